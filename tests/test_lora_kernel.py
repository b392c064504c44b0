"""The compiled LoRA delta kernel (``native/lora_delta.c``) against plain torch.

The engine-level oracle (bm greedy == HF + peft ``generate()``) is in test_lora.py; these pin the
kernel itself on the shapes the engine never happens to produce: slots in any order with base rows
between them, an adapter that skips the layer (rank 0), ranks that differ per slot and exceed the
kernel's stack buffer, K and N that are not multiples of the vector width, a first-row offset. Every
build this machine runs is checked (tests/native_variants.py), the scalar one (no AVX2) included.
"""

from __future__ import annotations

import pytest
import torch

from bm.runtime.native import LoraDeltaWeights, lora_delta_kernel
from tests.native_variants import ISAS, each_isa

machine_kernel = lora_delta_kernel()
needs_kernel = pytest.mark.skipif(machine_kernel is None, reason="no C compiler here: bm runs the torch path")


def stacked_adapters(slots: int, r: int, k: int, n: int, ranks: list[int], seed: int):
    g = torch.Generator().manual_seed(seed)
    a = torch.randn(slots, r, k, generator=g) / k**0.5
    b = torch.randn(slots, r, n, generator=g)
    for s, rank in enumerate(ranks):  # rows past a slot's rank are zero, as LoraLayers stores them
        a[s, rank:] = 0
        b[s, rank:] = 0
    return a, b, torch.tensor(ranks, dtype=torch.int64)


def reference(x, y, first, slots, a, b, ranks):
    out = y.clone().double()
    for i, s in enumerate(slots.tolist()):
        if s >= 0 and ranks[s] > 0:
            r = int(ranks[s])
            out[first + i] += (x[first + i].double() @ a[s, :r].double().T) @ b[s, :r].double()
    return out.float()


CASES = [
    # rows, K, N, R, per-slot ranks
    (32, 384, 1024, 8, [8, 8, 8, 8]),  # the benchmark's decode shape
    (13, 33, 50, 5, [5, 0, 3]),  # K and N tails, a slot whose adapter skips the layer
    (9, 7, 15, 4, [1, 4]),  # K and N below one vector
    (6, 40, 24, 300, [300, 17]),  # ranks beyond the kernel's 256-row stack buffer
    (1200, 128, 96, 8, [8, 2, 6, 8]),  # enough work for several threads
]


@needs_kernel
@each_isa
@pytest.mark.parametrize(("rows", "k", "n", "r", "ranks"), CASES)
def test_kernel_adds_each_rows_own_adapter_and_leaves_other_rows_bit_exact(isa, rows, k, n, r, ranks):
    kernel = lora_delta_kernel(isa)
    a, b, rank = stacked_adapters(len(ranks), r, k, n, ranks, seed=rows + k)
    g = torch.Generator().manual_seed(1)
    first = 3
    x = torch.randn(first + rows + 2, k, generator=g)
    y = torch.randn(first + rows + 2, n, generator=g)
    # slots in no particular order, with base rows (-1) among them
    slots = torch.randint(-1, len(ranks), (rows,), generator=g)
    expected = reference(x, y, first, slots, a, b, rank)
    got = y.clone()
    kernel(x, got, first, slots, LoraDeltaWeights(a, b, rank))
    torch.testing.assert_close(got, expected, rtol=1e-5, atol=1e-4)
    untouched = torch.ones(len(y), dtype=torch.bool)
    for i, s in enumerate(slots.tolist()):
        untouched[first + i] = s < 0 or ranks[s] == 0
    assert torch.equal(got[untouched], y[untouched])


@needs_kernel
@each_isa
def test_a_rows_result_does_not_depend_on_the_rest_of_the_batch(isa):
    """The engine's tokens of one request meet different neighbours from step to step; each row is
    summed in one fixed order, so its bits never change with them."""
    a, b, rank = stacked_adapters(3, 8, 200, 72, [8, 6, 8], seed=5)
    weights = LoraDeltaWeights(a, b, rank)
    g = torch.Generator().manual_seed(2)
    x, y = torch.randn(600, 200, generator=g), torch.randn(600, 72, generator=g)
    slots = torch.sort(torch.randint(0, 3, (600,), generator=g)).values
    batch = y.clone()
    kernel = lora_delta_kernel(isa)
    kernel(x, batch, 0, slots, weights)
    for row in (0, 1, 250, 599):
        alone = y[row : row + 1].clone()
        kernel(x[row : row + 1], alone, 0, slots[row : row + 1], weights)
        assert torch.equal(alone[0], batch[row])


@needs_kernel
def test_kernel_refuses_what_it_would_read_or_write_out_of_bounds():
    a, b, rank = stacked_adapters(2, 4, 16, 24, [4, 4], seed=0)
    weights = LoraDeltaWeights(a, b, rank)
    x, y, slots = torch.randn(5, 16), torch.randn(5, 24), torch.zeros(5, dtype=torch.int64)
    before = y.clone()
    with pytest.raises(ValueError, match="do not fit"):
        machine_kernel(x, y, 1, slots, weights)  # rows 1..6 of 5
    with pytest.raises(ValueError, match="do not fit"):
        machine_kernel(torch.randn(5, 17), y, 0, slots, weights)
    with pytest.raises(ValueError, match="contiguous"):
        machine_kernel(x, torch.randn(24, 5).t(), 0, slots, weights)
    with pytest.raises(ValueError, match="contiguous"):
        LoraDeltaWeights(a.transpose(1, 2).contiguous().transpose(1, 2), b, rank)
    with pytest.raises(ValueError, match="rank exceeds"):
        machine_kernel(x, y, 0, slots, LoraDeltaWeights(a, b, torch.tensor([4, 5])))
    assert torch.equal(y, before)  # nothing written by a refused call


def test_the_scalar_build_runs_plain_c_and_the_vector_builds_avx2():
    if "scalar" not in ISAS or machine_kernel is None:
        pytest.skip("needs a C compiler and an x86-64 machine")
    assert not lora_delta_kernel("scalar").avx2
    assert all(lora_delta_kernel(isa).avx2 for isa in ISAS if isa != "scalar")
