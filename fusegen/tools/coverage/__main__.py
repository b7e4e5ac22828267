"""`python -m fusegen.tools.coverage`: see `fusegen.tools.coverage.run`."""

import sys

from fusegen.tools.coverage.run import main

sys.exit(main())
