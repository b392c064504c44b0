"""Hardware rows for the simulator: datasheet peaks from ``hardware.yaml``, or ``cpu-local`` measured here.

Specs are data, so adding a device or changing a price is an edit to the YAML, not to code. ``cpu-local``
is this machine as bm's own CPU runtime sees it: a short micro-benchmark (GEMM throughput through torch,
memory bandwidth, the cost of one small op and of one engine-core step) cached in
``~/.cache/bm/cpu-local.yaml`` and rerun by ``bm sim calibrate``. Beside the row, each simulated model
gets its forward measured on bm's own engine here (:mod:`bm.sim.forward_fit`): on this CPU that, not the
roofline, times its forwards.
"""

from __future__ import annotations

import dataclasses
import os
import time
from dataclasses import dataclass, field
from importlib import resources
from pathlib import Path
from typing import Any

import yaml

from bm.config import ConfigError

CPU_LOCAL = "cpu-local"


@dataclass(frozen=True)
class Hardware:
    key: str
    name: str
    flops: dict[str, float]
    memory_bw: float
    memory: float
    interconnect_bw: float
    price_per_hour: float
    source: str
    compute_efficiency: float = 0.7
    memory_efficiency: float = 0.8
    iteration_overhead_s: float = 0.0
    layer_overhead_s: float = 0.0
    allreduce_latency_s: float = 5e-6
    # GEMMs of few rows run below peak: throughput = peak * T / (T + gemm_half_tokens) for T tokens
    gemm_half_tokens: float = 0.0
    extra: dict[str, Any] = field(default_factory=dict)

    @property
    def device_type(self) -> str:
        """The device a simulated run stands for, whose engine defaults it resolves (bm.config): this
        machine's CPU for cpu-local, a GPU for every datasheet row."""
        return "cpu" if self.key == CPU_LOCAL else "cuda"

    def peak_flops(self, dtype: str) -> float:
        if dtype not in self.flops:
            raise ConfigError(
                f"hardware {self.key}: no peak FLOP/s for dtype {dtype!r} (has {', '.join(sorted(self.flops))}); "
                "set model.dtype to one of those or add the figure to the hardware table"
            )
        return self.flops[dtype]

    def forward_fit(self, model: Any, dtype: str) -> dict[str, float] | None:
        """cpu-local: the fitted forward cost of ``model`` in ``dtype`` (bm.sim.forward_fit), if measured."""
        from bm.sim.forward_fit import model_key

        fits = self.extra.get("forward_fits") or {}
        entry = fits.get(model_key(model.shape_dict(), dtype))
        return dict(entry["terms"]) if entry else None

    def describe(self) -> dict[str, Any]:
        """The row as results.json records it."""
        row = dataclasses.asdict(self)
        row.pop("extra")
        return row | self.extra


_FIELDS = {f.name for f in dataclasses.fields(Hardware)} - {"key", "extra"}


def _row(key: str, raw: Any, where: str) -> Hardware:
    if not isinstance(raw, dict):
        raise ConfigError(f"{where}: row {key!r} must be a mapping of fields")
    for name in ("flops", "memory_bw", "memory", "interconnect_bw", "price_per_hour", "source"):
        if name not in raw:
            raise ConfigError(f"{where}: row {key!r} lacks field {name!r}")
    known = {k: v for k, v in raw.items() if k in _FIELDS}
    extra = {k: v for k, v in raw.items() if k not in _FIELDS}
    try:
        known["flops"] = {str(k): float(v) for k, v in known["flops"].items()}
        for name, value in known.items():
            if name not in ("flops", "source", "name"):
                known[name] = float(value)
    except (TypeError, ValueError, AttributeError) as exc:
        raise ConfigError(f"{where}: row {key!r} has a non-numeric figure ({exc})") from None
    known.setdefault("name", key)
    return Hardware(key=key, extra=extra, **known)


def hardware_table() -> dict[str, Hardware]:
    """The shipped datasheet rows (cpu-local is not among them: it is measured)."""
    text = resources.files("bm.sim").joinpath("hardware.yaml").read_text(encoding="utf-8")
    raw = yaml.safe_load(text) or {}
    return {key: _row(key, row, "bm/sim/hardware.yaml") for key, row in raw.items()}


def cache_dir() -> Path:
    return Path(os.environ.get("BM_CACHE_DIR") or Path.home() / ".cache" / "bm")


def cpu_local_path() -> Path:
    return cache_dir() / "cpu-local.yaml"


def load_hardware(name: str, *, calibrate_if_missing: bool = True) -> Hardware:
    """The row called ``name``; ``cpu-local`` is read from its cache, calibrated first when absent."""
    if name == CPU_LOCAL:
        path = cpu_local_path()
        if not path.is_file():
            if not calibrate_if_missing:
                raise ConfigError(f"--hardware cpu-local: {path} is missing; run `bm sim calibrate`")
            calibrate(path)
        return _row(CPU_LOCAL, yaml.safe_load(path.read_text(encoding="utf-8")), str(path))
    table = hardware_table()
    if name not in table:
        raise ConfigError(f"--hardware {name!r}: unknown; allowed: {', '.join([*table, CPU_LOCAL])}")
    return table[name]


def ensure_forward_fit(model_config: Any, shape: Any, dtype: str) -> Hardware:
    """The cpu-local row with the fitted forward of the model ``shape`` (measured now on bm's engine
    with ``model_config``'s random weights when the cache has none, then cached)."""
    from bm.sim.forward_fit import measure_forward_fit, model_key

    hardware = load_hardware(CPU_LOCAL)
    if hardware.forward_fit(shape, dtype) is not None:
        return hardware
    fit = measure_forward_fit(model_config)
    path = cpu_local_path()
    raw = yaml.safe_load(path.read_text(encoding="utf-8")) or {}
    fits = raw.get("forward_fits") or {}
    fits[model_key(shape.shape_dict(), dtype)] = fit | {"model": shape.name, "dtype": dtype}
    raw["forward_fits"] = fits
    path.write_text(yaml.safe_dump(raw, sort_keys=False), encoding="utf-8")
    return load_hardware(CPU_LOCAL)


# -- calibration --------------------------------------------------------------------------------------


def _best(fn: Any, repeats: int) -> float:
    best = float("inf")
    for _ in range(repeats):
        t = time.perf_counter()
        fn()
        best = min(best, time.perf_counter() - t)
    return best


def measure_memory_bw(mib: int = 256) -> float:
    """Bytes/s of a large copy (read + write), the best of a few: what streaming weights and KV costs."""
    try:
        import torch
    except ImportError:  # pragma: no cover - torch is a dependency of bm's runtime
        import numpy as np

        a = np.ones(mib * 2**20 // 4, dtype=np.float32)
        b = np.empty_like(a)
        seconds = _best(lambda: np.copyto(b, a), 5)
        return 2 * a.nbytes / seconds
    a = torch.ones(mib * 2**20 // 4, dtype=torch.float32)
    b = torch.empty_like(a)
    seconds = _best(lambda: b.copy_(a), 5)
    return 2 * a.nbytes / seconds


def measure_gemm(dtype: str = "float32", m: int = 256, k: int = 1024, n: int = 1024) -> float | None:
    """FLOP/s of a mid-size matmul in ``dtype`` through torch (None without torch)."""
    try:
        import torch
    except ImportError:  # pragma: no cover
        return None
    dt = getattr(torch, dtype)
    a, b = torch.randn(m, k, dtype=dt), torch.randn(k, n, dtype=dt)
    torch.mm(a, b)
    reps = 10
    seconds = (
        _best(lambda: [torch.mm(a, b) for _ in range(reps)], 15) / reps
    )  # best of many: other load only slows
    return 2 * m * k * n / seconds


def gemm_curve(dtype: str, small: int = 128, large: int = 1024) -> tuple[float | None, float]:
    """Peak FLOP/s and the row count at which a GEMM reaches half of it, from two matmuls of ``small``
    and ``large`` rows: ``f(m) = peak * m / (m + h)`` through both points (decode GEMMs have few rows)."""
    f_small, f_large = measure_gemm(dtype, m=small), measure_gemm(dtype, m=large)
    if not f_small or not f_large:
        return f_large, 0.0
    h_over_p = (1 / f_small - 1 / f_large) / (1 / small - 1 / large)
    if h_over_p <= 0:
        return max(f_small, f_large), 0.0
    inv_peak = 1 / f_large - h_over_p / large
    if inv_peak <= 0:
        return f_large, 0.0
    return 1 / inv_peak, h_over_p / inv_peak


def measure_op_overhead() -> float:
    """Seconds of one tiny torch op (dispatch cost): a model's many small ops pay it per layer."""
    import torch

    x = torch.ones(8, 8)
    reps = 2000
    return _best(lambda: [x.add(1.0) for _ in range(reps)], 5) / reps


def measure_step_overhead() -> float:
    """Seconds of one engine-core step around a no-op executor: bm's own Python cost per iteration."""
    from bm.config import BmConfig
    from bm.engine.core import EngineCore
    from bm.engine.fake_executor import FakeExecutor
    from bm.engine.request import Request

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


# Small ops per decoder layer in bm's torch forward (norms, projections, rotary, attention, MLP,
# residuals): the dispatch overhead a layer pays beyond its FLOPs and bytes.
OPS_PER_LAYER = 30


def calibrate(path: Path | None = None) -> dict[str, Any]:
    """Measure this machine and write the cpu-local row (returns it)."""
    import platform

    try:
        import torch

        threads = torch.get_num_threads()
    except ImportError:  # pragma: no cover
        threads = os.cpu_count() or 1
    fp32, half_tokens = gemm_curve("float32")
    flops = {"float32": fp32} if fp32 else {}
    op = measure_op_overhead()
    row = {
        "name": f"this machine ({platform.processor() or platform.machine()}, {threads} threads)",
        "flops": flops,
        "memory_bw": measure_memory_bw(),
        "memory": float(_total_memory()),
        "interconnect_bw": 0.0,
        "price_per_hour": 0.10,
        # a micro-benchmark reaches its own peak by construction; the kernels bm's model runs reach less
        "compute_efficiency": 1.0,
        "memory_efficiency": 1.0,
        "iteration_overhead_s": measure_step_overhead(),
        "layer_overhead_s": OPS_PER_LAYER * op,
        "gemm_half_tokens": half_tokens,
        "op_overhead_s": op,
        "torch_threads": threads,
        "calibrated_at": time.strftime("%Y-%m-%dT%H:%M:%S%z"),
        "source": "measured by `bm sim calibrate` (bm.sim.hardware.calibrate)",
    }
    path = path or cpu_local_path()
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(yaml.safe_dump(row, sort_keys=False), encoding="utf-8")
    return row


def _total_memory() -> int:
    try:
        return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    except (ValueError, OSError, AttributeError):  # pragma: no cover
        return 16 * 2**30
