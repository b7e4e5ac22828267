"""Stage 5, across classes (`analyse.analyse_classes`): fusions to refuse for reasons outside their class
(checkpoint names, outside references).

`find_vetoes` runs after every class was analysed; the classes it names are analysed again with those fusions
refused (`fusegen.compiler.analyse.analyse_classes`), until no new veto appears.
"""

from __future__ import annotations

import ast
import itertools
import sys

from torch import nn

from fusegen.compiler.piece_refs import guarded_against, isinstance_guards, rewritable
from fusegen.compiler.scopes import checkpoint_scopes
from fusegen.core import astutil
from fusegen.core.plan import ClassOutcome, Refused, Veto, Vetoes, merged_linears


def find_vetoes(model: nn.Module, outcomes: list[ClassOutcome]) -> Vetoes:
    """Fusions to refuse for reasons outside their class: `{class: {merged: Veto(rule, reason)}}`."""
    parents = checkpoint_scopes(model, outcomes)  # read by two of them: computed once
    vetoes = checkpoint_conflicts(model, outcomes, parents)
    for found in (
        prefused_checkpoints(model, outcomes),
        outside_references(model, outcomes),
        merged_names_reused(outcomes),
        pieces_merged_apart(model, outcomes, parents),
    ):
        for class_name, reasons in found.items():
            vetoes.setdefault(class_name, {}).update(reasons)
    return vetoes


def merged_names_reused(outcomes: list[ClassOutcome]) -> Vetoes:
    """Fusions one of whose projections has the name another fusion gives its merged linear.

    MiniMax's lightning attention already holds a packed `qkv_proj`, which its
    full attention layers' q/k/v merge into: a checkpoint tensor `qkv_proj`
    would then be a piece in one layer and a merged tensor in the other. The
    fusion that consumes the name is refused; the one that produces it stays.
    """
    merged = {plan.merged: outcome.class_name for outcome in outcomes for plan in merged_linears(outcome.fused)}
    vetoes: Vetoes = {}
    for outcome in outcomes:
        for plan in outcome.fused:
            for name in plan.projections:
                if name in merged:
                    vetoes.setdefault(outcome.class_name, {}).setdefault(
                        plan.merged,
                        Veto(
                            "ambiguous-checkpoint-names",
                            f"{name} is also the merged name of {merged[name]}'s fusion, so a checkpoint tensor "
                            f"{name} could be either a piece or a merged tensor",
                        ),
                    )
    return vetoes


def pieces_merged_apart(
    model: nn.Module, outcomes: list[ClassOutcome], parents: dict[str, list[str]] | None = None
) -> Vetoes:
    """Fusions of two classes that merge a projection of one checkpoint name into different merged linears.

    Kimi Linear's and Bailing's hybrid layers hold their linear attention and their MLA attention at the same
    path (`layers.N.self_attn`); the first merges `q_proj` into `qkv_proj`, the second into
    `q_proj_kv_a_proj_with_mqa`. A checkpoint tensor `layers.N.self_attn.q_proj.weight` then feeds one or the other
    depending on the layer's type, which the path patterns of the checkpoint conversion (Transformers applies one
    per tensor) and of the TP plan cannot express, and which changes with the config's `layer_types`. Both
    fusions are refused, naming the tensors. (Refusing only one would leave that class's `q_proj` unfused at the
    same path, which `checkpoint_conflicts` refuses in the other.) Scopes that do not overlap keep them apart.
    `parents`: `checkpoint_scopes(model, outcomes)`, if the caller has it.
    """
    parents = checkpoint_scopes(model, outcomes) if parents is None else parents
    first_path: dict[str, str] = {}
    for path, module in model.named_modules():
        first_path.setdefault(type(module).__name__, path)
    plans = [(outcome.class_name, plan) for outcome in outcomes for plan in merged_linears(outcome.fused)]
    vetoes: Vetoes = {}
    for (one, plan), (other, other_plan) in itertools.combinations(plans, 2):
        shared = sorted(set(plan.projections) & set(other_plan.projections))
        same = plan.merged == other_plan.merged and plan.shards == other_plan.shards
        if one == other or not shared or same or not _scopes_overlap(parents, plan.merged, other_plan.merged):
            continue
        name = shared[0]
        reason = (
            f"{first_path.get(one, one)}.{name} ({one}) merges into {plan.merged} but "
            f"{first_path.get(other, other)}.{name} ({other}) into {other_plan.merged}: one checkpoint name "
            f"cannot feed both"
        )
        for class_name, merged in ((one, plan.merged), (other, other_plan.merged)):
            vetoes.setdefault(class_name, {}).setdefault(merged, Veto("ambiguous-checkpoint-names", reason))
    return vetoes


def _scopes_overlap(parents: dict[str, list[str]], one: str, other: str) -> bool:
    """Could a checkpoint name feed both merged linears? Yes unless both have scopes and they are disjoint."""
    return one not in parents or other not in parents or bool(set(parents[one]) & set(parents[other]))


def outside_references(model: nn.Module, outcomes: list[ClassOutcome]) -> Vetoes:
    """Fusions whose projections other code reaches into (`module.q_proj` in `_init_weights`).

    The projection no longer exists after fusion, so such code would fail or
    silently skip it. Any `<expr>.<projection>` outside `self.` in the model's
    classes counts: a false alarm costs a fusion, a miss breaks loading.

    Two exceptions (fusegen/compiler/piece_refs.py gives the soundness argument): a read under an isinstance guard
    that excludes the fused class (`guarded_against`) is no reference to it, and a read under a guard naming
    exactly the fused class, used only for its `.weight`/`.bias` (`rewritable`), is kept by the emitted copy of
    the reading class, which reads the piece's rows of the merged linear instead (`rewrite_piece_references`).
    """
    names = [(plan.merged, o.class_name, plan.projections) for o in outcomes for plan in merged_linears(o.fused)]
    if not names:
        return {}
    vetoes: Vetoes = {}
    classes = {
        cls
        for module in model.modules()
        for cls in type(module).__mro__
        if cls.__module__.startswith(("transformers.models.", type(model).__module__))
    }
    fused_classes = {type(module).__name__: type(module) for module in model.modules()}
    for cls in sorted(classes, key=lambda c: (c.__module__, c.__name__)):
        try:
            classdef = astutil.class_statement(cls)
        except Refused:
            continue
        namespace = vars(sys.modules[cls.__module__])
        guards, parent_of = isinstance_guards(classdef, namespace), astutil.parent_map(classdef)
        for node in astutil.walk(classdef):
            if not isinstance(node, ast.Attribute) or astutil.self_attr(node):
                continue
            for merged, class_name, projections in names:
                fused = fused_classes.get(class_name)
                if node.attr not in projections or guarded_against(node, guards, fused):
                    continue
                if not rewritable(node, guards, fused, parent_of, namespace):
                    vetoes.setdefault(class_name, {}).setdefault(
                        merged,
                        Veto(
                            "outside-reference",
                            f"{cls.__name__} reads `{ast.unparse(node)}` (line {node.lineno}), which fusion removes",
                        ),
                    )
    return vetoes


def prefused_checkpoints(model: nn.Module, outcomes: list[ClassOutcome]) -> Vetoes:
    """Fusions whose projections the model's checkpoints already store merged.

    Transformers splits such a tensor on load (`query_key_value` -> q/k/v) with
    a conversion of its own, and applies at most one conversion per tensor, so
    ours would never see the pieces: refused, with the checkpoint's name.
    """
    from transformers import PreTrainedModel
    from transformers.conversion_mapping import get_checkpoint_conversion_mapping

    keys = [model.config.model_type] + [type(m).__name__ for m in model.modules() if isinstance(m, PreTrainedModel)]
    splits = [
        (converter.source_patterns, converter.target_patterns)
        for key in dict.fromkeys(keys)
        for converter in get_checkpoint_conversion_mapping(key) or []
        if len(getattr(converter, "target_patterns", [])) > 1
    ]
    vetoes: Vetoes = {}
    for outcome in outcomes:
        for plan in outcome.fused:
            for sources, targets in splits:
                pieces = {
                    target.removesuffix(".weight").removesuffix(".bias").rpartition(".")[2] for target in targets
                }
                if pieces & set(plan.projections):
                    vetoes.setdefault(outcome.class_name, {}).setdefault(
                        plan.merged,
                        Veto(
                            "checkpoint-already-fused",
                            f"checkpoints store {', '.join(sources)} already merged (Transformers splits it into "
                            f"{', '.join(sorted(pieces))} on load)",
                        ),
                    )
    return vetoes


def checkpoint_conflicts(
    model: nn.Module, outcomes: list[ClassOutcome], parents: dict[str, list[str]] | None = None
) -> Vetoes:
    """Fusions whose checkpoint names an unfused module shares: `{class: {merged: Veto(rule, reason)}}`.

    A hybrid model may keep, at the same path (`layers.N.self_attn.q_proj`), a
    fused attention in some layers and an unfused one in others; the
    checkpoint cannot say which tensors to merge, so such a fusion is refused.

    With the parents read off the source (`fusegen.compiler.scopes.checkpoint_scopes`), the scopes are every
    attribute a holder is built under, so this sees at least the paths it saw
    before. What it guards is no longer a silent wrong load: `from_pretrained`
    falls back to a tensor's own name when the merged name is absent at that
    path, `load_checkpoint` maps by the live model's merged modules, and what
    still goes unfilled raises (`fusegen.runtime.check_loading`). It guards the
    TP plan, whose rules are path patterns (`layers.*.self_attn.q_proj`) that
    cannot tell a fused layer from an unfused one at the same path. It checks
    the instantiated model only: an unfused module at such a path in another
    config still loads exactly, but under tensor parallelism its pieces would
    match no rule (left replicated); that gap is not closed here.
    `parents`: `checkpoint_scopes(model, outcomes)`, if the caller has it.
    """
    parents = checkpoint_scopes(model, outcomes) if parents is None else parents
    fused_classes = {o.class_name: o for o in outcomes if o.fused}
    merged_away = {name: _merged_away(outcome) for name, outcome in fused_classes.items()}
    conflicts: Vetoes = {}
    for path, module in model.named_modules():
        own = type(module).__name__
        kept_here = [name for name, _ in module.named_children() if name not in merged_away.get(own, ())]
        for outcome in fused_classes.values():
            if outcome.class_name == own:
                continue
            for plan in outcome.fused:
                scoped = plan.merged not in parents or path.rpartition(".")[2] in parents[plan.merged]
                shared = [name for name in plan.projections if name in kept_here]
                if scoped and shared:
                    tensors = ", ".join(f"{path}.{name}" for name in shared)
                    conflicts.setdefault(outcome.class_name, {}).setdefault(
                        plan.merged,
                        Veto(
                            "ambiguous-checkpoint-names",
                            f"{tensors} ({own}) stays unfused under the checkpoint name that "
                            f"{outcome.class_name} merges into {plan.merged}, so loading could not tell which "
                            "tensors to merge",
                        ),
                    )
    return conflicts


def _merged_away(outcome: ClassOutcome) -> set[str]:
    """The projections `outcome`'s class no longer has under their own names in any config.

    A class with some fusion still keeps its other projections (Kimi's linear attention fuses q/k/v but keeps
    `b_proj`), and a conditional merge keeps its always-built pieces where the merged linear is not built
    (`FusionPlan.kept`); those still hold unfused tensors at their path, so they count as kept.
    """
    return {name for plan in merged_linears(outcome.fused) for name in plan.projections if name not in plan.kept}
