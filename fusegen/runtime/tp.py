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

from .checkpoint import MergedColumnConcatenate, MergedColumnSplit, _find_merged_linear, _tensors_of

MERGED_COLWISE = "fusegen_merged_colwise"
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
            parameter.register_hook(_replicated_rows_summed(partition, mesh))
            parameter._fusegen_sums_replicated = True


def _replicated_rows_summed(partition: RowPartition, mesh):
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
            torch.distributed.all_reduce(buffer, group=_mesh_group(mesh))
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
        merged = _find_merged_linear(model, full_layer_name)
        partition = getattr(merged, "tp_partition", None)
        if partition is not None and not partition.shard_on_read:
            present = [pattern for pattern in source_patterns if pattern in input_dict]
            if len(present) == len(partition.sizes):
                input_dict = {
                    pattern: [tensor.narrow(self.dim, start, size) for tensor in _tensors_of(input_dict[pattern])]
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
        merged = _find_merged_linear(model, head + source_patterns[0] + tail) if found else None
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
        tensor = _tensors_of(next(iter(input_dict.values())))[0]
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
        use_partitioned_concatenate(type(model).__name__)
        stacked = getattr(sys.modules.get(type(model).__module__), "STACKED_PARAMS_MAPPING", None) or {}
        for path, module in model.named_modules():  # merged linears have no config to name the model in errors
            if getattr(module, "output_sizes", None) is not None:
                module.tp_name = f"{_model_label(model.config)} ({path})"
                pieces = stacked.get(path.rpartition(".")[2])
                if pieces:  # canonical names for distributed checkpoints, see _canonical_state_dict
                    module.tp_piece_names = [
                        piece[0] if isinstance(piece, (tuple, list)) else piece for piece in pieces
                    ]
        _register_canonical_hooks(model)


def fused_plan_from(
    original: Mapping[str, str] | None,
    stacked: Mapping[str, Sequence[tuple[str, Any]]],
    parents: Mapping[str, Sequence[str]] | None = None,
    heads: Collection[str] | None = None,
) -> tuple[dict[str, str] | None, str | None]:
    """Derive a generated file's `TP_PLAN` from the original config's `base_model_tp_plan`: `(plan, None)` or
    `(None, why not)`. Used by the compiler; kept here next to the styles it names.

    Each merged linear takes one `fusegen_merged_colwise` rule where all of its pieces had `colwise` ones (a merge
    of attention heads also gets `fusegen_local_heads` on its owner: the merged names in `heads`, which the
    compiler takes from the fusion kinds; without it, a merge whose shard ids are q, k, v); other rules are kept. Pieces with any other style (e.g.
    `colwise_gather_output`) cannot be merged this way, and then no plan is derived.
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
        pieces = stacked[merged]
        styles = {original.get(f"{owner}.{name}" if owner else name) for name, _ in pieces}
        if styles != {"colwise"}:
            return None, f"{key} is {style!r}; fusegen merges only pieces that are all 'colwise'"
        head_sharded = merged in heads if heads is not None else [shard for _, shard in pieces] == ["q", "k", "v"]
        if head_sharded and owner:
            plan.setdefault(owner, LOCAL_HEADS)
        plan.setdefault(f"{owner}.{merged}" if owner else merged, MERGED_COLWISE)
    return plan, None
