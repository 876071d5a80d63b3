"""The numbers behind ``pkvrt report``: reading and checking results files, and every quantity
its tables and plots show, as plain Python data (no Markdown; see :mod:`report_tables`).

Ratios are only ever formed between rows of one file, and a (case, engine) measured in several
files counts once, from the newest file (``meta.date``).
"""

from __future__ import annotations

import collections
import json
import re
import statistics
from pathlib import Path
from typing import Callable

import numpy as np

from pkvrt.measure import coverage_results, results

NUMERIC = ("median_us", "wall_us", "tok_per_s", "cuda_tok_per_s", "gbps", "frac_read_bw",
           "max_err", "mean_err", "max_err_ref", "mean_err_ref", "cuda_ratio", "wall_ratio",
           "mean_cuda_us", "mean_wall_us", "launches_per_step", "cta_work_per_sm",
           "useful_kv_mb", "merge_mb", "merge_launches", "duration_us", "dram_pct_of_peak",
           "dram_read_mb", "l2_hit_pct", "achieved_occupancy_pct", "sm_pct_of_peak", "grid", "registers")
SERVING_TIMES = ("median_us", "wall_us", "tok_per_s", "cuda_tok_per_s")
STEP_KEYS = {"step": int, "active": int, "max_context": int, "wall_us": float, "cuda_us": float,
             "route": str}
FASTER, SLOWER = 1.02, 0.98   # verdict band: ratio >= 1.02 pkvrt faster, < 0.98 FlashInfer faster
NEAR_BEST = 1.02              # a split within 2 % of its group's best time counts as near-best
SWEEPS = "calibration-sweeps"
NCU = "ncu"
GENERIC = "generic"
FLOOR_BYTES_PER_US = 4.2e6   # the floor's read bandwidth, 4.2 TB/s (DESIGN.md "H200 anchors")
FLOOR_GBPS = FLOOR_BYTES_PER_US / 1e3


# --------------------------------------------------------------------------- reading

def _is_number(v) -> bool:
    return isinstance(v, (int, float)) and not isinstance(v, bool)


def file_kind(doc: dict) -> str:
    """``serving``, ``serving-steps``, ``isolated``, ``plan``, the file's own ``meta.kind``, or
    ``generate`` for a generation file written without one (``generic`` otherwise)."""
    kind = doc["meta"].get("kind")
    if isinstance(kind, str) and kind.startswith("plan"):
        return "plan"
    if kind:
        return str(kind)
    if coverage_results.is_generate(doc):
        return coverage_results.GENERATE
    return "isolated" if "isolated" in str(doc["meta"].get("protocol", "")) else GENERIC


def _check_names(where: str, row: dict, kind: str) -> None:
    """The row's identifying strings: ``kernel`` in ncu files, ``decoder`` in generation files,
    else ``case`` and ``engine``. A row of a generic file (no ``meta.kind``) that carries neither
    is a plain row (e.g. benches/plan_cost.py's), shown as it is; one that names only one of them
    is an error."""
    keys = {NCU: ("kernel",), coverage_results.GENERATE: ("decoder",)}.get(kind, ("case", "engine"))
    if kind == GENERIC and not any(k in row for k in keys):
        return
    for key in keys:
        if not isinstance(row.get(key), str) or not row[key]:
            raise ValueError(f"{where}: key {key!r}: expected a non-empty string, got {row.get(key)!r}")


def _check_numbers(where: str, row: dict, kind: str) -> None:
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


def validate(path, doc: dict) -> None:
    """Check the rows of one results document; a ValueError names the file, row and key."""
    if not isinstance(doc["meta"], dict):
        raise ValueError(f"{path}: key 'meta': expected an object, got {type(doc['meta']).__name__}")
    kind = file_kind(doc)
    for i, row in enumerate(doc["rows"]):
        where = f"{path}: rows[{i}]"
        if not isinstance(row, dict):
            raise ValueError(f"{where}: expected an object, got {row!r}")
        _check_names(where, row, kind)
        _check_numbers(where, row, kind)


def results_files(directory) -> list[Path]:
    """The results files ``pkvrt report`` reads: every ``*.json`` directly in ``directory``
    (not in its subfolders), sorted by name. Raises ValueError when there is none."""
    d = Path(directory)
    if not d.is_dir():
        raise ValueError(f"{d}: expected a directory of results files")
    files = sorted(d.glob("*.json"))
    if not files:
        raise ValueError(f"{d}: no results files (*.json) found")
    return files


def read_file(path: Path) -> dict:
    """One results file, read and validated; a ValueError names it."""
    try:
        doc = results.read_results(path)
    except json.JSONDecodeError as e:
        raise ValueError(f"{path}: not a pkvrt results file: invalid JSON at line {e.lineno} "
                         f"column {e.colno}: {e.msg}") from None
    validate(path, doc)
    return doc


def load_dir(directory, progress: Callable[[str], None] | None = None) -> list[tuple[str, dict]]:
    """Every results file of ``directory`` (:func:`results_files`), read and validated.

    Parameters
    ----------
    directory : str or Path
        The results directory; only its top-level ``*.json`` files are read.
    progress : callable, optional
        Called with one line ("reading N results files ...") before the files are read.

    Returns
    -------
    list of (str, dict)
        (path, document) per file, sorted by name.

    Raises
    ------
    ValueError
        For a missing or empty directory, or a malformed file (the message names it).
    """
    files = results_files(directory)
    if progress:
        progress(f"reading {len(files)} results file(s) (*.json) from {directory}")
    return [(str(f), read_file(f)) for f in files]


def trace_key(case: str) -> str:
    """``bimodal-B8-seed20260623`` -> ``bimodal-B8`` (the case over seeds)."""
    return re.sub(r"-seed\d+$", "", case)


def of_kind(files, kind):
    """The (path, doc) pairs of ``files`` whose :func:`file_kind` is ``kind``."""
    return [(p, d) for p, d in files if file_kind(d) == kind]


def _fastest(rows, prefix: str):
    return min((r for r in rows if r["engine"].startswith(prefix)), key=lambda r: r["median_us"],
               default=None)


# --------------------------------------------------------------------------- isolated kernels

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


def isolated_best(doc) -> tuple[dict[str, dict[str, dict]], list[dict]]:
    """The fastest row per (case, engine) of one isolated file ({case: {engine: row}}), and the
    rows without a time (failed or unavailable engines)."""
    cases: dict[str, dict[str, dict]] = {}
    failed = []
    for r in doc["rows"]:
        if not _is_number(r.get("median_us")):
            failed.append(r)
            continue
        best = cases.setdefault(r["case"], {})
        if r["engine"] not in best or r["median_us"] < best[r["engine"]]["median_us"]:
            best[r["engine"]] = r
    return cases, failed


# --------------------------------------------------------------------------- serving

def _serving_baselines(path, measured) -> dict[str, dict]:
    bases: dict[str, dict] = {}
    for r in measured:
        if r.get("baseline"):
            if r["case"] in bases:
                raise ValueError(f"{path}: case {r['case']!r}: two baseline rows "
                                 f"({bases[r['case']]['engine']}, {r['engine']})")
            bases[r["case"]] = r
    return bases


def _serving_entry(path, doc, r, b) -> dict:
    timed = r.get("correct", True) and b.get("correct", True)
    return dict(r, file=path, file_date=str(doc["meta"].get("date") or ""),
                cuda_ratio=r["cuda_tok_per_s"] / b["cuda_tok_per_s"] if timed else None,
                wall_ratio=r["tok_per_s"] / b["tok_per_s"] if timed else None)


def serving_groups(files) -> dict[tuple[str, str], list[dict]]:
    """(trace key, engine) -> one entry per (file, case): the measured row plus its ``cuda_ratio``
    and ``wall_ratio`` against the baseline row of the same case in the same file (None when
    either failed correctness). A (case, engine) measured in several files (a later run adding
    an engine re-times the others) counts once: the newest file's (``meta.date``), so a seed is
    never averaged in twice. Raises ValueError for a case with no baseline row."""
    groups: dict[tuple[str, str], list[dict]] = collections.OrderedDict()
    for path, doc in of_kind(files, "serving"):
        measured = [r for r in doc["rows"] if r.get("row", "measured") == "measured"]
        bases = _serving_baselines(path, measured)
        for r in measured:
            b = bases.get(r["case"])
            if b is None:
                raise ValueError(f"{path}: case {r['case']!r}: no baseline row "
                                 "(expected one row with \"baseline\": true)")
            entry = _serving_entry(path, doc, r, b)
            group = groups.setdefault((trace_key(r["case"]), r["engine"]), [])
            same = [i for i, e in enumerate(group) if e["case"] == r["case"]]
            if not same:
                group.append(entry)
            elif entry["file_date"] > group[same[0]]["file_date"]:
                group[same[0]] = entry
    return groups


# --------------------------------------------------------------------------- coverage (Table 6)

def isolated_coverage(files) -> list[dict]:
    """Per case of every isolated file: the fastest pkvrt-* engine at its best split and
    ``FlashInfer µs / pkvrt µs`` against the case's baseline (:func:`isolated_baseline`).
    Isolated files time kernels only, so ``wall`` is None."""
    out = []
    for path, doc in of_kind(files, "isolated"):
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


def fmt_pm(values, digits: int = 3) -> str:
    """Mean ± sample std: [1.2, 1.3] -> "1.250 ± 0.071"; one value -> "1.200"."""
    vals = [v for v in values if v is not None]
    if not vals:
        return "-"
    mean = sum(vals) / len(vals)
    if len(vals) == 1:
        return f"{mean:.{digits}f}"
    return f"{mean:.{digits}f} ± {statistics.stdev(vals):.{digits}f}"


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


# --------------------------------------------------------------------------- split sweeps (Table 7)

def split_groups(doc) -> dict[tuple[str, str], list[dict]]:
    """(case, engine) -> its rows sorted by split, for the groups with more than one split value."""
    groups: dict[tuple[str, str], list[dict]] = collections.OrderedDict()
    for r in doc["rows"]:
        if r.get("splits") is not None:
            groups.setdefault((r["case"], r["engine"]), []).append(r)
    return {k: sorted(rows, key=lambda r: r["splits"]) for k, rows in groups.items()
            if len({r["splits"] for r in rows}) > 1}


def split_references(doc, case: str) -> list[dict]:
    """The FlashInfer rows (no split) of ``case`` in one sweeps file: the references of its groups."""
    return [r for r in doc["rows"] if r["case"] == case and r.get("splits") is None
            and r["engine"].startswith("flashinfer")]


def split_best(rows) -> dict | None:
    """The fastest timed row of a sweep group (None when no split has a time)."""
    timed = [r for r in rows if _is_number(r.get("median_us")) and r["median_us"] > 0]
    return min(timed, key=lambda r: r["median_us"], default=None)


def split_group_stats(rows, refs) -> dict | None:
    """One sweep group (rows sorted by split) in numbers: ``best`` (row), ``near`` (the splits
    within :data:`NEAR_BEST` of the best time), ``neighbour`` (the slower of the swept splits
    either side of the best, over the best time; None when the best is the only timed split),
    ``worst`` (slowest / best time) and ``reference`` (fastest FlashInfer reference time / best,
    None without one). None when no split is timed."""
    best = split_best(rows)
    if best is None:
        return None
    t = best["median_us"]
    timed = [r for r in rows if _is_number(r.get("median_us")) and r["median_us"] > 0]
    i = timed.index(best)
    sides = timed[max(0, i - 1):i] + timed[i + 1:i + 2]
    ref_times = [r["median_us"] for r in refs if _is_number(r.get("median_us"))]
    return {"best": best, "near": [r["splits"] for r in timed if r["median_us"] <= NEAR_BEST * t],
            "neighbour": max(r["median_us"] for r in sides) / t if sides else None,
            "worst": max(r["median_us"] for r in timed) / t,
            "reference": min(ref_times) / t if ref_times else None}


def split_sweeps(files) -> list[dict]:
    """Every sweep group of every calibration-sweeps file, in file order: ``file`` (name),
    ``case``, ``engine``, ``rows`` (sorted by split), ``refs`` (:func:`split_references`) and
    ``stats`` (:func:`split_group_stats`)."""
    out = []
    for path, doc in of_kind(files, SWEEPS):
        for (case, engine), rows in split_groups(doc).items():
            refs = split_references(doc, case)
            out.append({"file": Path(path).name, "case": case, "engine": engine, "rows": rows,
                        "refs": refs, "stats": split_group_stats(rows, refs)})
    return out


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


def _newest_step_files(docs) -> dict[tuple[str, str], tuple[str, str]]:
    """(case, engine) -> (date, path) of the newest per-step file recording that engine's steps."""
    newest: dict[tuple[str, str], tuple[str, str]] = {}
    for path, doc in docs:
        date = str(doc["meta"].get("date") or "")
        for r in doc["rows"]:
            key = (r["case"], r["engine"])
            if not r.get("baseline") and (key not in newest or date > newest[key][0]):
                newest[key] = (date, path)
    return newest


def paired_steps(files, *, min_layers: int = 1):
    """Yield (file meta, engine record, baseline record) for every non-baseline per-step record
    that has a baseline record of the same case and step in the same file, from the files of at
    least ``min_layers`` layers.

    A (case, engine) recorded in several files (a later run re-timing an engine on the same
    seeds) is taken from the newest file only (``meta.date``; the first of equal dates), as
    Tables 2 and 3 count it: one record per measured step, never two."""
    docs = [(p, d) for p, d in of_kind(files, "serving-steps")
            if int(d["meta"].get("layers") or 1) >= min_layers]
    newest = _newest_step_files(docs)
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


def step_records(files) -> dict[str, list[dict]]:
    """Every paired per-step record (:func:`paired_steps`), per experiment: the record's case,
    engine, step, shape, route and times, its baseline's engine and times, and the per-step CUDA
    and wall ratios (baseline time / engine time)."""
    out: dict[str, list[dict]] = collections.OrderedDict()
    for meta, r, b in paired_steps(files):
        out.setdefault(trace_key(r["case"]), []).append({
            "case": r["case"], "engine": r["engine"], "layers": int(meta.get("layers") or 1),
            "step": r["step"], "active": r["active"], "max_context": r["max_context"],
            "mean_context": r.get("mean_context"), "route": r["route"],
            "cuda_us": r["cuda_us"], "wall_us": r["wall_us"], "baseline": b["engine"],
            "baseline_cuda_us": b["cuda_us"], "baseline_wall_us": b["wall_us"],
            "cuda_ratio": b["cuda_us"] / r["cuda_us"], "wall_ratio": b["wall_us"] / r["wall_us"]})
    return out


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


# --------------------------------------------------------------------------- other files

def row_columns(rows) -> list[str]:
    """The union of the rows' keys, in first-seen order."""
    cols: list[str] = []
    for r in rows:
        cols += [k for k in r if k not in cols]
    return cols
