import sys

from fusegen.cli import main

sys.exit(main())
