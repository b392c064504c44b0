"""The seed's Batch Manager over a real model: the adapter above the torch-free engine.

:class:`BatchManager` is :class:`bm.engine.driving.loop.EngineLoop` with the seed's ``InferenceRequest``
tensor maps and ``send_response`` tensors at its edge, :func:`generate` and :class:`OfflineClient` run a list
of requests (typed or seed) to completion, and :func:`torch_executor` is the step from a loaded model to the
executor every engine over it runs on. They import torch and :mod:`bm.runtime`, which is why they sit
here and not in :mod:`bm.engine` (which imports no torch at any depth). ``bm.BatchManager``,
``bm.InferenceRequest``, ``bm.OfflineClient`` and ``bm.generate`` are these.
"""

from __future__ import annotations

import importlib
from typing import Any

_EXPORTS = {
    "BatchManager": "bm.batch_manager.manager",
    "InferenceRequest": "bm.batch_manager.inference_request",
    "parse_request": "bm.batch_manager.inference_request",
    "to_core_request": "bm.batch_manager.inference_request",
    "OfflineClient": "bm.batch_manager.offline",
    "generate": "bm.batch_manager.offline",
    "torch_executor": "bm.batch_manager.executors",
}

__all__ = sorted(_EXPORTS)


def __getattr__(name: str) -> Any:
    module = _EXPORTS.get(name)
    if module is None:
        raise AttributeError(f"module 'bm.batch_manager' has no attribute {name!r}")
    return getattr(importlib.import_module(module), name)
