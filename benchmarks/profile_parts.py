#!/usr/bin/env python3
"""Where one engine run's time goes, by part: engine Python, GEMMs by shape, attention, elementwise, sampling.

    python benchmarks/profile_parts.py WORKLOAD.jsonl (--model-config CFG.json | --model DIR)
        [--limit N] [-c configs/bench.yaml] [-s SECTION.KEY=VALUE ...]

Runs the first ``--limit`` requests (all at t=0, end tokens ignored) through the engine core in this thread,
after a two-request warm-up, with a wall-clock timer around each part's entry point: every linear layer
(bm's packed GEMM, a quantized weight's kernel, or torch's), the attention call of each layer (KV write and kernel), the fused
elementwise kernels, sampling, the model forward and the engine step. Timers, not the torch profiler: bm's
C kernels run through ctypes, which the profiler cannot see, and a timer costs well under a microsecond
against calls of tens of microseconds. The compiled KV write is timed on its own. Derived: the engine's own Python per iteration (step minus forward
and sampling) and the forward's remainder (embedding, residual adds, metadata, torch's KV write where the compiled one is absent). GEMM efficiency is per
shape (rows bucketed, K x N), against the fp32 GEMM peak measured in the same run. Prints one JSON object.
"""

from __future__ import annotations

import argparse
import json
import time
from collections import defaultdict
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import torch
from common import add_model_arguments, log, model_overrides, read_workload, run_bm
from roofline import measure_gemm_peak

from bm.config import load_config
from bm.engine import EngineCore, Request
from bm.runtime import load_model
from bm.runtime.executor import TorchExecutor

ROW_BUCKETS = (1, 8, 32, 128, 512, 2048, 1 << 30)


class Timers:
    """Seconds and calls per part, and GEMM seconds and FLOPs per (row bucket, K, N)."""

    def __init__(self) -> None:
        self.seconds: dict[str, float] = defaultdict(float)
        self.calls: dict[str, int] = defaultdict(int)
        self.gemm: dict[tuple[str, int, int], list[float]] = defaultdict(lambda: [0, 0.0, 0.0])

    def add(self, part: str, seconds: float) -> None:
        self.seconds[part] += seconds
        self.calls[part] += 1

    def add_gemm(self, rows: int, k: int, n: int, seconds: float) -> None:
        high = next(b for b in ROW_BUCKETS if rows <= b)
        low = ROW_BUCKETS[ROW_BUCKETS.index(high) - 1] + 1 if high > 1 else 1
        entry = self.gemm[(f"{low}-{high}" if high < 1 << 30 else f">{low - 1}", k, n)]
        entry[0] += 1
        entry[1] += seconds
        entry[2] += 2.0 * rows * k * n
        self.add("gemm", seconds)


def _timed(timers: Timers, part: str, fn: Callable) -> Callable:
    def wrapper(*args: Any, **kwargs: Any) -> Any:
        start = time.perf_counter()
        try:
            return fn(*args, **kwargs)
        finally:
            timers.add(part, time.perf_counter() - start)

    return wrapper


def _timed_linear(timers: Timers, fn: Callable, module_of: Callable[[Any], torch.nn.Linear]) -> Callable:
    def wrapper(self: Any, x: torch.Tensor) -> torch.Tensor:
        start = time.perf_counter()
        out = fn(self, x)
        module = module_of(self)
        rows = x.numel() // module.in_features
        timers.add_gemm(rows, module.in_features, module.out_features, time.perf_counter() - start)
        return out

    return wrapper


def _timed_gated(timers: Timers, fn: Callable) -> Callable:
    """The fused MLP's gate/up pass, one kernel call timed as a GEMM of both projections' width."""

    def wrapper(self: Any, x: torch.Tensor, gate: torch.Tensor, up: torch.Tensor, n: int) -> torch.Tensor:
        start = time.perf_counter()
        out = fn(self, x, gate, up, n)
        timers.add_gemm(x.numel() // x.shape[-1], x.shape[-1], 2 * n, time.perf_counter() - start)
        return out

    return wrapper


def _timed_residual_gemm(timers: Timers, fn: Callable) -> Callable:
    """The panel GEMM with the residual add fused, which the fused MLP calls directly (its other calls
    come through a linear, whose wrapper times them)."""

    def wrapper(self: Any, x: torch.Tensor, packed: torch.Tensor, bias: Any, n: int, residual: Any = None):
        if residual is None:
            return fn(self, x, packed, bias, n)
        start = time.perf_counter()
        out = fn(self, x, packed, bias, n, residual)
        timers.add_gemm(x.numel() // x.shape[-1], x.shape[-1], n, time.perf_counter() - start)
        return out

    return wrapper


@contextmanager
def instrumented(timers: Timers) -> Iterator[None]:
    """Wrap each part's entry point with a timer; the originals come back on exit."""
    from bm.engine.step.core import EngineCore as Core
    from bm.runtime import decoding, model_runner, native, prepack, weight_quant
    from bm.runtime.backends import torch_backend

    patches: list[tuple[Any, str, Any]] = [
        (Core, "step", _timed(timers, "step", Core.step)),
        (model_runner.ModelRunner, "forward", _timed(timers, "forward", model_runner.ModelRunner.forward)),
        (decoding.Decoder, "decode", _timed(timers, "sampling", decoding.Decoder.decode)),
        (decoding.Decoder, "decode_on_device", _timed(timers, "sampling", decoding.Decoder.decode_on_device)),
        (torch_backend, "prefill", _timed(timers, "attention_prefill", torch_backend.prefill)),
        (torch_backend, "decode", _timed(timers, "attention_decode", torch_backend.decode)),  # torch's path
        (prepack._PackedForward, "__call__", _timed_linear(timers, prepack._PackedForward.__call__, lambda s: s._module)),
        (torch.nn.Linear, "forward", _timed_linear(timers, torch.nn.Linear.forward, lambda s: s)),
        # quantized weights (int8, GGUF blocks, GPTQ/AWQ, FP8): their own kernels, not the panel GEMM
        (weight_quant.KernelForward, "__call__", _timed_linear(timers, weight_quant.KernelForward.__call__, lambda s: s._module)),
    ]  # fmt: skip
    gemm = getattr(native, "SmallGemmKernel", None)
    if gemm is not None and hasattr(gemm, "gated"):  # the fused MLP's GEMMs, called outside the linears
        patches.append((gemm, "gated", _timed_gated(timers, gemm.gated)))
        patches.append((gemm, "__call__", _timed_residual_gemm(timers, gemm.__call__)))
    decode = getattr(native, "PagedDecodeKernel", None)  # the compiled decode kernel, called per layer
    if decode is not None:
        patches.append((decode, "__call__", _timed(timers, "attention_decode", decode.__call__)))
        patches.append((decode, "write_kv", _timed(timers, "kv_write", decode.write_kv)))
    kernels = getattr(native, "ElementwiseKernels", None)
    for name in ("rms_norm", "add_rms_norm", "silu_mul", "rotary"):
        if kernels is not None and hasattr(kernels, name):
            patches.append((kernels, name, _timed(timers, f"elementwise_{name}", getattr(kernels, name))))
    originals = [(owner, name, owner.__dict__[name]) for owner, name, _ in patches]
    try:
        for owner, name, wrapper in patches:
            setattr(owner, name, wrapper)
        yield
    finally:
        for owner, name, original in originals:
            setattr(owner, name, original)


def run_profiled(loaded: Any, config: Any, workload: list, timers: Timers) -> tuple[float, int, int]:
    """The workload through an engine core in this thread; (wall seconds, iterations, output tokens)."""
    core = EngineCore(config, TorchExecutor(loaded))
    for i, (prompt, out) in enumerate(workload):
        refused = core.add_request(Request(i, list(prompt), out))
        if refused is not None:
            raise SystemExit(f"request {i} refused: {refused.error}")
    iterations = output_tokens = 0
    start = time.perf_counter()
    with instrumented(timers):
        while core.num_active:
            step = core.step()
            iterations += 1
            output_tokens += sum(len(r.output_ids) for r in step.responses if r.final)
    return time.perf_counter() - start, iterations, output_tokens


def _part(seconds: float, wall: float, iterations: int) -> dict[str, float]:
    return {
        "seconds": round(seconds, 3),
        "share": round(seconds / wall, 4),
        "ms_per_iteration": round(seconds / max(iterations, 1) * 1e3, 3),
    }


def summarize(timers: Timers, wall: float, iterations: int, peak: float) -> dict[str, Any]:
    """Each part's seconds and share of the wall time, and the GEMM table."""
    s = timers.seconds
    elementwise = sum(v for k, v in s.items() if k.startswith("elementwise_"))
    attention = s["attention_prefill"] + s["attention_decode"]
    parts = {
        "gemm": s["gemm"],
        "attention_prefill": s["attention_prefill"],
        "attention_decode": s["attention_decode"],
        "elementwise": elementwise,
        "kv_write": s["kv_write"],
        "forward_other": s["forward"] - s["gemm"] - attention - elementwise - s["kv_write"],
        "sampling": s["sampling"],
        "engine_python": s["step"] - s["forward"] - s["sampling"],
        "outside_step": wall - s["step"],
    }
    gemm_flops = sum(e[2] for e in timers.gemm.values())
    shapes = [
        {"rows": rows, "k": k, "n": n, "calls": e[0], "seconds": round(e[1], 3),
         "gflop_s": round(e[2] / e[1] / 1e9, 1) if e[1] else None,
         "fraction_of_peak": round(e[2] / e[1] / peak, 3) if e[1] else None}
        for (rows, k, n), e in sorted(timers.gemm.items(), key=lambda kv: -kv[1][1])
    ]  # fmt: skip
    return {
        "wall_s": round(wall, 3),
        "iterations": iterations,
        "parts": {k: _part(v, wall, iterations) for k, v in parts.items()},
        "calls": dict(timers.calls),
        "gemm_peak_gflop_s": round(peak / 1e9, 1),
        "gemm_gflop_s": round(gemm_flops / s["gemm"] / 1e9, 1) if s["gemm"] else None,
        "gemm_fraction_of_peak": round(gemm_flops / s["gemm"] / peak, 3) if s["gemm"] else None,
        "gemm_by_shape": shapes,
    }


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("workload", type=Path)
    add_model_arguments(p)
    p.add_argument("--limit", type=int, default=32, help="first N requests only")
    args = p.parse_args()

    config = load_config(args.config, model_overrides(args))
    workload = read_workload(args.workload, args.limit)
    loaded = load_model(config.model)
    log("warm-up on 2 requests")
    run_bm(loaded, config, workload[:2])
    peaks = [measure_gemm_peak()]
    timers = Timers()
    wall, iterations, output_tokens = run_profiled(loaded, config, workload, timers)
    peaks.append(measure_gemm_peak())
    report = {
        "workload": str(args.workload),
        "requests": len(workload),
        "prompt_tokens": sum(len(x) for x, _ in workload),
        "output_tokens": output_tokens,
        "output_tok_s": round(output_tokens / wall, 1),
        "torch_threads": torch.get_num_threads(),
        **summarize(timers, wall, iterations, max(peaks)),
    }
    print(json.dumps(report, indent=1))


if __name__ == "__main__":
    main()
