"""Loading follows the original's own checkpoint conversions (issue 25, item 5): a fused model loads exactly the
checkpoint its original class saves, through `from_pretrained` and `load_checkpoint`, whatever Transformers renames or
converts on the way. One test per cause; each builds a real type's fused file and saves the ORIGINAL's tiny random
model (Transformers' `save_pretrained` writes the legacy names its conversions read back)."""

import pytest
import torch
from safetensors import safe_open

from fusegen.compiler.build import build
from fusegen.compiler.resolve import resolve
from fusegen.runtime import CheckpointError, load_checkpoint
from fusegen.testkit import random_model, tiny_config
from fusegen.tools.convert import import_fused_module


def fused_and_original(model_type, tmp_path):
    target = resolve(model_type, "image-text-to-text")
    out = tmp_path / "generated"
    out.mkdir()
    (out / f"fused_{model_type}.py").write_text(build(f"{model_type}:image-text-to-text", validate=False).text)
    module = import_fused_module(out, model_type)
    config = tiny_config(target)
    original = random_model(target.causal_lm, config)
    original.save_pretrained(tmp_path / "checkpoint")
    return getattr(module, "Fused" + target.causal_lm.__name__), original, config, tmp_path / "checkpoint"


def saved_keys(checkpoint):
    with safe_open(str(checkpoint / "model.safetensors"), "pt") as handle:
        return set(handle.keys())


def assert_same_weights(original, fused):
    """Every parameter of the fused model equals the original's (merged ones: the original's pieces, stacked)."""
    theirs = original.state_dict()
    for name, tensor in fused.state_dict().items():
        if name in theirs:
            assert torch.equal(tensor, theirs[name]), name


@pytest.mark.slow
@pytest.mark.parametrize("model_type", ["aria", "inkling2"])
def test_sub_models_get_their_model_types_conversions_once(model_type, tmp_path):
    # Aria's text model has no class-keyed conversions; Transformers gives it the "aria_text" ones by model type,
    # which turn the saved legacy `experts.fc1.weight` into the stacked `experts.gate_up_proj`. A fused class
    # registered by name was never looked up by model type, so those keys stayed unexpected and the experts random.
    # Inkling2's base model shares its head's model type: the original gets those conversions once, at the root;
    # given them again, a renaming applies twice (`position_embedding.weight.weight`).
    fused_class, original, config, checkpoint = fused_and_original(model_type, tmp_path)
    keys = saved_keys(checkpoint)
    legacy = {"aria": ".mlp.experts.fc1.weight", "inkling2": "model.llm."}[model_type]
    assert any(legacy in key for key in keys)  # the original saved legacy names: the conversions are exercised
    fused, info = fused_class.from_pretrained(checkpoint, dtype=torch.float32, output_loading_info=True)
    assert not {key: value for key, value in info.items() if value}
    assert_same_weights(original, fused)
    direct = random_model(fused_class, config)
    if model_type == "inkling2":
        # Its experts are converted with an op (`Interleave` of `w13_weight`), which `load_checkpoint` does not run:
        # it must refuse, naming the tensor, rather than leave them random.
        with pytest.raises(CheckpointError, match=r"experts\.gate_up_proj.*w13_weight"):
            load_checkpoint(direct, checkpoint)
        return
    load_checkpoint(direct, checkpoint)
    assert_same_weights(original, direct)


@pytest.mark.slow
@pytest.mark.parametrize("model_type", ["kosmos-2", "udop"])
def test_every_merged_linear_is_reached_by_its_pieces(model_type, tmp_path):
    # kosmos-2: `image_to_text_projection.x_attn` sits beside the text and vision models, under the root only, so
    # only a registered root's merge converters reach its q/k/v. udop: its pieces are the bare names q, k, v, and
    # Transformers splices a renamed key at the first occurrence of the matched text: `k` is in `block` first.
    fused_class, original, config, checkpoint = fused_and_original(model_type, tmp_path)
    piece = {"kosmos-2": "image_to_text_projection.x_attn.q_proj.weight", "udop": "block.0.layer.0.SelfAttention.k."}
    assert any(piece[model_type] in key for key in saved_keys(checkpoint))
    fused, info = fused_class.from_pretrained(checkpoint, dtype=torch.float32, output_loading_info=True)
    assert not {key: value for key, value in info.items() if value}
    assert_same_weights(original, fused)
    merged = [name for name, _ in fused.named_parameters() if name.endswith("qkv_proj.weight")]
    assert merged  # the merged linears exist, and were compared through their pieces below
    for name in merged:
        prefix = name.rsplit(".qkv_proj.", 1)[0]
        names = ("q", "k", "v") if model_type == "udop" else ("q_proj", "k_proj", "v_proj")
        pieces = [original.get_parameter(f"{prefix}.{each}.weight") for each in names]
        assert torch.equal(fused.get_parameter(name), torch.cat(pieces)), name
    direct = random_model(fused_class, config)
    load_checkpoint(direct, checkpoint)
    assert_same_weights(original, direct)
    fused.save_pretrained(tmp_path / "again")
    assert saved_keys(tmp_path / "again") == saved_keys(checkpoint)


@pytest.mark.slow
def test_an_original_converter_that_makes_the_pieces_is_followed_by_the_merge(tmp_path):
    # Step3p7's vision tower is saved with one `attn.in_proj_weight`, which the original's converter chunks into
    # q_proj, k_proj, v_proj (and permutes for RoPE). Transformers applies one converter per key, so the merge must be
    # composed with it.
    fused_class, original, _config, checkpoint = fused_and_original("step3p7", tmp_path)
    keys = saved_keys(checkpoint)
    assert any(key.endswith("attn.in_proj_weight") for key in keys)
    fused, info = fused_class.from_pretrained(checkpoint, dtype=torch.float32, output_loading_info=True)
    assert not {key: value for key, value in info.items() if value}
    assert_same_weights(original, fused)
    tower = [name for name, _ in fused.named_parameters() if "vision_model" in name and "qkv_proj" in name]
    assert tower
    for name in tower:
        prefix, _, tensor = name.rpartition(".qkv_proj.")
        pieces = [original.get_parameter(f"{prefix}.{each}.{tensor}") for each in ("q_proj", "k_proj", "v_proj")]
        assert torch.equal(fused.get_parameter(name), torch.cat(pieces)), name
