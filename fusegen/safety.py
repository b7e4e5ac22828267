"""The rules that keep hoisting a merged GEMM from changing what it reads.

Fusing moves every projection call to one merged call placed before the
first of them, so the merged GEMM reads its input once, up front, where the
later projections used to read it later. That is only sound if nothing in
between changes the input: not by rebinding a name it reads, not by writing
through it, and not by writing a view that shares its storage. Every rule
over-approximates on purpose: a false alarm costs one fusion, a miss returns
wrong numbers.
"""

from __future__ import annotations

import ast
import builtins
import inspect

from torch import nn

from fusegen.astutil import self_attr
from fusegen.plan import Refused

METADATA_ATTRS = frozenset({"shape", "dtype", "device", "ndim", "is_cuda", "layout", "requires_grad", "is_meta"})
"""Attributes that are ints, tuples or flags: they share no storage with the tensor."""

METADATA_METHODS = frozenset(
    {"size", "dim", "numel", "stride", "is_contiguous", "element_size", "get_device", "nelement", "item", "tolist"}
)

PURE_METHODS = frozenset(
    {
        *METADATA_METHODS,
        "view", "view_as", "reshape", "reshape_as", "transpose", "permute", "contiguous", "unsqueeze",
        "squeeze", "flatten", "unflatten", "expand", "expand_as", "repeat", "chunk", "split", "narrow",
        "select", "unbind", "t", "to", "float", "half", "bfloat16", "double", "int", "long", "bool",
        "type", "type_as", "clone", "detach", "cpu", "matmul", "mm", "bmm", "add", "sub", "mul", "div",
        "pow", "sqrt", "rsqrt", "exp", "mean", "sum", "norm", "softmax", "sigmoid", "tanh", "masked_fill",
        "new_zeros", "new_ones", "new_empty", "new_full", "new_tensor",
    }
)  # fmt: skip
"""Tensor methods that never write their receiver or arguments."""

PURE_BUILTINS = frozenset(
    {"len", "isinstance", "tuple", "list", "range", "min", "max", "int", "float", "bool", "str", "type", "zip",
     "enumerate", "hasattr", "getattr", "print", "repr", "abs", "sum", "any", "all", "sorted", "reversed", "id"}
)  # fmt: skip
"""Builtins that may read a tensor but never write it."""


def input_names(arg: ast.expr) -> set[str]:
    """Names the projections' input reads; refuse inputs that compute something.

    Merging evaluates the input expression once instead of once per
    projection; that is only the same if evaluating it has no effect and
    always gives the same value (a call such as `self.dropout(x)` does not).
    """
    for node in ast.walk(arg):
        if not isinstance(node, (ast.Name, ast.Attribute, ast.Subscript, ast.Constant, ast.Slice, ast.Tuple,
                                 ast.Load, ast.UnaryOp, ast.USub)):  # fmt: skip
            raise Refused("input-not-simple", f"the projection input `{ast.unparse(arg)}` computes a value", arg)
    return {node.id for node in ast.walk(arg) if isinstance(node, ast.Name)}


def may_alias(expr: ast.expr, tracked: set[str], module: nn.Module) -> bool:
    """Could the value of `expr` share storage with a tracked name?"""
    if isinstance(expr, ast.Name):
        return expr.id in tracked
    if isinstance(expr, (ast.Constant, ast.Compare, ast.Lambda, ast.JoinedStr)):
        return False
    if isinstance(expr, ast.Attribute):
        return expr.attr not in METADATA_ATTRS and may_alias(expr.value, tracked, module)
    if isinstance(expr, ast.Subscript):
        return may_alias(expr.value, tracked, module)
    if isinstance(expr, ast.Call):
        return _call_may_alias(expr, tracked, module)
    if isinstance(expr, ast.NamedExpr):
        return may_alias(expr.value, tracked, module)
    return any(
        may_alias(child, tracked, module) for child in ast.iter_child_nodes(expr) if isinstance(child, ast.expr)
    )


def _call_may_alias(call: ast.Call, tracked: set[str], module: nn.Module) -> bool:
    func = call.func
    if self_attr(func) and isinstance(getattr(module, func.attr, None), nn.Linear):
        return False  # a linear writes its result into new storage
    if isinstance(func, ast.Attribute) and func.attr in METADATA_METHODS:
        return False
    operands = [*call.args, *(keyword.value for keyword in call.keywords)]
    if isinstance(func, ast.Attribute) and not self_attr(func):
        operands.append(func.value)  # a method may return a view of its receiver
    return any(may_alias(operand, tracked, module) for operand in operands)


def aliases(funcdef: ast.FunctionDef, seeds: set[str], module: nn.Module) -> set[str]:
    """`seeds` plus every name in `funcdef` that may be bound to a view of them.

    Flow-insensitive (any assignment anywhere counts) and transitive, so
    chains (`h = x.view(-1); g = h[1:]`) and unpacking are covered.
    """
    bindings = list(_bindings(funcdef))
    tracked = set(seeds)
    changed = True
    while changed:
        changed = False
        for targets, value in bindings:
            if may_alias(value, tracked, module):
                new = {n.id for t in targets for n in ast.walk(t) if isinstance(n, ast.Name)} - tracked
                if new:
                    tracked |= new
                    changed = True
    return tracked


def _bindings(funcdef: ast.FunctionDef):
    """(targets, value) for every way `funcdef` binds a name to a value."""
    for node in ast.walk(funcdef):
        if isinstance(node, ast.Assign):
            yield node.targets, node.value
        elif isinstance(node, (ast.AnnAssign, ast.AugAssign, ast.NamedExpr)) and node.value is not None:
            yield [node.target], node.value
        elif isinstance(node, (ast.For, ast.AsyncFor)):
            yield [node.target], node.iter
        elif isinstance(node, ast.withitem) and node.optional_vars is not None:
            yield [node.optional_vars], node.context_expr
        elif isinstance(node, ast.comprehension):
            yield [node.target], node.iter


def check_not_rebound(region: list[ast.stmt], tracked: set[str]) -> None:
    """Refuse if the region assigns or deletes a name the input expression reads.

    Each later projection re-evaluates its input expression; the merged call
    evaluates it once, before the region. Rebinding an alias is harmless (the
    input's storage is untouched), so only the input's own names count here.
    """
    for stmt in region:
        for node in ast.walk(stmt):
            if isinstance(node, ast.Name) and isinstance(node.ctx, (ast.Store, ast.Del)) and node.id in tracked:
                verb = "deleted" if isinstance(node.ctx, ast.Del) else "rebound"
                raise Refused("input-rebound", f"`{node.id}` is {verb} between the projections", node)
            if isinstance(node, (ast.FunctionDef, ast.ClassDef)) and node.name in tracked:
                raise Refused("input-rebound", f"`{node.name}` is rebound between the projections", node)


def check_not_written_through(region: list[ast.stmt], tracked: set[str], module: nn.Module) -> None:
    """Refuse if the region writes an item or attribute of a possible alias (`x[0] = 0`)."""
    for stmt in region:
        for node in ast.walk(stmt):
            if (
                isinstance(node, (ast.Subscript, ast.Attribute))
                and isinstance(node.ctx, (ast.Store, ast.Del))
                and may_alias(node.value, tracked, module)
            ):
                raise Refused("input-written", f"`{ast.unparse(node)}` writes into the projection input", node)


def check_no_inplace_calls(region: list[ast.stmt], tracked: set[str], module: nn.Module) -> None:
    """Refuse in-place calls on a possible alias: `x.mul_()`, `torch.relu_(x)`, `out=x`, `inplace=True`."""
    for stmt in region:
        for call in (node for node in ast.walk(stmt) if isinstance(node, ast.Call)):
            name = call_name(call)
            receiver = call.func.value if isinstance(call.func, ast.Attribute) else None
            in_place = name.endswith("_") and not name.endswith("__")
            if in_place and receiver is not None and may_alias(receiver, tracked, module):
                raise Refused("inplace-call", f"`{ast.unparse(call)}` writes the projection input in place", call)
            operands = [*call.args, *(keyword.value for keyword in call.keywords if keyword.arg != "out")]
            touches_input = any(may_alias(operand, tracked, module) for operand in operands)
            for keyword in call.keywords:
                if keyword.arg == "out" and may_alias(keyword.value, tracked, module):
                    raise Refused("inplace-call", f"`{ast.unparse(call)}` writes the projection input via out=", call)
                if keyword.arg == "inplace" and touches_input and not _is_false(keyword.value):
                    raise Refused("inplace-call", f"`{ast.unparse(call)}` may modify its input in place", call)
            if in_place and touches_input:
                raise Refused("inplace-call", f"`{ast.unparse(call)}` writes the projection input in place", call)


def check_calls_pure(
    region: list[ast.stmt],
    tracked: set[str],
    module: nn.Module,
    namespace: dict,
    projection_calls: list[ast.Call],
) -> None:
    """Refuse if a possible alias is handed to anything not known to leave it intact.

    Submodules are judged by their instantiated class (`nn.ReLU(inplace=True)`
    is impure whatever the source says), functions by what they resolve to
    in the modeling module's namespace.
    """
    skip = {id(call) for call in projection_calls}
    for stmt in region:
        for call in (node for node in ast.walk(stmt) if isinstance(node, ast.Call)):
            if id(call) in skip:
                continue
            operands = [*call.args, *(keyword.value for keyword in call.keywords)]
            receiver = call.func.value if isinstance(call.func, ast.Attribute) and not self_attr(call.func) else None
            if not any(may_alias(operand, tracked, module) for operand in operands) and not (
                receiver is not None and may_alias(receiver, tracked, module)
            ):
                continue
            if not _known_pure(call, module, namespace):
                raise Refused(
                    "impure-call",
                    f"the projection input is passed to `{ast.unparse(call.func)}`, which may write it",
                    call,
                )


def check_no_state_methods(region: list[ast.stmt], module: nn.Module) -> None:
    """Refuse if the region calls a method of the module itself (`self.reset_cache()`).

    Such a method reaches the module's state without being handed the input,
    and the input may be that state (`x = self.buffer`); submodule calls are
    judged by their arguments instead.
    """
    for stmt in region:
        for call in (node for node in ast.walk(stmt) if isinstance(node, ast.Call)):
            if self_attr(call.func) and not isinstance(getattr(module, call.func.attr, None), nn.Module):
                raise Refused(
                    "state-method-call", f"`{ast.unparse(call.func)}` may change module state the input aliases", call
                )


def _known_pure(call: ast.Call, module: nn.Module, namespace: dict) -> bool:
    func = call.func
    if self_attr(func):
        return pure_module(getattr(module, func.attr, None))
    resolved = resolve(func, namespace)
    if resolved is not _UNRESOLVED:
        return _pure_function(resolved, call)
    # A method on a local value: trust only the tensor methods known not to write.
    return isinstance(func, ast.Attribute) and func.attr in PURE_METHODS


def pure_module(child: object) -> bool:
    """Is `child` a module that never writes its input?

    Only modules of torch and Transformers' activation library are trusted,
    and only when not configured to work in place.
    """
    if not isinstance(child, nn.Module) or getattr(child, "inplace", False):
        return False
    origin = type(child).__module__
    return origin.startswith("torch.nn.modules") or origin == "transformers.activations"


def _pure_function(function: object, call: ast.Call) -> bool:
    name = getattr(function, "__name__", "")
    if function in _PURE_BUILTIN_OBJECTS:
        return True
    origin = getattr(function, "__module__", None) or ""
    if not (origin == "torch" or origin.startswith("torch.")) or name.endswith("_"):
        return False
    if any(keyword.arg in ("out", "inplace") for keyword in call.keywords):
        return False
    try:
        parameters = list(inspect.signature(function).parameters)
    except (TypeError, ValueError):
        return True  # torch builtins without a Python signature are functional
    # `F.dropout(x, 0.1, True, True)`: an in-place flag passed positionally
    return "inplace" not in parameters or len(call.args) <= parameters.index("inplace")


_PURE_BUILTIN_OBJECTS = [getattr(builtins, name) for name in sorted(PURE_BUILTINS)]
_UNRESOLVED = object()


def resolve(expr: ast.expr, namespace: dict) -> object:
    """The object a dotted name (`torch.nn.functional.silu`) denotes in `namespace`."""
    if isinstance(expr, ast.Name):
        if expr.id in namespace:
            return namespace[expr.id]
        return getattr(builtins, expr.id, _UNRESOLVED)
    if isinstance(expr, ast.Attribute):
        base = resolve(expr.value, namespace)
        if base is _UNRESOLVED or not inspect.ismodule(base):
            return _UNRESOLVED
        return getattr(base, expr.attr, _UNRESOLVED)
    return _UNRESOLVED


def call_name(call: ast.Call) -> str:
    if isinstance(call.func, ast.Attribute):
        return call.func.attr
    return call.func.id if isinstance(call.func, ast.Name) else ""


def _is_false(expr: ast.expr) -> bool:
    return isinstance(expr, ast.Constant) and expr.value is False


def check_input_stable(
    funcdef: ast.FunctionDef,
    region: list[ast.stmt],
    arg: ast.expr,
    module: nn.Module,
    namespace: dict,
    projection_calls: list[ast.Call],
) -> None:
    """Run every rule; raises `Refused` naming the first that fires."""
    names = input_names(arg)
    tracked = aliases(funcdef, names, module)
    check_not_rebound(region, names)
    check_not_written_through(region, tracked, module)
    check_no_inplace_calls(region, tracked, module)
    check_calls_pure(region, tracked, module, namespace, projection_calls)
    check_no_state_methods(region, module)
