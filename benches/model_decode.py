"""Whole-model decode: a Llama-3-8B-shaped decoder's step, captured in one
CUDA graph per batch size, with pkvrt's attention against FlashInfer's fastest decode path.

Protocol (``pkvrt/measure/model.py`` says what a step computes, ``pkvrt/measure/model_attention.py`` what each
engine runs):

1. The cases: every batch x context (default B 1, 4, 8, 32 x 8K, 32K, 128K); one whose weights +
   KV + 4 GiB of headroom exceed the GPU's memory is recorded as skipped with the bytes
   (``pkvrt.measure.model.plan_cases``; on a 139.8 GiB H200 that is B8 x 128K, B32 x 32K, B32 x 128K).
2. The weights once (16.1 GB, random on the GPU, seed 20260623); per case the 32 layers' paged
   caches (random K/V for the context, each row's pages scattered by a seeded free list),
   allocated before the case and freed after it.
3. Per engine (pkvrt, flashinfer-tc, flashinfer-cuda, flashinfer-xqa, no-attention;
   ``--engines``): the step is captured in one graph (``DecodeLoop.capture``; an engine that
   cannot be built or captured is recorded as unavailable), then, each pass from the same
   initial state (every row holds the context; rows grow by one token a step, a new page from
   the free list when a token starts one):
   a. check: ``--check-steps`` steps fed the same seeded tokens; logits and layer 0's attention
      output are kept (after the first engine's, layer 0's FP32 reference attention of those
      steps is computed: ``Model.layer0_reference``);
   b. synchronous pass: ``--warmup`` + ``--steps`` steps, each = synchronize, event, the step's
      host work (lengths/slots copy; FlashInfer's plan()) and the replay, event, wait: the step a
      greedy loop that reads its tokens waits for (``ms_per_step``);
   c. pipelined pass: the same steps enqueued back to back (greedy tokens stay on the GPU), an
      event at each step's start: the host works a step ahead (``pipelined_ms_per_step``).
4. Per case: every engine's layer-0 attention is checked against FP32; FlashInfer's baseline is
   its fastest path (by ``ms_per_step``) among those that pass; every engine's logits and layer-0
   attention outputs are compared with the baseline's (the baseline with the next FlashInfer
   path) within fp16 tolerances (``pkvrt.measure.model_results``); the attention share is
   1 - (no-attention step) / (step), the step with attention's output replaced by q (the append
   and everything else still run); a ratio row gives pkvrt against the baseline.

The results file is rewritten after every case, so a run cut short keeps what finished.
The longest steps (B4 x 128K) take ~25 ms; the full default run should take 2-3 minutes on an
H200 (an estimate: not yet measured), much of it FlashInfer's first JIT compile when its cache
is cold.

usage: python benches/model_decode.py [--out FILE] [--batches 1,4,8,32] [--contexts 8K,32K,128K]
       [--engines pkvrt,flashinfer-tc,flashinfer-cuda,flashinfer-xqa,no-attention]
       [--steps 20] [--warmup 3] [--check-steps 3] [--layers 32] [--dtype float16]
Exit status 1 when a check failed (the results are written all the same), 2 without a GPU.
"""

from __future__ import annotations

import argparse
import sys
import time

import attrs
import torch

from pkvrt.measure.model_results import parse_counts

SEED = 20260623
DEFAULT_ENGINES = "pkvrt,flashinfer-tc,flashinfer-cuda,flashinfer-xqa,no-attention"
DTYPES = {"float16": torch.float16, "bfloat16": torch.bfloat16}


def sync_pass(loop, backend, graph, start, warmup: int, steps: int):
    """Per timed step: ms from an idle GPU through host work + replay (CUDA events), and the host
    work's µs (perf_counter)."""
    loop.reset(start)
    ms, host_us = [], []
    for i in range(warmup + steps):
        torch.cuda.synchronize()
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        a.record()
        t0 = time.perf_counter()
        loop.prepare(backend)
        t1 = time.perf_counter()
        graph.replay()
        b.record()
        b.synchronize()
        if i >= warmup:
            ms.append(a.elapsed_time(b))
            host_us.append((t1 - t0) * 1e6)
    return ms, host_us


def pipelined_pass(loop, backend, graph, start, warmup: int, steps: int) -> list[float]:
    """Per timed step: ms between the events at consecutive steps' starts, steps enqueued back
    to back (the host a step ahead of the GPU)."""
    loop.reset(start)
    torch.cuda.synchronize()
    events = [torch.cuda.Event(enable_timing=True) for _ in range(warmup + steps + 1)]
    for i in range(warmup + steps):
        events[i].record()
        loop.step(backend, graph)
    events[-1].record()
    events[-1].synchronize()
    return [events[i].elapsed_time(events[i + 1]) for i in range(warmup, warmup + steps)]


def add_checks(rows: list[dict], checks: dict, ref0, dtype) -> None:
    """In place: every measured engine's layer-0 attention against the FP32 reference ``ref0``,
    then its agreement with the case's baseline (FlashInfer's fastest correct path; the
    baseline's with the next FlashInfer path, else with pkvrt); the no-attention row gets
    ``attention_signal``: how far its logits are from the baseline's, the size of a failure."""
    from pkvrt.measure.model_results import FLASHINFER_PREFIX, NO_ATTENTION, PKVRT, agreement, \
        baseline_engine, reference_check, rel_err

    measured = [r for r in rows if r["row"] == "measured" and r["engine"] in checks]
    for r in measured:
        if r["engine"] != NO_ATTENTION and ref0 is not None:
            r.update(reference_check(checks[r["engine"]][1], ref0, dtype=dtype))
    base = baseline_engine(rows)
    if base is None:
        return
    others = [e for e in checks if e.startswith(FLASHINFER_PREFIX) and e != base] + [PKVRT]
    for r in measured:
        e = r["engine"]
        if e == NO_ATTENTION:
            r["attention_signal"] = rel_err(checks[e][0], checks[base][0])[1]
            continue
        ref = base if e != base else next((o for o in others if o in checks), None)
        if ref is not None:
            r.update(agreement(*checks[e], *checks[ref], dtype=dtype), logits_vs=ref)


def run_case(case, model, engines, args, log) -> list[dict]:
    """Every engine on one case (see the module docstring); the case's rows."""
    from pkvrt.measure.model import DecodeLoop, make_caches, pages_needed, run_steps
    from pkvrt.measure.model_attention import make_backend
    from pkvrt.measure.model_results import check_failed, finish_case, measured_row, unavailable_row

    cfg, device = model.cfg, model.w.embed.device
    max_steps = 1 + max(args.check_steps, args.warmup + args.steps)  # +1: the capture's warm-up
    pages = pages_needed(case.batch, case.context, max_steps, cfg.page_size)
    caches = make_caches(cfg, pages, device=device, seed=SEED + 1)
    loop = DecodeLoop(model, caches, batch=case.batch, context=case.context, max_steps=max_steps,
                      seed=SEED)
    gen = torch.Generator(device=device).manual_seed(SEED + 2)
    forced = torch.randint(cfg.vocab, (args.check_steps, case.batch), generator=gen, device=device)
    rows, checks, ref0 = [], {}, None
    for name in engines:
        t0 = time.perf_counter()
        try:   # FlashInfer missing or failing to build (JIT) must not end the run
            backend = make_backend(name, cfg, loop)
            graph = loop.capture(backend)
        except Exception as exc:  # noqa: BLE001 - recorded as the engine being unavailable
            reason = f"{type(exc).__name__}: {exc}"[:500]
            rows.append(unavailable_row(case, name, model=cfg.name, reason=reason))
            log(f"  {name:<16} unavailable: {reason}")
            continue
        checks[name] = run_steps(loop, backend, forced, graph)
        if ref0 is None:   # layer 0's K/V of the pass depend only on the tokens: once per case
            bt = torch.as_tensor(loop.pool.block_tables, device=device)
            ref0 = model.layer0_reference(forced, caches, bt, context=case.context)
        sync_ms, host_us = sync_pass(loop, backend, graph, forced[0], args.warmup, args.steps)
        pipe_ms = pipelined_pass(loop, backend, graph, forced[0], args.warmup, args.steps)
        row = measured_row(case, name, model=cfg.name, sync_ms=sync_ms, pipelined_ms=pipe_ms,
                           host_us=host_us, warmup=args.warmup)
        if hasattr(backend, "check"):
            try:
                backend.check()  # pkvrt: the planning kernel flagged no row (length, page id)
            except RuntimeError as exc:
                row["status_error"] = str(exc)
        rows.append(row)
        log(f"  {name:<16} {row['ms_per_step']:8.3f} ms/step  {row['tokens_per_s']:9.1f} tok/s  "
            f"pipelined {row['pipelined_ms_per_step']:8.3f} ms  host {row['host_us']:6.0f} us  "
            f"({time.perf_counter() - t0:.1f} s)")
        del graph, backend
    add_checks(rows, checks, ref0, cfg.dtype)
    for r in rows:
        if r["row"] == "measured" and "attention_signal" not in r:
            log(f"  check {r['engine']:<16} layer 0 vs FP32 {r.get('attn0_ref_err', float('nan')):.1e}, "
                f"vs {r.get('logits_vs', '-')}: logits {r.get('logits_rel_err', float('nan')):.1e}"
                f"{'  FAILED' if check_failed(r) else ''}")
    rows += finish_case(rows)
    del loop, caches, checks
    if device.type == "cuda":
        torch.cuda.empty_cache()
    return rows


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", help="results JSON (rewritten after every case)")
    ap.add_argument("--batches", type=parse_counts, default=[1, 4, 8, 32])
    ap.add_argument("--contexts", type=parse_counts, default=[8192, 32768, 131072],
                    help="context tokens per row at the first step (K = 1024)")
    ap.add_argument("--engines", default=DEFAULT_ENGINES,
                    help=f"comma-separated (default, every engine: {DEFAULT_ENGINES})")
    ap.add_argument("--steps", type=int, default=20, help="timed steps per pass")
    ap.add_argument("--warmup", type=int, default=3, help="untimed steps before them")
    ap.add_argument("--check-steps", type=int, default=3)
    ap.add_argument("--layers", type=int, default=32)
    ap.add_argument("--dtype", choices=sorted(DTYPES), default="float16")
    args = ap.parse_args(argv)
    if not torch.cuda.is_available():
        print("model_decode.py: needs a CUDA GPU (torch.cuda.is_available() is False); nothing was run",
              file=sys.stderr)
        return 2
    from pkvrt.measure import results
    from pkvrt.measure.model import LLAMA3_8B, Model, make_weights, plan_cases
    from pkvrt.measure.model_attention import GPU_ENGINES
    from pkvrt.measure.model_results import KIND, check_failed, model_decode_table, skipped_row
    from pkvrt.policy.calibration import find_calibration
    from pkvrt.policy.registry import load_routes

    engines = [e.strip() for e in args.engines.split(",") if e.strip()]
    unknown = [e for e in engines if e not in GPU_ENGINES]
    if unknown or args.steps < 1 or args.warmup < 0 or args.check_steps < 1:
        ap.error(f"unknown engines {unknown} (expected {', '.join(GPU_ENGINES)})" if unknown
                 else "--steps and --check-steps must be >= 1, --warmup >= 0")

    def log(msg):
        print(msg, flush=True)

    name = LLAMA3_8B.name if args.layers == LLAMA3_8B.layers else f"{LLAMA3_8B.name}-L{args.layers}"
    cfg = attrs.evolve(LLAMA3_8B, layers=args.layers, dtype=DTYPES[args.dtype], name=name)
    capacity = torch.cuda.get_device_properties(0).total_memory
    max_steps = 1 + max(args.check_steps, args.warmup + args.steps)
    cases = plan_cases(cfg, args.batches, args.contexts, steps=max_steps, capacity_bytes=capacity)
    log(f"{cfg.name}: {cfg.layers} layers, weights {cases[0].weight_bytes / 2**30:.1f} GiB; "
        f"{torch.cuda.get_device_name()} {capacity / 2**30:.1f} GiB")
    for c in cases:
        log(f"  {c.name:<9} KV {c.kv_bytes / 2**30:6.1f} GiB  need {c.need_bytes / 2**30:6.1f} GiB  "
            f"{'fits' if c.fits else 'skipped'}")
    meta = results.make_meta(
        seeds=[SEED], routes_path=load_routes().path,
        calibration_path=find_calibration(torch.cuda.get_device_name()).source, kind=KIND,
        model={k: str(v) if isinstance(v, torch.dtype) else v for k, v in attrs.asdict(cfg).items()},
        engines=engines, steps=args.steps, warmup=args.warmup, check_steps=args.check_steps,
        capacity_gib=capacity / 2**30,
        protocol="whole-step CUDA graph per batch; sync = host work + replay from an idle GPU; "
                 "pipelined = steps back to back; attention share vs the no-attention step")
    t0 = time.perf_counter()
    model = Model(cfg, make_weights(cfg, seed=SEED))
    torch.cuda.synchronize()
    log(f"weights made in {time.perf_counter() - t0:.1f} s")
    rows = []
    for case in cases:
        if not case.fits:
            rows.append(skipped_row(case, model=cfg.name))
        else:
            log(f"{case.name} ({time.strftime('%H:%M:%S')})")
            try:
                rows += run_case(case, model, engines, args, log)
            except torch.cuda.OutOfMemoryError as exc:
                torch.cuda.empty_cache()
                rows.append(skipped_row(case, model=cfg.name, reason=f"out of memory: {exc}"[:300]))
                log("  out of memory: skipped")
        if args.out:
            results.write_results(args.out, meta, rows)
    table = model_decode_table([(args.out or "-", {"meta": meta, "rows": rows})])
    log("\n" + table)
    failed = [r for r in rows if r["row"] == "measured" and check_failed(r)]
    if failed:
        log(f"CHECK FAILED: {', '.join(r['case'] + ' ' + r['engine'] for r in failed)}")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
