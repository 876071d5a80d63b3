"""The serving harness: continuous decode over a trace, FlashInfer against pkvrt, correctness
first, then CUDA-event and wall timing (paper sections 3.6 and 3.9; DESIGN.md "Measurement").

Protocol of one seed (:func:`run_seed`):

1. Trace -> decode steps (``traces.decode_steps``) -> page layout with hole fraction 0
   (``pagetable.build_layout``, seeded by the seed). A trace longer than ``steps_limit`` steps is
   measured on ``steps_limit`` steps spread evenly over the whole trace (:func:`sample_steps`):
   every step is an independent attention call over pages allocated up front, so an even
   sample estimates the whole trace's throughput instead of only its first requests.
2. K/V pages, q and (``--mlp``) the MLP weights are allocated once, random, seeded. When the
   smallest step's KV fits in L2 a few identical cache copies are rotated over the attention
   calls (:func:`cache_copies`), so no engine is timed on an L2-resident cache.
3. Baseline: every FlashInfer decode path (:data:`FI_VARIANTS`, pkvrt/measure/fi_engines.py: the
   CUDA-core, tensor-core and cuDNN wrappers and XQA) is run on ``probe_steps`` steps spread over
   the measured ones, its output checked against the FP32 reference; the fastest by device time
   (per step the least of :data:`PROBE_DEVICE_ROUNDS` passes) is the baseline
   (:func:`choose_baseline`). A path that this FlashInfer lacks, that refuses the
   shape, fails or is wrong is unavailable: printed, and named with the reason in the results
   meta (``baseline_candidates``, :func:`candidate_status`).
4. Per engine: one untimed pass over all measured steps (warms graphs and JIT caches and checks
   correctness on ``check_steps`` sampled steps: vs FlashInfer ``max|e| < 2e-3, mean|e| < 3e-4``
   and vs the FP32 reference on a few rows); an engine that fails is not timed. Then untimed
   passes until one captures no graph (:func:`warm_until_steady`: the Runtime captures a
   per-layer graph on a key's second sighting, a one-time cost per shape).
5. Wall passes, all engines interleaved (:func:`interleaved_wall_passes`): step by step, every
   engine runs the step (an engine that plans on the host first plans the trace's previous step,
   untimed, as a serving loop did; L2 flushed; synchronize; host clock; plan + every layer;
   synchronize; host clock), in an order rotated from step to step and round to round,
   ``wall_rounds`` rounds; an engine's wall time of a step is the median of its rounds (the
   warm-up passes of step 4 plan each step's predecessor too). The GPU machine's host changes
   speed by tens of percent from one second to the next (benches/NOTES.md, host cost), so
   engines timed one after another, as before b8e83eb, compared different host phases;
   interleaved, the wall ratio of two engines compares them on the same step in the same phase.
6. Per engine, a device pass (CUDA events around the same work, queued behind a spin kernel
   that covers the host's enqueue time, so the events measure device work and not host gaps).

Engine protocol (``layers``, ``mlp``): per step plan once, then per layer one attention call,
optionally followed by the seed's gated-MLP tail (``x @ W_gate``, ``x @ W_up``, ``silu * up``,
``@ W_down``; intermediate 11008, hidden ``H_q * D`` = 4096 for the seed shape, fp16). All
layers read one KV cache (rotated over the L2 copies above), not 32 separate caches: 32 caches of
a 32-request 32K trace would need ~140 GB. Every layer still streams its whole KV from HBM
(the step's KV exceeds L2, or copies rotate), so the device work equals that of 32 caches. The
MLP weights are one set shared by all layers (270 MB, far above L2, so equally honest).

FP8 K/V (``kv_dtype="fp8"``): the fp16 caches above, drawn from the same generator,
are quantized to float8_e4m3fn with per-tensor float32 scales (``fp8_scales``: "unit", a plain
cast with scales 1, the default; "amax", amax / 448 by ``reference.quantize_kv``), one scale
tensor pair per layer (all holding the same values, as every layer reads the same cache), and q
and out stay fp16/bf16. pkvrt engines get ``kv_dtype=torch.float8_e4m3fn`` and each layer's
scale tensors on ``run()``; FlashInfer's paths run their FP8-KV kernels with the scales as host
floats (fixed for the run). The check of every engine is against FP32 attention over the
dequantized cache, on every row of a checked step (the FlashInfer output is recorded but not the
yardstick: its FP8 paths may round q or P to FP8), with the fp16 tolerance; a FlashInfer path
also passes when its error against attention over the fp16 values the cache was quantized from
is within ``reference.fp8_error_bound`` (as benches/isolated.py decides its baseline).

Only the engines' ``plan``/``attend`` and :class:`CudaClock` touch CUDA; the loop, the
correctness bookkeeping and the summaries run on any device (the CPU tests drive them).
"""

from __future__ import annotations

import collections
import inspect
import math
import statistics
import time

import attrs
import numpy as np
import torch

from pkvrt import reference
from pkvrt.measure.fi_engines import FI_VARIANTS
from pkvrt.measure.fi_engines import WORKSPACE_BYTES as FI_WORKSPACE_BYTES  # noqa: F401 (calibrate.py)
from pkvrt.measure.pagetable import build_layout
from pkvrt.measure.traces import Step, decode_steps
from pkvrt.policy import planner, sharing

MAX_ERR = 2e-3            # vs FlashInfer and vs the FP32 reference (DESIGN.md)
MEAN_ERR = 3e-4
MLP_INTERMEDIATE = 11008
L2_ROTATE_FACTOR = 3      # rotate copies until the KV touched between reuses is >= 3 x L2
MAX_COPIES = 8
REF_ROWS = 2              # FP32 reference rows per checked step (longest and shortest)
PROBE_DEVICE_ROUNDS = 3   # device passes of the baseline probe; per step the least counts
BASELINE = "flashinfer"
ADAPTIVE = "adaptive"
ADAPTIVE_EAGER = "adaptive-eager"  # the same Runtime with its graphs off: every run() launches
ADAPTIVE_FI_GRAPH = "adaptive-figraph"  # the same Runtime with its FlashInfer route in FlashInfer's graph mode
ADAPTIVE_FI_WRAPPER = "adaptive-fiwrapper"  # the same with FlashInfer's run() at every layer (no direct calls)
ADAPTIVE_DEVICE_TIME = "adaptive-device-time"  # the same with the router weighing device time only
# the Runtime's own routing (no route forced), in each of its modes the RuntimeEngine builds
ADAPTIVE_ENGINES = (ADAPTIVE, ADAPTIVE_EAGER, ADAPTIVE_FI_GRAPH, ADAPTIVE_FI_WRAPPER, ADAPTIVE_DEVICE_TIME)
FI_GRAPH = "flashinfer-graph"   # the Runtime with its FlashInfer route forced (FlashInfer's graph mode)
DEVICE_PLAN = "device-plan"     # the Runtime with device-side planning (lengths stay on the GPU)
STEP_GRAPH = "device-plan-step"  # device planning, the whole step captured as one CUDA graph
STEP_GRAPH_TAIL1 = "device-plan-step-tail1"  # the same with the fused tail in one level (ablation)
HOST_STEP = "host-step"          # host lengths, every layer of a step in one graph per step_key
HOST_STEP_ROUTER = "adaptive-step"  # the same with the router's policy (capture_routing="router")
SHARED_STEP = "shared-step"      # SharedPagesRuntime: host-step that reads shared page runs once
SHARED_DEVICE_STEP = "shared-device-step"  # SharedPagesRuntime on device lengths: device-plan-step
                                           # whose shared prefixes are found on the GPU
ROUTE_VARIANTS = ("flashinfer-cuda", "flashinfer-tc")  # the wrappers the Runtime's FlashInfer route runs
DTYPES = {"float16": torch.float16, "bfloat16": torch.bfloat16}
FP8 = torch.float8_e4m3fn
KV_DTYPES = ("fp16", "fp8")     # --kv-dtype: the cache in q's 16-bit dtype, or float8_e4m3fn
FP8_SCALES = ("unit", "amax")   # --fp8-scales: scales 1 (a cast) or amax / 448, per tensor


# --------------------------------------------------------------------------- configuration

@attrs.frozen
class Shape:
    """The attention shape of a run (seed: 32 / 8 / 128 / page 16 / fp16)."""

    num_qo_heads: int = 32
    num_kv_heads: int = 8
    head_dim: int = 128
    page_size: int = 16
    dtype: str = "float16"

    @property
    def torch_dtype(self) -> torch.dtype:
        return DTYPES[self.dtype]

    @property
    def dtype_bytes(self) -> int:
        return 2

    @property
    def hidden(self) -> int:
        """Width of the MLP tail's input: one attention output row, ``H_q * D``."""
        return self.num_qo_heads * self.head_dim

    @property
    def kv_bytes_per_token(self) -> int:
        """K and V bytes of one token over all KV heads: ``2 * H_kv * D * 2``."""
        return 2 * self.num_kv_heads * self.head_dim * self.dtype_bytes


@attrs.frozen
class ServingConfig:
    """What ``pkvrt bench serving`` runs (see :mod:`pkvrt.tools.bench` for the options)."""

    trace: str
    max_active: int
    seeds: tuple[int, ...]
    engines: tuple[str, ...]
    routes: str | None = None
    calibration: str | None = None
    steps_limit: int = 200
    layers: int = 1
    mlp: bool = False
    mlp_intermediate: int = MLP_INTERMEDIATE
    num_requests: int | None = None
    check_steps: int = 4
    probe_steps: int = 8
    shape: Shape = Shape()
    kv_dtype: str = attrs.field(default="fp16")
    fp8_scales: str = attrs.field(default="unit")
    wall_rounds: int = attrs.field(default=3)
    # True: each timed step planned cold; False (default): its host plan follows an untimed
    # plan of the trace's previous step, as in a serving loop (:func:`timed_step`)
    cold_plans: bool = False

    @wall_rounds.validator
    def _check_wall_rounds(self, attribute, value):
        if isinstance(value, bool) or not isinstance(value, int) or value < 1:
            raise ValueError(f"wall_rounds={value!r}: expected an integer >= 1")

    @kv_dtype.validator
    def _check_kv_dtype(self, attribute, value):
        if value not in KV_DTYPES:
            raise ValueError(f"kv_dtype={value!r}: expected one of {', '.join(KV_DTYPES)}")

    @fp8_scales.validator
    def _check_fp8_scales(self, attribute, value):
        if value not in FP8_SCALES:
            raise ValueError(f"fp8_scales={value!r}: expected one of {', '.join(FP8_SCALES)}")

    @property
    def fp8(self) -> bool:
        return self.kv_dtype == "fp8"


# --------------------------------------------------------------------------- pure helpers

def engine_label(name: str) -> str:
    """Results-file engine name of an ``--engines`` entry: ``adaptive`` -> ``pkvrt-adaptive``,
    a route ``pkv_workqueue`` -> ``pkvrt-workqueue``; FlashInfer variants and ``flashinfer-graph``
    keep their name."""
    if name in FI_VARIANTS or name in (BASELINE, FI_GRAPH):
        return name
    if name in (DEVICE_PLAN, STEP_GRAPH, STEP_GRAPH_TAIL1, HOST_STEP, HOST_STEP_ROUTER, SHARED_STEP,
                SHARED_DEVICE_STEP):
        return "pkvrt-" + name
    base, _, route = name.partition(":")
    if route and base in (DEVICE_PLAN, STEP_GRAPH):   # device-plan-step:pkv_fused
        return f"pkvrt-{base}-" + (route[4:] if route.startswith("pkv_") else route).replace("_", "-")
    return "pkvrt-" + (name[4:] if name.startswith("pkv_") else name).replace("_", "-")


def parse_engines(text: str, route_names) -> tuple[str, ...]:
    """``--engines`` as a tuple: ``flashinfer`` (the baseline, always first, added if absent),
    ``flashinfer-cuda`` / ``flashinfer-tc`` / ``flashinfer-cudnn`` / ``flashinfer-xqa`` (one
    FlashInfer path for the whole run, :data:`FI_VARIANTS`), ``flashinfer-graph``
    (the Runtime with its FlashInfer route forced: FlashInfer's CUDA-graph mode), ``adaptive``,
    ``adaptive-eager`` (the same Runtime with ``RuntimeOptions(use_cuda_graph=False)``: each
    ``run()`` launches its kernels, which programmatic dependent launch chains across layers), ``adaptive-figraph``
    (the same Runtime with ``flashinfer_cuda_graph=True``: its FlashInfer steps replay a graph
    per layer too), ``adaptive-fiwrapper`` (the same Runtime with ``flashinfer_direct_run=False``:
    FlashInfer's own ``run()`` at every layer of its FlashInfer steps, the ablation of the direct
    calls), ``adaptive-device-time`` (the same Runtime with ``router.weigh_host = False``: routes
    chosen by predicted device time alone, the ablation of routes.toml's ``[host_time]``),
    ``device-plan`` (the Runtime with device-side planning, one graph replay per layer),
    ``device-plan-step`` (device planning with the whole step, planning and every layer, captured
    as one CUDA graph, as an engine that captures its decode step runs it), ``device-plan-step-tail1``
    (the same with ``RuntimeOptions(fused_two_level_tail=False)``: the ablation of the fused
    route's two-level tail), either of ``device-plan`` and ``device-plan-step``
    with ``:ROUTE`` (device planning with that workqueue or fused route of routes.toml instead of
    the default one, e.g. ``device-plan-step:pkv_fused``), ``host-step`` (host lengths, every
    layer of the step captured in one graph per ``Runtime.step_key``:
    ``Runtime(engine_capture=True)``), ``adaptive-step`` (the same with the router's policy,
    ``capture_routing="router"``), ``shared-step`` (host-step with ``pkvrt.SharedPagesRuntime``:
    rows that share pages read each shared run once per chunk of rows), ``shared-device-step``
    (device-plan-step with ``pkvrt.SharedPagesRuntime(device_planning=True)``: the shared
    prefixes found on the GPU from the block tables), or a PersistentKV route name of
    routes.toml (that route forced on every step). Duplicates are dropped."""
    names = [n.strip() for n in text.split(",") if n.strip()]
    if not names:
        raise ValueError("--engines: expected a comma-separated list, e.g. flashinfer,adaptive")
    known = tuple(dict.fromkeys((BASELINE, *FI_VARIANTS, FI_GRAPH, *ADAPTIVE_ENGINES,
                                  DEVICE_PLAN, STEP_GRAPH, STEP_GRAPH_TAIL1, HOST_STEP, HOST_STEP_ROUTER, SHARED_STEP,
                                  SHARED_DEVICE_STEP, *route_names)))
    for n in names:
        base, colon, route = n.partition(":")
        if colon and base in (DEVICE_PLAN, STEP_GRAPH):
            if route not in route_names:
                raise ValueError(f"--engines: {n!r}: unknown route {route!r}; expected one of "
                                 f"{', '.join(route_names)}")
        elif n not in known:
            raise ValueError(f"--engines: unknown engine {n!r}; expected one of {', '.join(known)} "
                             f"(device-plan and device-plan-step also take :ROUTE)")
    out = [BASELINE] + [n for n in names if n != BASELINE]
    return tuple(dict.fromkeys(out))


MAX_SEEDS = 10_000   # a bench runs every seed; more than this is a typo, not a plan


def parse_seeds(text: str) -> tuple[int, ...]:
    """``--seeds 20260623,20260624`` or a range ``20260623-20260627`` (inclusive); at most
    :data:`MAX_SEEDS` in all. A ValueError says what is wrong with ``text``; the caller names
    the flag."""
    seeds: list[int] = []
    for part in (p.strip() for p in text.split(",")):
        lo, dash, hi = part.partition("-")
        try:
            a, b = int(lo), int(hi) if dash else int(lo)
        except ValueError:
            raise ValueError(f"{part!r} is not an integer or a range A-B") from None
        if b < a:
            raise ValueError(f"range {part!r} is empty (expected A <= B)")
        if len(seeds) + b - a + 1 > MAX_SEEDS:
            raise ValueError(f"{'range ' if dash else ''}{part!r} makes {len(seeds) + b - a + 1} "
                             f"seeds; expected at most {MAX_SEEDS}")
        seeds.extend(range(a, b + 1))
    return tuple(dict.fromkeys(seeds))


def case_name(trace: str, max_active: int, seed: int | None, *, layers: int = 1,
              mlp: bool = False, group: int = 4, kv_dtype: str = "fp16") -> str:
    """``bimodal-B8-seed20260623``; the engine protocol, a group size other than the seed's
    G = 4 and an FP8 KV cache are part of the name: ``bimodal-B8-L32-mlp-seed20260623``,
    ``bimodal-B8-G8-seed...``, ``bimodal-B8-L32-fp8-seed...`` (so the report never merges FP8
    rows with fp16 ones of the same trace)."""
    proto = "" if layers == 1 and not mlp else f"-L{layers}" + ("-mlp" if mlp else "")
    g = "" if group == 4 else f"-G{group}"
    kv = "" if kv_dtype == "fp16" else f"-{kv_dtype}"
    return f"{trace}-B{max_active}{g}{proto}{kv}" + ("" if seed is None else f"-seed{seed}")


def check_fp8_engines(engines, route_kv_dtypes: dict[str, tuple[str, ...]]) -> None:
    """Refuse ``--engines`` entries that cannot run an FP8 KV cache, naming them:
    ``flashinfer-graph`` (the Runtime does not run FlashInfer over FP8 pages: its decode takes
    the scales as host floats, which a replayed graph cannot re-read) and a forced route
    (``pkv_x`` or ``device-plan[-step]:pkv_x``) whose routes.toml ``kv_dtypes`` lack
    float8_e4m3fn. ``route_kv_dtypes``: route name -> its kv_dtypes."""
    for name in engines:
        if name == FI_GRAPH:
            raise ValueError("--engines flashinfer-graph: with --kv-dtype fp8 the Runtime does not "
                             "run FlashInfer (its FP8 decode takes the scales as host floats, which "
                             "a replayed graph cannot re-read); FlashInfer's FP8 paths are measured "
                             "as the baseline")
        route = name.partition(":")[2] or name
        served = route_kv_dtypes.get(route)
        if served is not None and route != BASELINE and "float8_e4m3fn" not in served:
            raise ValueError(f"--engines {name}: route {route!r} does not serve an FP8 KV cache "
                             f"(kv_dtypes = {list(served)} in routes.toml)")


def sample_steps(total: int, limit: int) -> np.ndarray:
    """Indices of the steps to measure: all of them, or ``limit`` spread evenly (the first, and the
    last when limit >= 2). 320 steps, limit 200 -> 0, 2, 3, 5, ..., 319 (rounded linspace)."""
    if total < 1 or limit < 1:
        raise ValueError(f"sample_steps: expected total >= 1 and limit >= 1, got {total}, {limit}")
    if total <= limit:
        return np.arange(total)
    return np.unique(np.round(np.linspace(0, total - 1, limit)).astype(np.int64))


def check_positions(n: int, k: int) -> tuple[int, ...]:
    """``k`` positions among ``n`` measured steps for the correctness check, evenly spread,
    first and last included (n 200, k 4 -> 0, 66, 133, 199)."""
    if k <= 0:
        return ()
    return tuple(dict.fromkeys(int(round(x)) for x in np.linspace(0, n - 1, min(k, n))))


def cache_copies(min_step_kv_bytes: int, l2_bytes: int, copy_bytes: int, budget_bytes: int) -> int:
    """How many identical KV caches to rotate over the attention calls.

    Enough that the bytes touched between two uses of one copy are at least
    ``L2_ROTATE_FACTOR * l2_bytes``, at most :data:`MAX_COPIES` and what ``budget_bytes`` holds.
    Example (H200, 60 MB L2): a B1 8K step reads 33.6 MB -> ceil(180 / 33.6) = 6 copies; a B8
    bimodal step (~550 MB) -> 1.

    Raises ValueError when not even one copy fits the budget.
    """
    if copy_bytes > budget_bytes:
        raise ValueError(f"the KV cache of this trace needs {copy_bytes / 2**30:.1f} GiB but only "
                         f"{budget_bytes / 2**30:.1f} GiB of device memory is available; use "
                         "fewer requests (--num-requests) or a shorter trace")
    want = math.ceil(L2_ROTATE_FACTOR * l2_bytes / max(1, min_step_kv_bytes))
    return max(1, min(want, MAX_COPIES, budget_bytes // copy_bytes))


def choose_baseline(probe_us: dict[str, float]) -> str:
    """The FlashInfer path with the smallest probe time (ties: the first given). ``probe_us``
    holds the paths that ran; the unavailable ones are named by :func:`candidate_status`."""
    if not probe_us:
        raise ValueError("choose_baseline: no FlashInfer variant could be run")
    return min(probe_us, key=lambda k: probe_us[k])


def candidate_status(labels, probe_us: dict[str, float], failures: dict[str, str]) -> dict[str, str]:
    """Per FlashInfer path of ``labels`` (in that order) whether it competed for the baseline:
    ``"ok"`` when it was probed, else ``"unavailable: "`` and why (its entry in ``failures``,
    e.g. "unavailable: RuntimeError: flashinfer 0.5.3: ... backend='cudnn' ...")."""
    return {label: "ok" if label in probe_us else
            "unavailable: " + failures.get(label, "not probed") for label in labels}


def merge_candidates(per_seed: dict[str, dict]) -> dict[str, str]:
    """One ``baseline_candidates`` for a results file from each seed's (``per_seed[seed]
    ["baseline_candidates"]``): a path's status where every seed agrees, else each seed's,
    "seed 1: ok; seed 2: unavailable: ..."."""
    merged: dict[str, dict[str, str]] = {}
    for seed, info in per_seed.items():
        for label, status in info.get("baseline_candidates", {}).items():
            merged.setdefault(label, {})[seed] = status
    return {label: next(iter(by_seed.values())) if len(set(by_seed.values())) == 1 else
            "; ".join(f"seed {s}: {st}" for s, st in by_seed.items())
            for label, by_seed in merged.items()}


def route_variant(probe_us: dict[str, float]) -> str:
    """The wrapper the Runtime's own FlashInfer route runs (pkvrt/runtime/fi_route.py drives the
    CUDA-core or the tensor-core wrapper, no other path): the faster of the two in the probe,
    the tensor-core one (the Runtime's default) when neither ran."""
    probed = {k: probe_us[k] for k in ROUTE_VARIANTS if k in probe_us}
    return choose_baseline(probed) if probed else "flashinfer-tc"


def errors(out: torch.Tensor, ref: torch.Tensor) -> tuple[float, float]:
    """(max|e|, mean|e|) of ``out - ref`` in float32; NaN anywhere gives NaN (a failure)."""
    e = (out.float() - ref.float()).abs()
    return float(e.max()), float(e.mean())


def within_tolerance(max_e: float, mean_e: float) -> bool:
    """``max|e| < 2e-3 and mean|e| < 3e-4`` (false for NaN)."""
    return bool(max_e < MAX_ERR and mean_e < MEAN_ERR)


def plan_splits(plan) -> list[tuple[int, int]]:
    """(S, rows) of a route plan: per-row S of a workqueue, per-bucket S of a bucket plan;
    [] for FlashInfer (it splits on its own)."""
    if isinstance(plan, planner.WorkqueuePlan):
        s, n = np.unique(plan.num_splits, return_counts=True)
        return list(zip(s.tolist(), n.tolist()))
    if isinstance(plan, planner.BucketPlan):
        return [(b.num_splits, len(b.rows)) for b in plan.buckets]
    return []


@attrs.frozen
class StepRecord:
    """One measured step of one engine. ``splits``: (S, rows) pairs of the step's plan."""

    step: int
    active: int
    max_context: int
    mean_context: float
    route: str
    splits: tuple[tuple[int, int], ...]
    counters: planner.Counters
    wall_us: float
    cuda_us: float


def _mix_text(counter: collections.Counter, total: int) -> str:
    """Counter({'pkv_workqueue': 180, 'flashinfer': 20}), 200 -> "pkv_workqueue 90.0%, flashinfer 10.0%"."""
    return ", ".join(f"{k} {100 * v / total:.1f}%" for k, v in counter.most_common())


def summarize(case: str, engine: str, records: list[StepRecord], **extra) -> dict:
    """The results row of one (case, engine) from its measured steps.

    Throughputs are decode tokens (active rows, summed over steps) per second of summed step time;
    ``median_us`` / ``wall_us`` are medians of the per-step device / wall times, ``mean_*`` the
    means. ``route`` is the route taken most often, ``route_mix`` every route's share of steps,
    ``splits`` the split counts as ``S:row-steps`` (most used first), ``split_main`` the most used
    S (None when no step split). Counters are per-step means (Table 4 columns; MB = 2**20 B,
    ``merge_mb`` counts each partial state once, ``cta_work_per_sm`` over steps that count CTAs).
    """
    if not records:
        raise ValueError(f"summarize: no measured steps for {case} / {engine}")
    n = len(records)
    tokens = sum(r.active for r in records)
    wall = [r.wall_us for r in records]
    cuda = [r.cuda_us for r in records]
    routes = collections.Counter(r.route for r in records)
    splits: collections.Counter = collections.Counter()
    for r in records:
        for s, rows in r.splits:
            splits[s] += rows
    counted = [r.counters.cta_work_per_sm for r in records if r.counters.decode_ctas > 0]
    top = sorted(splits.items(), key=lambda x: (-x[1], x[0]))
    return {
        "case": case, "engine": engine, "row": "measured", **extra,
        "steps": n, "decode_tokens": tokens,
        "median_us": statistics.median(cuda), "mean_cuda_us": sum(cuda) / n,
        "wall_us": statistics.median(wall), "mean_wall_us": sum(wall) / n,
        "tok_per_s": tokens / (sum(wall) * 1e-6), "cuda_tok_per_s": tokens / (sum(cuda) * 1e-6),
        "route": routes.most_common(1)[0][0], "route_mix": _mix_text(routes, n),
        "splits": ", ".join(f"{s}:{c}" for s, c in top) or "-",
        "split_main": top[0][0] if top else None,
        "launches_per_step": sum(r.counters.launches for r in records) / n,
        "cta_work_per_sm": sum(counted) / len(counted) if counted else None,
        "useful_kv_mb": sum(r.counters.useful_kv_bytes for r in records) / n / 2**20,
        "merge_mb": sum(r.counters.merge_bytes for r in records) / 2 / n / 2**20,
        "merge_launches": sum(r.counters.merge_launches for r in records) / n,
        "mean_active": tokens / n,
    }


def ratio_rows(rows: list[dict]) -> list[dict]:
    """Per case, one ratio row per measured non-baseline engine against the case's baseline row
    (``baseline: true``): ``cuda_ratio`` and ``wall_ratio`` are throughput ratios (engine over
    baseline; > 1 means the engine is faster). Engines that failed correctness get none."""
    out = []
    base = {r["case"]: r for r in rows
            if r.get("baseline") and r.get("row") == "measured" and "tok_per_s" in r}
    for r in rows:
        b = base.get(r["case"])
        if b is None or r is b or r.get("row") != "measured" or "tok_per_s" not in r:
            continue
        out.append({"case": r["case"], "engine": f"{r['engine']} / {b['engine']}", "row": "ratio",
                    "numerator": r["engine"], "baseline_engine": b["engine"],
                    "cuda_ratio": r["cuda_tok_per_s"] / b["cuda_tok_per_s"],
                    "wall_ratio": r["tok_per_s"] / b["tok_per_s"],
                    "route": r.get("route"), "split_main": r.get("split_main")})
    return out


def step_rows(case: str, engine: str, seed: int, records: list[StepRecord], *,
              baseline: bool = False) -> list[dict]:
    """Flat per-step records for the ``.steps.json`` file (the report's plots)."""
    return [{"case": case, "engine": engine, "seed": seed, "baseline": baseline, "step": r.step,
             "active": r.active,
             "max_context": r.max_context, "mean_context": round(r.mean_context, 1),
             "route": r.route, "split_max": max((s for s, _ in r.splits), default=None),
             "wall_us": round(r.wall_us, 2), "cuda_us": round(r.cuda_us, 2)} for r in records]


# --------------------------------------------------------------------------- clocks

class HostClock:
    """Host-only timing (CPU tests): device time is the wall time of the step."""

    def sync(self) -> None:
        pass

    def start(self, cover_us: float):
        return time.perf_counter()

    def flush_l2(self) -> None:
        pass

    def stop(self, token) -> float:
        return (time.perf_counter() - token) * 1e6


class CudaClock:
    """CUDA-event timing of queued device work.

    ``start(cover_us)`` first enqueues a spin kernel (``torch.cuda._sleep``) of about ``cover_us``
    so that the GPU is still busy while the host enqueues the step; the start event then fires
    only when the spin ends, and the events bracket the step's device work without host gaps.
    """

    def __init__(self):
        self.cycles_per_us = self._cycles_per_us()
        self._flush = None   # flush_l2's buffer, twice the L2 (allocated on first use)

    @staticmethod
    def _cycles_per_us() -> float:
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        torch.cuda._sleep(1_000_000)   # warm up
        a.record()
        torch.cuda._sleep(10_000_000)
        b.record()
        b.synchronize()
        return 10_000_000 / (a.elapsed_time(b) * 1e3)

    def sync(self) -> None:
        torch.cuda.synchronize()

    def flush_l2(self) -> None:
        """Evict the step's KV from L2: write a buffer of twice its size (device work, before a
        timed step's clock starts)."""
        if self._flush is None:
            l2 = torch.cuda.get_device_properties(torch.cuda.current_device()).L2_cache_size
            self._flush = torch.empty(2 * max(l2, 2**20), dtype=torch.uint8, device="cuda")
        self._flush.zero_()

    def start(self, cover_us: float):
        torch.cuda._sleep(int(cover_us * self.cycles_per_us))
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        a.record()
        return a, b

    def stop(self, token) -> float:
        a, b = token
        b.record()
        b.synchronize()
        return a.elapsed_time(b) * 1e3


def median_us(fn, calls_per_fn: int = 1, repeats: int = 30, *, graph=None) -> float:
    """CUDA-event median per call of a CUDA graph that runs ``fn`` once (``fn`` makes
    ``calls_per_fn`` calls): warm-up on a side stream, capture, 3 untimed replays, ``repeats``
    timed ones (the protocol of benches/isolated.py). ``graph``: time this captured graph
    instead of capturing ``fn`` (a caller that checked what a replay of it writes)."""
    from pkvrt.runtime import graphs

    g = graph if graph is not None else graphs.capture(fn).graph
    for _ in range(3):
        g.replay()
    times = []
    for _ in range(repeats):
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        a.record()
        g.replay()
        b.record()
        b.synchronize()
        times.append(a.elapsed_time(b) * 1e3 / calls_per_fn)
    return statistics.median(times)


# --------------------------------------------------------------------------- workload

class Workload:
    """Everything allocated once per seed: steps, page layout, K/V copies, q, MLP weights.

    k[c], v[c]: [num_pages, H_kv, page_size, D] (identical copies, ``kv_dtype``); q:
    [max_active, H_q, D] (step with B rows uses ``q[:B]``); w_gate_up: [hidden, 2*inter];
    w_down: [inter, hidden]. FP8 (``config.kv_dtype == "fp8"``): ``k_scales[l]``,
    ``v_scales[l]`` float32 [1] device tensors per layer (same values), ``scale_floats`` the
    same as host floats, and until :meth:`drop_source` the fp16 caches they were quantized from
    (``k_src``, ``v_src``, for the FP8 error bound of :func:`reference_rows`).
    """

    def __init__(self, trace, config: ServingConfig, seed: int, *, device="cuda",
                 l2_bytes: int = 60 * 2**20, budget_bytes: int | None = None):
        sh = config.shape
        self.shape, self.layers, self.mlp, self.device = sh, config.layers, config.mlp, device
        self.trace = trace
        self.fp8 = config.fp8
        self.kv_dtype = FP8 if self.fp8 else sh.torch_dtype
        self.kv_dtype_bytes = self.kv_dtype.itemsize
        all_steps = list(decode_steps(trace, max_active=config.max_active))
        self.steps_total = len(all_steps)
        sampled = sample_steps(len(all_steps), config.steps_limit)
        self.steps: list[Step] = [all_steps[i] for i in sampled]
        # the step a serving loop planned just before each measured one (None: the first step,
        # or config.cold_plans)
        self.previous: list[Step | None] = [
            all_steps[i - 1] if i > 0 and not config.cold_plans else None for i in sampled]
        self.layout = build_layout(trace, page_size=sh.page_size, hole_fraction=0.0, seed=seed)
        pages = self.layout.num_physical_pages
        page_bytes = sh.num_kv_heads * sh.page_size * sh.head_dim * self.kv_dtype_bytes
        copy_bytes = 2 * pages * page_bytes
        # FP8: the fp16 source (2 bytes per element) lives beside the copies until drop_source()
        src_bytes = copy_bytes * sh.dtype_bytes if self.fp8 else 0   # copy_bytes counts 1 B/element
        mlp_bytes = 3 * sh.hidden * config.mlp_intermediate * sh.dtype_bytes if config.mlp else 0
        if budget_bytes is None:
            budget_bytes = int(0.8 * torch.cuda.mem_get_info()[0]) - mlp_bytes
        kv_per_token = 2 * sh.num_kv_heads * sh.head_dim * self.kv_dtype_bytes
        min_kv = min(int(s.seq_lens.astype(np.int64).sum()) for s in self.steps) * kv_per_token
        self.copies = cache_copies(min_kv, l2_bytes, copy_bytes, budget_bytes - src_bytes)
        gen = torch.Generator(device=device)
        gen.manual_seed(seed)
        dt = dict(device=device, dtype=sh.torch_dtype)
        shape4 = (pages, sh.num_kv_heads, sh.page_size, sh.head_dim)
        k0 = torch.randn(shape4, generator=gen, **dt)
        v0 = torch.randn(shape4, generator=gen, **dt)
        self.k_src = self.v_src = self.k_scales = self.v_scales = None
        self.scale_floats = (1.0, 1.0)
        if self.fp8:
            self.k_src, self.v_src = k0, v0
            k0, ks = quantize_fp8(k0, config.fp8_scales)
            v0, vs = quantize_fp8(v0, config.fp8_scales)
            self.scale_floats = (float(ks), float(vs))   # one device read, at set-up
            # one scale tensor pair per layer, as an engine holds them (each is its own graph input)
            self.k_scales = [ks] + [ks.clone() for _ in range(self.layers - 1)]
            self.v_scales = [vs] + [vs.clone() for _ in range(self.layers - 1)]
        self.k = [k0] + [k0.clone() for _ in range(self.copies - 1)]
        self.v = [v0] + [v0.clone() for _ in range(self.copies - 1)]
        self.q = torch.randn((config.max_active, sh.num_qo_heads, sh.head_dim), generator=gen, **dt)
        self.w_gate_up = self.w_down = None
        if config.mlp:
            inter = config.mlp_intermediate
            self.w_gate_up = torch.randn((sh.hidden, 2 * inter), generator=gen, **dt) * 0.02
            self.w_down = torch.randn((inter, sh.hidden), generator=gen, **dt) * 0.02
        self.inter = config.mlp_intermediate

    def cache(self, pos: int, layer: int):
        """(k, v) of the attention call of layer ``layer`` in measured step ``pos``."""
        c = (pos * self.layers + layer) % self.copies
        return self.k[c], self.v[c]

    def scales(self, layer: int) -> dict:
        """``run()``'s scale arguments for layer ``layer``: ``k_scale``, ``v_scale`` (float32 [1]
        device tensors) of an FP8 cache; {} for a 16-bit cache."""
        if not self.fp8:
            return {}
        return dict(k_scale=self.k_scales[layer], v_scale=self.v_scales[layer])

    def drop_source(self) -> None:
        """Free the fp16 caches an FP8 cache was quantized from (after the references are made)."""
        self.k_src = self.v_src = None

    def mlp_tail(self, out: torch.Tensor) -> torch.Tensor:
        """The seed's gated MLP on the attention output. out: [B, H_q, D] -> [B, hidden]."""
        x = out.view(out.shape[0], -1)                           # [B, hidden]
        gate, up = torch.mm(x, self.w_gate_up).split(self.inter, dim=1)
        return torch.mm(torch.nn.functional.silu(gate) * up, self.w_down)


def quantize_fp8(cache: torch.Tensor, mode: str) -> tuple[torch.Tensor, torch.Tensor]:
    """An FP8 copy of a 16-bit cache and its per-tensor float32 scale [1]: ``"unit"`` casts
    (scale 1; N(0, 1) data is far inside e4m3's range, 448), ``"amax"`` divides by amax / 448
    (``reference.quantize_kv``). cache [P, H_kv, page, D]."""
    if mode == "unit":
        return cache.to(FP8), torch.ones(1, dtype=torch.float32, device=cache.device)
    if mode == "amax":
        return reference.quantize_kv(cache, per_head=False)
    raise ValueError(f"fp8_scales={mode!r}: expected one of {', '.join(FP8_SCALES)}")


def run_step(engine, wl: Workload, step: Step, pos: int, out: torch.Tensor) -> None:
    """One decode step of ``engine``: plan once, then attention (+ MLP) for every layer.
    out: [max_active, H_q, D], rows ``:B`` receive the last layer's attention output. An engine
    with its own ``run_step`` (a captured whole step) runs the step itself. FP8: ``attend`` also
    gets the layer's ``k_scale``/``v_scale`` tensors (:meth:`Workload.scales`)."""
    if hasattr(engine, "run_step"):
        engine.run_step(wl, step, pos, out)
        return
    engine.plan(step)
    b = len(step.rids)
    q, o = wl.q[:b], out[:b]
    for layer in range(wl.layers):
        k, v = wl.cache(pos, layer)
        engine.attend(q, k, v, o, **wl.scales(layer))
        if wl.mlp:
            wl.mlp_tail(o)


# --------------------------------------------------------------------------- engines
# (FlashInfer's decode paths, the baseline's candidates, are in pkvrt/measure/fi_engines.py)

RUNTIME_REQUIRED = ("device", "routes", "calibration", "max_batch", "max_pages_per_row",
                    "use_cuda_graph", "kv_dtype")   # kv_dtype: asked for with FP8 caches only
RUNTIME_OPTIONAL = ("max_graphs", "validate", "flashinfer_tensor_cores")


def runtime_kwargs(signature: inspect.Signature, wanted: dict,
                   option_fields=()) -> tuple[dict, tuple[str, ...]]:
    """Split ``wanted`` Runtime keyword arguments into those ``signature`` (of ``Runtime``) or
    its ``RuntimeOptions`` (``option_fields``, given to the Runtime through ``with_options``)
    accept and the optional ones neither does (dropped, recorded in the results). A missing
    required one is an error naming it; a ``**kwargs`` signature without option fields
    accepts everything."""
    params = signature.parameters
    if not option_fields and any(p.kind is inspect.Parameter.VAR_KEYWORD for p in params.values()):
        return dict(wanted), ()
    names = {n for n, p in params.items() if p.kind is not inspect.Parameter.VAR_KEYWORD} | set(option_fields)
    missing = [k for k in RUNTIME_REQUIRED if k in wanted and k not in names]
    if missing:
        raise ValueError(f"pkvrt.runtime.Runtime: expected keyword argument(s) {missing} "
                         "(the interface the harness is written against)")
    kept = {k: v for k, v in wanted.items() if k in names}
    return kept, tuple(k for k in wanted if k not in names)


def graphs_per_layer_key(wl: Workload) -> int:
    """How many distinct (cache copy, scale tensors) inputs the layers of a step read: the copies
    for a 16-bit cache; with FP8 every layer has its own scale tensors, so up to copies * layers.
    The Runtime keeps a graph per input (and per plan structure), so its ``max_graphs`` scales
    with this: 64 per input, else its LRU would evict and re-capture during the timed passes."""
    return wl.copies * (wl.layers if wl.fp8 else 1)


def _runtime_step_info(rt, d, seq, kv_dtype_bytes: int):
    """(route, splits, counters) of a Runtime's last step ``d`` on lengths ``seq``. A
    workqueue/fused plan lives on the GPU (device planning, or host lengths): the host planner's
    identical rule gives its splits and counters (off the timed path); the fused route's merge
    runs in the decode kernel."""
    if d.plan is None:
        make = planner.plan_fused if d.kind == "fused" else planner.plan_workqueue
        p = make(seq, num_kv_heads=rt.num_kv_heads, num_qo_heads=rt.num_qo_heads,
                 head_dim=rt.head_dim, dtype_bytes=kv_dtype_bytes,
                 splits=rt.registry.route(d.route).splits, cal=rt.calibration)
        return d.route, tuple(plan_splits(p)), p.counters
    return d.route, tuple(plan_splits(d.plan)), d.plan.counters


class RuntimeEngine:
    """``pkvrt.Runtime`` with CUDA graphs (``adaptive-eager``: without, each ``run()`` launches
    its kernels): ``plan(seq_lens, block_tables)`` once per step
    (host int32 numpy arrays, its fast path), ``run(q, k, v, out=...)`` per layer. ``force``: a
    route name forced on every step (``Runtime.plan(..., force=name)``), None = adaptive. FP8
    (``wl.fp8``): ``kv_dtype=torch.float8_e4m3fn`` and each layer's scale tensors on ``run()``."""

    def __init__(self, wl: Workload, *, name: str, force: str | None, routes, calibration,
                 max_active: int, tensor_cores: bool):
        self.device_planning = name.partition(":")[0] == DEVICE_PLAN
        self._on_device: dict[int, tuple] = {}
        try:
            from pkvrt.runtime import Runtime
            from pkvrt.runtime.options import FIELDS as option_fields
            from pkvrt.runtime.options import with_options
        except ModuleNotFoundError as e:
            if e.name != "pkvrt.runtime":
                raise
            raise ValueError(f"engine {name!r} needs pkvrt.runtime, which this build does not "
                             "have; run with --engines flashinfer") from None

        sh = wl.shape
        self.label = engine_label(name)
        self.force = force
        self.layout, self.kv_dtype_bytes = wl.layout, wl.kv_dtype_bytes
        wanted = dict(device=wl.device, routes=routes, calibration=calibration,
                      max_batch=max_active, max_pages_per_row=wl.layout.max_pages,
                      use_cuda_graph=name != ADAPTIVE_EAGER,
                      max_graphs=64 * graphs_per_layer_key(wl), validate=False,
                      flashinfer_tensor_cores=tensor_cores,
                      # the flashinfer-graph engine is FlashInfer's CUDA-graph mode by definition
                      flashinfer_cuda_graph=name in (FI_GRAPH, ADAPTIVE_FI_GRAPH),
                      flashinfer_direct_run=name != ADAPTIVE_FI_WRAPPER)
        if self.device_planning:
            wanted.update(device_planning=True, num_pages=wl.k[0].shape[0])
        if wl.fp8:
            wanted.update(kv_dtype=FP8)
        self.kwargs, self.dropped = runtime_kwargs(inspect.signature(Runtime), wanted, option_fields)
        if self.force is not None and "force" not in inspect.signature(Runtime.plan).parameters:
            raise ValueError(f"engine {name!r}: pkvrt.runtime.Runtime.plan has no force= "
                             "argument, so a route cannot be forced")
        self.rt = Runtime(sh.num_qo_heads, sh.num_kv_heads, sh.head_dim, sh.page_size,
                          sh.torch_dtype, **with_options(self.kwargs))
        if name == ADAPTIVE_DEVICE_TIME:
            self.rt.router.weigh_host = False   # device time only: the routing before [host_time]
        self.decision = None

    def plan(self, step: Step) -> None:
        self._last_seq = step.seq_lens
        if self.device_planning:
            self.decision = self.rt.plan(*self._device_inputs(step), force=self.force)
            return
        bt = self.layout.block_table(step.rids)
        if self.force is None:
            self.decision = self.rt.plan(step.seq_lens, bt)
        else:
            self.decision = self.rt.plan(step.seq_lens, bt, force=self.force)

    def _device_inputs(self, step: Step):
        """The step's lengths and block table as int32 tensors on the GPU, as an engine whose
        scheduler keeps them there has them: uploaded the first time a step is seen (the
        untimed warm-up pass), reused by the timed passes."""
        key = id(step)
        if key not in self._on_device:
            dev, seq = self.rt.device, np.asarray(step.seq_lens, dtype=np.int32)
            cols = -(-int(seq.max()) // self.rt.page_size)   # only the columns the step uses
            bt = np.ascontiguousarray(self.layout.block_table(step.rids)[:, :cols], dtype=np.int32)
            self._on_device[key] = (torch.as_tensor(seq, device=dev), torch.as_tensor(bt, device=dev),
                                    step)   # step kept alive: its id stays unique
        return self._on_device[key][:2]

    def attend(self, q, k_cache, v_cache, out, **scales) -> None:
        # scales: k_scale, v_scale of an FP8 cache (this layer's tensors), else none
        self.rt.run(q, k_cache, v_cache, out=out, **scales)

    def step_info(self):
        return _runtime_step_info(self.rt, self.decision, self._last_seq, self.kv_dtype_bytes)

    def _init_captured(self, wl: Workload, *, name: str, force: str | None, routes, calibration,
                       max_active: int, **runtime_kw) -> None:
        """The fields and Runtime of an engine whose steps are captured whole (the step-graph
        engines): no host validation, ``num_pages`` of the workload's caches, FP8 when the
        workload is; ``runtime_kw`` picks the mode (device planning or engine_capture)."""
        from pkvrt.runtime import Runtime
        from pkvrt.runtime.options import with_options

        sh = wl.shape
        self.device_planning = bool(runtime_kw.get("device_planning", False))
        self.force, self.label = force, engine_label(name)
        self._on_device: dict[int, tuple] = {}
        self.layout, self.dropped, self.kv_dtype_bytes = wl.layout, (), wl.kv_dtype_bytes
        fp8 = dict(kv_dtype=FP8) if wl.fp8 else {}
        self.rt = Runtime(sh.num_qo_heads, sh.num_kv_heads, sh.head_dim, sh.page_size, sh.torch_dtype,
                          device=wl.device, routes=routes, calibration=calibration,
                          max_batch=max_active, max_pages_per_row=wl.layout.max_pages,
                          num_pages=wl.k[0].shape[0], **with_options(dict(fp8, **runtime_kw), validate=False))

    def stats(self) -> dict:
        """Scalar entries of ``Runtime.stats()``, those of a nested dict as ``key_subkey`` (the
        FlashInfer route's ``flashinfer_direct_calls``, ...), and which harness kwargs it did not
        accept."""
        s = self.rt.stats() if hasattr(self.rt, "stats") else {}
        scalar = (int, float, str, bool)
        out = {k: v for k, v in s.items() if isinstance(v, scalar)}
        out.update({f"{k}_{kk}": vv for k, v in s.items() if isinstance(v, dict)
                    for kk, vv in v.items() if isinstance(vv, scalar)})
        if self.dropped:
            out["kwargs_not_accepted"] = ",".join(self.dropped)
        return out


def capture_layers(rt, wl: Workload, b: int, phase: int, out: torch.Tensor,
                   plan=None) -> torch.cuda.CUDAGraph:
    """One CUDA graph of a step of ``b`` rows: ``plan()`` if given (device planning captures it),
    then every layer's ``rt.run()`` on the cache copies of ``phase`` (and the MLP tail with
    ``mlp``), writing ``out[:b]``; warmed up once, then captured (``graphs.capture``)."""
    q, o = wl.q[:b], out[:b]

    def body():
        if plan is not None:
            plan()
        for layer in range(wl.layers):
            c = (phase + layer) % wl.copies
            rt.run(q, wl.k[c], wl.v[c], out=o, **wl.scales(layer))
            if wl.mlp:
                wl.mlp_tail(o)

    from pkvrt.runtime import graphs  # the Runtime's warm-up-then-capture, with its empty-graph check

    return graphs.capture(body, side_stream=torch.cuda.Stream(), pool=None, device=wl.device).graph


class StepGraphEngine(RuntimeEngine):
    """``pkvrt.Runtime(device_planning=True)``, graphs off (``RuntimeOptions(use_cuda_graph=
    False)``), with the whole decode step captured as one CUDA graph, as an engine that captures its decode step runs it
    (``examples/engine_graph.py``): per step, the step's lengths and block-table rows are copied
    into static device buffers, then the graph of (plan + every layer's attention, and the MLP
    tail with ``mlp``) for this batch size and cache phase is replayed. A graph is captured the
    first time its (batch, phase) is seen (the untimed pass). The phase is the first cache copy
    the step reads, ``pos * layers % copies``: the graph bakes in which copy each layer reads
    (and, FP8, each layer's scale tensors, whose values the kernels read at replay)."""

    def __init__(self, wl: Workload, *, name: str, routes, calibration, max_active: int,
                 force: str | None = None):
        self._init_captured(wl, name=name, force=force, routes=routes, calibration=calibration,
                            max_active=max_active, use_cuda_graph=False, device_planning=True,
                            fused_two_level_tail=name != STEP_GRAPH_TAIL1)
        i32 = dict(dtype=torch.int32, device=wl.device)
        self.seq = torch.ones(max_active, **i32)
        self.bt = torch.zeros(max_active, wl.layout.max_pages, **i32)
        self.graphs: dict[tuple[int, int], torch.cuda.CUDAGraph] = {}
        self.decisions: dict = {}   # batch size -> the RouteDecision its graphs' plan() made
        self.decision = None

    def run_step(self, wl: Workload, step: Step, pos: int, out: torch.Tensor) -> None:
        b = len(step.rids)
        seq, bt = self._device_inputs(step)
        self.seq[:b].copy_(seq)
        self.bt[:b, :bt.shape[1]].copy_(bt)
        self._last_seq = step.seq_lens
        phase = pos * wl.layers % wl.copies
        g = self.graphs.get((b, phase))
        if g is None:
            g = self.graphs[(b, phase)] = self._capture(wl, b, phase, out)
            self.decisions[b] = self.rt.last_decision   # the route the graph's plan() chose
        g.replay()
        # the Runtime's last_decision is of the last graph captured, whatever its batch size: the
        # route of this step is its own graph's (the route depends on the row count only)
        self.decision = self.decisions[b]

    def _capture(self, wl: Workload, b: int, phase: int, out: torch.Tensor) -> torch.cuda.CUDAGraph:
        return capture_layers(self.rt, wl, b, phase, out,
                              plan=lambda: self.rt.plan(self.seq[:b], self.bt[:b], force=self.force))

    def stats(self) -> dict:
        return {"step_graphs": len(self.graphs)}


class HostStepGraphEngine(RuntimeEngine):
    """``pkvrt.Runtime(engine_capture=True)``: host lengths with the step's layers captured as
    one CUDA graph, as an engine that captures its decode step and keeps lengths on the host runs
    it (``examples/engine_graph.py --host-routing``). Per step: ``plan(seq_lens, block_tables)``
    on the host (the route: routes.toml's ``[device_planning]`` one, or with ``routing="router"``
    the router's; one copy, or FlashInfer's plan), then the graph of (every layer's ``run()``,
    the first one with the planning kernel of a workqueue/fused step, and the MLP tail with
    ``mlp``) for (``Runtime.step_key``, cache phase) is replayed; captured the first time that
    pair is seen (the untimed pass). The phase is as in :class:`StepGraphEngine`."""

    def __init__(self, wl: Workload, *, name: str, routes, calibration, max_active: int,
                 tensor_cores: bool, routing: str = "device_planning"):
        self._init_captured(wl, name=name, force=None, routes=routes, calibration=calibration,
                            max_active=max_active, engine_capture=True, capture_routing=routing,
                            flashinfer_tensor_cores=tensor_cores)
        self.graphs: dict[tuple, torch.cuda.CUDAGraph] = {}
        self.decision = None

    def run_step(self, wl: Workload, step: Step, pos: int, out: torch.Tensor) -> None:
        self.plan(step)
        b, phase = len(step.rids), pos * wl.layers % wl.copies
        key = (self.rt.step_key, b, phase)
        g = self.graphs.get(key)
        if g is None:
            g = self.graphs[key] = self._capture(wl, b, phase, out)
        g.replay()

    def _capture(self, wl: Workload, b: int, phase: int, out: torch.Tensor) -> torch.cuda.CUDAGraph:
        return capture_layers(self.rt, wl, b, phase, out)

    def stats(self) -> dict:
        out = super().stats()
        out["step_graphs"] = len(self.graphs)
        return out


def _init_shared(engine, wl: Workload, *, name: str, routes, calibration, max_active: int, **mode) -> None:
    """The fields and ``pkvrt.SharedPagesRuntime`` of a shared-pages engine (``mode``: its
    engine_capture or device_planning, and options): ``num_pages`` of the workload's caches,
    FP8 when the workload is."""
    from pkvrt.runtime.shared import SharedPagesRuntime

    sh = wl.shape
    engine.device_planning, engine.force = bool(mode.get("device_planning")), None
    engine.label, engine._on_device = engine_label(name), {}
    engine.layout, engine.dropped, engine.kv_dtype_bytes = wl.layout, (), wl.kv_dtype_bytes
    fp8 = dict(kv_dtype=FP8) if wl.fp8 else {}
    engine.rt = SharedPagesRuntime(
        sh.num_qo_heads, sh.num_kv_heads, sh.head_dim, sh.page_size, sh.torch_dtype,
        num_pages=wl.k[0].shape[0], device=wl.device, routes=routes, calibration=calibration,
        max_batch=max_active, max_pages_per_row=wl.layout.max_pages, **fp8, **mode)


class SharedStepGraphEngine(HostStepGraphEngine):
    """``pkvrt.SharedPagesRuntime(engine_capture=True)``: :class:`HostStepGraphEngine` for steps
    whose rows may share pages (a trace with prefix hashes, served with prefix caching:
    ``pagetable.build_layout``). Per step ``plan(seq_lens, block_tables)`` finds the shared page
    runs from the block tables themselves; steps with sharing run the chunk decode, the own
    decode and the merge, the others the plain Runtime's route; the graph of every layer is
    captured per (``step_key``, batch, cache phase), the first time it is seen. The route
    recorded for a step with sharing is ``shared-pages``, its counters the K/V bytes of the pages
    the plan reads (each shared run once per chunk)."""

    SHARED_ROUTE = "shared-pages"

    def __init__(self, wl: Workload, *, name: str, routes, calibration, max_active: int,
                 tensor_cores: bool):
        from pkvrt.runtime.options import RuntimeOptions

        _init_shared(self, wl, name=name, routes=routes, calibration=calibration,
                     max_active=max_active, engine_capture=True,
                     options=RuntimeOptions(validate=False, flashinfer_tensor_cores=tensor_cores))
        self.graphs: dict[tuple, torch.cuda.CUDAGraph] = {}
        self.decision = None

    def step_info(self):
        sp, sh = self.rt.plan_used, self.rt
        if sp is None:   # no sharing this step: the plain Runtime's route, as host-step records it
            return _runtime_step_info(sh.plain, self.decision, self._last_seq, self.kv_dtype_bytes)
        # the tokens the plan reads: each shared run once per chunk, each own segment once
        tokens = int(sp.chunk_seq.sum()) + int(sp.own_seq.sum())
        kv = tokens * 2 * sh.num_kv_heads * sh.head_dim * self.kv_dtype_bytes
        # the two query gathers (one where the own decode reads q itself), the merge, and each
        # decode's launches (fused: 1, else with its merge)
        launches = (2 if sh._own_identity else 3) + sum(
            1 if rt.last_decision.kind == "fused" else 2 for rt in (sh.shared, sh.own))
        return self.SHARED_ROUTE, (), planner.Counters(
            launches=launches, decode_ctas=0, cta_work_per_sm=0.0, useful_kv_bytes=int(kv),
            merge_bytes=0, merge_launches=1)

    def stats(self) -> dict:
        """The plain, chunk and own Runtimes' scalar stats (``plain_*``, ``shared_*``,
        ``own_*``) and the step graphs."""
        out = {"step_graphs": len(self.graphs)}
        for name in ("plain", "shared", "own"):
            rt = getattr(self.rt, name)
            if rt is not None and (name == "plain" or rt is not self.rt.plain):
                out.update({f"{name}_{k}": v for k, v in rt.stats().items()
                            if isinstance(v, (int, float, str, bool))})
        return out


class SharedDeviceStepEngine(StepGraphEngine):
    """``pkvrt.SharedPagesRuntime(device_planning=True)``, graphs off: :class:`StepGraphEngine`
    (the step's lengths and block tables in static device buffers, the whole step captured per
    (batch, phase)) for steps whose rows may share pages. The graph holds the detection
    (kernels/find_shared.cu), both decodes' planning and every layer's query gather, chunk
    decode, own decode and merge, so it replays whatever the step shares. The route recorded is
    ``shared-pages-device``; its counters are the K/V bytes of what the GPU's rule reads (the
    twin, ``sharing.plan_prefix_chunks`` with the Runtime's ``device_rule``, computed off the
    timed path)."""

    SHARED_ROUTE = "shared-pages-device"

    def __init__(self, wl: Workload, *, name: str, routes, calibration, max_active: int):
        from pkvrt.runtime.options import RuntimeOptions

        _init_shared(self, wl, name=name, routes=routes, calibration=calibration,
                     max_active=max_active, device_planning=True,
                     options=RuntimeOptions(validate=False, use_cuda_graph=False))
        i32 = dict(dtype=torch.int32, device=wl.device)
        self.seq = torch.ones(max_active, **i32)
        self.bt = torch.zeros(max_active, wl.layout.max_pages, **i32)
        self.graphs: dict[tuple[int, int], torch.cuda.CUDAGraph] = {}
        self.decisions: dict = {}
        self.decision = None

    def run_step(self, wl: Workload, step: Step, pos: int, out: torch.Tensor) -> None:
        super().run_step(wl, step, pos, out)
        self._last_bt = self.layout.block_table(step.rids)

    def _capture(self, wl: Workload, b: int, phase: int, out: torch.Tensor) -> torch.cuda.CUDAGraph:
        # the whole block-table width: find_shared's buffers keep one width, so one generation
        return capture_layers(self.rt, wl, b, phase, out,
                              plan=lambda: self.rt.plan(self.seq[:b], self.bt[:b]))

    def step_info(self):
        sh = self.rt
        if sh.shared is None:   # G above 8: the plain device-planning Runtime's route
            return _runtime_step_info(sh.plain, self.decision, self._last_seq, self.kv_dtype_bytes)
        seq = np.asarray(self._last_seq, np.int64)
        found = sharing.plan_prefix_chunks(seq, self._last_bt[:, :self.bt.shape[1]],
                                           sh.page_size, sh.chunk, rule=sh.device_rule(len(seq)))
        tokens = int(found.chunk_seq.sum()) + int(found.own_seq.sum())
        kv = tokens * 2 * sh.num_kv_heads * sh.head_dim * self.kv_dtype_bytes
        # per layer: the query gather, the two decodes (fused: one launch each), the merge
        launches = 2 + sum(1 if rt.last_decision.kind == "fused" else 2 for rt in (sh.shared, sh.own))
        return self.SHARED_ROUTE, (), planner.Counters(
            launches=launches, decode_ctas=0, cta_work_per_sm=0.0, useful_kv_bytes=int(kv),
            merge_bytes=0, merge_launches=1)

    def stats(self) -> dict:
        return {"step_graphs": len(self.graphs)}


# --------------------------------------------------------------------------- passes

def untimed_pass(engine, wl: Workload, steps: list[Step], out: torch.Tensor, clock,
                 keep: tuple[int, ...] = (), previous: list | None = None) -> dict[int, torch.Tensor]:
    """Run every step once (warm-up); returns clones of ``out[:B]`` at positions ``keep``.
    ``previous``: as in :func:`interleaved_wall_passes` (each step after its predecessor's
    plan, so whatever that order first does, a buffer grown or a graph captured, happens here
    and not in a timed pass)."""
    kept = {}
    for pos, step in enumerate(steps):
        if previous is not None and previous[pos] is not None and plans_on_host(engine):
            engine.plan(previous[pos])
        run_step(engine, wl, step, pos, out)
        if pos in keep:
            clock.sync()
            kept[pos] = out[:len(step.rids)].clone()
    clock.sync()
    return kept


WARM_PASSES_MAX = 3   # untimed passes after the correctness pass, at most


def graphs_captured(engine) -> int:
    """Graphs the engine has captured so far (per-layer graphs and whole-step graphs; 0 for an
    engine that reports neither, e.g. FlashInfer's)."""
    s = engine.stats() if hasattr(engine, "stats") else {}
    return sum(int(s.get(k, 0)) for k in ("captures", "step_graphs"))


def warm_until_steady(engine, wl: Workload, out: torch.Tensor, clock) -> int:
    """Untimed passes until one captures no graph (at most :data:`WARM_PASSES_MAX`); returns the
    passes run. The Runtime captures a per-layer graph the second time it sees a key
    (``graphs.SeenKeys``), so after the correctness pass the first timed pass would capture every
    key again, ~1 ms each: a one-layer adaptive run of 2026-12-02 had 4 such captures in 32 timed
    steps (mean wall 506 us against a median of 281, benches/NOTES.md). Capture is a
    one-time cost per shape, not a per-step one; the timed passes measure the steady state and
    still record any capture left in them (``rt_captures_timed``). FP8 layers have their own
    scale tensors, so their own graphs: the same rule covers them. Each step follows its
    predecessor's plan, as in the wall passes (:attr:`Workload.previous`)."""
    for n in range(1, WARM_PASSES_MAX + 1):
        before = graphs_captured(engine)
        untimed_pass(engine, wl, wl.steps, out, clock, previous=wl.previous)
        if graphs_captured(engine) == before:
            return n
    return WARM_PASSES_MAX


def wall_pass(engine, wl: Workload, steps: list[Step], out: torch.Tensor, clock):
    """Synchronized wall µs per step, and each step's (route, splits, counters)."""
    walls, infos = [], []
    for pos, step in enumerate(steps):
        walls.append(timed_step(engine, wl, step, pos, out, clock))
        infos.append(engine.step_info())
    return walls, infos


def timed_step(engine, wl: Workload, step: Step, pos: int, out: torch.Tensor, clock,
               flush_l2: bool = False, previous: Step | None = None) -> float:
    """Wall µs of one step of ``engine`` from an idle GPU to its end (synchronized both sides);
    ``flush_l2``: L2 evicted first (``clock.flush_l2``, untimed). ``previous``: the trace's step
    before this one, planned first (untimed) by an engine that plans on the host, so that what
    its planning remembers from step to step (the sharing runs' memo, a route memo) is as a
    serving loop leaves it: a step that shares what its predecessor shared finds it there, as
    consecutive decode steps do, while the measured steps, sampled far apart, would each
    find a memo filled by other steps."""
    if previous is not None and plans_on_host(engine):
        engine.plan(previous)
    if flush_l2:
        clock.flush_l2()
    clock.sync()
    t0 = time.perf_counter()
    run_step(engine, wl, step, pos, out)
    clock.sync()
    return (time.perf_counter() - t0) * 1e6


def plans_on_host(engine) -> bool:
    """Whether a step of ``engine`` begins with a plan() on the host from host lengths (the
    Runtime engines of host lengths; FlashInfer's wrappers, and its XQA engine, whose plan()
    stages the step's lengths and tables): what :func:`timed_step` primes. Engines of device
    lengths plan on the GPU, inside their step."""
    return hasattr(engine, "plan") and not getattr(engine, "device_planning", False)


def interleaved_wall_passes(engines: list, wl: Workload, steps: list[Step], out: torch.Tensor,
                            clock, rounds: int, previous: list | None = None
                            ) -> list[tuple[list[float], list]]:
    """Wall passes of several engines interleaved step by step: at step ``pos`` of round ``r``
    the engines run that step in the order rotated by ``pos + r``. Per engine: the median over
    the rounds of its wall µs per step, and each step's (route, splits, counters) from the
    first round (as :func:`wall_pass` returns them). Every engine sees the steps in order in
    each round, as in a wall pass of its own; the engines share ``out``, which only times. The
    engines of a step read the same cache copies (:meth:`Workload.cache` is a function of the
    step and layer), so L2 is flushed before each timed step: no engine runs on the KV the one
    before it left in L2 (at one layer a step's copy would otherwise be read twice in a row).
    ``previous[pos]`` (:attr:`Workload.previous`): the step a serving loop planned before step
    ``pos``, planned untimed first by each engine that plans on the host (:func:`timed_step`)."""
    n = len(engines)
    walls = [[[] for _ in steps] for _ in engines]
    infos: list[list] = [[None] * len(steps) for _ in engines]
    for r in range(rounds):
        for pos, step in enumerate(steps):
            for k in range(n):
                i = (pos + r + k) % n
                walls[i][pos].append(timed_step(engines[i], wl, step, pos, out, clock, flush_l2=True,
                                                previous=None if previous is None else previous[pos]))
                if r == 0:
                    infos[i][pos] = engines[i].step_info()
    return [([statistics.median(w) for w in walls[i]], infos[i]) for i in range(n)]


def device_pass(engine, wl: Workload, steps: list[Step], out: torch.Tensor, clock,
                cover_us: list[float]) -> tuple[list[float], int]:
    """Device µs per step (see :class:`CudaClock`; ``cover_us[i]``: the spin before step i) and
    how many steps took the host longer to enqueue than their spin (those may include host gaps)."""
    times, uncovered = [], 0
    for pos, step in enumerate(steps):
        clock.sync()
        token = clock.start(cover_us[pos])
        t0 = time.perf_counter()
        run_step(engine, wl, step, pos, out)
        enqueue_us = (time.perf_counter() - t0) * 1e6
        times.append(clock.stop(token))
        uncovered += enqueue_us > cover_us[pos]
    return times, uncovered


@attrs.frozen(eq=False)
class RefRows:
    """The FP32 answer for some rows of one checked step.

    rows : int [R], the step's rows checked. ref : [R, H_q, D] float32, attention over the cache
    the engines read (FP8: dequantized with its scales). FP8 only: ``exact`` [R, H_q, D]
    float64, attention over the fp16 values the cache was quantized from, and ``fp8_bound``,
    ``reference.fp8_error_bound`` of ``||out[rows] - exact||_F``.
    """

    rows: np.ndarray
    ref: torch.Tensor
    exact: torch.Tensor | None = None
    fp8_bound: float | None = None


def reference_rows(wl: Workload, step: Step) -> RefRows:
    """FP32 reference output of up to :data:`REF_ROWS` rows of ``step`` (longest, shortest); for
    an FP8 cache of every row (the FlashInfer output is not the yardstick there, see the module
    docstring), with the exact answer over the fp16 source and its FP8 error bound."""
    seq = step.seq_lens
    if wl.fp8:
        rows = np.arange(len(seq))
    else:
        rows = np.array(list(dict.fromkeys([int(np.argmax(seq)), int(np.argmin(seq))]))[:REF_ROWS])
    bt = torch.from_numpy(wl.layout.block_table(step.rids[rows])).to(wl.device)
    lens = torch.from_numpy(seq[rows].astype(np.int32)).to(wl.device)
    q = wl.q[torch.from_numpy(rows).to(wl.device)]                       # [R, H_q, D]
    ref = reference.decode_attention(q, wl.k[0], wl.v[0], lens, bt, **wl.scales(0))
    if not wl.fp8:
        return RefRows(rows, ref)
    if wl.k_src is None:
        raise RuntimeError("reference_rows: the fp16 source of the FP8 cache was dropped "
                           "(Workload.drop_source); make the references before")
    exact = reference.decode_attention(q, wl.k_src, wl.v_src, lens, bt, dtype=torch.float64)
    bound = reference.fp8_error_bound(q, wl.k_src, wl.v_src, lens, bt, **wl.scales(0))
    return RefRows(rows, ref, exact, bound)


def check_output(o: torch.Tensor, r: RefRows) -> dict:
    """Errors of an engine's output ``o`` [B, H_q, D] on the rows of ``r``: ``max_err_ref``,
    ``mean_err_ref`` against ``r.ref``; FP8 also ``err_norm_unquantized`` (``||o[rows] -
    exact||_F``) and ``fp8_bound``."""
    got = o[torch.from_numpy(r.rows).to(o.device)]
    max_e, mean_e = errors(got, r.ref)
    out = dict(max_err_ref=max_e, mean_err_ref=mean_e)
    if r.exact is not None:
        out.update(err_norm_unquantized=float((got.double() - r.exact).norm()), fp8_bound=r.fp8_bound)
    return out


def _bound_use(check: dict) -> float:
    """``err_norm_unquantized / fp8_bound`` of a :func:`check_output` result (inf for NaN)."""
    use = check["err_norm_unquantized"] / check["fp8_bound"] if check["fp8_bound"] > 0 else math.inf
    return math.inf if math.isnan(use) else use


def within_fp8_bound(checks: list[dict]) -> bool:
    """Every check's ``err_norm_unquantized <= fp8_bound`` (false for NaN, or without checks)."""
    return bool(checks) and all(c.get("err_norm_unquantized", math.nan) <= c.get("fp8_bound", -1.0)
                                for c in checks)


def measure_engine(engine, wl: Workload, clock, *, case: str, seed: int, fi_outs, refs, out,
                   baseline: bool = False, wall_rounds: int = 1, log=print) -> tuple[dict, list[dict]]:
    """:func:`run_seed`'s protocol for one engine alone: :func:`check_engine`, its wall passes
    (:func:`interleaved_wall_passes` of one engine) and :func:`time_engine`. Returns (results
    row, per-step rows)."""
    common, failed = check_engine(engine, wl, clock, case=case, seed=seed, fi_outs=fi_outs,
                                  refs=refs, out=out, baseline=baseline, log=log)
    if failed is not None:
        return failed, []
    before = engine.stats()
    ((walls, infos),) = interleaved_wall_passes([engine], wl, wl.steps, out, clock, wall_rounds,
                                                wl.previous)
    return time_engine(engine, wl, clock, case=case, seed=seed, common=common, out=out,
                       walls=walls, infos=infos, before=before, wall_passes=wall_rounds)


def check_engine(engine, wl: Workload, clock, *, case: str, seed: int, fi_outs, refs, out,
                 baseline: bool = False, log=print) -> tuple[dict, dict | None]:
    """Correctness of one engine on the checked steps, then (if correct) its warm-up
    (:func:`warm_until_steady`). Returns (the row fields every row of it carries, None), or
    (those, its results row) for an incorrect engine, which gets ``correct: false`` and no timing.

    fi_outs : {pos: baseline output [B, H_q, D]} (for the baseline itself: filled here).
    refs : {pos: :class:`RefRows`}.
    16-bit caches: correct = within tolerance of the baseline's output and of the FP32
    reference. FP8: within tolerance of the FP32 reference over the dequantized cache (every
    row), or, for a FlashInfer path, within the FP8 error bound of the unquantized answer; the
    errors against the baseline's output are recorded only.
    """
    kept = untimed_pass(engine, wl, wl.steps, out, clock, keep=tuple(refs))
    errs, checks = [], []                          # per checked step: fi max, fi mean, ref max, ref mean
    for pos, o in kept.items():
        if baseline:
            fi_outs[pos] = o
        c = check_output(o, refs[pos])
        checks.append(c)
        errs.append((*errors(o, fi_outs[pos]), c["max_err_ref"], c["mean_err_ref"]))
    # worst over the checked steps; np.max keeps a NaN (a failure)
    max_fi, mean_fi, max_ref, mean_ref = (float(x) for x in np.max(errs, axis=0)) if errs else (0.0,) * 4
    fp8, flashinfer_path = {}, baseline or engine.label in FI_VARIANTS
    if wl.fp8:
        bound_ok = within_fp8_bound(checks)
        correct = within_tolerance(max_ref, mean_ref) or (flashinfer_path and bound_ok)
        worst = max(checks, key=_bound_use, default={})   # the step closest to (or past) its bound
        fp8 = dict(within_fp8_bound=bound_ok, err_norm_unquantized=worst.get("err_norm_unquantized"),
                   fp8_bound=worst.get("fp8_bound"))
    else:
        correct = within_tolerance(max_fi, mean_fi) and within_tolerance(max_ref, mean_ref)
    common = dict(seed=seed, baseline=baseline, correct=correct, max_err=max_fi, mean_err=mean_fi,
                  max_err_ref=max_ref, mean_err_ref=mean_ref, checked_steps=len(kept), **fp8)
    if not correct:
        bound = (f"; vs unquantized |e| {fp8['err_norm_unquantized']:.3g}, FP8 bound "
                 f"{fp8['fp8_bound']:.3g}" if wl.fp8 and flashinfer_path and checks else "")
        log(f"  {engine.label}: FAILED correctness (vs FlashInfer max {max_fi:.3g} mean "
            f"{mean_fi:.3g}; vs FP32 max {max_ref:.3g} mean {mean_ref:.3g}{bound}); not timed")
        return common, {"case": case, "engine": engine.label, "row": "measured", **common}
    warm_until_steady(engine, wl, out, clock)
    return common, None


def time_engine(engine, wl: Workload, clock, *, case: str, seed: int, common: dict, out,
                walls: list[float], infos: list, before: dict,
                wall_passes: int = 1) -> tuple[dict, list[dict]]:
    """The device pass of one engine whose wall times per step (and step infos) were measured
    in ``wall_passes`` passes, and its results row and per-step rows. ``before``:
    ``engine.stats()`` before its timed passes (the ``rt_*_timed`` fields count what the
    ``timed_passes`` = wall passes + the device pass did, the untimed plans of each step's
    predecessor in the wall passes included: ``rt_plans_timed`` counts both)."""
    # the spin before step i covers 1.25x its wall time (an upper bound of its enqueue time) + 50 us
    cudas, uncovered = device_pass(engine, wl, wl.steps, out, clock, [1.25 * w + 50.0 for w in walls])
    after = engine.stats()
    records = []
    for step, wall, cuda, (route, splits, counters) in zip(wl.steps, walls, cudas, infos):
        seq = step.seq_lens
        records.append(StepRecord(step=step.index, active=len(seq), max_context=int(seq.max()),
                                  mean_context=float(seq.mean()), route=route,
                                  splits=tuple(splits), counters=counters, wall_us=wall,
                                  cuda_us=cuda))
    extra = {f"rt_{k}": v for k, v in after.items()}
    extra.update({f"rt_{k}_timed": after[k] - v for k, v in before.items()
                  if isinstance(v, (int, float)) and not isinstance(v, bool)
                  and isinstance(after.get(k), (int, float))})
    row = summarize(case, engine.label, records, **common, steps_total=wl.steps_total,
                    cache_copies=wl.copies, device_uncovered_steps=uncovered,
                    timed_passes=wall_passes + 1, **extra)
    return row, step_rows(case, engine.label, seed, records, baseline=common["baseline"])


def probe_baseline(candidates: dict, wl: Workload, clock, out, probe_steps: int,
                   failures: dict) -> dict[str, float]:
    """Summed device µs (the device pass: CUDA events behind a covering spin) of each candidate
    engine over ``probe_steps`` steps spread over the measured ones (after one warm-up pass over
    them): the baseline is FlashInfer's fastest path by device time. A step counts the least of
    :data:`PROBE_DEVICE_ROUNDS` device passes: a host stall longer than a step's spin only adds
    to that step's time, and one pass let it pick a slower baseline (2026-12-03, one-layer FP8
    bimodal B8 seed 20260624: the tensor-core path probed 1856 us, 615 in the run before on
    the same steps, so the CUDA-core path, 1171 us, became the baseline). The warm-up pass also checks
    each candidate's output on the first and last probe step against the FP32 reference (the
    tolerance of :func:`measure_engine`; FP8: or the FP8 error bound, :func:`wrong_output`), so
    that a wrong path cannot become the baseline.
    ``candidates``: label -> engine; one that raises or is wrong is removed from it and the
    reason recorded in ``failures`` (another path can still be the baseline)."""
    steps = [wl.steps[i] for i in sample_steps(len(wl.steps), probe_steps)]
    refs = {pos: reference_rows(wl, steps[pos]) for pos in check_positions(len(steps), 2)}
    probe = {}
    for label, eng in list(candidates.items()):
        out.fill_(float("nan"))
        try:
            kept = untimed_pass(eng, wl, steps, out, clock, keep=tuple(refs))
            why = wrong_output(kept, refs, steps)
            if why is None:
                walls, _ = wall_pass(eng, wl, steps, out, clock)
                cover = [1.25 * w + 50.0 for w in walls]
                rounds = [device_pass(eng, wl, steps, out, clock, cover)[0]
                          for _ in range(PROBE_DEVICE_ROUNDS)]
        except Exception as exc:  # noqa: BLE001 - recorded in meta and printed
            why = f"{type(exc).__name__}: {exc}"
        if why is not None:
            failures[label] = why
            del candidates[label]
            continue
        probe[label] = sum(min(times) for times in zip(*rounds))
    return probe


def wrong_output(kept: dict, refs: dict, steps: list[Step]) -> str | None:
    """Why the outputs ``kept`` ({pos: [B, H_q, D]}) of a FlashInfer path differ from the FP32
    references ``refs`` ({pos: :class:`RefRows`}) beyond tolerance, naming the step; None when
    they agree. FP8: also None within the FP8 error bound of the unquantized answer (a path that
    rounds q or P to FP8 still counts, as in benches/isolated.py)."""
    for pos, o in kept.items():
        c = check_output(o, refs[pos])
        if not within_tolerance(c["max_err_ref"], c["mean_err_ref"]) and not (
                "fp8_bound" in c and within_fp8_bound([c])):
            bound = (f"; vs unquantized |e| {c['err_norm_unquantized']:.3g}, FP8 bound "
                     f"{c['fp8_bound']:.3g}" if "fp8_bound" in c else "")
            return (f"wrong output on step {steps[pos].index}: vs FP32 max|e| {c['max_err_ref']:.3g}, "
                    f"mean|e| {c['mean_err_ref']:.3g}{bound}")
    return None


def run_seed(config: ServingConfig, seed: int, trace, make_engine, *, clock, device="cuda",
             l2_bytes: int = 60 * 2**20, budget_bytes: int | None = None, log=print):
    """Measure every engine of ``config`` on one seed.

    make_engine(name, wl, fi_route) -> engine, for ``name`` in ``config.engines`` and every
    FlashInfer path of the probe (:data:`FI_VARIANTS`, built with ``fi_route`` None).
    ``fi_route`` is the wrapper the Runtime's FlashInfer route should run (:func:`route_variant`).
    A FlashInfer path that cannot run here (it raised or was wrong in the probe) and that
    ``config.engines`` names gets a row ``"row": "unavailable"`` with the reason, no timing.

    Returns (rows incl. ratio rows, per-step rows, info dict for the results meta).
    """
    wl = Workload(trace, config, seed, device=device, l2_bytes=l2_bytes, budget_bytes=budget_bytes)
    case = case_name(trace.name, config.max_active, seed, layers=config.layers, mlp=config.mlp,
                     group=config.shape.num_qo_heads // config.shape.num_kv_heads,
                     kv_dtype=config.kv_dtype)
    sh = config.shape
    out = torch.full((config.max_active, sh.num_qo_heads, sh.head_dim), float("nan"),
                     dtype=sh.torch_dtype, device=device)
    kv = (f", KV float8_e4m3fn ({config.fp8_scales} scales {wl.scale_floats[0]:.4g} / "
          f"{wl.scale_floats[1]:.4g})" if wl.fp8 else "")
    log(f"{case}: {len(wl.steps)} of {wl.steps_total} steps, {wl.layout.num_physical_pages} "
        f"pages, {wl.copies} cache cop{'y' if wl.copies == 1 else 'ies'}{kv}")
    candidates, failures = {}, {}
    for label in FI_VARIANTS:
        try:
            candidates[label] = make_engine(label, wl, None)
        except Exception as exc:  # noqa: BLE001 - recorded in meta and printed, another may work
            failures[label] = f"{type(exc).__name__}: {exc}"
    probe = probe_baseline(candidates, wl, clock, out, config.probe_steps, failures)
    status = candidate_status(FI_VARIANTS, probe, failures)
    for label, text in status.items():
        if text != "ok":
            log(f"  {label} {text}")
    if not probe:
        raise ValueError(f"{case}: no FlashInfer variant could run the baseline: {failures}")
    base_label = choose_baseline(probe)
    fi_route = route_variant(probe)
    log(f"  baseline {base_label}, the fastest of {len(probe)} FlashInfer paths (probe device time "
        f"over {min(config.probe_steps, len(wl.steps))} steps: "
        + ", ".join(f"{k} {v:.0f} us" for k, v in probe.items()) + ")")
    check = check_positions(len(wl.steps), config.check_steps)
    refs = {pos: reference_rows(wl, wl.steps[pos]) for pos in check}
    wl.drop_source()   # FP8: the fp16 source was needed for the references only
    fi_outs: dict[int, torch.Tensor] = {}
    rows, steps_out = [], []
    engines = [(BASELINE, candidates[base_label])]
    for name in config.engines:
        if name == BASELINE or name == base_label:
            continue
        if name in failures:
            log(f"  {name}: not measured, unavailable: {failures[name]}")
            rows.append({"case": case, "engine": name, "row": "unavailable", "seed": seed,
                         "reason": failures[name]})
            continue
        engines.append((name, candidates[name] if name in candidates else
                        make_engine(name, wl, fi_route)))
    timed = []   # (engine, its common row fields, its stats before the timed passes)
    for name, eng in engines:
        out.fill_(float("nan"))
        common, failed = check_engine(eng, wl, clock, case=case, seed=seed, fi_outs=fi_outs,
                                      refs=refs, out=out, baseline=name == BASELINE, log=log)
        if failed is not None:
            rows.append(failed)
        else:
            timed.append((eng, common, eng.stats()))
    passes = interleaved_wall_passes([t[0] for t in timed], wl, wl.steps, out, clock,
                                     config.wall_rounds, wl.previous)
    for (eng, common, before), (walls, infos) in zip(timed, passes):
        row, srows = time_engine(eng, wl, clock, case=case, seed=seed, common=common, out=out,
                                 walls=walls, infos=infos, before=before,
                                 wall_passes=config.wall_rounds)
        rows.append(row)
        steps_out.extend(srows)
        if "tok_per_s" in row:
            err = (f"max|e| vs FP32 {row['max_err_ref']:.2e}" if wl.fp8 else   # FP8: the yardstick
                   f"max|e| {row['max_err']:.2e}")
            log(f"  {row['engine']:<20} {row['route_mix']:<40} device {row['median_us']:9.1f} us"
                f"  wall {row['wall_us']:9.1f} us  {row['tok_per_s']:10.0f} tok/s  {err}")
    rows.extend(ratio_rows(rows))
    info = {"baseline": base_label, "baseline_probe_device_us": probe,
            "baseline_probe_rounds": PROBE_DEVICE_ROUNDS,   # per step the least of (1 before cb69b5b)
            "baseline_candidates": status, "baseline_failures": failures,
            "flashinfer_route": fi_route, "cache_copies": wl.copies,
            "steps_total": wl.steps_total, "steps_measured": len(wl.steps)}
    return rows, steps_out, info
