"""Turn a directory of results JSON files into Markdown tables and PNG plots.

``pkvrt report RESULTS_DIR --out DIR`` reads every ``*.json`` in RESULTS_DIR (each must be a
pkvrt results file, ``{"meta": {...}, "rows": [...]}``; a malformed one is an error naming it)
and writes ``DIR/report.md`` with the seed paper's tables:

- Table 1, isolated kernels (benches/isolated.py): case, engine, µs, GB/s, fraction of the
  4.2 TB/s read floor (the reference of the engine-protocol table), ratio against the case's
  baseline (FlashInfer's fastest correct decode path in the same file, marked "(baseline)");
- Table 2, serving (``pkvrt bench serving``): per trace and engine the selected route, CUDA and
  wall decode-token throughput ratios against the file's baseline row (mean ± sample std over
  seeds), and max / mean errors;
- Table 3, absolute serving throughput and ms per step (the paper's model-level table for the
  ``-L<n>-mlp`` cases);
- Table 4, structural counters (launches, CTA work per SM, KV and merge MB) where rows carry them;
- Table 5, hardware counters from ``kind: ncu`` files (benches/ncu_table5.sh): per kernel its
  duration, DRAM throughput and bytes, L2 hit rate, occupancy, SM throughput, grid, registers;
- Table 6, coverage map: per isolated case and per serving trace the best pkvrt engine, its ratio
  against FlashInfer and a verdict from that ratio (CUDA-event and wall ratios separately);
- Table 7, split sensitivity: per (case, engine) of a ``calibration-sweeps`` file with more than
  one split value, time per split relative to the group's best split;
- per-step tables from ``.steps.json`` files, per experiment (the case without its seed: trace,
  B, G, L, and ``-fp8`` for an FP8 KV cache) and engine with the baseline named: throughput
  ratio by context length, and the route map of the adaptive engine over (active rows, context);
- whole-model decode (``kind: model-decode``, benches/model_decode.py) and tensor-parallel
  decode (``kind: tp-decode``, benches/tp_decode.py): per case ms/step, tokens/s, shares, checks;
- every other file as a plain table of its rows.

It also draws ``ratio_vs_context.png``, ``route_map.png`` and ``steps_<engine>.png`` from the same
numbers as those tables, one panel per experiment. That needs matplotlib (``pip install
'pkvrt[plots]'``); without it the command fails before writing anything, so that a committed
report keeps its plots, unless ``--no-plots`` asks for the tables only. Ratios are only ever
formed between rows of one file, and a (case, engine) measured in several files counts once, from
the newest file (``meta.date``).
"""

from __future__ import annotations

import argparse
import collections
import json
import math
import re
import statistics
from pathlib import Path

import numpy as np

from pkvrt.measure import results
from pkvrt.measure.model_results import KIND as MODEL_KIND, model_decode_table
from pkvrt.measure.tp_results import KIND as TP_KIND, tp_decode_table

NUMERIC = ("median_us", "wall_us", "tok_per_s", "cuda_tok_per_s", "gbps", "frac_read_bw",
           "max_err", "mean_err", "max_err_ref", "mean_err_ref", "cuda_ratio", "wall_ratio",
           "mean_cuda_us", "mean_wall_us", "launches_per_step", "cta_work_per_sm",
           "useful_kv_mb", "merge_mb", "merge_launches", "duration_us", "dram_pct_of_peak",
           "dram_read_mb", "l2_hit_pct", "achieved_occupancy_pct", "sm_pct_of_peak", "grid", "registers")
SERVING_TIMES = ("median_us", "wall_us", "tok_per_s", "cuda_tok_per_s")
STEP_KEYS = {"step": int, "active": int, "max_context": int, "wall_us": float, "cuda_us": float,
             "route": str}
COUNTERS = (("launches_per_step", "Launches/step", 2), ("cta_work_per_sm", "Decode CTA work/SM", 1),
            ("useful_kv_mb", "Useful KV MB", 1), ("merge_mb", "Merge MB", 2),
            ("merge_launches", "Merge launches", 2))
FASTER, SLOWER = 1.02, 0.98   # verdict band: ratio >= 1.02 pkvrt faster, < 0.98 FlashInfer faster
SWEEPS = "calibration-sweeps"
NCU = "ncu"
NCU_COLUMNS = (("duration_us", "Duration µs", 1), ("dram_pct_of_peak", "DRAM % of peak", 1),
               ("dram_read_mb", "DRAM read MB", 1), ("l2_hit_pct", "L2 hit %", 1),
               ("achieved_occupancy_pct", "Occupancy %", 1), ("sm_pct_of_peak", "SM % of peak", 1),
               ("grid", "Grid", 0), ("registers", "Regs", 0))
NO_MATPLOTLIB = ("the plots need matplotlib, which is not installed: pip install 'pkvrt[plots]' "
                 "(or pass --no-plots to write the tables only; nothing was written)")
PLOTS_OFF = "Plots not drawn (pkvrt report --no-plots)."
FLOOR_BYTES_PER_US = 4.2e6   # the floor's read bandwidth, 4.2 TB/s (DESIGN.md "H200 anchors")
FLOOR_GBPS = FLOOR_BYTES_PER_US / 1e3


# --------------------------------------------------------------------------- reading

def _is_number(v) -> bool:
    return isinstance(v, (int, float)) and not isinstance(v, bool)


def file_kind(doc: dict) -> str:
    """``serving``, ``serving-steps``, ``isolated``, ``plan`` or the file's own ``meta.kind``
    (``generic`` when it has none)."""
    kind = doc["meta"].get("kind")
    if isinstance(kind, str) and kind.startswith("plan"):
        return "plan"
    if kind:
        return str(kind)
    return "isolated" if "isolated" in str(doc["meta"].get("protocol", "")) else "generic"


def validate(path, doc: dict) -> None:
    """Check the rows of one results document; a ValueError names the file, row and key."""
    if not isinstance(doc["meta"], dict):
        raise ValueError(f"{path}: key 'meta': expected an object, got {type(doc['meta']).__name__}")
    kind = file_kind(doc)
    for i, row in enumerate(doc["rows"]):
        where = f"{path}: rows[{i}]"
        if not isinstance(row, dict):
            raise ValueError(f"{where}: expected an object, got {row!r}")
        for key in ("kernel",) if kind == NCU else ("case", "engine"):
            if not isinstance(row.get(key), str) or not row[key]:
                raise ValueError(f"{where}: key {key!r}: expected a non-empty string, "
                                 f"got {row.get(key)!r}")
        for key in NUMERIC:
            if key in row and row[key] is not None and not _is_number(row[key]):
                raise ValueError(f"{where}: key {key!r}: expected a number or null, got {row[key]!r}")
        if kind == "serving" and row.get("row") == "measured" and row.get("correct", True):
            for key in SERVING_TIMES:
                if not _is_number(row.get(key)) or not row[key] > 0:
                    raise ValueError(f"{where}: key {key!r}: expected a positive number in a "
                                     f"timed serving row, got {row.get(key)!r}")
        if kind == "serving-steps":
            for key, typ in STEP_KEYS.items():
                ok = isinstance(row.get(key), str) if typ is str else _is_number(row.get(key))
                if not ok:
                    raise ValueError(f"{where}: key {key!r}: expected "
                                     f"{'a string' if typ is str else 'a number'}, got {row.get(key)!r}")


def load_dir(directory) -> list[tuple[str, dict]]:
    """Every ``*.json`` in ``directory`` (sorted by name), read and validated."""
    d = Path(directory)
    if not d.is_dir():
        raise ValueError(f"{d}: expected a directory of results files")
    files = sorted(d.glob("*.json"))
    if not files:
        raise ValueError(f"{d}: no results files (*.json) found")
    out = []
    for f in files:
        try:
            doc = results.read_results(f)
        except json.JSONDecodeError as e:
            raise ValueError(f"{f}: not a pkvrt results file: invalid JSON at line {e.lineno} "
                             f"column {e.colno}: {e.msg}") from None
        validate(f, doc)
        out.append((str(f), doc))
    return out


# --------------------------------------------------------------------------- formatting

def md_table(header, rows, align: str | None = None) -> str:
    """A GitHub Markdown table; ``align`` has one "l" or "r" per column (default l then r)."""
    align = align or "l" + "r" * (len(header) - 1)
    rule = ["---:" if a == "r" else "---" for a in align]
    lines = [header, rule, *rows]
    return "\n".join("| " + " | ".join(str(c).replace("|", "\\|") for c in r) + " |" for r in lines)


def fmt_pm(values, digits: int = 3) -> str:
    """Mean ± sample std: [1.2, 1.3] -> "1.250 ± 0.071"; one value -> "1.200"."""
    vals = [v for v in values if v is not None]
    if not vals:
        return "-"
    mean = sum(vals) / len(vals)
    if len(vals) == 1:
        return f"{mean:.{digits}f}"
    return f"{mean:.{digits}f} ± {statistics.stdev(vals):.{digits}f}"


def fmt_err(v) -> str:
    if v is None:
        return "-"
    if isinstance(v, float) and math.isnan(v):
        return "NaN"
    return "0" if v == 0 else f"{v:.3e}"


def trace_key(case: str) -> str:
    """``bimodal-B8-seed20260623`` -> ``bimodal-B8`` (the case over seeds)."""
    return re.sub(r"-seed\d+$", "", case)


def _of_kind(files, kind):
    return [(p, d) for p, d in files if file_kind(d) == kind]


# --------------------------------------------------------------------------- Table 1

def isolated_baseline(rows) -> dict | None:
    """The baseline row among one isolated case's timed ``rows``: the fastest row of the engine
    they name as ``baseline_engine`` (benches/isolated.py: FlashInfer's fastest decode path that
    matched the FP32 reference; None when none did), or, in files older than that field, the
    fastest flashinfer-* row."""
    named = [r for r in rows if "baseline_engine" in r]
    if named:
        name = named[0]["baseline_engine"]
        return _fastest([r for r in rows if r["engine"] == name], "") if name else None
    return _fastest(rows, "flashinfer")


def isolated_table(files) -> str:
    """Best split per (case, engine) of every isolated file, ratio vs the case's baseline
    (:func:`isolated_baseline`, marked in the Engine column). A FlashInfer path that could not
    run shows "unavailable" and why, an engine that failed "FAILED" and its error.

    The fraction column is GB/s over the 4.2 TB/s read floor (:data:`FLOOR_GBPS`, the reference
    of the engine-protocol table), not over the file's own ``read_bandwidth_gbps`` probe nor its
    rows' ``frac_read_bw``: the probe (a torch row-sum, 2.86 TB/s on the H200) reads slower than
    decode does, so fractions of it exceed 1 (decode at 4.2 TB/s: 4.2 / 2.86 = 1.47)."""
    out = []
    for path, doc in _of_kind(files, "isolated"):
        beta = doc["meta"].get("read_bandwidth_gbps")
        cases: dict[str, dict[str, dict]] = {}
        failed = []
        for r in doc["rows"]:
            if not _is_number(r.get("median_us")):
                failed.append(r)
                continue
            best = cases.setdefault(r["case"], {})
            if r["engine"] not in best or r["median_us"] < best[r["engine"]]["median_us"]:
                best[r["engine"]] = r
        rows = []
        for case, engines in cases.items():
            base = isolated_baseline(list(engines.values()))
            for e, r in sorted(engines.items(), key=lambda x: x[1]["median_us"]):
                gbps = r.get("gbps")
                frac = None if gbps is None else gbps / FLOOR_GBPS
                rows.append((case, e + (" (baseline)" if r is base else ""),
                             "-" if r.get("splits") is None else r["splits"],
                             f"{r['median_us']:.2f}", "-" if gbps is None else f"{gbps:.1f}",
                             "-" if frac is None else f"{frac:.3f}",
                             f"{base['median_us'] / r['median_us']:.3f}x" if base else "-"))
        for r in failed:
            why = r.get("unavailable")
            rows.append((r["case"], r["engine"], "-" if r.get("splits") is None else r["splits"],
                         "unavailable" if why else "FAILED", "-", "-",
                         str(why or r.get("error", "no time")).removeprefix("unavailable: ")[:60]))
        title = f"**{Path(path).name}**" + (
            f" (the file's streaming-read probe measured {beta} GB/s; fractions are of the "
            f"{FLOOR_GBPS / 1e3:g} TB/s floor instead)" if beta else "")
        out.append(title + "\n\n" + md_table(
            ("Case", "Engine", "Split", "µs", "GB/s", f"Fraction of {FLOOR_GBPS / 1e3:g} TB/s",
             "Ratio vs baseline"), rows, align="llrrrrr"))
    return "\n\n".join(out)


# --------------------------------------------------------------------------- baseline probe

def baseline_probe_table(files) -> str:
    """Every FlashInfer path the serving harness probed for the baseline, per results file: its
    summed device µs over the probe steps relative to the fastest (mean over seeds, absolute µs
    of the first seed in brackets), or why it could not run; the chosen baseline in bold. This
    is where the paths that were not the baseline (e.g. XQA, cuDNN) appear in serving results."""
    rows = []
    for path, doc in _of_kind(files, "serving"):
        seeds = doc["meta"].get("per_seed") or {}
        probes = [s.get("baseline_probe_device_us") for s in seeds.values() if s.get("baseline_probe_device_us")]
        if not probes:
            continue
        status = next(iter(seeds.values())).get("baseline_candidates") or {}
        chosen = collections.Counter(s.get("baseline") for s in seeds.values()).most_common(1)[0][0]
        labels = list(dict.fromkeys([*status, *probes[0]]))
        cells = []
        for label in labels:
            rel = [p[label] / min(p.values()) for p in probes if label in p]
            if rel:
                text = f"{statistics.mean(rel):.3f} ({probes[0][label]:.0f} us)" if label in probes[0] \
                    else f"{statistics.mean(rel):.3f}"
                cells.append(f"**{label}** {text}" if label == chosen else f"{label} {text}")
            else:
                cells.append(f"{label}: {status.get(label, 'not probed')}")
        rows.append((Path(path).name, len(probes), "; ".join(cells)))
    if not rows:
        return ""
    return md_table(("File", "Seeds", "FlashInfer paths: probe device time / fastest (bold: the baseline)"), rows,
                    align="lrl")


# --------------------------------------------------------------------------- Tables 2, 3

def serving_groups(files) -> dict[tuple[str, str], list[dict]]:
    """(trace key, engine) -> one entry per (file, case): the measured row plus its ``cuda_ratio``
    and ``wall_ratio`` against the baseline row of the same case in the same file (None when
    either failed correctness). A (case, engine) measured in several files (a later run adding
    an engine re-times the others) counts once: the newest file's (``meta.date``), so a seed is
    never averaged in twice. Raises ValueError for a case with no baseline row."""
    groups: dict[tuple[str, str], list[dict]] = collections.OrderedDict()
    for path, doc in _of_kind(files, "serving"):
        measured = [r for r in doc["rows"] if r.get("row", "measured") == "measured"]
        bases = {}
        for r in measured:
            if r.get("baseline"):
                if r["case"] in bases:
                    raise ValueError(f"{path}: case {r['case']!r}: two baseline rows "
                                     f"({bases[r['case']]['engine']}, {r['engine']})")
                bases[r["case"]] = r
        for r in measured:
            b = bases.get(r["case"])
            if b is None:
                raise ValueError(f"{path}: case {r['case']!r}: no baseline row "
                                 "(expected one row with \"baseline\": true)")
            timed = r.get("correct", True) and b.get("correct", True)
            entry = dict(r, file=path, file_date=str(doc["meta"].get("date") or ""),
                         cuda_ratio=r["cuda_tok_per_s"] / b["cuda_tok_per_s"] if timed else None,
                         wall_ratio=r["tok_per_s"] / b["tok_per_s"] if timed else None)
            group = groups.setdefault((trace_key(r["case"]), r["engine"]), [])
            same = [i for i, e in enumerate(group) if e["case"] == r["case"]]
            if not same:
                group.append(entry)
            elif entry["file_date"] > group[same[0]]["file_date"]:
                group[same[0]] = entry
    return groups


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


FP8_ERRORS_NOTE = ("Traces ending in -fp8 (an FP8 KV cache, `pkvrt bench serving --kv-dtype fp8`): "
                   "Max / Mean |e| against FP32 attention over the dequantized cache (the "
                   "yardstick there; FlashInfer's FP8 output is not).")


def serving_table(files) -> str:
    """Table 2: throughput ratios against the baseline, mean ± std over seeds. Errors are against
    the baseline's output, for FP8 rows (``within_fp8_bound`` present) against the FP32
    reference over the dequantized cache, with a note saying so."""
    rows, fp8 = [], False
    for (key, engine), entries in serving_groups(files).items():
        ok = [e for e in entries if e["wall_ratio"] is not None]
        bad = len(entries) - len(ok)
        ref = "within_fp8_bound" in entries[0]
        fp8 |= ref
        max_key, mean_key = ("max_err_ref", "mean_err_ref") if ref else ("max_err", "mean_err")
        errs = [e.get(max_key) for e in entries if _is_number(e.get(max_key))]
        means = [e.get(mean_key) for e in entries if _is_number(e.get(mean_key))]
        label = engine + (" (baseline)" if entries[0].get("baseline") else "")
        rows.append((key, label, _route_text(entries), len(entries),
                     fmt_pm([e["cuda_ratio"] for e in ok]) + (f" ({bad} FAILED)" if bad else ""),
                     fmt_pm([e["wall_ratio"] for e in ok]) + (f" ({bad} FAILED)" if bad else ""),
                     fmt_err(max(errs) if errs else None),
                     fmt_err(sum(means) / len(means) if means else None)))
    if not rows:
        return ""
    table = md_table(("Trace / mode", "Engine", "Selected route", "Seeds", "CUDA tok/s ratio",
                      "Wall tok/s ratio", "Max |e|", "Mean |e|"), rows, align="lllrrrrr")
    return table + ("\n\n" + FP8_ERRORS_NOTE if fp8 else "")


def throughput_table(files) -> str:
    """Table 3: absolute CUDA / wall decode-token throughput and ms per step over seeds."""
    rows = []
    for (key, engine), entries in serving_groups(files).items():
        ok = [e for e in entries if e.get("correct", True)]
        if not ok:
            continue
        rows.append((key, engine, len(ok),
                     fmt_pm([e["cuda_tok_per_s"] for e in ok], 1),
                     fmt_pm([e.get("mean_cuda_us", e["median_us"]) / 1e3 for e in ok]),
                     fmt_pm([e["tok_per_s"] for e in ok], 1),
                     fmt_pm([e.get("mean_wall_us", e["wall_us"]) / 1e3 for e in ok])))
    if not rows:
        return ""
    return md_table(("Trace / mode", "Engine", "Seeds", "CUDA tok/s", "CUDA ms/step", "Wall tok/s",
                     "Wall ms/step"), rows, align="llrrrrr")


# --------------------------------------------------------------------------- Table 4

def counters_table(files) -> str:
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
        for field, _, digits in COUNTERS:
            vals = [e[field] for e in entries if _is_number(e.get(field))]
            cells.append(f"{sum(vals) / len(vals):.{digits}f}" if vals else "–")
        rows.append((key, engine, source, *cells))
    if not rows:
        return ""
    return md_table(("Trace", "Engine", "Source", *(c[1] for c in COUNTERS)), rows, align="lll" + "r" * 5)


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


def ncu_table(files) -> str:
    """Table 5: one row per profiled kernel of each ncu file, then each engine's total duration."""
    out = []
    for path, doc in _of_kind(files, NCU):
        case = str(doc["meta"].get("case") or Path(path).stem)
        engine, totals = None, {}
        for r in doc["rows"]:
            engine = r.get("engine") or ncu_engine(r["kernel"], engine)
            totals[engine] = totals.get(engine, 0.0) + float(r.get("duration_us") or 0.0)
            kernel = r["kernel"].replace("void ", "").split("<")[0].split("(")[0]
            out.append([case, engine, kernel] + [
                "-" if r.get(key) is None else f"{r[key]:.{digits}f}" for key, _, digits in NCU_COLUMNS])
        out += [[case, e, "**all kernels**", f"**{t:.1f}**"] + [""] * (len(NCU_COLUMNS) - 1)
                for e, t in totals.items()]
    if not out:
        return ""
    note = ("Nsight Compute, `--clock-control none`, caches flushed before each kernel (ncu's "
            "default), one launch per kernel after warm-up (`benches/ncu_table5.sh`). Durations "
            "are single serialized launches, not the graph-replayed times of Table 1.")
    return md_table(["Case", "Engine", "Kernel"] + [title for _, title, _ in NCU_COLUMNS], out) + "\n\n" + note


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


def _fastest(rows, prefix: str):
    return min((r for r in rows if r["engine"].startswith(prefix)), key=lambda r: r["median_us"],
               default=None)


def isolated_coverage(files) -> list[dict]:
    """Per case of every isolated file: the fastest pkvrt-* engine at its best split and
    ``FlashInfer µs / pkvrt µs`` against the case's baseline (:func:`isolated_baseline`).
    Isolated files time kernels only, so ``wall`` is None."""
    out = []
    for path, doc in _of_kind(files, "isolated"):
        timed: dict[str, list[dict]] = collections.OrderedDict()
        for r in doc["rows"]:
            timed.setdefault(r["case"], [])
            if _is_number(r.get("median_us")) and r["median_us"] > 0:
                timed[r["case"]].append(r)
        for case, rows in timed.items():
            pkv, fi = _fastest(rows, "pkvrt"), isolated_baseline(rows)
            ratio = fi["median_us"] / pkv["median_us"] if pkv and fi else None
            split = "" if pkv is None or pkv.get("splits") is None else f", split {pkv['splits']}"
            best = None if pkv is None else {"engine": pkv["engine"] + split, "ratio": ratio,
                                             "text": "-" if ratio is None else f"{ratio:.3f}"}
            out.append({"case": case, "source": Path(path).name, "seeds": "-",
                        "baseline": fi["engine"] if fi else "-", "cuda": best, "wall": None})
    return out


def _best_engine(engines: dict[str, list[dict]], key: str) -> dict | None:
    """The engine whose mean ``key`` ratio over seeds is highest, with that mean and mean ± std."""
    means = {e: statistics.fmean(x[key] for x in es) for e, es in engines.items()}
    if not means:
        return None
    e = max(means, key=means.get)
    return {"engine": e, "ratio": means[e], "text": fmt_pm([x[key] for x in engines[e]])}


def _candidates(key: str, engines: dict[str, list[dict]], failed: list[str]) -> dict[str, list[dict]]:
    """The pkvrt-* engines of a trace whose every seed passed correctness; the others are
    appended to ``failed`` as "trace: engine"."""
    out = {}
    for engine, entries in engines.items():
        if not engine.startswith("pkvrt") or entries[0].get("baseline"):
            continue
        if all(e["cuda_ratio"] is not None for e in entries):
            out[engine] = entries
        else:
            failed.append(f"{key}: {engine}")
    return out


def serving_coverage(files) -> tuple[list[dict], list[str]]:
    """Per serving trace of Table 2: the pkvrt-* engine with the best mean CUDA ratio and the one
    with the best mean wall ratio over seeds (ratios from ``serving_groups``), and the engines
    left out because a seed failed correctness ("trace: engine")."""
    traces: dict[str, dict[str, list[dict]]] = collections.OrderedDict()
    for (key, engine), entries in serving_groups(files).items():
        traces.setdefault(key, {})[engine] = entries
    out: list[dict] = []
    failed: list[str] = []
    for key, engines in traces.items():
        every = [e for entries in engines.values() for e in entries]
        bases = collections.Counter(e["engine"] for e in every if e.get("baseline"))
        cands = _candidates(key, engines, failed)
        out.append({"case": key, "source": ", ".join(sorted({Path(e["file"]).name for e in every})),
                    "seeds": len({e["case"] for e in every}),
                    "baseline": ", ".join(f"{b} ({n})" if len(bases) > 1 else b
                                          for b, n in bases.most_common()),
                    "cuda": _best_engine(cands, "cuda_ratio"),
                    "wall": _best_engine(cands, "wall_ratio")})
    return out, failed


def _coverage_cells(best: dict | None) -> tuple[str, str, str]:
    if best is None:
        return "-", "-", "-"
    return best["engine"], best["text"], verdict(best["ratio"])


def coverage_table(files) -> str:
    """Table 6: one row per measured case (isolated cases, then serving traces)."""
    iso = isolated_coverage(files)
    serving, failed = serving_coverage(files)
    if not iso and not serving:
        return "No data: no isolated or serving results files."
    rows = [(c["case"], c["source"], c["baseline"], c["seeds"], *_coverage_cells(c["cuda"]),
             *_coverage_cells(c["wall"])) for c in iso + serving]
    notes = ["Ratio = FlashInfer time / pkvrt time (serving: decode-token throughput ratio against "
             "each seed's baseline row, mean ± std over seeds). Verdict: pkvrt faster if ratio >= "
             f"{FASTER}, tie if {SLOWER} <= ratio < {FASTER}, FlashInfer faster below {SLOWER}."]
    protocols = sorted({str(d["meta"]["protocol"]) for _, d in _of_kind(files, "isolated")
                        if d["meta"].get("protocol")})
    if iso:
        notes.append("Isolated cases: kernel time only (no wall measure), best split per engine, "
                     "against the case's baseline (FlashInfer's fastest path, named in the "
                     "Baseline column)"
                     + (f"; protocol: {'; '.join(protocols)}." if protocols else "."))
    for label, key in (("CUDA events (isolated and serving)", "cuda"), ("wall (serving)", "wall")):
        counts = collections.Counter(verdict(c[key]["ratio"]) for c in iso + serving if c[key])
        if counts:
            notes.append(f"Verdicts, {label}: " + ", ".join(
                f"{v} {counts[v]}" for v in ("pkvrt faster", "tie", "FlashInfer faster", "-")
                if counts[v]) + ".")
    if failed:
        notes.append("Not candidates (a seed failed correctness): " + "; ".join(failed) + ".")
    return md_table(("Case", "Source", "Baseline", "Seeds", "Best pkvrt (CUDA events)", "CUDA ratio",
                     "CUDA verdict", "Best pkvrt (wall)", "Wall ratio", "Wall verdict"),
                    rows, align="lllrlrllrl") + "\n\n" + "\n".join(f"- {n}" for n in notes)


# --------------------------------------------------------------------------- Table 7

def split_groups(doc) -> dict[tuple[str, str], list[dict]]:
    """(case, engine) -> its rows sorted by split, for the groups with more than one split value."""
    groups: dict[tuple[str, str], list[dict]] = collections.OrderedDict()
    for r in doc["rows"]:
        if r.get("splits") is not None:
            groups.setdefault((r["case"], r["engine"]), []).append(r)
    return {k: sorted(rows, key=lambda r: r["splits"]) for k, rows in groups.items()
            if len({r["splits"] for r in rows}) > 1}


def split_rows(rows, refs) -> tuple[dict | None, list[tuple]]:
    """The fastest row of a sweep group, and the table rows: one per split with its time relative
    to the fastest (1.000 = best, marked), then the reference rows (FlashInfer of the same case)."""
    timed = [r for r in rows if _is_number(r.get("median_us")) and r["median_us"] > 0]
    best = min(timed, key=lambda r: r["median_us"], default=None)

    def rel(r):
        ok = best is not None and _is_number(r.get("median_us"))
        return f"{r['median_us'] / best['median_us']:.3f}" if ok else "-"
    out = []
    for r in rows:
        us = f"{r['median_us']:.2f}" if _is_number(r.get("median_us")) else "FAILED"
        work = f"{r['cta_work_per_sm']:.2f}" if _is_number(r.get("cta_work_per_sm")) else "-"
        out.append((r["splits"], us, work, rel(r), "best" if r is best else ""))
    for r in refs:
        us = f"{r['median_us']:.2f}" if _is_number(r.get("median_us")) else "FAILED"
        out.append((f"{r['engine']} (no split)", us, "-", rel(r), "reference"))
    return best, out


def split_table(files) -> str:
    """Table 7: per (case, engine) sweep of a calibration-sweeps file, µs against the split."""
    parts = []
    for path, doc in _of_kind(files, SWEEPS):
        for (case, engine), rows in split_groups(doc).items():
            refs = [r for r in doc["rows"] if r["case"] == case and r.get("splits") is None
                    and r["engine"].startswith("flashinfer")]
            best, table_rows = split_rows(rows, refs)
            head = (f"best: {best['splits']} splits, {best['median_us']:.2f} µs" if best
                    else "no timed split")
            parts.append(f"**{case} · {engine}** ({Path(path).name}; {head})\n\n" + md_table(
                ("Splits", "µs", "CTA work/SM", "Time vs best split", "Best"), rows=table_rows,
                align="rrrrl"))
    if not parts:
        return (f"No data: no {SWEEPS} file with a split sweep (more than one split value for a "
                "case and engine).")
    return "\n\n".join(parts)


# --------------------------------------------------------------------------- per-step data

def context_bin(tokens: int) -> tuple[int, int]:
    """Power-of-two bin of a context length: 20000 -> (16384, 32768)."""
    lo = 1 << (max(1, int(tokens)).bit_length() - 1)
    return lo, 2 * lo


def bin_label(lo: int, hi: int) -> str:
    """(16384, 32768) -> "16K-32K"; (512, 1024) -> "512-1K"."""
    def k(x):
        return f"{x // 1024}K" if x >= 1024 else str(x)
    return f"{k(lo)}-{k(hi)}"


def paired_steps(files, *, min_layers: int = 1):
    """Yield (file meta, engine record, baseline record) for every non-baseline per-step record
    that has a baseline record of the same case and step in the same file, from the files of at
    least ``min_layers`` layers.

    A (case, engine) recorded in several files (a later run re-timing an engine on the same
    seeds) is taken from the newest file only (``meta.date``; the first of equal dates), as
    Tables 2 and 3 count it: one record per measured step, never two."""
    docs = [(p, d) for p, d in _of_kind(files, "serving-steps")
            if int(d["meta"].get("layers") or 1) >= min_layers]
    newest: dict[tuple[str, str], tuple[str, str]] = {}      # (case, engine) -> (date, path)
    for path, doc in docs:
        date = str(doc["meta"].get("date") or "")
        for r in doc["rows"]:
            key = (r["case"], r["engine"])
            if not r.get("baseline") and (key not in newest or date > newest[key][0]):
                newest[key] = (date, path)
    for path, doc in docs:
        base = {(r["case"], r["step"]): r for r in doc["rows"] if r.get("baseline")}
        for r in doc["rows"]:
            b = base.get((r["case"], r["step"]))
            if b is not None and not r.get("baseline") \
                    and newest[(r["case"], r["engine"])][1] == path:
                yield doc["meta"], r, b


def baseline_text(baselines: dict[str, str]) -> str:
    """Name the baseline of a group of seeds from {case: baseline engine}: the engine when every
    seed has the same one, else each with its share, most first: ``{"s1": "fi-cuda", "s2":
    "fi-cuda", "s3": "fi-tc"}`` -> "fi-cuda (2/3 seeds), fi-tc (1/3 seeds)"."""
    counts = collections.Counter(baselines.values()).most_common()
    if len(counts) == 1:
        return counts[0][0]
    return ", ".join(f"{e} ({n}/{len(baselines)} seeds)" for e, n in counts)


def ratio_by_context(files) -> list[dict]:
    """Per experiment (the case without its seed: trace, B, G, L), engine and context bin (the
    step's longest context): the steps and the throughput ratio over them, ``sum(baseline time) /
    sum(engine time)`` (every step has the same tokens on both). ``baseline`` names the baseline
    engine of the (experiment, engine)'s seeds (:func:`baseline_text`)."""
    acc = collections.defaultdict(lambda: [0, 0.0, 0.0, 0.0, 0.0])
    bases: dict[tuple[str, str], dict[str, str]] = collections.defaultdict(dict)
    for _, r, b in paired_steps(files):
        exp = trace_key(r["case"])
        bases[(exp, r["engine"])][r["case"]] = b["engine"]
        a = acc[(exp, r["engine"], context_bin(r["max_context"]))]
        a[0] += 1
        a[1] += b["wall_us"]
        a[2] += r["wall_us"]
        a[3] += b["cuda_us"]
        a[4] += r["cuda_us"]
    return [{"experiment": x, "engine": e, "baseline": baseline_text(bases[(x, e)]), "bin": bin_,
             "steps": n, "wall_ratio": bw / ew, "cuda_ratio": bc / ec}
            for (x, e, bin_), (n, bw, ew, bc, ec) in sorted(acc.items())]


def kv_element_bytes(meta: dict) -> int:
    """Bytes of one K/V element of a results file: 1 where ``meta.kv_dtype`` is an FP8 dtype
    (``pkvrt bench serving --kv-dtype fp8``), else 2 (fp16/bf16; files without the key)."""
    return 1 if str(meta.get("kv_dtype") or "").startswith("float8") else 2


def step_floor_us(record: dict, meta: dict) -> float:
    """The read floor of one per-step record: the step's K+V bytes over every layer,
    ``active * mean_context * 2 * H_kv * D * KV element bytes * layers``, at 4.2 TB/s."""
    sh = meta.get("shape") or {}
    per_token = 2 * int(sh.get("num_kv_heads", 8)) * int(sh.get("head_dim", 128)) * kv_element_bytes(meta)
    tokens = record["active"] * record["mean_context"]
    return tokens * per_token * int(meta.get("layers") or 1) / FLOOR_BYTES_PER_US


def engine_protocol_rows(files) -> list[dict]:
    """Per (trace, engine, baseline) of the multi-layer (engine protocol) per-step files: steps,
    the fraction of the read floor (sum of floors / sum of CUDA-event times), the baseline's, the
    throughput ratio over the steps, and the 5th percentile and minimum of the per-step ratio."""
    acc = collections.OrderedDict()
    for meta, r, b in paired_steps(files, min_layers=2):
        a = acc.setdefault((trace_key(r["case"]), r["engine"], b["engine"]),
                           {"floor": 0.0, "us": 0.0, "base_us": 0.0, "ratios": []})
        a["floor"] += step_floor_us(r, meta)
        a["us"] += r["cuda_us"]
        a["base_us"] += b["cuda_us"]
        a["ratios"].append(b["cuda_us"] / r["cuda_us"])
    out = []
    for (key, engine, base), a in acc.items():
        rs = sorted(a["ratios"])
        out.append({"trace": key, "engine": engine, "baseline": base, "steps": len(rs),
                    "floor_fraction": a["floor"] / a["us"], "baseline_floor_fraction": a["floor"] / a["base_us"],
                    "ratio": a["base_us"] / a["us"], "p5": float(np.percentile(rs, 5)), "min": rs[0]})
    return out


def engine_protocol_table(rows: list[dict]) -> str:
    cells = [(r["trace"], r["engine"], r["baseline"], r["steps"], f"{r['floor_fraction']:.3f}",
              f"{r['baseline_floor_fraction']:.3f}", f"{r['ratio']:.3f}", f"{r['p5']:.3f}",
              f"{r['min']:.3f}") for r in rows]
    return md_table(("Trace", "Engine", "Baseline", "Steps", "Floor fraction", "Baseline's",
                     "CUDA ratio (summed)", "Per-step ratio p5", "min"), cells,
                    align="lllrrrrrr") if cells else ""


def engine_step_points(files, engine: str) -> list[dict]:
    """One point per measured step of ``engine`` in the engine-protocol per-step files (the
    steps the engine-protocol table counts): its experiment, the experiment's baseline
    (:func:`baseline_text`), active rows, total tokens and the per-step CUDA ratio."""
    pts, bases = [], collections.defaultdict(dict)
    for _, r, b in paired_steps(files, min_layers=2):
        if r["engine"] == engine:
            exp = trace_key(r["case"])
            bases[exp][r["case"]] = b["engine"]
            pts.append({"experiment": exp, "active": r["active"],
                        "tokens": r["active"] * r["mean_context"],
                        "ratio": b["cuda_us"] / r["cuda_us"]})
    return [dict(p, baseline=baseline_text(bases[p["experiment"]])) for p in pts]


def route_map_cells(files, engine: str = "pkvrt-adaptive") -> list[dict]:
    """Per experiment and (active rows, context bin) of ``engine``'s steps: the route it took
    most often, that route's share, and the wall / CUDA throughput ratio against the baseline
    (named per experiment, :func:`baseline_text`) over those steps."""
    acc: dict = collections.defaultdict(lambda: [collections.Counter(), 0.0, 0.0, 0.0, 0.0])
    bases: dict[str, dict[str, str]] = collections.defaultdict(dict)
    for _, r, b in paired_steps(files):
        if r["engine"] != engine:
            continue
        exp = trace_key(r["case"])
        bases[exp][r["case"]] = b["engine"]
        a = acc[(exp, r["active"], context_bin(r["max_context"]))]
        a[0][r["route"]] += 1
        a[1] += b["wall_us"]
        a[2] += r["wall_us"]
        a[3] += b["cuda_us"]
        a[4] += r["cuda_us"]
    out = []
    for (exp, active, bin_), (routes, bw, ew, bc, ec) in sorted(acc.items()):
        route, n = routes.most_common(1)[0]
        total = sum(routes.values())
        out.append({"experiment": exp, "baseline": baseline_text(bases[exp]), "active": active,
                    "bin": bin_, "route": route, "share": n / total, "steps": total,
                    "wall_ratio": bw / ew, "cuda_ratio": bc / ec})
    return out


def context_table(data: list[dict]) -> str:
    rows = [(d["experiment"], d["engine"], d["baseline"], bin_label(*d["bin"]), d["steps"],
             f"{d['cuda_ratio']:.3f}", f"{d['wall_ratio']:.3f}") for d in data]
    return md_table(("Experiment", "Engine", "Baseline", "Longest context", "Steps", "CUDA ratio",
                     "Wall ratio"), rows, align="lllrrrr") if rows else ""


def route_map_table(cells: list[dict]) -> str:
    rows = [(c["experiment"], c["baseline"], c["active"], bin_label(*c["bin"]), c["route"],
             f"{100 * c['share']:.0f}%", c["steps"], f"{c['cuda_ratio']:.3f}",
             f"{c['wall_ratio']:.3f}") for c in cells]
    return md_table(("Experiment", "Baseline", "Active rows", "Longest context", "Route", "Share",
                     "Steps", "CUDA ratio", "Wall ratio"), rows, align="llrllrrrr") if rows else ""


# --------------------------------------------------------------------------- other files

def generic_table(path, doc) -> str:
    """All rows of a file as a table; columns are the union of keys in first-seen order."""
    cols: list[str] = []
    for r in doc["rows"]:
        cols += [k for k in r if k not in cols]

    def cell(v):
        if isinstance(v, float):
            return f"{v:.4g}"
        return "-" if v is None else json.dumps(v) if isinstance(v, (dict, list)) else str(v)
    rows = [tuple(cell(r.get(c)) for c in cols) for r in doc["rows"]]
    title = f"**{Path(path).name}** (kind: {file_kind(doc)}, {len(rows)} rows)"
    return title + "\n\n" + (md_table(cols, rows, align="l" * len(cols)) if rows else "(no rows)")


# --------------------------------------------------------------------------- plots
# Each plot draws the numbers of one table above, one panel per experiment (trace, B, G, L), so
# that no series mixes batch sizes, group sizes, layer counts or baselines.

def _pyplot():
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    return plt


def _panels(plt, n: int, *, ncols: int = 4, size: tuple[float, float] = (4.6, 3.4)):
    """A figure with ``n`` panels in rows of ``ncols`` (the unused cells removed), laid out by
    matplotlib's constrained layout; returns (figure, list of ``n`` axes)."""
    ncols = min(n, ncols)
    nrows = -(-n // ncols)
    fig, axes = plt.subplots(nrows, ncols, figsize=(size[0] * ncols, size[1] * nrows),
                             squeeze=False, layout="constrained")
    for ax in axes.flat[n:]:
        fig.delaxes(ax)
    return fig, list(axes.flat[:n])


def _by_experiment(items: list[dict]) -> dict[str, list[dict]]:
    out: dict[str, list[dict]] = collections.OrderedDict()
    for it in items:
        out.setdefault(it["experiment"], []).append(it)
    return out


def _bin_x(bin_: tuple[int, int]) -> float:
    """Where a power-of-two context bin sits on a log axis: its geometric middle."""
    return math.sqrt(bin_[0] * bin_[1])


def plot_ratio_vs_context(data: list[dict], path: Path) -> None:
    """The throughput-ratio-by-context table: one panel per experiment, one colour per engine
    (the legend names its baseline), CUDA-event ratio solid, wall ratio dashed."""
    plt = _pyplot()
    groups = _by_experiment(data)
    engines = list(dict.fromkeys(d["engine"] for d in data))
    color = {e: plt.get_cmap("tab10")(i % 10) for i, e in enumerate(engines)}
    fig, axes = _panels(plt, len(groups))
    for ax, (exp, rows) in zip(axes, groups.items()):
        for e in dict.fromkeys(d["engine"] for d in rows):
            pts = [d for d in rows if d["engine"] == e]
            x = [_bin_x(d["bin"]) for d in pts]
            ax.plot(x, [d["cuda_ratio"] for d in pts], marker="o", color=color[e],
                    label=f"{e} vs {pts[0]['baseline']}")
            ax.plot(x, [d["wall_ratio"] for d in pts], marker="x", ls="--", color=color[e])
        ax.axhline(1.0, color="grey", lw=0.8, ls=":")
        ax.set_xscale("log", base=2)
        ax.set_title(exp, fontsize=9)
        ax.legend(fontsize=6)
    fig.suptitle("Decode-token throughput ratio vs the baseline by longest context, per experiment "
                 "(solid: CUDA events, dashed: wall; steps per point: the table)")
    fig.supxlabel("longest context in the step (tokens, power-of-two bins)")
    fig.supylabel("engine / baseline")
    fig.savefig(path, dpi=110)
    plt.close(fig)


def plot_route_map(cells: list[dict], path: Path) -> None:
    """The route-map table: one panel per experiment, the adaptive engine's route per (active
    rows, context bin) as a coloured square labelled by the wall ratio vs the named baseline."""
    plt = _pyplot()
    from matplotlib.lines import Line2D

    groups = _by_experiment(cells)
    routes = list(dict.fromkeys(c["route"] for c in cells))
    color = {r: plt.get_cmap("tab10")(i % 10) for i, r in enumerate(routes)}
    fig, axes = _panels(plt, len(groups))
    for ax, (exp, cs) in zip(axes, groups.items()):
        x, y = [c["active"] for c in cs], [_bin_x(c["bin"]) for c in cs]
        ax.scatter(x, y, s=260, marker="s", color=[color[c["route"]] for c in cs])
        for c, xi, yi in zip(cs, x, y):
            ax.annotate(f"{c['wall_ratio']:.2f}", (xi, yi), ha="center", va="center", fontsize=6,
                        color="white")
        ax.set_xlim(0.3, max(x) + 0.7)
        ax.set_xticks(range(1, max(x) + 1))
        ax.set_yscale("log", base=2)
        ax.margins(y=0.15)
        ax.set_title(f"{exp}\nvs {cs[0]['baseline']}", fontsize=8)
    fig.legend(handles=[Line2D([], [], marker="s", ls="", color=color[r], label=r) for r in routes],
               loc="outside right upper", title="route", fontsize=8)
    fig.suptitle("Route of pkvrt-adaptive per (active rows, longest context), per experiment; "
                 "label: wall ratio vs the baseline")
    fig.supxlabel("active rows")
    fig.supylabel("longest context (tokens)")
    fig.savefig(path, dpi=110)
    plt.close(fig)


def plot_step_ratios(pts: list[dict], engine: str, path: Path) -> None:
    """Every measured engine-protocol step of ``engine`` (the steps the engine-protocol table
    counts), one panel per experiment: per-step CUDA ratio vs the named baseline against (active
    rows, total tokens); a step that loses shows red, on one colour scale for all panels."""
    plt = _pyplot()
    from matplotlib.colors import TwoSlopeNorm

    ratios = [p["ratio"] for p in pts]
    norm = TwoSlopeNorm(vmin=min(min(ratios), 0.9), vcenter=1.0, vmax=max(max(ratios), 1.1))
    groups = _by_experiment(pts)
    fig, axes = _panels(plt, len(groups))
    rng = np.random.default_rng(0)   # spread the integer row counts a little so points show
    for ax, (exp, ps) in zip(axes, groups.items()):
        sc = ax.scatter([p["active"] + rng.uniform(-0.25, 0.25) for p in ps],
                        [p["tokens"] for p in ps], c=[p["ratio"] for p in ps], cmap="RdYlGn",
                        norm=norm, s=14)
        ax.set_xticks(range(1, max(p["active"] for p in ps) + 1))
        ax.set_yscale("log", base=2)
        ax.set_title(f"{exp} vs {ps[0]['baseline']} ({len(ps)} steps)", fontsize=8)
    fig.colorbar(sc, ax=axes, label="per-step CUDA ratio vs the baseline (>1: faster)")
    fig.suptitle(f"{engine}: engine protocol, every measured step, per experiment")
    fig.supxlabel("active rows in the step")
    fig.supylabel("total tokens in the step (KV read per layer)")
    fig.savefig(path, dpi=110)
    plt.close(fig)


def _have_matplotlib() -> bool:
    try:
        import matplotlib  # noqa: F401
    except ImportError:
        return False
    return True


# --------------------------------------------------------------------------- the report

def build_report(files, out_dir: Path, *, plots: bool = True) -> tuple[str, list[str]]:
    """The Markdown text and the notes printed by the command; draws the plots into ``out_dir``
    unless ``plots`` is False. Raises ValueError, before writing anything, when there are
    per-step records to plot, ``plots`` is True and matplotlib is not installed."""
    by_ctx = ratio_by_context(files)
    cells = route_map_cells(files)
    engine_rows = engine_protocol_rows(files)
    if plots and (by_ctx or cells) and not _have_matplotlib():
        raise ValueError(NO_MATPLOTLIB)
    parts = ["# pkvrt results report", "", "| File | Kind | GPU | Date | Commit |", "|---|---|---|---|---|"]
    for path, doc in files:
        m = doc["meta"]
        parts.append(f"| {Path(path).name} | {file_kind(doc)} | {m.get('gpu') or '-'} | "
                     f"{m.get('date') or '-'} | {m.get('pkvrt_commit') or '-'} |")
    sections = [
        (f"Table 1: isolated decode attention (best split per engine; fraction of the "
         f"{FLOOR_GBPS / 1e3:g} TB/s read floor)", isolated_table(files)),
        ("Table 2: serving throughput against the baseline (mean ± std over seeds)",
         serving_table(files)),
        ("Baseline probe: every FlashInfer decode path per serving run", baseline_probe_table(files)),
        ("Table 3: absolute serving throughput (mean ± std over seeds; -L<n>-mlp cases are the "
         "model-level proxy)", throughput_table(files)),
        ("Table 4: structural counters, mean per step", counters_table(files)),
        ("Table 5: hardware counters (Nsight Compute)", ncu_table(files)),
        ("Table 6: coverage map (from the measured results)", coverage_table(files)),
        ("Table 7: split sensitivity (calibration seed sweeps)", split_table(files)),
        (f"Engine protocol: fraction of the read floor (KV bytes at {FLOOR_GBPS / 1e3:g} TB/s) and "
         "per-step ratios", engine_protocol_table(engine_rows)),
        ("Throughput ratio by longest context (per-step records, per experiment)",
         context_table(by_ctx)),
        ("Route map of the adaptive engine (per-step records, per experiment)",
         route_map_table(cells)),
        ("Whole-model decode (Llama-3-8B shape, one CUDA graph per step): ms/step, tokens/s, "
         "attention share", model_decode_table(files)),
        ("Tensor-parallel decode (Llama-3-8B shape, TP ranks, one CUDA graph per rank and step): "
         "ms/step, tokens/s, scaling efficiency, attention and all-reduce shares", tp_decode_table(files)),
    ]
    handled = {"isolated", "serving", "serving-steps", "plan", NCU, MODEL_KIND, TP_KIND}
    for path, doc in files:
        if file_kind(doc) not in handled:
            sections.append((f"Other results: {Path(path).name}", generic_table(path, doc)))
    for title, body in sections:
        if body:
            parts += ["", f"## {title}", "", body]
    if not by_ctx and not cells:
        note = "No per-step records (.steps.json files) to plot."
        parts += ["", note]
    elif not plots:
        note = PLOTS_OFF
        parts += ["", note]
    else:
        out_dir.mkdir(parents=True, exist_ok=True)
        drawn = []
        if by_ctx:
            plot_ratio_vs_context(by_ctx, out_dir / "ratio_vs_context.png")
            drawn.append("ratio_vs_context.png")
        if cells:
            plot_route_map(cells, out_dir / "route_map.png")
            drawn.append("route_map.png")
        for engine in dict.fromkeys(r["engine"] for r in engine_rows):
            pts = engine_step_points(files, engine)
            if pts:
                name = f"steps_{engine}.png"
                plot_step_ratios(pts, engine, out_dir / name)
                drawn.append(name)
        parts += ["", "## Plots", ""] + [f"![{p}]({p})" for p in drawn]
        note = "wrote plots: " + ", ".join(drawn)
    return "\n".join(parts) + "\n", [note]


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """Arguments of ``pkvrt report``."""
    parser.add_argument("results_dir", metavar="RESULTS_DIR",
                        help="directory of results JSON files (pkvrt bench, benches/isolated.py)")
    parser.add_argument("--out", metavar="DIR",
                        help="where report.md and the plots go (default: RESULTS_DIR/report)")
    parser.add_argument("--no-plots", action="store_true",
                        help="write report.md with the tables only (no matplotlib needed); plot "
                             "files already in DIR are left as they are, without links")


def run(args: argparse.Namespace) -> int:
    """``pkvrt report``: write DIR/report.md (and plots); returns 0."""
    files = load_dir(args.results_dir)
    out = Path(args.out) if args.out else Path(args.results_dir) / "report"
    text, notes = build_report(files, out, plots=not args.no_plots)
    out.mkdir(parents=True, exist_ok=True)
    (out / "report.md").write_text(text, encoding="utf-8")
    print(f"read {len(files)} results file(s) from {args.results_dir}")
    for n in notes:
        print(n)
    print(f"wrote {out / 'report.md'}")
    return 0
