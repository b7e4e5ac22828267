"""Serving-grade checkpoint loading for fused models, without going through `from_pretrained`.

Why a second loader: `from_pretrained` is general (device maps, quantizers, conversion ops that gather the q/k/v pieces
and concatenate them) and reports a bad checkpoint as a warning table while returning a partly random model. A server
wants the opposite: refuse anything doubtful, and do it before a single byte is copied. So loading is split in three
steps with no data read until the last one:

1. `open_checkpoint` (`fusegen/runtime/files.py`) finds the weight files, checks every path stays inside the
   checkpoint directory, and reads the safetensors headers (names, shapes, dtypes, layout metadata) -- no tensor data.
2. `plan_load` (`fusegen/runtime/plan.py`) matches every checkpoint tensor to its destination: a whole parameter, or a
   row slice of a merged (`MergedColumnLinear`) parameter. Missing, unexpected and wrongly shaped tensors fail here,
   all at once.
3. The copy (this module): each tensor's bytes are read from the file (positioned reads, never the memory map)
   straight into its destination's memory, or, when a dtype conversion or a GPU is involved, through a reusable
   16 MiB buffer and `copy_`; no state dict, no per-tensor temporary and no second copy of the model ever exists.

The model must already be materialised (e.g. `FusedLlamaForCausalLM(config)`); a `meta` model is refused because
copying into meta tensors silently does nothing, and `to_empty` would leave non-persistent buffers (rotary `inv_freq`)
uninitialised. Saving is `fusegen/runtime/saving.py`.

The names below the imports are re-exported so callers of this module from before the split keep working.
"""

from __future__ import annotations

import os
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from pathlib import Path

import torch

from .files import (  # noqa: F401 (re-exported)
    CANONICAL,
    FUSED,
    LAYOUT_KEY,
    STACKED_KEY,
    STEMS,
    Checkpoint,
    CheckpointError,
    TensorInfo,
    open_checkpoint,
)
from .linear import absent_bias_pieces
from .merged import merged_modules, normalise_stacked, stacked_mapping  # noqa: F401 (re-exported)
from .plan import Plan, check_compatible, model_targets, plan_load
from .saving import canonical_tensors, parse_size, save_checkpoint, write_safetensors  # noqa: F401 (re-exported)


def _require_materialised(model: torch.nn.Module) -> None:
    """Copying into meta tensors is a silent no-op, so refuse up front rather than 'load' nothing."""
    for name, tensor in model.state_dict(keep_vars=True).items():
        if tensor.is_meta:
            raise ValueError(f"{name} is on the meta device; build the model with real tensors before loading")


@torch.no_grad()
def execute_plan(plan: Plan, checkpoint: Checkpoint) -> None:
    """Stream each tensor into place, file by file, in file order."""
    order = {file: position for position, file in enumerate(checkpoint.files)}
    for copy in sorted(plan.copies, key=lambda c: order[c.source.file]):
        try:
            checkpoint.read_into(copy.name, copy.destination.view())
        except Exception as error:  # only I/O after validation lands here (file changed under us, disk error)
            raise CheckpointError(
                f"read failed after validation ({error}); the model is partially loaded, discard it",
                file=copy.source.file,
                tensor=copy.name,
            ) from error


@dataclass(frozen=True)
class LoadReport:
    layout: str
    files: tuple[Path, ...]
    copied: int
    unexpected: tuple[str, ...]
    missing: tuple[str, ...] = ()
    """With `allow_missing=True`: the parameters the checkpoint lacked entirely, by model name, now initialised."""


def load_checkpoint(
    model: torch.nn.Module,
    path: str | os.PathLike,
    *,
    strict: bool = True,
    allow_pickle: bool = False,
    stacked: Mapping | None = None,
    allowed_roots: Iterable[str | os.PathLike] = (),
    allow_missing: bool = False,
) -> LoadReport:
    """Load a canonical or fused checkpoint directory into an already materialised `model`, in place.

    Everything (paths, names, shapes, dtype kinds) is validated from headers before any data is copied, so a bad
    checkpoint raises `CheckpointError` and leaves the model untouched. `stacked` overrides the
    `STACKED_PARAMS_MAPPING` found in the model's module; `allowed_roots`: see `open_checkpoint`.

    A missing tensor raises, unless `allow_missing=True`: then a parameter the checkpoint lacks entirely (an ordinary
    one, or a merged one none of whose pieces is there) is listed in `LoadReport.missing` under its model name and
    initialised by the model's own `_init_weights`, as `from_pretrained` does for a missing key (`init_missing`). A
    merged parameter the checkpoint holds in part, or whose pieces are in it under names that map nowhere, still
    raises `CheckpointError` naming the tensor (`plan.absent_parameters`).
    """
    _require_materialised(model)
    if allow_missing and not callable(getattr(model, "initialize_weights", None)):
        raise ValueError(
            f"allow_missing=True needs a Transformers PreTrainedModel, whose _init_weights initialises what the "
            f"checkpoint lacks; {type(model).__name__} has no initialize_weights()"
        )
    with open_checkpoint(path, allow_pickle=allow_pickle, allowed_roots=allowed_roots) as checkpoint:
        plan = plan_load(model, checkpoint, strict=strict, stacked=stacked, allow_missing=allow_missing)
        execute_plan(plan, checkpoint)
        if plan.missing:
            init_missing(model, plan.missing)
        zero_absent_bias(model)
        return LoadReport(checkpoint.layout, checkpoint.files, len(plan.copies), plan.unexpected, plan.missing)


@torch.no_grad()
def init_missing(model: torch.nn.Module, missing: Iterable[str]) -> None:
    """Initialise exactly the parameters named in `missing` with the model's own `_init_weights`, as Transformers'
    `from_pretrained` initialises missing keys.

    Transformers' initialisers leave a tensor flagged `_is_hf_initialized` alone, and `initialize_weights()` skips a
    module so flagged (every module of a constructed model is). So for the duration: every other tensor of the state
    dict is flagged, the missing ones (all names of a tied tensor) and the modules holding them are not; then
    `initialize_weights()` runs and every flag is put back as it was, so a later call behaves as before.

    A merged parameter gets the rule `_init_weights` applies to a linear, the one the original applies to each of its
    pieces (e.g. normal with `initializer_range`, zero bias).
    """
    state = model.state_dict(keep_vars=True)
    lacking = {id(state[name]) for name in missing}
    owners = {id(m): m for m in (model.get_submodule(name.rpartition(".")[0]) for name in missing)}
    saved = [(obj, obj.__dict__.get("_is_hf_initialized", _UNSET)) for obj in [*state.values(), *owners.values()]]
    try:
        for tensor in state.values():
            tensor._is_hf_initialized = id(tensor) not in lacking
        for module in owners.values():
            module._is_hf_initialized = False
        model.initialize_weights()
    finally:
        for obj, flag in saved:
            if flag is _UNSET:
                obj.__dict__.pop("_is_hf_initialized", None)
            else:
                obj._is_hf_initialized = flag


_UNSET = object()


@torch.no_grad()
def load_weights(
    model: torch.nn.Module, weights: Iterable[tuple[str, torch.Tensor]], *, stacked: Mapping | None = None
) -> set[str]:
    """vLLM-style streaming load: copy each `(name, tensor)` into place and return the model names that were filled.

    Accepts canonical names (q/k/v pieces go to their rows of the merged tensor) and fused names alike. Unlike
    `load_checkpoint` nothing can be validated ahead (the iterable is consumed once), so an unknown name or a wrong
    shape raises mid-way; compare the returned set with `model.state_dict()` keys to detect missing tensors.
    """
    mapping = stacked_mapping(model, stacked)
    targets = {**model_targets(model, mapping, FUSED).by_name, **model_targets(model, mapping, CANONICAL).by_name}
    loaded: set[str] = set()
    for name, tensor in weights:
        destination = targets.get(name)
        if destination is None:
            raise CheckpointError("not a tensor of the model", file="<weights iterable>", tensor=name)
        check_compatible(name, TensorInfo(Path("<weights iterable>"), tuple(tensor.shape), tensor.dtype), destination)
        destination.view().copy_(tensor)
        loaded.add(destination.param)
    zero_absent_bias(model)
    return loaded


def zero_absent_bias(model: torch.nn.Module) -> None:
    """Zero the bias rows of merged pieces without a bias: no checkpoint fills them (see `plan._piece_destinations`)."""
    for module in merged_modules(model).values():
        if absent_bias_pieces(module) and hasattr(module, "zero_absent_bias"):
            module.zero_absent_bias()
