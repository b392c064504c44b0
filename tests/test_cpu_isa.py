"""The choice of each C kernel's instruction-set build (bm.cpu_isa), with CPU features faked:
every branch of the dispatch is pinned here, whatever CPU runs the tests."""

from __future__ import annotations

import pytest

from bm import cpu_isa
from bm.cpu_isa import KERNEL_ISAS, bf16_kv_cache, choose_isa, supported_isas

# Linux /proc/cpuinfo flag names
SAPPHIRE_RAPIDS = frozenset(
    [
        "sse4_2",
        "avx",
        "avx2",
        "fma",
        "f16c",
        "avx512f",
        "avx512dq",
        "avx512cd",
        "avx512bw",
        "avx512vl",
        "avx512_bf16",
        "avx512_vnni",
        "amx_bf16",
    ]
)
# AVX-512 F/BW/VL/DQ without AVX512_BF16 or AMX (Skylake-SP)
SKYLAKE_SP = SAPPHIRE_RAPIDS - {"avx512_bf16", "amx_bf16"}
HASWELL = frozenset(["sse4_2", "avx", "avx2", "fma", "f16c"])
SANDY_BRIDGE = frozenset(["sse4_2", "avx"])
# AVX-512 F without BW/VL (Knights Landing): not enough for the avx512 build
KNIGHTS_LANDING = frozenset(["avx", "avx2", "fma", "avx512f", "avx512cd"])


def test_an_avx512_cpu_gets_every_build_best_first():
    assert supported_isas(SAPPHIRE_RAPIDS, "x86_64") == ("avx512", "avx2", "scalar")
    assert supported_isas(HASWELL, "x86_64") == ("avx2", "scalar")
    assert supported_isas(SANDY_BRIDGE, "x86_64") == ("scalar",)
    assert supported_isas(KNIGHTS_LANDING, "x86_64") == ("avx2", "scalar")


@pytest.mark.parametrize("kernel", sorted(set(KERNEL_ISAS) - {"bf16_gemm"}))
def test_each_kernel_gets_the_best_build_it_has_code_for(kernel):
    best = "avx512" if "avx512" in KERNEL_ISAS[kernel] else "avx2"
    assert choose_isa(kernel, SAPPHIRE_RAPIDS, "x86_64") == best
    assert choose_isa(kernel, HASWELL, "x86_64") == "avx2"
    assert choose_isa(kernel, SANDY_BRIDGE, "x86_64") == "scalar"


@pytest.mark.parametrize("kernel", sorted(KERNEL_ISAS))
def test_each_vector_build_a_kernel_lists_has_a_vector_path_in_its_source(kernel):
    """A listed avx2 or avx512 build whose source has no branch for it compiles the plain C loops under
    that name: the int8 and group GEMMs' AVX2 builds once did, 50-100x slower than their figures."""
    import re
    from pathlib import Path

    source = (Path(cpu_isa.__file__).parent / "runtime" / "native" / f"{kernel}.c").read_text()
    for isa, switch in (("avx2", "BM_HAVE_AVX2"), ("avx512", "BM_HAVE_AVX512")):
        if isa in KERNEL_ISAS[kernel]:
            assert re.search(rf"#\s*(el)?if\b[^\n]*\b{switch}\b", source), f"{kernel}.c has no {switch} path"


def test_the_bf16_gemm_gets_its_avx512_bf16_build_only_where_the_cpu_has_avx512_bf16():
    assert choose_isa("bf16_gemm", SAPPHIRE_RAPIDS, "x86_64") == "avx512_bf16"
    assert choose_isa("bf16_gemm", SAPPHIRE_RAPIDS, "x86_64", "avx512") == "avx512_bf16"
    assert choose_isa("bf16_gemm", SAPPHIRE_RAPIDS, "x86_64", "avx2") == "scalar"  # capped: no code
    assert choose_isa("bf16_gemm", SKYLAKE_SP, "x86_64") == "scalar"
    assert choose_isa("bf16_gemm", HASWELL, "x86_64") == "scalar"
    assert "-mavx512bf16" in cpu_isa.isa_flags("avx512_bf16")
    assert not any("bf16" in f for f in cpu_isa.isa_flags("avx512"))
    assert "avx512_bf16" not in cpu_isa.ISAS  # a kernel's own variant, not a BM_CPU_ISA value


def test_lora_has_no_avx512_code_so_it_runs_its_avx2_build_on_avx512_cpus():
    assert choose_isa("lora_delta", SAPPHIRE_RAPIDS, "x86_64", "avx512") == "avx2"
    assert choose_isa("small_gemm", SAPPHIRE_RAPIDS, "x86_64", "avx512") == "avx512"


@pytest.mark.parametrize(("requested", "expected"), [("avx2", "avx2"), ("scalar", "scalar"), ("auto", "avx512"),
                                                     (None, "avx512"), ("", "avx512"), (" AVX2 ", "avx2")])  # fmt: skip
def test_bm_cpu_isa_caps_the_choice_on_a_cpu_that_has_more(requested, expected):
    assert choose_isa("small_gemm", SAPPHIRE_RAPIDS, "x86_64", requested) == expected


def test_forcing_a_build_the_cpu_cannot_run_names_the_missing_features():
    with pytest.raises(ValueError, match=r"BM_CPU_ISA=avx512, but this CPU lacks avx512bw, .*avx2, scalar"):
        choose_isa("small_gemm", HASWELL, "x86_64", "avx512")
    with pytest.raises(ValueError, match="lacks avx2, fma"):
        choose_isa("elementwise", SANDY_BRIDGE, "x86_64", "avx2")


def test_an_unknown_value_is_refused_with_the_choices():
    with pytest.raises(ValueError, match=r"BM_CPU_ISA='sse9' .* auto, avx512, avx2, scalar"):
        choose_isa("small_gemm", SAPPHIRE_RAPIDS, "x86_64", "sse9")


def test_other_architectures_build_one_native_variant_and_refuse_x86_settings():
    assert supported_isas(frozenset({"neon", "asimd"}), "aarch64") == ("native",)
    assert choose_isa("small_gemm", frozenset({"asimd"}), "aarch64") == "native"
    with pytest.raises(ValueError, match="x86-64 setting"):
        choose_isa("small_gemm", frozenset({"asimd"}), "aarch64", "avx2")


def test_each_build_is_compiled_with_explicit_flags_so_avx2_can_be_forced_on_an_avx512_machine():
    assert "-march=native" not in cpu_isa.isa_flags("avx2")
    assert {"-mavx2", "-mfma"} <= set(cpu_isa.isa_flags("avx2"))
    assert not any(f.startswith("-mavx512") for f in cpu_isa.isa_flags("avx2"))
    assert {"-mavx512f", "-mavx512bw", "-mavx512vl", "-mfma"} <= set(cpu_isa.isa_flags("avx512"))
    assert not any(f.startswith(("-mavx", "-mfma")) for f in cpu_isa.isa_flags("scalar"))


def test_the_environment_variable_is_read_at_each_load(monkeypatch):
    monkeypatch.setattr(cpu_isa, "cpu_features", lambda: SAPPHIRE_RAPIDS)
    monkeypatch.setattr(cpu_isa.platform, "machine", lambda: "x86_64")
    monkeypatch.setenv(cpu_isa.ENV_ISA, "avx2")
    assert cpu_isa.kernel_isa("small_gemm") == "avx2"
    monkeypatch.delenv(cpu_isa.ENV_ISA)
    assert cpu_isa.kernel_isa("small_gemm") == "avx512"
    assert cpu_isa.kernel_isa("small_gemm", "scalar") == "scalar"


def test_the_kernel_cache_keeps_one_file_per_build():
    """The variant is part of the cached library's name and hash: forcing AVX2 never loads the AVX-512
    build (or the reverse)."""
    from pathlib import Path

    from bm.runtime.native import build

    source = Path(build.__file__).parent / "elementwise.c"
    keys = {isa: build._cache_key(source, "cc", None, isa) for isa in ("avx512", "avx2", "scalar")}
    assert len(set(keys.values())) == 3


def test_a_changed_instruction_set_header_rebuilds_every_kernel(tmp_path):
    """Every source includes isa.h (the variant's BM_HAVE_* switches): a cached build of any kernel must
    not survive a change to it."""
    import shutil
    from pathlib import Path

    from bm.runtime.native import build

    native = Path(build.__file__).parent
    for path in [*native.glob("*.c"), *native.glob("*.h")]:
        shutil.copy(path, tmp_path / path.name)
    sources = sorted(tmp_path.glob("*.c"))
    assert all('#include "isa.h"' in s.read_text() for s in sources)
    before = [build._cache_key(s, "cc", None, "avx2") for s in sources]
    header = tmp_path / "isa.h"
    header.write_text(header.read_text() + "\n/* changed */\n")
    after = [build._cache_key(s, "cc", None, "avx2") for s in sources]
    assert all(a != b for a, b in zip(before, after, strict=True))


def test_a_bad_bm_cpu_isa_is_a_config_error_before_anything_loads(monkeypatch):
    from bm.config import ConfigError, config_from_dict

    monkeypatch.setenv(cpu_isa.ENV_ISA, "sse9")
    with pytest.raises(ConfigError, match="BM_CPU_ISA='sse9' is not an instruction set"):
        config_from_dict({"model": {"device": "cpu"}})


def test_the_cpu_isa_module_loads_without_torch():
    """bm.config imports it, and bm run checks its config before torch loads (seconds)."""
    import subprocess
    import sys

    code = "import sys, bm.config; print('torch' in sys.modules)"
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert done.stdout.strip() == "False"


def test_a_bf16_kv_cache_goes_with_the_avx512_attention_builds():
    """A bf16 model's cache stays bf16 where both attention kernels load the AVX-512 build (the one with
    the bf16 kernels: widening is a shift, so AVX-512 F/BW is all it needs, with or without AVX512_BF16);
    float32 where the AVX2 or scalar builds run, forced or not, and off x86-64."""
    assert bf16_kv_cache(SAPPHIRE_RAPIDS, "x86_64")
    assert bf16_kv_cache(SKYLAKE_SP, "x86_64")
    assert bf16_kv_cache(SAPPHIRE_RAPIDS, "x86_64", "avx512")
    assert not bf16_kv_cache(SAPPHIRE_RAPIDS, "x86_64", "avx2")
    assert not bf16_kv_cache(SAPPHIRE_RAPIDS, "x86_64", "scalar")
    assert not bf16_kv_cache(KNIGHTS_LANDING, "x86_64")
    assert not bf16_kv_cache(HASWELL, "x86_64")
    assert not bf16_kv_cache(SANDY_BRIDGE, "x86_64")
    assert not bf16_kv_cache(frozenset({"asimd", "bf16"}), "aarch64")


def test_the_bf16_kv_cache_choice_follows_bm_cpu_isa_at_each_load(monkeypatch):
    """The runtime's choice (bm.runtime.native.kv_cache_dtype) reads the same faked features and
    BM_CPU_ISA: the bf16 cache path under AVX-512, the float32 fallback under a forced AVX2."""
    torch = pytest.importorskip("torch")
    from bm.runtime import native

    monkeypatch.setattr(native, "cpu_features", lambda: HASWELL)
    assert native.kv_cache_dtype(torch.device("cpu"), torch.bfloat16) == torch.float32
    if "avx512" not in cpu_isa.machine_isas() or native.paged_decode_kernel() is None:
        return  # the kernels this CPU builds cannot show the bf16 side
    monkeypatch.setattr(native, "cpu_features", lambda: SAPPHIRE_RAPIDS)
    monkeypatch.setattr(native.platform, "machine", lambda: "x86_64")
    assert native.kv_cache_dtype(torch.device("cpu"), torch.bfloat16) == torch.bfloat16
    monkeypatch.setenv(cpu_isa.ENV_ISA, "avx2")
    assert native.kv_cache_dtype(torch.device("cpu"), torch.bfloat16) == torch.float32
