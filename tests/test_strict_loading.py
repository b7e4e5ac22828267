"""Config-independent stacked mappings, and strict loading: a merged parameter is filled exactly, or loading raises.

Each model is built from configs that construct different modules (dense first layers, dense-only layer lists), saved
as its original class, and loaded into the fused class with `from_pretrained`: the logits must agree, and where the
checkpoint cannot fill a merged parameter a `CheckpointError` naming the tensor must be raised, never a random init.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file
from transformers import (
    DeepseekV2Config,
    DeepseekV2ForCausalLM,
    LlamaConfig,
    LlamaForCausalLM,
    Qwen2MoeConfig,
    Qwen2MoeForCausalLM,
    Qwen3MoeConfig,
    Qwen3MoeForCausalLM,
)
from transformers.utils.loading_report import LoadStateDictInfo

from fusegen.compiler.build import build
from fusegen.runtime import CheckpointError, check_loading, load_checkpoint
from fusegen.testkit import SMALL_MLA, TOLERANCE, import_file, max_diff, random_model, small_config
from generated.fused_llama import FusedLlamaForCausalLM, FusedLlamaModel
from generated.fused_qwen3_moe import FusedQwen3MoeForCausalLM

IDS = torch.randint(0, 128, (2, 12), generator=torch.Generator().manual_seed(1))
MOE = {"num_key_value_heads": 2, "num_experts_per_tok": 2, "moe_intermediate_size": 32}
DEEPSEEK_V2 = {**MOE, **SMALL_MLA, "n_shared_experts": 1, "q_lora_rank": None}
QWEN2_MOE = {**MOE, "num_experts": 4, "shared_expert_intermediate_size": 48}


@pytest.fixture(scope="module")
def built(tmp_path_factory):
    """deepseek_v2 and qwen2_moe, whose default configs build no dense layer, built fresh into a temporary directory."""
    out = tmp_path_factory.mktemp("built")
    modules = {}
    for model_type in ("deepseek_v2", "qwen2_moe"):
        path = out / f"fused_{model_type}.py"
        path.write_text(build(model_type).text)
        modules[model_type] = import_file(path, f"strict_loading_fused_{model_type}")
    return modules


def save_original(tmp_path, original_class, config):
    model = random_model(original_class, config)
    model.save_pretrained(tmp_path / "original")
    return tmp_path / "original", model


def assert_loads_exactly(fused_class, path, original):
    fused, info = fused_class.from_pretrained(path, output_loading_info=True)
    assert not any(info.values()), info
    with torch.no_grad():
        assert max_diff(original(IDS).logits, fused.eval()(IDS).logits) <= TOLERANCE
    return fused


# --------------------------------------------------------------------------------------------------------------------
# Config variants: every placement of a merged linear loads, whatever config the build instantiated
# --------------------------------------------------------------------------------------------------------------------


@pytest.mark.slow
@pytest.mark.parametrize("dense_layers", [0, 1, 2])
def test_deepseek_v2_dense_first_layers_load_exactly(built, tmp_path, dense_layers):
    config = small_config(DeepseekV2Config, **DEEPSEEK_V2, first_k_dense_replace=dense_layers)
    path, original = save_original(tmp_path, DeepseekV2ForCausalLM, config)
    fused = assert_loads_exactly(built["deepseek_v2"].FusedDeepseekV2ForCausalLM, path, original)
    if dense_layers:
        merged = fused.model.layers[0].mlp.gate_up_proj.weight
        mlp = original.model.layers[0].mlp
        assert torch.equal(merged, torch.cat([mlp.gate_proj.weight, mlp.up_proj.weight]))


@pytest.mark.slow
def test_deepseek_v2_mapping_and_tp_plan_name_every_placement(built):
    module = built["deepseek_v2"]
    assert module.TP_PLAN["layers.*.mlp.gate_up_proj"] == "fusegen_merged_colwise"
    assert module.TP_PLAN["layers.*.mlp.shared_experts.gate_up_proj"] == "fusegen_merged_colwise"
    assert not any(key.endswith((".gate_proj", ".up_proj")) for key in module.TP_PLAN)
    assert '"gate_up_proj": ["mlp", "shared_experts"]' in Path(module.__file__).read_text()


@pytest.mark.parametrize(
    "variant",
    [{}, {"mlp_only_layers": [0]}, {"decoder_sparse_step": 2}, {"mlp_only_layers": [0, 1]}],
    ids=["all-sparse", "mlp-only-0", "sparse-step-2", "all-dense"],
)
@pytest.mark.slow
def test_qwen2_moe_dense_layers_load_exactly(built, tmp_path, variant):
    config = small_config(Qwen2MoeConfig, **QWEN2_MOE, **variant)
    path, original = save_original(tmp_path, Qwen2MoeForCausalLM, config)
    assert_loads_exactly(built["qwen2_moe"].FusedQwen2MoeForCausalLM, path, original)


@pytest.mark.parametrize("variant", [{}, {"mlp_only_layers": [0]}], ids=["all-sparse", "mlp-only-0"])
def test_qwen3_moe_dense_layers_load_exactly(tmp_path, variant):
    config = small_config(Qwen3MoeConfig, **MOE, num_experts=4, head_dim=16, **variant)
    path, original = save_original(tmp_path, Qwen3MoeForCausalLM, config)
    assert_loads_exactly(FusedQwen3MoeForCausalLM, path, original)


# --------------------------------------------------------------------------------------------------------------------
# Strictness: what the mapping cannot fill raises, naming the tensor
# --------------------------------------------------------------------------------------------------------------------


@pytest.mark.slow
def test_a_stale_mapping_that_misses_the_dense_layer_raises(built, tmp_path):
    """The file the old compiler wrote (parents read off the default config) must refuse, not random-init layer 0."""
    text = Path(built["deepseek_v2"].__file__).read_text()
    stale = text.replace('"gate_up_proj": ["mlp", "shared_experts"]', '"gate_up_proj": ["shared_experts"]')
    assert stale != text
    (tmp_path / "fused_deepseek_v2.py").write_text(stale)
    module = import_file(tmp_path / "fused_deepseek_v2.py", "strict_loading_stale_deepseek_v2")
    config = small_config(DeepseekV2Config, **DEEPSEEK_V2, first_k_dense_replace=1)
    path, _ = save_original(tmp_path, DeepseekV2ForCausalLM, config)
    with pytest.raises(CheckpointError) as error:
        module.FusedDeepseekV2ForCausalLM.from_pretrained(path)
    assert error.value.tensor == "model.layers.0.mlp.gate_proj.weight"
    assert "model.layers.0.mlp.gate_up_proj.weight" in str(error.value) and "mapped nowhere" in str(error.value)


def without(path, name):
    state = load_file(path / "model.safetensors")
    del state[name]
    save_file(state, str(path / "model.safetensors"), metadata={"format": "pt"})


def test_missing_k_proj_raises_through_from_pretrained_and_load_checkpoint(checkpoint):
    path, original = checkpoint(LlamaForCausalLM, small_config(LlamaConfig, num_key_value_heads=2))
    without(path, "model.layers.1.self_attn.k_proj.weight")
    with pytest.raises(CheckpointError) as error:
        FusedLlamaForCausalLM.from_pretrained(path)
    message = str(error.value)
    assert error.value.tensor == "model.layers.1.self_attn.qkv_proj.weight"
    assert "model.layers.1.self_attn.k_proj.weight" in message and "merging its pieces failed" in message
    with pytest.raises(CheckpointError, match="model.layers.1.self_attn.k_proj.weight"):
        load_checkpoint(FusedLlamaForCausalLM(original.config), path)


def test_a_checkpoint_without_any_piece_reports_the_merged_parameter_missing_as_the_original_does(checkpoint):
    """Transformers' contract for a parameter the checkpoint lacks: listed in `missing_keys` (the model's own name) and
    initialised by `_init_weights`, not an error. The original does that for gate_proj and up_proj; the fused class for
    the gate_up_proj they make, with the same initialisation (normal, std `initializer_range`) and everything else
    loaded exactly."""
    config = small_config(LlamaConfig, num_key_value_heads=2, initializer_range=0.5)
    path, original = checkpoint(LlamaForCausalLM, config)
    for piece in ("gate_proj", "up_proj"):
        without(path, f"model.layers.0.mlp.{piece}.weight")
    reference, expected = LlamaForCausalLM.from_pretrained(path, output_loading_info=True)
    assert expected["missing_keys"] == {"model.layers.0.mlp.gate_proj.weight", "model.layers.0.mlp.up_proj.weight"}
    fused, info = FusedLlamaForCausalLM.from_pretrained(path, output_loading_info=True)
    assert info["missing_keys"] == {"model.layers.0.mlp.gate_up_proj.weight"}
    assert not info["unexpected_keys"] and not info["mismatched_keys"]
    merged = fused.model.layers[0].mlp.gate_up_proj.weight
    pieces = torch.cat([reference.model.layers[0].mlp.gate_proj.weight, reference.model.layers[0].mlp.up_proj.weight])
    assert merged.shape == pieces.shape
    assert abs(merged.std().item() - 0.5) < 0.05 and abs(pieces.std().item() - 0.5) < 0.05  # same init rule
    with torch.no_grad():
        loaded = fused.model.layers[1].self_attn.qkv_proj.weight
        attention = original.model.layers[1].self_attn
        assert torch.equal(
            loaded, torch.cat([attention.q_proj.weight, attention.k_proj.weight, attention.v_proj.weight])
        )


def test_missing_merged_parameters_are_named_as_transformers_names_its_own_merged_parameters(tmp_path):
    """Why a merged parameter none of whose pieces is in the checkpoint is listed under the MODEL's name, not the
    canonical piece names (docs/loading.md): Transformers does exactly that for the parameters it merges itself.
    Mixtral's v5 model stacks the v4 experts (`block_sparse_moe.experts.N.w1/w3`) into `mlp.experts.gate_up_proj`;
    a checkpoint saved in the v4 layout without layer 0's experts is reported as missing `...experts.gate_up_proj`
    and `...experts.down_proj`, names only the loaded model has. A fused model's `state_dict()` holds its merged
    names too, and Transformers' common test `test_model_weights_reload_no_missing_tied_weights` requires every
    missing key to be one of them; the fused class follows the same rule for `qkv_proj` / `gate_up_proj`."""
    from transformers import MixtralConfig, MixtralForCausalLM

    config = MixtralConfig(
        vocab_size=64, hidden_size=32, intermediate_size=16, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, num_local_experts=2, num_experts_per_tok=1,
    )  # fmt: skip
    MixtralForCausalLM(config).save_pretrained(tmp_path, save_original_format=True)
    state = load_file(tmp_path / "model.safetensors")
    dropped = [name for name in state if name.startswith("model.layers.0.block_sparse_moe.experts.")]
    assert "model.layers.0.block_sparse_moe.experts.0.w1.weight" in dropped  # the v4 (canonical) layout
    save_file({k: v for k, v in state.items() if k not in dropped}, str(tmp_path / "model.safetensors"),
              metadata={"format": "pt"})  # fmt: skip
    model, info = MixtralForCausalLM.from_pretrained(tmp_path, output_loading_info=True)
    assert info["missing_keys"] == {"model.layers.0.mlp.experts.gate_up_proj", "model.layers.0.mlp.experts.down_proj"}
    assert info["missing_keys"] <= set(model.state_dict())


def test_errors_name_the_class_called_the_file_and_the_tensor_without_a_traceback(checkpoint):
    path, _ = checkpoint(LlamaForCausalLM, small_config(LlamaConfig, num_key_value_heads=2))
    without(path, "model.layers.1.self_attn.k_proj.weight")
    with pytest.raises(CheckpointError) as error:
        FusedLlamaForCausalLM.from_pretrained(path)
    message = str(error.value)
    assert message.startswith(f"{path / 'model.safetensors'}: tensor 'model.layers.1.self_attn.qkv_proj.weight': ")
    assert "FusedLlamaForCausalLM: merged parameter" in message and "FusedLlamaModel" not in message
    assert "Traceback" not in message and 'File "' not in message and len(message.splitlines()) == 1, message
    assert error.value.file == str(path / "model.safetensors")
    # Validation before Transformers reads anything (here: a cut file) names the class too.
    data = (path / "model.safetensors").read_bytes()
    (path / "model.safetensors").write_bytes(data[: len(data) - 100])
    with pytest.raises(CheckpointError) as error:
        FusedLlamaForCausalLM.from_pretrained(path)
    assert "FusedLlamaForCausalLM: " in str(error.value) and len(str(error.value).splitlines()) == 1, error.value
    assert error.value.file == str(path / "model.safetensors") and error.value.tensor


def test_an_unmappable_q_proj_under_a_new_parent_leaves_nothing_random(checkpoint):
    """It maps nowhere, but no merged parameter misses it: from_pretrained loads exactly and reports it as unexpected;
    load_checkpoint (strict) refuses it."""
    path, original = checkpoint(LlamaForCausalLM, small_config(LlamaConfig, num_key_value_heads=2))
    state = load_file(path / "model.safetensors")
    extra = "model.layers.0.cross_attn.q_proj.weight"
    state[extra] = torch.zeros(64, 64)
    save_file(state, str(path / "model.safetensors"), metadata={"format": "pt"})
    fused, info = FusedLlamaForCausalLM.from_pretrained(path, output_loading_info=True)
    assert info["unexpected_keys"] == {extra} and not info["missing_keys"]
    with torch.no_grad():
        assert torch.equal(fused.eval()(IDS).logits, original(IDS).logits)
    with pytest.raises(CheckpointError, match="unexpected") as error:
        load_checkpoint(FusedLlamaForCausalLM(original.config), path)
    assert error.value.tensor == extra


def test_base_model_from_a_causal_lm_checkpoint_and_tied_heads_still_load(checkpoint, tmp_path):
    path, original = checkpoint(
        LlamaForCausalLM, small_config(LlamaConfig, num_key_value_heads=2, tie_word_embeddings=True)
    )
    base, info = FusedLlamaModel.from_pretrained(path, output_loading_info=True)
    assert not info["missing_keys"] and not info["unexpected_keys"]
    with torch.no_grad():
        expected = original.model(IDS).last_hidden_state
        assert max_diff(base.eval()(IDS).last_hidden_state, expected) <= TOLERANCE
    fused, info = FusedLlamaForCausalLM.from_pretrained(path, output_loading_info=True)
    assert not any(info.values()), info
    assert fused.lm_head.weight is fused.model.embed_tokens.weight


def info(missing=(), unexpected=(), errors=None):
    return LoadStateDictInfo(
        missing_keys=set(missing),
        unexpected_keys=set(unexpected),
        mismatched_keys=set(),
        error_msgs=[],
        conversion_errors=errors or {},
        skipped_pp_keys=set(),
    )


def test_a_piece_renamed_to_a_merged_name_the_model_lacks_raises_when_its_own_piece_is_missing():
    """An unfused module at a scoped path: its q_proj renamed to a qkv_proj it does not have, its own q_proj missing."""
    with torch.device("meta"):
        model = FusedLlamaForCausalLM(small_config(LlamaConfig, num_key_value_heads=2))
    renamed = "model.layers.0.cross_attn.qkv_proj.weight"
    check_loading(model, info(unexpected=[renamed]))  # nothing of the model is missing: fine
    model.model.layers[0].cross_attn = torch.nn.Module()
    model.model.layers[0].cross_attn.q_proj = torch.nn.Linear(4, 4, device="meta")
    lost = "model.layers.0.cross_attn.q_proj.weight"
    with pytest.raises(CheckpointError, match="does not have") as error:
        check_loading(model, info(missing=[lost], unexpected=[renamed]), where="ckpt")
    assert error.value.tensor == lost and error.value.file == "ckpt"


def _with_traceback(text):
    """A conversion error as Transformers records it: the formatted traceback, the message, then where."""
    try:
        raise ValueError(text)
    except ValueError as error:
        import traceback

        return "".join(traceback.format_exception(error)) + f"{text}\nError: MergedColumnConcatenate on tensors"


def test_ordinary_missing_keys_are_left_to_transformers():
    with torch.device("meta"):
        model = FusedLlamaForCausalLM(small_config(LlamaConfig, num_key_value_heads=2))
    check_loading(model, info(missing=["lm_head.weight", "model.norm.weight"], unexpected=["model.extra.weight"]))
    merged = ["model.layers.1.self_attn.qkv_proj.bias", "model.layers.1.self_attn.qkv_proj.weight"]
    check_loading(model, info(missing=merged))  # none of its pieces: missing, as the original's q/k/v would be
    stray = "model.layers.1.self_attn.k_proj.weight"
    with pytest.raises(CheckpointError, match="mapped nowhere") as error:
        check_loading(model, info(missing=merged, unexpected=[stray]), caller="FusedLlamaForCausalLM")
    assert error.value.tensor == stray and str(error.value).count("FusedLlamaForCausalLM: ") == 1


def test_parents_come_from_every_construction_site_in_the_source():
    """Both branches of a conditional count; a holder built any other way leaves its merged name unscoped."""
    import ast

    from fusegen.compiler.scopes import holder_references as _holder_references

    source = """
class Layer(nn.Module):
    def __init__(self, config, i):
        super(Layer, self).__init__()
        self.mlp = Moe(config) if i >= config.first_k_dense_replace else Mlp(config)
        self.extra: nn.Module = Mlp(config) or None
        if isinstance(self.mlp, Mlp):
            pass

class Moe(nn.Module):
    def __init__(self, config):
        self.shared_experts = Mlp(config)
        self.experts = nn.ModuleList([Mlp(config) for _ in range(4)])
"""
    layer, moe = ast.parse(source).body
    assert sorted(_holder_references(layer, {"Mlp", "Layer"})) == [("Mlp", "extra"), ("Mlp", "mlp")]
    assert sorted(_holder_references(moe, {"Mlp"})) == [("Mlp", ""), ("Mlp", "shared_experts")]


def test_a_merged_parameter_tied_to_a_filled_one_counts_as_filled():
    """Zamba saves its shared transformer once and ties it into every other hybrid layer (`all_tied_weights_keys`):
    the tied copies' merged weights are missing from the checkpoint, and Transformers' `tie_weights` fills them."""
    with torch.device("meta"):
        model = FusedLlamaForCausalLM(small_config(LlamaConfig, num_key_value_heads=2))
    target, source = "model.layers.1.self_attn.qkv_proj.weight", "model.layers.0.self_attn.qkv_proj.weight"
    model.all_tied_weights_keys = {**model.all_tied_weights_keys, target: source}
    check_loading(model, info(missing=[target]))  # the source was filled: the tie fills the target
    check_loading(model, info(missing=[source]))  # only the target was in the checkpoint: Transformers swaps them
    # Nothing real to tie in and no piece in the checkpoint: missing, as the original's would be (Transformers
    # initialises them); only a failed merge or a stray piece raises.
    check_loading(model, info(missing=[target, source]))
    with pytest.raises(CheckpointError, match="merging its pieces failed: ValueError: sizes") as error:
        check_loading(model, info(missing=[target, source], errors={source: _with_traceback("sizes")}))
    assert error.value.tensor == source and "Traceback" not in str(error.value)


def test_zamba_shared_transformer_loads_through_its_tied_merged_weights(tmp_path):
    """End to end: the tiny Zamba saved by the original class loads into the fused class, ties and all."""
    from fusegen.compiler.resolve import resolve
    from fusegen.compiler.shrink import shrunk_config as shrunk

    (tmp_path / "fused_zamba.py").write_text(build("zamba").text)
    module = import_file(tmp_path / "fused_zamba.py", "strict_loading_fused_zamba")
    target = resolve("zamba")
    config = shrunk(target.config_class)
    assert config.layers_block_type.count("hybrid") >= 2, config.layers_block_type
    path, original = save_original(tmp_path, target.causal_lm, config)
    fused = assert_loads_exactly(module.FusedZambaForCausalLM, path, original)
    hybrid = [layer for layer in fused.model.layers if hasattr(layer, "shared_transf")]
    first, *rest = (layer.shared_transf.self_attn.qkv_proj.weight for layer in hybrid)
    assert rest and all(weight is first for weight in rest)
