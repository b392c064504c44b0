"""One iteration's budget (batch slots and tokens) and the context-chunking rule, shared by both stages.

The capacity stage walks requests in its own order and asks the budget what each would compute; the
micro-batch stage later hands out the final chunks. Because both use the rule defined here, the capacity
stage never reserves blocks for (or pauses in favour of) work the micro-batch stage then drops.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass

from bm.config import ContextChunkingPolicy
from bm.scheduling.request import GENERATION_STATES, LlmRequest

FIRST_COME_FIRST_SERVED = ContextChunkingPolicy.FIRST_COME_FIRST_SERVED
EQUAL_PROGRESS = ContextChunkingPolicy.EQUAL_PROGRESS


@dataclass(frozen=True)
class ChunkingConfig:
    """How long contexts are split across iterations.

    ``unit``: every chunk but a context's last ends on a multiple of it (a KV block), so chunks fill whole
    blocks. ``max_chunk``: most tokens of one request per iteration (None: the token budget decides).
    """

    enabled: bool = False
    policy: ContextChunkingPolicy = FIRST_COME_FIRST_SERVED
    unit: int = 32
    max_chunk: int | None = None


def context_chunk(
    request: LlmRequest, tokens_left: int, chunking: ChunkingConfig, computed: int | None = None
) -> int:
    """Tokens of ``request``'s context to compute now, given ``tokens_left`` in the budget (0: none).

    ``computed``: tokens already in the cache when the request starts (a cached prefix the capacity stage
    matched but has not taken yet); by default its own ``num_computed_tokens``.

    Without chunking a context goes whole or not at all, except a resumed one: recomputing a paused
    request's prompt plus output may have outgrown the budget, so it is always chunkable.
    """
    if computed is None:
        computed = request.num_computed_tokens
    remaining = request.num_tokens - computed
    if remaining <= 0:
        return 0
    if not chunking.enabled and request.num_pauses == 0:
        return remaining if remaining <= tokens_left else 0
    limit = tokens_left if chunking.max_chunk is None else min(tokens_left, chunking.max_chunk)
    if remaining <= limit:
        return remaining
    # Not the last chunk: end on a unit boundary so the context fills whole blocks.
    end = (computed + limit) // chunking.unit * chunking.unit
    return max(0, end - computed)


def unit_step(position: int, remaining: int, unit: int) -> int:
    """Tokens from ``position`` to the next unit boundary (or to the end of the context)."""
    return min(remaining, unit - position % unit)


def min_context_cost(request: LlmRequest, chunking: ChunkingConfig, computed: int) -> int:
    """The fewest tokens a context can advance by in one iteration."""
    remaining = request.num_tokens - computed
    if not chunking.enabled and request.num_pauses == 0:
        return remaining
    return unit_step(computed, remaining, chunking.unit)


class IterationBudget:
    """Slots and tokens left in this iteration, consumed request by request."""

    def __init__(self, max_batch_size: int, max_num_tokens: int, chunking: ChunkingConfig) -> None:
        self.max_num_tokens = max_num_tokens
        self.slots_left = max_batch_size
        self.tokens_left = max_num_tokens
        self.chunking = chunking

    @property
    def equal_progress(self) -> bool:
        return self.chunking.enabled and self.chunking.policy == EQUAL_PROGRESS

    def take(self, request: LlmRequest, computed: int | None = None) -> int:
        """Reserve what ``request`` would compute; returns those tokens (0: it does not fit).

        ``computed``: as for :func:`context_chunk`. Under EQUAL_PROGRESS only the smallest step is
        reserved: the micro-batch stage shares the rest.
        """
        if self.slots_left <= 0:
            return 0
        if request.state in GENERATION_STATES:  # every beam computes a token (TRT-LLM counts them all)
            width = request.beam_width
            tokens = width if self.tokens_left >= width else 0
        elif self.equal_progress:
            if computed is None:
                computed = request.num_computed_tokens
            cost = min_context_cost(request, self.chunking, computed)
            tokens = cost if 0 < cost <= self.tokens_left else 0
        else:
            tokens = context_chunk(request, self.tokens_left, self.chunking, computed)
        if tokens:
            self.slots_left -= 1
            self.tokens_left -= tokens
        return tokens

    def take_all(self, requests: Iterable[LlmRequest]) -> list[LlmRequest]:
        """The requests that fit, each reserved in turn exactly as :meth:`take` reserves it; a
        generation (every running request, every iteration) is counted here without a call."""
        taken = []
        for request in requests:
            if request.state in GENERATION_STATES and self.slots_left > 0:
                width = request.beam_width
                if self.tokens_left >= width:
                    self.slots_left -= 1
                    self.tokens_left -= width
                    taken.append(request)
            elif self.take(request):
                taken.append(request)
        return taken

    def give_back(self, tokens: int) -> None:
        self.slots_left += 1
        self.tokens_left += tokens
