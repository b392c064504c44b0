"""The torch executor: runs the engine core's batches through the model and samples.

It owns every tensor of an iteration: the packed forward (:class:`ModelRunner`), the block copies a beam
fork asks for, context/generation logits kept for the response, and decoding (controls, sampling, beam
steps). Block tables, positions and what to sample come from the core; nothing here allocates a block.
"""

from __future__ import annotations

from dataclasses import replace
from typing import Any

import torch

from bm.config import KvCacheConfig
from bm.engine.execution.protocol import (
    PENDING_TOKEN,
    BeamStep,
    CacheLayout,
    ExecutionBatch,
    ExecutionResult,
    FinalOutputs,
    ModelLimits,
    WarmupShapes,
    WorkItem,
    WorkKind,
)
from bm.engine.requests.model_inputs import LoraSpec
from bm.runtime.backends import InputFill
from bm.runtime.beam_search import BeamSearch
from bm.runtime.decoding import Decoder, DecodeResult
from bm.runtime.grammar import GrammarRuntime
from bm.runtime.kv_sizing import num_kv_blocks
from bm.runtime.launched import Launched, copy_to_host, sampled_tokens, take_samples
from bm.runtime.logits import DecodingState, PendingTokens
from bm.runtime.lora import LoraLayers
from bm.runtime.model_loader import LoadedModel, available_memory_bytes
from bm.runtime.model_runner import ModelRunner
from bm.runtime.speculative import verify_drafts
from bm.runtime.threads import LoadReading, ThreadGovernor, governor_for, release_caller_team
from bm.runtime.transfer import to_device
from bm.runtime.triton.batch import StagingBuffer
from bm.scheduling import FinishReason, LlmRequest


def executor_for(model: LoadedModel) -> TorchExecutor:
    """The executor that runs the engines over ``model`` one after another (``bm compare``'s variants and
    repeats, ``bm sweep``'s points, a script calling :func:`bm.bench.run_bench` twice): its KV cache, its
    warm-up and its thread count serve the next engine too, so every run starts warm and none pays for
    them again. While an engine still holds it, a new engine gets a fresh executor of its own."""
    held = model.shared_executor
    if held is None or held.in_use or held.model is not model:
        held = TorchExecutor(model)
        if model.shared_executor is None or not model.shared_executor.in_use:
            model.shared_executor = held
    return held


class TorchExecutor:
    def __init__(self, model: LoadedModel) -> None:
        self.model = model
        self.runner: ModelRunner | None = None
        self.grammar = GrammarRuntime(model.tokenizer, model.vocab_size, model.eos_token_id)
        self.decoder = Decoder(self.grammar)
        self._limits = ModelLimits(
            vocab_size=model.vocab_size,
            max_position_embeddings=model.max_position_embeddings,
            sliding_window=model.sliding_window,
            sliding_window_on_every_layer=model.sliding_window_on_every_layer,
            layer_windows=model.layer_windows,
            hidden_size=model.model.get_input_embeddings().embedding_dim,
            weight_bytes=torch.empty((), dtype=model.dtype).element_size(),
            device_type=model.device.type,
        )
        self._layout: CacheLayout | None = None  # the cache the runner holds
        self._warmed: WarmupShapes | None = None  # the budgets its warm-up ran for
        self.lora: LoraLayers | None = None  # built when the first adapter arrives
        self._adapter_slots: dict[int, int] = {}  # LoRA task id -> its slot
        self._prompt_tables: dict[int, torch.Tensor] = {}  # request id -> [num_virtual, hidden]
        # the previous launch's tokens on the device and each request's row (overlap scheduling)
        self._last: tuple[torch.Tensor, dict[int, int]] | None = None
        self._fill_staging = StagingBuffer(model.device, torch.long)
        self.in_use = False  # an engine is bound to it (from bind() to close())
        self._governor: ThreadGovernor | None = None  # made on the first step, on the computing thread
        self._governed = False
        # where the last governor (the warm-up's, or the previous engine's) left the thread count: the
        # next engine's first step starts there (bm.runtime.threads.LoadReading)
        self._threads_at: LoadReading | None = None

    @property
    def limits(self) -> ModelLimits:
        return self._limits

    def num_kv_blocks(self, kv_config: KvCacheConfig, max_useful_tokens: int) -> int:
        """Blocks for a new engine's cache; the cache this executor already holds counts as free (a new
        engine over it takes it over rather than allocating beside it)."""
        free = available_memory_bytes(self.model.device) + (self.runner.cache_bytes if self.runner else 0)
        return num_kv_blocks(self.model, kv_config, max_useful_tokens=max_useful_tokens, free_bytes=free)

    def bind(self, layout: CacheLayout) -> None:
        """Allocate the cache for ``layout``, or keep the one held when it serves ``layout`` (same shape,
        at least as many blocks): a second engine over this executor (``bm.LLM``'s next ``generate``)
        then reuses its tensors, captured CUDA graphs and warm-up instead of paying for them again."""
        self.in_use = True
        if self.runner is not None and _serves(self._layout, layout):
            return
        self.runner = None  # the old cache goes before the new one is allocated
        self._layout, self._warmed = layout, None
        self.runner = ModelRunner(
            self.model,
            layout.num_blocks,
            layout.tokens_per_block,
            layout.max_seq_len,
            max_attention_window=layout.window_layout or layout.max_attention_window,
            sink_token_length=layout.sink_token_length,
            window_pools=layout.window_pools,
            cache_dtype=layout.dtype,
        )

    def warm_up(self, shapes: WarmupShapes) -> dict[str, Any] | None:
        """Before any request of a new engine: run the shape classes of a run within ``shapes`` once
        (bm.runtime.warmup), where model.warmup asks for it and this cache has not run them for these
        budgets yet, and settle the CPU thread count on the machine's load; the report, or None when
        no forward ran."""
        from bm.runtime.warmup import warm_up, warmup_enabled

        assert self.runner is not None, "bind() the executor before warming it up"
        governor = governor_for(self.model.yield_cores, self.model.device.type, self._threads_at)
        try:
            report = None
            if warmup_enabled(self.model.warmup, self.model.device) and self._warmed != shapes:
                report = warm_up(
                    self.runner,
                    shapes.max_batch_size,
                    shapes.max_num_tokens,
                    shapes.max_seq_len,
                    touch_blocks=shapes.touch_blocks,
                    before_each=governor.tick if governor is not None else None,
                )
                self._warmed = shapes
            if governor is not None and self._threads_at is None:
                # the first engine: the first step computes on the count the load called for during the
                # warm-up (topped up to one window), not on every thread
                governor.settle()
            if report is None:
                return None
            report.threads = governor.current if governor is not None else None
            return report.to_dict()
        finally:
            if governor is not None:
                self._threads_at = governor.reading()
                governor.restore()  # the building thread's count as it was; the worker resumes the reading

    def hand_over_threads(self) -> None:
        """The engine's worker thread computes from now on: the calling thread gives its OpenMP team
        back, so only one team competes for the cores (bm.runtime.threads)."""
        release_caller_team()

    def close(self) -> None:
        """The engine is done with this executor: LoRA layers give the shared model its own forwards back
        (a later adapter builds them again), and what belonged to its requests goes, so the next engine
        over the model starts with the cache, warm-up and thread count only. (Adapter slots left behind
        made the next engine, without adapters, fail its first step.)"""
        self.in_use = False
        if self.lora is not None:
            self.lora.close()
            self.lora = None
        self._adapter_slots = {}
        self._prompt_tables = {}
        self._last = None
        self.decoder = Decoder(self.grammar)
        if self._governor is not None:  # the next engine resumes where this one left the count
            self._threads_at = self._governor.reading()
            self._governor.restore()
        self._governor, self._governed = None, False  # the next engine's worker makes its own

    def admit(self, request: LlmRequest) -> None:
        """The runtime's state for a request: its prompt table as a tensor, and decoding state when it
        asked for more than temperature/top-k/top-p."""
        inputs = request.model_inputs
        if inputs is not None and inputs.lora is not None and inputs.lora.weights is not None:
            if self.lora is None:
                self.lora = LoraLayers(self.model.model, self.model.dtype, self.model.device)
            self.lora.check(inputs.lora)
        if inputs is not None and inputs.prompt_table is not None:
            # admitted between steps, while one may be in flight: no blocking copy
            self._prompt_tables[request.request_id] = to_device(
                inputs.prompt_table.rows, self.model.dtype, self.model.device
            )
        controls = request.controls
        if controls is None:
            return
        options = DecodingState(controls)
        if controls.embedding_bias is not None:
            # on the device once, not copied there every step (a [vocab] float32 row each)
            options.bias = to_device(controls.embedding_bias, torch.float32, self.model.device)
        if request.beam_width > 1:
            options.beam = BeamSearch(
                request.beam_width,
                request.max_new_tokens,
                request.sampling.end_id,
                controls.len_penalty,
                controls.early_stopping,
            )
        if controls.guided is not None:
            options.grammar = self.grammar.start(controls.guided)
        request.decoding = options

    def load_adapter(self, slot: int, adapter: LoraSpec) -> None:
        assert self.lora is not None, "an adapter is loaded only after a request bringing it was admitted"
        self.lora.load(slot, adapter)
        self._adapter_slots = {t: s for t, s in self._adapter_slots.items() if s != slot}
        self._adapter_slots[adapter.task_id] = slot

    @property
    def overlaps_host(self) -> bool:
        """On a GPU, :meth:`launch` returns once the step is queued: the core's overlap scheduler then
        prepares the next step while this one runs (``engine.overlap_scheduler: auto``). On the CPU the
        forward itself runs on the calling thread, so there is nothing to overlap."""
        return self.model.device.type == "cuda"

    def execute(self, batch: ExecutionBatch) -> ExecutionResult:
        return self.collect(self._launch(batch, keep_tokens=False))

    def launch(self, batch: ExecutionBatch) -> Launched:
        """Queue the step and return without waiting for its tokens (overlap scheduling): rows whose
        input is pending take the token the previous launch sampled for their request, on the device;
        plain rows sample on the device too, and :meth:`collect` copies their tokens to the host."""
        return self._launch(batch, keep_tokens=True)

    def collect(self, launched: Launched) -> ExecutionResult:
        """The launched step's result, its device tokens copied to the host (the one wait on the GPU)."""
        result = launched.result
        for items, decoded, (host, copied) in launched.on_device:
            if copied is not None:
                copied.synchronize()
            take_samples(result, zip(items, *decoded.read(host), strict=True))
        launched.on_device = []
        return result

    def _launch(self, batch: ExecutionBatch, *, keep_tokens: bool) -> Launched:
        assert self.runner is not None, "bind() the executor before executing"
        if not self._governed:
            self._governor = governor_for(self.model.yield_cores, self.model.device.type, self._threads_at)
            self._governed = True
        if self._governor is not None:
            self._governor.tick()
        self.runner.copy_blocks(batch.block_copies)
        launched = Launched(ExecutionResult(num_forwards=len(batch.forwards)))
        for group in batch.forwards:
            self._forward(group, launched)
        self._last = sampled_tokens(launched, self.model.device) if keep_tokens else None
        return launched

    def _input_fill(self, group: list[WorkItem]) -> tuple[InputFill, PendingTokens] | None:
        """The packed rows of ``group`` whose input token is pending, and those tokens from the previous
        launch's (a request whose row there failed sampled nothing: token 0, its row is thrown away):
        for the forward's input, and by request for the decoder (the penalties count them there)."""
        rows, sources = [], []
        by_request: dict[int, int] = {}
        offset = 0
        for item in group:
            if item.kind is WorkKind.GENERATION and item.token_ids[0] == PENDING_TOKEN:
                assert self._last is not None, "a pending token with no launch before it"
                tokens, index = self._last
                by_request[item.request.request_id] = len(rows)
                rows.append(offset)
                sources.append(index.get(item.request.request_id, tokens.shape[0] - 1))
            offset += len(item.token_ids)
        if not rows:
            return None
        # through pinned memory without blocking: a plain torch.tensor(..., device) would wait for the
        # step in flight, which is what overlapping is to avoid
        both = self._fill_staging.send([*rows, *sources])
        values = tokens.index_select(0, both[len(rows) :])
        return InputFill(both[: len(rows)], values), PendingTokens(by_request, values)

    def _forward(self, group: list[WorkItem], launched: Launched) -> None:
        result = launched.result
        if self._adapter_slots:
            # each adapter's tokens one row range of the packed batch (a stable sort: base items first,
            # then slot by slot, each in the core's order); logits rows follow this order throughout
            group = sorted(group, key=lambda item: self._slot(item.request))
        for item in group:
            item.keep_all = item.kind is WorkKind.CONTEXT and _wants_context_logits(item)
        tables = {i: self._prompt_tables.get(item.request.request_id) for i, item in enumerate(group)}
        tables = {i: t for i, t in tables.items() if t is not None}
        fill, pending = self._input_fill(group) or (None, None)
        if self._adapter_slots:
            self.lora.begin([(self._slot(item.request), len(item.token_ids)) for item in group])
        try:
            # in the model's dtype: a step that only samples needs no float32 copy of its logits
            logits = self.runner.forward(
                group, tables or None, static_ok=self.lora is None, fill=fill, float_logits=False
            )
        finally:
            if self.lora is not None:
                self.lora.end()
        draft_rows: list[tuple[WorkItem, torch.Tensor]] = []
        if any(item.keep_all or item.num_draft for item in group):
            logits = self._take_context_logits(group, logits.float(), draft_rows)
        for (item, rows), targets in zip(draft_rows, _draft_targets(draft_rows), strict=True):
            drafts = item.token_ids[len(item.token_ids) - item.num_draft :]
            outcome = verify_drafts(
                rows, drafts, item.request, self.decoder.sampler, item.draft_logits, targets
            )
            result.drafts[item.request.request_id] = outcome
        to_sample = [item for item in group if item.sample and not item.num_draft]
        if not to_sample:
            return
        requests = [item.request for item in to_sample]
        on_device = self.decoder.decode_on_device(logits, requests, pending)
        if on_device is not None:  # no host work: tokens (and log probs) stay on the device for now
            launched.on_device.append((to_sample, on_device, copy_to_host(on_device.tensors())))
            return
        beams = [item.beam for item in to_sample]
        decoded: DecodeResult = self.decoder.decode(logits.float(), requests, beams, pending)
        result.faults.update(decoded.faults)
        for request_id, outcome in decoded.beams.items():
            req = next(item.request for item in to_sample if item.request.request_id == request_id)
            result.beams[request_id] = _beam_step(req, outcome.parents, outcome.done)
        log_probs = decoded.log_probs or [None] * len(to_sample)
        tops = decoded.top_log_probs or [None] * len(to_sample)
        rows = zip(to_sample, decoded.tokens, log_probs, tops, strict=True)
        take_samples(
            result, (r for r in rows if r[0].request.decoding is None or r[0].request.decoding.beam is None)
        )

    def _slot(self, request: LlmRequest) -> int:
        inputs = request.model_inputs
        if inputs is None or inputs.lora is None:
            return -1
        return self._adapter_slots[inputs.lora.task_id]

    def _take_context_logits(
        self, group: list[WorkItem], logits: torch.Tensor, draft_rows: list[tuple[WorkItem, torch.Tensor]]
    ) -> torch.Tensor:
        """Store the prompt positions' logits of ``keep_all`` items and hand the last ``num_draft + 1``
        rows of a draft item to ``draft_rows``; return one row per other sampled item."""
        keep: list[int] = []
        row = 0
        for item in group:
            if item.keep_all:
                n = len(item.token_ids)
            else:
                n = item.num_draft + 1 if item.num_draft else int(item.sample)
            if item.num_draft:  # the last num_draft + 1 rows verify the drafts
                draft_rows.append((item, logits[row + n - 1 - item.num_draft : row + n]))
            if item.keep_all:
                opts = item.request.decoding
                first = max(0, opts.num_context_logits - item.start_pos)  # skip what an earlier pass stored
                last = min(n, item.request.num_prompt_tokens - item.start_pos)
                if first < last:
                    opts.context_logits.append(logits[row + first : row + last].detach().to("cpu", copy=True))
                    opts.num_context_logits += last - first
            if item.sample and not item.num_draft:
                keep.append(row + n - 1)
            row += n
        return logits[keep]

    def final_outputs(self, request: LlmRequest) -> FinalOutputs:
        opts = request.decoding
        if opts is None:
            return FinalOutputs()
        out = FinalOutputs()
        if opts.beam is not None:
            search = opts.beam
            if request.finish_reason in (FinishReason.END_ID, FinishReason.LENGTH):
                hyps = search.results()
                out.beams, out.beam_log_probs = [h.tokens for h in hyps], [h.log_probs for h in hyps]
                out.beam_log_prob_ranks = [h.ranks for h in hyps]
            else:  # cancelled: the running beams
                out.beams, out.beam_log_probs = search.tokens, search.log_probs
                out.beam_log_prob_ranks = search.ranks
            out.cum_log_probs = [float(sum(v)) for v in out.beam_log_probs]
        if opts.controls.return_context_logits and opts.context_logits:
            out.context_logits = torch.cat(opts.context_logits)
        if opts.controls.return_generation_logits and opts.generation_logits:
            out.generation_logits = torch.stack(opts.generation_logits)
        return out

    def release(self, request: LlmRequest) -> None:
        self.decoder.release(request.request_id)
        self._prompt_tables.pop(request.request_id, None)


def _serves(held: CacheLayout | None, wanted: CacheLayout) -> bool:
    """Whether a cache allocated for ``held`` serves ``wanted``: the same shape, and at least as many
    blocks in the main pool and every windowed one (the extra blocks are never handed out)."""
    if held is None:
        return False
    pools = set(held.window_pools) == set(wanted.window_pools) and all(
        held.window_pools[w] >= n for w, n in wanted.window_pools.items()
    )
    same = replace(held, num_blocks=0, window_pools={}) == replace(wanted, num_blocks=0, window_pools={})
    return same and pools and held.num_blocks >= wanted.num_blocks


def _beam_step(req: LlmRequest, parents: list[int], done: bool) -> BeamStep:
    search = req.decoding.beam
    ended = False
    if done:
        best = search.results()[0]
        ended = bool(best.tokens) and best.tokens[-1] == req.sampling.end_id
    return BeamStep(parents, [list(t) for t in search.tokens], done, ended)


def _draft_targets(draft_rows: list[tuple[WorkItem, torch.Tensor]]) -> list[list[int] | None]:
    """Every greedy draft row's argmax from one batched op and one copy to the host (not one per
    request); None for sampled requests, whose rows :func:`verify_drafts` reads itself."""
    greedy = [i for i, (item, _) in enumerate(draft_rows) if item.request.sampling.is_greedy]
    out: list[list[int] | None] = [None] * len(draft_rows)
    if not greedy:
        return out
    flat = torch.cat([draft_rows[i][1] for i in greedy]).argmax(dim=-1).tolist()
    offset = 0
    for i in greedy:
        n = draft_rows[i][1].shape[0]
        out[i] = flat[offset : offset + n]
        offset += n
    return out


def _wants_context_logits(item: WorkItem) -> bool:
    opts = item.request.decoding
    return (
        opts is not None
        and opts.controls.return_context_logits
        and item.start_pos < item.request.num_prompt_tokens
        and opts.num_context_logits < item.request.num_prompt_tokens
    )
