"""A merged name keeps one meaning per file: BERT-style `query`/`key`/`value` merge into `qkv_proj` unless another
class of the file merges other pieces (`q_proj`/`k_proj`/`v_proj`) into that name; then they keep the name their
pieces join to, `query_key_value` (`fusegen.compiler.analyse.names_to_join`)."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
from torch import nn

from fusegen.compiler.analyse import analyse_classes
from fusegen.compiler.build import build
from fusegen.compiler.mappings import stacked_mapping
from fusegen.core.plan import merged_linears


class VisionAttention(nn.Module):
    def __init__(self, hidden):
        super().__init__()
        self.q_proj = nn.Linear(hidden, hidden)
        self.k_proj = nn.Linear(hidden, hidden)
        self.v_proj = nn.Linear(hidden, hidden)

    def forward(self, x):
        return self.q_proj(x) * self.k_proj(x) + self.v_proj(x)


class TextAttention(nn.Module):
    def __init__(self, hidden):
        super().__init__()
        self.query = nn.Linear(hidden, hidden)
        self.key = nn.Linear(hidden, hidden)
        self.value = nn.Linear(hidden, hidden)

    def forward(self, x):
        return self.query(x) * self.key(x) + self.value(x)


class Both(nn.Module):
    def __init__(self, hidden=8):
        super().__init__()
        self.config = SimpleNamespace(model_type="toy_both_styles")
        self.vision = VisionAttention(hidden)
        self.text = TextAttention(hidden)

    def forward(self, x):
        return self.vision(x) + self.text(x)


class TextOnly(nn.Module):
    def __init__(self, hidden=8):
        super().__init__()
        self.config = SimpleNamespace(model_type="toy_bert_style")
        self.text = TextAttention(hidden)

    def forward(self, x):
        return self.text(x)


def _mapping(model):
    found = {type(child): child for child in model.children()}
    outcomes, rewritten = analyse_classes(model, found, {}, {})
    assert set(rewritten) == set(found)
    return stacked_mapping([plan for outcome in outcomes for plan in merged_linears(outcome.fused)])


def test_bert_style_group_keeps_its_joined_name_where_qkv_proj_means_other_pieces():
    mapping = _mapping(Both())
    assert mapping == {
        "qkv_proj": [("q_proj", "q"), ("k_proj", "k"), ("v_proj", "v")],
        "query_key_value": [("query", "q"), ("key", "k"), ("value", "v")],
    }


def test_bert_style_group_alone_merges_into_qkv_proj():
    assert _mapping(TextOnly()) == {"qkv_proj": [("query", "q"), ("key", "k"), ("value", "v")]}


@pytest.mark.slow
@pytest.mark.parametrize(
    "model_type, text_class, vision_class",
    [
        ("git", "GitSelfAttention", "GitVisionAttention"),
        ("altclip", "AltRobertaSelfAttention", "AltCLIPAttention"),
        ("chinese_clip", "ChineseCLIPTextSelfAttention", "ChineseCLIPVisionAttention"),
    ],
)
def test_files_with_both_styles_build_and_validate(model_type, text_class, vision_class):
    result = build(model_type)  # validated: what is returned has passed (`fusegen.compiler.build._validated`)
    assert result.text is not None and result.validation is not None and result.validation.mismatch is None
    fused = {outcome.class_name: [plan.merged for plan in outcome.fused] for outcome in result.outcomes}
    assert fused[text_class] == ["query_key_value"]
    assert fused[vision_class] == ["qkv_proj"]
    assert "query_key_value" in result.text and "qkv_proj" in result.text
