"""Per-piece host cost of run() on an eager FlashInfer step (B8 bimodal), then cProfile."""
import cProfile, pstats, statistics, sys, time
sys.path.insert(0, "tests")
import numpy as np, torch
from paged import make_batch
from pkvrt.runtime import Runtime
from pkvrt.runtime.checks import run_signature
lens = [32768, 2048, 3072, 4096, 32000, 1024, 2560, 3584]
b = make_batch(lens, hole_fraction=0.5, seed=1)
seq, bt = b.seq_lens.cpu().numpy(), b.block_tables.cpu().numpy()
rt = Runtime(32, 8, 128, 16, torch.float16, max_batch=8, max_pages_per_row=bt.shape[1], validate=False)
q, k, v = b.q, b.k_cache, b.v_cache
out = torch.empty_like(q)
def med(fn, n=400):
    ts = []
    for _ in range(n):
        t = time.perf_counter(); fn(); ts.append(time.perf_counter() - t)
    torch.cuda.synchronize()
    return 1e6 * statistics.median(ts)
for _ in range(5):
    rt.plan(seq, bt, force="flashinfer")
    for _ in range(4): rt.run(q, k, v, out=out)
torch.cuda.synchronize()
fi = rt._fi
rows = {"rt.run (direct)": med(lambda: rt.run(q, k, v, out=out)),
        "run_signature": med(lambda: run_signature(q, k, v, out, None, None, 8)),
        "DirectCall": med(lambda: fi._direct(q, k, v, out)),
        "wrapper.run": med(lambda: fi._current.run(q, (k, v), out=out)),
        "is_capturing": med(lambda: torch.cuda.is_current_stream_capturing()),
        "empty launch (torch add_)": med(lambda: out.add_(0))}
d = fi._direct
a = d.args.copy(); iq, ik, iv, io = d.slots; a[iq], a[ik], a[iv], a[io] = q, k, v, out
rows["fn(*args) only"] = med(lambda: d.fn(*a))
print("args:", len(a), "tensors:", sum(isinstance(x, torch.Tensor) for x in a),
      [type(x).__name__ for x in a])
for kk, vv in rows.items():
    print(f"  {kk:28s} {vv:7.1f} us")
pr = cProfile.Profile(); pr.enable()
for _ in range(100):
    rt.plan(seq, bt, force="flashinfer")
    for _ in range(32): rt.run(q, k, v, out=out)
    torch.cuda.synchronize()
pr.disable(); pstats.Stats(pr).sort_stats("tottime").print_stats(18)
