"""Build-time compilation of ``kernels/*.cu`` to cubins (and PTX) plus a manifest.

Run by ``setup.py`` during ``pip install`` (loaded by file path: this module imports only the
standard library and ``_buildspec``), and by ``python -m pkvrt._build OUT_DIR`` by hand. The
runtime never compiles; it only reads the manifest written here (``pkvrt/launch/manifest.py``).

Environment:
  PKVRT_NVCC           path of nvcc (else $CUDA_HOME/bin/nvcc, else nvcc on PATH)
  CUDA_HOME            CUDA toolkit root
  PKVRT_CUDA_ARCHS     targets, e.g. "sm_90" or "sm_80,sm_90,compute_90" (default: all of
                       _buildspec.SASS_ARCHS plus PTX of _buildspec.PTX_ARCH)
  PKVRT_SKIP_CUDA_BUILD=1  build a CPU-only package: no cubins, a manifest that says why; the
                       GPU routes then report themselves unavailable
  PKVRT_BUILD_JOBS     parallel nvcc processes (default: CPU count)
  PKVRT_TUNE           override tuning constants for an experiment, e.g.
                       "PKV_COPY_MAP=1,PKV_L2_PREFETCH=128" (recorded in the manifest)
"""

from __future__ import annotations

import concurrent.futures
import datetime
import importlib.util
import json
import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
MANIFEST = "manifest.json"


class BuildError(RuntimeError):
    """nvcc is missing or failed; the message says what to install or set."""


def _load_spec():
    path = Path(__file__).with_name("_buildspec.py")
    spec = importlib.util.spec_from_file_location("pkvrt_buildspec", path)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


SPEC = _load_spec()


def find_nvcc() -> str:
    """$PKVRT_NVCC if set (it must be an executable: no silent fallback to another nvcc), else
    $CUDA_HOME/bin/nvcc, nvcc on PATH, /usr/local/cuda/bin/nvcc."""
    explicit = os.environ.get("PKVRT_NVCC")
    if explicit:
        if Path(explicit).is_file() and os.access(explicit, os.X_OK):
            return explicit
        raise BuildError(f"PKVRT_NVCC={explicit}: expected the path of an executable nvcc; "
                         "unset it to search CUDA_HOME and PATH")
    candidates = []
    if os.environ.get("CUDA_HOME"):
        candidates.append(str(Path(os.environ["CUDA_HOME"]) / "bin" / "nvcc"))
    on_path = shutil.which("nvcc")
    if on_path:
        candidates.append(on_path)
    candidates.append("/usr/local/cuda/bin/nvcc")
    for c in candidates:
        if Path(c).is_file() and os.access(c, os.X_OK):
            return c
    raise BuildError(
        "pkvrt needs nvcc (CUDA >= 12.0) to compile its kernels to cubins at install time, and "
        f"none was found (tried: {', '.join(candidates) or 'PATH'}). Install the CUDA toolkit and "
        "set CUDA_HOME or PKVRT_NVCC, or set PKVRT_SKIP_CUDA_BUILD=1 to build a CPU-only package "
        "(planner, router and CLI work; the GPU routes report themselves unavailable)."
    )


def nvcc_version(nvcc: str) -> str:
    out = subprocess.run([nvcc, "--version"], capture_output=True, text=True, check=True).stdout
    m = re.search(r"release [\d.]+, V([\d.]+)", out)
    return m.group(1) if m else out.strip().splitlines()[-1]


def targets() -> list[str]:
    raw = os.environ.get("PKVRT_CUDA_ARCHS")
    if not raw:
        return [*SPEC.SASS_ARCHS, SPEC.PTX_ARCH]
    out = []
    for tok in re.split(r"[,;\s]+", raw.strip()):
        if not tok:
            continue
        if re.fullmatch(r"\d+a?", tok):
            tok = f"sm_{tok}"
        if not re.fullmatch(r"(sm|compute)_\d+a?", tok):
            raise BuildError(f"PKVRT_CUDA_ARCHS: {tok!r} is not an arch; expected e.g. sm_90 or compute_90")
        out.append(tok)
    return out


def source_hash(family: str) -> str:
    """The manifest's ``source_sha256`` of ``family`` as ROOT holds it, under this build's tuning
    (PKVRT_TUNE applied)."""
    return SPEC.source_digest(ROOT, family, tuning())


_FUNC = re.compile(r"Compiling entry function '(\w+)' for '(\w+)'")
_STACK = re.compile(r"(\d+) bytes stack frame, (\d+) bytes spill stores, (\d+) bytes spill loads")
_USED = re.compile(r"Used (\d+) registers")


def parse_ptxas(log: str) -> dict[str, dict[str, int]]:
    """Per-function resources from ``-Xptxas=-v`` output: registers, stack, spill stores/loads."""
    res: dict[str, dict[str, int]] = {}
    current = None
    for line in log.splitlines():
        if m := _FUNC.search(line):
            current = m.group(1)
            res[current] = {}
        elif current and (m := _STACK.search(line)):
            res[current].update(stack=int(m.group(1)), spill_stores=int(m.group(2)),
                                spill_loads=int(m.group(3)))
        elif current and (m := _USED.search(line)):
            res[current]["registers"] = int(m.group(1))
    return res


def tuning() -> dict:
    """_buildspec.TUNING with PKVRT_TUNE overrides applied."""
    out = dict(SPEC.TUNING)
    for item in filter(None, re.split(r"[,\s]+", os.environ.get("PKVRT_TUNE", ""))):
        key, _, value = item.partition("=")
        if key not in out or not value.lstrip("-").isdigit():
            raise BuildError(f"PKVRT_TUNE: {item!r}: expected KEY=INT with KEY in {sorted(out)}")
        out[key] = int(value)
    return out


def _defines() -> list[str]:
    return [f"-D{k}={v}" for k, v in tuning().items()]


def _compile(nvcc: str, family: str, target: str, out_dir: Path) -> dict:
    src = ROOT / SPEC.FAMILIES[family]["source"]
    if target.startswith("sm_"):
        kind, out = "cubin", out_dir / f"{family}.{target}.cubin"
        cmd = [nvcc, "-cubin", f"-gencode=arch=compute_{target[3:]},code={target}"]
    else:
        kind, out = "ptx", out_dir / f"{family}.{target}.ptx"
        cmd = [nvcc, "-ptx", f"-arch={target}"]
    flags = list(SPEC.NVCC_FLAGS) if kind == "cubin" else [f for f in SPEC.NVCC_FLAGS if "ptxas" not in f]
    cmd += [*flags, *_defines(), f"-I{ROOT / 'kernels'}", "-o", str(out), str(src)]
    proc = subprocess.run(cmd, capture_output=True, text=True)
    if proc.returncode != 0:
        raise BuildError(f"nvcc failed for {family} ({target}):\n$ {' '.join(cmd)}\n{proc.stderr[-4000:]}")
    return {
        "family": family,
        "arch": target,
        "kind": kind,
        "file": out.name,
        "source_sha256": source_hash(family),
        "symbols": SPEC.symbols(family),
        "resources": parse_ptxas(proc.stdout + proc.stderr) if kind == "cubin" else {},
    }


def build(out_dir: Path, *, log=print) -> dict:
    """Compile every family for every target into ``out_dir`` and write the manifest."""
    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    base = {"schema": 1, "tuning": tuning(), "flags": list(SPEC.NVCC_FLAGS),
            "built": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds")}
    if os.environ.get("PKVRT_SKIP_CUDA_BUILD") == "1":
        manifest = {**base, "nvcc": None, "skipped": "PKVRT_SKIP_CUDA_BUILD=1", "entries": []}
        (out_dir / MANIFEST).write_text(json.dumps(manifest, indent=1))
        log("pkvrt: PKVRT_SKIP_CUDA_BUILD=1: no cubins built (CPU-only package)")
        return manifest
    nvcc = find_nvcc()
    version = nvcc_version(nvcc)
    previous = _previous_entries(out_dir, version)
    jobs, entries = [], []
    for family in SPEC.FAMILIES:
        for target in targets():
            old = previous.get((family, target))
            if old and old["source_sha256"] == source_hash(family) and (out_dir / old["file"]).is_file():
                entries.append(old)  # unchanged since the last build
            else:
                jobs.append((family, target))
    workers = int(os.environ.get("PKVRT_BUILD_JOBS", os.cpu_count() or 1))
    log(f"pkvrt: compiling {len(jobs)} kernel images with {nvcc} ({version}), {workers} jobs")
    with concurrent.futures.ThreadPoolExecutor(max_workers=max(1, workers)) as pool:
        futures = [pool.submit(_compile, nvcc, f, t, out_dir) for f, t in jobs]
        for fut in concurrent.futures.as_completed(futures):
            e = fut.result()
            log(f"pkvrt:   {e['file']}")
            entries.append(e)
    entries.sort(key=lambda e: (e["family"], e["arch"]))
    manifest = {**base, "nvcc": version, "nvcc_path": nvcc, "entries": entries}
    (out_dir / MANIFEST).write_text(json.dumps(manifest, indent=1))
    return manifest


def _previous_entries(out_dir: Path, version: str) -> dict:
    try:
        old = json.loads((out_dir / MANIFEST).read_text())
    except (OSError, ValueError):
        return {}
    if old.get("nvcc") != version or old.get("tuning") != tuning() or old.get("flags") != list(SPEC.NVCC_FLAGS):
        return {}
    return {(e["family"], e["arch"]): e for e in old.get("entries", [])}


USAGE = ("usage: python -m pkvrt._build [DIR]\n  compile kernels/*.cu to cubins and PTX in DIR "
         "(default pkvrt/_cubins); PKVRT_CUDA_ARCHS=sm_90 narrows the targets")

if __name__ == "__main__":
    if len(sys.argv) > 2 or (len(sys.argv) == 2 and sys.argv[1].startswith("-")):
        if sys.argv[1:] in (["-h"], ["--help"]):
            print(USAGE)
            sys.exit(0)
        sys.exit(f"pkvrt build: {sys.argv[1:]}: {USAGE}")
    dest = Path(sys.argv[1]) if len(sys.argv) > 1 else ROOT / "pkvrt" / "_cubins"
    try:
        build(dest)
    except BuildError as exc:
        sys.exit(f"pkvrt build: {exc}")
