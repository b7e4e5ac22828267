"""Fusion kinds: one module per kind, found and registered the way pyupgrade finds its plugins.

Every module of this package is imported the first time the compiler asks for the kinds (`kinds()`); a module
registers its kind with the `@register` class decorator. Nothing else lists the kinds: the matcher
(`fusegen.compiler.match`), the analysis (`fusegen.compiler.analyse`), the candidate filter
(`fusegen.compiler.instantiate.candidates`), the TP plan (`fusegen.compiler.mappings`) and the coverage tool
(`fusegen.tools.coverage`) all ask the registry.

The kinds today: `qkv` (qkv.py), `glu` (glu.py), `merged_column` (siblings.py: any other group of sibling
linears, MLA's `fused_qkv_a_proj` among them), `packed_qkv` (packed_qkv.py: an already packed q/k/v linear declares
its row layout), `rmsnorm` (rmsnorm.py).

Adding a kind is one new module here, plus its tests:

- A merge of sibling linears (one `MergedColumnLinear` instead of several `nn.Linear`s reading one value):
  subclass `fusegen.fusions.linear.LinearKind`, set `name` and `priority`, implement
  `claim(nodes) -> (plans, rest)` (take what you recognise from one same-input group of linear call nodes, in
  the order of `priority`, lower first; leave the rest to the next kind), and optionally `merged_name`,
  `head_sharded` (TP shards the merged linear by attention heads) and `present` / `label` (what the coverage tool
  counts). The rewrite of `__init__`/`forward`, the safety rules, the checkpoint mapping and the TP rule come with
  `LinearKind`.
- Any other rewrite of a class (RMSNorm -> one `F.rms_norm` call): subclass `fusegen.fusions.base.Kind`, and
  implement `candidate(module)` (which module classes to analyse at all), `match(trace, module) -> [FusionPlan]`
  (plans with no `shards`: they merge no linears, so they get no checkpoint mapping, no scope and no TP rule) and
  `rewrite(classdef, plan, module, namespace, fused)` (edit the copy of the class statement in place, or raise
  `Refused(rule, reason)`). A plan may be a subclass of `FusionPlan` carrying the kind's own data. A kind that rewrites only a leaf module's
  `forward` builds on `fusegen.fusions.leaf` (the guard that keeps the original statements, execution, the
  bit-exact comparison), as `rmsnorm` does.

Kinds sharing one search name the same `Kind.family` (the merged-linear kinds: `LinearKind.family`); the matcher
asks a family once. `silu.py` is a skeleton left unregistered (its docstring says why).

Then decorate the class with `@register`. The generated file is validated by execution like every other fusion
(`fusegen.compiler.validate`), so a kind that changes numerics is refused there, not shipped.
"""

from __future__ import annotations

import importlib
import pkgutil
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from fusegen.fusions.base import Kind

_REGISTRY: dict[str, Kind] = {}
_loaded = False


def register(cls: type[Kind]) -> type[Kind]:
    """Class decorator: register one instance of the kind `cls` under `cls.name`."""
    if cls.name in _REGISTRY and type(_REGISTRY[cls.name]) is not cls:
        raise ValueError(
            f"two fusion kinds are named {cls.name!r}: {type(_REGISTRY[cls.name]).__name__}, {cls.__name__}"
        )
    _REGISTRY[cls.name] = cls()
    return cls


def kinds() -> list[Kind]:
    """Every registered kind, lowest `priority` first (then by name, so the order never depends on file order)."""
    _load()
    return sorted(_REGISTRY.values(), key=lambda kind: (kind.priority, kind.name))


def kind(name: str) -> Kind:
    """The kind registered under `name` (a `FusionPlan.kind`)."""
    _load()
    return _REGISTRY[name]


def _load() -> None:
    """Import every module of this package once, so each registers its kind."""
    global _loaded
    if _loaded:
        return
    _loaded = True  # before importing: a kind module may itself ask for the kinds
    try:
        for module in pkgutil.iter_modules(__path__):
            if not module.name.startswith("_"):
                importlib.import_module(f"{__name__}.{module.name}")
    except BaseException:
        _loaded = False
        raise
