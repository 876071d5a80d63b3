"""cProfile of the adaptive Runtime.plan() on the GPU host: B8 phased rows growing a token a step."""
import cProfile, pstats, sys, time, statistics
import numpy as np, torch
sys.path.insert(0, "tests")
from paged import make_batch
from pkvrt.runtime import Runtime
lens = [32773, 2065, 3132, 4129, 32041, 1033, 2610, 3609] if sys.argv[1] == "8" else [32773]
steps = 1500
batch = make_batch([n + steps + 50 for n in lens], seed=1)
bt = batch.block_tables.cpu().numpy()
rt = Runtime(32, 8, 128, 16, torch.float16, max_batch=8, max_pages_per_row=bt.shape[1])
seq = np.array(lens, dtype=np.int32)
out = torch.empty_like(batch.q)
for _ in range(20):
    rt.plan(seq, bt); rt.run(batch.q, batch.k_cache, batch.v_cache, out=out)
torch.cuda.synchronize()
ts = []
for i in range(500):
    seq += 1
    t = time.perf_counter(); rt.plan(seq, bt); ts.append(1e6 * (time.perf_counter() - t))
    rt.run(batch.q, batch.k_cache, batch.v_cache, out=out); torch.cuda.synchronize()
print(f"B{len(lens)} route {rt.last_decision.route}: plan() median {statistics.median(ts):.1f} mean {statistics.mean(ts):.1f} us, memo hits {rt.router.memo_hits}")
pr = cProfile.Profile(); pr.enable()
for i in range(500):
    seq += 1; rt.plan(seq, bt)
    rt.run(batch.q, batch.k_cache, batch.v_cache, out=out); torch.cuda.synchronize()
pr.disable()
pstats.Stats(pr).sort_stats("tottime").print_stats(22)
