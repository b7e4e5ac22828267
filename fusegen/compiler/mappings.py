"""Stage 6: the module-level tables of a generated file: the checkpoint mapping, its classes and the TP plan."""

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


def merging_original_classes(outcomes) -> set[str]:
    """The original classes that hold a merged linear in the fused model."""
    return {outcome.class_name for outcome in outcomes if any(plan.shards for plan in outcome.fused)}


def checkpoint_classes(
    model: nn.Module, target: Target, renames: dict[str, str], merging: Collection[str] = ()
) -> list[str]:
    """Fused `PreTrainedModel` classes whose checkpoints need the stacked mapping.

    The nested base models are enough when every merged linear sits inside one: Transformers scopes a nested
    model's conversions to its prefix, and the causal LM nests it. A merged linear whose nearest enclosing
    `PreTrainedModel` is the root itself (Kosmos-2's `image_to_text_projection.x_attn`, beside its text and vision
    models) is reached by no nested model's conversions, so the root is registered too. `merging`: the original
    class names that hold a merged linear (`merging_original_classes`).
    """
    from transformers import PreTrainedModel
    from transformers.conversion_mapping import get_checkpoint_conversion_mapping

    names = []
    nested = []
    for path, module in model.named_modules():
        name = type(module).__name__
        if isinstance(module, PreTrainedModel) and module is not model and name in renames:
            names.append(renames[name])
        if isinstance(module, PreTrainedModel) and module is not model:
            nested.append(path)
    root = target.causal_lm.__name__
    at_root = any(
        type(module).__name__ in merging and not any(path.startswith(each + ".") for each in nested)
        for path, module in model.named_modules()
    )
    if names and root in renames and (at_root or get_checkpoint_conversion_mapping(root) is not None):
        # The original root's own class-keyed renames (Qwen2.5-VL's legacy `model.layers.*` -> the nested language
        # model's keys) are found by class name; the fused root is looked up by its own name, so it is registered
        # too, carrying them (`register_stacked_checkpoint` copies the original's conversions for each name, and
        # `fusegen.runtime.registry.register_for_tree` its model type's where it has no class-keyed ones).
        names.append(renames[root])
    return sorted(set(names)) or [renames[root]]


def tensor_parallel(model: nn.Module, plans: list[FusionPlan], scopes: dict) -> dict:
    """Template data for tensor parallelism: the fused form of the `base_model_tp_plan` of the one config that has
    one (`planned_config`), or why there is none; see fusegen/runtime/tp/. The kinds say which merged linears hold
    attention heads (`Kind.head_sharded`), except a merge that exists only in some configs (`FusionPlan.kept`, see
    `head_sharded_everywhere`)."""
    found, reason = planned_config(model)
    if found is None:
        return {"tp_plan": None, "tp_reason": reason, "tp_notes": []}
    heads = {plan.merged for plan in plans if head_sharded_everywhere(plan)}
    kept = {name for fusion in plans for name in fusion.kept}
    stacked = stacked_mapping(plans)
    plan, reason = fused_plan_from(found.base_model_tp_plan, stacked, scopes, heads=heads, kept=kept)
    if not plan:
        return {"tp_plan": None, "tp_reason": reason, "tp_notes": []}
    notes = tp_notes(plan, stacked, kept)
    if found is not model.config:
        notes.insert(0, f"(the plan of {type(found).__name__}; the base models built with another config have none)")
    return {"tp_plan": repr(plan), "tp_reason": None, "tp_notes": notes}


def planned_config(model: nn.Module) -> tuple[Any, str | None]:
    """The config whose `base_model_tp_plan` a generated file's `TP_PLAN` is the fused form of: `(config, None)` or
    `(None, why none)`.

    Transformers gives each base model (a `PreTrainedModel` that is its own `base_model`) the plan of ITS config,
    and a model nesting others collects their plans under their prefixes (`init_parallel_plans`). A causal LM's
    base model has the root's config; a multimodal model's text model has the text config (Qwen2.5-VL's, Gemma 3's
    plan lives there, the composite and vision configs have none), and its vision tower typically has none, so
    Transformers shards the text model and replicates the tower. The runtime applies `TP_PLAN` to the base models
    whose config has a plan (`fusegen.runtime.tp.init_fused_parallel_plans`), so one `TP_PLAN` is right only if
    all those plans are one: base models whose configs carry different plans (a vision config with its own plan)
    get no `TP_PLAN` rather than one plan applied to the other's modules.
    """
    from transformers import PreTrainedModel

    configs = {}
    for module in model.modules() if isinstance(model, nn.Module) else ():
        if isinstance(module, PreTrainedModel) and module.base_model is module:
            config = module.config
            if getattr(config, "base_model_tp_plan", None):
                configs.setdefault(id(config), config)
    if not configs and getattr(model.config, "base_model_tp_plan", None):
        configs[id(model.config)] = model.config  # no base model among the modules: the root's plan
    plans = {repr(sorted(config.base_model_tp_plan.items())): config for config in configs.values()}
    if not plans:
        return None, "the original config has no base_model_tp_plan"
    if len(plans) > 1:
        names = ", ".join(sorted(type(config).__name__ for config in plans.values()))
        return None, f"the base models' configs carry different base_model_tp_plans ({names}); one TP_PLAN per file"
    return next(iter(plans.values())), None


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
