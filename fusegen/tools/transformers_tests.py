"""Run Transformers' own model tests against fusegen's classes and print the tests that fail on the fused classes only.

    python -m fusegen.tools.transformers_tests CHECKOUT TEST_FILE... --model TARGET [--model TARGET...] [-k EXPR]

CHECKOUT is a Transformers source tree of the installed version (its `tests/` with `test_modeling_common.py`,
`causal_lm_tester.py`, `tests/models/<type>/test_modeling_<type>.py`, ...); TEST_FILE is relative to it
(`tests/models/llama/test_modeling_llama.py`). Each TARGET (`llama`, `bert:masked-lm`, as for `fusegen build`) is
built with `fusegen build` into a temporary directory, for the installed Transformers. Then pytest runs the test
files twice in that checkout, in separate processes: once as they are, once with the generated classes swapped in
for the originals (`fusegen/tools/transformers_swap.py` says what is swapped and why). The outcome of every test id
in the two runs is read from pytest's JUnit XML and compared:

- failed on fused only: the tests to fix (a failure or error with the fused classes, a pass or skip without);
- failed on both, failed on original only: listed with their counts, so a broken checkout or an environment problem
  shows up as what it is;
- a test that ran on one side only (collected differently) is listed too.

Exit code 0 when no test fails on the fused classes only, 1 when some do, 2 for bad input (no checkout, a test file
that is not there, a target that does not build).

Why run the originals too, rather than trust a clean run: Transformers' common tests assume GPUs, hub access and
optional packages this machine may lack, and some fail for the original classes here. Only the difference is
fusegen's.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
from dataclasses import dataclass, field
from pathlib import Path
from xml.etree import ElementTree

from fusegen.errors import EXIT_DRIFT, EXIT_OK, InputError, command
from fusegen.tools.transformers_swap import FILES_ENV, REPORT_ENV

PLUGIN = "fusegen.tools.transformers_swap"
FAILED, PASSED, SKIPPED = "failed", "passed", "skipped"


@dataclass
class Run:
    """One pytest run: the outcome of each test id, and the first line of each failure's message."""

    outcomes: dict[str, str] = field(default_factory=dict)
    messages: dict[str, str] = field(default_factory=dict)
    skips: dict[str, str] = field(default_factory=dict)
    returncode: int = 0

    def ids(self, outcome: str) -> list[str]:
        return sorted(test for test, seen in self.outcomes.items() if seen == outcome)


@dataclass
class Comparison:
    original: Run
    fused: Run
    swapped: dict[str, str]
    tested: dict[str, list[str]] = field(default_factory=dict)
    """Per test class, the generated classes in its `all_model_classes` in the fused run."""

    @property
    def fused_only(self) -> list[str]:
        return [t for t in self.fused.ids(FAILED) if self.original.outcomes.get(t, FAILED) != FAILED]

    @property
    def original_only(self) -> list[str]:
        return [t for t in self.original.ids(FAILED) if self.fused.outcomes.get(t) in (PASSED, SKIPPED)]

    @property
    def skipped_fused_only(self) -> list[str]:
        """Passed with the originals, skipped with the fused classes: not a failure, but nothing was checked."""
        return [t for t in self.fused.ids(SKIPPED) if self.original.outcomes.get(t) == PASSED]

    @property
    def both(self) -> list[str]:
        return [t for t in self.fused.ids(FAILED) if self.original.outcomes.get(t) == FAILED]

    @property
    def one_sided(self) -> list[str]:
        return sorted(set(self.original.outcomes) ^ set(self.fused.outcomes))


def read_junit(path: Path) -> Run:
    """Each `<testcase>` of a JUnit XML file as `class::name` with outcome failed (failure or error), skipped or
    passed; a test id reported twice (a teardown error after a pass) counts as failed."""
    run = Run()
    for case in ElementTree.parse(path).getroot().iter("testcase"):
        test = f"{case.get('classname', '').rpartition('.')[2]}::{case.get('name')}"
        problems = [child for child in case if child.tag in ("failure", "error")]
        if problems:
            run.outcomes[test] = FAILED
            text = problems[0].get("message") or problems[0].text or ""
            run.messages[test] = " ".join(text.strip().splitlines()[:1])[:300]
        elif any(child.tag == "skipped" for child in case):
            run.outcomes.setdefault(test, SKIPPED)
            skipped = next(child for child in case if child.tag == "skipped")
            run.skips[test] = " ".join((skipped.get("message") or "").strip().splitlines()[:1])[:300]
        else:
            run.outcomes.setdefault(test, PASSED)
    return run


def build_targets(targets: list[str], output_dir: Path) -> list[Path]:
    """`fusegen build TARGET --output-dir output_dir` for each target; the generated files written."""
    for target in targets:
        model, _, head = target.partition(":")
        argv = [sys.executable, "-m", "fusegen", "build", model, "--output-dir", str(output_dir)]
        if head:
            argv += ["--head", head]
        done = subprocess.run(argv, check=False, capture_output=True, text=True, env=_environment())
        if done.returncode != 0:
            raise InputError(f"`fusegen build {target}` failed (exit {done.returncode}): {done.stderr.strip()[-800:]}")
    files = sorted(output_dir.glob("fused_*.py"))
    if not files:
        raise InputError(f"`fusegen build {' '.join(targets)}` wrote no file (nothing fused)")
    return files


def _environment(extra: dict[str, str] | None = None) -> dict[str, str]:
    """This process's environment with this fusegen first on the path, so pytest's process imports the same one."""
    root = str(Path(__file__).resolve().parents[2])
    path = os.environ.get("PYTHONPATH", "")
    return {**os.environ, "PYTHONPATH": os.pathsep.join(p for p in (root, path) if p), **(extra or {})}


def run_pytest(checkout: Path, test_files: list[str], junit: Path, pytest_args: list[str], env: dict | None) -> Run:
    """pytest on the test files in the checkout (its own pytest configuration), outcomes from its JUnit XML."""
    argv = [sys.executable, "-m", "pytest", *test_files, "-q", "-p", "no:cacheprovider", "-o", "addopts="]
    argv += [f"--junitxml={junit}", *pytest_args]
    log = junit.with_suffix(".log")
    with open(log, "w", encoding="utf-8") as handle:
        done = subprocess.run(
            argv, check=False, cwd=checkout, stdout=handle, stderr=subprocess.STDOUT, env=_environment(env)
        )
    if not junit.is_file():
        raise InputError(f"pytest wrote no report (exit {done.returncode}); its output is in {log}")
    run = read_junit(junit)
    run.returncode = done.returncode
    return run


def compare(checkout: Path, test_files: list[str], generated: list[Path], work: Path, pytest_args: list[str]):
    original = run_pytest(checkout, test_files, work / "original.xml", pytest_args, None)
    report = work / "swapped.json"
    env = {FILES_ENV: os.pathsep.join(str(path) for path in generated), REPORT_ENV: str(report)}
    fused = run_pytest(checkout, test_files, work / "fused.xml", [*pytest_args, "-p", PLUGIN], env)
    document = json.loads(report.read_text(encoding="utf-8")) if report.is_file() else {}
    tested = {name: classes for name, classes in document.get("tested", {}).items() if classes}
    if not document.get("swapped") or not tested:
        raise InputError(
            f"the fused run tested no generated class (swapped: {document.get('swapped')}, test classes: "
            f"{document.get('tested')}); its output is in {work / 'fused.log'}"
        )
    return Comparison(original, fused, document["swapped"], tested)


def _counts(run: Run) -> str:
    return f"{len(run.outcomes)} run: {len(run.ids(PASSED))} passed, {len(run.ids(FAILED))} failed, " + (
        f"{len(run.ids(SKIPPED))} skipped"
    )


def render(comparison: Comparison) -> str:
    lines = ["swapped: " + ", ".join(f"{name} -> {where}" for name, where in sorted(comparison.swapped.items()))]
    lines += [
        f"{test}.all_model_classes, fused: {', '.join(names)}" for test, names in sorted(comparison.tested.items())
    ]
    lines.append(f"original: {_counts(comparison.original)}")
    lines.append(f"fused:    {_counts(comparison.fused)}")
    sections = (
        ("failed on fused only", comparison.fused_only, comparison.fused.messages),
        ("failed on both", comparison.both, comparison.fused.messages),
        ("failed on original only", comparison.original_only, comparison.original.messages),
        ("skipped on fused only (passed on original)", comparison.skipped_fused_only, comparison.fused.skips),
        ("ran on one side only", comparison.one_sided, {}),
    )
    for title, tests, messages in sections:
        lines.append(f"{title}: {len(tests)}")
        lines += [f"  {test}" + (f"  -- {messages[test]}" if test in messages else "") for test in tests]
    return "\n".join(lines)


def parse_args(argv: list[str] | None) -> tuple[argparse.Namespace, list[str]]:
    parser = argparse.ArgumentParser(
        prog="python -m fusegen.tools.transformers_tests",
        description="Run Transformers' own model tests twice (original classes, fusegen's) and print the tests that "
        "fail on the fused classes only. Arguments after `--` go to pytest.",
    )
    parser.add_argument("checkout", help="a Transformers source tree of the installed version (holding tests/)")
    parser.add_argument("test_files", nargs="+", help="test modules relative to the checkout")
    parser.add_argument("--model", action="append", required=True, help="a `fusegen build` target (TYPE[:HEAD])")
    parser.add_argument("-k", dest="keyword", help="pytest -k expression (e.g. LlamaModelTest)")
    parser.add_argument("--keep", help="keep the generated files, JUnit reports and logs in this directory")
    argv = list(sys.argv[1:] if argv is None else argv)
    extra = argv[argv.index("--") + 1 :] if "--" in argv else []
    args = parser.parse_args(argv[: argv.index("--")] if "--" in argv else argv)
    return args, extra


@command
def main(argv: list[str] | None = None) -> int:
    args, pytest_args = parse_args(argv)
    checkout = Path(args.checkout).resolve()
    if not (checkout / "tests" / "test_modeling_common.py").is_file():
        raise InputError(f"{checkout} holds no tests/test_modeling_common.py: not a Transformers checkout")
    for test_file in args.test_files:
        if not (checkout / test_file).is_file():
            raise InputError(f"no test file {checkout / test_file}")
    if args.keyword:
        pytest_args = ["-k", args.keyword, *pytest_args]
    with tempfile.TemporaryDirectory(prefix="fusegen-hf-tests-") as scratch:
        work = Path(args.keep).resolve() if args.keep else Path(scratch)
        work.mkdir(parents=True, exist_ok=True)
        generated = build_targets(args.model, work / "generated")
        comparison = compare(checkout, args.test_files, generated, work, pytest_args)
    print(render(comparison))
    return EXIT_DRIFT if comparison.fused_only else EXIT_OK


if __name__ == "__main__":
    sys.exit(main())
