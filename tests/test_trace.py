"""Tracing with the meta values a forward really receives (recorded by running the meta model once)."""

import pytest
import torch
from torch import nn

from fusegen.compiler.build import analyse
from fusegen.compiler.trace import record_inputs, trace_module
from fusegen.fusions.linear import find_groups


class _Rotary(nn.Module):
    def forward(self, x):
        return x.new_ones(x.shape[:-1] + (4,)), x.new_zeros(x.shape[:-1] + (4,))


class _Attention(nn.Module):
    """Unpacks a tuple argument before its projections, as most rotary attentions do."""

    def __init__(self):
        super().__init__()
        self.q_proj = nn.Linear(8, 8)
        self.k_proj = nn.Linear(8, 8)
        self.v_proj = nn.Linear(8, 8)

    def forward(self, hidden_states, position_embeddings, cache=None, **kwargs):
        cos, sin = position_embeddings
        if kwargs["flag"]:
            hidden_states = hidden_states * cos.sum() + sin.sum()
        return self.q_proj(hidden_states) + self.k_proj(hidden_states) + self.v_proj(hidden_states)


class _Model(nn.Module):
    def __init__(self):
        super().__init__()
        self.embed = nn.Embedding(16, 8)
        self.rotary = _Rotary()
        self.attention = _Attention()
        self.unused = _Attention()

    def forward(self, input_ids):
        hidden_states = self.embed(input_ids)
        return self.attention(hidden_states, self.rotary(hidden_states), flag=True)


def _meta_model():
    with torch.device("meta"):
        return _Model()


def test_synthetic_inputs_stop_at_the_tuple():
    trace = trace_module(_meta_model().attention)
    assert "the length of position_embeddings is not known" in trace.error
    # the stop says why the trace had no real inputs, so the report can tell a class the forward never reached
    assert trace.error.endswith("(traced with synthetic inputs: the model's meta forward never reached it)")


def test_a_recorded_trace_that_stops_does_not_get_the_synthetic_note():
    model = _meta_model()
    recorded = record_inputs(model, [model.attention])
    args, kwargs = recorded[id(model.attention)]
    trace = trace_module(model.attention, (args, {**kwargs, "flag": torch.ones(1, device="meta")}))
    assert trace.error is not None and "synthetic" not in trace.error


def test_recorded_inputs_unpack_the_tuple_and_find_the_group():
    model = _meta_model()
    recorded = record_inputs(model, [model.attention, model.unused])
    assert id(model.unused) not in recorded  # never called: falls back to synthetic inputs
    args, kwargs = recorded[id(model.attention)]
    assert isinstance(args[1], tuple) and kwargs == {"flag": True}
    trace = trace_module(model.attention, recorded[id(model.attention)])
    assert trace.error is None
    assert [plan.merged for plan in find_groups(trace.graph, model.attention)] == ["qkv_proj"]


def test_recording_restores_modes_and_survives_a_failing_forward():
    model = _meta_model().train()

    def fail(module, args, kwargs):
        raise RuntimeError("no meta kernel")

    model.rotary.register_forward_pre_hook(fail, with_kwargs=True)
    recorded = record_inputs(model, [model.attention])
    assert recorded == {}
    assert all(module.training for module in model.modules())
    assert all(not module._forward_pre_hooks for module in (model.attention, model.unused))


class _MaskedAttention(_Attention):
    """Branches on a tensor's contents, which no meta value knows, when given a mask."""

    def forward(self, hidden_states, mask=None):
        if mask is not None and mask.any():
            hidden_states = hidden_states * 2
        return self.q_proj(hidden_states) + self.k_proj(hidden_states) + self.v_proj(hidden_states)


def test_a_recorded_trace_that_sees_less_than_the_synthetic_one_is_not_kept():
    with torch.device("meta"):
        module = _MaskedAttention()
        recorded = ((torch.empty(2, 3, 8),), {"mask": torch.empty(2, 3, dtype=torch.bool)})
    trace = trace_module(module, recorded)
    assert trace.error is None  # the synthetic trace: mask left at its default
    assert [plan.merged for plan in find_groups(trace.graph, module)] == ["qkv_proj"]


def test_arguments_the_forward_does_not_take_fall_back_to_synthetic_inputs():
    with torch.device("meta"):
        module = _MaskedAttention()
    trace = trace_module(module, ((torch.empty(2, 3, 8),), {"renamed_by_a_decorator": None}))
    assert [plan.merged for plan in find_groups(trace.graph, module)] == ["qkv_proj"]


@pytest.mark.slow
@pytest.mark.parametrize(
    ("model_type", "class_name"),
    [
        ("codegen", "CodeGenAttention"),  # cos, sin = position_embeddings
        ("bloom", "BloomAttention"),  # the cache is updated in place by the recorded call
        ("mpt", "MptAttention"),
        ("zamba2", "Zamba2MLP"),  # KeyError: None with synthetic inputs
        ("nemotron_h", "NemotronHMamba2Mixer"),  # torch.ones(n, device=x.device) with n read off a shape
    ],
)
def test_traces_that_used_to_stop_reach_the_end(model_type, class_name):
    outcomes = {outcome.class_name: outcome for outcome in analyse(model_type).outcomes}
    assert outcomes[class_name].trace_error is None


@pytest.mark.slow
def test_gemma4_attention_is_traced_to_its_qkv_group():
    outcome = next(o for o in analyse("gemma4_text").outcomes if o.class_name == "Gemma4TextAttention")
    assert outcome.trace_error is None
    # Found, and fused although k_proj/v_proj are built in a nested block (fusegen/fusions/merged/rewrite_nested.py).
    assert [plan.projections for plan in outcome.fused] == [("q_proj", "k_proj", "v_proj")] and not outcome.refused


def test_moe_layers_do_not_end_the_recording():
    from fusegen.compiler.instantiate import candidates, instantiate
    from fusegen.compiler.resolve import resolve

    model = instantiate(resolve("jamba"))
    found = candidates(model)
    recorded = record_inputs(model, list(found.values()))
    # JambaAttention sits past MoE layers: grouped_mm wants bf16 and the eager loop reads the routing on meta.
    assert {cls.__name__ for cls, instance in found.items() if id(instance) in recorded} >= {"JambaAttention"}
    assert model.config._experts_implementation != "batched_mm"


def test_report_names_a_trace_stop_even_when_the_class_fused_something():
    from types import SimpleNamespace

    from fusegen.core.plan import ClassOutcome, FusionPlan
    from fusegen.tools.report import report_text

    plan = FusionPlan("glu", "gate_up_proj", (("gate_proj", 0), ("up_proj", 1)))
    outcome = ClassOutcome("XMLP", [plan], [], "TraceStopped: control flow depends on the traced value eq")
    target = SimpleNamespace(source="x", module=SimpleNamespace(__name__="modeling_x"))
    text = report_text([SimpleNamespace(target=target, outcomes=[outcome])])
    assert "XMLP: fused gate_proj + up_proj -> gate_up_proj (glu)" in text
    assert "XMLP: trace stopped early (TraceStopped: control flow depends on the traced value eq)" in text


class _CacheFailingModel(_Model):
    """Its default cache fails before the first layer, as hybrid models' caches do on `get_seq_length`."""

    def forward(self, input_ids, use_cache=True):
        if use_cache:
            raise ValueError("`get_seq_length` can only be called on Attention layers")
        return super().forward(input_ids)


def test_a_forward_that_fails_with_its_cache_is_recorded_without_it():
    with torch.device("meta"):
        model = _CacheFailingModel()
    recorded = record_inputs(model, [model.attention])
    assert id(model.attention) in recorded
    assert trace_module(model.attention, recorded[id(model.attention)]).error is None


class _GatedNorm(nn.Module):
    """A norm with no linear child whose forward unpacks its input's shape (Bamba's gated RMS norm)."""

    def __init__(self):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(8))

    def forward(self, hidden_states, gate=None):
        *prefix_dims, last_dim = hidden_states.shape
        return self.weight * hidden_states.view(*prefix_dims, 2, last_dim // 2).view(*prefix_dims, last_dim)


def test_a_norm_never_reached_gets_synthetic_hidden_states_as_wide_as_its_weight():
    with torch.device("meta"):
        norm = _GatedNorm()
    assert trace_module(norm).error is None


@pytest.mark.slow
@pytest.mark.parametrize(
    ("model_type", "class_name"),
    [
        ("bamba", "BambaRMSNormGated"),  # the default cache fails the meta forward before any layer
        ("granitemoehybrid", "GraniteMoeHybridRMSNormGated"),
        ("dbrx", "DbrxAttention"),  # the default config's clip_qkv=None fails the clamp
        (
            "mllama:causal-lm",
            "MllamaTextCrossAttention",
        ),  # skipped by the text-only forward: given cross-attention states
        ("blt", "BltCrossAttention"),
        ("xlm:causal-lm", "MultiHeadAttention"),  # the model asserts on `lengths.max().item()`: given a mask
        ("moss_transcribe_diarize", "MossTranscribeDiarizeAudioLayer"),  # audio only: given no mask
        ("got_ocr2", "GotOcr2VisionAttention"),  # vision only: given (batch, height, width, channels)
        ("gemma3n_text", None),  # its ModuleList of altup projections is no candidate any more
        ("gemma4_assistant", "Gemma4TextAttention"),  # recorded with a backbone's states, which it needs
        ("gemma4_unified_assistant", "Gemma4UnifiedAssistantForCausalLM"),  # iterates shared_kv_states.items()
        ("musicgen", None),
    ],
)
def test_trace_stops_of_the_coverage_sweep_are_gone(model_type, class_name):
    outcomes = {outcome.class_name: outcome for outcome in analyse(model_type).outcomes}
    assert class_name is None or class_name in outcomes
    assert [(name, o.trace_error) for name, o in outcomes.items() if o.trace_error] == []


class _CrossAttention(nn.Module):
    """Reads encoder states for k/v; with the default (None) it would read a cache the synthetic trace lacks."""

    def __init__(self):
        super().__init__()
        self.q_proj = nn.Linear(8, 8)
        self.k_proj = nn.Linear(8, 8)
        self.v_proj = nn.Linear(8, 8)

    def forward(self, hidden_states, cross_attention_states=None, cache=None):
        if cross_attention_states is None:
            cross_attention_states = cache.layers[0].keys
        return self.q_proj(hidden_states), self.k_proj(cross_attention_states) + self.v_proj(cross_attention_states)


class _RankAskingAttention(_Attention):
    """Asks its required mask's rank before the projections (XLM's MultiHeadAttention)."""

    def forward(self, input, mask):
        shape = (2, 1, 3, -1) if mask.dim() == 3 else (2, 1, 1, -1)
        hidden_states = input * mask.view(shape[0], -1, 1)
        return self.q_proj(hidden_states) + self.k_proj(hidden_states) + self.v_proj(hidden_states)


class _Layer(nn.Module):
    """Unpacks its attention's pair of outputs; the mask it must be given is passed through."""

    def __init__(self):
        super().__init__()
        self.self_attn = _PairAttention()
        self.fc1 = nn.Linear(8, 8)
        self.fc2 = nn.Linear(8, 8)

    def forward(self, hidden_states, attention_mask):
        hidden_states, _ = self.self_attn(hidden_states, attention_mask=attention_mask)
        return self.fc2(self.fc1(hidden_states))


class _PairAttention(_Attention):
    def forward(self, hidden_states, attention_mask=None):
        if attention_mask is not None:
            hidden_states = hidden_states.masked_fill(attention_mask[:, None, None, :], 0.0)
        return self.q_proj(hidden_states) + self.k_proj(hidden_states) + self.v_proj(hidden_states), None


class _WindowedVisionAttention(nn.Module):
    """Takes `(batch, height, width, channels)`, as SAM's and GOT-OCR2's vision attentions do."""

    def __init__(self):
        super().__init__()
        self.qkv = nn.Linear(8, 24)
        self.proj = nn.Linear(8, 8)

    def forward(self, hidden_states):
        batch, height, width, _ = hidden_states.shape
        q, k, v = self.qkv(hidden_states).reshape(batch, height * width, 3, 8).unbind(2)
        return self.proj(q + k + v)


@pytest.mark.parametrize(
    ("module_class", "calls"),
    [
        (_CrossAttention, ["q_proj", "k_proj", "v_proj"]),  # given encoder states
        (_RankAskingAttention, ["q_proj", "k_proj", "v_proj"]),  # given a (batch, length) mask
        (_Layer, ["self_attn", "fc1", "fc2"]),  # given no mask (None), so its attention's result has a length
        (_WindowedVisionAttention, ["qkv", "proj"]),  # given image-shaped hidden states
    ],
)
def test_synthetic_inputs_with_the_structure_a_class_needs_trace_to_the_end(module_class, calls):
    with torch.device("meta"):
        module = module_class()
    trace = trace_module(module)
    assert trace.error is None
    assert [node.target for node in trace.graph.nodes if node.op == "call_module"] == calls


def test_the_cross_attention_group_is_found_from_the_encoder_states():
    with torch.device("meta"):
        module = _CrossAttention()
    groups = find_groups(trace_module(module).graph, module)
    assert [plan.projections for plan in groups] == [("k_proj", "v_proj")]


class _DictReader(_Attention):
    """Rebuilds a recorded dict from its items before reading an entry (the Gemma 4 assistants' shared k/v)."""

    def forward(self, hidden_states, shared):
        shared = {key: (value[0] * 1, value[1]) for key, value in shared.items()}
        keys = list(shared.keys())
        hidden_states = hidden_states + shared[keys[0]][0] + sum(v[1] for v in shared.values())
        return self.q_proj(hidden_states) + self.k_proj(hidden_states) + self.v_proj(hidden_states)


def test_a_recorded_dict_is_iterated_by_its_keys_items_and_values():
    with torch.device("meta"):
        module = _DictReader()
        states = torch.empty(2, 3, 8)
        recorded = ((states,), {"shared": {"full_attention": (states, states), "sliding_attention": (states, states)}})
    trace = trace_module(module, recorded)
    assert trace.error is None
    assert [plan.merged for plan in find_groups(trace.graph, module)] == ["qkv_proj"]


def test_recording_stops_the_forward_once_every_module_has_its_call_and_records_the_same():
    from fusegen.compiler.instantiate import candidates, instantiate
    from fusegen.compiler.resolve import resolve

    model = instantiate(resolve("llama"))  # the default config: 32 layers on meta
    found = list(candidates(model).values())
    last = model.model.layers[-1].self_attn
    ran = []
    handle = last.register_forward_pre_hook(lambda module, args: ran.append(module))
    try:
        recorded = record_inputs(model, found)
    finally:
        handle.remove()
    assert {id(module) for module in found} <= recorded.keys()
    assert ran == []  # the last layer never ran: the forward ended in the first layer
    full = record_inputs(model, [*found, last])  # `last` is reached only by running every layer
    for module in found:
        assert _described(recorded[id(module)]) == _described(full[id(module)]), type(module).__name__


def _described(value):
    """`value` (a recorded `(args, kwargs)`) with every tensor as its (type, shape, dtype, device) and every other
    leaf as its type, through tuples, lists and dicts (keys kept, order included): what a trace is made from."""
    if isinstance(value, torch.Tensor):
        return (type(value), tuple(value.shape), value.dtype, value.device.type)
    if isinstance(value, (tuple, list)):
        return (type(value), [_described(item) for item in value])
    if isinstance(value, dict):
        return (type(value), [(key, _described(item)) for key, item in value.items()])
    return type(value)
