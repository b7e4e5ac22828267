"""Stage 5: rewrite `__init__` to build one merged linear instead of the projections.

The merged constructor is assembled from the projections' own source
expressions, so one generated class serves every config of the model:

    self.qkv_proj = MergedColumnLinear(
        config.hidden_size,
        [config.num_attention_heads * self.head_dim, config.num_key_value_heads * self.head_dim, ...],
        bias=config.attention_bias,
    )
    self.qkv_proj_sizes = self.qkv_proj.output_sizes

The second line keeps the split sizes on the owning module, where the rewritten
forward reads them (see `fusegen.runtime.linear.sizes_attribute`).
"""

from __future__ import annotations

import ast
import copy
import inspect

from torch import nn

from fusegen.core import astutil
from fusegen.core.plan import FusionPlan, Refused
from fusegen.fusions.merged.lookup import resolve_dotted
from fusegen.runtime.linear import sizes_attribute

MERGED_LINEAR = "MergedColumnLinear"
"""The runtime class the merged constructor calls (imported from `fusegen.runtime`)."""

_LINEAR_SIGNATURE = inspect.signature(nn.Linear.__init__)


def rewrite_init(funcdef: ast.FunctionDef, plan: FusionPlan, namespace: dict) -> frozenset[str]:
    """Replace the projections' assignments in `funcdef` with one merged assignment.

    Returns the projections that exist only under a condition (`self.q_a_proj = nn.Linear(...) if c else None`);
    `rewrite_forward` needs them to guard the merged call (see `_conditional_merge`).
    """
    assigns = [constructor_assignment(funcdef, name) for name in plan.projections]
    block = _shared_block(funcdef, assigns)
    positions = sorted(block.index(assign) for assign in assigns)
    calls = [constructor_call(assign) for assign in assigns]
    arguments = [linear_arguments(assign, call, namespace) for assign, call in zip(assigns, calls)]
    in_features = arguments[0]["in_features"]
    # Input widths may be spelled differently (`config.hidden_size`, `self.hidden_size`):
    # the projections read one tensor, so any config the original runs with gives them
    # one width, and the first spelling serves. Bias flags have no such guarantee: where
    # they are spelled differently, each piece keeps its own (see `bias_flags`).
    bias = bias_flags(arguments)
    guards = [construction_guard(assign) for assign in assigns]
    conditional = frozenset(name for name, guard in zip(plan.projections, guards) if guard is not None)
    guard = one_construction_guard(assigns, guards)
    reads = [*arguments, *([{"guard": guard}] if guard is not None else [])]
    _check_inputs_stable(block[positions[0] : positions[-1] + 1], assigns, reads)
    widths = ", ".join(f"__out{i}__" for i in range(len(assigns)))
    merged = ast.parse(f"self.{plan.merged} = {MERGED_LINEAR}(__in__, [{widths}], bias=__bias__)").body[0]
    fills = {"__in__": in_features, "__bias__": bias}
    fills.update({f"__out{i}__": bound["out_features"] for i, bound in enumerate(arguments)})
    for node in [n for n in astutil.walk(merged) if isinstance(n, ast.Name) and n.id in fills]:
        astutil.replace_node(merged, node, copy.deepcopy(fills[node.id]))  # the originals may stay in use
    sizes = ast.parse(f"self.{sizes_attribute(plan.merged)} = self.{plan.merged}.output_sizes").body[0]
    new = [merged, sizes]
    if guard is not None:
        new = _conditional_merge(plan, merged, guard, assigns, calls, conditional)
    last = block[positions[-1]]
    block[positions[-1] : positions[-1] + 1] = [ast.copy_location(stmt, last) for stmt in new]
    for assign in assigns:
        if assign is not last:
            block.remove(assign)
    return conditional


def bias_flags(arguments: list[dict[str, ast.expr]]) -> ast.expr:
    """The merged linear's `bias=`: the projections' one flag, or a list with each projection's own flag.

    `MergedColumnLinear(..., bias=[bias, False, bias])` (Whisper: k_proj has no bias) gives every piece the bias
    its projection had: a piece whose flag is false has zero rows that never enter the output or the gradient,
    and are neither loaded nor saved (`fusegen.runtime.linear.MergedColumnLinear`). Flags spelled the same way
    stay one flag, so the common case reads as before.
    """
    flags = [bound["bias"] for bound in arguments]
    if all(astutil.same_expr(flag, flags[0]) for flag in flags[1:]):
        return flags[0]
    return ast.List(elts=list(flags), ctx=ast.Load())


def constructor_call(assign: ast.Assign) -> ast.Call:
    """The `nn.Linear(...)` call of `self.p = nn.Linear(...)` or of `self.p = nn.Linear(...) if c else None`."""
    value = assign.value
    if isinstance(value, ast.IfExp):
        return value.body if _is_none(value.orelse) else value.orelse
    return value


def construction_guard(assign: ast.Assign) -> ast.expr | None:
    """The condition under which `assign` builds its linear (None: always); `c` or `not c` of an `if c else`."""
    value = assign.value
    if not isinstance(value, ast.IfExp):
        return None
    if _is_none(value.orelse):
        return value.test
    return ast.UnaryOp(ast.Not(), value.test)


def one_construction_guard(assigns: list[ast.Assign], guards: list[ast.expr | None]) -> ast.expr | None:
    """The one condition the conditional projections share (None if none is conditional); refuse two."""
    present = [(assign, guard) for assign, guard in zip(assigns, guards) if guard is not None]
    for assign, guard in present[1:]:
        if not astutil.same_expr(guard, present[0][1]):
            raise Refused(
                "unusual-init",
                f"the projections are built under different conditions (`{ast.unparse(present[0][1])}` vs "
                f"`{ast.unparse(guard)}`)",
                assign,
            )
    return present[0][1] if present else None


def _conditional_merge(
    plan: FusionPlan,
    merged: ast.Assign,
    guard: ast.expr,
    assigns: list[ast.Assign],
    calls: list[ast.Call],
    conditional: frozenset[str],
) -> list[ast.stmt]:
    """The one statement that builds the merged linear when some projections exist only under `guard`:

        if self.q_lora_rank is not None:
            self.fused_qkv_a_proj = MergedColumnLinear(...)
            self.fused_qkv_a_proj_sizes = self.fused_qkv_a_proj.output_sizes
            self.kv_a_proj_with_mqa = None
        else:
            self.fused_qkv_a_proj = None
            self.fused_qkv_a_proj_sizes = None
            self.kv_a_proj_with_mqa = nn.Linear(...)

    Soundness: where `guard` holds, the original built every projection (the conditional ones because the guard
    holds, the others always), and the merged linear replaces them all; where it does not, the original built only
    the unconditional ones, and exactly those are built, from their own constructor calls, under their own names,
    so that config's module (and its checkpoint) is the original's. The guard is evaluated once, where the last
    projection was built (`_check_inputs_stable` proves its names mean the same there). Each branch builds what it
    builds at that one place, in the projections' order, so modules register (parameter and state-dict order, the
    random draws of their initialisation) in the order the former per-statement conditional expressions gave. So
    `self.<merged> is not None` holds exactly where the conditional projections existed, which is what
    `rewrite_forward` guards the merged call with.
    """
    name, sizes = f"self.{plan.merged}", f"self.{sizes_attribute(plan.merged)}"
    body = [merged, ast.parse(f"{sizes} = {name}.output_sizes").body[0]]
    orelse = ast.parse(f"{name} = None\n{sizes} = None").body
    for projection, call in zip(plan.projections, calls):
        if projection not in conditional:
            body.append(ast.parse(f"self.{projection} = None").body[0])
            kept = ast.parse(f"self.{projection} = __call__").body[0]
            kept.value = call
            orelse.append(kept)
    return [ast.fix_missing_locations(ast.copy_location(ast.If(test=guard, body=body, orelse=orelse), merged))]


def _is_none(node: ast.expr) -> bool:
    return isinstance(node, ast.Constant) and node.value is None


def same_block_groups(funcdef: ast.FunctionDef, projections: tuple[str, ...]) -> list[list[str]]:
    """Smaller groups of `projections` whose constructors sit in one block of `__init__`.

    Gemma 4 builds q_proj always but k_proj and v_proj only in layers that do not share another layer's keys
    and values (`if not self.is_kv_shared_layer:`): q cannot join them, but k and v merge into `kv_proj` there.
    """
    groups: dict[int, list[str]] = {}
    for name in projections:
        refs = astutil.self_refs(funcdef, name)
        if len(refs) != 1:
            continue
        path = astutil.block_path(funcdef.body, refs[0])
        if path:
            groups.setdefault(id(path[-1][0]), []).append(name)
    return [names for names in groups.values() if 2 <= len(names) < len(projections)]


def check_no_other_uses(classdef: ast.ClassDef, plan: FusionPlan) -> None:
    """Refuse if a method other than `__init__`/`forward` touches a projection."""
    for stmt in classdef.body:
        if isinstance(stmt, (ast.FunctionDef, ast.AsyncFunctionDef)) and stmt.name not in ("__init__", "forward"):
            for name in plan.projections:
                refs = astutil.self_refs(stmt, name)
                if refs:
                    raise Refused("escaping-reference", f"method {stmt.name} uses self.{name}", refs[0])


def constructor_assignment(funcdef: ast.FunctionDef, name: str) -> ast.Assign:
    refs = astutil.self_refs(funcdef, name)
    assigns = [
        stmt
        for stmt in astutil.walk(funcdef)
        if isinstance(stmt, ast.Assign) and len(stmt.targets) == 1 and any(stmt.targets[0] is ref for ref in refs)
    ]
    if len(assigns) != 1 or len(refs) != 1:
        where = refs[1] if len(refs) > 1 else funcdef
        raise Refused("unusual-init", f"self.{name} is not assigned exactly once and used nowhere else", where)
    assign = assigns[0]
    value = assign.value
    conditional = isinstance(value, ast.IfExp) and (
        (isinstance(value.body, ast.Call) and _is_none(value.orelse))
        or (isinstance(value.orelse, ast.Call) and _is_none(value.body))
    )
    if not isinstance(value, ast.Call) and not conditional:
        raise Refused("unusual-init", f"self.{name} is not assigned a constructor call", assign)
    return assign


def _shared_block(funcdef: ast.FunctionDef, assigns: list[ast.Assign]) -> list[ast.stmt]:
    blocks = [astutil.block_path(funcdef.body, assign)[-1][0] for assign in assigns]
    if any(block is not blocks[0] for block in blocks):
        raise Refused("unusual-init", "the projections are constructed in different blocks", assigns[-1])
    return blocks[0]


def linear_arguments(assign: ast.Assign, call: ast.Call, namespace: dict) -> dict[str, ast.expr]:
    """in_features, out_features and bias of the `nn.Linear(...)` call `assign` makes, as expressions."""
    if resolve_dotted(call.func, namespace) is not nn.Linear:
        raise Refused("unusual-init", f"`{ast.unparse(call.func)}` is not torch.nn.Linear", assign)
    if any(isinstance(arg, ast.Starred) for arg in call.args) or any(kw.arg is None for kw in call.keywords):
        raise Refused("unusual-init", f"`{ast.unparse(call)}` unpacks its arguments", assign)
    try:
        bound = _LINEAR_SIGNATURE.bind(None, *call.args, **{kw.arg: kw.value for kw in call.keywords})
    except TypeError as exc:
        raise Refused("unusual-init", f"`{ast.unparse(call)}`: {exc}", assign) from exc
    extra = set(bound.arguments) - {"self", "in_features", "out_features", "bias"}
    if extra:
        raise Refused("unusual-init", f"`{ast.unparse(call)}` passes {', '.join(sorted(extra))}", assign)
    arguments = dict(bound.arguments)
    arguments.setdefault("bias", ast.Constant(True))
    return arguments


def _check_inputs_stable(span: list[ast.stmt], assigns: list[ast.Assign], arguments: list[dict]) -> None:
    """Refuse if a name or `self.<attr>` the constructors read is reassigned among them.

    The merged constructor runs where the last projection was built, so every
    expression must mean there what it meant at its own assignment.
    """
    read_names: set[str] = set()
    read_attrs: set[str] = set()
    for bound in arguments:
        for expr in bound.values():
            if isinstance(expr, ast.AST):
                read_names |= astutil.loaded_names(expr) - {"self"}
                read_attrs |= {n.attr for n in astutil.walk(expr) if astutil.self_attr(n)}
    for stmt in span:
        if stmt in assigns:
            continue
        for node in astutil.walk(stmt):
            rebinds_name = isinstance(node, ast.Name) and isinstance(node.ctx, ast.Store) and node.id in read_names
            rebinds_attr = astutil.self_attr(node) and isinstance(node.ctx, ast.Store) and node.attr in read_attrs
            if rebinds_name or rebinds_attr:
                raise Refused(
                    "constructor-inputs-change", f"`{ast.unparse(node)}` changes between the constructors", node
                )
