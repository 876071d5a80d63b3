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
// Grid: one CTA of 1024 threads (rows <= 1024). Costs O(B^2) shared-memory compares (leaders and
// ranks) and one pass over the block-table entries the step uses (the lcp, then the copies).
#include <stdint.h>

#include "decode_common.cuh"  // pkv::pdl_enter

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
};

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

  // 3. lcp with the leader: a warp per row, 32 entries per step, the first mismatch by ballot.
  for (int r = warp; r < B; r += PKV_FIND_THREADS / 32) {
    const int g = leader_of[r], n = min(s_of[r], s_of[g]);
    int lcp = n;
    if (g != r) {
      const int* a = p.block_tables + (long long)r * p.bt_stride;
      const int* b = p.block_tables + (long long)g * p.bt_stride;
      for (int i0 = 0; i0 < n; i0 += 32) {
        const int i = i0 + lane;
        const unsigned diff = __ballot_sync(0xffffffffu, i < n && a[i] != b[i]);
        if (diff) { lcp = i0 + __ffs(diff) - 1; break; }
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

  // 5. Slots, q gather indices, lengths; then the block-table copies, a warp per row.
  const int hq = HKV * G;
  if (tid < B) {
    const int slot = chunk_of[tid];
    const int run = slot >= 0 ? prefix_of[slot / C] : 0;
    const bool valid = len >= 1 && len <= (p.width << p.page_size_log2);
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
