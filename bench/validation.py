"""What build-time translation validation costs, and what it checked (not a test; prints its figures).

    python bench/validation.py [--rounds 5] [--against DIR] [--cost-only]

1. `fusegen -q build llama qwen2` (validated, as users run it) against the import floor (importing the two
   modeling modules) and against the same pipeline with validation off (`build(name, validate=False)`), each a
   fresh process, interleaved A B C A B C ..., medians; with `--against DIR`, also the same build of another
   checkout (main's worktree) in the same rounds. fusegen's modules are compiled to bytecode first, as an installed
   fusegen's are (`harness.installed_bytecode`), so both sides of the ratio import bytecode. The floor is timed twice:
   as Python runs it, and with the collector as every `fusegen` command sets it before its imports
   (`fusegen.cli.sparse_young_collections`), which makes those imports cheaper too; the second gives the build's
   cost like for like.
2. In this process: the seconds `fusegen.compiler.validate.validate` takes per target (with the gradient-checkpointing step
   the build skips), median of 3, and what each check
   found (max abs logit difference, max relative gradient difference, eval/train/gradient checkpointing).
3. The construction variants found for every checked-in generated file.

Part 1 ends with what the garbage collector costs while the floor's modules import, with Python's threshold and with
`fusegen`'s (`collector_cost`).
"""

from __future__ import annotations

import argparse
import os
import resource
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from harness import installed_bytecode

ROOT = Path(__file__).resolve().parent.parent
FLOOR = "import transformers.models.llama.modeling_llama, transformers.models.qwen2.modeling_qwen2"
SPARSE = "from fusegen.cli import sparse_young_collections\nsparse_young_collections().__enter__()\n"
"""The collector as a `fusegen` command sets it before its imports (`fusegen.cli.sparse_young_collections`)."""
FLOOR_SPARSE = SPARSE + FLOOR
UNVALIDATED = (
    "from fusegen.cli import frozen_heap, quiet_openmp\nquiet_openmp()\n"  # as `fusegen` runs: before torch loads,
    + SPARSE  # and with the collector as `fusegen` sets it, imports included
    + "from fusegen.compiler.build import build\nwith frozen_heap():\n"
    "    for name in ('llama', 'qwen2'):\n        build(name, validate=False)"
)


def timed(command: list[str], cwd: Path = ROOT) -> tuple[float, float]:
    """(wall seconds, CPU seconds) of one fresh process. CPU time is the steadier figure on a shared machine:
    other processes stretch the wall clock of both sides of a ratio, but hardly the work each side does."""
    before = resource.getrusage(resource.RUSAGE_CHILDREN)
    start = time.perf_counter()
    subprocess.run(command, check=True, cwd=cwd, capture_output=True)
    wall = time.perf_counter() - start
    after = resource.getrusage(resource.RUSAGE_CHILDREN)
    return wall, (after.ru_utime - before.ru_utime) + (after.ru_stime - before.ru_stime)


def build_cost(rounds: int, against: Path | None = None) -> None:
    """`against`: another checkout (e.g. main's worktree) whose `python -m fusegen -q build llama qwen2` runs in the
    same rounds, with this interpreter and from that directory (so `-m` imports its `fusegen`)."""
    start_load = os.getloadavg()[0]
    with tempfile.TemporaryDirectory(prefix="fusegen-bench-validation-") as out:
        build = [sys.executable, "-m", "fusegen", "-q", "build", "llama", "qwen2", "--output-dir", out]
        commands = {
            "fusegen -q build llama qwen2 (validated)": (build, ROOT),
            "same pipeline, validate=False": ([sys.executable, "-c", UNVALIDATED], ROOT),
            "import floor": ([sys.executable, "-c", FLOOR], ROOT),
            "import floor, collector as fusegen sets it": ([sys.executable, "-c", FLOOR_SPARSE], ROOT),
        }
        if against is not None:
            commands[f"the same build in {against}"] = (build, against)
        for checkout in {ROOT, against or ROOT}:  # as an installed fusegen is (see `installed_bytecode`)
            if not installed_bytecode(checkout):
                raise SystemExit(f"fusegen in {checkout} does not compile")
        for command, cwd in commands.values():  # warm the page cache once
            timed(command, cwd)
        samples: dict[str, list[tuple[float, float]]] = {label: [] for label in commands}
        for _ in range(rounds):
            for label, (command, cwd) in commands.items():
                samples[label].append(timed(command, cwd))
    print(
        f"## build cost: {rounds} interleaved rounds, fresh processes, medians (load average {os.getloadavg()[0]:.1f}"
        f" at the end, {start_load:.1f} at the start)"
    )
    validated, unvalidated, floor, floor_sparse = (
        "fusegen -q build llama qwen2 (validated)",
        "same pipeline, validate=False",
        "import floor",
        "import floor, collector as fusegen sets it",
    )
    for index, kind in enumerate(("wall", "CPU")):
        medians = {label: statistics.median(v[index] for v in values) for label, values in samples.items()}
        for label, value in medians.items():
            runs = ", ".join(f"{v[index]:.2f}" for v in samples[label])
            print(f"{kind:4s} {label:45s} {value:6.2f} s  ({value / medians[floor]:.2f}x the floor; runs {runs})")
        print(f"{kind:4s} validation's share: {medians[validated] - medians[unvalidated]:.2f} s")
        like_for_like = medians[validated] / medians[floor_sparse]
        print(
            f"{kind:4s} like for like (the build over the floor with the same collector setting): {like_for_like:.2f}x\n"
        )


COLLECTOR_PROBE = (
    """
import gc, sys, time
spent = [0, 0.0, 0.0]  # collections, CPU seconds, start of the running one
def timing(phase, info):
    if phase == "start":
        spent[2] = time.process_time()
    else:
        spent[0] += 1
        spent[1] += time.process_time() - spent[2]
gc.callbacks.append(timing)
if sys.argv[1] != "default":
    gc.set_threshold(int(sys.argv[1]), *gc.get_threshold()[1:])
"""
    + FLOOR
    + """
print(spent[0], spent[1], time.process_time())
"""
)


def collector_cost() -> None:
    """What the garbage collector costs while the floor's modules import, in a fresh process each: with Python's
    threshold and with the one every `fusegen` command sets (`fusegen.cli.YOUNG_THRESHOLD`)."""
    from fusegen.cli import YOUNG_THRESHOLD

    print("\n## the collector while the two modeling modules import (one fresh process each)")
    for setting in ("default", str(YOUNG_THRESHOLD)):
        done = subprocess.run([sys.executable, "-c", COLLECTOR_PROBE, setting], check=True, capture_output=True)
        count, seconds, total = done.stdout.decode().split()
        print(f"threshold {setting:8s}: {count} collections, {float(seconds):.2f} s CPU of {float(total):.2f} s")


def in_process() -> None:
    from fusegen.compiler.build import build
    from fusegen.compiler.validate import validate

    print("\n## validate() in process, per target (median of 3), and its checks")
    for name in ("llama", "qwen2"):
        result = build(name, validate=False)
        wall, cpu = [], []
        for _ in range(3):
            start, start_cpu = time.perf_counter(), time.process_time()
            report = validate(result.target, result.text, checkpointing=True)
            wall.append(time.perf_counter() - start)
            cpu.append(time.process_time() - start_cpu)
        print(f"{name}: {statistics.median(wall):.3f} s wall, {statistics.median(cpu):.3f} s CPU")
        for check in report.checks:
            print(
                f"  {check.config:28s} {check.status:8s} logits diff {check.logits_diff:.1e}  "
                f"grad diff (relative) {check.grad_diff:.1e}  {check.detail}"
            )


def variants() -> None:
    import generated
    from fusegen.compiler.resolve import resolve
    from fusegen.compiler.validate import construction_variants
    from fusegen.testkit import tiny_config

    print(
        "\n## construction variants per checked-in file (the build validates the first MAX_VARIANTS; the test up to 8)"
    )
    for path in sorted(Path(generated.__file__).parent.glob("fused_*.py")):
        target = resolve(path.stem.removeprefix("fused_"))
        config = tiny_config(target)
        print(
            f"{target.model_type}: {', '.join(label for label, _ in construction_variants(target, config, limit=8))}"
        )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--against", type=Path, metavar="DIR", help="another checkout to build in the same rounds")
    parser.add_argument("--cost-only", action="store_true", help="only the build cost (part 1)")
    args = parser.parse_args()
    sys.path.insert(0, str(ROOT))
    from transformers.utils import logging as hf_logging

    hf_logging.set_verbosity_error()
    build_cost(args.rounds, args.against.resolve() if args.against else None)
    collector_cost()
    if not args.cost_only:
        in_process()
        variants()


if __name__ == "__main__":
    main()
