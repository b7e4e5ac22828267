"""The rule registry: every refusal's rule id, what it means in one line, and the section of docs/analysis.md that
argues why it is sound (`fusegen.core.rules.Rule`). `fusegen report` prints from it, the coverage tool reads it, and
a test checks that every rule id the code raises is registered and documented in its section.

The compiler's own stages declare their rules here; each fusion family declares the rules it raises on its kinds
(`Kind.rules`), and `registry()` adds them, so a new kind stays one module.
"""

from __future__ import annotations

from fusegen.core.rules import DOC, Rule, rules

__all__ = ["COMPILER_RULES", "DOC", "Rule", "declared", "describe", "registry"]

REWRITE = "The rewrite and the build"

COMPILER_RULES: tuple[Rule, ...] = rules(
    REWRITE,
    ("name-clash", "the class already uses a name the rewrite adds"),
    ("closure", "forward is a closure"),
    ("name-mangled", "the class uses a name-mangled name"),
    ("no-source", "the class's source cannot be read"),
    ("not-module-level", "the class is not defined once at module level"),
    ("inherited-method", "the class inherits __init__ or forward instead of defining it"),
    ("unsupported-kind", "the kind does not rewrite classes"),
    ("ambiguous-checkpoint-names", "a checkpoint name would mean a piece in one class and a whole tensor in another"),
    ("outside-reference", "code outside the class reads a projection that fusion removes"),
    ("checkpoint-already-fused", "checkpoints store the projections already merged"),
    ("unreachable", "the causal LM never builds the fused class"),
    ("validation-mismatch", "the generated file computed something other than the original"),
)
"""The rules the compiler's own stages raise (analysis, vetoes, reachability, validation), whatever the kind."""


def registry() -> dict[str, Rule]:
    """Every rule by id: the compiler's own (`COMPILER_RULES`), then those each registered fusion kind declares
    (`Kind.rules`; kinds of one family share one table). One id, one rule: a clash is a bug, raised here."""
    from fusegen import fusions

    found = {rule.id: rule for rule in COMPILER_RULES}
    for kind in fusions.kinds():
        for rule in kind.rules:
            if found.setdefault(rule.id, rule) != rule:
                raise ValueError(f"rule {rule.id!r} of kind {kind.name!r} clashes with {found[rule.id]}")
    return found


def declared() -> dict[str, Rule]:
    """`registry()` plus the rules of the kinds written but not registered (`fusegen.fusions.silu`,
    `fusegen.fusions.packed_qkv`): every rule any fusegen code can refuse with, for the test against the docs."""
    from fusegen.fusions.base import Kind

    found = registry()
    pending = list(Kind.__subclasses__())
    while pending:
        kind = pending.pop()
        pending.extend(kind.__subclasses__())
        if not kind.__module__.startswith("fusegen."):
            continue
        for rule in kind.rules:
            if found.setdefault(rule.id, rule) != rule:
                raise ValueError(f"rule {rule.id!r} of {kind.__name__} clashes with {found[rule.id]}")
    return found


def describe(rule_id: str) -> Rule:
    """The registered rule `rule_id`, or a stand-in saying it is unregistered (a kind defined outside fusegen may
    refuse with its own ids; `fusegen report` must still print them)."""
    return registry().get(rule_id) or Rule(rule_id, "(not a registered rule)", "")
