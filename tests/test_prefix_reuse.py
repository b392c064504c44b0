"""Block reuse through the whole engine: outputs never change, prefill work shrinks, counters add up."""

from __future__ import annotations

import json

import pytest
import torch

from bm.batch_manager import InferenceRequest
from tests.conftest import hf_greedy, make_config, random_prompts
from tests.engine_wait import generate_or_fail
from tests.test_schemes import SMALL_CACHE, engine_config, run

REUSE = {"enable_block_reuse": True}


def shared_prefix_specs(vocab: int, groups: int = 3, per_group: int = 5, prefix_len: int = 37):
    """Groups of requests sharing a long system prompt, each with its own suffix; in every group one
    request is the bare prompt (wholly cached once its group has run) and one repeats another's prompt."""
    g = torch.Generator().manual_seed(11)
    specs = []
    for _ in range(groups):
        prefix = torch.randint(3, vocab, (prefix_len,), generator=g).tolist()
        members = []
        for j in range(per_group):
            suffix = torch.randint(3, vocab, (int(torch.randint(1, 14, (1,), generator=g)),), generator=g)
            members.append(
                (prefix + suffix.tolist() if j else prefix, int(torch.randint(1, 16, (1,), generator=g)))
            )
        members.append((members[1][0], 9))
        specs.extend(members)
    return specs


@pytest.fixture(scope="module")
def shared_workload(tiny_model, tiny_reference):
    specs = shared_prefix_specs(tiny_model.vocab_size)
    return specs, [hf_greedy(tiny_reference, p, m) for p, m in specs]


def context_tokens(stats) -> int:
    return sum(s["Total Context Tokens"] for s in stats)


CASES = [
    ("inflight_fused", "guaranteed_no_evict", None, {}),
    ("inflight_fused", "max_utilization", None, SMALL_CACHE),  # pauses; resumes may hit their own blocks
    ("inflight_fused", "guaranteed_no_evict", "first_come_first_served", {}),
    ("inflight_fused", "max_utilization", "equal_progress", SMALL_CACHE),
    ("inflight", "static_batch", None, {}),
]


@pytest.mark.parametrize(("scheme", "policy", "chunking", "cache"), CASES)
def test_outputs_are_identical_with_reuse_on_and_off(
    tiny_model, shared_workload, scheme, policy, chunking, cache
):
    specs, expected = shared_workload
    engine = engine_config(scheme, policy, chunking)
    off, off_stats = run(tiny_model, make_config(engine=engine, kv_cache=cache), specs)
    on, on_stats = run(tiny_model, make_config(engine=engine, kv_cache={**cache, **REUSE}), specs)
    for i in range(len(specs)):
        assert on[i].error == "" and off[i].error == ""
        assert on[i].output_ids == off[i].output_ids == expected[i], f"request {i}"
    reused = sum(r.num_reused_blocks for r in on.values())
    assert reused == sum(s["Reused Blocks"] for s in on_stats) > 0
    assert sum(r.num_missed_blocks for r in on.values()) == sum(s["Missed Blocks"] for s in on_stats)
    assert sum(s["Reused Blocks"] for s in off_stats) == 0
    tokens_per_block = (cache or {}).get("tokens_per_block", 8)
    # every reused block is a block of context not computed again (pauses recompute more on both sides)
    if policy == "max_utilization":
        assert sum(r.num_pauses for r in on.values()) > 0, "the small cache must force pauses"
    else:
        assert context_tokens(on_stats) == context_tokens(off_stats) - reused * tokens_per_block


def test_oracle_workload_is_unchanged_by_reuse(tiny_model, tiny_reference):
    specs = random_prompts(seed=1, count=10, vocab=tiny_model.vocab_size, max_prompt=48, max_output=24)
    specs += specs[:4]  # a few repeated prompts, as a retried request would be
    config = make_config(engine={"max_batch_size": 8, "max_num_tokens": 96}, kv_cache=REUSE)
    results, stats = run(tiny_model, config, specs)
    for i, (prompt, max_new) in enumerate(specs):
        assert results[i].output_ids == hf_greedy(tiny_reference, prompt, max_new), f"request {i}"
    assert sum(s["Reused Blocks"] for s in stats) > 0


def test_a_wholly_cached_prompt_computes_only_its_last_block(tiny_model, tiny_reference):
    prompt = list(range(3, 43))  # 40 tokens: 5 blocks of 8
    stats: list[str] = []
    results = generate_or_fail(
        [InferenceRequest.from_values(i, prompt, 4) for i in range(3)],
        make_config(engine={"max_batch_size": 1}, kv_cache=REUSE),  # one after the other
        model=tiny_model,
        return_stats=stats.append,
    )
    expected = hf_greedy(tiny_reference, prompt, 4)
    assert all(results[i].output_ids == expected for i in range(3))
    # the first computes all 5 blocks; the others take 4 and recompute the last (its logits are sampled)
    assert [results[i].num_reused_blocks for i in range(3)] == [0, 4, 4]
    assert [results[i].num_missed_blocks for i in range(3)] == [5, 1, 1]
    assert results[1].cache_hit_rate == pytest.approx(0.8)
    assert sum(json.loads(s)["Total Context Tokens"] for s in stats) == 40 + 8 + 8


def test_v1_does_not_reuse_blocks(tiny_model, shared_workload):
    specs, expected = shared_workload
    config = make_config(engine=engine_config("v1", "guaranteed_no_evict", None), kv_cache=REUSE)
    results, stats = run(tiny_model, config, specs)
    assert [results[i].output_ids for i in range(len(specs))] == expected
    assert sum(s["Reused Blocks"] + s["Missed Blocks"] for s in stats) == 0
    assert all(s["Reusable KV cache blocks"] == 0 for s in stats)


def test_iteration_stats_report_hit_rate(tiny_model, shared_workload):
    specs, _ = shared_workload
    _, stats = run(tiny_model, make_config(kv_cache=REUSE), specs)
    looked_up = [s for s in stats if s["Reused Blocks"] + s["Missed Blocks"]]
    assert looked_up
    for s in looked_up:
        assert s["Cache Hit Rate"] == pytest.approx(
            s["Reused Blocks"] / (s["Reused Blocks"] + s["Missed Blocks"]), abs=1e-6
        )
    assert max(s["Cache Hit Rate"] for s in stats) > 0.5


@pytest.mark.parametrize("window", [None, 24])
def test_beam_requests_beside_reuse_and_windows_keep_every_output(tiny_model, shared_workload, window):
    """Beams fork their block tables, so they neither take nor register cached blocks and keep their
    blocks to completion; the greedy requests around them still reuse, and nothing changes outputs."""
    specs, expected = shared_workload
    specs, expected = specs[:8], expected[:8]
    beam_prompts = [specs[1][0], specs[2][0]]  # share the first group's prefix

    def requests():
        out = [InferenceRequest.from_values(i, p, m) for i, (p, m) in enumerate(specs)]
        out += [InferenceRequest.from_values(100 + j, p, 6, beam_width=2) for j, p in enumerate(beam_prompts)]
        return out

    window_cfg = {} if window is None else {"max_attention_window": window}
    results = {}
    for reuse in (False, True):
        config = make_config(
            engine={"max_beam_width": 2, "max_batch_size": 4},
            kv_cache={**window_cfg, "enable_block_reuse": reuse},
        )
        results[reuse] = generate_or_fail(requests(), config, model=tiny_model, check_integrity=True)
    off, on = results[False], results[True]
    for rid in off:
        assert off[rid].error == on[rid].error == ""
        assert off[rid].output_ids == on[rid].output_ids, f"request {rid}"
        assert off[rid].beams == on[rid].beams
    for j in range(len(beam_prompts)):
        assert on[100 + j].num_reused_blocks == on[100 + j].num_missed_blocks == 0
    assert sum(on[i].num_reused_blocks for i in range(len(specs))) > 0
    if window is None:
        for i in range(len(specs)):
            assert on[i].output_ids == expected[i]
