"""The rules that keep the merged call in the world of every piece: context, caller-side aliasing, identity.

`hoist.check_input_stable` shows that nothing between the projections writes the input through a name the
forward binds from it. Three more things can change what a later projection computes, and these rules refuse
them (each an allowlist; a false alarm costs a fusion, a miss returns wrong numbers):

* **Ambient state** (`ambient-context`). Grad mode, autocast, saved-tensor hooks and torch function/dispatch modes
  are thread-local: a projection inside a `with` that the region opens, or after a call that switches such state,
  runs under another state than the merged call, which runs before the region. A projection may sit inside a
  `with` of the region only if every item is known not to change numerics or autograd (`HARMLESS_CONTEXTS`); a
  `with` of the region holding no projection must be one torch documents as restoring what it changed on exit
  (`RESTORING_CONTEXTS`); and no call in the region may switch state (`STATE_CALLS`), whatever it is handed.
* **Aliasing made by the caller** (`caller-alias`, `region-call`). The caller can hand the input under another
  name: a second parameter, an item of a container, `*args`/`**kwargs`, an attribute of `self` set by a hook, a
  global registry or a closure cell. So in the region every write (in-place method, `out=`, item store,
  augmented assignment, in-place `operator` function, `inplace=`) must target proven fresh local storage
  (`fresh_names`: every binding of the name is an allocation, a linear's output, or a view of those), and every
  call must be proven not to write anything (`region-call`): allowlisted torch and tensor code, a submodule (judged
  by the input-stability rules), or a module-level Python function whose bytecode, followed through the functions
  it names, stores nothing and calls nothing in place (`effect_free`).
* **Projection identity** (`projection-identity`). After fusion the projections exist only as the merged linear,
  so `forward` may reach them only as the spelled `self.<proj>`: never through `_modules`, a computed
  `getattr`/`setattr`, `attrgetter`, `get_submodule`, `parameters()`/`children()`/`state_dict()`, a property of
  the class, a callee handed `self` (in the region; elsewhere one whose code names a projection), or a module hook
  registered in forward.

* **Implicit calls** (`implicit-call`). An operator, comparison, truth test, item or attribute read, iteration,
  f-string, builtin such as `len` or `next` or `operator` function, decorator or class statement runs special
  methods of its operands with no call spelled: such operands must be known to be tensors, numbers, strings, torch
  or Transformers objects (`known_names`), or the code they run (a `__bool__` that switches grad mode, a generator
  made before the region, a `__len__` that writes what the caller handed) escapes every rule above. A builtin that
  calls a function it is handed (`max(..., key=f)`, `map(f, ...)`) must be handed a builtin or torch one; and what a
  builtin returns is known only from known operands (`_builtin_result_known`: `next` of a `map` over a grad switch,
  made before the region, runs that switch in it). `isinstance` reads `obj.__class__`, which the caller's class may
  answer with its own code: on an object not known, it is trusted only as a `rules.Claim` on a parameter (the
  rewrite guards the merged call with `class_is_honest`), and so is what a narrowing `isinstance` lets the region
  read of the parameter after it.

Besides, `argument-write` refuses torch functions that write an argument though their name has no underscore:
`F.embedding`/`F.embedding_bag` with `max_norm` (they renormalise the weight rows they read) and
`F.batch_norm`/`F.instance_norm` given running statistics outside `training=False` (they update them).
"""

from __future__ import annotations

import ast
import builtins
import contextlib
import dis
import functools
import inspect
import itertools
import math
import operator
import types

import torch
import torch.nn.functional as F
from torch import nn

from fusegen.core import vocabulary
from fusegen.core.astutil import parent_map, self_attr, walk
from fusegen.core.plan import Refused
from fusegen.fusions.merged import dataflow, lookup
from fusegen.fusions.merged.rules import Claim


def _contexts(*dotted: str) -> tuple:
    """The objects named by `dotted` that this torch has (older or newer releases lack some)."""
    found = []
    for name in dotted:
        obj: object = {"torch": torch, "contextlib": contextlib}[name.split(".")[0]]
        for part in name.split(".")[1:]:
            obj = getattr(obj, part, None)
        if obj is not None:
            found.append(obj)
    return tuple(found)


HARMLESS_CONTEXTS = _contexts(
    "torch.profiler.record_function", "torch.autograd.profiler.record_function", "contextlib.nullcontext"
)
"""Context managers that change neither numerics nor autograd: a projection may run inside one the region opens
(a profiler label; `nullcontext`)."""

RESTORING_CONTEXTS = HARMLESS_CONTEXTS + _contexts(
    "torch.no_grad", "torch.enable_grad", "torch.inference_mode", "torch.set_grad_enabled", "torch.autocast",
    "torch.amp.autocast", "torch.cpu.amp.autocast", "torch.autograd.graph.saved_tensors_hooks",
    "torch.autograd.graph.save_on_cpu", "torch.random.fork_rng",
)  # fmt: skip
"""Torch context managers that restore on exit the state they changed on entry: a `with` of the region that holds
no projection leaves the ambient state of the later projections as it found it."""

STATE_CALLS = frozenset(
    {"set_grad_enabled", "_set_grad_enabled", "set_autocast_enabled", "set_autocast_dtype", "set_autocast_gpu_dtype",
     "set_autocast_cpu_dtype", "set_autocast_cpu_enabled", "set_autocast_cache_enabled", "__enter__", "__exit__",
     "enter_context", "enter_async_context", "push", "callback", "set_default_dtype", "set_default_device",
     "set_default_tensor_type", "manual_seed", "seed", "set_rng_state", "use_deterministic_algorithms",
     "set_float32_matmul_precision", "set_flush_denormal", "set_num_threads", "register_module_forward_hook",
     "register_module_forward_pre_hook", "register_module_full_backward_hook", "register_module_backward_hook",
     "register_module_full_backward_pre_hook", "register_module_buffer_registration_hook",
     "register_module_module_registration_hook", "register_module_parameter_registration_hook",
     "_enable_torch_function", "_disable_torch_function", "_push_mode", "_pop_mode", "_set_torch_function_mode",
     "_push_on_torch_function_stack", "_pop_torch_function_stack", "_push_on_torch_dispatch_stack",
     "_pop_torch_dispatch_stack", "set_inference_mode", "_set_multithreading_enabled"}
)  # fmt: skip
"""Names of calls that change thread-local or global state a projection runs under (grad mode, autocast, modes,
saved-tensor hooks, global module hooks, default dtype, RNG): refused in the region whatever their receiver."""

QUERY_TORCH = frozenset(
    {"is_grad_enabled", "is_inference_mode_enabled", "is_autocast_enabled", "get_autocast_dtype",
     "get_autocast_gpu_dtype", "get_autocast_cpu_dtype", "is_tensor", "is_floating_point", "is_complex", "numel",
     "finfo", "iinfo", "get_default_dtype", "result_type", "promote_types", "is_storage", "Size", "device", "dtype"}
)  # fmt: skip
"""Functions and types of the `torch` namespace that read state or build metadata and write nothing."""

DICT_METHODS = frozenset({"get", "keys", "values", "items", "copy", "__contains__", "__getitem__", "__len__"})
"""Methods of the `**kwargs` dict that read it."""

SELF_REFLECTION = frozenset(
    {"get_submodule", "get_parameter", "get_buffer", "parameters", "named_parameters", "buffers", "named_buffers",
     "children", "named_children", "modules", "named_modules", "state_dict", "apply", "register_forward_hook",
     "register_forward_pre_hook", "register_full_backward_hook", "register_full_backward_pre_hook",
     "register_backward_hook", "register_module", "add_module", "register_parameter", "register_buffer",
     "__getattr__", "__setattr__", "__delattr__", "_apply", "to_empty", "load_state_dict", "_modules",
     "_parameters", "_buffers", "__dict__", "_named_members"}
)  # fmt: skip
"""Ways to reach a module's children or parameters, or to hook them, without spelling `self.<name>`."""


def region_findings(
    funcdef: ast.FunctionDef,
    region: list[ast.stmt],
    tracked: set[str],
    names: set[str],
    module: nn.Module,
    namespace: dict,
    projection_calls: list[ast.Call],
):
    """Every finding of this module's rules against fusing `projection_calls` over `region` (a generator)."""
    projections = {call.func.attr for call in projection_calls if self_attr(call.func)}
    local = dataflow.local_names(funcdef)
    fresh = fresh_names(funcdef, module, namespace, tracked)
    trusted = transformers_typed(funcdef, namespace)
    parent_of = parent_map(funcdef)
    skip = {id(call) for call in projection_calls}
    return itertools.chain(
        check_context(funcdef, region, projection_calls, namespace, local),
        check_projection_identity(funcdef, region, projections, module, namespace, local),
        check_argument_writes(region, fresh, module, namespace, local),
        check_caller_writes(region, fresh, names, module, namespace, local, trusted, parent_of),
        check_region_calls(funcdef, region, tracked, fresh, module, namespace, local, skip, trusted, parent_of),
        check_implicit_calls(funcdef, region, tracked, fresh, module, namespace, local, trusted, parent_of),
    )


# --- 1. ambient state --------------------------------------------------------------------------------------------


def check_context(funcdef, region, projection_calls, namespace, local):
    """Refuse (`ambient-context`) a projection inside a `with` the region opens unless every item is harmless, a
    `with` of the region whose items are not known to restore what they change, and a state-switching call other
    than the item of such a `with` (`with torch.set_grad_enabled(False):` around no projection: the call switches,
    the `with` restores on exit, the later projections run under the state they found)."""
    parent_of = parent_map(funcdef)
    inside = {id(node) for node in dataflow.region_nodes(region)}
    holding: set[int] = set()
    for call in projection_calls:
        node = parent_of.get(call)
        while node is not None and id(node) in inside:
            if isinstance(node, (ast.With, ast.AsyncWith)):
                holding.add(id(node))
                for item in node.items:
                    if _context_of(item.context_expr, namespace, local) not in HARMLESS_CONTEXTS:
                        yield Refused(
                            "ambient-context",
                            f"`{ast.unparse(call)}` runs under `with {ast.unparse(item)}`, the merged call before it",
                            call,
                        )
            node = parent_of.get(node)
    restoring_items = {
        id(item.context_expr)
        for node in dataflow.region_nodes(region)
        if isinstance(node, (ast.With, ast.AsyncWith))
        for item in node.items
        if _context_of(item.context_expr, namespace, local) in RESTORING_CONTEXTS
    }
    for node in dataflow.region_nodes(region):
        if isinstance(node, (ast.With, ast.AsyncWith)) and id(node) not in holding:
            for item in node.items:
                if id(item.context_expr) not in restoring_items:
                    yield Refused(
                        "ambient-context",
                        f"`with {ast.unparse(item)}` may change state it does not restore before the next projection",
                        node,
                    )
        # `with torch.set_grad_enabled(False):` switches as it is called, and its `with` switches back on exit
        if isinstance(node, ast.Call) and _switch_name(node, namespace, local) and id(node) not in restoring_items:
            yield Refused(
                "ambient-context", f"`{ast.unparse(node)}` may switch the state the later projections run under", node
            )


def _switch_name(call: ast.Call, namespace: dict, local: set[str]) -> str:
    """The state-switching name `call` calls (`STATE_CALLS`) as spelled, or as the function it resolves to is named
    (`watch = torch.nn.modules.module.register_module_forward_hook` at module level, then `watch(f)`), else ""."""
    if lookup.call_name(call) in STATE_CALLS:
        return lookup.call_name(call)
    if isinstance(call.func, (ast.Name, ast.Attribute)):
        name = getattr(lookup.resolve_dotted(call.func, namespace, local), "__name__", None)
        if isinstance(name, str) and name in STATE_CALLS:
            return name
    return ""


def _context_of(expr: ast.expr, namespace: dict, local: set[str]) -> object:
    """The context manager class or function `expr` calls (`torch.no_grad()` -> `torch.no_grad`), else None."""
    if isinstance(expr, ast.Call) and isinstance(expr.func, (ast.Name, ast.Attribute)):
        resolved = lookup.resolve_dotted(expr.func, namespace, local)
        return None if resolved is lookup.UNRESOLVED else resolved
    return None


# --- 2. caller-side aliasing --------------------------------------------------------------------------------------


def fresh_names(funcdef: ast.FunctionDef, module: nn.Module, namespace: dict, tracked: set[str]) -> set[str]:
    """Local names that can only hold new storage this forward made: every binding of the name (anywhere, so
    flow-insensitively) is an allocation (`torch.empty_like(x)`, `x.new_zeros(n)`, `.clone()`), a plain linear's
    output, a constant, or a view, item or arithmetic result of such names (or a copy or arithmetic result of a
    parameter annotated as a tensor). Never a parameter, a `global` or
    `nonlocal` name, or a name bound by `for`, `with`, `match` or a walrus from anything else."""
    parameters = {arg.arg for arg in walk(funcdef.args) if isinstance(arg, ast.arg)}
    declared = {n for node in walk(funcdef) if isinstance(node, (ast.Global, ast.Nonlocal)) for n in node.names}
    augmented = {id(node.value) for node in walk(funcdef) if isinstance(node, ast.AugAssign)}
    bindings: dict[str, list[ast.expr | None]] = {}
    for targets, value in dataflow.bindings(funcdef):
        if id(value) in augmented:
            continue  # `acc += x` writes into what `acc` holds (judged as a write), it binds no new storage
        for target in targets:
            plain = isinstance(target, ast.Name)
            for name in dataflow.bound_names(target):
                bindings.setdefault(name, []).append(value if plain else None)
    for node in walk(funcdef):
        if isinstance(node, (ast.For, ast.AsyncFor, ast.withitem, ast.comprehension)):
            target = node.target if not isinstance(node, ast.withitem) else node.optional_vars
            for name in dataflow.bound_names(target) if target is not None else ():
                bindings.setdefault(name, []).append(None)
    candidates = set(bindings) - parameters - declared - {"self"}
    # a parameter annotated as a tensor is one (`tensor_annotated`, as in `tensor_names`): `y.clone()`,
    # `y + 1` are new storage; `y` itself never is (it is not a candidate)
    tensors = set(tracked) | tensor_annotated(funcdef)
    fresh = set(candidates)
    changed = True
    while changed:
        changed = False
        for name in sorted(fresh):
            if not all(value is not None and _fresh_expr(value, fresh, tensors, module, namespace)
                       for value in bindings[name]):  # fmt: skip
                fresh.discard(name)
                changed = True
    return fresh


def _fresh_expr(expr: ast.expr, fresh: set[str], tracked: set[str], module, namespace) -> bool:
    """Is `expr` new storage (or a view of new storage), given the names in `fresh` are?"""
    if isinstance(expr, ast.Constant):
        return True
    if isinstance(expr, ast.Name):
        return expr.id in fresh
    if isinstance(expr, ast.Subscript):
        return _fresh_expr(expr.value, fresh, tracked, module, namespace)
    if isinstance(expr, ast.Attribute) and expr.attr in vocabulary.METADATA_ATTRS:
        # a tensor's shape, dtype or flags: ints, tuples and flags that share no storage with anything
        return _tensor_operand(expr.value, fresh, tracked, module, namespace)
    if isinstance(expr, ast.BinOp):
        # arithmetic on a tensor returns a new tensor; the operands must be tensors, not user objects
        return all(_tensor_operand(side, fresh, tracked, module, namespace) for side in (expr.left, expr.right))
    if isinstance(expr, ast.Call):
        if dataflow.linear_output(expr, module):
            return True
        func = expr.func
        if isinstance(func, ast.Attribute) and func.attr in vocabulary.METADATA_METHODS:
            return _tensor_operand(func.value, fresh, tracked, module, namespace)  # `x.size(0)`: an int, no storage
        if isinstance(func, ast.Attribute) and func.attr in vocabulary.FRESH_METHODS:
            return _tensor_operand(func.value, fresh, tracked, module, namespace)
        if isinstance(func, ast.Attribute) and func.attr in vocabulary.PURE_METHODS - vocabulary.METADATA_METHODS:
            return _fresh_expr(func.value, fresh, tracked, module, namespace)  # a view (or copy) of new storage
        resolved = lookup.resolve_dotted(func, namespace) if isinstance(func, (ast.Name, ast.Attribute)) else None
        name = getattr(resolved, "__name__", None)
        return name in vocabulary.FRESH_TORCH and getattr(torch, name, None) is resolved
    return False


def _tensor_operand(expr: ast.expr, fresh: set[str], tracked: set[str], module, namespace) -> bool:
    """Is `expr` a tensor or a number: a constant, new storage, an alias of the input, or a linear's output?"""
    if isinstance(expr, ast.Name) and expr.id in tracked:
        return True
    if isinstance(expr, ast.Attribute) and expr.attr in vocabulary.METADATA_ATTRS:
        return True
    return _fresh_expr(expr, fresh, tracked, module, namespace) or dataflow.linear_output(expr, module)


def _root(expr: ast.expr) -> ast.expr:
    """The object a write through `expr` lands in: `y[0].data` -> `y`, `q.view(-1)` -> `q`, `self.kept` -> itself."""
    while True:
        if isinstance(expr, ast.Subscript) or isinstance(expr, ast.Attribute) and not self_attr(expr):
            expr = expr.value
        elif (
            isinstance(expr, ast.Call)
            and isinstance(expr.func, ast.Attribute)
            and expr.func.attr in vocabulary.PURE_METHODS
            and not self_attr(expr.func)
        ):
            expr = expr.func.value
        else:
            return expr


def _fresh_target(expr: ast.expr, fresh: set[str]) -> bool:
    root = _root(expr)
    return isinstance(root, ast.Name) and root.id in fresh


def _rooted_in(expr: ast.expr, names: set[str]) -> bool:
    root = _root(expr)
    return isinstance(root, ast.Name) and root.id in names


def _narrowing(node: ast.AST, expr: ast.expr, parent_of: dict, namespace: dict) -> Claim | None:
    """A `Claim` on `p`, the name `expr` is rooted at, when `node` is in the body of an `if` whose test requires
    `isinstance(p, C)` (a conjunct), `C` a Transformers class that is not a tensor (`if cache is not None and
    isinstance(cache, EncoderDecoderCache):`); else None. `p` is then such an object there, trusted as
    `transformers_typed` parameters are (a user subclass of `C` included), on the claim: `isinstance` believes an
    object's `__class__`, which the caller's class may make lie. Only for a parameter the function never binds
    again (`_claimable`): a rebinding in the branch would make the test say nothing of the value there, and the
    rewrite's guard tests the parameter at the merged call. `isinstance` and `C` are resolved with the forward's
    own names in sight (a local `DynamicCache = object` is not the class)."""
    root = _root(expr)
    if not isinstance(root, ast.Name):
        return None
    child, current = node, parent_of.get(node)
    while current is not None:
        if isinstance(current, ast.If) and any(child is stmt for stmt in current.body):
            tests = current.test.values if isinstance(current.test, ast.BoolOp) and isinstance(
                current.test.op, ast.And) else [current.test]  # fmt: skip
            for test in tests:
                spelled = (
                    isinstance(test, ast.Call)
                    and isinstance(test.func, ast.Name)
                    and len(test.args) == 2
                    and isinstance(test.args[0], ast.Name)
                    and test.args[0].id == root.id
                )
                if spelled and _narrows(test, root.id, node, parent_of, namespace):
                    return Claim(root.id)
        child, current = current, parent_of.get(current)
    return None


def _narrows(test: ast.Call, name: str, node: ast.AST, parent_of: dict, namespace: dict) -> bool:
    """Is `test`, spelled `f(name, C)`, the builtin `isinstance` against a Transformers class whose metaclass keeps
    `type`'s check, `name` claimable? (The costlier half of `_narrowing`, asked only of such a spelling.)"""
    local = dataflow.local_names(_function_of(node, parent_of))
    if lookup.resolve_dotted(test.func, namespace, local) is not isinstance:
        return False
    cls = lookup.resolve_dotted(test.args[1], namespace, local)
    return _transformers_class(cls) and _plain_instancecheck(cls) and _claimable(name, node, parent_of)


def _claimable(name: str, node: ast.AST, parent_of: dict) -> bool:
    """Is `name` a parameter of the function holding `node` that it never binds again (`_rebound`), and whose
    `__class__` it never sets (`name.__class__ = ...`, `name` handed to `setattr`, `delattr` or `object.__setattr__`,
    or its own `__setattr__` called)? Then the value, and its class, are the same at the merged call, where the
    rewrite tests them, as wherever the region reads them."""
    funcdef = _function_of(node, parent_of)
    if name not in {arg.arg for arg in walk(funcdef.args) if isinstance(arg, ast.arg)}:
        return False

    def is_name(expr):
        return isinstance(expr, ast.Name) and expr.id == name

    setters = ("setattr", "delattr", "__setattr__", "__delattr__")
    for each in walk(funcdef):
        stored = isinstance(each, ast.Attribute) and not isinstance(each.ctx, ast.Load)
        if stored and each.attr == "__class__" and is_name(each.value):
            return False
        if isinstance(each, ast.Call) and lookup.call_name(each) in setters:
            receiver = each.func.value if isinstance(each.func, ast.Attribute) else None
            if is_name(receiver) or any(map(is_name, each.args)):  # `cache.__setattr__(...)`, `setattr(cache, ...)`
                return False
    return not _rebound(name, node, parent_of)


def _function_of(node: ast.AST, parent_of: dict) -> ast.AST:
    """The root of `parent_of`'s chain from `node`: the function analysed."""
    while parent_of.get(node) is not None:
        node = parent_of[node]
    return node


def _plain_instancecheck(cls: object) -> bool:
    """Does `isinstance(obj, cls)` run only `type.__instancecheck__` (which reads `obj.__class__` and nothing else)?
    A metaclass's own `__instancecheck__` may read anything of the object."""
    return isinstance(cls, type) and type(cls).__instancecheck__ is type.__instancecheck__


def _user_class_check(node: ast.AST, spelled: ast.expr, check: str, namespace: dict, local: set[str]):
    """Refuse (`implicit-call`) a class check `node` makes (`isinstance`, `issubclass`, a `case C():` pattern) against
    `spelled` (a class, or a tuple of them) unless every class is resolved here with a `_plain_class_check`."""
    classes = [lookup.resolve_dotted(e, namespace, local) for e in getattr(spelled, "elts", [spelled])]
    if not all(_plain_class_check(cls, check) for cls in classes):
        where = f"case {ast.unparse(node)}" if isinstance(node, ast.MatchClass) else ast.unparse(node)
        yield Refused("implicit-call", f"`{where}` may run a class check written by the user", node)


def _plain_class_check(cls: object, check: str) -> bool:
    """Is `cls` a class whose metaclass's `check` (`__instancecheck__`, `__subclasscheck__`) is `type`'s, or torch's
    or Transformers' own (torch's `Parameter`)? Not `ABCMeta`'s, even for a class of Python's own: it asks the
    class's subclasses too, and a user's subclass may hook them (`__subclasshook__`)."""
    if not isinstance(cls, type):
        return False
    function = getattr(type(cls), check)
    module = getattr(function, "__module__", None) or ""
    return function is getattr(type, check) or module.split(".")[0] in ("torch", "transformers")


def _rebound(name: str, node: ast.AST, parent_of: dict) -> bool:
    """Does the function holding `node` (the root of `parent_of`'s chain) bind `name` anywhere in its body, or
    declare it `global` or `nonlocal` (`dataflow.names_bound_in`: every binding form, `except ... as` and `match`
    captures included)?"""
    root = node
    while parent_of.get(root) is not None:
        root = parent_of[root]
    declared = {n for each in walk(root) if isinstance(each, (ast.Global, ast.Nonlocal)) for n in each.names}
    return name in declared or name in dataflow.names_bound_in(root)


def _transformers_class(cls: object) -> bool:
    return (
        isinstance(cls, type)
        and (cls.__module__ or "").startswith("transformers.")
        and not issubclass(cls, torch.Tensor)
    )


def check_caller_writes(region, fresh, names, module, namespace, local, trusted, parent_of):
    """Refuse (`caller-alias`) a write in the region into anything not proven fresh local storage: a parameter, an
    item of a container, `*args`/`**kwargs`, an attribute of `self`, a global may all be the caller's alias of the
    input. (The writes the input-stability rules see through the input's own aliases are theirs.)"""
    for node in dataflow.region_nodes(region):
        target = None
        if isinstance(node, ast.AugAssign):
            if isinstance(node.target, ast.Name) and node.target.id in names:
                continue  # rebinding the input itself is `input-rebound`'s
            target = node.target
        elif isinstance(node, (ast.Subscript, ast.Attribute)) and isinstance(node.ctx, (ast.Store, ast.Del)):
            if isinstance(node, ast.Attribute) and isinstance(node.value, ast.Name) and node.value.id == "self":
                continue  # rebinding a module attribute writes no tensor (what it held is judged by `state-source`)
            target = node.value
        elif isinstance(node, ast.Call):
            target = _written_operand(node, namespace, local)
        if target is None or _fresh_target(target, fresh) or _rooted_in(target, trusted):
            continue
        if _fresh_expr(_root(target), fresh, set(), module, namespace):
            continue  # written where it is made: `self.gate_proj(x).mul_(0.5)`, `torch.zeros_like(x).add_(1)`
        claim = _narrowing(node, target, parent_of, namespace)
        if claim is not None:
            yield claim
        else:
            yield Refused(
                "caller-alias",
                f"`{ast.unparse(node).strip()}` writes `{ast.unparse(target)}`, which the caller may have made an "
                "alias of the projection input",
                node,
            )


def _written_operand(call: ast.Call, namespace: dict, local: set[str]) -> ast.expr | None:
    """The operand `call` writes in place, if it is a write: the receiver of an in-place method or dunder, the
    `out=` destination, the first operand of an in-place torch or `operator` function or of `inplace=` not False."""
    for keyword in call.keywords:
        if keyword.arg == "out":
            return keyword.value
    func = call.func
    name = lookup.call_name(call)
    in_place = (name.endswith("_") and not name.endswith("__")) or name in vocabulary.INPLACE_DUNDERS
    if isinstance(func, ast.Attribute) and in_place:
        resolved = lookup.resolve_dotted(func, namespace, local)
        if resolved is lookup.UNRESOLVED:  # a method: it writes its receiver
            return func.value
    operator_write = name in ("iadd", "isub", "imul", "itruediv", "ifloordiv", "imod", "ipow", "imatmul", "iand",
                              "ior", "ixor", "ilshift", "irshift", "iconcat", "setitem", "delitem")  # fmt: skip
    flagged = any(
        k.arg == "inplace" and not (isinstance(k.value, ast.Constant) and k.value.value is False)
        for k in call.keywords
    ) or _inplace_positional(call, namespace, local)
    if (in_place or operator_write or flagged) and call.args:
        return call.args[0]
    return None


def _inplace_positional(call: ast.Call, namespace: dict, local: set[str]) -> bool:
    """Is `inplace` passed by position, and not as the constant False (`F.hardtanh(y, -1.0, 1.0, True)`)? Judged on
    the signature of the function the callee resolves to; a callee with no readable signature is judged by
    `region-call`."""
    if not isinstance(call.func, (ast.Name, ast.Attribute)):
        return False
    resolved = lookup.resolve_dotted(call.func, namespace, local)
    try:
        names = list(inspect.signature(resolved).parameters)
    except (TypeError, ValueError):
        return False
    if "inplace" not in names or names.index("inplace") >= len(call.args):
        return False
    if any(isinstance(arg, ast.Starred) for arg in call.args[: names.index("inplace") + 1]):
        return True
    flag = call.args[names.index("inplace")]
    return not (isinstance(flag, ast.Constant) and flag.value is False)


def check_region_calls(funcdef, region, tracked, fresh, module, namespace, local, skip, trusted, parent_of):
    """Refuse (`region-call`) a call in the region not proven to write nothing, whether or not it is handed an
    alias: the caller may have put the input where the callee reaches it (a cache object, a registry, a cell)."""
    tensors = tensor_names(funcdef, tracked, fresh, module, namespace, trusted)
    kwargs = funcdef.args.kwarg.arg if funcdef.args.kwarg else None
    parameters = {arg.arg for arg in walk(funcdef.args) if isinstance(arg, ast.arg)}
    entered = {  # the context managers a `with` of the region enters: judged by `check_context`
        id(node.context_expr)
        for node in dataflow.region_nodes(region)
        if isinstance(node, ast.withitem) and _context_of(node.context_expr, namespace, local) in RESTORING_CONTEXTS
    }
    lambdas = local_lambdas(funcdef, namespace, local)
    for call in (node for node in dataflow.region_nodes(region) if isinstance(node, ast.Call)):
        if id(call) in skip or id(call) in entered:
            continue
        if isinstance(call.func, ast.Attribute) and _rooted_in(call.func.value, trusted):
            continue  # a method of a Transformers object handed in (a cache): `transformers_typed`
        claim = (
            _narrowing(call, call.func.value, parent_of, namespace) if isinstance(call.func, ast.Attribute) else None
        )
        if claim is not None:
            yield claim  # a method of a Transformers object the forward tested for
            continue
        if isinstance(call.func, ast.Name) and call.func.id in lambdas:
            reason = _unproven_function(lambdas[call.func.id])
        else:
            reason = _unproven_call(call, tensors, kwargs, module, namespace, local, trusted, parameters)
        if reason:
            yield Refused("region-call", f"`{ast.unparse(call)}` {reason}", call)


# --- implicit calls ---------------------------------------------------------------------------------------------

_QUIET_BUILTINS = frozenset({"type", "id", "callable", "is_", "is_not"})
"""Builtins and `operator` functions that run no special method of what they are handed (`type` and `callable` read
the type's slots, `id` and `operator.is_` identity). `isinstance` reads `obj.__class__`: `_class_test`."""

_CONSTANT_TYPES = (int, float, complex, str, bytes, bool, type(None), type(Ellipsis), range, slice, torch.dtype,
                   torch.device, torch.Size, torch.memory_format, torch.layout, torch.Tensor, types.ModuleType,
                   types.FunctionType, types.BuiltinFunctionType, types.MethodType, type, nn.Module)  # fmt: skip


def _plain_value(value: object, depth: int = 0) -> bool:
    """Are `value`'s special methods known not to run user code: a number, string, tensor, dtype, module, function,
    class or `nn.Module`; a tuple or frozenset of such; a Transformers or torch object (configs included), trusted as
    `transformers_typed` objects are? Never a mutable container: what it holds at run time is not what it held here."""
    if isinstance(value, (tuple, frozenset)):
        return depth < 3 and all(_plain_value(item, depth + 1) for item in value)
    if isinstance(value, _CONSTANT_TYPES):
        return True
    from transformers import PretrainedConfig

    module = type(value).__module__ or ""
    return isinstance(value, PretrainedConfig) or module.startswith(("transformers.", "torch."))


def _self_value(module: nn.Module, name: str) -> object:
    """What `self.<name>` holds on the instance, found without running a property (a descriptor itself if it is one)."""
    for table in ("_parameters", "_buffers", "_modules"):
        if name in vars(module).get(table, {}):
            return vars(module)[table][name]
    if name in vars(module):
        return vars(module)[name]
    return inspect.getattr_static(type(module), name, None)


def known_names(funcdef, tensors, trusted, module, namespace, local) -> set[str]:
    """Local names whose every value has special methods known not to run user code (a greatest fixpoint, as
    `tensor_names`): the tensors and Transformers objects of `tensor_names`, the `**kwargs` dict, parameters
    annotated with anything but `Any`/`object` (the annotation is trusted, as a tensor annotation is), and locals every
    binding of which is `_known` given the others. A local bound from a method call the proof cannot resolve
    (`cache.update(...)`, judged by `region-call` where it runs in the region) is trusted like that call's result
    elsewhere, and so is one from an effect-free function handed known values (it makes nothing but through torch,
    numbers and tuples); one bound from a user class, a generator function, a generator expression, a lambda or a
    function that is not effect-free is not."""
    names = set(tensors) | set(trusted)
    if funcdef.args.kwarg:
        names |= {funcdef.args.kwarg.arg, "**" + funcdef.args.kwarg.arg}  # the dict is known, its items are not
    for arg in (*funcdef.args.posonlyargs, *funcdef.args.args, *funcdef.args.kwonlyargs):
        if arg.annotation is not None and not any(word in ast.unparse(arg.annotation) for word in ("Any", "object")):
            names.add(arg.arg)
    parameters = {arg.arg for arg in walk(funcdef.args) if isinstance(arg, ast.arg)}
    bindings: dict[str, list] = {}
    for targets, value in dataflow.bindings(funcdef):
        for target in targets:
            for name in dataflow.bound_names(target):
                bindings.setdefault(name, []).append(value)
    for node in walk(funcdef):
        if isinstance(node, (ast.For, ast.AsyncFor, ast.comprehension, ast.withitem)):
            target = node.target if not isinstance(node, ast.withitem) else node.optional_vars
            for name in dataflow.bound_names(target) if target is not None else ():
                bindings.setdefault(name, []).append(None)  # an element of an iterable, a context's value: unknown
        elif isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)) and node is not funcdef:
            bindings.setdefault(node.name, []).append(None)
    for node in walk(funcdef):  # `for i in range(n)`: ints (when `range` is the builtin and `n` is known)
        if isinstance(node, (ast.For, ast.comprehension)) and isinstance(node.target, ast.Name):
            loop = node.iter
            builtin_range = isinstance(loop, ast.Call) and lookup.resolve_dotted(loop.func, namespace, local) is range
            if builtin_range and node.target.id in bindings:
                bindings[node.target.id] = [b if b is not None else loop for b in bindings[node.target.id]]
    candidates = {name for name in bindings if name not in parameters and name != "self"} - names
    assumed = names | candidates
    changed = True
    while changed:
        changed = False
        for name in sorted(candidates & assumed):
            if not all(
                value is not None and _known(value, assumed, module, namespace, local) for value in bindings[name]
            ):
                assumed.discard(name)
                changed = True
    return assumed


def _known(expr, known, module, namespace, local) -> bool:
    """Are the special methods of the value of `expr` known not to run user code (see `known_names`)?"""

    def rec(e):
        return _known(e, known, module, namespace, local)

    if isinstance(expr, (ast.Constant, ast.JoinedStr)):
        return True
    if isinstance(expr, ast.Name):
        if expr.id in known:
            return True
        if expr.id == "self":
            return _module_without_special_methods(module)
        resolved = lookup.resolve_dotted(expr, namespace, local)
        return resolved is not lookup.UNRESOLVED and _plain_value(resolved)
    if isinstance(expr, ast.Starred):
        return rec(expr.value)
    if isinstance(expr, (ast.Tuple, ast.List, ast.Set)):
        return all(rec(element) for element in expr.elts)
    if isinstance(expr, ast.Dict):
        return all(rec(e) for e in (*expr.keys, *expr.values) if e is not None)
    if isinstance(expr, ast.Attribute):
        chain = _self_chain(expr, module)
        if chain is not _NOT_A_CHAIN:
            return _plain_value(chain) or isinstance(chain, property)  # a property: judged by projection-identity
        resolved = lookup.resolve_dotted(expr, namespace, local)
        if resolved is not lookup.UNRESOLVED:
            return _plain_value(resolved)
        return rec(expr.value)
    if isinstance(expr, ast.Subscript):
        return _subscript_known(expr, known, module, namespace, local) and rec(expr.slice)
    if isinstance(expr, ast.Slice):
        return all(rec(e) for e in (expr.lower, expr.upper, expr.step) if e is not None)
    if isinstance(expr, (ast.ListComp, ast.SetComp, ast.DictComp)):
        return True  # a new list, set or dict (builtin methods); its filters and hashing are judged where they run
    if isinstance(expr, ast.Compare) and all(isinstance(op, (ast.Is, ast.IsNot)) for op in expr.ops):
        return True  # identity runs no operand's code and is always a bool (`cache is not None`)
    if isinstance(expr, ast.UnaryOp) and isinstance(expr.op, ast.Not):
        return True  # always a bool; the operand's own truth test is judged where `not` applies it
    if isinstance(expr, (ast.BinOp, ast.UnaryOp, ast.BoolOp, ast.Compare, ast.IfExp)):
        return all(rec(child) for child in ast.iter_child_nodes(expr) if isinstance(child, ast.expr))
    if isinstance(expr, ast.Call):
        func = expr.func
        if _tensor_expr(expr, known, module, namespace):
            return True
        if isinstance(func, (ast.Name, ast.Attribute)):
            resolved = lookup.resolve_dotted(func, namespace, local)
            if resolved is lookup.UNRESOLVED:
                receiver = func.value if isinstance(func, ast.Attribute) else None
                if isinstance(receiver, ast.Name) and "**" + receiver.id in known:
                    return False  # `kwargs.get("cache")`: whatever the caller passed
                if self_attr(func):
                    return isinstance(_self_value(module, func.attr), nn.Module)
                # a method `region-call` judges (`cache.update(k, v, i)`), or a local callable bound from known code
                # (`attention_interface`, never a lambda): its result is trusted as everywhere else in these rules
                return isinstance(func, ast.Attribute) or rec(func)
            operands = [*expr.args, *(k.value for k in expr.keywords)]
            if isinstance(resolved, types.FunctionType):
                generator = resolved.__code__.co_flags & (inspect.CO_GENERATOR | inspect.CO_COROUTINE)
                # an effect-free function makes nothing but through torch, numbers and tuples, from its arguments
                return not generator and effect_free(resolved) and all(rec(operand) for operand in operands)
            if isinstance(resolved, type):
                if not (_plain_value(resolved) and (resolved.__module__ or "").startswith(("builtins", "torch"))):
                    return False
            elif not callable(resolved):
                return False
            return _builtin_result_known(resolved, expr, operands, rec, namespace, local)
        return False
    return False


_FIXED_RESULT = (len, bool, id, hash, isinstance, issubclass, callable, hasattr, int, float)
"""Builtins whose result is an exact `int`, `float` or `bool` whatever they are handed (Python converts what a
special method returns: `int(obj)` is an exact int even if `obj.__int__` returns a subclass)."""


def _called_operand(resolved: object, call: ast.Call) -> ast.expr | None:
    """The operand a builtin calls, now or when its result is advanced: the function of `map`, `filter`,
    `functools.reduce` and the two-argument `iter(f, sentinel)`, the `key` of `sorted`, `min` and `max`."""
    if resolved in (map, filter, functools.reduce) or (resolved is iter and len(call.args) == 2):
        return call.args[0] if call.args else None
    if resolved in (sorted, min, max):
        return next((k.value for k in call.keywords if k.arg == "key"), None)
    return None


def _builtin_callable(expr: ast.expr, namespace: dict, local: set[str]) -> bool:
    """Is `expr` a function of Python's builtins, `math`, `operator` or torch (its code is not the case's), never a
    lambda, a local name, a Python function, a `functools.partial` or a class the case defines?"""
    if not isinstance(expr, (ast.Name, ast.Attribute)):
        return False
    resolved = lookup.resolve_dotted(expr, namespace, local)
    if resolved is lookup.UNRESOLVED:
        return False
    if isinstance(resolved, type):
        return (resolved.__module__ or "") == "builtins" and _plain_value(resolved)
    if isinstance(resolved, types.BuiltinFunctionType):
        module = getattr(resolved, "__module__", None) or ""
        return module in ("builtins", "math", "_operator", "operator") or module.startswith("torch")
    return lookup.is_functional(resolved) or lookup.is_pure_torch(resolved)


def _builtin_result_known(resolved, call: ast.Call, operands: list, rec, namespace: dict, local: set[str]) -> bool:
    """Are the special methods of what a builtin or torch call returns known not to run user code?

    Sound because such a call runs only its own (C or torch) code, the special methods of its operands and, for the
    builtins of `_called_operand`, the operand they call. So if the called operand is a builtin function
    (`_builtin_callable`) and every operand is known, its result is a new builtin object over known values (a list, a
    lazy `map`/`zip`/`iter` whose `__next__` runs only known code), or one of the operands or a part or special-method
    result of one, known as `_known` treats items and attributes of known values; a builtin of `_FIXED_RESULT`
    returns an exact number or bool whatever it is handed. Before, any builtin's result was known: `map(flip, r)`,
    `iter(flip, 1)`, `zip(generator, r)` or `min([obj])` made before the region, then `next(...)`/`if t:` in it, ran
    a grad switch or the caller object's special methods where no rule looked."""
    called = _called_operand(resolved, call)
    if called is not None and not _builtin_callable(called, namespace, local):
        return False
    return resolved in _FIXED_RESULT or all(rec(operand) for operand in operands)


_CLASS_BOOKKEEPING = frozenset(
    {"__init__", "__module__", "__qualname__", "__doc__", "__annotations__", "__dict__", "__weakref__",
     "__firstlineno__", "__static_attributes__", "__classcell__", "__orig_bases__", "__parameters__",
     "__annotate_func__", "__annotations_cache__", "__type_params__"}
)  # fmt: skip


def _module_without_special_methods(module: nn.Module) -> bool:
    """Do the module's own classes (those not from torch or Transformers) define no special method, so that `self`
    handed to a builtin (`getattr(self, "flag")`) or an operator runs only `nn.Module`'s?"""
    for cls in type(module).__mro__:
        if (cls.__module__ or "").startswith(("torch", "transformers", "builtins")):
            continue
        if any(n.startswith("__") and n.endswith("__") and n not in _CLASS_BOOKKEEPING for n in vars(cls)):
            return False
    return True


def _subscript_known(expr: ast.Subscript, known, module, namespace, local) -> bool:
    """An item of a tensor (a tensor), of a tuple literal's name, or of a known local; never of a mutable global."""
    value = expr.value
    if isinstance(value, ast.Name) and (value.id not in known or "**" + value.id in known):
        return False  # an unknown container's item, or an item of `**kwargs`: whatever the caller passed
    return _known(value, known, module, namespace, local)


_NOT_A_CHAIN = object()


def _self_chain(expr: ast.Attribute, module: nn.Module) -> object:
    """What `self.a.b...` holds, read without running code through modules only (`self.block.flag`), a descriptor
    where one stands; `_NOT_A_CHAIN` for an expression not rooted at `self` or reaching past a non-module."""
    names = []
    while isinstance(expr, ast.Attribute):
        names.append(expr.attr)
        expr = expr.value
    if not (isinstance(expr, ast.Name) and expr.id == "self"):
        return _NOT_A_CHAIN
    value: object = module
    for name in reversed(names):
        if not isinstance(value, nn.Module):
            return value if _plain_value(value) and not isinstance(value, nn.Module) else _NOT_A_CHAIN
        value = _self_value(value, name)
    return value


def check_implicit_calls(funcdef, region, tracked, fresh, module, namespace, local, trusted, parent_of):
    """Refuse (`implicit-call`) an operation of the region that runs code of an object not known to be a tensor,
    number, string or Transformers object, though no call is spelled: an operator or comparison (`cache + 1`,
    `sw == 0`; not `is`), a truth test (`if sw:`, `assert`, `and`/`or`/`not`), an item or attribute read (`__getitem__`,
    a property, `__getattr__`), iteration or unpacking (`for t in cache`, `a, b = obj`, `*obj`), a `match` subject,
    an f-string (`__format__`), a builtin or `operator` function that calls the special methods of what it is handed
    (`len`, `next`, `str`, `list`, `operator.add`, ..., not `isinstance`/`type`/`operator.is_`), a function a builtin
    calls (`map(f, ...)`, `max(..., key=f)`: `_called_operand`, unless a builtin or torch function), a decorator
    applied, a class statement (its body, bases and metaclass run).

    Sound because each of these runs user code exactly when an operand's special methods are user code, and
    `known_names` admits only values whose special methods are torch's, Python's or (trusted) Transformers': such code
    could switch grad mode (a generator advanced by `next`, a `__bool__`) or write what the caller made an alias of
    the input (`Sly.__len__`), and `region-call` sees no call to judge."""
    tensors = tensor_names(funcdef, tracked, fresh, module, namespace, trusted)
    known = known_names(funcdef, tensors, trusted, module, namespace, local)

    def operand(node, expr, what):
        if expr is None or _known(expr, known, module, namespace, local):
            return
        claim = _narrowing(node, expr, parent_of, namespace) if isinstance(expr, ast.Name) else None
        if claim is not None:
            yield claim  # a Transformers object the forward tested for
        else:
            yield Refused(
                "implicit-call",
                f"`{ast.unparse(node).strip().splitlines()[0]}` {what} `{ast.unparse(expr)}`, whose special methods "
                "may be user code",
                node,
            )

    calls_func = {id(node.func) for node in dataflow.region_nodes(region) if isinstance(node, ast.Call)}
    rebound = _rebound_names(funcdef, parent_of)
    earlier = _bindings_in_order(funcdef)
    for node in dataflow.region_nodes(region):
        if isinstance(node, (ast.BinOp, ast.AugAssign)):
            pair = (node.left, node.right) if isinstance(node, ast.BinOp) else (node.target, node.value)
            for side in pair:
                yield from operand(node, side, "applies an operator to")
        elif isinstance(node, ast.UnaryOp):
            yield from operand(node, node.operand, "applies an operator to")
        elif isinstance(node, ast.Compare):
            if all(isinstance(op, (ast.Is, ast.IsNot)) for op in node.ops):
                continue
            for side in (node.left, *node.comparators):
                yield from operand(node, side, "compares")
        elif isinstance(node, ast.BoolOp):
            for value in node.values:
                yield from operand(node, value, "tests the truth of")
        elif isinstance(node, (ast.If, ast.While, ast.Assert, ast.IfExp)):
            yield from operand(node, node.test, "tests the truth of")
        elif isinstance(node, (ast.comprehension, ast.For, ast.AsyncFor)):
            yield from operand(node, node.iter, "iterates over")
            for test in getattr(node, "ifs", ()):  # a comprehension's filters test the truth of each value
                yield from operand(node, test, "tests the truth of")
        elif (
            isinstance(node, ast.Assign) and any(isinstance(t, (ast.Tuple, ast.List)) for t in node.targets)
        ) or isinstance(node, ast.Starred):
            yield from operand(node, node.value, "unpacks")
        elif isinstance(node, (ast.Set, ast.SetComp, ast.Dict, ast.DictComp)):  # a set member or key is hashed
            keys = {ast.Set: "elts", ast.SetComp: "elt", ast.Dict: "keys", ast.DictComp: "key"}[type(node)]
            found = getattr(node, keys)
            for key in found if isinstance(found, list) else [found]:
                yield from operand(node, key, "hashes")
            if isinstance(node, ast.Dict):  # `{**m}` lists `m`'s keys and reads its items
                for key, value in zip(node.keys, node.values):
                    if key is None:
                        yield from operand(node, value, "unpacks")
        elif isinstance(node, ast.keyword) and node.arg is None:  # `f(**m)`: the same
            yield from operand(node, node.value, "unpacks")
        elif isinstance(node, ast.Raise):
            for made in (node.exc, node.cause):  # `raise E` makes `E()`: its `__init__` runs
                if isinstance(made, (ast.Name, ast.Attribute)) and not _builtin_exception(made, namespace, local):
                    yield Refused("implicit-call", f"`{ast.unparse(node)}` makes an exception of a class not Python's",
                                  node)  # fmt: skip
        elif isinstance(node, ast.Name) and isinstance(node.ctx, (ast.Store, ast.Del)) and node.id not in known:
            if _may_drop_unknown(node, rebound, earlier, parent_of, known, module, namespace, local):
                yield Refused(
                    "implicit-call",
                    f"`{node.id}` is {'deleted' if isinstance(node.ctx, ast.Del) else 'rebound'} in the region: the "
                    "value it held may be collected, and its `__del__`, a weakref finalizer or a generator's "
                    "`finally` run",
                    node,
                )
        elif isinstance(node, ast.Match):
            yield from operand(node, node.subject, "matches")
        elif isinstance(node, ast.MatchClass):  # `case Probe():` is `isinstance(subject, Probe)`
            yield from _user_class_check(node, node.cls, "__instancecheck__", namespace, local)
        elif isinstance(node, ast.FormattedValue):
            yield from operand(node, node.value, "formats")
        elif isinstance(node, ast.Subscript) and isinstance(node.ctx, ast.Load):
            yield from operand(node, node.value, "reads an item of")
            yield from operand(node, node.slice, "indexes with")
        elif isinstance(node, ast.Attribute) and isinstance(node.ctx, ast.Load) and id(node) not in calls_func:
            if not self_attr(node) and lookup.resolve_dotted(node, namespace, local) is lookup.UNRESOLVED:
                yield from operand(node, node.value, "reads an attribute of")
        elif isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)) and node.decorator_list:
            yield Refused("implicit-call", f"`{node.name}` is decorated in the region: the decorator runs", node)
        elif isinstance(node, ast.ClassDef):
            yield Refused("implicit-call", f"`class {node.name}` runs its body, bases and metaclass", node)
        elif isinstance(node, ast.Call) and isinstance(node.func, (ast.Name, ast.Attribute)):
            resolved = lookup.resolve_dotted(node.func, namespace, local)
            builtin = isinstance(resolved, (types.BuiltinFunctionType, type)) and (
                getattr(builtins, getattr(resolved, "__name__", ""), None) is resolved
            )
            # `operator.add(obj, 1)`, `operator.truth(obj)`: the operator spelled as a function, as `obj + 1` is
            operator_function = lookup.operator_module_function(resolved) is not None
            if resolved is issubclass and node.args:
                yield from _user_class_check(node, node.args[-1], "__subclasscheck__", namespace, local)
            if resolved is isinstance:
                yield from _class_test(node, operand, parent_of, namespace, local)
            elif (builtin or operator_function) and resolved.__name__ not in _QUIET_BUILTINS:
                for argument in (*node.args, *(k.value for k in node.keywords)):
                    if not isinstance(argument, ast.GeneratorExp):  # its parts are nodes of the region, judged here
                        yield from operand(node, argument, "hands a builtin")
                called = _called_operand(resolved, node)
                if called is not None and not _builtin_callable(called, namespace, local):
                    yield Refused(
                        "implicit-call",
                        f"`{ast.unparse(node)}` calls `{ast.unparse(called)}`, which may be user code",
                        node,
                    )
            elif _torch_dispatching(node, resolved, tensors):
                # a torch function or tensor method calls `__torch_function__` of any argument that defines it
                for argument in (*node.args, *(k.value for k in node.keywords)):
                    if not isinstance(argument, (ast.GeneratorExp, ast.Lambda)):
                        yield from operand(node, argument, "hands torch")


def _class_test(call: ast.Call, operand, parent_of: dict, namespace: dict, local: set[str]):
    """Findings for `isinstance(obj, C)`. It runs `C`'s metaclass's `__instancecheck__`, which for `type` reads
    `obj.__class__` once `type(obj)` is not a subclass, a read the caller's class can answer with its own code:
    - every class named must be resolved here, with a metaclass check that is `type`'s or torch's or
      Transformers' own (`_plain_class_check`): a user's `__instancecheck__`, or `ABCMeta`'s, which calls
      `__subclasshook__` of the class and its subclasses, is user code whatever it is handed;
    - `obj` known (`known_names`): its reads run no user code;
    - otherwise `obj` a parameter never bound again, and every class checked by `type`'s `__instancecheck__`: a
      `Claim` on it (the merged call runs only where `class_is_honest(obj)`);
    - anything else is refused as an implicit call."""
    if len(call.args) != 2 or call.keywords:
        yield from operand(call, call.args[0] if call.args else None, "hands a builtin")
        return
    subject, spelled = call.args
    refused = list(_user_class_check(call, spelled, "__instancecheck__", namespace, local))
    if refused:
        yield from refused
        return
    classes = [lookup.resolve_dotted(e, namespace, local) for e in getattr(spelled, "elts", [spelled])]
    findings = list(operand(call, subject, "hands `isinstance`"))
    claimable = isinstance(subject, ast.Name) and _claimable(subject.id, call, parent_of)
    if all(isinstance(finding, Claim) for finding in findings):
        yield from findings
    elif claimable and all(map(_plain_instancecheck, classes)):
        yield Claim(subject.id)
    else:
        yield from findings


def _rebound_names(funcdef: ast.FunctionDef, parent_of: dict) -> tuple[set[str], set[str]]:
    """Names a store may rebind while they hold a value: those bound more than once in the forward (a parameter
    counts as bound), and those bound in a loop. (A name bound once, outside loops, drops no value when bound.)
    Comprehension variables are left out: they hold items of an iterable that still holds them, and an iterable that
    is not known is refused itself."""
    counts: dict[str, int] = {arg.arg: 1 for arg in walk(funcdef.args) if isinstance(arg, ast.arg)}
    looped: set[str] = set()
    comprehended = {
        name
        for node in walk(funcdef)
        if isinstance(node, ast.comprehension)
        for name in dataflow.bound_names(node.target)
    }
    for node in walk(funcdef):
        if isinstance(node, ast.Name) and isinstance(node.ctx, ast.Store):
            counts[node.id] = counts.get(node.id, 0) + 1
            current = parent_of.get(node)
            while current is not None and current is not funcdef:
                if isinstance(current, (ast.For, ast.AsyncFor, ast.While)):
                    looped.add(node.id)
                current = parent_of.get(current)
    return {name for name, count in counts.items() if count > 1} - comprehended, looped - comprehended


def _bindings_in_order(funcdef: ast.FunctionDef) -> dict[str, list[tuple]]:
    """Each name's bindings: source position, the value bound (None when not a plain assignment), the target node."""
    found: dict[str, list] = {}
    for targets, value in dataflow.bindings(funcdef):
        for target in targets:
            plain = isinstance(target, ast.Name)
            for node in walk(target):
                if isinstance(node, ast.Name):
                    found.setdefault(node.id, []).append(
                        ((node.lineno, node.col_offset), value if plain else None, node)
                    )
    for node in walk(funcdef):
        if isinstance(node, (ast.For, ast.AsyncFor, ast.withitem)):
            target = node.target if not isinstance(node, ast.withitem) else node.optional_vars
            for name in walk(target) if target is not None else ():
                if isinstance(name, ast.Name):
                    found.setdefault(name.id, []).append(((name.lineno, name.col_offset), None, name))
    return found


def _may_drop_unknown(node: ast.Name, rebound: tuple, earlier: dict, parent_of, known, module, namespace, local):
    """May the store or `del` at `node` drop the last reference to a value not known to be plain (`known_names`)?
    A `del` always may. A store may when the name is bound in a loop and not known, or when a binding of it that comes
    earlier in the source binds something not proven known: outside loops only an earlier binding can reach the
    store. A parameter's first rebinding drops nothing the caller does not still hold (its call passes the
    argument, and keeps it, until forward returns)."""
    if isinstance(node.ctx, ast.Del):
        return True
    bound_again, looped = rebound
    if node.id not in bound_again | looped:
        return False
    position = (node.lineno, node.col_offset)
    if node.id in looped:
        return True
    before = [
        value
        for where, value, binding in earlier.get(node.id, [])
        if where < position and not _other_branch(binding, node, parent_of)
    ]
    return not all(value is not None and _known(value, known, module, namespace, local) for value in before)


def _other_branch(binding: ast.AST, store: ast.AST, parent_of: dict) -> bool:
    """Are `binding` and `store` in different branches of one `if` (so, with no loop around, the binding cannot
    reach the store)?"""
    branch_of = {}
    child, current = store, parent_of.get(store)
    while current is not None:
        if isinstance(current, ast.If):
            branch_of[id(current)] = any(child is stmt for stmt in current.body)
        child, current = current, parent_of.get(current)
    child, current = binding, parent_of.get(binding)
    while current is not None:
        if isinstance(current, ast.If) and id(current) in branch_of:
            in_body = any(child is stmt for stmt in current.body)
            in_test = child is current.test
            return not in_test and in_body != branch_of[id(current)]
        child, current = current, parent_of.get(current)
    return False


def _builtin_exception(expr: ast.expr, namespace: dict, local: set[str]) -> bool:
    """Does `expr` name one of Python's exception classes (whose `__init__` runs no user code)?"""
    resolved = lookup.resolve_dotted(expr, namespace, local)
    return isinstance(resolved, type) and issubclass(resolved, BaseException) and resolved.__module__ == "builtins"


def _torch_dispatching(call: ast.Call, resolved: object, tensors: set[str]) -> bool:
    """Is `call` a torch function or a method of a known tensor (which hand their arguments to `__torch_function__`)?
    Not a projection or submodule call (`self.<child>(...)`, judged by the other rules)."""
    if self_attr(call.func):
        return False
    if (
        isinstance(call.func, ast.Attribute)
        and isinstance(call.func.value, ast.Name)
        and call.func.value.id in tensors
    ):
        return True
    module = getattr(resolved, "__module__", None) or ""
    return callable(resolved) and not isinstance(resolved, type) and module.split(".")[0] == "torch"


def local_lambdas(funcdef: ast.FunctionDef, namespace: dict, local: set[str]) -> dict[str, types.FunctionType]:
    """The local names bound to a lambda whose call `region-call` can judge as it judges a module-level function,
    each with that lambda made as a function of the module (its `__globals__` the module's namespace).

    A name qualifies when its one binding in the whole forward is a statement `f = lambda ...: ...` of the forward's
    own body (no other assignment, `del`, loop or `with` target, parameter, nested def or class, import, `except`
    name, match capture, `global`/`nonlocal` anywhere, nested scopes included), and the lambda has no default
    values (evaluating it then runs no code) and reads none of the forward's local names (it captures no state of
    the frame: every free name it reads is a global or builtin, as for a module-level function). Then every call of
    the name runs that lambda's code, reading only its arguments and the module's globals, exactly as the function
    returned here would, so `effect_free` on it is `effect_free` on what runs. Reflection that could rebind the name
    (`locals()`, frames) is refused by `reflection` and `frame-access` on its own."""
    counts: dict[str, int] = {}

    def bound(name: str) -> None:
        counts[name] = counts.get(name, 0) + 1

    for node in walk(funcdef):
        if isinstance(node, ast.Name) and not isinstance(node.ctx, ast.Load):
            bound(node.id)
        elif isinstance(node, ast.arg):
            bound(node.arg)
        elif (
            isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef))
            and node is not funcdef
            or isinstance(node, ast.ExceptHandler)
            and node.name
        ):
            bound(node.name)
        elif isinstance(node, ast.alias):
            bound((node.asname or node.name).split(".")[0])
        elif isinstance(node, (ast.MatchAs, ast.MatchStar)) and node.name:
            bound(node.name)
        elif isinstance(node, ast.MatchMapping) and node.rest:
            bound(node.rest)
        elif isinstance(node, (ast.Global, ast.Nonlocal)):
            for name in node.names:
                counts[name] = counts.get(name, 0) + 2
    found = {}
    for stmt in funcdef.body:
        if not (
            isinstance(stmt, ast.Assign)
            and len(stmt.targets) == 1
            and isinstance(stmt.targets[0], ast.Name)
            and isinstance(stmt.value, ast.Lambda)
            and counts.get(stmt.targets[0].id) == 1
        ):
            continue
        lam = stmt.value
        if lam.args.defaults or any(default is not None for default in lam.args.kw_defaults):
            continue
        own = {arg.arg for arg in walk(lam.args) if isinstance(arg, ast.arg)}
        read = {n.id for n in walk(lam.body) if isinstance(n, ast.Name)}
        if (read - own) & local:
            continue
        # evaluating a lambda without defaults only makes the function object: no code of the case runs here
        found[stmt.targets[0].id] = eval(compile(ast.Expression(lam), "<local lambda>", "eval"), namespace)
    return found


def tensor_annotated(funcdef: ast.FunctionDef) -> set[str]:
    """Parameters annotated as tensors (`y: torch.Tensor`, `y: torch.Tensor | None`): what the caller hands is its
    own, trusted to match the annotation."""
    return {
        arg.arg
        for arg in (*funcdef.args.posonlyargs, *funcdef.args.args, *funcdef.args.kwonlyargs)
        if arg.annotation is not None and "Tensor" in ast.unparse(arg.annotation)
    }


def tensor_names(funcdef, tracked, fresh, module, namespace, trusted=frozenset()) -> set[str]:
    """Local names that can only hold tensors (or tuples of them, or numbers): the input's aliases (a tensor's views),
    fresh storage, parameters annotated as tensors (what they hold is the caller's, trusted to match), and local
    names every binding of which is trusted tensor code applied to such names (`_tensor_expr`). A greatest fixpoint,
    so `g = g.reshape(s)` keeps `g` a tensor: every value ever bound to such a name is a tensor, by induction over
    the bindings run (each reads only names bound before it). What a Transformers object handed in holds
    (`key, value = shared_kv_states[kind]`) counts as tensors (`transformers_typed`, in `trusted`)."""
    names = set(tracked) | set(fresh) | set(trusted)
    parameters = {arg.arg for arg in walk(funcdef.args) if isinstance(arg, ast.arg)}
    names |= tensor_annotated(funcdef)
    bindings: dict[str, list] = {}
    for targets, value in dataflow.bindings(funcdef):
        for target in targets:
            for name in dataflow.bound_names(target):
                bindings.setdefault(name, []).append(value)
    candidates = {name for name in bindings if name not in parameters and name != "self"}
    assumed = names | candidates
    changed = True
    while changed:
        changed = False
        for name in sorted(candidates & assumed - names):
            if not all(_tensor_expr(value, assumed, module, namespace, trusted) for value in bindings[name]):
                assumed.discard(name)
                changed = True
    return assumed


def transformers_typed(funcdef: ast.FunctionDef, namespace: dict) -> set[str]:
    """Parameters annotated with a class of Transformers that is not a tensor (`cache: Cache | None`).

    Trusted like Transformers' activation modules: such an object (a cache) is not the projection input and holds
    none of its storage, and its methods (`cache.is_updated.get(i)`, `cache.get_seq_length()`) and the bookkeeping
    written into it (`cache.is_updated[i] = True`) touch only its own state."""
    found = set()
    for arg in (*funcdef.args.posonlyargs, *funcdef.args.args, *funcdef.args.kwonlyargs):
        if arg.annotation is None:
            continue
        classes = [
            lookup.resolve_dotted(node, namespace)
            for node in walk(arg.annotation)
            if isinstance(node, (ast.Name, ast.Attribute))
        ]
        classes = [c for c in classes if isinstance(c, type)]
        if classes and all(_transformers_class(c) for c in classes):
            found.add(arg.arg)
    return found


def _tensor_expr(expr: ast.expr, tensors: set[str], module, namespace, trusted=frozenset()) -> bool:
    """Is `expr` a tensor (or a tuple of tensors, or a number) made by trusted tensor code from `tensors`?"""
    if isinstance(expr, ast.Constant):
        return True
    if isinstance(expr, ast.Name):
        return expr.id in tensors
    if isinstance(expr, (ast.Tuple, ast.List)):
        return all(_tensor_expr(element, tensors, module, namespace, trusted) for element in expr.elts)
    if isinstance(expr, ast.Subscript):
        return _tensor_expr(expr.value, tensors, module, namespace, trusted)
    if isinstance(expr, (ast.BinOp, ast.UnaryOp)):
        operands = [child for child in ast.iter_child_nodes(expr) if isinstance(child, ast.expr)]
        return all(_tensor_expr(operand, tensors, module, namespace, trusted) for operand in operands)
    if isinstance(expr, ast.IfExp):
        return all(_tensor_expr(side, tensors, module, namespace, trusted) for side in (expr.body, expr.orelse))
    if self_attr(expr):
        return isinstance(getattr(module, expr.attr, None), (int, float, bool, torch.Tensor))  # `self.scaling`
    if isinstance(expr, ast.Attribute):
        return expr.attr in vocabulary.METADATA_ATTRS or expr.attr in ("T", "mT", "H", "mH", "real", "imag")
    if isinstance(expr, ast.Call):
        func = expr.func
        if isinstance(func, ast.Attribute) and _rooted_in(func.value, set(trusted)):
            return True  # what a Transformers object handed in returns (`cache.update(k, v, i)`): `transformers_typed`
        if self_attr(func):
            return isinstance(getattr(module, func.attr, None), nn.Module)  # a submodule returns tensors (trusted)
        method = isinstance(func, ast.Attribute) and func.attr in vocabulary.PURE_METHODS
        if method and lookup.resolve_dotted(func, namespace) is lookup.UNRESOLVED:
            return _tensor_expr(func.value, tensors, module, namespace, trusted)
        resolved = lookup.resolve_dotted(func, namespace) if isinstance(func, (ast.Name, ast.Attribute)) else None
        if isinstance(resolved, types.FunctionType) and not (resolved.__module__ or "").startswith("torch"):
            # an effect-free function builds no object but through torch, numbers and tuples (`apply_rotary_pos_emb`)
            return effect_free(resolved)
        return lookup.is_functional(resolved) or lookup.is_pure_torch(resolved)
    return False


def _unproven_call(call: ast.Call, tensors, kwargs, module, namespace, local, trusted, parameters) -> str | None:
    """Why `call` is not proven to leave every object the caller may alias intact, or None if it is."""
    func = call.func
    if self_attr(func):
        return None  # a submodule (judged by `impure-call` when handed an alias); self methods: `state-method-call`
    if isinstance(func, (ast.Name, ast.Attribute)):
        resolved = lookup.resolve_dotted(func, namespace, local)
        if resolved is not lookup.UNRESOLVED:
            return _unproven_function(resolved)
    if isinstance(func, ast.Attribute):
        receiver = func.value
        if isinstance(receiver, ast.Name) and receiver.id == kwargs and func.attr in DICT_METHODS:
            return None
        if _tensor_expr(receiver, tensors, module, namespace, trusted) and (
            func.attr in vocabulary.PURE_METHODS or func.attr.endswith("_")
        ):
            return None  # a tensor method; what an in-place one writes is judged by `caller-alias`
        root = _root(receiver)
        local_value = isinstance(root, ast.Name) and root.id in local and root.id not in parameters
        if local_value and func.attr in vocabulary.PURE_METHODS:
            # A local bound from code this proof cannot follow (`mixed_qkv = causal_conv1d_update(...)` elsewhere in
            # the forward) is trusted to be a tensor for tensor-method names: a known gap, see docs/analysis.md.
            return None
        return "calls a method of an object not known to be a tensor"
    return "calls something not statically known"


def _unproven_function(function: object) -> str | None:
    """Why calling the resolved `function` may write something, or None."""
    name = getattr(function, "__name__", "") or ""
    if any(function is getattr(builtins, pure, None) for pure in vocabulary.PURE_BUILTINS):
        return None
    if function in (getattr, hasattr, isinstance):
        return None
    if lookup.operator_module_function(function) is not None:
        return None if name in vocabulary.PURE_OPERATORS else "is an `operator` function that writes its operand"
    if lookup.is_functional(function) or lookup.is_pure_torch(function):
        return None
    if getattr(torch, name, None) is function and (name in QUERY_TORCH or name in vocabulary.FRESH_TORCH):
        return None
    if getattr(math, name, None) is function:
        return None
    if name.endswith("_") and getattr(torch, name, None) is function:
        return None  # `torch.relu_(t)`: what it writes is judged by `caller-alias`
    if isinstance(function, types.FunctionType) and effect_free(function):
        return None
    return "may write an object the caller handed over (not on the allowlist, and not proven free of writes)"


_WRITING_OPS = frozenset(
    {"STORE_ATTR", "STORE_SUBSCR", "STORE_GLOBAL", "STORE_DEREF", "DELETE_ATTR", "DELETE_SUBSCR", "DELETE_GLOBAL",
     "DELETE_DEREF", "STORE_SLICE", "IMPORT_NAME"}
)  # fmt: skip


def effect_free(function: types.FunctionType, seen: set | None = None) -> bool:
    """Does `function` provably write nothing outside its own frame and switch no state?

    Judged on its bytecode (nested code included): no attribute, item, slice, global or cell store; no name that
    ends in `_` (an in-place method or torch function), an in-place dunder or `operator` function, a
    state-switching call (`STATE_CALLS`) or a reflection name; every global it reads is a module of torch, `math`
    or `operator`, a builtin on the pure list, a constant, or a Python function that is itself effect-free
    (followed, at most 50 deep). Torch's own functions are not followed; the names the code reaches them by are
    judged. A false alarm costs a fusion."""
    seen = set() if seen is None else seen
    if function in seen:
        return True
    if len(seen) > 50 or (function.__module__ or "").startswith("torch"):
        # torch's own Python functions are trusted, except its state switches under any name the caller gives them
        return len(seen) <= 50 and function.__name__ not in STATE_CALLS
    seen.add(function)
    bad_names = STATE_CALLS | vocabulary.INPLACE_DUNDERS | vocabulary.REFLECTION_NAMES | vocabulary.FRAME_ATTRS
    writes_operand = {"iadd", "isub", "imul", "itruediv", "setitem", "delitem", "inplace", "out"}
    for code in _codes(function.__code__):
        if code.co_flags & (inspect.CO_GENERATOR | inspect.CO_COROUTINE):
            return False
        for instruction in dis.get_instructions(code):
            if instruction.opname in _WRITING_OPS:
                return False
        for name in (*code.co_names, *code.co_varnames):
            if (name.endswith("_") and not name.endswith("__")) or name in bad_names or name in writes_operand:
                return False
    loaded = {
        instruction.argval
        for code in _codes(function.__code__)
        for instruction in dis.get_instructions(code)
        if instruction.opname in ("LOAD_GLOBAL", "LOAD_NAME")
    }
    # what the code reads besides globals: its closure cells (a `functools.singledispatch` function calls what its
    # `dispatch` cell finds in a registry) and its default values; judged as a global holding them would be
    held = [*(function.__defaults__ or ()), *(function.__kwdefaults__ or {}).values()]
    for cell in function.__closure__ or ():
        try:
            held.append(cell.cell_contents)
        except ValueError:
            return False  # an empty cell: filled later, by code not seen here
    for value in held:
        if not _held_value_ok(value, seen):
            return False
    for name in loaded:  # the globals and builtins the code reads (attribute names are judged above)
        if name in function.__globals__:
            value = function.__globals__[name]
        elif hasattr(builtins, name):
            value = getattr(builtins, name)
            if not (name in vocabulary.PURE_BUILTINS or value in (getattr, hasattr, isinstance)):
                return False
            continue
        else:
            return False  # a name neither global nor builtin: it raises, or is injected later
        if inspect.ismodule(value):
            if value.__name__.split(".")[0] not in ("torch", "math", "operator", "typing"):
                return False
        elif isinstance(value, types.FunctionType):
            if not effect_free(value, seen):
                return False
        elif callable(value) and not isinstance(value, type):
            if not (lookup.is_functional(value) or lookup.is_pure_torch(value)):
                return False
        elif isinstance(value, type) and not issubclass(value, (torch.Tensor, int, float, tuple, str, bool)):
            return False
        elif not callable(value) and not isinstance(value, (int, float, str, bool, type(None), tuple, frozenset)):
            return False  # a global object: the function may read a registry the caller filled
    return True


def _held_value_ok(value: object, seen: set) -> bool:
    """May an effect-free function hold `value` in a closure cell or a default: a constant, a module of torch,
    `math` or `operator`, an effect-free function, a pure torch callable, or a tensor, number or string class?"""
    if isinstance(value, (int, float, complex, str, bytes, bool, type(None), torch.dtype, torch.device)):
        return True
    if isinstance(value, tuple):
        return all(_held_value_ok(item, seen) for item in value)
    if inspect.ismodule(value):
        return value.__name__.split(".")[0] in ("torch", "math", "operator", "typing")
    if isinstance(value, types.FunctionType):
        return effect_free(value, seen)
    if isinstance(value, type):
        return issubclass(value, (torch.Tensor, int, float, tuple, str, bool))
    if (type(value).__module__ or "").split(".")[0] == "torch":
        # torch's own objects (the `no_grad()` a decorated forward's wrapper holds), trusted as torch's functions are
        return True
    return callable(value) and (lookup.is_functional(value) or lookup.is_pure_torch(value))


def _codes(code: types.CodeType):
    yield code
    for const in code.co_consts:
        if isinstance(const, types.CodeType):
            yield from _codes(const)


def _codes_names(code: types.CodeType) -> set[str]:
    return {name for inner in _codes(code) for name in inner.co_names}


# --- 3. projection identity ----------------------------------------------------------------------------------------


def check_projection_identity(funcdef, region, projections, module, namespace, local):
    """Refuse (`projection-identity`) any way `forward` can reach the projections or their parameters other than
    the spelled `self.<proj>`: after fusion they exist only as the merged linear, so such code fails or sees one
    linear where there were several."""
    inside = {id(node) for node in dataflow.region_nodes(region)}
    cls = type(module)
    yield from _shadowed_projections(cls, projections, funcdef)
    for node in (node for stmt in funcdef.body for node in walk(stmt)):
        if isinstance(node, ast.Attribute) and isinstance(node.value, ast.Name) and node.value.id == "self":
            if node.attr in SELF_REFLECTION:
                yield Refused("projection-identity", f"`{ast.unparse(node)}` reaches the module's children", node)
            elif _side_door(inspect.getattr_static(cls, node.attr, None), projections):
                yield Refused(
                    "projection-identity", f"`{ast.unparse(node)}` is a property that may reach a projection", node
                )
        if not isinstance(node, ast.Call):
            continue
        resolved = (
            lookup.resolve_dotted(node.func, namespace, local)
            if isinstance(node.func, (ast.Name, ast.Attribute))
            else None
        )
        if resolved in (getattr, setattr, delattr, hasattr) and node.args and _is_self(node.args[0]):
            name = node.args[1] if len(node.args) > 1 else None
            constant = isinstance(name, ast.Constant) and isinstance(name.value, str)
            if not constant or name.value in projections or name.value in SELF_REFLECTION:
                yield Refused(
                    "projection-identity", f"`{ast.unparse(node)}` reaches an attribute of the module by name", node
                )
            elif resolved is not setattr and not _side_door(
                inspect.getattr_static(cls, name.value, None), projections
            ):
                continue  # `getattr(self, "flag")`: the spelled attribute, judged as `self.flag` would be
        elif resolved in (operator.attrgetter, operator.methodcaller):
            yield Refused("projection-identity", f"`{ast.unparse(node)}` reaches attributes by name", node)
        elif "hook" in _switch_name(node, namespace, local):
            yield Refused(
                "projection-identity", f"`{ast.unparse(node)}` hooks every module call, the linears' too", node
            )
        handed_self = any(_is_self(arg) for arg in [*node.args, *(k.value for k in node.keywords)])
        if handed_self and not (isinstance(node.func, ast.Name) and node.func.id == "super"):
            if id(node) in inside:
                yield Refused("projection-identity", f"`{ast.unparse(node)}` hands the module to a callee", node)
            elif isinstance(resolved, types.FunctionType) and _names_projection(resolved, projections, set()):
                yield Refused(
                    "projection-identity", f"`{ast.unparse(node)}` hands the module to code that names a projection",
                    node,
                )  # fmt: skip
            elif _unreadable_method(node.func, resolved, namespace, local):
                yield Refused(
                    "projection-identity", f"`{ast.unparse(node)}` hands the module to a method the analysis cannot "
                    "read (it may reach a projection by name)", node,
                )  # fmt: skip


def _shadowed_projections(cls: type, projections: set[str], funcdef: ast.FunctionDef):
    """Refuse when `self.<proj>` may not reach the registered projection: `nn.Module` keeps children in `_modules`
    and finds them through `__getattr__`, which Python calls only when ordinary lookup fails. A class attribute of
    the same name anywhere in the MRO (a class-level module, a method, a descriptor) is found first, and a class that
    overrides `__getattr__` or `__getattribute__` decides itself what the name returns. Then the original calls
    something the merged linear does not compute."""
    for name in sorted(projections):
        if inspect.getattr_static(cls, name, None) is not None:
            yield Refused(
                "projection-identity", f"`{cls.__name__}.{name}` is a class attribute: `self.{name}` reads it, "
                "not the registered linear", funcdef,
            )  # fmt: skip
    if getattr(cls, "__getattr__", None) is not nn.Module.__getattr__ or cls.__getattribute__ is not (
        object.__getattribute__
    ):
        yield Refused(
            "projection-identity",
            f"`{cls.__name__}` overrides attribute lookup: `self.<proj>` may not be the linear",
            funcdef,
        )


def _unreadable_method(func: ast.expr, resolved: object, namespace: dict, local: set[str]) -> bool:
    """Is `func`, handed `self` outside the region, a method or attribute function whose code the analysis does not
    read: one looked up on a class (`object.__getattribute__`, `nn.Module.__getattr__`: they take an attribute name,
    projections' too), on `self` (a staticmethod or a callable attribute), or on `super()`? A plain name the
    forward binds (Transformers' `attention_interface(self, q, k, v, ...)`) is trusted as the attention interfaces
    are (docs/analysis.md); a module-level function is read (`_names_projection`)."""
    if not isinstance(func, ast.Attribute) or isinstance(resolved, types.FunctionType):
        return False
    base = func.value
    if _is_self(base) or self_attr(base):
        return True
    if isinstance(base, ast.Call) and isinstance(base.func, ast.Name) and base.func.id in ("super", "type"):
        return True
    owner = lookup.resolve_dotted(base, namespace, local) if isinstance(base, (ast.Name, ast.Attribute)) else None
    return isinstance(owner, type)


def _is_self(expr: ast.expr) -> bool:
    return isinstance(expr, ast.Name) and expr.id == "self"


def _side_door(attribute: object, projections: set[str]) -> bool:
    """Is a class attribute a descriptor whose code may reach a projection or write (a property, say)?"""
    if attribute is None or isinstance(attribute, (types.FunctionType, staticmethod, classmethod, int, float, str,
                                                   bool, type(None), tuple, frozenset, torch.dtype)):  # fmt: skip
        return False
    getter = getattr(attribute, "fget", None) or getattr(type(attribute), "__get__", None)
    if getter is None:
        return False
    if isinstance(getter, types.FunctionType):
        return _names_projection(getter, projections, set()) or not effect_free(getter)
    return True  # a descriptor implemented in C or unknown


def _names_projection(function: types.FunctionType, projections: set[str], seen: set) -> bool:
    """Does `function`'s code (or a module-level function it names) name a projection or a reflective accessor?"""
    if function in seen or len(seen) > 50:
        return False
    seen.add(function)
    names = _codes_names(function.__code__)
    if names & (projections | SELF_REFLECTION | {"getattr", "setattr", "attrgetter", "vars"}):
        return True
    return any(
        isinstance(value, types.FunctionType) and _names_projection(value, projections, seen)
        for value in (function.__globals__.get(name) for name in names)
    )


# --- 5. argument-level writes --------------------------------------------------------------------------------------

_MAX_NORM_POSITION = {F.embedding: 3, F.embedding_bag: 3}
"""`F.embedding(input, weight, padding_idx, max_norm, ...)`, `F.embedding_bag(input, weight, offsets, max_norm, ...)`."""
_RUNNING_STATS = {F.batch_norm: (1, 2, 5, "training"), F.instance_norm: (1, 2, 5, "use_input_stats")}
"""Functional norms: positions of running mean and var, position and name of the flag that makes them update."""


def check_argument_writes(region, fresh, module, namespace, local):
    """Refuse (`argument-write`) torch calls that write an argument their name does not announce, unless what they
    write is fresh local storage: `max_norm` renormalises the weight's rows in place; running statistics are
    updated in place while training (or using input statistics). Submodules doing the same to their own weight or
    buffers are refused when handed the input (which may be those)."""
    for call in (node for node in dataflow.region_nodes(region) if isinstance(node, ast.Call)):
        func = call.func
        if self_attr(func):
            child = getattr(module, func.attr, None)
            if isinstance(child, nn.Module) and _writes_own_state(child) and (call.args or call.keywords):
                yield Refused(
                    "argument-write", f"`{ast.unparse(call)}` updates its own weight or buffers, which the input may be",
                    call,
                )  # fmt: skip
            continue
        if not isinstance(func, (ast.Name, ast.Attribute)):
            continue
        resolved = lookup.resolve_dotted(func, namespace, local)
        if resolved in _MAX_NORM_POSITION:
            norm = _argument(call, _MAX_NORM_POSITION[resolved], "max_norm")
            weight = _argument(call, 1, "weight")
            if not _none(norm) and weight is not None and not _fresh_target(weight, fresh):
                yield Refused("argument-write", f"`{ast.unparse(call)}` renormalises `{ast.unparse(weight)}` in place",
                              call)  # fmt: skip
        elif resolved in _RUNNING_STATS:
            mean_at, var_at, flag_at, flag = _RUNNING_STATS[resolved]
            flag_value = _argument(call, flag_at, flag)
            if flag_value is not None and isinstance(flag_value, ast.Constant) and flag_value.value is False:
                continue
            if resolved is F.batch_norm and flag_value is None:
                continue  # `training` defaults to False
            for stat in (_argument(call, mean_at, "running_mean"), _argument(call, var_at, "running_var")):
                if not _none(stat) and not _fresh_target(stat, fresh):
                    yield Refused("argument-write", f"`{ast.unparse(call)}` updates `{ast.unparse(stat)}` in place",
                                  call)  # fmt: skip


def _writes_own_state(child: nn.Module) -> bool:
    for inner in child.modules():
        if isinstance(inner, (nn.Embedding, nn.EmbeddingBag)) and inner.max_norm is not None:
            return True
        if isinstance(inner, (nn.modules.batchnorm._NormBase,)) and inner.track_running_stats:
            return True
    return False


def _argument(call: ast.Call, position: int, name: str) -> ast.expr | None:
    for keyword in call.keywords:
        if keyword.arg == name:
            return keyword.value
    return call.args[position] if len(call.args) > position else None


def _none(expr: ast.expr | None) -> bool:
    return expr is None or (isinstance(expr, ast.Constant) and expr.value is None)
