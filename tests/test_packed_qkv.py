"""The `packed_qkv` kind: the row order it declares for packed q/k/v is the one the classes read; the generated
classes (Falcon, GPT-BigCode, built into a temporary directory) compute what the originals do for every config
variant, load and save the checkpoint's own packed tensors, take PEFT adapters as the originals do, and the runtime
paths that ask the layout follow it. Tensor parallelism of the generated classes: tests/test_tp.py
(`generated-packed` cases)."""

from __future__ import annotations

import pytest
import torch
from torch import nn
from transformers import FalconConfig, GPTBigCodeConfig
from transformers.models.falcon.modeling_falcon import FalconAttention
from transformers.models.gpt_bigcode.modeling_gpt_bigcode import GPTBigCodeAttention

from fusegen import fusions
from fusegen.compiler.build import build
from fusegen.core.plan import Refused
from fusegen.fusions import packed_qkv
from fusegen.runtime import load_checkpoint, save_checkpoint
from fusegen.runtime.checkpoint import MergedColumnSplit
from fusegen.runtime.layout import RowLayout, layout_of
from fusegen.runtime.linear import MergedColumnLinear, linear_pieces
from fusegen.runtime.tp.packed import packed_entry
from fusegen.testkit import (
    import_file,
    logits,
    logits_tolerance,
    original_classes,
    random_input,
    random_model,
    small_config,
)

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
        _heads, _kv_heads, pieces = packed_entry(attention).pieces(attention)
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


def test_a_linear_subclass_the_kind_does_not_know_is_refused():
    attention = _bigcode(False)
    [plan] = packed_qkv.PackedQKVKind().match(None, attention)

    class Scaled(nn.Linear):
        pass

    attention.c_attn = Scaled(32, 96)
    with pytest.raises(Refused, match="Scaled, not nn.Linear"):
        packed_qkv.PackedQKVKind().check(attention, plan)
    falcon = _falcon("new-decoder")
    packed_qkv.PackedQKVKind().check(falcon, packed_qkv.PackedQKVKind().match(None, falcon)[0])  # FalconLinear
    assert "packed_qkv" in [kind.name for kind in fusions.kinds()]


def test_a_cross_attention_instance_declares_nothing():
    """GPT-BigCode's cross-attention packs only k/v in `c_attn` (and q in `q_attn`): no layout, no plan."""
    config = GPTBigCodeConfig(n_embd=32, n_head=4, multi_query=False, attn_implementation="eager")
    assert packed_qkv.declared_layout(GPTBigCodeAttention(config, is_cross_attention=True, layer_idx=0)) is None


# --------------------------------------------------------------------------------------------------------------------
# The generated classes, built from the installed Transformers into a temporary directory
# --------------------------------------------------------------------------------------------------------------------

TOKENS = {"bos_token_id": 0, "eos_token_id": 0, "pad_token_id": 0}
VARIANTS = {  # model type, config overrides; heads 4, hidden 64 (head_dim 16) unless overridden
    "falcon-new-decoder-2-kv": ("falcon", {"new_decoder_architecture": True, "num_kv_heads": 2}),
    "falcon-new-decoder-1-kv": ("falcon", {"new_decoder_architecture": True, "num_kv_heads": 1}),
    "falcon-new-decoder-4-kv-bias": ("falcon", {"new_decoder_architecture": True, "num_kv_heads": 4, "bias": True}),
    "falcon-classic-parallel": ("falcon", {"new_decoder_architecture": False, "multi_query": False}),
    "falcon-classic-sequential-bias": (
        "falcon",
        {"new_decoder_architecture": False, "multi_query": False, "parallel_attn": False, "bias": True},
    ),
    "falcon-multi-query": ("falcon", {"new_decoder_architecture": False, "multi_query": True}),
    "falcon-multi-query-alibi-bias": (
        "falcon",
        {"new_decoder_architecture": False, "multi_query": True, "alibi": True, "bias": True},
    ),
    "bigcode-multi-query": ("gpt_bigcode", {"multi_query": True}),
    "bigcode-multi-head": ("gpt_bigcode", {"multi_query": False}),
}


@pytest.fixture(scope="module")
def built(tmp_path_factory):
    """`built(model_type)`: (original causal LM class, generated module), each type built once per module."""
    root, done = tmp_path_factory.mktemp("packed_built"), {}

    def get(model_type):
        if model_type not in done:
            path = root / f"fused_{model_type}.py"
            path.write_text(build(model_type).text)
            done[model_type] = original_classes(model_type)[1], import_file(path, f"packed_built_{model_type}")
        return done[model_type]

    return get


def _pair(built, variant, tmp_path):
    model_type, overrides = VARIANTS[variant]
    original_class, module = built(model_type)
    config_class = original_classes(model_type)[0]
    original = random_model(original_class, small_config(config_class, **overrides, **TOKENS))
    original.save_pretrained(tmp_path / "original")
    fused_class = getattr(module, "Fused" + original_class.__name__)
    fused, info = fused_class.from_pretrained(tmp_path / "original", output_loading_info=True)
    assert not any(info.values()), info  # every tensor of the original's checkpoint, by its own name
    return original_class, original, fused.eval()


def _attentions(model):
    return [m for m in model.modules() if type(m).__name__.endswith(("FalconAttention", "GPTBigCodeAttention"))]


@pytest.mark.slow
@pytest.mark.parametrize("variant", sorted(VARIANTS))
def test_the_generated_class_declares_the_layout_and_matches_the_original(built, tmp_path, variant):
    original_class, original, fused = _pair(built, variant, tmp_path)
    assert [name for name, _ in fused.named_parameters()] == [name for name, _ in original.named_parameters()]
    for mine, theirs in zip(_attentions(fused), _attentions(original), strict=True):
        attribute, layout = packed_qkv.declared_layout(theirs)
        packed = getattr(mine, attribute)
        assert type(packed) is MergedColumnLinear and layout_of(packed) == layout == packed.row_layout
        assert torch.equal(packed.weight, getattr(theirs, attribute).weight)
    input_ids = random_input(original.config)
    expected = logits(original, input_ids)
    assert (logits(fused, input_ids) - expected).abs().max().item() <= logits_tolerance(expected)
    fused.save_pretrained(tmp_path / "fused")  # the checkpoint's own packed tensors, loaded by the original class
    reloaded, info = original_class.from_pretrained(tmp_path / "fused", output_loading_info=True)
    assert not any(info.values()), info
    saved = reloaded.state_dict()
    assert all(torch.equal(saved[name], tensor) for name, tensor in original.state_dict().items())


@pytest.mark.slow
@pytest.mark.parametrize("variant", ["falcon-new-decoder-2-kv", "bigcode-multi-head"])
def test_fusegens_own_loader_and_saver_keep_the_packed_tensor_whole(built, tmp_path, variant):
    original_class, original, fused = _pair(built, variant, tmp_path)
    save_checkpoint(fused, tmp_path / "fusegen")
    reloaded = original_class.from_pretrained(tmp_path / "fusegen")
    saved = reloaded.state_dict()
    assert all(torch.equal(saved[name], tensor) for name, tensor in original.state_dict().items())
    with torch.no_grad():
        for parameter in fused.parameters():
            parameter.zero_()
    load_checkpoint(fused, tmp_path / "original")
    loaded = fused.state_dict()
    assert all(torch.equal(loaded[name], tensor) for name, tensor in original.state_dict().items())


@pytest.mark.slow
@pytest.mark.parametrize("variant", ["falcon-new-decoder-2-kv", "bigcode-multi-head"])
def test_a_lora_adapter_of_the_original_applies_to_the_generated_class(built, tmp_path, variant):
    """PEFT adapts the packed linear under its own name, as on the original class: an adapter trained (here: drawn)
    on the original loads onto the generated class and gives the original's logits."""
    from peft import LoraConfig, PeftModel, get_peft_model

    _, original, fused = _pair(built, variant, tmp_path)
    attribute, _ = packed_qkv.declared_layout(_attentions(original)[0])
    torch.manual_seed(0)
    adapted = get_peft_model(original, LoraConfig(r=4, target_modules=[attribute], init_lora_weights=False))
    adapted.save_pretrained(tmp_path / "adapter")
    input_ids = random_input(original.config)
    expected = logits(adapted, input_ids)
    assert (expected - logits(fused, input_ids)).abs().max().item() > 1e-3  # the adapter changes the logits
    loaded = PeftModel.from_pretrained(fused, tmp_path / "adapter")
    assert (logits(loaded, input_ids) - expected).abs().max().item() <= logits_tolerance(expected)


def _rewrite(attention, edit):
    """The kind's rewrite of the attention's class statement after `edit(init)` mutated its `__init__`."""
    import ast
    import sys

    from fusegen.core import astutil

    classdef = astutil.parse_class(type(attention))
    edit(astutil.method(classdef, "__init__"))
    [plan] = packed_qkv.PackedQKVKind().match(None, attention)
    namespace = vars(sys.modules[type(attention).__module__])
    packed_qkv.PackedQKVKind().rewrite(classdef, plan, attention, namespace, [])
    return ast.unparse(classdef)


def test_the_rewrite_builds_the_declared_layout_and_refuses_what_it_cannot_place():
    import ast

    attention = _falcon("new-decoder")
    text = _rewrite(attention, lambda init: None)
    assert "self.query_key_value = MergedColumnLinear(self.hidden_size, query_key_value_layout.sizes" in text
    assert "layout=query_key_value_layout" in text and "FalconLinear(self.hidden_size, qkv_out_dim" not in text

    def changes_head_dim_later(init):
        init.body.append(ast.parse("self.head_dim = 2").body[0])

    with pytest.raises(Refused) as refusal:
        _rewrite(attention, changes_head_dim_later)
    assert refusal.value.rule == "packed-layout-inputs" and "self.head_dim" in refusal.value.reason

    def renames_the_width(init):
        for node in ast.walk(init):
            if isinstance(node, ast.Name) and node.id == "qkv_out_dim":
                node.id = "width"

    with pytest.raises(Refused) as refusal:
        _rewrite(attention, renames_the_width)
    assert refusal.value.rule == "packed-source-changed"


class _PackedOwner(nn.Module):
    """A module holding a layout-declaring merged linear that no stacked mapping splits (this test module defines no
    STACKED_PARAMS_MAPPING), as a generated Falcon attention holds `query_key_value`."""

    def __init__(self):
        super().__init__()
        self.query_key_value = MergedColumnLinear(8, [8, 4, 4], bias=False, layout=RowLayout.grouped(2, [4, 2, 2]))


def test_a_packed_linear_no_mapping_splits_is_one_tensor_to_the_loader_quantization_and_peft():
    """`fusegen.runtime.merged.stored_packed`: fusegen's loader names it whole, quantization leaves it one linear,
    PEFT finds no merged linear to pack (and does not refuse it); a merged linear without a declared layout and
    without a mapping is still refused by each."""
    from fusegen.runtime.merged import stored_packed
    from fusegen.runtime.peft import AdapterError, merged_linears
    from fusegen.runtime.plan import model_targets
    from fusegen.runtime.quantized import split_merged_linears

    model = _PackedOwner()
    assert stored_packed(model.query_key_value, "query_key_value", {})
    assert not stored_packed(model.query_key_value, "query_key_value", {"query_key_value": ("q", "k", "v")})
    targets = model_targets(model, {}, "canonical")
    assert targets.by_name["query_key_value.weight"].whole and targets.groups == (("query_key_value.weight",),)
    split_merged_linears(model)
    assert type(model.query_key_value) is MergedColumnLinear
    assert merged_linears(model) == {}
    model.query_key_value.row_layout = None  # now nothing says how it is stored
    with pytest.raises(ValueError, match="not in the stacked mapping"):
        model_targets(model, {}, "canonical")
    with pytest.raises(ValueError, match="no stacked mapping of 3 pieces"):
        split_merged_linears(model)
    with pytest.raises(AdapterError, match="no STACKED_PARAMS_MAPPING names its pieces"):
        merged_linears(model)
