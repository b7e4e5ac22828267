"""Stage 6: the module-level tables of a generated file: the checkpoint mapping, its classes and the TP plan."""

from __future__ import annotations

from torch import nn

from fusegen import fusions
from fusegen.compiler.plan import FusionPlan
from fusegen.compiler.resolve import Target
from fusegen.errors import InputError
from fusegen.runtime.tp import LOCAL_HEADS, MERGED_COLWISE, MLA_KV_A, fused_plan_from


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


def tensor_parallel(model: nn.Module, plans: list[FusionPlan], scopes: dict) -> dict:
    """Template data for tensor parallelism: the fused form of the config's `base_model_tp_plan` (or why there is
    none); see fusegen/runtime/tp.py. The kinds say which merged linears hold attention heads
    (`Kind.head_sharded`), except a merge that exists only in some configs (`FusionPlan.kept`, see
    `head_sharded_everywhere`)."""
    original = getattr(model.config, "base_model_tp_plan", None)
    heads = {plan.merged for plan in plans if head_sharded_everywhere(plan)}
    kept = {name for fusion in plans for name in fusion.kept}
    stacked = stacked_mapping(plans)
    plan, reason = fused_plan_from(original, stacked, scopes, heads=heads, kept=kept)
    if not plan:
        return {"tp_plan": None, "tp_reason": reason, "tp_notes": []}
    return {"tp_plan": repr(plan), "tp_reason": None, "tp_notes": tp_notes(plan, stacked, kept)}


def tp_notes(plan: dict[str, str], stacked: dict[str, list[tuple]], kept: set[str]) -> list[str]:
    """What the derived plan does with the merged linears, one comment line per fact, read off the plan itself (so
    the generated file's comment says nothing the plan does not do: a file without a local-heads rule never claims
    to shard q/k/v by heads)."""
    styles: dict[str, set[str]] = {merged: set() for merged in stacked}
    leaves, owners = set(), []
    for key, style in plan.items():
        leaf = key.rpartition(".")[2]
        leaves.add(leaf)
        styles.get(leaf, set()).add(style)
        if style == LOCAL_HEADS:
            owners.append(key)
    notes = []
    colwise = [merged for merged, found in styles.items() if MERGED_COLWISE in found]
    if colwise:
        notes.append(f"{', '.join(colwise)}: `{MERGED_COLWISE}`, each piece split as its own `colwise` rule split it")
    if owners:
        notes.append(f"{', '.join(owners)}: `{LOCAL_HEADS}`, q/k/v sharded by query and kv heads")
    mla = [merged for merged, found in styles.items() if MLA_KV_A in found]
    if mla:
        notes.append(f"{', '.join(mla)}: `{MLA_KV_A}`, replicated, its rope columns' gradient all-reduced")
    bare = [merged for merged, found in styles.items() if not found]
    if bare:
        notes.append(f"{', '.join(bare)}: no rule (replicated), as none of its pieces had one")
    alone = [name for pieces in stacked.values() for name, _ in pieces if name in kept and name in leaves]
    if alone:
        notes.append(f"{', '.join(alone)}: own rules kept, for the layers or configs that build them unmerged")
    return notes + ["every other rule: the config's own"]


def head_sharded_everywhere(plan: FusionPlan) -> bool:
    """Does the owner of `plan`'s merged linear get the local-heads rule (`fusegen.runtime.tp.LocalHeadsParallel`)?

    That rule finds, in every module the plan pattern names, one merged q/k/v linear whose sizes follow the
    config's head counts, and fails otherwise. A conditional merge (Gemma 4's `qkv_proj`, None in the layers that
    share kv or have no v_proj, and sized by per-layer head counts) has no such linear in some layers, so it gets
    the merged column rule alone: each piece split over the processes as its own `colwise` rule split it in the
    original, and the projections it keeps (`q_proj`, `k_proj`) their own rules (`fused_plan_from`'s `kept`).
    """
    return fusions.kind(plan.kind).head_sharded and not plan.kept
