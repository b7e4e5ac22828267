"""Quantized merged linears: built as the original's pieces, composed into one linear after loading where exact.

A quantizer (bitsandbytes, torchao, GPTQ, ...) works per linear: it picks modules by name and type, swaps them for its
own class and loads (or computes) per-module state (`SCB`, `absmax`, `qweight`/`scales`/`g_idx`, ...). Whether the
state of `q_proj`, `k_proj` and `v_proj` stacks into the state of one linear computing `[q; k; v]` depends on the
scheme AND on the checkpoint (nested statistics, act-order permutations, block sizes against piece sizes). So:

1. **Built split** (`split_merged_linears`, when a generated base model is built under a `quantization_config`):
   each merged linear's pieces are built as the original builds them (`nn.Linear(in, size, bias)` under the canonical
   name, registered on the module that owns the merged linear) and the merged attribute becomes a `PiecewiseLinear`
   that calls them and concatenates (one call site, several GEMMs). The state-dict names are then the original's, so
   the quantizer replaces, quantizes and loads every piece exactly as in the original class, and its output is
   exactly the original's piece outputs side by side. Transformers' loader keeps a checkpoint key under its own name
   when the stacked renaming (`q_proj` -> `qkv_proj`) leads to a name the model lacks and the original name exists,
   so the registered stacked converters need no change. Saving a split site is the pieces' own state dict.
2. **Composed where exact** (`compose_merged_linears`, after loading): per site, the first registered `Composer`
   whose `accepts` the pieces builds ONE module of the quantizer's own class holding the row-concatenation of their
   state, or says why it cannot (the site then stays split, still exact). A composer may only stack state that is
   per output row or per block/group within rows of one piece: then the merged module computes, for every output
   row, what that row's piece computes. Anything shared across rows (a per-tensor scale, nested statistics over all
   blocks, blocks straddling two pieces, different schemes, an act-order permutation per piece) stays split. No
   requantization happens anywhere, so nothing is approximated. A site whose pieces tensor parallelism sharded by
   their own rules (`tensor_parallel`, set by fusegen/runtime/tp/piecewise.py) is never composed: its pieces carry
   Transformers' tensor-parallel forwards, which one stacked module would not have.
3. **Saved canonically**: `split_state` (called by the save-direction converter) splits a composed module's
   state-dict entry into the pieces' entries, by the composer that built it.

`register_composer` is the one extension point: a scheme plugs in with a `Composer` (see the bitsandbytes ones at the
end of this module).
"""

from __future__ import annotations

import contextlib
import contextvars
import sys
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import torch
from torch import nn

from .layout import require_contiguous
from .linear import MergedColumnLinear, sizes_attribute
from .merged import merged_modules, stacked_mapping, stored_packed


class PiecewiseLinear(nn.Module):
    """A merged linear kept as its pieces: `forward(x)` is `cat([piece(x) for piece in pieces], -1)`.

    The pieces are registered on the OWNER (the module holding this one) under their canonical names, so the model's
    state dict, the quantizer's module selection and Transformers' loading see exactly the original's modules; this
    module has no parameters. Exactness: each piece is the original's module with the original's state, fed the same
    input, and concatenation copies its output unchanged. `reason` says why the site was not composed.
    """

    def __init__(self, owner: nn.Module, names: Sequence[str], sizes: Sequence[int]) -> None:
        super().__init__()
        self.piece_names = tuple(names)
        self.piece_sizes = list(sizes)
        self.reason = "not composed yet"
        object.__setattr__(self, "_owner", owner)  # not a submodule: the pieces belong to the owner's state dict

    @property
    def owner(self) -> nn.Module:
        """The module the pieces (and this module) are registered on."""
        return self._owner

    def pieces(self) -> list[nn.Module]:
        return [getattr(self._owner, name) for name in self.piece_names]

    def forward(self, input: torch.Tensor) -> torch.Tensor:
        return torch.cat([piece(input) for piece in self.pieces()], dim=-1)

    def extra_repr(self) -> str:
        return f"pieces={list(self.piece_names)}, sizes={self.piece_sizes}, split because: {self.reason}"


@dataclass(frozen=True)
class Composer:
    """How one quantization scheme stacks the loaded pieces of a merged linear, and splits them again on save.

    - `accepts(pieces)`: is every piece a module of this scheme (type check only)?
    - `compose(pieces, sizes)`: the merged module (the scheme's own class, `[sum(sizes), in]`), or a string saying why
      the pieces do not stack exactly (then the site stays split). Must not modify the pieces when refusing.
    - `split(module, leaf, tensor, sizes)`: for a composed `module`, the per-piece tensors of its state-dict entry
      `leaf` (`weight`, `SCB`, `weight.absmax`, ...), in piece order, as the pieces would have saved them. None: the
      composed module is an ordinary merged linear, saved by rows as any other (`MergedColumnSplit`).
    """

    name: str
    accepts: Callable[[list[nn.Module]], bool]
    compose: Callable[[list[nn.Module], list[int]], nn.Module | str]
    split: Callable[[nn.Module, str, torch.Tensor, list[int]], list[torch.Tensor]] | None = None


_COMPOSERS: list[Composer] = []


def register_composer(composer: Composer) -> None:
    """Add (or replace, by name) a scheme's composer; later registrations are tried first."""
    _COMPOSERS[:] = [existing for existing in _COMPOSERS if existing.name != composer.name]
    _COMPOSERS.insert(0, composer)


_SPLIT_BUILD: contextvars.ContextVar[bool] = contextvars.ContextVar("fusegen_split_build", default=False)


@contextlib.contextmanager
def building_split():
    """Build every merged linear split while this is active, even without a `quantization_config` (e.g. a GGUF
    load, where Transformers dequantizes into plain linears named after the checkpoint's canonical names)."""
    token = _SPLIT_BUILD.set(True)
    try:
        yield
    finally:
        _SPLIT_BUILD.reset(token)


def split_requested(config) -> bool:
    return _SPLIT_BUILD.get() or getattr(config, "quantization_config", None) is not None


_LOAD_SCOPE: contextvars.ContextVar[dict | None] = contextvars.ContextVar("fusegen_load_scope", default=None)


@contextlib.contextmanager
def load_scope():
    """One `from_pretrained` call: a model split while it is built marks the scope, and the stacked converters then
    rename nothing (`split_load`), so every checkpoint key reaches the piece of the same name, or the quantizer's own
    converters (`q_proj.SCB` -> `q_proj.weight` for its deserializer), exactly as for the original class."""
    token = _LOAD_SCOPE.set({})
    try:
        yield
    finally:
        _LOAD_SCOPE.reset(token)


def split_load() -> bool:
    """Is the current `from_pretrained` loading into a model built split?"""
    scope = _LOAD_SCOPE.get()
    return bool(scope and scope.get("split"))


# --------------------------------------------------------------------------------------------------------------------
# Build split, compose after loading
# --------------------------------------------------------------------------------------------------------------------


def _owner_of(model: nn.Module, path: str) -> tuple[nn.Module, str]:
    parent, _, attribute = path.rpartition(".")
    return (model.get_submodule(parent) if parent else model), attribute


def split_merged_linears(model: nn.Module) -> None:
    """Replace every `MergedColumnLinear` of `model` by its pieces, as the original builds them (see module docstring).

    Pieces are new `nn.Linear`s of the merged one's device and dtype (a meta model inside `from_pretrained` stays on
    meta); their bias flags are the merged linear's `bias_pieces`. The owner's `<merged>_sizes` list is unchanged.
    """
    mapping = stacked_mapping(model)
    for path, module in merged_modules(model).items():
        if not isinstance(module, MergedColumnLinear) or stored_packed(module, path.rpartition(".")[2], mapping):
            continue  # a packed checkpoint tensor is quantized as the one linear the original class has
        require_contiguous(module, f"{path}: quantization")  # PiecewiseLinear concatenates in piece order
        owner, attribute = _owner_of(model, path)
        names = mapping.get(attribute)
        if names is None or len(names) != len(module.output_sizes):
            raise ValueError(f"{path}: no stacked mapping of {len(module.output_sizes)} pieces for {attribute!r}")
        clash = [name for name in names if name in owner._modules or name in owner._parameters]
        if clash:
            raise ValueError(f"{path}: cannot place its pieces on {type(owner).__name__}, it already has {clash}")
        has_bias = module.bias_pieces if module.bias is not None else [False] * len(names)
        factory = {"device": module.weight.device, "dtype": module.weight.dtype}
        for name, size, bias in zip(names, module.output_sizes, has_bias):
            owner.add_module(name, nn.Linear(module.in_features, size, bias=bias, **factory))
        # Straight into _modules: the registration hook that carries `output_sizes` to a replacement must not make
        # this parameterless module look like a merged linear to loading, saving, PEFT or TP.
        owner._modules[attribute] = PiecewiseLinear(owner, names, module.output_sizes)
    scope = _LOAD_SCOPE.get()
    if scope is not None:
        scope["split"] = True


def piecewise_sites(model: nn.Module) -> dict[str, PiecewiseLinear]:
    return {path: module for path, module in model.named_modules() if isinstance(module, PiecewiseLinear)}


def compose_merged_linears(model: nn.Module) -> dict[str, str]:
    """Stack each split site into one module where a composer says that is exact; returns {site: reason} of the sites
    left split. Tensors a composer stacks are concatenated copies; the pieces are dropped afterwards."""
    left: dict[str, str] = {}
    for path, site in piecewise_sites(model).items():
        owner, attribute = _owner_of(model, path)
        pieces = site.pieces()
        devices = {p.device for piece in pieces for p in piece.parameters()}
        if getattr(site, "tensor_parallel", False):
            pass  # its pieces carry tensor-parallel forwards (fusegen/runtime/tp/piecewise.py); `reason` says so
        elif any(device.type == "meta" for device in devices):
            site.reason = "a piece is still on the meta device"
        elif len(devices) > 1:
            site.reason = f"pieces on different devices ({sorted(map(str, devices))})"
        else:
            composer = next((c for c in _COMPOSERS if c.accepts(pieces)), None)
            if composer is None:
                types = sorted(
                    {f"{type(piece).__name__} ({type(getattr(piece, 'weight', None)).__name__})" for piece in pieces}
                )
                site.reason = f"no composer stacks pieces of type {', '.join(types)}"
            else:
                merged = composer.compose(pieces, list(site.piece_sizes))
                if isinstance(merged, str):
                    site.reason = f"{composer.name}: {merged}"
                else:
                    merged.output_sizes = getattr(owner, sizes_attribute(attribute), list(site.piece_sizes))
                    merged.fusegen_composer = composer.name
                    for name in site.piece_names:
                        del owner._modules[name]
                    owner._modules[attribute] = merged
                    continue
        left[path] = site.reason
    return left


def split_state(module: nn.Module, leaf: str, tensor: torch.Tensor, sizes: list[int]) -> list[torch.Tensor] | None:
    """The per-piece tensors of state-dict entry `leaf` of a composed `module`, or None if no composer built it."""
    name = getattr(module, "fusegen_composer", None)
    composer = next((c for c in _COMPOSERS if c.name == name), None)
    return None if composer is None or composer.split is None else composer.split(module, leaf, tensor, sizes)


# --------------------------------------------------------------------------------------------------------------------
# Composers
# --------------------------------------------------------------------------------------------------------------------


def _rows(tensor: torch.Tensor, sizes: list[int]) -> list[torch.Tensor]:
    """`tensor` split along dim 0 in proportion to `sizes` (rows, packed bytes, blocks: all scale with the rows)."""
    total = sum(sizes)
    if (
        tensor.dim() == 0
        or (tensor.shape[0] * min(sizes)) % total
        or any((tensor.shape[0] * s) % total for s in sizes)
    ):
        raise ValueError(f"cannot split a tensor of shape {list(tensor.shape)} into pieces of {sizes} rows")
    return list(tensor.split([tensor.shape[0] * size // total for size in sizes]))


def _same(values) -> bool:
    values = list(values)
    return all(value == values[0] for value in values[1:])


def _bias_flags(pieces: list[nn.Module]) -> list[bool]:
    return [piece.bias is not None for piece in pieces]


def _stacked_bias(pieces: list[nn.Module]) -> torch.Tensor | None:
    if not any(_bias_flags(pieces)):
        return None
    return torch.cat([piece.bias.detach() for piece in pieces])


def _plain(piece: nn.Module) -> bool:
    """Plain float `weight` (and `bias`) only: not a quantizer's tensor subclass such as torchao's, which stacks its
    own way, nor a float8 weight with a scale beside it (compressed-tensors' FP8 pieces), whose value is the scaled one.
    """
    parameters = dict(piece.named_parameters(recurse=False))
    return set(parameters) <= {"weight", "bias"} and all(
        type(p) is nn.Parameter and type(p.data) is torch.Tensor and p.is_floating_point() and p.element_size() > 1
        for p in parameters.values()
    )


def _compose_float(pieces: list[nn.Module], sizes: list[int]) -> nn.Module | str:
    """Plain `nn.Linear` pieces (left unquantized, or dequantized by the loader): a `MergedColumnLinear`, whose forward
    is exactly the pieces' (see `MergedColumnLinear`), with zero bias rows for pieces without a bias."""
    weights = [piece.weight for piece in pieces]
    if not _same((w.dtype, w.device, w.shape[1], w.requires_grad) for w in weights):
        return "pieces differ in dtype, device or input size"
    flags = _bias_flags(pieces)
    merged = MergedColumnLinear(
        weights[0].shape[1], sizes, bias=flags if any(flags) else False, device="meta", dtype=weights[0].dtype
    )
    merged.weight = nn.Parameter(torch.cat([w.detach() for w in weights]), requires_grad=weights[0].requires_grad)
    if any(flags):
        bias = torch.cat(
            [
                piece.bias.detach() if piece.bias is not None else torch.zeros(size, dtype=weights[0].dtype,
                                                                                device=weights[0].device)
                for piece, size in zip(pieces, sizes)
            ]
        )  # fmt: skip
        merged.bias = nn.Parameter(bias, requires_grad=weights[0].requires_grad)
    return merged


def _split_rows(module: nn.Module, leaf: str, tensor: torch.Tensor, sizes: list[int]) -> list[torch.Tensor]:
    if tensor.dim() == 0:
        return [tensor.clone() for _ in sizes]  # a scalar describing every row alike (bnb `weight_format`)
    return _rows(tensor, sizes)


register_composer(
    Composer(
        name="float",
        accepts=lambda pieces: all(type(piece) is nn.Linear and _plain(piece) for piece in pieces),
        compose=_compose_float,
    )
)


def _bnb():
    """bitsandbytes if something loaded it (pieces of its classes exist only then); never imported from here."""
    return sys.modules.get("bitsandbytes")


def _is_bnb(pieces: list[nn.Module], class_name: str) -> bool:
    bnb = _bnb()
    return bnb is not None and all(type(piece) is getattr(bnb.nn, class_name) for piece in pieces)


def _scb(piece: nn.Module) -> torch.Tensor | None:
    return getattr(piece.weight, "SCB", None) if getattr(piece.weight, "SCB", None) is not None else piece.state.SCB


def _compose_bnb_8bit(pieces: list[nn.Module], sizes: list[int]) -> nn.Module | str:
    """LLM.int8 weights: int8 rows with one absmax scale per row (`SCB`). Stacking rows and their scales is what
    quantizing each piece gives; the matmul then computes each output row from its own int8 row and scale.
    Refused: fp16-weight mode, outlier thresholds that differ, or bias on some pieces only."""
    bnb = _bnb()
    states = [piece.state for piece in pieces]
    if any(state.has_fp16_weights for state in states):
        return "a piece keeps fp16 weights (has_fp16_weights=True)"
    if not _same(state.threshold for state in states):
        return f"outlier thresholds differ: {[state.threshold for state in states]}"
    scales = [_scb(piece) for piece in pieces]
    if any(scale is None for scale in scales):
        return "a piece has no SCB scales (not quantized)"
    flags = _bias_flags(pieces)
    if not _same(flags):
        return f"bias on some pieces only ({flags}): the int8 matmul would add the absent pieces' zero rows too"
    data = [
        (piece.state.CB if piece.weight.CB is None and piece.state.CB is not None else piece.weight).data
        for piece in pieces
    ]
    in_features = pieces[0].in_features
    merged = bnb.nn.Linear8bitLt(
        in_features, sum(sizes), bias=flags[0], has_fp16_weights=False, threshold=states[0].threshold, device="meta"
    )
    weight = torch.cat(data)
    merged.weight = bnb.nn.Int8Params(
        weight, requires_grad=False, has_fp16_weights=False, CB=weight, SCB=torch.cat(scales)
    )
    if flags[0]:
        merged.bias = nn.Parameter(_stacked_bias(pieces), requires_grad=pieces[0].bias.requires_grad)
    return merged


def _compose_bnb_4bit(pieces: list[nn.Module], sizes: list[int]) -> nn.Module | str:
    """4-bit (nf4/fp4) weights, quantized in blocks of `blocksize` consecutive weights of the row-major weight, one
    absmax per block. When every piece holds whole blocks (`size * in_features % blocksize == 0`), the blocks of the
    stacked weight are the pieces' blocks in order, so stacking the packed bytes and the absmax list is what
    quantizing the stacked weight would give, and dequantizing it gives each piece's dequantized rows. Refused:
    nested ("double") statistics (a mean over all blocks of one piece is subtracted), blocks straddling pieces,
    different quant types, codes, block sizes, compute or storage dtypes, CPU-repacked weights."""
    bnb = _bnb()
    states = [piece.weight.quant_state for piece in pieces]
    if any(state is None for state in states):
        return "a piece is not quantized"
    if any(getattr(state, "packing_format_for_cpu", False) for state in states):
        return "a piece was repacked for the CPU kernel (it ran a forward before composing)"
    if any(state.nested for state in states):
        return "nested (double) quantization: each piece's absmax is offset by its own mean"
    if not _same((s.quant_type, s.blocksize, s.dtype, tuple(s.shape[1:])) for s in states):
        return "pieces differ in quant type, block size, dtype or input size"
    if not all(torch.equal(s.code, states[0].code) for s in states[1:]):
        return "pieces use different quantization codes"
    in_features, blocksize = pieces[0].in_features, states[0].blocksize
    straddling = [size for size in sizes if (size * in_features) % blocksize]
    if straddling:
        return f"pieces of {straddling} rows x {in_features} do not fill whole blocks of {blocksize}"
    if not _same((piece.compute_dtype, piece.quant_storage, piece.weight.data.dtype) for piece in pieces):
        return "pieces differ in compute or storage dtype"
    flags = _bias_flags(pieces)
    if not _same(flags):
        return f"bias on some pieces only ({flags})"
    first = pieces[0]
    merged = bnb.nn.Linear4bit(
        in_features,
        sum(sizes),
        bias=flags[0],
        compute_dtype=first.compute_dtype,
        compress_statistics=False,
        quant_type=states[0].quant_type,
        quant_storage=first.quant_storage,
        device="meta",
    )
    state = bnb.functional.QuantState(
        absmax=torch.cat([s.absmax for s in states]),
        shape=torch.Size([sum(sizes), in_features]),
        code=states[0].code,
        blocksize=blocksize,
        quant_type=states[0].quant_type,
        dtype=states[0].dtype,
    )
    merged.weight = bnb.nn.Params4bit(
        torch.cat([piece.weight.data for piece in pieces]),
        requires_grad=False,
        quant_state=state,
        blocksize=blocksize,
        compress_statistics=False,
        quant_type=states[0].quant_type,
        quant_storage=first.quant_storage,
        module=merged,
        bnb_quantized=True,
    )
    merged.quant_state = state
    merged.compute_type_is_set = first.compute_type_is_set
    if flags[0]:
        merged.bias = nn.Parameter(_stacked_bias(pieces), requires_grad=first.bias.requires_grad)
    return merged


def _split_bnb_4bit(module: nn.Module, leaf: str, tensor: torch.Tensor, sizes: list[int]) -> list[torch.Tensor]:
    """Save direction: packed bytes, biases and absmax split with the rows; the serialized quant state (it records the
    weight's shape) is written again for each piece's shape; the code table is the same for every piece."""
    bnb = _bnb()
    if leaf in ("weight", "bias"):
        return _rows(tensor, sizes)
    state = module.weight.quant_state
    # After a CPU forward, bitsandbytes keeps absmax as [blocks per row, rows] (its save restores the weight bytes but
    # not this layout, for the original's linears alike): then each piece's absmax is its columns.
    absmax = _rows(state.absmax, sizes) if state.absmax.dim() == 1 else [t.T for t in _rows(state.absmax.T, sizes)]
    pieces = [
        bnb.functional.QuantState(
            absmax=part,
            shape=torch.Size([size, *state.shape[1:]]),
            code=state.code,
            blocksize=state.blocksize,
            quant_type=state.quant_type,
            dtype=state.dtype,
        ).as_dict(packed=True)
        for part, size in zip(absmax, sizes)
    ]
    key = leaf.removeprefix("weight.")
    if any(key not in piece for piece in pieces):
        raise ValueError(f"bitsandbytes 4-bit state {leaf!r} has no per-piece counterpart")
    return [piece[key].clone() for piece in pieces]  # the code table is one tensor shared by every piece's state


register_composer(
    Composer(
        name="bitsandbytes-8bit",
        accepts=lambda pieces: _is_bnb(pieces, "Linear8bitLt"),
        compose=_compose_bnb_8bit,
        split=_split_rows,
    )
)
register_composer(
    Composer(
        name="bitsandbytes-4bit",
        accepts=lambda pieces: _is_bnb(pieces, "Linear4bit"),
        compose=_compose_bnb_4bit,
        split=_split_bnb_4bit,
    )
)
