"""Step 2 of loading a checkpoint: match every checkpoint tensor to its destination in the model, before any copy.

A destination is a whole parameter, or a row slice of a merged (`MergedColumnLinear`) parameter found through
`output_sizes` and the generated file's `STACKED_PARAMS_MAPPING`. A merged linear the checkpoint stores packed
(`fusegen.runtime.merged.stored_packed`: it declares its row layout and no mapping splits it) is a whole parameter:
its tensor is read and written as it is, rows in the checkpoint's own packed order. Missing, unexpected and wrongly shaped tensors fail
here, all at once, so a bad checkpoint leaves the model untouched. The same destinations name the model's tensors
canonically when saving (`fusegen/runtime/saving.py`).
"""

from __future__ import annotations

import warnings
from collections.abc import Container, Mapping, Sequence
from dataclasses import dataclass

import torch

from .files import CANONICAL, FUSED, Checkpoint, CheckpointError, TensorInfo
from .layout import require_contiguous
from .linear import absent_bias_pieces
from .merged import merged_modules, stacked_mapping, stored_packed
from .renames import model_names


@dataclass(frozen=True)
class Destination:
    """Where one checkpoint tensor goes: rows `[start, start + shape[0])` of `tensor`, or all of it when `whole`."""

    param: str  # the model's state-dict name of the destination (first name, if tied)
    tensor: torch.Tensor
    start: int
    shape: tuple[int, ...]
    whole: bool

    def view(self) -> torch.Tensor:
        data = self.tensor.detach()
        return data if self.whole else data.narrow(0, self.start, self.shape[0])


@dataclass(frozen=True)
class Targets:
    """Every checkpoint name a model accepts, and which names must be present (any one name of each group)."""

    by_name: dict[str, Destination]
    groups: tuple[tuple[str, ...], ...]


def _pieces_for(path: str, module: torch.nn.Module, mapping: Mapping[str, tuple[str, ...]]) -> tuple[str, ...]:
    """The canonical names of a merged module's pieces, checked against its `output_sizes`."""
    attribute = path.rpartition(".")[2]
    pieces = mapping.get(attribute)
    if pieces is None:
        raise ValueError(
            f"{path} is a merged linear but {attribute!r} is not in the stacked mapping {sorted(mapping)}; "
            "pass stacked= or define STACKED_PARAMS_MAPPING in the model's module"
        )
    require_contiguous(module, f"{path}: fusegen's own loader and saver")
    if len(pieces) != len(module.output_sizes):
        raise ValueError(f"{path}: mapping lists {pieces} but output_sizes is {module.output_sizes}")
    return pieces


def _piece_destinations(
    names: Sequence[str],
    tensor: torch.Tensor,
    pieces: Sequence[str],
    sizes: Sequence[int],
    absent: Container[int] = (),
) -> tuple[dict[str, Destination], list[tuple[str, ...]]]:
    """Canonical names for each row block of a merged tensor (for every alias of it), and one group per block.

    Blocks in `absent` (bias rows of a projection that has no bias, see `MergedColumnLinear`) have no canonical
    tensor: no name, nothing required on load, nothing written on save; loading sets them to zero.
    """
    by_name, groups, start = {}, [], 0
    for index, (piece, size) in enumerate(zip(pieces, sizes)):
        if index in absent:
            start += size
            continue
        shape = (size, *tensor.shape[1:])
        group = []
        for name in names:
            module_path, _, leaf = name.rpartition(".")
            parent = module_path.rpartition(".")[0]
            piece_name = f"{parent}.{piece}.{leaf}" if parent else f"{piece}.{leaf}"
            by_name[piece_name] = Destination(names[0], tensor, start, shape, whole=False)
            group.append(piece_name)
        groups.append(tuple(group))
        start += size
    return by_name, groups


def model_targets(model: torch.nn.Module, mapping: Mapping[str, tuple[str, ...]], layout: str) -> Targets:
    """Map each name the checkpoint may use to its destination in `model`.

    Tied tensors (the same Parameter under several state-dict names, e.g. `lm_head.weight` and
    `model.embed_tokens.weight`) form one group: any one of their names satisfies it, the first name is preferred, so
    a checkpoint that omits `lm_head.weight` (as Transformers saves tied models) is complete.
    """
    aliases: dict[int, list[str]] = {}
    tensors: dict[int, torch.Tensor] = {}
    for name, tensor in model.state_dict(keep_vars=True).items():
        aliases.setdefault(id(tensor), []).append(name)
        tensors[id(tensor)] = tensor
    merged = merged_modules(model) if layout == CANONICAL else {}
    by_name: dict[str, Destination] = {}
    groups: list[tuple[str, ...]] = []
    for key, names in aliases.items():
        tensor = tensors[key]
        module_path = names[0].rpartition(".")[0]
        packed = module_path in merged and stored_packed(merged[module_path], module_path.rpartition(".")[2], mapping)
        if module_path in merged and not packed:
            module = merged[module_path]
            pieces = _pieces_for(module_path, module, mapping)
            absent = absent_bias_pieces(module) if names[0].endswith(".bias") else []
            piece_names, piece_groups = _piece_destinations(names, tensor, pieces, module.output_sizes, absent)
            by_name.update(piece_names)
            groups.extend(piece_groups)
        else:
            for name in names:
                by_name[name] = Destination(names[0], tensor, 0, tuple(tensor.shape), whole=True)
            groups.append(tuple(names))
    return Targets(by_name, tuple(groups))


def _listing(names: Sequence[str], limit: int = 8) -> str:
    shown = ", ".join(names[:limit])
    return shown + (f" and {len(names) - limit} more" if len(names) > limit else "")


def _check_stacked(model: torch.nn.Module, checkpoint: Checkpoint, mapping: Mapping[str, tuple[str, ...]]) -> None:
    """A fused checkpoint's row order must be the model's: same total size with q/k/v swapped would load silently."""
    if checkpoint.layout != FUSED or checkpoint.stacked is None:
        return
    for path in merged_modules(model):
        attribute = path.rpartition(".")[2]
        theirs = checkpoint.stacked.get(attribute)
        if theirs is not None and tuple(theirs) != tuple(mapping.get(attribute, ())):
            raise CheckpointError(
                f"merged rows are {list(theirs)} in the checkpoint but {list(mapping.get(attribute, ()))} in the model",
                file=checkpoint.files[0],
                tensor=f"{path}.weight",
            )


def absent_parameters(targets: Targets, missing: Sequence[str], unexpected: Sequence[str], where: object) -> list[str]:
    """The model names of the parameters the checkpoint lacks entirely, given the first name of each unfilled group.

    This is Transformers' contract for a key the checkpoint lacks (reported, then initialised), and it is safe only
    where no real and random rows can mix in one parameter. So it raises `CheckpointError` naming the tensor:

    - for a merged parameter some of whose pieces are in the checkpoint and some not (a partial piece set: its rows
      would be half real, half random). The error names the first absent piece;
    - for a merged parameter none of whose pieces is in the checkpoint while the checkpoint holds a tensor named like
      one of them elsewhere (`...x.q_proj.weight` under a parent the model does not have): that piece maps nowhere,
      and it is most likely the data this parameter should have had. The error names the stray tensor.

    A merged parameter without any piece (nor a stray one) is reported under its model name
    (`...self_attn.qkv_proj.weight`), the name `named_parameters()` gives and Transformers' loading report uses.
    """
    groups_of: dict[str, list[tuple[str, ...]]] = {}
    for group in targets.groups:
        groups_of.setdefault(targets.by_name[group[0]].param, []).append(group)
    unfilled = set(missing)
    absent: list[str] = []
    for param, groups in groups_of.items():
        lacking = [group[0] for group in groups if group[0] in unfilled]
        if not lacking:
            continue
        if targets.by_name[groups[0][0]].whole:
            absent.append(param)
            continue
        if len(lacking) < len(groups):
            raise CheckpointError(
                f"merged parameter {param} would be filled in part: the checkpoint holds "
                f"{_listing([g[0] for g in groups if g[0] not in unfilled])} but not {_listing(lacking)}, so its rows "
                "would mix loaded and random values",
                file=where,
                tensor=lacking[0],
            )
        tails = {".".join(piece.rsplit(".", 2)[-2:]) for piece in lacking}
        stray = [name for name in unexpected if ".".join(name.rsplit(".", 2)[-2:]) in tails]
        if stray:
            raise CheckpointError(
                f"maps nowhere: merged parameter {param} (made of {_listing(lacking)}) is not in the checkpoint, which "
                f"holds {_listing(stray)} where the model has no such tensor; refusing to leave {param} randomly "
                "initialised",
                file=where,
                tensor=stray[0],
            )
        absent.append(param)
    return absent


@dataclass(frozen=True)
class Copy:
    """One planned copy: checkpoint tensor `name` (described by `source`) into `destination`."""

    name: str
    source: TensorInfo
    destination: Destination


@dataclass(frozen=True)
class Plan:
    copies: tuple[Copy, ...]
    unexpected: tuple[str, ...]
    missing: tuple[str, ...] = ()
    """Model names (`named_parameters()`) of the parameters the checkpoint lacks entirely (only with `allow_missing`)."""


def plan_load(
    model: torch.nn.Module,
    checkpoint: Checkpoint,
    *,
    strict: bool = True,
    stacked: Mapping | None = None,
    allow_missing: bool = False,
) -> Plan:
    """Decide every copy, or raise: missing tensors (unless `allow_missing`), unexpected ones (if strict), wrong
    shapes, float vs int.

    Non-strict mode only tolerates unexpected tensors (one warning lists them). A missing tensor fails, since it would
    leave part of the model at its random initialisation, unless `allow_missing`: then a parameter the checkpoint
    lacks ENTIRELY (an ordinary one, or a merged one of which no piece is there) is listed in `Plan.missing` for the
    caller to initialise, as Transformers' `from_pretrained` treats a missing key (see `absent_parameters`).
    """
    mapping = stacked_mapping(model, stacked)
    targets = model_targets(model, mapping, checkpoint.layout)
    _check_stacked(model, checkpoint, mapping)
    names = model_names(model, checkpoint.infos, checkpoint.where)  # Transformers' key renames (legacy prefixes)
    infos = {name: checkpoint.infos[original] for name, original in names.items()}
    missing = [group[0] for group in targets.groups if not any(name in infos for name in group)]
    unexpected = sorted(names[name] for name in set(infos) - set(targets.by_name))
    absent: list[str] = []
    if missing and allow_missing:
        absent = absent_parameters(targets, missing, unexpected, checkpoint.where)
        missing = []
    if missing:
        hint = f" (the checkpoint has unexpected {_listing(unexpected)}; wrong layout or model?)" if unexpected else ""
        raise CheckpointError(
            f"missing from the {checkpoint.layout} checkpoint: {_listing(missing)}{hint}",
            file=checkpoint.where,
            tensor=missing[0],
        )
    if unexpected:
        described = _listing([f"{name} ({checkpoint.infos[name].file.name})" for name in unexpected])
        if strict:
            raise CheckpointError(
                f"unexpected tensors not in the model: {described}", file=checkpoint.where, tensor=unexpected[0]
            )
        warnings.warn(f"{checkpoint.root}: ignoring {len(unexpected)} unexpected tensors: {described}", stacklevel=3)
    copies = []
    for group in targets.groups:
        name = next((name for name in group if name in infos), None)
        if name is None:  # a parameter listed in `absent`
            continue
        source, destination = infos[name], targets.by_name[name]
        check_compatible(names[name], source, destination)
        copies.append(Copy(names[name], source, destination))
    return Plan(tuple(copies), tuple(unexpected), tuple(absent))


def check_compatible(name: str, source: TensorInfo, destination: Destination) -> None:
    """Shapes must match exactly; dtypes may differ (copy_ converts) but not across float / non-float, and a one-byte
    float (e4m3/e5m2, whose scale is another tensor) fills only a one-byte float."""
    if source.shape != destination.shape:
        raise CheckpointError(
            f"shape {list(source.shape)} in the checkpoint, {list(destination.shape)} expected by the model "
            f"({destination.param})",
            file=source.file,
            tensor=name,
        )
    if source.dtype.is_floating_point != destination.tensor.is_floating_point():
        raise CheckpointError(
            f"dtype {source.dtype} in the checkpoint cannot fill {destination.tensor.dtype} ({destination.param})",
            file=source.file,
            tensor=name,
        )
    if source.dtype.is_floating_point and source.dtype.itemsize == 1 and destination.tensor.element_size() != 1:
        raise CheckpointError(
            f"dtype {source.dtype} in the checkpoint is a pre-quantized (FP8) tensor whose scale is stored in "
            f"another tensor; converting it to {destination.tensor.dtype} ({destination.param}) would drop the "
            "scale. Load this checkpoint with from_pretrained, which applies its quantization_config",
            file=source.file,
            tensor=name,
        )
