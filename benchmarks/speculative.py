#!/usr/bin/env python3
"""Prompt-lookup (n-gram) speculation on a copy-heavy workload: output tok/s with and without, batch 1-8.

    python benchmarks/speculative.py --model-config configs/models/bench-llama-15m.json

The workload: for each request a random ``--span``-token text S, the model's own greedy continuation C
of S (``--output-len`` tokens, computed first), and the prompt ``S + C + S``: the model, reading S again,
tends to write C again, so the output repeats a span of the prompt (as in summarising, editing or
answering about a document). For each batch size in ``--batch-sizes``, that many requests run at t=0
with ``engine.max_batch_size`` set to it, once plain and once with ``engine.speculative: {method: ngram,
num_draft_tokens: K, max_ngram: N}``, in one process, best of ``--repeats``. Prints JSON: output tok/s of
each run, the speedup, the mean acceptance length (tokens per verifying step), acceptance rate, and
whether every output is identical.
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
from bm.runtime import load_model


def run(loaded, config, workload):
    requests = [Request(i, list(p), n) for i, (p, n) in enumerate(workload)]
    client = OfflineClient(requests)
    stats: list[str] = []
    start = time.perf_counter()
    with EngineLoop(
        config,
        client.get_requests,
        client.send_response,
        executor=torch_executor(config, loaded),
        return_stats=stats.append,
    ):
        client.wait()
    elapsed = time.perf_counter() - start
    results = [client.results[i] for i in range(len(workload))]
    failed = [r for r in results if r.error]
    if failed:
        raise SystemExit(f"{len(failed)} requests failed, e.g. {failed[0].error}")
    return elapsed, results


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--model-config", default="configs/models/bench-llama-15m.json")
    p.add_argument(
        "-c", "--config", type=Path, default=Path(__file__).parent.parent / "configs" / "bench.yaml"
    )
    p.add_argument("--batch-sizes", default="1,2,4,8")
    p.add_argument("--span", type=int, default=48)
    p.add_argument("--output-len", type=int, default=128)
    p.add_argument("--num-draft-tokens", type=int, default=6)
    p.add_argument("--max-ngram", type=int, default=3)
    p.add_argument("--repeats", type=int, default=2)
    args = p.parse_args()

    base = {"model.config": args.model_config, "model.path": None}
    plain = load_config(args.config, base)
    loaded = load_model(plain.model)
    sizes = [int(b) for b in args.batch_sizes.split(",")]
    g = torch.Generator().manual_seed(0)
    spans = [
        torch.randint(3, loaded.vocab_size, (args.span,), generator=g).tolist() for _ in range(max(sizes))
    ]
    _, continuations = run(loaded, plain, [(s, args.output_len) for s in spans])
    workload = [(s + c.output_ids + s, args.output_len) for s, c in zip(spans, continuations, strict=True)]

    report: dict = {"workload": {k: v for k, v in vars(args).items() if k not in ("config", "model_config")}}
    report["device"] = str(loaded.device)
    for size in sizes:
        batch = workload[:size]
        over = {"engine.max_batch_size": size}
        spec = {
            "method": "ngram",
            "num_draft_tokens": args.num_draft_tokens,
            "max_ngram": args.max_ngram,
        }
        configs = {
            "plain": load_config(args.config, base | over),
            "ngram": load_config(args.config, base | over | {"engine.speculative": spec}),
        }
        run(loaded, configs["plain"], batch[:1])  # warm-up
        best: dict[str, float] = {}
        outputs = {}
        for _ in range(args.repeats):
            for name, config in configs.items():
                elapsed, results = run(loaded, config, batch)
                best[name] = min(best.get(name, elapsed), elapsed)
                outputs[name] = results
        tokens = sum(len(r.output_ids) for r in outputs["plain"])
        spec_results = outputs["ngram"]
        steps = sum(r.num_draft_steps for r in spec_results)
        drafted = sum(r.num_draft_tokens for r in spec_results)
        accepted = sum(r.num_accepted_draft_tokens for r in spec_results)
        report[f"batch_{size}"] = {
            "output_tok_per_s": {k: round(tokens / v, 1) for k, v in best.items()},
            "speedup": round(best["plain"] / best["ngram"], 3),
            "mean_acceptance_length": round((accepted + steps) / steps, 3) if steps else 1.0,
            "acceptance_rate": round(accepted / drafted, 3) if drafted else 0.0,
            "identical_outputs": [r.output_ids for r in outputs["plain"]]
            == [r.output_ids for r in spec_results],
        }
        print(json.dumps({f"batch_{size}": report[f"batch_{size}"]}), flush=True)
    print(json.dumps(report, indent=2))


if __name__ == "__main__":
    main()
