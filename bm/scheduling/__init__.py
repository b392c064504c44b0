"""Two-stage scheduling over plain-Python requests (no torch): capacity policy, then micro-batch budgets."""

from bm.scheduling.capacity import CapacityScheduler, GuaranteedNoEvictScheduler
from bm.scheduling.micro_batch import MicroBatchScheduler
from bm.scheduling.request import FinishReason, LlmRequest, RequestState, SamplingParams
from bm.scheduling.scheduler import RequestScheduler, SchedulerOutput, SimpleScheduler

__all__ = [
    "CapacityScheduler",
    "FinishReason",
    "GuaranteedNoEvictScheduler",
    "LlmRequest",
    "MicroBatchScheduler",
    "RequestScheduler",
    "RequestState",
    "SamplingParams",
    "SchedulerOutput",
    "SimpleScheduler",
]
