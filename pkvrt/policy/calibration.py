"""Calibration files: the measured constants of one GPU, as a versioned JSON document.

One file per GPU lives in ``calibration/<slug>.json`` (a checkout) or ``pkvrt/_data/calibration``
(an install). The runtime picks the file whose ``slug`` matches ``slugify(device name)``; with no
match it warns and falls back to the seed's RTX 3060 profile (``rtx3060-seed.json``), marked as a
fallback. ``calibration/README.md`` explains every field and how ``pkvrt calibrate`` produces one.

Schema 1 (every key required unless marked optional; no others allowed)::

    schema            1
    gpu               device name as CUDA reports it, "NVIDIA H200"
    slug              file key, slugify(gpu) for measured files, "rtx3060-seed" for the seed
    sm_count          int > 0
    l2_bytes          int > 0
    beta_gbps         streaming-read bandwidth, GB/s (1e9 bytes/s)
    lambda_us         launch overhead of one eager launch, µs
    lambda_graph_us   launch overhead of one launch inside a CUDA-graph replay, µs
    c_min             occupancy target of the cost model, decode CTAs per SM
    splits            {"bucket_ctas_per_sm", "workqueue_ctas_per_sm", "min_split_tokens",
                       "cta_overhead_tiles", "co_resident_slowdown" (these two optional: 4.0 and
                       1.5 when absent, in files written before 2026-12-01), "max_waves"
                       (optional, int >= 1, default 2), "merge_free_slots" (optional, int
                       >= 0, default 0), "wave_room_slots" (optional, int >= 0, default 0),
                       "wave_room_tiles" (optional, number >= 0, default 0),
                       "wave_room_chunk_tiles" (optional, int >= 0, default 0), "by_group" (optional: {"<G>": {some
                       of _GROUP_KEYS}}, the balanced partition's constants fitted at query
                       heads per KV head G; a group size without an entry uses the keys above)}
    flashinfer        {"ctas_per_sm": {"<active>": float, ...}}  fitted, see costmodel.py
    time_model        optional: {"flashinfer", "bucket", "workqueue", "fused": each
                       {"read_scale" > 0, "tail_us" >= 0, "split_us" >= 0, "fixed_us" >= 0,
                       and optionally "depth_us", "merge_us", "room_us" >= 0 (0 when absent,
                       in files written before 2026-12-03)}, "by_group" (optional: {"<G>": {some of those four kinds}})}: the
                       measured time model of every route kind (costmodel.py, "The measured
                       model"); a file without it (the seed, files of an older calibrate) is
                       predicted with the roofline above (c_min, flashinfer.ctas_per_sm)
    host_time         optional: {"flashinfer", "bucket", "workqueue", "fused": each {"plan_us",
                       "run_us": numbers >= 0}, "date", "command", "source"}: the HOST time of a
                       step on each route in the Runtime's default mode (host lengths, a graph
                       per layer; FlashInfer eager with direct calls), measured on the machine
                       by ``pkvrt calibrate --host-time``: plan_us the step's fixed host time
                       (plan() and the first run()'s extra), run_us each run() (a layer). The
                       router weighs it when routes.toml's ``[host_time]`` is enabled
                       (costmodel.py, "Host time"); the host of the machine, not the GPU, sets it
    sharing           optional: {"l2_reread_cost": number in (0, 1], "date", "command",
                       "source"}: the time of a page's re-read by another row of the same step
                       (shared pages: they meet in L2) in units of its first read, fitted by
                       ``benches/shared_pages.py --fit-l2`` from measured steps with shared pages;
                       SharedPagesRuntime predicts a plain step, and the chunk decode's re-reads
                       of a run too long for one chunk, with it (absent: 1.0, no help from L2);
                       optional "overhead_us" (a number >= 0): per layer, what the shared path
                       takes beyond its chunk and own decodes (query gathers, the merge, the
                       boundaries between its dependent kernels), fitted by the same command
                       (absent: its launches at lambda_graph_us)
    by_kv_dtype       optional: {"float8_e4m3fn": section}: constants measured with K/V caches of
                       that dtype (``pkvrt calibrate --kv-dtype fp8``), laid over the rest of the
                       file (measured with fp16 caches) for a Runtime or Router of that KV dtype
                       (:meth:`Calibration.for_kv_dtype`). A section: {"splits" (optional: some of
                       _SECTION_SPLIT_KEYS, "by_group" as splits.by_group), "time_model"
                       (optional: some of the four kinds, "by_group" as time_model.by_group), at
                       least one of the two; "date", "command", "source": its own provenance}
    by_head_dim       optional: {"<D>": section} for D in SECTION_HEAD_DIMS: the partition's
                       constants measured at head dim D (``pkvrt calibrate --head-dim D``; a
                       section as by_kv_dtype's, fp16 caches), laid over the rest of the file
                       (measured at D 128) for a Runtime or Router of that head dim
                       (:meth:`Calibration.for_head_dim`), under an FP8 section's
    versions          {"torch", "cuda", "flashinfer", "driver"}: string or null
    date              ISO date the file was produced, "2026-11-29"
    seed              calibration trace seed, int
    command           the command line that produced the file
    source            provenance in words (measured / transcribed from where)
"""

from __future__ import annotations

import datetime
import json
import math
import os
import pathlib
import re
import warnings
from collections.abc import Iterable, Mapping

import attrs
import numpy as np

from pkvrt._paths import CHECKOUT, PACKAGE

SCHEMA = 1
DEFAULT_SLUG = "rtx3060-seed"
ENV_DIR = "PKVRT_CALIBRATION_DIR"  # an extra directory searched first (tests, experiments)

_TOP_KEYS = (
    "schema", "gpu", "slug", "sm_count", "l2_bytes", "beta_gbps", "lambda_us", "lambda_graph_us",
    "c_min", "splits", "flashinfer", "versions", "date", "seed", "command", "source",
)
_OPTIONAL_TOP_KEYS = ("time_model", "by_kv_dtype", "by_head_dim", "host_time", "sharing")
_SPLIT_KEYS = ("bucket_ctas_per_sm", "workqueue_ctas_per_sm", "min_split_tokens", "cta_overhead_tiles",
               "co_resident_slowdown", "max_waves", "merge_free_slots", "wave_room_slots",
               "wave_room_tiles", "wave_room_chunk_tiles", "by_group")
# splits.by_group.<G>.*: the balanced partition's constants that one group size may override
_GROUP_KEYS = ("workqueue_ctas_per_sm", "min_split_tokens", "cta_overhead_tiles", "co_resident_slowdown",
               "wave_room_slots", "wave_room_tiles", "wave_room_chunk_tiles")
# splits.* of a file written before they existed (2026-12-01): the balanced partition's defaults
DEFAULT_CTA_OVERHEAD_TILES = 4.0
DEFAULT_CO_RESIDENT_SLOWDOWN = 1.5
DEFAULT_MAX_WAVES = 2   # resident waves of CTAs the balanced partition may plan (planner.MAX_WAVES)
TOP_GROUP = 4           # the group size of a file's top-level constants (`pkvrt calibrate`'s shape)
CALIBRATION_HEAD_DIM = 128   # the head dim `pkvrt calibrate` times its kernels at
# head dims a by_head_dim section may be measured at (`pkvrt calibrate --head-dim`): the kernels'
# others (_buildspec.HEAD_DIMS)
SECTION_HEAD_DIMS = (64, 96, 256)
_VERSION_KEYS = ("torch", "cuda", "flashinfer", "driver")
# time_model.<kind>: every route kind has one when the section is present
TIME_KINDS = ("flashinfer", "bucket", "workqueue", "fused")
_TIME_KEYS = ("read_scale", "tail_us", "split_us", "fixed_us")
# time_model.<kind> keys a file may omit (0: the model before them, files before 2026-12-03)
_TIME_OPTIONAL_KEYS = ("depth_us", "merge_us", "room_us")
# host_time.<kind>: every route kind, each with both keys
_HOST_KEYS = ("plan_us", "run_us")
_SHARING_KEYS = ("l2_reread_cost", "date", "command", "source")
# KV dtypes (routes.toml names): the top level's, measured with fp16 caches (bf16 moves the same
# bytes through the same kernels), and those a by_kv_dtype section may be measured for
TOP_KV_DTYPES = ("float16", "bfloat16")
SECTION_KV_DTYPES = ("float8_e4m3fn",)
_SECTION_KEYS = ("splits", "time_model", "date", "command", "source")
# by_kv_dtype.<name>.splits.*: the split constants a KV dtype may override (SplitPoints order)
# the room charge's largest values: the planning kernel takes them as int32 (wave_room_tiles * 8)
# and multiplies slots, charge and SMs in int64
_ROOM_LIMITS = {"wave_room_slots": 1 << 20, "wave_room_tiles": float(1 << 20), "wave_room_chunk_tiles": (1 << 31) - 1}
# splits.* written only when nonzero
_UNSET_OMITTED = ("merge_free_slots", "wave_room_slots", "wave_room_tiles", "wave_room_chunk_tiles")
_SECTION_SPLIT_KEYS = ("bucket_ctas_per_sm", *_GROUP_KEYS, "max_waves", "by_group")


class CalibrationError(ValueError):
    """A calibration file is unreadable or breaks the schema; the message names file and key."""


@attrs.frozen
class SplitPoints:
    """Operating points of the split choice (see ``pkvrt.policy.planner``).

    bucket_ctas_per_sm: CTA work per SM the bucket route's split count aims for.
    workqueue_ctas_per_sm: decode CTAs resident per SM (the kernel's occupancy): the
        balanced partition's waves (``planner.PartitionModel``).
    min_split_tokens: no split is planned shorter than this many tokens (row-local cap).
    cta_overhead_tiles: fixed cost of one decode CTA in the balanced partition's makespan model,
        in 32-token tiles of streaming (``planner.partition_costs``).
    co_resident_slowdown: how much longer an SM takes with two resident CTAs than with one
        (1.0: a second CTA is free, 2.0: it runs after the first).
    max_waves: the balanced partition plans at most this many resident waves of decode CTAs
        (``workqueue_ctas_per_sm * sm_count`` each); larger cuts are not considered.
    merge_free_slots: on a one-row workqueue step (decode, then a separate merge launch) the
        cut is preferred that leaves at least this many resident slots free in its last wave, so
        that the merge's CTAs become resident while the decode runs (programmatic dependent
        launch) instead of after it (``planner.partition_choice``); fused cuts (no merge launch)
        and steps of several rows (unmeasured) ignore it. 0: no
        preference (files written before 2026-12-02). Set by hand, like max_waves: `pkvrt
        calibrate` keeps the file's value.
    wave_room_slots, wave_room_tiles, wave_room_chunk_tiles: the partition's choice (not its
        makespan) charges a cut of chunks of at most ``wave_room_chunk_tiles`` tiles whose last
        wave leaves ``free < wave_room_slots`` resident slots free ``wave_room_tiles *
        (wave_room_slots - free) / wave_room_slots`` tile-times: the next kernel's CTAs (the next
        layer's decode, launched early by programmatic dependent launch) find no slot to start
        in while this decode runs (``planner.partition_choice``). Fitted by `pkvrt calibrate`
        after the other constants (``fit_wave_room``); any of them 0 (files before 2026-12-02,
        or a fit where no charge helps): no charge.
    by_group: ``((G, ((key, value), ...)), ...)`` sorted by G: partition constants
        (``_GROUP_KEYS``) fitted at G query heads per KV head, which replace the ones above for
        that group size (:meth:`Calibration.for_group`). Empty: one set for every G.
    """

    bucket_ctas_per_sm: float
    workqueue_ctas_per_sm: float
    min_split_tokens: int
    cta_overhead_tiles: float = DEFAULT_CTA_OVERHEAD_TILES
    co_resident_slowdown: float = DEFAULT_CO_RESIDENT_SLOWDOWN
    max_waves: int = DEFAULT_MAX_WAVES
    merge_free_slots: int = 0
    wave_room_slots: int = 0
    wave_room_tiles: float = 0.0
    wave_room_chunk_tiles: int = 0
    by_group: tuple[tuple[int, tuple[tuple[str, float | int], ...]], ...] = ()

    def to_dict(self) -> dict:
        """The ``splits`` object of a file (``merge_free_slots`` and the wave-room keys only when
        set, ``by_group`` only when it has entries: a file without them reads back the same)."""
        d = {k: v for k, v in attrs.asdict(self, recurse=False).items()
             if k != "by_group" and (k not in _UNSET_OMITTED or v)}
        if self.by_group:
            d["by_group"] = {str(g): dict(kv) for g, kv in self.by_group}
        return d


@attrs.frozen
class RouteTime:
    """Constants of the measured time model of one route kind (``pkvrt.policy.costmodel.measured_us``):

        T = max(read_scale * KVBytes/beta, depth_us * depth) + tail_us * sqrt(makespan)
            + split_us * splits + merge_us * merge_states / SMs + room_us * room + fixed_us

    per launch group of a step; makespan in tile-times of the balanced partition's model,
    splits the longest row's split count, depth the tiles one resident CTA slot streams in
    a row (waves of CTAs times the chunk), merge_states the partial states the step writes
    and merges, room the partition's charge for a last wave with few free slots (tile-times).
    read_scale: the step's streaming read in units of ``beta``; depth_us: µs per tile of one
    CTA streaming alone (the step is latency-bound when that chain is longer than the read);
    tail_us: µs per square root of the makespan (the CTAs that finish last); split_us: µs per
    split of the longest row; merge_us: µs per partial state per SM (the merge's work);
    room_us: µs per tile-time of room charge; fixed_us: µs per launch group (launches,
    prologue), inside a CUDA-graph replay. depth_us, merge_us and room_us are 0 in files
    written before 2026-12-03 (the model is then the one of those files).
    """

    read_scale: float
    tail_us: float
    split_us: float
    fixed_us: float
    depth_us: float = 0.0
    merge_us: float = 0.0
    room_us: float = 0.0

    def to_dict(self) -> dict:
        """The file's object: the four keys, and those of depth_us, merge_us, room_us that are
        not 0 (absent reads as 0, so files of the model before them round-trip unchanged)."""
        return {k: getattr(self, k) for k in _TIME_KEYS + _TIME_OPTIONAL_KEYS
                if k in _TIME_KEYS or getattr(self, k) != 0}


@attrs.frozen
class HostCost:
    """Host time of a step on one route kind (a file's ``host_time.<kind>``), in µs: a step of
    L layers costs ``plan_us + L * run_us`` of host time (``pkvrt.policy.costmodel.wall_us``)."""

    plan_us: float
    run_us: float

    def to_dict(self) -> dict:
        return {k: getattr(self, k) for k in _HOST_KEYS}


@attrs.frozen
class HostTime:
    """A file's ``host_time`` section: :class:`HostCost` of every route kind (``TIME_KINDS``),
    with its own provenance (it is measured on the machine's host, apart from the GPU's
    constants: ``pkvrt calibrate --host-time``)."""

    costs: tuple[tuple[str, HostCost], ...]
    date: str
    command: str
    provenance: str

    def cost(self, kind: str) -> HostCost:
        return dict(self.costs)[kind]

    def to_dict(self) -> dict:
        return {k: c.to_dict() for k, c in self.costs} | {"date": self.date, "command": self.command,
                                                          "source": self.provenance}


@attrs.frozen
class SharingCost:
    """A file's ``sharing`` section: what a page costs a plain step when several of its rows
    read it (prefix caching, parallel sampling), its own provenance (fitted from measured
    steps with shared pages: ``benches/shared_pages.py --fit-l2``).

    l2_reread_cost : the time of a re-read of a page that another row of the step read, in
        units of its first read from memory (they meet in L2): 1.0 would be no help from L2.
    overhead_us : per layer, the time a shared step takes beyond its chunk and own decodes (the
        query gathers, the merge and the boundaries between those dependent kernels); None:
        not measured (the rule counts their launches at ``lambda_graph_us`` then)."""

    l2_reread_cost: float
    date: str
    command: str
    provenance: str
    overhead_us: float | None = None

    def to_dict(self) -> dict:
        d = {"l2_reread_cost": self.l2_reread_cost}
        if self.overhead_us is not None:
            d["overhead_us"] = self.overhead_us
        return d | {"date": self.date, "command": self.command, "source": self.provenance}


@attrs.frozen
class KvDtypeSection:
    """Constants measured with K/V caches of one dtype (a file's ``by_kv_dtype.<name>``), which
    :meth:`Calibration.for_kv_dtype` lays over the file's own (measured with fp16 caches).

    splits : ``((key, value), ...)``, some of ``_SECTION_SPLIT_KEYS`` in that order.
    splits_by_group : as :attr:`SplitPoints.by_group` (keys of ``_GROUP_KEYS``).
    time_model : ``((kind, RouteTime), ...)``, some kinds in ``TIME_KINDS`` order.
    time_model_by_group : as :attr:`Calibration.time_model_by_group`.
    date, command, provenance : when, by what command line and how the section was measured (the
        file's "date", "command", "source" keys, for this section alone).
    """

    splits: tuple[tuple[str, float | int], ...] = ()
    splits_by_group: tuple[tuple[int, tuple[tuple[str, float | int], ...]], ...] = ()
    time_model: tuple[tuple[str, RouteTime], ...] = ()
    time_model_by_group: tuple[tuple[int, tuple[tuple[str, RouteTime], ...]], ...] = ()
    date: str = ""
    command: str = ""
    provenance: str = ""

    def at_group(self, group_size: int) -> "KvDtypeSection":
        """The section with its ``by_group`` entries of ``group_size`` folded into its top level
        (and ``by_group`` emptied): :meth:`Calibration.for_group` of a file with sections."""
        return attrs.evolve(
            self, splits=_ordered(dict(self.splits) | dict(dict(self.splits_by_group).get(group_size, ())),
                                  _SECTION_SPLIT_KEYS),
            time_model=_ordered(dict(self.time_model) | dict(dict(self.time_model_by_group).get(group_size, ())),
                                TIME_KINDS),
            splits_by_group=(), time_model_by_group=())

    def to_dict(self) -> dict:
        """The ``by_kv_dtype.<name>`` object of a file (empty parts left out)."""
        d = {}
        if self.splits or self.splits_by_group:
            d["splits"] = dict(self.splits) | ({"by_group": {str(g): dict(kv) for g, kv in self.splits_by_group}}
                                               if self.splits_by_group else {})
        if self.time_model or self.time_model_by_group:
            d["time_model"] = {k: t.to_dict() for k, t in self.time_model} | (
                {"by_group": {str(g): {k: t.to_dict() for k, t in kinds} for g, kinds in self.time_model_by_group}}
                if self.time_model_by_group else {})
        return d | {"date": self.date, "command": self.command, "source": self.provenance}


def _ordered(d: dict, order) -> tuple:
    """``d``'s items in ``order`` (the file's key order)."""
    return tuple((k, d[k]) for k in order if k in d)


def _overlay(top: dict, by_group: tuple, over: dict, over_by_group: tuple, order) -> tuple[dict, tuple]:
    """(top, by_group) of one kind of constants (split keys or route kinds) with a KV dtype's
    laid over: ``over`` over ``top``; per G, ``over_by_group[G]`` over ``by_group[G]`` less the
    keys ``over`` sets (a constant measured with the KV dtype beats one measured at the G with
    fp16 caches). Example: top {overhead 1.5}, G 8 {overhead 3.0}; FP8 top {overhead 2.0}, no
    FP8 G 8 entry -> top {overhead 2.0}, G 8 {} (FP8 at G 8 uses 2.0)."""
    base, extra = dict(by_group), dict(over_by_group)
    groups = []
    for g in sorted(set(base) | set(extra)):
        entry = {k: v for k, v in base.get(g, ()) if k not in over} | dict(extra.get(g, ()))
        if entry:
            groups.append((g, _ordered(entry, order)))
    return top | over, tuple(groups)


@attrs.frozen
class Calibration:
    """Constants of one GPU (schema 1). ``source`` is the path it was loaded from (not in the file;
    ``"<memory>"`` when built in code).

    ``provenance`` holds the file's own ``"source"`` text (how the numbers were obtained);
    ``fallback`` is True when ``find_calibration`` found no file for the device at hand.
    ``flashinfer_ctas_per_sm`` is a tuple of ``(active_count, fitted_ctas_per_sm)`` pairs,
    sorted by active count. ``time_model``: ``((kind, RouteTime), ...)`` in ``TIME_KINDS``
    order, empty when the file has none (then every prediction is the roofline's);
    ``time_model_by_group``: ``((G, ((kind, RouteTime), ...)), ...)`` sorted by G, the kinds
    fitted at G query heads per KV head (:meth:`for_group`). ``by_kv_dtype``: ``((name,
    KvDtypeSection), ...)`` sorted by name, constants measured with K/V caches of that dtype.
    ``kv_dtype``: None for a file's calibration; the KV dtype name once :meth:`for_kv_dtype` has
    resolved it, with ``kv_dtype_fallback`` True when that dtype has no section (its constants
    are then the fp16-measured ones; the router still counts its bytes per element).
    ``by_head_dim``: ``((D, section), ...)`` sorted by D, constants measured at that head dim;
    ``head_dim`` / ``head_dim_fallback`` as ``kv_dtype`` once :meth:`for_head_dim` resolved it.
    """

    gpu: str
    slug: str
    sm_count: int
    l2_bytes: int
    beta_gbps: float
    lambda_us: float
    lambda_graph_us: float
    c_min: float
    splits: SplitPoints
    flashinfer_ctas_per_sm: tuple[tuple[int, float], ...]
    versions: tuple[tuple[str, str | None], ...]
    date: str
    seed: int
    command: str
    provenance: str
    source: str = "<memory>"
    fallback: bool = False
    time_model: tuple[tuple[str, RouteTime], ...] = ()
    time_model_by_group: tuple[tuple[int, tuple[tuple[str, RouteTime], ...]], ...] = ()
    by_kv_dtype: tuple[tuple[str, KvDtypeSection], ...] = ()
    kv_dtype: str | None = None
    kv_dtype_fallback: bool = False
    by_head_dim: tuple[tuple[int, KvDtypeSection], ...] = ()
    head_dim: int | None = None
    head_dim_fallback: bool = False
    host_time: HostTime | None = None   # the file's host_time section (None: not measured)
    sharing: SharingCost | None = None  # the file's sharing section (None: not measured)

    def version(self, name: str) -> str | None:
        """The recorded version of ``name`` ("torch", "cuda", "flashinfer", "driver")."""
        return dict(self.versions)[name]

    def route_time(self, kind: str) -> RouteTime | None:
        """The measured time model of route ``kind`` ("flashinfer", "bucket", "workqueue",
        "fused"), or None when this calibration has none (the roofline predicts)."""
        return dict(self.time_model).get(kind)

    def calibrated_group(self, group_size: int) -> int:
        """The group size whose constants serve ``group_size``: itself when the file has its
        ``by_group`` entry (or it is the calibration shape's, :data:`TOP_GROUP`), else the
        nearest calibrated group size on a log scale, ties to :data:`TOP_GROUP` (H200 file,
        entries 1, 4, 8: G 3 and 5 take 4's constants, G 7, 12 and 16 take 8's, G 2 takes 4's).
        The partition constants describe a CTA of the kernel, whose cost per token does not
        depend on G but whose tail merge grows with it, and the grid, whose width is H_kv: the
        nearest calibrated G is the closest measured stand-in until a calibration at that G."""
        if isinstance(group_size, bool) or not isinstance(group_size, int) or group_size <= 0:
            raise ValueError(f"calibrated_group: group_size must be a positive int, got {group_size!r}")
        have = {TOP_GROUP, *(g for g, _ in self.splits.by_group), *(g for g, _ in self.time_model_by_group)}
        if group_size in have:
            return group_size
        dist = lambda g: abs(math.log2(g / group_size))  # noqa: E731
        return min(sorted(have), key=lambda g: (round(dist(g), 9), g != TOP_GROUP))

    def for_group(self, group_size: int) -> "Calibration":
        """This calibration as seen by a shape with ``group_size`` query heads per KV head: the
        ``splits.by_group`` entry of that size (if any) replaces the partition constants, the
        ``time_model.by_group`` entry the time constants of the kinds it holds, and both
        ``by_group`` are emptied, so the result is the same whichever G it is asked for again
        (the Runtime and the Router both call it). A G without an entry keeps the top-level
        constants (fitted at the calibration shape's G, 4 for ``pkvrt calibrate``). Each
        ``by_kv_dtype`` section's entries of that G are folded into the section the same way,
        so that :meth:`for_kv_dtype` may come before or after.
        """
        if isinstance(group_size, bool) or not isinstance(group_size, int) or group_size <= 0:
            raise ValueError(f"for_group: group_size must be a positive int, got {group_size!r}")
        sections_grouped = any(s.splits_by_group or s.time_model_by_group
                               for _, s in (*self.by_kv_dtype, *self.by_head_dim))
        if not self.splits.by_group and not self.time_model_by_group and not sections_grouped:
            return self
        over = dict(dict(self.splits.by_group).get(group_size, ()))
        times = dict(self.time_model) | dict(dict(self.time_model_by_group).get(group_size, ()))
        return attrs.evolve(self, splits=attrs.evolve(self.splits, by_group=(), **over),
                            time_model=_ordered(times, TIME_KINDS), time_model_by_group=(),
                            by_kv_dtype=tuple((n, s.at_group(group_size)) for n, s in self.by_kv_dtype),
                            by_head_dim=tuple((d, s.at_group(group_size)) for d, s in self.by_head_dim))

    def for_kv_dtype(self, kv_dtype) -> "Calibration":
        """This calibration as seen by a Runtime or Router whose K/V cache is ``kv_dtype`` (a
        torch dtype or its routes.toml name, "float8_e4m3fn"): the ``by_kv_dtype`` section of
        that dtype laid over the file's constants, ``kv_dtype`` set and ``by_kv_dtype`` emptied.

        Each split constant and each route kind's time model, at group size G, comes from the
        first of: the section's G entry, the section's top level, the file's G entry, the file's
        top level. What was measured with the KV dtype comes first, then what was measured at
        the G. Composes with :meth:`for_group` in either order, to the same result. Example
        (H200 file with an FP8 section fitted at G 4 only): an FP8 Runtime at G 8 partitions
        with the FP8 G 4 constants and predicts pkvrt's routes with the FP8 time model, but
        FlashInfer (not timed with FP8 caches) with the file's G 8 constants, bytes halved.

        A 16-bit dtype (TOP_KV_DTYPES) sees the file's own constants. An FP8 dtype without a
        section does too, marked ``kv_dtype_fallback`` (:meth:`kv_dtype_note` says so). Asking
        a resolved calibration again for its dtype returns it; for another is a ValueError.
        """
        from pkvrt.policy.registry import kv_dtype_name   # registry imports nothing of pkvrt's policy

        name = kv_dtype_name(kv_dtype)
        if self.kv_dtype is not None:
            if name != self.kv_dtype:
                raise ValueError(f"for_kv_dtype({name!r}): this calibration is already the "
                                 f"{self.kv_dtype} view; ask the file's calibration")
            return self
        section = dict(self.by_kv_dtype).get(name)
        view = attrs.evolve(self, by_kv_dtype=(), kv_dtype=name,
                            kv_dtype_fallback=section is None and name not in TOP_KV_DTYPES)
        return view if section is None else view._laid_over(section, f"by_kv_dtype.{name}")

    def for_head_dim(self, head_dim: int) -> "Calibration":
        """This calibration as seen by a Runtime or Router of ``head_dim``: the ``by_head_dim``
        section of that head dim laid over the file's constants (as :meth:`for_kv_dtype` lays a
        KV dtype's), ``head_dim`` set and ``by_head_dim`` emptied. Ask it before
        :meth:`for_kv_dtype` (an FP8 section, measured at D 128, then lies over it); with
        :meth:`for_group` in either order. A head dim without a section keeps the file's
        constants (measured at :data:`CALIBRATION_HEAD_DIM`), marked ``head_dim_fallback``
        unless it is that head dim. Asking a resolved calibration again for its head dim returns
        it; for another, or after :meth:`for_kv_dtype`, is a ValueError."""
        if isinstance(head_dim, bool) or not isinstance(head_dim, int) or head_dim <= 0:
            raise ValueError(f"for_head_dim: head_dim must be a positive int, got {head_dim!r}")
        if self.head_dim is not None:
            if head_dim != self.head_dim:
                raise ValueError(f"for_head_dim({head_dim}): this calibration is already the D "
                                 f"{self.head_dim} view; ask the file's calibration")
            return self
        if self.kv_dtype is not None and self.by_head_dim:
            raise ValueError(f"for_head_dim({head_dim}): ask it before for_kv_dtype (this is the "
                             f"{self.kv_dtype} view)")
        section = dict(self.by_head_dim).get(head_dim)
        view = attrs.evolve(self, by_head_dim=(), head_dim=head_dim,
                            head_dim_fallback=section is None and head_dim != CALIBRATION_HEAD_DIM)
        return view if section is None else view._laid_over(section, f"by_head_dim.{head_dim}")

    def _laid_over(self, section: KvDtypeSection, name: str) -> "Calibration":
        """This calibration with ``section`` laid over its split constants and time model (per
        G: ``_overlay``), its provenance naming the section ``name``."""
        split_top = {k: v for k, v in attrs.asdict(self.splits, recurse=False).items() if k != "by_group"}
        split_top, split_groups = _overlay(split_top, self.splits.by_group, dict(section.splits),
                                           section.splits_by_group, _GROUP_KEYS)
        times, time_groups = _overlay(dict(self.time_model), self.time_model_by_group,
                                      dict(section.time_model), section.time_model_by_group, TIME_KINDS)
        return attrs.evolve(self, splits=SplitPoints(**split_top, by_group=split_groups),
                            time_model=_ordered(times, TIME_KINDS), time_model_by_group=time_groups,
                            provenance=f"{self.provenance} {name}: {section.provenance}")

    def head_dim_note(self) -> str:
        """What a resolved calibration's constants are at its head dim, for ``explain()``; ""
        at :data:`CALIBRATION_HEAD_DIM` or unresolved."""
        if self.head_dim is None or self.head_dim == CALIBRATION_HEAD_DIM:
            return ""
        if self.head_dim_fallback:
            return (f"D {self.head_dim}: no by_head_dim section in {self.slug}, so the constants "
                    f"measured at D {CALIBRATION_HEAD_DIM} (pkvrt calibrate --head-dim {self.head_dim} "
                    f"measures them)")
        over = (f", the by_kv_dtype.{self.kv_dtype} section's (measured at D {CALIBRATION_HEAD_DIM}) "
                "laid over them" if self.kv_dtype not in (None, *TOP_KV_DTYPES) and not self.kv_dtype_fallback
                else "")
        return f"D {self.head_dim}: the by_head_dim section's constants{over}"

    def kv_dtype_note(self) -> str:
        """What a resolved FP8 calibration's constants are, for ``explain()``; "" for a 16-bit
        dtype or a calibration :meth:`for_kv_dtype` has not resolved."""
        if self.kv_dtype is None or self.kv_dtype in TOP_KV_DTYPES:
            return ""
        if self.kv_dtype_fallback:
            return (f"{self.kv_dtype} K/V: no by_kv_dtype section in {self.slug}, so the constants "
                    f"measured with fp16 caches, bytes per element counted as 1 "
                    f"(pkvrt calibrate --kv-dtype fp8 measures them)")
        return f"{self.kv_dtype} K/V: the by_kv_dtype section's constants (measured with {self.kv_dtype} caches)"


# ----------------------------------------------------------------------------- parsing


def _fail(path, key: str, expected: str, got=None) -> CalibrationError:
    got_s = "" if got is None else f", got {got!r}"
    return CalibrationError(f"{path}: key {key!r}: expected {expected}{got_s}")


def _take(obj: Mapping, keys: tuple[str, ...], path, where: str) -> None:
    missing = [k for k in keys if k not in obj]
    if missing:
        raise _fail(path, f"{where}{missing[0]}", "it to be present (missing)")
    extra = sorted(set(obj) - set(keys))
    if extra:
        raise _fail(path, f"{where}{extra[0]}", f"one of the schema-{SCHEMA} keys {list(keys)} (unknown key)")


def _int(obj, key, path, where="", positive=True) -> int:
    v = obj[key]
    if isinstance(v, bool) or not isinstance(v, int):
        raise _fail(path, where + key, "an integer", v)
    if positive and v <= 0:
        raise _fail(path, where + key, "a positive integer", v)
    return v


def _nonneg_int(obj, key, path, where="") -> int:
    v = _int(obj, key, path, where, positive=False)
    if v < 0:
        raise _fail(path, where + key, "an integer >= 0", v)
    return v


def _float(obj, key, path, where="", zero_ok=False) -> float:
    v = obj[key]
    if isinstance(v, bool) or not isinstance(v, (int, float)):
        raise _fail(path, where + key, "a number", v)
    if not math.isfinite(v) or v < 0 or (v == 0 and not zero_ok):
        raise _fail(path, where + key, "a finite number >= 0" if zero_ok else "a finite positive number", v)
    return float(v)


def _str(obj, key, path, where="", nullable=False) -> str | None:
    v = obj[key]
    if v is None and nullable:
        return None
    if not isinstance(v, str) or not v:
        raise _fail(path, where + key, "a non-empty string" + (" or null" if nullable else ""), v)
    return v


def _dict(obj, key, path) -> dict:
    v = obj[key]
    if not isinstance(v, dict):
        raise _fail(path, key, "a JSON object", v)
    return v


def _split_value(obj, key, path, where):
    """One split constant: ``min_split_tokens`` and ``max_waves`` positive integers,
    ``cta_overhead_tiles`` a number >= 0, the others positive numbers."""
    if key in ("min_split_tokens", "max_waves"):
        return _int(obj, key, path, where)
    if key in ("wave_room_slots", "wave_room_chunk_tiles"):
        v = _nonneg_int(obj, key, path, where)
    else:
        v = _float(obj, key, path, where, zero_ok=key in ("cta_overhead_tiles", "wave_room_tiles"))
    if key in _ROOM_LIMITS and v > _ROOM_LIMITS[key]:   # the planning kernel's int arithmetic
        raise _fail(path, where + key, f"at most {_ROOM_LIMITS[key]}", v)
    return v


def _group_keys(v, path, where: str, allowed: tuple) -> list[tuple[int, dict]]:
    """A ``by_group`` object: [(G, entry)] with G positive integers and each entry a non-empty
    object of some of ``allowed``."""
    if not isinstance(v, dict):
        raise _fail(path, where, 'a JSON object {"<G>": {...}}', v)
    out = []
    for g, entry in v.items():
        if not re.fullmatch(r"[1-9][0-9]*", g):
            raise _fail(path, f"{where}.{g}", "keys that are positive integers (query heads per KV head)")
        if not isinstance(entry, dict) or not entry:
            raise _fail(path, f"{where}.{g}", f"a non-empty object of some of {list(allowed)}", entry)
        extra = sorted(set(entry) - set(allowed))
        if extra:
            raise _fail(path, f"{where}.{g}.{extra[0]}", f"one of {list(allowed)} (unknown key)")
        out.append((int(g), entry))
    return out


def _by_group(v, path, where: str = "splits.by_group") -> tuple:
    """``splits.by_group`` -> SplitPoints.by_group (validated: G keys are positive integers, each
    entry a non-empty object of ``_GROUP_KEYS``)."""
    return tuple(sorted((g, tuple((k, _split_value(entry, k, path, f"{where}.{g}.")) for k in _GROUP_KEYS
                                  if k in entry))
                        for g, entry in _group_keys(v, path, where, _GROUP_KEYS)))


def _route_time(entry, path, where: str) -> RouteTime:
    """One ``time_model.<kind>`` object -> RouteTime (every key of ``_TIME_KEYS``, some of
    ``_TIME_OPTIONAL_KEYS``, no other)."""
    if not isinstance(entry, dict):
        raise _fail(path, where, f"a JSON object of {list(_TIME_KEYS)} (and optionally "
                                 f"{list(_TIME_OPTIONAL_KEYS)})", entry)
    _take({k: None for k in _TIME_OPTIONAL_KEYS} | entry, _TIME_KEYS + _TIME_OPTIONAL_KEYS, path, where + ".")
    return RouteTime(**{k: _float(entry, k, path, where + ".", zero_ok=k != "read_scale")
                        for k in _TIME_KEYS + _TIME_OPTIONAL_KEYS if k in entry})


def _time_model(v, path, where: str = "time_model", every_kind: bool = True) -> tuple[tuple, tuple]:
    """``time_model`` -> (Calibration.time_model, Calibration.time_model_by_group): every kind of
    ``TIME_KINDS`` at the top level (some of them, not none, with ``every_kind`` False: a
    by_kv_dtype section's); ``by_group`` entries hold some of them."""
    if not isinstance(v, dict) or not (every_kind or v):
        raise _fail(path, where, f"a JSON object of {'' if every_kind else 'some of '}{list(TIME_KINDS)} "
                                 "(and optional by_group)", v)
    if every_kind:
        _take({"by_group": None} | v, TIME_KINDS + ("by_group",), path, where + ".")
    else:
        extra = sorted(set(v) - set(TIME_KINDS + ("by_group",)))
        if extra:
            raise _fail(path, f"{where}.{extra[0]}", f"one of {list(TIME_KINDS + ('by_group',))} (unknown key)")
    top = tuple((k, _route_time(v[k], path, f"{where}.{k}")) for k in TIME_KINDS if k in v)
    groups = _group_keys(v.get("by_group", {}), path, f"{where}.by_group", TIME_KINDS)
    return top, tuple(sorted((g, tuple((k, _route_time(entry[k], path, f"{where}.by_group.{g}.{k}"))
                                       for k in TIME_KINDS if k in entry)) for g, entry in groups))


def _by_kv_dtype(v, path) -> tuple[tuple[str, KvDtypeSection], ...]:
    """``by_kv_dtype`` -> Calibration.by_kv_dtype: keys of ``SECTION_KV_DTYPES``, each section
    with its own date, command and source and some splits and/or time_model overrides."""
    if not isinstance(v, dict):
        raise _fail(path, "by_kv_dtype", 'a JSON object {"<KV dtype>": {...}}', v)
    out = []
    for name, sec in sorted(v.items()):
        where = f"by_kv_dtype.{name}"
        if name not in SECTION_KV_DTYPES:
            raise _fail(path, where, f"keys among {list(SECTION_KV_DTYPES)} (the top level holds "
                                     f"{' and '.join(TOP_KV_DTYPES)}'s constants)")
        out.append((name, _section(sec, path, where)))
    return tuple(out)


def _by_head_dim(v, path) -> tuple[tuple[int, KvDtypeSection], ...]:
    """``by_head_dim`` -> Calibration.by_head_dim: keys the decimal head dims of
    ``SECTION_HEAD_DIMS``, each a section as by_kv_dtype's."""
    if not isinstance(v, dict):
        raise _fail(path, "by_head_dim", 'a JSON object {"<head dim>": {...}}', v)
    out = []
    for key, sec in v.items():
        where = f"by_head_dim.{key}"
        if not (isinstance(key, str) and key.isdigit() and int(key) in SECTION_HEAD_DIMS and str(int(key)) == key):
            raise _fail(path, where, f"keys among {[str(d) for d in SECTION_HEAD_DIMS]} (the top level "
                                     f"holds D {CALIBRATION_HEAD_DIM}'s constants)")
        out.append((int(key), _section(sec, path, where)))
    return tuple(sorted(out))


def _section(sec, path, where: str) -> KvDtypeSection:
    """One by_kv_dtype / by_head_dim section: its own date, command and source and some splits
    and/or time_model overrides."""
    if not isinstance(sec, dict):
        raise _fail(path, where, f"a JSON object of {list(_SECTION_KEYS)}", sec)
    _take({"splits": None, "time_model": None} | sec, _SECTION_KEYS, path, where + ".")
    if "splits" not in sec and "time_model" not in sec:
        raise _fail(path, f"{where}.splits", "splits or time_model to be present (the section "
                                             "overrides nothing)")
    splits, split_groups = (), ()
    if "splits" in sec:
        sp, at = sec["splits"], f"{where}.splits"
        if not isinstance(sp, dict) or not sp:
            raise _fail(path, at, f"a non-empty object of some of {list(_SECTION_SPLIT_KEYS)}", sp)
        extra = sorted(set(sp) - set(_SECTION_SPLIT_KEYS))
        if extra:
            raise _fail(path, f"{at}.{extra[0]}", f"one of {list(_SECTION_SPLIT_KEYS)} (unknown key)")
        splits = tuple((k, _split_value(sp, k, path, at + ".")) for k in _SECTION_SPLIT_KEYS[:-1] if k in sp)
        split_groups = _by_group(sp["by_group"], path, f"{at}.by_group") if "by_group" in sp else ()
    times, time_groups = (_time_model(sec["time_model"], path, f"{where}.time_model", every_kind=False)
                          if "time_model" in sec else ((), ()))
    if not (splits or split_groups or times or time_groups):
        raise _fail(path, f"{where}.splits", "a constant to override (an empty by_group overrides "
                                             "nothing, and such a section could not be written back)")
    return KvDtypeSection(splits=splits, splits_by_group=split_groups, time_model=times,
                          time_model_by_group=time_groups, date=_date(sec, path, where + "."),
                          command=_str(sec, "command", path, where + "."),
                          provenance=_str(sec, "source", path, where + "."))


def _host_time(v, path) -> HostTime:
    """``host_time`` -> HostTime: every kind of ``TIME_KINDS`` with ``plan_us`` and ``run_us``
    (numbers >= 0), and the section's date, command and source."""
    keys = TIME_KINDS + ("date", "command", "source")
    if not isinstance(v, dict):
        raise _fail(path, "host_time", f"a JSON object of {list(keys)}", v)
    _take(v, keys, path, "host_time.")
    costs = []
    for kind in TIME_KINDS:
        entry, where = v[kind], f"host_time.{kind}"
        if not isinstance(entry, dict):
            raise _fail(path, where, f"a JSON object of {list(_HOST_KEYS)}", entry)
        _take(entry, _HOST_KEYS, path, where + ".")
        costs.append((kind, HostCost(**{k: _float(entry, k, path, where + ".", zero_ok=True)
                                        for k in _HOST_KEYS})))
    return HostTime(costs=tuple(costs), date=_date(v, path, "host_time."),
                    command=_str(v, "command", path, "host_time."),
                    provenance=_str(v, "source", path, "host_time."))


def _sharing(v, path) -> SharingCost:
    """``sharing`` -> SharingCost: ``l2_reread_cost`` (a number in (0, 1]), date, command,
    source."""
    if not isinstance(v, dict):
        raise _fail(path, "sharing", f"a JSON object of {list(_SHARING_KEYS)}", v)
    _take({"overhead_us": None} | v, _SHARING_KEYS + ("overhead_us",), path, "sharing.")
    cost = _float(v, "l2_reread_cost", path, "sharing.")
    if cost > 1.0:
        raise _fail(path, "sharing.l2_reread_cost", "a number in (0, 1] (a re-read costs at most "
                    "a first read)", cost)
    overhead = _float(v, "overhead_us", path, "sharing.", zero_ok=True) if "overhead_us" in v else None
    return SharingCost(l2_reread_cost=cost, date=_date(v, path, "sharing."),
                       command=_str(v, "command", path, "sharing."),
                       provenance=_str(v, "source", path, "sharing."), overhead_us=overhead)


def _date(obj, path, where="") -> str:
    date = _str(obj, "date", path, where)
    try:
        datetime.date.fromisoformat(date)
    except ValueError:
        raise _fail(path, where + "date", "an ISO date YYYY-MM-DD", date) from None
    return date


def calibration_from_dict(doc: Mapping, source: str = "<memory>") -> Calibration:
    """Validate a parsed schema-1 document and build a :class:`Calibration`.

    Raises
    ------
    CalibrationError
        naming ``source`` and the offending key.
    """
    path = source
    if not isinstance(doc, dict):
        raise CalibrationError(f"{path}: expected a JSON object at top level, got {type(doc).__name__}")
    if "schema" not in doc:
        raise _fail(path, "schema", f"it to be present (missing); this reader knows schema {SCHEMA}")
    if doc["schema"] != SCHEMA or isinstance(doc["schema"], bool):
        raise _fail(path, "schema", f"{SCHEMA} (unknown schema version)", doc["schema"])
    _take({k: None for k in _OPTIONAL_TOP_KEYS} | doc, _TOP_KEYS + _OPTIONAL_TOP_KEYS, path, "")

    sp = _dict(doc, "splits", path)
    _take({"cta_overhead_tiles": None, "co_resident_slowdown": None, "max_waves": None, "merge_free_slots": None,
           "wave_room_slots": None, "wave_room_tiles": None, "wave_room_chunk_tiles": None, "by_group": None,
           **sp},
          _SPLIT_KEYS, path, "splits.")
    splits = SplitPoints(
        bucket_ctas_per_sm=_float(sp, "bucket_ctas_per_sm", path, "splits."),
        workqueue_ctas_per_sm=_float(sp, "workqueue_ctas_per_sm", path, "splits."),
        min_split_tokens=_int(sp, "min_split_tokens", path, "splits."),
        cta_overhead_tiles=(_float(sp, "cta_overhead_tiles", path, "splits.", zero_ok=True)
                            if "cta_overhead_tiles" in sp else DEFAULT_CTA_OVERHEAD_TILES),
        co_resident_slowdown=(_float(sp, "co_resident_slowdown", path, "splits.")
                              if "co_resident_slowdown" in sp else DEFAULT_CO_RESIDENT_SLOWDOWN),
        max_waves=_int(sp, "max_waves", path, "splits.") if "max_waves" in sp else DEFAULT_MAX_WAVES,
        merge_free_slots=(_nonneg_int(sp, "merge_free_slots", path, "splits.")
                          if "merge_free_slots" in sp else 0),
        wave_room_slots=(_split_value(sp, "wave_room_slots", path, "splits.")
                         if "wave_room_slots" in sp else 0),
        wave_room_tiles=(_split_value(sp, "wave_room_tiles", path, "splits.")
                         if "wave_room_tiles" in sp else 0.0),
        wave_room_chunk_tiles=(_split_value(sp, "wave_room_chunk_tiles", path, "splits.")
                               if "wave_room_chunk_tiles" in sp else 0),
        by_group=_by_group(sp["by_group"], path) if "by_group" in sp else (),
    )

    fi = _dict(doc, "flashinfer", path)
    _take(fi, ("ctas_per_sm",), path, "flashinfer.")
    table = fi["ctas_per_sm"]
    if not isinstance(table, dict) or not table:
        raise _fail(path, "flashinfer.ctas_per_sm", 'a non-empty object {"<active>": ctas_per_sm}', table)
    pairs = []
    for k in table:
        if not re.fullmatch(r"[1-9][0-9]*", k):
            raise _fail(path, f"flashinfer.ctas_per_sm.{k}", "keys that are positive integers (active counts)")
        pairs.append((int(k), _float(table, k, path, "flashinfer.ctas_per_sm.")))

    ver = _dict(doc, "versions", path)
    _take(ver, _VERSION_KEYS, path, "versions.")
    versions = tuple((k, _str(ver, k, path, "versions.", nullable=True)) for k in _VERSION_KEYS)

    date = _date(doc, path)
    slug = _str(doc, "slug", path)
    if slugify(slug) != slug:
        raise _fail(path, "slug", f"a slug (lower-case words joined by '-'), e.g. {slugify(slug)!r}", slug)

    time_model, time_by_group = _time_model(doc["time_model"], path) if "time_model" in doc else ((), ())
    return Calibration(
        gpu=_str(doc, "gpu", path),
        slug=slug,
        sm_count=_int(doc, "sm_count", path),
        l2_bytes=_int(doc, "l2_bytes", path),
        beta_gbps=_float(doc, "beta_gbps", path),
        lambda_us=_float(doc, "lambda_us", path),
        lambda_graph_us=_float(doc, "lambda_graph_us", path),
        c_min=_float(doc, "c_min", path),
        splits=splits,
        flashinfer_ctas_per_sm=tuple(sorted(pairs)),
        versions=versions,
        date=date,
        seed=_int(doc, "seed", path, positive=False),
        command=_str(doc, "command", path),
        provenance=_str(doc, "source", path),
        source=str(source),
        time_model=time_model,
        time_model_by_group=time_by_group,
        by_kv_dtype=_by_kv_dtype(doc["by_kv_dtype"], path) if "by_kv_dtype" in doc else (),
        by_head_dim=_by_head_dim(doc["by_head_dim"], path) if "by_head_dim" in doc else (),
        host_time=_host_time(doc["host_time"], path) if "host_time" in doc else None,
        sharing=_sharing(doc["sharing"], path) if "sharing" in doc else None,
    )


def calibration_to_dict(cal: Calibration) -> dict:
    """The schema-1 document of ``cal`` (``source`` and ``fallback`` are not part of a file;
    ``time_model`` and ``by_kv_dtype`` only when the calibration has them, so older files
    round-trip unchanged). A :meth:`Calibration.for_kv_dtype` view is refused (ValueError): it
    has lost its file's other sections."""
    if cal.kv_dtype is not None or cal.head_dim is not None:
        view = cal.kv_dtype if cal.kv_dtype is not None else f"D {cal.head_dim}"
        raise ValueError(f"calibration_to_dict: this is the {view} view of {cal.source} "
                         "(Calibration.for_kv_dtype / for_head_dim), not a file's calibration")
    return {
        "schema": SCHEMA,
        "gpu": cal.gpu,
        "slug": cal.slug,
        "sm_count": cal.sm_count,
        "l2_bytes": cal.l2_bytes,
        "beta_gbps": cal.beta_gbps,
        "lambda_us": cal.lambda_us,
        "lambda_graph_us": cal.lambda_graph_us,
        "c_min": cal.c_min,
        "splits": cal.splits.to_dict(),
        "flashinfer": {"ctas_per_sm": {str(a): c for a, c in cal.flashinfer_ctas_per_sm}},
        "versions": dict(cal.versions),
        "date": cal.date,
        "seed": cal.seed,
        "command": cal.command,
        "source": cal.provenance,
    } | ({"time_model": _time_model_dict(cal)} if cal.time_model else {}) | (
        {"by_kv_dtype": {n: sec.to_dict() for n, sec in cal.by_kv_dtype}} if cal.by_kv_dtype else {}) | (
        {"by_head_dim": {str(d): sec.to_dict() for d, sec in cal.by_head_dim}} if cal.by_head_dim else {}) | (
        {"host_time": cal.host_time.to_dict()} if cal.host_time is not None else {}) | (
        {"sharing": cal.sharing.to_dict()} if cal.sharing is not None else {})


def with_kv_dtype_section(cal: Calibration, name: str, section: KvDtypeSection) -> Calibration:
    """``cal`` (a file's calibration) with its ``by_kv_dtype`` section of ``name`` added or
    replaced; every other constant, the other sections included, unchanged."""
    if name not in SECTION_KV_DTYPES:
        raise ValueError(f"with_kv_dtype_section: {name!r}: expected one of {list(SECTION_KV_DTYPES)}")
    if cal.kv_dtype is not None:
        raise ValueError(f"with_kv_dtype_section: this is the {cal.kv_dtype} view, not a file's calibration")
    return attrs.evolve(cal, by_kv_dtype=tuple(sorted({**dict(cal.by_kv_dtype), name: section}.items())))


def with_head_dim_section(cal: Calibration, head_dim: int, section: KvDtypeSection) -> Calibration:
    """``cal`` (a file's calibration) with its ``by_head_dim`` section of ``head_dim`` added or
    replaced; every other constant, the other sections included, unchanged."""
    if head_dim not in SECTION_HEAD_DIMS:
        raise ValueError(f"with_head_dim_section: {head_dim!r}: expected one of {list(SECTION_HEAD_DIMS)}")
    if cal.kv_dtype is not None or cal.head_dim is not None:
        raise ValueError("with_head_dim_section: this is a resolved view, not a file's calibration")
    return attrs.evolve(cal, by_head_dim=tuple(sorted({**dict(cal.by_head_dim), head_dim: section}.items())))


def _time_model_dict(cal: Calibration) -> dict:
    d = {k: t.to_dict() for k, t in cal.time_model}
    if cal.time_model_by_group:
        d["by_group"] = {str(g): {k: t.to_dict() for k, t in kinds} for g, kinds in cal.time_model_by_group}
    return d


def load_calibration(path) -> Calibration:
    """Read and validate one calibration file.

    Raises
    ------
    CalibrationError
        for unreadable files, invalid JSON (with line and column), and any schema violation.
    """
    path = pathlib.Path(path)
    try:
        text = path.read_text(encoding="utf-8")
    except OSError as e:
        raise CalibrationError(f"{path}: cannot read calibration file: {e.strerror or e}") from None
    try:
        doc = json.loads(text)
    except json.JSONDecodeError as e:
        raise CalibrationError(f"{path}: invalid JSON at line {e.lineno} column {e.colno}: {e.msg}") from None
    return calibration_from_dict(doc, source=str(path))


def save_calibration(cal: Calibration, path) -> None:
    """Write ``cal`` as schema-1 JSON; ``load_calibration(path)`` gives it back field for field."""
    text = json.dumps(calibration_to_dict(cal), indent=2) + "\n"
    pathlib.Path(path).write_text(text, encoding="utf-8")


# ----------------------------------------------------------------------------- finding a file


def slugify(device_name: str) -> str:
    """File key of a device name: ``"NVIDIA H200"`` -> ``"nvidia-h200"``.

    Lower-case; every run of characters other than ``[a-z0-9]`` becomes one ``-``; no leading or
    trailing ``-``. ``"NVIDIA GeForce RTX 3060"`` -> ``"nvidia-geforce-rtx-3060"``.
    """
    slug = re.sub(r"[^a-z0-9]+", "-", device_name.lower()).strip("-")
    if not slug:
        raise ValueError(f"slugify: device name {device_name!r} has no letters or digits")
    return slug


def calibration_dirs() -> list[pathlib.Path]:
    """Directories searched for ``*.json``, first match wins.

    ``$PKVRT_CALIBRATION_DIR`` if set; then ``<repo>/calibration`` when running from a checkout
    (the directory next to ``pkvrt/`` holding ``pyproject.toml``), else the installed copy
    ``pkvrt/_data/calibration``. A set ``$PKVRT_CALIBRATION_DIR`` that is not a directory is an
    error (CalibrationError naming it), not a silent fallback.
    """
    dirs = []
    if os.environ.get(ENV_DIR):
        env_dir = pathlib.Path(os.environ[ENV_DIR])
        if not env_dir.is_dir():
            raise CalibrationError(f"{ENV_DIR}={env_dir}: expected an existing directory of "
                                   "calibration files; unset it to use the shipped ones")
        dirs.append(env_dir)
    pkg, repo = PACKAGE, CHECKOUT
    if (repo / "calibration").is_dir() and (repo / "pyproject.toml").is_file():
        dirs.append(repo / "calibration")
    else:
        dirs.append(pkg / "_data" / "calibration")
    return dirs


def _files(dirs: Iterable[pathlib.Path]) -> list[pathlib.Path]:
    return [f for d in dirs if d.is_dir() for f in sorted(d.glob("*.json"))]


def find_calibration(device_name: str | None) -> Calibration:
    """The calibration whose slug is ``slugify(device_name)``, else the seed profile.

    A file that matches by name (``<slug>.json``) or by its ``slug`` field is used. Without one
    (or with ``device_name=None``: no GPU), warns naming the device and returns the seed RTX 3060
    profile with ``fallback=True`` (``source`` is the seed file's path, so results files can
    still record its hash).

    Raises
    ------
    CalibrationError
        if the matching file is malformed, or no seed profile is found for the fallback.
    """
    dirs = calibration_dirs()
    if device_name is not None:
        want = slugify(device_name)
        for f in _files(dirs):
            if f.stem == want:
                cal = load_calibration(f)
                if cal.slug != want:
                    raise _fail(f, "slug", f"{want!r} to match the file name", cal.slug)
                return cal
        for f in _files(dirs):
            try:
                doc = json.loads(f.read_text(encoding="utf-8"))
            except (OSError, json.JSONDecodeError):
                continue  # a broken file of another GPU must not block this one
            if isinstance(doc, dict) and doc.get("slug") == want:
                return load_calibration(f)
    for d in dirs:
        seed = d / f"{DEFAULT_SLUG}.json"
        if seed.is_file():
            who = "no CUDA device" if device_name is None else f"device {device_name!r} (slug {slugify(device_name)!r})"
            warnings.warn(
                f"pkvrt: no calibration file for {who} in {[str(x) for x in dirs]}; using the seed "
                f"RTX 3060 profile {seed} as a fallback. Run `pkvrt calibrate` on this GPU.",
                stacklevel=2,
            )
            return attrs.evolve(load_calibration(seed), fallback=True)
    raise CalibrationError(f"no {DEFAULT_SLUG}.json (the default calibration) in {[str(x) for x in dirs]}")


def beta_gbps_for(device_name: str) -> float | None:
    """The streaming-read rate (GB/s, ``beta_gbps``) of the calibration file
    :func:`find_calibration` finds for ``device_name``; None where it finds none (it would fall
    back to the seed profile, whose rate is another GPU's). Quiet: no fallback warning."""
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        cal = find_calibration(device_name)
    return None if cal.fallback else cal.beta_gbps


# ----------------------------------------------------------------------------- fitting


def fit_split_points(measurements, *, sm_count: int, num_kv_heads: int, tile_tokens: int = 32,
                     tolerance: float = 0.02) -> dict:
    """Pick the split operating points from timed candidate splits.

    Parameters
    ----------
    measurements : iterable of mappings
        one record per timed (case, split): ``case`` (str), ``rows`` (active rows), ``context``
        (tokens per row), ``splits`` (S), ``us`` (median time); optional ``route``
        ("bucket" | "workqueue"; absent: rows == 1 -> bucket, rows > 1 -> workqueue, the paper's
        operating points B1 bucket, B8 workqueue).
    sm_count, num_kv_heads : int
        the GPU's SMs and the KV heads of the timed shape (CTAs = rows * num_kv_heads * S).
    tile_tokens : int
        ``min_split_tokens`` is a multiple of it.
    tolerance : float
        a split within this fraction of a case's best time counts as optimal.

    Returns
    -------
    dict
        ``{"bucket_ctas_per_sm", "workqueue_ctas_per_sm", "min_split_tokens"}`` (a ``splits``
        object for the calibration file); a route with no records is left out.

    Rule. Per case, the chosen split is the *smallest* S whose time is within ``tolerance`` of
    the case's best (fewer splits = less merge traffic; timings closer than 2% are noise). It
    becomes CTA work per SM ``rows*num_kv_heads*S/sm_count``; a route's operating point is the
    median over its cases. ``min_split_tokens`` is the shortest split (context/S) any chosen
    point uses, rounded down to a tile multiple: the planner never cuts shorter splits than
    were measured to pay off. Example (RTX 3060, 28 SMs, 8 KV heads): B1 32K times
    {28: 452, 32: 441, 36: 447} µs -> best 441, within 2% (449.8) are 32 and 36 -> S=32 ->
    1*8*32/28 = 9.14 CTAs/SM; 32768/32 = 1024 tokens per split.
    """
    cases: dict[str, list[Mapping]] = {}
    for i, rec in enumerate(measurements):
        for key, kind in (("case", str), ("rows", int), ("context", int), ("splits", int), ("us", (int, float))):
            if key not in rec or not isinstance(rec[key], kind) or isinstance(rec[key], bool):
                raise ValueError(f"fit_split_points: measurements[{i}][{key!r}]: expected {kind}, got {rec.get(key)!r}")
        if rec["rows"] < 1 or rec["context"] < 1 or rec["splits"] < 1 or not rec["us"] > 0:
            raise ValueError(f"fit_split_points: measurements[{i}]: rows, context, splits, us must be positive: {dict(rec)}")
        cases.setdefault(rec["case"], []).append(rec)
    if not cases:
        raise ValueError("fit_split_points: measurements is empty")

    per_route: dict[str, list[float]] = {}
    tokens_per_split = []
    for name, recs in cases.items():
        shape = {(r["rows"], r["context"], r.get("route")) for r in recs}
        if len(shape) != 1:
            raise ValueError(f"fit_split_points: case {name!r} mixes rows/context/route: {sorted(shape, key=str)}")
        rows, context, route = shape.pop()
        route = route or ("bucket" if rows == 1 else "workqueue")
        if route not in ("bucket", "workqueue"):
            raise ValueError(f"fit_split_points: case {name!r}: route must be 'bucket' or 'workqueue', got {route!r}")
        best = min(r["us"] for r in recs)
        s = min(r["splits"] for r in recs if r["us"] <= best * (1 + tolerance))
        per_route.setdefault(route, []).append(rows * num_kv_heads * s / sm_count)
        tokens_per_split.append(context // s)

    out: dict = {f"{r}_ctas_per_sm": float(_median(v)) for r, v in sorted(per_route.items())}
    out["min_split_tokens"] = max(tile_tokens, min(tokens_per_split) // tile_tokens * tile_tokens)
    return out


PARTITION_SLOWDOWNS = tuple(i / 8 for i in range(8, 25))    # co_resident_slowdown tried: 1 .. 3 by 1/8
PARTITION_OVERHEADS = tuple(i / 2 for i in range(33))        # cta_overhead_tiles tried: 0 .. 16 by 1/2
PARTITION_MIN_TOKENS = (32, 64, 128, 256)                    # min_split_tokens tried


def fit_partition(cases, *, sm_count: int, resident: int, num_kv_heads: int, splits,
                  tile_tokens: int = 32, slowdowns=PARTITION_SLOWDOWNS, overheads=PARTITION_OVERHEADS,
                  min_tokens=PARTITION_MIN_TOKENS, max_waves: int = DEFAULT_MAX_WAVES,
                  wave_room: bool = True) -> tuple[dict, dict]:
    """Fit the balanced partition's constants to timed partitions of calibration steps.

    Parameters
    ----------
    cases : mapping case name -> ``(seq_lens, {s: us})`` or ``(seq_lens, {s: us}, bounds)``: the
        step's lengths and the measured time of the partition cut at every candidate ``s``
        (``planner.plan_workqueue(..., longest_splits=s)``) of a route whose split bounds are
        ``bounds`` (default ``splits``). The workqueue and fused routes share the constants, so
        both routes' sweeps are passed, each step once per route.
    sm_count, resident : the GPU's SMs and the decode kernel's resident CTAs per SM (measured
        with the driver's occupancy query). max_waves : the partition's CTA cap (not fitted).
    num_kv_heads : the timed shape's KV heads. splits : the default SplitBounds.

    Returns
    -------
    (points, regret) : points ``{"workqueue_ctas_per_sm", "co_resident_slowdown",
        "cta_overhead_tiles", "min_split_tokens", "wave_room_slots", "wave_room_tiles",
        "wave_room_chunk_tiles"}`` (a ``splits`` update; the last three from
        :func:`fit_wave_room`, left out with ``wave_room`` False); regret ``{case: us of the
        rule's pick / best us}`` at those points.

    Rule: every combination of the grids is scored by the geometric mean over the cases of how
    much slower the partition it picks is than the fastest partition measured, then by the
    worst case; a pick that was not timed scores as the slowest time of its case. The best
    score is usually a plateau of combinations that pick the same cuts on every case; of it the
    combination farthest from any worse one wins (Chebyshev distance in grid steps over the
    three grids), so that a step the calibration did not time, whose best cut lies between the
    timed ones, is cut inside the plateau rather than at its edge (benches/NOTES.md,
    the calibration's fit). Ties: the smallest overhead, then slowdown, then the largest minimum split.
    A plateau one grid step thick along any of the three grids has every point one step from a
    worse one, so there the ties decide (the smallest overhead: the plateau's edge); of the H200
    file's fits only fp16 G = 4's is interior (G = 8, G = 1 and FP8 are one minimum split thick).
    """
    from pkvrt.policy import planner  # planner imports this module: late import keeps them acyclic

    if not cases:
        raise ValueError("fit_partition: no cases")
    base = Calibration(gpu="fit", slug="fit", sm_count=sm_count, l2_bytes=1, beta_gbps=1.0,
                       lambda_us=1.0, lambda_graph_us=1.0, c_min=1.0,
                       splits=SplitPoints(1.0, float(resident), tile_tokens), flashinfer_ctas_per_sm=((1, 1.0),),
                       versions=(), date="2026-12-01", seed=0, command="", provenance="")
    steps = {}
    for name, case in cases.items():
        if len(case) not in (2, 3):
            raise ValueError(f"fit_partition: case {name!r}: expected (seq_lens, times[, bounds]), got {len(case)} items")
        seq, times = case[0], case[1]
        if not times or not all(isinstance(t, (int, float)) and t > 0 for t in times.values()):
            raise ValueError(f"fit_partition: case {name!r}: expected positive times per candidate, got {times!r}")
        bounds = case[2] if len(case) == 3 else splits
        steps[name] = (np.asarray(seq, dtype=np.int64), times, bounds, min(times.values()), max(times.values()))
    scored = {}   # (slowdown index, overhead index, min-split index) -> (score, worst, regret)
    for i, k in enumerate(slowdowns):
        for j, f in enumerate(overheads):
            for n, m in enumerate(min_tokens):
                cal = attrs.evolve(base, splits=SplitPoints(1.0, float(resident), m, f, k, max_waves))
                regret = {}
                for name, (seq, times, bounds, fastest, slowest) in steps.items():
                    s = planner.balanced_partition(seq, num_kv_heads=num_kv_heads, splits=bounds,
                                                   cal=cal, tile_tokens=tile_tokens).longest_splits
                    regret[name] = times.get(s, slowest) / fastest
                score = float(np.exp(np.mean(np.log(list(regret.values())))))
                scored[i, j, n] = (round(score, 6), round(max(regret.values()), 6), regret)
    best = min(v[:2] for v in scored.values())
    plateau = [ix for ix, v in scored.items() if v[:2] == best]
    worse = np.array([ix for ix, v in scored.items() if v[:2] != best]).reshape(-1, 3)

    def margin(ix) -> float:
        return float(np.abs(worse - np.array(ix)).max(axis=1).min()) if len(worse) else float("inf")

    i, j, n = min(plateau, key=lambda ix: (-margin(ix), overheads[ix[1]], slowdowns[ix[0]], -min_tokens[ix[2]]))
    points = {"workqueue_ctas_per_sm": float(resident), "co_resident_slowdown": slowdowns[i],
              "cta_overhead_tiles": overheads[j], "min_split_tokens": min_tokens[n]}
    if not wave_room:
        return points, scored[i, j, n][2]
    cal = attrs.evolve(base, splits=SplitPoints(1.0, float(resident), min_tokens[n], overheads[j],
                                                slowdowns[i], max_waves))
    room, regret = fit_wave_room(steps, cal, num_kv_heads=num_kv_heads, tile_tokens=tile_tokens)
    return points | room, regret


# The room charge tried (fit_wave_room): slots that a last wave should leave free, the charge,
# in tile-times, of a last wave that leaves none, and the longest chunk (tiles) a charged cut has
WAVE_ROOM_SLOTS = (8, 16, 24, 32, 40, 48, 64, 96, 132)
WAVE_ROOM_TILES = (4.0, 8.0, 12.0, 16.0, 24.0, 32.0, 48.0, 64.0, 96.0)
WAVE_ROOM_CHUNKS = (4, 6, 8, 10, 12, 16, 24, 32, 1 << 20)


def fit_wave_room(steps: dict, cal: "Calibration", *, num_kv_heads: int, tile_tokens: int = 32,
                  slots=WAVE_ROOM_SLOTS, tiles=WAVE_ROOM_TILES, chunks=WAVE_ROOM_CHUNKS) -> tuple[dict, dict]:
    """The second stage of :func:`fit_partition`: with its other constants fixed (``cal``), the
    room charge (``splits.wave_room_slots``, ``wave_room_tiles``, ``wave_room_chunk_tiles``;
    ``planner.partition_choice``) of least geometric-mean regret over ``steps`` (name ->
    (lengths, {s: us}, bounds, fastest, slowest)), then least worst regret; ties (a plateau of
    charges that pick the same cuts) to no charge, then the smallest charge, then the fewest
    slots, then the shortest chunk. Returns ({"wave_room_slots", "wave_room_tiles",
    "wave_room_chunk_tiles"}, {case: regret} at them).

    Why a second stage and not a fifth grid of the first: the charge decides between cuts the
    makespan calls nearly equal, so it cannot stand in for the other constants, and fitting it
    jointly would multiply the first stage's ~2 200 combinations by 730."""
    from pkvrt.policy import planner

    def score(k: int, f: float, n: int):
        c = attrs.evolve(cal, splits=attrs.evolve(cal.splits, wave_room_slots=k, wave_room_tiles=f,
                                                  wave_room_chunk_tiles=n))
        regret = {}
        for name, (seq, times, bounds, fastest, slowest) in steps.items():
            s = planner.balanced_partition(seq, num_kv_heads=num_kv_heads, splits=bounds, cal=c,
                                           tile_tokens=tile_tokens).longest_splits
            regret[name] = times.get(s, slowest) / fastest
        return (round(float(np.exp(np.mean(np.log(list(regret.values()))))), 6), round(max(regret.values()), 6)), regret

    best_key, best = score(0, 0.0, 0), (0, 0.0, 0)
    for f in tiles:
        for k in slots:
            for n in chunks:
                key = score(k, f, n)
                if key[0] < best_key[0]:
                    best_key, best = key, (k, f, n)
    return {"wave_room_slots": best[0], "wave_room_tiles": best[1], "wave_room_chunk_tiles": best[2]}, best_key[1]


def _median(xs: list[float]) -> float:
    xs = sorted(xs)
    n = len(xs)
    return xs[n // 2] if n % 2 else 0.5 * (xs[n // 2 - 1] + xs[n // 2])
