"""Canonical optimizer state dicts of distributed fused models (`torch.distributed.checkpoint`, DCP).

`fusegen.runtime.distributed` makes a distributed fused model's `state_dict()` canonical (`q_proj.weight`,
`k_proj.weight`, ... instead of `qkv_proj.weight`). The optimizer's state cannot be made canonical the same way:
`torch.distributed.checkpoint.state_dict` (DSD) names optimizer state by walking `model.named_parameters()`, one
name per parameter, with no hook in between. So this module gives drop-in wrappers of DSD's four optimizer entry
points (`get_state_dict`, `get_optimizer_state_dict`, `set_state_dict`, `set_optimizer_state_dict`; same
arguments) that call DSD and convert its optimizer state dict: `canonical_optimizer_state` on the way out,
`merged_optimizer_state` on the way in. On a model without merged linears (the original class) both conversions
are the identity, so one training script can use the wrappers for either class.

A merged parameter's state is converted exactly when its model state is (`register_canonical_state_hooks`): when
the parameter is a DTensor (FSDP2, tensor parallelism, both). A single-process fused model keeps its fused names
for model and optimizer alike.

Why it is exact:

- Element-wise optimizer state (Adam's `exp_avg`, `exp_avg_sq`, `max_exp_avg_sq`, SGD's `momentum_buffer`, ...:
  any tensor of the parameter's own shape) updates row `r` of a parameter from row `r` of its gradient only. A
  piece's rows of the merged parameter get exactly the gradient the original's piece gets, so the piece's state is
  the same rows of the merged state: a row slice, taken as the model's weights are (`piece_dtensors`, or `split`
  of a gathered full tensor). Loading concatenates the pieces in row order and each rank keeps its own rows
  (`local_rows`), the inverse.
- Per-parameter scalars (`step`) are the same for every piece of one parameter; each piece gets a copy. Loading
  requires the pieces' scalars to be equal and refuses otherwise (no merged parameter can hold two steps).
- Anything else (a state tensor of another shape, e.g. Adafactor's factored row/column statistics, which mix the
  pieces' rows) has no exact split: the conversion raises `ValueError` naming the parameter and the state.
- The rows of a piece without a bias (`bias_pieces`) get no gradient; their state stays zero, is not listed on save
  and is zero on load, as the model state does.
- `param_groups` list the pieces' names where the merged parameter's was, in row order; loading puts the merged name
  back and refuses pieces spread over several groups.

Both DSD layouts are handled: nested (`{"state": {name: {...}}, "param_groups": [...]}`) and flattened
(`StateDictOptions(flatten_optimizer_state_dict=True)`: `state.<name>.<key>`, `param_groups.<name>.<key>`).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import nn

from .distributed import full_piece_sizes, is_dtensor, local_rows, piece_dtensors
from .layout import require_contiguous
from .linear import absent_bias_pieces
from .merged import stacked_mapping

_STATE, _GROUPS, _PARAMS = "state", "param_groups", "params"


@dataclass(frozen=True)
class MergedEntry:
    """One merged parameter of a distributed fused model: its name, its canonical pieces' names (pieces without a
    bias left out), where they sit among all pieces, and the module and parameter themselves."""

    name: str
    pieces: tuple[str, ...]
    indices: tuple[int, ...]
    module: nn.Module
    parameter: torch.Tensor


def merged_entries(model: nn.Module) -> list[MergedEntry]:
    """The DTensor merged parameters of `model` (none for a single-process or an original model)."""
    entries = []
    for path, owner in model.named_modules():
        prefix = f"{path}." if path else ""
        for attribute, pieces in stacked_mapping(owner).items():
            merged = owner._modules.get(attribute)
            if merged is None or getattr(merged, "output_sizes", None) is None:
                continue
            absent = set(absent_bias_pieces(merged))
            for leaf in ("weight", "bias"):
                parameter = getattr(merged, leaf, None)
                if not is_dtensor(parameter):
                    continue
                require_contiguous(merged, "a canonical optimizer state")
                indices = tuple(i for i in range(len(pieces)) if not (leaf == "bias" and i in absent))
                names = tuple(f"{prefix}{pieces[i]}.{leaf}" for i in indices)
                entries.append(MergedEntry(f"{prefix}{attribute}.{leaf}", names, indices, merged, parameter))
    return entries


# --- one parameter's state -------------------------------------------------------------------------------------------


def _is_elementwise(entry: MergedEntry, value) -> bool:
    return isinstance(value, torch.Tensor) and value.dim() > 0 and tuple(value.shape) == tuple(entry.parameter.shape)


def _is_scalar(value) -> bool:
    return not isinstance(value, torch.Tensor) or value.dim() == 0


def split_state(entry: MergedEntry, key: str, value) -> list:
    """`value` (the merged parameter's optimizer state `key`) as one value per canonical piece of `entry`."""
    if _is_elementwise(entry, value):
        if is_dtensor(value):
            parts = piece_dtensors(entry.module, value)
        else:
            parts = [part.clone() for part in value.split(full_piece_sizes(entry.module, entry.parameter))]
        return [parts[i] for i in entry.indices]
    if _is_scalar(value):
        return [value.clone() if isinstance(value, torch.Tensor) else value for _ in entry.indices]
    raise ValueError(
        f"{entry.name}: optimizer state {key!r} of shape {list(value.shape)} is not element-wise (the parameter is "
        f"{list(entry.parameter.shape)}), so it has no exact split into {list(entry.pieces)}"
    )


def merge_state(entry: MergedEntry, key: str, values: list):
    """The merged parameter's optimizer state `key` from its pieces' `values` (the inverse of `split_state`)."""
    if all(_is_scalar(value) for value in values):
        first = values[0]
        same = all(
            torch.equal(torch.as_tensor(v), torch.as_tensor(first)) if isinstance(first, torch.Tensor) else v == first
            for v in values
        )
        if not same:
            raise ValueError(
                f"{entry.name}: the pieces {list(entry.pieces)} hold different optimizer state {key!r} "
                f"({[v.item() if isinstance(v, torch.Tensor) else v for v in values]}); one merged parameter holds one"
            )
        return first
    if any(_is_scalar(value) for value in values):
        raise ValueError(f"{entry.name}: optimizer state {key!r} is a scalar for some of {list(entry.pieces)} only")
    sizes = full_piece_sizes(entry.module, entry.parameter)
    given = dict(zip(entry.indices, values))
    distributed = any(is_dtensor(value) for value in values)
    like = next(iter(given.values()))
    parts = []
    for index, size in enumerate(sizes):
        value = given.get(index)
        if value is None:
            parts.append(torch.zeros((size, *like.shape[1:]), dtype=like.dtype))
            continue
        value = value.full_tensor() if is_dtensor(value) else value
        if value.shape[0] != size or tuple(value.shape[1:]) != tuple(entry.parameter.shape[1:]):
            raise ValueError(
                f"{entry.pieces[entry.indices.index(index)]}: optimizer state {key!r} of shape {list(value.shape)} "
                f"does not fit {size} rows of {entry.name} {list(entry.parameter.shape)}"
            )
        parts.append(value)
    full = torch.cat([part.to(like.dtype) for part in parts])
    if not distributed:
        return full
    from torch.distributed.tensor import DTensor

    parameter = entry.parameter  # the state takes the parameter's own placement object (see `local_rows`)
    local = local_rows(full, parameter).contiguous().clone()
    return DTensor.from_local(local, parameter.device_mesh, parameter.placements, run_check=False,
                              shape=parameter.shape, stride=parameter.stride())  # fmt: skip


# --- whole optimizer state dicts -------------------------------------------------------------------------------------


def canonical_optimizer_state(model: nn.Module, optim_state_dict: dict) -> dict:
    """DSD's optimizer state dict of `model` (nested or flattened) with every DTensor merged parameter's entries
    replaced by its canonical pieces' entries (a new dict; the tensors of other parameters are shared)."""
    entries = merged_entries(model)
    if not entries or not optim_state_dict:
        return optim_state_dict
    if _STATE not in optim_state_dict:
        return _canonical_flat(entries, optim_state_dict)
    state = dict(optim_state_dict[_STATE])
    groups = [dict(group) for group in optim_state_dict.get(_GROUPS, [])]
    for entry in entries:
        if entry.name in state:
            per_piece = [{} for _ in entry.pieces]
            for key, value in state.pop(entry.name).items():
                for target, part in zip(per_piece, split_state(entry, key, value)):
                    target[key] = part
            state.update(zip(entry.pieces, per_piece))
        for group in groups:
            if entry.name in group.get(_PARAMS, ()):
                group[_PARAMS] = _replace(group[_PARAMS], [entry.name], list(entry.pieces))
    return {**optim_state_dict, _STATE: state, _GROUPS: groups}


def merged_optimizer_state(model: nn.Module, optim_state_dict: dict) -> dict:
    """The inverse of `canonical_optimizer_state`: a canonical optimizer state dict (DSD's layout, nested or
    flattened) in `model`'s own names, ready for DSD's `set_optimizer_state_dict`. A merged parameter whose pieces
    are not all listed is left as it is, for DSD to report."""
    entries = merged_entries(model)
    if not entries or not optim_state_dict:
        return optim_state_dict
    if _STATE not in optim_state_dict:
        return _merged_flat(entries, optim_state_dict)
    state = dict(optim_state_dict[_STATE])
    groups = [dict(group) for group in optim_state_dict.get(_GROUPS, [])]
    for entry in entries:
        if entry.name in state or not all(piece in state for piece in entry.pieces):
            continue
        per_piece = [state.pop(piece) for piece in entry.pieces]
        keys = list(per_piece[0])  # in the given order, the same on every rank (merging gathers: collectives)
        if any(set(states) != set(keys) for states in per_piece):
            raise ValueError(
                f"{entry.name}: the pieces {list(entry.pieces)} hold different optimizer states "
                f"{[sorted(states) for states in per_piece]}"
            )
        state[entry.name] = {key: merge_state(entry, key, [states[key] for states in per_piece]) for key in keys}
        holding = [group for group in groups if any(piece in group.get(_PARAMS, ()) for piece in entry.pieces)]
        if len(holding) > 1:
            raise ValueError(f"{entry.name}: its pieces {list(entry.pieces)} are in different parameter groups")
        for group in holding:
            group[_PARAMS] = _replace(group[_PARAMS], list(entry.pieces), [entry.name])
    return {**optim_state_dict, _STATE: state, _GROUPS: groups}


def _replace(names: list[str], old: list[str], new: list[str]) -> list[str]:
    """`names` with `new` where the first of `old` was, and every other name of `old` dropped."""
    first = min(names.index(name) for name in old if name in names)
    kept = [name for name in names if name not in old]
    position = sum(1 for name in names[:first] if name not in old)
    return kept[:position] + new + kept[position:]


def _canonical_flat(entries: list[MergedEntry], flat: dict) -> dict:
    out = dict(flat)
    for entry in entries:
        state_prefix, group_prefix = f"{_STATE}.{entry.name}.", f"{_GROUPS}.{entry.name}."
        for key in [key for key in out if key.startswith(state_prefix)]:
            name = key[len(state_prefix) :]
            for piece, part in zip(entry.pieces, split_state(entry, name, out.pop(key))):
                out[f"{_STATE}.{piece}.{name}"] = part
        for key in [key for key in out if key.startswith(group_prefix)]:
            value = out.pop(key)
            for piece in entry.pieces:
                out[f"{_GROUPS}.{piece}.{key[len(group_prefix) :]}"] = value
    return out


def _merged_flat(entries: list[MergedEntry], flat: dict) -> dict:
    out = dict(flat)
    for entry in entries:
        if any(key.startswith(f"{_STATE}.{entry.name}.") for key in out):
            continue
        for section, combine in ((_STATE, merge_state), (_GROUPS, _same_group_value)):
            names = [
                {k[len(f"{section}.{p}.") :] for k in out if k.startswith(f"{section}.{p}.")} for p in entry.pieces
            ]
            if not all(names):
                continue
            if any(keys != names[0] for keys in names):
                raise ValueError(f"{entry.name}: the pieces {list(entry.pieces)} hold different {section} {names}")
            for name in sorted(names[0]):
                values = [out.pop(f"{section}.{piece}.{name}") for piece in entry.pieces]
                out[f"{section}.{entry.name}.{name}"] = combine(entry, name, values)
    return out


def _same_group_value(entry: MergedEntry, key: str, values: list):
    if any(value != values[0] for value in values):
        raise ValueError(f"{entry.name}: its pieces {list(entry.pieces)} have different {key!r} ({values})")
    return values[0]


# --- DSD's entry points ----------------------------------------------------------------------------------------------


def get_optimizer_state_dict(model: nn.Module, optimizers, **kwargs) -> dict:
    """`torch.distributed.checkpoint.state_dict.get_optimizer_state_dict`, in canonical names."""
    from torch.distributed.checkpoint import state_dict as dsd

    return canonical_optimizer_state(model, dsd.get_optimizer_state_dict(model, optimizers, **kwargs))


def get_state_dict(model: nn.Module, optimizers, **kwargs) -> tuple[dict, dict]:
    """`torch.distributed.checkpoint.state_dict.get_state_dict`: model and optimizer state, in canonical names."""
    from torch.distributed.checkpoint import state_dict as dsd

    model_state, optim_state = dsd.get_state_dict(model, optimizers, **kwargs)
    return model_state, canonical_optimizer_state(model, optim_state)


def set_optimizer_state_dict(model: nn.Module, optimizers, optim_state_dict: dict, **kwargs) -> None:
    """`torch.distributed.checkpoint.state_dict.set_optimizer_state_dict` from a canonical optimizer state dict."""
    from torch.distributed.checkpoint import state_dict as dsd

    merged = merged_optimizer_state(model, optim_state_dict)
    dsd.set_optimizer_state_dict(model, optimizers, merged, **kwargs)
    place_full_merged_state(model, optimizers, merged, kwargs.get("options"))


def set_state_dict(model: nn.Module, optimizers, *, model_state_dict: dict, optim_state_dict: dict, **kwargs):
    """`torch.distributed.checkpoint.state_dict.set_state_dict` from canonical model and optimizer state dicts."""
    from torch.distributed.checkpoint import state_dict as dsd

    merged = merged_optimizer_state(model, optim_state_dict)
    result = dsd.set_state_dict(
        model, optimizers, model_state_dict=model_state_dict, optim_state_dict=merged, **kwargs
    )
    place_full_merged_state(model, optimizers, merged, kwargs.get("options"))
    return result


def place_full_merged_state(model: nn.Module, optimizers, merged: dict, options) -> None:
    """After DSD loaded a full (`full_state_dict=True`) optimizer state: give each tensor-parallel merged parameter's
    state this rank's own rows.

    DSD cuts a full tensor into each rank's part with `Shard(0)` arithmetic (rows `[r n, (r + 1) n)` of the
    merged tensor), but a tensor-parallel merged parameter holds a block of every piece (`MergedRowShard`, whose
    rows `select_local` gives), so DSD's part is other rows (or, with replicated kv heads, another row count). The
    full merged tensor (`merged`, this rank's copy) is cut again here with the parameter's own placement
    (`local_rows`). Under `broadcast_from_rank0` only rank 0 holds it: refused, naming the parameter.
    """
    if options is None or not options.full_state_dict or not merged:
        return
    from torch.distributed.tensor import DTensor

    entries = [e for e in merged_entries(model) if any(hasattr(p, "select_local") for p in e.parameter.placements)]
    if entries and options.broadcast_from_rank0:
        raise NotImplementedError(
            f"{entries[0].name}: a tensor-parallel merged parameter's optimizer state cannot be loaded with "
            "broadcast_from_rank0 (its rows per rank are not a Shard(0) block); load it without broadcast_from_rank0"
        )
    optimizers = (optimizers,) if isinstance(optimizers, torch.optim.Optimizer) else tuple(optimizers)
    for entry in entries:
        if _STATE in merged:
            values = merged[_STATE].get(entry.name, {})
        else:
            prefix = f"{_STATE}.{entry.name}."
            values = {key[len(prefix) :]: value for key, value in merged.items() if key.startswith(prefix)}
        parameter = entry.parameter
        for optimizer in optimizers:
            state = optimizer.state.get(parameter)
            if state is None:
                continue
            for key, value in values.items():
                if not _is_elementwise(entry, value) or is_dtensor(value):
                    continue
                current = state[key]
                local = (
                    local_rows(value, parameter).to(device=current.device, dtype=current.dtype).contiguous().clone()
                )
                state[key] = DTensor.from_local(local, parameter.device_mesh, parameter.placements, run_check=False,
                                                shape=parameter.shape, stride=parameter.stride())  # fmt: skip
