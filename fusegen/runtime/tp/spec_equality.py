"""Keep DTensor's sharding caches from confusing a `MergedRowShard` tensor with a `Shard(0)` tensor of the same shape.

The cause (torch 2.13; measured, see docs/tensor-parallel.md "Placement equality and DTensor's caches"):
`MergedRowShard` must compare equal to `Shard(0)`. DTensor relies on that in three places: `DTensorSpec` checks each
shard placement with `placement != Shard(dim)`; an in-place op (the optimizer's `add_`, `mul_`, `lerp_`...) keeps
its input's spec only if `input.placements == output.placements`, and its strategies are built from plain
`Shard(dim)`; and an in-place op whose strategies all change the placement is refused. So `==` cannot be made
strict (tried, in one process: `add_`, `mul_`, `copy_`, `lerp_`, AdamW and SGD steps and gradient accumulation on
a merged parameter were then refused). But `MergedRowShard` hashes apart from `Shard(0)` (its hash is its row
layout's), which breaks the rule that equal objects hash equally, and
DTensor's native sharding-propagation cache (C++, a `c10::FastMap` keyed by the op and its arguments'
`DTensorSpec`s, hashed with Python's `hash` and compared with Python's `==`) does not compare stored hashes before
calling `==`: an open-addressing probe that passes an entry for the same op on a `Shard(0)` tensor of the same
shape, stride and dtype takes it. Whether a probe passes it depends on the hashes, i.e. on the process's string-hash
seed and on what the cache already holds, hence one rank in some launches. The entry's output spec then labels the
result: `nn.Parameter(merged)` (a `detach`) came back `Shard(0)` and `full_tensor()` gathered it as such
(192 -> 128 rows at N=4 with shared kv heads, where q+k+v rows equal the vocabulary), and the other way round a
plain `Shard(0)` tensor (the lm_head) could come back labelled `MergedRowShard` and be gathered wrongly.

The fix, at that cause: two `DTensorSpec`s are equal only if, besides everything DTensor compares, every pair of
their placements has the same row layout (`row_layout`: None for DTensor's own placements, the pieces and every
rank's rows for `MergedRowShard`). Placement-level `==`, which the checks above use, is unchanged. A spec is a cache
key and nothing else compares specs in a way that needs the old answer (DTensor's remaining spec comparison,
`arg_spec != reshard_arg_spec` before an op, now also sees a `MergedRowShard` input as differing from a `Shard(0)`
the op's strategy asks for and calls `redistribute_local_tensor`, whose own placement-level comparison finds
nothing to do: the same local rows as before). It restores the hash rule for specs: equal specs now have equal
placements with equal row layouts, hence equal hashes, so every cache, the native one included, keeps the two
apart. Installed once, by `MergedRowShard`'s definition (before any such placement exists); without it any DTensor
op on a merged parameter could be labelled by another tensor's entry.
"""

from __future__ import annotations


def row_layout(placement):
    """What a placement says about which rows each rank holds beyond DTensor's own fields (None: nothing more)."""
    return getattr(placement, "row_layout", None)


def same_row_layouts(placements, others) -> bool:
    return all(row_layout(mine) == row_layout(theirs) for mine, theirs in zip(placements, others, strict=True))


def keep_merged_specs_apart() -> None:
    """Make `DTensorSpec` equality require equal row layouts (see the module docstring); idempotent."""
    from torch.distributed.tensor._dtensor_spec import DTensorSpec

    if getattr(DTensorSpec.__eq__, "fusegen_row_layouts", False):
        return
    equal = DTensorSpec.__eq__

    def __eq__(self, other):  # replaces DTensorSpec.__eq__
        result = equal(self, other)
        if result is True and isinstance(other, DTensorSpec):
            return same_row_layouts(self.placements, other.placements)
        return result

    __eq__.fusegen_row_layouts = True
    __eq__.__doc__ = f"{equal.__doc__ or ''} Equal specs also hold the same rows (fusegen.runtime.tp.spec_equality)."
    DTensorSpec.__eq__ = __eq__
