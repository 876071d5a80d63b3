"""Rewrite a FlashInfer wheel without ``flashinfer/data/cutlass`` (in place), to send it to a
GPU machine beside the checkout.

Such a transfer (the checkout, the wheels and ``.carry``) was limited to 64 MiB. With the
tracked tree at ~28 MB and a FlashInfer 0.7.2 wheel set (its sources trimmed to the decode
paths) at 34.8 MB, FlashInfer's JIT cache (``.carry/fi-cache.txz``, 2.3 MB: the tensor-core,
CUDA-core and XQA decode modules) no longer fits, and every call re-compiled ~3 kernel families
(~120 s of its device time). The CUTLASS headers (5.7 MB of the wheel compressed) are read by
none of the decode paths pkvrt runs or measures: the compiler's dependency files of those three
modules list no CUTLASS header (only CCCL and FlashInfer's own include/), and their include
paths are plain paths FlashInfer never checks. On 2026-12-02 the wheel went 31.5 -> 25.1 MB; with
it on the H200 the FlashInfer engine and route tests passed (28) and an XQA module not in the
carried cache (G = 8) compiled without CUTLASS.

usage: python benches/slim_fi_wheel.py .whl07s/flashinfer_python-0.7.2.post1-py3-none-any.whl
"""

from __future__ import annotations

import os
import sys
import zipfile

DROP = "flashinfer/data/cutlass/"


def slim(path: str) -> tuple[int, int]:
    """Rewrite the wheel at ``path`` without the entries under :data:`DROP`; returns (bytes
    before, bytes after). A wheel with nothing to drop is left as it is."""
    before = os.path.getsize(path)
    with zipfile.ZipFile(path) as src:
        keep = [i for i in src.infolist() if not i.filename.startswith(DROP)]
        if len(keep) == len(src.infolist()):
            return before, before
        tmp = path + ".tmp"
        with zipfile.ZipFile(tmp, "w", zipfile.ZIP_DEFLATED, compresslevel=9) as dst:
            for info in keep:
                dst.writestr(info, src.read(info), compress_type=zipfile.ZIP_DEFLATED, compresslevel=9)
    os.replace(tmp, path)
    return before, os.path.getsize(path)


if __name__ == "__main__":
    if len(sys.argv) != 2 or not sys.argv[1].endswith(".whl"):
        sys.exit(__doc__.split("usage: ")[1])
    b, a = slim(sys.argv[1])
    print(f"{sys.argv[1]}: {b / 1e6:.1f} -> {a / 1e6:.1f} MB")
