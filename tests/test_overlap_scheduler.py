"""Overlap scheduling (engine.overlap_scheduler): iteration n+1 is scheduled and launched before n's
tokens are read, and outputs stay exactly those of the seed's order, feature by feature.

The fake executor runs in ``chain`` mode here: a token depends on the input token before it, as a
model's does, so a placeholder resolved to the wrong token would change every later token. The tiny
model then checks the same on the torch executor, bit for bit on the CPU.
"""

from __future__ import annotations

from collections import Counter

import pytest
import torch

from bm.batch_manager.offline import generate
from bm.config import config_from_dict
from bm.engine.execution.fake_executor import FakeExecutor
from bm.engine.execution.protocol import PENDING_TOKEN
from bm.engine.requests.request import Request
from bm.engine.step.core import EngineCore
from bm.engine.step.overlap import resolve_overlap
from bm.scheduling import FinishReason
from tests.conftest import make_config, random_prompts
from tests.op_counts import HostReads
from tests.test_engine_core import mixed_requests, run_all

VOCAB = 500
END = 2


def fake_core(overlap: str, engine: dict | None = None, kv: dict | None = None, **executor) -> EngineCore:
    config = config_from_dict(
        {
            "engine": {"overlap_scheduler": overlap, **(engine or {})},
            "kv_cache": {"tokens_per_block": 4, "max_tokens": 512, **(kv or {})},
        }
    )
    return EngineCore(config, FakeExecutor(VOCAB, chain=True, **executor), check_integrity=True)


def outcome(core: EngineCore, requests: list[Request]) -> dict:
    """Every request's final tokens, finish reason, samples and beams, and its streamed tokens."""
    run = run_all(core, [Request(**vars(r)) for r in requests])
    streamed: dict[int, list[int]] = {}
    for step in run["records"]:
        for response in step.responses:
            if not response.final or response.output_ids:
                streamed.setdefault(response.request_id, []).extend(response.output_ids)
    finals = {}
    for rid, response in run["finals"].items():
        assert not response.error, (rid, response.error)
        assert PENDING_TOKEN not in response.output_ids
        samples = [(s.output_ids, s.finish_reason) for s in response.samples or []]
        finals[rid] = (response.output_ids, response.finish_reason, samples, response.beams)
    return {"finals": finals, "streamed": streamed, "run": run}


def both(requests: list[Request], engine: dict | None = None, kv: dict | None = None, **executor) -> tuple:
    off = outcome(fake_core("off", engine, kv, **executor), requests)
    core = fake_core("on", engine, kv, **executor)
    assert core.overlap
    on = outcome(core, requests)
    return off, on, core


def with_end_ids(requests: list[Request]) -> tuple[list[Request], dict[int, int]]:
    """Every other request samples its end id before its length limit."""
    end_at = {r.request_id: 1 + r.request_id % 4 for r in requests if r.request_id % 2 == 0}
    return [Request(**{**vars(r), "end_id": END, "request_output_len": 8}) for r in requests], end_at


def test_greedy_outputs_are_identical_with_overlap_on_and_off():
    off, on, _ = both(mixed_requests(12))
    assert on["finals"] == off["finals"]


def test_a_request_ending_on_its_end_id_costs_one_discarded_row_and_nothing_else():
    requests, end_at = with_end_ids(mixed_requests(10))
    off_core = fake_core("off", end_at=end_at)
    off = outcome(off_core, requests)
    on_core = fake_core("on", end_at=end_at)
    on = outcome(on_core, requests)
    assert on["finals"] == off["finals"]
    ended_early = [rid for rid, f in off["finals"].items() if f[1] is FinishReason.END_ID]
    assert ended_early and len(ended_early) == len(end_at)
    extra = on_core.executor.num_executed_tokens - off_core.executor.num_executed_tokens
    assert extra == len(ended_early)  # one thrown-away row each; a length limit is known in advance


def test_requests_ending_by_length_are_never_scheduled_past_it():
    off_core, on_core = fake_core("off"), fake_core("on")
    off, on = outcome(off_core, mixed_requests(8)), outcome(on_core, mixed_requests(8))
    assert on["finals"] == off["finals"]
    assert on_core.executor.num_executed_tokens == off_core.executor.num_executed_tokens


def test_stop_words_end_the_output_at_the_same_token():
    requests = mixed_requests(6)
    reference = outcome(fake_core("off"), requests)["finals"]
    stopped = []
    for r in requests:
        tokens = reference[r.request_id][0]
        words = [tokens[1:3]] if len(tokens) >= 4 else None
        stopped.append(Request(**{**vars(r), "stop_words_list": words}))
    off, on, _ = both(stopped)
    assert on["finals"] == off["finals"]
    assert any(f[1] is FinishReason.STOP_WORDS for f in on["finals"].values())


def test_streamed_tokens_add_up_to_the_same_outputs_with_overlap():
    requests, end_at = with_end_ids(mixed_requests(6))
    whole = outcome(fake_core("off", end_at=end_at), requests)["finals"]
    off, on, _ = both([Request(**{**vars(r), "streaming": True}) for r in requests], end_at=end_at)
    assert on["streamed"] == off["streamed"]
    assert on["streamed"] == {rid: final[0] for rid, final in whole.items()}


def test_one_token_requests_and_chunked_prompts():
    requests = [Request(i, [3 + (i * 11 + j) % 90 for j in range(9 + 7 * i)], 1 + i % 3) for i in range(8)]
    off, on, _ = both(requests, engine={"enable_chunked_context": True, "max_num_tokens": 8})
    assert on["finals"] == off["finals"]


@pytest.mark.parametrize("scheme", ["inflight", "inflight_fused"])
def test_pausing_under_max_utilization_recomputes_the_same_tokens(scheme):
    requests, end_at = with_end_ids(mixed_requests(10))
    requests = [Request(**{**vars(r), "request_output_len": 20}) for r in requests]
    engine = {"scheduler_policy": "max_utilization", "batching_scheme": scheme}
    off, on, _ = both(requests, engine=engine, kv={"max_tokens": 96}, end_at=end_at)
    assert on["finals"] == off["finals"]
    pauses = sum(r.num_pauses for r in on["run"]["finals"].values())
    assert pauses > 0  # the cache is small enough that the scheduler pauses requests


def test_beam_search_steps_run_in_order_and_give_the_same_beams():
    requests = [Request(10 + i, [5 + i, 9, 14, 3 + i], 6, beam_width=2) for i in range(3)]
    requests += mixed_requests(4)
    off, on, _ = both(requests, engine={"max_beam_width": 2})
    assert on["finals"] == off["finals"]


def test_request_drafts_are_verified_in_order_with_the_same_result():
    reference = outcome(fake_core("off"), mixed_requests(4))["finals"]
    requests = []
    for r in mixed_requests(4):
        good = reference[r.request_id][0][:2]
        requests.append(Request(**{**vars(r), "draft_input_ids": [*good, 1]}))
    off, on, _ = both(requests)
    assert on["finals"] == off["finals"] == reference


def test_ngram_drafts_turn_overlap_off_and_say_so():
    core = fake_core("on", engine={"speculative": {"method": "ngram", "num_draft_tokens": 2}})
    assert not core.overlap
    assert any("overlap_scheduler" in w for w in core.warnings)


def test_v1_never_overlaps():
    core = fake_core("on", engine={"batching_scheme": "v1"})
    assert not core.overlap


def test_n_samples_fork_from_the_same_first_token():
    requests = [
        Request(10 + i, [4 + i, 8, 15, 16, 23, 42][: 3 + i], 5, num_return_sequences=3) for i in range(3)
    ]
    requests += mixed_requests(5)
    off, on, _ = both(requests)
    assert on["finals"] == off["finals"]
    assert all(len(on["finals"][10 + i][2]) == 3 for i in range(3))


def test_a_cancelled_request_returns_its_tokens_without_placeholders():
    core = fake_core("on")
    for r in mixed_requests(4):
        assert core.add_request(Request(**{**vars(r), "request_output_len": 30})) is None
    for _ in range(6):
        core.step()
    assert core._in_flight is not None
    response = core.cancel(1)
    assert response is not None and response.finish_reason is FinishReason.CANCELLED
    assert response.output_ids and PENDING_TOKEN not in response.output_ids
    rest = core.finish_all(FinishReason.CANCELLED)
    assert {r.request_id for r in rest} == {0, 2, 3}
    assert all(PENDING_TOKEN not in r.output_ids for r in rest)
    assert core._in_flight is None and core.kv_cache_manager.pool.num_used_blocks == 0


def test_cancelling_the_last_request_leaves_no_iteration_in_flight():
    core = fake_core("on")
    assert core.add_request(Request(0, [5, 6, 7, 8], 20)) is None
    core.step()
    core.step()
    assert core.in_flight
    assert core.cancel(0) is not None
    assert not core.in_flight and not core.num_active


def test_every_iteration_reports_its_stats_once_an_iteration_later():
    off = outcome(fake_core("off"), mixed_requests(6))["run"]["records"]
    on = outcome(fake_core("on"), mixed_requests(6))["run"]["records"]
    assert on[0].stats is None  # the first step only launches
    iterations = [s.stats.iteration for s in on if s.stats is not None]
    assert iterations == list(range(1, len(iterations) + 1))  # numbered from 1, as without overlap
    assert off[0].stats.iteration == 1
    generated = sum(s.stats.generation_tokens for s in on if s.stats is not None)
    assert generated == sum(s.stats.generation_tokens for s in off if s.stats is not None)


@pytest.mark.parametrize("overlap", ["off", "on"])
def test_iteration_latencies_add_up_to_the_run_not_twice_it(overlap):
    """Under overlap two iterations are in flight at once: each one's latency starts where the previous
    one's collection ended, so the latencies tile the run as they do in order (a clock that ticks one
    second a reading makes every stretch visible)."""
    ticks = iter(range(10**6))
    config = config_from_dict(
        {"engine": {"overlap_scheduler": overlap}, "kv_cache": {"tokens_per_block": 4, "max_tokens": 512}}
    )
    core = EngineCore(config, FakeExecutor(VOCAB, chain=True), clock=lambda: float(next(ticks)))
    stats = [s.stats for s in run_all(core, mixed_requests(6))["records"] if s.stats is not None]
    assert all(s.latency_ms > 0 for s in stats)
    total, run = sum(s.latency_ms for s in stats), stats[-1].elapsed_s * 1e3
    assert run / 2 < total <= run


def test_auto_overlaps_only_an_executor_that_runs_ahead_of_the_host():
    class RunsAhead(FakeExecutor):
        overlaps_host = True

    assert resolve_overlap("auto", FakeExecutor(), v1=False, ngram=False) == (False, None)
    assert resolve_overlap("auto", RunsAhead(), v1=False, ngram=False) == (True, None)
    assert resolve_overlap("auto", RunsAhead(), v1=True, ngram=False) == (False, None)
    assert resolve_overlap("off", RunsAhead(), v1=False, ngram=False) == (False, None)
    on, said = resolve_overlap("on", FakeExecutor(), v1=False, ngram=True)
    assert not on and "n-gram" in said


def test_the_setting_is_validated_where_the_config_is_read():
    from bm.config import ConfigError

    with pytest.raises(ConfigError, match=r"engine\.overlap_scheduler"):
        config_from_dict({"engine": {"overlap_scheduler": "sometimes"}})
    assert config_from_dict({"engine": {"overlap_scheduler": True}}).engine.overlap_scheduler == "on"


# -- the tiny model on the torch executor: bit for bit on the CPU -----------------------------------------


def model_outputs(model, requests: list[Request], overlap: str, **engine) -> dict:
    config = make_config(engine={"overlap_scheduler": overlap, **engine})
    results = generate([Request(**vars(r)) for r in requests], config, model=model)
    out = {}
    for rid, result in results.items():
        assert not result.error, (rid, result.error)
        samples = [s.output_ids for s in result.samples or []]
        out[rid] = (result.output_ids, result.finish_reason, result.output_log_probs, samples)
    return out


def test_the_tiny_model_gives_the_same_greedy_tokens_and_log_probs_with_overlap(tiny_model):
    vocab = tiny_model.vocab_size
    specs = random_prompts(seed=12, count=8, vocab=vocab, max_prompt=30, max_output=12)
    requests = [Request(i, p, m, return_log_probs=True) for i, (p, m) in enumerate(specs)]
    reference = model_outputs(tiny_model, requests, "off")
    # stop words taken from the greedy outputs, an end id, n samples, beams: each its own feature
    first = reference[0][0]
    requests[0] = Request(**{**vars(requests[0]), "stop_words_list": [first[2:4]]})
    requests[1] = Request(**{**vars(requests[1]), "end_id": reference[1][0][3]})
    requests[2] = Request(**{**vars(requests[2]), "num_return_sequences": 2})
    requests[3] = Request(**{**vars(requests[3]), "beam_width": 2, "return_log_probs": False})
    requests[4] = Request(**{**vars(requests[4]), "repetition_penalty": 1.3, "min_length": 3})
    requests[5] = Request(**{**vars(requests[5]), "presence_penalty": 0.8, "frequency_penalty": 0.6})
    engine = {"max_beam_width": 2, "enable_chunked_context": True, "max_num_tokens": 16}
    off = model_outputs(tiny_model, requests, "off", **engine)
    on = model_outputs(tiny_model, requests, "on", **engine)
    assert on == off
    assert off[0][1] is FinishReason.STOP_WORDS and off[1][1] is FinishReason.END_ID


def test_the_tiny_model_pauses_and_recomputes_the_same_tokens_with_overlap(tiny_model):
    vocab = tiny_model.vocab_size
    specs = random_prompts(seed=4, count=8, vocab=vocab, max_prompt=24, max_output=24)
    requests = [Request(i, p, 24) for i, (p, _) in enumerate(specs)]
    engine = {"scheduler_policy": "max_utilization"}
    kv = {"tokens_per_block": 4, "max_tokens": 96}
    config = {"engine": engine, "kv_cache": kv}
    off = generate([Request(**vars(r)) for r in requests], make_config(**config), model=tiny_model)
    on_config = make_config(engine={**engine, "overlap_scheduler": "on"}, kv_cache=kv)
    on = generate([Request(**vars(r)) for r in requests], on_config, model=tiny_model)
    assert {i: r.output_ids for i, r in on.items()} == {i: r.output_ids for i, r in off.items()}
    assert sum(r.num_pauses for r in on.values()) > 0


def test_structured_output_steps_run_in_order_with_the_same_tokens(tiny_model):
    pytest.importorskip("llguidance", reason="structured output needs llguidance (optional extra)")
    from bm.engine.requests.structured import guided_spec

    vocab = tiny_model.vocab_size
    specs = random_prompts(seed=9, count=4, vocab=vocab, max_prompt=20, max_output=10)
    requests = [Request(i, p, m) for i, (p, m) in enumerate(specs)]
    requests[0] = Request(0, specs[0][0], 12, guided_decoding=guided_spec("guided_regex", "[a-c]{2,8}"))
    assert model_outputs(tiny_model, requests, "on") == model_outputs(tiny_model, requests, "off")


def test_pending_tokens_reach_the_static_decode_buffers_on_the_triton_path(tiny_model, monkeypatch):
    """The torch executor's own launch: plain rows sample on the device and the next step's inputs take
    those tokens there, in the static buffers a CUDA graph replays (run without capture on the CPU,
    under Triton's interpreter), the same tokens as the seed's order."""
    import dataclasses

    pytest.importorskip("triton")
    from bm.runtime.backends import ENV_SWITCH
    from bm.runtime.executor import TorchExecutor
    from bm.runtime.triton.graphs import DecodeGraphs

    monkeypatch.setenv(ENV_SWITCH, "triton")
    filled = []
    replay = DecodeGraphs.run
    monkeypatch.setattr(
        DecodeGraphs,
        "run",
        lambda self, items, fill=None: filled.append(fill is not None) or replay(self, items, fill),
    )
    loaded = dataclasses.replace(tiny_model, cuda_graphs="on")
    specs = random_prompts(seed=21, count=4, vocab=tiny_model.vocab_size, max_prompt=12, max_output=6)
    requests = [Request(i, p, m) for i, (p, m) in enumerate(specs)]
    outputs = {}
    for overlap in ("off", "on"):
        config = make_config(engine={"overlap_scheduler": overlap}, kv_cache={"tokens_per_block": 4})
        executor = TorchExecutor(loaded)
        core = EngineCore(config, executor, check_integrity=True)
        assert core.overlap == (overlap == "on") and (core.launcher is executor) == core.overlap
        run = run_all(core, [Request(**vars(r)) for r in requests])
        assert core.executor.runner.backend.graphs is not None
        outputs[overlap] = {rid: r.output_ids for rid, r in run["finals"].items()}
    assert outputs["on"] == outputs["off"]
    assert any(filled)  # decode steps took their inputs from the device


def test_the_simulator_runs_the_same_workload_with_overlap_on(tmp_path):
    """The core's overlap works under the simulated executor too: every request completes with the
    same tokens counted; the iterations may differ (an end found one step late)."""
    from tests.test_sim import run_document, sim_config

    off = run_document(sim_config(tmp_path))
    on = run_document(sim_config(tmp_path, **{"engine.overlap_scheduler": "on"}))
    assert on["completed"] == off["completed"] == 40
    assert on["total_output_tokens"] == off["total_output_tokens"]
    assert on["config"]["engine"]["overlap_scheduler"] == "on"


def _bias(vocab: int) -> list[float]:
    g = torch.Generator().manual_seed(3)
    return (torch.randn(vocab, generator=g) * 2).tolist()


# controls that rewrite logits from what the host knows at launch, each on its own and all together
DEVICE_CONTROLS = {
    "none": {},
    "logit bias": {"embedding_bias": "bias"},
    "single-token bad words": {"bad_words_list": [[5], [9]]},
    "min length": {"end_id": 7, "min_length": 6},
    "all three": {"embedding_bias": "bias", "bad_words_list": [[5]], "end_id": 7, "min_length": 6},
    # penalties count the output, a token still pending on the device included (overlap)
    "penalties": {"repetition_penalty": 1.4, "presence_penalty": 0.7, "frequency_penalty": 0.5},
}


@pytest.mark.parametrize("controls", list(DEVICE_CONTROLS))
def test_steps_that_need_no_host_read_decode_on_the_device_with_the_host_paths_bits(tiny_model, controls):
    """Log probs, top log probs, stop words and the controls that rewrite logits without the output's
    tokens on the host (a logit bias, single-token bad words, a minimum length, the penalties, which
    count a token still pending on the device there) need no device value on the host before a token
    is known, so such steps decode on the device and overlap. Kept generation logits send every row
    through the host path instead (they travel to the host in the launch) without changing a token:
    both must give the same tokens and the same log-prob bits, greedy and sampled, and so must overlap
    on and off."""
    from bm.runtime.decoding import on_device_only
    from bm.runtime.logits import DecodingState
    from bm.scheduling.controls import Controls

    assert on_device_only(
        DecodingState(Controls(return_log_probs=True, top_log_probs=3, stop_words_list=((5,),)))
    )
    assert on_device_only(DecodingState(Controls(min_length=3, bad_words_list=((5,),), embedding_bias=[0.0])))
    assert not on_device_only(DecodingState(Controls(return_log_probs=True, return_generation_logits=True)))
    assert not on_device_only(DecodingState(Controls(bad_words_list=((5, 6),))))  # reads the output
    vocab = tiny_model.vocab_size
    extra = {k: _bias(vocab) if v == "bias" else v for k, v in DEVICE_CONTROLS[controls].items()}
    specs = random_prompts(seed=21, count=6, vocab=vocab, max_prompt=24, max_output=10)
    plain = [
        Request(i, p, 10, return_log_probs=True, top_logprobs=2 + i % 2, end_id=-1, random_seed=i,
                temperature=None if i % 2 else 0.8, stop_words_list=[[vocab - 1]] if i == 1 else None)
        for i, (p, _) in enumerate(specs)
    ]  # fmt: skip
    plain = [Request(**{**vars(r), **extra}) for r in plain]
    host = [Request(**{**vars(r), "return_generation_logits": True}) for r in plain]
    outputs = {}
    for overlap in ("off", "on"):
        config = make_config(engine={"overlap_scheduler": overlap})
        device_run = generate([Request(**vars(r)) for r in plain], config, model=tiny_model)
        host_run = generate([Request(**vars(r)) for r in host], config, model=tiny_model)
        for rid, ours in device_run.items():
            theirs = host_run[rid]
            assert not ours.error and not theirs.error
            assert ours.output_ids == theirs.output_ids
            assert ours.output_log_probs == theirs.output_log_probs  # float equality: the same bits
            assert ours.output_top_log_probs == theirs.output_top_log_probs
            assert ours.output_top_log_probs and len(ours.output_top_log_probs[0]) == 2 + rid % 2
        outputs[overlap] = {
            rid: (r.output_ids, r.output_log_probs, r.output_top_log_probs) for rid, r in device_run.items()
        }
    # overlapped, each row's last token is still on the device when the next step is decoded (the
    # penalties count it there): the log probs, which see every penalised token, are the same bits
    assert outputs["on"] == outputs["off"]


def _launch_reads(tiny_model, monkeypatch, requests: list[Request]) -> Counter:
    """Where the torch executor's launches read device values on the host (tests/op_counts.py), over
    ``requests`` run with overlap on (the core then launches through the executor's own launch)."""
    from bm.runtime.executor import TorchExecutor

    sites: Counter = Counter()
    launch = TorchExecutor.launch

    def recorded(self, batch):
        with HostReads(sites):
            return launch(self, batch)

    monkeypatch.setattr(TorchExecutor, "launch", recorded)
    config = make_config(engine={"overlap_scheduler": "on", "max_num_tokens": 32})
    results = generate(requests, config, model=tiny_model)
    assert [r.error for r in results.values() if r.error] == []
    return sites


def test_an_overlapped_launch_reads_no_device_value_on_the_host(tiny_model, monkeypatch):
    """Under overlap the next step is launched while the previous one runs; a device value read on the
    host inside the launch (a token, a log prob, a mask) would make the host wait for the step it just
    queued, and host and device would take turns again. Every feature whose steps overlap (greedy and
    sampled rows, seeds, top-k/p, min-p, log probs, top log probs, stop words, end ids, n samples, a
    logit bias, single-token bad words, a minimum length, repetition, presence and frequency penalties,
    prompt tuning, streaming, context logits) launches without one. The only host read is the draw from each sampled request's CPU generator, a
    host tensor on any device. Kept generation logits, which send their rows through the host decode
    path, show the check at work."""
    vocab = tiny_model.vocab_size
    hidden = tiny_model.model.get_input_embeddings().embedding_dim
    table = torch.randn(3, hidden, generator=torch.Generator().manual_seed(2)).tolist()
    specs = random_prompts(seed=5, count=13, vocab=vocab, max_prompt=20, max_output=8)
    fields = [
        {}, {"temperature": 0.8, "random_seed": 1, "runtime_top_k": 5}, {"temperature": 1.1, "runtime_top_p": 0.9},
        {"temperature": 0.7, "min_p": 0.1, "random_seed": 3}, {"return_log_probs": True, "top_logprobs": 2},
        {"stop_words_list": [[vocab - 1]], "end_id": 7}, {"num_return_sequences": 2, "temperature": 0.9},
        {"embedding_bias": _bias(vocab)}, {"bad_words_list": [[5]], "end_id": 7, "min_length": 3},
        {"prompt_embedding_table": table, "prompt_vocab_size": 3}, {"streaming": True},
        {"return_context_logits": True},
        {"repetition_penalty": 1.3, "presence_penalty": 0.5, "frequency_penalty": 0.4, "temperature": 0.9},
    ]  # fmt: skip
    requests = [
        Request(i, p, 8, **extra) for i, ((p, _), extra) in enumerate(zip(specs, fields, strict=True))
    ]
    requests[9].input_ids = [vocab, vocab + 1, vocab + 2, *requests[9].input_ids]  # virtual tokens first
    sites = _launch_reads(tiny_model, monkeypatch, requests)
    assert set(sites) == {("bm/runtime/sampler.py", "_uniform")}  # the CPU generators' draws
    kept = [Request(0, specs[0][0], 4, return_generation_logits=True)]
    # the host decode path reads its tokens within the launch
    assert ("bm/runtime/sampler.py", "sample") in _launch_reads(tiny_model, monkeypatch, kept)


def test_pending_tokens_count_in_a_requests_length_and_never_appear_in_its_output_ids():
    """While an iteration is in flight its sampled tokens are pending: the scheduler, the cache and the
    batch see them in the request's length (``num_tokens``), and ``output_ids`` holds only known
    tokens, so nothing that reads a request's output between steps meets a placeholder."""
    core = fake_core("on")
    for request in mixed_requests(8):
        assert core.add_request(request) is None
    seen_pending = 0
    while core.num_active or core.in_flight:
        core.step()
        for req in core._active.values():
            assert PENDING_TOKEN not in req.output_ids
            assert req.num_tokens == req.num_prompt_tokens + len(req.output_ids) + req.num_pending
            assert req.num_pending <= 1  # between steps: only the iteration in flight's token
            seen_pending += req.num_pending
    assert seen_pending > 0  # the test saw iterations in flight
