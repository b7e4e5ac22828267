"""Stage 2: build the model on `meta` and pick the module classes worth analysing."""

from __future__ import annotations

import re

import torch
from torch import nn

from fusegen import fusions
from fusegen.compiler.inputs import model_config, tiny_config
from fusegen.compiler.resolve import Target
from fusegen.errors import InputError

_MISSING_ATTRIBUTE = re.compile(r"'(\w+)' object has no attribute '(\w+)'")
_REPAIRS = 6


def instantiate(target: Target) -> nn.Module:
    """The causal LM built from its default config on `meta`: no memory, no weights.

    Some default configs of the installed Transformers do not build as they
    are (a field the modeling code reads is never set, `head_dim` left None,
    a composite config where the class wants its text part). The classes and
    their source are what the analysis needs, not the config's values, so a
    few such gaps are filled in and the build retried; what still fails is
    reported with its reason. A field the modeling code reads but the config
    class does not define (DBRX's `attn_config.rope_theta`) is filled with a
    guess only to see the model build; the tiny config, whose per-model fix
    sets such fields to working values (`fusegen.compiler.shrink.FIXES`), is
    then preferred, so the meta forward that records each class's inputs runs.
    """
    try:
        config = target.config_class()
    except Exception as exc:  # upstream config code: report, do not crash
        small = _tiny(target)
        if small is not None:
            return small
        raise InputError(f"model type {target.model_type!r}: its default config does not build ({exc})") from exc
    config = _causal_lm_config(target, config)
    first_error, guessed = None, False
    for _ in range(_REPAIRS):
        try:
            with torch.device("meta"):
                model = target.causal_lm(config)
            return (_tiny(target) or model) if guessed else model
        except Exception as exc:  # noqa: BLE001 - upstream modeling code; report, do not crash
            first_error = first_error or exc
            guessed = guessed or _missing_field(config, exc) is not None
            repaired = _repair(config, exc)
            if repaired is None:
                break
            config = repaired
    small = _tiny(target)
    if small is not None:
        return small
    raise InputError(
        f"model type {target.model_type!r}: {target.causal_lm.__name__} cannot be built on the meta device "
        f"from its default config ({type(first_error).__name__}: {first_error})"
    )


def _causal_lm_config(target: Target, config):
    """The part of a composite default config the causal LM takes (`fusegen.compiler.inputs.model_config`)."""

    return model_config(target, config)


def _tiny(target: Target) -> nn.Module | None:
    """The model built from a shrunk config instead, when the default config is broken upstream.

    The analysis needs the classes, their source and one instance of each;
    a tiny config of the same model type has them all. Also used when the
    default config itself is rejected by its own validation (Gemma 4
    assistant), since the tiny config sets the fields that validation wants.
    """

    try:
        config = tiny_config(target)
        with torch.device("meta"):
            return target.causal_lm(config)
    except Exception:  # noqa: BLE001 - the default config's error is the one worth reporting
        return None


def _repair(config, error: Exception):
    """The config with the gap `error` points at filled in, or None if it is not a known gap."""
    try:
        text_config = config.get_text_config()
    except Exception:  # noqa: BLE001 - ambiguous or absent text config: nothing to fall back to
        text_config = config
    if text_config is not config and isinstance(error, AttributeError):
        return text_config
    missing = _missing_field(config, error)
    if missing is not None:
        owner, name = missing
        setattr(owner, name, 0.0 if "dropout" in name else None)
        return config
    if getattr(config, "head_dim", 0) is None and getattr(config, "num_attention_heads", None):
        config.head_dim = config.hidden_size // config.num_attention_heads
        return config
    return None


def _missing_field(config, error: Exception):
    """`(owner, name)` when `error` is a read of a field that `config` (or its nested config `owner`) lacks."""
    missing = _MISSING_ATTRIBUTE.search(str(error)) if isinstance(error, AttributeError) else None
    if missing is None:
        return None
    owner = _config_named(config, missing.group(1)) or config
    return None if hasattr(owner, missing.group(2)) else (owner, missing.group(2))


def _config_named(config, class_name: str):
    """`config` or the nested config (DBRX's `attn_config`) whose class is called `class_name`, or None.

    The error names the object that lacks the field; filling it in on any other
    config would not reach the read that failed.
    """
    from transformers import PreTrainedConfig

    if type(config).__name__ == class_name:
        return config
    nested = [value for value in vars(config).values() if isinstance(value, PreTrainedConfig)]
    return next((sub for sub in nested if type(sub).__name__ == class_name), None)


def candidates(model: nn.Module) -> dict[type, nn.Module]:
    """One instance of each module class that some fusion kind wants analysed (`Kind.candidate`).

    The linear kinds want two or more linear children; subclassed, hooked and parametrized linears count too,
    so that a group holding one is reported as refused, with its rule, rather than skipped.
    Ordered by first appearance, so the analysis (and its report) is deterministic.
    Plain containers (`nn.ModuleList`, `nn.ModuleDict`, not subclasses) are left out: they have no
    forward to trace, and their linears are called (one per index, in a loop
    or a comprehension) from the forward of the module that holds them.
    """
    kinds = fusions.kinds()
    found: dict[type, nn.Module] = {}
    for module in model.modules():
        if type(module) in (nn.ModuleList, nn.ModuleDict):
            continue
        if type(module) not in found and any(kind.candidate(module) for kind in kinds):
            found[type(module)] = module
    return found
