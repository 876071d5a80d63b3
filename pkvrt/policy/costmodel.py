"""Predicted µs of one decode step on one route: the measured model, else the seed's roofline.

A calibration with a ``time_model`` (what ``pkvrt calibrate`` writes now) is predicted with the
measured model (:func:`predict_route_us`, section "The measured model" below); one without it
(the seed's RTX 3060 profile, older files) with the seed's roofline:

    T_r = KVBytes/beta * max(1, C_min/C_r) + L_r*lambda + MergeBytes_r/beta

KVBytes: useful K+V bytes of the step (1 byte per element for FP8 K/V: half of fp16); beta: streaming-read bandwidth; C_r: decode CTA work per
SM of route r; C_min: occupancy target; L_r: launches; lambda: one launch's overhead (eager, or
inside a CUDA-graph replay); MergeBytes_r: partial-state bytes written by decode and read back by
the merge. All constants come from a :class:`pkvrt.policy.calibration.Calibration`; none live here.

Worked example, B8 x 32K on the H200 (DESIGN.md anchors: beta 4120 GB/s, 132 SMs, lambda inside
a graph 1.1 µs; C_min 4), H_q=32, H_kv=8, D=128, fp16, workqueue with 16 splits per row:

    KVBytes    = 8 rows * 32768 tok * 8 kvh * 128 * 2 (K,V) * 2 B = 1_073_741_824 B
    read       = 1_073_741_824 / 4120e3 B/µs                       = 260.6 µs
    C_wq       = 8 * 8 * 16 CTAs / 132 SMs = 7.76 >= 4             -> factor 1
    launches   = 2 (decode + merge) * 1.1 µs                       =   2.2 µs
    MergeBytes = 128 slots * 32 heads * (128*4 + 8) B * 2 (w + r)  = 4_259_840 B -> 1.0 µs
    T_wq       = 260.6 + 2.2 + 1.0                                 = 263.9 µs

FlashInfer splits the KV internally and chooses its own grid, so its C is *not* counted from a
plan: it is a fitted number (``Calibration.flashinfer_ctas_per_sm``, per active count), the C
that makes this model reproduce FlashInfer's measured time. The H200 anchor B8 32K = 290 µs
gives (290 - 1.1) / 260.6 = 1.109 = C_min/C -> C = 3.61 CTAs/SM, so

    T_fi       = 260.6 * 4/3.61 + 1 * 1.1                          = 289.9 µs
    speedup    = 289.9 / 263.9                                     = 1.10x
"""

from __future__ import annotations

import functools
import itertools
import math

import attrs
import numpy as np

from pkvrt._buildspec import TILE_TOKENS
from pkvrt.policy.calibration import Calibration, RouteTime
from pkvrt.policy.planner import (PartitionModel, _bucket_groups, balanced_partition,
                                  bucket_split_counts, kv_bytes, partition_costs)


def launch_us(cal: Calibration, *, graphs: bool) -> float:
    """Overhead of one launch: inside a CUDA graph (the runtime) or eager (the seed protocol)."""
    return cal.lambda_graph_us if graphs else cal.lambda_us


def read_us(nbytes: float, cal: Calibration) -> float:
    """µs to stream ``nbytes`` at ``beta_gbps`` (1 GB/s = 1e3 bytes per µs)."""
    return nbytes / (cal.beta_gbps * 1e3)


def route_time_us(*, kv_bytes: float, cta_work_per_sm: float, launches: int, merge_bytes: float,
                  cal: Calibration, graphs: bool) -> float:
    """``T_r`` of the model (module docstring), in µs.

    A route with ``cta_work_per_sm <= 0`` (no CTAs) is infinitely slow; ``kv_bytes`` of 0 costs
    only launches.
    """
    if cta_work_per_sm <= 0:
        return math.inf
    occupancy = max(1.0, cal.c_min / cta_work_per_sm)
    return read_us(kv_bytes, cal) * occupancy + launches * launch_us(cal, graphs=graphs) + read_us(merge_bytes, cal)


def flashinfer_ctas_per_sm(cal: Calibration, *, active: int, num_kv_heads: int) -> float:
    """FlashInfer's modelled decode CTA work per SM at ``active`` rows (a fitted number).

    The calibrated table is interpolated linearly in log2(active) between measured active
    counts and held constant beyond its ends. It is floored by FlashInfer's structural minimum,
    one CTA per (row, KV head): ``active * num_kv_heads / sm_count``.

    Example (seed table {1: 2.63, 8: 3.57}, 28 SMs, 8 KV heads): active 4 sits 2/3 of the way
    from log2 1 = 0 to log2 8 = 3 -> 2.63 + (2/3)*(3.57-2.63) = 3.26; floor 4*8/28 = 1.14 -> 3.26.
    Active 32: table end 3.57, floor 32*8/28 = 9.14 -> 9.14 (no occupancy penalty).
    """
    if active < 1:
        raise ValueError(f"flashinfer_ctas_per_sm: active must be >= 1, got {active}")
    table = cal.flashinfer_ctas_per_sm
    x = math.log2(active)
    if active <= table[0][0]:
        fitted = table[0][1]
    elif active >= table[-1][0]:
        fitted = table[-1][1]
    else:
        for (a0, c0), (a1, c1) in zip(table, table[1:]):
            if a0 <= active <= a1:
                x0, x1 = math.log2(a0), math.log2(a1)
                fitted = c0 + (x - x0) / (x1 - x0) * (c1 - c0)
                break
    return max(fitted, active * num_kv_heads / cal.sm_count)


def predict_us(counters, cal: Calibration, *, graphs: bool) -> float:
    """``T_r`` of a PersistentKV plan from its :class:`pkvrt.policy.planner.Counters`."""
    return route_time_us(kv_bytes=counters.useful_kv_bytes, cta_work_per_sm=counters.cta_work_per_sm,
                         launches=counters.launches, merge_bytes=counters.merge_bytes, cal=cal, graphs=graphs)


def predict_flashinfer_us(counters, cal: Calibration, *, active: int, num_kv_heads: int, graphs: bool) -> float:
    """``T_fi``: the model with FlashInfer's fitted C (``flashinfer_ctas_per_sm``) and its counters."""
    c = flashinfer_ctas_per_sm(cal, active=active, num_kv_heads=num_kv_heads)
    return route_time_us(kv_bytes=counters.useful_kv_bytes, cta_work_per_sm=c, launches=counters.launches,
                         merge_bytes=counters.merge_bytes, cal=cal, graphs=graphs)


# ----------------------------------------------------------------------------- the measured model
#
# Why not the roofline on the H200: at the cuts the planner picks, a step's time is its bytes at
# about beta plus 6-16 µs that the roofline's knee cannot express (B1 32K bucket: 39.9 µs measured,
# 42.6 predicted; FlashInfer B1 1.6K: 10.4 µs measured, 4.7 predicted). The partition's makespan
# alone (µs per tile-time) misses too: B1 32K and B8 32K both run 128 CTAs, one per SM, with
# makespans of 67 and 515 tile-times, in 41.1 and 250.2 µs: 0.61 and 0.49 µs per tile-time. What
# fits is, per launch group of a step (calibration ``time_model``, one set of constants per route
# kind and group size):
#
#     T = max(read_scale * KVBytes/beta, depth_us * depth) + tail_us * sqrt(makespan)
#         + split_us * splits + merge_us * merge_states / SMs + room_us * room + fixed_us
#
# - the read at beta, unless one CTA's chain of tiles takes longer: ``depth`` = resident waves of
#   CTAs times the chunk (the longest CTA's tiles). Short steps are latency-bound, not read-bound:
#   eight 1K rows at G 4 cut in 2 (128 CTAs of 16 tiles, one per SM) take 14.4 µs and cut in 3
#   (192 CTAs of 11 tiles) 12.0, though both read 33.6 MB (7.8 µs at beta) and the makespan
#   (22.5 vs 24.1 tile-times) calls the first cheaper; a CTA streams a tile in ~0.6 µs alone, so
#   16 tiles take ~9.6 µs and 11 tiles less than the read (2026-12-03, benches/NOTES.md);
# - a tail growing with the square root of the makespan (the CTAs that finish last);
# - the longest row's splits and the partial states per SM (the merge: its wait and its work);
# - the partition's room charge (``PartitionModel.room_charge``, in tile-times): a last wave that
#   leaves the next layer's early-launched CTAs few slots;
# - a fixed cost per launch group.
# Until cbdbfde (2026-12-03) the model was the read, the tail, the splits and the fixed cost; its
# worst error at the planned cut on the 2026-12-02 sweeps was 13.2 % (G 4 fused: short eight-row
# steps), now 4.3 % at most over every route and G = 1, 4, 8 (cost_model_error.py).
#
# Launch groups: the workqueue and fused routes are one (the balanced partition, makespan
# ``Partition.cost / (64 * SMs)`` tile-times, splits = its longest row's count); the bucket route
# is one per bucket (decode + merge launch, its CTAs cut like a partition at the bucket's S);
# FlashInfer is one, described by the form of its own scheduler's split (:func:`flashinfer_group`):
# the smallest KV chunk whose CTAs (KV heads x chunks of every row) fit FLASHINFER_CTAS_PER_SM
# per SM, makespan = that chunk times the CTAs per SM; it has no depth, merge-state or room
# description (those terms are 0 for it). Until 085e990 it was described by pkvrt's own
# balanced partition (a proxy), so its prediction moved with pkvrt's partition constants; on the
# 2026-12-01 H200 sweeps the proxy's worst error was 7.7 / 4.2 / 11.0 % at G = 4 / 1 / 8, this
# rule's 3.1 / 3.1 / 3.4 % (C = 4; C = 1, 2, 3: at most 5.6, 4.5, 4.5 %). Eager launches
# (graphs=False) add lambda_us - lambda_graph_us per launch, since fixed_us was measured inside
# graph replays.
#
# Worked example, eight 1K rows at G = 4 on the H200, fused route (beta 4302.8 GB/s; the H200
# file's fused constants: read 0.9437, depth 0.678, tail 0.7961, split 0.0709, merge 0, room
# 0.0721, fixed 0), the planned cut 2:
#     KVBytes   = 8 * 1024 * 8 kvh * 128 * 2 (K,V) * 2 B = 33_554_432 B -> / 4302.8e3 = 7.80 µs
#     partition: 128 CTAs of 16 tiles (one wave of 264 slots), makespan 22.5, no room charge
#     T_fused   = max(0.9437*7.80, 0.678*16) + 0.7961*sqrt(22.5) + 0.0709*2
#               = max(7.36, 10.85) + 3.78 + 0.14 = 14.77 µs (measured 14.44; the old model 12.7)

FLASHINFER_CTAS_PER_SM = 4   # the grid FlashInfer's split fills (fitted offline, see above)


@attrs.frozen
class LaunchGroup:
    """One decode launch (with its merge) of a step, as the measured model reads it.

    kv_bytes : useful K+V bytes it reads. makespan_tiles : the balanced partition's makespan of
    its CTAs, in tile-times. splits : its longest row's split count. launches : 1 or 2.
    depth_tiles : the tiles one resident CTA slot streams in a row: resident waves of its CTAs
    (``ceil(CTAs / (resident * SMs))``) times the longest CTA's tiles (0: not described, as
    FlashInfer's group). merge_states : the partial states written and merged (KV heads times
    the splits of every split row; 0 without a merge). room_tiles : the partition's charge for
    a last wave with few free slots (:meth:`pkvrt.policy.planner.PartitionModel.room_charge`),
    in tile-times.
    """

    kv_bytes: int
    makespan_tiles: float
    splits: int
    launches: int
    depth_tiles: float = 0.0
    merge_states: int = 0
    room_tiles: float = 0.0


# Up to this many rows flashinfer_group searches over Python ints (dev box, the bimodal B8 step:
# 23 us against 64 us for the same search in numpy calls on 8-element arrays)
_SCALAR_ROWS = 32


def flashinfer_group(seq: np.ndarray, *, num_kv_heads: int, head_dim: int, dtype_bytes: int,
                     cal: Calibration, tile_tokens: int = TILE_TOKENS,
                     ctas_per_sm: int = FLASHINFER_CTAS_PER_SM) -> LaunchGroup:
    """FlashInfer's launch group on ``seq`` (int64 [B], checked): its decode scheduler's form of
    split, the smallest chunk ``c`` (tiles) with ``H_kv * sum(ceil(tiles_r / c)) <= ctas_per_sm *
    SMs`` (binary search, as FlashInfer searches its KV chunk size); makespan ``c * ceil(CTAs /
    SMs)`` tile-times, splits ``ceil(longest / c)``; a batch whose rows alone exceed the grid gets
    ``c`` = the longest row (no split).

    Example (H200, 132 SMs, H_kv 8): B1 32K, 1024 tiles: c = 16 gives 512 CTAs <= 528, c = 15
    gives 552; so 64 splits, makespan 16 * 4 = 64. Eight 32K rows: c = 128, 512 CTAs, makespan 512.
    """
    cap = ctas_per_sm * cal.sm_count
    if len(seq) <= _SCALAR_ROWS:   # Python ints: a decode batch's ~10 search steps in a few us
        t = [-(-n // tile_tokens) for n in np.asarray(seq).tolist()]
        count = lambda c: sum([-(-x // c) for x in t])   # noqa: E731 - chunks of c tiles
        top, total_tokens = max(t), int(sum(np.asarray(seq).tolist()))
    else:
        t = -(-np.asarray(seq, dtype=np.int64) // tile_tokens)
        count = lambda c: int((-(-t // c)).sum())   # noqa: E731
        top, total_tokens = int(t.max()), int(np.asarray(seq, dtype=np.int64).sum())
    lo, hi = 1, max(1, top)
    while lo < hi:
        mid = (lo + hi) // 2
        if num_kv_heads * count(mid) <= cap:
            hi = mid
        else:
            lo = mid + 1
    ctas = num_kv_heads * count(lo)
    return LaunchGroup(kv_bytes=total_tokens * num_kv_heads * head_dim * 2 * dtype_bytes,
                       makespan_tiles=float(lo * -(-ctas // cal.sm_count)), splits=-(-top // lo),
                       launches=1)


def partition_group(seq: np.ndarray, *, num_kv_heads: int, head_dim: int, dtype_bytes: int, splits,
                    cal: Calibration, launches: int, tile_tokens: int = TILE_TOKENS,
                    longest_splits: int | None = None) -> LaunchGroup:
    """The launch group of the balanced partition of ``seq`` (int64 [B], checked) under the
    route bounds ``splits``: the workqueue (2 launches) and fused (1) routes.
    ``longest_splits`` forces the cut (calibration sweeps)."""
    p = balanced_partition(seq, num_kv_heads=num_kv_heads, splits=splits, cal=cal, tile_tokens=tile_tokens,
                           longest_splits=longest_splits, kind="workqueue" if launches == 2 else "fused")
    ns = p.num_splits.tolist()
    wave, room = _wave_and_room(cal, p.ctas, p.chunk_tiles)
    return LaunchGroup(kv_bytes=kv_bytes(seq, num_kv_heads=num_kv_heads, head_dim=head_dim, dtype_bytes=dtype_bytes),
                       makespan_tiles=p.cost / (64 * cal.sm_count), splits=max(ns), launches=launches,
                       depth_tiles=float(-(-p.ctas // wave) * p.chunk_tiles),
                       merge_states=num_kv_heads * sum(n for n in ns if n > 1), room_tiles=room)


def _wave_and_room(cal: Calibration, ctas: int, chunk: int) -> tuple[int, float]:
    """(resident CTA slots of the GPU, the room charge of a cut of ``ctas`` CTAs of ``chunk``
    tiles in tile-times): :class:`pkvrt.policy.planner.PartitionModel`'s ``wave`` and
    ``room_charge`` over ``64 * SMs``, in Python ints (the router calls this every evaluation;
    the numpy path costs ~10 us)."""
    sp = cal.splits
    wave = max(1, int(round(sp.workqueue_ctas_per_sm))) * cal.sm_count
    room8, free = int(round(8 * sp.wave_room_tiles)), -ctas % wave
    if not sp.wave_room_slots or not room8 or not sp.wave_room_chunk_tiles \
            or free >= sp.wave_room_slots or chunk > sp.wave_room_chunk_tiles:
        return wave, 0.0
    charge = room8 * cal.sm_count * (sp.wave_room_slots - free) // sp.wave_room_slots
    return wave, charge / (64 * cal.sm_count)


def bucket_groups(seq: np.ndarray, *, num_kv_heads: int, head_dim: int, dtype_bytes: int, splits,
                  cal: Calibration, bucketing: str = "exact", coarse_lengths=(),
                  tile_tokens: int = TILE_TOKENS, longest_splits: int | None = None) -> tuple[LaunchGroup, ...]:
    """One launch group per bucket of the bucket route (``planner.plan_bucket``'s buckets and
    split counts): its rows x H_kv x S CTAs, every row taken as long as the bucket's longest
    (exact for exact buckets; an upper bound for coarse ones), decode + merge when S > 1.
    ``longest_splits`` forces every bucket's S (calibration sweeps). Depth: counted as if one
    bucket CTA were resident per SM, an approximation (``splits.bucket_ctas_per_sm`` is a work
    target, not the kernel's occupancy) that no constant reads today: the bucket route's fit
    keeps depth_us at 0."""
    keys, inv, counts, longest = _bucket_groups(seq, bucketing, coarse_lengths)
    s = (np.full(keys.size, longest_splits, dtype=np.int64) if longest_splits is not None else
         bucket_split_counts(counts, longest, num_kv_heads=num_kv_heads, splits=splits, cal=cal,
                             tile_tokens=tile_tokens))
    tokens = np.bincount(inv, weights=seq, minlength=keys.size)
    model = PartitionModel.of(cal)
    out = []
    for n, rows, k, tok in zip(longest.tolist(), counts.tolist(), s.tolist(), tokens.tolist()):
        tiles = -(-n // tile_tokens)
        ctas = rows * num_kv_heads * k
        out.append(LaunchGroup(kv_bytes=int(tok) * num_kv_heads * head_dim * 2 * dtype_bytes,
                               makespan_tiles=_bucket_cost(rows, tiles, k, num_kv_heads, model) / (64 * cal.sm_count),
                               splits=k, launches=2 if k > 1 else 1,
                               depth_tiles=float(-(-ctas // cal.sm_count) * -(-tiles // k)),
                               merge_states=ctas if k > 1 else 0))
    return tuple(out)


@functools.lru_cache(maxsize=4096)
def _bucket_cost(rows: int, tiles: int, splits: int, num_kv_heads: int, model: PartitionModel) -> int:
    """``planner.partition_costs`` of ``rows`` rows of ``tiles`` tiles cut at ``splits``, cached:
    bucket shapes repeat from step to step (a row's tiles change once per 32 tokens), and one
    uncached call per bucket would cost the router ~15-100 µs each on a B8 step of 8 buckets."""
    cost, _, _ = partition_costs(np.full(rows, tiles, dtype=np.int64), np.array([splits], dtype=np.int64),
                                 num_kv_heads=num_kv_heads, model=model)
    return int(cost[0])


def measured_us(groups, rt: RouteTime, cal: Calibration, *, graphs: bool) -> float:
    """T of the measured model (section comment above) over ``groups`` with constants ``rt``."""
    eager = 0.0 if graphs else cal.lambda_us - cal.lambda_graph_us
    return sum(max(rt.read_scale * read_us(g.kv_bytes, cal), rt.depth_us * g.depth_tiles)
               + rt.tail_us * math.sqrt(g.makespan_tiles) + rt.split_us * g.splits
               + rt.merge_us * g.merge_states / cal.sm_count + rt.room_us * g.room_tiles
               + rt.fixed_us + g.launches * eager for g in groups)


def route_groups(kind: str, seq: np.ndarray, cal: Calibration, *, num_kv_heads: int, head_dim: int,
                 dtype_bytes: int, splits=None, bucketing: str = "exact", coarse_lengths=(),
                 tile_tokens: int = TILE_TOKENS, longest_splits: int | None = None) -> tuple[LaunchGroup, ...]:
    """The launch groups of route ``kind`` ("flashinfer", "bucket", "workqueue", "fused") on
    ``seq`` (int64 [B], checked); ``splits``: the route's SplitBounds (not for flashinfer);
    ``longest_splits``: the cut to describe instead of the planned one (not for flashinfer)."""
    kw = dict(num_kv_heads=num_kv_heads, head_dim=head_dim, dtype_bytes=dtype_bytes, cal=cal,
              tile_tokens=tile_tokens)
    if kind == "flashinfer":
        return (flashinfer_group(seq, **kw),)
    kw["longest_splits"] = longest_splits
    if kind == "bucket":
        return bucket_groups(seq, splits=splits, bucketing=bucketing, coarse_lengths=coarse_lengths, **kw)
    if kind in ("workqueue", "fused"):
        return (partition_group(seq, splits=splits, launches=2 if kind == "workqueue" else 1, **kw),)
    raise ValueError(f"route_groups: unknown route kind {kind!r}")


def predict_route_us(kind: str, seq: np.ndarray, counters, cal: Calibration, *, graphs: bool,
                     num_kv_heads: int, head_dim: int, dtype_bytes: int, splits=None,
                     bucketing: str = "exact", coarse_lengths=()) -> float:
    """Predicted µs of route ``kind`` on ``seq`` (int64 [B], checked): the measured model when
    ``cal`` has one for ``kind`` (``counters`` unused, may be None), else the roofline of the
    route's closed-form ``counters`` (:func:`predict_us`, :func:`predict_flashinfer_us`), exactly
    as before."""
    rt = cal.route_time(kind)
    if rt is None:
        if kind == "flashinfer":
            return predict_flashinfer_us(counters, cal, active=int(seq.size), num_kv_heads=num_kv_heads,
                                         graphs=graphs)
        return predict_us(counters, cal, graphs=graphs)
    groups = route_groups(kind, seq, cal, num_kv_heads=num_kv_heads, head_dim=head_dim,
                          dtype_bytes=dtype_bytes, splits=splits, bucketing=bucketing,
                          coarse_lengths=coarse_lengths)
    return measured_us(groups, rt, cal, graphs=graphs)


# ----------------------------------------------------------------------------- host time
#
# In the Runtime's default mode (host lengths, a graph per layer) a step is plan() on the host,
# then one run() per layer, each enqueueing that layer's device work; an engine that waits for
# a step's result before planning the next (its sampling) sees
#
#     W = plan_us + L * max(run_us, T)
#
# plan_us and run_us: the route kind's host time (calibration ``host_time``, measured on the
# machine by ``pkvrt calibrate --host-time``); T: the route's predicted device time per layer;
# L: layers per plan. The GPU runs layer i while the host enqueues layer i + 1, so a layer
# costs the slower of the two; nothing overlaps plan(), which precedes the step's first launch.
# Measured on the H200 (host-cost.json of 2026-12-01, in git at a5b249b: one run's medians, so
# one host phase): B1 32K on pkv_workqueue at L 32, plan 184, run 28.5, T 41.9 -> 1524 us
# (measured wall 1530); FlashInfer 402 + 32 * max(38.9, 42.4) = 1760 (1836: layers whose host and
# device times are close alternate which one bounds, which the max of the means misses); bimodal
# B8 at L 1 on pkv_workqueue 70 + max(24.7, 122.4) = 192 (187).


def wall_us(device_us: float, host, layers: int) -> float:
    """Predicted wall µs of a step of ``layers`` layers whose device time is ``device_us`` per
    layer, with host time ``host`` (a :class:`pkvrt.policy.calibration.HostCost`)."""
    return host.plan_us + layers * max(host.run_us, device_us)


def host_bound(device_us: float, host, layers: int) -> bool:
    """Whether the host sets the step's wall time: its host time (``plan_us + layers *
    run_us``) exceeds its device time (``layers * device_us``)."""
    return host.plan_us + layers * host.run_us > layers * device_us


# ----------------------------------------------------------------------------- fitting it


# The depth term's constant, searched on a grid (µs per tile of one CTA streaming alone; 0: no
# depth term): the H200's fits land at 0.45-0.70 (benches/NOTES.md, the time model).
DEPTH_GRID_US = (0.0, *(round(0.2 + 0.01 * i, 2) for i in range(131)))   # 0, 0.20 .. 1.50
_RECORD_KEYS = ("kv_bytes", "makespan_tiles", "splits", "us")
_OPTIONAL_RECORD_KEYS = ("depth_tiles", "merge_per_sm", "room_tiles")


def fit_route_time(records, *, beta_gbps: float, shape: tuple[float, float] | None = None) -> RouteTime:
    """The :class:`RouteTime` that best reproduces timed single-group steps.

    records : mappings with ``kv_bytes``, ``makespan_tiles``, ``splits`` and ``us`` (measured),
        optionally ``depth_tiles``, ``merge_per_sm`` (merge states over SMs) and ``room_tiles``
        (the :class:`LaunchGroup` terms; 0 when absent) and ``weight`` (> 0, default 1): how
        much the record's error counts.
    beta_gbps : the calibration's beta (KVBytes/beta is the read term).
    shape : None: fit every constant. ``(tail_us, split_us)``: keep those and fit
        ``read_scale`` and ``fixed_us`` only, depth_us, merge_us and room_us 0 (a route whose
        steps cannot separate more).

    What is minimised is the largest weighted relative error ``max w |T_model - T| / T`` (the
    target: every planned cut within 5 %), ties (1e-9) to the weighted squared relative error
    ``sum w ((T_model - T)/T)^2``, over these candidates, every constant >= 0 and read_scale > 0:

    * depth_us from :data:`DEPTH_GRID_US` (then refined to 0.001 around the best), and for each
      value and each subset of the linear terms (tail, split, merge, room, fixed; no more
      unknowns than records) the weighted least-squares solution of read_scale and the subset,
      the records bound by depth (``depth_us * depth_tiles > read_scale * read``) found by
      iterating from two starts (none; those whose chain outlasts their read at read_scale 1;
      at most 8 rounds each, every round's non-negative solution a candidate);
    * then Lawson's reweighting of the best candidate's terms (:func:`_lawson`), a round kept
      where it beats the candidate (:func:`_better`: a lower largest error, or a tie and a lower
      squared error).

    A heuristic search, not an exact minimax: the polish starts from one candidate at its
    depth_us and stops at a negative coefficient; a review's probe (the polish from every
    candidate of a 0.05 grid) found G 4 fused's largest weighted error 0.740 where this gives
    0.830 (planned cut 2.5 vs 2.8 %). The shipped H200 constants are this function's. A record set without depth (FlashInfer's) searches depth_us 0
      only, and a term no record has stays 0.

    With ``shape``: least squares on each subset of fixed_us, the best non-negative one (the
    form before cbdbfde). Example (H200 fused route, beta 4404.9 GB/s): B1 32K 134 MB in 41.07 µs
    at makespan 67 and 16 splits, B8 32K 1074 MB in 250.16 µs at 515 and 2, B8 1K 33.6 MB in
    13.88 µs at 19 and 2, with shape (0.59, 0.09): read_scale 0.974, fixed_us 3.84, predicting
    39.78, 254.78, 14.01 µs (-3.1 %, +1.8 %, +1.0 %).

    Raises ValueError with fewer records than free constants (2 with ``shape``, else 4), a
    record that is not numbers >= 0 (times > 0), or no fit with a positive read_scale (records
    that read no bytes).
    """
    recs = list(records)
    free = 2 if shape is not None else 4
    if len(recs) < free:
        raise ValueError(f"fit_route_time: {len(recs)} timed configurations, need at least {free}")
    for i, r in enumerate(recs):
        for key in _RECORD_KEYS + tuple(k for k in _OPTIONAL_RECORD_KEYS if k in r):
            v = r.get(key)
            if isinstance(v, bool) or not isinstance(v, (int, float, np.integer, np.floating)) or not v >= 0 \
                    or not math.isfinite(v):
                raise ValueError(f"fit_route_time: records[{i}][{key!r}]: expected a finite number >= 0, got {v!r}")
        if not r["us"] > 0:
            raise ValueError(f"fit_route_time: records[{i}]['us']: expected a time > 0, got {r['us']!r}")
        w = r.get("weight", 1.0)
        if (isinstance(w, bool) or not isinstance(w, (int, float, np.integer, np.floating))
                or not 0 < w < math.inf):
            raise ValueError(f"fit_route_time: records[{i}]['weight']: expected a finite number > 0, "
                             f"got {w!r}")
    y = np.array([r["us"] for r in recs], dtype=float)
    w = np.array([r.get("weight", 1.0) for r in recs], dtype=float)
    read = np.array([r["kv_bytes"] / (beta_gbps * 1e3) for r in recs])
    if not (read > 0).any():
        raise ValueError("fit_route_time: no fit with a positive read_scale (do the records read any bytes?)")
    if shape is not None:
        return _fit_shaped(recs, y, w, read, shape)
    depth = np.array([float(r.get("depth_tiles", 0.0)) for r in recs])
    lin = np.array([[math.sqrt(r["makespan_tiles"]), r["splits"], r.get("merge_per_sm", 0.0),
                     r.get("room_tiles", 0.0), 1.0] for r in recs])   # tail, split, merge, room, fixed
    terms = [j for j in range(lin.shape[1]) if lin[:, j].any()]   # a term no record has is 0
    subsets = [s for k in range(len(terms) + 1) for s in itertools.combinations(terms, k)
               if len(s) + 1 <= len(recs)]
    grid = DEPTH_GRID_US if depth.any() else (0.0,)
    best = None
    for a_grid in (grid, None):
        if a_grid is None:   # refine around the best depth_us
            a0 = best[1][0]
            a_grid = [] if a0 == 0 else sorted({round(max(0.0, a0 + 0.001 * k), 3) for k in range(-10, 11)} - {a0})
        for a in a_grid:
            for sub in subsets:
                cand = _fit_depth(y, w, read, depth, lin, a, sub)
                if cand is not None and (best is None or _better(cand[0], best[0])):
                    best = cand
    if best is None:
        raise ValueError("fit_route_time: no fit with a positive read_scale (do the records read any bytes?)")
    best = _lawson(y, w, read, depth, lin, best)
    a, rs, x = best[1]
    return RouteTime(read_scale=float(rs), tail_us=float(x[0]), split_us=float(x[1]), fixed_us=float(x[4]),
                     depth_us=float(a), merge_us=float(x[2]), room_us=float(x[3]))


def _better(score, than) -> bool:
    """Whether fit ``score`` (max weighted error, weighted squared error) beats ``than``: a
    largest error smaller by more than a part in 1e9, else (a tie) a smaller squared error."""
    tol = 1e-9 * than[0]
    return score[0] < than[0] - tol or (score[0] <= than[0] + tol and score[1] < than[1] * (1 - 1e-12))


def _solve(y, sw, read, depth, lin, a: float, sub, bound):
    """Weighted least squares (row weights ``sw``) of read_scale and the terms ``sub`` with the
    records ``bound`` by depth priced at ``a * depth``: (read_scale, x[5]), x 0 outside ``sub``."""
    cols = np.column_stack([np.where(bound, 0.0, read), lin[:, list(sub)]])
    target = y - np.where(bound, a * depth, 0.0)
    sol = np.linalg.lstsq(cols / y[:, None] * sw[:, None], target / y * sw, rcond=None)[0]
    x = np.zeros(lin.shape[1])
    x[list(sub)] = sol[1:]
    return sol[0], x


def _score(y, w, read, depth, lin, a: float, rs, x):
    """(the fit's criterion (largest weighted relative error, weighted squared error), the
    relative errors) of constants (a, rs, x)."""
    err = (np.maximum(rs * read, a * depth) + lin @ x - y) / y
    return (float(np.max(w * np.abs(err))), float(np.sum(w * err ** 2))), err


def _fit_depth(y, w, read, depth, lin, a: float, sub: tuple):
    """:func:`fit_route_time`'s candidates at depth_us ``a`` and linear terms ``sub``: the best
    of the rounds' least-squares solutions, as (score, (a, read_scale, x[5])), or None when none
    is non-negative. Two starts for the records bound by depth: none, and those whose chain
    outlasts their read at read_scale 1; each round takes the set the last solution implies,
    until it repeats (at most 8 rounds a start)."""
    sw = np.sqrt(w)
    best, seen = None, set()
    for bound in (np.zeros(y.size, dtype=bool), a * depth > read):
        for _ in range(8):
            key = bound.tobytes()
            if key in seen:
                break
            seen.add(key)
            rs, x = _solve(y, sw, read, depth, lin, a, sub, bound)
            if not rs > 0:
                break
            if (x >= 0).all():
                score, _ = _score(y, w, read, depth, lin, a, rs, x)
                if best is None or _better(score, best[0]):
                    best = (score, (a, rs, x))
            bound = a * depth > rs * read
    return best


def _lawson(y, w, read, depth, lin, best, rounds: int = 200):
    """Polish ``best`` (a :func:`_fit_depth` candidate) towards the least largest weighted error:
    Lawson's iteration (each round's least squares reweighted by each record's weighted error,
    so the worst records pull harder) on its depth_us and non-zero terms, the records bound by
    depth recomputed each round; the best round wins if it beats ``best`` (:func:`_better`)."""
    a, rs, x = best[1]
    sub = [i for i in range(lin.shape[1]) if x[i] > 0]
    u = np.ones(y.size)
    for _ in range(rounds):
        rs, xs = _solve(y, np.sqrt(u) * w, read, depth, lin, a, sub, a * depth > rs * read)
        if rs <= 0 or (xs < 0).any():
            break
        score, err = _score(y, w, read, depth, lin, a, rs, xs)
        if _better(score, best[0]):
            best = (score, (a, rs, xs))
        u = u * w * np.abs(err)
        if not u.sum() > 0:
            break
        u = u / u.sum()
    return best


def _fit_shaped(recs, y, w, read, shape) -> RouteTime:
    """:func:`fit_route_time` with ``shape`` = (tail_us, split_us) kept: read_scale and fixed_us
    by weighted least squares (fixed_us dropped when it would be negative)."""
    tail, split = shape
    sw = np.sqrt(w)
    rest = y - np.array([tail * math.sqrt(r["makespan_tiles"]) + split * r["splits"] for r in recs])
    best = None
    for cols in ((read,), (read, np.ones(y.size))):
        a = np.column_stack(cols) / y[:, None] * sw[:, None]
        x = np.linalg.lstsq(a, rest / y * sw, rcond=None)[0]
        if x[0] <= 0 or (x[1:] < 0).any():
            continue
        loss = float(np.sum((a @ x - rest / y * sw) ** 2))
        if best is None or loss < best[0] - 1e-15:
            best = (loss, x)
    if best is None:
        raise ValueError("fit_route_time: no fit with a positive read_scale (do the records read any bytes?)")
    x = best[1]
    return RouteTime(read_scale=float(x[0]), tail_us=float(tail), split_us=float(split),
                     fixed_us=float(x[1]) if x.size > 1 else 0.0)
