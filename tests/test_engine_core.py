"""The engine core stepped without a model: the fake executor drives the real scheduler, KV manager and loop."""

from __future__ import annotations

import subprocess
import sys
import textwrap

import pytest

from bm.config import config_from_dict
from bm.engine.execution.fake_executor import FakeExecutor, fake_token
from bm.engine.requests.request import Request
from bm.engine.step.core import EngineCore
from bm.scheduling import FinishReason
from tests.hang import HANG_S

VOCAB = 500


def core_for(engine: dict | None = None, kv: dict | None = None, **executor) -> EngineCore:
    config = config_from_dict(
        {
            "engine": engine or {},
            "kv_cache": {"tokens_per_block": 4, "max_tokens": 256, **(kv or {})},
        }
    )
    return EngineCore(config, FakeExecutor(VOCAB, **executor), check_integrity=True)


def expected_output(request_id: int, prompt_len: int, n: int) -> list[int]:
    """What the fake executor produces for a request, whatever the batching: token k sits at prompt + k."""
    return [fake_token(request_id, prompt_len + k, 0, VOCAB) for k in range(n)]


def run_all(core: EngineCore, requests: list[Request], max_steps: int = 2000) -> dict:
    """Add every request, step until none is active; returns final responses by id and the step records."""
    for request in requests:
        assert core.add_request(request) is None
    finals, records = {}, []
    for _ in range(max_steps):
        if not core.num_active:
            break
        out = core.step()
        records.append(out)
        for response in out.responses:
            if response.final:
                finals[response.request_id] = response
    stuck = [r.request_id for r in requests if r.request_id not in finals]
    assert not stuck, f"requests never finished within {max_steps} steps: {stuck}"
    return {"finals": finals, "records": records}


def mixed_requests(count: int = 10) -> list[Request]:
    out = []
    for i in range(count):
        prompt = [3 + (i * 7 + j) % 50 for j in range(5 + (i * 13) % 30)]
        out.append(Request(i, prompt, 3 + (i * 5) % 12))
    return out


def test_every_module_of_engine_kv_and_scheduling_imports_and_the_core_runs_without_torch():
    """The engine, ``bm.kv`` and ``bm.scheduling`` import no torch at any depth: every module under them
    imports in a process where ``import torch`` fails (the seed's tensor-map adapter and the torch
    executor's factory live in bm.batch_manager, above bm.runtime), and the core steps a request there."""
    code = textwrap.dedent(
        """
        import importlib, pkgutil, sys
        class Block:
            def find_spec(self, name, path=None, target=None):
                if name == "torch" or name.startswith("torch."):
                    raise ImportError("torch is blocked in this test")
        sys.meta_path.insert(0, Block())
        import bm.engine, bm.kv, bm.scheduling
        imported = 0
        for package in (bm.engine, bm.kv, bm.scheduling):
            for info in pkgutil.walk_packages(package.__path__, package.__name__ + "."):
                importlib.import_module(info.name)
                imported += 1
        assert imported > 30, f"only {imported} modules found under bm.engine, bm.kv, bm.scheduling"
        from bm.engine import EngineCore, EngineLoop, Request, Response, validate_request
        from bm.config import config_from_dict
        from bm.engine.step.core import EngineCore
        from bm.engine.execution.fake_executor import FakeExecutor
        from bm.engine.requests.request import Request
        core = EngineCore(config_from_dict({"kv_cache": {"max_tokens": 64, "tokens_per_block": 4}}),
                          FakeExecutor(100))
        core.add_request(Request(0, [5, 6, 7], 3))
        for _ in range(100):  # a few steps finish it; a scheduling hang must not spin forever
            if not core.num_active:
                break
            core.step()
        assert not core.num_active, "request 0 never finished"
        print("torch" in sys.modules)
        """
    )
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=HANG_S)
    assert done.returncode == 0, done.stderr
    assert done.stdout.strip() == "False"


@pytest.mark.parametrize(
    "engine, kv",
    [
        ({}, {}),
        ({"batching_scheme": "inflight"}, {}),
        ({"batching_scheme": "v1"}, {}),
        ({"scheduler_policy": "max_utilization"}, {"max_tokens": 64}),
        ({"scheduler_policy": "static_batch"}, {}),
        ({"enable_chunked_context": True, "max_num_tokens": 8}, {}),
        (
            {
                "enable_chunked_context": True,
                "max_num_tokens": 12,
                "context_chunking_policy": "equal_progress",
            },
            {},
        ),
        (
            {"scheduler_policy": "max_utilization", "enable_chunked_context": True, "max_num_tokens": 8},
            {"max_tokens": 64},
        ),
        ({}, {"enable_block_reuse": True}),
    ],
)
def test_outputs_do_not_depend_on_scheme_policy_chunking_or_reuse(engine, kv):
    requests = mixed_requests()
    finals = run_all(core_for(engine, kv), requests)["finals"]
    for r in requests:
        got = finals[r.request_id]
        assert got.error == "" and got.finish_reason == FinishReason.LENGTH
        assert got.output_ids == expected_output(r.request_id, len(r.input_ids), r.request_output_len)


def test_max_utilization_pauses_and_the_paused_request_resumes_with_the_same_output():
    core = core_for({"scheduler_policy": "max_utilization"}, {"max_tokens": 48})  # 12 blocks of 4
    requests = [Request(i, [5 + i] * 10, 14) for i in range(3)]  # each grows to 6 blocks
    result = run_all(core, requests)
    paused = [rid for out in result["records"] for rid in out.schedule.paused_ids]
    assert paused, "a 12-block cache for three 6-block requests must pause one"
    # the most recently started request is the one paused first
    assert paused[0] == 2
    assert result["finals"][2].num_pauses >= 1
    for r in requests:
        assert result["finals"][r.request_id].output_ids == expected_output(r.request_id, 10, 14)


def test_chunked_context_chunks_end_on_block_boundaries_and_fill_the_budget():
    core = core_for({"enable_chunked_context": True, "max_num_tokens": 10})
    result = run_all(core, [Request(0, list(range(3, 33)), 2)])  # a 30-token prompt, blocks of 4
    chunks = [out.schedule.context_chunks[0] for out in result["records"] if 0 in out.schedule.context_chunks]
    assert chunks == [8, 8, 8, 6]  # non-final chunks are the budget rounded down to whole blocks


def test_block_reuse_takes_a_shared_prefix_instead_of_computing_it():
    core = core_for(kv={"enable_block_reuse": True})
    prefix = list(range(3, 3 + 16))  # four full blocks
    first = run_all(core, [Request(0, [*prefix, 40, 41], 2)])
    second = run_all(core, [Request(1, [*prefix, 50, 51, 52], 2)])
    assert first["finals"][0].num_reused_blocks == 0
    assert second["finals"][1].num_reused_blocks == 4
    computed = sum(out.stats.context_tokens for out in second["records"])
    assert computed == 3  # only the suffix is computed


def test_beam_requests_hold_a_table_per_beam_and_free_every_block_at_the_end():
    core = core_for({"max_beam_width": 3})
    result = run_all(core, [Request(0, [5, 6, 7, 8, 9], 6, beam_width=3), Request(1, [5, 6], 4)])
    beams = result["finals"][0].beams
    assert beams is not None and len(beams) == 3 and all(len(b) == 6 for b in beams)
    assert result["finals"][1].output_ids == expected_output(1, 2, 4)
    assert core.kv_cache_manager.pool.num_used_blocks == 0


def test_token_budget_and_batch_size_bound_every_iteration():
    core = core_for({"max_batch_size": 3, "max_num_tokens": 40})
    result = run_all(core, mixed_requests(12))
    for out in result["records"]:
        s = out.schedule
        assert len(s.context_ids) + len(s.generation_ids) <= 3
        assert sum(s.context_chunks.values()) + len(s.generation_ids) <= 40


def test_end_id_ends_a_request_early_and_stop_signals_cancel_one():
    core = core_for(end_at={0: 3})
    assert core.add_request(Request(0, [5, 6, 7], 10, end_id=1)) is None
    assert core.add_request(Request(1, [5, 6, 7], 10)) is None
    finals = {}
    for _ in range(200):  # bounded: a request that is never scheduled fails below, never spins forever
        if not core.num_active:
            break
        out = core.step()
        finals.update({r.request_id: r for r in out.responses if r.final})
        if 0 in finals and 1 not in finals:
            cancelled = core.cancel(1)
            assert cancelled is not None
            finals[1] = cancelled
    assert not core.num_active, f"requests never finished within 200 steps: {sorted({0, 1} - set(finals))}"
    assert finals[0].finish_reason == FinishReason.END_ID and finals[0].output_ids[-1] == 1
    assert len(finals[0].output_ids) == 3
    assert finals[1].finish_reason == FinishReason.CANCELLED
    assert core.kv_cache_manager.pool.num_used_blocks == 0


def test_a_refused_request_gets_an_error_response_naming_the_field():
    core = core_for()
    response = core.add_request(Request(0, [5, 6], 4, beam_width=1.9))  # type: ignore[arg-type]
    assert response is not None and response.final and response.finish_reason == FinishReason.ERROR
    assert "beam_width" in response.error and "integer" in response.error
