"""The engine core: one iteration of in-flight batching as a flat list of named steps, with no torch.

::

    schedule -> pause -> prepare_resources -> execute -> update -> respond -> stats

The scheduler returns a plan and changes nothing; the KV cache manager's ``prepare_resources`` applies
it (frees the paused, takes cached prefixes, grows tables, forks beam blocks on write), a second plan
grows tables for drafts, and ``update_resources`` applies what the step computed (trims past rejected
drafts, registers full blocks, releases blocks behind the window, forks beam tables). Those two steps
and ``free`` when a request ends are the only places blocks change hands (a test reads the engine's
source for any other call). The executor computes the batch the
core describes and returns sampled tokens. The core runs the same under the torch executor, the fake
one in tests, or a simulator, so every decision it makes is testable without a model.

The core is synchronous and single-threaded; :mod:`bm.engine.batch_manager` puts it on a worker thread
behind the seed's callbacks.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from dataclasses import dataclass, field

from bm.config import BatchingScheme, BmConfig, resolve_engine
from bm.engine.batching import attach_drafts, build_batch, resource_plan
from bm.engine.executor import (
    CacheLayout,
    DraftOutcome,
    ExecutionBatch,
    ExecutionResult,
    Executor,
    WarmupShapes,
    WorkKind,
    warm_up,
)
from bm.engine.fast_forward import DecodeRun, fast_forward, supports_fast_forward
from bm.engine.hol import HeadOfLineWatch
from bm.engine.limits import cache_pools, max_seq_len, window_layout
from bm.engine.peft_cache import PeftCache
from bm.engine.request import Request, RequestError, RequestLimits, Response, error_response, validate_request
from bm.engine.samples import Family, combined_response, fork_siblings
from bm.engine.speculative import NgramConfig, SpecState, can_speculate, request_drafts
from bm.engine.stats import IterationStats, iteration_stats
from bm.engine.stopping import stop_reason
from bm.kv import KVCacheManager, ResourcePlan, ResourceUpdate
from bm.scheduling import FinishReason, LlmRequest, RequestState, SchedulerOutput
from bm.scheduling.factory import build_scheduler

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


@dataclass
class _Counts:
    computed: int = 0
    context: int = 0
    padding: int = 0
    generation: int = 0
    empty_slots: int = 0


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
        model = executor.limits
        # the budgets left unset take the defaults of the device the forwards run on (the simulator's:
        # its hardware row's), so the real engine and a what-if of it resolve the same config
        config = resolve_engine(config, getattr(model, "device_type", "cpu"))
        self.config = config
        self.executor = executor
        self.check_integrity = check_integrity
        self.clock = clock
        engine, kv_cfg = config.engine, config.kv_cache
        self.max_seq_len = max_seq_len(config, model)
        self.max_num_active_requests = engine.max_num_active_requests or engine.max_batch_size
        num_blocks = executor.num_kv_blocks(kv_cfg, self.max_num_active_requests * self.max_seq_len)
        layout = window_layout(config, model, self.max_seq_len)
        # the main table releases behind the window every layer stays within; narrower windows may get
        # pools of their own, which the main pool's share of the memory then grows by
        pools = cache_pools(config, layout, num_blocks, self.max_num_active_requests, self.max_seq_len)
        self.attention_window = pools.attention_window
        num_blocks = pools.num_blocks
        self.kv_cache_manager = KVCacheManager(
            num_blocks,
            kv_cfg.tokens_per_block,
            # V1 is the static baseline: a static-batching engine keeps no prefix cache.
            enable_block_reuse=kv_cfg.enable_block_reuse and engine.batching_scheme != BatchingScheme.V1,
            max_attention_window=self.attention_window,
            sink_token_length=pools.sink_token_length,
            num_layers=pools.num_layers,
            window_groups=pools.window_groups,
            window_sink_token_length=pools.window_sink_token_length,
        )
        executor.bind(
            CacheLayout(
                num_blocks,
                kv_cfg.tokens_per_block,
                min(self.max_seq_len, num_blocks * kv_cfg.tokens_per_block),
                self.attention_window,
                pools.sink_token_length,
                layout if layout.is_mixed else None,
                {g.window: g.num_blocks for g in pools.window_groups},
            )
        )
        # compiles and graph captures happen here, while the engine is built, not in the first steps
        self.warmup = warm_up(
            executor,
            WarmupShapes(
                engine.max_batch_size,
                engine.max_num_tokens,
                min(self.max_seq_len, num_blocks * kv_cfg.tokens_per_block),
            ),
        )
        self.scheduler = build_scheduler(engine, self.kv_cache_manager)
        self.scheme = BatchingScheme(engine.batching_scheme)
        self.max_num_tokens = engine.max_num_tokens
        self.limits = RequestLimits(
            vocab_size=model.vocab_size,
            max_seq_len=self.max_seq_len,
            # with chunking a prompt of any length fits the budget piece by piece
            max_num_tokens=None if engine.enable_chunked_context else engine.max_num_tokens,
            max_beam_width=engine.max_beam_width,
            hidden_size=model.hidden_size,
        )
        peft = config.peft_cache
        self.peft_cache = PeftCache(
            peft.max_adapters, peft.max_bytes, model.weight_bytes, executor.load_adapter
        )
        spec = engine.speculative
        self.ngram = NgramConfig(spec["num_draft_tokens"], spec["max_ngram"]) if spec else None
        # Drafts roll back KV by trimming a single table; V1's lockstep batches and an attention window
        # (blocks released behind it) keep one token a step.
        self.drafts_enabled = self.scheme != BatchingScheme.V1 and self.attention_window is None
        self._active: dict[int, LlmRequest] = {}  # insertion order is arrival order
        # n samples: request id -> its samples while any runs (siblings get negative internal ids, which
        # no user request can have)
        self._families: dict[int, Family] = {}
        self._next_sibling_id = -1
        self._held: list[LlmRequest] = []  # finished, kept by the scheduler (V1 empty slots)
        self._iteration = 0
        self._num_starts = 0
        self._start_time = clock()
        self._can_fast_forward = supports_fast_forward(
            executor,
            self.scheme,
            self.scheduler,
            self.kv_cache_manager,
            attention_window=self.attention_window,
            ngram=self.ngram,
        )
        # (generation ids, stats) of the last iteration when it was a pure decode of every active request
        self._decode: tuple[list[int], IterationStats] | None = None
        self._head_of_line = HeadOfLineWatch(
            engine.max_batch_size, engine.max_num_tokens, bool(engine.enable_chunked_context)
        )
        self.warnings: list[str] = []  # said once each during the run (logged), for the results file

    # -- requests in ----------------------------------------------------------------------------------

    @property
    def num_active(self) -> int:
        return len(self._active)

    def has_request(self, request_id: int) -> bool:
        return request_id in self._active or request_id in self._families

    def add_request(self, request: Request) -> Response | None:
        """Admit a request; returns its final error response instead when it is refused."""
        rid = request.request_id
        if isinstance(rid, int) and (rid in self._active or rid in self._families):
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
        """Run one iteration over the active requests (nothing when none is active)."""
        if not self._active:
            return StepOutput()
        started = self.clock()
        num_active = len(self._active)
        # A request whose LoRA adapter cannot be loaded yet (every slot held) waits unscheduled.
        ready = [r for r in self._active.values() if self.peft_cache.ready(r)]
        if self.kv_cache_manager.window_tables:
            ready = self._within_window_pools(ready)
        plan = self.scheduler.schedule_request(ready)
        blocked = self._head_of_line.observe(ready, plan, self.kv_cache_manager)
        if blocked is not None:
            self.warnings.append(blocked)
            log.warning("bm: %s", blocked)
        prepared = self.kv_cache_manager.prepare_resources(resource_plan(plan))
        self._pause(plan)
        reuse = self._start(plan, prepared.reused_tokens)
        drafts = self._propose_drafts(plan) if self.drafts_enabled else {}
        batch = build_batch(plan, self.kv_cache_manager, self.scheme, self.max_num_tokens)
        batch.block_copies = prepared.copies
        attach_drafts(batch, drafts)
        result = self.executor.execute(batch)
        counts = self._update(batch, result)
        out = StepOutput(schedule=_record(plan), computed_tokens=counts.computed)
        used_blocks = self.kv_cache_manager.pool.num_used_blocks
        layer_blocks = self.kv_cache_manager.num_layer_blocks_in_use()
        saved_layer_blocks = self.kv_cache_manager.num_layer_blocks_saved_by_window()
        self._respond(batch, result, out)
        if self.check_integrity:
            self.verify()
        self._iteration += 1
        now = self.clock()
        out.stats = iteration_stats(
            plan,
            counts,
            self.kv_cache_manager,
            iteration=self._iteration,
            num_active=num_active,
            max_requests=self.max_num_active_requests,
            used_blocks=used_blocks,
            num_finished=len(out.finished_ids),
            elapsed_s=now - self._start_time,
            latency_ms=(now - started) * 1e3,
            reuse=reuse,
        )
        out.stats.num_forwards = result.num_forwards
        out.stats.used_layer_blocks = layer_blocks
        out.stats.saved_layer_blocks = saved_layer_blocks
        out.stats.peft = self.peft_cache.snapshot(num_active - len(ready))
        out.stats.draft_steps = len(result.drafts)
        out.stats.draft_tokens = sum(o.num_draft for o in result.drafts.values())
        out.stats.accepted_draft_tokens = sum(o.num_accepted for o in result.drafts.values())
        self._decode = None
        if (
            self._can_fast_forward
            and len(plan.generation_requests) == num_active
            and not (plan.context_requests or plan.paused_requests or plan.padding or plan.empty_slots)
            and not (out.finished_ids or result.drafts or result.beams or result.faults)
            and not self._families
        ):
            self._decode = ([r.request_id for r in plan.generation_requests], out.stats)
        return out

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

    def _propose_drafts(self, plan: SchedulerOutput) -> dict[int, tuple[list[int], object]]:
        """Drafts for this step's generation requests and for the requests whose last prompt chunk runs
        now (its forward samples the first output token, so it verifies drafts too: a perfect draft
        costs the prompt's forward alone), within the token budget the plan leaves and the free KV
        blocks (a draft never pauses or delays anything: short of room, fewer drafts). Their blocks are
        a second plan the KV manager applies, after the scheduler's."""
        budget = self.max_num_tokens - sum(plan.context_chunk_sizes.values()) - len(plan.generation_requests)
        budget -= sum(w.num_tokens for w in plan.padding) + len(plan.empty_slots)
        kv = self.kv_cache_manager
        free = kv.get_num_free_blocks()
        grows = ResourcePlan()
        out: dict[int, tuple[list[int], object]] = {}
        last_chunks = [
            req
            for req in plan.context_requests
            if req.num_computed_tokens + plan.context_chunk_sizes[req.request_id] == req.num_tokens
        ]
        for req in [*plan.generation_requests, *last_chunks]:
            if budget <= 0:
                break
            if (req.speculation is None and self.ngram is None) or not can_speculate(req):
                continue
            if req.num_pending_samples:  # its last chunk forks the samples from a sampled token
                continue
            room = min(budget, req.max_new_tokens - len(req.output_ids) - 1)
            if room <= 0:
                continue
            drafts, logits = request_drafts(req, self.ngram, room)
            while drafts and kv.num_blocks_to_allocate(req.request_id, req.num_tokens + len(drafts)) > free:
                drafts.pop()
            if not drafts:
                continue
            free -= kv.num_blocks_to_allocate(req.request_id, req.num_tokens + len(drafts))
            grows.grow.append((req.request_id, req.num_tokens + len(drafts)))
            budget -= len(drafts)
            if logits is not None:
                logits = logits[: len(drafts)]
            out[req.request_id] = (drafts, logits)
        kv.prepare_resources(grows)  # in request order, as the blocks were counted
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

    # -- update ---------------------------------------------------------------------------------------

    def _update(self, batch: ExecutionBatch, result: ExecutionResult) -> _Counts:
        """Apply what was computed: progress, new tokens, finish reasons, then the cache's bookkeeping."""
        now = self.clock()
        counts = _Counts()
        for forward in batch.forwards:
            for item in forward:
                req, n = item.request, len(item.token_ids)
                counts.computed += n
                if item.kind is WorkKind.CONTEXT:
                    # drafts after a last prompt chunk count as computed once accepted (_accept_drafts)
                    req.num_computed_tokens += n - item.num_draft
                    counts.context += n - item.num_draft
                    if req.first_scheduled_time is None:
                        req.first_scheduled_time = now
                elif item.kind is WorkKind.PADDING:
                    counts.padding += n
                elif item.kind is WorkKind.GENERATION:
                    req.num_computed_tokens += item.beam == 0  # every beam computes the same position
                    counts.generation += 1
                else:
                    counts.empty_slots += 1
        forking: list[LlmRequest] = []
        for item, token, log_prob in result.sampled:
            if item.kind is not WorkKind.EMPTY_SLOT:
                req = item.request
                self._append_token(req, token, log_prob, now, result.top_log_probs.get(req.request_id))
                if req.num_pending_samples and item.kind is WorkKind.CONTEXT:
                    forking.append(req)
        update = ResourceUpdate()
        for request_id, outcome in result.drafts.items():
            req = self._active[request_id]
            self._accept_drafts(req, outcome, now)
            update.trim.append((request_id, req.num_computed_tokens))
        for forward in batch.forwards:
            for item in forward:
                req = item.request
                if item.kind in (WorkKind.CONTEXT, WorkKind.GENERATION) and req.beam_width == 1:
                    update.computed.append((req, req.num_computed_tokens))
        for request_id, step in result.beams.items():
            req = self._active[request_id]
            req.beam_tokens = step.beam_tokens
            req.output_ids = list(step.beam_tokens[0])
            req.state = RequestState.GENERATION_IN_PROGRESS
            if req.first_token_time is None:
                req.first_token_time = now
            if step.done:
                req.finish_reason = FinishReason.END_ID if step.ended_by_end_id else FinishReason.LENGTH
                req.state = RequestState.GENERATION_TO_COMPLETE
            else:
                update.forks.append((request_id, step.parents))
        for req in forking:
            self._fork_samples(req, update)
        self.kv_cache_manager.update_resources(update)
        return counts

    def _fork_samples(self, parent: LlmRequest, update: ResourceUpdate) -> None:
        """The prompt of an n-sample request is computed: its siblings join the active requests, their
        tables forked from its blocks by the KV manager's update step (:mod:`bm.engine.samples`)."""
        ids = list(range(self._next_sibling_id, self._next_sibling_id - parent.num_pending_samples, -1))
        self._next_sibling_id -= len(ids)
        siblings = fork_siblings(parent, ids)
        for sibling in siblings:
            self._num_starts += 1
            sibling.start_order = self._num_starts
            self.executor.admit(sibling)
            self._active[sibling.request_id] = sibling
        self._families[parent.request_id] = Family(parent, [parent, *siblings])
        update.samples.append((parent.request_id, ids, parent.num_prompt_tokens - 1))

    def _accept_drafts(self, req: LlmRequest, outcome: DraftOutcome, now: float) -> None:
        """Append the accepted drafts and the model's next token (stopping where the request ends); the
        KV of the accepted drafts is kept, the rest of the step's blocks are rolled back (the caller's
        :class:`ResourceUpdate` trims the table to ``num_computed_tokens``)."""
        for token in outcome.tokens:
            self._append_token(req, token, None, now)
            if req.is_finished:
                break
        req.num_computed_tokens += outcome.num_accepted  # the fed token was counted with the item
        if req.speculation is None:
            req.speculation = SpecState()
        spec = req.speculation
        spec.num_draft_tokens += outcome.num_draft
        spec.num_accepted_tokens += outcome.num_accepted
        spec.num_draft_steps += 1

    def _append_token(
        self,
        req: LlmRequest,
        token: int,
        log_prob: float | None,
        now: float,
        top: list[tuple[int, float]] | None = None,
    ) -> None:
        req.output_ids.append(token)
        if req.output_log_probs is not None and log_prob is not None:
            req.output_log_probs.append(log_prob)
        if req.output_top_log_probs is not None and top is not None:
            req.output_top_log_probs.append(top)
        req.state = RequestState.GENERATION_IN_PROGRESS
        if req.first_token_time is None:
            req.first_token_time = now
        reason = stop_reason(req, token)
        if reason is not FinishReason.NOT_FINISHED:
            req.finish_reason = reason
            req.state = RequestState.GENERATION_TO_COMPLETE

    # -- respond --------------------------------------------------------------------------------------

    def _respond(self, batch: ExecutionBatch, result: ExecutionResult, out: StepOutput) -> None:
        """Streamed tokens for every request that produced one; a final response for each that ended
        (and is not held as a V1 empty slot), after its resources are freed."""
        for request_id, message in result.faults.items():
            req = self._active.get(request_id)
            if req is not None:
                req.finish_reason = FinishReason.ERROR
                self._end(req, out, error=message)
        produced: dict[int, LlmRequest] = {}
        for forward in batch.forwards:
            for item in forward:
                if item.sample and item.kind is not WorkKind.EMPTY_SLOT:
                    produced[item.request.request_id] = item.request
        for req in produced.values():
            live = req.streaming and self._active.get(req.request_id) is req
            if live and (not req.is_finished or self.scheduler.holds(req)):
                out.responses.append(self._response(req, final=False))
        ended = [r for r in produced.values() if r.is_finished and self._active.get(r.request_id) is r]
        for req in [*self._held, *ended]:
            if self.scheduler.holds(req) or self._active.get(req.request_id) is not req:
                continue
            self._end(req, out)
        self._held = [r for r in self._active.values() if r.is_finished]

    def _end(self, req: LlmRequest, out: StepOutput, error: str = "") -> None:
        """Finish ``req``; a sample of an n-sample request is held until its last sibling ends, and
        the request's one final response then carries them all."""
        root = req.sample_parent or req
        family = self._families.get(root.request_id)
        if family is None:
            out.responses.append(self._finish(req, error))
            out.finished_ids.append(req.request_id)
            return
        family.done[req.sample_index] = self._finish(req, error)
        if family.complete:
            del self._families[root.request_id]
            out.responses.append(combined_response(family))
            out.finished_ids.append(root.request_id)

    def _finish(self, req: LlmRequest, error: str = "") -> Response:
        """Free everything the request holds and build its final response; its id may then be reused."""
        response = self._response(req, final=True, error=error)
        self.kv_cache_manager.free(req.request_id)
        self.executor.release(req)
        self.peft_cache.release(req)
        self._active.pop(req.request_id, None)
        req.state = RequestState.GENERATION_COMPLETE
        return response

    def _response(self, req: LlmRequest, final: bool, error: str = "") -> Response:
        start = req.num_streamed_tokens if req.streaming else 0
        response = Response(req.request_id, req.output_ids[start:], final=final, error=error)
        req.num_streamed_tokens = len(req.output_ids)
        if req.output_log_probs is not None:
            response.output_log_probs = req.output_log_probs[start:]
            response.cum_log_probs = [sum(req.output_log_probs)]
        if req.output_top_log_probs is not None:
            response.output_top_log_probs = req.output_top_log_probs[start:]
        if final:
            extras = self.executor.final_outputs(req)
            if extras.beams is not None:
                response.beams = extras.beams
                response.output_ids = list(extras.beams[0]) if extras.beams else []
                response.beam_log_probs = extras.beam_log_probs
                end_id = req.sampling.end_id
                response.pad_fill = end_id if end_id >= 0 else req.sampling.pad_id
                if req.controls is not None and req.controls.return_log_probs:
                    response.output_log_probs = (
                        list(extras.beam_log_probs[0]) if extras.beam_log_probs else []
                    )
                    response.cum_log_probs = extras.cum_log_probs
            response.context_logits = extras.context_logits
            response.generation_logits = extras.generation_logits
            response.finish_reason = req.finish_reason
            response.num_pauses = req.num_pauses
            response.num_reused_blocks = req.num_reused_blocks
            response.num_missed_blocks = req.num_missed_blocks
            if req.speculation is not None:
                response.num_draft_tokens = req.speculation.num_draft_tokens
                response.num_accepted_draft_tokens = req.speculation.num_accepted_tokens
                response.num_draft_steps = req.speculation.num_draft_steps
            response.arrival_time = req.arrival_time
            response.first_scheduled_time = req.first_scheduled_time
            response.first_token_time = req.first_token_time
        return response

    # -- ending requests from outside ------------------------------------------------------------------

    def cancel(
        self, request_id: int, reason: FinishReason = FinishReason.CANCELLED, error: str = ""
    ) -> Response | None:
        """End an active request now (a stop signal); None when it is not active."""
        family = self._families.get(request_id)
        members = [m for m in family.members if self._active.get(m.request_id) is m] if family else []
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
            self._end(member, out, error)
        self._decode = None
        return out.responses[0] if out.responses else None

    def finish_all(self, reason: FinishReason, error: str = "") -> list[Response]:
        """End every active request (cancel all, or an internal error)."""
        ids = [
            rid for rid, r in self._active.items() if r.sample_parent is None and rid not in self._families
        ]
        responses = [self.cancel(rid, reason, error) for rid in [*ids, *self._families]]
        self._held.clear()
        return [r for r in responses if r is not None]

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
