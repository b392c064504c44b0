"""The panel GEMM's fused epilogues (AVX-512 build): a gated MLP's gate and up projections with SiLU in one
pass, and the decoder layer's residual add on the down projection. They must give exactly the bits of
the separate ops they replace (two GEMMs then ElementwiseKernels.silu_mul; the GEMM then torch's
``residual + out``), at every tile, row-block, streaming and thread boundary, and leave a whole
generation bitwise unchanged. Builds without them say so, and bm runs the separate ops there."""

from __future__ import annotations

import pytest
import torch

from bm.batch_manager import BatchManager, InferenceRequest
from bm.runtime import load_model
from bm.runtime.model_loader import ModelConfig
from bm.runtime.native import SmallGemmKernel, elementwise_kernels, small_gemm_kernel
from tests.clients import StaggeredClient
from tests.conftest import make_config
from tests.native_variants import ISAS

# 1 row, the 12-row tile's edges, the one-block limit (128), row blocks of 108 at K = 576, 2,048 rows
ROWS = (1, 11, 12, 13, 128, 129, 337, 2048)


@pytest.fixture(scope="module")
def kernels():
    if "avx512" not in ISAS:
        pytest.skip("the fused epilogues are in the AVX-512 build; this CPU has no AVX-512")
    gemm, elementwise = small_gemm_kernel("avx512"), elementwise_kernels("avx512")
    if gemm is None or elementwise is None:
        pytest.skip("bm's C kernels do not build here")
    assert gemm.fuses_epilogues
    return gemm, elementwise


@pytest.mark.parametrize("n", [48, 1536])  # 1536 x 2,048 rows: a 12.6 MB output, streamed
@pytest.mark.parametrize("team", [1, 3])
def test_gated_gemm_gives_the_bits_of_two_gemms_then_silu_mul(kernels, threads, n, team):
    gemm, elementwise = kernels
    threads(team)
    torch.manual_seed(n)
    k = 576
    # gate inputs spread over +-100 and more: SiLU's exp clamps at both ends
    gate, up = torch.randn(n, k) * 3, torch.randn(n, k)
    gate_packed, up_packed = SmallGemmKernel.pack(gate), SmallGemmKernel.pack(up)
    x = torch.randn(max(ROWS), k + 3)[:, 1 : k + 1]  # strided rows
    for rows in ROWS:
        got = gemm.gated(x[:rows], gate_packed, up_packed, n)
        g, u = gemm(x[:rows], gate_packed, None, n), gemm(x[:rows], up_packed, None, n)
        assert torch.equal(got, elementwise.silu_mul(g, u)), f"{rows} rows"
        assert g.abs().max() > 88 or rows < 100  # the clamp was reached


@pytest.mark.parametrize("n", [48, 200, 216, 528])  # pairs, a lone panel, tails, a streamed output
@pytest.mark.parametrize("with_bias", [False, True])
def test_residual_epilogue_gives_the_bits_of_torch_adding_the_residual(kernels, threads, n, with_bias):
    gemm, _ = kernels
    threads(2)
    torch.manual_seed(n)
    k = 1536
    weight = torch.randn(n, k)
    bias = torch.randn(n) if with_bias else None
    packed = SmallGemmKernel.pack(weight)
    x = torch.randn(max(ROWS), k)
    residual = torch.randn(max(ROWS), n + 7)[:, 2 : n + 2]  # a residual with its own row stride
    for rows in ROWS:
        got = gemm(x[:rows], packed, bias, n, residual[:rows])
        assert torch.equal(got, residual[:rows] + gemm(x[:rows], packed, bias, n)), f"{rows} rows"


def test_gated_gemm_refuses_shapes_it_cannot_fuse(kernels):
    gemm, _ = kernels
    packed = SmallGemmKernel.pack(torch.randn(40, 8))  # 40 outputs: not whole panels
    with pytest.raises(ValueError, match="gated GEMM"):
        gemm.gated(torch.randn(2, 8), packed, packed, 40)


def generate(model, fused: bool, monkeypatch) -> dict:
    monkeypatch.setattr(small_gemm_kernel(), "fuses_epilogues", fused)
    g = torch.Generator().manual_seed(5)
    requests = [
        InferenceRequest.from_values(
            i,
            torch.randint(3, model.vocab_size, (int(n),), generator=g).tolist(),
            8,
            return_log_probs=True,
            return_generation_logits=True,
        )
        for i, n in enumerate([5, 40, 17, 3, 29])
    ]
    client = StaggeredClient(requests, per_iteration=2)
    with BatchManager(make_config(), client.get_requests, client.send_response, model=model):
        client.wait_or_fail()
    assert all(r.ok for r in client.results.values())
    return client.results


def test_fused_epilogues_leave_a_generation_bitwise_unchanged(kernels, monkeypatch):
    """The default tiny Llama (intermediate size 128: whole panels) through the engine, with the fused
    gate/up/SiLU pass and residual add and without: the same tokens, log probs and logits, exactly."""
    calls = []
    gated = SmallGemmKernel.gated
    monkeypatch.setattr(SmallGemmKernel, "gated", lambda self, *a: calls.append(1) or gated(self, *a))
    model = load_model(ModelConfig(device="cpu", seed=0))
    fused = generate(model, True, monkeypatch)
    assert calls, "the fused gate/up pass never ran"
    calls.clear()
    separate = generate(model, False, monkeypatch)
    assert not calls
    for rid, result in fused.items():
        assert result.output_ids == separate[rid].output_ids
        assert result.output_log_probs == separate[rid].output_log_probs
        assert torch.equal(result.generation_logits, separate[rid].generation_logits)


def test_a_linear_with_a_forward_hook_is_called_not_fused(kernels, monkeypatch):
    """transformers' tensor-parallel plan all-reduces a row-split projection's output in a forward hook;
    a fused epilogue would skip it, so a hooked linear runs as a module call."""
    from transformers import LlamaConfig
    from transformers.models.llama.modeling_llama import LlamaMLP

    from bm.runtime.attention import ShapeProbe, forward_context
    from bm.runtime.fusion import fuse_elementwise
    from bm.runtime.prepack import fusable_gemm, prepack_linears

    torch.manual_seed(0)
    mlp = LlamaMLP(LlamaConfig(hidden_size=32, intermediate_size=64)).eval()
    prepack_linears(mlp)
    fuse_elementwise(mlp)
    x, residual = torch.randn(1, 5, 32), torch.randn(1, 5, 32)
    with (
        torch.no_grad(),
        forward_context(ShapeProbe(), {}),
    ):
        assert fusable_gemm(mlp.down_proj) is not None
        plain = mlp.forward.with_residual(x, residual)
        handle = mlp.down_proj.register_forward_hook(lambda module, args, out: out * 2)
        assert fusable_gemm(mlp.down_proj) is None
        hooked = mlp.forward.with_residual(x, residual)
        expected = residual + mlp(x)  # the module call, hook included
        handle.remove()
    assert torch.equal(hooked, expected)
    assert not torch.allclose(hooked, plain)
