"""`python bench/hazard_batches.py [--batch fifth] [--validation off|on|both]`: the red-team batches' verdicts, counted.

tests/test_hazards.py holds each batch of hidden hazards and safe twins, and asserts only that every hazard is refused
or sound and every twin sound. This script builds and judges each case the same way (`fusegen.tools.oracle.verdict`:
by running, logits and gradients, in every mode) and prints how many were refused, fused soundly, miscompiled or
crashed, per batch, role and validation mode: the figures docs/analysis.md quotes.
"""

import argparse
import sys
import tempfile
from collections import Counter
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))  # run as a script: the repository root

import transformers

from fusegen.tools.oracle import importable
from tests.test_hazards import HAZARD_BATCHES, SAFE_BATCHES, _verdict, write_toy


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--batch", choices=sorted(HAZARD_BATCHES), action="append", help="default: every batch")
    parser.add_argument("--validation", choices=("off", "on", "both"), default="both")
    args = parser.parse_args()
    transformers.utils.logging.set_verbosity_error()
    modes = {"off": (False,), "on": (True,), "both": (False, True)}[args.validation]
    failed = False
    with tempfile.TemporaryDirectory() as scratch, importable(Path(scratch)) as root:
        for batch in args.batch or sorted(HAZARD_BATCHES):
            for role, cases in (("hazards", HAZARD_BATCHES[batch]), ("twins", SAFE_BATCHES[batch])):
                for validate in modes:
                    counts = Counter()
                    for name in sorted(cases):
                        verdict = _verdict(root, write_toy(root, name, cases[name]), name, validate=validate)
                        counts[verdict.split(" ", 1)[0].rstrip(":")] += 1
                        if verdict not in ("refused", "sound") or (role == "twins" and verdict != "sound"):
                            failed = True
                            print(f"  {batch} {name}: {verdict}", flush=True)
                    mode = "validation on" if validate else "validation off"
                    figures = ", ".join(f"{outcome} {n}" for outcome, n in sorted(counts.items()))
                    print(f"{batch} {role} ({len(cases)}), {mode}: {figures}", flush=True)
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
