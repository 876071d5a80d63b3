"""Cost model: T_r = KVBytes/beta * max(1, C_min/C_r) + L_r*lambda + MergeBytes_r/beta, table-driven."""

from __future__ import annotations

import itertools
import math
import pathlib

import attrs
import numpy as np
import pytest
from hypothesis import given
from hypothesis import strategies as st

from pkvrt.policy.calibration import Calibration, SplitPoints, load_calibration
from pkvrt.policy.costmodel import (flashinfer_ctas_per_sm, launch_us, predict_flashinfer_us,
                                    predict_us, read_us, route_time_us)
from pkvrt.policy.planner import Counters, flashinfer_counters, plan_bucket, plan_workqueue, state_bytes
from pkvrt.policy.registry import SplitBounds

SEED = pathlib.Path(__file__).resolve().parents[1] / "calibration" / "rtx3060-seed.json"


def make_cal(**kw) -> Calibration:
    """Round numbers: beta 1000 GB/s = 1e6 bytes/us, eager launch 10 us, graph launch 1 us."""
    base = dict(gpu="Test GPU", slug="test-gpu", sm_count=100, l2_bytes=1 << 20, beta_gbps=1000.0,
                lambda_us=10.0, lambda_graph_us=1.0, c_min=4.0,
                splits=SplitPoints(bucket_ctas_per_sm=8.0, workqueue_ctas_per_sm=16.0, min_split_tokens=128),
                flashinfer_ctas_per_sm=((1, 2.0), (4, 3.0), (16, 4.0)),
                versions=(("torch", None), ("cuda", None), ("flashinfer", None), ("driver", None)),
                date="2026-11-29", seed=1, command="test", provenance="test")
    return Calibration(**(base | kw))


# kv_bytes, C_r, launches, merge_bytes, graphs, expected µs (hand arithmetic on make_cal())
TABLE = [
    (1e9, 8.0, 2, 0, False, 1000 + 2 * 10),             # occupied: 1e9/1e6 = 1000 µs, 2 eager launches
    (1e9, 8.0, 2, 0, True, 1000 + 2 * 1),               # same inside a graph
    (1e9, 2.0, 1, 0, False, 1000 * (4 / 2) + 10),       # C 2 < C_min 4: read stretched 2x
    (1e9, 4.0, 1, 0, False, 1000 + 10),                 # exactly C_min: factor 1
    (1e9, 8.0, 2, 5e6, False, 1000 + 20 + 5),           # merge 5e6 B / 1e6 = 5 µs
    (0, 8.0, 3, 0, True, 3 * 1),                        # no KV: launches only
    (2.5e8, 0.5, 4, 1e6, False, 250 * 8 + 40 + 1),      # C 0.5: factor 8
]


@pytest.mark.parametrize("kv, c, launches, merge, graphs, expected", TABLE)
def test_route_time_table(kv, c, launches, merge, graphs, expected):
    got = route_time_us(kv_bytes=kv, cta_work_per_sm=c, launches=launches, merge_bytes=merge,
                        cal=make_cal(), graphs=graphs)
    assert got == pytest.approx(expected, rel=1e-12)


def test_no_ctas_is_infinitely_slow():
    assert route_time_us(kv_bytes=1, cta_work_per_sm=0.0, launches=1, merge_bytes=0, cal=make_cal(),
                         graphs=True) == math.inf


@pytest.mark.parametrize("graphs, lam", [(True, 1.0), (False, 10.0)])
def test_launch_overhead_is_a_parameter(graphs, lam):
    assert launch_us(make_cal(), graphs=graphs) == lam


# active, num_kv_heads, expected: table {1: 2, 4: 3, 16: 4} on 100 SMs, linear in log2(active)
FI_TABLE = [
    (1, 8, 2.0),
    (2, 8, 2.5),            # log2 2 = 1, halfway from log2 1 = 0 to log2 4 = 2
    (4, 8, 3.0),
    (8, 8, 3.5),            # halfway from log2 4 = 2 to log2 16 = 4
    (16, 8, 4.0),
    (32, 8, 4.0),           # beyond the table: its end; floor 32*8/100 = 2.56 does not bind
    (64, 8, 64 * 8 / 100),  # floor: one CTA per (row, kv head) = 5.12 > 4
    (3, 200, 3 * 200 / 100),
]


@pytest.mark.parametrize("active, kvh, expected", FI_TABLE)
def test_flashinfer_fitted_ctas_table(active, kvh, expected):
    assert flashinfer_ctas_per_sm(make_cal(), active=active, num_kv_heads=kvh) == pytest.approx(expected)


def test_flashinfer_table_with_one_point_is_constant():
    cal = make_cal(flashinfer_ctas_per_sm=((8, 3.0),))
    assert [flashinfer_ctas_per_sm(cal, active=a, num_kv_heads=1) for a in (1, 8, 64)] == [3.0, 3.0, 3.0]


def test_flashinfer_rejects_empty_step():
    with pytest.raises(ValueError, match="active must be >= 1"):
        flashinfer_ctas_per_sm(make_cal(), active=0, num_kv_heads=8)


@given(a=st.integers(1, 4096), b=st.integers(1, 4096))
def test_flashinfer_ctas_are_monotone_in_active(a, b):
    cal = make_cal()
    lo, hi = sorted((a, b))
    assert flashinfer_ctas_per_sm(cal, active=lo, num_kv_heads=8) <= flashinfer_ctas_per_sm(cal, active=hi, num_kv_heads=8)


def h200_cal() -> Calibration:
    """DESIGN.md's H200 anchors; the FlashInfer point is the one fitted in costmodel.py's example."""
    return make_cal(sm_count=132, beta_gbps=4120.0, lambda_us=10.0, lambda_graph_us=1.1, c_min=4.0,
                    flashinfer_ctas_per_sm=((8, 3.61),))


def test_worked_example_of_the_module_docstring():
    """B8 x 32K on the H200, workqueue with 16 splits per row (costmodel.py docstring)."""
    cal = h200_cal()
    kv = 8 * 32768 * 8 * 128 * 2 * 2                       # 1_073_741_824 B
    merge = 8 * 16 * 32 * (128 * 4 + 8) * 2                 # 4_259_840 B
    wq = Counters(launches=2, decode_ctas=8 * 8 * 16, cta_work_per_sm=8 * 8 * 16 / 132, useful_kv_bytes=kv,
                  merge_bytes=merge, merge_launches=1)
    t_wq = predict_us(wq, cal, graphs=True)
    assert t_wq == pytest.approx(kv / 4120e3 + 2 * 1.1 + merge / 4120e3)
    assert round(t_wq, 1) == 263.9
    fi = flashinfer_counters(np.full(8, 32768), num_kv_heads=8, head_dim=128, dtype_bytes=2)
    t_fi = predict_flashinfer_us(fi, cal, active=8, num_kv_heads=8, graphs=True)
    assert round(t_fi, 1) == 289.9                          # DESIGN.md measured 0.290 ms
    assert round(t_fi / t_wq, 2) == 1.10


@pytest.mark.parametrize("graphs", [True, False])
def test_predict_us_matches_route_time_on_plans(graphs):
    cal = make_cal()
    seq = np.array([40000, 1000, 17, 32768])
    kw = dict(num_kv_heads=8, num_qo_heads=32, head_dim=128, dtype_bytes=2, cal=cal)
    for plan in (plan_workqueue(seq, splits=SplitBounds(1, 64, 4), **kw),
                 plan_bucket(seq, splits=SplitBounds(4, 64, 4), **kw)):
        c = plan.counters
        assert predict_us(c, cal, graphs=graphs) == pytest.approx(
            read_us(c.useful_kv_bytes, cal) * max(1, 4 / c.cta_work_per_sm)
            + c.launches * launch_us(cal, graphs=graphs) + read_us(c.merge_bytes, cal))


def test_seed_profile_reproduces_the_papers_ratios():
    """The seed's fitted FlashInfer points give back the paper's CUDA-event ratios (eager launches):
    B1 32K bucket split 32: 1.471x; bimodal B8 (550.5 MiB of KV) workqueue split 20: 1.106x."""
    cal = load_calibration(SEED)
    kw = dict(num_kv_heads=8, num_qo_heads=32, head_dim=128, dtype_bytes=2, cal=cal)
    b1 = plan_bucket(np.array([32768]), splits=SplitBounds(4, 64, 4), **kw)
    assert b1.buckets[0].num_splits == 32
    fi1 = flashinfer_counters(np.array([32768]), num_kv_heads=8, head_dim=128, dtype_bytes=2)
    r1 = predict_flashinfer_us(fi1, cal, active=1, num_kv_heads=8, graphs=False) / predict_us(b1.counters, cal, graphs=False)
    assert r1 == pytest.approx(1.471, abs=0.005)

    total = round(550.5 * 2**20 / (8 * 128 * 2 * 2))       # tokens of the paper's Table 4 step
    seq = np.array([32768, 32768] + [(total - 65536) // 6] * 6)
    # the paper's workqueue gave every row 20 splits (1280 CTAs, Table 4); the balanced
    # partition would cut this step otherwise, so the paper's plan is spelled out
    wq = plan_workqueue(seq, splits=SplitBounds(20, 20, 20), **kw, longest_splits=20)
    wq = attrs.evolve(wq, counters=attrs.evolve(wq.counters, decode_ctas=8 * 8 * 20, cta_work_per_sm=8 * 8 * 20 / 28,
                                                merge_bytes=state_bytes(8 * 20, num_qo_heads=32, head_dim=128)))
    fi8 = flashinfer_counters(seq, num_kv_heads=8, head_dim=128, dtype_bytes=2)
    r8 = predict_flashinfer_us(fi8, cal, active=8, num_kv_heads=8, graphs=False) / predict_us(wq.counters, cal, graphs=False)
    assert r8 == pytest.approx(1.106, abs=0.005)


def test_faster_bandwidth_never_slows_a_route():
    c = Counters(launches=2, decode_ctas=100, cta_work_per_sm=1.0, useful_kv_bytes=10**9, merge_bytes=10**6,
                 merge_launches=1)
    cal = make_cal()
    assert predict_us(c, attrs.evolve(cal, beta_gbps=2000.0), graphs=True) < predict_us(c, cal, graphs=True)


# ----------------------------------------------------------------------------- the measured model

from pkvrt.policy.calibration import RouteTime, TIME_KINDS  # noqa: E402
from pkvrt.policy.costmodel import (FLASHINFER_CTAS_PER_SM, LaunchGroup, _wave_and_room,  # noqa: E402
                                    fit_route_time, measured_us, predict_route_us, route_groups)
from pkvrt.policy.planner import (PartitionModel, balanced_partition, bucket_counters,  # noqa: E402
                                  workqueue_counters)

SHAPE = dict(num_kv_heads=8, head_dim=128, dtype_bytes=2)
WQ, BUCKET = SplitBounds(1, 64, 4), SplitBounds(4, 64, 4)


def timed_cal(**kw) -> Calibration:
    """make_cal() with a time model: every kind (read, tail, split, fixed) distinct."""
    tm = tuple((k, RouteTime(1.0 + i / 10, 0.5 + i / 10, 0.1, 4.0 + i)) for i, k in enumerate(TIME_KINDS))
    return make_cal(time_model=tm, **kw)


# groups, constants, graphs, expected µs (make_cal: 1e6 B/µs, lambda 10 eager, 1 in a graph)
MEASURED = [
    ([LaunchGroup(10**9, 400.0, 16, 2)], RouteTime(1.1, 0.5, 0.1, 4.0), True, 1100 + 0.5 * 20 + 1.6 + 4),
    ([LaunchGroup(10**9, 400.0, 16, 2)], RouteTime(1.1, 0.5, 0.1, 4.0), False, 1115.6 + 2 * 9),
    ([LaunchGroup(10**6, 9.0, 1, 1)] * 3, RouteTime(1.0, 1.0, 0.0, 2.0), True, 3 * (1 + 3 + 2)),
    ([], RouteTime(1.0, 1.0, 1.0, 1.0), True, 0.0),
    # depth-bound: 0.5 us x 40 tiles = 20 > 1.0 x 1e7 B / 1e6 = 10; merge 300 states / 100 SMs x 2;
    # room 2 tile-times x 0.25
    ([LaunchGroup(10**7, 16.0, 4, 2, depth_tiles=40.0, merge_states=300, room_tiles=2.0)],
     RouteTime(1.0, 0.5, 0.1, 3.0, depth_us=0.5, merge_us=2.0, room_us=0.25), True, 20 + 2 + 0.4 + 6 + 0.5 + 3),
    # read-bound: the same group at depth_us 0.2 (8 < 10)
    ([LaunchGroup(10**7, 16.0, 4, 2, depth_tiles=40.0, merge_states=300, room_tiles=2.0)],
     RouteTime(1.0, 0.5, 0.1, 3.0, depth_us=0.2, merge_us=2.0, room_us=0.25), True, 10 + 2 + 0.4 + 6 + 0.5 + 3),
]


@pytest.mark.parametrize("groups, rt, graphs, expected", MEASURED)
def test_measured_model_table(groups, rt, graphs, expected):
    assert measured_us(groups, rt, make_cal(), graphs=graphs) == pytest.approx(expected, rel=1e-12)


def test_partition_routes_are_one_group_described_by_the_partition():
    cal, seq = make_cal(), np.array([40000, 1000, 17, 32768])
    for kind, launches in (("workqueue", 2), ("fused", 1)):
        p = balanced_partition(seq, num_kv_heads=8, splits=WQ, cal=cal, kind=kind)
        model = PartitionModel.of(cal, kind)
        (g,) = route_groups(kind, seq, cal, splits=WQ, **SHAPE)
        room = int(model.room_charge(np.array([p.ctas]), np.array([p.chunk_tiles]))[0])
        assert g == LaunchGroup(kv_bytes=int(seq.sum()) * 8 * 128 * 4, makespan_tiles=p.cost / (64 * 100),
                                splits=int(p.num_splits.max()), launches=launches,
                                depth_tiles=float(-(-p.ctas // model.wave) * p.chunk_tiles),
                                merge_states=8 * int(p.num_splits[p.num_splits > 1].sum()),
                                room_tiles=room / (64 * 100))
    (fi,) = route_groups("flashinfer", seq, cal, **SHAPE)
    assert (fi.makespan_tiles, fi.splits, fi.launches) == _flashinfer_split(seq, cal.sm_count) + (1,)
    assert (fi.depth_tiles, fi.merge_states, fi.room_tiles) == (0.0, 0, 0.0)   # not described
    forced = balanced_partition(seq, num_kv_heads=8, splits=WQ, cal=cal, longest_splits=8, kind="fused")
    (g8,) = route_groups("fused", seq, cal, splits=WQ, longest_splits=8, **SHAPE)
    assert (g8.makespan_tiles, g8.splits) == (forced.cost / 6400, int(forced.num_splits.max()))


@pytest.mark.parametrize("ctas, chunk", [(250, 8), (256, 8), (264, 8), (256, 9), (500, 4), (1, 1)])
def test_the_groups_room_is_the_partitions_room_charge(ctas, chunk):
    """costmodel's integer copy of PartitionModel.room_charge (the router's hot path) agrees
    with it, charged (G 4's H200 constants: 32 slots, 48 tiles, chunks <= 8) and not."""
    sp = attrs.evolve(make_cal().splits, workqueue_ctas_per_sm=2.0, wave_room_slots=32, wave_room_tiles=48.0,
                      wave_room_chunk_tiles=8)
    cal = make_cal(splits=sp)
    model = PartitionModel.of(cal)
    wave, room = _wave_and_room(cal, ctas, chunk)
    assert wave == model.wave == 200
    assert room == int(model.room_charge(np.array([ctas]), np.array([chunk]))[0]) / (64 * 100)
    assert (room > 0) == (chunk <= 8 and -ctas % 200 < 32)


def _flashinfer_split(seq, sms, hkv=8):
    """FlashInfer's split form written out by linear search: the smallest chunk (tiles) whose
    CTAs fit FLASHINFER_CTAS_PER_SM per SM -> (makespan tiles, longest row's splits)."""
    tiles = [-(-int(n) // 32) for n in seq]
    c = next((c for c in range(1, max(tiles) + 1)
              if hkv * sum(-(-t // c) for t in tiles) <= FLASHINFER_CTAS_PER_SM * sms), max(tiles))
    ctas = hkv * sum(-(-t // c) for t in tiles)
    return float(c * -(-ctas // sms)), -(-max(tiles) // c)


@pytest.mark.parametrize("seq", [[32768], [32768] * 8, [40000, 1000, 17, 32768], [1], [17] * 256,
                                 [131072, 300, 300]])
def test_flashinfer_group_is_the_smallest_chunk_that_fits_its_grid(seq):
    """Independent of pkvrt's partition constants (it was a proxy through them until 085e990)."""
    cal = make_cal()
    (fi,) = route_groups("flashinfer", np.array(seq), cal, **SHAPE)
    assert (fi.makespan_tiles, fi.splits) == _flashinfer_split(seq, cal.sm_count)
    other = attrs.evolve(cal, splits=attrs.evolve(cal.splits, cta_overhead_tiles=9.0, co_resident_slowdown=1.0))
    assert route_groups("flashinfer", np.array(seq), other, **SHAPE) == (fi,)


def test_flashinfer_group_example_h200():
    """The docstring's example: 132 SMs, H_kv 8, B1 32K -> 64 splits of 16 tiles, 4 CTAs per SM."""
    (fi,) = route_groups("flashinfer", np.array([32768]), make_cal(sm_count=132), **SHAPE)
    assert (fi.makespan_tiles, fi.splits) == (64.0, 64)


def test_bucket_route_is_one_group_per_bucket():
    """Exact buckets of a 32K pair and a 1000-token row: two groups, their splits the plan's, their
    bytes the step's; a one-row bucket is described like the partition cut at its S."""
    cal, seq = make_cal(), np.array([32768, 1000, 32768])
    plan = plan_bucket(seq, splits=BUCKET, num_qo_heads=32, cal=cal, **SHAPE)
    groups = route_groups("bucket", seq, cal, splits=BUCKET, **SHAPE)
    assert [g.splits for g in groups] == [b.num_splits for b in plan.buckets]
    assert [g.launches for g in groups] == [2 if b.num_splits > 1 else 1 for b in plan.buckets]
    assert sum(g.kv_bytes for g in groups) == plan.counters.useful_kv_bytes
    one = np.array([32768])
    (b,) = route_groups("bucket", one, cal, splits=BUCKET, **SHAPE)
    (p,) = route_groups("fused", one, cal, splits=SplitBounds(1, 64, 1), longest_splits=b.splits, **SHAPE)
    assert (b.makespan_tiles, b.splits, b.kv_bytes) == (p.makespan_tiles, p.splits, p.kv_bytes)


def test_unknown_kind_is_refused():
    with pytest.raises(ValueError, match="unknown route kind 'paged'"):
        route_groups("paged", np.array([10]), make_cal(), **SHAPE)


@pytest.mark.parametrize("graphs", [True, False])
def test_without_a_time_model_the_roofline_predicts_as_before(graphs):
    cal, seq = make_cal(), np.array([40000, 1000, 17, 32768])
    kw = dict(num_qo_heads=32, cal=cal, **SHAPE)
    cases = [("bucket", bucket_counters(seq, splits=BUCKET, **kw), BUCKET),
             ("workqueue", workqueue_counters(seq, splits=WQ, **kw), WQ)]
    for kind, c, bounds in cases:
        got = predict_route_us(kind, seq, c, cal, graphs=graphs, splits=bounds, **SHAPE)
        assert got == predict_us(c, cal, graphs=graphs)
    fi = flashinfer_counters(seq, **SHAPE)
    assert predict_route_us("flashinfer", seq, fi, cal, graphs=graphs, **SHAPE) == \
        predict_flashinfer_us(fi, cal, active=4, num_kv_heads=8, graphs=graphs)


@pytest.mark.parametrize("kind, bounds", [("bucket", BUCKET), ("workqueue", WQ), ("fused", WQ), ("flashinfer", None)])
def test_with_a_time_model_each_kind_uses_its_constants(kind, bounds):
    cal, seq = timed_cal(), np.array([40000, 1000, 17, 32768])
    groups = route_groups(kind, seq, cal, splits=bounds, **SHAPE)
    got = predict_route_us(kind, seq, None, cal, graphs=True, splits=bounds, **SHAPE)
    assert got == pytest.approx(measured_us(groups, cal.route_time(kind), cal, graphs=True))


def test_worked_example_of_the_measured_model():
    """B1 32K at G = 4 on the H200, fused route (costmodel.py, "The measured model")."""
    cal = make_cal(sm_count=132, beta_gbps=4404.9, splits=SplitPoints(0.97, 2.0, 128, 3.0, 2.0, 3))
    seq = np.array([32768])
    (g,) = route_groups("fused", seq, cal, splits=SplitBounds(1, 64, 1), **SHAPE)
    assert (g.kv_bytes, g.makespan_tiles, g.splits) == (134_217_728, 67.0, 16)
    t = measured_us([g], RouteTime(0.9811, 0.5927, 0.0900, 3.695), cal, graphs=True)
    assert round(t, 1) == 39.9


def test_an_fp8_prediction_reads_one_byte_per_element_with_the_sections_constants():
    """B1 32K fused at G = 4 with an FP8 section: half the bytes at the section's read_scale,
    the partition cut with the section's constants; without a section, the fp16 constants."""
    from pkvrt.policy.calibration import KvDtypeSection, with_kv_dtype_section

    cal = make_cal(sm_count=132, beta_gbps=4404.9, splits=SplitPoints(0.97, 2.0, 128, 3.0, 2.0, 3),
                   time_model=tuple((k, RouteTime(0.9811, 0.5927, 0.0900, 3.695)) for k in TIME_KINDS))
    fp8_rt = RouteTime(0.75, 0.5, 0.1, 3.0)
    sec = KvDtypeSection(splits=(("cta_overhead_tiles", 1.0),), time_model=(("fused", fp8_rt),),
                         date="2026-12-08", command="test", provenance="test")
    view = with_kv_dtype_section(cal, "float8_e4m3fn", sec).for_kv_dtype("float8_e4m3fn")
    seq, bounds = np.array([32768]), SplitBounds(1, 64, 1)
    fp8 = dict(SHAPE, dtype_bytes=1)
    (g,) = route_groups("fused", seq, view, splits=bounds, **fp8)
    assert (g.kv_bytes, g.makespan_tiles, g.splits) == (67_108_864, 65.0, 16)   # overhead 1 tile, not 3
    expected = 0.75 * 67_108_864 / 4404.9e3 + 0.5 * math.sqrt(65) + 0.1 * 16 + 3.0
    assert predict_route_us("fused", seq, None, view, graphs=True, splits=bounds, **fp8) == pytest.approx(expected)
    fallback = cal.for_kv_dtype("float8_e4m3fn")
    assert fallback.kv_dtype_fallback and fallback.route_time("fused") == cal.route_time("fused")


# ----------------------------------------------------------------------------- fitting the measured model


def synthetic_records(rt: RouteTime, n: int = 30, seed: int = 1, beta: float = 1000.0, noise: float = 0.0):
    rng = np.random.default_rng(seed)
    out = []
    for _ in range(n):
        kv, m, s = int(rng.integers(10**6, 10**9)), float(rng.uniform(4, 600)), int(rng.integers(1, 65))
        us = rt.read_scale * kv / (beta * 1e3) + rt.tail_us * math.sqrt(m) + rt.split_us * s + rt.fixed_us
        out.append(dict(kv_bytes=kv, makespan_tiles=m, splits=s, us=us * (1 + noise * rng.standard_normal())))
    return out


@pytest.mark.parametrize("rt", [RouteTime(0.98, 0.6, 0.09, 3.7), RouteTime(1.2, 0.0, 0.3, 9.0),
                                RouteTime(0.9, 1.5, 0.0, 0.0)])
def test_fit_recovers_the_constants_that_made_the_times(rt):
    got = fit_route_time(synthetic_records(rt), beta_gbps=1000.0)
    assert attrs.astuple(got) == pytest.approx(attrs.astuple(rt), abs=1e-9)


def test_fit_with_a_fixed_shape_recovers_read_and_fixed():
    rt = RouteTime(1.03, 0.59, 0.09, 2.1)
    got = fit_route_time(synthetic_records(rt, n=5), beta_gbps=1000.0, shape=(0.59, 0.09))
    assert attrs.astuple(got) == pytest.approx(attrs.astuple(rt), abs=1e-9)


@given(seed=st.integers(0, 10**6))
def test_fit_never_returns_a_negative_constant(seed):
    """Noisy times of a model with no tail and no split term: least squares alone may give them
    negative weights; the fit keeps every constant >= 0 and close to the truth."""
    recs = synthetic_records(RouteTime(1.0, 0.0, 0.0, 5.0), n=12, seed=seed, noise=0.02)
    got = fit_route_time(recs, beta_gbps=1000.0)
    assert got.read_scale > 0 and min(got.tail_us, got.split_us, got.fixed_us) >= 0
    errs = [abs(measured_us([LaunchGroup(r["kv_bytes"], r["makespan_tiles"], r["splits"], 1)], got, make_cal(),
                            graphs=True) / r["us"] - 1) for r in recs]
    assert max(errs) < 0.1


def depth_records(rt: RouteTime, n: int = 30, seed: int = 1, beta: float = 1000.0, noise: float = 0.0):
    """synthetic_records with the depth, merge and room terms: short steps (a few MB) whose chain
    of tiles outlasts their read, long ones bound by the read."""
    rng = np.random.default_rng(seed)
    out = []
    for i in range(n):
        kv = int(rng.integers(10**6, 10**7)) if i % 2 else int(rng.integers(10**8, 10**9))
        m, s, d = float(rng.uniform(4, 600)), int(rng.integers(1, 65)), float(rng.uniform(8, 64))
        mps, room = float(rng.uniform(0, 8)), float(rng.choice([0.0, 0.0, rng.uniform(0, 5)]))
        g = LaunchGroup(kv, m, s, 1, depth_tiles=d, merge_states=round(mps * 100), room_tiles=room)
        us = measured_us([g], rt, make_cal(), graphs=True)
        out.append(dict(kv_bytes=kv, makespan_tiles=m, splits=s, depth_tiles=d, merge_per_sm=round(mps * 100) / 100,
                        room_tiles=room, us=us * (1 + noise * rng.standard_normal())))
    return out


@pytest.mark.parametrize("rt", [RouteTime(0.98, 0.6, 0.09, 3.7, depth_us=0.6, merge_us=0.8, room_us=0.4),
                                RouteTime(1.1, 0.0, 0.0, 2.0, depth_us=0.45),
                                RouteTime(0.95, 0.3, 0.05, 1.0, depth_us=0.0, merge_us=1.5)])
def test_fit_recovers_the_depth_merge_and_room_terms(rt):
    recs = depth_records(rt)
    assert any(rt.depth_us * r["depth_tiles"] > rt.read_scale * r["kv_bytes"] / 1e6 for r in recs) == (rt.depth_us > 0)
    got = fit_route_time(recs, beta_gbps=1000.0)
    assert attrs.astuple(got) == pytest.approx(attrs.astuple(rt), abs=1e-6)


def test_a_weighted_record_pulls_the_fit_to_it():
    """``weight`` scales a record's relative error in the fit's criterion (the largest weighted
    error, then the weighted squared error): a heavy record is reproduced more closely than in
    the unweighted fit of the same noisy times (sweeps weights each step's planned cut so), and
    scaling every weight alike changes nothing."""
    recs = synthetic_records(RouteTime(1.0, 0.5, 0.1, 3.0), n=12, seed=3, noise=0.05)

    def err(rt, r=recs[0]):
        g = LaunchGroup(r["kv_bytes"], r["makespan_tiles"], r["splits"], 1)
        return abs(measured_us([g], rt, make_cal(), graphs=True) / r["us"] - 1)

    plain = fit_route_time(recs, beta_gbps=1000.0)
    heavy = fit_route_time([dict(r, weight=100.0 if i == 0 else 1.0) for i, r in enumerate(recs)],
                           beta_gbps=1000.0)
    assert err(heavy) < err(plain) / 5
    same = fit_route_time([dict(r, weight=2.0) for r in recs], beta_gbps=1000.0)   # scale-free
    assert attrs.astuple(same) == pytest.approx(attrs.astuple(plain), rel=1e-7, abs=1e-9)


@given(seed=st.integers(0, 10**6))
def test_the_largest_error_is_no_larger_than_least_squares(seed):
    """The criterion is the largest relative error: the fit's is at most that of the least-squares
    fit before cbdbfde (each subset of tail, split and fixed solved by least squares on the
    relative error, the non-negative one of least squared error), one of its candidates."""
    recs = synthetic_records(RouteTime(1.0, 0.4, 0.05, 4.0), n=10, seed=seed, noise=0.04)
    y = np.array([r["us"] for r in recs])
    cols = np.array([[r["kv_bytes"] / 1e6, math.sqrt(r["makespan_tiles"]), r["splits"], 1.0] for r in recs])
    ls = None
    for k in range(4):
        for sub in itertools.combinations((1, 2, 3), k):
            idx = [0, *sub]
            x = np.linalg.lstsq(cols[:, idx] / y[:, None], np.ones(y.size), rcond=None)[0]
            sse = float(np.sum((cols[:, idx] @ x / y - 1) ** 2))
            if x[0] > 0 and (x >= 0).all() and (ls is None or sse < ls[0]):
                ls = (sse, np.max(np.abs(cols[:, idx] @ x / y - 1)))
    got = fit_route_time(recs, beta_gbps=1000.0)
    pred = np.array([measured_us([LaunchGroup(r["kv_bytes"], r["makespan_tiles"], r["splits"], 1)], got,
                                 make_cal(), graphs=True) for r in recs])
    assert np.max(np.abs(pred / y - 1)) <= ls[1] + 1e-9


@pytest.mark.parametrize("records, shape, match", [
    ([], None, "0 timed configurations, need at least 4"),
    (synthetic_records(RouteTime(1, 1, 1, 1), n=3), None, "3 timed configurations, need at least 4"),
    (synthetic_records(RouteTime(1, 1, 1, 1), n=1), (1.0, 1.0), "need at least 2"),
    ([dict(kv_bytes=1, makespan_tiles=1, splits=1, us=0.0)] * 4, None, r"records\[0\]\['us'\]: expected a time > 0"),
    ([dict(kv_bytes=1, makespan_tiles=-1, splits=1, us=1.0)] * 4, None, r"'makespan_tiles'.*>= 0"),
    ([dict(kv_bytes=1, makespan_tiles=1, us=1.0)] * 4, None, r"'splits'.*got None"),
    ([dict(kv_bytes=1, makespan_tiles=1, splits=1, us=1.0, weight=0.0)] * 4, None,
     r"records\[0\]\['weight'\]: expected a finite number > 0, got 0.0"),
    ([dict(kv_bytes=1, makespan_tiles=1, splits=1, us=1.0, depth_tiles=-2.0)] * 4, None,
     r"records\[0\]\['depth_tiles'\]: expected a finite number >= 0, got -2.0"),
    ([dict(kv_bytes=1, makespan_tiles=1, splits=1, us=1.0, merge_per_sm=math.inf)] * 4, None,
     r"\['merge_per_sm'\]: expected a finite number >= 0, got inf"),
    ([dict(kv_bytes=0, makespan_tiles=i, splits=1, us=1.0 + i) for i in range(4)], None,
     "no fit with a positive read_scale"),
] + [([dict(kv_bytes=1, makespan_tiles=1, splits=1, us=1.0, weight=w)] * 4, None,
      r"\['weight'\]: expected a finite number > 0") for w in (-1.0, math.inf, math.nan, True)])
def test_fit_refuses_what_it_cannot_fit(records, shape, match):
    with pytest.raises(ValueError, match=match):
        fit_route_time(records, beta_gbps=1000.0, shape=shape)
