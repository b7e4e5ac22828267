"""Fusion kind `packed_qkv` (a skeleton, written to measure what a layout-declaring kind costs; not registered).

Some attentions already hold q, k and v in one packed linear, and their checkpoints store it that way: Falcon's
`query_key_value`, GPT-BigCode's `c_attn`. Nothing is merged; what fusegen adds is the fact every runtime path needs
and no tensor name tells: the row order of the packed weight. This kind reads it off the live module
(`declared_layout`), as a `fusegen.runtime.layout.RowLayout`:

- Falcon, `new_decoder_architecture`: per kv group, its query heads, then its key head, then its value head
  (`_split_heads` views the output as `(kv groups, heads per group + 2, head_dim)`): `grouped(kv heads, ...)`;
- Falcon classic and GPT-BigCode multi-head: per head q, k, v (`view(heads, 3 * head_dim)`): `grouped(heads, ...)`;
- Falcon and GPT-BigCode multi-query: all query heads, then the key head, then the value head: contiguous.

A generated class would construct `MergedColumnLinear(..., layout=...)` with it (`merged_linear` builds that
module from a live one), and the runtime paths that ask the layout follow: the forward and `linear_pieces`
(`fusegen.runtime.linear`), loading and saving through Transformers' converters (`fusegen.runtime.checkpoint`),
sharding whole groups (`RowLayout.shard`); fusegen's own loader, PEFT packing, quantization and TP refuse a
non-contiguous layout by name (`fusegen.runtime.layout.require_contiguous`).

What is not written yet, and why the kind is not registered: the rewrite of the class's `__init__` (it refuses,
`packed-qkv-skeleton`), and the checks that the class's forward reads the rows as declared (this module's tests
check the declarations against Transformers' own split code).
"""

from __future__ import annotations

import ast
from dataclasses import dataclass, field

import torch
from torch import nn

from fusegen.core.plan import FusionPlan, Refused
from fusegen.core.traced import Trace
from fusegen.fusions.base import Kind
from fusegen.runtime.layout import RowLayout
from fusegen.runtime.linear import MergedColumnLinear

KIND = "packed_qkv"


@dataclass(frozen=True)
class PackedPlan(FusionPlan):
    layout: RowLayout | None = field(default=None, compare=True)
    """The packed linear's row order (`merged` names the linear: `query_key_value`, `c_attn`)."""

    def describe(self) -> str:
        return f"{self.merged}: q/k/v as {self.layout.describe()} ({self.kind})"


def declared_layout(module: nn.Module) -> tuple[str, RowLayout] | None:
    """(packed linear's attribute, its row layout) for a Falcon or GPT-BigCode self-attention, else None."""
    if hasattr(module, "query_key_value") and hasattr(module, "new_decoder_architecture"):  # Falcon
        heads, head_dim = module.num_heads, module.head_dim
        if module.new_decoder_architecture:
            kv_heads = module.num_kv_heads
            return "query_key_value", RowLayout.grouped(kv_heads, [heads // kv_heads * head_dim, head_dim, head_dim])
        if module.multi_query:
            return "query_key_value", RowLayout.contiguous([heads * head_dim, head_dim, head_dim])
        return "query_key_value", RowLayout.grouped(heads, [head_dim] * 3)
    if hasattr(module, "c_attn") and hasattr(module, "kv_dim") and not getattr(module, "is_cross_attention", True):
        heads, head_dim = module.num_heads, module.head_dim  # GPT-BigCode
        if module.multi_query:
            return "c_attn", RowLayout.contiguous([heads * head_dim, head_dim, head_dim])
        return "c_attn", RowLayout.grouped(heads, [head_dim] * 3)
    return None


def merged_linear(module: nn.Module, plan: PackedPlan) -> MergedColumnLinear:
    """The `MergedColumnLinear` a generated class would hold instead of `module`'s packed linear: the same parameters
    (shared, not copied) and the declared layout. Its forward is `nn.Linear.forward`, so for an exact `nn.Linear`
    child (`check`) the output is bit-identical."""
    packed = getattr(module, plan.merged)
    merged = MergedColumnLinear(
        packed.in_features, plan.layout.sizes, bias=packed.bias is not None, device="meta", layout=plan.layout
    )
    merged.weight, merged.bias = packed.weight, packed.bias
    return merged


class PackedQKVKind(Kind):
    """Not registered (see the module docstring)."""

    name = KIND
    priority = 30

    def candidate(self, module: nn.Module) -> bool:
        return declared_layout(module) is not None

    def match(self, trace: Trace, module: nn.Module) -> list[FusionPlan]:
        found = declared_layout(module)
        if found is None:
            return []
        attribute, layout = found
        return [PackedPlan(KIND, attribute, layout=layout)]

    def check(self, module: nn.Module, plan: FusionPlan) -> None:
        """The packed child must be exactly `nn.Linear` of the declared size (Falcon's `FalconLinear` computes
        `x @ W.T + b`, which `MergedColumnLinear`'s `F.linear` need not round alike)."""
        packed = getattr(module, plan.merged, None)
        if type(packed) is not nn.Linear:
            raise Refused(
                "packed-linear-subclass", f"{plan.merged} is a {type(packed).__name__}, not exactly nn.Linear"
            )
        if packed.out_features != sum(plan.layout.sizes):
            raise Refused(
                "packed-size", f"{plan.merged} has {packed.out_features} rows, the layout {sum(plan.layout.sizes)}"
            )

    def rewrite(
        self, classdef: ast.ClassDef, plan: FusionPlan, module: nn.Module, namespace: dict, fused: list[FusionPlan]
    ) -> None:
        raise Refused("packed-qkv-skeleton", "the packed q/k/v kind declares the layout but rewrites no class yet")


def split_canonical(module: nn.Module, plan: PackedPlan) -> dict[str, torch.Tensor]:
    """The packed weight as canonical `q`, `k`, `v` weights (what a split-layout checkpoint or engine expects)."""
    return dict(zip("qkv", plan.layout.split(getattr(module, plan.merged).weight.detach())))
