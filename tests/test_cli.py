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
    listed = {line.split(": ", 1)[0] for line in result.stdout.splitlines()}
    assert {"llama", "qwen2", "mistral"} <= listed
