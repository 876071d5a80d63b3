"""Throwaway (session 15): Python cost of ops.plan_workqueue_device with the driver launch stubbed, CPU
tensors, B8 shapes; printed 22.0 and 34.1 us in two dev-box runs (a noisy 2-core machine). usage: python benches/results/h200/exploration/engine-capture/scripts/ops_plan_cost_cpu.py"""
import time, torch
from pkvrt.launch import ops, _driver
_driver.launch = lambda *a, **k: None
_driver.get_kernel = lambda *a, **k: object()
ops._driver.launch = _driver.launch; ops._driver.get_kernel = _driver.get_kernel
i32 = dict(dtype=torch.int32)
arena = torch.zeros(100000, **i32)
seq = torch.ones(8, **i32); rows = torch.ones(1, **i32); nt = torch.zeros(1, **i32)
st = torch.zeros(1, **i32); cand = torch.arange(1, 33, **i32); ms = torch.ones(1, **i32)
bt = torch.zeros(8, 2048, **i32); npg = torch.ones(1, **i32); ns = torch.zeros(8, **i32)
def once():
    ops.plan_workqueue_device(seq[:8], rows, arena[0:5*792].view(792, 5), nt, arena[5000:5009], ns[:8], st, cand,
        num_kv_heads=8, min_split_tiles=1, max_seq_len=ms, block_tables=bt[:8], num_pages=npg, page_size=16,
        sms=132, resident=264, slowdown8=11, overhead8=52, max_ctas=792, free_slots=0)
for _ in range(200): once()
n=5000; t0=time.perf_counter()
for _ in range(n): once()
print("ops.plan_workqueue_device incl. views, launch stubbed: %.1f us" % ((time.perf_counter()-t0)/n*1e6))
