"""The sections together: :class:`BmConfig`, built from a nested mapping and checked across sections, the
engine's budgets resolved per device, and the reference ``bm run --help`` prints.

Every check that needs more than one knob is here (:func:`validate`), so a config built in code, read from
a file or swept over a grid passes the same rules once, before any model loads.
"""

from __future__ import annotations

import dataclasses
import os
import platform
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from enum import Enum
from pathlib import Path
from typing import Any

from bm.config.bench import BenchConfig, validate_bench
from bm.config.engine import EngineConfig, chunked_context, engine_defaults
from bm.config.fields import ConfigError
from bm.config.kv import KvCacheConfig, PeftCacheConfig
from bm.config.model import GGUF_PRESETS, ModelConfig
from bm.config.sim import SimConfig, SweepConfig
from bm.cpu_isa import ENV_ISA, cpu_bf16_gemm, cpu_features
from bm.cpu_isa import check_environment as check_cpu_isa
from bm.preset_files import gguf_path
from bm.suggest import did_you_mean

# The source checkout (configs/ and examples/ live there, beside the package).
REPO_ROOT = Path(__file__).resolve().parents[2]


@dataclass
class BmConfig:
    """A whole configuration, one dataclass per section; build it with :func:`config_from_dict` or
    :func:`bm.config.load_config`, which check every value, rather than by hand."""

    model: ModelConfig = field(default_factory=ModelConfig)
    engine: EngineConfig = field(default_factory=EngineConfig)
    kv_cache: KvCacheConfig = field(default_factory=KvCacheConfig)
    peft_cache: PeftCacheConfig = field(default_factory=PeftCacheConfig)
    bench: BenchConfig = field(default_factory=BenchConfig)
    sim: SimConfig = field(default_factory=SimConfig)
    sweep: SweepConfig = field(default_factory=SweepConfig)

    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)


SECTIONS: dict[str, type] = {
    "model": ModelConfig,
    "engine": EngineConfig,
    "kv_cache": KvCacheConfig,
    "peft_cache": PeftCacheConfig,
    "bench": BenchConfig,
    "sim": SimConfig,
    "sweep": SweepConfig,
}


def _build_section(cls: type, name: str, data: Any) -> Any:
    if data is None:
        data = {}
    if not isinstance(data, Mapping):
        raise ConfigError(f"{name}: expected a mapping of keys, got {type(data).__name__}")
    known = {f.name: f for f in dataclasses.fields(cls)}
    values = {}
    for key, value in data.items():
        f = known.get(key)
        if f is None:
            allowed = ", ".join(known)
            hint = did_you_mean(str(key), known)
            raise ConfigError(f"{name}.{key}: unknown key{hint}; allowed keys in {name}: {allowed}")
        check = f.metadata.get("check")
        values[key] = check(f"{name}.{key}", value) if check else value
    return cls(**values)


def config_from_dict(data: Mapping[str, Any] | None) -> BmConfig:
    """Validate a nested mapping (as read from YAML) into a :class:`BmConfig`."""
    data = data or {}
    if not isinstance(data, Mapping):
        raise ConfigError(f"config: expected a mapping with sections {', '.join(SECTIONS)}")
    for key in data:
        if key not in SECTIONS:
            hint = did_you_mean(str(key), SECTIONS)
            raise ConfigError(f"{key}: unknown section{hint}; allowed sections: {', '.join(SECTIONS)}")
    cfg = BmConfig(**{name: _build_section(cls, name, data.get(name)) for name, cls in SECTIONS.items()})
    validate(cfg)
    return cfg


def resolve_engine(cfg: BmConfig, device_type: str) -> BmConfig:
    """``cfg`` with every budget key left unset filled in for ``device_type``; keys already set stay.

    The one place the per-device defaults are decided: the engine core resolves its config with it (the
    real engine from the model's device, the simulator from its hardware row's), and the CLI and
    ``bm.LLM`` resolve the same way once the model is loaded, so what a results file records is what
    ran. Resolving twice changes nothing."""
    engine = cfg.engine
    unset = {k: v for k, v in engine_defaults(engine, device_type).items() if getattr(engine, k) is None}
    if not unset:
        return cfg
    resolved = dataclasses.replace(cfg, engine=dataclasses.replace(engine, **unset))
    validate_budgets(resolved)
    return resolved


def validate_budgets(cfg: BmConfig) -> None:
    """The budget checks that need the resolved values (a set token budget is checked at load)."""
    engine, kv = cfg.engine, cfg.kv_cache
    if engine.enable_chunked_context and (engine.max_num_tokens or 0) < kv.tokens_per_block:
        raise _budget_below_one_block(engine, kv)


def _budget_below_one_block(engine: EngineConfig, kv: KvCacheConfig) -> ConfigError:
    """Chunks end on block boundaries, so a token budget under one block could never schedule a context."""
    return ConfigError(
        f"engine.max_num_tokens ({engine.max_num_tokens}) must hold at least one block "
        f"(kv_cache.tokens_per_block = {kv.tokens_per_block}) when chunked context is on"
    )


def validate(cfg: BmConfig) -> None:
    """Cross-field checks that no single knob can make alone."""
    if cfg.model.path and cfg.model.config:
        raise ConfigError(
            "model.path and model.config are exclusive: give a checkpoint or a config, not both"
        )
    if cfg.model.preset and (cfg.model.path or cfg.model.config):
        raise ConfigError(
            f"model.preset ({cfg.model.preset}) and model.{'path' if cfg.model.path else 'config'} are "
            "exclusive: a preset names the model; drop one"
        )
    clash = sorted(set(cfg.model.served_names) & set(cfg.model.lora_modules or {}))
    if clash:
        raise ConfigError(
            f"model.lora_modules: {clash[0]!r} is also a served name of the base model "
            "(model.served_model_name); a body.model must pick one, so rename the adapter"
        )
    kv, engine = cfg.kv_cache, cfg.engine
    if (
        engine.max_num_tokens is not None
        and chunked_context(engine)
        and engine.max_num_tokens < kv.tokens_per_block
    ):
        raise _budget_below_one_block(engine, kv)
    if engine.context_chunk_size is not None:
        if not chunked_context(engine):
            raise ConfigError("engine.context_chunk_size needs engine.enable_chunked_context: true")
        if engine.context_chunk_size < kv.tokens_per_block:
            raise ConfigError(
                f"engine.context_chunk_size ({engine.context_chunk_size}) must be at least one block "
                f"(kv_cache.tokens_per_block = {kv.tokens_per_block})"
            )
    if kv.sink_token_length and kv.max_attention_window is None:
        raise ConfigError(
            "kv_cache.sink_token_length needs kv_cache.max_attention_window; set a window or drop the sinks"
        )
    windows = kv.max_attention_window
    smallest = min(windows) if isinstance(windows, list) else windows
    if smallest is not None and kv.sink_token_length >= smallest:
        raise ConfigError(
            f"kv_cache.sink_token_length ({kv.sink_token_length}) must be smaller than "
            f"kv_cache.max_attention_window ({smallest})"
        )
    if kv.max_tokens is not None and kv.max_tokens < kv.tokens_per_block:
        raise ConfigError(
            f"kv_cache.max_tokens ({kv.max_tokens}) is smaller than one block "
            f"(kv_cache.tokens_per_block = {kv.tokens_per_block})"
        )
    if engine.executor == "sim" and not (cfg.model.config or cfg.model.path):
        raise ConfigError(_sim_needs_shape(cfg.model.preset))
    if engine.executor == "sim" and not cfg.bench.ignore_eos:
        raise ConfigError(
            "bench.ignore_eos is false (--respect-eos), but the simulator has no logits to tell where a "
            "model would end: it runs every request to its dataset's length; drop --respect-eos (or set "
            "bench.ignore_eos: true) to simulate, or run --executor torch"
        )
    validate_bench(cfg.bench)
    try:  # BM_CPU_ISA, the C kernels' instruction set: bm.cpu_isa owns the rule, config only refuses early
        check_cpu_isa()
    except ValueError as exc:
        raise ConfigError(str(exc)) from None
    _check_cpu_bf16_gemm(cfg.model)
    quantization = cfg.model.quantization
    if quantization == "gguf" and engine.executor == "sim":
        raise ConfigError(
            "model.quantization: gguf: the simulator prices a config.json's shape, not a GGUF file's blocks; "
            "set model.quantization: auto (full width) or int8 with engine.executor: sim"
        )
    if quantization == "gguf" and cfg.model.preset not in GGUF_PRESETS and gguf_path(cfg.model.path) is None:
        raise ConfigError(
            f"model.quantization: gguf runs a GGUF file's own blocks (a .gguf model.path, or the preset "
            f"{', '.join(GGUF_PRESETS)}); {cfg.model.label!r} is neither: set model.quantization: auto"
        )


def _check_cpu_bf16_gemm(model: ModelConfig) -> None:
    """``model.cpu_bf16_gemm: invariant`` refused before anything loads where it cannot run: on a CPU
    without its kernel's build (bm.cpu_isa.cpu_bf16_gemm says why), or with the weights left unpacked
    (the kernel reads its own packed copy). A model placed on CUDA has no CPU GEMM to choose."""
    if model.cpu_bf16_gemm != "invariant" or model.device.startswith("cuda"):
        return
    try:
        cpu_bf16_gemm("invariant", cpu_features(), platform.machine(), os.environ.get(ENV_ISA), model.prepack)
    except ValueError as exc:
        raise ConfigError(str(exc)) from None


def _sim_needs_shape(preset: str | None) -> str:
    """The simulator prices a model's shape and loads no weights, so a preset alone does not do; point
    to the preset's shape config where bm ships one."""
    message = "engine.executor: sim needs the model's shape: give --model-config CFG.json (model.config)"
    if preset is None:
        return message
    shape = Path("configs") / "models" / f"{preset}-shape.json"
    for root in (Path.cwd(), REPO_ROOT):
        if (root / shape).is_file():
            where = shape if root == Path.cwd() else root / shape
            return (
                f"engine.executor: sim loads no weights, so it needs the model's shape, not the preset "
                f"{preset!r}: use --model-config {where} instead of --model {preset}"
            )
    return message + f"; the preset {preset!r} gives weights, not a shape"


def config_reference(sections: Iterable[str] | None = None) -> str:
    """Every knob of ``sections`` (default: all) with its default and meaning, for ``--help`` and the
    README. Defaults print as a user writes them in YAML (``inflight_fused``, not the enum's repr); a
    knob whose default is unset shows none, its help says what unset means."""
    lines = []
    for name, cls in SECTIONS.items():
        if sections is not None and name not in sections:
            continue
        lines.append(f"{name}:")
        for f in dataclasses.fields(cls):
            default = f.default if f.default is not dataclasses.MISSING else None
            shown = "" if default is None else f" (default {_plain(default)})"
            lines.append(f"  {f.name}{shown}: {f.metadata.get('help', '')}")
    return "\n".join(lines)


def _plain(value: Any) -> str:
    """``value`` as YAML spells it: an enum by its value, booleans lower case, strings unquoted."""
    if isinstance(value, Enum):
        value = value.value
    if isinstance(value, bool):
        return "true" if value else "false"
    return str(value)
