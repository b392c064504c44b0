"""A checkpoint's ``generation_config.json`` as vLLM takes it: the sampling defaults of a request that
sets none of its own.

vLLM's ``LLM`` and its OpenAI server (``run-batch`` included) start every request from the model's
``generation_config.json`` (``--generation-config auto``), from vLLM's own ``SamplingParams`` defaults
(``vllm``), or from the file in another directory. bm reads it in one place, here, so ``bm.LLM`` and
``bm run``'s OpenAI batch lines give a file or script written for vLLM the same default. Plain Python
and file-only (no torch, no transformers): it runs before the model loads, so a value bm cannot run is
refused then, naming the file.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from bm.config.model import GENERATION_CHOICES, is_generation_choice
from bm.hub_cache import local_dir
from bm.llm_params import InvalidParameterError, SamplingParams

__all__ = ["GENERATION_CHOICES", "GENERATION_KEYS", "generation_defaults", "is_generation_choice"]

GENERATION_FILE = "generation_config.json"
# generation_config.json's keys vLLM takes as sampling defaults -> the SamplingParams (and body) name.
GENERATION_KEYS = {
    "temperature": "temperature",
    "top_p": "top_p",
    "top_k": "top_k",
    "min_p": "min_p",
    "repetition_penalty": "repetition_penalty",
    "max_new_tokens": "max_tokens",
}
VLLM_TEMPERATURE = 1.0  # vLLM's SamplingParams default, where the checkpoint says none


def generation_defaults(choice: str, model_dir: str | None) -> dict[str, Any]:
    """The sampling defaults ``choice`` asks for, under ``SamplingParams``' names: ``"auto"``, those of
    ``model_dir``'s ``generation_config.json`` (a hub id is looked up in the local Hugging Face cache);
    a directory, those of its file; ``"vllm"``, none (vLLM's own defaults then apply). A model without
    such a file (a preset, random weights) has none. A value bm cannot run raises
    :class:`~bm.llm_params.InvalidParameterError` naming the file and the way out."""
    if choice == "vllm":
        return {}
    folder = (
        local_dir(model_dir) if choice == "auto" and model_dir else (None if choice == "auto" else choice)
    )
    path = Path(folder) / GENERATION_FILE if folder else None
    if path is None or not path.is_file():
        return {}
    try:
        data = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, ValueError) as exc:
        raise InvalidParameterError(f"generation_config: cannot read {path}: {exc}") from None
    if not isinstance(data, dict):
        raise InvalidParameterError(f"generation_config: {path} holds no JSON object")
    defaults = {name: data[key] for key, name in GENERATION_KEYS.items() if data.get(key) is not None}
    try:  # judged now, naming the file, not at every request
        SamplingParams(**defaults)
    except InvalidParameterError as exc:
        raise InvalidParameterError(
            f"generation_config: {path} asks for {exc}; fix the file, or pass generation_config='vllm' "
            "(bm run: --generation-config vllm)"
        ) from None
    return defaults
