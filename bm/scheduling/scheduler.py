"""The two stages composed: capacity first, then the micro batch (the scheduler page's SimpleScheduler)."""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Sequence
from dataclasses import dataclass, field

from bm.scheduling.capacity import CapacityScheduler
from bm.scheduling.micro_batch import MicroBatchScheduler
from bm.scheduling.request import LlmRequest


@dataclass
class SchedulerOutput:
    context_requests: list[LlmRequest] = field(default_factory=list)
    generation_requests: list[LlmRequest] = field(default_factory=list)
    paused_requests: list[LlmRequest] = field(default_factory=list)

    @property
    def num_scheduled(self) -> int:
        return len(self.context_requests) + len(self.generation_requests)

    @property
    def num_context_tokens(self) -> int:
        return sum(r.context_chunk_size for r in self.context_requests)


class RequestScheduler(ABC):
    """Implement ``schedule_request`` directly when two-stage scheduling does not fit your policy."""

    @abstractmethod
    def schedule_request(
        self, active_requests: Sequence[LlmRequest], inflight_request_ids: frozenset[int] = frozenset()
    ) -> SchedulerOutput: ...

    def holds(self, request: LlmRequest) -> bool:
        """Whether a finished request must stay (a V1 empty slot) rather than be released at once."""
        return False


class SimpleScheduler(RequestScheduler):
    def __init__(self, capacity_scheduler: CapacityScheduler, micro_batch_scheduler: MicroBatchScheduler):
        self.capacity_scheduler = capacity_scheduler
        self.micro_batch_scheduler = micro_batch_scheduler

    def schedule_request(
        self, active_requests: Sequence[LlmRequest], inflight_request_ids: frozenset[int] = frozenset()
    ) -> SchedulerOutput:
        fitting, paused = self.capacity_scheduler.schedule_request(active_requests)
        context, generation = self.micro_batch_scheduler.schedule(fitting, inflight_request_ids)
        return SchedulerOutput(context, generation, paused)
