"""The parallel styles of fused models: `LocalHeadsParallel` on an attention module, `MergedColumnParallel` on each
merged linear, the merged parameters' placement (`MergedRowShard`) and the canonical state-dict hooks.

`LocalHeadsParallel` checks the head counts against the number of processes N, raising a `ValueError` that names the
model, the sizes and N, and sets the module's head counts to this process's. `MergedColumnParallel` replaces the
merged weight and bias by this process's rows of each piece, sets `output_sizes` to the local piece sizes (the
generated forward splits by it), and keeps inputs and outputs local. `MergedRowShard` says what each process holds
(its rows of every piece), so `full_tensor()`, gradients and saving see the true merged weight;
`model.state_dict()` lists the canonical pieces as `Shard(0)` DTensors for distributed checkpointing
(`_canonical_state_dict`).
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
from torch import nn
from transformers.distributed.tensor_parallel import TensorParallelLayer

try:  # Transformers >= 5.21 keeps the style registry in parallel_utils, 5.20 in tensor_parallel
    from transformers.distributed.parallel_utils import _AllReduceBackward
except ImportError:
    from transformers.distributed.tensor_parallel import _AllReduceBackward

from ..linear import absent_bias_pieces
from .partition import RowPartition, check_head_counts, partition_rows

MERGED_COLWISE = "fusegen_merged_colwise"


MLA_KV_A = "mla_kv_a_proj"
"""Transformers' style for MLA's kv_a_proj_with_mqa: replicated, rope columns' gradient all-reduced."""


LOCAL_HEADS = "fusegen_local_heads"


def model_label(config) -> str:
    return getattr(config, "_name_or_path", "") or getattr(config, "model_type", "") or "model"


def model_name(module: nn.Module) -> str:
    """What error messages call the model: its checkpoint path (or model type) and the module's class or path."""
    if getattr(module, "tp_name", None):
        return module.tp_name
    return f"{model_label(getattr(module, 'config', None))} ({type(module).__name__})"


def _merged_qkv(module: nn.Module, sizes: list[int]) -> nn.Module:
    """The attention module's merged linear whose pieces are q, k and v (found by their sizes)."""
    found = [child for child in module.children() if list(getattr(child, "output_sizes", [])) == sizes]
    if len(found) != 1:
        raise ValueError(f"{model_name(module)}: expected one merged q/k/v linear with output_sizes={sizes}")
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
        check_head_counts(model_name(module), heads, kv_heads, world_size)
        qkv = _merged_qkv(module, qkv_sizes(module, heads, kv_heads))
        qkv.tp_units = (heads, kv_heads, kv_heads)
        qkv.tp_replicable = (False, True, True)
        local_heads = heads // world_size
        local_kv_heads = kv_heads // world_size if kv_heads % world_size == 0 else 1
        module.num_key_value_groups = local_heads // local_kv_heads
        for attribute, value in (("num_heads", local_heads), ("num_key_value_heads", local_kv_heads)):
            if isinstance(getattr(module, attribute, None), int):
                setattr(module, attribute, value)
        return module


def qkv_sizes(module: nn.Module, heads: int, kv_heads: int) -> list[int]:
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
                f"{model_name(module)}: the {MERGED_COLWISE!r} rule cannot be honoured: {type(module).__name__} is "
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
            parameter.register_hook(replicated_rows_summed(partition, _mesh_group(mesh)))
            parameter._fusegen_sums_replicated = True


def replicated_rows_summed(partition: RowPartition, group):
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
            f"{model_name(module)}: tensor parallelism of a merged linear whose pieces differ in having a bias "
            f"(bias_pieces={module.bias_pieces}) is not supported; load the original class for tensor parallelism"
        )
    full_sizes = list(module.output_sizes)
    units = getattr(module, "tp_units", None) or full_sizes
    replicable = getattr(module, "tp_replicable", None) or [False] * len(full_sizes)
    partition = partition_rows(full_sizes, units, replicable, world_size, rank, what=model_name(module))
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


def register_canonical_hooks(model: nn.Module) -> None:
    """`_canonical_state_dict` on each merged linear, `_merged_from_canonical` on its owner (once per module)."""
    from functools import partial

    for path, module in model.named_modules():
        if getattr(module, "tp_piece_names", None) and not getattr(module, "_fusegen_tp_hooks", False):
            owner_path, _, attribute = path.rpartition(".")
            owner = model.get_submodule(owner_path) if owner_path else model
            module._register_state_dict_hook(_canonical_state_dict)
            owner._register_load_state_dict_pre_hook(partial(_merged_from_canonical, attribute), with_module=True)
            module._fusegen_tp_hooks = True
