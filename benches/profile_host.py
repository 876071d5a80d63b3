"""Where the host time of a Runtime step goes (GPU): per-call medians of each piece, then a
cProfile of plan()+run()+synchronize over many steps. Prints a short table.

usage: python benches/profile_host.py [B] [context] [route|adaptive]
"""
import cProfile
import pstats
import statistics
import sys
import time
from pathlib import Path

import numpy as np
import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests"))
from paged import make_batch  # noqa: E402

from pkvrt.runtime import Runtime  # noqa: E402


def per_call_us(fn, n=200):
    ts = []
    for _ in range(n):
        t = time.perf_counter()
        fn()
        ts.append(time.perf_counter() - t)
    return 1e6 * statistics.median(ts)


def main():
    b = int(sys.argv[1]) if len(sys.argv) > 1 else 1
    ctx = int(sys.argv[2]) if len(sys.argv) > 2 else 32768
    force = sys.argv[3] if len(sys.argv) > 3 and sys.argv[3] != "adaptive" else None
    batch = make_batch([ctx] * b, hole_fraction=0.0, seed=1)
    seq = batch.seq_lens.cpu().numpy()
    bt = batch.block_tables.cpu().numpy()
    rt = Runtime(32, 8, 128, 16, torch.float16, max_batch=64, max_pages_per_row=bt.shape[1])
    out = torch.empty_like(batch.q)
    for _ in range(5):
        rt.plan(seq, bt, force=force)
        rt.run(batch.q, batch.k_cache, batch.v_cache, out=out)
    torch.cuda.synchronize()
    rows = {
        "router.decide": per_call_us(lambda: rt.router.decide(seq, force=force, block_tables=bt)),
        "rt.plan": per_call_us(lambda: rt.plan(seq, bt, force=force)),
        "rt.run (graph hit)": per_call_us(lambda: rt.run(batch.q, batch.k_cache, batch.v_cache, out=out)),
        "torch.cuda.synchronize (idle)": per_call_us(torch.cuda.synchronize),
    }
    torch.cuda.synchronize()

    def step():
        rt.plan(seq, bt, force=force)
        rt.run(batch.q, batch.k_cache, batch.v_cache, out=out)
        torch.cuda.synchronize()
    rows["plan+run+sync"] = per_call_us(step)
    print(f"B={b} ctx={ctx} route={rt.last_decision.route}")
    for k, v in rows.items():
        print(f"  {k:32s} {v:9.1f} us")
    pr = cProfile.Profile()
    pr.enable()
    for _ in range(200):
        step()
    pr.disable()
    pstats.Stats(pr).sort_stats("tottime").print_stats(18)


if __name__ == "__main__":
    main()
