"""Run the router over a trace without a GPU: route per step, structural counters, predicted times.

``pkvrt plan`` replays continuous decode over a trace (a synthetic family, the shipped ``mixed``
fixture, or a CSV/JSON file), asks the router for every step's route, and forces every enabled
route on the same step to compare engines. It prints the trace summary, the adaptive route mix
(with the split counts used), the paper's Table 4 structural counters per engine, and the
predicted step time per engine. Every time here is a cost-model prediction for the named
calibration file, not a measurement. ``--json OUT`` writes the same as ``{"meta", "rows", ...}``.
"""

from __future__ import annotations

import argparse
import collections
import hashlib
import json
import sys
from pathlib import Path

import attrs
import numpy as np

from pkvrt import __version__
from pkvrt.measure.traces import FAMILIES, Trace, decode_steps, resolve_trace
from pkvrt.policy import calibration as calib
from pkvrt.policy import registry as reg_mod
from pkvrt.policy.planner import BucketPlan, WorkqueuePlan, check_seq_lens
from pkvrt.tools.cli import add_shape_arguments, check_shape_arguments, non_negative_int, positive_int

ADAPTIVE = "adaptive"
DEVICE_PLAN = "device-plan"   # per step the route device planning runs ([device_planning])
KIND_LABELS = {"flashinfer": "FlashInfer", "bucket": "PersistentKV buckets",
               "workqueue": "PersistentKV workqueue", "fused": "PersistentKV fused",
               "device_planning": "Device planning"}
MB = 2**20   # the paper's Table 4 "MB" (550.5 for bimodal B8 = 550.5 MiB of K+V)
SHARED_STEP_MIN = 0.1   # SharedPagesRuntime's default min_saved: a step saving less runs unshared


@attrs.frozen
class RouteShare:
    """How often the adaptive policy took ``route``; ``splits``: (S, row-steps) pairs, most used
    first (a row-step is one row on one step; S = 1 rows of a bucket have no merge)."""

    route: str
    kind: str
    steps: int
    share: float
    splits: tuple[tuple[int, int], ...]


@attrs.frozen
class EngineRow:
    """Per-step means of one engine over the trace (Table 4 columns) and its predicted time.

    ``cta_work_per_sm`` averages the steps whose route counts its own CTAs (None when none do:
    FlashInfer chooses its own grid). ``merge_mb`` counts each partial state once
    (``merge_bytes / 2 / 2**20``), as the paper's Table 4. ``ratio_vs_flashinfer`` is
    ``sum(T_flashinfer) / sum(T_engine)``, a predicted decode-token throughput ratio.
    """

    engine: str
    kind: str
    label: str
    launches_per_step: float
    cta_work_per_sm: float | None
    useful_kv_mb: float
    merge_mb: float
    merge_launches: float
    predicted_us: float
    predicted_tok_per_s: float
    ratio_vs_flashinfer: float


@attrs.frozen
class PlanSummary:
    """Everything ``pkvrt plan`` prints, as plain data (``attrs.asdict`` gives the JSON)."""

    trace: str
    trace_source: str
    trace_seed: int | None
    num_requests: int
    max_active: int
    steps: int
    decode_tokens: int
    mean_active: float
    context_min: int
    context_max: int
    context_mean: float
    long_steps: int               # steps whose longest context >= the gates' min_context
    min_context: int
    shape: dict
    graphs: bool
    launch_us: float
    calibration: str              # slug
    calibration_gpu: str
    calibration_source: str
    calibration_fallback: bool
    routes_path: str
    routes_sha256: str
    route_mix: tuple[RouteShare, ...]
    engines: tuple[EngineRow, ...]
    predicted_ratio: float        # adaptive over FlashInfer, sum(T_fi) / sum(T_adaptive)
    notes: tuple[str, ...]
    layers: int = 1               # attention calls per step, planned once (the router's layers)
    # the trace's prefix hashes as shared pages (pagetable.build_layout): the mean over steps of
    # the fraction of page reads that reading each shared page once saves, and the fraction of
    # steps that would save at least SHARED_STEP_MIN of theirs; None: the trace has no hashes
    shared_read: float | None = None
    shared_steps: float | None = None

    @property
    def case(self) -> str:
        """Results-file case name, e.g. ``bimodal-B8-seed20260623``."""
        seed = "" if self.trace_seed is None else f"-seed{self.trace_seed}"
        return f"{self.trace}-B{self.max_active}{seed}"


# --------------------------------------------------------------------------- the planner run

def _plan_splits(plan) -> list[tuple[int, int]]:
    """(S, rows) of a plan: per-row S of a workqueue, per-bucket S of a bucket plan."""
    if isinstance(plan, WorkqueuePlan):
        s, n = np.unique(plan.num_splits, return_counts=True)
        return list(zip(s.tolist(), n.tolist()))
    if isinstance(plan, BucketPlan):
        return [(b.num_splits, len(b.rows)) for b in plan.buckets]
    return []


class _Acc:
    """Running sums of one engine's counters and predicted times over steps."""

    def __init__(self):
        self.steps = self.known = 0
        self.launches = self.cta = self.kv = self.merge = self.merge_launches = 0.0
        self.us = 0.0

    def add(self, counters, us: float) -> None:
        self.steps += 1
        self.launches += counters.launches
        if counters.decode_ctas > 0:
            self.known += 1
            self.cta += counters.cta_work_per_sm
        self.kv += counters.useful_kv_bytes
        self.merge += counters.merge_bytes
        self.merge_launches += counters.merge_launches
        self.us += us

    def row(self, engine: str, kind: str, *, tokens: int, baseline_us: float) -> EngineRow:
        """Per-step means over the ``self.steps`` steps seen; ``baseline_us``: FlashInfer's sum."""
        n = self.steps
        label = "Adaptive route" if engine == ADAPTIVE else f"{KIND_LABELS[kind]} ({engine})"
        return EngineRow(
            engine=engine, kind=kind, label=label, launches_per_step=self.launches / n,
            cta_work_per_sm=self.cta / self.known if self.known else None,
            useful_kv_mb=self.kv / n / MB, merge_mb=self.merge / 2 / n / MB,
            merge_launches=self.merge_launches / n, predicted_us=self.us / n,
            predicted_tok_per_s=tokens / (self.us * 1e-6),
            ratio_vs_flashinfer=baseline_us / self.us)


def _progress(stream, done: int, total: int) -> None:
    width = 30
    fill = width * done // total
    stream.write(f"\rplanning [{'#' * fill}{'.' * (width - fill)}] {done}/{total} steps")
    if done == total:
        stream.write("\n")
    stream.flush()


def _forced_route(reg, engine: str, rows: int, group: int) -> str:
    """The route an engine other than adaptive runs on a step of ``rows`` rows at group size
    ``group``: ``device-plan`` the one device planning runs, ``device-plan:ROUTE`` that route, a
    route name itself."""
    if engine == DEVICE_PLAN:
        return reg.device_planning_route(rows, group).name
    return engine.partition(":")[2] if engine.startswith(DEVICE_PLAN + ":") else engine


def _engine_kind(reg, engine: str) -> str:
    if engine == ADAPTIVE:
        return "adaptive"
    return "device_planning" if engine.startswith(DEVICE_PLAN) else reg.route(engine).kind


def run_planner(trace: Trace, *, max_active: int, router, progress: bool = False,
                stream=None, layers: int = 1, engines=None) -> PlanSummary:
    """Replay continuous decode over ``trace`` and route every step with ``router``.

    Parameters
    ----------
    trace : the requests (:mod:`pkvrt.measure.traces`).
    max_active : slots of the decode loop (the batch size B).
    router : a :class:`pkvrt.policy.router.Router`; its registry, calibration and shape are used.
    progress : draw a progress bar on ``stream`` (default ``sys.stderr``).
    layers : run() calls per plan, passed to ``router.decide`` (it weighs host time at them when
        built with ``weigh_host=True`` and the calibration has ``host_time``).
    engines : the engines to report, in order: ``adaptive``, a route name (forced on every
        step), ``device-plan`` (per step the route of routes.toml's ``[device_planning]``) or
        ``device-plan:ROUTE``; the baseline route is always reported, first. None: every enabled
        route, then adaptive.

    Returns
    -------
    PlanSummary
        route mix of the policy; per engine the mean structural counters and predicted µs of one
        attention call per step.
    """
    reg, cal = router.registry, router.cal
    steps = list(decode_steps(trace, max_active=max_active))
    stream = stream or sys.stderr
    if engines is None:
        engines = [*(r.name for r in reg.routes if r.enabled), ADAPTIVE]
    engines = list(dict.fromkeys([reg.baseline.name, *engines]))
    forced = [e for e in engines if e != ADAPTIVE]
    accs = {e: _Acc() for e in [*engines, ADAPTIVE]}   # adaptive always: the route mix, the ratio
    unavailable: dict[str, str] = {}
    mix: dict[str, int] = collections.Counter()
    splits: dict[str, collections.Counter] = collections.defaultdict(collections.Counter)
    tokens = 0
    seq_min, seq_max, seq_sum, long_steps = None, 0, 0, 0
    min_context = min((r.gates.min_context for r in reg.routes if r.kind != "flashinfer"),
                      default=0)
    every = max(1, len(steps) // 100)

    def predicted(dec, name, seq):   # a baseline step no route challenged is decided unpredicted
        t = dec.predicted_us.get(name)
        return router.predict(router.registry.route(name), check_seq_lens(seq)) if t is None else t

    for i, step in enumerate(steps):
        seq = step.seq_lens
        tokens += len(seq)
        lo, hi = int(seq.min()), int(seq.max())
        seq_min = lo if seq_min is None else min(seq_min, lo)
        seq_max, seq_sum = max(seq_max, hi), seq_sum + int(seq.sum())
        long_steps += hi >= min_context
        d = router.decide(seq, layers=layers)
        accs[ADAPTIVE].add(d.plan.counters, predicted(d, d.route, seq))
        mix[d.route] += 1
        for s, n in _plan_splits(d.plan):
            splits[d.route][s] += n
        for e in forced:
            if e in unavailable:
                continue
            name = _forced_route(reg, e, len(seq), router.group_size)
            try:
                f = d if name == d.route else router.decide(seq, force=name, layers=layers)
            except ValueError as err:                # no kernel for this shape
                unavailable[e] = str(err)
                continue
            accs[e].add(f.plan.counters, predicted(f, name, seq))
        if progress and ((i + 1) % every == 0 or i + 1 == len(steps)):
            _progress(stream, i + 1, len(steps))

    n = len(steps)
    shared_read, shared_steps = _sharing(trace, steps, router.page_size)
    base = reg.baseline.name
    t_base = accs[base].us
    rows = [accs[name].row(name, _engine_kind(reg, name), tokens=tokens, baseline_us=t_base)
            for name in engines if name not in unavailable]
    mix_rows = tuple(
        RouteShare(route=name, kind=reg.route(name).kind, steps=c, share=c / n,
                   splits=tuple(sorted(splits[name].items(), key=lambda x: (-x[1], x[0]))))
        for name, c in sorted(mix.items(), key=lambda x: (-x[1], x[0])))
    notes = tuple(f"{name}: not run, {why}" for name, why in unavailable.items())
    notes += tuple(f"{r.name}: disabled in routes.toml, not shown" for r in reg.routes
                   if not r.enabled and r.name not in engines)
    return PlanSummary(
        trace=trace.name, trace_source=trace.source, trace_seed=trace.seed,
        num_requests=len(trace), max_active=max_active, steps=n, decode_tokens=tokens,
        mean_active=tokens / n, context_min=seq_min, context_max=seq_max,
        context_mean=seq_sum / tokens, long_steps=long_steps, min_context=min_context,
        shape=dict(num_qo_heads=router.num_qo_heads, num_kv_heads=router.num_kv_heads,
                   head_dim=router.head_dim, page_size=router.page_size,
                   dtype_bytes=router.dtype_bytes),
        graphs=router.graphs, launch_us=cal.lambda_graph_us if router.graphs else cal.lambda_us,
        calibration=cal.slug, calibration_gpu=cal.gpu, calibration_source=cal.source,
        calibration_fallback=cal.fallback, routes_path=reg.path, routes_sha256=reg.sha256,
        route_mix=mix_rows, engines=tuple(rows),
        predicted_ratio=t_base / accs[ADAPTIVE].us, notes=notes, layers=layers,
        shared_read=shared_read, shared_steps=shared_steps)


def _sharing(trace: Trace, steps, page_size: int) -> tuple[float | None, float | None]:
    """(mean saved fraction, fraction of steps saving >= SHARED_STEP_MIN) of reading each shared
    page once, with the trace's prefix hashes as shared pages; (None, None) without hashes or
    when the hash blocks are not whole pages."""
    from pkvrt.measure.pagetable import build_layout
    from pkvrt.policy.blocktables import shared_read_fraction

    if not any(r.prefix for r in trace.requests) or trace.block_tokens % page_size:
        return None, None
    table = build_layout(trace, page_size=page_size, seed=0).table
    saved = np.array([shared_read_fraction(st.seq_lens, table[st.rids], page_size) for st in steps])
    return float(saved.mean()), float((saved >= SHARED_STEP_MIN).mean())


# --------------------------------------------------------------------------- output

def text_table(header, rows, align: str | None = None) -> str:
    """Aligned text columns; ``align`` has one "l" or "r" per column (default: "l" then "r"s)."""
    align = align or "l" + "r" * (len(header) - 1)
    cells = [tuple(map(str, header))] + [tuple(map(str, r)) for r in rows]
    widths = [max(len(r[i]) for r in cells) for i in range(len(header))]
    return "\n".join("  ".join(c.ljust(w) if a == "l" else c.rjust(w)
                               for c, w, a in zip(r, widths, align)).rstrip()
                     for r in cells)


def _splits_text(pairs, limit: int = 4) -> str:
    """[(20, 1800), (12, 500)] -> "20:1800, 12:500"."""
    if not pairs:
        return "-"
    text = ", ".join(f"{s}:{n}" for s, n in pairs[:limit])
    return text + (f", +{len(pairs) - limit} more" if len(pairs) > limit else "")


def _times_table(s: PlanSummary) -> str:
    """Predicted µs and tok/s per engine; with ``layers`` > 1 per layer and per step of them."""
    if s.layers == 1:
        return text_table(("engine", "predicted µs/step", "predicted tok/s", "vs FlashInfer"),
                          [(e.label, f"{e.predicted_us:.1f}", f"{e.predicted_tok_per_s:.0f}",
                            f"{e.ratio_vs_flashinfer:.3f}x") for e in s.engines])
    return text_table(("engine", "predicted µs/layer", f"µs/step ({s.layers} layers)",
                       "predicted tok/s", "vs FlashInfer"),
                      [(e.label, f"{e.predicted_us:.1f}", f"{e.predicted_us * s.layers:.1f}",
                        f"{e.predicted_tok_per_s / s.layers:.0f}", f"{e.ratio_vs_flashinfer:.3f}x")
                       for e in s.engines])


def format_summary(s: PlanSummary) -> str:
    """The text ``pkvrt plan`` prints: trace, route mix, Table 4 counters, predicted times."""
    seed = "" if s.trace_seed is None else f", seed {s.trace_seed}"
    sh = s.shape
    fallback = " (fallback: no file for this GPU)" if s.calibration_fallback else ""
    launch = "inside a CUDA graph" if s.graphs else "eager"
    head = [
        f"trace        {s.trace} ({s.trace_source}{seed}): {s.num_requests} requests, "
        f"max_active {s.max_active}",
        f"steps        {s.steps} decode steps, mean active {s.mean_active:.2f}, "
        f"{s.decode_tokens} decode tokens",
        f"context      seq_len {s.context_min}..{s.context_max} tokens (mean {s.context_mean:.0f});"
        f" {s.long_steps}/{s.steps} steps have a longest context >= {s.min_context}",
        f"shape        H_q {sh['num_qo_heads']}, H_kv {sh['num_kv_heads']} "
        f"(G {sh['num_qo_heads'] // sh['num_kv_heads']}), head_dim {sh['head_dim']}, "
        f"page_size {sh['page_size']}, {sh['dtype_bytes']}-byte K/V",
        f"policy       {s.routes_path} (sha256 {s.routes_sha256[:12]})",
        f"calibration  {s.calibration} ({s.calibration_gpu}) from {s.calibration_source}"
        f"{fallback}; launch overhead {s.launch_us:g} µs ({launch})",
    ]
    if s.shared_read is not None:
        head.insert(3, f"sharing      prefix hashes as shared pages: reading each shared page once "
                       f"saves {100 * s.shared_read:.1f}% of a step's page reads (mean); "
                       f"{100 * s.shared_steps:.0f}% of steps save >= {100 * SHARED_STEP_MIN:.0f}%")
    mix = text_table(("route", "kind", "steps", "share", "splits used (S:row-steps)"),
                     [(m.route, m.kind, m.steps, f"{100 * m.share:.1f}%", _splits_text(m.splits))
                      for m in s.route_mix], align="llrrl")
    counters = text_table(
        ("engine", "Launches/step", "Decode CTA work/SM", "Useful KV MB", "Merge MB",
         "Merge launches"),
        [(e.label, f"{e.launches_per_step:.2f}",
          "-" if e.cta_work_per_sm is None else f"{e.cta_work_per_sm:.1f}",
          f"{e.useful_kv_mb:.1f}", f"{e.merge_mb:.2f}", f"{e.merge_launches:.2f}")
         for e in s.engines])
    times = _times_table(s)
    out = head + [
        "", "Route mix of the adaptive policy", mix,
        "", "Structural counters, mean per step (paper Table 4 columns; MB = 2^20 bytes, Merge MB "
        "counts each partial state once; CTA work/SM over the steps on PersistentKV routes)",
        counters,
        "", f"Predicted step time: COST-MODEL PREDICTION for calibration {s.calibration!r} "
        f"({s.calibration_gpu}), not a measurement"
        + (f"; a step is {s.layers} attention calls, planned once" if s.layers > 1 else ""),
        times,
        "", f"predicted adaptive/FlashInfer throughput ratio: {s.predicted_ratio:.3f}x "
        f"(sum of FlashInfer step times / sum of adaptive step times over {s.steps} steps)",
    ]
    out += [f"note: {n}" for n in s.notes]
    return "\n".join(out)


def _sha256(path) -> str | None:
    try:
        return hashlib.sha256(Path(path).read_bytes()).hexdigest()
    except OSError:
        return None


def summary_json(s: PlanSummary, *, command: str | None = None) -> dict:
    """``{"meta", "rows", "route_mix", "summary"}``: rows are one flat record per engine."""
    meta = {
        "kind": "plan (cost-model prediction, no GPU timing)",
        "gpu": None,
        "calibration": s.calibration, "calibration_gpu": s.calibration_gpu,
        "calibration_path": s.calibration_source,
        "calibration_sha256": _sha256(s.calibration_source),
        "calibration_fallback": s.calibration_fallback,
        "routes_path": s.routes_path, "routes_sha256": s.routes_sha256,
        "seeds": [] if s.trace_seed is None else [s.trace_seed],
        "trace": s.trace, "trace_source": s.trace_source,
        "command": command if command is not None else " ".join(["pkvrt", *sys.argv[1:]]),
        "pkvrt_version": __version__,
    }
    rows = [{"case": s.case, **{k: v for k, v in attrs.asdict(e).items() if k != "label"},
             "steps": s.steps, "decode_tokens": s.decode_tokens}
            for e in s.engines]
    doc = attrs.asdict(s)
    for key in ("engines", "route_mix"):
        doc.pop(key)
    return {"meta": meta, "rows": rows,
            "route_mix": [attrs.asdict(m) for m in s.route_mix],
            "summary": doc}


# --------------------------------------------------------------------------- the command


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """Arguments of ``pkvrt plan``."""
    parser.add_argument("--trace", default="bimodal", metavar="SPEC",
                        help=f"a family ({', '.join(FAMILIES)}), 'mixed' (the shipped fixture) "
                             "or a .csv/.json trace file (default: bimodal)")
    parser.add_argument("--max-active", type=positive_int, default=8, metavar="N",
                        help="decode slots, the batch size B (default: 8)")
    parser.add_argument("--seed", type=non_negative_int, default=20260623,
                        help="seed of a synthetic family (default: 20260623, the first held-out)")
    parser.add_argument("--num-requests", type=positive_int, metavar="N",
                        help="requests of a family (default 32); for a file, keep the first N")
    parser.add_argument("--routes", metavar="PATH",
                        help=f"routes.toml (default: {reg_mod.default_routes_path()})")
    cal = parser.add_mutually_exclusive_group()
    cal.add_argument("--calibration", metavar="PATH",
                     help=f"calibration JSON (default: the seed profile "
                          f"calibration/{calib.DEFAULT_SLUG}.json)")
    cal.add_argument("--gpu", metavar="NAME",
                     help="pick the calibration file by device name, e.g. 'NVIDIA H200'")
    parser.add_argument("--eager", action="store_true",
                        help="predict eager launches (lambda_us) instead of CUDA-graph replays")
    parser.add_argument("--layers", type=positive_int, metavar="N",
                        help="decide as the Runtime's default mode does with N layers per plan: host "
                             "time weighed (routes.toml [host_time], the calibration's host_time, e.g. "
                             "--gpu 'NVIDIA H200'); default: device time only")
    add_shape_arguments(parser)
    parser.add_argument("--json", metavar="OUT",
                        help="also write the summary as JSON to OUT (its directory must exist)")


def seed_calibration() -> calib.Calibration:
    """The seed RTX 3060 profile (``rtx3060-seed.json``) from the calibration directories."""
    dirs = calib.calibration_dirs()
    for d in dirs:
        path = d / f"{calib.DEFAULT_SLUG}.json"
        if path.is_file():
            return calib.load_calibration(path)
    raise calib.CalibrationError(f"no {calib.DEFAULT_SLUG}.json (the seed profile) in "
                                 f"{[str(d) for d in dirs]}; pass --calibration PATH")


def check_out_path(flag: str, path: str | None) -> None:
    """Refuse an output file whose directory does not exist, before any work (nothing is
    created: a typo in the directory would otherwise leave a new directory tree behind)."""
    if path is None:
        return
    parent = Path(path).parent
    if not parent.is_dir():
        what = "is not a directory" if parent.exists() else "does not exist"
        raise ValueError(f"{flag} {path}: directory {parent} {what}; create it first "
                         "(nothing was written)")


def run(args: argparse.Namespace) -> int:
    """``pkvrt plan``: print the summary (and write ``--json``); returns 0."""
    from pkvrt.policy.router import Router

    check_shape_arguments(args)        # the shapes the Runtime takes, no others
    check_out_path("--json", args.json)
    trace = resolve_trace(args.trace, num_requests=args.num_requests, seed=args.seed)
    registry = reg_mod.load_routes(args.routes)
    if args.calibration:
        cal = calib.load_calibration(args.calibration)
    elif args.gpu:
        cal = calib.find_calibration(args.gpu)
    else:
        cal = seed_calibration()
    router = Router(registry, cal, num_qo_heads=args.num_qo_heads,
                    num_kv_heads=args.num_kv_heads, head_dim=args.head_dim,
                    page_size=args.page_size, graphs=not args.eager, weigh_host=args.layers is not None)
    if args.layers is not None and router.host_model is not None:
        print(f"pkvrt plan: --layers {args.layers}: host time is not weighed: {router.host_model}",
              file=sys.stderr)
    summary = run_planner(trace, max_active=args.max_active, router=router,
                          progress=sys.stderr.isatty(), layers=args.layers or 1)
    print(format_summary(summary))
    if args.json:
        path = Path(args.json)
        path.write_text(json.dumps(summary_json(summary), indent=2) + "\n")
        print(f"wrote {path}")
    return 0
