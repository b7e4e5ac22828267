"""The rule ids of the merged-linear family's safety rules, and the switch the mutation tests turn them off with.

The hoisting rules (`fusegen.fusions.merged.hoist`) and the live checks (`fusegen.fusions.merged.live`) report
their findings through `raise_first`, which raises the first one whose rule is not `DISABLED`.
"""

from __future__ import annotations

DISABLED: frozenset[str] = frozenset()
"""Rule ids switched off. Only the mutation tests set it, to show each rule is needed."""


def raise_first(findings) -> None:
    for refusal in findings:
        if refusal.rule not in DISABLED:
            raise refusal


RULE_IDS = (
    "reflection", "input-rebound", "input-written", "aliased-augassign", "input-escapes", "deferred-capture",
    "opaque-alias", "inplace-call", "inplace-operator", "dynamic-attribute", "unknown-callee", "impure-call",
    "state-method-call", "state-source", "frame-access", "global-hook", "parametrized-projection", "linear-subclass",
    "projection-hook", "dtype-mismatch", "device-mismatch", "ambient-context", "caller-alias", "region-call",
    "projection-identity", "argument-write",
)  # fmt: skip
"""Every rule id this module can refuse with (besides `input-not-simple`, which guards the input's spelling)."""
