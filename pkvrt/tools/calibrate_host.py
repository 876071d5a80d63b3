"""``pkvrt calibrate --host-time``: the host time of a step on each route kind, on this machine.

The router weighs it (routes.toml ``[host_time]``; ``costmodel.wall_us``) in the Runtime's
default mode, so it is measured in that mode: a ``Runtime(32, 8, 128, 16)`` per route kind,
host lengths, a graph per layer, FlashInfer eager with its direct calls, the route forced.
Each step grows every row by one token (the router's memo then hits as in serving, and misses
once per quantum); per step the host time of ``plan()`` and ``L`` ``run()`` calls is timed
with nothing synchronized inside (the GPU is idle at its start: a synchronize before each
step, as an engine's sampling leaves it), at L = 1 and L = ``LONG``. Per (kind, case, round):

    run_us  = (host(LONG) - host(1)) / (LONG - 1)      one more layer
    plan_us = host(1) - run_us                         plan() and the first run()'s extra

medians over the steps, then over cases and rounds. The cases: one 32K row, the bimodal B8
step and eight short rows (0.5-3K tokens, the Azure traces' regime); the kinds in a rotated
order each round, since the host of a GPU machine changes speed by tens of percent between
one pass and the next (benches/NOTES.md, "Host cost"): what the router compares is the kinds
against each other, measured side by side.
"""

from __future__ import annotations

import datetime
import statistics
import time

import numpy as np

from pkvrt.policy import calibration as calib
from pkvrt.tools.calibrate import SEED, SHAPE, format_rows

CASES = {
    "B1-32K": (32768,),
    "B8-bimodal": (32768, 2048, 3072, 4096, 32000, 1024, 2560, 3584),
    "B8-short": (1100, 2300, 700, 1900, 3100, 500, 1500, 2700),
}
LONG = 16        # layers of the second timing (the first is one layer)
STEPS = 40       # timed steps per (kind, case, layers)
WARMUP = 10      # untimed steps first: graph captures, FlashInfer's JIT, the memo
ROUNDS = 3


def _cache(lens, steps: int, rng):
    """K/V caches, q, out and shuffled block tables for rows of ``lens`` tokens growing
    ``steps`` tokens (the host time does not depend on the values; the kernels read them)."""
    import torch

    page = SHAPE["page_size"]
    pages = [-(-(n + steps) // page) for n in lens]
    total = sum(pages)
    perm = rng.permutation(total).astype(np.int32)
    bt = np.full((len(lens), max(pages)), -1, dtype=np.int32)
    at = 0
    for i, p in enumerate(pages):
        bt[i, :p] = perm[at:at + p]
        at += p
    shape = (total, SHAPE["num_kv_heads"], page, SHAPE["head_dim"])
    k = torch.randn(shape, dtype=torch.float16, device="cuda")
    v = torch.randn(shape, dtype=torch.float16, device="cuda")
    q = torch.randn(len(lens), SHAPE["num_qo_heads"], SHAPE["head_dim"], dtype=torch.float16, device="cuda")
    return k, v, q, torch.empty_like(q), bt


def _host_us(rt, route: str, lens, bt, k, v, q, out, layers: int) -> float:
    """Median host µs of plan() + ``layers`` run() over STEPS growing steps (after WARMUP)."""
    import torch

    base = np.asarray(lens, dtype=np.int32)
    times = []
    for i in range(WARMUP + STEPS):
        seq = base + i
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        rt.plan(seq, bt, force=route)
        for _ in range(layers):
            rt.run(q, k, v, out)
        t1 = time.perf_counter()
        if i >= WARMUP:
            times.append((t1 - t0) * 1e6)
    torch.cuda.synchronize()
    return statistics.median(times)


def measure_host_time(reg, cal: calib.Calibration, *, rounds: int = ROUNDS, command: str = "",
                      log=print) -> tuple[calib.HostTime, list[dict]]:
    """The :class:`HostTime` of this machine (module docstring) and its timed rows.

    One Runtime per route kind of ``reg`` (the first route of each kind; FlashInfer must be
    available, RuntimeError otherwise)."""
    import torch

    from pkvrt.runtime import Runtime
    from pkvrt.runtime.options import with_options

    routes = {}
    for r in reg.routes:
        routes.setdefault(r.kind, r.name)
    missing = [k for k in calib.TIME_KINDS if k not in routes]
    if missing:
        raise RuntimeError(f"{reg.path}: no route of kind {', '.join(missing)}: host_time needs every kind")
    rng = np.random.default_rng(SEED)
    width = max(-(-(max(lens) + WARMUP + STEPS) // SHAPE["page_size"]) for lens in CASES.values())
    runtimes = {}
    for kind, name in routes.items():
        rt = Runtime(routes=reg, calibration=cal, max_batch=8, max_pages_per_row=width,
                     **with_options(SHAPE, validate=False))
        if kind == "flashinfer" and not rt.flashinfer_available:
            raise RuntimeError(f"FlashInfer is unavailable ({rt.explain().splitlines()[1]}); host_time "
                               "weighs FlashInfer's host time against the other routes'")
        runtimes[kind] = (rt, name)
    kinds = list(runtimes)
    rows = []
    for rnd in range(rounds):
        for case, lens in CASES.items():
            k, v, q, out, bt = _cache(lens, WARMUP + STEPS, rng)
            qb, ob = q[:len(lens)], out[:len(lens)]
            for kind in kinds[rnd % len(kinds):] + kinds[:rnd % len(kinds)]:
                rt, name = runtimes[kind]
                h1 = _host_us(rt, name, lens, bt, k, v, qb, ob, 1)
                hl = _host_us(rt, name, lens, bt, k, v, qb, ob, LONG)
                run = max(0.0, (hl - h1) / (LONG - 1))
                rows.append(dict(kind=kind, route=name, case=case, round=rnd, host_1_us=h1,
                                 host_long_us=hl, layers_long=LONG, plan_us=max(0.0, h1 - run), run_us=run))
                log(f"host time  round {rnd}  {case:10s}  {kind:10s}  L1 {h1:7.1f} us  L{LONG} {hl:7.1f} us"
                    f"  -> plan {rows[-1]['plan_us']:6.1f}  run {run:5.1f} us")
            del k, v, q, out
            torch.cuda.empty_cache()
    costs = tuple((kind, calib.HostCost(plan_us=round(statistics.median(r["plan_us"] for r in rows if r["kind"] == kind), 1),
                                         run_us=round(statistics.median(r["run_us"] for r in rows if r["kind"] == kind), 1)))
                  for kind in calib.TIME_KINDS)
    text = (f"Measured by pkvrt calibrate --host-time on this machine's host with {cal.gpu}: per route kind a "
            f"Runtime(32, 8, 128, 16) in its default mode (host lengths, a graph per layer, FlashInfer eager "
            f"with direct calls), the route forced ({', '.join(f'{k} {n}' for k, (_, n) in runtimes.items())}); "
            f"steps growing one token a step over {', '.join(CASES)}; host time of plan() + L run() with "
            f"nothing synchronized inside, median of {STEPS} steps after {WARMUP}, at L = 1 and {LONG}: "
            f"run_us = the slope, plan_us = L1 - run_us; medians over the cases and {rounds} rounds, the kinds "
            "in a rotated order each round. Host speed, not the GPU, sets these: re-measure on another machine.")
    ht = calib.HostTime(costs=costs, date=datetime.date.today().isoformat(), command=command or "pkvrt calibrate --host-time",
                        provenance=text)
    return ht, rows


def host_table(ht: calib.HostTime) -> str:
    return format_rows(("kind", "plan_us", "run_us"),
                       [(k, f"{c.plan_us:.1f}", f"{c.run_us:.1f}") for k, c in ht.costs])
