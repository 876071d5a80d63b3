// fused_decode.cu — workqueue decode with the merge in the tail of the last CTA.
//
// Same tasks, grid and partial-state slots as workqueue_decode.cu, same task body
// (workqueue_task.cuh with kTailMerge): the last CTA of each multi-split (row, KV head) merges
// its G heads in-kernel (with the sinks and lse where O is written), so no merge launch follows.
//
// Grid:  blockIdx.x = task; tasks at or beyond *num_tasks exit at once.
// Block: 128 threads; dynamic shared memory pkv::smem_bytes<D, GC, KV>() (K/V: T or e4m3).
// Layout: counters [B, H_kv] int32, all zero before the launch (and left zero after it); for the
//        two-level tail (p.group_counters set; G 5-16 at D 96-256) [slots, H_kv] int32, the same.
// Bytes: K/V as workqueue_decode; plus, per multi-split row, the partial states once written
//        and once read ((D + 2) * 4 bytes per slot and query head each way).
#include "workqueue_task.cuh"

// (128, 1): with the default occupancy target ptxas spilled 4 bytes in the f16/d256/g1 variant.
#define PKV_FUSED_ENTRY(NAME, TN, T, KN, KV, D, GC)                                    \
  extern "C" __global__ void __launch_bounds__(pkv::kThreads, 1)                       \
      NAME##_##TN##KN##_d##D##_gc##GC(const __grid_constant__ pkv::DecodeParams p) {   \
    pkv::workqueue_task<T, KV, D, GC, true>(p);                                        \
  }
PKV_INSTANTIATE_DECODE(PKV_FUSED_ENTRY, pkv_fused_decode)
