"""The engine: a model-free core loop, its executors' protocol, the typed request surface, and the seed's
Batch Manager (callbacks and InferenceRequest tensor maps) as an adapter over them.

Names load lazily, so ``import bm.engine.core`` (no torch) does not pull in the torch-backed adapter.
"""

from __future__ import annotations

import importlib
from typing import Any

_EXPORTS = {
    "BatchManager": "bm.engine.batch_manager",
    "Driver": "bm.engine.driver",
    "EngineCore": "bm.engine.core",
    "StepOutput": "bm.engine.core",
    "InferenceRequest": "bm.engine.inference_request",
    "parse_request": "bm.engine.inference_request",
    "to_core_request": "bm.engine.inference_request",
    "EngineLoop": "bm.engine.loop",
    "OfflineClient": "bm.engine.offline",
    "RequestResult": "bm.engine.offline",
    "generate": "bm.engine.offline",
    "Request": "bm.engine.request",
    "RequestError": "bm.engine.request",
    "RequestLimits": "bm.engine.request",
    "Response": "bm.engine.request",
    "validate_request": "bm.engine.validate",
}

__all__ = sorted(_EXPORTS)


def __getattr__(name: str) -> Any:
    module = _EXPORTS.get(name)
    if module is None:
        raise AttributeError(f"module 'bm.engine' has no attribute {name!r}")
    return getattr(importlib.import_module(module), name)
