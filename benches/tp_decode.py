"""Tensor-parallel decode: a Llama-3-8B-shaped decoder's step over TP GPUs, pkvrt's
attention on each rank's heads, the whole step (both all-reduces of every layer included) in one
CUDA graph per rank; step time, tokens/s and scaling efficiency per TP.

Protocol (``pkvrt/measure/model_tp.py`` says what a rank holds and computes):

1. One command runs every TP of ``--tp`` (default 1, 2, 4, 8; a TP with more ranks than this
   machine has GPUs is recorded as skipped): per TP it starts TP fresh processes
   (``pkvrt.measure.model_tp.spawn_ranks``: torch.multiprocessing, one GPU each, NCCL), which exit
   before the next TP starts, so every TP begins with empty GPUs.
2. Per TP, the cases: every batch x context (default B8 x 32K, 128K); one whose rank needs more
   than a GPU holds (its weight shard + its KV heads' caches + the scratch layer the caches are
   drawn through + 4 GiB headroom, ``model_tp.plan_tp_cases``; B8 x 128K at TP 1) is recorded as
   skipped with the bytes. The weights are the one-GPU model's (seed 20260623) sliced per rank,
   drawn one matrix at a time on the rank's GPU.
3. Per TP, first the check (``--check-context``, B2, ``--check-steps`` steps crossing a page
   boundary): the TP step against the same step computed on one GPU by rank 0 with the full
   model (``model_tp.check_against_one_gpu``; logits and layer 0's attention within the fp16
   tolerances of ``pkvrt.measure.model_results``, every rank's logits identical).
4. Per case: the rank's caches (its KV heads of the one-GPU caches), the step captured in one
   graph (``model_tp.capture_step``); ``--check-steps`` steps checked (layer 0's attention of
   each rank against FP32; every rank's logits identical); then three passes of ``--warmup`` +
   ``--steps`` steps enqueued back to back from the same initial state, a CUDA event pair around
   each replay (device time per replayed step; the host prepares the next step meanwhile):
   a. the step (``ms_per_step``: the slowest rank's median; tokens/s = B / that);
   b. the step captured without its all-reduces (``comm_share`` = 1 - b / a: all-reduce time plus
      waiting for the slowest rank; TP > 1 only);
   c. the step with attention's output replaced by q (``attention_share`` = 1 - c / a).
   Then one all-reduce of the step's [B, hidden] timed alone (a graph of 2 x layers of them).
5. Scaling efficiency = tokens/s at TP / (TP x tokens/s at TP 1), per case where TP 1 ran.

``--shard-only TP`` runs one rank's shard (rank 0 of TP) on GPU 0 alone, in this process, with
no communication at all: the per-rank cost of TP 2/4/8 measured on one GPU (mode
``shard-only``: no one-GPU check, no comm pass; its logits are not a model's).

Environment: NVLink multicast (NCCL_NVLS_ENABLE) is left as the machine sets it; nothing here
uses symmetric memory or multicast objects.

Results (``--out``): one JSON (``meta.kind`` "tp-decode", ``pkvrt.measure.tp_results`` says the rows),
rewritten after every TP; the table is printed last. Estimated time on an H200 pair with the
defaults (TP 1, 2): about 3-5 minutes, most of it drawing 137 GB of caches per rank for 128K.

usage: python benches/tp_decode.py --out FILE [--tp 1,2,4,8] [--batches 8] [--contexts 32K,128K]
       [--steps 20] [--warmup 5] [--check-steps 4] [--check-context 1005] [--layers 32]
       [--engine pkvrt] [--dtype float16] [--no-check]
       python benches/tp_decode.py --shard-only TP --out FILE [same options]
Exit status 1 when a check failed or a TP's ranks failed (the results are written all the same,
a failed TP as skipped rows naming the error), 2 without a GPU.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path

import attrs
import torch

from pkvrt.measure.model_results import parse_counts

SEED = 20260623
DTYPES = {"float16": torch.float16, "bfloat16": torch.bfloat16}
CHECK_BATCH = 2
ENGINES = ("pkvrt", "flashinfer-tc", "flashinfer-cuda", "flashinfer-xqa")


def bench_config(args):
    from pkvrt.measure.model import LLAMA3_8B

    name = LLAMA3_8B.name if args.layers == LLAMA3_8B.layers else f"{LLAMA3_8B.name}-L{args.layers}"
    return attrs.evolve(LLAMA3_8B, layers=args.layers, dtype=DTYPES[args.dtype], name=name)


def nccl_version() -> str | None:
    try:
        import torch.cuda.nccl as nccl

        v = nccl.version()
        return ".".join(map(str, v)) if isinstance(v, tuple) else str(v)
    except Exception:  # noqa: BLE001 - a torch without NCCL: recorded as None
        return None


def max_steps_of(args) -> int:
    return 1 + max(args.check_steps, args.warmup + args.steps)   # +1: a capture's warm-up step


# --------------------------------------------------------------------------- one rank

def gather_objects(obj, group) -> list:
    """Every rank's ``obj`` in rank order (``[obj]`` without a group)."""
    import torch.distributed as dist

    if group is None:
        return [obj]
    out = [None] * dist.get_world_size(group)
    dist.all_gather_object(out, obj, group=group)
    return out


def barrier(group) -> None:
    import torch.distributed as dist

    if group is not None:
        dist.barrier(group=group)


def timed_pass(loop, backend, graph, start, warmup: int, steps: int):
    """Steps enqueued back to back from the initial state (tokens ``start``), an event pair
    around each replay: (device ms per replay, ms between consecutive replays' starts), over the
    steps after ``warmup``."""
    loop.reset(start)
    torch.cuda.synchronize()
    events = [(torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True))
              for _ in range(warmup + steps)]
    for a, b in events:
        loop.prepare(backend)          # host: the next token's page and slot, the lengths' copy
        a.record()
        graph.replay()
        b.record()
    torch.cuda.synchronize()
    timed = events[warmup:]
    replay = [a.elapsed_time(b) for a, b in timed]
    interval = [timed[i][0].elapsed_time(timed[i + 1][0]) for i in range(len(timed) - 1)]
    return replay, interval or replay


def allreduce_alone_us(model, batch: int, calls: int, warmup: int, steps: int) -> float:
    """Median µs of one all-reduce of a [batch, hidden] tensor of the model's dtype, from a
    graph of ``calls`` of them replayed ``warmup + steps`` times (zeros: the sums stay 0)."""
    import torch.distributed as dist

    from pkvrt.runtime import graphs

    device = model.device
    buf = torch.zeros(batch, model.full.hidden, dtype=model.full.dtype, device=device)

    def launch():
        for _ in range(calls):
            dist.all_reduce(buf, group=model.group)

    entry = graphs.capture(launch, side_stream=torch.cuda.Stream(device), pool=None, device=device,
                           capture_error_mode="thread_local")
    events = [(torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True))
              for _ in range(warmup + steps)]
    for a, b in events:
        a.record()
        entry.graph.replay()
        b.record()
    torch.cuda.synchronize()
    ms = statistics.median(a.elapsed_time(b) for a, b in events[warmup:])
    del entry
    return ms * 1e3 / calls


def rank_case(case, model, args, log) -> dict | None:
    """This rank's record of one case (``pkvrt.measure.tp_results.measured_row``'s ``ranks`` entry), or
    None when some rank could not allocate the case's caches (every rank then skips it)."""
    from pkvrt.measure import model_tp
    from pkvrt.measure.model import DecodeLoop, pages_needed
    from pkvrt.measure.model_attention import NoAttention, make_backend
    from pkvrt.measure.model_results import rel_err

    cfg, device, group = model.full, model.device, model.group
    max_steps = max_steps_of(args)
    pages = pages_needed(case.batch, case.context, max_steps, cfg.page_size)
    try:
        caches = model_tp.make_shard_caches(cfg, model.shard, pages, device=device, seed=SEED + 1)
        ok = True
    except torch.cuda.OutOfMemoryError:
        caches, ok = None, False
    torch.cuda.empty_cache()
    if not all(gather_objects(ok, group)):
        return None
    loop = DecodeLoop(model, caches, batch=case.batch, context=case.context, max_steps=max_steps,
                      seed=SEED)
    forced = torch.randint(cfg.vocab, (args.check_steps, case.batch),
                           generator=torch.Generator().manual_seed(SEED + 2)).to(device)
    rec = {}
    t0 = time.perf_counter()
    backend = make_backend(args.engine, model.cfg, loop)
    graph = model_tp.capture_step(loop, backend)
    logits, attn0 = model_tp.run_steps(loop, backend, forced, graph)
    bt = torch.as_tensor(loop.pool.block_tables, device=device)
    ref0 = model.layer0_reference(forced, caches, bt, context=case.context)
    rec["attn0_ref_err"] = rel_err(attn0, ref0)[1]
    every = model_tp.gather(logits, group)
    rec["ranks_agree"] = all(torch.equal(x, every[0]) for x in every)
    barrier(group)
    rec["replay_ms"], rec["interval_ms"] = timed_pass(loop, backend, graph, forced[0], args.warmup, args.steps)
    if hasattr(backend, "check"):
        try:
            backend.check()            # pkvrt: the planning kernel flagged no row
        except RuntimeError as exc:
            rec["status_error"] = str(exc)
    del graph
    rec["no_comm_ms"] = None
    if model.communicate:              # b. the same step without its all-reduces
        model.communicate = False
        try:
            graph = model_tp.capture_step(loop, backend)
            rec["no_comm_ms"], _ = timed_pass(loop, backend, graph, forced[0], args.warmup, args.steps)
            del graph
        finally:
            model.communicate = True
        barrier(group)
    none = NoAttention()               # c. the step without attention
    graph = model_tp.capture_step(loop, none)
    rec["no_attention_ms"], _ = timed_pass(loop, none, graph, forced[0], args.warmup, args.steps)
    del graph
    rec["allreduce_us"] = (allreduce_alone_us(model, case.batch, 2 * cfg.layers, args.warmup, args.steps)
                           if model.communicate else None)
    log(f"  {case.name}: {statistics.median(rec['replay_ms']):.3f} ms/step (rank 0), "
        f"no-attention {statistics.median(rec['no_attention_ms']):.3f}, "
        + (f"no-comm {statistics.median(rec['no_comm_ms']):.3f}, all-reduce {rec['allreduce_us']:.1f} us, "
           if rec["no_comm_ms"] else "")
        + f"layer 0 vs FP32 {rec['attn0_ref_err']:.1e} ({time.perf_counter() - t0:.1f} s)")
    del backend, loop, caches
    torch.cuda.empty_cache()
    return rec


def run_tp(tp: int, rank: int, device, group, args, log, cfg=None) -> list[dict]:
    """Every case of ``args`` at ``tp`` on this rank (module docstring); the rows on rank 0, []
    on the others. ``group`` None: ``--shard-only`` (rank 0's shard alone, no communication).
    ``cfg``: the model (default: the 8B shape with ``args.layers`` and ``args.dtype``)."""
    import torch.distributed as dist

    from pkvrt.measure import model_tp
    from pkvrt.measure import tp_results as R

    cfg = cfg or bench_config(args)
    mode = "shard-only" if group is None else str(dist.get_backend(group))
    capacity = min(gather_objects(torch.cuda.get_device_properties(device).total_memory, group))
    cases = model_tp.plan_tp_cases(cfg, tp, args.batches, args.contexts, steps=max_steps_of(args),
                                   capacity_bytes=capacity)
    shard = model_tp.shard_of(cfg, tp, rank)
    t0 = time.perf_counter()
    model = model_tp.TPModel(cfg, shard, model_tp.make_shard_weights(cfg, shard, device=device, seed=SEED),
                             group=group)
    torch.cuda.synchronize()
    log(f"TP {tp} ({mode}): {cfg.name}, shard of {cases[0].weight_bytes / 2**30:.1f} GiB per rank made "
        f"in {time.perf_counter() - t0:.1f} s; {capacity / 2**30:.1f} GiB per GPU")
    rows = []
    if group is not None and not args.no_check:
        chk = model_tp.check_against_one_gpu(model, engine=args.engine, batch=CHECK_BATCH,
                                             context=args.check_context, steps=args.check_steps,
                                             weight_seed=SEED, cache_seed=SEED + 1, pool_seed=SEED,
                                             token_seed=SEED + 2)
        if rank == 0:
            case = model_tp.plan_tp_cases(cfg, tp, [CHECK_BATCH], [args.check_context],
                                          steps=args.check_steps + 1, capacity_bytes=capacity)[0]
            rows.append(R.check_row(case, model=cfg.name, engine=args.engine, tp=tp, mode=mode,
                                    steps=args.check_steps, fields=chk.fields, ranks_agree=chk.ranks_agree))
            log(f"  check against one GPU: logits {chk.fields['logits_rel_err']:.1e}, layer 0 "
                f"{chk.fields['attn0_rel_err']:.1e}, ranks identical {chk.ranks_agree}"
                f"{'  FAILED' if R.check_failed(rows[-1]) else ''}")
    for case in cases:
        if not case.fits:
            rows.append(R.skipped_row(case, model=cfg.name, tp=tp, mode=mode))
            continue
        barrier(group)
        rec = rank_case(case, model, args, log)
        if rec is None:
            rows.append(R.skipped_row(case, model=cfg.name, tp=tp, mode=mode,
                                      reason=f"TP {tp}: out of memory drawing the caches on some rank"))
            continue
        ranks = gather_objects(rec, group)
        rows.append(R.measured_row(case, model=cfg.name, engine=args.engine, tp=tp, mode=mode, ranks=ranks,
                                   warmup=args.warmup, steps=args.steps, allreduce_calls=2 * cfg.layers,
                                   dtype=cfg.dtype))
    return rows if rank == 0 else []


def _worker(tp: int, args, out_path: str) -> None:
    """One spawned rank of one TP: run_tp, rank 0 writes its rows (and the ranks' GPUs) to
    ``out_path``."""
    import torch.distributed as dist

    from pkvrt.measure import model_tp

    rank, world, device = model_tp.init_distributed()
    try:
        if world != tp:
            raise RuntimeError(f"tp_decode: {world} ranks started for TP {tp}")
        log = (lambda msg: print(msg, flush=True)) if rank == 0 else (lambda msg: None)
        rows = run_tp(tp, rank, device, dist.group.WORLD, args, log)
        gpus = gather_objects(torch.cuda.get_device_name(device), dist.group.WORLD)
        if rank == 0:
            Path(out_path).write_text(json.dumps({"rows": rows, "gpus": gpus}, default=float))
    finally:
        dist.destroy_process_group()


# --------------------------------------------------------------------------- the command

def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", help="results JSON (rewritten after every TP)")
    ap.add_argument("--tp", type=parse_counts, default=[1, 2, 4, 8],
                    help="tensor-parallel sizes (those above the GPU count are recorded as skipped)")
    ap.add_argument("--shard-only", type=int, metavar="TP",
                    help="one rank's shard of TP on GPU 0, no communication (per-rank cost)")
    ap.add_argument("--batches", type=parse_counts, default=[8])
    ap.add_argument("--contexts", type=parse_counts, default=[32768, 131072],
                    help="context tokens per row at the first step (K = 1024)")
    ap.add_argument("--engine", choices=ENGINES, default="pkvrt", help="every rank's attention")
    ap.add_argument("--steps", type=int, default=20, help="timed steps per pass")
    ap.add_argument("--warmup", type=int, default=5, help="untimed steps before them")
    ap.add_argument("--check-steps", type=int, default=4)
    ap.add_argument("--check-context", type=int, default=1005,
                    help="context of the one-GPU check (B2; 1005 + 4 steps crosses a page)")
    ap.add_argument("--no-check", action="store_true", help="skip the one-GPU check")
    ap.add_argument("--layers", type=int, default=32)
    ap.add_argument("--dtype", choices=sorted(DTYPES), default="float16")
    args = ap.parse_args(argv)
    if args.steps < 2 or args.warmup < 0 or args.check_steps < 1 or args.check_context < 1:
        ap.error("--steps must be >= 2, --warmup >= 0, --check-steps and --check-context >= 1")
    if not torch.cuda.is_available():
        print("tp_decode.py: needs CUDA GPUs (torch.cuda.is_available() is False); nothing was run",
              file=sys.stderr)
        return 2
    from pkvrt.measure import model_tp, results
    from pkvrt.measure import tp_results as R
    from pkvrt.policy.calibration import find_calibration
    from pkvrt.policy.registry import load_routes

    cfg = bench_config(args)
    tps = [args.shard_only] if args.shard_only else args.tp
    for tp in tps:
        try:
            model_tp.check_tp(cfg, tp)
        except ValueError as exc:
            ap.error(str(exc))

    def log(msg):
        print(msg, flush=True)

    n_gpus = torch.cuda.device_count()
    meta = results.make_meta(
        seeds=[SEED], routes_path=load_routes().path,
        calibration_path=find_calibration(torch.cuda.get_device_name(0)).source, kind=R.KIND,
        model={k: str(v) if isinstance(v, torch.dtype) else v for k, v in attrs.asdict(cfg).items()},
        engine=args.engine, tp=tps, shard_only=bool(args.shard_only), batches=args.batches,
        contexts=args.contexts, steps=args.steps, warmup=args.warmup, check_steps=args.check_steps,
        check_context=args.check_context, gpu_count=n_gpus,
        nccl=nccl_version(),
        nccl_nvls_enable=os.environ.get("NCCL_NVLS_ENABLE"), tp_gpus={},
        protocol="one CUDA graph per rank and step; device ms per replay (events around the replay, "
                 "steps back to back), slowest rank's median; attention share vs the no-attention "
                 "step, all-reduce share vs the step captured without all-reduces")
    rows: list[dict] = []
    failed_tps: list[int] = []

    def write():
        R.finish(rows)
        if args.out:
            results.write_results(args.out, meta, rows)

    if args.shard_only:
        device = torch.device("cuda", 0)
        torch.cuda.set_device(device)
        rows += run_tp(args.shard_only, 0, device, None, args, log)
        meta["tp_gpus"][str(args.shard_only)] = [torch.cuda.get_device_name(device)]
        write()
    for tp in ([] if args.shard_only else tps):
        if tp > n_gpus:
            for case in model_tp.plan_tp_cases(cfg, tp, args.batches, args.contexts,
                                               steps=max_steps_of(args), capacity_bytes=0):
                rows.append(R.skipped_row(case, model=cfg.name, tp=tp,
                                          reason=f"TP {tp} needs {tp} GPUs; this machine has {n_gpus}"))
            write()
            continue
        log(f"TP {tp}: starting {tp} rank(s) ({time.strftime('%H:%M:%S')})")
        with tempfile.TemporaryDirectory() as tmp:
            out = Path(tmp) / "rows.json"
            try:
                model_tp.spawn_ranks(_worker, tp, tp, args, str(out))
            except Exception as exc:  # noqa: BLE001 - a failed TP is recorded, the next one runs
                log(f"TP {tp} FAILED: {exc}")
                failed_tps.append(tp)
                for case in model_tp.plan_tp_cases(cfg, tp, args.batches, args.contexts,
                                                   steps=max_steps_of(args), capacity_bytes=0):
                    rows.append(R.skipped_row(case, model=cfg.name, tp=tp,
                                              reason=f"TP {tp} failed: {type(exc).__name__}: {exc}"[:500]))
                write()
                continue
            got = json.loads(out.read_text())
        rows += got["rows"]
        meta["tp_gpus"][str(tp)] = got["gpus"]
        write()
    log("\n" + R.tp_decode_table([(args.out or "-", {"meta": meta, "rows": rows})]))
    failed = [r for r in rows if r["row"] in ("measured", "check") and R.check_failed(r)]
    if failed:
        log("CHECK FAILED: " + ", ".join(f"{r['case']} TP {r['tp']} ({r['row']})" for r in failed))
    if failed_tps:
        log(f"FAILED: TP {', '.join(map(str, failed_tps))} (a rank raised; its traceback is above)")
    return 1 if failed or failed_tps else 0


if __name__ == "__main__":
    sys.exit(main())
