"""Serving a fused model in vLLM: fusegen's classes, with vLLM's tensor-parallel linears in place of the merged ones.

vLLM's Transformers backend builds the base model with `AutoModel.from_config(config, trust_remote_code=...)` (a
`fusegen export` maps `AutoModel` to the fused base class), keeps every module's own forward, and swaps leaf modules
for its own: each `nn.Linear` by the parallel class its `tp_plan` style names, and modules one of its *fusers*
recognises by a fused equivalent. A `MergedColumnLinear` is an `nn.Linear` whose style (`fusegen_merged_colwise`)
vLLM does not know, so without this module it becomes a `ReplicatedLinear`: right at one process, wrong at two, and
invisible to LoRA (`packed_modules_mapping` stays empty).

`register` (the `vllm.general_plugins` entry point `fusegen`, run by vLLM in every process before a model is built)
puts two fusers first in the backend's fuser list: `OriginalNormFuser` (fusegen's norms get vLLM's RMSNorm kernel
exactly where vLLM gives it to the original norm class; see its docstring) and `MergedLinearFuser`. For every module
holding a merged linear of a generated file, `MergedLinearFuser`:

- replaces each merged linear by the vLLM layer that shards the ORIGINAL projections the same way:
  q/k/v (shard ids "q", "k", "v" in the file's `STACKED_PARAMS_MAPPING`) -> `QKVParallelLinear` (query heads split,
  kv heads split or, when fewer than the processes, replicated), other merges (integer shard ids, gate/up) ->
  `MergedColumnParallelLinear` (each piece split into equal row blocks). So each process holds exactly the rows vLLM
  gives it for the original checkpoint, in the order `[q_r; k_r; v_r]` / `[gate_r; up_r]`;
- sets the owner's split sizes (`qkv_proj_sizes`, the list the generated forward splits by) to this process's
  piece widths; the generated forward is otherwise untouched, so the rows are split exactly where the pieces are;
- contributes the stacked mapping to vLLM's weight mapper (`q_proj` -> `(qkv_proj, "q")`), so every checkpoint tensor
  goes through its vLLM parameter's `weight_loader` with that shard id (a fused-layout tensor, with no shard id, is
  split by the layer itself in q, k, v order, the order the file's mapping has), and to `packed_modules_mapping`
  (LoRA and quantization see `qkv_proj = [q_proj, k_proj, v_proj]`);
- logs which fusegen class it serves and from which file.

What is refused, loudly (the engine does not start), rather than served wrong: a merged linear whose pieces have
different bias flags (vLLM's layers have one bias for all pieces), q/k/v widths that are not whole heads, a merged
linear whose tensor-parallel rule is not `fusegen_merged_colwise` (MLA's replicated `fused_qkv_a_proj`) at more than one
process, and a model whose merged linears vLLM replaced without this plugin (`load_weights`: the plugin was not
loaded).

Everything else (o_proj/down_proj as `RowParallelLinear` from the file's `TP_PLAN`, vocabulary-parallel embeddings and
LM head, vLLM's attention behind the Transformers attention interface) is vLLM's backend doing what it does for the
original classes. This module imports vLLM; only vLLM (through the plugin) and `FusedPreTrainedMixin.load_weights`
inside vLLM import it.
"""

from __future__ import annotations

import logging
import sys
from collections.abc import Iterable, Iterator
from dataclasses import dataclass
from typing import ClassVar

import torch
from torch import nn
from vllm.model_executor.layers.linear import MergedColumnParallelLinear, QKVParallelLinear
from vllm.model_executor.models.transformers import fuser as backend
from vllm.model_executor.models.transformers.fusers import BaseFuser, RMSNormFuser
from vllm.model_executor.models.transformers.fx_utils import trace
from vllm.model_executor.models.utils import AutoWeightsLoader

from .auto import original_name
from .linear import MergedColumnLinear, sizes_attribute
from .tp import MERGED_COLWISE
from .version import source_module

logger = logging.getLogger("vllm.fusegen")  # under vLLM's logger, so its handler and level apply

FUSEGEN_PIECES = "fusegen_pieces"
"""Attribute set on each vLLM layer that replaces a merged linear: its `(piece name, shard id)` pairs."""


def register() -> None:
    """The `vllm.general_plugins` entry point: put `MergedLinearFuser` first among the backend's fusers (idempotent)."""
    missing = tuple(fuser for fuser in (MergedLinearFuser, OriginalNormFuser) if fuser not in backend.FUSERS)
    backend.FUSERS = (*missing, *backend.FUSERS)


def _generated_module(module: nn.Module):
    """The generated file defining `module`'s class, if it is one (it has a `STACKED_PARAMS_MAPPING`)."""
    found = sys.modules.get(type(module).__module__)
    return found if isinstance(getattr(found, "STACKED_PARAMS_MAPPING", None), dict) else None


@dataclass
class MergedLinearFuser(BaseFuser):
    """vLLM fuser for a module of a generated file holding merged linears (see the module docstring).

    It does not rewrite the forward (`redefines_forward = False`): the module keeps fusegen's generated forward, which
    already calls one merged GEMM and splits by the owner's sizes list; only the linears themselves are replaced.
    """

    redefines_forward: ClassVar[bool] = False

    source_cls: str
    source_file: str
    merged: tuple[tuple[str, tuple[tuple[str, object], ...]], ...]
    """(merged attribute, ((piece, shard id), ...)) for each merged linear of the module, in attribute order."""

    @classmethod
    def match(cls, graph, module: nn.Module) -> MergedLinearFuser | None:
        generated = _generated_module(module)
        if generated is None:
            return None
        stacked = generated.STACKED_PARAMS_MAPPING
        merged = tuple(
            (name, tuple((piece, shard) for piece, shard in stacked[name]))
            for name, child in module.named_children()
            if isinstance(child, MergedColumnLinear) and name in stacked
        )
        if not merged:
            return None
        return cls(source_cls=type(module).__qualname__, source_file=str(generated.__file__), merged=merged)

    def info(self, name: str) -> str:
        layers = "; ".join(
            f"{merged} ({' + '.join(piece for piece, _ in pieces)}) -> {_vllm_class(pieces).__name__}"
            for merged, pieces in self.merged
        )
        return f"fusegen: {name} is {self.source_cls} from {self.source_file}, its generated forward kept; {layers}"

    def validate(self, module: nn.Module, vllm_config) -> bool:
        return True  # what cannot be served is refused in `fuse`, loudly, not skipped

    def fuse(self, module: nn.Module, prefix: str, vllm_config) -> nn.Module:
        tp_size = vllm_config.parallel_config.tensor_parallel_size
        for name, pieces in self.merged:
            old = getattr(module, name)
            where = f"{prefix}.{name} ({self.source_cls}, {self.source_file})"
            _check_servable(module, name, old, tp_size, where)
            new = _vllm_linear(module, old, pieces, vllm_config, prefix=f"{prefix}.{name}", where=where)
            setattr(new, FUSEGEN_PIECES, pieces)
            setattr(module, name, new)
            setattr(module, sizes_attribute(name), _local_sizes(new))
        _localise_heads(module)
        return module

    def orig_to_new_stacked(self, prefix: str) -> dict[str, tuple[str, object]]:
        return {
            f"{prefix}.{piece}": (f"{prefix}.{merged}", shard)
            for merged, pieces in self.merged
            for piece, shard in pieces
        }

    @property
    def packed_modules_mapping(self) -> dict[str, list[str]]:
        return {merged: [piece for piece, _ in pieces] for merged, pieces in self.merged}


def _is_qkv(pieces) -> bool:
    return [shard for _, shard in pieces] == ["q", "k", "v"]


def _vllm_class(pieces) -> type:
    return QKVParallelLinear if _is_qkv(pieces) else MergedColumnParallelLinear


def _tp_rule(module: nn.Module, name: str) -> str | None:
    """The generated file's `TP_PLAN` rule for the merged linear `name` of `module` (matched by attribute path).

    None for a module whose own config carries no `base_model_tp_plan`: a multimodal file's `TP_PLAN` is its text
    config's (`fusegen.compiler.mappings.planned_config`), and a vision tower's attention (Siglip's, config the
    vision config) is not split by Transformers, so the rule of the text model's `qkv_proj` is not its rule."""
    config = getattr(module, "config", None)
    if config is not None and not getattr(config, "base_model_tp_plan", None):
        return None
    plan = getattr(_generated_module(module), "TP_PLAN", None) or {}
    return next((style for key, style in plan.items() if key.rpartition(".")[2] == name), None)


def _check_servable(module: nn.Module, name: str, old: nn.Module, tp_size: int, where: str) -> None:
    flags = list(getattr(old, "bias_pieces", [old.bias is not None]))
    if any(flags) and not all(flags):
        raise ValueError(
            f"fusegen: {where}: pieces with and without a bias {flags}; vLLM's merged layers have one bias"
        )
    rule = _tp_rule(module, name)
    if tp_size > 1 and rule != MERGED_COLWISE:
        raise ValueError(
            f"fusegen: {where}: tensor-parallel rule {rule!r}, not {MERGED_COLWISE!r}; this merged linear cannot be "
            f"served at tensor_parallel_size={tp_size} (serve it at 1)"
        )


def _head_dim(module: nn.Module, old: nn.Module, where: str) -> int:
    head_dim = getattr(module, "head_dim", None)
    q, k, v = old.output_sizes
    if not isinstance(head_dim, int) or head_dim <= 0 or q % head_dim or k % head_dim or k != v:
        raise ValueError(f"fusegen: {where}: q/k/v widths {old.output_sizes} are not whole heads of {head_dim}")
    return head_dim


def _vllm_linear(module: nn.Module, old: nn.Module, pieces, vllm_config, *, prefix: str, where: str) -> nn.Module:
    """The vLLM layer holding what vLLM would give this process of the original pieces (see the module docstring)."""
    common = {
        "bias": old.bias is not None,
        "quant_config": vllm_config.quant_config,
        "prefix": prefix,
        "return_bias": False,
    }
    if _is_qkv(pieces):
        head_dim = _head_dim(module, old, where)
        q, k, _ = old.output_sizes
        return QKVParallelLinear(old.in_features, head_dim, q // head_dim, k // head_dim, **common)
    if [shard for _, shard in pieces] != list(range(len(pieces))):
        raise ValueError(f"fusegen: {where}: shard ids {[shard for _, shard in pieces]} are neither q/k/v nor 0..n-1")
    return MergedColumnParallelLinear(old.in_features, list(old.output_sizes), **common)


def _local_sizes(layer: nn.Module) -> list[int]:
    """This process's width of each piece, in row order: what the generated forward must split the output by."""
    if isinstance(layer, QKVParallelLinear):
        return [layer.num_heads * layer.head_size, layer.num_kv_heads * layer.head_size] + [
            layer.num_kv_heads * layer.v_head_size
        ]
    return [size // layer.tp_size for size in layer.output_sizes]


def _localise_heads(module: nn.Module) -> None:
    """Head counts of an attention module whose q/k/v became a `QKVParallelLinear`: this process's, as vLLM holds them.

    vLLM's attention reads its own head counts; these attributes are kept consistent for anything else reading them
    (`num_key_value_groups` for `repeat_kv`), as the Transformers tensor-parallel path does (`LocalHeadsParallel`).
    """
    qkv = next((child for child in module.children() if isinstance(child, QKVParallelLinear)), None)
    if qkv is None:
        return
    if isinstance(getattr(module, "num_key_value_groups", None), int):
        module.num_key_value_groups = qkv.num_heads // qkv.num_kv_heads
    for attribute, value in (("num_heads", qkv.num_heads), ("num_key_value_heads", qkv.num_kv_heads)):
        if isinstance(getattr(module, attribute, None), int):
            setattr(module, attribute, value)


class OriginalNormFuser(RMSNormFuser):
    """vLLM's norm kernel for a fusegen norm, exactly where vLLM uses it for the original norm class.

    vLLM's `RMSNormFuser` recognises a norm from a trace of its forward; the generated norm's forward (one guarded
    `F.rms_norm` call, the original statements below the guard) is not a pattern it knows, so vLLM would run it as
    plain torch code. The generated norm computes, by construction, exactly what the original norm computes (the
    rmsnorm fusion's soundness argument, fusegen/fusions/rmsnorm.py), and its class keeps the original's attributes
    (the same `__init__`). So this asks vLLM's own matcher about the ORIGINAL class: a twin of the module with the
    original class and the same state is traced and matched, and the result (plain or Gemma-style `1 + weight`, which
    attribute holds eps) is applied to the fused module as vLLM applies it to the original one. A norm vLLM would not
    replace in the original is not replaced here either.
    """

    @classmethod
    def match(cls, graph, module: nn.Module) -> RMSNormFuser | None:
        generated = _generated_module(module)
        source = source_module(type(module).__module__) if generated is not None else None
        original = getattr(sys.modules.get(source or ""), original_name(type(module).__name__), None)
        if original is None or original is type(module) or next(module.children(), None) is not None:
            return None
        twin = original.__new__(original)
        twin.__dict__.update(module.__dict__)
        twin_graph = trace(twin)
        found = RMSNormFuser.match(twin_graph, twin) if twin_graph is not None else None
        if found is None:
            return None
        return cls(
            zero_centered=found.zero_centered,
            source_cls=f"{type(module).__name__} (fusegen, as vLLM fuses {original.__name__})",
            eps_attr=found.eps_attr,
            eps=found.eps,
        )


# --------------------------------------------------------------------------------------------------------------------
# Loading: vLLM's loader, through each parameter's weight_loader
# --------------------------------------------------------------------------------------------------------------------


def unserved_merged_linears(model: nn.Module) -> list[str]:
    """Paths of the merged linears of a generated model that vLLM replaced without this plugin (no shard ids)."""
    stacked = getattr(sys.modules.get(type(model).__module__), "STACKED_PARAMS_MAPPING", None) or {}
    return [
        path
        for path, child in model.named_modules()
        if path.rpartition(".")[2] in stacked and not hasattr(child, FUSEGEN_PIECES)
    ]


def _canonical_to_stacked(model: nn.Module, weights: Iterable[tuple[str, torch.Tensor]]) -> Iterator:
    """Rename canonical piece tensors (`...self_attn.q_proj.weight`) to their merged layer, with the shard id attached
    as vLLM's mapper does; names vLLM's mapper already renamed (or fused-layout names) pass unchanged."""
    pieces = {
        f"{path}.{piece}" if path else piece: (f"{path}.{merged}" if path else merged, shard)
        for path, child in model.named_modules()
        for merged, layer in child.named_children()
        for piece, shard in getattr(layer, FUSEGEN_PIECES, ())
    }
    for name, tensor in weights:
        owner, _, leaf = name.rpartition(".")
        if owner in pieces and getattr(tensor, "shard_id", None) is None:
            merged, shard = pieces[owner]
            tensor = tensor.detach()
            tensor.shard_id = shard
            name = f"{merged}.{leaf}"
        yield name, tensor


def load_weights(model: nn.Module, weights: Iterable[tuple[str, torch.Tensor]]) -> set[str]:
    """`FusedPreTrainedMixin.load_weights` inside vLLM: each tensor through its vLLM parameter's `weight_loader`.

    Raises before reading a tensor if vLLM replaced a merged linear without the plugin (a replicated layer that would
    load whole q/k/v tensors at every process size and break at two). Unknown names raise in vLLM's loader.
    """
    missing = unserved_merged_linears(model)
    if missing:
        raise RuntimeError(
            f"fusegen: vLLM built {type(model).__name__} without fusegen's vLLM plugin (entry point "
            f"vllm.general_plugins:fusegen), so its merged linears {missing[:3]} are plain vLLM linears; reinstall "
            f"fusegen in this environment (`pip install -e .` or the wheel) and check VLLM_PLUGINS allows 'fusegen'"
        )
    return AutoWeightsLoader(model).load_weights(_canonical_to_stacked(model, weights))


def served_classes(model: nn.Module) -> list[str]:
    """`module.qualname` of every module class in a vLLM model, sorted: what `LLM.apply_model(served_classes)` shows
    a serving engineer (and the tests) about which classes run: fusegen's (`...fused_llama.FusedLlamaAttention`)
    or the original's (`transformers.models.llama.modeling_llama.LlamaAttention`)."""
    return sorted({f"{type(module).__module__}.{type(module).__qualname__}" for module in model.modules()})


__all__ = [
    "FUSEGEN_PIECES",
    "MergedLinearFuser",
    "OriginalNormFuser",
    "load_weights",
    "register",
    "served_classes",
    "unserved_merged_linears",
]
