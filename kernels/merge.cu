// merge.cu — segmented exact merge of split states.
//
// For every row r and query head h: the slots [split_offsets[r], split_offsets[r+1]) hold
// partial states (m_s, l_s, a_s) in the log2 domain; O = sum_s 2^(m_s-m) a_s / sum_s 2^(m_s-m) l_s
// with m = max_s m_s. Empty splits carry (m=-inf, l=0, a=0) and weigh exactly 0.
//
// Grid:  blockIdx.x = block of 4 query heads (one warp per head), blockIdx.y = merge row r. Output row = row_ids[r] (or r when row_ids is null);
//        -1 exits (idle graph slot); rows with no slots exit; with skip_single, rows with one
//        slot exit too (the decode kernel already wrote O for them).
// Block: 128 threads; warp w merges head 4*blockIdx.x + w (decode_common.cuh, merge_head:
//        few dependent L2 round trips, the merge is latency-bound); no shared memory.
// Layout: part_a [slots, H_q, D] f32, part_ml [slots, H_q, 2] f32, out [B, H_q, D] (T);
//        sinks [H_q] f32 or null (attention-sink logits, joining each head's denominator);
//        lse [B, H_q] f32 or null (each output row's and head's log2-sum-exp, written).
//        The states of e4m3 K/V are already dequantized (the decode applied v_scale to a), so
//        one merge serves every K/V dtype.
// Bytes: reads (D + 2) * 4 bytes per slot and head, writes D * 2 bytes per row and head.
// PDL: with early_trigger the CTA lets the next kernel's CTAs become resident before its own wait
//        (they wait for this whole grid at theirs), so a workqueue step's next decode issues its
//        early K/V copies while this layer's decode still runs instead of after it: bucketed B1
//        1.110 -> 1.149-1.164x FlashInfer in the engine protocol (2026-12-01, benches/NOTES.md).
// Trace (optional): CTA entry, PDL wait returned, and the last of its warps' ends.
#include "decode_common.cuh"

struct MergeParams {
  const float* part_a;
  const float* part_ml;
  const int* split_offsets;  // [rows + 1]
  const int* row_ids;        // [rows] or null
  void* out;                 // [B, H_q, D]
  int num_qo_heads;
  int skip_single;
  unsigned long long* trace;  // null, or [grid, kTraceMarks] %globaltimer marks (pkv::trace_mark)
  int early_trigger;          // 1: launch_dependents before the PDL wait (above)
  const float* sinks;         // null, or [H_q]
  float* lse;                 // null, or [B, H_q]
};

template <typename T, int D>
__device__ __forceinline__ void merge_states(const MergeParams& p) {
  pkv::trace_mark(p.trace, pkv::kEnter);
  if (p.early_trigger) pkv::pdl_trigger();
  pkv::pdl_enter();
  pkv::trace_mark(p.trace, pkv::kWaited);
  constexpr int HPC = pkv::kThreads / 32;  // heads per CTA, one warp each
  const int r = blockIdx.y;
  const int out_row = p.row_ids ? p.row_ids[r] : r;
  if (out_row < 0) return;
  const int b = p.split_offsets[r], e = p.split_offsets[r + 1];
  if (e - b <= 0 || (p.skip_single && e - b == 1)) return;
  const int h = blockIdx.x * HPC + threadIdx.x / 32;
  if (h >= p.num_qo_heads) return;
  T* o = static_cast<T*>(p.out) + ((long long)out_row * p.num_qo_heads + h) * D;
  pkv::merge_head<T, D>(p.part_a, p.part_ml, p.num_qo_heads, b, e - b, 1, h, o, threadIdx.x % 32,
                        pkv::sink_log2_of(p.sinks, h), pkv::lse_at(p.lse, p.num_qo_heads, out_row, h));
  pkv::trace_warp_done(p.trace);
}


// ---------------------------------------------------------------------------------------------
// merge_segments — the exact merge of a row's segment states, read where two decodes wrote them
// (pkvrt/runtime/shared.py: rows that share pages).
//
// Sources: "a", the chunk states: out_a [Va, H_kv * C * G, D] (T), lse_a [Va, H_kv * C * G] f32,
//          chunk v's row c holding query head h = hk * G + j at head hk * C * G + c * G + j;
//          "b", the own states: out_b [Sb, H_q, D] (T), lse_b [Sb, H_q] f32.
// slots [B, K] int64: per output row its states: s < Va * C: chunk s / C, row s % C; s < Va * C
//          + Sb: own state s - Va * C; otherwise none (padding).
// For row r and head h: m = max_k lse_k; O = sum_k 2^(lse_k - m) o_k / (sum_k 2^(lse_k - m) +
//          2^(sink * log2 e - m)); lse_out = m + log2(sum_k 2^(lse_k - m)) (the sink not counted).
// Grid:  blockIdx.x = block of 4 query heads (a warp each), blockIdx.y = row. Block: 128 threads.
// A clear first version: scalar loads of the D / 32 elements of each lane, K states in a loop.
struct SegmentParams {
  const void* out_a;
  const float* lse_a;
  const void* out_b;
  const float* lse_b;
  const long long* slots;  // [B, K]
  void* out;               // [B, H_q, D]
  const float* sinks;      // null, or [H_q]
  float* lse;              // null, or [B, H_q]
  int num_qo_heads;
  int group;               // G
  int chunk_rows;          // C
  int slots_a;             // Va * C
  int slots_b;             // Sb
  int k;                   // states per row (slots' columns)
};

__device__ __forceinline__ float seg_to_float(__half x) { return __half2float(x); }
__device__ __forceinline__ float seg_to_float(__nv_bfloat16 x) { return __bfloat162float(x); }
__device__ __forceinline__ void seg_from_float(float x, __half* d) { *d = __float2half_rn(x); }
__device__ __forceinline__ void seg_from_float(float x, __nv_bfloat16* d) { *d = __float2bfloat16_rn(x); }

template <typename T, int D>
__device__ __forceinline__ void merge_segments(const SegmentParams& p) {
  pkv::pdl_enter();
  constexpr int E = D / 32;
  const int r = blockIdx.y;
  const int h = blockIdx.x * (pkv::kThreads / 32) + threadIdx.x / 32;
  const int lane = threadIdx.x % 32;
  if (h >= p.num_qo_heads) return;
  const int g = p.group, c_rows = p.chunk_rows;
  const int hk = h / g, j = h % g;
  const int heads_a = (p.num_qo_heads / g) * c_rows * g;
  // where state k of this row and head is: (values, lse), or null
  auto state = [&](int k, const T** o, float* l) {
    const long long s = p.slots[(long long)r * p.k + k];
    if (s < 0) {   // not a state, as slots_a + slots_b and above ("none", what the host writes)
      *o = nullptr;
      *l = -INFINITY;
    } else if (s < p.slots_a) {
      const long long v = s / c_rows, c = s % c_rows;
      const long long head = (long long)hk * c_rows * g + c * g + j;
      *o = static_cast<const T*>(p.out_a) + (v * heads_a + head) * D;
      *l = p.lse_a[v * heads_a + head];
    } else if (s < (long long)p.slots_a + p.slots_b) {
      const long long o_row = s - p.slots_a;
      *o = static_cast<const T*>(p.out_b) + (o_row * p.num_qo_heads + h) * D;
      *l = p.lse_b[o_row * p.num_qo_heads + h];
    } else {
      *o = nullptr;
      *l = -INFINITY;
    }
  };
  float m = -INFINITY;
  for (int k = 0; k < p.k; ++k) {
    const T* o;
    float l;
    state(k, &o, &l);
    m = fmaxf(m, l);
  }
  float den = 0.f, acc[E];
#pragma unroll
  for (int e = 0; e < E; ++e) acc[e] = 0.f;
  for (int k = 0; k < p.k; ++k) {
    const T* o;
    float l;
    state(k, &o, &l);
    if (o == nullptr || l == -INFINITY) continue;
    const float w = exp2f(l - m);
    den += w;
#pragma unroll
    for (int e = 0; e < E; ++e) acc[e] = fmaf(w, seg_to_float(o[lane * E + e]), acc[e]);
  }
  const float sum = den;
  if (p.sinks != nullptr) den += exp2f(p.sinks[h] * 1.4426950408889634f - m);
  const float inv = den > 0.f ? 1.f / den : 0.f;
  T* dst = static_cast<T*>(p.out) + ((long long)r * p.num_qo_heads + h) * D + lane * E;
#pragma unroll
  for (int e = 0; e < E; ++e) seg_from_float(acc[e] * inv, dst + e);
  if (p.lse != nullptr && lane == 0) p.lse[(long long)r * p.num_qo_heads + h] = m + log2f(sum);
}

// Both kernels of this file for one dtype and head dim (_buildspec.symbols("merge")).
#define PKV_MERGE_ENTRIES(TN, T, D)                                                      \
  extern "C" __global__ void __launch_bounds__(pkv::kThreads)                            \
      pkv_merge_##TN##_d##D(const __grid_constant__ MergeParams p) {                     \
    merge_states<T, D>(p);                                                               \
  }                                                                                      \
  extern "C" __global__ void __launch_bounds__(pkv::kThreads)                            \
      pkv_merge_segments_##TN##_d##D(const __grid_constant__ SegmentParams p) {          \
    merge_segments<T, D>(p);                                                             \
  }
PKV_MERGE_ENTRIES(f16, __half, 64)
PKV_MERGE_ENTRIES(f16, __half, 96)
PKV_MERGE_ENTRIES(f16, __half, 128)
PKV_MERGE_ENTRIES(f16, __half, 256)
PKV_MERGE_ENTRIES(bf16, __nv_bfloat16, 64)
PKV_MERGE_ENTRIES(bf16, __nv_bfloat16, 96)
PKV_MERGE_ENTRIES(bf16, __nv_bfloat16, 128)
PKV_MERGE_ENTRIES(bf16, __nv_bfloat16, 256)
