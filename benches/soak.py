"""GPU soak of pkvrt.Runtime: a long continuous-decode replay with graphs on.

``--steps`` (default 100 000) decode steps of a trace (default ``mixed``: staggered arrivals, so
rows join and leave and the batch size moves over 1..max_active) go through one Runtime, one
layer per step, CUDA graphs on. Lengths grow by one token a step (``traces.decode_steps``); when
a trace is done the next one is drawn with the next seed (trace r: seed ``--seed + r``, its page
layout too), until the step count is reached. Page tables come from ``pagetable.build_layout`` and
``PageLayout.block_table(rids)`` as in the serving harness (pkvrt/measure/harness.py: hole fraction 0,
host int32 arrays, caller-owned q/out views ``q[:B]``, ``out[:B]``).

Unlike the harness, the K/V cache is allocated once for the whole soak (like an engine's cache,
and so that graph keys, which hold the cache's pointer, do not change with every trace):
``ceil(num_requests * ceil(max_context / page) / (1 - holes))`` pages of random data, which every
trace's layout fits in. Prompts are clamped so that no row exceeds ``--max-context`` tokens
(default 32768: long rows still pass routes.toml's 16K ``min_context`` gate, so the PersistentKV
routes and their graphs are exercised; at 16K they would almost never run). q is random and fixed.

Measured, at the start, at the end of warm-up (``--warmup``) and every ``--sample-every`` steps:
GPU memory (torch.cuda.memory_allocated / memory_reserved, device-wide used bytes from
mem_get_info), host RSS (/proc/self/status VmRSS), Runtime.stats() (graphs, captures, replays,
evictions, invalidations, regrowths, staging copies), the router memo size and hits, steps/s and
the median / p99 host time of ``plan() + run()`` over the window. Checked every step: graphs
alive <= max_graphs, router memo <= its size. Routes taken and batch sizes are counted.

Determinism: a fixed golden step (5 rows up to 24K tokens, 50 % holes, fixed q) is run at the
start, every ``--golden-every`` steps and at the end, once with the policy's route and once forced
on every route of routes.toml (``--golden-routes``); each output must be bit-identical
(torch.equal) to that route's first one. The first outputs are checked against the FP32
reference (pkvrt.reference.decode_attention) with the harness's tolerance.

Exit status: 0 when every step ran without an exception, no golden output changed, the
reference check passed, the bounds held and (with ``--max-growth-mib``) GPU-allocated and RSS
growth after warm-up stayed under it; 1 otherwise (the reasons are printed and recorded in the
results file, which is rewritten at every sample, so an interrupted run keeps its samples);
2 when there is no GPU (use ``--dry-run`` there).

``--dry-run`` (no GPU needed) replays the same step stream through the router alone (H200
calibration unless ``--calibration``): steps, restarts, batch sizes, route mix, distinct
PersistentKV graph shapes, cache size, router host time.

usage: python benches/soak.py [--steps 100000] [--out benches/results/h200/soak.json]
       python benches/soak.py --dry-run --steps 20000
"""

from __future__ import annotations

import argparse
import collections
import math
import sys
import time
import traceback
from pathlib import Path

import attrs
import numpy as np

try:
    import pkvrt  # noqa: F401  (the installed package: pip install -e .)
except ModuleNotFoundError:  # a bare checkout: its own pkvrt (planner, --help, --dry-run)
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from pkvrt.measure import traces  # noqa: E402
from pkvrt.measure.pagetable import build_layout  # noqa: E402
from pkvrt.tools.cli import add_shape_arguments, positive_int  # noqa: E402

ROOT = Path(__file__).resolve().parents[1]
DEFAULT_OUT = ROOT / "benches" / "results" / "h200" / "soak.json"
GOLDEN_LENS = (24576, 3000, 17001, 700, 9000)   # B5; the longest passes the 16K gate
GOLDEN_HOLES = 0.5
GOLDEN_SEED = 20260623
REL_ERR = 2e-3                                    # tests' norm-wise bound (tests/paged.py)


# --------------------------------------------------------------------------- arguments

def _fraction(text: str) -> float:
    v = float(text)
    if not 0.0 <= v < 1.0:
        raise argparse.ArgumentTypeError(f"{v} is not in [0, 1)")
    return v


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                epilog="See the module docstring (head of benches/soak.py) for the protocol.")
    p.add_argument("--steps", type=positive_int, default=100_000, help="decode steps (default 100000)")
    p.add_argument("--warmup", type=positive_int, default=5_000,
                   help="steps before the baseline sample that growth is measured from (default 5000)")
    p.add_argument("--sample-every", type=positive_int, default=10_000, metavar="N",
                   help="memory/stats sample every N steps (default 10000)")
    p.add_argument("--golden-every", type=positive_int, metavar="N",
                   help="golden-step check every N steps (default: --sample-every)")
    p.add_argument("--golden-routes", default="all", metavar="LIST",
                   help="'all' (the policy's route plus every route of routes.toml, forced; "
                        "FlashInfer only if available) or a comma list of route names and 'adaptive'")
    p.add_argument("--trace", default="mixed", metavar="SPEC",
                   help=f"'mixed' (traces.mixed_fixture(seed)), a family ({', '.join(traces.FAMILIES)}; "
                        "drawn with seed) or a .csv/.json file (same requests every restart, new page "
                        "layout); default mixed")
    p.add_argument("--num-requests", type=positive_int, metavar="N",
                   help="requests per trace: a family's draw size (default 32), or the first N")
    p.add_argument("--seed", type=int, default=traces.MIXED_SEED,
                   help=f"seed of trace 0; trace r uses seed + r (default {traces.MIXED_SEED}: trace 0 "
                        "is the shipped mixed fixture)")
    p.add_argument("--max-context", type=positive_int, default=32768, metavar="TOKENS",
                   help="clamp prompts so that no row exceeds this many tokens; sizes the cache and "
                        "max_pages_per_row (default 32768)")
    p.add_argument("--hole-fraction", type=_fraction, default=0.0,
                   help="page-layout holes of the traces (default 0, as the serving harness)")
    p.add_argument("--max-active", type=positive_int, default=8, metavar="N",
                   help="decode slots, the largest batch (default 8)")
    p.add_argument("--max-graphs", type=positive_int, default=64, help="RuntimeOptions(max_graphs=...) (default 64)")
    p.add_argument("--decision-memo", type=int, default=4096,
                   help="RuntimeOptions(decision_memo=...) (default 4096)")
    p.add_argument("--force", metavar="ROUTE", help="force this route on every soak step (default: policy)")
    p.add_argument("--validate", action="store_true",
                   help="RuntimeOptions(validate=True) (default off, as the serving harness)")
    p.add_argument("--flashinfer-cuda-graph", action="store_true",
                   help="RuntimeOptions(flashinfer_cuda_graph=True): FlashInfer steps inside graphs too")
    p.add_argument("--no-flashinfer", action="store_true", help="RuntimeOptions(flashinfer=False)")
    p.add_argument("--device-planning", action="store_true",
                   help="Runtime(device_planning=True) (where this Runtime has it): workqueue plans "
                        "built on the GPU from the step's int32 arrays; golden routes: workqueue/fused")
    p.add_argument("--routes", metavar="PATH", help="routes.toml (default: the package's)")
    p.add_argument("--calibration", metavar="PATH", help="calibration JSON (default: this GPU's file)")
    p.add_argument("--max-growth-mib", type=float, metavar="MIB",
                   help="also fail when GPU-allocated or RSS growth after warm-up exceeds this")
    p.add_argument("--max-seconds", type=float, default=540.0,
                   help="stop the soak (and fail) after this wall time (default 540)")
    p.add_argument("--out", default=str(DEFAULT_OUT), metavar="FILE",
                   help=f"results JSON (default {DEFAULT_OUT.relative_to(ROOT)})")
    p.add_argument("--dry-run", action="store_true",
                   help="no GPU: the step stream through the router only (route mix, graph shapes)")
    shape = add_shape_arguments(p)
    shape.add_argument("--dtype", choices=("float16", "bfloat16"), default="float16")
    args = p.parse_args(argv)
    args.golden_every = args.golden_every or args.sample_every
    if args.max_context < 2:
        p.error("--max-context: expected at least 2 tokens")
    return args


# --------------------------------------------------------------------------- steps (no GPU)

def clamp_trace(trace: traces.Trace, max_context: int) -> traces.Trace:
    """``trace`` with decode_len <= max_context - 1 and prompt_len + decode_len <= max_context."""
    reqs = []
    for r in trace.requests:
        decode = min(r.decode_len, max_context - 1)
        reqs.append(attrs.evolve(r, decode_len=decode, prompt_len=min(r.prompt_len, max_context - decode)))
    return attrs.evolve(trace, requests=reqs)


def draw_trace(args, seed: int) -> traces.Trace:
    """Trace of restart ``seed - args.seed``: mixed_fixture(seed), a family draw, or the file."""
    if args.trace == "mixed":
        t = traces.mixed_fixture(seed)
        if args.num_requests:
            t = attrs.evolve(t, requests=t.requests[:args.num_requests])
    else:
        t = traces.resolve_trace(args.trace, num_requests=args.num_requests, seed=seed)
    return clamp_trace(t, args.max_context)


def cache_pages(num_requests: int, args) -> int:
    """Pages a cache needs for any trace of ``num_requests`` clamped requests: build_layout's
    universe ``ceil(L / (1 - holes))`` with L <= num_requests * ceil(max_context / page)."""
    per_row = -(-args.max_context // args.page_size)
    return math.ceil(num_requests * per_row / (1.0 - args.hole_fraction)) + 1


def step_stream(args, capacity: int, restarts: list):
    """Endless (seq_lens int32 [B], block_tables int32 [B, W]) of the soak; ``restarts`` gets the
    seed of every trace drawn (trace 0 included)."""
    for r in range(sys.maxsize):
        seed = args.seed + r
        trace = draw_trace(args, seed)
        layout = build_layout(trace, page_size=args.page_size, hole_fraction=args.hole_fraction, seed=seed)
        if layout.num_physical_pages > capacity:
            raise ValueError(f"trace seed {seed}: {layout.num_physical_pages} pages exceed the cache's "
                             f"{capacity} (more requests than trace 0?)")
        restarts.append(seed)
        for step in traces.decode_steps(trace, max_active=args.max_active):
            yield step.seq_lens, layout.block_table(step.rids)


def golden_inputs(args, max_context: int):
    """The golden step: seq_lens int32 [5], block_tables int32 [5, W] (50 % holes), its cache pages."""
    lens = [min(n, max_context) for n in GOLDEN_LENS]
    t = traces.Trace(name="golden", seed=GOLDEN_SEED, source="benches/soak.py",
                     requests=[traces.Request(i, 0, n - 1, 1) for i, n in enumerate(lens)])
    layout = build_layout(t, page_size=args.page_size, hole_fraction=GOLDEN_HOLES, seed=GOLDEN_SEED)
    return np.array(lens, np.int32), layout.table.copy(), layout.num_physical_pages


def schedule(args) -> tuple[set, set]:
    """Step counts (after that many soak steps) at which to sample and to run the golden step."""
    n = args.steps
    samples = {min(args.warmup, n), n} | set(range(args.sample_every, n + 1, args.sample_every))
    golden = {n} | set(range(args.golden_every, n + 1, args.golden_every))
    return samples, golden


# --------------------------------------------------------------------------- measurements

def rss_bytes() -> int | None:
    try:
        for line in Path("/proc/self/status").read_text().splitlines():
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) * 1024
    except OSError:
        pass
    return None


def array_bytes(obj) -> int:
    """numpy bytes held by an attrs object (a RouteDecision and its plan), recursively."""
    if isinstance(obj, np.ndarray):
        return obj.nbytes
    if isinstance(obj, (tuple, list)):
        return sum(array_bytes(x) for x in obj)
    if isinstance(obj, dict):
        return sum(array_bytes(x) for x in obj.values())
    if attrs.has(type(obj)):
        return sum(array_bytes(getattr(obj, f.name)) for f in attrs.fields(type(obj)))
    return 0


def graph_shape(d, router) -> tuple | None:
    """(route, padded batch, structure) a PersistentKV decision's graph is keyed by (dry run):
    a bucket plan's buckets; for workqueue/fused, planned on the GPU, the planning kernel's grid
    of the padded batch (``planner.device_grid_ctas``, what Runtime._device_grid_tasks keys)."""
    from pkvrt.policy import planner
    from pkvrt.runtime import graphs

    if d.kind == "flashinfer":
        return None
    gb = graphs.padded_batch(d.active)
    if d.kind == "bucket":
        structure = tuple((graphs.padded_batch(b.rows.size), int(b.num_splits)) for b in d.plan.buckets)
    else:
        structure = planner.device_grid_ctas(gb, num_kv_heads=router.num_kv_heads,
                                             splits=router.registry.route(d.route).splits, cal=router.cal)
    return d.route, gb, structure


def q_tensor(shape, b: int, seed: int, device, dtype):
    import torch

    gen = torch.Generator(device=device).manual_seed(seed)
    return torch.randn((b, shape.num_qo_heads, shape.head_dim), generator=gen, device=device, dtype=dtype)


# --------------------------------------------------------------------------- dry run

def dry_run(args) -> int:
    from pkvrt.policy import calibration as calib
    from pkvrt.policy.registry import load_routes
    from pkvrt.policy.router import Router

    registry = load_routes(args.routes)
    cal = (calib.load_calibration(args.calibration) if args.calibration
           else calib.find_calibration("NVIDIA H200"))   # the GPU this soak is for
    router = Router(registry, cal, num_qo_heads=args.num_qo_heads, num_kv_heads=args.num_kv_heads,
                    head_dim=args.head_dim, page_size=args.page_size, graphs=True,
                    memo_size=args.decision_memo, device_plan_kinds=("workqueue", "fused"))   # as the Runtime's
    n_req = len(draw_trace(args, args.seed))
    capacity = cache_pages(n_req, args)
    restarts: list = []
    stream = step_stream(args, capacity, restarts)
    routes, batches, shapes = collections.Counter(), collections.Counter(), collections.Counter()
    host = np.empty(args.steps)
    longest, memo_full = 0, None
    t_start = time.perf_counter()
    for i in range(args.steps):
        seq, bt = next(stream)
        t0 = time.perf_counter()
        d = router.decide(seq, force=args.force, block_tables=bt)
        host[i] = time.perf_counter() - t0
        routes[d.route] += 1
        batches[int(seq.size)] += 1
        longest = max(longest, int(seq.max()))
        if memo_full is None and router.memo_size and len(router._memo) >= router.memo_size:
            memo_full = i + 1
        if (s := graph_shape(d, router)) is not None:
            shapes[s] += 1
    wall = time.perf_counter() - t_start
    g_seq, g_bt, g_pages = golden_inputs(args, args.max_context)
    page_bytes = args.num_kv_heads * args.page_size * args.head_dim * 2
    print(f"dry run (router only, calibration {cal.slug}): {args.steps} steps of {args.trace} in "
          f"{wall:.1f} s, {len(restarts)} traces (seeds {restarts[0]}..{restarts[-1]})")
    print(f"  cache: {capacity} pages = {2 * capacity * page_bytes / 2**30:.2f} GiB K+V; longest row "
          f"{longest} tokens; golden step {g_seq.tolist()} uses {g_pages} pages")
    print(f"  batch sizes: {dict(sorted(batches.items()))}")
    print(f"  routes: {dict(routes.most_common())}")
    print(f"  distinct PersistentKV graph shapes (route, padded B, structure): {len(shapes)} "
          f"(max_graphs {args.max_graphs}; the caller-q/out path keys each twice)")
    print(f"  router decide(): median {np.median(host) * 1e6:.1f} us, p99 "
          f"{np.percentile(host, 99) * 1e6:.1f} us; memo {len(router._memo)} / {router.memo_size} "
          f"(full at step {memo_full}), hits {router.memo_hits}")
    return 0


# --------------------------------------------------------------------------- the soak

class Soak:
    """State of one GPU soak: the runtime, the cache, the golden step, samples and failures."""

    def __init__(self, args):
        import torch

        from pkvrt.measure.harness import ADAPTIVE, Shape, engine_label
        from pkvrt.policy import calibration as calib
        from pkvrt.policy.registry import load_routes
        from pkvrt.runtime import Runtime
        from pkvrt.runtime.options import with_options

        self.args, self.torch = args, torch
        self.case = f"soak-{Path(args.trace).stem}-B{args.max_active}"
        self.engine = engine_label("device-plan" if args.device_planning else args.force or ADAPTIVE)
        self.shape = sh = Shape(num_qo_heads=args.num_qo_heads, num_kv_heads=args.num_kv_heads,
                                head_dim=args.head_dim, page_size=args.page_size, dtype=args.dtype)
        self.registry = load_routes(args.routes)
        self.cal = (calib.load_calibration(args.calibration) if args.calibration
                    else calib.find_calibration(torch.cuda.get_device_name()))
        extra = dict(device_planning=True) if args.device_planning else {}
        self.rt = Runtime(sh.num_qo_heads, sh.num_kv_heads, sh.head_dim, sh.page_size,
                          sh.torch_dtype, routes=self.registry, calibration=self.cal,
                          max_batch=max(args.max_active, len(GOLDEN_LENS)),
                          max_pages_per_row=-(-args.max_context // sh.page_size),
                          **with_options(extra, use_cuda_graph=True, max_graphs=args.max_graphs,
                                         validate=args.validate, flashinfer=not args.no_flashinfer,
                                         decision_memo=args.decision_memo,
                                         flashinfer_cuda_graph=args.flashinfer_cuda_graph))
        dev, dt = self.rt.device, sh.torch_dtype
        self.num_requests = len(draw_trace(args, args.seed))
        g_seq, g_bt, g_pages = golden_inputs(args, args.max_context)
        self.capacity = max(cache_pages(self.num_requests, args), g_pages)
        gen = torch.Generator(device=dev).manual_seed(args.seed)
        shape4 = (self.capacity, sh.num_kv_heads, sh.page_size, sh.head_dim)
        self.k = torch.randn(shape4, generator=gen, device=dev, dtype=dt)     # [P, H_kv, page, D]
        self.v = torch.randn(shape4, generator=gen, device=dev, dtype=dt)
        self.q = q_tensor(sh, args.max_active, args.seed + 1, dev, dt)           # [max_active, H_q, D]
        self.out = torch.full_like(self.q, float("nan"))
        self.g_seq, self.g_bt = g_seq, g_bt
        self.g_q = q_tensor(sh, len(g_seq), GOLDEN_SEED, dev, dt)                # [5, H_q, D]
        self.g_out = torch.empty_like(self.g_q)
        self.golden_routes = self._golden_routes(args.golden_routes)
        self.first: dict = {}            # golden route -> (route taken, first output)
        self.golden, self.samples, self.errors, self.failures = [], [], [], []
        self.routes, self.batches = collections.Counter(), collections.Counter()
        self.restarts: list = []
        self.graphs_max = self.memo_max = 0
        self.loop_s = 0.0                # wall time of the soak steps, samples and golden checks excluded

    def _golden_routes(self, text: str) -> list:
        names = [r.name for r in self.registry.routes
                 if not self.args.device_planning or r.kind in ("workqueue", "fused")]
        if text == "all":
            wanted = ["adaptive", *names]
        else:
            wanted = [n.strip() for n in text.split(",") if n.strip()]
            unknown = [n for n in wanted if n != "adaptive" and n not in names]
            if unknown:
                raise ValueError(f"--golden-routes: unknown route(s) {unknown}; known: adaptive, "
                                 f"{', '.join(names)}")
        base = self.registry.baseline.name
        return [n for n in wanted if n != base or self.rt.flashinfer_available]

    # -- golden step ----------------------------------------------------------------------

    def check_golden(self, at: int) -> None:
        """Run the golden step on every golden route; compare with the first outputs."""
        from pkvrt import reference
        from pkvrt.measure.harness import errors, within_tolerance

        torch = self.torch
        for name in self.golden_routes:
            d = self.rt.plan(self.g_seq, self.g_bt, force=None if name == "adaptive" else name)
            self.g_out.fill_(float("nan"))
            self.rt.run(self.g_q, self.k, self.v, out=self.g_out)
            torch.cuda.synchronize()
            rec = dict(step=at, golden=name, route=d.route)
            if name not in self.first:
                dev = self.rt.device
                ref = reference.decode_attention(self.g_q, self.k, self.v,
                                                 torch.from_numpy(self.g_seq).to(dev),
                                                 torch.from_numpy(self.g_bt).to(dev))
                max_e, mean_e = errors(self.g_out, ref)
                rel = ((self.g_out.float() - ref).norm() / ref.norm()).item()
                ok = within_tolerance(max_e, mean_e) and rel < REL_ERR
                rec.update(max_err_ref=max_e, mean_err_ref=mean_e, rel_err_ref=rel, ref_ok=ok)
                if not ok:
                    self.failures.append(f"golden {name} ({d.route}) vs FP32 reference: max|e| {max_e:.3g}, "
                                         f"mean|e| {mean_e:.3g}, rel {rel:.3g}")
                self.first[name] = (d.route, self.g_out.clone())
            else:
                route0, out0 = self.first[name]
                rec.update(equal=bool(torch.equal(self.g_out, out0)), route_changed=d.route != route0)
                if rec["route_changed"]:   # the policy picked another route: other reduction order
                    rec["max_abs_diff"] = float((self.g_out.float() - out0.float()).abs().max())
            self.golden.append(rec)

    def golden_counts(self) -> tuple[int, int]:
        """(mismatches: same route, different bits; route changes of the policy's golden step)."""
        later = [g for g in self.golden if "equal" in g]
        return (sum(not g["equal"] and not g["route_changed"] for g in later),
                sum(g["route_changed"] for g in later))

    # -- samples --------------------------------------------------------------------------

    def sample(self, label: str, at: int, t_soak: float, window: np.ndarray, window_s: float) -> dict:
        torch = self.torch
        torch.cuda.synchronize()
        free, total = torch.cuda.mem_get_info()
        s = self.rt.stats()
        router = self.rt.router
        self.graphs_max = max(self.graphs_max, s["graphs"])
        self.memo_max = max(self.memo_max, len(router._memo))
        mism, changes = self.golden_counts()
        row = dict(case=self.case, engine=self.engine, row="sample", label=label, step=at,
                   t_s=round(t_soak, 3),
                   gpu_allocated=torch.cuda.memory_allocated(), gpu_reserved=torch.cuda.memory_reserved(),
                   gpu_used=total - free, rss=rss_bytes(),
                   **{k: s[k] for k in ("graphs", "max_graphs", "captures", "replays", "evictions",
                                        "invalidations", "regrowths", "staging_copies", "eager_runs",
                                        "plans", "graph_memory_bytes")},
                   capture_seconds=round(s["capture_seconds"], 4),
                   seen_keys=len(getattr(getattr(self.rt, "_seen", None), "_keys", ())),
                   memo=len(router._memo), memo_size=router.memo_size, memo_hits=router.memo_hits,
                   memo_array_bytes=sum(array_bytes(d) for d in router._memo.values()),
                   graphs_max=self.graphs_max, memo_max=self.memo_max, traces=len(self.restarts),
                   golden_mismatches=mism, golden_route_changes=changes,
                   window_steps=int(window.size),
                   steps_per_s=round(window.size / window_s, 1) if window.size and window_s > 0 else None,
                   host_us_median=round(float(np.median(window)) * 1e6, 2) if window.size else None,
                   host_us_p99=round(float(np.percentile(window, 99)) * 1e6, 2) if window.size else None)
        self.samples.append(row)
        print(f"[{label:>7}] step {at:>6}  {row['t_s']:7.1f} s  "
              f"alloc {row['gpu_allocated'] / 2**20:8.1f} MiB  "
              f"reserved {row['gpu_reserved'] / 2**20:8.1f} MiB  rss {(row['rss'] or 0) / 2**20:7.1f} MiB  "
              f"graphs {row['graphs']:>3}  captures {row['captures']:>5}  evict {row['evictions']:>5}  "
              f"memo {row['memo']:>5}  host {row['host_us_median'] or 0:6.1f} us  "
              f"{row['steps_per_s'] or 0:7.0f} steps/s  golden mism {mism}", flush=True)
        return row

    # -- the loop -------------------------------------------------------------------------

    def run(self) -> dict:
        args, rt = self.args, self.rt
        samples_at, golden_at = schedule(args)
        host = np.zeros(args.steps)        # preallocated: the loop grows no Python list per step
        graphs_cache = getattr(rt, "_graphs", None)
        memo = rt.router._memo
        stream = step_stream(args, self.capacity, self.restarts)
        done = w_start = 0
        t_start = w_t = time.perf_counter()
        try:
            self.check_golden(0)
            self.sample("start", 0, 0.0, host[:0], 0.0)
            self.write(0, time.perf_counter() - t_start, host[:0], complete=False)
            w_t = time.perf_counter()
            for i in range(args.steps):
                seq, bt = next(stream)
                b = seq.size
                t0 = time.perf_counter()
                if t0 - t_start > args.max_seconds:
                    self.failures.append(f"stopped at step {done}: --max-seconds {args.max_seconds} reached")
                    break
                d = rt.plan(seq, bt, force=args.force)
                rt.run(self.q[:b], self.k, self.v, out=self.out[:b])
                host[i] = time.perf_counter() - t0
                done = i + 1
                self.routes[d.route] += 1
                self.batches[b] += 1
                if graphs_cache is not None and len(graphs_cache) > self.graphs_max:
                    self.graphs_max = len(graphs_cache)
                if len(memo) > self.memo_max:
                    self.memo_max = len(memo)
                if done in samples_at or done in golden_at:
                    window_s = time.perf_counter() - w_t
                    self.loop_s += window_s
                    if done in golden_at:
                        self.check_golden(done)
                    if done in samples_at:
                        label = "warmup" if done == min(args.warmup, args.steps) else "sample"
                        self.sample(label, done, time.perf_counter() - t_start, host[w_start:done], window_s)
                        self.write(done, time.perf_counter() - t_start, host[:done], complete=False)
                        w_start = done
                    w_t = time.perf_counter()
            if done and self.samples[-1]["step"] != done:      # stopped early by --max-seconds
                window_s = time.perf_counter() - w_t
                self.loop_s += window_s
                self.sample("stopped", done, time.perf_counter() - t_start, host[w_start:done], window_s)
        except Exception as exc:  # noqa: BLE001 - recorded, the run fails
            if done > w_start:
                self.loop_s += time.perf_counter() - w_t
            self.errors.append(dict(step=done, type=type(exc).__name__, message=str(exc),
                                    traceback=traceback.format_exc()))
            print(f"ERROR at step {done}: {type(exc).__name__}: {exc}", file=sys.stderr, flush=True)
            try:
                self.sample("error", done, time.perf_counter() - t_start, host[w_start:done], 0.0)
            except Exception as exc2:  # noqa: BLE001 - e.g. a sticky CUDA error
                self.errors.append(dict(step=done, type=type(exc2).__name__, message=f"final sample: {exc2}"))
        wall = time.perf_counter() - t_start
        return self.write(done, wall, host[:done], complete=True)

    # -- results --------------------------------------------------------------------------

    def summary(self, done: int, wall: float, host: np.ndarray) -> dict:
        args = self.args
        base = next((s for s in self.samples if s["label"] == "warmup"), None)
        last = self.samples[-1] if self.samples else None
        after = [s for s in self.samples if base is not None and s["step"] >= base["step"]]

        def growth(key):
            if base is None or last is None or base[key] is None or last[key] is None:
                return None
            return last[key] - base[key]

        def max_growth(key):
            vals = [s[key] for s in after if s[key] is not None]
            return max(vals) - base[key] if vals and base[key] is not None else None

        mism, changes = self.golden_counts()
        s = self.rt.stats()
        # The router memo keeps each decision with its plan (numpy arrays): RSS grows until it is
        # full, bounded. Growth from the first sample with a full memo isolates anything else.
        full = next((x for x in after if x["memo_size"] and x["memo"] >= x["memo_size"]), None)
        since_full = {k: (last[k] - full[k] if full and last[k] is not None and full[k] is not None else None)
                      for k in ("rss", "gpu_allocated")}
        return dict(
            case=self.case, engine=self.engine, row="summary",
            steps=done, steps_requested=args.steps, wall_s=round(wall, 2),
            host_us_median=round(float(np.median(host)) * 1e6, 2) if host.size else None,
            host_us_p99=round(float(np.percentile(host, 99)) * 1e6, 2) if host.size else None,
            steps_per_s=round(done / self.loop_s, 1) if done and self.loop_s > 0 else None,
            warmup_step=base["step"] if base else None,
            gpu_allocated_growth=growth("gpu_allocated"),
            gpu_allocated_max_growth=max_growth("gpu_allocated"),
            gpu_reserved_growth=growth("gpu_reserved"), gpu_used_growth=growth("gpu_used"),
            rss_growth=growth("rss"), rss_max_growth=max_growth("rss"),
            memo_full_step=full["step"] if full else None, rss_growth_since_memo_full=since_full["rss"],
            gpu_allocated_growth_since_memo_full=since_full["gpu_allocated"],
            graphs_max=self.graphs_max, max_graphs=s["max_graphs"], captures=s["captures"],
            replays=s["replays"], evictions=s["evictions"], invalidations=s["invalidations"],
            regrowths=s["regrowths"], eager_runs=s["eager_runs"],
            capture_seconds=round(s["capture_seconds"], 3),
            memo_max=self.memo_max, memo_size=self.rt.router.memo_size, memo_hits=self.rt.router.memo_hits,
            traces=len(self.restarts), golden_checks=len(self.golden), golden_mismatches=mism,
            golden_route_changes=changes, errors=len(self.errors),
            routes=", ".join(f"{k} {v}" for k, v in self.routes.most_common()),
            batch_sizes=", ".join(f"B{k}:{v}" for k, v in sorted(self.batches.items())))

    def verdict(self, summ: dict) -> list[str]:
        args, why = self.args, list(self.failures)
        why += [f"exception at step {e['step']}: {e['type']}: {e['message']}" for e in self.errors]
        if summ["steps"] < args.steps:
            why.append(f"ran {summ['steps']} of {args.steps} steps")
        if summ["golden_mismatches"]:
            why.append(f"{summ['golden_mismatches']} golden outputs differ from the first (same route)")
        if summ["graphs_max"] > summ["max_graphs"]:
            why.append(f"graphs alive reached {summ['graphs_max']} > max_graphs {summ['max_graphs']}")
        if self.rt.router.memo_size and summ["memo_max"] > summ["memo_size"]:
            why.append(f"router memo reached {summ['memo_max']} > {summ['memo_size']}")
        if args.max_growth_mib is not None:
            for key in ("gpu_allocated_growth", "rss_growth"):
                if summ[key] is not None and summ[key] > args.max_growth_mib * 2**20:
                    why.append(f"{key} {summ[key]} B > --max-growth-mib {args.max_growth_mib}")
        return why

    def write(self, done: int, wall: float, host: np.ndarray, *, complete: bool) -> dict:
        from pkvrt.measure import results

        args, sh = self.args, self.shape
        summ = self.summary(done, wall, host)
        why = self.verdict(summ) if complete else []
        meta = results.make_meta(
            seeds=self.restarts[:1], routes_path=self.registry.path, calibration_path=self.cal.source,
            kind="soak", complete=complete, passed=(not why) if complete else None, failures=why,
            trace=args.trace, trace_seeds=[self.restarts[0], self.restarts[-1]] if self.restarts else [],
            num_requests=self.num_requests, max_context=args.max_context, hole_fraction=args.hole_fraction,
            max_active=args.max_active, force=args.force, shape=attrs.asdict(sh),
            steps=args.steps, warmup=args.warmup, sample_every=args.sample_every,
            golden_every=args.golden_every, golden_lens=self.g_seq.tolist(), golden_holes=GOLDEN_HOLES,
            golden_routes=self.golden_routes, golden=self.golden,
            runtime=dict(max_graphs=args.max_graphs, decision_memo=args.decision_memo, validate=args.validate,
                         flashinfer=self.rt.flashinfer_available,
                         flashinfer_cuda_graph=args.flashinfer_cuda_graph,
                         device_planning=args.device_planning,
                         max_pages_per_row=self.rt.max_pages_per_row),
            cache_pages=self.capacity, cache_bytes=self.k.numel() * self.k.element_size() * 2,
            calibration_slug=self.cal.slug, calibration_fallback=self.cal.fallback,
            runtime_stats=self.rt.stats(), route_counts=dict(self.routes),
            batch_counts={str(k): v for k, v in sorted(self.batches.items())}, errors=self.errors,
            explain=self.rt.explain(),
            protocol=("one Runtime, graphs on, one layer per step, caller-owned q/out views; host time = "
                      "rt.plan() + rt.run() without synchronization; samples synchronize first; growth = "
                      "last sample - warm-up sample"))
        results.write_results(args.out, meta, [*self.samples, summ])
        return dict(summary=summ, failures=why)


def print_table(summ: dict, failures: list[str], out: str) -> None:
    from pkvrt.tools.report import md_table

    mib = lambda v: "-" if v is None else f"{v} B ({v / 2**20:+.1f} MiB)"  # noqa: E731
    rows = [("steps", f"{summ['steps']} of {summ['steps_requested']} ({summ['traces']} traces)"),
            ("wall s", f"{summ['wall_s']}"),
            ("host us/step (plan+run)", f"median {summ['host_us_median']}, p99 {summ['host_us_p99']}, "
                                        f"{summ['steps_per_s']} steps/s"),
            ("GPU allocated growth after warm-up", mib(summ["gpu_allocated_growth"])),
            ("GPU reserved / used growth",
             f"{mib(summ['gpu_reserved_growth'])} / {mib(summ['gpu_used_growth'])}"),
            ("RSS growth after warm-up", mib(summ["rss_growth"])),
            ("RSS growth since the router memo filled", f"{mib(summ['rss_growth_since_memo_full'])} "
                                                        f"(full at step {summ['memo_full_step']})"),
            ("graphs max / max_graphs", f"{summ['graphs_max']} / {summ['max_graphs']}"),
            ("captures / evictions / invalidations",
             f"{summ['captures']} / {summ['evictions']} / {summ['invalidations']} "
             f"({summ['capture_seconds']} s capturing)"),
            ("router memo max / size (hits)",
             f"{summ['memo_max']} / {summ['memo_size']} ({summ['memo_hits']})"),
            ("golden checks / mismatches / route changes",
             f"{summ['golden_checks']} / {summ['golden_mismatches']} / {summ['golden_route_changes']}"),
            ("routes", summ["routes"]), ("batch sizes", summ["batch_sizes"]),
            ("errors", str(summ["errors"]))]
    print()
    print(md_table(("soak", "value"), rows, align="ll"))
    print(f"\nwrote {out}")
    print("PASSED" if not failures else "FAILED:\n  " + "\n  ".join(failures))


def main(argv=None) -> int:
    args = parse_args(argv)
    if args.dry_run:
        return dry_run(args)
    import torch

    if not torch.cuda.is_available():
        print("benches/soak.py: no CUDA GPU here; the soak runs on a GPU (try --dry-run for the "
              "router-only replay of the same steps). Nothing was run.", file=sys.stderr)
        return 2
    try:
        soak = Soak(args)
    except Exception as exc:  # noqa: BLE001 - recorded in a results file, then re-raised
        from pkvrt.measure import results

        meta = results.make_meta(kind="soak", complete=True, passed=False,
                                 failures=[f"setup: {type(exc).__name__}: {exc}"],
                                 errors=[dict(step=0, type=type(exc).__name__, message=str(exc),
                                              traceback=traceback.format_exc())])
        results.write_results(args.out, meta, [])
        raise
    print(f"soak: {args.steps} steps of {args.trace} (max_active {args.max_active}, contexts <= "
          f"{args.max_context}), cache {soak.capacity} pages "
          f"({2 * soak.k.numel() * soak.k.element_size() / 2**30:.2f} GiB), golden routes "
          f"{', '.join(soak.golden_routes)}\n{soak.rt.explain().splitlines()[0]}", flush=True)
    res = soak.run()
    print_table(res["summary"], res["failures"], args.out)
    return 1 if res["failures"] else 0


if __name__ == "__main__":
    sys.exit(main())
