// find_shared.cu — the shared prefixes of a decode step, found on the GPU from its block tables.
//
// The device-lengths side of pkvrt.SharedPagesRuntime: rows whose block tables begin with the
// same physical pages (prefix caching, parallel sampling) are cut into chunks whose shared prefix
// is decoded once for all the chunk's rows (their C * G query heads side by side, one decode row),
// and each row decodes its remaining pages alone; merge_segments (merge.cu) then merges each row's
// two states exactly. Everything here has fixed shapes (the step's B rows: B chunk slots, B own
// segments), so an engine's captured step replays whatever the sharing is.
//
// The rule (pkvrt/policy/sharing.py plan_prefix_chunks is its twin, checked entry for entry on
// the GPU):
//   s_r    = (len_r - 1) >> page_log2, the whole pages before row r's last one (0 if len_r is
//            outside [1, width << page_log2]: such a row shares nothing)
//   leader = the lowest row whose first page equals r's (both with s >= 1)
//   lcp_r  = leading pages r has in common with its leader, at most min(s_r, s_leader)
//   a leader's n >= 2 rows, by decreasing lcp then row, are cut into parts = ceil(n / C) chunks
//   of consecutive ranks [j n / parts, (j + 1) n / parts); chunk v = (chunks of lower leaders) +
//   j; its prefix = the least lcp of its rows (its last rank's); a chunk of one row is none.
// Outputs (B = rows, W = width):
//   chunk_seq [B]          prefix tokens of chunk v (0: no chunk v, an idle decode row)
//   chunk_bt  [B, W]       its pages: its leader's first prefix entries
//   q_index   [B, H_kv, C, G] int64: the q row (of q viewed [B * H_q, D]) of the chunk decode's
//                          head (hk, c, j): row r of chunk position c, head hk * G + j; positions
//                          past a chunk's rows (and chunks that do not exist) repeat its first
//                          row (row 0 for no chunk): computed, never merged
//   own_seq   [B], own_bt [B, W]: row r's tokens after its chunk's prefix and their pages
//                          (a bad length is passed on unchanged: the planning kernel flags it)
//   slots     [B, 2] int64: chunk state v * C + c or -1; own state B * C + r (-1 for length 0)
//   rule_out [6] double (when given): the rule's plain and shared µs, 1 / 0 / -1 (shared / plain
//                          / no chunk found), the plain step's and the chunk decode's page re-reads,
//                          the chunk decode's split count by the time model (0: the partition's
//                          cut; on a step run plain, the count it would have taken) (without the
//                          rule: 1 or -1, the rest 0)
//   split_pin [1] int (when given): that count where the step shares, else 0; written every
//                          launch (the chunk decode's planning kernel reads it)
// The rule (rule = 1; pkvrt.policy.sharing.SharingRule is its twin): where chunks were found, the
// step shares only if the calibration's time model (plan_cut.cuh: the cut each decode's planning
// kernel will take, and its time) predicts the plain step at least `margin` (routes.toml
// [sharing] device_margin) times the shared one:
//   plain  = T(plain decode of the step's lengths) - l2_saved_us * (pages each row shares with
//            its leader, summed over the rows that are not leaders: what the plain step re-reads)
//            + plain_extra_us (the shared path's launches run whatever the decision: a step run
//            plain still has its query gather, idle chunk decode and merge)
//   shared = T(chunk decode of the chunks' prefixes) - l2_saved_us * (each leader's chunks'
//            prefixes less its longest: the chunks' own re-reads) + T(own decode) + extra_us
// Otherwise every chunk is dropped and the outputs are the plain step's (no chunk state, every
// row's own segment its whole table), so the graph of the step runs the plain decode in the own
// decode's place. rule = 0: share wherever chunks were found.
// The chunk decode's cut (with the rule and split_pin; ops.find_shared passes a rule with
// model_cut_rows > 0 only with split_pin): T(chunk decode) above is its planning
// kernel's cut, the partition's, except where the step has at most model_cut_rows chunks and
// the partition's cut is predicted at least model_cut_margin times the time model's fastest cut
// (pkv::fastest_cut, plan_cut.cuh): then that cut's count and time, and the chunk decode's
// planning kernel is given the count (split_pin). Measured on the host-lengths twin
// (SharedPagesRuntime._chunk_cut): the partition cuts chunk decodes of two to four 8K rows
// 1.3-1.5x slower than the model's best (benches/NOTES.md, "The chunk decode's cut").
// Grid: one CTA of 1024 threads (rows <= 1024). Costs O(B^2) shared-memory compares (leaders and
// ranks) and one pass over the block-table entries the step uses (the lcp, then the copies);
// the rule three cuts of B rows (plan_cut.cuh) and, on a step of at most model_cut_rows
// chunks, the chunk decode's time at each of its split counts (a warp a count).
#include <stdint.h>

#include "decode_common.cuh"  // pkv::pdl_enter
#include "plan_cut.cuh"       // pkv::choose_cut, pkv::cut_time_us

#define PKV_FIND_THREADS 1024

struct FindSharedParams {
  const int* seq_lens;       // [rows]
  const int* block_tables;   // [rows, bt_stride]
  int bt_stride;
  int rows;                  // B <= 1024
  int width;                 // W: block-table entries a row may use (the outputs' width too)
  int page_size_log2;
  int chunk_rows;            // C >= 2
  int group;                 // G
  int num_kv_heads;          // H_kv
  int* chunk_seq;            // [B]
  int* chunk_bt;             // [B, out_stride]
  int* own_seq;              // [B]
  int* own_bt;               // [B, out_stride]
  int out_stride;
  long long* q_index;        // [B * H_kv * C * G]
  long long* slots;          // [B, 2]
  // The rule (header). The row model is the plain and own decodes' (the step's G), the chunk
  // model the chunk decode's (group C * G): each Runtime's route, calibration and candidates.
  int rule;                  // 1: share where it pays; 0: wherever chunks were found
  int tile_tokens;
  int sms;
  const int* row_candidates;
  int row_num_candidates, row_min_split_tiles, row_resident, row_slowdown8, row_overhead8;
  int row_max_ctas, row_free_slots, row_room_slots, row_room8, row_room_chunk;
  const int* chunk_candidates;
  int chunk_num_candidates, chunk_min_split_tiles, chunk_resident, chunk_slowdown8, chunk_overhead8;
  int chunk_max_ctas, chunk_free_slots, chunk_room_slots, chunk_room8, chunk_room_chunk;
  double row_read_scale, row_depth_us, row_tail_us, row_split_us, row_merge_us, row_room_us, row_fixed_us;
  double chunk_read_scale, chunk_depth_us, chunk_tail_us, chunk_split_us, chunk_merge_us, chunk_room_us;
  double chunk_fixed_us;
  double token_us;           // µs to read one token's K and V (every KV head) at the calibration's beta
  double l2_saved_us;        // µs a re-read page costs less than a first read: (1 - l2_reread_cost) * page / beta
  double extra_us;           // what the shared path adds to its two decodes per layer
  double plain_extra_us;     // what its launches add to a step run plain (idle chunk decode)
  double margin;             // routes.toml [sharing] device_margin
  double* rule_out;          // [6] or null
  // The chunk decode's cut by the time model (header): split_pin null (off), or [1], written
  // every launch and read by the chunk decode's planning kernel after its PDL wait.
  int* split_pin;
  int model_cut_rows;        // routes.toml [sharing] model_cut_rows: at most this many chunks (0: off)
  int chunk_max_tasks;       // the chunk decode's planning grid (task slots): counts over it skipped
  double model_cut_margin;   // routes.toml [sharing] model_cut_margin
};

// Two sums and a max over a warp, in every lane.
__device__ __forceinline__ void warp_reduce(long long& a, long long& b, int& c) {
#pragma unroll
  for (int o = 16; o > 0; o >>= 1) {
    a += __shfl_xor_sync(0xffffffffu, a, o);
    b += __shfl_xor_sync(0xffffffffu, b, o);
    c = max(c, __shfl_xor_sync(0xffffffffu, c, o));
  }
}

// Two sums and a max over the CTA's threads (every thread calls; each gets them): each warp's by
// shuffles, then warp 0's over the 32 warps. scratch: [99] long long.
struct Reduced {
  long long a, b;
  int c;
};

__device__ Reduced block_reduce(long long a, long long b, int c, long long* scratch) {
  const int lane = threadIdx.x % 32, warp = threadIdx.x / 32;
  warp_reduce(a, b, c);
  if (lane == 0) {
    scratch[warp] = a;
    scratch[32 + warp] = b;
    scratch[64 + warp] = c;
  }
  __syncthreads();
  if (warp == 0) {   // PKV_FIND_THREADS / 32 = 32 warps: a lane each
    a = scratch[lane];
    b = scratch[32 + lane];
    c = (int)scratch[64 + lane];
    warp_reduce(a, b, c);
    if (lane == 0) {
      scratch[96] = a;
      scratch[97] = b;
      scratch[98] = c;
    }
  }
  __syncthreads();
  const Reduced r{scratch[96], scratch[97], (int)scratch[98]};
  __syncthreads();   // scratch may be reused by the next call
  return r;
}

// One decode's cut and what its time needs (plan_cut.cuh), kept in shared memory.
struct DecodeCut {
  pkv::Cut cut;
  long long tokens;   // K/V tokens it reads
  long long merged;   // sum of the n_r > 1
  int max_splits;
  int longest;        // the rows' most tiles and their sum
  long long total_tiles;
};

// A decode's partition model (plan_cut.cuh) and time constants: the row model's (the plain and
// own decodes) or the chunk model's (CHUNK), with `candidates` in shared memory.
template <bool CHUNK>
__device__ __forceinline__ pkv::CutModel cut_model(const FindSharedParams& p, const int* candidates) {
  return CHUNK
      ? pkv::CutModel{candidates, p.chunk_num_candidates, p.chunk_min_split_tiles, p.sms,
                      p.chunk_resident, p.chunk_slowdown8, p.chunk_overhead8, p.chunk_max_ctas,
                      p.chunk_free_slots, p.chunk_room_slots, p.chunk_room8, p.chunk_room_chunk}
      : pkv::CutModel{candidates, p.row_num_candidates, p.row_min_split_tiles, p.sms,
                      p.row_resident, p.row_slowdown8, p.row_overhead8, p.row_max_ctas,
                      p.row_free_slots, p.row_room_slots, p.row_room8, p.row_room_chunk};
}

template <bool CHUNK>
__device__ __forceinline__ pkv::CutTime cut_time(const FindSharedParams& p) {
  return CHUNK
      ? pkv::CutTime{p.chunk_read_scale, p.chunk_depth_us, p.chunk_tail_us, p.chunk_split_us,
                     p.chunk_merge_us, p.chunk_room_us, p.chunk_fixed_us}
      : pkv::CutTime{p.row_read_scale, p.row_depth_us, p.row_tail_us, p.row_split_us,
                     p.row_merge_us, p.row_room_us, p.row_fixed_us};
}

// The cut of a decode of B rows whose lengths are `len` (this thread's row; 0 for an idle row or
// a thread past B), as its planning kernel will cut it: the row model's (the plain and own
// decodes) or the chunk model's (CHUNK), whose candidates (in shared memory) the warps of
// choose_cut read; written to *out by thread 0. tiles: [1024] shared scratch. (A template, so
// that the model's fields stay operands of the parameter bank rather than registers: at 1024
// threads the kernel has 64.)
template <bool CHUNK>
__device__ void decode_cut(int len, const FindSharedParams& p, const int* candidates, int* tiles,
                           long long* scratch, DecodeCut* out) {
  const int tr = len > 0 ? pkv::cut_ceil_div(len, p.tile_tokens) : 0;
  tiles[threadIdx.x] = tr;
  const Reduced sums = block_reduce(len, tr, tr, scratch);   // (its barriers publish tiles[])
  if (threadIdx.x == 0) out->tokens = sums.a;   // (not held through the cut)
  const long long total = sums.b;
  const int longest = sums.c;
  const pkv::Cut cut = pkv::choose_cut<PKV_FIND_THREADS>(tiles, p.rows, longest, total, p.num_kv_heads,
                                                         cut_model<CHUNK>(p, candidates));
  const int n = tr > 0 ? pkv::cut_ceil_div(tr, cut.chunk) : 0;
  const Reduced splits = block_reduce(n > 1 ? n : 0, 0, n, scratch);
  const int max_splits = splits.c;
  const long long merged = splits.a;
  if (threadIdx.x == 0) {
    out->cut = cut;
    out->merged = merged;
    out->max_splits = max_splits;
    out->longest = longest;
    out->total_tiles = total;
  }
}

// Its time (one thread: thread 0, 32 or 64, one cut each).
template <bool CHUNK>
__device__ double decode_us(const DecodeCut& d, const FindSharedParams& p) {
  return pkv::cut_time_us(cut_time<CHUNK>(p), p.sms, CHUNK ? p.chunk_resident : p.row_resident, d.cut,
                          d.tokens * p.token_us, d.max_splits, d.merged, p.num_kv_heads);
}

extern "C" __global__ void __launch_bounds__(PKV_FIND_THREADS, 1)
    pkv_find_shared(const __grid_constant__ FindSharedParams p) {
  __shared__ int first_of[PKV_FIND_THREADS];   // first page (rows with s >= 1)
  __shared__ int s_of[PKV_FIND_THREADS];       // shareable pages
  __shared__ int leader_of[PKV_FIND_THREADS];
  __shared__ int lcp_of[PKV_FIND_THREADS];
  __shared__ int count_of[PKV_FIND_THREADS];   // rows per leader
  __shared__ int base_of[PKV_FIND_THREADS];    // first chunk of a leader
  __shared__ int prefix_of[PKV_FIND_THREADS];  // chunk v's prefix pages (0: none)
  __shared__ int head_of[PKV_FIND_THREADS];    // chunk v's first row (-1: none)
  __shared__ int lead_of_chunk[PKV_FIND_THREADS];
  __shared__ int chunk_of[PKV_FIND_THREADS];   // row r's chunk slot v * C + c, -1: none
  __shared__ int warp_sums[32];
  const int tid = threadIdx.x, lane = tid % 32, warp = tid / 32;
  const int B = p.rows, C = p.chunk_rows, G = p.group, HKV = p.num_kv_heads;
  // the rule's split counts, constant (the Runtimes'): read before the wait, into shared memory
  // (choose_cut's warps read them), as the planning kernel reads its own
  __shared__ int cands[2][64];   // row, chunk
  if (p.rule && tid < p.row_num_candidates) cands[0][tid] = p.row_candidates[tid];
  if (p.rule && tid >= 64 && tid - 64 < p.chunk_num_candidates) cands[1][tid - 64] = p.chunk_candidates[tid - 64];
  pkv::pdl_enter();

  // 1. Shareable pages and first page of each row.
  int len = 0, s = 0;
  if (tid < B) {
    len = p.seq_lens[tid];
    const bool valid = len >= 1 && len <= (p.width << p.page_size_log2);
    s = valid ? (len - 1) >> p.page_size_log2 : 0;
    first_of[tid] = s >= 1 ? p.block_tables[(long long)tid * p.bt_stride] : 0;
  }
  s_of[tid] = s;
  count_of[tid] = 0;
  prefix_of[tid] = 0;
  head_of[tid] = -1;
  chunk_of[tid] = -1;
  __syncthreads();

  // 2. Leader: the lowest row of the same first page.
  int leader = tid;
  if (tid < B && s >= 1) {
    const int f = first_of[tid];
    for (int g = 0; g < tid; ++g)
      if (s_of[g] >= 1 && first_of[g] == f) { leader = g; break; }
  }
  leader_of[tid] = leader;
  __syncthreads();

  // 3. lcp with the leader: a warp per row, 128 entries per step (each lane's four loads issued
  // before any is compared: a shared run is read to its end, and one load's latency a step is
  // what the step costs), the first mismatch by ballot.
  for (int r = warp; r < B; r += PKV_FIND_THREADS / 32) {
    const int g = leader_of[r], n = min(s_of[r], s_of[g]);
    int lcp = n;
    if (g != r) {
      const int* a = p.block_tables + (long long)r * p.bt_stride;
      const int* b = p.block_tables + (long long)g * p.bt_stride;
      constexpr int U = 4;
      for (int i0 = 0; i0 < n && lcp == n; i0 += 32 * U) {
        int av[U], bv[U];
#pragma unroll
        for (int u = 0; u < U; ++u) {
          const int i = i0 + 32 * u + lane;
          av[u] = i < n ? a[i] : 0;
          bv[u] = i < n ? b[i] : 0;
        }
#pragma unroll
        for (int u = 0; u < U; ++u) {
          const unsigned diff = __ballot_sync(0xffffffffu, av[u] != bv[u]);
          if (diff && lcp == n) lcp = i0 + 32 * u + __ffs(diff) - 1;
        }
      }
    }
    if (lane == 0) lcp_of[r] = lcp;
  }
  __syncthreads();
  if (tid < B && s >= 1) atomicAdd(&count_of[leader], 1);
  __syncthreads();

  // 4. Chunks: each leader's count, their first chunk (a scan in leader order), each row's rank.
  const int n_lead = tid < B && s >= 1 && leader == tid ? count_of[tid] : 0;
  const int parts_here = n_lead >= 2 ? (n_lead + C - 1) / C : 0;
  int total;
  const int base = pkv::block_exclusive_scan(parts_here, warp_sums, &total);
  base_of[tid] = base;
  __syncthreads();
  if (tid < B && s >= 1 && count_of[leader] >= 2) {
    const int n = count_of[leader], lcp = lcp_of[tid];
    int rank = 0;
    for (int r = 0; r < B; ++r) {
      if (s_of[r] < 1 || leader_of[r] != leader) continue;
      const int l = lcp_of[r];
      rank += l > lcp || (l == lcp && r < tid);
    }
    const int parts = (n + C - 1) / C;
    const int j = ((rank + 1) * parts - 1) / n;
    const int start = j * n / parts, end = (j + 1) * n / parts;
    const int v = base_of[leader] + j;
    if (end - start >= 2) {
      chunk_of[tid] = v * C + (rank - start);
      if (rank == start) { head_of[v] = tid; lead_of_chunk[v] = leader; }
      if (rank == end - 1) prefix_of[v] = lcp;
    }
  }
  __syncthreads();

  // 4b. The rule (header): keep the chunks only where the shared step is predicted faster.
  const bool found = __syncthreads_or(tid < B && chunk_of[tid] >= 0);
  if (p.rule_out != nullptr && tid < 6) p.rule_out[tid] = tid != 2 ? 0.0 : found ? 1.0 : -1.0;
  if (p.split_pin != nullptr && tid == 0) *p.split_pin = 0;   // the partition's cut, unless below
  if (p.rule && found) {
    // (its partial results in shared memory, so that no value outlives the three cuts in
    // registers: the kernel has 64 at 1024 threads)
    __shared__ long long scratch[99];
    __shared__ double part_us[3];   // plain, chunk, own
    __shared__ long long rereads[2];
    int* tiles = first_of;   // free since the leaders were found
    // re-reads: the plain step's (each non-leader row's pages in common with its leader) and the
    // chunks' (each leader's chunks read its first pages: all but the longest prefix again)
    const long long plain_rereads =
        block_reduce(tid < B && s >= 1 && leader != tid ? lcp_of[tid] : 0, 0, 0, scratch).a;
    base_of[tid] = 0;   // free since the chunks were numbered: each leader's longest prefix
    __syncthreads();
    const int prefix = tid < B ? prefix_of[tid] : 0;   // chunk tid's
    if (prefix > 0) atomicMax(&base_of[lead_of_chunk[tid]], prefix);
    __syncthreads();
    const Reduced prefixes = block_reduce(prefix, base_of[tid], 0, scratch);
    const long long chunk_rereads = prefixes.a - prefixes.b;
    if (tid == 0) {
      rereads[0] = plain_rereads;
      rereads[1] = chunk_rereads;
    }
    const int n = tid < B ? p.seq_lens[tid] : 0;   // (read again: not held through the cuts)
    const bool valid = n >= 1 && n <= (p.width << p.page_size_log2);
    const int run = tid < B && chunk_of[tid] >= 0 ? prefix_of[chunk_of[tid] / C] : 0;
    __shared__ DecodeCut cuts[3];   // plain, chunk, own
    decode_cut<false>(valid ? n : 0, p, cands[0], tiles, scratch, &cuts[0]);
    decode_cut<false>(valid ? n - (run << p.page_size_log2) : 0, p, cands[0], tiles, scratch, &cuts[2]);
    // (the chunk decode's last: tiles[] keeps its rows' tiles for the time model's cut)
    decode_cut<true>(prefix << p.page_size_log2, p, cands[1], tiles, scratch, &cuts[1]);
    // the time model's cut of a chunk decode of few chunks (header), its count and time
    __shared__ int model_splits;
    __shared__ double model_us;
    if (p.split_pin != nullptr && __syncthreads_count(prefix > 0) <= p.model_cut_rows) {
      double us;
      const int s = pkv::fastest_cut<PKV_FIND_THREADS>(
          tiles, p.rows, cuts[1].longest, cuts[1].total_tiles, HKV, cut_model<true>(p, cands[1]),
          cut_time<true>(p), cuts[1].tokens * p.token_us, p.chunk_max_tasks, &us);
      if (tid == 0) { model_splits = s; model_us = us; }
    } else if (tid == 0) {
      model_splits = 0;
    }
    __syncthreads();   // cuts[2] and model_*, written by thread 0, read by threads 32 and 64
    // the three times side by side, a thread of three warps each (double precision, a square root)
    if (tid == 0) {
      part_us[0] = fmax(decode_us<false>(cuts[0], p) - p.l2_saved_us * rereads[0], 0.0) + p.plain_extra_us;
    } else if (tid == 32) {
      const double partition = decode_us<true>(cuts[1], p);
      const bool model = model_splits > 0 && partition >= p.model_cut_margin * model_us;
      part_us[1] = fmax((model ? model_us : partition) - p.l2_saved_us * rereads[1], 0.0);
      if (!model) model_splits = 0;
    } else if (tid == 64) {
      part_us[2] = decode_us<false>(cuts[2], p);
    }
    __syncthreads();
    const double t_shared = part_us[1] + part_us[2] + p.extra_us;
    const bool share = part_us[0] >= p.margin * t_shared;
    if (p.rule_out != nullptr && tid == 0) {
      p.rule_out[0] = part_us[0];
      p.rule_out[1] = t_shared;
      p.rule_out[2] = share ? 1.0 : 0.0;
      p.rule_out[3] = (double)rereads[0];
      p.rule_out[4] = (double)rereads[1];
      p.rule_out[5] = (double)model_splits;
    }
    if (p.split_pin != nullptr && tid == 0) *p.split_pin = share ? model_splits : 0;
    if (!share) {   // the plain step: no chunk, every row's own segment its whole table
      chunk_of[tid] = -1;
      prefix_of[tid] = 0;
      head_of[tid] = -1;
    }
    __syncthreads();
  }

  // 5. Slots, q gather indices, lengths; then the block-table copies, a warp per row.
  const int hq = HKV * G;
  len = tid < B ? p.seq_lens[tid] : 0;   // (read again: not held through the rule's cuts)
  const bool valid = len >= 1 && len <= (p.width << p.page_size_log2);
  if (tid < B) {
    const int slot = chunk_of[tid];
    const int run = slot >= 0 ? prefix_of[slot / C] : 0;
    p.own_seq[tid] = valid ? len - (run << p.page_size_log2) : len;
    p.slots[2 * tid] = slot;
    p.slots[2 * tid + 1] = len != 0 ? (long long)B * C + tid : -1;
    p.chunk_seq[tid] = prefix_of[tid] << p.page_size_log2;   // chunk slot tid
  }
  const long long entries = (long long)B * HKV * C * G;
  for (long long e = tid; e < entries; e += PKV_FIND_THREADS) {
    const int j = (int)(e % G), hk = (int)(e / ((long long)G * C) % HKV);
    const int v = (int)(e / ((long long)G * C * HKV));
    const int row = head_of[v] >= 0 ? head_of[v] : 0;
    p.q_index[e] = (long long)row * hq + hk * G + j;
  }
  __syncthreads();   // the chunk rows' own entries below overwrite the fill
  if (tid < B && chunk_of[tid] >= 0) {
    const int v = chunk_of[tid] / C, c = chunk_of[tid] % C;
    long long* q = p.q_index + (((long long)v * HKV) * C + c) * G;
    for (int hk = 0; hk < HKV; ++hk)
      for (int j = 0; j < G; ++j) q[(long long)hk * C * G + j] = (long long)tid * hq + hk * G + j;
  }
  for (int r = warp; r < B; r += PKV_FIND_THREADS / 32) {
    const int l = p.seq_lens[r];
    if (l < 1 || l > (p.width << p.page_size_log2)) continue;
    const int slot = chunk_of[r];
    const int run = slot >= 0 ? prefix_of[slot / C] : 0;
    const int n = ((l - (run << p.page_size_log2)) + (1 << p.page_size_log2) - 1) >> p.page_size_log2;
    const int* src = p.block_tables + (long long)r * p.bt_stride + run;
    int* dst = p.own_bt + (long long)r * p.out_stride;
    for (int i = lane; i < n; i += 32) dst[i] = src[i];
  }
  for (int v = warp; v < B; v += PKV_FIND_THREADS / 32) {
    if (prefix_of[v] == 0) continue;   // no chunk v
    const int* lead = p.block_tables + (long long)lead_of_chunk[v] * p.bt_stride;
    int* dst = p.chunk_bt + (long long)v * p.out_stride;
    for (int i = lane; i < prefix_of[v]; i += 32) dst[i] = lead[i];
  }
}
