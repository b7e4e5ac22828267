"""The row layout a merged linear declares (`fusegen.runtime.layout`), and the runtime paths that follow it."""

from __future__ import annotations

import pytest
import torch
from torch import nn
from transformers import FalconConfig
from transformers.models.falcon.modeling_falcon import FalconAttention

from fusegen.runtime.checkpoint import MergedColumnConcatenate, MergedColumnSplit
from fusegen.runtime.layout import RowLayout, layout_of, require_contiguous
from fusegen.runtime.linear import MergedColumnLinear, linear_pieces
from fusegen.runtime.plan import model_targets

LAYOUTS = [
    RowLayout.contiguous([8, 4, 4]),
    RowLayout.grouped(2, [4, 2, 2]),  # 2 kv groups of 2 query heads (head_dim 2): q q k v | q q k v
    RowLayout.grouped(4, [3, 3, 3]),  # per head q, k, v (Falcon's classic layout, GPT-BigCode multi-head)
    RowLayout.grouped(3, [1, 5]),
]


def _pieces(layout: RowLayout, columns: int = 5, seed: int = 0) -> list[torch.Tensor]:
    generator = torch.Generator().manual_seed(seed)
    return [torch.randn(size, columns, generator=generator) for size in layout.sizes]


@pytest.mark.parametrize("layout", LAYOUTS, ids=lambda layout: layout.describe())
def test_split_inverts_merge_and_the_order_is_a_permutation(layout):
    pieces = _pieces(layout)
    merged = layout.merge(pieces)
    assert merged.shape[0] == sum(layout.sizes)
    assert all(torch.equal(a, b) for a, b in zip(layout.split(merged), pieces))
    assert sorted(layout.order().tolist()) == list(range(sum(layout.sizes)))
    assert torch.equal(merged, torch.cat(pieces)[layout.order()])
    for index, piece in enumerate(pieces):
        assert torch.equal(merged[layout.piece_rows(index)], piece)
    bias = [torch.randn(size) for size in layout.sizes]
    assert all(torch.equal(a, b) for a, b in zip(layout.split(layout.merge(bias)), bias))


def test_a_grouped_layout_interleaves_groups_and_a_contiguous_one_does_not():
    q, k, v = torch.arange(4.0), torch.arange(10.0, 12.0), torch.arange(20.0, 22.0)
    assert RowLayout.grouped(2, [2, 1, 1]).merge([q, k, v]).tolist() == [0, 1, 10, 20, 2, 3, 11, 21]
    assert RowLayout.contiguous([4, 2, 2]).merge([q, k, v]).tolist() == [0, 1, 2, 3, 10, 11, 20, 21]
    contiguous = RowLayout.contiguous([4, 2, 2])
    merged = contiguous.merge([q, k, v])
    assert all(piece.data_ptr() >= merged.data_ptr() for piece in contiguous.split(merged))  # views, as before


def test_the_grouped_layout_is_how_falcon_reads_its_packed_qkv():
    """Falcon (`new_decoder_architecture`) splits `query_key_value`'s output per kv group: its query heads, then its
    key head, then its value head. Weights merged by that layout give Falcon's own `_split_heads` the q, k and v of
    the separate projections."""
    config = FalconConfig(hidden_size=32, num_attention_heads=4, num_kv_heads=2, new_decoder_architecture=True)
    attention = FalconAttention(config)
    heads, kv_heads, head_dim = 4, 2, 8
    layout = RowLayout.grouped(kv_heads, [heads // kv_heads * head_dim, head_dim, head_dim])
    wq, wk, wv = (torch.randint(-4, 5, (size, 32)).float() for size in layout.sizes)  # exact sums, any order
    x = torch.randint(-4, 5, (2, 3, 32)).float()
    query, key, value = attention._split_heads(x @ layout.merge([wq, wk, wv]).T)
    assert torch.equal(query, (x @ wq.T).view(2, 3, heads, head_dim))
    per_group = heads // kv_heads
    expanded = [(x @ w.T).view(2, 3, kv_heads, 1, head_dim).expand(-1, -1, -1, per_group, -1) for w in (wk, wv)]
    assert torch.equal(key, expanded[0].flatten(2, 3))
    assert torch.equal(value, expanded[1].flatten(2, 3))


@pytest.mark.parametrize("layout", LAYOUTS, ids=lambda layout: layout.describe())
def test_a_merged_linear_computes_its_pieces_in_its_layout(layout):
    """Small integers as weights and inputs, so every sum is exact whatever order the GEMM adds in: a difference is a
    row in the wrong place, never rounding."""
    torch.manual_seed(0)
    separate = [nn.Linear(5, size) for size in layout.sizes]
    with torch.no_grad():
        for linear in separate:
            linear.weight.copy_(torch.randint(-4, 5, linear.weight.shape))
            linear.bias.copy_(torch.randint(-4, 5, linear.bias.shape))
    separate[1].bias = None  # a piece without a bias: its rows stay zero and out of the computation
    merged = MergedColumnLinear(5, layout.sizes, bias=[True, False, True][: len(layout.sizes)], layout=layout)
    with torch.no_grad():
        merged.weight.copy_(layout.merge([linear.weight for linear in separate]))
        biases = [linear.bias if linear.bias is not None else torch.full((size,), 7.0) for linear, size in
                  zip(separate, layout.sizes)]  # fmt: skip
        merged.bias.copy_(layout.merge(biases))
    x = torch.randint(-4, 5, (2, 3, 5)).float()
    outputs = layout.split(merged(x), dim=-1)
    for output, linear in zip(outputs, separate):
        assert torch.equal(output, linear(x))
    assert layout_of(merged) == layout
    picked = linear_pieces(merged, x, list(layout.sizes), [1, 2] if len(layout.sizes) > 2 else [1])
    assert all(torch.equal(a, linear(x)) for a, linear in zip(picked, separate[1:]))
    merged.zero_absent_bias()
    assert not merged.bias[layout.piece_rows(1)].any()


def test_a_layout_that_disagrees_with_the_sizes_is_refused():
    with pytest.raises(ValueError, match="does not match output_sizes"):
        MergedColumnLinear(5, [8, 4, 4], layout=RowLayout.grouped(2, [2, 2, 2]))
    with pytest.raises(ValueError, match="not divisible into 3 groups"):
        RowLayout((8, 4, 4), 3)


def test_sharding_keeps_whole_groups_and_each_process_holds_one_block():
    layout = RowLayout.grouped(4, [4, 2, 2])
    pieces = _pieces(layout)
    merged = layout.merge(pieces)
    local = layout.shard(2)
    assert local == RowLayout.grouped(2, [4, 2, 2])
    block = sum(local.sizes)
    for rank in range(2):
        mine = [piece.chunk(2)[rank] for piece in pieces]
        assert torch.equal(merged[rank * block : (rank + 1) * block], local.merge(mine))
    assert RowLayout.contiguous([8, 4, 4]).shard(4) == RowLayout.contiguous([2, 1, 1])
    with pytest.raises(ValueError, match="4 interleaved groups do not divide between 3 processes"):
        layout.shard(3)


class _Owner(nn.Module):
    def __init__(self, layout: RowLayout):
        super().__init__()
        self.qkv_proj = MergedColumnLinear(5, layout.sizes, bias=True, layout=layout)


@pytest.mark.parametrize("layout", LAYOUTS[:2], ids=lambda layout: layout.describe())
def test_the_checkpoint_converters_follow_the_layout(layout):
    """Loading concatenates the canonical pieces into the declared row order; saving splits them back."""
    model = _Owner(layout)
    # Module-level patterns, as build_stacked_converters writes them (`q_proj` -> `qkv_proj`; the leaf follows).
    names = list(("q_proj", "k_proj", "v_proj")[: len(layout.sizes)])
    pieces = _pieces(layout)
    loaded = MergedColumnConcatenate().convert(
        dict(zip(names, [p.clone() for p in pieces])), names, ["qkv_proj"], "qkv_proj.weight", model
    )
    [merged] = loaded["qkv_proj"]
    assert torch.equal(merged, layout.merge(pieces))
    saved = MergedColumnSplit().convert({"qkv_proj.weight": merged}, ["qkv_proj"], names, "q_proj.weight", model)
    assert all(torch.equal(saved[name], piece) for name, piece in zip(names, pieces))


def test_paths_that_handle_only_contiguous_pieces_refuse_by_name():
    model = _Owner(RowLayout.grouped(2, [4, 2, 2]))
    with pytest.raises(NotImplementedError, match=r"qkv_proj: fusegen's own loader .* 2 groups of \[4, 2, 2\]"):
        model_targets(model, {"qkv_proj": ("q_proj", "k_proj", "v_proj")}, "canonical")
    require_contiguous(_Owner(RowLayout.contiguous([8, 4, 4])).qkv_proj, "anything")  # contiguous passes
