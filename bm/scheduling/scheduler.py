"""The two stages composed: capacity first, then the micro batch (the scheduler page's SimpleScheduler).

A scheduler's output is a plan and nothing more: which requests run and how many tokens each computes,
which are paused, which cached prefix each starting request takes, and (V1) the padding it executes.
Nothing here allocates, frees or takes a block; the engine hands the plan to the KV cache manager's
``prepare_resources``.
"""

from __future__ import annotations

import inspect
from abc import ABC, abstractmethod
from collections.abc import Sequence
from dataclasses import dataclass, field

from bm.kv import PrefixMatch
from bm.scheduling.capacity import CapacityScheduler
from bm.scheduling.micro_batch import MicroBatchScheduler
from bm.scheduling.request import LlmRequest


@dataclass
class PaddingWork:
    """V1: pad tokens a member executes beside its shorter prompt (positions ``start`` onwards)."""

    request: LlmRequest
    start: int
    num_tokens: int


@dataclass
class EmptySlot:
    """V1: a finished member still computing one dummy token at ``position`` while its batch runs on."""

    request: LlmRequest
    position: int


@dataclass
class SchedulerOutput:
    context_requests: list[LlmRequest] = field(default_factory=list)
    generation_requests: list[LlmRequest] = field(default_factory=list)
    paused_requests: list[LlmRequest] = field(default_factory=list)
    # request id -> context tokens computed this iteration; taken from each context request's
    # ``context_chunk_size`` when a scheduler does not fill it (the scheduler page's custom schedulers).
    context_chunk_sizes: dict[int, int] = field(default_factory=dict)
    # request id -> the cached prefix a request starting now takes (block reuse)
    prefixes: dict[int, PrefixMatch] = field(default_factory=dict)
    padding: list[PaddingWork] = field(default_factory=list)
    empty_slots: list[EmptySlot] = field(default_factory=list)

    def __post_init__(self) -> None:
        for request in self.context_requests:
            self.context_chunk_sizes.setdefault(request.request_id, request.context_chunk_size)

    @property
    def num_scheduled(self) -> int:
        return len(self.context_requests) + len(self.generation_requests)

    @property
    def num_context_tokens(self) -> int:
        return sum(self.context_chunk_sizes.values())


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
        # A user's micro-batch subclass written against the two-argument form still works; it then
        # sizes a starting request's chunk as if nothing were cached (more than needed, never less).
        params = inspect.signature(micro_batch_scheduler.schedule).parameters
        self._passes_computed = "computed" in params

    def schedule_request(
        self, active_requests: Sequence[LlmRequest], inflight_request_ids: frozenset[int] = frozenset()
    ) -> SchedulerOutput:
        capacity = self.capacity_scheduler.plan(active_requests)
        micro = self.micro_batch_scheduler
        micro.chunk_sizes = {}
        if self._passes_computed:
            computed = {rid: match.num_tokens for rid, match in capacity.prefixes.items()}
            context, generation = micro.schedule(capacity.fitting, inflight_request_ids, computed)
        else:
            context, generation = micro.schedule(capacity.fitting, inflight_request_ids)
        # bm's micro-batch stage keeps its chunk sizes for the plan; a context it did not size (a user's
        # subclass that sets context_chunk_size, as the seed's did) is read by SchedulerOutput
        chunks = {
            r.request_id: micro.chunk_sizes[r.request_id]
            for r in context
            if r.request_id in micro.chunk_sizes
        }
        prefixes = {
            r.request_id: capacity.prefixes[r.request_id]
            for r in context
            if r.request_id in capacity.prefixes
        }
        return SchedulerOutput(context, generation, capacity.paused, chunks, prefixes=prefixes)
