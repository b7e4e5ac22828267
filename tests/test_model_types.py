"""Every checked-in generated file, beyond llama and qwen2: equivalent to its original on a tiny config."""

import importlib
from pathlib import Path

import pytest
import torch

import generated
from fusegen.compiler.modal_inputs import forward_inputs
from fusegen.compiler.resolve import resolve
from fusegen.compiler.validate import construction_variants
from fusegen.testkit import SMALL_MLA, TOLERANCE, max_diff, random_input, random_model, small_config, tiny_config

pytestmark = pytest.mark.slow  # every checked-in model type under every construction variant

CONFIGS = {
    "mistral": {},
    "qwen3": {"head_dim": 16},  # q/k norms after the projections
    "gemma3_text": {"head_dim": 16, "sliding_window": 8, "layer_types": ["sliding_attention", "full_attention"]},
    "olmo2": {},  # full-width q/k norms
    "granite": {},
    "starcoder2": {},  # biases; its MLP has no gate/up pair
    "cohere": {},
    "mixtral": {"num_local_experts": 4, "num_experts_per_tok": 2},
    "qwen3_moe": {"num_experts": 4, "num_experts_per_tok": 2, "moe_intermediate_size": 32, "head_dim": 16},
    "deepseek_v3": {**SMALL_MLA, "q_lora_rank": 32, "first_k_dense_replace": 1},
}


@pytest.mark.parametrize("model_type", sorted(CONFIGS))
def test_fused_model_matches_original(model_type, tmp_path):
    target = resolve(model_type)
    config = small_config(target.config_class, num_key_value_heads=2, **CONFIGS[model_type])
    original = random_model(target.causal_lm, config)
    original.save_pretrained(tmp_path / "original")
    module = importlib.import_module(f"generated.fused_{model_type}")
    fused_class = getattr(module, "Fused" + target.causal_lm.__name__)
    fused, info = fused_class.from_pretrained(tmp_path / "original", output_loading_info=True)
    assert not any(info.values()), info
    fused.eval()
    # Same kernels, not just same maths: MoE experts keep Transformers' grouped_mm implementation (eager for dense).
    assert fused.config._experts_implementation == original.config._experts_implementation

    input_ids = random_input(config)
    with torch.no_grad():
        assert max_diff(original(input_ids).logits, fused(input_ids).logits) <= TOLERANCE
    kwargs = {"max_new_tokens": 8, "min_new_tokens": 8, "do_sample": False}
    assert torch.equal(original.generate(input_ids[:1, :5], **kwargs), fused.generate(input_ids[:1, :5], **kwargs))

    fused.save_pretrained(tmp_path / "fused")
    reloaded = target.causal_lm.from_pretrained(tmp_path / "fused")
    expected, actual = original.state_dict(), reloaded.state_dict()
    assert expected.keys() == actual.keys()
    assert all(torch.equal(expected[name], actual[name]) for name in expected)


CHECKED_IN = sorted(path.stem.removeprefix("fused_") for path in Path(generated.__file__).parent.glob("fused_*.py"))


HAND_VARIANTS = {"bert": [("decoder with cross-attention", {"is_decoder": True, "add_cross_attention": True})]}
"""Variants the generic search cannot find: BERT's structure flags are fields of the base config, which it skips.
With cross-attention layers, `forward_inputs` sends encoder states, so the merged q/k/v of those layers runs too."""


@pytest.mark.parametrize("model_type", CHECKED_IN)
def test_checked_in_file_matches_under_every_construction_variant(model_type, tmp_path):
    """The shrunk config and each config variant that builds a different model (dense vs MoE layers, biases,
    q_lora_rank None vs set, tied vs untied, MQA), through the user's path: save_pretrained, the fused
    from_pretrained, logits, and a save that the original class loads back bit-identically."""
    target = resolve(model_type)
    config = tiny_config(target)
    variants = construction_variants(target, config, limit=8)
    variants += [(label, tiny_config(target, **changes)) for label, changes in HAND_VARIANTS.get(model_type, [])]
    assert variants, f"{model_type}: no construction variant found"
    fused_class = getattr(
        importlib.import_module(f"generated.fused_{model_type}"), "Fused" + target.causal_lm.__name__
    )
    for label, variant in [("tiny", config), *variants]:
        original = random_model(target.causal_lm, variant)
        original.save_pretrained(tmp_path / label)
        fused, info = fused_class.from_pretrained(tmp_path / label, output_loading_info=True)
        assert not any(info.values()), (label, info)
        inputs = forward_inputs(original, variant, random_input(variant))  # images too, for a multimodal type
        with torch.no_grad():
            expected = original(**inputs)[0]  # logits, or an encoder's hidden states
            diff = max_diff(expected, fused.eval()(**inputs)[0])
        assert diff <= TOLERANCE, (label, diff)
        assert expected.abs().max().item() > 0.1, label  # logits of order 1: a fault would show
        fused.save_pretrained(tmp_path / f"{label}-fused")
        reloaded = target.causal_lm.from_pretrained(tmp_path / f"{label}-fused")
        want, got = original.state_dict(), reloaded.state_dict()
        assert want.keys() == got.keys(), label
        assert all(torch.equal(want[name], got[name]) for name in want), label
