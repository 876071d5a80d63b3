"""How fast one decode CTA streams its K/V range at each group capacity: the split decode
(``ops.split_decode``, no merge) over rows of one length at H_kv 8, D 128, fp16, page 16,
with a fixed split count, for group sizes of the narrow body (4, 8, 16) and the wide one
(20, 32: two head groups, two token streams; 48, 64: one token stream, every warp over every
tile). The K/V bytes are the same at every G, so the times compare what a CTA costs per byte
when its warps split the tokens (narrow) or the heads (wide). Each point is the CUDA-event
median of a captured graph of one launch (``harness.median_us``); the caches (B x 32K tokens x
8 heads, 128 MB a row) are larger than L2.

usage: python benches/group_stream.py [--out benches/results/h200/group-stream.json]
       [--tokens 32768] [--batches 1,4] [--groups 4,8,16,20,32,48,64] [--splits 4,8,16,32]
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import torch

from pkvrt.launch import ops
from pkvrt.measure import results
from pkvrt.measure.harness import median_us

H_KV, D, PAGE, SEED = 8, 128, 16, 20261205


def _ints(text: str, name: str) -> list[int]:
    try:
        vals = [int(x) for x in text.split(",") if x]
    except ValueError:
        raise SystemExit(f"--{name}: expected comma-separated integers, got {text!r}") from None
    if not vals or min(vals) < 1:
        raise SystemExit(f"--{name}: expected positive integers, got {text!r}")
    return vals


def stream_row(b: int, tokens: int, g: int, s: int, us: float, nbytes: int) -> dict:
    """One measured point as a results row: ``case`` the rows and split count, ``engine`` the
    group size (``pkvrt report`` tabulates case x engine)."""
    return dict(case=f"B{b}-{tokens} S{s}", engine=f"split-decode G{g}", status="ok", batch=b,
                tokens=tokens, group=g, splits=s, ctas=b * H_KV * s, median_us=us,
                tb_per_s=nbytes / us / 1e6)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--out", default="benches/results/h200/group-stream.json")
    ap.add_argument("--tokens", type=int, default=32768)
    ap.add_argument("--batches", default="1,4")
    ap.add_argument("--groups", default="4,8,16,20,32,48,64")
    ap.add_argument("--splits", default="4,8,16,32")
    a = ap.parse_args(argv)
    if not torch.cuda.is_available():
        print("group_stream.py: needs a CUDA GPU", file=sys.stderr)
        return 2
    if a.tokens < PAGE or a.tokens % PAGE:
        raise SystemExit(f"--tokens: expected a multiple of {PAGE}, got {a.tokens}")
    batches, groups, splits = _ints(a.batches, "batches"), _ints(a.groups, "groups"), _ints(a.splits, "splits")
    torch.manual_seed(SEED)
    dev, rows = "cuda", []
    pages = a.tokens // PAGE
    print(f"{'B':>3} {'G':>3} {'S':>3} {'us':>9} {'TB/s':>6}")
    for b in batches:
        k = torch.randn(b * pages, H_KV, PAGE, D, device=dev, dtype=torch.float16)
        v = torch.randn_like(k)
        bt = torch.randperm(b * pages, device=dev, dtype=torch.int32).view(b, pages)
        seq = torch.full((b,), a.tokens, device=dev, dtype=torch.int32)
        row_ids = torch.arange(b, device=dev, dtype=torch.int32)
        nbytes = 2 * b * a.tokens * H_KV * D * k.element_size()
        for g in groups:
            q = torch.randn(b, H_KV * g, D, device=dev, dtype=torch.float16)
            out = torch.empty_like(q)
            for s in splits:
                part_a = torch.empty(b * s, H_KV * g, D, device=dev, dtype=torch.float32)
                part_ml = torch.empty(b * s, H_KV * g, 2, device=dev, dtype=torch.float32)
                us = median_us(lambda: ops.split_decode(q, k, v, seq, bt, row_ids, s, out, part_a, part_ml))
                rows.append(stream_row(b, a.tokens, g, s, us, nbytes))
                print(f"{b:3d} {g:3d} {s:3d} {us:9.1f} {rows[-1]['tb_per_s']:6.2f}", flush=True)
    meta = results.make_meta(seeds=[SEED], kind="group-stream", num_kv_heads=H_KV, head_dim=D,
                             page_size=PAGE, command=" ".join(["group_stream.py", *(argv or sys.argv[1:])]))
    results.write_results(Path(a.out), meta, rows)
    print(f"wrote {a.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
