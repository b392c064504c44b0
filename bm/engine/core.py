"""The engine core: one iteration of in-flight batching as a flat list of named steps, with no torch.

::

    schedule -> pause -> prepare_resources -> execute -> update -> respond -> stats

The scheduler returns a plan and changes no request; the KV cache manager's ``prepare_resources``
applies it (frees the paused, takes cached prefixes, grows tables, forks beam blocks on write), a second
plan grows tables for drafts, and ``update_resources`` applies what the step computed (trims past
rejected drafts, registers full blocks, releases blocks behind the window, forks beam tables). Those two
steps and ``free`` when a request ends are the only places blocks change hands (a test reads the
engine's source for any other call). The executor computes the batch the core describes and returns
sampled tokens. The core runs the same under the torch executor, the fake one in tests, or a
simulator, so every decision it makes is testable without a model.

What surrounds the step lives beside it: the parts built before the first step
(:mod:`bm.engine.setup`), the step's results applied to its requests (:mod:`bm.engine.progress`),
responses (:mod:`bm.engine.respond`), n-sample families (:mod:`bm.engine.samples`) and drafts
(:mod:`bm.engine.speculative`). The core is synchronous and single-threaded; :mod:`bm.engine.loop`
puts it on a worker thread behind the seed's callbacks.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from dataclasses import dataclass, field

from bm.config import BatchingScheme, BmConfig
from bm.engine.batching import attach_drafts, build_batch, resource_plan
from bm.engine.executor import ExecutionBatch, ExecutionResult, Executor, WorkKind
from bm.engine.fast_forward import DecodeRun, fast_forward, supports_fast_forward
from bm.engine.hol import HeadOfLineWatch
from bm.engine.overlap import (
    Flight,
    is_idle,
    launcher_for,
    mark_pending,
    pauses_pending,
    resolve_overlap,
    restore_pending,
    short_of_length,
    strip_pending,
    survey,
)
from bm.engine.peft_cache import PeftCache
from bm.engine.progress import WorkCounts, apply_tokens, count_work
from bm.engine.request import Request, RequestError, Response, error_response
from bm.engine.respond import produced_requests, response_for
from bm.engine.samples import SampleFamilies
from bm.engine.setup import set_up_core
from bm.engine.speculative import propose_drafts
from bm.engine.stats import CacheUsage, IterationStats, iteration_stats
from bm.engine.validate import validate_request
from bm.kv import PreparedResources
from bm.scheduling import FinishReason, LlmRequest, RequestState, SchedulerOutput

log = logging.getLogger("bm")


@dataclass
class ScheduleRecord:
    """Which requests an iteration scheduled, by id (what conformance tests and stats compare)."""

    context_ids: list[int] = field(default_factory=list)
    context_chunks: dict[int, int] = field(default_factory=dict)
    generation_ids: list[int] = field(default_factory=list)
    paused_ids: list[int] = field(default_factory=list)
    padding_ids: list[int] = field(default_factory=list)
    empty_slot_ids: list[int] = field(default_factory=list)


@dataclass
class StepOutput:
    responses: list[Response] = field(default_factory=list)
    stats: IterationStats | None = None
    schedule: ScheduleRecord = field(default_factory=ScheduleRecord)
    finished_ids: list[int] = field(default_factory=list)
    computed_tokens: int = 0
    # the requests a token was applied to, one entry per token (a discarded row of an ended request is not)
    produced_ids: list[int] = field(default_factory=list)


class EngineCore:
    """Requests in (:meth:`add_request`), one iteration per :meth:`step`, responses out."""

    def __init__(
        self,
        config: BmConfig,
        executor: Executor,
        *,
        check_integrity: bool = False,
        clock: Callable[[], float] = time.perf_counter,
    ) -> None:
        setup = set_up_core(config, executor)
        self.config = config = setup.config
        self.executor = executor
        self.check_integrity = check_integrity
        self.clock = clock
        self.max_seq_len = setup.max_seq_len
        self.max_num_active_requests = setup.max_num_active_requests
        self.kv_cache_manager = setup.kv_cache_manager
        self.attention_window = setup.attention_window
        self.scheduler = setup.scheduler
        self.limits = setup.limits
        self.peft_cache = setup.peft_cache
        self.ngram = setup.ngram
        self.warmup = setup.warmup  # the executor's warm-up report (None: it ran none)
        self.scheme = BatchingScheme(config.engine.batching_scheme)
        self.max_num_tokens = config.engine.max_num_tokens
        # Drafts roll back KV by trimming a single table; V1's lockstep batches and an attention window
        # (blocks released behind it) keep one token a step.
        self.drafts_enabled = self.scheme != BatchingScheme.V1 and self.attention_window is None
        self._active: dict[int, LlmRequest] = {}  # insertion order is arrival order
        self.families = SampleFamilies()
        self._held: list[LlmRequest] = []  # finished, kept by the scheduler (V1 empty slots)
        self._iteration = 0
        self._num_starts = 0
        self._start_time = clock()
        self.warnings: list[str] = []  # said once each during the run (logged), for the results file
        self.overlap, refused = resolve_overlap(
            config.engine.overlap_scheduler,
            executor,
            v1=self.scheme == BatchingScheme.V1,
            ngram=self.ngram is not None,
        )
        if refused is not None:
            self.warnings.append(refused)
            log.warning("bm: %s", refused)
        self.launcher = launcher_for(executor, overlap=self.overlap)
        self._in_flight: Flight | None = None  # overlap: the iteration launched and not yet collected
        self._last_collect: float | None = None  # when the previous iteration's stats were taken
        self._can_fast_forward = not self.overlap and supports_fast_forward(
            executor,
            self.scheme,
            self.scheduler,
            self.kv_cache_manager,
            attention_window=self.attention_window,
            ngram=self.ngram,
        )
        # (generation ids, stats) of the last iteration when it was a pure decode of every active request
        self._decode: tuple[list[int], IterationStats] | None = None
        engine = config.engine
        self._head_of_line = HeadOfLineWatch(
            engine.max_batch_size, engine.max_num_tokens, bool(engine.enable_chunked_context)
        )

    # -- requests in ----------------------------------------------------------------------------------

    @property
    def num_active(self) -> int:
        return len(self._active)

    @property
    def in_flight(self) -> bool:
        """An iteration is launched and not yet collected (overlap): the next step has work to do."""
        return self._in_flight is not None

    def has_request(self, request_id: int) -> bool:
        return request_id in self._active or request_id in self.families

    def add_request(self, request: Request) -> Response | None:
        """Admit a request; returns its final error response instead when it is refused."""
        rid = request.request_id
        if isinstance(rid, int) and self.has_request(rid):
            return error_response(
                rid, f"request id {rid} is already active; an id may be reused after its final response"
            )
        try:
            llm_request = validate_request(request, self.limits)
            if llm_request.num_return_sequences > 1:
                self._check_samples(llm_request)
            self._check_fits(llm_request)
            self.executor.admit(llm_request)
        except RequestError as exc:
            return error_response(rid, str(exc))
        if PeftCache.task_of(llm_request) is not None:
            try:
                self.peft_cache.admit(llm_request)
            except RequestError as exc:
                self.executor.release(llm_request)
                return error_response(rid, str(exc))
        llm_request.arrival_time = self.clock()
        self._active[rid] = llm_request
        self._decode = None
        return None

    def _check_samples(self, request: LlmRequest) -> None:
        """Samples fork one table; V1's static batches and attention windows (blocks released behind the
        window, windowed pools) are not built for it."""
        if self.scheme == BatchingScheme.V1:
            raise RequestError("num_return_sequences: not supported by the V1 batching scheme; send n lines")
        if self.attention_window is not None or self.kv_cache_manager.window_tables:
            raise RequestError("num_return_sequences: not supported with an attention window; send n lines")

    def _check_fits(self, request: LlmRequest) -> None:
        kv = self.kv_cache_manager
        needed = kv.get_needed_resource_to_completion(request)
        if needed > kv.get_max_resource_count():
            raise RequestError(
                f"the request needs {needed} KV cache blocks (prompt {request.num_prompt_tokens} + output "
                f"{request.max_new_tokens} tokens) but the cache holds {kv.get_max_resource_count()} blocks "
                f"of {kv.tokens_per_block} tokens; raise kv_cache.max_tokens or kv_cache.free_memory_fraction, "
                "or lower request_output_len"
            )

    # -- one iteration --------------------------------------------------------------------------------

    def step(self) -> StepOutput:
        """Run one iteration over the active requests (nothing when none is active).

        Without overlap an iteration is launched and collected here. With overlap
        (:mod:`bm.engine.overlap`) the next iteration is launched first and the one in flight collected
        after, so the output carries the previous iteration's tokens and stats (none after the first)."""
        if not self._active and self._in_flight is None:
            return StepOutput()
        out = StepOutput()
        prev, self._in_flight = self._in_flight, None
        if prev is not None and not prev.overlappable:
            self._collect(prev, out)
            prev = None
        started, num_active = self.clock(), len(self._active)
        ready, plan = self._schedule(overlapping=prev is not None)
        if prev is not None and pauses_pending(plan):  # the recompute needs the pending token
            self._collect(prev, out)
            prev = None
            ready, plan = self._schedule(overlapping=False)
        flight = None
        if prev is None or not is_idle(plan):
            flight = self._launch(plan, ready, started, num_active)
        if prev is not None:
            self._collect(prev, out, following=flight)
        elif flight is not None and (not self.overlap or not flight.batch.forwards):
            self._collect(flight, out)
            flight = None
        self._in_flight = flight
        return out

    def _schedule(self, *, overlapping: bool) -> tuple[list[LlmRequest], SchedulerOutput]:
        """The ready requests and the scheduler's plan for them; while an iteration is in flight, a
        request whose pending token is its last is not scheduled again."""
        ready = self._ready()
        if overlapping:
            ready = short_of_length(ready)
        return ready, self.scheduler.schedule_request(ready)

    def _launch(
        self, plan: SchedulerOutput, ready: list[LlmRequest], started: float, num_active: int
    ) -> Flight:
        """Apply the plan to the cache and the requests, build the batch and launch it."""
        self._watch_head_of_line(ready, plan)
        prepared = self.kv_cache_manager.prepare_resources(resource_plan(plan))
        self._pause(plan)
        reuse = self._start(plan, prepared.reused_tokens)
        batch = self._batch(plan, prepared)
        flight = Flight(plan, batch, reuse, started, num_active, len(ready))
        if self.overlap:
            flight.counts = count_work(batch, self.clock())
            survey(flight)
        flight.handle = self.launcher.launch(batch)  # the runtime reads the output so far, unmarked
        if self.overlap:
            mark_pending(flight.sampling)
        return flight

    def _collect(self, flight: Flight, out: StepOutput, following: Flight | None = None) -> None:
        """Read ``flight``'s tokens and apply them (``following``: the iteration launched after it, whose
        placeholders are set aside meanwhile), respond, and write the iteration's stats to ``out``."""
        result, active, empty_slot = self.launcher.collect(flight.handle), self._active, WorkKind.EMPTY_SLOT
        result.sampled = [s for s in result.sampled if active.get((r := s[0].request).request_id) is r]
        out.produced_ids = [i.request.request_id for i, _, _ in result.sampled if i.kind is not empty_slot]
        batch = flight.batch
        if self.overlap:
            strip_pending(flight.sampling)
            if following is not None:
                strip_pending(following.sampling)
        counts = self._update(flight, result)
        out.schedule, out.computed_tokens = _record(flight.plan), counts.computed
        usage = CacheUsage.of(self.kv_cache_manager)
        self._respond(batch, result, out)
        if self.check_integrity:
            self.verify()
        if following is not None:
            restore_pending(following.sampling, self._active)
        self._iteration += 1
        out.stats = self._stats(flight, counts, result, usage, out)
        self._remember_decode(flight.plan, result, out, flight.num_active)

    def _ready(self) -> list[LlmRequest]:
        """The active requests the scheduler sees: not one whose LoRA adapter cannot be loaded yet (every
        slot held), nor, with windowed pools, one beyond what the pools are sized for."""
        ready = self.peft_cache.ready_requests(self._active.values())
        return self._within_window_pools(ready) if self.kv_cache_manager.window_tables else ready

    def _watch_head_of_line(self, ready: list[LlmRequest], plan: SchedulerOutput) -> None:
        blocked = self._head_of_line.observe(ready, plan, self.kv_cache_manager)
        if blocked is not None:
            self.warnings.append(blocked)
            log.warning("bm: %s", blocked)

    def _batch(self, plan: SchedulerOutput, prepared: PreparedResources) -> ExecutionBatch:
        """The executor's batch for ``plan``, with the blocks to copy and any drafts to verify."""
        drafts = {}
        if self.drafts_enabled:
            drafts = propose_drafts(plan, self.kv_cache_manager, self.ngram, self.max_num_tokens)
        batch = build_batch(plan, self.kv_cache_manager, self.scheme, self.max_num_tokens)
        batch.block_copies = prepared.copies
        attach_drafts(batch, drafts)
        return batch

    def _stats(
        self,
        flight: Flight,
        counts: WorkCounts,
        result: ExecutionResult,
        usage: CacheUsage,
        out: StepOutput,
    ) -> IterationStats:
        """The iteration's stats line (the seed's fields and bm's)."""
        now = self.clock()
        # An iteration's latency runs from its launch, or from the previous iteration's collection if
        # that came later: under overlap the two are in flight together, and counting from launch would
        # count each stretch twice (latencies summing to twice the run). In order, launch comes later.
        begin = flight.started if self._last_collect is None else max(flight.started, self._last_collect)
        self._last_collect = now
        stats = iteration_stats(
            flight.plan,
            counts,
            self.kv_cache_manager,
            iteration=self._iteration,
            num_active=flight.num_active,
            max_requests=self.max_num_active_requests,
            used_blocks=usage.used_blocks,
            num_finished=len(out.finished_ids),
            elapsed_s=now - self._start_time,
            latency_ms=(now - begin) * 1e3,
            reuse=flight.reuse,
        )
        stats.num_forwards = result.num_forwards
        stats.used_layer_blocks = usage.layer_blocks
        stats.saved_layer_blocks = usage.saved_layer_blocks
        stats.peft = self.peft_cache.snapshot(flight.num_active - flight.num_ready)
        stats.draft_steps = len(result.drafts)
        stats.draft_tokens = sum(o.num_draft for o in result.drafts.values())
        stats.accepted_draft_tokens = sum(o.num_accepted for o in result.drafts.values())
        return stats

    def _remember_decode(
        self, plan: SchedulerOutput, result: ExecutionResult, out: StepOutput, num_active: int
    ) -> None:
        """Keep the step as fast-forward's template when it decoded every active request and nothing
        else happened (no start, pause, end, draft, beam or fault)."""
        self._decode = None
        if (
            self._can_fast_forward
            and len(plan.generation_requests) == num_active
            and not (plan.context_requests or plan.paused_requests or plan.padding or plan.empty_slots)
            and not (out.finished_ids or result.drafts or result.beams or result.faults)
            and not self.families
        ):
            self._decode = ([r.request_id for r in plan.generation_requests], out.stats)

    def fast_forward(self, until: float = float("inf")) -> DecodeRun | None:
        """Right after a :meth:`step` that decoded every active request: advance the iterations that
        provably repeat it (:mod:`bm.engine.fast_forward`), starting none at or after clock time
        ``until``. None when the executor cannot, or nothing can be skipped."""
        decode, self._decode = self._decode, None
        if decode is None:
            return None
        generation_ids, template = decode
        if len(generation_ids) != len(self._active):
            return None
        run = fast_forward(
            [self._active[rid] for rid in generation_ids],
            self.kv_cache_manager,
            self.executor,  # supports_fast_forward checked that it offers decode_run
            self.clock,
            template,
            until,
            first_iteration=self._iteration + 1,
            engine_start_s=self._start_time,
        )
        if run is not None:
            self._iteration += run.num_iterations
            if self.check_integrity:
                self.verify()
        return run

    def _within_window_pools(self, ready: list[LlmRequest]) -> list[LlmRequest]:
        """Windowed pools are sized for ``max_num_active_requests`` requests holding blocks: beyond that,
        a request not started yet waits unscheduled (the engine loop never queues more anyway)."""
        kv = self.kv_cache_manager
        room = self.max_num_active_requests - kv.num_requests
        out = []
        for request in ready:
            if not kv.has_request(request.request_id):
                if room <= 0:
                    continue
                room -= 1
            out.append(request)
        return out

    def _pause(self, plan: SchedulerOutput) -> None:
        """Paused requests (their blocks already freed) wait in the queue and recompute prompt + output."""
        for req in plan.paused_requests:
            req.pause()

    def _start(self, plan: SchedulerOutput, reused_tokens: dict[int, int]) -> tuple[int, int]:
        """Requests starting to hold blocks now: their cached prefix counts as computed, and they get a
        start order (MAX_UTILIZATION pauses the latest first). Returns (reused, missed) blocks."""
        reused = missed = 0
        for req in plan.context_requests:
            if req.holds_blocks:
                continue
            self._num_starts += 1
            req.start_order = self._num_starts
            match = plan.prefixes.get(req.request_id)
            if match is None:
                continue
            req.num_computed_tokens = reused_tokens.get(req.request_id, 0)
            if self.kv_cache_manager.enable_block_reuse:
                req.num_reused_blocks += match.num_blocks
                req.num_missed_blocks += match.num_missed_blocks
                reused += match.num_blocks
                missed += match.num_missed_blocks
        return reused, missed

    def _update(self, flight: Flight, result: ExecutionResult) -> WorkCounts:
        """Apply what was computed (:mod:`bm.engine.progress`): progress (counted at launch under
        overlap), new tokens, finish reasons; an n-sample request whose prompt is done forks its
        samples; then the cache's bookkeeping."""
        now = self.clock()
        batch = flight.batch
        counts = flight.counts if flight.counts is not None else count_work(batch, now)
        lengths, active = self.kv_cache_manager.reads_computed_lengths, self._active
        update, forking = apply_tokens(batch, result, active, now, lengths and flight.counts is None)
        if lengths and flight.counts is not None:  # the lengths this iteration computed, of the held
            update.computed = [(r, n) for r, n in flight.computed if active.get(r.request_id) is r]
        for parent in forking:
            for sibling in self.families.fork(parent, update):
                self._num_starts += 1
                sibling.start_order = self._num_starts
                self.executor.admit(sibling)
                self._active[sibling.request_id] = sibling
        self.kv_cache_manager.update_resources(update)
        return counts

    # -- respond --------------------------------------------------------------------------------------

    def _respond(self, batch: ExecutionBatch, result: ExecutionResult, out: StepOutput) -> None:
        """Streamed tokens for every request that produced one; a final response for each that ended
        (and is not held as a V1 empty slot), after its resources are freed."""
        for request_id, message in result.faults.items():
            req = self._active.get(request_id)
            if req is not None:
                req.finish_reason = FinishReason.ERROR
                self._end(req, out, error=message)
        ended = []  # one pass: streamed tokens go out first, then the final responses
        for req in produced_requests(batch):
            if self._active.get(req.request_id) is not req:
                continue
            finished = req.is_finished
            if req.streaming and (not finished or self.scheduler.holds(req)):
                out.responses.append(response_for(req, final=False))
            if finished:
                ended.append(req)
        for req in [*self._held, *ended]:
            if self.scheduler.holds(req) or self._active.get(req.request_id) is not req:
                continue
            self._end(req, out)
        self._held = [r for r in self._active.values() if r.is_finished]

    def _end(self, req: LlmRequest, out: StepOutput, error: str = "") -> None:
        """Finish ``req``: its resources are freed, and its request's final response goes out (for a
        sample of an n-sample request, once its last sibling has ended)."""
        response = self.families.settle(req, self._finish(req, error))
        if response is not None:
            out.responses.append(response)
            out.finished_ids.append(response.request_id)

    def _finish(self, req: LlmRequest, error: str = "") -> Response:
        """Free everything the request holds and build its final response; its id may then be reused."""
        response = response_for(req, final=True, error=error, extras=self.executor.final_outputs(req))
        self.kv_cache_manager.free(req.request_id)
        self.executor.release(req)
        self.peft_cache.release(req)
        self._active.pop(req.request_id, None)
        req.state = RequestState.GENERATION_COMPLETE
        return response

    # -- ending requests from outside ------------------------------------------------------------------

    def cancel(
        self, request_id: int, reason: FinishReason = FinishReason.CANCELLED, error: str = ""
    ) -> Response | None:
        """End an active request now (a stop signal); None when it is not active."""
        members = [m for m in self.families.members(request_id) if self._active.get(m.request_id) is m]
        req = self._active.get(request_id)
        if req is not None and req.sample_parent is not None:
            return None  # a sample ends with its request
        if req is None and not members:
            return None
        out = StepOutput()
        for member in members or [req]:
            if not member.is_finished:
                member.finish_reason = reason
            self._held = [r for r in self._held if r is not member]
            strip_pending([member])  # its row in flight, if any, is thrown away
            self._end(member, out, error)
        self._decode = None
        self._drop_orphan_flight()
        return out.responses[0] if out.responses else None

    def finish_all(self, reason: FinishReason, error: str = "") -> list[Response]:
        """End every active request (cancel all, or an internal error)."""
        ids = [rid for rid, r in self._active.items() if r.sample_parent is None and rid not in self.families]
        responses = [self.cancel(rid, reason, error) for rid in [*ids, *self.families.root_ids()]]
        self._held.clear()
        return [r for r in responses if r is not None]

    def _drop_orphan_flight(self) -> None:
        """With nothing active left, an iteration in flight holds only rows of ended requests: collect
        it and throw it away, rather than leave it for the next request's first step to report."""
        if self._in_flight is not None and not self._active:
            self.launcher.collect(self._in_flight.handle)
            self._in_flight = None

    # -- stats and checks -----------------------------------------------------------------------------

    def verify(self) -> None:
        """The cache's own invariants, and every block table belongs to an active request."""
        kv = self.kv_cache_manager
        kv.check_integrity()
        stray = [rid for rid in kv.request_ids() if rid not in self._active]
        if stray:
            raise AssertionError(f"block tables belong to no active request: {stray}")


def _record(plan: SchedulerOutput) -> ScheduleRecord:
    return ScheduleRecord(
        context_ids=[r.request_id for r in plan.context_requests],
        context_chunks=dict(plan.context_chunk_sizes),
        generation_ids=[r.request_id for r in plan.generation_requests],
        paused_ids=[r.request_id for r in plan.paused_requests],
        padding_ids=[w.request.request_id for w in plan.padding],
        empty_slot_ids=[s.request.request_id for s in plan.empty_slots],
    )
