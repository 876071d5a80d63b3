"""`pkvrt bench serving` and `pkvrt calibrate` on a GPU (run on the H200): a tiny serving run
completes (fp16, and with an FP8 KV cache), passes the correctness check and writes valid
results; the device timing excludes host gaps; `calibrate --quick` writes a loadable calibration
file."""

from __future__ import annotations

import time

import pytest
import torch

from pkvrt.measure import harness, results
from pkvrt.policy import calibration
from pkvrt.tools import cli, report

pytestmark = pytest.mark.gpu


def run(capsys, *argv):
    rc = cli.main(list(argv))
    out, err = capsys.readouterr()
    return rc, out, err


@pytest.fixture
def tiny_trace(tmp_path):
    """Two long rows (>= 16K: PersistentKV routes are eligible) and a short one; B2."""
    p = tmp_path / "tiny.csv"
    p.write_text("arrival_step,prompt_len,decode_len\n0,17000,4\n0,900,3\n1,20000,3\n")
    return p


ENGINES = ("flashinfer,flashinfer-cuda,flashinfer-xqa,flashinfer-cudnn,flashinfer-graph,adaptive,"
           "pkv_workqueue,pkv_bucket,pkv_fused")


@pytest.mark.parametrize("extra, case", [
    ([], "tiny-B2-seed5"),
    (["--engine-layers", "3", "--mlp"], "tiny-B2-L3-mlp-seed5"),
])
def test_tiny_serving_run(capsys, tmp_path, tiny_trace, extra, case):
    out = tmp_path / "res" / "serving.json"
    rc, stdout, err = run(capsys, "bench", "serving", "--trace", str(tiny_trace), "--max-active", "2",
                          "--seeds", "5", "--steps-limit", "6", "--engines", ENGINES,
                          "--out", str(out), *extra)
    assert rc == 0, stdout + err
    doc = results.read_results(out)
    meta = doc["meta"]
    assert meta["kind"] == "serving" and meta["gpu"] == torch.cuda.get_device_name()
    seed = meta["per_seed"]["5"]
    assert seed["baseline"] in harness.FI_VARIANTS
    # every FlashInfer path competed or is named with the reason (cuDNN needs FlashInfer >= 0.6)
    assert list(meta["baseline_candidates"]) == list(harness.FI_VARIANTS)
    assert meta["baseline_candidates"]["flashinfer-xqa"] == "ok"
    assert seed["baseline_probe_device_us"][seed["baseline"]] == min(seed["baseline_probe_device_us"].values())
    measured = {r["engine"]: r for r in doc["rows"] if r["row"] == "measured"}
    assert {"pkvrt-adaptive", "pkvrt-workqueue", "pkvrt-bucket", "pkvrt-fused",
            "flashinfer-graph"} <= set(measured)
    unavailable = {r["engine"] for r in doc["rows"] if r["row"] == "unavailable"}
    assert unavailable | set(measured) >= {"flashinfer-xqa", "flashinfer-cudnn"}
    failed = {k for k, v in meta["baseline_candidates"].items() if v != "ok"}
    assert unavailable == failed & {"flashinfer-cuda", "flashinfer-xqa", "flashinfer-cudnn"}
    assert sum(r["baseline"] for r in measured.values()) == 1
    for r in measured.values():
        assert r["case"] == case and r["correct"], r
        assert r["max_err"] < 2e-3 and r["mean_err"] < 3e-4 and r["max_err_ref"] < 2e-3
        assert r["median_us"] > 0 and r["wall_us"] > 0 and r["tok_per_s"] > 0
        assert r["steps"] == 6 and r["decode_tokens"] > 6
    assert measured["pkvrt-workqueue"]["route"] == "pkv_workqueue"
    assert measured["pkvrt-bucket"]["route"] == "pkv_bucket"
    assert measured["flashinfer-graph"]["route"] == "flashinfer"
    ratios = [r for r in doc["rows"] if r["row"] == "ratio"]
    assert len(ratios) == len(measured) - 1 and all(r["wall_ratio"] > 0 for r in ratios)
    steps = results.read_results(out.with_name("serving.steps.json"))
    assert steps["meta"]["kind"] == "serving-steps" and len(steps["rows"]) == 6 * len(measured)
    rc, _, err = run(capsys, "report", str(out.parent), "--out", str(tmp_path / "rep"))
    assert rc == 0, err
    assert "pkvrt-adaptive" in (tmp_path / "rep" / "report.md").read_text()


def test_tiny_fp8_serving_run(capsys, tmp_path, tiny_trace):
    """--kv-dtype fp8: FlashInfer's FP8-KV paths compete for the baseline (cuDNN has
    none with fp16 q: named unavailable), every pkvrt engine matches FP32 attention over the
    dequantized cache within the fp16 tolerance, and the names and meta say FP8."""
    out = tmp_path / "res" / "serving-fp8.json"
    rc, stdout, err = run(capsys, "bench", "serving", "--trace", str(tiny_trace), "--max-active", "2",
                          "--seeds", "5", "--steps-limit", "6", "--engine-layers", "2",
                          "--kv-dtype", "fp8", "--fp8-scales", "amax",
                          "--engines", "flashinfer,adaptive,device-plan,device-plan-step",
                          "--out", str(out))
    assert rc == 0, stdout + err
    doc = results.read_results(out)
    meta = doc["meta"]
    assert meta["kv_dtype"] == "float8_e4m3fn" and meta["fp8_scales"] == "amax"
    assert meta["per_seed"]["5"]["baseline"] in ("flashinfer-cuda", "flashinfer-tc", "flashinfer-xqa")
    assert list(meta["baseline_candidates"]) == list(harness.FI_VARIANTS)
    measured = {r["engine"]: r for r in doc["rows"] if r["row"] == "measured"}
    assert set(measured) - {meta["per_seed"]["5"]["baseline"]} == {
        "pkvrt-adaptive", "pkvrt-device-plan", "pkvrt-device-plan-step"}
    for label, r in measured.items():
        assert r["case"] == "tiny-B2-L2-fp8-seed5" and r["correct"] and r["within_fp8_bound"], r
        if label.startswith("pkvrt-"):
            assert r["max_err_ref"] < 2e-3 and r["mean_err_ref"] < 3e-4, r
            assert r["median_us"] > 0 and r["steps"] == 6


def test_step_graph_records_the_route_each_batch_size_ran(capsys, tmp_path):
    """The step-graph engine replays one graph per batch size; each step's recorded route is its
    own graph's (routes.toml [device_planning]: one row -> small_route, more -> route), not the
    route of whichever graph was captured last."""
    from pkvrt.policy.registry import load_routes

    trace = tmp_path / "two-phases.csv"   # two rows for two steps, then one row alone for three
    trace.write_text("arrival_step,prompt_len,decode_len\n0,17000,2\n0,900,2\n5,20000,3\n")
    out = tmp_path / "res" / "serving.json"
    rc, stdout, err = run(capsys, "bench", "serving", "--trace", str(trace), "--max-active", "2",
                          "--seeds", "5", "--steps-limit", "5", "--engine-layers", "2",
                          "--engines", "flashinfer,device-plan-step", "--out", str(out))
    assert rc == 0, stdout + err
    reg = load_routes(None)
    rows = [r for r in results.read_results(out.with_name("serving.steps.json"))["rows"]
            if r["engine"] == "pkvrt-device-plan-step"]
    assert sorted({r["active"] for r in rows}) == [1, 2]
    assert reg.device_planning_route(1).name != reg.device_planning_route(2).name   # the shipped file
    for r in rows:
        assert r["route"] == reg.device_planning_route(r["active"]).name, r


class _HostSlowEngine:
    """Plans slowly on the host (5 ms sleep), then runs one small device op per layer."""

    label = "slow-host"

    def __init__(self):
        self.x = torch.zeros(1 << 20, device="cuda")

    def plan(self, step):
        time.sleep(0.005)

    def attend(self, q, k, v, out):
        self.x.add_(1.0)

    def step_info(self):
        return "none", (), None

    def stats(self):
        return {}


@pytest.mark.serial   # it reads device and wall times
def test_device_time_excludes_host_gaps():
    from pkvrt.measure.traces import Request, Trace

    trace = Trace(name="t", requests=(Request(0, 0, 40, 3),), seed=None, source="test")
    config = harness.ServingConfig(trace="t", max_active=1, seeds=(1,), engines=("flashinfer",),
                                   shape=harness.Shape())
    wl = harness.Workload(trace, config, 1)
    out = torch.empty((1, 32, 128), dtype=torch.float16, device="cuda")
    clock = harness.CudaClock()
    eng = _HostSlowEngine()
    walls, _ = harness.wall_pass(eng, wl, wl.steps, out, clock)
    cudas, uncovered = harness.device_pass(eng, wl, wl.steps, out, clock, [1.25 * w + 50 for w in walls])
    assert min(walls) > 5000.0                    # the host sleep is wall time
    assert max(cudas) < 1000.0 and uncovered == 0  # ... but not device time


@pytest.mark.serial   # it checks measured constants against plausible ranges
def test_calibrate_quick_writes_a_loadable_file(capsys, tmp_path):
    target = tmp_path / "cal.json"
    raw = tmp_path / "raw" / "sweeps.json"
    rc, out, err = run(capsys, "calibrate", "--quick", "--out", str(target), "--raw", str(raw))
    assert rc == 0, out + err
    cal = calibration.load_calibration(target)
    props = torch.cuda.get_device_properties(0)
    assert cal.gpu == props.name and cal.slug == calibration.slugify(props.name)
    assert cal.sm_count == props.multi_processor_count and cal.seed == 20260622
    assert 100 < cal.beta_gbps < 20000 and 0 < cal.lambda_graph_us < cal.lambda_us < 100
    assert [a for a, _ in cal.flashinfer_ctas_per_sm] == [1, 8]
    assert cal.splits.min_split_tokens % 32 == 0
    assert "beta_gbps" in out and f"wrote {target}" in out
    assert report.load_dir(raw.parent)            # the raw sweeps are a valid results file
