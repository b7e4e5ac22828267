"""The layers of the tree, proved on the import graph: imports point one way, nothing cycles, no private name crosses
a module boundary.

The layers, top to bottom (`LAYERS`): the command line, the tools, the test kit, the compiler's stages, the fusion
kinds, the shared core, the runtime, then `fusegen.errors` and the package itself. A module may import its own layer
or any layer below it, never one above. The graph is built with `ast` from every module of `fusegen/`, with every
import in it: module-level, inside functions (a lazy import hides a cycle from the interpreter, not from this test)
and under `if TYPE_CHECKING`. Run `python tests/test_layering.py [ROOT]` to print the figures for a checkout.
"""

from __future__ import annotations

import ast
import sys
from dataclasses import dataclass, field
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1] / "fusegen"

LAYERS = (
    ("fusegen.__main__", "fusegen.cli"),
    ("fusegen.tools",),
    ("fusegen.testkit",),
    ("fusegen.compiler",),
    ("fusegen.fusions",),
    ("fusegen.core",),
    ("fusegen.runtime",),
    ("fusegen.errors", "fusegen"),
)
"""Top first. A module belongs to the layer of the longest prefix naming it (`fusegen` itself last)."""


@dataclass(frozen=True)
class Import:
    importer: str
    imported: str
    """A module of the tree (the module an `import a.b` or `from a.b import c` names, or `a.b.c` if that is one)."""
    lazy: bool
    """Inside a function: runs when the function is called, not when the importer is imported."""
    line: int


@dataclass
class Graph:
    modules: dict[str, Path]
    imports: list[Import] = field(default_factory=list)
    private: list[str] = field(default_factory=list)
    """`from x import _name` or `x._name`, x another module of the tree."""
    unknown: list[str] = field(default_factory=list)
    """Imports of a `fusegen` module that does not exist."""


def module_name(path: Path, root: Path) -> str:
    parts = list(path.relative_to(root.parent).with_suffix("").parts)
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def absolute(importer: str, node: ast.ImportFrom, is_package: bool) -> str:
    """The module a `from` import names, relative imports resolved against `importer`."""
    if not node.level:
        return node.module or ""
    base = importer.split(".") if is_package else importer.split(".")[:-1]
    base = base[: len(base) - (node.level - 1)]
    return ".".join(base + ([node.module] if node.module else []))


def build_graph(root: Path = ROOT) -> Graph:
    """Every import between the modules of the tree under `root` (the `fusegen` package directory)."""
    graph = Graph({module_name(path, root): path for path in sorted(root.rglob("*.py"))})
    for name, path in graph.modules.items():
        _scan(graph, name, path)
    graph.imports = list(dict.fromkeys(graph.imports))  # `from m import a, b` is one import of m
    return graph


def _scan(graph: Graph, name: str, path: Path) -> None:
    tree = ast.parse(path.read_text())
    modules = graph.modules
    local_modules: dict[str, str] = {}  # a name bound to a module of the tree -> that module

    def add(imported: str, node: ast.stmt, lazy: bool) -> None:
        if imported in modules:
            graph.imports.append(Import(name, imported, lazy, node.lineno))
        else:
            graph.unknown.append(f"{name}:{node.lineno} imports {imported}, which is not a module of the tree")

    def visit(node: ast.AST, lazy: bool) -> None:
        for child in ast.iter_child_nodes(node):
            inner = lazy or isinstance(child, (ast.FunctionDef, ast.AsyncFunctionDef, ast.Lambda))
            if isinstance(child, ast.Import):
                for alias in child.names:
                    if alias.name.split(".")[0] == "fusegen":
                        add(alias.name, child, lazy)
                        if alias.asname:
                            local_modules[alias.asname] = alias.name
            elif isinstance(child, ast.ImportFrom):
                source = absolute(name, child, path.name == "__init__.py")
                if source.split(".")[0] != "fusegen":
                    continue
                for alias in child.names:
                    full = f"{source}.{alias.name}"
                    if full in modules:
                        add(full, child, lazy)
                        local_modules[alias.asname or alias.name] = full
                    else:
                        add(source, child, lazy)
                        if alias.name.startswith("_") and not alias.name.startswith("__"):
                            graph.private.append(f"{name}:{child.lineno}: from {source} import {alias.name}")
            visit(child, inner)

    visit(tree, False)
    for node in ast.walk(tree):
        private = isinstance(node, ast.Attribute) and node.attr.startswith("_") and not node.attr.startswith("__")
        if private and isinstance(node.value, ast.Name) and node.value.id in local_modules:
            graph.private.append(f"{name}:{node.lineno}: {node.value.id}.{node.attr}")


def layer(module: str) -> int:
    """The index in `LAYERS` of the longest prefix naming `module`."""
    best, found = -1, None
    for index, prefixes in enumerate(LAYERS):
        for prefix in prefixes:
            if (module == prefix or module.startswith(prefix + ".")) and len(prefix) > best:
                best, found = len(prefix), index
    assert found is not None, f"{module} is in no layer of LAYERS"
    return found


def cycles(graph: Graph) -> list[list[str]]:
    """The strongly connected components of more than one module (Tarjan), lazy imports included."""
    edges: dict[str, set[str]] = {}
    for edge in graph.imports:
        if edge.importer != edge.imported:
            edges.setdefault(edge.importer, set()).add(edge.imported)
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    found: list[list[str]] = []

    def connect(node: str) -> None:
        index[node] = low[node] = len(index)
        stack.append(node)
        on_stack.add(node)
        for successor in sorted(edges.get(node, ())):
            if successor not in index:
                connect(successor)
                low[node] = min(low[node], low[successor])
            elif successor in on_stack:
                low[node] = min(low[node], index[successor])
        if low[node] == index[node]:
            component = []
            while True:
                member = stack.pop()
                on_stack.discard(member)
                component.append(member)
                if member == node:
                    break
            if len(component) > 1:
                found.append(sorted(component))

    for node in sorted(graph.modules):
        if node not in index:
            connect(node)
    return found


def upward(graph: Graph) -> list[str]:
    """Imports of a layer above the importer's."""
    return [
        f"{edge.importer}:{edge.line} imports {edge.imported}{' (lazily)' if edge.lazy else ''}"
        for edge in graph.imports
        if layer(edge.imported) < layer(edge.importer)
    ]


def figures(graph: Graph) -> dict[str, int]:
    """The numbers the architecture is measured by."""
    lazy = [edge for edge in graph.imports if edge.lazy]
    return {
        "modules": len(graph.modules),
        "imports between modules": len({(edge.importer, edge.imported) for edge in graph.imports}),
        "function-level imports of fusegen modules": len(lazy),
        "  of which in fusegen.compiler": sum(edge.importer.startswith("fusegen.compiler") for edge in lazy),
        "modules in import cycles": sum(len(component) for component in cycles(graph)),
        "import cycles (strongly connected components)": len(cycles(graph)),
        "imports of a higher layer": len(upward(graph)),
        "private names used across modules": len(graph.private),
    }


GRAPH = build_graph()


def test_the_graph_sees_every_kind_of_import():
    """The scan finds module-level, lazy and relative imports (else the tests below would pass on an empty graph)."""
    edges = {(edge.importer, edge.imported, edge.lazy) for edge in GRAPH.imports}
    assert ("fusegen.compiler.match", "fusegen.fusions", False) in edges
    assert ("fusegen.runtime.pretrained", "fusegen.runtime.tp", True) in edges  # `from .tp import ...` in a function
    assert ("fusegen.runtime.loading", "fusegen.runtime.plan", False) in edges
    assert len(GRAPH.modules) > 60 and len(GRAPH.imports) > 150


def test_every_import_names_a_module_of_the_tree():
    assert not GRAPH.unknown, GRAPH.unknown


def test_imports_point_down_the_layers():
    """tools -> test kit -> compiler -> fusions -> core -> runtime: never up, lazily or not."""
    assert not upward(GRAPH), upward(GRAPH)


def test_no_import_cycles_lazy_imports_included():
    assert not cycles(GRAPH), cycles(GRAPH)


def test_no_private_name_is_used_across_modules():
    assert not GRAPH.private, GRAPH.private


def test_the_checks_fail_on_what_they_forbid(tmp_path):
    """A tree with an upward lazy import, a cycle and a private import across modules is caught by each check."""
    package = tmp_path / "fusegen"
    for directory in ("compiler", "fusions", "core"):
        (package / directory).mkdir(parents=True)
        (package / directory / "__init__.py").write_text("")
    (package / "__init__.py").write_text("")
    (package / "core" / "a.py").write_text("def f():\n    from fusegen.compiler import b\n")
    (package / "compiler" / "b.py").write_text("from fusegen.core.a import _hidden\nfrom fusegen.core import a\n")
    (package / "fusions" / "c.py").write_text("from . import d\n")
    (package / "fusions" / "d.py").write_text("def g():\n    from fusegen.fusions import c\n    return c._x\n")
    graph = build_graph(package)
    assert upward(graph) == ["fusegen.core.a:2 imports fusegen.compiler.b (lazily)"]
    assert sorted(map(tuple, cycles(graph))) == [
        ("fusegen.compiler.b", "fusegen.core.a"),
        ("fusegen.fusions.c", "fusegen.fusions.d"),
    ]
    assert graph.private == ["fusegen.compiler.b:1: from fusegen.core.a import _hidden", "fusegen.fusions.d:3: c._x"]


def test_no_layer_below_the_tools_imports_a_tool():
    offenders = [
        f"{edge.importer} imports {edge.imported}"
        for edge in GRAPH.imports
        if layer(edge.importer) > layer("fusegen.tools") and edge.imported.startswith("fusegen.tools")
    ]
    assert not offenders, offenders


def test_the_runtime_imports_neither_the_compiler_nor_the_test_kit():
    """Generated files import only torch, transformers and fusegen.runtime; the runtime must not drag in more."""
    offenders = [
        f"{edge.importer} imports {edge.imported}"
        for edge in GRAPH.imports
        if edge.importer.startswith("fusegen.runtime") and not edge.imported.startswith("fusegen.runtime")
    ]
    assert not offenders, offenders


def test_every_package_of_the_tree_is_installed():
    """pyproject's explicit package list names every package directory, so an installed fusegen has all of it."""
    import tomllib

    listed = set(tomllib.loads((ROOT.parent / "pyproject.toml").read_text())["tool"]["setuptools"]["packages"])
    packages = {module_name(path.parent / "__init__.py", ROOT) for path in ROOT.rglob("__init__.py")}
    assert packages <= listed, sorted(packages - listed)


if __name__ == "__main__":
    measured = build_graph(Path(sys.argv[1]) / "fusegen" if len(sys.argv) > 1 else ROOT)
    for label, count in figures(measured).items():
        print(f"{label}: {count}")
    for component in cycles(measured):
        print("cycle:", " <-> ".join(component))
    for line in upward(measured) + measured.private + measured.unknown:
        print(line)
