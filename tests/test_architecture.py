"""The package's shape: stage packages whose imports point down the stack, no cycles, no private names
imported across modules, few top-level modules, short lines, and `import tiledsl` from any folder."""
from __future__ import annotations

import ast
import os
import subprocess
import sys
from pathlib import Path

import networkx as nx
import pytest

import tiledsl

ROOT = Path(__file__).resolve().parent.parent
PACKAGE = Path(tiledsl.__file__).resolve().parent
MAX_TOP_LEVEL_MODULES = 12
MAX_LINE = 120

# Each sub-package (or top-level module) and the layer it sits on: a module imports only from its own
# layer or below. Top-level modules not named here sit where their imports put them (checked by the cycle
# test alone). families.py, the family table, sits just above layout/ (the front end and the passes read
# layouts through it); what its rows name higher up (lowerings, kernel classes) it resolves by name on
# first use, not by import.
LAYERS = {
    "spec": 0, "errors": 0, "version": 0, "hw": 0, "device_limits": 0, "mods": 0,
    "layout": 1,
    "families": 2,
    "schedule": 3, "frontend": 3,
    "lower": 4,
    "codegen": 5, "runtime": 5,
    "reference": 6,
    "dispatch": 7, "serving": 8, "tune": 8, "distributed": 8,
    "api": 9, "cli": 10,
}


def module_name(path: Path) -> str:
    """tiledsl/lower/fa2.py -> tiledsl.lower.fa2; a package's __init__.py -> the package."""
    parts = list(path.relative_to(PACKAGE.parent).with_suffix("").parts)
    if parts[-1] == "__init__":
        parts.pop()
    return ".".join(parts)


def modules() -> dict[str, Path]:
    return {module_name(p): p for p in PACKAGE.rglob("*.py")}


def resolve(importer: str, is_package: bool, node: ast.ImportFrom) -> str:
    """The absolute module an ImportFrom names, at any relative depth."""
    if node.level == 0:
        return node.module or ""
    base = importer.split(".")
    if not is_package:
        base = base[:-1]
    base = base[: len(base) - (node.level - 1)]
    return ".".join(base + ([node.module] if node.module else []))


def imported(importer: str, path: Path, known: set[str]):
    """(tiledsl module imported, names taken from it) for every import in `path`, function-level ones too.
    `from pkg import mod` counts as importing pkg.mod."""
    tree = ast.parse(path.read_text(), str(path))
    for node in ast.walk(tree):
        if isinstance(node, ast.ImportFrom):
            target = resolve(importer, path.name == "__init__.py", node)
            if not target.startswith("tiledsl"):
                continue
            plain = []
            for alias in node.names:
                sub = f"{target}.{alias.name}"
                if sub in known:
                    yield sub, ()
                else:
                    plain.append(alias.name)
            if plain:
                yield target, tuple(plain)
        elif isinstance(node, ast.Import):
            for alias in node.names:
                if alias.name.startswith("tiledsl"):
                    yield alias.name, ()


def import_graph() -> nx.DiGraph:
    found = modules()
    graph = nx.DiGraph()
    graph.add_nodes_from(found)
    for name, path in found.items():
        for target, _ in imported(name, path, set(found)):
            if target in found and target != name:
                graph.add_edge(name, target)
    return graph


def layer(module: str) -> int | None:
    parts = module.split(".")
    return LAYERS.get(parts[1]) if len(parts) > 1 else None


def test_the_graph_sees_relative_imports_at_every_depth_and_function_level_imports():
    graph = import_graph()
    assert graph.has_edge("tiledsl.runtime.fa1", "tiledsl.runtime.kernel")        # `from .kernel import Kernel`
    assert graph.has_edge("tiledsl.lower.hopper", "tiledsl.schedule.passes")      # `from ..schedule.passes import`
    assert graph.has_edge("tiledsl.cli.report", "tiledsl.families")               # inside a function


def test_tiledsl_has_no_import_cycles():
    cycles = list(nx.simple_cycles(import_graph()))
    assert not cycles, "import cycles in tiledsl: " + "; ".join(" -> ".join(c + c[:1]) for c in cycles)


def test_imports_point_down_the_stack():
    upward = []
    for a, b in import_graph().edges:
        la, lb = layer(a), layer(b)
        if la is not None and lb is not None and lb > la:
            upward.append(f"{a} (layer {la}) imports {b} (layer {lb})")
    assert not upward, "\n".join(upward)


def test_no_module_imports_another_modules_private_name():
    found = modules()
    private = []
    for name, path in found.items():
        for target, names in imported(name, path, set(found)):
            private += [f"{name} imports {target}.{n}" for n in names if n.startswith("_") and not n.startswith("__")]
    assert not private, "\n".join(private)


def test_a_module_reached_as_an_attribute_is_not_read_for_its_private_names():
    """`from . import x` then `x._y` is the same private import in another spelling."""
    found = modules()
    private = []
    for name, path in found.items():
        tree = ast.parse(path.read_text())
        bound = {alias.asname or alias.name for node in ast.walk(tree) if isinstance(node, ast.ImportFrom)
                 for alias in node.names
                 if f"{resolve(name, path.name == '__init__.py', node)}.{alias.name}" in found}
        for node in ast.walk(tree):
            if (isinstance(node, ast.Attribute) and isinstance(node.value, ast.Name) and node.value.id in bound
                    and node.attr.startswith("_") and not node.attr.startswith("__")):
                private.append(f"{name}:{node.lineno} reads {node.value.id}.{node.attr}")
    assert not private, "\n".join(private)


def test_few_top_level_modules():
    top = sorted(p.name for p in PACKAGE.glob("*.py"))
    assert len(top) <= MAX_TOP_LEVEL_MODULES, top


def test_lines_fit_in_a_review_window():
    long = [f"{path.relative_to(ROOT)}:{i}" for path in PACKAGE.rglob("*.py")
            for i, line in enumerate(path.read_text().splitlines(), 1) if len(line) > MAX_LINE]
    assert not long, f"{len(long)} lines over {MAX_LINE} characters: " + ", ".join(long[:20])


@pytest.mark.parametrize("folder", sorted({str(p.parent.relative_to(ROOT)) for p in PACKAGE.rglob("*.py")}))
def test_import_tiledsl_works_from_inside_every_folder_of_the_package(folder):
    # No module may shadow the standard library for a Python started inside the package.
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    done = subprocess.run([sys.executable, "-c", "import tiledsl, dataclasses, ast; print(tiledsl.__version__)"],
                          cwd=ROOT / folder, env=env, capture_output=True, text=True, timeout=60)
    assert done.returncode == 0, done.stderr
