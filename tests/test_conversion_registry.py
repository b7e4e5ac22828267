"""What a fused model loads and saves with is decided by its own classes and its own tree (fusegen/runtime/registry.py),
whatever else the process imported, built or registered: same-named classes of two generated modules, a tree that
gives a class other conversions, tensor parallelism's merge op, and the trees one class name cannot serve.

Every test runs inside `restored_registry` (autouse fixture), and the second generated module is imported for this file
only and removed after it, so these tests leave Transformers' registry, fusegen's record of merges and `sys.modules`
as they found them.
"""

from __future__ import annotations

import re
import sys
from pathlib import Path

import pytest
import torch
from transformers import DistributedConfig, LlamaConfig, LlamaForCausalLM, PreTrainedModel
from transformers.conversion_mapping import (
    get_checkpoint_conversion_mapping,
    get_model_conversion_mapping,
    register_checkpoint_conversion_mapping,
)
from transformers.core_model_loading import Chunk, WeightConverter, WeightRenaming

from fusegen.runtime import MergedColumnConcatenate, register_stacked_checkpoint
from fusegen.runtime.registry import register_for_tree, restored_registry
from fusegen.testkit import TOLERANCE, import_file, max_diff, random_model, small_config
from generated import fused_llama
from generated.fused_llama import FusedLlamaForCausalLM, FusedLlamaModel

ROOT = Path(__file__).resolve().parents[1]
OTHER = "fusegen_test_registry_llama_qkv_only"
"""A second generated module defining classes of the checked-in fused_llama's names, with q/k/v merged but gate/up
left as the original's: each module's models load right only with their own module's merges."""


def _qkv_only(text: str) -> str:
    """generated/fused_llama.py with the original MLP in place of the fused one and the gate/up merge removed."""
    edits = [
        (r"class FusedLlamaMLP\(nn\.Module\):.*?(?=\nclass FusedLlamaAttention)", ""),
        (r'\n    "gate_up_proj": \[\("gate_proj", 0\), \("up_proj", 1\)\],', ""),
        (r'parents=\{"gate_up_proj": \["mlp"\], "qkv_proj": \["self_attn"\]\}', 'parents={"qkv_proj": ["self_attn"]}'),
        (r"\nregister_fused_causal_lm\(FusedLlamaForCausalLM\)\n", "\n"),  # pipelines' list: not this test's business
        (r"(?=\nimport torch\n)", "\nfrom transformers.models.llama.modeling_llama import LlamaMLP as FusedLlamaMLP"),
    ]
    for pattern, replacement in edits:
        text, count = re.subn(pattern, replacement, text, count=1, flags=re.DOTALL)
        assert count == 1, f"generated/fused_llama.py no longer has {pattern!r}"
    return text


@pytest.fixture(scope="module")
def other(tmp_path_factory):
    with restored_registry():
        path = tmp_path_factory.mktemp("other") / "fused_llama.py"
        path.write_text(_qkv_only((ROOT / "generated" / "fused_llama.py").read_text()))
        try:
            yield import_file(path, OTHER)
        finally:
            sys.modules.pop(OTHER, None)


@pytest.fixture(autouse=True)
def registry():
    with restored_registry():
        yield


def _merge_ops(model) -> list:
    return [
        op
        for conversion in get_model_conversion_mapping(model, add_legacy=False)
        for op in getattr(conversion, "operations", [])
        if isinstance(op, MergedColumnConcatenate)
    ]


@pytest.mark.parametrize("order", [("checked_in", "other"), ("other", "checked_in")])
def test_same_named_classes_of_two_modules_each_load_and_save_with_their_own_merges(
    order, other, reload_module, tmp_path
):
    # Both orders in one process, after fusegen's modules were re-executed (tests/test_runtime.py reloads the
    # checkpoint module: "re-import / reload must be harmless"): which merges a model gets must come from its own
    # classes, not from what was registered last under their name nor from a table a re-import empties.
    reload_module("fusegen.runtime.checkpoint")
    reload_module("fusegen.runtime.registry")
    classes = {"checked_in": fused_llama.FusedLlamaForCausalLM, "other": other.FusedLlamaForCausalLM}
    assert classes["other"].__name__ == classes["checked_in"].__name__
    config = small_config(LlamaConfig, num_key_value_heads=2)
    original = random_model(LlamaForCausalLM, config)
    original.save_pretrained(tmp_path / "original")
    ids = torch.randint(0, config.vocab_size, (2, 7))
    want = original(ids).logits
    loaded = {}
    for which in order:
        loaded[which] = classes[which].from_pretrained(tmp_path / "original", dtype=torch.float32)
        mlp = loaded[which].model.layers[0].mlp
        assert hasattr(mlp, "gate_up_proj") == (which == "checked_in")
        assert max_diff(want, loaded[which](ids).logits) <= TOLERANCE, which
    # The model built first saves after the other module's model was built: still its own merges, reversed.
    first = order[0]
    loaded[first].save_pretrained(tmp_path / "saved")
    again = LlamaForCausalLM.from_pretrained(tmp_path / "saved", dtype=torch.float32)
    assert max_diff(want, again(ids).logits) == 0.0


@pytest.fixture
def llama_type_conversion():
    """A conversion for the "llama" model type (restored with the registry), standing in for a type whose sub-model
    gets other conversions where it sits (Aria's text model gets "aria_text"'s): with it, `FusedLlamaModel` as its own
    root gets it, and under `FusedLlamaForCausalLM` (which gets it at the root) gets nothing."""
    renaming = WeightRenaming(source_patterns="fusegen_test_legacy_name", target_patterns="fusegen_test_name")
    register_checkpoint_conversion_mapping("llama", [renaming], overwrite=True)


def test_tensor_parallel_merge_op_is_part_of_what_the_model_registers(llama_type_conversion):
    config = small_config(LlamaConfig, num_key_value_heads=1)  # one kv head on two processes: read whole
    FusedLlamaForCausalLM(config)  # a tree that registered other conversions for FusedLlamaModel
    tp_config = small_config(LlamaConfig, num_key_value_heads=1)
    tp_config.distributed_config = DistributedConfig(tp_size=2)
    tp_model = FusedLlamaForCausalLM(tp_config)
    # What from_pretrained looks up right after building: every merge keeps this process's rows.
    ops = _merge_ops(tp_model)
    assert len(ops) == 2 and all(type(op).__name__ == "PartitionedConcatenate" for op in ops), ops
    # A single-process model built next neither inherits it nor, when the TP model registers again (as it does before
    # saving), takes it away.
    single = FusedLlamaModel(config)
    assert [type(op) for op in _merge_ops(single)] == [MergedColumnConcatenate] * 2
    register_for_tree(tp_model)
    assert all(type(op).__name__ == "PartitionedConcatenate" for op in _merge_ops(tp_model))


class _Pair(PreTrainedModel):
    """Two fused base models in one tree (a stand-in for a composite model)."""

    _supports_sdpa = True

    def __init__(self, first, second):
        config = _as(_PairConfig)
        super().__init__(config)
        self.first, self.second = first, second
        self.post_init()


class _OtherTypeConfig(LlamaConfig):
    model_type = "fusegen_test_llama_like"


class _PairConfig(LlamaConfig):
    model_type = "fusegen_test_pair"  # no conversions: Transformers' walk skips the pair (custom code)


def _as(config_class):
    """The small llama config as `config_class` (a `LlamaConfig` subclass of another model type)."""
    values = {key: value for key, value in small_config(LlamaConfig).to_diff_dict().items() if key != "model_type"}
    config = config_class(**values)
    assert config.model_type == config_class.model_type
    return config


def test_one_class_at_two_places_with_different_conversions_is_refused(llama_type_conversion):
    config = small_config(LlamaConfig)
    # At `first` the original LlamaModel gets "llama"'s conversion (by model type); at `second`, under a config of
    # another model type, nothing: one registration under the class name cannot serve both places.
    other_type = _as(_OtherTypeConfig)
    pair = _Pair(FusedLlamaModel(config), FusedLlamaModel(other_type))
    with pytest.raises(ValueError, match=r"FusedLlamaModel at 'first' and at 'second'.*different checkpoint conv"):
        register_for_tree(pair)


def test_one_class_at_two_places_with_the_same_conversions_is_accepted():
    config = small_config(LlamaConfig)
    pair = _Pair(FusedLlamaModel(config), FusedLlamaModel(config))
    register_for_tree(pair)
    assert len(_merge_ops(pair)) == 4  # each place gets its scoped copy of the two merges


def test_two_classes_of_one_name_in_one_tree_are_refused(other):
    config = small_config(LlamaConfig)
    pair = _Pair(FusedLlamaModel(config), other.FusedLlamaModel(config))
    with pytest.raises(ValueError, match=r"two different classes \(from generated\.fused_llama and " + OTHER):
        register_for_tree(pair)


@pytest.mark.parametrize(
    "head, parent, composed",
    [
        ("attn", "attn", True),
        ("attn", "vision.attn", True),
        ("attn", "self_attn", True),  # Transformers searches `attn\.in_proj_weight` in `...self_attn.in_proj_weight`
        ("self_attn", "attn", False),
        ("attn", "attention", False),
        ("attn", "attn.inner", False),
    ],
)
def test_an_original_converter_is_composed_with_the_merge_its_pieces_reach(head, parent, composed):
    # The original chunks `{head}.in_proj_weight` into `{head}.{q,k,v}_proj.weight`. Transformers applies that pattern
    # wherever its text occurs in a key, so its pieces are the merge's exactly when `{parent}.` ends with `{head}.`
    # as text (Step3p7: `attn` converts the keys of `self_attn`, whose merge must then take the pieces).
    chunk = WeightConverter(
        source_patterns=f"{head}.in_proj_weight",
        target_patterns=[f"{head}.q_proj.weight", f"{head}.k_proj.weight", f"{head}.v_proj.weight"],
        operations=[Chunk(dim=0)],
    )
    register_checkpoint_conversion_mapping("SegmentProbeModel", [chunk], overwrite=True)
    stacked = {"qkv_proj": [("q_proj", "q"), ("k_proj", "k"), ("v_proj", "v")]}
    register_stacked_checkpoint(["FusedSegmentProbeModel"], stacked, parents={"qkv_proj": [parent]})
    registered = get_checkpoint_conversion_mapping("FusedSegmentProbeModel")
    kinds = [type(op).__name__ for conversion in registered for op in conversion.operations]
    assert ("ThenMerge" in kinds) == composed, kinds
    assert ("Chunk" in kinds) == (not composed), kinds
