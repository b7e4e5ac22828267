"""Refusals decided outside one class: checkpoints already merged, fused classes the model never builds."""

import pytest

from fusegen.compiler.build import analyse, build
from fusegen.core.plan import Veto
from fusegen.fusions.merged import rules as merged_rules


def rules(outcomes):
    return {(outcome.class_name, refusal.rule) for outcome in outcomes for refusal in outcome.refused}


def test_checkpoint_that_already_stores_qkv_merged_is_refused():
    # sarvam_moe checkpoints hold `query_key_value`, which Transformers splits into q/k/v on load.
    outcomes = analyse("sarvam_moe").outcomes
    assert ("Glm4MoeAttention", "checkpoint-already-fused") in rules(outcomes)
    assert any(plan.merged == "gate_up_proj" for outcome in outcomes for plan in outcome.fused)


@pytest.mark.slow
def test_class_built_from_a_config_of_any_type_is_reached_through_a_dispatch_not_refused():
    # GotOcr2Model builds AutoModel.from_config(config.text_config), and GotOcr2Config declares its text part as
    # AutoConfig: the fused file dispatches on the text config's type (tests/test_class_tables.py checks both
    # branches), so the Qwen2 fusions are no longer unreachable; `report` (the analysis alone) agrees.
    result = build("got_ocr2")
    assert ("Qwen2Attention", "unreachable") not in rules(result.outcomes)
    assert "FusedQwen2Model._from_config(config.text_config)" in result.text
    assert ("Qwen2Attention", "unreachable") not in rules(analyse("got_ocr2").outcomes)


@pytest.mark.slow
def test_pretrained_base_inherits_the_runtime_mixin_and_carries_no_added_methods():
    text = build("llama").text
    assert "class FusedLlamaPreTrainedModel(FusedPreTrainedMixin, PreTrainedModel):" in text
    for method in ("from_pretrained", "save_pretrained", "load_adapter", "load_weights", "init_parallel_plans"):
        assert f"def {method}(" not in text, method


def test_projection_reached_from_another_class_is_refused():
    # ModernBertDecoderPreTrainedModel._init_weights reads `module.q_proj`, which a fused attention lacks.
    outcomes = analyse("modernbert-decoder").outcomes
    assert ("ModernBertDecoderAttention", "outside-reference") in rules(outcomes)


def test_projection_named_like_another_fusions_merged_linear_is_refused(monkeypatch):
    # MiniMax lightning layers hold a packed qkv_proj; the full-attention layers merge q/k/v into qkv_proj.
    # `region-call` (its `output.append(...)` between the projections) refuses the lightning layer's group first;
    # switched off, the build-level rule this test is about must still catch the name clash.
    monkeypatch.setattr(merged_rules, "DISABLED", frozenset({"region-call"}))
    outcomes = analyse("minimax").outcomes
    assert ("MiniMaxLightningAttention", "ambiguous-checkpoint-names") in rules(outcomes)
    assert any(plan.merged == "qkv_proj" for o in outcomes if o.class_name == "MiniMaxAttention" for plan in o.fused)


def test_a_veto_carries_its_rule_id_as_data():
    # The rule comes from the veto itself, never from its wording: a reason no rule's message resembles keeps the
    # rule it was given (before, the rule was guessed from the reason's text and this came back as another rule).
    veto = Veto("some-new-rule", "a reason worded like no other rule's")
    outcomes = analyse("llama", refused={"LlamaAttention": {"qkv_proj": veto}}).outcomes
    (attention,) = [o for o in outcomes if o.class_name == "LlamaAttention"]
    assert [(r.projections, r.rule, r.reason) for r in attention.refused] == [
        (("q_proj", "k_proj", "v_proj"), "some-new-rule", "a reason worded like no other rule's")
    ]
    assert [plan.merged for o in outcomes for plan in o.fused if plan.shards] == ["gate_up_proj"]


def test_a_refusal_quoting_a_multi_line_statement_stays_one_header_comment_line():
    # CpmAntLayerNorm's forward starts with an `assert`, which the norm kind's refusal quotes as `if ...: raise ...`.
    text = build("cpmant", validate=False).text
    refused = [line for line in text.splitlines() if line.startswith("#   CpmAntLayerNorm:")]
    assert len(refused) == 1 and "raise AssertionError" in refused[0]
    compile(text, "fused_cpmant.py", "exec")
