"""``python -m pkvrt``: the same as the ``pkvrt`` console script."""

import sys

from pkvrt.tools.cli import main

sys.exit(main())
