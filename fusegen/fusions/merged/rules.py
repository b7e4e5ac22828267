"""The rule ids of the merged-linear family's safety rules, and the switch the mutation tests turn them off with.

The hoisting rules (`fusegen.fusions.merged.hoist`) and the live checks (`fusegen.fusions.merged.live`) report
their findings through `claims_unless_refused`, which raises the first refusal whose rule is not `DISABLED` and
otherwise returns what the findings claim (`Claim`).
"""

from __future__ import annotations

import dataclasses

from fusegen.core.rules import Rule, rules

DISABLED: frozenset[str] = frozenset()
"""Rule ids switched off. Only the mutation tests set it, to show each rule is needed."""


@dataclasses.dataclass(frozen=True)
class Claim:
    """A finding that refuses nothing: the region relies on the parameter `name` holding the class `isinstance` says
    it holds. That is so where `fusegen.runtime.claims.class_is_honest(name)` is, so a rewrite runs the merged call
    only there and each projection at its own place elsewhere (`rewrite_forward.claimed_split`, `rewrite_cross`); a
    rewrite that cannot refuses (`class-claim`)."""

    name: str


def claims_unless_refused(findings) -> frozenset[str]:
    """Raise the first refusal whose rule is not `DISABLED`; otherwise return the names the findings claim."""
    claims = set()
    for finding in findings:
        if isinstance(finding, Claim):
            claims.add(finding.name)
        elif finding.rule not in DISABLED:
            raise finding
    return frozenset(claims)


PROJECTIONS = "Projections are what they look like"
INPUT = "The input is stable between the projections"
WORLD = "The merged call runs in the world of every piece"
REWRITE = "The rewrite and the build"

LIVE_AND_HOIST_RULES: tuple[Rule, ...] = (
    *rules(
        PROJECTIONS,
        ("linear-subclass", "a piece is not exactly nn.Linear"),
        ("projection-hook", "a piece has a hook or an instance-level forward"),
        ("global-hook", "a global module hook is registered"),
        ("parametrized-projection", "a piece's weight is computed by a parametrization"),
        ("dtype-mismatch", "the pieces' weights and biases differ in dtype"),
        ("device-mismatch", "the pieces' weights and biases differ in device"),
    ),
    *rules(
        INPUT,
        ("reflection", "forward uses eval, exec, locals, a frame attribute or another reflective name"),
        ("input-rebound", "a name the input reads is bound between the projection calls"),
        ("input-written", "an item or attribute of a possible alias of the input is stored or deleted"),
        ("aliased-augassign", "an augmented assignment targets a possible alias of the input"),
        (
            "input-escapes",
            "a possible alias is stored, or handed to a callee that may keep it, out of the analysis' sight",
        ),
        (
            "deferred-capture",
            "a lambda, nested function or generator that may run in the region reads a possible alias",
        ),
        ("opaque-alias", "forward reads an alias made by a call not known to return a tensor view"),
        ("inplace-call", "a possible alias is written by an in-place method or function, out= or inplace="),
        ("inplace-operator", "an in-place operator function or dunder is applied to a possible alias"),
        ("dynamic-attribute", "setattr, delattr or a non-metadata getattr on a possible alias"),
        ("unknown-callee", "a call reaching an alias has a callee that cannot be resolved statically"),
        ("impure-call", "a possible alias is handed to a function or method not known to leave it intact"),
        ("state-method-call", "the region calls a method of the module itself"),
        ("state-source", "the input may be module state that the region may write"),
        ("frame-access", "forward calls a module-level function that may reach the caller's frame"),
    ),
    *rules(
        WORLD,
        (
            "ambient-context",
            "a projection runs under a context, or after a state switch, that its siblings or the merged call may not",
        ),
        (
            "caller-alias",
            "the region writes in place into a name not proven fresh local storage (the caller may alias it)",
        ),
        ("region-call", "the region makes a call not proven to write nothing, whether or not it is handed the input"),
        (
            "projection-identity",
            "the projections or their parameters are reached other than through the spelled self.<proj>",
        ),
        ("argument-write", "a call writes its arguments (max_norm, running statistics, a self-updating submodule)"),
        (
            "implicit-call",
            (
                "the region runs code of an object not known to be a tensor, number or Transformers object without "
                "calling it (an operator, truth test, iteration, f-string, property, builtin, decorator or class)"
            ),
        ),
    ),
)
"""The rules `claims_unless_refused` reports for the live checks (`live`) and the hoisting rules (`hoist`)."""

RULES: tuple[Rule, ...] = (
    *LIVE_AND_HOIST_RULES,
    *rules(INPUT, ("input-not-simple", "the input expression computes something")),
    *rules(
        REWRITE,
        ("not-called-once", "a projection is called more than once, or not at all"),
        ("unusual-call", "a projection is called other than as self.p(x) or self.p(input=x)"),
        ("escaping-reference", "a projection is used other than by its call, its constructor and existence guards"),
        ("call-in-loop", "a projection is called in a loop, comprehension or nested scope"),
        (
            "different-inputs",
            "the projections' inputs are spelled differently and nothing proves them the same tensor",
        ),
        ("unusual-init", "the projections are constructed in a shape the rewrite does not handle"),
        ("constructor-inputs-change", "what a moved constructor reads may change between the constructors"),
        (
            "class-claim",
            (
                "the region trusts a caller's object to be the class isinstance says, and the rewrite has no place "
                "to fall back to each projection where the object's class may lie"
            ),
        ),
    ),
)
"""Every rule the merged-linear family refuses with: the kinds built on `LinearKind` declare them (`Kind.rules`)."""

RULE_IDS = tuple(rule.id for rule in LIVE_AND_HOIST_RULES)
"""Every rule id `claims_unless_refused` can refuse with (the live checks and the hoisting rules)."""
