"""`fusegen diff`: reads the checked-in file (a build only when there is none), lists rename-only classes by name."""

import shutil
from pathlib import Path

import pytest

from fusegen.cli import main

ROOT = Path(__file__).resolve().parent.parent
LLAMA = ROOT / "generated" / "fused_llama.py"


@pytest.fixture
def directory(tmp_path):
    shutil.copy(LLAMA, tmp_path)
    return tmp_path


def run_diff(capsys, *argv) -> str:
    assert main(["diff", *map(str, argv)]) == 0
    return capsys.readouterr().out


def test_diff_reads_the_file_on_disk_not_a_fresh_build(directory, capsys):
    path = directory / "fused_llama.py"
    text = path.read_text()
    marker = "        self.qkv_proj_sizes = self.qkv_proj.output_sizes\n"
    assert text.count(marker) == 1
    path.write_text(text.replace(marker, marker + "        self.only_on_disk = 1\n"))
    out = run_diff(capsys, "llama", "--output-dir", directory)
    assert "+        self.only_on_disk = 1" in out
    assert "fresh build" not in out


def test_rename_only_classes_are_listed_by_name_and_not_diffed(directory, capsys):
    out = run_diff(capsys, "llama", "--output-dir", directory)
    assert (
        "fused_llama: renamed class names only, not shown: FusedLlamaDecoderLayer, FusedLlamaModel, "
        "FusedLlamaForCausalLM" in out
    )
    assert "fused_llama: renamed class names and FusedPreTrainedMixin added as first base only, not shown: " in out
    assert "+++ fused_llama.FusedLlamaModel" not in out
    assert "+++ fused_llama.FusedLlamaDecoderLayer" not in out
    for changed in ("FusedLlamaAttention", "FusedLlamaMLP", "FusedLlamaRMSNorm"):
        assert f"+++ fused_llama.{changed}\n" in out
    assert "-        self.q_proj = nn.Linear(" in out
    assert "+        self.qkv_proj = MergedColumnLinear(" in out


def test_a_class_changed_beyond_its_renames_is_diffed_not_listed(directory, capsys):
    path = directory / "fused_llama.py"
    text = path.read_text()
    line = "class FusedLlamaModel(FusedLlamaPreTrainedModel):\n"
    assert text.count(line) == 1
    path.write_text(text.replace(line, line + "    extra = 1\n"))
    out = run_diff(capsys, "llama", "--output-dir", directory)
    assert "+++ fused_llama.FusedLlamaModel" in out
    assert "+    extra = 1" in out
    assert "not shown: FusedLlamaDecoderLayer, FusedLlamaForCausalLM\n" in out


def test_a_file_built_from_another_source_is_diffed_with_a_warning(directory, capsys):
    path = directory / "fused_llama.py"
    text = path.read_text()
    start = text.index("# fusegen-source-sha256: ") + len("# fusegen-source-sha256: ")
    path.write_text(text[:start] + "0" * 64 + text[start + 64 :])
    out = run_diff(capsys, "llama", "--output-dir", directory)
    assert "was built from another source of transformers.models.llama.modeling_llama" in out


@pytest.mark.slow
def test_without_a_file_the_diff_is_of_a_fresh_build_and_says_so(tmp_path, capsys):
    out = run_diff(capsys, "llama", "--output-dir", tmp_path)
    assert f"llama: no {tmp_path / 'fused_llama.py'}; diffing a fresh build instead (nothing is written)" in out
    assert "+++ fused_llama.FusedLlamaAttention" in out
    assert "renamed class names only, not shown: FusedLlamaDecoderLayer" in out
    assert not list(tmp_path.iterdir())
