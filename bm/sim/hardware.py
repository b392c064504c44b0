"""Hardware rows for the simulator: datasheet peaks from ``hardware.yaml``, or a local row measured here.

Specs are data, so adding a device or changing a price is an edit to the YAML, not to code. A datasheet
row models a well-tuned engine at the vendor's peaks, not bm. The local rows are this machine as bm's own
runtime sees it: ``cpu-local`` (the CPU) and ``cuda-local`` (a GPU), each a short micro-benchmark of its
device (:mod:`bm.sim.calibration`: GEMM throughput, copy bandwidth, the cost of one small op and of one
engine-core step) cached in ``~/.cache/bm/<row>.yaml`` and rerun by ``bm sim calibrate [--device DEV]``.
Beside a local row, each simulated model gets its forward measured on bm's own engine on that device
(:mod:`bm.sim.forward_fit`): that, not the roofline, times its forwards.
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
CUDA_LOCAL = "cuda-local"
# Rows measured on this machine rather than read from the datasheet table, by the device each measures
LOCAL_ROWS = {CPU_LOCAL: "cpu", CUDA_LOCAL: "cuda"}


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
        """The device a simulated run stands for, whose engine defaults it resolves (bm.config): the
        device a local row measured, a GPU for every datasheet row."""
        return LOCAL_ROWS.get(self.key, "cuda")

    def peak_flops(self, dtype: str) -> float:
        if dtype not in self.flops:
            raise ConfigError(
                f"hardware {self.key}: no peak FLOP/s for dtype {dtype!r} (has {', '.join(sorted(self.flops))}); "
                "set model.dtype to one of those or add the figure to the hardware table"
            )
        return self.flops[dtype]

    def forward_fit(self, model: Any, dtype: str, weights: Any = None) -> dict[str, float] | None:
        """A local row: the fitted forward cost of ``model`` in ``dtype`` with its linears held as
        ``weights`` (bm.sim.model.WeightFormat; None: full width) (bm.sim.forward_fit), if measured;
        every term present (one a fit left out, or an older cache lacks, is 0)."""
        from bm.sim.forward_fit import TERMS, fit_key

        fits = self.extra.get("forward_fits") or {}
        entry = fits.get(fit_key(model, dtype, weights))
        return {name: float(entry["terms"].get(name, 0.0)) for name in TERMS} if entry else None

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
    """The shipped datasheet rows (the local rows are not among them: they are measured)."""
    text = resources.files("bm.sim").joinpath("hardware.yaml").read_text(encoding="utf-8")
    raw = yaml.safe_load(text) or {}
    return {key: _row(key, row, "bm/sim/hardware.yaml") for key, row in raw.items()}


def cache_dir() -> Path:
    return Path(os.environ.get("BM_CACHE_DIR") or Path.home() / ".cache" / "bm")


def local_row_name(device: str) -> str:
    """The local row that measures ``device`` (``cpu`` -> cpu-local, ``cuda`` or ``cuda:N`` -> cuda-local)."""
    kind, _, index = device.partition(":")
    for name, row_device in LOCAL_ROWS.items():
        if row_device == kind and (not index or (kind == "cuda" and index.isdigit())):
            return name
    raise ConfigError(f"device {device!r}: no local hardware row measures it; allowed: cpu, cuda, cuda:N")


def local_row_path(name: str) -> Path:
    """Where the local row ``name`` is cached (``BM_CACHE_DIR``, else ``~/.cache/bm``)."""
    return cache_dir() / f"{name}.yaml"


def default_device() -> str:
    """What ``bm sim calibrate`` measures without ``--device``: the GPU when CUDA is present, else the CPU."""
    import torch

    return "cuda" if torch.cuda.is_available() else "cpu"


def load_hardware(name: str, *, calibrate_if_missing: bool = True) -> Hardware:
    """The row called ``name``; a local row is read from its cache, calibrated first (on its device)
    when absent."""
    if name in LOCAL_ROWS:
        path = local_row_path(name)
        if not path.is_file():
            if not calibrate_if_missing:
                raise ConfigError(f"--hardware {name}: {path} is missing; run `bm sim calibrate`")
            calibrate(LOCAL_ROWS[name])
        return _row(name, yaml.safe_load(path.read_text(encoding="utf-8")), str(path))
    table = hardware_table()
    if name not in table:
        raise ConfigError(f"--hardware {name!r}: unknown; allowed: {', '.join([*table, *LOCAL_ROWS])}")
    return table[name]


def ensure_forward_fit(
    model_config: Any, shape: Any, dtype: str, row: str = CPU_LOCAL, weights: Any = None
) -> Hardware:
    """The local row ``row`` with the fitted forward of the model ``shape`` in ``dtype``, its linears
    held as ``weights``: measured now on bm's engine on that row's device (``model_config``'s weights,
    random unless it names a checkpoint, quantized as it says; its device and dtype forced to the
    row's) when the cache has none, then cached beside the row."""
    from bm.sim.forward_fit import fit_key, measure_forward_fit

    hardware = load_hardware(row)
    if hardware.forward_fit(shape, dtype, weights) is not None:
        return hardware
    device = str(hardware.extra.get("device") or LOCAL_ROWS[row])
    # decode graphs as a default run has them: the fit prices graph-replayed and eager forwards apart
    model_config = dataclasses.replace(model_config, dtype=dtype, device=device, cuda_graphs="auto")
    from bm.runtime import ModelLoadError

    try:
        fit = measure_forward_fit(model_config)
    except ModelLoadError as exc:
        raise ConfigError(f"--hardware {row}: the model to measure could not be built: {exc}") from None
    path = local_row_path(row)
    raw = yaml.safe_load(path.read_text(encoding="utf-8")) or {}
    fits = raw.get("forward_fits") or {}
    fits[fit_key(shape, dtype, weights)] = fit | {"model": shape.name, "dtype": dtype}
    raw["forward_fits"] = fits
    path.write_text(yaml.safe_dump(raw, sort_keys=False), encoding="utf-8")
    return load_hardware(row)


def calibrate(device: str | None = None, path: Path | None = None) -> dict[str, Any]:
    """Measure ``device`` (``cpu``, ``cuda`` or ``cuda:N``; default: CUDA when present, else the CPU) and
    write its local row, cpu-local or cuda-local, to ``path`` (default: the cache). Returns the row.

    Rewriting the row drops its forward fits: the next simulated run of each model measures its forward
    again, on the device as it is now."""
    from bm.sim.calibration import measure_row

    device = device or default_device()
    name = local_row_name(device)  # checks the spelling before torch sees it
    row = measure_row(_torch_device(device), {k: r.price_per_hour for k, r in hardware_table().items()})
    row |= {
        "calibrated_at": time.strftime("%Y-%m-%dT%H:%M:%S%z"),
        "source": f"measured by `bm sim calibrate --device {device}` (bm.sim.hardware.calibrate)",
    }
    path = path or local_row_path(name)
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(yaml.safe_dump(row, sort_keys=False), encoding="utf-8")
    return row


def _torch_device(device: str) -> Any:
    """The torch device to measure; a GPU row asked for where there is no CUDA is a user error."""
    import torch

    resolved = torch.device(device)
    if resolved.type == "cuda":
        if not torch.cuda.is_available():
            raise ConfigError(
                f"device {device!r}: CUDA is not available here; calibrate cpu-local with --device cpu"
            )
        if resolved.index is None:
            resolved = torch.device("cuda", torch.cuda.current_device())
    return resolved
