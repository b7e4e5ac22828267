"""`python -m fusegen.tools.coverage`: build every causal LM, verify each fused one on a tiny random model, write the table.

For each model type the sweep (`fusegen.tools.sweep`) says fused, nothing to fuse, or why not. Each fused type is then
checked in its own worker process, with a timeout: the generated module is imported from a temporary directory, the
ORIGINAL causal LM is built from a tiny config (`fusegen.compiler.shrink`) with every parameter randomised (biases too, so a
mis-sliced bias shows), saved with `save_pretrained`, and loaded into the fused class with `from_pretrained`, the path
users take. Any missing, unexpected or mismatched key fails the check; then logits on a fixed random input must agree
within `logits_tolerance` (TOLERANCE times the logits' scale), and a few greedy tokens must be identical.

The result is `docs/coverage.md`, regenerated (never edited) by this command.
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

from fusegen.tools.coverage.analysis import summary_counts
from fusegen.tools.coverage.markdown import render_markdown
from fusegen.tools.coverage.original import inspect_original
from fusegen.tools.coverage.rows import TIMEOUT, Inspection, Row, Verification
from fusegen.tools.coverage.verification import verify
from fusegen.tools.coverage.workers import run_isolated


def preload() -> None:
    """Import what every worker needs once, before forking: it otherwise costs each worker seconds."""
    import transformers.core_model_loading
    import transformers.generation.utils
    import transformers.modeling_utils  # noqa: F401


def collect(model_types: list[str], jobs: int, timeout: float, log=print, variants: int | None = None) -> list[Row]:
    """Sweep, then inspect every type and verify every fused one (under at most `variants` construction variants
    besides the tiny config; None: all of them), each in its own process."""
    from fusegen.tools.sweep import sweep

    preload()

    entries = {}
    for done, entry in enumerate(sweep(model_types, jobs), start=1):
        entries[entry.model_type] = entry
        log(f"[build {done}/{len(model_types)}] {entry.model_type}: {entry.status}")
    tasks = [(f"inspect:{t}", inspect_original, (t,)) for t in model_types]
    tasks += [(f"verify:{t}", verify, (t, e.text, variants)) for t, e in entries.items() if e.status == "fused"]
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


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m fusegen.tools.coverage", description=__doc__.splitlines()[0])
    parser.add_argument("--jobs", type=int, default=1, metavar="N", help="worker processes (default 1)")
    parser.add_argument("--output", type=Path, default=Path("docs/coverage.md"), metavar="FILE")
    parser.add_argument("--only", nargs="+", metavar="TYPE", help="these model types only")
    parser.add_argument("--timeout", type=float, default=TIMEOUT, metavar="S", help="per model type, in seconds")
    parser.add_argument(
        "--variants",
        type=int,
        default=None,
        metavar="N",
        help="verify at most N construction variants per type besides the tiny config (default: all)",
    )
    args = parser.parse_args(argv)

    from fusegen.compiler.resolve import causal_lm_types

    known = causal_lm_types()
    model_types = known if not args.only else list(dict.fromkeys(args.only))
    unknown = [t for t in model_types if t not in known]
    if unknown:
        parser.error(f"unknown model types: {', '.join(unknown)}")
    start = time.perf_counter()
    log = lambda line: print(line, file=sys.stderr, flush=True)
    rows = collect(model_types, args.jobs, args.timeout, log=log, variants=args.variants)
    text = render_markdown(rows)
    args.output.parent.mkdir(parents=True, exist_ok=True)
    args.output.write_text(text, encoding="utf-8")
    for label, count in summary_counts(rows):
        print(f"{label}: {count}")
    print(f"wrote {args.output} ({len(rows)} model types in {time.perf_counter() - start:.0f} s, {args.jobs} jobs)")
    return 0
