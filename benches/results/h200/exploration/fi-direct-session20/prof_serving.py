"""pkvrt bench serving with per-call host timers on each engine's plan() and attend() (and the
Runtime's plan pieces), printed per engine at the end: mean us per call over every pass."""
import collections, sys, time
from pkvrt.measure import harness, fi_engines
from pkvrt.runtime import planning, running, fi_route
from pkvrt.policy import fallback
acc = collections.defaultdict(lambda: [0.0, 0])
def wrap(owner, attr, key):
    inner = getattr(owner, attr)
    def f(*a, **k):
        t = time.perf_counter()
        try:
            return inner(*a, **k)
        finally:
            e = acc[key]; e[0] += time.perf_counter() - t; e[1] += 1
    setattr(owner, attr, f)
wrap(harness.RuntimeEngine, "plan", "pkvrt engine.plan")
wrap(harness.RuntimeEngine, "attend", "pkvrt engine.attend")
wrap(fi_engines.FlashInferEngine, "plan", "fi engine.plan")
wrap(fi_engines.FlashInferEngine, "attend", "fi engine.attend")
from pkvrt.measure import pagetable
wrap(pagetable.PageLayout, "block_table", "layout.block_table")
wrap(fallback, "decide", "pkvrt fallback.decide")
wrap(fi_route.FlashInferRoute, "plan", "pkvrt FlashInferRoute.plan (FI plan)")
wrap(fi_route.FlashInferRoute, "run", "pkvrt FlashInferRoute.run")
import flashinfer
wrap(flashinfer.BatchDecodeWithPagedKVCacheWrapper, "plan", "wrapper.plan (both)")
from pkvrt.tools import cli
rc = cli.main(sys.argv[1:])
for k, (s, n) in sorted(acc.items()):
    print(f"{k:40s} {n:7d} calls {1e6 * s / max(n, 1):8.1f} us/call")
sys.exit(rc)
