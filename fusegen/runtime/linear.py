"""Merged (column-stacked) linear layers used by generated fused model files."""

from __future__ import annotations

import operator
from collections.abc import Sequence

import torch
from torch import nn


def _as_output_sizes(output_sizes: Sequence[int]) -> list[int]:
    """Normalise `output_sizes` to a list of positive Python ints.

    Plain ints matter: `Tensor.split` and `torch.compile` want static Python ints, and configs sometimes hold numpy
    integers. `operator.index` rejects floats (e.g. a `hidden_size / heads` that should have been `//`) instead of
    silently truncating them.
    """
    if isinstance(output_sizes, (str, bytes)) or not isinstance(output_sizes, Sequence):
        raise TypeError(f"output_sizes must be a sequence of ints, got {type(output_sizes).__name__}")
    sizes = [int(operator.index(size)) for size in output_sizes]
    if not sizes:
        raise ValueError("output_sizes must not be empty")
    if any(size <= 0 for size in sizes):
        raise ValueError(f"output_sizes must all be positive, got {sizes}")
    return sizes


def sizes_attribute(merged: str) -> str:
    """The owner's attribute holding a merged linear's split sizes, e.g. `qkv_proj_sizes` for `qkv_proj`.

    Generated forwards split by `self.qkv_proj_sizes`, not `self.qkv_proj.output_sizes`: a wrapper that replaces
    the merged linear (a PEFT LoRA layer, a quantizer's linear) hides `output_sizes`, but never touches its owner.
    The generated `__init__` binds it to the merged linear's own `output_sizes` list, so code that re-partitions
    the linear in place (tensor parallelism) updates both at once.
    """
    return f"{merged}_sizes"


class MergedColumnLinear(nn.Linear):
    """Several linears sharing one input, stored as a single `nn.Linear` whose rows are stacked in order.

    Why a subclass of `nn.Linear` and not a new module: the forward is then exactly `nn.Linear.forward` (one GEMM,
    bit-identical semantics), and everything in Transformers that special-cases `nn.Linear` (`_init_weights`, meta-device
    construction inside `from_pretrained`, dtype casting, device maps) keeps working unchanged.

    `output_sizes` records where each original projection lives in the output (`weight[:output_sizes[0]]` is the first
    projection, and so on). Generated forwards split the output by the same list, kept on the owner (`sizes_attribute`), and the checkpoint
    converters in `fusegen.runtime.checkpoint` read it to split the weight back into its original tensors on save,
    which is what makes unequal pieces (GQA/MQA q vs k/v) round-trip.
    """

    def __init__(
        self,
        in_features: int,
        output_sizes: Sequence[int],
        bias: bool = True,
        device: torch.device | str | None = None,
        dtype: torch.dtype | None = None,
    ) -> None:
        sizes = _as_output_sizes(output_sizes)
        super().__init__(in_features, sum(sizes), bias=bias, device=device, dtype=dtype)
        self.output_sizes: list[int] = sizes

    def extra_repr(self) -> str:
        """Show the per-projection sizes, so a printed model reveals how the fused output is laid out."""
        return f"{super().extra_repr()}, output_sizes={self.output_sizes}"
