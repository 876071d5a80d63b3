"""Rows that share pages, read once: the sharing plan (numpy) and SharedPagesRuntime on the fake
device (emulated kernels, tests/test_runtime_cpu.py), exact against the FP32 reference."""

from __future__ import annotations

import attrs
import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from test_runtime_cpu import FAKE_SHAPE, ROUTES, SEED, fake_device, pool, ref, rel_err  # noqa: F401

from pkvrt.policy import sharing
from pkvrt.policy.blocktables import SharedRun, shared_page_runs
from pkvrt.policy.registry import load_routes
from pkvrt.runtime.options import RuntimeOptions
from pkvrt.runtime.shared import SharedPagesRuntime

PAGE = FAKE_SHAPE["page_size"]
G = FAKE_SHAPE["num_qo_heads"] // FAKE_SHAPE["num_kv_heads"]


SOURCES = [0, 1, 4, 2, 0, 1, 4, 2]   # pool rows of at least 900 tokens (test_runtime_cpu.POOL_LENS)


def shared_step(b, lens, prefix_pages, groups):
    """Rows of the pool's pages (row i: pool row SOURCES[i]; lengths up to 900), where the rows
    of each group take their group's first row's first ``prefix_pages`` pages (prefix caching):
    a block table with shared runs."""
    assert max(lens) <= 900
    bt = b.block_tables[SOURCES[:len(lens)]].numpy().copy()
    for rows in groups:
        for r in rows[1:]:
            bt[r, :prefix_pages] = bt[rows[0], :prefix_pages]
    return np.array(lens, np.int32), bt


def runtime(**kw):
    args = dict(routes=ROUTES, calibration=SEED, max_batch=8, max_pages_per_row=256,
                options=RuntimeOptions(flashinfer=False, shared_when_predicted_faster=False),
                min_saved=0.0)
    args.update(kw)
    return SharedPagesRuntime(*FAKE_SHAPE.values(), torch.float16, **args)


@pytest.mark.parametrize("lens, prefix, groups", [
    ([800, 850, 900, 700], 40, [[0, 1, 2, 3]]),                   # one prefix, every row
    ([800, 850, 900, 700, 880, 600], 30, [[0, 1, 2, 3, 4]]),      # 5 rows: chunks of 3 + 2
    ([800, 850, 900, 700, 880, 860], 20, [[0, 1, 2], [3, 4, 5]]),  # two groups
    ([641, 640, 656, 900], 40, [[0, 1, 2, 3]]),                   # rows ending at the prefix's end
])
@pytest.mark.parametrize("engine_capture", [False, True], ids=["own graphs", "engine capture"])
def test_shared_pages_are_exact(fake_device, pool, lens, prefix, groups, engine_capture):  # noqa: F811
    b, _ = pool
    cache = (b.k_cache, b.v_cache)
    seq, bt = shared_step(b, lens, prefix, groups)
    rt = runtime(engine_capture=engine_capture)
    rt.plan(seq, bt)
    sp = rt.plan_used
    assert sp is not None and sp.saved_fraction > 0.2, rt.explain()
    # a row's own pages in one segment: with engine capture the own decode reads q itself
    assert rt._own_identity == (engine_capture and sp.own_rows.size == len(lens))
    q = torch.randn(len(lens), FAKE_SHAPE["num_qo_heads"], FAKE_SHAPE["head_dim"],
                    generator=torch.Generator().manual_seed(len(lens))).half()
    out = rt.run(q, *cache, out=torch.full_like(q, float("nan")))
    assert rel_err(out, ref(q, cache, seq, torch.as_tensor(bt))) < 2e-3
    out2 = rt.run(q, *cache)                     # a second layer: the same static buffers
    assert torch.equal(out2, out)
    for inner in (rt.shared, rt.own):            # the decodes ran on their static q/out
        assert inner.stats()["staging_copies"] == 0
    assert "saved" in rt.explain()
    key = rt.step_key
    assert key[0] == "shared"
    rt.plan(seq, bt)                                      # the same structure: the same key
    assert rt.step_key == key


@pytest.mark.parametrize("mode", ["engine capture", "own graphs", "eager"])
def test_a_step_that_shares_what_the_last_did_stages_nothing_and_stays_exact(fake_device, pool,  # noqa: F811
                                                                              monkeypatch, mode):
    """The gather indices, own rows and merge slots are the sharing structure's: consecutive
    steps of one structure (rows one token longer), with a plain step between them, copy them
    once; another structure copies its own. The chunk decode is planned again only where its
    arrays are not those it planned last (the plain step between leaves its plan in place) or,
    on the router's routes, where the last step ran another number of layers than its route
    was decided at. Every step of every layer matches the reference."""
    b, _ = pool
    cache = (b.k_cache, b.v_cache)
    options = RuntimeOptions(flashinfer=False, shared_when_predicted_faster=False,
                             use_cuda_graph=mode != "eager")
    rt = runtime(engine_capture=mode == "engine capture", options=options)
    staged = []
    stage = rt._stage
    monkeypatch.setattr(rt, "_stage", lambda name, a: staged.append(name) or stage(name, a))
    one = shared_step(b, [800, 850, 880, 700], 40, [[0, 1, 2, 3]])
    other = shared_step(b, [800, 850, 880, 700, 860, 600], 20, [[0, 1, 2], [3, 4, 5]])
    # the same shapes as ``one`` (one chunk of four rows, every row one own segment) over other pages
    alike = shared_step(b, [800, 850, 880, 700], 30, [[1, 0, 2, 3]])
    # and ``one``'s lengths, chunk lengths included, over another row's prefix pages
    swapped = shared_step(b, [800, 850, 880, 700], 40, [[1, 0, 2, 3]])
    plain = (np.array([900, 1000, 40], np.int32), b.block_tables[[0, 1, 3]].numpy())
    longer = lambda step, n: (step[0] + n, step[1])   # noqa: E731
    # (step, index copies, chunk decode planned (True) or kept (False), layers run)
    steps = [(one, 3, True, 1), (longer(one, 1), 0, False, 1), (plain, 0, None, 1),
             (longer(one, 2), 0, False, 2), (longer(one, 3), 0, None, 1), (other, 3, True, 1),
             (longer(one, 4), 3, True, 1), (alike, 3, True, 1), (longer(one, 5), 3, True, 1),
             (longer(swapped, 5), 3, True, 1)]
    captured = rt.shared._captured_policy
    assert captured == (mode == "engine capture")
    for i, ((seq, bt), copies, planned, layers) in enumerate(steps):
        staged.clear()
        before = rt.shared.stats()
        rt.plan(seq, bt)
        assert len(staged) == copies, (i, staged)
        assert (rt.plan_used is None) == (i == 2)
        after = rt.shared.stats()
        if i == 4:   # step 3 ran two layers: the router's route is decided again at 2
            planned = not captured
            assert rt.shared._layers == (1 if captured else 2)
        if planned is not None:
            assert after["plans"] - before["plans"] == int(planned), i
            assert after["plans_kept"] - before["plans_kept"] == int(not planned), i
        q = torch.randn(len(seq), FAKE_SHAPE["num_qo_heads"], FAKE_SHAPE["head_dim"],
                        generator=torch.Generator().manual_seed(i)).half()
        for _ in range(layers):
            out = rt.run(q, *cache, out=torch.full_like(q, float("nan")))
            assert rel_err(out, ref(q, cache, seq, torch.as_tensor(bt))) < 2e-3, i


def test_a_chunk_plan_made_elsewhere_or_a_failed_own_plan_keeps_steps_exact(fake_device, pool,  # noqa: F811
                                                                           monkeypatch):
    """The chunk Runtime planned by someone else between two steps of one structure: the next
    step plans it again. The own decode's plan raising after the chunk decode's: the next step
    of that structure runs on the kept chunk plan, exact."""
    b, _ = pool
    cache = (b.k_cache, b.v_cache)
    rt = runtime()
    one = shared_step(b, [800, 850, 880, 700], 40, [[0, 1, 2, 3]])
    other = shared_step(b, [800, 850, 880, 700, 860, 600], 20, [[0, 1, 2], [3, 4, 5]])

    def step(i, seq, bt):
        rt.plan(seq, bt)
        q = torch.randn(len(seq), FAKE_SHAPE["num_qo_heads"], FAKE_SHAPE["head_dim"],
                        generator=torch.Generator().manual_seed(i)).half()
        out = rt.run(q, *cache, out=torch.full_like(q, float("nan")))
        assert rel_err(out, ref(q, cache, seq, torch.as_tensor(bt))) < 2e-3, i

    step(0, *one)
    rt.plan(one[0] + 1, one[1])
    planned = rt.shared.stats()["plans"]
    rt.shared.plan(np.array([64], np.int32), other[1][:1])          # made elsewhere
    step(1, one[0] + 2, one[1])
    assert rt.shared.stats()["plans"] == planned + 2                 # the elsewhere plan and ours
    own_plan = rt.own.plan
    monkeypatch.setattr(rt.own, "plan", lambda *a, **k: (_ for _ in ()).throw(RuntimeError("copy")))
    with pytest.raises(RuntimeError, match="copy"):
        rt.plan(one[0] + 3, one[1])
    monkeypatch.setattr(rt.own, "plan", own_plan)
    kept = rt.shared.stats()["plans_kept"]
    step(2, one[0] + 4, one[1])
    assert rt.shared.stats()["plans_kept"] == kept + 1


def test_sinks_count_once_across_segments(fake_device, pool):  # noqa: F811
    from pkvrt import reference

    b, _ = pool
    seq, bt = shared_step(b, [800, 850, 900, 700], 40, [[0, 1, 2, 3]])
    rt = runtime(sinks=True)
    rt.plan(seq, bt)
    assert rt.plan_used is not None and rt.own is not rt.plain
    q = torch.randn(4, FAKE_SHAPE["num_qo_heads"], FAKE_SHAPE["head_dim"]).half() * 2
    sinks = torch.linspace(-1, 6, FAKE_SHAPE["num_qo_heads"])
    out = rt.run(q, b.k_cache, b.v_cache, sinks=sinks)
    want = reference.decode_attention(q, b.k_cache, b.v_cache, torch.as_tensor(seq),
                                      torch.as_tensor(bt), sinks=sinks)
    assert rel_err(out, want) < 2e-3
    with pytest.raises(ValueError, match="sinks=None but the Runtime was built with sinks=True"):
        rt.run(q, b.k_cache, b.v_cache)


def test_steps_without_sharing_run_the_plain_runtime(fake_device, pool):  # noqa: F811
    b, _ = pool
    seq = np.array([900, 1000, 40], np.int32)
    bt = b.block_tables[[0, 1, 3]].numpy()
    rt = runtime()
    d = rt.plan(seq, bt)
    assert rt.plan_used is None and d.route
    q = torch.randn(3, FAKE_SHAPE["num_qo_heads"], FAKE_SHAPE["head_dim"]).half()
    assert rel_err(rt.run(q, b.k_cache, b.v_cache), ref(q, (b.k_cache, b.v_cache), seq, torch.as_tensor(bt))) < 2e-3
    assert "no sharing" in rt.explain()
    shared_seq, shared_bt = shared_step(b, [800, 850, 900, 700], 40, [[0, 1, 2, 3]])
    rt.plan(shared_seq, shared_bt, force="pkv_workqueue")      # a forced route: no sharing
    assert rt.plan_used is None


def test_constructor_refusals():
    with pytest.raises(ValueError, match="window_left=127: shared pages are attended whole"):
        SharedPagesRuntime(8, 2, 64, 16, window_left=127)
    with pytest.raises(ValueError, match="device_planning='yes': expected True"):
        SharedPagesRuntime(8, 2, 64, 16, device_planning="yes")
    with pytest.raises(ValueError, match="min_saved=1.5"):
        SharedPagesRuntime(8, 2, 64, 16, min_saved=1.5)


@settings(max_examples=60, deadline=None)
@given(st.lists(st.integers(1, 300), min_size=2, max_size=9), st.integers(0, 2**31 - 1),
       st.sampled_from([1, 2, 4, 8]), st.sampled_from([1, 4, 16]))
def test_sharing_plan_covers_every_page_once(lens, seed, group, page):
    """Any sharing structure: every row's pages are covered exactly once by its chunks and own
    segments, a chunk's rows use the chunk's pages at those positions, only whole pages before a
    row's last one are shared, and each row ends in an own segment."""
    rng = np.random.default_rng(seed)
    seq = np.array(lens, np.int32)
    pages = -(-seq // page)
    width = int(pages.max())
    bt = rng.permutation(10_000)[:len(lens) * width].reshape(len(lens), width).astype(np.int32)
    for _ in range(3):   # nested prefixes: a random group takes a random row's first pages
        rows = rng.choice(len(lens), size=rng.integers(2, len(lens) + 1), replace=False)
        n = int(rng.integers(1, width + 1))
        bt[rows, :n] = bt[rows[0], :n]
    sp = sharing.plan_sharing(seq, bt, page, group)
    if sp is None:
        return
    marked = np.array(bt, np.int64)   # as plan_sharing marks it: each row's last pages its own
    own = np.arange(width) >= ((seq.astype(np.int64) - 1) // page)[:, None]
    marked[own] = -1 - np.nonzero(own.ravel())[0]
    want = _plan_by_rows(seq, bt, shared_page_runs(seq, marked, page), sp.capacity_rows, page)
    for name, value in want.items():   # the same plan as the per-row loop's
        assert np.array_equal(getattr(sp, name), np.asarray(value)), name
    c = sp.capacity_rows
    n_chunk = sp.chunk_rows.shape[0] * c
    for r in range(len(lens)):
        got = []
        for s in sp.slots[r]:
            if s < n_chunk:
                v, pos = divmod(int(s), c)
                assert sp.chunk_rows[v, pos] == r and sp.chunk_valid[v, pos]
                n = sp.chunk_seq[v] // page
                first = next(j for j in range(width - n + 1) if (bt[r, j:j + n] == sp.chunk_bt[v, :n]).all())
                assert first + n <= (seq[r] - 1) // page      # whole pages, before the last one
                got += list(range(first, first + n))
            elif s < n_chunk + sp.own_rows.size:
                o = int(s) - n_chunk
                assert sp.own_rows[o] == r
                n = -(-int(sp.own_seq[o]) // page)
                first = next(j for j in range(width - n + 1) if (bt[r, j:j + n] == sp.own_bt[o, :n]).all())
                got += list(range(first, first + n))
        assert sorted(got) == list(range(pages[r])), r
    assert sp.pages_read <= sp.pages_unshared


def test_the_runs_memo_hits_while_rows_grow_by_their_own_pages(monkeypatch):
    """Rows that decode on (each step a token more, crossing page boundaries at different steps)
    keep their shared runs: the runs are computed once, and each step's are those of the table
    with only each row's last pages marked (what a fresh computation without the memo's marking
    of unshared entries gives)."""
    calls, used = [], []
    real_runs, real_memo = sharing.shared_page_runs, sharing._memo_runs

    def counting(*a, **k):
        calls.append(1)
        return real_runs(*a, **k)

    def noting(*a, **k):
        used.append(real_memo(*a, **k))
        return used[-1]
    monkeypatch.setattr(sharing, "shared_page_runs", counting)
    monkeypatch.setattr(sharing, "_memo_runs", noting)
    sharing._RUNS_MEMO.clear()
    rng = np.random.default_rng(3)
    seq0 = np.array([700 + 37 * i for i in range(6)], np.int32)
    bt = rng.permutation(2000)[:6 * 60].reshape(6, 60).astype(np.int32)
    bt[1:4, :30] = bt[0, :30]          # a prefix of four rows
    bt[5, :12] = bt[4, :12]            # another of two
    for step in range(40):
        seq = seq0 + step
        assert sharing.plan_sharing(seq, bt, PAGE, G) is not None
        assert used[-1][0] == _marked_runs(seq, bt), step
    assert len(calls) == 1


def _plan_by_rows(seq, bt, runs, per_chunk, page=PAGE):
    """The plan's chunks and own segments by a loop over rows (what plan_sharing computed each
    step before its layout was kept with the runs): the reference of the tests' plans."""
    pages = -(-np.asarray(seq, np.int64) // page)
    covered, chunks = [[] for _ in seq], []
    for run in runs:
        rows = list(run.rows)
        parts = -(-len(rows) // per_chunk)
        for sub in (rows[i::parts] for i in range(parts)):
            v = len(chunks)
            chunks.append((sub, run.first_page, run.num_pages))
            for c, r in enumerate(sub):
                covered[r].append((run.first_page, run.first_page + run.num_pages, v * per_chunk + c))
    n_chunk_slots = len(chunks) * per_chunk
    own_rows, own_seq, own_pages, row_slots = [], [], [], []
    for r in range(len(seq)):
        segs = sorted(covered[r])
        slots = [s for _, _, s in segs]
        at = 0
        for first, end in [(f, e) for f, e, _ in segs] + [(int(pages[r]), int(pages[r]))]:
            if first > at:
                slots.append(n_chunk_slots + len(own_rows))
                own_rows.append(r)
                own_seq.append(min(int(seq[r]), first * page) - at * page)
                own_pages.append(bt[r, at:first])
            at = max(at, end)
        row_slots.append(slots)
    k = max(len(x) for x in row_slots)
    slots = np.full((len(seq), k), n_chunk_slots + len(own_rows), np.int32)
    for r, x in enumerate(row_slots):
        slots[r, :len(x)] = x
    return dict(chunk_rows=[sub + [sub[0]] * (per_chunk - len(sub)) for sub, _, _ in chunks],
                chunk_valid=[[c < len(sub) for c in range(per_chunk)] for sub, _, _ in chunks],
                chunk_seq=[n * page for _, _, n in chunks],
                chunk_bt=sharing._table([bt[sub[0], f:f + n] for sub, f, n in chunks]),
                own_rows=own_rows, own_seq=own_seq, own_bt=sharing._table(own_pages), slots=slots,
                pages_read=sum(n for _, _, n in chunks) + sum(len(p) for p in own_pages))


def _nested(bt):
    bt[1:6, :20] = bt[0, :20]          # a system prompt under five more rows
    bt[1:3, 20:32] = bt[1, 20:32]      # a conversation under two of them
    bt[7, :9] = bt[6, :9]              # another prefix of two


def _one_prefix(bt):
    bt[1:, :20] = bt[0, :20]           # parallel sampling: one prompt under every row
    bt[1:, 20] = bt[0, 20]             # (its last page too, where every row's own pages begin)


def _one_prefix_not_first(bt):
    bt[2:, 20:37] = bt[1, 20:37]       # a prefix every row but row 0 shares, past 20 own pages
    bt[1:, :20] = bt[1, :20]


@pytest.mark.parametrize("structure", [_nested, _one_prefix, _one_prefix_not_first],
                         ids=["nested and separate", "one prefix under every row", "all rows but one"])
@pytest.mark.parametrize("memo", [True, False], ids=["memo kept", "memo cleared each step"])
def test_plans_of_decoding_steps_equal_the_per_row_loop(memo, structure):
    """Rows decoding on under nested and separate prefixes, or one prefix under every row (each
    row's own pages one column slice of the table) or under all rows but one, some crossing a
    page boundary each step: every step's plan (its layout kept with the runs, or made afresh)
    equals the per-row loop's, entry for entry, and the kept arrays cannot be written."""
    rng = np.random.default_rng(11)
    seq0 = np.array([600 + 29 * i for i in range(8)], np.int32)
    bt = rng.permutation(4000)[:8 * 70].reshape(8, 70).astype(np.int32)
    structure(bt)
    sharing._RUNS_MEMO.clear()
    for step in range(0, 90, 3):
        if not memo:
            sharing._RUNS_MEMO.clear()
        seq = seq0 + step
        sp = sharing.plan_sharing(seq, bt, PAGE, G)
        want = _plan_by_rows(seq, bt, _marked_runs(seq, bt), sp.capacity_rows)
        for name, value in want.items():
            got = getattr(sp, name)
            assert np.array_equal(got, np.asarray(value)) and np.asarray(got).dtype != object, (step, name)
        assert sp.own_seq.dtype == sp.own_bt.dtype == sp.chunk_bt.dtype == np.int32
        # the one-slice own tables where every row's own pages begin at one column
        layouts = [lay for _, _, kept in sharing._RUNS_MEMO.values() for lay in kept.values()]
        assert any(lay.common_at >= 0 for lay in layouts) == (structure is _one_prefix)
        with pytest.raises(ValueError, match="read-only"):
            sp.slots[0, 0] = 0


def test_a_fingerprint_collision_recomputes_the_runs(monkeypatch):
    """Every table fingerprinted the same (all-zero weights): a second sharing structure still
    gets its own runs (the memo compares the whole table before it answers)."""
    monkeypatch.setattr(sharing, "_FINGERPRINT_WEIGHTS", np.zeros(1 << 16, np.int64))
    sharing._RUNS_MEMO.clear()
    seq = np.array([500, 520, 540, 560], np.int32)
    bt = np.arange(4 * 40, dtype=np.int32).reshape(4, 40)
    a, b = bt.copy(), bt.copy()
    a[1:, :10] = a[0, :10]             # every row shares 10 pages
    b[2:, :20] = b[2, :20]             # rows 2 and 3 share 20
    for table in (a, b, a):
        got, _ = sharing._memo_runs(seq, _marked(seq, table), PAGE)
        assert got == shared_page_runs(seq, _marked(seq, table), PAGE)
    assert len(sharing._RUNS_MEMO) == 1   # one key, refilled on each collision


def _marked_runs(seq, bt):
    return shared_page_runs(seq, _marked(seq, bt), PAGE)


def test_plan_sharing_refuses_a_negative_page_id():
    """A negative id in an entry that may be shared is named (the plan marks unshared entries
    with negative ids of its own, so such an id could join a run); one past a row's pages, or in
    its last page (never shared), is not read as one."""
    seq = np.array([40, 40, 20], np.int32)
    bt = np.arange(9, dtype=np.int32).reshape(3, 3)
    bt[:2, 0] = 100
    bt[2, 2] = -1                       # past row 2's two pages: not read
    bt[2, 1] = -2                       # row 2's last page: its own
    assert sharing.plan_sharing(seq, bt, PAGE, G) is not None
    bt[1, 1] = -3
    with pytest.raises(ValueError, match=r"block_tables\[1, 1\] = -3: expected page ids >= 0"):
        sharing.plan_sharing(seq, bt, PAGE, G)


def _marked(seq, bt):
    """The table with each row's pages from its last one on given ids of their own (as
    plan_sharing marks them, but not the entries no other entry shares)."""
    shareable = (np.asarray(seq, np.int64) - 1) // PAGE
    marked = np.array(bt, np.int64)
    own = np.arange(bt.shape[1]) >= shareable[:, None]
    marked[own] = -1 - np.nonzero(own.ravel())[0]
    return marked


def test_more_chunks_than_a_batch_runs_unshared(fake_device, pool):  # noqa: F811
    """Sharing that alternates between row pairs page after page makes more chunks than the
    batch holds: the step runs on the plain Runtime, exact, and a failed plan leaves no
    sharing plan behind."""
    b, _ = pool
    base = b.block_tables[0].numpy()
    pairs = [((0, 1), (2, 3)), ((0, 2), (1, 3)), ((0, 3), (1, 2))]
    bt = np.zeros((4, 20), np.int32)
    for j in range(20):
        for k, rows in enumerate(pairs[j % 3]):
            bt[list(rows), j] = base[2 * j + k]
    seq = np.array([20 * PAGE - 3] * 4, np.int32)
    sp = sharing.plan_sharing(seq, bt, PAGE, G)
    assert sp is not None and sp.chunk_rows.shape[0] > 4
    rt = runtime(max_batch=4)
    rt.plan(seq, bt)
    assert rt.plan_used is None
    q = torch.randn(4, FAKE_SHAPE["num_qo_heads"], FAKE_SHAPE["head_dim"]).half()
    out = rt.run(q, b.k_cache, b.v_cache)
    assert rel_err(out, ref(q, (b.k_cache, b.v_cache), seq, torch.as_tensor(bt))) < 2e-3


@pytest.mark.parametrize("engine_capture", [False, True], ids=["own graphs", "engine capture"])
def test_shared_pages_are_exact_with_fp8_kv(fake_device, pool, engine_capture):  # noqa: F811
    """e4m3 K/V with per-KV-head scales: the chunk and own decodes dequantize with the layer's
    scales and the merge is exact against the FP32 reference over the dequantized caches."""
    from pkvrt import reference

    b, _ = pool
    seq, bt = shared_step(b, [800, 850, 900, 700, 880], 30, [[0, 1, 2, 3, 4]])
    k8, ks = reference.quantize_kv(b.k_cache.float(), per_head=True)
    v8, vs = reference.quantize_kv(b.v_cache.float(), per_head=True)
    rt = runtime(kv_dtype=torch.float8_e4m3fn, engine_capture=engine_capture)
    rt.plan(seq, bt)
    assert rt.plan_used is not None and rt.shared is not None
    q = torch.randn(len(seq), FAKE_SHAPE["num_qo_heads"], FAKE_SHAPE["head_dim"],
                    generator=torch.Generator().manual_seed(21)).half()
    out = rt.run(q, k8, v8, out=torch.full_like(q, float("nan")), k_scale=ks, v_scale=vs)
    want = reference.decode_attention(q, k8, v8, torch.as_tensor(seq), torch.as_tensor(bt),
                                      k_scale=ks, v_scale=vs)
    assert rel_err(out, want) < 2e-3


def test_chunk_rows_follow_the_kernels_served(fake_device):  # noqa: F811
    """Rows per chunk: the most whose rows x G heads a kernel serves (FP8 K/V at D 256: 8)."""
    rt16 = SharedPagesRuntime(8, 2, 256, 16, torch.float16, routes=ROUTES, calibration=SEED,
                              max_batch=8, max_pages_per_row=64, options=RuntimeOptions(flashinfer=False))
    assert rt16.chunk == 4
    rt8 = SharedPagesRuntime(8, 2, 256, 16, torch.float16, kv_dtype=torch.float8_e4m3fn,
                             routes=ROUTES, calibration=SEED, max_batch=8, max_pages_per_row=64,
                             options=RuntimeOptions(flashinfer=False))
    assert rt8.chunk == 2 and rt8.shared.num_qo_heads == 2 * 2 * 4


@pytest.mark.parametrize("wide", [(), (24,), (64,)], ids=["no wide G", "G 24", "G 64"])
def test_chunks_default_to_16_heads_whatever_the_calibration(fake_device, wide):  # noqa: F811
    """Chunks default to the narrow body's 16 heads (16 // G rows), whether or not the
    calibration has a group size above 16 (64-head chunks ran slower than 16-head ones on the
    H100 with its own G 64 constants); shared_chunk_rows may ask for up to 64 // G."""
    cal = attrs.evolve(SEED, splits=attrs.evolve(SEED.splits, by_group=tuple((g, ()) for g in wide)))
    rt = SharedPagesRuntime(8, 2, 128, 16, torch.float16, routes=ROUTES, calibration=cal,
                            max_batch=8, max_pages_per_row=64, options=RuntimeOptions(flashinfer=False))
    assert rt.chunk == 4 and rt.shared.num_qo_heads == 2 * 4 * 4
    asked = SharedPagesRuntime(8, 2, 128, 16, torch.float16, routes=ROUTES, calibration=cal, max_batch=8,
                               max_pages_per_row=64,
                               options=RuntimeOptions(flashinfer=False, shared_chunk_rows=16))
    assert asked.chunk == 16 and asked.shared.num_qo_heads == 2 * 16 * 4
    # G 9 and 16: two rows are already more than 16 heads: nothing shared by default, and 7 or 4
    # rows (the wide body) when asked
    for hq, rows in ((18, 7), (32, 4)):
        g_rt = SharedPagesRuntime(hq, 2, 128, 16, torch.float16, routes=ROUTES, calibration=cal,
                                  max_batch=8, max_pages_per_row=64, options=RuntimeOptions(flashinfer=False))
        assert (g_rt.chunk, g_rt.shared) == (1, None), hq
        g_asked = SharedPagesRuntime(hq, 2, 128, 16, torch.float16, routes=ROUTES, calibration=cal,
                                     max_batch=8, max_pages_per_row=64,
                                     options=RuntimeOptions(flashinfer=False, shared_chunk_rows=rows))
        assert g_asked.chunk == rows and g_asked.shared.num_qo_heads == 2 * rows * (hq // 2), hq


def test_chunk_heads_of_routes_toml_set_the_default_chunk(fake_device, tmp_path):  # noqa: F811
    """routes.toml ``[sharing] chunk_heads`` sets the default rows per chunk (chunk_heads // G,
    at most what the kernels serve); the shipped file's is 16, as without the key;
    shared_chunk_rows still overrides it."""
    assert ROUTES.sharing_chunk_heads == 16 and load_routes(None).sharing_chunk_heads == 16
    text = open(ROUTES.path).read()
    assert "chunk_heads = 16\n" in text   # the shipped key, and without it the same 16:
    bare = tmp_path / "routes.toml"
    bare.write_text(text.replace("chunk_heads = 16\n", ""))
    assert load_routes(bare).sharing_chunk_heads == 16
    for heads, hq, rows in ((32, 8, 8), (32, 16, 4), (64, 8, 16), (256 // 4, 32, 4), (8, 8, 2), (4, 8, 1)):
        routes = attrs.evolve(ROUTES, sharing_chunk_heads=heads)
        rt = SharedPagesRuntime(hq, 2, 128, 16, torch.float16, routes=routes, calibration=SEED,
                                max_batch=8, max_pages_per_row=64, options=RuntimeOptions(flashinfer=False))
        assert rt.chunk == rows, (heads, hq)
        assert (rt.shared is None) == (rows == 1)
        if rt.shared is not None:
            assert rt.shared.num_qo_heads == 2 * rows * (hq // 2)
    routes = attrs.evolve(ROUTES, sharing_chunk_heads=32)
    asked = SharedPagesRuntime(8, 2, 128, 16, torch.float16, routes=routes, calibration=SEED, max_batch=8,
                               max_pages_per_row=64,
                               options=RuntimeOptions(flashinfer=False, shared_chunk_rows=2))
    assert asked.chunk == 2


@pytest.mark.parametrize("device_planning", [False, True], ids=["host lengths", "device lengths"])
def test_fewer_chunk_rows_are_exact(fake_device, pool, device_planning):  # noqa: F811
    """``RuntimeOptions(shared_chunk_rows=2)``: chunks of 2 rows (the chunk decode at group 2 G)
    where the kernels serve 4; 5 rows of one prefix take 3 chunks (rows 0 and 4 share their
    later pages too: one more), and the step stays exact."""
    b, _ = pool
    cache = (b.k_cache, b.v_cache)
    seq, bt = shared_step(b, [800, 850, 900, 700, 880], 30, [[0, 1, 2, 3, 4]])
    rt = runtime(device_planning=device_planning,
                 options=RuntimeOptions(flashinfer=False, shared_chunk_rows=2,
                                         shared_when_predicted_faster=False))
    assert rt.chunk == 2 and rt.shared.num_qo_heads == FAKE_SHAPE["num_kv_heads"] * 2 * G
    if device_planning:
        rt.plan(torch.as_tensor(seq), torch.as_tensor(bt))
        assert (rt.found().chunk_rows >= 0).sum(axis=1).max() == 2
    else:
        rt.plan(seq, bt)
        assert rt.plan_used.chunk_rows.shape == (4, 2)
    q = torch.randn(len(seq), FAKE_SHAPE["num_qo_heads"], FAKE_SHAPE["head_dim"],
                    generator=torch.Generator().manual_seed(5)).half()
    out = rt.run(q, *cache, out=torch.full_like(q, float("nan")))
    assert rel_err(out, ref(q, cache, seq, torch.as_tensor(bt))) < 2e-3


def test_chunk_rows_option_refusals(fake_device):  # noqa: F811
    with pytest.raises(ValueError, match="serve at most 16 rows"):
        runtime(options=RuntimeOptions(flashinfer=False, shared_chunk_rows=17))
    with pytest.raises(ValueError, match="shared_chunk_rows=0"):
        RuntimeOptions(shared_chunk_rows=0)
    assert runtime(options=RuntimeOptions(flashinfer=False, shared_chunk_rows=1)).shared is None


def loop_runs(seq, bt, page, min_rows=2):
    """The definition of shared_page_runs written as a loop over positions (the reference)."""
    pages = -(-np.asarray(seq, np.int64) // page)
    runs, open_runs = [], {}
    width = int(pages.max()) if pages.size else 0
    for j in range(width + 1):
        groups = {}
        if j < width:
            for r in np.nonzero(pages > j)[0].tolist():
                groups.setdefault(int(bt[r, j]), []).append(r)
        here = {tuple(g) for g in groups.values() if len(g) >= min_rows}
        for rows in list(open_runs):
            if rows not in here:
                first = open_runs.pop(rows)
                runs.append(SharedRun(rows, first, j - first))
        for rows in here:
            open_runs.setdefault(rows, j)
    return sorted(runs, key=lambda r: (r.first_page, r.rows))


@settings(max_examples=300, deadline=None)
@given(st.lists(st.integers(1, 300), min_size=1, max_size=9), st.integers(0, 2**31 - 1),
       st.sampled_from([1, 4, 16]), st.booleans(), st.sampled_from([2, 3]))
def test_shared_page_runs_equal_the_loop_definition(lens, seed, page, alternate, min_rows):
    """blocktables.shared_page_runs (one sort) gives the runs of its definition (a loop over
    positions), for nested prefixes and for sharing that alternates between row pairs."""
    rng = np.random.default_rng(seed)
    seq = np.array(lens, np.int32)
    width = int((-(-seq // page)).max()) + int(rng.integers(0, 3))
    bt = rng.permutation(20_000)[:len(lens) * width].reshape(len(lens), width).astype(np.int32)
    for _ in range(int(rng.integers(0, 4))):
        rows = rng.choice(len(lens), size=int(rng.integers(1, len(lens) + 1)), replace=False)
        n = int(rng.integers(1, width + 1))
        bt[rows, :n] = bt[rows[0], :n]
    if alternate:
        for j in range(width):
            perm = rng.permutation(len(lens))
            for k in range(0, len(lens) - 1, 2):
                bt[perm[k + 1], j] = bt[perm[k], j]
    assert shared_page_runs(seq, bt, page, min_rows=min_rows) == loop_runs(seq, bt, page, min_rows)
    # ids spread too far for one (position, id) key (the two-key sort), negative ones among them
    far = (bt.astype(np.int64) - 10_000) * 2**48
    assert shared_page_runs(seq, far, page, min_rows=min_rows) == loop_runs(seq, far, page, min_rows)


def test_shared_page_runs_of_ids_too_far_apart_for_one_key():
    """Ids 2^63 apart (no int64 key of position and id): the runs of the definition."""
    seq = np.array([48, 48, 48, 20], np.int32)
    bt = np.array([[-2**62, 5, 2**62], [-2**62, 5, 7], [-2**62, 6, 2**62], [1, 5, 2**62]], np.int64)
    assert shared_page_runs(seq, bt, 16) == loop_runs(seq, bt, 16) == [
        SharedRun((0, 1, 2), 0, 1), SharedRun((0, 1, 3), 1, 1), SharedRun((0, 2), 2, 1)]


# ---- device lengths: the shared prefixes found on the GPU (kernels/find_shared.cu, emulated by
# its twin sharing.plan_prefix_chunks; tests/gpu/test_sharing.py checks the kernel against it)

DEVICE_STEPS = [   # (lens, prefix pages, groups)
    ([800, 850, 900, 700], 40, [[0, 1, 2, 3]]),                    # one prefix, every row
    ([800, 850, 900, 700, 880, 600], 30, [[0, 1, 2, 3, 4]]),       # 5 rows of a leader: 3 + 2
    ([800, 850, 900, 700, 880, 860], 20, [[0, 1, 2], [3, 4, 5]]),  # two leaders
    ([641, 640, 656, 900], 40, [[0, 1, 2, 3]]),                    # rows ending at the prefix's end
    ([800, 0, 900, 700], 40, [[0, 2, 3]]),                         # an idle row (length 0)
    ([900, 800, 40], 0, []),                                       # nothing shared
]


@pytest.mark.parametrize("lens, prefix, groups", DEVICE_STEPS)
@pytest.mark.parametrize("engine_capture", [False, True], ids=["own graphs", "engine capture"])
def test_device_lengths_shared_prefixes_are_exact(fake_device, pool, lens, prefix, groups,  # noqa: F811
                                                  engine_capture):
    b, _ = pool
    cache = (b.k_cache, b.v_cache)
    seq, bt = shared_step(b, [max(n, 1) for n in lens], prefix, groups)
    seq[:] = lens
    rt = runtime(device_planning=True, engine_capture=engine_capture)
    rt.plan(torch.as_tensor(seq), torch.as_tensor(bt))
    found, twin = rt.found(), sharing.plan_prefix_chunks(seq, bt, PAGE, rt.chunk)
    for name in ("chunk_seq", "chunk_rows", "own_seq", "slots"):
        assert np.array_equal(getattr(found, name), getattr(twin, name)), name
    assert (found.tokens_saved > 0) == bool(groups)
    q = torch.randn(len(lens), FAKE_SHAPE["num_qo_heads"], FAKE_SHAPE["head_dim"],
                    generator=torch.Generator().manual_seed(len(lens))).half()
    out = rt.run(q, *cache, out=torch.full_like(q, float("nan")))
    live = seq > 0
    assert rel_err(out[live], ref(q[live], cache, seq[live], torch.as_tensor(bt[live]))) < 2e-3
    assert torch.equal(out[~live], torch.zeros_like(out[~live]))   # an idle row: zeros
    assert torch.equal(rt.run(q, *cache), out)                     # a second layer
    key = rt.step_key
    assert key[0] == "shared-device" and "found on the GPU" in rt.explain()
    seq2 = seq.copy()
    seq2[live] += 1                 # the next step: the same key (fixed shapes), whatever is shared
    rt.plan(torch.as_tensor(seq2), torch.as_tensor(bt))
    assert rt.step_key == key
    assert rt.own.device_status() == 0 and rt.shared.device_status() == 0


def test_device_lengths_with_sinks_and_forced_routes(fake_device, pool):  # noqa: F811
    from pkvrt import reference

    b, _ = pool
    seq, bt = shared_step(b, [800, 850, 900, 700], 40, [[0, 1, 2, 3]])
    rt = runtime(device_planning=True, sinks=True)
    q = torch.randn(4, FAKE_SHAPE["num_qo_heads"], FAKE_SHAPE["head_dim"]).half() * 2
    sinks = torch.linspace(-1, 6, FAKE_SHAPE["num_qo_heads"])
    want = reference.decode_attention(q, b.k_cache, b.v_cache, torch.as_tensor(seq),
                                      torch.as_tensor(bt), sinks=sinks)
    rt.plan(torch.as_tensor(seq), torch.as_tensor(bt))
    assert rel_err(rt.run(q, b.k_cache, b.v_cache, sinks=sinks), want) < 2e-3
    rt.plan(torch.as_tensor(seq), torch.as_tensor(bt), force="pkv_workqueue")   # plain, no sharing
    assert rt.found() is None and rt.step_key[0] != "shared-device"
    assert rel_err(rt.run(q, b.k_cache, b.v_cache, sinks=sinks), want) < 2e-3
    with pytest.raises(ValueError, match=r"q: expected a contiguous \[B, H_q, D\] = \(4, 8, 64\) .* got shape \(3, 8, 64\)"):
        rt.plan(torch.as_tensor(seq), torch.as_tensor(bt))
        rt.run(q[:3], b.k_cache, b.v_cache, sinks=sinks)


def test_device_lengths_bad_length_is_flagged_not_read(fake_device, pool):  # noqa: F811
    """A length beyond the block table shares nothing and its own segment carries it to the
    planning kernel, which flags it (device_status) and gives it no work."""
    b, _ = pool
    seq, bt = shared_step(b, [800, 850, 900, 700], 40, [[0, 1, 2, 3]])
    seq[2] = bt.shape[1] * PAGE + 5
    found = sharing.plan_prefix_chunks(seq, bt, PAGE, 4)
    assert found.slots[2, 0] == -1 and found.own_seq[2] == seq[2]
    rt = runtime(device_planning=True)
    rt.plan(torch.as_tensor(seq), torch.as_tensor(bt))
    q = torch.randn(4, FAKE_SHAPE["num_qo_heads"], FAKE_SHAPE["head_dim"]).half()
    rt.run(q, b.k_cache, b.v_cache)
    with pytest.raises(RuntimeError, match="seq_len"):
        rt.own.device_status()


@settings(max_examples=200, deadline=None)
@given(st.lists(st.integers(0, 300), min_size=1, max_size=12), st.integers(0, 2**31 - 1),
       st.sampled_from([1, 4, 16]), st.sampled_from([2, 3, 4, 8, 16]))
def test_prefix_chunks_cover_every_page_once(lens, seed, page, c_rows):
    """The device rule, any block tables (nested prefixes, idle rows): a row's chunk prefix and
    own pages cover its pages once, in order; a chunk's rows hold its pages at its positions,
    only whole pages before their last one; chunks have 2..C rows; slots name them."""
    rng = np.random.default_rng(seed)
    seq = np.array(lens, np.int32)
    width = max(1, int((-(-seq // page)).max()))
    bt = rng.permutation(20_000)[:len(lens) * width].reshape(len(lens), width).astype(np.int32)
    for _ in range(int(rng.integers(0, 4))):
        rows = rng.choice(len(lens), size=int(rng.integers(1, len(lens) + 1)), replace=False)
        n = int(rng.integers(1, width + 1))
        bt[rows, :n] = bt[rows[0], :n]
    f = sharing.plan_prefix_chunks(seq, bt, page, c_rows)
    b = len(lens)
    for v in range(b):
        rows = [int(r) for r in f.chunk_rows[v] if r >= 0]
        n = int(f.chunk_seq[v]) // page
        assert (n > 0) == bool(rows) and (not rows or 2 <= len(rows) <= c_rows)
        for c, r in enumerate(rows):
            assert f.slots[r, 0] == v * c_rows + c
            assert n <= (seq[r] - 1) // page and (bt[r, :n] == f.chunk_bt[v, :n]).all()
    for r in range(b):
        s0 = int(f.slots[r, 0])
        run = int(f.chunk_seq[s0 // c_rows]) // page if s0 >= 0 else 0
        assert f.slots[r, 1] == (b * c_rows + r if seq[r] else -1)
        if seq[r] == 0:
            assert s0 == -1 and f.own_seq[r] == 0
            continue
        assert f.own_seq[r] == seq[r] - run * page
        k = -(-int(f.own_seq[r]) // page)
        assert (f.own_bt[r, :k] == bt[r, run:run + k]).all()
    # every leader's rows that share their first page and a whole page before the last share it
    shareable = (seq - 1) // page
    for r in range(b):
        twins = [x for x in range(b) if shareable[x] >= 1 and shareable[r] >= 1 and bt[x, 0] == bt[r, 0]]
        if len(twins) >= 2 and c_rows >= 2:
            n_chunked = sum(1 for x in twins if f.slots[x, 0] >= 0)
            assert n_chunked >= len(twins) - 1   # at most one chunk of one row (no chunk) per leader


def test_find_shared_refuses_bad_arguments():
    """ops.find_shared's host checks (no GPU needed: they run before the launch)."""
    from pkvrt.launch import ops

    b, w = 4, 8
    i32 = lambda *s: torch.zeros(*s, dtype=torch.int32)   # noqa: E731
    args = dict(seq_lens=i32(b), block_tables=i32(b, w), chunk_seq=i32(b), chunk_bt=i32(b, w),
                own_seq=i32(b), own_bt=i32(b, w), q_index=torch.zeros(b * 2 * 4 * 4, dtype=torch.int64),
                slots=torch.zeros(b, 2, dtype=torch.int64))
    kw = dict(page_size=16, chunk_rows=4, group=4, num_kv_heads=2)
    for change, match in [(dict(block_tables=i32(b, w).long()), "block_tables: expected a row-contiguous int32"),
                          (dict(q_index=torch.zeros(3, dtype=torch.int64)), "q_index: expected a contiguous int64 \\[128\\]"),
                          (dict(slots=torch.zeros(b, 3, dtype=torch.int64)), "slots: expected"),
                          (dict(own_bt=i32(b, w - 1)), "own_bt: expected a row-contiguous int32 \\[4, >= 8\\]"),
                          (dict(chunk_seq=i32(b + 1)), "chunk_seq: expected \\[4\\]")]:
        with pytest.raises(ops.KernelArgumentError, match=match):
            ops.find_shared(**{**args, **change}, **kw)
    for change, match in [(dict(page_size=12), "page_size: expected a power of two"),
                          (dict(chunk_rows=1), "chunk_rows: expected an int in \\[2, 64\\]")]:
        with pytest.raises(ops.KernelArgumentError, match=match):
            ops.find_shared(**args, **{**kw, **change})


# ----------------------------------------------------------------------------- failed calls


@pytest.mark.parametrize("device_planning", [False, True], ids=["host lengths", "device lengths"])
def test_a_failed_plan_leaves_no_plan_that_run_would_use(fake_device, pool, device_planning):  # noqa: F811
    """A plan() that raises after a step with sharing must not leave the own decode's plan as
    if it were the whole step (run() would skip the chunks and the merge): run() refuses."""
    b, _ = pool
    cache = (b.k_cache, b.v_cache)
    seq, bt = shared_step(b, [800, 850, 900, 700], 40, [[0, 1, 2, 3]])
    rt = runtime(device_planning=device_planning)
    conv = torch.as_tensor if device_planning else np.asarray
    rt.plan(conv(seq), conv(bt))
    q = torch.randn(4, FAKE_SHAPE["num_qo_heads"], FAKE_SHAPE["head_dim"],
                    generator=torch.Generator().manual_seed(2)).half()
    want = ref(q, cache, seq, torch.as_tensor(bt))
    assert rel_err(rt.run(q, *cache), want) < 2e-3
    for bad in (dict(force="nope"), dict(seq_lens=conv(seq[None]))):
        args = dict(seq_lens=conv(seq), block_tables=conv(bt)) | bad
        with pytest.raises(ValueError):
            rt.plan(args["seq_lens"], args["block_tables"], force=args.get("force"))
        with pytest.raises(RuntimeError, match="no plan in effect"):
            rt.run(q, *cache)
    rt.plan(conv(seq), conv(bt))
    assert rel_err(rt.run(q, *cache), want) < 2e-3


def test_a_plain_step_is_checked_once(fake_device, pool, monkeypatch):  # noqa: F811
    """A host-lengths step without sharing is checked by the SharedPagesRuntime and handed to
    the plain Runtime as checked (the check is a fifth of a short step's plan())."""
    from pkvrt.runtime import planning, shared
    b, _ = pool
    seq = np.array([900, 1000, 40], np.int32)
    bt = b.block_tables[[0, 1, 3]].numpy()
    calls = []

    def counted(check):
        def wrapper(*a, **kw):
            calls.append(check.__module__)
            return check(*a, **kw)
        return wrapper
    monkeypatch.setattr(shared, "check_step", counted(shared.check_step))
    monkeypatch.setattr(planning, "check_step", counted(planning.check_step))
    rt = runtime()
    rt.plan(seq, bt)
    assert rt.plan_used is None and len(calls) == 1
    q = torch.randn(3, FAKE_SHAPE["num_qo_heads"], FAKE_SHAPE["head_dim"]).half()
    assert rel_err(rt.run(q, b.k_cache, b.v_cache), ref(q, (b.k_cache, b.v_cache), seq, torch.as_tensor(bt))) < 2e-3


def test_a_shared_step_hands_the_own_decode_the_step_check_step_would_give(fake_device, pool,  # noqa: F811
                                                                          monkeypatch):
    """With sharing the own decode's step is made from the caller's checked step, not checked
    again: it equals check_step's of the own segments field for field, but the largest page id,
    which is the caller's (a bound the own ids never exceed)."""
    from pkvrt.runtime.checks import check_step
    b, _ = pool
    seq, bt = shared_step(b, [700, 800, 900, 660], 40, [[0, 1, 2, 3]])
    seen = []
    rt = runtime()
    own_plan = rt.own.plan

    def spy(seq_lens, block_tables, **kw):
        seen.append((seq_lens, block_tables, kw.get("_checked")))
        return own_plan(seq_lens, block_tables, **kw)
    monkeypatch.setattr(rt.own, "plan", spy)
    rt.plan(seq, bt)
    sp = rt.plan_used
    assert sp is not None and len(seen) == 1 and seen[0][2] is not None
    given, p = seen[0][2], rt.own
    want = check_step(sp.own_seq, sp.own_bt, page_size=p.page_size, max_batch=p.max_batch,
                      max_pages_per_row=p.max_pages_per_row, validate=True)
    assert np.array_equal(given.seq, want.seq) and given.seq.dtype == want.seq.dtype
    assert given.lens == want.lens and given.pages == want.pages and given.max_pages == want.max_pages
    assert given.block_tables is sp.own_bt
    assert want.max_page_id <= given.max_page_id == int(bt[:, :-(-max(seq) // PAGE)].max())


class _StreamLog:
    """A stand-in for SharedPagesRuntime's side stream: records when it is entered, left and
    joined (on a CPU the kernels run in order, so the Runtime builds none)."""

    def __init__(self, log):
        self.log = log

    def enter(self):
        self.log.append("enter")

    def leave(self):
        self.log.append("leave")

    def join(self):
        self.log.append("join")


def _logged(log, name, fn):
    def wrapper(*a, **kw):
        log.append(name)
        return fn(*a, **kw)
    return wrapper


@pytest.mark.parametrize("device_planning", [False, True], ids=["host lengths", "device lengths"])
def test_the_chunk_decode_runs_on_the_side_stream_and_the_merge_after_both(
        fake_device, pool, monkeypatch, device_planning):  # noqa: F811
    """The chunk decode between enter() and leave() (on the side stream), the own decode after
    leave() (on the caller's), the merge only after join(): an order the GPU's streams keep
    only if this code asks for it (tests/gpu/test_sharing.py checks the arithmetic there)."""
    from pkvrt.runtime import shared
    b, _ = pool
    seq, bt = shared_step(b, [800, 850, 900, 700], 40, [[0, 1, 2, 3]])
    rt = runtime(device_planning=device_planning)
    assert rt._side is None   # the CPU: no CUDA stream
    log = []
    rt._side = _StreamLog(log)
    shared_run = rt.shared.run
    monkeypatch.setattr(rt.shared, "run", _logged(log, "chunk decode", shared_run))
    monkeypatch.setattr(rt.own, "run", _logged(log, "own decode", rt.own.run))
    monkeypatch.setattr(shared.ops, "merge_segments", _logged(log, "merge", shared.ops.merge_segments))
    if device_planning:
        rt.plan(torch.as_tensor(seq), torch.as_tensor(bt))
    else:
        rt.plan(seq, bt)
        assert rt.plan_used is not None
    q = torch.randn(4, FAKE_SHAPE["num_qo_heads"], FAKE_SHAPE["head_dim"]).half()
    out = rt.run(q, b.k_cache, b.v_cache)
    assert log == ["enter", "chunk decode", "leave", "own decode", "join", "merge"]
    assert rel_err(out, ref(q, (b.k_cache, b.v_cache), seq, torch.as_tensor(bt))) < 2e-3
    # a failed launch in either decode: the caller's stream current again, and waiting for the
    # side's work (a capture stays joined)
    for runtime_, name, want in ((rt.shared, "chunk decode", ["enter", "chunk decode", "leave", "join"]),
                                 (rt.own, "own decode",
                                  ["enter", "chunk decode", "leave", "own decode", "join"])):
        log.clear()
        monkeypatch.setattr(rt.shared, "run", _logged(log, "chunk decode", shared_run))
        monkeypatch.setattr(runtime_, "run", _logged(log, name, _raise_launch_error))
        with pytest.raises(RuntimeError, match="a failed launch"):
            rt.run(q, b.k_cache, b.v_cache)
        assert log == want, name


def _raise_launch_error(*a, **kw):
    raise RuntimeError("a failed launch")


def _side_stream_on_cuda(monkeypatch, current_device: int, record_fails: bool = False):
    """A _SideStream of cuda:1 without a GPU (the caller's stream id 7, the side's 9): torch's
    raw stream calls logged."""
    from pkvrt.runtime import shared
    calls = []
    monkeypatch.setattr(torch._C, "_cuda_getDevice", lambda: current_device, raising=False)
    monkeypatch.setattr(torch._C, "_cuda_getCurrentStream", lambda d: (7, d, 1), raising=False)
    monkeypatch.setattr(torch._C, "_cuda_setStream", lambda **kw: calls.append(("set", kw["stream_id"])),
                        raising=False)

    def stream(stream_id, name):
        return type("S", (), dict(stream_id=stream_id, device_index=1, device_type=1, name=name,
                                  wait_event=lambda self, e: calls.append(("wait", self.name))))()
    monkeypatch.setattr(torch.cuda, "Stream", lambda stream_id, device_index, device_type: stream(7, "caller"))

    class Event:
        def record(self, stream=None):
            if record_fails:
                raise RuntimeError("a sticky CUDA error")
            calls.append(("record", stream.name))
    side = object.__new__(shared._SideStream)
    side.device, side.stream = torch.device("cuda", 1), stream(9, "side")
    side._forked, side._done = Event(), Event()
    side._callers, side._caller = shared._StreamRecorder(True), stream(7, "caller")
    return side, calls


def test_the_side_stream_refuses_another_current_device(monkeypatch):
    side, calls = _side_stream_on_cuda(monkeypatch, current_device=0)
    with pytest.raises(RuntimeError, match=r"current CUDA device is cuda:0, the Runtime's cuda:1"):
        side.enter()
    assert calls == []   # no stream switched
    side, calls = _side_stream_on_cuda(monkeypatch, current_device=1)
    side.enter()
    side.leave()
    side.join()
    assert calls == [("record", "caller"), ("wait", "side"), ("set", 9), ("record", "side"), ("set", 7),
                     ("wait", "caller")]


def test_leaving_the_side_stream_restores_the_callers_after_a_failed_record(monkeypatch):
    side, calls = _side_stream_on_cuda(monkeypatch, current_device=1, record_fails=True)
    with pytest.raises(RuntimeError, match="a sticky CUDA error"):
        side.leave()
    assert calls == [("set", 7)]


def test_the_side_stream_is_an_option():
    assert RuntimeOptions().shared_side_stream is True
    with pytest.raises(ValueError, match="shared_side_stream=1: expected True or False"):
        RuntimeOptions(shared_side_stream=1)


def test_host_lengths_are_checked_on_the_callers_table_before_sharing(fake_device, pool):  # noqa: F811
    b, _ = pool
    seq, bt = shared_step(b, [800, 850, 900, 700], 40, [[0, 1, 2, 3]])
    rt = runtime()
    for s, t, match in ((seq + 0.7, bt, "seq_lens: expected an integer dtype"),
                        (seq, bt.astype(np.float64) + 0.5, "block_tables: expected an integer dtype")):
        with pytest.raises(ValueError, match=match):
            rt.plan(s, t)
    neg = bt.copy()
    neg[2, 50] = -3                 # named where the caller put it, not in a chunk's own table
    with pytest.raises(ValueError, match=r"block_tables\[2, 50\] = -3"):
        rt.plan(seq, neg)


def test_run_of_a_shared_step_checks_q_out_and_lse_first(fake_device, pool):  # noqa: F811
    b, _ = pool
    cache = (b.k_cache, b.v_cache)
    seq, bt = shared_step(b, [800, 850, 900, 700], 40, [[0, 1, 2, 3]])
    rt = runtime()
    rt.plan(seq, bt)
    assert rt.plan_used is not None
    hq, d = FAKE_SHAPE["num_qo_heads"], FAKE_SHAPE["head_dim"]
    q = torch.randn(4, hq, d).half()
    out = torch.full_like(q, 7.0)
    for kw, match in ((dict(q=q[:3]), r"q: expected .* \(4, 8, 64\)"),
                      (dict(q=q.float()), "q: expected dtype torch.float16"),
                      (dict(q=[1]), "q: expected a torch.Tensor"), (dict(out=out.float()), "out: expected"),
                      (dict(out=torch.empty(4, d, hq).half().transpose(1, 2)), "out: .*contiguous"),
                      (dict(lse=torch.empty(4, hq).half()), "lse: expected a contiguous float32")):
        args = dict(q=q, out=out) | kw
        with pytest.raises(ValueError, match=match):
            rt.run(args.pop("q"), *cache, **args)
        assert torch.equal(out, torch.full_like(q, 7.0))


@pytest.mark.parametrize("args, kw, match", [
    ((8, 0, 64, 16), {}, "num_kv_heads=0: expected a positive integer"),
    ((8, 2, 64, 16), dict(min_saved="0.5"), "min_saved='0.5': expected 0 <= min_saved < 1"),
    ((8, 2, 64, 16), dict(min_saved=float("nan")), "min_saved=nan: expected 0 <= min_saved < 1"),
])
def test_constructor_shape_and_min_saved_are_checked_first(args, kw, match):
    with pytest.raises(ValueError, match=match):
        SharedPagesRuntime(*args, **kw)


def test_min_saved_takes_any_real_number(fake_device):  # noqa: F811
    """A NumPy scalar (a value read from a config array) is a fraction like a float."""
    assert runtime(min_saved=np.float32(0.25)).min_saved == 0.25


PLAN_FIELDS = ("chunk_rows", "chunk_valid", "chunk_seq", "chunk_bt", "own_rows", "own_seq",
               "own_bt", "slots", "pages_read", "pages_unshared", "capacity_rows")


def _decode_run(rng, steps: int, *, engine_table: bool):
    """Consecutive decode steps of rows under shared prefixes, with what a serving loop does to
    them: every row one token longer a step (a new page when it crosses one: a fresh id, now and
    then an id another row uses), and now and then a row leaves, one joins under another's
    prefix, a used entry is replaced (copy-on-write), two rows swap places, one is shortened, or
    one takes several tokens at once into pages that may be others'.
    ``engine_table``: entries past a row's pages are -1 until its pages reach them (an engine's
    table gains each new page's id); else the whole table is written up front (the harness's).
    Yields (lengths [B], table [B, W]) copies."""
    width, num_pages, free = 48, 4000, iter(rng.permutation(4000).tolist())
    rows = []   # (length, its full page list of width ids)

    def new_row(prefix=None):
        ids = [next(free) for _ in range(width)]
        if prefix is not None:
            ids[:len(prefix)] = prefix
        return [int(rng.integers(PAGE + 1, 20 * PAGE)), ids]
    for _ in range(int(rng.integers(2, 7))):
        donor = rows[int(rng.integers(len(rows)))] if rows and rng.random() < 0.7 else None
        rows.append(new_row(donor[1][:int(rng.integers(1, 12))] if donor else None))
    for _ in range(steps):
        event = rng.random()
        if event < 0.04 and len(rows) > 2:
            rows.pop(int(rng.integers(len(rows))))
        elif event < 0.08 and len(rows) < 8:
            donor = rows[int(rng.integers(len(rows)))]
            rows.append(new_row(donor[1][:int(rng.integers(1, 12))]))
        elif event < 0.11:
            r = rows[int(rng.integers(len(rows)))]
            r[1][int(rng.integers(0, -(-r[0] // PAGE)))] = next(free)
        elif event < 0.13:
            i, j = rng.choice(len(rows), 2, replace=False)
            rows[i], rows[j] = rows[j], rows[i]
        elif event < 0.15:
            r = rows[int(rng.integers(len(rows)))]
            r[0] = max(1, r[0] - int(rng.integers(1, 3 * PAGE)))
        elif event < 0.19:   # several tokens at once (speculative decoding), into pages others use
            r, other = rows[int(rng.integers(len(rows)))], rows[int(rng.integers(len(rows)))]
            at, r[0] = -(-r[0] // PAGE), min(r[0] + int(rng.integers(PAGE, 3 * PAGE)), width * PAGE - 1)
            for j in range(at, -(-r[0] // PAGE)):
                if rng.random() < 0.5:
                    r[1][j] = other[1][int(rng.integers(0, -(-other[0] // PAGE)))]
        for r in rows:
            if r[0] % PAGE == 0 and rng.random() < 0.1:   # the new page is one another row uses
                other = rows[int(rng.integers(len(rows)))]
                r[1][r[0] // PAGE] = other[1][int(rng.integers(0, -(-other[0] // PAGE)))]
            r[0] = min(r[0] + 1, width * PAGE)
        seq = np.array([r[0] for r in rows], np.int32)
        bt = np.array([r[1] for r in rows], np.int32)
        if engine_table:
            bt[np.arange(width) >= -(-seq[:, None] // PAGE)] = -1
        yield seq, bt, num_pages


@settings(max_examples=25, deadline=None)
@given(seed=st.integers(0, 2**32 - 1), engine_table=st.booleans(), group=st.sampled_from([1, 4, 7, 16]))
def test_consecutive_steps_carried_plan_as_each_step_alone(seed, engine_table, group):
    """StepSharing carries a step's sharing to the next; on every step of a decode run (rows
    joining, leaving, swapping, shortened, lengthened by pages, pages replaced, new pages shared) its re-reads and
    plan are those of page_rereads and plan_sharing on the step alone, entry for entry; most
    steps are carried, and say so."""
    rng = np.random.default_rng(seed)
    steps = sharing.StepSharing(PAGE, group, capacity=sharing.CAPACITY, min_saved=0.05, num_pages=4000)
    n = 0
    for seq, bt, num_pages in _decode_run(rng, 60, engine_table=engine_table):
        before = steps.carried
        rereads = steps.step(seq, bt)
        assert rereads == sharing.page_rereads(seq, bt, PAGE, num_pages)
        got = steps.plan()
        want = sharing.plan_sharing(seq, bt, PAGE, group, capacity=sharing.CAPACITY, min_saved=0.05) \
            if rereads else None
        assert (got is None) == (want is None)
        if got is not None:
            for name in PLAN_FIELDS:
                assert np.array_equal(getattr(got, name), getattr(want, name)), name
        assert steps.followed == (steps.carried == before + 1)
        assert steps.pages_used == int((-(-seq.astype(np.int64) // PAGE)).sum())
        n += 1
    assert steps.carried >= n // 2


def test_step_sharing_without_a_page_bound_or_with_an_id_past_it_plans_each_step_alone():
    """No ``num_pages`` (nothing bounds a bincount), or an id past it: every step is planned
    from scratch, with the same answers."""
    seq = np.array([100, 100, 100], np.int32)
    bt = np.arange(3 * 8, dtype=np.int32).reshape(3, 8)
    bt[:, :4] = bt[0, :4]
    for num_pages in (None, 10):
        steps = sharing.StepSharing(PAGE, G, capacity=16, min_saved=0.0, num_pages=num_pages)
        for s in (seq, seq + 1, seq + 2):
            assert steps.step(s, bt) == sharing.page_rereads(s, bt, PAGE) == 2 * 4
            assert steps.plan() is not None and steps.carried == 0
    with pytest.raises(RuntimeError, match="no step"):
        sharing.StepSharing(PAGE, G, capacity=16, min_saved=0.0, num_pages=None).plan()


def cut_and_partition(routes, engine_capture: bool, monkeypatch):
    """A SharedPagesRuntime with shared_chunk_cut="time_model" and one with "partition", on
    ``routes``; the first's predict_step_us recording each call's ``splits`` in a list.
    Returns (cut, partition, that list, the unrecorded predict_step_us)."""
    opts = dict(flashinfer=False, shared_when_predicted_faster=False)
    rt = runtime(engine_capture=engine_capture, routes=routes,
                 options=RuntimeOptions(shared_chunk_cut="time_model", **opts))
    part = runtime(engine_capture=engine_capture, routes=routes,
                   options=RuntimeOptions(shared_chunk_cut="partition", **opts))
    calls, predict = [], rt.shared.predict_step_us
    monkeypatch.setattr(rt.shared, "predict_step_us",
                        lambda seq, **kw: calls.append(kw.get("splits")) or predict(seq, **kw))
    return rt, part, calls, predict


@pytest.mark.parametrize("engine_capture", [True, False], ids=["engine capture", "own graphs"])
def test_the_chunk_decode_cut_by_the_time_model_is_exact_and_kept_per_structure(fake_device, pool,  # noqa: F811
                                                                                monkeypatch, engine_capture):
    """RuntimeOptions(shared_chunk_cut="time_model"): the chunk decode's longest chunk is cut in
    the split count the chunk Runtime's time model predicts fastest (the planning kernel given
    that one count), predicted once per sharing structure, its step key saying so; the output
    matches the reference at every step, the pinned count is what the emulated planning kernel
    cut, and a step of another structure predicts again. Where the chunk Runtime routes by
    itself (its own graphs, host routing) nothing is pinned. The partition's cut is as before."""
    b, _ = pool
    cache = (b.k_cache, b.v_cache)
    one = shared_step(b, [800, 850, 880, 700], 40, [[0, 1, 2, 3]])
    other = shared_step(b, [800, 850, 880, 700, 860, 600], 20, [[0, 1, 2], [3, 4, 5]])
    opts = dict(flashinfer=False, shared_when_predicted_faster=False)
    anygain = attrs.evolve(ROUTES, sharing_model_cut_margin=1.0)   # any predicted gain cuts
    rt, part, predicted, predict = cut_and_partition(anygain, engine_capture, monkeypatch)
    for i, (seq, bt) in enumerate([one, (one[0] + 1, one[1]), other]):
        predicted.clear()
        rt.plan(seq, bt)
        part.plan(seq, bt)
        sp = rt.plan_used
        assert sp is not None
        pinned = rt.shared._pinned_splits
        if not engine_capture:   # the chunk Runtime's router picks its route: no pin, no prediction
            assert pinned is None and predicted == []
        else:
            route = rt.plain.registry.device_planning_route(len(sp.chunk_seq), rt.shared.router.group_size)
            tiles = -(-int(sp.chunk_seq.max()) // 32)
            min_tiles = -(-rt.shared.calibration.splits.min_split_tokens // 32)
            counts = [s for s in route.splits.candidates() if -(-tiles // s) >= min_tiles]
            want = min((predict(sp.chunk_seq, splits=s), s) for s in counts)[1]
            assert pinned == want and rt.shared.step_key[-1] == ("splits", want), i
            assert f"chunk decode cut at {want} split(s)" in rt.explain() and "cut at" not in part.explain()
            assert sorted(s for s in predicted if s is not None) == ([] if i == 1 else counts), (i, predicted)
            assert part.shared._pinned_splits is None and part.shared.step_key[-1] != ("splits", want)
        q = torch.randn(len(seq), FAKE_SHAPE["num_qo_heads"], FAKE_SHAPE["head_dim"],
                        generator=torch.Generator().manual_seed(i)).half()
        want_out = ref(q, cache, seq, torch.as_tensor(bt))
        for r in (rt, part):
            out = r.run(q, *cache, out=torch.full_like(q, float("nan")))
            assert rel_err(out, want_out) < 2e-3, i
        if engine_capture:   # the planning kernel ran in the step's first run(): its cut
            assert int(rt.shared._d_num_splits[:len(sp.chunk_seq)].max()) == want, i
    if engine_capture:   # a model that prefers the fewest splits: the kernel cuts there, not at the partition's
        seq, bt = one
        pref = runtime(engine_capture=True, routes=anygain,
                       options=RuntimeOptions(shared_chunk_cut="time_model", **opts))
        real = pref.shared.predict_step_us
        monkeypatch.setattr(pref.shared, "predict_step_us",
                            lambda seq, splits=None: splits if splits is not None else real(seq))
        pref.plan(seq, bt)
        part.plan(seq, bt)
        q = torch.randn(len(seq), FAKE_SHAPE["num_qo_heads"], FAKE_SHAPE["head_dim"]).half()
        for r in (pref, part):
            assert rel_err(r.run(q, *cache), ref(q, cache, seq, torch.as_tensor(bt))) < 2e-3
        n = len(pref.plan_used.chunk_seq)
        fewest, usual = (int(r.shared._d_num_splits[:n].max()) for r in (pref, part))
        assert fewest == pref.shared._pinned_splits == 1 < usual
    with pytest.raises(ValueError, match="shared_chunk_cut='model': expected one of 'partition', 'time_model'"):
        RuntimeOptions(shared_chunk_cut="model")


def test_a_pinned_chunk_cut_is_the_kernels_cut_whatever_the_bounds(fake_device, pool):  # noqa: F811
    """RuntimeOptions(shared_chunk_cut=N), the sweep of the cut: every chunk decode cut at N
    splits of its longest chunk, over routes.toml's bounds (four chunks of a step with
    ``model_cut_rows`` 2) and whatever the model predicts; exact; explain() says pinned. A step
    whose chunk decode does not take N is a ValueError naming the counts it takes, after which
    run() refuses (no plan in effect) and the next step that takes N plans and runs exact. The
    option takes counts >= 1 (numpy's too), not 0, negative numbers, booleans or floats, and
    only where it applies: host lengths with engine_capture."""
    b, _ = pool
    cache = (b.k_cache, b.v_cache)
    step = shared_step(b, [800, 850, 880, 700, 860, 600], 20, [[0, 1, 2], [3, 4, 5]])   # 4 chunks
    short = shared_step(b, [60, 70, 80, 90], 3, [[0, 1, 2, 3]])   # a 48-token run: one split only
    bounded = attrs.evolve(ROUTES, sharing_model_cut_rows=2)
    opts = dict(flashinfer=False, shared_when_predicted_faster=False)

    def q_and_want(seq, bt, seed):
        q = torch.randn(len(seq), FAKE_SHAPE["num_qo_heads"], FAKE_SHAPE["head_dim"],
                        generator=torch.Generator().manual_seed(seed)).half()
        return q, ref(q, cache, seq, torch.as_tensor(bt))

    q, want = q_and_want(*step, 5)
    for n in (1, np.int64(4)):
        rt = runtime(engine_capture=True, routes=bounded, options=RuntimeOptions(shared_chunk_cut=n, **opts))
        rt.plan(*step)
        chunks = len(rt.plan_used.chunk_seq)
        assert chunks == 4 and rt.shared._pinned_splits == n and rt.shared.step_key[-1] == ("splits", n)
        assert f"the chunk decode cut at {n} split(s) of its longest chunk (pinned" in rt.explain()
        assert rel_err(rt.run(q, *cache, out=torch.full_like(q, float("nan"))), want) < 2e-3, n
        assert int(rt.shared._d_num_splits[:chunks].max()) == n   # the emulated planning kernel's cut
    with pytest.raises(ValueError, match=r"shared_chunk_cut=4\): this step's chunk decode takes 1 "
                                         r"split\(s\) of its longest chunk \(48 tokens; 1 chunk"):   # 3 pages
        rt.plan(*short)
    with pytest.raises(RuntimeError, match="no plan in effect"):
        rt.run(q, *cache)
    assert rt._kept is None
    rt.plan(*step)   # a step that takes the count plans again, exact
    assert rel_err(rt.run(q, *cache, out=torch.full_like(q, float("nan"))), want) < 2e-3
    for bad in (0, -2, True, 2.0, "4"):
        with pytest.raises(ValueError, match="or a split count >= 1"):
            RuntimeOptions(shared_chunk_cut=bad)
    for kw in (dict(engine_capture=False), dict(engine_capture=True, device_planning=True)):
        with pytest.raises(ValueError, match="shared_chunk_cut=4: a pinned cut applies to host "
                                             "lengths with engine_capture=True only"):
            runtime(**kw, options=RuntimeOptions(shared_chunk_cut=4, **opts))


@pytest.mark.parametrize("engine_capture", [True, False], ids=["engine capture", "own graphs"])
def test_the_default_cut_predicts_nothing_where_the_chunk_runtime_routes_itself(fake_device, pool,  # noqa: F811
                                                                                monkeypatch, engine_capture):
    """With its own graphs (host routing) the chunk Runtime's router picks its cut: the default
    (the time model's cut) then makes no prediction of its own, so each plan() predicts the chunk
    decode exactly as with the partition's cut; under engine capture it predicts once per
    structure, then never."""
    b, _ = pool
    seq, bt = shared_step(b, [800, 850, 880, 700], 40, [[0, 1, 2, 3]])
    opts = dict(flashinfer=False, shared_when_predicted_faster=False)   # every step shared
    counts = {}
    for cut in ("time_model", "partition"):
        rt = runtime(engine_capture=engine_capture, options=RuntimeOptions(shared_chunk_cut=cut, **opts))
        calls, predict = [], rt.shared.predict_step_us
        monkeypatch.setattr(rt.shared, "predict_step_us",
                            lambda s, _c=calls, _p=predict, **kw: _c.append(kw.get("splits")) or _p(s, **kw))
        per_plan = []
        for k in range(4):   # the same structure, one token more each step
            before = len(calls)
            rt.plan(seq + k, bt)
            per_plan.append(len(calls) - before)
        assert rt.plan_used is not None
        counts[cut] = per_plan
    if engine_capture:   # the sweep once, then kept with the structure's chunk time
        assert counts["time_model"][0] > counts["partition"][0] and counts["time_model"][1:] == [0, 0, 0]
    else:
        assert counts["time_model"] == counts["partition"], counts


@pytest.mark.filterwarnings("ignore:pkvrt.Runtime. the FlashInfer route is unavailable")
def test_the_time_models_cut_is_the_default(fake_device):  # noqa: F811
    """The chunk decode is cut by the time model unless the options ask for the partition,
    options given or not (H100, 7414544: benches/NOTES.md, "The chunk decode's cut")."""
    assert RuntimeOptions().shared_chunk_cut == "time_model"
    assert runtime(engine_capture=True, options=None)._cut_here
    assert runtime(engine_capture=True, options=RuntimeOptions(flashinfer=False))._cut_here
    assert not runtime(engine_capture=True, options=RuntimeOptions(shared_chunk_cut="partition"))._cut_here


def test_chunk_decodes_of_more_chunks_than_model_cut_rows_keep_the_partition(fake_device, pool,  # noqa: F811
                                                                            monkeypatch):
    """routes.toml ``[sharing] model_cut_rows`` bounds the time model's cut: a chunk decode of
    more chunks is cut by the planning kernel's partition (nothing pinned, no sweep of counts,
    the partition's plan and prediction; explain() names the bound), one of at most that many by
    the model. Exact either way. The shipped file bounds it at 4."""
    assert ROUTES.sharing_model_cut_rows == 4 and load_routes(None).sharing_model_cut_rows == 4
    b, _ = pool
    cache = (b.k_cache, b.v_cache)
    many = shared_step(b, [800, 850, 880, 700, 860, 600], 20, [[0, 1, 2], [3, 4, 5]])   # 4 chunks
    few = shared_step(b, [800, 850, 880, 700], 40, [[0, 1, 2, 3]])                      # 1 chunk
    bounded = attrs.evolve(ROUTES, sharing_model_cut_rows=2, sharing_model_cut_margin=1.0)
    rt, part, swept, _ = cut_and_partition(bounded, True, monkeypatch)
    for i, (seq, bt) in enumerate([few, many]):   # pinned first: the over-bound step unpins
        swept.clear()
        rt.plan(seq, bt)
        part.plan(seq, bt)
        chunks = len(rt.plan_used.chunk_seq)
        assert chunks == (1, 4)[i]
        if chunks > 2:   # over the bound: the partition's cut, as without the option
            assert rt.shared._pinned_splits is None and all(s is None for s in swept), swept
            assert rt.shared.step_key == part.shared.step_key
            assert "cut by the partition: 4 chunks, over routes.toml [sharing] model_cut_rows 2" \
                in rt.explain()
        else:            # within it: the model's count, pinned
            assert rt.shared._pinned_splits is not None and any(s is not None for s in swept)
            assert rt.shared.step_key[-1] == ("splits", rt.shared._pinned_splits)
            assert "cut at" in rt.explain() and "model_cut_rows" not in rt.explain()
        q = torch.randn(len(seq), FAKE_SHAPE["num_qo_heads"], FAKE_SHAPE["head_dim"],
                        generator=torch.Generator().manual_seed(i)).half()
        want = ref(q, cache, seq, torch.as_tensor(bt))
        for r in (rt, part):
            assert rel_err(r.run(q, *cache, out=torch.full_like(q, float("nan"))), want) < 2e-3, i
        cut = rt.shared._d_num_splits[:chunks]   # what the planning kernel cut in the first run()
        if chunks > 2:
            assert torch.equal(cut, part.shared._d_num_splits[:chunks])
        else:
            assert int(cut.max()) == rt.shared._pinned_splits


@pytest.mark.parametrize("best_us, cut", [(80.0, True), (95.0, False)], ids=["1.25x", "1.05x"])
def test_the_time_models_cut_needs_model_cut_margin(fake_device, pool, monkeypatch, best_us, cut):  # noqa: F811
    """routes.toml ``[sharing] model_cut_margin`` (1.10 shipped): the model's fastest cut is
    taken only where the partition's is predicted at least that many times it; a smaller
    predicted gain keeps the partition's cut (nothing pinned, though the step before was; the
    partition's prediction; explain() says why). The model here: 100 us at the partition's
    cut, ``best_us`` at every pinned count (80 for the step before)."""
    assert ROUTES.sharing_model_cut_margin == 1.10
    b, _ = pool
    before = shared_step(b, [800, 850, 880, 700, 860, 600], 20, [[0, 1, 2], [3, 4, 5]])
    seq, bt = shared_step(b, [800, 850, 880, 700], 40, [[0, 1, 2, 3]])
    rt = runtime(engine_capture=True, options=RuntimeOptions(
        flashinfer=False, shared_when_predicted_faster=False, shared_chunk_cut="time_model"))
    best = {"us": 80.0}
    monkeypatch.setattr(rt.shared, "predict_step_us",
                        lambda seq, splits=None: 100.0 if splits is None else best["us"])
    rt.plan(*before)
    assert rt.shared._pinned_splits is not None
    best["us"] = best_us
    rt.plan(seq, bt)
    assert (rt.shared._pinned_splits is not None) == cut
    assert rt._chunk_cut(rt.plan_used) == ((rt.shared._pinned_splits, best_us) if cut else (None, 100.0))
    said = rt.explain()
    assert ("the chunk decode cut at" in said) == cut, said
    assert ("cut by the partition: predicted 100.0 us a layer against the time model's fastest "
            "cut's 95.0" in said and "under routes.toml [sharing] model_cut_margin 1.1" in said) != cut, said
    q = torch.randn(4, FAKE_SHAPE["num_qo_heads"], FAKE_SHAPE["head_dim"]).half()
    out = rt.run(q, b.k_cache, b.v_cache, out=torch.full_like(q, float("nan")))
    assert rel_err(out, ref(q, (b.k_cache, b.v_cache), seq, torch.as_tensor(bt))) < 2e-3


def test_the_time_models_cut_never_plans_past_the_planning_grid(fake_device):  # noqa: F811
    """Twelve chunks of two rows (H_kv 8): a split count the time model might prefer plans more
    tasks than the chunk Runtime's planning grid holds (the partition never does); such counts
    are not taken, so the step is planned whole (status 0) and exact, as with the partition."""
    from paged import make_batch
    hq, hkv, d, page, groups, prefix_pages, own = 32, 8, 64, 16, 12, 64, 64
    n = 2 * groups
    b = make_batch([prefix_pages * page + own] * n, num_qo_heads=hq, num_kv_heads=hkv, head_dim=d,
                   page_size=page, dtype=torch.float16, device="cpu", seed=3)
    bt = b.block_tables.numpy().copy()
    for g in range(groups):
        bt[2 * g + 1, :prefix_pages] = bt[2 * g, :prefix_pages]
    seq = np.full(n, prefix_pages * page + own, np.int32)
    want = ref(b.q, (b.k_cache, b.v_cache), seq, torch.as_tensor(bt))
    rt = SharedPagesRuntime(hq, hkv, d, page, torch.float16, calibration=SEED, max_batch=32,
                            routes=attrs.evolve(ROUTES, sharing_model_cut_margin=1.0),
                            max_pages_per_row=128, engine_capture=True, min_saved=0.0,
                            options=RuntimeOptions(flashinfer=False, shared_when_predicted_faster=False,
                                                   shared_chunk_cut="time_model"))
    rt.plan(seq, bt)
    out = rt.run(b.q, b.k_cache, b.v_cache)
    sh, chunks = rt.shared, len(rt.plan_used.chunk_seq)
    assert chunks == groups and sh.device_status(raise_on_error=False) == 0
    assert hkv * int(sh._d_num_splits[:chunks].sum()) <= sh._step.structure   # within the grid
    # the counts the grid would not hold were there to be refused: the route allows 4 and more
    assert hkv * chunks * 4 > sh._step.structure
    assert rel_err(out, want) < 2e-3


def test_a_deferred_planning_launch_cuts_at_its_steps_count(fake_device, pool):  # noqa: F811
    """Engine capture without num_pages defers the chunk decode's planning launch to the step's
    first run(): it cuts at the count the step was planned at (its step key's), even where the
    chunk Runtime was pinned to another count in between."""
    b, _ = pool
    seq, bt = shared_step(b, [800, 850, 880, 700], 40, [[0, 1, 2, 3]])
    rt = runtime(engine_capture=True, routes=attrs.evolve(ROUTES, sharing_model_cut_margin=1.0),
                 options=RuntimeOptions(flashinfer=False, shared_when_predicted_faster=False,
                                        shared_chunk_cut="time_model"))
    rt.plan(seq, bt)
    planned = rt.shared.step_key[-1]
    assert rt.shared._step.plan_launch is not None and planned[0] == "splits"
    rt.shared._pin_splits(1 if planned[1] != 1 else 4)   # another count, before the first run()
    q = torch.randn(4, FAKE_SHAPE["num_qo_heads"], FAKE_SHAPE["head_dim"]).half()
    out = rt.run(q, b.k_cache, b.v_cache)
    assert int(rt.shared._d_num_splits[:len(rt.plan_used.chunk_seq)].max()) == planned[1]
    assert rel_err(out, ref(q, (b.k_cache, b.v_cache), seq, torch.as_tensor(bt))) < 2e-3
