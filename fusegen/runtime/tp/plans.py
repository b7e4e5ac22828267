"""The TP plan of a fused model at run time: `init_fused_parallel_plans` swaps the config's rules for the generated
file's `TP_PLAN` and registers the styles; `check_plan_honoured` refuses, before anything is sharded, a fused rule
matching a module it cannot work on (naming the model, the module and the rule)."""

from __future__ import annotations

import re
import sys
from collections.abc import Mapping, Sequence
from typing import Any

import torch
from torch import nn
from transformers import PreTrainedModel

try:  # Transformers >= 5.21 keeps the style registry in parallel_utils, 5.20 in tensor_parallel
    from transformers.distributed.parallel_utils import ALL_PARALLEL_STYLES
except ImportError:
    from transformers.distributed.tensor_parallel import ALL_PARALLEL_STYLES

from .piecewise import piecewise_tp_plan
from .replicated_kv import use_partitioned_concatenate
from .styles import (
    LOCAL_HEADS,
    MERGED_COLWISE,
    MLA_KV_A,
    LocalHeadsParallel,
    MergedColumnParallel,
    model_label,
    qkv_sizes,
)


def register_styles() -> None:
    """Make the fused styles known to Transformers' `ParallelInterface` (idempotent)."""
    if torch.distributed.is_available():
        ALL_PARALLEL_STYLES.register(MERGED_COLWISE, MergedColumnParallel())
        ALL_PARALLEL_STYLES.register(LOCAL_HEADS, LocalHeadsParallel())


def _tensor_parallel_requested(config) -> bool:
    distributed = getattr(config, "distributed_config", None)
    return distributed is not None and (getattr(distributed, "tp_size", 1) or 1) > 1


def fused_tp_plan(model_plan: Mapping[str, str], config_plan: Mapping[str, str] | None, tp_plan: Mapping[str, str]):
    """`model_plan` (Transformers' merge of class, config and embedding rules) with the config's rules that `tp_plan`
    replaces removed and `tp_plan`'s rules added: rules for projections the fused model no longer has would be
    reported as matching nothing, and the rest must use the fused styles."""
    stale = set(config_plan or {}) - set(tp_plan)
    return {**{key: style for key, style in model_plan.items() if key not in stale}, **tp_plan}


def init_fused_parallel_plans(model: PreTrainedModel, tp_plan: Mapping[str, str] | None) -> None:
    """`init_parallel_plans` of a generated base model: Transformers' plans, then `tp_plan` in place of the config's.

    Heads (`*ForCausalLM`) need nothing: they collect their base model's plan, already fixed here. Nor does a base
    model whose config has no `base_model_tp_plan`: Transformers gives it no rules of its own (a vision tower, whose
    merged linears then stay whole on every process, as the original's pieces do), and a composite model collects
    its children's plans, already fused, under their prefixes. `TP_PLAN` is the fused form of the one config plan
    the file's base models carry (`fusegen.compiler.mappings.planned_config`), so it goes to the base models whose
    config has a plan. `tp_plan=None` means the generated file could not derive a plan; a tensor-parallel load of a
    model holding such a base model is then refused by name.

    A tensor-parallel load sets `distributed_config` on the ROOT config only, so the checks are run by the outermost
    base model (the one with the root config; built last) over every planned base model it holds, itself included.
    """
    PreTrainedModel.init_parallel_plans(model)
    if model.base_model is not model:
        return
    from ..quant import prepare_quantized

    prepare_quantized(model)  # built here because this is the base model's build hook (no TP involved)
    if getattr(model.config, "base_model_tp_plan", None):
        if tp_plan is None:
            model._tp_plan = {}
        else:
            register_styles()
            fused = piecewise_tp_plan(model, tp_plan, strict=False)  # merged linears built as pieces: their rules
            model._tp_plan = fused_tp_plan(model._tp_plan or {}, model.config.base_model_tp_plan, fused)
    if _tensor_parallel_requested(model.config):
        prepare_tensor_parallel(model, tp_plan)


def planned_base_models(model: nn.Module) -> list[tuple[str, PreTrainedModel]]:
    """`(path, module)` of the base models in `model` (itself included) whose config carries a `base_model_tp_plan`:
    the ones Transformers gives rules of their own, and a generated file's `TP_PLAN` replaces."""
    return [
        (path, module)
        for path, module in model.named_modules()
        if isinstance(module, PreTrainedModel)
        and module.base_model is module
        and getattr(module.config, "base_model_tp_plan", None)
    ]


def prepare_tensor_parallel(model: PreTrainedModel, tp_plan: Mapping[str, str] | None) -> None:
    """Before a tensor-parallel load shards anything: refuse a planned base model without a `TP_PLAN` and a fused rule
    that cannot be honoured (`check_plan_honoured`), read replicated kv heads whole (`use_partitioned_concatenate`)
    and name every module for the errors the styles raise."""
    planned = planned_base_models(model)
    if planned and tp_plan is None:
        raise ValueError(
            f"{type(model).__name__}: its generated file has no TP_PLAN (the comment above `TP_PLAN = None` "
            f"in {type(model).__module__} says why), so it cannot load with tp_plan"
        )
    stacked = getattr(sys.modules.get(type(model).__module__), "STACKED_PARAMS_MAPPING", None) or {}
    for _, base in planned:
        check_plan_honoured(base, piecewise_tp_plan(base, tp_plan), stacked)
    use_partitioned_concatenate(model)  # its tree's merges, registered right after, keep this process's rows
    label = model_label(model.config)
    for path, module in model.named_modules():  # modules have no path (linears no config) to name in errors
        module.tp_name = f"{label} ({path})"


def _generic(path: str) -> str:
    """A module path as plan rules name it: layer numbers replaced by `*` (`layers.0.mlp` -> `layers.*.mlp`)."""
    return re.sub(r"(^|\.)\d+(?=\.|$)", r"\1*", path)


def _rule_for(path: str, plan: Mapping[str, str]) -> tuple[str, str] | None:
    generic = _generic(path)
    return (generic, plan[generic]) if generic in plan else None


def check_plan_honoured(model: nn.Module, plan: Mapping[str, str], stacked: Mapping[str, Sequence[Any]]) -> None:
    """Raise `ValueError` naming the model, the module and the rule when a fused rule of `plan` cannot do what it says
    for the module it matches in this model (this config); run before anything is sharded.

    A rule that matches no module is left alone: the generated plan holds for every config of the model type, and a
    module built only under some configs (`fused_qkv_a_proj` when `q_lora_rank` is None) is simply absent here.
    A rule that matches the wrong kind of module is not: applied anyway it would crash part-way (the styles assume
    a merged linear or an attention holding one), or, for MLA, all-reduce the gradient of columns that are not the
    rope columns, which trains silently wrong. The checks, per style:

    - `fusegen_merged_colwise`: the module is a merged linear (it has `output_sizes` to split piece by piece);
    - `fusegen_local_heads`: the module has a config with `num_attention_heads` and holds exactly one merged linear
      whose pieces are q, k and v by their widths;
    - `mla_kv_a_proj` on a merged linear: its LAST piece (in `stacked`, the file's mapping) is the projection the
      config's `base_model_tp_plan` gives that style (the one whose own last `qk_rope_head_dim` columns are the rope
      key), and that piece is wider than those columns.
    """
    config = getattr(model, "config", None)
    label = model_label(config)
    for path, module in model.named_modules():
        found = _rule_for(path, plan) if path else None
        if found is None:
            continue
        rule, style = found
        problem = _why_not_honoured(module, path, style, stacked, config)
        if problem:
            raise ValueError(
                f"{label} ({path}): the tensor-parallel rule {rule!r}: {style!r} cannot be honoured: {problem}"
            )


def _why_not_honoured(module, path, style, stacked, config) -> str | None:
    """Why `style` cannot do its job on `module` (at `path`), or None; see `check_plan_honoured`."""
    sizes = getattr(module, "output_sizes", None)
    if style == MERGED_COLWISE and sizes is None:
        return f"{type(module).__name__} is not a merged linear (it has no output_sizes to split piece by piece)"
    if style == LOCAL_HEADS:
        heads = getattr(getattr(module, "config", None), "num_attention_heads", None)
        if not isinstance(heads, int):
            return f"{type(module).__name__} has no config.num_attention_heads to share between the processes"
        kv_heads = getattr(module.config, "num_key_value_heads", None) or heads
        wanted = qkv_sizes(module, heads, kv_heads)
        if sum(list(getattr(child, "output_sizes", [])) == wanted for child in module.children()) != 1:
            return f"{type(module).__name__} holds no single merged q/k/v linear with output_sizes={wanted}"
    if style == MLA_KV_A and sizes is not None:
        owner, _, attribute = path.rpartition(".")
        pieces = [piece[0] if isinstance(piece, (tuple, list)) else piece for piece in stacked.get(attribute, ())]
        rope = getattr(config.get_text_config(), "qk_rope_head_dim", None) if config is not None else None
        config_plan = getattr(config, "base_model_tp_plan", None) or {}
        last = pieces[-1] if pieces else None
        if last is None or config_plan.get(_generic(f"{owner}.{last}" if owner else last)) != MLA_KV_A:
            return (
                f"its last piece ({last}) is not the projection the config's plan gives {MLA_KV_A!r}, so its last "
                f"output columns are not the rope key's"
            )
        if isinstance(rope, int) and sizes[-1] <= rope:
            return f"its last piece has {sizes[-1]} rows, not more than qk_rope_head_dim={rope}"
    return None
