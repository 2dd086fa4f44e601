#!/usr/bin/env bash
# Runs the coverage-guided fuzz targets of fuzz/ (cargo-fuzz, libFuzzer) for a time each.
#
#   ./scripts/fuzz.sh [seconds] [target...]
#
# seconds defaults to 600 per target; the targets default to all of them (rule_file,
# paths, keys, client_ip). Targets run two at a time on a machine with two or more cores
# (FUZZ_JOBS=N to change that), each on one core. Each starts from its committed seeds
# (fuzz/seeds/<target>) plus what earlier runs kept (fuzz/corpus/<target>, not committed),
# with the dictionary fuzz/dicts/<target>.dict when there is one. Crash inputs go to
# fuzz/artifacts/<target>/, libFuzzer's output to fuzz/logs/<target>.log.
#
# Environment: FUZZ_JOBS (targets at once), FUZZ_ARGS (extra libFuzzer flags),
# CARGO_TARGET_DIR (default fuzz/target).
#
# Exits non-zero when a target finds anything (a crash, a timeout, out of memory).
set -euo pipefail
cd "$(dirname "$0")/.."

all_targets=(rule_file paths keys client_ip)
seconds="${1:-600}"
if ! [[ "$seconds" =~ ^[0-9]+$ ]] || [ "$seconds" -eq 0 ]; then
  echo "usage: $0 [seconds] [target...]   (targets: ${all_targets[*]})" >&2
  exit 2
fi
shift || true
targets=("$@")
if [ ${#targets[@]} -eq 0 ]; then targets=("${all_targets[@]}"); fi
for t in "${targets[@]}"; do
  if [ ! -f "fuzz/fuzz_targets/$t.rs" ]; then
    echo "error: no fuzz target \`$t\` (targets: ${all_targets[*]})" >&2
    exit 2
  fi
done

if ! command -v cargo >/dev/null 2>&1; then
  echo "error: cargo is not installed; install Rust from https://rustup.rs first" >&2
  exit 1
fi
if ! cargo +nightly --version >/dev/null 2>&1; then
  echo "error: cargo-fuzz needs a nightly toolchain (for the sanitizer and coverage flags);" >&2
  echo "       install one with: rustup toolchain install nightly" >&2
  exit 1
fi
if ! cargo fuzz --version >/dev/null 2>&1; then
  echo "==> installing cargo-fuzz"
  cargo install cargo-fuzz --locked
fi

cores=$(nproc 2>/dev/null || echo 1)
jobs="${FUZZ_JOBS:-$(( cores >= 2 ? 2 : 1 ))}"
export CARGO_TARGET_DIR="${CARGO_TARGET_DIR:-$PWD/fuzz/target}"

echo "==> building the fuzz targets (nightly, release with debug assertions)"
(cd fuzz && cargo +nightly fuzz build)

mkdir -p fuzz/logs
# Crash files present before this run are not findings of this run.
declare -A before
for t in "${targets[@]}"; do
  mkdir -p "fuzz/corpus/$t" "fuzz/artifacts/$t"
  cp -n fuzz/seeds/"$t"/* "fuzz/corpus/$t/" 2>/dev/null || true
  before[$t]=$(ls "fuzz/artifacts/$t" | sort | tr '\n' ' ')
done

run_target() {
  local t=$1
  local dict=()
  if [ -f "fuzz/dicts/$t.dict" ]; then dict=("-dict=dicts/$t.dict"); fi
  # shellcheck disable=SC2086
  (cd fuzz && cargo +nightly fuzz run "$t" "corpus/$t" -- \
    -max_total_time="$seconds" -timeout=10 -rss_limit_mb=2048 -print_final_stats=1 \
    "${dict[@]}" ${FUZZ_ARGS:-}) >"fuzz/logs/$t.log" 2>&1
}

echo "==> fuzzing ${targets[*]} for ${seconds}s each, $jobs at a time (logs: fuzz/logs/)"
declare -A status
pids=()
names=()
for t in "${targets[@]}"; do
  while [ "$(jobs -rp | wc -l)" -ge "$jobs" ]; do wait -n || true; done
  echo "    $(date +%H:%M:%S) start $t"
  run_target "$t" &
  pids+=($!)
  names+=("$t")
done
for i in "${!pids[@]}"; do
  if wait "${pids[$i]}"; then status[${names[$i]}]=0; else status[${names[$i]}]=$?; fi
done

echo
printf '%-10s %14s %9s %8s %8s  %s\n' target executions exec/s corpus "rss MB" result
found=0
for t in "${targets[@]}"; do
  log="fuzz/logs/$t.log"
  execs=$(grep -Eo 'stat::number_of_executed_units: *[0-9]+' "$log" | tail -n1 | awk '{print $NF}' || true)
  rate=$(grep -Eo 'stat::average_exec_per_sec: *[0-9]+' "$log" | tail -n1 | awk '{print $NF}' || true)
  rss=$(grep -Eo 'stat::peak_rss_mb: *[0-9]+' "$log" | tail -n1 | awk '{print $NF}' || true)
  corpus=$(ls "fuzz/corpus/$t" | wc -l)
  new=()
  for f in $(ls "fuzz/artifacts/$t" | sort); do
    case " ${before[$t]} " in *" $f "*) ;; *) new+=("fuzz/artifacts/$t/$f") ;; esac
  done
  if [ ${#new[@]} -gt 0 ] || [ "${status[$t]}" -ne 0 ]; then
    result="FOUND (exit ${status[$t]}) ${new[*]:-see $log}"
    found=1
  else
    result="nothing found"
  fi
  printf '%-10s %14s %9s %8s %8s  %s\n' "$t" "${execs:-?}" "${rate:-?}" "$corpus" "${rss:-?}" "$result"
done
if [ "$found" -ne 0 ]; then
  echo
  echo "A target found an input that breaks a property: replay it with"
  echo "  cargo +nightly fuzz run <target> <file>   (in fuzz/)"
  echo "and keep it under fuzz/regressions/<target>/ so that tests/core/fuzz_regressions.rs replays it."
  exit 1
fi
