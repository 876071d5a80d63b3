"""Device time of the planning kernel (kernels/plan_workqueue.cu) with and without the page-id
check (target <= 1 % of a step's device time), and of a whole device-lengths
Runtime.plan() in an engine's captured step, with its inputs copied before the kernel or copied
by the kernel itself (direct mode).

For each batch (rows x tokens per row, random valid page ids), times 200 graph replays of 20
planning launches each way with CUDA events and prints us per launch; writes JSON with --out.

usage: python benches/plan_cost.py [--out FILE]   (committed: benches/results/h200/plan-cost.json)
"""

from __future__ import annotations

import argparse
import sys

CASES = [(1, 1600), (1, 32768), (8, 1500), (8, 32768), (8, 131072), (64, 32768), (256, 8192)]


def runtime_plan_us(b, width, seq, bt, num_pages, page) -> dict:
    """Device µs per ``Runtime.plan()`` with device lengths, captured 20 times in one graph as an
    engine captures its step (the Runtime's graphs off): ``direct`` = the planning kernel copies
    the lengths and block-table entries itself (contiguous inputs, the default); ``copied`` =
    two copy launches and two device-scalar fills before it (what strided inputs still get, and
    every step before direct mode, 2026-12-01)."""
    import torch

    from pkvrt.runtime import Runtime
    from pkvrt.runtime.options import RuntimeOptions

    out = {}
    for how in ("copied", "direct"):
        rt = Runtime(32, 8, 128, page, torch.float16, max_batch=b, max_pages_per_row=width,
                     device_planning=True, num_pages=num_pages,
                     options=RuntimeOptions(use_cuda_graph=False, validate=False))
        # The copy path on purpose (strided inputs take it; the 2026-12-01 run passed a strided
        # view, which at one row is contiguous, so its B1 "copied" times were direct ones).
        rt._direct_plan = how == "direct"
        rt.plan(seq, bt)   # warm-up outside the capture
        torch.cuda.synchronize()
        rt._d_rows.fill_(-1)   # written by the copied path's fills only: which path ran
        out[how] = graph_us(lambda: rt.plan(seq, bt), replays=100,
                            check=lambda: rt.device_status() == 0
                            and (int(rt._d_rows[0]) == -1) == (how == "direct"))
    return out


def graph_us(launch, *, replays: int, check, calls: int = 20) -> float:
    """Device µs per call of ``launch`` captured ``calls`` times in one CUDA graph (on a side
    stream), replayed ``replays`` times between two CUDA events, after one checked replay
    (``check()`` must be true: the valid step was not flagged, the intended path ran)."""
    import torch

    from pkvrt.runtime.graphs import collector_paused

    g = torch.cuda.CUDAGraph()
    s = torch.cuda.Stream()
    s.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(s), collector_paused(), torch.cuda.graph(g, stream=s):   # graphs.capture's reason
        for _ in range(calls):
            launch()
    torch.cuda.current_stream().wait_stream(s)
    g.replay()
    torch.cuda.synchronize()
    assert check(), "a valid step was flagged, or another path than the intended one ran"
    e0, e1 = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    e0.record()
    for _ in range(replays):
        g.replay()
    e1.record()
    torch.cuda.synchronize()
    return e0.elapsed_time(e1) * 1000 / (replays * calls)


def main(argv=None) -> int:
    import torch

    from pkvrt.launch import ops
    from pkvrt.measure import results
    from pkvrt.policy import planner
    from pkvrt.policy.calibration import find_calibration
    from pkvrt.policy.registry import load_routes

    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out")
    ap.add_argument("--kernel-only", action="store_true",
                    help="time the planning kernel only, not Runtime.plan() (e.g. cubins of an "
                         "older commit through PKVRT_CUBIN_DIR, loaded with PKVRT_ALLOW_STALE_CUBINS=1 where "
                         "their argument structs match)")
    args = ap.parse_args(argv)
    cal = find_calibration(torch.cuda.get_device_name())
    registry = load_routes()
    splits = registry.device_planning_route().splits
    i32 = dict(dtype=torch.int32, device="cuda")
    page, rows_out = 16, []
    for b, tokens in CASES:
        width = -(-tokens // page)
        num_pages = b * width
        seq = torch.full((b,), tokens, **i32)
        bt = torch.randperm(num_pages, device="cuda").view(b, width).int()
        cap = b * 8 * splits.max
        bufs = [torch.zeros(cap, 5, **i32), torch.zeros(1, **i32), torch.zeros(b + 1, **i32),
                torch.zeros(b, **i32), torch.zeros(1, **i32)]
        cand = torch.tensor(splits.candidates(), **i32)
        rows, max_seq, pages = torch.tensor([b], **i32), torch.tensor([tokens], **i32), torch.tensor([num_pages], **i32)
        times = {}
        for checked in (False, True):
            kw = dict(block_tables=bt, num_pages=pages, page_size=page) if checked else {}

            def launch():
                ops.plan_workqueue_device(seq, rows, *bufs[:4], bufs[4], cand, num_kv_heads=8,
                                          min_split_tiles=-(-cal.splits.min_split_tokens // 32),
                                          max_seq_len=max_seq, **planner.device_plan_targets(cal), **kw)
            launch()
            torch.cuda.synchronize()
            assert int(bufs[4][0]) == 0, "a valid step was flagged"
            times[checked] = graph_us(launch, replays=200, check=lambda: int(bufs[4][0]) == 0)
        row = dict(rows=b, tokens=tokens, unchecked_us=round(times[False], 2), checked_us=round(times[True], 2))
        line = (f"B{b:<4d} {tokens:>7d} tokens: plan {times[False]:6.2f} us, with page-id check "
                f"{times[True]:6.2f} us")
        if not args.kernel_only:
            plan = runtime_plan_us(b, width, seq, bt, num_pages, page)
            row.update(runtime_plan_copied_us=round(plan["copied"], 2), runtime_plan_direct_us=round(plan["direct"], 2))
            line += (f"; Runtime.plan() in an engine's graph: inputs copied first {plan['copied']:6.2f} us, "
                     f"direct {plan['direct']:6.2f} us")
        rows_out.append(row)
        print(line, flush=True)
    if args.out:
        results.write_results(args.out, results.make_meta(routes_path=registry.path,
                                                          calibration_path=cal.source,
                                                          kernel_only=args.kernel_only), rows_out)
    return 0


if __name__ == "__main__":
    sys.exit(main())
