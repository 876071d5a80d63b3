"""Rows that share pages, in the engine protocol: pkvrt's SharedPagesRuntime (each shared page
read once per chunk of rows) against FlashInfer's plain decode and pkvrt's plain device
planning, on the steps of the sharing workloads (prefix caching, parallel sampling).

Protocol (per step; Llama-3.1-8B attention: H_q 32, H_kv 8, D 128, fp16, page 16, HND; 32
layers, each its own K/V cache while 24 GiB holds them, cycled past that; the whole step in one
CUDA graph, CUDA-event time of its replays, median of REPLAYS, ``harness.median_us``):
- ``flashinfer-tc`` / ``flashinfer-cuda``: FlashInfer's decode wrapper (tensor cores / CUDA
  cores) in CUDA-graph mode, planned outside the graph; the baseline is the faster.
- ``flashinfer-cascade``: ``MultiLevelCascadeAttentionWrapper`` given the true sharing levels
  (level 0: the shared prefix, one query group per prefix; level 1: each row's own pages), where
  this FlashInfer builds it (its Hopper prefill path JIT-compiles against CUTLASS, which the
  slimmed travel wheel drops: then recorded unavailable with the reason).
- ``pkvrt-device-plan``: ``pkvrt.Runtime`` given GPU lengths, plan() and the 32 run() calls in
  the graph (no sharing: every row reads its pages).
- ``pkvrt-shared``: ``pkvrt.SharedPagesRuntime(engine_capture=True)``: plan() outside the graph
  (the sharing found from the block tables), the 32 run() calls (query gather, shared chunks,
  own segments, merge) in it.
- ``pkvrt-shared-device``: ``pkvrt.SharedPagesRuntime(device_planning=True)`` given GPU lengths,
  plan() (find_shared and both decodes' planning) and the 32 run() calls in the graph; on the
  cases without sharing (``8x(0+...)``) its time over ``pkvrt-device-plan``'s is what the
  detection and the shared path's launches cost a step that shares nothing. It keeps the chunks
  it finds where its rule predicts them faster (``SharedPagesRuntime.device_rule``: ``shared``
  and ``predicted`` in its row); ``pkvrt-shared-device-always`` keeps every chunk, the ablation
  of that rule. Both rows also carry ``plan_us``: plan() alone, captured PLAN_CALLS times in
  one graph (their difference is what the rule costs find_shared).
Every engine's layer-0 output is checked against the FP32 reference first. Floors: the step's
K/V bytes at 4.2 TB/s, each row reading its pages (``floor_us``) and each distinct page read
once (``floor_once_us``); ``floor_once_gpu_us``: the pages-once bytes at this GPU's streaming
rate (its calibration file's ``beta_gbps``, recorded in the meta; None without a file for this
GPU), and the ratio row's ``ceiling``: the baseline's time over it, the most any engine that
reads each page once from memory can gain on the step.

``pkvrt-shared`` shares a step's pages where the calibration's time model predicts the shared
path faster (``shared`` and ``predicted`` in its row); ``pkvrt-shared-always`` shares every step
with shared pages (``RuntimeOptions(shared_when_predicted_faster=False)``), the ablation of
that rule; ``pkvrt-shared-serial`` is ``pkvrt-shared-always`` with each layer's chunk decode
and own decode one after the other on one stream (``RuntimeOptions(shared_side_stream=False)``),
the ablation of the side stream. ``--fit-l2 RESULTS...`` (no GPU) fits the calibration's ``sharing.l2_reread_cost``
to the ``pkvrt-device-plan`` rows of results files and writes it into ``--calibration``'s file
(or ``--write``'s).

A ``pkvrt-shared`` row of a step with sharing also carries ``chunk_us`` and ``own_us``: its
chunk decode's and its own decode's 32 layers timed alone (``parts_us``), so that the rest of
its time is the gathers, the merges and the launch boundaries.
``pkvrt-shared-partition``, ``pkvrt-shared-always-partition`` and
``pkvrt-shared-device-partition`` (``--chunk-cut``, or named in ``--engines``): ``pkvrt-shared``,
``pkvrt-shared-always`` and ``pkvrt-shared-device`` with
``RuntimeOptions(shared_chunk_cut="partition")``, the chunk decode cut by the planning kernel's
partition instead of at the split count the time model predicts fastest (the default, within
routes.toml's ``[sharing] model_cut_rows`` and ``model_cut_margin``): the default's ablation.
``pkvrt-shared-s<S>`` and ``pkvrt-shared-c<N>-s<S>`` (``--chunk-splits S``): ``pkvrt-shared-always``
and ``pkvrt-shared-c<N>`` with the chunk decode cut at S splits of its longest chunk
(``RuntimeOptions(shared_chunk_cut=S)``), the sweep of the cut; a count the step's chunk decode
does not take is recorded unavailable, naming the counts it takes.
``pkvrt-shared-c<N>`` (``--chunk-rows N``): ``pkvrt-shared-always`` with chunks of N rows
(``RuntimeOptions(shared_chunk_rows=N)``), the ablation of how many rows read a run in one pass;
they run whatever ``--engines`` names, unless ``--engines`` names some ``pkvrt-shared-c<N>``,
then only those. ``--engines``: only the engines of these labels (a label that names no engine is
an error, not an engine skipped).

``--reverse-pass`` times each case's engines a second time in the reverse order and keeps the
smaller median of the two (``passes_us`` holds both): the first engine of a case has measured
10-12 % slower than the same plan later in it (benches/NOTES.md, "Rows that share pages").

``--cases`` takes the names of CASES and steps of one shared prefix written as the table writes
them, ``R x (S + O)`` without spaces (``8x(4K+128)``: 8 rows sharing 4 096 tokens, 128 of their own
each), for sweeps.

usage: python benches/shared_pages.py [--cases a,b] [--out FILE] [--max-seconds S]
       [--chunk-rows N,...] [--chunk-splits S,...] [--chunk-cut] [--engines LABEL,...]
       [--reverse-pass]
       python benches/shared_pages.py --fit-l2 RESULTS... [--calibration FILE] [--write FILE]
Writes benches/results/h200/shared-pages.json and prints a table.
"""

from __future__ import annotations

import argparse
import functools
import math
import re
import sys
import time
from pathlib import Path

import numpy as np
import torch

import pkvrt
from pkvrt import reference
from pkvrt.measure import coverage_results, results
from pkvrt.measure.harness import median_us
from pkvrt.policy.calibration import beta_gbps_for

H_Q, H_KV, D, PAGE, LAYERS = 32, 8, 128, 16, 32
REPLAYS = 15
PLAN_CALLS = 20          # plan() calls per graph in a device-lengths row's plan_us
TOLERANCE = 5e-3
CACHE_BUDGET = 24 * 2**30
FLOOR_BYTES_PER_US = coverage_results.FLOOR_GBPS * 1e3   # 4.2 TB/s
WORKSPACE = 256 * 2**20    # bytes of each FlashInfer workspace
DEVICE = "cuda"            # where every tensor lives (tests/test_shared_pages_dry_cpu.py: "cpu")
SEED = 20260623
# every engine's label, in the order a case runs them (and pkvrt-shared-c<N> of --chunk-rows)
ENGINES = ("pkvrt-shared", "pkvrt-shared-always", "pkvrt-shared-serial", "pkvrt-shared-device",
           "pkvrt-shared-device-always", "pkvrt-device-plan", "flashinfer-tc", "flashinfer-cuda", "flashinfer-cascade")
# --chunk-cut: pkvrt-shared, pkvrt-shared-always and pkvrt-shared-device with the chunk decode cut
# by the partition
CUT_ENGINES = ("pkvrt-shared-partition", "pkvrt-shared-always-partition", "pkvrt-shared-device-partition")
# name -> (groups of (rows, shared tokens), own tokens per row): the sharing workloads' steps
CASES = {
    "8x(8K+512)": ([(8, 8192)], 512),
    "8x(32K+128)": ([(8, 32768)], 128),
    "32x(4K+256)": ([(32, 4096)], 256),
    "64x(2K+1K)": ([(64, 2048)], 1024),
    "16x(1K+1K)": ([(16, 1024)], 1024),
    "parallel-8x(2K..16K)x4": ([(8, 2048), (8, 4096), (8, 8192), (8, 16384)], 64),
    # no sharing: what the device-lengths detection costs a step that shares nothing
    "8x(0+8K)": ([(8, 0)], 8192),
    "8x(0+1K)": ([(8, 0)], 1024),
}


_SPEC = re.compile(r"(\d+)x\((\d+)(K?)\+(\d+)(K?)\)")


def case_spec(name: str) -> tuple[list, int] | None:
    """A case's (groups, own tokens): its row of CASES, or a name ``RxS+O`` written as the table
    writes them, ``R x (S + O)`` (R rows sharing S tokens, then O of their own each; ``8x(4K+128)``,
    K = 1024): a step of one shared prefix at any size, for sweeps (None: neither)."""
    if name in CASES:
        return CASES[name]
    m = _SPEC.fullmatch(name)
    if m is None:
        return None
    rows, shared, own = int(m[1]), int(m[2]) * (1024 if m[3] else 1), int(m[4]) * (1024 if m[5] else 1)
    if rows < 1 or own < 1 or shared % PAGE:
        return None
    return [(rows, shared)], own


class Step:
    """A step's block tables (each group's rows share its prefix pages, then pages of their
    own, all scattered over the pool), its per-layer caches and queries."""

    def __init__(self, groups, own: int, gen: torch.Generator):
        lens = [shared + own for rows, shared in groups for _ in range(rows)]
        self.seq = np.array(lens, np.int32)
        b = len(lens)
        own_pages = -(-own // PAGE) + 1
        total = sum(-(-s // PAGE) for _, s in groups) + b * own_pages
        perm = torch.randperm(total, generator=gen).numpy().astype(np.int32)
        width = int(max(-(-s // PAGE) for s in self.seq))
        bt = np.zeros((b, width), np.int32)
        at, r = 0, 0
        self.levels = []   # (rows, prefix pages) per group: the cascade's level 0
        for rows, shared in groups:
            n = shared // PAGE
            prefix = perm[at:at + n]
            at += n
            self.levels.append((list(range(r, r + rows)), prefix))
            for i in range(r, r + rows):
                pages = -(-int(self.seq[i]) // PAGE)
                bt[i, :n] = prefix
                bt[i, n:pages] = perm[at:at + pages - n]
                at += pages - n
            r += rows
        self.bt = bt
        self.num_pages = total
        self.seq_d = torch.as_tensor(self.seq, device=DEVICE)
        self.bt_d = torch.as_tensor(bt, device=DEVICE)
        shape = (total, H_KV, PAGE, D)
        per_layer = 2 * math.prod(shape) * 2
        n = min(LAYERS, max(2, CACHE_BUDGET // per_layer))
        ks = [torch.randn(shape, device=DEVICE, dtype=torch.float16) for _ in range(n)]
        vs = [torch.randn(shape, device=DEVICE, dtype=torch.float16) for _ in range(n)]
        self.k = [ks[l % n] for l in range(LAYERS)]
        self.v = [vs[l % n] for l in range(LAYERS)]
        self.distinct_caches = n
        self.q = torch.randn((LAYERS, b, H_Q, D), device=DEVICE, dtype=torch.float16)
        self.out = torch.empty_like(self.q)
        self.ref = reference.decode_attention(self.q[0], self.k[0], self.v[0], self.seq_d, self.bt_d)
        per_token = 2 * H_KV * D * 2 * LAYERS
        self.floor_us = float(self.seq.sum()) * per_token / FLOOR_BYTES_PER_US
        used = np.concatenate([bt[i, :-(-int(s) // PAGE)] for i, s in enumerate(self.seq)])
        self.floor_once_us = np.unique(used).size * PAGE * per_token / FLOOR_BYTES_PER_US


def floor_at(floor_us: float, beta_gbps: float | None) -> float | None:
    """A floor of FLOOR_BYTES_PER_US restated at ``beta_gbps`` (None: no rate)."""
    return floor_us * FLOOR_BYTES_PER_US / (beta_gbps * 1e3) if beta_gbps else None


def rel_err(out, ref) -> float:
    e = (out.float() - ref).norm() / ref.norm()
    return float(e) if torch.isfinite(e) else float("inf")


def timed(st: Step, plan, body) -> dict:
    """Check layer 0 eagerly, capture ``body`` in one graph, check layer 0 as one replay of it
    writes it (the step that is timed, not its warm-up), then time its replays
    (``harness.median_us``); ``plan``: called once first (None: planned by the caller or inside
    ``body``)."""
    from pkvrt.runtime import graphs

    if plan is not None:
        plan()
    st.out.fill_(float("nan"))
    body()
    torch.cuda.synchronize()
    err = rel_err(st.out[0], st.ref)
    if err <= TOLERANCE:
        graph = graphs.capture(body).graph
        st.out.fill_(float("nan"))
        graph.replay()
        torch.cuda.synchronize()
        err = max(err, rel_err(st.out[0], st.ref))
    if not err <= TOLERANCE:
        return {"status": f"wrong: rel. error {err:.3g} against the FP32 reference", "max_err_ref": err}
    return {"status": "ok", "median_us": median_us(None, repeats=REPLAYS, graph=graph), "max_err_ref": err}


def unavailable(exc: Exception) -> str:
    """An engine's status where it raised: the exception's type and first line."""
    return f"unavailable: {type(exc).__name__}: {(str(exc).splitlines() or [''])[0][:200]}"


def reverse_pass(st: Step, engines: dict, rec: dict) -> None:
    """``--reverse-pass``: time the case's engines that ran again, in the reverse order, each
    rebuilt as in the first pass; a row keeps both medians (``passes_us``, first pass first) and
    the smaller as ``median_us``, so that no engine's time depends on where it ran in the case
    (the first engine of a case has measured 10-12 % slower than the same plan later in it).
    The row's other fields (``explain``, ``chunk_us``, ``own_us``, ...) are the first pass's. A
    second pass that answers wrong makes the row wrong; one that raises leaves the first pass's
    time (``passes_us`` [first, None]) and says why in ``second_pass``."""
    for label in reversed(list(engines)):
        first = rec[label]
        if first.get("status") != "ok":
            continue
        try:
            again = engines[label](st)
        except Exception as exc:  # noqa: BLE001 - the first pass stands, the failure is recorded
            first["second_pass"] = unavailable(exc)
            first["passes_us"] = [first["median_us"], None]
            continue
        if again.get("status") != "ok":
            rec[label] = {**again, "passes_us": [first["median_us"], None]}   # a wrong answer stands
            continue
        passes = [first["median_us"], again["median_us"]]
        rec[label] = {**first, "median_us": min(passes), "passes_us": passes,
                      "max_err_ref": max(first["max_err_ref"], again["max_err_ref"])}


def fi_plain(fi, st: Step, *, tensor_cores: bool) -> dict:
    b = len(st.seq)
    ws = torch.zeros(WORKSPACE, dtype=torch.uint8, device=DEVICE)
    pages = -(-st.seq // PAGE)
    bufs = (torch.zeros(b + 1, dtype=torch.int32, device=DEVICE),
            torch.zeros(int(pages.sum()), dtype=torch.int32, device=DEVICE),   # shared pages repeat
            torch.zeros(b, dtype=torch.int32, device=DEVICE))
    w = fi.BatchDecodeWithPagedKVCacheWrapper(ws, "HND", use_cuda_graph=True, use_tensor_cores=tensor_cores,
                                              paged_kv_indptr_buffer=bufs[0], paged_kv_indices_buffer=bufs[1],
                                              paged_kv_last_page_len_buffer=bufs[2])
    indptr = np.concatenate([[0], np.cumsum(pages)]).astype(np.int32)
    indices = np.concatenate([st.bt[i, :p] for i, p in enumerate(pages)]).astype(np.int32)
    last = (st.seq - (pages - 1) * PAGE).astype(np.int32)
    w.plan(torch.as_tensor(indptr), torch.as_tensor(indices), torch.as_tensor(last), H_Q, H_KV, D, PAGE,
           q_data_type=torch.float16, kv_data_type=torch.float16)

    def body():
        for l in range(LAYERS):
            w.run(st.q[l], (st.k[l], st.v[l]), out=st.out[l])
    return timed(st, None, body)


def fi_cascade(fi, st: Step) -> dict:
    """Two levels: each group's prefix (its rows one query group), then each row's own pages."""
    ws = torch.zeros(WORKSPACE, dtype=torch.uint8, device=DEVICE)
    w = fi.MultiLevelCascadeAttentionWrapper(2, ws, "HND")
    qo0, kv0, idx0, last0 = [0], [0], [], []
    for rows, prefix in st.levels:
        qo0.append(qo0[-1] + len(rows))
        kv0.append(kv0[-1] + len(prefix))
        idx0 += list(prefix)
        last0.append(PAGE)
    qo1, kv1, idx1, last1 = [0], [0], [], []
    for i, s in enumerate(st.seq):
        n_pre = next(len(p) for rows, p in st.levels if i in rows)
        pages = -(-int(s) // PAGE)
        qo1.append(i + 1)
        kv1.append(kv1[-1] + pages - n_pre)
        idx1 += list(st.bt[i, n_pre:pages])
        last1.append(int(s) - (pages - 1) * PAGE)
    t = lambda x: torch.tensor(x, dtype=torch.int32, device=DEVICE)  # noqa: E731
    w.plan([t(qo0), t(qo1)], [t(kv0), t(kv1)], [t(idx0), t(idx1)], [t(last0), t(last1)],
           H_Q, H_KV, D, PAGE, causal=False, q_data_type=torch.float16)

    def body():
        for l in range(LAYERS):
            st.out[l].copy_(w.run(st.q[l], (st.k[l], st.v[l])))
    return timed(st, None, body)


def pkvrt_plain(st: Step) -> dict:
    rt = pkvrt.Runtime(H_Q, H_KV, D, PAGE, torch.float16, max_batch=max(8, len(st.seq)),
                       max_pages_per_row=st.bt.shape[1], num_pages=st.num_pages)

    def body():
        rt.plan(st.seq_d, st.bt_d)
        for l in range(LAYERS):
            rt.run(st.q[l], st.k[l], st.v[l], out=st.out[l])
    return timed(st, None, body)


def pkvrt_shared(st: Step, chunk_rows: int | None = None, always: bool = False,
                 side_stream: bool = True, cut: str | int = "time_model") -> dict:
    rt = pkvrt.SharedPagesRuntime(H_Q, H_KV, D, PAGE, torch.float16, max_batch=max(8, len(st.seq)),
                                  max_pages_per_row=st.bt.shape[1], num_pages=st.num_pages,
                                  engine_capture=True,
                                  options=pkvrt.RuntimeOptions(shared_chunk_rows=chunk_rows,
                                                               shared_when_predicted_faster=not always,
                                                               shared_side_stream=side_stream,
                                                               shared_chunk_cut=cut))
    t0 = time.perf_counter()
    rt.plan(st.seq, st.bt)
    plan_us = (time.perf_counter() - t0) * 1e6

    def body():
        for l in range(LAYERS):
            rt.run(st.q[l], st.k[l], st.v[l], out=st.out[l])
    row = timed(st, None, body)
    row.update(plan_host_us_first=plan_us, explain=rt.explain(), shared=rt.plan_used is not None,
               predicted=rt.sharing_prediction)
    if rt.plan_used is not None:   # the chunk decode's cut: its longest chunk's splits
        row["chunk_splits"] = rt.shared._pinned_splits if cut != "partition" else None
    if row["status"] == "ok" and rt.plan_used is not None and side_stream:   # (serial: the same parts)
        row.update(parts_us(rt, st))
    return row


def parts_us(rt, st: Step) -> dict:
    """Where a shared step's time goes: its chunk decode's 32 layers alone and its own decode's
    alone, each captured and timed as the whole step is (``harness.median_us``); the rest of
    ``median_us`` is the query gathers, the merges and the launch boundaries between them, less
    what the two decodes overlap (the chunk decode on its side stream). The
    parts read the Runtimes' static buffers as the step does (their outputs are not checked:
    the whole step was). ``parts_error`` instead where a part fails."""
    sp = rt.plan_used
    chunks = sp.chunk_rows.shape[0]
    s_own = len(st.seq) if rt._own_identity else sp.own_rows.size

    def chunk():
        for l in range(LAYERS):
            rt.shared.run(rt.shared.static_q(chunks), st.k[l], st.v[l], out=rt.shared.static_out(chunks),
                          lse=rt._lse_v[:chunks])

    def own():
        for l in range(LAYERS):
            q = st.q[l] if rt._own_identity else rt.own.static_q(s_own)
            rt.own.run(q, st.k[l], st.v[l], out=rt.own.static_out(s_own), lse=rt._lse_o[:s_own])
    try:
        return {"chunk_us": median_us(chunk, repeats=REPLAYS), "own_us": median_us(own, repeats=REPLAYS)}
    except Exception as exc:  # noqa: BLE001 - a diagnostic: the step's own row stays as measured
        return {"parts_error": f"{type(exc).__name__}: {str(exc)[:160]}"}


def pkvrt_shared_device(st: Step, always: bool = False, cut: str = "time_model") -> dict:
    rt = pkvrt.SharedPagesRuntime(H_Q, H_KV, D, PAGE, torch.float16, max_batch=max(8, len(st.seq)),
                                  max_pages_per_row=st.bt.shape[1], num_pages=st.num_pages,
                                  device_planning=True,
                                  options=pkvrt.RuntimeOptions(use_cuda_graph=False,
                                                               shared_when_predicted_faster=not always,
                                                               shared_chunk_cut=cut))

    def body():
        rt.plan(st.seq_d, st.bt_d)
        for l in range(LAYERS):
            rt.run(st.q[l], st.k[l], st.v[l], out=st.out[l])
    row = timed(st, None, body)
    if row["status"] == "ok":
        # plan() alone (find_shared, its rule included, and both decodes' planning launches),
        # PLAN_CALLS times in one graph: what the step's planning costs apart from the decodes
        row["plan_us"] = median_us(lambda: [rt.plan(st.seq_d, st.bt_d) for _ in range(PLAN_CALLS)],
                                   calls_per_fn=PLAN_CALLS, repeats=REPLAYS)
    found = rt.found()
    d = found.decision if found is not None else None
    row.update(tokens_saved=found.tokens_saved if found is not None else 0, explain=rt.explain(),
               shared=bool(found is not None and found.tokens_saved > 0),
               predicted=None if d is None else {"plain_us": d.plain_us, "shared_us": d.shared_us,
                                                 "margin": rt.device_rule(len(st.seq)).margin,
                                                 "plain_rereads": d.plain_rereads,
                                                 "chunk_rereads": d.chunk_rereads,
                                                 "chunk_splits": d.chunk_splits})
    return row


def case_pages(name: str) -> tuple[np.ndarray, int]:
    """A case's lengths and how many of its plain step's page reads are re-reads (its rows read
    each group's prefix pages; the rest are their own)."""
    groups, own = case_spec(name)
    seq = np.array([shared + own for rows, shared in groups for _ in range(rows)], np.int64)
    each = int((-(-seq // PAGE)).sum())
    distinct = sum(shared // PAGE + rows * (-(-(shared + own) // PAGE) - shared // PAGE)
                   for rows, shared in groups)
    return seq, each - distinct


def fit_l2(files, base: str, write: str, argv) -> int:
    """``--fit-l2``: each case with shared pages measured on ``pkvrt-device-plan`` (plain device
    planning: every row reads its pages) against the time model's prediction of that step,
    per layer; fit ``sharing.l2_reread_cost`` (``pkvrt.policy.sharing.fit_l2_reread_cost``),
    and ``sharing.overhead_us`` from the ``pkvrt-shared-always`` rows timed in parts, and
    write them into the calibration file."""
    import datetime
    import json

    import attrs

    from pkvrt.policy import sharing
    from pkvrt.policy.calibration import SharingCost, load_calibration, save_calibration
    from pkvrt.policy.registry import load_routes
    from pkvrt.policy.router import Router

    cal, reg = load_calibration(base), load_routes()
    router = Router(reg, cal, num_qo_heads=H_Q, num_kv_heads=H_KV, head_dim=D, page_size=PAGE)
    page_bytes = 2 * H_KV * PAGE * D * 2
    steps, lines, overheads = [], [], []
    for f in files:
        for row in json.loads(Path(f).read_text())["rows"]:
            if row.get("engine") == "pkvrt-shared-always" and row.get("status") == "ok" \
                    and "chunk_us" in row and "own_us" in row:
                # the shared step beyond its two decodes (each timed alone, as the step is)
                overheads.append((row["median_us"] - row["chunk_us"] - row["own_us"]) / LAYERS)
                lines.append(f"{row['case']:<26} shared step beyond its decodes {overheads[-1]:6.1f} us "
                             f"({Path(f).name})")
            if row.get("engine") != "pkvrt-device-plan" or row.get("status") != "ok" \
                    or row["case"] not in CASES:
                continue
            seq, rereads = case_pages(row["case"])
            if not rereads:
                continue
            measured = row["median_us"] / LAYERS
            model = router.predict(reg.device_planning_route(len(seq)), seq)
            x = rereads * page_bytes / (cal.beta_gbps * 1e3)
            steps.append((measured, model, x))
            lines.append(f"{row['case']:<26} measured {measured:7.1f}  model {model:7.1f}  "
                         f"re-reads {x:7.1f} us  ({Path(f).name})")
    cost = sharing.fit_l2_reread_cost(steps)
    print("\n".join(lines))
    err = max(abs(p - (1 - cost) * x - m) / m for m, p, x in steps)
    print(f"l2_reread_cost {cost:.3f} over {len(steps)} steps; worst error {100 * err:.1f} %")
    src = (f"Fitted by benches/shared_pages.py --fit-l2 ({', '.join(Path(f).name for f in files)}): "
           f"{len(steps)} steps with shared pages on pkvrt-device-plan (32 layers, one graph), the "
           f"time model's prediction of each against its measured time per layer; worst error of "
           f"the fitted plain-step model {100 * err:.1f} %.")
    overhead = None
    if overheads:   # the median: robust to one step's noise; never below 0 (a step timed whole
        # can overlap its parts more than they did alone)
        overhead = max(0.0, round(float(np.median(overheads)), 2))
        print(f"overhead_us {overhead:.2f} (median of {len(overheads)} shared steps, "
              f"{min(overheads):.1f}..{max(overheads):.1f})")
        src += (f" overhead_us: the median over {len(overheads)} pkvrt-shared-always steps of their "
                f"time per layer less their chunk and own decodes' (chunk_us, own_us: each timed "
                f"alone), {min(overheads):.1f}..{max(overheads):.1f} us.")
    sec = SharingCost(l2_reread_cost=round(cost, 4), date=datetime.date.today().isoformat(),
                      command="python benches/shared_pages.py " + " ".join(argv or sys.argv[1:]),
                      provenance=src, overhead_us=overhead)
    save_calibration(attrs.evolve(cal, sharing=sec), write)
    print(f"wrote {write}")
    return 0


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--cases", default=",".join(CASES))
    ap.add_argument("--out", default="benches/results/h200/shared-pages.json")
    ap.add_argument("--max-seconds", type=float, default=540.0)
    ap.add_argument("--no-flashinfer", action="store_true")
    ap.add_argument("--chunk-rows", default="",
                    help="also run pkvrt-shared with chunks of these many rows (comma-separated; the "
                         "ablation of options.shared_chunk_rows, engines pkvrt-shared-c<N>)")
    ap.add_argument("--chunk-splits", default="",
                    help="also run pkvrt-shared-always and each pkvrt-shared-c<N> with the chunk "
                         "decode cut at these many splits of its longest chunk (comma-separated; "
                         "the sweep of options.shared_chunk_cut, engines pkvrt-shared-s<S> and "
                         "pkvrt-shared-c<N>-s<S>)")
    ap.add_argument("--engines", default=None,
                    help=f"run only these engines (comma-separated labels of {', '.join(ENGINES)} "
                         "and pkvrt-shared-c<N>, -s<S>, -c<N>-s<S> of --chunk-rows and --chunk-splits; "
                         "default: all; the chunked and pinned engines "
                         "run unless --engines names some of them, then only those)")
    ap.add_argument("--chunk-cut", action="store_true",
                    help="also run pkvrt-shared-partition, pkvrt-shared-always-partition and "
                         "pkvrt-shared-device-partition: pkvrt-shared, pkvrt-shared-always and "
                         "pkvrt-shared-device with RuntimeOptions(shared_chunk_cut="
                         "\"partition\") (the chunk decode cut by the planning kernel's partition, "
                         "not the time model's fastest split count: the default's ablation)")
    ap.add_argument("--reverse-pass", action="store_true",
                    help="time each case's engines a second time in the reverse order; each row "
                         "keeps both medians (passes_us) and the smaller as median_us")
    ap.add_argument("--fit-l2", nargs="+", metavar="RESULTS", default=None,
                    help="no GPU: fit the calibration's sharing.l2_reread_cost to the "
                         "pkvrt-device-plan rows of these results files (steps with shared pages) "
                         "and sharing.overhead_us to their pkvrt-shared-always rows, and write "
                         "them into --calibration's file at --write")
    ap.add_argument("--calibration", default="calibration/nvidia-h200.json")
    ap.add_argument("--write", default=None, help="--fit-l2: the calibration file to write "
                                                  "(default: --calibration's)")
    args = ap.parse_args(argv)
    if args.fit_l2:
        return fit_l2(args.fit_l2, args.calibration, args.write or args.calibration, argv)
    chunk_rows = [int(x) for x in args.chunk_rows.split(",") if x]
    only = None if args.engines is None else [e for e in args.engines.split(",") if e]
    chunk_splits = [int(x) for x in args.chunk_splits.split(",") if x]
    if any(n < 1 for n in chunk_splits):
        ap.error(f"--chunk-splits {args.chunk_splits}: expected split counts >= 1")
    # (label, chunk rows, pinned splits) of the chunked and pinned engines
    variants = [(f"pkvrt-shared-c{c}", c, "time_model") for c in chunk_rows] + \
        [(f"pkvrt-shared{'' if c is None else f'-c{c}'}-s{n}", c, n)
         for c in (None, *chunk_rows) for n in chunk_splits]
    chunked = tuple(label for label, _, _ in variants)
    labels = ENGINES + chunked + CUT_ENGINES
    if only is not None and any(e not in labels for e in only):
        ap.error(f"--engines: {', '.join(e for e in only if e not in labels)}: expected labels of "
                 f"{', '.join(labels)} (pkvrt-shared-c<N>: with --chunk-rows N; -s<S>: with --chunk-splits S)")
    names = [c for c in args.cases.split(",") if c]
    bad = [n for n in names if case_spec(n) is None]
    if bad:
        ap.error(f"--cases: {', '.join(bad)}: expected names of {', '.join(CASES)}, or R x (S + O) "
                 f"steps written as 8x(4K+128) (R rows, S shared tokens a multiple of {PAGE}, O >= 1 "
                 "own tokens each; K = 1024)")
    if not torch.cuda.is_available():
        print("benches/shared_pages.py needs a CUDA GPU (torch sees none); nothing to run here.")
        return 0
    fi = None
    if not args.no_flashinfer:
        import flashinfer as fi
    deadline = time.monotonic() + args.max_seconds
    beta = beta_gbps_for(torch.cuda.get_device_name())
    meta = results.make_meta(seeds=[SEED], kind="shared-pages", layers=LAYERS, page_size=PAGE,
                             replays=REPLAYS, tolerance=TOLERANCE, beta_gbps=beta,
                             protocol=__doc__.split("\n\n")[1])
    rows, out = [], Path(args.out)
    gen = torch.Generator().manual_seed(SEED)
    cascade_unavailable = None
    print(f"{'case':<26} {'floor':>8} {'once':>7}  engine times (us)")
    for name in names:
        if time.monotonic() > deadline:
            print(f"time budget spent: {name} and later not measured")
            break
        groups, own = case_spec(name)
        st = Step(groups, own, gen)
        rec = {}
        engines = {"pkvrt-shared": pkvrt_shared,
                   "pkvrt-shared-always": functools.partial(pkvrt_shared, always=True),
                   "pkvrt-shared-serial": functools.partial(pkvrt_shared, always=True, side_stream=False),
                   "pkvrt-shared-device": pkvrt_shared_device,
                   "pkvrt-shared-device-always": functools.partial(pkvrt_shared_device, always=True),
                   "pkvrt-device-plan": pkvrt_plain}
        if fi is not None:
            engines.update({"flashinfer-tc": functools.partial(fi_plain, fi, tensor_cores=True),
                            "flashinfer-cuda": functools.partial(fi_plain, fi, tensor_cores=False)})
            if any(shared for _, shared in groups):   # a cascade needs a shared level
                engines["flashinfer-cascade"] = functools.partial(fi_cascade, fi)
        engines.update({label: functools.partial(pkvrt_shared, chunk_rows=c, always=True, cut=cut)
                        for label, c, cut in variants})
        if args.chunk_cut or (only is not None and any(e in CUT_ENGINES for e in only)):
            engines.update({"pkvrt-shared-partition": functools.partial(pkvrt_shared, cut="partition"),
                            "pkvrt-shared-always-partition": functools.partial(pkvrt_shared, always=True,
                                                                               cut="partition"),
                            "pkvrt-shared-device-partition": functools.partial(pkvrt_shared_device,
                                                                               cut="partition")})
        if only is not None:
            engines = {k: v for k, v in engines.items()
                       if k in only or (k in chunked and not any(e in chunked for e in only))}
        for label, fn in engines.items():
            try:
                if label == "flashinfer-cascade" and cascade_unavailable:
                    rec[label] = {"status": cascade_unavailable}   # no failed JIT build per case
                else:
                    rec[label] = fn(st)
            except Exception as exc:  # noqa: BLE001 - recorded as unavailable, the rest run
                rec[label] = {"status": unavailable(exc)}
                if label == "flashinfer-cascade":
                    cascade_unavailable = rec[label]["status"] + f" (on {name}; not tried again)"
        if args.reverse_pass and time.monotonic() > deadline:
            print(f"time budget spent: {name} timed once (no reverse pass)")
        elif args.reverse_pass:
            reverse_pass(st, engines, rec)
        once_gpu = floor_at(st.floor_once_us, beta)
        for label in engines:
            rows.append({"case": name, "engine": label, "rows": int(len(st.seq)),
                         "floor_us": st.floor_us, "floor_once_us": st.floor_once_us,
                         "floor_once_gpu_us": once_gpu,
                         "distinct_caches": st.distinct_caches, **rec[label]})
        ok = {k: v["median_us"] for k, v in rec.items() if v.get("status") == "ok"}
        base = min((ok[k], k) for k in ok if k.startswith("flashinfer")) if any(
            k.startswith("flashinfer") for k in ok) else None
        ratio = base[0] / ok["pkvrt-shared"] if base and "pkvrt-shared" in ok else None
        per = lambda k: base[0] / ok[k] if base and k in ok else None  # noqa: E731
        rows.append({"case": name, "engine": "ratio", "baseline": base and base[1], "ratio": ratio,
                     "ceiling": base[0] / once_gpu if base and once_gpu else None,
                     "ratio_plain": per("pkvrt-device-plan"), "ratio_device": per("pkvrt-shared-device"),
                     "ratio_device_always": per("pkvrt-shared-device-always"),
                     "ratio_always": per("pkvrt-shared-always"), "ratio_serial": per("pkvrt-shared-serial"),
                     **{f"ratio_{label[len('pkvrt-shared-'):]}": per(label) for label in chunked},
                     **({"ratio_partition": per("pkvrt-shared-partition"),
                         "ratio_always_partition": per("pkvrt-shared-always-partition")}
                        if any(k in rec for k in CUT_ENGINES) else {}),
                     # the device-lengths shared path over plain device planning (no sharing: its cost)
                     "device_over_plain": (ok["pkvrt-shared-device"] / ok["pkvrt-device-plan"])
                     if {"pkvrt-shared-device", "pkvrt-device-plan"} <= ok.keys() else None})
        print(f"{name:<26} {st.floor_us:8.0f} {st.floor_once_us:7.0f}  "
              + "  ".join(f"{k} {v:.0f}" for k, v in ok.items())
              + "".join(f"  {k} plan() {rec[k]['plan_us']:.1f}" for k in ok if "plan_us" in rec[k])
              + f"  ratio {ratio if ratio is None else round(ratio, 3)}", flush=True)
        results.write_results(out, meta, rows)
        del st
    results.write_results(out, meta, rows)
    return 0


if __name__ == "__main__":
    sys.exit(main())
