"""Stages 3-5: trace, match, and rewrite the source of each candidate class (stage 5 ends in `build.analyse`, which
refuses what the causal LM never builds: `reachable`).

Each plan is tried on a copy of the class; a plan that any rule refuses is
recorded with its reason and the class keeps its original projections.
Vetoes found outside the classes (`fusegen.compiler.vetoes`) send the classes
they name through again, until none is new. Before that, a merged name that two
classes of the file would give different pieces (`qkv_proj` from `q_proj`... in a
vision tower and from BERT-style `query`... in the text model) sends the classes
whose kind shortened the name through again with the name their pieces join to
(`query_key_value`), so every merged name keeps one meaning per file.
"""

from __future__ import annotations

import ast
import dataclasses
import inspect
import sys

from torch import nn

from fusegen import fusions
from fusegen.compiler.match import find_plans
from fusegen.compiler.trace import Recorded, trace_module
from fusegen.compiler.vetoes import find_vetoes
from fusegen.core import astutil
from fusegen.core.plan import ClassOutcome, FusionPlan, Refusal, Refused, Veto, Vetoes, merged_linears
from fusegen.fusions.linear import join_names


def analyse_classes(
    model: nn.Module, found: dict[type, nn.Module], inputs: dict[int, Recorded], refused: Vetoes
) -> tuple[list[ClassOutcome], dict[type, ast.ClassDef]]:
    """Every candidate class's outcome, and the rewritten class statements of those with a fusion.

    `found` is one instance per candidate class (`fusegen.compiler.instantiate.candidates`), `inputs` what each
    instance received in a forward of `model` (`fusegen.compiler.trace.record_inputs`), `refused` the fusions to
    refuse up front (validation's verdicts).
    """

    joined: dict[type, frozenset[str]] = {}

    def run(cls, instance, vetoes=None):
        return analyse_class(
            cls,
            instance,
            vars(sys.modules[cls.__module__]),
            {**refused.get(cls.__name__, {}), **(vetoes or {})},
            inputs.get(id(instance)),
            joined.get(cls),
        )

    results = {cls: run(cls, instance) for cls, instance in found.items()}
    for cls, names in names_to_join({cls: outcome for cls, (outcome, _) in results.items()}).items():
        joined[cls] = names
        results[cls] = run(cls, found[cls])
    vetoes = find_vetoes(model, [outcome for outcome, _ in results.values()])
    while vetoes:
        for cls, instance in found.items():
            if cls.__name__ in vetoes:
                results[cls] = run(cls, instance, vetoes[cls.__name__])
        vetoes = find_vetoes(model, [outcome for outcome, _ in results.values()])
    outcomes = [outcome for outcome, _ in results.values()]
    rewritten = {cls: classdef for cls, (_, classdef) in results.items() if classdef is not None}
    return outcomes, rewritten


def analyse_class(
    cls: type,
    instance: nn.Module,
    namespace: dict,
    vetoes: dict[str, Veto] | None = None,
    recorded: Recorded | None = None,
    joined: frozenset[str] | None = None,
) -> tuple[ClassOutcome, ast.ClassDef | None]:
    """The outcome for `cls`, and its rewritten class statement if anything was fused.

    Each plan (`fusegen.compiler.match.find_plans`) goes to its kind (`fusegen.fusions`): the kind's checks on
    the live instance, then its rewrite of a copy of the class statement; a refusal keeps the class as it was
    for that plan and queues the smaller plans the kind offers.
    `vetoes` names merged linears refused for reasons found outside the class
    (checkpoint names shared with an unfused module), with the rule and reason.
    `recorded` is the arguments `instance` received in a forward of the model
    (`fusegen.compiler.trace.record_inputs`), traced with instead of synthetic inputs.
    `joined` names merged linears to name as their pieces join (`names_to_join`) rather than as their kind does.
    """
    vetoes = vetoes or {}
    trace = trace_module(instance, recorded)
    outcome = ClassOutcome(cls.__name__, trace_error=trace.error)
    plans = [_joined(plan, joined or frozenset()) for plan in find_plans(trace, instance)]
    if not plans:
        return outcome, None
    try:
        classdef = _fusable_source(cls)
    except Refused as refusal:
        outcome.refused = [Refusal(_subject(plan), refusal.rule, refusal.reason, refusal.line) for plan in plans]
        return outcome, None
    taken = {name: None for name, _ in instance.named_children()}
    taken.update({node.attr: node for node in astutil.walk(classdef) if astutil.self_attr(node)})
    queue = list(plans)
    while queue:
        plan = queue.pop(0)
        if isinstance(plan, Refusal):  # refused while matching (`Kind.match`): recorded in its place in the order
            outcome.refused.append(plan)
            continue
        kind = fusions.kind(plan.kind)
        candidate = astutil.copy_tree(classdef)
        try:
            kind.check(instance, plan)
        except Refused as refusal:
            outcome.refused.append(Refusal(plan.subject, refusal.rule, refusal.reason, refusal.line))
            queue.extend(kind.smaller_after_check(instance, plan))
            continue
        try:
            if plan.merged in vetoes:
                raise Refused(vetoes[plan.merged].rule, vetoes[plan.merged].reason)
            # `hasattr` also sees attributes set by base classes, which the class statement does not show (a false
            # alarm costs a fusion).
            for name in kind.new_names(plan):
                if name in taken or hasattr(instance, name):
                    raise Refused("name-clash", f"the class already uses the name {name}", taken.get(name))
            applied = kind.rewrite(candidate, plan, instance, namespace, outcome.fused) or plan
        except Refused as refusal:
            outcome.refused.append(Refusal(plan.subject, refusal.rule, refusal.reason, refusal.line))
            queue.extend(kind.smaller_after_rewrite(classdef, plan, refusal))
            continue
        classdef = candidate
        taken.update(dict.fromkeys(kind.new_names(plan)))
        outcome.fused.append(applied)
    return outcome, (classdef if outcome.fused else None)


def names_to_join(outcomes: dict[type, ClassOutcome]) -> dict[type, frozenset[str]]:
    """`{class: merged names}` to give the names their pieces join to (`join_names`), in the classes whose kind
    named them otherwise, because another class of the file gives the same name different pieces.

    Sound because only the attribute name changes: the pieces, their order and the shard ids stay, and the
    rewrite and the checkpoint mapping read the name from the plan. A clash between two joined names is left
    for `fusegen.compiler.mappings.stacked_mapping` to refuse.
    """
    pieces: dict[str, set[tuple]] = {}
    for outcome in outcomes.values():
        for plan in merged_linears(outcome.fused):
            pieces.setdefault(plan.merged, set()).add(plan.shards)
    clashing = {name for name, found in pieces.items() if len(found) > 1}
    to_join = {}
    for cls, outcome in outcomes.items():
        names = frozenset(
            plan.merged
            for plan in merged_linears(outcome.fused)
            if plan.merged in clashing and join_names(list(plan.projections)) != plan.merged
        )
        if names:
            to_join[cls] = names
    return to_join


def _joined(plan: FusionPlan | Refusal, joined: frozenset[str]) -> FusionPlan | Refusal:
    """`plan` with the name its pieces join to, if its merged name is one of `joined`."""
    if isinstance(plan, Refusal) or not plan.shards or plan.merged not in joined:
        return plan
    return dataclasses.replace(plan, merged=join_names(list(plan.projections)))


def _subject(found: FusionPlan | Refusal) -> tuple[str, ...]:
    """What a refusal of a plan or of a match-time refusal names."""
    return found.projections if isinstance(found, Refusal) else found.subject


def _fusable_source(cls: type) -> ast.ClassDef:
    """The class statement, if its `__init__` and `forward` can be rewritten at all."""
    forward = inspect.unwrap(cls.forward)
    if forward.__code__.co_freevars:
        raise Refused("closure", f"{cls.__name__}.forward is a closure over {', '.join(forward.__code__.co_freevars)}")
    classdef = astutil.parse_class(cls)
    for name in ("__init__", "forward"):
        if astutil.method(classdef, name) is None:
            raise Refused("inherited-method", f"{cls.__name__} inherits {name} instead of defining it")
    for node in astutil.walk(classdef):
        name = getattr(node, "attr", None) or getattr(node, "id", None)
        if isinstance(name, str) and name.startswith("__") and not name.endswith("__"):
            raise Refused("name-mangled", f"{cls.__name__} uses the name-mangled name {name}", node)
    return classdef
