"""Check what this machine can run: Python, torch, GPU, kernel cubins, FlashInfer, policy files.

Prints one line per check. Without a CUDA GPU pkvrt runs the planner only, which is not a
problem: the exit status is 0. Exit status 1 means a problem was found (a kernel family with
no cubin or PTX for this GPU, a driver too old for the toolkit that built the kernels, FlashInfer
missing on a GPU machine, an invalid routes.toml or calibration file); each such line starts
with "PROBLEM".
"""

from __future__ import annotations

import argparse
import importlib
import importlib.metadata
import platform
import re
import sys
import warnings

from pkvrt._buildspec import FAMILIES
from pkvrt.policy import registry

NO_GPU = "no CUDA GPU: kernels and FlashInfer routes unavailable; planner-only mode"


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--routes", metavar="PATH",
                        help=f"routes.toml to check (default: {registry.default_routes_path()})")


def run(args: argparse.Namespace) -> int:
    rows: list[tuple[str, str]] = []
    problems: list[str] = []

    def report(label: str, text: str, bad: bool = False) -> None:
        rows.append((label, f"PROBLEM: {text}" if bad else text))
        if bad:
            problems.append(label.strip())

    import torch

    report("python", f"{platform.python_version()} ({sys.executable})")
    report("torch", f"{torch.__version__} (CUDA build: {torch.version.cuda or 'none, CPU-only'})")
    report("cuda-python", "; ".join(f"{d} {_dist_version(d)}" for d in ("cuda-python", "cuda-bindings")))
    gpu = gpu_info(torch)
    report("gpu", gpu["text"] if gpu else NO_GPU)
    text, bad = driver_status(gpu["cc"] if gpu else None)
    report("driver", text, bad)
    for label, text, bad in kernel_rows(gpu["cc"] if gpu else None):
        report(label, text, bad)
    fi_ok, fi_text = flashinfer_status()
    report("flashinfer", fi_text, bad=gpu is not None and not fi_ok)
    try:
        reg = registry.load_routes(args.routes)
        report("routes.toml", f"{reg.path} (sha256 {reg.sha256})")
    except registry.RoutesError as e:
        report("routes.toml", str(e), bad=True)
    try:
        report("calibration", calibration_status(gpu["name"] if gpu else None))
    except ValueError as e:  # CalibrationError: a calibration file is malformed
        report("calibration", str(e), bad=True)

    width = max(len(label) for label, _ in rows)
    for label, text in rows:
        print(f"{label.ljust(width)}  {text}")
    if problems:
        print(f"\n{len(problems)} problem(s): {', '.join(problems)}")
    return 1 if problems else 0


def _dist_version(dist: str) -> str:
    """Installed version of a distribution, read from its metadata (nothing is imported)."""
    try:
        return importlib.metadata.version(dist)
    except importlib.metadata.PackageNotFoundError:
        return "not installed"


def gpu_info(torch) -> dict | None:
    """The current CUDA device: name, compute capability, SMs, L2; None without one."""
    if not torch.cuda.is_available():
        return None
    dev = torch.cuda.current_device()
    p = torch.cuda.get_device_properties(dev)
    l2 = getattr(p, "L2_cache_size", 0)
    text = (f"{p.name} (device {dev} of {torch.cuda.device_count()}), compute capability "
            f"{p.major}.{p.minor}, {p.multi_processor_count} SMs, "
            + (f"L2 {l2 / 2**20:.1f} MiB" if l2 else "L2 size unknown"))
    return {"name": p.name, "cc": (p.major, p.minor), "text": text}


def kernel_rows(cc: tuple[int, int] | None) -> list[tuple[str, str, bool]]:
    """(label, text, is_problem) for the kernel build manifest; per family for this GPU's ``cc``."""
    try:
        from pkvrt.launch.manifest import ManifestError, load_manifest, rebuild_command, stale_images
    except ModuleNotFoundError as e:
        if e.name != "pkvrt.launch.manifest":
            raise
        return [("kernels", "pkvrt.launch.manifest is not part of this checkout", cc is not None)]
    try:
        man = load_manifest()
    except ManifestError as e:
        return [("kernels", f"{e}", cc is not None)]
    skipped = getattr(man, "skipped", None)  # why a CPU-only build compiled nothing
    out = [("kernels", f"manifest {man.path} (nvcc {man.nvcc_version})"
            + (f"; no kernels built: {skipped}" if skipped else ""), False)]
    stale = sorted({e.family for e, _ in stale_images(man)})
    if stale:   # the runtime refuses these (built from other kernel sources than the checkout's)
        out.append(("  stale", f"{', '.join(stale)}: not built from this checkout's kernel "
                               f"sources, so the runtime refuses them; rebuild: "
                               f"{rebuild_command(man)} (PKVRT_ALLOW_STALE_CUBINS=1 loads them "
                               "anyway, for A/B runs of an older build)", True))
    for fam in FAMILIES:  # every family the runtime needs, whether the manifest lists it or not
        label = f"  {fam}"
        if cc is None:  # no GPU: what was built, per family
            built = [e.arch + ("" if e.present else " (file missing)")
                     for e in man.entries if e.family == fam]
            out.append((label, "built for " + (", ".join(built) or "nothing"), False))
            continue
        e = man.select(fam, cc)
        arch = f"sm_{cc[0]}{cc[1]}"
        if e is None:
            missing = [m.file for m in man.entries if m.family == fam and not m.present]
            note = f" (listed but missing: {', '.join(missing)})" if missing else ""
            out.append((label, f"no cubin or PTX for {arch}{note}: routes using it are "
                               f"unavailable", True))
        elif e.kind == "cubin":
            out.append((label, f"cubin {e.arch} ({e.file})", False))
        else:
            out.append((label, f"PTX fallback {e.arch}, JIT-compiled by the driver for {arch} "
                               f"({e.file})", False))
    return out


# Oldest Linux driver branch per CUDA major version; it loads cubins of every <major>.x toolkit
# (minor version compatibility). nvcc 13.0's cubins need R580; a R535-R570 driver is CUDA 12.x.
MIN_DRIVER_BRANCH = {11: "R450", 12: "R525", 13: "R580"}


def driver_status(cc: tuple[int, int] | None) -> tuple[str, bool]:
    """(text, is_problem): the CUDA version the driver supports against the toolkit that built
    the kernels (the manifest's ``nvcc``). A problem only on a GPU machine (``cc``)."""
    from pkvrt.launch import _driver  # the one door to cuda.bindings
    from pkvrt.launch.manifest import ManifestError, load_manifest

    try:
        man = load_manifest()
    except ManifestError:
        man = None  # the kernels row says why
    nvcc = man.nvcc_version if man else None
    m = re.match(r"(\d+)\.(\d+)", nvcc or "")
    built = (int(m[1]), int(m[2])) if m else None
    try:
        drv = _driver.driver_cuda_version()
    except _driver.CudaDriverError as e:
        need = f"; the kernels (nvcc {nvcc}) need {required_driver(built)}" if built else ""
        return f"cannot ask the driver which CUDA it supports: {e}{need}", cc is not None
    if built is None:
        return (f"supports CUDA {drv[0]}.{drv[1]} (no kernels built to compare with: see kernels)",
                False)
    ptx = cc is not None and any(getattr(man.select(f, cc), "kind", None) == "ptx" for f in FAMILIES)
    return driver_check(drv, nvcc, built, ptx=ptx, gpu=cc is not None)


def required_driver(built: tuple[int, int]) -> str:
    """(13, 0) -> "a driver that supports CUDA 13.0 (R580 or newer)"."""
    branch = MIN_DRIVER_BRANCH.get(built[0])
    return f"a driver that supports CUDA {built[0]}.0" + (f" ({branch} or newer)" if branch else "")


def driver_check(drv: tuple[int, int], nvcc: str, built: tuple[int, int], *, ptx: bool,
                 gpu: bool) -> tuple[str, bool]:
    """Compare the driver's CUDA version ``drv`` with the toolkit ``built`` (nvcc ``nvcc``).

    A cubin needs a driver of the toolkit's major version or newer: a R570 driver (CUDA 12.8)
    cannot load cubins of nvcc 13.0, which need R580. Within a major version an older driver
    loads them (minor version compatibility), but PTX, JIT-compiled by the driver on a GPU with
    no cubin, needs a driver at least as new as the toolkit (``ptx``: this GPU uses it).
    """
    text = f"supports CUDA {drv[0]}.{drv[1]}; kernels built by nvcc {nvcc}"
    if drv >= built:
        return f"{text}: OK", False
    rebuild = (f"or rebuild the kernels with a CUDA {drv[0]}.x toolkit "
               f"(at most {drv[0]}.{drv[1]}): "
               f"PKVRT_NVCC=/path/to/cuda-{drv[0]}.x/bin/nvcc pip install -e . "
               f"(or, without pip: PKVRT_NVCC=... python -m pkvrt._build)")
    if drv[0] < built[0]:
        return (f"{text}, which need {required_driver(built)}: the kernels cannot be loaded. "
                f"Update the driver, {rebuild}", gpu)
    if ptx:
        return (f"{text}; this GPU has no cubin and its PTX fallback needs a driver that "
                f"supports CUDA {built[0]}.{built[1]}. Update the driver, {rebuild}", gpu)
    return (f"{text}: OK (cubins load on an older {built[0]}.x driver; the PTX fallback for "
            f"GPUs without a cubin would need CUDA {built[0]}.{built[1]})", False)


def flashinfer_status() -> tuple[bool, str]:
    """(importable, text). Any exception counts: FlashInfer may fail to build or load."""
    try:
        fi = importlib.import_module("flashinfer")
    except Exception as e:  # noqa: BLE001 - the reason is the report
        return False, f"not importable: {type(e).__name__}: {e}"
    return True, f"{getattr(fi, '__version__', 'version unknown')} ({fi.__file__})"


def calibration_status(device_name: str | None) -> str:
    """Which calibration file the runtime would use for this device."""
    try:
        calibration = importlib.import_module("pkvrt.policy.calibration")
    except ModuleNotFoundError as e:
        if e.name != "pkvrt.policy.calibration":
            raise
        return "pkvrt.policy.calibration is not part of this checkout"
    find = getattr(calibration, "find_calibration", None)
    if find is None:
        return "pkvrt.policy.calibration has no find_calibration"
    if device_name is None:
        return no_gpu_calibration(calibration)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        cal = find(device_name)
    note = "; ".join(str(w.message) for w in caught)
    return f"{cal.source} (slug {getattr(cal, 'slug', '?')})" + (
        f"; fallback: {note}" if note else "")


def no_gpu_calibration(calibration) -> str:
    """Without a GPU: how the calibration is chosen, and the files shipped (each one loaded, so a
    malformed file is a CalibrationError, reported as a problem)."""
    dirs = calibration.calibration_dirs()
    files = [f for d in dirs for f in sorted(d.glob("*.json"))]
    shipped = ", ".join(f"{f.stem} ({calibration.load_calibration(f).gpu})" for f in files)
    seed = calibration.DEFAULT_SLUG
    return (f"no CUDA device: the calibration is chosen per GPU at run time (<gpu-slug>.json, "
            f"else the seed profile {seed}); shipped files: {shipped or 'none'} in "
            f"{', '.join(map(str, dirs))}; pkvrt plan and pkvrt bench predict with {seed} here "
            "unless given --gpu NAME or --calibration PATH")
