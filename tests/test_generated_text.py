"""What the generated files say about themselves is read off their plans: the docstring, the TP comment, the guards."""

import ast
import re
from pathlib import Path

import pytest

from fusegen.compiler.mappings import tp_notes
from fusegen.runtime.tp import LOCAL_HEADS, MERGED_COLWISE

ROOT = Path(__file__).resolve().parent.parent
GENERATED = ROOT / "generated"
FILES = sorted(GENERATED.glob("fused_*.py"), key=lambda path: path.name)
HEADS_WORDS = "q/k/v sharded by query and kv heads"


def _assigned(text: str, name: str):
    for node in ast.parse(text).body:
        if isinstance(node, ast.Assign) and [target.id for target in node.targets] == [name]:
            return ast.literal_eval(node.value)
    raise AssertionError(f"{name} not assigned")


def _tp_comment(text: str) -> str:
    lines = text.splitlines()
    start = next(i for i, line in enumerate(lines) if line.startswith(("# Tensor parallelism", "# No tensor")))
    end = next(i for i in range(start, len(lines)) if lines[i].startswith("TP_PLAN"))
    return "\n".join(lines[start:end])


@pytest.mark.parametrize("path", FILES, ids=lambda path: path.stem)
def test_tp_comment_claims_head_sharding_only_where_the_plan_has_the_rule(path):
    text = path.read_text()
    plan = _assigned(text, "TP_PLAN") or {}
    comment = _tp_comment(text)
    assert (HEADS_WORDS in comment) == (LOCAL_HEADS in plan.values()), comment
    merged = {key.rpartition(".")[2] for key, style in plan.items() if style == MERGED_COLWISE}
    for name in _assigned(text, "STACKED_PARAMS_MAPPING"):
        assert (f"{name}" in comment) == bool(plan), (name, comment)
    if merged:
        line = next(line for line in comment.splitlines() if MERGED_COLWISE in line)
        assert set(line.split(":")[0].lstrip("# ").split(", ")) == merged


def test_files_that_merge_no_qkv_or_have_no_local_heads_rule_do_not_claim_head_sharding():
    """The two files the review found saying it: DeepSeek V3 merges no q/k/v; Gemma 4's merge is conditional."""
    for name in ("fused_deepseek_v3.py", "fused_gemma4_text.py"):
        text = (GENERATED / name).read_text()
        assert "shards q/k/v" not in text and HEADS_WORDS not in text


@pytest.mark.parametrize("path", FILES, ids=lambda path: path.stem)
def test_docstring_names_exactly_the_merged_linears_and_the_rewritten_norms(path):
    text = path.read_text()
    docstring = ast.get_docstring(ast.parse(text))
    stacked = _assigned(text, "STACKED_PARAMS_MAPPING")
    listed = re.search(r"merged into one GEMM each \(([^)]*)\)", docstring)
    assert listed is not None and set(listed.group(1).split(", ")) == set(stacked), docstring
    header = text.split('"""', 1)[0]
    norms = set(re.findall(r"#   (\w+): forward -> torch\.nn\.functional\.rms_norm", header))
    said = set(re.findall(r"(Fused\w+): forward computed by one torch\.nn\.functional\.rms_norm call", docstring))
    assert said == norms


@pytest.mark.parametrize("path", FILES, ids=lambda path: path.stem)
def test_every_eps_guard_has_its_reason_on_the_line_above(path):
    lines = path.read_text().splitlines()
    guards = [i for i, line in enumerate(lines) if re.match(r"\s+if type\(self\.\w+\) is float", line)]
    for i in guards:
        assert lines[i - 1].strip().startswith("# fusegen: rms_norm equals the statements below for a float eps")
    header = path.read_text().split('"""', 1)[0]
    assert len(guards) == header.count(": forward -> torch.nn.functional.rms_norm")


def test_tp_notes_follow_the_plan():
    stacked = {"qkv_proj": [("q_proj", "q"), ("k_proj", "k"), ("v_proj", "v")], "gate_up_proj": [("gate_proj", 0)]}
    with_heads = {
        "layers.*.self_attn": LOCAL_HEADS,
        "layers.*.self_attn.qkv_proj": MERGED_COLWISE,
        "layers.*.mlp.down_proj": "rowwise",
    }
    notes = tp_notes(with_heads, stacked, set())
    assert notes[0] == f"qkv_proj: `{MERGED_COLWISE}`, each piece split as its own `colwise` rule split it"
    assert notes[1] == f"layers.*.self_attn: `{LOCAL_HEADS}`, {HEADS_WORDS}"
    assert notes[2] == "gate_up_proj: no rule (replicated), as none of its pieces had one"
    conditional = {
        "layers.*.self_attn.q_proj": "colwise",
        "layers.*.self_attn.qkv_proj": MERGED_COLWISE,
        "layers.*.mlp.gate_up_proj": MERGED_COLWISE,
    }
    notes = tp_notes(conditional, stacked, {"q_proj", "k_proj"})
    assert not any(HEADS_WORDS in note for note in notes)
    assert "q_proj: own rules kept, for the layers or configs that build them unmerged" in notes  # k_proj has no rule


def test_a_class_black_would_reflow_is_fenced_and_the_others_are_written_as_they_are():
    from fusegen.compiler.render import FMT_OFF, FMT_ON, format_source, with_classes

    slots = ["class _FusegenSlot0:\n    pass\n", "class _FusegenSlot1:\n    pass\n"]
    frame = format_source(f"import torch\n\n\n{slots[0]}\n\n{slots[1]}\n\n\nDONE = 1\n")
    kept = "class Kept:\n    x = [1, 2]\n"
    reflowed = "class Reflowed:\n    x = [1,\n         2]\n"
    assert format_source(kept) == kept and format_source(reflowed) != reflowed
    text = with_classes(frame, slots, [kept, reflowed])
    assert f"\n{kept}" in text and f"{FMT_OFF}{reflowed}{FMT_ON}" in text and FMT_OFF + kept not in text
    assert format_source(text) == text
    both_kept = with_classes(frame, slots, [kept, kept.replace("Kept", "Also")])
    assert FMT_OFF not in both_kept and format_source(both_kept) == both_kept
