"""The engine: a model-free core loop, its executors' protocol, the typed request surface, and the loop
that runs the core on a worker thread behind the Batch Manager's callbacks.

No module here imports torch, at any depth: the seed's tensor-map adapter (``BatchManager``,
``InferenceRequest``) and the torch executor an engine over a model runs on are :mod:`bm.batch_manager`,
above :mod:`bm.runtime`.
"""

from __future__ import annotations

import importlib
from typing import Any

_EXPORTS = {
    "Driver": "bm.engine.driver",
    "EngineCore": "bm.engine.core",
    "StepOutput": "bm.engine.core",
    "EngineLoop": "bm.engine.loop",
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
