"""The simulator's steady-decode fast-forward changes the wall time and nothing else: every iteration's
stats row, every token's timestamp and every metric equal the step-by-step replay's, under every policy,
scheme, chunking, block reuse, a KV cache small enough to pause, and a concurrency cap."""

from __future__ import annotations

import json
import math
from pathlib import Path

import pytest

from bm.config import load_config

from .recorder import Recorder
from .test_sim import TINY

SETTINGS = {
    "no_evict_fused": {"engine.scheduler_policy": "guaranteed_no_evict"},
    "max_util_inflight_small_kv": {
        "engine.batching_scheme": "inflight",
        "engine.scheduler_policy": "max_utilization",
        "kv_cache.max_tokens": 1024,
    },
    "max_util_chunked_reuse_small_kv": {
        "engine.scheduler_policy": "max_utilization",
        "engine.enable_chunked_context": True,
        "engine.max_num_tokens": 96,
        "kv_cache.enable_block_reuse": True,
        "kv_cache.max_tokens": 1280,
    },
    "no_evict_reuse_equal_progress": {
        "engine.enable_chunked_context": True,
        "engine.context_chunking_policy": "equal_progress",
        "engine.max_num_tokens": 128,
        "kv_cache.enable_block_reuse": True,
        "kv_cache.max_tokens": 2048,
    },
    "static_batch": {"engine.scheduler_policy": "static_batch"},
    "v1": {"engine.batching_scheme": "v1", "engine.scheduler_policy": "static_batch"},
    "concurrency_cap": {"bench.max_concurrency": 5},
}


def config_for(tmp_path: Path, seed: int, sets: dict) -> object:
    model_config = tmp_path / "tiny.json"
    model_config.write_text(json.dumps(TINY | {"vocab_size": 512, "max_position_embeddings": 4096}))
    overrides = {
        "engine.executor": "sim",
        "sim.hardware": "h100-sxm",
        "model.config": str(model_config),
        "bench.dataset_kind": "synthetic",
        "bench.num_requests": 60,
        "bench.input_len": 80,
        "bench.output_len": 60,
        "bench.range_ratio": 0.9,
        "bench.prefix_len": 40,
        "bench.num_prefix_groups": 3,
        "bench.request_rate": 400.0,
        "bench.burstiness": 0.5,
        "bench.seed": seed,
        "engine.max_batch_size": 12,
        "kv_cache.tokens_per_block": 8,
        "kv_cache.max_tokens": 8192,
    }
    return load_config(None, overrides | sets)


def replay(config, fast_forward: bool):
    """The run's result, and its stats rows and records as its journal got them."""
    from bm.bench.simulated import load_sim_model, run_sim
    from bm.workloads import load_workload

    model = load_sim_model(config)
    workload = load_workload(config.bench, vocab_size=model.vocab_size, encode=None)
    recorder = Recorder()
    return run_sim(config, model, workload, fast_forward=fast_forward, journal=recorder), recorder


def same(a, b) -> bool:
    """Equal, NaN included (a missing value in both records)."""
    if isinstance(a, float) and isinstance(b, float) and math.isnan(a) and math.isnan(b):
        return True
    return a == b


@pytest.mark.parametrize("seed", [1, 2])
@pytest.mark.parametrize("setting", list(SETTINGS))
def test_fast_forward_gives_the_step_by_step_replay_iteration_by_iteration(tmp_path, setting, seed):
    config = config_for(tmp_path, seed, SETTINGS[setting])
    stepped, stepped_rows = replay(config, fast_forward=False)
    skipped, skipped_rows = replay(config, fast_forward=True)
    assert stepped.metrics["completed"] == 60
    assert len(skipped_rows.stats) == len(stepped_rows.stats) > 60
    for mine, theirs in zip(skipped_rows.stats, stepped_rows.stats, strict=True):
        assert mine == theirs
    for mine, theirs in zip(skipped_rows.in_order(), stepped_rows.in_order(), strict=True):
        assert list(mine) == list(theirs)
        assert all(same(mine[k], theirs[k]) for k in mine), (mine, theirs)
    wall = {"wall_time_s", "fast_forwarded_iterations"}
    assert stepped.metrics["fast_forwarded_iterations"] == 0
    if setting != "v1":  # V1's lockstep batches are never fast-forwarded
        assert skipped.metrics["fast_forwarded_iterations"] > 0
    assert {k: v for k, v in skipped.metrics.items() if k not in wall} == {
        k: v for k, v in stepped.metrics.items() if k not in wall
    }


def test_fast_forward_skips_most_iterations_of_a_steady_decode(tmp_path):
    """The point of it: a long decode with no arrivals is advanced in a few calls, not step by step."""
    from bm.engine.requests.request import Request
    from bm.engine.step.core import EngineCore
    from bm.sim import CostModel, ModelShape, SimExecutor, load_hardware

    config = config_for(tmp_path, 1, {})
    shape = ModelShape.from_dict(TINY | {"vocab_size": 512})
    core = EngineCore(config, SimExecutor(CostModel(shape, load_hardware("h100-sxm"), "float32")))
    for i in range(4):
        assert core.add_request(Request(i, [5] * (10 + i), 200 + 50 * i)) is None
    steps = skipped = 0
    while core.num_active:
        core.step()
        steps += 1
        run = core.fast_forward()
        skipped += run.num_iterations if run is not None else 0
    assert steps + skipped == 350  # one token an iteration (the prompt's gives the first) to the longest
    assert steps <= 12


def test_a_decode_runs_tokens_are_the_scalar_fake_tokens_bumped_off_the_end_id():
    """The vectorized tokens of a fast-forwarded run equal what execute() samples one at a time, for
    request ids near 2**64 and end ids the hash hits."""
    import random

    from bm.engine.execution.fake_executor import fake_token
    from bm.scheduling.request import LlmRequest, Sampling
    from bm.sim.executor import fake_tokens

    rng = random.Random(5)
    requests = [
        LlmRequest(
            rng.randrange(2**64),
            [5] * rng.randrange(1, 3000),
            10,
            Sampling(end_id=rng.randrange(3, 40)),
        )
        for _ in range(100)
    ]
    for req, tokens in zip(requests, fake_tokens(requests, 60, 40), strict=True):
        expected = [fake_token(req.request_id, p, 0, 40) for p in range(req.num_tokens, req.num_tokens + 60)]
        expected = [(t + 1 if t + 1 < 40 else 3) if t == req.sampling.end_id else t for t in expected]
        assert tokens == expected
