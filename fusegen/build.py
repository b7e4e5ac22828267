"""The pipeline end to end: a target name in, a generated module's text out."""

from __future__ import annotations

import ast
import hashlib
import inspect
from dataclasses import dataclass

import transformers
from torch import nn

import fusegen
from fusegen.analyse import analyse_class
from fusegen.errors import InputError
from fusegen.imports import global_names, import_lines
from fusegen.instantiate import candidates, instantiate
from fusegen.plan import ClassOutcome, FusionPlan
from fusegen.propagate import classes_to_emit, fused_name, rename_classes
from fusegen.render import render
from fusegen.resolve import Target, resolve
from fusegen.rewrite_init import MERGED_LINEAR

REGISTER = "register_stacked_checkpoint"


@dataclass
class Analysis:
    target: Target
    model: nn.Module
    outcomes: list[ClassOutcome]
    rewritten: dict[str, ast.ClassDef]
    """Rewritten class statements of the classes with at least one fusion."""


@dataclass
class BuildResult:
    target: Target
    outcomes: list[ClassOutcome]
    text: str | None
    """The generated module, or None when nothing could be fused."""


def analyse(name: str) -> Analysis:
    """Stages 1-5: every candidate class's outcome, and the rewritten classes."""
    target = resolve(name)
    model = instantiate(target)
    namespace = vars(target.module)
    outcomes, rewritten = [], {}
    for cls, instance in candidates(model).items():
        outcome, classdef = analyse_class(cls, instance, namespace)
        outcomes.append(outcome)
        if classdef is not None:
            rewritten[cls.__name__] = classdef
    return Analysis(target, model, outcomes, rewritten)


def build(name: str) -> BuildResult:
    """The whole pipeline: the generated module's text for target `name`."""
    analysis = analyse(name)
    target, model, outcomes, rewritten = analysis.target, analysis.model, analysis.outcomes, analysis.rewritten
    if not rewritten:
        return BuildResult(target, outcomes, None)
    emitted = classes_to_emit(target.module, model, rewritten)
    renames = {name: fused_name(name) for name in emitted}
    for classdef in emitted.values():
        rename_classes(classdef, renames)
    sources = [ast.unparse(classdef) for classdef in emitted.values()]
    used = global_names("\n\n".join(sources)) - set(renames.values())
    plans = [plan for outcome in outcomes for plan in outcome.fused]
    text = render(
        fusegen_version=fusegen.__version__,
        transformers_version=transformers.__version__,
        source_module=target.module.__name__,
        model_type=target.model_type,
        build_target=target.source,
        fingerprint=hashlib.sha256(inspect.getsource(target.module).encode()).hexdigest(),
        fused_lines=[f"{fused_name(o.class_name)}: {plan.describe()}" for o in outcomes for plan in o.fused],
        refused_lines=[f"{o.class_name}: {refusal.describe()}" for o in outcomes for refusal in o.refused],
        causal_lm=target.causal_lm.__name__,
        imports=import_lines(used | {REGISTER}, target.module, {MERGED_LINEAR, REGISTER}),
        stacked_params_mapping=repr(_stacked_mapping(plans)),
        packed_modules_mapping=repr({plan.merged: list(plan.projections) for plan in plans}),
        classes=sources,
        checkpoint_classes=repr(_checkpoint_classes(model, target, renames)),
        parents=repr(_parents(model, outcomes)),
        exports=repr(sorted(renames.values())),
    )
    return BuildResult(target, outcomes, text)


def _stacked_mapping(plans: list[FusionPlan]) -> dict[str, list[tuple]]:
    """`{merged: [(projection, shard id), ...]}`; one meaning per merged name."""
    mapping: dict[str, list[tuple]] = {}
    for plan in plans:
        shards = [tuple(shard) for shard in plan.shards]
        if mapping.setdefault(plan.merged, shards) != shards:
            raise InputError(
                f"two classes merge different projections into {plan.merged}: {mapping[plan.merged]} vs {shards}"
            )
    return mapping


def _parents(model: nn.Module, outcomes: list[ClassOutcome]) -> dict[str, list[str]]:
    """For each merged name, the attribute names under which its module sits in the model.

    Checkpoint names are matched on `<parent>.<projection>`, so a same-named
    projection of an unfused module elsewhere is never swept into a merge. A
    module held directly in a `ModuleList` has an index for a parent; its
    projections are matched by bare name instead.
    """
    merged_by_class = {o.class_name: [plan.merged for plan in o.fused] for o in outcomes if o.fused}
    projections = {plan.merged: plan.projections for o in outcomes for plan in o.fused}
    found: dict[str, set[str]] = {}
    for path, module in model.named_modules():
        for merged in merged_by_class.get(type(module).__name__, []):
            found.setdefault(merged, set()).add(path.rpartition(".")[2])
    parents = {merged: sorted(names) for merged, names in sorted(found.items()) if not any(n.isdigit() for n in names)}
    for path, module in model.named_modules():
        if type(module).__name__ in merged_by_class:
            continue
        for merged, names in projections.items():
            scoped = merged not in parents or path.rpartition(".")[2] in parents[merged]
            if scoped and any(isinstance(getattr(module, name, None), nn.Module) for name in names):
                raise InputError(
                    f"{path} ({type(module).__name__}) is not fused but its projections have the checkpoint names "
                    f"of the fused {merged}; loading could not tell them apart"
                )
    return parents


def _checkpoint_classes(model: nn.Module, target: Target, renames: dict[str, str]) -> list[str]:
    """Fused `PreTrainedModel` classes whose checkpoints need the stacked mapping.

    The base model class is enough: Transformers scopes a nested model's
    conversions to its prefix, and the causal LM nests it.
    """
    from transformers import PreTrainedModel

    names = []
    for module in model.modules():
        name = type(module).__name__
        if isinstance(module, PreTrainedModel) and module is not model and name in renames:
            names.append(renames[name])
    return sorted(set(names)) or [renames[target.causal_lm.__name__]]
