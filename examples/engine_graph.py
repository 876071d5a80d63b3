"""A whole decode step (32 layers of attention) captured in the engine's own CUDA graph and
replayed every step with new lengths, in either of the two ways an engine can embed pkvrt.

Device lengths (the default): ``Runtime(...)`` given its lengths on the GPU. The engine
keeps the batch's lengths and block tables in device tensors (its scheduler updates them in
place); ``plan()`` then only launches work on the current stream (a copy of the lengths, a copy of
the block tables, the planning kernel), so the engine captures it together with every layer's
``run()`` and replays one graph step after step without any host planning.

Host lengths (``--host-routing``): ``Runtime(engine_capture=True)``. The engine calls ``plan()``
with host lengths before each replay (routes.toml's policy picks the route; a workqueue/fused
plan is built on the GPU by the planning kernel, which the step's first ``run()`` launches, so the
graph holds it; a FlashInfer step is planned by FlashInfer), and keeps one graph of the layers'
``run()`` calls per ``rt.step_key``, captured the first time a key is seen.

The lengths grow by one token a step; every few steps the last layer's output is checked against
the FP32 reference, and at the end the host time per step and the graphs captured are printed.

usage: python examples/engine_graph.py [--layers 32] [--steps 50] [--host-routing]
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
    ap.add_argument("--host-routing", action="store_true",
                    help="host lengths, routes.toml's policy, a graph per Runtime.step_key")
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

    if args.host_routing:
        return host_routed(args, rt_args=(H_Q, H_KV, HEAD_DIM, PAGE, torch.float16), width=width,
                           q=q, k_all=k_all, v_all=v_all, outs=outs, block_tables=block_tables)
    # GPU lengths at plan() make it device planning; inside the capture its launches go into
    # the graph (page ids are checked on the GPU against num_pages)
    rt = pkvrt.Runtime(H_Q, H_KV, HEAD_DIM, PAGE, torch.float16, max_batch=8,
                       max_pages_per_row=width, num_pages=k_all[0].shape[0])

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


def host_routed(args, *, rt_args, width, q, k_all, v_all, outs, block_tables) -> int:
    """``--host-routing``: plan() with host lengths before each step, a graph per step_key."""
    import pkvrt
    from pkvrt import reference
    from pkvrt.runtime.graphs import capture

    rt = pkvrt.Runtime(*rt_args, max_batch=8, max_pages_per_row=width, engine_capture=True,
                       num_pages=k_all[0].shape[0])
    lens = list(LENGTHS)                         # the engine's host lengths
    bt_host = block_tables.cpu().numpy()
    graphs: dict = {}

    def layers():
        for layer in range(args.layers):
            rt.run(q, k_all[layer], v_all[layer], out=outs[layer])

    host_us, ok, routes = [], True, {}
    for i in range(args.steps):
        lens = [n + 1 for n in lens]             # the engine's scheduler: one more token per row
        # (the timing starts on an idle GPU: plan()'s pinned staging ring waits for the copies of
        # the step before last, so a host that runs ahead would time the GPU's step, not its own)
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        d = rt.plan(lens, bt_host)               # routes.toml's policy, on the host
        g = graphs.get(rt.step_key)
        if g is None:                            # first step of this key: warm up + capture
            g = graphs[rt.step_key] = capture(layers).graph
        else:
            g.replay()
            host_us.append((time.perf_counter() - t0) * 1e6)
        routes[d.route] = routes.get(d.route, 0) + 1
        if i % 10 == 0 or i == args.steps - 1:
            torch.cuda.synchronize()
            seq = torch.tensor(lens, dtype=torch.int32, device="cuda")
            ref = reference.decode_attention(q, k_all[-1], v_all[-1], seq, block_tables)
            err = ((outs[-1].float() - ref).abs().max() / ref.abs().max()).item()
            ok &= err < 2e-3
            print(f"step {i:3d}: {d.route:14s} lengths {lens}  rel err {err:.1e}")
    torch.cuda.synchronize()
    print(f"routes {routes}; {len(graphs)} graphs captured (one per step key)")
    if host_us:
        print(f"host time per replayed step (plan + the replay of {args.layers} layers, GPU idle "
              f"at its start): median {statistics.median(host_us):.1f} us over {len(host_us)} "
              "replayed steps")
    print("OK" if ok else "MISMATCH")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
