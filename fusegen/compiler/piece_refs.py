"""Reads of a fused class's projections from code outside it: which are no reference to it, which can be kept.

`fusegen.compiler.vetoes.outside_references` refuses a fusion when other code reads one of its projections
(`module.q_proj` in a pretrained base's `_init_weights`): after fusion the attribute is gone. Two kinds of such
reads need no refusal.

**Guarded against the class** (`guarded_against`). A read `name.q_proj` in the body of `if isinstance(name, C)`
(an `elif` too, or a conjunction holding that test), with `name` not rebound in that body, runs only on instances
of `C`. It can reach a fused class `F` only if an instance of `F` can be an instance of `C`, that is if `F`
subclasses one of the classes `C` names (resolved in the reading class's module). So Siglip's `_init_weights`,
reading `module.q_proj` under `isinstance(module, SiglipAttention)`, is no reference to `Gemma3Attention`.

**Guarded for the class, and rewritable** (`rewritable`). The same read under `isinstance(name, F)` naming
exactly the fused class `F` (one class, not a tuple) IS a reference to `F`, but the emitted copy of the reading
class can keep it: the guard is renamed with every other reference to `FusedF`, so the body runs on fused
instances only, which hold the merged linear; the read becomes `merged_piece(name.<merged>, <index>)`
(`fusegen.runtime.linear.MergedPiece`): `.weight` and `.bias` views of exactly that projection's rows, with its
shape and the merged parameter's "already loaded" flag. Allowed uses of the read, nothing else:

- `name.q_proj.weight` / `name.q_proj.bias` (Siglip: `init.xavier_uniform_(module.q_proj.weight)`);
- `name.q_proj` as a positional argument of a call to a function of the reading class's module that uses that
  parameter only as `p.weight` / `p.bias` / `getattr(p, "weight" or "bias", ...)` (CLIP's `_init_child_weight`).

An initialiser called on a view writes the piece's rows in place and nothing else, on a tensor of the
projection's own shape (its fan-in and fan-out), so `_init_weights(module)` initialises the merged linear exactly
as the original initialises the pieces, value for value from the same random stream
(tests/test_piece_refs.py checks it bit for bit). The merged linear's own visit as an `nn.Linear` (the
generic branch) draws every row from the distribution the pieces' visits draw from, since that branch depends on
no shape (`normal_(std=initializer_range)`); whatever the attention-level branch writes afterwards is exact.
"""

from __future__ import annotations

import ast
import copy

from torch import nn

from fusegen.core import astutil
from fusegen.core.plan import merged_linears

PIECE = "merged_piece"
"""The runtime function a rewritten read calls (`fusegen.runtime.linear.merged_piece`)."""

Guards = dict[int, list[tuple[str, tuple[type, ...]]]]
"""`id(node)` -> the `(name, classes)` of each `isinstance(name, classes)` test whose if-body holds the node."""


def isinstance_guards(classdef: ast.ClassDef, namespace: dict) -> Guards:
    """For every node of `classdef`, the isinstance tests it runs under (see the module docstring).

    A test counts when it is `isinstance(name, C)` or `isinstance(name, (C1, C2))` with every `C` a name bound to a
    class in `namespace`, alone or as an operand of `and`; only the if-body is guarded (not its `else`), and a body
    that rebinds `name` anywhere (assignment, loop or `with` target) drops the guard for all of it.
    """
    guards: Guards = {}
    for statement in astutil.walk(classdef):
        if not isinstance(statement, ast.If):
            continue
        test = statement.test
        tests = test.values if isinstance(test, ast.BoolOp) and isinstance(test.op, ast.And) else [test]
        for name, classes in filter(None, (_isinstance_test(each, namespace) for each in tests)):
            body = ast.Module(body=statement.body, type_ignores=[])
            if any(
                isinstance(n, ast.Name) and n.id == name and isinstance(n.ctx, ast.Store) for n in astutil.walk(body)
            ):
                continue
            for node in astutil.walk(body):
                guards.setdefault(id(node), []).append((name, classes))
    return guards


def _isinstance_test(test: ast.expr, namespace: dict) -> tuple[str, tuple[type, ...]] | None:
    """`(name, classes)` of `isinstance(name, C)` / `isinstance(name, (C1, ...))` with classes resolved, else None."""
    if not (
        isinstance(test, ast.Call)
        and isinstance(test.func, ast.Name)
        and test.func.id == "isinstance"
        and len(test.args) == 2
        and not test.keywords
        and isinstance(test.args[0], ast.Name)
    ):
        return None
    spelled = test.args[1].elts if isinstance(test.args[1], ast.Tuple) else [test.args[1]]
    classes = [namespace.get(item.id) if isinstance(item, ast.Name) else None for item in spelled]
    if not classes or not all(isinstance(cls, type) for cls in classes):
        return None
    return test.args[0].id, tuple(classes)


def guarded_against(node: ast.Attribute, guards: Guards, fused: type | None) -> bool:
    """Whether the read `node` (`name.attr`) provably never runs on an instance of `fused`: it sits under an
    isinstance test of `name` none of whose classes `fused` subclasses. With `fused` unknown, never."""
    if fused is None or not isinstance(node.value, ast.Name):
        return False
    return any(name == node.value.id and not issubclass(fused, classes) for name, classes in guards.get(id(node), []))


def rewritable(node: ast.Attribute, guards: Guards, fused: type | None, parent_of: dict, namespace: dict) -> bool:
    """Whether the read `node` (`name.piece`) runs only on `fused` instances and is used in one of the allowed ways
    (see the module docstring), so the emitted copy can read the piece's rows of the merged linear instead."""
    if fused is None or not isinstance(node.value, ast.Name):
        return False
    if not any(name == node.value.id and classes == (fused,) for name, classes in guards.get(id(node), [])):
        return False
    parent = parent_of.get(node)
    if isinstance(parent, ast.Attribute) and parent.value is node and parent.attr in ("weight", "bias"):
        return isinstance(parent.ctx, ast.Load)
    if isinstance(parent, ast.Call) and node in parent.args and isinstance(parent.func, ast.Name):
        function = namespace.get(parent.func.id)
        return _uses_only_weight_and_bias(function, parent.args.index(node))
    return False


def _uses_only_weight_and_bias(function, position: int) -> bool:
    """Whether module-level `function` uses its positional parameter `position` only as `p.weight`, `p.bias` or
    `getattr(p, "weight" | "bias", ...)`, never rebinding it."""
    import inspect
    import textwrap

    if not inspect.isfunction(function):
        return False
    try:
        tree = ast.parse(textwrap.dedent(inspect.getsource(function)))
    except (OSError, TypeError, SyntaxError):
        return False
    definition = tree.body[0]
    arguments = [*definition.args.posonlyargs, *definition.args.args]
    if not isinstance(definition, ast.FunctionDef) or position >= len(arguments):
        return False
    name = arguments[position].arg
    parent_of = astutil.parent_map(definition)
    for use in (n for n in astutil.walk(definition) if isinstance(n, ast.Name) and n.id == name):
        parent = parent_of.get(use)
        if isinstance(use.ctx, ast.Store):
            return False
        if (
            isinstance(parent, ast.Attribute)
            and parent.attr in ("weight", "bias")
            and isinstance(parent.ctx, ast.Load)
        ):
            continue
        if (
            isinstance(parent, ast.Call)
            and isinstance(parent.func, ast.Name)
            and parent.func.id == "getattr"
            and parent.args[:1] == [use]
            and len(parent.args) >= 2
            and isinstance(parent.args[1], ast.Constant)
            and parent.args[1].value in ("weight", "bias")
        ):
            continue
        return False
    return True


def rewrite_piece_references(classdef: ast.ClassDef, namespace: dict, pieces: dict[type, dict[str, tuple]]) -> bool:
    """Replace, in place, every `rewritable` read `name.piece` of `classdef` by `merged_piece(name.<merged>, i)`.

    `pieces`: for each fused (original) class, `{projection: (merged name, index in its rows)}`. Returns whether
    anything was replaced (the file then imports `merged_piece`).
    """
    guards = isinstance_guards(classdef, namespace)
    parent_of = astutil.parent_map(classdef)
    found = []
    for node in astutil.walk(classdef):
        if not isinstance(node, ast.Attribute) or astutil.self_attr(node):
            continue
        for fused, projections in pieces.items():
            if node.attr in projections and rewritable(node, guards, fused, parent_of, namespace):
                found.append((node, projections[node.attr]))
    for node, (merged, index) in found:
        call = ast.Call(
            func=ast.Name(PIECE, ast.Load()),
            args=[ast.Attribute(copy.deepcopy(node.value), merged, ast.Load()), ast.Constant(index)],
            keywords=[],
        )
        astutil.replace_node(classdef, node, ast.copy_location(call, node))
    return bool(found)


def piece_table(model: nn.Module, outcomes) -> dict[type, dict[str, tuple]]:
    """`{fused original class: {projection: (merged name, row index)}}` of the merged linears in `outcomes`."""
    classes = {type(module).__name__: type(module) for module in model.modules()}
    table: dict[type, dict[str, tuple]] = {}
    for outcome in outcomes:
        cls = classes.get(outcome.class_name)
        for plan in merged_linears(outcome.fused) if cls is not None else []:
            for index, name in enumerate(plan.projections):
                table.setdefault(cls, {})[name] = (plan.merged, index)
    return table
