"""A multi-layer decode loop on pkvrt.Runtime: plan once per step, run once per layer.

32 layers, each a view of one big K and V cache ``[layers, num_pages, H_kv, page, D]`` (HND);
a few decode steps whose lengths grow by one token a step, with one request joining and one
leaving. Each step prints the route the runtime chose, the CUDA graphs it captured and replayed
and checks the last layer's output against the FP32 reference; at the end it prints
``explain()`` and ``stats()``.

Where the policy picks a PersistentKV workqueue route, the step's plan is built on the GPU by
the planning kernel and its grid depends only on the padded batch, so the first such step
captures (one planning graph and one graph per layer) and the next steps of that padded batch
replay them while the lengths grow: ``+0 captures, +33 replays`` at 32 layers. FlashInfer steps
run FlashInfer's own plan and launch it eagerly.

The cache is filled with random values up front (a real engine appends the step's new K/V
before ``plan``/``run``). q is written straight into ``rt.static_q(B)`` and the output read from
``rt.static_out(B)``: the zero-copy path, where each layer is one graph replay.

usage: python examples/decode_loop.py [--layers 32] [--steps 6] [--eager]
Needs a CUDA GPU (about 8 GB for 32 layers); without one it says so and exits 0.
"""

from __future__ import annotations

import argparse
import math
import sys

import numpy as np
import torch

H_Q, H_KV, HEAD_DIM, PAGE = 32, 8, 128, 16
# Request id -> context length at step 0. Two rows past the 16K gate, so the policy may pick a
# PersistentKV route; request 4 joins at step 2, request 1 leaves at step 4.
REQUESTS = {0: 20000, 1: 17500, 2: 3000, 3: 900}
JOIN = {2: (4, 18000)}
LEAVE = {4: 1}


def page_tables(lengths: dict[int, int], steps: int, seed: int = 0) -> tuple[dict[int, np.ndarray], int]:
    """Physical pages for every request, reserved for its whole run: request -> page ids (in
    logical order, scattered over the universe by a seeded permutation), and the universe size."""
    need = {r: math.ceil((n + steps) / PAGE) for r, n in lengths.items()}
    total = sum(need.values())
    perm = np.random.default_rng(seed).permutation(total).astype(np.int32)
    out, at = {}, 0
    for r, p in need.items():
        out[r] = perm[at:at + p]
        at += p
    return out, total


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--layers", type=int, default=32)
    ap.add_argument("--steps", type=int, default=6)
    ap.add_argument("--eager", action="store_true", help="launch eagerly (no CUDA graphs)")
    args = ap.parse_args(argv)
    if not torch.cuda.is_available():
        print("examples/decode_loop.py needs a CUDA GPU (torch sees none); nothing to run here.")
        return 0

    import pkvrt
    from pkvrt import reference

    lengths = dict(REQUESTS)
    for r, n in JOIN.values():
        lengths[r] = n
    pages, num_pages = page_tables(lengths, args.steps)
    width = max(len(p) for p in pages.values())
    gen = torch.Generator(device="cuda").manual_seed(20260623)
    shape = (args.layers, num_pages, H_KV, PAGE, HEAD_DIM)
    k_all = torch.randn(shape, device="cuda", dtype=torch.float16, generator=gen)
    v_all = torch.randn(shape, device="cuda", dtype=torch.float16, generator=gen)
    print(f"{args.layers} layers, {num_pages} pages of {PAGE} tokens, "
          f"{2 * k_all.numel() * 2 / 2**30:.1f} GiB of KV")

    # A graph per layer (each layer's cache is another tensor) and padded batch, plus the
    # planning graph: room for two padded batches' worth without evicting.
    rt = pkvrt.Runtime(H_Q, H_KV, HEAD_DIM, PAGE, torch.float16, max_batch=16,
                       max_pages_per_row=width,
                       options=pkvrt.RuntimeOptions(use_cuda_graph=not args.eager,
                                                    max_graphs=max(64, 2 * (args.layers + 1)),
                                                    layers_per_plan=args.layers))
    active = dict(REQUESTS)  # request -> current length
    ok = True
    for step in range(args.steps):
        if step in JOIN:
            r, n = JOIN[step]
            active[r] = n
        if step in LEAVE:
            active.pop(LEAVE[step])
        rids = sorted(active)
        seq_lens = np.array([active[r] for r in rids], dtype=np.int32)
        block_tables = np.full((len(rids), width), -1, dtype=np.int32)   # -1: padding, never read
        for i, r in enumerate(rids):
            block_tables[i, :len(pages[r])] = pages[r]

        before = rt.stats()
        decision = rt.plan(seq_lens, block_tables)          # once per step
        b = len(rids)
        q, out = rt.static_q(b), rt.static_out(b)
        for layer in range(args.layers):                    # once per layer
            q.normal_(generator=gen)                        # stands in for the q projection
            rt.run(q, k_all[layer], v_all[layer], out=out)
        ref = reference.decode_attention(q, k_all[-1], v_all[-1], torch.as_tensor(seq_lens, device="cuda"),
                                         torch.as_tensor(block_tables, device="cuda"))
        err = ((out.float() - ref).norm() / ref.norm()).item()
        ok &= err < 2e-3
        after = rt.stats()
        graphs = ", ".join(f"+{after[k] - before[k]} {k}" for k in ("captures", "replays", "eager_runs"))
        print(f"step {step}: B={b} longest={int(seq_lens.max())} route={decision.route} "
              f"({decision.kind}, predicted {decision.speedup:.2f}x over FlashInfer; {graphs}) "
              f"last-layer rel err {err:.1e} {'ok' if err < 2e-3 else 'FAIL'}")
        for r in rids:
            active[r] += 1                                  # the token decoded this step
    print()
    print(rt.explain())
    print()
    for k, v in rt.stats().items():
        print(f"{k}: {v}")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
