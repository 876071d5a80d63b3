"""The kernel build (CPU): every declared kernel has an image for every declared target, the
images carry their symbols, and ptxas reported no local-memory spills."""

import os
import shutil

import pytest

from pkvrt import _build, _buildspec
from pkvrt.launch.manifest import ManifestError, check_complete, load_manifest


@pytest.fixture(scope="module")
def manifest():
    try:
        m = load_manifest()
    except ManifestError as exc:
        pytest.fail(f"no kernel build: {exc} (install with `pip install -e .` and nvcc available)")
    if m.skipped:
        pytest.skip(f"CPU-only package ({m.skipped})")
    return m


def test_every_kernel_built_for_every_target(manifest):
    if os.environ.get("PKVRT_CUDA_ARCHS"):
        pytest.skip("PKVRT_CUDA_ARCHS narrows the targets on purpose")
    assert check_complete(manifest) == []


def test_no_spills_or_stack_in_shipped_cubins(manifest):
    """No kernel spills, but the few _buildspec.ACCEPTED_SPILLS name (with their reason), and
    those no more than the bytes they are allowed."""
    cubins = [e for e in manifest.entries if e.kind == "cubin"]
    assert cubins
    for e in cubins:
        assert set(e.resources) == set(_buildspec.symbols(e.family)), e.file
        arch = e.file.split(".")[1]
        for sym, r in e.resources.items():
            spill, stack = _buildspec.accepted_spill(arch, sym)
            assert r["spill_stores"] <= spill and r["spill_loads"] <= spill, (e.file, sym, r)
            assert r["stack"] <= stack, (e.file, sym, r)


def test_cubins_export_declared_symbols(manifest):
    # A cubin is an ELF file: each exported kernel name sits NUL-terminated in its string table.
    for e in manifest.entries:
        data = e.path.read_bytes()
        for sym in e.symbols:
            assert sym.encode() + (b"\0" if e.kind == "cubin" else b"(") in data, (e.file, sym)


def test_source_hash_tracks_kernel_sources(manifest):
    """The build's hash of every image is the checkout's, and the runtime's stale check (its own
    digest of the sources under the manifest's tuning) agrees: a fresh build is never refused."""
    from pkvrt.launch.manifest import stale_source

    for e in manifest.entries:
        assert e.source_sha256 == _build.source_hash(e.family), f"{e.file} is stale: rebuild"
        assert stale_source(manifest, e) is None, e.file


def test_manifest_selects_cubin_then_ptx(manifest):
    e = manifest.select("split_decode", (9, 0))
    assert e is not None and e.kind == "cubin" and e.arch == "sm_90"
    if not os.environ.get("PKVRT_CUDA_ARCHS"):
        assert manifest.select("split_decode", (8, 9)).arch == "sm_89"
        assert manifest.select("split_decode", (8, 7)).arch == "sm_86"  # same major, older minor
        later = manifest.select("split_decode", (12, 0))
        assert later.kind == "ptx" and later.arch == "compute_90"
    assert manifest.select("split_decode", (7, 5)) is None


def test_parse_ptxas_reads_spills():
    log = """ptxas info    : Compiling entry function 'k1' for 'sm_90'
ptxas info    : Function properties for k1
    8 bytes stack frame, 4 bytes spill stores, 12 bytes spill loads
ptxas info    : Used 255 registers, used 1 barriers
"""
    assert _build.parse_ptxas(log) == {"k1": {"stack": 8, "spill_stores": 4, "spill_loads": 12,
                                              "registers": 255}}


def test_targets_env(monkeypatch):
    monkeypatch.setenv("PKVRT_CUDA_ARCHS", "90, sm_80;compute_90")
    assert _build.targets() == ["sm_90", "sm_80", "compute_90"]
    monkeypatch.setenv("PKVRT_CUDA_ARCHS", "hopper")
    with pytest.raises(_build.BuildError, match="hopper"):
        _build.targets()


def test_missing_nvcc_message(monkeypatch, tmp_path):
    monkeypatch.delenv("PKVRT_NVCC", raising=False)
    monkeypatch.delenv("CUDA_HOME", raising=False)
    monkeypatch.setattr(shutil, "which", lambda _: None)
    monkeypatch.setattr(_build.Path, "is_file", lambda self: False)
    with pytest.raises(_build.BuildError, match="CUDA_HOME or PKVRT_NVCC"):
        _build.find_nvcc()


def test_pkvrt_nvcc_that_is_not_an_executable_is_an_error(monkeypatch, tmp_path):
    # the user named this nvcc: no silent fallback to another one on PATH
    other = tmp_path / "bin" / "nvcc"
    other.parent.mkdir()
    other.write_text("#!/bin/sh\n")
    other.chmod(0o755)
    monkeypatch.setattr(shutil, "which", lambda _: str(other))
    monkeypatch.setenv("PKVRT_NVCC", "/nonexistent/nvcc")
    with pytest.raises(_build.BuildError, match="^PKVRT_NVCC=/nonexistent/nvcc: expected the path "
                                                "of an executable nvcc"):
        _build.find_nvcc()
    monkeypatch.setenv("PKVRT_NVCC", str(other))
    assert _build.find_nvcc() == str(other)


def _fake_build(tmp_path, tuned=None):
    """A checkout's kernel sources under tmp_path/src and a manifest in tmp_path/cubins whose
    split_decode entry records their hash (under ``tuned``, default the shipped constants)."""
    import json

    root = tmp_path / "src"
    for rel in (_buildspec.FAMILIES["split_decode"]["source"], *_buildspec.HEADERS):
        (root / rel).parent.mkdir(parents=True, exist_ok=True)
        shutil.copy(_build.ROOT / rel, root / rel)
    tuning = {**_buildspec.TUNING, **(tuned or {})}
    digest = _buildspec.source_digest(root, "split_decode", tuning)
    cubins = tmp_path / "cubins"
    cubins.mkdir()
    (cubins / "split_decode.sm_90.cubin").write_bytes(b"\0")
    (cubins / "manifest.json").write_text(json.dumps({
        "schema": 1, "tuning": tuning, "nvcc": "13.0", "entries": [
            {"family": "split_decode", "arch": "sm_90", "kind": "cubin",
             "file": "split_decode.sm_90.cubin", "source_sha256": digest,
             "symbols": list(_buildspec.symbols("split_decode"))}]}))
    return root, load_manifest(cubins)


@pytest.mark.parametrize("tuned", [None, {"PKV_TC_STAGES": 4}], ids=["shipped", "PKVRT_TUNE variant"])
def test_a_cubin_built_from_other_kernel_sources_is_named_stale(tmp_path, tuned):
    """A manifest entry matches the sources it was built from (under its own tuning constants,
    so a PKVRT_TUNE variant is not stale); one changed byte in a header makes it stale, and the
    reason names the image and says to rebuild; a root without kernel sources (an installed
    wheel) is not checked."""
    from pkvrt.launch.manifest import stale_source

    root, m = _fake_build(tmp_path, tuned)
    (entry,) = m.entries
    assert stale_source(m, entry, root) is None
    header = root / _buildspec.HEADERS[0]
    header.write_bytes(header.read_bytes() + b"\n// a field added to DecodeParams\n")
    why = stale_source(m, entry, root)
    assert why is not None and "split_decode.sm_90.cubin" in why and "Rebuild" in why
    # the rebuild it names: into the manifest's folder, with the variant's tuning
    assert f"python -m pkvrt._build {m.path.parent}" in why
    assert ("PKVRT_TUNE=PKV_TC_STAGES=4 " in why) == (tuned is not None), why
    assert stale_source(m, entry, tmp_path / "no-checkout") is None


def test_the_driver_refuses_a_stale_cubin_before_loading_it(tmp_path, monkeypatch):
    """``_driver._module`` raises naming the stale image before it reads or loads any byte of it;
    PKVRT_ALLOW_STALE_CUBINS=1 turns the refusal into a warning (A/B runs of older builds)."""
    from pkvrt.launch import _driver
    from pkvrt.launch import manifest as manifest_mod

    root, m = _fake_build(tmp_path)
    header = root / _buildspec.HEADERS[0]
    header.write_bytes(header.read_bytes() + b"\n// changed\n")
    monkeypatch.setattr(manifest_mod.stale_source, "__defaults__", (root,))
    monkeypatch.setattr(_driver, "_manifest", m)
    monkeypatch.setattr(_driver.torch.cuda, "get_device_capability", lambda *a: (9, 0))
    monkeypatch.setattr(_driver, "_modules", {})
    monkeypatch.delenv("PKVRT_ALLOW_STALE_CUBINS", raising=False)
    with pytest.raises(ManifestError, match=r"split_decode\.sm_90\.cubin.*Rebuild"):
        _driver._module(0, "split_decode")

    loaded = []

    class _Cu:                    # stands in for cuda.bindings.driver past the check
        @staticmethod
        def cuModuleLoadData(data):
            loaded.append(data)
            return (0, "module")

    monkeypatch.setenv("PKVRT_ALLOW_STALE_CUBINS", "1")
    monkeypatch.setattr(_driver, "cu", _Cu)
    monkeypatch.setattr(_driver, "check", lambda call, result: result[1])
    with pytest.warns(RuntimeWarning, match="PKVRT_ALLOW_STALE_CUBINS=1"):
        assert _driver._module(0, "split_decode") == ("module", 90)
    assert loaded == [b"\0"]
