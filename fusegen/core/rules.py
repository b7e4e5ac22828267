"""What a refusal rule is: its id, what it refuses in one line, and the section of docs/analysis.md that argues it.

Each fusion family declares the rules it raises (`Kind.rules`: the merged-linear family in
`fusegen.fusions.merged.rules`, the RMS norm kind in `fusegen.fusions.rmsnorm`); the compiler declares its own and
assembles the one registry (`fusegen.compiler.rules.registry`) that `fusegen report`, the coverage tool and a test
against docs/analysis.md read.
"""

from __future__ import annotations

from dataclasses import dataclass

DOC = "docs/analysis.md"
"""Where every rule is documented, each in its `Rule.section`."""

SKELETONS = "Kinds written but not registered"
"""The doc section of the rules of kinds that exist as skeletons (not registered, so never in a build)."""


@dataclass(frozen=True)
class Rule:
    id: str
    """The stable id a refusal carries (`input-rebound`): in the header, `fusegen report` and docs/coverage.md."""
    doc: str
    """What the rule refuses, in one line."""
    section: str
    """The title of the `###` section of docs/analysis.md that documents it (its table row or paragraph)."""


def rules(section: str, *pairs: tuple[str, str]) -> tuple[Rule, ...]:
    """`Rule`s of one doc section, from `(id, doc)` pairs."""
    return tuple(Rule(rule_id, doc, section) for rule_id, doc in pairs)
