"""Loading a merged q/k/v whose kv heads are replicated (fewer kv heads than processes): no placement expresses it,
so the merged tensor is read whole (one layer at a time) and `PartitionedConcatenate` keeps this process's rows;
`PartitionedSplit` is the reverse on save."""

from __future__ import annotations

import torch
from transformers.conversion_mapping import get_checkpoint_conversion_mapping, register_checkpoint_conversion_mapping
from transformers.core_model_loading import ConversionOps, WeightConverter

from ..checkpoint import MergedColumnConcatenate, MergedColumnSplit, tensors_of
from ..merged import find_merged_linear


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
    state-dict hook usually hands the pieces over already split; this covers a merged tensor that still arrives.)
    Replicated kv heads arrive as one process's rows only (a `Replicate` DTensor gathers nothing), so saving them
    is refused rather than written wrong.
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
        if not partition.shard_on_read:
            raise ValueError(
                f"{full_layer_name}: cannot save a tensor-parallel model whose kv heads are replicated "
                f"(N={partition.world_size}); save it from a single process instead"
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


def use_partitioned_concatenate(class_name: str) -> None:
    """Swap the merge op of `class_name`'s registered checkpoint converters for `PartitionedConcatenate`.

    Done only for tensor-parallel loads (Transformers reads the registry after the model is built, so building the
    model is early enough); idempotent, and redone if a generated module is re-imported and registers afresh.
    """
    converters = get_checkpoint_conversion_mapping(class_name)
    if not converters:
        return
    changed = False
    for converter in converters:
        if isinstance(converter, WeightConverter):
            for index, op in enumerate(converter.operations):
                if type(op) is MergedColumnConcatenate:
                    converter.operations[index] = PartitionedConcatenate(op.dim)
                    changed = True
    if changed:
        register_checkpoint_conversion_mapping(class_name, converters, overwrite=True)
