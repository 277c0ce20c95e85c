"""The package's imports follow the layer list of docs/design.md: no import runs upward, none
crosses between side-by-side rooms, none forms a cycle, and every module has its place. Every
import statement counts, those inside functions included (a lazy import is still a dependency);
`if TYPE_CHECKING:` blocks, which never run, are left out."""

from __future__ import annotations

import ast
import fnmatch
import re
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
PACKAGE = "torch_paged_kv"


def modules() -> dict[str, tuple[Path, bool]]:
    """Dotted name (without the package prefix; "" for its __init__) -> (file, is a package)."""
    found = {}
    for path in (ROOT / PACKAGE).rglob("*.py"):
        parts = list(path.relative_to(ROOT / PACKAGE).with_suffix("").parts)
        is_package = parts[-1] == "__init__"
        found[".".join(parts[:-1] if is_package else parts)] = (path, is_package)
    return found


def _runtime_imports(tree: ast.AST) -> list[ast.Import | ast.ImportFrom]:
    """Every import statement of `tree` but those under `if TYPE_CHECKING:`."""
    found: list[ast.Import | ast.ImportFrom] = []

    def visit(node: ast.AST) -> None:
        if isinstance(node, ast.If) and "TYPE_CHECKING" in ast.unparse(node.test):
            for child in node.orelse:
                visit(child)
            return
        if isinstance(node, (ast.Import, ast.ImportFrom)):
            found.append(node)
        for child in ast.iter_child_nodes(node):
            visit(child)

    visit(tree)
    return found


def import_graph(mods: dict[str, tuple[Path, bool]], sources: dict[str, str] | None = None) -> dict[str, set[str]]:
    """module -> the package modules it imports (a name imported from a package that is not one of
    its modules counts as the package itself); `sources` replaces the text of some modules."""
    sources = sources or {}

    def owner(name: str) -> str:
        while name not in mods:
            name = name.rpartition(".")[0]
        return name

    graph: dict[str, set[str]] = {name: set() for name in mods}
    for name, (path, is_package) in mods.items():
        here = [PACKAGE, *name.split(".")] if name else [PACKAGE]
        if not is_package:
            here = here[:-1]
        for node in _runtime_imports(ast.parse(sources.get(name) or path.read_text())):
            if isinstance(node, ast.Import):
                targets = [alias.name for alias in node.names]
            else:
                base = here[: len(here) - node.level + 1] if node.level else []
                module = ".".join(base + ([node.module] if node.module else []))
                targets = [f"{module}.{alias.name}" for alias in node.names]
            for target in targets:
                if target == PACKAGE or target.startswith(PACKAGE + "."):
                    dependency = owner(target.removeprefix(PACKAGE).removeprefix("."))
                    if dependency != name:
                        graph[name].add(dependency)
    return graph


def layer_list() -> list[list[list[str]]]:
    """docs/design.md's ```layers block: lines top to bottom, each a list of rooms (split by `|`),
    each a list of module patterns."""
    text = (ROOT / "docs" / "design.md").read_text()
    block = re.search(r"^```layers\n(.*?)^```", text, flags=re.M | re.S)
    assert block is not None, "docs/design.md has no ```layers block"
    return [[room.split() for room in line.split("|")] for line in block[1].splitlines() if line.strip()]


def _matches(pattern: str, name: str) -> bool:
    if pattern == "(package)":
        return name == ""
    if pattern.endswith(".*"):
        return name == pattern[:-2] or fnmatch.fnmatch(name, pattern)
    return name == pattern


def places(mods, layers) -> dict[str, tuple[int, int]]:
    """module -> (line, room) of its first matching pattern; modules without one are left out."""
    found = {}
    for name in mods:
        for line, rooms in enumerate(layers):
            room = next((r for r, patterns in enumerate(rooms) if any(_matches(p, name) for p in patterns)), None)
            if room is not None:
                found[name] = (line, room)
                break
    return found


def violations(graph: dict[str, set[str]], place: dict[str, tuple[int, int]]) -> list[str]:
    """Imports that run upward or between rooms of one line."""
    bad = []
    for name, dependencies in sorted(graph.items()):
        for dependency in sorted(dependencies):
            (line, room), (their_line, their_room) = place[name], place[dependency]
            if their_line < line:
                bad.append(f"{name or '(package)'} imports {dependency}, a layer above it")
            elif their_line == line and their_room != room:
                bad.append(f"{name} imports {dependency}, beside it in another room")
    return bad


def cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """The strongly connected components of more than one module (Tarjan's algorithm)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    found: list[list[str]] = []

    def visit(node: str) -> None:
        index[node] = low[node] = len(index)
        stack.append(node)
        for other in sorted(graph[node]):
            if other not in index:
                visit(other)
                low[node] = min(low[node], low[other])
            elif other in stack:
                low[node] = min(low[node], index[other])
        if low[node] == index[node]:
            component = []
            while True:
                top = stack.pop()
                component.append(top)
                if top == node:
                    break
            if len(component) > 1:
                found.append(sorted(component))

    for node in sorted(graph):
        if node not in index:
            visit(node)
    return found


def test_every_module_has_a_place_in_the_layer_list():
    mods, layers = modules(), layer_list()
    assert len(layers) > 10
    assert sorted(set(mods) - set(places(mods, layers))) == []


def test_no_import_runs_upward_or_across_rooms():
    mods = modules()
    graph = import_graph(mods)
    assert sum(map(len, graph.values())) > 100  # the walk found the package's imports
    assert violations(graph, places(mods, layer_list())) == []


def test_no_import_cycle():
    assert cycles(import_graph(modules())) == []


@pytest.mark.parametrize(
    "module, source, complaint",
    [
        ("layout", "def f():\n    from .ops import api\n", "layout imports ops.api, a layer above it"),
        ("ops.cpu.args", "from ..triton import common\n", "ops.cpu.args imports ops.triton.common, beside it"),
        ("ops.validate", "from .cpu import kernels\n", "ops.validate imports ops.cpu.kernels, beside it"),
        ("ops.triton.store_kv", "from .. import dispatch\n", "ops.triton.store_kv imports ops.dispatch, beside it"),
        ("ops.records", "from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n    from .api import OPS\n", None),
    ],
)
def test_the_checks_see_lazy_upward_and_crossing_imports(module, source, complaint):
    """The checks on made-up sources: a lazy import inside a function counts, a TYPE_CHECKING one
    does not."""
    mods = modules()
    found = violations(import_graph(mods, {module: source}), places(mods, layer_list()))
    assert found == ([] if complaint is None else [next(v for v in found if v.startswith(complaint))])


def test_the_cycle_check_finds_a_cycle():
    graph = {"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}
    assert cycles(graph) == [["a", "b", "c"]]
