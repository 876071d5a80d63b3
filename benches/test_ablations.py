"""pytest-benchmark ablations (GPU; skipped without CUDA): `pytest benches --benchmark-only`.

- fused decode+merge vs the two-kernel workqueue (decode launch + merge launch), and
- CUDA-graph replay vs eager launches through pkvrt.Runtime (and device-side planning),
on the seed's shape (H_q=32, H_kv=8, D=128, fp16, page 16). Each round is one call followed by
a device synchronize, so the numbers are synchronized wall time per call (host + device), the
serving-facing quantity; isolated.py gives the device-only (CUDA-event) view.
"""

import sys
from pathlib import Path

import pytest
import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests"))
from paged import make_batch  # noqa: E402

pytestmark = pytest.mark.gpu

CASES = {
    "B1-32K": [32768],
    "B8-bimodal": [32768, 2048, 3072, 4096, 32000, 1024, 2560, 3584],
}


def _sync(fn):
    def call():
        fn()
        torch.cuda.synchronize()
    return call


@pytest.mark.parametrize("case", list(CASES))
@pytest.mark.parametrize("variant", ["two-kernel", "fused"])
def test_fused_merge_ablation(benchmark, case, variant):
    from pkvrt.launch import ops
    from pkvrt.policy import planner
    from pkvrt.policy.calibration import find_calibration
    from pkvrt.policy.registry import load_routes

    b = make_batch(CASES[case], hole_fraction=0.0, seed=20260623)
    cal = find_calibration(torch.cuda.get_device_name())
    plan = planner.plan_workqueue(CASES[case], num_kv_heads=8, num_qo_heads=32, head_dim=128,
                                  dtype_bytes=2, splits=load_routes().route("pkv_workqueue").splits,
                                  cal=cal)
    dev = dict(device="cuda", dtype=torch.int32)
    tasks, num, off, part_a, part_ml = ops.workqueue_tensors(plan, num_qo_heads=32, head_dim=128)
    out = torch.empty_like(b.q)
    counters = torch.zeros(len(CASES[case]), 8, **dev)

    def run():
        if variant == "fused":
            ops.workqueue_decode(b.q, b.k_cache, b.v_cache, b.seq_lens, b.block_tables, tasks, num,
                                 off, out, part_a, part_ml, counters=counters)
        else:
            ops.workqueue_decode(b.q, b.k_cache, b.v_cache, b.seq_lens, b.block_tables, tasks, num,
                                 off, out, part_a, part_ml)
            ops.merge(part_a, part_ml, off, out, skip_single=True)

    benchmark.extra_info.update(case=case, variant=variant, splits=int(plan.num_splits.max()))
    benchmark.pedantic(_sync(run), warmup_rounds=5, rounds=200, iterations=1)


@pytest.mark.parametrize("case", list(CASES))
@pytest.mark.parametrize("mode", ["graph-replay", "eager", "device-plan"])
def test_graph_replay_ablation(benchmark, case, mode):
    """plan() + run() per step: host planning with graph replay, host planning with eager
    launches, and device-side planning (lengths on the GPU) with graph replay."""
    from pkvrt.runtime import Runtime
    from pkvrt.runtime.options import RuntimeOptions

    lens = CASES[case]
    b = make_batch(lens, hole_fraction=0.0, seed=20260623)
    rt = Runtime(32, 8, 128, 16, torch.float16, max_batch=16, device_planning=mode == "device-plan",
                 options=RuntimeOptions(use_cuda_graph=mode != "eager"))
    if mode == "device-plan":
        seq, bt = b.seq_lens.int(), b.block_tables.int()
    else:
        seq, bt = b.seq_lens.cpu().numpy(), b.block_tables.cpu().numpy()
    out = torch.empty_like(b.q)
    decision = rt.plan(seq, bt)

    def step():
        rt.plan(seq, bt)
        rt.run(b.q, b.k_cache, b.v_cache, out=out)

    benchmark.extra_info.update(case=case, mode=mode, route=decision.route)
    benchmark.pedantic(_sync(step), warmup_rounds=5, rounds=200, iterations=1)
