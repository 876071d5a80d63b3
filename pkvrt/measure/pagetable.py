"""Seeded physical page assignment for a trace (paper section 3.7).

Every engine sees the same physical pages: the PersistentKV routes read a native block table
(``PageLayout.block_table(rids)``), FlashInfer's decode wrappers read the same pages as CSR
(:func:`pkvrt.policy.blocktables.to_csr`), its XQA decode as a dense table cut to the batch's
columns (:func:`pkvrt.policy.blocktables.to_padded`).

Layout rule, worked for page_size 16, hole_fraction 0.5 and two requests of (prompt, decode)
(100, 20) and (30, 2): reserved lengths 120 and 32 round up to 8 and 2 pages, L = 10 logical
pages, the physical universe has ceil(10 / (1 - 0.5)) = 20 page ids, a seeded permutation of
0..19 is drawn, and request 0 owns its first 8 ids (logical page j -> perm[j]), request 1 the
next 2. Logical order is kept inside a row; physical ids are scattered; 10 of the 20 ids are
holes that no request owns.

Prefix caching: requests whose ``prefix`` hashes agree on their first j blocks (equal hashes at
every position up to j) share the physical pages of those blocks, as an engine's prefix cache
gives them the same pages. Only whole blocks of the prompt are shared (a block of
``trace.block_tokens`` tokens is ``block_tokens / page_size`` pages; the request's last,
partial block and every decode token are its own). Worked example, page 16, blocks of 512
tokens: two samples of one 1100-token prompt share 2 blocks (64 pages) and own 5 pages each
(1100 + decode tokens - 1024). The universe counts each shared page once.
"""

from __future__ import annotations

import math

import attrs
import numpy as np

from pkvrt.measure.traces import Trace
from pkvrt.policy.blocktables import check_page_size

_INT32_MAX = 2**31 - 1


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
                 bucket_len: int | None = None, share_prefixes: bool = True) -> PageLayout:
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
    share_prefixes : give requests with equal prefix hashes the same pages (module docstring);
        the trace's ``block_tokens`` must then be a multiple of ``page_size``. Requests without
        hashes own all their pages, as with False.
    """
    page_size = check_page_size(page_size, "build_layout")
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
    shared = _shared_blocks(trace, page_size) if share_prefixes else None
    if shared is not None:
        return _shared_layout(trace, reserved, shared, page_size=page_size, rho=rho, seed=seed)
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


def _shared_blocks(trace: Trace, page_size: int) -> list[tuple] | None:
    """Per request, the keys of its shareable prefix blocks (the hashes of blocks 0..j, one key
    per whole prompt block it has hashes for); None when no request has hashes."""
    if not any(r.prefix for r in trace.requests):
        return None
    block = trace.block_tokens
    if block % page_size:
        raise ValueError(f"build_layout: the trace's prefix blocks of {block} tokens are not whole "
                         f"pages of {page_size}; a prefix cache shares whole pages")
    keys = []
    for r in trace.requests:
        n = min(len(r.prefix), r.prompt_len // block)
        keys.append(tuple(tuple(r.prefix[:j + 1]) for j in range(n)))
    return keys


def _shared_layout(trace: Trace, reserved: np.ndarray, shared: list[tuple], *, page_size: int,
                   rho: float, seed: int) -> PageLayout:
    """build_layout with prefix sharing: a block key's pages are drawn the first time a request
    needs them and reused by every later request with the same key; the rest of each request's
    pages are its own. Same permutation rule as without sharing, over the distinct pages."""
    per_block = trace.block_tokens // page_size
    distinct = {k for ks in shared for k in ks}
    own = [int(reserved[i]) - len(ks) * per_block for i, ks in enumerate(shared)]
    total = len(distinct) * per_block + sum(own)
    universe = max(total, math.ceil(total / (1.0 - rho) - 1e-9))
    if universe > _INT32_MAX:
        raise ValueError(f"build_layout: {universe} physical pages do not fit int32 page ids")
    perm = np.random.default_rng(seed).permutation(universe).astype(np.int32)
    width = int(reserved.max())
    table = np.full((len(trace.requests), width), -1, dtype=np.int32)
    pages_of: dict[tuple, np.ndarray] = {}
    at = 0
    for i, keys in enumerate(shared):
        col = 0
        for k in keys:
            if k not in pages_of:
                pages_of[k] = perm[at:at + per_block]
                at += per_block
            table[i, col:col + per_block] = pages_of[k]
            col += per_block
        table[i, col:col + own[i]] = perm[at:at + own[i]]
        at += own[i]
    return PageLayout(page_size=page_size, num_physical_pages=universe, hole_fraction=rho,
                      seed=int(seed), table=_readonly(table),
                      reserved_pages=_readonly(reserved.astype(np.int32)))


def owned_pages_mask(layout: PageLayout) -> np.ndarray:
    """bool [num_physical_pages]: True where some request owns the page id."""
    mask = np.zeros(layout.num_physical_pages, dtype=bool)
    ids = layout.table[layout.table >= 0]
    mask[ids] = True
    return mask
