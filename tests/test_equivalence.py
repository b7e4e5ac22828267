"""The fused classes, loaded from an original checkpoint, compute what the original computes."""

import logging

import pytest
import torch
from transformers import LlamaConfig, LlamaForCausalLM
from transformers.utils import logging as hf_logging

from fusegen.testkit import MODELS, TOLERANCE, load_pair, max_diff, model_classes, small_config
from generated.fused_llama import FusedLlamaForCausalLM

HEADS = {"mha": 4, "gqa": 2, "mqa": 1}


def saved_pair(checkpoint, model_type, kv_heads, attn, **config_overrides):
    """A random original of `model_type` saved once, and (original, fused) both loaded from it (`load_pair` fails on
    any missing, unexpected or mismatched key)."""
    config_class, original_class, _ = model_classes(model_type)
    path, _ = checkpoint(original_class, small_config(config_class, num_key_value_heads=kv_heads, **config_overrides))
    return load_pair(path, attn_implementation=attn)


@pytest.mark.slow
@pytest.mark.parametrize("attn", ["eager", "sdpa"])
@pytest.mark.parametrize("heads", sorted(HEADS))
@pytest.mark.parametrize("model_type", sorted(MODELS))
def test_logits_and_greedy_tokens_match(checkpoint, model_type, heads, attn):
    original, fused = saved_pair(checkpoint, model_type, HEADS[heads], attn)

    input_ids = torch.randint(0, 128, (2, 12), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        expected = original(input_ids).logits
        actual = fused(input_ids).logits
    assert max_diff(expected, actual) <= TOLERANCE

    prompt = input_ids[:1, :5]
    kwargs = {"max_new_tokens": 16, "min_new_tokens": 16, "do_sample": False}
    assert torch.equal(original.generate(prompt, **kwargs), fused.generate(prompt, **kwargs))


@pytest.mark.slow
@pytest.mark.parametrize("model_type", sorted(MODELS))
def test_left_padded_batch_with_mask_matches(checkpoint, model_type):
    original, fused = saved_pair(checkpoint, model_type, 2, "sdpa")
    input_ids = torch.randint(3, 128, (2, 10), generator=torch.Generator().manual_seed(2))
    mask = torch.ones_like(input_ids)
    mask[0, :4] = 0  # left padding on the first row
    input_ids[0, :4] = 0
    with torch.no_grad():
        expected = original(input_ids, attention_mask=mask).logits
        actual = fused(input_ids, attention_mask=mask).logits
    assert max_diff(expected[mask.bool()], actual[mask.bool()]) <= TOLERANCE
    kwargs = {"attention_mask": mask, "max_new_tokens": 8, "min_new_tokens": 8, "do_sample": False, "pad_token_id": 0}
    assert torch.equal(original.generate(input_ids, **kwargs), fused.generate(input_ids, **kwargs))


@pytest.mark.parametrize("tie", [True, False])
@pytest.mark.parametrize("model_type", sorted(MODELS))
def test_tied_and_untied_embeddings(checkpoint, model_type, tie):
    original, fused = saved_pair(checkpoint, model_type, 2, "eager", tie_word_embeddings=tie)
    assert (fused.lm_head.weight.data_ptr() == fused.model.embed_tokens.weight.data_ptr()) is tie
    input_ids = torch.arange(10).unsqueeze(0)
    with torch.no_grad():
        assert max_diff(original(input_ids).logits, fused(input_ids).logits) <= TOLERANCE


def test_explicit_head_dim(checkpoint):
    # head_dim * heads != hidden_size: the merged widths must come from head_dim.
    original, fused = saved_pair(checkpoint, "llama", 2, "eager", head_dim=24)
    assert fused.model.layers[0].self_attn.qkv_proj.output_sizes == [96, 48, 48]
    input_ids = torch.arange(10).unsqueeze(0)
    with torch.no_grad():
        assert max_diff(original(input_ids).logits, fused(input_ids).logits) <= TOLERANCE


def test_qwen2_biases_are_merged_in_order(checkpoint):
    original, fused = saved_pair(checkpoint, "qwen2", 2, "eager")
    attention, fused_attention = original.model.layers[1].self_attn, fused.model.layers[1].self_attn
    expected = torch.cat([attention.q_proj.bias, attention.k_proj.bias, attention.v_proj.bias])
    assert torch.equal(fused_attention.qkv_proj.bias, expected)
    assert fused_attention.qkv_proj.bias.shape == (64 + 32 + 32,)


@pytest.mark.parametrize("model_type", sorted(MODELS))
def test_sharded_checkpoint_loads(checkpoint, model_type):
    config_class, original_class, fused_class = model_classes(model_type)
    path, original = checkpoint(
        original_class, small_config(config_class, num_key_value_heads=2), max_shard_size="20KB"
    )
    assert (path / "model.safetensors.index.json").exists()
    fused, info = fused_class.from_pretrained(path, output_loading_info=True)
    assert not any(info.values()), info
    input_ids = torch.arange(10).unsqueeze(0)
    with torch.no_grad():
        assert max_diff(original(input_ids).logits, fused.eval()(input_ids).logits) <= TOLERANCE


@pytest.mark.parametrize("heads", sorted(HEADS))
@pytest.mark.parametrize("model_type", sorted(MODELS))
def test_save_round_trips_to_the_original_class(checkpoint, tmp_path, model_type, heads):
    config_class, original_class, fused_class = model_classes(model_type)
    path, original = checkpoint(original_class, small_config(config_class, num_key_value_heads=HEADS[heads]))
    fused = fused_class.from_pretrained(path)
    fused.save_pretrained(tmp_path / "fused-saved")
    reloaded, info = original_class.from_pretrained(tmp_path / "fused-saved", output_loading_info=True)
    assert not any(info.values()), info
    expected = original.state_dict()
    actual = reloaded.state_dict()
    assert expected.keys() == actual.keys()
    for name, tensor in expected.items():
        assert torch.equal(tensor, actual[name]), name


def test_fresh_fused_model_saves_the_canonical_layout(tmp_path):
    from safetensors import safe_open

    config = small_config(LlamaConfig, num_key_value_heads=1)
    FusedLlamaForCausalLM(config).save_pretrained(tmp_path)
    with safe_open(tmp_path / "model.safetensors", "pt") as handle:
        names = set(handle.keys())
        assert handle.get_tensor("model.layers.0.self_attn.k_proj.weight").shape == (16, 64)
    assert not any("qkv_proj" in name or "gate_up_proj" in name for name in names)
    assert {"model.layers.0.self_attn.q_proj.weight", "model.layers.0.mlp.up_proj.weight"} <= names


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_dtype_is_honoured(checkpoint, dtype):
    path, _ = checkpoint(LlamaForCausalLM, small_config(LlamaConfig, num_key_value_heads=2))
    fused = FusedLlamaForCausalLM.from_pretrained(path, dtype=dtype)
    assert fused.model.layers[0].self_attn.qkv_proj.weight.dtype == dtype


def test_loading_logs_no_warnings(checkpoint, caplog):
    path, _ = checkpoint(LlamaForCausalLM, small_config(LlamaConfig, num_key_value_heads=2))
    hf_logging.enable_propagation()
    try:
        with caplog.at_level(logging.WARNING):
            FusedLlamaForCausalLM.from_pretrained(path)
    finally:
        hf_logging.disable_propagation()
    assert not [r for r in caplog.records if r.levelno >= logging.WARNING], caplog.text


def test_load_weights_streams_canonical_pairs(checkpoint):
    from safetensors.torch import load_file

    path, original = checkpoint(LlamaForCausalLM, small_config(LlamaConfig, num_key_value_heads=2))
    fused = FusedLlamaForCausalLM(original.config).eval()
    loaded = fused.load_weights(load_file(path / "model.safetensors").items())
    assert "model.layers.0.self_attn.qkv_proj.weight" in loaded
    input_ids = torch.arange(10).unsqueeze(0)
    with torch.no_grad():
        assert max_diff(original(input_ids).logits, fused(input_ids).logits) <= TOLERANCE
