"""Gemma 4's q_proj joins k_proj and v_proj (built in a nested block): `qkv_proj` where the layer builds all three,
q_proj (and k_proj) on their own elsewhere; `fusegen/fusions/merged/rewrite_nested.py`.

- Equivalence: the checked-in fused class against the original, saved and loaded both ways, logits and every
  gradient, under config variants (kv sharing, attention_k_eq_v, attention_bias, per-layer head_dim and kv heads,
  use_double_wide_mlp).
- Loading: fusegen's own loader/saver round-trip the canonical checkpoint; a missing tensor raises naming it.
- Soundness: each rule of the nested rewrite refuses a mutated Gemma 4 source, and the same source is rewritten
  when that rule is switched off (so each test fails without its check).
"""

from __future__ import annotations

import ast
import inspect
import textwrap

import pytest
import torch
from safetensors.torch import load_file, save_file
from torch import nn
from transformers import Gemma4ForCausalLM, Gemma4TextConfig
from transformers.models.gemma4 import modeling_gemma4

from fusegen.core.plan import FusionPlan, Refused
from fusegen.fusions.merged import rewrite_nested, rules
from fusegen.runtime import CheckpointError, MergedColumnLinear, load_checkpoint, save_checkpoint
from fusegen.testkit import TOLERANCE, random_model
from generated import fused_gemma4_text
from tests.test_conditional_fusion import GEMMA4, IDS, round_trip

LAYERS = ["sliding_attention", "full_attention", "sliding_attention", "full_attention"]
MAPPING = fused_gemma4_text.STACKED_PARAMS_MAPPING
PLAN = FusionPlan("qkv", "qkv_proj", (("q_proj", "q"), ("k_proj", "k"), ("v_proj", "v")))


def gemma4_config(**overrides):
    values = {**GEMMA4, "num_hidden_layers": len(LAYERS), "layer_types": list(LAYERS), **overrides}
    return Gemma4TextConfig(**values)


def assert_layout(model: nn.Module) -> None:
    """Each layer holds exactly what the original builds there, merged where it can be."""
    for layer in model.model.layers:
        attention = layer.self_attn
        has_v = not attention.is_kv_shared_layer and not attention.use_alternative_attention
        assert isinstance(attention.qkv_proj, MergedColumnLinear) == has_v
        assert (type(attention.q_proj) is nn.Linear) == (not has_v)
        assert not hasattr(attention, "v_proj")
        if attention.is_kv_shared_layer:
            assert not hasattr(attention, "k_proj")
        else:
            assert (type(attention.k_proj) is nn.Linear) == attention.use_alternative_attention


VARIANTS = {
    "plain": {},
    "k_eq_v": {"attention_k_eq_v": True},
    "shared": {"num_kv_shared_layers": 2},
    "shared_k_eq_v": {"num_kv_shared_layers": 2, "attention_k_eq_v": True},
    "bias": {"attention_bias": True, "num_kv_shared_layers": 2},
    "global_heads": {"attention_k_eq_v": True, "num_global_key_value_heads": 1, "global_head_dim": 32},
    "global_head_dim": {"global_head_dim": 32, "num_key_value_heads": 1},
    "double_wide_mlp": {"use_double_wide_mlp": True, "num_kv_shared_layers": 2},
}


@pytest.mark.parametrize("variant", sorted(VARIANTS))
def test_fused_gemma4_matches_the_original(tmp_path, variant):
    config = gemma4_config(**VARIANTS[variant])
    _, fused = round_trip(Gemma4ForCausalLM, fused_gemma4_text.FusedGemma4ForCausalLM, config, tmp_path, MAPPING)
    assert_layout(fused)
    layers = [layer.self_attn for layer in fused.model.layers]
    assert any(isinstance(a.qkv_proj, MergedColumnLinear) for a in layers)
    if "num_kv_shared_layers" in VARIANTS[variant]:
        assert [a.is_kv_shared_layer for a in layers] == [False, False, True, True]
    if VARIANTS[variant].get("attention_k_eq_v"):
        assert any(type(a.k_proj) is nn.Linear for a in layers if not a.is_kv_shared_layer)


def test_mapping_and_tp_plan():
    """One merged name for q/k/v; the TP plan keeps the rules of the projections some layers build alone, and gives
    the owner no local-heads rule (it would look for a merged q/k/v in layers that have none)."""
    assert MAPPING["qkv_proj"] == [("q_proj", "q"), ("k_proj", "k"), ("v_proj", "v")]
    plan = fused_gemma4_text.TP_PLAN
    assert plan["layers.*.self_attn.qkv_proj"] == "fusegen_merged_colwise"
    assert plan["layers.*.self_attn.q_proj"] == "colwise" and plan["layers.*.self_attn.k_proj"] == "colwise"
    assert "layers.*.self_attn" not in plan and "layers.*.self_attn.v_proj" not in plan


def test_fusegen_loader_round_trips_and_names_missing_tensors(tmp_path):
    """`load_checkpoint`/`save_checkpoint`: the canonical file loads (strict) into qkv_proj slices and plain
    q_proj/k_proj, the fused save has exactly the canonical names and values, and a missing piece, in a merged
    layer or in a plain one, raises naming it; `from_pretrained` refuses an unfilled merged linear and reports a
    missing plain one as the original class does."""
    config = gemma4_config(num_kv_shared_layers=1, attention_k_eq_v=True)
    original = random_model(Gemma4ForCausalLM, config)
    original.save_pretrained(tmp_path / "original")
    fused = fused_gemma4_text.FusedGemma4ForCausalLM(config)
    load_checkpoint(fused, tmp_path / "original")
    with torch.no_grad():
        assert (original.eval()(IDS).logits - fused.eval()(IDS).logits).abs().max().item() <= TOLERANCE
    save_checkpoint(fused, tmp_path / "saved")
    want, got = (
        load_file(tmp_path / "original" / "model.safetensors"),
        load_file(tmp_path / "saved" / "model.safetensors"),
    )
    assert want.keys() == got.keys() and all(torch.equal(want[k], got[k]) for k in want)
    kinds = [a.self_attn for a in fused.model.layers]
    assert isinstance(kinds[0].qkv_proj, MergedColumnLinear) and type(kinds[1].k_proj) is nn.Linear
    assert kinds[3].is_kv_shared_layer and type(kinds[3].q_proj) is nn.Linear
    for missing in (
        "model.layers.0.self_attn.v_proj.weight",  # a piece of qkv_proj
        "model.layers.1.self_attn.k_proj.weight",  # k_eq_v layer: plain k_proj
        "model.layers.3.self_attn.q_proj.weight",  # kv-shared layer: plain q_proj
    ):
        broken = tmp_path / missing
        broken.mkdir()
        original.config.save_pretrained(broken)
        save_file(
            {k: v for k, v in want.items() if k != missing}, broken / "model.safetensors", metadata={"format": "pt"}
        )
        with pytest.raises(CheckpointError, match=missing.replace(".", r"\.")):
            load_checkpoint(fused_gemma4_text.FusedGemma4ForCausalLM(config), broken)
        if missing.endswith("v_proj.weight"):  # a merged linear left unfilled: from_pretrained refuses it
            with pytest.raises(CheckpointError, match=r"model\.layers\.0\.self_attn"):
                fused_gemma4_text.FusedGemma4ForCausalLM.from_pretrained(broken)
        else:  # a plain linear: reported missing, exactly as the original class reports it
            _, info = fused_gemma4_text.FusedGemma4ForCausalLM.from_pretrained(broken, output_loading_info=True)
            _, want_info = Gemma4ForCausalLM.from_pretrained(broken, output_loading_info=True)
            assert info["missing_keys"] == want_info["missing_keys"] == {missing}


def test_lora_on_q_k_v_matches_in_every_layer_kind(tmp_path):
    """A canonical LoRA adapter on q/k/v loads onto qkv_proj, and onto the plain q_proj/k_proj of the other layers:
    the fused model's outputs are the original's, so no layer is left unadapted."""
    from peft import LoraConfig, PeftModel, get_peft_model

    config = gemma4_config(num_kv_shared_layers=1, attention_k_eq_v=True)
    original = random_model(Gemma4ForCausalLM, config)
    original.save_pretrained(tmp_path / "base")
    adapted = get_peft_model(
        Gemma4ForCausalLM.from_pretrained(tmp_path / "base"),
        LoraConfig(r=4, target_modules=["q_proj", "k_proj", "v_proj"]),
    )
    torch.manual_seed(5)
    with torch.no_grad():
        for name, parameter in adapted.named_parameters():
            if "lora_" in name:
                parameter.normal_(0, 0.3)
    adapted.save_pretrained(tmp_path / "adapter")
    with torch.no_grad():
        want = adapted.eval()(input_ids=IDS).logits
        base = original.eval()(input_ids=IDS).logits
        fused = PeftModel.from_pretrained(
            fused_gemma4_text.FusedGemma4ForCausalLM.from_pretrained(tmp_path / "base"), tmp_path / "adapter"
        )
        got = fused.eval()(input_ids=IDS).logits
    assert (want - base).abs().max().item() > 1e-3  # the adapter changes the outputs
    assert (want - got).abs().max().item() <= TOLERANCE


# --------------------------------------------------------------------------------------------------------------------
# The soundness rules, on mutations of Gemma 4's own source
# --------------------------------------------------------------------------------------------------------------------

SOURCE = textwrap.dedent(inspect.getsource(modeling_gemma4.Gemma4TextAttention))
NAMESPACE = vars(modeling_gemma4)


def method(source: str, name: str) -> ast.FunctionDef:
    classdef = ast.parse(source).body[0]
    return next(stmt for stmt in classdef.body if isinstance(stmt, ast.FunctionDef) and stmt.name == name)


def mutated(anchor: str, insert: str = "", replace: str | None = None) -> str:
    """Gemma 4's attention source with `insert` put on its own line(s) before the line holding `anchor` (at that
    line's indentation), or `anchor` replaced by `replace`."""
    assert SOURCE.count(anchor) == 1, anchor
    if replace is not None:
        return SOURCE.replace(anchor, replace)
    head, _, tail = SOURCE.partition(anchor)
    line_start = head.rfind("\n") + 1
    indent = head[line_start:][: len(head[line_start:]) - len(head[line_start:].lstrip())]
    lines = "".join(f"{indent}{line}\n" for line in insert.splitlines())
    return head[:line_start] + lines + head[line_start:] + anchor + tail


def test_the_unmutated_source_is_rewritten():
    init = method(SOURCE, "__init__")
    built = rewrite_nested.rewrite_init_nested(init, PLAN, NAMESPACE)
    assert built.outer == ("q_proj",) and built.kept_inner == ("k_proj",) and built.guarded == ("v_proj",)


Q = "self.q_proj = nn.Linear("
K = "self.k_proj = nn.Linear("
IF = "if not self.is_kv_shared_layer:\n            self.k_norm"
INIT_MUTATIONS = {
    "attribute reassigned": (K, "self.head_dim = 2 * self.head_dim", None),
    "name rebound": (IF, "layer_config = config.per_layer_config[0]", None),
    "read object's attribute written": (IF, "config.hidden_size = 8", None),
    "read object's item written": (K, "self.__dict__['head_dim'] = 8", None),
    "method of a read object": (IF, "config.update({'hidden_size': 8})", None),
    "read object handed to a call": (IF, "print(layer_config)", None),
    "method of the module's base class": (IF, "super().register_buffer('head_dim', None)", None),
    "impure hoisted size": (
        "layer_config.num_key_value_heads * self.head_dim, bias=config.attention_bias\n            )\n            self.v",
        "",
        "self.kv_width(), bias=config.attention_bias\n            )\n            self.v",
    ),
}


@pytest.mark.parametrize("case", sorted(INIT_MUTATIONS))
def test_init_mutations_are_refused_by_the_hoist_check(monkeypatch, case):
    anchor, insert, replace = INIT_MUTATIONS[case]
    source = mutated(anchor, insert, replace)
    with pytest.raises(Refused) as refused:
        rewrite_nested.rewrite_init_nested(method(source, "__init__"), PLAN, NAMESPACE)
    assert refused.value.rule == "constructor-inputs-change", refused.value
    monkeypatch.setattr(rewrite_nested, "check_hoisted_init", lambda *args: None)
    rewrite_nested.rewrite_init_nested(method(source, "__init__"), PLAN, NAMESPACE)  # only that check refused it


@pytest.mark.parametrize(
    "wrapper", ["for _ in range(1):", "with torch.no_grad():", "while self.is_kv_shared_layer is None:"]
)
def test_inner_block_reached_other_than_through_if_is_refused(wrapper):
    """Constructors run zero, one or many times in a loop, or after an exception in a `with`: not a condition."""
    head, _, tail = SOURCE.partition(IF)
    body, sep, rest = tail.partition("\n\n        self.o_proj")
    nested = "\n".join(
        ("    " + line) if line.strip() else line for line in ("            self.k_norm" + body).split("\n")
    )
    source = head + wrapper + "\n            " + IF.split("\n")[0] + "\n" + nested + sep + rest
    with pytest.raises(Refused) as refused:
        rewrite_nested.rewrite_init_nested(method(source, "__init__"), PLAN, NAMESPACE)
    assert refused.value.rule == "unusual-init"


def attention_module(config=None):
    config = config or gemma4_config()
    with torch.device("meta"):
        return modeling_gemma4.Gemma4TextAttention(config, 0)


def rewrite_forward(source: str):
    init = method(source, "__init__")
    built = rewrite_nested.rewrite_init_nested(init, PLAN, NAMESPACE)
    forward = method(source, "forward")
    rewrite_nested.rewrite_forward_nested(forward, PLAN, attention_module(), NAMESPACE, built)
    return forward


BEFORE_KV = "if self.is_kv_shared_layer:\n            key_states, value_states"
FORWARD_MUTATIONS = {
    "input rebound": (BEFORE_KV, "hidden_states = hidden_states * 2", "input-rebound"),
    "input written in place": (BEFORE_KV, "hidden_states.mul_(2)", "inplace-call"),
    "input written through a view": (BEFORE_KV, "hidden_states[..., 0] = 0", "input-written"),
}


@pytest.mark.parametrize("case", sorted(FORWARD_MUTATIONS))
def test_forward_mutations_between_q_and_kv_are_refused(monkeypatch, case):
    """Computing k/v at q's call is right only if their input is still the same value there."""
    anchor, insert, rule = FORWARD_MUTATIONS[case]
    source = mutated(anchor, insert)
    with pytest.raises(Refused) as refused:
        rewrite_forward(source)
    assert refused.value.rule == rule, refused.value
    monkeypatch.setattr(rules, "DISABLED", frozenset(rules.RULE_IDS))
    rewrite_forward(source)  # only the region rules refused it


def test_forward_input_spelled_differently_is_refused():
    source = mutated("self.k_proj(hidden_states)", replace="self.k_proj(hidden_states * 1)")
    with pytest.raises(Refused) as refused:
        rewrite_forward(source)
    assert refused.value.rule == "different-inputs"


def test_generated_class_reads_as_the_original():
    """One `if` on the conjunction of the conditions v_proj was built under: its branch builds the merged linear at
    q_proj's place, the other q_proj and k_proj as the original does, each in the original's order; the forward's
    merged call guarded by the merged linear's existence, and k/v taken from it or from k_proj in one `if`."""
    init = inspect.getsource(fused_gemma4_text.FusedGemma4TextAttention.__init__)
    tree = ast.parse(textwrap.dedent(init))
    [merge] = [node for node in ast.walk(tree) if isinstance(node, ast.If) and "use_alternative_attention" in
               ast.unparse(node.test)]  # fmt: skip
    assert ast.unparse(merge.test) == "not self.is_kv_shared_layer and (not self.use_alternative_attention)"
    built = [[ast.unparse(n.targets[0]) for n in ast.walk(ast.Module(branch, [])) if isinstance(n, ast.Assign)]
             for branch in (merge.body, merge.orelse)]  # fmt: skip
    norms = ["self.q_norm", "self.k_norm", "self.v_norm"]
    assert built[0] == ["self.qkv_proj", "self.qkv_proj_sizes", "self.q_proj", *norms, "self.k_proj"]
    assert built[1] == ["self.qkv_proj", "self.qkv_proj_sizes", "self.q_proj", *norms, "self.k_proj"]
    assert " if self.qkv_proj is not None else " not in init and "self.v_proj" not in init
    forward = inspect.getsource(fused_gemma4_text.FusedGemma4TextAttention.forward)
    assert "if self.qkv_proj is not None:\n            q_proj_out, k_proj_out, v_proj_out = self.qkv_proj(" in forward
    assert " if self.qkv_proj is not None else " not in forward
    assert (
        "if self.qkv_proj is not None:\n                key_states = k_proj_out.view(hidden_shape)\n"
        "                value_states = v_proj_out.view(hidden_shape)\n            else:\n"
        "                key_states = self.k_proj(hidden_states).view(hidden_shape)\n"
        "                value_states = key_states\n"
    ) in forward


def merged_order(original: nn.Module, fused: nn.Module, mapping, at: str = "first") -> list[str]:
    """The original's parameter names in registration order, each piece of a merged linear the fused model has
    replaced by the merged linear's name at its `first` (or `last`) piece's place (read off the mapping, not the
    runtime)."""
    fused_names = dict(fused.named_parameters())
    order = []
    for name in dict(original.named_parameters()):
        owner, _, rest = name.rpartition(".")
        module, _, attribute = owner.rpartition(".")
        for merged, pieces in mapping.items():
            candidate = f"{module}.{merged}.{rest}"
            if attribute in [piece for piece, _ in pieces] and candidate in fused_names:
                name = candidate
        if at == "last" and name in order:
            order.remove(name)
        if name not in order:
            order.append(name)
    return order


def merged_values(original: nn.Module, name: str, mapping) -> torch.Tensor:
    """The original's tensor for fused parameter `name`: its own, or its pieces' stacked in row order."""
    own = dict(original.named_parameters())
    if name in own:
        return own[name]
    owner, _, leaf = name.rpartition(".")
    module, _, merged = owner.rpartition(".")
    return torch.cat(
        [own[f"{module}.{piece}.{leaf}"] for piece, _ in mapping[merged] if f"{module}.{piece}.{leaf}" in own]
    )


@pytest.mark.parametrize("variant", sorted(VARIANTS))
def test_construction_registers_and_draws_as_the_original(variant):
    """Built from one seed, the fused model registers its parameters in the original's order (each merged linear at
    its first piece's place), holds the original's initial values (the merged ones: the pieces' values stacked,
    so the same random numbers were drawn in the same order for tensors of the same shapes) and leaves the random
    generator where the original leaves it: the `if` block changed no construction order."""
    config = gemma4_config(**VARIANTS[variant])
    torch.manual_seed(0)
    original = Gemma4ForCausalLM(config)
    after_original = torch.get_rng_state()
    torch.manual_seed(0)
    fused = fused_gemma4_text.FusedGemma4ForCausalLM(config)
    assert torch.equal(torch.get_rng_state(), after_original)
    assert [name for name, _ in fused.named_parameters()] == merged_order(original, fused, MAPPING)
    merged = [name for name, _ in fused.named_parameters() if "qkv_proj" in name]
    assert merged or variant in ("shared_k_eq_v",), "no layer of the variant merges"
    for name, parameter in fused.named_parameters():
        assert torch.equal(parameter, merged_values(original, name, MAPPING)), name


# --------------------------------------------------------------------------------------------------------------------
# Construction variants (fusegen/compiler/validate.py): Gemma 4's construction-changing fields are found
# --------------------------------------------------------------------------------------------------------------------


def test_gemma4_variants_cover_kv_sharing_k_eq_v_and_double_wide_mlp():
    """Coverage's tiny config has been saved once (`architectures` set) before its variants are sought; they must
    still include attention_k_eq_v, kv sharing (which needs more layers than the tiny config has) and the
    double-wide MLP (which changes only kv-shared layers), each building what it names."""
    from fusegen.compiler.resolve import resolve
    from fusegen.compiler.shrink import shrunk_config
    from fusegen.compiler.validate import construction_variants
    from fusegen.testkit import model_config

    target = resolve("gemma4_text")
    config = model_config(target, shrunk_config(target.config_class))
    config.architectures = ["Gemma4ForCausalLM"]
    found = dict(construction_variants(target, config, limit=None, max_probes=None, every_field=True))
    assert found["attention_k_eq_v=True"].attention_k_eq_v
    shared = found["num_kv_shared_layers=1 (4 layers)"]
    assert shared.num_hidden_layers == 4 and "reuse" in shared.kv_sharing_modes
    wide = found["num_kv_shared_layers=1, use_double_wide_mlp=True (4 layers)"]
    assert wide.use_double_wide_mlp and "reuse" in wide.kv_sharing_modes
    assert any(label.startswith("enable_moe_block=True") for label in found)


def test_composite_gemma4_variants_reach_its_text_config():
    """The multimodal gemma4 config's attention lives in its text_config: the exhaustive search probes that
    sub-config's fields too (the build's capped search does not)."""
    from fusegen.compiler.resolve import resolve
    from fusegen.compiler.shrink import shrunk_config
    from fusegen.compiler.validate import construction_variants
    from fusegen.testkit import model_config

    target = resolve("gemma4")
    config = model_config(target, shrunk_config(target.config_class))
    found = dict(construction_variants(target, config, limit=None, max_probes=None, every_field=True))
    assert found["text_config.attention_k_eq_v=True"].text_config.attention_k_eq_v
    shared = found["text_config.num_kv_shared_layers=1 (4 layers)"].text_config
    assert shared.num_hidden_layers == 4 and "reuse" in shared.kv_sharing_modes
    assert not any(label.startswith("text_config.") for label, _ in construction_variants(target, config))


# --------------------------------------------------------------------------------------------------------------------
# Gemma 3n: the same shape without an inner guard (k_proj and v_proj both exist exactly where qkv_proj does)
# --------------------------------------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def gemma3n(tmp_path_factory):
    from fusegen.compiler.build import build
    from fusegen.testkit import import_file

    path = tmp_path_factory.mktemp("gemma3n") / "fused_gemma3n_text.py"
    path.write_text(build("gemma3n_text").text)
    return import_file(path, "nested_fused_gemma3n_text")


@pytest.mark.parametrize("bias", [False, True])
def test_gemma3n_matches_with_a_kv_shared_layer(gemma3n, tmp_path, bias):
    from transformers import Gemma3nForCausalLM

    from fusegen.compiler.resolve import resolve
    from fusegen.compiler.shrink import shrunk_config
    from fusegen.testkit import model_config

    target = resolve("gemma3n_text")
    config = model_config(target, shrunk_config(target.config_class, attention_bias=bias))
    fused_class = gemma3n.FusedGemma3nForCausalLM
    _, fused = round_trip(Gemma3nForCausalLM, fused_class, config, tmp_path, gemma3n.STACKED_PARAMS_MAPPING)
    layers = [layer.self_attn for layer in fused.model.layers]
    assert any(a.is_kv_shared_layer for a in layers) and not all(a.is_kv_shared_layer for a in layers)
    for attention in layers:
        assert isinstance(attention.qkv_proj, MergedColumnLinear) == (not attention.is_kv_shared_layer)
        assert (type(attention.q_proj) is nn.Linear) == attention.is_kv_shared_layer
        assert not hasattr(attention, "k_proj") and not hasattr(attention, "v_proj")
