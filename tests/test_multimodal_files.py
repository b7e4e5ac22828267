"""The checked-in files beyond causal LMs (Qwen2.5-VL, Gemma 3 with its Siglip tower, BERT): they load the
originals' checkpoints, through `from_pretrained` and `load_checkpoint`, and give the originals' outputs on text and
image inputs, with attention merged in the text model and in the vision tower."""

import importlib

import pytest
import torch
from safetensors import safe_open

from fusegen.compiler.modal_inputs import forward_inputs, image_features
from fusegen.compiler.resolve import resolve
from fusegen.runtime import load_checkpoint
from fusegen.testkit import logits_tolerance, max_diff, random_input, random_model, save_random, tiny_config

MERGED_IN = {
    "qwen2_5_vl": {"model.language_model": "qkv_proj", "model.visual": "gate_up_proj"},  # its ViT packs qkv already
    "gemma3": {"model.language_model": "qkv_proj", "model.vision_tower": "qkv_proj"},
    "bert": {"encoder": "qkv_proj"},
}


def parts(model_type):
    target = resolve(model_type)
    module = importlib.import_module(f"generated.fused_{model_type}")
    return target, getattr(module, "Fused" + target.causal_lm.__name__), tiny_config(target)


def flat(features):
    features = [features] if isinstance(features, torch.Tensor) else list(features)
    return torch.cat([tensor.reshape(-1) for tensor in features])


def compare(original, fused, inputs):
    with torch.no_grad():
        expected, actual = original(**inputs)[0], fused(**inputs)[0]
    assert max_diff(expected, actual) <= logits_tolerance(expected)
    if "pixel_values" in inputs:
        with torch.no_grad():
            expected, actual = flat(image_features(original, inputs)), flat(image_features(fused, inputs))
        assert expected.numel() > 0 and max_diff(expected, actual) <= logits_tolerance(expected)


@pytest.mark.slow
@pytest.mark.parametrize("model_type", sorted(MERGED_IN))
def test_file_loads_the_original_checkpoint_and_gives_its_outputs(model_type, tmp_path):
    target, fused_class, config = parts(model_type)
    save_random(target.causal_lm, config, tmp_path)
    original = target.causal_lm.from_pretrained(tmp_path).eval()
    fused, info = fused_class.from_pretrained(tmp_path, output_loading_info=True)
    assert not {key: value for key, value in info.items() if value}
    inputs = forward_inputs(original, config, random_input(config))
    if model_type != "bert":
        assert "pixel_values" in inputs and (inputs["input_ids"] == config.image_token_id).any()
    compare(original, fused.eval(), inputs)
    for prefix, merged in MERGED_IN[model_type].items():
        assert any(name.startswith(prefix) and name.endswith(merged) for name, _ in fused.named_modules()), prefix
    direct = fused_class(config).eval()
    load_checkpoint(direct, tmp_path)
    compare(original, direct, inputs)


@pytest.mark.slow
def test_qwen2_5_vl_loads_its_legacy_key_names(tmp_path):
    # Qwen2.5-VL saves `model.layers.*` and `visual.*`; Transformers renames them to the nested language model's
    # and vision tower's keys on load. Both loaders must follow (the test above would pass on new names alone).
    target, fused_class, config = parts("qwen2_5_vl")
    save_random(target.causal_lm, config, tmp_path)
    with safe_open(str(tmp_path / "model.safetensors"), "pt") as handle:
        keys = set(handle.keys())
    assert "model.layers.0.self_attn.q_proj.weight" in keys and any(key.startswith("visual.") for key in keys)
    model = fused_class(config).eval()
    report = load_checkpoint(model, tmp_path)
    assert report.copied and not report.unexpected


def test_gemma3_siglip_init_weights_initialises_the_merged_rows_as_the_original_the_pieces():
    target, fused_class, config = parts("gemma3")
    original, fused = random_model(target.causal_lm, config), random_model(fused_class, config)
    attention = original.model.vision_tower.encoder.layers[0].self_attn
    merged = fused.model.vision_tower.encoder.layers[0].self_attn
    torch.manual_seed(5)
    original.model.vision_tower._init_weights(attention)
    torch.manual_seed(5)
    fused.model.vision_tower._init_weights(merged)
    for tensor in ("weight", "bias"):
        pieces = torch.cat([getattr(getattr(attention, name), tensor) for name in ("q_proj", "k_proj", "v_proj")])
        assert torch.equal(pieces, getattr(merged.qkv_proj, tensor)), tensor
    assert torch.equal(attention.out_proj.weight, merged.out_proj.weight)
    # A loaded merged weight is skipped, as a loaded projection is.
    before = merged.qkv_proj.weight.detach().clone()
    merged.qkv_proj.weight._is_hf_initialized = True
    fused.model.vision_tower._init_weights(merged)
    assert torch.equal(before, merged.qkv_proj.weight)


def test_image_tokens_are_placed_as_the_processor_places_them():
    target, _, config = parts("qwen2_5_vl")
    original = random_model(target.causal_lm, config)
    inputs = forward_inputs(original, config, random_input(config))
    ids = inputs["input_ids"]
    merge = config.vision_config.spatial_merge_size
    per_image = (2 * merge) ** 2 // merge**2  # one (1, 2m, 2m) grid per image, merged m x m
    assert inputs["image_grid_thw"].tolist() == [[1, 2 * merge, 2 * merge]] * ids.shape[0]
    for row in ids.tolist():
        start = row.index(config.vision_start_token_id)
        assert row[start + 1 : start + 1 + per_image] == [config.image_token_id] * per_image
        assert row[start + 1 + per_image] == config.vision_end_token_id
    assert torch.equal(inputs["mm_token_type_ids"], (ids == config.image_token_id).long())


def test_a_fused_tower_that_never_ran_is_not_verified(monkeypatch):
    # Run on text alone, Qwen2.5-VL's vision tower (whose MLP is fused) never executes: validation must refuse to
    # call that a pass, although the logits agree.
    from fusegen.compiler import validate

    target, fused_class, config = parts("qwen2_5_vl")
    module = importlib.import_module("generated.fused_qwen2_5_vl")
    with open(module.__file__, encoding="utf-8") as handle:
        merging = validate.merging_classes_in_text(handle.read())
    args = (target.causal_lm, fused_class, config, module.STACKED_PARAMS_MAPPING, merging, ("eval",))
    assert validate.check_config("tiny", *args).status == "passed"
    monkeypatch.setattr(validate, "_inputs", lambda original, config, input_ids: input_ids)
    check = validate.check_config("tiny", *args)
    assert check.status == "mismatch" and "FusedQwen2_5_VLMLP fused but never executed" in check.detail


@pytest.mark.slow
def test_the_meta_recording_runs_the_vision_tower_on_an_image():
    # Before, the meta forward fed tokens alone, so a tower's classes were traced with synthetic inputs only.
    from fusegen.compiler.instantiate import candidates, instantiate
    from fusegen.compiler.trace import record_inputs

    model = instantiate(resolve("llava"))
    found = candidates(model)
    recorded = record_inputs(model, list(found.values()))
    reached = {type(module).__name__ for module in found.values() if id(module) in recorded}
    assert {"CLIPAttention", "CLIPMLP", "LlamaAttention"} <= reached


def test_an_anyres_model_gets_its_base_image_and_the_tiles_of_its_grid():
    # LLaVA-NeXT reads `(batch, 1 + tiles, channels, size, size)` and counts the tiles from `image_sizes` and the
    # (shrunk) pinpoints; the original itself runs on the batch and yields image tokens for every sequence.
    from fusegen.compiler.modal_inputs import anyres_tiles

    target = resolve("llava_next")
    config = tiny_config(target)
    original = random_model(target.causal_lm, config).eval()
    inputs = forward_inputs(original, config, random_input(config))
    size = config.vision_config.image_size
    tiles = anyres_tiles(config, size)
    assert tiles == 2  # a square image's best grid among 1x2, 2x1, 2x2, 3x1, 1x3 tiles: 1x2
    assert inputs["pixel_values"].shape == (2, 1 + tiles, 3, size, size)
    assert (inputs["input_ids"] == config.image_token_id).sum(dim=1).min() > 0
    with torch.no_grad():
        assert torch.isfinite(original(**inputs).logits).all()


@pytest.mark.slow
@pytest.mark.parametrize("model_type", ["llava_next", "llava_onevision"])
def test_anyres_models_verify_with_real_images(model_type):
    # Before the pinpoints were shrunk, every config of these was `skipped` (the original could not run).
    from fusegen.compiler.build import build

    result = build(model_type)
    assert result.text is not None and "self.qkv_proj = MergedColumnLinear(" in result.text
    statuses = {check.config: check.status for check in result.validation.checks}
    assert statuses["tiny"] == "passed" and set(statuses.values()) == {"passed"}, result.validation.describe()


def test_the_tp_plan_comes_from_the_one_config_that_has_one():
    # Qwen2.5-VL's plan lives in its text config (the composite and vision configs have none); a file whose base
    # models carry two different plans gets no TP_PLAN rather than one plan applied to the other's modules.
    from transformers import LlamaConfig, LlamaModel, PreTrainedModel

    from fusegen.compiler.instantiate import instantiate
    from fusegen.compiler.mappings import planned_config

    found, reason = planned_config(instantiate(resolve("qwen2_5_vl")))
    assert type(found).__name__ == "Qwen2_5_VLTextConfig" and reason is None
    assert importlib.import_module("generated.fused_qwen2_5_vl").TP_PLAN["layers.*.self_attn.qkv_proj"]

    class Two(PreTrainedModel):
        config_class = LlamaConfig

        def __init__(self, config):
            super().__init__(config)
            self.first, self.second = LlamaModel(config), LlamaModel(LlamaConfig(**config.to_dict()))
            self.second.config.base_model_tp_plan = {"layers.*.mlp.down_proj": "rowwise"}

    with torch.device("meta"):
        tiny = LlamaConfig(hidden_size=8, intermediate_size=16, num_hidden_layers=1, num_attention_heads=2)
        found, reason = planned_config(Two(tiny))
    assert found is None and "different base_model_tp_plans" in reason
