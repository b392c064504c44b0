"""Warm-up at engine build: the shape classes a run meets (a decode step per CUDA-graph bucket, the
prompt-carrying forwards whose kernel variants would compile mid-run) run once before any request, and
never change a request's output.

On CPU the same code runs with ``model.warmup: on``: the Triton path under Triton's interpreter with the
static buffers of the CUDA-graph path (``model.cuda_graphs: on``), and bm's C kernels on the torch path.
"""

from __future__ import annotations

import dataclasses

import pytest
import torch

from bm.engine import generate
from bm.engine.core import EngineCore
from bm.engine.request import Request
from bm.runtime.backends import ENV_SWITCH
from bm.runtime.executor import TorchExecutor
from bm.runtime.warmup import prefill_shapes, warmup_enabled
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


def test_warmup_is_on_by_default_only_on_cuda():
    assert warmup_enabled("auto", torch.device("cuda"))
    assert not warmup_enabled("auto", torch.device("cpu"))
    assert warmup_enabled("on", torch.device("cpu")) and not warmup_enabled("off", torch.device("cuda"))


def test_prefill_shapes_cover_one_sixteen_and_other_token_counts_within_the_budget():
    forwards = prefill_shapes(max_batch_size=64, max_num_tokens=8192, max_seq_len=4096)
    totals = {sum(n for n, _ in f) for f in forwards}
    assert {17, 32, 4096} <= totals  # neither 1 nor a multiple of 16, multiples of 16, the whole budget
    assert any(p > 0 and n > 1 for f in forwards for n, p in f)  # a chunk after a cached prefix
    assert any(n == 1 for f in forwards for n, _ in f)  # decode rows beside prompts
    assert all(n + p <= 4096 for f in forwards for n, p in f)
    tiny = prefill_shapes(max_batch_size=1, max_num_tokens=8, max_seq_len=12)
    assert all(n + p <= 12 and n <= 8 for f in tiny for n, p in f if f)


def test_the_engine_warms_up_at_build_with_the_runs_budgets_and_reports_it(tiny_model):
    loaded = dataclasses.replace(tiny_model, warmup="on")
    core = EngineCore(_config(), TorchExecutor(loaded))
    assert core.warmup is not None and core.warmup["seconds"] >= 0
    assert [1, 32] in core.warmup["forwards"]  # the token budget, in one prompt
    assert [1, 1] in core.warmup["forwards"]  # a decode step, run eagerly without CUDA graphs
    assert core.kv_cache_manager.pool.num_used_blocks == 0  # it took no block from the cache's owner
    off = EngineCore(_config(), TorchExecutor(dataclasses.replace(tiny_model, warmup="off")))
    assert off.warmup is None


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
    params = bm.SamplingParams(max_tokens=5, ignore_eos=True)
    first = [o.token_ids for o in llm.generate([[5, 6, 7], [9, 10, 11, 12]], params)]
    second = [o.token_ids for o in llm.generate([[5, 6, 7], [9, 10, 11, 12]], params)]
    assert first == second and all(len(t) == 5 for t in first)
    assert llm._executor.runner is runner and len(runs) == 1  # the same cache, warmed up once
