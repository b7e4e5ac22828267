"""Projections that exist only under a condition, and pieces with differing bias flags.

- MLA (DeepSeek V2/V3): `q_a_proj` is built only when `q_lora_rank` is set; it merges with `kv_a_proj_with_mqa` into
  `fused_qkv_a_proj` there, and where it is None the class keeps `q_proj` and a plain `kv_a_proj_with_mqa`.
- Whisper: `k_proj` has no bias while `v_proj` has one; the merged bias holds zero rows for k that are never saved,
  never demanded from a checkpoint, and never trained.

Every case is the original class saved with `save_pretrained` and loaded into the fused class: logits and every
gradient agree (the tolerances of fusegen/compiler/validate.py), and a fused save loads back into the original class
bit-identically.
"""

from __future__ import annotations

import ast
import inspect
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file
from torch import nn
from transformers import (
    DeepseekV2Config,
    DeepseekV2ForCausalLM,
    DeepseekV3Config,
    DeepseekV3ForCausalLM,
    WhisperConfig,
    WhisperForCausalLM,
)

from fusegen.compiler.build import build
from fusegen.runtime import CheckpointError, MergedColumnLinear, load_checkpoint, save_checkpoint
from fusegen.testkit import GRAD_TOLERANCE, SMALL_MLA, TOLERANCE, import_file, random_model, small_config
from generated import fused_deepseek_v3

IDS = torch.randint(0, 128, (2, 12), generator=torch.Generator().manual_seed(1))
MLA = {"num_key_value_heads": 4, **SMALL_MLA}
WHISPER = {
    "vocab_size": 128,
    "d_model": 64,
    "decoder_layers": 2,
    "decoder_attention_heads": 4,
    "decoder_ffn_dim": 96,
    "encoder_layers": 1,
    "encoder_attention_heads": 4,
    "encoder_ffn_dim": 96,
    "max_target_positions": 64,
    "max_source_positions": 64,
    "is_encoder_decoder": False,
    "pad_token_id": 0,
    "bos_token_id": 1,
    "eos_token_id": 2,
    "decoder_start_token_id": 1,
}


@pytest.fixture(scope="module")
def built(tmp_path_factory):
    """deepseek_v2 and whisper built fresh (deepseek_v3 is checked in)."""
    out = tmp_path_factory.mktemp("conditional")
    modules = {"deepseek_v3": fused_deepseek_v3}
    for model_type in ("deepseek_v2", "whisper"):
        path = out / f"fused_{model_type}.py"
        path.write_text(build(f"{model_type}:causal-lm").text)  # Whisper's decoder alone
        modules[model_type] = import_file(path, f"conditional_fused_{model_type}")
    return modules


# --------------------------------------------------------------------------------------------------------------------
# Comparing a fused model with its original
# --------------------------------------------------------------------------------------------------------------------


def expected_gradient(name: str, fused: nn.Module, original_grads: dict, mapping: dict) -> torch.Tensor:
    """The original's gradient for fused parameter `name`: itself, or its pieces' stacked (zeros for a piece without
    a bias). Written here from the mapping's names, independently of the compiler's validation."""
    if name in original_grads:
        return original_grads[name]
    path, _, leaf = name.rpartition(".")
    owner, _, attribute = path.rpartition(".")
    module = fused.get_submodule(path)
    pieces = []
    for (piece, _), size in zip(mapping[attribute], module.output_sizes):
        key = f"{owner}.{piece}.{leaf}"
        pieces.append(original_grads[key] if key in original_grads else torch.zeros(size, dtype=torch.float64))
        assert key in original_grads or leaf == "bias", key
    return torch.cat(pieces)


def gradients(model: nn.Module) -> dict[str, torch.Tensor]:
    model.train()
    model.zero_grad(set_to_none=True)
    logits = model(IDS).logits.double()
    cotangent = torch.randn(logits.shape, generator=torch.Generator().manual_seed(3), dtype=logits.dtype)
    (logits * cotangent).sum().backward()
    model.eval()
    return {
        name: (p.grad if p.grad is not None else torch.zeros_like(p)).double() for name, p in model.named_parameters()
    }


def assert_equivalent(original: nn.Module, fused: nn.Module, mapping: dict) -> None:
    """Same logits (eval) and the same gradient for every fused parameter (train, dropout off)."""
    with torch.no_grad():
        expected = original.eval()(IDS).logits
        assert expected.abs().max() > 0.1  # logits of order 1: a fault would show
        assert (expected - fused.eval()(IDS).logits).abs().max().item() <= TOLERANCE
    want, got = gradients(original), gradients(fused)
    scale = max(g.abs().max().item() for g in want.values())
    for name, grad in got.items():
        reference = expected_gradient(name, fused, want, mapping)
        assert grad.shape == reference.shape, name
        assert (grad - reference).abs().max().item() <= GRAD_TOLERANCE * scale, name


def round_trip(original_class, fused_class, config, tmp_path, mapping):
    """Original saved -> fused loaded (nothing missing or unexpected) -> equivalent -> fused saved -> original loads
    it back bit-identically, with exactly the original's tensor names in the file."""
    original = random_model(original_class, config)
    original.save_pretrained(tmp_path / "original")
    fused, info = fused_class.from_pretrained(tmp_path / "original", output_loading_info=True)
    assert not any(info.values()), info
    assert_equivalent(original, fused, mapping)
    fused.save_pretrained(tmp_path / "fused")
    assert (
        load_file(tmp_path / "fused" / "model.safetensors").keys()
        == load_file(tmp_path / "original" / "model.safetensors").keys()
    )
    reloaded = original_class.from_pretrained(tmp_path / "fused")
    want, got = original.state_dict(), reloaded.state_dict()
    assert want.keys() == got.keys()
    assert all(torch.equal(want[name], got[name]) for name in want)
    return original, fused


# --------------------------------------------------------------------------------------------------------------------
# MLA with a conditional q_a_proj
# --------------------------------------------------------------------------------------------------------------------

DEEPSEEK = {
    "deepseek_v3": (DeepseekV3Config, DeepseekV3ForCausalLM),
    "deepseek_v2": (DeepseekV2Config, DeepseekV2ForCausalLM),
}


@pytest.mark.parametrize("model_type", sorted(DEEPSEEK))
@pytest.mark.parametrize("q_lora_rank", [None, 24])
@pytest.mark.parametrize("dense_layers", [0, 1])
def test_mla_matches_the_original_for_both_q_lora_ranks(built, tmp_path, model_type, q_lora_rank, dense_layers):
    config_class, original_class = DEEPSEEK[model_type]
    module = built[model_type]
    config = small_config(config_class, **MLA, q_lora_rank=q_lora_rank, first_k_dense_replace=dense_layers)
    fused_class = getattr(module, "Fused" + original_class.__name__)
    _, fused = round_trip(original_class, fused_class, config, tmp_path, module.STACKED_PARAMS_MAPPING)
    attention = fused.model.layers[0].self_attn
    if q_lora_rank is None:
        assert (
            attention.fused_qkv_a_proj is None and attention.q_a_proj is None
            if hasattr(attention, "q_a_proj")
            else True
        )
        assert type(attention.kv_a_proj_with_mqa) is nn.Linear and type(attention.q_proj) is nn.Linear
    else:
        assert attention.kv_a_proj_with_mqa is None and attention.q_proj is None
        assert attention.fused_qkv_a_proj.output_sizes == [q_lora_rank, MLA["kv_lora_rank"] + MLA["qk_rope_head_dim"]]


def test_mla_mapping_names_fused_qkv_a_proj(built):
    for model_type in DEEPSEEK:
        module = built[model_type]
        assert module.STACKED_PARAMS_MAPPING["fused_qkv_a_proj"] == [("q_a_proj", 0), ("kv_a_proj_with_mqa", 1)]


def test_mla_generated_class_keeps_both_branches():
    """`__init__`: one `if` on the original condition, whose branch builds the merged construction and whose other
    branch builds the always-built kv_a_proj_with_mqa, both at the last projection's place; `forward`: the merged
    call is guarded by the merged linear's existence, and the `q_lora_rank is None` branch still calls q_proj as the
    original does."""
    cls = fused_deepseek_v3.FusedDeepseekV3Attention
    init = inspect.getsource(cls.__init__)
    tree = ast.parse(inspect.cleandoc("\n" + init) if init.startswith(" ") else init)
    [merge] = [n for n in ast.walk(tree) if isinstance(n, ast.If) and "fused_qkv_a_proj" in ast.unparse(n.body[0])]
    assert ast.unparse(merge.test) == "self.q_lora_rank is not None"
    body, orelse = ([ast.unparse(stmt) for stmt in branch] for branch in (merge.body, merge.orelse))
    assert body[0].startswith("self.fused_qkv_a_proj = MergedColumnLinear(") and body[1:] == [
        "self.fused_qkv_a_proj_sizes = self.fused_qkv_a_proj.output_sizes",
        "self.kv_a_proj_with_mqa = None",
    ]
    assert orelse[:2] == ["self.fused_qkv_a_proj = None", "self.fused_qkv_a_proj_sizes = None"]
    assert orelse[2].startswith("self.kv_a_proj_with_mqa = nn.Linear(") and len(orelse) == 3
    assert "self.q_a_proj" not in init and " if self.fused_qkv_a_proj is not None else " not in init
    forward = inspect.getsource(cls.forward)
    assert "if self.fused_qkv_a_proj is not None:" in forward
    assert "kv_a_proj_with_mqa_out = self.kv_a_proj_with_mqa(hidden_states)" in forward
    assert "q_states = self.q_proj(hidden_states)" in forward
    assert "self.q_b_proj(self.q_a_layernorm(q_a_proj_out))" in forward


@pytest.mark.parametrize("q_lora_rank", [None, 24])
def test_mla_construction_registers_and_draws_as_the_original(q_lora_rank):
    """Built from one seed, the fused DeepSeek V3 registers its parameters in the original's order, the merged linear
    at its last piece's place (where the flat conditional merge builds it, `rewrite_init._conditional_merge`; the one
    `if` block keeps that place), and leaves the random generator where the original does."""
    from tests.test_gemma4_qkv import merged_order

    config = small_config(DeepseekV3Config, **MLA, q_lora_rank=q_lora_rank, first_k_dense_replace=1)
    torch.manual_seed(0)
    original = DeepseekV3ForCausalLM(config)
    after_original = torch.get_rng_state()
    torch.manual_seed(0)
    fused = fused_deepseek_v3.FusedDeepseekV3ForCausalLM(config)
    assert torch.equal(torch.get_rng_state(), after_original)
    mapping = fused_deepseek_v3.STACKED_PARAMS_MAPPING
    assert [name for name, _ in fused.named_parameters()] == merged_order(original, fused, mapping, at="last")
    assert any("fused_qkv_a_proj" in name for name, _ in fused.named_parameters()) is (q_lora_rank is not None)


def test_mla_without_q_lora_rank_still_demands_its_own_tensors(built, tmp_path):
    """The q_lora_rank=None config demands no fused_qkv_a_proj, but a missing kv_a_proj_with_mqa still raises."""
    config = small_config(DeepseekV3Config, **MLA, q_lora_rank=None, first_k_dense_replace=1)
    original = random_model(DeepseekV3ForCausalLM, config)
    original.save_pretrained(tmp_path / "original")
    tensors = load_file(tmp_path / "original" / "model.safetensors")
    del tensors["model.layers.1.self_attn.kv_a_proj_with_mqa.weight"]
    save_file(tensors, tmp_path / "original" / "model.safetensors", metadata={"format": "pt"})
    fused = fused_deepseek_v3.FusedDeepseekV3ForCausalLM(config)
    with pytest.raises(CheckpointError, match="kv_a_proj_with_mqa"):
        load_checkpoint(fused, tmp_path / "original")


# --------------------------------------------------------------------------------------------------------------------
# Differing bias flags: Whisper's k_proj has no bias
# --------------------------------------------------------------------------------------------------------------------


def whisper_config(**overrides):
    return WhisperConfig(**{**WHISPER, **overrides})


def k_bias_rows(qkv: MergedColumnLinear) -> torch.Tensor:
    """The rows of the merged bias that belong to k_proj, which has no bias."""
    return qkv.bias.split(qkv.output_sizes)[1]


def test_whisper_qkv_proj_carries_per_piece_bias_flags(built):
    source = Path(built["whisper"].__file__).read_text()
    assert (
        "self.qkv_proj = MergedColumnLinear(embed_dim, [embed_dim, embed_dim, embed_dim], bias=[bias, False, bias])"
        in source
    )
    fused = built["whisper"].FusedWhisperForCausalLM(whisper_config())
    qkv = fused.model.decoder.layers[0].self_attn.qkv_proj
    assert qkv.bias_pieces == [True, False, True]
    assert not k_bias_rows(qkv).any()


def test_whisper_matches_and_never_saves_the_zero_bias(built, tmp_path):
    module = built["whisper"]
    round_trip(
        WhisperForCausalLM, module.FusedWhisperForCausalLM, whisper_config(), tmp_path, module.STACKED_PARAMS_MAPPING
    )
    saved = load_file(tmp_path / "fused" / "model.safetensors")
    assert not any(key.endswith("k_proj.bias") for key in saved)
    assert any(key.endswith("v_proj.bias") for key in saved)


def test_whisper_zero_bias_rows_stay_out_of_training(built, tmp_path):
    """An AdamW step with weight decay on both models: still equivalent, the k rows of the merged bias still zero."""
    module = built["whisper"]
    original = random_model(WhisperForCausalLM, whisper_config())
    original.save_pretrained(tmp_path / "original")
    fused = module.FusedWhisperForCausalLM.from_pretrained(tmp_path / "original")
    for model in (original, fused):
        optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2, weight_decay=0.1)
        model.train()
        model(IDS).logits.square().mean().backward()
        optimizer.step()
    assert_equivalent(original, fused, module.STACKED_PARAMS_MAPPING)
    assert not k_bias_rows(fused.model.decoder.layers[0].self_attn.qkv_proj).any()


def test_whisper_checkpoint_missing_a_real_bias_raises(built, tmp_path):
    """Only the bias k_proj never had may be absent: a missing v_proj.bias or k_proj.weight is refused by name."""
    original = random_model(WhisperForCausalLM, whisper_config())
    original.save_pretrained(tmp_path / "original")
    tensors = load_file(tmp_path / "original" / "model.safetensors")
    fused_class = built["whisper"].FusedWhisperForCausalLM
    for missing in ("model.decoder.layers.1.self_attn.v_proj.bias", "model.decoder.layers.1.self_attn.k_proj.weight"):
        broken = tmp_path / missing
        broken.mkdir()
        original.config.save_pretrained(broken)
        save_file(
            {k: v for k, v in tensors.items() if k != missing}, broken / "model.safetensors", metadata={"format": "pt"}
        )
        with pytest.raises(CheckpointError, match=missing.rpartition(".")[0].rpartition(".")[0]):
            fused_class.from_pretrained(broken)
        with pytest.raises(CheckpointError, match=missing):
            load_checkpoint(fused_class(whisper_config()), broken)


def test_whisper_fusegen_loader_and_saver(built, tmp_path):
    """`load_checkpoint` / `save_checkpoint`: the canonical file without k_proj.bias loads (strict), the k rows are
    zero even over garbage, a stray k_proj.bias is unexpected (as it is to the original), and saving omits it."""
    original = random_model(WhisperForCausalLM, whisper_config())
    original.save_pretrained(tmp_path / "original")
    fused = built["whisper"].FusedWhisperForCausalLM(whisper_config())
    qkv = fused.model.decoder.layers[0].self_attn.qkv_proj
    with torch.no_grad():
        qkv.bias.fill_(7.0)
    load_checkpoint(fused, tmp_path / "original")
    assert not k_bias_rows(qkv).any()
    with torch.no_grad():
        assert (original.eval()(IDS).logits - fused.eval()(IDS).logits).abs().max().item() <= TOLERANCE
    save_checkpoint(fused, tmp_path / "saved")
    saved = load_file(tmp_path / "saved" / "model.safetensors")
    assert saved.keys() == load_file(tmp_path / "original" / "model.safetensors").keys()
    stray = dict(saved)
    stray["model.decoder.layers.0.self_attn.k_proj.bias"] = torch.ones(WHISPER["d_model"])
    save_file(stray, tmp_path / "saved" / "model.safetensors", metadata={"format": "pt"})
    with pytest.raises(CheckpointError, match="k_proj.bias"):
        load_checkpoint(fused, tmp_path / "saved")


def test_merged_linear_bias_flags():
    """Each piece is its own `F.linear`, with or without its bias; the rows of a piece without one are inert."""
    torch.manual_seed(0)
    merged = MergedColumnLinear(8, [4, 3, 5], bias=[True, False, True])
    assert merged.bias_pieces == [True, False, True] and not merged.bias[4:7].any()
    with torch.no_grad():
        merged.bias.normal_()  # garbage in the k rows must not matter
    x = torch.randn(2, 8)
    q, k, v = merged(x).split(merged.output_sizes, dim=-1)
    w_q, w_k, w_v = merged.weight.split(merged.output_sizes)
    b_q, _, b_v = merged.bias.split(merged.output_sizes)
    assert torch.allclose(q, nn.functional.linear(x, w_q, b_q), atol=TOLERANCE)
    assert torch.allclose(k, nn.functional.linear(x, w_k), atol=TOLERANCE)
    assert torch.allclose(v, nn.functional.linear(x, w_v, b_v), atol=TOLERANCE)
    merged(x).sum().backward()
    assert not merged.bias.grad[4:7].any() and merged.bias.grad[:4].all()
    assert MergedColumnLinear(8, [4, 4], bias=[False, False]).bias is None
    assert MergedColumnLinear(8, [4, 4], bias=True).bias_pieces == [True, True]
    with pytest.raises(ValueError, match="2 flags for 3"):
        MergedColumnLinear(8, [4, 4, 4], bias=[True, False])


# --------------------------------------------------------------------------------------------------------------------
# Gemma 4: v_proj exists only without attention_k_eq_v (full layers), k and v only in layers not sharing kv
# --------------------------------------------------------------------------------------------------------------------

GEMMA4 = {
    "vocab_size": 128,
    "vocab_size_per_layer_input": 128,
    "hidden_size_per_layer_input": 8,
    "hidden_size": 64,
    "intermediate_size": 96,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "head_dim": 16,
    "global_head_dim": 16,
    "max_position_embeddings": 128,
    "sliding_window": 8,
    "pad_token_id": 0,
    "bos_token_id": 1,
    "eos_token_id": 2,
}
# The fused Gemma 4 attention (q_proj joining k/v in a nested block) is tested in tests/test_gemma4_qkv.py.


def test_quantizing_keeps_a_merged_linear_without_some_bias_as_its_pieces_and_sharding_refuses(built):
    """A quantizer's forward or a TP partition would not leave the zero bias rows out. Under a quantization config
    the merged linear is built as the original's pieces (k_proj without a bias, as in the original) and is not stacked
    back (fusegen/runtime/quantized.py); a TP partition refuses, by name."""
    from fusegen.runtime.quantized import PiecewiseLinear, compose_merged_linears
    from fusegen.runtime.tp.styles import _partition

    config = whisper_config()
    config.quantization_config = {"quant_method": "bitsandbytes", "load_in_8bit": True}
    quantized = built["whisper"].FusedWhisperForCausalLM(config)
    attention = quantized.model.decoder.layers[0].self_attn
    assert isinstance(attention.qkv_proj, PiecewiseLinear)
    assert attention.k_proj.bias is None and attention.q_proj.bias is not None and attention.v_proj.bias is not None
    compose_merged_linears(quantized)  # float pieces (no quantizer ran): stacked with zero k rows, as unquantized
    assert attention.qkv_proj.bias_pieces == [True, False, True]

    fused = built["whisper"].FusedWhisperForCausalLM(whisper_config())

    class Mesh:
        def size(self):
            return 2

        def get_local_rank(self):
            return 0

    qkv = fused.model.decoder.layers[0].self_attn.qkv_proj
    with pytest.raises(ValueError, match=r"bias_pieces=\[True, False, True\]"):
        _partition(qkv, Mesh())
    assert qkv.output_sizes == [WHISPER["d_model"]] * 3  # left as it was


def test_whisper_lora_on_k_and_v_gives_the_originals_outputs_and_trains_the_same(built, tmp_path):
    """A canonical LoRA adapter on k_proj and v_proj (random A and B) loads onto qkv_proj; one SGD step on each model
    keeps them equal, and the fused save is canonical (loads into the original)."""
    from peft import LoraConfig, PeftModel, get_peft_model

    original = random_model(WhisperForCausalLM, whisper_config())
    original.save_pretrained(tmp_path / "base")
    fused_class = built["whisper"].FusedWhisperForCausalLM
    adapted = get_peft_model(
        WhisperForCausalLM.from_pretrained(tmp_path / "base"), LoraConfig(r=4, target_modules=["k_proj", "v_proj"])
    )
    torch.manual_seed(5)
    with torch.no_grad():
        for name, parameter in adapted.named_parameters():
            if "lora_" in name:
                parameter.normal_(0, 0.3)
    adapted.save_pretrained(tmp_path / "adapter")

    def step(model):
        model.train()
        optimizer = torch.optim.SGD([p for p in model.parameters() if p.requires_grad], lr=0.5)
        model(input_ids=IDS, labels=IDS).loss.backward()
        optimizer.step()
        with torch.no_grad():
            return model.eval()(input_ids=IDS).logits

    base = WhisperForCausalLM.from_pretrained(tmp_path / "base")
    want = step(PeftModel.from_pretrained(base, tmp_path / "adapter", is_trainable=True))
    fused = PeftModel.from_pretrained(
        fused_class.from_pretrained(tmp_path / "base"), tmp_path / "adapter", is_trainable=True
    )
    got = step(fused)
    assert (want - got).abs().max().item() <= TOLERANCE
    fused.save_pretrained(tmp_path / "trained")
    reloaded = PeftModel.from_pretrained(WhisperForCausalLM.from_pretrained(tmp_path / "base"), tmp_path / "trained")
    with torch.no_grad():
        assert (reloaded.eval()(input_ids=IDS).logits - got).abs().max().item() <= TOLERANCE


def test_mla_tp_plan_gives_the_merged_linear_the_mla_style(built):
    """q_a_proj has no rule (replicated) and kv_a_proj_with_mqa is `mla_kv_a_proj` (replicated, the gradient of
    the last qk_rope_head_dim output columns all-reduced): the merged linear, whose last columns are the same, gets
    that style; the plain kv_a_proj_with_mqa of q_lora_rank=None configs keeps its own rule."""
    from fusegen.compiler.mappings import fused_plan_from

    plan = built["deepseek_v2"].TP_PLAN
    assert plan["layers.*.self_attn.fused_qkv_a_proj"] == "mla_kv_a_proj"
    assert plan["layers.*.self_attn.kv_a_proj_with_mqa"] == "mla_kv_a_proj"
    stacked = {"fused_qkv_a_proj": [("q_a_proj", 0), ("kv_a_proj_with_mqa", 1)]}
    reordered = {"fused_qkv_a_proj": [("kv_a_proj_with_mqa", 0), ("q_a_proj", 1)]}  # rope columns no longer last
    original = DeepseekV2Config.base_model_tp_plan
    assert fused_plan_from(original, reordered, {"fused_qkv_a_proj": ["self_attn"]})[0] is None
    derived, _ = fused_plan_from(original, stacked, {"fused_qkv_a_proj": ["self_attn"]})
    assert "layers.*.self_attn.kv_a_proj_with_mqa" not in derived  # kept only where a config keeps the module
