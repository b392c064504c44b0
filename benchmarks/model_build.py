#!/usr/bin/env python3
"""Seconds to build a random-weight model from a config: bm's way against the plain transformers way.

    python benchmarks/model_build.py [--model-config configs/models/smollm2-135m-shape.json]
                                     [--device cuda|cpu] [--dtype auto] [--old] [--new] [--runs 1]

``new``: :func:`bm.runtime.model_loader.random_model` (built on the meta device, each parameter drawn
once on ``--device``). ``old``: what bm did before, ``from_config`` under the seed on the CPU (every
parameter drawn twice there) then ``.to(device)``. ``--old`` or ``--new`` times only that way; neither
times both. Each figure is the best of ``--runs`` builds, the device synchronized before the clock stops.
Prints JSON with the parameter count and ``new_over_old`` when both ran.
"""

from __future__ import annotations

import argparse
import gc
import json
import time
from collections.abc import Callable
from pathlib import Path

import torch
from transformers import AutoConfig, AutoModelForCausalLM, PretrainedConfig

from bm.runtime.model_loader import random_model, resolve_device, resolve_dtype

DEFAULT_CONFIG = Path(__file__).resolve().parent.parent / "configs" / "models" / "smollm2-135m-shape.json"


def build_old(
    config: PretrainedConfig, dtype: torch.dtype, device: torch.device, seed: int
) -> torch.nn.Module:
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        model = AutoModelForCausalLM.from_config(config, dtype=dtype)
    return model.to(device)


def build_new(
    config: PretrainedConfig, dtype: torch.dtype, device: torch.device, seed: int
) -> torch.nn.Module:
    return random_model(config, dtype, device, seed)


def best_seconds(build: Callable[[], torch.nn.Module], device: torch.device, runs: int) -> tuple[float, int]:
    """The fastest of ``runs`` builds and the model's parameter count (tied ones once)."""
    best, count = float("inf"), 0
    for _ in range(runs):
        gc.collect()
        if device.type == "cuda":
            torch.cuda.empty_cache()
            torch.cuda.synchronize(device)
        start = time.perf_counter()
        model = build()
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        best = min(best, time.perf_counter() - start)
        count = sum(p.numel() for p in model.parameters())
        del model
    return best, count


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--model-config", type=Path, default=DEFAULT_CONFIG, help="model config JSON")
    p.add_argument("--device", default="auto", help="cuda when present, else cpu")
    p.add_argument("--dtype", default="auto", help="auto (bf16 on CUDA, float32 on CPU), float32, bfloat16")
    p.add_argument("--old", action="store_true", help="time the old way (alone unless --new too)")
    p.add_argument("--new", action="store_true", help="time the new way (alone unless --old too)")
    p.add_argument("--runs", type=int, default=1)
    p.add_argument("--seed", type=int, default=0)
    args = p.parse_args()
    device = resolve_device(args.device)
    dtype = resolve_dtype(args.dtype, device)
    config = AutoConfig.for_model(**json.loads(args.model_config.read_text()))
    ways = {"new": build_new, "old": build_old}
    chosen = [w for w in ways if getattr(args, w)] or list(ways)
    report: dict = {"model_config": str(args.model_config), "device": str(device), "dtype": str(dtype)}
    report["torch_threads"] = torch.get_num_threads()
    for way in chosen:
        seconds, count = best_seconds(
            lambda build=ways[way]: build(config, dtype, device, args.seed), device, args.runs
        )
        report[f"{way}_s"] = round(seconds, 3)
        report["parameters"] = count
    if len(chosen) == 2:
        report["new_over_old"] = round(report["new_s"] / report["old_s"], 3)
    print(json.dumps(report, indent=1))


if __name__ == "__main__":
    main()
