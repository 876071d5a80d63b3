// fused_decode.cu — workqueue decode with the merge fused in (ablation).
//
// Same tasks, grid and partial-state slots as workqueue_decode.cu. After a CTA has written its
// partial state it bumps the completion counter of its (row, kvh); the CTA that brings it to the
// row's split count is the last one and merges the G heads of that KV head in-kernel, then
// resets the counter to 0 so the kernel can be replayed from a CUDA graph without a memset.
//
// Grid:  blockIdx.x = task; tasks at or beyond *num_tasks exit at once.
// Block: 128 threads; dynamic shared memory pkv::smem_bytes<D, G>().
// Layout: counters [B, H_kv] int32, all zero before the launch (and left zero after it).
// Ordering: every thread fences its partial-state stores (__threadfence) before the barrier
//        that precedes the counter atomic; the last CTA fences again and reads slots with
//        L1-bypassing loads.
// Bytes: K/V as workqueue_decode; plus, per multi-split row, the partial states once written
//        and once read ((D + 2) * 4 bytes per slot and query head each way).
#include "decode_common.cuh"

template <typename T, int D, int G>
__device__ __forceinline__ void fused_decode(const pkv::DecodeParams& p) {
  pkv::pdl_enter();
  const int task = blockIdx.x;
  if (task >= *p.num_tasks) return;
  const int* t = p.tasks + 5 * task;
  const int row = t[0], kvh = t[1], split = t[2], begin = t[3], end = t[4];
  const int first = p.split_offsets[row];
  const int nsplit = p.split_offsets[row + 1] - first;
  extern __shared__ uint4 smem[];
  pkv::decode_range<T, D, G>(p, row, kvh, begin, end,
                             pkv::Sink{nsplit == 1 ? row : -1, first + split},
                             reinterpret_cast<unsigned char*>(smem));
  if (nsplit == 1) return;

  __shared__ int is_last;
  __threadfence();
  __syncthreads();
  if (threadIdx.x == 0) {
    int* counter = p.counters + row * p.num_kv_heads + kvh;
    is_last = atomicAdd(counter, 1) == nsplit - 1;
    if (is_last) *counter = 0;  // every other CTA of this (row, kvh) has already arrived
  }
  __syncthreads();
  if (!is_last) return;
  __threadfence();
  // The G heads of this KV head, one warp each (G = 8: two per warp).
  for (int g = threadIdx.x / 32; g < G; g += pkv::kThreads / 32) {
    const int h = kvh * G + g;
    T* o = static_cast<T*>(p.out) + ((long long)row * p.num_qo_heads + h) * D;
    pkv::merge_head<T, D>(p.part_a, p.part_ml, p.num_qo_heads, first, first + nsplit, h, o,
                          threadIdx.x % 32);
  }
}

// (128, 1): with the default occupancy target ptxas spilled 4 bytes in the f16/d256/g1 variant.
#define PKV_FUSED_ENTRY(NAME, TN, T, D, G)                                             \
  extern "C" __global__ void __launch_bounds__(pkv::kThreads, 1)                       \
      NAME##_##TN##_d##D##_g##G(const __grid_constant__ pkv::DecodeParams p) {         \
    fused_decode<T, D, G>(p);                                                          \
  }
PKV_INSTANTIATE_DECODE(PKV_FUSED_ENTRY, pkv_fused_decode)
