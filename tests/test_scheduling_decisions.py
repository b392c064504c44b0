"""Scheduling decisions pinned to exact values worked out by hand from the policies' definitions.

Outcome tests (outputs equal HF generate()) cannot see these: a request paused in the wrong order, a chunk
that ends off a block boundary or a context one token too long for the budget still produces the right
tokens, only later or never. Each test here states the situation and the one correct decision.
"""

from __future__ import annotations

import json

import pytest

from bm.batch_manager import InferenceRequest
from tests.conftest import make_config
from tests.engine_wait import generate_or_fail
from tests.sched_helpers import Harness, ReuseCache

POLICIES = ["guaranteed_no_evict", "max_utilization", "static_batch"]


# -- the token budget: a context equal to it fits, one token more does not -----------------------------


@pytest.mark.parametrize("policy", POLICIES)
@pytest.mark.parametrize(("prompt_len", "scheduled"), [(15, True), (16, True), (17, False)])
def test_unchunked_context_runs_when_it_fits_the_token_budget_exactly(policy, prompt_len, scheduled):
    h = Harness(policy=policy, max_num_tokens=16)
    decision = h.schedule([h.waiting(0, prompt_len)])
    assert decision.context == ({0: prompt_len} if scheduled else {})


@pytest.mark.parametrize("policy", POLICIES[:2])
@pytest.mark.parametrize(("prompt_len", "scheduled"), [(14, True), (15, True), (16, False)])
def test_generation_tokens_count_against_the_budget_a_context_must_fit(policy, prompt_len, scheduled):
    # One generation token leaves 15 of the 16: a 15-token context fits exactly, 16 does not.
    h = Harness(policy=policy, max_num_tokens=16)
    running = h.generating(0, prompt_len=4, generated=1)
    decision = h.schedule([running, h.waiting(1, prompt_len)])
    assert decision.generation == [0]
    assert decision.context == ({1: prompt_len} if scheduled else {})


def test_a_prompt_exactly_the_token_budget_completes_end_to_end(tiny_model):
    stats: list[str] = []
    config = make_config(engine={"max_num_tokens": 16}, kv_cache={"tokens_per_block": 4})
    results = generate_or_fail(
        [InferenceRequest.from_values(0, [5] * 16, 3)],
        config,
        model=tiny_model,
        return_stats=stats.append,
    )
    assert len(results[0].output_ids) == 3
    assert json.loads(stats[0])["Total Context Tokens"] == 16


# -- chunk boundaries ---------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("budget", "prompt_len", "chunk"),
    [
        (10, 20, 8),  # not the last chunk: 10 rounded down to a multiple of the 4-token block
        (12, 20, 12),  # the budget is itself a multiple of the block
        (15, 20, 12),
        (10, 10, 10),  # the last chunk may end anywhere: the whole context fits
        (10, 11, 8),  # one token over the budget: a non-final chunk again
        (16, 16, 16),
    ],
)
@pytest.mark.parametrize("chunking", ["first_come_first_served", "equal_progress"])
def test_first_chunk_of_one_context_ends_on_a_block_boundary_unless_it_is_the_last(
    chunking, budget, prompt_len, chunk
):
    h = Harness(max_num_tokens=budget, chunking=chunking)
    assert h.schedule([h.waiting(0, prompt_len)]).context == {0: chunk}


def test_fcfs_fills_the_budget_in_arrival_order_with_block_aligned_chunks():
    # Budget 10, blocks of 4: the first context takes 8 (a block multiple); the 2 tokens left cannot
    # hold a block, so the second waits.
    h = Harness(max_num_tokens=10, chunking="first_come_first_served")
    assert h.schedule([h.waiting(0, 20), h.waiting(1, 20)]).context == {0: 8}
    # A short first context leaves room: 6 (its last chunk), then 4 of the 10 remain, exactly one block.
    h = Harness(max_num_tokens=10, chunking="first_come_first_served")
    assert h.schedule([h.waiting(0, 6), h.waiting(1, 20)]).context == {0: 6, 1: 4}


def test_fcfs_chunk_after_a_generation_token_still_ends_on_a_block_boundary():
    # 1 generation token leaves 9 of 10; a non-final chunk of 9 would straddle blocks, so 8.
    h = Harness(max_num_tokens=10, chunking="first_come_first_served")
    running = h.generating(0, prompt_len=4, generated=1)
    decision = h.schedule([running, h.waiting(1, 20)])
    assert decision.generation == [0] and decision.context == {1: 8}


@pytest.mark.parametrize(
    ("budget", "prompts", "chunks"),
    [
        (10, [20, 20], {0: 4, 1: 4}),  # one block each; the 2 tokens left hold no further step
        (12, [20, 20, 20], {0: 4, 1: 4, 2: 4}),
        (10, [20, 20, 20], {0: 4, 1: 4}),  # the third gets nothing rather than a partial block
        (16, [20, 20], {0: 8, 1: 8}),  # two rounds
        (10, [6, 20], {0: 6, 1: 4}),  # round 1: 4 + 4; round 2: the first's last 2 tokens
        (10, [3, 20], {0: 3, 1: 4}),  # a context shorter than a block finishes in one step
    ],
)
def test_equal_progress_advances_every_context_one_block_per_round(budget, prompts, chunks):
    h = Harness(max_num_tokens=budget, chunking="equal_progress")
    assert h.schedule([h.waiting(i, n) for i, n in enumerate(prompts)]).context == chunks


@pytest.mark.parametrize(
    ("chunking", "per_iteration"),
    [("first_come_first_served", [8, 8, 4]), ("equal_progress", [8, 8, 4])],
)
def test_chunked_context_iterations_end_to_end(tiny_model, chunking, per_iteration):
    # One 20-token prompt, budget 10, blocks of 4: chunks of 8, 8 and the last 4 (both policies agree
    # with a single context). The context tokens per iteration show it in the engine's own stats.
    stats: list[str] = []
    config = make_config(
        engine={"max_num_tokens": 10, "enable_chunked_context": True, "context_chunking_policy": chunking},
        kv_cache={"tokens_per_block": 4},
    )
    generate_or_fail(
        [InferenceRequest.from_values(0, [5] * 20, 2)],
        config,
        model=tiny_model,
        return_stats=stats.append,
    )
    context = [json.loads(s)["Total Context Tokens"] for s in stats]
    assert [c for c in context if c] == per_iteration


def test_equal_progress_shares_each_iteration_end_to_end(tiny_model):
    # Prompts of 16 and 20, budget 10, blocks of 4: 4 + 4 a round for four iterations (16 each), then
    # the second's last 4 beside the first's first generation token.
    stats: list[str] = []
    config = make_config(
        engine={
            "max_num_tokens": 10,
            "enable_chunked_context": True,
            "context_chunking_policy": "equal_progress",
        },
        kv_cache={"tokens_per_block": 4},
    )
    generate_or_fail(
        [InferenceRequest.from_values(0, [5] * 16, 2), InferenceRequest.from_values(1, [6] * 20, 2)],
        config,
        model=tiny_model,
        return_stats=stats.append,
    )
    rows = [json.loads(s) for s in stats]
    assert [r["Total Context Tokens"] for r in rows[:5]] == [8, 8, 8, 8, 4]
    assert [r["Context Requests"] for r in rows[:5]] == [2, 2, 2, 2, 1]


# -- who is paused -------------------------------------------------------------------------------------


def test_max_utilization_pauses_the_most_recently_started_request():
    # 3 blocks of 4, all held. Request 0 (started first) needs a second block for its 5th token; 1 and 2
    # fit in theirs. The latest started (2) is paused and its block goes to 0.
    h = Harness(policy="max_utilization", num_blocks=3)
    active = [h.generating(0, 4, 1), h.generating(1, 2, 1), h.generating(2, 2, 1)]
    decision = h.schedule(active)
    assert decision.paused == [2]
    assert decision.generation == [0, 1]


def test_max_utilization_pauses_in_reverse_start_order_not_list_order():
    # 4 blocks of 4, all held; started in the order 1, 2, 3, 0 (0 arrived first but was resumed last).
    # 1 and 2 each need one more block: 0 (latest started) is paused for 1, then 3 for 2.
    h = Harness(policy="max_utilization", num_blocks=4)
    r1, r2, r3 = h.generating(1, 4, 1), h.generating(2, 4, 1), h.generating(3, 2, 1)
    r0 = h.generating(0, 2, 1)
    decision = h.schedule([r0, r1, r2, r3])
    assert decision.paused == [0, 3]
    assert decision.generation == [1, 2]


def test_max_utilization_pauses_the_request_itself_when_it_is_the_latest_started():
    # 2 blocks, both held; the latest started (1) needs a second block: nobody younger to pause.
    h = Harness(policy="max_utilization", num_blocks=2)
    active = [h.generating(0, 2, 1), h.generating(1, 4, 1)]
    decision = h.schedule(active)
    assert decision.paused == [1] and decision.generation == [0]


def test_max_utilization_pauses_nobody_when_the_blocks_suffice():
    # 5 blocks, 3 held: 0 and 1 each take one of the 2 free for their 5th token.
    h = Harness(policy="max_utilization", num_blocks=5)
    active = [h.generating(0, 4, 1), h.generating(1, 4, 1), h.generating(2, 2, 1)]
    decision = h.schedule(active)
    assert decision.paused == [] and decision.generation == [0, 1, 2]


@pytest.mark.parametrize("policy", ["guaranteed_no_evict", "static_batch"])
def test_reserving_policies_never_pause(policy):
    # Same squeeze as above: these policies reserved the blocks to completion up front, so they pause
    # nobody and keep every started request running.
    h = Harness(policy=policy, num_blocks=64)
    active = [h.generating(0, 4, 1), h.generating(1, 2, 1), h.generating(2, 2, 1)]
    decision = h.schedule(active)
    assert decision.paused == [] and decision.generation == [0, 1, 2]


def test_max_utilization_pauses_the_latest_started_end_to_end(tiny_model):
    # Three 4-token prompts, 8 new tokens each, blocks of 4, a cache of 7 blocks. They start together
    # in arrival order (0, 1, 2) and each needs a third block at its 9th token: 9 > 7, so the latest
    # started (2) is paused, then resumes once 0 and 1 finish. 0 and 1 are never paused.
    config = make_config(
        engine={"scheduler_policy": "max_utilization", "max_batch_size": 8, "max_num_tokens": 64},
        kv_cache={"tokens_per_block": 4, "max_tokens": 28},
    )
    results = generate_or_fail(
        [InferenceRequest.from_values(i, [5 + i] * 4, 8) for i in range(3)],
        config,
        model=tiny_model,
        check_integrity=True,
    )
    assert [results[i].num_pauses for i in range(3)] == [0, 0, 1]
    assert all(len(results[i].output_ids) == 8 for i in range(3))


# -- slots and blocks at their limits ------------------------------------------------------------------


@pytest.mark.parametrize("policy", POLICIES)
def test_max_batch_size_admits_exactly_that_many_in_arrival_order(policy):
    h = Harness(policy=policy, max_batch_size=2)
    assert h.schedule([h.waiting(i, 4) for i in range(3)]).context == {0: 4, 1: 4}


@pytest.mark.parametrize("policy", POLICIES[:2])
def test_generation_requests_fill_a_token_budget_equal_to_their_number(policy):
    # 3 generation requests and a budget of 3 tokens: each gets its one token, nothing is left over.
    h = Harness(policy=policy, max_num_tokens=3, num_blocks=64)
    active = [h.generating(i, 4, 1) for i in range(3)]
    decision = h.schedule([*active, h.waiting(3, 1)])
    assert decision.generation == [0, 1, 2] and decision.context == {}


@pytest.mark.parametrize("policy", ["guaranteed_no_evict", "static_batch"])
@pytest.mark.parametrize(("num_blocks", "admitted"), [(9, [0]), (10, [0, 1]), (11, [0, 1])])
def test_reserving_policies_admit_a_request_whose_need_equals_the_free_blocks(policy, num_blocks, admitted):
    # Each needs ceil((8 + 9) / 4) = 5 blocks to completion: two fit in 10 exactly, not in 9.
    h = Harness(policy=policy, num_blocks=num_blocks)
    decision = h.schedule([h.waiting(0, 8, max_new=9), h.waiting(1, 8, max_new=9)])
    assert list(decision.context) == admitted


def test_fcfs_stops_at_the_first_context_that_does_not_fit():
    # Budget 10: 8 to the first; the second cannot take a block in the 2 left, and the 1-token third
    # behind it waits too (first come, first served).
    h = Harness(max_num_tokens=10, chunking="first_come_first_served")
    assert h.schedule([h.waiting(0, 20), h.waiting(1, 20), h.waiting(2, 1)]).context == {0: 8}


def test_equal_progress_shares_among_at_most_max_batch_size_contexts():
    h = Harness(max_num_tokens=64, max_batch_size=2, chunking="equal_progress")
    assert h.schedule([h.waiting(i, 20) for i in range(3)]).context == {0: 20, 1: 20}


@pytest.mark.parametrize("chunking", ["first_come_first_served", "equal_progress"])
def test_a_chunk_cap_off_the_block_size_still_gives_block_aligned_chunks(chunking):
    # (EQUAL_PROGRESS used to cut a step at the cap, giving 6 and, under MAX_UTILIZATION, an
    # OutOfBlocksError; fixed on main in "EQUAL_PROGRESS stops a context at its chunk cap".)
    # context_chunk_size 6 with blocks of 4: a non-final chunk is at most 6 and a block multiple: 4.
    h = Harness(max_num_tokens=64, chunking=chunking, context_chunk_size=6)
    assert h.schedule([h.waiting(0, 20)]).context == {0: 4}


def test_max_utilization_with_equal_progress_and_an_unaligned_chunk_cap_completes(tiny_model):
    config = make_config(
        engine={
            "scheduler_policy": "max_utilization",
            "enable_chunked_context": True,
            "context_chunking_policy": "equal_progress",
            "context_chunk_size": 6,
        },
        kv_cache={"tokens_per_block": 4, "max_tokens": 40},
    )
    requests = [InferenceRequest.from_values(i, [5 + i] * 20, 4) for i in range(3)]
    results = generate_or_fail(requests, config, model=tiny_model, check_integrity=True)
    assert all(len(results[i].output_ids) == 4 for i in range(3))


@pytest.mark.parametrize("chunking", ["first_come_first_served", "equal_progress"])
def test_max_utilization_with_chunking_in_a_tight_cache_completes(tiny_model, chunking):
    # 10 blocks of 4 for three 20-token prompts with 4 new tokens (6 blocks each at completion): the
    # capacity stage must size every chunk's blocks for what the micro batch then hands out.
    config = make_config(
        engine={
            "scheduler_policy": "max_utilization",
            "enable_chunked_context": True,
            "context_chunking_policy": chunking,
        },
        kv_cache={"tokens_per_block": 4, "max_tokens": 40},
    )
    requests = [InferenceRequest.from_values(i, [5 + i] * 20, 4) for i in range(3)]
    results = generate_or_fail(requests, config, model=tiny_model, check_integrity=True)
    assert all(len(results[i].output_ids) == 4 for i in range(3))


@pytest.mark.parametrize(("budget", "generation"), [(64, [1, 2]), (2, [1, 2])])
def test_a_paused_requests_token_goes_back_to_the_budget(budget, generation):
    # As in the reverse-start-order test, but with only 2 tokens: 0 (youngest, first in the list) takes
    # one, 1 takes the other, then 0 is paused for 1's block and its token goes back, so 2 can run.
    h = Harness(policy="max_utilization", num_blocks=4, max_num_tokens=budget)
    r1, r2, r3 = h.generating(1, 4, 1), h.generating(2, 4, 1), h.generating(3, 2, 1)
    r0 = h.generating(0, 2, 1)
    decision = h.schedule([r0, r1, r2, r3])
    assert decision.generation == generation and decision.paused == [0, 3]


def test_micro_batch_alone_respects_max_batch_size_under_equal_progress():
    # A custom capacity scheduler may pass on more than fits: the micro batch still caps the slots.
    h = Harness(max_num_tokens=64, max_batch_size=2, chunking="equal_progress")
    assert h.micro_batch([h.waiting(i, 20) for i in range(3)]).context == {0: 20, 1: 20}


def test_micro_batch_alone_serves_contexts_first_come_first_served():
    # Budget 10: 8 to the first; the second cannot take a block in the 2 left; the 1-token third
    # behind it must not jump the queue.
    h = Harness(max_num_tokens=10, chunking="first_come_first_served")
    assert h.micro_batch([h.waiting(0, 20), h.waiting(1, 20), h.waiting(2, 1)]).context == {0: 8}


def test_pausing_frees_only_the_blocks_no_other_request_shares():
    # Blocks of 4. Request 0 computes 8 prompt tokens (2 full blocks, registered for reuse); request 1
    # has the same 8 and 1 more: it takes both blocks by reference and allocates a third of its own.
    # Pausing 0 would free nothing (1 still holds both), pausing 1 only its own block.
    cache = ReuseCache(num_blocks=6)
    cache.run_context(0, [9] * 8)
    cache.run_context(1, [9] * 8 + [7])
    assert (cache.held(0), cache.held(1)) == (2, 3)
    assert cache.freeable(0) == 0 and cache.freeable(1) == 1


def test_the_last_free_block_can_be_allocated():
    cache = ReuseCache(num_blocks=3)
    cache.run_context(0, [9] * 8)  # 2 of 3 blocks
    assert cache.free_blocks() == 1
    assert cache.can_allocate(0, 12)  # a third block: exactly the one left
    assert not cache.can_allocate(0, 13)


def test_blocks_freed_by_two_pauses_are_counted_once_each():
    # 5 blocks of 4, all held; started in the order 1..5. 1, 2 and 3 each need a second block; 4 and 5
    # fit in theirs. 5 is paused for 1, 4 for 2 (one block each); then 3 is the youngest left and
    # nothing is free, so it pauses itself. (Counting 5's block again at 4's pause would let 3 run.)
    h = Harness(policy="max_utilization", num_blocks=5)
    active = [h.generating(i, 4 if i <= 3 else 2, 1) for i in range(1, 6)]
    decision = h.schedule(active)
    assert decision.paused == [5, 4, 3] and decision.generation == [1, 2]


def test_a_prefix_only_a_paused_request_held_costs_its_blocks_when_taken():
    # Block reuse, blocks of 4, 4 blocks. 0 holds 1 block and needs a 2nd; 1 (started later) holds 2
    # registered blocks of [9] * 8 and needs a 3rd, so it pauses itself: its 2 blocks become cached and
    # are all that is free. Request 2 ([9] * 8 + [5]) would take them as its prefix and need 1 block
    # more: 3 blocks from a free pool of 2, so it must wait.
    h = Harness(policy="max_utilization", num_blocks=4, block_reuse=True)
    r0 = h.generating(0, 4, 1, prompt=[1] * 4)
    r1 = h.generating(1, 8, 1, prompt=[9] * 8)
    # (2 is listed before 1: a request that arrived after one paused now would not start anyway.)
    decision = h.schedule([r0, h.waiting(2, 9, prompt=[9] * 8 + [5]), r1])
    assert decision.generation == [0] and decision.paused == [1] and decision.context == {}
