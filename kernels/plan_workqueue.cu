// plan_workqueue.cu — device-side planning of the workqueue route.
//
// Builds, from device-resident seq_lens, the same plan as pkvrt/policy/planner.py's plan_workqueue
// (same split counts, split_offsets, tasks and task order), so that a whole decode step — planning, decode, merge — can run inside
// an engine's own CUDA graph while the lengths change between replays, with no host work
// proportional to the batch.
//
// Sliding window (window_left >= 0): row r attends to [start_r, len_r), start_r = len_r - 1 -
// window_left when positive (else 0), and everything below is planned on its attended length
// len_r - start_r: tiles, the split rule, the task order's key; a task's range is offset by
// start_r, and only the block-table entries of the attended range are checked (and copied).
// Split rule: the balanced partition (planner.balanced_partition, planner.partition_costs):
// tiles_r = ceil((len_r - start_r) / tile_tokens), cut by pkv::choose_cut (plan_cut.cuh, which
// works the cost out). Split j of n over t tiles covers tiles [j*t/n, (j+1)*t/n).
// Task order (the host's): rows by decreasing tokens per split (seq_len / splits, integer), ties
// by row index, then split, then KV head. The GPU starts CTAs in blockIdx order, so the longest
// tasks start first and the short ones fill the tail (in row order a long row listed after
// short ones started its CTAs in a later wave). Row r's rank is the count of rows before it in
// that order (each active thread counts over the rows: O(rows) per thread).
//
// Direct mode (src_seq_lens / src_block_tables given, rows and max_seq as parameters): the
// kernel copies the step's lengths and the block-table entries they use into seq_lens and
// block_tables itself, so an engine's captured step has no copy or fill node before it (each
// costs a dependent launch); otherwise the Runtime has copied them there.
// CSR direct mode (src_indptr, src_last_page_len and src_block_tables = FlashInfer's paged-KV
// indices): row r's pages are src_block_tables[src_indptr[r] .. src_indptr[r + 1]) and its
// length (pages - 1) * page_size + src_last_page_len[r] (0 for a row of no pages: an engine's
// padding row). A row whose indptr decreases, starts below 0 or ends past src_indices_len, or
// whose last_page_len is outside [1, page_size], is a bad length (status bit 1, no work).
// Grid:  one CTA of PKV_PLAN_THREADS (1024) threads; rows >= the active rows are idle (0 splits).
// Layout: seq_lens [max_rows] int32; tasks [task_capacity, 5] int32 (row, kvh, split,
//         tok_begin, tok_end); split_offsets [max_rows + 1]; num_splits [max_rows];
//         num_tasks [1]; candidates [num_candidates] ascending allowed split counts (or, where
//         split_pin is given and *split_pin > 0, that one count).
// Status (*status, written every launch): bit 0 = the plan needs more than task_capacity tasks
//         (*num_tasks is clamped); bit 1 = some active row has seq_len outside [0, *max_seq_len]
//         (a row of length 0 is idle: an engine's padding row, given no work and not flagged)
//         (max_seq in direct mode);
//         bit 2 = some active row's block table holds a page id outside [0, *num_pages) in one
//         of the ceil(seq_len / page_size) entries the decode would read (checked when
//         block_tables is given and *num_pages > 0). Such a row gets 0 splits: no task reads its block table or
//         writes its output. So neither a bad length nor a bad page id can send a decode kernel
//         outside its block-table row or the cache without a host look at them.
// Preconditions: max_rows <= 1024, num_candidates <= 64; candidates are read before the PDL
// wait, so no kernel that may still run then (the one before this one, and since the merge's
// early trigger the decode before that merge) may write them.
#include <stdint.h>

#include "decode_common.cuh"  // pkv::pdl_enter
#include "plan_cut.cuh"       // pkv::choose_cut

#define PKV_PLAN_THREADS 1024

struct PlanParams {
  int* seq_lens;            // read; written in direct mode (src_seq_lens)
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
  int sms;           // S: the GPU's SMs
  int resident;      // decode CTAs resident per SM (occupancy)
  int slowdown8;     // an SM's time with two resident CTAs over one, eighths
  int overhead8;     // f8: a CTA's fixed cost, eighths of a tile
  int max_ctas;      // candidates planning more CTAs are skipped (calibration splits.max_waves * R)
  int* block_tables;        // [rows, bt_stride] or null: page ids not checked
  const int* num_pages;     // [1]: pages in the cache, valid ids are [0, *num_pages); 0 = unchecked
  int bt_stride;
  int page_size_log2;
  // Direct mode (an engine's captured step: no copy or fill nodes before the planning kernel):
  const int* src_seq_lens;      // null, or the step's lengths, copied to seq_lens (active rows)
  const int* src_block_tables;  // null, or the step's block tables [rows, src_bt_stride]: the
                                // entries each row's length uses are copied to block_tables
  int src_bt_stride;
  int rows;                     // >= 0: the active rows (num_rows is not read); -1: *num_rows
  int max_seq;                  // > 0: the longest valid seq_len (max_seq_len not read); 0: read it
  int free_slots;               // prefer cuts whose last wave leaves this many resident slots free
  int room_slots;               // a last wave leaving free < room_slots slots is charged
  int room8;                    // room8 * S * (room_slots - free) / room_slots (eighths of a tile)
  int room_chunk;               // ... on cuts whose chunk is at most room_chunk tiles
  int window_left;              // -1, or each row attends to its last window_left + 1 tokens
  // CSR direct mode (with src_block_tables = the indices; src_seq_lens null):
  const int* src_indptr;        // null, or [rows + 1]: row r's entries start at src_indptr[r]
  const int* src_last_page_len; // [rows]: tokens in each row's last page
  int src_indices_len;          // entries in src_block_tables (an indptr past it is a bad row)
  // A split count chosen on the GPU by a kernel before this one in the stream (find_shared's
  // time-model cut of a chunk decode): null, or [1] read after the PDL wait; > 0 replaces the
  // candidates with that one count.
  const int* split_pin;
};

__device__ __forceinline__ int ceil_div(int a, int b) { return (a + b - 1) / b; }

extern "C" __global__ void __launch_bounds__(PKV_PLAN_THREADS, 1)
    pkv_plan_workqueue(const __grid_constant__ PlanParams p) {
  __shared__ int tiles_of[PKV_PLAN_THREADS];
  __shared__ int offs[PKV_PLAN_THREADS + 1];  // first task slot of each rank (task order)
  __shared__ int splits_of[PKV_PLAN_THREADS], key_of[PKV_PLAN_THREADS], rank_row[PKV_PLAN_THREADS];
  __shared__ int len_of[PKV_PLAN_THREADS];  // valid lengths (0: idle or bad)
  __shared__ int warp_sums[32];
  __shared__ int warp_max[32];
  __shared__ long long warp_tiles[32];
  __shared__ int bad_rows;
  __shared__ long long total_tiles;
  __shared__ int longest;
  const int tid = threadIdx.x, lane = tid % 32, warp = tid / 32;
  __shared__ int cand_all[64];
  __shared__ int num_cand;
  if (tid < p.num_candidates) cand_all[tid] = p.candidates[tid];  // constant: read before the wait
  pkv::pdl_enter();
  if (tid == 0) {
    bad_rows = 0;
    const int pin = p.split_pin != nullptr ? *p.split_pin : 0;   // written before the wait
    cand_all[0] = pin > 0 ? pin : cand_all[0];
    num_cand = pin > 0 ? 1 : p.num_candidates;
  }
  __syncthreads();

  // 1. Tiles of every active row (0: idle or bad), their max L and sum W.
  const int rows = min(p.rows >= 0 ? p.rows : *p.num_rows, p.max_rows);
  const int max_len = p.max_seq > 0 ? p.max_seq : *p.max_seq_len;
  int len = 0;
  if (tid < rows) {
    if (p.src_indptr != nullptr) {  // CSR: the length from the row's pages and last page
      const int lo = p.src_indptr[tid], hi = p.src_indptr[tid + 1], last = p.src_last_page_len[tid];
      const long long pages = (long long)hi - lo;
      const bool bad = lo < 0 || pages < 0 || hi > p.src_indices_len || (pages > 0 && (last < 1 || last > (1 << p.page_size_log2)));
      const long long n = pages > 0 ? ((pages - 1) << p.page_size_log2) + last : 0;
      len = bad || n > max_len ? -1 : (int)n;
      p.seq_lens[tid] = len;
    } else {
      len = p.src_seq_lens != nullptr ? p.src_seq_lens[tid] : p.seq_lens[tid];
      if (p.src_seq_lens != nullptr) p.seq_lens[tid] = len;
    }
    if (len < 0 || len > max_len) {  // 0: an idle row (an engine's padding), no work, no flag
      atomicOr(&bad_rows, 1);
      len = 0;
    }
  }
  const int num_pages = p.block_tables != nullptr ? *p.num_pages : 0;
  if (num_pages > 0 || p.src_block_tables != nullptr) {
    // The block-table entries each active row's length uses: copied to block_tables in direct
    // mode, checked against num_pages. Groups of max(32, 1024 / (rows rounded up to a power of
    // two)) threads take rows g, g + groups, ...; a group's threads stride over the row's
    // entries (independent loads, so they pipeline). One warp per row cost 3 us at B1 32K;
    // groups below a warp measured slower than a warp per row at B64 32K (49.8 vs 33.7 us,
    // benches/plan_cost.py). A row with a bad id is flagged in splits_of.
    tiles_of[tid] = len;  // the valid length, for the groups
    splits_of[tid] = 0;
    __syncthreads();
    int group = PKV_PLAN_THREADS;
    while (group > 32 && group * rows > PKV_PLAN_THREADS) group >>= 1;
    const int groups = PKV_PLAN_THREADS / group, g = tid / group, gl = tid % group;
    const int* src = p.src_block_tables != nullptr ? p.src_block_tables : p.block_tables;
    const int src_stride = p.src_block_tables != nullptr ? p.src_bt_stride : p.bt_stride;
    for (int r = g; r < rows; r += groups) {
      const int n = (tiles_of[r] + (1 << p.page_size_log2) - 1) >> p.page_size_log2;
      const int first = tiles_of[r] > 0 ? pkv::window_start(tiles_of[r], p.window_left) >> p.page_size_log2 : 0;
      const int* row = src + (p.src_indptr != nullptr ? (long long)p.src_indptr[r] : (long long)r * src_stride);
      int* dst = p.block_tables + (long long)r * p.bt_stride;
      // Batches of 8 independent loads before their checks (and direct mode's stores): the
      // group's stride is a runtime value, so the compiler did not unroll a plain strided loop
      // and each entry waited for its load (~14 us more than a warp per row with a constant
      // stride at >= 32 rows; benches/NOTES.md, the planning kernel).
      constexpr int kBatch = 8;
      const bool copy = p.src_block_tables != nullptr;
      bool bad = false;
      int j = first + gl;
      for (; j + (kBatch - 1) * group < n; j += kBatch * group) {
        int v[kBatch];
#pragma unroll
        for (int u = 0; u < kBatch; ++u) v[u] = row[j + u * group];
#pragma unroll
        for (int u = 0; u < kBatch; ++u) {
          if (copy) dst[j + u * group] = v[u];
          bad |= v[u] < 0 || v[u] >= num_pages;
        }
      }
      for (; j < n; j += group) {
        const int page = row[j];
        if (copy) dst[j] = page;
        bad |= page < 0 || page >= num_pages;
      }
      if (bad && num_pages > 0) splits_of[r] = 1;
    }
    __syncthreads();
    if (tid < rows && splits_of[tid]) {
      len = 0;
      atomicOr(&bad_rows, 2);
    }
  }
  const int t = len > 0 ? ceil_div(len - pkv::window_start(len, p.window_left), p.tile_tokens) : 0;
  tiles_of[tid] = t;
  len_of[tid] = len;
  int mx = t;
  long long sum = t;
#pragma unroll
  for (int o = 16; o > 0; o >>= 1) {
    mx = max(mx, __shfl_xor_sync(0xffffffffu, mx, o));
    sum += __shfl_xor_sync(0xffffffffu, sum, o);
  }
  if (lane == 0) {
    warp_max[warp] = mx;
    warp_tiles[warp] = sum;
  }
  __syncthreads();
  if (tid == 0) {
    int m = 0;
    long long w = 0;
    for (int i = 0; i < PKV_PLAN_THREADS / 32; ++i) {
      m = max(m, warp_max[i]);
      w += warp_tiles[i];
    }
    longest = m;
    total_tiles = w;
  }
  __syncthreads();

  // 2. The cut (plan_cut.cuh).
  const pkv::CutModel model{cand_all, num_cand, p.min_split_tiles, p.sms, p.resident,
                            p.slowdown8, p.overhead8, p.max_ctas, p.free_slots, p.room_slots,
                            p.room8, p.room_chunk};
  const int chunk = pkv::choose_cut<PKV_PLAN_THREADS>(tiles_of, rows, longest, total_tiles,
                                                      p.num_kv_heads, model).chunk;
  const int s = t > 0 ? ceil_div(t, chunk) : 0;

  // 3. Slots in row order (split_offsets), then the rows' rank in task order and the first
  //    task slot of each rank.
  int total_slots;
  const int excl = pkv::block_exclusive_scan(s, warp_sums, &total_slots);
  splits_of[tid] = s;
  key_of[tid] = s > 0 ? (len - pkv::window_start(len, p.window_left)) / s : -1;  // tokens per
                                       // split of the attended range; rows with no work last
  __syncthreads();
  if (tid < rows) {
    const int k = key_of[tid];
    int rank = 0;
    for (int i = 0; i < rows; ++i) {
      const int ki = key_of[i];
      rank += ki > k || (ki == k && i < tid);
    }
    rank_row[rank] = tid;
  }
  __syncthreads();
  const int ranked_splits = tid < rows ? splits_of[rank_row[tid]] : 0;
  int unused;
  const int task_excl = pkv::block_exclusive_scan(ranked_splits, warp_sums, &unused);
  offs[tid] = task_excl;  // first slot of rank tid in task order
  if (tid == PKV_PLAN_THREADS - 1) offs[PKV_PLAN_THREADS] = total_slots;
  __syncthreads();
  if (tid < p.max_rows) {
    p.split_offsets[tid] = excl;
    p.num_splits[tid] = s;
  }
  if (tid == 0) {
    p.split_offsets[p.max_rows] = total_slots;
    const int want_tasks = total_slots * p.num_kv_heads;
    *p.num_tasks = min(want_tasks, p.task_capacity);
    *p.status = (want_tasks > p.task_capacity ? 1 : 0) | (bad_rows & 1 ? 2 : 0) | (bad_rows & 2 ? 4 : 0);
  }
  // 4. Tasks: task slot j belongs to the rank i with offs[i] <= j < offs[i+1] (binary search),
  //    i.e. to row rank_row[i]; its split is j - offs[i] (the row's slot is split_offsets + split).
  for (int j = tid; j < total_slots; j += PKV_PLAN_THREADS) {
    int lo = 0, hi = rows - 1;
    while (lo < hi) {
      const int mid = (lo + hi + 1) / 2;
      if (offs[mid] <= j) lo = mid; else hi = mid - 1;
    }
    const int r = rank_row[lo], split = j - offs[lo], S = splits_of[r];
    const int len = len_of[r];
    const int start = pkv::window_start(len, p.window_left);
    const int tiles = tiles_of[r];
    const int b = start + (int)((long long)split * tiles / S) * p.tile_tokens;
    const int e = min(len, start + (int)((long long)(split + 1) * tiles / S) * p.tile_tokens);
    for (int h = 0; h < p.num_kv_heads; ++h) {
      const int tk = j * p.num_kv_heads + h;
      if (tk < p.task_capacity) {
        int* dst = p.tasks + 5 * tk;
        dst[0] = r; dst[1] = h; dst[2] = split; dst[3] = b; dst[4] = e;
      }
    }
  }
}
