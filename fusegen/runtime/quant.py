"""Quantizers on generated fused models: `from_pretrained(..., quantization_config=...)` and pre-quantized checkpoints.

How exactness is kept is `fusegen/runtime/quantized.py`: a fused base model built under a `quantization_config`
(on-the-fly, or the one a pre-quantized checkpoint's config carries) builds every merged linear as the original's
pieces, so the quantizer treats and loads each piece exactly as in the original class, and after loading the pieces
are stacked into one module wherever the scheme makes that exact. This module holds the build hook
(`prepare_quantized`), the registration hook that keeps `output_sizes` on a module replacing a merged linear
(`keep_output_sizes`, e.g. a PEFT layer), and the guard that refuses to merge quantizer state as if it were a float
weight (`check_quantized_pieces`).
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

from .quantized import split_merged_linears, split_requested

_REGISTERED = False


def _carry_output_sizes(parent: nn.Module, name: str, new: nn.Module):
    """Module-registration hook: a module replacing a merged linear keeps its `output_sizes`.

    Sound because a replacement computes the same rows in the same order (a quantized or wrapped linear of the same
    shape); it acts only where the module being replaced is a merged linear, i.e. carries `output_sizes`.
    """
    old = parent._modules.get(name) if isinstance(parent._modules, dict) else None
    sizes = getattr(old, "output_sizes", None) if old is not None and old is not new else None
    if sizes is not None and getattr(new, "output_sizes", None) is None:
        out_features = getattr(new, "out_features", None)
        if isinstance(out_features, int) and out_features != sum(sizes):
            raise ValueError(
                f"{type(new).__name__} replacing merged linear {name!r} has {out_features} output rows, "
                f"its pieces {list(sizes)} have {sum(sizes)}"
            )
        new.output_sizes = list(sizes)


def keep_output_sizes() -> None:
    """Register `_carry_output_sizes` once per process (torch's global module-registration hook)."""
    global _REGISTERED
    if not _REGISTERED:
        torch.nn.modules.module.register_module_module_registration_hook(_carry_output_sizes)
        _REGISTERED = True


def _get(config: Any, key: str, default: Any = None) -> Any:
    return config.get(key, default) if isinstance(config, dict) else getattr(config, key, default)


def _method(config: Any) -> str:
    return str(getattr(_get(config, "quant_method"), "value", _get(config, "quant_method")) or "")


class QuantizationRefused(ValueError):
    """Quantizer state that fusegen would have to merge as if it were a float weight (see `check_quantized_pieces`)."""


def prepare_quantized(model: nn.Module) -> None:
    """What a fused base model does when built: keep `output_sizes` on replacements, and build the merged linears split
    (their canonical pieces) under a `quantization_config` or `building_split()` (see fusegen/runtime/quantized.py)."""
    keep_output_sizes()
    if split_requested(model.config):
        split_merged_linears(model)


_LINEAR_TENSORS = {"weight", "bias"}


def check_quantized_pieces(input_dict: dict[str, Any], merged_name: str | None, model: nn.Module | None) -> None:
    """Refuse to merge quantizer state into a float merged linear. Under a `quantization_config` the merged linears
    are built split and never see this; a model built without one (a config object lacking the checkpoint's
    quantization_config) would otherwise concatenate `SCB`, `absmax`, int8 rows ... as if they were a weight.

    A canonical float checkpoint has only a float `weight` (and `bias`) per piece, so anything else is quantized.
    """
    leaf = (merged_name or "").rpartition(".")[2]
    tensors = [t for value in input_dict.values() for t in (value if isinstance(value, (list, tuple)) else [value])]
    quantized = leaf not in _LINEAR_TENSORS or any(not t.is_floating_point() for t in tensors)
    if quantized:
        method = _method(_get(getattr(model, "config", None), "quantization_config")) or "unknown"
        raise QuantizationRefused(
            f"{merged_name}: the checkpoint holds pre-quantized pieces ({method}: tensor {leaf!r}, dtype "
            f"{tensors[0].dtype if tensors else '?'}), but the model was built without a quantization_config, so "
            "its merged linears can only take float weights. Load it with the checkpoint's own config.json (its "
            "quantization_config builds the merged linears as their pieces)"
        )
