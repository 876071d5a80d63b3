// workqueue_task.cuh — one task of the compact workqueue, with or without the merge in its tail.
//
// Shared by workqueue_decode.cu (kTailMerge = false: a merge launch follows) and fused_decode.cu
// (kTailMerge = true: the last CTA of each (row, KV head) merges). One body, so the two kernels
// differ only in the tail and measure the same decode (benches/NOTES.md, "Merge in the tail").
//
// Types: q and out T; K/V KV (T, or e4m3 with the scales in DecodeParams, decode_common.cuh).
// Task = (row, kvh, split, tok_begin, tok_end) from the planner; grid = task capacity, tasks at
// or beyond *num_tasks exit at once (a captured graph is replayed with fewer tasks). The state
// of (row, split) goes to slot split_offsets[row] + split; a row with one split writes O.
//
// Tail merge (kTailMerge): after its slot stores the CTA bumps the (row, kvh) completion counter
// once (arrive_last); the CTA that brings it to the row's split count is the last, resets it
// to 0 (all others have arrived, so a replay needs no memset) and merges the G heads from L2
// (__ldcg, merge_head). No CTA ever waits on another:
// the last one to finish does the work, as in XQA's multi-block mode.
// PDL: with p.early_kv the plan and the first K/V tiles (never a row's last token) are read
// before griddepcontrol.wait (decode_common.cuh, decode_range_tc); Q, the last token, every
// write and the counters come after it.
#pragma once
#include "decode_common.cuh"

namespace pkv {

// True on every thread of the CTA that arrives last at the (row, kvh) counter. The pattern of
// cooperative groups' grid sync: the barrier orders every thread's slot stores before thread 0's
// device-scope fence (release), then one atomic per CTA; the last CTA fences again (acquire)
// before the barrier that releases its threads to read the other CTAs' slots.
__device__ __forceinline__ bool arrive_last(int* counter, int nsplit) {
  __syncthreads();
  int last = 0;
  if (threadIdx.x == 0) {
    __threadfence();
    last = atomicAdd(counter, 1) == nsplit - 1;
    if (last) {
      *counter = 0;  // every other CTA of this (row, kvh) has arrived: ready for the next launch
      __threadfence();
    }
  }
  return __syncthreads_or(last);
}

// The tail merge through shared memory (PKV_TAIL_SMEM) serves rows of at most kTailSlots
// splits, and instantiations whose G heads give every thread a whole number of float4 outputs.
constexpr int kTailSlots = 64;
template <int D, int G, typename KV>
__host__ __device__ constexpr int tail_chunk() {  // partial states per shared-memory chunk
  return (smem_bytes<D, G, KV>() - G * kTailSlots * 2 * 4) / (G * D * 4);
}
template <int D, int G, typename KV>
__host__ __device__ constexpr bool smem_tail() {
  return PKV_TAIL_SMEM != 0 && (G * D) % (4 * kThreads) == 0 && tail_chunk<D, G, KV>() >= 4;
}

// The merge of the G heads of (row, kvh) by the last CTA, one warp per head from registers:
// (1 + ceil(n / 16)) dependent L2 round trips per head, and G / 4 heads per warp in turn. Not
// inlined: inlined, it changed the register allocation of the whole kernel and the decode loop
// ran ~5 % slower (ncu, B1 32K).
template <typename T, int D, int G>
__device__ __noinline__ void tail_merge_warps(const DecodeParams& p, int row, int kvh, int first,
                                              int nsplit) {
  for (int g = threadIdx.x / 32; g < G; g += kThreads / 32) {  // one warp per head
    const int h = kvh * G + g;
    T* o = static_cast<T*>(p.out) + ((long long)row * p.num_qo_heads + h) * D;
    merge_head<T, D>(p.part_a, p.part_ml, p.num_qo_heads, first, first + nsplit, h, o,
                     threadIdx.x % 32);
  }
}

// The same merge by the whole CTA through its shared memory, free once the decode is done
// (benches/NOTES.md, "Session 16": at G = 8 the warp merge read ~26 GB/s, 0.16 us per split on
// the layer's critical path). The partial outputs of the G heads of one slot are G * D
// contiguous floats; cp.async copies C = tail_chunk() slots of them at once while every thread
// loads (m, l) of the (head, slot) pairs, so a row of n splits costs about ceil(n / C) L2 round
// trips (C = 23 at G = 8, D = 128) instead of 2 * (1 + ceil(n / 16)). Then each head's
// (m_all, 1 / l_all) and slot weights 2^(m_s - m_all) / l_all (as merge_head), and each thread
// sums its E = G * D / kThreads outputs (one head's) over the slots.
template <typename T, typename KV, int D, int G>
__device__ __noinline__ void tail_merge_smem(const DecodeParams& p, int row, int kvh, int first,
                                             int n, float* sm) {
  constexpr int C = tail_chunk<D, G, KV>();
  constexpr int GD = G * D;
  constexpr int E = GD / kThreads;   // outputs per thread, a multiple of 4
  float* w = sm;                         // [G][kTailSlots]: m, then the weight
  float* l = sm + G * kTailSlots;        // [G][kTailSlots]
  float* a = sm + 2 * G * kTailSlots;    // [C][G * D]
  const long long hq = p.num_qo_heads;
  const float* src = p.part_a + ((long long)first * hq + kvh * G) * D;   // slot s: src + s * hq * D
  cp_async_wait<0>();   // the decode's copies have landed and every warp is done with smem
  __syncthreads();
  auto issue = [&](int s0, int cnt) {
    for (int i = threadIdx.x; i < cnt * (GD / 4); i += kThreads) {
      const int j = i / (GD / 4), k = i % (GD / 4);
      cp_async16(a + j * GD + 4 * k, src + (long long)(s0 + j) * hq * D + 4 * k);
    }
    cp_async_commit();
  };
  issue(0, min(C, n));
  for (int i = threadIdx.x; i < G * n; i += kThreads) {
    const int g = i / n, s = i % n;
    const float2 ml = __ldcg(reinterpret_cast<const float2*>(
        p.part_ml + (((long long)(first + s)) * hq + kvh * G + g) * 2));
    w[g * kTailSlots + s] = ml.x;
    l[g * kTailSlots + s] = ml.y;
  }
  __syncthreads();
  const int lane = threadIdx.x % 32;
  for (int g = threadIdx.x / 32; g < G; g += kWarps) {
    float m = -INFINITY;
    for (int s = lane; s < n; s += 32) m = fmaxf(m, w[g * kTailSlots + s]);
#pragma unroll
    for (int off = 16; off > 0; off >>= 1) m = fmaxf(m, __shfl_xor_sync(0xffffffffu, m, off));
    float sum = 0.f;
    for (int s = lane; s < n; s += 32) sum += l[g * kTailSlots + s] * rescale(w[g * kTailSlots + s], m);
#pragma unroll
    for (int off = 16; off > 0; off >>= 1) sum += __shfl_xor_sync(0xffffffffu, sum, off);
    const float inv_l = 1.f / sum;
    __syncwarp();   // every lane has read this head's m values before they become weights
    for (int s = lane; s < n; s += 32) w[g * kTailSlots + s] = rescale(w[g * kTailSlots + s], m) * inv_l;
  }
  const int o0 = threadIdx.x * E, g = o0 / D;   // this thread's E outputs: head g, from o0 % D
  float acc[E];
#pragma unroll
  for (int e = 0; e < E; ++e) acc[e] = 0.f;
  for (int s0 = 0; s0 < n; s0 += C) {
    const int cnt = min(C, n - s0);
    cp_async_wait<0>();
    __syncthreads();   // the chunk (and, the first time, every weight) is visible to all
    for (int j = 0; j < cnt; ++j) {
      const float wj = w[g * kTailSlots + s0 + j];
      const float4* v = reinterpret_cast<const float4*>(a + j * GD + o0);
#pragma unroll
      for (int q = 0; q < E / 4; ++q) {
        const float4 x = v[q];
        acc[4 * q] = fmaf(wj, x.x, acc[4 * q]);
        acc[4 * q + 1] = fmaf(wj, x.y, acc[4 * q + 1]);
        acc[4 * q + 2] = fmaf(wj, x.z, acc[4 * q + 2]);
        acc[4 * q + 3] = fmaf(wj, x.w, acc[4 * q + 3]);
      }
    }
    if (s0 + C < n) {
      __syncthreads();   // every thread is done with the chunk before it is overwritten
      issue(s0 + C, min(C, n - s0 - C));
    }
  }
  T* o = static_cast<T*>(p.out) + ((long long)row * hq + kvh * G) * D + o0;
#pragma unroll
  for (int e0 = 0; e0 < E; e0 += 8) {
    float f[8] = {0.f, 0.f, 0.f, 0.f, 0.f, 0.f, 0.f, 0.f};
#pragma unroll
    for (int e = 0; e < 8 && e0 + e < E; ++e) f[e] = acc[e0 + e];
    const uint4 raw = from_float8(f, T());
    if constexpr (E >= 8) *reinterpret_cast<uint4*>(o + e0) = raw;
    else *reinterpret_cast<uint2*>(o + e0) = make_uint2(raw.x, raw.y);
  }
}

template <typename T, typename KV, int D, int G>
__device__ __forceinline__ void tail_merge(const DecodeParams& p, int row, int kvh, int first,
                                           int nsplit, unsigned char* smem) {
  if constexpr (smem_tail<D, G, KV>()) {
    if (nsplit <= kTailSlots) {
      tail_merge_smem<T, KV, D, G>(p, row, kvh, first, nsplit, reinterpret_cast<float*>(smem));
      return;
    }
  }
  tail_merge_warps<T, D, G>(p, row, kvh, first, nsplit);
}

template <typename T, typename KV, int D, int G, bool kTailMerge>
__device__ __forceinline__ void workqueue_task(const DecodeParams& p) {
  if (!p.early_kv) pdl_enter();  // else decode_range enters after its first copies
  const int task = blockIdx.x;
  if (task >= *p.num_tasks) return;
  trace_mark(p.trace, kEnter);
  if (!p.early_kv) trace_mark(p.trace, kWaited);
  const int* t = p.tasks + 5 * task;
  const int row = t[0], kvh = t[1], split = t[2], begin = t[3], end = t[4];
  const int first = p.split_offsets[row];
  const int nsplit = p.split_offsets[row + 1] - first;
  extern __shared__ uint4 smem[];
  decode_range<T, KV, D, G>(p, row, kvh, begin, end, Sink{nsplit == 1 ? row : -1, first + split},
                        reinterpret_cast<unsigned char*>(smem));
  if constexpr (kTailMerge) {
    if (nsplit > 1 && arrive_last(p.counters + row * p.num_kv_heads + kvh, nsplit))
      tail_merge<T, KV, D, G>(p, row, kvh, first, nsplit, reinterpret_cast<unsigned char*>(smem));
  }
  trace_mark(p.trace, kDone);
}

}  // namespace pkv
