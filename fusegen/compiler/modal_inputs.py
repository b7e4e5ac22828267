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
- audio tokens among the text, between the audio start and end tokens where the config names them, and a frame
  mask where the forward takes one (`with_audio`; Qwen2.5-Omni's thinker, Qwen2-Audio, Voxtral).
- audio: `input_features` of `2 * max_source_positions` frames (Whisper's two stride-2 convolutions; 32 without
  one) of the feature width the config (or its audio/encoder sub-config) names, laid out `(batch, features, frames)`
  or `(batch, frames, features)`, whichever the original runs (`audio_feature_options`); a raw waveform
  (`input_values`) for a forward that reads samples (`waveform`).
- videos (`pixel_values_videos`, for a forward that takes no still images): `(batch, frames, channels, size, size)`;
  and NaFlex patches (Siglip2's `spatial_shapes`): `(batch, patches, channels * patch * patch)` of a 2 x 2 grid.
- decoder tokens for an encoder-decoder (`decoder_input_ids`), random ids as the text; encoder states for a
  decoder-only head with cross-attention (`encoder_hidden_states`), where the original runs with them.

Everything is drawn from a seeded generator, so the original and the fused model see the very same batch.
"""

from __future__ import annotations

import inspect
import math

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

    Where the layout is not certain, the candidate batches (`_candidates`) are run on `model` (the original) in
    order and the first it runs on is taken: `image_sizes` is sent only where the model runs with it (a processor
    sends it only to towers that read it, Pixtral's and Mistral 3's, while LLaVA's forward takes it too but fails
    on it behind a CLIP tower); audio features go in the width and axis order the original reads; and a forward
    that takes token ids and features for the same encoder (Pop2Piano's `input_features` are its encoder's input
    embeddings) gets the token ids alone when it refuses both. Whatever batch is taken, both models see it, and
    validation separately fails a fused class the batch never runs (`fusegen.compiler.validate._never_executed`).
    """
    first, others = _candidates(model, config, input_ids, seed)
    inputs = first
    if others and not _runs(model, first):  # the first batch the original runs on; none: the first (its failure)
        inputs = next((each for each in _made(others) if _runs(model, each)), first)
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


def _made(makers):
    """The batches `makers` build, in order, skipping one whose building fails (`image_sizes` left out of a model
    whose `get_image_features` requires it: no such batch)."""
    for make in makers:
        try:
            yield make()
        except Exception:  # noqa: BLE001, S112 - this layout does not apply to the model
            continue


def _candidates(model: nn.Module, config, input_ids: torch.Tensor, seed: int) -> tuple[dict, list]:
    """The batch `forward_inputs` sends first, and the makers of the others to try if the original fails on it, the
    likeliest first (see there). Built only when tried: each may run the model's audio or image path."""
    flat = True
    try:
        first = _forward_inputs(model, config, input_ids, seed)
    except Exception:  # one other image layout is known (unflattened patches, PaddleOCR-VL); else the failure stands
        if "image_grid_thw" not in forward_parameters(model):
            raise
        flat = False
        first = _forward_inputs(model, config, input_ids, seed, flat_patches=False)
    others = []
    if "image_sizes" in first:
        others.append(lambda: _forward_inputs(model, config, input_ids, seed, image_sizes=False, flat_patches=flat))
    if "input_features" in first:
        generator = torch.Generator().manual_seed(seed + 11)
        per_token = per_token_features(model, first, generator)
        if per_token is not None:
            others.append(lambda: {**first, "input_features": per_token})
        count = len(audio_feature_options(config, input_ids.shape[0], generator))
        others += [
            lambda option=option: _forward_inputs(model, config, input_ids, seed, flat_patches=flat, audio=option)
            for option in range(1, count)
        ]
        if "input_ids" in first:  # token ids alone, for a forward that takes both for one encoder (Pop2Piano)
            text = {key: value for key, value in first.items() if key not in AUDIO_KEYS}
            others.append(lambda: {**text, "input_ids": input_ids, "attention_mask": torch.ones_like(input_ids)})
    return first, others


AUDIO_KEYS = ("input_features", "input_features_mask", "feature_attention_mask")
"""What `with_audio` adds to a batch (besides the audio tokens it places in `input_ids`)."""


def with_audio(model: nn.Module, config, batch: dict, features: torch.Tensor, frames: int) -> dict | None:
    """`batch` with `features` as `input_features`, an all-ones frame mask `(batch, frames)` where the forward
    takes one (`input_features_mask`, Qwen2-Audio's `feature_attention_mask`), and, for a model that reads its
    audio at placeholder tokens (`audio_token_id`), those tokens placed in `input_ids` as `with_audio_tokens` does.
    None when the placeholders cannot be placed (the audio path fails on these features)."""
    parameters = forward_parameters(model)
    found = {**batch, "input_features": features}
    for name in AUDIO_KEYS[1:]:
        if name in parameters:
            found[name] = torch.ones(features.shape[0], frames, dtype=torch.long)
    if "input_ids" not in found or audio_token_id(config) is None:
        return found
    input_ids = with_audio_tokens(model, config, found)
    if input_ids is None:
        return None
    return {**found, "input_ids": input_ids, "attention_mask": torch.ones_like(input_ids)}


def with_waveform(model: nn.Module, config, batch: dict, values: torch.Tensor) -> dict:
    """`batch` with the waveform `values` as `input_values` (`(batch, samples)`, else `(batch, 1, samples)`, whichever
    the audio path reads) and its audio tokens placed (`with_audio_tokens`; VibeVoice-ASR). A forward that draws noise into the audio latents unless told not to (a boolean `sample`
    parameter, VibeVoice's sigma-VAE) gets `sample=False`: the two models' draws could not be compared. `batch`
    unchanged when the tokens cannot be placed."""
    found = {**batch, "input_values": values}
    parameter = inspect.signature(type(model).forward).parameters.get("sample")
    if parameter is not None and isinstance(parameter.default, bool):
        found["sample"] = False
    if "input_ids" not in found:
        return found
    for layout in (values, values[:, None]):  # mono samples, or with their channel axis (VibeVoice's tokenizers)
        found["input_values"] = layout
        input_ids = with_audio_tokens(model, config, found, ("input_values", "sample"))
        if input_ids is not None:
            return {**found, "input_ids": input_ids, "attention_mask": torch.ones_like(input_ids)}
    return batch


def audio_token_id(config) -> int | None:
    """The id a processor writes for each audio embedding (`audio_token_id`, older `audio_token_index`)."""
    return _token_id((config,), "audio")


def _token_id(levels, kind: str) -> int | None:
    """The first `{kind}_token_id` (older spelling `{kind}_token_index`) that is an int, looked up on each config
    of `levels` in turn; None when none names one (a bool is a flag, never an id)."""
    for level in levels:
        for name in (f"{kind}_token_id", f"{kind}_token_index"):
            value = getattr(level, name, None)
            if isinstance(value, int) and not isinstance(value, bool):
                return value
    return None


def _with_token_block(input_ids: torch.Tensor, token: int, count: int, brackets: tuple) -> torch.Tensor:
    """`input_ids` with `count` copies of `token` inserted in every sequence after `PREFIX` text tokens, between
    `brackets` (the processor's start and end tokens) when both are ints."""
    block = [token] * count
    start, end = brackets
    if isinstance(start, int) and isinstance(end, int):
        block = [start, *block, end]
    block = torch.tensor(block, dtype=input_ids.dtype).expand(input_ids.shape[0], -1)
    return torch.cat([input_ids[:, :PREFIX], block, input_ids[:, PREFIX:]], dim=1)


def with_audio_tokens(model: nn.Module, config, batch: dict, keys=AUDIO_KEYS) -> torch.Tensor | None:
    """`batch["input_ids"]` with each sequence's audio tokens inserted after `PREFIX` text tokens: as many as the
    audio path (`get_audio_features`, asked of the model itself) yields embeddings per sequence. None when the model
    has no such method, it fails on the batch, or its embeddings do not split evenly over the sequences."""
    method = getattr(model, "get_audio_features", None)
    if method is None:
        return None
    given = {key: value for key, value in batch.items() if key in keys}
    try:  # the audio inputs the forward takes (a head's method often forwards `**kwargs` to its model's)
        with torch.no_grad():
            output = method(**given)
    except Exception:  # noqa: BLE001 - the audio path does not read this layout
        return None
    features = _flat(getattr(output, "pooler_output", output))
    input_ids = batch["input_ids"]
    total = sum(tensor.numel() for tensor in features) // config.get_text_config().hidden_size
    per_sequence, left = divmod(total, input_ids.shape[0])
    if per_sequence == 0 or left:
        return None
    brackets = (getattr(config, "audio_start_token_id", None), getattr(config, "audio_end_token_id", None))
    return _with_token_block(input_ids, audio_token_id(config), per_sequence, brackets)  # Qwen2.5-Omni: bracketed


def _forward_inputs(
    model: nn.Module,
    config,
    input_ids: torch.Tensor,
    seed: int,
    image_sizes: bool = True,
    flat_patches: bool = True,
    audio: int = 0,
) -> dict:
    parameters = forward_parameters(model) - (set() if image_sizes else {"image_sizes"})
    generator = torch.Generator().manual_seed(seed)
    images = (
        image_inputs(model, config, input_ids.shape[0], generator, flat_patches)
        if "pixel_values" in parameters
        else {}
    )
    if "pixel_values_videos" in parameters and "pixel_values" not in parameters:  # a video-only tower (VideoPrism)
        images = video_inputs(model, config, input_ids.shape[0], generator)
    if not image_sizes:
        images.pop("image_sizes", None)
    inputs = _audio_inputs(model, config, parameters, input_ids, generator, audio)  # first: its tokens lengthen ids
    input_ids = inputs.pop("input_ids", input_ids)
    inputs.pop("attention_mask", None)
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
    if "decoder_input_ids" in parameters and getattr(config, "is_encoder_decoder", False):
        inputs["decoder_input_ids"] = input_ids if "input_ids" not in inputs else input_ids.flip(-1)
        if "input_ids" not in parameters:
            inputs.pop("attention_mask", None)
    if "flattened_patches" in parameters:  # after the decoder's ids: the mask it brings is the patches' own
        inputs.update(flattened_patches(config, *input_ids.shape, generator))
    return {**inputs, **images}


def _audio_inputs(
    model: nn.Module, config, parameters: set[str], input_ids: torch.Tensor, generator, option: int = 0
) -> dict:
    """The audio the forward reads (features in the layout `audio_feature_options[option]`, a raw waveform), with
    `input_ids` (where the forward takes them) carrying the audio tokens of a model that reads its audio at
    placeholder tokens; {} for a forward without audio. Only the first layout is sent without its placeholders when
    they cannot be placed; another layout then raises (no such batch)."""
    text = {"input_ids": input_ids} if "input_ids" in parameters else {}
    if "input_features" in parameters:
        features, frames = audio_feature_options(config, input_ids.shape[0], generator)[option]
        found = with_audio(model, config, text, features, frames)
        if found is None and option:
            raise ValueError("the audio placeholders cannot be placed for this layout")
        return found or {**text, "input_features": features}
    if "input_values" in parameters and "input_ids" not in parameters:  # a raw waveform (SpeechT5, Moonshine)
        return {"input_values": waveform(config, input_ids.shape[0], generator)}
    if "input_values" in parameters and audio_token_id(config) is not None:  # a waveform at audio tokens
        return with_waveform(model, config, text, waveform(config, input_ids.shape[0], generator))
    return {}


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
    return _token_id((config,) if parent is None or parent is config else (config, parent), "image")


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
    if "spatial_shapes" in parameters and isinstance(getattr(vision, "patch_size", None), int):
        return naflex_inputs(vision, channels, batch, generator, dtype)
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
            "pixel_values": (
                images["pixel_values"].flatten(0, 1) if images["pixel_values"].dim() == 5 else images["pixel_values"]
            )
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
    brackets = (getattr(config, "vision_start_token_id", None), getattr(config, "vision_end_token_id", None))
    return _with_token_block(input_ids, token, per_image, brackets)


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
    in rows of 4, and their `attention_mask` (the forward's mask is the patches' one): all ones, no patch is
    padding. {} when the vision config does not size its patches."""
    vision = getattr(config, "vision_config", None)
    width = getattr(vision, "patch_embed_hidden_size", None)
    if not isinstance(width, int):
        return {}
    index = torch.arange(length)
    rows, columns = (index // 4 + 1).float(), (index % 4 + 1).float()
    pixels = torch.randn(batch, length, width, generator=generator)
    positions = torch.stack([rows, columns], dim=-1).expand(batch, -1, -1)
    return {"flattened_patches": torch.cat([positions, pixels], dim=-1), "attention_mask": torch.ones(batch, length)}


NAFLEX_GRID = (2, 2)
"""Patch rows and columns of a NaFlex image (Siglip2): the tower resizes its position table to any grid."""


def naflex_inputs(vision, channels: int, batch: int, generator: torch.Generator, dtype) -> dict:
    """One NaFlex image per sequence, as Siglip2's processor lays it out: `pixel_values` `(batch, patches,
    channels * patch * patch)` (each patch flattened), `pixel_attention_mask` `(batch, patches)` (no padding
    patch) and `spatial_shapes` `(batch, 2)`, the patch grid, `NAFLEX_GRID`."""
    patches = NAFLEX_GRID[0] * NAFLEX_GRID[1]
    width = channels * vision.patch_size**2
    return {
        "pixel_values": torch.randn(batch, patches, width, generator=generator).to(dtype),
        "pixel_attention_mask": torch.ones(batch, patches, dtype=torch.long),
        "spatial_shapes": torch.tensor([list(NAFLEX_GRID)] * batch),
    }


def video_inputs(model: nn.Module, config, batch: int, generator: torch.Generator) -> dict:
    """One video per sequence, `pixel_values_videos` `(batch, num_frames, channels, size, size)` at the vision
    config's frame count and image size; {} when the config does not spell them."""
    vision = getattr(config, "vision_config", None) or config
    size = getattr(vision, "image_size", None)
    size = size[0] if isinstance(size, (list, tuple)) else size
    frames = getattr(vision, "num_frames", None)
    if not isinstance(size, int) or not isinstance(frames, int):
        return {}
    channels = getattr(vision, "num_channels", None) or 3
    dtype = next((p.dtype for p in model.parameters() if p.is_floating_point()), torch.float32)
    return {"pixel_values_videos": torch.randn(batch, frames, channels, size, size, generator=generator).to(dtype)}


FEATURE_WIDTHS = (
    "input_size",
    "num_mel_bins",
    "n_mels",
    "feature_projection_input_dim",
    "feature_size",
    "input_feat_per_channel",
)
"""Config fields that give the width of one frame of `input_features`, looked up on the config and its sub-configs
(Parakeet's `encoder_config`, Voxtral's `audio_config`): the stacked low-frame-rate width (Fun-ASR-Nano's
`input_size`, mel bins times stacked frames), mel bins (Whisper, Parakeet), the stacked filter-bank width a
feature projection reads (SeamlessM4T), per-channel filter banks (Speech2Text, times `input_channels`)."""


def _config_levels(config) -> list:
    """`config`, then its sub-configs (one level down, in the order the config lists them)."""
    levels = [config]
    for key in getattr(config, "sub_configs", None) or {}:
        sub = getattr(config, key, None)
        if sub is not None and hasattr(sub, "to_dict"):
            levels.append(sub)
    return levels


def _config_value(config, name: str):
    """The first int `name` on `config` or one of its sub-configs, else None."""
    for level in _config_levels(config):
        value = getattr(level, name, None)
        if isinstance(value, int) and not isinstance(value, bool):
            return value
    return None


def feature_widths(config) -> list[int]:
    """The frame widths `input_features` may have, the likeliest first (`FEATURE_WIDTHS`; 80 when none is named)."""
    widths = []
    for name in FEATURE_WIDTHS:
        value = _config_value(config, name)
        if name == "input_feat_per_channel" and value is not None:
            value *= _config_value(config, "input_channels") or 1
        if value and value not in widths:
            widths.append(value)
    return widths or [80]


def audio_feature_options(config, batch: int, generator: torch.Generator) -> list[tuple[torch.Tensor, int]]:
    """Audio features for the forward and their frame count, one per possible layout, the likeliest first: for each
    frame width of `feature_widths` and each frame count, `(batch, width, frames)` (Whisper's channels-first log-mel)
    and `(batch, frames, width)` (the frame-major filter banks of Speech2Text, SeamlessM4T, Parakeet). Frames: twice
    `max_source_positions`, what two stride-2 convolutions bring down to the encoder's positions (Whisper checks
    it), else 32; where the encoder reads chunks of `2 * n_window` frames, first that rounded up to whole chunks
    (Qwen3-ASR checks it), then as it is (Qwen2.5-Omni's chunks may hold more frames than a tiny encoder has
    positions)."""
    frames = 2 * (_config_value(config, "max_source_positions") or 16)
    chunk = 2 * (_config_value(config, "n_window") or 0)
    counts = [-(-frames // chunk) * chunk, frames] if chunk and frames % chunk else [frames]
    options = []
    for width in feature_widths(config):
        for count in counts:
            features = torch.randn(batch, width, count, generator=generator)
            options += [(features, count), (features.transpose(1, 2).contiguous(), count)]
    return options


def per_token_features(model: nn.Module, inputs: dict, generator: torch.Generator) -> torch.Tensor | None:
    """Features `(batch, width, frames)` whose audio path (`get_audio_features`) yields one embedding per token of
    `inputs["input_ids"]`, for a model that adds the audio embeddings to the token embeddings position by position
    (Voxtral Realtime's streaming: `inputs_embeds += audio_embeds`): `inputs["input_features"]`'s frames scaled by
    tokens / embeddings. None when the model has no such method, the batch has no token ids, or the count does not
    scale to a whole number of frames."""
    method = getattr(model, "get_audio_features", None)
    features = inputs.get("input_features")
    if method is None or features is None or "input_ids" not in inputs:
        return None
    try:
        with torch.no_grad():
            output = method(input_features=features)
    except Exception:  # noqa: BLE001 - the audio path does not read this layout: no such candidate
        return None
    output = getattr(output, "pooler_output", output)
    if not isinstance(output, torch.Tensor) or output.dim() != 3 or output.shape[1] == 0:
        return None
    tokens, embeddings = inputs["input_ids"].shape[1], output.shape[1]
    frames, left = divmod(features.shape[2] * tokens, embeddings)
    if left or frames == features.shape[2]:
        return None
    return torch.randn(*features.shape[:2], frames, generator=generator)


WAVEFORM_STRIDES = ("conv_stride", "downsampling_ratios")
"""Config fields listing a waveform encoder's strides (wav2vec2-style feature encoders; VibeVoice's tokenizers)."""

WAVEFORM_FRAMES = 16
"""Frames a raw waveform is cut into by the feature encoder's convolutions (`waveform`)."""


def waveform(config, batch: int, generator: torch.Generator) -> torch.Tensor:
    """A raw waveform `(batch, samples)`: `WAVEFORM_FRAMES` times the product of the feature encoder's strides
    (`WAVEFORM_STRIDES`: SpeechT5's 320, VibeVoice's 3200), else 4000 samples (a quarter second at 16 kHz; Moonshine's convolutions, of
    stride 64 x 3 x 2, bring it down to 9 frames)."""
    found = (getattr(level, name, None) for name in WAVEFORM_STRIDES for level in _config_levels(config))
    strides = next((each for each in found if each), None)
    if isinstance(strides, (list, tuple)) and strides and all(isinstance(s, int) for s in strides):
        samples = WAVEFORM_FRAMES * math.prod(strides)
    else:
        samples = 4000
    return torch.randn(batch, samples, generator=generator)


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


def meta_signal_batches(model: nn.Module, length: int = 5) -> list[dict]:
    """Batches for recording a meta forward (`fusegen.compiler.trace`) of a model that reads audio or video, one
    per layout `forward_inputs` would try (`audio_feature_options`; a waveform; a video), floats on `meta` and
    integer masks real; token ids (and decoder tokens for an encoder-decoder) as zeros on `meta` where the forward
    takes them. [] for a forward that reads none of these or a config that does not say how to make them."""
    parameters = forward_parameters(model)
    config = getattr(model, "config", None)
    if config is None:
        return []
    generator = torch.Generator().manual_seed(0)
    tokens = {}
    if "input_ids" in parameters:
        tokens["input_ids"] = torch.zeros(2, length, dtype=torch.long, device="meta")
    if "decoder_input_ids" in parameters and getattr(config, "is_encoder_decoder", False):
        tokens["decoder_input_ids"] = torch.zeros(2, length, dtype=torch.long, device="meta")
    try:
        if "input_features" in parameters:
            batches = []
            for features, frames in audio_feature_options(config, 2, generator):
                batch = {**tokens, "input_features": features.to("meta")}
                batch.update(
                    {name: torch.ones(2, frames, dtype=torch.long) for name in AUDIO_KEYS[1:] if name in parameters}
                )
                batches.append(batch)
            return batches
        if "input_values" in parameters and "input_ids" not in parameters:
            return [{**tokens, "input_values": waveform(config, 2, generator).to("meta")}]
        if "pixel_values_videos" in parameters and "pixel_values" not in parameters:
            videos = video_inputs(model, config, 2, generator)
            return [{**tokens, **{key: value.to("meta") for key, value in videos.items()}}] if videos else []
    except Exception:  # noqa: BLE001 - a config that does not spell its sizes as expected: tokens alone
        return []
    return []
