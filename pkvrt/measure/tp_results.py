"""Results rows and the report table of the tensor-parallel decode benchmark
(``benches/tp_decode.py``): per (batch, context) and TP the device time of a replayed step,
tokens/s, scaling efficiency, attention's and the all-reduces' shares, and the checks.

A results file has ``meta.kind == "tp-decode"`` and rows of three kinds (``row``):

* ``measured`` (case, engine = the attention engine of every rank): ``tp``, ``mode`` (``nccl``:
  TP ranks, one per GPU; ``shard-only``: one rank's shard on one GPU, no communication: the
  per-rank cost of TP > 1), ``rank_ms`` (each rank's median device ms per replayed step),
  ``ms_per_step`` (the slowest rank's median) and ``tokens_per_s`` = batch / that,
  ``interval_ms`` (median start-to-start of steps enqueued back to back), ``no_attention_ms``
  with ``attention_share`` = 1 - no-attention / step, ``no_comm_ms`` with ``comm_share`` = 1 -
  (the step captured without its all-reduces) / step (all-reduce time plus waiting for the
  slowest rank), ``allreduce_us`` (one all-reduce of the step's [B, hidden] alone, median over a
  graph of ``allreduce_calls`` of them), ``scaling_efficiency`` = tokens_per_s / (TP x the TP 1
  row's) when that row is in the file (:func:`finish`), the per-rank memory and the checks:
  ``attn0_ref_err`` (layer 0's attention against FP32, worst rank), ``ranks_agree`` (every
  rank's logits identical; rows of more than one rank), ``status_error`` (pkvrt's planning kernel flagged a row).
* ``check`` (case, engine): the TP step against the same step on one GPU
  (``pkvrt.measure.model_tp.check_against_one_gpu``): ``logits_rel_err``, ``attn0_rel_err``,
  ``argmax_agree``, ``logits_ok``, ``ranks_agree``.
* ``skipped`` (case, "-"): a (case, TP) that does not fit one GPU per rank, or a TP with more
  ranks than the machine has GPUs, with ``reason``.

``tp_decode_table(files)`` renders them for ``pkvrt report``.
"""

from __future__ import annotations

import statistics

from pkvrt.measure.model import Case
from pkvrt.measure.model_results import _f, _pct, _table, attention_tolerance

KIND = "tp-decode"
MODES = ("nccl", "gloo", "shard-only")


def case_label(model: str, case: Case) -> str:
    return f"{model}-{case.name}"


def measured_row(case: Case, *, model: str, engine: str, tp: int, mode: str, ranks: list[dict],
                 warmup: int, steps: int, allreduce_calls: int, dtype) -> dict:
    """One (case, TP) from every rank's timings and checks, ``ranks`` in rank order, each
    ``{"replay_ms": [...], "interval_ms": [...], "no_attention_ms": [...], "no_comm_ms": [...]
    or None, "allreduce_us": float or None, "attn0_ref_err": float, "ranks_agree": bool or
    None, "status_error": str or None}`` (lists: per timed step). The step time is the slowest
    rank's median; ``dtype`` (the model's) sets the FP32 check's tolerance."""
    if mode not in MODES:
        raise ValueError(f"measured_row: mode={mode!r}: expected one of {MODES}")

    def worst(key):
        vals = [statistics.median(r[key]) for r in ranks if r.get(key)]
        return max(vals) if vals else None

    ms, none, nocomm = worst("replay_ms"), worst("no_attention_ms"), worst("no_comm_ms")
    ar = [r["allreduce_us"] for r in ranks if r.get("allreduce_us") is not None]
    errs = [r["attn0_ref_err"] for r in ranks if r.get("attn0_ref_err") is not None]
    status = "; ".join(f"rank {i}: {r['status_error']}" for i, r in enumerate(ranks) if r.get("status_error"))
    row = {"case": case_label(model, case), "engine": engine, "row": "measured", "model": model,
           "tp": tp, "mode": mode, "batch": case.batch, "context": case.context, "steps": steps,
           "warmup": warmup, "rank_ms": [statistics.median(r["replay_ms"]) for r in ranks],
           "ms_per_step": ms, "tokens_per_s": case.batch / (ms * 1e-3),
           "interval_ms": worst("interval_ms"),
           "no_attention_ms": none, "attention_ms": None if none is None else ms - none,
           "attention_share": None if none is None else 1 - none / ms,
           "no_comm_ms": nocomm, "comm_ms": None if nocomm is None else ms - nocomm,
           "comm_share": None if nocomm is None else 1 - nocomm / ms,
           "allreduce_us": max(ar) if ar else None, "allreduce_calls": allreduce_calls if ar else 0,
           "allreduce_share_alone": (allreduce_calls * max(ar) * 1e-3 / ms) if ar else None,
           "weights_gib": case.weight_bytes / 2**30, "kv_gib": case.kv_bytes / 2**30,
           "scaling_efficiency": None}
    if errs:
        row["attn0_ref_err"] = max(errs)
        row["ref_ok"] = bool(row["attn0_ref_err"] <= attention_tolerance(dtype))
    agree = [r["ranks_agree"] for r in ranks if r.get("ranks_agree") is not None]
    if len(ranks) > 1 and agree:
        row["ranks_agree"] = all(agree)
    if status:
        row["status_error"] = status
    return row


def check_row(case: Case, *, model: str, engine: str, tp: int, mode: str, steps: int, fields: dict,
              ranks_agree: bool) -> dict:
    """The one-GPU comparison of ``pkvrt.measure.model_tp.check_against_one_gpu`` (``fields``: its
    agreement dict) as a row."""
    return {"case": case_label(model, case), "engine": engine, "row": "check", "model": model,
            "tp": tp, "mode": mode, "batch": case.batch, "context": case.context, "steps": steps,
            **fields, "ranks_agree": bool(ranks_agree)}


def skipped_row(case: Case, *, model: str, tp: int, mode: str = "nccl", reason: str | None = None) -> dict:
    return {"case": case_label(model, case), "engine": "-", "row": "skipped", "model": model,
            "tp": tp, "mode": mode, "batch": case.batch, "context": case.context, "reason": reason or case.reason,
            "need_gib": case.need_bytes / 2**30}


def finish(rows: list[dict]) -> list[dict]:
    """Fill ``scaling_efficiency`` of every measured ``nccl`` row, in place: its tokens/s over
    TP x the tokens/s of the TP 1 row of the same (case, engine) (1.0 for that row itself;
    None when TP 1 was not measured). Returns ``rows``.

    Example: TP 1 at 571 tokens/s, TP 2 at 1000 tokens/s: 1000 / (2 x 571) = 0.876."""
    one = {(r["case"], r["engine"]): r for r in rows
           if r["row"] == "measured" and r["mode"] == "nccl" and r["tp"] == 1}
    for r in rows:
        if r["row"] == "measured" and r["mode"] == "nccl":
            base = one.get((r["case"], r["engine"]))
            r["scaling_efficiency"] = (None if base is None
                                       else r["tokens_per_s"] / (r["tp"] * base["tokens_per_s"]))
    return rows


def _e(v) -> str:
    return "-" if v is None else f"{v:.1e}"


def check_failed(r: dict) -> bool:
    """A measured row whose FP32 check failed, whose ranks disagreed or whose planning kernel
    flagged a row, or a check row outside the tolerances."""
    if r["row"] == "check":
        return not (r.get("logits_ok") and r.get("ranks_agree"))
    return r.get("ref_ok") is False or r.get("ranks_agree") is False or bool(r.get("status_error"))


def _check_cell(r: dict) -> str:
    parts = []
    if "attn0_ref_err" in r:
        parts.append(f"layer 0 vs FP32 {r['attn0_ref_err']:.1e} (worst rank)")
    if "ranks_agree" in r:
        parts.append("logits identical on every rank" if r["ranks_agree"] else "ranks' logits differ")
    if r.get("status_error"):
        parts.append(r["status_error"])
    if not parts:
        return "-"
    return ("**FAILED** " if check_failed(r) else "ok: ") + "; ".join(parts)


def tp_decode_table(files) -> str:
    """Markdown tables of every ``tp-decode`` file among ``files`` ([(path, doc)], as
    ``pkvrt.tools.report.load_dir`` returns them): per case, TP and mode the step; then the one-GPU
    checks; then the skipped cases. Empty string when there is no such file."""
    rows = [r for _, doc in files if doc["meta"].get("kind") == KIND for r in doc["rows"]]
    if not rows:
        return ""

    def order(r):
        return (r.get("model", ""), r.get("batch", 0), r.get("context", 0),
                r.get("mode", "") == "shard-only", r.get("tp", 0), r["engine"])
    measured = sorted((r for r in rows if r["row"] == "measured"), key=order)
    parts = []
    if measured:
        parts.append(_table(
            ["case", "TP", "mode", "attention", "ms/step", "tokens/s", "scaling efficiency",
             "attention share", "all-reduce share", "all-reduce µs/call (alone)",
             "GiB/rank (weights + KV)", "check"],
            [(r["case"], r["tp"], r["mode"], r["engine"], _f(r["ms_per_step"], 2),
              _f(r["tokens_per_s"], 0), _f(r.get("scaling_efficiency"), 3),
              _pct(r.get("attention_share")), _pct(r.get("comm_share")), _f(r.get("allreduce_us"), 1),
              f"{r['weights_gib']:.1f} + {r['kv_gib']:.1f}", _check_cell(r)) for r in measured]))
    checks = sorted((r for r in rows if r["row"] == "check"), key=order)
    if checks:
        parts.append(_table(
            ["check case", "TP", "attention", "steps", "logits vs one GPU", "layer 0 vs one GPU",
             "argmax agree", "ranks identical", "result"],
            [(r["case"], r["tp"], r["engine"], r["steps"], _e(r.get("logits_rel_err")),
              _e(r.get("attn0_rel_err")), _pct(r.get("argmax_agree")),
              "yes" if r.get("ranks_agree") else "no",
              "**FAILED**" if check_failed(r) else "ok") for r in checks]))
    skipped = sorted((r for r in rows if r["row"] == "skipped"), key=order)
    if skipped:
        parts.append("\n".join(f"- {r['case']} TP {r['tp']}: skipped ({r['reason']})" for r in skipped))
    return "\n\n".join(parts)
