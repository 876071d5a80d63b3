"""Planners: workqueue coverage and bounds, bucket grouping, counters by hand, the bimodal B8 case."""

from __future__ import annotations

import pathlib

import attrs
import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from hypothesis.extra import numpy as hnp

from pkvrt._buildspec import TILE_TOKENS
from pkvrt.policy import planner
from pkvrt.policy.blocktables import to_csr
from pkvrt.policy.calibration import SplitPoints, load_calibration
from pkvrt.policy.planner import (BucketPlan, WorkqueuePlan, bucket_counters, check_seq_lens,
                                  clamp_splits, plan_bucket, plan_flashinfer, plan_fused,
                                  plan_workqueue, split_capacity, split_tile_range,
                                  workqueue_counters)
from pkvrt.policy.registry import SplitBounds, load_routes

SEED = load_calibration(pathlib.Path(__file__).resolve().parents[1] / "calibration" / "rtx3060-seed.json")
SHAPE = dict(num_kv_heads=8, num_qo_heads=32, head_dim=128, dtype_bytes=2)
WQ_BOUNDS = SplitBounds(min=1, max=64, multiple_of=4)      # routes.toml's workqueue bounds
BUCKET_BOUNDS = SplitBounds(min=4, max=64, multiple_of=4)  # routes.toml's bucket bounds


# ----------------------------------------------------------------------------- strategies


@st.composite
def bounds(draw) -> SplitBounds:
    m = draw(st.sampled_from((1, 2, 4, 8)))
    lo = draw(st.sampled_from((1, m, 2 * m, 4 * m)))
    hi = draw(st.integers(max(lo, 2) // m, 16)) * m
    return SplitBounds(min=lo, max=max(lo, hi), multiple_of=m)


@st.composite
def cals(draw):
    return attrs.evolve(
        SEED, sm_count=draw(st.integers(1, 200)),
        splits=SplitPoints(bucket_ctas_per_sm=draw(st.floats(0.1, 100)),
                           workqueue_ctas_per_sm=draw(st.floats(0.1, 100)),
                           min_split_tokens=draw(st.integers(1, 2048)),
                           cta_overhead_tiles=draw(st.floats(0.0, 16.0)),
                           co_resident_slowdown=draw(st.floats(1.0, 3.0))))


lengths = st.one_of(st.integers(1, 100), st.integers(1, 5000), st.integers(16000, 140000))
seqs = hnp.arrays(np.int32, st.integers(1, 64), elements=lengths)
heads = st.sampled_from(((8, 32), (2, 16), (1, 1), (4, 4)))


def tiles_of(seq):
    return -(-np.asarray(seq, dtype=np.int64) // TILE_TOKENS)


# ----------------------------------------------------------------------------- workqueue


def check_workqueue(plan: WorkqueuePlan, seq, sb: SplitBounds, num_kv_heads: int, cal):
    seq = np.asarray(seq, dtype=np.int64)
    t = plan.tasks.astype(np.int64)
    assert plan.tasks.dtype == np.int32 and t.shape == (int(plan.num_splits.sum()) * num_kv_heads, 5)
    row, kvh, split, b, e = t.T
    # no empty task; boundaries on tiles; inside the row
    assert (e > b).all() and (b % TILE_TOKENS == 0).all() and (e <= seq[row]).all()
    assert ((kvh >= 0) & (kvh < num_kv_heads)).all()
    assert ((split >= 0) & (split < plan.num_splits[row])).all()
    # (row, kvh) token ranges cover [0, seq_len) exactly once, splits in token order
    order = np.lexsort((b, kvh, row))
    row, kvh, split, b, e = (x[order] for x in (row, kvh, split, b, e))
    first = np.r_[True, (row[1:] != row[:-1]) | (kvh[1:] != kvh[:-1])]
    last = np.r_[first[1:], True]
    assert (b[first] == 0).all() and (e[last] == seq[row[last]]).all()
    assert (b[~first] == e[np.flatnonzero(~first) - 1]).all()
    assert (split[~first] == split[np.flatnonzero(~first) - 1] + 1).all()
    assert first.sum() == seq.size * num_kv_heads
    # split_offsets: exclusive prefix sum of num_splits
    ns = plan.num_splits.astype(np.int64)
    assert plan.split_offsets.dtype == np.int32 and plan.num_splits.dtype == np.int32
    assert plan.split_offsets[0] == 0 and (np.diff(plan.split_offsets) == ns).all()
    # split counts: the balanced partition's chunk c bounds every split, a row that fits one
    # chunk is not split, and no row has more splits than the longest row's candidate
    p = planner.balanced_partition(seq, num_kv_heads=num_kv_heads, splits=sb, cal=cal)
    tiles = tiles_of(seq)
    assert (ns == -(-tiles // p.chunk_tiles)).all() and (ns >= 1).all() and (ns <= tiles).all()
    assert (ns[tiles <= p.chunk_tiles] == 1).all()
    assert ((e - b) <= p.chunk_tiles * TILE_TOKENS).all()
    assert ns.max() <= p.longest_splits <= max(sb.max, 1) or p.longest_splits == max(1, tiles.max() // -(-cal.splits.min_split_tokens // TILE_TOKENS))


@settings(max_examples=150, deadline=None)
@given(seq=seqs, sb=bounds(), cal=cals(), hd=heads)
def test_workqueue_tasks_cover_every_row_and_head_once(seq, sb, cal, hd):
    kvh, qoh = hd
    plan = plan_workqueue(seq, num_kv_heads=kvh, num_qo_heads=qoh, head_dim=128, dtype_bytes=2, splits=sb, cal=cal)
    check_workqueue(plan, seq, sb, kvh, cal)
    c = plan.counters
    slots = int(plan.num_splits.sum())
    assert (c.launches, c.merge_launches, c.decode_ctas) == (2, 1, len(plan.tasks))
    assert c.cta_work_per_sm == pytest.approx(len(plan.tasks) / cal.sm_count)
    assert c.merge_bytes == slots * qoh * (4 * 128 + 8) * 2
    assert c.useful_kv_bytes == int(seq.astype(np.int64).sum()) * kvh * 128 * 2 * 2
    assert workqueue_counters(seq, num_kv_heads=kvh, num_qo_heads=qoh, head_dim=128, dtype_bytes=2,
                              splits=sb, cal=cal) == c


def _brute_force_partition(seq, sb, cal, hkv):
    """The partition's choice computed again, one candidate at a time, in plain Python ints."""
    tiles = [int(t) for t in tiles_of(seq)]
    min_tiles = -(-cal.splits.min_split_tokens // TILE_TOKENS)
    m = planner.PartitionModel.of(cal)
    sms, wave, f8 = m.sms, m.wave, m.overhead8
    load = lambda k: 8 + (k - 1) * (m.slowdown8 - 8)  # noqa: E731
    longest = max(tiles)
    cands = [s for s in sb.candidates() if -(-longest // s) >= min_tiles] or [max(1, longest // min_tiles)]
    best = None
    for i, s in enumerate(cands):
        c = -(-longest // s)
        n = [-(-t // c) for t in tiles]
        ctas = hkv * sum(n)
        big = hkv * sum(k for t, k in zip(tiles, n) if 2 * -(-t // k) > c)
        small_tiles = hkv * sum(t for t, k in zip(tiles, n) if t > 0 and 2 * -(-t // k) <= c)
        loads = big // wave * load(m.resident) + (load(-(-(big % wave) // sms)) if big % wave else 0)
        beside = (8 * small_tiles + (ctas - big) * f8) * (m.slowdown8 - 8)
        work = 8 * hkv * sum(tiles) + ctas * f8     # at the best throughput: N > S may double up
        floor = work * load(m.resident) // m.resident if ctas > sms else work * 8
        cost = max((8 * c + f8) * loads * sms + beside, floor)
        if i > 0 and ctas > planner.MAX_WAVES * wave:
            continue
        if best is None or (cost, ctas, s) < best[:3]:
            best = (cost, ctas, s, c)
    return best


@settings(max_examples=150, deadline=None)
@given(seq=seqs, sb=bounds(), cal=cals(), hd=heads)
def test_balanced_partition_is_the_least_cost_candidate(seq, sb, cal, hd):
    kvh, _ = hd
    p = planner.balanced_partition(seq, num_kv_heads=kvh, splits=sb, cal=cal)
    cost, ctas, s, c = _brute_force_partition(seq, sb, cal, kvh)
    assert (p.cost, p.ctas, p.longest_splits, p.chunk_tiles) == (cost, ctas, s, c)


def test_balanced_partition_examples():
    """H200-like constants (132 SMs, two resident CTAs per SM, slowdown 1.4, CTA overhead 6 tiles,
    64-token floor): the worked example of partition_costs and ragged steps of the engine protocol."""
    cal = attrs.evolve(SEED, sm_count=132, splits=SplitPoints(
        bucket_ctas_per_sm=0.97, workqueue_ctas_per_sm=2.0, min_split_tokens=64, cta_overhead_tiles=6.0,
        co_resident_slowdown=1.4))
    part = lambda seq: planner.balanced_partition(np.array(seq), num_kv_heads=8, splits=WQ_BOUNDS, cal=cal)  # noqa: E731
    one = part([8192])                                              # two CTAs on every SM
    assert (one.num_splits.tolist(), one.cost) == ([32], 162624)
    cost, ctas, _ = planner.partition_costs(np.array([256]), np.array([16, 20, 32]), num_kv_heads=8,
                                            model=planner.PartitionModel.of(cal))
    assert cost.tolist() == [185856, 220704, 162624] and ctas.tolist() == [128, 160, 256]
    # 50 tiles: s = 16 -> c = 4, 13 splits, 104 CTAs (not 1 split on 8 CTAs, 23 us measured)
    one_short = part([1600])
    assert (one_short.num_splits.tolist(), one_short.ctas, one_short.chunk_tiles) == ([13], 104, 4)
    assert part([32768] * 8).num_splits.tolist() == [4] * 8        # 256 CTAs, two per SM
    ragged = part([28672] + [2048] * 6)                             # a 28K row and six 2K rows
    assert ragged.chunk_tiles == 45 and ragged.num_splits.tolist() == [20] + [2] * 6   # 256 CTAs


def test_workqueue_tasks_run_longest_first():
    seq = np.array([100, 40000, 3000, 33000])
    plan = plan_workqueue(seq, **SHAPE, splits=WQ_BOUNDS, cal=SEED)
    size = (plan.tasks[:, 4] - plan.tasks[:, 3]).astype(np.int64)
    per_split = seq[plan.tasks[:, 0]] // plan.num_splits[plan.tasks[:, 0]]
    assert (np.diff(per_split) <= 0).all()          # rows by decreasing tokens per split


def test_fused_plan_shares_tasks_and_drops_the_merge_launch():
    seq = np.array([40000, 1000, 17])
    wq = plan_workqueue(seq, **SHAPE, splits=WQ_BOUNDS, cal=SEED)
    fu = plan_fused(seq, **SHAPE, splits=WQ_BOUNDS, cal=SEED)
    assert np.array_equal(wq.tasks, fu.tasks) and np.array_equal(wq.split_offsets, fu.split_offsets)
    assert (fu.counters.launches, fu.counters.merge_launches) == (1, 0)
    assert fu.counters.merge_bytes == wq.counters.merge_bytes


# ----------------------------------------------------------------------------- buckets


@settings(max_examples=150, deadline=None)
@given(seq=seqs, sb=bounds(), cal=cals(), coarse=st.none() | st.lists(st.integers(1, 4096), min_size=1, max_size=5, unique=True))
def test_buckets_cover_every_row_once(seq, sb, cal, coarse):
    seq64 = seq.astype(np.int64)
    coarse = tuple(sorted(c * TILE_TOKENS for c in coarse)) if coarse else ()
    mode = "coarse" if coarse else "exact"
    plan = plan_bucket(seq, **SHAPE, splits=sb, cal=cal, bucketing=mode, coarse_lengths=coarse)
    rows = np.concatenate([bk.rows for bk in plan.buckets])
    assert rows.dtype == np.int32 and np.array_equal(np.sort(rows), np.arange(seq.size))
    keys = [bk.route_len for bk in plan.buckets]
    assert keys == sorted(keys, reverse=True) and len(set(keys)) == len(keys)
    cap_all = split_capacity(seq64, min_split_tokens=cal.splits.min_split_tokens)
    for bk in plan.buckets:
        lens = seq64[bk.rows]
        assert (lens <= bk.route_len).all()
        if mode == "exact":
            assert (lens == bk.route_len).all()
        elif bk.route_len in coarse:   # the next coarse length: no smaller one holds the longest row
            assert all(c < lens.max() for c in coarse if c < bk.route_len)
        else:                          # overflow bucket: rows beyond the last coarse length
            assert (lens > coarse[-1]).all() and bk.route_len == lens.max()
        s = bk.num_splits
        assert 1 <= s <= max(cap_all[bk.rows]) and s <= sb.max
        assert s in sb.candidates() or s == max(cap_all[bk.rows]) < sb.candidates()[0]
    c = plan.counters
    ss = np.array([bk.num_splits for bk in plan.buckets])
    rr = np.array([len(bk.rows) for bk in plan.buckets])
    assert c.launches == len(plan.buckets) + int((ss > 1).sum()) and c.merge_launches == int((ss > 1).sum())
    assert c.decode_ctas == int((rr * ss).sum()) * 8
    assert c.merge_bytes == int((rr * ss)[ss > 1].sum()) * 32 * (4 * 128 + 8) * 2
    assert bucket_counters(seq, **SHAPE, splits=sb, cal=cal, bucketing=mode, coarse_lengths=coarse) == c


def test_bucket_split_choice_from_cta_work_and_tiles():
    # seed: ceil(9.0 * 28 SMs / (rows * 8 kvh)): 1 row -> ceil(31.5) = 32, 2 rows -> ceil(15.75) = 16
    one = plan_bucket(np.array([32768]), **SHAPE, splits=BUCKET_BOUNDS, cal=SEED)
    two = plan_bucket(np.array([32768, 32768]), **SHAPE, splits=BUCKET_BOUNDS, cal=SEED)
    assert one.buckets[0].num_splits == 32 and two.buckets[0].num_splits == 16
    # 300 tokens: 10 tiles, 4 per split at least -> capacity 2 < min 4 -> 2 splits, never more than tiles
    short = plan_bucket(np.array([300]), **SHAPE, splits=BUCKET_BOUNDS, cal=SEED)
    assert short.buckets[0].num_splits == 2


def test_coarse_buckets_round_rows_up_and_keep_true_lengths():
    seq = np.array([5000, 9000, 8192, 20000, 30000, 100])
    plan = plan_bucket(seq, **SHAPE, splits=BUCKET_BOUNDS, cal=SEED, bucketing="coarse", coarse_lengths=(8192, 16384))
    got = {bk.route_len: sorted(seq[bk.rows].tolist()) for bk in plan.buckets}
    # 100, 5000, 8192 -> 8192; 9000 -> 16384; 20000, 30000 overflow -> one bucket keyed 30000
    assert got == {8192: [100, 5000, 8192], 16384: [9000], 30000: [20000, 30000]}


@pytest.mark.parametrize("mode, coarse, match", [("banana", (), "bucketing"), ("coarse", (), "coarse_lengths")])
def test_bucket_mode_errors(mode, coarse, match):
    with pytest.raises(ValueError, match=match):
        plan_bucket(np.array([10]), **SHAPE, splits=BUCKET_BOUNDS, cal=SEED, bucketing=mode, coarse_lengths=coarse)


# ----------------------------------------------------------------------------- hand-worked counters


def test_counters_by_hand():
    """seq [32768, 1000, 100]; H_q 32, H_kv 8, D 128, fp16; seed: 28 SMs, min_split_tokens 128 (4 tiles)."""
    seq = np.array([32768, 1000, 100], dtype=np.int32)
    kv = (32768 + 1000 + 100) * 8 * 128 * 2 * 2                  # 33868 tok * 4096 B = 138_723_328 B
    assert kv == 138_723_328
    # workqueue, balanced partition (seed: a wave of 28 CTAs, CTA overhead 2 tiles = 16 eighths):
    # tiles [1024, 32, 4]. s = 12: chunk ceil(1024/12) = 86 -> splits [12, 1, 1], 112 CTAs, 96 of
    # them longer than half a chunk -> 4 waves: max(4*(8*86+16)*28, 8*8*1060 + 112*16) = 78848,
    # the cheapest within MAX_WAVES = 4 waves (112 CTAs; s = 8 costs 87360; s = 16, 144 CTAs at
    # 73920, is beyond the cap)
    p = planner.balanced_partition(seq, num_kv_heads=8, splits=WQ_BOUNDS, cal=SEED)
    wq = plan_workqueue(seq, **SHAPE, splits=WQ_BOUNDS, cal=SEED)
    assert wq.num_splits.tolist() == p.num_splits.tolist()
    n = wq.num_splits.tolist()
    assert wq.split_offsets.tolist() == [0, n[0], n[0] + n[1], sum(n)] and n[1:] == [1, 1]
    c = wq.counters
    assert c.decode_ctas == sum(n) * 8
    assert c.cta_work_per_sm == pytest.approx(sum(n) * 8 / 28)
    assert c.useful_kv_bytes == kv
    assert c.merge_bytes == sum(n) * 32 * (128 * 4 + 8) * 2
    assert (c.launches, c.merge_launches) == (2, 1)
    # the 1000-token row is one task per head: [0, 1000)
    r1 = wq.tasks[(wq.tasks[:, 0] == 1) & (wq.tasks[:, 1] == 0)]
    assert r1[:, 3].tolist() == [0] and r1[-1, 4] == 1000

    # exact buckets: 3 one-row buckets, want ceil(9.0*28 / 8) = 32; capacities 256, 8, 1
    # -> S = 32, 8, 1 (1 < min 4: the 4-tile row cannot take 4 splits of 4 tiles)
    bk = plan_bucket(seq, **SHAPE, splits=BUCKET_BOUNDS, cal=SEED)
    assert [(b.route_len, b.num_splits, b.rows.tolist()) for b in bk.buckets] == \
        [(32768, 32, [0]), (1000, 8, [1]), (100, 1, [2])]
    c = bk.counters
    assert (c.launches, c.merge_launches) == (3 + 2, 2)          # decode per bucket + merge for S > 1
    assert c.decode_ctas == (32 + 8 + 1) * 8 == 328
    assert c.merge_bytes == (32 + 8) * 32 * 520 * 2 == 1_331_200  # the S = 1 bucket writes O directly
    assert c.useful_kv_bytes == kv


# ----------------------------------------------------------------------------- bimodal B8


def bimodal_b8(seed: int) -> np.ndarray:
    """1 long (~32K) : 3 short (1K-4K) rows, 8 distinct lengths (pkvrt.measure.traces' bimodal ranges)."""
    rng = np.random.default_rng(seed)
    while True:
        seq = np.concatenate([rng.integers(30720, 34817, 2), rng.integers(1024, 4097, 6)]).astype(np.int32)
        if len(set(seq.tolist())) == 8:
            return seq


@pytest.mark.parametrize("seed", range(20260623, 20260628))
def test_bimodal_b8_exact_buckets_fan_out_workqueue_does_not(seed):
    seq = bimodal_b8(seed)
    bk = plan_bucket(seq, **SHAPE, splits=BUCKET_BOUNDS, cal=SEED)
    wq = plan_workqueue(seq, **SHAPE, splits=WQ_BOUNDS, cal=SEED)
    # 8 distinct lengths -> 8 buckets; every one splits (>= 1024 tokens = 32 tiles -> capacity 8)
    assert len(bk.buckets) == 8 and bk.counters.launches == 16 and bk.counters.merge_launches == 8
    assert wq.counters.launches == 2 and wq.counters.merge_launches == 1
    assert wq.counters.merge_bytes < bk.counters.merge_bytes
    assert bk.counters.useful_kv_bytes == wq.counters.useful_kv_bytes


def test_papers_table4_counters():
    """Paper Table 4 (held-out bimodal B8, 550.5 MiB KV, 28 SMs): buckets 16 launches, 73.1 CTA work
    per SM, 4.06 MiB merge, 8 merge launches; workqueue 2, 45.7, 2.54 MiB, 1 (MiB counted once)."""
    total = round(550.5 * 2**20 / (8 * 128 * 2 * 2))
    short = (total - 2 * 32768) // 6
    seq = np.array([32768, 32769] + [short - 2 + i for i in range(6)])  # 8 distinct lengths
    bk = plan_bucket(seq, **SHAPE, splits=BUCKET_BOUNDS, cal=SEED).counters
    # the paper's workqueue gave every row 20 splits (the balanced partition cuts it otherwise)
    wq = planner.workqueue_counters_of(seq, [20] * 8, **SHAPE, sm_count=SEED.sm_count)
    assert (bk.launches, round(bk.cta_work_per_sm, 1), round(bk.merge_bytes / 2 / 2**20, 2), bk.merge_launches) == \
        (16, 73.1, 4.06, 8)
    assert (wq.launches, round(wq.cta_work_per_sm, 1), round(wq.merge_bytes / 2 / 2**20, 2), wq.merge_launches) == \
        (2, 45.7, 2.54, 1)
    assert wq.useful_kv_bytes / 2**20 == pytest.approx(550.5, abs=0.1)     # + 18 tokens for distinctness


# ----------------------------------------------------------------------------- helpers, inputs


@given(n=st.integers(1, 5000), s=st.integers(1, 5000))
def test_split_tile_range_partitions_tiles(n, s):
    s = min(s, n)
    b, e = split_tile_range(np.arange(s), s, n)
    assert b[0] == 0 and e[-1] == n and (b[1:] == e[:-1]).all() and (e > b).all()


@given(sb=bounds(), want=st.lists(st.integers(1, 200), min_size=1, max_size=20))
def test_vectorized_clamp_matches_split_bounds(sb, want):
    assert clamp_splits(sb, np.array(want)).tolist() == [sb.clamp(w) for w in want]


@pytest.mark.parametrize("bad, match", [
    (np.array([[1, 2]]), "1-D"), (np.array([], dtype=np.int32), "non-empty"),
    (np.array([1.5, 2.0]), "integer dtype"), (np.array([5, 0, 3]), r"seq_lens\[1\] = 0"),
    (np.array([-4]), r"seq_lens\[0\] = -4"),
])
@pytest.mark.parametrize("fn", [plan_workqueue, plan_bucket])
def test_bad_seq_lens_are_named(fn, bad, match):
    with pytest.raises(ValueError, match=match):
        fn(bad, **SHAPE, splits=WQ_BOUNDS, cal=SEED)


def test_heads_must_divide():
    with pytest.raises(ValueError, match="num_qo_heads=30"):
        plan_workqueue(np.array([10]), num_kv_heads=8, num_qo_heads=30, head_dim=128, dtype_bytes=2,
                       splits=WQ_BOUNDS, cal=SEED)


def test_check_seq_lens_accepts_lists_and_int64():
    assert check_seq_lens([3, 4]).tolist() == [3, 4]
    assert check_seq_lens(np.array([7], dtype=np.uint16)).dtype == np.int64


def test_flashinfer_plan_uses_the_shared_csr():
    seq = np.array([33, 16, 1], dtype=np.int32)
    bt = np.array([[5, 9, 2], [7, -1, -1], [0, -1, -1]], dtype=np.int32)
    plan = plan_flashinfer(seq, num_kv_heads=8, head_dim=128, dtype_bytes=2, page_size=16, block_tables=bt)
    ref = to_csr(seq, bt, 16)
    assert all(np.array_equal(a, b) for a, b in zip((plan.indptr, plan.indices, plan.last_page_len), ref))
    assert plan.indptr.tolist() == [0, 3, 4, 5]                    # ceil(33/16) = 3, 1, 1 pages
    assert (plan.counters.launches, plan.counters.merge_bytes) == (1, 0)
    assert plan.counters.useful_kv_bytes == 50 * 8 * 128 * 2 * 2
    bare = plan_flashinfer(seq, num_kv_heads=8, head_dim=128, dtype_bytes=2, page_size=16)
    assert bare.indptr is None and bare.counters == plan.counters


# ----------------------------------------------------------------------------- benchmark


def test_bench_plan_workqueue_b64(benchmark):
    seq = np.random.default_rng(20260622).integers(1024, 65536, 64).astype(np.int32)
    plan = benchmark(plan_workqueue, seq, **SHAPE, splits=WQ_BOUNDS, cal=SEED)
    check_workqueue(plan, seq, WQ_BOUNDS, 8, SEED)


def test_bench_plan_bucket_b8(benchmark):
    seq = bimodal_b8(20260623)
    plan = benchmark(plan_bucket, seq, **SHAPE, splits=BUCKET_BOUNDS, cal=SEED)
    assert isinstance(plan, BucketPlan) and len(plan.buckets) == 8


def test_device_grid_bounds_the_partition():
    """planner.device_grid_ctas: MAX_WAVES resident waves, or every row at the smallest count."""
    cal = attrs.evolve(SEED, sm_count=132, splits=SplitPoints(0.97, 2.0, 64, 6.0, 1.4))
    assert planner.device_grid_ctas(8, num_kv_heads=8, splits=WQ_BOUNDS, cal=cal) == 2 * 264
    assert planner.device_grid_ctas(1, num_kv_heads=8, splits=WQ_BOUNDS, cal=cal) == 8 * 64
    assert planner.device_grid_ctas(128, num_kv_heads=8, splits=WQ_BOUNDS, cal=cal) == 128 * 8


def test_max_waves_caps_the_partition_from_the_calibration():
    """calibration splits.max_waves bounds the CTAs of a cut (here H_kv 32, three 33K rows among
    short ones, split counts 1, 4, 8, ...: one split per row at 2 waves (256 CTAs), 4 splits of
    the long rows at 3 waves)."""
    from pkvrt.policy.planner import PartitionModel, balanced_partition
    from pkvrt.policy.registry import SplitBounds

    h200 = load_calibration(pathlib.Path(__file__).resolve().parents[1] / "calibration" / "nvidia-h200.json")
    seq = np.array([33323, 33000, 32500, 2000, 3000, 2500, 1500, 2227])
    sp = SplitBounds(1, 64, 4)
    got = {}
    for w in (2, 3):
        c = attrs.evolve(h200, splits=attrs.evolve(h200.splits, max_waves=w))
        p = balanced_partition(seq, num_kv_heads=32, splits=sp, cal=c)
        assert p.ctas <= w * PartitionModel.of(c).wave
        assert planner.device_plan_targets(c)["max_ctas"] == w * PartitionModel.of(c).wave
        got[w] = p.longest_splits
    assert got == {2: 1, 3: 4}


def test_small_ctas_beside_the_big_ones_cost_with_the_slowdown():
    """Two 34K rows beside six ~2K rows at H_kv 32 (the calibration's bimodal B8 step at G = 1,
    measured 371 us cut in 2, 304 in 4). The short rows' work beside the big CTAs costs
    ``(8 * small tiles + small CTAs * f) * (slowdown8 - 8)``; with the H200's G = 1 constants
    (slowdown 1.875, 7 tiles) it makes 4 splits the cheapest cut, where the two-term model
    (waves of big CTAs, average load) picks 2. At slowdown 1 that work costs nothing."""
    seq = np.array([34135, 1892, 1538, 3940, 1363, 1843, 2029, 34751])
    tiles = -(-seq // 32)
    cands = np.arange(1, 65)
    m = planner.PartitionModel(sms=132, resident=2, slowdown8=15, overhead8=56, max_waves=3)
    cost, ctas, chunk = planner.partition_costs(tiles, cands, num_kv_heads=32, model=m)
    assert ctas[[1, 3]].tolist() == [320, 448] and chunk[[1, 3]].tolist() == [543, 272]
    small = 32 * int(tiles[1:7].sum())      # every short row is one small task at both cuts
    beside = (8 * small + 6 * 32 * 56) * (15 - 8)
    waves = {2: (8 * 543 + 56) * 8 * 132, 4: (8 * 272 + 56) * 15 * 132}   # 128 big CTAs / 256
    average = {s: (8 * 32 * int(tiles.sum()) + ctas[s - 1] * 56) * 15 // 2 for s in (2, 4)}  # N > S
    for s in (2, 4):
        assert cost[s - 1] == max(waves[s] + beside, average[s])
    assert int(cands[np.argmin(cost)]) == 4
    assert max(waves[2], average[2]) < max(waves[4], average[4])   # without it: 2 splits
    free = attrs.evolve(m, slowdown8=8)
    cost1, _, _ = planner.partition_costs(tiles, cands[[1, 3]], num_kv_heads=32, model=free)
    average1 = {s: (8 * 32 * int(tiles.sum()) + ctas[s - 1] * 56) * 8 // 2 for s in (2, 4)}
    assert cost1.tolist() == [max((8 * c + 56) * 8 * 132, average1[s]) for s, c in ((2, 543), (4, 272))]


# --------------------------------------------------------------------------- free slots

def _h200_free(free_slots: int, room=(0, 0.0, 0)):
    h200 = load_calibration(pathlib.Path(__file__).resolve().parents[1] / "calibration" / "nvidia-h200.json")
    return attrs.evolve(h200, splits=attrs.evolve(h200.splits, merge_free_slots=free_slots,
                                                  wave_room_slots=room[0], wave_room_tiles=room[1],
                                                  wave_room_chunk_tiles=room[2]))


def test_free_slots_set_aside_the_cut_that_fills_its_last_wave():
    """One 8K row at H_kv 8: the makespan model's cheapest cut is 264 CTAs, every resident slot of
    the H200 (2 x 132); with splits.merge_free_slots = 8 the cheapest cut that leaves 8 slots free is
    taken instead (232 CTAs), and when no candidate leaves that many the rule steps aside."""
    from pkvrt.policy.planner import PartitionModel, balanced_partition, partition_candidates, partition_costs

    seq = np.array([8193])
    bounds = load_routes().route("pkv_workqueue").splits
    full = balanced_partition(seq, num_kv_heads=8, splits=bounds, cal=_h200_free(0))
    m = PartitionModel.of(_h200_free(8))
    assert full.ctas == m.wave and m.free_in_last_wave(full.ctas) == 0
    roomy = balanced_partition(seq, num_kv_heads=8, splits=bounds, cal=_h200_free(8))
    assert m.free_in_last_wave(roomy.ctas) >= 8 and roomy.ctas == 232
    tiles = -(-seq // TILE_TOKENS)
    cands = partition_candidates(int(tiles.max()), bounds, -(-m_min_tokens() // TILE_TOKENS))
    cost, ctas, _ = partition_costs(tiles, cands, num_kv_heads=8, model=m)
    ok = (ctas <= m.max_waves * m.wave) & (m.free_in_last_wave(ctas) >= 8)
    assert roomy.cost == cost[ok].min() > full.cost          # the cheapest roomy cut, dearer in the model
    never = balanced_partition(seq, num_kv_heads=8, splits=bounds, cal=_h200_free(m.wave + 1))
    assert (never.ctas, never.chunk_tiles) == (full.ctas, full.chunk_tiles)
    assert planner.device_plan_targets(_h200_free(8))["free_slots"] == 8
    # several rows (a merge grid of 8 CTAs per row, not measured): the rule does not apply
    rows = np.array([8193, 2000])
    for f in (8, 40):
        assert (balanced_partition(rows, num_kv_heads=8, splits=bounds, cal=_h200_free(f)).num_splits.tolist()
                == balanced_partition(rows, num_kv_heads=8, splits=bounds, cal=_h200_free(0)).num_splits.tolist())
    # a fused cut has no merge launch to make room for: the rule does not apply to it
    assert planner.device_plan_targets(_h200_free(8), "fused")["free_slots"] == 0
    fused = balanced_partition(seq, num_kv_heads=8, splits=bounds, cal=_h200_free(8), kind="fused")
    assert (fused.ctas, fused.chunk_tiles) == (full.ctas, full.chunk_tiles)
    with pytest.raises(ValueError, match="kind='bucket'"):
        PartitionModel.of(_h200_free(8), "bucket")


def m_min_tokens() -> int:
    return _h200_free(0).splits.min_split_tokens


@pytest.mark.parametrize("free_slots,room", [(0, (0, 0.0, 0)), (8, (0, 0.0, 0)), (40, (0, 0.0, 0)),
                                             (0, (32, 6.0, 1 << 20)), (8, (48, 2.5, 12)),
                                             (0, (264, 40.0, 8))])
def test_free_slots_rule_is_the_planning_kernels(free_slots, room):
    """The host planner and the planning kernel's emulation (tests/test_runtime_cpu.py, the
    kernel's loops written out) choose the same cuts on random batches, free slots or not, with
    and without a room charge (the GPU test tests/gpu/test_device_plan.py checks the kernel
    itself)."""
    import torch

    from pkvrt.launch import ops
    from test_runtime_cpu import Emu

    cal = _h200_free(free_slots, room)
    bounds = load_routes().route("pkv_workqueue").splits
    rng = np.random.default_rng(free_slots + room[0])
    emu = Emu.__new__(Emu)
    emu.launches = emu.direct = 0
    for _ in range(60):
        b = int(rng.integers(1, 17))
        seq = rng.integers(1, int(rng.choice([3000, 20000, 140000])), b).astype(np.int32)
        host = planner.plan_workqueue(seq, num_kv_heads=8, num_qo_heads=32, head_dim=128,
                                      dtype_bytes=2, splits=bounds, cal=cal)
        i32 = dict(dtype=torch.int32)
        out = dict(tasks=torch.zeros(b * 8 * 64, 5, **i32), num_tasks=torch.zeros(1, **i32),
                   split_offsets=torch.zeros(b + 1, **i32), num_splits=torch.zeros(b, **i32),
                   status=torch.zeros(1, **i32))
        emu.plan_workqueue_device(torch.as_tensor(seq), torch.tensor([b], **i32), out["tasks"],
                                  out["num_tasks"], out["split_offsets"], out["num_splits"],
                                  out["status"], torch.tensor(bounds.candidates(), **i32),
                                  num_kv_heads=8, min_split_tiles=-(-cal.splits.min_split_tokens // TILE_TOKENS),
                                  max_seq_len=torch.tensor([ops.MAX_SEQ_LEN], **i32),
                                  **planner.device_plan_targets(cal))
        assert out["num_splits"].tolist() == host.num_splits.tolist(), seq


def test_room_charge_prefers_a_last_wave_with_room_on_short_steps():
    """The calibration sweeps' short eight-row step at G = 4 (H_kv 8; H200: 264 resident slots):
    the makespan alone takes 256 CTAs (8 slots free, chunks of 7 tiles); a room charge of 32
    slots and 24 tiles on chunks of up to 8 tiles (18 tiles at 8 free: more than the makespan's
    7 % between the two cuts) moves it to 224 CTAs, the sweep's fastest cut (9.7 us against 11.3
    at 256); with the charge on chunks of up to 6 tiles it stays. The charge is an absolute
    time: the cut of a 32K row is unchanged."""
    bounds = load_routes().route("pkv_fused").splits
    short = np.array([2557, 264, 187, 1020, 237, 640, 403, 1106])
    plain, charged = _h200_free(0), _h200_free(0, (32, 24.0, 8))
    p0 = planner.balanced_partition(short, num_kv_heads=8, splits=bounds, cal=plain, kind="fused")
    p1 = planner.balanced_partition(short, num_kv_heads=8, splits=bounds, cal=charged, kind="fused")
    assert p0.ctas == 256 and p1.ctas == 224 and p1.cost > p0.cost   # cost: the makespan alone
    narrow = planner.balanced_partition(short, num_kv_heads=8, splits=bounds, cal=_h200_free(0, (32, 24.0, 6)),
                                        kind="fused")
    assert narrow.ctas == 256
    m = planner.PartitionModel.of(charged, "fused")
    assert m.room_charge([264, 256, 232, 528], [8, 8, 8, 9]).tolist() == [24 * 8 * 132, 24 * 8 * 132 * 24 // 32,
                                                                       0, 0]
    long = np.array([32768])
    assert (planner.balanced_partition(long, num_kv_heads=8, splits=bounds, cal=charged, kind="fused").longest_splits
            == planner.balanced_partition(long, num_kv_heads=8, splits=bounds, cal=plain, kind="fused").longest_splits)
