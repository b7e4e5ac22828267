"""Tensor parallelism of the checked-in multimodal and encoder files (issue 25 item 7), 2 ranks, gloo, CPU.

Transformers shards what the original's configs plan: Qwen2.5-VL's and Gemma 3's TEXT configs carry a
`base_model_tp_plan`, their composite and vision configs none, so the text model is split and the vision tower stays
whole on every rank (Qwen's ViT, Siglip); BERT's config has no plan, so Transformers refuses TP for `BertModel`. The
fused classes must do exactly that: the text model's merged linears split by heads, the tower's left whole, no rule
the original lacks, and the original's numbers on text + image inputs, logits and greedy tokens.

One launch (`tests/multirank.py`: spawned workers, a free port, gloo timeouts) runs every case; `-rP` prints the figures.
"""

from __future__ import annotations

import importlib
import json
import re

import pytest
import torch

from fusegen.compiler.modal_inputs import forward_inputs, image_features
from fusegen.compiler.resolve import resolve
from fusegen.testkit import logits_tolerance, max_diff, random_input, save_random, tiny_config
from tests.multirank import launch, rank_group

pytestmark = pytest.mark.slow  # a 2-process launch loading three models per case

TYPES = ("qwen2_5_vl", "gemma3", "bert")
TOWERS = {"qwen2_5_vl": "model.visual.", "gemma3": "model.vision_tower.", "bert": None}
GREEDY = {"max_new_tokens": 6, "min_new_tokens": 6, "do_sample": False}


def classes(model_type):
    target = resolve(model_type)
    module = importlib.import_module(f"generated.fused_{model_type}")
    return target.causal_lm, getattr(module, "Fused" + target.causal_lm.__name__)


def flat(features) -> torch.Tensor:
    features = [features] if isinstance(features, torch.Tensor) else list(features)
    return torch.cat([tensor.reshape(-1) for tensor in features])


# --------------------------------------------------------------------------------------------------------------------
# Worker side
# --------------------------------------------------------------------------------------------------------------------


def refusal(model_class, path) -> str | None:
    try:
        model_class.from_pretrained(path, tp_plan="auto")
    except ValueError as error:
        return str(error)
    return None


def sharded(model) -> list[str]:
    from torch.distributed.tensor import DTensor

    return sorted(name for name, parameter in model.named_parameters() if isinstance(parameter, DTensor))


def run_case(model_type, path) -> dict:
    original_class, fused_class = classes(model_type)
    if TOWERS[model_type] is None:  # no plan in the original: both refuse
        return {"original_error": refusal(original_class, path), "fused_error": refusal(fused_class, path)}
    single = original_class.from_pretrained(path).eval()
    original_tp = original_class.from_pretrained(path, tp_plan="auto").eval()
    fused_tp = fused_class.from_pretrained(path, tp_plan="auto").eval()
    inputs = forward_inputs(single, single.config, random_input(single.config))
    with torch.no_grad():
        expected, original, fused = (model(**inputs).logits for model in (single, original_tp, fused_tp))
        features = [flat(image_features(model, inputs)) for model in (single, fused_tp)]
    tokens = single.generate(**inputs, **GREEDY)
    attention = next(
        module for name, module in fused_tp.named_modules() if name.endswith("language_model.layers.0.self_attn")
    )
    return {
        "tolerance": logits_tolerance(expected),
        "fused_vs_single": max_diff(expected, fused),
        "original_tp_vs_single": max_diff(expected, original),
        "features_vs_single": max_diff(features[0], features[1]),
        "features_tolerance": logits_tolerance(features[0]),
        "image_tokens": int((inputs["input_ids"] == single.config.image_token_id).sum()),
        "greedy_fused_tp": torch.equal(fused_tp.generate(**inputs, **GREEDY), tokens),
        "greedy_fused_tp_static": torch.equal(
            fused_tp.generate(**inputs, cache_implementation="static", **GREEDY), tokens
        ),
        "greedy_original_tp": torch.equal(original_tp.generate(**inputs, **GREEDY), tokens),
        "fused_plan": sorted(fused_tp.tp_plan),
        "original_plan": sorted(original_tp.tp_plan),
        "fused_sharded": sharded(fused_tp),
        "original_sharded": sharded(original_tp),
        "local_qkv_sizes": list(attention.qkv_proj.output_sizes),
    }


def worker(rank, world_size, port, cases, out_dir):
    with rank_group(rank, world_size, port, out_dir) as results:
        for model_type, path in cases.items():
            try:
                results[model_type] = run_case(model_type, path)
            except Exception as error:  # noqa: BLE001 (recorded per case: one failure must not hide the others)
                results[model_type] = {"failed": f"{type(error).__name__}: {error}"}


# --------------------------------------------------------------------------------------------------------------------
# Launcher side
# --------------------------------------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def launched(tmp_path_factory):
    root = tmp_path_factory.mktemp("mmtp")
    cases = {}
    for model_type in TYPES:
        original_class, _ = classes(model_type)
        save_random(original_class, tiny_config(resolve(model_type)), root / model_type)
        cases[model_type] = str(root / model_type)
    return launch(worker, 2, (cases, str(root)), root)


def results(launched, model_type):
    per_rank = [ranks[model_type] for ranks in launched]
    failed = [f"rank {rank}: {result['failed']}" for rank, result in enumerate(per_rank) if "failed" in result]
    assert not failed, "; ".join(failed)
    return per_rank


@pytest.mark.parametrize("model_type", ["qwen2_5_vl", "gemma3"])
def test_fused_multimodal_tp_gives_the_originals_outputs_on_images(launched, model_type):
    for rank, result in enumerate(results(launched, model_type)):
        print(f"N=2 {model_type} rank {rank}: {json.dumps({k: v for k, v in result.items() if 'plan' not in k})}")
        assert result["image_tokens"] > 0
        assert result["fused_vs_single"] <= result["tolerance"], result
        assert result["original_tp_vs_single"] <= result["tolerance"], result  # Transformers' own TP, for reference
        assert result["features_vs_single"] <= result["features_tolerance"], result
        assert result["greedy_fused_tp"] and result["greedy_fused_tp_static"] and result["greedy_original_tp"], result


@pytest.mark.parametrize("model_type", ["qwen2_5_vl", "gemma3"])
def test_fused_multimodal_tp_shards_the_text_model_and_leaves_the_tower_whole(launched, model_type):
    """The original's plan comes from its text config alone; the fused plan is the same with each merged linear's
    rule in place of its pieces', so the tower (which Transformers does not shard) has no rule and no DTensor."""
    text = tiny_config(resolve(model_type)).get_text_config()
    head_dim = getattr(text, "head_dim", None) or text.hidden_size // text.num_attention_heads
    tower = TOWERS[model_type]
    merged = {"q_proj": "qkv_proj", "k_proj": "qkv_proj", "v_proj": "qkv_proj", "gate_proj": "gate_up_proj"}
    merged["up_proj"] = "gate_up_proj"
    for result in results(launched, model_type):
        fused_plan, original_plan = set(result["fused_plan"]), set(result["original_plan"])
        renamed = {re.sub(r"[a-z_]+$", lambda leaf: merged.get(leaf[0], leaf[0]), key) for key in original_plan}
        owners = {key.removesuffix(".q_proj") for key in original_plan if key.endswith(".q_proj")}
        assert fused_plan == renamed | owners  # + the local-heads rule on each attention
        assert not any(key.startswith(tower) for key in fused_plan | original_plan)
        assert result["fused_sharded"] and not any(name.startswith(tower) for name in result["fused_sharded"])
        assert any(name.endswith("self_attn.qkv_proj.weight") for name in result["fused_sharded"])
        assert any(name.endswith("mlp.gate_up_proj.weight") for name in result["fused_sharded"])
        assert not any(name.startswith(tower) for name in result["original_sharded"])
        assert result["local_qkv_sizes"] == [
            text.num_attention_heads // 2 * head_dim,
            text.num_key_value_heads // 2 * head_dim,
            text.num_key_value_heads // 2 * head_dim,
        ]


def test_bert_has_no_plan_and_refuses_tp_as_the_original_does(launched):
    for result in results(launched, "bert"):
        print(f"N=2 bert: {result}")
        assert result["original_error"] and "tp_plan" in result["original_error"], result
        assert result["fused_error"] and "tp_plan" in result["fused_error"], result
