"""Capacity scheduling: which active requests get KV cache resources this iteration.

The shape follows the scheduler page: a policy subclasses :class:`CapacityScheduler` and implements
``schedule_request(active_requests) -> (fitting_requests, paused_requests)``. Block arithmetic is asked of
the KV cache manager (``get_max_resource_count``, ``get_needed_resource_to_completion``, ...), never
redone here. The built-in policies also see the iteration's token budget (:mod:`bm.scheduling.budget`),
so a request is fitting only if the micro-batch stage will really run it this iteration.

Fitting requests come out in the order the micro-batch stage serves them: generation first, then
contexts already under way, then new contexts.
"""

from __future__ import annotations

import sys
from abc import ABC, abstractmethod
from collections.abc import Sequence

from bm.kv import KVCacheManager
from bm.scheduling.budget import ChunkingConfig, IterationBudget
from bm.scheduling.request import LlmRequest, RequestState


class CapacityScheduler(ABC):
    """Base class of capacity policies. Subclass it to plug in a policy of your own."""

    # Only requests with no_schedule_until_state <= state < no_schedule_after_state are considered.
    no_schedule_until_state = RequestState.CONTEXT_INIT
    no_schedule_after_state = RequestState.GENERATION_COMPLETE

    def __init__(
        self,
        max_num_requests: int,
        kv_cache_manager: KVCacheManager,
        max_num_tokens: int | None = None,
        chunking: ChunkingConfig | None = None,
    ) -> None:
        self.max_num_requests = max_num_requests
        self.kv_cache_manager = kv_cache_manager
        self.max_num_tokens = max_num_tokens
        self.chunking = chunking or ChunkingConfig()
        self._starts = 0

    def is_schedulable(self, request: LlmRequest) -> bool:
        return self.no_schedule_until_state <= request.state < self.no_schedule_after_state

    def new_budget(self) -> IterationBudget:
        """This iteration's slots and tokens (unbounded tokens when the scheduler was given no budget)."""
        return IterationBudget(self.max_num_requests, self.max_num_tokens or sys.maxsize, self.chunking)

    def mark_started(self, request: LlmRequest) -> None:
        """Record that ``request`` starts holding blocks now (MAX_UTILIZATION pauses the latest first)."""
        self._starts += 1
        request.start_order = self._starts

    def try_start(
        self, request: LlmRequest, budget: IterationBudget, free_blocks: int, to_completion: bool
    ) -> int | None:
        """Start a new request if it fits, taking its cached prefix when block reuse finds one.

        The cached prefix is not computed again, so the budget is asked only for the rest, and blocks
        the prefix takes from the cache count against ``free_blocks`` only when nobody holds them yet.
        ``to_completion``: check the blocks it needs to completion (no-evict), else this iteration's.
        Returns the free-pool blocks it uses up, or None when it does not fit (nothing changed then).
        """
        if budget.slots_left <= 0:  # before hashing the prompt for a prefix it could not use
            return None
        kv = self.kv_cache_manager
        match = kv.find_cached_prefix(request)
        cost = match.cost(kv.get_needed_resource_to_completion(request)) if to_completion else 0
        if cost > free_blocks:
            return None
        request.num_computed_tokens = match.num_tokens  # so the budget sees only what is left
        tokens = budget.take(request)
        if tokens and not to_completion:
            if request.beam_width > 1:  # beams are reserved to completion even when others are not
                blocks = kv.get_needed_resource_to_completion(request)
            else:
                blocks = kv.num_blocks_for_tokens(budget.tokens_to_hold(request, tokens))
            cost = match.cost(blocks)
            if cost > free_blocks:
                budget.give_back(tokens)
                tokens = 0
        if not tokens:
            request.num_computed_tokens = 0
            return None
        kv.take_cached_prefix(request, match)
        request.num_reused_blocks += match.num_blocks  # both 0 without reuse (NO_MATCH)
        request.num_missed_blocks += match.num_missed_blocks
        self.mark_started(request)
        return cost

    @abstractmethod
    def schedule_request(
        self, active_requests: Sequence[LlmRequest]
    ) -> tuple[list[LlmRequest], list[LlmRequest]]:
        """Return ``(fitting_requests, paused_requests)``."""


def split_started(
    scheduler: CapacityScheduler, active_requests: Sequence[LlmRequest]
) -> tuple[list[LlmRequest], list[LlmRequest]]:
    """Schedulable requests that hold blocks (generation first) and those that do not yet, in order."""
    generation, contexts, new = [], [], []
    for request in active_requests:
        if not scheduler.is_schedulable(request):
            continue
        if request.is_generation_phase:
            generation.append(request)
        elif request.holds_blocks:
            contexts.append(request)
        else:
            new.append(request)
    return generation + contexts, new


class GuaranteedNoEvictScheduler(CapacityScheduler):
    """Admit a request only when the blocks it needs to completion are still unreserved.

    Requests that already hold blocks reserve their full need first; new requests then enter in arrival
    order until the first that does not fit (first come, first served), so a started request always
    finishes without eviction.
    """

    def schedule_request(
        self, active_requests: Sequence[LlmRequest]
    ) -> tuple[list[LlmRequest], list[LlmRequest]]:
        kv = self.kv_cache_manager
        budget = self.new_budget()
        started, new = split_started(self, active_requests)
        # Held blocks count once however many requests share them; cached blocks count as free.
        reserved = kv.get_reserved_resource(started)
        fitting = [r for r in started if budget.take(r)]
        available = kv.get_max_resource_count() - reserved
        for request in new:
            cost = self.try_start(request, budget, available, to_completion=True)
            if cost is None:
                break
            fitting.append(request)
            available -= cost
        return fitting, []


class MaxUtilizationScheduler(CapacityScheduler):
    """Run as much as fits this iteration; when blocks run short, pause the most recently started.

    Only the blocks this iteration's tokens need are considered, not the need to completion. Started
    requests are served oldest first; when one cannot get its blocks, the youngest started requests are
    paused (their blocks freed, their context recomputed later) until it can, or it is paused itself if
    it is the youngest. New requests never displace started ones.
    """

    def schedule_request(
        self, active_requests: Sequence[LlmRequest]
    ) -> tuple[list[LlmRequest], list[LlmRequest]]:
        kv = self.kv_cache_manager
        budget = self.new_budget()
        started, new = split_started(self, active_requests)
        # Beam requests are never paused (their beams could not be recomputed from one context): each
        # reserves what it needs to completion once started, and the others share what is left.
        alive = sorted((r for r in started if r.beam_width == 1), key=lambda r: r.start_order)
        free = kv.get_num_free_blocks() - sum(
            kv.get_remaining_resource_to_completion(r) for r in started if r.beam_width > 1
        )
        fitting: list[LlmRequest] = []
        paused: list[LlmRequest] = []
        given: dict[int, tuple[int, int]] = {}  # request id -> (tokens, blocks) granted

        for request in started:
            if request in paused:
                continue
            tokens = budget.take(request)
            if not tokens:
                continue
            if request.beam_width > 1:  # its blocks are reserved above
                fitting.append(request)
                continue
            need = kv.num_blocks_to_allocate(request.request_id, budget.tokens_to_hold(request, tokens))
            while need > free and alive[-1] is not request:
                victim = alive.pop()
                paused.append(victim)
                free += kv.num_freeable_blocks(victim.request_id)
                # Freed now, not after scheduling, so a new request's prefix match sees its blocks as
                # cached (reclaimable) rather than held; the batch manager's own free is then a no-op.
                kv.free(victim.request_id)
                if victim.request_id in given:
                    victim_tokens, victim_blocks = given.pop(victim.request_id)
                    fitting.remove(victim)
                    budget.give_back(victim_tokens)
                    free += victim_blocks
            if need > free:  # it is the youngest itself
                budget.give_back(tokens)
                alive.remove(request)
                paused.append(request)
                free += kv.num_freeable_blocks(request.request_id)
                kv.free(request.request_id)
                continue
            free -= need
            fitting.append(request)
            given[request.request_id] = (tokens, need)

        for request in new:
            cost = self.try_start(request, budget, free, to_completion=False)
            if cost is None:
                break
            free -= cost
            fitting.append(request)
        return fitting, paused


class StaticBatchScheduler(GuaranteedNoEvictScheduler):
    """No new request until the current batch has drained.

    A batch is formed, when none is running, from the waiting requests in arrival order whose needs to
    completion fit together (up to ``max_num_requests``). Its members are then served, over as many
    iterations as their contexts and outputs take, before anyone else is admitted.
    """

    def __init__(self, *args, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        self._batch: set[int] = set()

    def schedule_request(
        self, active_requests: Sequence[LlmRequest]
    ) -> tuple[list[LlmRequest], list[LlmRequest]]:
        members = [r for r in active_requests if r.request_id in self._batch and self.is_schedulable(r)]
        if not members:
            members = self._form_batch(active_requests)
        started, new = split_started(self, members)
        budget = self.new_budget()
        fitting = [r for r in started if budget.take(r)]
        for request in new:  # the batch was formed on full needs, so any cached prefix is a bonus
            if self.try_start(request, budget, sys.maxsize, to_completion=False) is None:
                break
            fitting.append(request)
        return fitting, []

    def _form_batch(self, active_requests: Sequence[LlmRequest]) -> list[LlmRequest]:
        kv = self.kv_cache_manager
        available = kv.get_max_resource_count()
        members = []
        for request in active_requests:
            if not self.is_schedulable(request):
                continue
            needed = kv.get_needed_resource_to_completion(request)
            if len(members) >= self.max_num_requests or needed > available:
                break
            members.append(request)
            available -= needed
        self._batch = {r.request_id for r in members}
        return members
