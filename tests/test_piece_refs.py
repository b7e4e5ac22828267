"""Outside reads of a fused projection: guarded against the class (no reference), or kept through the merged rows."""

import ast
import textwrap

import pytest
import torch
from torch import nn

from fusegen.compiler.build import analyse
from fusegen.compiler.piece_refs import guarded_against, isinstance_guards, rewritable, rewrite_piece_references
from fusegen.core import astutil
from fusegen.runtime import MergedColumnLinear, merged_piece


class Attention(nn.Module):
    pass


class OtherAttention(nn.Module):
    pass


class SubAttention(Attention):
    pass


def init_child(child, std):
    if getattr(child, "weight", None) is not None:
        child.weight.normal_(std=std)


def init_child_and_more(child, std):
    child.weight.normal_(std=std)
    return child.in_features  # a use beyond weight/bias: not rewritable


NAMESPACE = {
    "Attention": Attention,
    "OtherAttention": OtherAttention,
    "SubAttention": SubAttention,
    "init_child": init_child,
    "init_child_and_more": init_child_and_more,
}


def reads(source: str):
    """The class statement of `source`, its guards and parent map, and its `*.q_proj` reads in order."""
    classdef = ast.parse(textwrap.dedent(source)).body[0]
    found = [n for n in ast.walk(classdef) if isinstance(n, ast.Attribute) and n.attr == "q_proj"]
    found.sort(key=lambda node: node.lineno)
    return classdef, isinstance_guards(classdef, NAMESPACE), astutil.parent_map(classdef), found


SOURCE = """
class Base:
    def _init_weights(self, module):
        module.q_proj.weight.zero_()  # 0: no guard
        if isinstance(module, Attention):
            module.q_proj.weight.zero_()  # 1: exactly Attention, weight
            init_child(module.q_proj, 0.02)  # 2: passed to a function reading only weight
            init_child_and_more(module.q_proj, 0.02)  # 3: passed to a function reading more
            module.q_proj.in_features  # 4: another attribute
        elif isinstance(module, (Attention, OtherAttention)):
            module.q_proj.bias.zero_()  # 5: a tuple guard
        elif isinstance(module, OtherAttention) and module.flag:
            module.q_proj.weight.zero_()  # 6: a conjunction naming OtherAttention only
        if isinstance(module, Attention):
            module = other
            module.q_proj.weight.zero_()  # 7: the name is rebound in the body
        else:
            module.q_proj.weight.zero_()  # 8: the else branch is not guarded
"""


def test_a_read_under_a_guard_that_excludes_the_class_is_no_reference_to_it():
    _, guards, _, found = reads(SOURCE)
    assert [guarded_against(node, guards, Attention) for node in found] == [False] * 6 + [True, False, False]
    assert [guarded_against(node, guards, OtherAttention) for node in found] == [False, True, True, True, True] + [
        False
    ] * 4
    # A subclass of a guard's class is an instance of it: the read may reach it.
    assert not guarded_against(found[1], guards, SubAttention)
    assert guarded_against(found[6], guards, SubAttention)
    assert not guarded_against(found[6], guards, None)  # the fused class unknown: never excused


def test_only_weight_and_bias_reads_under_a_guard_naming_exactly_the_class_are_rewritable():
    _, guards, parent_of, found = reads(SOURCE)
    verdicts = [rewritable(node, guards, Attention, parent_of, NAMESPACE) for node in found]
    assert verdicts == [False, True, True, False, False, False, False, False, False]
    assert not rewritable(found[1], guards, SubAttention, parent_of, NAMESPACE)  # the guard must name the class


def test_rewrite_reads_the_pieces_rows_of_the_merged_linear():
    classdef, _, _, _ = reads(SOURCE)
    assert rewrite_piece_references(classdef, NAMESPACE, {Attention: {"q_proj": ("qkv_proj", 0)}})
    text = ast.unparse(classdef)
    assert text.count("merged_piece(module.qkv_proj, 0)") == 2
    assert "merged_piece(module.qkv_proj, 0).weight.zero_()" in text
    assert "init_child(merged_piece(module.qkv_proj, 0), 0.02)" in text
    assert text.count("module.q_proj") == 7


def test_merged_piece_views_the_pieces_rows_and_carries_the_loaded_flag():
    linear = MergedColumnLinear(4, [3, 2, 2], bias=[True, False, True])
    piece = merged_piece(linear, 1)
    assert piece.weight.shape == (2, 4) and piece.bias is None and piece.out_features == 2
    torch.nn.init.zeros_(merged_piece(linear, 2).weight)
    assert not linear.weight[5:].any() and linear.weight[:5].all()
    linear.weight._is_hf_initialized = True
    assert merged_piece(linear, 0).weight._is_hf_initialized is True
    with pytest.raises(AttributeError):
        merged_piece(linear, 0).forward  # noqa: B018 - nothing beyond weight and bias


def rules(outcomes):
    return {(outcome.class_name, refusal.rule) for outcome in outcomes for refusal in outcome.refused}


@pytest.mark.slow
def test_gemma3_fuses_its_text_attention_and_its_siglip_tower():
    # SiglipPreTrainedModel._init_weights reads module.q_proj under isinstance(module, SiglipAttention): no
    # reference to Gemma3Attention, and a rewritable one to SiglipAttention. Before, both were refused.
    outcomes = analyse("gemma3").outcomes
    fused = {outcome.class_name for outcome in outcomes if any(p.merged == "qkv_proj" for p in outcome.fused)}
    assert {"Gemma3Attention", "SiglipAttention"} <= fused
    assert not {rule for _, rule in rules(outcomes)} & {"outside-reference", "ambiguous-checkpoint-names"}


def test_a_real_reference_the_rewrite_cannot_keep_still_refuses():
    # ModernBertDecoderPreTrainedModel._init_weights passes module.q_proj to `init_weight`, a function defined
    # inside it (and asking `isinstance(module, nn.Linear)`), not one of the module's: the fusion stays refused.
    assert ("ModernBertDecoderAttention", "outside-reference") in rules(analyse("modernbert-decoder").outcomes)
