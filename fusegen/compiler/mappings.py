"""Stage 6d: the module-level tables of a generated file: the checkpoint mapping, its classes and the TP plan."""

from __future__ import annotations

from torch import nn

from fusegen import fusions
from fusegen.compiler.plan import FusionPlan
from fusegen.compiler.resolve import Target
from fusegen.errors import InputError
from fusegen.runtime.tp import fused_plan_from


def stacked_mapping(plans: list[FusionPlan]) -> dict[str, list[tuple]]:
    """`{merged: [(projection, shard id), ...]}`; one meaning per merged name."""
    mapping: dict[str, list[tuple]] = {}
    for plan in plans:
        shards = [tuple(shard) for shard in plan.shards]
        if mapping.setdefault(plan.merged, shards) != shards:
            raise InputError(
                f"two classes merge different projections into {plan.merged}: {mapping[plan.merged]} vs {shards}"
            )
    return mapping


def checkpoint_classes(model: nn.Module, target: Target, renames: dict[str, str]) -> list[str]:
    """Fused `PreTrainedModel` classes whose checkpoints need the stacked mapping.

    The base model class is enough: Transformers scopes a nested model's
    conversions to its prefix, and the causal LM nests it.
    """
    from transformers import PreTrainedModel
    from transformers.conversion_mapping import get_checkpoint_conversion_mapping

    names = []
    for module in model.modules():
        name = type(module).__name__
        if isinstance(module, PreTrainedModel) and module is not model and name in renames:
            names.append(renames[name])
    root = target.causal_lm.__name__
    if names and root in renames and get_checkpoint_conversion_mapping(root) is not None:
        # The original root's own class-keyed renames (Qwen2.5-VL's legacy `model.layers.*` -> the nested language
        # model's keys) are found by class name; the fused root is looked up by its own name, so it is registered
        # too, carrying them (`register_stacked_checkpoint` copies the original's conversions for each name).
        names.append(renames[root])
    return sorted(set(names)) or [renames[root]]


def tensor_parallel(model: nn.Module, plans: list[FusionPlan], parents: dict) -> dict:
    """Template data for tensor parallelism: the fused form of the config's `base_model_tp_plan` (or why there is
    none); see fusegen/runtime/tp.py. The kinds say which merged linears hold attention heads
    (`Kind.head_sharded`), except a merge that exists only in some configs (`FusionPlan.kept`, see
    `head_sharded_everywhere`)."""
    original = getattr(model.config, "base_model_tp_plan", None)
    heads = {plan.merged for plan in plans if head_sharded_everywhere(plan)}
    kept = {name for fusion in plans for name in fusion.kept}
    plan, reason = fused_plan_from(original, stacked_mapping(plans), parents, heads=heads, kept=kept)
    return {"tp_plan": repr(plan) if plan else None, "tp_reason": reason}


def head_sharded_everywhere(plan: FusionPlan) -> bool:
    """Does the owner of `plan`'s merged linear get the local-heads rule (`fusegen.runtime.tp.LocalHeadsParallel`)?

    That rule finds, in every module the plan pattern names, one merged q/k/v linear whose sizes follow the
    config's head counts, and fails otherwise. A conditional merge (Gemma 4's `qkv_proj`, None in the layers that
    share kv or have no v_proj, and sized by per-layer head counts) has no such linear in some layers, so it gets
    the merged column rule alone: each piece split over the processes as its own `colwise` rule split it in the
    original, and the projections it keeps (`q_proj`, `k_proj`) their own rules (`fused_plan_from`'s `kept`).
    """
    return fusions.kind(plan.kind).head_sharded and not plan.kept
