// plan_cut.cuh — the balanced partition's cut of a step and its time, on the GPU.
//
// The planning kernel (plan_workqueue.cu) cuts a step with it; find_shared.cu cuts three steps
// with it (the plain step, the chunk decode, the own decode) to decide whether sharing pays, and
// times a chunk decode of few chunks at each of its split counts (fastest_cut).
// Host twins: pkvrt/policy/planner.py partition_costs / partition_choice (the cut, the same
// integer arithmetic) and pkvrt/policy/costmodel.py measured_us (the time, in double).
//
// The cut (planner.partition_costs). tiles_r = a row's tiles; L = max tiles, W = sum tiles. For
// every candidate s (an allowed count with ceil(L/s) >= min_split_tiles; if none,
// max(1, L / min_split_tiles)) the chunk is c = ceil(L/s), row r gets n_r = ceil(tiles_r / c)
// splits, N = H_kv * sum n_r CTAs, N_big = H_kv * sum of n_r over rows whose largest split
// ceil(tiles_r / n_r) exceeds c/2 (the other rows are small: W_small = H_kv * their tiles,
// N_small = N - N_big). With S = sms, R = resident * S, full = N_big / R, rem = N_big % R and
// load8(k) = 8 + (k-1)*(slowdown8-8):
//     cost = max((8c + f8) * (full * load8(resident) + (rem ? load8(ceil(rem / S)) : 0)) * S
//                  + (8 * W_small + N_small * f8) * (slowdown8 - 8),
//                W8 * (N > S ? load8(resident) / resident : 8))                 (int64)
// W8 = 8 * H_kv * W + N * f8 (the average load at the GPU's best throughput; integer division).
// f8 = the CTA overhead in eighths of a tile (planner.PartitionModel). The chosen s has the
// least cost + room charge (with free = (-N) mod R: room8 * S * (room_slots - free) / room_slots
// when free < room_slots and c <= room_chunk, else 0), then the fewest CTAs, then the smallest
// s, among candidates with N <= max_ctas (the first candidate is always eligible) and, on a
// one-row step, when any of them does, (-N) mod R >= free_slots (the last wave leaves slots for
// the merge). Warp w evaluates candidates w and w + 32 (one pass over the rows per candidate);
// warp 0 filters the candidates and takes the least by shuffles.
//
// The time (costmodel.measured_us of one launch group, in a CUDA graph):
//     T = max(read_scale * read_us, depth_us * depth) + tail_us * sqrt(cost / (64 S))
//         + split_us * max n_r + merge_us * H_kv * (sum of n_r > 1) / S
//         + room_us * room / (64 S) + fixed_us,      depth = ceil(N / R) * c
// read_us: the K/V bytes the step reads at the calibration's beta.
#pragma once

#include <stdint.h>

namespace pkv {

// planner.PartitionModel of one Runtime's calibration, with its route's allowed split counts.
struct CutModel {
  const int* candidates;  // ascending allowed split counts of the route (<= 64)
  int num_candidates;
  int min_split_tiles;
  int sms;        // S
  int resident;   // decode CTAs resident per SM
  int slowdown8;  // an SM's time with two resident CTAs over one, eighths
  int overhead8;  // f8: a CTA's fixed cost, eighths of a tile
  int max_ctas;   // candidates planning more CTAs are skipped (the first is always eligible)
  int free_slots, room_slots, room8, room_chunk;
};

struct Cut {
  int chunk;        // c, tiles per split
  int ctas;         // N
  long long cost;   // the makespan model of the cut (1/64 tile times S), without the room charge
  long long room;   // the room charge the choice added to it
};

// calibration RouteTime of the route kind (µs)
struct CutTime {
  double read_scale, depth_us, tail_us, split_us, merge_us, room_us, fixed_us;
};

__device__ __forceinline__ int cut_ceil_div(int a, int b) { return (a + b - 1) / b; }
__device__ __forceinline__ long long load8(int k, int slowdown8) {
  return 8 + (long long)(k - 1) * (slowdown8 - 8);
}

// The candidates whose chunk ceil(longest / s) is at least min_split_tiles (else the row cap
// max(1, longest / min_split_tiles) alone), in order, into cand[] and *num_cand. One warp
// calls it: lane i tests candidate base + i, a ballot places the kept ones.
__device__ __forceinline__ void filter_candidates(const CutModel& m, int longest, int* cand, int* num_cand) {
  const int lane = threadIdx.x % 32;
  int n = 0;
  for (int base = 0; base < m.num_candidates; base += 32) {
    const int i = base + lane;
    const int s = i < m.num_candidates ? m.candidates[i] : 1;
    const bool keep = i < m.num_candidates && longest > 0 && cut_ceil_div(longest, s) >= m.min_split_tiles;
    const unsigned kept = __ballot_sync(0xffffffffu, keep);
    if (keep) cand[n + __popc(kept & ((1u << lane) - 1u))] = s;
    n += __popc(kept);
  }
  if (lane == 0) {
    if (n == 0) cand[n++] = max(1, longest / m.min_split_tiles);
    *num_cand = n;
  }
}

// A cut's split counts at chunk c over the rows' tiles[0, rows), summed over a warp (every
// lane gets them): all splits, those of rows whose largest split exceeds c / 2 (big), the tiles
// of the other rows, the most splits of a row and the sum of the counts above one (the splits
// the merge reads).
struct CutCounts {
  int all, big, small_tiles, most, merged;
};

__device__ __forceinline__ CutCounts warp_cut_counts(const int* tiles, int rows, int c) {
  CutCounts n{0, 0, 0, 0, 0};
  for (int r = threadIdx.x % 32; r < rows; r += 32) {
    const int tr = tiles[r];
    if (tr > 0) {
      const int k = cut_ceil_div(tr, c);
      n.all += k;
      if (2 * cut_ceil_div(tr, k) > c) n.big += k;
      else n.small_tiles += tr;
      n.most = max(n.most, k);
      if (k > 1) n.merged += k;
    }
  }
#pragma unroll
  for (int o = 16; o > 0; o >>= 1) {
    n.all += __shfl_xor_sync(0xffffffffu, n.all, o);
    n.big += __shfl_xor_sync(0xffffffffu, n.big, o);
    n.small_tiles += __shfl_xor_sync(0xffffffffu, n.small_tiles, o);
    n.most = max(n.most, __shfl_xor_sync(0xffffffffu, n.most, o));
    n.merged += __shfl_xor_sync(0xffffffffu, n.merged, o);
  }
  return n;
}

// The makespan model of a cut at chunk c (header): n_all splits in all, n_big of them in rows
// whose largest split exceeds c / 2, w_small the tiles of the other rows, over H KV heads.
__device__ __forceinline__ long long cut_cost(const CutModel& m, int c, int n_all, int n_big,
                                              int w_small, long long total_tiles, int H) {
  const int S = m.sms, R = m.resident * m.sms, f8 = m.overhead8;
  const long long ctas = (long long)H * n_all, big = (long long)H * n_big;
  const long long full = big / R, rem = big % R;
  const long long loads = full * load8(m.resident, m.slowdown8) +
                          (rem > 0 ? load8((int)((rem + S - 1) / S), m.slowdown8) : 0);
  const long long beside = (8LL * H * w_small + (ctas - big) * f8) * (m.slowdown8 - 8);
  const long long a = (8LL * c + f8) * loads * S + beside;
  const long long work = 8LL * H * total_tiles + ctas * f8;
  const long long b = ctas > S ? work * load8(m.resident, m.slowdown8) / m.resident : work * 8;
  return a > b ? a : b;
}

// The last wave's room charge (planner.PartitionModel.room_charge) of a cut leaving `free`
// resident slots free at chunk c.
__device__ __forceinline__ long long room_charge(const CutModel& m, int free, int c) {
  return m.room_slots > 0 && free < m.room_slots && c <= m.room_chunk
      ? (long long)m.room8 * m.sms * (m.room_slots - free) / m.room_slots : 0LL;
}

// The cut of a step of `rows` rows whose tiles are tiles[0, rows) (shared memory; longest and
// total their max and sum). Block-wide: every thread of a CTA of THREADS threads calls it with
// the same arguments, and every thread gets the cut. Warp 0 reads the candidates and makes the
// choice (a serial loop of thread 0 over 64 candidates, with a 64-bit division each, took most
// of the ~80 us the sharing rule's three cuts cost a step on an H100).
template <int THREADS>
__device__ Cut choose_cut(const int* tiles, int rows, int longest, long long total_tiles,
                          int num_kv_heads, const CutModel& m) {
  __shared__ int cand[64];
  __shared__ long long cost_of[64];
  __shared__ int ctas_of[64], chunk_of[64];
  __shared__ int num_cand;
  __shared__ Cut chosen;
  const int lane = threadIdx.x % 32, warp = threadIdx.x / 32;
  if (warp == 0) filter_candidates(m, longest, cand, &num_cand);
  __syncthreads();

  // Cost of every candidate: warp w takes candidates w, w + 32.
  const int L = longest, H = num_kv_heads, R = m.resident * m.sms;
  for (int k = warp; k < num_cand; k += THREADS / 32) {
    const int c = L > 0 ? cut_ceil_div(L, cand[k]) : 1;
    const CutCounts n = warp_cut_counts(tiles, rows, c);
    if (lane == 0) {
      cost_of[k] = cut_cost(m, c, n.all, n.big, n.small_tiles, total_tiles, H);
      ctas_of[k] = H * n.all;
      chunk_of[k] = c;
    }
  }
  __syncthreads();
  if (warp == 0) {
    // Least cost + room charge, then fewest CTAs, then smallest s (the lowest index), within
    // max_ctas (the first candidate always eligible); on a one-row step first among the cuts
    // whose last wave leaves free_slots resident slots free, so the merge becomes resident during
    // the decode (planner.partition_choice). Lane i weighs candidates i and i + 32, then the
    // warp takes the least (charged, CTAs, index) by shuffles.
    long long best_charged = 0, best_room = 0;
    int best = -1;
    for (int pass = m.free_slots > 0 && rows == 1 ? 0 : 1; pass < 2; ++pass) {
      best = -1;
      for (int k = lane; k < num_cand; k += 32) {
        if (k > 0 && ctas_of[k] > m.max_ctas) continue;
        const int free = (R - ctas_of[k] % R) % R;
        if (pass == 0 && free < m.free_slots) continue;
        const long long room = room_charge(m, free, chunk_of[k]);
        const long long charged = cost_of[k] + room;
        if (best < 0 || charged < best_charged ||
            (charged == best_charged && ctas_of[k] < ctas_of[best])) {
          best = k; best_charged = charged; best_room = room;
        }
      }
#pragma unroll
      for (int o = 16; o > 0; o >>= 1) {
        const int k = __shfl_xor_sync(0xffffffffu, best, o);
        const long long charged = __shfl_xor_sync(0xffffffffu, best_charged, o);
        const long long room = __shfl_xor_sync(0xffffffffu, best_room, o);
        const bool better = k >= 0 && (best < 0 || charged < best_charged ||
            (charged == best_charged && (ctas_of[k] < ctas_of[best] ||
                                         (ctas_of[k] == ctas_of[best] && k < best))));
        if (better) { best = k; best_charged = charged; best_room = room; }
      }
      if (best >= 0) break;   // (the same in every lane after the shuffles)
    }
    if (lane == 0) chosen = Cut{chunk_of[best], ctas_of[best], cost_of[best], best_room};
  }
  __syncthreads();
  const Cut cut = chosen;
  __syncthreads();  // the scratch above may be reused by the next call
  return cut;
}

// costmodel.measured_us of the launch group of `cut` (module comment) on `sms` SMs of `resident`
// decode CTAs each: read_us the K/V bytes' time at beta, max_splits = max n_r, merged_splits =
// sum of the n_r > 1.
__device__ __forceinline__ double cut_time_us(const CutTime& t, int sms, int resident, const Cut& cut,
                                              double read_us, int max_splits, long long merged_splits,
                                              int num_kv_heads) {
  const double S = sms;
  const long long R = (long long)resident * sms;
  const double depth = (double)((cut.ctas + R - 1) / R) * cut.chunk;
  return fmax(t.read_scale * read_us, t.depth_us * depth) + t.tail_us * sqrt(cut.cost / (64.0 * S)) +
         t.split_us * max_splits + t.merge_us * (double)(num_kv_heads * merged_splits) / S +
         t.room_us * (cut.room / (64.0 * S)) + t.fixed_us;
}

// The time model's fastest cut of a step (find_shared.cu: the chunk decode of few chunks, which
// the partition's cost ranks worse than measured; SharedPagesRuntime's host twin
// _chunk_cut): every candidate choose_cut would weigh, each taken as the only one (the cut the
// planning kernel makes given that one count: its chunk, CTAs, cost and room charge), timed by
// cut_time_us at `t`; counts planning more than max_tasks CTAs are skipped (the first count,
// the fewest CTAs, is kept whatever it plans); the least time, ties to fewer splits. Returns
// the split count and its time in *best_us (every thread). Block-wide, as choose_cut.
template <int THREADS>
__device__ int fastest_cut(const int* tiles, int rows, int longest, long long total_tiles,
                           int num_kv_heads, const CutModel& m, const CutTime& t, double read_us,
                           int max_tasks, double* best_us) {
  __shared__ int cand[64];
  __shared__ double us_of[64];
  __shared__ bool fits[64];
  __shared__ int num_cand;
  __shared__ int chosen;
  __shared__ double chosen_us;
  const int lane = threadIdx.x % 32, warp = threadIdx.x / 32;
  if (warp == 0) filter_candidates(m, longest, cand, &num_cand);
  __syncthreads();
  const int H = num_kv_heads, R = m.resident * m.sms;
  for (int k = warp; k < num_cand; k += THREADS / 32) {
    const int c = longest > 0 ? cut_ceil_div(longest, cand[k]) : 1;
    const CutCounts n = warp_cut_counts(tiles, rows, c);
    if (lane == 0) {
      const int ctas = H * n.all;
      const Cut cut{c, ctas, cut_cost(m, c, n.all, n.big, n.small_tiles, total_tiles, H),
                    room_charge(m, (R - ctas % R) % R, c)};
      us_of[k] = cut_time_us(t, m.sms, m.resident, cut, read_us, n.most, n.merged, H);
      fits[k] = k == 0 || ctas <= max_tasks;
    }
  }
  __syncthreads();
  if (warp == 0) {   // lane i weighs counts i and i + 32; the least (time, count) by shuffles
    int best = -1;
    double best_t = 0.0;
    for (int k = lane; k < num_cand; k += 32)
      if (fits[k] && (best < 0 || us_of[k] < best_t)) { best = k; best_t = us_of[k]; }
#pragma unroll
    for (int o = 16; o > 0; o >>= 1) {
      const int k = __shfl_xor_sync(0xffffffffu, best, o);
      const double u = __shfl_xor_sync(0xffffffffu, best_t, o);
      if (k >= 0 && (best < 0 || u < best_t || (u == best_t && k < best))) { best = k; best_t = u; }
    }
    if (lane == 0) { chosen = cand[best]; chosen_us = best_t; }
  }
  __syncthreads();
  const int s = chosen;
  *best_us = chosen_us;
  __syncthreads();  // the scratch above may be reused by the next call
  return s;
}

}  // namespace pkv
