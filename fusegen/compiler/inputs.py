"""Configs and inputs the compiler's checks run on (and the tests, `bench/` and the tools, through `fusegen.testkit`).

- `model_config` / `tiny_config`: the config as the causal LM takes it (the text part of a composite config), and a
  target's config shrunk generically (`fusegen.compiler.shrink`);
- `random_model` / `randomise`: THE initialisation policy (see `randomise`);
- `random_input`, `input_rows`, `extra_inputs`: fixed token ids avoiding the special tokens, and the other inputs a
  model needs to run every class it builds.

One place for each, so that every equivalence figure in the project (the build's validation, the coverage tool,
the tests) comes from the same initialisation and inputs; the tolerance they are held to is
`fusegen.compiler.validate`'s.
"""

from __future__ import annotations

import inspect

import torch

from fusegen.compiler.shrink import tiny_config as shrunk

SEED = 0


BATCH, LENGTH = 2, 12
"""`random_input`'s default shape: two sequences of twelve tokens."""


def model_config(target, config):
    """The config the causal LM takes: the composite config's text part when the class is built from that.

    `MODEL_FOR_CAUSAL_LM_MAPPING` maps some composite model types (`qwen3_5`, `llama4`) to a text-only causal LM
    whose `config_class` is the text config; the compiler builds those from the text part too. Where the text part
    is ambiguous (MusicGen holds a text encoder and a decoder), the one sub-config of exactly the wanted class is it.
    """
    wanted = getattr(target.causal_lm, "config_class", None)
    if wanted is None or isinstance(config, wanted):
        return config
    try:
        text = config.get_text_config()
    except Exception:  # noqa: BLE001 - no unambiguous text part: look for the sub-config of the wanted class
        text = _sub_config_of_class(config, wanted)
    return text if isinstance(text, wanted) else config


def _sub_config_of_class(config, wanted):
    """The one sub-config of `config` that is a `wanted`, or None if there is none or more than one."""
    found = [getattr(config, key, None) for key in getattr(config, "sub_configs", None) or {}]
    found = [sub for sub in found if isinstance(sub, wanted)]
    return found[0] if len(found) == 1 else None


def tiny_config(target, **overrides):
    """`target`'s config (a resolved target: `config_class`, `causal_lm`) shrunk by `fusegen.compiler.shrink`, with
    `overrides`, as the causal LM takes it. Raises `ShrinkError` when no tiny config can be made."""

    return model_config(target, shrunk(target.config_class, **overrides))


def randomise(model: torch.nn.Module, select=None) -> torch.nn.Module:
    """Draw every floating-point parameter of `model` afresh, in place, from the global RNG; returns `model`.
    `select(name)` limits it to some parameters (an adapter's `lora_` tensors, say; PEFT starts B at zero, which
    would hide a dropped or misplaced tensor).

    Matrices from N(0, 1/fan_in), vectors (norm weights, biases) from N(0, 1). Every tensor is drawn, biases and
    norms too, so a mis-sliced bias or a norm applied to the wrong piece shows. The scale keeps activations and
    logits of order 1 through the layers, which is what `TOLERANCE` is calibrated for: smaller weights (N(0, 0.05),
    say) shrink each layer's output so much that a real fault (gate and up swapped) moves the logits by as little as
    1e-5, and a check at 1e-5 then passes what it should catch; larger ones saturate softmaxes and blow rounding up.
    """
    with torch.no_grad():
        for name, parameter in model.named_parameters():
            if not parameter.is_floating_point() or (select is not None and not select(name)):
                continue
            fan_in = parameter[0].numel() if parameter.dim() > 1 else 1
            parameter.normal_(0.0, fan_in**-0.5)
    return model


def random_model(model_class, config, seed: int = SEED):
    """`model_class(config)` in fp32 eval mode with `randomise`'s weights, seeded by `seed` (built after seeding, so
    buffers drawn at construction are reproducible too)."""
    torch.manual_seed(seed)
    return randomise(model_class(config).to(torch.float32).eval())


def random_input(config, batch: int = BATCH, length: int = LENGTH, seed: int = SEED + 1) -> torch.Tensor:
    """Fixed random token ids `(batch, length)` below min(vocab, 1024), avoiding every special token id of the
    config (image/audio placeholders included), so a multimodal model's text path is what runs."""
    text_config = config.get_text_config(decoder=True)
    vocab = getattr(text_config, "vocab_size", None) or 256
    special = set()
    for source in (config, text_config):
        for name in dir(source):
            if name.endswith(("token_id", "token_index", "token_ids")) and not name.startswith("_"):
                value = getattr(source, name, None)
                special.update(
                    v for v in (value if isinstance(value, (list, tuple)) else [value]) if isinstance(v, int)
                )
    allowed = torch.tensor([i for i in range(min(vocab, 1024)) if i not in special])
    generator = torch.Generator().manual_seed(seed)
    return allowed[torch.randint(0, len(allowed), (batch, length), generator=generator)]


def input_rows(config) -> int:
    """Rows of `input_ids` per sequence: 1, or one per codebook for a decoder that reads them stacked (MusicGen's
    `(batch * num_codebooks, length)`)."""
    return getattr(config.get_text_config(decoder=True), "num_codebooks", None) or 1


def extra_inputs(model: torch.nn.Module, batch: int, length: int, make) -> dict:
    """Forward arguments besides `input_ids` that `model` needs to run every class it builds; `make(*shape)` makes
    each tensor (random for a check, `meta` for recording).

    - `cross_attention_states` (Mllama): image states, so the cross-attention layers run instead of being skipped.
    - `shared_kv_states` (the Gemma 4 assistants, which read the backbone's keys and values and its hidden states
      instead of tokens): `inputs_embeds` of twice the backbone's width, and one key/value pair per layer type shaped
      as that type's attention reads it. `output_hidden_states=True` too: without it the text model slices its
      per-layer inputs, which the assistants never have (`None[...]`, transformers 5.24).
    """
    parameters = inspect.signature(type(model).forward).parameters
    config = getattr(model, "config", None)
    if config is None:
        return {}
    if "shared_kv_states" in parameters:
        return {
            "inputs_embeds": make(batch, length, 2 * config.backbone_hidden_size),
            "shared_kv_states": _shared_kv_states(model, batch, length, make),
            "output_hidden_states": True,
        }
    width = getattr(config.get_text_config(), "hidden_size", None)
    if "cross_attention_states" in parameters and width:
        return {"cross_attention_states": make(batch, length // 2, width)}
    return {}


def _shared_kv_states(model: torch.nn.Module, batch: int, length: int, make) -> dict:
    """`{layer type: (keys, values)}` shaped `(batch, kv heads, length, head_dim)` of the first attention of each type."""
    shared = {}
    for module in model.modules():
        layer_type = getattr(module, "layer_type", None)
        if layer_type is None or layer_type in shared or not hasattr(module, "num_key_value_groups"):
            continue
        shape = (batch, module.config.num_attention_heads // module.num_key_value_groups, length, module.head_dim)
        shared[layer_type] = (make(*shape), make(*shape))
    return shared
