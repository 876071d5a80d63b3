"""A Llama-3-8B-shaped decoder's decode steps with pkvrt's attention, the whole step in one CUDA
graph (pkvrt/measure/model.py): what pkvrt does to a model's decode step.

Makes the model (random fp16 weights drawn on the GPU, 16 GB, nothing downloaded) and its 32
layers' paged KV caches for ``--batch`` rows of ``--context`` random tokens, captures one decode
step in one CUDA graph (embedding; per layer RMSNorm, QKV, RoPE, the new token's K/V appended
into its page, pkvrt's decode attention with device planning, output projection, SwiGLU MLP;
final norm, LM head, greedy argmax) and replays it ``--steps`` times, the rows growing by one
token a step (a new page from the free list when a token starts one). Prints ms per step and
tokens/s (steps enqueued back to back, as an engine runs them).

usage: python examples/llama_decode.py [--batch 4] [--context 32768] [--steps 10] [--layers 32]
Needs a CUDA GPU with about 17 GB + the KV cache (128 KiB per token: B4 x 32K = 16 GiB);
without one it says so and exits 0. ``benches/model_decode.py`` compares it with FlashInfer.
"""

from __future__ import annotations

import argparse
import sys
import time

import attrs
import torch

WARMUP = 2


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--batch", type=int, default=4)
    ap.add_argument("--context", type=int, default=32768, help="tokens per row at the first step")
    ap.add_argument("--steps", type=int, default=10)
    ap.add_argument("--layers", type=int, default=32)
    args = ap.parse_args(argv)
    if not torch.cuda.is_available():
        print("examples/llama_decode.py needs a CUDA GPU (torch sees none); nothing to run here.")
        return 0

    from pkvrt.measure.model import LLAMA3_8B, DecodeLoop, Model, kv_bytes, make_caches, make_weights, \
        pages_needed
    from pkvrt.measure.model_attention import PkvrtAttention

    name = LLAMA3_8B.name if args.layers == LLAMA3_8B.layers else f"{LLAMA3_8B.name}-L{args.layers}"
    cfg = attrs.evolve(LLAMA3_8B, layers=args.layers, name=name)
    steps = WARMUP + args.steps + 1                      # + the capture's warm-up step
    t0 = time.perf_counter()
    model = Model(cfg, make_weights(cfg, seed=0))
    caches = make_caches(cfg, pages_needed(args.batch, args.context, steps, cfg.page_size), seed=1)
    loop = DecodeLoop(model, caches, batch=args.batch, context=args.context, max_steps=steps)
    attention = PkvrtAttention(cfg, loop)
    graph = loop.capture(attention)                     # prepares and runs one step, then captures
    torch.cuda.synchronize()
    print(f"{cfg.name}, {cfg.layers} layers: B{args.batch} x {args.context} tokens, "
          f"KV {kv_bytes(cfg, args.batch, args.context, steps) / 2**30:.1f} GiB; model made and "
          f"step captured in {time.perf_counter() - t0:.1f} s")

    loop.reset(torch.zeros(args.batch, dtype=torch.int64, device="cuda"))
    for _ in range(WARMUP):
        loop.step(attention, graph)
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(args.steps):
        loop.step(attention, graph)                      # host: slots, lengths copy; GPU: replay
    end.record()
    end.synchronize()
    attention.check()                                    # raises if a length or page id was bad
    ms = start.elapsed_time(end) / args.steps
    print(f"{ms:.2f} ms per step, {args.batch / (ms * 1e-3):.0f} tokens/s over {args.steps} steps "
          f"(lengths now {loop.pool.lengths.min()}..{loop.pool.lengths.max()}); next tokens "
          f"{loop.tokens.tolist()[:8]}")
    if not torch.isfinite(loop.logits).all():
        print("non-finite logits")
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
