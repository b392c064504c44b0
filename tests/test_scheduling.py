"""The two scheduling stages on synthetic requests (no model)."""

from __future__ import annotations

from bm.kv import KVCacheManager
from bm.scheduling import (
    GuaranteedNoEvictScheduler,
    LlmRequest,
    MicroBatchScheduler,
    RequestState,
    SimpleScheduler,
)


def req(rid: int, prompt: int, max_new: int, state: RequestState = RequestState.CONTEXT_INIT) -> LlmRequest:
    r = LlmRequest(request_id=rid, prompt_ids=[3] * prompt, max_new_tokens=max_new, state=state)
    if state != RequestState.CONTEXT_INIT:
        r.num_computed_tokens = prompt
        r.output_ids = [4]
    return r


def test_states_are_ordered_so_schedulable_is_a_range_check():
    assert RequestState.CONTEXT_INIT < RequestState.GENERATION_IN_PROGRESS
    assert RequestState.GENERATION_IN_PROGRESS < RequestState.GENERATION_TO_COMPLETE
    assert RequestState.GENERATION_TO_COMPLETE < RequestState.GENERATION_COMPLETE


def test_guaranteed_no_evict_reserves_blocks_to_completion():
    kv = KVCacheManager(num_blocks=10, tokens_per_block=4)
    sched = GuaranteedNoEvictScheduler(max_num_requests=8, kv_cache_manager=kv)
    # Each needs ceil((8 + 8) / 4) = 4 blocks: two fit in 10, the third waits.
    active = [req(i, 8, 8) for i in range(3)]
    fitting, paused = sched.schedule_request(active)
    assert [r.request_id for r in fitting] == [0, 1] and paused == []


def test_running_requests_are_counted_before_new_ones_are_admitted():
    kv = KVCacheManager(num_blocks=10, tokens_per_block=4)
    sched = GuaranteedNoEvictScheduler(max_num_requests=8, kv_cache_manager=kv)
    running = req(0, 20, 8, RequestState.GENERATION_IN_PROGRESS)  # 7 blocks at completion
    new_small = req(1, 4, 4)  # 2 blocks
    new_big = req(2, 8, 8)  # 4 blocks: does not fit in the 3 left
    fitting, _ = sched.schedule_request([new_big, running, new_small])
    # first come first served among new requests: the big one blocks the small one behind it
    assert [r.request_id for r in fitting] == [0]


def test_finished_requests_are_not_scheduled():
    kv = KVCacheManager(num_blocks=10, tokens_per_block=4)
    sched = GuaranteedNoEvictScheduler(max_num_requests=8, kv_cache_manager=kv)
    done = req(0, 4, 4, RequestState.GENERATION_COMPLETE)
    fitting, _ = sched.schedule_request([done, req(1, 4, 4)])
    assert [r.request_id for r in fitting] == [1]


def test_micro_batch_respects_token_budget_and_schedules_generation_first():
    mb = MicroBatchScheduler(max_batch_size=8, max_num_tokens=20)
    gens = [req(i, 5, 5, RequestState.GENERATION_IN_PROGRESS) for i in range(3)]
    ctx = [req(10, 10, 5), req(11, 10, 5)]
    context, generation = mb.schedule(ctx + gens)
    assert [r.request_id for r in generation] == [0, 1, 2]
    # 3 generation tokens + 10 context tokens fit; the second context (10 more) would make 23 > 20
    assert [r.request_id for r in context] == [10]
    assert mb.chunk_sizes == {10: 10}
    assert context[0].context_chunk_size == 0  # kept for the plan, not written on the request


def test_micro_batch_respects_max_batch_size():
    mb = MicroBatchScheduler(max_batch_size=2, max_num_tokens=1000)
    gens = [req(i, 5, 5, RequestState.GENERATION_IN_PROGRESS) for i in range(3)]
    context, generation = mb.schedule([*gens, req(9, 3, 3)])
    assert len(generation) == 2 and context == []


def test_simple_scheduler_composes_capacity_then_micro_batch():
    kv = KVCacheManager(num_blocks=100, tokens_per_block=4)
    sched = SimpleScheduler(GuaranteedNoEvictScheduler(4, kv), MicroBatchScheduler(4, 64))
    active = [req(0, 8, 4, RequestState.GENERATION_IN_PROGRESS), req(1, 30, 4), req(2, 40, 4)]
    out = sched.schedule_request(active)
    assert [r.request_id for r in out.generation_requests] == [0]
    assert [r.request_id for r in out.context_requests] == [1]  # 1 + 30 tokens; the 40-token prompt waits
    assert out.num_context_tokens == 30
