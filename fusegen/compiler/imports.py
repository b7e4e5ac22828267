"""Stage 6: the import block of a generated file: exactly the globals its classes use.

Unchanged helpers are imported from the original modeling module rather than
copied, so a generated file stays small and picks up upstream fixes. Every
name comes from that module's namespace, typing helpers included (their home
differs between Python versions, the modeling module's spelling does not);
only modules (`torch`, `nn`) are imported by their own name.
"""

from __future__ import annotations

import ast
import builtins
import inspect
import symtable
import sys
from types import ModuleType

from fusegen.core.astutil import walk
from fusegen.errors import InputError

RUNTIME_MODULE = "fusegen.runtime"


def global_names(source: str) -> set[str]:
    """Names `source` reads from outside itself: globals it uses but never defines."""
    module = symtable.symtable(source, "<generated>", "exec")
    defined = {symbol.get_name() for symbol in module.get_symbols() if symbol.is_assigned()}
    used: set[str] = set()

    def visit(table: symtable.SymbolTable) -> None:
        for symbol in table.get_symbols():
            if symbol.is_referenced() and (symbol.is_global() or table is module):
                used.add(symbol.get_name())
        for child in table.get_children():
            visit(child)

    visit(module)
    return used - defined


def import_block(emitted: dict, skip: set[str], runtime: set[str], runtime_if_used: set[str]) -> list[str]:
    """The import lines of a generated file holding the (renamed) class statements of `emitted`.

    Every global a class reads, less `skip` (the file's own classes and module-level names), is imported as its
    module binds it (`use` aliases a name two modules bind differently); `runtime` names of fusegen.runtime are
    imported always (the template calls them), `runtime_if_used` only where a class reads them.
    """
    used: dict[str, tuple[ModuleType | None, str]] = {}
    for item in emitted.values():
        for used_name in sorted(global_names(ast.unparse(item.classdef)) - skip):
            use(used, used_name, item)
    for name in runtime | (runtime_if_used & set(used)):
        module = used.get(name, (None, ""))[0]
        if module is not None and name in vars(module):  # the class reads the module's own, not fusegen's
            raise InputError(
                f"{module.__name__}: its code reads its own {name!r}, a name the generated file imports from "
                f"{RUNTIME_MODULE}; rename it in the modeling module"
            )
        used[name] = (None, "")
    return import_lines(used, runtime | runtime_if_used)


def use(used: dict[str, tuple[ModuleType | None, str]], name: str, item) -> None:
    """Record that `item`'s class reads the global `name` from its module.

    Two modules may bind one name to different objects (each model module has
    its own `eager_attention_forward`); the later one is then imported under
    a prefixed alias and its class's references renamed to it.
    """
    module = item.module
    previous = used.setdefault(name, (module, name))[0]
    if previous is module or getattr(previous, name, None) is getattr(module, name, None):
        return
    alias = f"{module.__name__.rpartition('.')[2].removeprefix('modeling_')}_{name}"
    for node in walk(item.classdef):
        if isinstance(node, ast.Name) and node.id == name:
            node.id = alias
    used[alias] = (module, name)


def import_lines(used: dict[str, tuple[ModuleType | None, str]], runtime_names: set[str]) -> list[str]:
    """Sorted import statements binding each name as its module binds it.

    `used` maps each name the generated code reads to the modeling module
    whose code reads it and the name there (they differ for an alias); None
    for names of `fusegen.runtime`.
    """
    plain: set[str] = set()
    from_imports: dict[str, set[str]] = {}
    for local in sorted(used):
        source_module, name = used[local]
        if local in runtime_names:
            from_imports.setdefault(RUNTIME_MODULE, set()).add(local)
            continue
        namespace = vars(source_module)
        if name not in namespace:
            if hasattr(builtins, name) and local == name:
                continue
            raise InputError(f"{source_module.__name__}: the generated code uses {name!r}, which it does not define")
        value = namespace[name]
        if inspect.ismodule(value):
            parent, _, leaf = value.__name__.rpartition(".")
            if value.__name__ == local:
                plain.add(f"import {local}")
            elif leaf == local:
                from_imports.setdefault(parent, set()).add(local)
            else:
                plain.add(f"import {value.__name__} as {local}")
            continue
        from_imports.setdefault(source_module.__name__, set()).add(name if local == name else f"{name} as {local}")
    standard = sorted(line for line in plain if line.split()[1].partition(".")[0] in sys.stdlib_module_names)
    plain -= set(standard)
    third_party = sorted(plain) + [
        line
        for module_name in sorted(from_imports)
        if module_name != RUNTIME_MODULE
        for line in _from_lines(module_name, from_imports[module_name])
    ]
    first_party = [_from_line(RUNTIME_MODULE, from_imports[RUNTIME_MODULE])] if RUNTIME_MODULE in from_imports else []
    # isort's layout: the standard library (`math`), a blank line, third-party imports, a blank line, fusegen's own.
    groups = [group for group in (standard, third_party, first_party) if group]
    return [line for index, group in enumerate(groups) for line in ([""] if index else []) + group]


def _from_lines(module_name: str, names: set[str]) -> list[str]:
    """The module's plain names in one statement, then each aliased name (`a as b`) in one of its own, as isort
    lays them out by default (ruff's `combine-as-imports = false`)."""
    plain = {name for name in names if " as " not in name}
    aliased = sorted(names - plain, key=_isort_key)
    return ([_from_line(module_name, plain)] if plain else []) + [f"from {module_name} import {a}" for a in aliased]


def _from_line(module_name: str, names: set[str]) -> str:
    return f"from {module_name} import {', '.join(sorted(names, key=_isort_key))}"


def _isort_key(name: str) -> tuple[int, str]:
    """isort's order-by-type: CONSTANTS, then Classes, then functions and variables; within each, case-insensitively
    (`Qwen2_5_VisionPatchEmbed` before `Qwen2_5_VLConfig`), as ruff sorts them."""
    return (0 if name.isupper() else 1 if name[:1].isupper() else 2, name.lower(), name)
