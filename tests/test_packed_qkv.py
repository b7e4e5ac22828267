"""The `packed_qkv` kind (a skeleton): the row order it declares for packed q/k/v is the one the classes read, and
the runtime paths that ask the layout follow it."""

from __future__ import annotations

import pytest
import torch
from torch import nn
from transformers import FalconConfig, GPTBigCodeConfig
from transformers.models.falcon.modeling_falcon import FalconAttention
from transformers.models.gpt_bigcode.modeling_gpt_bigcode import GPTBigCodeAttention

from fusegen import fusions
from fusegen.core.plan import Refused
from fusegen.fusions import packed_qkv
from fusegen.runtime.checkpoint import MergedColumnSplit
from fusegen.runtime.linear import linear_pieces
from fusegen.runtime.tp import PACKED_ATTENTION
from fusegen.runtime.tp.packed import _class_key

FALCON = {
    "new-decoder": {"new_decoder_architecture": True, "num_kv_heads": 2},
    "classic": {"new_decoder_architecture": False, "multi_query": False},
    "multi-query": {"new_decoder_architecture": False, "multi_query": True},
}


def _falcon(variant: str) -> FalconAttention:
    config = FalconConfig(hidden_size=32, num_attention_heads=4, bias=True, **FALCON[variant])
    return FalconAttention(config)


def _bigcode(multi_query: bool) -> GPTBigCodeAttention:
    config = GPTBigCodeConfig(n_embd=32, n_head=4, multi_query=multi_query, attn_implementation="eager")
    return GPTBigCodeAttention(config, layer_idx=0)


def _integer_weights(linear: nn.Linear) -> None:
    """Small integers: every sum exact in any order, so `torch.equal` tests row placement, not rounding."""
    with torch.no_grad():
        linear.weight.copy_(torch.randint(-3, 4, linear.weight.shape))
        if linear.bias is not None:
            linear.bias.copy_(torch.randint(-3, 4, linear.bias.shape))


@pytest.mark.parametrize("variant", sorted(FALCON))
def test_the_falcon_layout_is_what_split_heads_reads(variant):
    attention = _falcon(variant)
    _integer_weights(attention.query_key_value)
    [plan] = packed_qkv.PackedQKVKind().match(None, attention)
    q, k, v = plan.layout.split(attention.query_key_value.weight.detach())
    x = torch.randint(-3, 4, (2, 3, 32)).float()
    query, key, value = attention._split_heads(x @ attention.query_key_value.weight.detach().T)
    heads, head_dim = 4, 8
    assert torch.equal(query.reshape(2, 3, -1), x @ q.T)
    kv_heads = k.shape[0] // head_dim
    for packed, mine in ((key, k), (value, v)):  # Falcon hands back k/v per query head (broadcast or per kv group)
        per_kv = packed.reshape(2, 3, -1, head_dim)
        expected = (x @ mine.T).view(2, 3, kv_heads, head_dim)
        if per_kv.shape[2] != kv_heads:
            expected = expected.repeat_interleave(heads // kv_heads, dim=2)
        assert torch.equal(per_kv, expected)


@pytest.mark.parametrize("multi_query", [False, True])
def test_the_bigcode_layout_is_what_its_forward_reads(multi_query):
    """GPT-BigCode's forward splits `c_attn`'s output inline; its q/k/v agree with the declared pieces."""
    attention = _bigcode(multi_query)
    _integer_weights(attention.c_attn)
    [plan] = packed_qkv.PackedQKVKind().match(None, attention)
    x = torch.randint(-3, 4, (2, 3, 32)).float()
    out = attention.c_attn(x)
    q, k, v = plan.layout.split(out, dim=-1)
    heads, head_dim = 4, 8
    if multi_query:
        query, key, value = out.unsqueeze(1).split((32, 8, 8), dim=3)  # the forward's own split
        assert torch.equal(query.squeeze(1), q) and torch.equal(key.squeeze(1), k) and torch.equal(value.squeeze(1), v)
    else:
        query, key, value = out.view(2, 3, heads, 3 * head_dim).transpose(1, 2).split(3 * [head_dim], dim=3)
        for packed, mine in ((query, q), (key, k), (value, v)):
            assert torch.equal(packed.transpose(1, 2).reshape(2, 3, -1), mine)


def test_the_declared_layouts_agree_with_the_tp_table_of_the_original_classes():
    """Two independent descriptions of the same rows: the kind's layout and `PACKED_ATTENTION`'s pieces (units per
    piece, in row order) for the same module."""
    for attention in (_falcon("new-decoder"), _falcon("multi-query"), _bigcode(True), _bigcode(False)):
        [plan] = packed_qkv.PackedQKVKind().match(None, attention)
        _heads, _kv_heads, pieces = PACKED_ATTENTION[_class_key(attention)].pieces(attention)
        assert sum(rows for rows, _, _ in pieces) == sum(plan.layout.sizes)
        if plan.layout.is_contiguous:  # [q; k; v]: one table piece per layout piece, same rows
            assert [rows for rows, _, _ in pieces] == list(plan.layout.sizes)
        else:  # one table piece cut into units (groups) that the layout interleaves
            [(_, units, _)] = pieces
            assert units == plan.layout.groups


def test_a_merged_linear_with_the_layout_computes_what_the_packed_linear_did():
    attention = _bigcode(False)
    [plan] = packed_qkv.PackedQKVKind().match(None, attention)
    packed_qkv.PackedQKVKind().check(attention, plan)
    merged = packed_qkv.merged_linear(attention, plan)
    x = torch.randn(2, 3, 32)
    assert torch.equal(merged(x), attention.c_attn(x))
    k, v = linear_pieces(merged, x, list(plan.layout.sizes), [1, 2])
    assert torch.equal(k, plan.layout.split(attention.c_attn(x), dim=-1)[1])
    assert torch.equal(v, plan.layout.split(attention.c_attn(x), dim=-1)[2])


def test_saving_splits_the_packed_rows_into_canonical_q_k_v():
    """Transformers' save path (`MergedColumnSplit`) asks the layout: the canonical pieces come out in q, k, v order."""
    attention = _bigcode(False)
    [plan] = packed_qkv.PackedQKVKind().match(None, attention)
    owner = nn.Module()
    owner.c_attn = packed_qkv.merged_linear(attention, plan)
    names = ["q_proj", "k_proj", "v_proj"]  # module-level patterns, as build_stacked_converters writes them
    weight = attention.c_attn.weight.detach()
    saved = MergedColumnSplit().convert({"c_attn.weight": weight}, ["c_attn"], names, "q_proj.weight", owner)
    canonical = packed_qkv.split_canonical(attention, plan)
    assert [saved[name].shape[0] for name in names] == [32, 32, 32]
    assert all(torch.equal(saved[name], canonical[piece]) for name, piece in zip(names, "qkv"))
    assert torch.equal(plan.layout.merge([saved[name] for name in names]), weight)


def test_falcons_own_linear_subclass_is_refused_and_the_rewrite_is_not_written():
    attention = _falcon("new-decoder")
    [plan] = packed_qkv.PackedQKVKind().match(None, attention)
    with pytest.raises(Refused, match="FalconLinear, not exactly nn.Linear"):
        packed_qkv.PackedQKVKind().check(attention, plan)
    with pytest.raises(Refused) as refusal:
        packed_qkv.PackedQKVKind().rewrite(None, plan, attention, {}, [])
    assert refusal.value.rule == "packed-qkv-skeleton"
    assert "packed_qkv" not in [kind.name for kind in fusions.kinds()]
