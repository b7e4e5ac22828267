"""Quantizers through `quantization_config` on the fused classes, against the original class under the same config.

Each scheme fusegen supports is row-separable (per-row scales, or blocks/groups inside one piece), so the fused model
must give the original's logits; a scheme that is not, a pre-quantized checkpoint that cannot be merged, and a save
that the original could not read back must raise. Measured differences print with `pytest tests/test_quant.py -rP`.
"""

from __future__ import annotations

import logging
import warnings

import pytest
import torch
import torchao.quantization as torchao_quantization
from transformers import (
    BitsAndBytesConfig,
    LlamaConfig,
    LlamaForCausalLM,
    QuantoConfig,
    TorchAoConfig,
)

from fusegen.runtime.quant import QuantizationRefused
from fusegen.testkit import MODELS, TOLERANCE, logits, model_classes, random_model, small_config
from generated.fused_llama import FusedLlamaForCausalLM

pytestmark = pytest.mark.slow  # quantizers on every scheme

# intermediate_size 128: bitsandbytes' CPU 4-bit kernel needs in_features divisible by its block size (64).
OVERRIDES = {"num_key_value_heads": 2, "intermediate_size": 128}
SCHEMES = {
    "bnb-8bit": lambda: BitsAndBytesConfig(load_in_8bit=True),
    "bnb-4bit-nf4": lambda: BitsAndBytesConfig(load_in_4bit=True, bnb_4bit_quant_type="nf4"),
    "bnb-4bit-fp4": lambda: BitsAndBytesConfig(load_in_4bit=True, bnb_4bit_quant_type="fp4"),
    "quanto-int8": lambda: QuantoConfig(weights="int8"),
    "quanto-int4": lambda: QuantoConfig(weights="int4"),
    "torchao-int8-weight-only": lambda: TorchAoConfig(torchao_quantization.Int8WeightOnlyConfig()),
    "torchao-int8-dynamic": lambda: TorchAoConfig(torchao_quantization.Int8DynamicActivationInt8WeightConfig()),
}


@pytest.fixture(autouse=True)
def _quiet():
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        yield


def _ids():
    return torch.randint(0, 128, (2, 12), generator=torch.Generator().manual_seed(1))


@pytest.fixture(scope="module")
def saved(tmp_path_factory):
    """One float checkpoint per model type, saved by the original class."""
    paths = {}
    for name in MODELS:
        config_class, original_class, _ = model_classes(name)
        path = tmp_path_factory.mktemp(name)
        random_model(original_class, small_config(config_class, **OVERRIDES)).save_pretrained(path)
        paths[name] = path
    return paths


@pytest.mark.parametrize(
    ("model_type", "scheme"),
    [("llama", scheme) for scheme in sorted(SCHEMES)]
    + [("qwen2", scheme) for scheme in ("bnb-4bit-nf4", "bnb-8bit", "quanto-int8", "torchao-int8-weight-only")],
)
def test_fused_model_quantizes_as_the_original(saved, model_type, scheme):
    _, original_class, fused_class = model_classes(model_type)
    original = original_class.from_pretrained(saved[model_type], quantization_config=SCHEMES[scheme]())
    fused = fused_class.from_pretrained(saved[model_type], quantization_config=SCHEMES[scheme]())
    piece = original.model.layers[0].self_attn.q_proj
    for merged in (fused.model.layers[0].self_attn.qkv_proj, fused.model.layers[0].mlp.gate_up_proj):
        assert isinstance(merged, type(piece)), f"{merged} is not quantized like {piece}"  # torchao: in place
        assert type(merged.weight) is type(piece.weight)
    difference = (logits(original, _ids()) - logits(fused, _ids())).abs().max().item()
    print(f"{model_type} {scheme}: max |logits fused - original| = {difference:.3g}")
    assert difference <= TOLERANCE
    # Quantized at all: the logits moved away from the float model's.
    assert (
        logits(original_class.from_pretrained(saved[model_type]), _ids()) - logits(fused, _ids())
    ).abs().max() > 1e-4


REFUSED = {
    "bnb-4bit-double-quant": (
        lambda: BitsAndBytesConfig(load_in_4bit=True, bnb_4bit_use_double_quant=True),
        "bnb_4bit_use_double_quant",
    ),
    "quanto-skip-gate": (
        lambda: QuantoConfig(weights="int8", modules_to_not_convert=["lm_head", "gate_proj"]),
        "modules_to_not_convert entry 'gate_proj'",
    ),
    "torchao-per-tensor": (
        lambda: TorchAoConfig(torchao_quantization.Int8WeightOnlyConfig(granularity=torchao_quantization.PerTensor())),
        "granularity PerTensor",
    ),
    "skip-one-piece": (
        lambda: BitsAndBytesConfig(load_in_8bit=True, llm_int8_skip_modules=["q_proj"]),
        "modules_to_not_convert entry 'q_proj'",
    ),
}


@pytest.mark.parametrize("case", sorted(REFUSED))
def test_schemes_that_are_not_row_separable_are_refused(saved, case):
    make, message = REFUSED[case]
    with pytest.raises(QuantizationRefused, match=message) as raised:
        FusedLlamaForCausalLM.from_pretrained(saved["llama"], quantization_config=make())
    assert "FusedLlamaModel (" in str(raised.value) and "original class (e.g. LlamaModel)" in str(raised.value)


def test_bnb_4bit_blocks_straddling_two_pieces_are_refused(tmp_path):
    # k and v are each one head of 12 rows by 36 inputs: 432 weights, not a multiple of bitsandbytes' 64.
    config = small_config(LlamaConfig, hidden_size=36, num_attention_heads=3, num_key_value_heads=1, head_dim=12)
    random_model(LlamaForCausalLM, config).save_pretrained(tmp_path)
    with pytest.raises(QuantizationRefused, match="does not fill whole blocks of 64"):
        FusedLlamaForCausalLM.from_pretrained(tmp_path, quantization_config=BitsAndBytesConfig(load_in_4bit=True))


class _Records(logging.Handler):
    def __init__(self):
        super().__init__()
        self.messages = []

    def emit(self, record):
        self.messages.append(record.getMessage())


@pytest.mark.parametrize("scheme", ["bnb-8bit", "bnb-4bit-nf4"])
def test_pre_quantized_checkpoint_of_the_original_is_refused(saved, tmp_path, scheme):
    """Loading merged pieces of per-piece quantizer state would misload: raise, naming the tensor and why."""
    original = LlamaForCausalLM.from_pretrained(saved["llama"], quantization_config=SCHEMES[scheme]())
    original.save_pretrained(tmp_path)
    records = _Records()
    logger = logging.getLogger("transformers")
    logger.addHandler(records)
    try:
        # Transformers raises RuntimeError after logging its load report; a strict loader may raise ValueError first.
        with pytest.raises((RuntimeError, ValueError)) as raised:
            FusedLlamaForCausalLM.from_pretrained(tmp_path)
    finally:
        logger.removeHandler(records)
    report = "\n".join([*records.messages, str(raised.value)])
    assert "the checkpoint holds pre-quantized pieces (bitsandbytes" in report, report[-2000:]


def test_pre_quantized_torchao_checkpoint_of_the_original_is_refused(saved, tmp_path):
    original = LlamaForCausalLM.from_pretrained(
        saved["llama"], quantization_config=SCHEMES["torchao-int8-weight-only"]()
    )
    original.save_pretrained(tmp_path)
    with pytest.raises((RuntimeError, ValueError), match="qkv_proj"):
        FusedLlamaForCausalLM.from_pretrained(tmp_path)


def test_bnb_8bit_fused_model_saves_what_the_original_loads(saved, tmp_path):
    original = LlamaForCausalLM.from_pretrained(saved["llama"], quantization_config=SCHEMES["bnb-8bit"]())
    fused = FusedLlamaForCausalLM.from_pretrained(saved["llama"], quantization_config=SCHEMES["bnb-8bit"]())
    fused.save_pretrained(tmp_path)
    reloaded = LlamaForCausalLM.from_pretrained(tmp_path)
    assert reloaded.config.quantization_config.load_in_8bit
    assert type(reloaded.model.layers[0].self_attn.k_proj) is type(original.model.layers[0].self_attn.k_proj)
    assert (logits(original, _ids()) - logits(reloaded, _ids())).abs().max().item() <= TOLERANCE


@pytest.mark.parametrize("scheme", ["bnb-4bit-nf4", "torchao-int8-weight-only"])
def test_saving_a_quantized_fused_model_the_original_cannot_read_is_refused(saved, tmp_path, scheme):
    fused = FusedLlamaForCausalLM.from_pretrained(saved["llama"], quantization_config=SCHEMES[scheme]())
    with pytest.raises(QuantizationRefused, match="cannot save a .*-quantized FusedLlamaForCausalLM"):
        fused.save_pretrained(tmp_path)
