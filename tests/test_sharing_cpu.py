"""Rows that share pages (prefix caching, parallel sampling) in traces and page layouts, and the
shared runs found from a step's block tables alone (no GPU)."""

from __future__ import annotations

import json

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from pkvrt.measure import pagetable, traces
from pkvrt.policy.blocktables import SharedRun, shared_page_runs, shared_read_fraction


def layout(trace, page=16, **kw):
    return pagetable.build_layout(trace, page_size=page, seed=7, **kw)


# ----------------------------------------------------------------------------- traces


def test_parallel_samples_share_their_prompts_whole_blocks():
    t = traces.synthetic("parallel", num_requests=20, seed=3)
    groups = [t.requests[i:i + 8] for i in range(0, 20, 8)]
    for g in groups:
        assert len({r.prompt_len for r in g}) == 1 and len({r.prefix for r in g}) == 1
        assert len(g[0].prefix) == -(-g[0].prompt_len // 512)
    assert not set(groups[0][0].prefix) & set(groups[1][0].prefix)
    lay = layout(t)
    for g in groups:
        shared = g[0].prompt_len // 512 * 32            # whole blocks, 32 pages of 16 each
        rows = lay.table[[r.rid for r in g]]
        assert (rows[:, :shared] == rows[0, :shared]).all()
        own = [set(rows[i, shared:lay.reserved_pages[g[i].rid]]) for i in range(len(g))]
        assert all(not (a & b) for i, a in enumerate(own) for b in own[i + 1:])   # decode pages: own
    ids = lay.table[lay.table >= 0]
    assert lay.num_physical_pages == np.unique(ids).size           # each shared page counted once


def test_sysprompt_requests_share_the_system_blocks_only():
    t = traces.synthetic("sysprompt", num_requests=6, seed=4)
    assert all(r.prefix[:8] == tuple(range(8)) and r.prompt_len >= 4096 + 256 for r in t.requests)
    lay = layout(t)
    assert (lay.table[:, :256] == lay.table[0, :256]).all()          # 8 blocks of 32 pages
    assert len({lay.table[r, 256] for r in range(6)}) == 6


@pytest.mark.parametrize("family", ["bucketed", "bimodal", "uniform", "zipf", "homogeneous"])
def test_families_without_hashes_keep_their_draws_and_layouts(family):
    t = traces.synthetic(family, num_requests=12, seed=20260623)
    assert all(r.prefix == () for r in t.requests)
    a, b = layout(t), layout(t, share_prefixes=False)
    assert np.array_equal(a.table, b.table) and a.num_physical_pages == b.num_physical_pages


def test_json_hash_ids_round_trip_and_their_errors(tmp_path):
    t = traces.synthetic("parallel", num_requests=10, seed=1)
    path = tmp_path / "p.json"
    traces.write_json(t, path)
    back = traces.load_trace(path)
    assert [r.prefix for r in back.requests] == [r.prefix for r in t.requests]
    assert back.block_tokens == 512
    with pytest.raises(ValueError, match="carries prefix hashes.*write_json"):
        traces.write_csv(t, tmp_path / "p.csv")
    bad = tmp_path / "bad.json"
    bad.write_text(json.dumps({"requests": [{"prompt_len": 600, "decode_len": 2, "hash_ids": [1, -2]}]}))
    with pytest.raises(traces.TraceError, match=r"bad.json, line 1, field 'hash_ids': expected a list of integers >= 0"):
        traces.load_trace(bad)
    bad.write_text(json.dumps({"block_tokens": 0, "requests": [{"prompt_len": 6, "decode_len": 2}]}))
    with pytest.raises(traces.TraceError, match="field 'block_tokens': expected an integer >= 1"):
        traces.load_trace(bad)


def test_the_worked_example_of_the_docs(tmp_path):
    """docs/traces.md: page 16, blocks of 512: two requests share 2 blocks (64 pages); request 0
    owns 8 pages, request 1 owns 19 (its block 2 is partial)."""
    path = tmp_path / "t.json"
    path.write_text(json.dumps({"block_tokens": 512, "requests": [
        {"prompt_len": 1100, "decode_len": 40, "hash_ids": [7, 8, 9]},
        {"prompt_len": 1300, "decode_len": 16, "hash_ids": [7, 8, 11]}]}))
    lay = layout(traces.load_trace(path))
    assert (lay.table[0, :64] == lay.table[1, :64]).all()
    assert lay.reserved_pages.tolist() == [72, 83]
    assert not set(lay.table[0, 64:72]) & set(lay.table[1, 64:83])
    assert lay.num_physical_pages == 64 + 8 + 19


def test_blocks_must_be_whole_pages():
    t = traces.synthetic("sysprompt", num_requests=2, seed=1)
    t = traces.Trace(name="t", requests=t.requests, seed=None, source="x", block_tokens=24)
    with pytest.raises(ValueError, match="blocks of 24 tokens are not whole pages of 16"):
        layout(t)


# ----------------------------------------------------------------------------- detection


def test_runs_of_a_parallel_step_and_its_read_fraction():
    t = traces.synthetic("parallel", num_requests=16, seed=1)
    lay = layout(t)
    step = list(traces.decode_steps(t, max_active=8))[5]
    bt = lay.block_table(step.rids)
    runs = shared_page_runs(step.seq_lens, bt, 16)
    shared = t.requests[0].prompt_len // 512 * 32
    assert runs == [SharedRun(tuple(range(8)), 0, shared)]
    pages = -(-step.seq_lens.astype(np.int64) // 16)
    want = 1 - (shared + (pages - shared).sum()) / pages.sum()
    assert shared_read_fraction(step.seq_lens, bt, 16) == pytest.approx(want)


def test_nested_and_separate_groups():
    """Rows 0-3 share pages 0-9, rows 0-1 also 10-14; rows 4-5 share 0-3 of their own; row 6
    shares nothing; padding past a row's length is ignored."""
    rng = np.random.default_rng(0)
    ids = iter(rng.permutation(10_000).tolist())
    bt = np.full((7, 20), -1, np.int32)
    base, deeper, other = [next(ids) for _ in range(10)], [next(ids) for _ in range(5)], [next(ids) for _ in range(4)]
    for r in range(7):
        for j in range(20):
            bt[r, j] = next(ids)
    bt[0:4, :10] = base
    bt[0:2, 10:15] = deeper
    bt[4:6, :4] = other
    seq = np.array([320, 300, 200, 170, 100, 90, 50], np.int32)        # pages 20 19 13 11 7 6 4
    bt[6, 4:] = base[0]          # beyond row 6's 4 pages: never read, not shared
    runs = shared_page_runs(seq, bt, 16)
    assert runs == [SharedRun((0, 1, 2, 3), 0, 10), SharedRun((4, 5), 0, 4), SharedRun((0, 1), 10, 5)]
    assert shared_page_runs(np.array([16, 16], np.int32), np.array([[3], [4]], np.int32), 16) == []


@settings(max_examples=40, deadline=None)
@given(st.lists(st.tuples(st.integers(1, 3000), st.integers(0, 3)), min_size=1, max_size=8),
       st.integers(0, 2**31 - 1))
def test_runs_cover_exactly_the_shared_reads(rows, seed):
    """Every (row, page) a run names is a page another row reads at the same position, and
    every such read is in exactly one run."""
    rng = np.random.default_rng(seed)
    seq = np.array([n for n, _ in rows], np.int32)
    pages = -(-seq // 16)
    group_ids = {g: rng.permutation(50_000)[:200] for g in range(4)}
    bt = np.zeros((len(rows), int(pages.max())), np.int32)
    fresh = iter(rng.permutation(np.arange(100_000, 200_000)).tolist())
    for r, (_, g) in enumerate(rows):
        k = int(rng.integers(0, pages[r] + 1)) if g else 0          # a group's prefix of k pages
        bt[r, :k] = group_ids[g][:k]
        for j in range(k, bt.shape[1]):
            bt[r, j] = next(fresh)
    covered = {}
    for run in shared_page_runs(seq, bt, 16):
        for r in run.rows:
            for j in range(run.first_page, run.first_page + run.num_pages):
                assert (r, j) not in covered
                covered[(r, j)] = run
    for r in range(len(rows)):
        for j in range(pages[r]):
            others = [s for s in range(len(rows)) if s != r and j < pages[s] and bt[s, j] == bt[r, j]]
            assert ((r, j) in covered) == bool(others), (r, j)
