"""Results files: ``{"meta": {...}, "rows": [...]}`` as DESIGN.md ("Results files") defines.

``meta`` records where a number came from (GPU, driver, CUDA, torch, FlashInfer, the cuDNN
frontend, pkvrt commit, seeds, routes.toml and calibration hashes, date, command line); ``rows``
are flat records, one per measured (case, engine). Ratios are computed only between rows of the
same file.
"""

from __future__ import annotations

import datetime
import hashlib
import json
import os
import platform
import subprocess
import sys
from pathlib import Path

from pkvrt._paths import CHECKOUT

ROOT = CHECKOUT


def file_sha256(path) -> str | None:
    try:
        return hashlib.sha256(Path(path).read_bytes()).hexdigest()
    except OSError:
        return None


def git_commit() -> str | None:
    """HEAD of the checkout (``-dirty`` with uncommitted changes), or ``$PKVRT_SOURCE_COMMIT``
    when set: a copied work tree (the device machine's) can carry stale git metadata, so the
    sender declares the commit it copied."""
    declared = os.environ.get("PKVRT_SOURCE_COMMIT")
    if declared:
        return declared
    try:
        out = subprocess.run(["git", "-C", str(ROOT), "rev-parse", "HEAD"], capture_output=True,
                             text=True, timeout=5)
        dirty = subprocess.run(["git", "-C", str(ROOT), "status", "--porcelain", "--untracked-files=no"],
                               capture_output=True, text=True, timeout=5).stdout.strip()
        return out.stdout.strip() + ("-dirty" if dirty else "") if out.returncode == 0 else None
    except (OSError, subprocess.TimeoutExpired):
        return None


def environment() -> dict:
    """GPU, driver and library versions of this process (no GPU: says so)."""
    import torch

    env = {"python": platform.python_version(), "torch": torch.__version__,
           "torch_cuda": torch.version.cuda, "gpu": None}
    try:
        import flashinfer
        env["flashinfer"] = flashinfer.__version__
    except Exception as exc:  # not installed, or failed to import/build: recorded, not fatal
        env["flashinfer"] = f"unavailable: {type(exc).__name__}"
    try:  # the cuDNN frontend FlashInfer's cuDNN decode path runs on (pkvrt/measure/fi_engines.py)
        import cudnn
        env["cudnn_frontend"] = str(getattr(cudnn, "__version__", "?"))
    except Exception as exc:  # noqa: BLE001 - not installed, or its library failed to load
        env["cudnn_frontend"] = f"unavailable: {type(exc).__name__}"
    if torch.cuda.is_available():
        props = torch.cuda.get_device_properties(0)
        env.update(gpu=props.name, sm_count=props.multi_processor_count,
                   compute_capability=f"{props.major}.{props.minor}",
                   l2_bytes=getattr(props, "L2_cache_size", None),
                   memory_gib=round(props.total_memory / 2**30, 1))
        try:
            smi = subprocess.run(["nvidia-smi", "--query-gpu=driver_version", "--format=csv,noheader"],
                                 capture_output=True, text=True, timeout=10)
            env["driver"] = smi.stdout.strip().splitlines()[0] if smi.returncode == 0 else None
        except (OSError, subprocess.TimeoutExpired, IndexError):
            env["driver"] = None
    return env


def kernel_build() -> dict:
    """Which kernel build produced the numbers: manifest path, nvcc, tuning constants, and
    ``sources_sha256``, a digest of the source hash of every kernel family in the manifest (its
    .cu file, the shared headers, the flags and tuning: ``pkvrt/_build.py``): it names the build
    the kernels were loaded from, even where a build of other sources was copied in beside this
    checkout's Python."""
    from pkvrt.launch.manifest import ManifestError, load_manifest

    try:
        m = load_manifest()
    except ManifestError as exc:
        return {"error": str(exc)}
    families = sorted({(str(e.family), str(e.source_sha256)) for e in m.entries})
    return {"manifest": str(m.path), "nvcc": m.nvcc_version, "tuning": m.tuning,
            "sources_sha256": hashlib.sha256(json.dumps(families).encode()).hexdigest() if families else None}


def make_meta(*, seeds=(), routes_path=None, calibration_path=None, **extra) -> dict:
    return {
        "kernels": kernel_build(),
        **environment(),
        "pkvrt_commit": git_commit(),
        "seeds": list(seeds),
        "routes_path": str(routes_path) if routes_path else None,
        "routes_sha256": file_sha256(routes_path) if routes_path else None,
        "calibration_path": str(calibration_path) if calibration_path else None,
        "calibration_sha256": file_sha256(calibration_path) if calibration_path else None,
        "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        "command": " ".join([Path(sys.argv[0]).name, *sys.argv[1:]]),
        **extra,
    }


def write_results(path, meta: dict, rows: list[dict]) -> Path:
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_suffix(path.suffix + ".tmp")
    tmp.write_text(json.dumps({"meta": meta, "rows": rows}, indent=1, default=float) + "\n")
    tmp.replace(path)  # never leave a half-written results file
    return path


def read_results(path) -> dict:
    data = json.loads(Path(path).read_text())
    if not isinstance(data, dict) or "meta" not in data or not isinstance(data.get("rows"), list):
        raise ValueError(f"{path}: not a pkvrt results file (expected an object with 'meta' and 'rows')")
    return data
