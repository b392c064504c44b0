"""The one place an engine core is built, for the engine loop, the distributed engine and the simulator.

Each caller differs only in its executor (the torch executor over a model, that executor wrapped for a
rank of a multi-rank run, or the simulator's) and its clock; everything else (resolving the budgets,
sizing and binding the cache, warm-up, the scheduler) happens in :class:`~bm.engine.core.EngineCore`'s
set-up (:mod:`bm.engine.setup`), the same for all of them.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import Any

from bm.config import BmConfig
from bm.engine.core import EngineCore
from bm.engine.executor import Executor


def default_executor(config: BmConfig, model: Any = None) -> Executor:
    """The torch executor over ``model``: the one every engine over that loaded model takes in turn
    (:func:`bm.runtime.executor.executor_for`: its cache, warm-up and thread count carry over, so the
    second run in a process starts no colder than the first); over a model loaded from
    ``config.model`` when none is given."""
    from bm.runtime import load_model
    from bm.runtime.executor import TorchExecutor, executor_for

    return executor_for(model) if model is not None else TorchExecutor(load_model(config.model))


def build_core(
    config: BmConfig,
    executor: Executor | None = None,
    *,
    model: Any = None,
    wrap: Callable[[Executor], Executor] | None = None,
    clock: Callable[[], float] = time.perf_counter,
    check_integrity: bool = False,
) -> EngineCore:
    """A core over ``executor`` (by default the torch executor over ``model``), which ``wrap`` may wrap
    first (a rank of a multi-rank run makes its shards agree through it)."""
    executor = executor or default_executor(config, model)
    if wrap is not None:
        executor = wrap(executor)
    return EngineCore(config, executor, check_integrity=check_integrity, clock=clock)
