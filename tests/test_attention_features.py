"""Soft-capping, ALiBi, sink logits and per-layer windows in paged attention, checked against attention computed
directly: whole prompts, a chunk on a cached prefix, and decoding (torch path and compiled kernel)."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch

from bm.runtime.attention import ALIBI_ATTR, forward_context, paged_attention_forward
from bm.runtime.model_runner import ModelRunner, work_item
from bm.runtime.native import ENV_SWITCH


def direct_attention(q, keys, values, positions, window=None, softcap=None, slopes=None, sinks=None):
    """Each query (at ``positions``) over the keys it may see, scores written out one head at a time."""
    heads, kv_heads = q.shape[0], keys.shape[0]
    out = torch.empty(q.shape[1], heads, q.shape[2])
    for i, p in enumerate(positions):
        seen = [k for k in range(p + 1) if window is None or k > p - window]
        for h in range(heads):
            kh = h // (heads // kv_heads)
            scores = keys[kh, seen] @ q[h, i] * q.shape[-1] ** -0.5
            if softcap is not None:
                scores = softcap * torch.tanh(scores / softcap)
            if slopes is not None:
                scores = scores + slopes[h] * (torch.tensor(seen) - p)
            if sinks is not None:
                probs = torch.softmax(torch.cat([scores, sinks[h : h + 1]]), 0)[:-1]
            else:
                probs = torch.softmax(scores, 0)
            out[i, h] = probs @ values[kh, seen]
    return out


@pytest.mark.parametrize("native", ["1", "0"])
@pytest.mark.parametrize(
    ("softcap", "alibi", "window", "sink"),
    [
        (1.5, False, None, False),
        (None, True, None, False),
        (None, True, 6, False),
        (2.0, False, 7, False),
        (None, False, None, True),
        (None, False, 5, True),
    ],
)
def test_paged_attention_with_softcap_alibi_sinks_and_window_matches_direct(
    tiny_model, monkeypatch, native, softcap, alibi, window, sink
):
    monkeypatch.setenv(ENV_SWITCH, native)
    bs = 4
    runner = ModelRunner(tiny_model, num_blocks=32, tokens_per_block=bs, max_seq_len=64,
                         max_attention_window=window)  # fmt: skip
    layer = min(tiny_model.kv_shapes)
    kv_heads, dim = tiny_model.kv_shapes[layer]
    heads = kv_heads * 2
    g = torch.Generator().manual_seed(1)
    n = 24
    keys, values = torch.randn(2, kv_heads, n, dim, generator=g) * 2
    queries = torch.randn(heads, n, dim, generator=g) * 2
    slopes = 2.0 ** (-torch.arange(1, heads + 1, dtype=torch.float32) / 2) if alibi else None
    sinks = torch.randn(heads, generator=g) * 2 if sink else None
    module = SimpleNamespace(layer_idx=layer, **({ALIBI_ATTR: slopes} if alibi else {}))
    table = list(range(10, 16))

    @torch.inference_mode()
    def attend(item, first, count):
        inputs = runner.backend.prepare([item])
        q, k, v = (x[None, :, first : first + count] for x in (queries, keys, values))
        with forward_context(runner.backend, inputs.metadata):
            return paged_attention_forward(module, q, k, v, None, softcap=softcap, s_aux=sinks)[0][0]

    def want(first, count):
        return direct_attention(queries[:, first : first + count], keys, values, range(first, first + count),
                                window, softcap, slopes, sinks)  # fmt: skip

    torch.testing.assert_close(
        attend(work_item([0] * 15, 0, table, False), 0, 15), want(0, 15), atol=1e-5, rtol=1e-5
    )
    torch.testing.assert_close(
        attend(work_item([0] * 7, 15, table, False), 15, 7), want(15, 7), atol=1e-5, rtol=1e-5
    )
    torch.testing.assert_close(
        attend(work_item([0], 22, table, True), 22, 1), want(22, 1), atol=1e-5, rtol=1e-5
    )


def test_layers_with_different_windows_each_attend_their_own(tiny_model):
    """A per-layer window list: layer 0 slides over 5 tokens, layer 1 attends everything."""
    layers = sorted(tiny_model.kv_shapes)
    windows = [5 if i == layers[0] else None for i in range(max(layers) + 1)]
    runner = ModelRunner(tiny_model, num_blocks=32, tokens_per_block=4, max_seq_len=64,
                         max_attention_window=windows)  # fmt: skip
    g = torch.Generator().manual_seed(2)
    n = 18
    for layer in layers[:2]:
        kv_heads, dim = tiny_model.kv_shapes[layer]
        keys, values = torch.randn(2, kv_heads, n, dim, generator=g)
        queries = torch.randn(kv_heads * 2, n, dim, generator=g)
        with torch.inference_mode():
            inputs = runner.backend.prepare([work_item([0] * n, 0, list(range(5)), False)])
            with forward_context(runner.backend, inputs.metadata):
                out = paged_attention_forward(
                    SimpleNamespace(layer_idx=layer), queries[None], keys[None], values[None], None
                )[0][0]
        want = direct_attention(queries, keys, values, range(n), windows[layer])
        torch.testing.assert_close(out, want, atol=1e-5, rtol=1e-5)
