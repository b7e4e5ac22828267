"""The parallel styles of fused models: `LocalHeadsParallel` on an attention module, `MergedColumnParallel` on each
merged linear, and the merged parameters' placement (`MergedRowShard`, `describe_loaded`).

`LocalHeadsParallel` checks the head counts against the number of processes N, raising a `ValueError` that names the
model, the sizes and N, and sets the module's head counts to this process's. `MergedColumnParallel` replaces the
merged weight and bias by this process's rows of each piece, sets `output_sizes` to the local piece sizes (the
generated forward splits by it), and keeps inputs and outputs local. `MergedRowShard` says what each process holds
(its rows of every piece, kv heads replicated over processes included), so `full_tensor()`, redistributing,
gradients and saving see the true merged weight; `model.state_dict()` lists the canonical pieces for distributed
checkpointing (`fusegen.runtime.distributed`, for every DTensor placement).
"""

from __future__ import annotations

import torch
from torch import nn
from transformers.distributed.tensor_parallel import TensorParallelLayer

try:  # Transformers >= 5.21 keeps the style registry in parallel_utils, 5.20 in tensor_parallel
    from transformers.distributed.parallel_utils import _AllReduceBackward
except ImportError:
    from transformers.distributed.tensor_parallel import _AllReduceBackward

from ..layout import require_contiguous
from ..linear import absent_bias_pieces
from .partition import RowPartition, check_head_counts, dtensor_chunk, partition_rows
from .spec_equality import keep_merged_specs_apart

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
        require_contiguous(module, f"{model_name(module)}: tensor parallelism ({MERGED_COLWISE})")
        partition = _partition(module, mesh)
        module._parameters[param] = nn.Parameter(
            _local_dtensor(module, tensor, partition, mesh), requires_grad=tensor.requires_grad
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
    if partition is None or not any(partition.replicated):
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
        for index, (full, size, shared) in enumerate(zip(partition.full_sizes, partition.sizes, partition.replicated))
        if shared
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
            return DTensor.from_local(
                local, grad.device_mesh, grad.placements, run_check=False, shape=grad.shape, stride=grad.stride()
            )
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
    module.tp_layout = tuple(  # every process's partition: what the placement records (`merged_row_shard`)
        partition_rows(full_sizes, units, replicable, world_size, other, what=model_name(module))
        for other in range(world_size)
    )
    module.output_sizes[:] = partition.sizes  # in place: the owner's `<merged>_sizes` is this same list
    return partition


def _merged_row_shard_class():
    """`MergedRowShard`, defined on first use (torch.distributed may be unavailable when this module is imported)."""
    global _MERGED_ROW_SHARD
    if _MERGED_ROW_SHARD is not None:
        return _MERGED_ROW_SHARD
    import torch.distributed._functional_collectives as funcol
    from torch.distributed.tensor import Shard

    keep_merged_specs_apart()

    class MergedRowShard(Shard):
        """Placement of a merged linear's weight (or bias) under tensor parallelism: what each process really holds.

        The global tensor is the true merged weight `[p_0; p_1; ...]` (pieces of `full_sizes` rows, e.g. q, k, v);
        process r holds, stacked, `sizes[r][i]` rows of each piece i from row `starts[r][i]` of that piece: block r
        of q, and block r of k and v, or, with fewer kv heads than processes, the kv head its query heads read (the
        same rows on the N/KV processes sharing it); for gate/up pieces that do not divide by N, DTensor's block r
        of each (ceil(rows/N) rows, the last ones fewer), so processes hold different row counts. No built-in
        placement says that (`Shard(0)` would mean rows `[r*n, (r+1)*n)` of the merged tensor; `_StridedShard` only
        fits equal pieces), so gathering (`full_tensor()`, redistributing to `Replicate`) puts each piece together
        from the processes' blocks, each row taken once (`assemble`), and going back to this placement keeps each
        process's rows (`select_local`). Gradients and optimizer states share the parameter's placement.

        It compares equal to `Shard(0)` on purpose: DTensor validates shard placements against `Shard(dim)`, and
        Transformers' loader must read each checkpoint piece as `Shard(0)` (block r of q, of k, of v, of gate, of
        up), which is exactly this layout when every piece is split as `Shard(0)` splits it (`chunked_pieces`). A
        merged linear with replicated kv heads is read whole instead, as `Replicate`, and takes this placement once
        loaded (`describe_loaded`). Its hash is its row layout's, unlike `Shard(0)`'s, and a `DTensorSpec` holding
        it equals only a spec holding the same row layout (`spec_equality`, installed below): DTensor's sharding
        caches, keyed by specs, never hand one tensor's result to the other. Distributed checkpoints see the
        canonical pieces (`fusegen.runtime.distributed`).
        """

        def __init__(self, full_sizes, sizes, starts):
            """`sizes`: every process's piece sizes (one tuple per process), or one tuple shared by all."""
            super().__init__(0)
            self.full_sizes = tuple(int(size) for size in full_sizes)
            self.starts = tuple(tuple(int(start) for start in rank) for rank in starts)
            per_rank = len(sizes) and isinstance(sizes[0], (tuple, list))
            rank_sizes = sizes if per_rank else [sizes] * len(self.starts)
            self.sizes = tuple(tuple(int(size) for size in rank) for rank in rank_sizes)
            if len(self.sizes) != len(self.starts):
                raise ValueError(f"{len(self.sizes)} processes' sizes for {len(self.starts)} processes' starts")

        def __eq__(self, other):
            if type(other) is type(self):
                return (other.full_sizes, other.sizes, other.starts) == (self.full_sizes, self.sizes, self.starts)
            return type(other) is Shard and other.dim == self.dim

        def __hash__(self):
            return hash(("fusegen.MergedRowShard", *self.row_layout))

        @property
        def row_layout(self):
            """The pieces and every rank's rows: what `DTensorSpec` equality also compares (`spec_equality`)."""
            return self.full_sizes, self.sizes, self.starts

        def __repr__(self):
            return f"MergedRowShard(full_sizes={list(self.full_sizes)}, sizes={[list(s) for s in self.sizes]})"

        @property
        def chunked_pieces(self) -> bool:
            """Process r holds its `Shard(0)` block of every piece (`dtensor_chunk`: N equal blocks, or ceil-sized
            ones with shorter last ones), so its rows of piece i are a `Shard(0)` DTensor's local tensor."""
            world_size = len(self.starts)
            return all(
                (starts[i], self.sizes[rank][i]) == dtensor_chunk(full, world_size, rank)
                for rank, starts in enumerate(self.starts)
                for i, full in enumerate(self.full_sizes)
            )

        def local_rows(self, rank: int) -> int:
            """How many rows process `rank` holds."""
            return sum(self.sizes[rank])

        def select_local(self, full: torch.Tensor, rank: int) -> torch.Tensor:
            """Process `rank`'s rows of the whole merged tensor `full`."""
            offsets = [sum(self.full_sizes[:i]) for i in range(len(self.full_sizes))]
            rows = zip(offsets, self.starts[rank], self.sizes[rank])
            return torch.cat([full.narrow(0, offset + start, size) for offset, start, size in rows])

        def assemble(self, blocks) -> torch.Tensor:
            """The whole merged tensor from every process's local tensor (`blocks[r]`), each row taken once."""
            pieces = []
            for i, full in enumerate(self.full_sizes):
                found = {}
                for rank, block in enumerate(blocks):
                    if self.sizes[rank][i]:
                        found.setdefault(self.starts[rank][i], block.split(list(self.sizes[rank]), dim=0)[i])
                covered = 0
                for start in sorted(found):  # the blocks must tile the piece: each row once, none missing
                    if start != covered:
                        break
                    covered += found[start].shape[0]
                if covered != full or sum(found[start].shape[0] for start in found) != full:
                    raise ValueError(f"{self!r}: the processes' rows do not cover piece {i} ({sorted(found)})")
                pieces.extend(found[start] for start in sorted(found))
            return torch.cat(pieces, dim=0)

        def _to_replicate_tensor(self, local_tensor, mesh, mesh_dim, current_logical_shape):
            count = mesh.size(mesh_dim=mesh_dim)
            rows = [self.local_rows(rank) for rank in range(count)]
            local = local_tensor.contiguous()
            if local.shape[0] < max(rows):  # all-gather needs equal blocks: pad, then cut each block to its rows
                pad = local.new_zeros((max(rows) - local.shape[0], *local.shape[1:]))
                local = torch.cat([local, pad])
            gathered = funcol.all_gather_single(local, gather_dim=0, group=(mesh, mesh_dim))
            blocks = [block.narrow(0, 0, n) for block, n in zip(gathered.chunk(count, dim=0), rows)]
            return self.assemble(blocks)

        def _replicate_to_shard(self, local_tensor, mesh, mesh_dim, shard_index):
            return self.select_local(local_tensor, int(shard_index)).clone()

    _MERGED_ROW_SHARD = MergedRowShard
    return MergedRowShard


_MERGED_ROW_SHARD = None


def merged_row_shard(module: nn.Module):
    """The honest placement of `module`'s (a tensor-parallel merged linear's) parameters."""
    partition = module.tp_partition
    layout = module.tp_layout
    return _merged_row_shard_class()(partition.full_sizes, [p.sizes for p in layout], [p.starts for p in layout])


def _local_dtensor(module: nn.Module, tensor: torch.Tensor, partition: RowPartition, mesh):
    """This process's rows as a DTensor whose placement says what it holds.

    Pieces split as `Shard(0)` splits them (equal blocks, or DTensor's ceil-sized blocks of a piece of rows that does
    not divide by N): `MergedRowShard` (global view = the true merged tensor, so `full_tensor()` is it). Replicated
    kv heads (fewer kv heads than processes) are marked `Replicate` while Transformers loads them (so it reads the
    pieces whole, see `PartitionedConcatenate`) and take their `MergedRowShard` when loading is done
    (`describe_loaded`).
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
        placement = merged_row_shard(module)
    else:  # read whole: labelled Replicate while Transformers loads it, then `describe_loaded`
        shape, placement = tuple(local.shape), Replicate()
    stride = torch.empty(shape, device="meta").stride()
    return DTensor.from_local(local, mesh, [placement], run_check=False, shape=shape, stride=stride)


def describe_loaded(model: nn.Module) -> None:
    """After a tensor-parallel load: merged parameters read whole (replicated kv heads, labelled `Replicate` for
    Transformers' loader) take their honest `MergedRowShard`, whose global tensor is the true merged weight."""
    from torch.distributed.tensor import DTensor, Replicate

    for module in model.modules():
        partition = getattr(module, "tp_partition", None)
        if partition is None or partition.shard_on_read or getattr(module, "tp_layout", None) is None:
            continue
        placement = merged_row_shard(module)
        for leaf in ("weight", "bias"):
            parameter = module._parameters.get(leaf)
            if not isinstance(parameter, DTensor) or list(parameter.placements) != [Replicate()]:
                continue
            local = parameter.to_local()
            shape = (sum(partition.full_sizes), *local.shape[1:])
            stride = torch.empty(shape, device="meta").stride()
            honest = DTensor.from_local(local, parameter.device_mesh, [placement], run_check=False, shape=shape,
                                        stride=stride)  # fmt: skip
            relabelled = nn.Parameter(honest, requires_grad=parameter.requires_grad)
            relabelled.__dict__.update(parameter.__dict__)  # Transformers' flags (`_is_hf_initialized`: loaded)
            module._parameters[leaf] = relabelled
