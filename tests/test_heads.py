"""Targets beyond the causal LM: which class `fusegen build TYPE [--head HEAD]` builds, and what it is called."""

import pytest

from fusegen.cli import main
from fusegen.compiler.resolve import HEADS, UNIVERSE, default_head, model_types, resolve
from fusegen.errors import InputError
from fusegen.fusions.qkv import QKV


@pytest.mark.parametrize(
    "model_type, built",
    [
        ("llama", "LlamaForCausalLM"),
        ("gemma3_text", "Gemma3ForCausalLM"),
        ("qwen2_5_vl", "Qwen2_5_VLForConditionalGeneration"),
        ("qwen3_5", "Qwen3_5ForConditionalGeneration"),  # served with images, not its text-only causal LM
        ("gemma3", "Gemma3ForConditionalGeneration"),
        ("llava", "LlavaForConditionalGeneration"),
        ("bert", "BertModel"),  # an encoder: its base model, not BertLMHeadModel
        ("xlm-roberta", "XLMRobertaModel"),
        ("t5", "T5ForConditionalGeneration"),
        ("bart", "BartForConditionalGeneration"),  # not BartForCausalLM, its decoder alone
        ("whisper", "WhisperForConditionalGeneration"),
        ("clip", "CLIPModel"),
    ],
)
def test_default_head_is_the_class_a_user_serves(model_type, built):
    target = resolve(model_type)
    assert target.causal_lm.__name__ == built
    assert target.source == model_type and target.file_stem == model_type


def test_a_head_is_named_by_mapping_or_by_class_and_recorded_in_the_target():
    by_mapping = resolve("bert", "masked-lm")
    by_class = resolve("bert", "BertForMaskedLM")
    spelled = resolve("bert:masked-lm")
    assert by_mapping.causal_lm.__name__ == by_class.causal_lm.__name__ == spelled.causal_lm.__name__
    assert by_mapping.causal_lm.__name__ == "BertForMaskedLM"
    assert by_mapping.source == by_class.source == spelled.source == "bert:masked-lm"
    assert spelled.file_stem == "bert_masked_lm"
    assert resolve("bert", "base").source == "bert"  # the default head needs no suffix
    assert resolve("kosmos-2.5").model_type == "kosmos-2.5"  # a model type with a dot is no module path


def test_an_unknown_head_names_the_heads_the_type_has():
    with pytest.raises(InputError, match="has no head 'image-text-to-text'.*masked-lm \\(BertForMaskedLM\\)"):
        resolve("bert", "image-text-to-text")
    with pytest.raises(InputError, match="names a head and --head names"):
        resolve("bert:masked-lm", "base")


def test_cli_rejects_a_bad_head_with_exit_2(capsys):
    assert main(["report", "bert", "--head", "nonsense"]) == 2
    assert "has no head 'nonsense'" in capsys.readouterr().err


def test_the_universe_covers_every_mapping_of_the_issue():
    assert set(UNIVERSE) <= set(HEADS)
    for model_type in ("qwen2_5_vl", "qwen3_vl", "gemma3", "mistral3", "llava", "internvl", "smolvlm", "paligemma"):
        assert default_head(model_type) == "image-text-to-text", model_type
    for model_type in ("bert", "xlm-roberta", "modernbert", "distilbert", "deberta"):
        assert default_head(model_type) == "base", model_type
    assert {"t5", "whisper", "clip", "llama"} <= set(model_types())
    assert len(model_types("image-text-to-text")) == 100  # transformers 5.24's mapping


def test_bert_style_query_key_value_merge_into_qkv_proj():
    assert QKV().merged_name(["query", "key", "value"]) == "qkv_proj"
    assert QKV().merged_name(["query_proj", "key_proj", "value_proj"]) == "qkv_proj"
    assert QKV().merged_name(["q_proj", "k_proj", "v_proj"]) == "qkv_proj"
    assert QKV().merged_name(["q", "k", "v"]) == "qkv_proj"  # T5
    assert QKV().merged_name(["to_q", "to_k", "to_v"]) == "to_qkv"
