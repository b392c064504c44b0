"""What a step computed, applied to its requests: progress, new tokens, finish reasons, accepted drafts
and beam steps, and the KV cache update that follows from them (no torch).

The executor returns tokens; this module writes them onto the scheduler's requests and describes what
the KV manager must do about them (a :class:`~bm.kv.ResourceUpdate`: computed lengths, drafts to trim,
beam forks). The engine core applies that update, through the manager, in the same step.
"""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass

from bm.engine.execution.protocol import DraftOutcome, ExecutionBatch, ExecutionResult, WorkKind
from bm.engine.requests.speculative import SpecState
from bm.engine.requests.stopping import stop_reason
from bm.kv import ResourceUpdate
from bm.scheduling import FinishReason, LlmRequest, RequestState, SchedulerOutput
from bm.scheduling.request import NOT_FINISHED

# read per token: module constants, not members read off their enum classes each time
GENERATION_IN_PROGRESS = RequestState.GENERATION_IN_PROGRESS
GENERATION_TO_COMPLETE = RequestState.GENERATION_TO_COMPLETE


@dataclass
class WorkCounts:
    """Token slots a step computed, by kind (the stats line's counts)."""

    computed: int = 0
    context: int = 0
    padding: int = 0
    generation: int = 0
    empty_slots: int = 0


def count_work(batch: ExecutionBatch, now: float) -> WorkCounts:
    """Every item's progress: context tokens now in the cache (drafts after a last prompt chunk count
    once accepted), a generation's position, a request's first scheduled time; returns the counts."""
    computed = context = padding = generation = empty_slots = 0
    # the kinds as locals: reading a member off its enum class costs more than the test, per item
    context_kind, padding_kind, generation_kind = WorkKind.CONTEXT, WorkKind.PADDING, WorkKind.GENERATION
    for forward in batch.forwards:
        for item in forward:
            kind = item.kind
            if kind is generation_kind:
                computed += len(item.token_ids)
                item.request.num_computed_tokens += item.beam == 0  # every beam computes this position
                generation += 1
                continue
            req, n = item.request, len(item.token_ids)
            computed += n
            if kind is context_kind:
                req.num_computed_tokens += n - item.num_draft
                context += n - item.num_draft
                if req.first_scheduled_time is None:
                    req.first_scheduled_time = now
            elif kind is padding_kind:
                padding += n
            else:
                empty_slots += 1
    return WorkCounts(computed, context, padding, generation, empty_slots)


def start_requests(
    plan: SchedulerOutput, reused_tokens: dict[int, int], starts: Iterator[int], reuse: bool
) -> tuple[int, int]:
    """The plan's requests that start to hold blocks now: their cached prefix counts as computed, and
    they take the next start order from ``starts`` (MAX_UTILIZATION pauses the latest first). Returns
    the (reused, missed) blocks, counted where ``reuse`` (block reuse) is on."""
    reused = missed = 0
    for req in plan.context_requests:
        if req.holds_blocks:
            continue
        req.start_order = next(starts)
        match = plan.prefixes.get(req.request_id)
        if match is None:
            continue
        req.num_computed_tokens = reused_tokens.get(req.request_id, 0)
        if reuse:
            req.num_reused_blocks += match.num_blocks
            req.num_missed_blocks += match.num_missed_blocks
            reused += match.num_blocks
            missed += match.num_missed_blocks
    return reused, missed


def apply_tokens(
    batch: ExecutionBatch,
    result: ExecutionResult,
    active: dict[int, LlmRequest],
    now: float,
    lengths: bool = True,
) -> tuple[ResourceUpdate, list[LlmRequest]]:
    """Sampled tokens, accepted drafts and beam steps onto their requests; returns the KV cache's update
    and the n-sample requests whose prompt is now computed (their samples fork next). ``lengths``: the
    update lists each request's computed length (False: the cache does not read them, or the caller
    has them from launch)."""
    forking: list[LlmRequest] = []
    context, generation, empty_slot = WorkKind.CONTEXT, WorkKind.GENERATION, WorkKind.EMPTY_SLOT
    tops = result.top_log_probs
    for item, token, log_prob in result.sampled:
        if item.kind is not empty_slot:
            req = item.request
            append_token(req, token, log_prob, now, tops.get(req.request_id) if tops else None)
            if req.num_pending_samples and item.kind is context:
                forking.append(req)
    update = ResourceUpdate()
    for request_id, outcome in result.drafts.items():
        req = active[request_id]
        accept_drafts(req, outcome, now)
        update.trim.append((request_id, req.num_computed_tokens))
    computed = update.computed
    for forward in batch.forwards if lengths else ():
        for item in forward:
            req = item.request
            if (item.kind is generation or item.kind is context) and req.beam_width == 1:
                computed.append((req, req.num_computed_tokens))
    for request_id, step in result.beams.items():
        req = active[request_id]
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
    return update, forking


def accept_drafts(req: LlmRequest, outcome: DraftOutcome, now: float) -> None:
    """Append the accepted drafts and the model's next token (stopping where the request ends); the KV of
    the accepted drafts is kept, the rest of the step's blocks are rolled back (the caller's
    :class:`ResourceUpdate` trims the table to ``num_computed_tokens``)."""
    for token in outcome.tokens:
        append_token(req, token, None, now)
        if req.is_finished:
            break
    req.num_computed_tokens += outcome.num_accepted  # the fed token was counted with the item
    if req.speculation is None:
        req.speculation = SpecState()
    spec = req.speculation
    spec.num_draft_tokens += outcome.num_draft
    spec.num_accepted_tokens += outcome.num_accepted
    spec.num_draft_steps += 1


def append_token(
    req: LlmRequest,
    token: int,
    log_prob: float | None,
    now: float,
    top: list[tuple[int, float]] | None = None,
) -> None:
    """One new token: its log probs when asked for, the first token's time, and whether it ends the
    request (end id, stop words, length)."""
    req.output_ids.append(token)
    if log_prob is not None and req.output_log_probs is not None:
        req.output_log_probs.append(log_prob)
    if top is not None and req.output_top_log_probs is not None:
        req.output_top_log_probs.append(top)
    req.state = GENERATION_IN_PROGRESS
    if req.first_token_time is None:
        req.first_token_time = now
    reason = stop_reason(req, token)
    if reason is not NOT_FINISHED:
        req.finish_reason = reason
        req.state = GENERATION_TO_COMPLETE
