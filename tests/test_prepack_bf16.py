"""bfloat16 linears packed once for oneDNN: the same numbers as F.linear's per-call reorder, faster.

F.linear in bfloat16 on the CPU reorders the weight into oneDNN's layout on every call; with a decode
step's few rows that reorder is most of the call. bm packs each bfloat16 weight once at load instead
(bm.runtime.prepack) and calls the packed oneDNN linear inside its forwards."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from bm.runtime.attention import ShapeProbe, forward_context
from bm.runtime.prepack import _PackedForward, prepack_linears, prepack_supported, should_prepack

pytestmark = pytest.mark.skipif(
    prepack_supported(torch.device("cpu"), torch.bfloat16) is not None,
    reason="oneDNN does not run bfloat16 on this CPU or torch",
)


def in_bm_forward():
    return forward_context(ShapeProbe(), {})


@pytest.mark.parametrize("rows", [1, 5, 64, 300, 2048])
def test_a_packed_bfloat16_linear_gives_f_linears_exact_output(rows):
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(96, 200), nn.Linear(200, 50, bias=False)).to(torch.bfloat16)
    x = torch.randn(1, rows, 96, dtype=torch.bfloat16)
    expected = model(x)
    assert prepack_linears(model) == 2
    assert all(isinstance(m.forward, _PackedForward) for m in model)
    with in_bm_forward():
        got = model(x)
    assert got.dtype == torch.bfloat16
    assert torch.equal(got, expected)


def test_bfloat16_models_are_packed_by_default_on_a_cpu_that_runs_bfloat16():
    model = nn.Linear(8, 8).to(torch.bfloat16)
    assert should_prepack("auto", model, torch.device("cpu"), torch.bfloat16) is True


def test_a_float32_input_to_a_packed_bfloat16_linear_takes_the_modules_own_forward():
    torch.manual_seed(0)
    layer = nn.Linear(16, 8).to(torch.bfloat16)
    prepack_linears(layer)
    with in_bm_forward(), pytest.raises(RuntimeError):
        layer(torch.randn(2, 16))  # nn.Linear's own dtype error, not a silent cast
