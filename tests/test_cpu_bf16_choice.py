"""bfloat16 on a CPU without bf16 instructions is not a 5x trap: it runs in float32, said in one line."""

from __future__ import annotations

import logging

import pytest
import torch

from bm.config import ModelConfig, resolve_dtype_name
from bm.cpu_isa import native_bf16
from bm.runtime import model_loader

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
