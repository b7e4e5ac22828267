"""Tensor parallelism of merged linears built as their pieces (a model loaded under a `quantization_config`).

Under a `quantization_config` (on-the-fly, e.g. torchao's `Float8WeightOnlyConfig`, or a pre-quantized checkpoint's)
a generated base model builds every merged linear as the original's pieces: `q_proj`, `k_proj`, `v_proj` registered
on the attention module, and `qkv_proj` a parameterless `PiecewiseLinear` that calls them and concatenates
(fusegen/runtime/quantized.py). There is then no merged weight for `fusegen_merged_colwise` to split, and the
quantizer works on each piece exactly as on the original's projection. So the plan shards the pieces exactly as
Transformers shards the original's projections:

- every rule of the generated `TP_PLAN` that names such a site (`layers.*.self_attn.qkv_proj`) is replaced by the
  config's own rules for its pieces (`layers.*.self_attn.q_proj: colwise`, ...), which are the rules the original
  class gets from the same config; the site itself gets `fusegen_piecewise_colwise`, which shards nothing and only
  sets the owner's `<merged>_sizes` (the list the generated forward splits by) to this process's width of each piece;
- `fusegen_local_heads` on an attention module whose q/k/v are pieces becomes `fusegen_piecewise_local_heads`: it
  checks the head counts against N (query heads and kv heads must both divide by N: a `colwise` k_proj/v_proj keeps
  rows `[r*n, (r+1)*n)`, whole kv heads only then; the replicated kv heads of the merged style are not what the
  original's plan does, so they are refused) and sets the module's head counts to this process's.

Why the numbers are the original's: each piece is the original's module, built, loaded, sharded (`colwise`: rows
`[r*n, (r+1)*n)` of its weight and bias, read by Transformers' shard-on-read) and quantized by Transformers' own code,
so it computes exactly what the original's projection computes on this process; the concatenation copies those
outputs unchanged, and the split by the local sizes hands each back unchanged. The local sizes are DTensor's own
chunk sizes for `Shard(0)` of each piece (`Shard.local_shard_size_and_offset`), the rows `colwise` gives it; the
first forward checks that the concatenated width is their sum and raises otherwise. A site sharded this way is
never composed into one module after loading (its pieces carry Transformers' tensor-parallel forwards).

A piece rule other than `colwise` (or no rule: the piece stays whole on every process, as the original's would) is
refused by name, as is a site whose pieces are partly built split: nothing is sharded in a way the original's plan
would not shard it.
"""

from __future__ import annotations

import re
from collections.abc import Mapping

import torch
from torch import nn
from transformers.distributed.tensor_parallel import TensorParallelLayer

from ..linear import sizes_attribute
from ..quantized import PiecewiseLinear
from .partition import check_head_counts
from .styles import LOCAL_HEADS, model_label, model_name, qkv_sizes

PIECEWISE_COLWISE = "fusegen_piecewise_colwise"
PIECEWISE_LOCAL_HEADS = "fusegen_piecewise_local_heads"
COLWISE = "colwise"


def _generic(path: str) -> str:
    return re.sub(r"(^|\.)\d+(?=\.|$)", r"\1*", path)


def _sites_by_rule(model: nn.Module) -> dict[str, list[tuple[str, nn.Module]]]:
    """Modules of `model` by their generic path (layer numbers as `*`), as plan rules name them."""
    found: dict[str, list[tuple[str, nn.Module]]] = {}
    for path, module in model.named_modules():
        if path:
            found.setdefault(_generic(path), []).append((path, module))
    return found


def piecewise_tp_plan(model: nn.Module, tp_plan: Mapping[str, str], strict: bool = True) -> dict[str, str]:
    """`tp_plan` (a generated file's `TP_PLAN`, keys relative to the base model `model`) for a model whose merged
    linears were built as pieces: see the module docstring. Unchanged when no rule names a `PiecewiseLinear`.

    A site that cannot be sharded as the original's pieces are (a piece rule other than `colwise`, a rule matching
    pieces and merged linears alike) raises `ValueError` naming the model, the module and the rule; with
    `strict=False` (the plan a model records when it is built, tensor parallelism or not) its rule is kept as it is
    instead, and a tensor-parallel load then raises in `prepare_tensor_parallel`, before anything is sharded.
    """
    if not any(isinstance(module, PiecewiseLinear) for module in model.modules()):
        return dict(tp_plan)  # built merged (no quantization_config): the generated plan as it is
    modules = _sites_by_rule(model)
    config = getattr(model, "config", None)
    config_plan = dict(getattr(config, "base_model_tp_plan", None) or {})
    label = model_label(config)
    plan: dict[str, str] = {}
    rewritten = False
    for rule, style in tp_plan.items():
        matched = modules.get(rule, [])
        split = [module for _, module in matched if isinstance(module, PiecewiseLinear)]
        if style == LOCAL_HEADS:
            split = [module for _, module in matched if _piecewise_qkv(module) is not None]
        if not split:
            plan[rule] = style
            continue
        try:
            plan.update(_piece_rules(rule, style, matched, split, config_plan, label))
        except ValueError:
            if strict:
                raise
            plan[rule] = style
            continue
        rewritten = True
    if rewritten:
        register_piecewise_styles()
    return plan


def _piece_rules(rule, style, matched, split, config_plan, label) -> dict[str, str]:
    """The rules replacing `rule` (matching the sites `split`, every one of `matched`): see `piecewise_tp_plan`."""
    where = f"{label} ({matched[0][0]})"
    if len(split) != len(matched):
        raise ValueError(
            f"{where}: the tensor-parallel rule {rule!r}: {style!r} matches merged linears built as pieces and "
            f"merged ones alike; cannot shard them the same way"
        )
    if style == LOCAL_HEADS:
        return {rule: PIECEWISE_LOCAL_HEADS}
    rules = {}
    owner = rule.rpartition(".")[0]
    for name in split[0].piece_names:
        piece_rule = f"{owner}.{name}" if owner else name
        piece_style = config_plan.get(piece_rule)
        if piece_style != COLWISE:
            raise ValueError(
                f"{where}: {type(split[0]).__name__} built as pieces {list(split[0].piece_names)} (a quantized "
                f"load) cannot be sharded with tensor parallelism: the config's plan gives its piece {name!r} "
                f"the rule {piece_style!r}, and only {COLWISE!r} pieces are sharded as the original's are"
            )
        rules[piece_rule] = piece_style
    return {**rules, rule: PIECEWISE_COLWISE}


def _piecewise_qkv(module: nn.Module) -> PiecewiseLinear | None:
    """The attention module's q/k/v site built as pieces (found by its piece sizes), or None."""
    config = getattr(module, "config", None)
    heads = getattr(config, "num_attention_heads", None)
    if not isinstance(heads, int):
        return None
    kv_heads = getattr(config, "num_key_value_heads", None) or heads
    wanted = qkv_sizes(module, heads, kv_heads)
    found = [
        child for child in module.children() if isinstance(child, PiecewiseLinear) and child.piece_sizes == wanted
    ]
    return found[0] if len(found) == 1 else None


def register_piecewise_styles() -> None:
    """Make the two styles known to Transformers' `ParallelInterface` (idempotent)."""
    if torch.distributed.is_available():
        try:  # Transformers >= 5.21 keeps the style registry in parallel_utils, 5.20 in tensor_parallel
            from transformers.distributed.parallel_utils import ALL_PARALLEL_STYLES
        except ImportError:
            from transformers.distributed.tensor_parallel import ALL_PARALLEL_STYLES

        ALL_PARALLEL_STYLES.register(PIECEWISE_COLWISE, PiecewiseColumnParallel())
        ALL_PARALLEL_STYLES.register(PIECEWISE_LOCAL_HEADS, PiecewiseLocalHeads())


class PiecewiseLocalHeads(TensorParallelLayer):
    """For an attention module whose q/k/v are pieces sharded `colwise`: check that N divides both head counts, then
    set the module's head counts to this process's (query heads per kv head are unchanged)."""

    def install_forward(self, module: nn.Module, mesh) -> nn.Module:
        config = module.config
        heads = config.num_attention_heads
        kv_heads = getattr(config, "num_key_value_heads", None) or heads
        world_size = mesh.size()
        name = model_name(module)
        check_head_counts(name, heads, kv_heads, world_size)
        if kv_heads % world_size:
            raise ValueError(
                f"{name}: cannot shard over N={world_size} tensor-parallel processes: num_key_value_heads={kv_heads} "
                f"is not divisible by N. Under a quantization_config q/k/v are built as the original's pieces and "
                f"sharded as Transformers shards the original's (colwise), which would cut a kv head; load without "
                f"the quantization_config, or with N dividing num_key_value_heads"
            )
        if _piecewise_qkv(module) is None:
            raise ValueError(f"{name}: {PIECEWISE_LOCAL_HEADS!r} needs q/k/v built as pieces")
        module.num_key_value_groups = heads // kv_heads
        for attribute, value in (("num_heads", heads // world_size), ("num_key_value_heads", kv_heads // world_size)):
            if isinstance(getattr(module, attribute, None), int):
                setattr(module, attribute, value)
        return module


class PiecewiseColumnParallel(TensorParallelLayer):
    """For a `PiecewiseLinear` whose pieces are sharded `colwise` by their own rules: no parameters of its own, no
    change to its input (each piece's `colwise` forward takes care of it); it sets the sizes the owner's forward
    splits by to this process's rows of each piece, and checks the first output against them."""

    def install_forward(self, module: nn.Module, mesh) -> nn.Module:
        from torch.distributed.tensor import Shard

        if not isinstance(module, PiecewiseLinear):
            raise TypeError(
                f"{model_name(module)}: the {PIECEWISE_COLWISE!r} rule needs a merged linear built as pieces, not "
                f"{type(module).__name__}"
            )
        world_size, rank = mesh.size(), mesh.get_local_rank()
        full = list(module.piece_sizes)
        local = [int(Shard.local_shard_size_and_offset(size, world_size, rank)[0]) for size in full]
        owner = module.owner
        attribute = next((name for name, child in owner._modules.items() if child is module), None)
        sizes = getattr(owner, sizes_attribute(attribute), None) if attribute else None
        if not isinstance(sizes, list) or sizes != full:
            raise ValueError(
                f"{model_name(module)}: its owner's {sizes_attribute(attribute or '?')} is {sizes}, not the pieces' "
                f"sizes {full}"
            )
        sizes[:] = local  # in place: the list the generated forward splits by
        module.piece_sizes = local
        module.full_piece_sizes = full
        module.reason = "tensor parallelism: each piece is sharded by its own colwise rule, as the original's"
        module.tensor_parallel = True
        return super().install_forward(module, mesh)

    def transform_output_post_forward(self, module, output, mesh):
        if output.shape[-1] != sum(module.piece_sizes):
            raise ValueError(
                f"{model_name(module)}: its pieces {list(module.piece_names)} returned {output.shape[-1]} columns on "
                f"this process, not {module.piece_sizes} (their colwise shards)"
            )
        return output


__all__ = [
    "PIECEWISE_COLWISE",
    "PIECEWISE_LOCAL_HEADS",
    "PiecewiseColumnParallel",
    "PiecewiseLocalHeads",
    "piecewise_tp_plan",
]
