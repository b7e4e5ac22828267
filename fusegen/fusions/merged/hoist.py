"""The hoisting rules: what keeps moving a merged GEMM up front from changing what it reads.

Fusing moves every projection call to one merged call placed before the
first of them, so the merged GEMM reads its input once, up front, where the
later projections used to read it later. That is only sound if nothing in
between changes the input: not by rebinding a name it reads, not by writing
through it, and not by writing a view that shares its storage.

The analysis is an allowlist. Between the first and the last projection
call, every expression that could reach the input or a possible alias of it
(the names it was bound from included, `sources`; as an argument, a
receiver, a callee, an augmented-assignment target, or through the frame)
must be *shown* not to write it, by a rule that names what it trusts:

* torch functions and tensor methods known to be pure (`PURE_TORCH`,
  `torch.nn.functional`, `PURE_METHODS`), never their in-place `_` variants,
  never with `out=` or `inplace=`;
* torch and Transformers modules, judged on the instantiated model
  (`pure_module`), never on the source text;
* metadata reads (`METADATA_ATTRS`, `METADATA_METHODS`).

Everything else is refused, with a stable rule id and the source line. Each
rule over-approximates on purpose: a false alarm costs one fusion, a miss
returns wrong numbers.

The names the rules trust come from one vocabulary (`fusegen.core.vocabulary`); which names may alias the input
comes from `fusegen.fusions.merged.dataflow`, what a name denotes from `fusegen.fusions.merged.lookup`, and what a
child module is from `fusegen.fusions.merged.live`.

What the analysis trusts without checking (documented in docs/analysis.md):
the projection input, and the output of a plain `nn.Linear` child (`linear_output`),
is a tensor whose methods keep their documented meaning; a callee handed no alias of the input reaches it only through
module state (`state-method-call`), a closure (`deferred-capture`) or the
frame (`reflection`, `frame-access`).
"""

from __future__ import annotations

import ast
import builtins
import copy
import inspect
import itertools
import types

import torch
from torch import nn

from fusegen.core.astutil import enclosing_loop_or_scope, parent_map, self_attr, walk
from fusegen.core.plan import Refused
from fusegen.core.vocabulary import (
    FRAME_ATTRS,
    METADATA_ATTRS,
    METADATA_METHODS,
    PURE_BUILTINS,
    PURE_METHODS,
    PURE_OPERATORS,
    REFLECTION_NAMES,
)
from fusegen.fusions.merged import dataflow
from fusegen.fusions.merged.dataflow import (
    aliases,
    aliases_of,
    bindings,
    bound_names,
    call_may_alias,
    input_names,
    keeps_no_reference,
    loads,
    local_names,
    may_alias,
    region_nodes,
    sources,
    stash_targets,
)
from fusegen.fusions.merged.live import pure_module
from fusegen.fusions.merged.lookup import (
    UNRESOLVED,
    is_functional,
    is_pure_torch,
    operator_module_function,
    resolve_dotted,
)
from fusegen.fusions.merged.region_rules import region_findings
from fusegen.fusions.merged.rules import claims_unless_refused

_SCOPES = (ast.Lambda, ast.FunctionDef, ast.AsyncFunctionDef, ast.GeneratorExp)
"""Code that runs later than where it is written, so a walk over the region does not see it run."""


PLAIN_STATE = (int, float, bool, complex, str, bytes, type(None), torch.dtype, torch.device)
"""Attribute values that hold no storage: reading one into the input cannot make the input module state."""


def check_no_state_source(funcdef: ast.FunctionDef, region: list[ast.stmt], tracked: set[str], module: nn.Module):
    """Refuse if the input may be module state and the region may write module state.

    `sources` follows local names only (following `self` would take every `h = self.norm(h)`), so after
    `z = self.kept` (or `z = self.helper(...)`, which may return `self.kept`) the tensor the projections read is
    also reachable through `self`, and a write between them (`self.kept.mul_(2)`, `self.kept[0] = 0`, a callee
    handed `self` or a piece of its state) changes what the later ones read without naming `z`. An attribute
    whose instance value is a submodule is judged by the submodule-call rules, and one holding a plain number,
    string, dtype or device has no storage. Both sides are judged on names, flow-insensitively on the source
    side: a false alarm costs a fusion; a miss returns wrong numbers. (Self-method calls in the region are
    `state-method-call`'s.)
    """
    sources = [
        (value, attr)
        for targets, value in bindings(funcdef)
        if {name for target in targets for name in bound_names(target)} & tracked
        for attr in _state_attributes(value, module)
    ]
    if not sources:
        return
    write = next(_module_state_writes(region, module), None)
    if write is not None:
        value, attr = sources[0]
        yield Refused(
            "state-source",
            f"`{ast.unparse(value)}` may make the input `self.{attr}`, and `{ast.unparse(write).strip()}` may write"
            " module state between the projections",
            write,
        )


def _state_root(expr: ast.expr, module: nn.Module) -> str | None:
    """The attribute `a` when `expr` is `self.a` or reached from it by attributes and items (`self.a[0].data`),
    `a` holding neither a submodule nor a plain value; else None."""
    while isinstance(expr, (ast.Attribute, ast.Subscript)) and not self_attr(expr):
        expr = expr.value
    if not self_attr(expr):
        return None
    held = getattr(module, expr.attr, None)
    if isinstance(held, nn.Module) or (hasattr(module, expr.attr) and isinstance(held, PLAIN_STATE)):
        return None
    return expr.attr


def _module_state_writes(region: list[ast.stmt], module: nn.Module):
    """Nodes of the region that may write module state: a store into or augmented assignment of `self.a...`, a
    method of `self.a...` other than a pure or metadata one, a call handed `self` or `self.a...`."""
    for node in region_nodes(region):
        if isinstance(node, ast.AugAssign) and _state_root(node.target, module):
            yield node
        elif isinstance(node, (ast.Subscript, ast.Attribute)) and isinstance(node.ctx, (ast.Store, ast.Del)):
            if _state_root(node.value, module):
                yield node
        elif isinstance(node, ast.Call):
            func = node.func
            method = func.attr if isinstance(func, ast.Attribute) else None
            if method and method not in PURE_METHODS | METADATA_METHODS and _state_root(func.value, module):
                yield node
            operands = [*node.args, *(keyword.value for keyword in node.keywords)]
            if any(isinstance(o, ast.Name) and o.id == "self" or _state_root(o, module) for o in operands):
                yield node


class _SelfAttributeAsName(ast.NodeTransformer):
    """Rewrites every `self.<attr>` to the name `marker`, so `may_alias` can be asked about that attribute."""

    def __init__(self, attr: str, marker: str):
        self.attr, self.marker = attr, marker

    def visit_Attribute(self, node: ast.Attribute) -> ast.expr:
        if self_attr(node, self.attr):
            return ast.copy_location(ast.Name(self.marker, ast.Load()), node)
        return self.generic_visit(node)


def _state_attributes(value: ast.expr, module: nn.Module) -> list[str]:
    """The `self.<attr>` reads in `value` whose storage the value may share (`may_alias`), submodules and plain
    values excepted (see `check_no_state_source`)."""
    found = []
    for node in walk(value):
        if not (self_attr(node) and isinstance(node.ctx, ast.Load)):
            continue
        held = getattr(module, node.attr, None)
        if isinstance(held, nn.Module) or (hasattr(module, node.attr) and isinstance(held, PLAIN_STATE)):
            continue
        marker = f"__state_{node.attr}__"
        marked = _SelfAttributeAsName(node.attr, marker).visit(copy.deepcopy(value))
        if may_alias(marked, {marker}, module) and node.attr not in found:
            found.append(node.attr)
    return found


def check_not_rebound(region: list[ast.stmt], tracked: set[str]):
    """Refuse if the region assigns or deletes a name the input expression reads.

    Each later projection re-evaluates its input expression; the merged call
    evaluates it once, before the region. Rebinding an alias is harmless (the
    input's storage is untouched), so only the input's own names count here.
    Every binding form counts: assignment, `del`, `def`/`class`, `import ... as`,
    `except ... as` (which also deletes the name) and `match` captures.
    """
    for node in region_nodes(region):
        bound = None
        if isinstance(node, ast.Name) and isinstance(node.ctx, (ast.Store, ast.Del)):
            bound = node.id
        elif isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef, ast.ExceptHandler)):
            bound = node.name
        elif isinstance(node, ast.alias):
            bound = (node.asname or node.name).split(".")[0]
        elif isinstance(node, (ast.MatchAs, ast.MatchStar)):
            bound = node.name
        elif isinstance(node, ast.MatchMapping):
            bound = node.rest
        elif isinstance(node, (ast.Global, ast.Nonlocal)) and tracked & set(node.names):
            bound = min(tracked & set(node.names))
        if bound in tracked:
            verb = "deleted" if isinstance(getattr(node, "ctx", None), ast.Del) else "rebound"
            yield Refused("input-rebound", f"`{bound}` is {verb} between the projections", node)


def check_not_written_through(region: list[ast.stmt], tracked: set[str], module: nn.Module):
    """Refuse if the region writes an item or attribute of a possible alias (`x[0] = 0`, `x.data += 1`).

    A store into an item or attribute writes the object it is taken from,
    whichever statement form does it (assignment, augmented assignment, `del`).
    """
    for node in region_nodes(region):
        if (
            isinstance(node, (ast.Subscript, ast.Attribute))
            and isinstance(node.ctx, (ast.Store, ast.Del))
            and may_alias(node.value, tracked, module)
        ):
            yield Refused("input-written", f"`{ast.unparse(node)}` writes into the projection input", node)


def check_no_aliased_augassign(region: list[ast.stmt], tracked: set[str], names: set[str]):
    """Refuse `h += 1` where `h` may be a view of the input (`h = x.view(-1)`, `d = x.detach()`).

    An augmented assignment to a name is a store, yet on a tensor it runs
    `__iadd__`, which writes the existing storage before rebinding the name.
    (The input's own names are caught as rebinding first.)
    """
    for node in region_nodes(region):
        if isinstance(node, ast.AugAssign):
            targets = {n.id for n in walk(node.target) if isinstance(n, ast.Name)}
            hit = targets & (tracked - names)
            if hit:
                yield Refused("aliased-augassign", f"`{ast.unparse(node).strip()}` writes `{min(hit)}` in place", node)


def check_no_reflection(funcdef: ast.FunctionDef):
    """Refuse if `forward` mentions `eval`, `exec`, `locals`, `vars`, `globals`, `__dict__` or a frame.

    These reach every name of the frame (or of an object) without being
    handed them, so no alias analysis can bound what they touch. The whole
    forward is scanned, not only the region: `e = eval` may be bound before
    the region and called inside it.
    """
    local = local_names(funcdef)
    for node in (node for stmt in funcdef.body for node in walk(stmt)):
        by_name = isinstance(node, ast.Name) and node.id in REFLECTION_NAMES and node.id not in local
        by_attribute = isinstance(node, ast.Attribute) and node.attr in FRAME_ATTRS | REFLECTION_NAMES
        if by_name or by_attribute:
            yield Refused("reflection", f"`{ast.unparse(node)}` can reach any name of the frame", node)


def check_no_deferred_capture(funcdef: ast.FunctionDef, region: list[ast.stmt], tracked: set[str]):
    """Refuse a lambda, nested function or generator, written before or in the region, that reads an alias.

    Its body runs when it is called or advanced, which may be inside the
    region, and its parameters may be bound to an alias (`lambda t=x: ...`),
    so neither the statements of the region nor the alias analysis show
    what it does. Eager comprehensions run where they stand and are checked there.
    """
    end = max(getattr(node, "end_lineno", 0) or 0 for node in region_nodes(region))
    parent_of = parent_map(funcdef)
    for node in (node for stmt in funcdef.body for node in walk(stmt)):
        if isinstance(node, _SCOPES) and node.lineno <= end:
            captured = loads(node)  # the body, and the defaults and decorators evaluated with it
            if captured & tracked and not _unreachable_until(node, end, funcdef, parent_of):
                yield Refused(
                    "deferred-capture",
                    f"`{ast.unparse(node).splitlines()[0]}` captures `{min(captured & tracked)}` "
                    "and may run between the projections",
                    node,
                )


def _unreachable_until(scope: ast.AST, end: int, funcdef: ast.FunctionDef, parent_of: dict) -> bool:
    """Is `scope`'s code sure not to run before line `end` (the region's last)?

    Qwen4-Exp's attention binds `position_embeddings = (x[:, -n:, :] for x in position_embeddings)` before its
    projections and unpacks it after them. A lambda or generator that is the whole value of an assignment to
    plain names, or a `def` without decorators, is reachable only through the local names it is bound to
    (reaching it through the frame is refused by `reflection` and `frame-access`; a `global` name is not local).
    If it is bound outside any loop or scope and no code outside it reads those names from the binding's line up
    to `end`, nothing can call or advance it before the region ends. (A read on an earlier line runs before the binding, so it sees an older
    value.)
    """
    if isinstance(scope, (ast.FunctionDef, ast.AsyncFunctionDef)):
        if scope.decorator_list:
            return False
        binder, bound = scope, {scope.name}
    else:
        binder = parent_of.get(scope)
        if not (isinstance(binder, ast.Assign) and binder.value is scope):
            return False
        if not all(isinstance(target, ast.Name) for target in binder.targets):
            return False
        bound = {target.id for target in binder.targets}
    declared = {name for node in walk(funcdef) if isinstance(node, (ast.Global, ast.Nonlocal)) for name in node.names}
    if enclosing_loop_or_scope(funcdef, binder, parent_of) is not None or bound & declared:
        return False  # a `global` name is reachable from any function the region calls
    inside = {id(node) for node in walk(scope)}
    reads = (node for stmt in funcdef.body for node in walk(stmt) if isinstance(node, ast.Name))
    return not any(
        node.id in bound
        and isinstance(node.ctx, ast.Load)
        and id(node) not in inside
        and binder.lineno <= node.lineno <= end
        for node in reads
    )


def check_no_escape(
    funcdef: ast.FunctionDef, region: list[ast.stmt], tracked: set[str], module: nn.Module, namespace: dict
):
    """Refuse if a possible alias is put where the alias analysis cannot follow it, before or in the region.

    Once stored in an object the analysis does not track (`self.c = x`,
    `self.cache.append(x)`, `CACHE.append(x)`), or kept by a callee that is
    not known to keep nothing (`self.norm(x)` with a user `norm`), any later
    call reaching that object, or the same callee called again in the region,
    could write the input without being handed a tracked name.
    """
    end = max(getattr(node, "end_lineno", 0) or 0 for node in region_nodes(region))
    start = region[0].lineno
    local = local_names(funcdef) - {"self"}
    inside = {id(node) for node in region_nodes(region)}
    keepers: dict[str, ast.Call] = {}
    for stmt in funcdef.body:
        for node in walk(stmt):
            if isinstance(node, ast.Assign) and node.lineno <= end and may_alias(node.value, tracked, module):
                for target in node.targets:
                    for part in walk(target):
                        stored = isinstance(part, (ast.Attribute, ast.Subscript)) and isinstance(part.ctx, ast.Store)
                        if stored and not may_alias(part.value, tracked, module):
                            yield Refused(
                                "input-escapes", f"`{ast.unparse(node)}` stores the projection input away", node
                            )
            if not isinstance(node, ast.Call) or node.lineno > end:
                continue
            operands = [*node.args, *(keyword.value for keyword in node.keywords)]
            if isinstance(node.func, ast.Attribute) and not self_attr(node.func):
                operands.append(node.func.value)
            if not any(may_alias(o, tracked, module) for o in operands) or keeps_no_reference(
                node, tracked, module, namespace
            ):
                continue
            reached = {name for operand in operands for name in loads(operand)} - local
            stores = sorted(name for name in reached if name == "self" or _global_storage(namespace.get(name)))
            if stores:
                yield Refused(
                    "input-escapes", f"`{ast.unparse(node)}` may store the projection input in `{stores[0]}`", node
                )
            if id(node) not in inside and node.lineno < start:
                keepers.setdefault(ast.dump(node.func, include_attributes=False), node)
    for node in region_nodes(region):
        kept = keepers.get(ast.dump(node, include_attributes=False)) if isinstance(node, ast.expr) else None
        if kept is not None:
            yield Refused(
                "input-escapes",
                f"`{ast.unparse(node)}` was handed the projection input by `{ast.unparse(kept)}` and may have kept it",
                node,
            )


def _global_storage(value: object) -> bool:
    """Could a module-level `value` hold a reference handed to it (a list, a dict, an object)?"""
    return value is not None and not inspect.ismodule(value) and not callable(value)


def check_calls(
    region: list[ast.stmt],
    tracked: set[str],
    module: nn.Module,
    namespace: dict,
    projection_calls: list[ast.Call],
    local: set[str],
    allocated: set[str] | frozenset = frozenset(),
):
    """Every call in the region that could reach an alias must be shown not to write it.

    A call reaches an alias when its callee, receiver or any argument may
    be one. It is then judged by what its callee statically is (`judge_call`);
    a callee that is not a resolvable name or dotted attribute
    (`(x.mul_ if c else x.mul)(2)`, `fns[0](x)`, `getattr(x, "mul_")(2)`)
    is unknown and refused.
    """
    skip = {id(call) for call in projection_calls}
    for call in (node for node in region_nodes(region) if isinstance(node, ast.Call)):
        found = None if id(call) in skip else judge_call(call, tracked, module, namespace, local, allocated)
        if found is not None:
            yield found


def judge_call(
    call: ast.Call,
    tracked: set[str],
    module: nn.Module,
    namespace: dict,
    local: set[str],
    allocated: set[str] | frozenset = frozenset(),
) -> Refused | None:
    """The one finding against `call`, or None if it provably leaves every tracked alias intact (`allocated`: the
    names `dataflow.allocated_names` proves hold only new storage)."""
    func = call.func
    text = ast.unparse(call)
    found = _check_keywords(call, tracked, module, text)
    if found is not None:
        return found
    args_alias = any(may_alias(arg, tracked, module) for arg in [*call.args, *(k.value for k in call.keywords)])
    if self_attr(func):
        if args_alias and not pure_module(getattr(module, func.attr, None)):
            return Refused(
                "impure-call", f"the projection input is passed to `{ast.unparse(func)}`, which may write it", call
            )
        return None
    if isinstance(func, ast.Attribute):
        resolved = resolve_dotted(func, namespace, local)
        if resolved is UNRESOLVED:
            receiver = "alias" if may_alias(func.value, tracked, module) else None
            if receiver is None and dataflow.linear_output(func.value, module):
                receiver = "tensor"
            if receiver is None and isinstance(func.value, ast.Name) and func.value.id in allocated:
                receiver = "new"
            return _judge_method(call, func, receiver, args_alias, text)
        return _judge_function(resolved, call, text) if args_alias else None
    if isinstance(func, ast.Name):
        if may_alias(func, tracked, module):
            return Refused("unknown-callee", f"`{func.id}` may be bound to a method or closure of the input", call)
        if args_alias:
            resolved = resolve_dotted(func, namespace, local)
            if resolved is UNRESOLVED:
                return Refused(
                    "unknown-callee", f"`{func.id}` is a local value, so what `{text}` does is unknown", call
                )
            return _judge_function(resolved, call, text)
        return None
    if args_alias or may_alias(func, tracked, module):
        return Refused("unknown-callee", f"the callee of `{text}` is computed, so what it does is unknown", call)


def _judge_method(
    call: ast.Call, func: ast.Attribute, receiver: str | None, args_alias: bool, text: str
) -> Refused | None:
    """A method of a local value: only allowlisted tensor methods may be called on, or handed, an alias.

    `receiver` is "alias" if the receiver may alias the input, "tensor" if it
    is a plain linear's output (`linear_output`), "new" if it is a name that only
    holds storage the forward allocated (`allocated_names`), else None. The receiver is
    known to be a tensor only in those two cases (the input is a tensor, and
    `check_no_opaque_aliases` keeps every other alias a tensor view): handed an
    alias, a method of any other object is unknown.
    """
    if not (receiver == "alias" or args_alias):
        return None
    name = func.attr
    if name.startswith("__") and name.endswith("__") and name not in PURE_METHODS:
        rule = "inplace-operator" if name.startswith(("__i", "__set", "__del")) else "impure-call"
        return Refused(rule, f"`{text}` calls the dunder `{name}` on the projection input", call)
    if name.endswith("_") and not name.endswith("__"):
        if receiver == "new" and name != "set_":
            return None  # writes the new storage it is called on (`buf.copy_(x)`), keeps no reference to `x`
        return Refused("inplace-call", f"`{text}` writes the projection input in place", call)
    if receiver is None:
        return Refused("impure-call", f"`{text}` hands the projection input to a method of an unknown object", call)
    if name not in PURE_METHODS:
        return Refused("impure-call", f"`{text}` is not a tensor method known to leave its operands intact", call)


def _judge_function(function: object, call: ast.Call, text: str) -> Refused | None:
    """A resolved function handed an alias: only allowlisted pure functions pass."""
    name = getattr(function, "__name__", "") or ""
    if operator_module_function(function) is not None:
        if name in PURE_OPERATORS:
            return None
        rule = "inplace-operator" if name.startswith("i") or name in ("setitem", "delitem") else "impure-call"
        return Refused(rule, f"`{text}` is an `operator` function that writes its operand", call)
    if function in (getattr, setattr, delattr):
        if function is getattr and _constant_attr(call) in METADATA_ATTRS:
            return None
        return Refused("dynamic-attribute", f"`{text}` reaches an attribute of the projection input by name", call)
    if any(function is getattr(builtins, pure, None) for pure in PURE_BUILTINS):
        if any(keyword.arg == "key" for keyword in call.keywords):
            return Refused("unknown-callee", f"`{text}` calls its `key` on the projection input", call)
        return None
    if name.endswith("_"):
        return Refused("inplace-call", f"`{text}` writes the projection input in place", call)
    if is_functional(function) or is_pure_torch(function):
        if _inplace_positional(function, call):
            return Refused("inplace-call", f"`{text}` passes an in-place flag positionally", call)
        return None
    return Refused(
        "impure-call", f"the projection input is passed to `{ast.unparse(call.func)}`, which may write it", call
    )


def _check_keywords(call: ast.Call, tracked: set[str], module: nn.Module, text: str) -> Refused | None:
    """`out=<alias>` writes the alias; `inplace=` anything but False on a call handed an alias may too."""
    operands = [*call.args, *(k.value for k in call.keywords if k.arg not in ("out", "inplace")), call.func]
    touches = any(may_alias(operand, tracked, module) for operand in operands)
    for keyword in call.keywords:
        if keyword.arg == "out" and may_alias(keyword.value, tracked, module):
            return Refused("inplace-call", f"`{text}` writes the projection input via out=", call)
        if keyword.arg == "inplace" and touches and not _is_false(keyword.value):
            return Refused("inplace-call", f"`{text}` may modify its input in place", call)
        if keyword.arg is None and touches:
            return Refused("unknown-callee", f"`{text}` passes keywords by `**`, which may hold inplace=True", call)
    return None


def _constant_attr(call: ast.Call) -> str | None:
    if len(call.args) >= 2 and isinstance(call.args[1], ast.Constant) and isinstance(call.args[1].value, str):
        return call.args[1].value
    return None


def _inplace_positional(function: object, call: ast.Call) -> bool:
    """`F.dropout(x, 0.1, True, True)`: an in-place flag passed positionally."""
    try:
        parameters = list(inspect.signature(function).parameters)
    except (TypeError, ValueError):
        return False  # torch builtins without a Python signature take no inplace flag
    return "inplace" in parameters and len(call.args) > parameters.index("inplace")


def _dotted(expr: ast.expr) -> bool:
    """Is `expr` a name or a dotted attribute chain of names (statically spelled)?"""
    while isinstance(expr, ast.Attribute):
        expr = expr.value
    return isinstance(expr, ast.Name)


def check_no_opaque_aliases(
    funcdef: ast.FunctionDef,
    region: list[ast.stmt],
    tracked: set[str],
    names: set[str],
    module: nn.Module,
    namespace: dict,
    projection_calls: list[ast.Call],
):
    """Refuse if the forward reads, up to the last projection, an alias that may not be a tensor view.

    The method and operator rules trust that an alias is a tensor (or a
    container of tensors): the input is one, and allowlisted tensor code
    returns views. An alias made by anything else (`obj = Helper(x)`,
    `cache.append(x)`, `with ... as h`) may be a user object whose `view`
    or `__add__` writes the input, or whose `clone()`/size()` hands it back
    where the analysis assumes fresh storage or an int; so reading it
    before or between the projections is refused. (The input's own names
    hold what `nn.Linear` is handed: a tensor.)

    A read that runs before every call or binding that may make the name
    such an alias still sees the value the name had before (`_read_first`):
    `h = mask_padding(h, attention_mask)` reads `attention_mask` as it was
    passed, and a call after the last projection cannot change what the
    region reads.
    """
    skip = {id(call) for call in projection_calls}
    local = local_names(funcdef) - {"self"}
    bound = aliases_of(funcdef, names, module, namespace, stash=False)  # aliases by binding: views, or opaque below
    makers: dict[str, list[ast.AST]] = {}
    for node in walk(funcdef):
        if isinstance(node, ast.Call) and id(node) not in skip:
            for name in stash_targets(node, tracked, module, namespace, local) - bound:
                makers.setdefault(name, []).append(node)
        entered = isinstance(node, ast.withitem) and node.optional_vars is not None
        if entered and may_alias(node.context_expr, tracked, module):
            for name in bound_names(node.optional_vars):
                makers.setdefault(name, []).append(node.context_expr)
    for targets, value in bindings(funcdef):
        if not may_alias(value, tracked, module):
            continue
        for call in (n for n in walk(value) if isinstance(n, ast.Call) and id(n) not in skip):
            if call_may_alias(call, tracked, module) and not keeps_no_reference(call, tracked, module, namespace):
                for name in (name for target in targets for name in bound_names(target)):
                    makers.setdefault(name, []).append(call)
    allocated = dataflow.allocated_names(funcdef)  # `t.copy_(x)` on new storage copies `x`, keeps no reference
    hits = {name: nodes for name, nodes in makers.items() if name not in names and name not in allocated}
    end = max(getattr(node, "end_lineno", 0) or 0 for node in region_nodes(region))
    parent_of = parent_map(funcdef)
    for node in (node for stmt in funcdef.body for node in walk(stmt)):
        if isinstance(node, ast.Name) and isinstance(node.ctx, ast.Load) and node.id in hits and node.lineno <= end:
            if all(_read_first(node, maker, funcdef, parent_of) for maker in hits[node.id]):
                continue
            made = ast.unparse(hits[node.id][0])
            yield Refused("opaque-alias", f"`{node.id}` may hold the projection input through `{made}`", node)


def _read_first(read: ast.Name, maker: ast.AST, funcdef: ast.FunctionDef, parent_of: dict) -> bool:
    """Does `read` run before `maker` (a call or a `with` item's expression) every time either runs?

    Only where neither sits in a loop, comprehension or nested scope, so each
    runs at most once per forward: then `read` runs first if it is part of
    `maker`'s own operands (evaluated before the call, or before the `with`
    binds), or if `maker` starts on a later line (outside loops, statements
    run in line order).
    """
    if any(enclosing_loop_or_scope(funcdef, node, parent_of) is not None for node in (read, maker)):
        return False
    if maker.lineno > read.end_lineno:
        return True
    return read is not maker and any(node is read for node in walk(maker))


def check_no_state_methods(region: list[ast.stmt], module: nn.Module):
    """Refuse if the region calls a method of the module itself (`self.reset_cache()`).

    Such a method reaches the module's state without being handed the input,
    and the input may be that state (`x = self.buffer`); submodule calls are
    judged by their arguments instead.
    """
    for call in (node for node in region_nodes(region) if isinstance(node, ast.Call)):
        func = call.func
        if self_attr(func) and not isinstance(getattr(module, func.attr, None), nn.Module):
            yield Refused(
                "state-method-call", f"`{ast.unparse(func)}` may change module state the input aliases", call
            )


def check_frame_access(funcdef: ast.FunctionDef, namespace: dict):
    """Refuse if `forward` names a Python function whose code (transitively) reaches a frame.

    A helper called between the projections with no argument can still
    write the input through `sys._getframe(1).f_locals` or `inspect.currentframe()`.
    Module-level functions are followed through the names their code reads;
    torch's own functions are trusted not to inspect their caller.
    """
    local = local_names(funcdef)
    for stmt in funcdef.body:
        for node in walk(stmt):
            if isinstance(node, (ast.Name, ast.Attribute)) and _dotted(node):
                function = resolve_dotted(node, namespace, local)
                if isinstance(function, types.FunctionType) and _reaches_frame(function, set()):
                    yield Refused("frame-access", f"`{ast.unparse(node)}` may read or write the caller's frame", node)


def _reaches_frame(function: types.FunctionType, seen: set) -> bool:
    if function in seen or (function.__module__ or "").startswith("torch") or len(seen) > 200:
        return False
    seen.add(function)
    names = _code_names(function.__code__)
    if names & (FRAME_ATTRS | REFLECTION_NAMES | {"inspect", "sys", "gc", "builtins"}):
        return True
    for name in names:
        other = function.__globals__.get(name)
        if isinstance(other, types.FunctionType) and _reaches_frame(other, seen):
            return True
    return False


def _code_names(code: types.CodeType) -> set[str]:
    names = set(code.co_names)
    for const in code.co_consts:
        if isinstance(const, types.CodeType):
            names |= _code_names(const)
    return names


def _is_false(expr: ast.expr) -> bool:
    return isinstance(expr, ast.Constant) and expr.value is False


def check_input_stable(
    funcdef: ast.FunctionDef,
    region: list[ast.stmt],
    arg: ast.expr,
    module: nn.Module,
    namespace: dict,
    projection_calls: list[ast.Call],
) -> frozenset[str]:
    """Run every rule; raises `Refused` naming the first that fires, or returns the parameters whose class the region
    trusts `isinstance` about (`rules.Claim`: the rewrite guards the merged call with `class_is_honest`, or refuses).

    The write, escape and capture rules see every name that may refer to the input's tensor: the names it was
    bound from (`sources`) and every alias of those (`aliases`). Rebinding is judged on the input's own names:
    rebinding a source leaves the tensor the input names as it was.
    """
    names = input_names(arg)
    allocated = dataflow.allocated_names(funcdef)
    tracked = aliases(funcdef, sources(funcdef, names, module), module, namespace, exclude=allocated)
    local = local_names(funcdef)
    return claims_unless_refused(
        itertools.chain(
            check_no_reflection(funcdef),
            check_not_rebound(region, names),
            check_not_written_through(region, tracked, module),
            check_no_aliased_augassign(region, tracked, names),
            check_no_escape(funcdef, region, tracked, module, namespace),
            check_no_deferred_capture(funcdef, region, tracked),
            check_no_opaque_aliases(funcdef, region, tracked, names, module, namespace, projection_calls),
            check_calls(region, tracked, module, namespace, projection_calls, local, allocated),
            check_no_state_methods(region, module),
            check_no_state_source(funcdef, region, tracked, module),
            check_frame_access(funcdef, namespace),
            region_findings(funcdef, region, tracked, names, module, namespace, projection_calls),
        )
    )
