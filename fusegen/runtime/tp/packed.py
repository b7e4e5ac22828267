"""Packed q/k/v: checkpoints that already store the projections as one tensor (phi3, gpt2, gpt_bigcode, falcon).
How each original class packs its rows is written down per class (`PACKED_ATTENTION`); `apply_packed_tp_plan` shards
such a model by heads. A generated class whose packed linear declares its row layout (`fusegen.fusions.packed_qkv`)
is sharded by that layout: whole kv groups (or heads) per process for a grouped layout, q by query heads and k/v by
kv heads for a contiguous one, checked against its original class's entry; its packed linear then declares this
process's layout. No generated file imports this module."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

try:  # Transformers >= 5.21 keeps the style registry in parallel_utils, 5.20 in tensor_parallel
    from transformers.distributed.parallel_utils import _AllReduceBackward
except ImportError:
    from transformers.distributed.tensor_parallel import _AllReduceBackward

from ..auto import original_class
from ..layout import RowLayout, layout_of
from .partition import check_head_counts, partition_rows
from .styles import model_label, model_name, replicated_rows_summed

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
        raise ValueError(f"{model_name(module)}: cross-attention (q_attn + c_attn) has no packed-QKV plan")
    heads = module.num_heads
    return heads, heads, [(heads * module.head_dim, heads, False)] * 3


def _gpt2_localise(module, heads, kv_heads):
    # forward: q, k, v = c_attn(x).split(self.split_size), each viewed as (-1, head_dim)
    module.num_heads, module.split_size = heads, heads * module.head_dim


def _bigcode_pieces(module):
    if module.is_cross_attention:
        raise ValueError(f"{model_name(module)}: cross-attention (q_attn + c_attn) has no packed-QKV plan")
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
        raise ValueError(f"{model_name(module)}: alibi is built for all heads by the model; no packed-QKV plan")
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


def packed_entry(module: nn.Module) -> PackedAttention | None:
    """The `PACKED_ATTENTION` entry of `module`'s class, or of the original class a generated class copies when its
    packed linear declares its row layout (`fusegen.fusions.packed_qkv` rewrites only the constructor, so the
    forward, and what `localise` sets, is the original's); None for any other module."""
    entry = PACKED_ATTENTION.get(_class_key(module))
    if entry is not None:
        return entry
    original = original_class(type(module))
    entry = PACKED_ATTENTION.get(f"{original.__module__}.{original.__qualname__}") if original is not None else None
    if entry is None or getattr(getattr(module, entry.packed, None), "row_layout", None) is None:
        return None
    return entry


def _pieces(module: nn.Module, entry: PackedAttention):
    """`(heads, kv heads, pieces)` as `PackedAttention.pieces` gives them; for a packed linear that declares its row
    layout, the pieces are the layout's (whole groups of a grouped layout; q by query heads and k/v by kv heads of a
    contiguous one), checked against the class's table entry, so the two descriptions cannot silently differ."""
    heads, kv_heads, pieces = entry.pieces(module)
    packed = getattr(module, entry.packed)
    if getattr(packed, "row_layout", None) is None:
        return heads, kv_heads, pieces
    layout = layout_of(packed)
    if layout.is_contiguous:
        declared = [(layout.sizes[0], heads, False), *((size, kv_heads, True) for size in layout.sizes[1:])]
    else:
        declared = [(sum(layout.sizes), layout.groups, False)]
    if [tuple(piece) for piece in pieces] != declared:
        raise ValueError(
            f"{model_name(module)}: {entry.packed} declares {layout.describe()}, which is not how "
            f"{type(module).__name__} reads its rows ({pieces}); refusing to shard it"
        )
    return heads, kv_heads, declared


def _localise_layout(packed: nn.Module, partition) -> None:
    """A layout-declaring packed linear's own record of its rows, made this process's (`RowLayout.shard`)."""
    if getattr(packed, "row_layout", None) is None:
        return
    layout = layout_of(packed)
    if layout.is_contiguous:
        local = RowLayout.contiguous(partition.sizes)
    else:
        local = layout.shard(partition.world_size)  # whole groups: the process's rows are one block of them
    if sum(local.sizes) != sum(partition.sizes):
        raise ValueError(f"{model_name(packed)}: the partition keeps {sum(partition.sizes)} rows, the layout {local}")
    packed.output_sizes[:] = list(local.sizes)
    packed.row_layout = local


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

    found = [(path, module) for path, module in model.named_modules() if packed_entry(module) is not None]
    if not found:
        raise ValueError(
            f"{model_label(getattr(model, 'config', None))}: no attention module of a packed-QKV class "
            f"({', '.join(key.rpartition('.')[2] for key in PACKED_ATTENTION)}); nothing to shard"
        )
    layouts = []
    for path, module in found:  # every check before the first change; these need no process group
        layout = packed_entry(module)
        if getattr(module, "tp_partition", None) is not None:
            raise ValueError(f"{model_label(getattr(model, 'config', None))} ({path}) is already sharded")
        if getattr(module, layout.packed).weight.is_meta:
            raise ValueError(f"{path}.{layout.packed} is on the meta device; load the model before sharding it")
        module.tp_name = f"{model_label(getattr(model, 'config', None))} ({path})"
        layouts.append((path, module, layout, *_pieces(module, layout)))
    world_size, rank = dist.get_world_size(group), dist.get_rank(group)
    partitions = []
    for path, module, layout, heads, kv_heads, pieces in layouts:
        check_head_counts(module.tp_name, heads, kv_heads, world_size)
        rows, units, replicable = zip(*pieces)
        partition = partition_rows(rows, units, replicable, world_size, rank, what=module.tp_name)
        if any(partition.replicated) and _is_conv1d(getattr(module, layout.packed)):
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
        _localise_layout(packed, partition)
        _column_parallel_input(packed, group)
        if any(partition.replicated):  # replicated kv heads: each sharing process holds part of their gradient
            for parameter in packed.parameters(recurse=False):
                if parameter.requires_grad:
                    parameter.register_hook(replicated_rows_summed(partition, group))
        _row_parallel_forward(output, (rank * local_heads * head_dim, local_heads * head_dim), group)
        layout.localise(module, local_heads, local_kv)
        module.tp_partition = partition
        plan[f"{path}.{layout.packed}"] = PACKED_COLWISE
        plan[f"{path}.{layout.output}"] = PACKED_ROWWISE
    return plan
