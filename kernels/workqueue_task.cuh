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
// Two levels (p.group_counters set; two_level_tail says where): the splits form groups of
// S = ceil(sqrt(nsplit)) consecutive ones; the last CTA of a group (its counter at slot first +
// jS) merges the group into that slot, a partial state, then arrives at the (row, kvh) counter,
// whose last arrival merges the ceil(nsplit / S) group states (stride S). One CTA merging all
// 41-57 splits of 16 heads took 14-25 us after the last decode (H100, 64/4 heads, fp16 D 128:
// benches/NOTES.md, "The fused tail in two levels"); the groups' merges run while other CTAs
// still decode, and what follows the last decode is two merges of at most 8 states each (up to
// 64 splits). Only in the classes of kHasTwoLevelTail (G 5-16 at D 96-256).
// PDL: with p.early_kv the plan and the first K/V tiles (never a row's last token) are read
// before griddepcontrol.wait (decode_common.cuh, prefill_pipeline); Q, the last token, every
// write and the counters come after it.
#pragma once
#include "decode_common.cuh"

namespace pkv {

// Tuning (pkvrt/_buildspec.py TUNING; benches/NOTES.md, the tail merge): PKV_TAIL_ACQREL = 0 is the
// ablation's arrival with two sequentially consistent fences; the tail merge of groups of at least
// PKV_TAIL_WIDE_MIN_GROUP heads (two per warp at G = 8) keeps twice the slots in flight.
#ifndef PKV_TAIL_ACQREL
#define PKV_TAIL_ACQREL 1
#endif
#ifndef PKV_TAIL_WIDE_MIN_GROUP
#define PKV_TAIL_WIDE_MIN_GROUP 8
#endif

// True on every thread of the CTA that arrives last at the (row, kvh) counter. The barrier
// orders every thread's slot stores before thread 0's atomic, whose release (cumulative over
// what the barrier ordered) publishes them; the last CTA's acquire, then the second barrier,
// order its threads' reads of the other CTAs' slots after every arrival. As CUTLASS's generic
// barrier; one acq_rel atomic costs less than the fence-atomic-fence of cooperative groups' grid
// sync (the ablation): 0.15-0.25 us per merge-only layer in cut_protocols, +0.4-1.1 % in the engine
// protocol (measured 2026-12-02, benches/NOTES.md).
__device__ __forceinline__ bool arrive_last(int* counter, int nsplit) {
  __syncthreads();
  int last = 0;
  if (threadIdx.x == 0) {
#if PKV_TAIL_ACQREL
    int old;
    asm volatile("atom.add.acq_rel.gpu.s32 %0, [%1], 1;" : "=r"(old) : "l"(counter) : "memory");
    last = old == nsplit - 1;
    if (last) *counter = 0;  // every other CTA of this (row, kvh) has arrived: ready for the next launch
#else
    __threadfence();
    last = atomicAdd(counter, 1) == nsplit - 1;
    if (last) {
      *counter = 0;  // every other CTA of this (row, kvh) has arrived: ready for the next launch
      __threadfence();
    }
#endif
  }
  return __syncthreads_or(last);
}

// The merge of the G heads of (row, kvh) by the last CTA. Not inlined: inlined, it changed the
// register allocation of the whole kernel and the decode loop ran ~5 % slower (ncu, B1 32K).
// At G = 8 each warp merges two heads in turn (512 B per slot and head at D = 128, 4 KB per slot
// for the CTA): at 53-64 splits the tail after the last decode (arrival + merge) is 8-9 us, a
// third of the layer. Twice the slots in flight (WIDE) cut ~1.2 us there and cost ~0.8 us at
// 2-16 splits; at G = 8 the trace gained, at G = 4 the wider merge's registers (179 -> 223) cost
// the short steps more than it saved, so it is the wide classes' only (GC >= 8: G 5..16).
// Merges the n states at slots first + k * stride into O (or, kPartial, into the partial state
// at slot `first`: a group of the two-level tail), a warp a head at a time.
template <typename T, int D, int GC, bool kPartial>
__device__ __noinline__ void tail_merge(const DecodeParams& p, int row, int kvh, int first, int n,
                                        int stride) {
  const int G = p.group;
  for (int g = threadIdx.x / 32; g < G; g += kThreads / 32) {  // one warp per head
    const int h = kvh * G + g;
    T* o = kPartial ? nullptr : static_cast<T*>(p.out) + ((long long)row * p.num_qo_heads + h) * D;
    const long long at = (long long)first * p.num_qo_heads + h;
    merge_head<T, D, (GC >= PKV_TAIL_WIDE_MIN_GROUP ? 2 : 1), kPartial>(
        p.part_a, p.part_ml, p.num_qo_heads, first, n, stride, h, o, threadIdx.x % 32,
        kPartial ? -INFINITY : sink_log2_of(p.sinks, h),
        kPartial ? nullptr : lse_at(p.lse, p.num_qo_heads, row, h), p.part_a + at * D,
        p.part_ml + at * 2);
  }
}

// The same merge, this warp's heads (g = warp, warp + 4, ...: HW at most) all at once: pair
// j = (head j / NMAX, state j % NMAX) of PAIRS = HW * NMAX; lane j loads its pair's (m, l) and
// every lane its E outputs of every pair before any arithmetic, one round trip for all where
// merge_head takes at least one per head (a warp had 2-4 heads in turn at G 5-16). For n <= NMAX.
template <int D, int GC>
struct TailPairs {
  static constexpr int HW = (GC + kWarps - 1) / kWarps;
  static constexpr int PAIRS = D >= 256 ? 16 : 32;   // registers: PAIRS * D / 32 floats a lane
  static constexpr int NMAX = PAIRS / HW;
};

template <typename T, int D, int GC, bool kPartial>
__device__ __noinline__ void tail_merge_heads(const DecodeParams& p, int row, int kvh, int first,
                                              int n, int stride) {
  constexpr int E = D / 32, HW = TailPairs<D, GC>::HW, NMAX = TailPairs<D, GC>::NMAX;
  constexpr int PAIRS = HW * NMAX;
  const int G = p.group, H = p.num_qo_heads, lane = threadIdx.x % 32, warp = threadIdx.x / 32;
  const int hw = warp < G ? (G - warp + kWarps - 1) / kWarps : 0;   // this warp's heads
  auto head = [&](int i) { return kvh * G + warp + i * kWarps; };
  auto at = [&](int k, int i) { return (long long)(first + k * stride) * H + head(i); };
  auto live = [&](int j) { return j / NMAX < hw && j % NMAX < n; };
  float v[PAIRS][E];
#pragma unroll
  for (int j = 0; j < PAIRS; ++j)
    if (live(j)) load_state_part<E>(p.part_a + at(j % NMAX, j / NMAX) * D + lane * E, v[j]);
  const int mine = lane / NMAX;   // the head of lane's pair (lanes past PAIRS: none)
  float m_j = -INFINITY, l_j = 0.f;
  if (lane < PAIRS && live(lane)) {
    const float2 ml = __ldcg(reinterpret_cast<const float2*>(p.part_ml + at(lane % NMAX, mine) * 2));
    m_j = ml.x;
    l_j = ml.y;
  }
  float m_all[HW], l_all[HW], w = 0.f;
#pragma unroll
  for (int i = 0; i < HW; ++i) {
    float m = mine == i ? m_j : -INFINITY, l = mine == i ? l_j : 0.f;
    warp_fold_ml(m, l);
    m_all[i] = m;
    l_all[i] = l;
    // a partial state stays unnormalised; an output takes out_factor's 1 / l with the sink
    const float scale = !kPartial && i < hw ? out_factor(p, head(i), m, l) : 1.f;
    if (mine == i) w = rescale(m_j, m) * scale;
  }
  float acc[HW][E];
#pragma unroll
  for (int i = 0; i < HW; ++i)
#pragma unroll
    for (int e = 0; e < E; ++e) acc[i][e] = 0.f;
#pragma unroll
  for (int j = 0; j < PAIRS; ++j) {
    const float wj = __shfl_sync(0xffffffffu, w, j);
    if (live(j)) {
#pragma unroll
      for (int e = 0; e < E; ++e) acc[j / NMAX][e] = fmaf(wj, v[j][e], acc[j / NMAX][e]);
    }
  }
#pragma unroll
  for (int i = 0; i < HW; ++i) {
    if (i >= hw) break;
    const int h = head(i);
    if constexpr (kPartial) {
      store_merged<T, E, true>(acc[i], p.part_a + ((long long)first * H + h) * D + lane * E);
      if (lane == 0)
        *reinterpret_cast<float2*>(p.part_ml + ((long long)first * H + h) * 2) = make_float2(m_all[i], l_all[i]);
    } else {
      store_merged<T, E, false>(acc[i], static_cast<T*>(p.out) + ((long long)row * H + h) * D + lane * E);
      float* lse = lse_at(p.lse, H, row, h);
      if (lse != nullptr && lane == 0) *lse = m_all[i] + log2f(l_all[i]);
    }
  }
}

// The tail's merge of n states: all of a warp's heads at once where they fit (G 5-16 at D 96-256,
// kHasTwoLevelTail), else a head at a time. The classes that have this merge and the two-level
// tail: G 5-16 (capacities 8 and 16, the wide merge's: PKV_TAIL_WIDE_MIN_GROUP) at D 96-256.
// Elsewhere a warp merges one head (G <= 4), or the code's registers would cost resident CTAs
// (D 64: its pairs' took the kernel from 124-128 registers to 185-189, 2 CTAs per SM instead of
// 4; the two-level code alone to 129-134, 3 instead of 4), so it is not compiled there; at
// D 96-256 shared memory bounds residency below what the registers allow.
template <int D, int GC>
constexpr bool kHasTwoLevelTail = GC >= PKV_TAIL_WIDE_MIN_GROUP && GC >= 8 && GC <= 16 && D >= 96;

template <typename T, int D, int GC, bool kPartial>
__device__ __forceinline__ void merge_states_of(const DecodeParams& p, int row, int kvh, int first,
                                                int n, int stride) {
  if constexpr (kHasTwoLevelTail<D, GC>) {
    if (n <= TailPairs<D, GC>::NMAX) {
      tail_merge_heads<T, D, GC, kPartial>(p, row, kvh, first, n, stride);
      return;
    }
  }
  tail_merge<T, D, GC, kPartial>(p, row, kvh, first, n, stride);
}

// Whether nsplit states merge in two levels (in the classes above). Forced from
// p.merge_groups_from splits when it is set (tests, ablations); else where one level takes more
// than three round trips to L2 per warp (its heads at once, n <= NMAX: one; else ceil(n / BATCH)
// for each of the warp's ceil(G / 4) heads), since two levels take two and an arrival more. So at
// D 96-128: G 13-16 from 9 splits, G 9-12 from 33, G 5-8 from 33; at D 256: G 13-16 from 5,
// G 9-12 and G 5-8 from 17.
// Measured (H100, 2026-12-06, benches/layer_timeline.py, one level against two from 9 splits):
// G 16 layers 27-34 % shorter on one-row and one-long-row steps, G 7 24 % at 48-64 splits, but
// G 8 11-48 % longer at 16-32 splits, where its heads fit one round trip (benches/NOTES.md).
template <int D, int GC>
__device__ __forceinline__ bool two_level_tail(const DecodeParams& p, int nsplit) {
  if (!kHasTwoLevelTail<D, GC> || p.group_counters == nullptr) return false;
  if (p.merge_groups_from > 0) return nsplit >= p.merge_groups_from;
  if (nsplit <= TailPairs<D, GC>::NMAX) return false;
  constexpr int BATCH = (D >= 256 ? 8 : 16) * 2;   // merge_head's slots in flight (WIDE = 2)
  const int heads = (p.group + kWarps - 1) / kWarps;   // the most a warp merges
  return heads * ((nsplit + BATCH - 1) / BATCH) > 3;
}

// After a CTA's states are stored: the merge of (row, kvh)'s nsplit states by whichever CTA
// arrives last, in one level or two (above).
template <typename T, int D, int GC>
__device__ __forceinline__ void tail(const DecodeParams& p, int row, int kvh, int first, int nsplit,
                                     int split) {
  int* row_counter = p.counters + row * p.num_kv_heads + kvh;
  if constexpr (kHasTwoLevelTail<D, GC>) {
    if (two_level_tail<D, GC>(p, nsplit)) {
      int S = 1;
      while (S * S < nsplit) ++S;
      const int g0 = split / S * S, cnt = min(S, nsplit - g0);
      if (cnt > 1) {
        if (!arrive_last(p.group_counters + (first + g0) * p.num_kv_heads + kvh, cnt)) return;
        merge_states_of<T, D, GC, true>(p, row, kvh, first + g0, cnt, 1);
      }
      if (arrive_last(row_counter, (nsplit + S - 1) / S))
        merge_states_of<T, D, GC, false>(p, row, kvh, first, (nsplit + S - 1) / S, S);
      return;
    }
  }
  if (arrive_last(row_counter, nsplit)) merge_states_of<T, D, GC, false>(p, row, kvh, first, nsplit, 1);
}

template <typename T, typename KV, int D, int GC, bool kTailMerge>
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
  decode_range<T, KV, D, GC>(p, row, kvh, begin, end, Sink{nsplit == 1 ? row : -1, first + split},
                             reinterpret_cast<unsigned char*>(smem));
  trace_mark(p.trace, kDecoded);
  if constexpr (kTailMerge) {
    if (nsplit > 1) tail<T, D, GC>(p, row, kvh, first, nsplit, split);
  }
  trace_mark(p.trace, kDone);
}

}  // namespace pkv
