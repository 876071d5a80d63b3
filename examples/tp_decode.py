"""Tensor-parallel decode steps of a Llama-3-8B-shaped decoder over N GPUs, pkvrt's attention on
each rank's heads, the whole step in one CUDA graph per rank (pkvrt/measure/model_tp.py).

Each of the N ranks draws its shard of the one-GPU model's random weights on its GPU (H_q/N and
H_kv/N heads, 1/N of every projection's and the MLP's columns, the embedding and LM head
replicated) and its KV heads of the caches for ``--batch`` rows of ``--context`` tokens, then:

1. the check: ``--check-steps`` steps at B2 x ``--check-context`` tokens (crossing a page
   boundary), each captured in one graph, against the same steps computed on one GPU by rank 0
   with the full model (logits and layer 0's attention within the fp16 tolerances of
   ``pkvrt.measure.model_results``; every rank's logits identical);
2. the run: one decode step captured in one CUDA graph per rank (per layer RMSNorm, the rank's
   QKV, RoPE, the new token's K/V appended into its page, pkvrt's decode attention with device
   planning over the rank's heads, the rank's part of the output projection, an all-reduce,
   the rank's part of the SwiGLU MLP, an all-reduce; final norm, LM head, greedy argmax) and
   replayed ``--steps`` times, the rows growing by one token a step. Rank 0 prints ms per step
   and tokens/s (steps enqueued back to back, as an engine runs them).

usage (N GPUs; N = 1 works too):
    torchrun --nproc-per-node N examples/tp_decode.py [--batch 8] [--context 32768] [--steps 10]
    python3 -m torch.distributed.run --nproc-per-node N examples/tp_decode.py ...  (no torchrun
        script on PATH)
    python3 examples/tp_decode.py ...        (one process: N = 1)
options: [--layers 32] [--engine pkvrt] [--check-context 1005] [--check-steps 4] [--no-check]
Needs N CUDA GPUs, each with the rank's shard (8.5 GiB at N = 2) + its KV heads (128 KiB per token
over N) + 4 GiB; rank 0 briefly holds the full 15 GiB model for the check. Without a GPU it says
so and exits 0. ``benches/tp_decode.py`` measures TP 1, 2, 4, 8 in one command.
"""

from __future__ import annotations

import argparse
import os
import sys
import time

import attrs
import torch

WARMUP = 2
ENGINES = ("pkvrt", "flashinfer-tc", "flashinfer-cuda", "flashinfer-xqa")


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--batch", type=int, default=8)
    ap.add_argument("--context", type=int, default=32768, help="tokens per row at the first step")
    ap.add_argument("--steps", type=int, default=10)
    ap.add_argument("--layers", type=int, default=32)
    ap.add_argument("--engine", choices=ENGINES, default="pkvrt", help="every rank's attention")
    ap.add_argument("--check-context", type=int, default=1005)
    ap.add_argument("--check-steps", type=int, default=4)
    ap.add_argument("--no-check", action="store_true", help="skip the check against one GPU")
    args = ap.parse_args(argv)
    if not torch.cuda.is_available():
        print("examples/tp_decode.py needs CUDA GPUs (torch sees none); nothing to run here.")
        return 0

    import torch.distributed as dist

    from pkvrt.measure import model_tp
    from pkvrt.measure.model import LLAMA3_8B, DecodeLoop, pages_needed
    from pkvrt.measure.model_attention import make_backend

    if "RANK" not in os.environ:   # plain `python examples/tp_decode.py`: one rank
        os.environ.update(RANK="0", WORLD_SIZE="1", LOCAL_RANK="0", MASTER_ADDR="127.0.0.1",
                          MASTER_PORT=str(model_tp.free_port()))
    rank, world, device = model_tp.init_distributed()
    group = dist.group.WORLD

    def say(msg):
        if rank == 0:
            print(msg, flush=True)

    try:
        name = LLAMA3_8B.name if args.layers == LLAMA3_8B.layers else f"{LLAMA3_8B.name}-L{args.layers}"
        cfg = attrs.evolve(LLAMA3_8B, layers=args.layers, name=name)
        steps = WARMUP + args.steps + 1                  # + the capture's warm-up step
        capacity = torch.cuda.get_device_properties(device).total_memory
        case = model_tp.plan_tp_cases(cfg, world, [args.batch], [args.context], steps=steps,
                                      capacity_bytes=capacity)[0]   # checks that TP = N splits cfg
        if not case.fits:
            say(f"B{args.batch} x {args.context} does not fit at TP {world}: {case.reason}")
            return 1
        t0 = time.perf_counter()
        shard = model_tp.shard_of(cfg, world, rank)
        model = model_tp.TPModel(cfg, shard, model_tp.make_shard_weights(cfg, shard, device=device, seed=0),
                                 group=group)
        say(f"{cfg.name}, {cfg.layers} layers at TP {world}: rank shard {case.weight_bytes / 2**30:.1f} GiB "
            f"(H_q {model.cfg.num_qo_heads}, H_kv {model.cfg.num_kv_heads}, MLP {model.cfg.intermediate}) "
            f"made in {time.perf_counter() - t0:.1f} s")
        ok = True
        if not args.no_check:
            chk = model_tp.check_against_one_gpu(model, engine=args.engine, batch=2,
                                                 context=args.check_context, steps=args.check_steps,
                                                 weight_seed=0, cache_seed=1)
            if rank == 0:
                f = chk.fields
                ok = bool(f["logits_ok"] and chk.ranks_agree)
                print(f"check against one GPU (B2 x {args.check_context}, {args.check_steps} steps): "
                      f"logits rel. err {f['logits_rel_err']:.1e}, layer 0 {f['attn0_rel_err']:.1e}, "
                      f"argmax agree {f['argmax_agree']:.0%}, ranks identical {chk.ranks_agree}: "
                      f"{'ok' if ok else 'FAILED'}", flush=True)

        t0 = time.perf_counter()
        pages = pages_needed(args.batch, args.context, steps, cfg.page_size)
        caches = model_tp.make_shard_caches(cfg, shard, pages, device=device, seed=1)
        loop = DecodeLoop(model, caches, batch=args.batch, context=args.context, max_steps=steps)
        attention = make_backend(args.engine, model.cfg, loop)
        graph = model_tp.capture_step(loop, attention)   # prepares and runs one step, then captures
        torch.cuda.synchronize()
        say(f"B{args.batch} x {args.context} tokens: KV {case.kv_bytes / 2**30:.1f} GiB per rank; "
            f"caches made and step captured in {time.perf_counter() - t0:.1f} s")

        loop.reset(torch.zeros(args.batch, dtype=torch.int64, device=device))
        for _ in range(WARMUP):
            loop.step(attention, graph)
        dist.barrier(group=group)
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        for _ in range(args.steps):
            loop.step(attention, graph)                  # host: slots, lengths copy; GPU: replay
        end.record()
        end.synchronize()
        if hasattr(attention, "check"):
            attention.check()                            # raises if a length or page id was bad
        ms = start.elapsed_time(end) / args.steps
        every = model_tp.gather(loop.tokens, group)
        same = all(torch.equal(t, every[0]) for t in every)
        say(f"{ms:.2f} ms per step, {args.batch / (ms * 1e-3):.0f} tokens/s over {args.steps} steps "
            f"at TP {world} (lengths now {loop.pool.lengths.min()}..{loop.pool.lengths.max()}); next "
            f"tokens {loop.tokens.tolist()[:8]}, the same on every rank: {same}")
        if not torch.isfinite(loop.logits).all() or not same:
            say("non-finite logits" if same else "the ranks' tokens differ")
            ok = False
        return 0 if ok else 1
    finally:
        dist.destroy_process_group()


if __name__ == "__main__":
    sys.exit(main())
