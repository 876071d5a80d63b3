"""Host time of two new plan() paths, on a machine without a GPU: the drop-in wrapper's plan() in
CUDA-graph mode, and finding a step's shared pages (the numbers in benches/NOTES.md).

- ``dropin``: ``pkvrt.BatchDecodeWithPagedKVCacheWrapper(use_cuda_graph=True).plan()`` on the
  tests' fake device (tests/test_runtime_cpu.py: CPU tensors, kernel launches no-ops), so only
  its Python and numpy run: the CSR to block tables, the checks, the Runtime's staging. Median of
  ``--calls`` calls on one step (H_q 8, H_kv 2, D 64, page 16).
- ``sharing``: on the sharing workloads' steps (rows x (shared + own) tokens, page 16, G 4), the
  repeat test (``sharing.any_page_repeats``), the plan for a new sharing structure
  (``sharing.plan_sharing`` after clearing its memo) and for the last steps' structure (a memo
  hit, lengths moved), each a median over ``--calls``; and the rule that decides whether the
  step shares (``SharedPagesRuntime`` predicting the shared and the plain step with the H200
  calibration, lengths moved a token a call).
- ``decode``: ``SharedPagesRuntime.plan()`` (host lengths, the H100 calibration, ``engine_capture``)
  on the sharing workloads' steps decoding on, every row a token longer each call (so rows
  cross page boundaries at different calls, as in serving): the median and mean over the calls
  after the first 20, and whether the step shares.

usage: python benches/host_sharing_cpu.py [--calls 50]
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

import numpy as np

REPO = Path(__file__).resolve().parents[1]
DROPIN_STEPS = ((8, 32768), (64, 2048), (1, 32768))          # (rows, tokens each)
SHARING_STEPS = ((8, 8192, 512), (8, 32768, 128), (32, 4096, 256), (64, 2048, 1024), (16, 1024, 1024))


def median_us(fn, calls: int) -> float:
    times = []
    for _ in range(calls):
        t0 = time.perf_counter()
        fn()
        times.append((time.perf_counter() - t0) * 1e6)
    return statistics.median(times)


def dropin(calls: int) -> None:
    import torch

    import test_runtime_cpu as fake   # main() installed its fake device

    from pkvrt.policy.blocktables import to_csr
    from pkvrt.runtime.wrapper import BatchDecodeWithPagedKVCacheWrapper

    print("drop-in plan(), CUDA-graph mode (fake device)")
    for b, n in DROPIN_STEPS:
        pages = -(-n // 16)
        bt = np.arange(b * pages, dtype=np.int32).reshape(b, pages)
        ip, ind, lpl = (torch.as_tensor(x) for x in to_csr(np.full(b, n, np.int32), bt, 16))
        i32 = dict(dtype=torch.int32)
        w = BatchDecodeWithPagedKVCacheWrapper(
            torch.zeros(8, dtype=torch.uint8), "HND", use_cuda_graph=True, routes=fake.ROUTES,
            calibration=fake.SEED, paged_kv_indptr_buffer=torch.zeros(b + 1, **i32),
            paged_kv_indices_buffer=torch.zeros(b * pages, **i32),
            paged_kv_last_page_len_buffer=torch.zeros(b, **i32))
        plan = lambda: w.plan(ip, ind, lpl, 8, 2, 64, 16, q_data_type=torch.float16)  # noqa: E731
        plan()
        print(f"  B {b:3d} x {n:6d} tokens: {median_us(plan, calls):7.0f} us")


def sharing_cost(calls: int) -> None:
    import torch

    from pkvrt.policy import sharing
    from pkvrt.runtime.options import RuntimeOptions
    from pkvrt.runtime.shared import SharedPagesRuntime

    rng = np.random.default_rng(0)
    print("finding shared pages (page 16, G 4; the rule: H_q 32, H_kv 8, D 128, the H200 file)")
    for rows, shared, own in SHARING_STEPS:
        n = shared // 16
        per = -(-(shared + own) // 16) + 1
        bt = rng.permutation(rows * per + n).astype(np.int32)[:rows * per].reshape(rows, per).copy()
        bt[:, :n] = bt[0, :n]
        seq = np.full(rows, shared + own, np.int32)
        repeats = median_us(lambda: sharing.any_page_repeats(seq, bt, 16, rows * per + n), calls)

        def new():
            sharing._RUNS_MEMO.clear()
            sharing.plan_sharing(seq, bt, 16, 4)
        fresh = median_us(new, calls)
        step = iter(range(10**9))
        hit = median_us(lambda: sharing.plan_sharing(seq + next(step) % 3, bt, 16, 4), calls)
        # the rule (the re-read count, then SharedPagesRuntime._sharing_pays's three predictions),
        # lengths moved a token a call as in decoding (the routers' memos hit per split quantum)
        rt = SharedPagesRuntime(32, 8, 128, 16, torch.float16, max_batch=max(8, rows),
                                max_pages_per_row=per, num_pages=rows * per + n, engine_capture=True,
                                calibration=str(REPO / "calibration" / "nvidia-h200.json"),
                                options=RuntimeOptions(flashinfer=False))
        sp = sharing.plan_sharing(seq, bt, 16, 4, capacity=rt.chunk * rt.group)
        grow = iter(range(10**9))
        num_pages = rows * per + n

        def rule():
            s = seq + next(grow) % 16
            rt._sharing_pays(s, sharing.page_rereads(s, bt, 16, num_pages), sp, own_gather=False)
        rule = median_us(rule, calls)
        print(f"  {rows:2d} x ({shared} + {own}): repeat test {repeats:5.0f} us, new structure "
              f"{fresh / 1e3:5.2f} ms, memo hit {hit / 1e3:5.2f} ms, rule {rule:5.0f} us")


def decode(calls: int) -> None:
    import torch

    from pkvrt.policy import sharing
    from pkvrt.runtime.options import RuntimeOptions
    from pkvrt.runtime.shared import SharedPagesRuntime

    print("SharedPagesRuntime.plan() per decode step (host lengths, the H100 file, rows +1 token a call)")
    rng = np.random.default_rng(0)
    for rows, shared, own in SHARING_STEPS:
        n = shared // 16
        seq0 = np.array([shared + own + 37 * i for i in range(rows)], np.int32)
        per = -(-(int(seq0.max()) + calls + 20) // 16)
        bt = rng.permutation(rows * per + n).astype(np.int32)[:rows * per].reshape(rows, per).copy()
        bt[:, :n] = bt[0, :n]
        rt = SharedPagesRuntime(32, 8, 128, 16, torch.float16, max_batch=max(8, rows),
                                max_pages_per_row=per, num_pages=rows * per + n, engine_capture=True,
                                calibration=str(REPO / "calibration" / "nvidia-h100-80gb-hbm3.json"),
                                options=RuntimeOptions(flashinfer=False))
        sharing._RUNS_MEMO.clear()
        times = []
        for s in range(calls + 20):
            t0 = time.perf_counter()
            rt.plan(seq0 + s, bt)
            times.append((time.perf_counter() - t0) * 1e6)
        times = times[20:]
        print(f"  {rows:2d} x ({shared} + {own}): median {statistics.median(times):5.0f} us, mean "
              f"{statistics.fmean(times):5.0f} us, {'shared' if rt.plan_used is not None else 'plain'}")


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--calls", type=int, default=50)
    args = ap.parse_args(argv)
    sys.path.insert(0, str(REPO / "tests"))
    import test_runtime_cpu as fake   # the tests' fake device, not a copy of it

    fake.install_fake_device(setattr, lambda name: fake.no_op_kernel, replay_runs_launches=False)
    dropin(args.calls)
    sharing_cost(args.calls)
    decode(max(args.calls, 200))
    return 0


if __name__ == "__main__":
    sys.exit(main())
