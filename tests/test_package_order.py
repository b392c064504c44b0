"""No package of bm imports a package above it, in the order written in docs/internals.md ("Package order").

The design's rule is that the layers run one way: the CLI over the front door over the engine over the
scheduler and the KV manager, the torch runtime beside them and the seed's adapter above it. A lazy import
inside a function still ties the lower package to the upper one (it cannot be used, tested or read
without it), so imports are read from the source with ``ast``, function-level ones included, the same
way the import-cycle test reads them. The order is read from the doc, so the doc and the rule cannot
drift apart.
"""

from __future__ import annotations

import re

from tests.test_import_cycles import PACKAGE, import_graph

DOC = PACKAGE.parent / "docs" / "internals.md"

# Upward edges not yet untangled, each with why it is still there. An entry that no longer occurs fails
# the test below, so the allowance goes with the fix.
KNOWN_UPWARD: dict[tuple[str, str], str] = {}


def package_order(text: str) -> list[str]:
    """The units of the order, top first: the first word of each line of the ``text`` block under the
    "Package order" heading (words after ``#`` are a description)."""
    section = text.split("\n## Package order\n", 1)[1]
    block = re.search(r"```text\n(.*?)```", section, re.S)
    assert block, "docs/internals.md's Package order section has no ```text block"
    return [
        line.split("#", 1)[0].split()[0]
        for line in block.group(1).splitlines()
        if line.split("#", 1)[0].strip()
    ]


def unit_of(module: str, order: list[str]) -> str | None:
    """The unit of the order a module belongs to: the longest unit that is the module or a package
    holding it (the root package's unit holds only the root's own ``__init__``)."""
    root = order[-1] if order else ""
    found = [u for u in order if module == u or (u != root and module.startswith(u + "."))]
    return max(found, key=len) if found else None


def upward_imports(graph: dict[str, set[str]], order: list[str]) -> set[tuple[str, str, str, str]]:
    """(importer unit, imported unit, importer module, imported module) for every import that goes up."""
    rank = {unit: i for i, unit in enumerate(order)}  # 0 is the top
    out = set()
    for module, imported in graph.items():
        unit = unit_of(module, order)
        for target in imported:
            target_unit = unit_of(target, order)
            if unit and target_unit and rank[target_unit] < rank[unit]:
                out.add((unit, target_unit, module, target))
    return out


def bm_order() -> list[str]:
    return package_order(DOC.read_text(encoding="utf-8"))


def test_the_order_names_each_package_once_and_only_packages_that_exist():
    order = bm_order()
    assert len(order) == len(set(order)), f"named twice: {sorted({u for u in order if order.count(u) > 1})}"
    modules = set(import_graph())
    assert order[-1] == "bm", "the root package is the bottom of the order"
    missing = [u for u in order if u not in modules and not any(m.startswith(u + ".") for m in modules)]
    assert not missing, f"units of the order that are not modules or packages of bm: {missing}"


def test_every_module_of_bm_has_a_place_in_the_order():
    order = bm_order()
    unplaced = sorted(m for m in import_graph() if unit_of(m, order) is None)
    assert not unplaced, f"modules in no package of docs/internals.md's Package order: {unplaced}"


def test_no_package_of_bm_imports_a_package_above_it():
    found = upward_imports(import_graph(), bm_order())
    edges = {(unit, target) for unit, target, _, _ in found}
    unexpected = sorted(
        f"{m} imports {t} ({u} is below {tu})" for u, tu, m, t in found if (u, tu) not in KNOWN_UPWARD
    )
    assert not unexpected, "upward imports:\n" + "\n".join(unexpected)
    fixed = sorted(f"{u} -> {t}" for u, t in KNOWN_UPWARD if (u, t) not in edges)
    assert not fixed, f"no longer upward, so drop them from KNOWN_UPWARD: {fixed}"


def test_a_planted_upward_import_inside_a_function_is_found(tmp_path):
    pkg = tmp_path / "pkg"
    (pkg / "low").mkdir(parents=True)
    (pkg / "__init__.py").write_text("")
    (pkg / "top.py").write_text("from pkg.low import helper\n")
    (pkg / "low" / "__init__.py").write_text("")
    (pkg / "low" / "helper.py").write_text("def f():\n    from pkg import top\n    return top\n")
    order = package_order("# x\n\n## Package order\n\n```text\npkg.top  # above\npkg.low\npkg\n```\n")
    assert order == ["pkg.top", "pkg.low", "pkg"]
    assert upward_imports(import_graph(pkg), order) == {("pkg.low", "pkg.top", "pkg.low.helper", "pkg.top")}
    (pkg / "low" / "helper.py").write_text("def f():\n    return 1\n")
    assert upward_imports(import_graph(pkg), order) == set()
