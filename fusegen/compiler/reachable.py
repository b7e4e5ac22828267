"""Stage 6a: fusions in classes the causal LM never builds are refused (`unreachable`), so `report` shows them."""

from __future__ import annotations

from torch import nn

from fusegen.compiler.propagate import classes_to_emit, constructed_classes, unreachable_reasons
from fusegen.compiler.resolve import Target
from fusegen.core.plan import ClassOutcome, Refusal


def refuse_unreachable(
    target: Target, model: nn.Module, outcomes: list[ClassOutcome], rewritten: dict
) -> tuple[list, dict]:
    """Outcomes and rewritten classes with the fusions the causal LM never builds refused (so `report` shows them)."""
    if not rewritten:
        return outcomes, rewritten
    emitted = classes_to_emit(target.module, model, rewritten)
    stray = {cls.__name__ for cls in rewritten} - constructed_classes(emitted, target.causal_lm.__name__)
    if not stray:
        return outcomes, rewritten
    kept = {cls: classdef for cls, classdef in rewritten.items() if cls.__name__ not in stray}
    return _unreachable(outcomes, target, stray, model), kept


def _unreachable(
    outcomes: list[ClassOutcome], target: Target, stray: set[str], model: nn.Module
) -> list[ClassOutcome]:
    """The outcomes with the fusions of `stray` classes turned into refusals: the causal LM never builds them.

    This happens when a model constructs a submodule indirectly, through
    `AutoModel.from_config(config.text_config)` (module-level class tables are
    re-emitted, see `fusegen.compiler.propagate.ClassTable`); each reason names the call.
    """
    reasons = unreachable_reasons(target.module, model, stray, target.causal_lm.__name__)
    return [
        (
            ClassOutcome(
                outcome.class_name,
                [],
                outcome.refused
                + [Refusal(plan.subject, "unreachable", reasons[outcome.class_name]) for plan in outcome.fused],
                outcome.trace_error,
            )
            if outcome.class_name in stray
            else outcome
        )
        for outcome in outcomes
    ]
