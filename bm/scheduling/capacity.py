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
from abc import ABC
from collections.abc import Sequence
from dataclasses import dataclass, field

from bm.kv import KVCacheManager, PrefixMatch
from bm.scheduling.budget import ChunkingConfig, IterationBudget
from bm.scheduling.request import CONTEXT_INIT, GENERATION_STATES, LlmRequest, RequestState
from bm.scheduling.reuse import ContributedBlocks


@dataclass
class CapacityPlan:
    """The capacity stage's decision, with no side effect on requests or the cache.

    ``prefixes``: for each request that starts holding blocks this iteration, the cached prefix it will
    take (``NO_MATCH`` when none); ``prepare_resources`` takes them.
    """

    fitting: list[LlmRequest] = field(default_factory=list)
    paused: list[LlmRequest] = field(default_factory=list)
    prefixes: dict[int, PrefixMatch] = field(default_factory=dict)


class CapacityScheduler(ABC):  # noqa: B024 (schedule_request or plan, either one)
    """Base class of capacity policies. Subclass it to plug in a policy of your own.

    A policy implements ``schedule_request`` as on the scheduler page; the built-in ones implement
    :meth:`plan`, which also says which cached prefix each starting request takes.
    """

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

    def is_schedulable(self, request: LlmRequest) -> bool:
        return self.no_schedule_until_state <= request.state < self.no_schedule_after_state

    def new_budget(self) -> IterationBudget:
        """This iteration's slots and tokens (unbounded tokens when the scheduler was given no budget)."""
        return IterationBudget(self.max_num_requests, self.max_num_tokens or sys.maxsize, self.chunking)

    def plan(self, active_requests: Sequence[LlmRequest]) -> CapacityPlan:
        """The decision for this iteration; by default ``schedule_request``'s, with no cached prefixes."""
        fitting, paused = self.schedule_request(active_requests)
        return CapacityPlan(list(fitting), list(paused))

    def schedule_request(
        self, active_requests: Sequence[LlmRequest]
    ) -> tuple[list[LlmRequest], list[LlmRequest]]:
        """Return ``(fitting_requests, paused_requests)``; subclasses implement this or :meth:`plan`."""
        if type(self).plan is CapacityScheduler.plan:
            raise TypeError(f"{type(self).__name__} must implement schedule_request or plan")
        decision = self.plan(active_requests)
        return decision.fitting, decision.paused

    def try_start(
        self,
        request: LlmRequest,
        budget: IterationBudget,
        free_blocks: int,
        to_completion: bool,
        plan: CapacityPlan,
        releasing: Sequence[int] = (),
    ) -> int | None:
        """Plan to start a new request if it fits, with its cached prefix when block reuse finds one.

        The cached prefix is not computed again, so the budget is asked only for the rest, and blocks
        the prefix takes from the cache count against ``free_blocks`` only when nobody holds them yet
        (``releasing``: requests this plan pauses, whose blocks will be cached by then).
        ``to_completion``: check the blocks it needs to completion (no-evict), else this iteration's.
        Returns the free-pool blocks it uses up, or None when it does not fit (nothing changed then).
        """
        if budget.slots_left <= 0:  # before hashing the prompt for a prefix it could not use
            return None
        kv = self.kv_cache_manager
        match = kv.find_cached_prefix(request, releasing)
        cost = match.cost(kv.get_needed_resource_to_completion(request)) if to_completion else 0
        if cost > free_blocks:
            return None
        tokens = budget.take(request, computed=match.num_tokens)  # the budget sees only what is left
        if tokens and not to_completion:
            if request.beam_width > 1:  # beams are reserved to completion even when others are not
                blocks = kv.get_needed_resource_to_completion(request)
            else:  # its whole context, not this chunk only, so its later chunks never run short
                blocks = kv.num_blocks_for_tokens(request.num_tokens)
            cost = match.cost(blocks)
            if cost > free_blocks:
                budget.give_back(tokens)
                tokens = 0
        if not tokens:
            return None
        plan.prefixes[request.request_id] = match
        plan.fitting.append(request)
        return cost


def split_started(
    scheduler: CapacityScheduler, active_requests: Sequence[LlmRequest]
) -> tuple[list[LlmRequest], list[LlmRequest]]:
    """Schedulable requests that hold blocks (generation first) and those that do not yet, in order.

    Called on every request every iteration, so states and counts are read as attributes: a context
    holds blocks when some of its tokens are computed (:attr:`LlmRequest.holds_blocks`), and the state
    range is :meth:`CapacityScheduler.is_schedulable`'s unless a policy overrides that."""
    generation, contexts, new = [], [], []
    low, high = scheduler.no_schedule_until_state, scheduler.no_schedule_after_state
    custom = type(scheduler).is_schedulable is not CapacityScheduler.is_schedulable
    for request in active_requests:
        state = request.state
        if not (scheduler.is_schedulable(request) if custom else low <= state < high):
            continue
        if state in GENERATION_STATES:
            generation.append(request)
        elif request.num_computed_tokens > 0:
            contexts.append(request)
        else:
            new.append(request)
    return generation + contexts, new


def running_contexts(started: Sequence[LlmRequest]) -> list[LlmRequest]:
    """Contexts under way (chunked, not finished): they go on computing their prefix this iteration."""
    return [r for r in started if r.state == CONTEXT_INIT]


class GuaranteedNoEvictScheduler(CapacityScheduler):
    """Admit a request only when the blocks it needs to completion are still unreserved.

    Requests that already hold blocks reserve their full need first; new requests then enter in arrival
    order until the first that does not fit (first come, first served), so a started request always
    finishes without eviction. With block reuse, a new request whose prefix another context computes this
    iteration waits for it (:mod:`bm.scheduling.reuse`).
    """

    def plan(self, active_requests: Sequence[LlmRequest]) -> CapacityPlan:
        kv = self.kv_cache_manager
        budget = self.new_budget()
        started, new = split_started(self, active_requests)
        plan = CapacityPlan(fitting=budget.take_all(started))
        if not new:  # what the started requests reserve only bounds who starts
            return plan
        # Held blocks count once however many requests share them; cached blocks count as free.
        reserved = kv.get_reserved_resource(started)
        available = kv.get_max_resource_count() - reserved
        contributed = ContributedBlocks(kv, running_contexts(started))
        for request in new:
            if contributed.beneficial_to_skip(request):
                continue
            cost = self.try_start(request, budget, available, True, plan)
            if cost is None:
                break
            available -= cost
        return plan


class MaxUtilizationScheduler(CapacityScheduler):
    """Run as much as fits this iteration; when blocks run short, pause the most recently started.

    Only the blocks this iteration needs are considered, not the need to completion; a context counts its
    whole context though (TensorRT-LLM's rule for a first chunk), so a chunked context that starts can
    finish its context without evicting anyone. Started requests are served oldest first; when one cannot
    get its blocks, the youngest started requests are paused (their blocks freed, their context
    recomputed later) until it can, or it is paused itself if it is the youngest. New requests never
    displace started ones, and none that arrived after a request paused this iteration starts in it.
    With block reuse, a new request whose prefix another context computes this iteration waits for it.
    """

    def plan(self, active_requests: Sequence[LlmRequest]) -> CapacityPlan:
        kv = self.kv_cache_manager
        budget = self.new_budget()
        started, new = split_started(self, active_requests)
        # Beam requests are never paused (their beams could not be recomputed from one context): each
        # reserves what it needs to completion once started, and the others share what is left.
        alive = sorted((r for r in started if r.beam_width == 1), key=lambda r: r.start_order)
        free = kv.get_num_free_blocks() - sum(
            kv.get_remaining_resource_to_completion(r) for r in started if r.beam_width > 1
        )
        plan = CapacityPlan()
        releasing: list[int] = []  # ids of the paused, whose blocks prepare_resources frees first
        given: dict[int, tuple[int, int]] = {}  # request id -> (tokens, blocks) granted

        def pause(victim: LlmRequest) -> int:
            """Blocks pausing ``victim`` gives back, counted over everything paused so far."""
            before = kv.num_blocks_freed_by(releasing)
            releasing.append(victim.request_id)
            plan.paused.append(victim)
            return kv.num_blocks_freed_by(releasing) - before

        for request in started:
            if request in plan.paused:
                continue
            tokens = budget.take(request)
            if not tokens:
                continue
            if request.beam_width > 1:  # its blocks are reserved above
                plan.fitting.append(request)
                continue
            # A generation needs room for its next token; a context under way keeps the rest of its
            # context reserved, as when it started. Both are its known tokens.
            need = kv.num_blocks_to_allocate(request.request_id, request.num_tokens)
            while need > free and alive[-1] is not request:
                victim = alive.pop()
                free += pause(victim)
                if victim.request_id in given:
                    victim_tokens, victim_blocks = given.pop(victim.request_id)
                    plan.fitting.remove(victim)
                    budget.give_back(victim_tokens)
                    free += victim_blocks
            if need > free:  # it is the youngest itself
                budget.give_back(tokens)
                alive.remove(request)
                free += pause(request)
                continue
            free -= need
            plan.fitting.append(request)
            given[request.request_id] = (tokens, need)

        # As in TensorRT-LLM's single pass over the queue, a pause ends it: nothing that arrived after a
        # request paused now starts now (it would take the blocks the pause just gave back).
        position = {r.request_id: i for i, r in enumerate(active_requests)}
        cutoff = min((position[r.request_id] for r in plan.paused), default=len(active_requests))
        contributed = ContributedBlocks(kv, running_contexts(started))
        for request in new:
            if position[request.request_id] > cutoff:
                break
            if contributed.beneficial_to_skip(request):
                continue
            cost = self.try_start(request, budget, free, False, plan, releasing)
            if cost is None:
                break
            free -= cost
        return plan


class StaticBatchScheduler(GuaranteedNoEvictScheduler):
    """No new request until the current batch has drained.

    A batch is formed, when none is running, from the waiting requests in arrival order whose needs to
    completion fit together (up to ``max_num_requests``). Its members are then served, over as many
    iterations as their contexts and outputs take, before anyone else is admitted.
    """

    def __init__(self, *args, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        self._batch: set[int] = set()

    def plan(self, active_requests: Sequence[LlmRequest]) -> CapacityPlan:
        members = [r for r in active_requests if r.request_id in self._batch and self.is_schedulable(r)]
        if not members:
            members = self._form_batch(active_requests)
        started, new = split_started(self, members)
        budget = self.new_budget()
        plan = CapacityPlan(fitting=budget.take_all(started))
        for request in new:  # the batch was formed on full needs, so any cached prefix is a bonus
            if self.try_start(request, budget, sys.maxsize, False, plan) is None:
                break
        return plan

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
