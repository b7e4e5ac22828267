"""The coverage table's data: one `Row` per model type (the sweep's status, the `Inspection` of the original, the
`Verification` of the fused model), and the run's constants."""

from __future__ import annotations

import re
from dataclasses import dataclass, field

BATCH, LENGTH = 2, 12
NEW_TOKENS = 4


TIMEOUT = 600.0


ALREADY_FUSED = re.compile(r"^(qkv_proj|qkv|c_attn|Wqkv|query_key_value|wqkv|in_proj|gate_up_proj|w13|gate_up)$")


@dataclass
class Verification:
    """Outcome of the equivalence check of one fused model type."""

    status: str
    """`verified`, `mismatch` (loaded but computes something else), `failed` (the fused side broke),
    `skipped` (no tiny config, or the original itself cannot run on text) or `timeout`/`crash`."""
    max_abs_diff: float | None = None
    greedy: str = ""
    """`same`, `differ`, or why generation was not compared."""
    reason: str = ""
    seconds: float = 0.0
    checks: list[dict] = field(default_factory=list)
    """One `ConfigCheck` (as data) per config verified: the tiny config first, then each construction variant."""
    left_out: list[str] = field(default_factory=list)
    """Construction variants found but not verified (over the `--variants` limit)."""


@dataclass
class Inspection:
    """What the original model holds, per module class: its linear children and already-merged weights."""

    linears: dict[str, list[str]] = field(default_factory=dict)
    already_fused: dict[str, list[str]] = field(default_factory=dict)
    error: str = ""
    places: dict[str, list[str]] = field(default_factory=dict)
    """Per module class, where the model holds it: its module paths, list indices written `*`
    (`model.visual.blocks.*.attn`); what tells a vision tower's class from the text model's."""


@dataclass
class Row:
    model_type: str
    status: str
    report: dict
    error: str
    inspection: Inspection
    verification: Verification | None
