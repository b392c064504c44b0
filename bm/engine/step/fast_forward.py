"""Steady decode in one call: many pure-generation iterations whose decisions are already known.

Between two events (an arrival, a request finishing, a KV block that might not be there) an in-flight
batch of generating requests repeats the same iteration: the scheduler picks the same requests in the
same order, each computes one token, and the only things that change are positions, tables growing at
block boundaries and the clock. A simulated trace spends most of its iterations there, and stepping each
one through the scheduler costs far more than the cost model that times it.

:func:`fast_forward` advances such a stretch at once and produces what the step-by-step loop would: the
same tokens, the same block allocations and registrations in the same order (so block ids, reuse and
eviction are unchanged), and each iteration's stats and end time. It only runs when every decision in
the stretch is provably the one the scheduler would take:

- the last iteration scheduled every active request as generation (nothing queued, paused, chunked,
  padded or held as an empty slot) and none finished;
- no request can finish inside the stretch (it stops one token short of the first ``max_new_tokens``)
  and none can stop on a token (no stop words; the executor's tokens are never the end id);
- the free pool covers every block the stretch allocates, so MAX_UTILIZATION never pauses, and a
  no-evict policy has nothing new to admit;
- the policy is one of bm's built-in capacity and micro-batch schedulers under an in-flight scheme
  (a user's scheduler might decide on something else), with no attention window, drafts, beams or
  streaming responses.

The executor must offer ``decode_run`` (the simulator does): it times the iterations one after the
other on its clock, stopping before the caller's deadline (the next arrival), and returns the tokens.
Everything else (tables, registrations, request progress) is applied here, through the KV cache
manager's own methods, in step order.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass, replace
from typing import Protocol

from bm.config import BatchingScheme
from bm.engine.execution.protocol import ExecutionResult
from bm.engine.outputs.stats import IterationStats
from bm.kv import KVCacheManager, ResourcePlan, ResourceUpdate
from bm.scheduling import LlmRequest, RequestState, SchedulerOutput
from bm.scheduling.capacity import GuaranteedNoEvictScheduler, MaxUtilizationScheduler, StaticBatchScheduler
from bm.scheduling.micro_batch import MicroBatchScheduler
from bm.scheduling.scheduler import RequestScheduler, SimpleScheduler

_BUILT_IN_CAPACITY = (GuaranteedNoEvictScheduler, MaxUtilizationScheduler, StaticBatchScheduler)


class DecodeRunExecutor(Protocol):
    def decode_run(
        self, requests: list[LlmRequest], max_iterations: int, until: float
    ) -> tuple[list[float], list[list[int]]]:
        """Time up to ``max_iterations`` iterations of one generation token per request (``requests`` in
        batch order), starting no iteration at or after clock time ``until``. Returns each iteration's
        end time on the clock and, per request, the tokens sampled (never its end id)."""
        ...


@dataclass
class DecodeRun:
    """What :func:`fast_forward` advanced: ``len(end_times)`` iterations of ``request_ids``.

    Per iteration ``j``: the clock at its end ``end_times[j]`` and the blocks used and cached after it;
    with ``template`` that is every field of its stats row (``bm.bench.simulated.decode_rows`` writes them).
    """

    request_ids: list[int]
    start_s: float  # the clock before the first iteration
    end_times: list[float]
    used_blocks: list[int]
    cached_blocks: list[int]
    first_iteration: int  # the iteration counter of the first
    engine_start_s: float  # the core's clock origin (stats' elapsed time)
    template: IterationStats  # the fields every iteration of the run shares
    num_layers: int = 1  # layers one main-pool block serves (stats count layer blocks with it)

    @property
    def num_iterations(self) -> int:
        return len(self.end_times)


class DecodeTemplate:
    """Fast-forward's template: the last iteration, when it decoded every active request and nothing
    else happened (no start, pause, end, draft, beam or fault). The core shows it every iteration it
    collects (:meth:`observe`) and has it forgotten whenever a request comes or goes."""

    def __init__(self, enabled: bool) -> None:
        self.enabled = enabled  # supports_fast_forward, asked once
        self.remembered: tuple[list[int], IterationStats] | None = None

    def forget(self) -> None:
        self.remembered = None

    def observe(
        self,
        plan: SchedulerOutput,
        result: ExecutionResult,
        stats: IterationStats | None,
        *,
        num_active: int,
        num_finished: int,
        sampling_families: bool,
    ) -> None:
        self.remembered = None
        if (
            self.enabled
            and stats is not None
            and len(plan.generation_requests) == num_active
            and not (plan.context_requests or plan.paused_requests or plan.padding or plan.empty_slots)
            and not (num_finished or result.drafts or result.beams or result.faults)
            and not sampling_families
        ):
            self.remembered = ([r.request_id for r in plan.generation_requests], stats)

    def take(self, active: Mapping[int, LlmRequest]) -> tuple[list[LlmRequest], IterationStats] | None:
        """The remembered iteration's requests (still every active one) and its stats, once."""
        last, self.remembered = self.remembered, None
        if last is None or len(last[0]) != len(active):
            return None
        return [active[rid] for rid in last[0]], last[1]


def supports_fast_forward(
    executor: object,
    scheme: BatchingScheme,
    scheduler: RequestScheduler,
    kv: KVCacheManager,
    *,
    attention_window: int | None,
    ngram: object | None,
) -> bool:
    """Whether an engine so configured allows stretches at all (the core asks once)."""
    return (
        callable(getattr(executor, "decode_run", None))
        and scheme in (BatchingScheme.INFLIGHT_FUSED, BatchingScheme.INFLIGHT)
        and attention_window is None
        and not kv.window_tables  # narrower windows release blocks as they go
        and ngram is None
        and type(scheduler) is SimpleScheduler
        and type(scheduler.capacity_scheduler) in _BUILT_IN_CAPACITY
        and type(scheduler.micro_batch_scheduler) is MicroBatchScheduler
    )


def _steady(req: LlmRequest) -> bool:
    controls = req.controls
    return (
        req.state == RequestState.GENERATION_IN_PROGRESS
        and req.beam_width == 1
        and not req.streaming
        and req.speculation is None
        and (controls is None or not controls.stop_words_list)
    )


def fast_forward(
    requests: list[LlmRequest],
    kv: KVCacheManager,
    executor: DecodeRunExecutor,
    clock: Callable[[], float],
    template: IterationStats,
    until: float,
    *,
    first_iteration: int,
    engine_start_s: float,
) -> DecodeRun | None:
    """Advance the pure-decode stretch that follows an iteration which scheduled ``requests`` (every
    active request, in batch order) and reported ``template``; None when no iteration can be skipped.

    The caller (the core) passes what it owns and counts the iterations itself; the stretch's blocks
    change hands only through the KV manager's plan and update steps, one pair per iteration that has
    block events, in step order."""
    if not requests or not all(_steady(r) for r in requests):
        return None
    horizon = min(r.max_new_tokens - len(r.output_ids) for r in requests) - 1
    if horizon <= 0:
        return None
    horizon, events = _block_events(requests, kv, horizon)
    if horizon <= 0:
        return None
    start_s = clock()
    end_times, tokens = executor.decode_run(requests, horizon, until)
    done = len(end_times)
    if done == 0:
        return None
    for req, new in zip(requests, tokens, strict=True):
        req.output_ids.extend(new)
        req.num_computed_tokens += done
    used: list[int] = []
    cached: list[int] = []
    pool = kv.pool
    position = 0
    for j in range(done):
        plan, update = ResourcePlan(), ResourceUpdate()
        while position < len(events) and events[position][0] == j:
            _, kind, index = events[position]
            req = requests[index]
            if kind == 0:
                plan.grow.append((req.request_id, req.num_tokens - done + j))
            else:
                update.computed.append((req, req.num_computed_tokens - done + j + 1))
            position += 1
        if plan.grow:
            kv.prepare_resources(plan)
        if update:
            kv.update_resources(update)
        used.append(pool.num_used_blocks)
        cached.append(pool.num_cached_blocks)
    return DecodeRun(
        request_ids=[r.request_id for r in requests],
        start_s=start_s,
        end_times=end_times,
        used_blocks=used,
        cached_blocks=cached,
        first_iteration=first_iteration,
        engine_start_s=engine_start_s,
        template=replace(template, finished_requests=0, reused_blocks=0, missed_blocks=0),
        num_layers=kv.num_layers,
    )


def _block_events(
    requests: list[LlmRequest], kv: KVCacheManager, horizon: int
) -> tuple[int, list[tuple[int, int, int]]]:
    """The stretch's block events in step order, ``(iteration, 0 = allocation / 1 = registration, batch
    position)``, and its horizon: cut before the iteration whose block the free pool might not hold."""
    bs = kv.tokens_per_block
    events: list[tuple[int, int, int]] = []
    allocations = 0
    for index, req in enumerate(requests):
        fed = req.num_tokens  # tokens the table must hold in the run's first iteration
        held = len(kv.block_ids(req.request_id))
        j = max(0, held * bs + 1 - fed)  # the first iteration that needs a new block
        while j < horizon:
            events.append((j, 0, index))
            allocations += 1
            j += bs
    free = kv.get_num_free_blocks()
    if allocations > free:  # stop before the iteration that might not get its block
        events.sort()
        horizon = events[free][0]
        if horizon <= 0:
            return 0, []
    if kv.enable_block_reuse:
        for index, req in enumerate(requests):
            computed = req.num_computed_tokens  # after iteration j: computed + j + 1
            j = bs - 1 - computed % bs  # the first iteration that fills a block
            while j < horizon:
                events.append((j, 1, index))
                j += bs
    events.sort()
    return horizon, events
