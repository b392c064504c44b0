"""The Triton kernels (run in Triton's interpreter on CPU) against a dense torch reference.

Each case packs several sequences into one launch, as the engine does: decode rows, whole prompts and
chunks after a cached prefix, with tails that fill no tile, over a shuffled block pool.
"""

from __future__ import annotations

import pytest
import torch

pytest.importorskip("triton")

from bm.runtime.triton.batch import BatchBuilder
from bm.runtime.triton.ops import paged_attention, store_kv

BS = 4  # tokens per block: small, so sequences span several blocks and tiles


def _pool(kv_heads: int, head_dim: int, num_blocks: int, dtype: torch.dtype, gen: torch.Generator):
    return torch.randn(2, kv_heads, num_blocks, BS, head_dim, generator=gen).to(dtype)


def _case(specs, heads, kv_heads, head_dim, dtype=torch.float32, seed=0):
    """specs: (cached, new) per sequence. Returns cache, q, k, v, builder inputs, tables."""
    gen = torch.Generator().manual_seed(seed)
    need = sum(-(-(c + n) // BS) for c, n in specs)
    cache = _pool(kv_heads, head_dim, need + 3, dtype, gen)
    order = torch.randperm(need + 3, generator=gen).tolist()
    tables, tokens, starts = [], [], []
    for cached, new in specs:
        used = -(-(cached + new) // BS)
        tables.append(order[:used])
        order = order[used:]
        tokens.append([0] * new)
        starts.append(cached)
    total = sum(n for _, n in specs)
    q = torch.randn(heads, total, head_dim, generator=gen).to(dtype)
    k = torch.randn(kv_heads, total, head_dim, generator=gen).to(dtype)
    v = torch.randn(kv_heads, total, head_dim, generator=gen).to(dtype)
    inputs = BatchBuilder(torch.device("cpu"), BS).build(tokens, starts, tables, keep=[])
    return cache, q, k, v, inputs, tables


def _reference(
    cache, q, specs, tables, scale, window=None, sink_tokens=0, softcap=None, alibi=None, sinks=None
):
    """Dense attention per sequence: gather its keys from the cache, mask, softmax (float64)."""
    heads = q.shape[0]
    kv_heads, head_dim = cache.shape[1], cache.shape[4]
    group = heads // kv_heads
    out = torch.empty(q.shape[1], heads, head_dim, dtype=torch.float64)
    offset = 0
    for (cached, new), table in zip(specs, tables, strict=True):
        length = cached + new
        kv = cache.index_select(2, torch.tensor(table)).reshape(2, kv_heads, -1, head_dim)[:, :, :length]
        keys = kv[0].double().repeat_interleave(group, 0)
        values = kv[1].double().repeat_interleave(group, 0)
        qs = q[:, offset : offset + new].double()
        scores = qs @ keys.transpose(1, 2) * scale  # [heads, new, length]
        if softcap is not None:
            scores = softcap * torch.tanh(scores / softcap)
        qpos = torch.arange(cached, length)[:, None]
        kpos = torch.arange(length)[None, :]
        if alibi is not None:
            scores = scores + alibi.double()[:, None, None] * (kpos - qpos)
        allowed = kpos <= qpos
        if window is not None:
            allowed &= (kpos > qpos - window) | (kpos < sink_tokens)
        scores = scores.masked_fill(~allowed, float("-inf"))
        if sinks is not None:
            scores = torch.cat([scores, sinks.double()[:, None, None].expand(heads, new, 1)], -1)
        probs = scores.softmax(-1)[..., :length]
        out[offset : offset + new] = (probs @ values).transpose(0, 1)
        offset += new
    return out


def _run(specs, heads, kv_heads, head_dim, dtype=torch.float32, block_n=16, **extras):
    cache, q, k, v, inputs, tables = _case(specs, heads, kv_heads, head_dim, dtype)
    store_kv(cache, k, v, inputs.batch.slot_mapping)
    batch = inputs.batch.with_window(extras.pop("window", None), extras.pop("sink_tokens", 0))
    out = torch.empty(q.shape[1], heads, head_dim, dtype=dtype)
    scale = head_dim**-0.5
    paged_attention(out, q, cache, batch, scale, block_n=block_n, **extras)
    ref = _reference(cache, q, specs, tables, scale, batch.window, batch.sink_tokens, **extras)
    return out, ref


MIXED = [(0, 1), (9, 1), (0, 7), (5, 6), (13, 1), (0, 3)]  # decode rows, prompts, chunks after a prefix


@pytest.mark.parametrize(
    ("heads", "kv_heads", "head_dim"),
    [(2, 2, 64), (4, 1, 64), (6, 2, 128), (8, 1, 64)],
    ids=["mha", "gqa4", "gqa3-d128", "gqa8"],
)
def test_mixed_batch_matches_dense_reference(heads, kv_heads, head_dim):
    out, ref = _run(MIXED, heads, kv_heads, head_dim)
    torch.testing.assert_close(out.double(), ref, atol=2e-5, rtol=2e-5)


def test_store_kv_writes_each_token_at_its_slot_and_skips_padding_rows():
    cache, _q, k, v, inputs, tables = _case([(3, 2), (0, 1)], 2, 2, 64)
    before = cache.clone()
    slots = inputs.batch.slot_mapping.clone()
    slots[1] = -1  # a padding row (a CUDA graph's unused bucket slot) writes nothing
    store_kv(cache, k, v, slots)
    flat = cache.view(2, 2, -1, 64)
    written = [(0, tables[0][0] * BS + 3), (2, tables[1][0] * BS + 0)]
    for token, slot in written:
        torch.testing.assert_close(flat[0, :, slot], k[:, token])
        torch.testing.assert_close(flat[1, :, slot], v[:, token])
    skipped = tables[0][1] * BS + 0
    torch.testing.assert_close(flat[:, :, skipped], before.view(2, 2, -1, 64)[:, :, skipped])


def test_store_kv_takes_values_with_a_row_stride_of_their_own():
    """Values split from a stacked q/k/v product step by the product's width, keys (out of the rotary
    kernel) by their own: the KV write takes both as they are."""
    kv_heads, tokens, d, q_width = 2, 5, 16, 4 * 16
    product = torch.randn(tokens, q_width + 2 * kv_heads * d)
    value = product[:, q_width + kv_heads * d :].view(tokens, kv_heads, d).transpose(0, 1)
    key = torch.randn(tokens, kv_heads, d).transpose(0, 1)
    cache = torch.zeros(2, kv_heads, 4, 4, d)  # 4 blocks of 4 tokens
    slots = torch.tensor([3, 0, 9, 14, 5])
    store_kv(cache, key, value, slots)
    flat = cache.view(2, kv_heads, 16, d)
    for token, slot in enumerate(slots.tolist()):
        assert torch.equal(flat[0, :, slot], key[:, token]) and torch.equal(flat[1, :, slot], value[:, token])


def test_windows_with_and_without_sink_tokens():
    specs = [(11, 1), (0, 9), (6, 5), (2, 1)]
    out, ref = _run(specs, 4, 2, 64, window=5)
    torch.testing.assert_close(out.double(), ref, atol=2e-5, rtol=2e-5)
    out, ref = _run(specs, 4, 2, 64, window=5, sink_tokens=2)
    torch.testing.assert_close(out.double(), ref, atol=2e-5, rtol=2e-5)


def test_softcap_alibi_and_sink_logits():
    gen = torch.Generator().manual_seed(1)
    slopes = torch.rand(4, generator=gen)
    sinks = torch.randn(4, generator=gen)
    out, ref = _run(MIXED, 4, 2, 64, softcap=2.0, alibi=slopes, sinks=sinks)
    torch.testing.assert_close(out.double(), ref, atol=2e-5, rtol=2e-5)


def test_windowed_table_with_freed_blocks_reads_only_live_ones():
    """Blocks wholly outside the window may be gone (-1 in the table): the kernel never reads them."""
    specs = [(14, 1), (10, 3)]
    cache, q, k, v, inputs, tables = _case(specs, 4, 2, 64)
    store_kv(cache, k, v, inputs.batch.slot_mapping)
    ref = _reference(cache, q, specs, tables, 0.125, window=4)
    dead = inputs.batch.block_table.clone()
    dead[:, 0] = -1  # position 0-3 of both sequences lie outside every query's window
    batch = inputs.batch.with_window(4, 0)
    batch.block_table = dead
    out = torch.empty(q.shape[1], 4, 64)
    paged_attention(out, q, cache, batch, 0.125, block_n=16)
    torch.testing.assert_close(out.double(), ref, atol=2e-5, rtol=2e-5)


def test_bfloat16_stays_within_bf16_rounding():
    out, ref = _run(MIXED, 4, 2, 64, dtype=torch.bfloat16)
    torch.testing.assert_close(out.double(), ref, atol=3e-2, rtol=3e-2)


@pytest.mark.parametrize("num_seqs", [1, 2, 3, 5, 8])
def test_every_packed_array_starts_16_byte_aligned_whatever_the_batch_size(num_seqs):
    """Triton compiles a kernel variant per pointer alignment: arrays at offsets that followed the batch
    size made steps of different sizes compile different variants mid-run."""
    tokens = [[7] * (1 + i % 3) for i in range(num_seqs)]
    starts = [3 * i for i in range(num_seqs)]
    tables = [list(range(8 * i, 8 * i + 8)) for i in range(num_seqs)]
    builder = BatchBuilder(torch.device("cpu"), BS)
    inputs = builder.build(tokens, starts, tables, keep=list(range(num_seqs)), pooled_tables={6: tables})
    batches = [inputs.batch, *inputs.pooled.values()]
    arrays = [inputs.input_ids, inputs.positions, inputs.logits_index]
    arrays += [t for b in batches for t in (b.cu_seqlens, b.seq_lens, b.block_table, b.slot_mapping)]
    assert all(t.data_ptr() % 16 == 0 for t in arrays)
    assert inputs.batch.cu_seqlens.tolist() == [0, *[sum(map(len, tokens[: i + 1])) for i in range(num_seqs)]]
    assert inputs.batch.seq_lens.tolist() == [s + len(t) for s, t in zip(starts, tokens, strict=True)]
    assert inputs.positions[0].tolist() == [
        p for s, t in zip(starts, tokens, strict=True) for p in range(s, s + len(t))
    ]
