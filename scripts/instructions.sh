#!/usr/bin/env bash
# Instructions per request, counted by valgrind's callgrind (stable on a shared machine).
#
# Each variant of benches/instructions.rs runs twice, with FEW and MANY requests after the
# same warm-up; (instructions(MANY) - instructions(FEW)) / (MANY - FEW) is the count per
# request, the median of REPEAT (default 3) such pairs: the counts move by a few percent from
# one process to the next (random hash keys place the buckets differently). With --annotate, the top functions of the MANY run are written to
# $OUT/<variant>.txt (inclusive counts, for a per-stage breakdown).
#
#   scripts/instructions.sh [--annotate] [variant...]
set -euo pipefail
cd "$(dirname "$0")/.."
annotate=0
if [[ "${1:-}" == --annotate ]]; then annotate=1; shift; fi
variants=("$@")
[[ ${#variants[@]} -gt 0 ]] || variants=(engine_1x1 engine_3x2 layer_bare layer_identity layer_fluxgate layer_fluxgate_legacy layer_governor)
FEW=${FEW:-2000}
MANY=${MANY:-22000}
REPEAT=${REPEAT:-3}
OUT=${OUT:-${CARGO_TARGET_DIR:-target}/instructions}
mkdir -p "$OUT"
command -v valgrind >/dev/null || { echo "valgrind is needed: apt-get install valgrind" >&2; exit 1; }
# Symbols for the annotation; the same optimizations as `cargo bench`.
if ! build=$(CARGO_PROFILE_BENCH_DEBUG=line-tables-only cargo bench --bench instructions --no-run --message-format=json); then
  echo "the benchmark did not build: cargo bench --bench instructions --no-run" >&2
  exit 1
fi
bin=$(python3 -c 'import json,sys
for l in sys.stdin:
    m=json.loads(l)
    if m.get("reason")=="compiler-artifact" and m["target"]["name"]=="instructions" and m.get("executable"): print(m["executable"])' <<<"$build")
[[ -n "$bin" ]] || { echo "no benchmark executable in the build's output" >&2; exit 1; }
count() {
  local variant=$1 n=$2 file="$OUT/$1.$2.out"
  valgrind --tool=callgrind --callgrind-out-file="$file" "$bin" "$variant" "$n" >/dev/null 2>"$OUT/$1.$2.log"
  grep -E '^(summary|totals):' "$file" | head -1 | awk '{print $2}'
}
printf '%-22s %14s\n' variant "instr/request"
for v in "${variants[@]}"; do
  runs=()
  for _ in $(seq "$REPEAT"); do
    few=$(count "$v" "$FEW"); many=$(count "$v" "$MANY")
    runs+=("$(awk -v a="$many" -v b="$few" -v n=$((MANY - FEW)) 'BEGIN { printf "%.3f", (a - b) / n }')")
  done
  median=$(printf '%s\n' "${runs[@]}" | sort -g | awk '{a[NR]=$1} END {print a[int((NR+1)/2)]}')
  printf '%-22s %14.0f\n' "$v" "$median"
  if [[ $annotate == 1 ]]; then
    callgrind_annotate --inclusive=yes "$OUT/$v.$MANY.out" > "$OUT/$v.full.txt" 2>/dev/null || true
    head -120 "$OUT/$v.full.txt" > "$OUT/$v.txt"
  fi
done
