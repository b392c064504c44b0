"""Signals at random moments of real commands: every one must end by itself within the documented bound
(bm/cli/interrupts.py, 60 s), and for ``bm run`` every resume must give exactly one record per line,
equal to an uninterrupted run's (issue 53's "Must show").

    python benchmarks/interrupt_soak.py run --trials 50            # 50 SIGINT + 50 SIGTERM
    python benchmarks/interrupt_soak.py run --trials 50 --busy 2   # the same beside two busy loops
    python benchmarks/interrupt_soak.py bench --trials 25
    python benchmarks/interrupt_soak.py ray --trials 10

Each trial starts the command, waits a uniformly random time in [0, the uninterrupted run's wall time]
(start-up included, so the model load is hit too), sends the signal and times the exit. For ``run`` and
``ray`` it then resumes and compares every record with the reference run (output ids and finish
reason, greedy and seeded sampled lines alike). Prints one JSON document: exit codes, exit times
(min, median, p90, p99, max), how many ended within the bound, how many resumes matched.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
MODEL = REPO / "configs" / "models" / "bench-llama-15m.json"
BOUND_S = 60.0


def write_prompts(path: Path, n: int, max_input: int, max_output: int, seed: int = 0) -> Path:
    """``n`` lines of token ids (the 15M model has no tokenizer); every third samples (temperature 0.8,
    seeded by the run seed), the rest greedy."""
    rng = random.Random(seed)
    with path.open("w") as f:
        for i in range(n):
            ids = [rng.randint(3, 8000) for _ in range(rng.randint(4, max_input))]
            line = {"id": f"s{i}", "input_ids": ids, "max_tokens": rng.randint(2, max_output)}
            if i % 3 == 0:
                line["temperature"] = 0.8
            f.write(json.dumps(line) + "\n")
    return path


def command(kind: str, prompts: Path, out: Path, resume: bool = False) -> list[str]:
    bm = [sys.executable, "-m", "bm"]
    common = ["--model-config", str(MODEL), "-o", str(out), "-q"]
    if kind == "bench":
        return [*bm, "bench", "--dataset-kind", "synthetic", "--num-requests", "400", "--input-len", "32",
                "--output-len", "16", *common, "--overwrite"]  # fmt: skip
    args = [*bm, "run", str(prompts), *common, "--seed", "7"]
    if kind == "ray":
        args += ["--ray", "--replicas", "2", "--replica-threads", "1", "--block-lines", "100"]
    return [*args, "--resume"] if resume else args


def env() -> dict[str, str]:
    return {**os.environ, "PYTHONPATH": str(REPO), "OMP_NUM_THREADS": "1", "HF_HUB_OFFLINE": "1"}


def run_to_end(args: list[str]) -> tuple[int, float, str]:
    started = time.monotonic()
    done = subprocess.run(args, env=env(), capture_output=True, text=True, cwd=REPO)
    return done.returncode, time.monotonic() - started, done.stdout + done.stderr


def records(out: Path) -> dict[int, tuple]:
    rows = [json.loads(line) for line in (out / "outputs.jsonl").read_text().splitlines()]
    by_index = {r["index"]: (r["output_ids"], r["finish_reason"]) for r in rows}
    assert len(by_index) == len(rows), "an index has two records"
    return by_index


def trial(kind: str, prompts: Path, work: Path, sig: int, delay: float, reference: dict | None) -> dict:
    out = work / f"out-{time.monotonic_ns()}"
    # the output goes to files, not pipes: Ray's processes inherit the driver's descriptors, and a pipe
    # stays open until the last of them exits, so timing the pipes' close timed the cluster's teardown
    # (one SIGINT under load 9.7 read 65.3 s that way), not the command's exit
    with tempfile.TemporaryFile("w+") as out_file, tempfile.TemporaryFile("w+") as err_file:
        proc = subprocess.Popen(command(kind, prompts, out), env=env(), cwd=REPO, stdout=out_file, stderr=err_file, text=True)  # fmt: skip
        time.sleep(delay)
        sent = time.monotonic()
        finished_first = proc.poll() is not None
        if not finished_first:
            proc.send_signal(sig)
        proc.wait()
        exit_s = time.monotonic() - sent
        out_file.seek(0)
        err_file.seek(0)
        stdout, stderr = out_file.read(), err_file.read()
    result = {
        "signal": signal.Signals(sig).name,
        "load_average": os.getloadavg()[0],
        "delay_s": round(delay, 2),
        "code": proc.returncode,
        "exit_s": round(exit_s, 3),
        "finished_before_the_signal": finished_first,
        "traceback": "Traceback" in stderr,
    }
    if proc.returncode == 130 and (out / "outputs.jsonl").exists():
        result["resume_command_printed"] = "--resume" in stdout
    if reference is not None:
        code, _wall, text = run_to_end(command(kind, prompts, out, resume=True))
        result["resume_code"] = code
        try:
            got = records(out)
            result["resume_matches"] = code == 0 and got == reference
            if not result["resume_matches"]:
                result["mismatch"] = [i for i in reference if got.get(i) != reference[i]][:5]
        except (OSError, ValueError, AssertionError) as exc:
            result["resume_matches"], result["error"] = False, f"{exc}: {text[-500:]}"
    elif kind == "bench":
        result["results_written"] = (out / "results.json").exists()
        # the journal creates stats.jsonl at the first iteration: a signal after it must still leave
        # results.json (one before it, during start-up, ends with nothing measured)
        result["replay_started"] = (out / "stats.jsonl").exists()
    subprocess.run(["rm", "-rf", str(out)])
    return result


def summarize(trials: list[dict]) -> dict:
    times = sorted(t["exit_s"] for t in trials if not t["finished_before_the_signal"])

    def q(p: float) -> float | None:
        return round(times[min(len(times) - 1, int(p * len(times)))], 3) if times else None

    loads = [t["load_average"] for t in trials]
    codes: dict[str, int] = {}
    for t in trials:
        codes[str(t["code"])] = codes.get(str(t["code"]), 0) + 1
    return {
        "trials": len(trials),
        "exit_codes": codes,  # a negative code: the signal itself ended it, before Python had started
        "load_average": {"min": min(loads, default=None), "max": max(loads, default=None)},
        "exit_s": {
            "min": q(0),
            "median": round(statistics.median(times), 3) if times else None,
            "p90": q(0.9),
            "p99": q(0.99),
            "max": q(1.0),
        },
        "within_bound": sum(t["exit_s"] <= BOUND_S for t in trials),
        "tracebacks": sum(t["traceback"] for t in trials),
        "resumes_matching": sum(bool(t.get("resume_matches")) for t in trials if "resume_code" in t),
        "resumes": sum("resume_code" in t for t in trials),
        "results_written": sum(bool(t.get("results_written")) for t in trials),
        "replay_started": sum(bool(t.get("replay_started")) for t in trials),
        "replay_started_without_results": sum(
            bool(t.get("replay_started")) and not t.get("results_written") for t in trials
        ),
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("kind", choices=["run", "bench", "ray"])
    parser.add_argument("--trials", type=int, default=10, help="per signal (SIGINT and SIGTERM)")
    parser.add_argument("--lines", type=int, default=2000)
    parser.add_argument("--max-input", type=int, default=40, help="prompt tokens, at most")
    parser.add_argument("--max-output", type=int, default=16, help="max_tokens, at most")
    parser.add_argument("--busy", type=int, default=0, help="busy loops beside the runs")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--trials-out", type=Path, default=None, help="also write every trial here")
    args = parser.parse_args()
    rng = random.Random(args.seed)
    busy = [subprocess.Popen([sys.executable, "-c", "while True: pass"]) for _ in range(args.busy)]
    try:
        with tempfile.TemporaryDirectory(prefix="bm-soak-") as tmp:
            work = Path(tmp)
            prompts = write_prompts(work / "prompts.jsonl", args.lines, args.max_input, args.max_output)
            ref_out = work / "reference"
            code, wall, text = run_to_end(command(args.kind, prompts, ref_out))
            if code != 0:
                raise SystemExit(f"the reference run failed ({code}): {text[-2000:]}")
            reference = None if args.kind == "bench" else records(ref_out)
            trials = []
            for i in range(2 * args.trials):
                sig = signal.SIGINT if i % 2 == 0 else signal.SIGTERM
                trials.append(trial(args.kind, prompts, work, sig, rng.uniform(0, wall), reference))
                print(json.dumps(trials[-1]), file=sys.stderr, flush=True)
    finally:
        for p in busy:
            p.kill()
    if args.trials_out is not None:
        args.trials_out.write_text("".join(json.dumps(t) + "\n" for t in trials))
    by_signal = {
        name: summarize([t for t in trials if t["signal"] == name]) for name in ("SIGINT", "SIGTERM")
    }
    document = {
        "kind": args.kind,
        "lines": args.lines if args.kind != "bench" else None,
        "prompt_tokens": [4, args.max_input],
        "max_tokens": [2, args.max_output],
        "busy_loops": args.busy,
        "bound_s": BOUND_S,
        "reference_wall_s": round(wall, 2),
        "all": summarize(trials),
        **by_signal,
    }
    print(json.dumps(document, indent=2))


if __name__ == "__main__":
    main()
