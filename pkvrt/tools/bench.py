"""Time pkvrt against FlashInfer on a serving trace (``serving``) or isolated kernels (``isolated``).

``pkvrt bench serving`` replays continuous decode over a trace (a synthetic family, the shipped
``mixed`` fixture or a CSV/JSON file) on the GPU, once per seed: FlashInfer (the fastest of its
decode paths on probe steps: the CUDA-core, tensor-core and cuDNN wrappers, planned every step,
and XQA; pkvrt/measure/fi_engines.py) against the pkvrt Runtime (adaptive routing, CUDA graphs)
and the other engines of ``--engines``. Correctness is checked before timing; every engine gets
CUDA-event and synchronized wall times per step. It writes a results JSON (one row per case and
engine, plus ratio rows) and a ``.steps.json`` of per-step records next to it; ``pkvrt report``
turns a directory of them into tables and plots. The protocol is described in
pkvrt/measure/harness.py.

Without a CUDA GPU it says so and runs the planner instead (``pkvrt plan`` on the same trace,
exit status 0): per seed the route of every step and the cost model's predicted time per
engine, for the calibration it names (``--gpu`` / ``--calibration``; default the seed RTX 3060
profile, as ``pkvrt plan``), then a summary table (``--verbose``: each seed's route mix,
structural counters and predictions). ``--seeds``, ``--engines`` and ``--engine-layers`` take
effect there too; the engines that differ only in how a GPU runs a step are refused.

Without a MODE (no arguments, or an option first) it is ``serving``: ``pkvrt bench --trace zipf``
is ``pkvrt bench serving --trace zipf``; ``pkvrt bench`` alone runs serving with its defaults.

``--kv-dtype fp8`` runs the same protocol over float8_e4m3fn K/V pages with fp16 (or bf16) q and
out: per-tensor scales (``--fp8-scales unit``, the default: a cast with scales 1; ``amax``:
amax / 448), one scale tensor pair per layer, every pkvrt engine with
``kv_dtype=torch.float8_e4m3fn``, FlashInfer's FP8-KV paths as the baseline's candidates (cuDNN
has none with fp16 q: recorded unavailable with its reason), every engine checked against FP32
attention over the dequantized cache; case names end in ``-fp8`` (pkvrt/measure/harness.py).

``pkvrt bench isolated -- [ARGS]`` runs benches/isolated.py (the Table 1 kernel benchmark) with
ARGS, e.g. ``pkvrt bench isolated -- --cases B1-32K,B8-32K``.
"""

from __future__ import annotations

import argparse
import importlib.util
import sys
import textwrap
import warnings
from pathlib import Path

import attrs

from pkvrt.measure import fi_engines, harness, results
from pkvrt.measure.traces import FAMILIES, resolve_trace
from pkvrt.policy import calibration as calib
from pkvrt.policy import registry as reg_mod
from pkvrt.tools import plan_cmd
from pkvrt.tools.cli import add_shape_arguments, check_shape_arguments, positive_int

HELD_OUT_SEEDS = "20260623,20260624,20260625,20260626,20260627"
ISOLATED = results.ROOT / "benches" / "isolated.py"
DEFAULT_ENGINES = "flashinfer,adaptive"
# Options that only shape the GPU run (value when not given); the planner warns that it ignores them.
GPU_ONLY = {"--steps-limit": ("steps_limit", 200), "--check-steps": ("check_steps", 4),
            "--wall-rounds": ("wall_rounds", 3), "--mlp": ("mlp", False),
            "--cold-plans": ("cold_plans", False)}

# --engines: every name harness.parse_engines takes (besides route names), with what it times.
# PLANNER_ENGINES (and device-plan:ROUTE, and route names) are predicted without a GPU too.
ENGINES = {
    harness.BASELINE: "the baseline: the fastest of FlashInfer's decode paths on probe steps; "
                      "always run",
    "flashinfer-cuda": "FlashInfer's CUDA-core decode wrapper, one path for the whole run",
    "flashinfer-tc": "FlashInfer's tensor-core decode wrapper, one path for the whole run",
    "flashinfer-cudnn": "FlashInfer's cuDNN decode, one path for the whole run",
    "flashinfer-xqa": "FlashInfer's XQA decode, one path for the whole run",
    harness.FI_GRAPH: "FlashInfer's CUDA-graph mode, through the Runtime",
    harness.ADAPTIVE: "the pkvrt Runtime: the router's route per step, CUDA graphs",
    harness.ADAPTIVE_EAGER: "the same Runtime without graphs: each run() launches",
    harness.ADAPTIVE_FI_GRAPH: "the same Runtime with FlashInfer's CUDA-graph mode",
    harness.ADAPTIVE_FI_WRAPPER: "the same Runtime calling FlashInfer's own run() at every layer",
    harness.ADAPTIVE_DEVICE_TIME: "the same Runtime, its router weighing device time only",
    harness.DEVICE_PLAN: "device planning (lengths stay on the GPU), a graph per layer; "
                         "device-plan:ROUTE runs that workqueue or fused route (the planner "
                         "predicts the route per step, not the planning kernel)",
    harness.STEP_GRAPH: "device planning, the whole step in one graph; device-plan-step:ROUTE "
                        "likewise",
    harness.STEP_GRAPH_TAIL1: "device-plan-step with the fused tail in one level (the ablation of "
                              "the two-level tail)",
    harness.HOST_STEP: "host lengths, the step's layers in one graph per step key",
    harness.HOST_STEP_ROUTER: "host-step with the router's policy",
    harness.SHARED_STEP: "host-step with pkvrt.SharedPagesRuntime: shared page runs read once "
                         "per chunk of rows (traces with prefix hashes)",
    harness.SHARED_DEVICE_STEP: "device-plan-step with pkvrt.SharedPagesRuntime(device_planning="
                                "True): shared prefixes found on the GPU, read once per chunk",
}
PLANNER_ENGINES = (harness.BASELINE, harness.ADAPTIVE, harness.DEVICE_PLAN)
DEVICE_KINDS = ("workqueue", "fused")   # the route kinds device planning runs


def _seeds(text: str) -> tuple[int, ...]:
    try:
        return harness.parse_seeds(text)
    except ValueError as e:
        raise argparse.ArgumentTypeError(str(e)) from None


def default_mode(argv: list[str]) -> list[str]:
    """The arguments after ``bench``, with ``serving`` put first where they name no MODE (none at
    all, or an option first, -h/--help included: ``pkvrt bench --help`` shows serving's options):
    ``--trace zipf`` -> ``serving --trace zipf``. pkvrt/tools/cli.py applies it before parsing."""
    if not argv or argv[0].startswith("-"):
        return ["serving", *argv]
    return argv


def _shipped_routes() -> str:
    try:
        reg = reg_mod.load_routes(None)
    except (ValueError, OSError) as e:          # the help must not fail on a broken routes.toml
        return f"see pkvrt routes ({e})"
    return ", ".join(r.name for r in reg.routes if r.kind != "flashinfer")


def engines_epilog() -> str:
    """The ``--engines`` names for ``pkvrt bench --help``: every name the option takes."""
    width = max(map(len, ENGINES)) + 2
    items = [(name, ("[planner] " if name in PLANNER_ENGINES else "") + text)
             for name, text in ENGINES.items()]
    items.append(("ROUTE", "[planner] a route of routes.toml forced on every step (shipped: "
                           f"{_shipped_routes()})"))
    lines = [textwrap.fill(text, 96, initial_indent=f"  {name:<{width}}",
                           subsequent_indent=" " * (width + 2)) for name, text in items]
    return ("engines (--engines, comma-separated; [planner]: predicted without a GPU too, "
            "device-plan:ROUTE included):\n" + "\n".join(lines))


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """Arguments of ``pkvrt bench``: the ``serving`` and ``isolated`` modes."""
    sub = parser.add_subparsers(dest="mode", metavar="MODE", required=True,
                                help="serving (the default when no MODE is given) or isolated")
    s = sub.add_parser("serving", help="continuous decode over a trace, FlashInfer vs pkvrt",
                       description=__doc__, epilog=engines_epilog(),
                       formatter_class=argparse.RawDescriptionHelpFormatter)
    s.add_argument("--trace", default="bimodal", metavar="SPEC",
                   help=f"a family ({', '.join(FAMILIES)}), 'mixed' or a .csv/.json trace file "
                        "(default: bimodal)")
    s.add_argument("--max-active", type=positive_int, default=8, metavar="N",
                   help="decode slots, the batch size B (default: 8)")
    s.add_argument("--seeds", type=_seeds, default=harness.parse_seeds(HELD_OUT_SEEDS),
                   metavar="S[,S|A-B]", help="seeds (trace draw, page layout, data); default: the "
                                             "held-out seeds 20260623-20260627. Without a GPU a "
                                             "family is drawn and planned per seed; a file "
                                             "trace is the same for every seed and planned once")
    s.add_argument("--num-requests", type=positive_int, metavar="N",
                   help="requests of a family (default 32); for a file, keep the first N")
    s.add_argument("--engines", metavar="LIST",
                   help=f"comma-separated engine names, listed under 'engines' below (default: "
                        f"{DEFAULT_ENGINES}; without a GPU: every enabled route and adaptive)")
    s.add_argument("--routes", metavar="PATH",
                   help=f"routes.toml (default: {reg_mod.default_routes_path()})")
    cal = s.add_mutually_exclusive_group()
    cal.add_argument("--calibration", metavar="PATH",
                     help="calibration JSON (default: the file of this GPU, see "
                          f"calibration/README.md; without a GPU the seed profile "
                          f"calibration/{calib.DEFAULT_SLUG}.json, as pkvrt plan)")
    cal.add_argument("--gpu", metavar="NAME",
                     help="pick the calibration file by device name, e.g. 'NVIDIA H200', as "
                          "pkvrt plan --gpu (on a GPU: instead of this GPU's own file)")
    s.add_argument("--out", metavar="FILE",
                   help="results JSON (default: benches/results/<gpu>/serving-<case>.json; the "
                        "per-step records go to FILE with suffix .steps.json; without a GPU "
                        "nothing is written unless --out is given)")
    s.add_argument("-v", "--verbose", action="store_true",
                   help="without a GPU: print each seed's full planner output (route mix with "
                        "split counts, structural counters, predictions per engine) before the "
                        "summary table")
    s.add_argument("--engine-layers", type=positive_int, default=1, metavar="L",
                   help="attention calls per step, planned once (engine protocol; default: 1). "
                        "Without a GPU: the router decides for L layers per plan and the "
                        "predictions are per step of L layers")
    gpu = s.add_argument_group("GPU run only (the planner, without a GPU, warns that it ignores "
                               "these)")
    gpu.add_argument("--steps-limit", type=positive_int, metavar="N",
                     help="measure at most N steps per seed, spread evenly over the trace "
                          "(default: 200)")
    gpu.add_argument("--mlp", action="store_true", default=None,
                     help="follow every layer's attention with the seed's gated MLP tail "
                          f"(intermediate {harness.MLP_INTERMEDIATE}, hidden H_q*D)")
    gpu.add_argument("--check-steps", type=positive_int, metavar="N",
                     help="steps checked for correctness before timing (default: 4)")
    gpu.add_argument("--wall-rounds", type=positive_int, metavar="N",
                     help="wall passes per engine, every engine's steps interleaved with the "
                          "others' in a rotated order; a step's wall time is the median of its "
                          "rounds (default: 3)")
    gpu.add_argument("--cold-plans", action="store_true", default=None,
                     help="time each sampled step's host plan() cold; by default an engine that "
                          "plans on the host first plans the trace's previous step (untimed), "
                          "so its memos are as a serving loop leaves them")
    shape = add_shape_arguments(s)
    shape.add_argument("--dtype", choices=tuple(harness.DTYPES), default="float16",
                       help="q and out (and a 16-bit KV cache; default: float16)")
    shape.add_argument("--kv-dtype", choices=harness.KV_DTYPES, default="fp16",
                       help="the KV cache: fp16 (in --dtype, the default) or fp8 (float8_e4m3fn "
                            "with float32 scales; case names end in -fp8)")
    shape.add_argument("--fp8-scales", choices=harness.FP8_SCALES, default=None,
                       help="with --kv-dtype fp8, the per-tensor scales: unit (a cast, scales 1; "
                            "the default) or amax (amax / 448)")
    i = sub.add_parser("isolated", help="the isolated kernel benchmark (benches/isolated.py)",
                       description="Run benches/isolated.py; pass its arguments after '--', e.g. "
                                   "pkvrt bench isolated -- --cases B1-32K --out x.json")
    i.add_argument("isolated_args", nargs=argparse.REMAINDER, metavar="-- ARGS",
                   help="the arguments of benches/isolated.py (python benches/isolated.py --help)")


def run(args: argparse.Namespace) -> int:
    if args.mode == "isolated":
        return run_isolated(args.isolated_args)
    return run_serving(args)


# --------------------------------------------------------------------------- isolated

def run_isolated(argv: list[str]) -> int:
    """Import benches/isolated.py from the checkout and call its ``main(argv)``."""
    import torch

    argv = argv[1:] if argv[:1] == ["--"] else argv
    if not ISOLATED.is_file():
        print(f"pkvrt bench isolated: {ISOLATED} is not here (an installed pkvrt has no benches/); "
              "run it from a checkout: python benches/isolated.py --help", file=sys.stderr)
        return 2
    if not torch.cuda.is_available():
        print(f"pkvrt bench isolated: no CUDA GPU here; {ISOLATED} times kernels on a GPU. "
              "Nothing was run.", file=sys.stderr)
        return 2
    spec = importlib.util.spec_from_file_location("pkvrt_benches_isolated", ISOLATED)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return int(module.main(argv) or 0)


# --------------------------------------------------------------------------- serving

def _config(args, registry) -> harness.ServingConfig:
    shape = harness.Shape(num_qo_heads=args.num_qo_heads, num_kv_heads=args.num_kv_heads,
                          head_dim=args.head_dim, page_size=args.page_size, dtype=args.dtype)
    check_shape_arguments(args, harness.DTYPES[args.dtype])   # the shapes the Runtime takes
    engines = harness.parse_engines(args.engines or DEFAULT_ENGINES, [r.name for r in registry.routes])
    if args.fp8_scales is not None and args.kv_dtype != "fp8":
        raise ValueError(f"--fp8-scales {args.fp8_scales}: scales belong to an FP8 KV cache; "
                         "add --kv-dtype fp8 (or drop --fp8-scales)")
    if args.kv_dtype == "fp8":
        harness.check_fp8_engines(engines, {r.name: r.kv_dtypes for r in registry.routes})
    gpu_only = {key: default if getattr(args, key) is None else getattr(args, key)
                for key, default in GPU_ONLY.values()}
    return harness.ServingConfig(
        trace=args.trace, max_active=args.max_active, seeds=tuple(args.seeds), engines=engines,
        routes=registry.path, calibration=args.calibration, layers=args.engine_layers,
        num_requests=args.num_requests, shape=shape, kv_dtype=args.kv_dtype,
        fp8_scales=args.fp8_scales or "unit", **gpu_only)


def run_serving(args: argparse.Namespace) -> int:
    """``pkvrt bench serving``: the GPU run, or the planner fallback without CUDA."""
    import torch

    registry = reg_mod.load_routes(args.routes)
    config = _config(args, registry)
    traces = [resolve_trace(config.trace, num_requests=config.num_requests, seed=s)
              for s in config.seeds]                 # fail on a bad --trace before any GPU work
    if not torch.cuda.is_available():
        return planner_fallback(args, config, registry, traces)
    return serving_on_gpu(args, config, registry, traces)


def calibration_for(args, device: str | None) -> calib.Calibration:
    """``--calibration PATH``; else the file ``--gpu NAME`` picks (as ``pkvrt plan --gpu``); else
    the file of ``device``, the GPU at hand; without one the seed profile, as ``pkvrt plan``."""
    if args.calibration:
        return calib.load_calibration(args.calibration)
    if args.gpu or device:
        return calib.find_calibration(args.gpu or device)
    return plan_cmd.seed_calibration()


# --------------------------------------------------------------------------- planner mode

def planner_engines(args, config: harness.ServingConfig, registry) -> tuple[str, ...] | None:
    """The engines the planner reports for ``--engines`` (None when not given: every enabled
    route and adaptive, as ``pkvrt plan``). An engine that differs from these only in how a GPU
    runs a step is refused: the cost model cannot tell it apart."""
    if args.engines is None:
        return None
    routes = [r.name for r in registry.routes]
    gpu_only = [e for e in config.engines if e not in (*PLANNER_ENGINES, *routes)
                and not e.startswith(harness.DEVICE_PLAN + ":")]
    if gpu_only:
        shown = ", ".join(r for r in routes if r != registry.baseline.name)
        they = ("they need", "they differ") if len(gpu_only) > 1 else ("it needs", "it differs")
        raise ValueError(
            f"--engines {','.join(gpu_only)}: {they[0]} a CUDA GPU (none here): {they[1]} from "
            "flashinfer, adaptive or a route only in how the GPU runs a step (FlashInfer's decode "
            "paths, CUDA graphs, captured steps, host time), which only timing measures; the "
            f"planner predicts {', '.join(PLANNER_ENGINES)}, device-plan:ROUTE and the routes of "
            f"{registry.path} ({shown})")
    for e in config.engines:
        route = e.partition(":")[2]
        if e.startswith(harness.DEVICE_PLAN + ":") and registry.route(route).kind not in DEVICE_KINDS:
            raise ValueError(f"--engines {e}: device planning runs a workqueue or fused route; "
                             f"{route} is a {registry.route(route).kind} route")
    return tuple(registry.baseline.name if e == harness.BASELINE else e for e in config.engines)


def _warn_gpu_only(args) -> None:
    given = [flag for flag, (key, _) in GPU_ONLY.items() if getattr(args, key) is not None]
    if given:
        warnings.warn(f"{', '.join(given)}: not used without a GPU (they shape the timed run; the "
                      "planner plans every step of the trace, attention only)", stacklevel=2)


def _planner_header(args, cal, router, config) -> list[str]:
    """Which calibration predicts (and how to pick another), layers and host time, FP8."""
    shipped = ", ".join(sorted({f.stem for d in calib.calibration_dirs() for f in d.glob("*.json")}))
    if args.calibration:
        how = f"--calibration {args.calibration}"
    elif args.gpu:
        how = f"--gpu {args.gpu!r}" + (": no file for it, the seed profile" if cal.fallback else "")
    else:
        how = "the default without a GPU, as pkvrt plan; --gpu NAME or --calibration PATH picks another"
    host = ("host time weighed as the Runtime's default mode does" if router.host_model is None
            else f"host time not weighed: {router.host_model}")
    out = [f"calibration: {cal.slug} ({cal.gpu}) from {cal.source} ({how}; shipped: {shipped})",
           f"layers: a step is {config.layers} attention call{'s' * (config.layers > 1)} "
           f"(--engine-layers), planned once; {host}"]
    if config.fp8:
        out.append("KV cache float8_e4m3fn: the router counts 1 byte per K/V element; an FP8 "
                   "Runtime does not run the FlashInfer route (steps routed there run on the "
                   "fastest PersistentKV route).")
    return out


def _plan_seeds(config, traces, router, engines, progress: bool) -> list[tuple[str, object]]:
    """(seed label, PlanSummary) per seed; a file trace, the same for every seed, once."""
    if traces[0].seed is None:
        label = ",".join(map(str, config.seeds)) if len(config.seeds) <= 3 else \
            f"{len(config.seeds)} seeds"
        traces, labels = traces[:1], [label]
    else:
        labels = [str(s) for s in config.seeds]
    return [(label, plan_cmd.run_planner(trace, max_active=config.max_active, router=router,
                                         progress=progress, layers=config.layers, engines=engines))
            for label, trace in zip(labels, traces)]


def planner_fallback(args, config: harness.ServingConfig, registry, traces) -> int:
    """No CUDA: ``plan_cmd.run_planner`` over every seed's trace, a summary table (each seed's
    full output with ``--verbose``), ``--out`` if given."""
    from pkvrt.policy.router import Router

    engines = planner_engines(args, config, registry)      # refuse before printing anything
    cal = calibration_for(args, None)
    print("pkvrt bench: no CUDA GPU here, so nothing can be timed; falling back to the planner "
          "(routes, counters and COST-MODEL PREDICTIONS, not measurements).")
    _warn_gpu_only(args)
    sh = config.shape
    kv = {"kv_dtype": "float8_e4m3fn"} if config.fp8 else {}
    router = Router(registry, cal, num_qo_heads=sh.num_qo_heads, num_kv_heads=sh.num_kv_heads,
                    head_dim=sh.head_dim, page_size=sh.page_size, graphs=True, weigh_host=True, **kv)
    print("\n".join(_planner_header(args, cal, router, config)))
    if traces[0].seed is None and len(config.seeds) > 1:
        print(f"--seeds: trace {config.trace!r} is a file, the same requests for every seed (on a "
              "GPU the seeds draw page layouts and data, which the planner does not model): "
              "planned once")
    runs = _plan_seeds(config, traces, router, engines, progress=sys.stderr.isatty())
    for label, summary in runs if args.verbose else ():
        print(f"\n== seed {label}\n{plan_cmd.format_summary(summary)}")
    print()
    print(format_planner_table(runs))
    if args.out:
        print(f"wrote {_write_plan(args.out, config, registry, cal, runs)}")
    return 0


def _write_plan(out, config, registry, cal, runs) -> Path:
    """The planner's results file: every engine row of every seed (a file trace's one plan
    under each seed's case name)."""
    plans = [s for _, s in runs] if len(runs) == len(config.seeds) else [runs[0][1]] * len(config.seeds)
    rows = [{**r, "case": harness.case_name(s.trace, config.max_active, seed, layers=config.layers,
                                             kv_dtype=config.kv_dtype), "seed": seed}
            for seed, s in zip(config.seeds, plans) for r in plan_cmd.summary_json(s)["rows"]]
    meta = results.make_meta(seeds=config.seeds, routes_path=registry.path,
                             calibration_path=cal.source,
                             kind="plan (cost-model prediction, no GPU timing)",
                             trace=config.trace, max_active=config.max_active, layers=config.layers,
                             fallback="no CUDA GPU: planner only", **_kv_meta(config))
    return results.write_results(out, meta, rows)


def _route_mix(s) -> str:
    return ", ".join(f"{m.route} {100 * m.share:.0f}%" for m in s.route_mix)


def format_planner_table(runs) -> str:
    """The summary of planner mode: per seed the steps, the adaptive route mix and each
    engine's predicted throughput against FlashInfer; over several seeds their pooled ratio
    (the sum of FlashInfer's step times over the sum of the engine's)."""
    first = runs[0][1]
    base = first.engines[0].engine                       # run_planner puts the baseline first
    engines = [e.engine for e in first.engines[1:]]
    head = ("trace", "seed", "steps", "mean active", "adaptive route mix", *engines)
    rows = []
    for label, s in runs:
        ratio = {e.engine: e.ratio_vs_flashinfer for e in s.engines}
        rows.append((s.trace, label, s.steps, f"{s.mean_active:.2f}", _route_mix(s),
                     *(f"{ratio[e]:.3f}x" for e in engines)))
    if len(runs) > 1:
        total = {e: sum(x.predicted_us * s.steps for _, s in runs for x in s.engines if x.engine == e)
                 for e in [base, *engines]}
        rows.append(("all", f"{len(runs)} seeds", sum(s.steps for _, s in runs), "", "",
                     *(f"{total[base] / total[e]:.3f}x" for e in engines)))
    notes = [f"note: {n}" for n in dict.fromkeys(n for _, s in runs for n in s.notes)]
    title = (f"Summary (max_active {first.max_active}): predicted throughput vs FlashInfer per "
             f"engine, COST-MODEL PREDICTIONS for calibration {first.calibration!r} (--verbose: "
             "each seed's route mix, counters and step times)")
    return "\n".join([title, plan_cmd.text_table(head, rows, align="llrrl" + "r" * len(engines)),
                      *notes])


# --------------------------------------------------------------------------- GPU run

def default_out(config: harness.ServingConfig, gpu: str) -> Path:
    """benches/results/<gpu slug>/serving-<trace>-B<N>[-L<l>[-mlp]][-fp8].json"""
    name = harness.case_name(Path(config.trace).stem, config.max_active, None,
                             layers=config.layers, mlp=config.mlp, kv_dtype=config.kv_dtype)
    return results.ROOT / "benches" / "results" / calib.slugify(gpu) / f"serving-{name}.json"


def steps_path(out: Path) -> Path:
    """``x/serving.json`` -> ``x/serving.steps.json``."""
    return out.with_name(out.stem + ".steps.json")


def engine_factory(config: harness.ServingConfig, registry, cal, *,
                   flashinfer=fi_engines.make_engine):
    """``make_engine(name, wl, fi_route)`` of :func:`pkvrt.measure.harness.run_seed`: a FlashInfer path
    (``flashinfer(name, wl, max_active=...)``, pkvrt/measure/fi_engines.py), the whole-step graph engine
    (``device-plan-step[:ROUTE]``), the host-lengths ones (``host-step``, ``adaptive-step``) or
    a Runtime engine (adaptive, ``device-plan[:ROUTE]``, ``flashinfer-graph``, a forced route). The workload ``wl`` carries the KV dtype and scales
    (harness.Workload), so every engine follows ``--kv-dtype``."""
    def make_engine(name, wl, fi_route):
        if name in harness.FI_VARIANTS:
            return flashinfer(name, wl, max_active=config.max_active)
        base, _, route = name.partition(":")   # device-plan[-step]:ROUTE
        if base in (harness.STEP_GRAPH, harness.STEP_GRAPH_TAIL1):
            return harness.StepGraphEngine(wl, name=name, routes=registry.path, calibration=cal,
                                           max_active=config.max_active, force=route or None)
        if name in (harness.HOST_STEP, harness.HOST_STEP_ROUTER):
            routing = "router" if name == harness.HOST_STEP_ROUTER else "device_planning"
            return harness.HostStepGraphEngine(wl, name=name, routes=registry.path, calibration=cal,
                                               max_active=config.max_active, routing=routing,
                                               tensor_cores=fi_route == "flashinfer-tc")
        if name == harness.SHARED_DEVICE_STEP:
            return harness.SharedDeviceStepEngine(wl, name=name, routes=registry.path,
                                                  calibration=cal, max_active=config.max_active)
        if name == harness.SHARED_STEP:
            return harness.SharedStepGraphEngine(wl, name=name, routes=registry.path, calibration=cal,
                                                 max_active=config.max_active,
                                                 tensor_cores=fi_route == "flashinfer-tc")
        if route:
            force = route
        elif base in (*harness.ADAPTIVE_ENGINES, harness.DEVICE_PLAN):
            force = None                              # the Runtime's own routing
        else:                                         # flashinfer-graph, or a route name
            force = registry.baseline.name if base == harness.FI_GRAPH else name
        return harness.RuntimeEngine(wl, name=name, force=force, routes=registry.path,
                                     calibration=cal, max_active=config.max_active,
                                     tensor_cores=fi_route == "flashinfer-tc")
    return make_engine


def serving_on_gpu(args, config: harness.ServingConfig, registry, traces) -> int:
    """Run every seed on the GPU; write the results and per-step files; 1 if an engine failed."""
    import torch

    from pkvrt.launch import _driver

    why = _driver.available()
    if why and any(e not in (harness.BASELINE, *harness.FI_VARIANTS) for e in config.engines):
        raise ValueError(f"pkvrt kernels cannot run here: {why}")
    env = results.environment()
    if str(env.get("flashinfer", "")).startswith("unavailable"):
        raise ValueError(f"FlashInfer is the serving baseline and it is {env['flashinfer']}; "
                         "install flashinfer-python (pip install 'pkvrt[flashinfer]')")
    cal = calibration_for(args, torch.cuda.get_device_name())
    clock = harness.CudaClock()
    l2 = env.get("l2_bytes") or 60 * 2**20
    make_engine = engine_factory(config, registry, cal)
    out = Path(args.out) if args.out else default_out(config, env["gpu"])
    rows, steps, per_seed = [], [], {}
    for seed, trace in zip(config.seeds, traces):
        r, s, info = harness.run_seed(config, seed, trace, make_engine, clock=clock,
                                      l2_bytes=l2, log=lambda m: print(m, flush=True))
        rows += r
        steps += s
        per_seed[str(seed)] = info
        torch.cuda.empty_cache()
        _write(out, config, registry, cal, clock, traces, per_seed, rows, steps)  # after every seed
    print(f"wrote {out} and {steps_path(out).name}")
    from pkvrt.tools.report import serving_table
    print(serving_table([(str(out), results.read_results(out))]))
    failed = [r for r in rows if r.get("row") == "measured" and not r.get("correct", True)]
    for r in failed:
        print(f"FAILED correctness: {r['case']} {r['engine']} (max|e| {r['max_err']:.3g}, "
              f"vs FP32 {r['max_err_ref']:.3g})", file=sys.stderr)
    return 1 if failed else 0


def _kv_meta(config: harness.ServingConfig) -> dict:
    """Meta entries of an FP8 run: ``kv_dtype`` (the cache's torch dtype name, as
    benches/isolated.py writes it) and ``fp8_scales`` (unit / amax, per tensor). A 16-bit run
    adds nothing: its files stay as they were."""
    if not config.fp8:
        return {}
    return dict(kv_dtype="float8_e4m3fn", fp8_scales=config.fp8_scales, fp8_scale_granularity="tensor")


FP8_PROTOCOL = (" FP8 KV cache: the 16-bit caches quantized to float8_e4m3fn with per-tensor "
                "scales (fp8_scales), one scale tensor pair per layer, q/out 16-bit; pkvrt engines "
                "get kv_dtype=float8_e4m3fn and the layer's scale tensors, FlashInfer's paths "
                "their FP8-KV kernels with the scales as host floats (wrappers: kv_data_type, "
                "k_scale, v_scale; XQA: bmm1_scale = k_scale/sqrt(D), bmm2_scale = v_scale); "
                "correct = every row of a checked step within the fp16 tolerance of FP32 "
                "attention over the dequantized cache, or, for a FlashInfer path, within the FP8 "
                "error bound (reference.fp8_error_bound) of attention over the 16-bit source "
                "(errors vs the baseline's output recorded only)")


def _write(out: Path, config, registry, cal, clock, traces, per_seed, rows, steps) -> None:
    """The results file and its .steps.json (atomic writes; a later seed rewrites both)."""
    meta = results.make_meta(
        seeds=[int(s) for s in per_seed], routes_path=registry.path, calibration_path=cal.source,
        kind="serving", trace=config.trace, trace_source=traces[0].source,
        max_active=config.max_active, engines=list(config.engines), layers=config.layers,
        mlp=config.mlp, mlp_intermediate=config.mlp_intermediate if config.mlp else None,
        steps_limit=config.steps_limit, shape=attrs.asdict(config.shape),
        calibration_slug=cal.slug, calibration_fallback=cal.fallback, per_seed=per_seed,
        spin_cycles_per_us=round(clock.cycles_per_us, 1),
        baseline_candidates=harness.merge_candidates(per_seed),
        wall_rounds=config.wall_rounds, cold_plans=config.cold_plans,
        protocol=("continuous decode, hole fraction 0; per engine: untimed pass with correctness "
                  "check, untimed passes until one captures no graph; then wall passes of all "
                  "engines interleaved step by step in a rotated order, wall_rounds rounds "
                  "(an engine that plans on the host first plans the trace's previous step, "
                  "untimed, unless cold_plans; L2 flushed before each; synchronized host clock per step incl. planning and "
                  "metadata; a step's wall = median of its rounds); per engine a device pass (CUDA events behind a host-covering spin kernel); FlashInfer's "
                  "CUDA-core, tensor-core and cuDNN decode wrappers planned every step from pinned "
                  "host CSR, its XQA decode given device block tables and lengths staged once per "
                  "step; baseline = fastest of those paths that run and match the FP32 reference, "
                  "by device time over probe steps spread over the measured ones "
                  "(baseline_candidates says which could not and why); layers share one KV cache "
                  "rotated over L2-defeating copies" + (FP8_PROTOCOL if config.fp8 else "")),
        **_kv_meta(config))
    results.write_results(out, meta, rows)
    results.write_results(steps_path(out), {**meta, "kind": "serving-steps", "results_file": out.name},
                          steps)
