"""bm's simulator: the real engine core (scheduler, KV manager, chunking, reuse) with the forward
replaced by a roofline cost model, replayed against a virtual clock. Pure Python: no torch at import."""

from bm.sim.cost import CostModel, IterationCost
from bm.sim.executor import SimExecutor, VirtualClock, logit_fields
from bm.sim.hardware import (
    CPU_LOCAL,
    CUDA_LOCAL,
    LOCAL_ROWS,
    Hardware,
    calibrate,
    ensure_forward_fit,
    hardware_table,
    load_hardware,
)
from bm.sim.model import ModelShape

__all__ = [
    "CPU_LOCAL",
    "CUDA_LOCAL",
    "LOCAL_ROWS",
    "CostModel",
    "Hardware",
    "IterationCost",
    "ModelShape",
    "SimExecutor",
    "VirtualClock",
    "calibrate",
    "ensure_forward_fit",
    "hardware_table",
    "load_hardware",
    "logit_fields",
]
