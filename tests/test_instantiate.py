"""Building models on meta from default configs that the installed Transformers leaves incomplete."""

import pytest

from fusegen.compiler.instantiate import candidates, instantiate
from fusegen.compiler.resolve import resolve
from fusegen.errors import InputError


def test_llama_builds_on_meta_without_memory():
    model = instantiate(resolve("llama"))
    assert all(parameter.is_meta for parameter in model.parameters())
    # The linear kinds want the attention and the MLP, the rmsnorm kind the norm.
    assert [cls.__name__ for cls in candidates(model)] == ["LlamaAttention", "LlamaMLP", "LlamaRMSNorm"]


@pytest.mark.parametrize("model_type", ["ministral", "emu3"])
def test_known_gaps_in_default_configs_are_filled(model_type):
    # ministral leaves head_dim None; emu3 never sets pad_token_id (transformers 5.24).
    model = instantiate(resolve(model_type, "causal-lm"))
    assert candidates(model)


def test_a_config_that_cannot_be_repaired_is_an_input_error():
    from dataclasses import replace

    from transformers import LlamaConfig, LlamaForCausalLM

    class _Broken(LlamaForCausalLM):
        def __init__(self, config):
            raise RuntimeError("no such layer kind")

    # the tiny config does not help either: the class itself cannot be built
    with pytest.raises(InputError, match=r"cannot be built on the meta device .*RuntimeError: no such layer kind"):
        instantiate(replace(resolve("llama"), causal_lm=_Broken, config_class=LlamaConfig))


@pytest.mark.parametrize(
    ("model_type", "causal_lm"),
    [
        # DBRX reads `attn_config.rope_theta`, a field DbrxAttentionConfig does not define (transformers 5.24)
        ("dbrx", "DbrxForCausalLM"),
        # the causal LM takes the decoder part of a config that also holds a text encoder
        ("musicgen", "MusicgenForCausalLM"),
        ("musicgen_melody", "MusicgenMelodyForCausalLM"),
        # the default config is rejected by its own validation (hidden_size_per_layer_input must be 0)
        ("gemma4_assistant", "Gemma4AssistantForCausalLM"),
        # the rotary embedding reads `rope_parameters["full_attention"]`, which the default leaves empty
        ("cohere_compass_text", "CohereCompassForCausalLM"),
        # the composite config's text part leaves the indexer's sizes unset
        ("qwen4_exp", "Qwen4ExpForCausalLM"),
    ],
)
def test_broken_default_configs_build_from_the_tiny_config(model_type, causal_lm):
    model = instantiate(resolve(model_type, "causal-lm"))
    assert type(model).__name__ == causal_lm
    assert candidates(model)


def test_dbrx_is_analysed_with_a_config_whose_attention_runs():
    # The default config's `clip_qkv=None` makes DbrxAttention's clamp fail: the guessed fill-in is not kept.
    model = instantiate(resolve("dbrx"))
    attention = model.transformer.blocks[0].norm_attn_norm.attn
    assert attention.clip_qkv is not None and attention.num_key_value_heads < attention.num_heads


def test_a_field_missing_on_a_nested_config_is_filled_there():
    from transformers import DbrxConfig

    from fusegen.compiler.instantiate import _repair

    config = DbrxConfig()
    error = AttributeError("'DbrxAttentionConfig' object has no attribute 'rope_theta'")
    assert _repair(config, error) is config
    assert config.attn_config.rope_theta is None


def test_plain_containers_are_not_candidates():
    # Gemma3nTextModel holds its altup projections in a ModuleList, which has no forward to trace.
    model = instantiate(resolve("gemma3n_text"))
    assert not any(cls.__name__ in ("ModuleList", "ModuleDict") for cls in candidates(model))
