"""The plain data the stages hand each other: fusion plans and outcomes."""

from __future__ import annotations

from dataclasses import dataclass, field

ShardId = str | int


@dataclass(frozen=True)
class FusionPlan:
    """Sibling linears of one class to merge into one linear, in row order."""

    kind: str
    """`qkv`, `glu` or `merged_column`: how the group was recognised."""
    merged: str
    """Attribute name of the merged linear (`qkv_proj`)."""
    shards: tuple[tuple[str, ShardId], ...]
    """Each projection's attribute name and its shard id, in row order."""
    kept: tuple[str, ...] = ()
    """Projections that configs without the merged linear still build on their own (a conditional fusion, such
    as MLA's `kv_a_proj_with_mqa` where `q_lora_rank` is None): their own TP rules stay in the plan."""

    @property
    def projections(self) -> tuple[str, ...]:
        return tuple(name for name, _ in self.shards)

    def describe(self) -> str:
        return f"{' + '.join(self.projections)} -> {self.merged} ({self.kind})"


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
