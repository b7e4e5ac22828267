"""`fusegen convert` (fused-layout checkpoints) and `fusegen verify` (fused vs original on a checkpoint)."""

from __future__ import annotations

import argparse
import hashlib
import json
from pathlib import Path

import pytest
import torch
from safetensors import safe_open
from safetensors.torch import load_file, save_file
from transformers import AutoModelForCausalLM, LlamaConfig, LlamaForCausalLM

from fusegen.runtime import load_checkpoint
from fusegen.testkit import MODELS, TOLERANCE, logits, model_classes, small_config
from fusegen.tools import convert, verify
from fusegen.tools.convert import convert_checkpoint
from generated.fused_llama import FusedLlamaForCausalLM

GENERATED = Path(__file__).resolve().parents[1] / "generated"


def parse(module, argv):
    """Parse `argv` with a parser holding only `module`'s subcommand, as cli.py will wire it."""
    parser = argparse.ArgumentParser(prog="fusegen")
    module.add_parser(parser.add_subparsers(dest="command", required=True))
    return parser.parse_args(argv)


def last_line(stderr: str) -> str:
    """The command's own message: Transformers' progress bars may precede it on stderr."""
    return stderr.strip().splitlines()[-1]


IDS = torch.arange(12).unsqueeze(0)


# --------------------------------------------------------------------------------------------------------------------
# convert
# --------------------------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("model_type", sorted(MODELS))
def test_convert_writes_a_fused_layout_that_loads(checkpoint, tmp_path, model_type):
    config_class, original_class, fused_class = model_classes(model_type)
    source, original = checkpoint(original_class, small_config(config_class, num_key_value_heads=2))
    out = convert_checkpoint(source, tmp_path / "fused", model_type, generated_dir=GENERATED)
    assert sorted(p.name for p in out.iterdir()) == ["config.json", "fused.safetensors", "generation_config.json"]
    with safe_open(out / "fused.safetensors", "pt") as handle:
        names, metadata = set(handle.keys()), handle.metadata()
        assert handle.get_slice("model.layers.0.self_attn.qkv_proj.weight").get_shape() == [128, 64]
    assert metadata["format"] == "pt" and metadata["fusegen_layout"] == "fused"
    assert "model.layers.1.mlp.gate_up_proj.weight" in names and not any("q_proj" in n for n in names)
    config = json.loads((out / "config.json").read_text())
    assert config["architectures"] == [fused_class.__name__] and config["fusegen_layout"] == "fused"
    assert config["model_type"] == model_type
    described = config["fusegen"]
    assert described["layout"] == "fused" and described["weights"] == "fused.safetensors"
    assert described["class"] == fused_class.__name__ and "qkv_proj" in described["stacked"]
    source_digest = hashlib.sha256((source / "model.safetensors").read_bytes()).hexdigest()
    assert described["source"]["files"]["model.safetensors"]["sha256"] == source_digest
    assert described["source"]["config_sha256"] == hashlib.sha256((source / "config.json").read_bytes()).hexdigest()
    assert json.loads(metadata["fusegen_source"]) == described["source"]

    model = fused_class(original.config)
    assert load_checkpoint(model, out).layout == "fused"
    assert torch.equal(logits(model, IDS), logits(original, IDS))


def test_convert_shards_and_keeps_dtype(checkpoint, tmp_path):
    source, original = checkpoint(
        LlamaForCausalLM, small_config(LlamaConfig, num_key_value_heads=1), dtype=torch.bfloat16
    )
    original = original.to(torch.bfloat16)
    LlamaForCausalLM.save_pretrained(original, source)
    out = convert_checkpoint(source, tmp_path / "fused", "llama", generated_dir=GENERATED, max_shard_size="20KB")
    assert (out / "fused.safetensors.index.json").exists()
    assert {tensor.dtype for tensor in load_file(next(out.glob("fused-*.safetensors"))).values()} == {torch.bfloat16}
    model = FusedLlamaForCausalLM(original.config).to(torch.bfloat16)
    load_checkpoint(model, out)
    assert torch.equal(logits(model, IDS), logits(original, IDS))


def test_original_class_refuses_a_fused_checkpoint_loudly(checkpoint, tmp_path):
    source, _ = checkpoint(LlamaForCausalLM, small_config(LlamaConfig, num_key_value_heads=2))
    out = convert_checkpoint(source, tmp_path / "fused", "llama", generated_dir=GENERATED)
    refusal = r"fusegen fused layout .*FusedLlamaForCausalLM"
    with pytest.raises(ValueError, match=refusal):
        LlamaForCausalLM.from_pretrained(out)
    with pytest.raises(ValueError, match=refusal):
        AutoModelForCausalLM.from_pretrained(out)
    with pytest.raises(ValueError, match=refusal):
        LlamaForCausalLM.from_pretrained(out, variant="fused")
    # Without that config entry the weights' file name still keeps the original class from loading garbage.
    config = json.loads((out / "config.json").read_text())
    del config["transformers_weights"]
    (out / "config.json").write_text(json.dumps(config))
    with pytest.raises(OSError, match="no file named model.safetensors"):
        LlamaForCausalLM.from_pretrained(out)


def test_convert_command(checkpoint, tmp_path, capsys):
    source, _ = checkpoint(LlamaForCausalLM, small_config(LlamaConfig, num_key_value_heads=2))
    args = parse(
        convert, ["convert", str(source), str(tmp_path / "out"), "--model", "llama", "--generated-dir", str(GENERATED)]
    )
    assert convert.run(args) == 0
    assert "fused layout" in capsys.readouterr().out
    assert (tmp_path / "out" / "fused.safetensors").exists()


@pytest.mark.parametrize(
    "problem, expected",
    [
        ("missing-source", "no config.json"),
        ("non-empty-out", "not an empty directory"),
        ("wrong-model", "not 'qwen2'"),
        ("no-generated-file", "fusegen build"),
        ("missing-tensor", "k_proj"),
    ],
)
def test_convert_bad_input_exits_2_and_writes_nothing(checkpoint, tmp_path, capsys, problem, expected):
    source, _ = checkpoint(LlamaForCausalLM, small_config(LlamaConfig, num_key_value_heads=2))
    out, model, generated = tmp_path / "out", "llama", GENERATED
    if problem == "missing-source":
        source = tmp_path / "nowhere"
    elif problem == "non-empty-out":
        out.mkdir()
        (out / "keep.txt").write_text("mine")
    elif problem == "wrong-model":
        model = "qwen2"
    elif problem == "no-generated-file":
        generated = tmp_path
    elif problem == "missing-tensor":
        state = load_file(source / "model.safetensors")
        del state["model.layers.1.self_attn.k_proj.weight"]
        save_file(state, str(source / "model.safetensors"), metadata={"format": "pt"})
    args = parse(convert, ["convert", str(source), str(out), "--model", model, "--generated-dir", str(generated)])
    assert convert.run(args) == 2
    error = last_line(capsys.readouterr().err)
    assert error.startswith("fusegen: error: ") and expected in error
    assert not out.exists() or [p.name for p in out.iterdir()] == ["keep.txt"]
    assert not list(tmp_path.glob(".out.partial*"))


def test_convert_rejects_a_bad_shard_size():
    with pytest.raises(SystemExit) as exit_info:
        parse(convert, ["convert", "a", "b", "--model", "llama", "--max-shard-size", "lots"])
    assert exit_info.value.code == 2


# --------------------------------------------------------------------------------------------------------------------
# verify
# --------------------------------------------------------------------------------------------------------------------


def verify_args(path, *extra, generated=GENERATED):
    return parse(verify, ["verify", str(path), "--generated-dir", str(generated), "--prompts", "2", *extra])


@pytest.mark.slow
@pytest.mark.parametrize("dtype", ["fp32", "bf16"])
@pytest.mark.parametrize("model_type", sorted(MODELS))
def test_verify_passes_on_a_good_checkpoint(checkpoint, capsys, model_type, dtype):
    config_class, original_class, _ = model_classes(model_type)
    path, _ = checkpoint(original_class, small_config(config_class, num_key_value_heads=2))
    assert verify.run(verify_args(path, "--dtype", dtype)) == 0
    out = capsys.readouterr().out
    assert "max abs logit diff" in out and "greedy-token agreement: " in out and "OK" in out
    if dtype == "fp32":
        diff = float(out.split("max abs logit diff: ")[1].split()[0])
        assert diff <= TOLERANCE


@pytest.mark.slow
def test_verify_reports_a_broken_fused_file_as_mismatch(checkpoint, tmp_path, capsys):
    path, _ = checkpoint(LlamaForCausalLM, small_config(LlamaConfig, num_key_value_heads=2))
    broken = tmp_path / "broken"
    broken.mkdir()
    text = (GENERATED / "fused_llama.py").read_text()
    swapped = text.replace("q_proj_out, k_proj_out, v_proj_out = ", "q_proj_out, v_proj_out, k_proj_out = ")
    assert swapped != text
    (broken / "fused_llama.py").write_text(swapped)
    assert verify.run(verify_args(path, generated=broken)) == 1
    assert "MISMATCH" in capsys.readouterr().out


@pytest.mark.parametrize("problem", ["empty-dir", "fused-layout", "missing-tensor", "no-generated-file"])
def test_verify_bad_input_exits_2(checkpoint, tmp_path, capsys, problem):
    path, _ = checkpoint(LlamaForCausalLM, small_config(LlamaConfig, num_key_value_heads=2))
    generated = GENERATED
    if problem == "empty-dir":
        path = tmp_path / "empty"
        path.mkdir()
    elif problem == "fused-layout":
        path = convert_checkpoint(path, tmp_path / "fused", "llama", generated_dir=GENERATED)
    elif problem == "missing-tensor":
        state = load_file(path / "model.safetensors")
        del state["model.norm.weight"]
        save_file(state, str(path / "model.safetensors"), metadata={"format": "pt"})
    elif problem == "no-generated-file":
        generated = tmp_path
    assert verify.run(verify_args(path, generated=generated)) == 2
    assert last_line(capsys.readouterr().err).startswith("fusegen: error: ")


def test_bf16_tolerance_is_relative_to_the_logit_scale():
    assert verify.tolerance("fp32", 100.0) == TOLERANCE
    assert verify.tolerance("bf16", 8.0) == 0.5
    assert verify.tolerance("bf16", 0.1) == verify.BF16_RELATIVE_TOLERANCE
