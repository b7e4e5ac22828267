"""Stage 5a: rewrite `forward` to call the merged linear once and split it.

`q = self.q_proj(x); k = self.k_proj(x); v = self.v_proj(x)` becomes

    q_proj_out, k_proj_out, v_proj_out = self.qkv_proj(x).split(self.qkv_proj_sizes, dim=-1)
    q = q_proj_out; ...

placed before the statement holding the first projection call, in the
innermost block that dominates every call. The sizes are read from the owner
(`fusegen.runtime.linear.sizes_attribute`), not from the merged linear, which a wrapper may hide.
"""

from __future__ import annotations

import ast

from torch import nn

from fusegen import astutil, safety
from fusegen.plan import FusionPlan, Refused
from fusegen.runtime.linear import sizes_attribute


def rewrite_forward(funcdef: ast.FunctionDef, plan: FusionPlan, module: nn.Module, namespace: dict) -> None:
    """Apply `plan` to `funcdef` in place, or raise `Refused` leaving it unusable."""
    calls = [_single_call(funcdef, name) for name in plan.projections]
    arg = calls[0].args[0]
    for call in calls[1:]:
        if not astutil.same_expr(call.args[0], arg):
            raise Refused(
                "different-inputs",
                f"`{ast.unparse(calls[0])}` and `{ast.unparse(call)}` spell their input differently",
                call,
            )
    for call in calls:
        scope = astutil.enclosing_loop_or_scope(funcdef, call)
        if scope is not None:
            raise Refused("call-in-loop", f"`{ast.unparse(call)}` sits inside a {type(scope).__name__.lower()}", call)
    block, first, last = _dominating_region(funcdef, calls)
    safety.check_input_stable(funcdef, block[first : last + 1], arg, module, namespace, calls)
    _splice(funcdef, plan, calls, block, first)


def _single_call(funcdef: ast.FunctionDef, name: str) -> ast.Call:
    """The one `self.<name>(arg)` call, after folding existence guards on it.

    The projection no longer exists after fusion, so any other use of it
    would break or change meaning; only `self.<name> is (not) None` and bare
    truthiness tests are understood (an `nn.Linear` is never None and always
    truthy), and folded to constants.
    """
    refs = astutil.self_refs(funcdef, name)
    calls = [
        node for node in ast.walk(funcdef) if isinstance(node, ast.Call) and any(node.func is ref for ref in refs)
    ]
    if len(calls) != 1:
        where = calls[1] if len(calls) > 1 else funcdef
        raise Refused("not-called-once", f"self.{name} is called {len(calls)} times in forward", where)
    call = calls[0]
    if len(call.args) != 1 or call.keywords or isinstance(call.args[0], ast.Starred):
        raise Refused("unusual-call", f"`{ast.unparse(call)}` does not pass exactly one positional input", call)
    for ref in refs:
        if ref is not call.func:
            _fold_guard(funcdef, ref, name)
    return call


def _fold_guard(funcdef: ast.FunctionDef, ref: ast.Attribute, name: str) -> None:
    parent_of = astutil.parents(funcdef)
    parent = parent_of.get(ref)
    if isinstance(parent, ast.Compare) and len(parent.ops) == 1 and isinstance(parent.ops[0], (ast.Is, ast.IsNot)):
        other = parent.comparators[0] if parent.left is ref else parent.left
        if isinstance(other, ast.Constant) and other.value is None:
            folded = ast.Constant(isinstance(parent.ops[0], ast.IsNot))
            astutil.replace_node(funcdef, parent, ast.copy_location(folded, parent))
            return
    in_test = isinstance(parent, (ast.If, ast.IfExp, ast.While, ast.Assert)) and parent.test is ref
    negated = isinstance(parent, ast.UnaryOp) and isinstance(parent.op, ast.Not)
    if in_test or negated:
        astutil.replace_node(funcdef, ref, ast.copy_location(ast.Constant(True), ref))
        return
    raise Refused("escaping-reference", f"self.{name} is used other than by its call and an existence guard", ref)


def _dominating_region(funcdef: ast.FunctionDef, calls: list[ast.Call]) -> tuple[list[ast.stmt], int, int]:
    """The innermost block holding (or dominating) every call, and the span of them in it."""
    paths = [astutil.block_path(funcdef.body, call) for call in calls]
    depth = 0
    while all(len(path) > depth + 1 and path[depth + 1][0] is paths[0][depth + 1][0] for path in paths):
        depth += 1
    block = paths[0][depth][0]
    indices = [path[depth][1] for path in paths]
    return block, min(indices), max(indices)


def _splice(funcdef: ast.FunctionDef, plan: FusionPlan, calls: list[ast.Call], block: list[ast.stmt], index: int):
    taken = astutil.all_names(funcdef)
    temps = []
    for name in plan.projections:
        temps.append(astutil.fresh_name(f"{name}_out", taken))
        taken.add(temps[-1])
    merged, sizes = f"self.{plan.merged}", f"self.{sizes_attribute(plan.merged)}"
    statement = ast.parse(f"{', '.join(temps)} = {merged}(__input__).split({sizes}, dim=-1)").body[0]
    placeholder = next(n for n in ast.walk(statement) if isinstance(n, ast.Name) and n.id == "__input__")
    astutil.replace_node(statement, placeholder, calls[0].args[0])
    block.insert(index, ast.copy_location(statement, block[index]))
    for call, temp in zip(calls, temps):
        astutil.replace_node(funcdef, call, ast.copy_location(ast.Name(temp, ast.Load()), call))
