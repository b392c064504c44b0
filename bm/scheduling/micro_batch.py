"""Micro-batch scheduling: the fitting requests' tokens for this iteration, under the token budget."""

from __future__ import annotations

from collections.abc import Mapping, Sequence

from bm.scheduling.budget import ChunkingConfig, IterationBudget, unit_step
from bm.scheduling.request import CONTEXT_INIT, GENERATION_STATES, LlmRequest


class MicroBatchScheduler:
    """Hand out this iteration's tokens under ``max_batch_size`` and ``max_num_tokens``.

    Requests are served in the order the capacity stage gives them (generation first). Each context
    request gets a chunk (TensorRT-LLM's ``setContextChunkSize``), kept in :attr:`chunk_sizes` for the
    plan rather than written on the request, so scheduling changes no request: its whole remaining
    context, or with chunking enabled a chunk chosen by the policy: FIRST_COME_FIRST_SERVED fills the
    budget in arrival order, EQUAL_PROGRESS advances every context by one unit per round until the
    budget is spent.
    """

    def __init__(
        self, max_batch_size: int, max_num_tokens: int, chunking: ChunkingConfig | None = None
    ) -> None:
        self.max_batch_size = max_batch_size
        self.max_num_tokens = max_num_tokens
        self.chunking = chunking or ChunkingConfig()
        # request id -> context tokens, as the last schedule() decided them (read into the plan at once)
        self.chunk_sizes: dict[int, int] = {}

    def schedule(
        self,
        fitting_requests: Sequence[LlmRequest],
        inflight_request_ids: frozenset[int] = frozenset(),
        computed: Mapping[int, int] | None = None,
    ) -> tuple[list[LlmRequest], list[LlmRequest]]:
        """Return ``(context_requests, generation_requests)``; each context's chunk is in
        :attr:`chunk_sizes` until the next call.

        ``computed``: request id -> tokens in the cache once the request starts (the cached prefix the
        capacity stage planned); requests not named count their own ``num_computed_tokens``.
        """
        computed = computed or {}
        budget = IterationBudget(self.max_batch_size, self.max_num_tokens, self.chunking)
        running: list[LlmRequest] = []
        contexts: list[LlmRequest] = []
        for request in fitting_requests:
            if inflight_request_ids and request.request_id in inflight_request_ids:
                continue
            state = request.state  # read once: the phase properties cost a call each, per request
            if state in GENERATION_STATES:
                running.append(request)
            elif state == CONTEXT_INIT:
                contexts.append(request)
        generation = budget.take_all(running)  # in the same order: contexts take nothing before
        if budget.equal_progress:
            chunks = self._equal_progress(contexts, budget, computed)
        else:
            chunks = {}
            for request in contexts:
                tokens = budget.take(request, computed.get(request.request_id))
                if not tokens:
                    break
                chunks[request.request_id] = tokens
        self.chunk_sizes = chunks
        return [r for r in contexts if r.request_id in chunks], generation

    def _equal_progress(
        self, contexts: list[LlmRequest], budget: IterationBudget, computed_at_start: Mapping[int, int]
    ) -> dict[int, int]:
        """Round-robin one unit step at a time, so every context advances at the same pace; returns each
        advancing context's chunk."""
        chosen = contexts[: budget.slots_left]
        chunk = dict.fromkeys((r.request_id for r in chosen), 0)
        tokens_left = budget.tokens_left
        cap = self.chunking.max_chunk
        progressing = True
        while progressing:
            progressing = False
            for request in chosen:
                done = chunk[request.request_id]
                computed = computed_at_start.get(request.request_id, request.num_computed_tokens)
                remaining = request.num_tokens - computed - done
                if remaining <= 0 or (cap is not None and done >= cap):
                    continue
                step = unit_step(computed + done, remaining, self.chunking.unit)
                # A chunk that is not the context's last ends on a unit boundary, so past the cap the
                # request stops growing rather than taking a partial unit.
                if cap is not None and done + step > cap:
                    continue
                if step > tokens_left:
                    continue
                chunk[request.request_id] = done + step
                tokens_left -= step
                progressing = True
        return {r.request_id: chunk[r.request_id] for r in chosen if chunk[r.request_id] > 0}
