"""The engine core: one iteration of in-flight batching as a flat list of named steps, with no torch.

::

    schedule -> pause -> prepare_resources -> execute -> update -> respond -> stats

:meth:`EngineCore.plain_step` runs them in that order; :meth:`EngineCore.overlapped_step` launches the
next iteration before it collects the one in flight (:mod:`bm.engine.step.overlap`), from the same two
parts: ``_launch`` (pause, prepare resources, execute) and ``_collect`` (update, respond, stats).
The scheduler returns a plan and changes no request; the KV cache manager's ``prepare_resources``
applies it, a second plan grows tables for drafts, and ``update_resources`` applies what the step
computed. Those two steps and ``free`` when a request ends are the only places blocks change hands (a
test reads the engine's source for any other call). The core runs the same under the torch executor,
the fake one in tests, or a simulator, so every decision it makes is testable without a model.

Around the step, each in its own module: the parts built before the first step (:mod:`~bm.engine.step.setup`),
admission and the gates before scheduling (:mod:`~bm.engine.step.admission`), the step's results applied to
its requests (:mod:`~bm.engine.step.apply`), responses (:mod:`~bm.engine.outputs.respond`), n-sample families
(:mod:`~bm.engine.requests.samples`), drafts (:mod:`~bm.engine.requests.speculative`), the head-of-line watch
(:mod:`~bm.engine.step.hol`) and fast-forward's template (:mod:`~bm.engine.step.fast_forward`).
:mod:`bm.engine.driving.loop` puts the core on a worker thread.
"""

from __future__ import annotations

import itertools
import logging
import time
from collections.abc import Callable

from bm.config import BatchingScheme, BmConfig
from bm.engine.execution.peft_cache import PeftCache
from bm.engine.execution.protocol import ExecutionBatch, ExecutionResult, Executor, WorkKind
from bm.engine.outputs.respond import produced_requests, response_for
from bm.engine.outputs.stats import CacheUsage, IterationStats, iteration_stats
from bm.engine.outputs.step_output import ScheduleRecord, StepOutput
from bm.engine.requests.request import Request, RequestError, Response, error_response
from bm.engine.requests.samples import SampleFamilies
from bm.engine.requests.speculative import propose_drafts
from bm.engine.requests.validate import validate_request
from bm.engine.step.admission import check_fits, check_samples, ready_requests
from bm.engine.step.apply import WorkCounts, apply_tokens, count_work, start_requests
from bm.engine.step.batching import attach_drafts, build_batch, resource_plan
from bm.engine.step.fast_forward import DecodeRun, DecodeTemplate, fast_forward, supports_fast_forward
from bm.engine.step.hol import HeadOfLineWatch
from bm.engine.step.overlap import (
    Flight,
    is_idle,
    launcher_for,
    mark_pending,
    pauses_pending,
    resolve_overlap,
    settle_pending,
    short_of_length,
    survey,
)
from bm.engine.step.setup import set_up_core
from bm.kv import PreparedResources
from bm.scheduling import FinishReason, LlmRequest, RequestState, SchedulerOutput

__all__ = ["EngineCore", "ScheduleRecord", "StepOutput"]

log = logging.getLogger("bm")


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
        self._starts = itertools.count(1)  # start orders: MAX_UTILIZATION pauses the latest first
        self._start_time = clock()
        self.warnings: list[str] = []  # said once each during the run (logged), for the results file
        self.overlap, refused = resolve_overlap(
            config.engine.overlap_scheduler,
            executor,
            v1=self.scheme == BatchingScheme.V1,
            ngram=self.ngram is not None,
        )
        self._warn(refused)
        self.launcher = launcher_for(executor, overlap=self.overlap)
        self._in_flight: Flight | None = None  # overlap: the iteration launched and not yet collected
        self._last_collect: float | None = None  # when the previous iteration's stats were taken
        self.decode_template = DecodeTemplate(
            not self.overlap
            and supports_fast_forward(
                executor,
                self.scheme,
                self.scheduler,
                self.kv_cache_manager,
                attention_window=self.attention_window,
                ngram=self.ngram,
            )
        )
        self._head_of_line = HeadOfLineWatch.for_engine(config.engine)

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
                windowed = self.attention_window is not None or bool(self.kv_cache_manager.window_tables)
                check_samples(v1=self.scheme == BatchingScheme.V1, windowed=windowed)
            check_fits(llm_request, self.kv_cache_manager)
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
        self.decode_template.forget()
        return None

    # -- one iteration --------------------------------------------------------------------------------

    def step(self) -> StepOutput:
        """Run one iteration over the active requests (nothing when none is active): in order, or
        overlapped with the next when the core overlaps (:mod:`bm.engine.step.overlap`)."""
        return self.overlapped_step() if self.overlap else self.plain_step()

    def plain_step(self) -> StepOutput:
        """The seed's iteration, each part in turn: schedule; pause, prepare resources and execute
        (:meth:`_launch`); update, respond and stats (:meth:`_collect`)."""
        out = StepOutput()
        if not self._active:
            return out
        started, num_active = self.clock(), len(self._active)
        ready, plan = self._schedule()
        flight = self._launch(plan, ready, started, num_active)
        self._collect(flight, out)
        return out

    def overlapped_step(self) -> StepOutput:
        """Launch the next iteration, then collect the one in flight, from the same parts: the output
        carries the previous iteration's tokens and stats (none after the first). An iteration that
        cannot run ahead of its tokens, or a plan pausing a request whose token is pending, is
        collected before the next launch; an iteration with nothing to compute, at once."""
        out, prev, self._in_flight = StepOutput(), self._in_flight, None
        if not self._active and prev is None:
            return out
        if prev is not None and not prev.overlappable:
            self._collect(prev, out)
            prev = None
        started, num_active = self.clock(), len(self._active)
        ready, plan = self._schedule(overlapping=prev is not None)
        if prev is not None and pauses_pending(plan):
            self._collect(prev, out)
            prev = None
            ready, plan = self._schedule()
        flight = (
            None if prev is not None and is_idle(plan) else self._launch(plan, ready, started, num_active)
        )
        if prev is not None:
            self._collect(prev, out)
        elif flight is not None and not flight.batch.forwards:
            self._collect(flight, out)
            flight = None
        self._in_flight = flight
        return out

    def _schedule(self, *, overlapping: bool = False) -> tuple[list[LlmRequest], SchedulerOutput]:
        """The ready requests (:func:`~bm.engine.step.admission.ready_requests`) and the scheduler's plan for
        them; while an iteration is in flight, a request whose pending token is its last is not
        scheduled again."""
        kv = self.kv_cache_manager
        ready = ready_requests(self._active.values(), self.peft_cache, kv, self.max_num_active_requests)
        if overlapping:
            ready = short_of_length(ready)
        return ready, self.scheduler.schedule_request(ready)

    def _launch(
        self, plan: SchedulerOutput, ready: list[LlmRequest], started: float, num_active: int
    ) -> Flight:
        """Pause, prepare resources and execute: the plan applied to the cache and the requests, the
        batch built and launched (under overlap its sampled tokens then count as pending)."""
        self._warn(self._head_of_line.observe(ready, plan, self.kv_cache_manager))
        prepared = self.kv_cache_manager.prepare_resources(resource_plan(plan))
        for req in plan.paused_requests:  # their blocks are freed: back to the queue, to recompute
            req.pause()
        reuse = start_requests(
            plan, prepared.reused_tokens, self._starts, self.kv_cache_manager.enable_block_reuse
        )
        batch = self._batch(plan, prepared)
        flight = Flight(plan, batch, reuse, started, num_active, len(ready))
        if self.overlap:
            flight.counts = count_work(batch, self.clock())
            survey(flight)
        flight.handle = self.launcher.launch(batch)
        mark_pending(flight.sampling)  # empty without overlap: survey fills it
        return flight

    def _collect(self, flight: Flight, out: StepOutput) -> None:
        """Update, respond and stats: read ``flight``'s tokens and apply them, respond, and write the
        iteration's stats to ``out``."""
        result, active, empty_slot = self.launcher.collect(flight.handle), self._active, WorkKind.EMPTY_SLOT
        result.sampled = [s for s in result.sampled if active.get((r := s[0].request).request_id) is r]
        out.produced_ids = [i.request.request_id for i, _, _ in result.sampled if i.kind is not empty_slot]
        settle_pending(flight.sampling)
        counts = self._update(flight, result)
        out.schedule, out.computed_tokens = ScheduleRecord.of(flight.plan), counts.computed
        usage = CacheUsage.of(self.kv_cache_manager)
        self._respond(flight.batch, result, out)
        if self.check_integrity:
            self.verify()
        self._iteration += 1
        out.stats = self._stats(flight, counts, result, usage, out)
        self.decode_template.observe(
            flight.plan,
            result,
            out.stats,
            num_active=flight.num_active,
            num_finished=len(out.finished_ids),
            sampling_families=bool(self.families),
        )

    def _warn(self, message: str | None) -> None:
        """Say ``message`` once, now (logged) and in the results file (:attr:`warnings`)."""
        if message is not None:
            self.warnings.append(message)
            log.warning("bm: %s", message)

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
        return iteration_stats(
            flight.plan,
            counts,
            self.kv_cache_manager,
            iteration=self._iteration,
            num_active=flight.num_active,
            max_requests=self.max_num_active_requests,
            usage=usage,
            result=result,
            num_finished=len(out.finished_ids),
            elapsed_s=now - self._start_time,
            latency_ms=(now - begin) * 1e3,
            reuse=flight.reuse,
            peft=self.peft_cache.snapshot(flight.num_active - flight.num_ready),
        )

    def fast_forward(self, until: float = float("inf")) -> DecodeRun | None:
        """Right after a :meth:`step` that decoded every active request: advance the iterations that
        provably repeat it (:mod:`bm.engine.step.fast_forward`), starting none at or after clock time
        ``until``. None when the executor cannot, or nothing can be skipped."""
        taken = self.decode_template.take(self._active)
        if taken is None:
            return None
        requests, template = taken
        run = fast_forward(
            requests,
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

    def _update(self, flight: Flight, result: ExecutionResult) -> WorkCounts:
        """Apply what was computed (:mod:`bm.engine.step.apply`): progress (counted at launch under
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
                sibling.start_order = next(self._starts)
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
            member.num_pending = 0  # its row in flight, if any, is thrown away
            self._end(member, out, error)
        self.decode_template.forget()
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
