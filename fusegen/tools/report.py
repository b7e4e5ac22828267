"""`fusegen report`: each candidate class's outcome (`compiler.build.analyse`), for people and tools, with what each
rule that fired means (the rule registry, `fusegen.compiler.rules`)."""

from __future__ import annotations

from dataclasses import asdict

from fusegen.compiler.rules import DOC, describe


def report_data(analyses) -> dict:
    """Plain data: per target, per candidate class, what was fused and what was refused."""
    return {
        "targets": [
            {
                "target": analysis.target.source,
                "model_type": analysis.target.model_type,
                "module": analysis.target.module.__name__,
                "classes": [outcome_data(outcome) for outcome in analysis.outcomes],
            }
            for analysis in analyses
        ]
    }


def outcome_data(outcome) -> dict:
    return {
        "class": outcome.class_name,
        "fused": [
            {"kind": plan.kind, "merged": plan.merged, "shards": [list(shard) for shard in plan.shards]}
            for plan in outcome.fused
        ],
        "refused": [
            {
                **asdict(refusal),
                "projections": list(refusal.projections),
                "rule_doc": describe(refusal.rule).doc,
                "rule_section": describe(refusal.rule).section,
            }
            for refusal in outcome.refused
        ],
        "trace_stopped": outcome.trace_error,
    }


def report_text(analyses) -> str:
    lines = []
    for analysis in analyses:
        lines.append(f"{analysis.target.source} ({analysis.target.module.__name__})")
        if not analysis.outcomes:
            lines.append("  no module has two or more linears: nothing to fuse")
        for outcome in analysis.outcomes:
            for plan in outcome.fused:
                lines.append(f"  {outcome.class_name}: fused {plan.describe()}")
            for refusal in outcome.refused:
                lines.append(f"  {outcome.class_name}: refused {refusal.describe()}")
            if not outcome.fused and not outcome.refused:
                why = f" (trace stopped early: {outcome.trace_error})" if outcome.trace_error else ""
                lines.append(f"  {outcome.class_name}: no linears share an input{why}")
            elif outcome.trace_error:
                lines.append(
                    f"  {outcome.class_name}: trace stopped early ({outcome.trace_error}): "
                    "linears called after that point were not seen"
                )
    fired = sorted({r.rule for analysis in analyses for outcome in analysis.outcomes for r in outcome.refused})
    if fired:
        lines.append(f"rules (documented in {DOC}):")
        for rule in map(describe, fired):
            lines.append(f"  {rule.id}: {rule.doc}" + (f" ({DOC}: {rule.section})" if rule.section else ""))
    return "\n".join(lines) + "\n"
