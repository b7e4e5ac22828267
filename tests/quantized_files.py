"""Pre-quantized checkpoints made locally from tiny random models, in the formats published checkpoints use.

Each writer takes a float model of the ORIGINAL class and writes what a quantization tool would publish for it:
the quantized tensors come from the format's own code (Transformers' FP8 quantize op, compressed-tensors'
compressors, the `gguf` package's quantizers and writer), never from fusegen. The tests then load the one file into
the original class and into the fused class and compare them.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np
import torch

# --- GGUF --------------------------------------------------------------------------------------------------------------

_GGUF_NAMES = {
    "self_attn.q_proj": "attn_q",
    "self_attn.k_proj": "attn_k",
    "self_attn.v_proj": "attn_v",
    "self_attn.o_proj": "attn_output",
    "mlp.gate_proj": "ffn_gate",
    "mlp.up_proj": "ffn_up",
    "mlp.down_proj": "ffn_down",
    "input_layernorm": "attn_norm",
    "post_attention_layernorm": "ffn_norm",
}


def _llama_permute(weights: np.ndarray, heads: int) -> np.ndarray:
    """llama.cpp's convert script interleaves the rotary halves of each q/k head (Transformers undoes it on load)."""
    return (
        weights.reshape(heads, 2, weights.shape[0] // heads // 2, *weights.shape[1:])
        .swapaxes(1, 2)
        .reshape(weights.shape)
    )


def _q4_k(rows: np.ndarray) -> np.ndarray:
    """Q4_K blocks for `rows` (the `gguf` package dequantizes Q4_K but has no quantizer): per block of 256 values,
    fp16 `d` and `dmin`, eight 6-bit sub-block scales and mins packed in 12 bytes, then 128 bytes of 4-bit values,
    laid out as `gguf.quants.Q4_K.dequantize_blocks` reads them. A plain min/max fit, not llama.cpp's search."""
    blocks = rows.astype(np.float32).reshape(-1, 8, 32)
    low = np.minimum(blocks.min(axis=-1), 0.0)
    step = (blocks.max(axis=-1) - low) / 15.0
    d = np.maximum(step.max(axis=-1), 1e-8) / 63.0
    dmin = np.maximum((-low).max(axis=-1), 1e-8) / 63.0
    d16, dmin16 = d.astype(np.float16), dmin.astype(np.float16)
    sc = np.clip(np.round(step / d16.astype(np.float32)[:, None]), 1, 63).astype(np.uint8)
    mn = np.clip(np.round(-low / dmin16.astype(np.float32)[:, None]), 0, 63).astype(np.uint8)
    scale = d16.astype(np.float32)[:, None, None] * sc[..., None]
    offset = dmin16.astype(np.float32)[:, None, None] * mn[..., None]
    q = np.clip(np.round((blocks + offset) / scale), 0, 15).astype(np.uint8)
    packed = np.zeros((blocks.shape[0], 12), dtype=np.uint8)
    packed[:, 0:4] = (sc[:, 0:4] & 0x3F) | ((sc[:, 4:8] >> 4) << 6)
    packed[:, 4:8] = (mn[:, 0:4] & 0x3F) | ((mn[:, 4:8] >> 4) << 6)
    packed[:, 8:12] = (sc[:, 4:8] & 0x0F) | ((mn[:, 4:8] & 0x0F) << 4)
    q = q.reshape(-1, 4, 2, 32)  # pairs of sub-blocks share bytes: low nibble first, high nibble second
    qs = (q[:, :, 0] | (q[:, :, 1] << 4)).reshape(-1, 128)
    out = np.concatenate([d16.view(np.uint8).reshape(-1, 2), dmin16.view(np.uint8).reshape(-1, 2), packed, qs], 1)
    return out.reshape(rows.shape[0], -1)


def write_gguf(model: torch.nn.Module, path: Path, qtype: str) -> Path:
    """`model` (an original Llama or Qwen2 causal LM) as a GGUF file, its linear weights in `qtype` (F32, F16, Q8_0
    or Q4_K; norms and biases stay F32, as llama.cpp's converter keeps them), with the metadata Transformers reads
    the config from. Returns the file."""
    import gguf

    config = model.config
    arch = {"llama": "llama", "qwen2": "qwen2"}[config.model_type]
    qtype_enum = gguf.GGMLQuantizationType[qtype]
    writer = gguf.GGUFWriter(str(path), arch)
    writer.add_context_length(config.max_position_embeddings)
    writer.add_embedding_length(config.hidden_size)
    writer.add_block_count(config.num_hidden_layers)
    writer.add_feed_forward_length(config.intermediate_size)
    writer.add_head_count(config.num_attention_heads)
    writer.add_head_count_kv(config.num_key_value_heads)
    writer.add_layer_norm_rms_eps(config.rms_norm_eps)
    writer.add_rope_freq_base(config.rope_parameters["rope_theta"])
    writer.add_vocab_size(config.vocab_size)
    writer.add_tokenizer_model("llama")
    writer.add_token_list([f"<t{i}>" for i in range(config.vocab_size)])
    for name, tensor in model.state_dict().items():
        data = tensor.detach().float().numpy()
        gguf_name = _gguf_name(name)
        if arch == "llama" and gguf_name.endswith(("attn_q.weight", "attn_k.weight")):
            heads = config.num_attention_heads if "attn_q" in gguf_name else config.num_key_value_heads
            data = _llama_permute(data, heads)
        if data.ndim == 1 or qtype == "F32":
            writer.add_tensor(gguf_name, data)
        elif qtype == "F16":
            writer.add_tensor(gguf_name, data.astype(np.float16))
        elif qtype == "Q4_K":
            writer.add_tensor(gguf_name, _q4_k(data), raw_dtype=qtype_enum)
        else:
            quantized = gguf.quants.quantize(data, qtype_enum)
            writer.add_tensor(gguf_name, quantized, raw_dtype=qtype_enum)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return path


def _gguf_name(name: str) -> str:
    if name == "model.embed_tokens.weight":
        return "token_embd.weight"
    if name == "model.norm.weight":
        return "output_norm.weight"
    if name == "lm_head.weight":
        return "output.weight"
    _, _, layer, rest = name.split(".", 3)
    module, _, leaf = rest.rpartition(".")
    return f"blk.{layer}.{_GGUF_NAMES[module]}.{leaf}"


# --- compressed-tensors ---------------------------------------------------------------------------------------------

CT_SCHEMES = {
    # int8 weights, one scale per output row (llmcompressor's W8A16), packed
    "w8a16-channel": {"num_bits": 8, "type": "int", "strategy": "channel", "fmt": "pack-quantized"},
    # int4 weights, one scale per group of 128 inputs in each row (W4A16), packed eight to an int32
    "w4a16-group128": {"num_bits": 4, "type": "int", "strategy": "group", "group_size": 128, "fmt": "pack-quantized"},
    # int4, one scale per row
    "w4a16-channel": {"num_bits": 4, "type": "int", "strategy": "channel", "fmt": "pack-quantized"},
    # fp8 e4m3 weights, one scale per row (FP8_DYNAMIC's weights)
    "fp8-channel": {"num_bits": 8, "type": "float", "strategy": "channel", "fmt": "float-quantized"},
    # fp8 e4m3 weights, one scale per tensor (FP8's weights): q, k and v each have their own
    "fp8-tensor": {"num_bits": 8, "type": "float", "strategy": "tensor", "fmt": "float-quantized"},
    # int4 asymmetric, one scale and zero point per row; the zero points are packed eight rows to an int32
    "w4a16-asym-channel": {
        "num_bits": 4,
        "type": "int",
        "strategy": "channel",
        "symmetric": False,
        "fmt": "pack-quantized",
    },
    # fp8 e4m3 weights, one scale per block of 32 rows x 64 inputs (FP8_BLOCK's weights, smaller blocks): every piece
    # holds whole blocks
    "fp8-block32": {
        "num_bits": 8,
        "type": "float",
        "strategy": "block",
        "block_structure": [32, 64],
        "fmt": "float-quantized",
    },
    # blocks of 48 rows: q (128 rows) and k, v (64) end in a partial block, so blocks of a stacked weight would
    # straddle two pieces
    "fp8-block48": {
        "num_bits": 8,
        "type": "float",
        "strategy": "block",
        "block_structure": [48, 64],
        "fmt": "float-quantized",
    },
}


def write_compressed_tensors(model: torch.nn.Module, path: Path | None, scheme: str) -> Path | None:
    """`model` (an original causal LM, float) saved as a compressed-tensors checkpoint of `scheme` (`CT_SCHEMES`),
    every decoder linear quantized weight-only with round-to-nearest min/max scales, `lm_head` left float. With
    `path=None` the model's linears are only quantized and compressed in place (any module holding `nn.Linear`s).

    What llmcompressor's `oneshot` does for a data-free scheme, with compressed-tensors' own pieces: the scheme is
    attached by `apply_quantization_config`, the scales come from `calculate_qparams` on each weight's min/max (per
    row, per group or per tensor), and `ModelCompressor` packs the weights and writes the `quantization_config`.
    """
    from compressed_tensors.compressors import ModelCompressor
    from compressed_tensors.quantization import (
        QuantizationArgs,
        QuantizationConfig,
        QuantizationScheme,
        QuantizationStatus,
        apply_quantization_config,
    )
    from compressed_tensors.quantization.utils import calculate_qparams

    spec = dict(CT_SCHEMES[scheme])
    fmt = spec.pop("fmt")
    args = QuantizationArgs(**{"symmetric": True, "dynamic": False, **spec})
    config = QuantizationConfig(
        config_groups={"group_0": QuantizationScheme(targets=["Linear"], weights=args)},
        ignore=["lm_head"],
        quantization_status=QuantizationStatus.INITIALIZED,
        format=fmt,
    )
    model = model.to(torch.float32)
    apply_quantization_config(model, config)
    with torch.no_grad():
        for module in model.modules():
            if getattr(module, "quantization_scheme", None) is None:
                continue
            weight = module.weight
            if args.strategy == "block":
                rows, columns = args.block_structure
                padded = torch.nn.functional.pad(weight, (0, -weight.shape[1] % columns, 0, -weight.shape[0] % rows))
                blocks = padded.unflatten(0, (-1, rows)).unflatten(-1, (-1, columns))
                low, high = blocks.amin((1, 3)), blocks.amax((1, 3))
            elif args.strategy == "group":
                grouped = weight.unflatten(-1, (weight.shape[-1] // args.group_size, args.group_size))
                low, high = grouped.amin(-1), grouped.amax(-1)
            elif args.strategy == "channel":
                low, high = weight.amin(-1, keepdim=True), weight.amax(-1, keepdim=True)
            else:
                low, high = weight.amin().reshape(1), weight.amax().reshape(1)
            scale, zero_point = calculate_qparams(low, high, args)
            module.weight_scale.data.copy_(scale.reshape(module.weight_scale.shape))
            if hasattr(module, "weight_zero_point"):
                module.weight_zero_point.data.copy_(zero_point.reshape(module.weight_zero_point.shape))
    compressor = ModelCompressor.from_pretrained_model(model, quantization_format=fmt)
    compressor.compress_model(model)
    if path is None:
        return None
    model.save_pretrained(path)
    compressor.update_config(str(path))
    return path


# --- FP8 fine-grained (block-wise `weight_scale_inv`) --------------------------------------------------------------


def write_fp8(model: torch.nn.Module, path: Path, block: tuple[int, int]) -> Path:
    """`model` (an original causal LM, float) as a fine-grained FP8 checkpoint (DeepSeek-V3 style): every decoder
    linear's weight in e4m3 with one `weight_scale_inv` per `block` (rows, columns), `lm_head`, embeddings and
    norms as they are. The quantization is Transformers' own (`Fp8Quantize`, the op its FP8 quantizer saves with).
    Block sizes that do not tile a weight leave it unquantized, as that op does."""
    from safetensors.torch import save_file
    from transformers import FineGrainedFP8Config
    from transformers.integrations.finegrained_fp8 import Fp8Quantize

    config = FineGrainedFP8Config(weight_block_size=list(block))
    quantize = Fp8Quantize(type("Quantizer", (), {"quantization_config": config})())
    tensors, seen = {}, set()
    for name, tensor in model.state_dict().items():
        if tensor.data_ptr() in seen:
            continue  # a tied weight (lm_head = embeddings) is saved once, as Transformers saves it
        seen.add(tensor.data_ptr())
        if ".layers." in name and name.endswith("_proj.weight"):
            tensors.update(quantize.convert({name: tensor.detach()}))
        else:
            tensors[name] = tensor.detach().contiguous()
    path.mkdir(parents=True, exist_ok=True)
    save_file({k: v.contiguous() for k, v in tensors.items()}, str(path / "model.safetensors"), {"format": "pt"})
    model.config.quantization_config = {
        "quant_method": "fp8",
        "activation_scheme": "dynamic",
        "weight_block_size": list(block),
    }
    model.config.save_pretrained(path)
    del model.config.quantization_config
    return path
