"""The one place scheduling-decision tests build schedulers and requests.

Decision tests state situations (a cache of N blocks, requests holding M of them, started in some order)
and read back decisions (who runs, with how many context tokens, who is paused). Only this module knows
how the engine core represents them, so when that core changes, this is the file to adapt.
"""

from __future__ import annotations

import signal
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass

import pytest

from bm.kv import KVCacheManager
from bm.scheduling import LlmRequest, MicroBatchScheduler, RequestState
from bm.scheduling.factory import build_scheduler, chunking_config
from tests.conftest import make_config

# A scheduling call on a handful of requests takes microseconds; one that has not returned after this
# many seconds is looping forever.
SCHEDULE_WAIT_S = 5.0


@contextmanager
def returns_within(seconds: float, what: str) -> Iterator[None]:
    """Fail the test if the block runs longer than ``seconds`` (a scheduler looping forever)."""

    def on_alarm(signum: int, frame: object) -> None:
        pytest.fail(f"{what} did not return within {seconds} s: it loops forever", pytrace=False)

    previous = signal.signal(signal.SIGALRM, on_alarm)
    signal.setitimer(signal.ITIMER_REAL, seconds)
    try:
        yield
    finally:
        signal.setitimer(signal.ITIMER_REAL, 0)
        signal.signal(signal.SIGALRM, previous)


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
        block_reuse: bool = False,
    ) -> None:
        engine: dict = {
            "scheduler_policy": policy,
            "max_batch_size": max_batch_size,
            "max_num_tokens": max_num_tokens,
            "enable_chunked_context": False,  # chunking=None: a context runs whole (the seed's)
        }
        if chunking:
            engine.update(enable_chunked_context=True, context_chunking_policy=chunking)
        if context_chunk_size is not None:
            engine["context_chunk_size"] = context_chunk_size
        config = make_config(
            engine=engine,
            kv_cache={
                "tokens_per_block": tokens_per_block,
                "max_tokens": num_blocks * tokens_per_block,
                "enable_block_reuse": block_reuse,
            },
        )
        self.kv = KVCacheManager(
            num_blocks=num_blocks, tokens_per_block=tokens_per_block, enable_block_reuse=block_reuse
        )
        self.scheduler = build_scheduler(config.engine, self.kv)
        self._starts = 0
        # The micro-batch stage alone, as a custom capacity scheduler would feed it.
        self.micro_batch_stage = MicroBatchScheduler(
            max_batch_size, max_num_tokens, chunking_config(config.engine, tokens_per_block)
        )

    def waiting(
        self, request_id: int, prompt_len: int, max_new: int = 4, prompt: list[int] | None = None
    ) -> LlmRequest:
        """A request that has not started: its whole prompt is still to compute.

        ``prompt``: its tokens (default ``prompt_len`` copies of a token of its own).
        """
        prompt = prompt if prompt is not None else [3 + request_id] * prompt_len
        return LlmRequest(request_id=request_id, prompt_ids=prompt, max_new_tokens=max_new)

    def generating(
        self,
        request_id: int,
        prompt_len: int,
        generated: int,
        max_new: int = 32,
        prompt: list[int] | None = None,
    ) -> LlmRequest:
        """A request in generation that started now: every token but its newest one is in the cache
        (and, with block reuse, its full blocks registered for reuse).

        Create them in the order they should count as started (MAX_UTILIZATION pauses the latest).
        """
        request = LlmRequest(
            request_id=request_id,
            prompt_ids=prompt if prompt is not None else [3 + request_id] * prompt_len,
            max_new_tokens=max_new,
            state=RequestState.GENERATION_IN_PROGRESS,
            output_ids=[7] * generated,
        )
        request.num_computed_tokens = request.num_tokens - 1
        self.kv.allocate(request_id, request.num_computed_tokens)
        self.kv.cache_computed_blocks(request, request.num_computed_tokens)  # no-op without reuse
        self._starts += 1  # what the engine core records when a request starts holding blocks
        request.start_order = self._starts
        return request

    def held_blocks(self, request_id: int) -> int:
        return self.kv.num_held_blocks(request_id)

    def schedule(self, active: Sequence[LlmRequest]) -> Decision:
        ids = [r.request_id for r in active]
        with returns_within(SCHEDULE_WAIT_S, f"scheduling requests {ids}"):
            out = self.scheduler.schedule_request(list(active))
        return Decision(
            context={r.request_id: out.context_chunk_sizes[r.request_id] for r in out.context_requests},
            generation=[r.request_id for r in out.generation_requests],
            paused=[r.request_id for r in out.paused_requests],
        )

    def micro_batch(self, fitting: Sequence[LlmRequest]) -> Decision:
        """The micro-batch stage alone on ``fitting`` (what a capacity stage, maybe a user's, passed on)."""
        ids = [r.request_id for r in fitting]
        with returns_within(SCHEDULE_WAIT_S, f"micro-batching requests {ids}"):
            context, generation = self.micro_batch_stage.schedule(list(fitting))
        chunks = self.micro_batch_stage.chunk_sizes
        return Decision(
            {r.request_id: chunks[r.request_id] for r in context}, [r.request_id for r in generation], []
        )


class ReuseCache:
    """A KV cache with block reuse, for decisions that depend on blocks shared between requests."""

    def __init__(self, num_blocks: int, tokens_per_block: int = 4) -> None:
        self.kv = KVCacheManager(
            num_blocks=num_blocks, tokens_per_block=tokens_per_block, enable_block_reuse=True
        )

    def run_context(self, request_id: int, prompt: list[int]) -> LlmRequest:
        """Start a request (taking any cached prefix), compute its whole prompt and register its blocks."""
        request = LlmRequest(request_id=request_id, prompt_ids=prompt, max_new_tokens=4)
        self.kv.take_cached_prefix(request, self.kv.find_cached_prefix(request))
        self.kv.allocate(request_id, len(prompt))
        self.kv.cache_computed_blocks(request, len(prompt))
        return request

    def freeable(self, request_id: int) -> int:
        """Blocks that pausing (freeing) the request would return to the pool."""
        return self.kv.num_freeable_blocks(request_id)

    def held(self, request_id: int) -> int:
        return self.kv.num_held_blocks(request_id)

    def free_blocks(self) -> int:
        return self.kv.get_num_free_blocks()

    def can_allocate(self, request_id: int, num_tokens: int) -> bool:
        return self.kv.can_allocate(request_id, num_tokens)
