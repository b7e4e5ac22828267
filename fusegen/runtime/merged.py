"""What the runtime knows about a model's merged linears: where they are and which canonical pieces they stack.

One place for the lookups every runtime module needs (loading, saving, strict loading, PEFT, tensor parallelism).
Merged linears are found by duck typing on `output_sizes`, not by isinstance, so models built before an
`importlib.reload` of the generated file or of `fusegen.runtime.linear` are still recognised; a module with
`output_sizes` that is not a merged linear would be treated as one, which no Transformers module is.
"""

from __future__ import annotations

import sys
from collections.abc import Mapping

from torch import nn


def merged_modules(model: nn.Module) -> dict[str, nn.Module]:
    """Modules holding merged rows (`output_sizes`), by their path in `model`."""
    return {
        path: module for path, module in model.named_modules() if getattr(module, "output_sizes", None) is not None
    }


def find_merged_linear(model: nn.Module | None, param_name: str | None) -> nn.Module | None:
    """Return the module owning `param_name` if it is a merged linear (has `output_sizes`), else None.

    Converters only get the root model and a parameter name. Depending on whether a ForCausalLM checkpoint is loaded
    into a base model (or the opposite) that name may carry one `base_model_prefix` level too many or too few, so both
    variants are tried.
    """
    if model is None or not param_name:
        return None
    return find_merged_module(model, param_name.rpartition(".")[0])


def find_merged_module(model: nn.Module | None, module_path: str) -> nn.Module | None:
    """`find_merged_linear` by the module's path (a quantized module's state may be `weight.absmax`, two levels down)."""
    if model is None:
        return None
    prefix = getattr(model, "base_model_prefix", "") or ""
    candidates = [module_path]
    if prefix:
        candidates += [module_path.removeprefix(prefix + "."), f"{prefix}.{module_path}"]
    for candidate in candidates:
        try:
            module = model.get_submodule(candidate)
        except AttributeError:
            continue
        if getattr(module, "output_sizes", None) is not None:
            return module
    return None


def stored_packed(module: nn.Module | None, attribute: str, mapping: Mapping) -> bool:
    """Whether the checkpoint stores the merged linear `module` (the child `attribute` of its owner) as one tensor.

    That is a merged linear that declares its row layout (`row_layout`, `fusegen.runtime.layout`) and that no stacked
    mapping splits into canonical pieces: packed q/k/v whose checkpoint is packed already (Falcon's
    `query_key_value`, `fusegen.fusions.packed_qkv`). Its checkpoint tensor is the whole merged tensor, rows in the
    declared order, so loading, saving, quantization and PEFT take it as the one linear the original class has.
    """
    return getattr(module, "row_layout", None) is not None and attribute not in mapping


def stacked_mapping(model: nn.Module, stacked: Mapping | None = None) -> dict[str, tuple[str, ...]]:
    """Merged linear attribute name -> canonical piece names in row order.

    Taken from `stacked` if given, else from the `STACKED_PARAMS_MAPPING` of the module that defines the model's class
    (every generated file has one), so the generated file need not be imported by name. Pieces may be vLLM-style
    `(name, shard_id)` tuples or bare names.
    """
    if stacked is None:
        stacked = getattr(sys.modules.get(type(model).__module__), "STACKED_PARAMS_MAPPING", None) or {}
    return normalise_stacked(stacked)


def normalise_stacked(stacked: Mapping) -> dict[str, tuple[str, ...]]:
    """Drop vLLM shard ids: only the piece names and their order matter for loading."""
    return {
        merged: tuple(piece[0] if isinstance(piece, (tuple, list)) else piece for piece in pieces)
        for merged, pieces in stacked.items()
    }
