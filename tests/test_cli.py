"""`fusegen build` and `--check` as a user runs them: exit codes, files, determinism."""

import os
import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = pytest.mark.slow  # each test starts fresh fusegen processes

ROOT = Path(__file__).resolve().parent.parent


def fusegen(*args, cwd=ROOT, env=None):
    return subprocess.run(
        [sys.executable, "-m", "fusegen", *map(str, args)],
        capture_output=True,
        text=True,
        check=False,
        cwd=cwd,
        env={**os.environ, **(env or {})},
    )


@pytest.fixture(scope="module")
def built(tmp_path_factory):
    out = tmp_path_factory.mktemp("built")
    result = fusegen("build", "llama", "qwen2", "--output-dir", out)
    assert result.returncode == 0, result.stderr
    return out


def test_build_writes_one_file_per_target(built):
    assert sorted(p.name for p in built.iterdir()) == ["fused_llama.py", "fused_qwen2.py"]


def test_builds_are_byte_identical_across_hash_seeds(built, tmp_path):
    result = fusegen("build", "llama", "qwen2", "--output-dir", tmp_path, env={"PYTHONHASHSEED": "12345"})
    assert result.returncode == 0, result.stderr
    for name in ("fused_llama.py", "fused_qwen2.py"):
        assert (tmp_path / name).read_bytes() == (built / name).read_bytes()


def test_check_passes_on_a_fresh_directory_without_targets(built):
    result = fusegen("build", "--check", "--output-dir", built)
    assert result.returncode == 0, result.stdout + result.stderr
    assert "up to date" in result.stdout


def test_check_reports_drift_with_a_diff_and_writes_nothing(built, tmp_path):
    stale = tmp_path / "fused_llama.py"
    text = (built / "fused_llama.py").read_text()
    stale.write_text(text.replace("dim=-1", "dim=2", 1))
    before = stale.read_bytes()
    result = fusegen("build", "--check", "--output-dir", tmp_path)
    assert result.returncode == 1
    assert "-" in result.stdout and "+" in result.stdout and "dim=2" in result.stdout
    assert stale.read_bytes() == before
    assert sorted(p.name for p in tmp_path.iterdir()) == ["fused_llama.py"]


def test_check_with_target_and_missing_file_is_drift(tmp_path):
    result = fusegen("build", "--check", "llama", "--output-dir", tmp_path)
    assert result.returncode == 1
    assert not list(tmp_path.iterdir())


def test_unknown_model_type_exits_2_and_says_how_to_list(tmp_path):
    result = fusegen("build", "lama", "--output-dir", tmp_path)
    assert result.returncode == 2
    assert "unknown model type 'lama'" in result.stderr
    assert "fusegen list" in result.stderr and "'llama'" in result.stderr


def test_failed_target_writes_no_file_and_keeps_good_output(built, tmp_path):
    good = tmp_path / "fused_llama.py"
    good.write_text("# a good file\n")
    result = fusegen("build", "llama", "nosuchmodel", "--output-dir", tmp_path)
    assert result.returncode == 2
    assert good.read_text() == "# a good file\n"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["fused_llama.py"]


def test_build_without_targets_is_a_usage_error(tmp_path):
    result = fusegen("build", "--output-dir", tmp_path)
    assert result.returncode == 2
    assert "TARGET" in result.stderr


def test_check_on_empty_directory_is_an_input_error(tmp_path):
    result = fusegen("build", "--check", "--output-dir", tmp_path)
    assert result.returncode == 2
    assert "no fused_*.py" in result.stderr


def test_check_refuses_a_file_without_header(tmp_path):
    (tmp_path / "fused_x.py").write_text("print('hand written')\n")
    result = fusegen("build", "--check", "--output-dir", tmp_path)
    assert result.returncode == 2
    assert "fused_x.py" in result.stderr


def test_version_and_module_entry_point():
    import fusegen as package

    result = fusegen("--version")
    assert result.returncode == 0
    assert result.stdout.strip() == f"fusegen {package.__version__}"


def test_list_includes_the_model_types():
    result = fusegen("list")
    assert result.returncode == 0
    listed = {line.strip().split(": ", 1)[0] for line in result.stdout.splitlines()}
    assert {"llama", "qwen2", "mistral"} <= listed


# --- the universe: `build --all` and `list` over every mapping (in process: no model is built) --------------------


def test_all_builds_every_type_of_the_universe_or_one_mapping_through_its_class():
    from fusegen.cli import all_targets
    from fusegen.compiler.resolve import model_types

    assert all_targets(None) == model_types() and {"llama", "bert", "t5", "clip", "qwen2_5_vl"} <= set(
        all_targets(None)
    )
    causal = all_targets("causal-lm")
    assert len(causal) == len(model_types("causal-lm"))
    assert {"llama", "llama4:causal-lm", "bert:causal-lm", "bart:causal-lm"} <= set(causal)  # not their defaults
    assert "gemma3" in causal  # its causal-LM mapping registers its image-text-to-text class: no suffix
    assert "clip" in all_targets("dual-encoder")  # CLIPModel is its default (base) class too: no suffix


def test_build_all_with_a_mapping_writes_each_file_under_its_head_and_keeps_other_records(
    tmp_path, monkeypatch, capsys
):
    import json

    from fusegen.cli import SWEEP_SUMMARY, main
    from fusegen.tools import sweep as sweeping

    built = []

    def fake_sweep(targets, jobs):  # the builds themselves are the compiler's tests; this is the CLI's plumbing
        built.extend(targets)
        for target in targets[:2]:
            stem = target.replace(":", "_").replace("-", "_")
            yield sweeping.SweepEntry(target, "fused", 0.0, text=f"# {target}\n", summary="fused X", file_stem=stem)

    monkeypatch.setattr(sweeping, "sweep", fake_sweep)
    (tmp_path / SWEEP_SUMMARY).write_text('{"t5": {"status": "fused", "detail": "fused T5Attention.qkv_proj"}}\n')
    assert main(["build", "--all", "--mapping", "seq2seq-lm", "--output-dir", str(tmp_path)]) == 0
    assert built[:2] == ["audioflamingo3", "bart"] and "t5" in built and len(built) == 38
    assert (tmp_path / "fused_bart.py").read_text() == "# bart\n"
    record = json.loads((tmp_path / SWEEP_SUMMARY).read_text())
    assert set(record) == {"audioflamingo3", "bart", "t5"}  # t5 from the earlier sweep, kept
    assert "2 model types" not in capsys.readouterr().out  # the count is the mapping's, 38


def test_list_names_each_mapping_s_types_with_their_default_head(tmp_path, capsys):
    from fusegen.cli import SWEEP_SUMMARY, main
    from fusegen.compiler.resolve import UNIVERSE, model_types

    (tmp_path / SWEEP_SUMMARY).write_text('{"bart": {"status": "fused", "detail": "fused BartAttention.qkv_proj"}}\n')
    assert main(["list", "--output-dir", str(tmp_path)]) == 0
    out = capsys.readouterr().out
    for mapping in UNIVERSE:
        assert f"{mapping}: {len(model_types(mapping))} model types\n" in out
    assert "  bert: base BertModel: unknown" in out
    assert "  gemma3: image-text-to-text Gemma3ForConditionalGeneration: unknown" in out
    assert "  bart: seq2seq-lm BartForConditionalGeneration: fused: fused BartAttention.qkv_proj" in out
    assert main(["list", "--mapping", "dual-encoder", "--output-dir", str(tmp_path)]) == 0
    lines = capsys.readouterr().out.splitlines()
    assert lines[0] == f"dual-encoder: {len(model_types('dual-encoder'))} model types"
    assert "  clip: base CLIPModel: unknown (run `fusegen build --all` or `fusegen report`)" in lines


@pytest.mark.parametrize(
    "argv, message",
    [
        (["build", "--mapping", "causal-lm", "llama"], "--mapping selects the model types of --all"),
        (["build", "--all", "--mapping", "causal"], "invalid choice: 'causal'"),
        (["list", "--mapping", "vision"], "invalid choice: 'vision'"),
    ],
)
def test_bad_mapping_exits_2_with_one_message(argv, message, capsys, tmp_path):
    from fusegen.cli import main

    try:
        code = main([*argv, "--output-dir", str(tmp_path)])
    except SystemExit as exit_:  # argparse's choices check exits itself, with our message format
        code = exit_.code
    err = capsys.readouterr().err
    assert code == 2 and message in err and "fusegen: error:" in err and "Traceback" not in err
