"""The load fast path: fused-layout checkpoints through `from_pretrained`, merged tensors built in place from the
file (fusegen/runtime/streaming.py), and bad checkpoints refused on these paths before anything is mapped."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
import torch
from safetensors import safe_open
from safetensors.torch import load_file, save_file
from transformers import LlamaConfig, LlamaForCausalLM

from fusegen.runtime import CheckpointError, files, load_checkpoint
from fusegen.runtime.streaming import concatenate_into_new, file_region, fill_from_file, reading_session
from fusegen.testkit import MODELS, logits, model_classes, small_config
from fusegen.tools.convert import convert_checkpoint
from generated.fused_llama import FusedLlamaForCausalLM, FusedLlamaModel

pytestmark = pytest.mark.slow  # fused-layout checkpoints written and loaded many ways, one in a fresh process

ROOT = Path(__file__).resolve().parents[1]
GENERATED = ROOT / "generated"
QKV = "model.layers.0.self_attn.qkv_proj.weight"
Q = "model.layers.0.self_attn.q_proj.weight"


IDS = torch.arange(12).unsqueeze(0)


def mapped_file(tensor: torch.Tensor) -> str | None:
    """The file whose memory mapping holds `tensor`'s data, or None for ordinary (anonymous) memory."""
    region = file_region(tensor.data_ptr())
    return None if region is None else Path(region.path).name


def fused_checkpoint(checkpoint, tmp_path, model_type="llama", **convert_kwargs):
    config_class, original_class, fused_class = model_classes(model_type)
    source, original = checkpoint(original_class, small_config(config_class, num_key_value_heads=2))
    out = convert_checkpoint(source, tmp_path / "fused", model_type, generated_dir=GENERATED, **convert_kwargs)
    return source, out, original, fused_class


# --------------------------------------------------------------------------------------------------------------------
# The fused layout through from_pretrained
# --------------------------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("shard_size", ["5GB", "20KB"])
@pytest.mark.parametrize("model_type", sorted(MODELS))
def test_fused_layout_loads_through_from_pretrained_zero_copy(checkpoint, tmp_path, model_type, shard_size):
    _, out, original, fused_class = fused_checkpoint(checkpoint, tmp_path, model_type, max_shard_size=shard_size)
    model = fused_class.from_pretrained(out)
    assert torch.equal(logits(model, IDS), logits(original, IDS))
    # The merged weight is a view of the fused file's mapping, as the original's weights are of theirs.
    assert mapped_file(model.model.layers[0].self_attn.qkv_proj.weight).startswith("fused")
    assert mapped_file(model.model.layers[1].mlp.gate_up_proj.weight).startswith("fused")


def test_fused_layout_through_from_pretrained_converts_dtype(checkpoint, tmp_path):
    _, out, original, _ = fused_checkpoint(checkpoint, tmp_path)
    model = FusedLlamaForCausalLM.from_pretrained(out, dtype=torch.bfloat16)
    weight = model.model.layers[0].self_attn.qkv_proj.weight
    assert weight.dtype == torch.bfloat16
    expected = torch.cat(
        [original.model.layers[0].self_attn.q_proj.weight, original.model.layers[0].self_attn.k_proj.weight]
    )
    assert torch.equal(weight[: expected.shape[0]], expected.to(torch.bfloat16))


def test_fused_layout_base_model_and_explicit_config(checkpoint, tmp_path):
    _, out, original, _ = fused_checkpoint(checkpoint, tmp_path)
    base = FusedLlamaModel.from_pretrained(out)
    assert torch.equal(base.layers[0].self_attn.qkv_proj.weight[:64], original.model.layers[0].self_attn.q_proj.weight)
    model = FusedLlamaForCausalLM.from_pretrained(out, config=original.config)
    assert torch.equal(logits(model, IDS), logits(original, IDS))


def test_model_loaded_from_fused_layout_saves_the_canonical_one(checkpoint, tmp_path):
    _, out, original, _ = fused_checkpoint(checkpoint, tmp_path)
    model = FusedLlamaForCausalLM.from_pretrained(out)
    assert not hasattr(model.config, "fusegen") and not hasattr(model.config, "fusegen_layout")
    model.save_pretrained(tmp_path / "saved")
    saved = json.loads((tmp_path / "saved" / "config.json").read_text())
    assert "fusegen" not in saved and "transformers_weights" not in saved
    assert torch.equal(logits(LlamaForCausalLM.from_pretrained(tmp_path / "saved"), IDS), logits(original, IDS))


def test_fused_layout_with_another_row_order_is_refused(checkpoint, tmp_path):
    _, out, _, _ = fused_checkpoint(checkpoint, tmp_path)
    path = out / "fused.safetensors"
    with safe_open(path, "pt") as handle:
        metadata = handle.metadata()
    stacked = json.loads(metadata["fusegen_stacked"])
    stacked["qkv_proj"] = [stacked["qkv_proj"][1], stacked["qkv_proj"][0], stacked["qkv_proj"][2]]
    save_file(load_file(path), str(path), metadata={**metadata, "fusegen_stacked": json.dumps(stacked)})
    with pytest.raises(CheckpointError, match="merged rows of qkv_proj"):
        FusedLlamaForCausalLM.from_pretrained(out)


# --------------------------------------------------------------------------------------------------------------------
# The canonical layout: merged tensors allocated once, pieces read from the file
# --------------------------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("model_type", sorted(MODELS))
def test_canonical_from_pretrained_matches_the_original(checkpoint, model_type, dtype):
    """fp32 reads the pieces from the file; bf16 converts them (Transformers casts each piece) and copies."""
    config_class, original_class, fused_class = model_classes(model_type)
    path, _ = checkpoint(original_class, small_config(config_class, num_key_value_heads=1))
    original = original_class.from_pretrained(path, dtype=dtype)
    model = fused_class.from_pretrained(path, dtype=dtype)
    attention = original.model.layers[1].self_attn
    for leaf in ("weight", "bias") if model_type == "qwen2" else ("weight",):
        pieces = [getattr(getattr(attention, name), leaf) for name in ("q_proj", "k_proj", "v_proj")]
        assert torch.equal(getattr(model.model.layers[1].self_attn.qkv_proj, leaf), torch.cat(pieces))
    assert mapped_file(model.model.layers[0].self_attn.qkv_proj.weight) is None  # new memory, not the file's
    assert torch.equal(logits(model, IDS), logits(original, IDS))


def test_sharded_canonical_from_pretrained(checkpoint):
    path, original = checkpoint(
        LlamaForCausalLM, small_config(LlamaConfig, num_key_value_heads=2), max_shard_size="20KB"
    )
    assert (path / "model.safetensors.index.json").exists()
    assert torch.equal(logits(FusedLlamaForCausalLM.from_pretrained(path), IDS), logits(original, IDS))


def test_pieces_of_a_mapped_file_are_read_from_the_file(tmp_path):
    tensors = {name: torch.randn(rows, 8) for name, rows in (("q", 4), ("k", 2), ("v", 2))}
    save_file(tensors, str(tmp_path / "x.safetensors"))
    with safe_open(tmp_path / "x.safetensors", "pt") as handle:
        views = [handle.get_slice(name)[...] for name in ("q", "k", "v")]
        assert mapped_file(views[0]) == "x.safetensors"
        destination = torch.empty(2, 8)
        assert fill_from_file(destination, views[1]) and torch.equal(destination, tensors["k"])
        assert not fill_from_file(destination, tensors["k"].clone())  # ordinary memory: the caller copies
        assert not fill_from_file(torch.empty(2, 8, dtype=torch.float64), views[1])  # conversion: the caller copies
        with reading_session():
            merged = concatenate_into_new(views, 0)
            again = concatenate_into_new(views, 0)
        assert torch.equal(merged, torch.cat(list(tensors.values()))) and torch.equal(again, merged)
        assert mapped_file(merged) is None


def test_concatenate_into_new_is_torch_cat():
    pieces = [torch.randn(3, 5), torch.randn(2, 5).double(), torch.randn(1, 5)]
    for dim, inputs in ((0, pieces), (1, [p.T for p in pieces])):
        merged = concatenate_into_new(list(inputs), dim)
        assert merged.dtype == torch.float64 and torch.equal(merged, torch.cat(inputs, dim=dim))
    with pytest.raises(RuntimeError):
        concatenate_into_new([torch.zeros(2, 3), torch.zeros(2, 4)], 0)


def test_only_the_mapped_file_itself_is_read(tmp_path):
    """The file is found by the mapping's inode: a renamed file is still read (its bytes are the view's); a file
    deleted and recreated under the same name is another inode and is not read (the caller copies instead)."""
    path = tmp_path / "x.safetensors"
    save_file({"a": torch.ones(4, 4)}, str(path))
    with safe_open(path, "pt") as handle:
        view = handle.get_slice("a")[...]
        os.replace(path, tmp_path / "renamed.safetensors")
        save_file({"a": torch.zeros(4, 4)}, str(path))
        destination = torch.zeros(4, 4)
        assert fill_from_file(destination, view) and torch.equal(destination, torch.ones(4, 4))
        os.unlink(tmp_path / "renamed.safetensors")
        assert not fill_from_file(destination, view)


def test_load_checkpoint_converts_in_chunks(checkpoint, monkeypatch):
    path, original = checkpoint(LlamaForCausalLM, small_config(LlamaConfig, num_key_value_heads=2))
    monkeypatch.setattr(files, "_BOUNCE_BYTES", 1000)  # several chunks per tensor, and a ragged last one
    model = FusedLlamaForCausalLM(original.config).to(torch.float64)
    load_checkpoint(model, path)
    expected = torch.cat(
        [original.model.layers[0].self_attn.q_proj.weight, original.model.layers[0].self_attn.k_proj.weight]
    )
    assert torch.equal(model.model.layers[0].self_attn.qkv_proj.weight[:96], expected.double())


# --------------------------------------------------------------------------------------------------------------------
# Bad checkpoints on these paths: CheckpointError, never SIGBUS
# --------------------------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("dtype", [None, torch.bfloat16])
@pytest.mark.parametrize("layout", ["canonical", "fused"])
def test_truncated_file_is_refused_by_from_pretrained(checkpoint, tmp_path, layout, dtype):
    source, out, _, _ = fused_checkpoint(checkpoint, tmp_path)
    path = (source if layout == "canonical" else out) / (
        "model.safetensors" if layout == "canonical" else "fused.safetensors"
    )
    path.write_bytes(path.read_bytes()[:-100])
    with pytest.raises(CheckpointError, match="truncated") as error:
        FusedLlamaForCausalLM.from_pretrained(path.parent, dtype=dtype)
    assert error.value.tensor is not None and path.name in str(error.value)


def test_index_escaping_the_directory_is_refused_by_from_pretrained(checkpoint, tmp_path):
    path, _ = checkpoint(LlamaForCausalLM, small_config(LlamaConfig, num_key_value_heads=2), max_shard_size="20KB")
    index = json.loads((path / "model.safetensors.index.json").read_text())
    shard = index["weight_map"][Q]
    os.replace(path / shard, tmp_path / shard)
    index["weight_map"] = {k: (f"../{shard}" if v == shard else v) for k, v in index["weight_map"].items()}
    (path / "model.safetensors.index.json").write_text(json.dumps(index))
    with pytest.raises(CheckpointError, match="escapes the checkpoint directory"):
        FusedLlamaForCausalLM.from_pretrained(path)


def test_tensor_in_two_shards_is_refused_by_from_pretrained(checkpoint, tmp_path):
    path, _ = checkpoint(LlamaForCausalLM, small_config(LlamaConfig, num_key_value_heads=2), max_shard_size="20KB")
    index = json.loads((path / "model.safetensors.index.json").read_text())
    shard = index["weight_map"][Q]
    other = next(v for v in index["weight_map"].values() if v != shard)
    extra = {**load_file(path / other), Q: load_file(path / shard)[Q]}
    save_file(extra, str(path / other), metadata={"format": "pt"})
    with pytest.raises(CheckpointError, match="two shards"):
        FusedLlamaForCausalLM.from_pretrained(path)


def test_pickle_only_checkpoint_is_refused_by_from_pretrained_unless_allowed(tmp_path):
    original = LlamaForCausalLM(small_config(LlamaConfig, num_key_value_heads=2))
    (tmp_path / "bin").mkdir()
    original.config.save_pretrained(tmp_path / "bin")
    torch.save(dict(original.state_dict()), tmp_path / "bin" / "pytorch_model.bin")
    with pytest.raises(CheckpointError, match="pickle"):
        FusedLlamaForCausalLM.from_pretrained(tmp_path / "bin")
    model = FusedLlamaForCausalLM.from_pretrained(tmp_path / "bin", allow_pickle=True)
    assert torch.equal(logits(model, IDS), logits(original, IDS))


CUT_AFTER_VALIDATION = textwrap.dedent("""
    import os, sys, torch
    from safetensors import safe_open
    from safetensors.torch import save_file
    from fusegen.runtime import CheckpointError
    from fusegen.runtime.loading import execute_plan, open_checkpoint, plan_load
    from fusegen.runtime.streaming import fill_from_file
    from generated.fused_llama import FusedLlamaForCausalLM
    from transformers import LlamaConfig, LlamaForCausalLM
    from fusegen.testkit import small_config

    directory = sys.argv[1]
    config = small_config(LlamaConfig, num_key_value_heads=2)
    LlamaForCausalLM(config).save_pretrained(directory)
    weights = os.path.join(directory, "model.safetensors")
    size = os.path.getsize(weights)

    # load_checkpoint, converting bf16 <- fp32: the file is cut after it was validated.
    model = FusedLlamaForCausalLM(config).to(torch.bfloat16)
    with open_checkpoint(directory) as checkpoint:
        plan = plan_load(model, checkpoint)
        os.truncate(weights, 4096)
        try:
            execute_plan(plan, checkpoint)
        except CheckpointError as error:
            print("load_checkpoint:", "partially loaded" in str(error))

    # from_pretrained's merge: a piece that is a view of a mapping whose file was then cut.
    LlamaForCausalLM(config).save_pretrained(directory)
    with safe_open(weights, "pt") as handle:
        view = handle.get_slice("model.layers.1.self_attn.v_proj.weight")[...]
        os.truncate(weights, 4096)
        try:
            fill_from_file(torch.empty_like(view), view)
        except CheckpointError as error:
            print("from_pretrained merge:", "model.safetensors" in str(error))
    """)


def test_file_cut_after_validation_raises_not_sigbus(tmp_path):
    """Run in a child process: a regression here would be a SIGBUS, which must not take the test run down."""
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")])}
    result = subprocess.run(
        [sys.executable, "-c", CUT_AFTER_VALIDATION, str(tmp_path / "ckpt")],
        check=False,
        capture_output=True,
        text=True,
        env=env,
        cwd=ROOT,
        timeout=300,
    )
    assert result.returncode == 0, (result.returncode, result.stderr[-2000:])
    assert result.stdout.split("\n")[:2] == ["load_checkpoint: True", "from_pretrained merge: True"], result.stdout
