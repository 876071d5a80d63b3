"""The kernels of one B8 bimodal decode step, for Nsight Compute (Table 5 of the seed).

Runs, on the isolated benchmark's B8-bimodal batch (H_q=32, H_kv=8, D=128, fp16, page 16, 50 %
holes): FlashInfer's tensor-core decode, pkvrt's workqueue decode + merge and fused decode at the
planner's split choice, and the bucket route (split decode + merge) at the same splits. Each is
warmed up first; only the measured calls run between cudaProfilerStart and cudaProfilerStop, so
`ncu --profile-from-start off` sees one launch of each kernel. Outputs are checked against the
FP32 reference before profiling starts.

usage: ncu --profile-from-start off ... python benches/ncu_workload.py [--lens 32768] [--bucket-splits 16]
(default: the B8 bimodal batch, bucket at the workqueue's largest split count)
"""

from __future__ import annotations

import sys
from pathlib import Path

LENS = [32768, 2048, 3072, 4096, 32000, 1024, 2560, 3584]


def main(argv=None) -> int:
    import argparse

    import torch

    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--lens", default=",".join(map(str, LENS)), help="comma-separated row lengths")
    ap.add_argument("--bucket-splits", type=int, default=0, help="bucket route splits (0: the workqueue's max)")
    args = ap.parse_args(argv)
    lens = [int(x) for x in args.lens.split(",")]

    sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests"))
    from paged import make_batch, rel_err

    from pkvrt import reference
    from pkvrt.launch import ops
    from pkvrt.policy import planner
    from pkvrt.policy.blocktables import to_csr
    from pkvrt.policy.calibration import find_calibration
    from pkvrt.policy.registry import load_routes
    from pkvrt.runtime import fi_route

    b = make_batch(lens, seed=20260623)
    ref = reference.decode_attention(b.q, b.k_cache, b.v_cache, b.seq_lens, b.block_tables)
    cal = find_calibration(torch.cuda.get_device_name())
    plan = planner.plan_workqueue(lens, num_kv_heads=8, num_qo_heads=32, head_dim=128, dtype_bytes=2,
                                  splits=load_routes().route("pkv_workqueue").splits, cal=cal)
    dev = dict(device="cuda", dtype=torch.int32)
    tasks, num = torch.as_tensor(plan.tasks, **dev), torch.tensor([len(plan.tasks)], **dev)
    offsets = torch.as_tensor(plan.split_offsets, **dev)
    s = int(plan.num_splits.max())
    bs = args.bucket_splits or s
    slots = max(int(plan.split_offsets[-1]), len(lens) * bs)
    part_a = torch.empty(slots, 32, 128, device="cuda")
    part_ml = torch.empty(slots, 32, 2, device="cuda")
    counters = torch.zeros(len(lens), 8, **dev)
    rows = torch.arange(len(lens), **dev)
    moffs = torch.arange(len(lens) + 1, **dev) * bs
    outs = {name: torch.empty_like(b.q) for name in ("workqueue", "fused", "bucket", "flashinfer")}

    def workqueue():
        ops.workqueue_decode(b.q, b.k_cache, b.v_cache, b.seq_lens, b.block_tables, tasks, num,
                             offsets, outs["workqueue"], part_a, part_ml)
        ops.merge(part_a, part_ml, offsets, outs["workqueue"], skip_single=True)

    def fused():
        ops.workqueue_decode(b.q, b.k_cache, b.v_cache, b.seq_lens, b.block_tables, tasks, num,
                             offsets, outs["fused"], part_a, part_ml, counters=counters)

    def bucket():
        ops.split_decode(b.q, b.k_cache, b.v_cache, b.seq_lens, b.block_tables, rows, bs,
                         outs["bucket"], part_a, part_ml)
        ops.merge(part_a, part_ml, moffs, outs["bucket"], row_ids=rows)

    runs = [workqueue, fused, bucket]
    fi, why = fi_route.load_flashinfer()
    if fi is not None:
        indptr, indices, last = to_csr(b.seq_lens.cpu().numpy(), b.block_tables.cpu().numpy(), 16)
        ws = torch.zeros(128 * 2**20, dtype=torch.uint8, device="cuda")
        w = fi.BatchDecodeWithPagedKVCacheWrapper(ws, "HND", use_tensor_cores=True,
                                                  backend=fi_route.BACKEND)
        w.plan(torch.as_tensor(indptr), torch.as_tensor(indices).cuda(), torch.as_tensor(last),
               32, 8, 128, 16, q_data_type=torch.float16, kv_data_type=torch.float16)
        runs.append(lambda: w.run(b.q, (b.k_cache, b.v_cache), out=outs["flashinfer"]))
    else:
        print(f"FlashInfer unavailable ({why}): profiling pkvrt only")
        del outs["flashinfer"]
    for fn in runs:          # warm-up + correctness, outside the profiled range
        fn()
    torch.cuda.synchronize()
    for name, out in outs.items():
        err = rel_err(out, ref)
        print(f"{name:10s} rel err {err:.1e}")
        if err > 2e-3:
            return 1
    torch.cuda.cudart().cudaProfilerStart()
    for fn in runs:
        fn()
    torch.cuda.synchronize()
    torch.cuda.cudart().cudaProfilerStop()
    print(f"profiled: {', '.join(outs)} (workqueue splits {s}, bucket {bs}, {len(plan.tasks)} workqueue tasks)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
