"""The Triton path end to end on CPU (Triton's interpreter): the engine oracle, agreement with the torch
path on windowed and soft-capped models, and the static-buffer (CUDA graph) decode path."""

from __future__ import annotations

import dataclasses

import pytest
import torch

from tests.hang import HANG_S

pytest.importorskip("triton")

from bm.batch_manager import BatchManager, InferenceRequest
from bm.runtime import ModelRunner, work_item
from bm.runtime.backends import ENV_SWITCH
from bm.runtime.model_loader import describe_model
from bm.runtime.triton.graphs import bucket_for
from bm.scheduling import FinishReason
from tests.clients import StaggeredClient
from tests.conftest import hf_greedy, make_config, random_prompts


@pytest.fixture
def triton_path(monkeypatch):
    monkeypatch.setenv(ENV_SWITCH, "triton")


def test_greedy_output_equals_hf_generate_on_the_triton_path_with_chunking_and_reuse(
    tiny_model, tiny_reference, triton_path
):
    shared = random_prompts(seed=5, count=1, vocab=tiny_model.vocab_size, max_prompt=20, max_output=1)[0][0]
    specs = random_prompts(seed=3, count=10, vocab=tiny_model.vocab_size, max_prompt=30, max_output=8)
    specs = [((shared + p) if i % 2 else p, m) for i, (p, m) in enumerate(specs)]  # cached prefixes
    config = make_config(
        engine={"max_batch_size": 6, "max_num_tokens": 24, "enable_chunked_context": True},
        kv_cache={"tokens_per_block": 4, "max_tokens": 1024, "enable_block_reuse": True},
    )
    requests = [InferenceRequest.from_values(i, p, m) for i, (p, m) in enumerate(specs)]
    client = StaggeredClient(requests, per_iteration=3)
    with BatchManager(config, client.get_requests, client.send_response, model=tiny_model):
        client.wait_or_fail(timeout=HANG_S)  # Triton's interpreter is slow, more so on a busy machine
    for i, (prompt, max_new) in enumerate(specs):
        result = client.results[i]
        assert result.ok, result.error
        assert result.finish_reason == FinishReason.LENGTH
        assert result.output_ids == hf_greedy(tiny_reference, prompt, max_new), f"request {i}"


def _gemma2(device: str = "cpu"):
    """A tiny Gemma 2: sliding-window layers beside full ones, and soft-capped attention."""
    from transformers import AutoConfig, AutoModelForCausalLM

    config = AutoConfig.for_model(
        "gemma2", vocab_size=96, hidden_size=64, intermediate_size=96, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, head_dim=16, sliding_window=6,
        attn_logit_softcapping=30.0, initializer_range=0.2, max_position_embeddings=256,
    )  # fmt: skip
    torch.manual_seed(0)
    return describe_model(AutoModelForCausalLM.from_config(config).eval(), None, "gemma2")


def _steps(runner: ModelRunner, prompts: list[list[int]], decode_steps: int) -> list[torch.Tensor]:
    """Prefill (in two chunks, the second after a cached prefix), then greedy decode steps; logits of each."""
    bs = runner.tokens_per_block
    tables = [list(range(i * 8, i * 8 + 8)) for i in range(len(prompts))]
    seqs = [list(p) for p in prompts]
    out = []
    half = [len(p) // 2 for p in prompts]
    out.append(
        runner.forward([work_item(p[:h], 0, t, False) for p, h, t in zip(prompts, half, tables, strict=True)])
    )
    logits = runner.forward(
        [work_item(p[h:], h, t, True) for p, h, t in zip(prompts, half, tables, strict=True)]
    )
    out.append(logits)
    for _ in range(decode_steps):
        nxt = logits.argmax(-1).tolist()
        for s, t in zip(seqs, nxt, strict=True):
            s.append(t)
        logits = runner.forward(
            [work_item([s[-1]], len(s) - 1, t, True) for s, t in zip(seqs, tables, strict=True)]
        )
        out.append(logits)
    assert all(len(t) * bs >= len(s) for s, t in zip(seqs, tables, strict=True))
    return out


def test_triton_path_matches_torch_path_on_windows_and_softcap(monkeypatch):
    loaded = _gemma2()
    prompts = [[5, 9, 3, 7, 1, 22, 13, 4, 8, 2, 30], [11, 12, 13], [40, 41, 42, 43, 44, 45, 46, 47]]
    monkeypatch.setenv(ENV_SWITCH, "torch")
    windows = loaded.layer_windows
    assert None in windows and 6 in windows
    reference = _steps(ModelRunner(loaded, 32, 4, 64, max_attention_window=windows), prompts, 4)
    monkeypatch.setenv(ENV_SWITCH, "triton")
    runner = ModelRunner(loaded, 32, 4, 64, max_attention_window=windows)
    assert runner.attention_backend == "triton"
    for got, want in zip(_steps(runner, prompts, 4), reference, strict=True):
        torch.testing.assert_close(got, want, atol=1e-4, rtol=1e-4)


def test_static_buffer_decode_path_gives_the_dynamic_paths_outputs(tiny_model, triton_path):
    """model.cuda_graphs on (no capture without CUDA): decode steps run over the static buffers, padded
    to their bucket. Greedy tokens are identical and logits equal to float rounding; at a batch that
    fills its bucket exactly, the logits are bitwise identical."""
    prompts = [[7, 8, 9, 10, 11], [3, 4], [20, 21, 22, 23, 24, 25, 26], [30, 31, 32, 33]]
    assert bucket_for(len(prompts)) == len(prompts) and bucket_for(3) == 4
    runs = {}
    for mode in ("off", "on"):
        loaded = dataclasses.replace(tiny_model, cuda_graphs=mode)
        runner = ModelRunner(loaded, 40, 4, 64)
        assert (runner.backend.graphs is not None) == (mode == "on")
        runs[mode] = (_steps(runner, prompts, 3), _steps(runner, prompts[:3], 2))
    (full_off, padded_off), (full_on, padded_on) = runs["off"], runs["on"]
    for got, want in zip(full_on, full_off, strict=True):
        assert torch.equal(got, want)
    for got, want in zip(padded_on, padded_off, strict=True):
        assert torch.equal(got.argmax(-1), want.argmax(-1))
        torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-5)


def test_the_fused_rotary_and_kv_store_gives_the_logits_and_cache_of_separate_launches(
    monkeypatch, triton_path, triton_rotary_on_cpu
):
    """The stacked attention's one launch for the rotary and the KV store (TritonBackend.rotate_and_store)
    against the rotary pair then the KV store, over an eager step of two prompts, two decode steps on
    the static buffers and an eager step mixing a third prompt with decode rows: the same bits in every
    logit and in the whole cache."""
    from bm.runtime.backends.triton_backend import TritonBackend
    from tests.test_layer_launches import gpu_path_llama

    tables = [[0, 1], [2, 3], [4]]
    steps = [
        [work_item(list(range(3, 12)), 0, tables[0]), work_item([7, 8, 9, 10, 11], 0, tables[1])],
        [work_item([20], 9, tables[0]), work_item([21], 5, tables[1])],
        [work_item([22], 10, tables[0]), work_item([23], 6, tables[1])],
        [
            work_item([24], 11, tables[0]),
            work_item([30, 31, 32], 0, tables[2]),
            work_item([25], 7, tables[1]),
        ],
    ]

    def run() -> tuple[list[torch.Tensor], list[torch.Tensor]]:
        runner = ModelRunner(
            gpu_path_llama(2, monkeypatch), num_blocks=8, tokens_per_block=16, max_seq_len=64
        )
        with torch.inference_mode():
            logits = [runner.forward(items) for items in steps]
        return logits, [cache.clone() for cache in runner.kv_caches]

    fused_calls: list[bool] = []
    fused = TritonBackend.rotate_and_store

    def counted(self, *args):
        out = fused(self, *args)
        fused_calls.append(out is not None)
        return out

    monkeypatch.setattr(TritonBackend, "rotate_and_store", counted)
    got_logits, got_caches = run()
    assert fused_calls == [True] * 2 * len(steps)  # every layer of every step took the one launch
    monkeypatch.setattr(TritonBackend, "rotate_and_store", lambda self, *args: None)
    want_logits, want_caches = run()
    for step, (got, want) in enumerate(zip(got_logits, want_logits, strict=True)):
        assert torch.equal(got, want), f"step {step}"
    for got, want in zip(got_caches, want_caches, strict=True):
        assert torch.equal(got, want)
    assert all(cache.abs().sum() > 0 for cache in got_caches)
