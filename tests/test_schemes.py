"""Batching schemes x capacity policies x context chunking: outputs never change, counters add up."""

from __future__ import annotations

import itertools
import json

import pytest

from bm.batch_manager import BatchManager, InferenceRequest
from bm.config import ConfigError
from tests.clients import StaggeredClient
from tests.conftest import hf_greedy, make_config, random_prompts
from tests.engine_wait import generate_or_fail

SCHEMES = ["inflight_fused", "inflight", "v1"]
POLICIES = ["guaranteed_no_evict", "max_utilization", "static_batch"]
CHUNKING = [None, "first_come_first_served", "equal_progress"]
# A cache of 40 blocks of 4 tokens for 16 concurrent requests of up to 90 tokens: tight on purpose.
SMALL_CACHE = {"tokens_per_block": 4, "max_tokens": 160}


def engine_config(scheme, policy, chunking, **extra):
    engine = {
        "batching_scheme": scheme,
        "scheduler_policy": policy,
        "max_batch_size": 8,
        "max_num_tokens": 64,
    }
    if chunking:
        engine.update(enable_chunked_context=True, context_chunking_policy=chunking)
    engine.update(extra)
    return engine


@pytest.fixture(scope="module")
def workload(tiny_model, tiny_reference):
    specs = random_prompts(seed=5, count=16, vocab=tiny_model.vocab_size, max_prompt=60, max_output=30)
    return specs, [hf_greedy(tiny_reference, p, m) for p, m in specs]


def run(model, config, specs, per_iteration=3):
    requests = [InferenceRequest.from_values(i, p, m) for i, (p, m) in enumerate(specs)]
    client = StaggeredClient(requests, per_iteration=per_iteration)
    stats: list[str] = []
    with BatchManager(
        config,
        client.get_requests,
        client.send_response,
        return_stats=stats.append,
        model=model,
        check_integrity=True,
    ):
        client.wait_or_fail()
    return client.results, [json.loads(s) for s in stats]


@pytest.mark.parametrize(
    ("scheme", "policy", "chunking"), list(itertools.product(SCHEMES, POLICIES, CHUNKING))
)
def test_every_scheme_policy_and_chunking_matches_hf_generate(tiny_model, workload, scheme, policy, chunking):
    specs, expected = workload
    config = make_config(engine=engine_config(scheme, policy, chunking), kv_cache=SMALL_CACHE)
    results, stats = run(tiny_model, config, specs)
    for i in range(len(specs)):
        assert results[i].error == ""
        assert results[i].output_ids == expected[i], f"request {i}"
    paused = sum(r.num_pauses for r in results.values())
    assert paused == sum(s["Paused Requests"] for s in stats)
    if policy == "max_utilization" and scheme != "v1":
        assert paused > 0, "the small cache must force MAX_UTILIZATION to pause"
    else:
        assert paused == 0  # no-evict policies and V1 (padded batch reserved up front) never pause
    if chunking:
        assert max(s["Total Context Tokens"] + s["Total Generation Tokens"] for s in stats) <= 64


@pytest.mark.parametrize(("scheme", "policy"), list(itertools.product(SCHEMES, POLICIES)))
def test_a_request_larger_than_the_cache_fails_alone_and_the_rest_complete(tiny_model, scheme, policy):
    config = make_config(
        engine=engine_config(scheme, policy, None), kv_cache={"tokens_per_block": 4, "max_tokens": 64}
    )
    requests = [InferenceRequest.from_values(i, [5 + i] * 10, 8) for i in range(6)]
    requests.insert(3, InferenceRequest.from_values(99, [7] * 40, 30))  # 70 tokens > 64 in the whole cache
    results = generate_or_fail(requests, config, model=tiny_model, check_integrity=True)
    assert "KV cache blocks" in results[99].error
    assert all(results[i].error == "" and len(results[i].output_ids) == 8 for i in range(6))


def hand_workload():
    # prompts of 2, 4, 3 tokens; outputs of 1, 3, 2 tokens
    return [
        InferenceRequest.from_values(i, [10 + i] * p, o) for i, (p, o) in enumerate([(2, 1), (4, 3), (3, 2)])
    ]


def counters(model, scheme, max_batch_size):
    stats: list[str] = []
    config = make_config(engine={"batching_scheme": scheme, "max_batch_size": max_batch_size})
    generate_or_fail(hand_workload(), config, model=model, return_stats=stats.append)
    records = [json.loads(s) for s in stats]
    return {
        k: sum(r[k] for r in records)
        for k in ("Empty Generation Slots", "Computed Tokens", "Total Generation Tokens")
    }


def test_v1_executes_padding_and_empty_slots_as_counted_by_hand(tiny_model):
    # One batch of three: longest prompt 4, longest output 3.
    # Context: 9 real + (2 + 0 + 1) pad tokens = 12. Two lockstep generation steps of 3 slots each:
    # request 0 (1 token) is empty twice, request 2 (2 tokens) once -> 3 empty slots, 3 real tokens.
    assert counters(tiny_model, "v1", 3) == {
        "Empty Generation Slots": 3,
        "Computed Tokens": 18,
        "Total Generation Tokens": 3,
    }
    # Batches {0, 1} then {2}: 6 real + 2 pad, two steps of 2 slots (request 0 empty twice), then 3 + 1.
    assert counters(tiny_model, "v1", 2) == {
        "Empty Generation Slots": 2,
        "Computed Tokens": 16,
        "Total Generation Tokens": 3,
    }


@pytest.mark.parametrize("scheme", ["inflight_fused", "inflight"])
def test_in_flight_batching_computes_strictly_fewer_token_slots_than_v1(tiny_model, scheme):
    inflight = counters(tiny_model, scheme, 3)
    assert inflight == {"Empty Generation Slots": 0, "Computed Tokens": 12, "Total Generation Tokens": 3}
    assert inflight["Computed Tokens"] < counters(tiny_model, "v1", 3)["Computed Tokens"]


def test_inflight_runs_context_and_generation_as_separate_forwards(tiny_model):
    stats: list[str] = []
    specs = [([5] * 6, 4), ([6] * 5, 4)]
    client = StaggeredClient([InferenceRequest.from_values(i, p, m) for i, (p, m) in enumerate(specs)], 1)
    config = make_config(engine={"batching_scheme": "inflight"})
    with BatchManager(
        config, client.get_requests, client.send_response, return_stats=stats.append, model=tiny_model
    ):
        client.wait_or_fail()
    mixed = [json.loads(s) for s in stats if '"Context Requests": 1' in s and '"Generation Requests": 1' in s]
    assert mixed and all(r["Forwards"] == 2 for r in mixed)


@pytest.mark.parametrize(
    "engine",
    [
        {"capacity_scheduler": "examples.custom_scheduler:ShortestPromptFirstScheduler"},
        {"micro_batch_scheduler": "tests.test_schemes:OneContextPerIteration"},
        {"scheduler": "tests.test_schemes:FifoOneAtATime"},
    ],
)
def test_custom_schedulers_named_in_the_config_run_and_keep_outputs(tiny_model, tiny_reference, engine):
    specs = random_prompts(seed=8, count=6, vocab=tiny_model.vocab_size, max_prompt=20, max_output=8)
    requests = [InferenceRequest.from_values(i, p, m) for i, (p, m) in enumerate(specs)]
    results = generate_or_fail(requests, make_config(engine=engine), model=tiny_model, check_integrity=True)
    for i, (p, m) in enumerate(specs):
        assert results[i].output_ids == hf_greedy(tiny_reference, p, m)


def test_a_bad_custom_scheduler_path_names_the_key(tiny_model):
    with pytest.raises(ConfigError, match=r"engine\.capacity_scheduler: cannot import 'nowhere\.mod:X'"):
        BatchManager(
            make_config(engine={"capacity_scheduler": "nowhere.mod:X"}), list, print, model=tiny_model
        )
    with pytest.raises(ConfigError, match=r"expected 'package\.module:ClassName'"):
        make_config(engine={"scheduler": "not a path"})


# -- custom schedulers used above -------------------------------------------------------------------

from bm.scheduling import MicroBatchScheduler, RequestScheduler, SchedulerOutput  # noqa: E402


class OneContextPerIteration(MicroBatchScheduler):
    """At most one context request per iteration (generation unaffected)."""

    def schedule(self, fitting_requests, inflight_request_ids=frozenset()):
        context, generation = super().schedule(fitting_requests, inflight_request_ids)
        return context[:1], generation


class FifoOneAtATime(RequestScheduler):
    """No two-stage split: run the oldest request alone, start to finish."""

    def __init__(self, engine_config, kv_cache_manager):
        self.kv = kv_cache_manager

    def schedule_request(self, active_requests, inflight_request_ids=frozenset()):
        request = active_requests[0]
        if request.is_generation_phase:
            return SchedulerOutput(generation_requests=[request])
        request.context_chunk_size = request.num_context_tokens_remaining
        return SchedulerOutput(context_requests=[request])
