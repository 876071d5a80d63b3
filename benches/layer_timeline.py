"""Where a layer's time goes: %globaltimer marks of every decode and merge CTA of an eager step.

What it measures is the fixed cost of a layer. Per case (the steps of the engine protocol that
lose the most: one short row, one long row, a ragged B8 step), the host partition (this GPU's
calibration) is launched for ``--layers`` layers back to back, eagerly, the way the Runtime runs
an engine-captured step: workqueue decode (``early_kv`` from the second layer on) then merge,
on one stream with programmatic dependent launch, all queued behind a spin kernel so that no
host gap enters. Each working CTA writes its marks (kernels/decode_common.cuh, trace_mark):
entering, its PDL wait returned, done (and, in a decode CTA, its decode done before the arrival;
not used here). Per layer it reports, in µs from the layer's first decode
CTA: the last decode CTA past its wait, the first and last decode CTA done, the merge's first
CTA in, its last wait, its last CTA done, and the period to the next layer's first CTA; the
median over layers 1.. (layer 0 waits on the spin) goes to the table and the JSON.

With ``--route pkv_fused`` the decode kernel merges in its last CTA's tail and no merge is
launched: the merge columns are empty, ``decode_done_last`` is the end of the layer's work,
``decoded_last`` the last CTA's decode done (before its arrival) and ``tail`` the difference: what
the merge in the last CTAs adds to the layer.

``--heads QO/KV`` runs another head shape (default 32/8; 64/4 is Qwen3-235B's G 16, 28/4
Qwen2.5-7B's G 7), with this GPU's constants for its group size, as the Runtime plans it.

usage: python benches/layer_timeline.py [--layers 8] [--route pkv_workqueue|pkv_fused]
       [--heads 32/8] [--merge-groups-from N] [--cases B8-bimodal,...] [--out FILE]
"""

from __future__ import annotations

import argparse
import statistics
import sys
from pathlib import Path

import numpy as np
import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests"))
from paged import make_batch, rel_err  # noqa: E402

from pkvrt import reference  # noqa: E402
from pkvrt.launch import ops  # noqa: E402
from pkvrt.measure import results  # noqa: E402
from pkvrt.policy import planner  # noqa: E402
from pkvrt.policy.calibration import find_calibration  # noqa: E402
from pkvrt.policy.registry import load_routes  # noqa: E402

CASES = {  # name -> seq_lens (D 128, fp16, page 16)
    "B1-1.6K": [1600],
    "B1-8K": [8192],
    "B1-32K": [32768],
    "B8-bimodal": [32768, 2048, 3072, 4096, 32000, 1024, 2560, 3584],
    # the model-coverage issue's bimodal step: one 28K row, seven of 0.5-2.3K
    "B8-one-long": [28672, 512, 1200, 2300, 900, 1800, 700, 1500],
}
COLUMNS = ("decode_waited_last", "decode_done_first", "decoded_last", "decode_done_last", "tail",
           "merge_in_first", "merge_waited_last", "merge_done_last", "period")


def layer_marks(dec: np.ndarray, mer: np.ndarray) -> dict[str, float]:
    """Marks (ns) of one layer's decode [n, TRACE_MARKS] and merge [m, TRACE_MARKS] CTAs -> µs from the first
    decode CTA in (only CTAs that wrote a mark count)."""
    d = dec[dec[:, 0] > 0]
    t0 = d[:, 0].min()
    m_in = mer[mer[:, 0] > 0]
    m_done = mer[mer[:, 2] > 0]
    us = lambda t: float(t - t0) / 1e3  # noqa: E731
    decoded = d[d[:, 3] > 0]
    decoded_last = us(decoded[:, 3].max()) if len(decoded) else float("nan")
    return {"t0": int(t0), "decode_waited_last": us(d[:, 1].max()), "decode_done_first": us(d[:, 2].min()),
            "decoded_last": decoded_last, "decode_done_last": us(d[:, 2].max()),
            "tail": us(d[:, 2].max()) - decoded_last,
            "merge_in_first": us(m_in[:, 0].min()) if len(m_in) else float("nan"),
            "merge_waited_last": us(m_in[:, 1].max()) if len(m_in) else float("nan"),
            "merge_done_last": us(m_done[:, 2].max()) if len(m_done) else float("nan")}


def run_case(name: str, lens, layers: int, cal, splits, fused: bool = False, qo: int = 32,
             kv_heads: int = 8, merge_groups_from: int = 0) -> dict:
    b = make_batch(lens, num_qo_heads=qo, num_kv_heads=kv_heads, device="cuda", seed=20261201)
    plan = planner.plan_workqueue(np.array(lens), num_kv_heads=kv_heads, num_qo_heads=qo, head_dim=128,
                                  dtype_bytes=2, splits=splits, cal=cal.for_group(qo // kv_heads))
    tasks, num, offsets, part_a, part_ml = ops.workqueue_tensors(plan, num_qo_heads=qo, head_dim=128)
    out = torch.full_like(b.q, float("nan"))
    merge_ctas = -(-qo // 4) * len(lens)   # the merge kernel's grid: 4 query heads a CTA, per row
    kv = int(sum(lens)) * kv_heads * 128 * 2 * 2
    # Each layer reads its own cache copy, and the timed layers others than the warm-up's, with
    # at least 3 x L2 between reuses: no layer is timed on L2-resident K/V.
    copies = max(2 * layers, -(-3 * 60 * 2**20 // kv))
    ks = [b.k_cache] + [b.k_cache.clone() for _ in range(copies - 1)]
    vs = [b.v_cache] + [b.v_cache.clone() for _ in range(copies - 1)]
    dec = torch.zeros(layers, len(plan.tasks), ops.TRACE_MARKS, dtype=torch.int64, device="cuda")
    mer = torch.zeros(layers, merge_ctas, ops.TRACE_MARKS, dtype=torch.int64, device="cuda")
    counters = torch.zeros(len(lens), kv_heads, dtype=torch.int32, device="cuda") if fused else None
    two_level = dict(group_counters=torch.zeros(part_a.shape[0], kv_heads, dtype=torch.int32, device="cuda"),
                     merge_groups_from=merge_groups_from) if fused and merge_groups_from >= 0 else {}

    def step(traced: bool):
        for layer in range(layers):
            c = (layer + (layers if traced else 0)) % copies
            ops.workqueue_decode(b.q, ks[c], vs[c], b.seq_lens, b.block_tables, tasks, num,
                                 offsets, out, part_a, part_ml, early_kv=layer > 0,
                                 trace=dec[layer] if traced else None, counters=counters, **two_level)
            if not fused:
                ops.merge(part_a, part_ml, offsets, out, skip_single=True,
                          trace=mer[layer] if traced else None)

    step(False)                       # warm-up: kernel loads, attributes
    torch.cuda.synchronize()
    err = rel_err(out, reference.decode_attention(b.q, b.k_cache, b.v_cache, b.seq_lens, b.block_tables))
    if not err < 5e-3:
        raise RuntimeError(f"{name}: wrong output, rel_err {err:.3g}")
    torch.cuda._sleep(50_000_000)     # ~25 ms: the host queues every layer before the GPU starts
    step(True)
    torch.cuda.synchronize()
    err = rel_err(out, reference.decode_attention(b.q, b.k_cache, b.v_cache, b.seq_lens, b.block_tables))
    if not err < 5e-3:
        raise RuntimeError(f"{name}: wrong output after the traced step, rel_err {err:.3g}")
    d, m = dec.cpu().numpy(), mer.cpu().numpy()
    per = [layer_marks(d[i], m[i]) for i in range(layers)]
    for i in range(layers - 1):
        per[i]["period"] = (per[i + 1]["t0"] - per[i]["t0"]) / 1e3
    med = {c: statistics.median(p[c] for p in per[1:-1] if c in p) for c in COLUMNS}
    common = dict(case=name, heads=f"{qo}/{kv_heads}", merge_groups_from=merge_groups_from, engine="pkvrt-fused" if fused else "pkvrt-workqueue", splits=int(plan.num_splits.max()),
                  ctas=len(plan.tasks), floor_us=round(kv / 4.2e6, 2))
    rows = [dict(common, layer="median", **{k: round(v, 2) for k, v in med.items()})]
    rows += [dict(common, layer=i, **{k: round(v, 2) for k, v in p.items() if k != "t0"})
             for i, p in enumerate(per)]
    return rows


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--layers", type=int, default=8)
    ap.add_argument("--cases", default=",".join(CASES))
    ap.add_argument("--route", choices=("pkv_workqueue", "pkv_fused"), default="pkv_workqueue")
    ap.add_argument("--heads", default="32/8", help="query heads / KV heads (default 32/8)")
    ap.add_argument("--merge-groups-from", type=int, default=0,
                    help="pkv_fused's two-level tail (ops.workqueue_decode): 0 (default) where the "
                         "kernel's rule says, N >= 2 from N splits of a (row, KV head), -1 never")
    ap.add_argument("--out", default="benches/results/h200/layer-timeline.json")
    args = ap.parse_args(argv)
    try:
        qo, kv_heads = (int(x) for x in args.heads.split("/"))
        if qo <= 0 or kv_heads <= 0 or qo % kv_heads:
            raise ValueError
    except ValueError:
        ap.error(f"--heads: QO/KV with KV dividing QO, e.g. 64/4; got {args.heads!r}")
    if args.merge_groups_from == 1 or args.merge_groups_from < -1:
        ap.error(f"--merge-groups-from: -1, 0 or >= 2; got {args.merge_groups_from}")
    unknown = [n for n in args.cases.split(",") if n not in CASES]
    if unknown:
        ap.error(f"--cases: unknown {unknown}; known: {', '.join(CASES)}")
    if not torch.cuda.is_available():
        print("layer_timeline: needs a CUDA GPU", file=sys.stderr)
        return 2
    cal = find_calibration(torch.cuda.get_device_name())
    splits = load_routes().route(args.route).splits
    rows = [r for n in args.cases.split(",")
            for r in run_case(n, CASES[n], args.layers, cal, splits, fused=args.route == "pkv_fused",
                              qo=qo, kv_heads=kv_heads, merge_groups_from=args.merge_groups_from)]
    print(f"{'case':12s} {'heads':>5s} {'S':>3s} {'CTAs':>5s} {'floor':>6s} " + " ".join(f"{c:>8s}" for c in
          ("dec.wait", "dec.1st", "decoded", "dec.last", "tail", "mrg.in", "mrg.wait", "mrg.done", "period")))
    for r in (r for r in rows if r["layer"] == "median"):
        print(f"{r['case']:12s} {r['heads']:>5s} {r['splits']:3d} {r['ctas']:5d} {r['floor_us']:6.1f} "
              + " ".join(f"{r[c]:8.2f}" for c in COLUMNS))
    meta = results.make_meta(seeds=[20261201], routes_path=None, calibration_path=cal.source,
                             kind="layer-timeline", protocol="eager layers behind a spin, PDL, "
                             "%globaltimer marks per CTA, median over the middle layers, µs from "
                             "the layer's first decode CTA")
    results.write_results(args.out, meta, rows)
    print(f"wrote {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
