"""Custom scheduler classes named ``package.module:ClassName`` in the config (``engine.capacity_scheduler``,
``engine.micro_batch_scheduler``, ``engine.scheduler``): where their module is found."""

from __future__ import annotations

import importlib.util
import sys
from collections.abc import Sequence
from pathlib import Path

CLASS_KEYS = ("capacity_scheduler", "micro_batch_scheduler", "scheduler")


def find_class_module(class_path: str, folders: Sequence[Path]) -> bool:
    """Make the module of a ``package.module:ClassName`` setting importable; False when it is nowhere.

    Python's path comes first (an installed package wins); else the first of ``folders`` (the config
    file's folder, then the working directory) holding the top-level package or module is added to
    ``sys.path`` (at the end, so it shadows nothing installed), and the module's own imports resolve
    beside it as with ``PYTHONPATH=.``.
    The ``bm`` script, unlike ``python -m``, has no working directory on its path: without this the
    scheduler page's ``examples.custom_scheduler:ShortestPromptFirstScheduler`` failed from the repo root."""
    top = class_path.partition(":")[0].split(".")[0]
    if top in sys.modules:
        return True
    try:
        if importlib.util.find_spec(top) is not None:
            return True
    except (ImportError, ValueError):
        return True  # it exists but is broken: importing it later reports why
    for folder in folders:
        if (folder / f"{top}.py").is_file() or (folder / top).is_dir():
            sys.path.append(str(folder.resolve()))
            importlib.invalidate_caches()
            return True
    return False
