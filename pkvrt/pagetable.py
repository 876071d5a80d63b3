"""Seeded physical page assignment for a trace (paper section 3.7) and block-table -> CSR.

Every engine sees the same physical pages: the PersistentKV routes read a native block table
(``PageLayout.block_table(rids)``), FlashInfer's decode wrappers read the same pages as CSR
(:func:`to_csr`), its XQA decode as a dense table cut to the batch's columns (:func:`to_padded`).

Layout rule, worked for page_size 16, hole_fraction 0.5 and two requests of (prompt, decode)
(100, 20) and (30, 2): reserved lengths 120 and 32 round up to 8 and 2 pages, L = 10 logical
pages, the physical universe has ceil(10 / (1 - 0.5)) = 20 page ids, a seeded permutation of
0..19 is drawn, and request 0 owns its first 8 ids (logical page j -> perm[j]), request 1 the
next 2. Logical order is kept inside a row; physical ids are scattered; 10 of the 20 ids are
holes that no request owns.
"""

from __future__ import annotations

import math

import attrs
import numpy as np

from pkvrt.traces import Trace

MAX_PAGE_SIZE = 64
_INT32_MAX = 2**31 - 1


def _check_page_size(page_size, where: str) -> int:
    if isinstance(page_size, bool) or not isinstance(page_size, (int, np.integer)) \
            or not 1 <= page_size <= MAX_PAGE_SIZE or page_size & (page_size - 1):
        raise ValueError(f"{where}: page_size={page_size!r}: expected a power of two in "
                         f"1..{MAX_PAGE_SIZE}")
    return int(page_size)


def _readonly(a: np.ndarray) -> np.ndarray:
    a.setflags(write=False)
    return a


@attrs.frozen(eq=False)
class PageLayout:
    """Physical pages of every request of a trace.

    Attributes
    ----------
    page_size : tokens per page.
    num_physical_pages : size of the physical page-id universe, ``ceil(L / (1 - hole_fraction))``
        for ``L`` reserved logical pages in all; a KV cache for this layout needs this many pages.
    hole_fraction : requested fraction of page ids that no request owns.
    seed : seed of the permutation.
    table : int32 [num_requests, max_pages], logical page -> physical page id of request ``rid``
        (row ``rid``), ``-1`` past the request's ``reserved_pages``. Read-only.
    reserved_pages : int32 [num_requests], pages reserved per request (prompt + decode tokens,
        rounded up to the page or to ``bucket_len``). Read-only.
    """

    page_size: int
    num_physical_pages: int
    hole_fraction: float
    seed: int
    table: np.ndarray
    reserved_pages: np.ndarray

    @property
    def max_pages(self) -> int:
        return self.table.shape[1]

    def block_table(self, rids) -> np.ndarray:
        """int32 [B, max_pages]: the block-table rows of requests ``rids`` (int [B]), a copy."""
        return self.table[np.asarray(rids, dtype=np.intp)]


def build_layout(trace: Trace, *, page_size: int, hole_fraction: float = 0.0, seed: int,
                 bucket_len: int | None = None) -> PageLayout:
    """Assign physical pages to every request of ``trace`` (paper section 3.7).

    Parameters
    ----------
    trace : the requests; row ``rid`` of the table belongs to request ``rid``.
    page_size : tokens per page, a power of two in 1..64.
    hole_fraction : rho in [0, 1); the universe has ``ceil(L / (1 - rho))`` page ids, so about a
        fraction rho of them are unowned (rho = 0.5 doubles the address space).
    seed : seeds the permutation of the universe (``np.random.default_rng(seed)``).
    bucket_len : if given, reserved lengths round up to a multiple of it instead of the page
        (bucketed experiments); must be a positive multiple of ``page_size``.
    """
    page_size = _check_page_size(page_size, "build_layout")
    rho = float(hole_fraction)
    if not 0.0 <= rho < 1.0:
        raise ValueError(f"build_layout: hole_fraction={hole_fraction!r}: expected 0 <= "
                         "hole_fraction < 1")
    granule = page_size
    if bucket_len is not None:
        if isinstance(bucket_len, bool) or not isinstance(bucket_len, (int, np.integer)) \
                or bucket_len < page_size or bucket_len % page_size:
            raise ValueError(f"build_layout: bucket_len={bucket_len!r}: expected a positive "
                             f"multiple of page_size={page_size}")
        granule = int(bucket_len)
    exact = trace.column("prompt_len") + trace.column("decode_len")      # int64 [n]
    reserved = -(-exact // granule) * granule // page_size                 # pages per request
    total = int(reserved.sum())
    # 1e-9 keeps float noise from adding a page: L=9, rho=0.1 must give 10 ids, not 11.
    universe = max(total, math.ceil(total / (1.0 - rho) - 1e-9))
    if universe > _INT32_MAX:
        raise ValueError(f"build_layout: {universe} physical pages do not fit int32 page ids; "
                         "use a larger page_size or fewer requests")
    perm = np.random.default_rng(seed).permutation(universe).astype(np.int32)
    width = int(reserved.max())
    owned = np.arange(width) < reserved[:, None]                           # bool [n, width]
    table = np.full((len(exact), width), -1, dtype=np.int32)
    table[owned] = perm[:total]        # row-major fill: consecutive slices, logical order kept
    return PageLayout(page_size=page_size, num_physical_pages=universe, hole_fraction=rho,
                      seed=int(seed), table=_readonly(table),
                      reserved_pages=_readonly(reserved.astype(np.int32)))


def owned_pages_mask(layout: PageLayout) -> np.ndarray:
    """bool [num_physical_pages]: True where some request owns the page id."""
    mask = np.zeros(layout.num_physical_pages, dtype=bool)
    ids = layout.table[layout.table >= 0]
    mask[ids] = True
    return mask


def _used_pages(seq_lens, block_tables, page_size: int, where: str):
    """Checked (seq int64 [B], pages int64 [B], block_tables [B, max_pages], used bool
    [B, max_pages]) of a block-table batch: ``used[i, j]`` when page j of row i holds tokens."""
    page_size = _check_page_size(page_size, where)
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
    used = np.arange(bt.shape[1]) < pages[:, None]                        # bool [B, max_pages]
    return seq, pages, bt, used


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
    seq, pages, bt, used = _used_pages(seq_lens, block_tables, page_size, "to_csr")
    indices = bt[used].astype(np.int32)
    if indices.size and indices.min() < 0:
        raise _negative_page(bt, used, pages, "to_csr")
    indptr = np.zeros(len(seq) + 1, dtype=np.int32)
    np.cumsum(pages, out=indptr[1:])
    last_page_len = (seq - (pages - 1) * int(page_size)).astype(np.int32)
    return indptr, indices, last_page_len


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
    seq, pages, bt, used = _used_pages(seq_lens, block_tables, page_size, "to_padded")
    cols = int(pages.max()) if pages.size else 0
    used = used[:, :cols]
    table = np.where(used, bt[:, :cols], pad).astype(np.int32)          # C-contiguous, new
    if table.size and np.where(used, table, 0).min() < 0:
        raise _negative_page(bt, used, pages, "to_padded")
    return table, seq.astype(np.int32)
