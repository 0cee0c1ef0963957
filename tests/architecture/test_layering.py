"""The layering, checked from the import graph of the source (docs/design.md, "Architecture").

Dependencies point one way: the CLI -> the job layer (beam_rl/job) -> the Beam steps (transforms) and the
runner tooling (runners) -> the wiring (beam_rl/wiring.py) -> the domain (the rest of beam_rl) ->
schemas. The graph is read from the
source with `ast`, not by importing it, so every import counts: module-level ones, function-local ones
(which only hide a dependency until the function runs) and `if TYPE_CHECKING:` ones (which only hide it
from the interpreter). An edge goes to the module an import names: `import a.b` and `from a import b`
(b a submodule) to `a.b`, `from a.b import name` to `a.b`. It also goes to the packages above that
module (`a`), whose `__init__` Python runs first, unless they are the importer's own packages (already
being initialized when the importer runs): that is how importing the inference client runs
beam_rl/envs/__init__.py and every bundled environment with it.
"""

from __future__ import annotations

import ast
from collections.abc import Iterable, Iterator
from dataclasses import dataclass
from pathlib import Path

import pytest

from tests.support.paths import REPO as ROOT

PACKAGES = ("beam_rl", "transforms", "runners", "schemas")

CLI = "beam_rl.cli"
JOB = "beam_rl.job"  # starting, following and stopping a run: the one part of beam_rl that assembles Beam
WIRING = "beam_rl.wiring"  # builds every part from the config; the Beam steps and the job call it
ABOVE_THE_DOMAIN = (CLI, JOB, WIRING)

# The cycles that remain, each as the set of modules of its strongly connected component. The test fails
# on a new cycle, on one that grows, and on one that is gone, so that these lists shrink with each fix
# and never grow unnoticed.
KNOWN_MODULE_LEVEL_CYCLES: frozenset[frozenset[str]] = frozenset()

# Counting function-local and TYPE_CHECKING imports too.
KNOWN_HIDDEN_CYCLES: frozenset[frozenset[str]] = frozenset()


@dataclass(frozen=True)
class Import:
    importer: str  # the module holding the import statement
    target: str  # the module imported, resolved to an absolute dotted name
    line: int
    kind: str  # "module": runs when the importer is imported; "function": when a function runs;
    #            "type_checking": never at run time (under `if TYPE_CHECKING:`)

    def __str__(self) -> str:
        return f"{self.importer} -> {self.target} ({self.kind}, line {self.line})"


def _module_name(path: Path) -> str:
    parts = list(path.relative_to(ROOT).with_suffix("").parts)
    if parts[-1] == "__init__":
        parts.pop()
    return ".".join(parts)


def _source_files() -> dict[str, Path]:
    return {_module_name(path): path for package in PACKAGES for path in sorted((ROOT / package).rglob("*.py"))}


def _is_type_checking(test: ast.expr) -> bool:
    return (isinstance(test, ast.Name) and test.id == "TYPE_CHECKING") or (
        isinstance(test, ast.Attribute) and test.attr == "TYPE_CHECKING")


def _imports_in(nodes: Iterable[ast.AST], kind: str) -> Iterator[tuple[ast.Import | ast.ImportFrom, str]]:
    """Every import statement under `nodes` (at any depth: in a try's handlers, a with, a match case),
    with when it runs. Class bodies run at import time like the module's own; a function's body only
    when it is called."""
    for node in nodes:
        if isinstance(node, (ast.Import, ast.ImportFrom)):
            yield node, kind
        elif isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
            yield from _imports_in(ast.iter_child_nodes(node), "function" if kind == "module" else kind)
        elif isinstance(node, ast.If) and _is_type_checking(node.test):
            yield from _imports_in(node.body, "type_checking")
            yield from _imports_in(node.orelse, kind)
        else:
            yield from _imports_in(ast.iter_child_nodes(node), kind)


def _resolve(importer: str, is_package: bool, node: ast.Import | ast.ImportFrom, known: set[str]) -> list[str]:
    if isinstance(node, ast.Import):
        return [alias.name for alias in node.names]
    base = node.module or ""
    if node.level:  # relative: from the importer's package, one level up per extra dot
        package = importer.split(".") if is_package else importer.split(".")[:-1]
        anchor = package[: len(package) - (node.level - 1)]
        base = ".".join(anchor + ([base] if base else []))
    # `from a import b` imports the submodule a.b when there is one, else the name b of a.
    return [f"{base}.{alias.name}" if f"{base}.{alias.name}" in known else base for alias in node.names]


def _initialized(importer: str, target: str) -> list[str]:
    """`target` and the packages above it that importing it runs, less the importer's own packages."""
    parts = target.split(".")
    above = [".".join(parts[:n]) for n in range(1, len(parts))]
    return [p for p in above if not _within(importer, p)] + [target]


def import_graph() -> list[Import]:
    files = _source_files()
    known = set(files)
    imports = set()
    for module, path in files.items():
        tree = ast.parse(path.read_text(), filename=str(path))
        for node, kind in _imports_in(tree.body, "module"):
            for named in _resolve(module, path.name == "__init__.py", node, known):
                for target in _initialized(module, named):
                    imports.add(Import(module, target, node.lineno, kind))
    return sorted(imports, key=str)


def _within(target: str, package: str) -> bool:
    return target == package or target.startswith(package + ".")


def _violations(imports: Iterable[Import], importer_package: str, forbidden: Iterable[str]) -> list[str]:
    return [str(i) for i in imports if _within(i.importer, importer_package)
            and any(_within(i.target, package) for package in forbidden)]


def strongly_connected(edges: dict[str, set[str]]) -> list[frozenset[str]]:
    """The graph's strongly connected components of more than one module, or of one importing itself
    (Tarjan's algorithm, iterative: the graph has a few hundred modules)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    found = []
    for start in sorted(edges):
        if start in index:
            continue
        work = [(start, iter(sorted(edges[start])))]
        index[start] = low[start] = len(index)
        stack.append(start)
        on_stack.add(start)
        while work:
            node, successors = work[-1]
            for successor in successors:
                if successor not in index:
                    index[successor] = low[successor] = len(index)
                    stack.append(successor)
                    on_stack.add(successor)
                    work.append((successor, iter(sorted(edges.get(successor, ())))))
                    break
                if successor in on_stack:
                    low[node] = min(low[node], index[successor])
            else:
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
                    if len(component) > 1 or node in edges.get(node, ()):
                        found.append(frozenset(component))
    return found


def _a_cycle(component: frozenset[str], edges: dict[str, set[str]]) -> list[str]:
    """One shortest closed path through the component's first module, to name in a failure."""
    start = min(component)
    paths = {start: [start]}
    frontier = [start]
    while frontier:
        following = []
        for node in frontier:
            for successor in sorted(edges.get(node, set()) & component):
                if successor == start:
                    return paths[node] + [start]
                if successor not in paths:
                    paths[successor] = paths[node] + [successor]
                    following.append(successor)
        frontier = following
    return [start]


def _edges(imports: Iterable[Import], kinds: set[str]) -> dict[str, set[str]]:
    known = set(_source_files())
    edges: dict[str, set[str]] = {module: set() for module in known}
    for i in imports:
        if i.kind in kinds and i.target in known and i.target != i.importer:
            edges[i.importer].add(i.target)
    return edges


def _describe(components: Iterable[frozenset[str]], edges: dict[str, set[str]]) -> list[str]:
    return sorted(" -> ".join(_a_cycle(c, edges)) + f"  (component: {', '.join(sorted(c))})" for c in components)


@pytest.fixture(scope="module")
def imports() -> list[Import]:
    return import_graph()


def _in_domain(module: str) -> bool:
    return _within(module, "beam_rl") and not any(_within(module, room) for room in ABOVE_THE_DOMAIN)


def _domain_violations(imports: Iterable[Import], forbidden: Iterable[str]) -> list[str]:
    return [str(i) for i in imports if _in_domain(i.importer) and any(_within(i.target, f) for f in forbidden)]


def test_the_graph_sees_every_kind_of_import(imports):
    # The reader of this file's rules must be able to trust that nothing is missed: the CLI's
    # function-local imports of the job layer and the TYPE_CHECKING imports are in the graph.
    kinds = {i.kind for i in imports}
    assert kinds == {"module", "function", "type_checking"}
    assert any(i.importer == CLI and _within(i.target, JOB) and i.kind == "function" for i in imports)
    assert any(_in_domain(i.importer) for i in imports) and not _in_domain(JOB + ".run")


def test_schemas_import_nothing_of_the_package(imports):
    assert _violations(imports, "schemas", ("beam_rl", "transforms", "runners")) == []


def test_the_domain_imports_neither_beam_nor_anything_above_it(imports):
    # The wiring hands every domain module its parts: none builds them from the config through it.
    assert _domain_violations(imports, ("apache_beam", "transforms", "runners", *ABOVE_THE_DOMAIN)) == []


def test_the_wiring_imports_only_the_domain(imports):
    assert _violations(imports, WIRING, ("apache_beam", "transforms", "runners", JOB, CLI)) == []


def test_the_transforms_import_neither_the_runners_nor_the_job(imports):
    assert _violations(imports, "transforms", ("runners", JOB, CLI)) == []


def test_the_runner_tooling_imports_neither_the_steps_nor_the_wiring_nor_the_job(imports):
    assert _violations(imports, "runners", ("transforms", WIRING, JOB, CLI)) == []


def test_the_job_layer_never_imports_the_cli(imports):
    assert _violations(imports, JOB, (CLI,)) == []


def test_the_cli_reaches_beam_only_when_a_command_runs_it(imports):
    # `beam-rl --help`, `status` and `config` never import Beam: the job layer and the runners are
    # imported inside the commands that start them.
    eager = [str(i) for i in imports if i.importer == CLI and i.kind == "module"
             and any(_within(i.target, room) for room in (JOB, "runners", "transforms", "apache_beam"))]
    assert eager == []


def _check_cycles(imports: list[Import], kinds: set[str], known: frozenset[frozenset[str]]) -> None:
    edges = _edges(imports, kinds)
    found = set(strongly_connected(edges))
    assert _describe(found - known, edges) == [], "import cycles not in the known list (a new one, or a known one grown)"
    assert sorted(map(sorted, known - found)) == [], "known cycles gone or shrunk: update the list"


def test_no_cycle_among_module_level_imports_but_the_known_one(imports):
    _check_cycles(imports, {"module"}, KNOWN_MODULE_LEVEL_CYCLES)


def test_the_cycles_through_function_local_and_type_checking_imports_are_the_known_ones(imports):
    _check_cycles(imports, {"module", "function", "type_checking"}, KNOWN_HIDDEN_CYCLES)


def test_the_cycle_finder_finds_and_names_a_cycle():
    edges = {"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"d"}, "e": {"a"}}
    assert set(strongly_connected(edges)) == {frozenset("abc"), frozenset("d")}
    assert _describe([frozenset("abc")], edges) == ["a -> b -> c -> a  (component: a, b, c)"]
