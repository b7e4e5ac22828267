"""Checkpoint conversion so fused models load and save the ORIGINAL (unfused) Transformers layout.

Fused models keep e.g. `self_attn.qkv_proj` where the published checkpoints hold `self_attn.{q,k,v}_proj`. Rather than
shipping new checkpoints, we plug into Transformers' own conversion machinery (`WeightConverter`s looked up by class name
in `transformers.conversion_mapping`): it concatenates on `from_pretrained` and runs the reversed ops on `save_pretrained`.

Why custom ops instead of Transformers' `Concatenate`: its reverse is `Chunk`, which splits into EQUAL parts. With GQA/MQA
q is wider than k/v, so `Chunk` would write wrong shapes. `MergedColumnSplit` splits by the merged module's
`output_sizes` instead, looked up on the live model, so every layout round-trips bit-identically.

How nesting is handled (verified with transformers 5.x, see tests/test_runtime.py): `get_model_conversion_mapping` walks
every `PreTrainedModel` in the module tree and looks each one up by class name. Classes defined outside the
`transformers.` package count as "custom code" and are skipped unless their class name (or model_type) was registered by
the user. So registering only the BASE model class (e.g. `FusedLlamaModel`) is enough: the `FusedLlamaForCausalLM` root is
skipped, and the base model's converters get scoped to its sub-module, which with `base_model_prefix="model"` matches
keys with or without the `model.` prefix. That also covers `FusedLlamaModel.from_pretrained` on a ForCausalLM checkpoint.
Registering the head class as well is harmless (Transformers applies at most one converter per key, and both copies are
identical), only redundant.

This module builds the converters; which ones a model's classes get registered with, and when, is
`fusegen/runtime/registry.py`.
"""

from __future__ import annotations

import re
from collections.abc import Iterable, Mapping, Sequence
from copy import deepcopy
from typing import Any

import torch
from torch import nn
from transformers.core_model_loading import ConversionOps, WeightConverter

from .layout import layout_of
from .linear import absent_bias_pieces
from .merged import find_merged_linear, find_merged_module
from .quant import check_quantized_pieces
from .quantized import split_load, split_state
from .streaming import PreallocatedConcatenate

# Checkpoint names are used as regexes by Transformers; restricting them to dotted identifiers means no character in
# them can act as a regex operator (a `.` matching any char is harmless between identifiers).
_NAME_RE = re.compile(r"[A-Za-z_]\w*(\.\w+)*")

# Prepended to each source pattern: the piece name must start the key or follow a `.`, so `q_proj` cannot match
# `xq_proj`. Transformers strips `(?...)` groups when it reverses a transform, so the saved names stay plain.
_LEFT_BOUNDARY = r"(?<![^.])"


def tensors_of(value: Any) -> list[torch.Tensor]:
    """Transformers passes either one tensor or a list of tensors per pattern to a conversion op; normalise to a list."""
    return list(value) if isinstance(value, (list, tuple)) else [value]


class MergedColumnConcatenate(PreallocatedConcatenate):
    """Load direction: concatenate the checkpoint's pieces (in mapping order) into the merged weight or bias.

    Same maths as Transformers' `Concatenate`; it differs in two ways. Its `reverse_op` is `MergedColumnSplit`
    (size-aware) instead of an equal `Chunk`. And it checks the piece sizes against the target module's `output_sizes`,
    so a missing piece or a mapping order that disagrees with the module fails loudly (Transformers reports it as a
    conversion error and leaves the parameter missing) rather than loading a silently mis-split weight.

    The merge itself (`PreallocatedConcatenate`, fusegen/runtime/streaming.py) allocates the merged tensor once and
    reads each piece into its slice, from the checkpoint file when the piece is an untouched view of it.
    """

    def __init__(self, dim: int = 0):
        super().__init__(dim=dim)

    @torch.no_grad()
    def convert(
        self,
        input_dict: dict[str, Any],
        source_patterns: list[str],
        target_patterns: list[str],
        full_layer_name: str | None = None,
        model: nn.Module | None = None,
        **kwargs,
    ) -> dict[str, torch.Tensor]:
        check_quantized_pieces(input_dict, full_layer_name, model)
        merged = find_merged_linear(model, full_layer_name)
        input_dict = _with_absent_bias(input_dict, source_patterns, full_layer_name, merged)
        pieces = [t.shape[self.dim] for p in source_patterns if p in input_dict for t in tensors_of(input_dict[p])]
        if merged is not None and pieces != list(merged.output_sizes):
            raise ValueError(
                f"{full_layer_name}: checkpoint pieces have sizes {pieces} along dim {self.dim}, "
                f"but the merged module expects output_sizes={merged.output_sizes}"
            )
        # A one-element list, as Transformers' loader hands a plain checkpoint tensor on: its quantize ops then
        # receive the merged tensor as they receive any other (optimum-quanto's takes `value[0]`, which of a bare
        # tensor would be its first row); the loader unwraps it when no quantize op follows.
        merged_tensors = super().convert(input_dict, source_patterns, target_patterns, **kwargs)
        layout = layout_of(merged) if merged is not None else None
        if layout is not None and not layout.is_contiguous:  # the pieces' rows interleaved as the kind declared
            order = layout.order()
            merged_tensors = {
                key: value.index_select(self.dim, order.to(value.device)) for key, value in merged_tensors.items()
            }
        return {key: [value] for key, value in merged_tensors.items()}

    @property
    def reverse_op(self) -> ConversionOps:
        return MergedColumnSplit(self.dim)


class MergedColumnSplit(ConversionOps):
    """Save direction: split a merged weight or bias back into its original tensors by the module's `output_sizes`.

    The sizes come from the live model (not the config) so that whatever the compiler generated is the single source of
    truth. Pieces are views of the merged tensor (no copy, so saving does not double peak memory); safetensors writes
    non-overlapping views of one storage fine.
    """

    def __init__(self, dim: int = 0):
        self.dim = dim

    @torch.no_grad()
    def convert(
        self,
        input_dict: dict[str, Any],
        source_patterns: list[str],
        target_patterns: list[str],
        full_layer_name: str | None = None,
        model: nn.Module | None = None,
        **kwargs,
    ) -> dict[str, torch.Tensor]:
        if len(input_dict) != 1:
            raise ValueError(f"MergedColumnSplit expects exactly one merged tensor, got {list(input_dict)}")
        tensor = tensors_of(next(iter(input_dict.values())))[0]
        # `full_layer_name` is the FIRST piece's full name (e.g. `model.layers.0.self_attn.q_proj.weight`);
        # swap the piece pattern for the merged one to find the module that owns the tensor.
        head, found, tail = _split_at_segment(full_layer_name or "", target_patterns[0])
        merged = find_merged_module(model, head + source_patterns[0]) if found else None
        if merged is None:
            raise ValueError(f"Cannot find the merged linear owning {full_layer_name!r}; need it for its output_sizes")
        sizes = list(merged.output_sizes)
        composed = split_state(merged, tail.lstrip("."), tensor, sizes)
        if composed is not None:
            # A merged linear stacked from quantized pieces (fusegen/runtime/quantized.py): its composer writes each
            # piece's state as the piece itself would have (packed bytes, scales, serialized quant state).
            return dict(zip(target_patterns, composed))
        if len(sizes) != len(target_patterns) or tensor.dim() == 0 or sum(sizes) != tensor.shape[self.dim]:
            raise ValueError(
                f"{full_layer_name}: cannot split a tensor of size {tensor.shape[self.dim]} into {target_patterns} "
                f"with output_sizes={sizes}"
            )
        pieces = dict(zip(target_patterns, layout_of(merged).split(tensor, dim=self.dim)))
        absent = absent_bias_pieces(merged) if _is_bias(full_layer_name) else []
        if not absent:
            return pieces
        # A projection without a bias (Whisper's k_proj) gets no bias tensor back: its rows are zeros fusion added.
        # Full names, since Transformers completes the returned patterns from the first one, which may be dropped.
        return {
            head + target + tail: piece for index, (target, piece) in enumerate(pieces.items()) if index not in absent
        }

    @property
    def reverse_op(self) -> ConversionOps:
        return MergedColumnConcatenate(self.dim)


def _split_at_segment(name: str, piece: str) -> tuple[str, str, str]:
    """`name.partition(piece)` at the last place `piece` is whole dotted segments (`...SelfAttention.q.weight` at
    `q`, not at the `q` of an earlier `sequence`); `(name, "", "")` when it is nowhere."""
    found = None
    for found in re.finditer(rf"(?<![^.]){re.escape(piece)}(?![^.])", name):
        pass
    if found is None:
        return name, "", ""
    return name[: found.start()], piece, name[found.end() :]


def _is_bias(name: str | None) -> bool:
    return (name or "").endswith(".bias")


def _with_absent_bias(
    input_dict: dict[str, Any], source_patterns: list[str], full_layer_name: str | None, merged: nn.Module | None
) -> dict[str, Any]:
    """`input_dict` with a zero tensor for each piece of a merged bias whose projection has no bias.

    A canonical checkpoint has no `k_proj.bias` where the original's k_proj has none; the merged bias still has
    rows for it, which hold zeros (`MergedColumnLinear` keeps them out of the computation). Exactly those pieces
    are filled: a checkpoint tensor for such a piece is replaced by zeros (the original ignores it as unexpected),
    and any other piece that is missing stays missing, so the size check below and the strict loader raise.
    """
    absent = absent_bias_pieces(merged) if _is_bias(full_layer_name) else []
    present = [tensors_of(input_dict[p])[0] for p in source_patterns if p in input_dict]
    if not absent or not present or len(source_patterns) != len(merged.output_sizes):
        return input_dict
    completed = dict(input_dict)
    for index in absent:
        like = present[0]
        completed[source_patterns[index]] = torch.zeros(
            merged.output_sizes[index], dtype=like.dtype, device=like.device
        )
    return completed


class StackedConverter(WeightConverter):
    """The converter of one merged linear: Transformers' `WeightConverter`, idle while a model built split (its merged
    linears as their canonical pieces, fusegen/runtime/quantized.py) loads. Transformers applies at most one
    converter per key, so renaming `q_proj.SCB` to `qkv_proj.SCB` would keep the quantizer's converter from
    reaching it."""

    def rename_source_key(self, source_key: str) -> tuple[str, str | None]:
        """The key with the piece renamed WHERE the pattern matched.

        Transformers' own method replaces the first occurrence of the matched text, which is another place when
        that text also occurs earlier in the key: a bare piece name `k` (UDOP's `SelfAttention.k`, held where no
        parent scopes it) occurs in `block` first, and `encoder.block.0....k.weight` became
        `encoder.blocqkv_proj.0....k.weight`, a name the model lacks, so the merge lost a piece. The match itself
        (scope, boundaries, which pattern) is Transformers' (`_scoped_match`); only the splice is by position."""
        if split_load():
            return source_key, None
        matched = self._scoped_match(source_key)
        if matched is None:
            return source_key, None
        prefix, key, match = matched
        self._was_used = True
        group = next(name for name, value in match.groupdict().items() if value is not None)
        renamed = key[: match.start()] + self.target_patterns[0] + key[match.end() :]
        return (prefix or "") + renamed, self.source_patterns[int(group[1:])]


def _piece_names(merged_name: str, pieces: Iterable[Any]) -> list[str]:
    """Accept vLLM-style `(name, shard_id)` tuples or bare names; only the name and its ORDER matter here."""
    names = [piece[0] if isinstance(piece, (tuple, list)) else piece for piece in pieces]
    if not names:
        raise ValueError(f"{merged_name!r} has no pieces")
    if len(set(names)) != len(names):
        raise ValueError(f"{merged_name!r} lists a piece twice: {names}")
    return names


def _check_name(name: str, what: str) -> str:
    """Reject names that are not dotted identifiers, since Transformers would interpret them as regexes."""
    if not isinstance(name, str) or not _NAME_RE.fullmatch(name):
        raise ValueError(f"{what} must be a dotted identifier, got {name!r}")
    return name


def _join(parent: str | None, name: str) -> str:
    """Qualify a linear name with its owning attribute (e.g. `self_attn.q_proj`) so patterns only match there."""
    return f"{parent}.{name}" if parent else name


def build_stacked_converters(
    stacked: Mapping[str, Sequence[Any]],
    parents: Mapping[str, Sequence[str]] | None = None,
) -> list[WeightConverter]:
    """Build one `WeightConverter` per (merged linear, parent attribute).

    Patterns are `"{parent}.{piece}"` (e.g. `self_attn.q_proj`) without a `.weight` suffix, so one converter handles the
    weight and, when present, the bias (Qwen2 q/k/v) through the same name. The parent pins the match to the right
    sub-module: a bare `q_proj` would also capture e.g. a vision tower's attention. Without a parent entry the bare
    names are used.
    """
    parents = dict(parents or {})
    unknown = set(parents) - set(stacked)
    if unknown:
        raise ValueError(f"parents names merged linears that are not in the mapping: {sorted(unknown)}")
    converters = []
    for merged_name, pieces in stacked.items():
        _check_name(merged_name, "merged linear name")
        names = [_check_name(n, "piece name") for n in _piece_names(merged_name, pieces)]
        owners = parents.get(merged_name) or [None]
        if isinstance(owners, str):
            owners = [owners]
        for parent in owners:
            if parent is not None:
                _check_name(parent, "parent")
            converters.append(
                StackedConverter(
                    source_patterns=[_LEFT_BOUNDARY + _join(parent, n) for n in names],
                    target_patterns=_join(parent, merged_name),
                    operations=[MergedColumnConcatenate(dim=0)],
                )
            )
    return converters


def with_merges(original: list, stacked: list, merge_op: type | None = None) -> list:
    """The conversions to register for a fused class: its original's `original` (what Transformers gives the
    original class at one place of a tree) and its merge converters `stacked`, all copies.

    An original converter whose outputs are exactly one merged linear's pieces is composed with that merge (`_composed`)
    and listed last: saving reverses the list, so the original's legacy tensor is written as the original writes it.
    `merge_op`: a subclass of `MergedColumnConcatenate` put in place of it in the merges (tensor parallelism's
    `PartitionedConcatenate`), so the choice is part of what is registered, not an edit of it afterwards."""
    kept, composed = [], []
    for conversion in original:
        merge = _composed(conversion, stacked)
        (composed if merge is not None else kept).append(merge if merge is not None else conversion)
    conversions = deepcopy([*kept, *stacked, *composed])
    if merge_op is not None:
        for conversion in conversions:
            operations = getattr(conversion, "operations", [])
            for index, op in enumerate(operations):
                if type(op) is MergedColumnConcatenate:
                    operations[index] = merge_op(op.dim)
    return conversions


def conversions_signature(conversions: list) -> tuple:
    """What identifies a list of conversions: each one's kind, patterns and operations (their kinds)."""
    return tuple(
        (
            type(c).__name__,
            tuple(getattr(c, "_original_source_patterns", getattr(c, "source_patterns", ()))),
            tuple(getattr(c, "_original_target_patterns", getattr(c, "target_patterns", ()))),
            tuple(type(op).__name__ for op in getattr(c, "operations", ())),
        )
        for c in conversions
    )


def _reaches(parent: str, head: str) -> bool:
    """Whether pieces the original converter names `{head}q_proj...` are the pieces of a merge held under `parent`.

    By text, not by whole segments, because that is how Transformers applies the original converter: its patterns are
    searched in the key unanchored, so Step3p7's `attn\\.in_proj_weight` converts `...self_attn.in_proj_weight` into
    `...self_attn.q_proj.weight`, the pieces of the merge under `self_attn` (tests/test_checkpoint_renames.py). So the
    pieces reach the merge exactly when `parent.` ends with `head` as text; an empty side leaves the place unpinned."""
    return not head or not parent or (parent + ".").endswith(head)


_PIECE_RE = re.compile(r"(?P<head>(?:[A-Za-z_]\w*\.)*?)(?P<piece>[A-Za-z_]\w*)(?P<tail>\.(?:weight|bias))?")


def _composed(conversion, stacked: list) -> WeightConverter | None:
    """The original's converter `conversion` followed by a merge, when its outputs are exactly the pieces of one
    merged linear, in order (Step3p7's vision `attn.in_proj_weight`, chunked to `attn.q_proj.weight`,
    `attn.k_proj.weight`, `attn.v_proj.weight`): one converter doing both, since Transformers applies at most one
    converter to a key, so the pieces it makes would never reach the merge. Else None (kept as it is)."""
    if not isinstance(conversion, WeightConverter) or isinstance(conversion, StackedConverter):
        return None
    targets = [_PIECE_RE.fullmatch(t.replace("\\", "")) for t in conversion._original_target_patterns]
    if len(targets) < 2 or any(t is None for t in targets):
        return None
    heads, tails = {t["head"] for t in targets}, {t["tail"] or "" for t in targets}
    if len(heads) != 1 or len(tails) != 1:
        return None
    head, tail, pieces = heads.pop(), tails.pop(), [t["piece"] for t in targets]
    for merge in stacked:
        names = [pattern.removeprefix(_LEFT_BOUNDARY) for pattern in merge._original_source_patterns]
        parents = {name.rpartition(".")[0] for name in names}
        if [name.rpartition(".")[2] for name in names] != pieces or len(parents) != 1:
            continue
        parent = parents.pop()
        if not _reaches(parent, head):
            continue
        merged = merge._original_target_patterns[0].rpartition(".")[2]
        return WeightConverter(
            source_patterns=list(conversion._original_source_patterns),
            target_patterns=f"{head}{merged}{tail}",
            operations=[
                ThenMerge(
                    list(conversion.operations), list(conversion.source_patterns), list(conversion.target_patterns)
                )
            ],
        )
    return None


class ThenMerge(ConversionOps):
    """Load direction: the original converter's ops, with its own patterns, then the pieces they produce
    concatenated in order into the merged tensor (checked against the merged linear's `output_sizes`)."""

    def __init__(self, operations: list, sources: list[str], pieces: list[str]):
        self.operations, self.sources, self.pieces = operations, sources, pieces

    @torch.no_grad()
    def convert(self, input_dict, source_patterns, target_patterns, full_layer_name=None, model=None, **kwargs):
        produced = input_dict
        for op in self.operations:
            produced = op.convert(
                produced, self.sources, self.pieces, full_layer_name=full_layer_name, model=model, **kwargs
            )
        tensors = [tensors_of(produced[piece])[0] for piece in self.pieces]
        merged = find_merged_linear(model, full_layer_name)
        sizes = [tensor.shape[0] for tensor in tensors]
        if merged is None or sizes != list(merged.output_sizes) or not layout_of(merged).is_contiguous:
            raise ValueError(
                f"{full_layer_name}: the original's conversion made pieces of sizes {sizes}, which do not stack into "
                f"the merged linear (output_sizes={getattr(merged, 'output_sizes', None)})"
            )
        return {target_patterns[0]: [torch.cat(tensors, dim=0)]}

    @property
    def reverse_op(self) -> ConversionOps:
        return SplitThen([op.reverse_op for op in self.operations[::-1]], self.pieces, self.sources)


class SplitThen(ConversionOps):
    """Save direction of `ThenMerge`: the merged tensor split by `output_sizes` into the pieces, then the original
    converter's reversed ops, so the original's own tensor is written (`attn.in_proj_weight`)."""

    def __init__(self, operations: list, pieces: list[str], sources: list[str]):
        self.operations, self.pieces, self.sources = operations, pieces, sources

    @torch.no_grad()
    def convert(self, input_dict, source_patterns, target_patterns, full_layer_name=None, model=None, **kwargs):
        tensor = tensors_of(next(iter(input_dict.values())))[0]
        merged = find_merged_linear(model, full_layer_name)
        if merged is None or not layout_of(merged).is_contiguous:
            raise ValueError(f"Cannot find the merged linear owning {full_layer_name!r}; need it for its output_sizes")
        produced = dict(zip(self.pieces, tensor.split(list(merged.output_sizes), dim=0)))
        for op in self.operations:
            produced = op.convert(
                produced, self.pieces, self.sources, full_layer_name=full_layer_name, model=model, **kwargs
            )
        return produced

    @property
    def reverse_op(self) -> ConversionOps:
        return ThenMerge([op.reverse_op for op in self.operations[::-1]], self.sources, self.pieces)
