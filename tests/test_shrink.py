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


@pytest.mark.parametrize(
    "model_type",
    ["glm4v", "glm4v_moe", "glm_ocr", "paddleocr_vl", "hunyuan_vl", "cosmos3_edge", "hy_v4_vl", "qwen2_vl"],
)
def test_multimodal_rope_sections_split_the_tiny_rotary_half(model_type):
    # Before, GLM-4V's and PaddleOCR-VL's models fell back to full-size sections ([8, 12, 12]) the tiny head could not
    # split, HunYuanVL had none (its image positions need three axes), and Cosmos 3 Edge's and HY-V4-VL's own
    # validation rejected their full-size sections. The sections must cover exactly the frequencies the rotary
    # embedding built from the tiny config computes (GLM-4V-MoE rotates half the head, HY-V4-VL its rope slice).
    from fusegen.compiler.resolve import resolve

    target = resolve(model_type)
    with torch.device("meta"):
        model = target.causal_lm(shrunk_config(target.config_class))
    [rotary] = {type(m): m for m in model.modules() if hasattr(m, "mrope_section") and hasattr(m, "inv_freq")}.values()
    assert len(rotary.mrope_section) >= 3 and min(rotary.mrope_section) >= 1
    assert sum(rotary.mrope_section) == rotary.inv_freq.shape[-1]


def test_a_rotary_half_too_narrow_for_three_sections_keeps_the_models_own_fallback():
    from transformers import Qwen3_5Config

    text = shrunk_config(Qwen3_5Config).get_text_config()
    assert "mrope_section" not in text.rope_parameters  # a quarter of 16: two frequencies, fewer than three axes


def test_vision_feature_layers_index_the_tiny_tower_and_stay_distinct():
    # Molmo 2's adapter concatenates the features of layers [24, 18] (set in __post_init__): the tiny config's own
    # validation rejected them for a 2-layer tower.
    from transformers import Molmo2Config

    tiny = shrunk_config(Molmo2Config)
    layers = tiny.adapter_config.vision_feature_layer
    count = tiny.vision_config.num_hidden_layers
    assert len(set(layers)) == len(layers) == 2 and all(0 <= layer < count for layer in layers)


def test_codebook_ranges_and_widths_fit_the_tiny_model():
    from transformers import Apertus1p5Config

    tiny = shrunk_config(Apertus1p5Config)  # validates: image codes end where audio codes begin, inside the vocabulary
    assert tiny.audio_token_offset + tiny.audio_config.codebook_size <= tiny.text_config.vocab_size == VOCAB
    assert tiny.audio_config.codebook_dim == tiny.audio_config.hidden_size <= HIDDEN  # WavTokenizer's demand


def test_nested_sub_config_dicts_are_shrunk_over_their_field_defaults():
    # PI0 spells its PaliGemma's Gemma text config as a dict without `head_dim`: Gemma's default 256 stayed full size,
    # and the tiny VLM's keys no longer matched the action expert's in the shared cache.
    from transformers import PI0Config, Pix2StructConfig

    tiny = shrunk_config(PI0Config)
    assert tiny.vlm_config.text_config.head_dim == tiny.dit_config.head_dim <= HEAD_DIM
    text = shrunk_config(Pix2StructConfig).text_config  # T5-style `d_kv` is a head dim: heads x d_kv is the width
    assert text.d_kv * text.num_heads == text.hidden_size
