"""TensorRT-LLM's ``microBatchSchedulerTest.cpp``, as data.

The micro-batch tests run no KV cache manager, so the cache here never binds. ``maxBatchSize`` is
``max_batch_size``, ``maxNumTokens`` is ``max_num_tokens`` (``std::nullopt``: none), TRT-LLM's
``chunkUnitSize`` is ``tokens_per_block`` (bm chunks on block boundaries) and ``maxContextLength`` is
``context_chunk_size``. ``After(ctx_pos, num_gen)`` is checked after each iteration, as the TRT-LLM tests
check after ``forward``.

``ContextChunkingTest`` calls ``setCtxRequestsChunkSize`` directly on requests with one new token each,
so its positions are exactly the cumulative context chunks of requests that end when their context does;
those cases run through the engine loop with ``max_new_tokens: 1`` and check every request's position
after each iteration.
"""

from __future__ import annotations

from tests.conformance.harness import After, Case, Req, Span, iota

MICRO = "microBatchSchedulerTest.cpp::MicroBatchSchedulerTest."
COMBINED = "microBatchSchedulerTest.cpp::CombinedSchedulerTest."
CHUNKING = "microBatchSchedulerTest.cpp::ContextChunkingTest."


def context_chunking(
    name: str,
    policy: str,
    lengths: tuple[int, ...],
    unit: int,
    positions: tuple[tuple[int, ...], ...],
    capacity: int | None = None,
    max_context_length: int | None = None,
    note: str = "",
) -> Case:
    done = positions[-1] == lengths
    return Case(
        name=f"{name}[{policy}]",
        source=CHUNKING + name,
        policy="GUARANTEED_NO_EVICT",
        max_batch_size=8,
        max_num_tokens=capacity,
        tokens_per_block=unit,
        chunking=policy,
        chunk_size=max_context_length,
        requests=tuple(Req(i, n, 1) for i, n in enumerate(lengths)),
        spans=tuple(
            Span(t, t + 1, after={i: After(ctx_pos=p) for i, p in enumerate(row)})
            for t, row in enumerate(positions)
        ),
        num_iterations=len(positions) if done else None,
        run_iterations=None if done else len(positions),
        note=note,
    )


def both_policies(name: str, lengths, unit, positions_ep, positions_fcfs=None, **kw) -> tuple[Case, ...]:
    return (
        context_chunking(name, "EQUAL_PROGRESS", lengths, unit, positions_ep, **kw),
        context_chunking(
            name, "FIRST_COME_FIRST_SERVED", lengths, unit, positions_fcfs or positions_ep, **kw
        ),
    )


CASES: tuple[Case, ...] = (
    Case(
        name="SimpleNoOverlap",
        source=MICRO + "SimpleNoOverlap",
        max_batch_size=2,
        requests=tuple(Req(i, 10, 80) for i in range(4)),
        spans=(
            Span(0, 80, scheduled=(0, 1), after={0: After(num_gen=1), 1: After(num_gen=1)}),
            Span(80, 160, scheduled=(2, 3), after={2: After(num_gen=1), 3: After(num_gen=1)}),
        ),
        num_iterations=160,  # nothing is scheduled from iteration 160 on
    ),
    Case(
        name="SimpleNoOverlapMaxNumTokens",
        source=MICRO + "SimpleNoOverlapMaxNumTokens",
        max_batch_size=2,
        max_num_tokens=7,
        tokens_per_block=5,
        chunking="EQUAL_PROGRESS",
        requests=(Req(0, 12, 5), Req(1, 12, 5)),
        spans=(
            Span(0, 1, scheduled=(0,), after={0: After(5, 0)}),
            # The last chunk may be longer than the unit when it fits the token budget.
            Span(1, 2, scheduled=(0,), after={0: After(12, 1)}),
            Span(2, 3, scheduled=(0, 1), after={0: After(12, 2), 1: After(ctx_pos=5)}),
            # Request 1's last chunk would not fit beside request 0's token: chunked again.
            Span(3, 4, scheduled=(0, 1), after={0: After(num_gen=3), 1: After(ctx_pos=10)}),
            Span(4, 6, scheduled=(0, 1), after={0: After(num_gen=4), 1: After(12, 1)}),
            Span(6, 9, scheduled=(1,), after={1: After(num_gen=3)}),
        ),
        num_iterations=9,
    ),
    Case(
        name="SimpleNoOverlapMaxContextLength",
        source=MICRO + "SimpleNoOverlapMaxContextLength",
        max_batch_size=2,
        tokens_per_block=5,
        chunking="EQUAL_PROGRESS",
        chunk_size=12,
        requests=(Req(0, 10, 5), Req(1, 10, 5), Req(2, 10, 5), Req(3, 17, 5)),
        spans=(
            Span(0, 1, scheduled=(0, 1), after={0: After(10, 1), 1: After(10, 1)}),
            Span(1, 5, scheduled=(0, 1), after={0: After(num_gen=2), 1: After(num_gen=2)}),
            # maxContextLength 12: request 3's 17 tokens go in chunks, ending on a unit boundary.
            Span(5, 6, scheduled=(2, 3), after={2: After(10, 1), 3: After(10, 0)}),
            Span(6, 7, scheduled=(2, 3), after={2: After(10, 2), 3: After(17, 1)}),
            Span(7, 10, scheduled=(2, 3), after={2: After(num_gen=3), 3: After(num_gen=2)}),
            Span(10, 11, scheduled=(3,), after={3: After(num_gen=5)}),
        ),
        num_iterations=11,
    ),
    Case(
        name="SimpleMaxNumTokensBW1",
        source=MICRO + "SimpleMaxNumTokensBW1",
        max_batch_size=4,
        max_num_tokens=12,
        requests=tuple(Req(i, 10, 10) for i in range(4)),
        spans=(
            Span(0, 1, scheduled=(0,)),
            Span(1, 2, scheduled=(0, 1)),
            Span(2, 3, scheduled=(0, 1, 2)),
            # 12 tokens: one context and two generations, or three generations; never a context and three.
            Span(3, 10, scheduled=(0, 1, 2)),
            Span(10, 11, scheduled=(1, 2, 3)),
            Span(11, 12, scheduled=(2, 3)),
        ),
        num_iterations=20,
    ),
    Case(
        name="SimpleMaxNumTokensBW4",
        source=MICRO + "SimpleMaxNumTokensBW4",
        max_batch_size=4,
        max_num_tokens=15,
        max_beam_width=4,
        requests=tuple(Req(i, 10, 10, beam_width=4) for i in range(4)),
        spans=(
            Span(0, 1, scheduled=(0,)),
            Span(1, 2, scheduled=(0, 1)),
            # Each generation with 4 beams counts 4 tokens: a third request would exceed 15.
            Span(2, 10, scheduled=(0, 1)),
            Span(10, 11, scheduled=(1, 2)),
            Span(11, 20, scheduled=(2, 3)),
            Span(20, 21, scheduled=(3,)),
        ),
        num_iterations=21,
    ),
    Case(
        name="BeamWidthMismatchSkipped",
        source=MICRO + "BeamWidthMismatchSkipped",
        max_batch_size=4,
        max_beam_width=4,
        requests=(Req(0, 2, 5), Req(1, 2, 5, beam_width=4), Req(2, 2, 5)),
        spans=(Span(1, 2, generation=(0, 2), context=()),),
        run_iterations=2,
        note="TRT-LLM advances the three requests to generation by hand; here iteration 0 runs their "
        "contexts, and iteration 1 is the call the test checks.",
    ),
    Case(
        name="ChunkSizeZeroNotScheduled",
        source=MICRO + "ChunkSizeZeroNotScheduled",
        max_batch_size=4,
        max_num_tokens=5,
        tokens_per_block=5,
        chunking="EQUAL_PROGRESS",
        requests=(Req(0, 20, 5), Req(1, 20, 5)),
        spans=(
            Span(0, 1, num_context=1),
        ),  # and every scheduled context has a positive chunk (always checked)
        run_iterations=1,
    ),
    Case(
        name="ReusableTokensZeroHasNoEffect",
        source=MICRO + "ReusableTokensZeroHasNoEffect",
        max_batch_size=4,
        max_num_tokens=12,
        requests=(Req(0, 10, 10), Req(1, 10, 10)),
        spans=(Span(0, 1, num_context=1, num_generation=0),),
        run_iterations=1,
    ),
    Case(
        name="NoReuseMicroBatchUnchanged",
        source=COMBINED + "NoReuseMicroBatchUnchanged",
        policy="MAX_UTILIZATION",
        max_batch_size=4,
        max_num_tokens=25,
        num_blocks=10,
        requests=(Req(0, iota(20), 5), Req(1, iota(20), 5)),
        spans=(Span(0, 1, num_context=1, num_generation=0),),
        run_iterations=1,
        note="The capacity stage's own output (both fit) and estimatedReusableTokens are not observable "
        "through the loop; the micro-batch result is.",
    ),
    *both_policies("NoLimit", (25, 25), 20, ((25, 25),)),
    *both_policies("ContextLengthNeverSatisfied", (25, 25), 100, ((0, 0),), max_context_length=20),
    *both_policies("ChunkLongerThanContext", (25, 25), 30, ((25, 25),), max_context_length=25),
    *both_policies("ContextLengthSatisfied", (10, 25), 10, ((10, 20), (10, 25)), max_context_length=20),
    *both_policies(
        "TokenCapacitySmallerThanContext", (25, 25), 20, ((20, 0), (25, 0), (25, 20), (25, 25)), capacity=20
    ),
    *both_policies("TokenCapacitySmallerThanChunkUnit", (25, 25), 20, ((0, 0),), capacity=10),
    *both_policies("SchedulingOrder", (25, 25), 5, ((15, 15), (25, 25)), ((25, 5), (25, 25)), capacity=30),
    *both_policies("CompletionOrder", (25, 15), 5, ((15, 15), (25, 15)), ((25, 5), (25, 15)), capacity=30),
    *both_policies(
        "LongFirstShortLater", (25, 15), 5, ((10, 10), (20, 15), (25, 15)), capacity=30, max_context_length=10
    ),
    *both_policies(
        "FrontPriority",
        (25, 25),
        5,
        ((10, 5), (20, 10), (25, 20), (25, 25)),
        ((15, 0), (25, 5), (25, 20), (25, 25)),
        capacity=15,
    ),
)
