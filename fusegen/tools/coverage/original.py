"""Inspection of the original model: per module class, its linear children and the weights it already stores merged."""

from __future__ import annotations

import re
from dataclasses import asdict

from fusegen.errors import first_line as _first_line
from fusegen.testkit import (  # the one kit (fusegen/testkit.py)
    model_config,
)
from fusegen.tools.coverage.rows import ALREADY_FUSED, Inspection


def inspect_original(model_type: str, head: str | None = None) -> dict:
    """Linear children and already-merged weights of each module class of the original model, built on `meta`.

    The default config is what the compiler analysed (its text part when the causal LM takes that); if the model
    cannot be built from it, the tiny config stands in. `head`: the class to build (`resolve`'s; None: the default).
    """
    from fusegen.compiler.resolve import resolve
    from fusegen.compiler.shrink import shrunk_config

    target = resolve(model_type, head)
    model, error = None, None
    for make_config in (target.config_class, lambda: shrunk_config(target.config_class)):
        try:
            model = _build_on_meta(target, model_config(target, make_config()))
            break
        except Exception as failure:  # noqa: BLE001 - try the next config, report the first failure
            error = error or failure
    if model is None:
        return asdict(Inspection(error=f"{type(error).__name__}: {_first_line(error)}"))
    inspection = Inspection()
    for path, module in model.named_modules():
        name = type(module).__name__
        place = _PATH_INDEX.sub(".*", path)
        if place not in inspection.places.setdefault(name, []):
            inspection.places[name].append(place)
        linears = [child for child, sub in module.named_children() if _is_linear(sub)]
        if len(linears) >= 2 and name not in inspection.linears:
            inspection.linears[name] = linears
        merged = [n for n in linears if ALREADY_FUSED.match(n)]
        merged += [n for n, p in module.named_parameters(recurse=False) if ALREADY_FUSED.match(n) and p.dim() >= 2]
        if merged and name not in inspection.already_fused:
            inspection.already_fused[name] = merged
    return asdict(inspection)


_PATH_INDEX = re.compile(r"\.\d+(?=\.|$)")
"""A module-list index in a module path (`model.layers.3.self_attn`), written `*` in `Inspection.places`."""


def _build_on_meta(target, config):
    import torch

    with torch.device("meta"):
        return target.causal_lm(config)


def _is_linear(module) -> bool:
    """`nn.Linear` and GPT-2's `Conv1D` (a linear with a transposed weight) both count as projections."""
    from torch import nn

    return isinstance(module, nn.Linear) or type(module).__name__ == "Conv1D"
