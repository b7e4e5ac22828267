"""The layers of the tree: the compiler, the fusion kinds and the runtime never import a tool."""

import ast
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1] / "fusegen"


def imported_modules(path: Path) -> set[str]:
    """Every module an `import` or `from ... import` anywhere in the file names (lazy imports included)."""
    found = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            found.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            found.add(node.module)
            found.update(f"{node.module}.{alias.name}" for alias in node.names)
    return found


def test_no_layer_below_the_tools_imports_a_tool():
    offenders = []
    for package in ("compiler", "fusions", "runtime"):
        for path in sorted((ROOT / package).glob("*.py")):
            tools = sorted(name for name in imported_modules(path) if name.startswith("fusegen.tools"))
            offenders += [f"{path.relative_to(ROOT.parent)} imports {name}" for name in tools]
    assert not offenders, offenders


def test_the_runtime_imports_neither_the_compiler_nor_the_test_kit():
    """Generated files import only torch, transformers and fusegen.runtime; the runtime must not drag in more."""
    offenders = []
    for path in sorted((ROOT / "runtime").glob("*.py")):
        names = imported_modules(path)
        offenders += [
            f"{path.name} imports {name}"
            for name in sorted(names)
            if name.startswith(("fusegen.compiler", "fusegen.tools", "fusegen.testkit", "fusegen.fusions"))
        ]
    assert not offenders, offenders
