"""The `rmsnorm` fusion kind (fusegen/fusions/rmsnorm.py): which norms it rewrites, which it refuses, and that the
rewrite is bit-identical where it is emitted."""

import ast
import dataclasses

import pytest
import torch
import torch.nn.functional as F
from torch import nn
from transformers.models.gemma.modeling_gemma import GemmaRMSNorm
from transformers.models.gemma3.modeling_gemma3 import Gemma3RMSNorm
from transformers.models.llama.modeling_llama import LlamaRMSNorm
from transformers.models.olmo2.modeling_olmo2 import Olmo2RMSNorm
from transformers.models.qwen3.configuration_qwen3 import Qwen3Config
from transformers.models.qwen3.modeling_qwen3 import Qwen3Attention, Qwen3RMSNorm

from fusegen.core import astutil
from fusegen.core.plan import Refused
from fusegen.fusions import rmsnorm

# --- hand-written norms: each differs from an RMS norm in one way, and must be refused -----------------------------


class _Norm(nn.Module):
    def __init__(self, hidden_size, eps=1e-6):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(hidden_size))
        self.variance_epsilon = eps


class EpsOutsideRsqrt(_Norm):
    def forward(self, hidden_states):
        input_dtype = hidden_states.dtype
        hidden_states = hidden_states.to(torch.float32)
        variance = hidden_states.pow(2).mean(-1, keepdim=True)
        hidden_states = hidden_states * (torch.rsqrt(variance) + self.variance_epsilon)
        return self.weight * hidden_states.to(input_dtype)


class EpsOutsideSqrt(_Norm):
    def forward(self, hidden_states):
        input_dtype = hidden_states.dtype
        hidden_states = hidden_states.to(torch.float32)
        variance = hidden_states.pow(2).mean(-1, keepdim=True)
        hidden_states = hidden_states / (torch.sqrt(variance) + self.variance_epsilon)
        return self.weight * hidden_states.to(input_dtype)


class WeightBeforeFloatCast(_Norm):
    def forward(self, hidden_states):
        input_dtype = hidden_states.dtype
        hidden_states = (self.weight * hidden_states).to(torch.float32)
        variance = hidden_states.pow(2).mean(-1, keepdim=True)
        return (hidden_states * torch.rsqrt(variance + self.variance_epsilon)).to(input_dtype)


class OtherReductionDim(_Norm):
    def forward(self, hidden_states):
        input_dtype = hidden_states.dtype
        hidden_states = hidden_states.to(torch.float32)
        variance = hidden_states.pow(2).mean(-2, keepdim=True)
        hidden_states = hidden_states * torch.rsqrt(variance + self.variance_epsilon)
        return self.weight * hidden_states.to(input_dtype)


class NoKeepdim(_Norm):
    def forward(self, hidden_states):
        input_dtype = hidden_states.dtype
        hidden_states = hidden_states.to(torch.float32)
        variance = hidden_states.pow(2).mean(-1)
        hidden_states = hidden_states * torch.rsqrt(variance + self.variance_epsilon)
        return self.weight * hidden_states.to(input_dtype)


class InInputDtype(_Norm):
    """Computes in the input's dtype; the kernel computes half types in float32, so they differ in bfloat16."""

    def forward(self, hidden_states):
        variance = hidden_states.pow(2).mean(-1, keepdim=True)
        return self.weight * (hidden_states * torch.rsqrt(variance + self.variance_epsilon))


class MeanSubtracted(_Norm):
    def forward(self, hidden_states):
        input_dtype = hidden_states.dtype
        hidden_states = hidden_states.to(torch.float32)
        centred = hidden_states - hidden_states.mean(-1, keepdim=True)
        hidden_states = centred * torch.rsqrt(centred.pow(2).mean(-1, keepdim=True) + self.variance_epsilon)
        return self.weight * hidden_states.to(input_dtype)


class Residual(_Norm):
    def forward(self, hidden_states):
        input_dtype = hidden_states.dtype
        h = hidden_states.to(torch.float32)
        h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + self.variance_epsilon)
        return self.weight * h.to(input_dtype) + hidden_states


class Branching(_Norm):
    def forward(self, hidden_states):
        input_dtype = hidden_states.dtype
        hidden_states = hidden_states.to(torch.float32)
        variance = hidden_states.pow(2).mean(-1, keepdim=True)
        if self.training:
            variance = variance + 1
        hidden_states = hidden_states * torch.rsqrt(variance + self.variance_epsilon)
        return self.weight * hidden_states.to(input_dtype)


class EpsProperty(_Norm):
    @property
    def eps(self):
        return self.variance_epsilon

    def forward(self, hidden_states):
        input_dtype = hidden_states.dtype
        hidden_states = hidden_states.to(torch.float32)
        variance = hidden_states.pow(2).mean(-1, keepdim=True)
        hidden_states = hidden_states * torch.rsqrt(variance + self.eps)
        return self.weight * hidden_states.to(input_dtype)


class TwoNumbers(_Norm):
    """A plain Llama-style norm that also holds a second number: a rewrite reading the wrong one must be caught."""

    def __init__(self, hidden_size, eps=1e-6):
        super().__init__(hidden_size, eps)
        self.other_epsilon = 1e-2

    def forward(self, hidden_states):
        input_dtype = hidden_states.dtype
        hidden_states = hidden_states.to(torch.float32)
        variance = hidden_states.pow(2).mean(-1, keepdim=True)
        hidden_states = hidden_states * torch.rsqrt(variance + self.variance_epsilon)
        return self.weight * hidden_states.to(input_dtype)


class Spelled(_Norm):
    """Llama's norm spelled differently: `torch.mean`, `** 2`, `.float()`, `type_as`, an inlined helper."""

    def _norm(self, x):
        return x * (self.variance_epsilon + torch.mean(x**2, dim=-1, keepdim=True)).rsqrt()

    def forward(self, x):
        return self.weight * self._norm(x.float()).type_as(x)


REFUSED = {
    EpsOutsideRsqrt: "norm-not-rms",
    EpsOutsideSqrt: "norm-expression",
    WeightBeforeFloatCast: "norm-not-rms",
    OtherReductionDim: "norm-expression",
    NoKeepdim: "norm-expression",
    InInputDtype: "norm-not-rms",
    MeanSubtracted: "norm-not-rms",
    Residual: "norm-not-rms",
    Branching: "norm-statement",
    EpsProperty: "norm-attribute",
}


def _meta(cls, *args):
    with torch.device("meta"):
        return cls(*args)


@pytest.mark.parametrize("cls", list(REFUSED), ids=lambda c: c.__name__)
def test_a_norm_that_differs_is_refused(cls):
    with pytest.raises(Refused) as refusal:
        rmsnorm.derive(cls, _meta(cls, 16))
    assert refusal.value.rule == REFUSED[cls], refusal.value.reason
    assert refusal.value.rule in rmsnorm.RULES


@pytest.mark.parametrize("cls", [c for c in REFUSED if c is not EpsProperty], ids=lambda c: c.__name__)
def test_the_llama_rewrite_differs_from_each_refused_norm(cls):
    """The refusals are real: put in Llama's rewrite anyway and the execution check sees the difference (so it can
    fail). EpsProperty is left out: its property returns the same eps, a refusal on principle (the reader does not
    follow properties), not because the numbers differ."""
    llama = rmsnorm.derive(LlamaRMSNorm, _meta(LlamaRMSNorm, 16))
    fast = rmsnorm.compile_forward(LlamaRMSNorm, _forward(rmsnorm.rewritten_class(LlamaRMSNorm, llama)))
    instance = _meta(cls, 16)
    with pytest.raises(Refused) as refusal:
        rmsnorm.compare_forwards(instance, cls.forward, fast, "variance_epsilon", cls.__name__)
    assert refusal.value.rule == "norm-inexact"


def _forward(classdef: ast.ClassDef) -> ast.FunctionDef:
    return astutil.method(classdef, "forward")


def test_a_rewrite_reading_the_wrong_eps_is_caught_by_execution():
    instance = _meta(TwoNumbers, 16)
    plan = rmsnorm.derive(TwoNumbers, instance)
    assert plan.eps == "variance_epsilon"
    wrong = dataclasses.replace(plan, eps="other_epsilon")
    forward = _forward(rmsnorm.rewritten_class(TwoNumbers, plan))
    ast_text = ast.unparse(forward).replace("eps=self.variance_epsilon", "eps=self.other_epsilon")
    bad = rmsnorm.compile_forward(TwoNumbers, ast.parse(ast_text).body[0])
    with pytest.raises(Refused, match="output differs"):
        rmsnorm.compare_forwards(instance, TwoNumbers.forward, bad, wrong.eps, "TwoNumbers")


def test_a_rewrite_with_the_same_output_and_other_gradients_is_caught():
    """The outputs agree bit for bit, the gradients are halved: the check's backward pass (one pass through both
    graphs) must still tell them apart."""

    def half_gradient(self, hidden_states):
        out = LlamaRMSNorm.forward(self, hidden_states)
        return out.detach() + (out - out.detach()) * 0.5

    with pytest.raises(Refused, match="gradient differs") as refusal:
        rmsnorm.compare_forwards(_meta(LlamaRMSNorm, 16), LlamaRMSNorm.forward, half_gradient, "variance_epsilon", "L")
    assert refusal.value.rule == "norm-inexact"


def test_the_one_call_kernel_with_weight_is_not_llama_in_bfloat16():
    """`F.rms_norm(x, shape, weight, eps)` applies the weight before rounding to bfloat16, Llama after: the checker
    refuses it (which is why the emitted Llama form multiplies by the weight outside the kernel)."""

    def one_call(self, hidden_states):
        return F.rms_norm(hidden_states, hidden_states.shape[-1:], self.weight, self.variance_epsilon)

    with pytest.raises(Refused, match="bfloat16") as refusal:
        rmsnorm.compare_forwards(_meta(LlamaRMSNorm, 16), LlamaRMSNorm.forward, one_call, "variance_epsilon", "L")
    assert refusal.value.rule == "norm-inexact"


# --- the styles that are rewritten ---------------------------------------------------------------------------------


def _qwen3_q_norm():
    config = Qwen3Config(hidden_size=64, num_attention_heads=4, num_key_value_heads=2, head_dim=16)
    with torch.device("meta"):
        return Qwen3Attention(config, layer_idx=0).q_norm


ACCEPTED = {
    "llama": (LlamaRMSNorm, lambda: _meta(LlamaRMSNorm, 64), "cast-then-weight"),
    "olmo2": (Olmo2RMSNorm, lambda: _meta(Olmo2RMSNorm, 64), "weight-then-cast"),
    "gemma": (GemmaRMSNorm, lambda: _meta(GemmaRMSNorm, 64), "weight-then-cast"),
    "gemma3": (Gemma3RMSNorm, lambda: _meta(Gemma3RMSNorm, 64), "weight-then-cast"),
    "qwen3 q_norm (per head)": (Qwen3RMSNorm, _qwen3_q_norm, "cast-then-weight"),
    "spelled differently": (Spelled, lambda: _meta(Spelled, 64), "cast-then-weight"),
}


@pytest.mark.parametrize("name", list(ACCEPTED))
def test_rms_norm_styles_are_rewritten_bit_identically(name):
    cls, make, style = ACCEPTED[name]
    instance = make()
    plan = rmsnorm.derive(cls, instance)
    assert plan.style == style
    forward = ast.unparse(_forward(rmsnorm.rewritten_class(cls, plan)))
    assert forward.count(rmsnorm.KERNEL) == 1
    assert rmsnorm.check_exact(cls, instance, plan) > 300  # every case passed (a failing one raises)


def test_gemma_keeps_its_one_plus_weight_in_float32():
    plan = rmsnorm.derive(Gemma3RMSNorm, _meta(Gemma3RMSNorm, 8))
    fast = ast.unparse(_forward(rmsnorm.rewritten_class(Gemma3RMSNorm, plan)).body[0].body[0])  # the guarded return
    assert "x.to(torch.float32), x.shape[-1:], eps=self.eps)" in fast
    assert "(1.0 + self.weight.to(torch.float32))" in fast
    assert fast.rstrip().endswith(".to(x.dtype)")


def test_llama_keeps_its_original_statements_for_other_dtypes():
    """float64 input: the kernel would compute in float64 where Llama computes in float32; the guard sends it to the
    original statements, which the rewrite keeps below it."""
    plan = rmsnorm.derive(LlamaRMSNorm, _meta(LlamaRMSNorm, 8))
    forward = _forward(rmsnorm.rewritten_class(LlamaRMSNorm, plan))
    original = _forward(astutil.parse_class(LlamaRMSNorm))
    assert isinstance(forward.body[0], ast.If)
    assert [ast.dump(s) for s in forward.body[1:]] == [ast.dump(s) for s in original.body]
    norm = LlamaRMSNorm(8).double()
    x = torch.randn(3, 8, dtype=torch.float64)
    fast = rmsnorm.compile_forward(LlamaRMSNorm, forward)
    assert torch.equal(fast(norm, x), norm(x))
    assert not torch.equal(norm.weight * F.rms_norm(x, (8,), eps=norm.variance_epsilon), norm(x))


# --- values a config can put in the attributes the rewrite reads --------------------------------------------------


class Scaled(_Norm):
    """Llama's norm times a number the config sets (`self.scale`): the rewrite keeps reading it as the original does."""

    def __init__(self, hidden_size, eps=1e-6):
        super().__init__(hidden_size, eps)
        self.scale = 2.0

    def forward(self, hidden_states):
        input_dtype = hidden_states.dtype
        hidden_states = hidden_states.to(torch.float32)
        variance = hidden_states.pow(2).mean(-1, keepdim=True)
        hidden_states = hidden_states * torch.rsqrt(variance + self.variance_epsilon)
        return self.scale * (self.weight * hidden_states.to(input_dtype))


def _outcome(forward, module, x):
    """What calling `forward` does: `("value", output)` or `("raises", exception type, message)`."""
    try:
        return ("value", forward(module, x))
    except Exception as error:  # noqa: BLE001 - the outcome compared is the exception itself
        return ("raises", type(error), str(error))


def _same_outcome(expected, actual) -> bool:
    if expected[0] != actual[0]:
        return False
    if expected[0] == "raises":  # the same type (messages may differ: `.float()` is emitted as `.to(torch.float32)`)
        return expected[1] is actual[1]
    return expected[1].dtype == actual[1].dtype and torch.equal(expected[1], actual[1])


STYLES = {  # a class of each rewritten style (the eps attribute, the class)
    "llama (cast-then-weight)": ("variance_epsilon", LlamaRMSNorm),
    "olmo2 (weight-then-cast)": ("variance_epsilon", Olmo2RMSNorm),
    "gemma3 (1 + weight)": ("eps", Gemma3RMSNorm),
    "scaled": ("variance_epsilon", Scaled),
}
CONFIG_VALUES = {  # what `rms_norm_eps` (or `eps`) can hold in a config besides a float
    "None": None,
    "int 0": 0,
    "int 1": 1,
    "True": True,
    "a tensor": torch.tensor(1e-6),
    "a float64 tensor": torch.tensor(0.5, dtype=torch.float64),
}


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float64], ids=str)
@pytest.mark.parametrize("value", list(CONFIG_VALUES))
@pytest.mark.parametrize("style", list(STYLES))
def test_every_eps_a_config_can_carry_behaves_as_in_the_original(style, value, dtype):
    """eps=None: the original raises a TypeError, where `F.rms_norm(..., eps=None)` would quietly use the dtype's
    machine epsilon; other non-float values are not what the execution check ran. Whatever the value, the rewritten
    forward does what the original does: the same output bit for bit, or an exception of the same type."""
    eps, cls = STYLES[style]
    plan = rmsnorm.derive(cls, _meta(cls, 8))
    fast = rmsnorm.compile_forward(cls, _forward(rmsnorm.rewritten_class(cls, plan)))
    norm = cls(8)
    with torch.no_grad():
        norm.weight.normal_()
    setattr(norm, eps, CONFIG_VALUES[value])
    x = torch.randn(3, 8, generator=torch.Generator().manual_seed(0)).to(dtype)
    expected, actual = _outcome(type(norm).forward, norm, x), _outcome(fast, norm, x)
    assert _same_outcome(expected, actual), (expected, actual)


@pytest.mark.parametrize("style", list(STYLES))
def test_other_attributes_a_config_sets_behave_as_in_the_original(style):
    """The weight (None where a config builds the norm without one) and a number such as `Scaled.scale` (None, an int)
    are read by the same operations in the rewrite as in the original, so they do the same to both."""
    _, cls = STYLES[style]
    plan = rmsnorm.derive(cls, _meta(cls, 8))
    fast = rmsnorm.compile_forward(cls, _forward(rmsnorm.rewritten_class(cls, plan)))
    changes = [("weight", None)] + ([("scale", None), ("scale", 3)] if cls is Scaled else [])
    x = torch.randn(3, 8, generator=torch.Generator().manual_seed(0))
    for name, value in changes:
        norm = cls(8)
        setattr(norm, name, value)
        expected, actual = _outcome(type(norm).forward, norm, x), _outcome(fast, norm, x)
        assert _same_outcome(expected, actual), (name, value, expected, actual)


def test_the_rewrite_runs_the_kernel_for_a_float_eps_only():
    """The guard in the emitted text: a float eps (what `check_exact` executed) and, for Llama, an exact dtype."""
    plan = rmsnorm.derive(LlamaRMSNorm, _meta(LlamaRMSNorm, 8))
    guard = _forward(rmsnorm.rewritten_class(LlamaRMSNorm, plan)).body[0]
    assert ast.unparse(guard.test) == (
        "type(self.variance_epsilon) is float and hidden_states.dtype in (torch.float32, torch.bfloat16, torch.float16)"
    )
    plan = rmsnorm.derive(Gemma3RMSNorm, _meta(Gemma3RMSNorm, 8))
    forward = _forward(rmsnorm.rewritten_class(Gemma3RMSNorm, plan))
    original = _forward(astutil.parse_class(Gemma3RMSNorm))
    assert ast.unparse(forward.body[0].test) == "type(self.eps) is float"
    assert [ast.dump(s) for s in forward.body[1:]] == [ast.dump(s) for s in original.body]  # kept below the guard


# --- in the generated files ----------------------------------------------------------------------------------------

GENERATED = {
    "llama": ("generated.fused_llama", "LlamaConfig", "LlamaForCausalLM", "LlamaRMSNorm", {}),
    "qwen3": ("generated.fused_qwen3", "Qwen3Config", "Qwen3ForCausalLM", "Qwen3RMSNorm", {"head_dim": 16}),
    "gemma3_text": (
        "generated.fused_gemma3_text",
        "Gemma3TextConfig",
        "Gemma3ForCausalLM",
        "Gemma3RMSNorm",
        {"head_dim": 16, "sliding_window": 4},
    ),
}


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
@pytest.mark.parametrize("model_type", list(GENERATED))
def test_generated_fused_norms_change_no_bit_of_the_model(model_type, dtype):
    """The checked-in file's fused norms, swapped back for the original norm's forward in the same model with the
    same weights, give the same logits and the same gradients, bit for bit (per-head q/k norms included)."""
    import importlib
    import types

    import transformers

    from fusegen.compiler.validate import map_state
    from fusegen.testkit import random_model, small_config

    module_name, config_name, causal_lm, norm_name, overrides = GENERATED[model_type]
    fused_module = importlib.import_module(module_name)
    config = small_config(getattr(transformers, config_name), num_key_value_heads=2, **overrides)
    original = random_model(getattr(transformers, causal_lm), config)
    fused = getattr(fused_module, f"Fused{causal_lm}")(config)
    fused.load_state_dict(map_state(original, fused, fused_module.STACKED_PARAMS_MAPPING))
    fused = fused.to(dtype)
    original_norm = getattr(importlib.import_module(type(original).__module__), norm_name)
    norms = [m for m in fused.modules() if type(m).__name__ == f"Fused{norm_name}"]
    assert len(norms) >= 2 * config.num_hidden_layers + 1
    assert all(type(m).forward is not original_norm.forward for m in norms)
    input_ids = torch.randint(0, config.vocab_size, (2, 12), generator=torch.Generator().manual_seed(3))

    def logits_and_grads(swapped: bool):
        for norm in norms:
            if swapped:
                norm.forward = types.MethodType(original_norm.forward, norm)
            else:
                norm.__dict__.pop("forward", None)
        fused.zero_grad()
        logits = fused.train()(input_ids, use_cache=False).logits
        logits.float().square().mean().backward()
        return logits.detach(), {n: p.grad.clone() for n, p in fused.named_parameters() if p.grad is not None}

    torch.manual_seed(0)
    logits, grads = logits_and_grads(swapped=False)
    torch.manual_seed(0)
    expected_logits, expected_grads = logits_and_grads(swapped=True)
    assert torch.equal(logits, expected_logits)
    assert grads.keys() == expected_grads.keys() and len(grads) > 0
    assert all(torch.equal(grads[name], expected_grads[name]) for name in grads)


def test_generated_llama_equals_the_original_bitwise_in_float32():
    """Whole file against Transformers' LlamaForCausalLM, same weights, fp32: not one bit of the logits differs.

    The norm rewrite is exact by construction (the test above isolates it); the merged GEMMs are bit-identical to
    their pieces on this CPU at these sizes (bench/gemm.py checks the same), though the project's tolerance allows
    them not to be elsewhere: if this fails on another machine with the test above passing, the GEMMs differ.
    """
    import transformers

    from fusegen.compiler.validate import map_state
    from fusegen.testkit import random_model, small_config
    from generated.fused_llama import STACKED_PARAMS_MAPPING, FusedLlamaForCausalLM

    config = small_config(transformers.LlamaConfig, num_key_value_heads=2)
    original = random_model(transformers.LlamaForCausalLM, config)
    fused = FusedLlamaForCausalLM(config)
    fused.load_state_dict(map_state(original, fused, STACKED_PARAMS_MAPPING))
    assert any(type(m).__name__ == "FusedLlamaRMSNorm" for m in fused.modules())
    input_ids = torch.randint(0, config.vocab_size, (2, 12), generator=torch.Generator().manual_seed(4))
    with torch.no_grad():
        assert torch.equal(original(input_ids).logits, fused.eval()(input_ids).logits)


@pytest.mark.parametrize("value", ["None", "int 0", "a tensor"])
@pytest.mark.parametrize("model_type", list(GENERATED))
def test_generated_norms_treat_a_non_float_eps_as_the_original_does(model_type, value):
    """The checked-in files' norms built with an eps that is no float (None, on which the original raises; an int; a
    tensor) do what the original norm class does."""
    import importlib

    import transformers

    module_name, _, causal_lm, norm_name, _ = GENERATED[model_type]
    fused_norm = getattr(importlib.import_module(module_name), f"Fused{norm_name}")
    original_norm = getattr(importlib.import_module(getattr(transformers, causal_lm).__module__), norm_name)
    fused, original = fused_norm(8, eps=CONFIG_VALUES[value]), original_norm(8, eps=CONFIG_VALUES[value])
    x = torch.randn(3, 8, generator=torch.Generator().manual_seed(0))
    expected, actual = _outcome(type(original).forward, original, x), _outcome(type(fused).forward, fused, x)
    assert _same_outcome(expected, actual), (expected, actual)
