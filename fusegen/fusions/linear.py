"""The merged-linear family: kinds that turn sibling `nn.Linear`s reading one value into one `MergedColumnLinear`.

The matcher (`fusegen.compiler.match.find_groups`) finds each group of linears whose first call reads the same
input node and offers it to the registered `LinearKind`s in priority order; each claims what it recognises and
leaves the rest. What a claimed plan then goes through is shared by every linear kind and lives here: the live
checks (`live.check_projections`), the rewrite of `__init__` (`rewrite_init`) and `forward`
(`rewrite_forward`) under the safety rules, and the smaller groups tried when a group is refused. A linear
plan's `shards` name the pieces in row order; the checkpoint mapping, the scopes, the vetoes and the TP plan
read them.
"""

from __future__ import annotations

import ast
import contextlib
import dataclasses
import os
import re
from collections.abc import Iterable

from torch import fx, nn

from fusegen import fusions
from fusegen.core import astutil
from fusegen.core.plan import FusionPlan, Refused, ShardId
from fusegen.core.traced import Trace
from fusegen.fusions.base import Kind
from fusegen.fusions.merged.groups import linear_children, same_input_groups
from fusegen.fusions.merged.live import check_projections, projection_findings
from fusegen.fusions.merged.rewrite_cross import rewrite_self_or_cross
from fusegen.fusions.merged.rewrite_forward import (
    CLASS_IS_HONEST,
    LINEAR_PIECE,
    LINEAR_PIECES,
    differently_spelled,
    projection_calls,
    rewrite_forward,
)
from fusegen.fusions.merged.rewrite_init import MERGED_LINEAR, check_no_other_uses, rewrite_init, same_block_groups
from fusegen.fusions.merged.rewrite_nested import rewrite_forward_nested, rewrite_init_nested, spans_blocks
from fusegen.fusions.merged.rules import RULE_IDS, RULES
from fusegen.runtime.linear import sizes_attribute

SIBLINGS = "merged_column"
"""The kind that takes any group no other linear kind claims (siblings.py); smaller retried groups are its plans."""

_SUFFIX = re.compile(r"(_proj|_lin|_linear|_layer)$")


class LinearKind(Kind):
    """A kind that merges some of the linears of one same-input group (see the module docstring)."""

    runtime_names = frozenset({MERGED_LINEAR, LINEAR_PIECES, LINEAR_PIECE, CLASS_IS_HONEST})
    family = "merged-linear"
    rules = RULES

    def match(self, trace: Trace, module: nn.Module) -> list[FusionPlan]:
        """The plans of every linear kind: the family's one search (`find_groups`)."""
        return find_groups(trace.graph, module)

    def claim(self, nodes: list[fx.Node]) -> tuple[list[FusionPlan], list[fx.Node]]:
        """The plans this kind makes of a same-input group of linear call nodes (each node's `target` is the
        projection's attribute name), and the nodes it leaves to the kinds after it."""
        raise NotImplementedError

    def merged_name(self, names: list[str]) -> str:
        """The merged linear's attribute name for projections `names` (in row order)."""
        return join_names(names)

    def plan(self, names: list[str], shard_ids: Iterable[ShardId] | None = None) -> FusionPlan:
        """A plan of this kind merging `names` in row order; shard ids default to the row indices."""
        ids = range(len(names)) if shard_ids is None else shard_ids
        return FusionPlan(self.name, self.merged_name(names), tuple(zip(names, ids)))

    def candidate(self, module: nn.Module) -> bool:
        """Two or more linear children (subclassed, hooked and parametrized ones too, so that a group holding one
        is reported as refused, with its rule, rather than skipped)."""
        return len(linear_children(module)) >= 2

    def check(self, module: nn.Module, plan: FusionPlan) -> None:
        check_projections(module, plan.projections)

    def new_names(self, plan: FusionPlan) -> tuple[str, ...]:
        """The merged linear and its split sizes."""
        return (plan.merged, sizes_attribute(plan.merged))

    def rewrite(
        self, classdef: ast.ClassDef, plan: FusionPlan, module: nn.Module, namespace: dict, fused: list[FusionPlan]
    ) -> FusionPlan:
        """The merged construction in `__init__`, the merged call + split in `forward`; returns `plan` noting which
        projections configs without the merged linear still build on their own (`FusionPlan.kept`)."""
        check_no_other_uses(classdef, plan)
        if spans_blocks(astutil.method(classdef, "__init__"), plan.projections):
            return _rewrite_nested(classdef, plan, module, namespace, fused)
        conditional = rewrite_init(astutil.method(classdef, "__init__"), plan, namespace)
        forward = astutil.method(classdef, "forward")
        with _merged_linears_present(module, [done for done in fused if done.shards]):
            calls = projection_calls(forward, plan, conditional)
            if not conditional and differently_spelled(calls) is not None:
                rewrite_self_or_cross(forward, plan, calls, module, namespace)  # one input, or two (cross-attention)
            else:
                rewrite_forward(forward, plan, module, namespace, conditional, calls)
        return _with_kept(plan, conditional)

    def smaller_after_check(self, module: nn.Module, plan: FusionPlan) -> list[FusionPlan]:
        return _plain_subplans(module, plan)

    def smaller_after_rewrite(self, classdef: ast.ClassDef, plan: FusionPlan, refusal: Refused) -> list[FusionPlan]:
        forward = astutil.method(classdef, "forward")
        if refusal.rule == "unusual-init" or spans_blocks(astutil.method(classdef, "__init__"), plan.projections):
            groups = same_block_groups(astutil.method(classdef, "__init__"), plan.projections)
            return [fusions.kind(SIBLINGS).plan(names) for names in groups]
        if refusal.rule in RULE_IDS and refusal.line is not None:
            called_before = _called_before_subplans(forward, plan, refusal.line)
            if called_before:
                return called_before
        # A group read from two inputs (`rewrite_cross`) may be refused by any rule; its same-input part may merge.
        return _same_spelling_subplans(forward, plan)


def find_groups(graph: fx.Graph, module: nn.Module) -> list[FusionPlan]:
    """Every plan the linear kinds make of the same-input groups of `graph` (sorted by projections)."""
    plans = []
    for nodes in same_input_groups(graph, module):
        plans.extend(_split_group(nodes))
    return sorted(plans, key=lambda plan: plan.projections)


def _split_group(nodes: list[fx.Node]) -> list[FusionPlan]:
    """A same-input group as plans: each linear kind, in priority order, claims what it recognises of the rest.

    Attention and MLP projections may share an input in one class (parallel
    blocks); keeping them apart keeps the merged names meaningful and lets a
    tensor-parallel runtime shard each merged linear its own way.
    """
    plans = []
    for kind in fusions.kinds():
        if isinstance(kind, LinearKind):
            claimed, nodes = kind.claim(nodes)
            plans.extend(claimed)
    return plans


def join_names(names: list[str]) -> str:
    """`q_proj, k_proj, v_proj` -> `qkv_proj`; `gate_proj, up_proj` -> `gate_up_proj`.

    The shared prefix and suffix are kept and the distinct stems joined, with
    no separator when every stem is one letter, as the serving engines name them.
    (A kind may name a group otherwise: see `LinearKind.merged_name`.)
    """
    prefix = os.path.commonprefix(names)
    suffix = os.path.commonprefix([name[::-1] for name in names])[::-1]
    suffix = suffix[suffix.find("_") :] if "_" in suffix else ""
    stems = [name[len(prefix) : len(name) - len(suffix)] for name in names]
    if not all(len(stem) == 1 for stem in stems):
        # Keep only whole words of the prefix: `query`/`quux` share `qu`, not a word.
        prefix = prefix[: prefix.rfind("_") + 1] if "_" in prefix else ""
        stems = [name[len(prefix) : len(name) - len(suffix)] for name in names]
    if not all(stems):
        return "_".join(names)
    joiner = "" if all(len(stem) == 1 for stem in stems) else "_"
    return prefix + joiner.join(stems) + suffix


def roles(names: Iterable[str]) -> set[str]:
    """Projection names reduced to their role, for the coverage tool (`present`): `q_proj` -> `q`, `wq` -> `q`,
    `query` -> `query`."""
    found = set()
    for name in names:
        stem = _SUFFIX.sub("", name)
        found.add(stem[1:] if re.fullmatch(r"w[qkv]", stem) else stem)
    return found


@contextlib.contextmanager
def _merged_linears_present(instance: nn.Module, fused: list[FusionPlan]):
    """`instance` with a plain meta `nn.Linear` under each merged name fused so far, for the analysis only.

    A later plan's forward already calls the earlier merged linear (`self.gate_up_proj(x).split(...)`); it is
    made of plain linears (`check_projections`), so its output is new storage, which the safety rules can only
    see if the name resolves to an `nn.Linear`. The children are removed again before anything else reads
    `instance`.
    """
    added = [plan.merged for plan in fused if plan.merged not in instance._modules]
    for name in added:
        instance._modules[name] = nn.Linear(1, 1, device="meta")
    try:
        yield
    finally:
        for name in added:
            del instance._modules[name]


def _rewrite_nested(
    classdef: ast.ClassDef, plan: FusionPlan, module: nn.Module, namespace: dict, fused: list[FusionPlan]
) -> FusionPlan:
    """The rewrite of a plan whose constructors sit in nested blocks (`fusegen.fusions.merged.rewrite_nested`); the plan
    notes the projections configs without the merged linear still build (`FusionPlan.kept`)."""
    built = rewrite_init_nested(astutil.method(classdef, "__init__"), plan, namespace)
    with _merged_linears_present(module, [done for done in fused if done.shards]):
        rewrite_forward_nested(astutil.method(classdef, "forward"), plan, module, namespace, built)
    return dataclasses.replace(plan, kept=built.kept)


def _with_kept(plan: FusionPlan, conditional: frozenset[str]) -> FusionPlan:
    """`plan`, noting which projections configs without the merged linear keep (see `FusionPlan.kept`)."""
    if not conditional:
        return plan
    return dataclasses.replace(plan, kept=tuple(name for name in plan.projections if name not in conditional))


def _plain_subplans(instance: nn.Module, plan: FusionPlan) -> list[FusionPlan]:
    """The group less the projections that are not plain `nn.Linear`s, if two or more remain.

    One subclassed or hooked projection (a LoRA-wrapped `q_proj`) should not
    cost the fusion of its plain siblings (`k_proj` + `v_proj`).
    """
    names = [name for name in plan.projections if not any(projection_findings(instance, (name,)))]
    if len(names) < 2 or len(names) == len(plan.projections):
        return []
    return [fusions.kind(SIBLINGS).plan(names)]


def _same_spelling_subplans(forward: ast.FunctionDef, plan: FusionPlan) -> list[FusionPlan]:
    """Smaller groups of `plan` whose calls spell their input the same way.

    A cross-attention-capable layer feeds q from `hidden_states` but k and v
    from `current_states` (which is `hidden_states` only in self-attention):
    q cannot join them, but k and v still read one value and merge into `kv_proj`.
    """
    groups: dict[str, list[str]] = {}
    for name in plan.projections:
        calls = [
            node
            for node in astutil.walk(forward)
            if isinstance(node, ast.Call) and astutil.self_attr(node.func, name) and _one_input(node) is not None
        ]
        if len(calls) == 1:
            groups.setdefault(ast.dump(_one_input(calls[0]), include_attributes=False), []).append(name)
    return [fusions.kind(SIBLINGS).plan(names) for names in groups.values() if 2 <= len(names) < len(plan.projections)]


def _one_input(call: ast.Call) -> ast.expr | None:
    """The input of `self.p(x)` or `self.p(input=x)`."""
    if len(call.args) == 1 and not call.keywords:
        return call.args[0]
    if not call.args and len(call.keywords) == 1 and call.keywords[0].arg == "input":
        return call.keywords[0].value
    return None


def _called_before_subplans(forward: ast.FunctionDef, plan: FusionPlan, line: int) -> list[FusionPlan]:
    """The group less the projections called on or after `line`, where an input-stability rule refused it.

    Dots' and Bailing's MLA attention also feed `g_proj` from `hidden_states`, but only after the cache update,
    the indexer and the attention call, which the rules cannot see into; `q_a_proj` + `kv_a_proj_with_mqa`, both
    called before them, still merge. The smaller group's hoist spans less code, and it is judged again by every
    rule (a subgroup is never trusted because of its parent), so offering it costs only the time to check it.
    """
    names = []
    for name in plan.projections:
        calls = [
            node for node in astutil.walk(forward) if isinstance(node, ast.Call) and astutil.self_attr(node.func, name)
        ]
        if len(calls) == 1 and calls[0].lineno < line:
            names.append(name)
    if len(names) < 2 or len(names) == len(plan.projections):
        return []
    return [fusions.kind(SIBLINGS).plan(names)]
