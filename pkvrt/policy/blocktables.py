"""A step's block tables in the page formats other decode kernels read (numpy, no GPU).

PersistentKV reads a native block table ``[B, max_pages]`` (logical -> physical page id; entries
past a row's ``ceil(seq_len / page_size)`` pages are never read). FlashInfer's paged decode reads
the same pages as CSR (:func:`to_csr`), its XQA decode and vLLM's kernels as a dense table cut to
the batch's columns (:func:`to_padded`). The planner builds FlashInfer's plan with
:func:`to_csr`; the benches build their baselines' inputs with both. Rows that share pages
(prefix caching, parallel sampling) are found from the tables themselves
(:func:`shared_page_runs`, :func:`shared_read_fraction`).
"""

from __future__ import annotations

import itertools

import attrs
import numpy as np

from pkvrt._buildspec import MAX_PAGE_SIZE


def check_page_size(page_size, where: str) -> int:
    if isinstance(page_size, bool) or not isinstance(page_size, (int, np.integer)) \
            or not 1 <= page_size <= MAX_PAGE_SIZE or page_size & (page_size - 1):
        raise ValueError(f"{where}: page_size={page_size!r}: expected a power of two in "
                         f"1..{MAX_PAGE_SIZE}")
    return int(page_size)


def _checked_pages(seq_lens, block_tables, page_size: int, where: str):
    """Checked (seq int64 [B], pages int64 [B], block_tables [B, max_pages]) of a block-table
    batch: row i holds tokens in its first ``pages[i]`` entries."""
    page_size = check_page_size(page_size, where)
    seq = np.asarray(seq_lens)
    bt = np.asarray(block_tables)
    if seq.ndim != 1 or bt.ndim != 2 or bt.shape[0] != seq.shape[0]:
        raise ValueError(f"{where}: expected seq_lens [B] and block_tables [B, max_pages], got "
                         f"shapes {seq.shape} and {bt.shape}")
    seq = seq.astype(np.int64)
    if seq.size and seq.min() < 1:
        row = int(np.argmin(seq))
        raise ValueError(f"{where}: seq_lens[{row}] = {seq[row]}: expected >= 1")
    pages = -(-seq // page_size)
    if pages.size and pages.max() > bt.shape[1]:
        row = int(np.argmax(pages))
        raise ValueError(f"{where}: row {row} has seq_len {seq[row]} = {pages[row]} pages of "
                         f"{page_size}, but block_tables has only {bt.shape[1]} columns")
    return seq, pages, bt


def _used_mask(pages, columns: int) -> np.ndarray:
    """bool [B, columns]: entry j of row i holds tokens (j < pages[i])."""
    return np.arange(columns) < pages[:, None]


# Up to this many rows a loop over row slices gathers the used ids faster than the [B, columns]
# mask (dev box, to_csr of the bimodal B8 32K step: 27 vs 44 us); at 32 rows they are even
# (60 vs 56 us), past that the mask wins (a B256 gather: 31 vs 129 us).
_LOOP_ROWS = 16


def used_ids(bt: np.ndarray, pages, out: np.ndarray | None = None) -> np.ndarray:
    """The page ids the rows use (row i: its first ``pages[i]`` entries of ``bt`` [B, columns]),
    row after row: FlashInfer's CSR ``indices``. ``pages``: ints [B] (list or array), each <=
    the columns. ``out``: an array of exactly ``sum(pages)`` elements to gather into (a pinned
    staging view, say; ids are cast to its dtype as numpy's same-kind casting does), else a new
    array of ``bt``'s dtype. No check of the ids."""
    if not isinstance(pages, list):
        pages = np.asarray(pages).tolist()
    if len(pages) <= _LOOP_ROWS:
        parts = [bt[r, :p] for r, p in enumerate(pages)] or [np.empty(0, bt.dtype)]
        return np.concatenate(parts, out=out)
    used = bt[_used_mask(np.asarray(pages), bt.shape[1])]
    if out is None:
        return used
    out[...] = used
    return out


def _negative_page(bt, used, pages, where: str) -> ValueError:
    """The error for a negative (padding) page id among the pages a row uses (``used``: bool
    [B, columns] over the first columns of ``bt``)."""
    row = int(np.nonzero((bt[:, :used.shape[1]] < 0) & used)[0][0])
    return ValueError(f"{where}: block_tables row {row} has a negative (padding) page id "
                      f"within its first {pages[row]} pages")


def to_csr(seq_lens, block_tables, page_size: int) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """The pages of a block-table batch as FlashInfer's CSR arrays.

    Parameters
    ----------
    seq_lens : int [B], tokens per row (new token included), each >= 1.
    block_tables : int [B, max_pages], logical -> physical page; only the first
        ``ceil(seq_len / page_size)`` entries of a row are read.
    page_size : tokens per page.

    Returns
    -------
    indptr : int32 [B+1], ``indptr[i+1] - indptr[i] = ceil(seq_lens[i] / page_size)``.
    indices : int32 [indptr[-1]], the rows' pages in logical order, row after row.
    last_page_len : int32 [B], tokens in each row's last page, in 1..page_size
        (seq_len 33, page 16 -> 3 pages, last_page_len 1).
    """
    seq, pages, bt = _checked_pages(seq_lens, block_tables, page_size, "to_csr")
    indptr = np.empty(len(seq) + 1, dtype=np.int32)
    last_page_len = np.empty(len(seq), dtype=np.int32)
    indices = np.empty(int(pages.sum()), dtype=np.int32)
    write_csr(seq.tolist(), pages.tolist(), bt, page_size, indptr, last_page_len, indices)
    if indices.size and indices.min() < 0:
        raise _negative_page(bt, _used_mask(pages, bt.shape[1]), pages, "to_csr")
    return indptr, indices, last_page_len


def write_csr(lens: list, pages: list, bt: np.ndarray, page_size: int, indptr: np.ndarray,
              last_page_len: np.ndarray, indices: np.ndarray) -> int:
    """:func:`to_csr`'s arrays written into given ones (``indptr`` [>= B+1], ``last_page_len``
    [>= B], ``indices`` [>= sum(pages)]: the Runtime's pinned staging, say) from already checked
    lengths and their page counts as Python ints; returns nnz. No check of the ids."""
    b = len(lens)
    indptr[0] = 0
    indptr[1:b + 1] = list(itertools.accumulate(pages))
    nnz = int(indptr[b])
    last_page_len[:b] = [n - (p - 1) * page_size for n, p in zip(lens, pages)]
    used_ids(bt, pages, out=indices[:nnz])
    return nnz


def to_padded(seq_lens, block_tables, page_size: int, pad: int = 0) -> tuple[np.ndarray, np.ndarray]:
    """The pages of a block-table batch as a dense table cut to the columns the batch uses: the
    page table of kernels that take one (FlashInfer's XQA decode, vLLM's block tables).

    XQA sizes its grid from the table's width (``columns * page_size`` is its max_seq_len), so
    the table is exactly as wide as the longest row needs, and C-contiguous (XQA reads it as
    ``[B, columns]`` by raw pointer). Entries past a row's pages are ``pad``, a page id every
    cache has, so a kernel that fetched one would still read inside the cache. Example: seq_lens
    [33, 5], page 16 -> 3 columns; row 0 = its pages 0..2, row 1 = [its page 0, pad, pad].

    Parameters
    ----------
    seq_lens : int [B], tokens per row, each >= 1.
    block_tables : int [B, max_pages], logical -> physical page (as :func:`to_csr` reads it).
    page_size : tokens per page. pad : the page id of unused entries.

    Returns
    -------
    table : int32 [B, ceil(max(seq_lens) / page_size)], C-contiguous.
    seq_lens : int32 [B].
    """
    seq, pages, bt = _checked_pages(seq_lens, block_tables, page_size, "to_padded")
    cols = int(pages.max()) if pages.size else 0
    used = _used_mask(pages, cols)
    table = np.where(used, bt[:, :cols], pad).astype(np.int32)          # C-contiguous, new
    if table.size and np.where(used, table, 0).min() < 0:
        raise _negative_page(bt, used, pages, "to_padded")
    return table, seq.astype(np.int32)


# --------------------------------------------------------------------------- shared pages

@attrs.frozen
class SharedRun:
    """Pages several rows read at the same logical positions (equal physical ids): logical
    pages ``first_page .. first_page + num_pages - 1`` of every row in ``rows`` (ascending)."""

    rows: tuple[int, ...]
    first_page: int
    num_pages: int


_ROW_WEIGHTS = np.random.default_rng(20261204).integers(1, 2**45, size=4096).astype(np.float64)


def _row_weights(b: int) -> np.ndarray:
    """b random integer weights below 2^45, the same at every call (grown past 4096 rows): their
    sums over groups of up to 256 rows are exact in float64."""
    global _ROW_WEIGHTS
    if b > _ROW_WEIGHTS.size:
        _ROW_WEIGHTS = np.random.default_rng(20261204).integers(1, 2**45, size=b).astype(np.float64)
    return _ROW_WEIGHTS[:b]


def shared_page_runs(seq_lens, block_tables, page_size: int, *, min_rows: int = 2) -> list[SharedRun]:
    """The step's shared page runs, from its block tables alone (no annotation from the caller).

    At each logical position j the rows that use a page there (``j < ceil(seq_len /
    page_size)``) are grouped by physical id; a group of ``min_rows`` rows or more shares that
    page. Consecutive positions shared by the same rows form one run. Any structure comes out:
    several groups in one step, nested prefixes (8 rows share pages 0..63, 4 of them also
    64..95: two runs). Example, page 16: rows of 600 tokens whose first 32 pages are one prompt's,
    then their own -> one run (rows 0..B-1, first_page 0, num_pages 32).

    One sort of the used entries: grouped by (position, page id); a group's row set
    named by the sum of its rows' random weights (exact in float64; two different sets collide
    with probability ~B^2 / 2^45); a row's runs are its maximal stretches of one shared set,
    and rows with the same (set, first, end) form a run. About 0.1-0.3 ms at B 8 x 1.4K pages on
    the 2-core dev box (a loop over positions, kept in tests/test_sharing_runtime_cpu.py as the
    reference, took 1-8 ms).
    """
    seq, pages, bt = _checked_pages(seq_lens, block_tables, page_size, "shared_page_runs")
    b, w = bt.shape
    if b == 0 or w == 0:
        return []
    # the used entries, row-major: row rs, position js, flat index at of the [B, w] table
    n = int(pages.sum())
    rs = np.repeat(np.arange(b), pages)
    js = np.arange(n) - np.repeat(np.cumsum(pages) - pages, pages)
    at = rs * w + js
    ids = bt.ravel()[at].astype(np.int64)
    lo = int(ids.min())
    span = int(ids.max()) - lo + 1
    if span <= (2**62) // w:
        # (position, id) as one int64 key, increasing along each row: the stable sort merges the
        # B sorted rows (65 us at 8 x 1.4K entries on the dev box, where numpy's default sort
        # took 0.9 ms)
        order = np.argsort(js * span + (ids - lo), kind="stable")
    else:
        order = np.lexsort((ids, js))
    sj, sv = js[order], ids[order]
    first = np.ones(n, bool)
    first[1:] = (sv[1:] != sv[:-1]) | (sj[1:] != sj[:-1])
    gid = np.empty(n, np.int64)
    gid[order] = np.cumsum(first) - 1
    counts = np.bincount(gid)
    sig_g = np.bincount(gid, weights=_row_weights(b)[rs])
    hit = counts[gid] >= min_rows
    sig = np.zeros(b * w)   # 0: an entry no other row shares, or unused
    sig[at[hit]] = sig_g[gid[hit]]
    sig = sig.reshape(b, w)
    # each row's stretches of one shared set: (row, first position, end) where the set changes
    change = np.ones((b, w), bool)
    change[:, 1:] = sig[:, 1:] != sig[:, :-1]
    rs, js = np.nonzero(change)
    ends = np.append(js[1:], w)
    ends = np.where(np.append(rs[1:] == rs[:-1], False), ends, w)
    sigs = sig[rs, js]
    keep = sigs != 0
    rs, js, ends, sigs = rs[keep], js[keep], ends[keep], sigs[keep]
    if rs.size == 0:
        return []
    # rows with the same (set, first, end) form one run; rows ascending within it
    order = np.lexsort((rs, ends, js, sigs))
    rs, js, ends, sigs = rs[order], js[order], ends[order], sigs[order]
    new_run = np.ones(rs.size, bool)
    new_run[1:] = (sigs[1:] != sigs[:-1]) | (js[1:] != js[:-1]) | (ends[1:] != ends[:-1])
    bounds = np.append(np.flatnonzero(new_run), rs.size).tolist()
    rows, firsts, lasts = rs.tolist(), js.tolist(), ends.tolist()
    runs = [SharedRun(tuple(rows[a:z]), firsts[a], lasts[a] - firsts[a])
            for a, z in zip(bounds[:-1], bounds[1:])]
    return sorted(runs, key=lambda r: (r.first_page, r.rows))


def shared_read_fraction(seq_lens, block_tables, page_size: int) -> float:
    """1 - (distinct pages the step reads) / (pages its rows read): the fraction of a step's
    page reads that reading each shared page once would save (0 without sharing)."""
    seq, pages, bt = _checked_pages(seq_lens, block_tables, page_size, "shared_read_fraction")
    ids = used_ids(bt, pages)
    return 0.0 if ids.size == 0 else 1.0 - np.unique(ids).size / ids.size
