import sys, time, statistics
sys.path[:0] = [sys.argv[1], sys.argv[1] + "/tests"]
import numpy as np, torch
import test_runtime_cpu as trc
trc.install_fake_device(setattr, lambda name: (lambda *a, **k: None), replay_runs_launches=False)
from pkvrt.policy.calibration import load_calibration
from pkvrt.policy.registry import load_routes
from pkvrt.runtime import Runtime
cal = load_calibration(sys.argv[1] + "/calibration/nvidia-h200.json")
width = -(-(40000 + 10000) // 16)
for lens in ([32768], [32768, 2048, 3072, 4096, 32000, 1024, 2560, 3584], [32768+5, 2048+17, 3072+60, 4096+33, 32000+41, 1024+9, 2560+50, 3584+25]):
    b = len(lens)
    rt = Runtime(32, 8, 128, 16, torch.float16, routes=load_routes(sys.argv[1] + "/routes.toml"),
                 calibration=cal, max_batch=8, max_pages_per_row=width, flashinfer=False)
    seq = np.array(lens, dtype=np.int32)
    bt = np.arange(b * width, dtype=np.int32).reshape(b, width)
    for _ in range(5): rt.plan(seq, bt)
    ts = []; routes = {}
    h0 = rt.router.memo_hits
    for _ in range(3000):
        seq += 1
        t0 = time.perf_counter(); d = rt.plan(seq, bt); ts.append(time.perf_counter() - t0)
        routes[d.route] = routes.get(d.route, 0) + 1
    ts = [1e6 * t for t in ts]
    print(f"B{b}: mean {statistics.mean(ts):.1f} median {statistics.median(ts):.1f} p90 {sorted(ts)[2700]:.1f} max {max(ts):.0f} us; hits {rt.router.memo_hits - h0}/3000 {routes}")
