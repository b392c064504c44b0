"""A GGUF file's own Q4_0, Q4_1 and Q8_0 blocks as bm's linear weights (``model.quantization: gguf``,
``auto`` for a GGUF preset): the blocks read as gguf's own ``dequantize`` expands them, the group GEMM
bit for bit the float32 panel GEMM on that expansion (in every build, each row whatever the batch), and
the oracle: greedy output equals HF generate() on the expanded weights, which is the model transformers
loads from the same file. Files are written here with the gguf package (no hub)."""

from __future__ import annotations

import copy

import numpy as np
import pytest
import torch

from bm.config import ConfigError
from bm.runtime import load_model
from bm.runtime.gguf_weights import FORMATS, decode_blocks, install_gguf_linears
from bm.runtime.group_linears import group_weight
from bm.runtime.model_loader import ModelConfig, describe_model
from bm.runtime.native import GroupWeight, group_gemm_kernel, small_gemm_kernel
from bm.runtime.weight_quant import WeightQuantError, quantized_linears
from bm.runtime.weight_sources import weight_source
from tests.conftest import make_config, reference_model
from tests.native_variants import each_isa
from tests.quantized_oracle import ORACLE_ENGINES, assert_greedy_equals_hf

gguf = pytest.importorskip("gguf")


def _kernel(isa: str | None = None):
    kernel = group_gemm_kernel(isa)
    if kernel is None:
        pytest.skip("bm's C kernels do not build here")
    return kernel


def _quantize(w: torch.Tensor, kind: str) -> np.ndarray:
    """``w [N, K]`` as the format's rows of blocks, by gguf's own quantizer."""
    return gguf.quants.quantize(w.numpy().astype(np.float32), gguf.GGMLQuantizationType[kind])


@pytest.mark.parametrize("kind", sorted(FORMATS))
def test_blocks_decode_to_ggufs_own_dequantized_values_bit_for_bit(kind):
    g = torch.Generator().manual_seed(len(kind))
    w = torch.randn(24, 96, generator=g) * torch.logspace(-2, 1, 24)[:, None]
    raw = _quantize(w, kind)
    u, d, m = decode_blocks(torch.from_numpy(raw), kind)
    weight = GroupWeight.pack(u, d, m, FORMATS[kind][0], 32)
    want = torch.from_numpy(gguf.quants.dequantize(raw, gguf.GGMLQuantizationType[kind]).copy())
    assert torch.equal(weight.expanded(), want)
    assert weight.values.numel() == 2 * 16 * 96 * FORMATS[kind][0] // 8  # two panels of 16 rows


@pytest.mark.parametrize(("m", "n", "k"), [(1, 35, 64), (13, 50, 96), (30, 16, 32)])
@pytest.mark.parametrize("bits", [4, 8])
@each_isa
def test_the_group_gemm_is_the_float32_panel_gemm_on_the_expanded_weight_in_every_build(m, n, k, bits, isa):
    """Tiles of twelve rows, shorter ones and a row alone, a panel pair, one panel and a part panel: each
    output is the float32 panel GEMM's chain over the expanded weight, so the bits equal small_gemm.c's
    on that weight, every build's equal the plain C build's, and a row's never depend on the batch."""
    g = torch.Generator().manual_seed(m * n + k + bits)
    kernel, scalar = _kernel(isa), _kernel("scalar")
    low, high = (0, 16) if bits == 4 else (-128, 128)
    u = torch.randint(low, high, (n, k), generator=g)
    d = torch.rand(n, k // 32, generator=g) / 50
    offset = torch.randn(n, k // 32, generator=g) / 10 if bits == 4 else torch.zeros(n, k // 32)
    weight = GroupWeight.pack(u, d, offset, bits, 32)
    x, bias = torch.randn(m, k, generator=g), torch.randn(n, generator=g)
    y = kernel(x, weight, bias)
    assert torch.equal(y, scalar(x, weight, bias))
    for i in range(m):
        assert torch.equal(kernel(x[i : i + 1], weight, bias), y[i : i + 1]), f"row {i}"
    panel = small_gemm_kernel()
    if panel is not None and panel.isa != "scalar":
        expanded = weight.expanded()
        assert torch.equal(y, panel(x, panel.pack(expanded), bias, n))
    want = (
        x.double()
        @ (u.double() * d.double().repeat_interleave(32, 1) + offset.double().repeat_interleave(32, 1)).T
    )
    torch.testing.assert_close(y.double(), want + bias.double(), rtol=1e-5, atol=1e-5 * k)


def _llama_cpp_rows(w: torch.Tensor, heads: int) -> torch.Tensor:
    """q/k rows in llama.cpp's converter order (its ``permute``, by its definition): within each head,
    the first and second halves interleaved."""
    n = w.shape[0]
    return w.reshape(heads, 2, n // heads // 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


def write_gguf(model: torch.nn.Module, path, kinds: dict[str, str]) -> None:
    """The decoder linears of a tiny Llama as a GGUF file, each in ``kinds[module suffix]`` (default
    Q4_1), in llama.cpp's layout; then ``model``'s weights set to what transformers reads back from it
    (gguf's dequantize, rows put back), so the model is the file's float32 expansion."""
    config = model.config
    names = gguf.get_tensor_name_map(gguf.MODEL_ARCH.LLAMA, config.num_hidden_layers)
    writer = gguf.GGUFWriter(str(path), "llama")
    with torch.no_grad():
        for name, linear in quantized_linears(model):
            kind = kinds.get(name.split(".")[-1], "Q4_1")
            key = names.get_name(name + ".weight", try_suffixes=(".weight",))
            heads = {"attn_q": config.num_attention_heads, "attn_k": config.num_key_value_heads}.get(
                key.split(".")[-2]
            )
            w = linear.weight.detach().float()
            stored = _llama_cpp_rows(w, heads) if heads else w
            if kind == "F32":
                raw = stored.numpy().copy()
                back = stored
            else:
                raw = _quantize(stored, kind)
                back = torch.from_numpy(gguf.quants.dequantize(raw, gguf.GGMLQuantizationType[kind]).copy())
            writer.add_tensor(key, raw, raw_shape=raw.shape, raw_dtype=gguf.GGMLQuantizationType[kind])
            if heads:  # transformers' reverse permute
                n = back.shape[0]
                back = back.reshape(heads, n // heads // 2, 2, -1).swapaxes(1, 2).reshape(back.shape)
            linear.weight.copy_(back)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()


@pytest.fixture(scope="module")
def gguf_case(tmp_path_factory):
    """The embedded tiny Llama as a file of mixed formats (down projections Q8_0, v Q4_0, o kept F32, the
    rest Q4_1), and two models of it: bm's running the blocks, and the plain float32 expansion."""
    path = tmp_path_factory.mktemp("gguf") / "tiny.gguf"
    base = load_model(ModelConfig(device="cpu", seed=0, prepack="off", fused_elementwise="off"))
    write_gguf(base.model, path, {"down_proj": "Q8_0", "v_proj": "Q4_0", "o_proj": "F32"})
    plain = copy.deepcopy(base.model)
    scheme, install = weight_source("gguf", device=base.device, dtype=base.dtype, sharded=False, gguf=path)
    loaded = describe_model(
        base.model, base.tokenizer, "tiny.gguf", quantization=scheme, install_weights=install
    )
    return path, loaded, plain


def test_each_linear_takes_its_files_format_and_f32_tensors_stay_as_stored(gguf_case):
    _, loaded, plain = gguf_case
    assert loaded.quantization == "gguf"
    layers = loaded.model.config.num_hidden_layers
    assert loaded.num_quantized_linears == 6 * layers  # q, k, v, gate, up, down: o is stored F32
    modules = dict(loaded.model.named_modules())
    for name, reference in quantized_linears(plain):
        module = modules[name]
        if name.endswith("o_proj"):
            assert module.weight.dtype == torch.float32
            continue
        weight = group_weight(module)
        assert weight.bits == (8 if name.endswith("down_proj") else 4)
        assert torch.equal(weight.expanded(), reference.weight)  # q and k rows put back in HF's order
    assert loaded.model.get_output_embeddings().weight.dtype == torch.float32


@ORACLE_ENGINES
def test_greedy_output_equals_hf_generate_on_the_files_float32_expansion(gguf_case, engine):
    _, loaded, plain = gguf_case
    ref = reference_model(loaded)
    expanded = dict(ref.named_parameters())
    for name, param in plain.named_parameters():
        assert torch.equal(expanded[name], param), name  # the reference is the file's expansion
    assert_greedy_equals_hf(loaded, ref, engine)


def test_a_file_whose_blocks_are_not_the_converted_weight_is_refused_naming_the_tensor(gguf_case, tmp_path):
    path, _, _ = gguf_case
    base = load_model(ModelConfig(device="cpu", seed=0, prepack="off"))
    with pytest.raises(WeightQuantError, match=r"blk\.0\.attn_q\.weight's blocks in tiny\.gguf, expanded"):
        install_gguf_linears(base.model, path)  # seed-0 random weights, not the file's expansion


def test_a_block_format_bm_does_not_run_is_refused_naming_the_format(tmp_path):
    base = load_model(ModelConfig(device="cpu", seed=0, prepack="off"))
    path = tmp_path / "k.gguf"
    write_gguf(base.model, path, {"up_proj": "Q5_0"})
    with pytest.raises(
        WeightQuantError, match=r"blk\.0\.ffn_up\.weight in k\.gguf is Q5_0.*quantization: none"
    ):
        install_gguf_linears(base.model, path)


def test_quantization_auto_is_the_default_and_gguf_is_refused_off_a_gguf_file():
    assert make_config().model.quantization == "auto"
    assert make_config(model={"quantization": None}).model.quantization == "auto"  # vLLM's default
    with pytest.raises(
        ConfigError,
        match=r"model\.quantization: gguf runs a GGUF file's own blocks .* 'embedded tiny-llama' is neither",
    ):
        make_config(model={"quantization": "gguf"})
    cuda = make_config(model={"quantization": "gguf", "preset": "smollm2-135m", "device": "cuda"})
    assert cuda.model.quantization == "gguf"  # the blocks on the Triton GEMM
    assert load_model(ModelConfig(device="cpu", seed=0)).quantization == "none"  # auto: as stored


def test_the_tensor_index_reads_what_ggufs_own_reader_reads(gguf_case):
    """bm steps over a file's metadata values instead of parsing them (a tokenizer made the gguf reader
    take 4.9 s of a 5.7 s load); every tensor's name, format and bytes must still be the reader's. On the
    preset's real file too, where it is installed."""
    from bm.preset_files import preset_gguf
    from bm.runtime.gguf_index import read_gguf_index

    files = [gguf_case[0], *([preset_gguf("smollm2-135m")] if preset_gguf("smollm2-135m") else [])]
    for path in files:
        reader = gguf.GGUFReader(str(path))
        arch, tensors = read_gguf_index(path)
        field = reader.fields["general.architecture"]
        assert arch == bytes(field.parts[field.data[0]]).decode() == "llama"
        assert list(tensors) == [t.name for t in reader.tensors]
        for t in reader.tensors:
            mine = tensors[t.name]
            assert mine.kind == t.tensor_type.name, t.name
            assert np.array_equal(mine.data, np.asarray(t.data).view(np.uint8).reshape(mine.data.shape)), (
                t.name
            )


def test_a_gguf_file_as_model_path_runs_its_own_blocks_and_is_named_by_its_path(
    gguf_case, tmp_path, monkeypatch
):
    """``--model x.gguf`` (vLLM and llama.cpp take a file so): converted once like the preset (here the
    conversion is the expanded model saved, transformers' own conversion being the preset's test), then
    run on the file's blocks, the results naming the file."""
    from bm.config.model import model_override
    from bm.runtime import presets

    path, _, plain = gguf_case
    converted = tmp_path / "converted"
    plain.save_pretrained(converted)
    seen = []
    monkeypatch.setattr(
        presets, "converted_gguf", lambda gguf, label: seen.append((gguf, label)) or converted
    )
    assert model_override(str(path)) == ("model.path", str(path))
    loaded = load_model(ModelConfig(path=str(path), device="cpu"))
    assert seen == [(path, "tiny")]
    assert loaded.quantization == "gguf" and loaded.num_quantized_linears == 6 * 2
    assert loaded.name == str(path)
    assert make_config(model={"path": str(path), "quantization": "gguf"}).model.quantization == "gguf"
    assert load_model(ModelConfig(path=str(path), device="cpu", quantization="none")).quantization == "none"
