"""The pipeline driver: a target name in, a generated module's text out.

    resolve -> instantiate -> trace -> match -> rewrite -> propagate -> render -> validate -> write

1. `resolve` turns the name into the module and causal LM class; 2. `instantiate` builds it on `meta` and picks
the candidate classes; 3-5. `analyse` traces (`trace`), matches (`match`) and rewrites each candidate class (each
fusion kind's rewrite; the merged linears' are `rewrite_init`, `rewrite_forward`, `rewrite_cross` and
`rewrite_nested`, under the rules of `safety`), with the vetoes found outside a class (`vetoes`) fed back in, and
stage 5 ends by refusing what the causal LM never builds (`reachable`); 6. `propagate` copies every class that
names a fused class (`runtime_base` adds the runtime base class; `scopes`, `mappings` and `imports` derive the
file's tables and imports); 7. `render` fills the template with each class's text (`splice`); 8. `validate` runs
the result against the original; 9. the CLI writes it (`writer`). Each stage is its own module and hands the next
plain data; this one only calls them, and each module's docstring names its stage by these numbers.
"""

from __future__ import annotations

import ast
import textwrap
from dataclasses import dataclass, field

import transformers
from torch import nn

import fusegen
from fusegen import fusions
from fusegen.compiler.analyse import analyse_classes
from fusegen.compiler.imports import import_block
from fusegen.compiler.instantiate import candidates, instantiate
from fusegen.compiler.mappings import checkpoint_classes, merging_original_classes, stacked_mapping, tensor_parallel
from fusegen.compiler.piece_refs import PIECE, piece_table, rewrite_piece_references
from fusegen.compiler.propagate import Emitted, classes_to_emit, fused_name, fused_names, rename_classes
from fusegen.compiler.reachable import refuse_unreachable
from fusegen.compiler.render import LINE_LENGTH, render
from fusegen.compiler.resolve import Target, resolve
from fusegen.compiler.runtime_base import CHECK, MIXIN, REGISTER, REGISTER_AUTO, TEMPLATE_NAMES, add_runtime_base
from fusegen.compiler.scopes import checkpoint_scopes
from fusegen.compiler.splice import class_text
from fusegen.compiler.trace import record_inputs
from fusegen.compiler.writer import source_fingerprint
from fusegen.core.plan import ClassOutcome, FusionPlan, Refusal, Veto, Vetoes, merged_linears


@dataclass
class Analysis:
    target: Target
    model: nn.Module
    outcomes: list[ClassOutcome]
    rewritten: dict[type, ast.ClassDef]
    """Rewritten class statements of the classes with at least one fusion."""


@dataclass
class BuildResult:
    target: Target
    outcomes: list[ClassOutcome]
    text: str | None
    """The generated module, or None when nothing could be fused."""
    fused_classes: list[type] = field(default_factory=list)
    """The original classes that were rewritten (in analysis order)."""
    validation: object | None = None
    """The `fusegen.compiler.validate.Validation` of the text, when it was validated."""


@dataclass
class Emission:
    """Stage 6's result: the classes of the generated file, renamed and completed, and its tables."""

    emitted: dict[str, Emitted]
    """Every class statement to write, by original name, in definition order."""
    renames: dict[str, str]
    """Original class name -> fused class name."""
    imports: list[str]
    """The file's import lines."""
    plans: list[FusionPlan]
    """The plans that merge linears, in outcome order."""
    scopes: dict[str, list[str]]
    """Checkpoint scopes of each merged linear (`fusegen.compiler.scopes.checkpoint_scopes`); the runtime takes them
    as `register_stacked_checkpoint(..., parents=)`."""
    checkpoint_classes: list[str]
    stacked: dict[str, list[tuple]]
    """The checkpoint mapping, `STACKED_PARAMS_MAPPING` (`fusegen.compiler.mappings.stacked_mapping`)."""
    tensor_parallel: dict
    """The TP plan's template data (`fusegen.compiler.mappings.tensor_parallel`)."""


def analyse(name: str, refused: Vetoes | None = None) -> Analysis:
    """Stages 1-5: every candidate class's outcome, and the rewritten classes the causal LM builds.

    `refused`: `{class: {merged: Veto(rule, reason)}}`, fusions to refuse whatever the analysis finds
    (validation's verdicts).
    """
    target = resolve(name)
    model = instantiate(target)
    found = candidates(model)
    inputs = record_inputs(model, list(found.values()))
    outcomes, rewritten = analyse_classes(model, found, inputs, refused or {})
    outcomes, rewritten = refuse_unreachable(target, model, outcomes, rewritten)
    return Analysis(target, model, outcomes, rewritten)


def build(name: str, validate: bool = True, refused: Vetoes | None = None) -> BuildResult:
    """The whole pipeline: the generated module's text for target `name`.

    `validate=False` skips translation validation (`fusegen.compiler.validate`): for tests of the analysis itself, which
    must see what the analysis alone would emit. `refused`: fusions to refuse up front (see `analyse`).
    """
    analysis = analyse(name, refused)
    if not analysis.rewritten:
        return BuildResult(analysis.target, analysis.outcomes, None)
    text = render_module(analysis, propagate(analysis))
    result = BuildResult(analysis.target, analysis.outcomes, text, list(analysis.rewritten))
    return _validated(name, result, refused) if validate else result


def propagate(analysis: Analysis) -> Emission:
    """Stage 6: the classes to emit (`analyse` already refused what is unreachable), renamed, with the runtime base class
    added, and the tables and imports the generated file needs."""
    target, model, outcomes = analysis.target, analysis.model, analysis.outcomes
    emitted = classes_to_emit(target.module, model, analysis.rewritten)
    pieces = piece_table(model, outcomes)
    for item in emitted.values():
        if isinstance(item.classdef, ast.ClassDef):  # reads of a projection kept through the merged rows
            rewrite_piece_references(item.classdef, vars(item.module), pieces)
    renames = fused_names(emitted)
    add_runtime_base(emitted, model)
    for item in emitted.values():
        rename_classes(item.classdef, renames)
    kind_names = {name for kind in fusions.kinds() for name in kind.runtime_names}
    imports = import_block(
        emitted,
        set(renames.values()) | TEMPLATE_NAMES,
        {REGISTER, REGISTER_AUTO} if target.generates else {REGISTER},
        {CHECK, MIXIN, PIECE} | kind_names,
    )
    plans = merged_linears([plan for outcome in outcomes for plan in outcome.fused])
    scopes = checkpoint_scopes(model, outcomes)
    return Emission(
        emitted,
        renames,
        imports,
        plans,
        scopes,
        checkpoint_classes(model, target, renames, merging_original_classes(outcomes)),
        stacked_mapping(plans),
        tensor_parallel(model, plans, scopes),
    )


def render_module(analysis: Analysis, emission: Emission) -> str:
    """Stage 7: the generated module's text, from the template."""
    target, outcomes = analysis.target, analysis.outcomes
    renames, plans = emission.renames, emission.plans
    sources = [class_text(name, item.classdef, item.module) for name, item in emission.emitted.items()]
    return render(
        fusegen_version=fusegen.__version__,
        transformers_version=transformers.__version__,
        source_module=target.module.__name__,
        model_type=target.model_type,
        build_target=target.source,
        fingerprint=source_fingerprint(target.module),
        fused_lines=[
            _comment_line(f"{fused_name(o.class_name)}: {plan.describe()}") for o in outcomes for plan in o.fused
        ],
        refused_lines=[
            _comment_line(f"{o.class_name}: {refusal.describe()}") for o in outcomes for refusal in o.refused
        ],
        causal_lm=target.causal_lm.__name__,
        summary=_summary(target.causal_lm.__name__, outcomes),
        imports=emission.imports,
        stacked_params_mapping=repr(emission.stacked),
        packed_modules_mapping=repr({plan.merged: list(plan.projections) for plan in plans}),
        classes=sources,
        checkpoint_classes=repr(emission.checkpoint_classes),
        fused_causal_lm=renames[target.causal_lm.__name__],
        scopes=repr(emission.scopes),
        generates=target.generates,
        exports=repr(sorted(renames.values())),
        **emission.tensor_parallel,
    )


def _validated(name: str, result: BuildResult, refused: Vetoes | None) -> BuildResult:
    """Stage 8: `result` if its text computes what the original computes (`fusegen.compiler.validate`); else the
    build again with the fusions of one class refused (rule `validation-mismatch`, naming the config and the
    figure), trying each fused class in turn until the rest validates; else no text and every fusion refused.

    A retry is itself validated, so what is written has always passed; only a failing build pays for the retries.
    """
    from fusegen.compiler import validate

    try:
        report = validate.validate(result.target, result.text)
    except Exception as error:  # noqa: BLE001 - an unvalidated file is not written; say why instead of crashing
        report = validate.Validation([validate.Check("tiny", "mismatch", f"validation failed: {error!r}"[:500])])
    result.validation = report
    mismatch = report.mismatch
    if mismatch is None:
        return result
    reason = validate.refusal_reason(mismatch)
    if not refused:
        for outcome in (o for o in result.outcomes if o.fused):
            veto = Veto(validate.RULE, reason)
            retry = build(name, refused={outcome.class_name: {plan.merged: veto for plan in outcome.fused}})
            if retry.text is not None:
                return retry
    outcomes = [
        ClassOutcome(
            outcome.class_name,
            [],
            outcome.refused + [Refusal(plan.subject, validate.RULE, reason) for plan in outcome.fused],
            outcome.trace_error,
        )
        for outcome in result.outcomes
    ]
    return BuildResult(result.target, outcomes, None, [], report)


def _summary(causal_lm: str, outcomes: list[ClassOutcome]) -> str:
    """The docstring's first sentence after `Fused <causal_lm>: `, from the plans applied: the merged linears by name,
    then each other kind's `summary` with the classes it rewrote, one line each (wrapped to the line length)."""
    merged = list(dict.fromkeys(plan.merged for o in outcomes for plan in merged_linears(o.fused)))
    parts = [f"sibling projections merged into one GEMM each ({', '.join(merged)})"] if merged else []
    rewritten: dict[str, list[str]] = {}
    for outcome in outcomes:
        for plan in outcome.fused:
            if not plan.shards:
                rewritten.setdefault(plan.kind, []).append(fused_name(outcome.class_name))
    for name, classes in rewritten.items():
        words = fusions.kind(name).summary or f"rewritten by the {name} kind"
        parts.append(f"{', '.join(dict.fromkeys(classes))}: {words}")
    lead = f"Fused {causal_lm}: "
    lines = [textwrap.fill(part, LINE_LENGTH - 4, break_long_words=False) for part in [lead + parts[0], *parts[1:]]]
    return ";\n".join(lines)[len(lead) :]


def _comment_line(text: str) -> str:
    """`text` on one line, for the header's `#` comments: a reason quoting a multi-line statement (an `assert`
    unparsed as `if ...: raise ...`) would otherwise end the comment and break the file."""
    return " ".join(text.split())
