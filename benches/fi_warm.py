"""Compile FlashInfer's JIT modules for the model shapes before they are timed (GPU): each
model's correctness probe (``model_shapes.probe_paths``: every FlashInfer decode path on every
layer kind) in a pool of processes, so that the ~30 modules a fresh machine builds for all 13
models (about 40 s each, one at a time inside ``benches/model_shapes.py``) build side by side.
FlashInfer's JIT cache locks each module, so two processes that need one build it once. Prints,
per model, the seconds it took and each path's status on each layer kind. Nothing is timed here;
the cache it fills lives under ``$FLASHINFER_WORKSPACE_BASE`` (``benches/offline_gpu.sh`` hands
it back as ``OUT/fi-jit.tgz``).

usage: python benches/fi_warm.py [--models a,b] [--processes 6]
"""

from __future__ import annotations

import argparse
import multiprocessing as mp
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))


def _probe(name: str) -> tuple[str, float, dict]:
    import torch

    import flashinfer as fi
    import model_shapes as ms

    ws = {k: torch.zeros(ms.WORKSPACE, dtype=torch.uint8, device="cuda") for k in ("fa2", "xqa")}
    t = time.monotonic()
    status = ms.probe_paths(fi, ms.MODELS[name], ws)
    return name, time.monotonic() - t, status


def main(argv=None) -> int:
    from pkvrt.measure.model_shapes import MODELS

    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--models", default=",".join(MODELS), help="comma-separated model names")
    ap.add_argument("--processes", type=int, default=6, help="probes at once (default: 6)")
    args = ap.parse_args(argv)
    names = [m for m in args.models.split(",") if m]
    unknown = [m for m in names if m not in MODELS]
    if unknown:
        ap.error(f"--models: unknown {unknown}; known: {', '.join(MODELS)}")
    if args.processes < 1:
        ap.error(f"--processes {args.processes}: expected at least 1")
    import torch
    if not torch.cuda.is_available():
        print("benches/fi_warm.py needs a CUDA GPU (torch sees none); nothing to compile here.")
        return 0
    t0 = time.monotonic()
    with mp.get_context("spawn").Pool(min(args.processes, len(names))) as pool:
        for name, seconds, status in pool.imap_unordered(_probe, names):
            paths = "; ".join(f"{label}/{kind}: {s}" for (label, kind), s in status.items())
            print(f"{time.monotonic() - t0:6.0f} s  {name} ({seconds:.0f} s): {paths}", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
