"""`python bench/fuzz.py --examples 1000 [--seed 0]`: the differential fuzzer, `fusegen.tools.fuzz` (see there)."""

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))  # run as a script: the repository root

from fusegen.tools.fuzz import main

if __name__ == "__main__":
    sys.exit(main())
