// decode_common.cuh — shared pieces of the PersistentKV decode kernels.
//
// What it computes: for one (row, KV head, token range [tok_begin, tok_end)), the exact
// online-softmax state of the G query heads that share that KV head:
//     s_j = q_h . k_j;  x_j = sm_scale * s_j, or with a soft cap c: c * tanh(sm_scale * s_j / c)
//     (the scores taken to the log2 domain: * log2(e))
//     m   = max_j x_j,  l = sum_j 2^(x_j - m),  a = sum_j 2^(x_j - m) v_j   (FP32)
// and either writes O = a / l (one split covers the whole row) or the partial state (m, l, a)
// to a slot that the merge kernel (merge.cu) or the fused kernel combines exactly. Where O is
// written, an attention sink (one logit per query head, natural log) joins the denominator:
// O = a * 2^(m - m') / (l * 2^(m - m') + 2^(sink*log2(e) - m')), m' = max(m, sink*log2(e)); and
// the row's log2-sum-exp of its scores, m + log2(l) (the sink not counted), is written on request.
//
// Layouts (elements, not bytes):
//   q            [B, H_q, D]                      contiguous, T = fp16 or bf16
//   k/v cache    indexed [page, KV head, token in page, D]: element (p, h, t, d) at
//                p * page_stride + h * head_stride + t * tok_stride + d. HND caches
//                ([pages, H_kv, page, D]: tok_stride = D), NHD caches ([pages, page, H_kv, D]:
//                head_stride = D, tok_stride = H_kv * D) and K, V as strided views of one
//                tensor are all this; rows of D elements contiguous and 16-byte aligned.
//                KV = T, or e4m3 (1 byte, FP8 caches)
//   k/v_scale    [1] or [H_kv]  float32           e4m3 only: element value = e4m3 * scale[kvh]
//   block_tables [B, bt_stride]                   int32 logical page -> physical page
//   seq_lens     [B]                              int32, >= 1
//   sinks        [H_q] float32 or null            attention-sink logits (natural log domain)
//   out          [B, H_q, D]                      contiguous, dtype of q
//   lse          [B, H_q] float32 or null         log2-sum-exp of each row's and head's scores
//   part_a       [slots, H_q, D]  float32         un-normalised accumulator a
//   part_ml      [slots, H_q, 2]  float32         (m, l)
//
// Group capacity GC (a template parameter, 4, 8, 16 or 64): the kernel serves every group size
// G = H_q / H_kv <= GC (G itself is a run-time value, DecodeParams::group). The G heads of a KV
// head are the rows of an m16n8k16 A operand: rows 0..7 when GC <= 8 (rows 8..15 zero), all 16
// when GC = 16, so an instruction costs the same for every G of a class. GC 4 and 8 run the
// same body and differ in the fused tail's merge (workqueue_task.cuh). GC 64 (G 17..64) runs
// the wide body, whose warps split the heads, 16 each, over K/V stages they share (below).
//
// CTA shape: PKV_THREADS = 128 threads, 4 warps; each warp streams its own 16-token tiles
// through tc_stages<D>() private stages (D=128: 3, 96 KB per CTA) and computes S = Q K^T and
// O += P V with mma.sync m16n8k16 (details above decode_range_tc); the warps combine their
// states once at the end through shared memory (finish_groups). The wide body (GC 64,
// decode_range_wide) keeps the same bytes in CTA-wide stages that every warp reads.
//
// Head dims 64, 128, 256 keep 16-byte chunks XOR-swizzled in shared memory; D = 96 (a row of
// 12 chunks, which the swizzle would send past the row) pads each shared-memory row by one chunk
// instead (a row stride of 13 chunks, odd, so ldmatrix's 8 row reads land in 8 bank groups).
//
// FP8 (e4m3) K/V: the same pipeline over 1-byte elements. The shared-memory budget per CTA is
// the fp16 one, so the stage count doubles (same bytes in flight, same occupancy, so the
// partition constants calibrated on fp16 still describe the grid). Values are dequantized in
// registers after the shared-memory load (e4m3 is exact in fp16 and bf16; cvt.rn.f16x2.e4m3x2
// on sm_89+, an exact bit-shift emulation on sm_80/86). The scales are read from device memory
// after the PDL wait (a replayed graph sees new values): k_scale joins the softmax scale of the
// CTA's KV head, v_scale multiplies the state's accumulator once in finish_groups, so partial
// states hold dequantized values and the merges are unchanged. e4m3 serves D 64, 128, 256.
//
// Bytes moved per (row, KV head): 2 * seq_len * D * sizeof(KV) of K and V, each byte once, plus
// 4 bytes of block table per page and G*D*sizeof(T) of Q (and 8 bytes of scales for e4m3).
#pragma once

#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <cuda_fp8.h>
#include <stdint.h>

#ifndef PKV_TILE_TOKENS
#define PKV_TILE_TOKENS 32
#endif
#ifndef PKV_THREADS
#define PKV_THREADS 128
#endif
#ifndef PKV_TC_STAGES
#define PKV_TC_STAGES 3
#endif
#ifndef PKV_TC_STAGES_D256
#define PKV_TC_STAGES_D256 2
#endif

namespace pkv {

constexpr int kTileTokens = PKV_TILE_TOKENS;  // the planners' split granularity (tokens)
constexpr int kThreads = PKV_THREADS;
constexpr int kVec = 8;  // elements per 16-byte access (fp16/bf16)

// The K/V element type of an instantiation: T itself, or e4m3 (1 byte).
using e4m3 = __nv_fp8_e4m3;
template <typename KV>
__host__ __device__ constexpr bool is_fp8() { return sizeof(KV) == 1; }

// Each of the 4 warps streams its own 16-token tiles through tc_stages<D>() private stages (K
// and V, 16 x D each): D=128: 3 * 4 * 8 KB = 96 KB per CTA. e4m3 tiles are half the bytes:
// twice the stages in the same 96 KB.
constexpr int kWarps = kThreads / 32;
constexpr int kTcTile = 16;
template <int D, typename KV = __half>
__host__ __device__ constexpr int tc_stages() {
  return (D >= 256 ? PKV_TC_STAGES_D256 : PKV_TC_STAGES) * (is_fp8<KV>() ? 2 : 1);
}

// Elements between token rows of a K or V tile in shared memory: D, or D + one 16-byte chunk
// where D / 8 is not a power of two (D = 96: no XOR swizzle, the padding spreads the banks).
template <int D, typename KV = __half>
__host__ __device__ constexpr bool swizzled() { return (D & (D - 1)) == 0; }
template <int D, typename KV = __half>
__host__ __device__ constexpr int tile_row() { return swizzled<D, KV>() ? D : D + kVec; }

// Dynamic shared memory of a decode CTA (pkvrt/launch/ops.py decode_smem_bytes mirrors it): the
// pipeline's stages, or the states at the end if larger: [kWarps][GC][D + 2] floats, or for the
// wide body (GC > 16) its token streams' [TS][G] <= GC states of D + 2 floats.
template <int D, int GC, typename KV = __half>
__host__ __device__ constexpr int smem_bytes() {
  constexpr int pipe = tc_stages<D, KV>() * kWarps * 2 * kTcTile * tile_row<D, KV>() * (int)sizeof(KV);
  constexpr int merge = (GC > 16 ? 1 : kWarps) * GC * (D + 2) * 4;   // wide body: [TS][G] <= GC states
  return pipe > merge ? pipe : merge;
}

// Everything a decode kernel reads, passed by value as one __grid_constant__ parameter.
// The Python side (pkvrt/launch/ops.py) mirrors this struct field by field; keep them in sync.
struct DecodeParams {
  const void* q;              // [B, H_q, D]
  const void* k_cache;        // [num_pages, H_kv, page_size, D] as indexed (layouts above)
  const void* v_cache;        // same indexing as k_cache
  void* out;                  // [B, H_q, D]
  float* part_a;              // [slots, H_q, D]
  float* part_ml;             // [slots, H_q, 2]
  const int* seq_lens;        // [B]
  const int* block_tables;    // [B, bt_stride]
  const int* row_ids;         // split decode: [rows] batch row of each grid row, -1 = idle slot
  const int* tasks;           // workqueue: [task_capacity, 5] (row, kvh, split, tok_begin, tok_end)
  const int* num_tasks;       // workqueue: device scalar, tasks beyond it exit at once
  const int* split_offsets;   // workqueue/fused: [B + 1] first slot of each row
  int* counters;              // fused: [B, H_kv] completion counters, zero between launches
  long long k_page_stride;    // elements between pages of k_cache
  long long k_head_stride;    // elements between KV heads of k_cache
  long long v_page_stride;
  long long v_head_stride;
  int num_qo_heads;
  int num_kv_heads;
  int page_size_log2;
  int bt_stride;              // elements between rows of block_tables
  int num_splits;             // split decode: splits per row (gridDim.x)
  float sm_scale_log2;        // softmax scale * log2(e)
  int early_kv;               // workqueue: 1 = copy the first K/V tiles before pdl_enter (below)
  unsigned long long* trace;  // workqueue: null, or [grid, kTraceMarks] %globaltimer marks (trace_mark)
  const float* k_scale;       // e4m3 K/V: [1] or [H_kv] dequantization scales (null otherwise)
  const float* v_scale;       // [1] or [H_kv]
  int k_scale_per_head;       // e4m3: 1 = k_scale indexed by KV head ([H_kv]), 0 = one scale ([1])
  int v_scale_per_head;       // same for v_scale
  int k_tok_stride;           // elements between token rows of one page and KV head of k_cache
  int v_tok_stride;           // (32-bit: page_size * stride < 2^31, checked by the host)
  int group;                  // G = H_q / H_kv, at most the instantiation's group capacity GC
  int window_left;            // split decode: -1, or a row attends to its last window_left + 1
                              // tokens (workqueue tasks carry their ranges from the planner)
  float softcap_scale;        // 0: no soft cap; else sm_scale / cap
  float softcap_log2;         // cap * log2(e)
  const float* sinks;         // null, or [H_q] attention-sink logits
  float* lse;                 // null, or [B, H_q]: each row's and head's log2-sum-exp
  int* group_counters;        // fused: null (one-level tail), or [slots, H_kv] counters of the
                              // two-level tail, zero between launches (workqueue_task.cuh)
  int merge_groups_from;      // with group_counters: 0, two levels where the kernel's rule says
                              // (two_level_tail); N >= 2, from N splits of a (row, kvh) (G 5-16
                              // at D 96-256, the classes that have the two-level tail)
};

// Block-wide exclusive scan of x (one value per thread) over a block of 1024 threads (32 warps:
// the planning kernels); *total gets the sum. Every thread of the block must call it.
// warp_sums: 32 ints of shared memory.
__device__ __forceinline__ int block_exclusive_scan(int x, int* warp_sums, int* total) {
  const int lane = threadIdx.x % 32, warp = threadIdx.x / 32;
  int v = x;
#pragma unroll
  for (int o = 1; o < 32; o *= 2) {
    const int y = __shfl_up_sync(0xffffffffu, v, o);
    if (lane >= o) v += y;
  }
  if (lane == 31) warp_sums[warp] = v;
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
  const int excl = v - x + (warp > 0 ? warp_sums[warp - 1] : 0);
  *total = warp_sums[31];
  __syncthreads();  // warp_sums may be reused by the next scan
  return excl;
}

// The first token a row of seq_len tokens attends to: a sliding window keeps the last
// window_left + 1 (FlashInfer's window_left), -1 keeps them all.
__device__ __forceinline__ int window_start(int seq_len, int window_left) {
  return window_left >= 0 && seq_len - 1 - window_left > 0 ? seq_len - 1 - window_left : 0;
}

// ---- element types -------------------------------------------------------------------------

__device__ __forceinline__ void to_float8(const uint4& raw, float (&f)[8], __half) {
  const __half2* h = reinterpret_cast<const __half2*>(&raw);
#pragma unroll
  for (int i = 0; i < 4; ++i) {
    float2 v = __half22float2(h[i]);
    f[2 * i] = v.x;
    f[2 * i + 1] = v.y;
  }
}
__device__ __forceinline__ void to_float8(const uint4& raw, float (&f)[8], __nv_bfloat16) {
  const __nv_bfloat162* h = reinterpret_cast<const __nv_bfloat162*>(&raw);
#pragma unroll
  for (int i = 0; i < 4; ++i) {
    float2 v = __bfloat1622float2(h[i]);
    f[2 * i] = v.x;
    f[2 * i + 1] = v.y;
  }
}
__device__ __forceinline__ uint4 from_float8(const float (&f)[8], __half) {
  uint4 raw;
  __half2* h = reinterpret_cast<__half2*>(&raw);
#pragma unroll
  for (int i = 0; i < 4; ++i) h[i] = __floats2half2_rn(f[2 * i], f[2 * i + 1]);
  return raw;
}
__device__ __forceinline__ uint4 from_float8(const float (&f)[8], __nv_bfloat16) {
  uint4 raw;
  __nv_bfloat162* h = reinterpret_cast<__nv_bfloat162*>(&raw);
#pragma unroll
  for (int i = 0; i < 4; ++i) h[i] = __floats2bfloat162_rn(f[2 * i], f[2 * i + 1]);
  return raw;
}

// Two e4m3 values (bits 0-7 and 8-15 of x, the lower one first in memory) as an f16x2 register
// (low half = bits 0-7), exactly: every e4m3 value is an fp16 value.
__device__ __forceinline__ unsigned e4m3x2_to_f16x2(unsigned x) {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 890
  unsigned r;
  asm("cvt.rn.f16x2.e4m3x2 %0, %1;" : "=r"(r) : "h"(static_cast<unsigned short>(x)));
  return r;
#else
  // sm_80/86 have no FP8 conversion. e4m3's exponent and mantissa bits moved to fp16's
  // positions (<< 7) read as value * 2^-8 for normal and subnormal values alike (fp16's bias is
  // 8 larger); * 256 in fp16 is exact. 0x7F (NaN) would become 480: made fp16 NaN.
  const unsigned bits = ((x & 0x7Fu) << 7) | ((x & 0x80u) << 8) | ((x & 0x7F00u) << 15) |
                        ((x & 0x8000u) << 16);
  __half2 h = __hmul2(*reinterpret_cast<const __half2*>(&bits), __float2half2_rn(256.f));
  unsigned r = *reinterpret_cast<unsigned*>(&h);
  if ((x & 0x7Fu) == 0x7Fu) r = (r & 0xFFFF0000u) | 0x7FFFu;
  if ((x & 0x7F00u) == 0x7F00u) r = (r & 0xFFFFu) | 0x7FFF0000u;
  return r;
#endif
}

// The same pair as the mma operand type of q: f16x2, or bf16x2 (exact: e4m3 has 4 significant
// bits and exponents >= -9) through float.
__device__ __forceinline__ unsigned e4m3x2_to(unsigned x, __half) { return e4m3x2_to_f16x2(x); }
__device__ __forceinline__ unsigned e4m3x2_to(unsigned x, __nv_bfloat16) {
  const unsigned h = e4m3x2_to_f16x2(x);
  const float2 f = __half22float2(*reinterpret_cast<const __half2*>(&h));
  const __nv_bfloat162 b = __floats2bfloat162_rn(f.x, f.y);
  return *reinterpret_cast<const unsigned*>(&b);
}

// The dequantization scales of KV head kvh (e4m3 instantiations only).
__device__ __forceinline__ float kv_scale(const float* s, int per_head, int kvh) {
  return s[per_head ? kvh : 0];
}

// 2^x with the hardware approximation (rel. error ~2^-22); 2^-inf = 0.
__device__ __forceinline__ float fast_exp2(float x) {
  float y;
  asm("ex2.approx.ftz.f32 %0, %1;" : "=f"(y) : "f"(x));
  return y;
}

// Weight of a state with max m_s inside a combined max m: 2^(m_s - m), and 0 for an empty
// state (m_s = -inf), also when m itself is -inf (all empty) — never NaN.
__device__ __forceinline__ float rescale(float m_s, float m) {
  return m_s == -INFINITY ? 0.f : fast_exp2(m_s - m);
}

// ---- programmatic dependent launch (sm_90+) ------------------------------------------------
//
// The host launches every pkvrt kernel with the programmatic-stream-serialization attribute on
// sm_90+ (pkvrt/launch/_driver.py; PKVRT_PDL=0 turns it off): such a kernel may be scheduled while the
// previous kernel of its stream is still draining. So every kernel entry calls pdl_enter()
// before its first global-memory access: griddepcontrol.wait returns once the previous grid has
// completed and its writes are visible (at once when launched without the attribute), then
// launch_dependents lets the next kernel's CTAs get resident and wait in turn. What it hides
// is the launch latency between decode and merge (and between layers' kernels in a graph).
__device__ __forceinline__ void pdl_enter() {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
  asm volatile("griddepcontrol.wait;\n" ::: "memory");
  asm volatile("griddepcontrol.launch_dependents;\n" ::: "memory");
#endif
}

// launch_dependents alone: the next kernel's CTAs may become resident now (they still wait for
// this whole grid at their griddepcontrol.wait).
__device__ __forceinline__ void pdl_trigger() {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
  asm volatile("griddepcontrol.launch_dependents;\n" ::: "memory");
#endif
}

// ---- timeline marks (benches/layer_timeline.py) -------------------------------------------
//
// With a non-null trace buffer [grid, kTraceMarks] (uint64), thread 0 of a working CTA writes
// %globaltimer (ns) at its entry (0), when its PDL wait returned (1), at its end (2) and, in the
// workqueue task, when its decode was done, before the arrival and the tail merge (3). Null
// costs one predicated branch per mark.
enum TraceMark { kEnter = 0, kWaited = 1, kDone = 2, kDecoded = 3 };
constexpr int kTraceMarks = 4;
__device__ __forceinline__ void trace_mark(unsigned long long* trace, int mark) {
  if (trace != nullptr && threadIdx.x == 0) {
    unsigned long long t;
    asm volatile("mov.u64 %0, %%globaltimer;" : "=l"(t));
    const unsigned cta = blockIdx.x + gridDim.x * (blockIdx.y + gridDim.y * blockIdx.z);
    trace[(unsigned long long)kTraceMarks * cta + mark] = t;
  }
}

// The kDone mark of a CTA whose warps finish independently (no barrier: some may have left):
// each warp's lane 0 raises it to its own end time (the buffer starts zeroed).
__device__ __forceinline__ void trace_warp_done(unsigned long long* trace) {
  if (trace != nullptr && threadIdx.x % 32 == 0) {
    unsigned long long t;
    asm volatile("mov.u64 %0, %%globaltimer;" : "=l"(t));
    const unsigned cta = blockIdx.x + gridDim.x * (blockIdx.y + gridDim.y * blockIdx.z);
    atomicMax(trace + (unsigned long long)kTraceMarks * cta + kDone, t);
  }
}

// ---- async copies --------------------------------------------------------------------------

__device__ __forceinline__ void cp_async16(void* smem, const void* gmem) {
  unsigned s = static_cast<unsigned>(__cvta_generic_to_shared(smem));
  asm volatile("cp.async.cg.shared.global [%0], [%1], 16;\n" ::"r"(s), "l"(gmem));
}
__device__ __forceinline__ void cp_async_commit() { asm volatile("cp.async.commit_group;\n" ::); }
template <int N>
__device__ __forceinline__ void cp_async_wait() {
  asm volatile("cp.async.wait_group %0;\n" ::"n"(N));
}

// ---- the decode body -----------------------------------------------------------------------

// Where a finished range goes: O directly (out_row >= 0) or a partial-state slot.
struct Sink {
  int out_row;  // batch row to write O into, or -1
  int slot;     // partial-state slot (used when out_row < 0)
};

// Writes the neutral state (m = -inf, l = 0, a = 0) of the G heads of `kvh` into `slot`.
// Used by splits that own no tokens; touches neither Q nor shared memory.
template <int D>
__device__ __forceinline__ void write_neutral(const DecodeParams& p, int kvh, int slot) {
  const int G = p.group, h0 = kvh * G;
  float* a = p.part_a + ((long long)slot * p.num_qo_heads + h0) * D;
  for (int i = threadIdx.x; i < G * D; i += kThreads) a[i] = 0.f;
  if (threadIdx.x < G) {
    float* ml = p.part_ml + ((long long)slot * p.num_qo_heads + h0 + threadIdx.x) * 2;
    ml[0] = -INFINITY;
    ml[1] = 0.f;
  }
}

// The normalisation of a finished state (m, l) of query head h: the factor that turns its
// accumulator a into O, with the head's attention sink in the denominator when p.sinks is set;
// and its log2-sum-exp m + log2(l) (the scores only), written to p.lse[out_row, h] on request
// by the caller. An empty state (l = 0) never reaches here: every row has >= 1 token.
__device__ __forceinline__ float out_factor(const DecodeParams& p, int h, float m, float l) {
  if (p.sinks == nullptr) return 1.f / l;
  const float sink = p.sinks[h] * 1.4426950408889634f;  // to the log2 domain
  const float m2 = fmaxf(m, sink);
  const float w = fast_exp2(m - m2);
  return w / (l * w + fast_exp2(sink - m2));
}

// Combines ng (<= NG) states staged in shared memory (sm_acc [ng][hstride][D], sm_ml
// [ng][hstride][2], written before a __syncthreads; hstride GC for the narrow body's per-warp
// states, G for the wide body's token streams) of the p.group heads into O (sink.out_row >= 0;
// with the sink and lse of out_factor) or one partial-state slot. Each thread finishes 8 consecutive
// outputs of one head. v_scale multiplies the accumulator (e4m3 V's dequantization scale; 1
// otherwise), so the slots hold dequantized states.
template <typename T, int D, int GC, int NG>
__device__ __forceinline__ void finish_groups(const DecodeParams& p, const float* sm_acc,
                                              const float* sm_ml, int h0, Sink sink,
                                              float v_scale, int ng = NG, int hstride = GC) {
  constexpr int LANES = D / kVec;
  const int G = p.group;
  for (int idx = threadIdx.x; idx < G * LANES; idx += kThreads) {
    const int g = idx / LANES;
    const int d0 = (idx % LANES) * kVec;
    float m_all = -INFINITY;
#pragma unroll 4
    for (int gi = 0; gi < ng; ++gi) m_all = fmaxf(m_all, sm_ml[(gi * hstride + g) * 2]);
    float l_all = 0.f, a[kVec];
#pragma unroll
    for (int e = 0; e < kVec; ++e) a[e] = 0.f;
#pragma unroll 4
    for (int gi = 0; gi < ng; ++gi) {
      const float w = rescale(sm_ml[(gi * hstride + g) * 2], m_all);
      l_all += w * sm_ml[(gi * hstride + g) * 2 + 1];
      const float* src = sm_acc + (gi * hstride + g) * D + d0;
#pragma unroll
      for (int e = 0; e < kVec; ++e) a[e] = fmaf(w, src[e], a[e]);
    }
    const int h = h0 + g;
    if (sink.out_row >= 0) {
      const float inv = v_scale * out_factor(p, h, m_all, l_all);
#pragma unroll
      for (int e = 0; e < kVec; ++e) a[e] *= inv;
      T* o = static_cast<T*>(p.out) + ((long long)sink.out_row * p.num_qo_heads + h) * D + d0;
      *reinterpret_cast<uint4*>(o) = from_float8(a, T());
      if (p.lse != nullptr && d0 == 0)
        p.lse[(long long)sink.out_row * p.num_qo_heads + h] = m_all + log2f(l_all);
    } else {
#pragma unroll
      for (int e = 0; e < kVec; ++e) a[e] *= v_scale;
      float* dst = p.part_a + ((long long)sink.slot * p.num_qo_heads + h) * D + d0;
      *reinterpret_cast<float4*>(dst) = make_float4(a[0], a[1], a[2], a[3]);
      *reinterpret_cast<float4*>(dst + 4) = make_float4(a[4], a[5], a[6], a[7]);
      if (d0 == 0) {
        float* ml = p.part_ml + ((long long)sink.slot * p.num_qo_heads + h) * 2;
        ml[0] = m_all;
        ml[1] = l_all;
      }
    }
  }
}

// ---- tensor-core body ----------------------------------------------------------------------
//
// Warp w owns 16-token tiles w, w+4, w+8, ... of the range and keeps its own (m, l, O) for
// the G heads; S = Q K^T and O += P V are mma.sync.m16n8k16 with the G heads as rows 0..G-1
// of the 16-row A operand (GC <= 8: rows 8..15 are zero and left out of the instruction's
// inputs; GC = 16: rows 8..15 are heads 8..15, a second online-softmax state per thread). Per
// tile and warp: D/16 ldmatrix.x4 of K, D/8 mma for S, one online-softmax update (quad
// shuffles), D/16 ldmatrix.x4.trans of V and D/8 mma for O. Shared-memory rows are XOR-swizzled
// in 16-byte chunks (chunk ^ (token & 7); D = 96: padded rows instead, tile_row) so ldmatrix's
// 8 row reads hit 8 different bank groups. Tokens past tok_end are zero-filled by cp.async
// (never read from the cache) and masked to -inf before the softmax.

#ifndef PKV_L2_PREFETCH
#define PKV_L2_PREFETCH 0
#endif
__device__ __forceinline__ void cp_async16_zfill(void* smem, const void* gmem, bool valid) {
  unsigned s = static_cast<unsigned>(__cvta_generic_to_shared(smem));
#if PKV_L2_PREFETCH == 128
  asm volatile("cp.async.cg.shared.global.L2::128B [%0], [%1], 16, %2;\n" ::"r"(s), "l"(gmem),
               "r"(valid ? 16 : 0));
#elif PKV_L2_PREFETCH == 256
  asm volatile("cp.async.cg.shared.global.L2::256B [%0], [%1], 16, %2;\n" ::"r"(s), "l"(gmem),
               "r"(valid ? 16 : 0));
#else
  asm volatile("cp.async.cg.shared.global [%0], [%1], 16, %2;\n" ::"r"(s), "l"(gmem),
               "r"(valid ? 16 : 0));
#endif
}

__device__ __forceinline__ void ldmatrix_x4(unsigned (&r)[4], const void* smem) {
  unsigned s = static_cast<unsigned>(__cvta_generic_to_shared(smem));
  asm volatile("ldmatrix.sync.aligned.m8n8.x4.shared.b16 {%0,%1,%2,%3}, [%4];\n"
               : "=r"(r[0]), "=r"(r[1]), "=r"(r[2]), "=r"(r[3]) : "r"(s));
}
__device__ __forceinline__ void ldmatrix_x4_trans(unsigned (&r)[4], const void* smem) {
  unsigned s = static_cast<unsigned>(__cvta_generic_to_shared(smem));
  asm volatile("ldmatrix.sync.aligned.m8n8.x4.trans.shared.b16 {%0,%1,%2,%3}, [%4];\n"
               : "=r"(r[0]), "=r"(r[1]), "=r"(r[2]), "=r"(r[3]) : "r"(s));
}

// d[0..3] += A(16x16, rows 8..15 zero: a1 = a3 = 0) * B(16x8).
__device__ __forceinline__ void mma16816(float (&d)[4], unsigned a0, unsigned a2, unsigned b0,
                                         unsigned b1, __half) {
  asm volatile("mma.sync.aligned.m16n8k16.row.col.f32.f16.f16.f32 {%0,%1,%2,%3}, {%4,%5,%6,%7}, "
               "{%8,%9}, {%0,%1,%2,%3};\n"
               : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3])
               : "r"(a0), "r"(0u), "r"(a2), "r"(0u), "r"(b0), "r"(b1));
}
__device__ __forceinline__ void mma16816(float (&d)[4], unsigned a0, unsigned a2, unsigned b0,
                                         unsigned b1, __nv_bfloat16) {
  asm volatile("mma.sync.aligned.m16n8k16.row.col.f32.bf16.bf16.f32 {%0,%1,%2,%3}, {%4,%5,%6,%7}, "
               "{%8,%9}, {%0,%1,%2,%3};\n"
               : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3])
               : "r"(a0), "r"(0u), "r"(a2), "r"(0u), "r"(b0), "r"(b1));
}
// d[0..3] += A(16x16) * B(16x8) with all four A registers: a0 (row grp, k 2tig..), a1 (row grp
// + 8, k 2tig..), a2 (row grp, k 2tig + 8..), a3 (row grp + 8, k 2tig + 8..).
__device__ __forceinline__ void mma16816_a4(float (&d)[4], unsigned a0, unsigned a1, unsigned a2,
                                            unsigned a3, unsigned b0, unsigned b1, __half) {
  asm volatile("mma.sync.aligned.m16n8k16.row.col.f32.f16.f16.f32 {%0,%1,%2,%3}, {%4,%5,%6,%7}, "
               "{%8,%9}, {%0,%1,%2,%3};\n"
               : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3])
               : "r"(a0), "r"(a1), "r"(a2), "r"(a3), "r"(b0), "r"(b1));
}
__device__ __forceinline__ void mma16816_a4(float (&d)[4], unsigned a0, unsigned a1, unsigned a2,
                                            unsigned a3, unsigned b0, unsigned b1, __nv_bfloat16) {
  asm volatile("mma.sync.aligned.m16n8k16.row.col.f32.bf16.bf16.f32 {%0,%1,%2,%3}, {%4,%5,%6,%7}, "
               "{%8,%9}, {%0,%1,%2,%3};\n"
               : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3])
               : "r"(a0), "r"(a1), "r"(a2), "r"(a3), "r"(b0), "r"(b1));
}
// The mma of a warp's R = 1 or 2 row halves: R = 1 leaves rows 8..15 out (zero).
template <int R, typename T>
__device__ __forceinline__ void mma_rows(float (&d)[4], unsigned a0, unsigned a1, unsigned a2,
                                         unsigned a3, unsigned b0, unsigned b1) {
  if constexpr (R == 1) mma16816(d, a0, a2, b0, b1, T());
  else mma16816_a4(d, a0, a1, a2, a3, b0, b1, T());
}
__device__ __forceinline__ unsigned pack2(float lo, float hi, __half) {
  __half2 h = __floats2half2_rn(lo, hi);
  return *reinterpret_cast<unsigned*>(&h);
}
__device__ __forceinline__ unsigned pack2(float lo, float hi, __nv_bfloat16) {
  __nv_bfloat162 h = __floats2bfloat162_rn(lo, hi);
  return *reinterpret_cast<unsigned*>(&h);
}

// ---- e4m3 K/V on the tensor-core body --------------------------------------------------------
//
// ldmatrix moves 16-bit elements, so e4m3 tiles are read with plain shared-memory loads and
// converted to fp16 (bf16 for S with bf16 q) in registers. An mma's k index may be mapped to
// any head-dim element (or token) as long as both operands use the same map, and its n index
// to any output element as long as the result is stored by the same map; both are chosen so
// that each thread loads whole 16-byte (D = 64: 8-byte for V) runs of one token row
// (grp = lane / 4, tig = lane % 4 as in the mma fragments):
//  * S = Q K^T: k-step 4*kb + s (kb < D/64, s < 4) gives thread tig the head-dim elements
//    d = 64*kb + 16*tig + 4*s + {0, 1} (fragment k = 2*tig, 2*tig + 1) and + {2, 3}
//    (k = 2*tig + 8, 2*tig + 9): bytes 4s..4s+3 of 16-byte chunk 4*kb + tig of the token row,
//    and the same elements of q (32 contiguous bytes per thread and kb). n = token as in fp16.
//  * O^T += V^T P^T, transposed so that the 8 head columns of the output are n and the 16 rows
//    are head-dim elements: no padding rows (D/16 mma per tile instead of D/8, and 4*D/16
//    accumulator registers instead of 4*D/8). B = P^T is P straight from the S accumulators
//    (b0 = P[head grp][tokens 2*tig, +1], b1 = tokens + 8, as fp16's A operand). A = V^T: row
//    r of m16 tile mt is head-dim element d(mt, r); thread grp reads, of token rows 2*tig,
//    2*tig + 1, 2*tig + 8, 2*tig + 9, the EB = 16 bytes at 16*grp of each BLK = 128-byte block
//    (D = 64: the 8 bytes at 8*grp of the 64-byte row): byte p of block c is
//    d(mt = EB/2*c + p/2, r = grp + 8*(p & 1)) = BLK*c + EB*grp + p, and byte_perm pairs byte
//    p of two token rows (the A fragment pairs tokens). Accumulator o[mt][c] holds
//    O[head 2*tig + (c & 1)][d(mt, grp + 8*(c >> 1))]; the online softmax's rescale of head h
//    comes from lane 4*h by shuffle.
// Per tile and warp (D = 128): 4 + 4 16-byte loads, 64 conversions, 16 byte_perm, 16 + 8 mma.
// Bank conflicts: 16-byte chunks are XOR-swizzled inside each 128-byte line of the tile by
// e4m3_line_xor<D>, chosen so that every 8 lanes of a 16-byte load (16 lanes of an 8-byte one)
// hit 8 different 16-byte bank groups for both patterns (K: token rows 2m, 2m+1 x 4 chunks
// each, V: rows c, c+2, c+4, c+6 x 2 chunks each); the copies write whole lines (conflict-free
// under any permutation inside a line). tests/test_e4m3_layout.py replays both patterns and the
// fragment maps on the CPU.
template <int D>
__device__ __forceinline__ int e4m3_line_xor(int line) {
  static_assert(D == 64 || D == 128 || D == 256, "e4m3 tiles: D in 64, 128, 256");
  if constexpr (D == 64) {  // a line is 2 token rows: K reads one line, V 4 consecutive ones
    return (line & 3) << 1;
  } else {                  // by token row: rows 2m, 2m+1 in opposite halves (bit 2) for K,
    const int r = D == 256 ? line >> 1 : line;   // rows c + 2t on 4 chunk pairs (bits 1-2) for V
    return (((r >> 1) & 3) << 1) ^ ((r & 1) << 2);
  }
}
// Shared-memory offset of byte a = token * D + d of an e4m3 K or V tile [16][D].
template <int D>
__device__ __forceinline__ int e4m3_swizzle(int a) {
  return (a & ~0x70) | ((((a >> 4) & 7) ^ e4m3_line_xor<D>(a >> 7)) << 4);
}
// Element offset of 16-byte chunk c of token row t of a K or V tile in shared memory.
template <typename KV, int D>
__device__ __forceinline__ int tile_chunk(int t, int c) {
  if constexpr (is_fp8<KV>()) return e4m3_swizzle<D>(t * D + c * 16);
  else if constexpr (swizzled<D, KV>()) return t * D + (c ^ (t & 7)) * kVec;
  else return t * tile_row<D, KV>() + c * kVec;
}

// A thread's e4m3 fragment offsets inside a K or V tile, computed once per CTA (keeping one
// offset per load instead ran the D = 256 kernels out of registers). The swizzle is the same for
// rows t and t + 8 and for every 128-byte block of a row, and logical chunks c and c ^ 4 of a
// line land on physical chunks p and p ^ 4 (one XOR per line), so each load is one of these
// plus a constant, or with bit 6 flipped. K: one offset (chunk 4*kb + tig of row grp + 8*nt is
// (k ^ 64*(kb & 1)) + 128*(kb / 2) + 8*D*nt); V: one (row 2*tig; row 2*tig + 1 is e4m3_v1).
// (The k-step order cannot follow the swizzle instead: an mma's k -> d map must be the same for
// every row and column of the warp, and the swizzle depends on the row.)
struct E4m3Frags {
  int k;      // K: row grp, chunk tig (block 0, k-step group 0)
  int v0;     // V: row 2*tig, block 0, the EB bytes of this thread (pv_e4m3)
};
// V: row 2*tig + 1, same bytes: the swizzle of rows 2m and 2m + 1 differs in bit 2 of the chunk.
template <int D>
__device__ __forceinline__ int e4m3_v1(const E4m3Frags& f) { return (f.v0 ^ 64) + (D >= 128 ? D : 0); }
template <int D>
__device__ __forceinline__ E4m3Frags e4m3_frags(int grp, int tig) {
  constexpr int EB = D < 128 ? D / 8 : 16;
  E4m3Frags f;
  f.k = e4m3_swizzle<D>(grp * D + 16 * tig);
  f.v0 = e4m3_swizzle<D>(2 * tig * D + EB * grp);
  return f;
}

// Q as A fragments in the e4m3 head-dim order above: qa[4*kb + s] holds
// d = 64*kb + 16*tig + 4*s + {0,1} / {2,3} of row grp (zero for rows >= G).
template <typename T, int D>
__device__ __forceinline__ void q_frags_e4m3(unsigned (&qa)[D / 16][2], const T* qh, bool head,
                                             int tig) {
#pragma unroll
  for (int kb = 0; kb < D / 64; ++kb) {
    uint4 x0 = make_uint4(0u, 0u, 0u, 0u), x1 = x0;
    if (head) {
      const T* src = qh + 64 * kb + 16 * tig;
      x0 = *reinterpret_cast<const uint4*>(src);      // d + 0 .. 7
      x1 = *reinterpret_cast<const uint4*>(src + 8);  // d + 8 .. 15
    }
    qa[4 * kb][0] = x0.x;     qa[4 * kb][1] = x0.y;      // s = 0: d + {0,1}, {2,3}
    qa[4 * kb + 1][0] = x0.z; qa[4 * kb + 1][1] = x0.w;  // s = 1: d + {4,5}, {6,7}
    qa[4 * kb + 2][0] = x1.x; qa[4 * kb + 2][1] = x1.y;
    qa[4 * kb + 3][0] = x1.z; qa[4 * kb + 3][1] = x1.w;
  }
}

// S = Q K^T over one e4m3 K tile: s[nt] covers tokens nt*8 .. nt*8+7 (thread: token grp + 8nt);
// qa the A fragments of rows 0..7, qb of rows 8..15 (read when R = 2).
template <typename T, int D, int R>
__device__ __forceinline__ void qk_e4m3(float (&s)[2][4], const unsigned (&qa)[D / 16][2],
                                        const unsigned (&qb)[D / 16][2], const unsigned char* ks,
                                        const E4m3Frags& f) {
#pragma unroll
  for (int kb = 0; kb < D / 64; ++kb) {
    unsigned w[2][4];
#pragma unroll
    for (int nt = 0; nt < 2; ++nt) {
      const uint4 v = *reinterpret_cast<const uint4*>(ks + (f.k ^ (64 * (kb & 1))) + 128 * (kb >> 1) +
                                                      8 * D * nt);
      w[nt][0] = v.x; w[nt][1] = v.y; w[nt][2] = v.z; w[nt][3] = v.w;
    }
#pragma unroll
    for (int st = 0; st < 4; ++st)
#pragma unroll
      for (int nt = 0; nt < 2; ++nt)
        mma_rows<R, T>(s[nt], qa[4 * kb + st][0], qb[4 * kb + st][0], qa[4 * kb + st][1],
                       qb[4 * kb + st][1], e4m3x2_to(w[nt][st] & 0xFFFFu, T()),
                       e4m3x2_to(w[nt][st] >> 16, T()));
  }
}

// m16n8k16 with all four A registers (rows 0..15): d += A(16x16) * B(16x8), fp16 in.
__device__ __forceinline__ void mma16816_full(float (&d)[4], unsigned a0, unsigned a1, unsigned a2,
                                              unsigned a3, unsigned b0, unsigned b1) {
  mma16816_a4(d, a0, a1, a2, a3, b0, b1, __half());
}

// O^T += V^T P^T over one e4m3 V tile (fp16 mma: P in [0, 1] and e4m3 V are exact in fp16).
// pb0[r], pb1[r]: P of head grp + 8r at tokens 2*tig, 2*tig + 1 and 2*tig + 8, 2*tig + 9
// (f16x2); o[r] the O^T of heads 8r .. 8r + 7. The V fragments are converted once for both.
template <int D, int R>
__device__ __forceinline__ void pv_e4m3(float (&o)[R][D / 16][4], const unsigned (&pb0)[R],
                                        const unsigned (&pb1)[R], const unsigned char* vs,
                                        const E4m3Frags& f) {
  constexpr int BLK = D < 128 ? D : 128;  // bytes of a row block
  constexpr int EB = BLK / 8;             // bytes per thread and block: 8 or 16
  constexpr int W = EB / 4;               // 32-bit words per load (8- or 16-byte loads)
#pragma unroll
  for (int c = 0; c < D / BLK; ++c) {
    unsigned w[4][W];                     // rows 2tig, 2tig+1, 2tig+8, 2tig+9
#pragma unroll
    for (int r = 0; r < 4; ++r) {
      const unsigned char* src = vs + (r & 1 ? e4m3_v1<D>(f) : f.v0) + 8 * D * (r >> 1) + BLK * c;
      if constexpr (W == 4) {
        const uint4 v = *reinterpret_cast<const uint4*>(src);
        w[r][0] = v.x; w[r][1] = v.y; w[r][2] = v.z; w[r][3] = v.w;
      } else {
        const uint2 v = *reinterpret_cast<const uint2*>(src);
        w[r][0] = v.x; w[r][1] = v.y;
      }
    }
#pragma unroll
    for (int i = 0; i < W; ++i) {
      // Bytes p = 4i .. 4i+3 of the run: m16 tiles mt = EB/2*c + 2i (p = 4i, 4i+1: rows grp,
      // grp + 8) and mt + 1 (p = 4i+2, 4i+3).
      const int mt = EB / 2 * c + 2 * i;
      const unsigned k01 = __byte_perm(w[0][i], w[1][i], 0x5140);  // tokens 2tig, 2tig+1: p, p+1
      const unsigned k23 = __byte_perm(w[0][i], w[1][i], 0x7362);  //                      p+2, p+3
      const unsigned h01 = __byte_perm(w[2][i], w[3][i], 0x5140);  // tokens 2tig+8, 2tig+9
      const unsigned h23 = __byte_perm(w[2][i], w[3][i], 0x7362);
      const unsigned a0 = e4m3x2_to_f16x2(k01 & 0xFFFFu), a1 = e4m3x2_to_f16x2(k01 >> 16);
      const unsigned a2 = e4m3x2_to_f16x2(h01 & 0xFFFFu), a3 = e4m3x2_to_f16x2(h01 >> 16);
      const unsigned c0 = e4m3x2_to_f16x2(k23 & 0xFFFFu), c1 = e4m3x2_to_f16x2(k23 >> 16);
      const unsigned c2 = e4m3x2_to_f16x2(h23 & 0xFFFFu), c3 = e4m3x2_to_f16x2(h23 >> 16);
#pragma unroll
      for (int r = 0; r < R; ++r) {
        mma16816_full(o[r][mt], a0, a1, a2, a3, pb0[r], pb1[r]);
        mma16816_full(o[r][mt + 1], c0, c1, c2, c3, pb0[r], pb1[r]);
      }
    }
  }
}

// Head-dim element of row r (0..15) of m16 tile mt of O^T (pv_e4m3's d(mt, r)).
template <int D>
__device__ __forceinline__ int e4m3_o_elem(int mt, int r) {
  constexpr int BLK = D < 128 ? D : 128, EB = BLK / 8;
  return BLK * (mt / (EB / 2)) + EB * (r & 7) + 2 * (mt % (EB / 2)) + (r >> 3);
}

// The online-softmax score of a raw product s = q . k in the log2 domain is s * scale; with a
// soft cap c it is c * tanh(s * sm_scale / c) * log2(e): cap_pre = sm_scale / c, cap_log2 =
// c * log2(e) (both scales include an e4m3 K scale). tanhf, not tanh.approx: the
// approximation's relative error of 2^-11 would move a capped logit of 50 by 0.02.
__device__ __forceinline__ float capped_log2(float s, float cap_pre, float cap_log2) {
  return cap_log2 * tanhf(s * cap_pre);
}

// The scores' scale for KV head kvh: the softmax scale in the log2 domain, the soft cap's
// pre-scale (capped: a soft cap is set); e4m3: the head's K scale joins both, read after the PDL
// wait like Q.
struct ScoreScale {
  float sm_scale, cap_pre;
  bool capped;
};
template <typename KV>
__device__ __forceinline__ ScoreScale score_scale(const DecodeParams& p, int kvh) {
  ScoreScale s{p.sm_scale_log2, p.softcap_scale, p.softcap_scale > 0.f};
  if constexpr (is_fp8<KV>()) {
    const float ks = kv_scale(p.k_scale, p.k_scale_per_head, kvh);
    s.sm_scale *= ks;
    s.cap_pre *= ks;
  }
  return s;
}

// Accumulator tiles of O per warp: D/8 n8 tiles (K/V of q's type), or D/16 m16 tiles of O^T
// (e4m3).
template <int D, typename KV>
__host__ __device__ constexpr int o_tiles() { return is_fp8<KV>() ? D / 16 : D / 8; }

// Q of up to 16 heads as A fragments: qa of row grp (the head at qh), qb of row grp + 8 (at
// qh + 8 * D; R = 2), zero for rows >= `rows`. qh points at head grp of the 16.
template <typename T, typename KV, int D, int R>
__device__ __forceinline__ void load_q_frags(unsigned (&qa)[D / 16][2], unsigned (&qb)[D / 16][2],
                                             const T* qh, int rows, int grp, int tig) {
  if constexpr (is_fp8<KV>()) {
    q_frags_e4m3<T, D>(qa, qh, grp < rows, tig);
    q_frags_e4m3<T, D>(qb, qh + 8 * D, R == 2 && grp + 8 < rows, tig);
  } else {
#pragma unroll
    for (int kk = 0; kk < D / 16; ++kk) {
      qa[kk][0] = grp < rows ? *reinterpret_cast<const unsigned*>(qh + kk * 16 + 2 * tig) : 0u;
      qa[kk][1] = grp < rows ? *reinterpret_cast<const unsigned*>(qh + kk * 16 + 8 + 2 * tig) : 0u;
      qb[kk][0] = qb[kk][1] = 0u;   // rows 8..15: left out of the mma when R = 1
      if constexpr (R == 2) {
        const T* qh8 = qh + 8 * D;
        qb[kk][0] = grp + 8 < rows ? *reinterpret_cast<const unsigned*>(qh8 + kk * 16 + 2 * tig) : 0u;
        qb[kk][1] = grp + 8 < rows ? *reinterpret_cast<const unsigned*>(qh8 + kk * 16 + 8 + 2 * tig) : 0u;
      }
    }
  }
}

// NTL (1, or 2 for fp16 / bf16 K/V) 16-token tiles for the warp's heads (the rows of qa / qb):
// S = Q K^T from the K tiles at ks + j * tstep, one online-softmax update of (m, l) and o over all
// 16 * NTL tokens, O += P V from the V tiles at vs + j * tstep (shared memory, by tile_chunk).
// tstep, the elements from one tile's K or V to the next's, is 0 where NTL is 1 and required, so
// no NTL = 2 call reads its first tile twice. tile_tok: the first tile's first token; tokens at
// or past tok_end are masked. Two tiles give the warp four independent S accumulators and one
// softmax for 32 tokens (the wide body's PKV_WIDE_TWO_TILES variant, at 3-4 head groups, where
// each warp attends both tiles of a stage); P is then rounded to T against the 32 tokens' max,
// not each tile's. sm_scale: the softmax scale in the log2 domain (times k_scale for e4m3); with
// a soft cap (capped) the scores are cap_log2 * tanh(s * cap_pre).
template <typename T, typename KV, int D, int R, int NTL = 1>
__device__ __forceinline__ void tile_attend(const KV* ks, const KV* vs, int tile_tok, int tok_end,
                                            const unsigned (&qa)[D / 16][2],
                                            const unsigned (&qb)[D / 16][2], const E4m3Frags& frags,
                                            float sm_scale, float cap_pre, float cap_log2,
                                            bool capped, float (&o)[R][o_tiles<D, KV>()][4],
                                            float (&m)[R], float (&l)[R], int tstep) {
  constexpr bool kFp8 = is_fp8<KV>();
  constexpr int KSTEPS = D / 16;   // mma k-steps over the head dim (S = Q K^T)
  constexpr int NT = D / 8;        // n8 tiles of O
  constexpr int NO = o_tiles<D, KV>();
  constexpr int SN = 2 * NTL;      // n8 tiles of S
  static_assert(NTL == 1 || (NTL == 2 && !kFp8), "two tiles at once: fp16 / bf16 K/V");
  const int lane = threadIdx.x % 32, tig = lane % 4;
  // S = Q K^T for 16 * NTL tokens: s[nt] covers tokens nt*8 .. nt*8+7 (c0, c1: row grp; c2, c3:
  // row grp + 8).
  float s[SN][4] = {};
  if constexpr (kFp8) {
    qk_e4m3<T, D, R>(s, qa, qb, reinterpret_cast<const unsigned char*>(ks), frags);
  } else {
    const int mat = lane / 8, r8 = lane % 8;
    const int tok = (mat >> 1) * 8 + r8;
#pragma unroll
    for (int kk = 0; kk < KSTEPS; ++kk) {
      const int c = kk * 2 + (mat & 1);
#pragma unroll
      for (int j = 0; j < NTL; ++j) {
        unsigned b[4];
        ldmatrix_x4(b, ks + j * tstep + tile_chunk<KV, D>(tok, c));
        mma_rows<R, T>(s[2 * j], qa[kk][0], qb[kk][0], qa[kk][1], qb[kk][1], b[0], b[1]);
        mma_rows<R, T>(s[2 * j + 1], qa[kk][0], qb[kk][0], qa[kk][1], qb[kk][1], b[2], b[3]);
      }
    }
  }
  // Online softmax on rows grp (+ 8): c0, c1 (c2, c3) of each n8 tile.
  float pr[R][2 * SN], alpha[R];
#pragma unroll
  for (int r = 0; r < R; ++r) {
    float x[2 * SN];
    if (capped) {  // a uniform branch around the tanh, so that plain kernels never run it
#pragma unroll
      for (int nt = 0; nt < SN; ++nt)
#pragma unroll
        for (int e = 0; e < 2; ++e) s[nt][2 * r + e] = capped_log2(s[nt][2 * r + e], cap_pre, cap_log2);
    }
#pragma unroll
    for (int nt = 0; nt < SN; ++nt)
#pragma unroll
      for (int e = 0; e < 2; ++e) {
        const bool valid = tile_tok + nt * 8 + 2 * tig + e < tok_end;
        x[nt * 2 + e] = valid ? (capped ? s[nt][2 * r + e] : s[nt][2 * r + e] * sm_scale) : -INFINITY;
      }
    float mx = fmaxf(fmaxf(x[0], x[1]), fmaxf(x[2], x[3]));
#pragma unroll
    for (int e = 4; e < 2 * SN; e += 4)
      mx = fmaxf(mx, fmaxf(fmaxf(x[e], x[e + 1]), fmaxf(x[e + 2], x[e + 3])));
    mx = fmaxf(mx, __shfl_xor_sync(0xffffffffu, mx, 1));
    mx = fmaxf(mx, __shfl_xor_sync(0xffffffffu, mx, 2));
    const float m_new = fmaxf(m[r], mx);
    alpha[r] = rescale(m[r], m_new);
    const float m_use = m_new == -INFINITY ? 0.f : m_new;
#pragma unroll
    for (int e = 0; e < 2 * SN; ++e) pr[r][e] = fast_exp2(x[e] - m_use);
    float lr = l[r] * alpha[r] + (pr[r][0] + pr[r][1]) + (pr[r][2] + pr[r][3]);
#pragma unroll
    for (int e = 4; e < 2 * SN; e += 4) lr = lr + (pr[r][e] + pr[r][e + 1]) + (pr[r][e + 2] + pr[r][e + 3]);
    l[r] = lr;
    m[r] = m_new;
  }
  if constexpr (kFp8) {  // o[r][mt][c] belongs to head 8r + 2*tig + (c & 1), whose alpha lane
                         // 4 * (2*tig + (c & 1)) holds (its row grp is that head's)
#pragma unroll
    for (int r = 0; r < R; ++r) {
      const float alpha0 = __shfl_sync(0xffffffffu, alpha[r], 8 * tig);
      const float alpha1 = __shfl_sync(0xffffffffu, alpha[r], 8 * tig + 4);
#pragma unroll
      for (int n = 0; n < NO; ++n) {
        o[r][n][0] *= alpha0;
        o[r][n][1] *= alpha1;
        o[r][n][2] *= alpha0;
        o[r][n][3] *= alpha1;
      }
    }
  } else {  // o[0][n][0..1]: row grp, o[0][n][2..3]: row grp + 8 (the padding when R = 1)
#pragma unroll
    for (int n = 0; n < NT; ++n) {
      o[0][n][0] *= alpha[0];
      o[0][n][1] *= alpha[0];
      if constexpr (R == 2) {
        o[0][n][2] *= alpha[R - 1];
        o[0][n][3] *= alpha[R - 1];
      }
    }
  }
  // O += P V: P (rows grp, grp + 8; tokens 2*tig.. and +8 of each tile) is the A operand
  // straight from registers.
  if constexpr (kFp8) {
    unsigned pb0[R], pb1[R];
#pragma unroll
    for (int r = 0; r < R; ++r) {
      pb0[r] = pack2(pr[r][0], pr[r][1], __half());
      pb1[r] = pack2(pr[r][2], pr[r][3], __half());
    }
    pv_e4m3<D, R>(o, pb0, pb1, reinterpret_cast<const unsigned char*>(vs), frags);
  } else {  // tile j's tokens are the k dim of its own mma step
    const int mat = lane / 8, r8 = lane % 8;
    const int tok = (mat & 1) * 8 + r8;
#pragma unroll
    for (int j = 0; j < NTL; ++j) {
      const unsigned pa0 = pack2(pr[0][4 * j], pr[0][4 * j + 1], T());
      const unsigned pa2 = pack2(pr[0][4 * j + 2], pr[0][4 * j + 3], T());
      const unsigned pa1 = R == 2 ? pack2(pr[R - 1][4 * j], pr[R - 1][4 * j + 1], T()) : 0u;
      const unsigned pa3 = R == 2 ? pack2(pr[R - 1][4 * j + 2], pr[R - 1][4 * j + 3], T()) : 0u;
#pragma unroll
      for (int n2 = 0; n2 < NT / 2; ++n2) {
        unsigned b[4];
        const int c = n2 * 2 + (mat >> 1);
        ldmatrix_x4_trans(b, vs + j * tstep + tile_chunk<KV, D>(tok, c));
        mma_rows<R, T>(o[0][2 * n2], pa0, pa1, pa2, pa3, b[0], b[1]);
        mma_rows<R, T>(o[0][2 * n2 + 1], pa0, pa1, pa2, pa3, b[2], b[3]);
      }
    }
  }
}

// A warp's finished state into shared memory for finish_groups: its head j (j < rows; rows grp
// and grp + 8 of its fragments, l already summed over the quad) at index at + j of sm_acc
// ([.][D] floats) and sm_ml ([.][2]).
template <typename KV, int D, int R>
__device__ __forceinline__ void stage_state(float* sm_acc, float* sm_ml, int at, int rows,
                                            const float (&o)[R][o_tiles<D, KV>()][4],
                                            const float (&m)[R], const float (&l)[R], int grp,
                                            int tig) {
  constexpr int NO = o_tiles<D, KV>();
  if constexpr (is_fp8<KV>()) {  // o[r][mt][c]: head 8r + 2*tig + (c & 1), elements d(mt, grp), +1
#pragma unroll
    for (int r = 0; r < R; ++r)
#pragma unroll
      for (int c = 0; c < 2; ++c) {
        const int head = 8 * r + 2 * tig + c;
        if (head < rows) {
          float* dst = sm_acc + (at + head) * D;
#pragma unroll
          for (int mt = 0; mt < NO; ++mt)
            *reinterpret_cast<float2*>(dst + e4m3_o_elem<D>(mt, grp)) =
                make_float2(o[r][mt][c], o[r][mt][c + 2]);
        }
      }
  }
#pragma unroll
  for (int r = 0; r < R; ++r) {
    const int head = grp + 8 * r;
    if (head < rows) {
      if constexpr (!is_fp8<KV>()) {
        float* dst = sm_acc + (at + head) * D + 2 * tig;
#pragma unroll
        for (int n = 0; n < NO; ++n)
          *reinterpret_cast<float2*>(dst + n * 8) = make_float2(o[0][n][2 * r], o[0][n][2 * r + 1]);
      }
      if (tig == 0) {
        sm_ml[(at + head) * 2] = m[r];
        sm_ml[(at + head) * 2 + 1] = l[r];
      }
    }
  }
}

// Fills a cp.async pipeline of STAGES stages with stages 0 .. STAGES - 2 of the n a range has
// (one commit group each, empty past n): issue(i) copies stage i, end_of(i) is the token after
// it. With p.early_kv (workqueue launches after the first of a step, see
// pkvrt/runtime/running.py) the stages that hold only tokens before the row's last one are
// issued before pdl_enter: they overlap the previous kernels' drain (the previous layer's merge,
// and its decode too: the merge triggers before its own wait, kernels/merge.cu). The plan
// (tasks, offsets, lengths, block tables) is at least two kernels old then, and K/V of those
// tokens were written before the step; the last token (appended for this step, possibly by the
// kernel just before) and Q are read after the wait. Every thread of the CTA calls it.
template <int STAGES, typename Issue, typename EndOf>
__device__ __forceinline__ void prefill_pipeline(const DecodeParams& p, int row, int n, Issue& issue,
                                                 EndOf end_of) {
  int filled = 0;
  if (p.early_kv) {
    const int safe_end = p.seq_lens[row] - 1;
    for (; filled < STAGES - 1 && filled < n; ++filled) {
      if (end_of(filled) > safe_end) break;
      issue(filled);
      cp_async_commit();
    }
    pdl_enter();
    trace_mark(p.trace, kWaited);
  }
  for (int s = filled; s < STAGES - 1; ++s) {
    if (s < n) issue(s);
    cp_async_commit();
  }
}

template <typename T, typename KV, int D, int GC>
__device__ __forceinline__ void decode_range_tc(const DecodeParams& p, int row, int kvh,
                                                int tok_begin, int tok_end, Sink sink,
                                                unsigned char* smem) {
  constexpr bool kFp8 = is_fp8<KV>();
  constexpr int R = GC > 8 ? 2 : 1;             // 8-row halves of the A operand in use
  constexpr int STAGES = tc_stages<D, KV>();
  constexpr int CVEC = 16 / (int)sizeof(KV);   // elements per 16-byte copy: 8, or 16 of e4m3
  constexpr int CHUNKS = D / CVEC;              // 16-byte chunks per token row
  constexpr int NO = o_tiles<D, KV>();
  constexpr int TILE_ELEMS = kTcTile * tile_row<D, KV>();  // one K (or V) tile
  static_assert(GC <= 16, "at most 16 heads: the 16 rows of the A operand");
  static_assert(D % 16 == 0 && (CHUNKS * kTcTile) % 32 == 0, "head dim: a multiple of 16");
  static_assert(!kFp8 || swizzled<D, KV>(), "e4m3 tiles: D in 64, 128, 256");
  static_assert(kWarps * GC * (D + 2) * 4 <= smem_bytes<D, GC, KV>(), "warp merge must fit in smem");

  const int G = p.group;
  if (G > GC) __trap();  // the host picks the capacity of G (_buildspec.group_class): never taken
  const int warp = threadIdx.x / 32, lane = threadIdx.x % 32;
  const int grp = lane / 4, tig = lane % 4;     // mma fragment coordinates
  const int h0 = kvh * G;

  const KV* kc = static_cast<const KV*>(p.k_cache) + kvh * p.k_head_stride;
  const KV* vc = static_cast<const KV*>(p.v_cache) + kvh * p.v_head_stride;
  const int* bt = p.block_tables + (long long)row * p.bt_stride;
  const int pmask = (1 << p.page_size_log2) - 1;
  const int num_tiles = (tok_end - tok_begin + kTcTile - 1) / kTcTile;
  const int my_tiles = num_tiles > warp ? (num_tiles - warp + kWarps - 1) / kWarps : 0;
  KV* wbase = reinterpret_cast<KV*>(smem) + warp * STAGES * 2 * TILE_ELEMS;

  // Lane t < 16 looks up the page of token t of a tile, one tile ahead; the copies then take
  // the page by shuffle.
  const int ctok = lane % kTcTile;
  auto page_of = [&](int i) -> int {  // physical page of this lane's token in my tile i
    const int tok = tok_begin + (warp + i * kWarps) * kTcTile + ctok;
    return tok < tok_end ? bt[tok >> p.page_size_log2] : 0;
  };
  int next_page = my_tiles > 0 ? page_of(0) : 0;
  auto issue = [&](int i) {
    const int tok0 = tok_begin + (warp + i * kWarps) * kTcTile;
    const int page_here = next_page;  // lane t < 16 holds the page of token t of this tile
    if (i + 1 < my_tiles) next_page = page_of(i + 1);
    KV* ks = wbase + (i % STAGES) * 2 * TILE_ELEMS;
    KV* vs = ks + TILE_ELEMS;
    // Chunk-major: consecutive lanes copy consecutive 16-byte chunks of one token row, so a
    // warp instruction covers whole rows (D=128: 2 rows = 4 lines of 128 B; e4m3: 4 rows). A
    // lane-per-row mapping (32 B of 16 rows per instruction) ran at 3.0 TB/s instead of 4.1
    // (benches/NOTES.md, chunk-major copies).
#pragma unroll
    for (int j = 0; j < CHUNKS * kTcTile / 32; ++j) {
      const int idx = lane + 32 * j;
      const int t = idx / CHUNKS, c = idx % CHUNKS;  // token of the tile, chunk of its row
      const int tok = tok0 + t;
      const bool valid = tok < tok_end;
      const long long page = __shfl_sync(0xffffffffu, page_here, t);
      const int in_page = tok & pmask;  // the in-page offsets in 32 bits: one IMAD each
      const int sc = tile_chunk<KV, D>(t, c);  // swizzled destination
      cp_async16_zfill(ks + sc, valid ? kc + page * p.k_page_stride + (in_page * p.k_tok_stride + c * CVEC) : kc,
                       valid);
      cp_async16_zfill(vs + sc, valid ? vc + page * p.v_page_stride + (in_page * p.v_tok_stride + c * CVEC) : vc,
                       valid);
    }
  };

  // Prefill the pipeline (early copies before the PDL wait: prefill_pipeline).
  prefill_pipeline<STAGES>(p, row, my_tiles, issue, [&](int i) {
    return min(tok_end, tok_begin + (warp + i * kWarps + 1) * kTcTile);
  });

  // Q as A fragments of heads h0 .. h0 + G - 1.
  E4m3Frags frags{};  // e4m3 only
  if constexpr (kFp8) frags = e4m3_frags<D>(grp, tig);
  unsigned qa[D / 16][2], qb[D / 16][2];
  load_q_frags<T, KV, D, R>(qa, qb, static_cast<const T*>(p.q) + ((long long)row * p.num_qo_heads + h0 + grp) * D,
                            G, grp, tig);
  const ScoreScale sc = score_scale<KV>(p, kvh);

  float o[R][NO][4];
#pragma unroll
  for (int r = 0; r < R; ++r)
#pragma unroll
    for (int n = 0; n < NO; ++n) o[r][n][0] = o[r][n][1] = o[r][n][2] = o[r][n][3] = 0.f;
  float m[R], l[R];  // rows grp (+ 8) of this warp's state (l: this thread's columns)
#pragma unroll
  for (int r = 0; r < R; ++r) {
    m[r] = -INFINITY;
    l[r] = 0.f;
  }
  for (int i = 0; i < my_tiles; ++i) {
    // The stage refilled below was read (ldmatrix) by every lane in iteration i - 1: order
    // those reads before these writes (compute-sanitizer racecheck flags the bare WAR hazard).
    __syncwarp();
    if (i + STAGES - 1 < my_tiles) issue(i + STAGES - 1);
    cp_async_commit();
    cp_async_wait<STAGES - 1>();
    __syncwarp();  // every lane's copies of tile i are visible to the whole warp

    const KV* ks = wbase + (i % STAGES) * 2 * TILE_ELEMS;
    tile_attend<T, KV, D, R>(ks, ks + TILE_ELEMS, tok_begin + (warp + i * kWarps) * kTcTile, tok_end,
                             qa, qb, frags, sc.sm_scale, sc.cap_pre, p.softcap_log2, sc.capped, o, m, l,
                             0);
  }
  cp_async_wait<0>();
#pragma unroll
  for (int r = 0; r < R; ++r) {
    l[r] += __shfl_xor_sync(0xffffffffu, l[r], 1);
    l[r] += __shfl_xor_sync(0xffffffffu, l[r], 2);
  }
  __syncthreads();  // every warp's pipeline is drained: reuse its smem for the warp merge

  float* sm_acc = reinterpret_cast<float*>(smem);  // [kWarps][GC][D]
  float* sm_ml = sm_acc + kWarps * GC * D;         // [kWarps][GC][2]
  stage_state<KV, D, R>(sm_acc, sm_ml, warp * GC, G, o, m, l, grp, tig);
  __syncthreads();
  const float v_scale = kFp8 ? kv_scale(p.v_scale, p.v_scale_per_head, kvh) : 1.f;
  finish_groups<T, D, GC, kWarps>(p, sm_acc, sm_ml, h0, sink, v_scale);
}


// ---- wide body: group capacity 64 ----------------------------------------------------------
//
// G = p.group in 17..64 query heads per KV head: models with that many query heads per KV
// head, and SharedPagesRuntime's chunks (the rows x G heads of rows that share a page run, so
// that a K/V tile of the run is read once for all of them). An mma A operand holds 16 heads,
// so the CTA's warps split the heads where the narrow body splits the tokens: HG = ceil(G / 16)
// head groups, warp w takes head group w % HG of token stream w / HG, with TS = 2 token streams
// (the two 16-token tiles of a stage) when HG <= 2 and 1 otherwise (at HG = 3 warp 3 only
// copies). K/V stream through CTA-wide stages of kWideStageTokens = 32 tokens, two tiles laid
// out as the narrow body's (K tile, V tile: the same swizzle and fragment loads); every warp
// copies 8 tokens of each stage and one __syncthreads per stage publishes it, so each byte of
// the range moves from memory to shared memory once for all G heads. The pipeline has the
// narrow body's bytes (wide_stages: 6 stages at D <= 128, 4 at D = 256, twice that for e4m3).
// The TS streams' states combine in finish_groups.
#ifndef PKV_WIDE_TWO_TILES
#define PKV_WIDE_TWO_TILES 0
#endif
constexpr int kWideStageTokens = 2 * kTcTile;
template <int D, typename KV>
__host__ __device__ constexpr int wide_stage_elems() { return 2 * 2 * kTcTile * tile_row<D, KV>(); }
template <int D, typename KV>
__host__ __device__ constexpr int wide_stages() { return 2 * tc_stages<D, KV>(); }

template <typename T, typename KV, int D, int GC>
__device__ __forceinline__ void decode_range_wide(const DecodeParams& p, int row, int kvh,
                                                  int tok_begin, int tok_end, Sink sink,
                                                  unsigned char* smem) {
  constexpr bool kFp8 = is_fp8<KV>();
  constexpr int STAGES = wide_stages<D, KV>();
  constexpr int CVEC = 16 / (int)sizeof(KV);   // elements per 16-byte copy
  constexpr int CHUNKS = D / CVEC;              // 16-byte chunks per token row
  constexpr int NO = o_tiles<D, KV>();
  constexpr int TILE_ELEMS = kTcTile * tile_row<D, KV>();
  constexpr int STAGE_ELEMS = wide_stage_elems<D, KV>();
  constexpr int WARP_TOKENS = kWideStageTokens / kWarps;   // tokens of a stage a warp copies
  // With PKV_WIDE_TWO_TILES = 1 (a PKVRT_TUNE variant, not yet measured on a GPU: off in the
  // shipped build), a warp at TS = 1 attends the stage's two tiles in one tile_attend (NTL = 2:
  // four S accumulators in flight, one softmax for 32 tokens) for fp16 / bf16 K/V at D 64 and
  // 128. D 256 keeps one tile (with two, pkv_split_decode and the others spill); D 96 (padded
  // tile rows) is not tried.
  constexpr bool kTwoTiles = PKV_WIDE_TWO_TILES && !kFp8 && (D == 64 || D == 128);
  static_assert(GC > 16 && GC <= 16 * kWarps, "the wide body: up to 16 heads per warp");
  static_assert(STAGE_ELEMS == 2 * 2 * TILE_ELEMS && (CHUNKS * WARP_TOKENS) % 32 == 0,
                "a warp's copies of a stage: whole instructions");
  static_assert(STAGES * STAGE_ELEMS * (int)sizeof(KV) <= smem_bytes<D, GC, KV>() &&
                GC * (D + 2) * 4 <= smem_bytes<D, GC, KV>(), "stages and states must fit in smem");

  const int G = p.group;
  if (G > GC) __trap();  // the host picks the capacity of G (_buildspec.group_class): never taken
  const int warp = threadIdx.x / 32, lane = threadIdx.x % 32;
  const int grp = lane / 4, tig = lane % 4;
  const int h0 = kvh * G;
  const int HG = (G + 15) / 16;                 // head groups of 16
  const int TS = HG <= 2 ? 2 : 1;               // token streams
  const int hg = warp % HG, ts = warp / HG;
  const bool computes = ts < TS;
  const int rows = min(16, G - 16 * hg);        // heads of this warp's group

  const KV* kc = static_cast<const KV*>(p.k_cache) + kvh * p.k_head_stride;
  const KV* vc = static_cast<const KV*>(p.v_cache) + kvh * p.v_head_stride;
  const int* bt = p.block_tables + (long long)row * p.bt_stride;
  const int pmask = (1 << p.page_size_log2) - 1;
  const int num_stages = (tok_end - tok_begin + kWideStageTokens - 1) / kWideStageTokens;
  KV* sbase = reinterpret_cast<KV*>(smem);

  // Lane t < 8 looks up the page of token t of the warp's 8, one stage ahead.
  const int ctok = lane % WARP_TOKENS;
  auto page_of = [&](int i) -> int {
    const int tok = tok_begin + i * kWideStageTokens + warp * WARP_TOKENS + ctok;
    return tok < tok_end ? bt[tok >> p.page_size_log2] : 0;
  };
  int next_page = num_stages > 0 ? page_of(0) : 0;
  auto issue = [&](int i) {   // the warp's 8 tokens of stage i, chunk-major as the narrow body
    const int st0 = warp * WARP_TOKENS;   // their first token in the stage
    const int tok0 = tok_begin + i * kWideStageTokens + st0;
    const int page_here = next_page;
    if (i + 1 < num_stages) next_page = page_of(i + 1);
    KV* stage = sbase + (i % STAGES) * STAGE_ELEMS;
#pragma unroll
    for (int j = 0; j < CHUNKS * WARP_TOKENS / 32; ++j) {
      const int idx = lane + 32 * j;
      const int t = idx / CHUNKS, c = idx % CHUNKS;   // token of the warp's 8, chunk of its row
      const int tok = tok0 + t;
      const bool valid = tok < tok_end;
      const long long page = __shfl_sync(0xffffffffu, page_here, t);
      const int in_page = tok & pmask;
      KV* ks = stage + ((st0 + t) / kTcTile) * 2 * TILE_ELEMS;   // its tile's K, then V
      const int sc = tile_chunk<KV, D>((st0 + t) % kTcTile, c);
      cp_async16_zfill(ks + sc, valid ? kc + page * p.k_page_stride + (in_page * p.k_tok_stride + c * CVEC) : kc,
                       valid);
      cp_async16_zfill(ks + TILE_ELEMS + sc,
                       valid ? vc + page * p.v_page_stride + (in_page * p.v_tok_stride + c * CVEC) : vc, valid);
    }
  };

  // Prefill the pipeline (early copies before the PDL wait: prefill_pipeline).
  prefill_pipeline<STAGES>(p, row, num_stages, issue, [&](int i) {
    return min(tok_end, tok_begin + (i + 1) * kWideStageTokens);
  });

  // Q of the warp's heads h0 + 16 hg .. + rows - 1 (none for a warp that only copies).
  E4m3Frags frags{};
  if constexpr (kFp8) frags = e4m3_frags<D>(grp, tig);
  unsigned qa[D / 16][2], qb[D / 16][2];
  load_q_frags<T, KV, D, 2>(
      qa, qb, static_cast<const T*>(p.q) + ((long long)row * p.num_qo_heads + h0 + 16 * hg + grp) * D,
      computes ? rows : 0, grp, tig);
  const ScoreScale sc = score_scale<KV>(p, kvh);

  float o[2][NO][4];
#pragma unroll
  for (int r = 0; r < 2; ++r)
#pragma unroll
    for (int n = 0; n < NO; ++n) o[r][n][0] = o[r][n][1] = o[r][n][2] = o[r][n][3] = 0.f;
  float m[2] = {-INFINITY, -INFINITY}, l[2] = {0.f, 0.f};
  for (int i = 0; i < num_stages; ++i) {
    cp_async_wait<STAGES - 2>();
    // Stage i has landed for every warp's copies, and every warp is done with stage i - 1,
    // which the copies below refill.
    __syncthreads();
    if (i + STAGES - 1 < num_stages) issue(i + STAGES - 1);
    cp_async_commit();
    if (computes) {
      const KV* stage = sbase + (i % STAGES) * STAGE_ELEMS;
      int t0 = ts;   // the stage's first tile this warp attends one at a time
      if constexpr (kTwoTiles) {
        if (TS == 1) {   // both tiles at once
          tile_attend<T, KV, D, 2, 2>(stage, stage + TILE_ELEMS, tok_begin + i * kWideStageTokens, tok_end,
                                      qa, qb, frags, sc.sm_scale, sc.cap_pre, p.softcap_log2, sc.capped, o,
                                      m, l, 2 * TILE_ELEMS);
          t0 = 2;
        }
      }
      for (int t = t0; t < 2; t += TS) {
        const int tile_tok = tok_begin + i * kWideStageTokens + t * kTcTile;
        if (tile_tok < tok_end)
          tile_attend<T, KV, D, 2>(stage + t * 2 * TILE_ELEMS, stage + (t * 2 + 1) * TILE_ELEMS, tile_tok,
                                   tok_end, qa, qb, frags, sc.sm_scale, sc.cap_pre, p.softcap_log2, sc.capped,
                                   o, m, l, 0);
      }
    }
  }
  cp_async_wait<0>();
#pragma unroll
  for (int r = 0; r < 2; ++r) {
    l[r] += __shfl_xor_sync(0xffffffffu, l[r], 1);
    l[r] += __shfl_xor_sync(0xffffffffu, l[r], 2);
  }
  __syncthreads();  // the stages are drained: reuse them for the streams' states

  float* sm_acc = reinterpret_cast<float*>(smem);  // [TS][G][D], TS * G <= GC
  float* sm_ml = sm_acc + GC * D;                  // [TS][G][2]
  if (computes) stage_state<KV, D, 2>(sm_acc, sm_ml, ts * G + 16 * hg, rows, o, m, l, grp, tig);
  __syncthreads();
  const float v_scale = kFp8 ? kv_scale(p.v_scale, p.v_scale_per_head, kvh) : 1.f;
  finish_groups<T, D, GC, 2>(p, sm_acc, sm_ml, h0, sink, v_scale, TS, G);   // TS <= 2 streams
}

// Attention of the G = p.group <= GC query heads of (row, kvh) over tokens [tok_begin, tok_end)
// of the row, tok_begin < tok_end <= seq_len, q and out in T, K/V in KV (T or e4m3). `smem`
// holds smem_bytes<D, GC, KV>() bytes.
template <typename T, typename KV, int D, int GC>
__device__ __forceinline__ void decode_range(const DecodeParams& p, int row, int kvh,
                                             int tok_begin, int tok_end, Sink sink,
                                             unsigned char* smem) {
  if constexpr (GC > 16)
    decode_range_wide<T, KV, D, GC>(p, row, kvh, tok_begin, tok_end, sink, smem);
  else
    decode_range_tc<T, KV, D, GC>(p, row, kvh, tok_begin, tok_end, sink, smem);
}

// The (m, l) of the warp's lanes folded into one (log2 domain, online rescale), on every lane.
__device__ __forceinline__ void warp_fold_ml(float& m, float& l) {
#pragma unroll
  for (int off = 16; off > 0; off >>= 1) {
    const float mo = __shfl_xor_sync(0xffffffffu, m, off);
    const float lo = __shfl_xor_sync(0xffffffffu, l, off);
    const float m_new = fmaxf(m, mo);
    l = l * rescale(m, m_new) + lo * rescale(mo, m_new);
    m = m_new;
  }
}

// A lane's E = D / 32 consecutive floats of a partial state's accumulator (src at lane * E),
// read from L2 (__ldcg: in the fused kernel other CTAs wrote them).
template <int E>
__device__ __forceinline__ void load_state_part(const float* src, float (&v)[E]) {
  if constexpr (E == 2) {
    const float2 x = __ldcg(reinterpret_cast<const float2*>(src));
    v[0] = x.x;
    v[1] = x.y;
  } else if constexpr (E % 4 != 0) {   // D = 96: 12-byte runs, scalar loads
#pragma unroll
    for (int e = 0; e < E; ++e) v[e] = __ldcg(src + e);
  } else {
#pragma unroll
    for (int q = 0; q < E / 4; ++q) {
      const float4 x = __ldcg(reinterpret_cast<const float4*>(src) + q);
      v[4 * q] = x.x;
      v[4 * q + 1] = x.y;
      v[4 * q + 2] = x.z;
      v[4 * q + 3] = x.w;
    }
  }
}

// A lane's E merged outputs: into O (T, at dst = the head's row + lane * E), or kPartial into a
// partial state's accumulator (floats at dst).
template <typename T, int E, bool kPartial>
__device__ __forceinline__ void store_merged(const float (&acc)[E], void* dst_) {
  if constexpr (kPartial) {
    float* dst = static_cast<float*>(dst_);
    if constexpr (E % 4 == 0) {
#pragma unroll
      for (int q = 0; q < E / 4; ++q)
        reinterpret_cast<float4*>(dst)[q] = make_float4(acc[4 * q], acc[4 * q + 1], acc[4 * q + 2], acc[4 * q + 3]);
    } else if constexpr (E == 2) {
      *reinterpret_cast<float2*>(dst) = make_float2(acc[0], acc[1]);
    } else {
#pragma unroll
      for (int e = 0; e < E; ++e) dst[e] = acc[e];
    }
  } else {
    T* dst = static_cast<T*>(dst_);
    float f[8] = {0.f, 0.f, 0.f, 0.f, 0.f, 0.f, 0.f, 0.f};
#pragma unroll
    for (int e = 0; e < E; ++e) f[e] = acc[e];
    const uint4 raw = from_float8(f, T());
    if constexpr (E == 8) *reinterpret_cast<uint4*>(dst) = raw;
    else if constexpr (E == 4) *reinterpret_cast<uint2*>(dst) = make_uint2(raw.x, raw.y);
    else if constexpr (E == 2) *reinterpret_cast<unsigned*>(dst) = raw.x;
    else {   // E = 3 (D = 96): three elements at a 6-byte stride
      const T* r = reinterpret_cast<const T*>(&raw);
#pragma unroll
      for (int e = 0; e < E; ++e) dst[e] = r[e];
    }
  }
}

// Exact merge of the n partial states in slots slot_begin + k * stride (k < n) of query head h
// into O[out_row, h, :] (`o` points at that head's D outputs), executed by one warp; lane owns
// the E = D/32 consecutive outputs lane*E .. lane*E+E-1. kPartial: into a partial state instead
// (a_out: the head's D floats of a slot, ml_out: its (m, l); no normalisation, sink or lse), the
// first level of the fused kernel's two-level tail (workqueue_task.cuh). a_out / ml_out may be
// the first state's own: a lane stores only the outputs it alone loaded, after its last load. Latency, not bandwidth, is its cost (a few
// KB per head, in L2), so it is written to have few dependent round trips to L2:
//  1. lane i loads (m, l) of slots i, i+32, ... and folds them online; a butterfly over the warp
//     gives (m_all, l_all) on every lane: one round trip for up to 32 slots;
//  2. lane i turns slot i's m into its weight 2^(m_i - m_all) / l_all; the accumulators then
//     take batches of BATCH slots whose loads are all issued before the first FMA, the weight
//     of each broadcast from its lane by shuffle: ceil(n / BATCH) round trips, the first of
//     them issued together with step 1's loads.
// A loop over the slots three times with one dependent load per iteration measured 9 us for 16
// slots, 28 us for 64 on the H200 (benches/NOTES.md, the merge).
// Loads bypass L1 (__ldcg): in the fused kernel the slots were written by other CTAs.
// WIDE = 2 doubles the slots in flight (<= 128 registers for them): the fused kernel's tail at
// G > 4. ptxas sizes the whole kernel for it (fp16 D 128: 193 -> 195 registers, e4m3 D 128:
// 145 -> 180); occupancy stays 2 CTAs per SM, bounded by shared memory. The merge kernel keeps 1
// (its occupancy counts).
// sink_log2: the head's attention sink in the log2 domain (-inf: none), which joins the
// denominator; lse: null, or where lane 0 writes the head's log2-sum-exp m_all + log2(l_all).
template <typename T, int D, int WIDE = 1, bool kPartial = false>
__device__ __forceinline__ void merge_head(const float* part_a, const float* part_ml,
                                           int num_qo_heads, int slot_begin, int n, int stride,
                                           int h, T* o, int lane, float sink_log2 = -INFINITY,
                                           float* lse = nullptr, float* a_out = nullptr,
                                           float* ml_out = nullptr) {
  constexpr int E = D / 32;                  // outputs per lane: 2, 3, 4 or 8
  constexpr int BATCH = (E >= 8 ? 8 : 16) * WIDE;  // slots in flight per lane (<= 64 * WIDE registers)
  static_assert(BATCH <= 32, "a batch's weights are shuffled from the lanes of one 32-slot round");
  // k-th state's (m, l); its E outputs of this lane
  auto ml_at = [&](int k) { return part_ml + ((long long)(slot_begin + k * stride) * num_qo_heads + h) * 2; };
  float v[BATCH][E];
  auto load_batch = [&](int k0, int cnt) {   // the lane's E outputs of states k0 .. k0+cnt-1
#pragma unroll
    for (int j = 0; j < BATCH; ++j) {
      if (j < cnt)
        load_state_part<E>(part_a + ((long long)(slot_begin + (k0 + j) * stride) * num_qo_heads + h) * D + lane * E, v[j]);
    }
  };

  // The first batch of accumulators is loaded with the (m, l) of step 1: one round trip for
  // both when the row has at most BATCH slots (16 at D <= 128, 32 with WIDE), the common case.
  load_batch(0, min(BATCH, n));

  // 1. (m_all, l_all), with lane's own slot of the first 32 kept for its weight.
  float m_mine = -INFINITY, l_acc = 0.f;
  if (lane < n) {
    m_mine = __ldcg(ml_at(lane));
    l_acc = __ldcg(ml_at(lane) + 1);
  }
  float m_acc = m_mine;
  for (int k = lane + 32; k < n; k += 32) {
    const float ms = __ldcg(ml_at(k)), ls = __ldcg(ml_at(k) + 1);
    const float m_new = fmaxf(m_acc, ms);
    l_acc = l_acc * rescale(m_acc, m_new) + ls * rescale(ms, m_new);
    m_acc = m_new;
  }
  warp_fold_ml(m_acc, l_acc);
  const float m_all = m_acc;
  float inv_l = 1.f;   // a partial state stays unnormalised
  if constexpr (!kPartial) {
    inv_l = 1.f / l_acc;
    if (sink_log2 != -INFINITY) {   // the sink in the denominator (out_factor's rule)
      const float m2 = fmaxf(m_all, sink_log2), w = fast_exp2(m_all - m2);
      inv_l = w / (l_acc * w + fast_exp2(sink_log2 - m2));
    }
    if (lse != nullptr && lane == 0) *lse = m_all + log2f(l_acc);
  }

  // 2. sum_s w_s a_s over the lane's E outputs.
  float acc[E];
#pragma unroll
  for (int e = 0; e < E; ++e) acc[e] = 0.f;
  for (int c0 = 0; c0 < n; c0 += 32) {
    float w;  // weight of slot slot_begin + c0 + lane
    if (c0 == 0) {
      w = rescale(m_mine, m_all) * inv_l;
    } else {
      const int k = c0 + lane;
      w = k < n ? rescale(__ldcg(ml_at(k)), m_all) * inv_l : 0.f;
    }
    const int cnt = min(32, n - c0);
    for (int j0 = 0; j0 < cnt; j0 += BATCH) {
      if (c0 + j0 > 0) load_batch(c0 + j0, min(BATCH, cnt - j0));
#pragma unroll
      for (int j = 0; j < BATCH; ++j) {
        const float wj = __shfl_sync(0xffffffffu, w, (j0 + j) & 31);
        if (j0 + j < cnt) {
#pragma unroll
          for (int e = 0; e < E; ++e) acc[e] = fmaf(wj, v[j][e], acc[e]);
        }
      }
    }
  }
  if constexpr (kPartial) {
    store_merged<T, E, true>(acc, a_out + lane * E);
    if (lane == 0) *reinterpret_cast<float2*>(ml_out) = make_float2(m_all, l_acc);
  } else {
    store_merged<T, E, false>(acc, o + lane * E);
  }
}

// The merge of a row's query head h where O is written: its sink (log2 domain, -inf: none)
// and where its lse goes (null: not asked).
__device__ __forceinline__ float sink_log2_of(const float* sinks, int h) {
  return sinks != nullptr ? sinks[h] * 1.4426950408889634f : -INFINITY;
}
__device__ __forceinline__ float* lse_at(float* lse, int num_qo_heads, int row, int h) {
  return lse != nullptr ? lse + (long long)row * num_qo_heads + h : nullptr;
}

}  // namespace pkv

// Instantiates an extern "C" entry point per (q/out dtype, K/V dtype, head dim, group capacity)
// so cubin symbols are stable: NAME_<dtype><kv>_d<D>_gc<GC> (pkvrt/_buildspec.py symbol()), where
// <kv> is empty for K/V of the q dtype and _e4m3 for FP8 K/V: pkv_split_decode_f16_d128_gc4
// serves G 1..4, _gc8 G 5..8, _gc16 G 9..16, _gc64 (the wide body) G 17..64. M(NAME, TN, T, KN,
// KV, D, GC) defines one entry. e4m3: D 64, 128, 256 (no D 96), and group capacities 16 and 64
// at D <= 128 (at D = 256 the second half of the O^T accumulators would not fit the registers).
#define PKV_FOR_CLASSES(M, NAME, TN, T, KN, KV, D)                                      \
  M(NAME, TN, T, KN, KV, D, 4) M(NAME, TN, T, KN, KV, D, 8) M(NAME, TN, T, KN, KV, D, 16) \
  M(NAME, TN, T, KN, KV, D, 64)
#define PKV_FOR_DIMS_CLASSES(M, NAME, TN, T, KN, KV)                                           \
  PKV_FOR_CLASSES(M, NAME, TN, T, KN, KV, 64) PKV_FOR_CLASSES(M, NAME, TN, T, KN, KV, 96)     \
  PKV_FOR_CLASSES(M, NAME, TN, T, KN, KV, 128) PKV_FOR_CLASSES(M, NAME, TN, T, KN, KV, 256)
#define PKV_FOR_DIMS_CLASSES_E4M3(M, NAME, TN, T, KN, KV)                                      \
  PKV_FOR_CLASSES(M, NAME, TN, T, KN, KV, 64) PKV_FOR_CLASSES(M, NAME, TN, T, KN, KV, 128)    \
  M(NAME, TN, T, KN, KV, 256, 4) M(NAME, TN, T, KN, KV, 256, 8)
#define PKV_INSTANTIATE_DECODE(M, NAME)                                     \
  PKV_FOR_DIMS_CLASSES(M, NAME, f16, __half, , __half)                      \
  PKV_FOR_DIMS_CLASSES(M, NAME, bf16, __nv_bfloat16, , __nv_bfloat16)       \
  PKV_FOR_DIMS_CLASSES_E4M3(M, NAME, f16, __half, _e4m3, pkv::e4m3)         \
  PKV_FOR_DIMS_CLASSES_E4M3(M, NAME, bf16, __nv_bfloat16, _e4m3, pkv::e4m3)
