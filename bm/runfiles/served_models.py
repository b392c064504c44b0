"""What a batch line's ``body.model`` may name, as vLLM serves models: the base model under its served
names (``--served-model-name``) and PEFT adapters by name (``--lora-modules``). Apart from the line
reader (:mod:`bm.runfiles.openai_batch`) because ``bm run --ray``'s replicas and block readers route lines
too and need nothing else of it. Plain Python (no torch).
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from bm.config import ModelConfig
from bm.generation_config import generation_defaults
from bm.workloads.request import RowError


class ModelNotFoundError(RowError):
    """A line's ``body.model`` names neither a served name of the base model nor an adapter: answered
    with HTTP 404, as OpenAI and vLLM answer a request for a model they do not serve."""


@dataclass(frozen=True)
class ServedModels:
    """What a line's ``body.model`` may name, as vLLM serves them: the base model under any of its
    served names (``--served-model-name``), or a PEFT adapter by its ``--lora-modules`` name. A line
    naming anything else is refused (404), never answered by another model. ``routes`` False (``bm
    bench``, which replays prompts for timing): any name is the base model's. ``defaults``: the sampling
    values a line that sets none of them gets besides vLLM's temperature 1.0, as vLLM's server starts
    each request from its ``--generation-config`` (``model.generation_config``;
    :func:`bm.generation_config.generation_defaults`), adapters included."""

    names: tuple[str, ...]
    adapters: Mapping[str, str] = field(default_factory=dict)
    routes: bool = True
    defaults: Mapping[str, Any] = field(default_factory=dict)

    @classmethod
    def of(cls, model: ModelConfig) -> ServedModels:
        """The names a run over ``model`` (the config's ``model`` section) answers to, and its sampling
        defaults (a generation_config.json bm cannot run raises ``InvalidParameterError``, a
        ``ValueError``, before the model loads)."""
        adapters = {name: str(Path(d).resolve()) for name, d in (model.lora_modules or {}).items()}
        defaults = generation_defaults(model.generation_config, model.path)
        return cls(tuple(model.served_names), adapters, defaults=defaults)

    def route(self, model: str | None) -> tuple[str | None, str | None]:
        """(the name the response gives, the adapter directory or None) for a line's ``body.model``; a
        line naming none is the base model's, as vLLM answers it. Raises :class:`ModelNotFoundError`."""
        if not self.routes:
            return model, None
        if model is None or model in self.names:
            return (model or self.names[0]), None
        if model in self.adapters:
            return model, self.adapters[model]
        served = ", ".join(repr(n) for n in self.names)
        adapters = ", ".join(repr(n) for n in self.adapters)
        where = f"the base model is served as {served} (--served-model-name)" + (
            f" and the adapters as {adapters} (--lora-modules)" if adapters else ""
        )
        raise ModelNotFoundError(
            f"body.model: {model!r} is not served by this run; {where}. Name one of them, or serve this "
            "name with --served-model-name NAME (the base model) or --lora-modules NAME=DIR (an adapter); "
            "config keys model.served_model_name and model.lora_modules"
        )


ANY_MODEL = ServedModels(("bm",), routes=False)
