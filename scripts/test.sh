#!/usr/bin/env bash
# Runs the whole test suite: formatting, lints, docs, unit, integration and doc tests (the Redis
# ones against real redis-server processes the tests start on free loopback ports), and the
# packaging check of every publishable crate. Installs redis-server when it is missing.
# The MongoDB rule source's live test runs only when FLUXGATE_TEST_MONGO_URL names a MongoDB
# server (no MongoDB server package exists in Debian's archive); its other tests need none.
set -euo pipefail
cd "$(dirname "$0")/.."

step() { printf '\n==> %s\n' "$*"; }

if ! command -v cargo >/dev/null 2>&1; then
  echo "error: cargo is not installed; install Rust from https://rustup.rs first" >&2
  exit 1
fi

# The Redis tests start their own redis-server processes; install the server when missing.
if ! command -v redis-server >/dev/null 2>&1 || ! command -v redis-cli >/dev/null 2>&1; then
  step "installing redis-server, redis-tools and redis-sentinel (Debian packages)"
  sudo_cmd=""
  if [ "$(id -u)" -ne 0 ]; then sudo_cmd="sudo"; fi
  $sudo_cmd apt-get update -qq
  DEBIAN_FRONTEND=noninteractive $sudo_cmd apt-get install -y -qq redis-server redis-tools redis-sentinel >/dev/null
fi
echo "redis-server: $(redis-server --version)"
if [ -n "${FLUXGATE_TEST_MONGO_URL:-}" ]; then
  echo "MongoDB live test: against FLUXGATE_TEST_MONGO_URL"
else
  echo "MongoDB live test: not run (FLUXGATE_TEST_MONGO_URL is not set)"
fi

step "cargo fmt --check"
cargo fmt --all -- --check

step "cargo clippy (all targets, warnings are errors)"
cargo clippy --workspace --all-targets --locked -- -D warnings

step "cargo doc (every crate, warnings are errors)"
RUSTDOCFLAGS="-D warnings" cargo doc --no-deps --workspace --locked --quiet

step "cargo test (unit, integration and doc tests)"
log=$(mktemp)
trap 'rm -f "$log"' EXIT
cargo test --workspace --locked 2>&1 | tee "$log"
passed=$(grep -Eo '^test result: [A-Za-z]+\. [0-9]+ passed' "$log" | awk '{s += $4} END {print s + 0}')
failed=$(grep -Eo '; [0-9]+ failed' "$log" | awk '{s += $2} END {print s + 0}')

step "API fuzzing: schemathesis against a live fluxgate-server and its OpenAPI document"
./scripts/fuzz-api.sh

step "cargo package (every publishable crate, built from its packaged sources)"
# cargo treats the packaged, not yet published workspace crates like registry crates: it
# neither unpacks nor rebuilds them again while their version stays the same. Build them
# in a target directory of their own, without their earlier unpacked sources and builds.
pkg_target="${CARGO_TARGET_DIR:-target}/package-check"
rm -rf "${CARGO_HOME:-$HOME/.cargo}"/registry/src/-*/fluxgate-* "${CARGO_HOME:-$HOME/.cargo}"/registry/cache/-*/fluxgate-*
rm -rf "$pkg_target"/package "$pkg_target"/debug/.fingerprint/fluxgate-* "$pkg_target"/debug/deps/*fluxgate*
CARGO_TARGET_DIR="$pkg_target" cargo package --workspace --locked --allow-dirty --quiet
echo "packaged: $(ls "$pkg_target"/package/*.crate | xargs -n1 basename | tr '\n' ' ')"

echo
echo "tests: $passed passed, $failed failed"
