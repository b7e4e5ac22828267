"""Stage 6d: the module-level tables of a generated file: the checkpoint mapping, its classes and the TP plan."""

from __future__ import annotations

from collections.abc import Collection, Mapping, Sequence
from typing import Any

from torch import nn

from fusegen import fusions
from fusegen.compiler.resolve import Target
from fusegen.core.plan import FusionPlan
from fusegen.errors import InputError
from fusegen.runtime.tp.styles import LOCAL_HEADS, MERGED_COLWISE, MLA_KV_A


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

    names = []
    for module in model.modules():
        name = type(module).__name__
        if isinstance(module, PreTrainedModel) and module is not model and name in renames:
            names.append(renames[name])
    return sorted(set(names)) or [renames[target.causal_lm.__name__]]


def tensor_parallel(model: nn.Module, plans: list[FusionPlan], parents: dict) -> dict:
    """Template data for tensor parallelism: the fused form of the config's `base_model_tp_plan` (or why there is
    none); see fusegen/runtime/tp/. The kinds say which merged linears hold attention heads
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


def fused_plan_from(
    original: Mapping[str, str] | None,
    stacked: Mapping[str, Sequence[tuple[str, Any]]],
    parents: Mapping[str, Sequence[str]] | None = None,
    heads: Collection[str] | None = None,
    kept: Collection[str] = (),
) -> tuple[dict[str, str] | None, str | None]:
    """Derive a generated file's `TP_PLAN` from the original config's `base_model_tp_plan`: `(plan, None)` or
    `(None, why not)`. The style names are the runtime's (`fusegen.runtime.tp.styles`).

    Each merged linear takes one `fusegen_merged_colwise` rule where all of its pieces had `colwise` ones (a merge
    of attention heads also gets `fusegen_local_heads` on its owner: the merged names in `heads`, which the
    compiler takes from the fusion kinds; without it, a merge whose shard ids are q, k, v); other rules are kept.
    Pieces with any other style (e.g. `colwise_gather_output`) cannot be merged this way, and then no plan is
    derived. A piece in `kept` is built on its own in the configs without the merged linear (a conditional
    fusion), so its own rule stays as well.
    """
    if not original:
        return None, "the original config has no base_model_tp_plan"
    piece_of = {name: merged for merged, pieces in stacked.items() for name, _ in pieces}
    plan: dict[str, str] = {}
    for key, style in original.items():
        owner, _, leaf = key.rpartition(".")
        merged = piece_of.get(leaf)
        if merged is None or (parents and merged in parents and owner.rpartition(".")[2] not in parents[merged]):
            plan[key] = style
            continue
        if leaf in kept:
            plan[key] = style
        pieces = stacked[merged]
        ordered = [original.get(f"{owner}.{name}" if owner else name) for name, _ in pieces]
        if ordered[-1] == MLA_KV_A and not any(ordered[:-1]):
            # MLA's q_a_proj (replicated, no rule) + kv_a_proj_with_mqa (`mla_kv_a_proj`): that style keeps the
            # weight replicated and all-reduces the gradient of the output's last `qk_rope_head_dim` columns, which
            # in the merged output are still kv_a_proj_with_mqa's rope columns; the q_a columns pass untouched.
            plan.setdefault(f"{owner}.{merged}" if owner else merged, MLA_KV_A)
            continue
        styles = set(ordered)
        if styles != {"colwise"}:
            return None, f"{key} is {style!r}; fusegen merges only pieces that are all 'colwise'"
        head_sharded = merged in heads if heads is not None else [shard for _, shard in pieces] == ["q", "k", "v"]
        if head_sharded and owner:
            plan.setdefault(owner, LOCAL_HEADS)
        plan.setdefault(f"{owner}.{merged}" if owner else merged, MERGED_COLWISE)
    return plan, None
