"""The one place scheduling-decision tests build schedulers and requests.

Decision tests state situations (a cache of N blocks, requests holding M of them, started in some order)
and read back decisions (who runs, with how many context tokens, who is paused). Only this module knows
how the engine core represents them, so when that core changes, this is the file to adapt.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from bm.kv import KVCacheManager
from bm.scheduling import LlmRequest, RequestState
from bm.scheduling.factory import build_scheduler
from tests.conftest import make_config


@dataclass
class Decision:
    """One iteration's schedule, by request id: context chunk sizes, generation requests, paused ones."""

    context: dict[int, int]
    generation: list[int]
    paused: list[int]


class Harness:
    """A scheduler built from an engine config, with its own KV cache of ``num_blocks`` blocks."""

    def __init__(
        self,
        *,
        policy: str = "guaranteed_no_evict",
        num_blocks: int = 64,
        tokens_per_block: int = 4,
        max_batch_size: int = 8,
        max_num_tokens: int = 64,
        chunking: str | None = None,
        context_chunk_size: int | None = None,
    ) -> None:
        engine: dict = {
            "scheduler_policy": policy,
            "max_batch_size": max_batch_size,
            "max_num_tokens": max_num_tokens,
        }
        if chunking:
            engine.update(enable_chunked_context=True, context_chunking_policy=chunking)
        if context_chunk_size is not None:
            engine["context_chunk_size"] = context_chunk_size
        config = make_config(
            engine=engine,
            kv_cache={"tokens_per_block": tokens_per_block, "max_tokens": num_blocks * tokens_per_block},
        )
        self.kv = KVCacheManager(num_blocks=num_blocks, tokens_per_block=tokens_per_block)
        self.scheduler = build_scheduler(config.engine, self.kv)

    def waiting(self, request_id: int, prompt_len: int, max_new: int = 4) -> LlmRequest:
        """A request that has not started: its whole prompt is still to compute."""
        return LlmRequest(
            request_id=request_id, prompt_ids=[3 + request_id] * prompt_len, max_new_tokens=max_new
        )

    def generating(self, request_id: int, prompt_len: int, generated: int, max_new: int = 32) -> LlmRequest:
        """A request in generation that started now: every token but its newest one is in the cache.

        Create them in the order they should count as started (MAX_UTILIZATION pauses the latest).
        """
        request = LlmRequest(
            request_id=request_id,
            prompt_ids=[3 + request_id] * prompt_len,
            max_new_tokens=max_new,
            state=RequestState.GENERATION_IN_PROGRESS,
            output_ids=[7] * generated,
        )
        request.num_computed_tokens = request.num_tokens - 1
        self.kv.allocate(request_id, request.num_computed_tokens)
        self.scheduler.capacity_scheduler.mark_started(request)
        return request

    def held_blocks(self, request_id: int) -> int:
        return self.kv.num_held_blocks(request_id)

    def schedule(self, active: Sequence[LlmRequest]) -> Decision:
        out = self.scheduler.schedule_request(list(active))
        return Decision(
            context={r.request_id: r.context_chunk_size for r in out.context_requests},
            generation=[r.request_id for r in out.generation_requests],
            paused=[r.request_id for r in out.paused_requests],
        )
