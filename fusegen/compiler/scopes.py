"""Stage 6: checkpoint scopes read off the source: under which attributes each merged linear's holders are built.

The generated file registers them (`parents=`) so a checkpoint's `<parent>.<projection>` names feed each merged
linear; the vetoes (`fusegen.compiler.vetoes.checkpoint_conflicts`) and the TP plan read them too.
"""

from __future__ import annotations

import ast
import inspect
import sys

from torch import nn

from fusegen.compiler.propagate import model_specific_classes
from fusegen.core import astutil
from fusegen.core.plan import ClassOutcome, Refused, merged_linears


def checkpoint_scopes(model: nn.Module, outcomes: list[ClassOutcome]) -> dict[str, list[str]]:
    """Checkpoint scopes: `<parent>.<projection>` names feed each merged linear, for every config of the model.

    Scoping by parent keeps a same-named projection of an unfused module
    elsewhere out of a merge. The parents are read off the source, not off the
    one instantiated model: every attribute name under which any class of the
    model constructs a class holding the merged linear (`self.mlp =
    DeepseekV2Moe(config) if ... else DeepseekV2MLP(config)` gives `mlp` even
    when the default config builds no dense layer). Only classes the model is
    built from can hold a fused class: they are the ones fusegen emits with
    their references renamed, and a class it does not emit constructs the
    original, unfused class. A holder constructed any other way (in a
    `ModuleList`, passed as a value, from a table) gets no scope at all: its
    projections are matched by bare name. A scope too wide only costs the
    pattern a match that Transformers undoes (a renamed key the model lacks
    falls back to the checkpoint's own name); one too narrow would leave a
    merged parameter unfilled, which loading then refuses (see
    `fusegen.runtime.check_loading`).
    """
    found = construction_sites(model, outcomes)
    return {merged: sorted(names) for merged, names in sorted(found.items()) if "" not in names}


def construction_sites(model: nn.Module, outcomes: list[ClassOutcome]) -> dict[str, set[str]]:
    """For each merged name, the attributes its holders are assigned to; "" marks a construction of another form."""
    classes = model_specific_classes(sys.modules[type(model).__module__], model)
    merged_by_class = {o.class_name: [plan.merged for plan in merged_linears(o.fused)] for o in outcomes if o.fused}
    holders: dict[str, list[str]] = {}
    for cls in classes:
        for base in cls.__mro__:
            holders.setdefault(cls.__name__, []).extend(merged_by_class.get(base.__name__, []))
    holders = {name: merged for name, merged in holders.items() if merged}
    found: dict[str, set[str]] = {}
    tables = _class_tables(classes, set(holders))
    for cls in classes:
        try:
            classdef = astutil.class_statement(cls)
        except Refused:
            continue
        for holder, attribute in holder_references(classdef, set(holders), tables):
            for merged in holders[holder]:
                found.setdefault(merged, set()).add(attribute)
    return found


def _class_tables(classes, holders: set[str]) -> dict[str, set[str]]:
    """Module-level names whose statements name holder classes (`CLASSES = {"a": Holder}`): name -> holders.

    A holder reached through such a name is constructed wherever the name is used, so each use counts as a
    reference to every holder it names (see `holder_references`).
    """
    tables: dict[str, set[str]] = {}
    for filename in sorted({inspect.getsourcefile(cls) or "" for cls in classes} - {""}):
        for stmt in astutil.module_tree(filename).body:
            if isinstance(stmt, (ast.Assign, ast.AnnAssign)):
                named = {n.id for n in astutil.walk(stmt.value) if isinstance(n, ast.Name) and n.id in holders}
                targets = stmt.targets if isinstance(stmt, ast.Assign) else [stmt.target]
                for target in targets:
                    if isinstance(target, ast.Name) and named:
                        tables.setdefault(target.id, set()).update(named)
    return tables


def holder_references(
    classdef: ast.ClassDef, holders: set[str], tables: dict[str, set[str]] | None = None
) -> list[tuple[str, str]]:
    """(holder, attribute) per reference to a holder class in the methods of `classdef`.

    `self.<attribute> = Holder(...)`, also as a branch of a conditional
    expression, gives the attribute; so does `self.<attribute> = TABLE[key](...)`
    for every holder a module-level class table names. Every other reference
    gives "" (a type check `isinstance(m, Holder)` and `super(Holder, self)`
    construct nothing and are skipped).
    """
    tables = tables or {}
    direct: dict[int, str] = {}
    skipped: set[int] = set()
    functions = [stmt for stmt in classdef.body if isinstance(stmt, (ast.FunctionDef, ast.AsyncFunctionDef))]
    for node in (n for function in functions for n in astutil.walk(function)):
        if isinstance(node, (ast.Assign, ast.AnnAssign)):
            targets = node.targets if isinstance(node, ast.Assign) else [node.target]
            if len(targets) == 1 and astutil.self_attr(targets[0]) and node.value is not None:
                for call in _direct_calls(node.value):
                    table = call.func.value if isinstance(call.func, ast.Subscript) else call.func
                    direct[id(table)] = targets[0].attr
        elif isinstance(node, ast.Call) and isinstance(node.func, ast.Name):
            if node.func.id in ("isinstance", "issubclass"):
                skipped.update(id(n) for argument in node.args[1:] for n in astutil.walk(argument))
            elif node.func.id == "super" and node.args:
                skipped.add(id(node.args[0]))
    references = []
    for node in (n for function in functions for n in astutil.walk(function)):
        if isinstance(node, ast.Name) and id(node) not in skipped:
            for holder in {node.id} & holders | tables.get(node.id, set()):
                references.append((holder, direct.get(id(node), "")))
    return references


def _direct_calls(expression: ast.expr) -> list[ast.Call]:
    """The calls whose result `expression` is: itself, or the branches of `a if c else b` / `a or b`."""
    if isinstance(expression, ast.Call):
        return [expression]
    if isinstance(expression, ast.IfExp):
        return _direct_calls(expression.body) + _direct_calls(expression.orelse)
    if isinstance(expression, ast.BoolOp):
        return [call for value in expression.values for call in _direct_calls(value)]
    return []
