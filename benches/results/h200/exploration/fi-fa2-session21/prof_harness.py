"""pkvrt bench serving with per-engine host timers inside the interleaved wall passes only
(untimed passes and device passes run unwrapped): per engine, the median and mean over timed
steps of each piece's per-step total (us), and the GC time and collections per step.
GC_OFF=1: gc disabled for the whole run (no timers: TIMERS=0)."""
import collections, gc, os, statistics, sys, time
from pkvrt.measure import harness, fi_engines, pagetable
from pkvrt.runtime import planning, running, fi_route, core
from pkvrt.policy import fallback
import flashinfer

ON = [False]
cur = collections.defaultdict(float)
per = collections.defaultdict(lambda: collections.defaultdict(list))   # engine -> key -> [per step]

def wrap(owner, attr, key):
    inner = getattr(owner, attr)
    def f(*a, **k):
        if not ON[0]:
            return inner(*a, **k)
        t = time.perf_counter()
        try:
            return inner(*a, **k)
        finally:
            cur[key] += time.perf_counter() - t
            cur["n " + key] += 1
    setattr(owner, attr, f)

gc_t = [0.0]
def gc_cb(phase, info):
    if not ON[0]:
        return
    if phase == "start":
        gc_t[0] = time.perf_counter()
    else:
        cur["gc"] += time.perf_counter() - gc_t[0]
        cur[f"n gc{info['generation']}"] += 1

if os.environ.get("TIMERS", "1") == "1":
    gc.callbacks.append(gc_cb)
    wrap(harness, "run_step", "run_step")
    wrap(harness.CudaClock, "sync", "sync")
    wrap(harness.RuntimeEngine, "plan", "engine.plan")
    wrap(harness.RuntimeEngine, "attend", "engine.attend")
    wrap(fi_engines.FlashInferEngine, "plan", "engine.plan")
    wrap(fi_engines.FlashInferEngine, "attend", "engine.attend")
    wrap(fi_engines, "to_csr", "to_csr")
    wrap(pagetable.PageLayout, "block_table", "layout.block_table")
    wrap(planning.Planning, "plan", "Runtime.plan")
    wrap(running.Running, "run", "Runtime.run")
    wrap(planning, "check_step", "check_step")
    wrap(fallback, "decide", "decide")
    wrap(planning.Planning, "_gather_flashinfer", "_gather_flashinfer")
    wrap(planning.Planning, "_plan_flashinfer", "_plan_flashinfer")
    wrap(fi_route.FlashInferRoute, "plan", "FlashInferRoute.plan")
    wrap(fi_route.FlashInferRoute, "run", "FlashInferRoute.run")
    wrap(fi_route.DirectCall, "__call__", "DirectCall")
    wrap(flashinfer.BatchDecodeWithPagedKVCacheWrapper, "plan", "wrapper.plan")
    wrap(flashinfer.BatchDecodeWithPagedKVCacheWrapper, "run", "wrapper.run")

    inner_ts = harness.timed_step
    def timed_step(engine, wl, step, pos, out, clock, flush_l2=False):
        cur.clear()
        t = time.perf_counter()
        w = inner_ts(engine, wl, step, pos, out, clock, flush_l2)
        cur["timed_step (incl. flush)"] = time.perf_counter() - t
        cur["wall"] = w * 1e-6
        for k, v in cur.items():
            per[engine.label][k].append(v)
        return w
    harness.timed_step = timed_step

    inner_iw = harness.interleaved_wall_passes
    def iw(*a, **k):
        ON[0] = True
        try:
            return inner_iw(*a, **k)
        finally:
            ON[0] = False
    harness.interleaved_wall_passes = iw
if os.environ.get("GC_OFF") == "1":
    gc.disable()

from pkvrt.tools import cli
rc = cli.main(sys.argv[1:])
for eng, keys in per.items():
    n = len(keys["wall"])
    print(f"== {eng}: {n} timed steps")
    for k in sorted(keys):
        v = keys[k] + [0.0] * (n - len(keys[k]))
        if k.startswith("n "):
            print(f"   {k:34s} mean {statistics.mean(v):8.2f} per step")
        else:
            print(f"   {k:34s} median {1e6 * statistics.median(v):8.1f}  mean {1e6 * statistics.mean(v):8.1f} us")
sys.exit(rc)
