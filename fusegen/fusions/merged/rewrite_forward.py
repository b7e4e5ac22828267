"""Stage 5: rewrite `forward` to call the merged linear once and split it.

`q = self.q_proj(x); k = self.k_proj(x); v = self.v_proj(x)` becomes

    q_proj_out, k_proj_out, v_proj_out = self.qkv_proj(x).split(self.qkv_proj_sizes, dim=-1)
    q = q_proj_out; ...

placed before the statement holding the first projection call, in the
innermost block that dominates every call. The sizes are read from the owner
(`fusegen.runtime.linear.sizes_attribute`), not from the merged linear, which a wrapper may hide.

Where the region trusts what `isinstance` says of a parameter (`rules.Claim`), the merged call runs only where
`class_is_honest` holds, and each projection is otherwise computed at its own place (`claimed_split`).
"""

from __future__ import annotations

import ast
import contextlib
import copy
import sys

from torch import nn

from fusegen.core import astutil
from fusegen.core.plan import FusionPlan, Refused
from fusegen.core.vocabulary import ATTRIBUTE_BY_NAME, IN_PLACE_OPERATORS, REFLECTION_NAMES
from fusegen.fusions.merged import dataflow, hoist, lookup, pieces
from fusegen.runtime.linear import sizes_attribute

LINEAR_PIECES = "linear_pieces"
"""The `fusegen.runtime` function computing some pieces of a merged linear (`fusegen.runtime.linear`)."""

LINEAR_PIECE = pieces.LINEAR_PIECE

CLASS_IS_HONEST = "class_is_honest"
"""The `fusegen.runtime` test that an object's `__class__` is its type (`fusegen.runtime.claims`)."""


def projection_calls(funcdef: ast.FunctionDef, plan: FusionPlan, conditional: frozenset[str] = frozenset()):
    """The one call of each projection of `plan` in `funcdef`, in plan order, their guards folded (`single_call`)."""
    merged = plan.merged if conditional else None
    return [single_call(funcdef, name, merged if name in conditional else None) for name in plan.projections]


def rewrite_forward(
    funcdef: ast.FunctionDef,
    plan: FusionPlan,
    module: nn.Module,
    namespace: dict,
    conditional: frozenset[str] = frozenset(),
    calls: list[ast.Call] | None = None,
) -> None:
    """Apply `plan`, whose projections all read one input, to `funcdef` in place, or raise `Refused` leaving it
    unusable. (A group read from two inputs is `rewrite_cross`'s: `fusegen.fusions.linear.LinearKind.rewrite`
    sends it there; here it is refused as `different-inputs`.)

    `conditional` names the projections `__init__` builds only under a condition (`rewrite_init` returns them);
    the merged call is then guarded by the merged linear's existence (see `_guarded_split`). `calls`: the
    projection calls if the caller found them already (`projection_calls`).
    """
    calls = projection_calls(funcdef, plan, conditional) if calls is None else calls
    arg = calls[0].args[0]
    refuse_different_inputs(calls)
    refuse_calls_in_loops(funcdef, calls)
    block, first, last = dominating_region(funcdef, calls)
    with absent_linears_present(module, namespace) if conditional else contextlib.nullcontext():
        claims = hoist.check_input_stable(funcdef, block[first : last + 1], arg, module, namespace, calls)
    if conditional:
        refuse_claims(claims, calls)
    if claims:
        refuse_runtime_name_clash(funcdef, namespace, (CLASS_IS_HONEST, LINEAR_PIECE))
    _splice(funcdef, plan, calls, block, first, module, conditional, claims)


def refuse_claims(claims: frozenset[str], calls: list[ast.Call]) -> None:
    """Refuse (`class-claim`) a region that trusts what `isinstance` says of a caller's object (`rules.Claim`), where
    the rewrite computes the pieces in one place only: an object whose `__class__` lies would run the caller's code
    between projections that then all ran before it."""
    if claims:
        raise Refused(
            "class-claim",
            f"the region trusts `isinstance` about {', '.join(f'`{name}`' for name in sorted(claims))}, whose class "
            "may lie (a `__class__` property), and this rewrite cannot compute each projection at its own place then",
            calls[0],
        )


def merge_flag(funcdef: ast.FunctionDef, plan: FusionPlan, claims: frozenset[str], switch: str = "") -> ast.Assign:
    """`merge_<merged> = [<switch> and ]class_is_honest(<claims>)`, the name fresh: the one test of whether the merged
    call runs, made once before it and read at every projection's place, so that code that runs between them (a
    caller's object whose class lies) cannot make two tests disagree."""
    flag = astutil.fresh_name(f"merge_{plan.merged}", astutil.all_names(funcdef))
    test = f"{CLASS_IS_HONEST}({', '.join(sorted(claims))})"
    return ast.parse(f"{flag} = {switch + ' and ' if switch else ''}{test}").body[0]


def merged_or_own(flag: str, temp: str, plan: FusionPlan, call: ast.Call, piece: int) -> ast.IfExp:
    """What replaces projection call `call` under a merge flag: `<temp> if <flag> else linear_piece(self.<merged>,
    <input>, self.<merged>_sizes, <piece>)`. Where the flag is false the projection is computed where its call was,
    from its own input expression, evaluated there: within the statement, in the original's order, from its own
    rows (`fusegen.runtime.linear.linear_piece`, a tensor of its own as the projection's output was)."""
    merged, sizes = f"self.{plan.merged}", f"self.{sizes_attribute(plan.merged)}"
    choice = ast.parse(f"{temp} if {flag} else {LINEAR_PIECE}({merged}, __input__, {sizes}, {piece})").body[0].value
    choice.orelse.args[1] = copy.deepcopy(call.args[0])
    return ast.copy_location(choice, call)


def refuse_runtime_name_clash(funcdef: ast.FunctionDef, namespace: dict, names: tuple[str, ...]) -> None:
    """Refuse (`name-clash`) when the forward binds, or the modeling module defines, a name the rewrite calls from
    `fusegen.runtime`: the generated file imports it under that name, which would shadow the module's own or be
    shadowed by the forward's."""
    for name in names:
        if name in namespace or name in astutil.all_names(funcdef):
            raise Refused("name-clash", f"`{name}`, which the rewrite calls from fusegen.runtime, is already a name "
                          "of forward or of its module", funcdef)  # fmt: skip


class _AbsentModule(nn.Module):
    """Stands in for a child another config builds, of a class the safety rules do not trust (see below)."""


@contextlib.contextmanager
def absent_linears_present(module: nn.Module, namespace: dict):
    """`module` with a plain meta `nn.Linear` for each child that is None here but a plain linear in other configs.

    A conditional fusion hoists the always-built projections' calls over code that runs in the other configs
    (`q_states = self.q_proj(hidden_states)` where `q_lora_rank` is None), so the safety rules must judge that
    code too. What such a child is there is read off `__init__`: `self.q_proj = None if c else nn.Linear(...)`
    builds exactly an `nn.Linear`, which writes nothing; `self.norm = SomeNorm(...) if c else None` builds a module
    of a class the rules cannot see, so it stands in as an `_AbsentModule`, which they trust with nothing (handed
    an alias of the input it is an impure call), exactly as they treat a child of a class they do not know; a
    child built any other way stays None here, which the rules refuse (a false alarm costs a fusion). Children
    that exist in this config are judged as they are here, as for every fusion; build-time validation runs the
    other configs (`fusegen/compiler/validate.py`).
    """
    stand_ins = {}
    for stmt in astutil.walk(astutil.method(astutil.class_statement(type(module)), "__init__") or ast.Module(body=[])):
        if not (isinstance(stmt, ast.Assign) and len(stmt.targets) == 1 and astutil.self_attr(stmt.targets[0])):
            continue
        value, name = stmt.value, stmt.targets[0].attr
        if not isinstance(value, ast.IfExp) or module.__dict__.get(name, 0) is not None:
            continue
        built = [side for side in (value.body, value.orelse) if isinstance(side, ast.Call)]
        nones = [side for side in (value.body, value.orelse) if isinstance(side, ast.Constant) and side.value is None]
        if len(built) != 1 or len(nones) != 1:
            continue
        constructor = lookup.resolve_dotted(built[0].func, namespace)
        if constructor is nn.Linear:
            stand_ins[name] = nn.Linear(1, 1, device="meta")
        elif isinstance(constructor, type) and issubclass(constructor, nn.Module):
            stand_ins[name] = _AbsentModule()
    for name, linear in stand_ins.items():
        del module.__dict__[name]
        module._modules[name] = linear
    try:
        yield
    finally:
        for name in stand_ins:
            del module._modules[name]
            module.__dict__[name] = None


def single_call(funcdef: ast.FunctionDef, name: str, merged: str | None = None) -> ast.Call:
    """The one `self.<name>(arg)` call, after folding existence guards on it.

    The projection no longer exists after fusion, so any other use of it
    would break or change meaning; only `self.<name> is (not) None` and bare
    truthiness tests are understood (an `nn.Linear` is never None and always
    truthy), and folded to constants. A projection built only under a condition (`merged` given) may be None:
    its guards then test the merged linear instead (`self.v_proj is not None` -> `self.kv_proj is not None`),
    which exists exactly where the projection did (`rewrite_init._conditional_merge`).
    """
    refs = astutil.self_refs(funcdef, name)
    calls = [
        node for node in astutil.walk(funcdef) if isinstance(node, ast.Call) and any(node.func is ref for ref in refs)
    ]
    if len(calls) != 1:
        where = calls[1] if len(calls) > 1 else funcdef
        raise Refused("not-called-once", f"self.{name} is called {len(calls)} times in forward", where)
    call = calls[0]
    if not call.args and len(call.keywords) == 1 and call.keywords[0].arg == "input":
        # `nn.Linear.forward(self, input)`: the keyword names the one input; read it like a positional one.
        call.args, call.keywords = [call.keywords[0].value], []
    if len(call.args) != 1 or call.keywords or isinstance(call.args[0], ast.Starred):
        raise Refused("unusual-call", f"`{ast.unparse(call)}` does not pass exactly one input", call)
    for ref in refs:
        if ref is not call.func:
            _fold_guard(funcdef, ref, name, merged)
    return call


def _fold_guard(funcdef: ast.FunctionDef, ref: ast.Attribute, name: str, merged: str | None = None) -> None:
    parent_of = astutil.parent_map(funcdef)
    parent = parent_of.get(ref)
    if isinstance(parent, ast.Compare) and len(parent.ops) == 1 and isinstance(parent.ops[0], (ast.Is, ast.IsNot)):
        other = parent.comparators[0] if parent.left is ref else parent.left
        if isinstance(other, ast.Constant) and other.value is None:
            if merged is not None:
                ref.attr = merged  # None exactly where the projection was None
                return
            folded = ast.Constant(isinstance(parent.ops[0], ast.IsNot))
            astutil.replace_node(funcdef, parent, ast.copy_location(folded, parent))
            return
    in_test = isinstance(parent, (ast.If, ast.IfExp, ast.While, ast.Assert)) and parent.test is ref
    negated = isinstance(parent, ast.UnaryOp) and isinstance(parent.op, ast.Not)
    if (in_test or negated) and merged is not None:
        ref.attr = merged  # a module is truthy, None is not: the same truth value as the projection's
        return
    if in_test or negated:
        astutil.replace_node(funcdef, ref, ast.copy_location(ast.Constant(True), ref))
        return
    raise Refused("escaping-reference", f"self.{name} is used other than by its call and an existence guard", ref)


def dominating_region(funcdef: ast.FunctionDef, calls: list[ast.Call]) -> tuple[list[ast.stmt], int, int]:
    """The innermost block holding (or dominating) every call, and the span of them in it."""
    paths = [astutil.block_path(funcdef.body, call) for call in calls]
    depth = 0
    while all(len(path) > depth + 1 and path[depth + 1][0] is paths[0][depth + 1][0] for path in paths):
        depth += 1
    block = paths[0][depth][0]
    indices = [path[depth][1] for path in paths]
    return block, min(indices), max(indices)


def differently_spelled(calls: list[ast.Call]) -> ast.Call | None:
    """The first projection call whose input is spelled otherwise than the first call's (None: all alike)."""
    return next((call for call in calls[1:] if not astutil.same_expr(call.args[0], calls[0].args[0])), None)


def refuse_different_inputs(calls: list[ast.Call]) -> None:
    """Refuse (`different-inputs`) unless every projection call spells its input as the first one does."""
    call = differently_spelled(calls)
    if call is not None:
        raise Refused(
            "different-inputs",
            f"`{ast.unparse(calls[0])}` and `{ast.unparse(call)}` spell their input differently",
            call,
        )


def refuse_calls_in_loops(funcdef: ast.FunctionDef, calls: list[ast.Call]) -> None:
    """Refuse (`call-in-loop`) when a projection call sits in a loop, comprehension or nested scope: one merged
    call before it could not stand for the calls of every iteration."""
    for call in calls:
        scope = astutil.enclosing_loop_or_scope(funcdef, call)
        if scope is not None:
            raise Refused("call-in-loop", f"`{ast.unparse(call)}` sits inside a {type(scope).__name__.lower()}", call)


def piece_temps(funcdef: ast.FunctionDef, plan: FusionPlan) -> list[str]:
    """One fresh local name per projection (`q_proj_out`, ...) for its piece of the merged output."""
    taken = astutil.all_names(funcdef)
    temps = []
    for name in plan.projections:
        temps.append(astutil.fresh_name(f"{name}_out", taken))
        taken.add(temps[-1])
    return temps


def split_statement(plan: FusionPlan, temps: list[str], source: ast.expr) -> ast.Assign:
    """`<temps> = self.<merged>(<source>).split(self.<merged>_sizes, dim=-1)`, `source` copied in: the one statement
    every merged-linear rewrite computes the pieces with. Rows are in the plan's order, so `temps[i]` is projection
    i's output; the sizes are the merged linear's own `output_sizes` (what TP and quantizers keep current)."""
    merged, sizes = f"self.{plan.merged}", f"self.{sizes_attribute(plan.merged)}"
    statement = ast.parse(f"{', '.join(temps)} = {merged}(__input__).split({sizes}, dim=-1)").body[0]
    statement.value.func.value.args = [copy.deepcopy(source)]
    return statement


def _splice(
    funcdef: ast.FunctionDef,
    plan: FusionPlan,
    calls: list[ast.Call],
    block: list[ast.stmt],
    index: int,
    module: nn.Module | None = None,
    conditional: frozenset[str] = frozenset(),
    claims: frozenset[str] = frozenset(),
):
    """Insert the merged call and split before `block[index]` and make each projection call read its piece: under
    the existence guard of a conditional fusion (`_guarded_split`), or, with `claims`, under a merge flag
    (`claimed_split`)."""
    temps = piece_temps(funcdef, plan)
    inputs = dataflow.loads(calls[0].args[0])
    statement = split_statement(plan, temps, calls[0].args[0])
    replacements = [ast.copy_location(ast.Name(temp, ast.Load()), call) for call, temp in zip(calls, temps)]
    if conditional:
        statement = _guarded_split(plan, statement, calls, temps, conditional)
    elif claims:
        flag = merge_flag(funcdef, plan, claims)
        statement, replacements = claimed_split(flag, plan, calls, temps, statement)
        block.insert(index, ast.fix_missing_locations(ast.copy_location(flag, block[index])))
        index += 1
    block.insert(index, ast.fix_missing_locations(ast.copy_location(statement, block[index])))
    for call, replacement in zip(calls, replacements):
        astutil.replace_node(funcdef, call, ast.fix_missing_locations(replacement))
    if conditional or claims:
        detach_written_pieces(funcdef, temps, statement.body, 0, module, inputs)
    else:
        detach_written_pieces(funcdef, temps, block, index, module, inputs)


def claimed_split(
    flag: ast.Assign, plan: FusionPlan, calls: list[ast.Call], temps: list[str], split: ast.stmt
) -> tuple[ast.If, list[ast.IfExp]]:
    """The merged call where the claimed classes are honest, each projection at its own call elsewhere:

        merge_qkv_proj = class_is_honest(cache)
        if merge_qkv_proj:
            q_proj_out, k_proj_out, v_proj_out = self.qkv_proj(x).split(self.qkv_proj_sizes, dim=-1)
        q = q_proj_out if merge_qkv_proj else linear_piece(self.qkv_proj, x, self.qkv_proj_sizes, 0)
        if isinstance(cache, DynamicCache):
            ...
        k = k_proj_out if merge_qkv_proj else linear_piece(self.qkv_proj, x, self.qkv_proj_sizes, 1)

    Soundness: where `class_is_honest` holds, `isinstance` sees each claimed parameter's type and runs nothing of
    the caller's, which is what the rules assumed when they passed the region, so the merged call is the plain
    hoist; the region cannot change the answer (the claimed parameters are never bound again, and nothing in the
    forward stores their `__class__`: `region_rules._claimable`), and the flag is read, not recomputed. Elsewhere
    nothing is hoisted: each projection is computed where its call was, as the original computed it
    (`merged_or_own`). Returns the `if` and the expressions that replace the calls, in order."""
    name = flag.targets[0].id
    guarded = ast.If(test=ast.Name(name, ast.Load()), body=[split], orelse=[])
    choices = [merged_or_own(name, temp, plan, call, piece) for piece, (call, temp) in enumerate(zip(calls, temps))]
    return ast.copy_location(guarded, split), choices


def _guarded_split(
    plan: FusionPlan, split: ast.stmt, calls: list[ast.Call], temps: list[str], conditional: frozenset[str]
) -> ast.If:
    """The merged call and split where the merged linear exists, each always-built projection's own call elsewhere:

        if self.fused_qkv_a_proj is not None:
            q_a_proj_out, kv_a_proj_with_mqa_out = self.fused_qkv_a_proj(x).split(...)
        else:
            kv_a_proj_with_mqa_out = self.kv_a_proj_with_mqa(x)

    Soundness: `self.<merged> is not None` holds exactly in the configs where `__init__` built the conditional
    projections (`rewrite_init._conditional_merge`); there every piece is what the original's projection returns,
    as for an unconditional fusion. Elsewhere the always-built projections are called by their own names, on the
    same input, at the same point the merged call would run: the hoist to that point is proved harmless by the
    same input-stability rules (the region is the same), and a plain linear's call writes nothing. A conditional
    piece is then unbound, but the original reads it only where it called a projection that was None (an error
    there as well), so no value differs. The guard is the existence of the merged linear, never a copy of the
    forward's own condition (`if self.q_lora_rank is None`), so the two cannot disagree.
    """
    test = ast.parse(f"self.{plan.merged} is not None").body[0].value
    orelse = []
    for name, call, temp in zip(plan.projections, calls, temps):
        if name not in conditional:
            own = ast.parse(f"{temp} = self.{name}(__input__)").body[0]
            own.value.args = [copy.deepcopy(call.args[0])]
            orelse.append(own)
    guarded = ast.If(test=test, body=[split], orelse=orelse)
    return ast.fix_missing_locations(ast.copy_location(guarded, split))


def detach_written_pieces(
    funcdef: ast.FunctionDef,
    temps: list[str],
    block: list[ast.stmt],
    index: int,
    module: nn.Module | None,
    inputs: set[str] | frozenset = frozenset(),
) -> None:
    """After the split, give each piece the forward may write in place a storage of its own: `piece = piece.clone()`;
    and each piece whose layout may show a contiguous one: `piece = piece.contiguous()` (`fusegen.fusions.merged.
    pieces`: an unproven `.view`, a layout read; `inputs` are the names of the merged call's input, whose shape
    proves a view keeps the leading dims).

    `split` returns views of one tensor, and autograd refuses to let a view that is one of several outputs of a
    node be modified in place ("Output 0 of SplitWithSizes is a view and is being modified inplace"), where the
    original wrote its projection's own fresh output (`g = self.gate_proj(x); g.mul_(0.5)`) and trained fine.
    Slicing instead of splitting would not help: basic-slice views share their base's version counter, so an
    in-place write to one piece bumps the version of a sibling autograd saved for backward (`silu(gate) * up`
    saves `up`) and backward fails.

    Why the clone is exact: its forward is a copy, so every value is bit-identical, and its backward passes the
    gradient through unchanged, so the gradient reaching the split (and the merged GEMM) is exactly the gradient
    the original's projection output received. The clone is a new tensor with its own version counter, as the
    original projection's output was, so in-place writes to it behave exactly as in the original.

    Which pieces: those whose possible aliases (`dataflow.aliases`, seeded with the piece's temporary, over the
    whole forward) are written by an in-place method or function, an augmented assignment, an item or attribute
    store, `out=`/`inplace=`, an in-place `operator` function, a call of an alias itself (a bound in-place
    method: `op = g.mul_; op(2)`), or anything at all when the forward uses reflection (`eval`, `locals`, ...).
    Every test is on names, so a false alarm costs one copy of that piece; a miss is never silent: autograd
    raises on the write in training, and in inference the write lands in the piece's own disjoint slice of the
    merged output, which nothing else reads. Build-time validation runs the forward under autograd too.
    Unwritten pieces keep the plain split, so models that write no projection output in place pay nothing.

    Pieces written where the forward does not show it get the same clone: a piece stored away, returned, or
    handed to a function or submodule not proven free of writes (`pieces.needs_own_storage`). A piece whose
    layout may show, and that nothing writes, is made contiguous (`.contiguous()`): every value is the same, its
    backward passes the gradient through, and a `.view` that only a contiguous tensor allows (`k.view(-1)`) then
    works as it did on the projection's output. A written piece always gets `.clone()`, never `.contiguous()`
    alone: a piece that is already contiguous (one row: batch 1, one token) comes back from `.contiguous()` as the
    split's own view, which autograd refuses to write in place; `.clone()` of a split piece is dense, so
    contiguous too.
    """
    reflective = any(
        isinstance(node, ast.Call)
        and isinstance(node.func, ast.Name)
        and node.func.id in REFLECTION_NAMES | ATTRIBUTE_BY_NAME
        for node in astutil.walk(funcdef)
    )
    namespace = vars(sys.modules[type(module).__module__]) if module is not None else {}
    treated = []
    for temp in temps if pieces.COPIES else ():
        tracked = dataflow.aliases(funcdef, {temp}, module)
        views = pieces.view_names(funcdef, temp)
        if (
            reflective
            or _written_in_place(funcdef, tracked)
            or pieces.needs_own_storage(funcdef, views, module, namespace)
        ):
            treated.append(f"{temp} = {temp}.clone()")  # a piece's own storage; contiguous where the split was not
        elif pieces.needs_contiguous(funcdef, temp, views, set(inputs)):
            treated.append(f"{temp} = {temp}.contiguous()")
    for offset, line in enumerate(treated, start=1):
        block.insert(index + offset, ast.copy_location(ast.parse(line).body[0], block[index]))


def _written_in_place(funcdef: ast.FunctionDef, tracked: set[str]) -> bool:
    """Does anything in `funcdef` possibly write a tensor named in `tracked` in place? (See `detach_written_pieces`.)"""

    def mentions(node: ast.AST | None) -> bool:
        return node is not None and any(isinstance(n, ast.Name) and n.id in tracked for n in astutil.walk(node))

    for node in astutil.walk(funcdef):
        if isinstance(node, ast.AugAssign) and mentions(node.target):
            return True
        stored = isinstance(node, (ast.Subscript, ast.Attribute)) and isinstance(node.ctx, (ast.Store, ast.Del))
        if stored and mentions(node.value):
            return True
        if isinstance(node, ast.Call) and _call_writes(node, mentions):
            return True
    return False


def _call_writes(call: ast.Call, mentions) -> bool:
    """Could `call` write a tracked tensor in place?"""
    func = call.func
    name = func.attr if isinstance(func, ast.Attribute) else func.id if isinstance(func, ast.Name) else ""
    operands = [*call.args, *(keyword.value for keyword in call.keywords)]
    in_place = (name.endswith("_") and not name.endswith("__")) or name in IN_PLACE_OPERATORS
    if isinstance(func, ast.Attribute) and mentions(func.value) and (in_place or name.startswith("__")):
        return True  # `g.mul_(2)`, `g.__imul__(2)`, `g.__setitem__(0, 1)`
    if not isinstance(func, ast.Attribute) and mentions(func):
        return True  # a callee computed from the piece: `op = g.mul_; op(2)`, `getattr(g, "mul_")(2)`
    if in_place and any(mentions(operand) for operand in operands):
        return True  # `torch.relu_(g)`, `operator.imul(g, 2)`
    for keyword in call.keywords:
        if keyword.arg == "out" and mentions(keyword.value):
            return True
        is_false = isinstance(keyword.value, ast.Constant) and keyword.value.value is False
        if keyword.arg == "inplace" and not is_false and any(mentions(operand) for operand in operands):
            return True
    return False
