"""Measure this GPU's cost-model constants: the same as ``pkvrt calibrate`` (see pkvrt/tools/calibrate.py).

usage: python calibration/calibrate.py [--out PATH] [--quick] [--routes PATH] [--raw PATH]
"""

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # run from a checkout, uninstalled

from pkvrt.tools.calibrate import main  # noqa: E402

if __name__ == "__main__":
    sys.exit(main())
