"""fusegen.runtime.loading: streaming load into merged parameters, canonical save, and refusal of bad checkpoints.

Every bad-input test also checks the model was left untouched: validation happens before any data is copied.
"""

from __future__ import annotations

import json
import os
import pickle
import warnings

import pytest
import torch
from safetensors import safe_open
from safetensors.torch import load_file, save_file
from transformers import LlamaConfig, LlamaForCausalLM

from fusegen.runtime import CheckpointError, load_checkpoint, load_weights, save_checkpoint
from fusegen.runtime.loading import FUSED, LAYOUT_KEY, STACKED_KEY, open_checkpoint, parse_size, write_safetensors
from fusegen.testkit import MODELS, logits, model_classes, random_model, small_config
from generated.fused_llama import STACKED_PARAMS_MAPPING, FusedLlamaForCausalLM

Q = "model.layers.0.self_attn.q_proj.weight"
QKV = "model.layers.0.self_attn.qkv_proj.weight"
FUSED_METADATA = {"format": "pt", LAYOUT_KEY: FUSED, STACKED_KEY: json.dumps(STACKED_PARAMS_MAPPING)}


def llama_config(**overrides):
    return small_config(LlamaConfig, num_key_value_heads=2, **overrides)


def canonical_state(config, seed=0) -> dict[str, torch.Tensor]:
    """A random original-class state dict as Transformers would save it (tied lm_head omitted)."""
    model = random_model(LlamaForCausalLM, config, seed=seed)
    state = {name: tensor.contiguous() for name, tensor in model.state_dict().items()}
    if config.tie_word_embeddings:
        del state["lm_head.weight"]
    return state


def write_single(directory, state, metadata=None, name="model.safetensors"):
    directory.mkdir(parents=True, exist_ok=True)
    save_file(state, str(directory / name), metadata=metadata or {"format": "pt"})
    return directory


def write_sharded(directory, state, shards=2, stem="model", index_overrides=None, metadata=None):
    """Split `state` round-robin into `shards` files plus an index; `index_overrides` edits the weight_map."""
    directory.mkdir(parents=True, exist_ok=True)
    names = list(state)
    weight_map = {}
    for i in range(shards):
        file = f"{stem}-{i + 1:05d}-of-{shards:05d}.safetensors"
        part = {name: state[name] for name in names[i::shards]}
        save_file(part, str(directory / file), metadata=metadata or {"format": "pt"})
        weight_map.update(dict.fromkeys(part, file))
    weight_map.update(index_overrides or {})
    index = {"metadata": {"total_size": 0}, "weight_map": weight_map}
    (directory / f"{stem}.safetensors.index.json").write_text(json.dumps(index))
    return directory


def snapshot(model):
    return {name: tensor.clone() for name, tensor in model.state_dict().items()}


def assert_untouched(model, before):
    after = model.state_dict()
    assert all(torch.equal(before[name], after[name]) for name in before), "model was modified by a failed load"


def refused(fused, path, match=None, **kwargs) -> CheckpointError:
    """`load_checkpoint(model, path, **kwargs)` of the `fused` fixture's model raises a `CheckpointError` matching
    `match`, and every tensor of the model keeps its value; returns the error."""
    model, before = fused
    with pytest.raises(CheckpointError, match=match) as error:
        load_checkpoint(model, path, **kwargs)
    assert_untouched(model, before)
    return error.value


@pytest.fixture
def fused():
    """A fresh fused model and its snapshot, to check failed loads leave it alone."""
    model = FusedLlamaForCausalLM(llama_config())
    return model, snapshot(model)


IDS = torch.arange(10).unsqueeze(0)


# --------------------------------------------------------------------------------------------------------------------
# Loading good checkpoints
# --------------------------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("kv_heads", [4, 2, 1])
@pytest.mark.parametrize("model_type", sorted(MODELS))
def test_canonical_checkpoint_loads_into_merged_slices(checkpoint, model_type, kv_heads):
    config_class, original_class, fused_class = model_classes(model_type)
    path, original = checkpoint(original_class, small_config(config_class, num_key_value_heads=kv_heads))
    model = fused_class(original.config)
    report = load_checkpoint(model, path)
    assert report.layout == "canonical" and report.unexpected == ()
    attention = original.model.layers[1].self_attn
    expected = torch.cat([attention.q_proj.weight, attention.k_proj.weight, attention.v_proj.weight])
    assert torch.equal(model.model.layers[1].self_attn.qkv_proj.weight, expected)
    assert torch.equal(logits(model, IDS), logits(original, IDS))


def test_sharded_transformers_checkpoint_loads(checkpoint):
    path, original = checkpoint(LlamaForCausalLM, llama_config(), max_shard_size="20KB")
    assert (path / "model.safetensors.index.json").exists()
    model = FusedLlamaForCausalLM(original.config)
    assert len(load_checkpoint(model, path).files) > 1
    assert torch.equal(logits(model, IDS), logits(original, IDS))


@pytest.mark.parametrize("tie", [True, False])
def test_tied_lm_head_may_be_missing(checkpoint, tie):
    path, original = checkpoint(LlamaForCausalLM, llama_config(tie_word_embeddings=tie))
    assert ("lm_head.weight" in load_file(path / "model.safetensors")) is not tie
    model = FusedLlamaForCausalLM(original.config)
    load_checkpoint(model, path)
    assert (model.lm_head.weight is model.model.embed_tokens.weight) is tie
    assert torch.equal(model.lm_head.weight, original.lm_head.weight)


def test_tied_model_accepts_a_checkpoint_that_also_holds_lm_head(tmp_path):
    config = llama_config(tie_word_embeddings=True)
    state = canonical_state(config)
    state["lm_head.weight"] = state["model.embed_tokens.weight"].clone()
    model = FusedLlamaForCausalLM(config)
    assert load_checkpoint(model, write_single(tmp_path / "ckpt", state)).unexpected == ()


def test_dtype_is_converted_per_tensor(tmp_path):
    config = llama_config()
    state = {name: tensor.to(torch.bfloat16) for name, tensor in canonical_state(config).items()}
    model = FusedLlamaForCausalLM(config)
    load_checkpoint(model, write_single(tmp_path / "bf16", state))
    assert model.model.layers[0].self_attn.qkv_proj.weight.dtype == torch.float32
    assert torch.equal(model.model.layers[0].self_attn.qkv_proj.weight[:64], state[Q].float())


def test_fused_layout_loads(tmp_path):
    config = llama_config()
    source = random_model(FusedLlamaForCausalLM, config)
    tensors = ((name, tensor) for name, tensor in source.state_dict().items())
    write_safetensors(tmp_path / "fused", "fused", tensors, metadata=FUSED_METADATA, max_shard_size="20KB")
    model = FusedLlamaForCausalLM(config)
    report = load_checkpoint(model, tmp_path / "fused")
    assert report.layout == "fused" and len(report.files) > 1
    assert torch.equal(logits(model, IDS), logits(source, IDS))


def test_explicit_stacked_mapping_is_used(fused, tmp_path):
    model, _ = fused
    swapped = {**STACKED_PARAMS_MAPPING, "gate_up_proj": [("up_proj", 1), ("gate_proj", 0)]}
    state = canonical_state(llama_config())
    load_checkpoint(model, write_single(tmp_path / "ckpt", state), stacked=swapped)
    rows = model.model.layers[0].mlp.gate_up_proj.weight
    assert torch.equal(rows[:96], state["model.layers.0.mlp.up_proj.weight"])


def test_allowed_roots_admits_symlinked_blobs(tmp_path):
    """The hub cache layout: snapshot files are symlinks into a sibling blobs/ directory."""
    config = llama_config()
    blobs = write_single(tmp_path / "blobs", canonical_state(config), name="abc123")
    snapshot_dir = tmp_path / "snapshots" / "rev"
    snapshot_dir.mkdir(parents=True)
    (snapshot_dir / "model.safetensors").symlink_to(blobs / "abc123")
    with pytest.raises(CheckpointError, match="outside the checkpoint directory"):
        load_checkpoint(FusedLlamaForCausalLM(config), snapshot_dir)
    load_checkpoint(FusedLlamaForCausalLM(config), snapshot_dir, allowed_roots=[blobs])


# --------------------------------------------------------------------------------------------------------------------
# Bad checkpoints: each raises CheckpointError naming the file (and tensor), before touching the model
# --------------------------------------------------------------------------------------------------------------------


def test_missing_tensor(fused, tmp_path):
    state = canonical_state(llama_config())
    del state["model.layers.1.self_attn.k_proj.weight"]
    path = write_single(tmp_path / "ckpt", state)
    error = refused(fused, path)
    assert error.tensor == "model.layers.1.self_attn.k_proj.weight"
    assert "model.safetensors" in str(error) and "k_proj" in str(error)


def test_missing_tensor_is_fatal_even_when_not_strict(fused, tmp_path):
    state = canonical_state(llama_config())
    del state["model.norm.weight"]
    refused(fused, write_single(tmp_path / "ckpt", state), strict=False, match="model.norm.weight")


# allow_missing=True: Transformers' contract for a parameter the checkpoint lacks entirely (reported, initialised as the
# original initialises it); a merged parameter filled in part, or whose pieces map nowhere, still raises.


def without_pieces(config, *names):
    state = canonical_state(config)
    for name in names:
        del state[name]
    return state


def test_allow_missing_initialises_a_merged_parameter_without_any_piece_as_from_pretrained_and_the_original(tmp_path):
    """Same seed, same numbers: the fused merged parameter load_checkpoint initialises equals what
    FusedLlamaForCausalLM.from_pretrained and the ORIGINAL LlamaForCausalLM.from_pretrained initialise (the original's
    gate_proj and up_proj rows, stacked); every other tensor is the checkpoint's."""
    config = llama_config(initializer_range=0.5)
    gate, up = "model.layers.0.mlp.gate_proj.weight", "model.layers.0.mlp.up_proj.weight"
    path = write_single(tmp_path / "ckpt", without_pieces(config, gate, up))
    config.save_pretrained(path)
    with pytest.raises(CheckpointError, match="missing from the canonical checkpoint") as error:
        load_checkpoint(FusedLlamaForCausalLM(config), path)  # the default stays: a missing tensor is fatal
    assert error.value.tensor == gate
    model = FusedLlamaForCausalLM(config)
    merged = model.model.layers[0].mlp.gate_up_proj.weight
    with torch.no_grad():
        merged.fill_(float("nan"))
    torch.manual_seed(7)
    report = load_checkpoint(model, path, allow_missing=True)
    assert report.missing == ("model.layers.0.mlp.gate_up_proj.weight",)
    assert not torch.isnan(merged).any() and abs(merged.std().item() - 0.5) < 0.05
    torch.manual_seed(7)
    reference, info = FusedLlamaForCausalLM.from_pretrained(path, output_loading_info=True)
    assert info["missing_keys"] == set(report.missing)
    torch.manual_seed(7)
    original = LlamaForCausalLM.from_pretrained(path)
    pieces = torch.cat([original.get_parameter(gate), original.get_parameter(up)])
    assert torch.equal(merged, pieces)
    ours, theirs = model.state_dict(), reference.state_dict()
    assert sorted(ours) == sorted(theirs) and all(torch.equal(ours[name], theirs[name]) for name in ours)


def test_allow_missing_initialises_an_ordinary_missing_tensor(tmp_path):
    config = llama_config()
    path = write_single(tmp_path / "ckpt", without_pieces(config, "model.norm.weight"))
    model = FusedLlamaForCausalLM(config)
    with torch.no_grad():
        model.model.norm.weight.fill_(3.0)
    report = load_checkpoint(model, path, allow_missing=True)
    assert report.missing == ("model.norm.weight",)
    assert torch.equal(model.model.norm.weight, torch.ones_like(model.model.norm.weight))  # RMSNorm's own init


def test_allow_missing_still_refuses_a_partial_piece_set(fused, tmp_path):
    """k_proj absent, q_proj and v_proj present: the merged rows would mix loaded and random values."""
    path = write_single(tmp_path / "ckpt", without_pieces(llama_config(), "model.layers.1.self_attn.k_proj.weight"))
    error = refused(fused, path, match="filled in part", allow_missing=True, strict=False)
    assert error.tensor == "model.layers.1.self_attn.k_proj.weight"
    assert "model.layers.1.self_attn.qkv_proj.weight" in str(error) and "q_proj" in str(error)


def test_allow_missing_still_refuses_pieces_that_map_nowhere(fused, tmp_path):
    """The checkpoint holds layer 0's gate_proj/up_proj under a parent the model lacks: they map nowhere, and the
    model's gate_up_proj would be random. Raised even with strict=False (which only tolerates harmless extras)."""
    state = canonical_state(llama_config())
    for piece in ("gate_proj", "up_proj"):
        state[f"model.layers.0.ffn.{piece}.weight"] = state.pop(f"model.layers.0.mlp.{piece}.weight")
    error = refused(
        fused, write_single(tmp_path / "ckpt", state), match="maps nowhere", allow_missing=True, strict=False
    )
    assert error.tensor == "model.layers.0.ffn.gate_proj.weight"
    assert "model.layers.0.mlp.gate_up_proj.weight" in str(error)


def test_allow_missing_needs_a_pretrained_model(tmp_path):
    path = write_single(tmp_path / "ckpt", {"weight": torch.zeros(2, 2)})
    with pytest.raises(ValueError, match="initialize_weights"):
        load_checkpoint(torch.nn.Linear(2, 3), path, allow_missing=True)


def test_unexpected_tensor_strict(fused, tmp_path):
    state = {**canonical_state(llama_config()), "model.extra.weight": torch.zeros(3)}
    error = refused(fused, write_single(tmp_path / "ckpt", state), match="unexpected")
    assert error.tensor == "model.extra.weight" and "model.safetensors" in str(error)


def test_unexpected_tensors_non_strict_warn_once_listing_all(checkpoint, tmp_path):
    config = llama_config()
    state = {**canonical_state(config), "extra.a": torch.zeros(1), "extra.b": torch.zeros(2)}
    model = FusedLlamaForCausalLM(config)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        report = load_checkpoint(model, write_single(tmp_path / "ckpt", state), strict=False)
    messages = [str(w.message) for w in caught if "unexpected" in str(w.message)]
    assert len(messages) == 1 and "extra.a" in messages[0] and "extra.b" in messages[0]
    assert report.unexpected == ("extra.a", "extra.b")
    assert torch.equal(model.model.layers[0].self_attn.qkv_proj.weight[:64], state[Q])


def test_wrong_shape_names_both_shapes(fused, tmp_path):
    state = canonical_state(llama_config())
    state["model.layers.0.self_attn.v_proj.weight"] = torch.zeros(16, 64)
    error = refused(fused, write_single(tmp_path / "ckpt", state))
    message = str(error)
    assert "[16, 64]" in message and "[32, 64]" in message and "v_proj" in message and "model.safetensors" in message


def test_float_checkpoint_cannot_fill_integer_or_vice_versa(fused, tmp_path):
    state = canonical_state(llama_config())
    state["model.norm.weight"] = torch.ones(64, dtype=torch.int32)
    refused(fused, write_single(tmp_path / "ckpt", state), match="dtype torch.int32")


def test_truncated_file_names_the_tensor_cut_off(fused, tmp_path):
    path = write_single(tmp_path / "ckpt", canonical_state(llama_config()))
    data = (path / "model.safetensors").read_bytes()
    (path / "model.safetensors").write_bytes(data[:-100])
    error = refused(fused, path, match="truncated")
    assert error.tensor is not None and "model.safetensors" in str(error)


@pytest.mark.parametrize("damage", ["empty", "short-header", "garbage-json"])
def test_corrupt_file(fused, tmp_path, damage):
    path = write_single(tmp_path / "ckpt", canonical_state(llama_config()))
    data = (path / "model.safetensors").read_bytes()
    corrupted = {
        "empty": b"",
        "short-header": data[:20],
        "garbage-json": data[:8] + b"{" * (len(data) - 8),
    }[damage]
    (path / "model.safetensors").write_bytes(corrupted)
    refused(fused, path, match="model.safetensors")


def test_corrupt_shard_among_good_ones_loads_nothing(fused, tmp_path):
    path = write_sharded(tmp_path / "ckpt", canonical_state(llama_config()), shards=3)
    last = path / "model-00003-of-00003.safetensors"
    last.write_bytes(last.read_bytes()[:-8])
    refused(fused, path, match="00003")


def test_index_naming_a_missing_shard(fused, tmp_path):
    path = write_sharded(tmp_path / "ckpt", canonical_state(llama_config()), index_overrides={Q: "gone.safetensors"})
    error = refused(fused, path, match="gone.safetensors")
    assert error.tensor == Q and "index.json" in str(error)


@pytest.mark.parametrize("shard", ["../outside.safetensors", "sub/../../outside.safetensors", "/etc/passwd", "C:\\x"])
def test_index_shard_path_escaping_the_directory_is_refused(fused, tmp_path, shard):
    state = canonical_state(llama_config())
    write_single(tmp_path, {Q: state[Q]}, name="outside.safetensors")
    path = write_sharded(tmp_path / "ckpt", state, index_overrides={Q: shard})
    error = refused(fused, path, match="escapes the checkpoint directory")
    assert error.tensor == Q


def test_index_shard_symlink_pointing_outside_is_refused(fused, tmp_path):
    path = write_sharded(tmp_path / "ckpt", canonical_state(llama_config()))
    shard = path / "model-00002-of-00002.safetensors"
    os.replace(shard, tmp_path / "elsewhere.safetensors")
    shard.symlink_to(tmp_path / "elsewhere.safetensors")
    refused(fused, path, match="outside the checkpoint directory")


def test_symlink_inside_the_directory_is_fine(tmp_path):
    config = llama_config()
    path = write_sharded(tmp_path / "ckpt", canonical_state(config))
    (path / "sub").mkdir()
    os.replace(path / "model-00001-of-00002.safetensors", path / "sub" / "real.safetensors")
    (path / "model-00001-of-00002.safetensors").symlink_to(path / "sub" / "real.safetensors")
    load_checkpoint(FusedLlamaForCausalLM(config), path)


def test_same_tensor_in_two_shards(fused, tmp_path):
    state = canonical_state(llama_config())
    path = write_sharded(tmp_path / "ckpt", state)
    save_file({Q: state[Q]}, str(path / "extra.safetensors"), metadata={"format": "pt"})
    index = json.loads((path / "model.safetensors.index.json").read_text())
    index["weight_map"]["model.extra"] = "extra.safetensors"  # makes the index open extra.safetensors too
    (path / "model.safetensors.index.json").write_text(json.dumps(index))
    error = refused(fused, path, match="two shards")
    assert error.tensor == Q


def test_index_listing_a_tensor_twice(fused, tmp_path):
    path = write_sharded(tmp_path / "ckpt", canonical_state(llama_config()))
    index_file = path / "model.safetensors.index.json"
    text = index_file.read_text().replace(
        '"weight_map": {', f'"weight_map": {{"{Q}": "model-00002-of-00002.safetensors", ', 1
    )
    index_file.write_text(text)
    error = refused(fused, path, match="listed twice")
    assert error.tensor == Q


def test_index_disagreeing_with_the_shard_headers(fused, tmp_path):
    state = canonical_state(llama_config())
    path = write_sharded(tmp_path / "ckpt", state)
    with safe_open(path / "model-00001-of-00002.safetensors", "pt") as handle:
        first = next(iter(handle.keys()))
    write_sharded(path, state, index_overrides={first: "model-00002-of-00002.safetensors"})
    refused(fused, path, match="does not hold it")


def test_unreadable_index(fused, tmp_path):
    path = write_sharded(tmp_path / "ckpt", canonical_state(llama_config()))
    (path / "model.safetensors.index.json").write_text("{not json")
    refused(fused, path, match="unreadable index")


def test_pickle_only_checkpoint_is_refused_unless_allowed(tmp_path):
    config = llama_config()
    (tmp_path / "bin").mkdir()
    torch.save(canonical_state(config), tmp_path / "bin" / "pytorch_model.bin")
    model = FusedLlamaForCausalLM(config)
    before = snapshot(model)
    with pytest.raises(CheckpointError, match="pickle") as error:
        load_checkpoint(model, tmp_path / "bin")
    assert "pytorch_model.bin" in str(error.value)
    assert_untouched(model, before)
    assert load_checkpoint(model, tmp_path / "bin", allow_pickle=True).layout == "canonical"
    assert torch.equal(model.model.layers[0].self_attn.qkv_proj.weight[:64], canonical_state(config)[Q])


def test_pickle_with_code_is_refused_even_when_allowed(tmp_path):
    (tmp_path / "bin").mkdir()

    class Evil:
        def __reduce__(self):
            return (os.system, ("true",))

    (tmp_path / "bin" / "pytorch_model.bin").write_bytes(pickle.dumps({"x": Evil()}, protocol=2))
    with pytest.raises(CheckpointError, match="unreadable pickle"):
        load_checkpoint(FusedLlamaForCausalLM(llama_config()), tmp_path / "bin", allow_pickle=True)


def test_safetensors_preferred_over_pickle(tmp_path):
    config = llama_config()
    path = write_single(tmp_path / "both", canonical_state(config))
    (path / "pytorch_model.bin").write_bytes(b"not even a pickle")
    assert load_checkpoint(FusedLlamaForCausalLM(config), path).files == (path / "model.safetensors",)


def test_empty_directory(fused, tmp_path):
    (tmp_path / "empty").mkdir()
    error = refused(fused, tmp_path / "empty", match="no weights")
    assert "empty" in str(error)


def test_not_a_directory(fused, tmp_path):
    refused(fused, tmp_path / "nope", match="not a checkpoint directory")


def test_single_file_and_index_together_are_ambiguous(fused, tmp_path):
    state = canonical_state(llama_config())
    path = write_sharded(tmp_path / "ckpt", state)
    write_single(path, state)
    refused(fused, path, match="stale")


def test_canonical_and_fused_files_together_are_ambiguous(fused, tmp_path):
    state = canonical_state(llama_config())
    path = write_single(tmp_path / "ckpt", state)
    write_single(path, state, name="fused.safetensors", metadata=FUSED_METADATA)
    refused(fused, path, match="ambiguous")


def test_mixed_layouts_across_shards(fused, tmp_path):
    path = write_sharded(tmp_path / "ckpt", canonical_state(llama_config()))
    second = path / "model-00002-of-00002.safetensors"
    save_file(load_file(second), str(second), metadata=FUSED_METADATA)
    refused(fused, path, match="mixed shards")


def test_fused_checkpoint_with_another_row_order_is_refused(fused, tmp_path):
    source = random_model(FusedLlamaForCausalLM, llama_config())
    swapped = {**STACKED_PARAMS_MAPPING, "qkv_proj": [("k_proj", "k"), ("q_proj", "q"), ("v_proj", "v")]}
    metadata = {**FUSED_METADATA, STACKED_KEY: json.dumps(swapped)}
    path = write_single(tmp_path / "ckpt", dict(source.state_dict()), metadata=metadata, name="fused.safetensors")
    refused(fused, path, match="merged rows")


def test_canonical_names_in_a_fused_checkpoint_are_reported_as_a_layout_mix_up(fused, tmp_path):
    path = write_single(tmp_path / "ckpt", canonical_state(llama_config()), metadata=FUSED_METADATA)
    refused(fused, path, match="wrong layout or model")


def test_file_cut_after_validation_is_reported_not_ignored(tmp_path):
    """The one failure that can only surface mid-copy; the error says the model is partially loaded."""
    from fusegen.runtime.loading import execute_plan, plan_load

    model = FusedLlamaForCausalLM(llama_config())
    path = write_single(tmp_path / "ckpt", canonical_state(llama_config()))
    with open_checkpoint(path) as checkpoint:
        plan = plan_load(model, checkpoint)
        os.truncate(path / "model.safetensors", 4096)
        with pytest.raises(CheckpointError, match="partially loaded"):
            execute_plan(plan, checkpoint)


def test_meta_model_is_refused(tmp_path):
    path = write_single(tmp_path / "ckpt", canonical_state(llama_config()))
    with torch.device("meta"):
        model = FusedLlamaForCausalLM(llama_config())
    with pytest.raises(ValueError, match="meta device"):
        load_checkpoint(model, path)


def test_open_checkpoint_reads_headers_only(tmp_path):
    path = write_sharded(tmp_path / "ckpt", canonical_state(llama_config()))
    with open_checkpoint(path) as checkpoint:
        assert checkpoint.layout == "canonical" and len(checkpoint.files) == 2
        assert checkpoint.infos[Q].shape == (64, 64) and checkpoint.infos[Q].nbytes == 64 * 64 * 4


def test_checkpoint_error_survives_pickling():
    error = pickle.loads(pickle.dumps(CheckpointError("bad", file="a/b.safetensors", tensor="x.weight")))
    assert (error.file, error.tensor, str(error)) == (
        "a/b.safetensors",
        "x.weight",
        "a/b.safetensors: tensor 'x.weight': bad",
    )


# --------------------------------------------------------------------------------------------------------------------
# Saving
# --------------------------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("shard_size", ["5GB", "20KB"])
@pytest.mark.parametrize("tie", [True, False])
@pytest.mark.parametrize("model_type", sorted(MODELS))
def test_save_round_trips_bit_exact_to_the_original_class(checkpoint, tmp_path, model_type, tie, shard_size):
    config_class, original_class, fused_class = model_classes(model_type)
    config = small_config(config_class, num_key_value_heads=1, tie_word_embeddings=tie)
    path, original = checkpoint(original_class, config)
    model = fused_class(original.config)
    load_checkpoint(model, path)
    written = save_checkpoint(model, tmp_path / "saved", max_shard_size=shard_size)
    assert (tmp_path / "saved" / "config.json").exists()
    assert ((tmp_path / "saved" / "model.safetensors.index.json") in written) is (shard_size == "20KB")
    with open_checkpoint(tmp_path / "saved") as saved:
        assert ("lm_head.weight" in saved.infos) is not tie
        assert not any("qkv_proj" in name or "gate_up_proj" in name for name in saved.infos)
    reloaded, info = original_class.from_pretrained(tmp_path / "saved", output_loading_info=True)
    assert not any(info.values()), info
    expected, actual = original.state_dict(), reloaded.state_dict()
    assert expected.keys() == actual.keys()
    assert all(torch.equal(expected[name], actual[name]) for name in expected)


def test_save_keeps_dtype_and_loads_back(tmp_path):
    config = llama_config()
    model = random_model(FusedLlamaForCausalLM, config).to(torch.bfloat16)
    save_checkpoint(model, tmp_path / "bf16")
    with safe_open(tmp_path / "bf16" / "model.safetensors", "pt") as handle:
        assert handle.get_slice(Q).get_dtype() == "BF16"
    again = FusedLlamaForCausalLM(config).to(torch.bfloat16)
    load_checkpoint(again, tmp_path / "bf16")
    assert all(torch.equal(a, b) for a, b in zip(model.state_dict().values(), again.state_dict().values()))


def test_resave_with_fewer_shards_removes_stale_files(tmp_path):
    model = FusedLlamaForCausalLM(llama_config())
    save_checkpoint(model, tmp_path / "out", max_shard_size="20KB")
    (tmp_path / "out" / "tokenizer.json").write_text("{}")
    save_checkpoint(model, tmp_path / "out")
    names = sorted(p.name for p in (tmp_path / "out").iterdir())
    assert names == ["config.json", "model.safetensors", "tokenizer.json"]
    load_checkpoint(FusedLlamaForCausalLM(llama_config()), tmp_path / "out")


@pytest.mark.parametrize(
    "text, expected", [("5GB", 5 * 10**9), ("20KB", 20_000), ("1.5MB", 1_500_000), ("4GiB", 4 * 2**30), (123, 123)]
)
def test_parse_size(text, expected):
    assert parse_size(text) == expected


@pytest.mark.parametrize("text", ["", "5XB", "-1", 0, "GB"])
def test_parse_size_rejects(text):
    with pytest.raises(ValueError):
        parse_size(text)


# --------------------------------------------------------------------------------------------------------------------
# load_weights (vLLM style)
# --------------------------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("tie", [True, False])
def test_load_weights_from_canonical_names(tie):
    config = llama_config(tie_word_embeddings=tie)
    original = random_model(LlamaForCausalLM, config)
    model = FusedLlamaForCausalLM(config)
    loaded = load_weights(model, original.state_dict().items())
    assert loaded == {name for name, _ in model.named_parameters()}
    assert torch.equal(logits(model, IDS), logits(original, IDS))


def test_load_weights_from_fused_names_returns_fused_param_names():
    config = llama_config()
    source = random_model(FusedLlamaForCausalLM, config)
    model = FusedLlamaForCausalLM(config)
    loaded = load_weights(model, iter(source.state_dict().items()))
    assert QKV in loaded and loaded == {name for name, _ in model.named_parameters()}
    assert torch.equal(logits(model, IDS), logits(source, IDS))


def test_load_weights_partial_reports_only_what_it_filled():
    config = llama_config()
    state = canonical_state(config)
    assert load_weights(FusedLlamaForCausalLM(config), [(Q, state[Q])]) == {QKV}


def test_load_weights_rejects_unknown_names_and_wrong_shapes():
    model = FusedLlamaForCausalLM(llama_config())
    with pytest.raises(CheckpointError, match="not a tensor of the model"):
        load_weights(model, [("model.nonsense.weight", torch.zeros(1))])
    with pytest.raises(CheckpointError, match=r"\[3, 64\].*\[64, 64\]"):
        load_weights(model, [(Q, torch.zeros(3, 64))])
