"""Distributed checkpoints (torch.distributed.checkpoint, DCP) of fused models in canonical names, both ways:
under FSDP2 (`fully_shard`) and under tensor parallelism, 2 ranks, gloo, CPU (issue 23 item 3).

One launch runs every case (`tests/multirank.py`: spawned workers, a free port, a short gloo timeout, a deadline); each
case records figures, rank 0's results are asserted here. `pytest tests/test_distributed_checkpoints.py -rP` prints
them.
"""

from __future__ import annotations

import pytest
import torch

from fusegen.testkit import logits_tolerance, model_classes, random_model, small_config
from tests.multirank import launch, rank_group

pytestmark = pytest.mark.slow  # multi-process launches

WORLD_SIZE = 2
IDS = [[3, 17, 42, 5, 99, 11, 64, 2, 8, 30], [7, 1, 120, 77, 56, 13, 9, 4, 101, 66]]
MLP_37 = {"num_key_value_heads": 2, "intermediate_size": 37}
# name -> (model type, config overrides, case function)
CASES = {
    "fsdp-qwen2-fused-to-original": ("qwen2", {"num_key_value_heads": 2}, "fsdp_fused_to_original"),
    "fsdp-llama-original-to-fused": ("llama", {"num_key_value_heads": 1}, "fsdp_original_to_fused"),
    "fsdp-qwen2-dsd-both-ways": ("qwen2", {"num_key_value_heads": 2}, "fsdp_dsd_both_ways"),
    "tp-qwen2-fused-to-original": ("qwen2", {"num_key_value_heads": 2}, "tp_fused_to_original"),
    "tp-llama-original-to-fused": ("llama", {"num_key_value_heads": 2}, "tp_original_to_fused"),
    # model + optimizer state, training resumed on the other class and on the same one (item 1 of the follow-up)
    "fsdp-llama-resume-fused-to-original": ("llama", {"num_key_value_heads": 2}, "fsdp_resume_fused"),
    "fsdp-qwen2-resume-fused-to-original": ("qwen2", {"num_key_value_heads": 2}, "fsdp_resume_fused"),
    "fsdp-llama-resume-original-to-fused": ("llama", {"num_key_value_heads": 2}, "fsdp_resume_original"),
    "fsdp-qwen2-resume-original-to-fused": ("qwen2", {"num_key_value_heads": 2}, "fsdp_resume_original"),
    "tp-qwen2-resume-fused-to-original": ("qwen2", {"num_key_value_heads": 2}, "tp_resume_fused"),
    "tp-llama-resume-original-to-fused": ("llama", {"num_key_value_heads": 2}, "tp_resume_original"),
    "tp-llama-mqa-resume-fused-to-original": ("llama", {"num_key_value_heads": 1}, "tp_resume_fused_single_original"),
    # gate/up of 37 rows over 2 ranks: 19 and 18 rows each (DTensor's split, as Transformers' colwise gives them)
    "tp-qwen2-mlp-37-resume-fused-to-original": ("qwen2", MLP_37, "tp_resume_fused"),
    "tp-llama-mlp-37-original-to-fused": ("llama", MLP_37, "tp_original_to_fused"),
}
TRAIN_STEPS, RESUME_STEPS = 2, 3  # AdamW steps before the checkpoint, and after it


# --------------------------------------------------------------------------------------------------------------------
# Worker side
# --------------------------------------------------------------------------------------------------------------------


def _ids():
    return torch.tensor(IDS)


def _train_step(model):
    """One AdamW step on a fixed batch (the weights then differ from the checkpoint's): returns the loss."""
    model.train()
    optimizer = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=1e-2)
    loss = model(input_ids=_ids(), labels=_ids()).loss
    loss.backward()
    optimizer.step()
    optimizer.zero_grad()
    return loss.item()


def _fsdp(model):
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    mesh = init_device_mesh("cpu", (WORLD_SIZE,))
    for layer in model.model.layers:
        fully_shard(layer, mesh=mesh)
    return fully_shard(model, mesh=mesh)


def _full(value):
    """The whole tensor, a copy (a replicated DTensor's `full_tensor()` is its live local tensor)."""
    return (value.full_tensor() if hasattr(value, "full_tensor") else value).clone()


def _canonical_full(model, model_type):
    """Every parameter of a (possibly distributed) model gathered whole, merged ones split into canonical pieces by
    the single-process rule (`output_sizes`, read from the model type's unsharded fused model)."""
    return _canonical_split({name: _full(p.detach()) for name, p in model.named_parameters()}, model, model_type)


def _canonical_split(tensors, model, model_type):
    """`{parameter name: whole tensor of its shape}` with merged parameters' tensors split into canonical pieces."""
    from fusegen.runtime.merged import merged_modules, stacked_mapping

    _, _, fused_class = model_classes(model_type)
    with torch.device("meta"):
        reference = fused_class(model.config)
    sizes = {path: list(module.output_sizes) for path, module in merged_modules(reference).items()}
    out = {}
    for name, value in tensors.items():
        path, _, leaf = name.rpartition(".")
        if path not in sizes:
            out[name] = value
            continue
        owner_path, _, attribute = path.rpartition(".")
        pieces = stacked_mapping(reference.get_submodule(owner_path))[attribute]
        for piece, part in zip(pieces, value.split(sizes[path])):
            out[f"{owner_path}.{piece}.{leaf}"] = part
    return out


def _logits(model):
    with torch.no_grad():
        return _full(model.eval()(input_ids=_ids()).logits)


def _checkpoint_keys(checkpoint):
    import torch.distributed.checkpoint as dcp

    return sorted(dcp.FileSystemReader(checkpoint).read_metadata().state_dict_metadata)


def _dcp_into(model, checkpoint):
    """`dcp.load` into the model's state dict, then `load_state_dict` (DCP's documented recipe)."""
    import torch.distributed.checkpoint as dcp

    state = model.state_dict()
    dcp.load(state, checkpoint_id=checkpoint)
    return model.load_state_dict(state)


def _compare(saved, loaded, saved_logits, loaded_logits, checkpoint):
    keys = _checkpoint_keys(checkpoint)
    return {
        "checkpoint_keys_canonical": sorted(saved) == keys,
        "merged_names_in_checkpoint": [k for k in keys if "qkv_proj" in k or "gate_up_proj" in k],
        "same_names": sorted(saved) == sorted(loaded),
        "max_tensor_diff": max((saved[k] - loaded[k]).abs().max().item() for k in saved if k in loaded),
        "logits_diff": (saved_logits - loaded_logits).abs().max().item(),
        "logits_bound": logits_tolerance(saved_logits),
    }


def fsdp_fused_to_original(model_type, path, out):
    """Fused under FSDP2, one training step, DCP save; the original under FSDP2 loads it."""
    import torch.distributed.checkpoint as dcp

    _, original_class, fused_class = model_classes(model_type)
    fused = _fsdp(fused_class.from_pretrained(path))
    loss = _train_step(fused)
    dcp.save(fused.state_dict(), checkpoint_id=out)
    original = _fsdp(original_class.from_pretrained(path))
    info = _dcp_into(original, out)
    result = _compare(_canonical_full(fused, model_type), _canonical_full(original, model_type), _logits(fused),
                      _logits(original), out)  # fmt: skip
    return {**result, "loss": loss, "load_info": [list(info.missing_keys), list(info.unexpected_keys)]}


def fsdp_original_to_fused(model_type, path, out):
    """The original under FSDP2, one training step, DCP save; the fused model under FSDP2 loads it."""
    import torch.distributed.checkpoint as dcp

    _, original_class, fused_class = model_classes(model_type)
    original = _fsdp(original_class.from_pretrained(path))
    loss = _train_step(original)
    dcp.save(original.state_dict(), checkpoint_id=out)
    fused = _fsdp(fused_class.from_pretrained(path))
    info = _dcp_into(fused, out)
    result = _compare(_canonical_full(original, model_type), _canonical_full(fused, model_type), _logits(original),
                      _logits(fused), out)  # fmt: skip
    return {**result, "loss": loss, "load_info": [list(info.missing_keys), list(info.unexpected_keys)]}


def fsdp_dsd_both_ways(model_type, path, out):
    """torch.distributed.checkpoint.state_dict (DSD) under FSDP2: the fused model's full state dict, in canonical
    names, set into the original; the original's sharded state dict set into a fresh fused model."""
    from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict, set_model_state_dict

    _, original_class, fused_class = model_classes(model_type)
    fused = _fsdp(fused_class.from_pretrained(path))
    loss = _train_step(fused)
    full = get_model_state_dict(fused, options=StateDictOptions(full_state_dict=True))
    original = _fsdp(original_class.from_pretrained(path))
    set_model_state_dict(original, full, options=StateDictOptions(full_state_dict=True))
    saved, loaded = _canonical_full(fused, model_type), _canonical_full(original, model_type)
    _train_step(original)
    fresh = _fsdp(fused_class.from_pretrained(path))
    set_model_state_dict(fresh, get_model_state_dict(original))
    trained, reloaded = _canonical_full(original, model_type), _canonical_full(fresh, model_type)
    return {
        "loss": loss,
        "full_keys_canonical": sorted(full) == sorted(saved),
        "full_types": sorted({f"{type(v).__name__}:{k.split('.')[-2]}" for k, v in full.items()}),
        "full_exact": all(torch.equal(_full(full[k]), saved[k]) for k in saved),
        "into_original_max_diff": max((saved[k] - loaded[k]).abs().max().item() for k in saved),
        "into_fused_names": sorted(trained) == sorted(reloaded),
        "into_fused_max_diff": max((trained[k] - reloaded[k]).abs().max().item() for k in trained),
    }


def tp_fused_to_original(model_type, path, out):
    """Fused under tensor parallelism, one training step, DCP save; the original under Transformers' own plan loads
    it, and so does a single-process original (every rank reads the whole tensors)."""
    import torch.distributed.checkpoint as dcp

    _, original_class, fused_class = model_classes(model_type)
    fused = fused_class.from_pretrained(path, tp_plan="auto")
    loss = _train_step(fused)
    dcp.save(fused.state_dict(), checkpoint_id=out)
    original = original_class.from_pretrained(path, tp_plan="auto")
    _dcp_into(original, out)
    single = original_class.from_pretrained(path)
    _dcp_into(single, out)
    saved = _canonical_full(fused, model_type)
    result = _compare(saved, _canonical_full(original, model_type), _logits(fused), _logits(original), out)
    result["single_max_tensor_diff"] = max((saved[k] - v).abs().max().item() for k, v in single.state_dict().items()
                                           if k in saved)  # fmt: skip
    return {**result, "loss": loss}


def tp_original_to_fused(model_type, path, out):
    """The original under Transformers' tensor parallelism, one training step, DCP save; the fused model under
    tensor parallelism loads it."""
    import torch.distributed.checkpoint as dcp

    _, original_class, fused_class = model_classes(model_type)
    original = original_class.from_pretrained(path, tp_plan="auto")
    loss = _train_step(original)
    dcp.save(original.state_dict(), checkpoint_id=out)
    fused = fused_class.from_pretrained(path, tp_plan="auto")
    _dcp_into(fused, out)
    result = _compare(_canonical_full(original, model_type), _canonical_full(fused, model_type), _logits(original),
                      _logits(fused), out)  # fmt: skip
    return {**result, "loss": loss}


def _optimizer(model):
    return torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=1e-2)


def _step(model, optimizer):
    """One training step of `optimizer` (its state carries over between steps): returns the loss."""
    model.train()
    loss = model(input_ids=_ids(), labels=_ids()).loss
    loss.backward()
    optimizer.step()
    optimizer.zero_grad()
    return loss.item()


def _canonical_training_state(model, optimizer, model_type):
    """Parameters and optimizer state (`<name>/<state key>`), gathered whole and in canonical names by the test's
    own rule (`_canonical_full`), independent of the code under test."""
    out = {f"{name}/param": value for name, value in _canonical_full(model, model_type).items()}
    for name, parameter in model.named_parameters():  # one order on every rank: gathering is a collective
        state = optimizer.state.get(parameter, {})
        for key in sorted(state):
            value = state[key]
            tensor = _full(value.detach())
            if tensor.dim() == 0:
                tensor = tensor.expand(parameter.shape)  # a scalar per parameter (`step`): one per piece
            for piece, part in _canonical_split({name: tensor}, model, model_type).items():
                out[f"{piece}/{key}"] = part
    return out


def _state_functions(model):
    """DSD's entry points for the original class (stock), fusegen's wrappers for the fused one."""
    from torch.distributed.checkpoint import state_dict as dsd

    from fusegen.runtime import optimizer_state
    from fusegen.runtime.merged import merged_modules

    return optimizer_state if merged_modules(model) else dsd  # (fully_shard renames the class: ask the modules)


def _save_training(model, optimizer, out):
    import torch.distributed.checkpoint as dcp

    model_state, optim_state = _state_functions(model).get_state_dict(model, optimizer)
    dcp.save({"model": model_state, "optim": optim_state}, checkpoint_id=out)


def _load_training(model, optimizer, out, with_optimizer=True):
    """DCP's documented resume recipe: a state dict of the right shape, `dcp.load` into it, then `set_state_dict`."""
    import torch.distributed.checkpoint as dcp

    functions = _state_functions(model)
    model_state, optim_state = functions.get_state_dict(model, optimizer)
    state = {"model": model_state, "optim": optim_state} if with_optimizer else {"model": model_state}
    dcp.load(state, checkpoint_id=out)
    if with_optimizer:
        functions.set_state_dict(model, optimizer, model_state_dict=state["model"], optim_state_dict=state["optim"])
    else:
        model.load_state_dict(state["model"])


def _flat_layout_converts(model, optimizer):
    """DSD's flattened optimizer layout (`flatten_optimizer_state_dict=True`): fusegen's canonical flat state holds
    the canonical nested state's entries, and converting it back gives DSD's own flat state, tensor for tensor."""
    from torch.distributed.checkpoint.state_dict import StateDictOptions
    from torch.distributed.checkpoint.state_dict import get_optimizer_state_dict as dsd_optimizer_state_dict

    from fusegen.runtime import optimizer_state

    flat_options = StateDictOptions(flatten_optimizer_state_dict=True)
    nested = optimizer_state.get_optimizer_state_dict(model, optimizer)
    flat = optimizer_state.get_optimizer_state_dict(model, optimizer, options=flat_options)
    expected = {
        f"state.{name}.{key}": value for name, state in nested["state"].items() for key, value in state.items()
    }
    own = dsd_optimizer_state_dict(model, optimizer, options=flat_options)
    back = optimizer_state.merged_optimizer_state(model, flat)

    def same(a, b):
        return torch.equal(_full(a), _full(b)) if isinstance(a, torch.Tensor) else a == b

    canonical = sorted(k for k in flat if k.startswith("state.")) == sorted(expected)
    return (
        canonical
        and all(same(flat[k], expected[k]) for k in sorted(expected))
        and sorted(back) == sorted(own)
        and all(same(back[k], own[k]) for k in sorted(own))
        and any("q_proj" in k for k in flat)
        and not any("qkv_proj" in k for k in flat)
    )


def _full_state_dict_converts(model, optimizer):
    """`StateDictOptions(full_state_dict=True)`: the canonical full optimizer state holds the canonical sharded
    state's tensors gathered whole, and setting it (full) back leaves every optimizer tensor as it was."""
    from torch.distributed.checkpoint.state_dict import StateDictOptions

    from fusegen.runtime import optimizer_state

    full_options = StateDictOptions(full_state_dict=True)
    nested = optimizer_state.get_optimizer_state_dict(model, optimizer)
    full = optimizer_state.get_optimizer_state_dict(model, optimizer, options=full_options)
    if sorted(full["state"]) != sorted(nested["state"]) or any("qkv_proj" in name for name in full["state"]):
        return False
    same = all(
        torch.equal(_full(nested["state"][name][key]), _full(full["state"][name][key]))
        for name in sorted(nested["state"])
        for key in sorted(nested["state"][name])
    )

    def local(value):  # what the optimizer updates with: this rank's rows, and what they are said to be
        return (value.to_local() if hasattr(value, "to_local") else value).clone(), getattr(value, "placements", None)

    before = {(name, key): local(value) for name, p in model.named_parameters() for key, value in
              sorted(optimizer.state[p].items())}  # fmt: skip
    optimizer_state.set_optimizer_state_dict(model, optimizer, full, options=full_options)
    after = {(name, key): local(value) for name, p in model.named_parameters() for key, value in
             sorted(optimizer.state[p].items())}  # fmt: skip
    return (
        same
        and sorted(before) == sorted(after)
        and all(torch.equal(before[k][0], after[k][0]) and before[k][1] == after[k][1] for k in before)
        and all(str(before[k][1]) == str(after[k][1]) for k in before)  # MergedRowShard compares equal to Shard(0)
    )


def _max_diff(expected, actual):
    return max((expected[k] - actual[k]).abs().max().item() for k in expected if k in actual)


def _resume(model_type, path, out, source, build, build_other=None):
    """`source` ("fused" or "original") trains TRAIN_STEPS, saves model and optimizer with DCP, and trains on for
    RESUME_STEPS; then each class resumes from the checkpoint and trains RESUME_STEPS: the resumed state (weights and
    optimizer state, canonical) against the saved one, and the losses/weights after against the uninterrupted run.
    A control resumes the other class with a fresh optimizer (weights only) to show what the optimizer state moves.
    `build_other` builds the other class where it differs from `build` (a single process where Transformers' own
    tensor parallelism cannot run the original)."""
    _, original_class, fused_class = model_classes(model_type)
    classes = {"fused": fused_class, "original": original_class}
    other = "original" if source == "fused" else "fused"
    model = build(classes[source], path)
    optimizer = _optimizer(model)
    for _ in range(TRAIN_STEPS):
        _step(model, optimizer)
    _save_training(model, optimizer, out)
    saved = _canonical_training_state(model, optimizer, model_type)
    losses = [_step(model, optimizer) for _ in range(RESUME_STEPS)]
    trained = _canonical_full(model, model_type)
    keys = _checkpoint_keys(out)
    result = {"merged_names_in_checkpoint": [k for k in keys if "qkv_proj" in k or "gate_up_proj" in k],
              "optimizer_keys": len([k for k in keys if k.startswith("optim.state.")])}  # fmt: skip
    builds = {source: build, other: build_other or build}
    for kind in (other, source):
        resumed = builds[kind](classes[kind], path)
        resumed_optimizer = _optimizer(resumed)
        _load_training(resumed, resumed_optimizer, out)
        state = _canonical_training_state(resumed, resumed_optimizer, model_type)
        if kind == "fused":
            result["flat_layout_converts"] = _flat_layout_converts(resumed, resumed_optimizer)
            result["full_state_dict_converts"] = _full_state_dict_converts(resumed, resumed_optimizer)
        resumed_losses = [_step(resumed, resumed_optimizer) for _ in range(RESUME_STEPS)]
        result[kind] = {
            "state_names_equal": sorted(state) == sorted(saved),
            "state_keys": len(state),
            "state_max_diff": _max_diff(saved, state),
            "state_worst": max(saved, key=lambda k: (saved[k] - state[k]).abs().max().item() if k in state else -1),
            "loss_diffs": [abs(a - b) for a, b in zip(losses, resumed_losses)],
            "param_max_diff": _max_diff(trained, _canonical_full(resumed, model_type)),
        }
    control = builds[other](classes[other], path)
    control_optimizer = _optimizer(control)
    _load_training(control, control_optimizer, out, with_optimizer=False)
    result["fresh_optimizer_loss_diffs"] = [abs(a - _step(control, control_optimizer)) for a in losses]
    return result


def _fsdp_build(model_class, path):
    return _fsdp(model_class.from_pretrained(path))


def _tp_build(model_class, path):
    return model_class.from_pretrained(path, tp_plan="auto")


def fsdp_resume_fused(model_type, path, out):
    return _resume(model_type, path, out, "fused", _fsdp_build)


def fsdp_resume_original(model_type, path, out):
    return _resume(model_type, path, out, "original", _fsdp_build)


def tp_resume_fused(model_type, path, out):
    return _resume(model_type, path, out, "fused", _tp_build)


def tp_resume_original(model_type, path, out):
    return _resume(model_type, path, out, "original", _tp_build)


def tp_resume_fused_single_original(model_type, path, out):
    """Fewer kv heads than ranks: Transformers' tensor parallelism cannot shard the original's k/v, so the original
    resumes in a single process (every rank reads the whole tensors)."""
    return _resume(
        model_type, path, out, "fused", _tp_build, lambda model_class, path: model_class.from_pretrained(path)
    )


def _worker(rank, world_size, port, cases, out_dir):
    """One rank: run every case (recording, not raising, its failures); `rank_group` writes the results."""
    import torch.distributed as dist
    from torch.distributed.checkpoint.api import CheckpointException

    with rank_group(rank, world_size, port, out_dir) as results:
        for name, (model_type, path, how) in cases.items():
            try:
                results[name] = globals()[how](model_type, path, f"{out_dir}/{name}-dcp")
            except (Exception, CheckpointException) as error:  # noqa: BLE001 (recorded per case: one failure must
                # not hide the others; DCP raises CheckpointException, a BaseException)
                results[name] = {"failed": f"{type(error).__name__}: {error}"}
            dist.barrier()


# --------------------------------------------------------------------------------------------------------------------
# Launcher side
# --------------------------------------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def launched(tmp_path_factory):
    root = tmp_path_factory.mktemp("dcp")
    cases = {}
    for name, (model_type, overrides, how) in CASES.items():
        config_class, original_class, _ = model_classes(model_type)
        random_model(original_class, small_config(config_class, **overrides)).save_pretrained(root / name)
        cases[name] = (model_type, str(root / name), how)
    return launch(_worker, WORLD_SIZE, (cases, str(root)), root)


def test_dsd_state_dicts_are_canonical_both_ways(launched):
    for rank, ranks in enumerate(launched):
        result = ranks["fsdp-qwen2-dsd-both-ways"]
        print(f"rank {rank}: {result}")
        assert "failed" not in result, f"rank {rank}: {result['failed']}"
        assert result["full_keys_canonical"] and result["full_exact"] and result["into_fused_names"], result
        assert result["into_original_max_diff"] == 0 and result["into_fused_max_diff"] == 0, result


@pytest.mark.parametrize("name", sorted(name for name, case in CASES.items() if "resume" in case[2]))
def test_training_resumes_from_a_canonical_checkpoint_on_either_class(launched, name):
    """Model and optimizer state (AdamW) in canonical names: the resumed state equals the saved one exactly on both
    classes; the same class then continues exactly as without the checkpoint, the other class within float
    rounding of the merged GEMM (fused and original differ by that much from identical states, single-process
    too), while a resume without the optimizer state (the control) is far off."""
    from fusegen.compiler.validate import TOLERANCE

    source = "fused" if name.endswith("fused-to-original") else "original"
    other = "original" if source == "fused" else "fused"
    for rank, ranks in enumerate(launched):
        result = ranks[name]
        print(f"{name} rank {rank}: {result}")
        assert "failed" not in result, f"rank {rank}: {result['failed']}"
        assert not result["merged_names_in_checkpoint"] and result["optimizer_keys"] > 0, result
        assert result["flat_layout_converts"] and result["full_state_dict_converts"], result
        for kind in (source, other):
            assert result[kind]["state_names_equal"] and result[kind]["state_max_diff"] == 0, (kind, result)
        assert max(result[source]["loss_diffs"]) == 0 and result[source]["param_max_diff"] == 0, result
        assert max(result[other]["loss_diffs"]) <= TOLERANCE and result[other]["param_max_diff"] <= 1e-3, result
        assert max(result["fresh_optimizer_loss_diffs"]) > 100 * TOLERANCE, result


@pytest.mark.parametrize(
    "name", sorted(name for name, case in CASES.items() if "dsd" not in case[2] and "resume" not in case[2])
)
def test_distributed_checkpoint_is_canonical_both_ways(launched, name):
    per_rank = [ranks[name] for ranks in launched]
    for rank, result in enumerate(per_rank):
        print(f"{name} rank {rank}: {result}")
        assert "failed" not in result, f"rank {rank}: {result['failed']}"
        assert result["checkpoint_keys_canonical"] and not result["merged_names_in_checkpoint"], result
        assert result["same_names"], result
        assert result["max_tensor_diff"] == 0, result
        assert result["logits_diff"] <= result["logits_bound"], result
        assert result.get("single_max_tensor_diff", 0) == 0, result
        assert result.get("load_info", [[], []]) == [[], []], result
