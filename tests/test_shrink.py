"""`fusegen.compiler.shrink.shrunk_config`: default configs shrink to tiny ones that still build the same architecture."""

import pytest
import torch
from transformers import (
    Gemma2Config,
    Gemma2ForCausalLM,
    LlamaConfig,
    LlamaForCausalLM,
    Qwen2Config,
    Qwen2ForCausalLM,
    Qwen3MoeConfig,
    Qwen3MoeForCausalLM,
)

from fusegen.compiler.shrink import HEAD_DIM, HIDDEN, VOCAB, ShrinkError, shrunk_config

MAX_PARAMETERS = 1_000_000


def parameters_on_meta(model_class, config) -> int:
    with torch.device("meta"):
        model = model_class(config)
    return sum(parameter.numel() for parameter in model.parameters())


@pytest.mark.parametrize(
    "config_class, model_class",
    [(LlamaConfig, LlamaForCausalLM), (Qwen2Config, Qwen2ForCausalLM)],
    ids=["llama", "qwen2"],
)
def test_dense_model_is_tiny_and_builds(config_class, model_class):
    config = shrunk_config(config_class)
    assert (config.hidden_size, config.num_hidden_layers, config.vocab_size) == (HIDDEN, 2, VOCAB)
    assert config.num_attention_heads % config.num_key_value_heads == 0
    assert getattr(config, "head_dim", None) in (None, HEAD_DIM)
    assert parameters_on_meta(model_class, config) < MAX_PARAMETERS


def test_special_token_ids_fit_the_vocabulary():
    config = shrunk_config(LlamaConfig)  # bos/eos default to ids below 256: kept as they are
    assert (config.bos_token_id, config.eos_token_id) == (LlamaConfig().bos_token_id, LlamaConfig().eos_token_id)
    config = shrunk_config(Qwen2Config)  # Qwen2's ids are beyond 256: moved to the top of the tiny vocabulary
    for token_id in (config.bos_token_id, config.eos_token_id):
        assert token_id is None or 0 <= token_id < config.vocab_size


@pytest.mark.parametrize("kv_heads, expected", [(None, 4), (32, 4), (8, 2), (1, 1)])
def test_attention_kind_is_kept(kv_heads, expected):
    # MHA (kv == heads) stays MHA, GQA stays GQA, MQA stays MQA.
    config = LlamaConfig(num_attention_heads=32, num_key_value_heads=kv_heads)
    assert shrunk_config(config).num_key_value_heads == expected


def test_moe_has_few_small_experts():
    config = shrunk_config(Qwen3MoeConfig)
    assert config.num_experts == 4 and config.num_experts_per_tok == 2
    assert config.moe_intermediate_size <= 32
    # `mlp_only_layers` stays a list of valid (new) layer indices
    assert all(0 <= i < config.num_hidden_layers for i in config.mlp_only_layers)
    assert parameters_on_meta(Qwen3MoeForCausalLM, config) < MAX_PARAMETERS


def test_layer_types_follow_the_kept_layers():
    # Gemma 2 alternates sliding and full attention: both kinds must survive the cut to a few layers.
    config = shrunk_config(Gemma2Config)
    assert len(config.layer_types) == config.num_hidden_layers <= 4
    assert set(config.layer_types) == set(Gemma2Config().layer_types)
    assert parameters_on_meta(Gemma2ForCausalLM, config) < MAX_PARAMETERS


def test_mrope_section_fits_the_rotary_dimension():
    # A config instance is shrunk too, nested text config and multimodal RoPE sections included.
    from transformers import Qwen2VLConfig

    rope = {"rope_type": "default", "rope_theta": 1e6, "mrope_section": [16, 24, 24]}
    text = shrunk_config(Qwen2VLConfig(text_config={"rope_parameters": rope})).get_text_config()
    section = text.rope_parameters["mrope_section"]
    assert sum(section) == text.hidden_size // text.num_attention_heads // 2
    assert all(part >= 1 for part in section)


def test_overrides_win():
    assert shrunk_config(LlamaConfig, num_hidden_layers=3).num_hidden_layers == 3


def test_rejects_what_is_not_a_config():
    with pytest.raises(ShrinkError, match="config class or instance"):
        shrunk_config(LlamaForCausalLM)


@pytest.mark.parametrize("model_type", ["llava_next", "llava_onevision"])
def test_anyres_pinpoints_are_rescaled_with_the_vision_tile(model_type):
    # Before, the tiny tower's image size shrank and the pinpoints did not: every grid was hundreds of tiles, and the
    # original could not run its own tiny config (validation skipped).
    from transformers import CONFIG_MAPPING

    full, tiny = CONFIG_MAPPING[model_type](), shrunk_config(CONFIG_MAPPING[model_type])
    old, new = full.vision_config.image_size, tiny.vision_config.image_size
    assert new < old and all(h % old == 0 and w % old == 0 for h, w in full.image_grid_pinpoints)
    assert tiny.image_grid_pinpoints == [[h // old * new, w // old * new] for h, w in full.image_grid_pinpoints]
