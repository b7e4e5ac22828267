"""Stage 5, for one attention class serving self- and cross-attention: q/k/v in one GEMM when self-attending.

Whisper, the Bart family and BERT-style cross-attention build one class for both uses. q reads `hidden_states`;
k and v read

    current_states = key_value_states if key_value_states is not None else hidden_states

(or `... if is_cross_attention else hidden_states` with `is_cross_attention = key_value_states is not None`),
and a cache reuse branch may skip k/v altogether. The group therefore spells its input two ways, which the plain
rewrite refuses (`different-inputs`). This module proves, from the source, a switch that tells the two uses apart,
and writes (all three pieces stay rows of one `qkv_proj`, so every instance has the same parameters and the
checkpoint mapping is uniform):

    if key_value_states is None:
        q_proj_out, k_proj_out, v_proj_out = self.qkv_proj(hidden_states).split(self.qkv_proj_sizes, dim=-1)
    else:
        (q_proj_out,) = linear_pieces(self.qkv_proj, hidden_states, self.qkv_proj_sizes, (0,))
    ...
    current_states = key_value_states if key_value_states is not None else hidden_states
    if is_cross_attention and cache and is_updated:
        ...  # reuse: k/v are not computed, as in the original
    else:
        if key_value_states is not None:
            k_proj_out, v_proj_out = linear_pieces(self.qkv_proj, current_states, self.qkv_proj_sizes, (1, 2))
        key_states = k_proj_out...

Soundness, fact by fact (each is checked below; where one fails the group is refused with `different-inputs`
and the reason, and the plain k + v fusion is tried next):

1. The switch `A` is a parameter of `forward` that the body never binds again, so `A is None` has one value for
   the whole call: tested at the q site and at the k/v site it agrees (`is` cannot be overridden).
2. The k/v input `C` is bound exactly once in `forward`, by one of the forms above, so `A is None` implies that
   `C` is the very object `H` (`hidden_states`) was when that statement ran; the statement is executed before
   the k/v calls on every path to them (it sits in an enclosing block ahead of them, outside any loop).
3. With `A is None`, computing k/v at the q site instead of at their own site is the plain hoist: the region
   from the first of the q call / `C`'s binding to the last k/v call passes every input-stability rule for `H`
   and its aliases (`C` is one), so k/v at their site would read the value q read. A linear writes nothing,
   so computing pieces a path never reads (the reuse branch) changes no value.
4. Otherwise (`A` not None) nothing is hoisted across the uses: q is computed at the q site from `H`, and k/v
   at their own site from `C` (their pair passes the input-stability rules for `C` there, as the plain k + v
   fusion does; the rules also guard the states `C` was bound from, `dataflow.sources`), with `linear_pieces`, which computes exactly those rows (`fusegen/runtime/linear.py`).
   The reuse branch still computes no k/v.

5. Where either region trusts what `isinstance` says of a parameter `P` (`if isinstance(cache,
   EncoderDecoderCache):` then `cache.is_updated`: `rules.Claim`), the merged call also needs `class_is_honest(P)`
   (`fusegen.runtime.claims`): one flag, `A is None and class_is_honest(P)`, made before the q site. Where it
   holds, fact 3 applies as above (`isinstance` sees `P`'s type and nothing of the caller's runs, as the rules
   assumed). Elsewhere, cross-attention included, nothing is computed ahead: each projection is computed alone
   where its call was (`rewrite_forward.claimed_split`), k and v in two GEMMs as in the original.

A false alarm costs the q fusion (k + v still merge); a miss would feed k/v the wrong states, so every form not
listed is refused.
"""

from __future__ import annotations

import ast

from torch import nn

from fusegen.core import astutil
from fusegen.core.plan import FusionPlan, Refused
from fusegen.fusions.merged import hoist
from fusegen.fusions.merged.rewrite_forward import (
    CLASS_IS_HONEST,
    LINEAR_PIECE,
    LINEAR_PIECES,
    claimed_split,
    detach_written_pieces,
    dominating_region,
    merge_flag,
    piece_temps,
    refuse_runtime_name_clash,
    split_statement,
)
from fusegen.runtime.linear import sizes_attribute


def rewrite_self_or_cross(
    funcdef: ast.FunctionDef, plan: FusionPlan, calls: list[ast.Call], module: nn.Module, namespace: dict
) -> None:
    """Apply `plan`, whose `calls` read two inputs, to `funcdef` in place, or raise `Refused` (see the module)."""
    shared, own, current, switch, binding = _two_uses(funcdef, calls)
    for node in [*calls, binding]:
        scope = astutil.enclosing_loop_or_scope(funcdef, node)
        if scope is not None:
            raise Refused("call-in-loop", f"`{ast.unparse(node)}` sits inside a {type(scope).__name__.lower()}", node)
    _check_binding_precedes(funcdef, binding, [calls[i] for i in own])
    block, first, last = dominating_region(funcdef, [*calls, binding])
    position = _shared_first(funcdef, block, calls, shared, own)
    region = _region_until(block, first, last, [*calls, binding])
    hidden = calls[shared[0]].args[0]
    claims = hoist.check_input_stable(funcdef, region, hidden, module, namespace, calls)
    own_block, own_first, own_last = dominating_region(funcdef, [calls[i] for i in own])
    own_calls = [calls[i] for i in own]
    own_region = own_block[own_first : own_last + 1]
    claims |= hoist.check_input_stable(funcdef, own_region, current, module, namespace, own_calls)
    if claims:
        refuse_runtime_name_clash(funcdef, namespace, (CLASS_IS_HONEST, LINEAR_PIECE))
        _splice_claimed(funcdef, plan, calls, switch, hidden.id, (block, position), module, claims)
    else:
        refuse_runtime_name_clash(funcdef, namespace, (LINEAR_PIECES,))
        _splice(funcdef, plan, calls, shared, own, switch, (block, position), (own_block, own_first), module)


def _two_uses(funcdef: ast.FunctionDef, calls: list[ast.Call]):
    """`(shared, own, C, A, binding)`: indices of the calls reading `H` and of those reading `C` (in plan order),
    the `C` expression, the switch name `A` and the statement binding `C` (facts 1 and 2)."""
    spellings: dict[str, list[int]] = {}
    for index, call in enumerate(calls):
        spellings.setdefault(ast.dump(call.args[0], include_attributes=False), []).append(index)
    groups = list(spellings.values())
    names = [calls[group[0]].args[0] for group in groups]
    if len(groups) != 2 or not all(isinstance(name, ast.Name) for name in names):
        raise _refuse(calls, "the projections read more than two inputs, or one not a plain name")
    reasons = []
    for shared, own in (groups, groups[::-1]):
        hidden, current = calls[shared[0]].args[0], calls[own[0]].args[0]
        try:
            switch, binding = _switch(funcdef, current.id, hidden.id)
        except _NoProof as reason:
            reasons.append(str(reason))
            continue
        return shared, own, current, switch, binding
    raise _refuse(calls, "; ".join(reasons))


class _NoProof(Exception):
    """Why a fact of the module docstring could not be shown."""


def _refuse(calls: list[ast.Call], why: str) -> Refused:
    return Refused(
        "different-inputs",
        f"`{ast.unparse(calls[0])}` and `{ast.unparse(calls[-1])}` spell their input differently, and no switch "
        f"proves when they read the same tensor: {why}",
        calls[-1],
    )


def _switch(funcdef: ast.FunctionDef, current: str, hidden: str) -> tuple[str, ast.Assign]:
    """The switch `A` with `A is None` implying `current is hidden` (facts 1 and 2), and the binding of `current`."""
    stores = _stores(funcdef, current)
    if len(stores) != 1 or not isinstance(stores[0], ast.Assign) or len(stores[0].targets) != 1:
        raise _NoProof(f"`{current}` is not bound exactly once by a plain assignment")
    binding = stores[0]
    value = binding.value
    if not isinstance(value, ast.IfExp):
        raise _NoProof(f"`{current}` is not bound by a conditional expression")
    other = _choice(funcdef, value, hidden)
    if other is None:
        raise _NoProof(f"`{ast.unparse(binding)}` is not `X if A is not None else {hidden}` or an equivalent form")
    if other not in _parameters(funcdef) or _stores(funcdef, other):
        raise _NoProof(f"`{other}` is not a parameter of forward left unbound by its body")
    return other, binding


def _choice(funcdef: ast.FunctionDef, value: ast.IfExp, hidden: str) -> str | None:
    """`A` when `value` yields `H` exactly when `A is None`: `X if A is not None else H`, `H if A is None else X`,
    or the same with the test spelled `F` / `not F`, `F` bound once, to `A is not None` or `A is None`; else None.
    (What `X` is does not matter: only the self-attention side is relied on.)"""
    test, negated = value.test, False
    if isinstance(test, ast.UnaryOp) and isinstance(test.op, ast.Not):
        test, negated = test.operand, True
    flag = _name(test)
    if flag is not None:
        test = _flag_value(funcdef, flag)
        if test is None:
            return None
    tested, is_none = _none_test(test)
    if tested is None:
        return None
    body_when_none = is_none != negated  # the body is chosen exactly when `A is None`
    fallback = value.body if body_when_none else value.orelse
    return tested if _name(fallback) == hidden else None


def _flag_value(funcdef: ast.FunctionDef, flag: str) -> ast.expr | None:
    """The value of `flag` if it is bound exactly once, by a plain `flag = <expr>`, and is no parameter."""
    stores = _stores(funcdef, flag)
    if flag in _parameters(funcdef) or len(stores) != 1 or not isinstance(stores[0], ast.Assign):
        return None
    if astutil.enclosing_loop_or_scope(funcdef, stores[0]) is not None:
        return None  # bound in a nested scope: this function's `flag` is another variable; in a loop: keep it simple
    return stores[0].value if len(stores[0].targets) == 1 else None


def _none_test(test: ast.expr) -> tuple[str | None, bool]:
    """`(A, True)` for `A is None`, `(A, False)` for `A is not None`, `(None, False)` otherwise."""
    if not (isinstance(test, ast.Compare) and len(test.ops) == 1 and isinstance(test.ops[0], (ast.Is, ast.IsNot))):
        return None, False
    left, right = test.left, test.comparators[0]
    if isinstance(left, ast.Constant) and left.value is None:
        left, right = right, left
    if not (isinstance(right, ast.Constant) and right.value is None) or _name(left) is None:
        return None, False
    return left.id, isinstance(test.ops[0], ast.Is)


def _name(node: ast.expr) -> str | None:
    return node.id if isinstance(node, ast.Name) else None


def _parameters(funcdef: ast.FunctionDef) -> set[str]:
    """Named parameters (not `*args` / `**kwargs`): bound at entry, whatever the caller spreads into them."""
    arguments = funcdef.args
    return {a.arg for a in [*arguments.posonlyargs, *arguments.args, *arguments.kwonlyargs]}


def _stores(funcdef: ast.FunctionDef, name: str) -> list[ast.AST]:
    """Every statement or construct that may bind or unbind `name` anywhere in `funcdef` (nested scopes counted
    too, which only costs a fusion): assignments of any kind, loop and `with` targets, `del`, imports,
    `except ... as`, match captures, nested definitions and `global`/`nonlocal` declarations."""
    parent_of = astutil.parent_map(funcdef)
    found = []
    for node in astutil.walk(funcdef):
        if isinstance(node, ast.Name) and not isinstance(node.ctx, ast.Load) and node.id == name:
            holder = parent_of.get(node)
            found.append(holder if isinstance(holder, ast.Assign) and node in holder.targets else node)
        elif (
            isinstance(node, (ast.Global, ast.Nonlocal))
            and name in node.names
            or isinstance(node, ast.alias)
            and (node.asname or node.name).split(".")[0] == name
        ):
            found.append(node)
        elif isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef, ast.ExceptHandler)):
            if node is not funcdef and node.name == name:
                found.append(node)
        elif (
            isinstance(node, (ast.MatchAs, ast.MatchStar))
            and node.name == name
            or isinstance(node, ast.MatchMapping)
            and node.rest == name
        ):
            found.append(node)
    return found


def _check_binding_precedes(funcdef: ast.FunctionDef, binding: ast.Assign, own_calls: list[ast.Call]) -> None:
    """Fact 2's dominance: `binding` sits in a block enclosing every k/v call, ahead of the statement holding it."""
    path = astutil.block_path(funcdef.body, binding)
    for call in own_calls:
        other = astutil.block_path(funcdef.body, call)
        same_blocks = len(other) > len(path) - 1 and all(
            other[depth][0] is path[depth][0] and other[depth][1] == path[depth][1] for depth in range(len(path) - 1)
        )
        if not (same_blocks and other[len(path) - 1][0] is path[-1][0] and other[len(path) - 1][1] > path[-1][1]):
            raise _refuse([call], f"`{ast.unparse(binding)}` does not run before `{ast.unparse(call)}` on every path")


def _shared_first(funcdef, block: list[ast.stmt], calls: list[ast.Call], shared: list[int], own: list[int]) -> int:
    """The index in `block` of the first statement holding a call on `H`; every call on `C` must come later."""
    depth = len(astutil.block_path(funcdef.body, block[0])) - 1

    def index(call: ast.Call) -> int:
        return astutil.block_path(funcdef.body, call)[depth][1]

    first_own = min(index(calls[i]) for i in own)
    if max(index(calls[i]) for i in shared) >= first_own:
        raise _refuse(calls, "the projections on the second input do not all come after those on the first")
    return min(index(calls[i]) for i in shared)


def _region_until(block: list[ast.stmt], first: int, last: int, nodes: list[ast.AST]) -> list[ast.stmt]:
    """What may run from `block[first]` until the statement holding the last of `nodes`: `block[first:last]`, then
    the part of `block[last]` up to there (`_prefix`). Anything left out runs only after every node, so it cannot
    change what the calls read; the whole statement is kept wherever the shape is not understood."""
    inside = [node for node in nodes if _contains(block[last], node)]
    return [*block[first:last], *_prefix(block[last], inside)]


def _prefix(stmt: ast.stmt, nodes: list[ast.AST]) -> list[ast.stmt]:
    """`stmt`, or for an `if` whose one branch holds every node: its test (as an expression statement), then that
    branch's statements up to the one holding the last node, that one cut down the same way."""
    if isinstance(stmt, ast.If) and not any(_contains(stmt.test, node) for node in nodes):
        for branch in (stmt.body, stmt.orelse):
            holding = [index for index, inner in enumerate(branch) if any(_contains(inner, node) for node in nodes)]
            if holding and all(any(_contains(inner, node) for inner in branch) for node in nodes):
                end = max(holding)
                test = ast.copy_location(ast.Expr(stmt.test), stmt)
                return [test, *branch[:end], *_prefix(branch[end], nodes)]
    return [stmt]


def _contains(tree: ast.AST, node: ast.AST) -> bool:
    return any(child is node for child in astutil.walk(tree))


def _splice(funcdef, plan, calls, shared, own, switch, shared_site, own_site, module) -> None:
    """Insert the switched merged call at the q site and the k/v pieces at their site; calls become the pieces."""
    temps = piece_temps(funcdef, plan)
    merged, sizes = f"self.{plan.merged}", f"self.{sizes_attribute(plan.merged)}"
    hidden, current = calls[shared[0]].args[0].id, calls[own[0]].args[0].id

    def pieces(indices: list[int], source: str) -> str:
        targets = ", ".join(temps[i] for i in indices) + ("," if len(indices) == 1 else "")
        rows = ", ".join(str(i) for i in indices) + ("," if len(indices) == 1 else "")
        return f"({targets}) = {LINEAR_PIECES}({merged}, {source}, {sizes}, ({rows}))"

    shared_stmt = ast.parse(f"if {switch} is None:\n    pass\nelse:\n    {pieces(shared, hidden)}\n").body[0]
    shared_stmt.body = [split_statement(plan, temps, ast.Name(hidden, ast.Load()))]
    own_stmt = ast.parse(f"if {switch} is not None:\n    {pieces(own, current)}\n").body[0]
    (block, position), (own_block, own_position) = shared_site, own_site
    own_block.insert(own_position, ast.fix_missing_locations(ast.copy_location(own_stmt, own_block[own_position])))
    block.insert(position, ast.fix_missing_locations(ast.copy_location(shared_stmt, block[position])))
    for call, temp in zip(calls, temps):
        astutil.replace_node(funcdef, call, ast.copy_location(ast.Name(temp, ast.Load()), call))
    detach_written_pieces(funcdef, temps, shared_stmt.body, 0, module, {hidden})
    detach_written_pieces(funcdef, [temps[i] for i in shared], shared_stmt.orelse, 0, module, {hidden})
    detach_written_pieces(funcdef, [temps[i] for i in own], own_stmt.body, 0, module, {current})


def _splice_claimed(funcdef, plan, calls, switch, hidden, site, module, claims) -> None:
    """Fact 5: one flag, `<switch> is None and class_is_honest(<claims>)`, before the q site; the merged call under
    it, and every projection call reading its piece where the flag holds and computing it alone where the call was
    otherwise (`rewrite_forward.claimed_split`)."""
    temps = piece_temps(funcdef, plan)
    flag = merge_flag(funcdef, plan, claims, f"{switch} is None")
    split = split_statement(plan, temps, ast.Name(hidden, ast.Load()))
    guarded, choices = claimed_split(flag, plan, calls, temps, split)
    block, position = site
    for statement in (guarded, flag):
        block.insert(position, ast.fix_missing_locations(ast.copy_location(statement, block[position])))
    for call, choice in zip(calls, choices):
        astutil.replace_node(funcdef, call, ast.fix_missing_locations(choice))
    detach_written_pieces(funcdef, temps, guarded.body, 0, module, {hidden})
