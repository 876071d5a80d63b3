"""Where pkvrt's own files are, for every module that reads one (imports only the standard library).

``PACKAGE`` is the installed package folder (``_cubins/`` of the build, ``_data/`` with the shipped
routes.toml, calibration files and trace fixture); ``CHECKOUT`` is the folder above it, the
repository root in a source checkout or an editable install (its routes.toml and calibration/
win there, so that an edit takes effect without reinstalling).
"""

from pathlib import Path

PACKAGE = Path(__file__).resolve().parent
CHECKOUT = PACKAGE.parent
