"""What a fusion kind is: the interface the compiler's stages call (see the package docstring for how to add one)."""

from __future__ import annotations

import ast
from collections.abc import Iterable
from typing import ClassVar

from torch import nn

from fusegen.core.plan import FusionPlan, Refused
from fusegen.core.traced import Trace


class Kind:
    """One fusion kind. The stages call, per candidate class instance:

    - `candidate(module)` (stage 2): whether the class is worth tracing and analysing at all;
    - `match(trace, module)` (stage 4): the plans this kind finds in the traced class;
    - per plan, in order: `check(module, plan)` on the live instance, then the name-clash check of
      `new_names(plan)`, then `rewrite(classdef, plan, module, namespace, fused)` (stage 5) on a copy of the class
      statement. Either may raise `Refused`; the plan is then recorded as refused with the rule, and the plans
      `smaller_after_check` / `smaller_after_rewrite` return are tried next.

    A kind is stateless: `@register` keeps one instance. Defaults describe a kind that finds nothing.
    """

    name: ClassVar[str]
    """The kind's id: `FusionPlan.kind`, the report's and the generated header's `(qkv)`."""
    priority: ClassVar[int] = 50
    """Kinds are asked in ascending priority. For linear kinds it decides who claims a linear first."""
    family: ClassVar[str | None] = None
    """Kinds that share one search name the same family: the matcher asks only the family's first kind (in priority
    order), whose `match` returns the plans of every kind of the family (`fusegen.compiler.match`). None: the kind
    matches on its own."""
    head_sharded: ClassVar[bool] = False
    """Tensor parallelism: the merged linear holds attention heads (q by query heads, k/v by kv heads), so the TP
    plan gives its owner `fusegen_local_heads` (fusegen/runtime/tp.py). Kinds that merge no linears ignore it."""
    runtime_names: ClassVar[frozenset[str]] = frozenset()
    """Names of `fusegen.runtime` the rewritten classes may call (`MergedColumnLinear`); a generated file imports
    those its classes use. Every other global a rewrite introduces must exist in the class's own module."""
    label: ClassVar[tuple[str, str] | None] = None
    """The coverage summary's words for the pieces and for what a model has (`("q/k/v", "a q/k/v triplet")`), or
    None: the summary then counts nothing for this kind (`fusegen.tools.coverage.kind_counts`)."""

    def candidate(self, module: nn.Module) -> bool:
        """Whether instances of `type(module)` should be traced and analysed for this kind.

        A false alarm costs an analysis; a miss costs the fusion silently, so say yes when unsure.
        """
        return False

    def match(self, trace: Trace, module: nn.Module) -> list[FusionPlan]:
        """The plans this kind finds in one traced instance (stage 4); for a kind of a `family`, the plans of every
        kind of the family."""
        return []

    def check(self, module: nn.Module, plan: FusionPlan) -> None:
        """Checks on the live instance before the source is touched; raise `Refused` to decline."""

    def new_names(self, plan: FusionPlan) -> tuple[str, ...]:
        """Attributes the rewrite adds to the class; the analysis refuses the plan (`name-clash`) if one is taken."""
        return ()

    def rewrite(
        self, classdef: ast.ClassDef, plan: FusionPlan, module: nn.Module, namespace: dict, fused: list[FusionPlan]
    ) -> FusionPlan | None:
        """Rewrite `classdef` (a copy; the analysis keeps it only on success) in place for `plan`, and return the
        plan as applied (a kind may note what the rewrite found, e.g. `FusionPlan.kept`), or None for `plan` itself.

        `namespace` is the globals of the class's module, `fused` the plans of this class already applied to
        `classdef`. Raise `Refused(rule, reason, node)` to decline: a refusal costs the fusion, never correctness.
        """
        raise Refused("unsupported-kind", f"the {self.name} kind does not rewrite classes")

    def smaller_after_check(self, module: nn.Module, plan: FusionPlan) -> list[FusionPlan]:
        """Plans to try when `check` refused `plan` (e.g. the group without the one hooked linear)."""
        return []

    def smaller_after_rewrite(self, classdef: ast.ClassDef, plan: FusionPlan, refusal: Refused) -> list[FusionPlan]:
        """Plans to try when the rewrite refused `plan`; `classdef` is the class before this plan's rewrite."""
        return []

    def present(self, names: Iterable[str]) -> bool:
        """Coverage: whether a class with linear children `names` has what this kind fuses (fused or not)."""
        return False
