"""The conversation trace's steps (B8, 32 layers, FlashInfer by the policy) through pkvrt's
default Runtime and through FlashInfer called as the serving harness calls it, alternating per
step; per-call host timers on the pieces of each plan(). Prints medians (us)."""
import collections, itertools, statistics, sys, time
import numpy as np, torch
from pkvrt.runtime import Runtime, planning, fi_route, core
from pkvrt.policy import fallback
from pkvrt.policy.blocktables import to_csr
from pkvrt.measure.traces import resolve_trace, decode_steps
from pkvrt.measure.pagetable import build_layout
import flashinfer
acc = collections.defaultdict(list)
who = ["-"]
def wrap(owner, attr, key):
    inner = getattr(owner, attr)
    def f(*a, **k):
        t = time.perf_counter()
        try:
            return inner(*a, **k)
        finally:
            acc[f"{who[0]}: {key}"].append(time.perf_counter() - t)
    setattr(owner, attr, f)
wrap(planning, "check_step", "check_step")
wrap(fallback, "decide", "decide")
wrap(planning.Planning, "_gather_flashinfer", "_gather_flashinfer")
wrap(planning.Planning, "_plan_flashinfer", "_plan_flashinfer (copy + route plan)")
wrap(fi_route.FlashInferRoute, "plan", "FlashInferRoute.plan")
wrap(core.Runtime, "_record", "Runtime._record")
wrap(flashinfer.BatchDecodeWithPagedKVCacheWrapper, "plan", "wrapper.plan")
wrap(flashinfer.BatchDecodeWithPagedKVCacheWrapper, "run", "wrapper.run")
tr = resolve_trace(".carry/traces/azure2023_conv.csv", seed=1)
lay = build_layout(tr, page_size=16, seed=1)
steps = list(itertools.islice(decode_steps(tr, max_active=8), 0, 6000, 20))
inputs = [(s.seq_lens.astype(np.int32), lay.block_table(s.rids)) for s in steps]
pages = lay.num_physical_pages
k = torch.randn(pages, 8, 16, 128, dtype=torch.float16, device="cuda"); v = torch.randn_like(k)
q = torch.randn(8, 32, 128, dtype=torch.float16, device="cuda"); out = torch.empty_like(q)
rt = Runtime(32, 8, 128, 16, torch.float16, max_batch=8, max_pages_per_row=lay.max_pages, validate=False)
ws = torch.zeros(128 * 2**20, dtype=torch.uint8, device="cuda")
w = flashinfer.BatchDecodeWithPagedKVCacheWrapper(ws, "HND", use_tensor_cores=True)
pin = dict(dtype=torch.int32, pin_memory=True)
ip, ind, la = torch.zeros(9, **pin), torch.zeros(8 * lay.max_pages, **pin), torch.zeros(8, **pin)
npv = (ip.numpy(), ind.numpy(), la.numpy())
ev = [None]
def fi_plan(seq, bt):
    a, b, c = to_csr(seq, bt, 16); n, nnz = len(c), len(b)
    if ev[0] is not None: ev[0].synchronize()
    else: ev[0] = torch.cuda.Event()
    npv[0][:n + 1] = a; npv[1][:nnz] = b; npv[2][:n] = c
    w.plan(ip[:n + 1], ind[:nnz], la[:n], 32, 8, 128, 16, q_data_type=torch.float16, kv_data_type=torch.float16)
    ev[0].record()
def step(name, seq, bt):
    b = len(seq); qb, ob = q[:b], out[:b]
    who[0] = name
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    if name == "pkvrt":
        rt.plan(seq, bt)
        t1 = time.perf_counter()
        for _ in range(32): rt.run(qb, k, v, out=ob)
    else:
        fi_plan(seq, bt)
        t1 = time.perf_counter()
        for _ in range(32): w.run(qb, (k, v), out=ob)
    t2 = time.perf_counter()
    torch.cuda.synchronize()
    t3 = time.perf_counter()
    acc[f"{name}: plan()"].append(t1 - t0); acc[f"{name}: 32 runs"].append(t2 - t1)
    acc[f"{name}: step wall"].append(t3 - t0)
for i, (seq, bt) in enumerate(inputs[:20]):
    step("pkvrt", seq, bt); step("fi", seq, bt)
acc.clear()
for rnd in range(3):
    for i, (seq, bt) in enumerate(inputs):
        for name in (("pkvrt", "fi") if (i + rnd) % 2 else ("fi", "pkvrt")):
            step(name, seq, bt)
print("steps", len(inputs), "routes", collections.Counter(rt.router.decide(s).route for s, _ in inputs[:50]))
for key, vals in sorted(acc.items()):
    print(f"{key:48s} {len(vals):6d}  median {1e6 * statistics.median(vals):8.1f}  mean {1e6 * statistics.mean(vals):8.1f} us")
