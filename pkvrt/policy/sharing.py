"""Rows that share pages, read once: a step split into shared chunks and own segments.

Prefix caching and parallel sampling give several rows the same physical pages at the same
logical positions. Attention is a sum over keys, so a row's output is the exact merge of partial
states over any partition of its keys. :func:`plan_sharing` partitions each row's pages into

- **shared chunks**: a shared page run (:func:`~pkvrt.policy.blocktables.shared_page_runs`, on
  the pages before each row's last one: the last page holds the new token and is the row's own)
  and at most ``capacity // G`` of its rows. A chunk is one row of a decode whose group is
  ``rows x G``: its query heads are its rows' heads side by side, so each K/V tile of the run is
  read once for all of them (tensor cores at M = rows x G), and a partial state comes out per
  row;
- **own segments**: each maximal range of a row's pages outside its chunks (at least its last
  page), one decode row each, at the model's own group size;

and records, per row, where its segments' states are (``slots``), so that they merge exactly
(``out = sum_k 2^lse_k o_k / sum_k 2^lse_k``, a sink's ``e^s`` added once).

numpy only (no GPU); the runtime side is :class:`pkvrt.runtime.shared.SharedPagesRuntime`.
"""

from __future__ import annotations

import collections
import threading
import types

import attrs
import numpy as np

from pkvrt._buildspec import TILE_TOKENS
from pkvrt.policy.blocktables import (SharedRun, _checked_pages, check_page_size, shared_page_runs,
                                      used_ids)

CAPACITY = 64   # query vectors per KV head a decode kernel takes (the largest group capacity)


@attrs.frozen
class SharingPlan:
    """A step's shared chunks and own segments (numpy int32 / bool arrays).

    chunk_rows [V, C] : each chunk's rows (a chunk of fewer than C repeats its first row;
        ``chunk_valid`` says which are real). chunk_seq [V], chunk_bt [V, W] : the run's tokens
        (whole pages) and pages, a decode row each.
    own_rows [S], own_seq [S], own_bt [S, W'] : each own segment's row, tokens and pages.
    slots [B, K] : per row, the states to merge: ``v * C + c`` (chunk v, position c), ``V * C +
        s`` (own segment s), ``V * C + S`` (none: an empty state).
    pages_read, pages_unshared : K/V pages the plan reads, and the step without sharing.
    """

    capacity_rows: int
    chunk_rows: np.ndarray = attrs.field(eq=False)
    chunk_valid: np.ndarray = attrs.field(eq=False)
    chunk_seq: np.ndarray = attrs.field(eq=False)
    chunk_bt: np.ndarray = attrs.field(eq=False)
    own_rows: np.ndarray = attrs.field(eq=False)
    own_seq: np.ndarray = attrs.field(eq=False)
    own_bt: np.ndarray = attrs.field(eq=False)
    slots: np.ndarray = attrs.field(eq=False)
    pages_read: int
    pages_unshared: int

    @property
    def saved_fraction(self) -> float:
        return 1.0 - self.pages_read / self.pages_unshared


def _table(rows: list[np.ndarray]) -> np.ndarray:
    width = max(1, max(len(r) for r in rows))
    out = np.zeros((len(rows), width), np.int32)
    for i, r in enumerate(rows):
        out[i, :len(r)] = r
    return out


def plan_sharing(seq_lens, block_tables, page_size: int, group: int, *,
                 capacity: int = CAPACITY, min_saved: float = 0.0) -> SharingPlan | None:
    """The step's sharing plan, or None when no chunk of two rows or more exists (G above
    capacity / 2, no shared run) or it would save less than ``min_saved`` of the page reads.

    O(B * max_pages log) on the host (one sort, ``shared_page_runs``); callers that plan every step first
    check cheaply whether any page id repeats (:func:`any_page_repeats`), and a Runtime that
    plans consecutive steps carries what they share from one to the next (:class:`StepSharing`)."""
    seq, pages, bt = _checked_pages(seq_lens, block_tables, page_size, "plan_sharing")
    per_chunk, layout = _sharing_layout(seq, bt, page_size, group, capacity)
    return _plan_of(per_chunk, layout, seq, pages, bt, page_size, min_saved)


def _sharing_layout(seq: np.ndarray, bt: np.ndarray, page_size: int, group: int,
                    capacity: int) -> tuple[int, "_Layout | None"]:
    """(rows per chunk, the :class:`_Layout` of the step's shared runs, None where no chunk of
    two rows can exist) of a checked step: the runs' memo's, made once per sharing structure."""
    if isinstance(group, bool) or not isinstance(group, int) or group < 1:
        raise ValueError(f"plan_sharing: group={group!r}: expected a positive int")
    if isinstance(capacity, bool) or not isinstance(capacity, int) or not 1 <= capacity <= CAPACITY:
        raise ValueError(f"plan_sharing: capacity={capacity!r}: expected 1..{CAPACITY}")
    per_chunk = capacity // group
    if per_chunk < 2 or seq.size < 2:
        return per_chunk, None
    # only the whole pages before each row's last page are shared, and only pages that another
    # of those entries names: the others get ids no other entry has (negative, one per entry),
    # so no run reaches a row's last page, and the table changes (for the memo of the runs)
    # only when what is shared does, not each time a row's shareable pages grow by its own page
    shareable = (seq - 1) // page_size
    width = bt.shape[1]
    marked = np.array(bt, dtype=np.int64, copy=True)
    own = np.arange(width) >= shareable[:, None]
    ids = marked[~own]
    if ids.size and ids.min() < 0:   # (the marks are negative: such an id could join a run)
        r, j = (int(x) for x in np.argwhere(~own & (marked < 0))[0])
        raise ValueError(f"plan_sharing: block_tables[{r}, {j}] = {int(bt[r, j])}: expected page ids >= 0")
    if ids.size:
        if ids.max() < 8 * ids.size + (1 << 16):   # a bincount's size
            alone = np.bincount(ids)[ids] < 2
        else:
            _, inverse, counts = np.unique(ids, return_inverse=True, return_counts=True)
            alone = counts[inverse.ravel()] < 2
        own[~own] = alone
    marked[own] = -1 - np.nonzero(own.ravel())[0]
    runs, layouts = _memo_runs(seq, marked, page_size)
    layout = layouts.get(per_chunk)
    if layout is None:   # the chunks and segments of these runs, once per sharing structure
        layout = layouts[per_chunk] = _Layout.of(runs, bt, seq.size, per_chunk, page_size)
    return per_chunk, layout


def _plan_of(per_chunk: int, layout: "_Layout | None", seq: np.ndarray, pages: np.ndarray,
             bt: np.ndarray, page_size: int, min_saved: float) -> SharingPlan | None:
    """The step's plan from its structure's layout: the chunks as they are, the own segments of
    this step's lengths (None: no chunk, or less than ``min_saved`` of the reads saved)."""
    if layout is None or layout.chunk_rows is None:
        return None
    own_seq, own_bt, own_pages = layout.own_segments(seq, pages, bt, page_size)
    plan = SharingPlan(
        capacity_rows=per_chunk, chunk_rows=layout.chunk_rows, chunk_valid=layout.chunk_valid,
        chunk_seq=layout.chunk_seq, chunk_bt=layout.chunk_bt, own_rows=layout.own_rows,
        own_seq=own_seq, own_bt=own_bt, slots=layout.slots,
        pages_read=layout.chunk_pages + own_pages, pages_unshared=int(pages.sum()))
    return plan if plan.saved_fraction >= min_saved else None


@attrs.frozen(eq=False)
class _Layout:
    """What a step's plan takes from its shared runs alone (read-only arrays, kept with the runs
    in their memo): the chunks, and each own segment's row and bounds. A segment ends where the
    row's next run begins, or (``last``) at the row's last page, which each step computes: every
    row ends in an own segment, since no run reaches a row's last page."""

    chunk_rows: np.ndarray | None   # None: no chunk (no run)
    chunk_valid: np.ndarray | None
    chunk_seq: np.ndarray | None
    chunk_bt: np.ndarray | None
    chunk_pages: int
    own_rows: np.ndarray | None
    seg_at: np.ndarray | None       # each own segment's first page
    seg_end: np.ndarray | None      # its end page (a run's first page; last segments: unused)
    seg_last: np.ndarray | None     # bool: it ends at the row's last page
    slots: np.ndarray | None
    # the first own page of every row, where each row has one own segment (its pages after one
    # shared prefix that starts all rows' runs at the same page: parallel sampling, a system
    # prompt), so the own tables are one column slice of the step's table; else -1
    common_at: int = -1

    @classmethod
    def of(cls, runs, bt: np.ndarray, b: int, per_chunk: int, page_size: int) -> "_Layout":
        covered: list[list[tuple[int, int, int]]] = [[] for _ in range(b)]   # (first, end, slot)
        chunks: list[tuple[list[int], int, int]] = []                        # (rows, first, n)
        for run in runs:
            rows = list(run.rows)
            parts = -(-len(rows) // per_chunk)      # as few chunks as fit, of near-equal sizes
            for sub in (rows[i::parts] for i in range(parts)):
                v = len(chunks)
                chunks.append((sub, run.first_page, run.num_pages))
                for c, r in enumerate(sub):
                    covered[r].append((run.first_page, run.first_page + run.num_pages, v * per_chunk + c))
        if not chunks:
            return cls(*(None,) * 4, 0, *(None,) * 5)
        n_chunk_slots = len(chunks) * per_chunk
        own_rows, seg_at, seg_end, seg_last, row_slots = [], [], [], [], []
        for r in range(b):
            segs = sorted(covered[r])
            slots = [s for _, _, s in segs]
            at = 0
            for first, end in [(f, e) for f, e, _ in segs]:
                if first > at:    # own pages [at, first)
                    slots.append(n_chunk_slots + len(own_rows))
                    own_rows.append(r)
                    seg_at.append(at)
                    seg_end.append(first)
                    seg_last.append(False)
                at = max(at, end)
            slots.append(n_chunk_slots + len(own_rows))   # [at, the row's last page]
            own_rows.append(r)
            seg_at.append(at)
            seg_end.append(at)
            seg_last.append(True)
            row_slots.append(slots)
        empty = n_chunk_slots + len(own_rows)
        k = max(len(s) for s in row_slots)
        slots = np.full((b, k), empty, np.int32)
        for r, s in enumerate(row_slots):
            slots[r, :len(s)] = s
        arrays = dict(
            chunk_rows=np.array([sub + [sub[0]] * (per_chunk - len(sub)) for sub, _, _ in chunks], np.int32),
            chunk_valid=np.array([[c < len(sub) for c in range(per_chunk)] for sub, _, _ in chunks]),
            chunk_seq=np.array([n * page_size for _, _, n in chunks], np.int32),
            chunk_bt=_table([bt[sub[0], f:f + n] for sub, f, n in chunks]),
            own_rows=np.array(own_rows, np.int32), seg_at=np.array(seg_at, np.int64),
            seg_end=np.array(seg_end, np.int64), seg_last=np.array(seg_last), slots=slots)
        for a in arrays.values():
            a.setflags(write=False)   # shared by every plan of this structure
        one_each = len(own_rows) == b and len(set(seg_at)) == 1   # (each row's one: its last)
        return cls(chunk_pages=sum(n for _, _, n in chunks), common_at=seg_at[0] if one_each else -1,
                   **arrays)

    def own_segments(self, seq, pages, bt: np.ndarray, page_size: int) -> tuple[np.ndarray, np.ndarray, int]:
        """This step's own segments: tokens [S] int32, pages [S, W'] int32 (zero-padded), and
        how many pages they read."""
        if self.common_at >= 0:   # one slice (a third of the general gather's time at 32 rows)
            at = self.common_at
            n = pages - at
            width = int(n.max())   # (every own segment has a page)
            own_bt = bt[:, at:at + width]
            if int(n.min()) < width:   # zero past each segment's pages, as the gather pads
                own_bt = np.where(np.arange(width) < n[:, None], own_bt, 0)
            return (seq - at * page_size).astype(np.int32), own_bt.astype(np.int32), int(n.sum())
        rows, at = self.own_rows, self.seg_at
        end = np.where(self.seg_last, pages[rows], self.seg_end)
        n = end - at
        own_seq = (np.minimum(seq[rows], end * page_size) - at * page_size).astype(np.int32)
        cols = np.arange(max(1, int(n.max())))
        inside = cols < n[:, None]
        own_bt = np.where(inside, bt[rows[:, None], np.where(inside, at[:, None] + cols, 0)], 0)
        return own_seq, own_bt.astype(np.int32), int(n.sum())


_RUNS_MEMO: dict[tuple, tuple[np.ndarray, list, dict]] = {}
_RUNS_MEMO_SIZE = 16
_RUNS_MEMO_LOCK = threading.Lock()   # Runtimes planning in several threads share the memo
_FINGERPRINT_WEIGHTS = np.zeros(0, np.int64)


def _memo_runs(seq, marked: np.ndarray, page_size: int) -> tuple[list[SharedRun], dict]:
    """:func:`~pkvrt.policy.blocktables.shared_page_runs` of the marked table, remembered with a
    dict of what plans derive from them (:class:`_Layout` by chunk rows): the table changes only
    when what the step shares does (:func:`plan_sharing` marks every entry no other entry
    shares), so consecutive decode steps find their runs here. Looked up by a
    fingerprint of the table (a dot product with fixed random weights, wrapping in int64: ~10 us
    where a digest of its bytes took ~200 us on the dev box) and then compared whole, so a
    collision costs a recomputation, never a wrong plan."""
    global _FINGERPRINT_WEIGHTS
    flat = marked.ravel()
    if _FINGERPRINT_WEIGHTS.size < flat.size:   # grown (the same seed: the same first weights)
        _FINGERPRINT_WEIGHTS = np.random.default_rng(20261206).integers(
            1, 2**62, size=max(flat.size, 1 << 16), dtype=np.int64)
    key = (int(np.dot(flat, _FINGERPRINT_WEIGHTS[:flat.size])), marked.shape, page_size)
    with _RUNS_MEMO_LOCK:
        hit = _RUNS_MEMO.get(key)
    if hit is not None and np.array_equal(hit[0], marked):
        return hit[1], hit[2]
    runs = shared_page_runs(seq, marked, page_size)
    kept = marked.copy()
    kept.setflags(write=False)   # the memo's own copy: no caller can change what it compares
    entry = (kept, runs, {})
    with _RUNS_MEMO_LOCK:
        if key not in _RUNS_MEMO and len(_RUNS_MEMO) >= _RUNS_MEMO_SIZE:
            _RUNS_MEMO.pop(next(iter(_RUNS_MEMO)))
        _RUNS_MEMO[key] = entry
    return runs, entry[2]


def any_page_repeats(seq_lens, block_tables, page_size: int, num_pages: int | None = None) -> bool:
    """Whether two used block-table entries of the step name the same page: the cheap test
    before :func:`plan_sharing` (:func:`page_rereads` > 0)."""
    return page_rereads(seq_lens, block_tables, page_size, num_pages, where="any_page_repeats") > 0


def page_rereads(seq_lens, block_tables, page_size: int, num_pages: int | None = None, *,
                 where: str = "page_rereads") -> int:
    """How many of the step's page reads are re-reads: the used block-table entries minus the
    distinct pages they name (what a plain step reads again of pages another row read). A
    bincount over the used ids when ``num_pages`` bounds them (tens of µs), else a sort."""
    seq, pages, bt = _checked_pages(seq_lens, block_tables, page_size, where)
    ids = used_ids(bt, pages)
    if ids.size < 2:
        return 0
    if num_pages is not None and ids.min() >= 0 and ids.max() < num_pages:
        return int(ids.size - np.count_nonzero(np.bincount(ids, minlength=1)))
    return int(ids.size - np.unique(ids).size)


@attrs.define(eq=False)
class _Carried:
    """The last step :class:`StepSharing` planned from scratch, as the steps that followed it
    left it: its table (a copy), pages [B], a bincount of its used page ids (``num_pages``
    long), its re-reads, and the layout of what it shares (``_sharing_layout``; None where the
    structure was not planned: a step without re-reads)."""

    bt: np.ndarray
    pages: np.ndarray
    counts: np.ndarray
    rereads: int
    layout: tuple | None
    used: np.ndarray | None = None   # bool [B, W]: the used entries (made when first needed)


class StepSharing:
    """What a Runtime's consecutive host steps share, carried from one step to the next.

    :meth:`step` returns what :func:`page_rereads` would, and :meth:`plan` then what
    :func:`plan_sharing` would, but a step that follows the last one (the same rows, each with
    the same pages or one page more, the pages they had unchanged) is planned from that step
    instead of marking and looking up its whole table again. A grown row's last page of the
    step before becomes shareable, and its new page is used: while no other used entry names
    the former, the structure (the marked table of :func:`plan_sharing`, so its runs and
    layout) is unchanged, and the latter adds a re-read where another entry names it. Any other
    step (rows joined, left or reordered, a used entry replaced, a row shorter or two pages
    longer, an id outside ``num_pages``; every step without ``num_pages``, which bounds the
    bincount) is planned from scratch. The own segments are always
    the step's own. After :meth:`step`: ``followed``, whether the step followed the one before
    (so shares what it shared), and ``pages_used``, its rows' pages. Dev box, a step of the
    parallel-sampling trace (8 rows, 11K used entries): 140 us from scratch (a memo hit of its
    runs), 7 us carried, plus 22 for the own segments (2026-12-06)."""

    def __init__(self, page_size: int, group: int, *, capacity: int, min_saved: float,
                 num_pages: int | None):
        self.page_size, self.group, self.capacity = page_size, group, capacity
        self.min_saved, self.num_pages = min_saved, num_pages
        self._last: _Carried | None = None
        self._now: tuple | None = None   # the step given to step(): (seq, pages, bt)
        self.followed, self.pages_used = False, 0
        self.carried = 0   # steps planned from the one before (tests, profiles)

    def step(self, seq_lens, block_tables, *, _pages: list | None = None) -> int:
        """The step's re-reads (``page_rereads(seq_lens, block_tables, page_size, num_pages)``),
        its structure found or carried; :meth:`plan` gives its plan. ``_pages``: the rows' pages
        of a step already checked (``pkvrt.runtime.checks.check_step``: ``seq_lens`` int64 [B],
        ``block_tables`` [B, W] wide enough), so it is not checked again."""
        self._now, self.followed = None, False   # until the step is checked and its structure known
        if _pages is None:
            seq, pages, bt = _checked_pages(seq_lens, block_tables, self.page_size, "StepSharing.step")
        else:
            seq, pages, bt = seq_lens, np.array(_pages, np.int64), block_tables
        rereads = self._follow(seq, pages, bt)
        if rereads is None:
            rereads = self._from_scratch(seq, pages, bt)
        self._now, self.pages_used = (seq, pages, bt), int(pages.sum())
        return rereads

    def plan(self) -> SharingPlan | None:
        """The last :meth:`step`'s ``plan_sharing(seq_lens, block_tables, page_size, group,
        capacity=, min_saved=)``: its chunks, and own segments of its lengths."""
        if self._now is None:
            raise RuntimeError("StepSharing.plan: no step (step() was not called or raised)")
        seq, pages, bt = self._now
        if self._last is None:   # not carried
            return plan_sharing(seq, bt, self.page_size, self.group, capacity=self.capacity,
                                min_saved=self.min_saved)
        if self._last.layout is None:   # no re-reads
            return None
        return _plan_of(*self._last.layout, seq, pages, bt, self.page_size, self.min_saved)

    def _from_scratch(self, seq, pages, bt) -> int:
        self._last = None   # until this step is planned
        ids = used_ids(bt, pages)
        if self.num_pages is None or ids.size < 2 or ids.min() < 0 or ids.max() >= self.num_pages:
            return page_rereads(seq, bt, self.page_size, self.num_pages)   # not carried
        counts = np.bincount(ids, minlength=self.num_pages)
        rereads = int(ids.size - np.count_nonzero(counts))
        layout = _sharing_layout(seq, bt, self.page_size, self.group, self.capacity) if rereads else None
        self._last = _Carried(bt.copy(), pages.copy(), counts, rereads, layout)
        return rereads

    def _follow(self, seq, pages, bt) -> int | None:
        """The step's re-reads where it follows the carried step (which it then becomes), else None."""
        last = self._last
        if last is None or bt.shape != last.bt.shape:
            return None
        grew = pages - last.pages
        if grew.size == 0 or grew.min() < 0 or grew.max() > 1:
            return None
        same_table = np.array_equal(bt, last.bt)
        if not same_table:   # (an engine's table gains its new pages' ids: compare the used ones)
            if last.used is None:
                last.used = np.arange(bt.shape[1]) < last.pages[:, None]
            if not np.array_equal(bt[last.used], last.bt[last.used]):
                return None
        rereads = last.rereads
        rows = np.flatnonzero(grew)
        if rows.size:
            at = last.pages[rows]
            now_shareable, new = bt[rows, at - 1], bt[rows, at]
            if new.min() < 0 or new.max() >= last.counts.size or (last.counts[now_shareable] != 1).any():
                return None   # an id outside the count, or a page that becomes shareable is shared
            # (a few rows cross a page a step: Python ints beat np.unique on them)
            times = collections.Counter(new.tolist())
            ids = list(times)
            counts = last.counts[ids].tolist()
            rereads += rows.size - sum(1 for c in counts if c == 0)
            if rereads and last.layout is None:
                return None   # the first re-read: the structure is planned from scratch
            last.counts[ids] += list(times.values())
            if not same_table:
                last.bt = bt.copy()
            last.pages, last.rereads, last.used = pages.copy(), rereads, None
        self.followed = True
        self.carried += 1
        return rereads


def plain_step_us(predicted_us: float, rereads: int, page_bytes: int, beta_gbps: float,
                  l2_reread_cost: float) -> float:
    """A plain step's µs when ``rereads`` of its page reads meet their page in L2: the time
    model's prediction (every page read from memory) less the share of those reads L2 saves,
    ``(1 - l2_reread_cost) * rereads * page_bytes / beta`` (at most the whole prediction)."""
    saved = (1.0 - l2_reread_cost) * rereads * page_bytes / (beta_gbps * 1e3)
    return max(predicted_us - saved, 0.0)


def fit_l2_reread_cost(steps) -> float:
    """``l2_reread_cost`` fitted to measured plain steps with shared pages: ``steps`` of
    (measured µs, the time model's µs, the re-reads' µs at ``beta``) per layer; the least-squares
    ``1 - cost`` of ``measured = model - (1 - cost) * reread_us``, kept in [0, 0.95] (a re-read
    costs between 5 % of a first read and all of it). ValueError without a step of re-reads."""
    steps = [(float(m), float(p), float(x)) for m, p, x in steps]
    den = sum(x * x for _, _, x in steps)
    if not steps or den <= 0:
        raise ValueError("fit_l2_reread_cost: no measured step re-reads a page (expected steps "
                         "with shared pages)")
    saved = sum((p - m) * x for m, p, x in steps) / den
    return 1.0 - min(max(saved, 0.0), 0.95)


@attrs.frozen
class PrefixChunks:
    """One step's shared prefixes as the GPU finds them (kernels/find_shared.cu): fixed shapes
    of the step's B rows, so a captured step replays whatever the sharing.

    chunk_seq [B] int32 : chunk v's tokens (whole pages of its shared prefix), 0: no chunk v
        (an idle decode row). chunk_bt [B, W] int32 : its pages (its leader's first ones; the
        entries past chunk_seq are not used). chunk_rows [B, C] int32 : its rows, -1 past them.
    own_seq [B] int32, own_bt [B, W] int32 : each row's pages after its chunk's prefix (all of
        them without one), a decode row each (row r's own segment is decode row r).
    slots [B, 2] int64 : per row, its chunk state ``v * C + c`` (or -1) and its own state
        ``B * C + r`` (-1 for a row of length 0: its output is zeros).
    """

    chunk_seq: np.ndarray = attrs.field(eq=False)
    chunk_bt: np.ndarray = attrs.field(eq=False)
    chunk_rows: np.ndarray = attrs.field(eq=False)
    own_seq: np.ndarray = attrs.field(eq=False)
    own_bt: np.ndarray = attrs.field(eq=False)
    slots: np.ndarray = attrs.field(eq=False)
    decision: "RuleDecision | None" = None   # the rule's, where it was asked and chunks were found

    def q_index(self, num_kv_heads: int, group: int) -> np.ndarray:
        """int64 [B * H_kv * C * G]: the q row (of q viewed [B * H_q, D]) of each chunk decode
        head (v, hk, c, j): row chunk_rows[v, c]'s head hk * G + j; past a chunk's rows its first
        row, row 0 for no chunk (computed, never merged), as find_shared writes it."""
        rows = self.chunk_rows.astype(np.int64)
        first = np.where(rows[:, :1] >= 0, rows[:, :1], 0)
        rows = np.where(rows >= 0, rows, first)
        idx = (rows[:, None, :, None] * (num_kv_heads * group)
               + np.arange(num_kv_heads)[None, :, None, None] * group + np.arange(group)[None, None, None, :])
        return idx.reshape(-1)

    @property
    def tokens_saved(self) -> int:
        """Token reads (per KV head and layer) the chunks save: each chunk's prefix read once
        instead of once per row."""
        counts = (self.chunk_rows >= 0).sum(axis=1)
        return int(((counts - 1).clip(min=0) * self.chunk_seq).sum())


def plan_prefix_chunks(seq_lens, block_tables, page_size: int, chunk_rows: int,
                       rule: "SharingRule | None" = None) -> PrefixChunks:
    """The prefix sharing of one step, by the rule the GPU applies (the twin of
    kernels/find_shared.cu, which tests/gpu/test_sharing.py checks entry for entry).

    - Row r's shareable pages are the whole pages before its last one: ``s_r = (len_r - 1) //
      page_size`` (0 for a length outside [1, W * page_size]: such a row shares nothing, and its
      own segment carries the bad length to the planning kernel, which flags it).
    - Its leader is the lowest row whose first page is r's first page (both with s >= 1), and
      ``lcp_r`` is the number of leading pages r has in common with its leader, at most both
      rows' shareable pages (the leader's: its own s).
    - A leader's rows (two or more) are ordered by decreasing lcp, then row, and cut into
      ``ceil(n / chunk_rows)`` chunks of consecutive ranks of near-equal size; a chunk's prefix
      is its rows' least lcp (the last one's), and a chunk of one row is no chunk.
    - Chunks are numbered by leader row, then by their place in the order.

    - With a ``rule`` (:class:`SharingRule`) and chunks found, the chunks are kept only where
      the rule predicts the shared step faster (``decision``); otherwise the result is the plain
      step's: no chunk, every row's own segment its whole table.

    One level of sharing per leader: rows that share a longer prefix with each other than with
    their leader (nested prefixes) share only the common part here; the host's
    :func:`plan_sharing` finds every level."""
    page_size = check_page_size(page_size, "plan_prefix_chunks")
    seq, bt = np.asarray(seq_lens).astype(np.int64), np.asarray(block_tables)
    if seq.ndim != 1 or bt.ndim != 2 or bt.shape[0] != seq.shape[0]:
        raise ValueError(f"plan_prefix_chunks: expected seq_lens [B] and block_tables [B, W], got "
                         f"shapes {seq.shape} and {bt.shape}")
    if isinstance(chunk_rows, bool) or not isinstance(chunk_rows, int) or not 2 <= chunk_rows <= CAPACITY:
        raise ValueError(f"plan_prefix_chunks: chunk_rows={chunk_rows!r}: expected 2..{CAPACITY}")
    b, w = bt.shape
    c_rows = chunk_rows
    valid = (seq >= 1) & (seq <= w * page_size)
    s = np.where(valid, (seq - 1) // page_size, 0)
    leader = np.arange(b)
    lcp = np.zeros(b, np.int64)
    for r in range(b):
        if s[r] < 1:
            continue
        leader[r] = next(g for g in range(r + 1) if s[g] >= 1 and bt[g, 0] == bt[r, 0])
        g, n = leader[r], min(s[r], s[leader[r]])
        diff = np.nonzero(bt[r, :n] != bt[g, :n])[0]
        lcp[r] = diff[0] if diff.size else n
    chunk_seq = np.zeros(b, np.int32)
    chunk_bt = np.zeros((b, w), np.int32)
    members = np.full((b, c_rows), -1, np.int32)
    run = np.zeros(b, np.int64)              # each row's chunk prefix (pages), 0: none
    slot0 = np.full(b, -1, np.int64)
    leader_prefixes: dict[int, list[int]] = {}   # each leader's chunks' prefixes (pages)
    v = 0
    for g in range(b):
        rows = [r for r in range(b) if s[r] >= 1 and leader[r] == g]
        if len(rows) < 2:
            continue
        rows.sort(key=lambda r: (-lcp[r], r))
        n, parts = len(rows), -(-len(rows) // c_rows)
        for j in range(parts):
            part = rows[j * n // parts:(j + 1) * n // parts]
            prefix = int(lcp[part[-1]])
            if len(part) >= 2:
                leader_prefixes.setdefault(g, []).append(prefix)
                chunk_seq[v + j] = prefix * page_size
                chunk_bt[v + j, :prefix] = bt[g, :prefix]
                members[v + j, :len(part)] = part
                for c, r in enumerate(part):
                    run[r], slot0[r] = prefix, (v + j) * c_rows + c
        v += parts
    decision = None
    if rule is not None and (slot0 >= 0).any():
        # the re-reads: each non-leader row's pages in common with its leader (the plain step);
        # each leader's chunks' prefixes but its longest (the chunk decode)
        plain_rereads = int(sum(lcp[r] for r in range(b) if s[r] >= 1 and leader[r] != r))
        chunk_rereads = sum(sum(p) - max(p) for p in leader_prefixes.values())
        own = np.where(valid, seq - run * page_size, 0)
        decision = rule.decide(np.where(valid, seq, 0), chunk_seq, own, plain_rereads, chunk_rereads)
        if not decision.shared:   # the plain step
            chunk_seq[:], chunk_bt[:], members[:], run[:], slot0[:] = 0, 0, -1, 0, -1
    own_seq = np.where(valid, seq - run * page_size, seq).astype(np.int32)
    own_bt = np.zeros((b, w), np.int32)
    for r in range(b):
        if valid[r]:
            k = -(-int(own_seq[r]) // page_size)
            own_bt[r, :k] = bt[r, run[r]:run[r] + k]
    slot1 = np.where(seq != 0, b * c_rows + np.arange(b), -1)
    return PrefixChunks(chunk_seq=chunk_seq, chunk_bt=chunk_bt, chunk_rows=members, own_seq=own_seq,
                        own_bt=own_bt, slots=np.stack([slot0, slot1], axis=1).astype(np.int64),
                        decision=decision)


# ----------------------------------------------------------------------------- the device rule


@attrs.frozen
class DecodeTime:
    """One decode the device rule times: the route its device planning runs (``kind``
    "workqueue" or "fused", its split bounds ``splits``) on its Runtime's calibration ``cal``
    (that Runtime's group view), by the calibration's measured model, exactly as
    ``Router.predict`` times that route (:func:`pkvrt.policy.costmodel.predict_route_us`).
    ``cal`` must have a measured model of ``kind`` (:meth:`SharingRule.unavailable`)."""

    kind: str
    splits: object = attrs.field(eq=False)    # the route's SplitBounds
    cal: object = attrs.field(eq=False)       # a Calibration with a time model of kind
    num_kv_heads: int
    head_dim: int
    dtype_bytes: int
    graphs: bool

    def us(self, lens) -> float:
        """Predicted µs of the decode of ``lens`` (int [B], at least one row > 0)."""
        from pkvrt.policy.costmodel import predict_route_us

        return predict_route_us(self.kind, np.asarray(lens, dtype=np.int64), None, self.cal,
                                graphs=self.graphs, num_kv_heads=self.num_kv_heads,
                                head_dim=self.head_dim, dtype_bytes=self.dtype_bytes,
                                splits=self.splits)

    def fastest_cut(self, lens, max_tasks: int) -> tuple[int, float]:
        """(split count of the longest row, predicted µs) of the cut this time model predicts
        fastest for ``lens`` (int [B], at least one row > 0): every count the planning kernel
        takes as it is (``planner.partition_candidates``), each cut as the planning kernel cuts
        given that one count, those planning at most ``max_tasks`` CTAs (the planning grid;
        the fewest-CTA count whatever it plans); ties to fewer splits. The twin of
        ``pkv::fastest_cut`` (kernels/plan_cut.cuh) and of the host-lengths choice
        (``SharedPagesRuntime._chunk_cut``)."""
        from pkvrt.policy import planner
        from pkvrt.policy.registry import SplitBounds

        seq = np.asarray(lens, dtype=np.int64)
        tiles = -(-int(seq.max()) // TILE_TOKENS)
        min_tiles = -(-self.cal.splits.min_split_tokens // TILE_TOKENS)
        counts = planner.partition_candidates(tiles, self.splits, min_tiles).tolist()
        fits = [s for i, s in enumerate(counts) if i == 0 or planner.balanced_partition(
            seq, num_kv_heads=self.num_kv_heads, splits=self.splits, cal=self.cal, kind=self.kind,
            longest_splits=s).ctas <= max_tasks]
        us, s = min((attrs.evolve(self, splits=SplitBounds(min=s, max=s, multiple_of=1)).us(seq), s)
                    for s in fits)
        return s, us

    def kernel_fields(self, prefix: str) -> dict:
        """The ``FindSharedParams`` fields of this decode (``prefix`` "row" or "chunk"), but its
        candidates' pointer: the partition (``planner.device_plan_targets``, as its planning
        kernel gets them) and the time constants (an eager launch's extra cost in fixed_us)."""
        from pkvrt.policy.planner import device_plan_targets

        t = device_plan_targets(self.cal, self.kind)
        rt = self.cal.route_time(self.kind)
        launches = 2 if self.kind == "workqueue" else 1
        eager = 0.0 if self.graphs else self.cal.lambda_us - self.cal.lambda_graph_us
        fields = {"num_candidates": len(self.splits.candidates()),
                  "min_split_tiles": -(-self.cal.splits.min_split_tokens // TILE_TOKENS),
                  **{k: t[k] for k in ("resident", "slowdown8", "overhead8", "max_ctas",
                                       "free_slots", "room_slots", "room8", "room_chunk")},
                  "read_scale": rt.read_scale, "depth_us": rt.depth_us, "tail_us": rt.tail_us,
                  "split_us": rt.split_us, "merge_us": rt.merge_us, "room_us": rt.room_us,
                  "fixed_us": rt.fixed_us + launches * eager}
        return {f"{prefix}_{k}": v for k, v in fields.items()}


@attrs.frozen
class RuleDecision:
    """What the device rule predicted for one step (per layer): the plain and shared µs, whether
    the step shares, the page re-reads it credited L2 with (plain step, chunk decode), and the
    chunk decode's split count by the time model (0: the partition's cut): the count it is
    planned at where the step shares (on a step run plain no chunk decode runs)."""

    plain_us: float
    shared_us: float
    shared: bool
    plain_rereads: int
    chunk_rereads: int
    chunk_splits: int = 0


@attrs.frozen
class SharingRule:
    """Whether a step of device lengths shares: the twin of kernels/find_shared.cu's rule, the
    host rule of ``SharedPagesRuntime`` (``_sharing_pays``) on the GPU's prefix chunks.

    ``row``: the plain and own decodes (the model's G), ``chunk``: the chunk decode (group
    C x G), each as its device planning cuts and times it. ``l2_saved_us``: per re-read page,
    ``(1 - l2_reread_cost) * page bytes / beta`` (calibration ``sharing``); ``extra_us``: what
    the shared path adds to its two decodes per layer (``sharing.overhead_us``, or its launches);
    ``plain_extra_us``: what those launches add to a step the rule runs plain (a captured step
    has them whatever it decides: the query gather, an idle chunk decode, the merge);
    ``margin``: routes.toml ``[sharing] device_margin``.

        plain  = max(T_row(step) - l2_saved_us * plain re-reads, 0) + plain_extra_us
        shared = max(T_chunk(chunk prefixes) - l2_saved_us * chunk re-reads, 0)
                 + T_row(own segments) + extra_us
        shares when plain >= margin * shared

    T_chunk is the chunk decode at its planning kernel's cut, the partition's, except with
    ``model_cut_rows`` > 0 (routes.toml ``[sharing] model_cut_rows``; 0: off) on a step of at
    most that many chunks whose partition cut the model predicts at least ``model_cut_margin``
    times its fastest cut (:meth:`DecodeTime.fastest_cut` within ``chunk_max_tasks``, the chunk
    decode's planning grid): then the fastest cut, and the chunk decode is planned at its split
    count (``chunk_splits``; the kernel's ``split_pin``), as host lengths cut it
    (``SharedPagesRuntime._chunk_cut``).

    The re-reads are those of the prefix chunks (:func:`plan_prefix_chunks`): a plain step
    re-reads each non-leader row's pages in common with its leader, the chunk decode each
    leader's chunks' prefixes but the longest. Worked example (the H100 file, H_q 32, H_kv 8,
    D 128, fp16, page 16, the fused route; 16 rows of a 1K shared prefix and 1K own tokens, 4
    rows a chunk): plain = 47.4 us by the model less 960 re-read pages x 13.5 ns (0.607 of a
    64 KiB page at beta) + 6.0 us (two launches in a graph) = 40.4 us; shared = four 1K chunks
    16.9 us less 192 x 13.5 ns, + sixteen own 1K rows 24.8 us, + the measured 10.6 us = 49.7 us;
    40.4 < 1.0 x 49.7: plain (measured on that GPU, benches/results/h100/shared-pages.json:
    28.2 us a layer plain device planning, 54.6 the device-lengths step sharing it).
    """

    row: DecodeTime
    chunk: DecodeTime
    page_size: int
    l2_saved_us: float
    extra_us: float
    plain_extra_us: float
    margin: float
    model_cut_rows: int = 0
    model_cut_margin: float = 1.10
    chunk_max_tasks: int = 0
    # kernel_fields(), made once (a plan() of device lengths passes them every step)
    _fields: types.MappingProxyType = attrs.field(init=False, eq=False, repr=False)

    def __attrs_post_init__(self):
        cal = self.row.cal
        token_bytes = self.row.num_kv_heads * self.row.head_dim * 2 * self.row.dtype_bytes
        object.__setattr__(self, "_fields", types.MappingProxyType({
            "rule": 1, "tile_tokens": TILE_TOKENS, "sms": cal.sm_count,
            **self.row.kernel_fields("row"), **self.chunk.kernel_fields("chunk"),
            "token_us": token_bytes / (cal.beta_gbps * 1e3), "l2_saved_us": self.l2_saved_us,
            "extra_us": self.extra_us, "plain_extra_us": self.plain_extra_us, "margin": self.margin,
            "model_cut_rows": self.model_cut_rows, "chunk_max_tasks": self.chunk_max_tasks,
            "model_cut_margin": self.model_cut_margin}))

    @staticmethod
    def unavailable(row_cal, chunk_cal, row_kind: str, chunk_kind: str) -> str | None:
        """Why the rule cannot be built for these calibrations and route kinds, or None: each
        needs the measured time model of its kind, and both the same GPU constants (the kernel
        reads one beta and SM count)."""
        for name, cal, kind in (("the step's", row_cal, row_kind), ("the chunk decode's", chunk_cal, chunk_kind)):
            if cal.route_time(kind) is None:
                return f"{name} calibration has no measured time model of the {kind} route"
        if (row_cal.beta_gbps, row_cal.sm_count) != (chunk_cal.beta_gbps, chunk_cal.sm_count):
            return "the step's and the chunk decode's calibrations differ in beta_gbps or sm_count"
        return None

    def decide(self, seq, chunk_seq, own_seq, plain_rereads: int, chunk_rereads: int) -> RuleDecision:
        """The decision on one step's lengths (int [B] each: the step's valid lengths, 0 for a bad
        or idle row; the chunks' prefix tokens; the own segments' tokens, 0 for a bad row)."""
        t_plain = max(self.row.us(seq) - self.l2_saved_us * plain_rereads, 0.0) + self.plain_extra_us
        chunk_us, splits = self.chunk.us(chunk_seq), 0
        if 0 < self.model_cut_rows and np.count_nonzero(chunk_seq) <= self.model_cut_rows:
            s, us = self.chunk.fastest_cut(chunk_seq, self.chunk_max_tasks)
            if chunk_us >= self.model_cut_margin * us:
                chunk_us, splits = us, s
        t_chunk = max(chunk_us - self.l2_saved_us * chunk_rereads, 0.0)
        t_shared = t_chunk + self.row.us(own_seq) + self.extra_us
        return RuleDecision(plain_us=t_plain, shared_us=t_shared, shared=t_plain >= self.margin * t_shared,
                            plain_rereads=int(plain_rereads), chunk_rereads=int(chunk_rereads),
                            chunk_splits=splits)

    def kernel_fields(self) -> types.MappingProxyType:
        """``FindSharedParams``' rule fields (but the candidates' pointers and ``rule_out``),
        made at construction (read-only)."""
        return self._fields
