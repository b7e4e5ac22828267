"""Stages 3-5: trace, match, and rewrite the source of each candidate class.

Each plan is tried on a copy of the class; a plan that any rule refuses is
recorded with its reason and the class keeps its original projections.
Vetoes found outside the classes (`fusegen.compiler.vetoes`) send the classes
they name through again, until none is new.
"""

from __future__ import annotations

import ast
import contextlib
import copy
import dataclasses
import inspect
import sys

from torch import nn

from fusegen.compiler import astutil
from fusegen.compiler.match import find_groups, merged_name
from fusegen.compiler.plan import ClassOutcome, FusionPlan, Refusal, Refused
from fusegen.compiler.rewrite_forward import rewrite_forward
from fusegen.compiler.rewrite_init import check_no_other_uses, rewrite_init, same_block_subplans
from fusegen.compiler.safety import check_projections, projection_findings
from fusegen.compiler.trace import Recorded, trace_module
from fusegen.compiler.vetoes import find_vetoes
from fusegen.runtime.linear import sizes_attribute


def analyse_classes(
    model: nn.Module, found: dict[type, nn.Module], inputs: dict[int, Recorded], refused: dict[str, dict[str, str]]
) -> tuple[list[ClassOutcome], dict[type, ast.ClassDef]]:
    """Every candidate class's outcome, and the rewritten class statements of those with a fusion.

    `found` is one instance per candidate class (`fusegen.compiler.instantiate.candidates`), `inputs` what each
    instance received in a forward of `model` (`fusegen.compiler.trace.record_inputs`), `refused` the fusions to
    refuse up front, `{class: {merged: reason}}` (validation's verdicts).
    """

    def run(cls, instance, vetoes=None):
        return analyse_class(
            cls,
            instance,
            vars(sys.modules[cls.__module__]),
            {**refused.get(cls.__name__, {}), **(vetoes or {})},
            inputs.get(id(instance)),
        )

    results = {cls: run(cls, instance) for cls, instance in found.items()}
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
    vetoes: dict[str, str] | None = None,
    recorded: Recorded | None = None,
) -> tuple[ClassOutcome, ast.ClassDef | None]:
    """The outcome for `cls`, and its rewritten class statement if anything was fused.

    `vetoes` names merged linears refused for reasons found outside the class
    (checkpoint names shared with an unfused module), with the reason.
    `recorded` is the arguments `instance` received in a forward of the model
    (`fusegen.compiler.trace.record_inputs`), traced with instead of synthetic inputs.
    """
    vetoes = vetoes or {}
    trace = trace_module(instance, recorded)
    outcome = ClassOutcome(cls.__name__, trace_error=trace.error)
    plans = find_groups(trace.graph, instance)
    if not plans:
        return outcome, None
    try:
        classdef = _fusable_source(cls)
    except Refused as refusal:
        outcome.refused = [Refusal(plan.projections, refusal.rule, refusal.reason, refusal.line) for plan in plans]
        return outcome, None
    taken = {name: None for name, _ in instance.named_children()}
    taken.update({node.attr: node for node in ast.walk(classdef) if astutil.self_attr(node)})
    queue = list(plans)
    while queue:
        plan = queue.pop(0)
        candidate = copy.deepcopy(classdef)
        try:
            check_projections(instance, plan.projections)
        except Refused as refusal:
            outcome.refused.append(Refusal(plan.projections, refusal.rule, refusal.reason, refusal.line))
            queue.extend(_plain_subplans(instance, plan))
            continue
        try:
            if plan.merged in vetoes:
                reason = vetoes[plan.merged]
                raise Refused(_veto_rule(reason), reason)
            # Names the rewrite adds: the merged linear and its split sizes. `hasattr` also sees attributes set by
            # base classes, which the class statement does not show (a false alarm costs a fusion).
            for name in (plan.merged, sizes_attribute(plan.merged)):
                if name in taken or hasattr(instance, name):
                    raise Refused("name-clash", f"the class already uses the name {name}", taken.get(name))
            check_no_other_uses(candidate, plan)
            conditional = rewrite_init(astutil.method(candidate, "__init__"), plan, namespace)
            with _merged_linears_present(instance, outcome.fused):
                rewrite_forward(astutil.method(candidate, "forward"), plan, instance, namespace, conditional)
        except Refused as refusal:
            outcome.refused.append(Refusal(plan.projections, refusal.rule, refusal.reason, refusal.line))
            if refusal.rule == "different-inputs":
                queue.extend(_same_spelling_subplans(astutil.method(classdef, "forward"), plan))
            elif refusal.rule == "unusual-init":
                queue.extend(same_block_subplans(astutil.method(classdef, "__init__"), plan))
            continue
        classdef = candidate
        taken[plan.merged] = taken[sizes_attribute(plan.merged)] = None
        outcome.fused.append(_with_kept(plan, conditional))
    return outcome, (classdef if outcome.fused else None)


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
    shards = tuple((name, index) for index, name in enumerate(names))
    return [FusionPlan("merged_column", merged_name(names), shards)]


def _veto_rule(reason: str) -> str:
    """The rule name of a veto found outside the class (see `fusegen.compiler.vetoes.find_vetoes`), from its reason."""
    if reason.startswith("the fused model does not match the original"):
        return "validation-mismatch"  # fusegen.compiler.validate.refusal_reason
    if "already merged" in reason:
        return "checkpoint-already-fused"
    if "which fusion removes" in reason:
        return "outside-reference"
    return "ambiguous-checkpoint-names"


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
            for node in ast.walk(forward)
            if isinstance(node, ast.Call) and astutil.self_attr(node.func, name) and _one_input(node) is not None
        ]
        if len(calls) == 1:
            groups.setdefault(ast.dump(_one_input(calls[0]), include_attributes=False), []).append(name)
    return [
        FusionPlan("merged_column", merged_name(names), tuple((name, index) for index, name in enumerate(names)))
        for names in groups.values()
        if 2 <= len(names) < len(plan.projections)
    ]


def _one_input(call: ast.Call) -> ast.expr | None:
    """The input of `self.p(x)` or `self.p(input=x)`."""
    if len(call.args) == 1 and not call.keywords:
        return call.args[0]
    if not call.args and len(call.keywords) == 1 and call.keywords[0].arg == "input":
        return call.keywords[0].value
    return None


def _fusable_source(cls: type) -> ast.ClassDef:
    """The class statement, if its `__init__` and `forward` can be rewritten at all."""
    forward = inspect.unwrap(cls.forward)
    if forward.__code__.co_freevars:
        raise Refused("closure", f"{cls.__name__}.forward is a closure over {', '.join(forward.__code__.co_freevars)}")
    classdef = astutil.parse_class(cls)
    for name in ("__init__", "forward"):
        if astutil.method(classdef, name) is None:
            raise Refused("inherited-method", f"{cls.__name__} inherits {name} instead of defining it")
    for node in ast.walk(classdef):
        name = getattr(node, "attr", None) or getattr(node, "id", None)
        if isinstance(name, str) and name.startswith("__") and not name.endswith("__"):
            raise Refused("name-mangled", f"{cls.__name__} uses the name-mangled name {name}", node)
    return classdef
