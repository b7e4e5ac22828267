"""Bad input on every `fusegen` command: exit 2, one `fusegen: error:` line naming the file or tensor, no traceback.

Most cases run `fusegen.cli.main` in process (an exception escaping it fails the test just as a traceback would); one
runs `python -m fusegen` end to end, since the exit status a shell sees is the point.
"""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from transformers import LlamaConfig, LlamaForCausalLM

from fusegen.cli import main
from fusegen.errors import EXIT_ERROR, EXIT_INTERNAL, command
from fusegen.testkit import random_model, small_config

ROOT = Path(__file__).resolve().parent.parent
GENERATED = ROOT / "generated"


def damage_truncate(path: Path) -> str:
    data = (path / "model.safetensors").read_bytes()
    (path / "model.safetensors").write_bytes(data[:-100])
    return "model.safetensors"


def damage_corrupt(path: Path) -> str:
    (path / "model.safetensors").write_bytes(b"\x10\x00\x00\x00\x00\x00\x00\x00{not json at all")
    return "model.safetensors"


def damage_no_weights(path: Path) -> str:
    (path / "model.safetensors").unlink()
    return "no weights"


def damage_no_config(path: Path) -> str:
    (path / "config.json").unlink()
    return "config.json"


def damage_pickle_only(path: Path) -> str:
    from safetensors.torch import load_file

    torch.save(load_file(path / "model.safetensors"), path / "pytorch_model.bin")
    (path / "model.safetensors").unlink()
    return "pytorch_model.bin"


def damage_bad_config(path: Path) -> str:
    (path / "config.json").write_text("{nope")
    return "config.json"


def damage_unknown_model_type(path: Path) -> str:
    config = json.loads((path / "config.json").read_text())
    (path / "config.json").write_text(json.dumps({**config, "model_type": "nosuchmodel"}))
    return "nosuchmodel"


def damage_missing_path(path: Path) -> str:
    shutil.rmtree(path)
    return path.name


DAMAGES = {
    "truncated": damage_truncate,
    "corrupt": damage_corrupt,
    "no-weights": damage_no_weights,
    "no-config": damage_no_config,
    "pickle-only": damage_pickle_only,
    "bad-config": damage_bad_config,
    "unknown-model-type": damage_unknown_model_type,
    "missing-path": damage_missing_path,
}


@pytest.fixture(scope="module")
def good(tmp_path_factory):
    path = tmp_path_factory.mktemp("good") / "ckpt"
    random_model(LlamaForCausalLM, small_config(LlamaConfig, num_key_value_heads=2)).save_pretrained(path)
    return path


@pytest.fixture
def damaged(good, tmp_path):
    def make(kind):
        path = tmp_path / "ckpt"
        shutil.copytree(good, path)
        return path, DAMAGES[kind](path)

    return make


def assert_bad_input(argv, capsys, *named):
    code = main([str(arg) for arg in argv])
    err = capsys.readouterr().err
    assert code == EXIT_ERROR, err
    assert "Traceback" not in err
    line = next(line for line in err.splitlines() if line.startswith("fusegen: error: "))
    for name in named:
        assert name in line, line
    return line


@pytest.mark.parametrize("kind", sorted(DAMAGES))
def test_verify_bad_checkpoint(damaged, capsys, kind):
    path, named = damaged(kind)
    assert_bad_input(["verify", path, "--generated-dir", GENERATED, "--prompts", "1"], capsys, named)


@pytest.mark.parametrize("kind", sorted(DAMAGES))
def test_convert_bad_checkpoint(damaged, tmp_path, capsys, kind):
    path, named = damaged(kind)
    out = tmp_path / "out"
    assert_bad_input(["convert", path, out, "--model", "llama", "--generated-dir", GENERATED], capsys, named)
    assert not out.exists()


def test_verify_names_the_truncated_tensor(damaged, capsys):
    path, _ = damaged("truncated")
    line = assert_bad_input(["verify", path, "--generated-dir", GENERATED], capsys, "model.safetensors", "truncated")
    assert "tensor '" in line


def test_convert_unknown_model_type(good, tmp_path, capsys):
    argv = ["convert", good, tmp_path / "out", "--model", "nosuchmodel", "--generated-dir", GENERATED]
    assert_bad_input(argv, capsys, "fused_nosuchmodel.py")


@pytest.mark.parametrize("command_name", ["build", "report", "diff"])
def test_unknown_model_type(command_name, tmp_path, capsys):
    extra = ["--output-dir", tmp_path] if command_name == "build" else []
    assert_bad_input([command_name, "nosuchmodel", *extra], capsys, "nosuchmodel")


def test_report_unimportable_module(capsys):
    assert_bad_input(["report", "no_such_package.modeling_x"], capsys, "no_such_package")


@pytest.mark.slow
def test_build_into_a_file(tmp_path, capsys):
    (tmp_path / "afile").write_text("x")
    assert_bad_input(["build", "llama", "--output-dir", tmp_path / "afile"], capsys, "afile")


def test_build_check_on_a_file_that_is_not_utf8(tmp_path, capsys):
    (tmp_path / "fused_llama.py").write_bytes(b"\xff\xfe not text")
    assert_bad_input(["build", "--check", "--output-dir", tmp_path], capsys, "fused_llama.py")


def test_build_all_with_no_workers(tmp_path, capsys):
    assert_bad_input(["build", "--all", "--jobs", "0", "--output-dir", tmp_path], capsys, "--jobs")


def test_list_with_a_damaged_sweep_summary(tmp_path, capsys):
    (tmp_path / "fusegen-sweep.json").write_text("{broken")
    assert_bad_input(["list", "--output-dir", tmp_path], capsys, "fusegen-sweep.json")


def test_list_with_a_missing_directory(tmp_path, capsys):
    assert_bad_input(["list", "--output-dir", tmp_path / "nowhere"], capsys, "nowhere")


def test_a_bug_is_exit_3_with_its_traceback_never_1(capsys):
    @command
    def broken():
        raise KeyError("oops")

    assert broken() == EXIT_INTERNAL
    err = capsys.readouterr().err
    assert "Traceback" in err and "internal error" in err and "KeyError" in err


@pytest.mark.slow
def test_verify_from_the_shell(damaged):
    """The reported case: `fusegen verify` on a truncated model.safetensors printed a traceback and exited 1."""
    path, named = damaged("truncated")
    result = subprocess.run(
        [sys.executable, "-m", "fusegen", "verify", str(path), "--generated-dir", str(GENERATED)],
        capture_output=True,
        text=True,
        cwd=ROOT,
        check=False,
    )
    assert result.returncode == EXIT_ERROR, result.stderr
    assert "Traceback" not in result.stdout + result.stderr
    assert named in result.stderr.strip().splitlines()[-1]
