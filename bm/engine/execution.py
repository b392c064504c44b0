"""The middle of an iteration: allocate -> forward -> sample -> update, for every batching scheme.

The scheduler says which requests run and how many tokens each computes; this module turns that into
work items (a real context chunk, V1 pad tokens, a generation token, or a V1 empty slot), groups them
into forwards as the scheme dictates, samples, and applies the results to the requests:

- ``inflight_fused``: one packed forward with context and generation tokens together;
- ``inflight``: the context forward, then the generation forward, in the same iteration;
- ``v1``: forwards of at most ``max_num_tokens`` tokens (a static batch's padded contexts can exceed it).
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from enum import Enum

import torch

from bm.kv import KVCacheManager, beam_key
from bm.runtime import ModelRunner, Segment
from bm.runtime.beam_search import StepOutcome
from bm.runtime.decoding import Decoder, DecodeResult
from bm.runtime.logits import ends_with_stop_word
from bm.scheduling import FinishReason, LlmRequest, RequestState, SchedulerOutput


class WorkKind(Enum):
    CONTEXT = "context"
    PADDING = "padding"  # V1: pad tokens executed beside a shorter prompt
    GENERATION = "generation"
    EMPTY_SLOT = "empty_slot"  # V1: a finished member still computing while its batch runs on


@dataclass(slots=True)
class WorkItem:
    request: LlmRequest
    kind: WorkKind
    segment: Segment
    beam: int = 0


@dataclass
class IterationResult:
    """What an iteration computed, for the responses and the stats."""

    produced: list[LlmRequest] = field(default_factory=list)  # got a new token (streaming candidates)
    finished: list[LlmRequest] = field(default_factory=list)
    computed_tokens: int = 0  # every token through a forward, padding included
    context_tokens: int = 0
    padding_tokens: int = 0
    generation_tokens: int = 0
    empty_slots: int = 0
    num_forwards: int = 0


class IterationExecutor:
    def __init__(
        self, scheme: str, max_num_tokens: int, kv: KVCacheManager, runner: ModelRunner, decoder: Decoder
    ) -> None:
        self.scheme = scheme
        self.max_num_tokens = max_num_tokens
        self.kv = kv
        self.runner = runner
        self.decoder = decoder
        self._copies: list[tuple[int, int]] = []  # KV blocks to fork before the next forward (beams)

    def run(self, scheduled: SchedulerOutput) -> IterationResult:
        items = self._allocate(scheduled)
        self.runner.copy_blocks(self._copies)
        self._copies = []
        result = IterationResult()
        sampled: list[tuple[WorkItem, int, float | None]] = []
        beams: dict[int, StepOutcome] = {}
        for group in self._forward_groups(items):
            sampled.extend(self._forward(group, beams))
            result.num_forwards += 1
        self._update(items, sampled, result)
        self._after_compute(items)
        self._update_beams(items, beams, result)
        return result

    # -- allocate ---------------------------------------------------------------------------------------

    def _allocate(self, scheduled: SchedulerOutput) -> list[WorkItem]:
        """Blocks for every token computed this iteration, and the segments the runner will pack."""
        kv = self.kv
        items: list[WorkItem] = []
        for req in scheduled.context_requests:
            if req.context_chunk_size:
                start = req.num_computed_tokens
                end = start + req.context_chunk_size
                table = kv.allocate(req.request_id, end)
                segment = Segment(req.token_slice(start, end), start, table, end == req.num_tokens)
                items.append(WorkItem(req, WorkKind.CONTEXT, segment))
            if req.padding_chunk_size:
                start = req.num_padding_computed
                table = kv.allocate(req.padding_key, start + req.padding_chunk_size)
                tokens = [req.sampling.pad_id] * req.padding_chunk_size
                items.append(WorkItem(req, WorkKind.PADDING, Segment(tokens, start, table, False)))
        for req in scheduled.generation_requests:
            if req.is_finished:  # V1 empty slot: keep computing beside the batch, discard the result
                pos = req.num_computed_tokens + req.num_empty_slots
                table = kv.allocate(req.request_id, pos + 1)
                items.append(
                    WorkItem(req, WorkKind.EMPTY_SLOT, Segment([req.sampling.pad_id], pos, table, True))
                )
            elif req.decoding is not None and req.decoding.beam is not None:
                items.extend(self._allocate_beams(req))
            else:
                table = kv.allocate(req.request_id, req.num_tokens)
                segment = Segment([req.last_token()], req.num_tokens - 1, table, True)
                items.append(WorkItem(req, WorkKind.GENERATION, segment))
        return items

    def _allocate_beams(self, req: LlmRequest) -> list[WorkItem]:
        """One generation token per beam; a beam about to write into a block it shares gets its own copy."""
        items = []
        position = req.num_tokens - 1
        for beam, tokens in enumerate(req.decoding.beam.tokens):
            key = beam_key(req.request_id, beam)
            copy = self.kv.copy_on_write(key, position)
            if copy is not None:
                self._copies.append(copy)
            table = self.kv.allocate(key, req.num_tokens)
            items.append(
                WorkItem(req, WorkKind.GENERATION, Segment([tokens[-1]], position, table, True), beam)
            )
        return items

    # -- forward and sample -----------------------------------------------------------------------------

    def _forward_groups(self, items: list[WorkItem]) -> list[list[WorkItem]]:
        if self.scheme == "inflight_fused":
            return [items] if items else []
        contexts = [i for i in items if i.kind in (WorkKind.CONTEXT, WorkKind.PADDING)]
        generation = [i for i in items if i.kind in (WorkKind.GENERATION, WorkKind.EMPTY_SLOT)]
        if self.scheme == "inflight":
            return [g for g in (contexts, generation) if g]
        groups: list[list[WorkItem]] = []
        current: list[WorkItem] = []
        size = 0
        for item in contexts:
            n = len(item.segment.token_ids)
            if current and size + n > self.max_num_tokens:
                groups.append(current)
                current, size = [], 0
            current.append(item)
            size += n
        groups.extend(g for g in (current, generation) if g)
        return groups

    def _forward(
        self, group: list[WorkItem], beams: dict[int, StepOutcome]
    ) -> list[tuple[WorkItem, int, float | None]]:
        for item in group:
            if item.kind is WorkKind.CONTEXT and _wants_context_logits(item):
                item.segment.keep_all = True
        logits = self.runner.forward([item.segment for item in group])
        if any(item.segment.keep_all for item in group):
            logits = self._take_context_logits(group, logits)
        to_sample = [item for item in group if item.segment.sample]
        if not to_sample:
            return []
        decoded: DecodeResult = self.decoder.decode(
            logits, [item.request for item in to_sample], [item.beam for item in to_sample]
        )
        beams.update(decoded.beams)
        log_probs = decoded.log_probs or [None] * len(to_sample)
        return [
            (item, token, lp)
            for item, token, lp in zip(to_sample, decoded.tokens, log_probs, strict=True)
            if item.request.decoding is None or item.request.decoding.beam is None
        ]

    def _take_context_logits(self, group: list[WorkItem], logits: torch.Tensor) -> torch.Tensor:
        """Store the prompt positions' logits of ``keep_all`` segments; return one row per sampled segment."""
        keep: list[int] = []
        row = 0
        for item in group:
            seg = item.segment
            n = len(seg.token_ids) if seg.keep_all else int(seg.sample)
            if seg.keep_all:
                opts = item.request.decoding
                first = max(0, opts.num_context_logits - seg.start_pos)  # skip what an earlier pass stored
                last = min(n, item.request.num_prompt_tokens - seg.start_pos)
                if first < last:
                    opts.context_logits.append(logits[row + first : row + last].detach().to("cpu", copy=True))
                    opts.num_context_logits += last - first
            if seg.sample:
                keep.append(row + n - 1)
            row += n
        return logits[keep]

    # -- update -----------------------------------------------------------------------------------------

    def _update(
        self,
        items: list[WorkItem],
        sampled: list[tuple[WorkItem, int, float | None]],
        result: IterationResult,
    ) -> None:
        now = time.perf_counter()
        for item in items:
            req, n = item.request, len(item.segment.token_ids)
            result.computed_tokens += n
            if item.kind is WorkKind.CONTEXT:
                req.num_computed_tokens += n
                result.context_tokens += n
                if req.first_scheduled_time is None:
                    req.first_scheduled_time = now
            elif item.kind is WorkKind.PADDING:
                req.num_padding_computed += n
                result.padding_tokens += n
            elif item.kind is WorkKind.GENERATION:
                req.num_computed_tokens += item.beam == 0  # every beam computes the same position
                result.generation_tokens += 1
            else:
                req.num_empty_slots += 1
                result.empty_slots += 1
            req.context_chunk_size = req.padding_chunk_size = 0
        for item, token, log_prob in sampled:
            if item.kind is WorkKind.EMPTY_SLOT:
                continue
            req = item.request
            req.output_ids.append(token)
            if req.output_log_probs is not None and log_prob is not None:
                req.output_log_probs.append(log_prob)
            req.state = RequestState.GENERATION_IN_PROGRESS
            if req.first_token_time is None:
                req.first_token_time = now
            result.produced.append(req)
            reason = _stop_reason(req, token)
            if reason is not FinishReason.NOT_FINISHED:
                req.finish_reason = reason
                req.state = RequestState.GENERATION_TO_COMPLETE
                result.finished.append(req)

    def _after_compute(self, items: list[WorkItem]) -> None:
        """Newly full blocks become reusable; blocks left behind the attention window go back.

        Beam requests do neither: their tables fork and copy on write, so their blocks are reserved to
        completion and never shared outside the request.
        """
        for item in items:
            req = item.request
            if item.kind in (WorkKind.CONTEXT, WorkKind.GENERATION) and req.beam_width == 1:
                self.kv.cache_computed_blocks(req, req.num_computed_tokens)
                self.kv.release_outside_window(req.request_id, req.num_computed_tokens)

    def _update_beams(
        self, items: list[WorkItem], beams: dict[int, StepOutcome], result: IterationResult
    ) -> None:
        """Apply each beam request's step: fork its block tables, or finish it with its hypotheses."""
        if not beams:
            return
        by_id = {item.request.request_id: item.request for item in items}
        now = time.perf_counter()
        for request_id, outcome in beams.items():
            req = by_id[request_id]
            search = req.decoding.beam
            req.output_ids = list(search.tokens[0])
            req.state = RequestState.GENERATION_IN_PROGRESS
            if req.first_token_time is None:
                req.first_token_time = now
            if outcome.done:
                best = search.results()[0]
                ended = bool(best.tokens) and best.tokens[-1] == req.sampling.end_id
                req.finish_reason = FinishReason.END_ID if ended else FinishReason.LENGTH
                req.state = RequestState.GENERATION_TO_COMPLETE
                result.finished.append(req)
            else:
                self.kv.fork_beams(request_id, outcome.parents)
            result.produced.append(req)


def _wants_context_logits(item: WorkItem) -> bool:
    opts = item.request.decoding
    return (
        opts is not None
        and opts.return_context_logits
        and item.segment.start_pos < item.request.num_prompt_tokens
        and opts.num_context_logits < item.request.num_prompt_tokens
    )


def _stop_reason(req: LlmRequest, token: int) -> FinishReason:
    if token == req.sampling.end_id:
        return FinishReason.END_ID
    opts = req.decoding
    if (
        opts is not None
        and opts.stop_words
        and ends_with_stop_word(req.prompt_ids, req.output_ids, opts.stop_words)
    ):
        return FinishReason.STOP_WORDS
    if len(req.output_ids) >= req.max_new_tokens:
        return FinishReason.LENGTH
    return FinishReason.NOT_FINISHED
