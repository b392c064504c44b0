#!/usr/bin/env python3
"""``bm run --ray --replicas N`` against one ``bm run`` process on the same prompts, alternated in one
sitting, every figure from this run.

    python benchmarks/ray_replicas.py [--lines 256] [--input-len 128] [--output-len 32] [--replicas 2]
        [--rounds 2] [--model-config configs/models/bench-llama-15m.json] [--block-lines 32]

Both are run as a user runs them, as commands (``python -m bm run ...``), on a synthetic file of
``--lines`` token-id prompts run to their full length (``--ignore-eos``). A local Ray cluster with the
machine's CPUs is started once here and each ``--ray`` run joins it (``RAY_ADDRESS``), so starting Ray
is not counted, but starting the replicas (each loads the model) is. Reported per run: the command's
wall time, ``summary.json``'s ``wall_time_s`` and output tok/s; then the medians and the ratio
replicas / one process on wall time. The records of both are checked equal (the same ``--seed``).
Prints one JSON object; progress goes to stderr.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent


def log(text: str) -> None:
    print(text, file=sys.stderr, flush=True)


def write_prompts(path: Path, lines: int, input_len: int, output_len: int, vocab: int) -> Path:
    rng = random.Random(0)
    with path.open("w") as f:
        for _ in range(lines):
            ids = [rng.randrange(3, vocab) for _ in range(input_len)]
            f.write(json.dumps({"input_ids": ids, "max_tokens": output_len}) + "\n")
    return path


def run_once(args: argparse.Namespace, prompts: Path, out: Path, ray: bool, env: dict[str, str]) -> dict:
    command = [sys.executable, "-m", "bm", "run", str(prompts), "-o", str(out), "-q", "--ignore-eos"]
    command += ["--seed", "1", "--model-config", args.model_config, "--set", "model.device=cpu"]
    if ray:
        command += ["--ray", "--replicas", str(args.replicas), "--block-lines", str(args.block_lines)]
    started = time.perf_counter()
    done = subprocess.run(command, env=env, capture_output=True, text=True, check=False)
    wall = time.perf_counter() - started
    if done.returncode != 0:
        raise SystemExit(f"{' '.join(command)} failed:\n{done.stdout[-2000:]}\n{done.stderr[-2000:]}")
    summary = json.loads((out / "summary.json").read_text())
    return {
        "mode": f"--ray --replicas {args.replicas}" if ray else "one process",
        "command_wall_s": round(wall, 2),
        "run_wall_s": round(summary["wall_time_s"], 2),
        "output_tokens_per_s": round(summary["output_tokens_per_s"], 1),
        "num_output_tokens": summary["num_output_tokens"],
    }


def records(out: Path) -> dict[int, list[int]]:
    rows = [json.loads(line) for line in (out / "outputs.jsonl").read_text().splitlines()]
    return {r["index"]: r["output_ids"] for r in rows}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--lines", type=int, default=256)
    parser.add_argument("--input-len", type=int, default=128)
    parser.add_argument("--output-len", type=int, default=32)
    parser.add_argument("--replicas", type=int, default=2)
    parser.add_argument("--block-lines", type=int, default=32)
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--model-config", default=str(REPO / "configs" / "models" / "bench-llama-15m.json"))
    args = parser.parse_args()
    import ray

    vocab = json.loads(Path(args.model_config).read_text())["vocab_size"]
    ray.init(include_dashboard=False, logging_level="error")
    env = {**os.environ, "PYTHONPATH": str(REPO), "RAY_ADDRESS": ray.get_runtime_context().gcs_address}
    runs, outputs = [], {}
    with tempfile.TemporaryDirectory(prefix="bm-ray-bench-") as tmp:
        prompts = write_prompts(Path(tmp) / "p.jsonl", args.lines, args.input_len, args.output_len, vocab)
        for round_ in range(args.rounds):
            for ray_mode in (False, True):  # alternated, so a change in the machine's load hits both
                out = Path(tmp) / f"out-{round_}-{int(ray_mode)}"
                result = run_once(args, prompts, out, ray_mode, env)
                log(json.dumps(result))
                runs.append(result)
                outputs.setdefault(result["mode"], records(out))
    ray.shutdown()
    modes = list(dict.fromkeys(r["mode"] for r in runs))
    medians = {
        mode: {
            key: statistics.median(r[key] for r in runs if r["mode"] == mode)
            for key in ("command_wall_s", "run_wall_s", "output_tokens_per_s")
        }
        for mode in modes
    }
    one, many = (medians[m] for m in modes)
    print(
        json.dumps(
            {
                "workload": {
                    k: getattr(args, k) for k in ("lines", "input_len", "output_len", "model_config")
                },
                "cpus": os.cpu_count(),
                "load_average": os.getloadavg(),
                "runs": runs,
                "medians": medians,
                "replicas_over_one_process_command_wall": round(
                    many["command_wall_s"] / one["command_wall_s"], 3
                ),
                "replicas_over_one_process_output_tok_s": round(
                    many["output_tokens_per_s"] / one["output_tokens_per_s"], 3
                ),
                "records_equal": len({json.dumps(v, sort_keys=True) for v in outputs.values()}) == 1,
            },
            indent=2,
        )
    )


if __name__ == "__main__":
    main()
