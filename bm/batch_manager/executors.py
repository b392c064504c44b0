"""The torch executor an engine over a model runs on: the one step from a loaded model to an executor.

It lives here, above :mod:`bm.runtime`, and not in :mod:`bm.engine`, because the engine is torch-free at
any depth: its loop and core take an executor and never choose one. Everything that runs the real model
(the seed's :class:`~bm.batch_manager.manager.BatchManager`, :func:`~bm.batch_manager.offline.generate`,
``bm run`` and ``bm bench`` through :func:`bm.distributed.engine.engine_loop`, a rank of a multi-rank run)
asks this module for it.
"""

from __future__ import annotations

from typing import Any

from bm.config import BmConfig
from bm.engine.execution.protocol import Executor


def torch_executor(config: BmConfig, model: Any = None) -> Executor:
    """The torch executor over ``model``: the one every engine over that loaded model takes in turn
    (:func:`bm.runtime.executor.executor_for`: its cache, warm-up and thread count carry over, so the
    second run in a process starts no colder than the first); over a model loaded from
    ``config.model`` when none is given.

    bm.runtime (torch, transformers: seconds) is imported here, on first use, not with this module:
    :mod:`bm.distributed.engine` imports it, and ``bm bench --sim`` reaches that through the bench
    runner without ever running a model."""
    from bm.runtime import load_model
    from bm.runtime.executor import TorchExecutor, executor_for

    return executor_for(model) if model is not None else TorchExecutor(load_model(config.model))
