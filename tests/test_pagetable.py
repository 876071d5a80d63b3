"""Page layouts (paper section 3.7) and block-table -> CSR conversion."""

from __future__ import annotations

import math

import numpy as np
import pytest
from hypothesis import given, settings, strategies as st

from pkvrt.measure import pagetable as pt
from pkvrt.measure import traces
from pkvrt.measure.traces import Request, Trace
from pkvrt.policy import blocktables


def _trace(lengths) -> Trace:
    return Trace(name="t", requests=tuple(Request(i, 0, p, d) for i, (p, d) in
                                          enumerate(lengths)), seed=None, source="test")


@pytest.mark.parametrize("family", traces.FAMILIES)
@pytest.mark.parametrize("page_size", [1, 16, 64])
@pytest.mark.parametrize("rho", [0.0, 0.3, 0.5, 0.8])
def test_layout_pages_distinct_in_universe_and_holes(family, page_size, rho):
    """Without prefix sharing every request owns its pages (tests/test_sharing_cpu.py: with)."""
    tr = traces.synthetic(family, num_requests=8, seed=11)
    lay = pt.build_layout(tr, page_size=page_size, hole_fraction=rho, seed=5, share_prefixes=False)
    exact = tr.column("prompt_len") + tr.column("decode_len")
    assert lay.reserved_pages.tolist() == [math.ceil(e / page_size) for e in exact]
    owned = lay.table[lay.table >= 0]
    total = int(lay.reserved_pages.sum())
    assert owned.size == total
    assert len(np.unique(owned)) == total                              # every page distinct
    assert owned.min() >= 0 and owned.max() < lay.num_physical_pages   # inside the universe
    # universe = ceil(L / (1 - rho)): holes are a fraction rho of it, up to one page
    assert total / (1 - rho) - 1e-6 <= lay.num_physical_pages < total / (1 - rho) + 1
    holes = lay.num_physical_pages - total
    assert abs(holes / lay.num_physical_pages - rho) <= 1 / lay.num_physical_pages
    mask = pt.owned_pages_mask(lay)
    assert mask.shape == (lay.num_physical_pages,) and mask.sum() == total
    assert mask[owned].all()                          # with the sum: exactly the owned ids


def test_layout_rows_are_prefix_then_padding():
    lay = pt.build_layout(_trace([(100, 20), (30, 2), (1, 1)]), page_size=16, seed=0)
    assert lay.reserved_pages.tolist() == [8, 2, 1]
    assert lay.table.shape == (3, 8) and lay.table.dtype == np.int32
    for row, n in enumerate(lay.reserved_pages):
        assert (lay.table[row, :n] >= 0).all() and (lay.table[row, n:] == -1).all()


def test_layout_is_consecutive_slices_of_a_seeded_permutation():
    tr = _trace([(100, 20), (30, 2), (70, 1)])
    lay = pt.build_layout(tr, page_size=16, hole_fraction=0.5, seed=7)
    perm = np.random.default_rng(7).permutation(lay.num_physical_pages)
    flat = np.concatenate([lay.table[r, :n] for r, n in enumerate(lay.reserved_pages)])
    assert flat.tolist() == perm[:flat.size].tolist()


@pytest.mark.parametrize("seed", [0, 20260623])
def test_layout_deterministic_per_seed(seed):
    tr = traces.synthetic("bimodal", num_requests=16, seed=1)
    a = pt.build_layout(tr, page_size=16, hole_fraction=0.5, seed=seed)
    b = pt.build_layout(tr, page_size=16, hole_fraction=0.5, seed=seed)
    c = pt.build_layout(tr, page_size=16, hole_fraction=0.5, seed=seed + 1)
    assert np.array_equal(a.table, b.table) and a.num_physical_pages == b.num_physical_pages
    assert not np.array_equal(a.table, c.table)


def test_layout_scatters_physical_pages():
    lay = pt.build_layout(traces.synthetic("homogeneous", num_requests=4, seed=0),
                          page_size=16, seed=3)
    row = lay.table[0, :lay.reserved_pages[0]]
    assert (np.diff(row) != 1).mean() > 0.9          # not contiguous in physical memory


def test_layout_bucket_len_rounds_up_to_bucket():
    tr = _trace([(100, 20), (8192, 64), (1, 1)])
    lay = pt.build_layout(tr, page_size=16, seed=0, bucket_len=4096)
    assert lay.reserved_pages.tolist() == [256, 768, 256]


def test_layout_arrays_are_read_only_and_block_table_copies():
    lay = pt.build_layout(_trace([(100, 20), (30, 2)]), page_size=16, seed=0)
    with pytest.raises(ValueError):
        lay.table[0, 0] = 5
    bt = lay.block_table(np.array([1, 0, 1], np.int32))
    assert bt.dtype == np.int32 and bt.shape == (3, lay.max_pages)
    assert np.array_equal(bt[0], lay.table[1]) and np.array_equal(bt[1], lay.table[0])
    original = int(lay.table[1, 0])
    bt[0, 0] = original + 1                           # a writable copy: the layout is untouched
    assert lay.table[1, 0] == original


@pytest.mark.parametrize("kwargs,words", [
    ({"page_size": 3}, "page_size=3"),
    ({"page_size": 256}, "page_size=256"),
    ({"page_size": 0}, "page_size=0"),
    ({"page_size": 16, "hole_fraction": 1.0}, "hole_fraction=1.0"),
    ({"page_size": 16, "hole_fraction": -0.1}, "hole_fraction=-0.1"),
    ({"page_size": 16, "bucket_len": 100}, "bucket_len=100"),
    ({"page_size": 16, "bucket_len": 8}, "bucket_len=8"),
])
def test_layout_argument_errors(kwargs, words):
    with pytest.raises(ValueError, match=words):
        pt.build_layout(_trace([(10, 2)]), seed=0, **kwargs)


# --------------------------------------------------------------------------- to_csr

def _to_csr_slow(seq_lens, block_tables, page_size):
    indptr, indices, last = [0], [], []
    for s, row in zip(seq_lens, block_tables):
        n = (int(s) + page_size - 1) // page_size
        indices.extend(int(p) for p in row[:n])
        indptr.append(indptr[-1] + n)
        last.append(int(s) - (n - 1) * page_size)
    return indptr, indices, last


@settings(max_examples=200, deadline=None)
@given(data=st.data(), page_size=st.sampled_from([1, 2, 4, 8, 16, 32, 64]),
       batch=st.integers(1, 40), width=st.integers(1, 20))
def test_to_csr_matches_slow_loop(data, page_size, batch, width):   # batches on both sides of _LOOP_ROWS
    seq = data.draw(st.lists(st.integers(1, width * page_size), min_size=batch, max_size=batch))
    seq = np.array(seq, np.int32)
    rng = np.random.default_rng(data.draw(st.integers(0, 2**32 - 1)))
    bt = rng.integers(0, 10_000, size=(batch, width)).astype(np.int32)
    used = np.arange(width) < (-(-seq // page_size))[:, None]
    bt[~used] = -1                                    # padding must never be read
    indptr, indices, last = blocktables.to_csr(seq, bt, page_size)
    assert indptr.dtype == indices.dtype == last.dtype == np.int32
    want = _to_csr_slow(seq, bt, page_size)
    assert (indptr.tolist(), indices.tolist(), last.tolist()) == want
    assert ((last >= 1) & (last <= page_size)).all()


def test_to_csr_on_a_layout_step():
    tr = traces.synthetic("bimodal", num_requests=16, seed=2)
    lay = pt.build_layout(tr, page_size=16, hole_fraction=0.5, seed=2)
    for step in traces.decode_steps(tr, max_active=8):
        indptr, indices, last = blocktables.to_csr(step.seq_lens, lay.block_table(step.rids), 16)
        assert indptr[-1] == indices.size and (indices >= 0).all()
        assert (indices < lay.num_physical_pages).all()
        assert ((indptr[1:] - indptr[:-1] - 1) * 16 + last).tolist() == step.seq_lens.tolist()


def test_to_csr_worked_example():
    indptr, indices, last = blocktables.to_csr([33, 16, 1], [[7, 8, 9], [4, -1, -1], [2, -1, -1]], 16)
    assert indptr.tolist() == [0, 3, 4, 5]
    assert indices.tolist() == [7, 8, 9, 4, 2]
    assert last.tolist() == [1, 16, 1]


@pytest.mark.parametrize("seq,bt,words", [
    ([49], [[1, 2, 3]], "row 0 has seq_len 49 = 4 pages"),
    ([16, 0], [[1], [2]], r"seq_lens\[1\] = 0"),
    ([17], [[1, -1]], "row 0 has a negative"),
    ([5, 5], [[1]], "shapes"),
])
def test_to_csr_errors(seq, bt, words):
    with pytest.raises(ValueError, match=words):
        blocktables.to_csr(np.array(seq), np.array(bt), 16)


def test_to_csr_rejects_bad_page_size():
    with pytest.raises(ValueError, match="page_size=12"):
        blocktables.to_csr([1], [[0]], 12)


# --------------------------------------------------------------------------- to_padded

def test_to_padded_worked_example():
    table, seq = blocktables.to_padded([33, 5], [[7, 8, 9, 10], [4, -1, -1, -1]], 16)
    assert table.tolist() == [[7, 8, 9], [4, 0, 0]]         # 3 columns: ceil(33 / 16)
    assert seq.tolist() == [33, 5]
    assert table.dtype == seq.dtype == np.int32 and table.flags.c_contiguous
    table, _ = blocktables.to_padded([33, 5], [[7, 8, 9, 10], [4, -1, -1, -1]], 16, pad=3)
    assert table[1].tolist() == [4, 3, 3]


@settings(max_examples=200, deadline=None)
@given(data=st.data(), page_size=st.sampled_from([1, 4, 16, 64]),
       batch=st.integers(1, 12), width=st.integers(1, 20))
def test_to_padded_holds_the_csr_pages(data, page_size, batch, width):
    """Row i's first ceil(seq_i / page) entries are the pages to_csr lists for it, the rest are
    the pad; the table is exactly as wide as the longest row needs (XQA's max_seq_len)."""
    seq = np.array(data.draw(st.lists(st.integers(1, width * page_size), min_size=batch,
                                      max_size=batch)), np.int32)
    rng = np.random.default_rng(data.draw(st.integers(0, 2**32 - 1)))
    bt = rng.integers(1, 10_000, size=(batch, width)).astype(np.int32)
    pages = -(-seq // page_size)
    bt[np.arange(width) >= pages[:, None]] = -1       # padding must never be copied
    table, seq_out = blocktables.to_padded(seq, bt, page_size)
    indptr, indices, _ = blocktables.to_csr(seq, bt, page_size)
    assert table.shape == (batch, pages.max()) and table.flags.c_contiguous
    assert seq_out.tolist() == seq.tolist()
    for i in range(batch):
        assert table[i, :pages[i]].tolist() == indices[indptr[i]:indptr[i + 1]].tolist()
        assert (table[i, pages[i]:] == 0).all()


def test_to_padded_on_a_layout_step():
    tr = traces.synthetic("bimodal", num_requests=16, seed=2)
    lay = pt.build_layout(tr, page_size=16, hole_fraction=0.5, seed=2)
    for step in list(traces.decode_steps(tr, max_active=8))[::7]:
        table, seq = blocktables.to_padded(step.seq_lens, lay.block_table(step.rids), 16)
        assert table.shape[1] * 16 >= seq.max() > (table.shape[1] - 1) * 16
        assert ((table >= 0) & (table < lay.num_physical_pages)).all()


@pytest.mark.parametrize("seq,bt,words", [
    ([49], [[1, 2, 3]], "to_padded: row 0 has seq_len 49 = 4 pages"),
    ([16, 0], [[1], [2]], r"to_padded: seq_lens\[1\] = 0"),
    ([17], [[1, -1]], "to_padded: block_tables row 0 has a negative"),
])
def test_to_padded_errors(seq, bt, words):
    with pytest.raises(ValueError, match=words):
        blocktables.to_padded(np.array(seq), np.array(bt), 16)
