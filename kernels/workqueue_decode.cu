// workqueue_decode.cu — PersistentKV compact workqueue decode.
//
// One CTA per task of a compact list built by the planner (pkvrt/planner.py): task =
// (row, kvh, split, tok_begin, tok_end), only non-empty ranges exist, so a ragged batch runs as
// one launch with row-local split counts and no empty split CTAs.
//
// Grid:  blockIdx.x = task (0..task_capacity-1); tasks at or beyond *num_tasks exit at once
//        (a captured graph is sized for a capacity and replayed with fewer tasks).
// Block: 128 threads; dynamic shared memory pkv::smem_bytes<D, G>().
// Layout: tasks [capacity, 5] int32; split_offsets [B+1] int32; the state of (row, split) goes
//        to slot split_offsets[row] + split. A row with a single split writes O directly and
//        the merge kernel skips it (merge.cu, skip_single = 1).
// Bytes: each K and V byte of every active row once (the tasks partition [0, seq_len)).
// PDL: with p.early_kv the plan and the first K/V tiles (never a row's last token) are read
//        before griddepcontrol.wait (decode_common.cuh, decode_range_tc); Q, the last token and
//        every write come after it.
#include "decode_common.cuh"

template <typename T, int D, int G>
__device__ __forceinline__ void workqueue_decode(const pkv::DecodeParams& p) {
  if (!p.early_kv) pkv::pdl_enter();  // else decode_range enters after its first copies
  const int task = blockIdx.x;
  if (task >= *p.num_tasks) return;
  pkv::trace_mark(p.trace, pkv::kEnter);
  if (!p.early_kv) pkv::trace_mark(p.trace, pkv::kWaited);
  const int* t = p.tasks + 5 * task;
  const int row = t[0], kvh = t[1], split = t[2], begin = t[3], end = t[4];
  const int first = p.split_offsets[row];
  const int nsplit = p.split_offsets[row + 1] - first;
  extern __shared__ uint4 smem[];
  pkv::decode_range<T, D, G>(p, row, kvh, begin, end,
                             pkv::Sink{nsplit == 1 ? row : -1, first + split},
                             reinterpret_cast<unsigned char*>(smem));
  pkv::trace_mark(p.trace, pkv::kDone);
}

// (128, 1): with the default occupancy target ptxas spilled 4 bytes in the sm_80 d64/g8 variants.
#define PKV_WQ_ENTRY(NAME, TN, T, D, G)                                                \
  extern "C" __global__ void __launch_bounds__(pkv::kThreads, 1)                       \
      NAME##_##TN##_d##D##_g##G(const __grid_constant__ pkv::DecodeParams p) {         \
    workqueue_decode<T, D, G>(p);                                                      \
  }
PKV_INSTANTIATE_DECODE(PKV_WQ_ENTRY, pkv_workqueue_decode)
