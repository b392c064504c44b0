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

from bm.kv import KVCacheManager
from bm.scheduling.budget import ChunkingConfig
from bm.scheduling.micro_batch import MicroBatchScheduler
from bm.scheduling.request import LlmRequest, RequestState
from bm.scheduling.scheduler import RequestScheduler, SchedulerOutput


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
        self._batch: list[LlmRequest] = []

    def holds(self, request: LlmRequest) -> bool:
        """A finished member stays (as an empty slot) until every member of its batch has finished."""
        return any(m is request for m in self._batch) and not all(m.is_finished for m in self._batch)

    def schedule_request(
        self, active_requests: Sequence[LlmRequest], inflight_request_ids: frozenset[int] = frozenset()
    ) -> SchedulerOutput:
        self._batch = [m for m in self._batch if m.state < RequestState.GENERATION_COMPLETE]
        if not self._batch:
            self._batch = self._form(active_requests)
        members = [m for m in self._batch if m.request_id not in inflight_request_ids]
        if any(m.is_context_phase or m.num_padding_computed < m.num_padding_tokens for m in members):
            return SchedulerOutput(context_requests=self._context_work(members))
        return SchedulerOutput(generation_requests=members)

    def _form(self, active_requests: Sequence[LlmRequest]) -> list[LlmRequest]:
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
        for member in members:
            member.num_padding_tokens = longest_prompt - member.num_tokens
            member.num_padding_computed = 0
            member.num_empty_slots = 0
        return members

    def _context_work(self, members: list[LlmRequest]) -> list[LlmRequest]:
        """Real context chunks by the chunking policy, then pad tokens in what is left of the budget."""
        real, _ = self._contexts.schedule([m for m in members if m.is_context_phase])
        tokens_left = self.max_num_tokens if self.chunking.enabled else sys.maxsize
        tokens_left -= sum(m.context_chunk_size for m in real)
        work = list(real)
        for member in members:
            pads = member.num_padding_tokens - member.num_padding_computed
            real_done = not member.is_context_phase or (
                member in real and member.context_chunk_size == member.num_context_tokens_remaining
            )
            if pads <= 0 or not real_done or tokens_left <= 0:
                continue
            member.padding_chunk_size = min(pads, tokens_left)
            tokens_left -= member.padding_chunk_size
            if member not in real:
                member.context_chunk_size = 0
                work.append(member)
        return work
