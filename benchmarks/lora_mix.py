#!/usr/bin/env python3
"""Cost of serving four LoRA adapters mixed in one batch, against the base model on the same workload.

    python benchmarks/lora_mix.py --model-config configs/models/bench-llama-15m.json

The workload: ``--requests`` random prompts of ``--prompt-min``..``--prompt-max`` tokens with
``--output-len`` output tokens, all submitted at t=0. The base run sends them plain; the mixed run gives
request i adapter ``i % --adapters`` (random rank-``--rank`` adapters on every attention and MLP
projection of every layer, in the seed's form), so every batch mixes all adapters in the same packed
forwards. Both runs use the same model, requests and order, in one process, alternated ``--repeats``
times after a warm-up; the best wall time of each is kept. Prints JSON: wall times, output tok/s, the
mixed/base time ratio of the best runs and of each repeat's adjacent pair.
"""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path

import torch

from bm.batch_manager import OfflineClient, torch_executor
from bm.config import load_config
from bm.engine import EngineLoop, Request
from bm.engine.requests.model_inputs import LORA_MODULE_NAMES
from bm.runtime import load_model
from bm.runtime.lora_adapters import find_lora_targets


def random_adapter(model: torch.nn.Module, rank: int, seed: int) -> tuple[list[list[int]], torch.Tensor]:
    """Seed-form config rows and weights for every LoRA module of every layer (rows padded to one width)."""
    g = torch.Generator().manual_seed(seed)
    targets = find_lora_targets(model)
    rows, widths = [], []
    for (module, layer), linear in sorted(targets.items()):
        rows.append([module, layer, rank])
        widths.append(rank * (linear.in_features + linear.out_features))
    weights = torch.randn(len(rows), max(widths), generator=g) * 0.02
    return rows, weights


def run(loaded, config, requests: list[Request]) -> tuple[float, int]:
    client = OfflineClient(requests)
    start = time.perf_counter()
    with EngineLoop(
        config, client.get_requests, client.send_response, executor=torch_executor(config, loaded)
    ):
        client.wait()
    elapsed = time.perf_counter() - start
    failed = [r for r in client.results.values() if r.error]
    if failed:
        raise SystemExit(f"{len(failed)} requests failed, e.g. {failed[0].error}")
    return elapsed, sum(len(r.output_ids) for r in client.results.values())


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--model-config", default="configs/models/bench-llama-15m.json")
    p.add_argument(
        "-c", "--config", type=Path, default=Path(__file__).parent.parent / "configs" / "bench.yaml"
    )
    p.add_argument("--requests", type=int, default=32)
    p.add_argument("--prompt-min", type=int, default=32)
    p.add_argument("--prompt-max", type=int, default=128)
    p.add_argument("--output-len", type=int, default=64)
    p.add_argument("--adapters", type=int, default=4)
    p.add_argument("--rank", type=int, default=8)
    p.add_argument("--repeats", type=int, default=3)
    args = p.parse_args()

    config = load_config(args.config, {"model.config": args.model_config, "model.path": None})
    loaded = load_model(config.model)
    g = torch.Generator().manual_seed(0)
    vocab = loaded.vocab_size
    workload = []
    for _ in range(args.requests):
        n = int(torch.randint(args.prompt_min, args.prompt_max + 1, (1,), generator=g))
        workload.append(torch.randint(3, vocab, (n,), generator=g).tolist())
    adapters = [random_adapter(loaded.model, args.rank, seed) for seed in range(args.adapters)]

    def base() -> list[Request]:
        return [Request(i, list(ids), args.output_len) for i, ids in enumerate(workload)]

    def mixed() -> list[Request]:
        out = []
        for i, ids in enumerate(workload):
            rows, weights = adapters[i % args.adapters]
            out.append(
                Request(
                    i,
                    list(ids),
                    args.output_len,
                    lora_task_id=1 + i % args.adapters,
                    lora_config=rows,
                    lora_weights=weights,
                )
            )
        return out

    run(loaded, config, base()[:4])  # warm-up
    run(loaded, config, mixed()[:4])
    times: dict[str, list[float]] = {"base": [], "mixed": []}
    tokens = {}
    for _ in range(args.repeats):
        for name, build in (("base", base), ("mixed", mixed)):
            elapsed, tokens[name] = run(loaded, config, build())
            times[name].append(elapsed)
    best = {k: min(v) for k, v in times.items()}
    report = {
        "workload": {k: v for k, v in vars(args).items() if k not in ("config", "model_config")},
        "adapted_layers": sorted({LORA_MODULE_NAMES[m] for m, _ in find_lora_targets(loaded.model)}),
        "device": str(loaded.device),
        "wall_s": {k: [round(t, 3) for t in v] for k, v in times.items()},
        "output_tok_per_s": {k: round(tokens[k] / best[k], 1) for k in best},
        "mixed/base_time": round(best["mixed"] / best["base"], 3),
        # each repeat's mixed run against the base run just before it: on a shared machine the best of
        # each can come from different moments, the pairs from the same one
        "mixed/base_time_per_repeat": [
            round(m / b, 3) for b, m in zip(times["base"], times["mixed"], strict=True)
        ],
    }
    print(json.dumps(report, indent=2))


if __name__ == "__main__":
    main()
