"""benches/sanitize_workload.py's variants-and-layouts sweep on the CPU test device: each case of
tests/gpu/test_coverage.py it runs under compute-sanitizer is built, launched (the emulated
kernels of tests/test_runtime_cpu.py) and checked against the FP32 reference, so a GPU call
spends its time on the sanitizer, not on the workload's own mistakes."""

from __future__ import annotations

import importlib.util
import pathlib
import sys

import pytest
import torch

from pkvrt.policy.calibration import load_calibration
from test_runtime_cpu import fake_device  # noqa: F401

ROOT = pathlib.Path(__file__).resolve().parents[1]


@pytest.fixture
def workload(fake_device, monkeypatch):  # noqa: F811
    spec = importlib.util.spec_from_file_location("sanitize_workload", ROOT / "benches" / "sanitize_workload.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    monkeypatch.setattr(mod, "DEV", "cpu")
    cov = mod._gpu_tests("test_coverage")
    monkeypatch.setattr(cov, "DEV", "cpu")
    monkeypatch.setattr(cov, "calibration", lambda: load_calibration(ROOT / "calibration" / "nvidia-h200.json"))
    monkeypatch.setattr(torch.cuda, "synchronize", lambda *a, **k: None)
    yield mod
    sys.modules.pop("test_coverage", None)


@pytest.mark.parametrize("quick", [True, False], ids=["quick", "full"])
def test_the_coverage_sweep_runs_every_case_and_each_matches(workload, capsys, quick):
    t = workload.Tally()
    workload.coverage_sweep(t, quick)
    out = capsys.readouterr().out
    want = len(workload.QUICK_COVERAGE) if quick else len(workload.COVERAGE_CASES)
    assert (t.cases, t.bad) == (want, 0), out


def test_a_wrong_output_is_a_mismatch(workload, fake_device, capsys, monkeypatch):  # noqa: F811
    """A kernel that gets one row wrong is reported (BAD), and the sweep goes on."""
    real = fake_device.workqueue_decode

    def off_by_a_bit(*args, **kw):
        real(*args, **kw)
        args[8][0] += 0.5          # out, row 0

    monkeypatch.setattr(workload.ops, "workqueue_decode", off_by_a_bit)
    t = workload.Tally()
    workload.coverage_sweep(t, quick=True)
    bad = [line for line in capsys.readouterr().out.splitlines() if line.startswith("BAD")]
    assert t.bad == len(bad) == len(workload.QUICK_COVERAGE)      # every quick case runs it
    assert all("rel. error" in line for line in bad), bad          # the check, not an exception


@pytest.mark.parametrize("quick", [True, False], ids=["quick", "full"])
def test_the_decode_and_fp8_sweeps_match_on_every_shape(workload, capsys, quick):
    """Every head dim and group capacity of the decode sweep, and the e4m3 sweep, through the
    emulated split, workqueue and fused kernels (six cases a shape, five an FP8 one: the fused
    kernel's two-level tail by its rule and forced)."""
    t = workload.Tally()
    buf = workload.Buffers(poison=True)
    workload.decode_sweep(t, workload.QUICK_SHAPES if quick else workload.SHAPES, quick, buf)
    workload.fp8_sweep(t, quick, buf)
    out = capsys.readouterr().out
    shapes = len(workload.QUICK_SHAPES if quick else workload.SHAPES)
    fp8 = 2 if quick else len(workload.FP8_SHAPES)
    assert (t.cases, t.bad) == (6 * shapes + 5 * fp8, 0), out


def test_every_sharing_case_binds_to_its_test_function(workload, monkeypatch):
    """The sanitizer calls tests/gpu/test_sharing.py's functions by name with positional
    arguments: each must still take exactly those, each argument it parametrizes one of its
    values (a test that grows or changes a parameter would otherwise show up only as a BAD line
    on the GPU)."""
    import inspect

    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)   # its module-level skip
    monkeypatch.delitem(sys.modules, "test_sharing", raising=False)
    mod = workload._gpu_tests("test_sharing")
    sys.modules.pop("test_sharing")
    cases = workload.sharing_cases()
    assert len({name for name, _, _ in cases}) == len(cases)
    for name, test, args in cases:
        fn = getattr(mod, test)
        bound = inspect.signature(fn).bind(*args).arguments
        # each argument the GPU test parametrizes is one of its parametrized values
        for mark in getattr(fn, "pytestmark", []):
            if mark.name != "parametrize":
                continue
            names = [n.strip() for n in mark.args[0].split(",")]
            got = tuple(bound[n] for n in names)
            values = [tuple(v) if len(names) > 1 else (v,) for v in mark.args[1]]
            assert got in values, (name, names, got)
