"""Which rows of a merged linear each tensor-parallel process keeps (`RowPartition`), and the head-count checks."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass


def dtensor_chunk(full: int, world_size: int, rank: int) -> tuple[int, int]:
    """(start, size) of process `rank`'s block of `full` rows under DTensor's `Shard(0)`: blocks of
    ceil(full / N) rows, the last ones shorter (or empty). It is the split Transformers' `colwise` gives each of the
    original's projections (`distribute_tensor` and the shard-on-read loader both use it), so a merged linear split
    this way piece by piece holds exactly the original's rows on every process."""
    chunk = -(-full // world_size)
    start = min(rank * chunk, full)
    return start, min(start + chunk, full) - start


@dataclass(frozen=True)
class RowPartition:
    """This process's rows of each piece of a merged linear: `sizes[i]` rows from row `starts[i]` of piece i.

    `replicated[i]`: piece i's rows are held by several processes (kv heads fewer than processes); otherwise the
    processes' blocks of piece i are disjoint.
    """

    full_sizes: tuple[int, ...]
    starts: tuple[int, ...]
    sizes: tuple[int, ...]
    world_size: int
    rank: int
    replicated: tuple[bool, ...] = ()

    @property
    def shard_on_read(self) -> bool:
        """Whether every piece is split as DTensor's `Shard(0)` splits it (`dtensor_chunk`), block `rank` kept: N equal
        blocks, or, for a piece of rows that does not divide by N, ceil-sized blocks with shorter last ones.

        Then a `Shard(0)` DTensor describes the parameter to Transformers' loader, which applies it to each checkpoint
        piece separately and so reads exactly these rows. Replicated pieces (kv heads < N) are not of that form.
        """
        return all(
            (start, size) == dtensor_chunk(full, self.world_size, self.rank)
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
    read kv head r // (N/units), so q and kv stay aligned. A piece counted in single rows (gate/up, any merged linear
    that is not q/k/v) that does not divide by N is split as DTensor splits it (`dtensor_chunk`: ceil(rows/N) rows
    per process, the last ones fewer), which is what Transformers' `colwise` gives the original's projection, and
    its row-parallel `down_proj` the matching input columns. Anything else cannot be split without cutting a head.
    """
    starts, sizes, replicated = [], [], []
    for full, count, can_replicate in zip(full_sizes, units, replicable):
        if count <= 0 or full % count:
            raise ValueError(f"{what}: a piece of {full} rows cannot hold {count} equal units")
        rows = full // count
        shared = False
        if count % world_size == 0:
            size = count // world_size * rows
            start = rank * size
        elif can_replicate and world_size % count == 0:
            size, shared = rows, True
            start = rank // (world_size // count) * rows
        elif rows == 1 and not can_replicate:
            start, size = dtensor_chunk(full, world_size, rank)
        else:
            raise ValueError(
                f"{what}: piece sizes {list(full_sizes)} in units of {list(units)} cannot be split over "
                f"N={world_size} tensor-parallel processes ({count} is not divisible by {world_size})"
            )
        starts.append(start)
        sizes.append(size)
        replicated.append(shared)
    return RowPartition(tuple(full_sizes), tuple(starts), tuple(sizes), world_size, rank, tuple(replicated))


def check_head_counts(name: str, heads: int, kv_heads: int, world_size: int) -> None:
    """Refuse head counts that N processes cannot share, before anything is sharded or read."""
    where = f"{name}: cannot shard over N={world_size} tensor-parallel processes"
    if world_size > heads:
        raise ValueError(f"{where}: N is larger than num_attention_heads={heads}")
    if heads % world_size:
        raise ValueError(f"{where}: num_attention_heads={heads} is not divisible by N")
    if kv_heads % world_size and world_size % kv_heads:
        raise ValueError(f"{where}: num_key_value_heads={kv_heads} neither divisible by nor dividing N")
