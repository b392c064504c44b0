#!/usr/bin/env bash
# The baseline gate of `bm compare`, shown to hold its word on this machine: one saved baseline, then
# ten gated runs of the unchanged code (each must exit 0) and one with a planted 30% slowdown (every
# engine iteration 1.3x as long, benchmarks/planted_slowdown.py; it must exit 1).
#
#   benchmarks/compare_gate.sh [OUT_DIR]        # default bm-out/compare-gate; BM="python -m bm"
#   LOAD_CMD="..." benchmarks/compare_gate.sh   # the gated runs with that command running beside them
#
# The baseline is saved first, alone; LOAD_CMD (any shell command, e.g. a test suite or an on/off busy
# loop) then runs in the background through the eleven gated runs and is stopped after. 256 requests of
# 128/128 tokens: a repeat lasts 1-2 s on a quiet 2-core machine, long enough for the gate's load meter
# (kernel ticks, 100 a second per CPU) to tell a quiet repeat from a shared one.
#
# Prints each run's exit code and the gate's own account of its margins; exits 0 only when all ten
# unchanged runs passed and the slowed one failed.
set -u
OUT=${1:-bm-out/compare-gate}
BM=${BM:-python -m bm}
PY=${PY:-python}
HERE=$(cd "$(dirname "$0")" && pwd)
WORKLOAD=(--dataset-kind synthetic --input-len 128 --output-len 128 --num-requests 256 --ignore-eos
          --schemes inflight_fused --quiet)
rm -rf "$OUT" && mkdir -p "$OUT"

$BM compare "${WORKLOAD[@]}" --repeat 10 -o "$OUT/base" > "$OUT/base.log" 2>&1 || { echo "baseline run failed"; cat "$OUT/base.log"; exit 2; }
echo "baseline: $OUT/base/compare.json (10 repeats)"
LOAD_PID=
if [ -n "${LOAD_CMD:-}" ]; then
    setsid bash -c "$LOAD_CMD" > "$OUT/load.log" 2>&1 &
    LOAD_PID=$!
    trap '[ -n "$LOAD_PID" ] && kill -- -"$LOAD_PID" 2>/dev/null' EXIT
    echo "load beside the gated runs: $LOAD_CMD"
fi

green=0
for i in $(seq 1 10); do
    $BM compare "${WORKLOAD[@]}" --baseline "$OUT/base/compare.json" -o "$OUT/same-$i" > "$OUT/same-$i.log" 2>&1
    rc=$?
    [ "$rc" = 0 ] && green=$((green + 1))
    echo "unchanged run $i: exit $rc; $(grep -o 'median over [0-9]* repeat(s).*margins used .*' "$OUT/same-$i.log" | sed 's/ may be.*margins used/, margins/')"
    grep -E '^(regression|note):' "$OUT/same-$i.log"
done

$PY "$HERE/planted_slowdown.py" 0.3 compare "${WORKLOAD[@]}" --baseline "$OUT/base/compare.json" -o "$OUT/slowed" > "$OUT/slowed.log" 2>&1
red=$?
echo "planted 30% slowdown: exit $red; $(grep -o 'median over [0-9]* repeat(s).*margins used .*' "$OUT/slowed.log" | sed 's/ may be.*margins used/, margins/')"
grep -E '^(regression|note):' "$OUT/slowed.log"

[ -n "$LOAD_PID" ] && kill -- -"$LOAD_PID" 2>/dev/null && LOAD_PID=
echo "unchanged: $green/10 passed; slowed: exit $red (1 expected)"
[ "$green" = 10 ] && [ "$red" = 1 ]
