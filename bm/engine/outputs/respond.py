"""A request's response, built from its state: the tokens it streams, or everything at its end (no torch).

Streaming requests get the tokens produced since their last response; a final response carries what the
request counted over its life (:class:`~bm.engine.requests.request.RequestCounters`), its times, and what the
executor keeps to the end (beams, context and generation logits:
:class:`~bm.engine.execution.protocol.FinalOutputs`).
"""

from __future__ import annotations

from bm.engine.execution.protocol import ExecutionBatch, FinalOutputs, WorkKind
from bm.engine.requests.request import Response
from bm.scheduling import LlmRequest


def produced_requests(batch: ExecutionBatch) -> list[LlmRequest]:
    """The requests that sampled a token in ``batch``, each once, in the batch's order."""
    produced: dict[int, LlmRequest] = {}
    empty_slot = WorkKind.EMPTY_SLOT  # a local: read per item
    for forward in batch.forwards:
        for item in forward:
            if item.sample and item.kind is not empty_slot:
                produced[item.request.request_id] = item.request
    return list(produced.values())


def response_for(
    req: LlmRequest, *, final: bool, error: str = "", extras: FinalOutputs | None = None
) -> Response:
    """The response ``req`` is owed now: its new tokens (streaming) or all of them (final); ``extras``:
    what the executor returns for a final response."""
    start = req.num_streamed_tokens if req.streaming else 0
    response = Response(req.request_id, req.output_ids[start:], final=final, error=error)
    req.num_streamed_tokens = len(req.output_ids)
    if req.output_log_probs is not None:
        response.output_log_probs = req.output_log_probs[start:]
        response.cum_log_probs = [sum(req.output_log_probs)]
    if req.output_top_log_probs is not None:
        response.output_top_log_probs = req.output_top_log_probs[start:]
    if final:
        _final_fields(req, response, extras or FinalOutputs())
    return response


def _final_fields(req: LlmRequest, response: Response, extras: FinalOutputs) -> None:
    if extras.beams is not None:
        response.beams = extras.beams
        response.output_ids = list(extras.beams[0]) if extras.beams else []
        response.beam_log_probs = extras.beam_log_probs
        response.beam_log_prob_ranks = extras.beam_log_prob_ranks
        end_id = req.sampling.end_id
        response.pad_fill = end_id if end_id >= 0 else req.sampling.pad_id
        if req.controls is not None and req.controls.return_log_probs:
            response.output_log_probs = list(extras.beam_log_probs[0]) if extras.beam_log_probs else []
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
