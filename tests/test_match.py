"""Merged names: the serving engines' conventions."""

import pytest

from fusegen.compiler.build import build
from fusegen.tools.coverage import verify
from fusegen.fusions.siblings import merged_name


@pytest.mark.parametrize(
    ("names", "merged"),
    [
        (["q_proj", "k_proj", "v_proj"], "qkv_proj"),
        (["gate_proj", "up_proj"], "gate_up_proj"),
        (["q_a_proj", "kv_a_proj_with_mqa"], "fused_qkv_a_proj"),  # vLLM's name for MLA's latent projections
        (["kv_a_proj_with_mqa", "q_a_proj"], "fused_qkv_a_proj"),
    ],
)
def test_merged_names(names, merged):
    assert merged_name(names) == merged


# glm_moe_dsa has the same pair but is refused today (input-escapes, a false alarm listed in docs/analysis.md).
@pytest.mark.parametrize("model_type", ["longcat_flash"])
def test_mla_latent_projections_merge_into_fused_qkv_a_proj(model_type):
    result = build(model_type)
    plans = [plan for outcome in result.outcomes for plan in outcome.fused]
    assert ("fused_qkv_a_proj", (("q_a_proj", 0), ("kv_a_proj_with_mqa", 1))) in [(p.merged, p.shards) for p in plans]
    assert '"fused_qkv_a_proj": ["q_a_proj", "kv_a_proj_with_mqa"]' in result.text  # packed_modules_mapping
    verification = verify(model_type, result.text)
    assert verification["status"] == "verified", verification
