"""The tables of ``pkvrt report``: each as a :class:`Table` (header, rows of cell strings) made
from :mod:`report_data`'s numbers, and as Markdown (the ``*_table`` functions, which return ""
when there is nothing to show). :mod:`report` decides where each goes: into report.md, or, when
it is long, a summary there and every row into a CSV appendix.
"""

from __future__ import annotations

import collections
import json
import math
import re
import statistics
from dataclasses import dataclass, field
from pathlib import Path

from pkvrt.tools.report_data import (FASTER, FLOOR_GBPS, NCU, NEAR_BEST, SLOWER, SWEEPS, _is_number,
                                     bin_label, file_kind, fmt_pm, isolated_baseline, isolated_best,
                                     isolated_coverage, of_kind, row_columns, serving_coverage,
                                     serving_groups, trace_key)

COUNTERS = (("launches_per_step", "Launches/step", 2), ("cta_work_per_sm", "Decode CTA work/SM", 1),
            ("useful_kv_mb", "Useful KV MB", 1), ("merge_mb", "Merge MB", 2),
            ("merge_launches", "Merge launches", 2))
NCU_COLUMNS = (("duration_us", "Duration µs", 1), ("dram_pct_of_peak", "DRAM % of peak", 1),
               ("dram_read_mb", "DRAM read MB", 1), ("l2_hit_pct", "L2 hit %", 1),
               ("achieved_occupancy_pct", "Occupancy %", 1), ("sm_pct_of_peak", "SM % of peak", 1),
               ("grid", "Grid", 0), ("registers", "Regs", 0))
NCU_NOTE = ("Nsight Compute, `--clock-control none`, caches flushed before each kernel (ncu's "
            "default), one launch per kernel after warm-up (`benches/ncu_table5.sh`). Durations "
            "are single serialized launches, not the graph-replayed times of Table 1.")
FP8_ERRORS_NOTE = ("Traces ending in -fp8 (an FP8 KV cache, `pkvrt bench serving --kv-dtype fp8`): "
                   "Max / Mean |e| against FP32 attention over the dequantized cache (the "
                   "yardstick there; FlashInfer's FP8 output is not).")
# work-tracking labels ("session" or "issue", maybe "#", then a number): not results
LABEL = re.compile(r"\s*\(?\b(?:session|issue)[\s_-]*#?\d+\b\)?", re.IGNORECASE)


# --------------------------------------------------------------------------- formatting

@dataclass
class Table:
    """A table as cell strings: ``header``, ``rows`` and ``align`` (one "l" or "r" per column;
    default "l" then "r"), with the ``notes`` printed under it in Markdown."""

    header: tuple
    rows: list = field(default_factory=list)
    align: str | None = None
    notes: list = field(default_factory=list)

    def __len__(self) -> int:
        return len(self.rows)

    def markdown(self, rows: list | None = None) -> str:
        """The table (or the given subset of its ``rows``) in Markdown, then its notes."""
        text = md_table(self.header, self.rows if rows is None else rows, self.align)
        return "\n\n".join([text, *self.notes])

    def markdown_or(self, empty: str = "") -> str:
        """:meth:`markdown`, or ``empty`` for a table without rows."""
        return self.markdown() if self.rows else empty


def md_table(header, rows, align: str | None = None) -> str:
    """A GitHub Markdown table; ``align`` has one "l" or "r" per column (default l then r)."""
    align = align or "l" + "r" * (len(header) - 1)
    rule = ["---:" if a == "r" else "---" for a in align]
    lines = [header, rule, *rows]
    return "\n".join("| " + " | ".join(str(c).replace("|", "\\|") for c in r) + " |" for r in lines)


def neutral(text: str) -> str:
    """Free text from a results file without work-tracking labels (LABEL: a parenthesised
    label goes with its parentheses). The report shows results, not who measured them when."""
    return LABEL.sub("", str(text))


def fmt_err(v) -> str:
    if v is None:
        return "-"
    if isinstance(v, float) and math.isnan(v):
        return "NaN"
    return "0" if v == 0 else f"{v:.3e}"


def _us(v) -> str:
    return f"{v:.2f}" if _is_number(v) else "FAILED"


def _ratio(v, digits: int = 3) -> str:
    return "-" if v is None else f"{v:.{digits}f}"


# --------------------------------------------------------------------------- Table 1

def _isolated_timed_rows(cases) -> list[tuple]:
    rows = []
    for case, engines in cases.items():
        base = isolated_baseline(list(engines.values()))
        for e, r in sorted(engines.items(), key=lambda x: x[1]["median_us"]):
            gbps = r.get("gbps")
            rows.append((case, e + (" (baseline)" if r is base else ""),
                         "-" if r.get("splits") is None else r["splits"], f"{r['median_us']:.2f}",
                         "-" if gbps is None else f"{gbps:.1f}",
                         "-" if gbps is None else f"{gbps / FLOOR_GBPS:.3f}",
                         f"{base['median_us'] / r['median_us']:.3f}x" if base else "-"))
    return rows


def _isolated_failed_row(r) -> tuple:
    why = r.get("unavailable")
    return (r["case"], r["engine"], "-" if r.get("splits") is None else r["splits"],
            "unavailable" if why else "FAILED", "-", "-",
            neutral(str(why or r.get("error", "no time")).removeprefix("unavailable: ")[:60]))


def isolated_grids(files) -> list[tuple[str, str, Table]]:
    """Table 1, one (path, title, Table) per isolated file: best split per (case, engine), ratio vs
    the case's baseline (:func:`isolated_baseline`, marked in the Engine column). A FlashInfer path
    that could not run shows "unavailable" and why, an engine that failed "FAILED" and its error.

    The fraction column is GB/s over the 4.2 TB/s read floor (:data:`FLOOR_GBPS`, the reference
    of the engine-protocol table), not over the file's own ``read_bandwidth_gbps`` probe nor its
    rows' ``frac_read_bw``: the probe (a torch row-sum, 2.86 TB/s on the H200) reads slower than
    decode does, so fractions of it exceed 1 (decode at 4.2 TB/s: 4.2 / 2.86 = 1.47)."""
    out = []
    for path, doc in of_kind(files, "isolated"):
        cases, failed = isolated_best(doc)
        rows = _isolated_timed_rows(cases) + [_isolated_failed_row(r) for r in failed]
        beta = doc["meta"].get("read_bandwidth_gbps")
        title = f"**{Path(path).name}**" + (
            f" (the file's streaming-read probe measured {beta} GB/s; fractions are of the "
            f"{FLOOR_GBPS / 1e3:g} TB/s floor instead)" if beta else "")
        out.append((path, title, Table(
            ("Case", "Engine", "Split", "µs", "GB/s", f"Fraction of {FLOOR_GBPS / 1e3:g} TB/s",
             "Ratio vs baseline"), rows, "llrrrrr")))
    return out


def isolated_table(files) -> str:
    """Table 1 in Markdown (:func:`isolated_grids`), one titled table per isolated file."""
    return "\n\n".join(f"{title}\n\n{t.markdown()}" for _, title, t in isolated_grids(files))


# --------------------------------------------------------------------------- baseline probe

def _probe_cells(seeds: dict) -> str:
    probes = [s.get("baseline_probe_device_us") for s in seeds.values() if s.get("baseline_probe_device_us")]
    status = next(iter(seeds.values())).get("baseline_candidates") or {}
    chosen = collections.Counter(s.get("baseline") for s in seeds.values()).most_common(1)[0][0]
    cells = []
    for label in dict.fromkeys([*status, *probes[0]]):
        rel = [p[label] / min(p.values()) for p in probes if label in p]
        if rel:
            text = f"{statistics.mean(rel):.3f} ({probes[0][label]:.0f} us)" if label in probes[0] \
                else f"{statistics.mean(rel):.3f}"
            cells.append(f"**{label}** {text}" if label == chosen else f"{label} {text}")
        else:
            cells.append(f"{label}: {neutral(status.get(label, 'not probed'))}")
    return "; ".join(cells)


def baseline_probe_grid(files) -> Table:
    """Every FlashInfer path the serving harness probed for the baseline, per results file: its
    summed device µs over the probe steps relative to the fastest (mean over seeds, absolute µs
    of the first seed in brackets), or why it could not run; the chosen baseline in bold. This
    is where the paths that were not the baseline (e.g. XQA, cuDNN) appear in serving results."""
    rows = []
    for path, doc in of_kind(files, "serving"):
        seeds = doc["meta"].get("per_seed") or {}
        n = sum(1 for s in seeds.values() if s.get("baseline_probe_device_us"))
        if n:
            rows.append((Path(path).name, n, _probe_cells(seeds)))
    return Table(("File", "Seeds", "FlashInfer paths: probe device time / fastest (bold: the baseline)"),
                 rows, "lrl")


def baseline_probe_table(files) -> str:
    """:func:`baseline_probe_grid` in Markdown ("" when no file has probe records)."""
    return baseline_probe_grid(files).markdown_or()


# --------------------------------------------------------------------------- Tables 2, 3

def _route_text(entries) -> str:
    routes = collections.Counter(e.get("route") for e in entries if e.get("route"))
    if not routes:
        return "-"
    route = routes.most_common(1)[0][0]
    splits = collections.Counter(e.get("split_main") for e in entries
                                 if e.get("route") == route and e.get("split_main"))
    text = route + (f", split {splits.most_common(1)[0][0]}" if splits else "")
    if len(routes) > 1:
        text += f" ({len(routes)} routes over seeds)"
    return text


def _serving_row(key, engine, entries) -> tuple:
    ok = [e for e in entries if e["wall_ratio"] is not None]
    bad = f" ({len(entries) - len(ok)} FAILED)" if len(ok) < len(entries) else ""
    ref = "within_fp8_bound" in entries[0]
    max_key, mean_key = ("max_err_ref", "mean_err_ref") if ref else ("max_err", "mean_err")
    errs = [e.get(max_key) for e in entries if _is_number(e.get(max_key))]
    means = [e.get(mean_key) for e in entries if _is_number(e.get(mean_key))]
    label = engine + (" (baseline)" if entries[0].get("baseline") else "")
    return (key, label, _route_text(entries), len(entries),
            fmt_pm([e["cuda_ratio"] for e in ok]) + bad, fmt_pm([e["wall_ratio"] for e in ok]) + bad,
            fmt_err(max(errs) if errs else None), fmt_err(sum(means) / len(means) if means else None))


def serving_grid(files) -> Table:
    """Table 2: throughput ratios against the baseline, mean ± std over seeds. Errors are against
    the baseline's output, for FP8 rows (``within_fp8_bound`` present) against the FP32
    reference over the dequantized cache, with a note saying so."""
    groups = serving_groups(files)
    rows = [_serving_row(key, engine, entries) for (key, engine), entries in groups.items()]
    fp8 = any("within_fp8_bound" in entries[0] for entries in groups.values())
    return Table(("Trace / mode", "Engine", "Selected route", "Seeds", "CUDA tok/s ratio",
                  "Wall tok/s ratio", "Max |e|", "Mean |e|"), rows, "lllrrrrr",
                 [FP8_ERRORS_NOTE] if fp8 else [])


def serving_table(files) -> str:
    """Table 2 in Markdown (:func:`serving_grid`); "" without serving files."""
    return serving_grid(files).markdown_or()


def throughput_grid(files) -> Table:
    """Table 3: absolute CUDA / wall decode-token throughput and ms per step over seeds."""
    rows = []
    for (key, engine), entries in serving_groups(files).items():
        ok = [e for e in entries if e.get("correct", True)]
        if ok:
            rows.append((key, engine, len(ok), fmt_pm([e["cuda_tok_per_s"] for e in ok], 1),
                         fmt_pm([e.get("mean_cuda_us", e["median_us"]) / 1e3 for e in ok]),
                         fmt_pm([e["tok_per_s"] for e in ok], 1),
                         fmt_pm([e.get("mean_wall_us", e["wall_us"]) / 1e3 for e in ok])))
    return Table(("Trace / mode", "Engine", "Seeds", "CUDA tok/s", "CUDA ms/step", "Wall tok/s",
                  "Wall ms/step"), rows, "llrrrrr")


def throughput_table(files) -> str:
    return throughput_grid(files).markdown_or()


# --------------------------------------------------------------------------- Table 4

def counters_grid(files) -> Table:
    """Table 4: per (source, trace, engine) the mean structural counters over seeds."""
    groups: dict[tuple[str, str, str], list[dict]] = collections.OrderedDict()
    for path, doc in files:
        kind = file_kind(doc)
        if kind not in ("serving", "plan"):
            continue
        source = "measured run" if kind == "serving" else "planner"
        for r in doc["rows"]:
            if r.get("row", "measured") == "measured" and _is_number(r.get("launches_per_step")):
                groups.setdefault((source, trace_key(r["case"]), r["engine"]), []).append(r)
    rows = []
    for (source, key, engine), entries in groups.items():
        cells = []
        for name, _, digits in COUNTERS:
            vals = [e[name] for e in entries if _is_number(e.get(name))]
            cells.append(f"{sum(vals) / len(vals):.{digits}f}" if vals else "–")
        rows.append((key, engine, source, *cells))
    return Table(("Trace", "Engine", "Source", *(c[1] for c in COUNTERS)), rows, "lll" + "r" * 5)


def counters_table(files) -> str:
    return counters_grid(files).markdown_or()


# --------------------------------------------------------------------------- Table 5

def ncu_engine(kernel: str, previous: str | None) -> str:
    """The engine an ncu kernel row belongs to: a decode kernel names it, a merge kernel belongs
    to the decode launched just before it (benches/ncu_workload.py profiles engine by engine)."""
    k = kernel.lower()
    if "merge" in k:
        return previous or "?"
    for key, name in (("pkv_workqueue_decode", "pkvrt-workqueue"), ("pkv_fused_decode", "pkvrt-fused"),
                      ("pkv_split_decode", "pkvrt-bucket"), ("flashinfer", "flashinfer-tc")):
        if key in k:
            return name
    return kernel


def _ncu_file_rows(path, doc) -> list[list]:
    case = str(doc["meta"].get("case") or Path(path).stem)
    engine, totals, out = None, {}, []
    for r in doc["rows"]:
        engine = r.get("engine") or ncu_engine(r["kernel"], engine)
        totals[engine] = totals.get(engine, 0.0) + float(r.get("duration_us") or 0.0)
        kernel = r["kernel"].replace("void ", "").split("<")[0].split("(")[0]
        out.append([case, engine, kernel] + [
            "-" if r.get(key) is None else f"{r[key]:.{digits}f}" for key, _, digits in NCU_COLUMNS])
    return out + [[case, e, "**all kernels**", f"**{t:.1f}**"] + [""] * (len(NCU_COLUMNS) - 1)
                  for e, t in totals.items()]


def ncu_grid(files) -> Table:
    """Table 5: one row per profiled kernel of each ncu file, then each engine's total duration."""
    rows = [r for path, doc in of_kind(files, NCU) for r in _ncu_file_rows(path, doc)]
    return Table(["Case", "Engine", "Kernel"] + [title for _, title, _ in NCU_COLUMNS], rows,
                 notes=[NCU_NOTE])


def ncu_table(files) -> str:
    return ncu_grid(files).markdown_or()


# --------------------------------------------------------------------------- Table 6

def verdict(ratio) -> str:
    """A pkvrt / FlashInfer speed ratio as a verdict: 1.05 -> "pkvrt faster", 0.99 -> "tie"
    (0.98 <= ratio < 1.02), 0.90 -> "FlashInfer faster"; None -> "-". The ratio is judged as the
    tables show it, to 3 decimals (1.0196 is shown as 1.020 and is "pkvrt faster")."""
    if ratio is None:
        return "-"
    shown = round(ratio, 3)
    if shown >= FASTER:
        return "pkvrt faster"
    return "tie" if shown >= SLOWER else "FlashInfer faster"


def _coverage_cells(best: dict | None) -> tuple[str, str, str]:
    if best is None:
        return "-", "-", "-"
    return best["engine"], best["text"], verdict(best["ratio"])


def _coverage_notes(files, covered: list[dict], failed: list[str], isolated: bool) -> list[str]:
    notes = ["Ratio = FlashInfer time / pkvrt time (serving: decode-token throughput ratio against "
             "each seed's baseline row, mean ± std over seeds). Verdict: pkvrt faster if ratio >= "
             f"{FASTER}, tie if {SLOWER} <= ratio < {FASTER}, FlashInfer faster below {SLOWER}."]
    protocols = sorted({neutral(d["meta"]["protocol"]) for _, d in of_kind(files, "isolated")
                        if d["meta"].get("protocol")})
    if isolated:
        notes.append("Isolated cases: kernel time only (no wall measure), best split per engine, "
                     "against the case's baseline (FlashInfer's fastest path, named in the "
                     "Baseline column)" + (f"; protocol: {'; '.join(protocols)}." if protocols else "."))
    for label, key in (("CUDA events (isolated and serving)", "cuda"), ("wall (serving)", "wall")):
        counts = collections.Counter(verdict(c[key]["ratio"]) for c in covered if c[key])
        if counts:
            notes.append(f"Verdicts, {label}: " + ", ".join(
                f"{v} {counts[v]}" for v in ("pkvrt faster", "tie", "FlashInfer faster", "-")
                if counts[v]) + ".")
    if failed:
        notes.append("Not candidates (a seed failed correctness): " + "; ".join(failed) + ".")
    return ["\n".join(f"- {n}" for n in notes)]


def coverage_grid(files) -> Table:
    """Table 6: one row per measured case (isolated cases, then serving traces), with notes."""
    iso = isolated_coverage(files)
    serving, failed = serving_coverage(files)
    rows = [(c["case"], c["source"], c["baseline"], c["seeds"], *_coverage_cells(c["cuda"]),
             *_coverage_cells(c["wall"])) for c in iso + serving]
    return Table(("Case", "Source", "Baseline", "Seeds", "Best pkvrt (CUDA events)", "CUDA ratio",
                  "CUDA verdict", "Best pkvrt (wall)", "Wall ratio", "Wall verdict"), rows,
                 "lllrlrllrl", _coverage_notes(files, iso + serving, failed, bool(iso)) if rows else [])


NO_COVERAGE = "No data: no isolated or serving results files."


def coverage_table(files) -> str:
    return coverage_grid(files).markdown_or(NO_COVERAGE)


# --------------------------------------------------------------------------- Table 7

NO_SWEEPS = (f"No data: no {SWEEPS} file with a split sweep (more than one split value for a "
             "case and engine).")


def _split_cells(sweep: dict) -> list[tuple]:
    """One table row per split of a sweep group (time relative to the group's best, the best
    marked), then its FlashInfer reference rows."""
    best = sweep["stats"]["best"] if sweep["stats"] else None
    head = (sweep["case"], sweep["engine"], sweep["file"])

    def rel(r):
        ok = best is not None and _is_number(r.get("median_us"))
        return f"{r['median_us'] / best['median_us']:.3f}" if ok else "-"
    out = []
    for r in sweep["rows"]:
        work = f"{r['cta_work_per_sm']:.2f}" if _is_number(r.get("cta_work_per_sm")) else "-"
        out.append((*head, r["splits"], _us(r.get("median_us")), work, rel(r), "best" if r is best else ""))
    for r in sweep["refs"]:
        out.append((*head, f"{r['engine']} (no split)", _us(r.get("median_us")), "-", rel(r), "reference"))
    return out


def split_grid(sweeps: list[dict]) -> Table:
    """Table 7 in full: per sweep group (:func:`report_data.split_sweeps`) µs against the split."""
    return Table(("Case", "Engine", "File", "Splits", "µs", "CTA work/SM", "Time vs best split", "Best"),
                 [row for s in sweeps for row in _split_cells(s)], "lllrrrrl")


def _median_text(values, fmt: str = "{:g}") -> str:
    return "-" if not values else fmt.format(statistics.median(values))


def _split_summary_row(file: str, engine: str, sweeps: list[dict]) -> tuple:
    stats = [s["stats"] for s in sweeps if s["stats"]]
    splits = sorted({r["splits"] for s in sweeps for r in s["rows"]})
    best = [st["best"]["splits"] for st in stats]
    refs = [st["reference"] for st in stats if st["reference"] is not None]
    untimed = len(sweeps) - len(stats)
    return (file, engine, len(sweeps) if not untimed else f"{len(sweeps)} ({untimed} untimed)",
            f"{splits[0]}-{splits[-1]} ({len(splits)} values)",
            "-" if not best else f"{min(best)} / {_median_text(best)} / {max(best)}",
            _median_text([len(st["near"]) for st in stats]),
            _median_max([st["neighbour"] for st in stats]), _median_max([st["worst"] for st in stats]),
            _median_text(refs, "{:.3f}"))


def _median_max(values) -> str:
    vals = [v for v in values if v is not None]
    return "-" if not vals else f"{statistics.median(vals):.2f} / {max(vals):.2f}"


def split_summary_grid(sweeps: list[dict]) -> Table:
    """Table 7 summarised: one row per (file, engine) over its cases: the splits swept, the best
    split (min / median / max over cases), how many splits come within 2 % of the best (median
    per case), the time one swept split off the best (the slower side) and at the slowest split,
    over the best (median / max over cases), and the fastest FlashInfer reference's time over
    the best split (median)."""
    by: dict[tuple[str, str], list[dict]] = collections.OrderedDict()
    for s in sweeps:
        by.setdefault((s["file"], s["engine"]), []).append(s)
    return Table(("File", "Engine", "Cases", "Splits swept", "Best split (min / median / max)",
                  f"Splits within {round((NEAR_BEST - 1) * 100)} % of best (median)",
                  "Next split / best (median / max)", "Slowest / best split (median / max)",
                  "FlashInfer / best split (median)"),
                 [_split_summary_row(f, e, ss) for (f, e), ss in by.items()], "llrlrrrrr")


# --------------------------------------------------------------------------- per-step tables

def engine_protocol_grid(rows: list[dict]) -> Table:
    """The engine-protocol table: per (trace, engine, baseline) the read-floor fractions and the
    summed and per-step CUDA ratios (:func:`report_data.engine_protocol_rows`)."""
    cells = [(r["trace"], r["engine"], r["baseline"], r["steps"], f"{r['floor_fraction']:.3f}",
              f"{r['baseline_floor_fraction']:.3f}", f"{r['ratio']:.3f}", f"{r['p5']:.3f}",
              f"{r['min']:.3f}") for r in rows]
    return Table(("Trace", "Engine", "Baseline", "Steps", "Floor fraction", "Baseline's",
                  "CUDA ratio (summed)", "Per-step ratio p5", "min"), cells, "lllrrrrrr")


def engine_protocol_table(rows: list[dict]) -> str:
    return engine_protocol_grid(rows).markdown_or()


def context_grid(data: list[dict]) -> Table:
    """Throughput ratio per (experiment, engine, longest-context bin) (:func:`ratio_by_context`)."""
    rows = [(d["experiment"], d["engine"], d["baseline"], bin_label(*d["bin"]), d["steps"],
             f"{d['cuda_ratio']:.3f}", f"{d['wall_ratio']:.3f}") for d in data]
    return Table(("Experiment", "Engine", "Baseline", "Longest context", "Steps", "CUDA ratio",
                  "Wall ratio"), rows, "lllrrrr")


def context_table(data: list[dict]) -> str:
    return context_grid(data).markdown_or()


def _by_keys(items: list[dict], *keys) -> dict[tuple, list[dict]]:
    out: dict[tuple, list[dict]] = collections.OrderedDict()
    for it in items:
        out.setdefault(tuple(it[k] for k in keys), []).append(it)
    return out


def context_summary_grid(data: list[dict]) -> Table:
    """The ratio-by-context table folded to one row per (experiment, engine): the bins' ratios
    side by side, shortest context first."""
    rows = []
    for (exp, engine), ds in _by_keys(data, "experiment", "engine").items():
        ds = sorted(ds, key=lambda d: d["bin"])
        rows.append((exp, engine, ds[0]["baseline"], sum(d["steps"] for d in ds),
                     " · ".join(f"{bin_label(*d['bin'])} {d['cuda_ratio']:.3f}" for d in ds),
                     " · ".join(f"{bin_label(*d['bin'])} {d['wall_ratio']:.3f}" for d in ds)))
    return Table(("Experiment", "Engine", "Baseline", "Steps", "CUDA ratio by longest context",
                  "Wall ratio by longest context"), rows, "lllrll")


def route_map_grid(cells: list[dict]) -> Table:
    """The adaptive engine's route per (experiment, active rows, context bin) (:func:`route_map_cells`)."""
    rows = [(c["experiment"], c["baseline"], c["active"], bin_label(*c["bin"]), c["route"],
             f"{100 * c['share']:.0f}%", c["steps"], f"{c['cuda_ratio']:.3f}",
             f"{c['wall_ratio']:.3f}") for c in cells]
    return Table(("Experiment", "Baseline", "Active rows", "Longest context", "Route", "Share",
                  "Steps", "CUDA ratio", "Wall ratio"), rows, "llrllrrrr")


def route_map_table(cells: list[dict]) -> str:
    return route_map_grid(cells).markdown_or()


def _span(values, fmt=str) -> str:
    lo, hi = min(values), max(values)
    return fmt(lo) if lo == hi else f"{fmt(lo)}-{fmt(hi)}"


def route_map_summary_grid(cells: list[dict]) -> Table:
    """The route map folded to one row per (experiment, route): its cells and steps, the active
    rows and context bins where it was taken, and the range of its cells' ratios."""
    rows = []
    for (exp, route), cs in _by_keys(cells, "experiment", "route").items():
        bins = sorted(c["bin"] for c in cs)
        rows.append((exp, cs[0]["baseline"], route, len(cs), sum(c["steps"] for c in cs),
                     _span([c["active"] for c in cs]), f"{bin_label(*bins[0])} to {bin_label(*bins[-1])}",
                     _span([c["cuda_ratio"] for c in cs], "{:.3f}".format),
                     _span([c["wall_ratio"] for c in cs], "{:.3f}".format)))
    return Table(("Experiment", "Baseline", "Route", "Cells", "Steps", "Active rows",
                  "Longest context", "CUDA ratio (cells)", "Wall ratio (cells)"), rows, "lllrrllll")


# --------------------------------------------------------------------------- other files

def _cell(v) -> str:
    if isinstance(v, float):
        return f"{v:.4g}"
    if v is None:
        return "-"
    return json.dumps(v) if isinstance(v, (dict, list)) else neutral(str(v))


def generic_grid(doc) -> Table:
    """All rows of a file as a table; columns are the union of keys in first-seen order, floats
    to 4 significant digits."""
    cols = row_columns(doc["rows"])
    return Table(tuple(cols), [tuple(_cell(r.get(c)) for c in cols) for r in doc["rows"]], "l" * len(cols))


def raw_grid(doc) -> Table:
    """All rows of a file as they are (for a CSV appendix): None as "", objects as JSON."""
    cols = row_columns(doc["rows"])

    def raw(v):
        return "" if v is None else json.dumps(v) if isinstance(v, (dict, list)) else v
    return Table(tuple(cols), [tuple(raw(r.get(c)) for c in cols) for r in doc["rows"]])
