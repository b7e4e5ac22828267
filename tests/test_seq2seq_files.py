"""Encoder-decoders built through their seq2seq-LM class (`fusegen build bart`, the default head): the
file is written, validated, and its class loads a tiny random original checkpoint and gives the original's logits.

BART's pretrained base names its layers with raw strings (`_no_split_modules = [r"BartEncoderLayer", ...]`) and gets
the runtime base class added: the splice of that class once failed with "overlapping edits", an internal error, for
every type that copies BART's code. Each type here is built fresh (nothing is checked in for them)."""

from __future__ import annotations

import sys

import pytest
import torch

from fusegen.compiler.build import build
from fusegen.compiler.modal_inputs import forward_inputs
from fusegen.testkit import import_file, logits_tolerance, max_diff, random_input, save_random, tiny_config

SEQ2SEQ = ["bart", "mbart", "plbart", "marian", "pegasus", "blenderbot"]
"""BART and types that copy its code (`# Copied from transformers.models.bart...`); BART names its layers with raw
strings (the crash), the copies guard the splice of their own spellings. Each is built as its seq2seq-LM class."""


@pytest.mark.slow
@pytest.mark.parametrize("model_type", SEQ2SEQ)
def test_conditional_generation_builds_validates_and_loads_the_original_checkpoint(model_type, tmp_path):
    result = build(model_type)
    target = result.target
    assert target.head == "seq2seq-lm"  # its conditional-generation class (MarianMTModel for marian)
    assert result.text is not None, [o.refused for o in result.outcomes]
    assert result.validation.checks[0].status == "passed", result.validation.describe()
    assert result.validation.mismatch is None, result.validation.describe()
    assert "self.qkv_proj = MergedColumnLinear(" in result.text
    path = tmp_path / f"fused_{model_type.replace('-', '_')}.py"
    path.write_text(result.text)
    name = f"seq2seq_{model_type.replace('-', '_')}"
    module = import_file(path, name)
    try:
        fused_class = getattr(module, "Fused" + target.causal_lm.__name__)
        config = tiny_config(target)
        save_random(target.causal_lm, config, tmp_path / "ckpt")
        original = target.causal_lm.from_pretrained(tmp_path / "ckpt").eval()
        fused, info = fused_class.from_pretrained(tmp_path / "ckpt", output_loading_info=True)
        assert not {key: value for key, value in info.items() if value}
        assert any(name.endswith("self_attn.qkv_proj") for name, _ in fused.named_modules())
        inputs = forward_inputs(original, config, random_input(config))
        assert "decoder_input_ids" in inputs
        with torch.no_grad():
            expected, actual = original(**inputs).logits, fused.eval()(**inputs).logits
        assert max_diff(expected, actual) <= logits_tolerance(expected)
    finally:
        del sys.modules[name]
