"""The inputs a model's forward takes besides token ids: images, audio features, decoder tokens.

Validation and the coverage tool must run every class a build fuses, and a multimodal model's vision tower runs
only when it is given an image; an encoder-decoder's decoder only with decoder tokens; a speech model reads audio
features, not tokens. `forward_inputs` builds one batch of each, shaped from the model's own config, the way a
processor would lay it out:

- images (`pixel_values`): `(batch, channels, size, size)` at the vision config's `image_size`, with `image_sizes`
  where the forward takes them (Mistral 3, LLaVA-NeXT; an any-resolution model's `(batch, 1 + tiles, channels,
  size, size)`, the base image and the tiles of its grid, `anyres_tiles`) and a pixel mask and an images axis where it takes one
  (SmolVLM); for the Qwen-VL family, flattened patches of one `(1, 2m, 2m)` grid per image (`image_grid_thw`, m the
  spatial merge size), so the merger has whole windows to merge.
- image tokens: as many per image as the vision path yields features (asked of the model itself,
  `get_image_features`, so no per-model count is hard-coded), placed after a short text prefix between the
  vision start/end tokens when the config has them (Qwen-VL's rope index looks for the start token), with
  `token_type_ids` marking them where the forward takes those (Gemma 3's bidirectional image attention).
- audio: `input_features` of `(batch, mel bins, 2 * max_source_positions)` (Whisper's two stride-2 convolutions).
- decoder tokens for an encoder-decoder (`decoder_input_ids`), random ids as the text; encoder states for a
  decoder-only head with cross-attention (`encoder_hidden_states`), where the original runs with them.

Everything is drawn from a seeded generator, so the original and the fused model see the very same batch.
"""

from __future__ import annotations

import inspect

import torch
from torch import nn

PREFIX = 3
"""Text tokens before the image."""


def forward_parameters(model: nn.Module) -> set[str]:
    """The names `type(model).forward` takes."""
    return set(inspect.signature(type(model).forward).parameters)


def forward_inputs(model: nn.Module, config, input_ids: torch.Tensor, seed: int = 1) -> dict:
    """Keyword arguments for `model(**inputs)`: `input_ids` (from `fusegen.testkit.random_input`) and an attention
    mask, plus images, audio features and decoder tokens where the forward takes them (see the module docstring).

    `image_sizes` is sent only where the model runs with it: a processor sends it only to towers that read it
    (Pixtral's, Mistral 3), while LLaVA's forward takes it too but fails on it behind a CLIP tower. So the batch
    with it is run once on `model` (the original), and built again without it if that fails.
    """
    inputs = _forward_inputs(model, config, input_ids, seed)
    if "image_sizes" in inputs and not _runs(model, inputs):
        inputs = _forward_inputs(model, config, input_ids, seed, image_sizes=False)
    states = encoder_states(model, config, input_ids, seed)
    if states is not None and _runs(model, {**inputs, "encoder_hidden_states": states}):
        inputs["encoder_hidden_states"] = states
    return inputs


def _runs(model: nn.Module, inputs: dict) -> bool:
    """Whether `model` (the original) runs on `inputs`."""
    try:
        with torch.no_grad():
            model(**inputs)
    except Exception:  # noqa: BLE001 - it does not: the caller builds the batch without what it tried
        return False
    return True


def encoder_states(model: nn.Module, config, input_ids: torch.Tensor, seed: int) -> torch.Tensor | None:
    """Encoder states `(batch, half the length, hidden)` for a decoder-only head whose forward takes
    `encoder_hidden_states` (ProphetNet's, BART's, Whisper's causal LMs): their cross-attention runs only with
    them. Sent only where the original runs with them (`forward_inputs`): a BERT-style head without
    cross-attention layers refuses them. None for other models."""
    parameters = forward_parameters(model)
    if "encoder_hidden_states" not in parameters or "decoder_input_ids" in parameters:  # a whole seq2seq model
        return None
    width = getattr(config.get_text_config(decoder=True), "hidden_size", None)
    if not isinstance(width, int):
        return None
    dtype = next((p.dtype for p in model.parameters() if p.is_floating_point()), torch.float32)
    generator = torch.Generator().manual_seed(seed + 7)
    shape = (input_ids.shape[0], max(input_ids.shape[1] // 2, 1), width)
    return torch.randn(*shape, generator=generator).to(dtype)


def _forward_inputs(model: nn.Module, config, input_ids: torch.Tensor, seed: int, image_sizes: bool = True) -> dict:
    parameters = forward_parameters(model) - (set() if image_sizes else {"image_sizes"})
    generator = torch.Generator().manual_seed(seed)
    inputs: dict = {}
    images = image_inputs(model, config, input_ids.shape[0], generator) if "pixel_values" in parameters else {}
    if not image_sizes:
        images.pop("image_sizes", None)
    if images:
        input_ids = with_image_tokens(model, config, input_ids, images)
        token = image_token_id(config)
        for name in ("token_type_ids", "mm_token_type_ids"):
            if name in parameters and token is not None:  # 1 marks an image token, as the processor writes them
                inputs[name] = (input_ids == token).long()  # (no image token: a text segment id, left to default)
    if "input_ids" in parameters:
        inputs["input_ids"] = input_ids
        inputs["attention_mask"] = torch.ones_like(input_ids)
    if "input_features" in parameters:
        inputs["input_features"] = audio_features(config, input_ids.shape[0], generator)
    if "decoder_input_ids" in parameters and getattr(config, "is_encoder_decoder", False):
        inputs["decoder_input_ids"] = input_ids if "input_ids" not in inputs else input_ids.flip(-1)
        if "input_ids" not in parameters:
            inputs.pop("attention_mask", None)
    return {**inputs, **images}


def image_token_id(config) -> int | None:
    """The id a processor writes for each image feature (`image_token_id`, older `image_token_index`)."""
    for name in ("image_token_id", "image_token_index"):
        value = getattr(config, name, None)
        if isinstance(value, int):
            return value
    return None


def image_inputs(model: nn.Module, config, batch: int, generator: torch.Generator) -> dict:
    """One image per sequence, in the layout the forward reads (see the module docstring); {} when the config
    names no vision part or no image token (an image-only forward, a dual encoder, gets its images all the same)."""
    vision = getattr(config, "vision_config", None)
    if vision is None:
        return {}
    parameters = forward_parameters(model)
    channels = getattr(vision, "num_channels", None) or getattr(vision, "in_channels", None) or 3
    dtype = next((p.dtype for p in model.parameters() if p.is_floating_point()), torch.float32)
    if "image_grid_thw" in parameters:
        patch, merge = vision.patch_size, getattr(vision, "spatial_merge_size", 1)
        temporal = getattr(vision, "temporal_patch_size", 1)
        rows = batch * (2 * merge) ** 2
        pixels = torch.randn(rows, channels * temporal * patch * patch, generator=generator).to(dtype)
        return {"pixel_values": pixels, "image_grid_thw": torch.tensor([[1, 2 * merge, 2 * merge]] * batch)}
    size = getattr(vision, "image_size", None)
    size = size[0] if isinstance(size, (list, tuple)) else size
    if not isinstance(size, int):
        return {}
    pixels = torch.randn(batch, channels, size, size, generator=generator).to(dtype)
    found = {"pixel_values": pixels}
    if "pixel_attention_mask" in parameters:
        found["pixel_values"] = pixels[:, None]
        found["pixel_attention_mask"] = torch.ones(batch, 1, size, size, dtype=torch.bool)
    if "image_sizes" in parameters:
        found["image_sizes"] = torch.tensor([[size, size]] * batch)
        tiles = anyres_tiles(config, size)
        if tiles:  # the base image, then the tiles of its best grid, stacked per image as the processor does
            found["pixel_values"] = torch.randn(batch, 1 + tiles, channels, size, size, generator=generator).to(dtype)
    return found


def anyres_tiles(config, size: int) -> int:
    """How many tiles an any-resolution model (LLaVA-NeXT's `image_grid_pinpoints`) cuts a `size` x `size` image
    into, besides the base image: its best grid (Transformers' `select_best_resolution`, as the processor picks it)
    counted in tiles of `size`, the vision tower's image size. 0 for a model without pinpoints."""
    pinpoints = getattr(config, "image_grid_pinpoints", None)
    if not isinstance(pinpoints, (list, tuple)) or not pinpoints:
        return 0
    from transformers.image_processing_utils import select_best_resolution

    height, width = select_best_resolution((size, size), [tuple(point) for point in pinpoints])
    return -(-height // size) * -(-width // size)


def image_features(model: nn.Module, images: dict):
    """The vision path's output for `images` as the language model receives it (`get_image_features`'s pooled
    output: one tensor, or one per image), or None when the model has no such method."""
    method = getattr(model, "get_image_features", None)
    if method is None:
        return None
    accepted = set(inspect.signature(method).parameters)
    output = method(**{key: value for key, value in images.items() if key in accepted})
    return getattr(output, "pooler_output", output)


def _flat(features) -> list[torch.Tensor]:
    if isinstance(features, torch.Tensor):
        return [features]
    return [tensor for each in features for tensor in _flat(each)]


def with_image_tokens(model: nn.Module, config, input_ids: torch.Tensor, images: dict) -> torch.Tensor:
    """`input_ids` with each sequence's image tokens inserted after `PREFIX` text tokens: as many as the vision path
    yields features for one image, between the vision start and end tokens when the config has them."""
    token = image_token_id(config)
    if token is None:
        return input_ids
    with torch.no_grad():
        features = image_features(model, images)
        features = [] if features is None else _flat(features)
    width = config.get_text_config().hidden_size
    total = sum(tensor.numel() for tensor in features) // width
    per_image, left = divmod(total, input_ids.shape[0])
    if per_image == 0 or left:
        raise ValueError(f"{total} image features do not split evenly over {input_ids.shape[0]} images")
    image = [token] * per_image
    start, end = getattr(config, "vision_start_token_id", None), getattr(config, "vision_end_token_id", None)
    if isinstance(start, int) and isinstance(end, int):
        image = [start, *image, end]
    block = torch.tensor(image, dtype=input_ids.dtype).expand(input_ids.shape[0], -1)
    return torch.cat([input_ids[:, :PREFIX], block, input_ids[:, PREFIX:]], dim=1)


def audio_features(config, batch: int, generator: torch.Generator) -> torch.Tensor:
    """Log-mel features `(batch, num_mel_bins, frames)`: twice `max_source_positions` frames, what two stride-2
    convolutions bring down to the encoder's positions (Whisper), else 2 x 16."""
    bins = getattr(config, "num_mel_bins", None) or 80
    positions = getattr(config, "max_source_positions", None) or 16
    return torch.randn(batch, bins, 2 * positions, generator=generator)


def meta_image_inputs(model: nn.Module, batch: int = 2) -> dict:
    """`image_inputs` for recording a meta forward (`fusegen.compiler.trace`): pixels on `meta`, integer layout
    tensors (`image_grid_thw`, `image_sizes`) real, since the vision path reads their values; {} when the forward
    takes no images or the config does not say how to make them."""
    if "pixel_values" not in forward_parameters(model):
        return {}
    try:
        images = image_inputs(model, model.config, batch, torch.Generator().manual_seed(0))
    except Exception:  # noqa: BLE001 - a config that does not spell its vision sizes as expected: no images
        return {}
    return {key: value.to("meta") if value.is_floating_point() else value for key, value in images.items()}
