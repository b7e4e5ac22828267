"""Tensor parallelism for generated fused models, on Transformers' own machinery (`from_pretrained(tp_plan="auto")`).

Why fused models need more than Transformers' built-in styles: a merged linear stacks several projections, and each
must be split on its own. `qkv_proj` holds q (by query heads), then k and v (by key/value heads); when there are fewer
kv heads than processes, each process keeps the kv head its query heads read (k and v are then replicated). Transformers'
`packed_colwise` only splits equal halves, and its `colwise` would hand process 0 all of q and process 1 all of k and v.

The pieces, for a generated file with a `TP_PLAN`:

- `TP_PLAN` (in the generated file) is the fused form of the config's `base_model_tp_plan`: the rules for
  `q_proj`/`k_proj`/`v_proj` become one `fusegen_merged_colwise` rule for `qkv_proj` plus a `fusegen_local_heads` rule
  for the attention module, `gate_proj`/`up_proj` become `gate_up_proj`; row-parallel `o_proj`/`down_proj`, and every
  rule for an unfused module, are kept as they are.
- `init_fused_parallel_plans` runs when a fused base model is built: Transformers merges the config's plan (which names
  projections that no longer exist); this swaps those rules for `TP_PLAN`'s and registers the two styles below.
- `LocalHeadsParallel` (on the attention module) checks the head counts against the number of processes N, raising a
  `ValueError` that names the model, the sizes and N, and sets the module's head counts to this process's.
- `MergedColumnParallel` (on each merged linear) replaces its weight and bias by this process's rows of each piece,
  sets `output_sizes` to the local piece sizes (the generated forward splits by it), and keeps inputs and outputs local.
- `check_plan_honoured` runs before anything is sharded: a fused rule matching a module it cannot work on (the
  merged style on a plain linear, local heads on a module without a merged q/k/v, MLA's `mla_kv_a_proj` on a merged
  linear whose last piece is not the rope-carrying one) raises a `ValueError` naming the model, the module and the
  rule. DeepSeek MLA needs no style of its own: its config's plan replicates the low-rank a-projections (merged into
  `fused_qkv_a_proj`, which keeps `mla_kv_a_proj`: the rope key's gradient is all-reduced, and those columns are
  still the merged output's last), splits q_b/kv_b by heads and o_proj by rows, and replicates the norms.

The merged parameters' placement, `MergedRowShard`, says what each process holds (its rows of every piece), so
`full_tensor()`, gradients and saving see the true merged weight; `model.state_dict()` lists the canonical pieces as
`Shard(0)` DTensors for distributed checkpointing (`_canonical_state_dict`).

Loading reads only each process's slices where the layout allows: Transformers' shard-on-read slices every checkpoint
tensor by the placement of the parameter it feeds, one piece at a time, and `MergedRowShard` reads as `Shard(0)`, so
the merged parameter gets exactly rows `[r*n, (r+1)*n)` of q, of k and of v. Replicated kv heads cannot be expressed
as a placement; such a `qkv_proj` is read whole (one layer at a time) and `PartitionedConcatenate` keeps this
process's rows.

This module is imported when a fused model is first built, not when a generated file is imported.
"""

from __future__ import annotations

import re
import sys
from collections.abc import Collection, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn
from transformers import PreTrainedModel
from transformers.conversion_mapping import get_checkpoint_conversion_mapping, register_checkpoint_conversion_mapping
from transformers.core_model_loading import ConversionOps, WeightConverter
from transformers.distributed.tensor_parallel import TensorParallelLayer

try:  # Transformers >= 5.21 keeps the style registry in parallel_utils, 5.20 in tensor_parallel
    from transformers.distributed.parallel_utils import ALL_PARALLEL_STYLES, _AllReduceBackward
except ImportError:
    from transformers.distributed.tensor_parallel import ALL_PARALLEL_STYLES, _AllReduceBackward

from .checkpoint import MergedColumnConcatenate, MergedColumnSplit, tensors_of
from .linear import absent_bias_pieces
from .merged import find_merged_linear

MERGED_COLWISE = "fusegen_merged_colwise"
MLA_KV_A = "mla_kv_a_proj"
"""Transformers' style for MLA's kv_a_proj_with_mqa: replicated, rope columns' gradient all-reduced."""
LOCAL_HEADS = "fusegen_local_heads"


# --------------------------------------------------------------------------------------------------------------------
# Which rows each process keeps
# --------------------------------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class RowPartition:
    """This process's rows of each piece of a merged linear: `sizes[i]` rows from row `starts[i]` of piece i."""

    full_sizes: tuple[int, ...]
    starts: tuple[int, ...]
    sizes: tuple[int, ...]
    world_size: int
    rank: int

    @property
    def shard_on_read(self) -> bool:
        """Whether every piece is cut into N equal consecutive blocks, block `rank` kept.

        Then a `Shard(0)` DTensor describes the parameter to Transformers' loader, which applies it to each checkpoint
        piece separately and so reads exactly these rows. Replicated pieces (kv heads < N) are not of that form.
        """
        return all(
            size * self.world_size == full and start == self.rank * size
            for full, start, size in zip(self.full_sizes, self.starts, self.sizes)
        )

    def merged_rows(self) -> list[tuple[int, int]]:
        """(start, length) of the kept rows within the full merged tensor, piece by piece."""
        offsets = [sum(self.full_sizes[:i]) for i in range(len(self.full_sizes))]
        return [(offset + start, size) for offset, start, size in zip(offsets, self.starts, self.sizes)]


def partition_rows(
    full_sizes: Sequence[int],
    units: Sequence[int],
    replicable: Sequence[bool],
    world_size: int,
    rank: int,
    *,
    what: str,
) -> RowPartition:
    """Split each piece by whole units (heads, or single rows) over `world_size` processes.

    A piece whose unit count divides by N is cut into N blocks. A `replicable` piece with fewer units than processes
    (kv heads) gives each group of N/units consecutive processes the same unit: process r holds query heads that all
    read kv head r // (N/units), so q and kv stay aligned. Anything else cannot be split without cutting a head.
    """
    starts, sizes = [], []
    for full, count, can_replicate in zip(full_sizes, units, replicable):
        if count <= 0 or full % count:
            raise ValueError(f"{what}: a piece of {full} rows cannot hold {count} equal units")
        rows = full // count
        if count % world_size == 0:
            size = count // world_size * rows
            starts.append(rank * size)
        elif can_replicate and world_size % count == 0:
            size = rows
            starts.append(rank // (world_size // count) * rows)
        else:
            raise ValueError(
                f"{what}: piece sizes {list(full_sizes)} in units of {list(units)} cannot be split over "
                f"N={world_size} tensor-parallel processes ({count} is not divisible by {world_size})"
            )
        sizes.append(size)
    return RowPartition(tuple(full_sizes), tuple(starts), tuple(sizes), world_size, rank)


def check_head_counts(name: str, heads: int, kv_heads: int, world_size: int) -> None:
    """Refuse head counts that N processes cannot share, before anything is sharded or read."""
    where = f"{name}: cannot shard over N={world_size} tensor-parallel processes"
    if world_size > heads:
        raise ValueError(f"{where}: N is larger than num_attention_heads={heads}")
    if heads % world_size:
        raise ValueError(f"{where}: num_attention_heads={heads} is not divisible by N")
    if kv_heads % world_size and world_size % kv_heads:
        raise ValueError(f"{where}: num_key_value_heads={kv_heads} neither divisible by nor dividing N")


# --------------------------------------------------------------------------------------------------------------------
# Parallel styles
# --------------------------------------------------------------------------------------------------------------------


def _model_label(config) -> str:
    return getattr(config, "_name_or_path", "") or getattr(config, "model_type", "") or "model"


def _model_name(module: nn.Module) -> str:
    """What error messages call the model: its checkpoint path (or model type) and the module's class or path."""
    if getattr(module, "tp_name", None):
        return module.tp_name
    return f"{_model_label(getattr(module, 'config', None))} ({type(module).__name__})"


def _merged_qkv(module: nn.Module, sizes: list[int]) -> nn.Module:
    """The attention module's merged linear whose pieces are q, k and v (found by their sizes)."""
    found = [child for child in module.children() if list(getattr(child, "output_sizes", [])) == sizes]
    if len(found) != 1:
        raise ValueError(f"{_model_name(module)}: expected one merged q/k/v linear with output_sizes={sizes}")
    return found[0]


class LocalHeadsParallel(TensorParallelLayer):
    """For the attention module holding `qkv_proj`: validate head counts, then make them this process's.

    The generated forward reshapes with `view(*shape, -1, head_dim)`, so it follows the local width by itself; what
    does not follow is `num_key_value_groups` (query heads per kv head, used by `repeat_kv`), which changes when kv
    heads are replicated. Runs before the merged linear is sharded (Transformers applies a plan parent first) and
    tells it how its pieces are counted in heads.
    """

    def install_forward(self, module: nn.Module, mesh) -> nn.Module:
        config = module.config
        heads = config.num_attention_heads
        kv_heads = getattr(config, "num_key_value_heads", None) or heads
        world_size = mesh.size()
        check_head_counts(_model_name(module), heads, kv_heads, world_size)
        qkv = _merged_qkv(module, _qkv_sizes(module, heads, kv_heads))
        qkv.tp_units = (heads, kv_heads, kv_heads)
        qkv.tp_replicable = (False, True, True)
        local_heads = heads // world_size
        local_kv_heads = kv_heads // world_size if kv_heads % world_size == 0 else 1
        module.num_key_value_groups = local_heads // local_kv_heads
        for attribute, value in (("num_heads", local_heads), ("num_key_value_heads", local_kv_heads)):
            if isinstance(getattr(module, attribute, None), int):
                setattr(module, attribute, value)
        return module


def _qkv_sizes(module: nn.Module, heads: int, kv_heads: int) -> list[int]:
    """[q, k, v] widths from the head counts and the module's head_dim (or the merged linear's q width / heads)."""
    head_dim = getattr(module, "head_dim", None)
    if not isinstance(head_dim, int):
        merged = next((c for c in module.children() if getattr(c, "output_sizes", None)), None)
        head_dim = merged.output_sizes[0] // heads if merged is not None else 0
    return [heads * head_dim, kv_heads * head_dim, kv_heads * head_dim]


def _mesh_group(mesh):
    return mesh.get_group() if mesh.ndim == 1 else mesh.get_group("tp")


class MergedColumnParallel(TensorParallelLayer):
    """Column parallel for a merged linear: each piece split on its own, by heads (q/k/v) or by rows (gate/up).

    The input arrives replicated, the output leaves local (this process's rows of each piece, in piece order), which
    is what the generated `split(output_sizes)` and the following row-parallel `o_proj`/`down_proj` expect. Parameters
    are DTensors (what Transformers loads and saves through) but the forward runs on their local tensors.
    """

    def should_use_local_tensors(self, module: nn.Module) -> bool:
        return True

    def shard_param(self, module: nn.Module, param: str, mesh) -> None:
        tensor = module._parameters.get(param)
        if tensor is None:
            return
        if getattr(module, "output_sizes", None) is None:  # a user's plan override naming a plain module
            raise ValueError(
                f"{_model_name(module)}: the {MERGED_COLWISE!r} rule cannot be honoured: {type(module).__name__} is "
                f"not a merged linear (it has no output_sizes to split piece by piece)"
            )
        partition = _partition(module, mesh)
        module._parameters[param] = nn.Parameter(
            _local_dtensor(tensor, partition, mesh), requires_grad=tensor.requires_grad
        )

    def transform_inputs_pre_forward(self, module, args, kwargs, mesh):
        from torch.distributed.tensor import DTensor, Replicate

        _hook_replicated_gradients(module, mesh)
        x = args[0]
        if isinstance(x, DTensor):
            x = x.redistribute(placements=[Replicate()]).to_local()
        # Each process back-propagates through its rows only, so the input's gradient is a sum over processes.
        x = _AllReduceBackward.apply(x, _mesh_group(mesh))
        return (x, *args[1:]), kwargs


def _hook_replicated_gradients(module: nn.Module, mesh) -> None:
    """Before a forward: give each parameter of a merged linear with replicated rows the summing gradient hook.

    Done at forward time, once per parameter object, because loading replaces the parameters built by `shard_param`.
    """
    partition = getattr(module, "tp_partition", None)
    if partition is None or partition.shard_on_read:
        return
    for parameter in module.parameters(recurse=False):
        if parameter.requires_grad and not getattr(parameter, "_fusegen_sums_replicated", False):
            parameter.register_hook(_replicated_rows_summed(partition, _mesh_group(mesh)))
            parameter._fusegen_sums_replicated = True


def _replicated_rows_summed(partition: RowPartition, group):
    """Gradient hook for a merged parameter with replicated kv heads: sum each kv head's gradient over the processes
    sharing it.

    Process r computes attention for its own query heads only, so its gradient for a kv head shared by the group
    `[g*N/KV, (g+1)*N/KV)` is that group member's part of the true gradient; without the sum each copy would be
    updated differently. One all-reduce over all processes of a buffer holding one slot per kv head (each process
    writes its slot, zeros elsewhere) sums within groups without creating process groups.
    """
    from torch.distributed.tensor import DTensor

    replicated = [
        (index, full // size)
        for index, (full, size) in enumerate(zip(partition.full_sizes, partition.sizes))
        if size * partition.world_size != full
    ]
    offsets = [sum(partition.sizes[:index]) for index in range(len(partition.sizes))]

    def hook(grad):
        local = grad.to_local() if isinstance(grad, DTensor) else grad
        local = local.clone()
        for index, slots in replicated:
            size, start = partition.sizes[index], partition.starts[index]
            rows = local.narrow(0, offsets[index], size)
            buffer = rows.new_zeros((slots, *rows.shape))
            buffer[start // size] = rows
            torch.distributed.all_reduce(buffer, group=group)
            rows.copy_(buffer[start // size])
        if isinstance(grad, DTensor):
            return DTensor.from_local(local, grad.device_mesh, grad.placements, run_check=False)
        return local

    return hook


def _partition(module: nn.Module, mesh) -> RowPartition:
    """This process's rows (computed once per module); also switches `output_sizes` to the local piece sizes."""
    world_size, rank = mesh.size(), mesh.get_local_rank()
    partition = getattr(module, "tp_partition", None)
    if partition is not None and (partition.world_size, partition.rank) == (world_size, rank):
        return partition
    if absent_bias_pieces(module):
        raise ValueError(
            f"{_model_name(module)}: tensor parallelism of a merged linear whose pieces differ in having a bias "
            f"(bias_pieces={module.bias_pieces}) is not supported; load the original class for tensor parallelism"
        )
    full_sizes = list(module.output_sizes)
    units = getattr(module, "tp_units", None) or full_sizes
    replicable = getattr(module, "tp_replicable", None) or [False] * len(full_sizes)
    partition = partition_rows(full_sizes, units, replicable, world_size, rank, what=_model_name(module))
    module.tp_partition = partition
    module.output_sizes[:] = partition.sizes  # in place: the owner's `<merged>_sizes` is this same list
    return partition


def _merged_row_shard_class():
    """`MergedRowShard`, defined on first use (torch.distributed may be unavailable when this module is imported)."""
    global _MERGED_ROW_SHARD
    if _MERGED_ROW_SHARD is not None:
        return _MERGED_ROW_SHARD
    import torch.distributed._functional_collectives as funcol
    from torch.distributed.tensor import Shard

    class MergedRowShard(Shard):
        """Placement of a merged linear's weight (or bias) under tensor parallelism: what each process really holds.

        The global tensor is the true merged weight `[p_0; p_1; ...]` (pieces of `full_sizes` rows, e.g. q, k, v);
        process r of N holds block r of every piece, stacked: `[p_0 block r; p_1 block r; ...]`. No built-in
        placement says that (`Shard(0)` would mean rows `[r*n, (r+1)*n)` of the merged tensor; `_StridedShard` only
        fits equal pieces), so gathering (`full_tensor()`, redistributing to `Replicate`, saving) re-orders the
        gathered blocks piece by piece; gradients and optimizer states share the parameter's placement.

        It compares equal to `Shard(0)` on purpose: DTensor validates shard placements against `Shard(dim)`, and
        Transformers' loader must read each checkpoint piece as `Shard(0)` (block r of q, of k, of v), which is
        exactly this layout. The hash differs, so DTensor's caches keep the two apart. Distributed checkpointing
        sees the canonical pieces instead, see `_canonical_state_dict`.
        """

        def __init__(self, full_sizes):
            super().__init__(0)
            self.full_sizes = tuple(int(size) for size in full_sizes)

        def __eq__(self, other):
            if type(other) is type(self):
                return other.full_sizes == self.full_sizes
            return type(other) is Shard and other.dim == self.dim

        def __hash__(self):
            return hash(("fusegen.MergedRowShard", self.full_sizes))

        def __repr__(self):
            return f"MergedRowShard(full_sizes={list(self.full_sizes)})"

        def _to_replicate_tensor(self, local_tensor, mesh, mesh_dim, current_logical_shape):
            count = mesh.size(mesh_dim=mesh_dim)
            gathered = funcol.all_gather_single(local_tensor.contiguous(), gather_dim=0, group=(mesh, mesh_dim))
            return _unblock(gathered, self.full_sizes, count)

    _MERGED_ROW_SHARD = MergedRowShard
    return MergedRowShard


_MERGED_ROW_SHARD = None


def _unblock(gathered: torch.Tensor, full_sizes: Sequence[int], world_size: int) -> torch.Tensor:
    """The processes' blocks one after the other (`[q0 k0 v0 q1 k1 v1]`) -> the merged tensor (`[q k v]`).

    Valid for evenly split pieces only (each process holds `full // N` rows of each), which is when
    `MergedRowShard` is used.
    """
    local_sizes = [size // world_size for size in full_sizes]
    blocks = [block.split(local_sizes, dim=0) for block in gathered.split(sum(local_sizes), dim=0)]
    return torch.cat([block[piece] for piece in range(len(local_sizes)) for block in blocks], dim=0)


def _local_dtensor(tensor: torch.Tensor, partition: RowPartition, mesh):
    """This process's rows as a DTensor whose placement says what it holds.

    Evenly split pieces: `MergedRowShard` (global view = the true merged tensor, so `full_tensor()` is it). Replicated
    kv heads (fewer kv heads than processes) are marked `Replicate`, which is exact for the kv rows but not for q;
    such models cannot be saved or checkpointed from several processes (refused in `PartitionedSplit`).
    A meta tensor (inside `from_pretrained`) becomes a meta placeholder of the local shape; a real one (already
    loaded) keeps its own rows.
    """
    from torch.distributed.tensor import DTensor, Replicate

    rows = sum(partition.sizes)
    if tensor.is_meta:
        local = torch.empty((rows, *tensor.shape[1:]), dtype=tensor.dtype, device="meta")
    else:
        local = torch.cat([tensor.detach().narrow(0, start, size) for start, size in partition.merged_rows()])
    if partition.shard_on_read:
        shape = (sum(partition.full_sizes), *tensor.shape[1:])
        placement = _merged_row_shard_class()(partition.full_sizes)
    else:
        shape, placement = tuple(local.shape), Replicate()
    stride = torch.empty(shape, device="meta").stride()
    return DTensor.from_local(local, mesh, [placement], run_check=False, shape=shape, stride=stride)


def _canonical_state_dict(module: nn.Module, state_dict: dict, prefix: str, local_metadata) -> None:
    """State-dict hook of a tensor-parallel merged linear: its tensors as the canonical pieces, each `Shard(0)`.

    Distributed checkpointing (torch.distributed.checkpoint) describes each process's data as one box of the
    global tensor, which the merged layout is not (block r of q, of k, of v). Each piece's block IS one box of the
    piece, so `dcp.save(model.state_dict())` writes the checkpoint's own q/k/v tensors, and `dcp.load` fills the
    pieces in place (they are views of the merged parameter). Only for evenly split, materialised parameters.
    """
    from torch.distributed.tensor import DTensor, Shard

    partition = getattr(module, "tp_partition", None)
    pieces = getattr(module, "tp_piece_names", None)
    if partition is None or not partition.shard_on_read or not pieces:
        return
    owner = prefix[:-1].rpartition(".")[0]
    for leaf in ("weight", "bias"):
        value = state_dict.get(prefix + leaf)
        if not isinstance(value, DTensor) or value.is_meta:
            continue
        local, offset = value.to_local(), 0
        del state_dict[prefix + leaf]
        for name, full, size in zip(pieces, partition.full_sizes, partition.sizes):
            view = local.narrow(0, offset, size)
            shape = (full, *local.shape[1:])
            state_dict[f"{owner}.{name}.{leaf}" if owner else f"{name}.{leaf}"] = DTensor.from_local(
                view,
                value.device_mesh,
                [Shard(0)],
                run_check=False,
                shape=shape,
                stride=torch.empty(shape, device="meta").stride(),
            )
            offset += size


def _merged_from_canonical(attribute, owner, state_dict, prefix, local_metadata, strict, missing, unexpected, errors):
    """Load-state-dict pre-hook of the module owning merged linear `attribute`, the inverse of
    `_canonical_state_dict`: canonical pieces are copied into their rows (registered on the owner because
    `load_state_dict` hands each module only the keys under its own prefix)."""
    module = getattr(owner, attribute, None)
    partition = getattr(module, "tp_partition", None)
    pieces = getattr(module, "tp_piece_names", None)
    if partition is None or not partition.shard_on_read or not pieces:
        return
    for leaf in ("weight", "bias"):
        keys = [f"{prefix}{name}.{leaf}" for name in pieces]
        if not all(key in state_dict for key in keys):
            continue
        parameter = getattr(module, leaf)
        with torch.no_grad():
            local, offset = parameter.to_local(), 0
            for key, size in zip(keys, partition.sizes):
                value = state_dict.pop(key)
                value = value.to_local() if hasattr(value, "to_local") else value
                rows = local.narrow(0, offset, size)
                if value.data_ptr() != rows.data_ptr():  # dcp.load into state_dict() views already wrote them
                    rows.copy_(value)
                offset += size
        state_dict[f"{prefix}{attribute}.{leaf}"] = parameter


def _register_canonical_hooks(model: nn.Module) -> None:
    """`_canonical_state_dict` on each merged linear, `_merged_from_canonical` on its owner (once per module)."""
    from functools import partial

    for path, module in model.named_modules():
        if getattr(module, "tp_piece_names", None) and not getattr(module, "_fusegen_tp_hooks", False):
            owner_path, _, attribute = path.rpartition(".")
            owner = model.get_submodule(owner_path) if owner_path else model
            module._register_state_dict_hook(_canonical_state_dict)
            owner._register_load_state_dict_pre_hook(partial(_merged_from_canonical, attribute), with_module=True)
            module._fusegen_tp_hooks = True


# --------------------------------------------------------------------------------------------------------------------
# Loading replicated kv heads
# --------------------------------------------------------------------------------------------------------------------


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


# --------------------------------------------------------------------------------------------------------------------
# Plans
# --------------------------------------------------------------------------------------------------------------------


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

    Heads (`*ForCausalLM`) need nothing: they collect their base model's plan, already fixed here. `tp_plan=None`
    means the generated file could not derive a plan; a tensor-parallel load is then refused by name.
    """
    PreTrainedModel.init_parallel_plans(model)
    if model.base_model is not model:
        return
    from .quant import prepare_quantized

    prepare_quantized(model)  # built here because this is the base model's build hook (no TP involved)
    requested = _tensor_parallel_requested(model.config)
    if tp_plan is None:
        if requested:
            raise ValueError(
                f"{type(model).__name__}: its generated file has no TP_PLAN (the comment above `TP_PLAN = None` "
                f"in {type(model).__module__} says why), so it cannot load with tp_plan"
            )
        model._tp_plan = {}
        return
    register_styles()
    model._tp_plan = fused_tp_plan(model._tp_plan or {}, model.config.base_model_tp_plan, tp_plan)
    if requested:
        stacked = getattr(sys.modules.get(type(model).__module__), "STACKED_PARAMS_MAPPING", None) or {}
        check_plan_honoured(model, tp_plan, stacked)
        use_partitioned_concatenate(type(model).__name__)
        for path, module in model.named_modules():  # modules have no path (linears no config) to name in errors
            module.tp_name = f"{_model_label(model.config)} ({path})"
            if getattr(module, "output_sizes", None) is not None:
                pieces = stacked.get(path.rpartition(".")[2])
                if pieces:  # canonical names for distributed checkpoints, see _canonical_state_dict
                    module.tp_piece_names = [
                        piece[0] if isinstance(piece, (tuple, list)) else piece for piece in pieces
                    ]
        _register_canonical_hooks(model)


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
    label = _model_label(config)
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
        wanted = _qkv_sizes(module, heads, kv_heads)
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


def fused_plan_from(
    original: Mapping[str, str] | None,
    stacked: Mapping[str, Sequence[tuple[str, Any]]],
    parents: Mapping[str, Sequence[str]] | None = None,
    heads: Collection[str] | None = None,
    kept: Collection[str] = (),
) -> tuple[dict[str, str] | None, str | None]:
    """Derive a generated file's `TP_PLAN` from the original config's `base_model_tp_plan`: `(plan, None)` or
    `(None, why not)`. Used by the compiler; kept here next to the styles it names.

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


# --------------------------------------------------------------------------------------------------------------------
# Packed q/k/v: checkpoints that already store the projections as one tensor (phi3, gpt2, gpt_bigcode)
# --------------------------------------------------------------------------------------------------------------------

PACKED_COLWISE = "fusegen_packed_colwise"
PACKED_ROWWISE = "fusegen_packed_rowwise"


class _LocalHeadsConfig:
    """The model's config as one process's attention module sees it: its own head counts, everything else live.

    Phi3Attention splits its packed output at `self.config.num_attention_heads * head_dim`, so under tensor
    parallelism the module must read the local count there. Attributes are forwarded on every read (not copied), so
    a later `set_attn_implementation` on the model's config is seen; only the overridden counts differ.
    """

    def __init__(self, config, **local):
        object.__setattr__(self, "_config", config)
        object.__setattr__(self, "_local", dict(local))

    def __getattr__(self, name):
        if name.startswith("__"):  # copy/pickle protocols: this object's own, never the wrapped config's
            raise AttributeError(name)
        local = object.__getattribute__(self, "_local")
        return local[name] if name in local else getattr(object.__getattribute__(self, "_config"), name)

    def __setattr__(self, name, value):
        setattr(object.__getattribute__(self, "_config"), name, value)


@dataclass(frozen=True)
class PackedAttention:
    """How one Transformers attention class packs q/k/v, read off its source (the soundness of the plan rests on it).

    `packed`/`output`: attribute names of the packed projection and of the output projection. `pieces(module)`:
    `(query heads, kv heads, pieces)`, the packed rows as pieces `(rows, units, replicable)` in row order, each cut
    into whole units (heads, or falcon's kv groups) over the processes. `localise(module, heads, kv_heads)` sets what
    the forward reads so it computes with this process's heads. A class not listed is refused: guessing a packed
    layout would return wrong numbers.
    """

    packed: str
    output: str
    pieces: Any
    localise: Any


def _phi3_pieces(module):
    heads, kv_heads, head_dim = module.config.num_attention_heads, module.num_key_value_heads, module.head_dim
    q, kv = (heads * head_dim, heads, False), (kv_heads * head_dim, kv_heads, True)
    return heads, kv_heads, [q, kv, kv]


def _phi3_localise(module, heads, kv_heads):
    # forward: q = qkv[..., : config.num_attention_heads * head_dim], k/v by self.num_key_value_heads
    module.config = _LocalHeadsConfig(module.config, num_attention_heads=heads, num_key_value_heads=kv_heads)
    module.num_key_value_heads, module.num_key_value_groups = kv_heads, heads // kv_heads


def _gpt2_pieces(module):
    if module.is_cross_attention:
        raise ValueError(f"{_model_name(module)}: cross-attention (q_attn + c_attn) has no packed-QKV plan")
    heads = module.num_heads
    return heads, heads, [(heads * module.head_dim, heads, False)] * 3


def _gpt2_localise(module, heads, kv_heads):
    # forward: q, k, v = c_attn(x).split(self.split_size), each viewed as (-1, head_dim)
    module.num_heads, module.split_size = heads, heads * module.head_dim


def _bigcode_pieces(module):
    if module.is_cross_attention:
        raise ValueError(f"{_model_name(module)}: cross-attention (q_attn + c_attn) has no packed-QKV plan")
    heads, head_dim = module.num_heads, module.head_dim
    if module.multi_query:  # [q (all heads); k (1 head); v (1 head)]
        return heads, 1, [(heads * head_dim, heads, False), (head_dim, 1, True), (head_dim, 1, True)]
    return heads, heads, [(heads * 3 * head_dim, heads, False)]  # per head [q_h k_h v_h]: view(num_heads, 3 * d)


def _bigcode_localise(module, heads, kv_heads):
    # forward (multi_query): split((embed_dim, kv_dim, kv_dim)); else view(num_heads, 3 * head_dim)
    module.num_heads = heads
    module.embed_dim = heads * module.head_dim
    module.num_key_value_groups = heads // kv_heads if module.multi_query else 1


def _falcon_pieces(module):
    if module.config.alibi:  # FalconModel builds the slopes for all heads; the attention views them per local head
        raise ValueError(f"{_model_name(module)}: alibi is built for all heads by the model; no packed-QKV plan")
    heads, head_dim = module.num_heads, module.head_dim
    if module.new_decoder_architecture:  # per kv group [q_g (H/KV heads); k_g; v_g]: view(-1, H/KV + 2, head_dim)
        kv_heads = module.num_kv_heads
        return heads, kv_heads, [(kv_heads * (heads // kv_heads + 2) * head_dim, kv_heads, False)]
    if module.multi_query:  # [q (all heads); k; v]: view(num_heads + 2, head_dim)
        return heads, 1, [(heads * head_dim, heads, False), (head_dim, 1, True), (head_dim, 1, True)]
    return heads, heads, [(heads * 3 * head_dim, heads, False)]  # per head [q_h k_h v_h]: view(num_heads, 3, d)


def _falcon_localise(module, heads, kv_heads):
    # _split_heads and forward read self.num_heads, and self.num_kv_heads unless multi_query (then 1 kv head)
    module.num_heads = heads
    if module.new_decoder_architecture or not module.multi_query:
        module.num_kv_heads = kv_heads


PACKED_ATTENTION = {
    "transformers.models.phi3.modeling_phi3.Phi3Attention": PackedAttention(
        "qkv_proj", "o_proj", _phi3_pieces, _phi3_localise
    ),
    "transformers.models.gpt2.modeling_gpt2.GPT2Attention": PackedAttention(
        "c_attn", "c_proj", _gpt2_pieces, _gpt2_localise
    ),
    "transformers.models.gpt_bigcode.modeling_gpt_bigcode.GPTBigCodeAttention": PackedAttention(
        "c_attn", "c_proj", _bigcode_pieces, _bigcode_localise
    ),
    "transformers.models.falcon.modeling_falcon.FalconAttention": PackedAttention(
        "query_key_value", "dense", _falcon_pieces, _falcon_localise
    ),
}


def _class_key(module: nn.Module) -> str:
    return f"{type(module).__module__}.{type(module).__qualname__}"


def _is_conv1d(module: nn.Module) -> bool:
    """Transformers' `Conv1D` (GPT-2 style): weight is (in, out), the transpose of `nn.Linear`'s."""
    return type(module).__name__ == "Conv1D" and hasattr(module, "nf")


def _keep_output_rows(linear: nn.Module, rows: list[tuple[int, int]]) -> None:
    """Cut a projection to the given output rows, in order (`nn.Linear`: weight rows; `Conv1D`: weight columns)."""
    conv1d = _is_conv1d(linear)
    with torch.no_grad():
        for leaf in ("weight", "bias"):
            tensor = getattr(linear, leaf, None)
            if tensor is None:
                continue
            dim = 1 if conv1d and leaf == "weight" else 0
            local = torch.cat([tensor.narrow(dim, start, size) for start, size in rows], dim=dim).contiguous()
            setattr(linear, leaf, nn.Parameter(local, requires_grad=tensor.requires_grad))
    width = sum(size for _, size in rows)
    if conv1d:
        linear.nf = width
    else:
        linear.out_features = width


class _SumOverProcesses(torch.autograd.Function):
    """All-reduce sum forward, identity backward (a row-parallel projection's output).

    The sum is replicated and every process computes the same loss from it, so each process's partial product
    receives the output's gradient unchanged; summing it again (as `torch.distributed.nn.all_reduce` does) would
    make every gradient N times too large.
    """

    @staticmethod
    def forward(ctx, partial, group):
        torch.distributed.all_reduce(partial, group=group)
        return partial

    @staticmethod
    def backward(ctx, grad):
        return grad, None


def _row_parallel_forward(linear: nn.Module, columns: tuple[int, int], group):
    """Make `linear` row parallel: it keeps the input columns `columns` (this process's heads), multiplies its
    local input by them, sums the partial products over the processes and adds the bias once, after the sum."""
    conv1d = _is_conv1d(linear)
    start, size = columns
    with torch.no_grad():
        weight = linear.weight.narrow(0 if conv1d else 1, start, size).contiguous()
    linear.weight = nn.Parameter(weight, requires_grad=linear.weight.requires_grad)
    if not conv1d:
        linear.in_features = size

    def forward(x):
        partial = x @ linear.weight if conv1d else nn.functional.linear(x, linear.weight)
        total = _SumOverProcesses.apply(partial, group)
        return total if linear.bias is None else total + linear.bias

    linear.forward = forward


def _column_parallel_input(linear: nn.Module, group) -> None:
    """Each process computes its rows only, so the input's gradient is the sum over processes."""

    def sum_gradients(module, args):
        if not torch.is_grad_enabled():
            return None
        return (_AllReduceBackward.apply(args[0], group), *args[1:])

    linear.register_forward_pre_hook(sum_gradients)


def apply_packed_tp_plan(model: nn.Module, group=None) -> dict[str, str]:
    """Shard every packed q/k/v attention of an ORIGINAL Transformers model over the processes of `group`, in place.

    For each attention module of a class in `PACKED_ATTENTION`: the packed projection keeps this process's rows of
    each piece (its query heads, and its kv heads, or the one kv head its query heads read when there are fewer kv
    heads than processes), the module's head counts become the local ones, and the output projection becomes row
    parallel (its input columns for this process's query heads, partial products summed over the processes, bias
    added once). Everything else stays replicated. Returns the plan applied: module path -> style.

    Head counts N cannot share raise `ValueError` naming the model, the counts and N before anything is changed;
    so does a model with no packed attention (nothing would be sharded) and an attention class not listed.
    The model must be loaded (real tensors, e.g. `Phi3ForCausalLM.from_pretrained(path)` on every process).
    """
    import torch.distributed as dist

    found = [(path, module) for path, module in model.named_modules() if _class_key(module) in PACKED_ATTENTION]
    if not found:
        raise ValueError(
            f"{_model_label(getattr(model, 'config', None))}: no attention module of a packed-QKV class "
            f"({', '.join(key.rpartition('.')[2] for key in PACKED_ATTENTION)}); nothing to shard"
        )
    layouts = []
    for path, module in found:  # every check before the first change; these need no process group
        layout = PACKED_ATTENTION[_class_key(module)]
        if getattr(module, "tp_partition", None) is not None:
            raise ValueError(f"{_model_label(getattr(model, 'config', None))} ({path}) is already sharded")
        if getattr(module, layout.packed).weight.is_meta:
            raise ValueError(f"{path}.{layout.packed} is on the meta device; load the model before sharding it")
        module.tp_name = f"{_model_label(getattr(model, 'config', None))} ({path})"
        layouts.append((path, module, layout, *layout.pieces(module)))
    world_size, rank = dist.get_world_size(group), dist.get_rank(group)
    partitions = []
    for path, module, layout, heads, kv_heads, pieces in layouts:
        check_head_counts(module.tp_name, heads, kv_heads, world_size)
        rows, units, replicable = zip(*pieces)
        partition = partition_rows(rows, units, replicable, world_size, rank, what=module.tp_name)
        if not partition.shard_on_read and _is_conv1d(getattr(module, layout.packed)):
            # the gradient hook for replicated kv heads sums rows along dim 0; a Conv1D weight holds them along dim 1
            raise ValueError(f"{module.tp_name}: replicated kv heads in a Conv1D projection are not supported")
        partitions.append((path, module, layout, heads, kv_heads, partition))
    plan = {}
    for path, module, layout, heads, kv_heads, partition in partitions:
        local_heads = heads // world_size
        local_kv = kv_heads // world_size if kv_heads % world_size == 0 else 1
        packed, output = getattr(module, layout.packed), getattr(module, layout.output)
        head_dim = module.head_dim
        _keep_output_rows(packed, partition.merged_rows())
        _column_parallel_input(packed, group)
        if not partition.shard_on_read:  # replicated kv heads: each sharing process holds part of their gradient
            for parameter in packed.parameters(recurse=False):
                if parameter.requires_grad:
                    parameter.register_hook(_replicated_rows_summed(partition, group))
        _row_parallel_forward(output, (rank * local_heads * head_dim, local_heads * head_dim), group)
        layout.localise(module, local_heads, local_kv)
        module.tp_partition = partition
        plan[f"{path}.{layout.packed}"] = PACKED_COLWISE
        plan[f"{path}.{layout.output}"] = PACKED_ROWWISE
    return plan
