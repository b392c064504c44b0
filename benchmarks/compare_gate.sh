#!/usr/bin/env bash
# The baseline gate of `bm compare`, shown to hold its word on this machine: one saved baseline, then
# ten gated runs of the unchanged code (each must exit 0) and one with a planted 30% slowdown (every
# engine iteration 1.3x as long, benchmarks/planted_slowdown.py; it must exit 1).
#
#   benchmarks/compare_gate.sh [OUT_DIR]        # default bm-out/compare-gate; BM="python -m bm.cli.main"
#
# Prints each run's exit code and the gate's own account of its margins; exits 0 only when all ten
# unchanged runs passed and the slowed one failed.
set -u
OUT=${1:-bm-out/compare-gate}
BM=${BM:-python -m bm.cli.main}
PY=${PY:-python}
HERE=$(cd "$(dirname "$0")" && pwd)
WORKLOAD=(--dataset-kind synthetic --input-len 128 --output-len 128 --num-requests 64 --ignore-eos
          --schemes inflight_fused --quiet)
rm -rf "$OUT" && mkdir -p "$OUT"

$BM compare "${WORKLOAD[@]}" --repeat 10 -o "$OUT/base" > "$OUT/base.log" 2>&1 || { echo "baseline run failed"; cat "$OUT/base.log"; exit 2; }
echo "baseline: $OUT/base/compare.json (10 repeats)"

green=0
for i in $(seq 1 10); do
    $BM compare "${WORKLOAD[@]}" --baseline "$OUT/base/compare.json" -o "$OUT/same-$i" > "$OUT/same-$i.log" 2>&1
    rc=$?
    [ "$rc" = 0 ] && green=$((green + 1))
    echo "unchanged run $i: exit $rc; $(grep -o 'best of [0-9]* repeat(s).*margins used .*' "$OUT/same-$i.log" | sed 's/ may be.*margins used/, margins/')"
    grep -E '^(regression|note):' "$OUT/same-$i.log"
done

$PY "$HERE/planted_slowdown.py" 0.3 compare "${WORKLOAD[@]}" --baseline "$OUT/base/compare.json" -o "$OUT/slowed" > "$OUT/slowed.log" 2>&1
red=$?
echo "planted 30% slowdown: exit $red; $(grep -o 'best of [0-9]* repeat(s).*margins used .*' "$OUT/slowed.log" | sed 's/ may be.*margins used/, margins/')"
grep -E '^(regression|note):' "$OUT/slowed.log"

echo "unchanged: $green/10 passed; slowed: exit $red (1 expected)"
[ "$green" = 10 ] && [ "$red" = 1 ]
