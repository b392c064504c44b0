"""bfloat16 on the CPU, chosen by the CPU's features (faked here): without bf16 instructions it is not a
5x trap (it runs in float32, said in one line); with them, ``model.cpu_bf16_gemm`` picks oneDNN's GEMM
(AMX) or bm's batch-invariant one (AVX512_BF16), and refuses invariant where it cannot run."""

from __future__ import annotations

import logging

import pytest
import torch

from bm.config import ConfigError, ModelConfig, config_from_dict, resolve_dtype_name, sections
from bm.cpu_isa import cpu_bf16_gemm, native_bf16
from bm.runtime import model_loader
from bm.runtime.native import Bf16GemmKernel, bf16_gemm_kernel
from bm.runtime.prepack import prepack_supported

AVX2_EPYC = frozenset({"sse4_2", "avx", "avx2", "fma"})
SAPPHIRE_RAPIDS = AVX2_EPYC | {"avx512f", "avx512bw", "avx512_bf16", "amx_bf16", "amx_tile"}
GRAVITON3 = frozenset({"fp", "asimd", "sve", "bf16"})


def test_native_bf16_is_read_off_the_cpus_flags():
    assert native_bf16(SAPPHIRE_RAPIDS) and native_bf16(GRAVITON3)
    assert native_bf16(AVX2_EPYC) is False
    assert native_bf16(frozenset()) is None  # no /proc/cpuinfo: unknown


def test_bfloat16_runs_in_float32_only_on_a_cpu_known_to_lack_bf16():
    assert resolve_dtype_name("bf16", "cpu", native_bf16=False) == "float32"
    assert resolve_dtype_name("bf16", "cpu", native_bf16=True) == "bfloat16"
    assert resolve_dtype_name("bf16", "cpu") == "bfloat16"  # unknown, or a simulated machine's row
    assert resolve_dtype_name("bf16", "cuda", native_bf16=False) == "bfloat16"
    assert resolve_dtype_name("float16", "cpu", native_bf16=False) == "float16"
    assert resolve_dtype_name("auto", "cpu", native_bf16=False) == "float32"


@pytest.mark.parametrize(
    ("features", "expected"), [(AVX2_EPYC, torch.float32), (SAPPHIRE_RAPIDS, torch.bfloat16)]
)
def test_loading_in_bf16_on_a_cpu_without_it_loads_float32_and_says_why(
    monkeypatch, caplog, features, expected
):
    monkeypatch.setattr(model_loader, "cpu_features", lambda: features)
    with caplog.at_level(logging.WARNING, logger="bm"):
        loaded = model_loader.load_model(ModelConfig(dtype="bfloat16", device="cpu"))
    assert loaded.dtype == expected
    assert next(loaded.model.parameters()).dtype == expected
    said = [r.getMessage() for r in caplog.records if "bfloat16 instructions" in r.getMessage()]
    if expected == torch.float32:
        assert len(said) == 1 and "5x slower" in said[0] and "float32" in said[0]
    else:
        assert not said


# ---- model.cpu_bf16_gemm: oneDNN or bm's batch-invariant bf16 GEMM -------------------------------------
AVX512 = AVX2_EPYC | {"avx512f", "avx512bw", "avx512vl", "avx512dq"}
SKYLAKE_SP = AVX512  # AVX-512 without AVX512_BF16
ZEN4 = AVX512 | {"avx512_bf16"}  # AVX512_BF16, no AMX: this kind of machine measured the choice
SAPPHIRE_RAPIDS_FULL = ZEN4 | {"amx_bf16", "amx_tile"}


@pytest.mark.parametrize(
    ("features", "machine", "expected"),
    [
        (SAPPHIRE_RAPIDS_FULL, "x86_64", "onednn"),  # AMX tiles: oneDNN unless invariance is asked for
        (ZEN4, "x86_64", "invariant"),
        (SKYLAKE_SP, "x86_64", "onednn"),
        (AVX2_EPYC, "x86_64", "onednn"),
        (GRAVITON3, "aarch64", "onednn"),
    ],
)
def test_auto_keeps_onednn_on_amx_and_takes_the_invariant_gemm_where_only_avx512_bf16_runs_it(
    features, machine, expected
):
    assert cpu_bf16_gemm("auto", features, machine) == expected
    assert cpu_bf16_gemm("onednn", features, machine) == "onednn"


def test_invariant_is_granted_on_amx_and_avx512_bf16_cpus_when_asked_for():
    assert cpu_bf16_gemm("invariant", SAPPHIRE_RAPIDS_FULL, "x86_64") == "invariant"
    assert cpu_bf16_gemm("invariant", ZEN4, "x86_64") == "invariant"


@pytest.mark.parametrize(
    ("features", "machine", "isa", "said"),
    [
        (SKYLAKE_SP, "x86_64", None, "lacks avx512_bf16"),
        (AVX2_EPYC, "x86_64", None, "lacks avx512_bf16, avx512bw"),
        (GRAVITON3, "aarch64", None, "this one is aarch64"),
        (ZEN4, "x86_64", "avx2", "BM_CPU_ISA=avx2 rules out"),
    ],
)
def test_invariant_where_the_kernel_cannot_run_is_refused_naming_the_field_and_the_fix(
    features, machine, isa, said
):
    with pytest.raises(ValueError, match=r"model\.cpu_bf16_gemm: invariant") as refused:
        cpu_bf16_gemm("invariant", features, machine, isa)
    assert said in str(refused.value)
    assert "set model.cpu_bf16_gemm to auto or onednn" in str(refused.value)
    assert "model.dtype to float32" in str(refused.value)
    assert cpu_bf16_gemm("auto", features, machine, isa) == "onednn"  # auto never refuses


def test_the_config_refuses_an_impossible_invariant_before_any_model_loads(monkeypatch):
    monkeypatch.setattr(sections, "cpu_features", lambda: SKYLAKE_SP)
    monkeypatch.setattr(sections.platform, "machine", lambda: "x86_64")
    monkeypatch.delenv("BM_CPU_ISA", raising=False)
    with pytest.raises(ConfigError, match=r"model.cpu_bf16_gemm: invariant needs AVX512_BF16"):
        config_from_dict({"model": {"cpu_bf16_gemm": "invariant", "dtype": "bfloat16"}})
    config_from_dict({"model": {"cpu_bf16_gemm": "invariant", "device": "cuda"}})  # no CPU GEMM to choose
    config_from_dict({"model": {"cpu_bf16_gemm": "auto"}})
    monkeypatch.setattr(sections, "cpu_features", lambda: ZEN4)
    config_from_dict({"model": {"cpu_bf16_gemm": "invariant"}})
    with pytest.raises(ConfigError, match=r"model\.prepack off leaves unpacked"):
        config_from_dict({"model": {"cpu_bf16_gemm": "invariant", "prepack": "off"}})
    with pytest.raises(ConfigError, match="allowed: auto, invariant, onednn"):
        config_from_dict({"model": {"cpu_bf16_gemm": "fast"}})


@pytest.mark.parametrize(("features", "expected"), [(SAPPHIRE_RAPIDS_FULL, "onednn"), (ZEN4, "invariant")])
def test_a_bf16_models_linears_are_packed_for_the_gemm_the_cpu_gets(monkeypatch, features, expected):
    if expected == "invariant" and bf16_gemm_kernel() is None:
        pytest.skip("bm's bf16 GEMM does not build on this machine")
    if prepack_supported(torch.device("cpu"), torch.bfloat16) is not None:
        pytest.skip("oneDNN does not run bfloat16 on this CPU or torch")
    monkeypatch.setattr(model_loader, "cpu_features", lambda: features)
    monkeypatch.setattr(model_loader.platform, "machine", lambda: "x86_64")
    loaded = model_loader.load_model(ModelConfig(dtype="bfloat16", device="cpu"))
    assert loaded.cpu_bf16_gemm == expected
    kernels = {type(m.forward._kernel) for m in loaded.model.modules() if isinstance(m, torch.nn.Linear)}
    assert kernels == ({Bf16GemmKernel} if expected == "invariant" else {type(None)})
    assert load_model_cpu_bf16_gemm("onednn", features) == "onednn"


def load_model_cpu_bf16_gemm(requested: str, features: frozenset[str]) -> str | None:
    """What a bf16 tiny model loads with under ``model.cpu_bf16_gemm`` = ``requested`` (features faked
    by the caller's monkeypatch)."""
    return model_loader.load_model(
        ModelConfig(dtype="bfloat16", device="cpu", cpu_bf16_gemm=requested)
    ).cpu_bf16_gemm


def test_a_float32_model_has_no_bf16_gemm_to_choose():
    assert model_loader.load_model(ModelConfig(device="cpu", cpu_bf16_gemm="invariant")).cpu_bf16_gemm is None
