"""Training parity: where the original trains, the fused model gives the same loss and the same gradients.

A merged weight's gradient must equal its pieces' gradients concatenated in `STACKED_PARAMS_MAPPING` order, with and
without gradient checkpointing, and also when the forward writes a projection's output in place (`g.mul_(0.5)`),
which a plain `split` turns into an autograd error.
"""

import importlib

import pytest
import torch

from fusegen.compiler.build import build
from fusegen.fusions.merged import rewrite_forward
from fusegen.testkit import GRAD_TOLERANCE, MODELS, TOLERANCE, model_classes, random_model, small_config
from tests.test_hazards import GLU_INIT, write_case

pytestmark = pytest.mark.slow  # training steps and toy builds with validation


# The toy block's forward writes projection outputs in place, each in another spelling; q/k/v are only read.
IN_PLACE_FORWARDS = {
    "method": "        g = self.gate_proj(x)\n        g.mul_(0.5)\n        u = self.up_proj(x)\n",
    "augmented": "        g = self.gate_proj(x)\n        u = self.up_proj(x)\n        u += 1\n        g *= 2\n",
    "item_write": "        g = self.gate_proj(x)\n        g[..., 0] = 0\n        u = self.up_proj(x)\n",
    "view_alias": "        g = self.gate_proj(x)\n        h = g.view(-1)\n        h.add_(1)\n        u = self.up_proj(x)\n",
    "function": "        g = self.gate_proj(x)\n        torch.relu_(g)\n        u = self.up_proj(x)\n",
    "direct": "        g = self.gate_proj(x).mul_(0.5)\n        u = self.up_proj(x)\n",
}
WRITTEN = {"method": ["gate"], "augmented": ["gate", "up"], "item_write": ["gate"], "view_alias": ["gate"]}
TOY_TAIL = (
    "        q = self.q_proj(x)\n        k = self.k_proj(x)\n        v = self.v_proj(x)\n"
    "        return q + torch.cat([k, v], dim=-1) + self.down_proj(self.act(g) * u)\n"
)


def train_step(model, input_ids, checkpointing=False):
    """Loss and `{name: grad}` of one training step (labels = inputs, the causal-LM loss)."""
    model.train()
    model.zero_grad(set_to_none=True)
    if checkpointing:
        model.gradient_checkpointing_enable()
    output = model(input_ids=input_ids, labels=input_ids, use_cache=False)
    loss = output.loss if output.loss is not None else output.logits.float().square().mean()
    loss.backward()
    return loss.detach(), {name: p.grad for name, p in model.named_parameters()}


def expected_grads(original_grads, fused_model):
    """The original's gradients in the fused model's names: merged ones are the pieces' gradients concatenated."""
    mapping = importlib.import_module(type(fused_model).__module__).STACKED_PARAMS_MAPPING
    expected = {}
    for name, _ in fused_model.named_parameters():
        path, _, tensor = name.rpartition(".")
        parent, _, merged = path.rpartition(".")
        if name in original_grads:
            expected[name] = original_grads[name]
        else:
            prefix = f"{parent}." if parent else ""
            expected[name] = torch.cat([original_grads[f"{prefix}{piece}.{tensor}"] for piece, _ in mapping[merged]])
    return expected


def assert_same_training(original, fused, input_ids, checkpointing=False):
    """Same loss within TOLERANCE, same gradients within GRAD_TOLERANCE of each tensor's largest; returns the worst."""
    loss, grads = train_step(original, input_ids, checkpointing)
    fused_loss, fused_grads = train_step(fused, input_ids, checkpointing)
    assert abs(loss.item() - fused_loss.item()) <= TOLERANCE, (loss, fused_loss)
    worst = 0.0
    for name, expected in expected_grads(grads, fused).items():
        actual = fused_grads[name]
        assert actual is not None and expected is not None, name
        relative = (actual - expected).abs().max().item() / expected.abs().max().item()
        assert relative <= GRAD_TOLERANCE, (name, relative)
        worst = max(worst, relative)
    return worst


@pytest.mark.parametrize("checkpointing", [False, True], ids=["plain", "checkpointing"])
@pytest.mark.parametrize("model_type", sorted(MODELS))
def test_llama_and_qwen2_train_like_the_original(checkpoint, model_type, checkpointing):
    config_class, original_class, fused_class = model_classes(model_type)
    path, _ = checkpoint(original_class, small_config(config_class, num_key_value_heads=2, attention_dropout=0.0))
    original = original_class.from_pretrained(path)
    fused, info = fused_class.from_pretrained(path, output_loading_info=True)
    assert not any(info.values()), info
    assert isinstance(fused.model.layers[0].mlp.gate_up_proj, torch.nn.Linear)
    input_ids = torch.randint(0, 128, (2, 12), generator=torch.Generator().manual_seed(3))
    assert_same_training(original, fused, input_ids, checkpointing)
    if checkpointing:  # the layers really recomputed: checkpointing is on in every decoder layer
        assert all(layer.gradient_checkpointing for layer in fused.model.layers)


def build_toy(case_path, name, forward):
    dotted = write_case(case_path, name, GLU_INIT, forward + TOY_TAIL)
    return dotted, build(dotted)


@pytest.mark.parametrize("spelling", sorted(IN_PLACE_FORWARDS))
def test_in_place_writes_on_projection_outputs_train_like_the_original(case_path, tmp_path, spelling):
    dotted, result = build_toy(case_path, f"inplace_{spelling}", IN_PLACE_FORWARDS[spelling])
    assert result.text is not None, [r for o in result.outcomes for r in o.refused]
    (fused_plans,) = [o.fused for o in result.outcomes if o.class_name == "ToyBlock"]
    assert {plan.merged for plan in fused_plans} == {"qkv_proj", "gate_up_proj"}, [o.refused for o in result.outcomes]
    for piece in ("q", "k", "v"):  # read only: they keep the plain split
        assert f"{piece}_proj_out = {piece}_proj_out.clone()" not in result.text
    for piece in WRITTEN.get(spelling, ["gate"]):
        assert f"{piece}_proj_out = {piece}_proj_out.clone()" in result.text
    (case_path / "hazard_cases" / f"fused_inplace_{spelling}.py").write_text(result.text)
    original_module = importlib.import_module(dotted)
    fused_module = importlib.import_module(f"hazard_cases.fused_inplace_{spelling}")
    original = random_model(original_module.ToyForCausalLM, original_module.ToyConfig())
    original.save_pretrained(tmp_path / "toy")
    fused, info = fused_module.FusedToyForCausalLM.from_pretrained(tmp_path / "toy", output_loading_info=True)
    assert not any(info.values()), info
    input_ids = torch.randint(0, 32, (2, 5), generator=torch.Generator().manual_seed(1))
    assert_same_training(original, fused, input_ids)


def test_without_the_clone_the_build_refuses_by_validation(case_path, monkeypatch):
    """The in-place fix switched off: the fused model raises in training, and validation refuses to write it."""
    monkeypatch.setattr(rewrite_forward, "detach_written_pieces", lambda *args: None)
    dotted = write_case(case_path, "inplace_unfixed", GLU_INIT, IN_PLACE_FORWARDS["method"] + TOY_TAIL)
    unvalidated = build(dotted, validate=False)
    assert unvalidated.text is not None and "clone()" not in unvalidated.text
    result = build(dotted)
    assert result.text is None
    refusals = [r for o in result.outcomes for r in o.refused]
    assert refusals and all(r.rule == "validation-mismatch" for r in refusals), refusals
    assert "SplitWithSizes" in refusals[0].reason and "train mode" in refusals[0].reason, refusals[0].reason


def test_olmo_clip_qkv_trains_like_the_original():
    """OLMo clamps q/k/v in place when `clip_qkv` is set; before the fix its fused model could not train then.

    The tiny config leaves `clip_qkv` unset (a forward-only field, so no construction variant covers it): the
    build must clone the clamped pieces anyway, and with the clones removed validation under clip_qkv fails.
    """
    from fusegen.compiler import validate
    from fusegen.testkit import tiny_config

    result = build("olmo")
    assert "q_proj_out = q_proj_out.clone()" in result.text and "v_proj_out = v_proj_out.clone()" in result.text
    assert "gate_proj_out = gate_proj_out.clone()" not in result.text  # the MLP writes nothing in place
    target = result.target
    config = tiny_config(target, clip_qkv=0.5)
    unfixed = "\n".join(line for line in result.text.splitlines() if not line.strip().endswith("_out.clone()"))
    checks = {}
    for name, text in (("fixed", result.text), ("unfixed", unfixed)):
        with validate._isolated(text, target) as module:
            fused_class = getattr(module, "Fused" + target.causal_lm.__name__)
            checks[name] = validate.check_config(
                "clip_qkv=0.5", target.causal_lm, fused_class, config, module.STACKED_PARAMS_MAPPING,
                validate.merging_classes_in_text(text), ("eval", "train"),
            )  # fmt: skip
    assert checks["fixed"].status == "passed" and checks["fixed"].grad_diff is not None, checks["fixed"]
    assert checks["unfixed"].status == "mismatch" and "SplitWithSizes" in checks["unfixed"].detail, checks["unfixed"]
