"""Isolated decode benchmark (the seed's Table 1 protocol, on the GPU at hand).

Shape H_q=32, H_kv=8 (G=4), D=128, fp16, page 16, 50 % holes (G=1 and G=8 cases change H_kv).
Every engine runs on the same pages and is timed the same way: a CUDA graph that calls it once
per cache copy (copies rotate so that no case is an L2 number), replayed many times, CUDA-event
median per call. Correctness is checked before timing against FlashInfer (seed tolerance) and
the FP32 reference. Also measured in the same run: streaming-read bandwidth (the floor's beta).

FlashInfer's decode paths (pkvrt/measure/fi_engines.py: the CUDA-core, tensor-core and cuDNN wrappers and
XQA) each get a row; the baseline of a case is the fastest of them that matches the FP32
reference, named in every row of the case (``baseline_engine``, ``ratio_vs_fi`` = its time over
the row's). A path that cannot run here is printed and recorded in the meta with the reason
(``baseline_candidates``: case -> path -> "ok" | "unavailable: ..." | "wrong output: ...").

FP8 K/V (``--kv-dtype fp8``): the same cases (default B1-32K, B8-32K) with the caches
in float8_e4m3fn and fp16 q/out, one float32 scale per tensor for K and one for V (FlashInfer's
paths take host floats: the wrappers' ``k_scale``/``v_scale``, XQA's ``bmm1_scale``/
``bmm2_scale``; pkvrt's kernels read the same values from device tensors). ``--fp8-scales unit``
(default) casts the fp16 data to e4m3 with scales 1, so no FlashInfer path pays for a scale
(the wrappers multiply ``out`` by a ``v_scale`` other than 1 in a separate kernel);
``amax`` quantizes with amax / 448 (``reference.quantize_kv``). Every engine is checked against
the FP32 reference over the dequantized cache (the fp16 tolerance) and, end to end, against FP32
attention over the fp16 values the cache was quantized from (``reference.fp8_error_bound``); a
FlashInfer path is the baseline if it passes either (an FP8 path that also rounds q or P to FP8
still counts).

usage: python benches/isolated.py [--out benches/results/h200/isolated.json] [--cases B1-32K,...]
       [--splits 8,16,32] [--wq-splits 16] (extra split counts to sweep, exploration only)
       [--kv-dtype fp8 [--fp8-scales unit|amax]] (default out: .../isolated-fp8.json)
"""

from __future__ import annotations

import argparse
import copy
import math
import sys
from pathlib import Path

import attrs
import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests"))
from paged import make_batch, simple_tasks  # noqa: E402

from pkvrt import reference  # noqa: E402
from pkvrt.launch import _driver, ops  # noqa: E402
from pkvrt.measure import fi_engines, results  # noqa: E402
from pkvrt.measure.harness import median_us  # noqa: E402  (graph-replay CUDA-event median per call)
from pkvrt.measure.harness import within_tolerance  # noqa: E402  (the serving bench's FP32 tolerance)
from pkvrt.policy import planner  # noqa: E402
from pkvrt.runtime.graphs import collector_paused  # noqa: E402
from pkvrt.policy.blocktables import to_padded  # noqa: E402
from pkvrt.policy.calibration import find_calibration  # noqa: E402
from pkvrt.policy.registry import load_routes  # noqa: E402

SEED = 20260623
CASES = {  # name -> (seq_lens, H_q, H_kv)
    "B1-8K": ([8192], 32, 8),
    "B1-32K": ([32768], 32, 8),
    "B1-64K": ([65536], 32, 8),
    "B1-128K": ([131072], 32, 8),
    "B4-32K": ([32768] * 4, 32, 8),
    "B8-32K": ([32768] * 8, 32, 8),
    "B8-bimodal": ([32768, 2048, 3072, 4096, 32000, 1024, 2560, 3584], 32, 8),
    "G1-B1-32K": ([32768], 32, 32),
    "G8-B1-32K": ([32768], 32, 4),
    "G1-B8-bimodal": ([32768, 2048, 3072, 4096, 32000, 1024, 2560, 3584], 32, 32),
    "G8-B8-bimodal": ([32768, 2048, 3072, 4096, 32000, 1024, 2560, 3584], 32, 4),
    # the group sizes the models add, and the chunk decodes of SharedPagesRuntime (a chunk of
    # 16 / G rows is one decode row of group 16): 8 x (8K + 512) and 16 x (1K + 1K) at G 4
    "G4-B8-8K": ([8192] * 8, 32, 8),
    "G16-B2-8K": ([8192] * 2, 128, 8),
    "G16-B4-1K": ([1024] * 4, 128, 8),
    "G16-B8-bimodal": ([32768, 2048, 3072, 4096, 32000, 1024, 2560, 3584], 64, 4),
    "G7-B8-bimodal": ([32768, 2048, 3072, 4096, 32000, 1024, 2560, 3584], 28, 4),
    # benches/dropin.py's Zipf B8 step 0 (seed 20260623): 17 % over the H100's time model at its cut
    "B8-zipf": ([10743, 2360, 3729, 4246, 3041, 4852, 2999, 6243], 32, 8),
}
DEFAULT_CASES = [c for c in CASES if (not c.endswith("B8-bimodal") or c == "B8-bimodal")
                 and c not in ("G4-B8-8K", "G16-B2-8K", "G16-B4-1K", "B8-zipf")]
FP8_CASES = ["B1-32K", "B8-32K"]   # the FP8 table (isolated-fp8.json)
L2_ROTATE_BYTES = 3 * 60 * 2**20
FP8 = torch.float8_e4m3fn


def read_bandwidth_gbps() -> float:
    """Streaming read: a sum over 2 GiB of fp16 (reads each byte once, writes ~nothing)."""
    x = torch.randn(2**17, 2**13, device="cuda", dtype=torch.float16)
    out = torch.empty(2**17, device="cuda", dtype=torch.float32)
    us = median_us(lambda: torch.sum(x, dim=1, dtype=torch.float32, out=out), 1, repeats=20)
    return x.numel() * 2 / (us * 1e-6) / 1e9


class Case:
    """One case's pages (``copies`` rotated cache copies) and its FP32 reference. ``fp8``: None,
    or "unit" / "amax" (the caches quantized to float8_e4m3fn, module docstring): then
    ``scales`` holds the per-tensor device scales (k [1], v [1]), ``scale_floats`` the same as
    host floats, ``ref`` the FP32 answer over the dequantized caches and ``exact`` / ``fp8_bound``
    FP32 attention over the fp16 source and its FP8 error bound."""

    def __init__(self, name, lens, hq, hkv, dtype=torch.float16, page=16, d=128, fp8=None):
        self.name, self.lens, self.fp8 = name, lens, fp8
        kv_bytes = 2 * sum(lens) * hkv * d * (1 if fp8 else 2)
        self.kv_bytes = kv_bytes
        self.copies = max(1, math.ceil(L2_ROTATE_BYTES / kv_bytes))
        b0 = make_batch(lens, num_qo_heads=hq, num_kv_heads=hkv, head_dim=d, page_size=page,
                        dtype=dtype, seed=SEED, hole_fraction=0.5)
        self.scales, self.scale_floats = (None, None), (1.0, 1.0)
        if fp8:
            src = b0
            from pkvrt.measure.harness import quantize_fp8   # "unit" (a cast) or "amax" / 448, per tensor
            kq, ks = quantize_fp8(src.k_cache, fp8)
            vq, vs = quantize_fp8(src.v_cache, fp8)
            self.scales, self.scale_floats = (ks, vs), (float(ks), float(vs))
            self.exact = reference.decode_attention(src.q, src.k_cache, src.v_cache, src.seq_lens,
                                                    src.block_tables, dtype=torch.float64)
            self.fp8_bound = reference.fp8_error_bound(src.q, src.k_cache, src.v_cache, src.seq_lens,
                                                       src.block_tables, k_scale=ks, v_scale=vs)
            b0 = attrs.evolve(src, k_cache=kq, v_cache=vq)
            del src
        # Copies share q, seq_lens and block tables (same pages, same values, other addresses).
        self.batches = [b0] + [attrs.evolve(b0, k_cache=b0.k_cache.clone(), v_cache=b0.v_cache.clone())
                               for _ in range(self.copies - 1)]
        self.b0 = b0
        self.ref = reference.decode_attention(b0.q, b0.k_cache, b0.v_cache, b0.seq_lens, b0.block_tables,
                                              k_scale=self.scales[0], v_scale=self.scales[1])

    def single(self, i: int) -> "Case":
        """This case reduced to its i-th cache copy (``batches`` of one): the input of an engine
        that makes a single call (``--per-call``); everything else is shared, not copied."""
        one = copy.copy(self)
        one.batches = [self.batches[i]]
        return one

    @property
    def kv_scales(self) -> dict:
        """pkvrt's launch arguments for the scales (none for fp16 caches)."""
        return dict(k_scale=self.scales[0], v_scale=self.scales[1]) if self.fp8 else {}


def engine_flashinfer(case: Case, label: str):
    """FlashInfer's decode wrapper ``label`` (a key of ``fi_engines.WRAPPERS``), planned once
    from CSR; RuntimeError when this FlashInfer's wrapper does not run that backend."""
    import flashinfer

    b0 = case.b0
    page = b0.k_cache.shape[2]
    pages = [math.ceil(n / page) for n in case.lens]
    indptr = torch.tensor([0] + list(torch.tensor(pages).cumsum(0).tolist()), dtype=torch.int32)
    indices = torch.cat([b0.block_tables[i, :p] for i, p in enumerate(pages)]).int()
    last = torch.tensor([n - (p - 1) * page for n, p in zip(case.lens, pages)], dtype=torch.int32)
    ws = torch.zeros(fi_engines.WORKSPACE_BYTES, dtype=torch.uint8, device="cuda")
    w = fi_engines.make_wrapper(flashinfer, label, ws)
    w.plan(indptr, indices, last, b0.q.shape[1], b0.k_cache.shape[1], b0.q.shape[2], page,
           q_data_type=b0.q.dtype, kv_data_type=b0.k_cache.dtype)
    outs = [torch.empty_like(b0.q) for _ in case.batches]
    # FP8: the per-tensor scales as the host floats the wrappers take (k_scale joins sm_scale;
    # a v_scale other than 1 is a separate multiply of out)
    scales = dict(zip(("k_scale", "v_scale"), case.scale_floats)) if case.fp8 else {}

    def fn():
        for b, o in zip(case.batches, outs):
            w.run(b0.q, (b.k_cache, b.v_cache), out=o, **scales)
    return fn, outs[0]


def engine_xqa(case: Case):
    """FlashInfer's XQA decode over the case's pages: the block table cut to the columns the
    longest row uses (padding -> page 0), int32 lengths, both on the device."""
    import flashinfer

    entry = fi_engines.xqa_entry(flashinfer)
    b0 = case.b0
    table, seq = to_padded(case.lens, b0.block_tables.cpu().numpy(), b0.k_cache.shape[2])
    table, seq = torch.as_tensor(table, device="cuda"), torch.as_tensor(seq, device="cuda")
    ws = torch.zeros(fi_engines.WORKSPACE_BYTES, dtype=torch.uint8, device="cuda")
    outs = [torch.empty_like(b0.q) for _ in case.batches]

    ks, vs = case.scale_floats

    def fn():
        for b, o in zip(case.batches, outs):
            fi_engines.run_xqa(entry, b0.q, b.k_cache, b.v_cache, ws, table, seq, max(case.lens), o,
                               k_scale=ks, v_scale=vs)
    return fn, outs[0]


def engine_fi_path(case: Case, label: str):
    """The (fn, out) of FlashInfer path ``label`` (one of ``fi_engines.FI_VARIANTS``)."""
    return engine_xqa(case) if label == fi_engines.XQA else engine_flashinfer(case, label)


def engine_split(case: Case, splits: int, merge: bool = True):
    """merge=False: the decode kernel alone (exploration: what the merge launch costs)."""
    b0 = case.b0
    rows = len(case.lens)
    row_ids = torch.arange(rows, dtype=torch.int32, device="cuda")
    part_a = torch.empty((rows * splits, *b0.q.shape[1:]), device="cuda")
    part_ml = torch.empty((rows * splits, b0.q.shape[1], 2), device="cuda")
    offsets = torch.arange(rows + 1, dtype=torch.int32, device="cuda") * splits
    outs = [torch.full_like(b0.q, float("nan")) for _ in case.batches]

    def fn():
        for b, o in zip(case.batches, outs):
            ops.split_decode(b0.q, b.k_cache, b.v_cache, b0.seq_lens, b0.block_tables, row_ids,
                             splits, o, part_a, part_ml, **case.kv_scales)
            if splits > 1 and merge:
                ops.merge(part_a, part_ml, offsets, o, row_ids=row_ids)
    return fn, outs[0]


def engine_workqueue(case: Case, splits: int | None, fused: bool, plan=None):
    """splits: every row gets min(splits, tiles) splits; or ``plan``: a planner WorkqueuePlan."""
    b0 = case.b0
    hkv = b0.k_cache.shape[1]
    if plan is not None:
        tasks, offsets = plan.tasks.tolist(), plan.split_offsets.tolist()
    else:
        tasks, offsets = simple_tasks(case.lens, hkv, splits)
    t = torch.tensor(tasks, dtype=torch.int32, device="cuda")
    num = torch.tensor([len(tasks)], dtype=torch.int32, device="cuda")
    off = torch.tensor(offsets, dtype=torch.int32, device="cuda")
    part_a = torch.empty((offsets[-1], *b0.q.shape[1:]), device="cuda")
    part_ml = torch.empty((offsets[-1], b0.q.shape[1], 2), device="cuda")
    counters = torch.zeros(len(case.lens), hkv, dtype=torch.int32, device="cuda") if fused else None
    outs = [torch.full_like(b0.q, float("nan")) for _ in case.batches]

    def fn():
        for b, o in zip(case.batches, outs):
            ops.workqueue_decode(b0.q, b.k_cache, b.v_cache, b0.seq_lens, b0.block_tables, t, num,
                                 off, o, part_a, part_ml, counters=counters, **case.kv_scales)
            if not fused:
                ops.merge(part_a, part_ml, off, o, skip_single=True)
    return fn, outs[0]


def per_call_us(calls, graphs: bool, repeats: int = 30) -> float:
    """Median per call when each call is launched on its own, as an engine calling attention once
    per layer does: ``graphs`` -> one CUDA graph per call, replayed one after another (the
    Runtime's run()); else the calls' eager launches. A spin kernel queued first covers the host's
    enqueue time, so the events see device time and the gaps between launches, not host gaps."""
    import statistics

    for c in calls:
        c()
    torch.cuda.synchronize()
    runs = calls
    if graphs:
        runs = []
        for c in calls:
            g = torch.cuda.CUDAGraph()
            with collector_paused(), torch.cuda.graph(g):   # pkvrt.runtime.graphs.capture's reason
                c()
            runs.append(g.replay)
    times = []
    for _ in range(repeats + 3):
        torch.cuda._sleep(2_000_000)  # ~1 ms of spinning while the host enqueues
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        a.record()
        for r in runs:
            r()
        b.record()
        b.synchronize()
        times.append(a.elapsed_time(b) * 1e3 / len(runs))
    return statistics.median(times[3:])


def per_call_rows(case: Case, bplan, registry, args) -> list[dict]:
    """Rows of the --per-call mode: pkvrt's bucket choice with one graph per call and eagerly,
    FlashInfer tensor-core eagerly (FlashInfer's run() as the serving baseline calls it)."""
    rows = []
    if len(bplan.buckets) != 1:
        return rows
    s = bplan.buckets[0].num_splits
    singles = [case.single(i) for i in range(case.copies)]   # one engine per cache copy
    engines = [("per-call-pkvrt-bucket-graph", s, [engine_split(c, s)[0] for c in singles], True),
               ("per-call-pkvrt-bucket-eager", s, [engine_split(c, s)[0] for c in singles], False)]
    try:
        engines.append(("per-call-flashinfer-tc-eager", None,
                        [engine_flashinfer(c, "flashinfer-tc")[0] for c in singles], False))
    except Exception as exc:  # noqa: BLE001 - FlashInfer missing: pkvrt rows only
        print(f"{case.name}: flashinfer unavailable for --per-call: {exc!r}", flush=True)
    for eng, s_, calls, graphs in engines:
        us = per_call_us(calls, graphs)
        rows.append(dict(case=case.name, engine=eng, splits=s_, median_us=round(us, 2),
                         gbps=round(case.kv_bytes / (us * 1e-6) / 1e9, 1), kv_mb=round(case.kv_bytes / 1e6, 1),
                         copies=case.copies, protocol="per call"))
    return rows


def without_pdl(fn, out):
    """The engine ``fn`` with programmatic dependent launch off for its launches (A/B)."""
    def run():
        _driver.set_pdl(False)
        try:
            fn()
        finally:
            _driver.set_pdl(None)
    return run, out


def engine_sdpa(case: Case):
    """Repack the pages into contiguous K/V, then PyTorch SDPA (GQA), per row."""
    b0 = case.b0
    outs = [torch.empty_like(b0.q) for _ in case.batches]

    def fn():
        for b, o in zip(case.batches, outs):
            for i, n in enumerate(case.lens):
                k = reference.gather_kv(b.k_cache, b0.block_tables[i], n)[None]
                v = reference.gather_kv(b.v_cache, b0.block_tables[i], n)[None]
                o[i] = torch.nn.functional.scaled_dot_product_attention(
                    b0.q[i][None, :, None], k, v, enable_gqa=True)[0, :, 0]
    return fn, outs[0]


def errors(out, ref):
    e = (out.float() - ref.float()).abs()
    return e.max().item(), e.mean().item()


def fi_candidates(rows: list[dict]) -> tuple[str | None, dict[str, str]]:
    """The baseline of one case's ``rows`` and every FlashInfer path's status, in
    ``fi_engines.FI_VARIANTS`` order: "ok" (timed, within the FP32 tolerance of
    ``harness.within_tolerance``, or for an FP8 case within ``fp8_error_bound`` of the
    unquantized answer: the row's ``within_fp8_bound``), "wrong output: ..." (timed, outside
    it), or "unavailable: ..." (not built: the row's ``unavailable``; failed to run: its
    ``error``; no row at all). The baseline is the fastest "ok" path, None when there is none."""
    status, timed = {}, {}
    for r in rows:
        label = r["engine"]
        if label not in fi_engines.FI_VARIANTS:
            continue
        if "median_us" not in r:
            status[label] = r.get("unavailable") or f"unavailable: {r.get('error', 'not timed')}"
        elif not (within_tolerance(r["max_err_ref"], r["mean_err_ref"]) or r.get("within_fp8_bound")):
            status[label] = (f"wrong output: vs FP32 max|e| {r['max_err_ref']:.3g}, "
                             f"mean|e| {r['mean_err_ref']:.3g}")
        else:
            status[label], timed[label] = "ok", r["median_us"]
    ordered = {label: status.get(label, "unavailable: not run") for label in fi_engines.FI_VARIANTS}
    return (min(timed, key=timed.get) if timed else None), ordered


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", default=None, help="default benches/results/h200/isolated.json "
                    "(isolated-fp8.json with --kv-dtype fp8)")
    ap.add_argument("--cases", default=None, help=f"of {', '.join(CASES)} (default: {', '.join(DEFAULT_CASES)}; "
                    f"with --kv-dtype fp8: {', '.join(FP8_CASES)})")
    ap.add_argument("--splits", default="", help="bucket split counts to sweep as well (exploration)")
    ap.add_argument("--wq-splits", default="", help="workqueue split counts to sweep as well")
    ap.add_argument("--partition-sweep", action="store_true",
                    help="also time the balanced partition cut at every candidate (the longest row's "
                         "allowed split counts): how far the rule's pick is from the best cut")
    ap.add_argument("--nomerge-splits", default="",
                    help="bucket split counts to time without the merge kernel (exploration; outputs not exact)")
    ap.add_argument("--routes", default=None, help="routes.toml (split bounds); default: the repo's")
    ap.add_argument("--no-sdpa", action="store_true")
    ap.add_argument("--per-call", action="store_true",
                    help="also time each call launched on its own (a graph per call for pkvrt, eager "
                         "FlashInfer): the per-layer pattern of the engine protocol")
    ap.add_argument("--ab-pdl", action="store_true",
                    help="also time the planner's bucket/workqueue choice with programmatic dependent launch off")
    ap.add_argument("--kv-dtype", choices=["fp16", "fp8"], default="fp16",
                    help="fp8: float8_e4m3fn K/V with fp16 q/out; default cases "
                         f"{','.join(FP8_CASES)}, default out benches/results/h200/isolated-fp8.json")
    ap.add_argument("--fp8-scales", choices=["unit", "amax"], default="unit",
                    help="fp8: per-tensor scales 1 (a cast; FlashInfer's fastest case) or amax / 448")
    args = ap.parse_args(argv)
    fp8 = args.fp8_scales if args.kv_dtype == "fp8" else None
    if args.out is None:
        args.out = f"benches/results/h200/isolated{'-fp8' if fp8 else ''}.json"
    if args.cases is None:
        args.cases = ",".join(FP8_CASES if fp8 else DEFAULT_CASES)
    if fp8:
        args.no_sdpa = True   # the repack engine is an fp16 orientation row
    if not torch.cuda.is_available():
        print("isolated.py: needs a CUDA GPU (torch.cuda.is_available() is False); nothing was run",
              file=sys.stderr)
        return 2
    torch.manual_seed(SEED)
    registry = load_routes(args.routes)
    cal = find_calibration(torch.cuda.get_device_name())

    def shape(hq, hkv):
        return dict(num_qo_heads=hq, num_kv_heads=hkv, head_dim=128, dtype_bytes=1 if fp8 else 2)
    beta = read_bandwidth_gbps()
    print(f"streaming read: {beta:.0f} GB/s", flush=True)
    rows, candidates = [], {}
    for name in args.cases.split(","):
        lens, hq, hkv = CASES[name]
        case = Case(name, lens, hq, hkv, fp8=fp8)
        engines = []
        for label in fi_engines.FI_VARIANTS:
            try:
                engines.append((label, None, *engine_fi_path(case, label)))
            except Exception as exc:  # noqa: BLE001 - recorded in the results, not hidden
                rows.append(dict(case=name, engine=label, splits=None,
                                 unavailable=f"unavailable: {type(exc).__name__}: {exc}"))
        # The planner's automatic split choice (calibration of this GPU at this G), as the runtime runs it.
        # (the nearest calibrated group size's constants where the file has none of this one's,
        # as the Runtime and the Router take them)
        kcal = cal.for_kv_dtype("float8_e4m3fn" if fp8 else "float16")
        gcal = kcal.for_group(kcal.calibrated_group(hq // hkv))
        bplan = planner.plan_bucket(lens, splits=registry.route("pkv_bucket").splits, cal=gcal, **shape(hq, hkv))
        wplan = planner.plan_workqueue(lens, splits=registry.route("pkv_workqueue").splits, cal=gcal, **shape(hq, hkv))
        if len(bplan.buckets) == 1:
            s = bplan.buckets[0].num_splits
            engines.append(("pkvrt-bucket", s, *engine_split(case, s)))
        s = int(wplan.num_splits.max())
        engines.append(("pkvrt-workqueue", s, *engine_workqueue(case, None, False, wplan)))
        fplan = planner.plan_workqueue(lens, splits=registry.route("pkv_fused").splits, cal=gcal,
                                       kind="fused", **shape(hq, hkv))   # the fused route's own cut
        engines.append(("pkvrt-fused", int(fplan.num_splits.max()), *engine_workqueue(case, None, True, fplan)))
        if args.ab_pdl:
            if len(bplan.buckets) == 1:
                s = bplan.buckets[0].num_splits
                engines.append(("pkvrt-bucket-nopdl", s, *without_pdl(*engine_split(case, s))))
            s = int(wplan.num_splits.max())
            engines.append(("pkvrt-workqueue-nopdl", s, *without_pdl(*engine_workqueue(case, None, False, wplan))))
        # Sweeps (exploration; not the runtime's choice).
        for s in map(int, filter(None, args.splits.split(","))):
            engines.append(("sweep-bucket", s, *engine_split(case, s)))
        for s in map(int, filter(None, args.nomerge_splits.split(","))):
            engines.append(("sweep-bucket-nomerge", s, *engine_split(case, s, merge=False)))
        for s in map(int, filter(None, args.wq_splits.split(","))):
            engines.append(("sweep-workqueue", s, *engine_workqueue(case, s, False)))
        if args.partition_sweep:
            wq = registry.route("pkv_workqueue").splits
            for s in planner.partition_candidates(-(-max(lens) // 32), wq, 1).tolist():
                cut = planner.plan_workqueue(lens, splits=wq, cal=gcal, longest_splits=s, **shape(hq, hkv))
                engines.append(("sweep-partition", s, *engine_workqueue(case, None, False, cut)))
        if not args.no_sdpa:
            engines.append(("repack-sdpa", None, *engine_sdpa(case)))
        fi_out = None
        for eng, s, fn, out in engines:
            try:
                fn()
                torch.cuda.synchronize()
            except Exception as exc:  # noqa: BLE001 - a failing engine is reported, not hidden
                print(f"{name} {eng}@{s}: FAILED {exc!r}", flush=True)
                rows.append(dict(case=name, engine=eng, splits=s, error=repr(exc)))
                continue
            max_e, mean_e = errors(out, case.ref)
            if eng in fi_engines.FI_VARIANTS and fi_out is None and within_tolerance(max_e, mean_e):
                fi_out = out.clone()
            us = median_us(fn, case.copies)
            row = dict(case=name, engine=eng, splits=s, median_us=round(us, 2),
                       gbps=round(case.kv_bytes / (us * 1e-6) / 1e9, 1),
                       frac_read_bw=round(case.kv_bytes / (us * 1e-6) / 1e9 / beta, 3),
                       kv_mb=round(case.kv_bytes / 1e6, 1), copies=case.copies,
                       max_err_ref=max_e, mean_err_ref=mean_e)
            if fp8:   # end to end: vs FP32 attention over the fp16 values, within the FP8 bound
                err = (out.double() - case.exact).norm().item()
                row.update(kv_dtype="float8_e4m3fn", fp8_scales=fp8, err_norm_unquantized=err,
                           fp8_bound=case.fp8_bound, within_fp8_bound=bool(err <= case.fp8_bound))
            if fi_out is not None:
                row["max_err_fi"], row["mean_err_fi"] = errors(out, fi_out)
            rows.append(row)
        if args.per_call:
            rows += per_call_rows(case, bplan, registry, args)
        base, status = fi_candidates([r for r in rows if r["case"] == name])
        candidates[name] = status
        for label, text in status.items():
            if text != "ok":
                print(f"{name}: {label} {text}", flush=True)
        fi_best = next((r["median_us"] for r in rows if r["case"] == name and r["engine"] == base), None)
        for r in rows:
            if r["case"] == name:
                r["baseline_engine"] = base
                if fi_best and "median_us" in r:
                    r["ratio_vs_fi"] = round(fi_best / r["median_us"], 3)
        best = {}
        for r in rows:
            if r["case"] == name and "median_us" in r and (r["engine"] not in best or r["median_us"] < best[r["engine"]]["median_us"]):
                best[r["engine"]] = r
        print(f"{name:12s} baseline {base}  " + "  ".join(f"{e}{'' if r['splits'] is None else '@' + str(r['splits'])}="
                                        f"{r['median_us']:.1f}us" for e, r in best.items()), flush=True)
        del case, engines
        torch.cuda.empty_cache()
    meta = results.make_meta(seeds=[SEED], routes_path=registry.path, calibration_path=cal.source,
                             read_bandwidth_gbps=round(beta, 1), baseline_candidates=candidates,
                             kv_dtype="float8_e4m3fn" if fp8 else "float16", fp8_scales=fp8,
                             protocol="isolated graph-replay, CUDA-event median per call, 50% holes, "
                                      "L2 rotation; baseline = fastest FlashInfer decode path (CUDA-core, "
                                      "tensor-core, cuDNN, XQA) matching the FP32 reference")
    results.write_results(args.out, meta, rows)
    return 0


if __name__ == "__main__":
    sys.exit(main())
