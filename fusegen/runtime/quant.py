"""Quantizers (`from_pretrained(..., quantization_config=...)`) on generated fused models.

A merged linear stacks the rows of several projections. A quantizer that treats it as one linear gives the original's
numbers exactly when its scheme is *row-separable*: every scale (and every block or group) covers rows of one piece
only, so quantizing `[q; k; v]` at once equals quantizing q, k and v one by one and stacking the results. Per-row
int8 (bitsandbytes LLM.int8, optimum-quanto's per-axis weights, torchao `PerRow`) and groups inside a row are of
that form; a per-tensor scale is not (the merged max is not the max of each piece), nor is bitsandbytes' nested
("double") quantization of the 4-bit absmax (it subtracts their mean over the whole tensor).

What this module does, when a fused base model is built with a `quantization_config` (Transformers puts it on the
config before building the model, and replaces modules after):

- `check_quantization` refuses, by name, a scheme or a `modules_to_not_convert` entry under which the fused model
  would not be quantized as the original is (a false alarm costs a quantized load; a miss returns wrong numbers);
- bitsandbytes selects modules with `type(module) is nn.Linear`, which a `MergedColumnLinear` subclass fails, so for
  it the merged linears are given class `nn.Linear` (same forward, same parameters; `output_sizes` is kept);
- `keep_output_sizes` carries `output_sizes` over when a quantizer swaps the merged module for its own (the generated
  forward and the save-time split read it).

Pre-quantized checkpoints and saving quantized fused models are handled (or refused) by `check_quantized_pieces`
and `check_quantized_save`, called from the checkpoint converters.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

from .layout import require_contiguous
from .linear import absent_bias_pieces

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


def _merged_linears(model: nn.Module) -> dict[str, nn.Module]:
    return {path: m for path, m in model.named_modules() if getattr(m, "output_sizes", None) is not None}


def _pieces(model: nn.Module, path: str) -> list[str]:
    """Piece names of the merged linear at `path`, from the generated file's STACKED_PARAMS_MAPPING."""
    import sys

    stacked = getattr(sys.modules.get(type(model).__module__), "STACKED_PARAMS_MAPPING", None) or {}
    pieces = stacked.get(path.rpartition(".")[2], [])
    return [piece[0] if isinstance(piece, (tuple, list)) else piece for piece in pieces]


def _get(config: Any, key: str, default: Any = None) -> Any:
    return config.get(key, default) if isinstance(config, dict) else getattr(config, key, default)


def _method(config: Any) -> str:
    return str(getattr(_get(config, "quant_method"), "value", _get(config, "quant_method")) or "")


class QuantizationRefused(ValueError):
    """A quantization config under which a fused model would not compute what the original does."""


def _refuse(model: nn.Module, what: str, why: str) -> QuantizationRefused:
    return QuantizationRefused(
        f"{type(model).__name__} ({_get(model.config, '_name_or_path', '') or model.config.model_type}): {what}: "
        f"{why}. Load the original class (e.g. {type(model).__name__.removeprefix('Fused')}) for this scheme."
    )


def _check_skipped(model: nn.Module, config: Any, merged: dict[str, nn.Module]) -> None:
    """A `modules_to_not_convert` entry naming one piece would leave it full precision in the original only."""
    skipped = list(_get(config, "modules_to_not_convert") or []) + list(_get(config, "llm_int8_skip_modules") or [])
    names = {piece for path in merged for piece in _pieces(model, path)} | {p.rpartition(".")[2] for p in merged}
    for entry in skipped:
        hit = sorted(name for name in names if name in str(entry))
        if hit:
            raise _refuse(
                model,
                f"modules_to_not_convert entry {entry!r}",
                f"it names {hit}, which the fused model merges with other projections into one quantized linear",
            )


def _check_bnb(model: nn.Module, config: Any, merged: dict[str, nn.Module]) -> None:
    if not _get(config, "load_in_4bit"):
        return  # LLM.int8: one absmax per weight row, row-separable
    if _get(config, "bnb_4bit_use_double_quant"):
        raise _refuse(
            model,
            "bitsandbytes 4-bit with bnb_4bit_use_double_quant=True",
            "nested quantization subtracts the mean absmax of the whole merged weight (a per-tensor statistic), "
            "so the merged linear would not be quantized as its pieces are",
        )
    blocksize = 64  # what Transformers' Linear4bit (bitsandbytes Params4bit) uses
    for path, module in merged.items():
        in_features = module.weight.shape[1]
        for size in module.output_sizes:
            if (size * in_features) % blocksize:
                raise _refuse(
                    model,
                    f"bitsandbytes 4-bit on {path}",
                    f"a piece of {size}x{in_features} weights does not fill whole blocks of {blocksize}, so blocks "
                    "would straddle two pieces",
                )


def _check_quanto(model: nn.Module, config: Any) -> None:
    if _get(config, "activations") is not None:
        raise _refuse(
            model,
            f"optimum-quanto activations={_get(config, 'activations')!r}",
            "activation quantization keeps one output scale per module, shared by the merged pieces",
        )


_TORCHAO_ROW_SEPARABLE = {
    "Int8WeightOnlyConfig",
    "Int8DynamicActivationInt8WeightConfig",
    "Float8WeightOnlyConfig",
    "Float8DynamicActivationFloat8WeightConfig",
    "Int4WeightOnlyConfig",
    "IntxWeightOnlyConfig",
    "Int8DynamicActivationIntxWeightConfig",
}
_SEPARABLE_GRANULARITY = {"PerRow", "PerGroup", "PerAxis", "PerToken"}


def _granularities(ao_config: Any) -> list[Any]:
    value = getattr(ao_config, "granularity", None)
    values = list(value) if isinstance(value, (list, tuple)) else [value]
    for attribute in ("weight_granularity",):
        if getattr(ao_config, attribute, None) is not None:
            values.append(getattr(ao_config, attribute))
    return values


def _check_torchao(model: nn.Module, config: Any) -> None:
    """Known configs only, each with row or in-row group granularity (torchao's defaults are per-row for int8)."""
    ao_config = _get(config, "quant_type")
    if isinstance(ao_config, dict) and "_default" in ao_config and len(ao_config) == 1:
        ao_config = ao_config["_default"]
    name = type(ao_config).__name__
    if name not in _TORCHAO_ROW_SEPARABLE:
        raise _refuse(
            model,
            f"torchao {name if not isinstance(ao_config, str) else ao_config!r}",
            f"fusegen knows row-separable torchao configs only ({', '.join(sorted(_TORCHAO_ROW_SEPARABLE))})",
        )
    for granularity in _granularities(ao_config):
        if granularity is None and name == "Float8DynamicActivationFloat8WeightConfig":
            granularity = "PerTensor"  # its default
        label = granularity if isinstance(granularity, str) else type(granularity).__name__
        if label == "PerAxis" and getattr(granularity, "axis", None) != 0:
            label = f"PerAxis(axis={getattr(granularity, 'axis', None)})"  # a scale per input column spans all pieces
        if granularity is not None and label not in _SEPARABLE_GRANULARITY:
            raise _refuse(
                model,
                f"torchao {name} with granularity {label}",
                "one scale for the whole merged weight differs from one scale per piece; use PerRow()",
            )


_CHECKS = {"bitsandbytes": _check_bnb, "quanto": _check_quanto, "torchao": _check_torchao}


def check_quantization(model: nn.Module) -> None:
    """Refuse a `config.quantization_config` under which the merged linears would not match the original's pieces.

    Methods other than bitsandbytes, quanto and torchao are refused too: fusegen cannot tell whether they are
    row-separable.
    """
    config = _get(model.config, "quantization_config")
    if config is None:
        return
    merged = _merged_linears(model)
    if not merged:
        return
    for path, module in merged.items():
        require_contiguous(module, f"{path}: quantization")
    without_bias = [path for path, module in merged.items() if absent_bias_pieces(module)]
    if without_bias:
        raise _refuse(
            model,
            f"quantizing {without_bias[0]}",
            "some of its pieces have no bias (their rows of the merged bias are zeros the fused forward leaves out), "
            "and a quantizer's own forward would not leave them out",
        )
    method = _method(config)
    check = _CHECKS.get(method)
    if check is None:
        raise _refuse(
            model,
            f"quantization method {method!r}",
            "fusegen supports bitsandbytes, quanto and torchao on merged linears (schemes whose scales are per "
            "row or per in-row group); others may share a scale across merged projections",
        )
    _check_skipped(model, config, merged)
    if method == "bitsandbytes":
        _check_bnb(model, config, merged)
    else:
        check(model, config)


def prepare_quantized(model: nn.Module) -> None:
    """What a fused base model does when built: check the scheme, then make the merged linears selectable.

    bitsandbytes replaces only modules of type exactly `nn.Linear`; giving a merged linear that class keeps its
    forward (it is `nn.Linear.forward`), parameters and `output_sizes`, so bitsandbytes sees what it sees in the
    original: a linear of the merged shape.
    """
    keep_output_sizes()
    config = _get(model.config, "quantization_config")
    if config is None:
        return
    check_quantization(model)
    if _method(config) == "bitsandbytes":
        for module in _merged_linears(model).values():
            if isinstance(module, nn.Linear) and type(module) is not nn.Linear:
                module.__class__ = nn.Linear


_LINEAR_TENSORS = {"weight", "bias"}


def check_quantized_pieces(input_dict: dict[str, Any], merged_name: str | None, model: nn.Module | None) -> None:
    """Refuse to merge the pieces of a pre-quantized checkpoint (e.g. saved by the original class under bitsandbytes
    or torchao): their quantizer state (`SCB`, `absmax`, `_weight_qdata`, ...) is laid out by each quantizer its own
    way, and concatenating it as if it were a weight loads wrong or leaves the merged linear random.

    A canonical float checkpoint has only a float `weight` (and `bias`) per piece, so anything else is quantized.
    """
    leaf = (merged_name or "").rpartition(".")[2]
    tensors = [t for value in input_dict.values() for t in (value if isinstance(value, (list, tuple)) else [value])]
    quantized = leaf not in _LINEAR_TENSORS or any(not t.is_floating_point() for t in tensors)
    if quantized:
        method = _method(_get(getattr(model, "config", None), "quantization_config")) or "unknown"
        raise QuantizationRefused(
            f"{merged_name}: the checkpoint holds pre-quantized pieces ({method}: tensor {leaf!r}, dtype "
            f"{tensors[0].dtype if tensors else '?'}); fusegen merges only float checkpoints. Load the unquantized "
            "checkpoint into the fused class with quantization_config=..., or load this one with the original class"
        )


def check_quantized_save(model: nn.Module | None, piece_name: str | None, tensor: torch.Tensor, sizes: list[int]):
    """Refuse to save a quantized fused model in a form the original class would misread.

    bitsandbytes 8-bit keeps per-row state (`weight` int8 rows, `SCB` one scale per row) that splits by rows like a
    float weight, and a scalar `weight_format`; that saves canonically. bitsandbytes 4-bit stores the weight packed
    into a column of bytes and torchao writes safetensors metadata keyed by the merged names: refused.
    """
    if model is None or not getattr(model, "is_quantized", False):
        return
    method = getattr(model, "quantization_method", "") or ""
    method = str(getattr(method, "value", method))
    packed = tensor.dim() > 0 and tensor.shape[0] != sum(sizes)
    if "torchao" in method or packed:
        raise QuantizationRefused(
            f"{piece_name}: cannot save a {method}-quantized {type(model).__name__} in the canonical layout "
            f"(the merged tensor {list(tensor.shape)} is {'packed' if packed else 'described by torchao metadata under fused names'}"
            "); save the unquantized fused model, or quantize with the original class"
        )
