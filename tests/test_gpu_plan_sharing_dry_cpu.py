"""tests/gpu/test_device_plan.py's and tests/gpu/test_sharing.py's own test functions run on the
CPU test device, as tests/test_gpu_tests_dry_cpu.py does for tests/gpu/test_coverage.py: a GPU
call then spends its minutes on the kernels, not on the test code's mistakes.

Both GPU modules are imported with DEV = "cpu" (test_sharing with torch.cuda.is_available faked
True while it imports, so that its module-level skip does not fire) and run on the fake device of
tests/test_gpu_tests_dry_cpu.py (the ``gpu_module`` fixture: tests/test_runtime_cpu.py's emulated
kernels behind the real launch wrappers' argument checks, the H200 residency and device name).
Each GPU test checks the emulated outputs as it would the kernels' on the H200: the device plan
against the host planner, the shared-pages steps and merge_segments against the FP32 reference
or the merge written out in torch. A wrong output fails here too (the last tests show it).

Every parametrization of every test function of both modules runs (155 + 86 cases, ~40 s on
2 cores with one torch thread). Not seen here: the kernels' own numerics (the emulation computes
in FP32), real CUDA graph capture (test_device_plan's own torch.cuda.graph records the launches
made in it and a replay re-runs them; SharedPagesRuntime's engine capture is the fake device's),
streams (no-ops) and a tensor left on the host where the GPU wants it (everything is on the CPU).
"""

from __future__ import annotations

import contextlib
import inspect

import pytest
import torch

from pkvrt.launch import ops
from test_gpu_tests_dry_cpu import REAL, gpu_module, load_gpu_tests, parametrizations  # noqa: F401

plan = load_gpu_tests("test_device_plan")
with pytest.MonkeyPatch.context() as _m:
    _m.setattr(torch.cuda, "is_available", lambda: True)   # the module skips itself without CUDA
    sharing = load_gpu_tests("test_sharing")


# ----------------------------------------------------------------------------- streams and graphs


class FakeStream:
    def wait_stream(self, other):
        pass

    def synchronize(self):
        pass


class RecordedGraph:
    """torch.cuda.CUDAGraph: the ops launches made inside ``torch.cuda.graph(g)``, replayed."""

    def __init__(self):
        self.launches = []

    def replay(self):
        assert self.launches, "a graph with no launches captured"
        for launch, args, kw in self.launches:
            launch(*args, **kw)


@contextlib.contextmanager
def recording(graph, *args, **kw):
    """torch.cuda.graph: a launch inside is recorded, not run, as in a capture (the GPU test's
    captured step is launches only: other work in it would run once here, not on replay)."""
    saved = {name: getattr(ops, name) for name in REAL}

    def record(launch, a, k):
        if k.pop("prepare", False):   # ops.PreparedLaunch: each call recorded as a launch
            return lambda: graph.launches.append((launch, a, k))
        graph.launches.append((launch, a, k))
        return None

    for name, launch in saved.items():
        setattr(ops, name, lambda *a, _launch=launch, **k: record(_launch, a, k))
    try:
        yield
    finally:
        for name, launch in saved.items():
            setattr(ops, name, launch)


@pytest.fixture
def dry(gpu_module, monkeypatch):   # noqa: F811 (the imported fixture)
    """The fake device (gpu_module), the two GPU modules on the CPU, streams and graphs faked."""
    for mod in (plan, sharing):
        monkeypatch.setattr(mod, "DEV", "cpu")
    monkeypatch.setattr(torch.cuda, "Stream", lambda *a, **k: FakeStream())
    monkeypatch.setattr(torch.cuda, "current_stream", lambda *a, **k: FakeStream())
    monkeypatch.setattr(torch.cuda, "stream", lambda s: contextlib.nullcontext())
    monkeypatch.setattr(torch.cuda, "CUDAGraph", RecordedGraph)
    monkeypatch.setattr(torch.cuda, "graph", recording)


# ----------------------------------------------------------------------------- the cases


def cases(mod) -> list:
    return [p for name in sorted(n for n in dir(mod) if n.startswith("test_"))
            for p in parametrizations(getattr(mod, name))]


PLAN_CASES, SHARING_CASES = cases(plan), cases(sharing)


@pytest.mark.parametrize("test, kw", PLAN_CASES)
def test_device_plan_tests_pass_on_the_emulated_kernels(dry, test, kw):
    getattr(plan, test)(**kw)


@pytest.mark.parametrize("test, kw", SHARING_CASES)
def test_sharing_tests_pass_on_the_fake_device(dry, test, kw):
    getattr(sharing, test)(**kw)


def test_every_test_function_of_both_modules_is_dry_run():
    """Every case of every test function (163 of test_device_plan, 98 of test_sharing), each
    under its own id."""
    assert (len(PLAN_CASES), len(SHARING_CASES)) == (163, 98)
    for mod, run in ((plan, PLAN_CASES), (sharing, SHARING_CASES)):
        assert {p.values[0] for p in run} == {n for n in dir(mod) if n.startswith("test_")}
        assert len(run) == len({p.id for p in run})


# ----------------------------------------------------------------------------- the dry run can fail


def corrupt(monkeypatch, name, tensor, wrong):
    """ops.<name> as it is, then ``wrong(argument)`` applied to its argument named ``tensor``
    (after each launch of a prepared one, ops.PreparedLaunch)."""
    launch, sig = getattr(ops, name), inspect.signature(REAL[name])

    def launch_wrong(*args, **kw):
        prepared = launch(*args, **kw)
        spoil = lambda: wrong(sig.bind(*args, **kw).arguments[tensor])  # noqa: E731
        if prepared is None:
            spoil()
            return None

        def launch_then_spoil():
            prepared()
            spoil()
        return launch_then_spoil

    monkeypatch.setattr(ops, name, launch_wrong)


def test_a_wrong_plan_fails_the_device_plan_tests(dry, monkeypatch):
    """A device plan whose first task stops after one tile fails the comparison with the host
    planner."""
    corrupt(monkeypatch, "plan_workqueue_device", "tasks", lambda t: t[0, 4].copy_(t[0, 3] + 32))
    with pytest.raises(AssertionError, match="not equal"):
        plan.test_device_plan_equals_host_plan_for_one_row(32768, None)
    with pytest.raises(AssertionError, match="not equal"):
        plan.test_device_plan_equals_host_plan(2, "room32")


def test_a_wrong_merge_fails_the_sharing_tests(dry, monkeypatch):
    """merge_segments writing one element wrong fails the shared-pages step against the FP32
    reference (eager, engine-captured, in 64-head chunks, and cut by the time model) and the
    kernel test against the torch merge."""
    corrupt(monkeypatch, "merge_segments", "out", lambda out: out[0, 0, 0].add_(1.0))
    hq, hkv, lens, prefixes = sharing.CASES[0]
    for capture, chunks in ((False, "default"), (True, "default"), (False, "wide"), (True, "cut")):
        with pytest.raises(AssertionError) as failed:
            sharing.test_shared_pages_match_the_reference(hq, hkv, lens, prefixes, capture, chunks)
        assert failed.value.args[0][0] > 2e-3        # (err, rt.explain()): the reference check
    with pytest.raises(AssertionError, match="not close"):
        sharing.test_merge_segments_kernel_matches_torch(torch.float16, 64, False)


def test_wrong_shared_prefixes_fail_the_device_lengths_tests(dry, monkeypatch):
    """find_shared dropping a row's chunk state fails the kernel-against-twin test and the
    device-lengths step against the FP32 reference."""
    def drop(slots):
        rows = (slots[:, 0] >= 0).nonzero()
        if len(rows):
            slots[rows[0, 0], 0] = -1
    corrupt(monkeypatch, "find_shared", "slots", drop)
    with pytest.raises(AssertionError, match="slots"):
        sharing.test_find_shared_kernel_matches_its_twin(0)
    hq, hkv, lens, prefixes = sharing.CASES[0]
    with pytest.raises(AssertionError) as failed:
        sharing.test_device_lengths_shared_pages_match_the_reference(hq, hkv, lens, prefixes, False)
    assert failed.value.args[0][0] > 2e-3        # (err, rt.explain()): the reference check


def test_the_graph_test_checks_what_its_replays_compute(dry, monkeypatch):
    """The graph test's outputs come from the recorded graph's replays: a merge in it writing one
    element wrong fails the test, and so does a replay that runs nothing (out stays the NaN it
    was filled with before each replay)."""
    with monkeypatch.context() as m:
        corrupt(m, "merge", "out", lambda out: out[0, 0, 0].add_(1.0))
        with pytest.raises(AssertionError) as failed:
            plan.test_plan_decode_merge_in_one_graph_with_changing_lengths()
        assert "rel_err(out, ref) < 2e-3" in str(failed.traceback[-1].statement)   # its own check
    monkeypatch.setattr(RecordedGraph, "replay", lambda self: None)
    with pytest.raises(AssertionError) as failed:
        plan.test_plan_decode_merge_in_one_graph_with_changing_lengths()
    assert "rel_err(out, ref) < 2e-3" in str(failed.traceback[-1].statement)
