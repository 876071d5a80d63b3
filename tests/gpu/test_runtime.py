"""pkvrt.Runtime on the GPU: every route, graphs on and off, against the FP32 reference and
FlashInfer, over decode steps whose lengths grow and whose rows join and leave. Host-routed
workqueue/fused steps are planned on the GPU by the planning kernel: their plan equals the host
planner's task for task, and their graphs replay while the lengths grow.

Data comes from ``tests/paged.py::make_batch``: pages no row owns hold NaN and block-table
padding holds an out-of-range page id, so reading what must not be read fails the test.
"""

from __future__ import annotations

import gc
import math
import warnings
import weakref

import numpy as np
import pytest
import torch

from paged import make_batch, rel_err
from pkvrt import reference
from pkvrt.launch import _driver
from pkvrt.runtime import fi_route, graphs
from pkvrt.runtime import Runtime
from pkvrt.runtime.options import RuntimeOptions, with_options

pytestmark = pytest.mark.gpu

SHAPE = dict(num_qo_heads=32, num_kv_heads=8, head_dim=128, page_size=16)
# Requests' longest lengths: two past the 16K gate (so the policy itself may pick PersistentKV),
# a mid, a short, a one-page and a 12K one.
POOL_LENS = [20000, 17000, 5000, 900, 33, 12000]
# (pool rows, tokens short of their longest length): lengths grow by one a step, request 4 joins
# at step 2, request 1 leaves at step 4, request 5 joins at step 5.
STEPS = [([0, 1, 2, 3], 5), ([0, 1, 2, 3], 4), ([0, 1, 2, 3, 4], 3), ([0, 1, 2, 3, 4], 2),
         ([0, 2, 3, 4], 1), ([0, 2, 3, 4, 5], 0)]
FI_MODULE, FI_REASON = fi_route.load_flashinfer()
ROUTES = ["flashinfer", "pkv_bucket", "pkv_workqueue", "pkv_fused", None]


@pytest.fixture(scope="module")
def pool():
    """Two layers of paged KV for the pool of requests (layer 1: other values, same pages)."""
    b = make_batch(POOL_LENS, **SHAPE, dtype=torch.float16, seed=20260623)
    k1, v1 = torch.randn_like(b.k_cache), torch.randn_like(b.v_cache)
    k1[~b.owned], v1[~b.owned] = float("nan"), float("nan")
    return b, [(b.k_cache, b.v_cache), (k1, v1)]


def step_inputs(b, rows, short, seed):
    seq = np.array([max(1, POOL_LENS[r] - short) for r in rows], dtype=np.int32)
    bt = b.block_tables[rows].cpu().numpy()
    gen = torch.Generator(device="cuda").manual_seed(seed)
    q = torch.randn(len(rows), SHAPE["num_qo_heads"], SHAPE["head_dim"], device="cuda", generator=gen)
    return seq, bt, q.half()


def ref_out(q, cache, seq, bt):
    return reference.decode_attention(q, cache[0], cache[1], torch.as_tensor(seq, device="cuda"),
                                      torch.as_tensor(bt, device="cuda"))


def fi_out(q, cache, seq, bt, tensor_cores=True):
    """FlashInfer's own answer (a plain wrapper with its default backend, planned from scratch),
    or None without it."""
    if FI_MODULE is None:
        return None
    page = SHAPE["page_size"]
    pages = [math.ceil(n / page) for n in seq]
    indptr = torch.tensor([0, *np.cumsum(pages)], dtype=torch.int32)
    indices = torch.cat([torch.as_tensor(bt[i, :p]) for i, p in enumerate(pages)]).int().cuda()
    last = torch.tensor([n - (p - 1) * page for n, p in zip(seq, pages)], dtype=torch.int32)
    ws = torch.zeros(128 * 2**20, dtype=torch.uint8, device="cuda")
    w = FI_MODULE.BatchDecodeWithPagedKVCacheWrapper(ws, "HND", use_tensor_cores=tensor_cores)
    w.plan(indptr, indices, last, SHAPE["num_qo_heads"], SHAPE["num_kv_heads"], SHAPE["head_dim"],
           page, q_data_type=torch.float16, kv_data_type=torch.float16)
    return w.run(q, cache)


def check(out, q, cache, seq, bt, what):
    torch.cuda.synchronize()
    assert not torch.isnan(out).any(), f"{what}: NaN (an element not written, or a poisoned read)"
    assert rel_err(out, ref_out(q, cache, seq, bt)) < 2e-3, what
    fi = fi_out(q, cache, seq, bt)
    if fi is not None:
        e = (out.float() - fi.float()).abs()
        assert e.max().item() < 2e-3 and e.mean().item() < 3e-4, what


def runtime(**kw):
    # FlashInfer's CUDA-graph mode on: these tests check the graph machinery of every route.
    # The default (eager FlashInfer route) has its own test below.
    kw = dict(dict(max_batch=16, max_pages_per_row=2048, flashinfer_cuda_graph=True), **kw)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # the calibration fallback warning on a GPU with no file
        return Runtime(*SHAPE.values(), torch.float16, **with_options(kw))


@pytest.mark.parametrize("use_graphs", [True, False], ids=["graphs", "eager"])
@pytest.mark.parametrize("route", ROUTES, ids=lambda r: r or "auto")
def test_decode_steps_match_reference_and_flashinfer(pool, route, use_graphs):
    if route == "flashinfer" and FI_MODULE is None:
        pytest.skip(f"FlashInfer route unavailable: {FI_REASON}")
    b, caches = pool
    rt = runtime(use_cuda_graph=use_graphs)
    for i, (rows, short) in enumerate(STEPS):
        seq, bt, q = step_inputs(b, rows, short, seed=i)
        d = rt.plan(seq, bt, force=route)
        assert route is None or d.route == route
        for layer, cache in enumerate(caches):
            if layer == 0:  # a fresh q/out every call (staging path, then its own graph)
                out = rt.run(q.clone(), *cache, out=torch.full_like(q, float("nan")))
            else:           # the zero-copy path
                rt.static_q(len(rows)).copy_(q)
                rt.static_out(len(rows)).fill_(float("nan"))
                out = rt.run(rt.static_q(len(rows)), *cache, out=rt.static_out(len(rows)))
            check(out, q, cache, seq, bt, f"step {i} layer {layer} route {d.route}")
    s = rt.stats()
    if use_graphs:
        assert s["captures"] > 0 and s["replays"] > 0 and s["min_graph_nodes"] >= 1
        assert s["graphs"] <= s["max_graphs"]
    else:
        assert s["captures"] == 0 and s["eager_runs"] == 2 * len(STEPS)


@pytest.mark.parametrize("routing", ["device_planning", "router"])
@pytest.mark.parametrize("route", ROUTES, ids=lambda r: r or "auto")
def test_engine_capture_host_lengths(pool, route, routing):
    """engine_capture: plan() on the host before each step, the step's layers captured in one
    graph per step_key and replayed while lengths grow and rows join and leave; every step's
    last layer matches the reference (a stale graph would read another step's plan). Unforced
    steps take routes.toml's [device_planning] route (capture_routing="router": the router's)."""
    if route == "flashinfer" and FI_MODULE is None:
        pytest.skip(f"FlashInfer route unavailable: {FI_REASON}")
    if routing == "router" and route is not None:
        pytest.skip("a forced route is the same with either routing")
    b, caches = pool
    rt = runtime(engine_capture=True, capture_routing=routing,
                 flashinfer_cuda_graph=False)   # FlashInfer's graph mode anyway
    assert not rt.use_cuda_graph and rt.step_key is None
    outs = {}
    step_graphs: dict = {}
    steps = STEPS + [(rows, short + 2) for rows, short in STEPS]   # every key seen twice
    for i, (rows, short) in enumerate(steps):
        seq, bt, q = step_inputs(b, rows, short, seed=100 + i)
        qs = rt.static_q(len(rows))
        qs.copy_(q)
        out = outs.setdefault(len(rows), torch.empty_like(q))
        out.fill_(float("nan"))
        d = rt.plan(seq, bt, force=route)
        key = (rt.step_key, len(rows))
        assert key[0][0] == d.route and key[0][2] >= len(rows)
        if route is None and routing == "device_planning":
            assert d.route == rt.registry.device_planning_route(len(rows)).name

        def layers():
            for cache in caches:
                rt.run(qs, *cache, out=out)

        g = step_graphs.get(key)
        if g is None:
            step_graphs[key] = graphs.capture(layers).graph   # its warm-up computes this step
        else:
            g.replay()
        check(out, q, caches[-1], seq, bt, f"step {i} route {d.route}")
    s = rt.stats()
    assert s["captures"] == 0 and s["replays"] == 0   # no graphs of the Runtime's own
    assert len(step_graphs) < len(steps)              # keys repeat: graphs were replayed


@pytest.mark.parametrize("route", ["pkv_workqueue", "pkv_fused"])
def test_engine_capture_one_graph_per_step_key_serves_its_padded_batch(pool, route):
    """Keyed on step_key alone (README's loop): steps of 3 and 4 rows share padded batch 4, so
    one graph, captured on the first, replays for both, reading q and writing out through the
    static buffers (the same addresses at every batch size)."""
    b, caches = pool
    rt = runtime(engine_capture=True)
    step_graphs: dict = {}
    for i, rows in enumerate([[0, 2, 3], [0, 1, 2, 3], [0, 2, 3], [1, 2, 3, 4]]):
        seq, bt, q = step_inputs(b, rows, 3 - i, seed=200 + i)
        rt.plan(seq, bt, force=route)
        qs, out = rt.static_q(len(rows)), rt.static_out(len(rows))
        qs.copy_(q)
        out.fill_(float("nan"))
        g = step_graphs.get(rt.step_key)
        if g is None:
            step_graphs[rt.step_key] = graphs.capture(
                lambda: [rt.run(rt.static_q(len(rows)), *c, out=rt.static_out(len(rows)))
                         for c in caches]).graph
        else:
            g.replay()
        check(out, q, caches[-1], seq, bt, f"step {i} ({len(rows)} rows)")
    assert len(step_graphs) == 1


def test_a_flashinfer_step_in_an_engine_graph_needs_engine_capture(pool):
    if FI_MODULE is None:
        pytest.skip(f"FlashInfer route unavailable: {FI_REASON}")
    b, caches = pool
    rt = runtime(use_cuda_graph=False, flashinfer_cuda_graph=False)
    seq, bt, q = step_inputs(b, [0, 2], 0, seed=7)
    rt.plan(seq, bt, force="flashinfer")
    out = torch.empty_like(q)
    with pytest.raises(RuntimeError, match="engine_capture=True"):
        graphs.capture(lambda: rt.run(q, *caches[0], out=out))
    g = torch.cuda.CUDAGraph()
    with pytest.raises(RuntimeError, match="engine_capture=True"):
        with torch.cuda.graph(g):
            rt.plan(seq, bt)


@pytest.mark.parametrize("route", ["pkv_bucket", "pkv_workqueue", "pkv_fused", "flashinfer"])
def test_replay_after_inplace_metadata_change(pool, route):
    if route == "flashinfer" and FI_MODULE is None:
        pytest.skip(f"FlashInfer route unavailable: {FI_REASON}")
    b, caches = pool
    rt = runtime()
    for i, short in enumerate([40, 17, 3, 0]):   # same rows and structure, new lengths and q
        seq, bt, q = step_inputs(b, [0, 2, 3], short, seed=50 + i)
        rt.plan(seq, bt, force=route)
        rt.static_q(3).copy_(q)
        rt.static_out(3).fill_(float("nan"))
        out = rt.run(rt.static_q(3), *caches[0], out=rt.static_out(3))
        check(out, q, caches[0], seq, bt, f"replay {i}")
    s = rt.stats()
    # workqueue/fused: the planning graph of the padded batch and the decode graph
    graphs_per_step = 2 if route in ("pkv_workqueue", "pkv_fused") else 1
    assert s["captures"] == graphs_per_step and s["replays"] == 3 * graphs_per_step
    assert s["staging_copies"] == 0


@pytest.mark.parametrize("route", ["pkv_workqueue", "pkv_fused"])
def test_host_lengths_plan_is_built_on_the_gpu_task_for_task(pool, route):
    """Host lengths, a workqueue/fused route: no Python plan (decision.plan is None); the tasks,
    split offsets and task count the planning kernel wrote equal the host planner's
    (Router.full_plan), on ragged steps whose batch changes size; outputs exact."""
    b, caches = pool
    rt = runtime()
    L = rt._layout
    for i, (rows, short) in enumerate(STEPS):
        seq, bt, q = step_inputs(b, rows, short, seed=200 + i)
        d = rt.plan(seq, bt, force=route)
        assert d.route == route and d.plan is None
        twin = rt.router.full_plan(route, seq)
        torch.cuda.synchronize()
        t = int(rt._v_num_tasks[0])
        tasks = rt._arena[L.tasks:L.tasks + 5 * t].view(t, 5).cpu().numpy()
        offsets = rt._arena[L.split_offsets:L.split_offsets + len(rows) + 1].cpu().numpy()
        assert np.array_equal(tasks, twin.tasks), f"step {i}: tasks differ from the host planner's"
        assert np.array_equal(offsets, twin.split_offsets), f"step {i}: split offsets differ"
        assert rt._step.structure == rt._device_grid_tasks(rt.registry.route(route), graphs.padded_batch(len(rows)))
        out = rt.run(q, *caches[0], out=torch.full_like(q, float("nan")))
        check(out, q, caches[0], seq, bt, f"step {i} route {route}")
        assert rt.device_status() == 0
    assert rt.stats()["h2d_copies"] == len(STEPS)   # planning head + block tables: one copy


@pytest.mark.parametrize("route", ["pkv_workqueue", "pkv_fused", None], ids=lambda r: r or "auto")
def test_host_lengths_replay_while_lengths_grow(pool, route):
    """20 steps of 3 rows whose lengths grow one token a step (2 layers, static q/out): a
    workqueue/fused step replays one planning graph and one graph per layer, so captures stay
    at 3 while replays grow by 3 a step; outputs exact at every step. auto: whatever the policy
    picks for these lengths (FlashInfer steps launch eagerly)."""
    b, caches = pool
    rt = runtime()
    decided = set()
    for i in range(20):
        seq, bt, q = step_inputs(b, [0, 1, 2], 40 - 2 * i, seed=300 + i)   # grows 2 a step
        decided.add(rt.plan(seq, bt, force=route).kind)
        rt.static_q(3).copy_(q)
        for layer, cache in enumerate(caches):
            rt.static_out(3).fill_(float("nan"))
            out = rt.run(rt.static_q(3), *cache, out=rt.static_out(3))
            check(out, q, cache, seq, bt, f"step {i} layer {layer}")
    s = rt.stats()
    if decided <= {"workqueue", "fused"}:
        assert s["captures"] == 3 * len(decided) and s["replays"] >= 3 * (20 - len(decided))
    assert s["graphs"] <= s["max_graphs"]


@pytest.mark.parametrize("route", ["pkv_workqueue", "pkv_fused"])
def test_host_lengths_bad_page_ids(pool, route):
    """validate=True: a negative page id among the pages a row uses is refused at plan(), one
    past the cache at run(), both before any launch (out untouched, the previous plan stays).
    validate=False: the planning kernel checks the ids against the cache run() was given: the row
    gets no work, the others are exact, device_status() names it."""
    b, caches = pool
    pages = caches[0][0].shape[0]
    seq, bt, q = step_inputs(b, [0, 2, 3], 0, seed=11)
    used = (int(seq[1]) - 1) // SHAPE["page_size"]
    rt = runtime()
    rt.plan(seq, bt, force=route)
    neg = bt.copy()
    neg[1, used] = -1
    with pytest.raises(ValueError, match=rf"block_tables\[1, {used}\] = -1"):
        rt.plan(seq, neg, force=route)
    out = rt.run(q, *caches[0], out=torch.full_like(q, float("nan")))   # the previous plan
    check(out, q, caches[0], seq, bt, "the plan before the refused one")
    past = bt.copy()
    past[1, used] = pages
    rt.plan(seq, past, force=route)
    out = torch.full_like(q, 5.0)
    with pytest.raises(ValueError, match="page id .* num_pages"):
        rt.run(q, *caches[0], out=out)
    torch.cuda.synchronize()
    assert (out == 5.0).all()

    loose = runtime(validate=False)
    loose.plan(seq, bt, force=route)
    loose.run(q, *caches[0], out=torch.empty_like(q))   # the GPU's bound: this cache's pages
    loose.plan(seq, past, force=route)
    loose.static_q(3).copy_(q)
    loose.static_out(3).fill_(7.0)
    out = loose.run(loose.static_q(3), *caches[0], out=loose.static_out(3))
    torch.cuda.synchronize()
    assert torch.all(out[1] == 7.0)
    check(out[[0, 2]].contiguous(), q[[0, 2]].contiguous(), caches[0], seq[[0, 2]], bt[[0, 2]],
          "rows around a row with a page id past the cache")
    assert loose.device_status(raise_on_error=False) == 4


def test_default_flashinfer_route_runs_eagerly_inside_a_graph_runtime(pool):
    if FI_MODULE is None:
        pytest.skip(f"FlashInfer route unavailable: {FI_REASON}")
    b, caches = pool
    rt = runtime(flashinfer_cuda_graph=False)
    for i, (rows, short) in enumerate(STEPS):
        seq, bt, q = step_inputs(b, rows, short, seed=70 + i)
        rt.plan(seq, bt, force="flashinfer")
        out = rt.run(q, *caches[0], out=torch.full_like(q, float("nan")))
        check(out, q, caches[0], seq, bt, f"step {i}")
    s = rt.stats()
    assert s["captures"] == 0 and s["eager_runs"] == len(STEPS)


@pytest.mark.parametrize("tensor_cores", [True, False], ids=["tensor-cores", "cuda-cores"])
def test_flashinfer_direct_run_is_bitwise_the_wrappers_run(pool, tensor_cores):
    """Eager FlashInfer steps: from the third layer on the Runtime calls FlashInfer's kernel
    entry with the arguments its run() built for the second (fi_route.DirectCall). Over steps
    whose rows join and leave, layers with their own caches and fresh q/out tensors, its output
    is bit for bit the output of FlashInfer's run() at every layer (flashinfer_direct_run=False),
    and with this FlashInfer every step's recording is usable (no fallback), on its tensor-core
    and CUDA-core decode paths (two different compiled entries). The route names FlashInfer's FA2
    backend (fi_route.BACKEND): with FlashInfer 0.7 (the versions the direct calls run with) its
    output is bit for bit that of a wrapper left on FlashInfer's default backend, i.e. the same
    kernel (0.6.0-0.6.3's default picked FA3 on SM90)."""
    if FI_MODULE is None:
        pytest.skip(f"FlashInfer route unavailable: {FI_REASON}")
    b, caches = pool
    kw = dict(flashinfer_cuda_graph=False, flashinfer_tensor_cores=tensor_cores)
    direct, wrapper = runtime(**kw), runtime(**kw, flashinfer_direct_run=False)
    layers = [caches[0], caches[1], caches[0], caches[1]]
    for i, (rows, short) in enumerate(STEPS):
        seq, bt, q = step_inputs(b, rows, short, seed=110 + i)
        for rt in (direct, wrapper):
            rt.plan(seq, bt, force="flashinfer")
        for layer, cache in enumerate(layers):
            ql = q * (1 + 0.25 * layer)
            got = direct.run(ql.clone(), *cache, out=torch.full_like(q, float("nan")))
            want = wrapper.run(ql.clone(), *cache, out=torch.full_like(q, float("nan")))
            torch.cuda.synchronize()
            assert torch.equal(got, want), f"step {i} layer {layer}"
            if layer == 1:
                check(got, ql, cache, seq, bt, f"step {i} layer {layer}")
                default = fi_out(ql, cache, seq, bt, tensor_cores)
                assert torch.equal(got, default), f"step {i}: not FlashInfer's default kernel"
    s = direct.stats()["flashinfer"]
    assert s["direct_calls"] == len(STEPS) * (len(layers) - 2) and s["direct_fallbacks"] == 0
    assert wrapper.stats()["flashinfer"]["direct_calls"] == 0


@pytest.mark.parametrize("graph_mode", [True, False], ids=["fi-graph", "fi-eager"])
def test_flashinfer_route_with_the_host_running_ahead(pool, graph_mode):
    """Steps planned and run while the GPU is still busy (a spin kernel in front), synchronized
    only at the end: every step's output must be its own. Without the route's wait on a
    wrapper's previous plan copy, FlashInfer's pinned schedule buffer is rewritten under the
    pending copy and a step runs another step's schedule (fi_route.FlashInferRoute.plan)."""
    if FI_MODULE is None:
        pytest.skip(f"FlashInfer route unavailable: {FI_REASON}")
    b, caches = pool
    rt = runtime(flashinfer_cuda_graph=graph_mode)
    plan_steps = [([0, 2, 3, 5], 0), ([0, 2, 3, 4], 0), ([0, 2, 3, 5], 9), ([1, 3, 4, 5], 2)] * 2
    for rows, short in plan_steps[:2]:   # warm-up: wrappers built, graphs captured
        seq, bt, q = step_inputs(b, rows, short, seed=1)
        rt.plan(seq, bt, force="flashinfer")
        for cache in caches:
            rt.run(q, *cache, out=torch.empty_like(q))
    torch.cuda.synchronize()
    outs = []
    torch.cuda._sleep(200_000_000)   # ~0.1 s of GPU time: the host runs far ahead
    for i, (rows, short) in enumerate(plan_steps):
        seq, bt, q = step_inputs(b, rows, short, seed=90 + i)
        rt.plan(seq, bt, force="flashinfer")
        for cache in caches + caches:   # eager: layers 3 and 4 call FlashInfer's entry directly
            outs.append((rt.run(q, *cache, out=torch.full_like(q, float("nan"))), q, cache, seq, bt))
    torch.cuda.synchronize()
    for i, (out, q, cache, seq, bt) in enumerate(outs):
        check(out, q, cache, seq, bt, f"run {i} planned ahead of the GPU")


def test_graph_count_stays_bounded_over_many_steps():
    lens = [2000, 1500, 700, 300, 64, 1]
    b = make_batch(lens, **SHAPE, dtype=torch.float16, seed=7)
    cache = (b.k_cache, b.v_cache)
    rt = runtime(max_graphs=4)
    rng = np.random.default_rng(20260624)
    routes = ["pkv_bucket", "pkv_workqueue", "pkv_fused"]
    for i in range(2000):
        rows = sorted(rng.choice(len(lens), size=int(rng.integers(1, len(lens) + 1)), replace=False).tolist())
        seq = np.array([int(rng.integers(1, lens[r] + 1)) for r in rows], dtype=np.int32)
        bt = b.block_tables[rows].cpu().numpy()
        rt.plan(seq, bt, force=routes[i % 3])
        q = rt.static_q(len(rows))
        q.normal_()
        out = rt.run(q, *cache, out=rt.static_out(len(rows)))
        assert rt.stats()["graphs"] <= 4
        if i % 250 == 0:
            torch.cuda.synchronize()
            assert rel_err(out, ref_out(q, cache, seq, bt)) < 2e-3, i
    s = rt.stats()
    assert s["evictions"] > 0 and s["graphs"] <= 4


@pytest.mark.parametrize("bad, match", [
    (lambda t: t.update(q=t["q"][:1]), "q: expected a contiguous"),
    (lambda t: t.update(q=t["q"].float()), "q: expected dtype"),
    (lambda t: t.update(k_cache=t["k_cache"][:10], v_cache=t["v_cache"][:10]), "page id .* num_pages"),
    (lambda t: t.update(v_cache=t["v_cache"][:, :4]), "v_cache: expected"),
    (lambda t: t.update(q=t["q"].cpu()), "q: expected a tensor on cuda"),
])
def test_validation_errors_at_run_leave_out_untouched(pool, bad, match):
    b, caches = pool
    rt = runtime()
    seq, bt, q = step_inputs(b, [0, 1], 0, seed=3)
    rt.plan(seq, bt, force="pkv_workqueue")
    t = dict(q=q, k_cache=caches[0][0], v_cache=caches[0][1], out=torch.full_like(q, 5.0))
    bad(t)
    with pytest.raises(ValueError, match=match):
        rt.run(**t)
    torch.cuda.synchronize()
    assert (t["out"] == 5.0).all()


def test_without_flashinfer_the_policy_falls_back_to_persistentkv(pool):
    b, caches = pool
    rt = runtime(flashinfer=False)
    seq, bt, q = step_inputs(b, [2, 3, 4], 0, seed=9)   # short contexts: the policy says FlashInfer
    d = rt.plan(seq, bt)
    assert d.kind != "flashinfer" and "FlashInfer unavailable" in rt.explain()
    check(rt.run(q, *caches[0]), q, caches[0], seq, bt, "fallback")


def test_an_empty_capture_is_an_error():
    with pytest.raises(RuntimeError, match="empty"):
        graphs.capture(lambda: None, side_stream=torch.cuda.Stream(), pool=None,
                       device=torch.device("cuda", torch.cuda.current_device()))


def test_a_collection_inside_a_capture_waits_until_it_ends(pool, monkeypatch):
    """Dead Runtimes of every route (their graphs, pools and FlashInfer wrappers) wait in a
    reference cycle, so only the cyclic garbage collector frees them. Inside each of a new
    Runtime's captures, the first launch drops the cycle and then collects the way an automatic
    collection would (only when the collector is enabled). A collection inside a capture runs
    those finalizers in it; that failed a planning capture on 2026-12-03 with
    CUDA_ERROR_STREAM_CAPTURE_INVALIDATED. graphs.capture keeps the collector off while it
    captures, so the dead Runtimes are freed after it and every step is exact."""
    b, caches = pool
    dead = []
    for route in ROUTES[:-1]:
        if route == "flashinfer" and FI_MODULE is None:
            continue
        rt = runtime()
        for i, (rows, short) in enumerate(STEPS[:2]):
            seq, bt, q = step_inputs(b, rows, short, seed=400 + i)
            rt.plan(seq, bt, force=route)
            rt.run(q, *caches[0])
        dead.append(rt)
    del rt
    dead.append(dead)               # a cycle: only the collector frees it
    box, launch, inside = [dead], _driver.launch, []
    del dead

    def launch_after_a_collection(kernel, grid, block, params):
        if torch.cuda.is_current_stream_capturing():
            box.clear()             # the cycle is garbage now
            inside.append((kernel.name, gc.isenabled()))
            if gc.isenabled():      # what an automatic collection here would do
                gc.collect()
        launch(kernel, grid, block, params)

    monkeypatch.setattr(_driver, "launch", launch_after_a_collection)
    rt = runtime()
    for route in ["pkv_workqueue", "pkv_bucket", "pkv_fused"]:
        for i, (rows, short) in enumerate(STEPS[:3]):
            seq, bt, q = step_inputs(b, rows, short, seed=410 + i)
            rt.plan(seq, bt, force=route)
            out = rt.run(q, *caches[0], out=torch.full_like(q, float("nan")))
            check(out, q, caches[0], seq, bt, f"{route} step {i}")
    assert inside, "no launch ran inside a capture: nothing was tested"
    assert not any(enabled for _, enabled in inside), f"the collector ran inside a capture: {inside}"
    gc.collect()                    # the dead Runtimes go now, outside any capture
    torch.cuda.synchronize()


@pytest.mark.parametrize("mode", ["graphs", "fi-eager", "engine_capture", "device_planning"])
def test_a_dropped_runtime_is_freed_at_once(pool, mode):
    """A Runtime holds no reference cycle: with the collector off, it (its graphs, pools,
    FlashInfer wrappers) is freed when its last reference goes, after steps of every route in
    each mode, three run() calls a step (fi-eager: the default eager FlashInfer route, whose
    direct call is recorded at a step's second run() and used from the third). An engine that
    drops one then knows when its graphs are destroyed; a cycle would leave that to a
    collection, which may run inside the engine's own capture (see the test above)."""
    b, caches = pool
    kw = {"graphs": {}, "fi-eager": dict(flashinfer_cuda_graph=False),
          "engine_capture": dict(engine_capture=True),
          "device_planning": dict(device_planning=True, use_cuda_graph=False)}[mode]
    routes = ["pkv_workqueue", "pkv_fused"] if mode == "device_planning" else ROUTES
    gc.collect()
    gc.disable()
    try:
        rt = runtime(**kw)
        for route in routes:
            if route == "flashinfer" and FI_MODULE is None:
                continue
            for i, (rows, short) in enumerate(STEPS[:2]):
                seq, bt, q = step_inputs(b, rows, short, seed=420 + i)
                if mode == "device_planning":
                    seq, bt = torch.as_tensor(seq, device="cuda"), torch.as_tensor(bt, device="cuda")
                rt.plan(seq, bt, force=route)
                out = rt.run(q, *caches[0])
                for cache in (caches[1], caches[0]):
                    rt.run(q, *cache, out=out)
        torch.cuda.synchronize()
        ref = weakref.ref(rt)
        del rt
        alive = ref()
        assert alive is None, ("a dropped Runtime is still alive (a reference cycle): held by "
                               f"{sorted({type(r).__name__ for r in gc.get_referrers(alive)})}")
    finally:
        gc.enable()


def test_captured_graphs_have_the_routes_launches(pool):
    b, caches = pool
    rt = runtime()
    seq, bt, q = step_inputs(b, [0, 1], 0, seed=1)   # two long rows, 2 exact buckets
    expect = {"pkv_bucket": None, "pkv_workqueue": 2, "pkv_fused": 1}
    for route, nodes in expect.items():
        d = rt.plan(seq, bt, force=route)
        if nodes is None:   # a decode per bucket, a merge per bucket with splits > 1
            nodes = sum(1 + (bk.num_splits > 1) for bk in d.plan.buckets)
        rt.run(rt.static_q(2), *caches[0], out=rt.static_out(2))
        key = next(k for k in rt._graphs._entries if k[0] == route)
        assert _driver.graph_node_count(rt._graphs.get(key).graph) == nodes, route


@pytest.mark.skipif(FI_MODULE is None, reason=f"FlashInfer unavailable: {FI_REASON}")
def test_the_router_weighs_host_time_at_the_layers_of_the_last_step(pool):
    """The default mode weighs host time (routes.toml [host_time], the H200 calibration's
    host_time) at the run() calls of the last step; engine_capture and FlashInfer's graph mode do
    not (their host time is not what host_time measured)."""
    b, caches = pool
    rt = Runtime(**SHAPE, max_batch=8, max_pages_per_row=b.block_tables.shape[1])
    if rt.calibration.host_time is None:
        pytest.skip(f"{rt.calibration.source} has no host_time")
    assert rt.router.weigh_host and rt.router.host_model is None
    seq, bt, q = step_inputs(b, [2, 3, 4], 0, seed=1)     # every row under the 16K context gate
    out = torch.empty_like(q)
    for layers in (1, 3, 3):
        d = rt.plan(seq, bt)
        for _ in range(layers):
            rt.run(q, *caches[0], out)
    assert d.layers == 3 and set(d.wall_us) >= {"flashinfer", d.route}
    assert rel_err(out, ref_out(q, caches[0], seq, bt)) < 2e-3
    hinted = Runtime(**SHAPE, max_batch=8, max_pages_per_row=b.block_tables.shape[1],
                     options=RuntimeOptions(layers_per_plan=32))
    assert hinted.plan(seq, bt).layers == 32          # the first step, decided at the hint
    for kw in (dict(engine_capture=True), dict(flashinfer_cuda_graph=True), dict(use_cuda_graph=False)):
        other = Runtime(**SHAPE, max_batch=8, max_pages_per_row=b.block_tables.shape[1], **with_options(kw))
        assert not other.router.weigh_host, kw
        assert other.plan(seq, bt).layers == 0
