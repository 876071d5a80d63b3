"""tests/gpu/test_coverage.py's own test functions run on the CPU test device, so that a GPU
call spends its minutes on the kernels, not on the test code's mistakes (a wrong call signature,
attribute, shape, tolerance looked up, or loop).

The GPU module is imported with DEV = "cpu", the H200 calibration (calibration/nvidia-h200.json)
and a no-op torch.cuda.synchronize; the Runtime runs on tests/test_runtime_cpu.py's fake device.
Each launch first goes through the real launch wrapper of pkvrt.launch.ops with only the launch
itself left out (its argument checks: dtypes, shapes, strides, alignment, int32 metadata, sinks
and lse), then through the emulated kernel, whose outputs the GPU test checks against the FP32
reference as it would on the H200: a wrong output fails here too.

Every parametrization of every test function of the GPU module runs (445 cases, ~35 s on
2 cores with one torch thread). What this cannot see: the kernels' own numerics (the emulation
computes in FP32, so the tolerances are not exercised), real CUDA graph capture (a replay here
re-runs the Python launches) and a tensor left on the host where the GPU wants it on the device
(everything is on the CPU).
"""

from __future__ import annotations

import contextlib
import importlib.util
import inspect
import itertools
import pathlib

import pytest
import torch

from pkvrt.launch import _driver, ops
from pkvrt.policy.calibration import load_calibration
from test_runtime_cpu import Emu, install_fake_device

ROOT = pathlib.Path(__file__).resolve().parents[1]
H200 = load_calibration(ROOT / "calibration" / "nvidia-h200.json")
KERNELS = ("split_decode", "merge", "merge_segments", "workqueue_decode", "plan_workqueue_device",
           "find_shared")
REAL = {name: getattr(ops, name) for name in KERNELS}   # taken before any fake device replaces them


def load_gpu_tests(name: str):
    """A module of tests/gpu imported under its own name (pytest's copy, if any, is untouched)."""
    spec = importlib.util.spec_from_file_location(f"dry_{name}", ROOT / "tests" / "gpu" / f"{name}.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


cov = load_gpu_tests("test_coverage")


# ----------------------------------------------------------------------------- the device


@contextlib.contextmanager
def cpu_tensors_pass_as_cuda():
    """``tensor.is_cuda`` True, for the real wrappers' "a CUDA tensor" checks on CPU tensors."""
    assert "is_cuda" not in torch.Tensor.__dict__
    torch.Tensor.is_cuda = property(lambda self: True)
    try:
        yield
    finally:
        del torch.Tensor.is_cuda


def checked(name: str, emulated):
    """ops.<name> as the fake device runs it: the real wrapper's checks (its launch a no-op: the
    fixture patches _driver.launch), then the emulated kernel given the same arguments (bound to
    the real signature, so a keyword the real wrapper lacks is a TypeError here too). Within a
    launch each row's gathered K/V is kept (the kernels write no cache): the same values, once."""
    real = REAL[name]
    sig = inspect.signature(real)
    mine = [p for p in sig.parameters.values() if p.name != "trace"]
    theirs = list(inspect.signature(emulated).parameters.values())
    assert len(mine) == len(theirs), (name, mine, theirs)
    rename = {}
    for p, e in zip(mine, theirs):
        assert p.kind == e.kind, (name, p, e)
        assert p.kind != p.KEYWORD_ONLY or p.name in {x.name for x in theirs}, (name, p)
        rename[p.name] = p.name if p.kind == p.KEYWORD_ONLY else e.name

    def launch(*args, **kw):
        bound = sig.bind(*args, **kw)            # TypeError: a call the real wrapper refuses
        with cpu_tensors_pass_as_cuda():
            real(*args, **kw)                    # KernelArgumentError: arguments it refuses
        given = {rename[k]: v for k, v in bound.arguments.items() if k != "trace"}
        memo, owner = {}, getattr(emulated, "__self__", None)

        def kv(cache, bt_row, n, scale=None):
            key = (cache.data_ptr(), cache.dtype, tuple(cache.stride()), bt_row.data_ptr(), n,
                   None if scale is None else scale.data_ptr())
            if key not in memo:
                memo[key] = Emu._kv(cache, bt_row, n, scale)
            return memo[key]

        if owner is not None:
            owner._kv = kv
        try:
            return emulated(**given)
        finally:
            if owner is not None:
                del owner._kv

    return launch


@pytest.fixture
def gpu_module(monkeypatch):
    """The fake device with checked launches, and the GPU module set up to run on it."""
    emu = Emu()
    for family in ("split_decode", "workqueue_decode", "fused_decode"):   # the H200 cubins' residency
        emu.occupancy.update({(family, 64): 4, (family, 256): 1})        # (benches/NOTES.md)
    install_fake_device(monkeypatch.setattr,
                        lambda name: checked(name, getattr(emu, name)) if name in REAL else getattr(emu, name))
    monkeypatch.setattr(_driver, "launch", lambda *a, **k: None)
    monkeypatch.setattr(torch.cuda, "synchronize", lambda *a, **k: None)
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda *a, **k: "NVIDIA H200")   # "auto"
    monkeypatch.setattr(cov, "DEV", "cpu")
    monkeypatch.setattr(cov, "calibration", lambda: H200)
    threads = torch.get_num_threads()
    torch.set_num_threads(1)   # many tiny ops: one thread is ~20x faster on a busy 2-core box (conftest.py)
    yield cov
    torch.set_num_threads(threads)


# ----------------------------------------------------------------------------- the cases


def parametrizations(fn) -> list:
    """Every case of the GPU test's own parametrize lists, as pytest.params of (its name, its
    keywords), with an id like pytest's (the bottom decorator's value first)."""
    axes = []
    for mark in [m for m in getattr(fn, "pytestmark", []) if m.name == "parametrize"]:   # bottom first
        names = mark.args[0]
        names = [n.strip() for n in names.split(",")] if isinstance(names, str) else list(names)
        ids = mark.kwargs.get("ids")
        axis = []
        for i, v in enumerate(mark.args[1]):
            values = v.values if hasattr(v, "values") else (v,) if len(names) == 1 else tuple(v)
            vid = v.id if getattr(v, "id", None) else ids[i] if ids else "-".join(map(str, values))
            axis.append((vid, dict(zip(names, values))))
        axes.append(axis)
    cases = []
    for combo in itertools.product(*axes):
        cid = "-".join(c[0] for c in combo)
        kw = {k: v for _, d in combo for k, v in d.items()}
        cases.append(pytest.param(fn.__name__, kw, id=f"{fn.__name__}[{cid}]" if cid else fn.__name__))
    return cases


KERNEL_CASES = [
    *parametrizations(cov.test_every_group_size_and_head_dim),
    *parametrizations(cov.test_attention_variants),
    *parametrizations(cov.test_page_sizes),
    *parametrizations(cov.test_cache_layouts),
    *parametrizations(cov.test_e4m3_kv),
    *parametrizations(cov.test_e4m3_nhd_layout),
    *parametrizations(cov.test_layout_views_are_what_they_claim),
    *parametrizations(cov.test_sinks_dominate_where_they_are_large),
    *parametrizations(cov.test_device_plan_with_a_window_equals_the_host_plan),
]
RUNTIME_CASES = [
    *parametrizations(cov.test_runtime_models),
    *parametrizations(cov.test_runtime_lse_of_a_padded_batch),
    *parametrizations(cov.test_runtime_sinks_and_lse_arguments),
    *parametrizations(cov.test_graph_replay_after_lengths_grew),
    *parametrizations(cov.test_phi3_has_no_flashinfer_route),
    *parametrizations(cov.test_runtime_refuses_unserved_e4m3_shapes),
]


@pytest.mark.parametrize("test, kw", KERNEL_CASES)
def test_kernel_tests_pass_on_the_emulated_kernels(gpu_module, test, kw):
    getattr(gpu_module, test)(**kw)


@pytest.mark.parametrize("test, kw", RUNTIME_CASES)
def test_runtime_tests_pass_on_the_fake_device(gpu_module, test, kw):
    getattr(gpu_module, test)(**kw)


def test_every_test_function_of_the_module_is_dry_run():
    """Every test function of the GPU module, every parametrization (445 cases)."""
    ran = {p.values[0] for p in KERNEL_CASES + RUNTIME_CASES}
    assert ran == {n for n in dir(cov) if n.startswith("test_")}
    assert len(KERNEL_CASES + RUNTIME_CASES) == len(set(p.id for p in KERNEL_CASES + RUNTIME_CASES))


def test_a_wrong_output_fails_the_gpu_tests_check(gpu_module, monkeypatch):
    """The dry run can fail: an emulated kernel that writes one element wrong fails the GPU test."""
    launch = ops.workqueue_decode

    def off_by_a_bit(*args, **kw):
        launch(*args, **kw)
        args[8][0, 0, 0] += 1.0          # out

    monkeypatch.setattr(ops, "workqueue_decode", off_by_a_bit)
    with pytest.raises(AssertionError, match="rel. error"):
        gpu_module.test_attention_variants("window127", 4, 128, torch.float16, cov.LENS, "workqueue")


def test_the_real_argument_checks_run(gpu_module):
    """A launch the real wrapper refuses is refused on the fake device: a float32 lse of the wrong
    shape here."""
    var = cov.VARIANTS["lse"]
    c = gpu_module.make_case(var, g=4, d=128, dtype=torch.float16)
    lse = torch.zeros(c.q.shape[0], c.q.shape[1] + 1)
    with pytest.raises(ops.KernelArgumentError, match="lse"):
        ops.split_decode(c.q, c.k, c.v, c.seq, c.bt, torch.arange(c.q.shape[0], dtype=torch.int32), 1,
                         torch.empty_like(c.q), lse=lse)
