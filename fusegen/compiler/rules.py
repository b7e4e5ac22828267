"""The rule registry: every refusal's rule id, what it means in one line, and the section of docs/analysis.md that
argues why it is sound. `fusegen report` prints from it, the coverage tool reads it, and a test checks that every
rule id the code raises is registered here (or by a kind) and documented in that section.

A fusion kind that refuses with rules of its own declares them (`Kind.rules`, `Kind.rules_section`); `registry()`
adds them, so a new kind stays one module.
"""

from __future__ import annotations

from dataclasses import dataclass

DOC = "docs/analysis.md"
"""Where every rule is documented, each in its `Rule.section`."""

PROJECTIONS = "Projections are what they look like"
INPUT = "The input is stable between the projections"
REWRITE = "The rewrite and the build"


@dataclass(frozen=True)
class Rule:
    id: str
    """The stable id a refusal carries (`input-rebound`): in the header, `fusegen report` and docs/coverage.md."""
    doc: str
    """What the rule refuses, in one line."""
    section: str
    """The title of the `###` section of docs/analysis.md that documents it (its table row or paragraph)."""


def _rules(section: str, *pairs: tuple[str, str]) -> list[Rule]:
    return [Rule(rule_id, doc, section) for rule_id, doc in pairs]


CORE: tuple[Rule, ...] = (
    *_rules(
        PROJECTIONS,
        ("linear-subclass", "a piece is not exactly nn.Linear"),
        ("projection-hook", "a piece has a hook or an instance-level forward"),
        ("global-hook", "a global module hook is registered"),
        ("parametrized-projection", "a piece's weight is computed by a parametrization"),
        ("dtype-mismatch", "the pieces' weights and biases differ in dtype"),
        ("device-mismatch", "the pieces' weights and biases differ in device"),
    ),
    *_rules(
        INPUT,
        ("input-not-simple", "the input expression computes something"),
        ("reflection", "forward uses eval, exec, locals, a frame attribute or another reflective name"),
        ("input-rebound", "a name the input reads is bound between the projection calls"),
        ("input-written", "an item or attribute of a possible alias of the input is stored or deleted"),
        ("aliased-augassign", "an augmented assignment targets a possible alias of the input"),
        (
            "input-escapes",
            "a possible alias is stored, or handed to a callee that may keep it, where the analysis does not follow it",
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
    *_rules(
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
        ("name-clash", "the class already uses a name the rewrite adds"),
        ("closure", "forward is a closure"),
        ("name-mangled", "the class uses a name-mangled name"),
        ("no-source", "the class's source cannot be read"),
        ("not-module-level", "the class is not defined once at module level"),
        ("inherited-method", "the class inherits __init__ or forward instead of defining it"),
        ("unsupported-kind", "the kind does not rewrite classes"),
        (
            "ambiguous-checkpoint-names",
            "a checkpoint name would mean a piece in one class and a whole tensor in another",
        ),
        ("outside-reference", "code outside the class reads a projection that fusion removes"),
        ("checkpoint-already-fused", "checkpoints store the projections already merged"),
        ("unreachable", "the causal LM never builds the fused class"),
        ("validation-mismatch", "the generated file computed something other than the original"),
    ),
)


def registry() -> dict[str, Rule]:
    """Every rule by id: `CORE`, then the rules each registered fusion kind declares."""
    from fusegen import fusions

    rules = {rule.id: rule for rule in CORE}
    for kind in fusions.kinds():
        for rule_id, doc in kind.rules.items():
            if rule_id in rules:
                raise ValueError(f"rule {rule_id!r} of kind {kind.name!r} is already registered")
            rules[rule_id] = Rule(rule_id, doc, kind.rules_section)
    return rules


def describe(rule_id: str) -> Rule:
    """The registered rule `rule_id`, or a stand-in saying it is unregistered (a kind defined outside fusegen may
    refuse with its own ids; `fusegen report` must still print them)."""
    return registry().get(rule_id) or Rule(rule_id, "(not a registered rule)", "")
