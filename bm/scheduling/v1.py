"""The V1 scheme: traditional static batching, kept as the honest baseline.

Up to ``max_batch_size`` requests form a batch when none is running and then run in lockstep until all
of them finish; nobody joins a batch in flight. Every member is padded to the batch's longest input and
longest output, and that padding is executed: pad tokens beside each shorter prompt (in a KV table of
their own, so they never touch the member's real attention), and an "empty generation slot" for every
member that has already finished while the batch runs on. The padded batch's blocks are reserved when
it forms, as a static batch allocates its padded cache up front; so under V1 there is nothing to pause
and the capacity policy makes no difference.
"""

from __future__ import annotations

import sys
from collections.abc import Sequence
from dataclasses import dataclass

from bm.kv import KVCacheManager
from bm.scheduling.budget import ChunkingConfig
from bm.scheduling.micro_batch import MicroBatchScheduler
from bm.scheduling.request import LlmRequest, RequestState
from bm.scheduling.scheduler import EmptySlot, PaddingWork, RequestScheduler, SchedulerOutput


@dataclass
class _Member:
    """A request's place in the static batch: the padding it owes and the empty slots it has run."""

    request: LlmRequest
    num_padding_tokens: int
    num_padding_computed: int = 0
    num_empty_slots: int = 0


class V1Scheduler(RequestScheduler):
    def __init__(
        self,
        max_batch_size: int,
        max_num_tokens: int,
        kv_cache_manager: KVCacheManager,
        chunking: ChunkingConfig | None = None,
    ) -> None:
        self.max_batch_size = max_batch_size
        self.max_num_tokens = max_num_tokens
        self.kv_cache_manager = kv_cache_manager
        self.chunking = chunking or ChunkingConfig()
        # Without chunking a batch's padded contexts all run in its first iteration (the engine splits
        # the forward to respect max_num_tokens); with chunking they share the token budget.
        tokens = max_num_tokens if self.chunking.enabled else sys.maxsize
        self._contexts = MicroBatchScheduler(max_batch_size, tokens, self.chunking)
        self._batch: list[_Member] = []

    def holds(self, request: LlmRequest) -> bool:
        """A finished member stays (as an empty slot) until every member of its batch has finished."""
        return any(m.request is request for m in self._batch) and not all(
            m.request.is_finished for m in self._batch
        )

    def schedule_request(
        self, active_requests: Sequence[LlmRequest], inflight_request_ids: frozenset[int] = frozenset()
    ) -> SchedulerOutput:
        """Plan the batch's next step; the padding and empty slots it emits are counted as done."""
        self._batch = [m for m in self._batch if m.request.state < RequestState.GENERATION_COMPLETE]
        if not self._batch:
            self._batch = self._form(active_requests)
        members = [m for m in self._batch if m.request.request_id not in inflight_request_ids]
        if any(m.request.is_context_phase or m.num_padding_computed < m.num_padding_tokens for m in members):
            return self._context_work(members)
        out = SchedulerOutput()
        for m in members:
            if m.request.is_finished:
                out.empty_slots.append(
                    EmptySlot(m.request, m.request.num_computed_tokens + m.num_empty_slots)
                )
                m.num_empty_slots += 1
            else:
                out.generation_requests.append(m.request)
        return out

    def _form(self, active_requests: Sequence[LlmRequest]) -> list[_Member]:
        """Members in arrival order while the padded batch's blocks fit in the free pool."""
        kv = self.kv_cache_manager
        free = kv.get_num_free_blocks()
        members: list[LlmRequest] = []
        longest_prompt = longest_output = 0
        for request in active_requests:
            if request.state != RequestState.CONTEXT_INIT:
                continue
            if len(members) >= self.max_batch_size:
                break
            prompt = max(longest_prompt, request.num_tokens)
            output = max(longest_output, request.max_new_tokens - len(request.output_ids))
            padded = [*members, request]
            need = sum(
                kv.num_blocks_for_tokens(m.num_tokens + output) * m.beam_width
                + kv.num_blocks_for_tokens(prompt - m.num_tokens)
                for m in padded
            )
            if need > free:
                break
            members, longest_prompt, longest_output = padded, prompt, output
        return [_Member(m, longest_prompt - m.num_tokens) for m in members]

    def _context_work(self, members: list[_Member]) -> SchedulerOutput:
        """Real context chunks by the chunking policy, then pad tokens in what is left of the budget."""
        real, _ = self._contexts.schedule([m.request for m in members if m.request.is_context_phase])
        out = SchedulerOutput(context_requests=real, context_chunk_sizes=dict(self._contexts.chunk_sizes))
        tokens_left = self.max_num_tokens if self.chunking.enabled else sys.maxsize
        tokens_left -= out.num_context_tokens
        for member in members:
            request = member.request
            pads = member.num_padding_tokens - member.num_padding_computed
            real_done = not request.is_context_phase or (
                request in real
                and out.context_chunk_sizes[request.request_id] == request.num_context_tokens_remaining
            )
            if pads <= 0 or not real_done or tokens_left <= 0:
                continue
            n = min(pads, tokens_left)
            out.padding.append(PaddingWork(request, member.num_padding_computed, n))
            member.num_padding_computed += n
            tokens_left -= n
        return out
