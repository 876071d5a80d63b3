"""A whole decode step (planning + 32 layers of attention) captured in the engine's own CUDA
graph, replayed every step with new lengths: ``Runtime(device_planning=True,
use_cuda_graph=False)``.

The engine keeps the batch's lengths and block tables in device tensors (its scheduler updates
them in place); ``plan()`` then only launches work on the current stream (a copy of the lengths,
a copy of the block tables, the planning kernel), so the engine can capture it together with every
layer's ``run()`` and replay the graph step after step without any host planning. The lengths
grow by one token a step; every few steps the last layer's output is checked against the FP32
reference, and at the end the host time per replayed step is printed.

usage: python examples/engine_graph.py [--layers 32] [--steps 50]
Needs a CUDA GPU; without one it says so and exits 0.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time

import torch

H_Q, H_KV, HEAD_DIM, PAGE = 32, 8, 128, 16
LENGTHS = [20000, 17500, 3000, 900, 18000, 33]   # a batch of 6 rows (graph captured for B = 6)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--layers", type=int, default=32)
    ap.add_argument("--steps", type=int, default=50)
    args = ap.parse_args(argv)
    if not torch.cuda.is_available():
        print("examples/engine_graph.py needs a CUDA GPU (torch sees none); nothing to run here.")
        return 0

    import pkvrt
    from pkvrt import reference
    from pkvrt.runtime.graphs import capture

    b = len(LENGTHS)
    width = -(-(max(LENGTHS) + args.steps) // PAGE)
    num_pages = b * width
    gen = torch.Generator(device="cuda").manual_seed(20260623)
    # Scattered physical pages: row r owns a random set of `width` pages of the universe.
    block_tables = torch.randperm(num_pages, device="cuda", generator=gen).view(b, width).int()
    shape = (args.layers, num_pages, H_KV, PAGE, HEAD_DIM)
    k_all = torch.randn(shape, device="cuda", dtype=torch.float16, generator=gen)
    v_all = torch.randn(shape, device="cuda", dtype=torch.float16, generator=gen)
    q = torch.randn(b, H_Q, HEAD_DIM, device="cuda", dtype=torch.float16, generator=gen)
    outs = [torch.empty_like(q) for _ in range(args.layers)]
    seq_lens = torch.tensor(LENGTHS, dtype=torch.int32, device="cuda")   # the engine's tensor

    rt = pkvrt.Runtime(H_Q, H_KV, HEAD_DIM, PAGE, torch.float16, max_batch=8,
                       max_pages_per_row=width, device_planning=True, use_cuda_graph=False,
                       num_pages=k_all[0].shape[0])   # page ids are checked on the GPU

    def step():
        rt.plan(seq_lens, block_tables)
        for layer in range(args.layers):
            rt.run(q, k_all[layer], v_all[layer], out=outs[layer])

    # one warm-up run on a side stream (kernels loaded, buffers sized), then the capture
    graph = capture(step).graph
    print(f"captured one graph for plan + {args.layers} layers: B={b}, "
          f"{2 * k_all.numel() * 2 / 2**30:.1f} GiB of KV")

    host_us, ok = [], True
    for i in range(args.steps):
        seq_lens += 1                            # the engine's scheduler: one more token per row
        t0 = time.perf_counter()
        graph.replay()
        host_us.append((time.perf_counter() - t0) * 1e6)
        if i % 10 == 0 or i == args.steps - 1:
            torch.cuda.synchronize()
            ref = reference.decode_attention(q, k_all[-1], v_all[-1], seq_lens, block_tables)
            err = ((outs[-1].float() - ref).abs().max() / ref.abs().max()).item()
            ok &= err < 2e-3
            print(f"step {i:3d}: lengths {seq_lens.tolist()}  rel err {err:.1e}")
    torch.cuda.synchronize()
    rt.device_status()                           # raises if a length was out of range
    print(f"host time per replayed step (plan + {args.layers} layers): median "
          f"{statistics.median(host_us):.1f} us over {args.steps} steps")
    print("OK" if ok else "MISMATCH")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
