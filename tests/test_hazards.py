"""Hand-written modules where fusion is safe (fused, same outputs) or wrong (refused, with the rule).

Each case is a tiny causal LM of its own (config, block, model, head) written
to a module file and compiled through the same path as a Transformers model
type: `fusegen build <dotted module path>`.
"""

import importlib
import sys

import pytest
import torch

from fusegen.build import analyse, build

MODULE = """
import inspect
import operator
import sys

import torch
import torch.nn.functional as F
from torch import nn
from transformers import GenerationMixin, PretrainedConfig, PreTrainedModel
from transformers.modeling_outputs import CausalLMOutput


def apply(module, x):
    return module(x)


def scale_in_place(x):
    x.mul_(2)
    return x


class Mutator(nn.Module):
    def forward(self, x):
        x.add_(1)
        return x


{extra}


class ToyConfig(PretrainedConfig):
    model_type = "{model_type}"

    def __init__(self, vocab_size=32, hidden_size=16, num_hidden_layers=2, flag=True, **kwargs):
        self.vocab_size = vocab_size
        self.hidden_size = hidden_size
        self.num_hidden_layers = num_hidden_layers
        self.flag = flag
        kwargs.setdefault("tie_word_embeddings", False)
        super().__init__(**kwargs)


class ToyBlock(nn.Module):
    def __init__(self, config):
        super().__init__()
        self.flag = config.flag
        self.hidden_size = config.hidden_size
        self.q_proj = nn.Linear(config.hidden_size, config.hidden_size, bias=False)
        self.k_proj = nn.Linear(config.hidden_size, config.hidden_size // 2, bias=False)
        self.v_proj = nn.Linear(config.hidden_size, config.hidden_size // 2, bias=False)
{init}

    def forward(self, x):
{forward}


    def reset_state(self):
        self.state.zero_()


class ToyPreTrainedModel(PreTrainedModel):
    config_class = ToyConfig
    base_model_prefix = "model"


class ToyLayer(nn.Module):
    def __init__(self, config):
        super().__init__()
        self.block = ToyBlock(config)
{layer}

    def forward(self, x):
        return x + self.block(x)


class ToyModel(ToyPreTrainedModel):
    def __init__(self, config):
        super().__init__(config)
        self.embed = nn.Embedding(config.vocab_size, config.hidden_size)
        self.layers = nn.ModuleList([ToyLayer(config) for _ in range(config.num_hidden_layers)])
        self.post_init()

    def forward(self, input_ids):
        hidden = self.embed(input_ids)
        for layer in self.layers:
            hidden = layer(hidden)
        return hidden


class ToyForCausalLM(ToyPreTrainedModel, GenerationMixin):
    def __init__(self, config):
        super().__init__(config)
        self.model = ToyModel(config)
        self.lm_head = nn.Linear(config.hidden_size, config.vocab_size, bias=False)
        self.post_init()

    def forward(self, input_ids, **kwargs):
        return CausalLMOutput(logits=self.lm_head(self.model(input_ids)))
"""

QKV = "        q = self.q_proj(x)\n        k = self.k_proj(x)\n        v = self.v_proj(x)\n"
RETURN = "        return q + torch.cat([k, v], dim=-1)\n"
GLU_INIT = """
        self.gate_proj = nn.Linear(config.hidden_size, 24, bias=False)
        self.up_proj = nn.Linear(config.hidden_size, 24, bias=False)
        self.down_proj = nn.Linear(24, config.hidden_size, bias=False)
        self.act = nn.SiLU()
"""

# name: (extra __init__ lines, forward body)
SAFE = {
    "plain": ("", QKV + RETURN),
    "reversed_glu_operands": (
        GLU_INIT,
        QKV + "        h = self.up_proj(x) * self.act(self.gate_proj(x))\n"
        "        return q + torch.cat([k, v], dim=-1) + self.down_proj(h)\n",
    ),
    "guard_is_not_none": (
        "",
        "        q = self.q_proj(x)\n        k = self.k_proj(x)\n"
        "        v = self.v_proj(x) if self.v_proj is not None else torch.zeros_like(k)\n" + RETURN,
    ),
    "guard_none_first": (
        "",
        "        q = self.q_proj(x)\n        k = self.k_proj(x)\n        v = torch.zeros_like(k)\n"
        "        if None is not self.v_proj:\n            v = self.v_proj(x)\n" + RETURN,
    ),
    "guard_is_none_else": (
        "",
        "        q = self.q_proj(x)\n        k = self.k_proj(x)\n"
        "        if self.v_proj is None:\n            v = torch.zeros_like(k)\n"
        "        else:\n            v = self.v_proj(x)\n" + RETURN,
    ),
    "guard_truthiness": (
        "",
        "        q = self.q_proj(x)\n        k = self.k_proj(x)\n        v = 0\n"
        "        if self.v_proj:\n            v = self.v_proj(x)\n" + RETURN,
    ),
    "guard_not": (
        "",
        "        q = self.q_proj(x)\n        k = self.k_proj(x)\n"
        "        v = torch.zeros_like(k) if not self.v_proj else self.v_proj(x)\n" + RETURN,
    ),
    "config_flag_branches": (
        "",
        "        q = self.q_proj(x)\n"
        "        if self.flag:\n            k = self.k_proj(x) * 2\n            v = self.v_proj(x)\n"
        "        else:\n            k = torch.zeros(x.shape[:-1] + (8,))\n            v = torch.ones_like(k)\n"
        + RETURN,
    ),
    "qk_norm": (
        "        self.q_norm = nn.LayerNorm(16)\n        self.k_norm = nn.LayerNorm(8)\n",
        "        q = self.q_norm(self.q_proj(x))\n        k = self.k_norm(self.k_proj(x))\n        v = self.v_proj(x)\n"
        + RETURN,
    ),
    "inplace_on_outputs": (
        "",
        "        q = self.q_proj(x)\n        q.mul_(2)\n        k = self.k_proj(x)\n        k.add_(q[..., :8])\n"
        "        v = self.v_proj(x)\n        torch.relu_(v)\n" + RETURN,
    ),
    "keyword_and_spelling_variants": (
        (
            "        self.a_proj = nn.Linear(in_features=self.hidden_size, out_features=4, bias=False)\n"
            "        self.b_proj = nn.Linear(config.hidden_size, 2 * 2, False)\n"
        ),
        QKV
        + "        return q + torch.cat([k, v], dim=-1) + torch.cat([self.a_proj(x), self.b_proj(x)] * 2, dim=-1)\n",
    ),
    "unwritten_view_alias": (
        "",
        (
            "        q = self.q_proj(x)\n        h = x.view(-1, self.hidden_size)\n        n = h.sum()\n"
            "        k = self.k_proj(x)\n        v = self.v_proj(x)\n"
            "        return q + torch.cat([k, v], dim=-1) + n\n"
        ),
    ),
    "metadata_between": (
        "",
        (
            "        q = self.q_proj(x)\n        batch, length, width = x.shape\n        size = x.size(-1)\n"
            "        k = self.k_proj(x)\n        v = self.v_proj(x)\n"
            "        return q + torch.cat([k, v], dim=-1) * (size // width)\n"
        ),
    ),
    "mutation_outside_region": (
        "",
        "        x = x * 2\n" + QKV + "        x.mul_(3)\n        return q + torch.cat([k, v], dim=-1) + x\n",
    ),
    "generic_merged_column": (
        (
            "        self.a_gate = nn.Linear(config.hidden_size, 4, bias=True)\n"
            "        self.b_gate = nn.Linear(config.hidden_size, 12, bias=True)\n"
        ),
        QKV + "        g = torch.cat([self.a_gate(x), torch.sigmoid(self.b_gate(x))], dim=-1)\n"
        "        return q * g + torch.cat([k, v], dim=-1)\n",
    ),
    "temporary_names_taken": (
        "",
        "        q_proj_out = 1.0\n" + QKV + "        return q * q_proj_out + torch.cat([k, v], dim=-1)\n",
    ),
    "pure_module_on_input": (
        "        self.act = nn.GELU()\n",
        (
            "        q = self.q_proj(x)\n        a = self.act(x)\n        k = self.k_proj(x)\n        v = self.v_proj(x)\n"
            "        return q + a + torch.cat([k, v], dim=-1)\n"
        ),
    ),
}

# name: (extra __init__ lines, forward body, expected rule)
HAZARDS = {
    "rebound_between": (
        "",
        (
            "        q = self.q_proj(x)\n        x, y = x, x * 2\n        k = self.k_proj(x)\n        v = self.v_proj(x)\n"
            "        return q + torch.cat([k, v], dim=-1) + y\n"
        ),
        "input-rebound",
    ),
    "item_written": (
        "",
        "        q = self.q_proj(x)\n        x[0] = 0\n        k = self.k_proj(x)\n        v = self.v_proj(x)\n"
        + RETURN,
        "input-written",
    ),
    "view_alias_written": (
        "",
        "        h = x.view(-1)\n        q = self.q_proj(x)\n        h[0] = 5.0\n        k = self.k_proj(x)\n"
        "        v = self.v_proj(x)\n" + RETURN,
        "input-written",
    ),
    "slice_alias_inplace": (
        "",
        "        q = self.q_proj(x)\n        h = x[:, 1:]\n        h.add_(1)\n        k = self.k_proj(x)\n"
        "        v = self.v_proj(x)\n" + RETURN,
        "inplace-call",
    ),
    "transpose_chain_inplace": (
        "",
        "        q = self.q_proj(x)\n        h = x.transpose(1, 2)\n        g = h[0]\n        g.zero_()\n"
        "        k = self.k_proj(x)\n        v = self.v_proj(x)\n" + RETURN,
        "inplace-call",
    ),
    "unpacked_alias_inplace": (
        "",
        "        q = self.q_proj(x)\n        a, b = x.chunk(2, dim=-1)\n        a.mul_(0)\n        k = self.k_proj(x)\n"
        "        v = self.v_proj(x)\n" + RETURN,
        "inplace-call",
    ),
    "method_inplace": (
        "",
        "        q = self.q_proj(x)\n        x.mul_(2)\n        k = self.k_proj(x)\n        v = self.v_proj(x)\n"
        + RETURN,
        "inplace-call",
    ),
    "function_inplace": (
        "",
        "        q = self.q_proj(x)\n        torch.relu_(x)\n        k = self.k_proj(x)\n        v = self.v_proj(x)\n"
        + RETURN,
        "inplace-call",
    ),
    "out_keyword": (
        "",
        "        q = self.q_proj(x)\n        torch.add(x, 1, out=x)\n        k = self.k_proj(x)\n        v = self.v_proj(x)\n"
        + RETURN,
        "inplace-call",
    ),
    "inplace_keyword": (
        "",
        "        q = self.q_proj(x)\n        F.relu(x, inplace=True)\n        k = self.k_proj(x)\n        v = self.v_proj(x)\n"
        + RETURN,
        "inplace-call",
    ),
    "inplace_submodule": (
        "        self.act = nn.ReLU(inplace=True)\n",
        "        q = self.q_proj(x)\n        self.act(x)\n        k = self.k_proj(x)\n        v = self.v_proj(x)\n"
        + RETURN,
        "impure-call",
    ),
    "mutating_user_module": (
        "        self.mutate = Mutator()\n",
        "        q = self.q_proj(x)\n        self.mutate(x)\n        k = self.k_proj(x)\n        v = self.v_proj(x)\n"
        + RETURN,
        "impure-call",
    ),
    "mutating_function": (
        "",
        "        q = self.q_proj(x)\n        scale_in_place(x)\n        k = self.k_proj(x)\n        v = self.v_proj(x)\n"
        + RETURN,
        "impure-call",
    ),
    "state_method_between": (
        "        self.register_buffer('state', torch.zeros(1))\n",
        "        q = self.q_proj(x)\n        self.reset_state()\n        k = self.k_proj(x)\n        v = self.v_proj(x)\n"
        + RETURN,
        "state-method-call",
    ),
    "called_twice": (
        "",
        "        q = self.q_proj(x) + self.q_proj(x)\n        k = self.k_proj(x)\n        v = self.v_proj(x)\n"
        + RETURN,
        "not-called-once",
    ),
    "call_in_loop": (
        "",
        "        q = 0\n        for _ in range(2):\n            q = q + self.q_proj(x)\n"
        "        k = self.k_proj(x)\n        v = self.v_proj(x)\n" + RETURN,
        "call-in-loop",
    ),
    "weight_referenced": (
        "",
        "        q = self.q_proj(x) * self.q_proj.weight.mean()\n        k = self.k_proj(x)\n        v = self.v_proj(x)\n"
        + RETURN,
        "escaping-reference",
    ),
    "passed_as_object": (
        "",
        "        q = apply(self.q_proj, x)\n        k = self.k_proj(x)\n        v = self.v_proj(x)\n" + RETURN,
        "not-called-once",
    ),
    "equality_guard_not_folded": (
        "",
        "        q = self.q_proj(x)\n        k = self.k_proj(x)\n"
        "        v = self.v_proj(x) if self.v_proj != None else k\n" + RETURN,
        "escaping-reference",
    ),
    "inputs_spelled_differently": (
        "",
        "        y = x\n        q = self.q_proj(x)\n        k = self.k_proj(y)\n        v = self.v_proj(x)\n" + RETURN,
        "different-inputs",
    ),
    "bias_disagrees": (
        (
            "        self.a_proj = nn.Linear(config.hidden_size, 4, bias=True)\n"
            "        self.b_proj = nn.Linear(config.hidden_size, 4, bias=False)\n"
        ),
        QKV
        + "        return q + torch.cat([k, v], dim=-1) + torch.cat([self.a_proj(x), self.b_proj(x)] * 2, dim=-1)\n",
        "constructors-disagree",
    ),
    "name_mangled": (
        "        self.__scale = 2.0\n",
        QKV + "        return q * self.__scale + torch.cat([k, v], dim=-1)\n",
        "name-mangled",
    ),
    "merged_name_taken": (
        "        self.qkv_proj = None\n",
        QKV + RETURN,
        "name-clash",
    ),
}


def module_source(model_type, init, forward, extra="", layer=""):
    """The toy causal LM's source with the block's extra `__init__` lines and `forward` body filled in.

    `extra` goes at module level (helpers, subclasses, global hooks), `layer`
    into `ToyLayer.__init__` after the block is built (hooks, replacements).
    """
    source = MODULE.replace("{model_type}", model_type).replace("{init}", init.rstrip("\n") or "        pass")
    source = source.replace("{extra}", extra.rstrip("\n")).replace("{layer}", layer.rstrip("\n"))
    return source.replace("{forward}", forward.rstrip("\n"))


def write_case(tmp_path, name, init, forward, extra="", layer=""):
    package = tmp_path / "hazard_cases"
    package.mkdir(exist_ok=True)
    (package / "__init__.py").touch()
    module_name = f"toy_{name}"
    (package / f"{module_name}.py").write_text(module_source(module_name, init, forward, extra, layer))
    return f"hazard_cases.{module_name}"


@pytest.fixture
def case_path(tmp_path, monkeypatch):
    monkeypatch.syspath_prepend(str(tmp_path))
    yield tmp_path
    for name in [m for m in sys.modules if m.startswith("hazard_cases")]:
        del sys.modules[name]


def outcome(dotted):
    (block,) = [o for o in analyse(dotted).outcomes if o.class_name == "ToyBlock"]
    return block


@pytest.mark.parametrize("name", sorted(HAZARDS))
def test_hazard_is_refused_with_its_rule(case_path, name):
    init, forward, rule = HAZARDS[name]
    block = outcome(write_case(case_path, name, init, forward))
    (refusal,) = [refusal for refusal in block.refused if refusal.rule == rule] or [block.refused]
    assert refusal.reason and refusal.line, refusal
    assert refusal.projections not in [plan.projections for plan in block.fused]


@pytest.mark.parametrize("name", sorted(SAFE))
def test_safe_case_is_fused_and_computes_the_same(case_path, tmp_path, name):
    init, forward = SAFE[name]
    dotted = write_case(case_path, name, init, forward)
    block = outcome(dotted)
    assert ("q_proj", "k_proj", "v_proj") in [plan.projections for plan in block.fused], block.refused
    assert not block.refused, block.refused
    result = build(dotted)
    (case_path / "hazard_cases" / f"fused_{name}.py").write_text(result.text)
    original_module = importlib.import_module(dotted)
    fused_module = importlib.import_module(f"hazard_cases.fused_{name}")
    for flag in (True, False):
        config = original_module.ToyConfig(flag=flag)
        torch.manual_seed(0)
        original = original_module.ToyForCausalLM(config).eval()
        checkpoint = tmp_path / f"checkpoint-{flag}"
        original.save_pretrained(checkpoint)
        fused, info = fused_module.FusedToyForCausalLM.from_pretrained(checkpoint, output_loading_info=True)
        assert not any(info.values()), info
        input_ids = torch.randint(0, 32, (2, 5), generator=torch.Generator().manual_seed(1))
        with torch.no_grad():
            expected = original(input_ids).logits
            actual = fused.eval()(input_ids).logits
        assert torch.allclose(expected, actual, atol=1e-6, rtol=0), (expected - actual).abs().max()


def test_generic_group_gets_a_merged_column_plan(case_path):
    init, forward = SAFE["generic_merged_column"]
    block = outcome(write_case(case_path, "generic_merged_column", init, forward))
    kinds = {plan.merged: plan.kind for plan in block.fused}
    assert kinds == {"qkv_proj": "qkv", "ab_gate": "merged_column"}


def test_refusal_names_the_source_line(case_path):
    init, forward, _ = HAZARDS["method_inplace"]
    dotted = write_case(case_path, "method_inplace", init, forward)
    (refusal,) = outcome(dotted).refused
    source = importlib.import_module(dotted).__file__
    with open(source) as handle:
        line = handle.read().splitlines()[refusal.line - 1]
    assert line.strip() == "x.mul_(2)"


def test_refusals_appear_in_the_generated_header(case_path):
    forward = QKV + (
        "        a = self.a_proj(x)\n        x.mul_(2)\n        b = self.b_proj(x)\n"
        "        return q + torch.cat([k, v], dim=-1) + torch.cat([a, b] * 2, dim=-1)\n"
    )
    init = "        self.a_proj = nn.Linear(16, 4)\n        self.b_proj = nn.Linear(16, 4)\n"
    text = build(write_case(case_path, "mixed", init, forward)).text
    header = text.split('"""')[0]
    assert "FusedToyBlock: q_proj + k_proj + v_proj -> qkv_proj (qkv)" in header
    assert "ToyBlock: a_proj + b_proj: inplace-call: `x.mul_(2)` writes the projection input in place" in header
    assert "self.a_proj(x)" in text and "self.b_proj(x)" in text


def test_module_that_does_not_import_is_an_input_error():
    from fusegen.errors import InputError

    with pytest.raises(InputError, match="cannot import module 'no_such_pkg.modeling'"):
        analyse("no_such_pkg.modeling")


def test_module_without_causal_lm_is_an_input_error(case_path):
    from fusegen.errors import InputError

    (case_path / "plain_pkg").mkdir()
    (case_path / "plain_pkg" / "__init__.py").touch()
    (case_path / "plain_pkg" / "modeling_plain.py").write_text("X = 1\n")
    with pytest.raises(InputError, match="defines no causal-LM classes"):
        analyse("plain_pkg.modeling_plain")


def test_kv_fused_when_q_reads_another_spelling(case_path, tmp_path):
    # The cross-attention-capable shape: k and v read `current`, which is `x` only when self-attending.
    forward = (
        "        q = self.q_proj(x)\n"
        "        current = x if self.flag else x.flip(1)\n"
        "        k = self.k_proj(current)\n        v = self.v_proj(current)\n" + RETURN
    )
    dotted = write_case(case_path, "cross_style", "", forward)
    block = outcome(dotted)
    assert [(plan.kind, plan.merged) for plan in block.fused] == [("merged_column", "kv_proj")]
    assert [refusal.rule for refusal in block.refused] == ["different-inputs"]
    (case_path / "hazard_cases" / "fused_cross_style.py").write_text(build(dotted).text)
    original_module = importlib.import_module(dotted)
    fused_module = importlib.import_module("hazard_cases.fused_cross_style")
    for flag in (True, False):
        torch.manual_seed(0)
        original = original_module.ToyForCausalLM(original_module.ToyConfig(flag=flag)).eval()
        original.save_pretrained(tmp_path / str(flag))
        fused = fused_module.FusedToyForCausalLM.from_pretrained(tmp_path / str(flag)).eval()
        input_ids = torch.randint(0, 32, (2, 5), generator=torch.Generator().manual_seed(1))
        with torch.no_grad():
            assert torch.allclose(original(input_ids).logits, fused(input_ids).logits, atol=1e-6, rtol=0)
