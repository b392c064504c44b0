"""Per-layer attention windows: models whose layers attend different spans (Gemma 2/3, Qwen2's
max_window_layers) run sequences past their window, each layer within its own, equal to HF."""

from __future__ import annotations

import json

import pytest
import torch
from transformers import AutoConfig, AutoModelForCausalLM

from bm.batch_manager import BatchManager, InferenceRequest, generate
from bm.config import ConfigError, config_from_dict
from bm.kv.window_layout import AttentionWindowLayout
from bm.runtime.model_loader import describe_model
from tests.clients import StaggeredClient
from tests.conftest import hf_greedy, make_config, reference_model

SMALL = dict(vocab_size=300, hidden_size=64, intermediate_size=128, num_attention_heads=4, num_key_value_heads=2,
             max_position_embeddings=512, initializer_range=0.2)  # fmt: skip


def build(model_type: str, **extra):
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(AutoConfig.for_model(model_type, **SMALL, **extra)).eval()
    return describe_model(model, None, model_type)


@pytest.fixture(scope="module")
def gemma3():
    """Gemma 3's layout: five sliding layers (window 32) for every full one."""
    loaded = build("gemma3_text", num_hidden_layers=6, head_dim=16, sliding_window=32)
    return loaded, reference_model(loaded)


def test_gemma3_layout_is_read_per_layer(gemma3):
    loaded, _ = gemma3
    assert loaded.layer_windows == (32, 32, 32, 32, 32, None)


def test_gemma3_requests_ten_windows_long_match_hf(gemma3):
    """300-token requests on a 32-token window: windowed layers attend 32 keys, the full one all."""
    loaded, ref = gemma3
    g = torch.Generator().manual_seed(8)
    specs = [
        (torch.randint(3, 300, (n,), generator=g).tolist(), m) for n, m in ((290, 10), (200, 100), (40, 12))
    ]
    results = generate(
        [InferenceRequest.from_values(i, p, m) for i, (p, m) in enumerate(specs)],
        make_config(
            engine={"enable_chunked_context": True, "max_num_tokens": 96}, kv_cache={"tokens_per_block": 16}
        ),
        model=loaded,
        check_integrity=True,
    )
    for i, (prompt, max_new) in enumerate(specs):
        assert results[i].error == ""
        assert results[i].output_ids == hf_greedy(ref, prompt, max_new), f"request {i}"


def test_gemma3_300_token_requests_joining_mid_generation_match_hf_in_a_fraction_of_the_kv_blocks(gemma3):
    """Window 32, five of six layers windowed, requests of 300 tokens arriving one an iteration, chunked
    context: the windowed layers keep blocks in a pool of their own and give back what fell behind
    their window, so the KV blocks in use (counted per layer: one block of one layer is the unit, as full
    attention would count 6 per block) stay well below what full attention holds for the same requests."""
    loaded, ref = gemma3
    g = torch.Generator().manual_seed(11)
    specs = [(torch.randint(3, 300, (n,), generator=g).tolist(), 300 - n) for n in (290, 270, 240, 285, 200)]
    client = StaggeredClient([InferenceRequest.from_values(i, p, m) for i, (p, m) in enumerate(specs)], 1)
    lines: list[str] = []
    config = make_config(
        engine={"max_batch_size": 3, "max_num_tokens": 64, "enable_chunked_context": True},
        kv_cache={"tokens_per_block": 16, "max_tokens": 2048},
    )
    with BatchManager(
        config, client.get_requests, client.send_response, model=loaded, check_integrity=True,
        return_stats=lines.append,
    ):  # fmt: skip
        assert client.wait(300)
    for i, (prompt, max_new) in enumerate(specs):
        assert client.results[i].error == "", f"request {i}"
        assert client.results[i].output_ids == hf_greedy(ref, prompt, max_new), f"request {i}"
    stats = [json.loads(line) for line in lines]
    used = [s["Used KV layer blocks"] for s in stats]
    full = [s["Used KV layer blocks"] + s["KV layer blocks saved by window"] for s in stats]
    assert max(full) >= 6 * 300 // 16  # full attention: at least one whole request in every layer
    assert max(used) * 2 < max(full)
    assert all(u <= f for u, f in zip(used, full, strict=True))


def test_gemma3_request_longer_than_a_full_attention_cache_runs_in_the_same_memory(gemma3):
    """160 tokens of memory in every layer: full attention holds 10 blocks of 16, too few for 300 tokens.
    With the windowed layers in a pool sized to their window, the full layer's pool gets the rest of
    the memory and the request runs, equal to HF. With block reuse (one table for every layer) it is
    refused, as before."""
    loaded, ref = gemma3
    prompt = torch.randint(3, 300, (280,), generator=torch.Generator().manual_seed(12)).tolist()
    engine = {"max_batch_size": 1, "max_num_tokens": 32, "enable_chunked_context": True}
    kv = {"tokens_per_block": 16, "max_tokens": 160}
    request = InferenceRequest.from_values(0, prompt, 20)
    result = generate([request], make_config(engine=engine, kv_cache=kv), model=loaded, check_integrity=True)
    assert result[0].error == ""
    assert result[0].output_ids == hf_greedy(ref, prompt, 20)
    one_table = make_config(engine=engine, kv_cache={**kv, "enable_block_reuse": True})
    refused = generate([request], one_table, model=loaded)
    assert "needs 19 KV cache blocks" in refused[0].error


def test_qwen2_max_window_layers_runs_past_the_window():
    """Qwen2 slides only on layers from max_window_layers up: a sequence longer than the window runs."""
    loaded = build(
        "qwen2", num_hidden_layers=2, sliding_window=24, use_sliding_window=True, max_window_layers=1
    )
    assert loaded.layer_windows == (None, 24)
    ref = reference_model(loaded)
    g = torch.Generator().manual_seed(9)
    specs = [(torch.randint(3, 300, (n,), generator=g).tolist(), m) for n, m in ((40, 20), (10, 50))]
    results = generate(
        [InferenceRequest.from_values(i, p, m) for i, (p, m) in enumerate(specs)], make_config(), model=loaded
    )
    for i, (prompt, max_new) in enumerate(specs):
        assert results[i].error == ""
        assert results[i].output_ids == hf_greedy(ref, prompt, max_new), f"request {i}"


def test_configured_windows_narrow_the_models_per_layer_and_repeat_over_layers():
    layout = AttentionWindowLayout.build((32, 32, None, 32), max_attention_window=[16, 64])
    assert layout.windows == (16, 32, 16, 32)
    assert AttentionWindowLayout.build((None, None), 8).uniform_window == 8
    mixed = AttentionWindowLayout.build((32, None), None, max_seq_len=512)
    assert mixed.is_mixed and mixed.uniform_window is None
    assert AttentionWindowLayout.build((600, None), None, max_seq_len=512).windows == (None, None)


def test_a_list_of_windows_is_accepted_and_each_entry_validated():
    cfg = config_from_dict({"kv_cache": {"max_attention_window": [32, 32, 4096]}})
    assert cfg.kv_cache.max_attention_window == [32, 32, 4096]
    with pytest.raises(ConfigError, match=r"kv_cache\.max_attention_window\[1\]: must be >= 1"):
        config_from_dict({"kv_cache": {"max_attention_window": [32, 0]}})
    with pytest.raises(ConfigError, match=r"kv_cache\.max_attention_window: an empty list"):
        config_from_dict({"kv_cache": {"max_attention_window": []}})


def test_draft_verification_past_the_window_matches_hf(gemma3):
    """Verifying steps run their queries as decode rows, each in its own windowed and full layers."""
    loaded, ref = gemma3
    g = torch.Generator().manual_seed(9)
    span = torch.randint(3, 300, (20,), generator=g).tolist()
    specs = [(span * 3, 40), (torch.randint(3, 300, (70,), generator=g).tolist(), 30)]
    expected = [hf_greedy(ref, p, m) for p, m in specs]
    perfect = generate(
        [
            InferenceRequest.from_values(i, p, m, draft_input_ids=expected[i])
            for i, (p, m) in enumerate(specs)
        ],
        make_config(kv_cache={"tokens_per_block": 16}),
        model=loaded,
        check_integrity=True,
    )
    ngram = generate(
        [InferenceRequest.from_values(i, p, m) for i, (p, m) in enumerate(specs)],
        make_config(
            engine={"speculative": {"method": "ngram", "num_draft_tokens": 5, "max_ngram": 3}},
            kv_cache={"tokens_per_block": 16},
        ),
        model=loaded,
        check_integrity=True,
    )
    for i, tokens in enumerate(expected):
        assert perfect[i].output_ids == tokens, f"perfect drafts, request {i}"
        assert ngram[i].output_ids == tokens, f"n-gram drafts, request {i}"
    assert perfect[0].num_accepted_draft_tokens > 0 and sum(r.num_draft_tokens for r in ngram.values()) > 0
