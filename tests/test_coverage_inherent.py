"""The coverage page names each case no change on our side makes pass, with its category and reason, and counts
them apart; each listed case is checked to still be what the page says."""

from __future__ import annotations

import importlib.util

import pytest
import torch

from fusegen.tools import coverage
from fusegen.tools.coverage import Inspection, Row

_GEMMA3N_ERROR = (
    "model type 'gemma3n': Gemma3nForConditionalGeneration cannot be built on the meta device from its default config "
    "(ImportError: TimmWrapperModel requires the PIL library but it was not found in your environment. "
    "TimmWrapperModel requires the timm library but it was not found in your environment.)"
)


def _row(model_type, status="nothing", error="", stops=()):
    classes = [{"class": name, "fused": [], "refused": [], "trace_stopped": why} for name, why in stops]
    return Row(model_type, status, {"classes": classes}, error, Inspection(), None)


def test_a_missing_library_is_an_inherent_environment_error_and_names_the_libraries():
    row = _row("gemma3n", "error", _GEMMA3N_ERROR)
    [(what, category, reason)] = coverage.inherent_cases(row)
    assert (what, category) == ("build", "environment")
    assert "PIL and timm" in reason and "gemma3n_text" in reason
    other = _row("x", "error", "model type 'x': its default config does not build (ValueError: bad)")
    assert coverage.inherent_cases(other) == []


def test_listed_trace_stops_are_inherent_and_others_are_not():
    listed = _row("big_bird", stops=[("BigBirdBlockSparseAttention", "ValueError: multiple of block size")])
    mixed = _row("phi4_multimodal", stops=[("Phi4MultimodalImageEmbedding", "x"), ("SomethingElse", "y")])
    assert [case[1] for case in coverage.inherent_cases(listed)] == ["meta-trace limit"]
    assert [case[1] for case in coverage.inherent_cases(mixed)] == ["data-dependent forward"]
    rows = [listed, mixed, _row("gemma3n", "error", _GEMMA3N_ERROR), _row("y", "error", "ValueError: bad")]
    counts = dict(coverage.summary_counts(rows))
    assert counts["types where a trace stopped early (some class)"] == 2
    assert counts["... of which every stop inherent (listed under 'Inherent cases')"] == 1
    assert counts["errors (input the compiler refuses, with a reason)"] == 2
    assert counts["... of which inherent (listed under 'Inherent cases', with the reason)"] == 1


def test_the_page_lists_each_inherent_case_with_its_category():
    text = coverage.render_markdown([_row("gemma3n", "error", _GEMMA3N_ERROR)])
    section = text.split("## Inherent cases, and why")[1].split("## ")[0]
    assert "- `gemma3n`, build: **environment**: the model needs the PIL and timm libraries" in section
    assert "None." in coverage.render_markdown([_row("llama")]).split("## Inherent cases, and why")[1]


def test_gemma3n_needs_timm_and_pil_on_the_original_class():
    """The original class alone, not our build: its vision tower is a TimmWrapperModel."""
    from transformers import Gemma3nConfig, Gemma3nForConditionalGeneration

    missing = [name for name in ("timm", "PIL") if importlib.util.find_spec(name) is None]
    if not missing:  # an environment with both: then it builds, and the case is no longer inherent here
        with torch.device("meta"):
            Gemma3nForConditionalGeneration(Gemma3nConfig())
        return
    with pytest.raises(ImportError, match="requires the .* library"), torch.device("meta"):
        Gemma3nForConditionalGeneration(Gemma3nConfig())


@pytest.mark.slow
@pytest.mark.parametrize(("model_type", "class_name"), sorted(coverage.INHERENT_STOPS))
def test_each_listed_inherent_stop_still_stops_there(model_type, class_name):
    from fusegen.compiler.build import analyse

    outcomes = {outcome.class_name: outcome for outcome in analyse(model_type).outcomes}
    assert outcomes[class_name].trace_error, f"{model_type} {class_name} traces now: drop it from INHERENT_STOPS"


def test_a_listed_skipped_verification_is_inherent_and_a_verified_one_is_not():
    from fusegen.tools.coverage.rows import Verification

    skipped = Row("llama4", "fused", {"classes": []}, "", Inspection(), Verification("skipped", reason="x"))
    verified = Row("llama4", "fused", {"classes": []}, "", Inspection(), Verification("verified"))
    other = Row("glm4v", "fused", {"classes": []}, "", Inspection(), Verification("skipped", reason="x"))
    assert [case[:2] for case in coverage.inherent_cases(skipped)] == [("verification", "upstream fault")]
    assert coverage.inherent_cases(verified) == coverage.inherent_cases(other) == []


@pytest.mark.slow
def test_llama4s_original_still_fails_on_every_forward():
    """The one listed skip (a new entry needs its own check here), on text alone and as a tuple too."""
    from fusegen.compiler.resolve import resolve
    from fusegen.testkit import random_input, random_model, tiny_config

    assert set(coverage.INHERENT_SKIPS) == {"llama4"}
    target = resolve("llama4")
    config = tiny_config(target)
    model = random_model(target.causal_lm, config)
    with pytest.raises(AttributeError, match="image_outputs"), torch.no_grad():
        model(input_ids=random_input(config), return_dict=False)
