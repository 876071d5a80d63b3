"""Runtime pieces that run without CUDA: argument checks, graph keys, capacities, staging, the
route choice without FlashInfer, and the clear error of a Runtime built on a machine with no GPU."""

from __future__ import annotations

import importlib.abc
import importlib.util
import pathlib
import sys
import types

import attrs
import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from pkvrt import runtime
from pkvrt.launch import _driver
from pkvrt.policy import fallback
from pkvrt.policy.calibration import load_calibration
from pkvrt.policy.fallback import decide, pkv_route_us
from pkvrt.policy.registry import load_routes
from pkvrt.policy.router import Router
from pkvrt.runtime import fi_route, graphs
from pkvrt.runtime import Runtime, check_run_args, check_shape, check_step
from pkvrt.runtime.graphs import (Capacities, arena_layout, bucket_sections, grow,
                                  initial_capacities, needed_capacities, stage_bucket,
                                  stage_workqueue)

REPO = pathlib.Path(__file__).resolve().parents[1]
SEED = load_calibration(REPO / "calibration" / "rtx3060-seed.json")
ROUTES = load_routes(REPO / "routes.toml")
SHAPE = dict(num_qo_heads=32, num_kv_heads=8, head_dim=128, page_size=16)
STEP = dict(page_size=16, max_batch=8, max_pages_per_row=64)


def router(graphs_on=True) -> Router:
    return Router(ROUTES, SEED, **SHAPE, graphs=graphs_on)


def table(seq, page=16, pad=-1, width=None, seed=0):
    """Block tables of distinct page ids for ``seq``, padding ``pad`` past each row's pages."""
    pages = [-(-n // page) for n in seq]
    w = width or max(pages)
    perm = np.random.default_rng(seed).permutation(sum(pages) * 2).astype(np.int32)
    bt = np.full((len(seq), w), pad, dtype=np.int32)
    at = 0
    for i, p in enumerate(pages):
        bt[i, :p] = perm[at:at + p]
        at += p
    return bt


# ----------------------------------------------------------------------------- construction


@pytest.mark.parametrize("args, name", [
    (dict(head_dim=100), "head_dim"),
    (dict(head_dim=512), "head_dim"),
    (dict(page_size=3), "page_size"),
    (dict(page_size=256), "page_size"),
    (dict(page_size=0), "page_size"),
    (dict(num_qo_heads=30), "num_qo_heads"),            # 30 % 8 != 0
    (dict(num_qo_heads=260, num_kv_heads=4), "group"),   # G = 65
    (dict(num_qo_heads=140, num_kv_heads=2), "group"),   # G = 70
    (dict(num_kv_heads=True), "num_kv_heads"),
    (dict(dtype=torch.float32), "dtype"),
])
def test_check_shape_names_the_argument(args, name):
    kw = dict(SHAPE, dtype=torch.float16)
    kw.update(args)
    with pytest.raises(ValueError, match=name):
        check_shape(kw["num_qo_heads"], kw["num_kv_heads"], kw["head_dim"], kw["page_size"], kw["dtype"])


@pytest.mark.parametrize("g", [1, 2, 4, 8])
@pytest.mark.parametrize("d", [64, 128, 256])
def test_check_shape_accepts_every_built_variant(g, d):
    assert check_shape(8 * g, 8, d, 16, torch.bfloat16) == g


def test_runtime_without_cuda_is_a_clear_error(monkeypatch):
    monkeypatch.setattr(_driver, "available", lambda: "no CUDA GPU visible to torch")
    with pytest.raises(RuntimeError, match="needs a CUDA GPU.*no CUDA GPU visible"):
        Runtime(32, 8, 128, 16)


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks this machine really has no GPU")
def test_runtime_on_this_cpu_machine_raises():
    with pytest.raises(RuntimeError, match="CUDA"):
        Runtime(32, 8, 128, 16)


@pytest.mark.parametrize("kw, name", [
    (dict(head_dim=80), "head_dim"), (dict(max_batch=0), "max_batch"),
    (dict(max_pages_per_row=-1), "max_pages_per_row"), (dict(max_graphs=0), "max_graphs"),
    (dict(dtype=torch.float32), "dtype"), (dict(layers_per_plan=0), "layers_per_plan"),
    (dict(layers_per_plan=True), "layers_per_plan"),
])
def test_runtime_argument_errors_come_before_the_cuda_check(monkeypatch, kw, name):
    monkeypatch.setattr(_driver, "available", lambda: "no GPU")
    args = dict(num_qo_heads=32, num_kv_heads=8, head_dim=128, page_size=16)
    args.update({k: v for k, v in kw.items() if k in args})
    rest = {k: v for k, v in kw.items() if k not in args}
    with pytest.raises(ValueError, match=name):
        Runtime(**args, **with_options(rest))


# ----------------------------------------------------------------------------- plan() checks


@pytest.mark.parametrize("seq, bt, match", [
    ([[5, 6]], None, r"seq_lens: expected a non-empty 1-D"),
    ([], None, r"seq_lens: expected a non-empty 1-D"),
    (np.array([5.0, 6.0]), None, r"seq_lens: expected an integer dtype"),
    ([5, 0, 7], None, r"seq_lens\[1\] = 0: expected >= 1"),
    (list(range(1, 10)), None, r"seq_lens: batch of 9 rows: expected at most max_batch=8"),
    ([5, 6], np.zeros((3, 4), np.int32), r"block_tables: expected shape \[B=2"),
    ([5, 6], np.zeros(4, np.int32), r"block_tables: expected shape \[B=2"),
    ([5, 40], np.zeros((2, 2), np.int32), r"block_tables: row 1 has seq_len 40 = 3 pages .* only 2 columns"),
    ([5, 64 * 16 + 1], np.zeros((2, 80), np.int32), r"seq_lens\[1\] = 1025 needs 65 pages .* max_pages_per_row=64"),
    ([5, 6], np.zeros((2, 1), np.float32), r"block_tables: expected an integer dtype"),
    ([20, 40], np.array([[3, 8, -1], [4, 5, -7]], np.int32), r"block_tables\[1, 2\] = -7: expected a page id >= 0"),
    ([20, 40], np.array([[3, 9, -1], [-4, 5, 6]], np.int32), r"block_tables\[1, 0\] = -4"),
])
def test_check_step_errors_name_the_argument(seq, bt, match):
    if bt is None:
        bt = np.zeros((max(1, len(seq)), 8), np.int32)
    before = np.array(bt, copy=True)
    with pytest.raises(ValueError, match=match):
        check_step(seq, bt, **STEP)
    assert np.array_equal(np.asarray(bt), before)  # inputs never modified


def test_padding_past_a_rows_pages_may_be_negative():
    bt = np.array([[3, 9, -1, -1], [4, -1, -1, -1]], np.int32)   # rows need 2 and 1 pages
    s = check_step([17, 16], bt, **STEP)
    assert s.pages == [2, 1] and s.max_pages == 2 and s.max_page_id == 9


def test_validate_false_skips_only_the_page_id_scan():
    bt = np.array([[3, -5]], np.int32)
    s = check_step([20], bt, **STEP, validate=False)
    assert s.max_page_id == -1
    with pytest.raises(ValueError, match="max_batch"):  # buffer guards stay on
        check_step(list(range(1, 10)), np.zeros((9, 1), np.int32), **STEP, validate=False)


@pytest.mark.parametrize("kind", ["list", "int64", "tensor", "strided-tensor"])
def test_check_step_accepts_host_inputs(kind):
    seq = [17, 1, 300]
    bt = table(seq)
    conv = {"list": lambda a: np.asarray(a).tolist(), "int64": lambda a: np.asarray(a, np.int64),
            "tensor": lambda a: torch.as_tensor(np.asarray(a)),
            "strided-tensor": lambda a: torch.as_tensor(np.asarray(a)).int().t().contiguous().t()}[kind]
    s = check_step(conv(seq), conv(bt), **STEP)
    assert s.seq.tolist() == seq and s.pages == [2, 1, 19]
    assert s.max_page_id == int(max(bt[i, :p].max() for i, p in enumerate([2, 1, 19])))


@settings(max_examples=100, deadline=None)
@given(st.lists(st.integers(1, 600), min_size=1, max_size=8), st.integers(0, 5),
       st.sampled_from([np.int32, np.int64, np.int16, np.uint32]), st.data())
def test_check_step_property(seq, extra, dtype, data):
    bt = table(seq, width=max(-(-n // 16) for n in seq) + extra, seed=len(seq)).astype(dtype)
    pages = [-(-n // 16) for n in seq]
    info = np.iinfo(dtype)  # padding may hold anything, the extremes included: it is never read
    for r, p in enumerate(pages):
        bt[r, p:] = data.draw(st.lists(st.sampled_from([info.min, info.max, max(info.min, -1), 0, 7]),
                                       min_size=bt.shape[1] - p, max_size=bt.shape[1] - p))
    s = check_step(seq, bt, **STEP)
    assert s.pages == pages and s.max_pages == max(pages)
    assert s.max_page_id == max(int(bt[i, :p].max()) for i, p in enumerate(pages))
    if info.min == 0:
        return
    bad = bt.copy()
    for _ in range(data.draw(st.integers(1, 3))):
        r = data.draw(st.integers(0, len(seq) - 1))
        bad[r, data.draw(st.integers(0, pages[r] - 1))] = data.draw(st.sampled_from([-3, info.min]))
    r, c = min((r, c) for r, p in enumerate(pages) for c in range(p) if bad[r, c] < 0)  # the first
    with pytest.raises(ValueError, match=rf"block_tables\[{r}, {c}\] = {bad[r, c]}: expected"):
        check_step(seq, bad, **STEP)


# ----------------------------------------------------------------------------- run() checks


def run_tensors(b=3, pages=10):
    q = torch.randn(b, 32, 128).half()
    k = torch.randn(pages, 8, 16, 128).half()
    return dict(q=q, k_cache=k, v_cache=k.clone(), out=torch.full_like(q, 7.0))


RUN_KW = dict(batch=3, num_qo_heads=32, num_kv_heads=8, head_dim=128, page_size=16,
              dtype=torch.float16, device=torch.device("cpu"))


@pytest.mark.parametrize("change, name", [
    (lambda t: t.update(q=t["q"].float()), "q: expected dtype"),
    (lambda t: t.update(q=t["q"][:2]), r"q: expected a contiguous \[B, H_q, D\] = \(3, 32, 128\)"),
    (lambda t: t.update(q=t["q"].transpose(0, 1).contiguous().transpose(0, 1)), "q: .*not contiguous"),
    (lambda t: t.update(q=torch.randn(3, 16, 128).half()), "q: expected a contiguous"),
    (lambda t: t.update(k_cache=torch.randn(10, 8, 32, 128).half()), "k_cache: expected .*page_size=16"),
    (lambda t: t.update(k_cache=torch.randn(10, 4, 16, 128).half()), "k_cache: expected .*H_kv=8"),
    (lambda t: t.update(k_cache=torch.randn(10, 8, 16, 132).half()[..., :128]), "k_cache: expected contiguous"),
    (lambda t: t.update(v_cache=torch.randn(12, 8, 16, 128).half()), "v_cache: expected the shape of k_cache"),
    (lambda t: t.update(v_cache=t["v_cache"].bfloat16()), "v_cache: expected dtype"),
    (lambda t: t.update(out=torch.zeros(4, 32, 128).half()), "out: expected a contiguous"),
    (lambda t: t.update(out=torch.zeros(3, 32, 128)), "out: expected dtype"),
    (lambda t: t.update(q=np.zeros((3, 32, 128))), "q: expected a torch.Tensor"),
])
def test_check_run_args_errors_name_the_tensor_and_leave_out_untouched(change, name):
    t = run_tensors()
    check_run_args(**t, **RUN_KW)  # the base case passes
    change(t)
    out_before = t["out"].clone()
    with pytest.raises(ValueError, match=name):
        check_run_args(**t, **RUN_KW)
    assert torch.equal(t["out"], out_before)


def test_check_run_args_page_ids_against_the_cache():
    t = run_tensors(pages=10)
    check_run_args(**t, **RUN_KW, max_page_id=9)
    with pytest.raises(ValueError, match=r"page id 10: expected page ids < num_pages = k_cache.shape\[0\] = 10"):
        check_run_args(**t, **RUN_KW, max_page_id=10)


def test_check_run_args_wrong_device():
    t = run_tensors()
    with pytest.raises(ValueError, match="q: expected a tensor on cuda:0"):
        check_run_args(**t, **dict(RUN_KW, device=torch.device("cuda", 0)))


# ----------------------------------------------------------------------------- graph keys


@pytest.mark.parametrize("b, p", [(1, 1), (2, 2), (3, 4), (5, 8), (8, 8), (9, 16), (256, 256), (257, 512)])
def test_padded_batch(b, p):
    assert graphs.padded_batch(b) == p


@settings(max_examples=200, deadline=None)
@given(st.integers(1, 10**6))
def test_task_bucket_bounds(t):
    cap = graphs.task_bucket(t)
    assert t <= cap <= max(t, 1.25 * t + 1) and cap <= graphs.task_bucket(t + 1)
    if t >= 4:  # at most 4 distinct capacities per power of two
        lo = 1 << (t.bit_length() - 1)
        assert len({graphs.task_bucket(x) for x in range(lo, 2 * lo, max(1, lo // 64))}) <= 5


def test_task_bucket_examples():
    assert [graphs.task_bucket(t) for t in (1, 3, 1024, 1280, 1300, 4096, 4097)] == [1, 3, 1024, 1280, 1536, 4096, 5120]


def test_graph_key_changes_with_what_a_graph_bakes_in():
    k = torch.zeros(10, 8, 16, 128, dtype=torch.float16)
    q = torch.zeros(4, 32, 128, dtype=torch.float16)
    kv = (graphs.tensor_key(k), graphs.tensor_key(k))
    qo = (graphs.tensor_key(q), graphs.tensor_key(q))
    base = graphs.graph_key("pkv_bucket", "bucket", 4, ((4, 16),), 0, kv, qo)
    assert base == graphs.graph_key("pkv_bucket", "bucket", 4, ((4, 16),), 0,
                                    (graphs.tensor_key(k), graphs.tensor_key(k)), qo)
    variants = [
        graphs.graph_key("pkv_bucket", "bucket", 8, ((4, 16),), 0, kv, qo),            # batch
        graphs.graph_key("pkv_bucket", "bucket", 4, ((4, 8),), 0, kv, qo),             # splits
        graphs.graph_key("pkv_bucket", "bucket", 4, ((2, 16), (2, 16)), 0, kv, qo),    # buckets
        graphs.graph_key("pkv_bucket", "bucket", 4, ((4, 16),), 1, kv, qo),            # generation
        graphs.graph_key("pkv_bucket", "bucket", 4, ((4, 16),), 0, kv, graphs.STATIC),
        graphs.graph_key("pkv_bucket", "bucket", 4, ((4, 16),), 0,
                         (graphs.tensor_key(k[1:]), graphs.tensor_key(k)), qo),        # pointer
        graphs.graph_key("pkv_bucket", "bucket", 4, ((4, 16),), 0,
                         (graphs.tensor_key(k[:9]), graphs.tensor_key(k)), qo),        # shape
        graphs.graph_key("pkv_bucket", "bucket", 4, ((4, 16),), 0,
                         (graphs.tensor_key(k.view(torch.bfloat16)), graphs.tensor_key(k)), qo),  # dtype
        graphs.graph_key("pkv_bucket", "bucket", 4, ((4, 16),), 0,
                         (graphs.tensor_key(k.transpose(0, 1)), graphs.tensor_key(k)), qo),  # strides
    ]
    assert len({base, *variants}) == len(variants) + 1


class FakeGraph:
    def __init__(self):
        self.resets = 0

    def reset(self):
        self.resets += 1


def test_graph_cache_is_a_bounded_lru():
    c = graphs.GraphCache(3)
    made = {k: graphs.GraphEntry(FakeGraph(), nodes=k + 1, mem_bytes=10 * k) for k in range(5)}
    for k in range(3):
        c.put(k, made[k])
    assert c.get(0) is made[0]               # 0 becomes most recent: 1 is now the oldest
    c.put(3, made[3])
    assert 1 not in c and made[1].graph.resets == 1 and c.evictions == 1
    c.put(4, made[4])
    assert 2 not in c and len(c) == 3 and c.evictions == 2
    assert sorted(c.node_counts()) == [1, 4, 5] and c.memory_bytes() == 0 + 30 + 40
    c.clear()
    assert len(c) == 0 and c.invalidations == 3 and all(made[k].graph.resets == 1 for k in (0, 3, 4))
    with pytest.raises(ValueError, match="max_graphs"):
        graphs.GraphCache(0)


@settings(max_examples=50, deadline=None)
@given(st.integers(1, 6), st.lists(st.integers(0, 12), max_size=200))
def test_graph_cache_never_exceeds_its_bound(bound, keys):
    c, made = graphs.GraphCache(bound), []
    for k in keys:
        if c.get(k) is None:
            e = graphs.GraphEntry(FakeGraph(), 1, 0)
            c.put(k, e)
            made.append((k, e))
        assert len(c) <= bound
    live = {id(c.get(k)) for k, _ in made if k in c}
    assert all(e.graph.resets == (0 if id(e) in live else 1) for _, e in made)
    assert c.evictions == len(made) - len(live)


def test_seen_keys():
    s = graphs.SeenKeys(2)
    assert [s.check_and_add(k) for k in ("a", "a", "b", "c", "a", "c")] == [False, True, False, False, False, True]


# ----------------------------------------------------------------------------- capacities


def test_initial_capacities_of_the_seed_routes():
    assert initial_capacities(ROUTES, max_batch=256, num_kv_heads=8) == Capacities(slots=512, tasks=4096)
    assert initial_capacities(ROUTES, max_batch=3, num_kv_heads=8) == Capacities(slots=256, tasks=2048)


@pytest.mark.parametrize("cur, need, new", [(512, 100, 512), (512, 512, 512), (512, 513, 1024), (512, 5000, 5000)])
def test_grow(cur, need, new):
    assert grow(cur, need) == new


@pytest.mark.parametrize("route", ["pkv_bucket", "pkv_workqueue", "pkv_fused"])
@pytest.mark.parametrize("seq", [[40000], [20000, 3000, 20000], [17000] * 8, [30000] * 32, list(range(100, 3300, 100))])
def test_needed_capacities_cover_the_plan(route, seq):
    d = router().decide(seq, force=route)
    need = needed_capacities(d.kind, d.plan)
    if d.kind == "bucket":
        for b in d.plan.buckets:
            if b.num_splits > 1:  # ops.split_decode needs rows * splits slots
                assert need.slots >= graphs.padded_batch(b.rows.size) * b.num_splits
    else:
        assert need.slots == d.plan.split_offsets[-1] and need.tasks >= d.plan.tasks.shape[0]
    init = initial_capacities(ROUTES, max_batch=256, num_kv_heads=8)
    fits = need.slots <= init.slots and need.tasks <= init.tasks
    assert fits or len(seq) > 8  # within the gates' 8 rows the initial buffers suffice


# ----------------------------------------------------------------------------- staging


@settings(max_examples=40, deadline=None)
@given(st.integers(1, 300), st.integers(1, 10**5))
def test_arena_layout_sections_are_disjoint_and_aligned(max_batch, tasks):
    L = arena_layout(max_batch, tasks)
    starts = [L.seq_lens, L.split_offsets, L.num_tasks, L.row_ids, L.merge_offsets, L.tasks]
    sizes = [max_batch, graphs.padded_batch(max_batch) + 1, 1, 2 * max_batch, 2 * max_batch, 5 * tasks]
    assert all(s % graphs.ALIGN == 0 for s in starts)
    assert all(a + n <= b for a, n, b in zip(starts, sizes, starts[1:] + [L.size]))


@settings(max_examples=60, deadline=None)
@given(st.lists(st.sampled_from([17000, 17001, 20000, 3000, 45, 1]), min_size=1, max_size=64))
def test_stage_bucket_pads_rows_and_writes_merge_offsets(seq):
    d = router().decide(seq, force="pkv_bucket")
    L = arena_layout(64, 16)
    arena = np.full(L.size, 12345, dtype=np.int32)
    structure, used = stage_bucket(arena, L, d.plan)
    assert structure == tuple((graphs.padded_batch(b.rows.size), b.num_splits) for b in d.plan.buckets)
    seen = []
    for (roff, pad, s, moff), b in zip(bucket_sections(L, structure), d.plan.buckets):
        n = b.rows.size
        assert arena[roff:roff + n].tolist() == b.rows.tolist()
        assert (arena[roff + n:roff + pad] == -1).all()
        seen += b.rows.tolist()
        if s > 1:
            assert arena[moff:moff + pad + 1].tolist() == [i * s for i in range(pad + 1)]
            assert moff + pad + 1 <= L.tasks and moff + pad + 1 <= used
        else:
            assert moff is None
        assert roff + pad <= L.merge_offsets and roff + pad <= used
    assert sorted(seen) == list(range(len(seq)))
    assert (arena[used:] == 12345).all()  # nothing written past what is copied


@settings(max_examples=60, deadline=None)
@given(st.lists(st.integers(1, 70000), min_size=1, max_size=16))
def test_stage_workqueue_pads_offsets_and_counts_tasks(seq):
    d = router().decide(seq, force="pkv_workqueue")
    t = d.plan.tasks.shape[0]
    L = arena_layout(16, graphs.task_bucket(t))
    arena = np.full(L.size, 12345, dtype=np.int32)
    cap, used = stage_workqueue(arena, L, d.plan, len(seq))
    b, gb = len(seq), graphs.padded_batch(len(seq))
    off = arena[L.split_offsets:L.split_offsets + gb + 1]
    assert off[:b + 1].tolist() == d.plan.split_offsets.tolist()
    assert (off[b + 1:] == d.plan.split_offsets[-1]).all()     # padded rows: zero slots
    assert arena[L.num_tasks] == t and cap == graphs.task_bucket(t) >= t
    assert np.array_equal(arena[L.tasks:used].reshape(t, 5), d.plan.tasks)
    with pytest.raises(ValueError, match="grow it first"):
        stage_workqueue(arena, arena_layout(16, cap - 1), d.plan, len(seq))


# ----------------------------------------------------------------------------- without FlashInfer


def test_route_choice_without_flashinfer_takes_the_best_persistentkv_route():
    r = router()
    seq = np.array([1000, 2000, 500])  # short contexts: the policy sends this to FlashInfer
    assert r.decide(seq).kind == "flashinfer"
    d = decide(r, seq, table(seq), flashinfer_unavailable="flashinfer failed to import (ImportError)")
    assert d.kind != "flashinfer"
    non_ablation = [x for x in ROUTES.routes if x.kind != "flashinfer" and not x.ablation]
    best = min(non_ablation, key=lambda x: pkv_route_us(r, x, seq))
    assert d.route == best.name and not d.forced
    assert "FlashInfer unavailable (flashinfer failed to import" in d.refused["flashinfer"]
    assert "FlashInfer unavailable" in d.explain()


def test_route_choice_without_flashinfer_remembers_its_fallback(monkeypatch):
    """With a fallback memo, a step whose router memo key was seen predicts nothing: the route
    of the first step with that key is taken again (as the router's own memo does)."""
    r = Router(ROUTES, SEED, **SHAPE, memo_size=16, device_plan_kinds=("workqueue", "fused"))
    memo, calls = {}, []
    real = fallback.pkv_route_us
    monkeypatch.setattr(fallback, "pkv_route_us", lambda *a: calls.append(a[1].name) or real(*a))
    seq = np.array([1000, 2000, 500])
    first = decide(r, seq, table(seq), flashinfer_unavailable="not installed", fallback_memo=memo)
    assert calls and len(memo) == 1
    calls.clear()
    again = decide(r, seq + 1, table(seq + 1), flashinfer_unavailable="not installed", fallback_memo=memo)
    assert calls == [] and again.route == first.route and again.reused
    assert "FlashInfer unavailable" in again.refused["flashinfer"]


def test_route_choice_with_flashinfer_is_the_routers():
    r = router()
    seq = np.array([1000, 2000])
    assert decide(r, seq, table(seq)).route == r.decide(seq).route == "flashinfer"
    assert decide(r, seq, table(seq), force="pkv_fused").route == "pkv_fused"


def test_forcing_an_unavailable_flashinfer_names_force():
    with pytest.raises(ValueError, match="force='flashinfer': the FlashInfer route is unavailable"):
        decide(router(), [100], table([100]), force="flashinfer", flashinfer_unavailable="not installed")


def test_load_flashinfer_reports_a_missing_module(monkeypatch):
    monkeypatch.setitem(sys.modules, "flashinfer", None)   # import flashinfer -> ModuleNotFoundError
    mod, reason = fi_route.load_flashinfer()
    assert mod is None and reason.startswith("flashinfer failed to import (ModuleNotFoundError")


class _BrokenImport(importlib.abc.MetaPathFinder, importlib.abc.Loader):
    """Makes ``import flashinfer`` raise what a broken install raises (not an ImportError)."""

    def find_spec(self, name, path, target=None):
        return importlib.util.spec_from_loader(name, self) if name == "flashinfer" else None

    def create_module(self, spec):
        return None

    def exec_module(self, module):
        raise OSError("libcudart.so.13: cannot open shared object file")


def test_load_flashinfer_reports_a_broken_install(monkeypatch):
    monkeypatch.delitem(sys.modules, "flashinfer", raising=False)
    monkeypatch.setattr(sys, "meta_path", [_BrokenImport(), *sys.meta_path])
    mod, reason = fi_route.load_flashinfer()
    assert mod is None and reason == ("flashinfer failed to import (OSError: libcudart.so.13: cannot "
                                      "open shared object file)")


def test_load_flashinfer_reports_a_wrong_version(monkeypatch):
    fake = types.ModuleType("flashinfer")
    fake.__version__ = "0.1.0"
    monkeypatch.setitem(sys.modules, "flashinfer", fake)
    mod, reason = fi_route.load_flashinfer()
    assert mod is None and "flashinfer 0.1.0 has no BatchDecodeWithPagedKVCacheWrapper" in reason


# ----------------------------------------------------------------------------- host cost


def test_bench_check_step_b8_32k(benchmark):
    seq = np.array([32768, 2048, 3072, 4096, 32000, 1024, 2560, 3584], dtype=np.int32)
    bt = table(seq.tolist())
    s = benchmark(check_step, seq, bt, page_size=16, max_batch=256, max_pages_per_row=8192)
    assert s.max_pages == 2048


def test_bench_stage_workqueue_b8(benchmark):
    seq = [32768, 2048, 3072, 4096, 32000, 1024, 2560, 3584]
    d = router().decide(seq, force="pkv_workqueue")
    L = arena_layout(256, 4096)
    arena = np.zeros(L.size, dtype=np.int32)
    cap, used = benchmark(stage_workqueue, arena, L, d.plan, 8)
    assert used == L.tasks + 5 * d.plan.tasks.shape[0]


# ----------------------------------------------------------------------------- fake device
#
# A real Runtime driven on the CPU: the device is "cpu", pinned buffers are plain, the kernels
# are emulated in FP32 from pkvrt.reference (same grids, slots, idle-slot exits and checks as
# kernels/*.cu), and a "graph" remembers the launch closure it captured and reruns it on replay,
# which is what a CUDA graph does: the buffers it was given are baked in, their contents are
# read at replay time. This checks plan()/run() end to end: validation, staging into the arena
# and block tables, launch views, padded batches, graph keys, replay after new metadata, the
# static/staging/caller paths, regrowth, the graph bound, the FlashInfer fallback.

import contextlib  # noqa: E402
import functools  # noqa: E402
import math  # noqa: E402

from paged import make_batch, rel_err  # noqa: E402

from pkvrt import reference  # noqa: E402
from pkvrt.launch import ops  # noqa: E402
from pkvrt.policy import sharing  # noqa: E402
from pkvrt.runtime.options import with_options  # noqa: E402

TILE = 32


class Emu:
    """Emulated kernels with launch counters."""

    def __init__(self):
        self.launches = 0
        self.direct = 0   # planning launches in direct mode (they copied the step's inputs)
        self.prepared = 0   # planning launches prepared (ops.PreparedLaunch), each run later
        self.early = []   # early_kv of every workqueue launch
        self.two_level = []   # whether each workqueue launch was given the two-level tail's counters
        # decode CTAs resident per SM by (family, head_dim): 2 everywhere unless a test sets some
        self.occupancy: dict[tuple[str, int], int] = {}

    def decode_occupancy(self, family, dtype, head_dim, group, kv_dtype=None):
        return self.occupancy.get((family, head_dim), 2)

    @staticmethod
    def _kv(cache, bt_row, n, scale=None):
        """The row's tokens, dequantized (FP8 caches: element * scale of its KV head)."""
        npages = -(-n // cache.shape[2])
        ids = bt_row[:npages]
        assert int(ids.min()) >= 0 and int(ids.max()) < cache.shape[0], "read a page it must not"
        return reference.dequantize_kv(reference.gather_kv(cache, bt_row, n), scale)

    @staticmethod
    def _finish(out, lse, row, heads, m, l, a, sinks):
        """O (and lse) of one row's heads from a finished state, as the kernels write them."""
        o, ls = reference.merge_states(m[None], l[None], a[None], None if sinks is None else sinks[heads],
                                       return_lse=True)
        out[row, heads] = o.to(out.dtype)
        if lse is not None:
            lse[row, heads] = ls

    def split_decode(self, q, k, v, seq, bt, row_ids, s, out, pa=None, pm=None, sm_scale=None, *,
                     k_scale=None, v_scale=None, window_left=-1, logits_soft_cap=0.0, sinks=None,
                     lse=None):
        ops.check_kv_scales(k, v, k_scale, v_scale, q=q, out=out)   # the wrapper's first check
        self.launches += 1
        if s > 1 and pa.shape[0] < row_ids.shape[0] * s:
            raise ops.KernelArgumentError("part_a too small")
        scale = sm_scale or 1 / math.sqrt(q.shape[2])
        for z, row in enumerate(row_ids.tolist()):
            if row < 0:
                continue
            n = int(seq[row])
            start = reference.window_start(n, window_left)
            kk, vv = self._kv(k, bt[row], n, k_scale), self._kv(v, bt[row], n, v_scale)
            per = -(-(-(-(n - start) // TILE)) // s)
            for j in range(s):
                b, e = min(n, start + j * per * TILE), min(n, start + (j + 1) * per * TILE)
                m, l, a = reference.split_state(q[row], kk[:, b:e], vv[:, b:e], scale, logits_soft_cap)
                if s == 1:
                    self._finish(out, lse, row, slice(None), m, l, a, sinks)
                else:
                    pa[z * s + j], pm[z * s + j, :, 0], pm[z * s + j, :, 1] = a, m, l

    def merge(self, pa, pm, offsets, out, *, row_ids=None, skip_single=False, sinks=None, lse=None):
        self.launches += 1
        off = offsets.tolist()
        for r in range(len(off) - 1):
            orow = r if row_ids is None else int(row_ids[r])
            b, e = off[r], off[r + 1]
            if orow < 0 or e - b <= 0 or (skip_single and e - b == 1):
                continue
            o, ls = reference.merge_states(pm[b:e, :, 0], pm[b:e, :, 1], pa[b:e], sinks, return_lse=True)
            out[orow] = o.to(out.dtype)
            if lse is not None:
                lse[orow] = ls

    def merge_segments(self, out_a, lse_a, out_b, lse_b, slots, out, *, group, chunk_rows,
                       sinks=None, lse=None):
        """kernels/merge.cu merge_segments: each row's states, gathered by their slots from the
        chunk states (chunk v's row c at heads hk * C * G + c * G + j) and the own states."""
        self.launches += 1
        b, hq, d = out.shape
        va, hkv = out_a.shape[0], hq // group
        sa = out_a.view(va, hkv, chunk_rows, group, d).permute(0, 2, 1, 3, 4).reshape(-1, hq, d)
        la = lse_a.view(va, hkv, chunk_rows, group).permute(0, 2, 1, 3).reshape(-1, hq)
        states, lses = torch.cat([sa.float(), out_b.float()]), torch.cat([la, lse_b])
        for r in range(b):
            ks = [int(x) for x in slots[r] if 0 <= int(x) < states.shape[0]]
            if not ks:   # no state (an idle row): the kernel writes zeros, lse -inf
                out[r] = 0
                if lse is not None:
                    lse[r] = float("-inf")
                continue
            o, ls = reference.merge_states(lses[ks], torch.ones_like(lses[ks]), states[ks], sinks,
                                           return_lse=True)
            out[r] = o.to(out.dtype)
            if lse is not None:
                lse[r] = ls

    def workqueue_decode(self, q, k, v, seq, bt, tasks, num_tasks, offsets, out, pa, pm,
                         sm_scale=None, counters=None, early_kv=False, *, k_scale=None, v_scale=None,
                         logits_soft_cap=0.0, sinks=None, lse=None, group_counters=None,
                         merge_groups_from=0):
        ops.check_kv_scales(k, v, k_scale, v_scale, q=q, out=out)   # the wrapper's first check
        self.launches += 1
        self.early.append(bool(early_kv))
        self.two_level.append(group_counters is not None)
        if group_counters is not None:   # the two-level tail's counters: a slot's per KV head, zero
            assert counters is not None and (merge_groups_from == 0 or merge_groups_from >= 2)
            assert group_counters.dtype == torch.int32 and group_counters.shape[1] == k.shape[1]
            assert group_counters.shape[0] >= pa.shape[0] and not group_counters.any()
        scale = sm_scale or 1 / math.sqrt(q.shape[2])
        g = q.shape[1] // k.shape[1]
        t = int(num_tasks[0])
        assert t <= tasks.shape[0], "num_tasks beyond the captured grid"
        merged = set()
        for row, kvh, split, b, e in tasks[:t].tolist():
            n = int(seq[row])
            assert 0 <= b < e <= n
            first, ns = int(offsets[row]), int(offsets[row + 1] - offsets[row])
            kk, vv = self._kv(k, bt[row], n, k_scale), self._kv(v, bt[row], n, v_scale)
            h = slice(kvh * g, kvh * g + g)
            m, l, a = reference.split_state(q[row, h], kk[kvh:kvh + 1, b:e], vv[kvh:kvh + 1, b:e], scale,
                                            logits_soft_cap)
            if ns == 1:
                self._finish(out, lse, row, h, m, l, a, sinks)
            else:
                pa[first + split, h], pm[first + split, h, 0], pm[first + split, h, 1] = a, m, l
                merged.add(row)
        if counters is not None:  # fused: the last CTA of each (row, kvh) merges in-kernel
            for row in merged:
                b, e = int(offsets[row]), int(offsets[row + 1])
                o, ls = reference.merge_states(pm[b:e, :, 0], pm[b:e, :, 1], pa[b:e], sinks, return_lse=True)
                out[row] = o.to(out.dtype)
                if lse is not None:
                    lse[row] = ls

    def find_shared(self, seq_lens, block_tables, chunk_seq, chunk_bt, own_seq, own_bt, q_index,
                    slots, *, page_size, chunk_rows, group, num_kv_heads, rule=None,
                    candidates=None, rule_out=None, split_pin=None):
        """kernels/find_shared.cu: its twin's outputs (sharing.plan_prefix_chunks, which
        tests/gpu/test_sharing.py checks against the kernel), the q gather indices of each
        chunk position (past a chunk's rows its first row; row 0 for no chunk), and the rule's
        decision as the kernel writes it."""
        self.launches += 1
        if rule is not None:   # what ops.find_shared refuses
            for t, n in zip(candidates, (len(rule.row.splits.candidates()), len(rule.chunk.splits.candidates()))):
                assert t.dtype == torch.int32 and tuple(t.shape) == (n,)
            assert not (rule.model_cut_rows > 0 and split_pin is None), "a model cut needs split_pin"
        found = sharing.plan_prefix_chunks(seq_lens.numpy(), block_tables.numpy(), page_size,
                                           chunk_rows, rule=rule)
        if rule_out is not None:
            d = found.decision
            chunks = bool((found.slots[:, 0] >= 0).any())
            rule_out[:] = torch.tensor([0, 0, 1 if chunks else -1, 0, 0, 0], dtype=torch.float64) if d is None \
                else torch.tensor([d.plain_us, d.shared_us, float(d.shared), d.plain_rereads,
                                   d.chunk_rereads, d.chunk_splits], dtype=torch.float64)
        b, w = block_tables.shape
        chunk_seq[:] = torch.as_tensor(found.chunk_seq)
        own_seq[:] = torch.as_tensor(found.own_seq)
        for r in range(b):
            n = -(-int(found.chunk_seq[r]) // page_size)
            chunk_bt[r, :n] = torch.as_tensor(found.chunk_bt[r, :n])
            if 1 <= int(seq_lens[r]) <= w * page_size:
                k = -(-int(found.own_seq[r]) // page_size)
                own_bt[r, :k] = torch.as_tensor(found.own_bt[r, :k])
        slots[:] = torch.as_tensor(found.slots)
        q_index[:] = torch.as_tensor(found.q_index(num_kv_heads, group))
        if split_pin is not None:   # written every launch: the model's cut where the step shares
            d = found.decision
            split_pin[0] = d.chunk_splits if d is not None and d.shared else 0

    def plan_workqueue_device(self, seq_lens, num_rows, tasks, num_tasks, split_offsets, num_splits,
                              status, candidates, *, num_kv_heads, min_split_tiles, sms, resident,
                              slowdown8, overhead8, max_ctas, max_seq_len=None, free_slots=0,
                              room_slots=0, room8=0, room_chunk=0, block_tables=None,
                              num_pages=None, page_size=None, src_seq_lens=None,
                              src_block_tables=None, rows=None, max_seq=None, window_left=-1,
                              src_indptr=None, src_last_page_len=None, split_pin=None, prepare=False):
        """The planning kernel's balanced partition written out again in plain loops (candidate
        chunks from the longest row, cost = max(waves of big CTAs + the small ones beside them,
        average load at the best throughput), chosen at the least cost + the last wave's room
        charge), tasks in the host's order (rows by decreasing
        tokens per split, then split, then KV head); rows with a bad length or a page id outside
        [0, num_pages) get no work. Refuses what ops.plan_workqueue_device refuses: a block
        table of fewer rows than seq_lens. A sliding window plans each row's attended range
        (its window's tiles and pages; task ranges offset by the window start). CSR direct mode
        (src_indptr): each row's length from its pages and last page, a bad indptr or last page
        a bad length, its pages copied from the indices at the row's offset. ``split_pin`` > 0
        (read when it runs): that one count in place of the candidates. ``prepare``: the
        same call, made later (ops.PreparedLaunch's contract: the tensors are read when it runs)."""
        kw = {k: v for k, v in locals().items() if k not in ("self", "prepare")}
        max_rows = seq_lens.shape[0]
        if block_tables is not None and block_tables.shape[0] < max_rows:
            raise ops.KernelArgumentError(f"block_tables: expected [>= {max_rows}, W], got "
                                          f"{tuple(block_tables.shape)}")
        ops.check_plan_direct_args(max_rows, block_tables, page_size, src_seq_lens, src_block_tables,
                                   rows, max_seq, src_indptr, src_last_page_len)   # as the wrapper
        if prepare:   # checked now, as the wrapper checks at preparation
            self.prepared += 1
            return functools.partial(self.plan_workqueue_device, **kw)
        self.launches += 1
        rows = min(int(num_rows[0]) if rows is None else rows, max_rows)
        max_len = max_seq if max_seq is not None else \
            ops.MAX_SEQ_LEN if max_seq_len is None else int(max_seq_len[0])   # None: the wrapper's default
        bound = int(num_pages[0]) if block_tables is not None else 0
        if src_seq_lens is not None:   # direct mode: the kernel copies what it reads
            self.direct += 1
            seq_lens[:rows] = src_seq_lens[:rows]
        offset = [r * (src_block_tables.shape[1] if src_block_tables is not None
                       and src_block_tables.dim() == 2 else 0) for r in range(rows)]
        if src_indptr is not None:   # CSR direct mode: the lengths from the pages
            self.direct += 1
            n_ind = src_block_tables.shape[0]
            for r in range(rows):
                lo, hi, last = int(src_indptr[r]), int(src_indptr[r + 1]), int(src_last_page_len[r])
                pages = hi - lo
                bad = lo < 0 or pages < 0 or hi > n_ind or (pages > 0 and not 1 <= last <= page_size)
                n = (pages - 1) * page_size + last if pages > 0 else 0
                seq_lens[r] = -1 if bad or n > max_len else n
                offset[r] = lo
        start = [0] * max_rows
        for r in range(rows):
            n = int(seq_lens[r])
            start[r] = reference.window_start(n, window_left) if 1 <= n <= max_len else 0
        if src_block_tables is not None:
            flat = src_block_tables.reshape(-1)
            for r in range(rows):
                n = int(seq_lens[r])
                if 1 <= n <= max_len:
                    p0, w = start[r] // page_size, -(-n // page_size)
                    block_tables[r, p0:w] = flat[offset[r] + p0:offset[r] + w]
        tiles, bad, bad_page = [0] * max_rows, False, False
        for r in range(rows):
            n = int(seq_lens[r])
            if n == 0:   # an idle row (an engine's padding): no work, not flagged
                continue
            if not 1 <= n <= max_len:
                bad = True
            elif bound and not all(0 <= int(x) < bound
                                   for x in block_tables[r, start[r] // page_size:-(-n // page_size)]):
                bad_page = True
            else:
                tiles[r] = -(-(n - start[r]) // TILE)
        longest, total = max(tiles), sum(tiles)
        if split_pin is not None and int(split_pin[0]) > 0:
            candidates = split_pin
        cands = [c for c in candidates.tolist() if longest and -(-longest // c) >= min_split_tiles]
        cands = cands or [max(1, longest // min_split_tiles)]
        cands_ok = []   # (not roomy, cost, ctas, index, chunk) of the eligible candidates
        for i, s_ in enumerate(cands):
            c = -(-longest // s_) if longest else 1
            n_all = n_big = small = 0
            for t in tiles:
                if t:
                    n = -(-t // c)
                    n_all += n
                    if 2 * -(-t // n) > c:
                        n_big += n
                    else:
                        small += t
            ctas = num_kv_heads * n_all
            big, wave = num_kv_heads * n_big, resident * sms
            load = lambda k: 8 + (k - 1) * (slowdown8 - 8)  # noqa: E731
            loads = big // wave * load(resident) + (load(-(-(big % wave) // sms)) if big % wave else 0)
            beside = (8 * num_kv_heads * small + (ctas - big) * overhead8) * (slowdown8 - 8)
            work = 8 * num_kv_heads * total + ctas * overhead8
            floor = work * load(resident) // resident if ctas > sms else work * 8
            cost = max((8 * c + overhead8) * loads * sms + beside, floor)
            free = (-ctas) % wave
            roomy = free >= free_slots
            if room_slots and free < room_slots and c <= room_chunk:
                cost += room8 * sms * (room_slots - free) // room_slots
            if i == 0 or ctas <= max_ctas:
                cands_ok.append((not roomy, cost, ctas, i, c))
        best = min(cands_ok) if free_slots and rows == 1 else min(cands_ok, key=lambda x: x[1:4])
        best = (best[4], best[1], best[2])
        splits = [-(-t // best[0]) if t else 0 for t in tiles]
        offs = np.concatenate([[0], np.cumsum(splits)])
        split_offsets[:] = torch.as_tensor(offs, dtype=torch.int32)
        num_splits[:] = torch.as_tensor(splits, dtype=torch.int32)
        t = []
        lens = [int(seq_lens[r]) - start[r] if tiles[r] else 0 for r in range(rows)]   # attended
        for r in sorted(range(rows), key=lambda r: -(lens[r] // splits[r]) if splits[r] else 1):
            n, s = lens[r], splits[r]
            for j in range(s):
                b = start[r] + j * tiles[r] // s * TILE
                e = start[r] + min(n, (j + 1) * tiles[r] // s * TILE)
                t += [[r, h, j, b, e] for h in range(num_kv_heads)]
        num_tasks[0] = min(len(t), tasks.shape[0])
        if t:
            tasks[:num_tasks[0]] = torch.as_tensor(t[:tasks.shape[0]], dtype=torch.int32)
        status[0] = (len(t) > tasks.shape[0]) | (2 if bad else 0) | (4 if bad_page else 0)


class ReplayGraph:
    def __init__(self, launch):
        self.launch, self.resets = launch, 0

    def replay(self):
        self.launch()

    def reset(self):
        self.launch, self.resets = None, self.resets + 1


class FakeEvent:
    def record(self):
        pass

    def synchronize(self):
        pass


def no_op_kernel(*args, prepare=False, **kwargs):
    """A kernel launch that does nothing (a prepared one, ``prepare=True``: a no-op to call), for
    scripts that time only the host work of a step (benches/host_pieces_cpu.py)."""
    return (lambda: None) if prepare else None


def install_fake_device(set_attr, kernels, *, replay_runs_launches: bool = True) -> None:
    """Make the Runtime run on the CPU: ``set_attr(owner, name, value)`` (monkeypatch.setattr,
    or plain setattr for a script: benches/host_pieces_cpu.py) patches the device, pinned memory,
    streams, events and graph capture, and ``kernels(name)`` gives each launch wrapper of ops.
    A captured graph's replay re-runs its launches (the tests need their outputs), or with
    ``replay_runs_launches=False`` does nothing, as a real replay runs no Python."""
    set_attr(runtime.core, "_resolve_device", lambda device: torch.device("cpu"))
    set_attr(runtime.buffers, "_pinned", lambda n, dtype=torch.int32: torch.zeros(n, dtype=dtype))
    set_attr(_driver, "get_kernel", lambda *a, **k: None)
    set_attr(torch.cuda, "device", lambda d: contextlib.nullcontext())
    set_attr(torch.cuda, "Stream", lambda *a, **k: object())
    set_attr(torch.cuda, "Event", FakeEvent)
    set_attr(torch.cuda, "graph_pool_handle", lambda: None)

    def capture(launch, *, side_stream=None, pool=None, device=None, capture_error_mode="global"):
        launch()  # the warm-up run computes this call's result
        return graphs.GraphEntry(ReplayGraph(launch if replay_runs_launches else lambda: None),
                                 nodes=1, mem_bytes=0)

    set_attr(graphs, "capture", capture)
    for name in ("split_decode", "merge", "merge_segments", "workqueue_decode", "plan_workqueue_device",
                 "decode_occupancy", "find_shared"):
        set_attr(ops, name, kernels(name))


@pytest.fixture
def fake_device(monkeypatch):
    emu = Emu()
    install_fake_device(monkeypatch.setattr, lambda name: getattr(emu, name))
    return emu


FAKE_SHAPE = dict(num_qo_heads=8, num_kv_heads=2, head_dim=64, page_size=16)
POOL_LENS = [3000, 2500, 900, 40, 1700, 33]   # requests' longest lengths


@pytest.fixture(scope="module")
def pool():
    """Paged data of 6 requests (holes, NaN-poisoned unowned pages) and a second layer's cache."""
    b = make_batch(POOL_LENS, **FAKE_SHAPE, dtype=torch.float16, device="cpu", seed=11)
    return b, (b.k_cache.clone(), b.v_cache.clone())


def fake_runtime(**kw):
    args = dict(routes=ROUTES, calibration=SEED, max_batch=8, max_pages_per_row=256, flashinfer=False)
    args.update(kw)
    return Runtime(*FAKE_SHAPE.values(), torch.float16, **with_options(args))


# (rows of the pool, how many tokens each is short of its longest length): lengths grow by one a
# step, request 4 joins at step 2, request 1 leaves at step 4, request 5 joins at step 5.
STEPS = [([0, 1, 2, 3], 5), ([0, 1, 2, 3], 4), ([0, 1, 2, 3, 4], 3), ([0, 1, 2, 3, 4], 2),
         ([0, 2, 3, 4], 1), ([0, 2, 3, 4, 5], 0)]


def step_inputs(b, rows, short, seed):
    seq = np.array([max(1, POOL_LENS[r] - short) for r in rows], dtype=np.int32)
    bt = b.block_tables[rows]
    q = torch.randn(len(rows), 8, 64, generator=torch.Generator().manual_seed(seed)).half()
    return seq, bt, q


def ref(q, cache, seq, bt):
    return reference.decode_attention(q, cache[0], cache[1], torch.as_tensor(seq), bt)


@pytest.mark.parametrize("use_graphs", [True, False], ids=["graphs", "eager"])
@pytest.mark.parametrize("route", ["pkv_bucket", "pkv_workqueue", "pkv_fused", None])
def test_fake_device_decode_loop_matches_reference(fake_device, pool, route, use_graphs):
    b, layer1 = pool
    rt = fake_runtime(use_cuda_graph=use_graphs)
    caches = [(b.k_cache, b.v_cache), layer1]
    copies = 0
    for i, (rows, short) in enumerate(STEPS):
        seq, bt, q = step_inputs(b, rows, short, seed=i)
        d = rt.plan(seq, bt, force=route)
        assert d.kind != "flashinfer"  # unavailable: the auto policy falls back to PersistentKV
        # workqueue/fused: planning head + block tables in one copy; bucket: arena + block tables
        copies += 1 if d.kind in ("workqueue", "fused") else 2
        for layer, cache in enumerate(caches):
            if layer == 0:   # a fresh q/out every call
                out = rt.run(q.clone(), *cache, out=torch.full_like(q, float("nan")))
            else:            # the zero-copy fast path
                rt.static_q(len(rows)).copy_(q)
                out = rt.run(rt.static_q(len(rows)), *cache, out=rt.static_out(len(rows)))
            assert not torch.isnan(out).any()
            assert rel_err(out, ref(q, cache, seq, bt)) < 2e-3, (i, layer, d.route)
    s = rt.stats()
    if use_graphs:
        assert s["captures"] > 0 and s["replays"] > 0 and s["eager_runs"] == 0
        assert s["graphs"] <= s["max_graphs"] and s["min_graph_nodes"] >= 1
    else:
        assert s["captures"] == 0 and s["eager_runs"] == 2 * len(STEPS)
    assert s["plans"] == len(STEPS) and s["h2d_copies"] == copies


@pytest.mark.parametrize("two_level", [True, False])
def test_fake_device_fused_launches_carry_the_two_level_counters(fake_device, pool, two_level):
    """The fused route's launches get the Runtime's group counters ([slots, H_kv], zero: the
    kernel's two-level tail where its rule says); the workqueue route's never; and none with
    RuntimeOptions(fused_two_level_tail=False), the ablation."""
    b, _ = pool
    rt = fake_runtime(use_cuda_graph=False, fused_two_level_tail=two_level)
    seq, bt, q = step_inputs(b, [0, 1, 2], 0, seed=3)
    for route in ("pkv_fused", "pkv_workqueue"):
        fake_device.two_level.clear()
        rt.plan(seq, bt, force=route)
        out = rt.run(q.clone(), b.k_cache, b.v_cache, out=torch.full_like(q, float("nan")))
        assert rel_err(out, ref(q, (b.k_cache, b.v_cache), seq, bt)) < 2e-3
        assert fake_device.two_level == [two_level and route == "pkv_fused"], route


@pytest.mark.parametrize("mode", ["eager", "engine_capture"])
def test_fake_device_a_dropped_runtime_is_freed_at_once(fake_device, pool, mode):
    """No reference cycle in a Runtime (285b2a6): with the collector off, a Runtime that
    planned and ran every PersistentKV route dies at ``del``. engine_capture with host lengths
    once kept its deferred planning launch as a closure over the Runtime, a cycle. (The fake
    device's graphs hold their launch closures, which a real CUDA graph does not: the graphs
    mode and the FlashInfer route are tests/gpu/test_runtime.py's.)"""
    import gc
    import weakref

    b, layer1 = pool
    gc.collect()
    gc.disable()
    try:
        rt = fake_runtime(**({"use_cuda_graph": False} if mode == "eager" else {"engine_capture": True}))
        for route in ["pkv_bucket", "pkv_workqueue", "pkv_fused"]:
            for i, (rows, short) in enumerate(STEPS[:2]):
                seq, bt, q = step_inputs(b, rows, short, seed=i)
                rt.plan(seq, bt, force=route)
                for cache in [(b.k_cache, b.v_cache), layer1]:
                    rt.run(q, *cache)
        alive = weakref.ref(rt)
        del rt
        assert alive() is None, "a dropped Runtime is still alive: a reference cycle holds it"
    finally:
        gc.enable()


def test_collector_paused_is_counted_and_restores_the_collector():
    """graphs.collector_paused (what graphs.capture runs its capture under): the collector is
    off inside, back on after the outermost block (also when it raises), left off when it was
    off before, and two overlapping blocks (two threads capturing) keep it off until both end."""
    import gc
    import threading

    assert gc.isenabled()
    with graphs.collector_paused():
        assert not gc.isenabled()
        with graphs.collector_paused():
            assert not gc.isenabled()
        assert not gc.isenabled()
    assert gc.isenabled()
    with pytest.raises(KeyError):
        with graphs.collector_paused():
            raise KeyError("x")
    assert gc.isenabled()
    gc.disable()
    try:
        with graphs.collector_paused():
            pass
        assert not gc.isenabled()
    finally:
        gc.enable()
    inside, release, states = threading.Event(), threading.Event(), []

    def other_capture():
        with graphs.collector_paused():
            inside.set()
            release.wait(10)

    t = threading.Thread(target=other_capture)
    t.start()
    inside.wait(10)
    with graphs.collector_paused():
        pass
    states.append(gc.isenabled())   # this thread's block ended, the other's has not
    release.set()
    t.join(10)
    states.append(gc.isenabled())
    assert states == [False, True]


@pytest.mark.parametrize("route", ["pkv_bucket", "pkv_workqueue", "pkv_fused"])
def test_fake_device_replay_reads_the_new_metadata(fake_device, pool, route):
    b, _ = pool
    rt = fake_runtime()
    cache = (b.k_cache, b.v_cache)
    for i, short in enumerate([9, 5, 0]):  # same rows and splits, new lengths and q
        seq, bt, q = step_inputs(b, [0, 1, 2], short, seed=100 + i)
        rt.plan(seq, bt, force=route)
        rt.static_q(3).copy_(q)
        out = rt.run(rt.static_q(3), *cache, out=rt.static_out(3))
        assert rel_err(out, ref(q, cache, seq, bt)) < 2e-3
    s = rt.stats()
    # workqueue/fused: the planning graph of the padded batch and the decode graph, each
    # captured once and replayed on the two later steps
    graphs_per_step = 1 if route == "pkv_bucket" else 2
    assert s["captures"] == graphs_per_step and s["replays"] == 2 * graphs_per_step
    assert s["staging_copies"] == 0


def test_fake_device_caller_tensors_go_through_staging_then_get_their_own_graph(fake_device, pool):
    b, _ = pool
    rt = fake_runtime()
    cache = (b.k_cache, b.v_cache)
    seq, bt, q = step_inputs(b, [0, 3], 0, seed=5)
    rt.plan(seq, bt, force="pkv_bucket")
    out = torch.empty_like(q)
    for call in range(3):
        q.copy_(torch.randn(q.shape, generator=torch.Generator().manual_seed(call)).half())
        rt.run(q, *cache, out=out)
        assert rel_err(out, ref(q, cache, seq, bt)) < 2e-3
    s = rt.stats()
    # call 0: staging copies + static graph; call 1: key seen again -> its own graph; call 2: replay
    assert s["staging_copies"] == 2 and s["captures"] == 2 and s["replays"] == 1


@pytest.mark.parametrize("route", ["pkv_workqueue", "pkv_fused"])
def test_fake_device_padded_batch_shares_a_graph(fake_device, pool, route):
    """3 and 4 rows pad to 4: one planning graph and one decode graph serve both steps, however
    the partition cuts them (the graph's grid is the padded batch's, not the step's tasks)."""
    b, _ = pool
    rt = fake_runtime()
    cache = (b.k_cache, b.v_cache)
    structures = []
    for rows in ([0, 1, 3], [0, 1, 3, 5]):
        seq, bt, q = step_inputs(b, rows, 0, seed=len(rows))
        d = rt.plan(seq, bt, force=route)
        assert d.plan is None                   # built on the GPU, not on the host
        structures.append(rt._step.structure)
        rt.static_q(len(rows)).copy_(q)
        out = rt.run(rt.static_q(len(rows)), *cache, out=rt.static_out(len(rows)))
        assert rel_err(out, ref(q, cache, seq, bt)) < 2e-3
    grid = rt._device_grid_tasks(rt.registry.route(route), 4)
    assert structures == [grid, grid] and rt._step.gbatch == 4
    assert rt.stats()["captures"] == 2 and rt.stats()["replays"] == 2


def test_fake_device_capacity_growth_drops_graphs(fake_device, pool, tmp_path):
    """Only host-planned bucket steps can outgrow the buffers (workqueue/fused ones are sized
    for every padded batch at construction): a bucket of two equal rows needs 2 x 16 slots."""
    text = (REPO / "routes.toml").read_text().replace("max_active = 8", "max_active = 1")
    (tmp_path / "routes.toml").write_text(text.replace("max = 64", "max = 16"))
    b, _ = pool
    # one resident wave of one CTA per SM: a device grid of 28 tasks, 14 slots at H_kv 2
    narrow = attrs.evolve(SEED, splits=attrs.evolve(SEED.splits, workqueue_ctas_per_sm=1.0, max_waves=1))
    rt = fake_runtime(routes=tmp_path / "routes.toml", calibration=narrow)
    assert rt.stats()["capacities"]["slots"] == 16          # 1 row * 16 splits
    cache = (b.k_cache, b.v_cache)
    for rows, equal in (([0], None), ([0, 1], 2500)):
        seq, bt, q = step_inputs(b, rows, 0, seed=7)
        if equal:
            seq[:] = equal                                  # one exact bucket of two rows
        d = rt.plan(seq, bt, force="pkv_bucket")
        out = rt.run(q, *cache, out=torch.empty_like(q))
        assert rel_err(out, ref(q, cache, seq, bt)) < 2e-3
    s = rt.stats()
    need = needed_capacities(d.kind, d.plan).slots
    assert need == 32 and s["capacities"]["slots"] >= need
    assert s["regrowths"] == 1 and s["invalidations"] == 1 and s["graphs"] == 1


# ----------------------------------------------------------------------------- host lengths, plans on the GPU


def _no_host_workqueue_plan(monkeypatch):
    """Fail if anything builds or stages a Python workqueue plan (the router's predictions may
    still compute split counts: ``tasks=False``)."""
    import pkvrt.policy.router as router_mod

    real = router_mod.workqueue_from_checked

    def counters_only(*a, **kw):
        assert not kw["tasks"], "a Python workqueue plan was built for a host-lengths step"
        return real(*a, **kw)
    monkeypatch.setattr(router_mod, "workqueue_from_checked", counters_only)
    monkeypatch.setattr(graphs, "stage_workqueue", lambda *a, **k: pytest.fail("staged on the host"))


@pytest.mark.parametrize("route", ["pkv_workqueue", "pkv_fused"])
def test_fake_device_host_lengths_plan_on_the_gpu_equals_the_host_twin(fake_device, pool, monkeypatch, route):
    """A host-routed workqueue/fused step builds no Python plan: the lengths and block tables
    go to the planning buffers (one copy) and the planning kernel (emulated) writes tasks and
    split offsets equal, task for task, to the host planner's (``Router.full_plan``)."""
    b, _ = pool
    cache = (b.k_cache, b.v_cache)
    rt = fake_runtime()
    steps = [step_inputs(b, rows, short, seed=i) for i, (rows, short) in enumerate(STEPS)]
    twins = [rt.router.full_plan(route, seq) for seq, _, _ in steps]   # before the guard below
    _no_host_workqueue_plan(monkeypatch)
    L = rt._layout
    for i, ((seq, bt, q), twin) in enumerate(zip(steps, twins)):
        rows = seq.tolist()
        d = rt.plan(seq, bt, force=route)
        assert d.route == route and d.plan is None
        gb = graphs.padded_batch(len(rows))
        assert rt._step.structure == rt._device_grid_tasks(rt.registry.route(route), gb)
        t = int(rt._v_num_tasks[0])
        assert np.array_equal(rt._arena[L.tasks:L.tasks + 5 * t].view(t, 5).numpy(), twin.tasks), i
        off = rt._arena[L.split_offsets:L.split_offsets + len(rows) + 1].numpy()
        assert np.array_equal(off, twin.split_offsets), i
        out = rt.run(q, *cache, out=torch.full_like(q, float("nan")))
        assert rel_err(out, ref(q, cache, seq, bt)) < 2e-3, i
        assert rt.device_status() == 0
    s = rt.stats()
    assert s["h2d_copies"] == len(STEPS) and s["regrowths"] == 0
    assert "workqueue/fused plans built on the GPU" in rt.explain() and "chosen" in rt.explain()


def test_fake_device_planning_head_sits_before_the_block_tables(fake_device):
    """One H2D copy uploads a host-lengths step: the planning head [rows, max_seq_len, pad |
    seq_lens] is the front of the block-table allocation; both 64-byte aligned."""
    for max_batch, rows in ((8, 8), (3, 4), (40, 64)):
        rt = fake_runtime(max_batch=max_batch)
        head = rt._plan_head()
        assert head % graphs.ALIGN == 0 and head >= graphs.ALIGN + rows
        assert rt._bt.data_ptr() - rt._bt_store.data_ptr() == 4 * head
        assert rt._d_seq.data_ptr() - rt._d_meta.data_ptr() == 4 * graphs.ALIGN
        assert rt._d_seq.numel() == rows and rt._d_rows.data_ptr() == rt._bt_store.data_ptr()
        assert rt._ring[0].bt.data_ptr() - rt._ring[0].store.data_ptr() == 4 * head


@pytest.mark.parametrize("route", ["pkv_workqueue", "pkv_fused"])
def test_fake_device_host_lengths_replay_while_lengths_grow_and_batches_change(fake_device, pool, route):
    """20 steps of 3 rows whose lengths grow one token a step: one planning graph and one decode
    graph, replayed 19 times each; 5 rows (padded batch 8) adds one pair, and 3 rows again
    replays the first pair."""
    b, _ = pool
    cache = (b.k_cache, b.v_cache)
    rt = fake_runtime()

    def step(rows, short, seed):
        seq, bt, q = step_inputs(b, rows, short, seed=seed)
        rt.plan(seq, bt, force=route)
        rt.static_q(len(rows)).copy_(q)
        out = rt.run(rt.static_q(len(rows)), *cache, out=rt.static_out(len(rows)))
        assert rel_err(out, ref(q, cache, seq, bt)) < 2e-3, (rows, short)

    for i in range(20):
        step([0, 1, 2], 30 - i, seed=i)
    s = rt.stats()
    assert s["captures"] == 2 and s["replays"] == 2 * 19
    step([0, 1, 2, 4, 5], 3, seed=20)
    step([0, 1, 2], 5, seed=21)
    s = rt.stats()
    assert s["captures"] == 4 and s["replays"] == 2 * 20 and s["graphs"] == 4


def test_fake_device_engine_capture_takes_the_device_planning_route(fake_device, pool):
    """engine_capture with host lengths: no graphs of the Runtime's own; unforced steps run
    routes.toml's [device_planning] route for their row count (the one-row small_route too),
    forced ones the forced route; the step key follows the route, the padded batch and the
    planning grid, so steps of one padded batch share a key while their lengths change."""
    b, _ = pool
    cache = (b.k_cache, b.v_cache)
    rt = fake_runtime(engine_capture=True)
    assert not rt.use_cuda_graph and rt.engine_capture and rt.step_key is None
    keys = []
    for i, (rows, short) in enumerate(STEPS + [([2], 0)]):
        seq, bt, q = step_inputs(b, rows, short, seed=i)
        d = rt.plan(seq, bt)
        assert d.route == rt.registry.device_planning_route(len(rows)).name and not d.forced
        assert d.max_context == int(seq.max()) and "[device_planning]" in d.explain()
        out = rt.run(q, *cache, out=torch.full_like(q, float("nan")))
        assert rel_err(out, ref(q, cache, seq, bt)) < 2e-3, (i, d.route)
        keys.append(rt.step_key)
    assert keys[0] == keys[1] and keys[0] != keys[2] and keys[2] == keys[3]   # 4, 4, 5, 5 rows
    assert keys[-1][0] == rt.registry.device_planning_route(1).name
    seq, bt, q = step_inputs(b, [0, 1], 0, seed=9)
    assert rt.plan(seq, bt, force="pkv_bucket").route == "pkv_bucket" and rt.step_key[0] == "pkv_bucket"
    s = rt.stats()
    assert s["captures"] == 0 and s["replays"] == 0 and s["eager_runs"] == len(STEPS) + 1
    assert "engine-captured steps" in rt.explain()


def test_fake_device_engine_capture_plans_in_the_steps_first_run(fake_device, pool):
    """engine_capture with host lengths: plan() copies the step and launches nothing; the
    step's first run() launches the planning kernel (so an engine's graph of the step holds it
    and a replay plans from the lengths the next plan() copied), and its decode does not read
    the plan early; the step's later run()s neither plan again nor wait. A bucket step has no
    planning launch."""
    b, _ = pool
    cache = (b.k_cache, b.v_cache)
    rt = fake_runtime(engine_capture=True)
    plans, early = [], []
    plan_kernel, launch = rt._launch_device_plan, rt._launch
    rt._launch_device_plan = lambda *a, **k: (plans.append(a[0].name), plan_kernel(*a, **k))
    rt._launch = lambda st, *a, early_kv=False, **k: (early.append(early_kv),
                                                       launch(st, *a, early_kv=early_kv, **k))
    for i, (rows, short) in enumerate(STEPS[:3]):
        seq, bt, q = step_inputs(b, rows, short, seed=i)
        d = rt.plan(seq, bt)
        assert len(plans) == i, "plan() launched the planning kernel"
        for _ in range(3):
            out = rt.run(q, *cache, out=torch.full_like(q, float("nan")))
            assert rel_err(out, ref(q, cache, seq, bt)) < 2e-3, (i, d.route)
        assert plans == [rt.registry.device_planning_route(len(r)).name for r, _ in STEPS[:i + 1]]
    assert early == [False, True, True] * 3
    seq, bt, q = step_inputs(b, [0, 1], 0, seed=9)
    rt.plan(seq, bt, force="pkv_bucket")
    rt.run(q, *cache)
    assert len(plans) == 3 and rt._step.plan_launch is None
    s = rt.stats()
    assert s["captures"] == 0 and s["replays"] == 0   # no graphs of the Runtime's own


def test_fake_device_engine_capture_plans_once_per_capture(fake_device, pool, monkeypatch):
    """The planning launch of an engine_capture step: the first eager run() after plan() and the
    first run() of every capture sequence (told apart by the stream's capture id) launch it, and
    their decode does not read the plan early; the other run()s of the same place do."""
    from pkvrt.launch import _driver
    b, _ = pool
    cache = (b.k_cache, b.v_cache)
    rt = fake_runtime(engine_capture=True)
    plans, early = [], []
    plan_kernel, launch = rt._launch_device_plan, rt._launch
    rt._launch_device_plan = lambda *a, **k: (plans.append(1), plan_kernel(*a, **k))
    rt._launch = lambda st, *a, early_kv=False, **k: (early.append(early_kv),
                                                       launch(st, *a, early_kv=early_kv, **k))
    seq, bt, q = step_inputs(b, [0, 1, 2], 1, seed=3)
    rt.plan(seq, bt)
    where = {"capture": 0}
    monkeypatch.setattr(rt, "_capturing", lambda: where["capture"] != 0)
    monkeypatch.setattr(_driver, "capture_id", lambda: where["capture"])
    for capture in (0, 7, 7, 8, 0):   # eager (warm-up), a capture, the same capture, another, eager
        where["capture"] = capture
        for _ in range(2):
            rt.run(q, *cache)
    assert len(plans) == 4   # eager, capture 7, capture 8, eager again after a capture
    assert early == [False, True, False, True, True, True, False, True, False, True]


def test_fake_device_engine_capture_checks_page_ids_at_plan(fake_device, pool):
    """engine_capture: an engine's replays call no run(), so plan() refuses a page id >=
    num_pages (ValueError naming it; the previous plan and its step key stay); validate=False
    leaves the ids to the planning kernel's GPU check (run with the step: its first run(), or
    the replay of an engine's graph)."""
    b, _ = pool
    pages = b.k_cache.shape[0]
    rt = fake_runtime(engine_capture=True, num_pages=pages)
    seq, bt, q = step_inputs(b, [0, 2, 3], 0, seed=5)
    rt.plan(seq, bt)
    key = rt.step_key
    bad = bt.clone()
    bad[1, (int(seq[1]) - 1) // FAKE_SHAPE["page_size"]] = pages
    with pytest.raises(ValueError, match=f"page id {pages}: expected page ids < num_pages = {pages}"):
        rt.plan(seq, bad)
    assert rt.step_key == key
    out = rt.run(q, b.k_cache, b.v_cache, out=torch.full_like(q, float("nan")))
    assert rel_err(out, ref(q, (b.k_cache, b.v_cache), seq, bt)) < 2e-3
    trusting = fake_runtime(engine_capture=True, num_pages=pages, validate=False)
    trusting.plan(seq, bad)   # no host check: the planning kernel gives the row no work
    assert trusting.device_status(raise_on_error=False) & 4   # plans the step first: no run() yet
    trusting.run(q, b.k_cache, b.v_cache)
    assert trusting.device_status(raise_on_error=False) & 4
    trusting.plan(seq, bt)    # a good step: its own word, not the last one's
    assert trusting.device_status() == 0


def test_fake_device_engine_capture_router_routing_is_the_routers(fake_device, pool):
    """capture_routing="router": the route of every step is the one the default Runtime's
    router picks (graph launch costs: the same as a Runtime with its own graphs)."""
    b, _ = pool
    a, r = fake_runtime(), fake_runtime(engine_capture=True, capture_routing="router")
    for i, (rows, short) in enumerate(STEPS):
        seq, bt, _ = step_inputs(b, rows, short, seed=i)
        assert a.plan(seq, bt).route == r.plan(seq, bt).route
    with pytest.raises(ValueError, match="capture_routing='auto'"):
        fake_runtime(engine_capture=True, capture_routing="auto")
    for kw in (dict(), dict(engine_capture=True, device_planning=True)):
        with pytest.raises(ValueError, match="applies to engine_capture=True with host lengths"):
            fake_runtime(capture_routing="router", **kw)
    with pytest.raises(ValueError, match="max_batch=2048: engine_capture"):
        fake_runtime(engine_capture=True, max_batch=2048)
    fake_runtime(engine_capture=True, capture_routing="router", max_batch=2048)


def test_fake_device_host_lengths_page_ids(fake_device, pool):
    """validate=True: a negative page id is refused at plan(), one past the cache at run(),
    before any launch. validate=False: the planning kernel checks the ids against the smallest
    cache run() was given; the row gets no work and device_status() names the cause."""
    b, _ = pool
    cache = (b.k_cache, b.v_cache)
    pages = b.k_cache.shape[0]
    seq, bt, q = step_inputs(b, [0, 1, 2], 0, seed=5)
    used = (int(seq[1]) - 1) // 16                       # row 1's last used page
    rt = fake_runtime()
    rt.plan(seq, bt, force="pkv_fused")
    launches = fake_device.launches
    neg = bt.clone()
    neg[1, used] = -3
    with pytest.raises(ValueError, match=rf"block_tables\[1, {used}\] = -3"):
        rt.plan(seq, neg, force="pkv_fused")
    past = bt.clone()
    past[1, used] = pages
    rt.plan(seq, past, force="pkv_fused")
    launches = fake_device.launches
    out = torch.full_like(q, 5.0)
    with pytest.raises(ValueError, match="page id .* num_pages"):
        rt.run(q, *cache, out=out)
    assert fake_device.launches == launches and torch.all(out == 5.0)

    loose = fake_runtime(validate=False)
    loose.plan(seq, bt, force="pkv_fused")
    loose.run(q, *cache)                                  # sets the GPU's bound: the cache's pages
    loose.plan(seq, past, force="pkv_fused")
    loose.static_q(3).copy_(q)
    loose.static_out(3).fill_(7.0)
    out = loose.run(loose.static_q(3), *cache, out=loose.static_out(3))
    assert torch.all(out[1] == 7.0) and rel_err(out[[0, 2]], ref(q, cache, seq, bt)[[0, 2]]) < 2e-3
    assert loose.device_status(raise_on_error=False) == 4
    with pytest.raises(RuntimeError, match="page id outside"):
        loose.device_status()
    loose.plan(seq, bt, force="pkv_bucket")               # planned on the host: no GPU word
    assert loose.device_status() == 0


def test_fake_device_workqueue_batches_beyond_one_planning_cta(fake_device, pool, monkeypatch):
    b, _ = pool
    monkeypatch.setattr(ops, "PLAN_MAX_ROWS", 2)
    rt = fake_runtime()
    seq, bt, q = step_inputs(b, [0, 1, 2], 0, seed=6)
    with pytest.raises(ValueError, match="batch of 3 rows on route 'pkv_workqueue'.* at most 2 rows"):
        rt.plan(seq, bt, force="pkv_workqueue")
    assert rt._step is None
    rt.plan(seq, bt, force="pkv_bucket")                  # other routes are not limited
    out = rt.run(q, b.k_cache, b.v_cache)
    assert rel_err(out, ref(q, (b.k_cache, b.v_cache), seq, bt)) < 2e-3


def test_fake_device_graph_count_stays_bounded(fake_device, pool):
    b, _ = pool
    rt = fake_runtime(max_graphs=3)
    cache = (b.k_cache, b.v_cache)
    rng = np.random.default_rng(3)
    routes = ["pkv_bucket", "pkv_workqueue", "pkv_fused"]
    for i in range(40):
        rows = sorted(rng.choice(6, size=rng.integers(1, 7), replace=False).tolist())
        seq, bt, q = step_inputs(b, rows, int(rng.integers(0, 30)), seed=i)
        rt.plan(seq, bt, force=routes[i % 3])
        rt.static_q(len(rows)).copy_(q)
        out = rt.run(rt.static_q(len(rows)), *cache, out=rt.static_out(len(rows)))
        assert rt.stats()["graphs"] <= 3
        if i % 8 == 0:
            assert rel_err(out, ref(q, cache, seq, bt)) < 2e-3
    assert rt.stats()["evictions"] > 0


@pytest.mark.parametrize("bad, match", [
    (lambda t: t.update(q=t["q"][:1]), "q: expected a contiguous"),
    (lambda t: t.update(k_cache=t["k_cache"][:5], v_cache=t["v_cache"][:5]), "page id .* num_pages"),
    (lambda t: t.update(v_cache=t["v_cache"].float()), "v_cache: expected dtype"),
])
def test_fake_device_run_errors_launch_nothing_and_leave_out_untouched(fake_device, pool, bad, match):
    b, _ = pool
    rt = fake_runtime()
    seq, bt, q = step_inputs(b, [0, 1], 0, seed=1)
    rt.plan(seq, bt, force="pkv_workqueue")
    t = dict(q=q, k_cache=b.k_cache, v_cache=b.v_cache, out=torch.full_like(q, 3.0))
    bad(t)
    before, launches = t["out"].clone(), fake_device.launches
    with pytest.raises(ValueError, match=match):
        rt.run(**t)
    assert torch.equal(t["out"], before) and fake_device.launches == launches


def test_fake_device_plan_errors_keep_the_previous_plan(fake_device, pool):
    b, _ = pool
    rt = fake_runtime()
    seq, bt, q = step_inputs(b, [0, 2], 0, seed=2)
    d = rt.plan(seq, bt, force="pkv_bucket")
    bad_bt = bt.clone()
    bad_bt[1, 0] = -2
    for args, kw, match in [((seq, bad_bt), {}, r"block_tables\[1, 0\] = -2"),
                            ((seq, bt), dict(force="nope"), "force='nope'"),
                            ((np.arange(1, 10), np.zeros((9, 4), np.int32)), {}, "max_batch")]:
        with pytest.raises(ValueError, match=match):
            rt.plan(*args, **kw)
        assert rt.last_decision is d
    out = rt.run(q, b.k_cache, b.v_cache)
    assert rel_err(out, ref(q, (b.k_cache, b.v_cache), seq, bt)) < 2e-3


def test_fake_device_run_before_plan(fake_device, pool):
    b, _ = pool
    with pytest.raises(RuntimeError, match=r"call plan\(seq_lens, block_tables\)"):
        fake_runtime().run(b.q, b.k_cache, b.v_cache)


def test_fake_device_without_flashinfer_warns_and_explains(fake_device, pool, monkeypatch):
    monkeypatch.setitem(sys.modules, "flashinfer", None)
    b, _ = pool
    rt = fake_runtime(flashinfer=True)   # its mode (and so its FlashInfer route) waits for plan()
    seq, bt, q = step_inputs(b, [2, 3], 0, seed=4)   # short contexts: the policy says FlashInfer
    with pytest.warns(RuntimeWarning, match="FlashInfer route is unavailable"):
        d = rt.plan(seq, bt)
    assert not rt.flashinfer_available
    assert d.kind in ("bucket", "workqueue")
    text = rt.explain()
    assert "flashinfer: unavailable (flashinfer failed to import" in text and "FlashInfer unavailable" in text
    assert rel_err(rt.run(q, b.k_cache, b.v_cache), ref(q, (b.k_cache, b.v_cache), seq, bt)) < 2e-3
    with pytest.raises(ValueError, match="force='flashinfer'"):
        rt.plan(seq, bt, force="flashinfer")


def test_flashinfer_cuda_cores_at_a_group_size_it_has_no_kernel_for(fake_device, monkeypatch):
    """G 5 with FlashInfer's CUDA-core path asked for: the FlashInfer route is unavailable with
    the reason (FlashInfer would raise "Unsupported group_size" at plan()), as for D 96: no
    warning, steps run on pkvrt's routes, explain() says why; at G 4 it is not refused."""
    monkeypatch.setitem(sys.modules, "flashinfer", None)
    rt = fake_runtime(flashinfer=True, flashinfer_tensor_cores=False)   # G 4: served
    assert rt._fi_unserved() is None
    hq, hkv, d, page = 10, 2, 64, 16
    rt = Runtime(hq, hkv, d, page, torch.float16, **with_options(dict(
        routes=ROUTES, calibration=SEED, max_batch=8, max_pages_per_row=256, flashinfer=True,
        flashinfer_tensor_cores=False)))
    b = make_batch([300, 40], num_qo_heads=hq, num_kv_heads=hkv, head_dim=d, page_size=page,
                   dtype=torch.float16, device="cpu", seed=3)
    rt.plan(b.seq_lens.numpy(), b.block_tables.numpy())
    assert not rt.flashinfer_available
    assert "CUDA-core decode has no kernel for group size 5" in rt.explain()
    out = rt.run(b.q, b.k_cache, b.v_cache)
    assert rel_err(out, reference.decode_attention(b.q, b.k_cache, b.v_cache, b.seq_lens, b.block_tables)) < 2e-3


def test_flashinfer_route_waits_for_a_wrappers_last_plan_copy_before_replanning(monkeypatch):
    """FlashInfer's plan() copies its schedule from a per-wrapper pinned buffer asynchronously;
    re-planning the same wrapper before that copy ran hands a step another step's schedule (the
    illegal memory access of the 2026-11-29 graph-mode serving runs). The route must wait on an
    event recorded after the wrapper's previous plan, and only that wrapper's."""
    log = []

    class Ev:
        n = 0

        def __init__(self):
            Ev.n += 1
            self.id = Ev.n

        def record(self):
            log.append(("record", self.id))

        def synchronize(self):
            log.append(("sync", self.id))

    class Wrapper:
        def __init__(self, *a, **kw):
            self.batch = None if "paged_kv_last_page_len_buffer" not in kw else \
                kw["paged_kv_last_page_len_buffer"].shape[0]

        def plan(self, indptr, indices, last, *a, **kw):
            log.append(("plan", last.shape[0]))

    monkeypatch.setattr(torch.cuda, "Event", Ev)
    fake = types.SimpleNamespace(BatchDecodeWithPagedKVCacheWrapper=Wrapper)

    # An evicted wrapper's pinned buffer may be reused at once: its last copy is waited on first.
    log.clear()
    route = fi_route.FlashInferRoute(
        fake, num_qo_heads=8, num_kv_heads=2, head_dim=64, page_size=16, dtype=torch.float16,
        device=torch.device("cpu"), sm_scale=None, tensor_cores=True, cuda_graph=True,
        indices_buffer=torch.zeros(64, dtype=torch.int32), max_wrappers=1)
    ip, idx = torch.zeros(3, dtype=torch.int32), torch.zeros(4, dtype=torch.int32)
    route.plan(ip, idx, torch.zeros(2, dtype=torch.int32))
    route.plan(ip[:2], idx, torch.zeros(1, dtype=torch.int32))
    b2 = log[1][1]
    assert log[:3] == [("plan", 2), ("record", b2), ("sync", b2)] and log[3] == ("plan", 1)

    for graph_mode in (True, False):
        log.clear()
        route = fi_route.FlashInferRoute(
            fake, num_qo_heads=8, num_kv_heads=2, head_dim=64, page_size=16, dtype=torch.float16,
            device=torch.device("cpu"), sm_scale=None, tensor_cores=True, cuda_graph=graph_mode,
            indices_buffer=torch.zeros(64, dtype=torch.int32))
        ip, idx = torch.zeros(3, dtype=torch.int32), torch.zeros(4, dtype=torch.int32)
        route.plan(ip, idx, torch.zeros(2, dtype=torch.int32))
        route.plan(ip[:2], idx, torch.zeros(1, dtype=torch.int32))
        route.plan(ip, idx, torch.zeros(2, dtype=torch.int32))
        first, other = log[1][1], log[3][1]
        if graph_mode:   # one wrapper (and event) per batch size: B2's event waited on, not B1's
            assert log == [("plan", 2), ("record", first), ("plan", 1), ("record", other),
                           ("sync", first), ("plan", 2), ("record", first)]
        else:            # one eager wrapper: every re-plan waits
            assert log == [("plan", 2), ("record", first), ("sync", first), ("plan", 1),
                           ("record", first), ("sync", first), ("plan", 2), ("record", first)]


def test_run_checks_each_argument_signature_once(fake_device, pool, monkeypatch):
    """run() checks its tensors in full once per signature (addresses, shapes, strides, dtypes,
    devices, batch): later layers and steps with the same tensors check only the step's page
    bound, and any change of a tensor is checked in full again."""
    from pkvrt.runtime import checks

    b, _ = pool
    rt = fake_runtime()
    cache = (b.k_cache, b.v_cache)
    calls = []
    monkeypatch.setattr(checks, "check_run_args", lambda *a, **k: calls.append(1) or check_run_args(*a, **k))
    seq, bt, q = step_inputs(b, [0, 1, 2], 0, seed=7)
    out = torch.empty_like(q)
    for i in range(3):
        rt.plan(seq, bt, force="pkv_workqueue")
        for _ in range(2):
            rt.run(q, *cache, out=out)
    assert len(calls) == 1
    with pytest.raises(ValueError, match="out: expected dtype"):      # another tensor: checked
        rt.run(q, *cache, out=out.float())
    with pytest.raises(ValueError, match=r"q: expected a contiguous \[B, H_q, D\]"):
        rt.run(q[:2], *cache, out=out)
    top = rt._step.max_page_id                                        # the step's largest page id
    small = (b.k_cache[:top + 1], b.v_cache[:top + 1])                # just enough pages for it
    n = len(calls)
    rt.run(q, *small, out=out)
    rt.run(q, *small, out=out)
    assert len(calls) == n + 1
    bt2 = bt.clone()
    bt2[0, 0] = top + 1                                               # the next step reads one page more
    rt.plan(seq, bt2, force="pkv_workqueue")
    with pytest.raises(ValueError, match=rf"page id {top + 1}: expected page ids < num_pages"):
        rt.run(q, *small, out=out)                                    # known signature: bound still read
    assert len(calls) == n + 1
    assert rt.run(q, *cache, out=out) is out


class CsrWrapper:
    """FlashInfer's decode wrapper as far as the Runtime's FlashInfer route drives it, in both
    modes: plan() records the CSR it is given (indices are a view onto the Runtime's device
    buffer, read at run() time as FlashInfer reads them); run() rebuilds lengths and block tables
    from that CSR and runs the FP32 reference."""

    def __init__(self, workspace, layout, *, use_tensor_cores, backend, use_cuda_graph=False,
                 paged_kv_indptr_buffer=None, paged_kv_indices_buffer=None,
                 paged_kv_last_page_len_buffer=None):
        assert layout == "HND" and backend == "fa2"   # FA2 named: "auto" re-decides every plan()
        self.planned = None

    def plan(self, indptr, indices, last_page_len, hq, hkv, d, page_size, **kw):
        assert not indptr.is_cuda and not last_page_len.is_cuda   # FlashInfer's host fast path
        self.planned = (indptr.clone(), indices, last_page_len.clone(), page_size)

    def run(self, q, kv, out):
        indptr, indices, last, ps = self.planned
        ptr = indptr.tolist()
        pages = [ptr[i + 1] - ptr[i] for i in range(len(ptr) - 1)]
        seq = torch.tensor([(n - 1) * ps + int(x) for n, x in zip(pages, last)])
        bt = torch.zeros(len(pages), max(pages), dtype=torch.int32)
        for r, n in enumerate(pages):
            bt[r, :n] = indices[ptr[r]:ptr[r] + n]
        out.copy_(reference.decode_attention(q, *kv, seq, bt).to(out.dtype))


class CsrModule:
    """A wrapper's compiled FlashInfer module: ``paged_run`` computes the reference from the
    planned CSR it is passed (positionally, with q, the caches and out among its arguments, as
    FlashInfer's run() calls its module) and counts its calls."""

    def __init__(self):
        self.calls = 0

    def paged_run(self, workspace, plan, q, k_cache, v_cache, out, lse=None, window_left=-1,
                  *extra):
        assert lse is None and window_left == -1 and (extra in ((), (1.0, None)) or extra[0] == 1.0)
        self.calls += 1
        CsrWrapper.run(types.SimpleNamespace(planned=plan.csr), q, (k_cache, v_cache), out)


class ModuleWrapper(CsrWrapper):
    """A wrapper whose run() builds its kernel's argument list from its plan and calls its
    module (``call``: "one" positional call, "twice" two calls, "keyword" out passed by keyword,
    "tuple" the caches passed again in a tuple, "view" a view of q passed besides q, "raise"
    run() raising)."""

    call = "one"

    def __init__(self, *a, **k):
        super().__init__(*a, **k)
        self._cached_module = CsrModule()
        self.runs = 0

    def run(self, q, kv, out):
        self.runs += 1
        # the plan's buffers in one opaque object, as FlashInfer passes its plan_info
        args = [object(), types.SimpleNamespace(csr=self.planned), q, kv[0], kv[1], out, None, -1,
                1.0, None]
        if self.call == "tuple":      # the caches once more, inside a tuple
            args[-1] = kv
        elif self.call == "view":     # a view of q besides q
            args[-1] = q.view(-1)
        elif self.call == "raise":
            raise RuntimeError("the wrapper's run() failed")
        if self.call == "keyword":
            self._cached_module.paged_run(*args[:5], out=out)
            return
        if self.call == "twice":
            self._cached_module.paged_run(*args)
        self._cached_module.paged_run(*args)


@pytest.mark.parametrize("graph_mode", [False, True], ids=["eager", "graph-mode"])
def test_fake_device_flashinfer_direct_run_replays_the_first_layers_call(fake_device, pool,
                                                                         monkeypatch, graph_mode):
    """Eager FlashInfer steps: the first two run()s after a plan() go through the wrapper's
    run() (the second recording its module call), later layers call its module's entry with
    that call's arguments and their own q, caches and out (per-layer caches and fresh q/out
    tensors give each layer's own answer); a new plan() records again. Graph mode never records
    (its run() is captured)."""
    monkeypatch.setitem(sys.modules, "flashinfer", types.SimpleNamespace(
        BatchDecodeWithPagedKVCacheWrapper=ModuleWrapper, __version__="0.7.2"))
    b, layer1 = pool
    rt = fake_runtime(flashinfer=True, flashinfer_cuda_graph=graph_mode, max_batch=8)
    caches = [(b.k_cache, b.v_cache), layer1, (b.k_cache, b.v_cache), layer1]
    for i, (rows, short) in enumerate(STEPS[:3]):
        seq, bt, q = step_inputs(b, rows, short, seed=40 + i)
        rt.plan(seq, bt, force="flashinfer")
        w = rt._fi._current
        runs_before, calls_before = w.runs, w._cached_module.calls
        for layer, cache in enumerate(caches):
            ql = q * (layer + 1)
            out = rt.run(ql.clone(), *cache, out=torch.full_like(q, float("nan")))
            assert rel_err(out, ref(ql, cache, seq, bt)) < 2e-3, (i, layer)
        assert not isinstance(w._cached_module, fi_route._Recorder)   # restored after recording
        if not graph_mode:
            assert w.runs - runs_before == 2                           # the first two layers only
            assert w._cached_module.calls - calls_before == len(caches)
    stats = rt.stats()["flashinfer"]
    if graph_mode:
        assert not stats["direct_run"] and stats["direct_calls"] == 0
    else:
        assert stats["direct_calls"] == 3 * (len(caches) - 2) and stats["direct_fallbacks"] == 0


@pytest.mark.parametrize("case", ["twice", "keyword", "tuple", "view", "q-is-out", "off"])
def test_fake_device_flashinfer_direct_run_falls_back_to_the_wrappers_run(fake_device, pool,
                                                                          monkeypatch, case):
    """A recording that is not one positional call holding each tensor once and nothing else on
    their memory (two module calls, a keyword argument, the caches again inside a tuple, a view
    of q, q that is out), or ``flashinfer_direct_run=False``: every layer runs the wrapper's
    run(), and the outputs are still each layer's."""
    monkeypatch.setattr(ModuleWrapper, "call", case if case in ("twice", "keyword", "tuple", "view")
                        else "one")
    monkeypatch.setitem(sys.modules, "flashinfer", types.SimpleNamespace(
        BatchDecodeWithPagedKVCacheWrapper=ModuleWrapper, __version__="0.7.2"))
    b, layer1 = pool
    rt = fake_runtime(flashinfer=True, max_batch=8, flashinfer_direct_run=case != "off")
    seq, bt, q = step_inputs(b, [0, 2, 3], 0, seed=50)
    rt.plan(seq, bt, force="flashinfer")
    w = rt._fi._current
    for layer, cache in enumerate([(b.k_cache, b.v_cache), layer1, layer1]):
        x = q.clone()
        out = rt.run(x, *cache, out=x if case == "q-is-out" else torch.full_like(q, float("nan")))
        assert rel_err(out, ref(q, cache, seq, bt)) < 2e-3, layer
    assert w.runs == 3
    stats = rt.stats()["flashinfer"]
    assert stats["direct_calls"] == 0
    assert stats["direct_fallbacks"] == (0 if case == "off" else 1)


def test_direct_call_recording_refuses_aliases_and_tensor_containers():
    """DirectCall.from_recording accepts one positional call holding q, k_cache, v_cache and out
    once each, and refuses anything a later layer would get wrong: q that is out or k_cache that
    is v_cache (passed once or twice), a view of one of them, a list, tuple or dict holding a
    tensor, a keyword argument, two calls."""
    q, out = torch.zeros(2, 4), torch.zeros(2, 4)
    k, v = torch.zeros(3, 4), torch.zeros(3, 4)

    def f(*a):
        pass

    def rec(*args, **kw):
        return [(f, args, kw)]

    ok = fi_route.DirectCall.from_recording(rec(1, q, k, v, out, None), q, k, v, out)
    assert ok is not None and ok.slots == (1, 2, 3, 4) and ok.args == [1, None, None, None, None, None]
    refused = {
        "q is out, once": (rec(q, k, v), q, k, v, q),
        "q is out, twice": (rec(q, k, v, q), q, k, v, q),
        "k is v, once": (rec(q, k, out), q, k, k, out),
        "k is v, twice": (rec(q, k, k, out), q, k, k, out),
        "view of out": (rec(q, k, v, out, out.view(-1)), q, k, v, out),
        "list with q": (rec(q, k, v, out, [q]), q, k, v, out),
        "dict with a tensor": (rec(q, k, v, out, {"a": torch.zeros(1)}), q, k, v, out),
        "tuple with a tensor": (rec(q, k, v, out, (1, torch.zeros(1))), q, k, v, out),
        "keyword": (rec(q, k, v, out=out), q, k, v, out),
        "two calls": (rec(q, k, v, out) * 2, q, k, v, out),
        "q missing": (rec(k, v, out), q, k, v, out),
    }
    for what, (calls, *tensors) in refused.items():
        assert fi_route.DirectCall.from_recording(calls, *tensors) is None, what


def test_fake_device_flashinfer_direct_run_state_per_step(fake_device, pool, monkeypatch):
    """The recorded call holds none of its layer's tensors; a two-layer step makes no direct
    call; a PersistentKV step between two FlashInfer steps leaves nothing behind (the next
    FlashInfer step records anew); a wrapper run() that raises while recording leaves the
    wrapper's module in place and the step on the wrapper path; a FlashInfer outside
    DIRECT_RUN_VERSIONS never records."""
    monkeypatch.setitem(sys.modules, "flashinfer", types.SimpleNamespace(
        BatchDecodeWithPagedKVCacheWrapper=ModuleWrapper, __version__="0.7.2"))
    b, layer1 = pool
    caches = [(b.k_cache, b.v_cache), layer1]
    rt = fake_runtime(flashinfer=True, max_batch=8)
    seq, bt, q = step_inputs(b, [0, 2, 3], 0, seed=60)
    rt.plan(seq, bt, force="flashinfer")
    for cache in caches:
        rt.run(q, *cache, out=torch.empty_like(q))
    d = rt._fi._direct
    assert d is not None and all(d.args[i] is None for i in d.slots)
    assert rt.stats()["flashinfer"]["direct_calls"] == 0            # two layers: nothing replayed
    rt.plan(seq, bt, force="pkv_workqueue")
    rt.run(q, *caches[0], out=torch.empty_like(q))
    rt.plan(seq, bt, force="flashinfer")
    w = rt._fi._current
    runs = w.runs
    for cache in caches + caches:
        out = rt.run(q, *cache, out=torch.full_like(q, float("nan")))
        assert rel_err(out, ref(q, cache, seq, bt)) < 2e-3
    assert w.runs - runs == 2 and rt.stats()["flashinfer"]["direct_calls"] == 2
    monkeypatch.setattr(ModuleWrapper, "call", "raise")
    rt.plan(seq, bt, force="flashinfer")
    for _ in range(2):   # the plain layer, then the recording one
        with pytest.raises(RuntimeError, match=r"run\(\) failed"):
            rt.run(q, *caches[0], out=torch.empty_like(q))
    assert isinstance(w._cached_module, CsrModule) and rt._fi._direct is None
    monkeypatch.setattr(ModuleWrapper, "call", "one")
    monkeypatch.setitem(sys.modules, "flashinfer", types.SimpleNamespace(
        BatchDecodeWithPagedKVCacheWrapper=ModuleWrapper, __version__="0.5.3"))
    old = fake_runtime(flashinfer=True, max_batch=8)
    assert old.stats()["flashinfer"]["direct_run"] is False


@pytest.mark.parametrize("graph_mode", [False, True], ids=["eager", "graph-mode"])
def test_fake_device_flashinfer_step_stages_the_csr_of_its_pages(fake_device, pool, monkeypatch,
                                                                 graph_mode):
    """A FlashInfer step's CSR is gathered by the Runtime straight into pinned staging (not by
    the router's to_csr): the arrays FlashInfer plans with are to_csr's, at up to 16 rows (the
    row loop) and beyond (the mask gather), and the output is the reference's. A negative page
    id is refused naming the entry, and the previous plan stays in effect."""
    from pkvrt.policy.blocktables import to_csr

    monkeypatch.setitem(sys.modules, "flashinfer", types.SimpleNamespace(
        BatchDecodeWithPagedKVCacheWrapper=CsrWrapper, __version__="0.7.2"))
    b, _ = pool
    rt = fake_runtime(flashinfer=True, flashinfer_cuda_graph=graph_mode, max_batch=24)
    assert rt.flashinfer_available
    cache = (b.k_cache, b.v_cache)
    for i, rows in enumerate(([4], [0, 1, 2, 3, 4, 5], [r % 6 for r in range(21)])):
        seq, bt, q = step_inputs(b, rows, i, seed=30 + i)
        d = rt.plan(seq, bt, force="flashinfer")
        assert d.kind == "flashinfer" and d.plan.indptr is None   # the router built no CSR
        w = rt._fi._current
        indptr, indices, last, ps = w.planned
        want = to_csr(seq, bt.numpy(), 16)
        assert indptr.tolist() == want[0].tolist() and last.tolist() == want[2].tolist()
        assert indices.tolist() == want[1].tolist() and ps == 16
        out = rt.run(q, *cache, out=torch.full_like(q, float("nan")))
        assert rel_err(out, ref(q, cache, seq, bt)) < 2e-3, rows
    bad = bt.clone()
    bad[3, 1] = -2
    with pytest.raises(ValueError, match=r"block_tables\[3, 1\] = -2: expected a page id >= 0"):
        rt.plan(seq, bad, force="flashinfer")
    out = rt.run(q, *cache, out=torch.full_like(q, float("nan")))   # the last good step's plan
    assert rel_err(out, ref(q, cache, seq, bt)) < 2e-3
    # without validate the gathered ids are still checked (FlashInfer would read outside the cache)
    lax = fake_runtime(flashinfer=True, flashinfer_cuda_graph=graph_mode, max_batch=24, validate=False)
    lax.plan(seq, bt, force="flashinfer")
    with pytest.raises(ValueError, match=r"block_tables\[3, 1\] = -2: expected a page id >= 0"):
        lax.plan(seq, bad, force="flashinfer")
    out = lax.run(q, *cache, out=torch.full_like(q, float("nan")))
    assert rel_err(out, ref(q, cache, seq, bt)) < 2e-3


# ----------------------------------------------------------------------------- the constructor's surface


def test_ablation_switches_live_in_runtime_options():
    from pkvrt.runtime.options import RuntimeOptions

    with pytest.raises(TypeError, match=r"use_cuda_graph, max_graphs: ablation switches, set through "
                                        r"options=pkvrt.RuntimeOptions\(use_cuda_graph=False, max_graphs=4\)"):
        Runtime(8, 2, 64, 16, use_cuda_graph=False, max_graphs=4)
    with pytest.raises(TypeError, match="unexpected keyword argument\\(s\\) 'layers'"):
        Runtime(8, 2, 64, 16, layers=32)
    with pytest.raises(ValueError, match="options=.*expected a pkvrt.RuntimeOptions"):
        Runtime(8, 2, 64, 16, options=dict(use_cuda_graph=False))
    for bad, match in ((dict(use_cuda_graph=1), "use_cuda_graph=1: expected True or False"),
                       (dict(max_graphs=0), "max_graphs=0: expected an int >= 1"),
                       (dict(decision_memo=-1), "decision_memo=-1"),
                       (dict(capture_routing="fast"), "capture_routing='fast'"),
                       (dict(layers_per_plan=0), "layers_per_plan=0")):
        with pytest.raises(ValueError, match=match):
            RuntimeOptions(**bad)


def test_the_first_plans_lengths_decide_device_planning(fake_device, pool, monkeypatch):  # noqa: F811
    """Built without device_planning: lengths on the GPU at the first plan() make it a
    device-planning Runtime (routes.toml's [device_planning] route, no FlashInfer, no host time
    weighed); host lengths keep it a host-routing one, and the first plan() decides for good."""
    from pkvrt.runtime import core

    b, _ = pool
    cache = (b.k_cache, b.v_cache)
    seq, bt, q = step_inputs(b, [0, 1, 2], 1, seed=2)
    monkeypatch.setattr(core, "lengths_on_gpu", lambda s: isinstance(s, torch.Tensor))
    rt = fake_runtime()
    assert rt._mode_open and not rt.device_planning
    d = rt.plan(torch.as_tensor(seq), torch.as_tensor(bt))
    assert rt.device_planning and d.route == rt.registry.device_planning_route(3).name
    assert not rt.router.weigh_host and not rt.flashinfer_available
    out = rt.run(q, *cache, out=torch.full_like(q, float("nan")))
    assert rel_err(out, ref(q, cache, seq, bt)) < 2e-3
    host = fake_runtime()
    host.plan(seq, bt)                                   # numpy lengths: host routing, for good
    host.plan(torch.as_tensor(seq), torch.as_tensor(bt))
    assert not host.device_planning and not host._mode_open
    fixed = fake_runtime(device_planning=False)          # said at construction: never switches
    fixed.plan(torch.as_tensor(seq), torch.as_tensor(bt))
    assert not fixed.device_planning
    for bad_seq, bad_bt, force, match in (
            (torch.as_tensor(seq).long(), torch.as_tensor(bt), None, "int32"),
            (torch.as_tensor(seq), torch.as_tensor(bt), "pkv_bucket", "force='pkv_bucket'")):
        undecided = fake_runtime()
        with pytest.raises(ValueError, match=match):
            undecided.plan(bad_seq, bad_bt, force=force)
        assert undecided._mode_open and not undecided.device_planning   # nothing changed
        undecided.plan(seq, bt)                                          # then host lengths decide
        assert not undecided._mode_open and not undecided.device_planning
    big = fake_runtime(max_batch=ops.PLAN_MAX_ROWS + 1)
    with pytest.raises(ValueError, match="max_batch=1025: device planning plans every step"):
        big.plan(torch.as_tensor(seq), torch.as_tensor(bt))
    assert big._mode_open and not big.device_planning    # nothing changed


def test_device_planning_inside_an_engine_capture_launches_into_it(fake_device, pool):  # noqa: F811
    """Device planning with the Runtime's graphs on: outside a capture it replays its own graphs;
    inside an engine's capture plan() and run() launch their kernels (the planning kernel in its
    direct mode) into the engine's graph instead of refusing. Host lengths with the Runtime's
    graphs still refuse a capture: their plan was staged outside it."""
    b, _ = pool
    cache = (b.k_cache, b.v_cache)
    rt = fake_runtime(device_planning=True, num_pages=b.k_cache.shape[0])
    seq, bt, q = step_inputs(b, [0, 1, 3], 0, seed=8)
    rt.plan(torch.as_tensor(seq), torch.as_tensor(bt))
    rt.run(q, *cache)
    before = rt.stats()
    direct = fake_device.direct
    rt._capturing = lambda: True
    rt.plan(torch.as_tensor(seq), torch.as_tensor(bt))
    out = rt.run(q, *cache, out=torch.full_like(q, float("nan")))
    after = rt.stats()
    assert fake_device.direct == direct + 1                  # one direct planning launch
    assert after["eager_runs"] == before["eager_runs"] + 1 and after["captures"] == before["captures"]
    assert rel_err(out, ref(q, cache, seq, bt)) < 2e-3
    host = fake_runtime()
    host.plan(seq, bt)
    host._capturing = lambda: True
    with pytest.raises(RuntimeError, match="a replay would run a stale plan"):
        host.run(q, *cache)


def _max_id(seq, bt):
    pages = -(-np.asarray(seq) // FAKE_SHAPE["page_size"])
    return max(int(bt[r, :n].max()) for r, n in enumerate(pages))


@pytest.mark.parametrize("route", ["pkv_workqueue", "pkv_fused"])
def test_fake_device_host_routing_page_bound_follows_the_callers_caches(fake_device, pool, route):
    """Host lengths on a route planned on the GPU: a num_pages the caller gave bounds every
    step's ids at plan() (the planning kernel would give a row past it no work: a wrong output);
    without one, a run() on a smaller cache does not lower the bound under a later step's valid
    ids on a larger cache; and a run() refused for its arguments sets no bound."""
    b, _ = pool
    cache = (b.k_cache, b.v_cache)
    seq, bt, q = step_inputs(b, [0, 2, 3], 0, seed=7)
    top = _max_id(seq, bt)
    given = fake_runtime(num_pages=top)
    with pytest.raises(ValueError, match=f"Runtime.plan: block_tables uses page id {top}: expected "
                                         f"page ids < num_pages = {top}"):
        given.plan(seq, bt, force=route)
    small_seq, small_bt, small_q = step_inputs(b, [3], 0, seed=8)   # a short row: low page ids
    low = _max_id(small_seq, small_bt)
    assert low < top
    rt = fake_runtime()
    rt.plan(small_seq, small_bt, force=route)
    view = (b.k_cache[:low + 1], b.v_cache[:low + 1])
    assert rel_err(rt.run(small_q, *view), ref(small_q, view, small_seq, small_bt)) < 2e-3
    with pytest.raises(ValueError, match="lse"):   # refused: must not set the bound either
        rt.run(small_q, *view, lse=torch.empty(1))
    rt.plan(seq, bt, force=route)
    out = rt.run(q, *cache, out=torch.full_like(q, float("nan")))
    assert rel_err(out, ref(q, cache, seq, bt)) < 2e-3
    assert rt.device_status() == 0


@pytest.mark.parametrize("kw, match", [
    (dict(device_planning="no"), "device_planning='no': expected True or False"),
    (dict(engine_capture=1), "engine_capture=1: expected True or False"),
    (dict(sm_scale=float("nan")), "sm_scale=nan: expected a finite number"),
    (dict(sm_scale="abc"), "sm_scale='abc': expected a finite number"),
])
def test_mode_flags_and_sm_scale_of_the_wrong_kind_are_refused(fake_device, kw, match):
    with pytest.raises(ValueError, match=match):
        fake_runtime(**kw)
    assert fake_runtime(sm_scale=np.float32(0.125)).sm_scale == 0.125   # any real number
