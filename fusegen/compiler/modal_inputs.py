"""The inputs a model's forward takes besides token ids: images, audio features, decoder tokens.

Validation and the coverage tool must run every class a build fuses, and a multimodal model's vision tower runs
only when it is given an image; an encoder-decoder's decoder only with decoder tokens; a speech model reads audio
features, not tokens. `forward_inputs` builds one batch of each, shaped from the model's own config, the way a
processor would lay it out:

- images (`pixel_values`): `(batch, channels, size, size)` at the vision config's `image_size`, with `image_sizes`
  where the forward takes them (Mistral 3, LLaVA-NeXT; an any-resolution model's `(batch, 1 + tiles, channels,
  size, size)`, the base image and the tiles of its grid, `anyres_tiles`); a pixel mask and an images axis where
  it takes one (SmolVLM), or one camera and a per-camera mask where the vision config sits in a nested
  vision-language config (PI0's `vlm_config`); an images axis and a text-to-image mask where the text
  cross-attends to them (IDEFICS's `image_attention_mask`); for the Qwen-VL family, flattened patches of one
  `(1, 2m, 2m)` grid per image (`image_grid_thw`, m the spatial merge size), so the merger has whole windows to
  merge, or the same patches as small images where the flattened layout fails (PaddleOCR-VL).
- image tokens: as many per image as the vision path yields features (asked of the model itself,
  `get_image_features`, so no per-model count is hard-coded), placed after a short text prefix between the
  vision start/end tokens when the config has them (Qwen-VL's rope index looks for the start token), with
  `token_type_ids` marking them where the forward takes those (Gemma 3's bidirectional image attention).
- robot state, action noise and timestep for a vision-language-action model (PI0, `action_inputs`).
- Pix2Struct's `flattened_patches` (`flattened_patches`).
- audio tokens among the text and a frame mask where the model places audio features there (Qwen2.5-Omni's thinker,
  `with_audio_tokens`, counted as image tokens are).
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
    try:
        inputs = _forward_inputs(model, config, input_ids, seed)
    except Exception:  # one other layout is known (unflattened patches); else the failure stands
        if "image_grid_thw" not in forward_parameters(model):
            raise
        inputs = _forward_inputs(model, config, input_ids, seed, flat_patches=False)
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


def _forward_inputs(
    model: nn.Module, config, input_ids: torch.Tensor, seed: int, image_sizes: bool = True, flat_patches: bool = True
) -> dict:
    parameters = forward_parameters(model) - (set() if image_sizes else {"image_sizes"})
    generator = torch.Generator().manual_seed(seed)
    inputs: dict = {}
    images = (
        image_inputs(model, config, input_ids.shape[0], generator, flat_patches)
        if "pixel_values" in parameters
        else {}
    )
    if not image_sizes:
        images.pop("image_sizes", None)
    if "input_features" in parameters:
        inputs["input_features"] = audio_features(config, input_ids.shape[0], generator)
        if "feature_attention_mask" in parameters:
            input_ids, inputs["feature_attention_mask"] = with_audio_tokens(model, config, input_ids, inputs)
    if images:
        input_ids = with_image_tokens(model, config, input_ids, images)
        token = image_token_id(config)
        for name in ("token_type_ids", "mm_token_type_ids"):
            if name in parameters and token is not None:  # 1 marks an image token, as the processor writes them
                inputs[name] = (input_ids == token).long()  # (no image token: a text segment id, left to default)
    if images and "image_attention_mask" in parameters:
        images = cross_attended_images(images, input_ids)
    if "input_ids" in parameters:
        inputs["input_ids"] = input_ids
        inputs["attention_mask"] = torch.ones_like(input_ids)
    inputs.update(action_inputs(parameters, config, input_ids.shape[0], generator))
    if "flattened_patches" in parameters:
        inputs.update(flattened_patches(config, *input_ids.shape, generator))
    if "decoder_input_ids" in parameters and getattr(config, "is_encoder_decoder", False):
        inputs["decoder_input_ids"] = input_ids if "input_ids" not in inputs else input_ids.flip(-1)
        if "input_ids" not in parameters:
            inputs.pop("attention_mask", None)
    return {**inputs, **images}


def cross_attended_images(images: dict, input_ids: torch.Tensor) -> dict:
    """Images for a model whose text cross-attends to them (IDEFICS): `pixel_values` with an images axis, `(batch,
    1, channels, size, size)`, and `image_attention_mask` `(batch, text length, 1)` letting every text token see
    its sequence's one image, as the processor lays them out."""
    pixels = images["pixel_values"]
    mask = torch.ones(*input_ids.shape, 1, dtype=torch.long)
    return {**images, "pixel_values": pixels[:, None] if pixels.dim() == 4 else pixels, "image_attention_mask": mask}


def image_token_id(config) -> int | None:
    """The id a processor writes for each image feature (`image_token_id`, older `image_token_index`)."""
    parent = vision_parent(config)
    for level in (config,) if parent is None or parent is config else (config, parent):
        for name in ("image_token_id", "image_token_index"):
            value = getattr(level, name, None)
            if isinstance(value, int):
                return value
    return None


def vision_parent(config):
    """The config level that holds the vision config: `config` itself, or its one sub-config that does (PI0 nests
    a PaliGemma config as `vlm_config`); None without one."""
    if getattr(config, "vision_config", None) is not None:
        return config
    found = [getattr(config, key, None) for key in getattr(config, "sub_configs", None) or {}]
    found = [sub for sub in found if getattr(sub, "vision_config", None) is not None]
    return found[0] if len(found) == 1 else None


def image_inputs(model: nn.Module, config, batch: int, generator: torch.Generator, flat_patches: bool = True) -> dict:
    """One image per sequence, in the layout the forward reads (see the module docstring); {} when the config
    names no vision part or no image token (an image-only forward, a dual encoder, gets its images all the same).
    `flat_patches=False`: a grid model's patches as `(rows, channels, patch, patch)` images, the layout PaddleOCR-VL's
    2-D patch embedding reads (`forward_inputs` falls back to it when the flattened layout fails)."""
    parent = vision_parent(config)
    if parent is None:
        return {}
    vision = parent.vision_config
    parameters = forward_parameters(model)
    channels = getattr(vision, "num_channels", None) or getattr(vision, "in_channels", None) or 3
    dtype = next((p.dtype for p in model.parameters() if p.is_floating_point()), torch.float32)
    if "image_grid_thw" in parameters:
        patch, merge = vision.patch_size, getattr(vision, "spatial_merge_size", 1)
        temporal = getattr(vision, "temporal_patch_size", 1)
        rows = batch * (2 * merge) ** 2
        pixels = torch.randn(rows, channels * temporal * patch * patch, generator=generator).to(dtype)
        if not flat_patches:
            pixels = pixels.reshape(rows, channels * temporal, patch, patch)
        return {"pixel_values": pixels, "image_grid_thw": torch.tensor([[1, 2 * merge, 2 * merge]] * batch)}
    size = getattr(vision, "image_size", None)
    size = size[0] if isinstance(size, (list, tuple)) else size
    if not isinstance(size, int):
        return {}
    pixels = torch.randn(batch, channels, size, size, generator=generator).to(dtype)
    found = {"pixel_values": pixels}
    if "pixel_attention_mask" in parameters and parent is not config:  # PI0: one camera, a per-camera mask
        found["pixel_values"] = pixels[:, None]
        found["pixel_attention_mask"] = torch.ones(batch, 1, dtype=torch.bool)
    elif "pixel_attention_mask" in parameters:
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
    if method is None:  # a model wrapping its vision-language model (PI0's `vlm`): that one's, one image per camera
        method = next((m.get_image_features for m in model.modules() if hasattr(m, "get_image_features")), None)
        if method is None:
            return None
        images = {
            "pixel_values": images["pixel_values"].flatten(0, 1)
            if images["pixel_values"].dim() == 5
            else images["pixel_values"]
        }
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
    width = (vision_parent(config) or config).get_text_config().hidden_size  # the text model the features enter
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


def with_audio_tokens(
    model: nn.Module, config, input_ids: torch.Tensor, inputs: dict
) -> tuple[torch.Tensor, torch.Tensor]:
    """For a model that places audio features among the text (Qwen2.5-Omni's thinker): `input_ids` with each
    sequence's audio tokens after `PREFIX` text tokens, as many as the audio tower yields features for one clip
    (asked of `get_audio_features`), between the audio start and end tokens when the config has them; and the
    `feature_attention_mask` of ones `(batch, frames)` those features were computed under (no frame is padding).
    The ids unchanged where the config names no audio token or the model cannot count its features."""
    features = inputs["input_features"]
    mask = torch.ones(features.shape[0], features.shape[-1], dtype=torch.long)
    token = next(
        (v for n in ("audio_token_id", "audio_token_index") if isinstance(v := getattr(config, n, None), int)), None
    )
    method = getattr(model, "get_audio_features", None)
    if token is None or method is None:
        return input_ids, mask
    with torch.no_grad():
        output = method(features, feature_attention_mask=mask)
    states = getattr(output, "last_hidden_state", output)
    total = states.numel() // config.get_text_config().hidden_size
    per_clip, left = divmod(total, input_ids.shape[0])
    if per_clip == 0 or left:
        raise ValueError(f"{total} audio features do not split evenly over {input_ids.shape[0]} clips")
    audio = [token] * per_clip
    start, end = getattr(config, "audio_start_token_id", None), getattr(config, "audio_end_token_id", None)
    if isinstance(start, int) and isinstance(end, int):
        audio = [start, *audio, end]
    block = torch.tensor(audio, dtype=input_ids.dtype).expand(input_ids.shape[0], -1)
    return torch.cat([input_ids[:, :PREFIX], block, input_ids[:, PREFIX:]], dim=1), mask


def action_inputs(parameters: set[str], config, batch: int, generator: torch.Generator) -> dict:
    """A vision-language-action model's other inputs (PI0, which predicts a chunk of robot actions by denoising):
    the robot `state` `(batch, max_state_dim)`, and the `noise` `(batch, chunk_size, max_action_dim)` and flow
    `timestep` `(batch,)` in (0, 1) that its forward would otherwise draw at random on each call, so that the
    original and the fused model denoise the very same sample. {} for other models."""
    state, chunk, actions = (getattr(config, name, None) for name in ("max_state_dim", "chunk_size", "max_action_dim"))
    if "state" not in parameters or not isinstance(state, int):
        return {}
    found = {"state": torch.randn(batch, state, generator=generator)}
    if "noise" in parameters and isinstance(chunk, int) and isinstance(actions, int):
        found["noise"] = torch.randn(batch, chunk, actions, generator=generator)
    if "timestep" in parameters:
        found["timestep"] = torch.rand(batch, generator=generator) * 0.8 + 0.1
    return found


def flattened_patches(config, batch: int, length: int, generator: torch.Generator) -> dict:
    """Pix2Struct's image input: `flattened_patches` `(batch, patches, 2 + patch_embed_hidden_size)`, each row its
    1-based patch row and column (0 marks padding) then the patch's pixels. As many patches as the text has tokens,
    in rows of 4: the forward's `attention_mask` is the patches' mask, and the callers send one of ones shaped as the
    token ids (no patch is padding). {} when the vision config does not size its patches."""
    vision = getattr(config, "vision_config", None)
    width = getattr(vision, "patch_embed_hidden_size", None)
    if not isinstance(width, int):
        return {}
    index = torch.arange(length)
    rows, columns = (index // 4 + 1).float(), (index % 4 + 1).float()
    pixels = torch.randn(batch, length, width, generator=generator)
    positions = torch.stack([rows, columns], dim=-1).expand(batch, -1, -1)
    return {"flattened_patches": torch.cat([positions, pixels], dim=-1)}


def audio_features(config, batch: int, generator: torch.Generator) -> torch.Tensor:
    """Log-mel features `(batch, num_mel_bins, frames)`: twice `max_source_positions` frames, what two stride-2
    convolutions bring down to the encoder's positions (Whisper), else 2 x 16."""
    audio = getattr(config, "audio_config", None)  # a composite model's audio tower (Qwen2.5-Omni's thinker)
    bins = getattr(config, "num_mel_bins", None) or getattr(audio, "num_mel_bins", None) or 80
    positions = getattr(config, "max_source_positions", None) or getattr(audio, "max_source_positions", None) or 16
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
