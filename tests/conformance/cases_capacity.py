"""TensorRT-LLM's ``capacitySchedulerTest.cpp``, as data.

One :class:`Case` per test and policy the test loops over. Budgets map as follows: ``maxNumRequests`` is
``max_batch_size``; ``kvCacheMaxNumTokens / kvCacheTokensPerBlock`` is the number of blocks; a request's
``setContextChunkSize(n)`` is ``context_chunk_size: n`` with chunked context on; there is no token budget
(the capacity test runs no micro-batch stage). ``kvCacheMaxNumTokensPerSeq`` never binds (every sequence
is shorter) and sink tokens are 0 in every configuration TRT-LLM runs, so neither appears.

``Before(max_new, prompt_len, num_gen, ctx_pos)`` is TRT-LLM's ``RequestState`` tuple.
"""

from __future__ import annotations

from tests.conformance.harness import Before, Case, Req, Span, fill, iota

CAPACITY = "capacitySchedulerTest.cpp::CapacitySchedulerTest."


def two(prompt: int, max_new: int) -> tuple[Req, ...]:
    return (Req(0, prompt, max_new), Req(1, prompt, max_new))


def simple_should_fit(policy: str) -> Case:
    return Case(
        name=f"SimpleShouldFit[{policy}]",
        source=CAPACITY + "SimpleShouldFit",
        policy=policy,
        max_batch_size=2,
        num_blocks=20,
        requests=two(10, 80),
        spans=(
            Span(0, 80, scheduled=(0, 1), active=(0, 1), before={0: Before(80, 10, 0), 1: Before(80, 10, 0)}),
        ),
        num_iterations=80,
    )


def simple_should_fit_in_chunk(policy: str) -> Case:
    def both(num_gen: int, pos: int) -> dict[int, Before]:
        return {0: Before(40, 50, num_gen, pos), 1: Before(40, 50, num_gen, pos)}

    return Case(
        name=f"SimpleShouldFitInChunk[{policy}]",
        source=CAPACITY + "SimpleShouldFitInChunk",
        policy=policy,
        max_batch_size=2,
        num_blocks=20,
        chunking="FIRST_COME_FIRST_SERVED",
        chunk_size=20,
        requests=two(50, 40),
        spans=(
            Span(0, 1, scheduled=(0, 1), active=(0, 1), before=both(0, 0)),
            Span(1, 2, scheduled=(0, 1), active=(0, 1), before=both(0, 20)),
            Span(2, 3, scheduled=(0, 1), active=(0, 1), before=both(0, 40)),
            Span(3, 4, scheduled=(0, 1), active=(0, 1), before=both(1, 50)),
            Span(4, 42, scheduled=(0, 1), active=(0, 1), before=both(2, 50)),
        ),
        num_iterations=42,
    )


def delay_duplicate_request(policy: str) -> Case:
    prompt = iota(21)  # two blocks and one token: the last input token is never reused
    reqs = tuple(Req(i, prompt, 2) for i in range(3))
    if policy == "STATIC_BATCH":  # no delay in static batching
        spans: tuple[Span, ...] = (
            Span(0, 2, scheduled=(0, 1, 2), active=(0, 1, 2), before={i: Before(2, 21, 0) for i in range(3)}),
        )
        iterations = 2
    else:
        spans = (
            Span(0, 1, scheduled=(0,), active=(0, 1, 2), before={0: Before(2, 21, 0)}),
            Span(
                1,
                2,
                scheduled=(0, 1, 2),
                active=(0, 1, 2),
                before={0: Before(2, 21, 1, 21), 1: Before(2, 21, 0), 2: Before(2, 21, 0)},
            ),
            Span(
                2,
                3,
                scheduled=(1, 2),
                active=(1, 2),
                before={1: Before(2, 21, 1, 21), 2: Before(2, 21, 1, 21)},
            ),
        )
        iterations = 3
    return Case(
        name=f"DelayDuplicateRequest[{policy}]",
        source=CAPACITY + "DelayDuplicateRequest",
        policy=policy,
        max_batch_size=3,
        num_blocks=20,
        enable_block_reuse=True,
        requests=reqs,
        spans=spans,
        num_iterations=iterations,
        num_reused_blocks=4,
    )


def delay_duplicate_request_chunked(policy: str) -> Case:
    return Case(
        name=f"DelayDuplicateRequestChunked[{policy}]",
        source=CAPACITY + "DelayDuplicateRequestChunked",
        policy=policy,
        max_batch_size=2,
        num_blocks=20,
        enable_block_reuse=True,
        chunking="FIRST_COME_FIRST_SERVED",
        chunk_size=20,
        requests=(Req(0, iota(50), 40), Req(1, iota(50), 40)),
        spans=(
            Span(0, 1, scheduled=(0,), active=(0, 1), before={0: Before(40, 50, 0, 0)}),
            Span(1, 2, scheduled=(0,), active=(0, 1), before={0: Before(40, 50, 0, 20)}),
            Span(2, 3, scheduled=(0,), active=(0, 1), before={0: Before(40, 50, 0, 40)}),
            Span(
                3,
                4,
                scheduled=(0, 1),
                active=(0, 1),
                before={0: Before(40, 50, 1, 50), 1: Before(40, 50, 0, 0)},
            ),
            Span(
                4,
                42,
                scheduled=(0, 1),
                active=(0, 1),
                before={0: Before(40, 50, 2, 50), 1: Before(40, 50, 1, 50)},
            ),
            Span(42, 43, scheduled=(1,), active=(1,), before={1: Before(40, 50, 39, 50)}),
        ),
        num_iterations=43,
        num_reused_blocks=4,
    )


def delay_five_requests_complicated(policy: str) -> Case:
    # Two requests with prompts of their own, then three sharing a growing system prompt.
    lens = (11, 21, 11, 21, 31)
    reqs = (
        Req(0, iota(11, 1), 80),
        Req(1, iota(21, 2), 80),
        Req(2, iota(11), 80),
        Req(3, iota(21), 80),
        Req(4, iota(31), 80),
    )
    every = (0, 1, 2, 3, 4)
    return Case(
        name=f"DelayFiveRequestsComplicated[{policy}]",
        source=CAPACITY + "DelayFiveRequestsComplicated",
        policy=policy,
        max_batch_size=5,
        num_blocks=100,
        enable_block_reuse=True,
        requests=reqs,
        spans=(
            Span(
                0, 1, scheduled=(0, 1, 2), active=every, before={i: Before(80, lens[i], 0) for i in (0, 1, 2)}
            ),
            Span(
                1,
                2,
                scheduled=(0, 1, 2, 3),
                active=every,
                before={**{i: Before(80, lens[i], 1, lens[i]) for i in (0, 1, 2)}, 3: Before(80, 21, 0)},
            ),
            Span(
                2,
                80,
                scheduled=every,
                active=every,
                before={
                    **{i: Before(80, lens[i], 2, lens[i]) for i in (0, 1, 2)},
                    3: Before(80, 21, 1, 21),
                    4: Before(80, 31, 0),
                },
            ),
            Span(
                80,
                81,
                scheduled=(3, 4),
                active=(3, 4),
                before={3: Before(80, 21, 79, 21), 4: Before(80, 31, 78, 31)},
            ),
            Span(81, 82, scheduled=(4,), active=(4,), before={4: Before(80, 31, 79, 31)}),
        ),
        num_iterations=82,
        num_reused_blocks=3,
    )


def staggered_pair(name: str, policy: str, num_blocks: int, batch: int, prompt_len: int, **expect) -> Case:
    """The reuse-aware tests' shape: two identical prompts; the second waits one iteration, then reuses."""
    new = 5
    return Case(
        name=name,
        source=CAPACITY + name,
        policy=policy,
        max_batch_size=batch,
        num_blocks=num_blocks,
        enable_block_reuse=True,
        requests=(Req(0, iota(prompt_len), new), Req(1, iota(prompt_len), new)),
        spans=(
            Span(0, 1, scheduled=(0,), active=(0, 1), before={0: Before(new, prompt_len, 0)}),
            Span(
                1,
                new,
                scheduled=(0, 1),
                active=(0, 1),
                before={0: Before(new, prompt_len, 1, prompt_len), 1: Before(new, prompt_len, 0)},
            ),
            Span(
                new,
                new + 1,
                scheduled=(1,),
                active=(1,),
                before={1: Before(new, prompt_len, new - 1, prompt_len)},
            ),
        ),
        num_iterations=new + 1,
        **expect,
    )


def together_pair(name: str, policy: str, num_blocks: int, reqs: tuple[Req, ...], reuse: bool) -> Case:
    """Two requests that start together and end together (no reuse to wait for)."""
    new = 5
    return Case(
        name=name,
        source=CAPACITY + name,
        policy=policy,
        max_batch_size=2,
        num_blocks=num_blocks,
        enable_block_reuse=reuse,
        requests=reqs,
        spans=(
            Span(
                0, new, scheduled=(0, 1), active=(0, 1), before={0: Before(new, 20, 0), 1: Before(new, 20, 0)}
            ),
        ),
        num_iterations=new,
        num_reused_blocks=0,
    )


ALL_POLICIES = ("GUARANTEED_NO_EVICT", "MAX_UTILIZATION", "STATIC_BATCH")

CASES: tuple[Case, ...] = (
    *(simple_should_fit(p) for p in ALL_POLICIES),
    *(simple_should_fit_in_chunk(p) for p in ALL_POLICIES),
    Case(
        name="SimpleDoesntFitMaxUtilization",
        source=CAPACITY + "SimpleDoesntFitMaxUtilization",
        policy="MAX_UTILIZATION",
        max_batch_size=2,
        num_blocks=10,
        requests=two(10, 80),
        spans=(
            # Both fit until iteration 41; then request 1 is paused; it resumes when request 0 is done.
            Span(0, 41, scheduled=(0, 1), active=(0, 1), before={0: Before(80, 10, 0), 1: Before(80, 10, 0)}),
            Span(41, 80, scheduled=(0,), active=(0, 1), before={0: Before(80, 10, 41, 10)}),
            Span(80, 120, scheduled=(1,), active=(1,), before={1: Before(39, 51, 0)}),
        ),
        num_iterations=119,
    ),
    Case(
        name="SimpleDoesntFitMaxUtilizationInChunk",
        source=CAPACITY + "SimpleDoesntFitMaxUtilizationInChunk",
        policy="MAX_UTILIZATION",
        max_batch_size=2,
        num_blocks=10,
        chunking="FIRST_COME_FIRST_SERVED",
        chunk_size=20,
        requests=two(30, 60),
        spans=(
            Span(
                0,
                2,
                scheduled=(0, 1),
                active=(0, 1),
                before={0: Before(60, 30, 0, 0), 1: Before(60, 30, 0, 0)},
            ),
            Span(
                2,
                22,
                scheduled=(0, 1),
                active=(0, 1),
                before={0: Before(60, 30, 1, 30), 1: Before(60, 30, 1, 30)},
            ),
            Span(22, 61, scheduled=(0,), active=(0, 1), before={0: Before(60, 30, 21, 30)}),
            Span(61, 100, scheduled=(1,), active=(1,), before={1: Before(39, 51, 0, 0)}),
        ),
        num_iterations=100,
    ),
    Case(
        name="SimpleDoesntFitMaxUtilizationInChunkedCache",
        source=CAPACITY + "SimpleDoesntFitMaxUtilizationInChunkedCache",
        policy="MAX_UTILIZATION",
        max_batch_size=2,
        num_blocks=10,
        chunking="FIRST_COME_FIRST_SERVED",
        chunk_size=40,
        requests=two(70, 20),
        spans=(
            Span(0, 1, scheduled=(0,), active=(0, 1), before={0: Before(20, 70, 0, 0)}),
            Span(1, 2, scheduled=(0,), active=(0, 1), before={0: Before(20, 70, 0, 40)}),
            Span(2, 21, scheduled=(0,), active=(0, 1), before={0: Before(20, 70, 1, 70)}),
            Span(21, 22, scheduled=(1,), active=(1,), before={1: Before(20, 70, 0, 0)}),
            Span(22, 23, scheduled=(1,), active=(1,), before={1: Before(20, 70, 0, 40)}),
            Span(23, 24, scheduled=(1,), active=(1,), before={1: Before(20, 70, 1, 70)}),
            Span(24, 42, scheduled=(1,), active=(1,), before={1: Before(20, 70, 2, 70)}),
        ),
        num_iterations=42,
    ),
    Case(
        name="SimpleDoesntFitGuaranteedCompletion",
        source=CAPACITY + "SimpleDoesntFitGuaranteedCompletion",
        policy="GUARANTEED_NO_EVICT",
        max_batch_size=2,
        num_blocks=10,
        requests=two(10, 80),
        spans=(
            Span(0, 80, scheduled=(0,), active=(0, 1), before={0: Before(80, 10, 0)}),
            Span(80, 160, scheduled=(1,), active=(1,), before={1: Before(80, 10, 0)}),
        ),
        num_iterations=160,
    ),
    Case(
        name="SimpleDoesntFitGuaranteedCompletionInChunk",
        source=CAPACITY + "SimpleDoesntFitGuaranteedCompletionInChunk",
        policy="GUARANTEED_NO_EVICT",
        max_batch_size=2,
        num_blocks=10,
        chunking="FIRST_COME_FIRST_SERVED",
        chunk_size=20,
        requests=two(30, 60),
        spans=(
            Span(0, 1, scheduled=(0,), active=(0, 1), before={0: Before(60, 30, 0, 0)}),
            Span(1, 2, scheduled=(0,), active=(0, 1), before={0: Before(60, 30, 0, 20)}),
            Span(2, 3, scheduled=(0,), active=(0, 1), before={0: Before(60, 30, 1, 30)}),
            Span(3, 61, scheduled=(0,), active=(0, 1), before={0: Before(60, 30, 2, 30)}),
            Span(61, 62, scheduled=(1,), active=(1,), before={1: Before(60, 30, 0, 0)}),
            Span(62, 63, scheduled=(1,), active=(1,), before={1: Before(60, 30, 0, 20)}),
            Span(63, 64, scheduled=(1,), active=(1,), before={1: Before(60, 30, 1, 30)}),
            Span(64, 122, scheduled=(1,), active=(1,), before={1: Before(60, 30, 2, 30)}),
        ),
        num_iterations=122,
    ),
    Case(
        name="SimpleDoesntFitAddingNewRequestsMaxUtilization",
        source=CAPACITY + "SimpleDoesntFitAddingNewRequestsMaxUtilization",
        policy="MAX_UTILIZATION",
        max_batch_size=4,
        num_blocks=10,
        requests=(Req(0, 10, 80), Req(1, 10, 80), Req(2, 10, 80, arrives=10), Req(3, 10, 80, arrives=10)),
        spans=(
            Span(0, 10, scheduled=(0, 1), active=(0, 1), before={0: Before(80, 10, 0), 1: Before(80, 10, 0)}),
            Span(
                10,
                21,
                scheduled=(0, 1, 2, 3),
                active=(0, 1, 2, 3),
                before={
                    0: Before(80, 10, 10, 10),
                    1: Before(80, 10, 10, 10),
                    2: Before(80, 10, 0),
                    3: Before(80, 10, 0),
                },
            ),
            # Out of blocks: the two latest started are paused.
            Span(
                21,
                41,
                scheduled=(0, 1),
                active=(0, 1, 2, 3),
                before={0: Before(80, 10, 21, 10), 1: Before(80, 10, 21, 10)},
            ),
            Span(41, 80, scheduled=(0,), active=(0, 1, 2, 3), before={0: Before(80, 10, 41, 10)}),
            Span(
                80,
                90,
                scheduled=(1, 2),
                active=(1, 2, 3),
                before={1: Before(39, 51, 0, 0), 2: Before(69, 21, 0)},
            ),
            Span(90, 119, scheduled=(1,), active=(1, 2, 3), before={1: Before(39, 51, 10, 51)}),
            Span(
                119, 139, scheduled=(2, 3), active=(2, 3), before={2: Before(59, 31, 0), 3: Before(69, 21, 0)}
            ),
            Span(139, 177, scheduled=(2,), active=(2, 3), before={2: Before(59, 31, 20, 31)}),
            Span(178, 227, scheduled=(3,), active=(3,), before={3: Before(49, 41, 0)}),
        ),
        num_iterations=227,
    ),
    Case(
        name="SimpleDoesntFitAddingNewRequestsGuaranteedCompletion",
        source=CAPACITY + "SimpleDoesntFitAddingNewRequestsGuaranteedCompletion",
        policy="GUARANTEED_NO_EVICT",
        max_batch_size=4,
        num_blocks=10,
        requests=(Req(0, 10, 80), Req(1, 10, 80), Req(2, 10, 80, arrives=10), Req(3, 10, 80, arrives=10)),
        spans=(
            Span(0, 10, scheduled=(0,), active=(0, 1), before={0: Before(80, 10, 0)}),
            Span(10, 80, scheduled=(0,), active=(0, 1, 2, 3), before={0: Before(80, 10, 10, 10)}),
            Span(80, 160, scheduled=(1,), active=(1, 2, 3), before={1: Before(80, 10, 0)}),
            Span(160, 240, scheduled=(2,), active=(2, 3), before={2: Before(80, 10, 0)}),
            Span(240, 320, scheduled=(3,), active=(3,), before={3: Before(80, 10, 0)}),
        ),
        num_iterations=320,
    ),
    Case(
        name="SimpleDoesntFitAddingNewRequestsGuaranteedCompletionInChunk",
        source=CAPACITY + "SimpleDoesntFitAddingNewRequestsGuaranteedCompletionInChunk",
        policy="GUARANTEED_NO_EVICT",
        max_batch_size=4,
        num_blocks=10,
        chunking="FIRST_COME_FIRST_SERVED",
        chunk_size=20,
        requests=(Req(0, 30, 60), Req(1, 30, 60), Req(2, 30, 60, arrives=10), Req(3, 30, 60, arrives=10)),
        spans=(
            Span(0, 10, scheduled=(0,), active=(0, 1), before={0: Before(60, 30, 0)}),
            Span(10, 61, scheduled=(0,), active=(0, 1, 2, 3), before={0: Before(60, 30, 9, 30)}),
            Span(61, 122, scheduled=(1,), active=(1, 2, 3), before={1: Before(60, 30, 0)}),
            Span(122, 183, scheduled=(2,), active=(2, 3), before={2: Before(60, 30, 0)}),
            Span(183, 244, scheduled=(3,), active=(3,), before={3: Before(60, 30, 0)}),
        ),
        num_iterations=244,
    ),
    *(delay_duplicate_request(p) for p in ("MAX_UTILIZATION", "GUARANTEED_NO_EVICT", "STATIC_BATCH")),
    *(delay_duplicate_request_chunked(p) for p in ("GUARANTEED_NO_EVICT", "MAX_UTILIZATION")),
    *(delay_five_requests_complicated(p) for p in ("MAX_UTILIZATION", "GUARANTEED_NO_EVICT")),
    Case(
        name="SimpleFitsStaticBatch",
        source=CAPACITY + "SimpleFitsStaticBatch",
        policy="STATIC_BATCH",
        max_batch_size=2,
        num_blocks=20,
        requests=(Req(0, 10, 80), Req(1, 10, 40), Req(2, 10, 80)),
        spans=(
            # Two requests run together; the third starts only when both have finished.
            Span(
                0, 40, scheduled=(0, 1), active=(0, 1, 2), before={0: Before(80, 10, 0), 1: Before(40, 10, 0)}
            ),
            Span(41, 79, scheduled=(0,), active=(0, 2), before={0: Before(80, 10, 41, 10)}),
            Span(80, 160, scheduled=(2,), active=(2,), before={2: Before(80, 10, 0)}),
        ),
        num_iterations=160,
    ),
    staggered_pair(
        "ReuseAwareSchedulingAllowsMoreRequestsWithSharedPrefix",
        "GUARANTEED_NO_EVICT",
        10,
        4,
        20,
        reuses_blocks=True,
    ),
    Case(
        name="ReuseAwareSchedulingWithPartialPrefixMatch",
        source=CAPACITY + "ReuseAwareSchedulingWithPartialPrefixMatch",
        policy="GUARANTEED_NO_EVICT",
        max_batch_size=3,
        num_blocks=20,
        enable_block_reuse=True,
        # The first two blocks match, the third differs.
        requests=(Req(0, iota(30), 5), Req(1, iota(20) + fill(10, 999), 5)),
        spans=(
            Span(0, 1, scheduled=(0,), active=(0, 1), before={0: Before(5, 30, 0)}),
            Span(
                1, 5, scheduled=(0, 1), active=(0, 1), before={0: Before(5, 30, 1, 30), 1: Before(5, 30, 0)}
            ),
            Span(5, 6, scheduled=(1,), active=(1,), before={1: Before(5, 30, 4, 30)}),
        ),
        num_iterations=6,
        num_reused_blocks=2,
    ),
    together_pair(
        "NoReuseWithDifferentPrompts",
        "GUARANTEED_NO_EVICT",
        20,
        (Req(0, fill(20, 100), 5), Req(1, fill(20, 200), 5)),
        reuse=True,
    ),
    staggered_pair(
        "ReuseAwareSchedulingMaxUtilizationPolicy", "MAX_UTILIZATION", 10, 4, 20, reuses_blocks=True
    ),
    staggered_pair(
        "MaxUtilizationReuseReducesNeededBlocksOneStep", "MAX_UTILIZATION", 6, 3, 30, num_reused_blocks=2
    ),
    staggered_pair(
        "MaxUtilizationUnderMemoryPressureWithReuse", "MAX_UTILIZATION", 5, 2, 20, reuses_blocks=True
    ),
    staggered_pair(
        "MaxUtilizationMultipleRequestsIncrementalReuse", "MAX_UTILIZATION", 15, 4, 20, reuses_blocks=True
    ),
    together_pair(
        "MaxUtilizationNoReuseWhenDisabled",
        "MAX_UTILIZATION",
        10,
        (Req(0, iota(20), 5), Req(1, iota(20), 5)),
        reuse=False,
    ),
)
