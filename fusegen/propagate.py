"""Stage 6: every class that (transitively) names a fused class is emitted too.

The decoder layer constructs the fused attention, the model constructs the
decoder layer, the causal LM the model; the pretrained base names module
classes in `_can_record_outputs`, and the model classes inherit from it. Each
of them is copied with those references renamed to the fused classes, so the
generated file holds a self-contained tree from the causal LM down.
"""

from __future__ import annotations

import ast
import sys
from dataclasses import dataclass
from types import ModuleType

from torch import nn

from fusegen import astutil
from fusegen.errors import InputError
from fusegen.plan import Refused

PREFIX = "Fused"


def fused_name(name: str) -> str:
    return PREFIX + name


@dataclass
class Emitted:
    """A class statement to write into the generated file, and the module it came from."""

    classdef: ast.ClassDef
    module: ModuleType


def classes_to_emit(
    target_module: ModuleType, model: nn.Module, rewritten: dict[type, ast.ClassDef]
) -> dict[str, Emitted]:
    """Class statements to emit, keyed by original name, each after what its body needs.

    `rewritten` holds the fused classes; any class the model is built from
    that uses one of the emitted names (in its body or bases) joins them,
    until nothing more changes. A class may live in another model's module
    (`got_ocr2` builds on other models' classes); it is read in its own
    module's terms.
    """
    universe = _model_classes(target_module, model)
    by_name: dict[str, type] = {}
    for cls in [*rewritten, *universe]:
        if by_name.setdefault(cls.__name__, cls) is not cls:
            raise InputError(
                f"two classes named {cls.__name__} ({cls.__module__}, {by_name[cls.__name__].__module__})"
            )
    emitted = {cls.__name__: Emitted(classdef, sys.modules[cls.__module__]) for cls, classdef in rewritten.items()}
    sources: dict[str, ast.ClassDef | Refused] = {}
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
            if not isinstance(classdef, Refused) and astutil.loaded_names(classdef) & set(emitted):
                emitted[cls.__name__] = Emitted(classdef, sys.modules[cls.__module__])
                changed = True
    for cls in universe:
        if isinstance(sources.get(cls.__name__), Refused) and _uses_any(cls, emitted):
            raise InputError(f"{cls.__name__} must be regenerated but {sources[cls.__name__].reason}")
    return _definition_order(emitted, target_module)


def constructed_classes(emitted: dict[str, Emitted], root: str) -> set[str]:
    """Emitted classes the causal LM `root` can actually build: named in a method (not in a type check), or a base.

    A class picked out of a module-level table (`ATTENTION_CLASSES[kind](...)`)
    or built through `AutoModel.from_config` is never named where it is built;
    its fused copy would sit unused in the generated file (and type checks
    renamed to it would stop matching the original that is built instead), so
    its fusion is refused.
    """
    reached = {root} if root in emitted else set()
    frontier = list(reached)
    while frontier:
        classdef = emitted[frontier.pop()].classdef
        named = set().union(*(_built_names(stmt) for stmt in classdef.body if isinstance(stmt, ast.FunctionDef)))
        bases = {base.id for base in classdef.bases if isinstance(base, ast.Name)}
        for name in (named | bases) & set(emitted) - reached:
            reached.add(name)
            frontier.append(name)
    return reached


def _built_names(function: ast.FunctionDef) -> set[str]:
    """Names a method reads, except as the type in `isinstance`/`issubclass` (a check, not a construction)."""
    checked = {
        id(node)
        for call in ast.walk(function)
        if isinstance(call, ast.Call)
        and isinstance(call.func, ast.Name)
        and call.func.id in ("isinstance", "issubclass")
        for argument in call.args[1:]
        for node in ast.walk(argument)
    }
    return {
        node.id
        for node in ast.walk(function)
        if isinstance(node, ast.Name) and isinstance(node.ctx, ast.Load) and id(node) not in checked
    }


def _definition_order(emitted: dict[str, Emitted], target_module: ModuleType) -> dict[str, Emitted]:
    """Source order, adjusted so every class follows the classes its bases and body name."""
    pending = sorted(
        emitted,
        key=lambda name: (
            emitted[name].module is target_module,
            emitted[name].module.__name__,
            emitted[name].classdef.lineno,
        ),
    )
    needs = {name: _class_level_names(emitted[name].classdef) & set(emitted) - {name} for name in emitted}
    ordered: dict[str, Emitted] = {}
    while pending:
        ready = next((name for name in pending if needs[name] <= set(ordered)), None)
        if ready is None:
            raise InputError(f"the classes {', '.join(pending)} need each other at class level")
        ordered[ready] = emitted[ready]
        pending.remove(ready)
    return ordered


def _class_level_names(classdef: ast.ClassDef) -> set[str]:
    """Names evaluated when the class statement runs (bases, decorators, attributes), not in methods."""
    parts = [*classdef.bases, *classdef.keywords, *classdef.decorator_list]
    parts += [stmt for stmt in classdef.body if not isinstance(stmt, (ast.FunctionDef, ast.AsyncFunctionDef))]
    return set().union(*(astutil.loaded_names(part) for part in parts)) if parts else set()


def _model_classes(target_module: ModuleType, model: nn.Module) -> list[type]:
    """Model-specific classes the model is built from (module classes and their bases).

    Classes of the target module or of any Transformers model module count;
    Transformers' shared machinery (`PreTrainedModel`, `GenerationMixin`) does not.
    """
    seen: dict[type, None] = {}
    for instance in model.modules():
        for cls in type(instance).__mro__:
            if cls.__module__ == target_module.__name__ or cls.__module__.startswith("transformers.models."):
                seen.setdefault(cls)
    return list(seen)


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
