"""fusegen where users meet it: pre-commit, a wheel install, `fusegen diff` and `fusegen list`."""

import os
import shutil
import subprocess
import sys
import sysconfig
import zipfile
from pathlib import Path

import pytest

pytestmark = pytest.mark.slow  # wheel installs, pre-commit and fresh CLI processes

ROOT = Path(__file__).resolve().parent.parent
BIN = Path(sys.executable).parent


def run(*command, cwd, env=None):
    return subprocess.run(
        [str(part) for part in command],
        cwd=cwd,
        capture_output=True,
        text=True,
        check=False,
        env={**os.environ, **(env or {})},
    )


@pytest.mark.skipif(shutil.which("git") is None, reason="git is not installed")
def test_pre_commit_hook_passes_fresh_files_and_fails_stale_ones(tmp_path):
    # `try-repo` runs the hook as declared in this checkout's .pre-commit-hooks.yaml, uncommitted edits included.
    repo = tmp_path / "user-project"
    (repo / "generated").mkdir(parents=True)
    shutil.copy(ROOT / "generated" / "fused_llama.py", repo / "generated")
    env = {"PRE_COMMIT_HOME": str(tmp_path / "cache"), "PATH": f"{BIN}{os.pathsep}{os.environ['PATH']}"}
    for command in (["init", "-q"], ["add", "."], ["-c", "user.email=t@t", "-c", "user.name=t", "commit", "-qm", "x"]):
        assert run("git", *command, cwd=repo).returncode == 0
    hook = [BIN / "pre-commit", "try-repo", ROOT, "fusegen-check", "--all-files"]
    passed = run(*hook, cwd=repo, env=env)
    assert passed.returncode == 0, passed.stdout + passed.stderr
    assert "fusegen build --check" in passed.stdout

    stale = repo / "generated" / "fused_llama.py"
    stale.write_text(stale.read_text().replace("dim=-1", "dim=2", 1))
    failed = run(*hook, cwd=repo, env=env)
    assert failed.returncode == 1
    assert "would regenerate" in failed.stdout + failed.stderr


def test_diff_shows_the_fused_attention_change():
    result = run(sys.executable, "-m", "fusegen", "diff", "llama", cwd=ROOT)
    assert result.returncode == 0, result.stderr
    assert "--- transformers.models.llama.modeling_llama.LlamaAttention" in result.stdout
    assert "+++ fused_llama.FusedLlamaAttention" in result.stdout
    assert "-        self.q_proj = nn.Linear(" in result.stdout
    assert "+        self.qkv_proj = MergedColumnLinear(" in result.stdout
    assert "\033[" not in result.stdout  # no colour when not a terminal


def test_list_reads_outcomes_from_generated_files_and_the_sweep(tmp_path):
    shutil.copy(ROOT / "generated" / "fused_llama.py", tmp_path)
    (tmp_path / "fusegen-sweep.json").write_text('{"xglm": {"status": "fused", "detail": "fused X.kv_proj"}}\n')
    result = run(sys.executable, "-m", "fusegen", "list", "--output-dir", tmp_path, cwd=ROOT)
    lines = dict(line.strip().split(": ", 1) for line in result.stdout.splitlines() if line.startswith("  "))
    assert lines["llama"].startswith("causal-lm LlamaForCausalLM: fused (")
    assert lines["xglm"] == "causal-lm XGLMForCausalLM: fused: fused X.kv_proj"
    assert lines["qwen2"].startswith("causal-lm Qwen2ForCausalLM: unknown")


def test_quiet_build_prints_nothing_on_success(tmp_path):
    result = run(sys.executable, "-m", "fusegen", "-q", "build", "llama", "--output-dir", tmp_path, cwd=ROOT)
    assert result.returncode == 0, result.stderr
    assert result.stdout == ""
    assert (tmp_path / "fused_llama.py").exists()


@pytest.mark.skipif(os.environ.get("FUSEGEN_SKIP_WHEEL") == "1", reason="FUSEGEN_SKIP_WHEEL=1")
def test_wheel_install_builds_from_any_directory(tmp_path):
    # A non-editable install must carry the templates: build a wheel, install it without
    # dependencies into a venv that sees this environment's packages, run it from elsewhere.
    wheels = tmp_path / "wheels"
    # Build from a clean copy: setuptools reuses a checkout's stale build/ directory.
    source = tmp_path / "source"
    shutil.copytree(ROOT, source, ignore=shutil.ignore_patterns(".*", "build", "*.egg-info", "__pycache__", "bench"))
    built = run(
        sys.executable, "-m", "pip", "wheel", "--no-deps", "--no-build-isolation", "-w", wheels, source, cwd=tmp_path
    )
    assert built.returncode == 0, built.stderr[-2000:]
    venv = tmp_path / "venv"
    assert run(sys.executable, "-m", "venv", venv, cwd=tmp_path).returncode == 0
    python = venv / "bin" / "python"
    # Dependencies come from this environment's site-packages (a plain path entry, so the
    # editable install's finder there stays inactive and fusegen comes from the wheel).
    site = run(python, "-c", "import sysconfig; print(sysconfig.get_paths()['purelib'])", cwd=tmp_path).stdout.strip()
    (Path(site) / "parent_environment.pth").write_text(sysconfig.get_paths()["purelib"] + "\n")
    (wheel,) = wheels.glob("fusegen-*.whl")
    installed = run(python, "-m", "pip", "install", "--no-deps", "--force-reinstall", wheel, cwd=tmp_path)
    assert installed.returncode == 0, installed.stderr[-2000:]
    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir()
    result = run(venv / "bin" / "fusegen", "build", "llama", "--output-dir", elsewhere / "out", cwd=elsewhere)
    assert result.returncode == 0, result.stderr[-2000:]
    assert (elsewhere / "out" / "fused_llama.py").read_text() == (ROOT / "generated" / "fused_llama.py").read_text()
    origin = run(python, "-c", "import fusegen, sys; print(fusegen.__file__)", cwd=elsewhere).stdout
    assert str(ROOT) not in origin
    # The pre-built fused files ship as fusegen.models; no top-level `generated` lands in site-packages.
    with zipfile.ZipFile(wheel) as archive:
        tops = {name.partition("/")[0] for name in archive.namelist()}
        assert "fusegen/models/fused_llama.py" in archive.namelist()
    assert "generated" not in tops
    probe = "import fusegen.models.fused_llama as m; print(m.__file__)"
    shipped = run(python, "-c", probe, cwd=elsewhere)
    assert shipped.returncode == 0, shipped.stderr[-2000:]
    assert str(ROOT) not in shipped.stdout
