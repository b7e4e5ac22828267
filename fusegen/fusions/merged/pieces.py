"""Which split pieces need storage of their own, or a contiguous layout, to behave as the projection outputs did.

The fused forward splits one merged output into pieces: views of one tensor, not contiguous (each row of a piece is
a slice of a longer row), and, under autograd, outputs of one multi-output node, which autograd refuses to let be
written in place. The original's projection outputs were independent, contiguous tensors. So:

* `needs_own_storage`: a piece that may be written in place later, by code the forward does not show, gets a
  copy of its own (`piece = piece.clone()`, exact: see `rewrite_forward.detach_written_pieces`). That is a piece
  any alias of which is stored away (`self.seen = k`, `box[0] = k`, a `global` name), also inside a dict, a record a
  class makes (`KV(k, v)`, a dataclass), such a record in a list, a lambda, a generator or a walrus (`_carries`),
  captured by a nested function or lambda, in its body or as a default value, or by a generator expression
  (`_captures`), handed to a method of an object that outlives the forward (`CACHE.append(k)`,
  `self.store.append(k)`: `_into_held_object`), returned as it is or in such a record, handed to a module-level
  Python function not proven free of writes (`region_rules.effect_free`), or handed to a submodule not proven so
  (`module_effect_free`: an in-place activation, a user module that keeps what it is handed). What a callee the
  analysis cannot resolve does with a piece (an attention interface looked up by name, a cache's `update`) is
  trusted: Transformers' attention functions and caches read or copy their operands.
* `needs_contiguous`: a piece whose layout may show gets `piece = piece.contiguous()`: an alias of it is `.view`ed
  with a shape not proven to keep every leading dim (`view(-1)` on a piece raises where the original's output
  viewed fine), or its layout is read (`stride()`, `is_contiguous()`, `data_ptr()`, storage, `as_strided`, `_base`),
  also through the class (`torch.Tensor.view(k, -1)`), an attribute view (`k.mT.stride()`) or an identity test
  (`k.contiguous() is k`, `id(k.contiguous()) == id(k)`: `_layout_shows`). The proof covers what
  Transformers spells (`q.view(hidden_shape)`, `hidden_shape = (*input_shape, -1, d)`, `input_shape =
  x.shape[:-1]`; `bsz, q_len, _ = x.size()`, `q.view(bsz, q_len, h, d)`), so those models pay nothing.
"""

from __future__ import annotations

import ast
import builtins
import inspect
import types

from torch import nn

from fusegen.core import vocabulary
from fusegen.core.astutil import enclosing_loop_or_scope, parent_map, self_attr, walk
from fusegen.fusions.merged import dataflow, live, lookup, region_rules

COPIES: bool = True
"""Whether the rewrite gives pieces the copies above. Only the mutation tests (to show the copies are needed) and
`bench/piece_copies.py` (to measure what they cost) switch it off; a build with it off may emit a model that raises
where the original runs."""

LAYOUT_METHODS = frozenset(
    {"stride", "is_contiguous", "data_ptr", "storage_offset", "untyped_storage", "storage", "as_strided",
     "view_as", "is_set_to", "_base", "is_non_overlapping_and_dense", "_is_view"}
)  # fmt: skip
"""Tensor methods whose result depends on the layout, where a split piece differs from a projection output."""

LINEAR_PIECE = "linear_piece"
"""The `fusegen.runtime` function a rewrite computes one piece alone with, where it does not merge the call
(`fusegen.runtime.linear.linear_piece`: a tensor of its own, dense, as the projection's output was)."""


def module_effect_free(child: object) -> bool:
    """Does calling `child` provably write nothing it is handed and keep no reference to it?

    Every module inside it is a trusted torch or Transformers-activation module not in place (`live.pure_module`),
    or a class whose `forward` is effect-free by bytecode (`region_rules.effect_free`: no store of any kind, no
    in-place call); no hooks, no instance-level `forward`."""
    if not isinstance(child, nn.Module) or live.global_hooks():
        return False
    for inner in child.modules():
        if live.module_hooks(inner) or "forward" in vars(inner) or getattr(inner, "inplace", False):
            return False
        if live.pure_module(inner):
            continue
        forward = inspect.getattr_static(type(inner), "forward", None)
        if not (isinstance(forward, types.FunctionType) and region_rules.effect_free(forward)):
            return False
    return True


def needs_own_storage(funcdef: ast.FunctionDef, tracked: set[str], module: nn.Module | None, namespace: dict) -> bool:
    """Is a piece whose possible aliases are `tracked` stored away, returned, or handed to unproven code?"""
    local = dataflow.local_names(funcdef)
    declared = {n for node in walk(funcdef) if isinstance(node, (ast.Global, ast.Nonlocal)) for n in node.names}
    parameters = {arg.arg for arg in walk(funcdef.args) if isinstance(arg, ast.arg)}
    typed = region_rules.transformers_typed(funcdef, namespace)
    for node in walk(funcdef):
        if isinstance(node, ast.Return) and node.value is not None and _carries(node.value, tracked, namespace, local):
            return True
        # an exception carries what it was made with to whoever catches it: a handler, or the caller
        if isinstance(node, ast.Raise) and any(_holds(e, tracked) for e in walk(node) if isinstance(e, ast.expr)):
            return True
        for targets, value in dataflow.node_bindings(node):
            stored = any(
                isinstance(t, (ast.Attribute, ast.Subscript)) or (isinstance(t, ast.Name) and t.id in declared)
                for target in targets
                for t in walk(target)
            )
            if stored and _carries(value, tracked, namespace, local):
                return True
        if _captures(node, tracked, funcdef):
            return True
        if not isinstance(node, ast.Call):
            continue
        operands = [*node.args, *(keyword.value for keyword in node.keywords)]
        if not any(_holds(operand, tracked) for operand in operands):
            continue
        func = node.func
        if _into_held_object(func, namespace, local, module):
            return True
        if (
            isinstance(func, ast.Attribute)
            and isinstance(func.value, ast.Name)
            and func.value.id in parameters - typed
            and func.attr in _KEEPING_METHODS
        ):
            return True  # a container the caller handed in (`sink.append(k)`): the caller keeps what it holds
        if _keeping_builtin(func, namespace, local):
            return True  # `list.append(self.store, k)`, `setattr(box, "k", k)`: Python code that stores its operand
        if self_attr(func):
            child = getattr(module, func.attr, None) if module is not None else None
            if isinstance(child, nn.Module) and not module_effect_free(child):
                return True
        elif isinstance(func, (ast.Name, ast.Attribute)):
            resolved = lookup.resolve_dotted(func, namespace, local)
            user = isinstance(resolved, types.FunctionType) and not (resolved.__module__ or "").startswith("torch")
            if user and not region_rules.effect_free(resolved):
                return True
    return False


_KEEPING_METHODS = frozenset(
    {"append", "extend", "insert", "add", "setdefault", "appendleft", "extendleft", "put", "put_nowait", "push",
     "__setitem__"}
)  # fmt: skip
"""Methods of Python's containers that keep what they are handed. On a parameter not typed as a Transformers
object they carry a piece to the caller. (`update` is left out: an untyped `layer_past.update(k, v)` is a cache's,
trusted as unresolved callees are; a caller's dict updated with a piece is not caught.)"""


def _keeping_builtin(func: ast.expr, namespace: dict, local: set[str]) -> bool:
    """Is `func` a builtin function or method descriptor outside torch that is not on the pure list: one that may
    store what it is handed somewhere that outlives the forward (`list.append`, `dict.update`, `setattr`)?"""
    if not isinstance(func, (ast.Name, ast.Attribute)):
        return False
    resolved = lookup.resolve_dotted(func, namespace, local)
    if resolved is lookup.UNRESOLVED and isinstance(func, ast.Attribute):
        owner = lookup.resolve_dotted(func.value, namespace, local)  # `list.append`: a method taken from its class
        resolved = inspect.getattr_static(owner, func.attr, None) if isinstance(owner, type) else None
    builtin_kinds = (types.BuiltinFunctionType, types.MethodDescriptorType, types.WrapperDescriptorType)
    if not isinstance(resolved, builtin_kinds):
        return False
    module = getattr(resolved, "__module__", None) or getattr(
        getattr(resolved, "__objclass__", None), "__module__", ""
    )
    if (module or "").split(".")[0] == "torch":
        return False
    return not (
        getattr(builtins, resolved.__name__, None) is resolved and resolved.__name__ in vocabulary.PURE_BUILTINS
    )


def _carries(expr: ast.expr, tracked: set[str], namespace: dict, local: set[str]) -> bool:
    """Could the value of `expr` carry one of `tracked` out of sight: `_holds`, or a container holding one, or what a
    call handed one returns (a record class `KV(k, v)`, `max([k])`; only torch code known to allocate is exempt), or
    a lambda, generator or comprehension reading one."""
    if _holds(expr, tracked):
        return True
    if isinstance(expr, (ast.Dict, ast.Set, ast.List, ast.Tuple, ast.Starred, ast.NamedExpr, ast.IfExp)):
        # `[Couple(k, None)]`, `(held := k)`: what an element (or the walrus's value) carries, the container does
        return any(
            _carries(e, tracked, namespace, local) for e in ast.iter_child_nodes(expr) if isinstance(e, ast.expr)
        )
    if isinstance(expr, (ast.Lambda, ast.GeneratorExp, ast.ListComp, ast.SetComp, ast.DictComp)):
        # a lambda's body or defaults, a generator's or comprehension's iterables and elements: read when it runs
        return any(isinstance(n, ast.Name) and n.id in tracked for n in walk(expr))
    if isinstance(expr, ast.Call):
        # a call handed a piece may return it, or hold it in what it returns (`max([k])`, `iter((k,))`, an
        # `nn.Identity`, `F.dropout(k, p, False)`, a record class): only torch code known to allocate does not
        operands = [*expr.args, *(keyword.value for keyword in expr.keywords)]
        if isinstance(expr.func, ast.Attribute):
            operands.append(expr.func.value)
        if not any(_carries(operand, tracked, namespace, local) for operand in operands):
            return False
        return not _allocates(expr, namespace, local)
    return False


_ALLOCATING_TORCH = vocabulary.FRESH_TORCH | {
    "cat", "concat", "concatenate", "stack", "matmul", "mm", "bmm", "baddbmm", "einsum", "linear", "softmax", "add",
    "sub", "mul", "div", "where", "scaled_dot_product_attention", "repeat_interleave",
}  # fmt: skip
"""Torch functions and tensor methods whose result is new storage whatever they are handed (no alias of an
operand, also for one operand: `torch.cat([k])` copies)."""


def _allocates(call: ast.Call, namespace: dict, local: set[str]) -> bool:
    """Is `call` a torch function or a tensor method in `_ALLOCATING_TORCH` (or `FRESH_METHODS`)?"""
    func = call.func
    if isinstance(func, ast.Attribute) and func.attr in vocabulary.FRESH_METHODS | _ALLOCATING_TORCH:
        resolved = lookup.resolve_dotted(func, namespace, local)
        if resolved is lookup.UNRESOLVED:
            return not self_attr(func)  # `k.clone()`, `q.matmul(k)`: a method of a tensor, by name
        module = getattr(resolved, "__module__", None) or ""
        return module.split(".")[0] == "torch" and getattr(resolved, "__name__", "") == func.attr
    if isinstance(func, ast.Name):
        resolved = lookup.resolve_dotted(func, namespace, local)
        module = getattr(resolved, "__module__", None) or ""
        return module.split(".")[0] == "torch" and getattr(resolved, "__name__", "") in _ALLOCATING_TORCH
    return False


def _captures(node: ast.AST, tracked: set[str], funcdef: ast.FunctionDef) -> bool:
    """Is `node` a nested function or lambda of the forward whose body reads one of `tracked` (a closure over a piece:
    whoever ends up holding it reaches the piece after forward returns)?"""
    if node is funcdef or not isinstance(
        node, (ast.Lambda, ast.FunctionDef, ast.AsyncFunctionDef, ast.GeneratorExp)
    ):  # fmt: skip
        return False
    # the whole definition: its body's free names, and its default values and decorators, which it keeps or runs
    return any(isinstance(n, ast.Name) and n.id in tracked for n in walk(node))


def _into_held_object(func: ast.expr, namespace: dict, local: set[str], module) -> bool:
    """Is `func` a method of an object that outlives the forward: a module-level object (`CACHE.append`) or a
    non-module attribute of the module (`self.store.append`)? What such a method is handed may be kept there."""
    if not isinstance(func, ast.Attribute):
        return False
    receiver = func.value
    if self_attr(receiver):
        return module is None or not isinstance(getattr(module, receiver.attr, None), nn.Module)
    if isinstance(receiver, ast.Name) and receiver.id not in local:
        resolved = lookup.resolve_dotted(receiver, namespace, local)
        return resolved is not lookup.UNRESOLVED and not inspect.ismodule(resolved) and not isinstance(resolved, type)
    return False


def view_names(funcdef: ast.FunctionDef, temp: str) -> set[str]:
    """`temp` and the names bound (anywhere) to a view of it or a container holding it (`_holds`): the names whose
    value is the piece's storage. A result of other code handed the piece (`attn_output = attention(q, k, v)`) is
    not one: what such code does with the piece is judged where it is handed it."""
    views = {temp}
    found = list(dataflow.bindings(funcdef))
    changed = True
    while changed:
        changed = False
        for targets, value in found:
            if _holds(value, views):
                new = {name for target in targets for name in dataflow.bound_names(target)} - views
                if new:
                    views |= new
                    changed = True
    return views


def _holds(expr: ast.expr, tracked: set[str]) -> bool:
    """Could `expr` be, or hold, one of `tracked` (a name, a view of one, a tuple or list holding one)?"""
    if isinstance(expr, ast.Name):
        return expr.id in tracked
    if isinstance(expr, (ast.Tuple, ast.List, ast.Starred)):
        return any(_holds(element, tracked) for element in ast.iter_child_nodes(expr) if isinstance(element, ast.expr))
    if isinstance(expr, ast.Subscript):
        return _holds(expr.value, tracked)
    if isinstance(expr, ast.Call) and isinstance(expr.func, ast.Attribute):
        return expr.func.attr in vocabulary.PURE_METHODS - vocabulary.METADATA_METHODS and _holds(
            expr.func.value, tracked
        )
    if isinstance(expr, ast.IfExp):
        return _holds(expr.body, tracked) or _holds(expr.orelse, tracked)
    return False


def needs_contiguous(funcdef: ast.FunctionDef, temp: str, tracked: set[str], inputs: set[str]) -> bool:
    """Does the layout of the piece `temp` (possible aliases `tracked`) show: an unproven `.view` or a layout read?"""
    direct = _direct_names(funcdef, temp)
    parent_of = parent_map(funcdef)
    for node in walk(funcdef):
        if _layout_shows(node, tracked):
            return True
        if not (isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute)):
            continue
        receiver = node.func.value
        if _kept_or_piece(receiver, direct) and node.func.attr == "view":
            # `(k_proj_out if self.qkv_proj is not None else self.k_proj(x)).view(s)`: the piece or a kept
            # projection's own (contiguous) output
            if not _keeps_leading_dims(funcdef, node, inputs):
                return True
            continue
        if not (isinstance(receiver, ast.Name) and receiver.id in tracked):
            if node.func.attr in LAYOUT_METHODS | {"view"} and _holds(receiver, tracked):
                return True  # a view or layout read of something made from the piece
            continue
        if node.func.attr in LAYOUT_METHODS:
            return True
        if node.func.attr == "view" and not (
            _reaches_as_piece(funcdef, receiver, direct, parent_of) and _keeps_leading_dims(funcdef, node, inputs)
        ):
            return True
    return False


_SAME_STORAGE_ATTRS = frozenset({"T", "mT", "H", "mH", "real", "imag", "data"})
"""Tensor attributes that are views of the tensor: their layout is derived from its layout."""


def _layout_shows(node: ast.AST, tracked: set[str]) -> bool:
    """Does `node` show the layout or identity of a piece (possible aliases `tracked`) in a spelling the method check
    of `needs_contiguous` does not read: a layout method called on the class (`torch.Tensor.view(k, -1)`,
    `torch.Tensor.untyped_storage(k)`), on an attribute view (`k.mT.stride()`), a layout attribute (`k._base`), or an
    identity test between values made from a piece (`k.contiguous() is k`: true for a projection's output only), or
    an identity function handed one (`id(k.contiguous()) == id(k)`)?"""

    def made_from_piece(expr):
        while isinstance(expr, ast.Attribute) and expr.attr in _SAME_STORAGE_ATTRS:
            expr = expr.value
        return _holds(expr, tracked)

    if isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute):
        method = node.func.attr
        if method in LAYOUT_METHODS | {"view"}:
            if isinstance(node.func.value, ast.Attribute) and made_from_piece(node.func.value):
                return True
            tensor_class = ast.unparse(node.func.value) in ("torch.Tensor", "Tensor", "torch._C.TensorBase")
            if tensor_class and node.args and made_from_piece(node.args[0]):
                return True
    if isinstance(node, ast.Attribute) and node.attr in LAYOUT_METHODS and made_from_piece(node.value):
        return True
    if isinstance(node, ast.Call) and _identity_function(node.func):
        # `id(k.contiguous()) == id(k)`, `operator.is_(k.contiguous(), k)`: identity compared by value
        return any(made_from_piece(argument) for argument in node.args)
    if isinstance(node, ast.Compare) and all(isinstance(op, (ast.Is, ast.IsNot)) for op in node.ops):
        sides = (node.left, *node.comparators)
        return sum(made_from_piece(side) for side in sides) >= 2
    return False


def _identity_function(func: ast.expr) -> bool:
    """Is `func` spelled as a function that exposes object identity (`id`, `operator.is_`, `operator.is_not`)? Judged
    by name: a shadowing name only costs a copy."""
    if isinstance(func, ast.Name):
        return func.id in ("id", "is_", "is_not")
    return isinstance(func, ast.Attribute) and func.attr in ("is_", "is_not")


def _kept_or_piece(expr: ast.expr, direct: set[str]) -> bool:
    """Is `expr` a conditional whose branches are the piece (a name of `direct`) or a fresh output: a projection's
    own call, or the piece computed alone (`linear_piece(...)`, a tensor of its own)?"""
    if not isinstance(expr, ast.IfExp):
        return False
    branches = (expr.body, expr.orelse)

    def fresh(branch):
        return isinstance(branch, ast.Call) and (
            self_attr(branch.func) or isinstance(branch.func, ast.Name) and branch.func.id == LINEAR_PIECE
        )

    return all((isinstance(b, ast.Name) and b.id in direct) or fresh(b) for b in branches) and any(
        isinstance(b, ast.Name) for b in branches
    )


def _reaches_as_piece(funcdef: ast.FunctionDef, read: ast.Name, direct: set[str], parent_of: dict) -> bool:
    """Is the name `read` sure to hold the piece itself where it is read? Either every binding of it is (`direct`),
    or, with neither the read nor any binding of the name in a loop or nested scope, every binding on an earlier
    line is a plain name of `direct` (`value_states = v_proj_out`, rebound only after the read)."""
    if read.id in direct:
        return True
    if enclosing_loop_or_scope(funcdef, read, parent_of) is not None:
        return False
    earlier = []
    for node in walk(funcdef):
        if isinstance(node, ast.Name) and node.id == read.id and isinstance(node.ctx, (ast.Store, ast.Del)):
            if enclosing_loop_or_scope(funcdef, node, parent_of) is not None:
                return False
            if node.lineno < read.lineno:
                earlier.append(node)
    if not earlier:
        return False
    for node in earlier:
        assign = parent_of.get(node)
        plain = isinstance(assign, ast.Assign) and assign.targets == [node] and isinstance(assign.value, ast.Name)
        if not (plain and assign.value.id in direct):
            return False
    return True


def _direct_names(funcdef: ast.FunctionDef, temp: str) -> set[str]:
    """`temp` and the names every binding of which is a plain name already in the set (`q = q_proj_out`)."""
    values: dict[str, list[ast.expr]] = {}
    for targets, value in dataflow.bindings(funcdef):
        for target in targets:
            for name in dataflow.bound_names(target):
                values.setdefault(name, []).append(value if isinstance(target, ast.Name) else None)
    direct = {temp}
    changed = True
    while changed:
        changed = False
        for name, bound in values.items():
            if name not in direct and all(isinstance(v, ast.Name) and v.id in direct for v in bound):
                direct.add(name)
                changed = True
    return direct


def _keeps_leading_dims(funcdef: ast.FunctionDef, view: ast.Call, inputs: set[str]) -> bool:
    """Is `view`'s shape proven to begin with every leading dim of the projection input (so it only splits the last
    dim of a piece, which a split view allows)?

    Two spellings: `*s` with `s` the input's `shape[:-1]` / `size()[:-1]` (directly or through a name bound once to
    it), and the names bound once by unpacking the input's `shape` / `size()`, all but the last, in order."""
    shape = list(view.args)
    if len(shape) == 1 and isinstance(shape[0], ast.Name):
        bound = _single_binding(funcdef, shape[0].id)
        if isinstance(bound, ast.Tuple):
            shape = list(bound.elts)
    if not shape:
        return False
    first = shape[0]
    if isinstance(first, ast.Starred):
        value = first.value
        if isinstance(value, ast.Name):
            value = _single_binding(funcdef, value.id)
        return value is not None and _leading_of_input(value, inputs)
    unpacked = _unpacked_dims(funcdef, inputs)
    if unpacked is None:
        return False
    leading = unpacked[:-1]
    given = shape[: len(leading)]
    return len(given) == len(leading) and all(
        isinstance(element, ast.Name) and element.id == name for element, name in zip(given, leading)
    )


def _single_binding(funcdef: ast.FunctionDef, name: str) -> ast.expr | None:
    """The value of the one plain assignment to `name` in `funcdef` (None if bound otherwise or more than once)."""
    found = [
        value
        for targets, value in dataflow.bindings(funcdef)
        for target in targets
        if name in dataflow.bound_names(target)
    ]
    if len(found) != 1:
        return None
    return found[0]


def _shape_of_input(expr: ast.expr, inputs: set[str]) -> bool:
    """Is `expr` `x.shape` or `x.size()` for an input name `x`?"""
    if isinstance(expr, ast.Attribute) and expr.attr == "shape":
        return isinstance(expr.value, ast.Name) and expr.value.id in inputs
    if isinstance(expr, ast.Call) and isinstance(expr.func, ast.Attribute) and expr.func.attr == "size":
        return not expr.args and isinstance(expr.func.value, ast.Name) and expr.func.value.id in inputs
    return False


def _leading_of_input(expr: ast.expr, inputs: set[str]) -> bool:
    """Is `expr` `x.shape[:-1]` or `x.size()[:-1]`?"""
    if not (isinstance(expr, ast.Subscript) and isinstance(expr.slice, ast.Slice)):
        return False
    bounds = expr.slice
    minus_one = isinstance(bounds.upper, ast.UnaryOp) and isinstance(bounds.upper.op, ast.USub)
    minus_one = minus_one and isinstance(bounds.upper.operand, ast.Constant) and bounds.upper.operand.value == 1
    return bounds.lower is None and bounds.step is None and minus_one and _shape_of_input(expr.value, inputs)


def _unpacked_dims(funcdef: ast.FunctionDef, inputs: set[str]) -> list[str] | None:
    """The names of `a, b, c = x.shape` (or `x.size()`), if the forward unpacks an input's shape so, each bound once."""
    for targets, value in dataflow.bindings(funcdef):
        for target in targets:
            if isinstance(target, ast.Tuple) and _shape_of_input(value, inputs):
                names = [element.id if isinstance(element, ast.Name) else None for element in target.elts]
                if None not in names and all(_single_binding(funcdef, n) is value for n in names[:-1]):
                    return names
    return None
