"""Every name a module of bm lists in ``__all__`` can be imported from it.

Several packages export lazily (a ``__getattr__`` over a name -> module table, so ``import bm.kv`` stays
free of torch); a table entry that points at the wrong module is only found when a user asks for the
name, as ``from bm.engine import validate_request`` once raised AttributeError. The modules are found
by reading the source, so a new ``__all__`` is covered without editing this test.
"""

from __future__ import annotations

import ast
import importlib
from pathlib import Path

import pytest

PACKAGE = Path(__file__).resolve().parents[1] / "bm"


def modules_with_all(root: Path = PACKAGE) -> list[str]:
    """Dotted names of the modules whose source assigns ``__all__`` at the top level."""
    out = []
    for path in sorted(root.rglob("*.py")):
        tree = ast.parse(path.read_text(encoding="utf-8"))
        targets = [
            target
            for node in tree.body
            for target in (node.targets if isinstance(node, ast.Assign) else [getattr(node, "target", None)])
        ]
        assigned = any(isinstance(t, ast.Name) and t.id == "__all__" for t in targets)
        if assigned:
            parts = (root.name, *path.relative_to(root).with_suffix("").parts)
            out.append(".".join(parts[:-1] if parts[-1] == "__init__" else parts))
    return out


def test_the_modules_with_all_are_found():
    found = modules_with_all()
    assert {"bm", "bm.engine", "bm.kv", "bm.scheduling"} <= set(found)


@pytest.mark.parametrize("module_name", modules_with_all())
def test_every_name_in_all_imports(module_name):
    module = importlib.import_module(module_name)
    missing = []
    for name in module.__all__:
        try:
            getattr(module, name)
        except AttributeError as exc:
            missing.append(f"{name} ({exc})")
    assert not missing, f"{module_name}.__all__ names that do not import: {missing}"


def test_a_name_that_went_says_what_replaces_it():
    import bm

    with pytest.raises(AttributeError, match=r"final bm\.engine\.Response"):
        bm.RequestResult  # noqa: B018
