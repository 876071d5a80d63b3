"""The new coverage's host pieces, without a GPU: the FP32 twins of the attention variants
(sliding window, soft cap, sinks, lse) against a dense computation written out here, the exact
split/merge with sinks over arbitrary cuts, the windowed workqueue plan, the Runtime's shape and
variant refusals, and the build spec's symbols and shared-memory sizes for every served shape.

tests/gpu/test_coverage.py checks the kernels against the same twins on the H200.
"""

from __future__ import annotations

import math
import pathlib

import numpy as np
import pytest
import torch
from hypothesis import example, given, settings
from hypothesis import strategies as st

from pkvrt import _buildspec, reference
from pkvrt.launch import ops
from pkvrt.policy import planner
from pkvrt.policy.calibration import load_calibration
from pkvrt.policy.registry import load_routes
from pkvrt.runtime.checks import check_shape, check_variant

REPO = pathlib.Path(__file__).resolve().parents[1]
SEED = load_calibration(REPO / "calibration" / "rtx3060-seed.json")
LN2 = math.log(2.0)
BAD_PAGE = 10**6          # block-table padding: indexing the cache with it raises
DECODE_FAMILIES = ("split_decode", "workqueue_decode", "fused_decode")
H200_SMEM_OPTIN = 227 * 1024   # cudaDevAttrMaxSharedMemoryPerBlockOptin on the H200 (sm_90)


# ----------------------------------------------------------------------------- paged data


def paged_case(lens, *, hkv, g, d, page, seed, layout="HND", scale=2.0):
    """A small paged batch in float32: scattered pages (a random permutation with holes), NaN in
    every slot no row owns (unowned pages, row tails), out-of-range ids as block-table padding.
    Returns q [B, H_q, D], k, v as the twins index them ([P, H_kv, page, D]; with layout "NHD" the
    transposed view of an NHD tensor), seq_lens [B] int32, block_tables [B, W] int32."""
    gen = torch.Generator().manual_seed(seed)
    pages = [-(-n // page) for n in lens]
    universe = 2 * sum(pages) + 1
    perm = torch.randperm(universe, generator=gen)
    bt = torch.full((len(lens), max(pages) + 1), BAD_PAGE, dtype=torch.int32)
    owned = torch.zeros(universe, dtype=torch.bool)
    at = 0
    for i, p in enumerate(pages):
        bt[i, :p] = perm[at:at + p].int()
        owned[perm[at:at + p]] = True
        at += p
    caches = []
    for _ in range(2):
        c = torch.randn(universe, hkv, page, d, generator=gen) * scale
        c[~owned] = math.nan
        for i, n in enumerate(lens):
            if n % page:
                c[int(bt[i, pages[i] - 1]), :, n % page:] = math.nan
        caches.append(c if layout == "HND" else c.transpose(1, 2).contiguous().transpose(1, 2))
    q = torch.randn(len(lens), hkv * g, d, generator=gen)
    return q, caches[0], caches[1], torch.tensor(lens, dtype=torch.int32), bt


def poison_before_window(cache, bt, lens, window_left):
    """NaN in every token slot before each row's window (a twin that reads one fails)."""
    page = cache.shape[2]
    for i, n in enumerate(lens):
        for t in range(reference.window_start(n, window_left)):
            cache[int(bt[i, t // page]), :, t % page] = math.nan


def dense_row(q_row, k_cache, v_cache, bt_row, n, *, scale, window_left, cap, sinks):
    """One row's attention in float64, token by token: the row's tokens fetched through its
    block table one at a time, its window kept, scores s = scale * q.k (cap * tanh(s / cap)
    with a cap), one sink logit per head appended to the softmax and dropped after it.
    Returns (out [H_q, D], lse [H_q] = log2 sum_j exp(s_j), the sink not counted)."""
    page, hkv = k_cache.shape[2], k_cache.shape[1]
    hq, d = q_row.shape
    g = hq // hkv
    start = max(0, n - 1 - window_left) if window_left >= 0 else 0
    toks = list(range(start, n))
    k = torch.stack([k_cache[int(bt_row[t // page]), :, t % page] for t in toks], 1).double()
    v = torch.stack([v_cache[int(bt_row[t // page]), :, t % page] for t in toks], 1).double()
    out = torch.empty(hq, d, dtype=torch.float64)
    lse = torch.empty(hq, dtype=torch.float64)
    for h in range(hq):
        s = scale * (k[h // g] @ q_row[h].double())                      # [N]
        if cap > 0:
            s = cap * torch.tanh(s / cap)
        logits = s if sinks is None else torch.cat([s, sinks[h:h + 1].double()])
        p = torch.softmax(logits, 0)[:len(toks)]
        out[h] = p @ v[h // g]
        lse[h] = torch.logsumexp(s, 0) / LN2
    return out, lse


# ----------------------------------------------------------------------------- strategies


@st.composite
def variant_cases(draw):
    hkv = draw(st.sampled_from([1, 2]))
    g = draw(st.sampled_from([1, 2, 3, 5]))
    page = draw(st.sampled_from([1, 2, 4, 16]))
    lens = draw(st.lists(st.integers(1, 90), min_size=1, max_size=3))
    window = draw(st.sampled_from([-1, 0, 1, 7, 31, 40, 200]))
    cap = draw(st.sampled_from([0.0, 0.5, 5.0, 30.0, 50.0]))
    with_sinks = draw(st.booleans())
    sinks = None
    if with_sinks:   # logits up to 40: a sink that dominates every score
        sinks = torch.tensor(draw(st.lists(st.floats(-40.0, 40.0), min_size=hkv * g, max_size=hkv * g)),
                             dtype=torch.float32)
    sm_scale = draw(st.one_of(st.none(), st.sampled_from([168 ** -0.5, 0.05, 1.0, 1.7])))
    return dict(hkv=hkv, g=g, d=draw(st.sampled_from([4, 8, 16])), page=page, lens=lens,
                window=window, cap=cap, sinks=sinks, sm_scale=sm_scale,
                layout=draw(st.sampled_from(["HND", "NHD"])), seed=draw(st.integers(0, 2**31 - 1)))


# ----------------------------------------------------------------------------- the twins


@settings(max_examples=60, deadline=None)
@given(case=variant_cases())
def test_reference_variants_equal_a_dense_computation(case):
    """decode_attention with window / soft cap / sinks / sm_scale / lse equals the dense row-by-row
    computation (any cache strides: NHD caches as transposed views; tokens before the window, row
    tails and unowned pages NaN; block-table padding out of range)."""
    c = case
    q, k, v, seq, bt = paged_case(c["lens"], hkv=c["hkv"], g=c["g"], d=c["d"], page=c["page"],
                                  seed=c["seed"], layout=c["layout"])
    for cache in (k, v):
        poison_before_window(cache, bt, c["lens"], c["window"])
    out, lse = reference.decode_attention(q, k, v, seq, bt, c["sm_scale"], window_left=c["window"],
                                          logits_soft_cap=c["cap"], sinks=c["sinks"], return_lse=True)
    assert out.dtype == torch.float32 and lse.dtype == torch.float32
    assert lse.shape == (len(c["lens"]), c["hkv"] * c["g"])
    scale = c["sm_scale"] if c["sm_scale"] is not None else 1.0 / math.sqrt(c["d"])
    for i, n in enumerate(c["lens"]):
        want, want_lse = dense_row(q[i], k, v, bt[i], n, scale=scale, window_left=c["window"],
                                   cap=c["cap"], sinks=c["sinks"])
        torch.testing.assert_close(out[i].double(), want, rtol=1e-4, atol=1e-5)
        torch.testing.assert_close(lse[i].double(), want_lse, rtol=1e-5, atol=1e-4)
    # without return_lse: the same output alone
    alone = reference.decode_attention(q, k, v, seq, bt, c["sm_scale"], window_left=c["window"],
                                       logits_soft_cap=c["cap"], sinks=c["sinks"])
    assert torch.equal(alone, out)


def test_reference_variant_examples():
    """Hand-checked cases: window 0 keeps the last token alone (O = its V, lse = its score in
    log2); a sink equal to that score halves O; a cap bounds the scores."""
    q, k, v, seq, bt = paged_case([5, 40], hkv=1, g=2, d=8, page=4, seed=3)
    out, lse = reference.decode_attention(q, k, v, seq, bt, window_left=0, return_lse=True)
    for i, n in enumerate([5, 40]):
        last_k = reference.gather_kv(k, bt[i], n)[0, n - 1]
        last_v = reference.gather_kv(v, bt[i], n)[0, n - 1]
        torch.testing.assert_close(out[i], last_v.expand(2, 8))
        s = (q[i] @ last_k) / math.sqrt(8)
        torch.testing.assert_close(lse[i], s / LN2)
        sinks = s.float()   # the sink logit equals the only score: half the weight
        half = reference.decode_attention(q[i:i + 1], k, v, seq[i:i + 1], bt[i:i + 1], window_left=0,
                                          sinks=sinks)
        torch.testing.assert_close(half[0], last_v.expand(2, 8) / 2)
    _, capped = reference.decode_attention(q * 100, k, v, seq, bt, logits_soft_cap=3.0, window_left=0,
                                           return_lse=True)
    assert (capped.abs() <= 3.0 / LN2 + 1e-5).all()
    # window_left >= len - 1 is the whole row
    full = reference.decode_attention(q, k, v, seq, bt)
    assert torch.equal(reference.decode_attention(q, k, v, seq, bt, window_left=39), full)
    assert [reference.window_start(n, w) for n, w in [(5, -1), (5, 0), (5, 4), (5, 9), (1, 0)]] == [0, 4, 0, 0, 0]


@st.composite
def split_cases(draw):
    hkv = draw(st.sampled_from([1, 2]))
    g = draw(st.sampled_from([1, 3, 4]))
    n = draw(st.integers(1, 120))
    cuts = sorted(draw(st.lists(st.integers(0, n), min_size=0, max_size=6)))
    lead = draw(st.integers(0, 2))    # empty splits before and after the range
    tail = draw(st.integers(0, 2))
    cuts = [0] * (lead + 1) + cuts + [n] * (tail + 1)
    with_sinks = draw(st.booleans())
    sinks = (torch.tensor(draw(st.lists(st.floats(-30.0, 30.0), min_size=hkv * g, max_size=hkv * g)),
                          dtype=torch.float32) if with_sinks else None)
    return dict(hkv=hkv, g=g, n=n, cuts=cuts, sinks=sinks,
                cap=draw(st.sampled_from([0.0, 1.0, 30.0])),
                scale=draw(st.sampled_from([0.125, 168 ** -0.5, 1.3])),
                seed=draw(st.integers(0, 2**31 - 1)), perm_seed=draw(st.integers(0, 1000)))


@settings(max_examples=80, deadline=None)
@given(case=split_cases())
# logits up to ~30 (scale 1.3, q and k of std 2): two splits' rescaling by exp(m_i - m) differ
# from one pass by a few float32 ulps of the output's scale (3.4e-6 at |out| ~ 0.06 here)
@example(case=dict(hkv=2, g=3, n=61, cuts=[0, 45, 61], sinks=None, cap=0.0, scale=1.3, seed=2906,
                   perm_seed=0))
def test_split_states_merge_exactly_with_sinks(case):
    """split_state over arbitrary cuts (empty splits included, in any order) merged by
    merge_states(..., sinks, return_lse=True) equals the one-split state merged alone and the
    dense computation: the merge is exact, the sink counted once, lse without it."""
    c = case
    hq, d = c["hkv"] * c["g"], 8
    gen = torch.Generator().manual_seed(c["seed"])
    q = torch.randn(hq, d, generator=gen) * 2
    k = torch.randn(c["hkv"], c["n"], d, generator=gen) * 2
    v = torch.randn(c["hkv"], c["n"], d, generator=gen)
    cuts = c["cuts"]
    states = [reference.split_state(q, k[:, a:b], v[:, a:b], c["scale"], c["cap"])
              for a, b in zip(cuts[:-1], cuts[1:])]
    order = torch.randperm(len(states), generator=torch.Generator().manual_seed(c["perm_seed"]))
    m, l, a = (torch.stack([s[j] for j in order.tolist()]) for s in zip(*states))
    assert m.shape == (len(cuts) - 1, hq)
    out, lse = reference.merge_states(m, l, a, c["sinks"], return_lse=True)
    m1, l1, a1 = reference.split_state(q, k, v, c["scale"], c["cap"])
    one, one_lse = reference.merge_states(m1[None], l1[None], a1[None], c["sinks"], return_lse=True)
    torch.testing.assert_close(out, one, rtol=2e-5, atol=1e-5)
    torch.testing.assert_close(lse, one_lse, rtol=1e-5, atol=1e-5)
    # the dense twin over the same tokens (one page per token, identity block table)
    kc, vc = k.transpose(0, 1)[:, :, None], v.transpose(0, 1)[:, :, None]    # [N, H_kv, 1, D]
    want, want_lse = dense_row(q, kc, vc, torch.arange(c["n"]), c["n"], scale=c["scale"],
                               window_left=-1, cap=c["cap"], sinks=c["sinks"])
    torch.testing.assert_close(out.double(), want, rtol=1e-4, atol=1e-5)
    torch.testing.assert_close(lse.double(), want_lse, rtol=1e-5, atol=1e-4)
    # without return_lse: the output alone, identical
    assert torch.equal(reference.merge_states(m, l, a, c["sinks"]), out)


def test_empty_split_state_is_the_identity_of_the_merge():
    q, k, v = torch.randn(4, 8), torch.randn(2, 0, 8), torch.randn(2, 0, 8)
    m, l, a = reference.split_state(q, k, v, 0.3, 5.0)
    assert torch.isinf(m).all() and (m < 0).all() and (l == 0).all() and (a == 0).all()
    k1, v1 = torch.randn(2, 9, 8), torch.randn(2, 9, 8)
    s = reference.split_state(q, k1, v1, 0.3, 5.0)
    sinks = torch.tensor([0.0, 50.0, -50.0, 2.0])
    both = reference.merge_states(torch.stack([m, s[0]]), torch.stack([l, s[1]]), torch.stack([a, s[2]]),
                                  sinks, return_lse=True)
    alone = reference.merge_states(s[0][None], s[1][None], s[2][None], sinks, return_lse=True)
    for x, y in zip(both, alone):
        torch.testing.assert_close(x, y)


# ----------------------------------------------------------------------------- windowed plans


WQ = load_routes(REPO / "routes.toml")
WINDOW_LEFTS = [0, 1, 31, 32, 127, 1000, 4095, 50000]


@settings(max_examples=80, deadline=None)
@given(seq=st.lists(st.one_of(st.integers(1, 100), st.integers(1, 6000), st.integers(6000, 70000)),
                    min_size=1, max_size=16),
       window=st.sampled_from(WINDOW_LEFTS), hkv=st.sampled_from([1, 2, 8]),
       route=st.sampled_from(["pkv_workqueue", "pkv_fused"]))
def test_windowed_plan_partitions_each_rows_window(seq, window, hkv, route):
    """plan_workqueue(..., window_left=w): per (row, KV head) the tasks cut [window_start, len)
    into contiguous non-empty ranges, splits 0..S-1 in token order, each starting a whole number
    of tiles after the window start; the split counts and offsets are those of the unwindowed plan
    of the attended lengths len - window_start, and so are the tasks, offset by the start."""
    r = WQ.route(route)
    seq = np.asarray(seq, dtype=np.int32)
    kw = dict(num_kv_heads=hkv, num_qo_heads=4 * hkv, head_dim=128, dtype_bytes=2, splits=r.splits,
              cal=SEED, kind=r.kind)
    plan = planner.plan_workqueue(seq, window_left=window, **kw)
    start = np.array([reference.window_start(int(n), window) for n in seq], dtype=np.int64)
    np.testing.assert_array_equal(planner.window_starts(seq.astype(np.int64), window), start)
    attended = (seq - start).astype(np.int32)
    flat = planner.plan_workqueue(attended, **kw)
    np.testing.assert_array_equal(plan.num_splits, flat.num_splits)
    np.testing.assert_array_equal(plan.split_offsets, flat.split_offsets)
    shifted = flat.tasks.astype(np.int64)
    shifted[:, 3:5] += start[shifted[:, 0]][:, None]
    np.testing.assert_array_equal(plan.tasks.astype(np.int64), shifted)

    t = plan.tasks.astype(np.int64)
    assert plan.tasks.dtype == np.int32 and len(t) == int(plan.num_splits.sum()) * hkv
    row, kvh, split, b, e = t.T
    assert (e > b).all() and (b >= start[row]).all() and (e <= seq[row]).all()
    assert ((b - start[row]) % _buildspec.TILE_TOKENS == 0).all()
    for i, n in enumerate(seq.tolist()):
        for h in range(hkv):
            mine = t[(row == i) & (kvh == h)]
            mine = mine[np.argsort(mine[:, 3])]
            assert len(mine) == plan.num_splits[i] >= 1
            assert mine[0, 3] == start[i] and mine[-1, 4] == n
            np.testing.assert_array_equal(mine[1:, 3], mine[:-1, 4])       # no gap, no overlap
            np.testing.assert_array_equal(mine[:, 2], np.arange(len(mine)))


def test_window_of_every_row_or_none_is_the_plain_plan():
    """window_left -1, or at least every row's length - 1, plans exactly what no window plans."""
    seq = np.array([1, 33, 5000, 40000, 7], dtype=np.int32)
    kw = dict(num_kv_heads=2, num_qo_heads=16, head_dim=128, dtype_bytes=2,
              splits=WQ.route("pkv_workqueue").splits, cal=SEED)
    plain = planner.plan_workqueue(seq, **kw)
    for w in (-1, 39999, 10**6):
        p = planner.plan_workqueue(seq, window_left=w, **kw)
        np.testing.assert_array_equal(p.tasks, plain.tasks)
        np.testing.assert_array_equal(p.split_offsets, plain.split_offsets)
    # window 0: every row one token, its last
    p = planner.plan_workqueue(seq, window_left=0, **kw)
    assert (p.num_splits == 1).all()
    np.testing.assert_array_equal(p.tasks[:, 4] - p.tasks[:, 3], np.ones(len(p.tasks)))
    np.testing.assert_array_equal(p.tasks[:, 4], seq[p.tasks[:, 0]])


# ----------------------------------------------------------------------------- refusals


SHAPE_OK = dict(num_qo_heads=16, num_kv_heads=2, head_dim=128, page_size=16, dtype=torch.float16)
FP8 = torch.float8_e4m3fn


@pytest.mark.parametrize("kw, match", [
    (dict(num_qo_heads=130, num_kv_heads=2), r"num_qo_heads / num_kv_heads = 65.*group size"),
    (dict(num_qo_heads=65, num_kv_heads=1), r"= 65.*group size"),
    (dict(head_dim=80), r"head_dim=80"),
    (dict(head_dim=512), r"head_dim=512"),
    (dict(page_size=256), r"page_size=256"),
    (dict(page_size=48), r"page_size=48"),
    (dict(num_qo_heads=15), r"num_qo_heads=15.*multiple of num_kv_heads=2"),
    (dict(head_dim=96, kv_dtype=FP8), r"e4m3 K/V at head_dim 96"),
    (dict(head_dim=256, num_qo_heads=24, kv_dtype=FP8), r"e4m3 K/V at head_dim 256 with group size 12"),
    (dict(head_dim=256, num_qo_heads=18, kv_dtype=FP8), r"e4m3 K/V at head_dim 256 with group size 9"),
    (dict(dtype=FP8), r"dtype=.*float8.*kv_dtype"),
    (dict(dtype=torch.float32), r"dtype=torch.float32"),
    (dict(kv_dtype=torch.bfloat16), r"kv_dtype=torch.bfloat16"),
])
def test_check_shape_refusals_name_the_argument(kw, match):
    args = dict(SHAPE_OK, **kw)
    kv = args.pop("kv_dtype", None)
    with pytest.raises(ValueError, match=match):
        check_shape(*args.values(), kv_dtype=kv)


@pytest.mark.parametrize("kw", [
    dict(num_qo_heads=32, num_kv_heads=2),                      # G 16
    dict(num_qo_heads=24, num_kv_heads=8),                      # G 3
    dict(num_qo_heads=28, num_kv_heads=4),                      # G 7 (Qwen2.5-7B)
    dict(num_qo_heads=32, num_kv_heads=32, head_dim=96),        # Phi-3
    dict(num_qo_heads=16, num_kv_heads=8, head_dim=256),        # Gemma-2
    dict(num_qo_heads=64, num_kv_heads=8, head_dim=64),         # gpt-oss
    dict(page_size=1), dict(page_size=128),
    dict(num_qo_heads=24, kv_dtype=FP8),                        # e4m3 G 12 at D 128
    dict(num_qo_heads=16, head_dim=256, kv_dtype=FP8),          # e4m3 G 8 at D 256
    dict(num_qo_heads=32, head_dim=64, kv_dtype=FP8),           # e4m3 G 16 at D 64
    dict(dtype=torch.bfloat16, kv_dtype=torch.bfloat16),
])
def test_check_shape_accepts_the_new_coverage(kw):
    args = dict(SHAPE_OK, **kw)
    kv = args.pop("kv_dtype", None)
    assert check_shape(*args.values(), kv_dtype=kv) == args["num_qo_heads"] // args["num_kv_heads"]


@pytest.mark.parametrize("kw, match", [
    (dict(kv_layout="XYZ"), r"kv_layout='XYZ'"),
    (dict(kv_layout="hnd"), r"kv_layout='hnd'"),
    (dict(window_left=-2), r"window_left=-2"),
    (dict(window_left=3.0), r"window_left=3.0"),
    (dict(window_left=True), r"window_left=True"),
    (dict(logits_soft_cap=-1), r"logits_soft_cap=-1"),
    (dict(logits_soft_cap=float("nan")), r"logits_soft_cap=nan"),
    (dict(logits_soft_cap=float("inf")), r"logits_soft_cap=inf"),
    (dict(logits_soft_cap="big"), r"logits_soft_cap='big'"),
    (dict(sinks=1), r"sinks=1"),
])
def test_check_variant_refusals_name_the_argument(kw, match):
    args = dict(dict(kv_layout="HND", window_left=-1, logits_soft_cap=0.0, sinks=False), **kw)
    with pytest.raises(ValueError, match=match):
        check_variant(**args)


def test_check_variant_accepts_the_variants():
    assert check_variant("NHD", 127, 50, True) == ("NHD", 127, 50.0, True)
    assert check_variant("HND", -1, 0, False) == ("HND", -1, 0.0, False)
    assert check_variant("HND", np.int64(4095), 30.0, False)[1] == 4095
    assert check_variant("HND", 0, 0.0, False)[1] == 0


# ----------------------------------------------------------------------------- build spec


@pytest.mark.parametrize("family", DECODE_FAMILIES)
def test_every_group_and_head_dim_has_a_symbol(family):
    """Every G in 1..64 at every D: a fp16 (and bf16) kernel of its group capacity, built."""
    built = set(_buildspec.symbols(family))
    assert _buildspec.GROUP_SIZES == tuple(range(1, 65))
    for d in _buildspec.HEAD_DIMS:
        for g in range(1, 65):
            gc = _buildspec.group_class(g)
            assert gc == min(c for c in (4, 8, 16, 64) if c >= g)
            assert _buildspec.unserved(d, g) is None
            for dt in ("f16", "bf16"):
                sym = _buildspec.symbol(family, dt, d, g)
                assert sym == f"pkv_{family}_{dt}_d{d}_gc{gc}" and sym in built, (d, g, sym)
            e4m3 = _buildspec.unserved(d, g, "e4m3")
            served = d in (64, 128) or (d == 256 and g <= 8)
            assert (e4m3 is None) == served, (d, g, e4m3)
            sym = _buildspec.symbol(family, "f16", d, g, "e4m3")
            assert (sym in built) == served and sym.endswith(f"_e4m3_d{d}_gc{gc}")
    for bad in (0, 65):
        with pytest.raises(ValueError, match="group size"):
            _buildspec.group_class(bad)
    assert "group size 65" in _buildspec.unserved(128, 65) and "head_dim 80" in _buildspec.unserved(80, 4)


def served_shapes():
    for d in _buildspec.HEAD_DIMS:
        for g in _buildspec.GROUP_SIZES:
            for kv, kv_bytes in ((None, 2), ("e4m3", 1)):
                if _buildspec.unserved(d, g, kv) is None:
                    yield d, g, kv, kv_bytes


def test_decode_smem_fits_the_h200_for_every_served_shape():
    shapes = list(served_shapes())
    assert len(shapes) == 4 * 64 + (64 + 64 + 8)
    for d, g, kv, kv_bytes in shapes:
        smem = ops.decode_smem_bytes(d, g, kv_bytes)
        assert 0 < smem <= H200_SMEM_OPTIN, (d, g, kv, smem)
        gc = _buildspec.group_class(g)
        # the states fit too: each warp's (narrow body), or the wide body's at most 64 heads
        assert smem >= (1 if gc > 16 else 4) * gc * (d + 2) * 4, (d, g, kv)
        assert smem == ops.decode_smem_bytes(d, gc, kv_bytes), "one size per group capacity"


def test_decode_smem_is_the_pipeline_at_d128():
    pipe = 3 * 4 * 2 * 16 * 128 * 2
    assert pipe == 96 * 1024
    for g in range(1, 9):
        assert ops.decode_smem_bytes(128, g, 2) == pipe, g
        assert ops.decode_smem_bytes(128, g, 1) == pipe, g    # e4m3: twice the stages, half the bytes
    # D 96 rows are padded to 104 elements; D 256 runs 2 stages
    assert ops.decode_smem_bytes(96, 4, 2) == 3 * 4 * 2 * 16 * 104 * 2
    for g in (1, 8, 16):   # the pipeline (128 KB) is larger than the states (66 KB at capacity 16)
        assert ops.decode_smem_bytes(256, g, 2) == 2 * 4 * 2 * 16 * 256 * 2 == 128 * 1024
    assert ops.decode_smem_bytes(256, 8, 1) == 4 * 4 * 2 * 16 * 256 * 1
    assert ops.decode_smem_bytes(64, 16, 2) == max(3 * 4 * 2 * 16 * 64 * 2, 4 * 16 * 66 * 4)


# ----------------------------------------------------------------------------- calibration


def test_a_group_size_without_its_own_constants_takes_the_nearest_calibrated_ones(tmp_path):
    """The H200 file cut to G 1, 4 (top level) and 8 (as it was before its other group sizes were
    calibrated): a group size without its entry takes the nearest on a log scale (ties to the
    top level), and the Router sees the same constants. The shipped file's own entries are
    each its group's."""
    import json
    import pathlib

    from pkvrt.policy.calibration import load_calibration
    h200 = pathlib.Path(__file__).resolve().parents[1] / "calibration" / "nvidia-h200.json"
    shipped = load_calibration(h200)
    assert {g: shipped.calibrated_group(g) for g in (1, 2, 3, 4, 5, 7, 8, 16)} == \
        {g: g for g in (1, 2, 3, 4, 5, 7, 8, 16)}
    doc = json.loads(h200.read_text())
    for section in ("splits", "time_model"):
        doc[section]["by_group"] = {k: v for k, v in doc[section]["by_group"].items() if k in ("1", "8")}
    (tmp_path / "cut.json").write_text(json.dumps(doc))
    cal = load_calibration(tmp_path / "cut.json")
    want = {1: 1, 2: 4, 3: 4, 4: 4, 5: 4, 6: 8, 7: 8, 8: 8, 9: 8, 12: 8, 16: 8}
    assert {g: cal.calibrated_group(g) for g in want} == want
    g8 = cal.for_group(8)
    assert cal.for_group(cal.calibrated_group(16)).splits == g8.splits
    folded = cal.for_group(cal.calibrated_group(7))
    assert folded.calibrated_group(7) == 4 and folded.for_group(4).splits == g8.splits   # no entries left
    with pytest.raises(ValueError, match="group_size"):
        cal.calibrated_group(0)


def test_a_windowed_router_routes_on_the_window_and_plans_from_the_window_start():
    """Router(window_left=W): decide() prices each row at its last W + 1 tokens (a row of 30000
    tokens under a 128-token window is a short row for the gates and costs), and full_plan's
    workqueue tasks cover [len - W - 1, len) of each row."""
    import pathlib

    from pkvrt.policy.calibration import load_calibration
    from pkvrt.policy.registry import load_routes
    from pkvrt.policy.router import Router
    repo = pathlib.Path(__file__).resolve().parents[1]
    reg = load_routes(repo / "routes.toml")
    cal = load_calibration(repo / "calibration" / "rtx3060-seed.json")
    kw = dict(num_qo_heads=32, num_kv_heads=8, head_dim=128, page_size=16)
    seq = np.array([30000, 2000, 100, 45000], np.int32)
    win = Router(reg, cal, window_left=127, **kw)
    d = win.decide(seq)
    assert d.max_context == 128 and "min_context" in d.refused.get("pkv_workqueue", "min_context")
    short = Router(reg, cal, **kw).decide(np.minimum(seq, 128))
    assert d.predicted_us == short.predicted_us
    plan = win.full_plan("pkv_workqueue", seq)
    for row, n in enumerate(seq.tolist()):
        spans = sorted((b, e) for r, h, _, b, e in plan.tasks.tolist() if r == row and h == 0)
        assert spans[0][0] == max(0, n - 128) and spans[-1][1] == n
        assert all(a[1] == b[0] for a, b in zip(spans, spans[1:]))
