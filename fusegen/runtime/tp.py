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

Loading reads only each process's slices where the layout allows: Transformers' shard-on-read slices every checkpoint
tensor by the placement of the parameter it feeds, one piece at a time, so a `Shard(0)` merged parameter gets exactly
rows `[r*n, (r+1)*n)` of q, of k and of v. Replicated kv heads cannot be expressed as a placement; such a `qkv_proj`
is read whole (one layer at a time) and `PartitionedConcatenate` keeps this process's rows.

This module is imported when a fused model is first built, not when a generated file is imported.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
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

        x = args[0]
        if isinstance(x, DTensor):
            x = x.redistribute(placements=[Replicate()]).to_local()
        # Each process back-propagates through its rows only, so the input's gradient is a sum over processes.
        x = _AllReduceBackward.apply(x, _mesh_group(mesh))
        return (x, *args[1:]), kwargs


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
    module.output_sizes = list(partition.sizes)
    return partition


def _local_dtensor(tensor: torch.Tensor, partition: RowPartition, mesh):
    """This process's rows as a DTensor: `Shard(0)` when the loader can read them by placement, else `Replicate`.

    A meta tensor (inside `from_pretrained`) becomes a meta placeholder of the local shape; a real one (already loaded)
    keeps its own rows. The `Shard(0)` DTensor's global view stacks the processes' blocks ([q0 k0 v0 q1 k1 v1]), not
    the checkpoint's [q k v]: only its local tensor and its placement (for reading) are used.
    """
    from torch.distributed.tensor import DTensor, Replicate, Shard

    rows = sum(partition.sizes)
    if tensor.is_meta:
        local = torch.empty((rows, *tensor.shape[1:]), dtype=tensor.dtype, device="meta")
    else:
        local = torch.cat([tensor.detach().narrow(0, start, size) for start, size in partition.merged_rows()])
    if partition.shard_on_read:
        shape = (rows * partition.world_size, *tensor.shape[1:])
        placement = Shard(0)
    else:
        shape, placement = tuple(local.shape), Replicate()
    stride = torch.empty(shape, device="meta").stride()
    return DTensor.from_local(local, mesh, [placement], run_check=False, shape=shape, stride=stride)


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

    Transformers gathers each DTensor before saving; a `Shard(0)` merged parameter then arrives as the processes'
    blocks one after the other ([q0 k0 v0 q1 k1 v1]), which this reassembles into the checkpoint's q, k and v.
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
        blocks = [block.split(partition.sizes, dim=self.dim) for block in tensor.split(sum(partition.sizes), self.dim)]
        pieces = [torch.cat([block[i] for block in blocks], dim=self.dim) for i in range(len(partition.sizes))]
        return dict(zip(target_patterns, pieces))

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
        for path, module in model.named_modules():  # merged linears have no config to name the model in errors
            if getattr(module, "output_sizes", None) is not None:
                module.tp_name = f"{_model_label(model.config)} ({path})"


def fused_plan_from(
    original: Mapping[str, str] | None,
    stacked: Mapping[str, Sequence[tuple[str, Any]]],
    parents: Mapping[str, Sequence[str]] | None = None,
) -> tuple[dict[str, str] | None, str | None]:
    """Derive a generated file's `TP_PLAN` from the original config's `base_model_tp_plan`: `(plan, None)` or
    `(None, why not)`. Used by the compiler; kept here next to the styles it names.

    Each merged linear takes one `fusegen_merged_colwise` rule where all of its pieces had `colwise` ones (a q/k/v
    merge also gets `fusegen_local_heads` on its owner); other rules are kept. Pieces with any other style (e.g.
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
        if [shard for _, shard in pieces] == ["q", "k", "v"] and owner:
            plan.setdefault(owner, LOCAL_HEADS)
        plan.setdefault(f"{owner}.{merged}" if owner else merged, MERGED_COLWISE)
    return plan, None
