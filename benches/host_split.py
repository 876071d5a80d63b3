"""Where the wall time of a host-lengths step goes (GPU): plan(), the step graph's replay, and the
wait for the device, per engine, on a trace's sampled steps.

The harness's engines (``device-plan-step``, ``host-step``, ``shared-step``; pkvrt/measure/harness.py)
run the trace as ``pkvrt bench serving --engine-layers 32 --max-active 8 --steps-limit 24`` would:
two untimed passes (every step graph captured), then ``--rounds`` rounds in which every step is
run by every engine in turn, L2 flushed and the GPU idle before each, as the wall passes are. For
each (engine, step, round): the host time of plan(), of the replay call, and from the replay's
return to the end of the device work. An engine that plans on the host first plans the trace's
previous step, untimed (``--cold-plans``: not), as the wall passes do. A host-lengths engine's
excess over device-plan-step's wall is its plan; this says how much, step by step.
``--profile``: a cProfile of shared-step's plan() in the last round (the top 20 by cumulative
time, printed).

usage: python benches/host_split.py [--traces parallel,sysprompt] [--rounds 3] [--cold-plans] [--out FILE]
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time

ENGINES = ("device-plan-step", "host-step", "shared-step")
PARTS = ("plan", "replay", "wait", "wall")
SEED = 20260623


def split_trace(name: str, rounds: int, profile: bool, cold_plans: bool = False) -> list[dict]:
    import cProfile
    import pstats

    import torch

    from pkvrt.measure import harness
    from pkvrt.measure.traces import resolve_trace
    from pkvrt.policy.calibration import find_calibration
    from pkvrt.policy.registry import load_routes
    from pkvrt.tools.bench import engine_factory

    cfg = harness.ServingConfig(trace=name, max_active=8, seeds=(SEED,), engines=ENGINES,
                                steps_limit=24, layers=32, cold_plans=cold_plans)
    wl = harness.Workload(resolve_trace(name, seed=SEED), cfg, SEED, device="cuda")
    sh = cfg.shape
    out = torch.zeros((cfg.max_active, sh.num_qo_heads, sh.head_dim), dtype=sh.torch_dtype, device="cuda")
    # built as `pkvrt bench serving` builds them, FlashInfer's tensor cores as the fallback route
    make_engine = engine_factory(cfg, load_routes(), find_calibration(torch.cuda.get_device_name()))
    engines = {n: make_engine(n, wl, "flashinfer-tc") for n in ENGINES}
    clock = harness.CudaClock()
    for e in engines.values():
        for _ in range(2):
            harness.untimed_pass(e, wl, wl.steps, out, clock, previous=wl.previous)
    times = {n: {p: [[] for _ in wl.steps] for p in PARTS} for n in engines}
    prof = cProfile.Profile()
    for r in range(rounds):
        for pos, step in enumerate(wl.steps):
            for k in range(len(engines)):
                n = ENGINES[(pos + r + k) % len(ENGINES)]
                e = engines[n]
                profiled = profile and n == "shared-step" and r == rounds - 1
                prev = wl.previous[pos]   # planned untimed first, as the wall passes do
                if prev is not None and harness.plans_on_host(e):
                    e.plan(prev)
                clock.flush_l2()
                clock.sync()
                t0 = time.perf_counter()
                if isinstance(e, harness.HostStepGraphEngine):
                    if profiled:
                        prof.enable()
                    e.plan(step)
                    if profiled:
                        prof.disable()
                    t1 = time.perf_counter()
                    b, phase = len(step.rids), pos * wl.layers % wl.copies
                    e.graphs[(e.rt.step_key, b, phase)].replay()   # captured by the untimed passes
                else:   # the whole step is one graph, planning kernel included
                    t1 = t0
                    e.run_step(wl, step, pos, out)
                t2 = time.perf_counter()
                clock.sync()
                t3 = time.perf_counter()
                for part, us in zip(PARTS, (t1 - t0, t2 - t1, t3 - t2, t3 - t0)):
                    times[n][part][pos].append(us * 1e6)
    rows = []
    for n in engines:
        for pos, step in enumerate(wl.steps):
            rows.append(dict(trace=name, engine=n, step=pos, active=len(step.rids),
                             **{f"{p}_us": round(statistics.median(times[n][p][pos]), 1) for p in PARTS}))
    print(f"{name}: {len(wl.steps)} steps x {rounds} rounds, median over steps (us)")
    for n in engines:
        mine = [r for r in rows if r["engine"] == n]
        print(f"  {n:18s} " + "  ".join(f"{p} {statistics.median(r[p + '_us'] for r in mine):7.0f}"
                                           for p in PARTS))
    if profile:
        pstats.Stats(prof).sort_stats("cumulative").print_stats(20)
    return rows


def main(argv=None) -> int:
    from pkvrt.measure import results
    from pkvrt.policy.registry import load_routes

    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--traces", default="parallel,sysprompt")
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--profile", action="store_true")
    ap.add_argument("--cold-plans", action="store_true",
                    help="plan each step cold (by default the trace's previous step is planned "
                         "first, untimed, as the wall passes do)")
    ap.add_argument("--out")
    args = ap.parse_args(argv)
    rows = []
    for name in args.traces.split(","):
        rows += split_trace(name, args.rounds, args.profile, args.cold_plans)
    if args.out:
        import torch

        from pkvrt.policy.calibration import find_calibration
        results.write_results(args.out, results.make_meta(
            seeds=(SEED,), routes_path=load_routes().path,
            calibration_path=find_calibration(torch.cuda.get_device_name()).source,
            rounds=args.rounds, cold_plans=args.cold_plans), rows)
    return 0


if __name__ == "__main__":
    sys.exit(main())
