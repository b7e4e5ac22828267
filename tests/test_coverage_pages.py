"""The coverage pages: one per Auto mapping, the text model's attention told from the vision tower's, the index made
from the pages, and rows saved by a run rendered again without rerunning it."""

import json
from dataclasses import asdict

from fusegen.tools import coverage
from fusegen.tools.coverage import analysis, markdown
from fusegen.tools.coverage.rows import NEW_TOKENS, Inspection, Row, Verification
from fusegen.tools.coverage.run import reusable, row_from_data

VERIFIED = Verification("verified", 0.0, "same", checks=[{"config": "tiny", "status": "verified"}])


def _outcome(name, fused=(), refused=()):
    return {
        "class": name,
        "fused": (
            [{"kind": "qkv", "merged": "qkv_proj", "shards": [[p, i] for i, p in enumerate(fused)]}] if fused else []
        ),
        "refused": (
            [{"projections": list(refused), "rule": "input-rebound", "reason": "why", "line": None}] if refused else []
        ),
        "trace_stopped": None,
    }


QKV = ("q_proj", "k_proj", "v_proj")


def _vlm(text_fused=True, vision_fused=True, verification=VERIFIED):
    """A toy image-text-to-text row: a text attention and a vision-tower attention, each fused or refused."""
    places = {
        "ToyForConditionalGeneration": [""],
        "ToyTextAttention": ["model.language_model.layers.*.self_attn"],
        "ToyVisionAttention": ["model.vision_tower.encoder.layers.*.self_attn"],
    }
    classes = [
        _outcome("ToyTextAttention", fused=QKV) if text_fused else _outcome("ToyTextAttention", refused=QKV),
        _outcome("ToyVisionAttention", fused=QKV) if vision_fused else _outcome("ToyVisionAttention", refused=QKV),
    ]
    return Row("toy_vl", "fused", {"classes": classes}, "", Inspection(places=places), verification)


def test_tower_of_a_module_path():
    assert analysis.tower_of_path("model.visual.blocks.*.attn") == "vision"
    assert analysis.tower_of_path("model.vision_tower.encoder.layers.*.self_attn") == "vision"
    assert analysis.tower_of_path("vision_model.encoder.layers.*.self_attn") == "vision"
    assert analysis.tower_of_path("model.audio_tower.layers.*.self_attn") == "audio"
    assert analysis.tower_of_path("model.language_model.layers.*.self_attn") == "text"
    assert analysis.tower_of_path("model.layers.*.mlp.activation_fn") == "text"  # `vi` inside a word is no tower
    assert analysis.tower_of_path("") == "text"


def test_attention_is_counted_per_tower():
    both, text_only = _vlm(), _vlm(vision_fused=False)
    counts = dict(coverage.summary_counts([both, text_only]))
    assert counts["types with attention fused and verified"] == 2
    assert counts["... in the text model"] == 2
    assert counts["... in the vision tower"] == 1
    assert counts["... in the audio tower"] == 0
    assert counts["types with a vision tower"] == 2
    assert counts["types with a q/k/v triplet in the vision tower"] == 2
    assert counts["... of which the tower's q/k/v fused and verified"] == 1
    assert coverage.part_cell(text_only, "attention", "text") == "fused"
    assert coverage.part_cell(text_only, "attention", "vision") == "refused: input-rebound"
    unverified = _vlm(verification=Verification("mismatch", 1.0, "differ"))
    assert dict(coverage.summary_counts([unverified]))["... in the vision tower"] == 0


def test_a_class_in_both_towers_counts_in_both():
    places = {"ClipAttention": ["text_model.encoder.layers.*.self_attn", "vision_model.encoder.layers.*.self_attn"]}
    row = Row(
        "clip", "fused", {"classes": [_outcome("ClipAttention", fused=QKV)]}, "", Inspection(places=places), VERIFIED
    )
    assert analysis.towers_of(row, "ClipAttention") == ["text", "vision"]
    counts = dict(coverage.summary_counts([row]))
    assert counts["... in the text model"] == counts["... in the vision tower"] == 1


def test_packed_vision_tower_is_told_apart():
    places = {"TextAttention": ["model.layers.*.self_attn"], "VisionAttention": ["model.visual.blocks.*.attn"]}
    row = Row(
        "qwen_like",
        "fused",
        {"classes": [_outcome("TextAttention", fused=QKV)]},
        "",
        Inspection(places=places, already_fused={"VisionAttention": ["qkv"]}),
        VERIFIED,
    )
    assert coverage.part_cell(row, "attention", "text") == "fused"
    assert coverage.part_cell(row, "attention", "vision") == "packed"
    assert dict(coverage.summary_counts([row]))["types whose vision tower already packs q/k/v"] == 1


def test_page_columns_follow_the_towers_present():
    page = coverage.render_markdown([_vlm()], "image-text-to-text")
    assert "| model type | attention (text model) | attention (vision tower) | MLP | norm | other |" in page
    assert "| `toy_vl` | fused | fused |" in page
    assert "AutoModelForImageTextToText" in page
    text_page = coverage.render_markdown([Row("toy", "nothing", {"classes": []}, "", Inspection(), None)])
    assert "| model type | attention | MLP | norm | other |" in text_page


def test_verification_paragraph_has_no_unfilled_placeholder():
    page = coverage.render_markdown([_vlm()], "image-text-to-text")
    assert "{" not in page.split("## Summary")[0]
    assert f"{NEW_TOKENS} greedy tokens must be identical" in page


def test_index_is_made_from_the_pages_and_lists_what_did_not_run():
    run = markdown.RunInfo(
        "python -m fusegen.tools.coverage --mapping image-text-to-text --jobs 2 --variants 1", 754.2, 1
    )
    page = coverage.render_markdown([_vlm(), _vlm(vision_fused=False)], "image-text-to-text", run)
    assert "wall time 754 s (13 min)" in page and "limited to 1 per type (`--variants 1`)" in page
    counts, line = markdown.read_page(page)
    assert dict(counts) == dict(coverage.summary_counts([_vlm(), _vlm(vision_fused=False)]))
    assert line.startswith("Run: `python -m fusegen.tools.coverage --mapping image-text-to-text")
    index = markdown.render_index({"causal-lm": None, "image-text-to-text": page, "dual-encoder": None})
    assert "| | [image-text-to-text](coverage/image-text-to-text.md) |" in index
    assert "| ... in the vision tower | 1 |" in index
    assert "- `causal-lm`: not yet run." in index and "- `dual-encoder`: not yet run." in index
    assert "wall time 754 s" in index


def test_saved_rows_render_the_same_page():
    rows = [_vlm(), _vlm(vision_fused=False)]
    again = [row_from_data(data) for data in json.loads(json.dumps([asdict(r) for r in rows]))]
    assert again == rows
    assert coverage.render_markdown(again, "image-text-to-text") == coverage.render_markdown(
        rows, "image-text-to-text"
    )


def test_inspection_records_where_each_class_sits():
    # Gemma 3's image-text-to-text class holds Siglip's attention in its vision tower, its own in the text model
    inspected = Inspection(**coverage.inspect_original("gemma3", "image-text-to-text"))
    row = Row("gemma3", "nothing", {"classes": []}, "", inspected, None)
    assert analysis.towers_of(row, "SiglipAttention") == ["vision"]
    assert analysis.towers_of(row, "Gemma3Attention") == ["text"]
    assert "Gemma3ForConditionalGeneration" in inspected.places
    # the mapping's class, not the type's default head: BERT's causal LM, where `fusegen build bert` builds BertModel
    assert "BertLMHeadModel" in coverage.inspect_original("bert", "causal-lm")["places"]
    assert "BertLMHeadModel" not in coverage.inspect_original("bert")["places"]


def test_rows_are_reused_only_where_the_other_mapping_built_the_same_class(tmp_path):
    # gemma3: image-text-to-text and multimodal-lm both register Gemma3ForConditionalGeneration; bert's causal LM
    # (BertLMHeadModel) is not its masked LM (BertForMaskedLM)
    rows = [_vlm(), Row("bert", "fused", {"classes": []}, "", Inspection(), VERIFIED)]
    rows[0].model_type = "gemma3"
    saved = tmp_path / "image-text-to-text.rows.json"
    saved.write_text(
        json.dumps({"mapping": "image-text-to-text", "argv": [], "seconds": 1.0, "rows": [asdict(rows[0])]})
    )
    causal = tmp_path / "causal-lm.rows.json"
    causal.write_text(json.dumps({"mapping": "causal-lm", "argv": [], "seconds": 1.0, "rows": [asdict(rows[1])]}))
    found = reusable([saved, causal], "multimodal-lm", ["gemma3", "bert"])
    assert list(found) == ["gemma3"] and found["gemma3"] == ("image-text-to-text", rows[0])
    assert reusable([causal], "masked-lm", ["bert"]) == {}
    assert reusable([saved], "image-text-to-text", ["gemma3"]) == {}  # never a mapping's own earlier run
    run = markdown.RunInfo(
        "python -m fusegen.tools.coverage --mapping multimodal-lm", 5.0, reused={"gemma3": "image-text-to-text"}
    )
    page = coverage.render_markdown([rows[0]], "multimodal-lm", run)
    assert "The rows of 1 types are the `image-text-to-text` run's, which built the same class for them" in page


def test_a_rerun_replaces_only_its_types_rows_and_the_page_names_them(tmp_path):
    from fusegen.tools.coverage.run import _rerun_into

    before = [Row("toy", "error", {"classes": []}, "clash", Inspection(), None), _vlm()]
    whole = tmp_path / "rows.json"
    whole.write_text(
        json.dumps({"mapping": "causal-lm", "argv": [], "seconds": 100.0, "rows": list(map(asdict, before))})
    )
    fixed = Row("toy", "fused", {"classes": [_outcome("ToyAttention", fused=QKV)]}, "", Inspection(), VERIFIED)
    merged = _rerun_into(whole, {"mapping": "causal-lm", "seconds": 7.0}, "coverage --only toy", [fixed])
    assert [row_from_data(data) for data in merged["rows"]] == [fixed, before[1]]
    assert json.loads(whole.read_text())["rerun"] == {
        "command": "coverage --only toy",
        "seconds": 7.0,
        "types": ["toy"],
    }
    run = markdown.RunInfo("coverage", 100.0, rerun=merged["rerun"])
    page = coverage.render_markdown([row_from_data(data) for data in merged["rows"]], "causal-lm", run)
    assert "The rows of 1 type come from a later run of it, `coverage --only toy` (7 s)" in page
