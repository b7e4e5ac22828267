"""Loading a merged q/k/v whose kv heads are replicated (fewer kv heads than processes): no placement expresses it,
so the merged tensor is read whole (one layer at a time) and `PartitionedConcatenate` keeps this process's rows;
`PartitionedSplit` is the reverse on save."""

from __future__ import annotations

import torch
from torch import nn
from transformers.core_model_loading import ConversionOps

from ..checkpoint import MergedColumnConcatenate, MergedColumnSplit, tensors_of
from ..merged import find_merged_linear
from ..registry import set_merge_op


class PartitionedConcatenate(MergedColumnConcatenate):
    """`MergedColumnConcatenate` that, for a merged linear read whole (replicated kv heads), keeps this process's rows.

    In every other case the loader already sliced the pieces and this is exactly `MergedColumnConcatenate`.
    """

    @torch.no_grad()
    def convert(self, input_dict, source_patterns, target_patterns, full_layer_name=None, model=None, **kwargs):
        merged = find_merged_linear(model, full_layer_name)
        partition = getattr(merged, "tp_partition", None)
        if partition is not None and not partition.shard_on_read:
            present = [pattern for pattern in source_patterns if pattern in input_dict]
            if len(present) == len(partition.sizes):
                input_dict = {
                    pattern: [tensor.narrow(self.dim, start, size) for tensor in tensors_of(input_dict[pattern])]
                    for pattern, start, size in zip(present, partition.starts, partition.sizes)
                }
        return super().convert(
            input_dict, source_patterns, target_patterns, full_layer_name=full_layer_name, model=model, **kwargs
        )

    @property
    def reverse_op(self) -> ConversionOps:
        return PartitionedSplit(self.dim)


class PartitionedSplit(MergedColumnSplit):
    """`MergedColumnSplit` for saving a tensor-parallel model, whose merged linears hold local `output_sizes`.

    Transformers gathers each DTensor (`full_tensor()`) before saving; a `MergedRowShard` merged parameter then
    arrives as the true merged tensor, split here by the full piece sizes (not the local `output_sizes`). (The
    state-dict hooks of `fusegen.runtime.distributed` usually hand the pieces over already split; this covers a
    merged tensor that still arrives.) Replicated kv heads gather whole too (`MergedRowShard.assemble`). Anything
    but the whole merged tensor is refused, never written wrong.
    """

    @torch.no_grad()
    def convert(self, input_dict, source_patterns, target_patterns, full_layer_name=None, model=None, **kwargs):
        head, found, tail = (full_layer_name or "").partition(target_patterns[0])
        merged = find_merged_linear(model, head + source_patterns[0] + tail) if found else None
        partition = getattr(merged, "tp_partition", None)
        if partition is None:
            return super().convert(
                input_dict, source_patterns, target_patterns, full_layer_name=full_layer_name, model=model, **kwargs
            )
        tensor = tensors_of(next(iter(input_dict.values())))[0]
        if tensor.shape[self.dim] != sum(partition.full_sizes):
            raise ValueError(
                f"{full_layer_name}: gathered {list(tensor.shape)}, expected {sum(partition.full_sizes)} rows"
            )
        # `full_tensor()` of a MergedRowShard parameter is the true merged tensor: split it as a single process would.
        return dict(zip(target_patterns, tensor.split(list(partition.full_sizes), dim=self.dim)))

    @property
    def reverse_op(self) -> ConversionOps:
        return PartitionedConcatenate(self.dim)


def use_partitioned_concatenate(model: nn.Module) -> None:
    """Make `model` (being loaded tensor-parallel) load and save its merges with `PartitionedConcatenate`.

    The choice is carried by the model and is part of what is registered for its tree (`fusegen.runtime.registry`),
    so no later registration (another model built, the same model registered again) undoes it, and no other model
    inherits it. Set while the model is built: Transformers looks its conversions up right after."""
    set_merge_op(model, PartitionedConcatenate)
