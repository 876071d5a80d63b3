"""Per-step plans of every route, as plain NumPy arrays with structural counters.

Pure functions of the step's ``seq_lens`` (int [B]), the attention shape, the route's split
bounds (``pkvrt.registry.SplitBounds``) and the GPU's calibration; the runtime calls one per
decode step, so they are vectorized (no Python loop over rows or tasks).

Split choice (row-local, paper section 3.5) is two small rules:

* bucket route: each bucket aims for ``cal.splits.bucket_ctas_per_sm`` CTA work per SM,
  ``S = ceil(target * sm_count / (bucket_rows * H_kv))`` (:func:`bucket_split_counts`);
* workqueue route: the whole step aims for ``cal.splits.workqueue_ctas_per_sm``, so the split
  count comes from the active batch size, ``S = ceil(target * sm_count / (active * H_kv))``,
  then each row is capped by its own tile count (:func:`workqueue_split_counts`). A step of
  one row is one bucket and takes the bucket target instead (:func:`workqueue_ctas_target`).

Both snap S to the route's allowed counts (``SplitBounds.clamp``) and then cap it by the row's
capacity ``max(1, tiles // min_split_tiles)`` (``min_split_tiles = ceil(min_split_tokens /
tile_tokens)``), taking the largest allowed count that fits, or the capacity itself when even
the smallest allowed count does not (a row is never given more splits than tiles). A split
covers a contiguous, balanced range of 32-token tiles: split ``s`` of ``S`` over ``n`` tiles owns
tiles ``[s*n//S, (s+1)*n//S)`` (:func:`split_tile_range`), so every split has at least
``n//S >= 1`` tiles and boundaries fall on multiples of ``tile_tokens``.

Counters (per step): launches, decode CTAs, CTA work per SM (``decode_ctas / sm_count``),
useful KV bytes ``sum(seq_lens) * H_kv * D * 2 (K and V) * dtype_bytes``, merge bytes and merge
launches. *Merge bytes* are the partial-state bytes the decode kernel writes and the merge
kernel reads back: per slot and query head ``D*4`` (``a``, fp32) ``+ 8`` (``m``, ``l``, fp32),
times 2 (write + read). A bucket with S = 1 writes O directly and has no slots; every workqueue
row has slots (its merge also normalises S = 1 rows). The paper's Table 4 "Merge MB" counts the
states once in MiB: ``merge_bytes / 2 / 2**20`` (B8, 160 slots: 160*32*520 B = 2.54 MiB).
"""

from __future__ import annotations

import functools
import math

import attrs
import numpy as np

from pkvrt._buildspec import TILE_TOKENS
from pkvrt.calibration import Calibration
from pkvrt.pagetable import to_csr


@attrs.frozen
class Counters:
    """Structural counters of one step on one route (see module docstring for definitions).

    FlashInfer chooses its own grid, so its ``decode_ctas`` and ``cta_work_per_sm`` are 0
    ("not known"); the cost model uses a fitted number for it instead.
    """

    launches: int
    decode_ctas: int
    cta_work_per_sm: float
    useful_kv_bytes: int
    merge_bytes: int
    merge_launches: int


@attrs.frozen(eq=False)
class Bucket:
    """One launch group of the bucket route.

    rows : int32 [R], batch row indices (ascending). num_splits : S of every row of the bucket.
    route_len : the bucket key, tokens (exact: the common seq_len; coarse: the cap).
    """

    rows: np.ndarray
    num_splits: int
    route_len: int


@attrs.frozen(eq=False)
class BucketPlan:
    """Buckets in launch order (longest ``route_len`` first) and the step's counters."""

    buckets: tuple[Bucket, ...]
    counters: Counters


@attrs.frozen(eq=False)
class WorkqueuePlan:
    """Compact tasks of the workqueue (and fused) route.

    tasks : int32 [T, 5], ``(row, kvh, split, tok_begin, tok_end)``; ``tok_end > tok_begin``,
        ``tok_begin % tile_tokens == 0``, ``tok_end <= seq_lens[row]``; rows in order of
        decreasing tokens per split (longest tasks first), then split, then kvh.
    split_offsets : int32 [B+1], exclusive prefix sum of ``num_splits``: row ``i``'s partial
        states live in slots ``split_offsets[i] .. split_offsets[i+1]-1``.
    num_splits : int32 [B], splits of each row.
    """

    tasks: np.ndarray
    split_offsets: np.ndarray
    num_splits: np.ndarray
    counters: Counters


@attrs.frozen(eq=False)
class FlashInferPlan:
    """FlashInfer's CSR view of the same pages (all None when planned without block tables).

    indptr : int32 [B+1]; indices : int32 [nnz]; last_page_len : int32 [B].
    """

    indptr: np.ndarray | None
    indices: np.ndarray | None
    last_page_len: np.ndarray | None
    counters: Counters


# ----------------------------------------------------------------------------- inputs


def check_seq_lens(seq_lens, where: str = "seq_lens") -> np.ndarray:
    """``seq_lens`` as an int64 [B] array, B >= 1, every entry >= 1, else ValueError naming it."""
    seq = np.asarray(seq_lens)
    if seq.ndim != 1 or seq.size == 0:
        raise ValueError(f"{where}: expected a non-empty 1-D array of ints [B], got shape {seq.shape}")
    if seq.dtype.kind not in "iu":
        raise ValueError(f"{where}: expected an integer dtype (int32), got {seq.dtype}")
    seq = seq.astype(np.int64, copy=False)
    if seq.min() < 1:
        row = int(np.argmin(seq))
        raise ValueError(f"{where}[{row}] = {seq[row]}: expected every seq_len >= 1 (tokens incl. the new one)")
    return seq


def _check_heads(num_kv_heads: int, num_qo_heads: int) -> None:
    if num_kv_heads < 1 or num_qo_heads % num_kv_heads:
        raise ValueError(f"num_qo_heads={num_qo_heads}, num_kv_heads={num_kv_heads}: expected "
                         f"num_qo_heads a positive multiple of num_kv_heads")


def kv_bytes(seq: np.ndarray, *, num_kv_heads: int, head_dim: int, dtype_bytes: int) -> int:
    """Useful K+V bytes of a step: ``sum(seq_lens) * H_kv * D * 2 * dtype_bytes``."""
    return int(seq.sum()) * num_kv_heads * head_dim * 2 * dtype_bytes


def state_bytes(slots: int, *, num_qo_heads: int, head_dim: int) -> int:
    """Merge bytes of ``slots`` partial states: ``slots * H_q * (4*D + 8) * 2`` (write + read)."""
    return slots * num_qo_heads * (4 * head_dim + 8) * 2


# ----------------------------------------------------------------------------- split rules


def split_capacity(seq, *, min_split_tokens: int, tile_tokens: int = TILE_TOKENS):
    """Most splits a row of ``seq`` tokens may get: ``max(1, tiles // min_split_tiles)``.

    Example: 2500 tokens, min_split_tokens 128, tiles of 32 -> 79 tiles, 4 tiles per split at
    least -> 19 splits. Works on ints and int arrays alike.
    """
    min_tiles = -(-min_split_tokens // tile_tokens)
    tiles = -(-np.asarray(seq) // tile_tokens)
    return np.maximum(1, tiles // min_tiles)


@functools.lru_cache(maxsize=64)
def _candidates(splits) -> np.ndarray:
    """``splits.candidates()`` as an int64 array, cached per (frozen, hashable) SplitBounds."""
    return np.asarray(splits.candidates(), dtype=np.int64)


def clamp_splits(splits, want):
    """``SplitBounds.clamp`` over an int array: the nearest allowed count, ties to the smaller."""
    c = _candidates(splits)
    i = np.searchsorted(c, want, side="left")
    lo = c[np.maximum(i - 1, 0)]
    hi = c[np.minimum(i, c.size - 1)]
    return np.where(i == 0, c[0], np.where(i == c.size, c[-1], np.where(want - lo <= hi - want, lo, hi)))


def fit_to_capacity(splits, s, cap):
    """Cap split counts ``s`` by row capacities ``cap``: the largest allowed count <= cap, or cap
    itself when even the smallest allowed count exceeds it (bounds 4..64 by 4: cap 10 -> 8,
    cap 3 -> 3). Elementwise on arrays."""
    c = _candidates(splits)
    i = np.searchsorted(c, cap, side="right") - 1
    return np.minimum(s, np.where(i >= 0, c[np.maximum(i, 0)], cap))


def bucket_split_counts(rows, longest, *, num_kv_heads: int, splits, cal: Calibration,
                        tile_tokens: int = TILE_TOKENS) -> np.ndarray:
    """S of each bucket (int64 [K]): enough CTAs for the bucket target, capped by the bucket's
    longest row. ``rows``, ``longest``: int [K], rows and longest seq_len of each bucket.

    Example (seed: 28 SMs, target 9.0 CTAs/SM, min_split_tokens 128; H_kv 8; bounds 4..64 by 4):
    one 32K row: ceil(9.0*28 / (1*8)) = ceil(31.5) = 32 -> clamp 32; capacity 1024 tiles // 4 =
    256 -> S = 32 (the paper's B1 split). Two rows: ceil(252/16) = 16. One 200-token row:
    32, but capacity 7 tiles // 4 = 1 -> S = 1 (no merge).
    """
    rows = np.asarray(rows, dtype=np.int64)
    want = np.ceil(cal.splits.bucket_ctas_per_sm * cal.sm_count / (rows * num_kv_heads)).astype(np.int64)
    cap = split_capacity(longest, min_split_tokens=cal.splits.min_split_tokens, tile_tokens=tile_tokens)
    return fit_to_capacity(splits, clamp_splits(splits, want), cap)


def workqueue_ctas_target(active: int, cal: Calibration) -> float:
    """CTAs a workqueue step of ``active`` rows aims for: ``workqueue_ctas_per_sm * sm_count``,
    or for a single row ``bucket_ctas_per_sm * sm_count``.

    Why two: the workqueue target is fitted on ragged B4/B8 steps, whose short rows make short
    CTAs and want several CTAs per SM (H200: 6.8); one row is a uniform step, where one wave of
    equal CTAs is best (the bucket target, H200: 0.97). The workqueue target at B1 asked for 64
    splits of a 32K row: 48.6 us against 42.2 at 16 (benches/NOTES.md, "The split rule at B1").
    """
    per_sm = cal.splits.bucket_ctas_per_sm if active == 1 else cal.splits.workqueue_ctas_per_sm
    return per_sm * cal.sm_count


def device_plan_targets(cal: Calibration) -> dict[str, float]:
    """The CTA targets of ``ops.plan_workqueue_device`` as keywords (``ctas_target`` for steps of
    several rows, ``ctas_target_single`` for one row), the same rule as :func:`workqueue_ctas_target`."""
    return {"ctas_target": workqueue_ctas_target(2, cal), "ctas_target_single": workqueue_ctas_target(1, cal)}


def workqueue_split_counts(seq: np.ndarray, *, num_kv_heads: int, splits, cal: Calibration,
                           tile_tokens: int = TILE_TOKENS) -> np.ndarray:
    """S per row (int64 [B]): the active batch size sets the step's S, each row's tiles cap it.

    Example (seed: 28 SMs, target 45.0 CTAs/SM, min_split_tokens 128; H_kv 8; bounds 1..64 by
    4): B8 -> ceil(45*28 / (8*8)) = ceil(19.69) = 20 -> clamp 20; a 32K row keeps 20 (capacity
    256), a 2000-token row (63 tiles, capacity 15) gets 12, a 100-token row (capacity 1) gets 1.
    8 rows x 8 kvh x 20 = 1280 CTAs / 28 SMs = 45.7 CTA work per SM (the paper's Table 4).
    One row aims for the bucket target (:func:`workqueue_ctas_target`).
    """
    want = math.ceil(workqueue_ctas_target(len(seq), cal) / (len(seq) * num_kv_heads))
    cap = split_capacity(seq, min_split_tokens=cal.splits.min_split_tokens, tile_tokens=tile_tokens)
    return fit_to_capacity(splits, splits.clamp(want), cap)


def split_tile_range(split, num_splits, tiles):
    """Tiles ``[begin, end)`` of split ``split`` of ``num_splits`` over ``tiles`` tiles (balanced).

    Example: 10 tiles, 4 splits -> [0,2) [2,5) [5,7) [7,10). Works on arrays elementwise.
    """
    return split * tiles // num_splits, (split + 1) * tiles // num_splits


# ----------------------------------------------------------------------------- bucket route


def _bucket_keys(seq: np.ndarray, bucketing: str, coarse_lengths) -> np.ndarray:
    """Route length of every row: exact -> seq_len; coarse -> next coarse length >= seq_len.

    Rows longer than the last coarse length share one overflow bucket keyed by the longest of
    them (coarse (8192, 16384), rows 5000, 9000, 20000, 30000 -> keys 8192, 16384, 30000, 30000).
    """
    if bucketing == "exact":
        return seq
    if bucketing != "coarse":
        raise ValueError(f"bucketing={bucketing!r}: expected 'exact' or 'coarse'")
    coarse = np.asarray(coarse_lengths, dtype=np.int64)
    if coarse.size == 0:
        raise ValueError("coarse_lengths: expected at least one length with bucketing='coarse'")
    i = np.searchsorted(coarse, seq, side="left")
    over = i == coarse.size
    keys = coarse[np.minimum(i, coarse.size - 1)]
    if over.any():
        keys = np.where(over, seq[over].max(), keys)
    return keys


def _bucket_groups(seq, bucketing, coarse_lengths):
    """(keys [K] descending, inverse [B] into keys, rows per bucket [K], longest row per bucket [K])."""
    keys = _bucket_keys(seq, bucketing, coarse_lengths)
    uniq, inv, counts = np.unique(-keys, return_inverse=True, return_counts=True)
    if bucketing == "exact":
        longest = -uniq
    else:
        longest = np.zeros(uniq.size, dtype=np.int64)
        np.maximum.at(longest, inv, seq)
    return -uniq, inv, counts, longest


def _bucket_counters(seq, counts, s, *, num_kv_heads, num_qo_heads, head_dim, dtype_bytes, cal) -> Counters:
    split = s > 1
    n_split = int(split.sum())
    ctas = int((counts * s).sum()) * num_kv_heads
    slots = int((counts * s)[split].sum())
    return Counters(
        launches=int(s.size) + n_split, decode_ctas=ctas, cta_work_per_sm=ctas / cal.sm_count,
        useful_kv_bytes=kv_bytes(seq, num_kv_heads=num_kv_heads, head_dim=head_dim, dtype_bytes=dtype_bytes),
        merge_bytes=state_bytes(slots, num_qo_heads=num_qo_heads, head_dim=head_dim),
        merge_launches=n_split)


def bucket_from_checked(seq, *, num_kv_heads, num_qo_heads, head_dim, dtype_bytes, splits, cal, bucketing,
                        coarse_lengths, tile_tokens, rows: bool):
    """:func:`plan_bucket` (``rows=True``) or only its counters (``rows=False``) for a ``seq``
    already checked by :func:`check_seq_lens` (the router checks once per step)."""
    keys, inv, counts, longest = _bucket_groups(seq, bucketing, coarse_lengths)
    s = bucket_split_counts(counts, longest, num_kv_heads=num_kv_heads, splits=splits, cal=cal,
                            tile_tokens=tile_tokens)
    counters = _bucket_counters(seq, counts, s, num_kv_heads=num_kv_heads, num_qo_heads=num_qo_heads,
                                head_dim=head_dim, dtype_bytes=dtype_bytes, cal=cal)
    if not rows:
        return counters
    order = np.argsort(inv, kind="stable").astype(np.int32)
    groups = np.split(order, np.cumsum(counts)[:-1])
    buckets = tuple(Bucket(rows=g, num_splits=int(x), route_len=int(k)) for g, x, k in zip(groups, s, keys))
    return BucketPlan(buckets=buckets, counters=counters)


def bucket_counters(seq_lens, *, num_kv_heads: int, num_qo_heads: int, head_dim: int, dtype_bytes: int,
                    splits, cal: Calibration, bucketing: str = "exact", coarse_lengths=(),
                    tile_tokens: int = TILE_TOKENS) -> Counters:
    """The counters of :func:`plan_bucket` without building the row lists (the router's path)."""
    _check_heads(num_kv_heads, num_qo_heads)
    return bucket_from_checked(
        check_seq_lens(seq_lens), num_kv_heads=num_kv_heads, num_qo_heads=num_qo_heads,
        head_dim=head_dim, dtype_bytes=dtype_bytes, splits=splits, cal=cal, bucketing=bucketing,
        coarse_lengths=coarse_lengths, tile_tokens=tile_tokens, rows=False)


def plan_bucket(seq_lens, *, num_kv_heads: int, num_qo_heads: int, head_dim: int, dtype_bytes: int,
                splits, cal: Calibration, bucketing: str = "exact", coarse_lengths=(),
                tile_tokens: int = TILE_TOKENS) -> BucketPlan:
    """Group rows into length buckets and pick each bucket's split count.

    Parameters
    ----------
    seq_lens : int [B], tokens per row (>= 1).
    splits : SplitBounds of the route. cal : the GPU's calibration.
    bucketing : "exact" (one bucket per distinct seq_len) or "coarse" (rows go to the next of
        ``coarse_lengths``; they keep their true seq_len, the kernel is row-local).

    Returns
    -------
    BucketPlan
        one launch (two with S > 1: decode + merge) per bucket.
    """
    _check_heads(num_kv_heads, num_qo_heads)
    return bucket_from_checked(
        check_seq_lens(seq_lens), num_kv_heads=num_kv_heads, num_qo_heads=num_qo_heads,
        head_dim=head_dim, dtype_bytes=dtype_bytes, splits=splits, cal=cal, bucketing=bucketing,
        coarse_lengths=coarse_lengths, tile_tokens=tile_tokens, rows=True)


# ----------------------------------------------------------------------------- workqueue route


def workqueue_from_checked(seq, *, num_kv_heads, num_qo_heads, head_dim, dtype_bytes, splits, cal, tile_tokens,
                           tasks: bool):
    """:func:`plan_workqueue` (``tasks=True``) or only its counters (``tasks=False``) for a
    ``seq`` already checked by :func:`check_seq_lens`."""
    ns = workqueue_split_counts(seq, num_kv_heads=num_kv_heads, splits=splits, cal=cal, tile_tokens=tile_tokens)
    slots = int(ns.sum())
    ctas = slots * num_kv_heads
    counters = Counters(
        launches=2, decode_ctas=ctas, cta_work_per_sm=ctas / cal.sm_count,
        useful_kv_bytes=kv_bytes(seq, num_kv_heads=num_kv_heads, head_dim=head_dim, dtype_bytes=dtype_bytes),
        merge_bytes=state_bytes(slots, num_qo_heads=num_qo_heads, head_dim=head_dim), merge_launches=1)
    if not tasks:
        return counters
    offsets = np.zeros(seq.size + 1, dtype=np.int32)
    np.cumsum(ns, out=offsets[1:])

    # Task order: rows by decreasing tokens per split (the GPU starts the longest tasks first and
    # the short ones fill the tail), then split, then KV head (the H_kv heads of one page are
    # adjacent in the HND cache, so neighbouring CTAs read neighbouring bytes).
    order = np.argsort(-(seq // ns), kind="stable")
    ns_o = ns[order]
    first = np.zeros(seq.size, dtype=np.int64)
    np.cumsum(ns_o[:-1], out=first[1:])
    row = np.repeat(order, ns_o)                             # [N] row of each slot, task order
    split = np.arange(slots) - np.repeat(first, ns_o)        # [N]
    s_of = np.repeat(ns_o, ns_o)
    row_len = seq[row]
    t0, t1 = split_tile_range(split, s_of, -(-row_len // tile_tokens))

    # out: [N, H_kv, 5] int32 (row, kvh, split, tok_begin, tok_end) -> tasks [T = N*H_kv, 5]
    out = np.empty((slots, num_kv_heads, 5), dtype=np.int32)
    out[:, :, 0] = row[:, None]
    out[:, :, 1] = np.arange(num_kv_heads)
    out[:, :, 2] = split[:, None]
    out[:, :, 3] = (t0 * tile_tokens)[:, None]
    out[:, :, 4] = np.minimum(t1 * tile_tokens, row_len)[:, None]
    out = out.reshape(ctas, 5)
    return WorkqueuePlan(tasks=out, split_offsets=offsets, num_splits=ns.astype(np.int32), counters=counters)


def workqueue_counters(seq_lens, *, num_kv_heads: int, num_qo_heads: int, head_dim: int, dtype_bytes: int,
                       splits, cal: Calibration, tile_tokens: int = TILE_TOKENS) -> Counters:
    """The counters of :func:`plan_workqueue` without building the tasks (the router's path)."""
    _check_heads(num_kv_heads, num_qo_heads)
    return workqueue_from_checked(
        check_seq_lens(seq_lens), num_kv_heads=num_kv_heads, num_qo_heads=num_qo_heads,
        head_dim=head_dim, dtype_bytes=dtype_bytes, splits=splits, cal=cal, tile_tokens=tile_tokens,
        tasks=False)


def plan_workqueue(seq_lens, *, num_kv_heads: int, num_qo_heads: int, head_dim: int, dtype_bytes: int,
                   splits, cal: Calibration, tile_tokens: int = TILE_TOKENS) -> WorkqueuePlan:
    """Compact ``(row, kvh, split, tok_begin, tok_end)`` tasks, only non-empty ones.

    Parameters
    ----------
    seq_lens : int [B], tokens per row (>= 1).
    splits : SplitBounds of the route. cal : the GPU's calibration.

    Returns
    -------
    WorkqueuePlan
        ``sum(num_splits) * H_kv`` tasks; 2 launches (decode + merge).
    """
    _check_heads(num_kv_heads, num_qo_heads)
    return workqueue_from_checked(
        check_seq_lens(seq_lens), num_kv_heads=num_kv_heads, num_qo_heads=num_qo_heads,
        head_dim=head_dim, dtype_bytes=dtype_bytes, splits=splits, cal=cal, tile_tokens=tile_tokens,
        tasks=True)


def fused_counters(counters: Counters) -> Counters:
    """Workqueue counters with the merge fused into the decode kernel: one launch, no merge
    launch; the merge bytes stay (the last CTA of a (row, kvh) reads the others' states back)."""
    return attrs.evolve(counters, launches=1, merge_launches=0)


def plan_fused(seq_lens, **kwargs) -> WorkqueuePlan:
    """:func:`plan_workqueue` with :func:`fused_counters` (same tasks and slots)."""
    plan = plan_workqueue(seq_lens, **kwargs)
    return attrs.evolve(plan, counters=fused_counters(plan.counters))


# ----------------------------------------------------------------------------- flashinfer


def flashinfer_counters_from_checked(seq, *, num_kv_heads, head_dim, dtype_bytes) -> Counters:
    """:func:`flashinfer_counters` for a ``seq`` already checked by :func:`check_seq_lens`."""
    return Counters(launches=1, decode_ctas=0, cta_work_per_sm=0.0,
                    useful_kv_bytes=kv_bytes(seq, num_kv_heads=num_kv_heads, head_dim=head_dim,
                                             dtype_bytes=dtype_bytes),
                    merge_bytes=0, merge_launches=0)


def flashinfer_counters(seq_lens, *, num_kv_heads: int, head_dim: int, dtype_bytes: int) -> Counters:
    """One launch; FlashInfer's own grid is not known here (0), no pkvrt merge."""
    return flashinfer_counters_from_checked(check_seq_lens(seq_lens), num_kv_heads=num_kv_heads,
                                            head_dim=head_dim, dtype_bytes=dtype_bytes)


def plan_flashinfer(seq_lens, *, num_kv_heads: int, head_dim: int, dtype_bytes: int, page_size: int,
                    block_tables=None) -> FlashInferPlan:
    """FlashInfer's CSR page view (``pkvrt.pagetable.to_csr``) and counters.

    Parameters
    ----------
    seq_lens : int [B]. block_tables : int32 [B, max_pages] or None (then the CSR is None and
        the caller builds it later).
    """
    counters = flashinfer_counters(seq_lens, num_kv_heads=num_kv_heads, head_dim=head_dim, dtype_bytes=dtype_bytes)
    if block_tables is None:
        return FlashInferPlan(indptr=None, indices=None, last_page_len=None, counters=counters)
    indptr, indices, last = to_csr(seq_lens, block_tables, page_size)
    return FlashInferPlan(indptr=indptr, indices=indices, last_page_len=last, counters=counters)
