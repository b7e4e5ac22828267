"""Stage 2: build the model on `meta` and pick the module classes worth analysing."""

from __future__ import annotations

import re

import torch
from torch import nn

from fusegen import fusions
from fusegen.compiler.resolve import Target
from fusegen.errors import InputError

_MISSING_ATTRIBUTE = re.compile(r"'\w+' object has no attribute '(\w+)'")
_REPAIRS = 6


def instantiate(target: Target) -> nn.Module:
    """The causal LM built from its default config on `meta`: no memory, no weights.

    Some default configs of the installed Transformers do not build as they
    are (a field the modeling code reads is never set, `head_dim` left None,
    a composite config where the class wants its text part). The classes and
    their source are what the analysis needs, not the config's values, so a
    few such gaps are filled in and the build retried; what still fails is
    reported with its reason.
    """
    try:
        config = target.config_class()
    except Exception as exc:  # upstream config code: report, do not crash
        raise InputError(f"model type {target.model_type!r}: its default config does not build ({exc})") from exc
    first_error = None
    for _ in range(_REPAIRS):
        try:
            with torch.device("meta"):
                return target.causal_lm(config)
        except Exception as exc:  # noqa: BLE001 - upstream modeling code; report, do not crash
            first_error = first_error or exc
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


def _tiny(target: Target) -> nn.Module | None:
    """The model built from a shrunk config instead, when the default config is broken upstream.

    The analysis needs the classes, their source and one instance of each;
    a tiny config of the same model type has them all.
    """
    from fusegen.compiler.shrink import tiny_config

    try:
        config = tiny_config(target.config_class)
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
    missing = _MISSING_ATTRIBUTE.search(str(error))
    if isinstance(error, AttributeError) and missing and not hasattr(config, missing.group(1)):
        name = missing.group(1)
        setattr(config, name, 0.0 if "dropout" in name else None)
        return config
    if getattr(config, "head_dim", 0) is None and getattr(config, "num_attention_heads", None):
        config.head_dim = config.hidden_size // config.num_attention_heads
        return config
    return None


def candidates(model: nn.Module) -> dict[type, nn.Module]:
    """One instance of each module class that some fusion kind wants analysed (`Kind.candidate`).

    The linear kinds want two or more linear children; subclassed, hooked and parametrized linears count too,
    so that a group holding one is reported as refused, with its rule, rather than skipped.
    Ordered by first appearance, so the analysis (and its report) is deterministic.
    """
    kinds = fusions.kinds()
    found: dict[type, nn.Module] = {}
    for module in model.modules():
        if type(module) not in found and any(kind.candidate(module) for kind in kinds):
            found[type(module)] = module
    return found
