"""The attention window: paged attention checked against attention computed directly, and long
generations that fit a small cache with outputs equal to HF's sliding-window attention."""

from __future__ import annotations

import copy
import json
from types import SimpleNamespace

import pytest
import torch
from transformers import AutoConfig, AutoModelForCausalLM

from bm.batch_manager import InferenceRequest
from bm.config import ConfigError, config_from_dict
from bm.kv import NO_BLOCK
from bm.runtime.attention import forward_context, paged_attention_forward
from bm.runtime.model_loader import describe_model
from bm.runtime.model_runner import ModelRunner, work_item
from tests.conftest import hf_greedy, make_config, reference_model
from tests.engine_wait import generate_or_fail


def reference_attention(q, keys, values, positions, window, sink):
    """Softmax attention of each query (at ``positions``) over the keys it may see, one at a time."""
    heads, kv_heads = q.shape[0], keys.shape[0]
    out = torch.empty(q.shape[1], heads, q.shape[2])
    for i, p in enumerate(positions):
        seen = [k for k in range(p + 1) if k < sink or k > p - window]
        for h in range(heads):
            kh = h // (heads // kv_heads)
            scores = keys[kh, seen] @ q[h, i] * q.shape[-1] ** -0.5
            out[i, h] = torch.softmax(scores, 0) @ values[kh, seen]
    return out


@pytest.mark.parametrize(("window", "sink"), [(6, 2), (5, 0), (9, 5)])
def test_windowed_paged_attention_matches_attention_computed_directly(tiny_model, window, sink):
    bs = 4
    runner = ModelRunner(
        tiny_model, num_blocks=32, tokens_per_block=bs, max_seq_len=64,
        max_attention_window=window, sink_token_length=sink,
    )  # fmt: skip
    layer = min(tiny_model.kv_shapes)
    kv_heads, dim = tiny_model.kv_shapes[layer]
    heads = kv_heads * 2
    g = torch.Generator().manual_seed(0)
    n = 24
    keys, values = torch.randn(2, kv_heads, n, dim, generator=g)
    queries = torch.randn(heads, n, dim, generator=g)
    long_table, short_table = list(range(10, 16)), [20]
    module = SimpleNamespace(layer_idx=layer)

    @torch.inference_mode()
    def attend(items, rows):
        """One packed forward's attention; ``rows``: (first position, count) of each item's
        tokens in the long sequence (the short sequence's keys are the long one's first ones)."""
        inputs = runner.backend.prepare(items)
        q, k, v = (torch.cat([x[:, s : s + c] for s, c in rows], 1)[None] for x in (queries, keys, values))
        with forward_context(runner.backend, inputs.metadata):
            return paged_attention_forward(module, q, k, v, None)[0][0]

    # 1. a whole prompt longer than the window, beside a short one
    out = attend([work_item([0] * 15, 0, long_table, False), work_item([0] * 3, 0, short_table, False)],
                 [(0, 15), (0, 3)])  # fmt: skip
    want = reference_attention(queries[:, :15], keys, values, range(15), window, sink)
    torch.testing.assert_close(out[:15], want, atol=1e-5, rtol=1e-5)

    # 2. blocks no later query attends are released, and poisoned: they must never be read
    released = [b for b in range(len(long_table)) if b * bs >= sink and (b + 1) * bs <= 15 - window + 1]
    assert released or (window, sink) == (9, 5)  # there, every old block holds a sink
    for b in released:
        with torch.inference_mode():
            runner.kv_caches[layer][:, :, long_table[b]] = float("nan")
        long_table[b] = NO_BLOCK
    out = attend([work_item([0] * 7, 15, long_table, False)], [(15, 7)])
    torch.testing.assert_close(out, reference_attention(queries[:, 15:22], keys, values, range(15, 22), window, sink),
                               atol=1e-5, rtol=1e-5)  # fmt: skip

    # 3. decode: a query past the window beside one whose whole context is inside it
    out = attend([work_item([0], 22, long_table, True)], [(22, 1)])
    torch.testing.assert_close(out, reference_attention(queries[:, 22:23], keys, values, [22], window, sink),
                               atol=1e-5, rtol=1e-5)  # fmt: skip


SMALL = dict(vocab_size=300, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
             num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=512, initializer_range=0.2)  # fmt: skip


@pytest.fixture(scope="module")
def full_attention_mistral():
    """A Mistral with full attention for bm, and the same weights with a 16-token sliding window for HF."""
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(
        AutoConfig.for_model("mistral", **SMALL, sliding_window=None)
    ).eval()
    loaded = describe_model(model, None, "mistral")
    ref = reference_model(loaded)
    ref.config.sliding_window = 16
    return loaded, ref


def test_long_generations_fit_a_small_cache_under_a_window_and_match_hf(full_attention_mistral):
    loaded, ref = full_attention_mistral
    g = torch.Generator().manual_seed(5)
    specs = [(torch.randint(3, 300, (n,), generator=g).tolist(), m) for n, m in ((20, 60), (9, 70), (30, 40))]
    requests = [InferenceRequest.from_values(i, p, m) for i, (p, m) in enumerate(specs)]
    cache = {"tokens_per_block": 4, "max_tokens": 48}  # 12 blocks; every request outgrows the cache
    rejected = generate_or_fail(requests, make_config(kv_cache=cache), model=loaded)
    assert all("KV cache blocks" in rejected[i].error for i in range(3))
    stats: list[str] = []
    results = generate_or_fail(
        requests,
        make_config(kv_cache={**cache, "max_attention_window": 16}),
        model=loaded,
        return_stats=stats.append,
        check_integrity=True,
    )
    for i, (prompt, max_new) in enumerate(specs):
        assert results[i].error == ""
        assert results[i].output_ids == hf_greedy(ref, prompt, max_new), f"request {i}"
    assert max(json.loads(s)["Used KV cache blocks"] for s in stats) <= 12


def test_window_with_chunked_context_and_reuse_matches_hf(full_attention_mistral):
    loaded, ref = full_attention_mistral
    g = torch.Generator().manual_seed(6)
    shared = torch.randint(3, 300, (30,), generator=g).tolist()
    specs = [(shared + torch.randint(3, 300, (k,), generator=g).tolist(), 20) for k in (3, 11, 5, 3)]
    config = make_config(
        engine={"enable_chunked_context": True, "max_num_tokens": 16, "max_batch_size": 2},
        kv_cache={"tokens_per_block": 4, "max_attention_window": 16, "enable_block_reuse": True},
    )
    results = generate_or_fail(
        [InferenceRequest.from_values(i, p, m) for i, (p, m) in enumerate(specs)],
        config,
        model=loaded,
        check_integrity=True,
    )
    for i, (prompt, max_new) in enumerate(specs):
        assert results[i].output_ids == hf_greedy(ref, prompt, max_new), f"request {i}"
    assert sum(results[i].num_reused_blocks for i in range(4)) > 0


def test_native_window_and_user_window_take_the_smaller(full_attention_mistral):
    from bm.batch_manager import BatchManager

    loaded = copy.copy(full_attention_mistral[0])
    loaded.sliding_window = 24
    loaded.layer_windows = (24,) * len(loaded.layer_windows)
    for given, effective in ((None, 24), (16, 16), (40, 24), (600, 24)):
        config = make_config(kv_cache={"max_attention_window": given})
        with BatchManager(config, lambda n: [], lambda *a: None, model=loaded) as manager:
            assert manager.attention_window == effective


@pytest.mark.parametrize(
    ("kv", "pattern"),
    [
        ({"sink_token_length": 4}, r"kv_cache\.sink_token_length needs kv_cache\.max_attention_window"),
        (
            {"max_attention_window": 4, "sink_token_length": 4},
            r"must be smaller than kv_cache\.max_attention",
        ),
        ({"max_attention_window": 0}, r"kv_cache\.max_attention_window: must be >= 1"),
        ({"enable_block_reuse": "yes"}, r"kv_cache\.enable_block_reuse: expected true or false"),
    ],
)
def test_window_and_reuse_settings_are_validated(kv, pattern):
    with pytest.raises(ConfigError, match=pattern):
        config_from_dict({"kv_cache": kv})
