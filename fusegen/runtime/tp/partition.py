"""Which rows of a merged linear each tensor-parallel process keeps (`RowPartition`), and the head-count checks."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass


@dataclass(frozen=True)
class RowPartition:
    """This process's rows of each piece of a merged linear: `sizes[i]` rows from row `starts[i]` of piece i."""

    full_sizes: tuple[int, ...]
    starts: tuple[int, ...]
    sizes: tuple[int, ...]
    world_size: int
    rank: int

    @property
    def shard_on_read(self) -> bool:
        """Whether every piece is cut into N equal consecutive blocks, block `rank` kept.

        Then a `Shard(0)` DTensor describes the parameter to Transformers' loader, which applies it to each checkpoint
        piece separately and so reads exactly these rows. Replicated pieces (kv heads < N) are not of that form.
        """
        return all(
            size * self.world_size == full and start == self.rank * size
            for full, start, size in zip(self.full_sizes, self.starts, self.sizes)
        )

    def merged_rows(self) -> list[tuple[int, int]]:
        """(start, length) of the kept rows within the full merged tensor, piece by piece."""
        offsets = [sum(self.full_sizes[:i]) for i in range(len(self.full_sizes))]
        return [(offset + start, size) for offset, start, size in zip(offsets, self.starts, self.sizes)]


def partition_rows(
    full_sizes: Sequence[int],
    units: Sequence[int],
    replicable: Sequence[bool],
    world_size: int,
    rank: int,
    *,
    what: str,
) -> RowPartition:
    """Split each piece by whole units (heads, or single rows) over `world_size` processes.

    A piece whose unit count divides by N is cut into N blocks. A `replicable` piece with fewer units than processes
    (kv heads) gives each group of N/units consecutive processes the same unit: process r holds query heads that all
    read kv head r // (N/units), so q and kv stay aligned. Anything else cannot be split without cutting a head.
    """
    starts, sizes = [], []
    for full, count, can_replicate in zip(full_sizes, units, replicable):
        if count <= 0 or full % count:
            raise ValueError(f"{what}: a piece of {full} rows cannot hold {count} equal units")
        rows = full // count
        if count % world_size == 0:
            size = count // world_size * rows
            starts.append(rank * size)
        elif can_replicate and world_size % count == 0:
            size = rows
            starts.append(rank // (world_size // count) * rows)
        else:
            raise ValueError(
                f"{what}: piece sizes {list(full_sizes)} in units of {list(units)} cannot be split over "
                f"N={world_size} tensor-parallel processes ({count} is not divisible by {world_size})"
            )
        sizes.append(size)
    return RowPartition(tuple(full_sizes), tuple(starts), tuple(sizes), world_size, rank)


def check_head_counts(name: str, heads: int, kv_heads: int, world_size: int) -> None:
    """Refuse head counts that N processes cannot share, before anything is sharded or read."""
    where = f"{name}: cannot shard over N={world_size} tensor-parallel processes"
    if world_size > heads:
        raise ValueError(f"{where}: N is larger than num_attention_heads={heads}")
    if heads % world_size:
        raise ValueError(f"{where}: num_attention_heads={heads} is not divisible by N")
    if kv_heads % world_size and world_size % kv_heads:
        raise ValueError(f"{where}: num_key_value_heads={kv_heads} neither divisible by nor dividing N")
