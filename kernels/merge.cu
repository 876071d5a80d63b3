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
  pkv::merge_head<T, D>(p.part_a, p.part_ml, p.num_qo_heads, b, e, h, o, threadIdx.x % 32,
                        pkv::sink_log2_of(p.sinks, h), pkv::lse_at(p.lse, p.num_qo_heads, out_row, h));
  pkv::trace_warp_done(p.trace);
}

#define PKV_MERGE_ENTRY(TN, T, D)                                                        \
  extern "C" __global__ void __launch_bounds__(pkv::kThreads)                            \
      pkv_merge_##TN##_d##D(const __grid_constant__ MergeParams p) {                     \
    merge_states<T, D>(p);                                                               \
  }
PKV_MERGE_ENTRY(f16, __half, 64)
PKV_MERGE_ENTRY(f16, __half, 96)
PKV_MERGE_ENTRY(f16, __half, 128)
PKV_MERGE_ENTRY(f16, __half, 256)
PKV_MERGE_ENTRY(bf16, __nv_bfloat16, 64)
PKV_MERGE_ENTRY(bf16, __nv_bfloat16, 96)
PKV_MERGE_ENTRY(bf16, __nv_bfloat16, 128)
PKV_MERGE_ENTRY(bf16, __nv_bfloat16, 256)
