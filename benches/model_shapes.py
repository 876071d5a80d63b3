"""Model shapes in the engine protocol: each model of pkvrt/measure/model_shapes.py against
FlashInfer's fastest correct decode path, per step, with the model's own layer pattern.

Protocol (per model and step; 32 layers, each its own K/V cache, page 16, fp16):
- pkvrt: one ``Runtime(device_planning=True)`` (graphs off: ``RuntimeOptions(use_cuda_graph=
  False)``) per layer kind (window, soft cap, sinks, scale), the whole step (every kind's plan() and
  all 32 run() calls) captured in one CUDA graph; CUDA-event time of its replays (median,
  ``harness.median_us``).
- FlashInfer: its tensor-core and CUDA-core FA2 decode (``BatchDecodeWithPagedKVCacheWrapper``
  in CUDA-graph mode, planned outside the graph with the kind's window, soft cap and scale) and
  XQA (``trtllm_batch_decode_with_kv_cache(backend="xqa")``, window and sinks; it has no soft
  cap); each path's layers of one kind in one graph. A path is a candidate for a kind only if
  its output matched the FP32 reference on a probe step with short rows (where sinks and
  windows matter) and on the measured step's first layer of that kind; the baseline of a step is
  the sum over kinds of the fastest candidate's time (a path per kind: never weaker than any one
  path). A kind with no candidate (sinks on FA2 only, head dim 96) has no baseline: "none".
- Models of several layer kinds (local and global) also time each kind alone, pkvrt's plan()
  and that kind's layers in one graph (``pkvrt-device-plan-kind``), as FlashInfer's paths are
  timed per kind: a per-kind ratio.
- The floor: the step's K and V bytes (each layer its window) at 4.2 TB/s.

usage: python benches/model_shapes.py [--models a,b] [--steps N] [--out FILE] [--max-seconds S]
       [--trace-dir DIR]  (the Azure conversation trace: DIR/azure2023_conv.csv; docs/traces.md)
       [--routes FILE]    (a routes.toml instead of the shipped one)
Writes benches/results/h200/model-shapes.json (rows per (case, engine): median_us, floor_us,
max_err_ref; summary rows per model and trace: ratio = baseline / pkvrt over the steps' total time)
and prints a table per model.
"""

from __future__ import annotations

import argparse
import math
import sys
import time
from pathlib import Path

import numpy as np
import torch

from pkvrt import reference
from pkvrt.measure import results
from pkvrt.measure.harness import median_us
from pkvrt.measure.model_shapes import (
    LAYERS,
    MODELS,
    LayerKind,
    ModelShape,
    floor_us,
    geomean,
    isolated_steps,
    sample_steps,
)
from pkvrt.policy.registry import load_routes
from pkvrt.runtime import Runtime
from pkvrt.runtime.fi_route import NO_DECODE_HEAD_DIMS
from pkvrt.runtime.options import RuntimeOptions

PAGE = 16
REPLAYS = 15
TOLERANCE = 5e-3           # ||out - ref|| / ||ref|| of fp16 out against the FP32 reference
PATHS = ("flashinfer-tc", "flashinfer-cuda", "flashinfer-xqa")
SEED = 20260623            # held-out seed of the synthetic traces
PROBE_LENS = (100, 700, 5000)  # the probe step's rows: a sink still weighs at 100 tokens, and
                               # every model's window (128, 1024, 4096) cuts the longest row
CACHE_BUDGET = 24 * 2**30  # K/V bytes of one step's layers; past it the layers cycle through
                           # fewer caches, each still far larger than the 60 MB L2
WORKSPACE = 256 * 2**20    # bytes of each FlashInfer workspace (FA2's, XQA's)
DEVICE = "cuda"            # where every tensor lives (tests/test_model_shapes_dry_cpu.py: "cpu")
ROUTES = None              # the routes.toml Registry pkvrt's Runtimes read (None: the shipped one; --routes)


def scale_of(model: ModelShape, kind: LayerKind) -> float:
    return kind.sm_scale if kind.sm_scale is not None else 1.0 / math.sqrt(model.head_dim)


class Step:
    """One step's device data: block tables (pages scattered), K/V per layer (32 caches, or as
    many as CACHE_BUDGET holds, cycled), q, sinks."""

    def __init__(self, model: ModelShape, seq_lens: np.ndarray, gen: torch.Generator):
        dev = DEVICE
        self.seq = np.asarray(seq_lens, np.int32)
        pages = -(-self.seq // PAGE)
        self.num_pages = int(pages.sum())
        perm = torch.randperm(self.num_pages, generator=gen).numpy().astype(np.int32)
        self.width = int(pages.max())
        bt = np.zeros((len(self.seq), self.width), np.int32)
        start = 0
        for r, n in enumerate(pages):
            bt[r, :n] = perm[start:start + n]
            start += n
        self.bt_np = bt
        self.seq_d = torch.as_tensor(self.seq, device=dev)
        self.bt_d = torch.as_tensor(bt, device=dev)
        shape = (self.num_pages, model.num_kv_heads, PAGE, model.head_dim)
        per_layer = 2 * math.prod(shape) * 2
        n = min(LAYERS, max(2, CACHE_BUDGET // per_layer))
        ks = [torch.randn(shape, device=dev, dtype=torch.float16) for _ in range(n)]
        vs = [torch.randn(shape, device=dev, dtype=torch.float16) for _ in range(n)]
        self.k = [ks[l % n] for l in range(LAYERS)]
        self.v = [vs[l % n] for l in range(LAYERS)]
        self.distinct_caches = n
        b = len(self.seq)
        self.q = torch.randn((LAYERS, b, model.num_qo_heads, model.head_dim), device=dev,
                             dtype=torch.float16)
        self.sinks = torch.randn((LAYERS, model.num_qo_heads), device=dev) * 2 + 4
        self.out = torch.empty_like(self.q)

    def reference(self, model: ModelShape, kind: LayerKind, layer: int) -> torch.Tensor:
        return reference.decode_attention(
            self.q[layer], self.k[layer], self.v[layer], self.seq_d, self.bt_d,
            sm_scale=scale_of(model, kind), window_left=kind.window_left,
            logits_soft_cap=kind.logits_soft_cap,
            sinks=self.sinks[layer] if kind.sinks else None)


def rel_err(out: torch.Tensor, ref: torch.Tensor) -> float:
    e = (out.float() - ref).norm() / ref.norm()
    return float(e) if torch.isfinite(e) else float("inf")


# --------------------------------------------------------------------------- pkvrt

def pkvrt_step(model: ModelShape, st: Step) -> dict:
    """pkvrt's whole step in one graph; its time and its error on each kind's first layer."""
    kinds = model.layer_kinds(LAYERS)
    rts = {k: Runtime(model.num_qo_heads, model.num_kv_heads, model.head_dim, PAGE, torch.float16,
                      device_planning=True, num_pages=st.num_pages, max_batch=max(8, len(st.seq)),
                      max_pages_per_row=st.width, window_left=k.window_left,
                      logits_soft_cap=k.logits_soft_cap, sinks=k.sinks, sm_scale=k.sm_scale,
                      routes=ROUTES, options=RuntimeOptions(use_cuda_graph=False, flashinfer=False))
           for k in model.kinds()}

    def step():
        for rt in rts.values():
            rt.plan(st.seq_d, st.bt_d)
        for l, k in enumerate(kinds):
            rts[k].run(st.q[l], st.k[l], st.v[l], out=st.out[l],
                       sinks=st.sinks[l] if k.sinks else None)

    st.out.fill_(float("nan"))
    step()
    torch.cuda.synchronize()
    for rt in rts.values():
        rt.device_status()
    errs = {k.name: rel_err(st.out[kinds.index(k)], st.reference(model, k, kinds.index(k)))
            for k in model.kinds()}
    err = max(errs.values())
    status = "ok" if err <= TOLERANCE else f"wrong: rel. error {err:.3g} against the FP32 reference"
    per_kind = {}
    if len(rts) > 1:   # each kind's plan() and layers alone, as FlashInfer's paths are timed
        for k, rt in rts.items():
            def alone(k=k, rt=rt):
                rt.plan(st.seq_d, st.bt_d)
                for l, kk in enumerate(kinds):
                    if kk == k:
                        rt.run(st.q[l], st.k[l], st.v[l], out=st.out[l], sinks=st.sinks[l] if k.sinks else None)
            per_kind[k.name] = median_us(alone, repeats=REPLAYS)
    return {"median_us": median_us(step, repeats=REPLAYS), "max_err": err, "errors": errs,
            "status": status, "per_kind_us": per_kind}


# --------------------------------------------------------------------------- FlashInfer

class FiPath:
    """One FlashInfer decode path for one layer kind, over one step's pages."""

    def __init__(self, fi, label: str, model: ModelShape, kind: LayerKind, st: Step, ws):
        """ws: {"fa2": workspace, "xqa": a zeroed workspace of XQA's own (its semaphores)}."""
        self.fi, self.label, self.model, self.kind, self.st = fi, label, model, kind, st
        self.ws = ws["xqa" if label == "flashinfer-xqa" else "fa2"]
        ws = self.ws
        b = len(st.seq)
        if label == "flashinfer-xqa":
            if kind.logits_soft_cap > 0:
                raise RuntimeError("XQA has no logits soft cap")
            self.entry = fi.decode.trtllm_batch_decode_with_kv_cache
            return
        dev = DEVICE
        self.indptr_buf = torch.zeros(b + 1, dtype=torch.int32, device=dev)
        self.indices_buf = torch.zeros(st.num_pages, dtype=torch.int32, device=dev)
        self.last_buf = torch.zeros(b, dtype=torch.int32, device=dev)
        self.w = fi.BatchDecodeWithPagedKVCacheWrapper(
            ws, "HND", use_cuda_graph=True, use_tensor_cores=label == "flashinfer-tc",
            backend="fa2", paged_kv_indptr_buffer=self.indptr_buf,
            paged_kv_indices_buffer=self.indices_buf, paged_kv_last_page_len_buffer=self.last_buf)
        pages = -(-st.seq // PAGE)
        indptr = np.concatenate([[0], np.cumsum(pages)]).astype(np.int32)
        indices = np.concatenate([st.bt_np[r, :n] for r, n in enumerate(pages)]).astype(np.int32)
        last = (st.seq - (pages - 1) * PAGE).astype(np.int32)
        kw = {"q_data_type": torch.float16, "kv_data_type": torch.float16,
              "sm_scale": scale_of(model, kind)}
        if kind.window_left >= 0:
            kw["window_left"] = kind.window_left
        if kind.logits_soft_cap > 0:
            kw["logits_soft_cap"] = kind.logits_soft_cap
        self.w.plan(torch.as_tensor(indptr), torch.as_tensor(indices), torch.as_tensor(last),
                    model.num_qo_heads, model.num_kv_heads, model.head_dim, PAGE, **kw)

    def run(self, layer: int) -> None:
        st, kind = self.st, self.kind
        sinks = st.sinks[layer] if kind.sinks else None
        if self.label == "flashinfer-xqa":
            self.entry(query=st.q[layer], kv_cache=(st.k[layer], st.v[layer]),
                       workspace_buffer=self.ws, block_tables=st.bt_d, seq_lens=st.seq_d,
                       max_seq_len=int(st.seq.max()), bmm1_scale=scale_of(self.model, kind),
                       bmm2_scale=1.0, window_left=kind.window_left, out=st.out[layer],
                       sinks=sinks, kv_layout="HND", backend="xqa")
        else:   # FA2 takes sinks= and (as measured) ignores them: the check below catches it
            kw = {"sinks": sinks} if sinks is not None else {}
            self.w.run(st.q[layer], (st.k[layer], st.v[layer]), out=st.out[layer], **kw)


def fi_kind(fi, label: str, model: ModelShape, kind: LayerKind, st: Step, ws) -> dict:
    """A FlashInfer path on one kind's layers of a step: its graph time, or why it is no
    candidate (unavailable: an exception; wrong: an error over the tolerance)."""
    layers = [l for l, k in enumerate(model.layer_kinds(LAYERS)) if k == kind]
    try:
        path = FiPath(fi, label, model, kind, st, ws)
        st.out[layers[0]].fill_(float("nan"))
        path.run(layers[0])
        torch.cuda.synchronize()
    except Exception as exc:  # noqa: BLE001 - a path that refuses the shape is no candidate
        return {"status": f"unavailable: {type(exc).__name__}: {(str(exc).splitlines() or [''])[0][:160]}"}
    err = rel_err(st.out[layers[0]], st.reference(model, kind, layers[0]))
    if not err <= TOLERANCE:
        return {"status": f"wrong: rel. error {err:.3g} against the FP32 reference", "max_err": err}

    def body():
        for l in layers:
            path.run(l)
    try:
        t = median_us(body, repeats=REPLAYS)
    except Exception as exc:  # noqa: BLE001 - recorded; the other paths and cases still run
        return {"status": f"unavailable: timing its graph: {type(exc).__name__}: "
                          f"{(str(exc).splitlines() or [''])[0][:160]}", "max_err": err}
    return {"status": "ok", "median_us": t, "max_err": err}


def probe_paths(fi, model: ModelShape, ws, deadline: float = math.inf) -> dict:
    if model.head_dim in NO_DECODE_HEAD_DIMS:   # FlashInfer's decode would crash the context
        return {(label, k.name): f"unavailable: FlashInfer has no decode kernel for head_dim "
                                 f"{model.head_dim}" for k in model.kinds() for label in PATHS}
    return _probe(fi, model, ws, deadline)


def _probe(fi, model: ModelShape, ws, deadline: float = math.inf) -> dict:
    """Which FlashInfer paths are correct per kind, on a probe step of short rows (PROBE_LENS)
    where every window and sink changes the answer; also compiles their kernels."""
    gen = torch.Generator().manual_seed(1)
    st = Step(model, np.array(PROBE_LENS, np.int32), gen)
    ok = {}
    for kind in model.kinds():
        for label in PATHS:
            if time.monotonic() > deadline:   # a first call JIT-compiles its kernels (~40 s each)
                ok[(label, kind.name)] = "not probed: time budget spent"
                continue
            r = fi_kind(fi, label, model, kind, st, ws)
            ok[(label, kind.name)] = r["status"]
    del st
    return ok


# --------------------------------------------------------------------------- driver

def measure_model(fi, model: ModelShape, cases, ws, rows: list, deadline: float,
                  save=lambda: None) -> None:
    """The model's probe and cases, appended to ``rows``; ``save()`` after the probe and after
    each case (what a run killed past its deadline measured stays written)."""
    if time.monotonic() > deadline:
        print(f"  {model.name}: time budget spent, not measured", flush=True)
        return
    probe = probe_paths(fi, model, ws, deadline) if fi is not None else {}
    for (label, kname), status in sorted(probe.items()):
        rows.append({"case": f"{model.name}-probe", "engine": label, "kind": kname, "status": status})
    save()
    gen = torch.Generator().manual_seed(SEED)
    for case in cases:
        if time.monotonic() > deadline:
            print(f"  {model.name}: time budget spent, {case.name} and later not measured", flush=True)
            return
        st = Step(model, case.seq_lens, gen)
        name = f"{model.name}-{case.name}"
        fl = floor_us(model, st.seq, layers=LAYERS)
        p = pkvrt_step(model, st)
        rows.append({"case": name, "engine": "pkvrt-device-plan-step", "model": model.name,
                     "median_us": p["median_us"], "floor_us": fl, "max_err_ref": p["max_err"],
                     "status": p["status"],
                     "rows": len(st.seq), "max_context": int(st.seq.max()),
                     "distinct_caches": st.distinct_caches})
        for kname, t in p["per_kind_us"].items():
            rows.append({"case": name, "engine": "pkvrt-device-plan-kind", "model": model.name,
                         "trace": trace_of(name, model.name), "kind": kname,
                         "layers": sum(1 for k in model.layer_kinds(LAYERS) if k.name == kname),
                         "median_us": t, "status": p["status"]})
        base, base_paths = 0.0, {}
        for kind in model.kinds():
            n = sum(1 for k in model.layer_kinds(LAYERS) if k == kind)
            best = None
            for label in PATHS:
                if fi is None or probe.get((label, kind.name)) != "ok":
                    continue
                r = fi_kind(fi, label, model, kind, st, ws)
                rows.append({"case": name, "engine": label, "kind": kind.name, "layers": n,
                             "median_us": r.get("median_us"), "status": r["status"],
                             "max_err_ref": r.get("max_err")})
                if r["status"] == "ok" and (best is None or r["median_us"] < best[1]):
                    best = (label, r["median_us"])
            if best is None:
                base = None
            elif base is not None:
                base += best[1]
                base_paths[kind.name] = best[0]
        rows.append({"case": name, "engine": "flashinfer-fastest-correct", "model": model.name,
                     "median_us": base, "paths": base_paths, "floor_us": fl})
        ratio = f"{base / p['median_us']:.3f}" if base and p["status"] == "ok" else "none"
        print(f"  {name:<40} floor {fl:8.1f}  pkvrt {p['median_us']:8.1f} (err {p['max_err']:.1e})"
              f"  baseline {base or float('nan'):8.1f} {base_paths}  ratio {ratio}", flush=True)
        del st
        save()


def trace_of(case: str, model: str) -> str:
    """The trace of a step's case name ``<model>-<trace>[-step<N>]``."""
    return case[len(model) + 1:].rsplit("-step", 1)[0]


def summarize(rows: list) -> list:
    """Per (model, trace): the ratio of the total time over its steps, and of the floor."""
    by = {}
    for r in rows:
        if r.get("engine") not in ("pkvrt-device-plan-step", "flashinfer-fastest-correct") or "model" not in r:
            continue
        by.setdefault((r["model"], trace_of(r["case"], r["model"])), {}).setdefault(r["engine"], []).append(r)
    out = []
    for (model, trace), e in by.items():
        pk = e.get("pkvrt-device-plan-step", [])
        fi = e.get("flashinfer-fastest-correct", [])
        t_pk = sum(r["median_us"] for r in pk)
        same_steps = sorted(r["case"] for r in pk) == sorted(r["case"] for r in fi)
        t_fi = None if (not fi or not same_steps or any(r["median_us"] is None for r in fi)
                        or any(r.get("status", "ok") != "ok" for r in pk)) \
            else sum(r["median_us"] for r in fi)
        fl = sum(r["floor_us"] for r in pk)
        out.append({"case": f"{model}-{trace}", "engine": "summary", "model": model, "trace": trace,
                    "steps": len(pk), "pkvrt_us": t_pk, "baseline_us": t_fi,
                    "ratio": (t_fi / t_pk) if t_fi else None, "pkvrt_floor_fraction": fl / t_pk,
                    "baseline_floor_fraction": (fl / t_fi) if t_fi else None})
    return out


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--models", default=",".join(MODELS), help="comma-separated model names")
    ap.add_argument("--steps", type=int, default=2, help="steps sampled per trace")
    ap.add_argument("--trace-dir", default=None, help="folder holding azure2023_conv.csv")
    ap.add_argument("--out", default="benches/results/h200/model-shapes.json")
    ap.add_argument("--max-seconds", type=float, default=540.0)
    ap.add_argument("--no-flashinfer", action="store_true")
    ap.add_argument("--routes", default=None, metavar="FILE",
                    help="a routes.toml instead of the shipped one (an ablation: e.g. another "
                         "[device_planning] route); its path and sha256 go in the results' meta")
    args = ap.parse_args(argv)
    global ROUTES
    ROUTES = load_routes(args.routes)
    deadline = time.monotonic() + args.max_seconds
    names = [m for m in args.models.split(",") if m]
    unknown = [m for m in names if m not in MODELS]
    if unknown:
        ap.error(f"--models: unknown {unknown}; known: {', '.join(MODELS)}")
    if DEVICE == "cuda" and not torch.cuda.is_available():
        print("benches/model_shapes.py needs a CUDA GPU (torch sees none); nothing to run here.")
        return 0
    fi = None
    if not args.no_flashinfer:
        import flashinfer as fi
    cases = list(isolated_steps())
    cases += sample_steps("bucketed", max_active=1, count=args.steps, seed=SEED)
    cases += sample_steps("bimodal", max_active=8, count=args.steps, seed=SEED)
    if args.trace_dir:
        conv = Path(args.trace_dir) / "azure2023_conv.csv"
        cases += [c for c in sample_steps(str(conv), max_active=8, count=args.steps, seed=SEED)]
    ws = {"fa2": torch.zeros(WORKSPACE, dtype=torch.uint8, device=DEVICE),
          "xqa": torch.zeros(WORKSPACE, dtype=torch.uint8, device=DEVICE)}
    rows: list = []
    out = Path(args.out)
    meta = results.make_meta(seeds=[SEED], routes_path=ROUTES.path, kind="model-shapes", layers=LAYERS, page_size=PAGE,
                             replays=REPLAYS, tolerance=TOLERANCE, protocol=__doc__.split("\n\n")[1])

    def save():
        results.write_results(out, meta, rows + summarize(rows))

    for name in names:
        print(f"== {name}", flush=True)
        t0 = time.monotonic()
        try:
            measure_model(fi, MODELS[name], cases, ws, rows, deadline, save)
        except Exception as exc:  # noqa: BLE001 - one model's failure is recorded, the rest run
            rows.append({"case": name, "engine": "pkvrt-device-plan-step", "status":
                         f"failed: {type(exc).__name__}: {exc}"})
            print(f"  {name} FAILED: {type(exc).__name__}: {exc}", flush=True)
        print(f"  ({time.monotonic() - t0:.0f} s)", flush=True)
        save()
    summ = summarize(rows)
    results.write_results(out, meta, rows + summ)
    print(f"\n{'model / trace':<40} {'pkvrt us':>10} {'base us':>10} {'ratio':>7} {'pk/floor':>8} {'fi/floor':>8}")
    for r in summ:
        ratio = f"{r['ratio']:.3f}" if r["ratio"] else "none"
        bf = f"{r['baseline_floor_fraction']:.2f}" if r["baseline_floor_fraction"] else "-"
        print(f"{r['case']:<40} {r['pkvrt_us']:10.1f} {r['baseline_us'] or float('nan'):10.1f} "
              f"{ratio:>7} {r['pkvrt_floor_fraction']:8.2f} {bf:>8}")
    ok = [r["ratio"] for r in summ if r["ratio"]]
    print(f"geometric mean of the ratios: {geomean(ok):.3f} over {len(ok)} (model, trace) pairs")
    return 0


if __name__ == "__main__":
    sys.exit(main())
