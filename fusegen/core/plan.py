"""The plain data the stages hand each other: fusion plans and outcomes."""

from __future__ import annotations

from dataclasses import dataclass, field

ShardId = str | int


@dataclass(frozen=True)
class FusionPlan:
    """One fusion a kind (`fusegen.fusions`) found in one class.

    The base plan is what every stage after matching reads; a kind needing more data of its own may subclass it
    (a frozen dataclass with defaulted fields).
    """

    kind: str
    """The registered kind's name (`qkv`, `glu`, `merged_column`, ...): `fusegen.fusions.kind(plan.kind)`."""
    merged: str
    """What the fusion creates: the merged linear's attribute name (`qkv_proj`); for a kind that merges no
    linears, the name its rewrite is recorded under (vetoes and refusals are keyed by it)."""
    shards: tuple[tuple[str, ShardId], ...] = ()
    """Each merged projection's attribute name and its shard id, in row order. Empty for a kind that merges no
    linears: such a plan has no checkpoint mapping, no checkpoint scope and no TP rule."""
    kept: tuple[str, ...] = ()
    """Projections that configs without the merged linear still build on their own (a conditional fusion, such
    as MLA's `kv_a_proj_with_mqa` where `q_lora_rank` is None): their own TP rules stay in the plan."""

    @property
    def projections(self) -> tuple[str, ...]:
        return tuple(name for name, _ in self.shards)

    @property
    def subject(self) -> tuple[str, ...]:
        """What a refusal of this plan names: its projections, or the merged name when it merges none."""
        return self.projections or (self.merged,)

    def describe(self) -> str:
        if not self.shards:
            return f"{self.merged} ({self.kind})"
        return f"{' + '.join(self.projections)} -> {self.merged} ({self.kind})"


def merged_linears(plans: list[FusionPlan]) -> list[FusionPlan]:
    """The plans that merge linears (they have shards): the ones checkpoint mappings, scopes and TP plans concern."""
    return [plan for plan in plans if plan.shards]


@dataclass(frozen=True)
class Refusal:
    """A fusion the analysis declined, and why."""

    projections: tuple[str, ...]
    rule: str
    """Short stable identifier of the rule that fired (`input-rebound`, ...)."""
    reason: str
    line: int | None = None
    """Line in the original source file that triggered the rule, if known."""

    def describe(self) -> str:
        where = f" (line {self.line})" if self.line else ""
        return f"{' + '.join(self.projections)}: {self.rule}: {self.reason}{where}"


@dataclass(frozen=True)
class Veto:
    """A fusion to refuse for a reason found outside its class (`fusegen.compiler.vetoes`, validation)."""

    rule: str
    """The rule id the refusal carries (`ambiguous-checkpoint-names`, `validation-mismatch`, ...)."""
    reason: str


Vetoes = dict[str, dict[str, Veto]]
"""`{class name: {merged name: veto}}`."""


@dataclass
class ClassOutcome:
    """What happened to one candidate module class."""

    class_name: str
    fused: list[FusionPlan] = field(default_factory=list)
    refused: list[Refusal] = field(default_factory=list)
    trace_error: str | None = None


class Refused(Exception):
    """Raised by an analysis rule; becomes a `Refusal`, never a crash."""

    def __init__(self, rule: str, reason: str, node=None):
        super().__init__(f"{rule}: {reason}")
        self.rule = rule
        self.reason = reason
        self.line = getattr(node, "lineno", None)
