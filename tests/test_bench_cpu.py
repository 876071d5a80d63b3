"""`pkvrt bench` and `pkvrt calibrate` without a GPU: the planner fallback, argument errors, the
harness's pure helpers and its whole measuring loop driven on the CPU (FP32-reference engines,
host clock), and the calibration fits."""

from __future__ import annotations

import math
import time

import attrs
import numpy as np
import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st

from pkvrt import reference
from pkvrt._paths import CHECKOUT
from pkvrt.measure import harness, results
from pkvrt.measure.traces import Request, Trace
from pkvrt.policy import calibration, planner
from pkvrt.policy.registry import load_routes
from pkvrt.policy.router import Router
from pkvrt.tools import bench, calibrate, cli, sweeps
from pkvrt.tools.plan_cmd import seed_calibration

ROUTES = [r.name for r in load_routes(None).routes]


def run(capsys, *argv):
    rc = cli.main(list(argv))
    out, err = capsys.readouterr()
    return rc, out, err


@pytest.fixture
def no_cuda(monkeypatch):
    """Behave as a machine without CUDA even where one exists."""
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)


# --------------------------------------------------------------------------- planner fallback

@pytest.mark.parametrize("trace, seeds", [("bimodal", "20260623,20260624"), ("mixed", "7")])
def test_serving_falls_back_to_the_planner(capsys, tmp_path, no_cuda, trace, seeds):
    out_file = tmp_path / "r" / "plan.json"
    rc, out, err = run(capsys, "bench", "serving", "--trace", trace, "--seeds", seeds,
                       "--out", str(out_file), "--verbose")
    assert rc == 0, err
    assert out.startswith("pkvrt bench: no CUDA GPU here")
    assert "falling back to the planner" in out and "COST-MODEL PREDICTIONS" in out
    seed_list = [int(s) for s in seeds.split(",")]
    assert out.count("Route mix of the adaptive policy") == (len(seed_list) if trace != "mixed" else 1)
    doc = results.read_results(out_file)
    assert doc["meta"]["kind"].startswith("plan") and doc["meta"]["seeds"] == seed_list
    cases = {r["case"] for r in doc["rows"]}
    assert cases == {f"{trace}-B8-seed{s}" for s in seed_list}
    engines = {r["engine"] for r in doc["rows"]}
    assert {"flashinfer", "pkv_workqueue", "adaptive"} <= engines
    # the report reads the fallback's file (Table 4 from planner rows)
    rc, out, _ = run(capsys, "report", str(out_file.parent), "--out", str(tmp_path / "rep"))
    assert rc == 0
    md = (tmp_path / "rep" / "report.md").read_text()
    assert "Table 4" in md and f"| {trace}-B8 | adaptive | planner |" in md


def test_serving_parses_the_xqa_and_cudnn_engines(capsys, no_cuda, monkeypatch):
    seen = {}

    def fallback(args, config, registry, traces):   # stands in for the planner's run
        seen["config"] = config
        return 0
    monkeypatch.setattr(bench, "planner_fallback", fallback)
    rc, _, err = run(capsys, "bench", "serving", "--engines", "flashinfer-xqa,flashinfer-cudnn",
                     "--seeds", "1", "--engine-layers", "32")
    assert rc == 0, err
    assert seen["config"].engines == ("flashinfer", "flashinfer-xqa", "flashinfer-cudnn")
    assert seen["config"].layers == 32


def test_fallback_without_out_writes_nothing(capsys, tmp_path, no_cuda, monkeypatch):
    monkeypatch.chdir(tmp_path)
    rc, out, _ = run(capsys, "bench", "serving", "--seeds", "20260623", "--max-active", "4")
    assert rc == 0 and "max_active 4" in out
    assert list(tmp_path.iterdir()) == []


@pytest.mark.parametrize("argv, message", [
    (["--max-active", "0"], "argument --max-active: 0: expected a positive integer"),
    (["--steps-limit", "-3"], "argument --steps-limit: -3: expected a positive integer"),
    (["--seeds", "abc"], "argument --seeds: 'abc' is not an integer or a range A-B"),
    (["--seeds", "9-3"], "argument --seeds: range '9-3' is empty"),
    (["--dtype", "fp8"], "argument --dtype: invalid choice: 'fp8'"),
])
def test_serving_argument_errors(capsys, no_cuda, argv, message):
    rc, out, err = run(capsys, "bench", "serving", *argv)
    assert rc == 2 and message in err and out == ""


@pytest.mark.parametrize("argv, message", [
    (["--engines", "adaptive,warp"], "--engines: unknown engine 'warp'; expected one of "
                                     "flashinfer, flashinfer-cuda, flashinfer-tc, flashinfer-cudnn, "
                                     "flashinfer-xqa, flashinfer-graph, adaptive, adaptive-eager, "
                                     "adaptive-figraph, adaptive-fiwrapper, adaptive-device-time, device-plan, device-plan-step, "
                                     "device-plan-step-tail1, "
                                     "host-step, adaptive-step, shared-step, shared-device-step, "
                                     + ", ".join(r for r in ROUTES if r != "flashinfer")),
    (["--engines", ","], "--engines: expected a comma-separated list"),
    (["--trace", "no/such.csv"], "--trace 'no/such.csv': expected a family"),
    (["--num-qo-heads", "30"], "--num-qo-heads 30: expected a multiple of --num-kv-heads 8"),
    (["--calibration", "no/such.json"], "no/such.json: cannot read calibration file"),
    (["--routes", "no/such.toml"], "no/such.toml: file not found"),
])
def test_serving_value_errors_name_the_argument(capsys, no_cuda, argv, message):
    rc, out, err = run(capsys, "bench", "serving", *argv)
    assert rc == 2
    assert err.startswith("pkvrt: error: ") and message in err


@pytest.mark.slow
def test_bench_alone_is_the_main_job(capsys, no_cuda):
    # `pkvrt bench` with no mode = `pkvrt bench serving` with its defaults (README's main job);
    # without CUDA that is the planner over the default trace, exit 0.
    rc, out, err = run(capsys, "bench")
    assert rc == 0 and "no CUDA GPU here" in out + err
    assert "Summary (max_active 8)" in out and "Launches/step" not in out   # --verbose has them


def test_isolated_without_gpu(capsys, no_cuda):
    rc, out, err = run(capsys, "bench", "isolated", "--", "--cases", "B1-32K")
    assert rc == 2 and out == ""
    assert "no CUDA GPU here" in err and "benches/isolated.py" in err and "Nothing was run" in err


def test_isolated_missing_file_says_where(capsys, tmp_path, monkeypatch):
    monkeypatch.setattr(bench, "ISOLATED", tmp_path / "benches" / "isolated.py")
    rc, _, err = run(capsys, "bench", "isolated")
    assert rc == 2 and f"{tmp_path / 'benches' / 'isolated.py'} is not here" in err


def test_isolated_calls_the_benchmark_main(capsys, tmp_path, monkeypatch):
    script = tmp_path / "isolated.py"
    script.write_text("def main(argv):\n    print('isolated got', argv)\n    return 3\n")
    monkeypatch.setattr(bench, "ISOLATED", script)
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    rc, out, _ = run(capsys, "bench", "isolated", "--", "--cases", "B1-8K")
    assert rc == 3 and out == "isolated got ['--cases', 'B1-8K']\n"


# --------------------------------------------------------------------------- calibrate, no GPU

def test_calibrate_without_gpu(capsys, tmp_path, no_cuda):
    target = tmp_path / "cal.json"
    rc, out, err = run(capsys, "calibrate", "--quick", "--out", str(target))
    assert rc == 2 and out == ""
    assert "no CUDA GPU here" in err and "Nothing was written" in err
    assert not target.exists()
    assert calibrate.main(["--out", str(target)]) == 2


def test_calibration_script_is_the_same_command():
    import runpy

    script = CHECKOUT / "calibration" / "calibrate.py"
    ns = runpy.run_path(str(script), run_name="not_main")
    assert ns["main"] is calibrate.main


# --------------------------------------------------------------------------- calibration fits

def _cal(**kw):
    return attrs.evolve(seed_calibration(), sm_count=132, beta_gbps=4120.0, lambda_graph_us=1.1,
                        **kw)


def _records(c_min: float, noise=()):
    """Timed configurations as the cost model with ``c_min`` predicts them (B1 32K bucket
    sweep and a B8 32K workqueue sweep), optionally scaled by per-record noise factors."""
    cal = _cal(c_min=c_min)
    recs = []
    for rows, splits in [(1, s) for s in (4, 8, 16, 32, 64)] + [(8, s) for s in (1, 4, 8, 16)]:
        kv = rows * 32768 * 4096
        ctas = rows * 8 * splits
        slots = rows * splits if (rows > 1 or splits > 1) else 0
        merge = planner.state_bytes(slots, num_qo_heads=32, head_dim=128)
        launches = 2 if slots else 1
        from pkvrt.policy.costmodel import route_time_us
        us = route_time_us(kv_bytes=kv, cta_work_per_sm=ctas / 132, launches=launches,
                           merge_bytes=merge, cal=cal, graphs=True)
        recs.append(dict(kv_bytes=kv, ctas=ctas, launches=launches, merge_bytes=merge, us=us))
    for r, f in zip(recs, noise):
        r["us"] *= f
    return recs


@pytest.mark.parametrize("c_min", [1.0, 2.0, 4.0, 6.5])
def test_fit_c_min_recovers_the_model_constant(c_min):
    got = calibrate.fit_c_min(_records(c_min), _cal())
    assert got == pytest.approx(c_min, rel=0.011)       # the grid steps by 1 %


def test_fit_c_min_tolerates_noise():
    rng = np.random.default_rng(5)
    noisy = _records(3.0, noise=rng.uniform(0.97, 1.03, size=9))
    assert calibrate.fit_c_min(noisy, _cal()) == pytest.approx(3.0, rel=0.1)


def test_fit_c_min_takes_the_largest_consistent_value_when_no_point_is_below_the_knee():
    # only B8 x 64 splits: 4096 CTAs / 132 = 31 per SM, above any C_min <= 31 in the grid
    recs = [r for r in _records(2.0) if r["ctas"] == 8 * 8 * 16]
    got = calibrate.fit_c_min(recs, _cal())
    assert got == pytest.approx(8 * 8 * 16 / 132, rel=0.011)
    with pytest.raises(ValueError, match="no timed configurations"):
        calibrate.fit_c_min([], _cal())


def test_fit_flashinfer_ctas_reproduces_the_readme_anchor():
    fi = calibrate.fit_flashinfer_ctas({8: 290.0, 1: 68.0}, context=32768, cal=_cal(c_min=4.0),
                                       kv_bytes_per_token=4096)
    assert fi[8] == pytest.approx(3.61, abs=0.005)
    assert fi[1] == pytest.approx(4 * 32.58 / (68.0 - 1.1), abs=0.005)
    with pytest.raises(ValueError, match="active 2: time 1.0 us is not above"):
        calibrate.fit_flashinfer_ctas({2: 1.0}, context=32768, cal=_cal(c_min=4.0),
                                      kv_bytes_per_token=4096)


def test_calibration_steps_use_the_calibration_seed_only():
    steps = calibrate.calibration_steps()
    assert [(c, k, len(s)) for c, k, s in steps] == [
        ("B1-8K", "bucket", 1), ("B1-32K", "bucket", 1), ("B1-64K", "bucket", 1),
        ("B1-1.6K", "workqueue", 1), ("B1-8K", "workqueue", 1), ("B1-32K", "workqueue", 1),
        ("B1-128K", "workqueue", 1),
        ("B2-32K+1.4K", "workqueue", 2), ("B8-32K", "workqueue", 8), ("B8-1K", "workqueue", 8),
        ("short-B8-seed20260622", "workqueue", 8),
        ("bimodal-B4-seed20260622", "workqueue", 4), ("bimodal-B8-seed20260622", "workqueue", 8),
        ("long1-B8-seed20260622", "workqueue", 8)]
    b8 = steps[-2][2]
    assert (b8 > 30720).sum() == 2 and ((b8 >= 1025) & (b8 <= 4097)).sum() == 6
    short = steps[-4][2]
    assert short.min() >= 16 and short.max() <= 8000
    long1 = steps[-1][2]   # one long row first, seven short ones
    assert 16384 <= long1[0] <= 49152 and long1[1:].min() >= 1024 and long1[1:].max() <= 6144
    again = calibrate.calibration_steps()
    for i in (-1, -2, -4):   # seeded
        assert np.array_equal(again[i][2], steps[i][2])
    other = calibrate.calibration_steps(seed=20260623)
    for i in (-1, -2, -4):
        assert not np.array_equal(other[i][2], steps[i][2])


def test_calibration_times_cuts_in_the_runtimes_grid():
    # the Runtime pads a device-planned step's batch to a power of two and launches the most
    # CTAs the partition may plan for it: max_waves resident waves, capped by every row at the
    # largest split count (planner.device_grid_ctas); the sweeps time every cut in that grid
    fused = load_routes(None).route("pkv_fused").splits   # 1..64
    base = _cal()
    grid = lambda rows, hkv: calibrate.runtime_grid(rows, num_kv_heads=hkv, splits=fused,  # noqa: E731
                                                    base=base, resident=2, max_waves=3)
    assert grid(8, 4) == 3 * 2 * 132            # G 8 B8: 792 slots, whatever the cut
    assert grid(1, 4) == 4 * 64                 # one row: every KV head at 64 splits
    assert grid(3, 4) == grid(4, 4) == 3 * 2 * 132   # 3 rows replay the 4-row graph (unpadded: 4*3*64 = 768)
    wq = load_routes(None).route("pkv_workqueue").splits
    assert calibrate.runtime_grid(1, num_kv_heads=8, splits=wq, base=base, resident=2,
                                  max_waves=3) == 8 * wq.candidates()[-1]
    full = attrs.evolve(base, splits=calibration.SplitPoints(1.0, 2.0, 32, max_waves=3))
    assert grid(8, 4) == planner.device_grid_ctas(8, num_kv_heads=4, splits=fused, cal=full)
    tasks = torch.arange(15, dtype=torch.int32).view(3, 5)   # the slots past the plan's 3 tasks: zeros
    padded = calibrate.padded_tasks(tasks, 8)
    assert padded.shape == (8, 5) and torch.equal(padded[:3], tasks) and not padded[3:].any()
    assert calibrate.padded_tasks(tasks, None) is tasks and calibrate.padded_tasks(tasks, 2) is tasks


@pytest.mark.parametrize("quick, expected", [(True, (4, 20, 36, 52, 64)),
                                             (False, tuple(range(4, 65, 4)))])
def test_split_candidates(quick, expected):
    bounds = next(r.splits for r in load_routes(None).routes if r.name == "pkv_bucket")
    assert calibrate.split_candidates(bounds, quick) == expected


def test_max_waves_is_kept_across_a_recalibration(tmp_path):
    """splits.max_waves is set by hand: `pkvrt calibrate` keeps the value of the file it
    replaces unless --max-waves says otherwise, and writes it."""
    import argparse

    old = tmp_path / "nvidia-h200.json"
    h200 = calibration.load_calibration(CHECKOUT / "calibration" / "nvidia-h200.json")
    calibration.save_calibration(attrs.evolve(h200, splits=attrs.evolve(h200.splits, max_waves=3)), old)
    args = argparse.Namespace(out=str(old), max_waves=None)
    assert calibrate.kept_max_waves(args, "nvidia-h200") == 3
    assert calibrate.kept_max_waves(argparse.Namespace(out=str(old), max_waves=4), "nvidia-h200") == 4
    missing = argparse.Namespace(out=str(tmp_path / "new.json"), max_waves=None)
    assert calibrate.kept_max_waves(missing, "x") == calibration.DEFAULT_MAX_WAVES
    cal = calibrate.make_calibration(
        gpu="NVIDIA H200", sm_count=132, l2_bytes=60 * 2**20, beta_gbps=4000.0, lambda_us=6.0,
        lambda_graph_us=1.1, c_min=2.0,
        splits={"bucket_ctas_per_sm": 1.0, "workqueue_ctas_per_sm": 2.0, "min_split_tokens": 128,
                "cta_overhead_tiles": 3.0, "co_resident_slowdown": 1.8, "max_waves": 3, "merge_free_slots": 8},
        flashinfer={8: 3.6}, versions={}, command="pkvrt calibrate", provenance="test", date="2026-12-01")
    assert cal.splits.max_waves == 3 and cal.splits.merge_free_slots == 8


def test_merge_free_slots_is_kept_across_a_recalibration(tmp_path):
    """splits.merge_free_slots is set by hand (the timed cuts cannot measure it): `pkvrt calibrate`
    keeps the value of the file it replaces, 0 for a new file."""
    import argparse

    old = tmp_path / "nvidia-h200.json"
    h200 = calibration.load_calibration(CHECKOUT / "calibration" / "nvidia-h200.json")
    calibration.save_calibration(attrs.evolve(h200, splits=attrs.evolve(h200.splits, merge_free_slots=24)), old)
    assert calibrate.kept_merge_free_slots(argparse.Namespace(out=str(old)), "nvidia-h200") == 24
    assert calibrate.kept_merge_free_slots(argparse.Namespace(out=str(tmp_path / "new.json")), "x") == 0


@pytest.mark.parametrize("text, expected", [("4,1,8", (4, 1, 8)), ("4", (4,)), ("1,4", (1, 4)),
                                            ("4,1,8,2,3,5,7,16", (4, 1, 8, 2, 3, 5, 7, 16))])
def test_parse_groups(text, expected):
    assert calibrate.parse_groups(text) == expected


@pytest.mark.parametrize("text, match", [("4,x", "comma-separated positive integers"),
                                         ("4,4", "distinct"), ("1,8", "must include 4"),
                                         ("4,65", "group size 65: expected one of 1..64"),
                                         ("4,0", "group size 0: expected one of 1..64")])
def test_parse_groups_refuses(text, match):
    with pytest.raises(ValueError, match=match):
        calibrate.parse_groups(text)


def test_group_shape_keeps_32_query_heads_where_g_divides_them():
    """G dividing 32: H_q 32 over 32 / G KV heads; any other G: the models' 8 KV heads, H_q 8 G
    (Llama-3.2-3B's 24 / 8 at G 3); the time model's sweeps read the same heads."""
    assert calibrate.group_shape(1)["num_kv_heads"] == 32
    assert calibrate.group_shape(8)["num_kv_heads"] == 4
    assert calibrate.group_shape(4) == calibrate.SHAPE
    for g, heads in ((3, (24, 8)), (5, (40, 8)), (7, (56, 8)), (16, (32, 2)), (12, (96, 8))):
        s = calibrate.group_shape(g)
        assert (s["num_qo_heads"], s["num_kv_heads"]) == heads == sweeps.group_heads(g)
        assert s["num_qo_heads"] == g * s["num_kv_heads"]
        assert sweeps.group_shape(g)["num_kv_heads"] == heads[1]


def test_flashinfer_paths_at_group_sizes_it_has_no_kernel_for():
    """FlashInfer's CUDA-core decode has kernels for G 1, 2, 3, 4, 6, 8, 16 only: at G 5 a
    Runtime asked for it says so instead of failing at plan(); the tensor-core path serves it."""
    from pkvrt.runtime import fi_route
    assert fi_route.unserved(128, False, 5, tensor_cores=False).startswith(
        "FlashInfer's CUDA-core decode has no kernel for group size 5")
    assert fi_route.unserved(128, False, 5, tensor_cores=True) is None
    assert fi_route.unserved(128, False, 16, tensor_cores=False) is None
    assert fi_route.unserved(96, False, 4).startswith("FlashInfer has no decode kernel for head_dim 96")


def test_by_group_fit_reaches_the_router_of_that_group_size():
    """make_calibration writes the per-G fits as splits.by_group; a Router (and so the Runtime)
    at G = 1 partitions with the G = 1 constants, at G = 4 with the top level, and the two cut
    the same step differently when the constants differ."""
    cal = calibrate.make_calibration(
        gpu="NVIDIA H200", sm_count=132, l2_bytes=60 * 2**20, beta_gbps=4000.0, lambda_us=6.0,
        lambda_graph_us=1.1, c_min=2.0,
        splits={"bucket_ctas_per_sm": 1.0, "workqueue_ctas_per_sm": 2.0, "min_split_tokens": 128,
                "cta_overhead_tiles": 3.0, "co_resident_slowdown": 1.8, "max_waves": 3},
        by_group={1: {"workqueue_ctas_per_sm": 2.0, "min_split_tokens": 32, "cta_overhead_tiles": 0.0,
                      "co_resident_slowdown": 1.0}},
        flashinfer={8: 3.6}, versions={}, command="pkvrt calibrate", provenance="test", date="2026-12-01")
    assert dict(cal.splits.by_group)[1] == (("workqueue_ctas_per_sm", 2.0), ("min_split_tokens", 32),
                                            ("cta_overhead_tiles", 0.0), ("co_resident_slowdown", 1.0))
    reg = load_routes(None)
    shape = dict(head_dim=128, page_size=16)
    r1 = Router(reg, cal, num_qo_heads=32, num_kv_heads=32, **shape)
    r4 = Router(reg, cal, num_qo_heads=32, num_kv_heads=8, **shape)
    assert r1.cal.splits.cta_overhead_tiles == 0.0 and r1.cal.splits.min_split_tokens == 32
    assert r4.cal.splits.cta_overhead_tiles == 3.0 and r4.cal.splits.by_group == ()
    bounds = reg.route("pkv_fused").splits
    seq = np.array([33000, 33000, 33000, 900, 1200, 700, 2000, 400])
    own = planner.balanced_partition(seq, num_kv_heads=32, splits=bounds, cal=r1.cal)
    top = planner.balanced_partition(seq, num_kv_heads=32, splits=bounds, cal=r4.cal)
    assert own.longest_splits != top.longest_splits


def test_make_calibration_round_trips(tmp_path):
    cal = calibrate.make_calibration(
        gpu="NVIDIA H200", sm_count=132, l2_bytes=60 * 2**20, beta_gbps=4123.456, lambda_us=9.87654,
        lambda_graph_us=1.1234, c_min=2.345678,
        splits={"bucket_ctas_per_sm": 1.9393, "workqueue_ctas_per_sm": 0.7575, "min_split_tokens": 512,
                "cta_overhead_tiles": 2.25, "co_resident_slowdown": 1.35, "wave_room_slots": 32,
                "wave_room_tiles": 48.04, "wave_room_chunk_tiles": 8},
        flashinfer={8: 3.6084, 1: 1.2}, versions={"torch": "2.9", "cuda": "12.8", "flashinfer": "0.5.3",
                                                  "driver": None},
        by_group={1: {"workqueue_ctas_per_sm": 2.0, "min_split_tokens": 256, "cta_overhead_tiles": 0.0,
                      "co_resident_slowdown": 1.125, "wave_room_slots": 0, "wave_room_tiles": 0.0,
                      "wave_room_chunk_tiles": 0}},
        command="pkvrt calibrate", provenance="test values", date="2026-11-30")
    assert cal.slug == "nvidia-h200" and cal.beta_gbps == 4123.5 and cal.c_min == 2.346
    # the fitted room charge reaches the file, and G 1's "none" is kept (not G 4's by inheritance)
    assert (cal.splits.wave_room_slots, cal.splits.wave_room_tiles, cal.splits.wave_room_chunk_tiles) == (32, 48.04, 8)
    assert cal.for_group(1).splits.wave_room_slots == 0 and cal.for_group(4).splits.wave_room_slots == 32
    assert cal.flashinfer_ctas_per_sm == ((1, 1.2), (8, 3.608))
    path = tmp_path / "nvidia-h200.json"
    calibration.save_calibration(cal, path)
    assert calibration.load_calibration(path) == attrs.evolve(cal, source=str(path))


# --------------------------------------------------------------------------- harness helpers

def test_engine_labels_and_parsing():
    assert harness.engine_label("adaptive") == "pkvrt-adaptive"
    assert harness.engine_label("pkv_workqueue") == "pkvrt-workqueue"
    assert harness.engine_label("flashinfer") == "flashinfer"
    assert harness.engine_label("flashinfer-graph") == "flashinfer-graph"
    assert harness.engine_label("adaptive-step") == "pkvrt-adaptive-step"
    assert harness.engine_label("adaptive-eager") == "pkvrt-adaptive-eager"
    assert harness.engine_label("host-step") == "pkvrt-host-step"
    assert harness.parse_engines("host-step,adaptive-step", ROUTES) == (
        "flashinfer", "host-step", "adaptive-step")
    assert harness.parse_engines("adaptive,pkv_bucket,adaptive", ROUTES) == (
        "flashinfer", "adaptive", "pkv_bucket")
    assert harness.parse_engines("flashinfer-cuda, flashinfer", ROUTES) == (
        "flashinfer", "flashinfer-cuda")
    assert harness.parse_engines("flashinfer-xqa,flashinfer-cudnn", ROUTES) == (
        "flashinfer", "flashinfer-xqa", "flashinfer-cudnn")
    assert harness.engine_label("flashinfer-xqa") == "flashinfer-xqa"
    assert harness.engine_label("flashinfer-cudnn") == "flashinfer-cudnn"
    with pytest.raises(ValueError, match="unknown engine 'flashinfer-fa3'"):
        harness.parse_engines("flashinfer-fa3", ROUTES)


def test_device_planned_engines_take_a_route():
    assert harness.parse_engines("device-plan-step:pkv_fused,device-plan", ROUTES) == (
        "flashinfer", "device-plan-step:pkv_fused", "device-plan")
    assert harness.engine_label("device-plan-step:pkv_fused") == "pkvrt-device-plan-step-fused"
    assert harness.engine_label("device-plan:pkv_workqueue") == "pkvrt-device-plan-workqueue"
    with pytest.raises(ValueError, match="unknown route 'pkv_nope'"):
        harness.parse_engines("device-plan-step:pkv_nope", ROUTES)
    with pytest.raises(ValueError, match="unknown engine 'adaptive:pkv_fused'"):
        harness.parse_engines("adaptive:pkv_fused", ROUTES)


@pytest.mark.parametrize("text, seeds", [("20260623", (20260623,)),
                                         ("20260623-20260625,1", (20260623, 20260624, 20260625, 1)),
                                         ("3,3,2", (3, 2))])
def test_parse_seeds(text, seeds):
    assert harness.parse_seeds(text) == seeds


@pytest.mark.parametrize("layers, mlp, seed, name", [
    (1, False, 20260623, "bimodal-B8-seed20260623"),
    (32, True, 20260623, "bimodal-B8-L32-mlp-seed20260623"),
    (32, False, None, "bimodal-B8-L32"),
    (1, True, 5, "bimodal-B8-L1-mlp-seed5")])
def test_case_name(layers, mlp, seed, name):
    assert harness.case_name("bimodal", 8, seed, layers=layers, mlp=mlp) == name


@given(total=st.integers(1, 5000), limit=st.integers(1, 400))
def test_sample_steps_spreads_over_the_whole_trace(total, limit):
    idx = harness.sample_steps(total, limit)
    assert len(idx) == min(total, limit)
    assert np.all(np.diff(idx) > 0) and idx[0] == 0
    if min(total, limit) > 1:
        assert idx[-1] == total - 1
        # even: no gap wider than the ideal spacing rounded up
        assert np.diff(idx).max() <= math.ceil((total - 1) / (min(total, limit) - 1))


def test_check_positions():
    assert harness.check_positions(200, 4) == (0, 66, 133, 199)
    assert harness.check_positions(2, 4) == (0, 1)
    assert harness.check_positions(10, 0) == ()


@pytest.mark.parametrize("min_kv_mb, budget_copies, expected", [
    (33.6, 100, 6),      # B1 8K on a 60 MB L2: ceil(180 / 33.6)
    (550.0, 100, 1),     # B8 bimodal
    (1.0, 100, harness.MAX_COPIES),
    (33.6, 3, 3),        # memory allows only 3
])
def test_cache_copies(min_kv_mb, budget_copies, expected):
    copy = 4 * 2**30
    assert harness.cache_copies(int(min_kv_mb * 2**20), 60 * 2**20, copy, budget_copies * copy) == expected


def test_cache_copies_too_big_is_an_error():
    with pytest.raises(ValueError, match="needs 8.0 GiB but only 4.0 GiB"):
        harness.cache_copies(2**20, 60 * 2**20, 8 * 2**30, 4 * 2**30)


def test_errors_and_tolerance():
    ref = torch.zeros(2, 4, 8)
    out = ref.clone()
    out[0, 0, 0] = 1e-3
    max_e, mean_e = harness.errors(out.half(), ref)
    assert max_e == pytest.approx(1e-3, rel=1e-3) and mean_e == pytest.approx(1e-3 / 64, rel=1e-3)
    assert harness.within_tolerance(max_e, mean_e)
    assert not harness.within_tolerance(2e-3, 0.0) and not harness.within_tolerance(0.0, 3e-4)
    out[1, 1, 1] = float("nan")
    assert not harness.within_tolerance(*harness.errors(out, ref))


def test_choose_baseline():
    assert harness.choose_baseline({"flashinfer-cuda": 520.0, "flashinfer-tc": 440.0}) == "flashinfer-tc"
    with pytest.raises(ValueError, match="no FlashInfer variant"):
        harness.choose_baseline({})


def test_the_baseline_probe_counts_each_steps_least_device_time(monkeypatch):
    """A host stall in one device pass of the probe adds to one step of one path; the probe
    counts each step's least time over PROBE_DEVICE_ROUNDS passes, so the stall does not make
    the slower path the baseline (cb69b5b, 2026-12-03: one pass picked FlashInfer's CUDA-core
    path over the tensor-core path that ran 2x faster on those steps)."""
    import types

    wl = types.SimpleNamespace(steps=list(range(4)))
    passes = {"tc": [[10.0, 400.0, 10.0, 10.0], [10.0, 10.0, 10.0, 11.0], [12.0, 10.0, 10.0, 10.0]],
              "cuda": [[15.0] * 4] * 3}
    seen = {"tc": 0, "cuda": 0}

    def device_pass(eng, wl, steps, out, clock, cover):
        assert cover == [1.25 * 10.0 + 50.0] * len(steps)
        seen[eng] += 1
        return list(passes[eng][seen[eng] - 1]), 0

    monkeypatch.setattr(harness, "reference_rows", lambda wl, step: None)
    monkeypatch.setattr(harness, "untimed_pass", lambda *a, **k: {})
    monkeypatch.setattr(harness, "wrong_output", lambda *a: None)
    monkeypatch.setattr(harness, "wall_pass", lambda eng, wl, steps, out, clock: ([10.0] * len(steps), 0))
    monkeypatch.setattr(harness, "device_pass", device_pass)
    failures = {}
    probe = harness.probe_baseline({"flashinfer-tc": "tc", "flashinfer-cuda": "cuda"}, wl, None,
                                   torch.zeros(1), probe_steps=4, failures=failures)
    assert seen == {"tc": harness.PROBE_DEVICE_ROUNDS, "cuda": harness.PROBE_DEVICE_ROUNDS} == {"tc": 3, "cuda": 3}
    assert probe == {"flashinfer-tc": 40.0, "flashinfer-cuda": 60.0} and not failures
    assert harness.choose_baseline(probe) == "flashinfer-tc"
    assert sum(passes["tc"][0]) > sum(passes["cuda"][0])   # one pass alone would have picked cuda


def test_the_baseline_is_the_fastest_of_four_paths_and_names_the_others():
    assert harness.FI_VARIANTS == ("flashinfer-cuda", "flashinfer-tc", "flashinfer-cudnn",
                                   "flashinfer-xqa")
    probe = {"flashinfer-cuda": 358.3, "flashinfer-tc": 255.5, "flashinfer-cudnn": 256.7,
             "flashinfer-xqa": 305.5}   # B8 32K on the H200 (isolated.json)
    assert harness.choose_baseline(probe) == "flashinfer-tc"
    assert harness.choose_baseline({**probe, "flashinfer-cudnn": 255.4}) == "flashinfer-cudnn"
    assert harness.choose_baseline({"flashinfer-cuda": 51.1, "flashinfer-xqa": 47.0}) == "flashinfer-xqa"
    # unavailable paths are not in the probe: the fastest of the rest, the others named with why
    probe = {"flashinfer-cuda": 51.1, "flashinfer-xqa": 47.0}
    failures = {"flashinfer-tc": "RuntimeError: boom",
                "flashinfer-cudnn": "RuntimeError: flashinfer 0.5.3: no backend='cudnn'"}
    assert harness.choose_baseline(probe) == "flashinfer-xqa"
    assert harness.candidate_status(harness.FI_VARIANTS, probe, failures) == {
        "flashinfer-cuda": "ok", "flashinfer-tc": "unavailable: RuntimeError: boom",
        "flashinfer-cudnn": "unavailable: RuntimeError: flashinfer 0.5.3: no backend='cudnn'",
        "flashinfer-xqa": "ok"}
    assert harness.candidate_status(("flashinfer-tc",), {}, {}) == {
        "flashinfer-tc": "unavailable: not probed"}


def test_route_variant_is_the_faster_wrapper_the_runtime_can_run():
    assert harness.route_variant({"flashinfer-cuda": 52.0, "flashinfer-tc": 44.0,
                                  "flashinfer-xqa": 40.0}) == "flashinfer-tc"
    assert harness.route_variant({"flashinfer-cuda": 30.0, "flashinfer-tc": 44.0}) == "flashinfer-cuda"
    assert harness.route_variant({"flashinfer-xqa": 40.0}) == "flashinfer-tc"   # the Runtime's default


def test_merge_candidates_over_seeds():
    ok = dict.fromkeys(harness.FI_VARIANTS, "ok")
    no_cudnn = {**ok, "flashinfer-cudnn": "unavailable: RuntimeError: x"}
    assert harness.merge_candidates({"1": {"baseline_candidates": no_cudnn},
                                     "2": {"baseline_candidates": no_cudnn}}) == no_cudnn
    merged = harness.merge_candidates({"1": {"baseline_candidates": ok},
                                       "2": {"baseline_candidates": no_cudnn}})
    assert merged["flashinfer-tc"] == "ok"
    assert merged["flashinfer-cudnn"] == "seed 1: ok; seed 2: unavailable: RuntimeError: x"
    assert harness.merge_candidates({}) == {}


def test_serving_meta_names_the_candidates_and_the_protocol(tmp_path):
    """bench._write (after every seed) records each FlashInfer path's status and a protocol
    that names the four paths."""
    from types import SimpleNamespace as NS

    status = dict.fromkeys(harness.FI_VARIANTS, "ok")
    status["flashinfer-cudnn"] = "unavailable: RuntimeError: flashinfer 0.5.3: ..."
    per_seed = {"7": {"baseline": "flashinfer-xqa", "baseline_candidates": status}}
    out = tmp_path / "s.json"
    bench._write(out, _config(seeds=(7,)), NS(path=None), NS(source=None, slug="x", fallback=False),
                 NS(cycles_per_us=1.0), [_trace()], per_seed, [], [])
    meta = results.read_results(out)["meta"]
    assert meta["baseline_candidates"] == status
    assert meta["per_seed"]["7"]["baseline"] == "flashinfer-xqa"
    for words in ("CUDA-core, tensor-core and cuDNN decode wrappers", "XQA",
                  "baseline = fastest of those paths", "baseline_candidates"):
        assert words in meta["protocol"]
    assert results.read_results(bench.steps_path(out))["meta"]["baseline_candidates"] == status


def _rec(step, seq, route, splits, wall, cuda, ctas=0):
    c = planner.Counters(launches=2 if ctas else 1, decode_ctas=ctas, cta_work_per_sm=ctas / 132,
                         useful_kv_bytes=sum(seq) * 4096, merge_bytes=ctas * 100,
                         merge_launches=1 if ctas else 0)
    return harness.StepRecord(step=step, active=len(seq), max_context=max(seq),
                              mean_context=sum(seq) / len(seq), route=route, splits=splits,
                              counters=c, wall_us=wall, cuda_us=cuda)


def test_summarize_and_ratio_rows():
    # made-up step times, chosen so the expected numbers are easy to check by hand
    adaptive = [_rec(0, [20000, 100], "pkv_workqueue", ((20, 1), (1, 1)), 200.0, 100.0, ctas=168),
                _rec(1, [20001, 101], "pkv_workqueue", ((20, 1), (1, 1)), 300.0, 100.0, ctas=168),
                _rec(2, [20002], "flashinfer", (), 500.0, 200.0)]
    row = harness.summarize("c", "pkvrt-adaptive", adaptive, seed=1, correct=True)
    assert row["decode_tokens"] == 5 and row["steps"] == 3
    assert row["tok_per_s"] == pytest.approx(5 / 1000e-6)
    assert row["cuda_tok_per_s"] == pytest.approx(5 / 400e-6)
    assert row["median_us"] == 100.0 and row["wall_us"] == 300.0
    assert row["route"] == "pkv_workqueue" and row["route_mix"] == "pkv_workqueue 66.7%, flashinfer 33.3%"
    assert row["splits"] == "1:2, 20:2" and row["split_main"] == 1
    assert row["launches_per_step"] == pytest.approx(5 / 3)
    assert row["cta_work_per_sm"] == pytest.approx(168 / 132)
    base = harness.summarize("c", "flashinfer-tc", [_rec(i, [20000 + i], "flashinfer", (), 400.0, 250.0)
                                                    for i in range(3)], baseline=True, correct=True)
    assert base["split_main"] is None and base["splits"] == "-" and base["cta_work_per_sm"] is None
    failed = {"case": "c", "engine": "pkvrt-bucket", "row": "measured", "correct": False}
    ratios = harness.ratio_rows([base, row, failed])
    assert len(ratios) == 1
    r = ratios[0]
    assert r["engine"] == "pkvrt-adaptive / flashinfer-tc" and r["row"] == "ratio"
    assert r["wall_ratio"] == pytest.approx(row["tok_per_s"] / base["tok_per_s"])
    assert r["cuda_ratio"] == pytest.approx(row["cuda_tok_per_s"] / base["cuda_tok_per_s"])
    with pytest.raises(ValueError, match="no measured steps for c / x"):
        harness.summarize("c", "x", [])


def test_runtime_kwargs_filter():
    import inspect

    def runtime(num_qo_heads, num_kv_heads, head_dim, page_size, dtype=None, *, device="cuda",
                routes=None, calibration="auto", max_batch=256, max_pages_per_row=8192,
                use_cuda_graph=True, validate=True):
        pass
    wanted = dict(device="cuda", routes=None, calibration="auto", max_batch=8, max_pages_per_row=4,
                  use_cuda_graph=True, max_graphs=64, validate=False)
    kept, dropped = harness.runtime_kwargs(inspect.signature(runtime), wanted)
    assert "max_graphs" not in kept and dropped == ("max_graphs",) and kept["validate"] is False
    kept, dropped = harness.runtime_kwargs(inspect.signature(lambda a, **kw: None), wanted)
    assert kept == wanted and dropped == ()

    def old_runtime(num_qo_heads, *, device="cuda", routes=None, calibration="auto",
                    max_pages_per_row=1, use_cuda_graph=True):
        pass
    with pytest.raises(ValueError, match=r"expected keyword argument\(s\) \['max_batch'\]"):
        harness.runtime_kwargs(inspect.signature(old_runtime), wanted)
    # today's Runtime: switches are RuntimeOptions fields, and its **moved accepts nothing else
    from pkvrt.runtime import Runtime
    from pkvrt.runtime.options import FIELDS
    kept, dropped = harness.runtime_kwargs(inspect.signature(Runtime), dict(wanted, bogus=1), FIELDS)
    assert dropped == ("bogus",) and kept["max_graphs"] == 64 and kept["use_cuda_graph"] is True


# --------------------------------------------------------------------------- the loop on the CPU

SHAPE = harness.Shape(num_qo_heads=8, num_kv_heads=2, head_dim=64, page_size=16)


class ReferenceEngine:
    """An engine for driving the harness on the CPU: the router picks (and reports) a route as in
    the Runtime, attention is the FP32 reference. ``skew`` perturbs the output (a wrong engine),
    ``host_delay_s`` slows planning (a slower engine)."""

    def __init__(self, label, wl, router, *, force=None, skew=0.0, host_delay_s=0.0):
        self.label, self.wl, self.router, self.force = label, wl, router, force
        self.skew, self.delay = skew, host_delay_s

    def plan(self, step):
        if self.delay:
            time.sleep(self.delay)
        self.seq = torch.from_numpy(step.seq_lens.astype(np.int32))
        self.bt = torch.from_numpy(self.wl.layout.block_table(step.rids))
        self.decision = self.router.decide(step.seq_lens, force=self.force)

    def attend(self, q, k, v, out):
        out.copy_(reference.decode_attention(q, k, v, self.seq, self.bt) + self.skew)

    def step_info(self):
        d = self.decision
        return d.route, tuple(harness.plan_splits(d.plan)), d.plan.counters

    def stats(self):
        return {"replays": 0}


def _trace():
    reqs = [Request(0, 0, 17000, 5), Request(1, 0, 300, 4), Request(2, 1, 16500, 3)]
    return Trace(name="tiny", requests=tuple(reqs), seed=None, source="test")


def _run_cpu(config, *, wrong=(), fast="flashinfer-tc", missing=()):
    """run_seed on the CPU; every FlashInfer path but ``fast`` plans slowly (so ``fast`` is the
    baseline unless it fails), those in ``missing`` cannot be built (as cuDNN on 0.5.3), those in
    ``wrong`` give skewed outputs."""
    router = Router(load_routes(None), seed_calibration(), num_qo_heads=SHAPE.num_qo_heads,
                    num_kv_heads=SHAPE.num_kv_heads, head_dim=SHAPE.head_dim,
                    page_size=SHAPE.page_size)
    made = []

    def make_engine(name, wl, fi_route):
        made.append((name, fi_route))
        if name in missing:
            raise RuntimeError(f"flashinfer 0.5.3: no {name} here")
        delay = 0.25 if (name in harness.FI_VARIANTS and name != fast) else 0.0   # >> CPU noise
        force = "flashinfer" if name in harness.FI_VARIANTS else name if name in ROUTES else None
        return ReferenceEngine(harness.engine_label(name), wl, router, force=force,
                               skew=0.05 if name in wrong else 0.0, host_delay_s=delay)
    _run_cpu.made = made
    logs = []
    out = harness.run_seed(config, 11, _trace(), make_engine, clock=harness.HostClock(), device="cpu",
                           budget_bytes=2**30, log=logs.append)
    return (*out, logs)


def _config(**kw):
    base = dict(trace="tiny", max_active=2, seeds=(11,), steps_limit=4, check_steps=2, probe_steps=2,
                engines=("flashinfer", "adaptive", "pkv_bucket"), shape=SHAPE)
    return harness.ServingConfig(**{**base, **kw})


@pytest.mark.slow
def test_cpu_loop_rows_ratios_and_steps():
    rows, steps, info, logs = _run_cpu(_config())
    assert info["baseline"] == "flashinfer-tc"                    # the other paths were slowed
    assert info["baseline_candidates"] == dict.fromkeys(harness.FI_VARIANTS, "ok")
    assert set(info["baseline_probe_device_us"]) == set(harness.FI_VARIANTS)
    # the Runtime's FlashInfer route runs the faster of the two wrappers it can drive
    assert info["flashinfer_route"] == "flashinfer-tc"
    assert ("adaptive", "flashinfer-tc") in _run_cpu.made
    assert info["steps_measured"] == 4 and info["steps_total"] == 7
    measured = {r["engine"]: r for r in rows if r["row"] == "measured"}
    assert list(measured) == ["flashinfer-tc", "pkvrt-adaptive", "pkvrt-bucket"]
    assert measured["flashinfer-tc"]["baseline"] and not measured["pkvrt-adaptive"]["baseline"]
    for r in measured.values():
        assert r["correct"] and r["max_err"] == 0.0 and r["max_err_ref"] < 1e-3
        assert r["case"] == "tiny-B2-seed11" and r["steps"] == 4 and r["checked_steps"] == 2
        assert r["tok_per_s"] > 0 and r["cache_copies"] >= 1
    # the sampled steps span the whole trace: first and last step of the 7
    assert sorted({s["step"] for s in steps}) == [0, 2, 4, 6]
    assert measured["pkvrt-adaptive"]["decode_tokens"] == sum(
        s["active"] for s in steps if s["engine"] == "pkvrt-adaptive")
    assert measured["pkvrt-bucket"]["route"] == "pkv_bucket"
    assert "pkv_bucket" in measured["pkvrt-bucket"]["route_mix"]
    ratios = [r for r in rows if r["row"] == "ratio"]
    assert [r["numerator"] for r in ratios] == ["pkvrt-adaptive", "pkvrt-bucket"]
    assert len(steps) == 3 * 4 and {s["baseline"] for s in steps if s["engine"] == "flashinfer-tc"} == {True}
    assert any("baseline flashinfer-tc" in line for line in logs)


@pytest.mark.slow
def test_cpu_loop_baseline_probe_survives_a_failing_variant(monkeypatch):
    def broken_plan(self, step):
        if self.label == "flashinfer-tc":
            raise RuntimeError("no tensor-core kernel for this shape")
        return ReferenceEngine._plan(self, step)
    monkeypatch.setattr(ReferenceEngine, "_plan", ReferenceEngine.plan, raising=False)
    monkeypatch.setattr(ReferenceEngine, "plan", broken_plan)
    rows, _, info, logs = _run_cpu(_config(engines=("flashinfer", "adaptive")), fast="flashinfer-cuda")
    assert info["baseline"] == "flashinfer-cuda"
    assert info["baseline_failures"] == {
        "flashinfer-tc": "RuntimeError: no tensor-core kernel for this shape"}
    assert [r["engine"] for r in rows if r["row"] == "measured"] == ["flashinfer-cuda", "pkvrt-adaptive"]
    assert any("flashinfer-tc unavailable" in line for line in logs)


@pytest.mark.slow
def test_cpu_loop_unavailable_and_wrong_paths_are_named_not_dropped():
    """A FlashInfer path that cannot be built (cuDNN on 0.5.3) and one whose output is wrong (the
    fastest here) do not compete for the baseline; both are printed and named with the reason,
    and an --engines entry naming an unavailable path gets an "unavailable" row, not a crash."""
    rows, _, info, logs = _run_cpu(_config(engines=("flashinfer", "flashinfer-cudnn", "adaptive")),
                                   fast="flashinfer-xqa", missing=("flashinfer-cudnn",),
                                   wrong=("flashinfer-xqa",))
    status = info["baseline_candidates"]
    assert list(status) == list(harness.FI_VARIANTS)
    assert status["flashinfer-cudnn"] == "unavailable: RuntimeError: flashinfer 0.5.3: no flashinfer-cudnn here"
    assert status["flashinfer-xqa"].startswith("unavailable: wrong output on step ")
    assert "vs FP32 max|e| 0.05" in status["flashinfer-xqa"]
    assert status["flashinfer-cuda"] == status["flashinfer-tc"] == "ok"
    assert info["baseline"] in ("flashinfer-cuda", "flashinfer-tc")
    assert set(info["baseline_probe_device_us"]) == {"flashinfer-cuda", "flashinfer-tc"}
    assert info["flashinfer_route"] == info["baseline"]
    for label in ("flashinfer-cudnn", "flashinfer-xqa"):
        assert any(line.startswith(f"  {label} unavailable: ") for line in logs), logs
    unavailable = [r for r in rows if r["row"] == "unavailable"]
    assert unavailable == [{"case": "tiny-B2-seed11", "engine": "flashinfer-cudnn",
                            "row": "unavailable", "seed": 11,
                            "reason": "RuntimeError: flashinfer 0.5.3: no flashinfer-cudnn here"}]
    measured = [r["engine"] for r in rows if r["row"] == "measured"]
    assert measured == [info["baseline"], "pkvrt-adaptive"]
    assert any("flashinfer-cudnn: not measured, unavailable" in line for line in logs)


def test_cpu_loop_wrong_engine_is_not_timed():
    rows, steps, _, logs = _run_cpu(_config(), wrong=("pkv_bucket",))
    bad = next(r for r in rows if r["engine"] == "pkvrt-bucket")
    assert bad["correct"] is False and "tok_per_s" not in bad
    assert bad["max_err"] == pytest.approx(0.05, abs=1e-3)
    assert not [s for s in steps if s["engine"] == "pkvrt-bucket"]
    assert [r["numerator"] for r in rows if r["row"] == "ratio"] == ["pkvrt-adaptive"]
    assert any("pkvrt-bucket: FAILED correctness" in line for line in logs)


@pytest.mark.slow
def test_cpu_loop_engine_protocol_with_mlp(tmp_path, capsys):
    config = _config(layers=3, mlp=True, mlp_intermediate=32, engines=("flashinfer", "adaptive"))
    rows, steps, info, _ = _run_cpu(config)
    measured = [r for r in rows if r["row"] == "measured"]
    assert {r["case"] for r in measured} == {"tiny-B2-L3-mlp-seed11"}
    assert all(r["correct"] for r in measured)
    # write the files as `bench serving` does and report them: the tables follow the rows
    meta = {"kind": "serving"}
    results.write_results(tmp_path / "s.json", meta, rows)
    results.write_results(tmp_path / "s.steps.json", {"kind": "serving-steps"}, steps)
    rc, out, err = run(capsys, "report", str(tmp_path), "--out", str(tmp_path / "rep"))
    assert rc == 0, err
    md = (tmp_path / "rep" / "report.md").read_text()
    ratio = next(r for r in rows if r["row"] == "ratio")
    assert f"{ratio['wall_ratio']:.3f}" in md and "tiny-B2-L3-mlp" in md


def test_host_cost_targets_name_what_host_routing_adds(capsys):
    """benches/host_cost.py's verdicts: against FlashInfer's plan, against 60 us, and the part of
    plan() that host routing adds over device planning's (the host's speed cancels out)."""
    import sys as _sys

    _sys.path.insert(0, str(CHECKOUT / "benches"))
    import host_cost

    row = dict(case="B8", layers=1)
    host_cost.print_targets([dict(row, engine="runtime-adaptive-graphs", plan_us=70.0, route="pkv_fused"),
                             dict(row, engine="flashinfer-raw", plan_us=300.0, route="flashinfer"),
                             dict(row, engine="runtime-device-plan-graphs", plan_us=52.5, route="pkv_fused")])
    out = capsys.readouterr().out
    assert "vs FlashInfer plan 300.0 us: ok" in out and "vs 60 us (pkv_fused): MISS" in out
    assert "host routing adds 17.5 us over device planning's plan() (52.5 us)" in out


def test_host_cost_rounds_are_judged_on_their_median(capsys):
    """benches/host_cost.py --rounds: one median row per (engine, layers) over the rounds of a
    case, every field the median of its rounds, other cases untouched."""
    import sys as _sys

    _sys.path.insert(0, str(CHECKOUT / "benches"))
    import host_cost

    def row(case, engine, k, plan):
        return dict(case=case, engine=engine, layers=1, route="pkv_fused", round=k, plan_us=plan,
                    run_us=1.0, host_us=plan + 1, wall_us=10.0 * plan, gpu_us=5.0, over_us=10.0 * plan - 5)

    rows = [row("B8", "a", 0, 70.0), row("B8", "a", 1, 40.0), row("B8", "a", 2, 50.0),
            row("B8", "b", 0, 9.0), row("B1", "a", 0, 1.0)]
    med = host_cost.medians(rows, "B8")
    by = {r["engine"]: r for r in med}
    assert set(by) == {"a", "b"} and all(r["round"] == "median" for r in med)
    assert by["a"]["plan_us"] == 50.0 and by["a"]["wall_us"] == 500.0 and by["a"]["rounds"] == 3
    assert by["b"]["plan_us"] == 9.0 and by["b"]["rounds"] == 1
    assert "median of 3" in capsys.readouterr().out


class _SecondSight:
    """An engine that captures a step's graph the second time it runs that step, as the Runtime
    captures a per-layer graph on a key's second sighting (graphs.SeenKeys)."""

    def __init__(self, stats: bool = True):
        self.seen, self.captured, self.has_stats = set(), set(), stats
        self.runs = 0

    def run_step(self, wl, step, pos, out):
        self.runs += 1
        if step in self.seen and step not in self.captured:
            self.captured.add(step)
        self.seen.add(step)

    def stats(self):
        return {"captures": len(self.captured)} if self.has_stats else {}


def test_warm_until_steady_leaves_no_capture_to_the_timed_passes():
    """After the correctness pass (the first sighting of every step), the next pass captures every
    step's graph; the one after captures nothing, and warming stops there: the timed passes then
    see no capture. An engine without capture counters gets one untimed pass."""
    wl = attrs.make_class("Wl", {"steps": attrs.field(), "previous": attrs.field()})(
        steps=[0, 1, 2], previous=[None] * 3)
    clock = attrs.make_class("Clock", {"sync": attrs.field()})(sync=lambda: None)
    eng = _SecondSight()
    harness.untimed_pass(eng, wl, wl.steps, None, clock)      # the correctness pass
    assert harness.warm_until_steady(eng, wl, None, clock) == 2
    assert eng.runs == 9 and harness.graphs_captured(eng) == 3
    before = harness.graphs_captured(eng)
    harness.untimed_pass(eng, wl, wl.steps, None, clock)      # a timed pass would capture nothing
    assert harness.graphs_captured(eng) == before
    plain = _SecondSight(stats=False)
    assert harness.warm_until_steady(plain, wl, None, clock) == 1 and plain.runs == 3


class _OrderEngine:
    """An engine that runs its whole step itself (``run_step``), logging (name, step position),
    and sleeping 20 ms on its ``slow_run``-th run of each step (a host phase that is slow)."""

    def __init__(self, name, log, slow_run=None):
        self.name, self.log, self.slow_run, self.runs = name, log, slow_run, {}

    def run_step(self, wl, step, pos, out):
        self.log.append((self.name, pos))
        k = self.runs[pos] = self.runs.get(pos, 0) + 1
        if k == self.slow_run:
            time.sleep(0.02)   # one round's outlier: the median of three drops it

    def step_info(self):
        return ("r", (), None)


def test_interleaved_wall_passes_rotate_the_engines_and_take_each_steps_median():
    """Each step is run by every engine before the next step, first by a different engine from
    step to step and round to round; every engine sees the steps in order each round; an
    engine's wall of a step is the median of its rounds (one slow round does not move it)."""
    log = []
    engines = [_OrderEngine(n, log, slow_run=2 if n == "b" else None) for n in ("a", "b", "c")]
    steps = [object()] * 4
    got = harness.interleaved_wall_passes(engines, None, steps, None, harness.HostClock(), rounds=3)
    assert len(log) == 3 * 4 * 3
    for r in range(3):
        for pos in range(4):
            chunk = log[(r * 4 + pos) * 3:(r * 4 + pos + 1) * 3]
            assert [p for _, p in chunk] == [pos] * 3
            assert chunk[0][0] == "abc"[(pos + r) % 3] and sorted(n for n, _ in chunk) == ["a", "b", "c"]
    for walls, infos in got:
        assert len(walls) == 4 and infos == [("r", (), None)] * 4
        assert max(walls) < 15_000   # b's 20 ms rounds are outvoted by its two fast ones


class _PlanningEngine(_OrderEngine):
    """An :class:`_OrderEngine` whose step begins with a plan(); ``device_planning`` as the
    harness's Runtime engines carry it. Logs ("plan", step) for each plan() called from outside."""

    def __init__(self, name, log, device_planning):
        super().__init__(name, log)
        self.device_planning = device_planning

    def plan(self, step):
        self.log.append(("plan", step))


def test_wall_passes_plan_the_previous_step_first_where_the_engine_plans_on_the_host():
    """An engine of host lengths plans the step a serving loop planned before each timed step
    (untimed, just before it); one of device lengths does not; without ``previous`` (cold
    plans) neither does."""
    log = []
    host, device = _PlanningEngine("h", log, False), _PlanningEngine("d", log, True)
    steps, previous = ["s0", "s1", "s2"], [None, "p1", "p2"]
    harness.interleaved_wall_passes([host, device], None, steps, None, harness.HostClock(), rounds=1,
                                    previous=previous)
    assert [e for e in log if e[0] == "plan"] == [("plan", "p1"), ("plan", "p2")]
    for pos, prev in ((1, "p1"), (2, "p2")):   # right before the host engine's timed step
        assert log[log.index(("h", pos)) - 1] == ("plan", prev)
    assert log.count(("d", 0)) == log.count(("d", 1)) == 1
    log.clear()
    harness.interleaved_wall_passes([host, device], None, steps, None, harness.HostClock(), rounds=1)
    assert not [e for e in log if e[0] == "plan"]


def test_the_warm_up_passes_plan_the_previous_step_first_too():
    """The untimed passes before the timed ones run each step after its predecessor's plan
    (whatever that order first does happens untimed), on engines that plan on the host only."""
    log = []
    wl = attrs.make_class("Wl", {"steps": attrs.field(), "previous": attrs.field()})(
        steps=["s0", "s1"], previous=[None, "p1"])
    host, device = _PlanningEngine("h", log, False), _PlanningEngine("d", log, True)
    harness.untimed_pass(host, wl, wl.steps, None, harness.HostClock(), previous=wl.previous)
    assert log == [("h", 0), ("plan", "p1"), ("h", 1)]
    log.clear()
    harness.untimed_pass(device, wl, wl.steps, None, harness.HostClock(), previous=wl.previous)
    assert log == [("d", 0), ("d", 1)]


def test_cold_plans_reaches_the_config_and_run_seed_primes_by_default(monkeypatch):
    """``--cold-plans`` sets ServingConfig.cold_plans; run_seed plans each measured step's
    predecessor first (more plans per engine) unless it is set."""
    import argparse
    parser = argparse.ArgumentParser()
    bench.add_arguments(parser)
    registry = load_routes(None)
    args = parser.parse_args(["serving", "--trace", "bimodal", "--cold-plans"])
    assert bench._config(args, registry).cold_plans is True
    assert bench._config(parser.parse_args(["serving", "--trace", "bimodal"]), registry).cold_plans is False
    plans = []
    real_plan = ReferenceEngine.plan
    monkeypatch.setattr(ReferenceEngine, "plan", lambda self, step: plans.append(step) or real_plan(self, step))
    _run_cpu(_config(engines=("flashinfer", "adaptive")))
    primed = len(plans)
    plans.clear()
    _run_cpu(_config(engines=("flashinfer", "adaptive"), cold_plans=True))
    assert primed > len(plans) > 0


def test_workload_previous_is_the_trace_step_before_each_measured_one():
    """Workload.previous[i] is the decode step right before measured step i in the trace's own
    order (the first step has none); with cold_plans every one is None."""
    trace = _trace()
    all_steps = list(harness.decode_steps(trace, max_active=2))
    wl = harness.Workload(trace, _config(steps_limit=3), 11, device="cpu", budget_bytes=2**30)
    assert len(wl.steps) == 3 < len(all_steps)
    def key(s):
        return tuple(np.asarray(s.rids).tolist()), tuple(np.asarray(s.seq_lens).tolist())

    keys = [key(s) for s in all_steps]
    for step, prev in zip(wl.steps, wl.previous):
        i = keys.index(key(step))
        assert (prev is None) if i == 0 else key(prev) == keys[i - 1]
    assert any(p is not None for p in wl.previous)
    cold = harness.Workload(trace, _config(steps_limit=3, cold_plans=True), 11, device="cpu",
                            budget_bytes=2**30)
    assert cold.previous == [None] * 3


def test_calibrate_models_add_their_group_sizes(capsys):
    """--models: the named models' group sizes join --groups (once each, after it); a head dim
    other than 128 is said to run on the D 128 constants; an unknown name is refused naming the
    known ones."""
    import argparse
    parser = argparse.ArgumentParser()
    calibrate.add_arguments(parser)
    args = parser.parse_args(["--groups", "4,1", "--models", "llama-3.2-3b,gemma-2-9b,llama-3.1-8b"])
    assert calibrate.check_arguments(args) == "float16"
    assert args.groups == (4, 1, 3, 2)
    assert "gemma-2-9b (D 256) run on those constants" in capsys.readouterr().err
    with pytest.raises(ValueError, match="unknown model 'llama-9'; expected one of llama-3.1-8b"):
        calibrate.parse_models("llama-9")
