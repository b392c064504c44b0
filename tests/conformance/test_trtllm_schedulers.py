"""bm's engine loop schedules TensorRT-LLM's own scheduler test cases as TensorRT-LLM expects.

Each case is one test (and policy) of ``capacitySchedulerTest.cpp`` or ``microBatchSchedulerTest.cpp`` in
NVIDIA/TensorRT-LLM, written as data; it runs through ``EngineCore`` over the fake executor, so no model
and no torch are involved. A case that bm deliberately does differently is an ``xfail(strict=True)`` with
its reason (README.md in this folder says more); a case for a feature bm lacks is in ``NOT_PORTED``.
"""

from __future__ import annotations

import pytest

from tests.conformance import cases_capacity, cases_micro_batch
from tests.conformance.harness import Case, check_case, run_case
from tests.conformance.not_ported import NOT_PORTED, TRTLLM_TESTS

CASES: tuple[Case, ...] = cases_capacity.CASES + cases_micro_batch.CASES

CONFIG_RULE = (
    "deliberate: bm rejects context_chunk_size or max_num_tokens below one block (tokens_per_block, bm's "
    "chunk unit) at config time, naming the knob, instead of accepting a budget under which a long "
    "context could never advance"
)
MOCK_REUSE = (
    "TRT-LLM's mock completes each scheduled context and stores its blocks before adding the next "
    "request's sequence, so requests started in the same iteration reuse each other's blocks; in a real "
    "forward they are computed together and cannot, so bm reuses none (the schedule itself matches)"
)
RESUMED_CHUNKS = (
    "TRT-LLM's test sets the chunk size on the request and LlmRequest::pause resets it to the whole "
    "prompt, so the resumed 51-token context runs in one iteration (the test notes the real micro-batch "
    "scheduler would chunk it); bm's context_chunk_size caps every context, so it takes three (102 "
    "iterations instead of 100). Iterations 0-60, the pause and the wait match"
)
MIXED_BEAMS = (
    "deliberate: TRT-LLM's decoder runs one beam width per step, so a generation request whose beam width "
    "differs from the first is skipped; bm's runtime batches any beam widths in one step, so it runs all "
    "three (the skipped request would otherwise wait for the others to finish)"
)

DIFFERENCES: dict[str, str] = {
    "ContextLengthNeverSatisfied-EQUAL_PROGRESS": CONFIG_RULE,
    "ContextLengthNeverSatisfied-FIRST_COME_FIRST_SERVED": CONFIG_RULE,
    "ChunkLongerThanContext-EQUAL_PROGRESS": CONFIG_RULE,
    "ChunkLongerThanContext-FIRST_COME_FIRST_SERVED": CONFIG_RULE,
    "TokenCapacitySmallerThanChunkUnit-EQUAL_PROGRESS": CONFIG_RULE,
    "TokenCapacitySmallerThanChunkUnit-FIRST_COME_FIRST_SERVED": CONFIG_RULE,
    "DelayDuplicateRequest-STATIC_BATCH": MOCK_REUSE,
    "SimpleDoesntFitMaxUtilizationInChunk": RESUMED_CHUNKS,
    "BeamWidthMismatchSkipped": MIXED_BEAMS,
}

# bm defects these cases expose and that are not fixed yet (case id -> what is wrong).
DEFECTS: dict[str, str] = {}


def case_id(case: Case) -> str:
    return case.name.replace("[", "-").rstrip("]")


def params() -> list:
    out = []
    for case in CASES:
        cid = case_id(case)
        reason = DIFFERENCES.get(cid) or DEFECTS.get(cid)
        marks = [pytest.mark.xfail(strict=True, reason=reason)] if reason else []
        out.append(pytest.param(case, id=cid, marks=marks))
    return out


@pytest.mark.parametrize("case", params())
def test_engine_schedules_trtllm_case_as_trtllm_expects(case: Case) -> None:
    run = run_case(case)
    errors = check_case(case, run)
    assert not errors, f"{case.source}: {len(errors)} differences\n" + "\n".join(errors[:25])


def test_every_trtllm_scheduler_test_is_ported_or_listed_as_not_ported() -> None:
    ported = {case.source.split("::")[1] for case in CASES}
    assert not ported & set(NOT_PORTED), "a test is both ported and listed as not ported"
    assert ported | set(NOT_PORTED) == set(TRTLLM_TESTS), (
        f"unaccounted: {sorted(set(TRTLLM_TESTS) - ported - set(NOT_PORTED))}; "
        f"unknown: {sorted((ported | set(NOT_PORTED)) - set(TRTLLM_TESTS))}"
    )


def test_cases_are_many_and_named_uniquely() -> None:
    ids = [case_id(c) for c in CASES]
    assert len(ids) == len(set(ids))
    assert len(ids) >= 50
    assert set(DIFFERENCES) | set(DEFECTS) <= set(ids), "an xfail names no case"
