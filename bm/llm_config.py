"""``bm.LLM(...)``'s keywords: vLLM's engine arguments mapped onto bm's config keys, and the config built.

Why a table: a vLLM user types ``LLM(model, max_model_len=512, gpu_memory_utilization=0.8)``; each such
name lands on one key of :mod:`bm.config` (listed once, here, and pinned by a test), and the config
loader checks the values as it checks ``bm run --set``. A vLLM name bm has no knob for is accepted when
its value asks for what bm does anyway (``trust_remote_code=False``) and otherwise refused with the bm
way (:data:`bm.config.vllm.VLLM_UNSUPPORTED`); any other unknown keyword is refused with the nearest name.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, fields
from pathlib import Path
from typing import Any

from bm.config import MODEL_PRESETS, BmConfig, ConfigError, load_config
from bm.config.vllm import ENFORCE_EAGER_KEY, VLLM_ENGINE_KEYS, VLLM_UNSUPPORTED, NotInBm
from bm.generation_config import is_generation_choice
from bm.llm_params import InvalidParameterError, refuse_unknown

# vLLM's LLM(...) / EngineArgs name -> the bm config key it sets (the table the CLI's flags share).
ENGINE_ARGS: dict[str, str | None] = {
    **VLLM_ENGINE_KEYS,
    "max_logprobs": None,  # bm returns up to 20 top log probs per position, OpenAI's bound; nothing to set
}
# vLLM names bm takes with a meaning of their own (read by LLM itself, not the config); max_loras sets
# peft_cache.max_adapters, and model_config=PATH is bm's model.config (random weights, --model-config).
OWN_ARGS = (
    "seed",
    "tensor_parallel_size",
    "enable_lora",
    "max_loras",
    "max_lora_rank",
    "generation_config",
    "model_config",
)
# vLLM's LoRA engine arguments bm has no knob for (each accepted at the value that asks for what bm does).
VLLM_LORA_ONLY: dict[str, NotInBm] = {
    "max_cpu_loras": NotInBm(
        "bm reads each adapter directory once per process and keeps max_loras of them loaded",
        "drop it; max_loras= bounds the loaded adapters",
        inert=(None,),
    ),
    "fully_sharded_loras": NotInBm("bm.LLM runs in one process, unsharded", "drop it", inert=(False,)),
    "lora_dtype": NotInBm(
        "bm runs adapters in the model's dtype", "choose it with dtype=", inert=(None, "auto")
    ),
}
# vLLM's dtype names (and torch's) -> model.dtype; anything else is refused naming these.
DTYPE_ALIASES = {
    "auto": "auto",
    "half": "float16",
    "float16": "float16",
    "fp16": "float16",
    "bfloat16": "bfloat16",
    "bf16": "bfloat16",
    "float": "float32",
    "float32": "float32",
    "fp32": "float32",
}


@dataclass(frozen=True)
class LibraryOptions:
    """The keywords ``bm.LLM`` reads itself rather than the config (vLLM's meaning of each)."""

    enable_lora: bool = False
    max_lora_rank: int | None = None  # None: no bound (vLLM's default is 16; bm serves any rank)
    generation_config: str = "auto"  # "auto": the checkpoint's; "vllm": none; else a directory


# vLLM's enforce_eager=True: no CUDA graphs (bm's model.cuda_graphs).
_EAGER = {True: "off", False: "auto"}


def build_config(
    model: str | None, config: str | Path | BmConfig | None, options: dict[str, Any]
) -> BmConfig:
    """A validated config from a file or object plus keyword overrides (see :class:`bm.LLM`): vLLM's
    names (:data:`ENGINE_ARGS`), ``model`` section keys (``device="cpu"``) and sections as mappings
    (``engine={"max_batch_size": 64}``). Raises :class:`InvalidParameterError`."""
    from bm.config import ModelConfig, config_from_dict

    model_keys = {f.name for f in fields(ModelConfig)} - {"seed"}  # seed= is vLLM's: sampling
    sections = set(BmConfig.__dataclass_fields__)
    overrides: dict[str, Any] = {}
    if isinstance(model, Mapping):  # model={"preset": ..., "seed": ...}: the model section itself
        options = {**options, "model": {**model, **options.get("model", {})}}
    elif model is not None:
        if not isinstance(model, str):
            raise InvalidParameterError(
                f"LLM(model=...): expected a preset name, a checkpoint directory or a mapping of model "
                f"keys, got {type(model).__name__}"
            )
        preset = model in MODEL_PRESETS and not Path(model).exists()
        overrides["model.preset" if preset else "model.path"] = model
    for name, value in options.items():
        if name == "dtype":
            overrides["model.dtype"] = dtype_name(value)
        elif name == "max_loras":
            overrides["peft_cache.max_adapters"] = value
        elif name == "model_config":
            overrides["model.config"] = value
        elif name in ENGINE_ARGS:
            if ENGINE_ARGS[name] is not None:
                overrides[ENGINE_ARGS[name]] = value
        elif name == "enforce_eager":
            if not isinstance(value, bool):
                raise InvalidParameterError(f"LLM(enforce_eager=...): expected True or False, got {value!r}")
            overrides[ENFORCE_EAGER_KEY] = _EAGER[value]
        elif name in model_keys:
            overrides[f"model.{name}"] = value
        elif name in sections and isinstance(value, Mapping):
            overrides.update({f"{name}.{key}": v for key, v in value.items()})
        else:  # a vLLM name bm lacks (accepted when it asks for what bm does), or a typo
            known = [*ENGINE_ARGS, "enforce_eager", *OWN_ARGS, *model_keys, *sections]
            refuse_unknown(
                "LLM",
                name,
                value,
                known,
                {**VLLM_UNSUPPORTED, **VLLM_LORA_ONLY},
                note=f"; LLM takes vLLM's engine arguments ({', '.join(ENGINE_ARGS)}, enforce_eager, seed, "
                "tensor_parallel_size), model keys (device=, dtype=, ...) and config sections as mappings, "
                "e.g. engine={'max_batch_size': 64}",
            )
    try:
        if isinstance(config, BmConfig) and not overrides:
            return config  # already validated (the CLI builds its config from files and flags)
        if isinstance(config, BmConfig):
            data = config.to_dict()
            for dotted, value in overrides.items():
                section, _, key = dotted.partition(".")
                data.setdefault(section, {})[key] = value
            return config_from_dict(data)
        return load_config(config, overrides)
    except InvalidParameterError:
        raise
    except ConfigError as exc:
        raise InvalidParameterError(_vllm_names(str(exc))) from None


def library_options(options: dict[str, Any]) -> LibraryOptions:
    """Take ``LLM``'s own keywords out of ``options`` (in place) and check them."""
    enable = options.pop("enable_lora", False)
    rank = options.pop("max_lora_rank", None)
    generation = options.pop("generation_config", "auto")
    if not isinstance(enable, bool):
        raise InvalidParameterError(f"LLM(enable_lora=...): expected True or False, got {enable!r}")
    if rank is not None and (isinstance(rank, bool) or not isinstance(rank, int) or rank < 1):
        raise InvalidParameterError(f"LLM(max_lora_rank=...): expected an integer >= 1, got {rank!r}")
    if not isinstance(generation, (str, Path)):
        raise InvalidParameterError(
            f"LLM(generation_config=...): expected 'auto', 'vllm' or a directory, got {generation!r}"
        )
    if not is_generation_choice(generation):
        raise InvalidParameterError(
            f"LLM(generation_config={str(generation)!r}): not a directory; give 'auto' (the checkpoint's "
            "generation_config.json), 'vllm' (vLLM's SamplingParams defaults) or a directory holding one"
        )
    return LibraryOptions(enable, rank, str(generation))


def dtype_name(value: Any) -> str:
    """vLLM's ``dtype`` (a name or a ``torch.dtype``) as bm's ``model.dtype``; one bm cannot run is
    refused naming the ones it can."""
    name = str(value).removeprefix("torch.") if not isinstance(value, str) else value
    if name in DTYPE_ALIASES:
        return DTYPE_ALIASES[name]
    raise InvalidParameterError(
        f"LLM(dtype={value!r}): bm runs weights in float32, bfloat16 or float16; give one of "
        f"{', '.join(repr(k) for k in DTYPE_ALIASES)} (or torch.float32 / torch.bfloat16 / torch.float16)"
    )


def _vllm_names(message: str) -> str:
    """A config message that also names the vLLM keyword a user may have typed for the key."""
    for name, key in ENGINE_ARGS.items():
        if key is not None and message.startswith(f"{key}:"):
            return f"{name} ({key}){message[len(key) :]}"
    return message


def check_tensor_parallel(size: Any) -> None:
    """``tensor_parallel_size`` must be the ranks this process already runs in.

    ``bm.LLM`` runs in the process that builds it and starts no ranks: bm's tensor parallelism is a
    set of processes that ``bm run`` / ``bm bench`` start (or join under ``torchrun``), in which rank 0
    drives the engine and every other rank serves its shard of each forward (bm.distributed.cli). A
    script's ``LLM(tensor_parallel_size=2)`` would run every rank as a driver, so it is refused before
    anything loads, naming the commands that do run a split model (docs/parallel.md)."""
    from bm.parallel.layout import current_layout

    have = current_layout().tensor_parallel
    if isinstance(size, bool) or not isinstance(size, int) or size < 1:
        raise InvalidParameterError(f"LLM(tensor_parallel_size=...): expected an integer >= 1, got {size!r}")
    if size != have:
        raise InvalidParameterError(
            f"LLM(tensor_parallel_size={size}): bm.LLM runs in this one process ({have} tensor-parallel "
            f"rank(s)) and cannot start ranks; a model split over {size} ranks runs through the command "
            f"line: `bm run PROMPTS.jsonl --model MODEL --tensor-parallel {size}` (bm starts the ranks; "
            f"under torchrun: `torchrun --nproc-per-node {size} -m bm run PROMPTS.jsonl --model MODEL "
            f"--tensor-parallel {size}`) or `bm bench DATASET --model MODEL --tp {size}`; see "
            f"docs/parallel.md. Leave tensor_parallel_size unset (or {have}) here"
        )
