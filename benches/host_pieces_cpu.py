"""Where the host time of an adaptive ``Runtime.plan()`` goes, on a machine without a GPU.

The Runtime runs on tests/test_runtime_cpu.py's fake device (CPU tensors for device buffers, no
kernels: the planning launch is a no-op), so only Python and numpy are timed: the step checks
(``check_step``), the route decision (``fallback.decide``, the memoized router) and the staging
of a workqueue/fused step (``_stage_device_plan``). Each piece is timed in place, inside
``plan()`` over N calls, next to the whole call: a piece timed alone in a tight loop runs warm
and measures less than it costs in a step (2026-12-01, dev box, B1 32K: check_step 20 us alone,
35 in place). The Runtime is built with ``flashinfer=False``; on the default cases the router
picks a PersistentKV route itself (FlashInfer's refusal line says by how much), so the decision
is the one an adaptive Runtime with FlashInfer makes. The GPU host's copy and graph-replay calls
are not in these numbers: ``benches/host_cost.py`` measures the real thing on a GPU.

``--grow all``: every row grows a token a step, from lengths off the memo's 64-token grid (random
offsets, seeded), as a decode batch does; the default grows the long row alone. The last column
counts the router's full predictions (memo and window misses) per 1000 calls: with the keyed
memo alone, eight rows at random phases missed on 1 step in 8 (measured 2026-12-02).

usage: python benches/host_pieces_cpu.py [--rows 1,8] [--context 32768] [--calls 2000] [--rounds 5]
       [--grow long|all]
"""

from __future__ import annotations

import argparse
import collections
import statistics
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]


def fake_device():
    """The tests' fake device (tests/test_runtime_cpu.py, install_fake_device) with every kernel
    launch a no-op (a prepared one, ``prepare=True``, a no-op to call): only the host work of a
    step is left."""
    sys.path.insert(0, str(REPO / "tests"))
    import test_runtime_cpu   # noqa: E402 - the tests' fake device, not a copy of it

    test_runtime_cpu.install_fake_device(setattr, lambda name: test_runtime_cpu.no_op_kernel,
                                         replay_runs_launches=False)


def timed_in_place(pieces: dict[str, tuple[object, str]]) -> dict[str, float]:
    """Wrap each ``owner.attr`` so that its calls add their seconds to the returned dict."""
    acc: dict[str, float] = collections.defaultdict(float)
    for key, (owner, attr) in pieces.items():
        inner = getattr(owner, attr)

        def wrapped(*a, _inner=inner, _key=key, **k):
            t = time.perf_counter()
            try:
                return _inner(*a, **k)
            finally:
                acc[_key] += time.perf_counter() - t
        setattr(owner, attr, wrapped)
    return acc


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--rows", default="1,8", help="batch sizes (one long row, the rest 1.5K)")
    ap.add_argument("--context", type=int, default=32768)
    ap.add_argument("--calls", type=int, default=2000, help="plan() calls per round")
    ap.add_argument("--rounds", type=int, default=5,
                    help="rounds per batch size; the table shows medians over them (the dev box is "
                         "shared: one round of the same code moved 40 -> 54 us)")
    ap.add_argument("--grow", choices=("long", "all"), default="long",
                    help="long: the long row grows a token a step; all: every row does, from random "
                         "offsets off the 64-token grid")
    args = ap.parse_args(argv)
    fake_device()
    import numpy as np
    import torch

    from pkvrt.policy.calibration import load_calibration
    from pkvrt.policy.registry import load_routes
    from pkvrt.runtime import Runtime, planning
    from pkvrt.runtime.options import RuntimeOptions

    acc = timed_in_place({"check_step": (planning, "check_step"),
                          "route decision": (planning.fallback, "decide"),
                          "staging": (planning.Planning, "_stage_device_plan")})
    cal = load_calibration(REPO / "calibration" / "nvidia-h200.json")
    width = -(-(args.context + args.rounds * args.calls + 80) // 16)   # + offsets and warm-up
    print(f"{'rows':>4}  {'route':<14} {'plan() us':>9}  pieces in place (us per call; medians of "
          f"{args.rounds} rounds of {args.calls} calls; grow {args.grow})  predictions per 1000 calls")
    for b in (int(x) for x in args.rows.split(",")):
        rt = Runtime(32, 8, 128, 16, torch.float16, routes=load_routes(REPO / "routes.toml"),
                     calibration=cal, max_batch=max(b, 8), max_pages_per_row=width,
                     options=RuntimeOptions(flashinfer=False))
        seq = np.full(b, 1500, dtype=np.int32)
        seq[0] = args.context
        if args.grow == "all":
            seq += np.random.default_rng(20260602).integers(1, 64, b, dtype=np.int32)
        grown = slice(None) if args.grow == "all" else slice(0, 1)
        bt = np.arange(b * width, dtype=np.int32).reshape(b, width)
        for _ in range(5):
            d = rt.plan(seq, bt)
        rounds = collections.defaultdict(list)
        hits0 = rt.router.memo_hits
        for _ in range(args.rounds):
            acc.clear()
            t0 = time.perf_counter()
            for _ in range(args.calls):
                seq[grown] += 1      # the long row (or every row) grows a token a step
                rt.plan(seq, bt)
            rounds["plan()"].append(1e6 * (time.perf_counter() - t0) / args.calls)
            for k, v in acc.items():
                rounds[k].append(1e6 * v / args.calls)
        med = {k: statistics.median(v) for k, v in rounds.items()}
        pieces = ", ".join(f"{k} {v:.1f}" for k, v in med.items() if k != "plan()")
        calls = args.rounds * args.calls
        misses = 1000 * (calls - (rt.router.memo_hits - hits0)) / calls
        print(f"{b:>4}  {d.route:<14} {med['plan()']:9.1f}  {pieces}  {misses:.1f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
