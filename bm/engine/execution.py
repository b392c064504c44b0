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

from bm.kv import KVCacheManager
from bm.runtime import ModelRunner, Sampler, Segment
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
        self, scheme: str, max_num_tokens: int, kv: KVCacheManager, runner: ModelRunner, sampler: Sampler
    ) -> None:
        self.scheme = scheme
        self.max_num_tokens = max_num_tokens
        self.kv = kv
        self.runner = runner
        self.sampler = sampler

    def run(self, scheduled: SchedulerOutput) -> IterationResult:
        items = self._allocate(scheduled)
        result = IterationResult()
        sampled: list[tuple[WorkItem, int]] = []
        for group in self._forward_groups(items):
            sampled.extend(self._forward(group))
            result.num_forwards += 1
        self._update(items, sampled, result)
        self._after_compute(items)
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
            else:
                table = kv.allocate(req.request_id, req.num_tokens)
                segment = Segment([req.last_token()], req.num_tokens - 1, table, True)
                items.append(WorkItem(req, WorkKind.GENERATION, segment))
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

    def _forward(self, group: list[WorkItem]) -> list[tuple[WorkItem, int]]:
        logits = self.runner.forward([item.segment for item in group])
        to_sample = [item for item in group if item.segment.sample]
        if not to_sample:
            return []
        params = [item.request.sampling for item in to_sample]
        tokens = self.sampler.sample(logits, params, [item.request.request_id for item in to_sample])
        return list(zip(to_sample, tokens, strict=True))

    # -- update -----------------------------------------------------------------------------------------

    def _update(
        self, items: list[WorkItem], sampled: list[tuple[WorkItem, int]], result: IterationResult
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
                req.num_computed_tokens += 1
                result.generation_tokens += 1
            else:
                req.num_empty_slots += 1
                result.empty_slots += 1
            req.context_chunk_size = req.padding_chunk_size = 0
        for item, token in sampled:
            if item.kind is WorkKind.EMPTY_SLOT:
                continue
            req = item.request
            req.output_ids.append(token)
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
        """Newly full blocks become reusable; blocks left behind the attention window go back."""
        for item in items:
            if item.kind in (WorkKind.CONTEXT, WorkKind.GENERATION):
                req = item.request
                self.kv.cache_computed_blocks(req, req.num_computed_tokens)
                self.kv.release_outside_window(req.request_id, req.num_computed_tokens)


def _stop_reason(req: LlmRequest, token: int) -> FinishReason:
    if token == req.sampling.end_id:
        return FinishReason.END_ID
    if len(req.output_ids) >= req.max_new_tokens:
        return FinishReason.LENGTH
    return FinishReason.NOT_FINISHED
