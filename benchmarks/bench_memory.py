"""RSS of a long `bm bench` over its run: memory must not grow with the run's length (issue 53: the full
Azure conversation trace through the simulator rose from 1,245 to 2,424 MB over 511,872 iterations).

Runs the command in a subprocess and samples, every ``--every`` seconds, its resident memory (VmRSS and
its high-water mark VmHWM from ``/proc/PID/status``; psutil is not a dependency) and how far the run
is (the ``Iteration Counter`` of the last whole line of ``OUT/stats.jsonl``, which bench streams as it
goes). Prints JSON: the samples, the RSS at the first sample past 10% of the run's iterations and at the
end of the replay, the highest RSS from the 10% sample on (results included), its ratio to the 10%
figure (goal: at most 1.1), and the peak.

Usage (from the repository root)::

    python benchmarks/bench_memory.py TRACE.csv [--bm .venv/bin/bm] [--out DIR] [--every 0.5]
        [-- extra bm bench flags]

By default the run is the docs' simulator run of the whole trace (docs/sim.md, "Speed"): ``--executor
sim --hardware h100-sxm --model-config configs/models/llama-3.1-8b.json --trace-timestamps``.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
SIM_FLAGS = [
    "--executor", "sim", "--hardware", "h100-sxm",
    "--model-config", str(ROOT / "configs" / "models" / "llama-3.1-8b.json"), "--trace-timestamps",
]  # fmt: skip


def status_kib(pid: int) -> dict[str, int]:
    """VmRSS and VmHWM of ``pid`` in KiB (empty once the process is gone)."""
    out = {}
    try:
        with open(f"/proc/{pid}/status", encoding="ascii") as f:
            for line in f:
                key, _, value = line.partition(":")
                if key in ("VmRSS", "VmHWM"):
                    out[key] = int(value.split()[0])
    except (FileNotFoundError, ProcessLookupError):
        pass
    return out


def last_iteration(stats: Path, tail: int = 1 << 16) -> int | None:
    """The ``Iteration Counter`` of the last complete line of ``stats`` (None before the first)."""
    try:
        with stats.open("rb") as f:
            size = f.seek(0, os.SEEK_END)
            f.seek(max(0, size - tail))
            lines = f.read().split(b"\n")[:-1]  # the last piece is unterminated (or empty)
    except FileNotFoundError:
        return None
    for line in reversed(lines):
        try:
            return int(json.loads(line)["Iteration Counter"])
        except (ValueError, KeyError):
            continue
    return None


def sample_run(command: list[str], stats: Path, every_s: float) -> tuple[int, list[dict]]:
    """Run ``command``, sampling its RSS and iteration counter; returns (exit code, samples)."""
    start = time.perf_counter()
    proc = subprocess.Popen(command, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
    samples = []
    while proc.poll() is None:
        kib = status_kib(proc.pid)
        if kib:
            samples.append(
                {
                    "t_s": round(time.perf_counter() - start, 2),
                    "iteration": last_iteration(stats),
                    "rss_mb": round(kib.get("VmRSS", 0) / 1024, 1),
                    "hwm_mb": round(kib.get("VmHWM", 0) / 1024, 1),
                }
            )
        time.sleep(every_s)
    err = proc.stderr.read() if proc.stderr else ""
    if proc.returncode:
        print(err[-3000:], file=sys.stderr)
    return proc.returncode, samples


def summarize(samples: list[dict], num_iterations: int) -> dict:
    """RSS at the first sample at or past 10% of the iterations and at the replay's end (the first sample
    that saw the last iteration; the results are computed and written after it), the highest RSS from
    the 10% sample to the process's exit (the kernel's high-water mark, when it rose after that sample,
    else the highest sample), their ratios to the 10% figure, and the whole run's peak."""
    counted = [s for s in samples if s["iteration"] is not None]
    tenth = next((s for s in counted if s["iteration"] >= num_iterations / 10), None)
    end = next((s for s in counted if s["iteration"] >= num_iterations), counted[-1] if counted else None)
    out: dict = {"peak_rss_mb": max((s["hwm_mb"] for s in samples), default=None)}
    if tenth is None or end is None:
        return out
    later = [s for s in samples if s["t_s"] >= tenth["t_s"]]
    highest = max(s["rss_mb"] for s in later)
    if out["peak_rss_mb"] > tenth["hwm_mb"]:  # the high-water mark rose after the 10% sample
        highest = max(highest, out["peak_rss_mb"])
    out |= {
        "iteration_at_10pct": tenth["iteration"],
        "rss_at_10pct_mb": tenth["rss_mb"],
        "iteration_at_end": end["iteration"],
        "rss_at_end_mb": end["rss_mb"],
        "max_rss_from_10pct_on_mb": highest,
        "ratio_end_to_10pct": round(end["rss_mb"] / tenth["rss_mb"], 3),
        "ratio_max_to_10pct": round(highest / tenth["rss_mb"], 3),
    }
    out["flat_within_10pct"] = out["ratio_max_to_10pct"] <= 1.1
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("dataset")
    parser.add_argument("--bm", default=str(ROOT / ".venv" / "bin" / "bm"), help="the bm executable")
    parser.add_argument("--out", type=Path, help="bench output directory (default: a temporary one)")
    parser.add_argument("--every", type=float, default=0.5, help="seconds between samples")
    parser.add_argument("extra", nargs="*", help="more bm bench flags (after --)")
    args = parser.parse_args()
    out = args.out or Path(tempfile.mkdtemp(prefix="bm-bench-mem-")) / "out"
    if out.exists():  # an earlier run's stats.jsonl would be read as this run's progress
        parser.error(f"--out {out}: exists; give a new directory")
    command = [args.bm, "bench", args.dataset, *SIM_FLAGS, "-q", "-o", str(out), "--overwrite", *args.extra]
    started = time.perf_counter()
    code, samples = sample_run(command, out / "stats.jsonl", args.every)
    wall = time.perf_counter() - started
    results = json.loads((out / "results.json").read_text()) if (out / "results.json").exists() else {}
    num_iterations = results.get("num_iterations") or max(
        (s["iteration"] for s in samples if s["iteration"] is not None), default=0
    )
    report = {
        "command": command,
        "exit_code": code,
        "wall_s": round(wall, 1),
        "num_iterations": num_iterations,
        "num_requests": results.get("num_requests"),
        **summarize(samples, num_iterations),
        "goal": "from 10% of the iterations to the process's exit, RSS within 10% of its value at 10%",
        "samples": samples,
    }
    print(json.dumps(report, indent=1))


if __name__ == "__main__":
    main()
