"""Pre-quantized checkpoints made for the ORIGINAL class load into the fused class with the original's numbers.

Formats: fine-grained FP8 (block-wise `weight_scale_inv`), compressed-tensors (int8/int4 packed, FP8 per channel and
per tensor), GGUF (F32, F16, Q8_0, Q4_K). The files come from the formats' own tools (tests/quantized_files.py), from
tiny random Llama (GQA) and Qwen2 (q/k/v biases) models. Each test loads the one file into both classes and compares:

- the weights each merged linear computes with, bitwise, against the original's pieces (after a forward, so a
  compressed-tensors module has decompressed: that is the weight its matmul uses);
- logits within `TOLERANCE` (1e-5, the compiler's own rule for fused vs original in fp32): the weights are equal, so
  what may differ is only float rounding between one GEMM over the stacked rows and one GEMM per piece (measured: 0);
- greedy tokens, equal;
- that the checkpoint was quantized at all (the original's logits are away from the float model's).

Measured differences print with `pytest tests/test_prequantized.py -rP`.
"""

from __future__ import annotations

import json
import warnings

import pytest
import torch
from safetensors import safe_open

from fusegen.runtime.quantized import PiecewiseLinear
from fusegen.testkit import TOLERANCE, model_classes, random_model, small_config
from tests.quantized_files import write_compressed_tensors, write_fp8, write_gguf

SITES = {"self_attn": ("qkv_proj", ("q_proj", "k_proj", "v_proj")), "mlp": ("gate_up_proj", ("gate_proj", "up_proj"))}


@pytest.fixture(autouse=True)
def _quiet():
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        yield


def _ids():
    return torch.randint(0, 128, (2, 12), generator=torch.Generator().manual_seed(1))


def _float_model(model_type: str, **overrides):
    config_class, original_class, _ = model_classes(model_type)
    overrides = {"num_key_value_heads": 2, "tie_word_embeddings": False, **overrides}
    config = small_config(config_class, **overrides)
    return random_model(original_class, config)


def _site_weight(owner, merged: str, pieces: tuple[str, ...]) -> tuple[torch.Tensor, torch.Tensor | None]:
    """The weight (and bias) one merged site of the fused model computes with, as the stacked rows."""
    module = getattr(owner, merged)
    if isinstance(module, PiecewiseLinear):
        parts = module.pieces()
        biases = [p.bias for p in parts]
        bias = torch.cat(biases) if all(b is not None for b in biases) else None
        return torch.cat([p.weight for p in parts]), bias
    return module.weight, module.bias


def _check_same_weights(original, fused) -> dict[str, str]:
    """Bitwise equality of every merged site's weights with the original's pieces; returns {site: how it is held}."""
    held = {}
    for index, (layer, fused_layer) in enumerate(zip(original.model.layers, fused.model.layers)):
        for owner, (merged, pieces) in SITES.items():
            weight, bias = _site_weight(getattr(fused_layer, owner), merged, pieces)
            expected = torch.cat([getattr(getattr(layer, owner), piece).weight for piece in pieces])
            assert weight.dtype == expected.dtype and torch.equal(weight, expected), f"layer {index} {merged}"
            original_biases = [getattr(getattr(layer, owner), piece).bias for piece in pieces]
            if original_biases[0] is not None:
                assert torch.equal(bias, torch.cat(original_biases)), f"layer {index} {merged} bias"
            module = getattr(getattr(fused_layer, owner), merged)
            held[f"{index}.{merged}"] = (
                f"split ({module.reason})" if isinstance(module, PiecewiseLinear) else type(module).__name__
            )
    return held


def _compare(original, fused, float_model, label: str, lossless: bool = False) -> dict[str, str]:
    original, fused = original.eval(), fused.eval()
    ids = _ids()
    with torch.no_grad():
        expected, actual, unquantized = original(ids).logits, fused(ids).logits, float_model(ids).logits
    held = _check_same_weights(original, fused)
    difference = (expected - actual).abs().max().item()
    print(f"{label}: max |logits fused - original| = {difference:.3g}; quantization moved the logits by "
          f"{(expected - unquantized).abs().max().item():.3g}; sites: {sorted(set(held.values()))}")  # fmt: skip
    assert difference <= TOLERANCE
    if lossless:  # F32 GGUF: the original must then be the float model itself
        assert torch.equal(expected, unquantized)
    else:
        assert (expected - unquantized).abs().max().item() > 1e-3, "the checkpoint was not quantized"
    generate = {"max_new_tokens": 6, "do_sample": False, "pad_token_id": 0}
    assert torch.equal(original.generate(ids, **generate), fused.generate(ids, **generate))
    return held


# --- FP8 fine-grained ------------------------------------------------------------------------------------------------
# Hidden 64, 4 heads, 2 kv heads: q has 64 rows, k and v 32. Blocks of (16, 32) tile every projection; blocks of
# (64, 64) tile q and o but not k, v, gate or up, which Transformers' quantize op leaves in float: pieces of one merged
# linear then differ in scheme (q in e4m3 with scales, k and v float).

FP8_BLOCKS = {"16x32": (16, 32), "64x64-mixed": (64, 64)}


def _fp8_checkpoint(tmp_path, model_type, block):
    float_model = _float_model(model_type, intermediate_size=128)
    return write_fp8(float_model, tmp_path / "fp8", FP8_BLOCKS[block]), float_model


@pytest.mark.parametrize(
    ("model_type", "block"),
    [
        pytest.param(model_type, block, marks=pytest.mark.slow)
        for model_type in ("llama", "qwen2")
        for block in FP8_BLOCKS
    ],
)
def test_fp8_fine_grained_loads_as_the_original(tmp_path, model_type, block):
    """On CPU Transformers dequantizes each piece with its own block scales at load (`Fp8Dequantize`); the fused
    model is built split, so each piece is dequantized exactly so, then the float pieces are stacked."""
    path, float_model = _fp8_checkpoint(tmp_path, model_type, block)
    with safe_open(path / "model.safetensors", "pt") as handle:
        assert handle.get_slice("model.layers.0.self_attn.q_proj.weight").get_dtype() == "F8_E4M3"
    _, original_class, fused_class = model_classes(model_type)
    original, fused = original_class.from_pretrained(path), fused_class.from_pretrained(path)
    held = _compare(original, fused, float_model, f"{model_type} fp8 {block}")
    assert set(held.values()) == {"MergedColumnLinear"}


def test_fp8_fine_grained_saves_what_the_original_saves(tmp_path):
    """After the CPU dequantize load the original saves a float checkpoint without `quantization_config`: the fused
    model writes the same tensors, bitwise, and the same quantization entry (none)."""
    path, _ = _fp8_checkpoint(tmp_path, "qwen2", "16x32")
    _, original_class, fused_class = model_classes("qwen2")
    original_class.from_pretrained(path).save_pretrained(tmp_path / "original")
    fused_class.from_pretrained(path).save_pretrained(tmp_path / "fused")
    _assert_same_files(tmp_path / "original", tmp_path / "fused")


def _assert_same_files(expected_dir, actual_dir):
    with (
        safe_open(expected_dir / "model.safetensors", "pt") as expected,
        safe_open(actual_dir / "model.safetensors", "pt") as actual,
    ):
        names = sorted(expected.keys())  # a safe_open handle is not iterable
        assert sorted(actual.keys()) == names
        for key in names:
            assert torch.equal(actual.get_tensor(key), expected.get_tensor(key)), key
    quantization = [
        json.loads((d / "config.json").read_text()).get("quantization_config") for d in (expected_dir, actual_dir)
    ]
    assert quantization[0] == quantization[1]


def test_fp8_quantized_path_composes_aligned_blocks_only():
    """Transformers' quantized FP8 path (`FP8Linear`, Triton/DeepGEMM kernels) runs on GPU/XPU only, so this checks
    the composer on the state it would load: stacked e4m3 rows and block scales dequantize to the pieces' weights
    bitwise; blocks straddling two pieces and per-tensor scales that differ keep the site split."""
    from transformers.integrations.finegrained_fp8 import FP8Linear, _dequantize_fp8_weight

    from fusegen.runtime.format_composers import _compose_fp8, _split_fp8

    def piece(rows, block, scale=None):
        module = FP8Linear(64, rows, block_size=block)
        module.weight.data = (torch.randn(rows, 64) * 4).to(torch.float8_e4m3fn)
        if block is None:
            module.weight_scale_inv.data = torch.tensor(scale)
        else:
            module.weight_scale_inv.data = torch.rand_like(module.weight_scale_inv) + 0.5
        return module

    torch.manual_seed(0)
    pieces, sizes = [piece(64, (16, 32)), piece(32, (16, 32)), piece(32, (16, 32))], [64, 32, 32]
    merged = _compose_fp8(pieces, sizes)
    assert isinstance(merged, FP8Linear)
    stacked = _dequantize_fp8_weight(merged.weight, merged.weight_scale_inv, merged.block_size, torch.float32)
    each = [_dequantize_fp8_weight(p.weight, p.weight_scale_inv, p.block_size, torch.float32) for p in pieces]
    assert torch.equal(stacked, torch.cat(each))
    for leaf in ("weight", "weight_scale_inv"):
        parts = _split_fp8(merged, leaf, getattr(merged, leaf), sizes)
        assert all(torch.equal(part, getattr(p, leaf)) for part, p in zip(parts, pieces))
    straddling = [piece(64, (48, 32)), piece(32, (48, 32)), piece(32, (48, 32))]
    assert "whole blocks of 48 rows" in _compose_fp8(straddling, sizes)
    per_tensor = [piece(64, None, 0.5), piece(32, None, 0.25), piece(32, None, 0.5)]
    assert "per-tensor weight scales differ" in _compose_fp8(per_tensor, sizes)
    same_scale = [piece(64, None, 0.5), piece(32, None, 0.5), piece(32, None, 0.5)]
    assert isinstance(_compose_fp8(same_scale, sizes), FP8Linear)


# --- compressed-tensors ---------------------------------------------------------------------------------------------
# Hidden 128 and intermediate 256, so every linear's inputs fill groups of 128.

CT_EXPECTED = {
    "w8a16-channel": "composed",
    "w4a16-group128": "composed",
    "w4a16-channel": "composed",
    "fp8-channel": "composed",
    "fp8-tensor": "weight_scale is one value per module and differs",
    "fp8-block32": "composed",
    "fp8-block48": "do not hold whole blocks of 48 rows",
}


def _ct_checkpoint(tmp_path, model_type, scheme):
    float_model = _float_model(model_type, hidden_size=128, intermediate_size=256)
    reference = random_model(type(float_model), float_model.config)  # the writer quantizes its model in place
    return write_compressed_tensors(float_model, tmp_path / scheme, scheme), reference


@pytest.mark.parametrize(
    ("model_type", "scheme"),
    [("qwen2", "w4a16-group128")]
    + [
        pytest.param(model_type, scheme, marks=pytest.mark.slow)
        for model_type in ("llama", "qwen2")
        for scheme in CT_EXPECTED
        if (model_type, scheme) != ("qwen2", "w4a16-group128")
    ],
)
def test_compressed_tensors_loads_as_the_original(tmp_path, model_type, scheme):
    """Each piece loads as the original's compressed module; pieces whose scales are per row or per group in a row
    are stacked into one compressed-tensors linear, per-tensor FP8 scales that differ keep the site split."""
    path, float_model = _ct_checkpoint(tmp_path, model_type, scheme)
    _, original_class, fused_class = model_classes(model_type)
    original, fused = original_class.from_pretrained(path), fused_class.from_pretrained(path)
    qkv = fused.model.layers[0].self_attn.qkv_proj
    if CT_EXPECTED[scheme] == "composed":
        assert getattr(qkv, "fusegen_composer", None) == "compressed-tensors", qkv
        assert "compressed" in str(qkv.quantization_status).lower()  # still packed until the first forward
    else:
        assert isinstance(qkv, PiecewiseLinear) and CT_EXPECTED[scheme] in qkv.reason, qkv
    held = _compare(original, fused, float_model, f"{model_type} compressed-tensors {scheme}")
    if CT_EXPECTED[scheme] == "composed":
        assert set(held.values()) == {"Linear"}


@pytest.mark.slow
@pytest.mark.parametrize("model_type", ["llama", "qwen2"])
@pytest.mark.parametrize("scheme", ["w4a16-group128", "fp8-tensor"])
def test_compressed_tensors_dequantized_at_load(tmp_path, model_type, scheme):
    """`CompressedTensorsConfig(dequantize=True)`: Transformers dequantizes each piece at load into a plain float
    linear (its `CompressedTensorsDequantize` op); the float pieces stack into one merged linear, whatever the scales.
    """
    from transformers import CompressedTensorsConfig

    path, float_model = _ct_checkpoint(tmp_path, model_type, scheme)
    _, original_class, fused_class = model_classes(model_type)
    original = original_class.from_pretrained(path, quantization_config=CompressedTensorsConfig(dequantize=True))
    fused = fused_class.from_pretrained(path, quantization_config=CompressedTensorsConfig(dequantize=True))
    assert getattr(original.model.layers[0].self_attn.q_proj, "quantization_scheme", None) is None
    held = _compare(original, fused, float_model, f"{model_type} compressed-tensors {scheme} dequantized at load")
    assert set(held.values()) == {"MergedColumnLinear"}


@pytest.mark.slow
@pytest.mark.parametrize("scheme", ["w4a16-group128", "fp8-channel", "fp8-tensor"])
@pytest.mark.parametrize("forward", [False, True], ids=["compressed", "after-forward"])
def test_compressed_tensors_saves_what_the_original_saves(tmp_path, scheme, forward):
    """Composed sites (int4 packed, FP8 per row) and split ones (FP8 per tensor) write the original's files."""
    path, _ = _ct_checkpoint(tmp_path, "qwen2", scheme)
    _, original_class, fused_class = model_classes("qwen2")
    original, fused = original_class.from_pretrained(path), fused_class.from_pretrained(path)
    if forward:
        with torch.no_grad():
            original(_ids()), fused(_ids())
    original.save_pretrained(tmp_path / "original")
    fused.save_pretrained(tmp_path / "fused")
    _assert_same_files(tmp_path / "original", tmp_path / "fused")


# --- GGUF -----------------------------------------------------------------------------------------------------------
# Transformers' GGUF loader (the legacy one, for llama and qwen2) dequantizes every tensor to float and names it
# after the model's own state dict; the fused model is built split, so it has the original's names.

GGUF_TYPES = ("F32", "F16", "Q8_0", "Q4_K")


def _gguf_checkpoint(tmp_path, model_type, qtype):
    sizes = {"hidden_size": 256, "intermediate_size": 256} if qtype == "Q4_K" else {"intermediate_size": 128}
    float_model = _float_model(model_type, **sizes)
    return write_gguf(float_model, tmp_path / "model.gguf", qtype), float_model


@pytest.mark.parametrize(
    ("model_type", "qtype"),
    [("llama", "Q8_0")]
    + [
        pytest.param(model_type, qtype, marks=pytest.mark.slow)
        for model_type in ("llama", "qwen2")
        for qtype in GGUF_TYPES
        if (model_type, qtype) != ("llama", "Q8_0")
    ],
)
def test_gguf_loads_as_the_original(tmp_path, model_type, qtype):
    path, float_model = _gguf_checkpoint(tmp_path, model_type, qtype)
    _, original_class, fused_class = model_classes(model_type)
    original = original_class.from_pretrained(tmp_path, gguf_file=path.name)
    fused = fused_class.from_pretrained(tmp_path, gguf_file=path.name)
    held = _compare(original, fused, float_model, f"{model_type} gguf {qtype}", lossless=qtype == "F32")
    assert set(held.values()) == {"MergedColumnLinear"}


def test_gguf_save_is_refused_as_by_the_original(tmp_path):
    """Transformers refuses to save a GGUF-loaded model (its quantizer is not serializable); the fused class too."""
    path, _ = _gguf_checkpoint(tmp_path, "llama", "F16")
    _, original_class, fused_class = model_classes("llama")
    messages = []
    for model_class in (original_class, fused_class):
        with pytest.raises(ValueError, match="quantized with gguf and is not serializable") as raised:
            model_class.from_pretrained(tmp_path, gguf_file=path.name).save_pretrained(tmp_path / "out")
        messages.append(str(raised.value))
    assert messages[0] == messages[1]


def test_load_checkpoint_refuses_fp8_values_without_their_scale(tmp_path):
    """fusegen's own loader has no quantizer: with strict=False it would ignore `weight_scale_inv` as unexpected and
    copy the raw e4m3 values into float weights. It raises, naming the tensor, before copying anything."""
    from fusegen.runtime import CheckpointError, load_checkpoint

    path, _ = _fp8_checkpoint(tmp_path, "llama", "16x32")
    _, _, fused_class = model_classes("llama")
    config = fused_class.config_class.from_pretrained(path)
    del config.quantization_config
    model = fused_class(config)
    before = {name: tensor.clone() for name, tensor in model.state_dict().items()}
    with pytest.raises(CheckpointError, match="pre-quantized .FP8. tensor whose scale is stored in another tensor"):
        load_checkpoint(model, path, strict=False)
    assert all(torch.equal(tensor, before[name]) for name, tensor in model.state_dict().items())


@pytest.mark.slow
@pytest.mark.parametrize("model_type", ["llama", "qwen2"])
def test_one_kv_head_and_tied_embeddings(tmp_path, model_type):
    """Config variants: one kv head (k and v of a single head each) with tied embeddings, in each format."""
    _, original_class, fused_class = model_classes(model_type)
    variant = {"num_key_value_heads": 1, "tie_word_embeddings": True}
    fp8 = write_fp8(_float_model(model_type, intermediate_size=128, **variant), tmp_path / "fp8", (16, 32))
    ct_model = _float_model(model_type, hidden_size=128, intermediate_size=256, **variant)
    ct = write_compressed_tensors(ct_model, tmp_path / "ct", "w4a16-group128")
    for label, path, kwargs, float_model in [
        ("fp8", fp8, {}, _float_model(model_type, intermediate_size=128, **variant)),
        ("compressed-tensors", ct, {}, _float_model(model_type, hidden_size=128, intermediate_size=256, **variant)),
    ]:
        original = original_class.from_pretrained(path, **kwargs)
        fused = fused_class.from_pretrained(path, **kwargs)
        _compare(original, fused, float_model, f"{model_type} {label} one kv head, tied")
    gguf_model = _float_model(model_type, intermediate_size=128, num_key_value_heads=1)
    write_gguf(gguf_model, tmp_path / "model.gguf", "Q8_0")
    original = original_class.from_pretrained(tmp_path, gguf_file="model.gguf")
    fused = fused_class.from_pretrained(tmp_path, gguf_file="model.gguf")
    _compare(original, fused, gguf_model, f"{model_type} gguf Q8_0 one kv head")


def test_compressed_tensors_zero_points_packed_across_pieces_stay_split():
    """Asymmetric int4 packs the zero points eight rows to an int32 along the rows. (Transformers 5.24 cannot load
    such a checkpoint into the original class: it expects the zero points unpacked and reports a size mismatch; so
    the composer is checked on compressed-tensors' own modules.) Pieces of 64 and 64 rows stack, and the stacked
    module decompresses to the pieces' weights; pieces of 100 rows end in a half-filled word, and stacking the words
    would shift the second piece's zero points by four rows: they stay split."""
    from compressed_tensors.compressors import decompress_module

    from fusegen.runtime.format_composers import _compose_compressed_tensors

    def pieces(rows):
        torch.manual_seed(0)
        holder = torch.nn.Module()
        holder.a, holder.b = torch.nn.Linear(128, rows, bias=False), torch.nn.Linear(128, rows, bias=False)
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            write_compressed_tensors(holder, None, "w4a16-asym-channel")
        return [holder.a, holder.b]

    whole = pieces(64)
    assert whole[0].weight_zero_point.shape == (8, 1) and whole[0].weight_zero_point.dtype == torch.int32
    merged = _compose_compressed_tensors(whole, [64, 64])
    assert isinstance(merged, torch.nn.Linear), merged
    for module in (*whole, merged):
        decompress_module(module)
    assert torch.equal(merged.weight, torch.cat([piece.weight for piece in whole]))
    reason = _compose_compressed_tensors(pieces(100), [100, 100])
    assert "weight_zero_point of shapes [[13, 1], [13, 1]] is not one entry per 8 rows" in reason
