"""PEFT LoRA adapters on fused models, in the canonical (unfused) adapter layout.

An adapter trained on the original model has a LoRA per projection: for piece i of a merged linear (q, k, v),
`delta_i = s * B_i @ A_i` with `A_i: (r_i, in)`, `B_i: (out_i, r_i)` and one scaling `s` (alpha / r). The merged
linear computes `W x` with `W = [W_q; W_k; W_v]` stacked by rows, so the adapted merged linear must compute
`[W_q + delta_q; W_k + delta_k; W_v + delta_v] x` (an absent piece has `delta_i = 0`: vLLM's rule, absent slices
are zero). One PEFT LoRA on the merged linear computes `W x + s * B (A x)`. Choose

    A = [A_q; A_v]                   (the adapted pieces' A stacked by rows: rank R = r_q + r_v)
    B = [[B_q, 0  ],                 (rows of q, columns of q's rank block)
         [0,   0  ],                 (k is not adapted: its rows are zero)
         [0,   B_v]]                 (rows of v, columns of v's rank block)

Then row block i of `B A` is `sum_j B_ij A_j = B_i A_i` (B is zero off its diagonal blocks), so `s * B A x` is
exactly the pieces' deltas in their rows: the same outputs, whatever the ranks and whichever subset is adapted.
The scaling must be one number per merged linear, so pieces with different `alpha / r` are refused.

Training keeps the equality: B's off-block entries are multiplied by a zero mask in the forward
(`BlockDiagonalLinear`), so they get zero gradients and stay zero under any optimizer that leaves a zero-gradient,
zero-valued entry at zero (SGD, Adam(W), with or without weight decay). Each piece's A block then only receives
gradients from its own rows, which is what training the original's separate LoRAs does. The initial adapter is
the original's, number for number: each piece's A and B are drawn as PEFT draws them for that piece's own layer,
in the original's order, and the merged layer's own draws are discarded (`initialise_like_pieces`), so a run
with the same seed starts from the same adapter and leaves the generator in the same state. With `lora_dropout > 0`
each adapted piece gets its own dropout mask, drawn as the original's piece layer draws it (`PieceDropout`).

How it plugs in: `install()` wraps five PEFT methods (the target match, the layer creation, the injection, and the
state-dict remapping on load and save) so that on a fused model PEFT sees canonical names everywhere a user or a
file does: `target_modules=["q_proj", "v_proj"]` (PEFT's llama default) and `["qkv_proj", "gate_up_proj"]` both
mean "these pieces" and are stored canonically, a canonical adapter file loads through `PeftModel.from_pretrained`
and `load_adapter`, and a save writes the canonical per-piece tensors, so the original class loads it. Anything
that cannot be expressed this way raises `AdapterError`; no tensor is ever dropped. Models without merged linears
see PEFT unchanged. `fusegen.runtime` calls `arm()` on import, which installs now if PEFT is imported, or right
after PEFT's own import otherwise, so importing a generated file never imports PEFT.
"""

from __future__ import annotations

import contextvars
import copy
import importlib.abc
import importlib.util
import math
import re
import sys
import warnings
from collections.abc import Mapping
from dataclasses import dataclass

import torch
from torch import nn
from torch.nn import functional as F

from .layout import require_contiguous
from .linear import sizes_attribute
from .merged import stacked_mapping, stored_packed

_PREFIX = "base_model.model."  # what PEFT's files and PeftModel put before the base model's names


class AdapterError(ValueError):
    """A PEFT adapter or config that cannot be mapped onto a fused model's merged linears; the message says which."""


# --------------------------------------------------------------------------------------------------------------------
# The merged linears of a model, and which pieces an adapter config adapts
# --------------------------------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class Merged:
    """A merged linear at `path`, holding `pieces` (canonical names, row order) of `sizes` rows each."""

    path: str
    pieces: tuple[str, ...]
    sizes: tuple[int, ...]

    @property
    def attribute(self) -> str:
        return self.path.rpartition(".")[2]

    def piece_path(self, piece: str) -> str:
        """Where the original model has this piece: `model.layers.0.self_attn.q_proj`."""
        owner = self.path.rpartition(".")[0]
        return f"{owner}.{piece}" if owner else piece


def _base_layer(module: nn.Module) -> nn.Module:
    while isinstance(getattr(module, "base_layer", None), nn.Module):  # PEFT's wrappers keep the wrapped module there
        module = module.base_layer
    return module


def merged_linears(model: nn.Module) -> dict[str, Merged]:
    """Every merged linear of `model` (which may be wrapped by PEFT) by path, with its canonical pieces.

    Found through its owner: a module whose generated file's STACKED_PARAMS_MAPPING names a child of it. The
    sizes are the owner's `<merged>_sizes` (what the forward splits by), so a merged linear replaced by a
    quantizer's or PEFT's module still counts. A `MergedColumnLinear` no mapping explains cannot be mapped, and raises.
    """
    found = {}
    for path, owner in model.named_modules():
        if ".base_layer" in f".{path}":
            continue
        for attribute, pieces in stacked_mapping(owner).items():
            child = owner._modules.get(attribute)
            if child is None:
                continue
            merged_path = f"{path}.{attribute}" if path else attribute
            sizes = getattr(owner, sizes_attribute(attribute), None) or getattr(
                _base_layer(child), "output_sizes", None
            )
            if getattr(_base_layer(child), "output_sizes", None) is not None:
                require_contiguous(_base_layer(child), f"{merged_path}: packing a LoRA adapter")
            if sizes is None or len(sizes) != len(pieces):
                raise AdapterError(f"{merged_path}: cannot tell the sizes of its pieces {list(pieces)}")
            found[merged_path] = Merged(merged_path, tuple(pieces), tuple(sizes))
    for path, module in model.named_modules():
        unexplained = ".base_layer" not in f".{path}" and path not in found
        owner, _, attribute = path.rpartition(".")
        if unexplained and stored_packed(_base_layer(module), attribute, stacked_mapping(model.get_submodule(owner))):
            continue  # stored packed: PEFT adapts it under its own name, as on the original class
        if unexplained and any(cls.__name__ == "MergedColumnLinear" for cls in type(_base_layer(module)).__mro__):
            raise AdapterError(
                f"{path} is a merged linear, but no STACKED_PARAMS_MAPPING names its pieces, so no adapter can be "
                "mapped onto it"
            )
    return found


@dataclass(frozen=True)
class Packing:
    """One adapter's LoRA on one merged linear: the adapted pieces with their ranks (row order), and the scaling."""

    merged: Merged
    ranks: tuple[tuple[str, int], ...]
    alpha: float
    scaling: float

    @property
    def rank(self) -> int:
        return sum(rank for _, rank in self.ranks)

    def blocks(self) -> list[tuple[str, int, int, int, int]]:
        """(piece, first row, rows, first rank column, rank columns) of each adapted piece's block of B."""
        ranks, blocks, row, column = dict(self.ranks), [], 0, 0
        for piece, size in zip(self.merged.pieces, self.merged.sizes):
            if piece in ranks:
                blocks.append((piece, row, size, column, ranks[piece]))
                column += ranks[piece]
            row += size
        return blocks


def _peft():
    """The few PEFT names used here (imported on first use: PEFT is optional)."""
    from peft.tuners.tuners_utils import check_target_module_exists
    from peft.utils.other import get_pattern_key

    return check_target_module_exists, get_pattern_key


def packing_for(config, merged: Merged) -> Packing | None:
    """The pieces of `merged` that the (canonical) LoRA `config` adapts, or None; raises where it cannot be packed.

    Each piece is matched exactly as PEFT matches the original's module of that name (target_modules,
    exclude_modules, layers_to_transform, rank_pattern, alpha_pattern), so the fused model adapts what the
    original would.
    """
    check_target_module_exists, get_pattern_key = _peft()
    ranks, alphas = {}, {}
    for piece in merged.pieces:
        key = merged.piece_path(piece)
        if check_target_module_exists(config, key):
            ranks[piece] = config.rank_pattern.get(get_pattern_key(config.rank_pattern.keys(), key), config.r)
            alphas[piece] = config.alpha_pattern.get(
                get_pattern_key(config.alpha_pattern.keys(), key), config.lora_alpha
            )
    if not ranks:
        return None
    where = f"{merged.path} (merging {', '.join(merged.pieces)})"
    for option, value, supported in (
        ("use_dora", config.use_dora, (False,)),
        ("lora_bias", getattr(config, "lora_bias", False), (False,)),
        ("init_lora_weights", config.init_lora_weights, (True, False, "gaussian")),
    ):
        if not any(value is ok or (isinstance(ok, str) and value == ok) for ok in supported):
            raise AdapterError(f"{where}: LoRA with {option}={value!r} cannot be expressed on a merged linear")
    root = math.sqrt if config.use_rslora else (lambda r: r)
    scalings = {piece: alphas[piece] / root(ranks[piece]) for piece in ranks}
    if len(set(scalings.values())) > 1:
        raise AdapterError(
            f"{where}: the adapted pieces have different LoRA scalings {scalings} (lora_alpha / r); a merged linear "
            "has one scaling per adapter"
        )
    scaling = next(iter(scalings.values()))
    total = sum(ranks.values())
    alpha = sum(alphas.values()) if not config.use_rslora else scaling * math.sqrt(total)
    return Packing(merged, tuple(ranks.items()), alpha, scaling)


# --------------------------------------------------------------------------------------------------------------------
# Configs: fused names in, canonical names stored
# --------------------------------------------------------------------------------------------------------------------


def _expand(names, merged: Mapping[str, Merged], option: str):
    """Replace each merged-linear name (`qkv_proj`, `self_attn.qkv_proj`) by its pieces' names."""
    pieces = {m.attribute: m.pieces for m in merged.values()}
    expanded = []
    for name in names:
        head, _, leaf = name.rpartition(".")
        if leaf in pieces:
            expanded.extend(f"{head}.{piece}" if head else piece for piece in pieces[leaf])
        else:
            expanded.append(name)
    return type(names)(expanded) if isinstance(names, (set, list, tuple)) else expanded


def _check_regex(pattern: str, merged: Mapping[str, Merged], option: str) -> None:
    """A regex is matched against canonical names; one that names a merged linear but none of its pieces cannot be."""
    for m in merged.values():
        if re.fullmatch(pattern, m.path) and not any(re.fullmatch(pattern, m.piece_path(p)) for p in m.pieces):
            raise AdapterError(
                f"{option}={pattern!r} matches the merged linear {m.path} but none of its pieces "
                f"({', '.join(m.pieces)}); adapters are stored under canonical names, so spell the pieces"
            )


def _resolve_all_linear(config, model: nn.Module):
    """`"all-linear"` resolved as PEFT resolves it for the ORIGINAL model, so that the same modules get adapters.

    PEFT's rule is every `nn.Linear` but the output layer, plus one exception: on Transformers 5, for a model type
    whose MoE layers changed from v4 (its `_MOE_TARGET_MODULE_MAPPING`, applied only when the type also has
    `_MOE_FUSED_TARGETS`), PEFT resolves the string to the LEAF names of the linears plus the v4 names of the MoE
    projections and the router (`gate`, `gate_proj`, `up_proj`, `down_proj`), which it then maps to the v5
    parameters (`gate.weight`, `experts.gate_up_proj`, ...) in `convert_peft_config_for_transformers`. The router
    (`DeepseekV3TopkRouter`) is no `nn.Linear`, so only that name list adapts it. fusegen must rewrite the string
    before PEFT sees it (to expand merged names), so it follows the same branch here with PEFT's own function; the
    leaf names of merged linears are then expanded to their pieces by the caller, as the original's leaf names are
    its pieces. Without that branch the fused model gets full module names, no `gate`, and no router adapter."""
    from peft.tuners.tuners_utils import _maybe_include_all_linear_layers

    moe = _peft_moe_mapping(model)
    if moe is not None:
        from peft.utils.transformers_weight_conversion import _resolve_string_target_modules

        return _resolve_string_target_modules(copy.copy(config), model, moe)
    return _maybe_include_all_linear_layers(copy.copy(config), model).target_modules


def _peft_moe_mapping(model: nn.Module) -> dict[str, str] | None:
    """PEFT's v4-to-v5 MoE target mapping for this model's type, where PEFT applies it (see `_resolve_all_linear`);
    None where it does not, or where this PEFT has no such conversion."""
    model_type = getattr(getattr(model, "config", None), "model_type", None)
    try:
        from peft.import_utils import is_transformers_ge_v5
        from peft.utils import transformers_weight_conversion as conversion
    except ImportError:
        return None
    if not is_transformers_ge_v5 or model_type is None:
        return None
    base = getattr(conversion, "_MODEL_TO_CONVERSION_PATTERN", {}).get(model_type)
    mapping = getattr(conversion, "_MOE_TARGET_MODULE_MAPPING", {}).get(base)
    if not mapping or not getattr(conversion, "_MOE_FUSED_TARGETS", {}).get(base):
        return None
    return mapping


def canonicalise_config(config, model: nn.Module, merged: Mapping[str, Merged] | None = None) -> None:
    """Rewrite a LoRA config's fused names to canonical ones, in place (what PEFT saves is then canonical).

    `target_modules=["qkv_proj"]` becomes `["q_proj", "k_proj", "v_proj"]` (each piece gets the config's rank),
    `"all-linear"` becomes the original's linear names, and rank/alpha patterns naming a merged linear name its
    pieces. Options that would keep a merged linear whole (modules_to_save, target_parameters) are refused.
    """
    merged = merged_linears(model) if merged is None else merged
    if not merged:
        return
    targets = config.target_modules
    if isinstance(targets, str) and targets.lower() == "all-linear":
        targets = _resolve_all_linear(config, model)
    if isinstance(targets, str):
        _check_regex(targets, merged, "target_modules")
    elif targets is not None:
        targets = _expand(targets, merged, "target_modules")
    config.target_modules = targets
    excluded = getattr(config, "exclude_modules", None)
    if isinstance(excluded, str):
        _check_regex(excluded, merged, "exclude_modules")
    elif excluded is not None:
        config.exclude_modules = _expand(excluded, merged, "exclude_modules")
    for option in ("rank_pattern", "alpha_pattern"):
        patterns = getattr(config, option) or {}
        rewritten = {}
        for key, value in patterns.items():
            names = _expand([key], merged, option) if re.fullmatch(r"[\w.]+", key) else [key]
            if not isinstance(names, list) or names == [key]:
                _check_regex(rf"(.*\.)?({key})", merged, option)
            rewritten.update(dict.fromkeys(names, value))
        setattr(config, option, rewritten)
    names = {m.attribute for m in merged.values()} | {p for m in merged.values() for p in m.pieces}
    for option in ("modules_to_save", "target_parameters"):
        for name in getattr(config, option, None) or []:
            if name.rpartition(".")[2] in names:
                raise AdapterError(
                    f"{option}={name!r}: {name} is a merged linear or a piece of one on this fused model; "
                    "only LoRA via target_modules is supported there"
                )


# --------------------------------------------------------------------------------------------------------------------
# The LoRA layer on a merged linear
# --------------------------------------------------------------------------------------------------------------------


def _block_mask(blocks, shape, device) -> torch.Tensor:
    mask = torch.zeros(shape, dtype=torch.bool, device=device)
    for _, row, rows, column, columns in blocks:
        mask[row : row + rows, column : column + columns] = True
    return mask


class BlockDiagonalLinear(nn.Linear):
    """LoRA's B for a merged linear: piece i's rows read only piece i's rank block; every other entry is held at 0.

    The forward multiplies the weight by the block mask, so entries outside the blocks get zero gradients and
    keep their value (zero, as created); the state dict is an ordinary `weight`.
    """

    def __init__(self, packing: Packing, *, device=None, dtype=None):
        super().__init__(packing.rank, sum(packing.merged.sizes), bias=False, device=device, dtype=dtype)
        self.blocks = tuple(packing.blocks())
        self._masks: dict[torch.device, torch.Tensor] = {}  # not a buffer: PEFT may build this on meta and move it

    @property
    def mask(self) -> torch.Tensor:
        """True inside the pieces' blocks, on the weight's device (built once per device)."""
        device = self.weight.device
        if device not in self._masks:
            self._masks[device] = _block_mask(self.blocks, self.weight.shape, device)
        return self._masks[device]

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return F.linear(x, self.weight * self.mask)

    def extra_repr(self) -> str:
        return f"{super().extra_repr()}, blocks={[block[0] for block in self.blocks]}"


class PieceDropout(nn.Dropout):
    """LoRA dropout of a merged linear with several adapted pieces: one mask per adapted piece, in row order.

    On the original each adapted piece's LoRA layer applies its own `nn.Dropout` to the shared input `x`, so a
    q/v adapter draws two masks of `x`'s shape, q's then v's (the order the original's forward calls the pieces,
    which is row order wherever `test_lora_dropout_draws_follow_the_originals_calls` finds it). In training this
    returns the pieces' dropped copies of `x` side by side on the last dimension, `[d_q(x), d_v(x)]`, drawn by the
    same `F.dropout` calls in that order: the same masks, the same scaled values, and the generator left where the
    original leaves it. `PieceInputLinear` (LoRA's A) then gives each piece's rank block its own copy. In eval mode,
    or with p = 0, it returns `x` unchanged, as `nn.Dropout` does.
    """

    def __init__(self, p: float, count: int, inplace: bool = False):
        super().__init__(p, inplace)
        self.count = count

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if not self.training or self.p == 0:
            return x
        return torch.cat([F.dropout(x, self.p, True, self.inplace) for _ in range(self.count)], dim=-1)

    def extra_repr(self) -> str:
        return f"{super().extra_repr()}, one mask per piece: {self.count}"


class PieceInputLinear(nn.Linear):
    """LoRA's A for a merged linear whose adapted pieces each see their own dropped copy of the input.

    Given `x` of `in_features` (eval, no dropout) it is `nn.Linear`. Given the `PieceDropout` copies side by side
    (`count * in_features`), rank block i (piece i's A, rows `columns[i]`) reads copy i only:
    `[A_q d_q(x), A_v d_v(x)]`, which is what the original's separate `lora_A` layers compute, each the same
    `F.linear` of the same shapes. The weight and the state dict are an ordinary `(R, in)` A.
    """

    def __init__(self, weight: nn.Parameter, packing: Packing):
        nn.Module.__init__(self)  # nn.Linear's own __init__ would make (and draw) a weight; this one is given
        self.out_features, self.in_features = weight.shape
        self.weight = weight
        self.register_parameter("bias", None)
        self.columns = tuple((column, columns) for _, _, _, column, columns in packing.blocks())

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if x.shape[-1] == self.weight.shape[1]:
            return F.linear(x, self.weight)
        copies = x.split(self.weight.shape[1], dim=-1)
        if len(copies) != len(self.columns):
            raise ValueError(f"{len(copies)} input copies for {len(self.columns)} adapted pieces")
        return torch.cat(
            [F.linear(copy_, self.weight[start : start + rows]) for copy_, (start, rows) in zip(copies, self.columns)],
            dim=-1,
        )


def _pack_layer(layer: nn.Module, adapter: str, packing: Packing) -> None:
    """Make `layer`'s new adapter block-diagonal (off-block entries zeroed), its dropout one mask per adapted
    piece (`PieceDropout`, `PieceInputLinear`), and record how it is packed."""
    old = layer.lora_B[adapter]
    new = BlockDiagonalLinear(packing, device=old.weight.device, dtype=old.weight.dtype)
    if not old.weight.is_meta:
        with torch.no_grad():
            new.weight.copy_(old.weight * new.mask)
    new.weight.requires_grad_(old.weight.requires_grad)
    layer.lora_B[adapter] = new
    dropout = layer.lora_dropout[adapter]
    if isinstance(dropout, nn.Dropout) and dropout.p > 0 and len(packing.ranks) > 1:
        layer.lora_dropout[adapter] = PieceDropout(dropout.p, len(packing.ranks), dropout.inplace)
        # the same parameter: the state dict, the initialisation below and the optimizer see no change
        layer.lora_A[adapter] = PieceInputLinear(layer.lora_A[adapter].weight, packing)
    layer.scaling[adapter] = packing.scaling
    layer.__dict__.setdefault("fusegen_packings", {})[adapter] = packing


def packed_layers(model: nn.Module, adapter: str) -> dict[str, Packing]:
    """Path -> packing of every merged linear of `model` carrying `adapter`."""
    return {
        path: module.fusegen_packings[adapter]
        for path, module in model.named_modules()
        if adapter in getattr(module, "fusegen_packings", {})
    }


def _draws_discarded():
    """A context in which random draws leave the default device's generator (and the CPU's) as they were."""
    device = torch.get_default_device()
    if device.type in ("cpu", "meta"):  # meta draws nothing
        return torch.random.fork_rng(devices=[])
    return torch.random.fork_rng(device_type=device.type)


def _draw_lora(
    in_features: int, rank: int, out_features: int, init, bias: bool = False
) -> tuple[nn.Linear, nn.Linear]:
    """One LoRA's A and B drawn as PEFT's `LoraLayer.update_layer` draws them for an `nn.Linear` target: the two
    constructors (`nn.Linear(in, r)`, `nn.Linear(r, out)`, each drawing its kaiming-uniform weight, B its bias
    too), then `reset_lora_parameters` (True: A kaiming-uniform again; "gaussian": A normal with std 1/r; B and its
    bias zeroed; False: the constructors' draws stay)."""
    a, b = nn.Linear(in_features, rank, bias=False), nn.Linear(rank, out_features, bias=bias)
    if init is True:
        nn.init.kaiming_uniform_(a.weight, a=math.sqrt(5))
    elif init == "gaussian":
        nn.init.normal_(a.weight, std=1 / rank)
    if init is not False:
        nn.init.zeros_(b.weight)
        if bias:
            nn.init.zeros_(b.bias)
    return a, b


@torch.no_grad()
def _initialise_piece(layer: nn.Module, adapter: str, block, init) -> None:
    """Draw one adapted piece's A and B (`_draw_lora`) into its blocks of the merged layer's adapter."""
    _, row, rows, column, rank = block
    a_weight, b_weight = layer.lora_A[adapter].weight, layer.lora_B[adapter].weight
    a, b = _draw_lora(a_weight.shape[1], rank, rows, init)
    a_weight[column : column + rank].copy_(a.weight)
    b_weight[row : row + rows, column : column + rank].copy_(b.weight)


@torch.no_grad()
def initialise_like_pieces(layer: nn.Module, adapter: str, packing: Packing, init) -> None:
    """Give `layer`'s packed adapter the numbers PEFT would draw for each adapted piece's own LoRA on the original.

    For each target PEFT's `update_layer` creates `lora_A = nn.Linear(in, r)` and `lora_B = nn.Linear(r, out)`
    and initialises them (`_draw_lora`). The draws below, made for each adapted piece in row order with the same
    shapes, generator and calls, are bit for bit the original's where the original creates the pieces one after
    the other in row order, at the merged linear's place among the targets; they then leave the generator where
    the original's injection leaves it, and every later target draws the original's numbers too. Where the original
    orders its modules otherwise (deepseek_v3 builds q_b_proj between q_a_proj and kv_a_proj_with_mqa, gemma3's
    Siglip attention builds k, v, q), `replay_in_original_order` draws the whole adapter again in the original's
    order. The merged layer's own draws (one `(R, in)` A, one `(out, R)` B) are discarded (`_draws_discarded`).
    Nothing is drawn when the adapter is created on the meta device (`low_cpu_mem_usage`), as PEFT then draws
    nothing for the pieces either.
    """
    if layer.lora_A[adapter].weight.is_meta:
        return
    for block in packing.blocks():
        _initialise_piece(layer, adapter, block, init)


def original_module_order(model: nn.Module) -> list[str] | None:
    """The module paths of the Transformers class `model` is the fused copy of, in that class's registration order
    (built on the meta device from a copy of the config: nothing allocated, nothing drawn); None when `model` is not
    a generated class or its original cannot be built."""
    from .auto import original_class

    cls = original_class(type(model))
    config = getattr(model, "config", None)
    if cls is None or config is None:
        return None
    try:
        with torch.random.fork_rng(devices=[]), torch.device("meta"), warnings.catch_warnings():
            warnings.simplefilter("ignore")
            original = cls(copy.deepcopy(config))
    except Exception:  # noqa: BLE001 (no order to follow: the adapter keeps the fused model's order, as before)
        return None
    return [name for name, _ in original.named_modules()]


def _generator_states() -> dict:
    """The CPU generator's state and, for another default device, that device's (what LoRA's draws use)."""
    states = {"cpu": torch.get_rng_state()}
    device = torch.get_default_device()
    if device.type not in ("cpu", "meta"):
        states[device.type] = getattr(torch, device.type).get_rng_state()
    return states


def _set_generator_states(states: dict) -> None:
    for kind, state in states.items():
        (torch if kind == "cpu" else getattr(torch, kind)).set_rng_state(state)


def _call_units(model: nn.Module, adapter: str, key: str) -> list[tuple[str, nn.Module, tuple | None]]:
    """What one `_create_and_replace` call at `key` drew for `adapter`: `(canonical path, LoRA layer, block)`, a
    block per adapted piece of a merged linear (row order), None for a whole layer. A parameter target
    (`target_parameters`, PEFT's MoE experts) is its module, with no layer: it cannot be redrawn here."""
    try:
        layer = model.get_submodule(key)
    except AttributeError:
        return [(key.rpartition(".")[0], None, None)]
    packing = getattr(layer, "fusegen_packings", {}).get(adapter)
    if packing is None:
        return [(key, layer, None)]
    where = _relocate(packing, key)
    return [(where.piece_path(block[0]), layer, block) for block in packing.blocks()]


def _redrawable(layer: nn.Module, adapter: str, block) -> bool:
    """A merged linear's piece, or a plain LoRA `nn.Linear` layer without a variant: what `_draw_lora` draws as
    PEFT does."""
    if block is not None:
        return True
    if layer is None:
        return False
    loras = getattr(layer, "lora_A", None)
    lora_a = loras[adapter] if isinstance(loras, nn.ModuleDict) and adapter in loras else None
    return (
        type(lora_a) is nn.Linear
        and adapter not in getattr(layer, "lora_variant", {})
        and isinstance(getattr(layer, "get_base_layer", lambda: None)(), nn.Linear)
    )


@torch.no_grad()
def _redraw(layer: nn.Module, adapter: str, block, init) -> None:
    if block is not None:
        _initialise_piece(layer, adapter, block, init)
        return
    lora_a, lora_b = layer.lora_A[adapter], layer.lora_B[adapter]
    a, b = _draw_lora(lora_a.in_features, lora_a.out_features, lora_b.out_features, init, lora_b.bias is not None)
    lora_a.weight.copy_(a.weight)
    lora_b.weight.copy_(b.weight)
    if lora_b.bias is not None:
        lora_b.bias.copy_(b.bias)


def _same_states(a: dict, b: dict) -> bool:
    return a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)


def replay_in_original_order(
    model: nn.Module, adapter: str, init, order: list[str] | None, calls: list, after
) -> bool:
    """Draw again, in the original's module order, the parts of `adapter`'s initial numbers that the fused model's
    injection drew in another order. Returns whether anything was redrawn.

    PEFT injects in `named_modules()` order and each target draws when it is created (`_create_and_replace`; `calls`
    holds each call's key and the generator's state before it, `after` the state after the injection). A merged
    linear sits at one place, so where the original registers another target between its pieces (deepseek_v3:
    q_a_proj, q_b_proj, kv_a_proj_with_mqa) or its pieces in another order (gemma3's Siglip attention: k, v, q),
    the fused model's draws come in another order: same distribution, other numbers. The calls are cut into the
    shortest runs that draw the same pieces and layers as the same run of the original's order; a run whose order
    differs is drawn again from the generator's state before it, in the original's order (`_draw_lora`: PEFT's own
    calls for an `nn.Linear` target), so each gets the original's numbers. A run consumes the same draws in either
    order, so it ends in the state the next call started from (checked; a warning otherwise), and the generator is
    left as after the injection: where the original's leaves it. A run holding a target that cannot be redrawn
    here (an embedding or a convolution, a LoRA variant) keeps the fused order, with a warning.
    """
    if order is None or not calls:
        return False
    units = [[(path, layer, block) for path, layer, block in _call_units(model, adapter, key)] for key, _ in calls]
    flat = [(index, unit) for index, call in enumerate(units) for unit in call]
    layers = [unit[1] for _, unit in flat if _redrawable(unit[1], adapter, unit[2])]
    if not layers or layers[0].lora_A[adapter].weight.is_meta:  # low_cpu_mem_usage: nothing was drawn
        return False
    position = {name: index for index, name in enumerate(order)}
    if any(unit[0] not in position for _, unit in flat):
        return False
    ranked = sorted(range(len(flat)), key=lambda i: (position[flat[i][1][0]], i))  # the original's order
    redrawn, seen, start, consumed = False, set(), 0, 0
    for call_index, call in enumerate(units):
        seen.update(range(consumed, consumed + len(call)))
        consumed += len(call)
        if seen != set(ranked[:consumed]):
            continue
        run = ranked[start:consumed]
        if run != sorted(run):
            redrawn |= _redraw_run(model, adapter, init, [flat[i][1] for i in run], calls, start_call=flat[start][0],
                                   end_call=call_index + 1, after=after)  # fmt: skip
        start = consumed
    _set_generator_states(after)
    return redrawn


def _redraw_run(model, adapter, init, run, calls, start_call, end_call, after) -> bool:
    """Redraw one run of units (in the given, the original's, order) from the state before `start_call`."""
    unsupported = [path for path, layer, block in run if not _redrawable(layer, adapter, block)]
    if unsupported:
        warnings.warn(
            f"adapter {adapter!r}: the original creates {[path for path, _, _ in run]} in another order than this "
            f"fused model, and {unsupported[:3]} cannot be drawn again here; their initial numbers have the "
            "original's distribution but not its values",
            RuntimeWarning,
            3,
        )
        return False
    _set_generator_states(calls[start_call][1])
    for _, layer, block in run:
        _redraw(layer, adapter, block, init)
    expected = calls[end_call][1] if end_call < len(calls) else after
    if not _same_states(_generator_states(), expected):
        warnings.warn(
            f"adapter {adapter!r}: redrawing {[path for path, _, _ in run]} in the original's order consumed another "
            "amount of random numbers; the later targets' initial numbers are not the original's",
            RuntimeWarning,
            3,
        )
    return True


# --------------------------------------------------------------------------------------------------------------------
# Adapter state dicts: canonical <-> packed
# --------------------------------------------------------------------------------------------------------------------


def _relocate(packing: Packing, path: str) -> Merged:
    """The packing's merged linear as seen from a model where it sits at `path` (PeftModel adds a prefix)."""
    return Merged(path, packing.merged.pieces, packing.merged.sizes)


def _find(state_dict: Mapping, stem: str) -> str | None:
    for key in (stem, _PREFIX + stem, stem.removeprefix(_PREFIX)):
        if key in state_dict:
            return key
    return None


def pack_state_dict(
    state_dict: Mapping[str, torch.Tensor], packings: Mapping[str, Packing], merged: Mapping[str, Merged]
) -> dict[str, torch.Tensor]:
    """A canonical adapter state dict (`...q_proj.lora_A.weight`, no adapter name) with the pieces' tensors packed
    onto the merged linears (`...qkv_proj.lora_A.weight`) as the module docstring derives.

    Raises if an adapted piece is missing or has the wrong rank, or if the file holds a piece the config does not
    adapt (PEFT would otherwise ignore it without a word).
    """
    out = dict(state_dict)
    for path, packing in packings.items():
        where = _relocate(packing, path)
        blocks = packing.blocks()
        a_parts, b_parts = [], []
        for piece, _, rows, _, rank in blocks:
            stem = where.piece_path(piece)
            keys = [_find(out, f"{stem}.lora_A.weight"), _find(out, f"{stem}.lora_B.weight")]
            if None in keys:
                raise AdapterError(f"the adapter has no LoRA weights for {stem}, which its config adapts")
            a, b = out.pop(keys[0]), out.pop(keys[1])
            if a.shape[0] != rank or tuple(b.shape) != (rows, rank):
                raise AdapterError(
                    f"{stem}: LoRA A {list(a.shape)} / B {list(b.shape)} in the adapter, rank {rank} and {rows} rows "
                    "expected from its config and the model"
                )
            a_parts.append(a)
            b_parts.append(b)
        prefix = _PREFIX if keys[0].startswith(_PREFIX) and not path.startswith(_PREFIX) else ""
        b_merged = a_parts[0].new_zeros((sum(packing.merged.sizes), packing.rank), dtype=b_parts[0].dtype)
        for (_, row, rows, column, columns), b in zip(blocks, b_parts):
            b_merged[row : row + rows, column : column + columns] = b
        out[f"{prefix}{path}.lora_A.weight"] = torch.cat(a_parts)
        out[f"{prefix}{path}.lora_B.weight"] = b_merged
    for m in merged.values():
        for piece in m.pieces:
            stray = [
                k for k in out if k.removeprefix(_PREFIX).startswith(m.piece_path(piece).removeprefix(_PREFIX) + ".")
            ]
            if stray:
                raise AdapterError(
                    f"the adapter holds {stray[0]}, but its config does not adapt {m.piece_path(piece)} "
                    f"(merged into {m.path}); refusing to drop it"
                )
    return out


def unpack_state_dict(state_dict: dict, packings: Mapping[str, Packing], adapter: str) -> dict:
    """The inverse of `pack_state_dict` on PEFT's save path (keys carry the adapter name): per-piece A and B blocks
    under the canonical names. Raises if B is not block-diagonal (it then has no per-piece form)."""
    out = dict(state_dict)
    for path, packing in packings.items():
        a_key, b_key = f"{path}.lora_A.{adapter}.weight", f"{path}.lora_B.{adapter}.weight"
        if a_key not in out or b_key not in out:
            continue
        a, b = out.pop(a_key), out.pop(b_key)
        mask = _block_mask(packing.blocks(), b.shape, b.device)
        if torch.count_nonzero(b.masked_fill(mask, 0)):
            raise AdapterError(
                f"{b_key} has non-zero entries outside the blocks of its pieces, so it cannot be saved as "
                f"separate {', '.join(piece for piece, _ in packing.ranks)} adapters"
            )
        where = _relocate(packing, path)
        for piece, row, rows, column, columns in packing.blocks():
            stem = where.piece_path(piece)
            out[f"{stem}.lora_A.{adapter}.weight"] = a[column : column + columns].clone()
            out[f"{stem}.lora_B.{adapter}.weight"] = b[row : row + rows, column : column + columns].clone()
    return out


# --------------------------------------------------------------------------------------------------------------------
# The PEFT hooks
# --------------------------------------------------------------------------------------------------------------------

_MERGED = contextvars.ContextVar("fusegen_merged_linears", default=None)
"""The merged linears of the model PEFT is injecting into, by path (set for the duration of `inject_adapter`)."""

_CALLS = contextvars.ContextVar("fusegen_lora_calls", default=None)
"""`(key, generator state before)` of each target created while injecting into a fused model."""


def _inject_adapter(original):
    def inject_adapter(self, model, adapter_name, *args, **kwargs):
        merged = merged_linears(model)
        if not merged:
            return original(self, model, adapter_name, *args, **kwargs)
        config = self.peft_config[adapter_name]
        if (kwargs.get("state_dict") if "state_dict" in kwargs else (args[2] if len(args) > 2 else None)) is not None:
            raise AdapterError(
                f"{type(model).__name__}: injecting from a state dict is not supported on a fused model"
            )
        if config.peft_type.value != "LORA":
            prepared = self._prepare_adapter_config(copy.deepcopy(config), self.get_model_config(model))
            check_target_module_exists, _ = _peft()
            for m in merged.values():
                for key in (m.path, *map(m.piece_path, m.pieces)):
                    if check_target_module_exists(prepared, key):
                        raise AdapterError(
                            f"{config.peft_type.value} targets {key} of {type(model).__name__}, a merged linear or "
                            "a piece of one; only LoRA adapters are supported there"
                        )
            return original(self, model, adapter_name, *args, **kwargs)
        canonicalise_config(config, model, merged)
        order = original_module_order(model) if config.init_lora_weights in (True, False, "gaussian") else None
        token, calls_token = _MERGED.set(merged), _CALLS.set([])
        try:
            with warnings.catch_warnings():  # PEFT checks patterns against merged names; redone below on pieces
                warnings.filterwarnings("ignore", r"The following (rank|alpha)_pattern keys did not match")
                result = original(self, model, adapter_name, *args, **kwargs)
            calls = _CALLS.get()
        finally:
            _MERGED.reset(token)
            _CALLS.reset(calls_token)
        replay_in_original_order(model, adapter_name, config.init_lora_weights, order, calls, _generator_states())
        _warn_unmatched_patterns(config, self.targeted_module_names, merged, adapter_name, model)
        return result

    return inject_adapter


def _warn_unmatched_patterns(config, targeted, merged, adapter_name, model) -> None:
    """PEFT's warning for rank/alpha pattern keys that adapt nothing, judged on canonical names."""
    names = []
    for name in targeted:
        packing = getattr(model.get_submodule(name), "fusegen_packings", {}).get(adapter_name)
        names += (
            [packing.merged.piece_path(piece) for piece, _ in packing.ranks] if name in merged and packing else [name]
        )
    for option in ("rank_pattern", "alpha_pattern"):
        unused = [k for k in getattr(config, option) or {} if not any(re.match(rf"(.*\.)?({k})$", n) for n in names)]
        if unused:
            warnings.warn(f"{option} keys matched no adapted module and were ignored: {unused}", RuntimeWarning, 3)


def _check_target_module_exists(original):
    def check(peft_config, key):
        merged = (_MERGED.get() or {}).get(key)
        if merged is None:
            return original(peft_config, key)
        return packing_for(peft_config, merged) is not None

    return check


def _create_and_replace(original):
    def create_and_replace(self, lora_config, adapter_name, target, target_name, parent, current_key, **kwargs):
        calls = _CALLS.get()
        if calls is not None:  # where each target starts drawing (`replay_in_original_order`)
            calls.append((current_key, _generator_states()))
        merged = (_MERGED.get() or {}).get(current_key)
        if merged is None:
            return original(self, lora_config, adapter_name, target, target_name, parent, current_key, **kwargs)
        packing = packing_for(lora_config, merged)
        config = copy.copy(lora_config)
        config.rank_pattern = {re.escape(current_key): packing.rank}
        config.alpha_pattern = {re.escape(current_key): packing.alpha}
        with _draws_discarded():  # the merged layer's own draws; the pieces' are made below, in their order
            original(self, config, adapter_name, target, target_name, parent, current_key, **kwargs)
            layer = getattr(parent, target_name)
            _pack_layer(layer, adapter_name, packing)
        initialise_like_pieces(layer, adapter_name, packing, lora_config.init_lora_weights)

    return create_and_replace


def _remap_for_load(original):
    def remap(cls, model, config, adapter_name, state_dict):
        packings = packed_layers(model, adapter_name)
        if packings or merged_linears(model):
            state_dict = pack_state_dict(state_dict, packings, merged_linears(model))
        return original.__func__(cls, model, config, adapter_name, state_dict)

    return remap


def _get_adapter_state_dict(original):
    def get(cls, model, config, adapter_name, state_dict, unwanted_adapter_names):
        to_return = original.__func__(cls, model, config, adapter_name, state_dict, unwanted_adapter_names)
        packings = packed_layers(model, adapter_name)
        return unpack_state_dict(to_return, packings, adapter_name) if packings else to_return

    return get


def install() -> None:
    """Teach PEFT (the LoRA tuner) about merged linears; idempotent. Needs PEFT's 0.21 internals."""
    from peft.tuners.lora import LoraModel
    from peft.tuners.tuners_utils import BaseTuner

    if getattr(BaseTuner.inject_adapter, "_fusegen", False):
        return
    wrapped = {
        (BaseTuner, "inject_adapter"): _inject_adapter(BaseTuner.inject_adapter),
        (LoraModel, "_check_target_module_exists"): staticmethod(
            _check_target_module_exists(LoraModel._check_target_module_exists)
        ),
        (LoraModel, "_create_and_replace"): _create_and_replace(LoraModel._create_and_replace),
        (LoraModel, "_remap_adapter_state_dict_for_load"): classmethod(
            _remap_for_load(LoraModel.__dict__["_remap_adapter_state_dict_for_load"])
        ),
        (LoraModel, "_get_adapter_state_dict"): classmethod(
            _get_adapter_state_dict(LoraModel.__dict__["_get_adapter_state_dict"])
        ),
    }
    for (owner, name), function in wrapped.items():
        setattr(owner, name, function)
    BaseTuner.inject_adapter._fusegen = True


# --------------------------------------------------------------------------------------------------------------------
# Transformers' `model.load_adapter`
# --------------------------------------------------------------------------------------------------------------------


def load_adapter(
    model, load, peft_model_id=None, adapter_name=None, peft_config=None, adapter_state_dict=None, **kwargs
):
    """`load_adapter` of a generated model: Transformers' own, given the adapter's tensors already packed.

    Transformers reads adapter files with its own loader (not PEFT's), so the packing happens here: the config is
    made canonical, the pieces each merged linear adapts are worked out from it (as injection will), the file's
    per-piece tensors are packed, and any adapter key left missing or unexpected afterwards raises.
    """
    install()
    merged = merged_linears(model)
    if not merged:
        return load(peft_model_id, adapter_name, peft_config, adapter_state_dict, **kwargs)
    from peft import PeftConfig
    from peft.utils import load_peft_weights

    download = {
        k: kwargs[k] for k in ("revision", "token", "cache_dir", "local_files_only", "subfolder") if k in kwargs
    }
    if peft_config is None:
        peft_config = PeftConfig.from_pretrained(peft_model_id, **download, **(kwargs.get("adapter_kwargs") or {}))
    if peft_config.peft_type.value != "LORA":
        return load(peft_model_id, adapter_name, peft_config, adapter_state_dict, **kwargs)
    if adapter_state_dict is None:
        adapter_state_dict = load_peft_weights(peft_model_id, device="cpu", **download)
    canonicalise_config(peft_config, model, merged)
    if peft_config.target_modules is None:
        from peft.tuners.lora import LoraModel

        peft_config = LoraModel._prepare_adapter_config(peft_config, model.config.to_dict())
    packings = {path: p for path, m in merged.items() if (p := packing_for(peft_config, m)) is not None}
    packed = pack_state_dict(adapter_state_dict, packings, merged)
    info = load(peft_model_id, adapter_name, peft_config, packed, **kwargs)
    name = adapter_name or "default"
    made = packed_layers(model, name)
    problems = [
        f"{path}: packed {made.get(path)} vs planned {p}" for path, p in packings.items() if made.get(path) != p
    ]
    # Transformers' missing keys are filtered by substring (adapter "y" matches "layers"): keep this adapter's own.
    problems += sorted(
        k for k in getattr(info, "missing_keys", ()) or () if f".{name}." in k or k.endswith(f".{name}")
    )
    problems += sorted(getattr(info, "unexpected_keys", ()) or ())
    if problems:
        raise AdapterError(f"adapter {peft_model_id or name!r} did not load completely: {problems[:8]}")
    return info


# --------------------------------------------------------------------------------------------------------------------
# Installing when PEFT is imported
# --------------------------------------------------------------------------------------------------------------------


class _InstallAfterImport(importlib.abc.MetaPathFinder, importlib.abc.Loader):
    """Finds nothing itself: when `peft` is imported, lets the normal finders load it, then calls `install()`.

    It stays armed until PEFT is actually executed: `importlib.util.find_spec("peft")` alone (Transformers'
    `is_peft_available()` asks it) must not disarm it, or a later `import peft` would load PEFT untaught and a
    canonical adapter would then find no `q_proj` on a fused model.
    """

    _searching = False

    def find_spec(self, name, path=None, target=None):
        if name != "peft" or self._searching:
            return None
        self._searching = True  # the normal finders' spec; this finder is skipped while they look
        try:
            spec = importlib.util.find_spec(name)
        finally:
            self._searching = False
        if spec is None or spec.loader is None:
            return spec
        self.loader = spec.loader
        spec.loader = self
        return spec

    def create_module(self, spec):
        return self.loader.create_module(spec)

    def exec_module(self, module):
        if self in sys.meta_path:
            sys.meta_path.remove(self)
        module.__spec__.loader = module.__loader__ = self.loader
        self.loader.exec_module(module)
        try:
            install()
        except Exception as error:  # noqa: BLE001 (an incompatible PEFT must not break `import peft`; say so)
            warnings.warn(f"fusegen.runtime could not teach PEFT about merged linears ({error!r})", stacklevel=2)


def arm() -> None:
    """Install the hooks now if PEFT is imported, else as soon as it is (importing PEFT here would cost seconds)."""
    if "peft" in sys.modules:
        if hasattr(sys.modules["peft"], "PeftModel"):
            install()
        return
    armed = any(isinstance(finder, _InstallAfterImport) for finder in sys.meta_path)
    if not armed and importlib.util.find_spec("peft") is not None:
        sys.meta_path.insert(0, _InstallAfterImport())
