"""Fused models among PEFT, pipelines and Transformers' checkpoint conventions (issue 15 items 1, 3, 6)."""

import json
import logging
import os
import subprocess
import sys

import pytest
import torch
from peft import IA3Config, LoraConfig, PeftModel, get_peft_model  # the `ecosystem` extra; a missing PEFT fails
from torch import nn
from transformers import AutoModelForCausalLM, LlamaConfig, LlamaForCausalLM

from fusegen.runtime import AdapterError
from fusegen.testkit import (
    MODELS,
    TOLERANCE,
    logits,
    logits_tolerance,
    model_classes,
    random_model,
    randomise,
    small_config,
)
from generated.fused_llama import FusedLlamaForCausalLM
from tests.test_hazards import QKV, RETURN, outcome, write_case

pytestmark = pytest.mark.slow  # PEFT, export and remote-code loads, many in fresh processes

IDS = torch.randint(0, 128, (2, 9), generator=torch.Generator().manual_seed(1))
ALL = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]


def _base(checkpoint, model_type):
    """A saved random GQA original of `model_type`; returns (path, original class, fused class)."""
    config_class, original_class, fused_class = model_classes(model_type)
    path, _ = checkpoint(original_class, small_config(config_class, num_key_value_heads=2))
    return path, original_class, fused_class


def assert_same_logits(actual, expected):
    """The adapted fused model's logits against the original's (or the other way round for a reloaded adapter):
    within the project's one logits rule, `logits_tolerance` (TOLERANCE times the logits' scale, at least TOLERANCE;
    fusegen/compiler/validate.py gives the argument). A merged LoRA sums the pieces' fp32 products in another order,
    so its rounding noise is relative to the logits' size, like a merged GEMM's; these logits reach 3-5."""
    torch.testing.assert_close(actual, expected, rtol=0, atol=logits_tolerance(expected))


def _random_lora(model):
    """Non-zero A and B everywhere (PEFT starts B at zero, which would hide a dropped or mis-placed tensor)."""
    torch.manual_seed(5)
    return randomise(model, lambda name: "lora_" in name)


def _adapter(tmp_path, original_class, path, **lora):
    """An adapter trained (randomised) on the original; returns (adapter dir, the original's logits with it)."""
    model = _random_lora(get_peft_model(original_class.from_pretrained(path), LoraConfig(**{"r": 4, **lora})))
    model.save_pretrained(tmp_path / "adapter")  # (tmp_path may not exist yet: save_pretrained makes it)
    return tmp_path / "adapter", logits(model, IDS)


def _lora_keys(directory):
    from safetensors import safe_open

    with safe_open(str(directory / "adapter_model.safetensors"), framework="pt") as handle:
        return set(handle.keys())


# --------------------------------------------------------------------------------------------------------------------
# The generated forward does not depend on what a wrapper hides
# --------------------------------------------------------------------------------------------------------------------


def test_forward_survives_a_wrapper_that_hides_output_sizes(checkpoint):
    """A module standing in for qkv_proj (as PEFT's and quantizers' do) has no `output_sizes`."""
    path, _, fused_class = _base(checkpoint, "llama")
    fused = fused_class.from_pretrained(path).eval()
    expected = logits(fused, IDS)
    for layer in fused.model.layers:
        merged = layer.self_attn.qkv_proj
        plain = nn.Linear(merged.in_features, merged.out_features, bias=merged.bias is not None)
        plain.load_state_dict(merged.state_dict())
        layer.self_attn.qkv_proj = plain
    assert torch.equal(logits(fused, IDS), expected)


def test_sizes_attribute_is_checked_for_name_clashes(case_path):
    block = outcome(write_case(case_path, "sizes_taken", "        self.qkv_proj_sizes = 3\n", QKV + RETURN))
    assert [r.rule for r in block.refused if r.projections == ("q_proj", "k_proj", "v_proj")] == ["name-clash"]
    assert "qkv_proj_sizes" in block.refused[0].reason


# --------------------------------------------------------------------------------------------------------------------
# Adapters trained on the original
# --------------------------------------------------------------------------------------------------------------------

SUBSETS = {"q_v": ["q_proj", "v_proj"], "all": ALL, "k_up": ["k_proj", "up_proj"], "gate": ["gate_proj"]}


@pytest.mark.parametrize("how", ["PeftModel", "load_adapter"])
@pytest.mark.parametrize("subset", sorted(SUBSETS))
@pytest.mark.parametrize("model_type", sorted(MODELS))
def test_original_adapter_gives_the_originals_outputs(checkpoint, tmp_path, model_type, subset, how):
    path, original_class, fused_class = _base(checkpoint, model_type)
    adapter, expected = _adapter(tmp_path, original_class, path, target_modules=SUBSETS[subset], lora_alpha=8)
    fused = fused_class.from_pretrained(path)
    if how == "PeftModel":
        fused = PeftModel.from_pretrained(fused, adapter)
    else:
        fused.load_adapter(adapter)
    assert_same_logits(logits(fused, IDS), expected)


def test_two_adapters_low_cpu_mem_usage_and_switching(checkpoint, tmp_path):
    path, original_class, fused_class = _base(checkpoint, "llama")
    first, expected_first = _adapter(tmp_path / "1", original_class, path, target_modules=["q_proj", "v_proj"])
    second, expected_second = _adapter(tmp_path / "2", original_class, path, target_modules=["k_proj", "up_proj"])
    fused = PeftModel.from_pretrained(fused_class.from_pretrained(path), first, low_cpu_mem_usage=True).eval()
    fused.load_adapter(second, adapter_name="second")
    fused.set_adapter("second")
    assert_same_logits(logits(fused, IDS), expected_second)
    fused.set_adapter("default")
    assert_same_logits(logits(fused, IDS), expected_first)
    with fused.disable_adapter():
        assert torch.equal(logits(fused, IDS), logits(fused_class.from_pretrained(path), IDS))


def test_ranks_may_differ_per_piece_when_the_scaling_agrees(checkpoint, tmp_path):
    path, original_class, fused_class = _base(checkpoint, "llama")
    lora = {"target_modules": ["q_proj", "v_proj"], "rank_pattern": {"v_proj": 8}, "alpha_pattern": {"v_proj": 16}}
    adapter, expected = _adapter(tmp_path, original_class, path, lora_alpha=8, **lora)
    fused = PeftModel.from_pretrained(fused_class.from_pretrained(path), adapter)
    assert_same_logits(logits(fused, IDS), expected)
    assert fused.base_model.model.model.layers[0].self_attn.qkv_proj.r["default"] == 12


@pytest.mark.parametrize(
    "lora, problem",
    [
        ({"target_modules": ["q_proj", "v_proj"], "rank_pattern": {"v_proj": 8}}, "different LoRA scalings"),
        ({"target_modules": ["q_proj"], "use_dora": True}, "use_dora"),
    ],
)
def test_unsupported_adapters_raise(checkpoint, tmp_path, lora, problem):
    path, original_class, fused_class = _base(checkpoint, "llama")
    adapter, _ = _adapter(tmp_path, original_class, path, **lora)
    with pytest.raises(AdapterError, match=problem):
        PeftModel.from_pretrained(fused_class.from_pretrained(path), adapter)
    with pytest.raises(AdapterError, match=problem):
        fused_class.from_pretrained(path).load_adapter(adapter)


def test_adapter_tensors_the_config_does_not_target_are_refused_not_dropped(checkpoint, tmp_path):
    path, original_class, fused_class = _base(checkpoint, "llama")
    adapter, _ = _adapter(tmp_path, original_class, path, target_modules=["q_proj", "k_proj"])
    config = json.loads((adapter / "adapter_config.json").read_text())
    (adapter / "adapter_config.json").write_text(json.dumps({**config, "target_modules": ["q_proj"]}))
    with pytest.raises(AdapterError, match="k_proj"):
        PeftModel.from_pretrained(fused_class.from_pretrained(path), adapter)
    with pytest.raises(AdapterError, match="k_proj"):
        fused_class.from_pretrained(path).load_adapter(adapter)


def test_other_peft_methods_on_merged_pieces_raise(checkpoint):
    path, _, fused_class = _base(checkpoint, "llama")
    config = IA3Config(target_modules=["k_proj", "down_proj"], feedforward_modules=["down_proj"])
    with pytest.raises(AdapterError, match="only LoRA"):
        get_peft_model(fused_class.from_pretrained(path), config)


# --------------------------------------------------------------------------------------------------------------------
# Training on the fused model
# --------------------------------------------------------------------------------------------------------------------


def _sgd_step(model):
    model.train()
    optimizer = torch.optim.SGD([p for p in model.parameters() if p.requires_grad], lr=0.5)
    model(input_ids=IDS, labels=IDS).loss.backward()
    optimizer.step()
    return model.eval()


@pytest.mark.parametrize("model_type", sorted(MODELS))
def test_training_step_on_the_fused_model_equals_the_originals(checkpoint, tmp_path, model_type):
    """Same adapter, same batch, one SGD step on each: same logits after, and the fused save loads in the original."""
    path, original_class, fused_class = _base(checkpoint, model_type)
    adapter, _ = _adapter(tmp_path, original_class, path, target_modules=["q_proj", "v_proj", "up_proj"], lora_alpha=8)
    original = _sgd_step(PeftModel.from_pretrained(original_class.from_pretrained(path), adapter, is_trainable=True))
    fused = _sgd_step(PeftModel.from_pretrained(fused_class.from_pretrained(path), adapter, is_trainable=True))
    assert_same_logits(logits(fused, IDS), logits(original, IDS))
    fused.save_pretrained(tmp_path / "trained")
    assert not any("qkv_proj" in key or "gate_up_proj" in key for key in _lora_keys(tmp_path / "trained"))
    reloaded = PeftModel.from_pretrained(original_class.from_pretrained(path), tmp_path / "trained")
    assert_same_logits(logits(reloaded, IDS), logits(original, IDS))


@pytest.mark.parametrize(
    "targets, canonical",
    [
        (["q_proj", "v_proj"], {"q_proj", "v_proj"}),
        (["qkv_proj", "gate_up_proj"], {"q_proj", "k_proj", "v_proj", "gate_proj", "up_proj"}),
        ("all-linear", set(ALL)),
    ],
)
def test_lora_training_by_original_or_fused_names_saves_canonically(checkpoint, tmp_path, targets, canonical):
    path, original_class, fused_class = _base(checkpoint, "llama")
    model = _sgd_step(get_peft_model(fused_class.from_pretrained(path), LoraConfig(r=4, target_modules=targets)))
    qkv = model.base_model.model.model.layers[0].self_attn.qkv_proj
    b = qkv.lora_B["default"]
    assert torch.count_nonzero(b.weight) and not torch.count_nonzero(b.weight.masked_fill(b.mask, 0))
    model.save_pretrained(tmp_path / "trained")
    saved = json.loads((tmp_path / "trained" / "adapter_config.json").read_text())
    assert {name.rpartition(".")[2] for name in saved["target_modules"]} == canonical
    assert {key.split(".")[-3] for key in _lora_keys(tmp_path / "trained")} == canonical
    reloaded = PeftModel.from_pretrained(original_class.from_pretrained(path), tmp_path / "trained")
    assert_same_logits(logits(reloaded, IDS), logits(model, IDS))


SAME_SEED = {
    "q_v": {"target_modules": ["q_proj", "v_proj"]},  # TRL's and PEFT's llama default
    "all-linear": {"target_modules": "all-linear"},
    "fused-names": {"target_modules": ["qkv_proj", "gate_up_proj", "down_proj"]},  # the original: the pieces
    "ranks": {
        "target_modules": ["k_proj", "v_proj", "up_proj"],
        "rank_pattern": {"v_proj": 8},
        "alpha_pattern": {"v_proj": 16},
    },
    "no-init": {"target_modules": ["q_proj", "k_proj", "o_proj", "gate_proj"], "init_lora_weights": False},
    "gaussian": {"target_modules": ["q_proj", "v_proj", "up_proj"], "init_lora_weights": "gaussian"},
    # one dropout mask per adapted piece, drawn in the original's order (PieceDropout)
    "dropout-q_v": {"target_modules": ["q_proj", "v_proj"], "lora_dropout": 0.1},
    "dropout-all-linear": {"target_modules": "all-linear", "lora_dropout": 0.3},
    "dropout-ranks": {
        "target_modules": ["k_proj", "v_proj", "up_proj"],
        "rank_pattern": {"v_proj": 8},
        "alpha_pattern": {"v_proj": 16},
        "lora_dropout": 0.2,
    },
}


def _same_seed_run(model, lora, seed, steps=3):
    """`get_peft_model` at `seed`, then `steps` AdamW steps at seed + 1: (initial adapter, losses)."""
    from peft import get_peft_model_state_dict

    torch.manual_seed(seed)
    model = get_peft_model(model, LoraConfig(r=4, lora_alpha=8, **lora))
    initial = {k: v.clone() for k, v in get_peft_model_state_dict(model).items()}
    torch.manual_seed(seed + 1)
    optimizer = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=1e-2)
    model.train()
    losses = []
    for _ in range(steps):
        optimizer.zero_grad()
        loss = model(input_ids=IDS, labels=IDS).loss
        loss.backward()
        optimizer.step()
        losses.append(loss.item())
    return initial, losses


@pytest.mark.parametrize("lora", sorted(SAME_SEED))
@pytest.mark.parametrize("model_type", sorted(MODELS))
def test_same_seed_lora_is_the_originals_adapter_and_run(checkpoint, model_type, lora):
    """PEFT on the fused model draws each piece's A and B as it does on the original, in the original's order:
    the same seed gives bit-identical adapters (in canonical names), and then the same training run."""
    path, original_class, fused_class = _base(checkpoint, model_type)
    runs = {}
    fused_lora = SAME_SEED[lora]
    original_lora = {**fused_lora}
    if lora == "fused-names":
        original_lora["target_modules"] = ["q_proj", "k_proj", "v_proj", "gate_proj", "up_proj", "down_proj"]
    for name, model_class, config in (("original", original_class, original_lora), ("fused", fused_class, fused_lora)):
        runs[name] = _same_seed_run(model_class.from_pretrained(path), config, seed=7)
    (initial, losses), (fused_initial, fused_losses) = runs["original"], runs["fused"]
    assert sorted(fused_initial) == sorted(initial)
    unequal = [k for k in initial if not torch.equal(fused_initial[k], initial[k])]
    assert not unequal, f"{len(unequal)} of {len(initial)} initial adapter tensors differ, e.g. {unequal[:2]}"
    loss_diff = max(abs(a - b) for a, b in zip(losses, fused_losses))
    print(f"{model_type} {lora}: losses {losses}, max loss difference {loss_diff:.3g}")
    assert loss_diff <= TOLERANCE * max(1.0, *losses), (losses, fused_losses)


def test_lora_targets_keep_the_originals_module_order():
    """Where the fused model's order of adaptable modules differs from the original's, a merged linear's pieces
    counted where the merged linear is (tiny configs, on the meta device): there PEFT's injection draws in another
    order, and `replay_in_original_order` draws the adapter again in the original's
    (`test_same_seed_lora_init_on_every_type` checks the numbers). deepseek_v3's fused_qkv_a_proj
    (q_a_proj + kv_a_proj_with_mqa) is built after q_b_proj, which the original builds between them; gemma3's
    Siglip attention builds k, v, q, its merged linear holds q, k, v."""
    from pathlib import Path
    from types import SimpleNamespace

    from fusegen.runtime.peft import merged_linears
    from fusegen.testkit import tiny_config

    def adaptable(module):
        return isinstance(module, (nn.Linear, nn.Embedding, nn.Conv1d, nn.Conv2d)) or type(module).__name__ == "Conv1D"

    differing = {}
    # The files built around a causal LM (they register it); the multimodal and encoder files are checked by
    # tests/test_multimodal_files.py.
    files = Path("generated").glob("fused_*.py")
    types = sorted(p.stem.removeprefix("fused_") for p in files if "\nregister_fused_causal_lm(" in p.read_text())
    assert "llama" in types and len(types) > 5
    for model_type in types:
        config_class, original_class, fused_class = model_classes(model_type)
        config = tiny_config(SimpleNamespace(config_class=config_class, causal_lm=original_class))
        with torch.device("meta"):
            original, fused = original_class(config), fused_class(config)
        merged = merged_linears(fused)
        assert merged, model_type
        order = []
        for name, module in fused.named_modules():
            if name in merged:
                order += [merged[name].piece_path(piece) for piece in merged[name].pieces]
            elif adaptable(module):
                order.append(name)
        expected = [name for name, module in original.named_modules() if adaptable(module)]
        assert sorted(order) == sorted(expected), model_type
        if order != expected:
            differing[model_type] = next(a for a, b in zip(order, expected) if a != b)
    assert differing == {
        "deepseek_v3": "model.layers.0.self_attn.q_b_proj",
        # Siglip's attention builds k_proj, v_proj, q_proj in that order; the merged qkv_proj is in q, k, v row order.
        "gemma3": "model.vision_tower.encoder.layers.0.self_attn.q_proj",
    }


def test_same_seed_lora_init_on_every_type():
    """`get_peft_model` at one seed, adapting every linear of the original but `lm_head` (by name), on the fused model
    gives bit for bit the original's initial adapter (canonical names) and leaves the generator where the original's
    leaves it, on every causal-LM type, with init True, False and "gaussian". The types whose module order differs (deepseek_v3, gemma3's Siglip
    attention) are redrawn in the original's order (`replay_in_original_order`, seen to run for those two only);
    with the redraw switched off they differ (the control)."""
    import copy
    from types import SimpleNamespace

    from peft import get_peft_model_state_dict

    from fusegen.runtime import peft as fused_peft
    from fusegen.testkit import tiny_config

    def initial(model, targets, init, replay=None):
        """The initial adapter at seed 11, the generator state after it, and whether the adapter was redrawn."""
        calls = []
        real = fused_peft.replay_in_original_order

        def recording(*args):
            calls.append(real(*args) if replay is None else replay(*args))
            return calls[-1]

        fused_peft.replay_in_original_order = recording
        try:
            torch.manual_seed(11)
            adapted = get_peft_model(model, LoraConfig(r=2, lora_alpha=4, target_modules=targets,
                                                       init_lora_weights=init))  # fmt: skip
        finally:
            fused_peft.replay_in_original_order = real
        state = {k: v.clone() for k, v in get_peft_model_state_dict(adapted).items()}
        return state, torch.get_rng_state(), any(calls)

    types = _causal_lm_types()
    assert {"deepseek_v3", "gemma3", "llama"} <= set(types)
    checked, redrawn, control = 0, set(), {}
    for model_type in types:
        config_class, original_class, fused_class = model_classes(model_type)
        config = tiny_config(SimpleNamespace(config_class=config_class, causal_lm=original_class))
        original, fused = original_class(config), fused_class(config)
        targets = sorted({n.rpartition(".")[2] for n, m in original.named_modules() if isinstance(m, nn.Linear)})
        targets.remove("lm_head")
        for init in (True, False, "gaussian"):
            expected, state, _ = initial(copy.deepcopy(original), targets, init)
            actual, fused_state, replayed = initial(copy.deepcopy(fused), targets, init)
            assert sorted(actual) == sorted(expected), (model_type, init)
            unequal = [k for k in expected if not torch.equal(actual[k], expected[k])]
            assert not unequal, (model_type, init, len(unequal), unequal[:3])
            assert torch.equal(state, fused_state), (model_type, init)
            checked += 1
            if replayed:
                redrawn.add(model_type)
                unreplayed, _, _ = initial(copy.deepcopy(fused), targets, init, replay=lambda *args: False)
                control[model_type, init] = sum(not torch.equal(unreplayed[k], expected[k]) for k in expected)
    print(
        f"{checked} cases bit-identical; redrawn: {sorted(redrawn)}; tensors differing without the redraw: {control}"
    )
    assert redrawn == {"deepseek_v3", "gemma3"}, redrawn
    assert all(count > 0 for count in control.values()), control


def test_all_linear_on_deepseek_v3_adapts_what_the_original_adapts_with_its_numbers():
    """`target_modules="all-linear"` on a v5 MoE type: PEFT resolves the string for the original to the linears' leaf
    names plus the v4 MoE names (`gate`, `gate_proj`, ...), so the router `mlp.gate` (a custom module, no
    `nn.Linear`) and the experts get parameter adapters. The fused model adapts the same modules and parameters, with
    the same initial adapter at one seed and the generator left in the same state; before the fix the fused model
    left the router out (full module names, no `gate`)."""
    import copy
    from types import SimpleNamespace

    from peft import get_peft_model_state_dict

    from fusegen.testkit import tiny_config

    config_class, original_class, fused_class = model_classes("deepseek_v3")
    config = tiny_config(SimpleNamespace(config_class=config_class, causal_lm=original_class))
    original, fused = original_class(config), fused_class(config)
    assert any(
        not isinstance(layer.mlp.gate, nn.Linear) for layer in original.model.layers if hasattr(layer.mlp, "gate")
    )
    adapters, states = [], []
    for model in (copy.deepcopy(original), copy.deepcopy(fused)):
        torch.manual_seed(5)
        adapted = get_peft_model(model, LoraConfig(r=2, lora_alpha=4, target_modules="all-linear"))
        adapters.append({k: v.clone() for k, v in get_peft_model_state_dict(adapted).items()})
        states.append(torch.get_rng_state())
    expected, actual = adapters
    assert any(".mlp.gate." in key for key in expected)  # the router is adapted on the original
    assert sorted(actual) == sorted(expected)
    assert [k for k in expected if not torch.equal(actual[k], expected[k])] == []
    assert torch.equal(states[0], states[1])


def _causal_lm_types():
    """The model types of the generated files built around a causal LM (they register it)."""
    from pathlib import Path

    files = Path("generated").glob("fused_*.py")
    return sorted(p.stem.removeprefix("fused_") for p in files if "\nregister_fused_causal_lm(" in p.read_text())


def test_lora_dropout_draws_follow_the_originals_calls():
    """What same-seed parity with `lora_dropout > 0` rests on: the original's forward calls a merged linear's
    pieces one after the other (no other adaptable module called in between) and in row order, so the merged
    layer's per-piece masks (`PieceDropout`, drawn in row order at the merged call) are the original's draws. Checked
    on each causal-LM type's original (tiny config, one forward, hooks recording the calls). The known exception:
    deepseek_v3 calls q_a_proj, q_b_proj, then kv_a_proj_with_mqa, so with dropout on q_b_proj and on a piece of
    fused_qkv_a_proj the masks are drawn in another order (docs/ecosystem.md)."""
    from types import SimpleNamespace

    from fusegen.compiler.modal_inputs import forward_inputs
    from fusegen.runtime.peft import merged_linears
    from fusegen.testkit import random_input, tiny_config

    def adaptable(module):
        return isinstance(module, (nn.Linear, nn.Embedding, nn.Conv1d, nn.Conv2d)) or type(module).__name__ == "Conv1D"

    types = _causal_lm_types()
    assert "llama" in types and len(types) > 5
    differing = {}
    for model_type in types:
        config_class, original_class, fused_class = model_classes(model_type)
        config = tiny_config(SimpleNamespace(config_class=config_class, causal_lm=original_class))
        torch.manual_seed(0)
        original = original_class(config).eval()
        with torch.device("meta"):
            merged = merged_linears(fused_class(config))
        calls = []
        for name, module in original.named_modules():
            if adaptable(module):
                module.register_forward_pre_hook(lambda module, args, name=name, calls=calls: calls.append(name))
        with torch.no_grad():  # text, and images where the forward takes them (gemma3's Siglip tower)
            original(**forward_inputs(original, config, random_input(config)))
        for m in merged.values():
            pieces = [m.piece_path(piece) for piece in m.pieces]
            first = [i for i, name in enumerate(calls) if name == pieces[0]]
            assert first, (model_type, pieces[0])
            for start in first:
                if calls[start : start + len(pieces)] != pieces:
                    differing.setdefault(model_type, (pieces, calls[start : start + len(pieces)]))
    print(differing)
    assert set(differing) == {"deepseek_v3"}, differing
    pieces, called = differing["deepseek_v3"]
    assert called[:2] == ["model.layers.0.self_attn.q_a_proj", "model.layers.0.self_attn.q_b_proj"], called


def test_merge_and_unload_gives_the_adapted_outputs(checkpoint, tmp_path):
    path, original_class, fused_class = _base(checkpoint, "qwen2")
    adapter, expected = _adapter(tmp_path, original_class, path, target_modules=["k_proj", "gate_proj"])
    merged = PeftModel.from_pretrained(fused_class.from_pretrained(path), adapter).merge_and_unload()
    assert type(merged.model.layers[0].self_attn.qkv_proj).__name__ == "MergedColumnLinear"
    assert_same_logits(logits(merged, IDS), expected)


def test_importing_a_generated_file_does_not_import_peft_but_arms_it():
    code = (
        "import sys, generated.fused_llama\n"
        "assert 'peft' not in sys.modules\n"
        "from peft.tuners.tuners_utils import BaseTuner\n"
        "assert BaseTuner.inject_adapter._fusegen\n"
    )
    subprocess.run([sys.executable, "-c", code], check=True, capture_output=True)


# --------------------------------------------------------------------------------------------------------------------
# Canonical checkpoints and pipelines
# --------------------------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("model_type", sorted(MODELS))
def test_saved_config_names_the_original_architecture(checkpoint, tmp_path, model_type):
    path, original_class, fused_class = _base(checkpoint, model_type)
    fused = fused_class.from_pretrained(path)
    fused.save_pretrained(tmp_path / "saved")
    config = json.loads((tmp_path / "saved" / "config.json").read_text())
    assert config["architectures"] == [original_class.__name__]
    # The fused class loads a config naming either class, with the same weights.
    config["architectures"] = [fused_class.__name__]
    (tmp_path / "saved" / "config.json").write_text(json.dumps(config))
    for directory in (path, tmp_path / "saved"):
        torch.testing.assert_close(logits(fused_class.from_pretrained(directory), IDS), logits(fused, IDS))


def _tokenizer():
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    tokenizer = Tokenizer(models.WordLevel({f"w{i}": i for i in range(128)}, unk_token="w0"))
    tokenizer.pre_tokenizer = pre_tokenizers.Whitespace()
    return PreTrainedTokenizerFast(tokenizer_object=tokenizer, unk_token="w0", eos_token="w1", pad_token="w2")


def test_text_generation_pipeline_logs_no_error(caplog):
    from transformers import pipeline

    fused = random_model(FusedLlamaForCausalLM, small_config(LlamaConfig))
    logging.getLogger("transformers").addHandler(caplog.handler)
    try:
        with caplog.at_level(logging.WARNING, logger="transformers"):
            generator = pipeline("text-generation", model=fused, tokenizer=_tokenizer())
            generator("w3 w4", max_new_tokens=2, do_sample=False)
    finally:
        logging.getLogger("transformers").removeHandler(caplog.handler)
    assert not [r for r in caplog.records if r.levelno >= logging.ERROR], caplog.text
    # ...and original models still load as themselves.
    assert type(AutoModelForCausalLM.from_config(small_config(LlamaConfig))) is LlamaForCausalLM


# --------------------------------------------------------------------------------------------------------------------
# Remote code: fusegen export
# --------------------------------------------------------------------------------------------------------------------

REMOTE_LOAD = """
import sys, torch
from transformers import AutoModelForCausalLM, LlamaForCausalLM
fused = AutoModelForCausalLM.from_pretrained(sys.argv[1], trust_remote_code=True).eval()
original = LlamaForCausalLM.from_pretrained(sys.argv[2]).eval()
ids = torch.tensor([[1, 5, 9, 42, 7]])
with torch.no_grad():
    print(type(fused).__name__, (fused(ids).logits - original(ids).logits).abs().max().item())
"""
BLOCK_FUSEGEN = """
import importlib.abc, sys
class Block(importlib.abc.MetaPathFinder):
    def find_spec(self, name, path=None, target=None):
        if name == "fusegen" or name.startswith("fusegen."):
            raise ModuleNotFoundError(f"No module named {name!r}")
sys.meta_path.insert(0, Block())
"""


def _export(checkpoint, tmp_path):
    from fusegen.cli import main

    path, _, _ = _base(checkpoint, "llama")
    assert main(["export", str(path), str(tmp_path / "remote"), "--model", "llama"]) == 0
    return path, tmp_path / "remote"


def _run(code, *args, tmp_path):
    env = {**os.environ, "HF_MODULES_CACHE": str(tmp_path / "modules")}
    return subprocess.run(
        [sys.executable, "-c", code, *map(str, args)], capture_output=True, text=True, env=env, check=False
    )


def test_export_loads_as_the_fused_class_with_trust_remote_code(checkpoint, tmp_path):
    path, remote = _export(checkpoint, tmp_path)
    config = json.loads((remote / "config.json").read_text())
    assert config["architectures"] == ["LlamaForCausalLM"]
    assert config["auto_map"] == {
        "AutoModel": "fused_llama.FusedLlamaModel",
        "AutoModelForCausalLM": "fused_llama.FusedLlamaForCausalLM",
    }
    result = _run(REMOTE_LOAD, remote, path, tmp_path=tmp_path)
    assert result.returncode == 0, result.stderr[-2000:]
    name, diff = result.stdout.split()
    assert name == "FusedLlamaForCausalLM" and float(diff) <= TOLERANCE


def test_export_without_fusegen_installed_names_the_package(checkpoint, tmp_path):
    path, remote = _export(checkpoint, tmp_path)
    result = _run(BLOCK_FUSEGEN + REMOTE_LOAD, remote, path, tmp_path=tmp_path)
    assert result.returncode != 0
    assert "pip install fusegen" in result.stderr.splitlines()[-1], result.stderr[-2000:]


def test_export_bad_input_exits_2_and_writes_nothing(checkpoint, tmp_path, capsys):
    from fusegen.cli import main

    path, remote = _export(checkpoint, tmp_path)
    before = sorted(p.name for p in remote.iterdir())
    cases = [
        ([str(path), str(remote), "--model", "llama"], "not an empty directory"),
        ([str(path), str(tmp_path / "b"), "--model", "qwen2"], "not 'qwen2'"),
        ([str(tmp_path / "missing"), str(tmp_path / "c"), "--model", "llama"], "no config.json"),
        ([str(path), str(tmp_path / "d"), "--model", "nosuchmodel"], "fusegen build nosuchmodel"),
    ]
    for argv, message in cases:
        assert main(["export", *argv]) == 2
        assert message in capsys.readouterr().err
    assert sorted(p.name for p in remote.iterdir()) == before
    assert sorted(p.name for p in tmp_path.iterdir()) == ["original", "remote"]


ASK_THEN_IMPORT_PEFT = """
import importlib.util, sys
import fusegen.runtime
assert "peft" not in sys.modules
assert importlib.util.find_spec("peft") is not None  # what Transformers' is_peft_available() does
from peft.tuners.tuners_utils import BaseTuner
print(getattr(BaseTuner.inject_adapter, "_fusegen", False))
"""


def test_asking_whether_peft_is_installed_does_not_disarm_the_hooks(tmp_path):
    """Asking for PEFT's spec (Transformers' is_peft_available, e.g. inside from_pretrained) before PEFT is imported
    used to remove the import hook, so PEFT later loaded untaught and a canonical adapter found no q_proj."""
    result = _run(ASK_THEN_IMPORT_PEFT, tmp_path=tmp_path)
    assert result.returncode == 0, result.stderr[-2000:]
    assert result.stdout.split()[-1] == "True"
