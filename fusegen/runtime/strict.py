"""Strict loading through `from_pretrained`: a merged parameter is filled from the checkpoint, or loading raises.

Transformers treats a parameter the checkpoint did not fill as "missing": it logs a table, initialises the parameter
randomly and returns the model. For an ordinary parameter that is its documented behaviour (a new head to fine-tune).
For a merged linear it is a silent wrong model: its pieces are in the checkpoint under other names, and the only way
they are left out is a stacked mapping that did not reach them (a parent it does not scope, a piece that failed to
convert). So the generated pretrained base (through `FusedPreTrainedMixin`) calls `check_loading` from
`_finalize_model_loading`, after the tensors are copied and before anything missing is initialised, and it raises
`CheckpointError` naming the tensor.

What is checked, on the live model (so it holds for whatever config the model was built with):

- every parameter of a merged linear (a module with `output_sizes`) must have been filled: not missing, not
  mismatched, or tied (`all_tied_weights_keys`) to a parameter that was filled, which Transformers' `tie_weights`
  then shares with it (Zamba's shared transformer is saved once and tied into every other hybrid layer). The message names the merged tensor, its canonical pieces, the pieces the checkpoint holds that mapped
  nowhere (the `tensor` of the error, when there is one) and the conversion error, if any;
- a checkpoint tensor renamed to a merged name the model does not have there (the model keeps that module unfused)
  while the model's own piece stays missing: it maps nowhere and the piece would be random, so it raises too.

A merged parameter of which the checkpoint holds NO piece (and no error or stray piece explains it) is left to
Transformers, as the original's pieces would be: reported in `missing_keys` under the model's own parameter name (the
one `named_parameters()` gives, which is what Transformers' loading report and its model tests compare against) and
initialised by `_init_weights` as a linear of the original's kind. Only a partial piece set, a failed merge or a piece
that maps nowhere can leave rows of a merged parameter random while others are real, and those raise.

Every error names the class whose `from_pretrained` was called, the weight file (or the checkpoint directory when the
tensor is in none of its files) and the tensor, and carries no traceback: a conversion error Transformers recorded is
reduced to its exception line.

Everything else is Transformers' usual behaviour: a tied `lm_head`, non-persistent buffers, `_keys_to_ignore_*`, an
unexpected head when a base model loads a causal-LM checkpoint.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping

import torch

from .files import CheckpointError
from .merged import merged_modules, stacked_mapping


def check_loading(
    model: torch.nn.Module,
    loading_info,
    where: object = None,
    stacked: Mapping | None = None,
    caller: str | None = None,
) -> None:
    """Raise `CheckpointError` if `from_pretrained` left a merged parameter unfilled (see the module docstring).

    `loading_info` is Transformers' `LoadStateDictInfo` (missing, unexpected and mismatched keys, conversion errors);
    `where` names the checkpoint in the message, `caller` the class whose `from_pretrained` the user called (the
    default is the model's). A false alarm costs a load that would have been a random merged weight anyway; a miss
    returns a model computing with random rows.
    """
    mapping = stacked_mapping(model, stacked)
    prefix = getattr(model, "base_model_prefix", "") or ""
    missing = set(getattr(loading_info, "missing_keys", ()) or ())
    missing |= {entry[0] for entry in getattr(loading_info, "mismatched_keys", ()) or ()}
    unexpected = set(getattr(loading_info, "unexpected_keys", ()) or ())
    errors = dict(getattr(loading_info, "conversion_errors", {}) or {})
    tied = _tie_groups(model)
    for path, module in merged_modules(model).items():
        for leaf, tensor in module.named_parameters(recurse=False):
            name = f"{path}.{leaf}"
            if name in missing and not (tied.get(name, set()) - missing):
                error = _unfilled(name, _piece_keys(name, mapping), unexpected, errors, prefix, where, caller or model)
                if error is not None:
                    raise error
    for key in sorted(unexpected):
        _check_renamed(key, mapping, missing, prefix, where, caller or model)


def _tie_groups(model: torch.nn.Module) -> dict[str, set[str]]:
    """For each parameter `model.all_tied_weights_keys` ties, every parameter tied with it (itself included).

    Transformers ties each target to its source after loading, and swaps the two when only the target was in the
    checkpoint; targets sharing a source share one tensor. So a missing merged parameter is filled exactly when some
    member of its group was filled. A group whose members are all missing stays an error: nothing real is tied in.
    """
    groups: dict[str, set[str]] = {}
    for target, source in (getattr(model, "all_tied_weights_keys", None) or {}).items():
        group = groups.get(target, {target}) | groups.get(source, {source})  # chains join one group
        for member in group:
            groups[member] = group
    return groups


def _piece_keys(name: str, mapping: Mapping[str, tuple[str, ...]]) -> list[str]:
    """The canonical checkpoint names of a merged tensor's pieces: `a.qkv_proj.weight` -> `a.q_proj.weight`, ..."""
    module_path, _, leaf = name.rpartition(".")
    parent, _, attribute = module_path.rpartition(".")
    return [f"{parent}.{piece}.{leaf}" if parent else f"{piece}.{leaf}" for piece in mapping.get(attribute, ())]


def _variants(key: str, prefix: str) -> set[str]:
    """`key` with and without the base-model prefix: checkpoint and model may differ by one level."""
    if not prefix:
        return {key}
    return {key, key.removeprefix(prefix + "."), f"{prefix}.{key}"}


def _found(keys: Iterable[str], among: set[str], prefix: str) -> list[str]:
    return [key for key in keys if _variants(key, prefix) & among]


def _class_name(caller: object) -> str:
    return caller if isinstance(caller, str) else type(caller).__name__


def error_reason(message: str) -> str:
    """The exception line of a conversion error Transformers recorded with its whole traceback (`log_conversion_errors`
    stores `traceback + message + where`): the sentence that matters, without the frames."""
    lines = message.splitlines()
    starts = [index for index, line in enumerate(lines) if line.startswith("Traceback (most recent call last)")]
    if not starts:
        return message.strip()
    for line in lines[starts[-1] + 1 :]:
        if line and not line[0].isspace():
            return line.strip()
    return lines[-1].strip()


def _unfilled(
    name: str, pieces: list[str], unexpected: set[str], errors: dict, prefix: str, where: object, caller: object
) -> CheckpointError | None:
    """The error for merged parameter `name` left unfilled, naming the pieces that mapped nowhere if any did; None when
    the checkpoint simply has none of its pieces (then it is a missing key, as the original's pieces would be)."""
    stray = [key for piece in pieces for key in sorted(_variants(piece, prefix) & unexpected)]
    failed = [message for key, message in errors.items() if _variants(key, prefix) & _variants(name, prefix)]
    if stray:
        reason = f"the checkpoint's {', '.join(stray)} mapped nowhere (no registered stacked mapping covers it)"
    elif failed:
        reason = f"merging its pieces failed: {error_reason(failed[0])}"
    else:
        return None
    problem = (
        f"{_class_name(caller)}: merged parameter {name} was not filled from the checkpoint (it is made of "
        f"{', '.join(pieces) or '?'}): {reason}; refusing to leave it randomly initialised"
    )
    tensor = stray[0] if stray else name
    return CheckpointError(problem, file=_file_of(where, [tensor, *pieces], prefix), tensor=tensor)


def _file_of(where: object, names: list[str], prefix: str) -> str | None:
    """The weight file of checkpoint directory `where` that holds the first of `names` found (any prefix variant),
    else its only weight file, else `where` itself."""
    import json
    from pathlib import Path

    if where is None:
        return None
    root = Path(str(where))
    index = root / "model.safetensors.index.json"
    if index.is_file():
        try:
            weight_map = json.loads(index.read_text(encoding="utf-8")).get("weight_map", {})
        except (OSError, ValueError):
            weight_map = {}
        for name in names:
            for variant in sorted(_variants(name, prefix)):
                if variant in weight_map:
                    return str(root / weight_map[variant])
        return str(index)
    single = root / "model.safetensors"
    return str(single) if single.is_file() else str(where)


def _check_renamed(
    key: str, mapping: Mapping[str, tuple[str, ...]], missing: set[str], prefix: str, where, caller: object
) -> None:
    """An unexpected `a.qkv_proj.weight` came from renaming `a.q_proj.weight`...: fine unless the model misses those."""
    module_path = key.rpartition(".")[0]
    if module_path.rpartition(".")[2] not in mapping:
        return
    lost = _found(_piece_keys(key, mapping), missing, prefix)
    if lost:
        raise CheckpointError(
            f"{_class_name(caller)}: the stacked mapping renamed it to {key}, which the model does not have (it keeps that module "
            f"unfused), so {', '.join(lost)} would be left randomly initialised",
            file=_file_of(where, lost, prefix),
            tensor=lost[0],
        )
