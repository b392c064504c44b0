"""The shape a new maintainer meets (issue 56): the engine's two loops read as loops, and no module of
bm is too long to hold in one reading.

``EngineCore.plain_step`` is the seed's iteration (schedule, then the launch part: pause, prepare
resources, execute; then the collect part: update, respond, stats) and ``overlapped_step`` is built
from the same two parts, so the overlap choreography stays in one function instead of leaking into the
plain loop. Read from the source with ``ast``, as the package-order test reads imports.
"""

from __future__ import annotations

import ast
import inspect
import textwrap

from bm.engine.step.core import EngineCore
from tests.test_import_cycles import PACKAGE, import_graph

MAX_MODULE_LINES = 450
MAX_PLAIN_STEP_LINES = 15

# bm.engine's subpackages by job, bottom first: each imports only those before it (bm/engine/__init__.py)
ENGINE_ORDER = ["requests", "execution", "outputs", "step", "driving"]


def _calls(function: object) -> list[str]:
    """The ``self.<name>(...)`` calls of a method, in source order."""
    tree = ast.parse(textwrap.dedent(inspect.getsource(function)))
    calls = [
        n
        for n in ast.walk(tree)
        if isinstance(n, ast.Call)
        and isinstance(n.func, ast.Attribute)
        and isinstance(n.func.value, ast.Name)
        and n.func.value.id == "self"
    ]
    return [c.func.attr for c in sorted(calls, key=lambda c: (c.lineno, c.col_offset))]


def test_no_module_of_bm_is_over_450_lines():
    long = {
        str(path.relative_to(PACKAGE.parent)): n
        for path in sorted(PACKAGE.rglob("*.py"))
        if (n := len(path.read_text(encoding="utf-8").splitlines())) > MAX_MODULE_LINES
    }
    assert long == {}, f"split these by what they do: {long}"


def test_the_plain_step_is_the_seeds_loop_in_at_most_15_lines():
    source = inspect.getsource(EngineCore.plain_step)
    assert len(source.splitlines()) <= MAX_PLAIN_STEP_LINES, source
    assert [c for c in _calls(EngineCore.plain_step) if not c.startswith("clock")] == [
        "_schedule",
        "_launch",
        "_collect",
    ]


def test_the_overlapped_step_is_built_from_the_plain_steps_parts_and_step_chooses_between_them():
    parts = set(_calls(EngineCore.overlapped_step)) - {"clock"}
    assert parts == {"_schedule", "_launch", "_collect"}
    assert set(_calls(EngineCore.step)) == {"overlapped_step", "plain_step"}
    launch, collect = _calls(EngineCore._launch), _calls(EngineCore._collect)
    assert "overlapped_step" not in launch + collect and "plain_step" not in launch + collect


def test_every_engine_module_is_in_a_subpackage_that_imports_only_those_below_it():
    graph = import_graph()
    engine = {m: m.split(".") for m in graph if m.startswith("bm.engine.")}
    flat = sorted(m for m, parts in engine.items() if len(parts) == 3 and parts[2] not in ENGINE_ORDER)
    assert not flat, f"modules of bm.engine in none of its subpackages {ENGINE_ORDER}: {flat}"
    upward = sorted(
        f"{m} imports {t}"
        for m, parts in engine.items()
        for t in graph[m]
        if t in engine and ENGINE_ORDER.index(engine[t][2]) > ENGINE_ORDER.index(parts[2])
    )
    assert not upward, "an engine subpackage imports one above it:\n" + "\n".join(upward)
