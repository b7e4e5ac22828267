"""Figures for docs/ecosystem.md: PEFT adapters trained on the original, loaded onto the fused class.

For tiny random llama and qwen2 models (GQA, biases on qwen2), a LoRA adapter is made on the ORIGINAL class for
each target set, with random (non-zero) A and B, saved, and loaded onto the fused class two ways:
`PeftModel.from_pretrained` and Transformers' `model.load_adapter`. Prints the max abs logits difference against
the original with the same adapter, or the exception the load raised, and whether it is within the project's one
logits rule, `fusegen.testkit.logits_tolerance` (TOLERANCE times the logits' scale; the build's validation and
tests/test_ecosystem.py hold the same figures to it). Also: training on the fused model by original and by fused
names, and loading its saved adapter back into the original class.

    python bench/peft_adapters.py
"""

from __future__ import annotations

import tempfile
import warnings
from pathlib import Path

import torch
from transformers.utils import logging as hf_logging

from fusegen.testkit import MODELS, logits, logits_tolerance, model_classes, random_model, randomise, small_config

TARGETS = {
    "q,v (PEFT default)": ["q_proj", "v_proj"],
    "q,k,v,o,gate,up,down": ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"],
    "k,up": ["k_proj", "up_proj"],
}
IDS = torch.randint(0, 128, (2, 10), generator=torch.Generator().manual_seed(1))


def make_adapter(original_class, checkpoint, targets, out):
    from peft import LoraConfig, get_peft_model

    torch.manual_seed(2)
    model = get_peft_model(
        original_class.from_pretrained(checkpoint), LoraConfig(r=4, lora_alpha=8, target_modules=targets)
    )
    randomise(model, lambda name: "lora_" in name)
    model.save_pretrained(out)
    return logits(model, IDS), sum("lora_" in k for k in model.state_dict())


def via_peft_model(fused_class, checkpoint, adapter):
    from peft import PeftModel

    model = PeftModel.from_pretrained(fused_class.from_pretrained(checkpoint), adapter).eval()
    return logits(model, IDS)


def via_load_adapter(fused_class, checkpoint, adapter):
    model = fused_class.from_pretrained(checkpoint)
    model.load_adapter(adapter)
    return logits(model, IDS)


def attempt(function, *args):
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            return function(*args), None
    except Exception as error:  # noqa: BLE001 (a figure script reports whatever happened)
        return None, f"{type(error).__name__}: {str(error)[:90]}"


def training_round_trip(config_class, original_class, fused_class, checkpoint, targets, out):
    """Train 3 SGD steps on the fused model with `targets`; save; load into the original; compare logits."""
    from peft import LoraConfig, PeftModel, get_peft_model

    torch.manual_seed(3)
    model = get_peft_model(
        fused_class.from_pretrained(checkpoint), LoraConfig(r=4, lora_alpha=8, target_modules=targets)
    )
    optimizer = torch.optim.SGD([p for p in model.parameters() if p.requires_grad], lr=0.5)
    model.train()
    for _ in range(3):
        loss = model(IDS, labels=IDS).loss
        loss.backward()
        optimizer.step()
        optimizer.zero_grad()
    model.save_pretrained(out)
    reloaded = PeftModel.from_pretrained(original_class.from_pretrained(checkpoint), out).eval()
    return logits(reloaded, IDS), logits(model, IDS)


def judged(expected, got) -> str:
    """The figure and the verdict of the one logits rule on it."""
    diff, bound = (got - expected).abs().max().item(), logits_tolerance(expected)
    verdict = "within" if diff <= bound else "OVER"
    return (
        f"max |logits diff| {diff:.2e} (max |logit| {expected.abs().max().item():.1f}, bound {bound:.1e}: {verdict})"
    )


def main():
    hf_logging.set_verbosity_error()
    hf_logging.disable_progress_bar()
    with tempfile.TemporaryDirectory() as tmp:
        for model_type in MODELS:
            config_class, original_class, fused_class = model_classes(model_type)
            base = random_model(original_class, small_config(config_class, num_key_value_heads=2))
            checkpoint = Path(tmp) / model_type
            base.save_pretrained(checkpoint)
            for label, targets in TARGETS.items():
                adapter = Path(tmp) / f"{model_type}-{label}"
                expected, tensors = make_adapter(original_class, checkpoint, targets, adapter)
                for how, function in (
                    ("PeftModel.from_pretrained", via_peft_model),
                    ("load_adapter", via_load_adapter),
                ):
                    got, error = attempt(function, fused_class, checkpoint, adapter)
                    figure = error or judged(expected, got)
                    print(f"{model_type:6} adapter on {label:22} ({tensors:2} tensors) via {how:26} {figure}")
            for label, targets in (
                ("original names q,v", ["q_proj", "v_proj"]),
                ("fused names", ["qkv_proj", "gate_up_proj"]),
            ):
                pair, error = attempt(
                    training_round_trip,
                    config_class,
                    original_class,
                    fused_class,
                    checkpoint,
                    targets,
                    Path(tmp) / f"{model_type}-trained-{label}",
                )
                figure = error or f"fused-trained adapter in the original class: {judged(*pair)}"
                print(f"{model_type:6} LoRA training on the fused model, {label:18} {figure}")


if __name__ == "__main__":
    main()
