"""Stage 6: every class that (transitively) names a fused class is emitted too.

The decoder layer constructs the fused attention, the model constructs the
decoder layer, the causal LM the model; the pretrained base names module
classes in `_can_record_outputs`, and the model classes inherit from it. Each
of them is copied with those references renamed to the fused classes, so the
generated file holds a self-contained tree from the causal LM down.
"""

from __future__ import annotations

import ast
from types import ModuleType

from torch import nn

from fusegen import astutil
from fusegen.errors import InputError
from fusegen.plan import Refused

PREFIX = "Fused"


def fused_name(name: str) -> str:
    return PREFIX + name


def classes_to_emit(
    module: ModuleType, model: nn.Module, rewritten: dict[str, ast.ClassDef]
) -> dict[str, ast.ClassDef]:
    """Class statements to emit, keyed by original name, in source order.

    `rewritten` holds the fused classes; any class of the model's own module
    that uses one of the emitted names (in its body or bases) joins them,
    until nothing more changes.
    """
    universe = _model_classes(module, model)
    sources: dict[str, ast.ClassDef] = {}
    emitted = dict(rewritten)
    changed = True
    while changed:
        changed = False
        for cls in universe:
            if cls.__name__ in emitted:
                continue
            if cls.__name__ not in sources:
                try:
                    sources[cls.__name__] = astutil.parse_class(cls)
                except Refused as refusal:
                    sources[cls.__name__] = refusal
            classdef = sources[cls.__name__]
            if isinstance(classdef, Refused):
                continue
            if astutil.loaded_names(classdef) & set(emitted):
                emitted[cls.__name__] = classdef
                changed = True
    for cls in universe:
        if isinstance(sources.get(cls.__name__), Refused) and _uses_any(cls, emitted):
            raise InputError(f"{cls.__name__} must be regenerated but {sources[cls.__name__].reason}")
    return dict(sorted(emitted.items(), key=lambda item: item[1].lineno))


def _model_classes(module: ModuleType, model: nn.Module) -> list[type]:
    """Classes defined in `module` that the model is built from (modules and bases)."""
    seen: dict[str, type] = {}
    for instance in model.modules():
        for cls in type(instance).__mro__:
            if cls.__module__ == module.__name__ and cls.__name__ not in seen:
                seen[cls.__name__] = cls
    return list(seen.values())


def _uses_any(cls: type, names: dict) -> bool:
    code_names: set[str] = set()
    for value in vars(cls).values():
        code = getattr(value, "__code__", None)
        if code is not None:
            code_names |= set(code.co_names)
    return bool(code_names & set(names)) or any(base.__name__ in names for base in cls.__bases__)


def rename_classes(classdef: ast.ClassDef, renames: dict[str, str]) -> None:
    """Point every reference to an emitted class at its fused copy, in place.

    Names, the class's own name, and string constants equal to a class name
    (`_no_split_modules = ["LlamaDecoderLayer"]`) are renamed.
    """
    if classdef.name in renames:
        classdef.name = renames[classdef.name]
    for node in ast.walk(classdef):
        if isinstance(node, ast.Name) and node.id in renames:
            node.id = renames[node.id]
        elif isinstance(node, ast.Constant) and isinstance(node.value, str) and node.value in renames:
            node.value = renames[node.value]
