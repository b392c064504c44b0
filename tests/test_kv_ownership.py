"""Blocks change hands only through the KV manager's steps: ``prepare_resources`` (the scheduler's plan
and the drafts' plan), ``update_resources`` (trims, registrations, window releases, beam forks) and
``free``. Nothing in the engine calls the manager's lower-level methods itself."""

from __future__ import annotations

import ast
from pathlib import Path

ENGINE = Path(__file__).resolve().parents[1] / "bm" / "engine"

# the manager's methods that change a table or a block's state; the steps above call them
LOW_LEVEL = {
    "allocate",
    "append",
    "allocate_padding",
    "trim",
    "take_cached_prefix",
    "cache_computed_blocks",
    "release_outside_window",
    "fork_beams",
    "copy_on_write",
}


def low_level_kv_calls(path: Path) -> list[str]:
    """``kv.allocate(...)``-style calls on a name or attribute that holds the KV cache manager."""
    found = []
    for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
        if not (isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute)):
            continue
        owner = ast.unparse(node.func.value)
        if node.func.attr in LOW_LEVEL and ("kv" in owner or "cache_manager" in owner):
            found.append(f"{path.name}:{node.lineno}: {owner}.{node.func.attr}")
    return found


def test_the_engine_changes_kv_blocks_only_through_the_managers_plan_and_update_steps():
    paths = sorted(ENGINE.rglob("*.py"))  # every module of every subpackage
    assert ENGINE / "step" / "core.py" in paths
    calls = [c for path in paths for c in low_level_kv_calls(path)]
    assert not calls, calls


def test_the_ownership_check_sees_a_direct_allocation(tmp_path):
    source = tmp_path / "x.py"
    source.write_text("def f(self):\n    self.kv_cache_manager.trim(1, 2)\n    kv.allocate(1, 3)\n")
    assert low_level_kv_calls(source) == ["x.py:2: self.kv_cache_manager.trim", "x.py:3: kv.allocate"]


def test_fast_forward_reads_no_private_field_of_the_core():
    tree = ast.parse((ENGINE / "step" / "fast_forward.py").read_text(encoding="utf-8"))
    private = [
        ast.unparse(n)
        for n in ast.walk(tree)
        if isinstance(n, ast.Attribute) and n.attr.startswith("_") and not n.attr.startswith("__")
    ]
    assert not private, private
