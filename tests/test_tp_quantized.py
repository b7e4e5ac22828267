"""Tensor parallelism of fused models loaded under an on-the-fly `quantization_config` (fusegen/runtime/tp/piecewise.py).

Under a `quantization_config` the merged linears are built as the original's pieces (`PiecewiseLinear`), and the
plan shards each piece with the config's own `colwise` rule, as Transformers shards the original's projections. The
multi-process cases (N=2, gloo, `tests/multirank.py`) generate greedily as Transformers' `test_tp_generation_quantized`
does (`output_scores`) with three models on the same checkpoint and config: the fused class under tensor parallelism,
the ORIGINAL class under tensor parallelism (Transformers' own plan), and both classes in one process, all four
quantized by the same config. The fused and the original tensor-parallel runs must give the same tokens and scores
within rounding (each rank's pieces are the original's modules with the original's quantized shards), and so must the
two single-process runs. Tensor parallel against one process is NOT exact, for the original either: the row-parallel
o_proj/down_proj are quantized per row of each rank's columns, so their scales differ from the whole rows' (the
25% of tokens Transformers' own test allows to differ); the fused run must move away from its single-process run
exactly as far as the original does from its own. Measured differences are printed with `-rP`.

The plan itself is checked in one process (no launch): which rules a model built as pieces gets, and the refusals.
"""

from __future__ import annotations

import json
import traceback

import pytest
import torch

from fusegen.runtime.quantized import PiecewiseLinear, building_split
from fusegen.runtime.tp.piecewise import PIECEWISE_COLWISE, PIECEWISE_LOCAL_HEADS, piecewise_tp_plan
from fusegen.testkit import TOLERANCE, model_classes, original_classes, random_model, small_config
from tests.multirank import launch, rank_group

TOKENS = {"bos_token_id": 0, "eos_token_id": 0, "pad_token_id": 0}  # the defaults lie outside the tiny vocabulary
QUANT = {
    "float8": "Float8WeightOnlyConfig",  # Transformers' test_tp_generation_quantized
    "int8": "Int8WeightOnlyConfig",
    "int8-dynamic": "Int8DynamicActivationInt8WeightConfig",
}
CASES = {  # name -> (model type, config overrides, torchao config)
    "qwen2-gqa-float8": ("qwen2", {"num_key_value_heads": 2}, "float8"),  # q/k/v biases
    "llama-gqa-int8": ("llama", {"num_key_value_heads": 2}, "int8"),
    # gate/up of 37 rows: Transformers' colwise gives rank 0 19 rows and rank 1 18, and so does each piece here
    "qwen2-mha-int8-dynamic-mlp-37": ("qwen2", {"num_key_value_heads": 4, "intermediate_size": 37}, "int8-dynamic"),
    "llama-mqa-float8-refused": ("llama", {"num_key_value_heads": 1}, "float8"),
}
REFUSED = {"llama-mqa-float8-refused": "num_key_value_heads=1 is not divisible by N"}


# --------------------------------------------------------------------------------------------------------------------
# Worker side
# --------------------------------------------------------------------------------------------------------------------


def _quantization_config(name):
    import torchao.quantization as torchao_quantization
    from transformers import TorchAoConfig

    return TorchAoConfig(getattr(torchao_quantization, QUANT[name])())


def _generate(model, input_ids):
    output = model.generate(
        input_ids, max_new_tokens=12, min_new_tokens=12, do_sample=False, num_beams=1, output_scores=True,
        return_dict_in_generate=True, use_cache=True,
    )  # fmt: skip
    return output.sequences, torch.stack(output.scores)


def _score_difference(scores, reference):
    """Largest difference of the finite scores; inf if the two differ in which scores are -inf (`min_new_tokens`
    masks the end-of-sequence token) or in shape."""
    finite = scores.isfinite()
    if scores.shape != reference.shape or not torch.equal(finite, reference.isfinite()):
        return float("inf")
    return (scores[finite] - reference[finite]).abs().max().item()


def _match_ratio(tokens, reference):
    """Share of equal tokens, as Transformers' `test_tp_generation_quantized` counts them."""
    return (tokens[0] == reference[0]).sum().item() / max(tokens.shape[1], reference.shape[1])


def _case(model_type, path, quant, world_size):
    from transformers import DistributedConfig

    _, original_class, fused_class = model_classes(model_type)
    distributed = {"distributed_config": DistributedConfig(tp_size=world_size)}
    try:
        tp = fused_class.from_pretrained(path, quantization_config=_quantization_config(quant), **distributed).eval()
    except ValueError as error:
        return {"refused": str(error)}
    original = original_class.from_pretrained(path, quantization_config=_quantization_config(quant), **distributed)
    single = fused_class.from_pretrained(path, quantization_config=_quantization_config(quant)).eval()
    original_single = original_class.from_pretrained(path, quantization_config=_quantization_config(quant)).eval()
    input_ids = torch.randint(0, 128, (1, 10), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        tokens, scores = _generate(tp, input_ids)
        original_tokens, original_scores = _generate(original.eval(), input_ids)
        single_tokens, single_scores = _generate(single, input_ids)
        original_single_tokens, original_single_scores = _generate(original_single, input_ids)
    attention, mlp = tp.model.layers[0].self_attn, tp.model.layers[0].mlp
    return {
        "tokens": tokens.tolist(),
        "tokens_original": original_tokens.tolist(),
        "tokens_single": single_tokens.tolist(),
        "tokens_original_single": original_single_tokens.tolist(),
        "scores_vs_original": _score_difference(scores, original_scores),
        "single_vs_original_single": _score_difference(single_scores, original_single_scores),
        "scores_vs_single": _score_difference(scores, single_scores),
        "original_vs_original_single": _score_difference(original_scores, original_single_scores),
        "match_single": _match_ratio(tokens, single_tokens),
        "scores_max": scores[scores.isfinite()].abs().max().item(),
        "qkv_type": type(attention.qkv_proj).__name__,
        "qkv_sizes": list(attention.qkv_proj_sizes),
        "gate_up_sizes": list(mlp.gate_up_proj_sizes),
        "q_rows": int(attention.q_proj.weight.shape[0]),
        "gate_rows": int(mlp.gate_proj.weight.shape[0]),
        "q_weight": type(attention.q_proj.weight.data).__name__,
        "single_composed": type(single.model.layers[0].self_attn.qkv_proj).__name__,
    }


def _worker(rank, world_size, port, cases, out_dir):
    with rank_group(rank, world_size, port, out_dir) as results:
        for name, (model_type, path, quant) in cases.items():
            try:
                results[name] = _case(model_type, path, quant, world_size)
            except Exception as error:  # noqa: BLE001 (recorded per case: one failure must not hide the others)
                results[name] = {"failed": f"{type(error).__name__}: {error}", "where": traceback.format_exc()[-3000:]}


# --------------------------------------------------------------------------------------------------------------------
# Launcher side
# --------------------------------------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def launched(tmp_path_factory):
    pytest.importorskip("torchao")
    root = tmp_path_factory.mktemp("tpquant")
    cases = {}
    for name, (model_type, overrides, quant) in CASES.items():
        config_class, original_class = original_classes(model_type)
        path = root / name
        random_model(original_class, small_config(config_class, **overrides, **TOKENS)).save_pretrained(path)
        cases[name] = (model_type, str(path), quant)
    return launch(_worker, 2, (cases, str(root)), root)


def _per_rank(launched, name):
    per_rank = [ranks[name] for ranks in launched]
    for rank, result in enumerate(per_rank):
        print(f"N=2 {name} rank {rank}: {json.dumps({k: v for k, v in result.items() if k != 'where'})}")
        if "failed" in result:
            print(result["where"])
    failed = [f"rank {rank}: {result['failed']}" for rank, result in enumerate(per_rank) if "failed" in result]
    assert not failed, "; ".join(failed)
    return per_rank


@pytest.mark.slow
@pytest.mark.parametrize("name", [name for name in CASES if name not in REFUSED])
def test_fused_tp_quantized_generation_equals_the_originals(launched, name):
    _, overrides, _ = CASES[name]
    heads, kv_heads, head_dim = 4, overrides["num_key_value_heads"], 16
    intermediate = overrides.get("intermediate_size", 96)
    for rank, result in enumerate(_per_rank(launched, name)):
        assert "refused" not in result, result  # a case that must load, refused at the fused load
        tolerance = TOLERANCE * max(1.0, result["scores_max"])
        # tensor parallel, fused and original: the original's pieces, shards and quantized kernels, concatenated
        assert result["tokens"] == result["tokens_original"], result
        assert result["scores_vs_original"] <= tolerance, result
        # one process, fused and original
        assert result["tokens_single"] == result["tokens_original_single"], result
        assert result["single_vs_original_single"] <= tolerance, result
        # tensor parallel against one process: o_proj/down_proj are quantized per row of each rank's COLUMNS
        # (rowwise), so their scales differ from the whole rows'; the fused model moves exactly as the original does
        assert abs(result["scores_vs_single"] - result["original_vs_original_single"]) <= 2 * tolerance, result
        assert result["match_single"] >= 0.75, result  # Transformers' own threshold for this comparison
        assert result["qkv_type"] == "PiecewiseLinear" and result["q_weight"] != "Tensor", result  # quantized pieces
        local_mlp = (intermediate + 1) // 2 if rank == 0 else intermediate // 2  # DTensor's ceil-first split
        assert result["qkv_sizes"] == [heads * head_dim // 2, kv_heads * head_dim // 2, kv_heads * head_dim // 2]
        assert result["gate_up_sizes"] == [local_mlp, local_mlp], result
        assert result["q_rows"] == heads * head_dim // 2 and result["gate_rows"] == local_mlp, result


@pytest.mark.slow
@pytest.mark.parametrize("name", sorted(REFUSED))
def test_kv_heads_a_colwise_piece_would_cut_are_refused(launched, name):
    for result in _per_rank(launched, name):
        assert REFUSED[name] in result.get("refused", ""), result
        assert "(layers.0.self_attn)" in result["refused"], result


# --------------------------------------------------------------------------------------------------------------------
# The plan, in one process
# --------------------------------------------------------------------------------------------------------------------


def _built_split(model_type, **overrides):
    config_class, _, fused_class = model_classes(model_type)
    with building_split():
        return fused_class(small_config(config_class, num_key_value_heads=2, **overrides, **TOKENS))


def test_a_model_built_as_pieces_gets_the_configs_rules_for_its_pieces():
    model = _built_split("qwen2")
    assert isinstance(model.model.layers[0].self_attn.qkv_proj, PiecewiseLinear)
    plan = model.tp_plan
    for piece in ("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj", "mlp.gate_proj", "mlp.up_proj"):
        assert plan[f"model.layers.*.{piece}"] == "colwise", plan
    assert plan["model.layers.*.self_attn.qkv_proj"] == PIECEWISE_COLWISE
    assert plan["model.layers.*.mlp.gate_up_proj"] == PIECEWISE_COLWISE
    assert plan["model.layers.*.self_attn"] == PIECEWISE_LOCAL_HEADS
    assert plan["model.layers.*.self_attn.o_proj"] == "rowwise"
    assert plan["model.layers.*.mlp.down_proj"] == "rowwise"


def test_a_merged_model_keeps_the_merged_rules():
    config_class, _, fused_class = model_classes("qwen2")
    plan = fused_class(small_config(config_class, num_key_value_heads=2, **TOKENS)).tp_plan
    assert plan["model.layers.*.self_attn.qkv_proj"] == "fusegen_merged_colwise"
    assert "model.layers.*.self_attn.q_proj" not in plan


def test_a_piece_whose_config_rule_is_not_colwise_is_refused_by_name():
    model = _built_split("llama")
    from generated.fused_llama import TP_PLAN

    model.model.config.base_model_tp_plan = {
        **model.model.config.base_model_tp_plan,
        "layers.*.mlp.up_proj": "colwise_gather_output",
    }
    with pytest.raises(ValueError, match=r"\(layers\.0\.mlp\.gate_up_proj\).*piece 'up_proj' the rule "
                                         r"'colwise_gather_output'"):  # fmt: skip
        piecewise_tp_plan(model.model, TP_PLAN)
    relaxed = piecewise_tp_plan(model.model, TP_PLAN, strict=False)  # what a model records when it is built
    assert relaxed["layers.*.mlp.gate_up_proj"] == "fusegen_merged_colwise"
    assert relaxed["layers.*.self_attn.qkv_proj"] == PIECEWISE_COLWISE
