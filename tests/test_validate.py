"""Build-time translation validation: a generated file that computes something else is caught and not written."""

import re
import sys

import pytest
import torch
from transformers import conversion_mapping

import fusegen.compiler.build
from fusegen.compiler.build import build
from fusegen.compiler.resolve import resolve
from fusegen.compiler.validate import Check, check_config, construction_variants, validate
from fusegen.testkit import TOLERANCE, tiny_config

pytestmark = pytest.mark.slow  # builds llama with validation several times

GLU_LINE = "down_proj = self.down_proj(self.act_fn(gate_proj_out) * up_proj_out)"
GLU_SWAPPED = "down_proj = self.down_proj(self.act_fn(up_proj_out) * gate_proj_out)"
MAPPING_LINE = '"gate_up_proj": [("gate_proj", 0), ("up_proj", 1)],'
MAPPING_SWAPPED = '"gate_up_proj": [("up_proj", 0), ("gate_proj", 1)],'
QKV_BIAS = "            bias=config.attention_bias,\n        )"


@pytest.fixture(scope="module")
def llama():
    result = build("llama")
    assert result.text is not None and result.validation.mismatch is None, result.validation.describe()
    return result


def test_llama_passes_on_the_tiny_config_and_its_variants(llama):
    checks = {check.config: check for check in llama.validation.checks}
    assert {"tiny", "attention_bias=True", "mlp_bias=True", "num_key_value_heads=1"} <= set(checks), checks
    for check in checks.values():
        assert check.status == "passed", check
        assert check.logits_diff <= TOLERANCE and check.grad_diff is not None, check


@pytest.mark.parametrize(
    "old, new, figure",
    [(GLU_LINE, GLU_SWAPPED, "max abs logit diff"), (MAPPING_LINE, MAPPING_SWAPPED, "max abs logit diff")],
    ids=["forward-operands-swapped", "mapping-order-swapped"],
)
def test_a_miscompiled_text_is_a_mismatch_with_its_figure(llama, old, new, figure):
    assert old in llama.text
    validation = validate(llama.target, llama.text.replace(old, new))
    mismatch = validation.mismatch
    assert mismatch is not None and mismatch.config == "tiny", validation.describe()
    assert figure in mismatch.detail, mismatch.detail
    # the random weights keep activations of order 1, so a real fault shows far above the rounding tolerance
    assert float(re.search(r"diff (\S+) >", mismatch.detail).group(1)) > 1000 * TOLERANCE, mismatch.detail


def test_a_fault_only_one_variant_shows_is_caught_under_that_variant(llama):
    """The merged q/k/v constructor loses its bias flag: right for the tiny config, wrong with attention_bias=True."""
    assert QKV_BIAS in llama.text
    validation = validate(llama.target, llama.text.replace(QKV_BIAS, "            bias=False,\n        )", 1))
    mismatch = validation.mismatch
    assert mismatch is not None and mismatch.config == "attention_bias=True", validation.describe()
    assert validation.checks[0].status == "passed"
    assert "q_proj.bias" in mismatch.detail, mismatch.detail


def test_a_generated_module_that_does_not_import_is_a_mismatch(llama):
    validation = validate(llama.target, llama.text + "\nraise RuntimeError('broken file')\n")
    assert validation.mismatch is not None and "does not import" in validation.mismatch.detail


def test_build_refuses_the_class_at_fault_and_keeps_the_rest(monkeypatch):
    """The MLP's text computes something else: the retry without the MLP's fusion validates and is what is built."""
    render = fusegen.compiler.build.render
    monkeypatch.setattr(
        fusegen.compiler.build, "render", lambda **context: render(**context).replace(GLU_LINE, GLU_SWAPPED)
    )
    result = build("llama")
    assert result.text is not None and result.validation.mismatch is None, result.validation.describe()
    assert GLU_SWAPPED not in result.text and "gate_up_proj" not in result.text
    fused = {outcome.class_name: [plan.merged for plan in outcome.fused] for outcome in result.outcomes}
    assert fused["LlamaAttention"] == ["qkv_proj"] and fused["LlamaMLP"] == []
    (refusal,) = [r for o in result.outcomes if o.class_name == "LlamaMLP" for r in o.refused]
    assert refusal.rule == "validation-mismatch" and refusal.projections == ("gate_proj", "up_proj")
    assert "tiny config" in refusal.reason and "max abs logit diff" in refusal.reason, refusal.reason
    assert "validation-mismatch" in result.text  # the header says why the MLP was left unfused


def test_build_refuses_every_fusion_and_writes_nothing_when_no_single_class_is_to_blame(monkeypatch):
    render = fusegen.compiler.build.render

    def broken(**context):  # every class broken: appended code that fails the module import
        return render(**context) + "\nraise RuntimeError('broken file')\n"

    monkeypatch.setattr(fusegen.compiler.build, "render", broken)
    result = build("llama")
    assert result.text is None
    refusals = [(outcome.class_name, r) for outcome in result.outcomes for r in outcome.refused]
    assert {name for name, _ in refusals} >= {"LlamaAttention", "LlamaMLP"}
    for _, refusal in refusals:
        assert refusal.rule == "validation-mismatch"
        assert "does not import" in refusal.reason, refusal.reason
    assert not any(outcome.fused for outcome in result.outcomes)


def test_validation_leaves_no_trace(llama):
    """No module, no registered checkpoint conversion, no RNG draw and no thread setting survive a validation."""
    conversion_mapping.get_checkpoint_conversion_mapping("llama")
    registered = dict(conversion_mapping._checkpoint_conversion_mapping_cache)
    user = set(conversion_mapping.USER_REGISTERED_MAPPINGS)
    threads = torch.get_num_threads()
    torch.manual_seed(123)
    expected = torch.rand(3)
    torch.manual_seed(123)
    validate(llama.target, llama.text)
    assert torch.equal(torch.rand(3), expected)
    assert conversion_mapping._checkpoint_conversion_mapping_cache == registered
    assert conversion_mapping.USER_REGISTERED_MAPPINGS == user
    assert torch.get_num_threads() == threads
    assert not [name for name in sys.modules if name.startswith("fusegen_validating_")]


@pytest.mark.parametrize(
    "model_type, expected",
    [
        ("llama", {"attention_bias=True", "mlp_bias=True", "tie_word_embeddings=True"}),
        ("deepseek_v3", {"q_lora_rank=None", "first_k_dense_replace=0"}),
        ("qwen3_moe", {"mlp_only_layers=[0]"}),
    ],
)
def test_construction_variants_are_the_fields_that_change_the_model(model_type, expected):
    target = resolve(model_type)
    config = tiny_config(target)
    labels = [label for label, _ in construction_variants(target, config, limit=10)]
    assert expected <= set(labels), labels
    fields = {label.partition("=")[0] for label in labels}
    assert not fields & {"use_cache", "rms_norm_eps", "attention_dropout", "pretraining_tp"}, labels


def test_a_config_the_original_cannot_run_is_skipped_not_passed():
    class Broken(torch.nn.Module):
        def __init__(self, config):
            raise ValueError("this config is not supported")

    target = resolve("llama")
    check = check_config("x=1", Broken, None, tiny_config(target), {}, set())
    assert check == Check("x=1", "skipped", check.detail) and "not supported" in check.detail


def test_check_fails_when_a_checked_in_file_no_longer_validates(monkeypatch, tmp_path, capsys):
    from fusegen.cli import main

    render = fusegen.compiler.build.render
    (tmp_path / "fused_llama.py").write_text("# an old file\n")
    monkeypatch.setattr(
        fusegen.compiler.build, "render", lambda **context: render(**context) + "\nraise RuntimeError('x')\n"
    )
    assert main(["build", "--check", "llama", "--output-dir", str(tmp_path)]) == 1
    captured = capsys.readouterr()
    assert "validation-mismatch" in captured.out and "is stale" in captured.err


def test_the_one_logits_rule_scales_with_the_logits_and_never_drops_below_tolerance():
    """`logits_tolerance` (re-exported by the test kit) is what validation, the tests and the benches hold logits to."""
    from fusegen.compiler.validate import _logits_diff, _Mismatch
    from fusegen.testkit import logits_tolerance

    assert logits_tolerance(torch.tensor([0.25, -0.5])) == TOLERANCE
    assert logits_tolerance(torch.tensor([[1.0, -4.0]])) == 4 * TOLERANCE
    expected = torch.tensor([4.0, -1.0])
    assert _logits_diff(expected, expected + 3.9 * TOLERANCE, "x") == pytest.approx(3.9 * TOLERANCE, rel=1e-2)
    with pytest.raises(_Mismatch, match="> 4e-05"):
        _logits_diff(expected, expected + 4.1 * TOLERANCE, "x")
