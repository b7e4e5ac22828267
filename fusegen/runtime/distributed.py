"""Canonical state dicts of distributed fused models: what `torch.distributed.checkpoint` (DCP) saves and loads.

A fused model's merged linear holds several projections' rows (`qkv_proj.weight` = `[q; k; v]`). When its
parameters are DTensors, under FSDP2 (`fully_shard`), tensor parallelism or both, `model.state_dict()` lists the
canonical pieces instead: `q_proj.weight`, `k_proj.weight`, `v_proj.weight`, each a DTensor of that piece's own
global shape. So `dcp.save(fused.state_dict(), ...)` writes the original model's checkpoint (the original class
loads it with `dcp.load(original.state_dict(), ...)`), and `dcp.load(fused.state_dict(), ...)` followed by
`fused.load_state_dict(...)` loads an original's checkpoint into the fused model. One mechanism for every
placement, installed on every fused model when it is built (`register_canonical_state_hooks`): a model whose
parameters are plain tensors keeps its fused state dict (Transformers' loading, saving and PEFT rely on it).

Why it is exact:

- Saving: a piece is rows `[o_i, o_i + n_i)` of the true merged tensor, which DTensor gives honestly as
  `full_tensor()` (FSDP2's `Shard(0)`, tensor parallelism's merged placement, `fusegen.runtime.tp`). Each piece is
  that slice, distributed again over the same mesh with `Shard(0)` where the merged tensor was sharded (each rank
  keeps its own chunk; no communication). When the merged placement says each rank holds its `Shard(0)` block of
  every piece (`chunked_pieces`: equal blocks, or DTensor's ceil-sized blocks of a piece that does not divide by
  N), that block IS the rank's chunk of a `Shard(0)` DTensor of the piece, so the pieces are views of the local
  tensor and nothing is gathered.
- Loading (a load-state-dict pre-hook on the module owning the merged linear, which `load_state_dict` hands the
  pieces' keys): the pieces are put back together, `[p_0; p_1; ...]` by rows, and each rank copies its own rows of
  that into its local tensor, selected by the parameter's placement (`local_rows`). Pieces that are views of the
  parameter (DCP loaded into them in place) are already there. A bias row block of a piece without a bias
  (`bias_pieces`) is not listed on save and is zero on load, as in a single-process checkpoint.
- A state dict holding the merged key itself (a fused checkpoint) loads as before; one holding only some of a
  merged linear's pieces is left to `load_state_dict`, which reports the missing and unexpected keys.
"""

from __future__ import annotations

from functools import partial
from types import SimpleNamespace

import torch
from torch import nn

from .linear import absent_bias_pieces
from .merged import stacked_mapping

_LEAVES = ("weight", "bias")


def is_dtensor(value) -> bool:
    return hasattr(value, "device_mesh") and hasattr(value, "placements") and hasattr(value, "to_local")


def full_piece_sizes(merged: nn.Module, value) -> list[int]:
    """The merged linear's full piece sizes: the placement's own (tensor parallelism keeps local `output_sizes`),
    else `output_sizes`; checked against the global rows of `value`."""
    placement = next((p for p in value.placements if getattr(p, "full_sizes", None)), None)
    sizes = list(placement.full_sizes) if placement is not None else list(merged.output_sizes)
    if sum(sizes) != value.shape[0]:
        raise ValueError(
            f"{type(merged).__name__}: a merged parameter of {value.shape[0]} rows does not hold pieces of {sizes}"
        )
    return sizes


def _piece_placements(placements):
    from torch.distributed.tensor import Replicate, Shard

    out = []
    for placement in placements:
        if placement.is_shard() and placement.dim != 0:
            raise ValueError(f"a merged parameter sharded along dim {placement.dim} has no canonical pieces")
        out.append(Shard(0) if placement.is_shard() else Replicate())
    return out


def piece_dtensors(merged: nn.Module, value) -> list:
    """The pieces of the merged DTensor `value` (a weight or bias of `merged`), each a DTensor of its own shape."""
    from torch.distributed.tensor import DTensor, Shard, distribute_tensor

    sizes = full_piece_sizes(merged, value)
    placements = value.placements
    if len(placements) == 1 and getattr(placements[0], "chunked_pieces", False):
        local, offset, pieces = value.to_local(), 0, []
        local_sizes = placements[0].sizes[value.device_mesh.get_local_rank()]
        for size, local_size in zip(sizes, local_sizes):
            shape = (size, *local.shape[1:])
            view = local.narrow(0, offset, local_size)
            stride = torch.empty(shape, device="meta").stride()
            pieces.append(
                DTensor.from_local(view, value.device_mesh, [Shard(0)], run_check=False, shape=shape, stride=stride)
            )
            offset += local_size
        return pieces
    full = value.full_tensor()
    target = _piece_placements(placements)
    return [
        distribute_tensor(piece.contiguous(), value.device_mesh, target, src_data_rank=None)
        for piece in full.split(sizes)
    ]


def local_rows(full: torch.Tensor, like) -> torch.Tensor:
    """This rank's part of `full` (the whole tensor) for a DTensor laid out as `like`: what `like.to_local()` holds
    when `like.full_tensor()` is `full`."""
    from torch.distributed.tensor._utils import compute_local_shape_and_global_offset

    placements = like.placements
    custom = [p for p in placements if hasattr(p, "select_local")]
    if custom:
        if len(placements) != 1:
            raise ValueError(f"{placements}: a merged placement on a mesh of more than one dimension is not supported")
        return custom[0].select_local(full, like.device_mesh.get_local_rank())
    shape, offset = compute_local_shape_and_global_offset(full.shape, like.device_mesh, placements)
    local = full
    for dim, (size, start) in enumerate(zip(shape, offset)):
        local = local.narrow(dim, start, size)
    return local


def _canonical_state_dict(owner: nn.Module, state_dict: dict, prefix: str, local_metadata) -> None:
    """State-dict post-hook of a module owning merged linears: their DTensor tensors as the canonical pieces."""
    for attribute, pieces in stacked_mapping(owner).items():
        merged = owner._modules.get(attribute)
        if merged is None or getattr(merged, "output_sizes", None) is None:
            continue
        absent = set(absent_bias_pieces(merged))
        for leaf in _LEAVES:
            key = f"{prefix}{attribute}.{leaf}"
            value = state_dict.get(key)
            if not is_dtensor(value) or value.to_local().is_meta:
                continue
            tensors = piece_dtensors(merged, value)
            del state_dict[key]
            for index, (piece, tensor) in enumerate(zip(pieces, tensors)):
                if not (leaf == "bias" and index in absent):
                    state_dict[f"{prefix}{piece}.{leaf}"] = tensor


def _merged_from_canonical(owner, state_dict, prefix, local_metadata, strict, missing, unexpected, errors) -> None:
    """Load-state-dict pre-hook of a module owning merged linears: canonical pieces of a DTensor merged parameter
    become the merged key, holding this rank's rows (the inverse of `_canonical_state_dict`)."""
    for attribute, pieces in stacked_mapping(owner).items():
        merged = owner._modules.get(attribute)
        if merged is None or getattr(merged, "output_sizes", None) is None:
            continue
        absent = set(absent_bias_pieces(merged))
        for leaf in _LEAVES:
            parameter = getattr(merged, leaf, None)
            merged_key = f"{prefix}{attribute}.{leaf}"
            wanted = [i for i in range(len(pieces)) if not (leaf == "bias" and i in absent)]
            keys = {i: f"{prefix}{pieces[i]}.{leaf}" for i in wanted}
            if not is_dtensor(parameter) or not all(key in state_dict for key in keys.values()):
                continue
            if merged_key in state_dict and state_dict[merged_key] is not parameter:
                continue  # the merged tensor itself is given; the pieces are left to be reported unexpected
            sizes = full_piece_sizes(merged, parameter)
            values = {i: state_dict.pop(key) for i, key in keys.items()}
            local = parameter.to_local()
            if not all(is_dtensor(v) and _storage(v.to_local()) == _storage(local) for v in values.values()):
                with torch.no_grad():
                    parts = []
                    for i, size in enumerate(sizes):
                        if i in values:
                            value = values[i]
                            parts.append(value.full_tensor() if is_dtensor(value) else value)
                        else:
                            parts.append(local.new_zeros((size, *local.shape[1:])))
                    full = torch.cat([part.to(local.dtype) for part in parts])
                    if list(full.shape) != list(parameter.shape):
                        raise ValueError(
                            f"{prefix}{attribute}.{leaf}: pieces {[pieces[i] for i in wanted]} make "
                            f"{list(full.shape)}, the merged parameter is {list(parameter.shape)}"
                        )
                    local.copy_(local_rows(full, parameter))
            state_dict[merged_key] = parameter


def _storage(tensor: torch.Tensor) -> int:
    return tensor.untyped_storage().data_ptr()


_PIECES_ATTRIBUTE = "_fusegen_canonical_pieces"


def register_canonical_state_hooks(model: nn.Module) -> None:
    """Install `_canonical_state_dict` and `_merged_from_canonical` on every module of `model` that owns a merged
    linear (once per module). Both do nothing unless the merged parameters are DTensors.

    Also makes the canonical names resolvable where `torch.distributed.checkpoint.state_dict` (DSD:
    `get_model_state_dict`, `set_model_state_dict`, `get_state_dict`) looks them up: DSD maps every state-dict key to
    a parameter by walking attributes (`getattr(attention, "q_proj")`), and lets a module name, in a
    `_fqn_modifiers()` method, an attribute to step into first for a name it does not have. The owner's
    `_fqn_modifiers()` sends each piece name to a plain object holding an entry per piece (nothing else reads it),
    so DSD keeps the canonical keys as they are (tested in tests/test_distributed_checkpoints.py).
    """
    for module in model.modules():
        if getattr(module, "_fusegen_canonical_state", False):
            continue
        owned = {
            a: p for a, p in stacked_mapping(module).items() if getattr(module._modules.get(a), "output_sizes", None)
        }
        if not owned:
            continue
        module.register_state_dict_post_hook(_canonical_state_dict)
        module.register_load_state_dict_pre_hook(_merged_from_canonical)
        pieces = [piece for names in owned.values() for piece in names]
        setattr(
            module, _PIECES_ATTRIBUTE, SimpleNamespace(**{p: SimpleNamespace(weight=None, bias=None) for p in pieces})
        )
        if not hasattr(module, "_fqn_modifiers"):
            module._fqn_modifiers = partial(dict, dict.fromkeys(pieces, _PIECES_ATTRIBUTE))
        module._fusegen_canonical_state = True
