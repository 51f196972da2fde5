"""`python -m kvforge.app.cli ...`: the `kvforge` console script."""

import sys

from kvforge.app.cli import main

sys.exit(main())
