"""``python -m pkvrt``: the same as the ``pkvrt`` console script."""

import sys

from pkvrt.cli import main

sys.exit(main())
