"""Name lookup: what a name or dotted name of a forward denotes in its module's namespace, and what the vocabulary
(`fusegen.core.vocabulary`) says of the function it denotes (a `torch.nn.functional` function, a pure `torch`
function, an in-place `torch` function, an `operator` function).

The lookup is static: a name the function binds itself denotes nothing at module level (`UNRESOLVED`), and only
modules are looked into, so no attribute of an object is ever read (no property runs).
"""

from __future__ import annotations

import ast
import builtins
import inspect
import operator

import torch

from fusegen.core.vocabulary import PURE_TORCH


def is_torch_inplace(function: object) -> bool:
    """`torch.relu_` and friends: write their first operand, keep no reference to any."""
    name = getattr(function, "__name__", "") or ""
    return name.endswith("_") and not name.endswith("__") and getattr(torch, name, None) is function


def operator_module_function(function: object) -> object:
    """`function` itself if it is a function of the `operator` module, else None."""
    name = getattr(function, "__name__", None)
    return function if name and getattr(operator, name, None) is function else None


def is_functional(function: object) -> bool:
    """A function of `torch.nn.functional` (by identity: its C builtins report another `__module__`)."""
    from torch.nn import functional

    name = getattr(function, "__name__", None)
    return bool(name) and callable(function) and getattr(functional, name, None) is function


def is_pure_torch(function: object) -> bool:
    name = getattr(function, "__name__", None)
    return bool(name) and name in PURE_TORCH and getattr(torch, name, None) is function


UNRESOLVED = object()


def resolve_dotted(expr: ast.expr, namespace: dict, local: set[str] | frozenset = frozenset()) -> object:
    """The object a dotted name (`torch.nn.functional.silu`) denotes in `namespace`.

    A name in `local` is bound by the function itself and so denotes
    nothing at module level.
    """
    if isinstance(expr, ast.Name):
        if expr.id in local:
            return UNRESOLVED
        if expr.id in namespace:
            return namespace[expr.id]
        return getattr(builtins, expr.id, UNRESOLVED)
    if isinstance(expr, ast.Attribute):
        base = resolve_dotted(expr.value, namespace, local)
        if base is UNRESOLVED or not inspect.ismodule(base):
            return UNRESOLVED
        return getattr(base, expr.attr, UNRESOLVED)
    return UNRESOLVED


def call_name(call: ast.Call) -> str:
    """The last name a call spells (`f` in `f(x)`, `mul_` in `a.b.mul_(x)`), or "" for a computed callee."""
    if isinstance(call.func, ast.Attribute):
        return call.func.attr
    return call.func.id if isinstance(call.func, ast.Name) else ""
