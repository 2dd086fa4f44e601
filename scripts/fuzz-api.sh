#!/usr/bin/env bash
# Property-based fuzzing of the rate-limit service's HTTP API with schemathesis (from PyPI),
# against a live `fluxgate-server` (Redis buckets, Redis rule store, admin token) and the
# OpenAPI document it serves: no 5xx, no answer the document does not allow, on every
# endpoint. Called by scripts/test.sh after the tests, which build the server binary.
#
# The rule set endpoints are fuzzed with every check but `positive_data_acceptance`: a
# rule set that matches the schema's outline can still be refused as rules (duplicate rule
# ids, a band the limiter cannot decide), with the documented 400.
set -euo pipefail
cd "$(dirname "$0")/.."

target="${CARGO_TARGET_DIR:-target}"
server="$target/debug/fluxgate-server"
[ -x "$server" ] || cargo build -p fluxgate-server --locked --quiet

if ! python3 -m venv --help >/dev/null 2>&1; then
  echo "installing python3 and python3-venv (Debian packages) for schemathesis"
  sudo_cmd=""
  if [ "$(id -u)" -ne 0 ]; then sudo_cmd="sudo"; fi
  $sudo_cmd apt-get update -qq
  DEBIAN_FRONTEND=noninteractive $sudo_cmd apt-get install -y -qq python3 python3-venv >/dev/null
fi
venv="$target/schemathesis-venv"
if [ ! -x "$venv/bin/schemathesis" ]; then
  python3 -m venv "$venv"
  "$venv/bin/pip" install --quiet "schemathesis==4.32.5"
fi

work=$(mktemp -d)
pids=()
cleanup() {
  for pid in "${pids[@]}"; do kill "$pid" 2>/dev/null || true; done
  rm -rf "$work"
}
trap cleanup EXIT
free_port() { python3 -c 'import socket; s = socket.socket(); s.bind(("127.0.0.1", 0)); print(s.getsockname()[1])'; }

redis_port=$(free_port)
redis-server --port "$redis_port" --bind 127.0.0.1 --save "" --appendonly no --dir "$work" >/dev/null 2>&1 &
pids+=($!)
for _ in $(seq 100); do redis-cli -p "$redis_port" ping >/dev/null 2>&1 && break; sleep 0.05; done
redis-cli -p "$redis_port" SET '{fluxgate:rules}:set:api' \
  '{"id":"api","rules":[{"id":"per-ip","bands":[{"capacity":1000,"window":"1m"}]}]}' >/dev/null
redis-cli -p "$redis_port" SADD '{fluxgate:rules}:index' api >/dev/null

port=$(free_port)
token="fuzz-token-$(date +%s%N)"
cat > "$work/server.toml" <<TOML
listen = "127.0.0.1:$port"
redis = "redis://127.0.0.1:$redis_port"
[store]
enabled = true
allow_empty = true
[admin]
token = "$token"
TOML
"$server" --config "$work/server.toml" 2>"$work/server.log" &
pids+=($!)
for _ in $(seq 200); do
  (exec 3<>"/dev/tcp/127.0.0.1/$port") 2>/dev/null && break
  sleep 0.05
done

venv=$(cd "$venv" && pwd)
st() {
  # From the scratch directory: schemathesis keeps its cache in the working directory.
  (cd "$work" && "$venv/bin/schemathesis" run "http://127.0.0.1:$port/openapi.json" \
    --header "Authorization: Bearer $token" --max-examples 100 --seed 1 --no-color "$@")
}
status=0
st --checks all --exclude-path-regex '^/api/rulesets' || status=1
st --checks all --exclude-checks positive_data_acceptance --include-path-regex '^/api/rulesets' || status=1
if grep -q "panicked" "$work/server.log"; then
  echo "the server panicked:" >&2
  grep -A5 "panicked" "$work/server.log" >&2
  status=1
fi
exit $status
