"""Calibration sweeps read back: the time model's fit, its error per route, the gates they measured.

``pkvrt calibrate --raw PATH`` keeps every timed configuration as the rows of a results file
(``benches/results/h200/calibrate-sweeps.json``): ``engine`` ("pkvrt-bucket", "pkvrt-workqueue",
"pkvrt-fused", "flashinfer-tc", "flashinfer-cuda"), ``case`` (a :func:`pkvrt.tools.calibrate.
calibration_steps` name, ``B<a>-32K`` for FlashInfer's active sweep, ``-G1`` / ``-G8`` appended
at other group sizes than 4), ``splits`` (the bucket's S, or the partition's cut: the longest
row's split count), ``median_us`` and ``kv_dtype`` (the K/V cache's routes.toml name; absent
in files written before FP8 calibration: "float16"). Everything here is a pure function of those
rows, a calibration and routes.toml, so it runs on a CPU: ``pkvrt calibrate`` calls it on the
rows it just measured, ``benches/cost_model_error.py`` on a file.

- :func:`read_rows`: rows of one KV dtype -> :class:`Timed` (one route kind on one step at one G);
- :func:`fit_partitions`: the balanced partition's constants per G (``fit_partition``);
- :func:`fit_time_model`: the measured model's constants per G and route kind;
- :func:`error_rows` / :func:`format_errors`: measured vs predicted at the cut the planner picks;
- :func:`suggest_gates`: where each route beat FlashInfer, as a routes.toml snippet that is
  printed or written, never applied.

Every function takes a file's calibration and reads each step with the view of its KV dtype and
group size (``cal.for_kv_dtype(t.kv_dtype).for_group(t.group)``); :func:`with_partitions` and
:func:`with_time_model` write a 16-bit fit to the top level, an FP8 fit to its ``by_kv_dtype``
section.
"""

from __future__ import annotations

import datetime
import re
import textwrap

import attrs
import numpy as np

from pkvrt._buildspec import TILE_TOKENS
from pkvrt.policy import calibration as calib
from pkvrt.policy.costmodel import fit_route_time, measured_us, predict_route_us, route_groups
from pkvrt.policy.planner import (balanced_partition, bucket_from_checked,
                                  flashinfer_counters_from_checked, fused_counters,
                                  workqueue_from_checked)
from pkvrt.policy.registry import KV_DTYPES

SHAPE = dict(num_qo_heads=32, head_dim=128)   # pkvrt calibrate's (group_heads), fp16 q
ENGINE_KIND = {"pkvrt-bucket": "bucket", "pkvrt-workqueue": "workqueue", "pkvrt-fused": "fused",
               "flashinfer-tc": "flashinfer", "flashinfer-cuda": "flashinfer"}
NEAR_BEST = 1.03   # a cut within 3 % of its step's fastest is fitted beside the planned one
# The planned cut's weight in the time-model fit (a near-best cut's: 1). The router predicts a
# step at its planned cut, so that is the time the fit must get right; the near-best cuts keep the
# model's shape (tail, split terms) honest. Weight 30 (2026-12-02, calibrate-sweeps.json, worst
# error at the planned cut, G 4 / 1 / 8 fused, workqueue): weight 1 5.4 5.3 / 4.9 7.4 / 11.3 15.4 %,
# 3: 4.0 4.9 / 4.4 7.0 / 11.0 14.2, 30: 2.3 4.7 / 3.8 5.9 / 8.9 12.7, 100: 2.3 4.7 / 3.5 5.4 /
# 7.9 12.9 (benches/NOTES.md, "The time model: the planned cut weighted"). Those are least-squares
# numbers; since 2026-12-03 (8a7d033) the fit minimises the largest weighted error, where weight 30 lets a near-best cut bind only
# at 30 times the planned cut's error: the near-best cuts keep little of the shape (their worst
# error on the H200 sweeps, G 1 fused 4.2 -> 7.9 %, workqueue 5.7 -> 7.7 %). What the weight is
# for, the planned cut on steps timed again, still wants 30 under the max criterion (2026-12-03,
# 8135ddc, benches/NOTES.md "Fit weight, checked across runs": fitted on one calibration run of the
# H200, the worst planned-cut error on another run of the same steps, fp16 G 1 / 4 / 8: 6.0-6.2 %
# at weights 10 to 1000, 7.7 % at 5, 8.3-9.4 % at 1 and 3; FP8 G 4: 3.4-4.8 % at 5 to 1000, 5.1-7.7 %
# at 1 and 3). The runs' own measured times moved by up to 5.8 % between them.
PLANNED_WEIGHT = 30.0
FI_CONTEXT = 32768
PARTITION_KINDS = ("workqueue", "fused")   # the balanced partition's routes: one set of constants


@attrs.frozen(eq=False)
class Timed:
    """One route kind timed on one calibration step at one group size.

    times : {cut: µs}; the cut is the bucket's S or the partition's longest-row split count;
        FlashInfer has one entry, cut 0 (its faster path: tensor-core or CUDA-core, each the
        median of its measurements).
    kv_dtype : the K/V cache's dtype (routes.toml name).
    """

    kind: str
    case: str
    group: int
    seq: np.ndarray
    times: dict
    kv_dtype: str = "float16"

    def view(self, cal: calib.Calibration) -> calib.Calibration:
        """``cal`` (a file's calibration) as a Router of this step's KV dtype and G sees it."""
        return cal.for_kv_dtype(self.kv_dtype).for_group(self.group)

    @property
    def shape(self) -> dict:
        return group_shape(self.group, self.kv_dtype)


def case_group(case: str) -> tuple[str, int]:
    """``"bimodal-B8-seed20260622-G1"`` -> ``("bimodal-B8-seed20260622", 1)``; no suffix: G 4."""
    m = re.fullmatch(r"(.+)-G([0-9]+)", case)
    return (m.group(1), int(m.group(2))) if m else (case, 4)


def step_lengths(case: str, kind: str, seed: int) -> np.ndarray | None:
    """seq_lens of a calibration step (int64 [B]) by its base name: the bucket steps for the
    bucket route, the partition steps for the others, ``B<a>-32K`` for FlashInfer's active sweep;
    None for an unknown name."""
    from pkvrt.tools.calibrate import calibration_steps   # calibrate imports this module

    want = ("bucket",) if kind == "bucket" else ("workqueue",)
    for name, k, seq in calibration_steps(seed):
        if name == case and k in want:
            return seq.astype(np.int64)
    m = re.fullmatch(r"B([0-9]+)-32K", case)
    if kind == "flashinfer" and m:
        return np.full(int(m.group(1)), FI_CONTEXT, dtype=np.int64)
    return None


def read_rows(rows, seed: int = 20260622, kv_dtype: str = "float16") -> list[Timed]:
    """Group the timed rows of ``kv_dtype`` caches in a calibrate-sweeps file by (route kind,
    step, G).

    Rows of other engines, another KV dtype or another head dim than D 128 (a ``--head-dim``
    run's, whose time model is not fitted), and cases that are no calibration step of ``seed``,
    are skipped.
    """
    if kv_dtype not in KV_DTYPES:
        raise ValueError(f"read_rows: kv_dtype {kv_dtype!r}: expected one of {', '.join(KV_DTYPES)}")
    acc: dict = {}
    for r in rows:
        kind = ENGINE_KIND.get(r.get("engine"))
        if (kind is None or not isinstance(r.get("median_us"), (int, float))
                or r.get("kv_dtype", "float16") != kv_dtype
                or r.get("head_dim", SHAPE["head_dim"]) != SHAPE["head_dim"]):
            continue
        base, g = case_group(r["case"])
        g = int(r.get("group", g))
        cut = int(r.get("splits", 0)) if kind != "flashinfer" else r["engine"]
        acc.setdefault((kind, base, g), {}).setdefault(cut, []).append(float(r["median_us"]))
    out = []
    for (kind, base, g), by_cut in sorted(acc.items(), key=lambda kv: (kv[0][2] != 4, kv[0][2], kv[0])):
        seq = step_lengths(base, kind, seed)
        if seq is None:
            continue
        med = {c: float(np.median(v)) for c, v in by_cut.items()}
        times = {0: min(med.values())} if kind == "flashinfer" else med
        out.append(Timed(kind=kind, case=base, group=g, seq=seq, times=times, kv_dtype=kv_dtype))
    return out


def group_heads(group: int) -> tuple[int, int]:
    """``(H_q, H_kv)`` that ``pkvrt calibrate`` times at ``group`` query heads per KV head: H_q
    32 over H_kv 32 / G where G divides 32 (G 4: 32 / 8, the file's top level; G 1: 32 / 32; G 8:
    32 / 4); otherwise H_kv 8 and H_q 8 G, the shape of the models with such a group (G 3:
    Llama-3.2-3B's 24 / 8; G 5: Qwen2.5-14B's 40 / 8; G 7: 56 / 8). Raises ValueError outside
    the kernels' group sizes."""
    from pkvrt._buildspec import GROUP_SIZES

    if isinstance(group, bool) or not isinstance(group, int) or group not in GROUP_SIZES:
        raise ValueError(f"group size {group!r}: expected one of {GROUP_SIZES[0]}..{GROUP_SIZES[-1]} "
                         "(the kernels' group sizes)")
    hq = SHAPE["num_qo_heads"]
    return (hq, hq // group) if hq % group == 0 else (8 * group, 8)


def group_shape(group: int, kv_dtype: str = "float16") -> dict:
    """The timed shape at ``group`` query heads per KV head (:func:`group_heads`), D 128, and
    the bytes of one K/V element of ``kv_dtype`` (2 for fp16, 1 for FP8)."""
    return dict(num_kv_heads=group_heads(group)[1], head_dim=SHAPE["head_dim"],
                dtype_bytes=KV_DTYPES[kv_dtype])


def route_of_kind(registry, kind: str):
    """The routes.toml route that a sweep of ``kind`` timed: the device-planning route for its
    kind, else the first non-ablation route of that kind, else the first; None if none."""
    if kind == "flashinfer":
        return registry.baseline
    try:
        dp = registry.device_planning_route()
    except KeyError:
        dp = None
    if dp is not None and dp.kind == kind:
        return dp
    same = [r for r in registry.routes if r.kind == kind]
    return ([r for r in same if not r.ablation] or same or [None])[0]


def planned_cut(t: Timed, route, cal: calib.Calibration) -> int:
    """The cut the planner picks for ``t``'s step with ``cal`` (a file's calibration, or
    ``t.view`` of it): the bucket's S (the largest, with several buckets) or the balanced
    partition's longest-row split count; 0 for FlashInfer."""
    if t.kind == "flashinfer":
        return 0
    cal = t.view(cal)
    if t.kind == "bucket":
        groups = route_groups("bucket", t.seq, cal, splits=route.splits, bucketing=route.bucketing,
                              coarse_lengths=route.coarse_lengths, **t.shape)
        return max(g.splits for g in groups)
    return balanced_partition(t.seq, num_kv_heads=t.shape["num_kv_heads"], splits=route.splits,
                              cal=cal, kind=t.kind).longest_splits


def _record(t: Timed, route, cal, cut: int) -> dict:
    """A fit record (``costmodel.fit_route_time``) of ``t`` at ``cut`` (``cal``: ``t.view``)."""
    kw = dict(splits=route.splits, bucketing=route.bucketing, coarse_lengths=route.coarse_lengths) \
        if t.kind != "flashinfer" else {}
    (g,) = route_groups(t.kind, t.seq, cal, longest_splits=cut or None, **kw, **t.shape)
    return dict(kv_bytes=g.kv_bytes, makespan_tiles=g.makespan_tiles, splits=g.splits, depth_tiles=g.depth_tiles,
                merge_per_sm=g.merge_states / cal.sm_count, room_tiles=g.room_tiles, us=t.times[cut])


# ----------------------------------------------------------------------------- fitting


def fit_partitions(timed, cal: calib.Calibration, registry, resident: dict | None = None) -> tuple[dict, dict]:
    """``calibration.fit_partition`` per G on the partition routes' sweeps (``timed``: of one KV
    dtype, :func:`read_rows`): the device-planning route's and the other partition kind's
    (workqueue or fused) when it was timed, which share the constants; with the resident CTAs per
    SM of ``resident`` ({G: the kernel's occupancy}, as ``pkvrt calibrate --raw`` records it),
    else of ``cal``'s view of that KV dtype, and its max_waves: ({G: points}, {G: {"case
    [kind]": regret}})."""
    points, regrets = {}, {}
    kinds = [k for k in PARTITION_KINDS if route_of_kind(registry, k) is not None]
    for g in sorted({t.group for t in timed if t.kind in kinds}):
        steps = [t for t in timed if t.kind in kinds and t.group == g]
        splits = cal.for_kv_dtype(steps[0].kv_dtype).splits
        points[g], regrets[g] = calib.fit_partition(
            partition_cases(steps, registry),
            sm_count=cal.sm_count,
            resident=(resident or {}).get(g) or max(1, round(splits.workqueue_ctas_per_sm)),
            num_kv_heads=steps[0].shape["num_kv_heads"], splits=registry.device_planning_route().splits,
            max_waves=splits.max_waves)
    return points, regrets


def partition_cases(steps, registry) -> dict:
    """``fit_partition``'s cases from timed partition steps (one G): ``"case [kind]"`` ->
    (lengths, {cut: us}, the split bounds of the route that was timed)."""
    routes = {k: route_of_kind(registry, k) for k in {t.kind for t in steps}}
    return {f"{t.case} [{t.kind}]": (t.seq, t.times, routes[t.kind].splits) for t in steps
            if routes[t.kind] is not None}   # a kind routes.toml has no route for: not fitted


def kv_dtype_section(cal: calib.Calibration, kv_dtype: str) -> calib.KvDtypeSection:
    """``cal``'s ``by_kv_dtype`` section of ``kv_dtype``, or a new empty one dated today (its
    command and source to be filled in before it is saved)."""
    return dict(cal.by_kv_dtype).get(kv_dtype) or calib.KvDtypeSection(date=datetime.date.today().isoformat())


def with_partitions(cal: calib.Calibration, points: dict, kv_dtype: str = "float16") -> calib.Calibration:
    """``cal`` with ``fit_partitions``' points: G 4 at the top level, the others in by_group;
    those of the ``by_kv_dtype`` section of an FP8 ``kv_dtype`` (its other keys kept)."""
    top = points.get(4, {})
    order = [a.name for a in attrs.fields(calib.SplitPoints)]   # the file's key order
    by_group = tuple(sorted((g, tuple((k, p[k]) for k in order if k in p)) for g, p in points.items() if g != 4))
    if kv_dtype in calib.TOP_KV_DTYPES:
        return attrs.evolve(cal, splits=attrs.evolve(cal.splits, by_group=by_group, **top))
    sec = kv_dtype_section(cal, kv_dtype)
    merged = dict(sec.splits) | top
    return calib.with_kv_dtype_section(cal, kv_dtype, attrs.evolve(
        sec, splits=tuple((k, merged[k]) for k in order if k in merged), splits_by_group=by_group))


def fit_records(timed, cal: calib.Calibration, registry, kind: str, group: int) -> list[dict]:
    """What :func:`fit_time_model` fits for ``kind`` at ``group``: every step's planned cut
    (when it was timed; ``weight`` PLANNED_WEIGHT) and every cut within NEAR_BEST of that step's
    fastest (weight 1)."""
    route = route_of_kind(registry, kind)
    out = []
    for t in timed:
        if t.kind != kind or t.group != group:
            continue
        best = min(t.times.values())
        cuts = {c for c, us in t.times.items() if us <= NEAR_BEST * best}
        view = t.view(cal)
        p = planned_cut(t, route, view)
        if p in t.times:
            cuts.add(p)
        out += [dict(_record(t, route, view, c), weight=PLANNED_WEIGHT if c == p else 1.0)
                for c in sorted(cuts)]
    return out


def fit_time_model(timed, cal: calib.Calibration, registry) -> dict[int, dict[str, calib.RouteTime]]:
    """The measured model's constants per G and route kind, from the sweeps (``cal``: a file's
    calibration, whose view of each step's KV dtype and G gives beta, SMs and the partition
    constants the planner picks cuts with).

    Per G: the device-planning route's kind at that G (timed at every cut) gets every constant
    (``costmodel.fit_route_time``: the four, and depth_us, merge_us, room_us); a workqueue or
    fused kind also timed at every cut, and FlashInfer, every constant too (FlashInfer's records
    carry no depth, merge or room: those stay 0); the bucket route (three one-row steps at one
    planned S: they cannot separate more) gets read_scale and fixed_us by least squares, with
    tail_us and split_us of the device-planning route at that G (else at G 4; else of the other
    workqueue-or-fused kind). A kind with too few records at a G is left out of that G.
    """
    groups = sorted({t.group for t in timed}, key=lambda g: (g != 4, g))
    out: dict[int, dict] = {}
    for g in groups:
        dp_kind = registry.device_planning_route(group=g).kind   # routes.toml large_group
        fits = {}
        kinds = sorted({t.kind for t in timed if t.group == g}, key=lambda k: (k != dp_kind, k == "bucket", k))
        for kind in kinds:
            if route_of_kind(registry, kind) is None:
                continue
            recs = fit_records(timed, cal, registry, kind, g)
            shape = None
            if kind == "bucket":   # the device-planning kind's shape, else the other partition kind's
                ref = next((f.get(k) for f in (fits, out.get(4, {})) for k in (dp_kind, "fused", "workqueue")
                            if f.get(k) is not None), None)
                if ref is None:
                    continue
                shape = (ref.tail_us, ref.split_us)
            try:
                fits[kind] = fit_route_time(recs, beta_gbps=cal.beta_gbps, shape=shape)
            except ValueError:
                continue
        if fits:
            out[g] = fits
    return out


def format_time_model(fits: dict) -> str:
    """:func:`fit_time_model`'s constants as a table, one line per G and route kind."""
    from pkvrt.tools.calibrate import format_rows

    return format_rows(("G", "kind", "read_scale", "depth_us", "tail_us", "split_us", "merge_us", "room_us", "fixed_us"),
                       [(g, k, f"{t.read_scale:.4f}", f"{t.depth_us:.3f}", f"{t.tail_us:.4f}", f"{t.split_us:.4f}",
                         f"{t.merge_us:.4f}", f"{t.room_us:.4f}", f"{t.fixed_us:.3f}")
                        for g, kinds in sorted(fits.items()) for k, t in kinds.items()])


def rounded_kinds(kinds: dict) -> tuple:
    """{kind: RouteTime} of one G as a calibration's time-model entry: ((kind, RouteTime), ...)
    in TIME_KINDS order, each constant rounded as the files hold them."""
    return tuple((k, calib.RouteTime(read_scale=round(rt.read_scale, 4), tail_us=round(rt.tail_us, 4),
                                     split_us=round(rt.split_us, 4), fixed_us=round(rt.fixed_us, 3),
                                     depth_us=round(rt.depth_us, 4), merge_us=round(rt.merge_us, 4),
                                     room_us=round(rt.room_us, 4)))
                 for k, rt in ((k, kinds[k]) for k in calib.TIME_KINDS if k in kinds))


def with_time_model(cal: calib.Calibration, fits: dict, kv_dtype: str = "float16") -> calib.Calibration:
    """``cal`` with :func:`fit_time_model`'s constants, rounded: G 4 at the top level (every kind
    of ``TIME_KINDS`` required), the others in ``time_model.by_group`` (what they have); for an
    FP8 ``kv_dtype``, the time model of its ``by_kv_dtype`` section instead, replaced by the kinds
    fitted (FlashInfer is not timed with FP8 caches: its kind is the file's)."""
    top = rounded_kinds(fits.get(4, {}))
    by_group = tuple(sorted((g, rounded_kinds(f)) for g, f in fits.items() if g != 4 and f))
    if kv_dtype not in calib.TOP_KV_DTYPES:
        sec = attrs.evolve(kv_dtype_section(cal, kv_dtype), time_model=top, time_model_by_group=by_group)
        return calib.with_kv_dtype_section(cal, kv_dtype, sec)
    missing = [k for k in calib.TIME_KINDS if k not in dict(top)]
    if missing:
        raise ValueError(f"time model at G 4 lacks {missing}: every route kind must be timed")
    return attrs.evolve(cal, time_model=top, time_model_by_group=by_group)


# ----------------------------------------------------------------------------- errors


@attrs.frozen
class ErrorRow:
    """Measured vs predicted µs of one route kind on one step at one G, at the planned cut."""

    group: int
    kind: str
    route: str
    case: str
    cut: int
    measured_us: float | None   # None: the planned cut was not timed
    predicted_us: float
    roofline_us: float

    @property
    def error(self) -> float | None:
        return None if self.measured_us is None else self.predicted_us / self.measured_us - 1


def error_rows(timed, cal: calib.Calibration, registry, fits: dict | None = None) -> list[ErrorRow]:
    """Every timed step and route kind at the cut the planner picks: measured, predicted by the
    measured model (``fits``, per G and kind; default: ``cal``'s own time model, a kind missing
    at a G taking G 4's) and by the roofline of ``cal`` (c_min, flashinfer.ctas_per_sm)."""
    out = []
    for t in timed:
        route = route_of_kind(registry, t.kind)
        if route is None:
            continue
        cal_g = t.view(cal)
        rt = (fits.get(t.group, {}).get(t.kind) or fits.get(4, {}).get(t.kind)) if fits is not None \
            else cal_g.route_time(t.kind)
        if rt is None:
            continue
        cut = planned_cut(t, route, cal_g)
        shape = t.shape
        kw = dict(splits=route.splits, bucketing=route.bucketing, coarse_lengths=route.coarse_lengths) \
            if t.kind != "flashinfer" else {}
        groups = route_groups(t.kind, t.seq, cal_g, **kw, **shape)
        roof_cal = attrs.evolve(cal_g, time_model=())
        out.append(ErrorRow(group=t.group, kind=t.kind, route=route.name, case=t.case, cut=cut,
                            measured_us=t.times.get(cut),
                            predicted_us=measured_us(groups, rt, cal_g, graphs=True),
                            roofline_us=_roofline_us(t, route, roof_cal, shape)))
    return out


def _roofline_us(t: Timed, route, cal, shape) -> float:
    seq, hkv = t.seq, shape["num_kv_heads"]
    kw = dict(num_kv_heads=hkv, num_qo_heads=group_heads(t.group)[0], head_dim=shape["head_dim"],
              dtype_bytes=shape["dtype_bytes"], cal=cal, tile_tokens=TILE_TOKENS)
    if t.kind == "flashinfer":
        c = flashinfer_counters_from_checked(seq, num_kv_heads=hkv, head_dim=shape["head_dim"],
                                             dtype_bytes=shape["dtype_bytes"])
    elif t.kind == "bucket":
        c = bucket_from_checked(seq, splits=route.splits, bucketing=route.bucketing,
                                coarse_lengths=route.coarse_lengths, rows=False, **kw)
    else:
        c = workqueue_from_checked(seq, splits=route.splits, tasks=False, kind=t.kind, **kw)
        c = fused_counters(c) if t.kind == "fused" else c
    return predict_route_us(t.kind, seq, c, cal, graphs=True, num_kv_heads=hkv, head_dim=shape["head_dim"],
                            dtype_bytes=shape["dtype_bytes"], splits=route.splits)


def format_errors(rows: list[ErrorRow]) -> str:
    """The error table (one line per route kind, step and G) and a worst-error line per G and
    route: ``G 4 pkv_fused: max |error| 3.8 % over 11 steps (roofline 18.2 %)``."""
    from pkvrt.tools.calibrate import format_rows

    def pct(x):
        return "-" if x is None else f"{100 * x:+.1f}%"
    table = format_rows(
        ("G", "route", "case", "cut", "measured us", "predicted us", "error", "roofline us", "roofline error"),
        [(r.group, r.route, r.case, r.cut or "-", "not timed" if r.measured_us is None else f"{r.measured_us:.1f}",
          f"{r.predicted_us:.1f}", pct(r.error), f"{r.roofline_us:.1f}",
          pct(None if r.measured_us is None else r.roofline_us / r.measured_us - 1)) for r in rows])
    summary = []
    for key in dict.fromkeys((r.group, r.route) for r in rows):
        errs = [abs(r.error) for r in rows if (r.group, r.route) == key and r.error is not None]
        roof = [abs(r.roofline_us / r.measured_us - 1) for r in rows
                if (r.group, r.route) == key and r.measured_us is not None]
        if errs:
            summary.append(f"G {key[0]} {key[1]}: max |error| {100 * max(errs):.1f} % over {len(errs)} steps "
                           f"(roofline {100 * max(roof):.1f} %)")
    return table + "\n\n" + "\n".join(summary)


# ----------------------------------------------------------------------------- gates


def suggest_gates(timed, cal: calib.Calibration, registry, *, header: str = "") -> str:
    """The gates the sweeps measured, as a routes.toml snippet (TOML with comments).

    A PersistentKV route *won* a calibration step at G when FlashInfer's measured time there
    (its faster path) over the route's, at the cut the planner picks, reached the route's
    promotion margin (routes.toml ``margin``). Per route: the group sizes where it won a step,
    the shortest longest-context among the steps it won (``min_context``) and the active rows
    of those steps (``min_active`` .. ``max_active``), with every step and ratio in comments
    (a step lost inside the range is named: gates cannot leave holes). Steps without a
    FlashInfer time at that G give no verdict. Nothing is applied: the text is for a person.
    """
    fi = {(t.case, t.group): t.times[0] for t in timed if t.kind == "flashinfer"}
    fi_groups = sorted({g for _, g in fi})
    lines = [
        "# Suggested [routes.<name>.gates] tables, measured by pkvrt calibrate" + (f" ({header})" if header else "")
        + ".",
        "# NOT applied: copy what you agree with into routes.toml (`pkvrt routes` checks it).",
        "# A route won a calibration step when FlashInfer's measured time (faster of tensor-core and",
        "# CUDA-core) over the route's, at the cut its planner picks, reached the route's margin.",
        f"# FlashInfer was timed at G = {', '.join(map(str, fi_groups)) or '(none)'}; other group sizes "
        "give no verdict.",
    ]
    for route in registry.routes:
        if route.kind == "flashinfer":
            continue
        verdicts, unjudged = [], []   # (G, case, active, longest, ratio); "case/G<g>"
        for t in timed:
            if route_of_kind(registry, t.kind) is not route:
                continue
            cut = planned_cut(t, route, cal)
            if (t.case, t.group) in fi and cut in t.times:
                verdicts.append((t.group, t.case, int(t.seq.size), int(t.seq.max()), fi[t.case, t.group] / t.times[cut]))
            else:
                unjudged.append(f"{t.case}/G{t.group}")
        note = " (ablation = true: the host router takes it only when forced)" if route.ablation else ""
        lines += ["", f"# {route.name}{note}, margin {route.margin:g}:"]
        lines += [f"#   G {g} {case}: {ratio:.2f}x {'won' if ratio >= route.margin else 'lost'}"
                  for g, case, _, _, ratio in verdicts]
        if unjudged:
            lines += textwrap.wrap("no verdict (no FlashInfer time, or the planned cut not timed): "
                                   + ", ".join(unjudged), 96, initial_indent="#   ", subsequent_indent="#     ",
                                   break_on_hyphens=False)
        if not verdicts:
            lines.append("#   no calibration step timed beside FlashInfer: no suggestion")
            continue
        won = [v for v in verdicts if v[4] >= route.margin]
        if not won:
            lines.append("#   won no step: keep it off these steps (e.g. enabled = false)")
            continue
        lo, hi = min(v[2] for v in won), max(v[2] for v in won)
        holes = [f"{case}/G{g}" for g, case, a, n, r in verdicts
                 if r < route.margin and lo <= a <= hi and g in {v[0] for v in won}
                 and n >= min(v[3] for v in won)]
        if holes:
            lines += textwrap.wrap("lost inside the suggested range: " + ", ".join(holes), 96,
                                   initial_indent="#   ", subsequent_indent="#     ", break_on_hyphens=False)
        lines += [f"[routes.{route.name}.gates]",
                  f"group_sizes = [{', '.join(str(g) for g in sorted({v[0] for v in won}))}]",
                  f"min_context = {min(v[3] for v in won)}",
                  f"min_active = {lo}",
                  f"max_active = {hi}"]
    return "\n".join(lines) + "\n"
