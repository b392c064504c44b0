#!/usr/bin/env bash
# The baseline gate of `bm compare`, shown to hold its word on this machine: one saved baseline, then
# RUNS gated runs of the unchanged code (each must exit EXPECT, 0 by default) alternated with RUNS runs
# with a planted slowdown (every engine iteration 1 + PLANTED as long, benchmarks/planted_slowdown.py;
# each must exit 1).
#
#   benchmarks/compare_gate.sh [OUT_DIR]        # default bm-out/compare-gate; BM="python -m bm"
#   LOAD_CMD="..." benchmarks/compare_gate.sh   # the gated runs with that command running beside them
#   RUNS=3 PLANTED= EXPECT=4 LOAD_CMD="..." ... # three unchanged runs that must end "not judged" (exit 4)
#
# The gate is paired (docs/compare.md): each gated run starts the baseline's bm as a worker
# (--baseline-cmd "$BM", the same installation, since the code is unchanged) and alternates its runs with
# its own, run by run. The planted slowdown is patched into the gated process only, so it lands on this
# side of every pair and never on the baseline's: what a slower commit does in CI. PAIRED=0 gates on the
# saved timings instead; TIME_LIMIT sets --time-limit (default bm's, 300 s).
#
# The baseline is saved first, alone; LOAD_CMD (any shell command, e.g. a test suite or a busy loop) then
# runs in the background through the gated runs and is stopped after. 256 requests of 128/128 tokens: a
# run lasts 1-2 s on a quiet 2-core machine.
#
# Prints each run's exit code, duration, the load average when it started, and the gate's own account
# (rounds, how timings were judged, the output throughput's median ratio and its bounds); exits 0 only
# when every unchanged run gave EXPECT and every slowed run failed.
set -u
OUT=${1:-bm-out/compare-gate}
BM=${BM:-python -m bm}
PY=${PY:-python}
RUNS=${RUNS:-10}
PLANTED=${PLANTED-0.3}
EXPECT=${EXPECT:-0}
HERE=$(cd "$(dirname "$0")" && pwd)
WORKLOAD=(--dataset-kind synthetic --input-len 128 --output-len 128 --num-requests 256 --ignore-eos
          --schemes inflight_fused --quiet)
GATE=()
[ "${PAIRED:-1}" = 1 ] && GATE+=(--baseline-cmd "$BM")
[ -n "${TIME_LIMIT:-}" ] && GATE+=(--time-limit "$TIME_LIMIT")
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

account() {  # the gate's verdict from a run's compare.json, in one line
    $PY - "$1" <<'EOF'
import json, sys
try:
    doc = json.load(open(sys.argv[1]))
except OSError:
    sys.exit(print("no compare.json"))
gate = doc.get("baseline") or {}
checks = gate.get("timing_checks", [])
tp = next((c for c in checks if c["metric"] == "output_throughput"), None)
ratio = "" if tp is None else f"; output tok/s {tp['worse_by']:+.1%} worse" + (
    f" (bounds {tp['low']:+.1%} to {tp['high']:+.1%})" if tp.get("pairs") else "")
print(f"{doc['repeat']} round(s), timings {gate.get('timings_from')}, {sum(c['judged'] for c in checks)}/"
      f"{len(checks)} judged, {len(gate.get('regressions', []))} regression(s)"
      f"{', time limit reached' if doc.get('timed_out') else ''}{ratio}")
EOF
}

gated() {  # NAME PREFIX...: one gated run, timed, with the load average at its start
    local name=$1; shift
    local load start rc
    load=$(cut -d' ' -f1 /proc/loadavg)
    start=$(date +%s.%N)
    "$@" compare "${WORKLOAD[@]}" --baseline "$OUT/base/compare.json" "${GATE[@]}" -o "$OUT/$name" > "$OUT/$name.log" 2>&1
    rc=$?
    printf '%-10s exit %s in %5.0f s, load %s at start; %s\n' "$name" "$rc" \
        "$(awk "BEGIN {print $(date +%s.%N) - $start}")" "$load" "$(account "$OUT/$name/compare.json")"
    grep -E '^regression:' "$OUT/$name.log" | head -2
    return "$rc"
}

same=0 red=0
for i in $(seq 1 "$RUNS"); do
    gated "same-$i" $BM; [ "$?" = "$EXPECT" ] && same=$((same + 1))
    if [ -n "$PLANTED" ]; then
        gated "slowed-$i" $PY "$HERE/planted_slowdown.py" "$PLANTED"; [ "$?" = 1 ] && red=$((red + 1))
    fi
done

[ -n "$LOAD_PID" ] && kill -- -"$LOAD_PID" 2>/dev/null && LOAD_PID=
echo "unchanged: $same/$RUNS gave exit $EXPECT; slowed by ${PLANTED:-nothing}: $red/$RUNS exit 1"
[ "$same" = "$RUNS" ] && { [ -z "$PLANTED" ] || [ "$red" = "$RUNS" ]; }
