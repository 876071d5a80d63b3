"""Build hook: compiles kernels/*.cu to cubins at install time (see pkvrt/_build.py).

Metadata lives in pyproject.toml; this file only adds the cubin step to ``build_py`` and copies
the default routes.toml and calibration files into the package, so that an installed pkvrt
carries everything it reads. Editable installs write the cubins into pkvrt/_cubins in the
source tree, where the runtime finds them.
"""

import importlib.util
import shutil
from pathlib import Path

from setuptools import setup
from setuptools.command.build_py import build_py

ROOT = Path(__file__).resolve().parent


def _builder():
    spec = importlib.util.spec_from_file_location("pkvrt_build", ROOT / "pkvrt" / "_build.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


class BuildPyWithCubins(build_py):
    def run(self):
        super().run()
        editable = getattr(self, "editable_mode", False)
        pkg = ROOT / "pkvrt" if editable else Path(self.build_lib) / "pkvrt"
        builder = _builder()
        try:
            builder.build(pkg / "_cubins", log=lambda msg: print(msg, flush=True))
        except builder.BuildError as exc:
            raise SystemExit(f"error: {exc}") from None
        if not editable:  # an installed package carries its defaults; a checkout reads the repo's
            data = pkg / "_data"
            (data / "calibration").mkdir(parents=True, exist_ok=True)
            shutil.copy2(ROOT / "routes.toml", data / "routes.toml")
            for f in (ROOT / "calibration").glob("*.json"):
                shutil.copy2(f, data / "calibration" / f.name)


setup(cmdclass={"build_py": BuildPyWithCubins})
