"""Report tables of the coverage benchmarks: the served models' shapes (``benches/model_shapes.py``,
``meta.kind == "model-shapes"``), the drop-in wrapper as engines call it (``benches/dropin.py``,
``"dropin"``), rows that share pages (``benches/shared_pages.py``, ``"shared-pages"``) and a real
checkpoint generating text (``examples/smollm2_generate.py``, ``"generate"``).

Each renderer takes ``files`` as ``pkvrt.tools.report.load_dir`` returns them (``[(path, doc)]``)
and returns Markdown ("" when no file of its kind is among them). A benchmark may be run in
several calls (a model subset each, ``--out`` a file each); rows of one (case, engine) found in
several files count once, from the newest file (``meta.date``). Ratios are the benchmark's own,
formed within one file: FlashInfer's fastest correct path's time over pkvrt's (> 1: pkvrt faster).
"""

from __future__ import annotations

import functools
import math
import re
import statistics

MODEL_SHAPES, DROPIN, SHARED_PAGES, GENERATE = "model-shapes", "dropin", "shared-pages", "generate"
KINDS = (MODEL_SHAPES, DROPIN, SHARED_PAGES, GENERATE)
FLOOR_GBPS = 4200.0   # the rate of the shared-pages files' floor columns (shared_pages.py's 4.2 TB/s)
GENERATE_KEYS = ("decoder", "decode_tokens_per_s", "equal_to_sdpa")


def is_generate(doc: dict) -> bool:
    """A generation results file: ``meta.kind == "generate"``, or (files written before the
    example named its kind) no kind and every row a decoder's (``GENERATE_KEYS``)."""
    kind = doc["meta"].get("kind")
    rows = doc.get("rows")
    return kind == GENERATE or (not kind and isinstance(rows, list) and bool(rows) and all(
        isinstance(r, dict) and all(k in r for k in GENERATE_KEYS) for r in rows))


def _docs(files, kind: str) -> list[dict]:
    """The ``kind`` files' documents, oldest first (``meta.date``): a later one's rows win."""
    return sorted((doc for _, doc in files if doc["meta"].get("kind") == kind),
                  key=lambda d: str(d["meta"].get("date") or ""))


def _rows(files, kind: str) -> list[dict]:
    """The rows of every ``kind`` file, each case's from the newest file that has it (a step's
    engines and ratio stay one file's); a model-level failure row (case = the model's name) is
    dropped where a newer file measured that model."""
    docs = _docs(files, kind)
    newest = {r.get("case"): i for i, doc in enumerate(docs) for r in doc["rows"]}
    measured = {}   # model -> the newest file holding rows of it
    for i, doc in enumerate(docs):
        for r in doc["rows"]:
            if r.get("model"):
                measured[r["model"]] = i
    out = []
    for i, doc in enumerate(docs):
        for r in doc["rows"]:
            case = r.get("case")
            if newest.get(case) != i or measured.get(case, -1) > i:
                continue
            out.append(r)
    return out


def _case_meta(files, kind: str) -> dict:
    """case -> the meta of the file whose rows of that case ``_rows`` keeps (the newest)."""
    return {r.get("case"): doc["meta"] for doc in _docs(files, kind) for r in doc["rows"]}


@functools.cache
def _calibrated_beta(gpu: str) -> float | None:
    from pkvrt.policy.calibration import beta_gbps_for
    try:
        return beta_gbps_for(gpu)
    except ValueError:   # no usable name, or a malformed file (CalibrationError)
        return None


def _gpu_beta(meta: dict) -> float | None:
    """The streaming-read rate (GB/s) of the GPU a results file ran on: the file's own
    ``beta_gbps``, else (files written before the bench recorded it) that of the calibration file
    pkvrt finds for its ``gpu`` (``calibration.beta_gbps_for``); None where neither is known."""
    if meta.get("beta_gbps"):
        return float(meta["beta_gbps"])
    return _calibrated_beta(str(meta["gpu"])) if meta.get("gpu") else None


def _ceiling(ratio: dict, by: dict, meta: dict) -> float | None:
    """The most a path reading each page once from memory can gain on the step: the baseline's
    time over the pages-once floor at the GPU's streaming rate (the ratio row's ``ceiling``, or
    the same from the rows' 4.2 TB/s floor and ``_gpu_beta``)."""
    if ratio.get("ceiling") is not None:
        return ratio["ceiling"]
    base = by.get(ratio.get("baseline") or "", {}).get("median_us")
    once = next((r.get("floor_once_us") for e, r in by.items() if e != "ratio"), None)
    beta = _gpu_beta(meta)
    if not (base and once and beta):
        return None
    return base / (once * FLOOR_GBPS / beta)


def _f(v, digits: int) -> str:
    return "-" if v is None else f"{v:.{digits}f}"


def _geomean(values) -> float | None:
    vals = [v for v in values if v]
    return math.exp(sum(math.log(v) for v in vals) / len(vals)) if vals else None


def _table(header, lines, text_columns: int = 1) -> str:
    """A Markdown table, its first ``text_columns`` columns left-aligned, the rest right."""
    rule = ["---" if i < text_columns else "---:" for i in range(len(header))]
    return "\n".join("| " + " | ".join(str(c).replace("|", "\\|") for c in line) + " |"
                     for line in (header, rule, *lines))


def _short(status: str, n: int = 90) -> str:
    return status if len(status) <= n else status[:n - 1] + "…"


def _by_trace(summ: list[dict]) -> str:
    """The pairs with a baseline grouped by trace: geometric means of the ratio and of both
    floor fractions, and the ratio pkvrt would reach at its read floor (FlashInfer's time over
    the floor), which bounds what any kernel can gain on that trace."""
    by: dict[str, list[dict]] = {}
    for r in summ:
        if r.get("ratio") and r.get("baseline_floor_fraction"):
            by.setdefault(r["trace"], []).append(r)
    if not by:
        return ""
    every = [r for rs in by.values() for r in rs]
    lines = [(t, len(rs), _f(_geomean(r["ratio"] for r in rs), 3),
              _f(_geomean(r["pkvrt_floor_fraction"] for r in rs), 2),
              _f(_geomean(r["baseline_floor_fraction"] for r in rs), 2),
              _f(_geomean(1 / r["baseline_floor_fraction"] for r in rs), 3)) for t, rs in by.items()]
    lines.append(("all", len(every), _f(_geomean(r["ratio"] for r in every), 3),
                  _f(_geomean(r["pkvrt_floor_fraction"] for r in every), 2),
                  _f(_geomean(r["baseline_floor_fraction"] for r in every), 2),
                  _f(_geomean(1 / r["baseline_floor_fraction"] for r in every), 3)))
    return ("By trace (geometric means over the models; \"ratio at the floor\" is FlashInfer's time "
            "over the read floor, the ratio of a step that reads its bytes at full bandwidth):\n\n"
            + _table(["trace", "pairs", "ratio", "pkvrt / floor", "FlashInfer / floor",
                      "ratio at the floor"], lines))


def model_shapes_table(files) -> str:
    """Per model and trace (the benchmark's ``summary`` rows): steps, pkvrt's and FlashInfer's
    fastest correct path's µs over the steps, the ratio and both read-floor fractions; the
    geometric mean of the ratios; which FlashInfer path each model's layer kinds were measured
    against; the paths found unavailable or wrong by the probe, and failed models."""
    rows = _rows(files, MODEL_SHAPES)
    if not rows:
        return ""
    summ = [r for r in rows if r.get("engine") == "summary"]
    parts = []
    if summ:
        parts.append(_table(
            ["model", "trace", "steps", "pkvrt µs", "FlashInfer fastest correct µs", "ratio",
             "pkvrt / floor", "FlashInfer / floor"],
            [(r["model"], r["trace"], r["steps"], _f(r["pkvrt_us"], 1), _f(r.get("baseline_us"), 1),
              _f(r.get("ratio"), 3) if r.get("ratio") else "none", _f(r.get("pkvrt_floor_fraction"), 2),
              _f(r.get("baseline_floor_fraction"), 2)) for r in summ], text_columns=2))
        g = _geomean(r.get("ratio") for r in summ)
        n = sum(1 for r in summ if r.get("ratio"))
        parts.append(f"Geometric mean of the ratios: {_f(g, 3)} over {n} (model, trace) pairs with a "
                     f"baseline; {len(summ) - n} without one (no correct FlashInfer path, or a pkvrt "
                     "step that failed its check).")
        parts.append(_by_trace(summ))
    kinds = _per_kind_lines(rows)
    if kinds:
        parts.append("Per layer kind (models of several): each kind's plan() and layers alone in one "
                     "graph, pkvrt's and FlashInfer's fastest correct path for that kind, summed over "
                     "the trace's steps:\n\n" + _table(
                         ["model", "trace", "kind", "layers", "steps", "pkvrt µs",
                          "FlashInfer fastest correct µs", "path", "ratio"], kinds, text_columns=3))
    paths: dict[str, set] = {}
    for r in rows:
        if r.get("engine") == "flashinfer-fastest-correct" and r.get("paths") and r.get("median_us"):
            paths.setdefault(r["model"], set()).update(f"{k}: {v}" for k, v in r["paths"].items())
    if paths:
        parts.append("Baseline paths (layer kind: FlashInfer path): " + "; ".join(
            f"{m} ({', '.join(sorted(p))})" for m, p in paths.items()) + ".")
    probe = [r for r in rows if str(r.get("case", "")).endswith("-probe") and r.get("status") != "ok"]
    if probe:
        parts.append("FlashInfer paths not used (the probe against the FP32 reference):\n\n" + "\n".join(
            f"- {r['case'][:-len('-probe')]} {r.get('kind')}: {r['engine']}: {_short(str(r.get('status')))}"
            for r in probe))
    failed = [r for r in rows if r.get("engine") == "pkvrt-device-plan-step"
              and str(r.get("status", "ok")) != "ok"]
    if failed:
        parts.append("pkvrt steps that failed:\n\n" + "\n".join(
            f"- {r['case']}: {_short(str(r['status']))}" for r in failed))
    return "\n\n".join(parts)


def _per_kind_lines(rows: list[dict]) -> list[tuple]:
    """(model, trace, kind, layers, steps, pkvrt µs, FlashInfer µs, paths, ratio) per layer kind
    of the models timed kind by kind (``pkvrt-device-plan-kind`` rows): each step's fastest
    correct FlashInfer path of that kind (its rows of the same case and kind), "none" where a
    step has none."""
    fi: dict[tuple, tuple] = {}
    for r in rows:
        e = r.get("engine", "")
        if e.startswith("flashinfer-") and r.get("kind") and r.get("status") == "ok" and r.get("median_us"):
            key = (r["case"], r["kind"])
            if key not in fi or r["median_us"] < fi[key][1]:
                fi[key] = (e, r["median_us"])
    by: dict[tuple, list] = {}
    for r in rows:
        if r.get("engine") == "pkvrt-device-plan-kind" and r.get("model"):
            by.setdefault((r["model"], r["trace"], r["kind"]), []).append(r)
    lines = []
    for (model, trace, kind), pk in by.items():
        t_pk = sum(r["median_us"] for r in pk)
        best = [fi.get((r["case"], kind)) for r in pk]
        ok = all(b is not None for b in best) and all(r.get("status") == "ok" for r in pk)
        t_fi = sum(b[1] for b in best) if ok else None
        paths = ", ".join(sorted({b[0] for b in best if b})) or "none"
        lines.append((model, trace, kind, pk[0].get("layers", "-"), len(pk), _f(t_pk, 1),
                      _f(t_fi, 1), paths, _f(t_fi / t_pk, 3) if t_fi else "none"))
    return lines


def dropin_table(files) -> str:
    """Per engine calling style (SGLang's, vLLM's): steps, the ratio's minimum and geometric
    mean (FlashInfer's faster wrapper over the drop-in, CUDA-graph replays), and the median host
    time of plan() for the drop-in and each FlashInfer wrapper; then the steps where a path was
    unavailable or wrong."""
    rows = _rows(files, DROPIN)
    if not rows:
        return ""
    styles = list(dict.fromkeys(r["style"] for r in rows if r.get("style")))
    lines = []
    for style in styles:
        mine = [r for r in rows if r.get("style") == style]
        ratios = [r["ratio"] for r in mine if r.get("engine") == "ratio" and r.get("ratio")]
        steps = sum(1 for r in mine if r.get("engine") == "ratio")
        plan = {}
        for r in mine:
            if r.get("engine") != "ratio" and r.get("plan_host_us") is not None:
                plan.setdefault(r["engine"], []).append(r["plan_host_us"])
        plan_text = ", ".join(f"{e} {_f(statistics.median(v), 1)}" for e, v in plan.items()) or "-"
        lines.append((style, steps, len(ratios), _f(min(ratios), 3) if ratios else "-",
                      _f(_geomean(ratios), 3), plan_text))
    parts = [_table(["style", "steps", "with a ratio", "ratio min", "ratio geomean",
                     "plan() host µs, median"], lines)]
    bad = [r for r in rows if r.get("engine") != "ratio" and r.get("status") not in (None, "ok")]
    if bad:
        parts.append("Paths unavailable or wrong:\n\n" + "\n".join(
            f"- {r['case']} {r['engine']}: {_short(str(r['status']))}" for r in bad))
    return "\n\n".join(parts)


def _parts(row: dict) -> str:
    """A shared step's two decodes timed alone (shared_pages.py ``parts_us``): "chunk + own"."""
    if row.get("chunk_us") is None or row.get("own_us") is None:
        return "-"
    return f"{row['chunk_us']:.0f} + {row['own_us']:.0f}"


def _shared_row(by: dict) -> dict:
    """The step's row of the shared path that shared (by the rule, else always), for its parts."""
    return next((by[e] for e in ("pkvrt-shared", "pkvrt-shared-always")
                 if by.get(e, {}).get("chunk_us") is not None), {})


def shared_pages_table(files) -> str:
    """Per step (rows x (shared + own tokens)): the floor with each row reading its pages and
    with each page read once, every engine's µs, the fastest FlashInfer path, the ceiling (the
    most reading each page once can gain over it on this GPU, ``_ceiling``), and the ratios of
    pkvrt's shared-pages paths (host and device lengths) and of its plain device planning against
    it, and the device-lengths shared path over plain device planning (on a step that shares
    nothing: what finding the sharing costs); then the unavailable paths."""
    rows = _rows(files, SHARED_PAGES)
    if not rows:
        return ""
    metas = _case_meta(files, SHARED_PAGES)
    engines = list(dict.fromkeys(r["engine"] for r in rows if r.get("engine") != "ratio"))
    cases = list(dict.fromkeys(r["case"] for r in rows))
    lines = []
    for case in cases:
        by = {r["engine"]: r for r in rows if r["case"] == case}
        any_row = next((r for e, r in by.items() if e != "ratio"), {})
        ratio = by.get("ratio", {})
        lines.append((case, _f(any_row.get("floor_us"), 0), _f(any_row.get("floor_once_us"), 0),
                      *(_f(by[e].get("median_us"), 1) if e in by and by[e].get("status") == "ok" else "-"
                        for e in engines),
                      ratio.get("baseline") or "-", _f(_ceiling(ratio, by, metas.get(case, {})), 2),
                      _f(ratio.get("ratio"), 3),
                      _f(ratio.get("ratio_device"), 3), _f(ratio.get("ratio_plain"), 3),
                      _f(ratio.get("device_over_plain"), 3), _parts(_shared_row(by))))
    header = ["step", "floor µs", "floor, pages once µs", *(f"{e} µs" for e in engines), "baseline",
              "ceiling: baseline / pages once at the GPU's rate", "shared / baseline",
              "shared-device / baseline", "plain / baseline", "shared-device time / plain time",
              "shared: chunk + own decodes alone µs"]
    if all(line[-1] == "-" for line in lines):   # results from before the parts were timed
        header, lines = header[:-1], [line[:-1] for line in lines]
    parts = [_table(header, lines)]
    bad = {}
    for r in rows:
        if r.get("engine") != "ratio" and r.get("status") not in (None, "ok"):
            status = re.sub(r" \(on [^)]*; not tried again\)$", "", str(r["status"]))
            bad.setdefault((r["engine"], _short(status)), []).append(r["case"])
    if bad:
        parts.append("Paths unavailable or wrong:\n\n" + "\n".join(
            f"- {e} on {', '.join(cs)}: {s}" for (e, s), cs in bad.items()))
    return "\n\n".join(parts)


def generate_table(files) -> str:
    """Per generation file (a model, its prompts): per decoder, whether the decode step ran in
    one CUDA graph, batch, greedy tokens per prompt, decode tokens/s (the median of the runs) and
    its ratio to FlashInfer's decoder in the same file, how many prompts equal SDPA's tokens, and
    each first divergence with both top-2 logit margins there (SDPA's, the decoder's): a margin
    near 0 is a near-tie that fp16 rounding may flip."""
    docs = [doc for _, doc in files if is_generate(doc)]
    parts = []
    for doc in sorted(docs, key=lambda d: str(d["meta"].get("date") or "")):
        rows, meta = doc["rows"], doc["meta"]
        fi = next((r["decode_tokens_per_s"] for r in rows if str(r["decoder"]).startswith("flashinfer")), None)
        lines = []
        for r in rows:
            divs = ", ".join(f"prompt {d['prompt']} at step {d['first_divergence']}: "
                             f"{d['ref_margin']:.3f} / {d['got_margin']:.3f}"
                             for d in r.get("divergences_vs_sdpa") or []) or "none"
            lines.append((r["decoder"], "yes" if r.get("cuda_graph") else "no", r.get("batch", "-"),
                          r.get("tokens_per_prompt", "-"), _f(r["decode_tokens_per_s"], 0),
                          _f(r["decode_tokens_per_s"] / fi, 3) if fi else "-",
                          f"{r['equal_to_sdpa']}/{r.get('batch', '-')}", divs))
        title = f"{meta.get('model') or 'model'}, {meta.get('gpu') or '-'}, {str(meta.get('date') or '-')[:10]}:"
        parts.append(title + "\n\n" + _table(
            ["decoder", "CUDA graph", "batch", "tokens / prompt", "decode tokens/s",
             "tokens/s / FlashInfer's", "prompts equal to SDPA",
             "first divergences (SDPA margin / decoder margin)"], lines))
    return "\n\n".join(parts)
