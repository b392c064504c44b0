"""Scheduler defects found by porting TensorRT-LLM's tests, each pinned in the shape a user meets it.

The conformance cases pin the exact TRT-LLM schedules; these pin the user-visible symptom (a budget
overrun, a crash, a thrash, a prefix computed many times), through the real engine loop over the fake
executor.
"""

from __future__ import annotations

from tests.conformance.harness import Iteration, Run, context_completions, core_request, new_core


def drain(core, max_iterations: int = 1000) -> list:
    outputs = []
    while core.num_active and len(outputs) < max_iterations:
        outputs.append(core.step())
    assert core.num_active == 0, f"requests still active after {max_iterations} iterations"
    return outputs


def record(out) -> Iteration:
    s = out.schedule
    return Iteration(
        list(s.context_ids),
        dict(s.context_chunks),
        list(s.generation_ids),
        list(s.paused_ids),
        list(out.finished_ids),
        [],
    )


def test_beam_generation_counts_every_beam_against_max_num_tokens() -> None:
    """The issue's repro: 4 requests of 10 + 10 tokens with 4 beams under a 15-token budget."""
    core = new_core(
        {
            "engine": {"max_batch_size": 4, "max_num_tokens": 15, "max_beam_width": 4},
            "kv_cache": {"tokens_per_block": 10, "max_tokens": 4000},
        }
    )
    for rid in range(4):
        assert core.add_request(core_request(rid, [1] * 10, 10, beam_width=4)) is None
    for t, out in enumerate(drain(core)):
        s = out.schedule
        computed = sum(s.context_chunks.values()) + 4 * len(s.generation_ids)
        assert computed <= 15, f"iteration {t} computes {computed} tokens (beams count one each)"


def test_equal_progress_with_a_chunk_cap_completes_on_block_boundaries() -> None:
    """The issue's repro: a chunk cap that is not a block multiple used to crash the batch manager."""
    core = new_core(
        {
            "engine": {
                "scheduler_policy": "max_utilization",
                "enable_chunked_context": True,
                "context_chunking_policy": "equal_progress",
                "context_chunk_size": 12,
            },
            "kv_cache": {"tokens_per_block": 5, "max_tokens": 30},
        }
    )
    assert core.add_request(core_request(0, list(range(15)), 15)) is None
    assert core.add_request(core_request(1, list(range(100, 117)), 1)) is None
    outputs = drain(core)
    run = Run([record(out) for out in outputs], completed=True, num_reused_blocks=None)
    for t, (it, ended) in enumerate(zip(run.iterations, context_completions(run), strict=True)):
        for rid, chunk in it.context_chunks.items():
            assert chunk <= 12
            assert rid in ended or chunk % 5 == 0, (
                f"iteration {t}: request {rid}'s chunk {chunk} ends mid-block"
            )


def test_max_utilization_with_chunked_context_does_not_thrash() -> None:
    """TRT-LLM's SimpleDoesntFitMaxUtilizationInChunk shape: request 1 is paused once and then waits
    for blocks, rather than being restarted and evicted again every iteration."""
    core = new_core(
        {
            "engine": {
                "scheduler_policy": "max_utilization",
                "max_batch_size": 2,
                "enable_chunked_context": True,
                "context_chunk_size": 20,
            },
            "kv_cache": {"tokens_per_block": 10, "max_tokens": 100},
        }
    )
    for rid in range(2):
        assert core.add_request(core_request(rid, [1] * 30, 60)) is None
    outputs = drain(core)
    pauses = [rid for out in outputs for rid in out.schedule.paused_ids]
    assert pauses == [1], f"paused: {pauses}"
    recomputed = sum(out.schedule.context_chunks.get(1, 0) for out in outputs)
    assert recomputed == 30 + 51  # its prompt once, then prompt + 21 generated tokens once


def test_requests_sharing_a_prefix_compute_it_once_with_block_reuse() -> None:
    """An offline batch (everything at t=0) with one system prompt: later requests wait for the first
    to compute the shared blocks and then reuse them, instead of all computing the prefix at once."""
    prefix = list(range(1, 65))  # 4 blocks of 16
    core = new_core(
        {
            "engine": {"max_batch_size": 16, "max_num_tokens": 2048},
            "kv_cache": {"tokens_per_block": 16, "max_tokens": 16 * 256, "enable_block_reuse": True},
        }
    )
    suffixes = [[500 + rid, 600 + rid, 700 + rid] for rid in range(16)]
    for rid, suffix in enumerate(suffixes):
        assert core.add_request(core_request(rid, prefix + suffix, 4)) is None
    outputs = drain(core)
    prefill = sum(sum(out.schedule.context_chunks.values()) for out in outputs)
    ideal = len(prefix) + sum(len(s) for s in suffixes)
    assert prefill <= 1.2 * ideal, f"computed {prefill} context tokens, one prefix + suffixes is {ideal}"
