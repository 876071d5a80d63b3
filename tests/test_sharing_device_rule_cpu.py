"""The device-lengths sharing rule (kernels/find_shared.cu; its twin sharing.SharingRule): the
time model's prediction of each decode, its decisions on the measured sharing steps, and
SharedPagesRuntime(device_planning=True) on the fake device keeping or dropping the chunks
found, exact either way."""

from __future__ import annotations

import sys

import attrs
import numpy as np
import pytest
import torch

from test_runtime_cpu import FAKE_SHAPE, REPO, ROUTES, fake_device, pool, ref, rel_err  # noqa: F401
from test_sharing_runtime_cpu import shared_step

from pkvrt.launch import ops
from pkvrt.policy import sharing
from pkvrt.policy.calibration import load_calibration
from pkvrt.runtime.options import RuntimeOptions
from pkvrt.runtime.shared import SharedPagesRuntime

sys.path.insert(0, str(REPO / "benches"))
import shared_pages as bench  # noqa: E402  (the measured steps, by the bench's own definition)

CALIBRATIONS = ("nvidia-h100-80gb-hbm3", "nvidia-h200")


def bench_step(name: str) -> tuple[np.ndarray, np.ndarray, int]:
    """A case of benches/shared_pages.py: its lengths and block tables (each group's prefix pages
    shared, then pages of each row's own), and the pages used."""
    groups, own = bench.CASES[name]
    lens = [shared + own for rows, shared in groups for _ in range(rows)]
    width = max(-(-n // bench.PAGE) for n in lens)
    bt = np.zeros((len(lens), width), np.int32)
    at = r = 0
    for rows, shared in groups:
        n = shared // bench.PAGE
        prefix, at = np.arange(at, at + n), at + n
        for i in range(r, r + rows):
            pages = -(-lens[i] // bench.PAGE)
            bt[i, :n], bt[i, n:pages] = prefix, np.arange(at, at + pages - n)
            at += pages - n
        r += rows
    return np.array(lens, np.int32), bt, at


def bench_runtime(fake_device, cal: str, rows: int, width: int, num_pages: int, **kw):  # noqa: F811
    kw.setdefault("options", RuntimeOptions(use_cuda_graph=False))
    return SharedPagesRuntime(bench.H_Q, bench.H_KV, bench.D, bench.PAGE, torch.float16,
                              max_batch=max(8, rows), max_pages_per_row=width, num_pages=num_pages,
                              device_planning=True, calibration=REPO / "calibration" / f"{cal}.json", **kw)


@pytest.mark.parametrize("cal", CALIBRATIONS)
def test_each_decode_is_timed_as_the_router_times_its_device_route(fake_device, cal):  # noqa: F811
    """The rule's decode times are Router.predict of the route device planning runs at B rows
    (routes.toml [device_planning], at each decode's group size: the chunk decode's, 16 heads a
    KV head, takes large_group_route) on the plain and the chunk Runtime's calibrations, in
    graphs (a Runtime with its own graphs times them so); the kernel's constants are those of
    the same calibrations and routes."""
    from pkvrt.policy.planner import device_plan_targets

    rng = np.random.default_rng(1)
    for b in (1, 2, 8, 64):
        rt = bench_runtime(fake_device, cal, b, 2048, 10**6)
        graphed = SharedPagesRuntime(bench.H_Q, bench.H_KV, bench.D, bench.PAGE, torch.float16,
                                     max_batch=max(8, b), max_pages_per_row=2048, num_pages=10**6,
                                     device_planning=True, calibration=REPO / "calibration" / f"{cal}.json")
        rule = rt.device_rule(b)
        routes = {which: ROUTES.device_planning_route(b, r.router.group_size)
                  for which, r in (("row", rt.plain), ("chunk", rt.shared))}
        assert rule.row.kind == routes["row"].kind and rule.chunk.kind == routes["chunk"].kind
        assert routes["chunk"].name == ("pkv_workqueue" if b > 1 else routes["row"].name)
        for _ in range(5):
            lens = rng.integers(0, 30_000, size=b)
            lens[0] = max(lens[0], 1)
            for which, runtime in (("row", graphed.plain), ("chunk", graphed.shared)):
                assert runtime.router.graphs
                want = runtime.router.predict(routes[which], lens.astype(np.int64))
                assert getattr(rule, which).us(lens) == pytest.approx(want, rel=1e-12), which
        fields = rule.kernel_fields()
        for which, runtime in (("row", rt.plain), ("chunk", rt.shared)):
            route = routes[which]
            targets = device_plan_targets(runtime.calibration, route.kind)
            for k in ("resident", "slowdown8", "overhead8", "max_ctas", "free_slots", "room_slots",
                      "room8", "room_chunk"):
                assert fields[f"{which}_{k}"] == targets[k], (which, k)
            assert fields[f"{which}_num_candidates"] == len(route.splits.candidates())
            assert fields[f"{which}_fixed_us"] == runtime.calibration.route_time(route.kind).fixed_us


# The path measured faster on each sharing step in the device-lengths mode
# (benches/results/h100/shared-pages.json, ef081fe, same process): the device-lengths step
# sharing (pkvrt-shared-device) against plain device planning (pkvrt-device-plan) plus the
# launches this mode keeps on a step it runs plain (4.2-7.3 us a layer on the steps without
# sharing). 8 x (8K + 512) is a near tie: 1 638 us sharing, 1 491 + 32 x 4-7 plain.
MEASURED_FASTER = {"8x(8K+512)": True, "8x(32K+128)": True, "32x(4K+256)": True,
                   "64x(2K+1K)": True, "16x(1K+1K)": False, "parallel-8x(2K..16K)x4": True}


@pytest.mark.parametrize("cal", CALIBRATIONS)
@pytest.mark.parametrize("name", list(bench.CASES))
def test_the_rule_takes_the_measured_faster_path_on_the_sharing_steps(fake_device, cal, name):  # noqa: F811
    """Each GPU's calibration: the rule shares exactly the steps where sharing measured faster
    than the plain step, and credits L2 with the plain step's true re-reads (one level of
    sharing: every re-read is of the leader's prefix)."""
    seq, bt, num_pages = bench_step(name)
    rt = bench_runtime(fake_device, cal, len(seq), bt.shape[1], num_pages)
    found = sharing.plan_prefix_chunks(seq, bt, bench.PAGE, rt.chunk, rule=rt.device_rule(len(seq)))
    d = found.decision
    if name not in MEASURED_FASTER:   # nothing shared: nothing to decide
        assert d is None and not (found.slots[:, 0] >= 0).any()
        return
    assert d.shared == MEASURED_FASTER[name], d
    assert d.plain_rereads == sharing.page_rereads(seq, bt, bench.PAGE)
    assert (found.tokens_saved > 0) == d.shared
    if d.shared:
        used = found.chunk_seq > 0
        assert d.chunk_rereads == sharing.page_rereads(found.chunk_seq[used], found.chunk_bt[used], bench.PAGE)


def test_the_plain_decision_describes_the_plain_step(fake_device):  # noqa: F811
    """Where the rule says plain, the outputs are those of a step that shares nothing: no chunk,
    every own segment the row's whole table, and the decision kept for found()."""
    seq, bt, _ = bench_step("16x(1K+1K)")
    rt = bench_runtime(fake_device, CALIBRATIONS[0], len(seq), bt.shape[1], 10**5)
    rule = rt.device_rule(len(seq))
    plain = sharing.plan_prefix_chunks(seq, bt, bench.PAGE, rt.chunk, rule=rule)
    shared = sharing.plan_prefix_chunks(seq, bt, bench.PAGE, rt.chunk)
    nothing = sharing.plan_prefix_chunks(seq, bt, bench.PAGE, rt.chunk,
                                         rule=attrs.evolve(rule, margin=float("inf")))
    assert not plain.decision.shared and nothing.decision.shared is False
    assert shared.tokens_saved > 0 and plain.tokens_saved == 0
    assert (plain.chunk_seq == 0).all() and (plain.chunk_rows == -1).all()
    np.testing.assert_array_equal(plain.own_seq, seq)
    np.testing.assert_array_equal(plain.own_bt, bt)
    np.testing.assert_array_equal(plain.slots[:, 0], -1)
    always = sharing.plan_prefix_chunks(seq, bt, bench.PAGE, rt.chunk, rule=attrs.evolve(rule, margin=0.0))
    assert always.decision.shared
    for name in ("chunk_seq", "chunk_rows", "own_seq", "slots"):
        np.testing.assert_array_equal(getattr(always, name), getattr(shared, name), err_msg=name)


@pytest.mark.parametrize("margin, shares", [(0.0, True), (float("inf"), False)])
@pytest.mark.parametrize("engine_capture", [False, True], ids=["own graphs", "engine capture"])
def test_device_lengths_follow_the_rule_exactly(fake_device, pool, margin, shares, engine_capture):  # noqa: F811
    """SharedPagesRuntime(device_planning=True) with the rule on (routes.toml [sharing]
    device_margin 0: share wherever chunks are found; inf: never): found() reports the decision, the chunks are
    kept or dropped, and the output matches the FP32 reference either way."""
    b, _ = pool
    seq, bt = shared_step(b, [800, 850, 900, 700], 40, [[0, 1, 2, 3]])
    routes = attrs.evolve(ROUTES, sharing_device_margin=margin)
    rt = SharedPagesRuntime(*FAKE_SHAPE.values(), torch.float16, routes=routes,
                            calibration=REPO / "calibration" / f"{CALIBRATIONS[0]}.json",
                            max_batch=8, max_pages_per_row=256, device_planning=True,
                            engine_capture=engine_capture, options=RuntimeOptions(flashinfer=False))
    rt.plan(torch.as_tensor(seq), torch.as_tensor(bt))
    found = rt.found()
    assert found.decision is not None and found.decision.shared is shares
    assert (found.tokens_saved > 0) is shares
    assert ("device_margin" in rt.explain()) and "found() reads them and the decision" in rt.explain()
    q = torch.randn(len(seq), FAKE_SHAPE["num_qo_heads"], FAKE_SHAPE["head_dim"],
                    generator=torch.Generator().manual_seed(3)).half()
    out = rt.run(q, b.k_cache, b.v_cache, out=torch.full_like(q, float("nan")))
    assert rel_err(out, ref(q, (b.k_cache, b.v_cache), seq, torch.as_tensor(bt))) < 2e-3


def test_no_rule_without_a_chunk_decode(fake_device):  # noqa: F811
    """G above the chunk capacity (one row a chunk): no chunk decode, so no rule, and said so."""
    rt = SharedPagesRuntime(32, 2, 64, 16, torch.float16, routes=ROUTES, max_batch=8,
                            max_pages_per_row=64, device_planning=True,
                            calibration=REPO / "calibration" / f"{CALIBRATIONS[0]}.json",
                            options=RuntimeOptions(flashinfer=False))
    assert rt.shared is None and rt.device_rule(4) is None
    assert rt._device_rule(4)[1] == "no chunk decode: one row of G 16 a chunk"


def test_without_a_time_model_every_chunk_is_kept(fake_device, pool):  # noqa: F811
    """A calibration without the measured time model of the device route (the seed file): no
    rule, every chunk found is kept, and explain() says why."""
    from test_runtime_cpu import SEED

    b, _ = pool
    seq, bt = shared_step(b, [800, 850, 900, 700], 40, [[0, 1, 2, 3]])
    rt = SharedPagesRuntime(*FAKE_SHAPE.values(), torch.float16, routes=ROUTES, calibration=SEED,
                            max_batch=8, max_pages_per_row=256, device_planning=True,
                            options=RuntimeOptions(flashinfer=False))
    assert rt.device_rule(len(seq)) is None
    rt.plan(torch.as_tensor(seq), torch.as_tensor(bt))
    assert rt.found().decision is None and rt.found().tokens_saved > 0
    assert "every one kept (the step's calibration has no measured time model of the fused route)" \
        in rt.explain()


def test_find_shared_refuses_a_bad_rule_buffer():
    """ops.find_shared names a rule_out, candidates or split_pin tensor of the wrong kind before
    anything is launched."""
    rt_cal = load_calibration(REPO / "calibration" / f"{CALIBRATIONS[0]}.json").for_group(4)
    route = ROUTES.device_planning_route(4)
    common = dict(kind=route.kind, splits=route.splits, num_kv_heads=2, head_dim=64, dtype_bytes=2,
                  graphs=True)
    rule = sharing.SharingRule(row=sharing.DecodeTime(cal=rt_cal, **common),
                               chunk=sharing.DecodeTime(cal=rt_cal, **common), page_size=16,
                               l2_saved_us=0.01, extra_us=10.0, plain_extra_us=5.0, margin=1.1)
    i32 = dict(dtype=torch.int32)
    b, w = 4, 8
    args = (torch.ones(b, **i32), torch.zeros(b, w, **i32), torch.zeros(b, **i32), torch.zeros(b, w, **i32),
            torch.zeros(b, **i32), torch.zeros(b, w, **i32),
            torch.zeros(b * 2 * 2 * 4, dtype=torch.int64), torch.zeros(b, 2, dtype=torch.int64))
    kw = dict(page_size=16, chunk_rows=2, group=4, num_kv_heads=2)
    cands = torch.tensor(route.splits.candidates(), **i32)
    for bad in (torch.zeros(6, dtype=torch.float32), torch.zeros(5, dtype=torch.float64)):
        with pytest.raises(ops.KernelArgumentError, match=r"rule_out: expected a float64 \[6\] tensor"):
            ops.find_shared(*args, **kw, rule=rule, candidates=(cands, cands), rule_out=bad)
    with pytest.raises(ops.KernelArgumentError, match=r"candidates \(chunk\): expected an int32"):
        ops.find_shared(*args, **kw, rule=rule, candidates=(cands, cands[:3]),
                        rule_out=torch.zeros(6, dtype=torch.float64))
    for bad in (torch.zeros(2, **i32), torch.zeros(1, dtype=torch.int64), [0]):
        with pytest.raises(ops.KernelArgumentError, match=r"split_pin: expected"):
            ops.find_shared(*args, **kw, rule=rule, candidates=(cands, cands), split_pin=bad)
    # a rule that cuts the chunk decode by the time model needs the pin to hand the count on
    with pytest.raises(ops.KernelArgumentError, match=r"split_pin: expected .* model_cut_rows is set"):
        ops.find_shared(*args, **kw, rule=attrs.evolve(rule, model_cut_rows=4), candidates=(cands, cands))
    for bad in (None, (cands,)):
        with pytest.raises(ops.KernelArgumentError, match=r"candidates: expected a \(row, chunk\) pair"):
            ops.find_shared(*args, **kw, rule=rule, candidates=bad)
    with pytest.raises(ops.KernelArgumentError, match=r"candidates \(row\)"):
        ops.find_shared(*args, **kw, rule=rule, candidates=(cands[:2], cands))


@pytest.mark.parametrize("cal", CALIBRATIONS)
@pytest.mark.parametrize("name", list(bench.CASES))
def test_the_chunk_decode_is_cut_as_host_lengths_cut_it(fake_device, cal, name):  # noqa: F811
    """The device rule's chunk decode cut by the time model (RuntimeOptions.shared_chunk_cut
    "time_model", the default) takes the count host lengths take for the same chunks
    (SharedPagesRuntime._chunk_cut: routes.toml's model_cut_rows and model_cut_margin, the
    planning grid), or the partition's cut where host lengths keep it; "partition" turns it
    off. On each GPU's file 8 x (8K + 512), the
    step it was measured on, is cut by the model. (Host lengths plan their chunk decode at as
    many rows as chunks, device lengths at the step's B rows, most of them idle: the two grids
    agree on these steps.)"""
    seq, bt, num_pages = bench_step(name)
    rt = bench_runtime(fake_device, cal, len(seq), bt.shape[1], num_pages)
    always = attrs.evolve(rt.device_rule(len(seq)), margin=0.0)
    d = sharing.plan_prefix_chunks(seq, bt, bench.PAGE, rt.chunk, rule=always).decision
    off = bench_runtime(fake_device, cal, len(seq), bt.shape[1], num_pages,
                        options=RuntimeOptions(use_cuda_graph=False, shared_chunk_cut="partition"))
    assert off.device_rule(len(seq)).model_cut_rows == 0
    if d is None:   # nothing shared
        assert name in ("8x(0+8K)", "8x(0+1K)")
        return
    host = SharedPagesRuntime(bench.H_Q, bench.H_KV, bench.D, bench.PAGE, torch.float16,
                              max_batch=max(8, len(seq)), max_pages_per_row=bt.shape[1],
                              num_pages=num_pages, engine_capture=True,
                              calibration=REPO / "calibration" / f"{cal}.json")
    assert host._steps.step(seq.astype(np.int64), bt)
    host_plan = host._steps.plan()
    device_chunks = sharing.plan_prefix_chunks(seq, bt, bench.PAGE, rt.chunk).chunk_seq
    # the same chunks both ways (one level of sharing from position 0 in every bench step)
    np.testing.assert_array_equal(np.sort(host_plan.chunk_seq), np.sort(device_chunks[device_chunks > 0]))
    want = host._chunk_cut(host_plan)[0]
    assert d.chunk_splits == (want or 0), (d, want, host._cut_why)
    if name == "8x(8K+512)":
        assert d.chunk_splits > 0, d
    no_cut = attrs.evolve(off.device_rule(len(seq)), margin=0.0)
    assert sharing.plan_prefix_chunks(seq, bt, bench.PAGE, rt.chunk, rule=no_cut).decision.chunk_splits == 0


@pytest.mark.parametrize("cut", ["time_model", "partition"])
def test_the_chunk_decode_is_planned_at_the_pinned_count(fake_device, cut):  # noqa: F811
    """Device lengths on 8 x (8K + 512) with the H200 file: find_shared's split_pin reaches the
    chunk decode's planning kernel, which cuts the longest chunk at that count (the partition's
    cut with "partition"), and found() reports it; the own decode is planned from its
    candidates as before."""
    seq, bt, num_pages = bench_step("8x(8K+512)")
    rt = bench_runtime(fake_device, CALIBRATIONS[1], len(seq), bt.shape[1], num_pages,
                       options=RuntimeOptions(use_cuda_graph=False, shared_chunk_cut=cut))
    rt.plan(torch.as_tensor(seq), torch.as_tensor(bt))
    d = rt.found().decision
    assert d.shared
    pin = int(rt._split_pin[0])
    assert pin == d.chunk_splits and (pin > 0) == (cut == "time_model")
    chunks = rt.found().chunk_seq
    planned = rt.shared._d_num_splits[:len(seq)].numpy()
    assert (planned[chunks == 0] == 0).all()
    if pin:
        assert planned.max() == pin
    else:
        route = ROUTES.device_planning_route(len(seq), rt.shared.router.group_size)
        from pkvrt.policy import planner
        part = planner.balanced_partition(chunks.astype(np.int64), num_kv_heads=bench.H_KV,
                                          splits=route.splits, cal=rt.shared.calibration, kind=route.kind)
        np.testing.assert_array_equal(planned, part.num_splits)
    assert rt.own._device_split_pin is None and rt.plain._device_split_pin is None
