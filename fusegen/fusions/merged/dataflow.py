"""Dataflow and aliases in a forward: which names may share storage with the projections' input.

Everything here is flow-insensitive and over-approximates on purpose: any binding anywhere counts, so a false alarm
costs one fusion and a miss never happens silently. `aliases` follows the input forward (views, unpacking, bound
methods, containers, names handed an alias by a call that may keep it), `sources` backward (the names it was bound
from), `may_alias` answers for one expression. A plain `nn.Linear` child's output is new storage
(`linear_output`), judged on the live child (`fusegen.fusions.merged.live`). The rules that use these answers are
`fusegen.fusions.merged.hoist`.
"""

from __future__ import annotations

import ast
import builtins

from torch import nn

from fusegen.core.astutil import self_attr, walk
from fusegen.core.plan import Refused
from fusegen.core.vocabulary import (
    FRESH_METHODS,
    FRESH_TORCH,
    INPLACE_DUNDERS,
    METADATA_ATTRS,
    METADATA_METHODS,
    PURE_BUILTINS,
    PURE_METHODS,
)
from fusegen.fusions.merged.live import plain_linear, pure_module
from fusegen.fusions.merged.lookup import (
    UNRESOLVED,
    is_functional,
    is_pure_torch,
    is_torch_inplace,
    operator_module_function,
    resolve_dotted,
)


def input_names(arg: ast.expr) -> set[str]:
    """Names the projections' input reads; refuse inputs that compute something.

    Merging evaluates the input expression once instead of once per
    projection; that is only the same if evaluating it has no effect and
    always gives the same value (a call such as `self.dropout(x)` does not).
    """
    for node in walk(arg):
        if not isinstance(node, (ast.Name, ast.Attribute, ast.Subscript, ast.Constant, ast.Slice, ast.Tuple,
                                 ast.Load, ast.UnaryOp, ast.USub)):  # fmt: skip
            raise Refused("input-not-simple", f"the projection input `{ast.unparse(arg)}` computes a value", arg)
    return {node.id for node in walk(arg) if isinstance(node, ast.Name)}


def may_alias(expr: ast.expr, tracked: set[str], module: nn.Module) -> bool:
    """Could the value of `expr` share storage with a tracked name (or be a bound method of one)?"""
    if isinstance(expr, ast.Name):
        return expr.id in tracked
    if isinstance(expr, (ast.Constant, ast.Compare, ast.JoinedStr)):
        return False
    if isinstance(expr, ast.Lambda):
        return bool(loads(expr) & tracked)  # a closure over an alias (or a default) reaches it when called
    if isinstance(expr, ast.Attribute):
        return expr.attr not in METADATA_ATTRS and may_alias(expr.value, tracked, module)
    if isinstance(expr, ast.Subscript):
        return may_alias(expr.value, tracked, module)
    if isinstance(expr, ast.Call):
        return call_may_alias(expr, tracked, module)
    if isinstance(expr, ast.NamedExpr):
        return may_alias(expr.value, tracked, module)
    return any(
        may_alias(child, tracked, module) for child in ast.iter_child_nodes(expr) if isinstance(child, ast.expr)
    )


def call_may_alias(call: ast.Call, tracked: set[str], module: nn.Module) -> bool:
    """Could a call's result share storage with a tracked name? Yes if its callee or any operand may."""
    func = call.func
    if self_attr(func) and plain_linear(getattr(module, func.attr, None)):
        return False  # a linear writes its result into new storage (unless a hook hands back something else)
    if isinstance(func, ast.Attribute) and (func.attr in METADATA_METHODS or func.attr in FRESH_METHODS):
        return False
    if torch_allocation(call):
        return False  # `torch.empty_like(x)`: new storage, whatever it is handed
    if isinstance(func, ast.Attribute) and func.attr in PURE_METHODS and linear_output(func.value, module):
        return False  # a view of, or new storage made from, the linear's new storage (`self.q_b_proj(q).view(s)`)
    operands = [func, *call.args, *(keyword.value for keyword in call.keywords)]
    return any(may_alias(operand, tracked, module) for operand in operands)


def torch_allocation(call: ast.Call) -> bool:
    """Is `call` `torch.<f>(...)` for an `f` that always returns new storage (`FRESH_TORCH`: `torch.zeros_like`)?"""
    func = call.func
    return (
        isinstance(func, ast.Attribute)
        and func.attr in FRESH_TORCH
        and isinstance(func.value, ast.Name)
        and func.value.id == "torch"
    )


def allocated_names(funcdef: ast.FunctionDef) -> set[str]:
    """Local names that only ever hold storage the forward allocated itself: every binding of the name (anywhere)
    is a plain assignment of `torch.<allocation>(...)` (`torch.empty_like(x)`) or of a `FRESH_METHODS` call
    (`x.new_zeros(n)`, `.clone()`); never a parameter, a `global`/`nonlocal` name, or the receiver of `set_` (which
    makes a tensor share another's storage). Writing into such a name (`buf.fill_(0)`, `buf.copy_(x)`, `acc += x`,
    `m[0] = 1`) writes that new storage only, never the input, and an in-place tensor method keeps no reference
    to its operands; so the alias analysis leaves these names out (`aliases(..., exclude=)`)."""
    values: dict[str, list] = {}
    for targets, value in bindings(funcdef):
        for target in targets:
            for name in bound_names(target):
                values.setdefault(name, []).append(value if isinstance(target, ast.Name) else None)
    for node in walk(funcdef):
        if isinstance(node, ast.AugAssign) and isinstance(node.target, ast.Name):
            values[node.target.id] = [v for v in values.get(node.target.id, []) if v is not node.value]
    parameters = {arg.arg for arg in walk(funcdef.args) if isinstance(arg, ast.arg)}
    declared = {n for node in walk(funcdef) if isinstance(node, (ast.Global, ast.Nonlocal)) for n in node.names}
    set_receivers = {
        node.func.value.id
        for node in walk(funcdef)
        if isinstance(node, ast.Call)
        and isinstance(node.func, ast.Attribute)
        and node.func.attr == "set_"
        and isinstance(node.func.value, ast.Name)
    }
    return {
        name
        for name, bound in values.items()
        if bound
        and name not in parameters | declared | set_receivers
        and all(
            isinstance(value, ast.Call)
            and (
                torch_allocation(value) or (isinstance(value.func, ast.Attribute) and value.func.attr in FRESH_METHODS)
            )
            for value in bound
        )
    }


def linear_output(expr: ast.expr, module: nn.Module) -> bool:
    """Is `expr` the result of calling a plain linear child (`self.q_b_proj(q_resid)`)?

    Such a value is a tensor in new storage that nothing else references:
    `nn.Linear.forward` returns `F.linear(input, weight, bias)` and keeps
    nothing (`plain_linear` rules out hooks, subclasses and instance-level
    forwards). So calling a `PURE_METHODS` method on it writes neither it nor
    the method's arguments, keeps no reference to them, and returns a view of
    it, new storage or a non-tensor, never an argument or a view of one.
    What the child is comes from the instantiated module, as for
    `pure_module`; a child built as another class in another config is
    judged when that config is built (`fusegen.compiler.validate`).
    """
    return isinstance(expr, ast.Call) and self_attr(expr.func) and plain_linear(getattr(module, expr.func.attr, None))


def aliases(
    funcdef: ast.FunctionDef,
    seeds: set[str],
    module: nn.Module,
    namespace: dict | None = None,
    exclude: set[str] | frozenset = frozenset(),
) -> set[str]:
    """`seeds` plus every name in `funcdef` that may be bound to a view of them, or hold one (never a name of
    `exclude`: `allocated_names`, which only hold new storage).

    Flow-insensitive (any assignment anywhere counts) and transitive, so
    chains (`h = x.view(-1); g = h[1:]`), unpacking, bound methods
    (`op = x.mul_`) and containers (`fns = [x]`) are covered. A local value
    handed an alias by a call not known to keep no reference (`cache.append(x)`,
    `stash(cache, x)`) may hold it afterwards, so it is tracked too.
    """
    return aliases_of(funcdef, seeds, module, namespace, stash=True, exclude=exclude)


def sources(funcdef: ast.FunctionDef, names: set[str], module: nn.Module) -> set[str]:
    """`names` and every local name (parameters included) they may have been bound from, transitively.

    `aliases` follows the input forward, to names bound from it; the tensor the input names may also be reached
    through the names it was bound from: after `z = y`, `z = y.view(s)` or `z = a if c else y`, a write through `y`
    (`y.mul_(2)`) between the projections changes what the later ones read from `z`, though nothing bound from `z`
    is touched. A binding of a collected name makes every name its value may alias (`may_alias`, the relation
    `aliases` follows forward) a source too. Flow-insensitive, as `aliases`: any binding anywhere counts, so a
    false alarm costs a fusion; a miss returns wrong numbers.
    """
    local = local_names(funcdef) - {"self"}
    found_bindings = list(bindings(funcdef))
    found = set(names)
    changed = True
    while changed:
        changed = False
        for targets, value in found_bindings:
            if {name for target in targets for name in bound_names(target)} & found:
                new = {name for name in (loads(value) & local) - found if may_alias(value, {name}, module)}
                if new:
                    found |= new
                    changed = True
    return found


def aliases_of(
    funcdef: ast.FunctionDef, seeds: set[str], module: nn.Module, namespace, stash: bool, exclude=frozenset()
) -> set[str]:
    """`aliases`, with or without the names that come to hold an alias by being handed one (`stash`)."""
    found_bindings = list(bindings(funcdef))
    local = local_names(funcdef) - {"self"}
    calls = [node for stmt in funcdef.body for node in walk(stmt) if isinstance(node, ast.Call)] if stash else []
    tracked = set(seeds)
    changed = True
    while changed:
        changed = False
        new: set[str] = set()
        for targets, value in found_bindings:
            if may_alias(value, tracked, module):
                new |= {name for target in targets for name in bound_names(target)}
        for call in calls:
            new |= stash_targets(call, tracked, module, namespace, local)
        new -= exclude
        if new - tracked:
            tracked |= new
            changed = True
    return tracked


def bound_names(target: ast.expr) -> set[str]:
    """The names a binding target binds: `a`, `a, (b, *c)`; not the `self` of `self.c = ...`."""
    if isinstance(target, ast.Name):
        return {target.id}
    if isinstance(target, (ast.Tuple, ast.List)):
        return {name for element in target.elts for name in bound_names(element)}
    if isinstance(target, ast.Starred):
        return bound_names(target.value)
    return set()


def stash_targets(call: ast.Call, tracked: set[str], module: nn.Module, namespace, local: set[str]) -> set[str]:
    """Local names `call` may make hold an alias: every name it is handed, if it is handed one and may keep it."""
    operands = [*call.args, *(keyword.value for keyword in call.keywords)]
    if isinstance(call.func, ast.Attribute) and not self_attr(call.func):
        operands.append(call.func.value)
    if not any(may_alias(operand, tracked, module) for operand in operands) or keeps_no_reference(
        call, tracked, module, namespace
    ):
        return set()
    return {name for operand in operands for name in loads(operand)} & local


def keeps_no_reference(call: ast.Call, tracked: set[str], module: nn.Module, namespace) -> bool:
    """Calls that return a value and store none of their operands anywhere: allowlisted tensor code."""
    func = call.func
    if self_attr(func):
        return pure_module(getattr(module, func.attr, None))
    if namespace is not None and isinstance(func, (ast.Name, ast.Attribute)):
        resolved = resolve_dotted(func, namespace)
        if resolved is not UNRESOLVED:
            if resolved in (getattr, setattr, delattr) or operator_module_function(resolved) is not None:
                return resolved is getattr
            builtin = any(resolved is getattr(builtins, pure, None) for pure in PURE_BUILTINS)
            return builtin or is_functional(resolved) or is_pure_torch(resolved) or is_torch_inplace(resolved)
    if isinstance(func, ast.Attribute) and may_alias(func.value, tracked, module):
        name = func.attr
        in_place = name.endswith("_") and not name.endswith("__") and name != "set_"
        return name in PURE_METHODS or name in INPLACE_DUNDERS or in_place
    # a pure method of a linear's output (`self.q_b_proj(q).view(shape)`): a tensor method
    return isinstance(func, ast.Attribute) and func.attr in PURE_METHODS and linear_output(func.value, module)


def bindings(funcdef: ast.FunctionDef):
    """(targets, value) for every way `funcdef` binds a name to a value (`node_bindings` of each of its nodes)."""
    for node in walk(funcdef):
        yield from node_bindings(node)


def node_bindings(node: ast.AST) -> list[tuple[list[ast.expr], ast.expr]]:
    """The (targets, value) pairs `node` itself binds: an assignment (plain, annotated, augmented, walrus); a `for`
    or comprehension target (each item of the iterable, so the iterable stands for the value); a `with ... as`
    target (what the manager's `__enter__` returns: `nullcontext(k)` returns `k`, so the manager expression stands
    for the value); a `match` statement's captures (each may be the subject or a part of it: `case w`, `case [w]`,
    `case Box(t=w)`)."""
    if isinstance(node, ast.Assign):
        return [(node.targets, node.value)]
    if isinstance(node, (ast.AnnAssign, ast.AugAssign, ast.NamedExpr)) and node.value is not None:
        return [([node.target], node.value)]
    if isinstance(node, (ast.For, ast.AsyncFor, ast.comprehension)):
        return [([node.target], node.iter)]
    if isinstance(node, ast.withitem) and node.optional_vars is not None:
        return [([node.optional_vars], node.context_expr)]
    if isinstance(node, ast.Match):
        return [([ast.Name(name, ast.Store()) for name in sorted(_captures(node))], node.subject)]
    return []


def _captures(match: ast.Match) -> set[str]:
    """The names a `match` statement's patterns bind."""
    names = set()
    for node in walk(match):
        if isinstance(node, (ast.MatchAs, ast.MatchStar)) and node.name:
            names.add(node.name)
        elif isinstance(node, ast.MatchMapping) and node.rest:
            names.add(node.rest)
    return names


def loads(node: ast.AST) -> set[str]:
    """Names read anywhere under `node`."""
    return {n.id for n in walk(node) if isinstance(n, ast.Name) and isinstance(n.ctx, ast.Load)}


def local_names(funcdef: ast.FunctionDef) -> set[str]:
    """Every name `funcdef` binds itself: such a name never denotes the module-level object of that name."""
    return names_bound_in(funcdef) | {a.arg for a in walk(funcdef) if isinstance(a, ast.arg)}


def names_bound_in(funcdef: ast.FunctionDef) -> set[str]:
    """Every name a statement or expression of `funcdef` binds, nested scopes included: assignment and deletion
    targets (`for`, `with`, walrus and comprehension targets are stores too), `except ... as`, `match` captures,
    imports, and nested function and class definitions. Parameters are not counted (`local_names` adds them)."""
    names = {n.id for n in walk(funcdef) if isinstance(n, ast.Name) and not isinstance(n.ctx, ast.Load)}
    for node in walk(funcdef):
        if (
            isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef))
            and node is not funcdef
            or isinstance(node, ast.ExceptHandler)
            and node.name
        ):
            names.add(node.name)
        elif isinstance(node, ast.alias):
            names.add((node.asname or node.name).split(".")[0])
        elif isinstance(node, (ast.MatchAs, ast.MatchStar)) and node.name:
            names.add(node.name)
        elif isinstance(node, ast.MatchMapping) and node.rest:
            names.add(node.rest)
    return names


def region_nodes(region: list[ast.stmt]):
    """Every node of the region's statements, nested blocks and scopes included."""
    for stmt in region:
        yield from walk(stmt)
