"""One step's balanced-partition cuts timed under the calibration's protocol and the engine's.

Why: the 2026-12-01 recalibration with a one-long-row step added (7085d22) fitted G = 8
constants that the calibration sweeps scored within 1 % of the best, yet the 32-layer engine
protocol ran them at 0.87x FlashInfer against 1.06x for the shipped ones: the two protocols rank
the same cuts of the same step class differently (benches/NOTES.md, the partition's cuts). This
times one step at a few cuts three ways, so the difference can be localized:

- ``exact``: ``pkvrt.tools.calibrate.time_workqueue`` (the fused route, a host plan at the
  cut) in a grid of exactly its CTAs, ``--layers`` calls back to back in one graph (calibrate's
  LAYERS is 8): how ``pkvrt calibrate`` timed cuts before 365ccca (the result files of that
  comparison, in git at 208e68a, call this protocol "calibrate");
- ``padded``: the same with the grid the Runtime launches for the batch (how ``pkvrt
  calibrate`` times cuts now)
  (``planner.device_grid_ctas``), the slots past the plan's tasks exiting at once;
  ``padded-no-early-kv``: and no layer's K/V copies start before the previous layer ends;
- ``runtime``: ``pkvrt.Runtime(device_planning=True)``, graphs off
  (``RuntimeOptions(use_cuda_graph=False)``), captured as the engine protocol's step graph (plan +
  ``layers`` runs): the planning kernel, and a decode grid sized for the most CTAs the partition may
  plan, the slots past the step's tasks exiting at
  once. The cut is forced by a routes.toml copy whose fused route allows that one split count
  (which also caps the grid at every row at that count: ``grid`` in the output) and by forcing
  ``pkv_fused`` (routes.toml runs one-row steps on pkv_workqueue: the B1 rows of
  ``g4-b1-8k-trace.json``, in git at 63b6932, ran that route at cut 32 whatever the "forced"
  cut says). With ``--calibrations`` nothing is forced: the engine's path.

usage (GPU): python benches/cut_protocols.py --lengths 3395,1246,31518,2810,2438,2434,32291,1956 \
    --group 8 --cuts 12,26 --layers 8,32 --out OUT.json
Prints one line per (protocol, layers, cut): µs per layer (CUDA-event median of graph replays).
"""

from __future__ import annotations

import argparse
import pathlib
import re
import sys
import tempfile

import numpy as np

ROOT = pathlib.Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))


def routes_forcing(cut: int) -> pathlib.Path:
    """A copy of routes.toml whose pkv_fused allows only ``cut`` splits per row."""
    text = (ROOT / "routes.toml").read_text()
    new, n = re.subn(r"(\[routes\.pkv_fused\.splits\]\s*\nmin = )1(\s*\nmax = )64",
                     rf"\g<1>{cut}\g<2>{cut}", text)
    if n != 1:
        raise SystemExit("routes.toml: [routes.pkv_fused.splits] min = 1 / max = 64 not found")
    path = pathlib.Path(tempfile.mkdtemp()) / "routes.toml"
    path.write_text(new)
    return path


def trace_layers(wl, plan, grid, layers: int = 32) -> dict:
    """One graph replay of ``layers`` fused-decode calls of ``plan`` (grid: None = its tasks),
    each layer writing its own trace buffer; per layer 1.. (layer 0 has no predecessor) the
    working CTAs' durations (done - past the PDL wait, µs), the spread of their wait-return
    times, the decode alone (waited -> decoded), the tail after the last decode and each split
    (row, KV head)'s merging CTA's arrival + merge (done - decoded of its last CTA; nan without
    split rows); medians over the layers of each statistic, and ``cta_marks``: one layer's marks
    per CTA."""
    import torch

    from pkvrt.launch import ops
    from pkvrt.measure import harness
    from pkvrt.tools import calibrate

    step, bt, seq = calibrate._device_tables(wl)
    b, hq, d = len(step.rids), wl.shape.num_qo_heads, wl.shape.head_dim
    q, out = wl.q[:b], torch.empty((b, hq, d), dtype=wl.q.dtype, device="cuda")
    tasks, num, offsets, part_a, part_ml = ops.workqueue_tensors(plan, num_qo_heads=hq, head_dim=d)
    n = tasks.shape[0]
    tasks = calibrate.padded_tasks(tasks, grid)
    counters = torch.zeros((b, wl.shape.num_kv_heads), dtype=torch.int32, device="cuda")
    traces = [torch.zeros((tasks.shape[0], ops.TRACE_MARKS), dtype=torch.int64, device="cuda") for _ in range(layers)]

    def fn():
        for i in range(layers):
            c = i % wl.copies
            ops.workqueue_decode(q, wl.k[c], wl.v[c], seq, bt, tasks, num, offsets, out, part_a, part_ml,
                                 counters=counters, early_kv=i > 0, trace=traces[i], **wl.scales(0))

    harness.median_us(fn, layers, 3)   # captures, replays: the last replay's marks stay
    torch.cuda.synchronize()
    stats = {"span_us": [], "dur_median_us": [], "dur_p90_us": [], "dur_max_us": [], "start_spread_us": [],
             "slow_fraction": [], "decoded_span_us": [], "dec_p90_us": [], "dec_max_us": [],
             "tail_after_decode_us": [], "merge_median_us": [], "merge_max_us": []}
    tk = plan.tasks[:n]
    groups = [np.flatnonzero((tk[:, 0] == r) & (tk[:, 1] == h)) for r, h in sorted({(int(a), int(b)) for a, b in tk[:, :2]})]
    for t in traces[1:]:
        m = t[:n].cpu().numpy().astype(np.float64)
        dur = (m[:, 2] - m[:, 1]) / 1e3   # done - past the PDL wait: the CTA's own work
        stats["span_us"].append((m[:, 2].max() - m[:, 1].min()) / 1e3)
        stats["dur_median_us"].append(float(np.median(dur)))
        stats["dur_p90_us"].append(float(np.percentile(dur, 90)))
        stats["dur_max_us"].append(float(dur.max()))
        # the long row's CTAs have equal chunks: among them, a CTA sharing its SM runs longer
        long = dur[plan.tasks[:, 0] == int(np.argmax(np.bincount(plan.tasks[:, 0])))]
        stats["slow_fraction"].append(float((long > 1.3 * np.median(long)).mean()))
        stats["start_spread_us"].append((m[:, 1].max() - m[:, 1].min()) / 1e3)
        # the decode alone (past the PDL wait to the kDecoded mark, before the arrival and the
        # tail merge): a late last decode (a straggler) against a slow arrival + merge after it
        dec = (m[:, 3] - m[:, 1]) / 1e3
        stats["decoded_span_us"].append((m[:, 3].max() - m[:, 1].min()) / 1e3)
        stats["dec_p90_us"].append(float(np.percentile(dec, 90)))
        stats["dec_max_us"].append(float(dec.max()))
        stats["tail_after_decode_us"].append((m[:, 2].max() - m[:, 3].max()) / 1e3)
        # the merging CTA of each split (row, KV head) (its last to end): arrival + tail merge
        merge = [(m[idx, 2].max() - m[idx[np.argmax(m[idx, 2])], 3]) / 1e3 for idx in groups if len(idx) > 1]
        stats["merge_median_us"].append(float(np.median(merge)) if merge else float("nan"))
        stats["merge_max_us"].append(float(np.max(merge)) if merge else float("nan"))
    out = {k: float(np.median(v)) for k, v in stats.items()}
    # one layer's marks per CTA (µs from the layer's first PDL return): row, kvh, split, waited,
    # decoded, done
    m = traces[layers // 2][:n].cpu().numpy().astype(np.float64)
    t0 = m[:, 1].min()
    out["cta_marks"] = [[int(a), int(b), int(c), round((w - t0) / 1e3, 3), round((dd - t0) / 1e3, 3), round((e - t0) / 1e3, 3)]
                   for (a, b, c), w, dd, e in zip(tk[:, :3], m[:, 1], m[:, 3], m[:, 2])]
    return out


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--lengths", required=True, help="comma-separated seq_lens of the step")
    ap.add_argument("--group", type=int, default=8, help="query heads per KV head (H_q 32)")
    ap.add_argument("--cuts", required=True, help="comma-separated split counts of the longest row")
    ap.add_argument("--layers", default="8,32", help="calls per timed graph")
    ap.add_argument("--calibrations", default="",
                    help="comma-separated calibration files: the runtime protocol also runs the "
                         "shipped routes.toml with each file's constants (the engine's exact path)")
    ap.add_argument("--repeats", type=int, default=30)
    ap.add_argument("--trace", action="store_true",
                    help="also record every CTA's %%globaltimer marks over one replay of 32 layers "
                         "(calibrate vs padded grid) and print the spread of the working CTAs' "
                         "durations per layer: a light wave packed two CTAs to an SM shows as a "
                         "second mode near twice the first")
    ap.add_argument("--out", type=pathlib.Path)
    args = ap.parse_args(argv)

    import torch

    from pkvrt.measure import harness
    from pkvrt.policy import calibration as calib
    from pkvrt.policy import planner
    from pkvrt.policy.registry import load_routes
    from pkvrt.measure import results
    from pkvrt.runtime import Runtime, graphs
    from pkvrt.runtime.options import RuntimeOptions
    from pkvrt.tools import calibrate

    seq = np.array([int(x) for x in args.lengths.split(",")], dtype=np.int64)
    cuts = [int(x) for x in args.cuts.split(",")]
    layers = [int(x) for x in args.layers.split(",")]
    shape = calibrate.group_shape(args.group)
    hkv, hq, d = shape["num_kv_heads"], shape["num_qo_heads"], shape["head_dim"]
    file_cal = calib.find_calibration(torch.cuda.get_device_name())
    cal = file_cal.for_group(args.group)   # what a Runtime at this G plans with
    l2 = torch.cuda.get_device_properties(0).L2_cache_size
    wl = calibrate._workload(seq, l2, shape)
    ref = calibrate._reference(wl)
    step, bt, dseq = calibrate._device_tables(wl)
    route = load_routes(None).route("pkv_fused")
    # the grid the Runtime launches for this batch (the most CTAs the partition may plan)
    runtime_grid = calibrate.runtime_grid(len(seq), num_kv_heads=hkv, splits=route.splits, base=cal,
                                          resident=planner.PartitionModel.of(cal).resident,
                                          max_waves=cal.splits.max_waves)
    rows = []
    for n in layers:
        calibrate.LAYERS = n
        for s in cuts:
            plan = planner.plan_workqueue(seq, num_kv_heads=hkv, num_qo_heads=hq, head_dim=d,
                                          dtype_bytes=wl.kv_dtype_bytes, splits=route.splits, cal=cal,
                                          longest_splits=s)
            ctas = plan.counters.decode_ctas
            for proto, grid, early in (("exact", None, True), ("padded", runtime_grid, True),
                                       ("padded-no-early-kv", runtime_grid, False)):
                us = calibrate.time_workqueue(wl, plan, ref, args.repeats, fused=True, grid=grid,
                                              early_kv=early)
                rows.append(dict(protocol=proto, layers=max(n, wl.copies), cut=s, us=us, ctas=ctas,
                                 grid=grid or ctas))
                print(f"{proto:18s} layers {rows[-1]['layers']:3d} cut {s:3d}: {us:7.2f} us/layer "
                      f"({ctas} CTAs, grid {grid or ctas})", flush=True)
    if args.trace:
        for s in cuts:
            plan = planner.plan_workqueue(seq, num_kv_heads=hkv, num_qo_heads=hq, head_dim=d,
                                          dtype_bytes=wl.kv_dtype_bytes, splits=route.splits, cal=cal,
                                          longest_splits=s)
            for proto, grid in (("exact", None), ("padded", runtime_grid)):
                r = trace_layers(wl, plan, grid)
                rows.append(dict(protocol=f"trace-{proto}", cut=s, grid=grid or plan.counters.decode_ctas, **r))
                print(f"trace {proto:9s} cut {s:3d}: layer span {r['span_us']:6.2f} us, CTA duration "
                      f"median {r['dur_median_us']:6.2f} p90 {r['dur_p90_us']:6.2f} max {r['dur_max_us']:6.2f}, "
                      f"start spread {r['start_spread_us']:6.2f} us, long row's CTAs > 1.3x their median "
                      f"{100 * r['slow_fraction']:.0f} %; decode alone p90 {r['dec_p90_us']:6.2f} max "
                      f"{r['dec_max_us']:6.2f}, decoded span {r['decoded_span_us']:6.2f}, tail after the last "
                      f"decode {r['tail_after_decode_us']:5.2f} us, merging CTA's arrival + merge median "
                      f"{r['merge_median_us']:5.2f} max {r['merge_max_us']:5.2f} us", flush=True)
    b = len(seq)
    q, out = wl.q[:b], torch.full((b, hq, d), float("nan"), dtype=wl.q.dtype, device="cuda")
    configs = [(s, routes_forcing(s), file_cal, "forced") for s in cuts]   # + force="pkv_fused" below
    for path in filter(None, args.calibrations.split(",")):
        c = calib.load_calibration(pathlib.Path(path))
        s = planner.balanced_partition(seq, num_kv_heads=hkv, splits=route.splits,
                                       cal=c.for_group(args.group), kind=route.kind).longest_splits
        configs.append((s, None, c, path))
    for n in layers:
        for s, routes, c, how in configs:
            rt = Runtime(hq, hkv, d, wl.shape.page_size, wl.shape.torch_dtype, routes=routes,
                         calibration=c, max_batch=b, max_pages_per_row=wl.layout.max_pages,
                         device_planning=True, num_pages=wl.k[0].shape[0],
                         options=RuntimeOptions(use_cuda_graph=False, validate=False))

            def body():
                rt.plan(dseq, bt, force="pkv_fused" if how == "forced" else None)
                for layer in range(n):
                    c = layer % wl.copies
                    rt.run(q, wl.k[c], wl.v[c], out=out)

            us = harness.median_us(body, n, args.repeats)
            calibrate._checked(f"runtime cut {s}", out, ref)
            grid = rt._device_grid_tasks(rt.registry.route(rt.last_decision.route), graphs.padded_batch(b))
            rows.append(dict(protocol="runtime", layers=n, cut=s, us=us, grid=grid, constants=how,
                             route=rt.last_decision.route))
            print(f"{'runtime':18s} layers {n:3d} cut {s:3d}: {us:7.2f} us/layer (grid {grid}, {how})", flush=True)
    if args.out:
        meta = results.make_meta(kind="cut-protocols", lengths=seq.tolist(), group=args.group)
        results.write_results(args.out, meta, rows)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
