"""From a scheduler's plan to work: what the cache must provide, and the batch the executor computes.

Both are pure functions of the plan and the cache's tables, kept apart from the loop so the loop reads as
its steps. Forwards are grouped by batching scheme: InflightFused packs everything into one forward,
Inflight runs contexts then generation, and V1 splits contexts into forwards of at most
``max_num_tokens`` tokens (a static batch's padded contexts can exceed it).
"""

from __future__ import annotations

from bm.config import BatchingScheme
from bm.engine.execution.protocol import PENDING_TOKEN, ExecutionBatch, WorkItem, WorkKind
from bm.kv import KVCacheManager, ResourcePlan
from bm.scheduling import SchedulerOutput


def resource_plan(plan: SchedulerOutput) -> ResourcePlan:
    """What the plan needs of the cache, in terms the KV manager knows (ids and token counts)."""
    resources = ResourcePlan(release=[r.request_id for r in plan.paused_requests])
    for req in plan.context_requests:
        rid = req.request_id
        start = req.num_computed_tokens
        if not req.holds_blocks and rid in plan.prefixes:
            match = plan.prefixes[rid]
            resources.starts.append((req, match))
            start = match.num_tokens
        resources.grow.append((rid, start + plan.context_chunk_sizes[rid]))
    # each generation grows to its tokens, pending ones included (num_tokens, read as lengths: once per
    # request an iteration)
    resources.grow.extend(
        [
            (r.request_id, len(r.prompt_ids) + len(r.output_ids) + r.num_pending)
            for r in plan.generation_requests
        ]
    )
    for slot in plan.empty_slots:
        resources.grow.append((slot.request.request_id, slot.position + 1))
    for work in plan.padding:
        resources.pad.append((work.request.request_id, work.start + work.num_tokens))
    return resources


def build_batch(
    plan: SchedulerOutput, kv: KVCacheManager, scheme: BatchingScheme, max_num_tokens: int
) -> ExecutionBatch:
    """The iteration's work items (tables already grown by ``prepare_resources``), grouped into forwards."""
    items: list[WorkItem] = []
    for req in plan.context_requests:
        start = req.num_computed_tokens
        end = start + plan.context_chunk_sizes[req.request_id]
        items.append(
            WorkItem(
                req,
                WorkKind.CONTEXT,
                req.token_slice(start, end),
                start,
                kv.block_ids(req.request_id),
                end == req.num_tokens,
                window_block_ids=kv.window_block_ids(req.request_id),
                decode_from=req.num_prompt_tokens,
            )
        )
    for work in plan.padding:
        table = kv.padding_block_ids(work.request.request_id)
        tokens = [work.request.sampling.pad_id] * work.num_tokens
        items.append(WorkItem(work.request, WorkKind.PADDING, tokens, work.start, table, False))
    generation, windowed = WorkKind.GENERATION, bool(kv.window_tables)
    for req in plan.generation_requests:
        # read as attributes (num_tokens - 1, last_token()): this runs once per request an iteration
        output, pending = req.output_ids, req.num_pending
        position = len(req.prompt_ids) + len(output) + pending - 1
        if req.beam_tokens is not None:
            for beam, tokens in enumerate(req.beam_tokens):
                table = kv.block_ids(req.request_id, beam)
                items.append(WorkItem(req, generation, [tokens[-1]], position, table, True, beam))
        else:
            token = PENDING_TOKEN if pending else output[-1] if output else req.prompt_ids[-1]
            item = WorkItem(req, generation, [token], position, kv.block_ids(req.request_id), True)
            if windowed:
                item.window_block_ids = kv.window_block_ids(req.request_id)
            items.append(item)
    for slot in plan.empty_slots:
        req = slot.request
        table = kv.block_ids(req.request_id)
        items.append(WorkItem(req, WorkKind.EMPTY_SLOT, [req.sampling.pad_id], slot.position, table, True))
    return ExecutionBatch(forward_groups(items, scheme, max_num_tokens))


def forward_groups(
    items: list[WorkItem], scheme: BatchingScheme, max_num_tokens: int
) -> list[list[WorkItem]]:
    """InflightFused: one packed forward. Inflight: contexts, then generation. V1: contexts in
    forwards of at most ``max_num_tokens`` tokens (a static batch's padded contexts can exceed it)."""
    if not items:
        return []
    if scheme == BatchingScheme.INFLIGHT_FUSED:
        return [items]
    contexts = [i for i in items if i.kind in (WorkKind.CONTEXT, WorkKind.PADDING)]
    generation = [i for i in items if i.kind in (WorkKind.GENERATION, WorkKind.EMPTY_SLOT)]
    if scheme == BatchingScheme.INFLIGHT:
        return [g for g in (contexts, generation) if g]
    groups: list[list[WorkItem]] = []
    current: list[WorkItem] = []
    size = 0
    for item in contexts:
        n = len(item.token_ids)
        if current and size + n > max_num_tokens:
            groups.append(current)
            current, size = [], 0
        current.append(item)
        size += n
    groups.extend(g for g in (current, generation) if g)
    return groups


def attach_drafts(batch: ExecutionBatch, drafts: dict[int, tuple[list[int], object]]) -> None:
    """Append each request's drafts to its sampling item: a generation step, or the last prompt chunk."""
    if not drafts:
        return
    for forward in batch.forwards:
        for item in forward:
            takes = item.sample and item.kind in (WorkKind.GENERATION, WorkKind.CONTEXT)
            found = drafts.get(item.request.request_id) if takes else None
            if found is not None:
                item.token_ids = [*item.token_ids, *found[0]]
                item.num_draft = len(found[0])
                item.draft_logits = found[1]
