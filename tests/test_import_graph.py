"""The layering of mmad's packages, read from the source: front ends (:mod:`mmad.server`, HTTP;
:mod:`mmad.grpc`) over the engine (:mod:`mmad.engine`) over the backends (:mod:`mmad.backends`).

Every import counts, at module level or inside a function (a lazy import is still a dependency);
only imports under ``if TYPE_CHECKING:`` are left out (they never run). The walker is checked on a
planted package too, so that a circle or an upward import would make these tests fail.
"""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
LAYERED = ("mmad.engine", "mmad.server", "mmad.grpc")
ABOVE_BACKENDS = ("mmad.engine", "mmad.server", "mmad.grpc", "mmad.bench", "mmad.cli")


def _module_name(path: Path, root: Path) -> str:
    parts = list(path.relative_to(root).with_suffix("").parts)
    if parts[-1] == "__init__":
        parts.pop()
    return ".".join(parts)


def _is_type_checking(test: ast.expr) -> bool:
    return (isinstance(test, ast.Name) and test.id == "TYPE_CHECKING") or (
        isinstance(test, ast.Attribute) and test.attr == "TYPE_CHECKING")


def _imports(tree: ast.AST, module: str, is_package: bool, known: set[str]) -> set[str]:
    """The modules of ``known`` that ``module``'s source imports (``from a import b`` counts as
    ``a.b`` where that is a module, else as ``a``)."""
    found: set[str] = set()
    package = module if is_package else module.rpartition(".")[0]

    def visit(node: ast.AST) -> None:
        if isinstance(node, ast.If) and _is_type_checking(node.test):
            for child in node.orelse:
                visit(child)
            return
        if isinstance(node, ast.Import):
            for alias in node.names:
                found.add(alias.name)
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                base = package.split(".")
                base = base[:len(base) - node.level + 1]
                target = ".".join(base + ([node.module] if node.module else []))
            else:
                target = node.module or ""
            for alias in node.names:
                submodule = f"{target}.{alias.name}"
                found.add(submodule if submodule in known else target)
        for child in ast.iter_child_nodes(node):
            visit(child)

    visit(tree)
    out = set()
    for name in found:
        # the deepest known module the name is (or lies in)
        while name and name not in known:
            name = name.rpartition(".")[0]
        if name and name != module:
            out.add(name)
    return out


def import_graph(root: Path, package: str) -> dict[str, set[str]]:
    """module → the modules of ``package`` (found under ``root``) it imports."""
    files = {}
    for path in sorted((root / package.replace(".", "/")).rglob("*.py")):
        files[_module_name(path, root)] = path
    known = set(files)
    graph = {}
    for module, path in files.items():
        tree = ast.parse(path.read_text(encoding="utf-8"), filename=str(path))
        imports = _imports(tree, module, path.name == "__init__.py", known)
        # importing a submodule runs its packages' __init__ too, but a package importing its own
        # submodules is no edge back to it
        graph[module] = {m for m in imports if not module.startswith(m + ".")}
    return graph


def circles(graph: dict[str, set[str]], among: tuple[str, ...]) -> list[list[str]]:
    """The import circles (strongly connected components of more than one module, or a module
    importing itself) among the modules under the packages ``among``."""

    def inside(m: str) -> bool:
        return any(m == p or m.startswith(p + ".") for p in among)

    nodes = sorted(m for m in graph if inside(m))
    edges = {m: sorted(n for n in graph[m] if inside(n)) for m in nodes}
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    found: list[list[str]] = []
    counter = [0]

    def connect(v: str) -> None:  # Tarjan's algorithm, iterative so deep packages do not recurse
        work = [(v, iter(edges[v]))]
        index[v] = low[v] = counter[0]
        counter[0] += 1
        stack.append(v)
        on_stack.add(v)
        while work:
            node, successors = work[-1]
            for w in successors:
                if w not in index:
                    index[w] = low[w] = counter[0]
                    counter[0] += 1
                    stack.append(w)
                    on_stack.add(w)
                    work.append((w, iter(edges[w])))
                    break
                if w in on_stack:
                    low[node] = min(low[node], index[w])
            else:
                work.pop()
                if work:
                    low[work[-1][0]] = min(low[work[-1][0]], low[node])
                if low[node] == index[node]:
                    component = []
                    while True:
                        w = stack.pop()
                        on_stack.discard(w)
                        component.append(w)
                        if w == node:
                            break
                    if len(component) > 1 or node in edges[node]:
                        found.append(sorted(component))

    for v in nodes:
        if v not in index:
            connect(v)
    return found


def edges_into(graph: dict[str, set[str]], sources: tuple[str, ...], targets: tuple[str, ...]) -> list[str]:
    """``a -> b`` for each import of a module under ``targets`` by a module under ``sources``."""

    def under(m: str, packages: tuple[str, ...]) -> bool:
        return any(m == p or m.startswith(p + ".") for p in packages)

    return sorted(f"{a} -> {b}" for a, deps in graph.items() if under(a, sources)
                  for b in deps if under(b, targets))


@pytest.fixture(scope="module")
def graph() -> dict[str, set[str]]:
    return import_graph(ROOT, "mmad")


def test_the_graph_holds_the_layers(graph):
    # the walker reads the real package: the layers are there and their known edges are found
    assert "mmad.engine.registry" in graph and "mmad.server.app" in graph and "mmad.grpc.service" in graph
    assert "mmad.engine.api" in graph["mmad.grpc.service"]
    assert "mmad.engine.registry" in graph["mmad.server.app"]


def test_no_import_circle_among_engine_server_grpc(graph):
    assert circles(graph, LAYERED) == []


def test_backends_import_nothing_above_them(graph):
    assert edges_into(graph, ("mmad.backends",), ABOVE_BACKENDS) == []


def test_engine_imports_no_front_end(graph):
    assert edges_into(graph, ("mmad.engine",), ("mmad.server", "mmad.grpc")) == []


# the engine's parts that hold model locks, device arrays, files or queues: a route or handler
# reaches them only through the engine's interface (mmad.engine.api, InProcessEngine)
ENGINE_INTERNALS = tuple(f"mmad.engine.{m}" for m in (
    "registry", "datasets", "jobs", "batcher", "store", "inference", "training", "region_forwards", "hostmem", "shm"))


def test_routes_and_handlers_reach_the_engine_through_its_interface(graph):
    assert edges_into(graph, ("mmad.server.routers", "mmad.grpc"), ENGINE_INTERNALS) == []
    # (the check sees these modules' imports: the routers do import the engine's interface)
    assert "mmad.engine.api" in graph["mmad.server.routers.jobs"]


# the routers that still read the process's runtime: the infer and train routes (their bodies
# are parsed against the shared-memory registry and counted in the HTTP metrics), Prometheus and
# the workers' internal routes. Every other router reaches the engine only.
RUNTIME_READERS = {f"mmad.server.routers.{m}" for m in ("metrics", "models", "training", "workers")}


def test_only_the_listed_routers_read_the_runtime(graph):
    readers = {m for m, imported in graph.items()
               if m.startswith("mmad.server.routers.") and "mmad.engine.runtime" in imported}
    assert readers == RUNTIME_READERS


def test_grpc_imports_nothing_of_the_http_front_end(graph):
    assert edges_into(graph, ("mmad.grpc",), ("mmad.server",)) == []


def _plant(root: Path, files: dict[str, str]) -> None:
    for name, text in files.items():
        path = root / name
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(text, encoding="utf-8")


def test_the_walker_finds_a_planted_circle(tmp_path):
    _plant(tmp_path, {
        "pkg/__init__.py": "",
        "pkg/engine/__init__.py": "",
        "pkg/engine/a.py": "from pkg.engine import b\n",
        "pkg/engine/b.py": "def f():\n    from pkg.server.c import g  # a lazy import is still an edge\n",
        "pkg/server/__init__.py": "",
        "pkg/server/c.py": "from ..engine.a import x\n",  # relative, back to a
        "pkg/server/d.py": "from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n    from pkg.engine import a\n",
        "pkg/backends/__init__.py": "",
        "pkg/backends/e.py": "import pkg.server.d\n",
    })
    planted = import_graph(tmp_path, "pkg")
    assert circles(planted, ("pkg.engine", "pkg.server")) == [["pkg.engine.a", "pkg.engine.b", "pkg.server.c"]]
    assert planted["pkg.server.d"] == set()  # TYPE_CHECKING-only imports never run
    assert edges_into(planted, ("pkg.backends",), ("pkg.server",)) == ["pkg.backends.e -> pkg.server.d"]
    assert edges_into(planted, ("pkg.engine",), ("pkg.server",)) == ["pkg.engine.b -> pkg.server.c"]


def test_the_walker_finds_no_circle_where_there_is_none(tmp_path):
    _plant(tmp_path, {
        "pkg/__init__.py": "",
        "pkg/a.py": "from pkg import b\n",
        "pkg/b.py": "import os\nfrom pkg.c import x\n",
        "pkg/c.py": "x = 1\n",
    })
    planted = import_graph(tmp_path, "pkg")
    assert planted["pkg.a"] == {"pkg.b"} and planted["pkg.b"] == {"pkg.c"}
    assert circles(planted, ("pkg",)) == []
