// workqueue_decode.cu — PersistentKV compact workqueue decode (a merge launch follows).
//
// One CTA per task of a compact list built by the planner (pkvrt/policy/planner.py,
// kernels/plan_workqueue.cu): task = (row, kvh, split, tok_begin, tok_end), only non-empty
// ranges exist, so a ragged batch runs as one launch with row-local split counts and no empty
// split CTAs. The task body is workqueue_task.cuh.
//
// Grid:  blockIdx.x = task (0..task_capacity-1); tasks at or beyond *num_tasks exit at once.
// Block: 128 threads; dynamic shared memory pkv::smem_bytes<D, GC, KV>() (K/V: T or e4m3).
// Layout: tasks [capacity, 5] int32; split_offsets [B+1] int32; the state of (row, split) goes
//        to slot split_offsets[row] + split. A row with a single split writes O directly and
//        the merge kernel skips it (merge.cu, skip_single = 1).
// Bytes: each K and V byte of every active row once (the tasks partition [0, seq_len)).
#include "workqueue_task.cuh"

// (128, 1): with the default occupancy target ptxas spilled 4 bytes in the sm_80 d64/g8 variants.
#define PKV_WQ_ENTRY(NAME, TN, T, KN, KV, D, GC)                                       \
  extern "C" __global__ void __launch_bounds__(pkv::kThreads, 1)                       \
      NAME##_##TN##KN##_d##D##_gc##GC(const __grid_constant__ pkv::DecodeParams p) {   \
    pkv::workqueue_task<T, KV, D, GC, false>(p);                                       \
  }
PKV_INSTANTIATE_DECODE(PKV_WQ_ENTRY, pkv_workqueue_decode)
