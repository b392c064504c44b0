#!/usr/bin/env python3
"""The simulator beside a published measurement: NVIDIA NIM's Llama-3.3-70B-Instruct figures.

    python benchmarks/sim_published.py

Source: NVIDIA NIM LLM benchmarking, "Performance", version 1.0.0 of the docs
(https://docs.nvidia.com/nim/benchmarking/llm/1.0.0/performance), table "Llama-3.3-70b-instruct Results,
Version 1.8.0, 2 x H100 80G, fp8 TP2, 5000 Input Tokens / 500 Output Tokens", row concurrency 1:
TTFT 406.77 ms, ITL 18.58 ms. The same shape is simulated here (h100-sxm, tensor parallel 2, fp8 weights
and KV, 5,000-token prompts, 500 output tokens, one request in flight) with bm's default engine settings
and chunked context, and printed with the sim's relative error as JSON.
"""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path

from bm.bench import run_bench
from bm.bench.simulated import load_sim_model
from bm.config import load_config
from bm.workloads import load_workload

PUBLISHED = {"median_ttft_ms": 406.77, "mean_itl_ms": 18.58}
SOURCE = (
    "https://docs.nvidia.com/nim/benchmarking/llm/1.0.0/performance — Llama-3.3-70b-instruct, NIM 1.8.0, "
    "2 x H100 80G, fp8 TP2, 5000 input / 500 output tokens, concurrency 1"
)


def main() -> None:
    root = Path(__file__).resolve().parent.parent
    config = load_config(
        None,
        {
            "engine.executor": "sim",
            "sim.hardware": "h100-sxm",
            "sim.tensor_parallel": 2,
            "model.config": str(root / "configs" / "models" / "llama-3.3-70b.json"),
            "engine.enable_chunked_context": True,
            "engine.max_num_tokens": 8192,
            "bench.dataset_kind": "synthetic",
            "bench.input_len": 5000,
            "bench.output_len": 500,
            "bench.num_requests": 8,
            "bench.max_concurrency": 1,
        },
    )
    model = dataclasses.replace(load_sim_model(config), dtype="fp8")  # NIM ran fp8
    workload = load_workload(config.bench, vocab_size=model.vocab_size, encode=None)
    metrics = run_bench(config, model, workload).metrics
    sim = {k: metrics[k] for k in PUBLISHED}
    print(
        json.dumps(
            {
                "source": SOURCE,
                "published": PUBLISHED,
                "sim": sim,
                "error": {k: (sim[k] - v) / v for k, v in PUBLISHED.items()},
                "sim_output_throughput": metrics["output_throughput"],
            },
            indent=2,
        )
    )


if __name__ == "__main__":
    main()
