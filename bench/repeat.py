"""Run bench/run.py's runtime section in N fresh processes and summarise each ratio across them (not a test).

    python bench/repeat.py [--runs 3] [--quick] [--shapes llama1b,qwen05b,tiny] [--json OUT]

Why: within one process, original and fused are interleaved, so machine drift hits both alike -- but each model
instance keeps the memory it was loaded into for the whole run. On this VM two loads of the SAME fused model differ by
up to 8% (bench/run.py's A/A control), because batch-1 GEMV speed depends on where the weights landed (page size and
host backing). A ratio from one process therefore carries that instance's luck; fresh processes draw new placements,
and the median over them is the figure to quote. Prints, per ratio key: median, min and max across runs.
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

HERE = Path(__file__).resolve().parent


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--runs", type=int, default=3)
    parser.add_argument("--quick", action="store_true")
    parser.add_argument("--shapes", default="llama1b,qwen05b,tiny")
    parser.add_argument("--json", type=Path, metavar="OUT", help="write {key: {median, min, max, runs}} as JSON")
    args = parser.parse_args()

    runs: list[dict] = []
    with tempfile.TemporaryDirectory(prefix="fusegen-repeat-") as tmp:
        for i in range(args.runs):
            out = Path(tmp) / f"run{i}.json"
            command = [sys.executable, str(HERE / "run.py"), "--only", "runtime", "--shapes", args.shapes]
            command += ["--json", str(out)] + (["--quick"] if args.quick else [])
            print(f"run {i + 1}/{args.runs}: {' '.join(command[1:])}", flush=True)
            subprocess.run(command, check=True, stdout=subprocess.DEVNULL)
            runs.append(json.loads(out.read_text()))

    keys = [k for k in runs[0] if k.startswith(("decode_ratio_", "prefill_ratio_", "decode_aa_control_ratio_"))]
    summary = {}
    print(f"\n{'ratio (fused / original)':44} {'median':>7} {'min':>7} {'max':>7}   per run")
    for key in keys:
        values = [run[key] for run in runs if run.get(key) is not None]
        if not values:
            continue
        summary[key] = {"median": statistics.median(values), "min": min(values), "max": max(values), "runs": values}
        print(
            f"{key:44} {summary[key]['median']:7.3f} {min(values):7.3f} {max(values):7.3f}   "
            + " ".join(f"{v:.3f}" for v in values)
        )
    if args.json:
        args.json.write_text(json.dumps(summary, indent=1) + "\n")


if __name__ == "__main__":
    main()
