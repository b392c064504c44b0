"""Custom scheduler classes named ``package.module:ClassName`` in the config (``engine.capacity_scheduler``,
``engine.micro_batch_scheduler``, ``engine.scheduler``): where their module is found.

Python's path comes first, so an installed package wins. Otherwise the module is looked for beside the
config file, then in the working directory: the ``bm`` script, unlike ``python -m``, has no working
directory on its path, and without this the scheduler page's
``examples.custom_scheduler:ShortestPromptFirstScheduler`` failed from the repository root.

The folder is not added to ``sys.path``: that would make every file in it importable under its bare name
for the rest of the process (a ``yaml.py`` or ``utils.py`` beside a config answering some later import
that should have failed). A finder for the one top-level name goes at the end of ``sys.meta_path``
instead; the module's own relative imports, and its imports of siblings in the same package, resolve
through the package as they do with ``PYTHONPATH=folder``.
"""

from __future__ import annotations

import importlib.util
import sys
from collections.abc import Sequence
from importlib.abc import MetaPathFinder
from importlib.machinery import (
    BYTECODE_SUFFIXES,
    EXTENSION_SUFFIXES,
    SOURCE_SUFFIXES,
    ExtensionFileLoader,
    FileFinder,
    ModuleSpec,
    SourceFileLoader,
    SourcelessFileLoader,
)
from pathlib import Path
from types import ModuleType

from bm.config.engine import EngineConfig
from bm.config.fields import ConfigError

CLASS_KEYS = ("capacity_scheduler", "micro_batch_scheduler", "scheduler")

# Python's own loaders for a folder's files, in the order its path finder tries them.
_LOADERS = (
    (ExtensionFileLoader, EXTENSION_SUFFIXES),
    (SourceFileLoader, SOURCE_SUFFIXES),
    (SourcelessFileLoader, BYTECODE_SUFFIXES),
)


class FolderModuleFinder(MetaPathFinder):
    """Finds one top-level module or package, ``name``, in one folder, and nothing else.

    The folder is searched exactly as Python searches a ``sys.path`` entry (a package, a module, or a
    namespace package such as ``examples/``). Only the top-level name is answered: a package's submodules
    are found through its ``__path__`` like any package's."""

    def __init__(self, name: str, folder: Path) -> None:
        self.name = name
        self.folder = folder
        self._finder = FileFinder(str(folder), *_LOADERS)

    def find_spec(
        self, fullname: str, path: Sequence[str] | None = None, target: ModuleType | None = None
    ) -> ModuleSpec | None:
        if fullname != self.name or path is not None:
            return None
        return self._finder.find_spec(fullname, target)

    def invalidate_caches(self) -> None:
        self._finder.invalidate_caches()

    def __repr__(self) -> str:
        return f"{type(self).__name__}({self.name!r}, {str(self.folder)!r})"


def find_class_module(class_path: str, folders: Sequence[Path]) -> bool:
    """Make the module of a ``package.module:ClassName`` setting importable; False when it is nowhere.

    Python's path comes first (an installed package wins); else the first of ``folders`` (the config
    file's folder, then the working directory) holding the top-level package or module gets a
    :class:`FolderModuleFinder` for that name at the end of ``sys.meta_path``. ``sys.path`` is left as
    it was. The module itself is imported later, by whoever builds the scheduler, so an error inside it
    is reported there, naming the key."""
    top = class_path.partition(":")[0].split(".")[0]
    if top in sys.modules:
        return True
    try:
        if importlib.util.find_spec(top) is not None:
            return True
    except (ImportError, ValueError):
        return True  # it exists but is broken: importing it later reports why
    for folder in folders:
        finder = FolderModuleFinder(top, folder.resolve())
        if finder.find_spec(top) is not None:
            sys.meta_path.append(finder)
            return True
    return False


def check_class_paths(engine: EngineConfig, folders: Sequence[Path]) -> None:
    """Refuse, when the config loads, a custom scheduler class whose module is nowhere to be found,
    naming the key and every place looked in."""
    for key in CLASS_KEYS:
        value = getattr(engine, key)
        if value is not None and not find_class_module(value, folders):
            raise ConfigError(
                f"engine.{key}: cannot import {value!r} (no module {value.partition(':')[0]!r} in "
                f"{' or '.join(repr(str(f)) for f in folders)} or Python's path); give a module there or "
                "set PYTHONPATH"
            )
