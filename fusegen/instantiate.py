"""Stage 2: build the model on `meta` and pick the module classes worth analysing."""

from __future__ import annotations

import torch
from torch import nn

from fusegen.errors import InputError
from fusegen.match import plain_linears
from fusegen.resolve import Target


def instantiate(target: Target) -> nn.Module:
    """The causal LM built from its default config on `meta`: no memory, no weights."""
    try:
        config = target.config_class()
        with torch.device("meta"):
            return target.causal_lm(config)
    except Exception as exc:
        raise InputError(
            f"model type {target.model_type!r}: {target.causal_lm.__name__} cannot be built on the meta device "
            f"from its default config ({type(exc).__name__}: {exc})"
        ) from exc


def candidates(model: nn.Module) -> dict[type, nn.Module]:
    """One instance of each module class with two or more plain linear children.

    Ordered by first appearance, so the analysis (and its report) is deterministic.
    """
    found: dict[type, nn.Module] = {}
    for module in model.modules():
        if type(module) not in found and len(plain_linears(module)) >= 2:
            found[type(module)] = module
    return found
