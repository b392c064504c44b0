"""Measuring a local device for its hardware row: ``cpu-local`` on the CPU, ``cuda-local`` on a GPU.

A datasheet row describes a well-tuned engine at the vendor's peaks; a local row describes this device
as bm's own runtime sees it, so its figures come from torch on the device itself: copy bandwidth, the
GEMM throughput curve (decode GEMMs have few rows and run far below peak), the cost of one small op
(the per-kernel dispatch or launch a layer pays) and the engine core's own Python per step. On CUDA
every timer synchronizes the device before it starts and before it stops: kernels are asynchronous, and
a timer that does not wait measures only the launches.

Everything here imports torch when called, never at import (``bm.sim`` stays importable without it).
"""

from __future__ import annotations

import os
import platform
import time
from collections.abc import Callable, Sequence
from typing import Any

# Small ops per decoder layer in bm's torch forward (norms, projections, rotary, attention, MLP,
# residuals): the dispatch overhead a layer pays beyond its FLOPs and bytes.
OPS_PER_LAYER = 30
# GEMM rows measured for the throughput curve: the CPU's two sizes as before; on a GPU from a decode
# step's few rows to a prefill's thousands, over a 4096-wide weight (a 7B-8B layer's)
CPU_GEMM = ((128, 1024), 1024)
CUDA_GEMM = ((16, 64, 256, 1024, 4096), 4096)


def _sync(device: Any) -> Callable[[], None]:
    """Wait for the device's queued work (nothing to wait for on the CPU)."""
    import torch

    if device.type == "cuda":
        return lambda: torch.cuda.synchronize(device)
    return lambda: None


def best_seconds(fn: Callable[[], Any], repeats: int, sync: Callable[[], None] = lambda: None) -> float:
    """The fastest of ``repeats`` calls of ``fn``, the device idle at the start and finished at the end of
    each: other load on a shared machine only ever adds time."""
    best = float("inf")
    for _ in range(repeats):
        sync()
        t = time.perf_counter()
        fn()
        sync()
        best = min(best, time.perf_counter() - t)
    return best


def measure_memory_bw(device: Any, mib: int = 256) -> float:
    """Bytes/s of a large copy (read + write), the best of a few: what streaming weights and KV costs."""
    import torch

    a = torch.ones(mib * 2**20 // 4, dtype=torch.float32, device=device)
    b = torch.empty_like(a)
    reps = 4 if device.type == "cuda" else 1  # a GPU copy of 1 GiB is under a millisecond
    seconds = best_seconds(lambda: [b.copy_(a) for _ in range(reps)], 5, _sync(device)) / reps
    return 2 * a.nbytes / seconds


def measure_gemm(device: Any, dtype: str, m: int, k: int, n: int) -> float:
    """FLOP/s of an ``m x k @ k x n`` matmul in ``dtype`` through torch, the best of many."""
    import torch

    dt = getattr(torch, dtype)
    a = torch.randn(m, k, dtype=dt, device=device)
    b = torch.randn(k, n, dtype=dt, device=device)
    torch.mm(a, b)  # first call: library heuristics, workspace
    reps = 10
    seconds = best_seconds(lambda: [torch.mm(a, b) for _ in range(reps)], 15, _sync(device)) / reps
    return 2 * m * k * n / seconds


def fit_gemm_curve(points: Sequence[tuple[int, float]]) -> tuple[float, float]:
    """Peak FLOP/s and the row count at which a GEMM reaches half of it, from ``(rows, FLOP/s)`` points:
    ``f(m) = peak * m / (m + h)``, i.e. ``1/f = 1/peak + (h/peak) / m``, a line in ``1/m`` fitted by
    least squares (through both points when there are two). A curve that does not rise with ``m`` gives
    its best point and no ramp."""
    best = max(f for _, f in points)
    if len(points) < 2:
        return best, 0.0
    xs = [1 / m for m, _ in points]
    ys = [1 / f for _, f in points]
    mx, my = sum(xs) / len(xs), sum(ys) / len(ys)
    sxx = sum((x - mx) ** 2 for x in xs)
    slope = sum((x - mx) * (y - my) for x, y in zip(xs, ys, strict=True)) / sxx if sxx else 0.0
    inv_peak = my - slope * mx
    if slope <= 0 or inv_peak <= 0:
        return best, 0.0
    return 1 / inv_peak, slope / inv_peak


def gemm_curve(device: Any, dtype: str) -> dict[str, Any]:
    """The GEMM throughput curve of ``dtype`` on ``device``: each measured point, the fitted peak and the
    half-throughput row count (the cost model's ``gemm_half_tokens``)."""
    import torch

    rows, width = CUDA_GEMM if device.type == "cuda" else CPU_GEMM
    previous = torch.get_float32_matmul_precision()
    if device.type == "cuda" and dtype == "float32":  # bm runs float32 on CUDA in TF32 (resolve_dtype)
        torch.set_float32_matmul_precision("high")
    try:
        points = [(m, measure_gemm(device, dtype, m, width, width)) for m in rows]
    finally:
        torch.set_float32_matmul_precision(previous)
    peak, half = fit_gemm_curve(points)
    return {"peak": peak, "half_tokens": half, "points": {m: f for m, f in points}}


def measure_op_overhead(device: Any) -> float:
    """Seconds of one tiny torch op: dispatch on the CPU, dispatch plus kernel launch on a GPU (the
    device waited for at the end: a chain of tiny kernels runs at the launch rate). A model's many
    small ops pay it per layer when nothing (a CUDA graph) hides it."""
    import torch

    x = torch.ones(8, 8, device=device)
    reps = 2000
    return best_seconds(lambda: [x.add(1.0) for _ in range(reps)], 5, _sync(device)) / reps


def measure_step_overhead() -> float:
    """Seconds of one engine-core step around a no-op executor: bm's own Python cost per iteration."""
    from bm.config import BmConfig
    from bm.engine.execution.fake_executor import FakeExecutor
    from bm.engine.requests.request import Request
    from bm.engine.step.core import EngineCore

    config = BmConfig()
    config.kv_cache.max_tokens = 1 << 16
    core = EngineCore(config, FakeExecutor(8192))
    for i in range(16):
        core.add_request(Request(i, list(range(3, 67)), 10_000, streaming=True))
    core.step()
    steps = 200
    t = time.perf_counter()
    for _ in range(steps):
        core.step()
    return (time.perf_counter() - t) / steps


def measure_row(device: Any, datasheet_prices: dict[str, float]) -> dict[str, Any]:
    """The measured fields of a local row for ``device`` (a ``torch.device``). ``datasheet_prices``:
    hourly price by datasheet row key, for a GPU named like one (its price is the row's starting point)."""
    import torch

    if device.type == "cuda":
        dtypes = ("bfloat16", "float16", "float32")
        props = torch.cuda.get_device_properties(device)
        name = f"{props.name} ({device}, measured)"
        memory = float(props.total_memory)
        price = _price_for(props.name, datasheet_prices)
    else:
        dtypes = ("float32",)
        name = (
            f"this machine ({platform.processor() or platform.machine()}, {torch.get_num_threads()} threads)"
        )
        memory = float(_total_memory())
        price = 0.10
    curves = {dtype: gemm_curve(device, dtype) for dtype in dtypes}
    op = measure_op_overhead(device)
    row: dict[str, Any] = {
        "name": name,
        "device": str(device),
        "flops": {dtype: curve["peak"] for dtype, curve in curves.items()},
        "memory_bw": measure_memory_bw(device, 1024 if device.type == "cuda" else 256),
        "memory": memory,
        "interconnect_bw": 0.0,
        "price_per_hour": price,
        # a micro-benchmark reaches its own peak by construction; the kernels bm's model runs reach less
        "compute_efficiency": 1.0,
        "memory_efficiency": 1.0,
        "iteration_overhead_s": measure_step_overhead(),
        "layer_overhead_s": OPS_PER_LAYER * op,
        # the ramp of the dtype bm runs by default there (bfloat16 on CUDA, float32 on CPU)
        "gemm_half_tokens": curves[dtypes[0]]["half_tokens"],
        "gemm_curves": {
            dtype: {"half_tokens": c["half_tokens"], "points": c["points"]} for dtype, c in curves.items()
        },
        "op_overhead_s": op,
    }
    if device.type == "cuda":
        from bm.runtime.triton.graphs import BUCKETS

        # decode steps up to this many rows replay a CUDA graph; larger ones (and prompts) run eagerly
        row["graph_max_batch_size"] = BUCKETS[-1]
    else:
        row["torch_threads"] = torch.get_num_threads()
    return row


def _price_for(device_name: str, prices: dict[str, float]) -> float:
    """The datasheet row's hourly price for a GPU named like it (an H100 -> h100-sxm), else 0: edit it."""
    lowered = device_name.lower().replace(" ", "")
    for key, price in prices.items():
        if key.split("-")[0] in lowered:
            return price
    return 0.0


def _total_memory() -> int:
    try:
        return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    except (ValueError, OSError, AttributeError):  # pragma: no cover
        return 16 * 2**30
