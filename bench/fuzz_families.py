"""`python bench/fuzz_families.py --pairs 40 [--seed 0]`: issue 24's family fuzzer, `fusegen.tools.fuzz_families`."""

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))  # run as a script: the repository root

from fusegen.tools.fuzz_families import main

if __name__ == "__main__":
    sys.exit(main())
