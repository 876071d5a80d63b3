"""Per-step plans of every route, as plain NumPy arrays with structural counters.

Pure functions of the step's ``seq_lens`` (int [B]), the attention shape, the route's split
bounds (``pkvrt.policy.registry.SplitBounds``) and the GPU's calibration; the runtime calls one per
decode step, so they are vectorized (no Python loop over rows or tasks).

Split choice (row-local, paper section 3.5):

* bucket route: each bucket aims for ``cal.splits.bucket_ctas_per_sm`` CTA work per SM,
  ``S = ceil(target * sm_count / (bucket_rows * H_kv))`` (:func:`bucket_split_counts`), snapped
  to the route's allowed counts (``SplitBounds.clamp``) and capped by the row's capacity
  ``max(1, tiles // min_split_tiles)``: the largest allowed count that fits, or the capacity
  itself when even the smallest allowed count does not.
* workqueue and fused routes: the balanced partition (:func:`balanced_partition`) cuts the
  whole step's KV work (rows x KV heads x tiles) into chunks of one length, chosen by a small
  makespan model over waves of ``workqueue_ctas_per_sm * sm_count`` CTAs, so short rows stay
  whole and long rows are cut until every CTA finishes about together.

A split covers a contiguous, balanced range of 32-token tiles: split ``s`` of ``S`` over ``n``
tiles owns tiles ``[s*n//S, (s+1)*n//S)`` (:func:`split_tile_range`), so every split has at
least ``n//S >= 1`` tiles and boundaries fall on multiples of ``tile_tokens``.

Counters (per step): launches, decode CTAs, CTA work per SM (``decode_ctas / sm_count``),
useful KV bytes ``sum(seq_lens) * H_kv * D * 2 (K and V) * dtype_bytes``, merge bytes and merge
launches. ``dtype_bytes`` everywhere here is the K/V element size only (2 for fp16/bf16, 1 for
FP8 K/V): q, out and the fp32 partial states are not counted with it. *Merge bytes* are the partial-state bytes the decode kernel writes and the merge
kernel reads back: per slot and query head ``D*4`` (``a``, fp32) ``+ 8`` (``m``, ``l``, fp32),
times 2 (write + read). A bucket with S = 1 writes O directly and has no slots; every workqueue
row has slots (its merge also normalises S = 1 rows). The paper's Table 4 "Merge MB" counts the
states once in MiB: ``merge_bytes / 2 / 2**20`` (B8, 160 slots: 160*32*520 B = 2.54 MiB).
"""

from __future__ import annotations

import functools

import attrs
import numpy as np

from pkvrt._buildspec import TILE_TOKENS
from pkvrt.policy.blocktables import to_csr
from pkvrt.policy.calibration import Calibration


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
    """Useful K+V bytes of a step: ``sum(seq_lens) * H_kv * D * 2 * dtype_bytes`` (bytes per K/V
    element: 2 for fp16/bf16, 1 for FP8; B1 32K, H_kv 8, D 128: 134 MB fp16, 67 MB FP8)."""
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


MAX_WAVES = 2   # default of calibration splits.max_waves: resident waves of CTAs the partition may plan


@attrs.frozen
class PartitionModel:
    """Constants of the partition's makespan model, from the calibration, in integer units.

    sms : S, the GPU's SMs. resident : CTAs of the decode kernel resident per SM at once (its
    occupancy; ``cal.splits.workqueue_ctas_per_sm`` rounded). slowdown8 : how much longer an SM
    takes with two resident CTAs than with one, in eighths (1.4 -> 11). overhead8 : a CTA's
    fixed cost (prologue, partial-state write, its share of the merge), in eighths of a tile.
    max_waves : the partition plans at most ``max_waves * wave`` CTAs (calibration
    ``splits.max_waves``, default MAX_WAVES). free_slots : resident slots a cut should leave
    free in its last wave (:func:`partition_choice`): calibration ``splits.merge_free_slots``
    for a workqueue route (decode + merge launch), 0 for a fused one. room_slots, room8,
    room_chunk : the choice's charge for a last wave with little room (:meth:`room_charge`):
    calibration ``splits.wave_room_slots``, ``wave_room_tiles`` (in eighths of a tile, rounded)
    and ``wave_room_chunk_tiles``.
    """

    sms: int
    resident: int
    slowdown8: int
    overhead8: int
    max_waves: int = MAX_WAVES
    free_slots: int = 0
    room_slots: int = 0
    room8: int = 0
    room_chunk: int = 0

    @classmethod
    def of(cls, cal: Calibration, kind: str = "workqueue") -> "PartitionModel":
        """The model of ``cal`` for a route of ``kind`` ("workqueue", "fused"; the merge's free
        slots apply to the workqueue kind alone)."""
        if kind not in ("workqueue", "fused"):
            raise ValueError(f"PartitionModel.of: kind={kind!r}: expected 'workqueue' or 'fused'")
        sp = cal.splits
        return cls(sms=cal.sm_count, resident=max(1, int(round(sp.workqueue_ctas_per_sm))),
                   slowdown8=int(round(8 * sp.co_resident_slowdown)),
                   overhead8=int(round(8 * sp.cta_overhead_tiles)), max_waves=sp.max_waves,
                   free_slots=sp.merge_free_slots if kind == "workqueue" else 0,
                   room_slots=sp.wave_room_slots, room8=int(round(8 * sp.wave_room_tiles)),
                   room_chunk=sp.wave_room_chunk_tiles)

    def free_in_last_wave(self, ctas):
        """Resident slots the last wave of ``ctas`` CTAs leaves free: ``(-ctas) mod wave`` (0 when
        the CTAs fill every slot of their last wave). Works on arrays."""
        return np.remainder(-np.asarray(ctas), self.wave)

    def room_charge(self, ctas, chunk):
        """What :func:`partition_choice` adds to a cut's cost (the units of
        :func:`partition_costs`) for the room its last wave leaves: ``room8 * S * (room_slots -
        free) // room_slots`` when ``free = free_in_last_wave(ctas) < room_slots`` and the cut's
        chunk is at most ``room_chunk`` tiles, else 0 (and 0 without a calibrated charge). Works
        on arrays (int64)."""
        free = self.free_in_last_wave(ctas)
        if not self.room_slots or not self.room8 or not self.room_chunk:
            return np.zeros_like(free, dtype=np.int64)
        short = np.maximum(0, self.room_slots - free).astype(np.int64)
        return np.where(np.asarray(chunk) <= self.room_chunk, self.room8 * self.sms * short // self.room_slots, 0)

    @property
    def wave(self) -> int:
        """CTAs resident on the whole GPU at once: ``resident * sms``."""
        return self.resident * self.sms

    def load8(self, k):
        """Time multiplier, in eighths, of an SM holding ``k`` resident CTAs: 8 for one, then
        ``slowdown8 - 8`` more for each further one (k=2 -> slowdown8). Works on arrays."""
        return 8 + (np.asarray(k) - 1) * (self.slowdown8 - 8)


def partition_candidates(longest_tiles: int, splits, min_tiles: int) -> np.ndarray:
    """Split counts the longest row may take: the route's allowed counts whose chunk
    ``ceil(longest_tiles / s)`` is at least ``min_tiles`` tiles; if none is, the old row cap
    ``max(1, longest_tiles // min_tiles)`` alone. int64, ascending."""
    c = _candidates(splits)
    ok = c[-(-longest_tiles // c) >= min_tiles]
    return ok if ok.size else np.array([max(1, longest_tiles // min_tiles)], dtype=np.int64)


@attrs.frozen
class Partition:
    """The balanced partition of one step: every split is at most ``chunk_tiles`` tiles.

    num_splits : int64 [B] splits per row. chunk_tiles : c. longest_splits : the candidate s
    it was chosen at (c = ceil(longest tiles / s)). ctas : decode CTAs (sum(num_splits) * H_kv).
    cost : the model's makespan of the choice, in eighths of a tile times the wave size.
    """

    num_splits: np.ndarray
    chunk_tiles: int
    longest_splits: int
    ctas: int
    cost: int


def partition_costs(tiles: np.ndarray, cands: np.ndarray, *, num_kv_heads: int, model: PartitionModel):
    """Model cost of cutting a step at each candidate ``s`` (the longest row's split count).

    tiles : int64 [B] tiles per row (0 = a row with no work). cands : int64 [K].
    Returns (cost [K], ctas [K], chunk [K]) int64: chunk ``c = ceil(max(tiles) / s)``; row r gets
    ``n_r = ceil(tiles_r / c)`` splits; ctas ``N = H_kv * sum(n_r)``. The cost (in 1/64 tile
    times S) is the larger of two makespans:

    * waves of the big CTAs (those longer than half a chunk): they fill the GPU's resident slots
      (``R = resident * S``) wave after wave; a wave costs ``(8c + f)`` times the load of its
      busiest SM, ``load8(ceil(CTAs in the wave / S))``: 8 with one CTA per SM, ``slowdown8``
      with two. So 128 CTAs on 132 SMs are one light wave and 160 put two on 28 SMs. The small
      CTAs run beside the big ones and slow them down: their work, ``8 * H_kv * (tiles of the
      rows whose tasks are small) + N_small * f``, spread over the S SMs, costs ``slowdown8 - 8``
      per eighth-tile on top (nothing when a second resident CTA is free, slowdown 1; all of it
      when it is not, slowdown 2). Without that term two 34K rows beside six 2K rows at G = 1
      were cut in 2 (the short rows' 192 CTAs ignored, 371 us) rather than 4 (304 us);
    * the average SM load, the work over the GPU's best throughput: ``W8 = 8 * H_kv * sum(tiles)
      + N * f`` at ``8 / S`` per eighth-tile with at most one CTA per SM (N <= S), at
      ``load8(resident) / resident / S`` when SMs can hold ``resident`` CTAs (N > S: two
      co-resident CTAs stream faster than one when slowdown < 2). Counting it at one CTA per SM
      (before d400fe9) over-charged every cut of more than S CTAs: eight 1K rows (H_kv 8) were cut in
      2 (128 CTAs, 13.2 us) rather than 4 (256 CTAs, 12.0 us), and the fit could not fix it.

    Worked example (H200: S = 132, two resident CTAs per SM, slowdown 1.4 -> 11, f = 6 tiles
    -> 48; H_kv 8): one 8K row, 256 tiles. s = 16: c = 16, N = 128 all big, one CTA per SM:
    max((128 + 48) * 8 * 132, (8*8*256 + 128*48) * 8) = max(185856, 180224) = 185856. s = 32:
    c = 8, N = 256, two per SM: max((64 + 48) * 11 * 132, (16384 + 256*48) * 11 // 2) =
    max(162624, 157696) = 162624. s = 20: c = 13, N = 160: (104 + 48) * 11 * 132 = 220704. So
    32 splits at these constants (the H200's fitted ones are in calibration/nvidia-h200.json).
    """
    t = tiles[None, :]
    c = -(-tiles.max() // cands)                              # [K]
    n = np.where(t > 0, -(-t // c[:, None]), 0)              # [K, B]
    chunk = np.where(n > 0, -(-t // np.maximum(n, 1)), 0)     # largest task of each row
    ctas = num_kv_heads * n.sum(axis=1)
    is_big = 2 * chunk > c[:, None]
    big = num_kv_heads * np.where(is_big, n, 0).sum(axis=1)
    small_tiles = num_kv_heads * np.where(is_big, 0, t).sum(axis=1)
    m, full, rem = model, big // model.wave, big % model.wave
    loads = full * m.load8(m.resident) + np.where(rem > 0, m.load8(np.maximum(1, -(-rem // m.sms))), 0)
    beside = (8 * small_tiles + (ctas - big) * m.overhead8) * (m.slowdown8 - 8)
    work = 8 * num_kv_heads * int(tiles.sum()) + ctas * m.overhead8
    floor = np.where(ctas > m.sms, work * m.load8(m.resident) // m.resident, work * 8)
    cost = np.maximum((8 * c + m.overhead8) * loads * m.sms + beside, floor)
    return cost, ctas, c


def balanced_partition(seq: np.ndarray, *, num_kv_heads: int, splits, cal: Calibration,
                       tile_tokens: int = TILE_TOKENS, longest_splits: int | None = None,
                       kind: str = "workqueue") -> Partition:
    """Cut a step's KV work (rows x KV heads x tiles) into chunks of near-equal size.

    One chunk length ``c`` (tiles) for the whole step: a row of ``t`` tiles gets
    ``ceil(t / c)`` balanced splits, so a row that fits in one chunk is neither split nor merged,
    and a 28K row next to six 2K rows is cut so that all of them finish together. ``c`` is
    ``ceil(longest / s)`` for the candidate ``s`` (the longest row's split count, an allowed
    count of ``splits`` whose chunk is at least ``min_split_tokens``) of least model cost
    (:func:`partition_costs`), ties to fewer CTAs, then smaller s; candidates planning more than
    ``MAX_WAVES`` waves of CTAs are skipped unless the smallest candidate is (a batch whose rows
    alone exceed that; ``MAX_WAVES`` is calibration ``splits.max_waves``); on a one-row step of
    the workqueue ``kind``, cuts leaving calibration ``splits.merge_free_slots`` resident slots
    free are preferred (:func:`partition_choice`; ``kind`` "fused" cuts for the fused kernel,
    which has no merge launch). ``longest_splits`` forces ``s`` (sweeps and ablations).

    The planning kernel (kernels/plan_workqueue.cu) computes the same choice with the same
    integer arithmetic; tests/gpu/test_device_plan.py checks they agree.
    """
    tiles = -(-np.asarray(seq, dtype=np.int64) // tile_tokens)
    min_tiles = -(-cal.splits.min_split_tokens // tile_tokens)
    ns, c, s, ctas, cost = _partition_of_tiles(tuple(tiles.tolist()), num_kv_heads, splits,
                                               PartitionModel.of(cal, kind), min_tiles, longest_splits)
    return Partition(num_splits=np.array(ns, dtype=np.int64), chunk_tiles=c, longest_splits=s,
                     ctas=ctas, cost=cost)


@functools.lru_cache(maxsize=4096)
def _partition_of_tiles(tiles: tuple, num_kv_heads: int, splits, model: PartitionModel, min_tiles: int,
                        longest_splits: int | None):
    """:func:`balanced_partition` on a tuple of tile counts, cached: a decoding row's tile count
    changes once per 32 steps, so most steps of a serving loop repeat an earlier step's tiles."""
    t = np.array(tiles, dtype=np.int64)
    cands = partition_candidates(int(t.max()), splits, min_tiles)
    if longest_splits is not None:
        cands = np.array([longest_splits], dtype=np.int64)
    cost, ctas, chunk = partition_costs(t, cands, num_kv_heads=num_kv_heads, model=model)
    i = partition_choice(cost, ctas, cands, model, rows=t.size, chunk=chunk)
    c = int(chunk[i])
    return tuple((-(-t // c)).tolist()), c, int(cands[i]), int(ctas[i]), int(cost[i])


def partition_choice(cost, ctas, cands, model: PartitionModel, rows: int, chunk) -> int:
    """The index of the cut to take: least model cost plus the last wave's room charge
    (:meth:`PartitionModel.room_charge`), then fewest CTAs, then the smallest s, among the
    candidates within ``max_waves`` waves (the first candidate is always eligible) — and, on a
    one-row step, when any of those leaves ``model.free_slots`` resident slots free in its last
    wave, among those alone.

    Why the room charge (benches/NOTES.md, the room charge): in a decode step that fills (nearly)
    every resident slot, the next layer's CTAs, launched early, cannot start their prologue and
    first K/V copies until decode CTAs exit. The calibration sweeps (8 layers back to back) time
    short eight-row steps at 224 CTAs 9.7 us and at 256 CTAs (8 of 264 slots free) 11.3 us,
    where the makespan, one kernel's, calls 256 cheaper. It matters where a CTA's work is short
    next to that prologue: only cuts of chunks up to ``room_chunk`` tiles are charged (charged
    at every chunk, the Azure code trace's 12-30-tile cuts lost 4-7 % in the engine protocol
    while its conversation trace's 6-10-tile cuts gained 10-19 %). ``chunk``: the candidates'
    chunks (tiles).

    Why the free slots (benches/NOTES.md, the free slots): every pkvrt kernel launches the next
    one early (programmatic dependent launch), whose CTAs then wait on the GPU, resident, for
    the decode to end; a cut that fills every slot of its last wave (one 8K row, H_kv 8: 33
    splits = 264 CTAs = the H200's 2 x 132) keeps them out until decode CTAs exit, so the
    merge and the next layer start a launch later. Measured in the 32-layer engine protocol
    at one 8K row: 16.1 us per layer at 264 CTAs, 12.4 at 232; with an MLP between the layers
    (no next attention to overlap) 91.9 -> 89.7. The makespan model cannot see it (it times
    one kernel), and a cut is never cheaper by that much in it, so it is a rule, not a cost.
    One row only: its merge grid (one CTA per 4 query heads: 8 at H_q 32) is what the slots make
    room for, and that is where it was measured; on random two- to eight-row steps the rule would
    change 16 % of the cuts at up to +45 % model cost (a merge grid of 8 CTAs per row), unmeasured.
    """
    ok = (np.asarray(ctas) <= model.max_waves * model.wave) | (np.arange(len(cands)) == 0)
    if model.free_slots and rows == 1:
        roomy = ok & (model.free_in_last_wave(ctas) >= model.free_slots)
        if roomy.any():
            ok = roomy
    charged = np.asarray(cost, dtype=np.int64) + model.room_charge(ctas, chunk)
    return min(np.flatnonzero(ok).tolist(), key=lambda k: (charged[k], ctas[k], cands[k]))


def device_plan_targets(cal: Calibration, kind: str = "workqueue") -> dict[str, int]:
    """The partition constants of ``ops.plan_workqueue_device`` as keywords
    (:class:`PartitionModel` and the CTA cap of ``max_waves`` resident waves)."""
    m = PartitionModel.of(cal, kind)
    return {"sms": m.sms, "resident": m.resident, "slowdown8": m.slowdown8, "overhead8": m.overhead8,
            "max_ctas": m.max_waves * m.wave, "free_slots": m.free_slots,
            "room_slots": m.room_slots, "room8": m.room8, "room_chunk": m.room_chunk}


def workqueue_split_counts(seq: np.ndarray, *, num_kv_heads: int, splits, cal: Calibration,
                           tile_tokens: int = TILE_TOKENS, kind: str = "workqueue") -> np.ndarray:
    """S per row (int64 [B]) of the workqueue or fused route (``kind``): :func:`balanced_partition`."""
    return balanced_partition(seq, num_kv_heads=num_kv_heads, splits=splits, cal=cal,
                              tile_tokens=tile_tokens, kind=kind).num_splits


def device_grid_ctas(gbatch: int, *, num_kv_heads: int, splits, cal: Calibration) -> int:
    """Most decode CTAs the balanced partition plans for at most ``gbatch`` rows: max_waves resident waves,
    or every row at the smallest allowed count when that is more (then it is the only candidate
    left), never more than every row at the largest. The device-planned grid is sized by it."""
    c = _candidates(splits)
    per_row = num_kv_heads * gbatch
    m = PartitionModel.of(cal)
    return int(min(per_row * c[-1], max(m.max_waves * m.wave, per_row * c[0])))


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


def workqueue_counters_of(seq, num_splits, *, num_kv_heads, num_qo_heads, head_dim, dtype_bytes,
                          sm_count) -> Counters:
    """Counters of a workqueue step whose rows have ``num_splits`` splits: 2 launches, one CTA per
    (split, KV head), one partial state per split (the merge also normalises S = 1 rows)."""
    slots = int(np.sum(num_splits))
    ctas = slots * num_kv_heads
    return Counters(
        launches=2, decode_ctas=ctas, cta_work_per_sm=ctas / sm_count,
        useful_kv_bytes=kv_bytes(seq, num_kv_heads=num_kv_heads, head_dim=head_dim, dtype_bytes=dtype_bytes),
        merge_bytes=state_bytes(slots, num_qo_heads=num_qo_heads, head_dim=head_dim), merge_launches=1)


def window_starts(seq: np.ndarray, window_left: int = -1) -> np.ndarray:
    """The first token each row attends to: seq - 1 - window_left where positive with a sliding
    window (window_left >= 0: the last window_left + 1 tokens), else 0 (kernels' window_start)."""
    if window_left < 0:
        return np.zeros_like(seq)
    return np.maximum(seq - 1 - window_left, 0).astype(seq.dtype)


def workqueue_from_checked(seq, *, num_kv_heads, num_qo_heads, head_dim, dtype_bytes, splits, cal, tile_tokens,
                           tasks: bool, longest_splits: int | None = None, kind: str = "workqueue",
                           window_left: int = -1):
    """:func:`plan_workqueue` (``tasks=True``) or only its counters (``tasks=False``) for a
    ``seq`` already checked by :func:`check_seq_lens`; ``kind`` "fused" cuts for the fused
    kernel (no merge launch: :meth:`PartitionModel.of`). With a sliding window the plan is the
    one of the attended lengths, its token ranges offset by each row's window start."""
    start = window_starts(seq, window_left)
    full, seq = seq, seq - start          # the attended lengths: what the partition cuts
    ns = balanced_partition(seq, num_kv_heads=num_kv_heads, splits=splits, cal=cal, tile_tokens=tile_tokens,
                            longest_splits=longest_splits, kind=kind).num_splits
    counters = workqueue_counters_of(seq, ns, num_kv_heads=num_kv_heads, num_qo_heads=num_qo_heads,
                                     head_dim=head_dim, dtype_bytes=dtype_bytes, sm_count=cal.sm_count)
    slots, ctas = int(ns.sum()), counters.decode_ctas
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
    out[:, :, 3] = (start[row] + t0 * tile_tokens)[:, None]
    out[:, :, 4] = np.minimum(start[row] + t1 * tile_tokens, full[row])[:, None]
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
                   splits, cal: Calibration, tile_tokens: int = TILE_TOKENS,
                   longest_splits: int | None = None, kind: str = "workqueue",
                   window_left: int = -1) -> WorkqueuePlan:
    """Compact ``(row, kvh, split, tok_begin, tok_end)`` tasks, only non-empty ones, cut by the
    balanced partition (:func:`balanced_partition`).

    Parameters
    ----------
    seq_lens : int [B], tokens per row (>= 1).
    splits : SplitBounds of the route. cal : the GPU's calibration.
    longest_splits : force the partition's candidate (the longest row's split count): sweeps.
    kind : "workqueue" (decode + merge launch) or "fused" (the fused kernel's cut: no merge
        launch to leave resident slots for, :meth:`PartitionModel.of`).
    window_left : -1, or each row attends to its last window_left + 1 tokens: the plan of those
        lengths, each task's range offset by its row's window start (as the planning kernel).

    Returns
    -------
    WorkqueuePlan
        ``sum(num_splits) * H_kv`` tasks; 2 launches (decode + merge).
    """
    _check_heads(num_kv_heads, num_qo_heads)
    return workqueue_from_checked(
        check_seq_lens(seq_lens), num_kv_heads=num_kv_heads, num_qo_heads=num_qo_heads,
        head_dim=head_dim, dtype_bytes=dtype_bytes, splits=splits, cal=cal, tile_tokens=tile_tokens,
        tasks=True, longest_splits=longest_splits, kind=kind, window_left=window_left)


def fused_counters(counters: Counters) -> Counters:
    """Workqueue counters with the merge fused into the decode kernel: one launch, no merge
    launch; the merge bytes stay (the last CTA of a (row, kvh) reads the others' states back)."""
    return attrs.evolve(counters, launches=1, merge_launches=0)


def plan_fused(seq_lens, **kwargs) -> WorkqueuePlan:
    """The fused route's plan: :func:`plan_workqueue` of the fused kind's cut (no merge launch
    to leave slots for: :meth:`PartitionModel.of`) with :func:`fused_counters`."""
    plan = plan_workqueue(seq_lens, kind="fused", **kwargs)
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
    """FlashInfer's CSR page view (``pkvrt.policy.blocktables.to_csr``) and counters.

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
