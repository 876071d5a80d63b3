"""`pkvrt bench serving --engines shared-step,shared-device-step` without a GPU: the harness's whole loop with
pkvrt.SharedPagesRuntime as an engine (host lengths, every layer of a step in one graph per
step key) on the fake device of test_runtime_cpu.py, on a trace whose requests share prompt
prefixes (served with prefix caching: equal prefix hashes map to the same pages), against the
FP32 reference and beside host-step; the kernels and FlashInfer run on the H200 only."""

from __future__ import annotations

import numpy as np
import pytest

from pkvrt.measure import harness
from pkvrt.measure.traces import Request, Trace
from pkvrt.policy.registry import load_routes
from pkvrt.runtime.shared import SharedPagesRuntime
from pkvrt.tools import bench
from pkvrt.tools.plan_cmd import seed_calibration
from test_bench_fp8_cpu import FakeFlashInfer, VirtualClock
from test_runtime_cpu import fake_device  # noqa: F401

SHAPE = harness.Shape(num_qo_heads=8, num_kv_heads=2, head_dim=64, page_size=16)
REGISTRY = load_routes(None)


def _trace():
    """Four requests of one 64-token-block prefix family (blocks 0-3 shared by three of them, a
    fourth with its own prompt), block_tokens 64 (a multiple of the page)."""
    reqs = (Request(0, 0, 300, 3, prefix=(0, 1, 2, 3)), Request(1, 0, 280, 3, prefix=(0, 1, 2, 3)),
            Request(2, 0, 260, 3, prefix=(0, 1, 2, 9)), Request(3, 0, 200, 3, prefix=(7, 8, 5)))
    return Trace(name="shared", requests=reqs, seed=None, source="test", block_tokens=64)


def test_engine_name_and_label():
    names = [r.name for r in REGISTRY.routes]
    assert harness.parse_engines("shared-step", names) == ("flashinfer", "shared-step")
    assert harness.engine_label("shared-step") == "pkvrt-shared-step"
    assert "shared-step" in bench.ENGINES
    assert harness.engine_label("shared-device-step") == "pkvrt-shared-device-step"
    assert "shared-device-step" in bench.ENGINES


@pytest.mark.slow
def test_shared_step_engine_serves_a_prefix_sharing_trace(fake_device, monkeypatch):  # noqa: F811
    # the trace's short rows are predicted faster plain (tests/test_sharing_rule_cpu.py): shared
    # here regardless, so that the engine's shared path runs through the harness
    monkeypatch.setattr(SharedPagesRuntime, "_sharing_pays", lambda self, seq, rereads, sp, own_gather: True)
    config = harness.ServingConfig(trace="shared", max_active=4, seeds=(11,), steps_limit=3,
                                   check_steps=3, probe_steps=1, layers=2,
                                   engines=("flashinfer", "host-step", "shared-step",
                                            "shared-device-step"), shape=SHAPE)
    made, clock = {}, VirtualClock()

    def flashinfer(name, wl, *, max_active):
        made[name] = FakeFlashInfer(name, wl, clock=clock)
        return made[name]
    factory = bench.engine_factory(config, REGISTRY, seed_calibration(), flashinfer=flashinfer)

    def make_engine(name, wl, fi_route):
        made[name] = made.get(name) or factory(name, wl, fi_route)
        return made[name]
    rows, steps, info = harness.run_seed(config, 11, _trace(), make_engine, clock=clock,
                                         device="cpu", budget_bytes=2**30, log=lambda *a: None)
    measured = {r["engine"]: r for r in rows if r.get("row") == "measured"}
    shared = measured["pkvrt-shared-step"]
    assert shared["correct"] and measured["pkvrt-host-step"]["correct"], rows
    assert "shared-pages" in shared["route_mix"]
    # each shared run is read once per chunk: fewer K/V bytes than every row reading its pages
    assert shared["useful_kv_mb"] < measured["pkvrt-host-step"]["useful_kv_mb"]
    assert isinstance(made["shared-step"], harness.SharedStepGraphEngine)
    assert made["shared-step"].rt.plan_used is not None and np.all(made["shared-step"].rt.plan_used.chunk_valid.sum(1) >= 1)
    # the same trace with the sharing found on the (emulated) GPU, the whole step in one graph
    device = measured["pkvrt-shared-device-step"]
    assert device["correct"] and "shared-pages-device" in device["route_mix"], rows
    assert device["useful_kv_mb"] < measured["pkvrt-host-step"]["useful_kv_mb"]
    assert isinstance(made["shared-device-step"], harness.SharedDeviceStepEngine)
    assert made["shared-device-step"].rt.found().tokens_saved > 0
