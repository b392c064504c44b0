"""The ``sim`` section (the simulated executor's device) and the ``sweep`` section (``bm sweep``'s grid
and SLO search)."""

from __future__ import annotations

from dataclasses import dataclass

from bm.config.fields import int_at_least, knob, mapping, number_in, optional_str


@dataclass
class SimConfig:
    """The simulated executor's device (used when ``engine.executor`` is ``sim``)."""

    hardware: str = knob(
        "h100-sxm",
        "Row of bm/sim/hardware.yaml (h100-sxm, h200, b200, a100-80gb, l40s, mi300x: a well-tuned engine at "
        "the datasheet's peaks, not bm) or a local row measured with bm's own forward by `bm sim calibrate`: "
        "cpu-local (this CPU) or cuda-local (this GPU).",
        optional_str,
    )
    tensor_parallel: int = knob(1, "Devices the model is split over (tensor parallelism).", int_at_least(1))


@dataclass
class SweepConfig:
    """``bm sweep``: the grid of configurations and the SLO search (flags override; see docs/sweep.md)."""

    grid: dict | None = knob(  # noqa: RUF009
        None, "Config keys to sweep, each a list of values, e.g. {engine.max_batch_size: [16, 32]}.", mapping
    )
    slo: dict | None = knob(None, "SLOs in ms: ttft, tpot, itl, e2el.", mapping)  # noqa: RUF009
    percentile: float = knob(
        99.0, "Percentile the SLOs apply to (99: p99).", number_in(0, 100, low_open=True)
    )
    load: str = knob(
        "rate", "What load means: rate (req/s), concurrency, or trace (speed-up of its timestamps)."
    )
    precision: float = knob(0.05, "Relative precision of the highest feasible load.", number_in(0, 1))
    repeats: int = knob(
        1, "Real engine: runs per point; feasible when the median run meets every SLO.", int_at_least(1)
    )
    workers: int = knob(
        0, "Simulated points run in parallel processes (0: one per CPU core).", int_at_least(0)
    )
