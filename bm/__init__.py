"""bm: offline LLM batch generation and benchmarking around a Python Batch Manager.

The top-level names are imported lazily so that ``import bm.kv`` or ``import bm.scheduling`` (pure
Python, used by simulations) does not pull in torch and transformers.
"""

from __future__ import annotations

from importlib import import_module
from typing import Any

_EXPORTS = {
    "LLM": "bm.llm",
    "SamplingParams": "bm.llm_params",
    "RequestOutput": "bm.llm_params",
    "CompletionOutput": "bm.llm_params",
    "Logprob": "bm.llm_params",
    "StructuredOutputsParams": "bm.llm_params",
    "GuidedDecodingParams": "bm.llm_params",
    "InvalidParameterError": "bm.llm_params",
    "LoRARequest": "bm.llm_types",
    "TextPrompt": "bm.llm_types",
    "TokensPrompt": "bm.llm_types",
    "BeamSearchParams": "bm.llm_types",
    "BeamSearchOutput": "bm.llm_types",
    "BeamSearchSequence": "bm.llm_types",
    "RequestMetrics": "bm.llm_types",
    "BmConfig": "bm.config",
    "ConfigError": "bm.config",
    "load_config": "bm.config",
    "BatchManager": "bm.batch_manager",
    "InferenceRequest": "bm.batch_manager",
    "OfflineClient": "bm.batch_manager",
    "generate": "bm.batch_manager",
    "FinishReason": "bm.scheduling",
}

__all__ = ["__version__", *_EXPORTS]


def _version() -> str:
    """The installed version. Read on first use: importlib.metadata costs about 0.2 s, and the ``bm``
    command installs its signal handlers only once ``import bm`` is done (see bm.cli.entry)."""
    from importlib.metadata import PackageNotFoundError, version

    try:
        return version("bm")
    except PackageNotFoundError:  # a source tree that is not installed
        return "0.0.0+source"


# Names that went, with what replaces them (said in the AttributeError).
_GONE = {
    "RequestResult": "; generate() and OfflineClient.results hold each request's final bm.engine.Response, "
    "which has the same fields (output_ids, finish_reason, error, ok, the counters)",
}


def __getattr__(name: str) -> Any:
    if name == "__version__":
        globals()["__version__"] = found = _version()
        return found
    module = _EXPORTS.get(name)
    if module is None:
        raise AttributeError(f"module 'bm' has no attribute {name!r}{_GONE.get(name, '')}")
    return getattr(import_module(module), name)
