"""The row layout of a merged linear: which rows of the merged weight belong to which canonical piece, in what order.

A fusion kind declares it; the runtime modules ask it (`layout_of`) instead of assuming "contiguous blocks in piece
order". Two layouts exist:

- `RowLayout.contiguous(sizes)`: piece 0's rows, then piece 1's, ... (every merge fusegen generates today:
  `qkv_proj` = q rows, k rows, v rows);
- `RowLayout.grouped(groups, per_group)`: the rows come in `groups` equal groups, each holding `per_group[i]`
  consecutive rows of piece i, the groups in order. Piece i then has `groups * per_group[i]` rows. This is packed
  q/k/v with head-interleaved rows as checkpoints store it: Falcon's `query_key_value` with
  `new_decoder_architecture` (per kv group, its query heads, then its key head, then its value head:
  `grouped(num_kv_heads, [heads_per_group * head_dim, head_dim, head_dim])`), Falcon's classic layout and
  GPT-BigCode's multi-head `c_attn` (per head q, k, v: `grouped(num_heads, [head_dim] * 3)`).

Soundness: a layout is a permutation of the rows of the contiguous concatenation of the pieces (`order`); `merge`
applies it and `split` inverts it, so `split(merge(pieces)) == pieces` exactly (row copies, no arithmetic), and a
merged linear's output column r is exactly the canonical piece row `order[r]` computes. Sharding by groups keeps
whole groups per process, and the local rows are again a layout of the same form (`shard`).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class RowLayout:
    sizes: tuple[int, ...]
    """Rows of each canonical piece (the merged linear's `output_sizes`)."""
    groups: int = 1
    """How many equal groups the rows are interleaved in (1: contiguous pieces)."""

    @staticmethod
    def contiguous(sizes: Sequence[int]) -> RowLayout:
        return RowLayout(tuple(int(size) for size in sizes), 1)

    @staticmethod
    def grouped(groups: int, per_group: Sequence[int]) -> RowLayout:
        """`groups` groups, each holding `per_group[i]` consecutive rows of piece i, pieces in order."""
        if groups < 1 or any(size < 1 for size in per_group):
            raise ValueError(
                f"a grouped layout needs groups >= 1 and positive rows per group, got {groups}, {per_group}"
            )
        return RowLayout(tuple(groups * int(size) for size in per_group), int(groups))

    def __post_init__(self) -> None:
        if any(size % self.groups for size in self.sizes):
            raise ValueError(f"piece sizes {list(self.sizes)} are not divisible into {self.groups} groups")

    @property
    def is_contiguous(self) -> bool:
        return self.groups == 1

    @property
    def per_group(self) -> tuple[int, ...]:
        return tuple(size // self.groups for size in self.sizes)

    def order(self) -> torch.Tensor:
        """`order[r]`: the row of the contiguous concatenation of the pieces that merged row r holds."""
        starts = [sum(self.sizes[:index]) for index in range(len(self.sizes))]
        rows = [
            torch.arange(starts[index] + group * size, starts[index] + (group + 1) * size)
            for group in range(self.groups)
            for index, size in enumerate(self.per_group)
        ]
        return torch.cat(rows)

    def piece_rows(self, index: int) -> torch.Tensor:
        """The merged rows of piece `index`, in the piece's own row order."""
        size, width = self.per_group[index], sum(self.per_group)
        offset = sum(self.per_group[:index])
        return torch.cat([torch.arange(g * width + offset, g * width + offset + size) for g in range(self.groups)])

    def merge(self, pieces: Sequence[torch.Tensor], dim: int = 0) -> torch.Tensor:
        """The merged tensor of the canonical `pieces` (their sizes along `dim` must be `sizes`)."""
        found = [int(piece.shape[dim]) for piece in pieces]
        if found != list(self.sizes):
            raise ValueError(f"pieces have sizes {found} along dim {dim}, the layout expects {list(self.sizes)}")
        stacked = torch.cat(list(pieces), dim=dim)
        return stacked if self.is_contiguous else stacked.index_select(dim, self.order().to(stacked.device))

    def split(self, merged: torch.Tensor, dim: int = 0) -> list[torch.Tensor]:
        """The canonical pieces of `merged` (views for a contiguous layout, copies otherwise)."""
        if merged.shape[dim] != sum(self.sizes):
            raise ValueError(f"a tensor of {merged.shape[dim]} rows along dim {dim} is not {list(self.sizes)}")
        if self.is_contiguous:
            return list(merged.split(list(self.sizes), dim=dim))
        return [merged.index_select(dim, self.piece_rows(i).to(merged.device)) for i in range(len(self.sizes))]

    def shard(self, world_size: int) -> RowLayout:
        """The layout of one process's rows when each piece is cut into `world_size` equal consecutive blocks.

        For a grouped layout that is whole groups per process (`groups` divisible by `world_size`), and a process's
        rows are then one consecutive block of the merged tensor; any other cut would split a group and is refused.
        """
        if self.is_contiguous:
            if any(size % world_size for size in self.sizes):
                raise ValueError(f"pieces {list(self.sizes)} do not divide into {world_size} equal blocks")
            return RowLayout.contiguous([size // world_size for size in self.sizes])
        if self.groups % world_size:
            raise ValueError(f"{self.groups} interleaved groups do not divide between {world_size} processes")
        return RowLayout.grouped(self.groups // world_size, self.per_group)

    def describe(self) -> str:
        if self.is_contiguous:
            return f"contiguous {list(self.sizes)}"
        return f"{self.groups} groups of {list(self.per_group)}"


def layout_of(module: object) -> RowLayout:
    """The row layout of a merged linear (anything with `output_sizes`): its declared `row_layout`, else contiguous.

    A declared layout must describe the module's current `output_sizes`; one that does not (the module was
    re-partitioned without its layout) raises rather than being guessed.
    """
    sizes = [int(size) for size in module.output_sizes]
    declared = getattr(module, "row_layout", None)
    if declared is None or (declared.is_contiguous and list(declared.sizes) != sizes):
        return RowLayout.contiguous(sizes)
    if list(declared.sizes) != sizes:
        raise ValueError(
            f"{type(module).__name__}: row layout {declared.describe()} does not match output_sizes {sizes}"
        )
    return declared


def require_contiguous(module: object, what: str) -> None:
    """Refuse, naming the layout, where a runtime path supports only contiguous pieces."""
    layout = layout_of(module)
    if not layout.is_contiguous:
        raise NotImplementedError(
            f"{what}: {type(module).__name__} stores its pieces as {layout.describe()}, and this path handles only"
            " contiguous pieces"
        )
