"""The markdown of `docs/coverage.md`, rendered from the rows (never edited by hand)."""

from __future__ import annotations

import re
from dataclasses import dataclass, field

from fusegen.compiler.rules import registry
from fusegen.testkit import (  # the one kit (fusegen/testkit.py)
    TOLERANCE,
)
from fusegen.tools.coverage.analysis import (
    PARTS,
    TOWER_LABELS,
    TOWERS,
    fused_in,
    inherent_cases,
    packed_in,
    refused_in,
    summary_counts,
    trace_stops,
)
from fusegen.tools.coverage.rows import BATCH, LENGTH, NEW_TOKENS, Row

MAPPINGS = {
    "causal-lm": ("causal LM", "AutoModelForCausalLM"),
    "image-text-to-text": ("image-text-to-text model", "AutoModelForImageTextToText"),
    "multimodal-lm": ("multimodal LM", "AutoModelForMultimodalLM"),
    "seq2seq-lm": ("seq2seq LM", "AutoModelForSeq2SeqLM"),
    "speech-seq2seq": ("speech seq2seq model", "AutoModelForSpeechSeq2Seq"),
    "text-encoding": ("text-encoding model", "AutoModelForTextEncoding"),
    "masked-lm": ("masked LM", "AutoModelForMaskedLM"),
    "dual-encoder": ("dual encoder (zero-shot image classification)", "AutoModelForZeroShotImageClassification"),
}
"""Mapping (`fusegen.compiler.resolve.UNIVERSE`) -> (what one of its models is called, its Auto class)."""


def part_cell(row: Row, part: str, tower: str | None = None) -> str:
    """`fused` (verified or not: the last column says), `refused: <rules>`, `packed` (the checkpoint already stores
    it merged), or empty when the model has no such group; in the classes of `tower` only, if given."""
    if fused_in(row, part, tower):
        return "fused"
    refused = refused_in(row, part, tower)
    if refused:
        return "refused: " + ", ".join(refused)
    return "packed" if packed_in(row, part, tower) else ""


def part_columns(rows: list[Row]) -> list[tuple[str, str, str | None]]:
    """The per-type table's part columns, (header, part, tower): attention once per tower that some row has
    attention in (fused, refused or packed), the text model's always; then MLP, norm, other."""
    towers = [t for t in TOWERS if t == "text" or any(part_cell(r, "attention", t) for r in rows)]
    columns = [(f"attention ({TOWER_LABELS[t].removeprefix('the ')})", "attention", t) for t in towers]
    if towers == ["text"]:
        columns = [("attention", "attention", None)]
    return columns + [(part, part, None) for part in PARTS if part != "attention"]


def _summary_markdown(row: Row, columns: list[tuple[str, str, str | None]] | None = None) -> str:
    refusals = [
        f"{refusal['rule']}: {outcome['class']}"
        for outcome in row.report.get("classes", [])
        for refusal in outcome["refused"]
    ]
    stops = [f"{name}: {why}" for name, why in trace_stops(row)]
    columns = columns or [(part, part, None) for part in PARTS]
    cells = [f"`{row.model_type}`", *(_escape(part_cell(row, part, tower)) for _, part, tower in columns)]
    cells += [_cell(list(dict.fromkeys(refusals))), _cell(stops), _escape(_configs_cell(row))]
    return "| " + " | ".join(cells) + " |"


def _configs_cell(row: Row) -> str:
    """`yes: tiny + N variants` when every config is verified, else what is not, by config."""
    v = row.verification
    if v is None:
        return "" if row.status != "fused" else "no: not run"
    checks = v.checks or [{"config": "tiny", "status": v.status}]
    variants = [c for c in checks if c["config"] != "tiny"]
    passed = [c["config"] for c in variants if c["status"] == "verified"]
    skipped = [c["config"] for c in variants if c["status"] == "skipped"]
    if v.status != "verified":
        return f"no ({v.status})"
    text = f"yes: tiny + {len(passed)} variant{'s' if len(passed) != 1 else ''}"
    if passed:
        text += f" ({', '.join(passed)})"
    if skipped:
        text += f"; skipped: {', '.join(skipped)}"
    if v.left_out:
        text += f"; {len(v.left_out)} not run (--variants)"
    return text


def check_rules_registered(rows: list[Row]) -> None:
    """Raise `ValueError` naming each rule id of `rows`' refusals that the rule registry does not know."""
    known = registry()
    unknown = sorted(
        {
            f"{refusal['rule']} ({row.model_type}, {outcome['class']})"
            for row in rows
            for outcome in row.report.get("classes", [])
            for refusal in outcome["refused"]
            if refusal["rule"] not in known
        }
    )
    if unknown:
        raise ValueError(f"refusals with rule ids not in fusegen.compiler.rules: {', '.join(unknown)}")


@dataclass
class RunInfo:
    """How the page's rows were obtained: printed on the page (the one part of it that depends on the run)."""

    command: str
    seconds: float
    variants: int | None = None
    only: list[str] | None = None
    reused: dict[str, str] = field(default_factory=dict)
    """`{model type: mapping}`: rows taken from a run of another mapping that built the same class (`--reuse`)."""
    rerun: dict | None = None
    """`{"command", "seconds", "types"}`: rows replaced by a later run of those types (`--rerun-into`), after changes
    that affect them; the page names them and that run."""


RUN_LINE = re.compile(r"^Run: `(?P<command>[^`]+)`, wall time (?P<seconds>\d+) s")
"""The page's run line, which `render_index` reads back."""


def render_markdown(rows: list[Row], mapping: str = "causal-lm", run: RunInfo | None = None) -> str:
    """The page of one Auto mapping (`MAPPINGS`): each of its model types built with the class the mapping
    registers for it. Nothing but the run line depends on the run, so a rerun only diffs on real changes.

    Every rule id it names must be in the rule registry (`fusegen.compiler.rules`), which documents each one in
    docs/analysis.md; an unregistered id is a bug, raised here rather than published."""
    import transformers

    import fusegen

    check_rules_registered(rows)
    what, auto = MAPPINGS[mapping]
    columns = part_columns(rows)

    lines = [
        f"# Coverage: every {what} of the installed Transformers (`{mapping}`)",
        "",
        (
            f"Generated by `python -m fusegen.tools.coverage --mapping {mapping}` (fusegen {fusegen.__version__}, "
            f"transformers {transformers.__version__}, torch {_torch_version()}). Never edit by hand: rerun the "
            "command. Part of [the coverage of every mapping](../coverage.md)."
        ),
        "",
        (
            f"Each model type `{auto}` registers is built with the class registered there (`fusegen build "
            f"TYPE:{mapping}`), whatever the type's default head is."
        ),
        "",
    ]
    if run is not None:
        lines += [_run_line(run), ""]
    lines += [
        (
            f"Verification: the original {what} is built from a tiny config (`fusegen/compiler/shrink.py`), every "
            "parameter drawn by `fusegen.testkit.randomise` (matrices N(0, 1/fan_in), vectors N(0, 1)), saved with "
            "`save_pretrained`, and loaded into the fused class with `from_pretrained` (any missing, unexpected or "
            "mismatched key fails). Both are given the inputs the forward takes besides token ids "
            "(`fusegen.compiler.modal_inputs.forward_inputs`: images with image tokens placed as the processor "
            "would, videos, audio features or waveforms in the layout the original runs, with audio tokens where "
            "the model reads them, decoder tokens; the details table says `given ...`); a model whose forward "
            "reads no token ids gets that batch alone. Every class the fused module defines that the fused model "
            "builds must run on it: one that never runs fails the check (fused but never executed is not "
            "verified). Logits (an encoder's "
            f"last hidden state) on a fixed random {BATCH}x{LENGTH} input must agree within {TOLERANCE:g} times "
            "their scale, max(1, max |logit|) (fp32; `fusegen.compiler.validate.logits_tolerance`), and, for a "
            f"model that generates, {NEW_TOKENS} greedy tokens must be identical. The same check runs under every "
            "construction variant of the tiny config: each config with one field changed that changes what "
            "`__init__` builds (a bias flag, MQA, dense vs MoE layers, a layer-kind list made uniform, an optional "
            "projection; `fusegen/compiler/validate.py`, `construction_variants`, every field probed). A type counts "
            "as verified only if every config verified; a variant the original itself cannot run is listed as "
            "skipped, never counted."
        ),
        "",
        (
            "Text model and towers: a class belongs to the vision (audio) tower when its module path in the original "
            "passes through a module named `vision*`, `visual*`, `image*`, `img*` or `vit*` (`audio*`, `speech*`), "
            "e.g. `model.visual.blocks.*.attn`, `model.vision_tower.encoder.layers.*.self_attn` "
            "(`fusegen.tools.coverage.analysis.TOWER_NAMES`); every other class is the text model's. A class in "
            "both (CLIP's attention) counts in both."
        ),
        "",
        "## Summary",
        "",
        "| | model types |",
        "|---|---:|",
    ]
    lines += [f"| {label} | {count} |" for label, count in summary_counts(rows)]
    lines += [
        "",
        "## Per model type: what is fused",
        "",
        (
            "`fused`: merged (the last column says whether verified); `refused: <rule ids>`: a group was found and "
            "declined (the detailed table below gives each reason); `packed`: the checkpoint already stores the group "
            "merged. Trace stops name the class and why its trace ended before the end of its forward."
        ),
        "",
        "| model type | "
        + " | ".join(header for header, _, _ in columns)
        + " | refused (rule: class) | trace stopped | verified under |",
        "|---|" + "---|" * len(columns) + "---|---|---|",
    ]
    lines += [_summary_markdown(row, columns) for row in rows]
    lines += ["", "## Unreachable fusions, and why", ""]
    unreachable = [
        f"- `{row.model_type}`, {outcome['class']}: {refusal['reason']}"
        for row in rows
        for outcome in row.report.get("classes", [])
        for refusal in outcome["refused"]
        if refusal["rule"] == "unreachable"
    ]
    lines += unreachable or [f"None: every fused class is built by its {what}."]
    lines += [
        "",
        "## Inherent cases, and why",
        "",
        (
            "Errors, trace stops and skipped verifications that no change on our side makes pass: `environment` (a library this environment "
            "does not install), `data-dependent forward` (the forward's structure follows tensor values), "
            "`meta-trace limit` (no input we can build reaches the class on `meta`), `upstream fault` (the original's "
            "forward fails on every input, so a fused type stays unverified). Upstream faults of a default "
            "config are worked around in `fusegen/compiler/shrink.py` (`FIXES`); a config the original itself does not "
            "run after its own `from_pretrained` is listed as skipped with `upstream:` in its reason."
        ),
        "",
    ]
    inherent = [
        f"- `{row.model_type}`, {what}: **{category}**: {reason}"
        for row in rows
        for what, category, reason in inherent_cases(row)
    ]
    lines += inherent or ["None."]
    lines += [
        "",
        "## Per model type: details",
        "",
        "| model type | build | fused | refused | already fused | verified | error |",
        "|---|---|---|---|---|---|---|",
    ]
    lines += [_row_markdown(row) for row in rows]
    return "\n".join(lines) + "\n"


def _run_line(run: RunInfo) -> str:
    minutes = run.seconds / 60
    line = (
        f"Run: `{run.command}`, wall time {run.seconds:.0f} s ({minutes:.0f} min) on a 2-core machine shared with "
        "other jobs."
    )
    if run.variants is not None:
        line += (
            f" Construction variants limited to {run.variants} per type (`--variants {run.variants}`): a type's "
            "'verified under' cell says how many were found and not run, so its 'verified' means verified under "
            "the tiny config and those run."
        )
    if run.only:
        line += f" Only {len(run.only)} type{'s were' if len(run.only) != 1 else ' was'} run (`--only`)."
    by_source: dict[str, list[str]] = {}
    for model_type, source in run.reused.items():
        by_source.setdefault(source, []).append(model_type)
    for source, types in by_source.items():
        line += (
            f" The rows of {len(types)} types are the `{source}` run's, which built the same class for them "
            f"(`--reuse`; its wall time is not in the figure above): {', '.join(f'`{t}`' for t in types)}."
        )
    if run.rerun:
        types = run.rerun["types"]
        line += (
            f" The rows of {len(types)} type{'s' if len(types) != 1 else ''} come from a later run of "
            f"{'those types' if len(types) != 1 else 'it'}, `{run.rerun['command']}` "
            f"({run.rerun['seconds']:.0f} s), after changes that affect them; the other rows are the run above's: "
            f"{', '.join(f'`{t}`' for t in types)}."
        )
    return line


def read_page(text: str) -> tuple[list[tuple[str, int]], str]:
    """(summary counts, run line) of a page `render_markdown` wrote; the index is made from these."""
    summary = text.split("## Summary", 1)[1].split("\n## ", 1)[0] if "## Summary" in text else ""
    counts = []
    for line in summary.splitlines():
        cells = [cell.strip() for cell in line.strip().strip("|").split("|")]
        if len(cells) == 2 and cells[1].isdigit():
            counts.append((cells[0], int(cells[1])))
    run = next((line for line in text.splitlines() if RUN_LINE.match(line)), "")
    return counts, run


def render_index(pages: dict[str, str | None]) -> str:
    """`docs/coverage.md`: the summary counts of every mapping's page side by side, and each page's run line;
    `pages` maps each mapping (in `UNIVERSE` order) to its page's text, or None for a mapping not run yet."""
    read = {mapping: read_page(text) for mapping, text in pages.items() if text is not None}
    # today's labels in their order (an `... of which` row right under its total), then any only older pages have
    canonical = [label for label, _ in summary_counts([])]
    labels = list(dict.fromkeys(canonical + [label for counts, _ in read.values() for label, _ in counts]))
    labels = [label for label in labels if any(label in dict(counts) for counts, _ in read.values())]
    lines = [
        "# Coverage: every model type of the Auto mappings fusegen builds",
        "",
        (
            "One page per Auto mapping, each written by one run of `python -m fusegen.tools.coverage --mapping "
            "MAPPING` (this index is rewritten from the pages by every run; never edit either by hand). Each page "
            "has the same tables: the summary counts, then per model type what is fused, refused and why, which "
            "configs verified, the inherent cases, and the details. A model type registered in several mappings "
            "is covered in each, built with that mapping's class."
        ),
        "",
        (
            "Why a page per mapping rather than one long page: the causal-LM page alone is about 100 KB of tables "
            "(196 types), and the eight mappings hold 468 (type, mapping) pairs; each mapping's run takes from "
            "minutes to an hour on two cores, so one run rewrites one page (with its own command and wall time) "
            "and never touches the others' results."
        ),
        "",
        "## Summary by mapping",
        "",
    ]
    if read:
        ran = list(read)
        lines += ["| | " + " | ".join(f"[{m}](coverage/{m}.md)" for m in ran) + " |"]
        lines += ["|---|" + "---:|" * len(ran)]
        for label in labels:
            values = [dict(read[m][0]).get(label) for m in ran]
            lines += [f"| {label} | " + " | ".join("" if v is None else str(v) for v in values) + " |"]
        lines += [""]
    lines += ["## Runs", ""]
    for mapping, text in pages.items():
        if text is None:
            lines += [f"- `{mapping}`: not yet run."]
        else:
            run = read[mapping][1] or (
                "Run: not recorded (a page written before the pages recorded their command and wall time; its "
                "counts are that earlier run's)."
            )
            lines += [f"- [`{mapping}`](coverage/{mapping}.md): {run.removeprefix('Run: ')}"]
    return "\n".join(lines) + "\n"


def _torch_version() -> str:
    import torch

    return torch.__version__


def _row_markdown(row: Row) -> str:
    fused, refused = [], []
    for outcome in row.report.get("classes", []):
        for plan in outcome["fused"]:
            shards = " + ".join(name for name, _ in plan["shards"])
            fused.append(f"{outcome['class']}: {shards} → {plan['merged']} ({plan['kind']})")
        for refusal in outcome["refused"]:
            refused.append(
                f"{outcome['class']}: {' + '.join(refusal['projections'])}: {refusal['rule']}: {refusal['reason']}"
            )
    already = [f"{cls}: {', '.join(names)}" for cls, names in row.inspection.already_fused.items()]
    cells = [
        f"`{row.model_type}`",
        row.status,
        _cell(fused),
        _cell(refused),
        _cell(already),
        _verified_cell(row),
        _cell(
            [_error_line(row.error)]
            if row.error
            else ([f"inspection: {row.inspection.error}"] if row.inspection.error else [])
        ),
    ]
    return "| " + " | ".join(cells) + " |"


def _verified_cell(row: Row) -> str:
    v = row.verification
    if v is None:
        return "" if row.status != "fused" else "no: not run"
    if v.status == "verified":
        note = f"; {v.reason}" if v.reason else ""
        configs = f"{len(v.checks)} configs; " if len(v.checks) > 1 else ""
        return _escape(f"yes ({configs}max abs diff {v.max_abs_diff:.1e}; greedy {v.greedy}{note})")
    detail = v.reason or v.status
    return _escape(f"no ({v.status}): {detail}")


def _error_line(error: str) -> str:
    """The last line of a traceback (or the whole message of a reasoned error)."""
    lines = [line for line in error.strip().splitlines() if line.strip()]
    return lines[-1].strip() if lines and lines[0].startswith("Traceback") else " ".join(lines)


def _cell(items: list[str]) -> str:
    return "<br>".join(_escape(item) for item in items)


def _escape(text: str) -> str:
    return text.replace("|", "\\|").replace("\n", " ")[:400]
