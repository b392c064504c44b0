"""Two-stage scheduling over plain-Python requests (no torch): capacity policy, then micro-batch budgets."""

from bm.scheduling.capacity import CapacityPlan, CapacityScheduler, GuaranteedNoEvictScheduler
from bm.scheduling.controls import Controls
from bm.scheduling.micro_batch import MicroBatchScheduler
from bm.scheduling.request import FinishReason, LlmRequest, RequestState, Sampling
from bm.scheduling.scheduler import (
    EmptySlot,
    PaddingWork,
    RequestScheduler,
    SchedulerOutput,
    SimpleScheduler,
)

__all__ = [
    "CapacityPlan",
    "CapacityScheduler",
    "Controls",
    "EmptySlot",
    "FinishReason",
    "GuaranteedNoEvictScheduler",
    "LlmRequest",
    "MicroBatchScheduler",
    "PaddingWork",
    "RequestScheduler",
    "RequestState",
    "Sampling",
    "SchedulerOutput",
    "SimpleScheduler",
]
