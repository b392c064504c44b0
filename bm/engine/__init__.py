"""The engine: a model-free core loop, its executors' protocol, the typed request surface, and the loop
that runs the core on a worker thread behind the Batch Manager's callbacks.

No module here imports torch, at any depth: the seed's tensor-map adapter (``BatchManager``,
``InferenceRequest``) and the torch executor an engine over a model runs on are :mod:`bm.batch_manager`,
above :mod:`bm.runtime`.

Grouped by job, each subpackage importing only those listed before it: :mod:`~bm.engine.requests` (the
typed request, its fields and checks), :mod:`~bm.engine.execution` (the executor protocol, the fake
executor, the PEFT cache), :mod:`~bm.engine.outputs` (responses and stats), :mod:`~bm.engine.step` (the
core loop) and :mod:`~bm.engine.driving` (the driver, the engine loop and its worker thread).
"""

from __future__ import annotations

import importlib
from typing import Any

_EXPORTS = {
    "Driver": "bm.engine.driving.driver",
    "EngineCore": "bm.engine.step.core",
    "StepOutput": "bm.engine.step.core",
    "EngineLoop": "bm.engine.driving.loop",
    "Request": "bm.engine.requests.request",
    "RequestError": "bm.engine.requests.request",
    "RequestLimits": "bm.engine.requests.request",
    "Response": "bm.engine.requests.request",
    "validate_request": "bm.engine.requests.validate",
}

__all__ = sorted(_EXPORTS)


def __getattr__(name: str) -> Any:
    module = _EXPORTS.get(name)
    if module is None:
        raise AttributeError(f"module 'bm.engine' has no attribute {name!r}")
    return getattr(importlib.import_module(module), name)
