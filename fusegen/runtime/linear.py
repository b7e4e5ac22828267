"""Merged (column-stacked) linear layers used by generated fused model files."""

from __future__ import annotations

import operator
from collections.abc import Sequence

import torch
from torch import nn
from torch.nn import functional as F

from .layout import RowLayout, layout_of


def _as_output_sizes(output_sizes: Sequence[int]) -> list[int]:
    """Normalise `output_sizes` to a list of positive Python ints.

    Plain ints matter: `Tensor.split` and `torch.compile` want static Python ints, and configs sometimes hold numpy
    integers. `operator.index` rejects floats (e.g. a `hidden_size / heads` that should have been `//`) instead of
    silently truncating them.
    """
    if isinstance(output_sizes, (str, bytes)) or not isinstance(output_sizes, Sequence):
        raise TypeError(f"output_sizes must be a sequence of ints, got {type(output_sizes).__name__}")
    sizes = [int(operator.index(size)) for size in output_sizes]
    if not sizes:
        raise ValueError("output_sizes must not be empty")
    if any(size <= 0 for size in sizes):
        raise ValueError(f"output_sizes must all be positive, got {sizes}")
    return sizes


def sizes_attribute(merged: str) -> str:
    """The owner's attribute holding a merged linear's split sizes, e.g. `qkv_proj_sizes` for `qkv_proj`.

    Generated forwards split by `self.qkv_proj_sizes`, not `self.qkv_proj.output_sizes`: a wrapper that replaces
    the merged linear (a PEFT LoRA layer, a quantizer's linear) hides `output_sizes`, but never touches its owner.
    The generated `__init__` binds it to the merged linear's own `output_sizes` list, so code that re-partitions
    the linear in place (tensor parallelism) updates both at once.
    """
    return f"{merged}_sizes"


def _as_bias_pieces(bias: bool | Sequence[bool], count: int) -> list[bool]:
    """One flag per piece: does that projection have a bias? A single flag applies to every piece."""
    if isinstance(bias, Sequence) and not isinstance(bias, (str, bytes)):
        flags = [bool(flag) for flag in bias]
        if len(flags) != count:
            raise ValueError(f"bias lists {len(flags)} flags for {count} output_sizes")
        return flags
    return [bool(bias)] * count


def absent_bias_pieces(module: nn.Module) -> list[int]:
    """Indices of the pieces of a merged linear whose projection has no bias (their rows of `bias` are zero)."""
    flags = getattr(module, "bias_pieces", None)
    if getattr(module, "bias", None) is None or not flags:
        return []
    return [index for index, kept in enumerate(flags) if not kept]


class MergedColumnLinear(nn.Linear):
    """Several linears sharing one input, stored as a single `nn.Linear` whose rows are stacked in order.

    Why a subclass of `nn.Linear` and not a new module: the forward is then exactly `nn.Linear.forward` (one GEMM,
    bit-identical semantics; with per-piece bias flags, `F.linear` with the real pieces' bias, see below), and everything in Transformers that special-cases `nn.Linear` (`_init_weights`, meta-device
    construction inside `from_pretrained`, dtype casting, device maps) keeps working unchanged.

    `output_sizes` records where each original projection lives in the output (`weight[:output_sizes[0]]` is the first
    projection, and so on). Generated forwards split the output by the same list, kept on the owner (`sizes_attribute`), and the checkpoint
    converters in `fusegen.runtime.checkpoint` read it to split the weight back into its original tensors on save,
    which is what makes unequal pieces (GQA/MQA q vs k/v) round-trip.

    `bias` may be one flag per piece (`[True, False, True]`: Whisper's k_proj has no bias while q and v do). Then
    `bias` holds rows for every piece, `bias_pieces` says which are real, and the rows of a piece without a bias
    are zero and stay out of the computation: the forward adds only the real pieces' rows (the others replaced by
    zeros), so those rows get no gradient, an optimizer leaves them as they are, and whatever they hold cannot
    change an output. Exactness: adding a zero to a GEMM output is the identity on every finite value, so each
    piece is what its own `F.linear` (with or without bias) returns. Loading fills those rows with zeros (a
    canonical checkpoint has no such tensor) and saving drops them (`fusegen.runtime.checkpoint`, `.loading`).
    """

    def __init__(
        self,
        in_features: int,
        output_sizes: Sequence[int],
        bias: bool | Sequence[bool] = True,
        device: torch.device | str | None = None,
        dtype: torch.dtype | None = None,
        layout: RowLayout | None = None,
    ) -> None:
        sizes = _as_output_sizes(output_sizes)
        flags = _as_bias_pieces(bias, len(sizes))
        if layout is not None and list(layout.sizes) != sizes:
            raise ValueError(f"row layout {layout.describe()} does not match output_sizes {sizes}")
        self.bias_pieces: list[bool] = flags
        self.output_sizes: list[int] = sizes
        self.row_layout: RowLayout | None = layout
        """How the pieces' rows are ordered (`fusegen.runtime.layout`); None: contiguous, in piece order."""
        super().__init__(in_features, sum(sizes), bias=any(flags), device=device, dtype=dtype)
        self.output_sizes = sizes

    def reset_parameters(self) -> None:
        """`nn.Linear`'s initialisation, with the rows of pieces without a bias set to zero."""
        super().reset_parameters()
        self.zero_absent_bias()

    @torch.no_grad()
    def zero_absent_bias(self) -> None:
        """Set the bias rows of the pieces that have no bias to zero (what a fused-layout checkpoint stores)."""
        if self.bias is None or self.bias.is_meta:
            return
        layout = layout_of(self)
        for index, kept in enumerate(self.bias_pieces):
            if not kept:
                self.bias.index_fill_(0, layout.piece_rows(index).to(self.bias.device), 0)

    def forward(self, input: torch.Tensor) -> torch.Tensor:
        if type(input) is not torch.Tensor and torch.overrides.has_torch_function_unary(input):
            return self._piece_by_piece(input)
        bias = self._bias_with_zero_rows()
        if bias is self.bias:  # every piece's bias kept, or none: the plain linear
            return super().forward(input)
        return F.linear(input, self.weight, bias)

    def _bias_with_zero_rows(self) -> torch.Tensor | None:
        if self.bias is None or all(self.bias_pieces):
            return self.bias
        layout = layout_of(self)
        pieces = layout.split(self.bias)
        return layout.merge(
            [piece if kept else torch.zeros_like(piece) for piece, kept in zip(pieces, self.bias_pieces)]
        )

    def _piece_by_piece(self, input: torch.Tensor) -> torch.Tensor:
        """The merged output of an input whose class overrides `__torch_function__` (a user tensor subclass; torch's
        own subclasses, `Parameter`, DTensor, fake and functional tensors, disable it, so they never come here).

        Such a class sees every `F.linear` it is handed and may compute it otherwise (by the weight's shape, say): one
        merged call would hand it a weight no original projection had. So each piece is computed as its projection
        computed it, `F.linear(input, rows of the piece, bias of the piece or None)`, and the outputs are merged along
        the last dim in the layout's row order (`merge` on the last dim), which the forward's split undoes. The same
        values as the single GEMM for a plain tensor; the subclass additionally sees the merge."""
        layout = layout_of(self)
        weights = layout.split(self.weight)
        biases = layout.split(self.bias) if self.bias is not None else [None] * len(weights)
        outputs = [
            F.linear(input, weight, bias if kept else None)
            for weight, bias, kept in zip(weights, biases, self.bias_pieces)
        ]
        return layout.merge(outputs, dim=-1)

    def extra_repr(self) -> str:
        """Show the per-projection sizes, so a printed model reveals how the fused output is laid out."""
        text = f"{super().extra_repr()}, output_sizes={self.output_sizes}"
        if not layout_of(self).is_contiguous:
            text = f"{text}, row_layout={layout_of(self).describe()}"
        return text if all(self.bias_pieces) or self.bias is None else f"{text}, bias_pieces={self.bias_pieces}"


def _computes_as_plain(linear: nn.Module) -> bool:
    """Is `linear` an unwrapped, hook-free `MergedColumnLinear` with plain tensors for parameters?

    Only then may `linear_pieces` compute some of its rows on their own: anything else (a PEFT LoRA layer, a
    quantizer's linear, tensor parallelism's hooks and DTensors, a parametrization, `functional_call`'s swapped-in
    tensors, a user's hook) defines its output through its own forward, which `linear_pieces` then calls.
    """
    from torch.nn.modules import module as torch_module

    hooks = (
        linear._forward_hooks, linear._forward_pre_hooks, linear._backward_hooks, linear._backward_pre_hooks,
        torch_module._global_forward_hooks, torch_module._global_forward_pre_hooks,
        torch_module._global_backward_hooks, torch_module._global_backward_pre_hooks,
    )  # fmt: skip
    if type(linear) is not MergedColumnLinear or any(hooks):
        return False
    parameters = [linear.weight] if linear.bias is None else [linear.weight, linear.bias]
    return all(type(p) is nn.Parameter and type(p.data) is torch.Tensor for p in parameters)


def linear_pieces(
    linear: nn.Module, input: torch.Tensor, sizes: Sequence[int], pieces: Sequence[int]
) -> tuple[torch.Tensor, ...]:
    """Pieces `pieces` (indices into `sizes`, ascending) of `linear(input).split(sizes, dim=-1)`.

    A generated attention that serves both self- and cross-attention (`fusegen/fusions/merged/rewrite_cross.py`) computes
    all of q/k/v in one GEMM when q and k/v read the same tensor, and only some pieces when they do not (q on the
    decoder's states, k/v on the encoder's). Exactness: for a plain merged linear (`_computes_as_plain`) and
    contiguous pieces, the result is `F.linear` with those rows of the weight and of the bias (the rows of a piece
    without a bias replaced by zeros, exactly as `MergedColumnLinear.forward` does, or no bias at all when no
    selected piece has one), which is what each original projection computes from the same rows: the same
    values, and gradients reaching exactly those rows. Every other module (wrapped, quantized, sharded, hooked) is
    called whole and its output split, so whatever its forward adds (a LoRA delta, hooks, a dequantization) is
    applied exactly as for the one-GEMM path; only the rows not asked for are computed in vain.
    """
    sizes = [int(size) for size in sizes]
    pieces = [int(piece) for piece in pieces]
    contiguous = pieces == list(range(pieces[0], pieces[0] + len(pieces)))
    layout = layout_of(linear) if getattr(linear, "output_sizes", None) is not None else RowLayout.contiguous(sizes)
    if not layout.is_contiguous:
        outputs = layout.split(linear(input), dim=-1)  # interleaved rows: one GEMM, then the pieces gathered
        return tuple(outputs[piece] for piece in pieces)
    if not (contiguous and _computes_as_plain(linear) and sizes == linear.output_sizes):
        outputs = linear(input).split(sizes, dim=-1)
        return tuple(outputs[piece] for piece in pieces)
    start = sum(sizes[: pieces[0]])
    stop = start + sum(sizes[piece] for piece in pieces)
    bias = None
    if linear.bias is not None and any(linear.bias_pieces[piece] for piece in pieces):
        rows = linear.bias.split(sizes)
        kept = [rows[piece] if linear.bias_pieces[piece] else torch.zeros_like(rows[piece]) for piece in pieces]
        bias = torch.cat(kept)
    output = F.linear(input, linear.weight[start:stop], bias)
    if len(pieces) == 1:
        return (output,)
    return tuple(output.split([sizes[piece] for piece in pieces], dim=-1))


def linear_piece(linear: nn.Module, input: torch.Tensor, sizes: Sequence[int], piece: int) -> torch.Tensor:
    """Piece `piece` of `linear(input).split(sizes, dim=-1)` alone (`linear_pieces`), as a tensor of its own.

    A generated forward computes a projection this way where it cannot merge the call (a caller's object whose class
    may lie, `fusegen/fusions/merged/rewrite_forward.py`), in the place of the projection's call. What the
    projection returned was a fresh tensor that the forward may write in place; a piece split from a whole call
    (a wrapped, quantized or hooked linear) is a view, which autograd would refuse to let it write, so it is
    cloned: the same values, dense, its gradient passed through unchanged.
    """
    (output,) = linear_pieces(linear, input, sizes, (piece,))
    return output if output._base is None else output.clone()


class MergedPiece:
    """One projection's rows of a merged linear, as code outside its class saw the projection (`module.q_proj` in
    an `_init_weights`; the compiler rewrites such a read to `merged_piece(module.qkv_proj, 0)`, see
    fusegen/compiler/piece_refs.py).

    `weight` and `bias` are views of exactly the piece's rows (`bias` None for a piece without one, as the original
    projection's is None), so an in-place initialiser writes those rows and nothing else, with the shape (fan-in
    and fan-out) the projection had: the same values from the same random stream. Each view carries the merged
    parameter's `_is_hf_initialized` flag, so Transformers' init functions skip a loaded tensor exactly as they
    skip the loaded projection (a view of a parameter does not inherit its attributes; without the flag a
    `from_pretrained` would re-initialise the loaded rows). Nothing else of an `nn.Linear` is offered: code that
    wants more fails on the missing attribute instead of running on something that is not the projection.
    """

    def __init__(self, linear: nn.Module, index: int) -> None:
        sizes = list(linear.output_sizes)
        self._linear, self._index = linear, index
        self._start, self._size = sum(sizes[:index]), sizes[index]
        self.in_features, self.out_features = linear.in_features, sizes[index]

    @property
    def weight(self) -> torch.Tensor:
        return _rows_view(self._linear.weight, self._start, self._size)

    @property
    def bias(self) -> torch.Tensor | None:
        bias = self._linear.bias
        if bias is None or not self._linear.bias_pieces[self._index]:
            return None
        return _rows_view(bias, self._start, self._size)


def merged_piece(linear: nn.Module, index: int) -> MergedPiece:
    """Piece `index` (in `output_sizes` order) of the merged linear `linear`: see `MergedPiece`."""
    return MergedPiece(linear, index)


def _rows_view(parameter: torch.Tensor, start: int, size: int) -> torch.Tensor:
    view = parameter.narrow(0, start, size)
    flag = getattr(parameter, "_is_hf_initialized", None)
    if flag is not None:
        view._is_hf_initialized = flag
    return view
