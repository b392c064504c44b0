"""The engine's defaults keep the batch full on a real trace, on every device, and the simulator resolves
them as the real engine does.

The seed's defaults (no chunked context, a 2,048-token budget) let a prompt at the token cap start only in
an iteration with almost no generating request: on a user's first 1,024-request Azure trace the batch
drained to zero about 98 times and averaged 7 requests an iteration. These tests pin the fix with the
fake executor (no model), the contrast with ``engine.defaults: seed``, and the warning a run gets when it
blocks anyway.
"""

from __future__ import annotations

import dataclasses
import logging
from collections import deque

import pytest

from bm.cli.bench import resolve_config
from bm.config import ENGINE_DEFAULTS, BmConfig, ConfigError, config_from_dict, load_config, resolve_engine
from bm.engine.driving.driver import Driver
from bm.engine.execution.fake_executor import FakeExecutor
from bm.engine.requests.request import Request
from bm.engine.step.core import EngineCore
from bm.engine.step.hol import PATIENCE, HeadOfLineWatch
from bm.sim.cost import CostModel
from bm.sim.executor import SimExecutor
from bm.sim.hardware import load_hardware
from bm.sim.model import ModelShape
from tests.sched_helpers import Harness

MAX_TOKENS = 1 << 22  # the fake executor's cache: large enough that only the budgets decide


def capped_trace(num_requests: int = 768, cap: int = 2048) -> list[tuple[int, int]]:
    """(prompt tokens, output tokens) like the Azure conversation trace cut at ``--max-input-len``: one
    prompt in ten sits at the cap, the rest spread from 40 to 1,500 tokens; outputs 64 to 448."""
    rows = []
    for i in range(num_requests):
        prompt = cap if i % 10 == 3 else 40 + (i * 617) % 1460
        rows.append((prompt, 64 + (i * 131) % 385))
    return rows


def run_trace(config: BmConfig, rows: list[tuple[int, int]], executor: FakeExecutor | None = None):
    """Every row at t=0 through the engine core as the engine loop drives it (admitted as slots free);
    returns the core and its iterations' stats."""
    core = EngineCore(config, executor or FakeExecutor(vocab_size=1000))
    pending = deque(
        Request(i, [3 + (i + j) % 900 for j in range(p)], n, streaming=False) for i, (p, n) in enumerate(rows)
    )
    stats = []
    driver = Driver(
        core,
        lambda response: None,
        source=lambda room: [pending.popleft() for _ in range(min(room, len(pending)))],
        stats=stats.append,
    )
    while pending or core.num_active:
        driver.round()
    return core, stats


def mean_scheduled(stats) -> float:
    return sum(s.context_requests + s.generation_requests for s in stats) / len(stats)


def test_default_budgets_keep_the_batch_at_least_half_full_on_prompts_at_the_token_cap():
    config = config_from_dict({"kv_cache": {"max_tokens": MAX_TOKENS}})
    core, stats = run_trace(config, capped_trace())
    engine = core.config.engine
    assert engine.enable_chunked_context
    assert mean_scheduled(stats) >= engine.max_batch_size / 2
    assert core.warnings == []


def test_the_seed_defaults_stay_one_key_away_and_drain_the_batch_on_the_same_trace(caplog):
    config = config_from_dict({"engine": {"defaults": "seed"}, "kv_cache": {"max_tokens": MAX_TOKENS}})
    with caplog.at_level(logging.WARNING, logger="bm"):
        core, stats = run_trace(config, capped_trace())
    engine = core.config.engine
    seed = ENGINE_DEFAULTS["seed"]["cpu"]
    assert (
        (engine.enable_chunked_context, engine.max_batch_size, engine.max_num_tokens)
        == (
            seed["enable_chunked_context"],
            seed["max_batch_size"],
            seed["max_num_tokens"],
        )
        == (False, 128, 2048)
    )
    assert mean_scheduled(stats) < engine.max_batch_size / 4
    # said once, during the run, naming the key that fixes it
    assert len(core.warnings) == 1
    assert "engine.enable_chunked_context=true" in core.warnings[0]
    said = [r.getMessage() for r in caplog.records if "head of the queue" in r.getMessage()]
    assert said == [f"bm: {core.warnings[0]}"]


def test_head_of_line_blocking_on_kv_blocks_names_the_cache_keys():
    # a cache of 40 blocks of 32 tokens: two long requests hold most of it to completion, and the third
    # waits while the batch (3 of 128) is far below half full
    config = config_from_dict({"kv_cache": {"max_tokens": 40 * 32}})
    core, _ = run_trace(config, [(600, 40), (600, 40), (600, 40)] + [(32, 8)] * 2)
    assert len(core.warnings) == 1
    assert "KV cache blocks" in core.warnings[0] and "kv_cache.max_tokens" in core.warnings[0]


@pytest.mark.parametrize("device_type", ["cpu", "cuda"])
def test_budgets_resolve_per_device_and_a_set_key_wins(device_type):
    defaults = ENGINE_DEFAULTS["bm"][device_type]
    cfg = resolve_engine(load_config(None, {"engine.max_num_tokens": 4096}), device_type)
    assert cfg.engine.max_num_tokens == 4096
    assert cfg.engine.max_batch_size == defaults["max_batch_size"]
    assert cfg.engine.enable_chunked_context is True
    assert resolve_engine(cfg, device_type) == cfg  # resolving twice changes nothing


def test_a_cuda_device_gets_larger_budgets_than_the_cpu():
    cpu, cuda = ENGINE_DEFAULTS["bm"]["cpu"], ENGINE_DEFAULTS["bm"]["cuda"]
    assert cuda["max_batch_size"] > cpu["max_batch_size"]
    assert cuda["max_num_tokens"] > cpu["max_num_tokens"]


def test_a_token_budget_below_one_block_is_refused_when_resolved():
    cfg = load_config(None, {"kv_cache.tokens_per_block": 4096})
    with pytest.raises(ConfigError, match="must hold at least one block"):
        resolve_engine(cfg, "cpu")


def test_real_and_simulated_runs_resolve_the_same_config_from_the_same_flags(tmp_path):
    shape = tmp_path / "shape.json"
    shape.write_text(
        '{"model_type": "llama", "hidden_size": 256, "intermediate_size": 512, "num_hidden_layers": 2, '
        '"num_attention_heads": 4, "num_key_value_heads": 2, "vocab_size": 1000, '
        '"max_position_embeddings": 4096}'
    )
    flags = {"model_config": shape, "dataset_kind": "synthetic"}
    real = resolve_config(None, [], flags, [])
    sim = resolve_config(None, [], flags | {"executor": "sim"}, [])
    assert dataclasses.replace(sim.engine, executor="torch") == real.engine  # no simulator-only override
    # on a GPU: the simulator's datasheet row resolves what a CUDA device does
    sim_core = EngineCore(
        sim, SimExecutor(CostModel(ModelShape.from_file(str(shape)), load_hardware("h100-sxm")))
    )
    gpu_core = EngineCore(
        dataclasses.replace(real, kv_cache=dataclasses.replace(real.kv_cache, max_tokens=1 << 20)),
        FakeExecutor(1000, max_position_embeddings=4096, device_type="cuda"),
    )
    assert dataclasses.replace(sim_core.config.engine, executor="torch") == gpu_core.config.engine
    assert gpu_core.config.engine == resolve_engine(real, "cuda").engine


@pytest.mark.parametrize("policy", ["guaranteed_no_evict", "max_utilization"])
def test_a_head_short_of_kv_blocks_is_named_with_a_fix_the_run_has_not_already_taken(policy):
    """The message names the KV cache's keys, and suggests max_utilization only where it is not set."""
    harness = Harness(policy=policy, num_blocks=6, tokens_per_block=4, max_batch_size=8, max_num_tokens=64)
    running = harness.generating(0, prompt_len=15, generated=2)  # holds 5 of the 6 blocks
    head = harness.waiting(1, prompt_len=12)  # needs 4 blocks, 1 is free
    watch = HeadOfLineWatch(8, 64, chunked=False, policy=policy)
    messages = []
    for _ in range(PATIENCE):
        plan = harness.scheduler.schedule_request([running, head])
        assert head not in plan.context_requests
        messages.append(watch.observe([running, head], plan, harness.kv))
    assert messages[:-1] == [None] * (PATIENCE - 1)
    assert "request 1 has waited 8 iterations at the head of the queue" in messages[-1]
    assert "raise kv_cache.max_tokens or kv_cache.free_memory_fraction" in messages[-1]
    assert ("engine.scheduler_policy=max_utilization" in messages[-1]) == (policy != "max_utilization")
