"""Split-KV (flash-decoding) decode attention, in Triton's interpreter, against the single-pass kernel.

The single-pass kernel is the oracle here (tests/test_triton_attention.py checks it against a dense
float64 reference). In float32 both run IEEE dots, so they differ only by the order of the reduction:
the split path rescales each split's partial sums by ``exp(max_split - max_all)`` and adds the splits
in a second pass, a few more float32 roundings of values whose magnitude is about 1 (each output is a
convex combination of N(0, 1) values, at most about 2.5 here). Hence ``FP32_TOL = 1e-6`` absolute
and relative: about eight float32 ulps at 1, four times the largest difference measured on these cases
(2.4e-7, over three seeds), and far below a real error's size (a key dropped or read twice moves an
output by its softmax weight, about 1/length, times a value of order 1). Where the split path must be
bitwise the single-pass kernel (a sequence that fits one split), the tests say so and use torch.equal.
"""

from __future__ import annotations

import dataclasses

import pytest
import torch

pytest.importorskip("triton")

from bm.runtime import ModelRunner, work_item
from bm.runtime.backends import ENV_SWITCH
from bm.runtime.triton.ops import (
    FILL_PER_SM,
    MAX_SPLITS,
    MIN_SPLIT_TILES,
    DecodeSplit,
    SplitScratch,
    choose_decode_split,
    decode_split,
    paged_attention,
    store_kv,
)
from tests.test_triton_attention import _case, _reference
from tests.triton_compile import compile_for_h100

FP32_TOL = {"atol": 1e-6, "rtol": 1e-6}
TILE = 16  # keys per tile: with 4-token blocks, short contexts still span several tiles and splits

# Decode rows: sequence lengths (context + the new token) on, off, and either side of a tile boundary.
LENGTHS = [16, 17, 32, 47, 64, 71, 5, 90]


def _decode(lengths, heads, kv_heads, head_dim, dtype=torch.float32, seed=0):
    """A decode-only batch (one new token per sequence, its key stored), and its query."""
    specs = [(n - 1, 1) for n in lengths]
    cache, q, k, v, inputs, tables = _case(specs, heads, kv_heads, head_dim, dtype, seed)
    store_kv(cache, k, v, inputs.batch.slot_mapping)
    return cache, q, inputs.batch, specs, tables


def _attend(cache, q, batch, num_splits, *, block_n=TILE, scratch=None, **extras):
    out = torch.empty(q.shape[1], q.shape[0], q.shape[2], dtype=q.dtype)
    scale = q.shape[2] ** -0.5
    paged_attention(
        out, q, cache, batch, scale, block_n=block_n, num_splits=num_splits, scratch=scratch, **extras
    )
    return out


@pytest.mark.parametrize(
    ("heads", "kv_heads", "head_dim", "num_splits"),
    [(2, 2, 64, 3), (6, 2, 64, 4), (8, 1, 80, 5), (9, 3, 96, 2)],
    ids=["mha-d64", "gqa3-d64", "gqa8-d80", "gqa3-d96"],
)
def test_split_kv_equals_the_single_pass_kernel_across_groups_and_head_sizes(
    heads, kv_heads, head_dim, num_splits
):
    cache, q, batch, specs, tables = _decode(LENGTHS, heads, kv_heads, head_dim)
    single = _attend(cache, q, batch, 1)
    split = _attend(cache, q, batch, num_splits)
    torch.testing.assert_close(split, single, **FP32_TOL)
    ref = _reference(cache, q, specs, tables, head_dim**-0.5)
    torch.testing.assert_close(split.double(), ref, atol=2e-5, rtol=2e-5)


@pytest.mark.parametrize("num_splits", [1, 3])
def test_launch_options_for_a_tuning_sweep_leave_the_bits_alone(num_splits):
    """``launch`` passes num_warps/num_stages to the kernel (a sweep on a GPU picks among them); the
    arithmetic and its order are the kernel's, so the result is the same bits."""
    cache, q, batch, _specs, _tables = _decode(LENGTHS, 6, 2, 64)
    tuned = _attend(cache, q, batch, num_splits, launch={"num_warps": 2, "num_stages": 1})
    assert torch.equal(tuned, _attend(cache, q, batch, num_splits))


def test_splits_a_sequence_cannot_fill_exit_without_writing_and_are_never_read():
    """With 16 splits, none of these sequences (1 to 6 tiles, two tiles a split at least) fills more than
    three: the rest exit at once. The scratch starts as NaN, so a partial pass 2 read that pass 1 never
    wrote would poison the output."""
    lengths = [3, 16, 17, 40, 96]
    cache, q, batch, _specs, _tables = _decode(lengths, 4, 2, 64)
    scratch = SplitScratch(torch.device("cpu"))
    for part in scratch.take(len(lengths) * 4 * 16, 64):
        part.fill_(float("nan"))
    split = _attend(cache, q, batch, 16, scratch=scratch)
    assert not split.isnan().any()
    torch.testing.assert_close(split, _attend(cache, q, batch, 1), **FP32_TOL)


def test_a_sequence_that_fits_one_split_gets_the_single_pass_kernels_bits():
    """Up to MIN_SPLIT_TILES tiles a sequence is one split: the same tiles in the same order, merged with
    a weight of exactly 1. So a CUDA graph captured to split (for its table's capacity) replays a short
    context with the bits an eager step, which does not split it, computes."""
    lengths = [1, 9, 16, 2 * TILE]
    cache, q, batch, _specs, _tables = _decode(lengths, 6, 2, 64)
    assert all(-(-n // TILE) <= MIN_SPLIT_TILES for n in lengths)
    assert torch.equal(_attend(cache, q, batch, 7), _attend(cache, q, batch, 1))


def test_a_graphs_capacity_based_choice_computes_what_the_eager_choice_computes():
    """A graph's batch carries its static table's capacity as max_seq_len; an eager batch its longest
    sequence. With the same rows the two choices may differ (split or not), the outputs may not."""
    lengths = [20, 30]
    cache, q, batch, _specs, _tables = _decode(lengths, 4, 2, 64)
    graph_batch = dataclasses.replace(batch, max_seq_len=4096)
    assert decode_split(batch, 2, 64, 132, TILE).num_splits == 1
    assert decode_split(graph_batch, 2, 64, 132, TILE).num_splits > 1
    eager = _attend(cache, q, batch, None, sm_count=132)
    graph = _attend(cache, q, graph_batch, None, sm_count=132)
    assert torch.equal(graph, eager)


@pytest.mark.parametrize("sink_tokens", [0, 3])
def test_windows_with_and_without_sink_tokens(sink_tokens):
    """The split path walks the sink tokens' tiles, then the window's (up to four tiles: two splits of
    work): the tiles between are skipped."""
    window = 40
    cache, q, batch, specs, tables = _decode(LENGTHS, 4, 2, 64)
    batch = batch.with_window(window, sink_tokens)
    single = _attend(cache, q, batch, 1)
    torch.testing.assert_close(_attend(cache, q, batch, 3), single, **FP32_TOL)
    ref = _reference(cache, q, specs, tables, 64**-0.5, window, sink_tokens)
    torch.testing.assert_close(single.double(), ref, atol=2e-5, rtol=2e-5)


def test_blocks_freed_outside_the_window_are_never_read():
    """A windowed table may hold -1 for blocks wholly behind every window: reading one would fault."""
    lengths = [90, 71]
    cache, q, batch, specs, tables = _decode(lengths, 4, 2, 64)
    batch = batch.with_window(40, 0)
    ref = _reference(cache, q, specs, tables, 64**-0.5, window=40)
    batch.block_table = batch.block_table.clone()
    batch.block_table[0, :12] = -1  # positions 0-47: behind the window of the row at 89 (and its tiles)
    batch.block_table[1, :4] = -1  # positions 0-15, for the row at 70
    torch.testing.assert_close(_attend(cache, q, batch, 3).double(), ref, atol=2e-5, rtol=2e-5)


def test_softcap_alibi_and_sink_logits():
    """Soft-capping and ALiBi act on each split's scores; the sink logit joins once, in pass 2."""
    gen = torch.Generator().manual_seed(1)
    extras = {"softcap": 2.0, "alibi": torch.rand(6, generator=gen), "sinks": torch.randn(6, generator=gen)}
    cache, q, batch, specs, tables = _decode(LENGTHS, 6, 2, 64)
    split = _attend(cache, q, batch, 4, **extras)
    torch.testing.assert_close(split, _attend(cache, q, batch, 1, **extras), **FP32_TOL)
    ref = _reference(cache, q, specs, tables, 64**-0.5, **extras)
    torch.testing.assert_close(split.double(), ref, atol=2e-5, rtol=2e-5)


def test_bfloat16_split_stays_within_bf16_rounding_of_the_single_pass_kernel():
    """In bf16 each split rounds its probabilities to bf16 against its own max, and the output is rounded
    once more: a bf16 ulp or two apart (about 1.6e-2 at 2), not float32's tolerance."""
    cache, q, batch, _specs, _tables = _decode(LENGTHS, 6, 2, 64, dtype=torch.bfloat16)
    single = _attend(cache, q, batch, 1)
    torch.testing.assert_close(_attend(cache, q, batch, 4), single, atol=2e-2, rtol=2e-2)


def test_the_dispatcher_splits_only_decode_batches_too_small_to_fill_the_device():
    cache, q, batch, specs, tables = _decode(LENGTHS, 4, 2, 64)
    ref = _reference(cache, q, specs, tables, 64**-0.5)
    for sm_count, splits in ((132, True), (1, False)):  # 16 programs: few for 132 SMs, plenty for 1
        scratch = SplitScratch(torch.device("cpu"))
        out = _attend(cache, q, batch, None, sm_count=sm_count, scratch=scratch)
        assert (scratch.nbytes > 0) == splits
        torch.testing.assert_close(out.double(), ref, atol=2e-5, rtol=2e-5)
    prompt_cache, prompt_q, _k, _v, prompt_inputs, _tables = _case([(40, 1), (0, 5)], 4, 2, 64)
    prompt_batch = prompt_inputs.batch
    scratch = SplitScratch(torch.device("cpu"))
    _attend(prompt_cache, prompt_q, prompt_batch, None, sm_count=132, scratch=scratch)
    assert scratch.nbytes == 0  # a batch with a prompt runs the single-pass kernel
    with pytest.raises(ValueError, match="decode-only"):
        _attend(prompt_cache, prompt_q, prompt_batch, 2)


def test_split_choice_fills_the_device_only_where_rows_times_kv_heads_cannot():
    target = FILL_PER_SM * 132
    # issue 40's two shapes at 256 sequences x 512 tokens on an H100: SmolLM2 (3 KV heads) splits in 3,
    # the 1B Llama (8 KV heads) already has enough programs
    assert choose_decode_split(256, 3, 64, 512, 132) == DecodeSplit(3, 64)
    assert choose_decode_split(256, 8, 64, 512, 132) == DecodeSplit(1, 64)
    # few programs: the fewest splits reaching the target, at most MAX_SPLITS
    assert choose_decode_split(100, 3, 64, 4096, 132).num_splits == -(-target // 300)
    assert choose_decode_split(1, 8, 128, 4096, 132).num_splits == MAX_SPLITS
    # a context of MIN_SPLIT_TILES tiles or fewer has no work for a second split
    assert choose_decode_split(1, 8, 64, MIN_SPLIT_TILES * 64, 132).num_splits == 1
    assert choose_decode_split(1, 8, 64, MIN_SPLIT_TILES * 64 + 1, 132).num_splits > 1
    # the tile follows the head size: larger heads, shorter tiles
    assert choose_decode_split(4, 2, 256, 4096, 132).block_n == 32
    assert choose_decode_split(4, 2, 128, 4096, 132).block_n == 64
    # more SMs to fill, more splits
    assert (
        choose_decode_split(64, 2, 64, 4096, 66).num_splits
        < choose_decode_split(64, 2, 64, 4096, 132).num_splits
    )


def test_scratch_grows_and_keeps_the_buffers_graphs_were_captured_over():
    scratch = SplitScratch(torch.device("cpu"))
    first = scratch.take(10, 64)[0].data_ptr()
    held = scratch.nbytes
    assert scratch.take(8, 64)[0].data_ptr() == first  # a smaller ask reuses the buffer
    assert scratch.nbytes == held
    big = scratch.take(1000, 64)
    assert big[0].data_ptr() != first
    assert all(t.data_ptr() % 64 == 0 for t in big)
    # the first buffer is still held (a graph captured over it may replay into it), beside the new one
    assert scratch.nbytes >= held + 4 * 1000 * 66


@pytest.fixture
def triton_path(monkeypatch):
    monkeypatch.setenv(ENV_SWITCH, "triton")


def test_runner_decode_steps_that_split_match_the_torch_path_and_the_static_buffers(
    tiny_model, triton_path, monkeypatch
):
    """The tiny model (2 KV heads, head size 16) at contexts of three 64-key tiles: its decode steps split
    on the Triton path (eager and over the static buffers alike) and agree with bm's torch path. Two rows
    fill their bucket, so the static buffers' step (split chosen for the table's capacity, 256) is
    bitwise the eager step (split chosen for the longest row)."""
    prompts = [[(7 * i + j) % 200 + 3 for j in range(n)] for i, n in enumerate((150, 131))]
    tables = [list(range(i * 64, i * 64 + 64)) for i in range(len(prompts))]

    def steps(runner):
        logits = runner.forward([work_item(p, 0, t, True) for p, t in zip(prompts, tables, strict=True)])
        tokens = logits.argmax(-1).tolist()
        return runner.forward(
            [work_item([t], len(p), table, True) for p, t, table in zip(prompts, tokens, tables, strict=True)]
        )

    runs = {}
    for mode in ("off", "on"):
        runner = ModelRunner(dataclasses.replace(tiny_model, cuda_graphs=mode), 128, 4, 256)
        assert runner.attention_backend == "triton"
        runs[mode] = steps(runner)
        assert runner.backend.split_scratch.nbytes > 0  # the decode steps ran split-KV
    monkeypatch.setenv(ENV_SWITCH, "torch")
    reference = steps(ModelRunner(tiny_model, 128, 4, 256))
    torch.testing.assert_close(runs["off"], reference, atol=1e-4, rtol=1e-4)
    assert torch.equal(runs["on"], runs["off"])


# The split-KV pair compiled for an H100 (tests/triton_compile.py): the interpreter forgives what the
# compiler refuses.
_BUILDS = """
flags = {"USE_WINDOW": True, "HEAD_DIM": 80, "HEAD_PAD": 128, "BLOCK_N": 64, "MIN_TILES": 2}
for dtype, dot in (("bf16", kernels.DOT_FAST), ("fp32", kernels.DOT_IEEE)):
    ints = ["window", "sink_tokens", "num_splits", "bt_stride", "q_stride_h", "q_stride_t", "c_stride_h",
            "c_stride_b", "c_stride_t"]
    for cache, quant in ((dtype, 0), ("i8", 1), ("fp8e4nv", 2)):  # full width, int8 rows, fp8
        ptrs = {"part_acc_ptr": "*fp32", "part_max_ptr": "*fp32", "part_sum_ptr": "*fp32", "q_ptr": f"*{dtype}",
                "k_cache_ptr": f"*{cache}", "v_cache_ptr": f"*{cache}", "block_table_ptr": "*i32",
                "seq_lens_ptr": "*i32", "alibi_ptr": "*fp32", "scale": "fp32", "softcap": "fp32",
                "k_scale": "fp32", "v_scale": "fp32"}
        build(kernels.split_kv_decode_kernel, {**ptrs, **dict.fromkeys(ints, "i32")},
              {"GROUP": 3, "BLOCK_M": 16, "TOKENS_PER_BLOCK": 16, "USE_SOFTCAP": True, "USE_ALIBI": True,
               "DOT": dot, "KV_QUANT": quant, **flags})
    ptrs = {"out_ptr": f"*{dtype}", "part_acc_ptr": "*fp32", "part_max_ptr": "*fp32", "part_sum_ptr": "*fp32",
            "seq_lens_ptr": "*i32", "sinks_ptr": "*fp32"}
    ints = ["window", "sink_tokens", "num_splits", "o_stride_t", "o_stride_h"]
    build(kernels.split_kv_combine_kernel, {**ptrs, **dict.fromkeys(ints, "i32")},
          {"SPLITS_PAD": 4, "USE_SINKS": True, **flags})
"""


def test_split_kv_kernels_compile_for_an_h100_without_one(tmp_path):
    pair = ["split_kv_decode_kernel"] * 3 + ["split_kv_combine_kernel"]  # full width, int8, fp8 caches
    assert compile_for_h100("kernels.py", _BUILDS, tmp_path) == pair * 2  # bf16, then fp32
