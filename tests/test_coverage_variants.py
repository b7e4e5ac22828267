"""Coverage verifies under config variants: a fault only a variant exercises fails the type, and the summary
sorts fusions into attention / MLP / norm and counts trace stops and unreachable fusions apart."""

from __future__ import annotations

import pytest

from fusegen.tools import coverage
from fusegen.tools.coverage import ConfigCheck, Inspection, Row, Verification, markdown, verification


@pytest.fixture(scope="module")
def llama_text():
    from fusegen.compiler.build import build

    return build("llama").text


def test_a_fault_only_a_variant_exercises_fails_the_type(llama_text):
    # Drop the merged q/k/v bias: the tiny config has attention_bias=False, so it still verifies there; the
    # attention_bias=True variant's checkpoint holds q/k/v biases the fused model cannot take.
    broken = llama_text.replace(
        "],\n            bias=config.attention_bias,\n        )", "],\n            bias=False,\n        )"
    )
    assert broken != llama_text
    tiny_only = coverage.verify("llama", broken, variants=0)
    assert tiny_only["status"] == "verified", tiny_only
    assert [check["config"] for check in tiny_only["checks"]] == ["tiny"]
    result = coverage.verify("llama", broken)
    assert result["status"] == "failed", result
    assert result["reason"].startswith("under attention_bias=True: fused from_pretrained"), result["reason"]
    assert coverage.verify("llama", llama_text)["status"] == "verified"


def test_the_limit_leaves_variants_out_and_says_which(llama_text):
    result = coverage.verify("llama", llama_text, variants=1)
    assert result["status"] == "verified"
    assert [check["config"] for check in result["checks"]] == ["tiny", "attention_bias=True"]
    assert "num_key_value_heads=1" in result["left_out"]


def check(config, status="verified", **kw):
    return ConfigCheck(config, status, max_abs_diff=kw.pop("diff", 0.0), greedy=kw.pop("greedy", "same"), **kw)


def test_combined_verdict():
    merging = {"FusedA"}
    ok = verification._combined([check("tiny", exercised=["FusedA"]), check("x=1", diff=2e-6)], [], merging)
    assert (ok.status, ok.max_abs_diff, ok.greedy, ok.reason) == ("verified", 2e-6, "same", "")
    bad = verification._combined(
        [check("tiny"), check("x=1", "mismatch", reason="max abs logit diff 0.1 > 1e-05")], [], merging
    )
    assert bad.status == "mismatch" and bad.reason == "under x=1: max abs logit diff 0.1 > 1e-05"
    skipped = verification._combined(
        [check("tiny", exercised=["FusedA"]), check("x=1", "skipped", reason="no")], [], merging
    )
    assert skipped.status == "verified" and "skipped, the original does not run: x=1 (no)" in skipped.reason
    unexercised = verification._combined([check("tiny"), check("x=1")], [], merging)
    assert "in none of the configs: FusedA" in unexercised.reason
    tiny_skipped = verification._combined([check("tiny", "skipped", reason="no tiny model")], [], merging)
    assert tiny_skipped.status == "skipped" and tiny_skipped.reason == "no tiny model"


def row(classes, status="fused", verification=None, already=None):
    return Row("toy", status, {"classes": classes}, "", Inspection(already_fused=already or {}), verification)


def outcome(name, fused=(), refused=(), trace=None):
    return {
        "class": name,
        "fused": [
            {"kind": kind, "merged": merged, "shards": [[p, i] for i, p in enumerate(ps)]}
            for kind, merged, ps in fused
        ],
        "refused": [{"projections": list(ps), "rule": rule, "reason": "why", "line": None} for ps, rule in refused],
        "trace_stopped": trace,
    }


def test_summary_sorts_fusions_into_parts_and_counts_trace_stops_and_unreachable_apart():
    verified = Verification(
        "verified",
        0.0,
        "same",
        checks=[{"config": "tiny", "status": "verified"}, {"config": "b=1", "status": "verified"}],
    )
    rows = [
        row(
            [
                outcome("ToyAttention", fused=[("merged_column", "kv_proj", ["k_proj", "v_proj"])]),
                outcome("ToyMLP", refused=[(["gate_proj", "up_proj"], "unreachable")]),
                outcome("ToyRMSNorm", fused=[("rms_norm", "norm", ["weight"])]),  # a norm kind, read generically
            ],
            verification=verified,
        ),
        row(
            [outcome("PackedAttention", trace="TraceStopped: the length of x is not known")],
            "nothing",
            None,
            {"PackedAttention": ["c_attn"]},
        ),
    ]
    assert [coverage.part_cell(rows[0], part) for part in coverage.PARTS] == [
        "fused",
        "refused: unreachable",
        "fused",
        "",
    ]
    assert coverage.part_cell(rows[1], "attention") == "packed"
    assert coverage.trace_stops(rows[1]) == [("PackedAttention", "TraceStopped: the length of x is not known")]
    counts = dict(coverage.summary_counts(rows))
    assert counts["types where a trace stopped early (some class)"] == 1
    assert counts["types with a fusion refused as unreachable"] == 1
    assert counts["types with attention fused and verified"] == 1
    assert counts["types with a norm fused and verified"] == 1
    assert counts["configs verified (tiny configs and construction variants)"] == 2
    line = markdown._summary_markdown(rows[0])
    assert "unreachable: ToyMLP" in line and line.endswith("| yes: tiny + 1 variant (b=1) |")


def test_variants_of_a_config_that_does_not_shrink_to_itself_keep_its_derived_fields():
    # Zamba derives attention_hidden_size = 2 * hidden_size; shrinking the tiny config again caps it, and the
    # original could no longer run. Its variants replace the one field instead.
    from fusegen.compiler.resolve import resolve
    from fusegen.compiler.shrink import tiny_config
    from fusegen.compiler.validate import _reshrinks_to_itself, construction_variants

    target = resolve("zamba")
    config = tiny_config(target.config_class)
    assert not _reshrinks_to_itself(target, config)
    variants = dict(construction_variants(target, config, limit=None, max_probes=None, every_field=True))
    assert "num_key_value_heads=1" in variants
    assert all(v.attention_hidden_size == config.attention_hidden_size for v in variants.values())
    assert _reshrinks_to_itself(resolve("llama"), tiny_config(resolve("llama").config_class))
