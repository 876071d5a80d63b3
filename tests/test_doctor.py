"""`pkvrt doctor`'s driver check, on a CPU: the driver query is monkeypatched.

The kernels are cubins built by the nvcc the manifest names; a driver that supports an older
CUDA major version cannot load them (nvcc 13.0 needs R580), and the PTX fallback needs a driver
at least as new as the toolkit. Other doctor tests (no GPU, bad routes file) are in test_cli.py.
"""

from __future__ import annotations

import json
import types

import pytest

from pkvrt._buildspec import FAMILIES
from pkvrt.launch import _driver
from pkvrt.tools import cli, doctor


@pytest.fixture
def manifest_dir(tmp_path, monkeypatch):
    """A manifest built by nvcc 13.0.88 with sm_90 cubins and compute_90 PTX for every family
    (write_manifest(nvcc=...) rewrites it with another version)."""
    def write_manifest(nvcc="13.0.88"):
        entries = []
        for fam in FAMILIES:
            for arch, kind in (("sm_90", "cubin"), ("compute_90", "ptx")):
                name = f"{fam}.{arch}.{kind}"
                (tmp_path / name).write_bytes(b"\0")
                entries.append(dict(family=fam, arch=arch, kind=kind, file=name,
                                    source_sha256="0" * 64, symbols=[]))
        (tmp_path / "manifest.json").write_text(json.dumps({"nvcc": nvcc, "entries": entries}))

    write_manifest()
    monkeypatch.setenv("PKVRT_CUBIN_DIR", str(tmp_path))
    return write_manifest


def fake_driver(monkeypatch, version):
    """cuDriverGetVersion answers ``version`` ((major, minor)), or raises CudaDriverError(text)."""
    def query():
        if isinstance(version, str):
            raise _driver.CudaDriverError(version)
        return version
    monkeypatch.setattr(_driver, "driver_cuda_version", query)


# ---- the comparison ----------------------------------------------------------------------------

@pytest.mark.parametrize("gpu", [True, False])
def test_cuda12_driver_cannot_load_cuda13_cubins(gpu):
    text, bad = doctor.driver_check((12, 8), "13.0.88", (13, 0), ptx=False, gpu=gpu)
    assert bad is gpu  # without a GPU nothing is loaded: said, not a problem
    assert text.startswith("supports CUDA 12.8; kernels built by nvcc 13.0.88")
    assert "a driver that supports CUDA 13.0 (R580 or newer)" in text
    assert "PKVRT_NVCC=/path/to/cuda-12.x/bin/nvcc pip install -e ." in text
    assert "python -m pkvrt._build" in text and "at most 12.8" in text


@pytest.mark.parametrize("drv, built", [((13, 0), (13, 0)), ((13, 2), (13, 0)), ((13, 0), (12, 8))])
def test_driver_as_new_as_the_toolkit_is_ok(drv, built):
    text, bad = doctor.driver_check(drv, "x", built, ptx=True, gpu=True)
    assert not bad and text.endswith(": OK")


def test_older_minor_driver_loads_cubins_but_not_ptx():
    text, bad = doctor.driver_check((13, 0), "13.1.80", (13, 1), ptx=False, gpu=True)
    assert not bad and "OK (cubins load on an older 13.x driver" in text
    text, bad = doctor.driver_check((13, 0), "13.1.80", (13, 1), ptx=True, gpu=True)
    assert bad and "PTX fallback needs a driver that supports CUDA 13.1" in text


# ---- driver_status: manifest + driver query ------------------------------------------------------

def test_status_reads_the_manifests_nvcc(manifest_dir, monkeypatch):
    fake_driver(monkeypatch, (12, 4))
    text, bad = doctor.driver_status((9, 0))
    assert bad and "nvcc 13.0.88" in text and "R580 or newer" in text
    fake_driver(monkeypatch, (13, 0))
    assert doctor.driver_status((9, 0)) == (
        "supports CUDA 13.0; kernels built by nvcc 13.0.88: OK", False)


def test_status_knows_which_gpu_runs_ptx(manifest_dir, monkeypatch):
    manifest_dir(nvcc="13.1.80")
    fake_driver(monkeypatch, (13, 0))
    assert doctor.driver_status((9, 0))[1] is False   # sm_90 cubins
    text, bad = doctor.driver_status((10, 0))          # no sm_100 cubin: compute_90 PTX
    assert bad and "PTX fallback" in text


def test_status_when_the_driver_cannot_be_asked(manifest_dir, monkeypatch):
    fake_driver(monkeypatch, "libcuda is not loadable")
    text, bad = doctor.driver_status(None)
    assert not bad
    assert text == ("cannot ask the driver which CUDA it supports: libcuda is not loadable; the "
                    "kernels (nvcc 13.0.88) need a driver that supports CUDA 13.0 (R580 or newer)")
    assert doctor.driver_status((9, 0))[1] is True


def test_status_without_nvcc_in_the_manifest(manifest_dir, monkeypatch):
    manifest_dir(nvcc=None)  # a CPU-only build (PKVRT_SKIP_CUDA_BUILD=1)
    fake_driver(monkeypatch, (12, 8))
    assert doctor.driver_status((9, 0)) == (
        "supports CUDA 12.8 (no kernels built to compare with: see kernels)", False)


# ---- the whole command, with a GPU faked -------------------------------------------------------

@pytest.mark.parametrize("drv, problem", [((12, 8), True), ((13, 0), False)])
def test_doctor_row(capsys, manifest_dir, monkeypatch, drv, problem):
    fake_driver(monkeypatch, drv)
    monkeypatch.setattr(doctor, "gpu_info", lambda torch: {
        "name": "NVIDIA H200", "cc": (9, 0), "text": "NVIDIA H200 (faked)"})
    rc = cli.main(["doctor"])
    out = capsys.readouterr().out
    rows = dict(line.split(None, 1) for line in out.splitlines() if line and line[0] != " ")
    prefix = ("PROBLEM: " if problem else "") + f"supports CUDA {drv[0]}.{drv[1]}"
    assert rows["driver"].startswith(prefix)
    names = out.rstrip().splitlines()[-1].split(" problem(s): ")[-1].split(", ")
    assert ("driver" in names) is problem
    if problem:
        assert rc == 1


# ---- the helper in pkvrt.launch._driver ---------------------------------------------------------------

def fake_cu(answer):
    def get_version():
        if isinstance(answer, Exception):
            raise answer
        return answer
    return types.SimpleNamespace(CUresult=types.SimpleNamespace(CUDA_SUCCESS=0),
                                 cuDriverGetVersion=get_version)


def test_driver_cuda_version_decodes(monkeypatch):
    monkeypatch.setattr(_driver, "cu", fake_cu((0, 12080)))
    assert _driver.driver_cuda_version() == (12, 8)
    monkeypatch.setattr(_driver, "cu", fake_cu((0, 13000)))
    assert _driver.driver_cuda_version() == (13, 0)


def test_driver_cuda_version_without_libcuda(monkeypatch):
    monkeypatch.setattr(_driver, "cu", fake_cu(RuntimeError("libcuda.so.1 not found")))
    with pytest.raises(_driver.CudaDriverError, match="not loadable.*libcuda.so.1 not found"):
        _driver.driver_cuda_version()
    monkeypatch.setattr(_driver, "cu", None)
    with pytest.raises(_driver.CudaDriverError, match="cuda-python is not importable"):
        _driver.driver_cuda_version()


def test_doctor_names_stale_images_and_how_to_rebuild_them(manifest_dir, tmp_path):
    """Images whose source hash is not the checkout's sources' (the fixture's all-zero hashes)
    make one ``stale`` problem row naming the families and the rebuild of that folder; the same
    manifest with the checkout's digests has no such row."""
    from pkvrt import _buildspec
    from pkvrt._paths import CHECKOUT

    rows = {label.strip(): (text, problem) for label, text, problem in doctor.kernel_rows(None)}
    text, problem = rows["stale"]
    assert problem and all(f in text for f in FAMILIES), text
    assert f"python -m pkvrt._build {tmp_path}" in text and "PKVRT_ALLOW_STALE_CUBINS=1" in text
    raw = json.loads((tmp_path / "manifest.json").read_text())
    for e in raw["entries"]:
        e["source_sha256"] = _buildspec.source_digest(CHECKOUT, e["family"], _buildspec.TUNING)
    (tmp_path / "manifest.json").write_text(json.dumps(raw))
    assert "stale" not in {label.strip() for label, _, _ in doctor.kernel_rows(None)}
