"""Stage 5: merge projections whose constructors sit in different blocks, one nested in the other's `if`.

Gemma 4 builds `q_proj` in every layer, but `k_proj` and `v_proj` only in layers that compute their own keys and
values, and `v_proj` only without `attention_k_eq_v`:

    self.q_proj = nn.Linear(...)
    self.q_norm = ...
    if not self.is_kv_shared_layer:
        ...
        self.k_proj = nn.Linear(...)
        self.v_proj = nn.Linear(...) if not self.use_alternative_attention else None

becomes one `if` on the conditions all three exist under: its branch builds the merged linear at q_proj's place,
the other branch each projection another config still builds, under its own name, at its own place. Both branches
repeat the statements from q_proj to the inner `if`, in the original's order, so modules register (parameter and
state-dict order, the random draws of their initialisation) as in the original:

    if not self.is_kv_shared_layer and not self.use_alternative_attention:
        self.qkv_proj = MergedColumnLinear(...)
        self.qkv_proj_sizes = self.qkv_proj.output_sizes
        self.q_proj = None
        self.q_norm = ...
        if not self.is_kv_shared_layer:
            ...
            self.k_proj = None
    else:
        self.qkv_proj = None
        self.qkv_proj_sizes = None
        self.q_proj = nn.Linear(...)
        self.q_norm = ...
        if not self.is_kv_shared_layer:
            ...
            self.k_proj = nn.Linear(...)

and in `forward` the merged call runs at q_proj's call, guarded by the merged linear's existence; a kept inner
projection's own call stays where it was, for the configs without the merged linear:

    if self.qkv_proj is not None:
        q_proj_out, k_proj_out, v_proj_out = self.qkv_proj(hidden_states).split(self.qkv_proj_sizes, dim=-1)
    else:
        q_proj_out = self.q_proj(hidden_states)
    ...
    if self.qkv_proj is not None:
        key_states = k_proj_out.view(hidden_shape)
        ...
    else:
        key_states = self.k_proj(hidden_states).view(hidden_shape)
        ...

Where v_proj is absent (attention_k_eq_v layers), q and k stay two linears: a merged q+k linear would need a
second merged name for the same checkpoint tensors (`q_proj` would load into `qkv_proj` in some layers and into
`qk_proj` in others), which Transformers' conversion registry, matching one converter per tensor name, cannot
express.

What must hold (each checked below, refused otherwise; a false alarm costs a fusion, a miss returns wrong numbers):

- the outer projections (q) are built unconditionally in one block, the inner ones (k, v) in one block reached
  from it only through `if` statements that come after the outer ones (`nested_layout`);
- every expression evaluated earlier than in the original (the inner constructors' sizes and bias flags, the `if`
  tests and the inner guard) is side-effect free and means at the merged constructor what it meant where the
  original evaluated it (`check_hoisted_init`);
- in `forward`, every projection reads one input spelled the same way, and the input is provably unchanged
  between the first call and the last (the same rules as every fusion, `hoist.check_input_stable`).
"""

from __future__ import annotations

import ast
import copy
from dataclasses import dataclass

from torch import nn

from fusegen.core import astutil
from fusegen.core.plan import FusionPlan, Refused
from fusegen.fusions.merged import hoist
from fusegen.fusions.merged.dataflow import loads
from fusegen.fusions.merged.rewrite_forward import (
    absent_linears_present,
    detach_written_pieces,
    dominating_region,
    piece_temps,
    refuse_calls_in_loops,
    refuse_claims,
    refuse_different_inputs,
    single_call,
    split_statement,
)
from fusegen.fusions.merged.rewrite_init import (
    MERGED_LINEAR,
    bias_flags,
    construction_guard,
    constructor_assignment,
    constructor_call,
    linear_arguments,
    one_construction_guard,
)
from fusegen.runtime.linear import sizes_attribute

RULE = "constructor-inputs-change"
"""The rule a hoisted expression that might mean something else at its new place is refused under."""

PURE_NODES = (
    ast.Name, ast.Attribute, ast.Constant, ast.BinOp, ast.UnaryOp, ast.BoolOp, ast.Compare, ast.IfExp,
    ast.operator, ast.unaryop, ast.boolop, ast.cmpop, ast.expr_context,
)  # fmt: skip
"""What a hoisted expression may be made of: reads of names and attributes, constants, arithmetic, comparisons and
boolean logic. No call, subscript, walrus, comprehension or lambda: those may run code that has effects or read
state the statements in between change. (An attribute read is trusted to be a read: config attributes and module
attributes are plain values; a property with effects would be a false negative this rule accepts.)"""


@dataclass(frozen=True)
class NestedLayout:
    """Where a plan's constructors sit: the outer ones in `block`, the inner ones below `block[if_index]`."""

    outer: tuple[str, ...]
    """Projections built unconditionally in the outer block (q_proj), in plan order."""
    inner: tuple[str, ...]
    """Projections built in the nested block (k_proj, v_proj), in plan order."""
    block: list[ast.stmt]
    if_index: int
    conditions: tuple[ast.expr, ...]
    """The tests that lead from the outer block to the inner one (`not t` for an `else` branch), outermost first."""


@dataclass(frozen=True)
class NestedInit:
    """What `rewrite_init_nested` built, which `rewrite_forward_nested` needs."""

    outer: tuple[str, ...]
    """Kept under their own names where the merged linear is None (called in the guarded split's `else`)."""
    kept_inner: tuple[str, ...]
    """Inner projections configs without the merged linear still build (k_proj where there is no v_proj)."""
    guarded: tuple[str, ...]
    """Inner projections built under their own `if c else None` guard: they exist exactly where the merged linear
    does, so their existence tests become the merged linear's."""

    @property
    def kept(self) -> tuple[str, ...]:
        return (*self.outer, *self.kept_inner)


def spans_blocks(funcdef: ast.FunctionDef, projections: tuple[str, ...]) -> bool:
    """Are the projections' constructor assignments in more than one block of `__init__`? (Unassigned or
    multiply assigned projections answer False: the ordinary rewrite refuses them with its own reason.)"""
    blocks = []
    for name in projections:
        refs = astutil.self_refs(funcdef, name)
        if len(refs) != 1:
            return False
        path = astutil.block_path(funcdef.body, refs[0])
        if not path:
            return False
        blocks.append(id(path[-1][0]))
    return len(set(blocks)) > 1


def nested_layout(funcdef: ast.FunctionDef, plan: FusionPlan) -> NestedLayout:
    """The outer/inner split of `plan`'s constructors, or `Refused("unusual-init")` if it is not that shape.

    Soundness of the shape: the outer projections run unconditionally in their block, so the merged constructor
    placed among them runs in every configuration the outer ones did; the inner block is reached from there only
    through `if` tests (no loop, `with` or `try`, which could run the inner constructors zero or several times, or
    after an exception), so "the inner projections exist" is exactly the conjunction of those tests, plus the inner
    guard; and the `if` comes after the outer projections, so the tests are evaluated later than the merged
    constructor, which `check_hoisted_init` proves harmless.
    """
    assigns = {name: constructor_assignment(funcdef, name) for name in plan.projections}
    paths = {name: astutil.block_path(funcdef.body, assign) for name, assign in assigns.items()}
    depth = min(len(path) for path in paths.values())
    outer = tuple(name for name in plan.projections if len(paths[name]) == depth)
    inner = tuple(name for name in plan.projections if len(paths[name]) > depth)
    block = paths[outer[0]][-1][0]
    refuse = lambda why, node: Refused("unusual-init", why, node)
    if any(paths[name][-1][0] is not block for name in outer):
        raise refuse("the unconditional projections are constructed in different blocks", assigns[outer[-1]])
    if any(construction_guard(assigns[name]) is not None for name in outer):
        raise refuse("a projection outside the nested block is built under a condition", assigns[outer[0]])
    inner_block = paths[inner[0]][-1][0]
    if any(paths[name][-1][0] is not inner_block for name in inner):
        raise refuse("the nested projections are constructed in different blocks", assigns[inner[-1]])
    path = paths[inner[0]]
    if path[depth - 1][0] is not block:
        raise refuse("the nested projections are not inside the block of the others", assigns[inner[0]])
    if_index = path[depth - 1][1]
    if if_index < max(block.index(assigns[name]) for name in outer):
        raise refuse("the nested block comes before a projection outside it", assigns[inner[0]])
    conditions = []
    for (outer_block, index), (inner_list, _) in zip(path[depth - 1 :], path[depth:]):
        stmt = outer_block[index]
        if not isinstance(stmt, ast.If):
            raise refuse(f"the projections are nested in a {type(stmt).__name__.lower()} statement", stmt)
        test = copy.deepcopy(stmt.test)
        conditions.append(test if inner_list is stmt.body else ast.UnaryOp(ast.Not(), test))
    return NestedLayout(outer, inner, block, if_index, tuple(conditions))


def check_hoisted_init(
    region: list[ast.stmt], projections: list[ast.Assign], hoisted: list[ast.expr], kept: list[ast.expr]
) -> None:
    """Refuse (rule `constructor-inputs-change`) unless every expression evaluated at the merged constructor means
    there what it meant where the original evaluated it.

    `hoisted` are evaluated earlier than in the original (the inner constructors' arguments, the `if` tests, the
    inner guard), `kept` at their own place or later (the outer constructors' arguments); `region` is every
    statement from the first outer constructor to the `if` holding the inner ones, nested blocks included.
    Soundness, for the expressions read in `region`:

    1. a hoisted expression is made of `PURE_NODES` only, so evaluating it earlier (or once more) has no effect;
    2. nothing in `region` binds, deletes or assigns a name any of them reads, or a `self.<attr>` they read, or
       writes an attribute or item of an object they read through (`config.hidden_size = 8`,
       `self.__dict__["head_dim"] = 8`);
    3. no call in `region` (other than the projections' own constructors, which are replaced) is handed, as an
       argument or as the object a method is called on, a bare name they read (`self`, `config`, `layer_config`):
       such a call could change what they read through the object (`config.update(...)`, `register(self)`).
       A call handed only attribute values (`Norm(dim=self.head_dim, eps=config.eps)`) gets values, not the
       objects the expressions read through.
    Over-approximations (the whole `if` statement, its `else` included, counts as in between) cost a fusion only.
    """
    for expr in hoisted:
        for node in astutil.walk(expr):
            if not isinstance(node, PURE_NODES):
                raise Refused(RULE, f"`{ast.unparse(expr)}` would be evaluated earlier and may have effects", expr)
    names: set[str] = {"self"}
    attrs: set[str] = set()
    for expr in [*hoisted, *kept]:
        names |= astutil.loaded_names(expr)
        attrs |= {node.attr for node in astutil.walk(expr) if astutil.self_attr(node)}
    skipped = {id(node) for assign in projections for node in astutil.walk(assign)}
    for stmt in region:
        for node in astutil.walk(stmt):
            if id(node) in skipped:
                continue
            stored = isinstance(getattr(node, "ctx", None), (ast.Store, ast.Del))
            if stored and isinstance(node, ast.Name) and node.id in names:
                raise Refused(RULE, f"`{node.id}` is rebound between the constructors", node)
            if stored and astutil.self_attr(node) and node.attr in attrs:
                raise Refused(RULE, f"`{ast.unparse(node)}` changes between the constructors", node)
            if stored and isinstance(node, (ast.Attribute, ast.Subscript)) and not astutil.self_attr(node):
                root = _root(node)
                if isinstance(root, ast.Name) and root.id in names:
                    raise Refused(
                        RULE, f"`{ast.unparse(node)}` writes into `{root.id}` between the constructors", node
                    )
            if isinstance(node, ast.Call):
                _check_call_reaches_nothing(node, names)


def _root(node: ast.expr) -> ast.expr:
    """The object an attribute or item chain starts from: `config` of `config.rope["x"].y`."""
    while isinstance(node, (ast.Attribute, ast.Subscript)):
        node = node.value
    return node


def _check_call_reaches_nothing(call: ast.Call, names: set[str]) -> None:
    """Rule 3 of `check_hoisted_init` for one call."""
    handed = [*call.args, *(keyword.value for keyword in call.keywords)]
    handed = [arg.value if isinstance(arg, ast.Starred) else arg for arg in handed]
    receiver = _root(call.func)
    is_super = isinstance(receiver, ast.Call) and isinstance(receiver.func, ast.Name) and receiver.func.id == "super"
    reads_receiver = (isinstance(receiver, ast.Name) and receiver.id in names) or is_super  # `super()` is `self`
    if isinstance(call.func, ast.Attribute) and reads_receiver:
        raise Refused(RULE, f"`{ast.unparse(call)}` may change what the constructors read", call)
    for arg in handed:
        if isinstance(arg, ast.Name) and arg.id in names:
            raise Refused(RULE, f"`{ast.unparse(call)}` is handed `{arg.id}` between the constructors", call)


def rewrite_init_nested(funcdef: ast.FunctionDef, plan: FusionPlan, namespace: dict) -> NestedInit:
    """Build the merged linear at the outer projections' place, under the conjunction of the conditions the inner
    ones exist under (see the module docstring); raise `Refused` leaving `funcdef` unusable otherwise.

    Soundness: the merged linear exists exactly where every projection did (the outer ones always, the inner ones
    where the `if` tests and the inner guard hold, `nested_layout`), and is built from their own expressions, which
    mean the same there (`check_hoisted_init`); those of the inner constructors are evaluated only in the branch
    where the original evaluated them. The conjunction is evaluated once, before the first outer projection: it is
    pure and nothing from there to the inner `if` changes what it reads (`check_hoisted_init`'s region starts at
    that projection), so it has the value it would have had anywhere in the region. The region's other statements
    run once either way (one branch runs), in their order. Where the merged linear is None, each projection the
    original built there is built by its own constructor call, at its own place, under its own name. A projection
    that exists exactly where the merged linear does (an inner one under the inner guard, or every inner one when
    there is no inner guard) is not built at all.
    """
    layout = nested_layout(funcdef, plan)
    assigns = {name: constructor_assignment(funcdef, name) for name in plan.projections}
    calls = {name: constructor_call(assign) for name, assign in assigns.items()}
    arguments = {name: linear_arguments(assigns[name], calls[name], namespace) for name in plan.projections}
    inner_guards = [construction_guard(assigns[name]) for name in layout.inner]
    guard = one_construction_guard([assigns[name] for name in layout.inner], inner_guards)
    conditions = [*layout.conditions, *([copy.deepcopy(guard)] if guard is not None else [])]
    hoisted = [expr for name in layout.inner for expr in arguments[name].values() if isinstance(expr, ast.AST)]
    kept = [expr for name in layout.outer for expr in arguments[name].values() if isinstance(expr, ast.AST)]
    first = min(layout.block.index(assigns[name]) for name in layout.outer)
    region = layout.block[first : layout.if_index + 1]
    check_hoisted_init(region, list(assigns.values()), [*hoisted, *conditions], kept)

    ordered = [arguments[name] for name in plan.projections]
    widths = ", ".join(f"__out{i}__" for i in range(len(ordered)))
    merged = ast.parse(f"self.{plan.merged} = {MERGED_LINEAR}(__in__, [{widths}], bias=__bias__)").body[0]
    fills = {"__in__": ordered[0]["in_features"], "__bias__": bias_flags(ordered)}
    fills.update({f"__out{i}__": bound["out_features"] for i, bound in enumerate(ordered)})
    for node in [n for n in astutil.walk(merged) if isinstance(n, ast.Name) and n.id in fills]:
        astutil.replace_node(merged, node, copy.deepcopy(fills[node.id]))
    test = conditions[0] if len(conditions) == 1 else ast.BoolOp(ast.And(), conditions)
    name, sizes = f"self.{plan.merged}", f"self.{sizes_attribute(plan.merged)}"

    guarded = tuple(p for p, g in zip(layout.inner, inner_guards) if g is not None)
    kept_inner = tuple(p for p in layout.inner if guard is not None and p not in guarded)
    last = max(layout.block.index(assigns[name]) for name in layout.outer)
    built = {
        True: [merged, ast.parse(f"{sizes} = {name}.output_sizes").body[0]],
        False: ast.parse(f"{name} = None\n{sizes} = None").body,
    }
    branches = {}
    for merged_branch in (True, False):
        region = [copy.deepcopy(stmt) for stmt in layout.block[first : layout.if_index + 1]]
        copies = _projection_copies(layout.block[first : layout.if_index + 1], region, assigns)
        head = built[merged_branch]
        for projection in layout.outer:
            assign = copies[projection]
            if merged_branch:
                statements = ast.parse(f"self.{projection} = None").body
                statements = [*head, *statements] if layout.block.index(assigns[projection]) == last else statements
                region[region.index(assign) : region.index(assign) + 1] = statements
        if not merged_branch:
            region[0:0] = head
        inner_block = astutil.block_path(region, copies[layout.inner[0]])[-1][0]
        for projection in layout.inner:
            assign = copies[projection]
            if projection in kept_inner and merged_branch:
                inner_block[inner_block.index(assign)] = ast.copy_location(
                    ast.parse(f"self.{projection} = None").body[0], assign
                )
            elif projection not in kept_inner:
                inner_block.remove(assign)
        if not inner_block:
            inner_block.append(ast.copy_location(ast.Pass(), copies[layout.inner[0]]))
        branches[merged_branch] = region
    one = ast.If(test=test, body=branches[True], orelse=branches[False])
    one = ast.fix_missing_locations(ast.copy_location(one, layout.block[first]))
    layout.block[first : layout.if_index + 1] = [one]
    return NestedInit(layout.outer, kept_inner, guarded)


def _projection_copies(
    original: list[ast.stmt], copied: list[ast.stmt], assigns: dict[str, ast.Assign]
) -> dict[str, ast.Assign]:
    """The copies (in `copied`, a deep copy of `original`) of the projections' constructor assignments."""
    pairs = {}
    for old, new in zip(original, copied):
        for old_node, new_node in zip(astutil.walk(old), astutil.walk(new)):
            pairs[id(old_node)] = new_node
    return {name: pairs[id(assign)] for name, assign in assigns.items()}


def rewrite_forward_nested(
    funcdef: ast.FunctionDef, plan: FusionPlan, module: nn.Module, namespace: dict, built: NestedInit
) -> None:
    """The merged call and split at the first projection call, guarded by the merged linear's existence; raise
    `Refused` leaving `funcdef` unusable if the analysis cannot prove it computes what the original does.

    Soundness: where the merged linear exists, every projection existed and is computed from one GEMM at the first
    call's place; that is the original's value for each only if their inputs are spelled the same (checked here)
    and nothing between the first call and the last can change that input or an alias of it (the region rules of
    `hoist.check_input_stable`, judged with the children other configs build standing in, as for every
    conditional fusion). The GEMM itself writes nothing, so computing it earlier reorders nothing observable.
    Where it is None, the outer projections are called by their own names at that same place (the region rules
    cover that move), and each kept inner projection's own call stays where it was, untouched: a layer without the
    merged linear computes exactly what the original does. A guarded inner projection's existence test becomes the
    merged linear's, which is the same inside the block where the original built it (outside it the original
    would fail on the missing attribute); the others' become True, as for any plain linear.
    """
    calls = [single_call(funcdef, name, plan.merged if name in built.guarded else None) for name in plan.projections]
    arg = calls[0].args[0]
    refuse_different_inputs(calls)
    refuse_calls_in_loops(funcdef, calls)
    block, first, last = dominating_region(funcdef, calls)
    with absent_linears_present(module, namespace):
        claims = hoist.check_input_stable(funcdef, block[first : last + 1], arg, module, namespace, calls)
    refuse_claims(claims, calls)
    temps = piece_temps(funcdef, plan)
    merged, split = f"self.{plan.merged}", split_statement(plan, temps, arg)
    orelse = []
    for name, call, temp in zip(plan.projections, calls, temps):
        if name in built.outer:
            own = ast.parse(f"{temp} = self.{name}(__input__)").body[0]
            own.value.args = [copy.deepcopy(call.args[0])]
            orelse.append(own)
    test = ast.parse(f"{merged} is not None").body[0].value
    guarded = ast.fix_missing_locations(
        ast.copy_location(ast.If(test=test, body=[split], orelse=orelse), block[first])
    )
    block.insert(first, guarded)
    for name, call, temp in zip(plan.projections, calls, temps):
        piece = ast.Name(temp, ast.Load())
        if name in built.kept_inner:
            exists = ast.parse(f"{merged} is not None").body[0].value
            piece = ast.IfExp(test=exists, body=piece, orelse=call)
        astutil.replace_node(funcdef, call, ast.fix_missing_locations(ast.copy_location(piece, call)))
    detach_written_pieces(funcdef, temps, guarded.body, 0, module, loads(arg))  # clones of written pieces follow
    one_test_per_run(funcdef, plan.merged)


def one_test_per_run(funcdef: ast.FunctionDef, merged: str) -> None:
    """Turn each run of consecutive simple statements that test `self.<merged> is not None` in a conditional
    expression into one `if` statement whose branches hold the run with each such expression resolved:

        key_states = (k_proj_out if self.qkv_proj is not None else self.k_proj(hidden_states)).view(hidden_shape)
        value_states = v_proj_out.view(hidden_shape) if self.qkv_proj is not None else key_states

    becomes

        if self.qkv_proj is not None:
            key_states = k_proj_out.view(hidden_shape)
            value_states = v_proj_out.view(hidden_shape)
        else:
            key_states = self.k_proj(hidden_states).view(hidden_shape)
            value_states = key_states

    Soundness: the test reads one attribute and has no effect, so evaluating it once before the run instead of
    inside each statement changes nothing as long as its value cannot change within the run: no statement of the
    run assigns or deletes `self.<merged>` (checked; `__init__` sets it once, and nothing else in the class writes
    it). Each statement then runs the operand its conditional expression would have chosen, and only that one, in
    the same order as before.
    """
    test = f"self.{merged} is not None"

    def tests_merged(node: ast.AST) -> bool:
        return isinstance(node, ast.IfExp) and ast.unparse(node.test) == test

    def in_run(stmt: ast.stmt) -> bool:
        if not isinstance(stmt, (ast.Assign, ast.AugAssign, ast.AnnAssign, ast.Expr)):
            return False
        writes = any(
            astutil.self_attr(node, merged) and isinstance(node.ctx, (ast.Store, ast.Del))
            for node in astutil.walk(stmt)
        )
        return not writes and any(tests_merged(node) for node in astutil.walk(stmt))

    class Resolve(ast.NodeTransformer):
        def __init__(self, exists: bool) -> None:
            self.exists = exists

        def visit_IfExp(self, node: ast.IfExp) -> ast.AST:
            self.generic_visit(node)
            return (node.body if self.exists else node.orelse) if tests_merged(node) else node

    blocks = [funcdef.body]
    for node in astutil.walk(funcdef):
        blocks.extend(astutil.child_blocks(node) if isinstance(node, ast.stmt) else [])
    for block in blocks:
        index = 0
        while index < len(block):
            end = index
            while end < len(block) and in_run(block[end]):
                end += 1
            if end > index:
                run = block[index:end]
                branches = [[Resolve(exists).visit(copy.deepcopy(stmt)) for stmt in run] for exists in (True, False)]
                one = ast.If(test=ast.parse(test, mode="eval").body, body=branches[0], orelse=branches[1])
                block[index:end] = [ast.fix_missing_locations(ast.copy_location(one, run[0]))]
            index += 1
