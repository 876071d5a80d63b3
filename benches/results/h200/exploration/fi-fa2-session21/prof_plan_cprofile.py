"""Conversation-trace steps (B8, FlashInfer by the policy) through the default Runtime: plan()
medians without a profiler, then cProfile over the plan() calls only (runs unprofiled)."""
import cProfile, itertools, pstats, statistics, time
import numpy as np, torch
from pkvrt.runtime import Runtime
from pkvrt.measure.traces import resolve_trace, decode_steps
from pkvrt.measure.pagetable import build_layout
tr = resolve_trace(".carry/traces/azure2023_conv.csv", seed=1)
lay = build_layout(tr, page_size=16, seed=1)
steps = list(itertools.islice(decode_steps(tr, max_active=8), 0, 30000, 100))
inputs = [(s.seq_lens.astype(np.int32), lay.block_table(s.rids)) for s in steps]
k = torch.randn(lay.num_physical_pages, 8, 16, 128, dtype=torch.float16, device="cuda"); v = torch.randn_like(k)
q = torch.randn(8, 32, 128, dtype=torch.float16, device="cuda"); out = torch.empty_like(q)
rt = Runtime(32, 8, 128, 16, torch.float16, max_batch=8, max_pages_per_row=lay.max_pages, validate=False)
def step(seq, bt, prof=None):
    torch.cuda.synchronize()
    t = time.perf_counter()
    if prof: prof.enable()
    rt.plan(seq, bt)
    if prof: prof.disable()
    dt = time.perf_counter() - t
    b = len(seq)
    for _ in range(32): rt.run(q[:b], k, v, out=out[:b])
    return dt
for seq, bt in inputs: step(seq, bt)
ts = [step(seq, bt) for seq, bt in inputs * 2]
print(f"{len(inputs)} steps, plan() median {1e6 * statistics.median(ts):.1f} us, routes", rt.stats().get("routes", ""))
pr = cProfile.Profile()
for seq, bt in inputs * 2: step(seq, bt, pr)
pstats.Stats(pr).sort_stats("tottime").print_stats(30)
