"""`fusegen diff`: what the compiler changed in each fused class, as a unified diff.

The original class is put through the same formatting as the generated one
(parsed, unparsed, black), so the diff shows what changed in the code (the
merged projections, the split, the renamed references), not comments or
line wrapping.
"""

from __future__ import annotations

import ast
import difflib

from fusegen.compiler import astutil
from fusegen.compiler.propagate import fused_name
from fusegen.compiler.render import format_source


def class_diffs(result) -> list[str]:
    """One unified diff per fused class of a `BuildResult`."""
    generated = ast.parse(result.text)
    lines = result.text.splitlines(keepends=True)
    diffs = []
    for cls in result.fused_classes:
        original = format_source(ast.unparse(astutil.parse_class(cls)))
        fused = _class_source(generated, lines, fused_name(cls.__name__))
        diffs.append(
            "".join(
                difflib.unified_diff(
                    original.splitlines(keepends=True),
                    fused.splitlines(keepends=True),
                    fromfile=f"{cls.__module__}.{cls.__name__}",
                    tofile=f"fused_{result.target.model_type}.{fused_name(cls.__name__)}",
                )
            )
        )
    return diffs


def _class_source(tree: ast.Module, lines: list[str], name: str) -> str:
    classdef = next(node for node in tree.body if isinstance(node, ast.ClassDef) and node.name == name)
    first = min([classdef.lineno, *(decorator.lineno for decorator in classdef.decorator_list)])
    return "".join(lines[first - 1 : classdef.end_lineno])
