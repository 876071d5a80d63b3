// plan_workqueue.cu — device-side planning of the workqueue route.
//
// Builds, from device-resident seq_lens, the same plan as pkvrt/planner.py's plan_workqueue
// (same split counts, split_offsets and task set; tasks in row order instead of the host's
// longest-first order), so that a whole decode step — planning, decode, merge — can run inside
// an engine's own CUDA graph while the lengths change between replays, with no host work
// proportional to the batch.
//
// Split rule (planner.workqueue_split_counts): want = ceil(target / (B * H_kv)), target =
// ctas_target_single when B = 1 (planner.workqueue_ctas_target), ctas_target otherwise, snapped
// to the nearest allowed count (ties to the smaller); each row is then capped by
// cap = max(1, tiles / min_split_tiles): the largest allowed count <= cap, or cap itself.
// Split s of S covers tiles [s*tiles/S, (s+1)*tiles/S).
//
// Grid:  one CTA of PKV_PLAN_THREADS (1024) threads; rows >= *num_rows are idle (0 splits).
// Layout: seq_lens [max_rows] int32; tasks [task_capacity, 5] int32 (row, kvh, split,
//         tok_begin, tok_end); split_offsets [max_rows + 1]; num_splits [max_rows];
//         num_tasks [1]; candidates [num_candidates] ascending allowed split counts.
// Status (*status, written every launch): bit 0 = the plan needs more than task_capacity tasks
//         (*num_tasks is clamped); bit 1 = some active row has seq_len outside [1, *max_seq_len]
//         (that row gets 0 splits: no task reads its block table or writes its output). So a bad
//         length cannot send a kernel past its block-table row without a host look at the
//         lengths; the page ids in the table are trusted.
// Preconditions: max_rows <= 1024, num_candidates <= 64.
#include <stdint.h>

#include "decode_common.cuh"  // pkv::pdl_enter

#define PKV_PLAN_THREADS 1024

struct PlanParams {
  const int* seq_lens;
  const int* num_rows;
  const int* max_seq_len;  // [1]: longest valid seq_len (block-table columns * page size)
  int* tasks;
  int* num_tasks;
  int* split_offsets;
  int* num_splits;
  int* status;
  const int* candidates;
  int num_candidates;
  int max_rows;
  int num_kv_heads;
  int min_split_tiles;
  int tile_tokens;
  int task_capacity;
  float ctas_target;         // workqueue_ctas_per_sm * sm_count
  float ctas_target_single;  // bucket_ctas_per_sm * sm_count: the target of a one-row step
};

__device__ __forceinline__ int snap(const int* c, int n, int want) {  // nearest, ties smaller
  if (want <= c[0]) return c[0];
  if (want >= c[n - 1]) return c[n - 1];
  int i = 0;
  while (c[i] < want) ++i;  // c[i-1] < want <= c[i]
  return (want - c[i - 1] <= c[i] - want) ? c[i - 1] : c[i];
}

__device__ __forceinline__ int fit(const int* c, int n, int s, int cap) {
  int best = -1;
  for (int i = 0; i < n && c[i] <= cap; ++i) best = c[i];
  return min(s, best >= 0 ? best : cap);
}

extern "C" __global__ void __launch_bounds__(PKV_PLAN_THREADS)
    pkv_plan_workqueue(const __grid_constant__ PlanParams p) {
  pkv::pdl_enter();
  __shared__ int cand[64];
  __shared__ int offs[PKV_PLAN_THREADS + 1];
  __shared__ int warp_sums[32];
  __shared__ int bad_rows;
  const int tid = threadIdx.x, lane = tid % 32, warp = tid / 32;
  if (tid < p.num_candidates) cand[tid] = p.candidates[tid];
  if (tid == 0) bad_rows = 0;
  __syncthreads();

  const int rows = min(*p.num_rows, p.max_rows);
  const int max_len = *p.max_seq_len;
  int s = 0;
  if (tid < rows && (p.seq_lens[tid] < 1 || p.seq_lens[tid] > max_len)) {
    atomicOr(&bad_rows, 1);
  } else if (tid < rows) {
    const int tiles = (p.seq_lens[tid] + p.tile_tokens - 1) / p.tile_tokens;
    const float target = rows == 1 ? p.ctas_target_single : p.ctas_target;
    const int want = (int)ceilf(target / (float)(rows * p.num_kv_heads));
    const int cap = max(1, tiles / p.min_split_tiles);
    s = fit(cand, p.num_candidates, snap(cand, p.num_candidates, want), cap);
  }
  // Block-wide exclusive scan of s (warp shuffles, then warp totals).
  int x = s;
#pragma unroll
  for (int o = 1; o < 32; o *= 2) {
    const int y = __shfl_up_sync(0xffffffffu, x, o);
    if (lane >= o) x += y;
  }
  if (lane == 31) warp_sums[warp] = x;
  __syncthreads();
  if (warp == 0) {
    int w = warp_sums[lane];
#pragma unroll
    for (int o = 1; o < 32; o *= 2) {
      const int y = __shfl_up_sync(0xffffffffu, w, o);
      if (lane >= o) w += y;
    }
    warp_sums[lane] = w;  // inclusive
  }
  __syncthreads();
  const int excl = x - s + (warp > 0 ? warp_sums[warp - 1] : 0);
  offs[tid] = excl;
  if (tid == PKV_PLAN_THREADS - 1) offs[PKV_PLAN_THREADS] = excl + s;
  __syncthreads();
  const int total_slots = offs[PKV_PLAN_THREADS];
  if (tid < p.max_rows) {
    p.split_offsets[tid] = excl;
    p.num_splits[tid] = s;
  }
  if (tid == 0) {
    p.split_offsets[p.max_rows] = total_slots;
    const int want_tasks = total_slots * p.num_kv_heads;
    *p.num_tasks = min(want_tasks, p.task_capacity);
    *p.status = (want_tasks > p.task_capacity ? 1 : 0) | (bad_rows ? 2 : 0);
  }
  // Tasks: slot j belongs to the row r with offs[r] <= j < offs[r+1] (binary search).
  for (int j = tid; j < total_slots; j += PKV_PLAN_THREADS) {
    int lo = 0, hi = rows - 1;
    while (lo < hi) {
      const int mid = (lo + hi + 1) / 2;
      if (offs[mid] <= j) lo = mid; else hi = mid - 1;
    }
    const int r = lo, split = j - offs[r], S = offs[r + 1] - offs[r];
    const int len = p.seq_lens[r];
    const int tiles = (len + p.tile_tokens - 1) / p.tile_tokens;
    const int b = split * tiles / S * p.tile_tokens;
    const int e = min(len, (split + 1) * tiles / S * p.tile_tokens);
    for (int h = 0; h < p.num_kv_heads; ++h) {
      const int t = j * p.num_kv_heads + h;
      if (t < p.task_capacity) {
        int* dst = p.tasks + 5 * t;
        dst[0] = r; dst[1] = h; dst[2] = split; dst[3] = b; dst[4] = e;
      }
    }
  }
}
