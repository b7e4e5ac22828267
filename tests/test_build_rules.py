"""Refusals decided outside one class: checkpoints already merged, fused classes the model never builds."""

from fusegen.build import analyse, build


def rules(outcomes):
    return {(outcome.class_name, refusal.rule) for outcome in outcomes for refusal in outcome.refused}


def test_checkpoint_that_already_stores_qkv_merged_is_refused():
    # sarvam_moe checkpoints hold `query_key_value`, which Transformers splits into q/k/v on load.
    outcomes = analyse("sarvam_moe").outcomes
    assert ("Glm4MoeAttention", "checkpoint-already-fused") in rules(outcomes)
    assert any(plan.merged == "gate_up_proj" for outcome in outcomes for plan in outcome.fused)


def test_class_built_through_auto_model_from_config_is_refused_as_unreachable():
    # Gemma4Model builds AutoModel.from_config(config.text_config): a fused text MLP would never be used.
    result = build("gemma4")
    refusals = {(o.class_name, r.rule): r.reason for o in result.outcomes for r in o.refused}
    assert "`AutoModel.from_config(config.text_config)` in Gemma4Model.__init__" in refusals[
        ("Gemma4TextMLP", "unreachable")
    ]
    assert result.text is None or "FusedGemma4TextMLP" not in result.text
    # `report` (the analysis alone) says so too.
    assert ("Gemma4TextMLP", "unreachable") in rules(analyse("gemma4").outcomes)


def test_transformers_models_declare_themselves_library_code():
    text = build("llama").text
    assert "def is_custom_code(cls):" in text


def test_projection_reached_from_another_class_is_refused():
    # ModernBertDecoderPreTrainedModel._init_weights reads `module.q_proj`, which a fused attention lacks.
    outcomes = analyse("modernbert-decoder").outcomes
    assert ("ModernBertDecoderAttention", "outside-reference") in rules(outcomes)
