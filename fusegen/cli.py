"""`fusegen` command line.

Exit codes: 0 ok, 1 drift found (or a verified model out of tolerance), 2 bad usage or input, 3 internal error
(defined once, with the error printing, in fusegen/errors.py).
"""

from __future__ import annotations

import argparse
import contextlib
import gc
import json
import os
import sys
import time
from pathlib import Path

import fusegen
from fusegen.compiler.resolve import UNIVERSE
from fusegen.errors import EXIT_DRIFT, EXIT_ERROR, EXIT_OK, InputError, command

SWEEP_SUMMARY = "fusegen-sweep.json"
"""What `build --all` leaves in the output directory for `fusegen list` to read."""


class _Parser(argparse.ArgumentParser):
    def error(self, message: str):  # argparse exits 2 too; keep the message style ours
        self.print_usage(sys.stderr)
        self.exit(EXIT_ERROR, f"fusegen: error: {message}\n")


class Console:
    """Where messages go: `-q` silences progress, `-v` adds detail; errors always show."""

    def __init__(self, verbosity: int):
        self.verbosity = verbosity

    def info(self, message: str) -> None:
        if self.verbosity >= 0:
            print(message)

    def detail(self, message: str) -> None:
        if self.verbosity > 0:
            print(message)

    def diff(self, text: str) -> None:
        sys.stdout.write(colourise(text) if sys.stdout.isatty() and "NO_COLOR" not in os.environ else text)


def colourise(diff: str) -> str:
    colours = {"+": "\033[32m", "-": "\033[31m", "@": "\033[36m"}
    out = []
    for line in diff.splitlines(keepends=True):
        colour = None if line.startswith(("+++", "---")) else colours.get(line[:1])
        out.append(f"{colour}{line.rstrip(chr(10))}\033[0m\n" if colour else line)
    return "".join(out)


_HEAD_HELP = (
    "the class to build when the model type registers several: image-text-to-text, multimodal-lm, causal-lm, "
    "seq2seq-lm, speech-seq2seq, base, text-encoding, masked-lm, dual-encoder, sequence-classification, "
    "token-classification, or a class name (BertForMaskedLM); default: the one a user would serve "
    "(`TYPE:HEAD` says the same per target)"
)


def make_parser() -> argparse.ArgumentParser:
    common = argparse.ArgumentParser(add_help=False)
    loudness = common.add_mutually_exclusive_group()
    # SUPPRESS: a subcommand's copy of these options must not reset what was given before it.
    loudness.add_argument(
        "-v", "--verbose", action="store_const", const=1, dest="verbosity", default=argparse.SUPPRESS
    )
    loudness.add_argument("-q", "--quiet", action="store_const", const=-1, dest="verbosity", default=argparse.SUPPRESS)

    parser = _Parser(prog="fusegen", description=__doc__, parents=[common])
    parser.add_argument("--version", action="version", version=f"fusegen {fusegen.__version__}")
    commands = parser.add_subparsers(dest="command", required=True, parser_class=_Parser)

    build = commands.add_parser("build", parents=[common], help="write fused model files, or check them")
    build.add_argument("targets", nargs="*", metavar="TARGET", help="model type (llama) or module path")
    build.add_argument("--output-dir", type=Path, default=Path("generated"), metavar="DIR")
    build.add_argument("--check", action="store_true", help="write nothing; exit 1 if DIR is out of date")
    build.add_argument("--diff", action="store_true", help="write nothing; print the diff of each stale file")
    build.add_argument(
        "--all",
        action="store_true",
        help="every model type of every mapping fusegen accepts (each through its default head), or of --mapping",
    )
    build.add_argument(
        "--mapping",
        choices=UNIVERSE,
        default=None,
        metavar="MAPPING",
        help=f"with --all: the model types one Auto mapping registers, each built through that mapping's class "
        f"({', '.join(UNIVERSE)})",
    )
    build.add_argument("--jobs", type=int, default=1, metavar="N", help="worker processes for --all (default 1)")
    build.add_argument("--head", default=None, metavar="HEAD", help=_HEAD_HELP)
    build.set_defaults(handler=_build)

    diff = commands.add_parser("diff", parents=[common], help="show what fusion changed in each generated class")
    diff.add_argument("targets", nargs="+", metavar="TARGET")
    diff.add_argument(
        "--output-dir",
        type=Path,
        default=Path("generated"),
        metavar="DIR",
        help="where the files are (default: generated)",
    )
    diff.add_argument("--head", default=None, metavar="HEAD", help=_HEAD_HELP)
    diff.set_defaults(handler=_diff)

    report = commands.add_parser("report", parents=[common], help="show what would be fused or refused, and why")
    report.add_argument("targets", nargs="+", metavar="TARGET")
    report.add_argument("--json", action="store_true", help="print the outcomes as JSON")
    report.add_argument("--head", default=None, metavar="HEAD", help=_HEAD_HELP)
    report.set_defaults(handler=_report)

    listing = commands.add_parser(
        "list", parents=[common], help="model types per mapping, their default head, and what fusegen made of them"
    )
    listing.add_argument("--output-dir", type=Path, default=None, metavar="DIR", help="default: generated")
    listing.add_argument(
        "--mapping", choices=UNIVERSE, default=None, metavar="MAPPING", help="only this mapping's model types"
    )
    listing.set_defaults(handler=_list)

    from fusegen.tools import convert, export, verify

    convert.add_parser(commands).set_defaults(handler=lambda args, console: convert.run(args))
    export.add_parser(commands).set_defaults(handler=lambda args, console: export.run(args))
    verify.add_parser(commands).set_defaults(handler=lambda args, console: verify.run(args))
    return parser


OPENMP_WAIT = ("OMP_WAIT_POLICY", "PASSIVE")
"""Set in a `fusegen` process before torch loads its OpenMP runtime (unless the user set it; the processes it starts
inherit it): idle OpenMP worker threads sleep instead of spinning. The build runs thousands of small kernels (the `rmsnorm` kind's exactness check
alone, 510 cases per norm class, each a forward and a backward per side), many of them in a parallel region; with
the default policy each region leaves a worker spinning for a while afterwards, which on 2 cores under load cost
10 to 18 s of CPU for `build llama qwen2` where the work itself is 0.8 s (docs/benchmarks.md, "Build-time
validation"). The policy decides only what an idle thread does, not how work is split or in what order anything
is summed, so no number a build computes or checks changes."""


def quiet_openmp() -> None:
    """`OPENMP_WAIT`, where it can still take effect: torch not imported yet (the command line), and the variable
    not set by the user. A process that imported torch already (a test calling `main`) is left alone."""
    if "torch" not in sys.modules:
        os.environ.setdefault(*OPENMP_WAIT)


YOUNG_THRESHOLD = 20_000
"""The collector's first threshold in a `fusegen` command (`sparse_young_collections`); Python's default is 700."""


@contextlib.contextmanager
def sparse_young_collections():
    """Run the block with the young generation collected every `YOUNG_THRESHOLD` net allocations instead of 700;
    undone after it. `main` runs every command under it, imports included.

    A command imports torch and Transformers (about 440,000 objects that live until the process ends) and then, for
    a build, allocates millions of short-lived ones (syntax trees, tensors, graphs). With the default threshold the
    collector ran some 900 times while `build llama qwen2` imported its modules, and its full collections walked
    the growing heap again and again: 0.75 s of the 3.9 s CPU that importing the two modeling modules takes
    (`python bench/validation.py --cost-only`, its collector lines; docs/benchmarks.md). Reference counting frees nearly all of
    those objects anyway; the collector still reclaims every cycle, only later (a young one after at most
    `YOUNG_THRESHOLD` more net allocations). Nothing a command computes or checks reads the collector, so no result
    changes; what it costs is the memory of cycles that wait longer to be reclaimed."""
    thresholds = gc.get_threshold()
    gc.set_threshold(YOUNG_THRESHOLD, *thresholds[1:])
    try:
        yield
    finally:
        gc.set_threshold(*thresholds)


@contextlib.contextmanager
def frozen_heap():
    """Run the block with the objects alive now left out of the garbage collector's passes (`gc.freeze`), and with
    sparse young collections (`sparse_young_collections`); both undone after it.

    What is alive when a build starts is mostly what torch and Transformers imported: modules, classes and functions
    that live until the process ends. A full collection walks all of them to find none dead; one ran during that
    build and cost 0.2 s of its 2 s. The collector still reclaims every cycle the build leaves; nothing the build
    computes or checks reads the collector, so no result changes (docs/benchmarks.md, "The build's own work, cut").
    A caller that froze objects itself (`gc.unfreeze` cannot tell whose they are) keeps its frozen set as it was:
    then nothing is frozen here, only the threshold set."""
    ours = gc.get_freeze_count() == 0
    if ours:
        gc.freeze()
    try:
        with sparse_young_collections():
            yield
    finally:
        if ours:
            gc.unfreeze()


def main(argv: list[str] | None = None) -> int:
    quiet_openmp()
    with sparse_young_collections():  # from here on: the parser imports torch and Transformers
        args = make_parser().parse_args(argv)
        console = Console(getattr(args, "verbosity", 0))
        if console.verbosity < 0:
            os.environ.setdefault("TRANSFORMERS_VERBOSITY", "error")
        return command(args.handler)(args, console)


def _build(args, console: Console) -> int:
    from fusegen.compiler.build import build
    from fusegen.compiler.writer import drift, output_path, recorded_targets, write_atomic

    if args.mapping is not None and not args.all:
        raise InputError("--mapping selects the model types of --all; name TARGETs (`TYPE:HEAD`) without it")
    if args.all:
        if args.targets or args.check or args.diff:
            raise InputError("--all takes no TARGET and cannot be combined with --check or --diff")
        if args.head is not None:
            raise InputError("--all builds each model type's default head; --head needs TARGETs")
        return _build_all(args, console)
    targets = list(dict.fromkeys(args.targets))
    if not targets:
        if not (args.check or args.diff):
            raise InputError("name at least one TARGET (e.g. `fusegen build llama`), or pass --check")
        recorded = recorded_targets(args.output_dir)
        unknown = [str(path) for path, target in recorded.items() if target is None]
        if unknown:
            raise InputError(f"no `# fusegen-target:` header in {', '.join(unknown)}")
        targets = list(recorded.values())
        if not targets:
            raise InputError(f"no fused_*.py files in {args.output_dir} to check")

    if args.head is not None and not args.targets:
        raise InputError("--head needs TARGETs (with --check alone, each file's header names its head)")
    with frozen_heap():
        results = [build(_headed(target, args.head)) for target in targets]  # all or nothing: any error writes no file
    status = EXIT_OK
    for result in results:
        path = output_path(args.output_dir, result.target.file_stem)
        if result.text is None:
            console.info(
                f"{result.target.source}: nothing fused, no file written "
                f"(`fusegen report {result.target.source}` says why)"
            )
            for outcome in result.outcomes:  # `report` does not validate: say here what validation refused
                for refusal in (r for r in outcome.refused if r.rule == "validation-mismatch"):
                    console.info(f"  {outcome.class_name}: refused {refusal.describe()}")
            if (args.check or args.diff) and path.exists():  # the file on disk is no longer what a build gives
                print(f"{path} is stale: a fresh build writes no file for {result.target.source}", file=sys.stderr)
                status = EXIT_DRIFT if args.check else status
            continue
        if args.check or args.diff:
            stale = drift(path, result.text)
            if stale is None:
                console.info(f"{path} is up to date")
                continue
            print(f"would regenerate {path}", file=sys.stderr)
            console.diff(stale)  # the diff is the point of --check in CI logs, so -q keeps it
            status = EXIT_DRIFT if args.check else status
        else:
            write_atomic(path, result.text)
            console.info(f"wrote {path} ({_summary(result)})")
        for outcome in result.outcomes:
            for refusal in outcome.refused:
                console.detail(f"  {outcome.class_name}: refused {refusal.describe()}")
        if result.validation is not None:
            console.detail(f"  validated against the original: {result.validation.describe()}")
    return status


def _headed(target: str, head: str | None) -> str:
    """`target` with `--head` applied (`TYPE:HEAD`; a module path is left to `resolve` to reject it with)."""
    from fusegen.compiler.resolve import resolve

    if head is None:
        return target
    return resolve(target, head).source


def _summary(result) -> str:
    from fusegen.tools.sweep import summarise

    summary = summarise(result.outcomes)
    return summary + ", see the file header" if "refused" in summary else summary


def all_targets(mapping: str | None) -> list[str]:
    """What `build --all` builds: every model type of the universe through its default head, or, with `mapping`,
    every type that mapping registers through that mapping's class (`TYPE:HEAD` where that is not the default)."""
    from fusegen.compiler.resolve import mapping_target, model_types

    if mapping is None:
        return model_types()
    return [mapping_target(model_type, mapping) for model_type in model_types(mapping)]


def _build_all(args, console: Console) -> int:
    from fusegen.compiler.writer import output_path, write_atomic
    from fusegen.tools.sweep import sweep

    if args.jobs < 1:
        raise InputError(f"--jobs must be at least 1, got {args.jobs}")
    start = time.perf_counter()
    model_types = all_targets(args.mapping)
    width = len(str(len(model_types)))
    summary: dict[str, dict] = {}
    for done, entry in enumerate(sweep(model_types, args.jobs), start=1):
        detail = entry.summary or entry.error.strip().splitlines()[-1]
        if entry.text is not None:
            write_atomic(output_path(args.output_dir, entry.file_stem), entry.text)
        summary[entry.model_type] = {"status": entry.status, "detail": detail}
        console.info(f"[{done:>{width}}/{len(model_types)}] {entry.model_type}: {entry.status}: {detail}")
    counts = {status: sum(1 for e in summary.values() if e["status"] == status) for status in _STATUSES}
    totals = ", ".join(f"{count} {status}" for status, count in counts.items())
    path = args.output_dir / SWEEP_SUMMARY
    try:  # a sweep of one mapping keeps what others recorded; a damaged record is replaced
        recorded = _read_sweep(path)
    except InputError:
        recorded = {}
    write_atomic(path, json.dumps(dict(sorted({**recorded, **summary}.items())), indent=1, sort_keys=True) + "\n")
    console.info(f"{len(model_types)} model types in {time.perf_counter() - start:.1f} s ({args.jobs} jobs): {totals}")
    console.info(f"outcomes saved to {path} (read by `fusegen list`)")
    return EXIT_ERROR if counts["crash"] else EXIT_OK


_STATUSES = ("fused", "nothing", "error", "crash")


def _diff(args, console: Console) -> int:
    """Diff the generated file on disk (DIR/fused_<model type>.py); without one, a fresh build, saying so."""
    from fusegen.compiler.resolve import resolve
    from fusegen.compiler.writer import output_path, recorded_fingerprint, source_fingerprint
    from fusegen.tools.diff import file_diff, summary

    for name in dict.fromkeys(args.targets):
        target = resolve(_headed(name, args.head))
        path = output_path(args.output_dir, target.file_stem)
        if path.is_file():
            try:
                text = path.read_text(encoding="utf-8")
            except (OSError, UnicodeDecodeError) as error:
                raise InputError(f"{path}: unreadable: {error}") from error
            label = path.stem
            if recorded_fingerprint(text) != source_fingerprint(target.module):
                console.info(f"{name}: {path} was built from another source of {target.module.__name__}: stale?")
        else:
            from fusegen.compiler.build import build

            console.info(f"{name}: no {path}; diffing a fresh build instead (nothing is written)")
            text = build(target.source).text
            label = output_path(Path(), target.file_stem).stem
            if text is None:
                console.info(f"{name}: nothing fused, nothing to diff")
                continue
        try:
            result = file_diff(text, target.module, label)
        except SyntaxError as error:
            raise InputError(f"{path}: not a Python file: {error}") from error
        for diff in result.diffs:
            console.diff(diff)
        if result.renamed or result.based:
            console.info(summary(label, result).rstrip("\n"))
    return EXIT_OK


def _report(args, console: Console) -> int:
    from fusegen.compiler.build import analyse
    from fusegen.tools.report import report_data, report_text

    analyses = [analyse(_headed(target, args.head)) for target in dict.fromkeys(args.targets)]
    if args.json:
        print(json.dumps(report_data(analyses), indent=2))
    else:
        print(report_text(analyses), end="")
    return EXIT_OK


def _list(args, console: Console) -> int:
    """The model types of each mapping (or of `--mapping`), each with its default head (the class `fusegen build TYPE`
    builds) and the outcome on record for that build: a generated file's header, else the last `build --all`.

    One line per mapping (`causal-lm: 196 model types`), then one per type, indented:
    `  llama: causal-lm LlamaForCausalLM: fused (generated/fused_llama.py)`. A type several mappings register is
    listed under each, always with its one default head.
    """
    from fusegen.compiler.resolve import UNIVERSE, default_head, head_class_name, model_types
    from fusegen.compiler.writer import recorded_targets

    if args.output_dir is not None and not args.output_dir.is_dir():
        raise InputError(f"{args.output_dir}: no such directory")
    directory = args.output_dir or Path("generated")
    built = {target: path for path, target in recorded_targets(directory).items() if target}
    swept = _read_sweep(directory / SWEEP_SUMMARY)
    for mapping in [args.mapping] if args.mapping else UNIVERSE:
        types = model_types(mapping)
        print(f"{mapping}: {len(types)} model types")
        for model_type in types:
            head = default_head(model_type)
            if model_type in built:
                outcome = f"fused ({built[model_type]})"
            elif model_type in swept:
                outcome = f"{swept[model_type]['status']}: {swept[model_type]['detail']}"
            else:
                outcome = "unknown (run `fusegen build --all` or `fusegen report`)"
            print(f"  {model_type}: {head} {head_class_name(model_type, head)}: {outcome}")
    return EXIT_OK


def _read_sweep(path: Path) -> dict:
    """The outcomes `build --all` recorded, or {} if there are none; a damaged file is named, not a traceback."""
    if not path.exists():
        return {}
    try:
        swept = json.loads(path.read_text(encoding="utf-8"))
        if not all(isinstance(entry, dict) and {"status", "detail"} <= entry.keys() for entry in swept.values()):
            raise ValueError("an entry lacks status or detail")
    except (UnicodeDecodeError, ValueError, AttributeError) as error:
        raise InputError(f"{path}: unreadable (remove it or rerun `fusegen build --all`): {error}") from error
    return swept


if __name__ == "__main__":  # pragma: no cover
    sys.exit(main())
