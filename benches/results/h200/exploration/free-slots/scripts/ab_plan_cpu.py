"""A/B of Runtime.plan() host time on the fake device: trees given as args, interleaved in one process."""
import sys, time, statistics, importlib
import numpy as np
trees = sys.argv[1:]
rts = {}
B = [1, 8]
for tree in trees:
    for m in [m for m in sys.modules if m.split(".")[0] in ("pkvrt", "test_runtime_cpu", "paged", "conftest")]:
        del sys.modules[m]
    sys.path[:0] = [tree, tree + "/tests"]
    import torch
    trc = importlib.import_module("test_runtime_cpu")
    trc.install_fake_device(setattr, lambda name: (lambda *a, **k: None), replay_runs_launches=False)
    from pkvrt.policy.calibration import load_calibration
    from pkvrt.policy.registry import load_routes
    from pkvrt.runtime import Runtime
    cal = load_calibration(tree + "/calibration/nvidia-h200.json")
    width = -(-(40000 + 60000) // 16)
    for b in B:
        rt = Runtime(32, 8, 128, 16, torch.float16, routes=load_routes(tree + "/routes.toml"),
                     calibration=cal, max_batch=8, max_pages_per_row=width, flashinfer=False)
        seq = np.array([32768+5, 2048+17, 3072+60, 4096+33, 32000+41, 1024+9, 2560+50, 3584+25][:b], np.int32)
        bt = np.arange(b * width, dtype=np.int32).reshape(b, width)
        for _ in range(5): rt.plan(seq, bt)
        rts[(tree, b)] = (rt, seq, bt)
    del sys.path[:2]
res = {k: [] for k in rts}
for rep in range(40):
    for k, (rt, seq, bt) in rts.items():
        t0 = time.perf_counter()
        for _ in range(200):
            seq += 1; rt.plan(seq, bt)
        res[k].append(1e6 * (time.perf_counter() - t0) / 200)
for b in B:
    base = res[(trees[0], b)]
    for t in trees:
        v = res[(t, b)]
        ratio = statistics.median([x / y for x, y in zip(v, base)])
        print(f"B{b} {t:<12} median {statistics.median(v):6.1f} min {min(v):6.1f} us  ratio to first {ratio:.3f}")
