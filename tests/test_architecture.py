"""The import structure: which package may import which, and no import cycles.

Read from the source with ``ast`` (nothing here imports our packages), so a layering slip
fails fast and names the file and line. Every import statement counts, at module level or
inside a function, and so does ``importlib.import_module`` of a literal name; a package's
layering also counts imports made only for type checking, a cycle does not (they never run).
"""

from __future__ import annotations

import ast
import subprocess
import sys
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
# Top-level package -> the folder it lives in (the generated wire code imports as draftcache).
PACKAGES = {
    "indexer": ROOT / "indexer",
    "migrations": ROOT / "migrations",
    "cache_service": ROOT / "cache_service",
    "decoder_client": ROOT / "decoder_client",
    "benchmarks": ROOT / "benchmarks",
    "draftcache": ROOT / "proto" / "draftcache",
}
# What each package may import of ours: the arrows point down only.
ALLOWED = {
    "draftcache": set(),
    "indexer": set(),
    "migrations": set(),
    "cache_service": {"indexer", "migrations", "draftcache"},
    "decoder_client": {"indexer", "draftcache"},
    "benchmarks": {"indexer", "migrations", "cache_service", "decoder_client", "draftcache"},
}


@dataclass(frozen=True)
class Import:
    """One module naming another: where, and whether only under ``if TYPE_CHECKING:``."""

    source: str
    target: str
    line: int
    typing_only: bool

    def __str__(self) -> str:
        return f"{self.source}:{self.line} -> {self.target}"


def _module_files() -> dict[str, Path]:
    files = {}
    for package, folder in PACKAGES.items():
        for path in sorted(folder.rglob("*.py")):
            parts = [package, *path.relative_to(folder).with_suffix("").parts]
            files[".".join(parts[:-1] if parts[-1] == "__init__" else parts)] = path
    return files


MODULES = _module_files()


def _is_type_checking(test: ast.expr) -> bool:
    return (isinstance(test, ast.Name) and test.id == "TYPE_CHECKING") or (
        isinstance(test, ast.Attribute) and test.attr == "TYPE_CHECKING"
    )


def _ours(name: str) -> str | None:
    """The module of ours a dotted name lies in (its longest known prefix), if any."""
    parts = name.split(".")
    while parts and ".".join(parts) not in MODULES:
        parts.pop()
    return ".".join(parts) if parts else None


class _Imports(ast.NodeVisitor):
    """Every module of ours a module names, with the line and whether only for type checking."""

    def __init__(self, module: str, is_package: bool) -> None:
        self.module, self.is_package = module, is_package
        self.found: list[Import] = []
        self._typing_only = False

    def visit_If(self, node: ast.If) -> None:
        if not _is_type_checking(node.test):
            self.generic_visit(node)
            return
        outer, self._typing_only = self._typing_only, True
        for child in node.body:
            self.visit(child)
        self._typing_only = outer
        for child in node.orelse:
            self.visit(child)

    def visit_Import(self, node: ast.Import) -> None:
        for alias in node.names:
            self._add(alias.name, node.lineno)

    def visit_ImportFrom(self, node: ast.ImportFrom) -> None:
        base = self._absolute(node.module, node.level)
        # ``from package import submodule`` names the submodule, not the package's __init__.
        named = {f"{base}.{alias.name}" for alias in node.names}
        for name in sorted({name if name in MODULES else base for name in named}):
            self._add(name, node.lineno)

    def visit_Call(self, node: ast.Call) -> None:
        func = node.func
        called = func.attr if isinstance(func, ast.Attribute) else func.id if isinstance(func, ast.Name) else ""
        if called in ("import_module", "__import__") and node.args:
            first = node.args[0]
            if isinstance(first, ast.Constant) and isinstance(first.value, str):
                self._add(first.value, node.lineno)
        self.generic_visit(node)

    def _absolute(self, module: str | None, level: int) -> str:
        if not level:
            return module or ""
        package = self.module.split(".") if self.is_package else self.module.split(".")[:-1]
        base = package[: len(package) - (level - 1)]
        return ".".join(base + ([module] if module else []))

    def _add(self, name: str, line: int) -> None:
        target = _ours(name)
        if target is not None and target != self.module:
            self.found.append(Import(self.module, target, line, self._typing_only))


def _imports_of(module: str) -> list[Import]:
    path = MODULES[module]
    visitor = _Imports(module, path.name == "__init__.py")
    visitor.visit(ast.parse(path.read_text(encoding="utf-8"), filename=str(path)))
    return visitor.found


IMPORTS = [imp for module in MODULES for imp in _imports_of(module)]


def _package(module: str) -> str:
    return module.split(".")[0]


def test_every_package_is_found():
    # A package moved or renamed without this file knowing would pass everything vacuously.
    assert {_package(m) for m in MODULES} == set(PACKAGES)


def test_the_server_imports_nothing_of_the_client_or_the_tools():
    found = [
        str(imp)
        for imp in IMPORTS
        if _package(imp.source) == "cache_service" and _package(imp.target) in ("decoder_client", "benchmarks")
    ]
    assert not found, "\n".join(found)


def test_packages_import_only_the_packages_below_them():
    found = [
        str(imp)
        for imp in IMPORTS
        if _package(imp.target) != _package(imp.source) and _package(imp.target) not in ALLOWED[_package(imp.source)]
    ]
    assert not found, "\n".join(found)


def test_the_allowed_package_graph_is_acyclic():
    # What the test above holds every package to must itself point one way.
    order = _topological(ALLOWED)
    assert order is not None and set(order) == set(ALLOWED)


def _topological(graph: dict[str, set[str]]) -> list[str] | None:
    """The nodes, each after everything it points to; ``None`` when the graph has a cycle."""
    done: list[str] = []
    pending = {node: set(targets) for node, targets in graph.items()}
    while pending:
        ready = sorted(node for node, targets in pending.items() if targets <= set(done))
        if not ready:
            return None
        done.extend(ready)
        for node in ready:
            del pending[node]
    return done


def test_no_module_imports_itself_through_others():
    graph: dict[str, set[str]] = {module: set() for module in MODULES}
    for imp in IMPORTS:
        if not imp.typing_only:
            graph[imp.source].add(imp.target)
    cycles = [" -> ".join(_cycle_in(graph, component)) for component in _strongly_connected(graph)]
    assert not cycles, "\n".join(cycles)


def _strongly_connected(graph: dict[str, set[str]]) -> Iterator[set[str]]:
    """The graph's components of more than one node (Tarjan's algorithm, iterative)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    for root in sorted(graph):
        if root in index:
            continue
        work = [(root, iter(sorted(graph[root])))]
        index[root] = low[root] = len(index)
        stack.append(root)
        on_stack.add(root)
        while work:
            node, targets = work[-1]
            target = next(targets, None)
            if target is None:
                work.pop()
                if work:
                    low[work[-1][0]] = min(low[work[-1][0]], low[node])
                if low[node] == index[node]:
                    component = set()
                    while True:
                        member = stack.pop()
                        on_stack.discard(member)
                        component.add(member)
                        if member == node:
                            break
                    if len(component) > 1:
                        yield component
            elif target not in index:
                index[target] = low[target] = len(index)
                stack.append(target)
                on_stack.add(target)
                work.append((target, iter(sorted(graph[target]))))
            elif target in on_stack:
                low[node] = min(low[node], index[target])


def _cycle_in(graph: dict[str, set[str]], component: set[str]) -> list[str]:
    """One cycle through a strongly connected component, as the modules along it (first again
    at the end), to name in a failure."""
    start = min(component)
    path, seen = [start], {start}
    while True:
        node = path[-1]
        nxt = min(t for t in graph[node] if t in component)
        if nxt in seen:
            return [*path[path.index(nxt) :], nxt]
        path.append(nxt)
        seen.add(nxt)


def test_the_graph_walk_finds_a_cycle():
    # The check above is only as good as its cycle finder: a known graph, a known cycle.
    graph = {"a": {"b"}, "b": {"c"}, "c": {"a", "d"}, "d": set()}
    assert list(_strongly_connected(graph)) == [{"a", "b", "c"}]
    assert _cycle_in(graph, {"a", "b", "c"}) == ["a", "b", "c", "a"]


_NO_DECODER_SIDE = """
import contextlib, io, sys
import cache_service.app
from cache_service.cli import main
with contextlib.redirect_stdout(io.StringIO()) as help_text:
    try:
        main(["serve", "--help"])
    except SystemExit as done:
        assert done.code in (0, None), done.code
assert "usage" in help_text.getvalue(), help_text.getvalue()
print(" ".join(sorted(m for m in ("torch", "transformers") if m in sys.modules)))
"""


def test_the_server_loads_without_the_decoder_side():
    # The server installs without torch: importing it and reading its options must not load it.
    # A fresh process, since this one's collection may have imported anything.
    done = subprocess.run(
        [sys.executable, "-c", _NO_DECODER_SIDE], cwd=ROOT, capture_output=True, text=True, timeout=120
    )
    assert done.returncode == 0, done.stderr
    assert done.stdout.strip() == ""
