"""Downstream use of the checked-in multimodal and encoder files (issue 25 item 7): `generate` with images, the
save/load round trip both ways, and PEFT LoRA on the text model and the vision tower, each against the original
class on a tiny random checkpoint. Tensor parallelism: tests/test_multimodal_tp.py.

The inputs are `fusegen.compiler.modal_inputs.forward_inputs`: pixel values (and `image_grid_thw` for Qwen2.5-VL),
image tokens placed as the processor places them, `token_type_ids` / `mm_token_type_ids` where the forward reads them.
"""

from __future__ import annotations

import importlib
import inspect
import json

import pytest
import torch
from peft import LoraConfig, PeftModel, get_peft_model, get_peft_model_state_dict
from safetensors import safe_open

from fusegen.compiler.modal_inputs import forward_inputs
from fusegen.compiler.resolve import resolve
from fusegen.testkit import TOLERANCE, logits_tolerance, max_diff, random_input, save_random, tiny_config

pytestmark = pytest.mark.slow  # several tiny multimodal models per test, generation, PEFT training steps

TOWERS = {"qwen2_5_vl": "model.visual.", "gemma3": "model.vision_tower.", "bert": None}
MULTIMODAL = ("qwen2_5_vl", "gemma3")
GREEDY = {"max_new_tokens": 6, "min_new_tokens": 6, "do_sample": False}


def classes(model_type):
    target = resolve(model_type)
    module = importlib.import_module(f"generated.fused_{model_type}")
    return target.causal_lm, getattr(module, "Fused" + target.causal_lm.__name__), tiny_config(target)


@pytest.fixture(scope="module")
def saved(tmp_path_factory):
    """`saved(model_type)`: (original class, fused class, path of a tiny random original checkpoint, inputs)."""
    done = {}

    def get(model_type):
        if model_type not in done:
            original_class, fused_class, config = classes(model_type)
            path = tmp_path_factory.mktemp(model_type)
            model = save_random(original_class, config, path).eval()
            done[model_type] = original_class, fused_class, path, forward_inputs(model, config, random_input(config))
        return done[model_type]

    return get


def outputs(model, inputs) -> torch.Tensor:
    with torch.no_grad():
        return model(**inputs)[0]


def file_tensors(path) -> dict[str, torch.Tensor]:
    with safe_open(str(path / "model.safetensors"), "pt") as handle:
        return {key: handle.get_tensor(key) for key in handle.keys()}  # noqa: SIM118


# --------------------------------------------------------------------------------------------------------------------
# generate with images
# --------------------------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("cache", ["dynamic", "static", "no-cache"])
@pytest.mark.parametrize("model_type", MULTIMODAL)
def test_generate_with_images_gives_the_originals_tokens_and_logits(saved, model_type, cache):
    original_class, fused_class, path, inputs = saved(model_type)
    original, fused = original_class.from_pretrained(path).eval(), fused_class.from_pretrained(path).eval()
    assert "pixel_values" in inputs and (inputs["input_ids"] == original.config.image_token_id).any()
    assert {"qkv_proj", "gate_up_proj"} <= {name.rpartition(".")[2] for name, _ in fused.named_modules()}
    options = {**GREEDY, "output_logits": True, "return_dict_in_generate": True}
    options.update({"static": {"cache_implementation": "static"}, "no-cache": {"use_cache": False}}.get(cache, {}))
    expected, actual = original.generate(**inputs, **options), fused.generate(**inputs, **options)
    assert expected.sequences.shape[1] == inputs["input_ids"].shape[1] + GREEDY["max_new_tokens"]
    assert torch.equal(actual.sequences, expected.sequences)
    differences = [max_diff(want, got) for want, got in zip(expected.logits, actual.logits, strict=True)]
    print(f"{model_type} {cache}: {len(differences)} steps, max logits difference {max(differences):.3g}")
    for step, (want, difference) in enumerate(zip(expected.logits, differences)):
        assert difference <= logits_tolerance(want), step


# --------------------------------------------------------------------------------------------------------------------
# save / load round trip
# --------------------------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("model_type", sorted(TOWERS))
def test_fused_save_is_the_originals_checkpoint_and_loads_into_it(saved, model_type, tmp_path):
    """The fused save writes the very tensors, under the very names (Qwen2.5-VL's legacy `model.layers.*` and
    `visual.*` included), that the original's save writes; the original class loads it with nothing missing or left
    over, to an identical state dict; config.json names the original class."""
    original_class, fused_class, path, inputs = saved(model_type)
    original, fused = original_class.from_pretrained(path).eval(), fused_class.from_pretrained(path).eval()
    original.save_pretrained(tmp_path / "original")
    fused.save_pretrained(tmp_path / "fused")
    expected, written = file_tensors(tmp_path / "original"), file_tensors(tmp_path / "fused")
    assert sorted(written) == sorted(expected)
    assert all(torch.equal(written[key], expected[key]) for key in expected)
    if model_type == "qwen2_5_vl":
        assert "model.layers.0.self_attn.q_proj.weight" in written and any(k.startswith("visual.") for k in written)
    config = json.loads((tmp_path / "fused" / "config.json").read_text())
    assert config["architectures"] == [original_class.__name__]
    reloaded, info = original_class.from_pretrained(tmp_path / "fused", output_loading_info=True)
    assert not {key: value for key, value in info.items() if value}
    before, after = original.state_dict(), reloaded.state_dict()
    assert sorted(after) == sorted(before) and all(torch.equal(after[key], before[key]) for key in before)
    assert torch.equal(outputs(reloaded.eval(), inputs), outputs(original, inputs))


@pytest.mark.parametrize("model_type", sorted(TOWERS))
def test_originals_save_loads_into_the_fused_class(saved, model_type, tmp_path):
    original_class, fused_class, path, inputs = saved(model_type)
    original_class.from_pretrained(path).save_pretrained(tmp_path / "original")
    fused = fused_class.from_pretrained(path).eval()
    reloaded, info = fused_class.from_pretrained(tmp_path / "original", output_loading_info=True)
    assert not {key: value for key, value in info.items() if value}
    before, after = fused.state_dict(), reloaded.state_dict()
    assert sorted(after) == sorted(before) and all(torch.equal(after[key], before[key]) for key in before)
    assert any("qkv_proj" in key for key in after)
    if TOWERS[model_type]:  # the tower is fused too (Qwen's ViT packs qkv already: its MLP is the merge there)
        assert any(key.startswith(TOWERS[model_type]) and "_proj" in key and ("qkv" in key or "gate_up" in key)
                   for key in after)  # fmt: skip
    assert torch.equal(outputs(reloaded.eval(), inputs), outputs(fused, inputs))


# --------------------------------------------------------------------------------------------------------------------
# PEFT LoRA on the text model and the vision tower
# --------------------------------------------------------------------------------------------------------------------

TARGETS = {
    # text attention q/k/v and both MLPs' gate/up (text Qwen2MLP, ViT Qwen2_5_VLMLP); the ViT's own packed `qkv`
    "qwen2_5_vl": ["q_proj", "k_proj", "v_proj", "gate_proj", "up_proj", "qkv"],
    # text attention and MLP; Siglip's q/k/v (its MLP is fc1/fc2, nothing merged)
    "gemma3": ["q_proj", "k_proj", "v_proj", "gate_proj", "up_proj"],
    "bert": ["query", "key", "value"],
}
ADAPTED_IN_TOWER = {"qwen2_5_vl": ("mlp.gate_proj", "mlp.up_proj"), "gemma3": ("q_proj", "k_proj", "v_proj")}


def loss(model, inputs) -> torch.Tensor:
    """The LM loss on the input tokens, or for an encoder the mean square of its hidden states."""
    if "labels" in inspect.signature(type(model.get_base_model()).forward).parameters:
        return model(**inputs, labels=inputs["input_ids"]).loss
    return model(**inputs)[0].pow(2).mean()


def same_seed_run(model, targets, inputs, seed=7, steps=3):
    """`get_peft_model` at `seed`, then `steps` AdamW steps at seed + 1: (model, initial adapter, losses)."""
    torch.manual_seed(seed)
    model = get_peft_model(model, LoraConfig(r=4, lora_alpha=8, target_modules=targets))
    initial = {key: value.clone() for key, value in get_peft_model_state_dict(model).items()}
    torch.manual_seed(seed + 1)
    optimizer = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=1e-2)
    model.train()
    losses = []
    for _ in range(steps):
        optimizer.zero_grad()
        value = loss(model, inputs)
        value.backward()
        optimizer.step()
        losses.append(value.item())
    return model.eval(), initial, losses


@pytest.mark.parametrize("model_type", sorted(TARGETS))
def test_same_seed_lora_on_text_and_vision_modules_is_the_originals(saved, model_type, tmp_path):
    """Same seed: bit-identical initial adapters (canonical names, vision tower included), the same losses over 3
    AdamW steps, the same outputs after; the fused model's saved adapter is canonical and the original loads it."""
    original_class, fused_class, path, inputs = saved(model_type)
    targets = TARGETS[model_type]
    original, initial, losses = same_seed_run(original_class.from_pretrained(path), targets, inputs)
    fused, fused_initial, fused_losses = same_seed_run(fused_class.from_pretrained(path), targets, inputs)
    assert sorted(fused_initial) == sorted(initial)
    tower = TOWERS[model_type]
    if tower:
        in_tower = [key for key in initial if key.startswith("base_model.model." + tower)]
        assert all(any(f".{piece}.lora_" in key for key in in_tower) for piece in ADAPTED_IN_TOWER[model_type])
    unequal = [key for key in initial if not torch.equal(fused_initial[key], initial[key])]
    assert not unequal, f"{len(unequal)} of {len(initial)} initial adapter tensors differ, e.g. {unequal[:2]}"
    difference = max(abs(a - b) for a, b in zip(losses, fused_losses))
    print(f"{model_type}: losses {losses}, max loss difference {difference:.3g}")
    assert difference <= TOLERANCE * max(1.0, *losses), (losses, fused_losses)
    expected, actual = outputs(original, inputs), outputs(fused, inputs)
    assert max_diff(expected, actual) <= logits_tolerance(expected)
    fused.save_pretrained(tmp_path / "adapter")
    with safe_open(str(tmp_path / "adapter" / "adapter_model.safetensors"), "pt") as handle:
        keys = set(handle.keys())
    assert keys and not any("qkv_proj" in key or "gate_up_proj" in key for key in keys)
    reloaded = PeftModel.from_pretrained(original_class.from_pretrained(path), tmp_path / "adapter").eval()
    assert max_diff(actual, outputs(reloaded, inputs)) <= logits_tolerance(actual)


@pytest.mark.parametrize("model_type", sorted(TARGETS))
def test_the_originals_adapter_loads_into_the_fused_class(saved, model_type, tmp_path):
    original_class, fused_class, path, inputs = saved(model_type)
    original, _, _ = same_seed_run(original_class.from_pretrained(path), TARGETS[model_type], inputs, steps=2)
    original.save_pretrained(tmp_path / "adapter")
    fused = PeftModel.from_pretrained(fused_class.from_pretrained(path), tmp_path / "adapter").eval()
    expected = outputs(original, inputs)
    assert max_diff(expected, outputs(fused, inputs)) <= logits_tolerance(expected)
