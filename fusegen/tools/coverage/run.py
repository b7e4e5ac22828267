"""`python -m fusegen.tools.coverage`: build every model type of an Auto mapping, verify each fused one, write its page.

The mapping (`--mapping`, causal LMs by default) decides the class each type is built with: the one it registers.

For each model type the sweep (`fusegen.tools.sweep`) says fused, nothing to fuse, or why not. Each fused type is then
checked in its own worker process, with a timeout: the generated module is imported from a temporary directory, the
ORIGINAL causal LM is built from a tiny config (`fusegen.compiler.shrink`) with every parameter randomised (biases too, so a
mis-sliced bias shows), saved with `save_pretrained`, and loaded into the fused class with `from_pretrained`, the path
users take. Any missing, unexpected or mismatched key fails the check; then logits on a fixed random input must agree
within `logits_tolerance` (TOLERANCE times the logits' scale), and a few greedy tokens must be identical.

The result is `docs/coverage/MAPPING.md` and the index `docs/coverage.md`, regenerated (never edited) by this command.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from dataclasses import asdict
from pathlib import Path

from fusegen.tools.coverage.analysis import summary_counts
from fusegen.tools.coverage.markdown import RunInfo, render_index, render_markdown
from fusegen.tools.coverage.original import inspect_original
from fusegen.tools.coverage.rows import TIMEOUT, Inspection, Row, Verification
from fusegen.tools.coverage.verification import verify
from fusegen.tools.coverage.workers import run_isolated


def preload() -> None:
    """Import what every worker needs once, before forking: it otherwise costs each worker seconds."""
    import transformers.core_model_loading
    import transformers.generation.utils
    import transformers.modeling_utils  # noqa: F401


def collect(
    model_types: list[str],
    jobs: int,
    timeout: float,
    log=print,
    variants: int | None = None,
    mapping: str = "causal-lm",
) -> list[Row]:
    """Sweep, then inspect every type and verify every fused one (under at most `variants` construction variants
    besides the tiny config; None: all of them), each in its own process, killed at `timeout` seconds (a build
    that does not finish is a crash).

    Each type is built with the class `mapping` registers for it (`TYPE:mapping`): the causal-LM section covers
    `BertLMHeadModel` and `Gemma3ForCausalLM`, the image-text-to-text section `Gemma3ForConditionalGeneration`, even
    where the type's default head (what `fusegen build TYPE` builds) is another one."""
    from fusegen.tools.sweep import SweepEntry, build_one

    preload()

    entries = {}
    builds = [(t, build_one, (f"{t}:{mapping}",)) for t in model_types]
    for done, (model_type, entry) in enumerate(run_isolated(builds, jobs, timeout), start=1):
        if isinstance(entry, dict):  # the build itself timed out or its process died
            entry = SweepEntry(model_type, "crash", timeout, error=f"build: {entry['status']}: {entry['reason']}")
        entry.model_type = model_type
        entries[model_type] = entry
        log(f"[build {done}/{len(model_types)}] {model_type}: {entry.status}")
    tasks = [(f"inspect:{t}", inspect_original, (t, mapping)) for t in model_types]
    tasks += [
        (f"verify:{t}", verify, (t, e.text, variants, mapping)) for t, e in entries.items() if e.status == "fused"
    ]
    tasks.sort(key=lambda task: task[0].partition(":")[2])
    results: dict[str, dict] = {}
    for done, (key, result) in enumerate(run_isolated(tasks, jobs, timeout), start=1):
        results[key] = result
        if key.startswith("verify:"):
            configs = len(result.get("checks", [])) or 1
            log(
                f"[verify {done}/{len(tasks)}] {key[7:]}: {result.get('status')} ({configs} configs) "
                f"{result.get('reason', '')[:160]}"
            )
    rows = []
    for model_type in model_types:
        entry = entries[model_type]
        inspected = results.get(f"inspect:{model_type}", {})
        if "status" in inspected:  # the inspection itself timed out or crashed
            inspected = {"error": inspected.get("reason", "")}
        verified = results.get(f"verify:{model_type}")
        rows.append(
            Row(
                model_type,
                entry.status,
                entry.report,
                entry.error,
                Inspection(**inspected),
                (
                    Verification(**{k: v for k, v in verified.items() if k in Verification.__dataclass_fields__})
                    if verified
                    else None
                ),
            )
        )
    return rows


DOCS = Path("docs/coverage")
"""Where each mapping's page goes (`MAPPING.md`)."""

INDEX = Path("docs/coverage.md")
"""The index of the pages: every mapping's summary counts side by side (`render_index`)."""


def write_index(index: Path, pages: Path) -> None:
    """Rewrite `index` from the mapping pages in `pages` (a mapping without a page is listed as not yet run)."""
    from fusegen.compiler.resolve import UNIVERSE

    texts = {
        m: (pages / f"{m}.md").read_text(encoding="utf-8") if (pages / f"{m}.md").is_file() else None for m in UNIVERSE
    }
    index.write_text(render_index(texts), encoding="utf-8")


def _command(args) -> str:
    """The command line that obtains the page's rows (where it writes them aside)."""
    words = ["python -m fusegen.tools.coverage", f"--mapping {args.mapping}", f"--jobs {args.jobs}"]
    if args.reuse:
        words.append("--reuse " + " ".join(path.name for path in args.reuse))
    if args.timeout != TIMEOUT:
        words.append(f"--timeout {args.timeout:g}")
    if args.variants is not None:
        words.append(f"--variants {args.variants}")
    if args.only:
        words.append("--only " + " ".join(args.only))
    return " ".join(words)


def reusable(files: list[Path], mapping: str, model_types: list[str]) -> dict[str, tuple[str, Row]]:
    """`{type: (source mapping, row)}` for the types of `model_types` that a saved run of another mapping (`files`,
    written by `--save-rows`) built with the very class `mapping` registers for them: the build, the inspection and
    the verification depend only on the class and the type's config, so that row is this mapping's row."""
    from transformers.models.auto import modeling_auto

    from fusegen.compiler.resolve import HEADS

    def names(head: str) -> dict:
        return getattr(modeling_auto, HEADS[head] + "_NAMES")

    found: dict[str, tuple[str, Row]] = {}
    wanted = names(mapping)
    for file in files:
        saved = json.loads(file.read_text(encoding="utf-8"))
        source = saved["mapping"]
        theirs = names(source)
        for data in saved["rows"]:
            t = data["model_type"]
            if t in model_types and t not in found and source != mapping and theirs.get(t) == wanted.get(t):
                found[t] = (source, row_from_data(data))
    return found


def row_from_data(data: dict) -> Row:
    """A `Row` from its `asdict` form (what `--save-rows` writes)."""
    verification = data["verification"]
    return Row(
        data["model_type"],
        data["status"],
        data["report"],
        data["error"],
        Inspection(**data["inspection"]),
        Verification(**verification) if verification else None,
    )


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m fusegen.tools.coverage", description=__doc__.splitlines()[0])
    parser.add_argument("--jobs", type=int, default=1, metavar="N", help="worker processes (default 1)")
    parser.add_argument(
        "--output",
        type=Path,
        metavar="FILE",
        help="where to write the page (default: docs/coverage/MAPPING.md, and docs/coverage.md, the index of every "
        "mapping's page, is rewritten from the pages there)",
    )
    parser.add_argument("--only", nargs="+", metavar="TYPE", help="these model types only")
    parser.add_argument("--timeout", type=float, default=TIMEOUT, metavar="S", help="per model type, in seconds")
    parser.add_argument(
        "--variants",
        type=int,
        default=None,
        metavar="N",
        help="verify at most N construction variants per type besides the tiny config (default: all)",
    )
    parser.add_argument(
        "--mapping",
        default="causal-lm",
        metavar="HEAD",
        help="the Auto mapping whose model types to cover (fusegen.compiler.resolve.UNIVERSE: causal-lm, "
        "image-text-to-text, multimodal-lm, seq2seq-lm, speech-seq2seq, text-encoding, masked-lm, dual-encoder); "
        "each type is built with the class that mapping registers for it (default: causal-lm)",
    )
    parser.add_argument(
        "--save-rows",
        type=Path,
        metavar="FILE",
        help="also write the run's rows as JSON (`--from-rows` renders them again without rerunning)",
    )
    parser.add_argument(
        "--from-rows",
        type=Path,
        metavar="FILE",
        help="render the page from rows a run saved with --save-rows instead of running",
    )
    parser.add_argument(
        "--rerun-into",
        type=Path,
        metavar="FILE",
        help="with --only: run those types again and put their rows into FILE (rows a whole run saved with "
        "--save-rows), then render the page from FILE; the page names the types and this run",
    )
    parser.add_argument(
        "--reuse",
        nargs="+",
        type=Path,
        default=[],
        metavar="FILE",
        help="rows saved by runs of other mappings (--save-rows): a type whose class there is the class this mapping "
        "registers is taken from them, not run again (the page says which)",
    )
    args = parser.parse_args(argv)
    if args.rerun_into and not args.only:
        parser.error("--rerun-into takes the types to run again from --only")

    from fusegen.compiler.resolve import UNIVERSE
    from fusegen.compiler.resolve import model_types as mapping_types

    if args.mapping not in UNIVERSE:
        parser.error(f"unknown mapping {args.mapping!r}; one of {', '.join(UNIVERSE)}")
    known = mapping_types(args.mapping)
    model_types = known if not args.only else list(dict.fromkeys(args.only))
    unknown = [t for t in model_types if t not in known]
    if unknown:
        parser.error(f"unknown model types: {', '.join(unknown)}")
    if args.from_rows:
        saved = json.loads(args.from_rows.read_text(encoding="utf-8"))
        run_args = parser.parse_args(saved["argv"])
        rows = [row_from_data(data) for data in saved["rows"]]
        seconds = saved["seconds"]
    else:
        run_args = args
        start = time.perf_counter()
        log = lambda line: print(line, file=sys.stderr, flush=True)
        reused = reusable(args.reuse, args.mapping, model_types)
        to_run = [t for t in model_types if t not in reused]
        ran = collect(to_run, args.jobs, args.timeout, log=log, variants=args.variants, mapping=args.mapping)
        seconds = time.perf_counter() - start
        by_type = {row.model_type: row for row in ran} | {t: row for t, (_, row) in reused.items()}
        rows = [by_type[t] for t in model_types]
        saved = {
            "mapping": args.mapping,
            "argv": sys.argv[1:] if argv is None else argv,
            "seconds": seconds,
            "rows": [asdict(r) for r in rows],
            "reused": {t: source for t, (source, _) in reused.items()},
        }
        if args.save_rows:
            args.save_rows.write_text(json.dumps(saved), encoding="utf-8")
        if args.rerun_into:
            saved = _rerun_into(args.rerun_into, saved, _command(args), ran)
            run_args, rows, seconds = (
                parser.parse_args(saved["argv"]),
                [row_from_data(d) for d in saved["rows"]],
                saved["seconds"],
            )
    run = RunInfo(
        _command(run_args), seconds, run_args.variants, run_args.only, saved.get("reused", {}), saved.get("rerun")
    )
    text = render_markdown(rows, run_args.mapping, run)
    output = args.output or DOCS / f"{run_args.mapping}.md"
    output.parent.mkdir(parents=True, exist_ok=True)
    output.write_text(text, encoding="utf-8")
    for label, count in summary_counts(rows):
        print(f"{label}: {count}")
    print(f"wrote {output} ({len(rows)} model types in {seconds:.0f} s, {run_args.jobs} jobs)")
    if args.output is None:
        write_index(INDEX, DOCS)
        print(f"wrote {INDEX}")
    return 0


def _rerun_into(path: Path, rerun: dict, command: str, ran: list) -> dict:
    """The whole run saved in `path` with the rows of `ran` (a later run of some of its types) in their places,
    recorded under "rerun" (the page names the types and the command); written back to `path`."""
    whole = json.loads(path.read_text(encoding="utf-8"))
    if whole["mapping"] != rerun["mapping"]:
        raise SystemExit(f"{path}: rows of mapping {whole['mapping']!r}, not {rerun['mapping']!r}")
    fresh = {row.model_type: asdict(row) for row in ran}
    missing = sorted(set(fresh) - {data["model_type"] for data in whole["rows"]})
    if missing:
        raise SystemExit(f"{path}: no row for {', '.join(missing)} to replace")
    whole["rows"] = [fresh.get(data["model_type"], data) for data in whole["rows"]]
    earlier = (whole.get("rerun") or {}).get("types", [])
    whole["rerun"] = {"command": command, "seconds": rerun["seconds"], "types": sorted({*earlier, *fresh})}
    path.write_text(json.dumps(whole), encoding="utf-8")
    return whole
