"""`fusegen` command line. Exit codes: 0 ok, 1 drift found, 2 bad usage or input."""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import fusegen
from fusegen.errors import FusegenError, InputError

EXIT_OK, EXIT_DRIFT, EXIT_ERROR = 0, 1, 2


class _Parser(argparse.ArgumentParser):
    def error(self, message: str):  # argparse exits 2 too; keep the message style ours
        self.print_usage(sys.stderr)
        self.exit(EXIT_ERROR, f"fusegen: error: {message}\n")


def make_parser() -> argparse.ArgumentParser:
    parser = _Parser(prog="fusegen", description=__doc__)
    parser.add_argument("--version", action="version", version=f"fusegen {fusegen.__version__}")
    commands = parser.add_subparsers(dest="command", required=True, parser_class=_Parser)

    build = commands.add_parser("build", help="write fused model files (or check them with --check)")
    build.add_argument("targets", nargs="*", metavar="TARGET", help="Transformers model type, e.g. llama")
    build.add_argument("--output-dir", type=Path, default=Path("generated"), metavar="DIR")
    build.add_argument(
        "--check", action="store_true", help="write nothing; exit 1 and print a diff if DIR is out of date"
    )
    build.add_argument("--all", action="store_true", help="every causal-LM model type of the installed Transformers")
    build.add_argument("--jobs", type=int, default=1, metavar="N", help="worker processes for --all (default 1)")

    report = commands.add_parser("report", help="show what would be fused or refused, and why")
    report.add_argument("targets", nargs="+", metavar="TARGET")
    report.add_argument("--json", action="store_true", help="print the outcomes as JSON")

    commands.add_parser("list", help="list the causal-LM model types Transformers knows")

    from fusegen import convert, verify

    convert.add_parser(commands).set_defaults(run=convert.run)
    verify.add_parser(commands).set_defaults(run=verify.run)
    return parser


def main(argv: list[str] | None = None) -> int:
    args = make_parser().parse_args(argv)
    try:
        if args.command == "build":
            return _build(args)
        if args.command == "report":
            return _report(args)
        if args.command in ("convert", "verify"):
            return args.run(args)
        return _list()
    except FusegenError as error:
        print(f"fusegen: error: {error}", file=sys.stderr)
        return error.exit_code


def _build(args) -> int:
    from fusegen.build import build
    from fusegen.writer import drift, output_path, recorded_targets, write_atomic

    if args.all:
        if args.targets or args.check:
            raise InputError("--all takes no TARGET and cannot be combined with --check")
        return _build_all(args)
    targets = list(dict.fromkeys(args.targets))
    if not targets:
        if not args.check:
            raise InputError("name at least one TARGET (e.g. `fusegen build llama`), or pass --check")
        recorded = recorded_targets(args.output_dir)
        unknown = [str(path) for path, target in recorded.items() if target is None]
        if unknown:
            raise InputError(f"no `# fusegen-target:` header in {', '.join(unknown)}")
        targets = list(recorded.values())
        if not targets:
            raise InputError(f"no fused_*.py files in {args.output_dir} to check")

    results = [build(target) for target in targets]  # all or nothing: any error writes no file
    status = EXIT_OK
    for result in results:
        path = output_path(args.output_dir, result.target.model_type)
        summary = _summary(result)
        if result.text is None:
            print(f"{result.target.model_type}: nothing to fuse ({summary}); no file written")
            continue
        if args.check:
            diff = drift(path, result.text)
            if diff is not None:
                status = EXIT_DRIFT
                print(f"would regenerate {path}", file=sys.stderr)
                sys.stdout.write(diff)
            else:
                print(f"{path} is up to date")
        else:
            write_atomic(path, result.text)
            print(f"wrote {path} ({summary})")
    return status


def _summary(result) -> str:
    from fusegen.sweep import summarise

    summary = summarise(result.outcomes)
    return summary + ", see the file header" if "refused" in summary else summary


def _build_all(args) -> int:
    import time

    from fusegen.resolve import causal_lm_types
    from fusegen.sweep import sweep
    from fusegen.writer import output_path, write_atomic

    start = time.perf_counter()
    model_types = causal_lm_types()
    counts: dict[str, int] = {}
    for done, entry in enumerate(sweep(model_types, args.jobs), start=1):
        counts[entry.status] = counts.get(entry.status, 0) + 1
        detail = entry.summary or entry.error.strip().splitlines()[-1]
        if entry.text is not None:
            write_atomic(output_path(args.output_dir, entry.model_type), entry.text)
        print(
            f"[{done:>{len(str(len(model_types)))}}/{len(model_types)}] {entry.model_type}: {entry.status}: {detail}"
        )
    totals = ", ".join(f"{counts.get(status, 0)} {status}" for status in ("fused", "nothing", "error", "crash"))
    print(f"{len(model_types)} model types in {time.perf_counter() - start:.1f} s ({args.jobs} jobs): {totals}")
    return EXIT_ERROR if counts.get("crash") else EXIT_OK


def _report(args) -> int:
    import json

    from fusegen.build import analyse
    from fusegen.report import report_data, report_text

    analyses = [analyse(target) for target in dict.fromkeys(args.targets)]
    if args.json:
        print(json.dumps(report_data(analyses), indent=2))
    else:
        print(report_text(analyses), end="")
    return EXIT_OK


def _list() -> int:
    from fusegen.resolve import causal_lm_types

    for name in causal_lm_types():
        print(name)
    return EXIT_OK


if __name__ == "__main__":  # pragma: no cover
    sys.exit(main())
