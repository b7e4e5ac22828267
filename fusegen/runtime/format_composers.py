"""Composers (`fusegen/runtime/quantized.py`) for pre-quantized checkpoint formats: compressed-tensors, fine-grained FP8.

A fused model loads a pre-quantized checkpoint split: each piece of a merged linear is the original's module with the
original's state (see `quantized.py`). A composer stacks the pieces of one site into ONE module of the quantizer's own
kind when, and only when, that module computes for every output row exactly what the row's piece computes; otherwise
it returns the reason and the site stays split (several GEMMs at one call site, still exact). Nothing is requantized.

**compressed-tensors** (`_compose_compressed_tensors`). A piece is an `nn.Linear` carrying a `quantization_scheme`;
its state is what the checkpoint holds (`weight_packed` / `weight` in e4m3, `weight_scale`, `weight_zero_point`,
`weight_shape`, ...), decompressed by compressed-tensors on the first forward. Stacked by name:

- row tensors (`weight`, `weight_packed`, `bias`, and the weight scale and zero point of the `channel`, `group`,
  `tensor_group` and `block` strategies): one block of rows per piece, concatenated. Exact because int/fp8 packing runs
  along the input dimension (a row's bytes are its own), and a per-row or per-group-within-a-row scale multiplies only
  its row. Two of them hold one entry per several rows: `block` scales (one per `block_structure[0]` rows) and the
  zero points of an asymmetric `pack-quantized` scheme (packed `32 // num_bits` rows to an int32 along the rows).
  Each piece must then hold exactly `rows / k` entries (whole blocks, whole int32 words): a piece ending in a partial
  block or word would have it straddle into the next piece (refused);
- `weight_shape`: the merged `[rows, in]`;
- everything else (a `tensor`-strategy scale, static activation scales, `g_idx`, global scales): one value for the
  whole module, so stacked only when every piece holds the same value (bitwise); a per-tensor scale that differs
  between pieces keeps the site split.

All pieces must have the same scheme (weights and activations arguments, format) and the same status (compressed:
a piece already decompressed by a forward is not composed).

**Fine-grained FP8** (`_compose_fp8`, Transformers' `FP8Linear`: e4m3 `weight`, `weight_scale_inv` per block of
`block_size` or per tensor, optional static `activation_scale`). Transformers runs this module only on a GPU or XPU
(on CPU it dequantizes the checkpoint at load, and the pieces are plain float linears for the float composer). Rows of
the weight and rows of blocks of the scale are stacked when every piece holds whole blocks of rows; per-tensor scales
and activation scales must be equal in every piece.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
from torch import nn

from .quantized import Composer, register_composer

# compressed-tensors parameters that hold one block of rows per output row (or per block of rows)
_CT_ROW_TENSORS = {"weight", "weight_packed", "bias"}
_CT_ROW_QPARAMS = {"weight_scale", "weight_zero_point"}
_CT_ROW_STRATEGIES = {"channel", "group", "tensor_group", "block"}


def _row_blocks(tensors: Sequence[torch.Tensor], sizes: Sequence[int]) -> bool:
    """Do the tensors have the same trailing shape, and leading sizes in proportion to the pieces' rows?"""
    if any(t.dim() == 0 for t in tensors) or any(t.shape[1:] != tensors[0].shape[1:] for t in tensors):
        return False
    return all(t.shape[0] * sizes[0] == tensors[0].shape[0] * size for t, size in zip(tensors, sizes))


def _split_rows(tensor: torch.Tensor, sizes: Sequence[int]) -> list[torch.Tensor]:
    """`tensor` cut along dim 0 in proportion to `sizes` (rows, or blocks of rows); raises if it does not divide."""
    total = sum(sizes)
    if tensor.dim() == 0 or any((tensor.shape[0] * size) % total for size in sizes):
        raise ValueError(f"cannot split a tensor of shape {list(tensor.shape)} by rows {list(sizes)}")
    return list(tensor.split([tensor.shape[0] * size // total for size in sizes]))


def _all_equal(tensors: Sequence[torch.Tensor]) -> bool:
    first = tensors[0]
    return all(t.dtype == first.dtype and t.shape == first.shape and torch.equal(t, first) for t in tensors[1:])


# --------------------------------------------------------------------------------------------------------------------
# compressed-tensors
# --------------------------------------------------------------------------------------------------------------------


def _is_compressed_tensors(pieces: list[nn.Module]) -> bool:
    return all(
        type(piece) is nn.Linear
        and type(getattr(piece, "quantization_scheme", None)).__module__.startswith("compressed_tensors")
        for piece in pieces
    )


def _ct_strategy(scheme) -> str | None:
    weights = scheme.weights
    strategy = getattr(weights, "strategy", None) if weights is not None else None
    return str(getattr(strategy, "value", strategy)) if strategy is not None else None


def _ct_stacked(scheme, name: str) -> bool:
    """Is parameter `name` of a piece under `scheme` a block of rows (stacked) rather than one value per module?"""
    return name in _CT_ROW_TENSORS or (name in _CT_ROW_QPARAMS and _ct_strategy(scheme) in _CT_ROW_STRATEGIES)


def _ct_rows_per_entry(scheme, name: str, tensor: torch.Tensor) -> int:
    """How many output rows one leading entry of stacked parameter `name` covers (see the module docstring)."""
    if name in _CT_ROW_TENSORS:
        return 1
    weights = scheme.weights
    if _ct_strategy(scheme) == "block":
        return int(weights.block_structure[0])
    fmt = str(getattr(scheme.format, "value", scheme.format))
    if (
        name == "weight_zero_point"
        and fmt == "pack-quantized"
        and tensor.dtype == torch.int32
        and weights.num_bits < 32
    ):
        return 32 // int(weights.num_bits)
    return 1


def _compose_compressed_tensors(pieces: list[nn.Module], sizes: list[int]) -> nn.Module | str:
    """One compressed-tensors linear holding the pieces' state stacked by rows (see the module docstring)."""
    from compressed_tensors.quantization.lifecycle.forward import set_forward_quantized

    scheme = pieces[0].quantization_scheme
    if any(piece.quantization_scheme != scheme for piece in pieces[1:]):
        return "pieces have different compressed-tensors schemes"
    statuses = {str(getattr(piece, "quantization_status", None)) for piece in pieces}
    if len(statuses) != 1 or "compressed" not in next(iter(statuses)).lower():
        return f"pieces are not all compressed (status {sorted(statuses)}); a forward has decompressed them"
    if any(
        list(piece.buffers(recurse=False))
        or list(piece.children())
        or piece._forward_hooks
        or piece._forward_pre_hooks
        for piece in pieces
    ):
        return "a piece holds buffers, submodules or hooks, which the stacked module would not carry"
    names = [name for name, _ in pieces[0].named_parameters(recurse=False)]
    if any([name for name, _ in piece.named_parameters(recurse=False)] != names for piece in pieces[1:]):
        return "pieces hold different compressed-tensors parameters"
    block = getattr(scheme.weights, "block_structure", None) if scheme.weights is not None else None
    if _ct_strategy(scheme) == "block" and block and any(size % block[0] for size in sizes):
        return f"pieces of {sizes} rows do not hold whole blocks of {block[0]} rows"
    stacked: dict[str, torch.Tensor] = {}
    for name in names:
        tensors = [getattr(piece, name).detach() for piece in pieces]
        if name == "weight_shape":
            stacked[name] = torch.tensor([sum(sizes), *tensors[0][1:].tolist()], dtype=tensors[0].dtype)
        elif _ct_stacked(scheme, name):
            rows = _ct_rows_per_entry(scheme, name, tensors[0])
            exact = all(t.dim() > 0 and t.shape[0] * rows == size for t, size in zip(tensors, sizes))
            if not exact or not _row_blocks(tensors, sizes):
                return (
                    f"{name} of shapes {[list(t.shape) for t in tensors]} is not one entry per {rows} rows of "
                    f"pieces of {sizes} rows (a partial block or packed word would straddle two pieces)"
                )
            stacked[name] = torch.cat(tensors)
        elif _all_equal(tensors):
            stacked[name] = tensors[0].clone()
        else:
            return f"{name} is one value per module and differs between the pieces"
    merged = nn.Linear(pieces[0].in_features, sum(sizes), bias=False, device="meta")
    del merged.weight
    del merged.bias
    for name in names:
        merged.register_parameter(
            name, nn.Parameter(stacked[name], requires_grad=getattr(pieces[0], name).requires_grad)
        )
    if "bias" not in names:
        merged.register_parameter("bias", None)
    merged.quantization_scheme = scheme.model_copy(deep=True)
    merged.quantization_status = pieces[0].quantization_status
    set_forward_quantized(merged)
    return merged


def _split_compressed_tensors(
    module: nn.Module, leaf: str, tensor: torch.Tensor, sizes: list[int]
) -> list[torch.Tensor]:
    """Save direction: each piece's entry as the piece itself holds it."""
    if leaf == "weight_shape":
        return [torch.tensor([size, *tensor[1:].tolist()], dtype=tensor.dtype) for size in sizes]
    if _ct_stacked(module.quantization_scheme, leaf):
        return _split_rows(tensor, sizes)
    return [tensor.clone() for _ in sizes]


register_composer(
    Composer(
        name="compressed-tensors",
        accepts=_is_compressed_tensors,
        compose=_compose_compressed_tensors,
        split=_split_compressed_tensors,
    )
)


# --------------------------------------------------------------------------------------------------------------------
# Fine-grained FP8 (Transformers' FP8Linear)
# --------------------------------------------------------------------------------------------------------------------


def _fp8_linear_class():
    try:
        from transformers.integrations.finegrained_fp8 import FP8Linear
    except ImportError:
        return None
    return FP8Linear


def _is_fp8(pieces: list[nn.Module]) -> bool:
    fp8_linear = _fp8_linear_class()
    return fp8_linear is not None and all(type(piece) is fp8_linear for piece in pieces)


def _compose_fp8(pieces: list[nn.Module], sizes: list[int]) -> nn.Module | str:
    """One `FP8Linear` with the pieces' e4m3 rows and their blocks of scales stacked (see the module docstring)."""
    first = pieces[0]
    settings = [(p.block_size and tuple(p.block_size), p.activation_scheme, p.weight_scale_inv.dtype) for p in pieces]
    if any(setting != settings[0] for setting in settings[1:]):
        return f"pieces differ in block size, activation scheme or scale dtype: {settings}"
    flags = [piece.bias is not None for piece in pieces]
    if any(flag != flags[0] for flag in flags[1:]):
        return f"bias on some pieces only ({flags})"
    scales = [piece.weight_scale_inv.detach() for piece in pieces]
    if first.block_size is None:
        if not _all_equal(scales):
            return "per-tensor weight scales differ between the pieces"
        scale = scales[0].clone()
    else:
        rows = first.block_size[0]
        if any(size % rows for size in sizes):
            return f"pieces of {sizes} rows do not hold whole blocks of {rows} rows (blocks would straddle pieces)"
        scale = torch.cat(scales)
    activation = [piece.activation_scale for piece in pieces]
    if activation[0] is not None and not _all_equal([a.detach() for a in activation]):
        return "static activation scales differ between the pieces"
    scale_fmt = "ue8m0" if scale.dtype != torch.float32 else "float"
    with torch.device("meta"):
        merged = type(first)(
            first.in_features,
            sum(sizes),
            block_size=first.block_size,
            activation_scheme=first.activation_scheme,
            scale_fmt=scale_fmt,
            has_bias=flags[0],
        )
    merged.weight = nn.Parameter(torch.cat([p.weight.detach() for p in pieces]), requires_grad=False)
    merged.weight_scale_inv = nn.Parameter(scale, requires_grad=first.weight_scale_inv.requires_grad)
    if activation[0] is not None:
        merged.activation_scale = nn.Parameter(activation[0].detach().clone(), requires_grad=False)
    if flags[0]:
        merged.bias = nn.Parameter(
            torch.cat([p.bias.detach() for p in pieces]), requires_grad=first.bias.requires_grad
        )
    for attribute in ("_hf_quantized_needs_local_tp", "_deepgemm_disabled"):
        if attribute in first.__dict__:
            setattr(merged, attribute, first.__dict__[attribute])
    return merged


def _split_fp8(module: nn.Module, leaf: str, tensor: torch.Tensor, sizes: list[int]) -> list[torch.Tensor]:
    if leaf in ("weight", "bias") or (leaf == "weight_scale_inv" and module.block_size is not None):
        return _split_rows(tensor, sizes)
    return [tensor.clone() for _ in sizes]  # a per-tensor or activation scale, the same in every piece


register_composer(Composer(name="fp8-fine-grained", accepts=_is_fp8, compose=_compose_fp8, split=_split_fp8))
