"""Peak RSS of `bm run` over many one-token requests on the embedded tiny model: memory must not grow with
the prompts file (issue: a 200,000-line file peaked at 1.17 GB, about 5.5 KB held per line).

Each size runs as its own `bm run` process; its peak RSS is read from the kernel (ru_maxrss of the
finished child). Prints JSON: lines, peak RSS (MiB), wall time per size, and the ratio of the largest to
the smallest peak (goal: at most 1.2).

``--format openai`` writes the same requests as an OpenAI batch file (``/v1/completions`` lines), whose
``batch_output.jsonl`` streams too.

Usage: python benchmarks/run_memory.py [--sizes 20000,200000] [--format bm|openai] [--keep DIR]
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path


def peak_rss_mib(command: list[str], env: dict[str, str]) -> tuple[float, float]:
    """(peak RSS in MiB, wall seconds) of one child process, alone: a fork server runs it, so the
    maximum is that child's and not an earlier one's."""
    probe = (
        "import resource, subprocess, sys, time; t = time.perf_counter(); "
        "rc = subprocess.run(sys.argv[1:], stdout=subprocess.DEVNULL).returncode; "
        "print(rc, resource.getrusage(resource.RUSAGE_CHILDREN).ru_maxrss, time.perf_counter() - t)"
    )
    out = subprocess.run([sys.executable, "-c", probe, *command], env=env, capture_output=True, text=True)
    rc, kib, wall = out.stdout.split()
    if rc != "0":
        raise RuntimeError(f"bm run exited {rc}: {out.stderr[-2000:]}")
    return int(kib) / 1024, float(wall)


def request_line(i: int, file_format: str) -> dict:
    """Request ``i``: a two-token prompt, one output token (the byte tokenizer reads "ab" as two)."""
    if file_format == "bm":
        return {"input_ids": [3 + i % 200, 7], "max_tokens": 1}
    body = {"prompt": chr(97 + i % 26) + "b", "max_tokens": 1}
    return {"custom_id": f"r{i}", "method": "POST", "url": "/v1/completions", "body": body}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--sizes", default="20000,200000")
    parser.add_argument("--format", choices=("bm", "openai"), default="bm")
    parser.add_argument("--keep", type=Path, help="write the prompt files and outputs here")
    args = parser.parse_args()
    sizes = [int(s) for s in args.sizes.split(",")]
    root = args.keep or Path(tempfile.mkdtemp(prefix="bm-rss-"))
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    rows = []
    for n in sizes:
        prompts = root / f"one-token-{n}.jsonl"
        with prompts.open("w") as f:
            for i in range(n):
                f.write(json.dumps(request_line(i, args.format)) + "\n")
        out = root / f"out-{n}"
        command = [sys.executable, "-m", "bm", "run", str(prompts), "-o", str(out), "--overwrite"]
        command += ["-q", "--ignore-eos", "--set", "model.device=cpu", "--set", "kv_cache.max_tokens=65536"]
        rss, wall = peak_rss_mib(command, env)
        records = sum(1 for _ in (out / "outputs.jsonl").open())
        assert records == n, f"{records} records for {n} lines"
        if args.format == "openai":
            answers = sum(1 for _ in (out / "batch_output.jsonl").open())
            assert answers == n, f"{answers} batch output lines for {n} lines"
        rows.append({"lines": n, "peak_rss_mib": round(rss, 1), "wall_s": round(wall, 1)})
    ratio = rows[-1]["peak_rss_mib"] / rows[0]["peak_rss_mib"]
    print(
        json.dumps(
            {
                "format": args.format,
                "runs": rows,
                "rss_ratio": round(ratio, 3),
                "goal": "<= 1.2",
                "met": ratio <= 1.2,
            },
            indent=2,
        )
    )


if __name__ == "__main__":
    main()
