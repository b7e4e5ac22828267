"""`fusegen diff`: what the compiler changed in each fused class, as a unified diff against the real source.

The left side is the class exactly as Transformers' file has it (decorators, comments and blank lines
included, read through linecache like the interpreter does); the right side is the class as the generated
file has it. Generated classes are spliced from that very text (`fusegen.compiler.splice`), so the diff
shows only what fusion changed (the merged projections, the split) and the renamed class names, plus a
comment moved above a statement it sat in when that statement was replaced.
"""

from __future__ import annotations

import ast
import difflib
import sys

from fusegen.compiler.propagate import fused_name
from fusegen.compiler.splice import original_text


def class_diffs(result) -> list[str]:
    """One unified diff per fused class of a `BuildResult`."""
    generated = ast.parse(result.text)
    lines = result.text.splitlines(keepends=True)
    diffs = []
    for cls in result.fused_classes:
        original = original_text(sys.modules[cls.__module__], cls.__name__)
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
