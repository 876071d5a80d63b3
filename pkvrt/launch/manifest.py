"""Reads the kernel build manifest (written at install time by ``pkvrt/_build.py``).

The runtime only reads: which image (cubin for the exact SASS arch, else PTX for the driver to
JIT) serves which family on a GPU of a given compute capability. It never compiles.
"""

from __future__ import annotations

import json
import os
from pathlib import Path

import attrs

from pkvrt import _buildspec
from pkvrt._paths import CHECKOUT, PACKAGE

CUBIN_DIR = PACKAGE / "_cubins"


class ManifestError(ValueError):
    """The manifest is missing or malformed, or has no image for a family on this GPU."""


@attrs.frozen
class Entry:
    family: str
    arch: str          # "sm_90" (SASS) or "compute_90" (PTX)
    kind: str          # "cubin" | "ptx"
    file: str
    source_sha256: str
    symbols: tuple[str, ...]
    resources: dict    # symbol -> {registers, stack, spill_stores, spill_loads}
    path: Path

    @property
    def present(self) -> bool:
        return self.path.is_file()

    @property
    def arch_number(self) -> int:
        return int(self.arch.split("_")[1].rstrip("a"))


@attrs.frozen
class Manifest:
    path: Path
    nvcc_version: str | None
    skipped: str | None      # why no kernels were built (CPU-only package), else None
    entries: tuple[Entry, ...]
    tuning: dict

    def select(self, family: str, cc: tuple[int, int]) -> Entry | None:
        """The image to load for ``family`` on a GPU of compute capability ``cc``.

        The cubin built for exactly this arch wins (SASS is binary-compatible only within a
        major version and upward in minor: sm_86 code runs on 8.9 but not on 9.0); otherwise
        the newest PTX not newer than the device, which the driver JIT-compiles.
        """
        want = cc[0] * 10 + cc[1]
        cubins = [e for e in self.entries if e.family == family and e.kind == "cubin" and e.present
                  and e.arch_number // 10 == cc[0] and e.arch_number <= want]
        if cubins:
            return max(cubins, key=lambda e: e.arch_number)
        ptx = [e for e in self.entries if e.family == family and e.kind == "ptx" and e.present
               and e.arch_number <= want]
        return max(ptx, key=lambda e: e.arch_number) if ptx else None


def load_manifest(directory: Path | None = None) -> Manifest:
    """Read the manifest of ``directory`` (default: $PKVRT_CUBIN_DIR, else pkvrt/_cubins)."""
    directory = Path(directory or os.environ.get("PKVRT_CUBIN_DIR") or CUBIN_DIR)
    path = directory / "manifest.json"
    try:
        raw = json.loads(path.read_text())
    except FileNotFoundError:
        raise ManifestError(
            f"{path}: no kernel manifest; the cubins are built at install time "
            "(pip install -e . with nvcc available, or python -m pkvrt._build)") from None
    except ValueError as exc:
        raise ManifestError(f"{path}: not valid JSON ({exc})") from None
    try:
        entries = tuple(
            Entry(family=e["family"], arch=e["arch"], kind=e["kind"], file=e["file"],
                  source_sha256=e["source_sha256"], symbols=tuple(e["symbols"]),
                  resources=e.get("resources", {}), path=directory / e["file"])
            for e in raw["entries"])
        return Manifest(path=path, nvcc_version=raw.get("nvcc"), skipped=raw.get("skipped"),
                        entries=entries, tuning=raw.get("tuning", {}))
    except (KeyError, TypeError) as exc:
        raise ManifestError(f"{path}: malformed manifest entry ({exc!r})") from None


def stale_source(manifest: Manifest, entry: Entry, root: Path = CHECKOUT) -> str | None:
    """Why ``entry`` was not built from the kernel sources under ``root`` (a source checkout or
    an editable install: ``root/kernels``), or None when it was, or when ``root`` holds no kernel
    sources to compare (an installed wheel, whose cubins were built from its own).

    The kernels and their ctypes mirrors (pkvrt/launch/ops.py) must agree on every argument
    struct: an image built before a field was added reads the struct at the wrong offsets,
    out of bounds. The manifest's ``source_sha256`` is compared with the sources' hash under the
    manifest's own tuning constants, so a PKVRT_TUNE variant of these sources is not stale."""
    spec = _buildspec.FAMILIES.get(entry.family)
    if spec is None:
        return f"{entry.file}: family {entry.family!r} is not in this pkvrt's build spec"
    if not all((root / rel).is_file() for rel in (spec["source"], *_buildspec.HEADERS)):
        return None
    # the constants the image was compiled with, as its build hashed them (an old manifest
    # without them: the shipped ones)
    tuned = manifest.tuning or _buildspec.TUNING
    if entry.source_sha256 == _buildspec.source_digest(root, entry.family, tuned):
        return None
    return (f"{entry.file} was not built from the kernel sources under {root} (its source, "
            f"headers, nvcc flags or tuning constants differ; manifest {manifest.path}): its "
            f"argument structs may not be this pkvrt's. Rebuild: {rebuild_command(manifest)}")


def stale_images(manifest: Manifest, root: Path = CHECKOUT) -> list[tuple[Entry, str]]:
    """Every present image of ``manifest`` that :func:`stale_source` finds stale, with why."""
    return [(e, why) for e in manifest.entries if e.present and (why := stale_source(manifest, e, root))]


def rebuild_command(manifest: Manifest) -> str:
    """The command that rebuilds ``manifest``'s images from the checkout's sources: the
    package's own build (``pip install -e .``), else the build into the manifest's folder with
    the tuning variant it was built with (``PKVRT_TUNE``)."""
    folder = manifest.path.parent
    if folder.resolve() == CUBIN_DIR.resolve():
        return "pip install -e . (from the repository root)"
    tune = ",".join(f"{k}={v}" for k, v in sorted(manifest.tuning.items())
                    if _buildspec.TUNING.get(k) != v)
    return (f"{'PKVRT_TUNE=' + tune + ' ' if tune else ''}python -m pkvrt._build {folder} "
            "(from the repository root)")


def check_complete(manifest: Manifest) -> list[str]:
    """Problems that make the build incomplete: a family/arch without its image, or a symbol
    missing from an image's declared list. Empty when every declared kernel exists."""
    problems = []
    have = {(e.family, e.arch): e for e in manifest.entries}
    for family in _buildspec.FAMILIES:
        for arch in (*_buildspec.SASS_ARCHS, _buildspec.PTX_ARCH):
            e = have.get((family, arch))
            if e is None:
                problems.append(f"{family}: no image for {arch}")
            elif not e.present:
                problems.append(f"{family}: {e.file} listed but missing")
            elif set(_buildspec.symbols(family)) - set(e.symbols):
                problems.append(f"{family} {arch}: symbols missing")
    return problems
