"""Rows that share pages (prefix caching, parallel sampling) through ``pkvrt.SharedPagesRuntime``,
both ways an engine can feed it, checked against the FP32 reference.

The batch: four samples of one 6 000-token prompt (n = 4 parallel sampling: their block tables
begin with the prompt's pages), three conversations under one 2 048-token system prompt (prefix
caching), and one request of its own. Each sample and conversation then has pages of its own.

Host lengths: ``plan(seq_lens, block_tables)`` with numpy arrays finds every shared page run on
the host and ``run()`` per layer reads each run once per chunk of rows.

Device lengths (``device_planning=True``): lengths and block tables stay in GPU tensors that the
engine updates in place; ``plan()`` and every layer's ``run()`` are captured in one CUDA graph
(``RuntimeOptions(use_cuda_graph=False)``: the Runtime's own graphs off) and replayed step after
step while the rows grow; the sharing is found on the GPU at every replay, and kept where the
time model, evaluated there, predicts it faster than the plain step (on this small batch it
does not: both ways run it plain).

usage: python examples/prefix_sharing.py [--layers 32] [--steps 20]
Needs a CUDA GPU; without one it says so and exits 0.
"""

from __future__ import annotations

import argparse
import sys

import numpy as np
import torch

H_Q, H_KV, HEAD_DIM, PAGE = 32, 8, 128, 16
PROMPT, SYSTEM = 6000, 2048
OWN = [40, 300, 17, 90, 1500, 2900, 800, 5000]   # own tokens per row; rows 0-3 sample, 4-6 chat


def batch(steps: int, gen: np.random.Generator):
    """(seq_lens, block_tables, num_pages): rows 0-3 share the prompt's pages, rows 4-6 the
    system prompt's, row 7 none; pages scattered over the cache, room for ``steps`` more tokens."""
    prefix = [PROMPT] * 4 + [SYSTEM] * 3 + [0]
    seq = np.array([p + o for p, o in zip(prefix, OWN)], np.int32)
    width = -(-(int(seq.max()) + steps) // PAGE)
    num_pages = 8 * width
    pool = gen.permutation(num_pages).astype(np.int32)
    bt = pool.reshape(8, width).copy()
    bt[1:4, :PROMPT // PAGE] = bt[0, :PROMPT // PAGE]
    bt[5:7, :SYSTEM // PAGE] = bt[4, :SYSTEM // PAGE]
    return seq, bt, num_pages


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--layers", type=int, default=32)
    ap.add_argument("--steps", type=int, default=20)
    args = ap.parse_args(argv)
    if not torch.cuda.is_available():
        print("examples/prefix_sharing.py needs a CUDA GPU (torch sees none); nothing to run here.")
        return 0

    import pkvrt
    from pkvrt import reference
    from pkvrt.runtime.graphs import capture

    seq, bt, num_pages = batch(args.steps, np.random.default_rng(20260623))
    b = len(seq)
    gen = torch.Generator(device="cuda").manual_seed(20260623)
    shape = (args.layers, num_pages, H_KV, PAGE, HEAD_DIM)
    k = torch.randn(shape, device="cuda", dtype=torch.float16, generator=gen)
    v = torch.randn(shape, device="cuda", dtype=torch.float16, generator=gen)
    q = torch.randn(b, H_Q, HEAD_DIM, device="cuda", dtype=torch.float16, generator=gen)
    out = torch.empty(args.layers, b, H_Q, HEAD_DIM, device="cuda", dtype=torch.float16)

    def error(lens) -> float:   # the last layer against FP32 attention
        want = reference.decode_attention(q, k[-1], v[-1], torch.as_tensor(lens, device="cuda"),
                                          torch.as_tensor(bt, device="cuda"))
        return float((out[-1].float() - want).norm() / want.norm())

    common = dict(max_batch=b, max_pages_per_row=bt.shape[1], num_pages=num_pages)

    # Host lengths: plan per step on the host, run() per layer
    host = pkvrt.SharedPagesRuntime(H_Q, H_KV, HEAD_DIM, PAGE, torch.float16, **common)
    host.plan(seq, bt)
    for layer in range(args.layers):
        host.run(q, k[layer], v[layer], out=out[layer])
    print(f"host lengths:   rel. error {error(seq):.2e}\n  {host.explain()}")

    # Device lengths: the engine's tensors, plan() and every layer in one graph, replayed
    seq_d, bt_d = torch.as_tensor(seq, device="cuda"), torch.as_tensor(bt, device="cuda")
    dev = pkvrt.SharedPagesRuntime(H_Q, H_KV, HEAD_DIM, PAGE, torch.float16, device_planning=True,
                                   options=pkvrt.RuntimeOptions(use_cuda_graph=False), **common)

    def step():
        dev.plan(seq_d, bt_d)
        for layer in range(args.layers):
            dev.run(q, k[layer], v[layer], out=out[layer])
    graph = capture(step).graph
    lens = seq.copy()
    worst = 0.0
    for _ in range(args.steps):
        lens += 1
        seq_d.copy_(torch.as_tensor(lens))   # the scheduler's in-place update
        graph.replay()
        worst = max(worst, error(lens))
    found = dev.found()                      # reads the GPU's buffers: for this printout only
    d = found.decision                       # the GPU's rule: keep the chunks it found, or not
    print(f"device lengths: {args.steps} replays, worst rel. error {worst:.2e}; the GPU's rule "
          f"predicted {d.plain_us:.1f} us a layer plain, {d.shared_us:.1f} shared: "
          + (f"{int((found.chunk_seq > 0).sum())} chunks kept, {found.tokens_saved} token reads saved "
             "a layer and KV head" if d.shared else "the plain step"))
    ok = worst < 2e-3 and error(lens) < 2e-3
    print("ok" if ok else "MISMATCH against the FP32 reference")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
