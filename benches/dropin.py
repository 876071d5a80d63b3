"""The engine protocol through the drop-in: ``pkvrt.BatchDecodeWithPagedKVCacheWrapper`` against
``flashinfer.BatchDecodeWithPagedKVCacheWrapper``, each called exactly as an engine calls
FlashInfer's, in the same process, on the same steps and caches.

Calling styles (docs/engines.md):
- ``sglang``: NHD, page size 1, separate K and V tensors ``[tokens, 1, H_kv, D]`` per layer.
- ``vllm``: NHD, block size 64, K and V in one tensor per layer ``[blocks, 2, 64, H_kv, D]``,
  passed whole (the wrapper takes its ``[:, 0]`` / ``[:, 1]`` views).
Both in CUDA-graph mode as the engines run decode: fixed indptr / indices / last-page-length
buffers, ``plan()`` on the host before each replay, the step's 32 ``run()`` calls (Llama-3.1-8B:
H_q 32, H_kv 8, D 128, fp16, each layer its own cache) captured in one graph per wrapper.

Per step and style: the graph's replay time (CUDA events, median, ``harness.median_us``), both
wrappers' output on layer 0 against the FP32 reference, and ``plan()``'s host time (median of
PLAN_CALLS calls on the step's CSR). FlashInfer's wrapper is its tensor-core one
(``use_tensor_cores=True``, what both engines construct for GQA decode) and, as a second row,
its CUDA-core one; the ratio is against the faster of the two on each step.

``--profile-plan``: each wrapper's plan() also runs PLAN_CALLS times under cProfile (the GPU
idle before each call, as timed), and its row keeps the PROFILE_TOP functions of most own time
per call (``plan_profile``): where the host time goes, pkvrt's against FlashInfer's, on the GPU
host itself (the dev box has no copies or launches to time).

usage: python benches/dropin.py [--styles sglang,vllm] [--steps N] [--trace-dir DIR]
       [--out FILE] [--max-seconds S] [--profile-plan]
Writes benches/results/h200/dropin.json and prints a table per style.
"""

from __future__ import annotations

import argparse
import math
import statistics
import sys
import time
from pathlib import Path

import numpy as np
import torch

import pkvrt
from pkvrt import reference
from pkvrt.measure import results
from pkvrt.measure.harness import median_us
from pkvrt.measure.model_shapes import (
    LAYERS,
    MODELS,
    floor_us,
    geomean,
    isolated_steps,
    sample_steps,
)

MODEL = MODELS["llama-3.1-8b"]
STYLES = {"sglang": {"page": 1, "packed": False}, "vllm": {"page": 64, "packed": True}}
FI_LABELS = {"flashinfer-tc": True, "flashinfer-cuda": False}   # label -> use_tensor_cores
SEED = 20260623
REPLAYS = 15
PLAN_CALLS = 50
PROFILE_TOP = 25
TOLERANCE = 5e-3
CACHE_BUDGET = 24 * 2**30
WORKSPACE = 256 * 2**20
DEVICE = "cuda"            # where every tensor lives (tests/test_dropin_dry_cpu.py: "cpu")


class Step:
    """One step's CSR (pages scattered over the pool) and its per-layer caches in a style."""

    def __init__(self, seq_lens: np.ndarray, page: int, packed: bool, gen: torch.Generator):
        sh, dev = MODEL, DEVICE
        self.seq = np.asarray(seq_lens, np.int32)
        pages = -(-self.seq // page)
        self.num_pages = int(pages.sum())
        perm = torch.randperm(self.num_pages, generator=gen).numpy().astype(np.int32)
        self.indptr = np.concatenate([[0], np.cumsum(pages)]).astype(np.int32)
        self.indices = perm
        self.last = (self.seq - (pages - 1) * page).astype(np.int32)
        self.page = page
        tok = (page, sh.num_kv_heads, sh.head_dim)
        per_layer = 2 * self.num_pages * math.prod(tok) * 2
        n = min(LAYERS, max(2, CACHE_BUDGET // per_layer))
        if packed:
            kv = [torch.randn((self.num_pages, 2, *tok), device=dev, dtype=torch.float16) for _ in range(n)]
            self.cache = [kv[l % n] for l in range(LAYERS)]
            self.k = [c[:, 0] for c in self.cache]
            self.v = [c[:, 1] for c in self.cache]
        else:
            ks = [torch.randn((self.num_pages, *tok), device=dev, dtype=torch.float16) for _ in range(n)]
            vs = [torch.randn((self.num_pages, *tok), device=dev, dtype=torch.float16) for _ in range(n)]
            self.k = [ks[l % n] for l in range(LAYERS)]
            self.v = [vs[l % n] for l in range(LAYERS)]
            self.cache = list(zip(self.k, self.v))
        self.distinct_caches = n
        b = len(self.seq)
        self.q = torch.randn((LAYERS, b, sh.num_qo_heads, sh.head_dim), device=dev, dtype=torch.float16)
        self.out = torch.empty_like(self.q)
        bt = np.zeros((b, int(pages.max())), np.int32)
        for r in range(b):
            bt[r, :pages[r]] = perm[self.indptr[r]:self.indptr[r + 1]]
        self.ref = reference.decode_attention(
            self.q[0], self.k[0].transpose(1, 2), self.v[0].transpose(1, 2),
            torch.as_tensor(self.seq, device=dev), torch.as_tensor(bt, device=dev))


def rel_err(out: torch.Tensor, ref: torch.Tensor) -> float:
    e = (out.float() - ref).norm() / ref.norm()
    return float(e) if torch.isfinite(e) else float("inf")


def make_wrapper(label: str, st: Step, ws: torch.Tensor):
    b = len(st.seq)
    bufs = {"paged_kv_indptr_buffer": torch.zeros(b + 1, dtype=torch.int32, device=DEVICE),
            "paged_kv_indices_buffer": torch.zeros(st.num_pages, dtype=torch.int32, device=DEVICE),
            "paged_kv_last_page_len_buffer": torch.zeros(b, dtype=torch.int32, device=DEVICE)}
    if label == "pkvrt":
        return pkvrt.BatchDecodeWithPagedKVCacheWrapper(ws, "NHD", use_cuda_graph=True, **bufs)
    import flashinfer

    return flashinfer.BatchDecodeWithPagedKVCacheWrapper(ws, "NHD", use_cuda_graph=True,
                                                         use_tensor_cores=FI_LABELS[label], **bufs)


def measure(label: str, st: Step, ws: torch.Tensor, profile: bool = False) -> dict:
    """Plan, check layer 0, capture the 32 layers, time the replays and plan()."""
    sh = MODEL
    w = make_wrapper(label, st, ws)
    csr = (torch.as_tensor(st.indptr), torch.as_tensor(st.indices), torch.as_tensor(st.last))

    def plan():
        w.plan(*csr, sh.num_qo_heads, sh.num_kv_heads, sh.head_dim, st.page,
               q_data_type=torch.float16, kv_data_type=torch.float16, non_blocking=True)

    def layers():
        for l in range(LAYERS):
            w.run(st.q[l], st.cache[l], out=st.out[l])

    plan()
    st.out[0].fill_(float("nan"))
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):   # warm-up on a side stream, as FlashInfer's graph test does
        layers()
    torch.cuda.current_stream().wait_stream(side)
    torch.cuda.synchronize()
    err = rel_err(st.out[0], st.ref)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        layers()
    plan()                                   # re-plan, then replay: the engines' order
    st.out[0].fill_(float("nan"))            # checked below: what the replay wrote, not the warm-up
    graph.replay()
    torch.cuda.synchronize()
    err = max(err, rel_err(st.out[0], st.ref))
    row = {"median_us": median_us(layers, repeats=REPLAYS), "max_err_ref": err,
           "plan_host_us": plan_host_us(plan), "status": "ok" if err <= TOLERANCE else
           f"wrong: rel. error {err:.3g} against the FP32 reference"}
    if profile:
        row["plan_profile"] = plan_profile(plan)
    if label == "pkvrt":
        row["explain"] = w.explain()
        # the ablation: plan() building block tables on the device first (device_step), as it
        # did before the planning kernel read the CSR itself (same step, same process)
        w._csr_direct = lambda rt: False
        row["plan_host_us_blocktables"] = plan_host_us(plan)
        del w._csr_direct
    return row


def plan_host_us(plan) -> float:
    """Median host time of ``PLAN_CALLS`` plan() calls, the GPU idle before each."""
    host = []
    for _ in range(PLAN_CALLS):
        t0 = time.perf_counter()
        plan()
        host.append((time.perf_counter() - t0) * 1e6)
        torch.cuda.synchronize()             # the next plan() may rewrite buffers still being copied
    return statistics.median(host)


def plan_profile(plan) -> list[dict]:
    """``PLAN_CALLS`` plan() calls under cProfile, the GPU idle before each (as
    :func:`plan_host_us`): the PROFILE_TOP functions of most own time, per plan() call (calls,
    own and cumulative microseconds; cProfile's overhead included, so compare rows, not sums)."""
    import cProfile
    import pstats

    prof = cProfile.Profile()
    for _ in range(PLAN_CALLS):
        prof.enable()
        plan()
        prof.disable()
        torch.cuda.synchronize()
    stats = pstats.Stats(prof).stats   # {(file, line, name): (calls, primitive, tottime, cumtime, callers)}
    top = sorted(stats.items(), key=lambda kv: -kv[1][2])[:PROFILE_TOP]
    return [{"function": f"{Path(f).name}:{line}({name})", "calls": nc / PLAN_CALLS,
             "own_us": 1e6 * tt / PLAN_CALLS, "cum_us": 1e6 * ct / PLAN_CALLS}
            for (f, line, name), (_, nc, tt, ct, _) in top]


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--styles", default="sglang,vllm")
    ap.add_argument("--steps", type=int, default=2, help="steps sampled per trace")
    ap.add_argument("--trace-dir", default=None, help="folder of azure2023_conv.csv and azure2023_code.csv")
    ap.add_argument("--out", default="benches/results/h200/dropin.json")
    ap.add_argument("--max-seconds", type=float, default=540.0)
    ap.add_argument("--profile-plan", action="store_true",
                    help="also profile each wrapper's plan() (cProfile; a plan_profile per row)")
    args = ap.parse_args(argv)
    styles = [s for s in args.styles.split(",") if s]
    if not styles or any(s not in STYLES for s in styles):
        ap.error(f"--styles: expected names of {', '.join(STYLES)}")
    if not torch.cuda.is_available():
        print("benches/dropin.py needs a CUDA GPU (torch sees none); nothing to run here.")
        return 0
    deadline = time.monotonic() + args.max_seconds
    cases = list(isolated_steps())
    cases += sample_steps("bucketed", max_active=1, count=args.steps, seed=SEED)
    for fam in ("bimodal", "uniform", "zipf"):
        cases += sample_steps(fam, max_active=8, count=args.steps, seed=SEED)
    cases += sample_steps("bimodal", max_active=4, count=args.steps, seed=SEED)
    if args.trace_dir:
        for name in ("azure2023_conv.csv", "azure2023_code.csv"):
            cases += sample_steps(str(Path(args.trace_dir) / name), max_active=8, count=args.steps, seed=SEED)
    ws = {lab: torch.zeros(WORKSPACE, dtype=torch.uint8, device=DEVICE) for lab in ("pkvrt", *FI_LABELS)}
    meta = results.make_meta(seeds=[SEED], kind="dropin", model=MODEL.name, layers=LAYERS,
                             replays=REPLAYS, plan_calls=PLAN_CALLS, tolerance=TOLERANCE,
                             protocol=__doc__.split("\n\n")[1])
    rows, out = [], Path(args.out)
    gen = torch.Generator().manual_seed(SEED)
    for style in styles:
        cfg = STYLES[style]
        print(f"== {style}: NHD, page {cfg['page']}, {'K/V packed' if cfg['packed'] else 'K, V separate'}",
              flush=True)
        for case in cases:
            if time.monotonic() > deadline:
                print(f"  time budget spent: {case.name} and later not measured", flush=True)
                break
            st = Step(case.seq_lens, cfg["page"], cfg["packed"], gen)
            name = f"{style}-{case.name}"
            rec = {}
            for label in ("pkvrt", *FI_LABELS):
                try:
                    rec[label] = measure(label, st, ws[label], profile=args.profile_plan)
                except Exception as exc:  # noqa: BLE001 - recorded as the path being unavailable
                    rec[label] = {"status": f"unavailable: {type(exc).__name__}: {str(exc)[:160]}"}
                rows.append({"case": name, "style": style, "engine": label, "rows": len(st.seq),
                             "max_context": int(st.seq.max()), "floor_us": floor_us(MODEL, st.seq, layers=LAYERS),
                             "distinct_caches": st.distinct_caches, **rec[label]})
            ok_fi = [(rec[l]["median_us"], l) for l in FI_LABELS if rec[l].get("status") == "ok"]
            base = min(ok_fi) if ok_fi else None
            pk = rec["pkvrt"]
            ratio = base[0] / pk["median_us"] if base and pk.get("status") == "ok" else None
            rows.append({"case": name, "style": style, "engine": "ratio", "baseline": base and base[1],
                         "ratio": ratio,
                         "plan_host_ratio": (rec[base[1]]["plan_host_us"] / pk["plan_host_us"])
                         if ratio else None})
            print(f"  {name:<36} pkvrt {pk.get('median_us', float('nan')):8.1f} us "
                  f"(plan {pk.get('plan_host_us', float('nan')):6.1f}, block tables first "
                  f"{pk.get('plan_host_us_blocktables', float('nan')):6.1f})  "
                  + "  ".join(f"{l} {rec[l].get('median_us', float('nan')):8.1f} "
                              f"(plan {rec[l].get('plan_host_us', float('nan')):6.1f})" for l in FI_LABELS)
                  + f"  ratio {ratio if ratio is None else round(ratio, 3)}", flush=True)
            results.write_results(out, meta, rows)
            del st
    results.write_results(out, meta, rows)
    print("\n| style | steps | ratio min | ratio geomean | plan() host, pkvrt / FlashInfer (median us) "
          "| pkvrt's plan() building block tables first |")
    print("|---|---|---|---|---|---|")
    for style in styles:
        rs = [r for r in rows if r["style"] == style and r["engine"] == "ratio" and r["ratio"]]
        pk_plan = [r["plan_host_us"] for r in rows if r["style"] == style and r["engine"] == "pkvrt"
                   and "plan_host_us" in r]
        fi_plan = [r["plan_host_us"] for r in rows if r["style"] == style and r["engine"] == "flashinfer-tc"
                   and "plan_host_us" in r]
        bt_plan = [r["plan_host_us_blocktables"] for r in rows if r["style"] == style
                   and r["engine"] == "pkvrt" and "plan_host_us_blocktables" in r]
        if rs:
            print(f"| {style} | {len(rs)} | {min(r['ratio'] for r in rs):.3f} | "
                  f"{geomean([r['ratio'] for r in rs]):.3f} | "
                  f"{statistics.median(pk_plan):.1f} / {statistics.median(fi_plan) if fi_plan else float('nan'):.1f} | "
                  f"{statistics.median(bt_plan) if bt_plan else float('nan'):.1f} |")
    if args.profile_plan:
        for style in styles:
            for label in ("pkvrt", "flashinfer-tc"):
                prof = next((r["plan_profile"] for r in rows if r["style"] == style
                             and r["engine"] == label and "plan_profile" in r), None)
                if prof:
                    print(f"\n{style} {label}: plan() under cProfile, first step, own us per call")
                    for e in prof[:10]:
                        print(f"  {e['own_us']:7.1f} own {e['cum_us']:7.1f} cum {e['calls']:5.1f}x  {e['function']}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
