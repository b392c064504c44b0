"""Warm-up at engine build: the shape classes a run meets (a decode step per CUDA-graph bucket, the
prompt-carrying forwards whose kernel variants would compile mid-run) run once before any request, and
never change a request's output.

The CPU warms up by default too (``model.warmup: auto``), on the torch path with bm's C kernels; the
CUDA path's code runs here on the Triton path under Triton's interpreter with the static buffers of the
CUDA-graph path (``model.cuda_graphs: on``).
"""

from __future__ import annotations

import dataclasses
import json
import threading
from collections import Counter

import pytest
import torch

from bm.batch_manager import generate
from bm.engine.requests.request import Request
from bm.engine.step.core import EngineCore
from bm.runtime.backends import ENV_SWITCH
from bm.runtime.executor import TorchExecutor
from bm.runtime.model_runner import ModelRunner
from bm.runtime.warmup import DECODE, PREFILL_CLASSES, prefill_shapes, warmup_enabled
from tests.conftest import hf_greedy, make_config, random_prompts


def _run(loaded, specs, config):
    results = generate(
        [Request(i, p, n, return_log_probs=True) for i, (p, n) in enumerate(specs)], config, model=loaded
    )
    return {i: (r.output_ids, r.output_log_probs) for i, r in results.items()}


def _config(**engine):
    return make_config(
        engine={"max_batch_size": 4, "max_num_tokens": 32, **engine},
        kv_cache={"tokens_per_block": 4, "max_tokens": 512},
    )


def test_warmup_is_on_by_default_on_every_device():
    assert warmup_enabled("auto", torch.device("cuda")) and warmup_enabled("auto", torch.device("cpu"))
    assert warmup_enabled("on", torch.device("cpu")) and not warmup_enabled("off", torch.device("cuda"))


def test_prefill_shapes_cover_one_sixteen_and_other_token_counts_within_the_budget():
    named = prefill_shapes(max_batch_size=64, max_num_tokens=8192, max_seq_len=4096)
    assert [name for name, _ in named] == list(PREFILL_CLASSES)
    forwards = [f for _, f in named]
    totals = {sum(n for n, _ in f) for f in forwards}
    assert {17, 32, 4096} <= totals  # neither 1 nor a multiple of 16, multiples of 16, the whole budget
    assert any(p > 0 and n > 1 for f in forwards for n, p in f)  # a chunk after a cached prefix
    assert any(n == 1 for f in forwards for n, _ in f)  # decode rows beside prompts
    assert all(n + p <= 4096 for f in forwards for n, p in f)
    tiny = prefill_shapes(max_batch_size=1, max_num_tokens=8, max_seq_len=12)
    assert all(n + p <= 12 and n <= 8 for _, f in tiny for n, p in f)
    without = prefill_shapes(64, 8192, 4096, whole_budget=False)
    assert [name for name, _ in without] == [n for n in PREFILL_CLASSES if n != "budget"]


def test_the_engine_warms_up_at_build_with_the_runs_budgets_and_reports_it(tiny_model):
    core = EngineCore(_config(), TorchExecutor(tiny_model))  # model.warmup: auto, on the CPU
    assert core.warmup is not None and core.warmup["seconds"] >= 0
    assert [4, 27] in core.warmup["forwards"]  # a prompt beside decode rows (max_batch_size 4: 3 rows)
    assert [1, 1] in core.warmup["forwards"]  # a decode step, run eagerly without CUDA graphs
    assert [1, 32] not in core.warmup["forwards"]  # the whole budget in one prompt: not on the CPU
    assert core.kv_cache_manager.pool.num_used_blocks == 0  # it took no block from the cache's owner
    off = EngineCore(_config(), TorchExecutor(dataclasses.replace(tiny_model, warmup="off")))
    assert off.warmup is None


def test_the_cpu_warmup_maps_the_first_blocks_of_a_pool_sized_for_the_run_up_to_its_limit(
    tiny_model, monkeypatch
):
    """The CPU pool is mapped untouched and each page faults in at its first write: where the pool's
    size was set for the run (kv_cache.max_tokens, as bm bench sets it for its dataset) the warm-up
    writes the lowest block ids (those the KV manager hands out first), the whole of a small pool and
    no more than TOUCH_LIMIT_BYTES of a large one; a pool sized from free memory is left untouched."""
    core = EngineCore(_config(), TorchExecutor(dataclasses.replace(tiny_model)))
    runner = core.executor.runner
    assert core.warmup["touched_bytes"] == runner.cache_bytes == runner.num_blocks * runner.block_bytes
    by_memory = make_config(engine={"max_batch_size": 4, "max_num_tokens": 32}, kv_cache={"max_tokens": None})
    assert EngineCore(by_memory, TorchExecutor(dataclasses.replace(tiny_model))).warmup["touched_bytes"] == 0

    touched: list[int] = []
    real = ModelRunner.touch_blocks
    monkeypatch.setattr(ModelRunner, "touch_blocks", lambda self, n: touched.append(n) or real(self, n))
    monkeypatch.setattr("bm.runtime.warmup.TOUCH_LIMIT_BYTES", 3 * runner.block_bytes + 1)
    small = EngineCore(_config(), TorchExecutor(dataclasses.replace(tiny_model)))
    assert touched == [3] and small.warmup["touched_bytes"] == 3 * runner.block_bytes


def test_the_warmup_runs_each_shape_class_once_before_the_first_request_and_lists_them(
    tiny_model, monkeypatch
):
    """Every forward of the warm-up runs while the engine is built, on the building thread, one per
    shape class (decode once per batch size); the run's own forwards all come after, on the worker; a
    second engine over the same model (the next run in the process) warms nothing up again."""
    config = _config(enable_chunked_context=True)
    report = EngineCore(config, TorchExecutor(tiny_model)).warmup
    shapes = Counter(report["shapes"])
    assert set(shapes) == {*PREFILL_CLASSES, DECODE} - {"budget"}  # the whole budget: not on the CPU
    assert all(shapes[name] == 1 for name in PREFILL_CLASSES if name != "budget")
    assert shapes[DECODE] == 2  # one decode step per batch size: 1 and 4 (max_batch_size)

    calls: list[str] = []
    real = ModelRunner.forward

    def forward(self, items, *args, **kwargs):
        calls.append(threading.current_thread().name)
        return real(self, items, *args, **kwargs)

    monkeypatch.setattr(ModelRunner, "forward", forward)
    model = dataclasses.replace(tiny_model)  # a copy holds no executor yet: nothing is warm
    stats: list[str] = []
    results = generate([Request(0, [5, 6, 7, 8, 9], 3)], config, model=model, return_stats=stats.append)
    assert not results[0].error and len(results[0].output_ids) == 3
    building = threading.current_thread().name
    # every warm-up forward first, on this thread, one per shape class; then one forward per step
    assert calls == [building] * len(report["shapes"]) + ["bm-batch-manager"] * len(stats)
    calls.clear()
    again = generate([Request(0, [5, 6, 7, 8, 9], 3)], config, model=model)
    assert again[0].output_ids == results[0].output_ids
    assert calls and building not in calls  # the model's shared executor was warm already


def test_warmup_registers_nothing_in_the_prefix_cache_and_leaves_reuse_and_outputs_unchanged(tiny_model):
    """Requests sharing a prefix, one at a time with block reuse on: the warm-up writes only blocks no
    request reads, so tokens, log probs and the prefix cache's counts are the same with it and without."""
    shared = [11, 12, 13, 14, 15, 16, 17, 18] * 3
    specs = [([*shared, 40 + i, 41, 42], 4) for i in range(4)]
    config = make_config(
        engine={"max_batch_size": 1, "max_num_tokens": 32, "enable_chunked_context": True},
        kv_cache={"tokens_per_block": 4, "max_tokens": 512, "enable_block_reuse": True},
    )

    def run(mode: str) -> tuple[dict, int]:
        model = dataclasses.replace(tiny_model, warmup=mode)
        core = EngineCore(config, TorchExecutor(model))
        kv = core.kv_cache_manager
        assert kv.pool.num_cached_blocks == 0 and kv.num_reused_blocks == 0  # nothing registered at build
        assert (core.warmup is not None) == (mode == "on")
        stats: list[str] = []
        requests = [Request(i, p, n, return_log_probs=True) for i, (p, n) in enumerate(specs)]
        out = generate(requests, config, model=model, return_stats=stats.append)
        reused = sum(json.loads(line)["Reused Blocks"] for line in stats)
        return {i: (r.output_ids, r.output_log_probs) for i, r in out.items()}, reused

    cold, cold_reused = run("off")
    warm, warm_reused = run("on")
    assert warm == cold
    assert warm_reused == cold_reused and warm_reused >= 3 * 5  # each later request took 5 full blocks


def test_warmup_never_changes_outputs_on_the_torch_path(tiny_model, tiny_reference):
    specs = random_prompts(seed=11, count=6, vocab=tiny_model.vocab_size, max_prompt=40, max_output=6)
    config = _config(enable_chunked_context=True)
    cold = _run(dataclasses.replace(tiny_model, warmup="off"), specs, config)
    warm = _run(dataclasses.replace(tiny_model, warmup="on"), specs, config)
    assert warm == cold  # tokens and log probs, bitwise
    for i, (prompt, n) in enumerate(specs):
        assert warm[i][0] == hf_greedy(tiny_reference, prompt, n)


def test_warmup_runs_every_graph_bucket_up_to_max_batch_size_and_keeps_outputs_on_the_triton_path(
    tiny_model, monkeypatch
):
    pytest.importorskip("triton")
    monkeypatch.setenv(ENV_SWITCH, "triton")
    specs = random_prompts(seed=12, count=5, vocab=tiny_model.vocab_size, max_prompt=20, max_output=5)
    config = _config()
    static = dataclasses.replace(tiny_model, cuda_graphs="on")
    core = EngineCore(config, TorchExecutor(dataclasses.replace(static, warmup="on")))
    assert core.warmup["graph_buckets"] == [1, 2, 4]  # every bucket up to max_batch_size (4)
    cold = _run(dataclasses.replace(static, warmup="off"), specs, config)
    warm = _run(dataclasses.replace(static, warmup="on"), specs, config)
    assert warm == cold


def test_an_llm_allocates_its_cache_and_warms_up_once_at_construction_for_every_generate(monkeypatch):
    import bm
    import bm.runtime.warmup as warmup

    runs = []
    real = warmup.warm_up
    monkeypatch.setattr(warmup, "warm_up", lambda *a, **k: runs.append(a[1:]) or real(*a, **k))
    llm = bm.LLM(
        "tiny-random", device="cpu", warmup="on", engine={"max_batch_size": 4, "max_num_tokens": 32},
        kv_cache={"max_tokens": 1024, "tokens_per_block": 8},
    )  # fmt: skip
    assert len(runs) == 1  # at construction, before the first generate
    runner = llm._executor.runner
    params = bm.SamplingParams(temperature=0, max_tokens=5, ignore_eos=True)
    first = [o.token_ids for o in llm.generate([[5, 6, 7], [9, 10, 11, 12]], params)]
    second = [o.token_ids for o in llm.generate([[5, 6, 7], [9, 10, 11, 12]], params)]
    assert first == second and all(len(t) == 5 for t in first)
    assert llm._executor.runner is runner and len(runs) == 1  # the same cache, warmed up once


def test_the_startup_line_says_how_much_of_the_kv_pool_the_warmup_mapped():
    from bm.bench.results import startup_line

    warm = {"seconds": 0.4, "graph_buckets": [], "touched_bytes": 444 * 2**20}
    line = startup_line({"load_model_s": 1.5, "engine_build_s": 0.5, "warmup": warm})
    assert (
        line
        == "start-up 2.0 s (model 1.5 s, engine 0.5 s: warm-up 0.4 s, 444 MB of KV mapped), before the clock"
    )
    assert "KV" not in startup_line({"engine_build_s": 0.5, "warmup": warm | {"touched_bytes": 0}})
