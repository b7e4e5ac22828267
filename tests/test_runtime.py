"""Tests for fusegen.runtime: MergedColumnLinear and the stacked-checkpoint converters.

Generated fused files do not exist yet, so `_make_fused` below hand-builds the same shape of model the compiler will
emit (qkv_proj / gate_up_proj as MergedColumnLinear, forward via `.split(output_sizes)`), by subclassing the stock
classes. Everything is tiny, fp32, CPU and offline.
"""

from __future__ import annotations

import ast
import json
import logging
import os
import pathlib
import sys

import pytest
import torch
from safetensors import safe_open
from torch import nn
from transformers import LlamaConfig, LlamaForCausalLM, LlamaModel, Qwen2Config, Qwen2ForCausalLM
from transformers.conversion_mapping import get_model_conversion_mapping
from transformers.models.llama import modeling_llama
from transformers.models.qwen2 import modeling_qwen2

import fusegen.runtime
from fusegen.runtime import (
    MergedColumnConcatenate,
    MergedColumnLinear,
    build_stacked_converters,
    register_stacked_checkpoint,
)
from fusegen.testkit import TOLERANCE, logits, random_model

# --------------------------------------------------------------------------------------------------------------------
# A hand-written fused model, shaped like the compiler's output
# --------------------------------------------------------------------------------------------------------------------

STACKED_PARAMS_MAPPING = {
    "qkv_proj": [("q_proj", "q"), ("k_proj", "k"), ("v_proj", "v")],
    "gate_up_proj": [("gate_proj", 0), ("up_proj", 1)],
}
PARENTS = {"qkv_proj": ["self_attn"], "gate_up_proj": ["mlp"]}


def _make_fused(prefix, modeling, attn_cls, mlp_cls, model_cls, causal_cls):
    """Return (FusedXModel, FusedXForCausalLM) built from the stock classes with q/k/v and gate/up merged."""

    class FusedAttention(attn_cls):
        def __init__(self, config, layer_idx):
            super().__init__(config, layer_idx)
            bias = self.q_proj.bias is not None
            del self.q_proj, self.k_proj, self.v_proj
            q, kv = config.num_attention_heads * self.head_dim, config.num_key_value_heads * self.head_dim
            self.qkv_proj = MergedColumnLinear(config.hidden_size, [q, kv, kv], bias=bias)

        def forward(self, hidden_states, position_embeddings, attention_mask=None, cache=None, **kwargs):
            shape = (*hidden_states.shape[:-1], -1, self.head_dim)
            q, k, v = (
                t.view(shape).transpose(1, 2)
                for t in self.qkv_proj(hidden_states).split(self.qkv_proj.output_sizes, dim=-1)
            )
            q, k = modeling.apply_rotary_pos_emb(q, k, *position_embeddings)
            if cache is not None:
                k, v = cache.update(k, v, self.layer_idx, kwargs=kwargs)
            attention = modeling.ALL_ATTENTION_FUNCTIONS.get_interface(
                self.config._attn_implementation, modeling.eager_attention_forward
            )
            kwargs.setdefault("sliding_window", getattr(self, "sliding_window", None))
            out, weights = attention(self, q, k, v, attention_mask, dropout=0.0, scaling=self.scaling, **kwargs)
            return self.o_proj(out.reshape(*hidden_states.shape[:-1], -1).contiguous()), weights

    class FusedMLP(mlp_cls):
        def __init__(self, config):
            super().__init__(config)
            bias = self.gate_proj.bias is not None
            del self.gate_proj, self.up_proj
            sizes = [config.intermediate_size, config.intermediate_size]
            self.gate_up_proj = MergedColumnLinear(config.hidden_size, sizes, bias=bias)

        def forward(self, x):
            gate, up = self.gate_up_proj(x).split(self.gate_up_proj.output_sizes, dim=-1)
            return self.down_proj(self.act_fn(gate) * up)

    class FusedModel(model_cls):
        def __init__(self, config):
            super().__init__(config)
            for idx, layer in enumerate(self.layers):
                layer.self_attn, layer.mlp = FusedAttention(config, idx), FusedMLP(config)
            self.post_init()

    class FusedForCausalLM(causal_cls):
        def __init__(self, config):
            super().__init__(config)
            self.model = FusedModel(config)
            self.post_init()

    for cls, name in ((FusedModel, f"Fused{prefix}Model"), (FusedForCausalLM, f"Fused{prefix}ForCausalLM")):
        cls.__name__ = cls.__qualname__ = name
        # Transformers decides "can set the experts implementation" from the source of the class's module; these
        # classes stand in for generated ones, which answer as the original module does, not as this test file would.
        cls.__module__ = modeling.__name__
    return FusedModel, FusedForCausalLM


FusedLlamaModel, FusedLlamaForCausalLM = _make_fused(
    "Llama", modeling_llama, modeling_llama.LlamaAttention, modeling_llama.LlamaMLP, LlamaModel, LlamaForCausalLM
)
FusedQwen2Model, FusedQwen2ForCausalLM = _make_fused(
    "Qwen2",
    modeling_qwen2,
    modeling_qwen2.Qwen2Attention,
    modeling_qwen2.Qwen2MLP,
    modeling_qwen2.Qwen2Model,
    Qwen2ForCausalLM,
)
register_stacked_checkpoint(["FusedLlamaModel", "FusedQwen2Model"], STACKED_PARAMS_MAPPING, parents=PARENTS)


# --------------------------------------------------------------------------------------------------------------------
# Helpers
# --------------------------------------------------------------------------------------------------------------------

HEADS = {"mha": 4, "gqa": 2, "mqa": 1}


def _config(kind="gqa", tied=False, cls=LlamaConfig, **overrides):
    kwargs = {
        "vocab_size": 100,
        "hidden_size": 32,
        "intermediate_size": 64,
        "num_hidden_layers": 2,
        "num_attention_heads": 4,
        "num_key_value_heads": HEADS[kind],
        "max_position_embeddings": 64,
        "tie_word_embeddings": tied,
        "pad_token_id": 0,
    }
    kwargs.update(overrides)
    return cls(**kwargs)


def _original(config, model_cls=LlamaForCausalLM):
    """A random original model (`fusegen.testkit.random_model`: biases drawn too, so bias handling is exercised)."""
    return random_model(model_cls, config)


def _save(model, path, **kwargs):
    model.save_pretrained(path, **kwargs)
    return str(path)


class _TransformersWarnings(logging.Handler):
    """Collect WARNING+ records of the `transformers` logger, where load reports (missing/unexpected keys) go."""

    def __init__(self):
        super().__init__(level=logging.WARNING)
        self.records = []

    def emit(self, record):
        self.records.append(record.getMessage())

    def __enter__(self):
        logging.getLogger("transformers").addHandler(self)
        return self.records

    def __exit__(self, *exc):
        logging.getLogger("transformers").removeHandler(self)


def _load(cls, path, **kwargs):
    """Load and assert Transformers reported nothing missing/unexpected/mismatched and logged no warning."""
    with _TransformersWarnings() as warnings:
        model, info = cls.from_pretrained(path, output_loading_info=True, **kwargs)
    assert {k: v for k, v in info.items() if v} == {}, info
    assert warnings == []
    return model.eval()


def _saved_tensors(path):
    """Every tensor in a saved checkpoint dir (single-file or sharded), by name."""
    tensors = {}
    for file in sorted(os.listdir(path)):
        if file.endswith(".safetensors"):
            with safe_open(os.path.join(path, file), framework="pt") as f:
                tensors.update({k: f.get_tensor(k) for k in f.keys()})  # noqa: SIM118 (safe_open is not iterable)
    return tensors


def _assert_same_state(a, b):
    sa, sb = a.state_dict(), b.state_dict()
    assert sa.keys() == sb.keys()
    for key in sa:
        assert torch.equal(sa[key], sb[key]), key


IDS = torch.tensor([[1, 5, 9, 42, 7, 3, 99, 12], [4, 4, 8, 15, 16, 23, 42, 0]])


# --------------------------------------------------------------------------------------------------------------------
# MergedColumnLinear
# --------------------------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("bias", [True, False])
def test_merged_linear_equals_separate_linears(bias):
    torch.manual_seed(0)
    parts = [nn.Linear(32, n, bias=bias) for n in (32, 8, 8)]
    merged = MergedColumnLinear(32, [32, 8, 8], bias=bias)
    with torch.no_grad():
        merged.weight.copy_(torch.cat([p.weight for p in parts]))
        if bias:
            merged.bias.copy_(torch.cat([p.bias for p in parts]))
    x = torch.randn(3, 5, 32)
    outs = merged(x).split(merged.output_sizes, dim=-1)
    for out, part in zip(outs, parts):
        torch.testing.assert_close(out, part(x), rtol=0, atol=1e-6)
    assert torch.equal(merged(x), nn.functional.linear(x, merged.weight, merged.bias))


def test_merged_linear_attributes_and_meta():
    sizes = (torch.tensor(8), 4, 4)  # int-likes (0-d tensors, numpy ints) are normalised to plain ints
    with torch.device("meta"):
        layer = MergedColumnLinear(16, sizes, bias=False, dtype=torch.bfloat16)
    assert isinstance(layer, nn.Linear)
    assert layer.output_sizes == [8, 4, 4] and all(type(s) is int for s in layer.output_sizes)
    assert layer.weight.shape == (16, 16) and layer.weight.is_meta and layer.weight.dtype == torch.bfloat16
    assert layer.bias is None
    assert "output_sizes=[8, 4, 4]" in repr(layer)


@pytest.mark.parametrize("bad", [[], [4, 0], [4.0, 2], "abc", 7])
def test_merged_linear_rejects_bad_sizes(bad):
    with pytest.raises((TypeError, ValueError)):
        MergedColumnLinear(8, bad)


def test_fresh_fused_model_is_initialised_by_transformers():
    """`_init_weights` treats the merged layer as an nn.Linear: normal(std=initializer_range), zero bias."""
    config = _config("gqa", initializer_range=0.02, attention_bias=True)
    model = FusedLlamaForCausalLM(config)
    qkv = model.model.layers[0].self_attn.qkv_proj
    assert abs(qkv.weight.std().item() - 0.02) < 0.005
    assert torch.count_nonzero(qkv.bias) == 0


# --------------------------------------------------------------------------------------------------------------------
# Loading canonical checkpoints into fused models
# --------------------------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("tied", [False, True], ids=["untied", "tied"])
@pytest.mark.parametrize("kind", ["mha", "gqa", "mqa"])
def test_load_original_checkpoint(tmp_path, kind, tied):
    original = _original(_config(kind, tied=tied))
    fused = _load(FusedLlamaForCausalLM, _save(original, tmp_path))

    for orig_layer, fused_layer in zip(original.model.layers, fused.model.layers):
        attn, mlp = orig_layer.self_attn, orig_layer.mlp
        expected_qkv = torch.cat([attn.q_proj.weight, attn.k_proj.weight, attn.v_proj.weight])
        assert torch.equal(fused_layer.self_attn.qkv_proj.weight, expected_qkv)
        assert torch.equal(fused_layer.mlp.gate_up_proj.weight, torch.cat([mlp.gate_proj.weight, mlp.up_proj.weight]))
    assert (fused.lm_head.weight is fused.model.embed_tokens.weight) == tied
    assert torch.equal(fused.lm_head.weight, original.lm_head.weight)
    torch.testing.assert_close(logits(fused, IDS), logits(original, IDS), rtol=0, atol=TOLERANCE)


def test_load_sharded_checkpoint(tmp_path):
    original = _original(_config("gqa"))
    path = _save(original, tmp_path, max_shard_size="20KB")
    weight_map = json.loads((tmp_path / "model.safetensors.index.json").read_text())["weight_map"]
    # Make sure the test really has the pieces of one merged linear spread over several files.
    assert len(set(weight_map.values())) > 2
    assert len({weight_map[f"model.layers.0.self_attn.{p}.weight"] for p in ("q_proj", "k_proj", "v_proj")}) > 1

    fused = _load(FusedLlamaForCausalLM, path)
    torch.testing.assert_close(logits(fused, IDS), logits(original, IDS), rtol=0, atol=TOLERANCE)


def test_load_honours_dtype(tmp_path):
    original = _original(_config("gqa"))
    fused = _load(FusedLlamaForCausalLM, _save(original, tmp_path), dtype=torch.bfloat16)
    attn = original.model.layers[1].self_attn
    qkv = fused.model.layers[1].self_attn.qkv_proj.weight
    assert qkv.dtype == torch.bfloat16
    assert torch.equal(qkv, torch.cat([attn.q_proj.weight, attn.k_proj.weight, attn.v_proj.weight]).bfloat16())


def test_load_base_model_from_causal_lm_checkpoint(tmp_path):
    """FusedLlamaModel alone (no head) on a ForCausalLM checkpoint: the `model.` prefix is stripped around our converter."""
    original = _original(_config("gqa"))
    path = _save(original, tmp_path)
    with _TransformersWarnings() as warnings:
        fused, info = FusedLlamaModel.from_pretrained(path, output_loading_info=True)
    # Only the head is left over, exactly as for the stock LlamaModel (this also proves the warning capture works).
    assert info["unexpected_keys"] == {"lm_head.weight"} and not info["missing_keys"] and not info["mismatched_keys"]
    assert len(warnings) == 1 and "lm_head.weight" in warnings[0] and "UNEXPECTED" in warnings[0]
    with torch.no_grad():
        expected = original.model(input_ids=IDS).last_hidden_state
        torch.testing.assert_close(fused.eval()(input_ids=IDS).last_hidden_state, expected, rtol=0, atol=TOLERANCE)


def test_qwen2_biases(tmp_path):
    config = _config("gqa", cls=Qwen2Config)
    original = _original(config, Qwen2ForCausalLM)
    fused = _load(FusedQwen2ForCausalLM, _save(original, tmp_path / "orig"))
    attn = original.model.layers[0].self_attn
    expected = torch.cat([attn.q_proj.bias, attn.k_proj.bias, attn.v_proj.bias])
    assert torch.equal(fused.model.layers[0].self_attn.qkv_proj.bias, expected)
    torch.testing.assert_close(logits(fused, IDS), logits(original, IDS), rtol=0, atol=TOLERANCE)

    reloaded = _load(Qwen2ForCausalLM, _save(fused, tmp_path / "fused"))
    _assert_same_state(reloaded, original)


def test_missing_piece_fails_loudly(tmp_path):
    """Without v_proj, q+k would still concatenate; the size check turns that into a conversion error, not a bad load."""
    from safetensors.torch import load_file, save_file

    path = _save(_original(_config("gqa")), tmp_path)
    file = os.path.join(path, "model.safetensors")
    tensors = load_file(file)
    del tensors["model.layers.0.self_attn.v_proj.weight"]
    save_file(tensors, file, metadata={"format": "pt"})
    with pytest.raises(RuntimeError, match="conversion"):
        FusedLlamaForCausalLM.from_pretrained(path)


def test_fused_layout_checkpoint_stays_fused(tmp_path):
    """`save_original_format=False` writes qkv_proj as-is; loading that back uses no converter, so Transformers records
    none and a later save keeps the fused layout (it re-saves in the format it loaded)."""
    torch.manual_seed(0)
    fused = FusedLlamaForCausalLM(_config("gqa")).eval()
    path = _save(fused, tmp_path / "a", save_original_format=False)
    assert "model.layers.0.self_attn.qkv_proj.weight" in _saved_tensors(path)
    reloaded = _load(FusedLlamaForCausalLM, path)
    _assert_same_state(reloaded, fused)
    assert "model.layers.0.self_attn.qkv_proj.weight" in _saved_tensors(_save(reloaded, tmp_path / "b"))


# --------------------------------------------------------------------------------------------------------------------
# Saving fused models back to the canonical layout
# --------------------------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("tied", [False, True], ids=["untied", "tied"])
@pytest.mark.parametrize("kind", ["mha", "gqa", "mqa"])
def test_round_trip_is_bit_identical(tmp_path, kind, tied):
    original = _original(_config(kind, tied=tied))
    original_dir = _save(original, tmp_path / "orig")
    fused = _load(FusedLlamaForCausalLM, original_dir)
    fused_dir = _save(fused, tmp_path / "fused")

    written = _saved_tensors(fused_dir)
    canonical = _saved_tensors(original_dir)
    assert written.keys() == canonical.keys()
    for key in canonical:
        assert torch.equal(written[key], canonical[key]), key
    _assert_same_state(_load(LlamaForCausalLM, fused_dir), original)


@pytest.mark.parametrize("kind", ["gqa", "mqa"])
def test_save_fresh_fused_model(tmp_path, kind):
    """A fused model never loaded from disk has no recorded conversions; the registered mapping is used instead."""
    torch.manual_seed(0)
    fused = FusedLlamaForCausalLM(_config(kind)).eval()
    path = _save(fused, tmp_path, max_shard_size="20KB")
    assert os.path.exists(os.path.join(path, "model.safetensors.index.json"))

    original = _load(LlamaForCausalLM, path)
    attn, qkv = original.model.layers[0].self_attn, fused.model.layers[0].self_attn.qkv_proj
    q, k, v = qkv.weight.split(qkv.output_sizes)
    assert (
        torch.equal(attn.q_proj.weight, q)
        and torch.equal(attn.k_proj.weight, k)
        and torch.equal(attn.v_proj.weight, v)
    )
    torch.testing.assert_close(logits(original, IDS), logits(fused, IDS), rtol=0, atol=TOLERANCE)

    # ...and the fused class reads its own output back.
    _assert_same_state(_load(FusedLlamaForCausalLM, path), fused)


# --------------------------------------------------------------------------------------------------------------------
# Registration
# --------------------------------------------------------------------------------------------------------------------


def _our_converters(model):
    return [
        t
        for t in get_model_conversion_mapping(model, add_legacy=False)
        # By name, not isinstance: test_re_registering_and_reloading swaps the class objects.
        if any(type(op).__name__ == MergedColumnConcatenate.__name__ for op in getattr(t, "operations", []))
    ]


def test_registration_is_scoped_to_fused_classes():
    config = _config("gqa")
    assert _our_converters(LlamaForCausalLM(config)) == []
    assert _our_converters(LlamaModel(config)) == []
    assert _our_converters(Qwen2ForCausalLM(_config("gqa", cls=Qwen2Config))) == []
    # Root ForCausalLM is skipped (custom code, not registered); the base model contributes one copy, scoped.
    converters = _our_converters(FusedLlamaForCausalLM(config))
    assert len(converters) == 2 and {c.scope_prefix for c in converters} == {""}
    assert len(_our_converters(FusedLlamaModel(config))) == 2


@pytest.mark.parametrize("name", ["llama", "LlamaModel", "LlamaForCausalLM", "not an identifier"])
def test_refuses_to_register_transformers_names(name):
    with pytest.raises(ValueError):
        register_stacked_checkpoint([name], STACKED_PARAMS_MAPPING, parents=PARENTS)


@pytest.mark.parametrize(
    "stacked, parents",
    [
        ({"qkv_proj": []}, None),
        ({"qkv_proj": ["q_proj", "q_proj"]}, None),
        ({"qkv_proj": ["q_proj", "k.*"]}, None),
        (STACKED_PARAMS_MAPPING, {"gate_proj": ["mlp"]}),
    ],
)
def test_rejects_bad_mappings(stacked, parents):
    with pytest.raises(ValueError):
        build_stacked_converters(stacked, parents)


def test_re_registering_and_reloading(tmp_path, reload_module):
    """Generated modules register at import time, so re-import / reload must be harmless."""
    register_stacked_checkpoint("FusedLlamaModel", STACKED_PARAMS_MAPPING, parents=PARENTS)
    reload_module("fusegen.runtime.checkpoint")
    reload_module("fusegen.runtime")
    fusegen.runtime.register_stacked_checkpoint(["FusedLlamaModel"], STACKED_PARAMS_MAPPING, parents=PARENTS)
    # A model built with the pre-reload MergedColumnLinear class still round-trips through the new converters.
    original = _original(_config("gqa"))
    fused = _load(FusedLlamaForCausalLM, _save(original, tmp_path / "orig"))
    _assert_same_state(_load(LlamaForCausalLM, _save(fused, tmp_path / "fused")), original)


def test_registering_head_class_too_is_harmless(tmp_path):
    """Both class names registered: the child gets a scoped copy too, but at most one converter fires per key."""
    _, FusedHeadForCausalLM = _make_fused(
        "Head", modeling_llama, modeling_llama.LlamaAttention, modeling_llama.LlamaMLP, LlamaModel, LlamaForCausalLM
    )
    register_stacked_checkpoint(["FusedHeadModel", "FusedHeadForCausalLM"], STACKED_PARAMS_MAPPING, parents=PARENTS)
    original = _original(_config("gqa"))
    fused = _load(FusedHeadForCausalLM, _save(original, tmp_path / "orig"))
    torch.testing.assert_close(logits(fused, IDS), logits(original, IDS), rtol=0, atol=TOLERANCE)
    _assert_same_state(_load(LlamaForCausalLM, _save(fused, tmp_path / "fused")), original)


def test_runtime_imports_only_torch_and_transformers():
    """Generated files import fusegen.runtime at model-load time; it must not drag in the compiler's dependencies.

    Checked on the source (not sys.modules): `import transformers` itself already imports jinja2. PEFT support
    (peft.py) imports PEFT inside its functions only (tests/test_ecosystem.py checks that importing a generated file
    does not import it).
    """
    allowed = {"torch", "transformers", "safetensors", "__future__"} | set(sys.stdlib_module_names)
    optional = {
        "peft.py": {"peft"},  # inside its functions, run only on a PEFT model
        "format_composers.py": {"compressed_tensors"},  # inside the composer of pieces compressed-tensors built
        "vllm.py": {"vllm"},  # the vLLM plugin: imported by vLLM's plugin loader only, never by a generated file
    }
    for file in pathlib.Path(fusegen.runtime.__file__).parent.glob("*.py"):
        allowed_here = allowed | optional.get(file.name, set())
        for node in ast.walk(ast.parse(file.read_text())):
            if isinstance(node, ast.Import):
                roots = {alias.name.split(".")[0] for alias in node.names}
            elif isinstance(node, ast.ImportFrom) and node.level == 0:
                roots = {node.module.split(".")[0]}
            else:
                continue
            assert roots <= allowed_here, (file.name, roots)


# --------------------------------------------------------------------------------------------------------------------
# FusedPreTrainedMixin: the methods every generated pretrained base inherits
# --------------------------------------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def built(tmp_path_factory):
    """llama and mixtral built against the installed Transformers: the checked-in files are for the pinned one, and
    this file also runs in CI's second venv (docs/ecosystem.md)."""
    from fusegen.compiler.build import build
    from fusegen.tools.convert import import_fused_module

    out = tmp_path_factory.mktemp("built")
    modules = {}
    for model_type in ("llama", "mixtral"):
        (out / f"fused_{model_type}.py").write_text(build(model_type).text)
        modules[model_type] = import_fused_module(out, model_type)
    return modules


def test_copies_of_transformers_code_declare_themselves_library_code(built):
    FusedLlamaForCausalLM, FusedLlamaModel = built["llama"].FusedLlamaForCausalLM, built["llama"].FusedLlamaModel

    class Mine(FusedLlamaForCausalLM):  # a user's subclass, in a module that is no generated file
        pass

    assert LlamaForCausalLM.is_custom_code() is False
    assert FusedLlamaForCausalLM.is_custom_code() is False
    assert FusedLlamaModel.is_custom_code() is False
    assert Mine.is_custom_code() is False


def test_copy_of_user_code_stays_custom_code(monkeypatch):
    from transformers import PreTrainedModel

    from fusegen.runtime import FusedPreTrainedMixin
    from fusegen.runtime.version import StaleGeneratedFileWarning, check_source

    monkeypatch.setenv("FUSEGEN_ALLOW_STALE", "1")
    with pytest.warns(StaleGeneratedFileWarning):
        check_source("my_models.modeling_x", "0" * 64, built_with="5.24.0", target="x", generated=__name__)

    class FusedXPreTrainedModel(FusedPreTrainedMixin, PreTrainedModel):
        pass

    assert FusedXPreTrainedModel.is_custom_code() is True


def test_experts_implementation_is_answered_as_for_the_original(built):
    from transformers import MixtralForCausalLM

    FusedLlamaForCausalLM = built["llama"].FusedLlamaForCausalLM
    FusedMixtralForCausalLM, FusedMixtralModel = (
        built["mixtral"].FusedMixtralForCausalLM,
        built["mixtral"].FusedMixtralModel,
    )

    # Transformers searches the class's module source for its experts decorator; the generated file lacks it.
    assert (
        "@use_experts_implementation"
        not in pathlib.Path(sys.modules[FusedMixtralModel.__module__].__file__).read_text()
    )
    assert MixtralForCausalLM._can_set_experts_implementation() is True
    assert FusedMixtralForCausalLM._can_set_experts_implementation() is True
    assert FusedMixtralModel._can_set_experts_implementation() is True
    assert (
        FusedLlamaForCausalLM._can_set_experts_implementation() is LlamaForCausalLM._can_set_experts_implementation()
    )


class _RowsDoubled(torch.Tensor):
    """An input whose `F.linear` doubles the output of any weight with 8 rows."""

    @classmethod
    def __torch_function__(cls, func, types, args=(), kwargs=None):
        out = super().__torch_function__(func, types, args, kwargs or {})
        if func is torch.nn.functional.linear and args[1].shape[0] == 8:
            return out * 2
        return out


def test_merged_linear_hands_an_overriding_input_each_piece_as_its_projection_did():
    torch.manual_seed(0)
    merged = MergedColumnLinear(16, [16, 8, 8], bias=[True, False, True])
    pieces = [nn.Linear(16, n, bias=b) for n, b in ((16, True), (8, False), (8, True))]
    with torch.no_grad():
        for piece, weight in zip(pieces, merged.weight.split([16, 8, 8])):
            piece.weight.copy_(weight)
        pieces[0].bias.copy_(merged.bias[:16])
        pieces[2].bias.copy_(merged.bias[24:])
    x = torch.randn(2, 3, 16)
    plain = merged(x)
    assert type(plain) is torch.Tensor
    expected = torch.cat([piece(x.as_subclass(_RowsDoubled)) for piece in pieces], dim=-1)
    actual = merged(x.as_subclass(_RowsDoubled))
    assert torch.allclose(actual, expected, atol=1e-6, rtol=0)
    assert not torch.allclose(actual[..., 16:], plain[..., 16:])  # k and v doubled, as the subclass wants
