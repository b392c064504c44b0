"""Micro-batch scheduling: which fitting requests run in this iteration's forward, under token budgets."""

from __future__ import annotations

from collections.abc import Sequence

from bm.scheduling.request import LlmRequest


class MicroBatchScheduler:
    """Select context and generation requests under ``max_batch_size`` and ``max_num_tokens``.

    Generation requests go first (one token each, and their latency is what users feel); context
    requests follow in arrival order until the first whose remaining context does not fit the token
    budget. Each chosen context request gets its ``context_chunk_size`` for this iteration.
    """

    def __init__(self, max_batch_size: int, max_num_tokens: int) -> None:
        self.max_batch_size = max_batch_size
        self.max_num_tokens = max_num_tokens

    def schedule(
        self,
        fitting_requests: Sequence[LlmRequest],
        inflight_request_ids: frozenset[int] = frozenset(),
    ) -> tuple[list[LlmRequest], list[LlmRequest]]:
        """Return ``(context_requests, generation_requests)``."""
        context: list[LlmRequest] = []
        generation: list[LlmRequest] = []
        num_tokens = 0
        for request in fitting_requests:
            if request.request_id in inflight_request_ids or not request.is_generation_phase:
                continue
            if len(generation) >= self.max_batch_size or num_tokens + 1 > self.max_num_tokens:
                break
            generation.append(request)
            num_tokens += 1

        for request in fitting_requests:
            if request.request_id in inflight_request_ids or not request.is_context_phase:
                continue
            if len(context) + len(generation) >= self.max_batch_size:
                break
            chunk = request.num_context_tokens_remaining
            if num_tokens + chunk > self.max_num_tokens:
                break
            request.context_chunk_size = chunk
            context.append(request)
            num_tokens += chunk
        return context, generation
