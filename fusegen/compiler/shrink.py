"""Shrink a Transformers config to a tiny one, generically, for equivalence checks on random weights.

A default config describes a multi-billion-parameter model; verifying a fused class needs the same architecture at a
size that builds in milliseconds. The rules here are keyed on attribute names (Transformers spells the same idea a
handful of ways: `n_embd`, `d_model`, `hidden_size`, ...), so one table serves every model type; `FIXES` holds the few
per-model exceptions a name cannot express.

We start from the config class's own field defaults, not from a built instance: fields left at `None` (`head_dim`,
`layer_types`, ...) are derived in `__post_init__`, so leaving them out lets the config re-derive them from the shrunk
sizes instead of carrying stale full-size values.
"""

from __future__ import annotations

import dataclasses
import functools
import itertools
import math
import re
from collections.abc import Callable
from typing import Any

HIDDEN = 64
HEADS = 4
HEAD_DIM = 16
ROPE_HEAD_DIM = 8
INTERMEDIATE = 128
EXPERT_INTERMEDIATE = 32
EXPERTS = 4
TOP_K = 2
VOCAB = 256
LAYERS = 2
MAX_LAYERS = 4
"""Up to this many layers are kept when that is what it takes to keep one layer of each kind."""
RANK = 16
STATE = 16
WINDOW = 8
"""Sliding windows shorter than the test prompt, so the windowed code path actually masks something."""


class ShrinkError(ValueError):
    """No tiny config could be built; the message says why."""


# --- entry point -----------------------------------------------------------------------------------------------------


def shrunk_config(config_or_class, **overrides):
    """A tiny config of the same class: hidden ~64, 2 layers, 4 heads, vocab 256, 4 experts.

    Accepts a config class or an instance (its non-default values are shrunk too). `overrides` are applied last, as
    keyword arguments to the config class. Raises `ShrinkError` when the shrunk values do not make a valid config.
    """
    from transformers import PreTrainedConfig

    if isinstance(config_or_class, PreTrainedConfig):
        cls, built = type(config_or_class), config_or_class
        values = {**field_defaults(cls), **_instance_values(config_or_class)}
    elif isinstance(config_or_class, type) and issubclass(config_or_class, PreTrainedConfig):
        cls, built = config_or_class, _default_instance(config_or_class)
        values = field_defaults(cls)
    else:
        raise ShrinkError(f"expected a config class or instance, got {config_or_class!r}")
    if built is not None:
        _add_derived_layer_lists(values, built)
        _add_derived_rope(values, built)
        _add_feature_layers(values, built)
        if values.get("image_grid_pinpoints") is None and getattr(built, "image_grid_pinpoints", None):
            values["image_grid_pinpoints"] = [list(p) for p in built.image_grid_pinpoints]  # to rescale, see below
    values = shrink_values(cls, values)
    _fit_feature_layers(values)
    fix = FIXES.get(getattr(cls, "model_type", ""))
    if fix is not None:
        values = fix(values)
    values.update(overrides)
    try:
        return cls(**values)
    except Exception as error:  # any config validation failure is a reason to report
        raise ShrinkError(f"{cls.__name__} rejects the shrunk values: {type(error).__name__}: {error}") from error


def field_defaults(cls) -> dict[str, Any]:
    """The class's own dataclass field defaults (factories called), sub-configs as nested dicts of theirs.

    Fields defaulting to `None` are left out so that `__post_init__` derives them from the shrunk values.
    """
    from transformers import PreTrainedConfig

    base = {field.name for field in dataclasses.fields(PreTrainedConfig)}
    values: dict[str, Any] = {}
    for field in dataclasses.fields(cls):
        if field.name in base and field.name not in ("tie_word_embeddings",):
            continue
        if field.default is not dataclasses.MISSING:
            value = field.default
        elif field.default_factory is not dataclasses.MISSING:
            value = field.default_factory()
        else:
            continue
        if value is not None:
            values[field.name] = _plain(value)
    for key, spec in (getattr(cls, "sub_configs_defaults", None) or {}).items():
        if key == "backbone_config":
            continue
        sub_cls = _sub_config_class(spec, values.get(key))
        if sub_cls is not None:
            kwargs = {name: _with_field_defaults(value) for name, value in dict(spec.init_kwargs).items()}
            values[key] = {**field_defaults(sub_cls), **kwargs, "model_type": sub_cls.model_type}
    return values


def _with_field_defaults(value):
    """A sub-config spec's nested config dict (PI0's `vlm_config` spells its Gemma `text_config` as a dict) over its
    class's field defaults, so the fields it leaves out (Gemma's `head_dim`) are shrunk too, not built at full size."""
    from transformers.models.auto.configuration_auto import CONFIG_MAPPING

    model_type = value.get("model_type") if isinstance(value, dict) else None
    if not isinstance(model_type, str) or model_type not in CONFIG_MAPPING:
        return value
    return {**field_defaults(CONFIG_MAPPING[model_type]), **value}


def _default_instance(cls):
    """The default config, or None when the class cannot build one (its defaults alone are then shrunk)."""
    try:
        return cls()
    except Exception:  # noqa: BLE001 - a broken default is not fatal: the shrunk values may well be valid
        return None


def _add_derived_layer_lists(values: dict[str, Any], built) -> None:
    """Add the per-layer lists `__post_init__` derived (`layer_types` from a pattern, say), at full length.

    Derived lists do not follow the layer count in every config (Zamba's pattern is fixed), and picking layers from
    the full list keeps one layer of each kind, where re-deriving for 2 layers might keep only sliding ones.
    """
    from transformers import PreTrainedConfig

    attributes = {k: v for k, v in vars(built).items() if not k.startswith("_")}
    count = _layer_count(attributes, _canonical_names(type(built)))
    for key, value in attributes.items():
        if isinstance(value, PreTrainedConfig) and isinstance(values.get(key), dict):
            _add_derived_layer_lists(values[key], value)
        elif key not in values and count and count > LAYERS and _is_per_layer(value, count):
            values[key] = list(value)


def _add_derived_rope(values: dict[str, Any], built) -> None:
    """Add the `rope_parameters` `__post_init__` derived, at full size, to each level whose model splits its rotary
    dimension into multimodal sections (`reads_mrope`) and whose values do not spell the sections.

    Cosmos 3 Edge and HY-V4-VL put their sections there, not in a field default, and GLM-4V-MoE its partial rotary
    factor: `_add_mrope_sections` and `_fix_rope` need both to size the tiny sections as the config's own
    validation, and the modeling code's split, demand.
    """
    from transformers import PreTrainedConfig

    for key, value in vars(built).items():
        if isinstance(value, PreTrainedConfig) and isinstance(values.get(key), dict):
            _add_derived_rope(values[key], value)
    derived = getattr(built, "rope_parameters", None)
    rope = values.get("rope_parameters")
    if not isinstance(derived, dict) or not derived or any(isinstance(v, dict) for v in derived.values()):
        return
    if not (rope is None or (isinstance(rope, dict) and "mrope_section" not in rope)):
        return
    if "mrope_section" in derived or reads_mrope(type(built)):
        values["rope_parameters"] = {**derived, **(rope or {})}


FEATURE_LAYERS = ("vision_feature_layer", "vision_feature_layers")
"""Fields of a composite config's sub-configs that index the vision tower's layers (whose features feed the
projector), not the layers of their own level."""


def _feature_layer_levels(values: dict[str, Any]):
    """This level and its sub-config dicts: where a feature-layer field may sit (Molmo 2: `adapter_config`)."""
    yield None, values
    for key, value in values.items():
        if isinstance(value, dict) and key != "vision_config":
            yield key, value


def _add_feature_layers(values: dict[str, Any], built) -> None:
    """Add the vision feature layers `__post_init__` derived (Molmo 2's adapter sets `[24, 18]`), so that
    `_fit_feature_layers` can make them index the tiny tower."""
    for key, level in _feature_layer_levels(values):
        source = built if key is None else getattr(built, key, None)
        for name in FEATURE_LAYERS:
            value = getattr(source, name, None)
            if name not in level and (_is_int(value) or isinstance(value, (list, tuple))):
                level[name] = list(value) if isinstance(value, (list, tuple)) else value


def _fit_feature_layers(values: dict[str, Any]) -> None:
    """Vision feature layers out of the shrunk tower's range made to index it: distinct layers stay distinct (their
    features are concatenated, so their number sizes the projector), deepest first from the last layer down, and
    layers already in range are kept (LLaVA's -2)."""
    vision = values.get("vision_config")
    count = vision.get("num_hidden_layers") if isinstance(vision, dict) else None
    if not _is_int(count) or count <= 0:
        return
    for _, level in _feature_layer_levels(values):
        for name in FEATURE_LAYERS:
            value = level.get(name)
            layers = [value] if _is_int(value) else value
            if not isinstance(layers, (list, tuple)) or not all(_is_int(v) for v in layers):
                continue
            if all(-count <= v < count for v in layers):
                continue
            order = sorted(set(layers), reverse=True)
            new = {old: max(count - 1 - i, 0) for i, old in enumerate(order)}
            level[name] = new[value] if _is_int(value) else type(layers)(new[v] for v in layers)


def _instance_values(config) -> dict[str, Any]:
    """The values an instance holds that differ from its class defaults (sub-configs as dicts)."""
    diff = config.to_diff_dict()
    for key in ("transformers_version", "architectures", "model_type"):
        diff.pop(key, None)
    return diff


def _plain(value):
    """Configs stored as field defaults become dicts, so every level can be shrunk the same way."""
    from transformers import PreTrainedConfig

    if isinstance(value, PreTrainedConfig):
        return {**field_defaults(type(value)), **_instance_values(value), "model_type": type(value).model_type}
    return value


def _sub_config_class(spec, current) -> type | None:
    """The config class a sub-config spec builds (resolving `AutoConfig` specs through their model type)."""
    from transformers import PreTrainedConfig

    if isinstance(spec.config_class, type) and issubclass(spec.config_class, PreTrainedConfig):
        return spec.config_class
    model_type = (current or {}).get("model_type", spec.model_type) if isinstance(current, dict) else spec.model_type
    try:
        return spec.get_config_class(model_type)
    except ValueError:
        return None


# --- one config level ------------------------------------------------------------------------------------------------


def shrink_values(cls, values: dict[str, Any]) -> dict[str, Any]:
    """Shrink one config level's keyword arguments (sub-configs recursively)."""
    names = _canonical_names(cls)
    values = dict(values)
    tile = _tile(values)
    for key, value in list(values.items()):
        sub_cls = _nested_config_class(cls, key, value)
        if sub_cls is not None:
            values[key] = {**shrink_values(sub_cls, value), "model_type": value.get("model_type", sub_cls.model_type)}
    _shrink_layers(values, names)
    before = {key: value for key, value in values.items() if _is_int(value)}
    for key, value in list(values.items()):
        rule = rule_for(names.get(key, key))
        if rule is not None:
            values[key] = _apply(rule, key, value, before, names)
    _fix_derived(values, names, before)
    _fill_unset_heads(cls, values, names)
    _add_mrope_sections(cls, values, names)
    _fix_rope(values, names)
    _fix_token_ids(values, names)
    _fix_image(values)
    _fix_pinpoints(values, tile)
    return values


IMAGE_PATCHES = 4
"""Patches per side of a tiny vision tower's image: divisible by every pixel-shuffle or merge factor of the vision
models (2 for Mistral 3, InternVL and the Qwen-VL merger, 4 for SmolVLM), so one image yields a few whole tokens."""


def _fix_image(values: dict[str, Any]) -> None:
    """A vision level's `image_size` as `IMAGE_PATCHES` patches a side (a full-size 896-pixel image is thousands of
    tokens), and Gemma 3's pooled `mm_tokens_per_image` as a square those patches pool into evenly."""
    patch, size = values.get("patch_size"), values.get("image_size")
    if isinstance(patch, (list, tuple)) and patch and all(_is_int(p) for p in patch):
        new = [p * IMAGE_PATCHES for p in patch]
        if isinstance(size, (list, tuple)):
            values["image_size"] = new[: len(size)] if len(size) <= len(new) else [new[0]] * len(size)
        elif _is_int(size):
            values["image_size"] = new[0]
    elif _is_int(patch) and _is_int(size):
        values["image_size"] = patch * IMAGE_PATCHES
    elif _is_int(patch) and isinstance(size, (list, tuple)) and all(_is_int(s) for s in size):
        values["image_size"] = [patch * IMAGE_PATCHES] * len(size)
    tubelet = values.get("tubelet_size")
    if patch is None and isinstance(tubelet, (list, tuple)) and len(tubelet) == 3 and all(map(_is_int, tubelet)):
        # a video tower's (frames, height, width) patch (VideoPrism): IMAGE_PATCHES a side, two tubelets of frames
        if _is_int(size):
            values["image_size"] = tubelet[1] * IMAGE_PATCHES
        if _is_int(values.get("num_frames")):
            values["num_frames"] = tubelet[0] * 2
    if _is_int(values.get("mm_tokens_per_image")):
        values["mm_tokens_per_image"] = (IMAGE_PATCHES // 2) ** 2


def _tile(values: dict[str, Any]) -> int | None:
    """The square image size of this level's vision sub-config (`vision_config.image_size`), if it spells one."""
    vision = values.get("vision_config")
    size = vision.get("image_size") if isinstance(vision, dict) else None
    if isinstance(size, (list, tuple)) and len(set(size)) == 1:
        size = size[0]
    return size if _is_int(size) and size > 0 else None


def _fix_pinpoints(values: dict[str, Any], old_tile: int | None) -> None:
    """Any-resolution grids (LLaVA-NeXT, LLaVA-OneVision: `image_grid_pinpoints`) rescaled with the vision tile.

    Each pinpoint is a resolution `(height, width)` cut into tiles of the vision tower's `image_size` (the modeling
    code counts `ceil(height / image_size) * ceil(width / image_size)` tiles). Shrinking the tower's image size alone
    leaves pinpoints of hundreds of tiles; rescaling each side as the same number of tiles of the new size keeps
    every grid's tile layout (1x2, 2x2, ...), and so the code paths a real image takes, at a tiny size.
    """
    pinpoints, new_tile = values.get("image_grid_pinpoints"), _tile(values)
    if old_tile is None or new_tile is None or not isinstance(pinpoints, (list, tuple)):
        return
    if not all(isinstance(p, (list, tuple)) and len(p) == 2 and all(_is_int(s) for s in p) for p in pinpoints):
        return
    rescaled = [[max(1, round(side / old_tile)) * new_tile for side in point] for point in pinpoints]
    values["image_grid_pinpoints"] = [list(p) for p in dict.fromkeys(tuple(p) for p in rescaled)]


def _canonical_names(cls) -> dict[str, str]:
    """Field name -> the standard name it is an alias of (`n_embd` -> `hidden_size`), via `attribute_map`.

    Only aliases of the standard names count: `attribute_map` also maps legacy names onto standard fields (XLNet's
    `n_token` -> `vocab_size`), and those must not rename the field.
    """
    mapping = getattr(cls, "attribute_map", {}) or {}
    return {field: standard for standard, field in mapping.items() if standard in _STANDARD_NAMES}


_STANDARD_NAMES = ("hidden_size", "num_attention_heads", "num_hidden_layers", "num_key_value_heads", "vocab_size")


def _nested_config_class(cls, key: str, value) -> type | None:
    """The config class of a sub-config given as a dict (declared sub-config, or a dict with a known `model_type`)."""
    if not isinstance(value, dict):
        return None
    spec = (getattr(cls, "sub_configs_defaults", None) or {}).get(key)
    if spec is not None:
        return _sub_config_class(spec, value)
    model_type = value.get("model_type")
    if isinstance(model_type, str):
        from transformers.models.auto.configuration_auto import CONFIG_MAPPING

        if model_type in CONFIG_MAPPING:
            return CONFIG_MAPPING[model_type]
        return _config_class_by_model_type(cls, model_type)
    return None


def _config_class_by_model_type(cls, model_type: str) -> type | None:
    """A config class defined next to `cls` (e.g. `DbrxAttentionConfig`) whose `model_type` matches."""
    import sys

    from transformers import PreTrainedConfig

    module = sys.modules.get(cls.__module__)
    for candidate in vars(module).values() if module else ():
        if (
            isinstance(candidate, type)
            and issubclass(candidate, PreTrainedConfig)
            and getattr(candidate, "model_type", None) == model_type
        ):
            return candidate
    return None


def _is_int(value) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


# --- layers ----------------------------------------------------------------------------------------------------------

_LAYER_COUNT = re.compile(
    r"^(num_hidden_layers|num_layers|n_layers?|decoder_layers|encoder_layers|num_decoder_layers)$"
)
_INDEX_HINT = re.compile(r"(layers|layer_ids|layer_idx|idxs|indices|layer_indices)$")


def _layer_count(values: dict[str, Any], names: dict[str, str]) -> int | None:
    """The number of decoder layers this level declares (its count field, or the length of `layer_types`)."""
    for key, value in values.items():
        if names.get(key, key) == "num_hidden_layers" and _is_int(value):
            return value
    for key, value in values.items():
        if _LAYER_COUNT.match(key) and _is_int(value):
            return value
    layer_types = values.get("layer_types")
    return len(layer_types) if isinstance(layer_types, (list, tuple)) else None


def _is_index_list(key: str, value, count: int) -> bool:
    """A strictly increasing list of layer indices (`mlp_only_layers`, `moe_layers`, `full_attn_idxs`, ...)."""
    return (
        isinstance(value, (list, tuple))
        and bool(_INDEX_HINT.search(key))
        and all(_is_int(v) and 0 <= v < count for v in value)
        and all(a < b for a, b in itertools.pairwise(value))
    )


def _is_per_layer(value, count: int) -> bool:
    return isinstance(value, (list, tuple)) and len(value) == count and count > 0


def _shrink_layers(values: dict[str, Any], names: dict[str, str]) -> None:
    """Keep a few layers, one of each kind, and make every per-layer list and index list agree with them.

    A layer's kind is its entry in every per-layer list (`layer_types`, `mlp_layer_types`, ...) plus its membership of
    every index list (`mlp_only_layers`, ...): keeping the first layer of each kind keeps e.g. one sliding and one
    full attention layer, so each fused class is built and exercised.
    """
    count = _layer_count(values, names)
    if not count:
        return
    index_lists = {k: v for k, v in values.items() if _is_index_list(k, v, count) and not _is_per_layer_name(k)}
    per_layer = {k: v for k, v in values.items() if k not in index_lists and _is_per_layer(v, count)}
    kept = _pick_layers(count, per_layer, index_lists)
    for key, value in per_layer.items():
        values[key] = type(value)(value[i] for i in kept)
    for key, value in index_lists.items():
        members = set(value)
        values[key] = type(value)(new for new, old in enumerate(kept) if old in members)
    for key, value in values.items():
        if (_LAYER_COUNT.match(key) or names.get(key) == "num_hidden_layers") and _is_int(value) and value == count:
            values[key] = len(kept)


def _is_per_layer_name(key: str) -> bool:
    """Names that hold one entry per layer even when those entries look like indices (`no_rope_layers` flags)."""
    return key in ("no_rope_layers",) or key.endswith("_types")


def _pick_layers(count: int, per_layer: dict[str, Any], index_lists: dict[str, Any]) -> list[int]:
    """The first layer of each distinct kind (up to `MAX_LAYERS`), topped up to `LAYERS` with the earliest others."""

    def kind(i: int) -> tuple:
        return tuple(repr(v[i]) for v in per_layer.values()) + tuple(i in v for v in index_lists.values())

    kept: list[int] = []
    seen: set[tuple] = set()
    for i in range(count):
        if kind(i) not in seen and len(kept) < MAX_LAYERS:
            seen.add(kind(i))
            kept.append(i)
    for i in range(count):
        if len(kept) >= min(LAYERS, count):
            break
        if i not in kept:
            kept.append(i)
    return sorted(kept)


# --- scalar rules ----------------------------------------------------------------------------------------------------

Rule = Callable[[int], int]


def _cap(limit: int) -> Rule:
    """For counters measured in layers (periods, offsets): small enough that the kept layers still show the pattern."""
    return lambda old: min(old, limit)


def _to(value: int) -> Rule:
    """Shrink to `value`; values already smaller are kept (zero, "off", is never passed to a rule)."""
    return lambda old: min(old, value)


_KV_HEADS = "kv-heads"
_DERIVED = "derived"

# (regex on the canonical attribute name, rule). First match wins; applied to positive ints only.
RULES: list[tuple[re.Pattern, Any]] = [
    (re.compile(p), r)
    for p, r in [
        # structure counters that must stay below the new layer count
        (
            r"^(first_k_dense_replace|num_dense_layers|moe_layer_start_index|expert_layer_offset|attn_layer_offset)$",
            _cap(1),
        ),
        (
            (
                r"^(sliding_window_pattern|global_attn_every_n_layers|no_rope_layer_interval|attn_layer_period"
                r"|expert_layer_period|layer_group_size|decoder_sparse_step|moe_layer_interval|interleave_moe_layer_step)$"
            ),
            _cap(2),
        ),
        (r"^(num_kv_shared_layers|n_recurrent_layers|max_window_layers)$", _cap(1)),
        (r"^moe_layer_end_index$", _cap(LAYERS - 1)),
        # attention heads
        (
            r"(key_value_heads|kv_heads|^kv_n_heads|num_query_groups|multi_query_group_num|linear_num_key_heads)$",
            _KV_HEADS,
        ),
        (
            (
                r"(attention_heads|^n_heads?|^num_heads|_n_heads|_num_heads|linear_num_value_heads|linear_num_heads"
                r"|index_n_heads|heads_per_ngram)$"
            ),
            _to(HEADS),
        ),
        (r"(^|_)qk_rope_head_dim$|^rotary_dim$", _to(ROPE_HEAD_DIM)),
        (r"^qk_head_dim$", _DERIVED),
        (
            (
                r"(head_dim|^d_head|^d_kv$|^dim_head|^kv_channels|attention_head_size|^mamba_d_head|^mamba_head_dim"
                r"|^mamba_headdim)$"
            ),
            _to(HEAD_DIM),
        ),
        # low-rank projections
        (r"(lora_rank|_rank$|^hc_lowrank$|^o_groups$)", _to(RANK)),
        # experts
        (r"^(num_experts|num_local_experts|n_routed_experts|moe_num_experts|num_experts_total)$", _to(EXPERTS)),
        (
            r"^(num_experts_per_tok|num_experts_per_token|moe_k|moe_top_k|moe_topk|top_k|num_selected_experts)$",
            _to(TOP_K),
        ),
        (r"^(n_shared_experts|num_shared_experts|moe_num_shared_experts)$", _to(1)),
        (r"^(n_group|num_expert_group)$", _to(2)),
        (r"^topk_group$", _to(1)),
        (r"^zero_expert_num$", _to(2)),
        # feed-forward widths
        (
            (
                r"(moe|expert).*(intermediate|ffn|hidden)_size|(intermediate|ffn)_size.*(moe|expert)"
                r"|^shared_expert.*intermediate_size$|^shared_experts_intermediate_size$|^expert_ffn_hidden_size$"
            ),
            _to(EXPERT_INTERMEDIATE),
        ),
        (
            (
                r"(intermediate_size|^ffn_dim$|ffn_dim$|^d_ff$|^n_inner$|^dff$|^dim_ff$|ffn_hidden_size$|^d_inner$"
                r"|^feed_forward_size$|^mlp_dim$|^intermediate_size_mlp$)"
            ),
            _to(INTERMEDIATE),
        ),
        # widths of the residual stream
        (
            (
                r"(^|_)(hidden_size|d_model|n_embd|embed_dim|emb_dim|embedding_dim|embedding_size|word_embed_proj_dim"
                r"|lru_width|attention_hidden_size|hidden_size_global|backbone_hidden_size|input_embedding_size"
                r"|output_embedding_size|ple_embed_dim|adapter_in_dim|adapter_out_dim|adapter_input_size|projection_dim"
                r"|output_dim)$"
            ),
            _to(HIDDEN),
        ),
        (r"^hidden_size_per_layer_input$", _to(RANK)),
        # state-space and linear-attention mixers
        (r"^(mamba_d_state|ssm_state_size|state_size|mamba_d_ssm_state)$", _to(STATE)),
        (r"^(mamba_n_heads|mamba_num_heads)$", _DERIVED),
        (r"^mamba_d_ssm$", _DERIVED),
        (r"^(time_step_rank|mamba_dt_rank)$", _to(8)),
        (r"^(mamba_n_groups|mamba_ngroups|n_groups)$", _to(1)),
        # convolutional audio codecs (VibeVoice's tokenizers, EnCodec, Mimi): the base channel count, doubled at each
        # downsampling stage, and the blocks per stage (7 stages of up to 8 blocks reach 2048 channels and 343M
        # parameters per tokenizer at the defaults, which no tiny check can afford)
        (r"^num_filters$", _to(4)),
        (r"^depths$", _to(2)),
        # audio frames an encoder reads (Whisper's input is twice as many mel frames)
        (r"^max_source_positions$", _to(16)),
        # vocabularies and windows
        (r"vocab_size|_vocab$", _to(VOCAB)),
        (
            (
                r"^(sliding_window|sliding_window_size|attention_window_size|local_attention|attention_chunk_size"
                r"|local_attention_window_len)$"
            ),
            _to(WINDOW),
        ),
    ]
]


def rule_for(name: str):
    for pattern, rule in RULES:
        if pattern.search(name):
            return rule
    return None


def _apply(rule, key: str, value, before: dict[str, Any], names: dict[str, str]):
    """Apply one rule to an int, or element-wise to a per-layer list of ints."""
    if isinstance(value, (list, tuple)) and value and all(_is_int(v) for v in value) and rule not in (_KV_HEADS,):
        if rule is _DERIVED:
            return value
        return type(value)(rule(v) if v > 0 else v for v in value)
    if not _is_int(value) or value <= 0 or rule is _DERIVED:
        return value
    if rule is _KV_HEADS:
        return _kv_heads(key, value, before, names)
    return rule(value)


def _kv_heads(key: str, old_kv: int, before: dict[str, Any], names: dict[str, str]) -> int:
    """Keep the attention kind: MHA stays MHA (kv == heads), MQA stays 1, GQA becomes 2 kv heads for 4 heads."""
    old_heads = before.get(_heads_key_for(key, before, names))
    if old_kv == 1:
        return 1
    if old_heads is None or old_kv >= old_heads:
        return HEADS if old_heads is None or old_heads >= HEADS else old_heads
    return 2


def _heads_key_for(kv_key: str, values: dict[str, Any], names: dict[str, str]) -> str | None:
    """The query-heads attribute a kv-heads attribute pairs with (`swa_num_key_value_heads` -> `swa_num_attention_heads`)."""
    for old, new in (
        ("key_value_heads", "attention_heads"),
        ("kv_heads", "heads"),
        ("kv_n_heads", "n_heads"),
        ("num_key_heads", "num_value_heads"),
        ("query_groups", "attention_heads"),
    ):
        if old in kv_key and kv_key.replace(old, new) in values:
            return kv_key.replace(old, new)
    for key in values:
        if names.get(key, key) == "num_attention_heads":
            return key
    return None


# --- values derived from others --------------------------------------------------------------------------------------


def _fix_derived(values: dict[str, Any], names: dict[str, str], before: dict[str, Any]) -> None:
    """Fields that must equal a combination of others (MLA's qk head dim, Mamba-2's head count and width).

    `before` holds the full-size values: a `head_dim` that equalled `qk_rope_head_dim` there is the rotary width
    (LongCat sizes its rotary embedding by it), so it must stay equal.
    """
    if _is_int(values.get("qk_head_dim")) and _is_int(values.get("qk_nope_head_dim")):
        values["qk_head_dim"] = values["qk_nope_head_dim"] + values.get("qk_rope_head_dim", 0)
    if _is_int(before.get("head_dim")) and before.get("head_dim") == before.get("qk_rope_head_dim"):
        values["head_dim"] = values["qk_rope_head_dim"]
    _fix_widths(values, names, before)
    hidden = next((v for k, v in values.items() if names.get(k, k) == "hidden_size" and _is_int(v)), HIDDEN)
    expand = values.get("mamba_expand", values.get("expand", 2))
    mamba_head = next((values[k] for k in ("mamba_d_head", "mamba_head_dim", "mamba_headdim") if k in values), None)
    if not _is_int(expand) or not _is_int(mamba_head) or mamba_head <= 0:
        mamba_head = None
    for key in ("mamba_n_heads", "mamba_num_heads"):
        if _is_int(values.get(key)) and mamba_head:
            values[key] = max(1, expand * hidden // mamba_head)
    if _is_int(values.get("mamba_d_ssm")) and _is_int(expand):
        values["mamba_d_ssm"] = expand * hidden


def _fix_widths(values: dict[str, Any], names: dict[str, str], before: dict[str, Any]) -> None:
    """A `*_dim` field no rule shrinks that equalled the level's hidden size at full size follows it down.

    WavTokenizer (Apertus 1.5's audio tokenizer) quantises its hidden states directly, so its config demands
    `codebook_dim == hidden_size`; the equality at full size is the relation the architecture relies on.
    """
    key = next((k for k, v in values.items() if names.get(k, k) == "hidden_size" and _is_int(v)), None)
    if key is None or not _is_int(before.get(key)):
        return
    for name, value in list(values.items()):
        if not name.endswith("_dim") or rule_for(names.get(name, name)) is not None or not _is_int(value):
            continue
        if value == before.get(name) == before[key] != values[key]:
            values[name] = values[key]


def _fill_unset_heads(cls, values: dict[str, Any], names: dict[str, str]) -> None:
    """Set `head_dim` and `num_key_value_heads` when the class declares them but leaves them `None`.

    Several modeling files read them with `getattr(config, "head_dim", hidden // heads)` or use them directly, and
    get `None` rather than the fallback; explicit values equal to the usual fallbacks are what they mean.
    """
    declared = {field.name: field.default for field in dataclasses.fields(cls)}
    if "head_dim" not in declared or declared["head_dim"] is not None or values.get("head_dim") is not None:
        return
    if any(names.get(k, k) == "num_attention_heads" for k in values):
        values["head_dim"] = _new_head_dim(values, names)
    heads = next((k for k in values if names.get(k, k) == "num_attention_heads"), None)
    if declared.get("num_key_value_heads", 0) is None and "num_key_value_heads" not in values and heads:
        values["num_key_value_heads"] = values[heads]


def _add_mrope_sections(cls, values: dict[str, Any], names: dict[str, str]) -> None:
    """Give a text config whose model splits its rotary dimension into multimodal sections (`reads_mrope`), and
    whose flat `rope_parameters` (the field's default or `_add_derived_rope`'s) leave them unset, full-size sections
    for `_fix_rope` to rescale.

    The modeling code then falls back to a full-size default (`.get("mrope_section", [8, 12, 12])`: GLM-4V,
    PaddleOCR-VL, Qwen2-VL), which a tiny rotary dimension cannot split, or has none (HunYuanVL's image positions
    need at least three axes); released checkpoints spell the sections out. The default's proportions are kept
    (three equal sections without one). Any split summing to the rotary half is one the model is built for, so the
    tiny model computes what such a checkpoint does. Where the tiny rotary half is too narrow for three sections
    (Qwen3.5's quarter-width rotation) nothing is added: the model keeps its own fallback, as before.
    """
    rope = values.get("rope_parameters")
    if not isinstance(rope, dict) or not rope or "mrope_section" in rope:  # none: left to the config, see above
        return
    if any(isinstance(v, dict) for v in rope.values()) or not reads_mrope(cls):
        return
    base = dict(rope)
    factor = base.get("partial_rotary_factor", values.get("partial_rotary_factor", 1.0))
    factor = factor if isinstance(factor, (int, float)) and not isinstance(factor, bool) else 1.0
    if factor != 1.0:  # the dict's own factor is what `_fix_rope` reads
        base["partial_rotary_factor"] = factor
    rotary = values.get("qk_rope_head_dim") if _is_int(values.get("qk_rope_head_dim")) else None
    half = (rotary if rotary is not None else int(_new_head_dim(values, names) * factor)) // 2
    sections = _modeling_mrope_default(cls) or [1, 1, 1]
    if half >= len(sections):
        values["rope_parameters"] = {**base, "mrope_section": list(sections)}


def reads_mrope(cls) -> bool:
    """Whether config class `cls`'s model splits its rotary dimension into multimodal sections: the config lists
    `mrope_section` among the rope keys it validates itself, or it is no tower's config (the text model's, or a
    top level) and its modeling module falls back to default sections."""
    declared = "mrope_section" in (getattr(cls, "ignore_keys_at_rope_validation", None) or ())
    if declared:
        return True
    tower = getattr(cls, "base_config_key", "") not in ("", "text_config")  # a vision or audio tower's own rope
    return not tower and _modeling_mrope_default(cls) is not None


_MROPE_DEFAULT = re.compile(r"\.get\(\s*[\"']mrope_section[\"']\s*,\s*\[([\d\s,]+)\]\s*\)")


@functools.cache
def _modeling_mrope_default(cls) -> tuple[int, ...] | None:
    """The full-size sections the modeling module next to config class `cls` falls back to, or None."""
    import importlib
    import inspect

    name = cls.__module__.replace(".configuration_", ".modeling_")
    if name == cls.__module__:
        return None
    try:
        source = inspect.getsource(importlib.import_module(name))
    except Exception:  # noqa: BLE001 - no modeling module (or one that cannot import here): no default known
        return None
    found = _MROPE_DEFAULT.search(source)
    return tuple(int(s) for s in found.group(1).split(",") if s.strip()) if found else None


def _fix_rope(values: dict[str, Any], names: dict[str, str]) -> None:
    """RoPE fields sized by the rotary dimension: `mrope_section`, LongRoPE factors, partial rotary factors.

    Multi-head latent attention rotates only `qk_rope_head_dim` of each head (HY-V4-VL's sections split that)."""
    head_dim = _new_head_dim(values, names)
    rotary = values.get("qk_rope_head_dim") if _is_int(values.get("qk_rope_head_dim")) else None
    for key, value in list(values.items()):
        if isinstance(value, dict) and ("rope" in key or "rope_type" in value):
            values[key] = _shrink_rope_dict(value, head_dim, rotary)
    factor = values.get("partial_rotary_factor")
    if isinstance(factor, float) and int(head_dim * factor) % 2:
        values["partial_rotary_factor"] = 0.5


def _new_head_dim(values: dict[str, Any], names: dict[str, str]) -> int:
    head_dim = values.get("head_dim")
    if _is_int(head_dim):
        return head_dim
    hidden = next((v for k, v in values.items() if names.get(k, k) == "hidden_size" and _is_int(v)), HIDDEN)
    heads = next((v for k, v in values.items() if names.get(k, k) == "num_attention_heads" and _is_int(v)), HEADS)
    return max(hidden // max(heads, 1), 2)


def _shrink_rope_dict(rope: dict, head_dim: int, rotary: int | None = None) -> dict:
    """One RoPE parameter dict (or a dict of them per layer type) with head-dim-sized fields made to fit;
    `rotary`: the rotated width where it is not the head dim (MLA's `qk_rope_head_dim`), for the mrope sections."""
    if all(isinstance(v, dict) for v in rope.values()) and rope:
        return {k: _shrink_rope_dict(v, head_dim, rotary) for k, v in rope.items()}
    rope = dict(rope)
    factor = rope.get("partial_rotary_factor", 1.0)
    if isinstance(factor, (int, float)) and int(head_dim * factor) % 2:
        rope["partial_rotary_factor"] = factor = 0.5
    half = max(int(head_dim * (factor if isinstance(factor, (int, float)) else 1.0)) // 2, 1)
    for key in ("mrope_section", "mrope_sections"):
        if isinstance(rope.get(key), (list, tuple)):
            rope[key] = _split_proportionally(list(rope[key]), half if rotary is None else max(rotary // 2, 1))
    for key in ("short_factor", "long_factor"):
        if isinstance(rope.get(key), (list, tuple)) and len(rope[key]) > half:
            rope[key] = list(rope[key])[:half]
    return rope


def _split_proportionally(sections: list[int], total: int) -> list[int]:
    """`sections` rescaled to sum to `total`, each at least 1 (`[16, 24, 24]` -> `[2, 3, 3]` for 8)."""
    if total < len(sections):
        raise ShrinkError(f"cannot split a rotary half-dimension of {total} into {len(sections)} mrope sections")
    old = sum(sections) or 1
    new = [max(1, math.floor(s * total / old)) for s in sections]
    i = 0
    while sum(new) != total:
        step = 1 if sum(new) < total else -1
        j = i % len(new) if step > 0 else (len(new) - 1 - i % len(new))
        if new[j] + step >= 1:
            new[j] += step
        i += 1
    return new


def _fix_token_ids(values: dict[str, Any], names: dict[str, str]) -> None:
    """Special token ids beyond the new vocabulary become distinct ids at its top (255, 254, ...)."""
    vocab = next((v for k, v in values.items() if names.get(k, k) == "vocab_size" and _is_int(v)), None)
    if vocab is None and isinstance(values.get("text_config"), dict):
        vocab = values["text_config"].get("vocab_size")
    vocab = vocab if _is_int(vocab) else VOCAB
    remapped: dict[int, int] = {}

    def fit(token):
        if not _is_int(token) or 0 <= token < vocab:
            return token
        return remapped.setdefault(token, vocab - 1 - len(remapped))

    for key, value in list(values.items()):
        if re.search(r"(token_id|token_ids|token_index|_index$|_id$)", names.get(key, key)) and key != "layer_idx":
            if isinstance(value, (list, tuple)):
                values[key] = type(value)(fit(v) for v in value)
            else:
                values[key] = fit(value)


# --- per-model fixes -------------------------------------------------------------------------------------------------


def _gpt_neo(values: dict[str, Any]) -> dict[str, Any]:
    """GPT-Neo encodes its layers as `[[pattern, repeats]]`: one global and one local layer."""
    values["attention_types"] = [[["global", "local"], 1]]
    values["window_size"] = WINDOW
    return values


def _set(**fixed) -> Callable[[dict[str, Any]], dict[str, Any]]:
    """A fix that sets the given values."""
    return lambda values: {**values, **fixed}


def _align(values: dict[str, Any]) -> dict[str, Any]:
    """ALIGN compares the text projection with the EfficientNet tower's pooled output, which is not projected: its
    width, the last block's `out_channels` times `width_coefficient` rounded to `depth_divisor` (as the tower's
    `round_filters` does), must be `projection_dim`. And a 64-pixel image (the tower's strides divide it by 32)
    rather than the default 600."""
    from transformers import AlignVisionConfig

    vision = {
        **{k: getattr(AlignVisionConfig(), k) for k in ("out_channels", "width_coefficient", "depth_divisor")},
        **values.get("vision_config", {}),
    }
    divisor, channels = vision["depth_divisor"], vision["out_channels"][-1] * vision["width_coefficient"]
    width = max(divisor, int(channels + divisor / 2) // divisor * divisor)
    width += divisor if width < 0.9 * channels else 0
    return {
        **values,
        "projection_dim": int(width),
        "vision_config": {**values.get("vision_config", {}), "image_size": 64},
    }


def _fun_asr_nano(values: dict[str, Any]) -> dict[str, Any]:
    """Fun-ASR-Nano's config requires `adaptor_config.intermediate_size == text_config.hidden_size // 4`."""
    adaptor = {**values.get("adaptor_config", {}), "intermediate_size": values["text_config"]["hidden_size"] // 4}
    return {**values, "adaptor_config": adaptor}


def _mamba2(values: dict[str, Any]) -> dict[str, Any]:
    """Mamba-2 requires `num_heads * head_dim == expand * hidden_size`."""
    values["num_heads"] = values.get("expand", 2) * values["hidden_size"] // values["head_dim"]
    return values


_QWEN4_EXP_INDEXER = {
    "indexer_n_heads": HEADS,
    "indexer_kv_heads": 1,
    "indexer_head_dim": HEAD_DIM,
    "indexer_budget": WINDOW,
    "indexer_compress_ratio": 2,
}

_ASSISTANT_CENTROIDS = {"num_centroids": 16, "centroid_intermediate_top_k": 4}
"""The Gemma 4 assistants' ordered embeddings split the vocabulary into `num_centroids` clusters (2048 by default,
more than the tiny vocabulary has tokens)."""

_DOTS3_SWA = {
    "swa_num_attention_heads": HEADS,
    "swa_num_key_value_heads": HEADS,
    "swa_q_lora_rank": RANK,
    "swa_kv_lora_rank": RANK,
    "swa_head_dim": HEAD_DIM + ROPE_HEAD_DIM,
    "swa_qk_nope_head_dim": HEAD_DIM,
    "swa_v_head_dim": HEAD_DIM,
}


def _apertus1p5(values: dict[str, Any]) -> dict[str, Any]:
    """Apertus 1.5 reads images and audio as discrete codes inside the text vocabulary: the image codebook's range
    starts at `image_token_offset` and ends where the audio codebook's begins, and both must fit the vocabulary.
    Tiny codebooks laid out after the text ids of the tiny vocabulary (the placeholder ids sit at its top)."""
    codes = VOCAB // 8
    return {
        **values,
        "vision_config": {**values["vision_config"], "codebook_size": codes},
        "audio_config": {**values["audio_config"], "codebook_size": codes},
        "image_token_offset": VOCAB // 2,
        "audio_token_offset": VOCAB // 2 + codes,
    }


FIXES: dict[str, Callable[[dict[str, Any]], dict[str, Any]]] = {
    "apertus1p5": _apertus1p5,
    # the thinker's rope index reads `vision_start_token_id` on every forward, which its config class does not define
    # (the composite Qwen2.5-Omni config does): ids of the tiny vocabulary below the remapped special ones
    "qwen2_5_omni_thinker": _set(vision_start_token_id=VOCAB - 8, vision_end_token_id=VOCAB - 9),
    "gpt_neo": _gpt_neo,
    "mamba2": _mamba2,
    "align": _align,
    "fun_asr_nano": _fun_asr_nano,
    # the default leaves the audio placeholder unset (released checkpoints set it): without it no audio is read
    "voxtral": _set(audio_token_id=VOCAB - 1),
    # the decoder reads `num_key_value_heads`, which the config class never defines (its encoder's default is MHA)
    "moonshine_streaming": _set(num_key_value_heads=HEADS),
    # attention layers are listed explicitly, and the default lists none
    "bamba": _set(attn_layer_indices=[1]),
    # a repeating block pattern, not one entry per layer: keep one recurrent block and the attention block
    "recurrent_gemma": _set(block_types=["recurrent", "attention"]),
    # the shared transformer is tied across hybrid layers, so it needs two of them
    "zamba": _set(layers_block_type=["linear_attention", "hybrid", "hybrid"], num_hidden_layers=3),
    # the default leaves the router's top-k unset (its forward then fails on `topk(k=None)`)
    "deepseek_v2": _set(num_experts_per_tok=TOP_K),
    # language adapters: the forward refuses to run without a default language
    "xmod": _set(default_language="en_XX"),
    # defaults the modeling code cannot build from (unset fields it reads unconditionally)
    "dots1": _set(n_routed_experts=EXPERTS, num_experts_per_tok=TOP_K, n_shared_experts=1),
    "lfm2_moe": _set(layer_types=["conv", "full_attention"], num_dense_layers=1),
    "qwen4_exp_text": _set(**_QWEN4_EXP_INDEXER),
    "qwen4_exp": lambda values: {**values, "text_config": {**values["text_config"], **_QWEN4_EXP_INDEXER}},
    # DBRX's attention reads `attn_config.rope_theta`, which DbrxAttentionConfig does not define, and clamps q/k/v
    # with `clip_qkv`, which fails when it is None (the default); released checkpoints set both. The sub-configs are
    # not shrunk by the generic rules (they default to None), so their sizes are set here too: GQA, 4 experts, top 2.
    "dbrx": _set(
        attn_config={"kv_n_heads": 2, "clip_qkv": 8.0, "rope_theta": 10000.0},
        ffn_config={"ffn_hidden_size": EXPERT_INTERMEDIATE, "moe_num_experts": EXPERTS, "moe_top_k": TOP_K},
    ),
    # the cross-attention layers are listed by index at full depth ([3, 8, ...]): keep one among the two tiny layers
    "mllama": lambda values: {**values, "text_config": {**values["text_config"], "cross_attention_layers": [1]}},
    # the rotary embedding reads `rope_parameters[layer_type]` per layer type, and the default leaves the dict empty
    "cohere_compass_text": _set(
        rope_parameters={
            "full_attention": {"rope_type": "default", "rope_theta": 10000.0},
            "sliding_attention": {"rope_type": "default", "rope_theta": 10000.0},
        }
    ),
    # sliding-window layers take their (full-size) MLA shape from `swa_*` arguments, not from the shrunk fields
    "dots3_note_text": _set(**_DOTS3_SWA),
    "dots3_note": lambda values: {**values, "text_config": {**values["text_config"], **_DOTS3_SWA}},
    "reformer": _set(is_decoder=True, axial_pos_embds_dim=[HIDDEN // 2, HIDDEN // 2]),
    "gemma4_assistant": lambda values: {
        **values,
        "text_config": {**values["text_config"], "hidden_size_per_layer_input": 0, "vocab_size_per_layer_input": 0},
        **_ASSISTANT_CENTROIDS,
    },
    "gemma4_unified_assistant": _set(**_ASSISTANT_CENTROIDS),
}
"""model_type -> a function that adjusts the shrunk keyword arguments where the generic rules cannot."""
