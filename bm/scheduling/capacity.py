"""Capacity scheduling: which active requests get KV cache resources this iteration.

The shape follows the scheduler page: a policy object subclasses :class:`CapacityScheduler` and implements
``schedule_request(active_requests) -> (fitting_requests, paused_requests)``. Block arithmetic is asked of
the KV cache manager (``get_max_resource_count``, ``get_needed_resource_to_completion``), never redone here.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Sequence

from bm.kv import KVCacheManager
from bm.scheduling.request import LlmRequest, RequestState


class CapacityScheduler(ABC):
    """Base class of capacity policies. Subclass it to plug in a policy of your own."""

    # Only requests with no_schedule_until_state <= state < no_schedule_after_state are considered.
    no_schedule_until_state = RequestState.CONTEXT_INIT
    no_schedule_after_state = RequestState.GENERATION_COMPLETE

    def __init__(self, max_num_requests: int, kv_cache_manager: KVCacheManager) -> None:
        self.max_num_requests = max_num_requests
        self.kv_cache_manager = kv_cache_manager

    def is_schedulable(self, request: LlmRequest) -> bool:
        return self.no_schedule_until_state <= request.state < self.no_schedule_after_state

    @abstractmethod
    def schedule_request(
        self, active_requests: Sequence[LlmRequest]
    ) -> tuple[list[LlmRequest], list[LlmRequest]]:
        """Return ``(fitting_requests, paused_requests)``."""


class GuaranteedNoEvictScheduler(CapacityScheduler):
    """Admit a request only when the blocks it needs to completion are still unreserved.

    Requests that already hold blocks (generating, or part-way through a chunked context) come first and
    reserve their full need; new requests then enter in arrival order until the first that does not fit,
    so a started request always finishes without eviction.
    """

    def schedule_request(
        self, active_requests: Sequence[LlmRequest]
    ) -> tuple[list[LlmRequest], list[LlmRequest]]:
        kv = self.kv_cache_manager
        max_blocks = kv.get_max_resource_count()
        scheduled: list[LlmRequest] = []
        pending: list[LlmRequest] = []
        reserved = 0
        for request in active_requests:
            if not self.is_schedulable(request):
                continue
            if len(scheduled) >= self.max_num_requests:
                break
            if request.is_generation_phase or request.num_computed_tokens > 0:
                scheduled.append(request)
                reserved += kv.get_needed_resource_to_completion(request)
            else:
                pending.append(request)

        available = max_blocks - reserved
        for request in pending:
            if len(scheduled) >= self.max_num_requests:
                break
            needed = kv.get_needed_resource_to_completion(request)
            if needed > available:
                break  # first come, first served: nobody overtakes a request that does not fit
            scheduled.append(request)
            available -= needed
        return scheduled, []
