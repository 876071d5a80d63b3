"""benches/slim_fi_wheel.py drops FlashInfer's CUTLASS headers from a wheel and keeps every
other entry byte for byte; a second run changes nothing; a bad argument exits with the usage."""

import subprocess
import sys
import zipfile
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
SCRIPT = REPO / "benches" / "slim_fi_wheel.py"


def test_slim_drops_cutlass_and_keeps_the_rest(tmp_path):
    whl = tmp_path / "flashinfer_python-0.0-py3-none-any.whl"
    files = {"flashinfer/__init__.py": b"x = 1\n", "flashinfer/data/include/a.cuh": b"// a\n" * 50,
             "flashinfer/data/cutlass/include/cute.hpp": b"// cute\n" * 500,
             "flashinfer/data/cutlass_like.txt": b"kept: not under data/cutlass/\n",
             "flashinfer_python-0.0.dist-info/RECORD": b"r\n"}
    with zipfile.ZipFile(whl, "w", zipfile.ZIP_DEFLATED) as z:
        for name, data in files.items():
            z.writestr(name, data)
    for _ in range(2):   # the second run finds nothing to drop
        out = subprocess.run([sys.executable, str(SCRIPT), str(whl)], capture_output=True, text=True)
        assert out.returncode == 0, out.stderr
    with zipfile.ZipFile(whl) as z:
        assert z.testzip() is None
        got = {n: z.read(n) for n in z.namelist()}
    want = {n: d for n, d in files.items() if not n.startswith("flashinfer/data/cutlass/")}
    assert got == want


def test_slim_wants_one_wheel():
    out = subprocess.run([sys.executable, str(SCRIPT)], capture_output=True, text=True)
    assert out.returncode != 0 and "slim_fi_wheel.py" in out.stderr
