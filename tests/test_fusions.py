"""The fusion-kind registry (`fusegen.fusions`): the kinds it finds, what the stages ask them, and a kind that
merges no linears plugged in from outside without touching the compiler."""

from __future__ import annotations

import ast
import importlib
import sys
from types import SimpleNamespace

import pytest
import torch

from fusegen import fusions
from fusegen.compiler.build import analyse, build
from fusegen.compiler.mappings import fused_plan_from, tensor_parallel
from fusegen.core import astutil
from fusegen.core.plan import FusionPlan, Refusal, Refused
from fusegen.fusions.base import Kind
from fusegen.fusions.linear import LinearKind
from fusegen.runtime.tp import LOCAL_HEADS, MERGED_COLWISE
from fusegen.testkit import TOLERANCE, max_diff, random_input, random_model, toy_source
from fusegen.tools import coverage

SCALE = """
class ToyScale(nn.Module):
    def __init__(self, config):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(config.hidden_size))

    def forward(self, x):
        return x * self.weight
"""
TOY = toy_source(
    "toy_scaled",
    init="        self.scale = ToyScale(config)\n",
    forward=(
        "        q = self.q_proj(x)\n        k = self.k_proj(x)\n        v = self.v_proj(x)\n"
        "        return self.scale(q + torch.cat([k, v], dim=-1))\n"
    ),
    extra=SCALE,
)
"""The test kit's toy causal LM whose q/k/v block ends in `ToyScale`, a module with no linear child."""


class SwappedProduct(Kind):
    """A toy kind that merges no linears: `ToyScale.forward`'s `x * self.weight` becomes `self.weight * x`."""

    name = "swapped_product"
    priority = 95

    def candidate(self, module):
        return type(module).__name__ == "ToyScale"

    def match(self, trace, module):
        return [FusionPlan(self.name, "forward")] if self.candidate(module) else []

    def rewrite(self, classdef, plan, module, namespace, fused):
        (ret,) = [node for node in ast.walk(astutil.method(classdef, "forward")) if isinstance(node, ast.Return)]
        if not isinstance(ret.value, ast.BinOp):
            raise Refused("not-a-product", "forward returns no product", ret)
        ret.value.left, ret.value.right = ret.value.right, ret.value.left


@pytest.fixture
def toy_kind(tmp_path, monkeypatch):
    """The toy model importable as `toy_scaled_pkg.modeling`, and the toy kind registered while the test runs."""
    package = tmp_path / "toy_scaled_pkg"
    package.mkdir()
    (package / "__init__.py").touch()
    (package / "modeling.py").write_text(TOY)
    monkeypatch.syspath_prepend(str(tmp_path))
    fusions.register(SwappedProduct)
    yield "toy_scaled_pkg.modeling"
    del fusions._REGISTRY[SwappedProduct.name]
    for name in [m for m in sys.modules if m.startswith("toy_scaled_pkg")]:
        del sys.modules[name]


def test_the_registry_finds_one_kind_per_module_in_priority_order():
    assert [(kind.name, type(kind).__module__) for kind in fusions.kinds()] == [
        ("qkv", "fusegen.fusions.qkv"),
        ("glu", "fusegen.fusions.glu"),
        ("merged_column", "fusegen.fusions.siblings"),
        ("packed_qkv", "fusegen.fusions.packed_qkv"),
        ("rmsnorm", "fusegen.fusions.rmsnorm"),
    ]
    assert [kind.name for kind in fusions.kinds() if kind.head_sharded] == ["qkv"]


def test_two_kinds_cannot_share_a_name():
    class Impostor(Kind):
        name = "qkv"

    with pytest.raises(ValueError, match="two fusion kinds are named 'qkv'"):
        fusions.register(Impostor)
    assert type(fusions.kind("qkv")).__name__ == "QKV"


def test_a_kind_that_merges_no_linears_plugs_in_without_touching_the_compiler(toy_kind):
    outcomes = {o.class_name: o for o in analyse(toy_kind).outcomes}
    # ToyScale has no linear child at all: it is analysed because its kind asked for it (`Kind.candidate`).
    assert [plan.describe() for plan in outcomes["ToyScale"].fused] == ["forward (swapped_product)"]
    assert [plan.describe() for plan in outcomes["ToyBlock"].fused] == ["q_proj + k_proj + v_proj -> qkv_proj (qkv)"]
    text = build(toy_kind, validate=False).text
    assert "return self.weight * x" in text and "class FusedToyScale(nn.Module):" in text
    assert "self.scale = FusedToyScale(config)" in text
    fused_path = sys.modules[toy_kind].__file__.replace("modeling.py", "fused.py")
    with open(fused_path, "w") as handle:
        handle.write(text)
    original_module = importlib.import_module(toy_kind)
    fused_module = importlib.import_module("toy_scaled_pkg.fused")
    # Only the linear merge has a checkpoint mapping, and the TP plan and scopes know nothing of the other kind.
    assert fused_module.STACKED_PARAMS_MAPPING == {"qkv_proj": [("q_proj", "q"), ("k_proj", "k"), ("v_proj", "v")]}
    assert fused_module.packed_modules_mapping == {"qkv_proj": ["q_proj", "k_proj", "v_proj"]}
    # qkv_proj's holder is built as `ToyLayer.block`; ToyScale, built as `ToyBlock.scale`, merges nothing to scope.
    assert 'STACKED_PARAMS_MAPPING, parents={"qkv_proj": ["block"]})' in text
    config = original_module.ToyConfig()
    original = random_model(original_module.ToyForCausalLM, config)
    fused = fused_module.FusedToyForCausalLM(config).eval()
    state = original.state_dict()
    for prefix in {key.rpartition(".q_proj.")[0] for key in state if ".q_proj." in key}:
        pieces = [state.pop(f"{prefix}.{name}.weight") for name in ("q_proj", "k_proj", "v_proj")]
        state[f"{prefix}.qkv_proj.weight"] = torch.cat(pieces)
    fused.load_state_dict(state)
    input_ids = random_input(config)
    with torch.no_grad():
        difference = max_diff(original(input_ids).logits, fused(input_ids).logits)
    assert difference <= TOLERANCE, difference


def test_a_refusing_kind_leaves_its_class_unfused_with_the_rule(toy_kind, monkeypatch):
    def refuse(self, classdef, plan, module, namespace, fused):
        raise Refused("toy-rule", "the toy kind declines")

    monkeypatch.setattr(SwappedProduct, "rewrite", refuse)
    (scale,) = [o for o in analyse(toy_kind).outcomes if o.class_name == "ToyScale"]
    assert scale.fused == []
    assert [(r.projections, r.rule, r.reason) for r in scale.refused] == [
        (("forward",), "toy-rule", "the toy kind declines")
    ]


def test_a_kind_may_answer_match_with_a_refusal_which_is_reported_in_its_place(toy_kind, monkeypatch):
    """`Kind.match` returns what it recognised but declines as a `Refusal`: no plan, no check, the rule reported."""
    checked = []
    monkeypatch.setattr(SwappedProduct, "check", lambda self, module, plan: checked.append(plan))
    monkeypatch.setattr(
        SwappedProduct,
        "match",
        lambda self, trace, module: [Refusal(("forward",), "toy-rule", "declined at match", 3)],
    )
    (scale,) = [o for o in analyse(toy_kind).outcomes if o.class_name == "ToyScale"]
    assert scale.fused == [] and checked == []
    assert [(r.projections, r.rule, r.reason, r.line) for r in scale.refused] == [
        (("forward",), "toy-rule", "declined at match", 3)
    ]


def test_the_tp_plan_shards_by_heads_what_the_kinds_say_holds_heads():
    original = {"layers.*.self_attn.q_proj": "colwise", "layers.*.self_attn.k_proj": "colwise",
                "layers.*.self_attn.v_proj": "colwise"}  # fmt: skip
    stacked = {"qkv_proj": [("q_proj", "q"), ("k_proj", "k"), ("v_proj", "v")]}
    heads, _ = fused_plan_from(original, stacked, heads={"qkv_proj"})
    assert heads == {"layers.*.self_attn": LOCAL_HEADS, "layers.*.self_attn.qkv_proj": MERGED_COLWISE}
    rows, _ = fused_plan_from(original, stacked, heads=set())
    assert rows == {"layers.*.self_attn.qkv_proj": MERGED_COLWISE}


def test_coverage_asks_the_kinds_what_to_count():
    # glu fused; a refused wq/wk/wv triplet, which only the qkv kind's `present` recognises by name.
    report = {"classes": [{"fused": [{"kind": "glu"}], "refused": [{"projections": ["wq", "wk", "wv"]}]}]}
    row = coverage.Row("toy", "fused", report, "", coverage.Inspection(), None)
    assert coverage.has_kind(row, "qkv") and coverage.has_kind(row, "glu")
    assert coverage.kind_counts([row]) == [
        ("types with a q/k/v triplet", 1),
        ("... of which q/k/v fused and verified", 0),
        ("types with a gate/up pair", 1),
        ("... of which gate/up fused and verified", 0),
    ]


class KeyValuePair(LinearKind):
    """A toy linear kind claiming `k_proj` + `v_proj` before qkv does, sharded by heads under TP."""

    name = "toy_kv"
    priority = 5
    head_sharded = True

    def claim(self, nodes):
        pair = [node for node in nodes if node.target in ("k_proj", "v_proj")]
        if len(pair) != 2:
            return [], nodes
        return [self.plan(["k_proj", "v_proj"])], [node for node in nodes if node not in pair]


@pytest.fixture
def toy_linear_kind(toy_kind):
    fusions.register(KeyValuePair)
    yield toy_kind
    del fusions._REGISTRY[KeyValuePair.name]


def test_a_linear_kind_is_one_class_and_the_stages_follow_it(toy_linear_kind):
    (block,) = [o for o in analyse(toy_linear_kind).outcomes if o.class_name == "ToyBlock"]
    # It claims first (priority 5): qkv then finds no triplet and q_proj alone is nothing to merge.
    assert [plan.describe() for plan in block.fused] == ["k_proj + v_proj -> kv_proj (toy_kv)"]
    text = build(toy_linear_kind, validate=False).text
    assert '"kv_proj": [("k_proj", 0), ("v_proj", 1)]' in text and "MergedColumnLinear" in text
    # The TP plan takes head sharding from the kind, not from the shard ids.
    model = SimpleNamespace(
        config=SimpleNamespace(base_model_tp_plan={"layers.*.k_proj": "colwise", "layers.*.v_proj": "colwise"})
    )
    tp = tensor_parallel(model, block.fused, {})
    assert tp["tp_plan"] == repr({"layers.*": LOCAL_HEADS, "layers.*.kv_proj": MERGED_COLWISE})
