"""`fusegen diff`: what the compiler changed in each class of a generated file, as a unified diff against the source.

The right side is the generated file as it is checked in (`generated/fused_<model type>.py`, or the one
`--output-dir` holds); only when there is none is a fresh build diffed instead, and the command says so. The left
side is each class exactly as Transformers' file has it (decorators, comments and blank lines included, read through
linecache like the interpreter does). Generated classes are spliced from that very text (`fusegen.compiler.splice`),
so a diff shows only what fusion changed (the merged projections, the split, an injected guard and its reason), the
renamed class names, and a comment moved above a statement it sat in when that statement was replaced.

A class whose only change is the renamed class names (the decoder layer, the model and the causal LM of most files:
they are copied only because they build a fused class) is listed by name instead of diffed; so is a pretrained base
whose only other change is fusegen's runtime base class (`fusegen.compiler.runtime_base.MIXIN`) put first.
"""

from __future__ import annotations

import ast
import difflib
import re
import sys
from dataclasses import dataclass, field
from types import ModuleType

from fusegen.compiler.propagate import PREFIX
from fusegen.compiler.runtime_base import MIXIN
from fusegen.compiler.splice import original_text


@dataclass
class FileDiff:
    """What a generated file changed, class by class, against the module it was built from."""

    diffs: list[str] = field(default_factory=list)
    """One unified diff per class with a change beyond the renames, in file order."""
    renamed: list[str] = field(default_factory=list)
    """Generated classes that are their original with the class names renamed, and nothing else."""
    based: list[str] = field(default_factory=list)
    """Generated classes that are their original renamed, with `MIXIN` added as the first base, and nothing else."""


def file_diff(text: str, module: ModuleType, label: str) -> FileDiff:
    """Compare each class of the generated module `text` with the class of `module` (the target's modeling module)
    it was made from; `label` names the generated file in the diffs' `+++` lines."""
    tree = ast.parse(text)
    lines = text.splitlines(keepends=True)
    classes = [node for node in tree.body if isinstance(node, ast.ClassDef) and node.name.startswith(PREFIX)]
    originals = {node.name: node.name.removeprefix(PREFIX) for node in classes}
    originals.update(_tables(tree))
    result = FileDiff()
    for node in classes:
        original_name = originals[node.name]
        home = _home(module, original_name)
        original = original_text(home, original_name)
        generated = _statement_text(lines, node)
        back = _renamed_back(generated, originals)
        if back == original:
            result.renamed.append(node.name)
            continue
        if back.replace(f"({MIXIN}, ", "(", 1) == original and f"({MIXIN}, " in back:
            result.based.append(node.name)
            continue
        result.diffs.append(
            "".join(
                difflib.unified_diff(
                    original.splitlines(keepends=True),
                    generated.splitlines(keepends=True),
                    fromfile=f"{home.__name__}.{original_name}",
                    tofile=f"{label}.{node.name}",
                )
            )
        )
    return result


def summary(label: str, result: FileDiff) -> str:
    """The lines naming the classes that were not diffed (empty if every class changed)."""
    lines = []
    if result.renamed:
        lines.append(f"{label}: renamed class names only, not shown: {', '.join(result.renamed)}\n")
    if result.based:
        names = ", ".join(result.based)
        lines.append(f"{label}: renamed class names and {MIXIN} added as first base only, not shown: {names}\n")
    return "".join(lines)


def _tables(tree: ast.Module) -> dict[str, str]:
    """`{FUSED_X: X}` for the class tables the file defines (`fusegen.compiler.propagate.fused_names`)."""
    prefix = f"{PREFIX.upper()}_"
    return {
        target.id: target.id.removeprefix(prefix)
        for node in tree.body
        if isinstance(node, ast.Assign)
        for target in node.targets
        if isinstance(target, ast.Name) and target.id.startswith(prefix)
    }


def _home(module: ModuleType, name: str) -> ModuleType:
    """The module whose source defines class `name` as `module` sees it (a class may come from another file)."""
    found = getattr(module, name, None)
    if isinstance(found, type) and found.__module__ in sys.modules:
        return sys.modules[found.__module__]
    return module


def _statement_text(lines: list[str], node: ast.ClassDef) -> str:
    first = min([node.lineno, *(decorator.lineno for decorator in node.decorator_list)])
    return "".join(lines[first - 1 : node.end_lineno])


def _renamed_back(text: str, originals: dict[str, str]) -> str:
    """`text` with every generated name in `originals` (as a whole word) spelled as the original again."""
    if not originals:
        return text
    pattern = re.compile(r"\b(" + "|".join(map(re.escape, sorted(originals, key=len, reverse=True))) + r")\b")
    return pattern.sub(lambda match: originals[match.group(1)], text)
