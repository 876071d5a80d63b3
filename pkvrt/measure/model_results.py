"""Results rows and the report table of the whole-model decode benchmark
(``benches/model_decode.py``): ms per step, tokens/s and the attention share of a
Llama-3-8B-shaped decode step per (batch, context) and attention engine, the check that the
engines' outputs agree, and pkvrt's ratio to FlashInfer's fastest path.

A results file has ``meta.kind == "model-decode"`` and rows of four kinds (``row``):

* ``measured`` (case, engine): ``ms_per_step`` / ``tokens_per_s`` (median of synchronous steps:
  the host work and the graph replay of a step that a greedy loop waits for),
  ``pipelined_ms_per_step`` / ``pipelined_tokens_per_s`` (median of steps enqueued back to back,
  the host a step ahead), ``host_us`` (the step's host work), ``attention_ms`` and
  ``attention_share`` (step minus the no-attention step, over the step), the checks (layer 0's
  attention against FP32, :func:`reference_check`; logits and layer 0 against the baseline,
  :func:`agreement`) and ``baseline`` (FlashInfer's fastest correct path of the case).
* ``ratio`` (case, "pkvrt / <baseline>"): ``step_ratio`` = baseline ms / pkvrt ms (the tokens/s
  ratio; > 1: pkvrt faster), ``pipelined_ratio``, ``attention_ratio`` (the attention times').
* ``skipped`` (case, "-"): a case that does not fit the device, with ``reason``.
* ``unavailable`` (case, engine): an engine that could not run, with ``reason``.

``model_decode_table(files)`` renders them for ``pkvrt report``.
"""

from __future__ import annotations

import argparse
import statistics

import torch

from pkvrt.measure.model import Case


def parse_counts(text: str) -> list[int]:
    """"1,4,8" -> [1, 4, 8]; "8K,32K" -> [8192, 32768] (K = 1024)."""
    out = []
    for part in text.split(","):
        part = part.strip()
        mult = 1024 if part[-1:] in "kK" else 1
        n = int(part[:-1] if mult > 1 else part) * mult
        if n < 1:
            raise argparse.ArgumentTypeError(f"{part!r}: expected positive counts")
        out.append(n)
    return out


KIND = "model-decode"
FLASHINFER_PREFIX = "flashinfer"
NO_ATTENTION = "no-attention"
PKVRT = "pkvrt"
# Agreement bounds, in units of the dtype's unit roundoff u (fp16 2^-11 = 4.9e-4, bf16 2^-8):
# ATTN_U for layer 0's attention output (both engines see the same q and cache there, so they
# differ only by their own rounding: P rounded to 16 bits before P.V, the output rounded; the
# harness bounds one call at 2e-3 = 4u against FP32), LOGITS_U for the logits after every
# layer (32 layers of propagated differences, see logits_tolerance).
ATTN_U = 20
LOGITS_U = 40
UNIT_ROUNDOFF = {torch.float16: 2.0 ** -11, torch.bfloat16: 2.0 ** -8, torch.float32: 2.0 ** -24}


def attention_tolerance(dtype) -> float:
    """Bound on layer 0's attention-output disagreement, max|a - b| / max|b| (fp16: 9.8e-3)."""
    return ATTN_U * UNIT_ROUNDOFF[dtype]


def logits_tolerance(dtype) -> float:
    """Bound on the logits' disagreement, max|a - b| / max|b| (fp16: 2.0e-2).

    Why 40u: the engines' attention outputs differ by a few u from layer 0 on, and every later
    layer passes the difference on through the residual stream. Measured on the CPU with the
    FP32 reference attention perturbed by 2u per element (a kernel's rounding), over 3 steps:
    the 8B shape (32 layers, context 512) gives logits 7.6u apart (4u: 8.6u), a 32-layer
    hidden-512 model 6-9u at contexts 256-8192: 40u leaves a 4-5x margin. Faults land outside:
    layer 5 of the 8B shape reading one wrong page of a row's 32 gives 52u, no attention at all
    2800u; ``tests/test_model_cpu.py`` keeps the hidden-512 version of this as a test. (One
    wrong page of a 128K row changes any output by less than rounding does: the tests at short
    contexts, where every page counts, are what catch such faults.)"""
    return LOGITS_U * UNIT_ROUNDOFF[dtype]


def rel_err(a: torch.Tensor, b: torch.Tensor) -> tuple[float, float]:
    """(max|a - b|, max|a - b| / max|b|), in float32."""
    diff = (a.float() - b.float()).abs().max().item()
    scale = b.float().abs().max().item()
    return diff, diff / scale if scale > 0 else float("inf") if diff > 0 else 0.0


def agreement(logits, attn0, ref_logits, ref_attn0, *, dtype) -> dict:
    """The check fields of one engine against a reference engine over the checked steps.

    logits, ref_logits : [steps, B, vocab]. attn0, ref_attn0 : [steps, B, H_q, D], layer 0's
    attention output. ``logits_ok`` when both disagreements are within their tolerances.
    """
    max_abs, rel = rel_err(logits, ref_logits)
    _, attn_rel = rel_err(attn0, ref_attn0)
    agree = (logits.argmax(-1) == ref_logits.argmax(-1)).float().mean().item()
    return {"logits_max_abs": max_abs, "logits_rel_err": rel, "argmax_agree": agree,
            "attn0_rel_err": attn_rel,
            "logits_ok": bool(rel <= logits_tolerance(dtype) and attn_rel <= attention_tolerance(dtype))}


def reference_check(attn0, ref_attn0, *, dtype) -> dict:
    """Layer 0's attention output [steps, B, H_q, D] against the FP32 reference
    (``Model.layer0_reference``): ``attn0_ref_err`` and ``ref_ok`` (within
    :func:`attention_tolerance`)."""
    err = rel_err(attn0, ref_attn0)[1]
    return {"attn0_ref_err": err, "ref_ok": bool(err <= attention_tolerance(dtype))}


def measured_row(case: Case, engine: str, *, model: str, sync_ms, pipelined_ms, host_us,
                 warmup: int) -> dict:
    """The timing fields of one (case, engine): medians and means of the per-step times."""
    ms = statistics.median(sync_ms)
    pms = statistics.median(pipelined_ms)
    return {"case": f"{model}-{case.name}", "engine": engine, "row": "measured", "model": model,
            "batch": case.batch, "context": case.context, "steps": len(sync_ms), "warmup": warmup,
            "ms_per_step": ms, "mean_ms_per_step": statistics.fmean(sync_ms),
            "tokens_per_s": case.batch / (ms * 1e-3),
            "pipelined_ms_per_step": pms, "pipelined_tokens_per_s": case.batch / (pms * 1e-3),
            "host_us": statistics.median(host_us),
            "kv_gib": case.kv_bytes / 2**30, "weights_gib": case.weight_bytes / 2**30}


def skipped_row(case: Case, *, model: str, reason: str | None = None) -> dict:
    return {"case": f"{model}-{case.name}", "engine": "-", "row": "skipped", "model": model,
            "batch": case.batch, "context": case.context, "reason": reason or case.reason,
            "need_gib": case.need_bytes / 2**30, "kv_gib": case.kv_bytes / 2**30}


def unavailable_row(case: Case, engine: str, *, model: str, reason: str) -> dict:
    return {"case": f"{model}-{case.name}", "engine": engine, "row": "unavailable", "model": model,
            "batch": case.batch, "context": case.context, "reason": reason}


def baseline_engine(rows: list[dict]) -> str | None:
    """FlashInfer's fastest correct path among ``rows`` of one case: the lowest ``ms_per_step``
    of the measured FlashInfer rows whose layer-0 attention matched the FP32 reference (or that
    were not checked against it)."""
    fi = [r for r in rows if r["row"] == "measured" and r["engine"].startswith(FLASHINFER_PREFIX)
          and r.get("ref_ok", True)]
    return min(fi, key=lambda r: r["ms_per_step"])["engine"] if fi else None


def finish_case(rows: list[dict]) -> list[dict]:
    """Fill in a case's derived fields, in place: ``attention_ms`` / ``attention_share`` (and
    the pipelined share) from the no-attention row, ``baseline`` on FlashInfer's fastest path;
    return the case's ratio row (pkvrt against that baseline) as a list (empty without both)."""
    measured = {r["engine"]: r for r in rows if r["row"] == "measured"}
    none = measured.get(NO_ATTENTION)
    for r in measured.values():
        if none is not None and r is not none:
            r["attention_ms"] = r["ms_per_step"] - none["ms_per_step"]
            r["attention_share"] = r["attention_ms"] / r["ms_per_step"]
            r["pipelined_attention_share"] = 1 - none["pipelined_ms_per_step"] / r["pipelined_ms_per_step"]
    base = baseline_engine(rows)
    for r in measured.values():
        r["baseline"] = r["engine"] == base
    p = measured.get(PKVRT)
    if base is None or p is None:
        return []
    b = measured[base]
    ratio = {"case": p["case"], "engine": f"{PKVRT} / {base}", "row": "ratio", "model": p["model"],
             "batch": p["batch"], "context": p["context"], "numerator": PKVRT,
             "baseline_engine": base, "step_ratio": b["ms_per_step"] / p["ms_per_step"],
             "pipelined_ratio": b["pipelined_ms_per_step"] / p["pipelined_ms_per_step"],
             "logits_ok": p.get("logits_ok"), "ref_ok": p.get("ref_ok")}
    if "attention_ms" in p and p["attention_ms"] > 0:
        ratio["attention_ratio"] = b["attention_ms"] / p["attention_ms"]
    return [ratio]


# --------------------------------------------------------------------------- the report table

def _f(v, digits: int) -> str:
    return "-" if v is None else f"{v:.{digits}f}"


def _pct(v) -> str:
    return "-" if v is None else f"{100 * v:.1f} %"


def check_failed(r: dict) -> bool:
    """A measured row whose FP32 or cross-engine check failed, or whose planning kernel flagged
    a row (``status_error``)."""
    return r.get("ref_ok") is False or r.get("logits_ok") is False or bool(r.get("status_error"))


def _check(r: dict) -> str:
    if "attention_signal" in r:
        return f"(without attention the logits move by {r['attention_signal']:.1e})"
    parts = []
    if "ref_ok" in r:
        parts.append(f"layer 0 vs FP32 {r['attn0_ref_err']:.1e}")
    if "logits_ok" in r:
        parts.append(f"vs {r.get('logits_vs', '?')}: logits {r['logits_rel_err']:.1e}, "
                     f"layer 0 {r['attn0_rel_err']:.1e}")
    if not parts:
        return "-"
    return ("**FAILED** " if check_failed(r) else "ok: ") + "; ".join(parts)


def _table(header, lines) -> str:
    out = ["| " + " | ".join(header) + " |", "|" + "|".join("---" for _ in header) + "|"]
    out += ["| " + " | ".join(str(c).replace("|", "\\|") for c in line) + " |" for line in lines]
    return "\n".join(out)


def model_decode_table(files) -> str:
    """Markdown tables of every ``model-decode`` file among ``files`` ([(path, doc)], as
    ``pkvrt.tools.report.load_dir`` returns them): per case and engine ms/step, tokens/s, the
    attention share and the check; then pkvrt against FlashInfer's fastest path per case; then
    the skipped cases and unavailable engines. Empty string when there is no such file."""
    rows = [r for _, doc in files if doc["meta"].get("kind") == KIND for r in doc["rows"]]
    if not rows:
        return ""

    def order(r):   # per case: pkvrt, FlashInfer's paths, then the rest
        e = r["engine"]
        rank = 0 if e == PKVRT else 1 if e.startswith(FLASHINFER_PREFIX) else 2
        return (r.get("model", ""), r.get("batch", 0), r.get("context", 0), rank, e)
    measured = sorted((r for r in rows if r["row"] == "measured"), key=order)
    parts = [_table(
        ["case", "engine", "ms/step", "tokens/s", "attention share", "pipelined ms/step",
         "host µs", "check (max rel. error)"],
        [(r["case"], r["engine"] + (" (baseline)" if r.get("baseline") else ""),
          _f(r["ms_per_step"], 2), _f(r["tokens_per_s"], 0), _pct(r.get("attention_share")),
          _f(r["pipelined_ms_per_step"], 2), _f(r["host_us"], 0), _check(r)) for r in measured])]
    ratios = sorted((r for r in rows if r["row"] == "ratio"), key=order)
    if ratios:
        parts.append(_table(
            ["case", "pkvrt vs", "step speedup (tokens/s ratio)", "pipelined", "attention-time speedup"],
            [(r["case"], r["baseline_engine"], _f(r["step_ratio"], 3), _f(r["pipelined_ratio"], 3),
              _f(r.get("attention_ratio"), 3)) for r in ratios]))
    other = sorted((r for r in rows if r["row"] in ("skipped", "unavailable")), key=order)
    if other:
        parts.append("\n".join(f"- {r['case']}{'' if r['engine'] == '-' else ' ' + r['engine']}: "
                               f"{r['row']} ({r['reason']})" for r in other))
    return "\n\n".join(parts)
