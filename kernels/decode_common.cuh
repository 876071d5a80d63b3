// decode_common.cuh — shared pieces of the PersistentKV decode kernels.
//
// What it computes: for one (row, KV head, token range [tok_begin, tok_end)), the exact
// online-softmax state of the G query heads that share that KV head:
//     x_j = (q_h . k_j) * sm_scale * log2(e)           (scores in the log2 domain)
//     m   = max_j x_j,  l = sum_j 2^(x_j - m),  a = sum_j 2^(x_j - m) v_j   (FP32)
// and either writes O = a / l (one split covers the whole row) or the partial state (m, l, a)
// to a slot that the merge kernel (merge.cu) or the fused kernel combines exactly.
//
// Layouts (elements, not bytes):
//   q            [B, H_q, D]                      contiguous
//   k/v cache    [num_pages, H_kv, page_size, D]  token rows contiguous (stride D); page and
//                                                 head strides are arguments (views allowed)
//   block_tables [B, bt_stride]                   int32 logical page -> physical page
//   seq_lens     [B]                              int32, >= 1
//   out          [B, H_q, D]                      contiguous, dtype of q
//   part_a       [slots, H_q, D]  float32         un-normalised accumulator a
//   part_ml      [slots, H_q, 2]  float32         (m, l)
//
// CTA shape: PKV_THREADS = 128 threads, two bodies (decode_range dispatches on G):
//  * SIMT (G = 1, 2): a token row of D elements is read by LANES = D/8 lanes with one 16-byte
//    access each; the CTA is GROUPS = 128/LANES token groups (D=128: 16 lanes, 8 groups). Group
//    gi owns tokens gi, gi+GROUPS, ... of every 32-token tile (PKV_TILE_TOKENS) and keeps its
//    own (m, l, a) for the G heads in registers. Pipeline: stages<D>() tiles deep (D=128: 4,
//    64 KB); each thread copies exactly the chunks it later consumes, so it waits only on its
//    own cp.async groups and the main loop has no barrier.
//  * Tensor cores (G = 4, 8): each of the 4 warps streams its own 16-token tiles through
//    tc_stages<D>() private stages (D=128: 3, 96 KB per CTA) and computes S = Q K^T and
//    O += P V with mma.sync m16n8k16 (details above decode_range_tc).
// Both combine their per-group / per-warp states once at the end through shared memory
// (finish_groups).
//
// Bytes moved per (row, KV head): 2 * seq_len * D * sizeof(T) of K and V, each byte once, plus
// 4 bytes of block table per page and G*D*sizeof(T) of Q.
#pragma once

#include <cuda_bf16.h>
#include <cuda_fp16.h>
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
#ifndef PKV_SMEM_BYTES
#define PKV_SMEM_BYTES 65536
#endif
#ifndef PKV_TC_MIN_GROUP
#define PKV_TC_MIN_GROUP 1
#endif

namespace pkv {

constexpr int kTileTokens = PKV_TILE_TOKENS;
constexpr int kThreads = PKV_THREADS;
constexpr int kVec = 8;  // elements per 16-byte access

// Two implementations of the per-CTA decode body share one entry point (decode_range):
//  * Tensor cores (G >= PKV_TC_MIN_GROUP): mma.sync m16n8k16 (fp16/bf16 in, FP32 accumulate),
//    the G heads padded to 16 rows. Its instruction count per K/V byte does not depend on G
//    (the padding rows are free), so one body serves every group size.
//  * SIMT (G < PKV_TC_MIN_GROUP): CUDA-core FP32 math; each 16-byte chunk is copied and
//    consumed by one thread. Issue-bound at G = 4 (3.2 TB/s at B8 32K, benches/NOTES.md v1);
//    at the read roofline for G = 1 in isolation, but slower than the tensor-core body in the
//    engine protocol (NOTES.md, "G = 1 on the tensor-core body"). Kept as the ablation
//    (PKVRT_TUNE=PKV_TC_MIN_GROUP=4).
template <int G>
__host__ __device__ constexpr bool use_tensor_cores() { return G >= PKV_TC_MIN_GROUP; }

// SIMT pipeline: as many 32-token K+V tiles as fit PKV_SMEM_BYTES, at least 2.
// D=128: a stage is 32*128*2*2 = 16 KB, 64 KB / 16 KB = 4 stages.
template <int D>
__host__ __device__ constexpr int stages() {
  return (PKV_SMEM_BYTES / (2 * kTileTokens * D * 2)) < 2 ? 2 : (PKV_SMEM_BYTES / (2 * kTileTokens * D * 2));
}

// Tensor-core pipeline: each of the 4 warps streams its own 16-token tiles through
// tc_stages<D>() private stages (K and V, 16 x D each): D=128: 3 * 4 * 8 KB = 96 KB per CTA.
constexpr int kWarps = kThreads / 32;
constexpr int kTcTile = 16;
template <int D>
__host__ __device__ constexpr int tc_stages() { return D >= 256 ? 2 : PKV_TC_STAGES; }

template <int D, int G>
__host__ __device__ constexpr int smem_bytes() {
  return use_tensor_cores<G>() ? tc_stages<D>() * kWarps * 2 * kTcTile * D * 2
                               : stages<D>() * 2 * kTileTokens * D * 2;
}

// Everything a decode kernel reads, passed by value as one __grid_constant__ parameter.
// The Python side (pkvrt/ops.py) mirrors this struct field by field; keep them in sync.
struct DecodeParams {
  const void* q;              // [B, H_q, D]
  const void* k_cache;        // [num_pages, H_kv, page_size, D]
  const void* v_cache;        // same layout as k_cache
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
  long long k_head_stride;    // elements between KV heads inside a page of k_cache
  long long v_page_stride;
  long long v_head_stride;
  int num_qo_heads;
  int num_kv_heads;
  int page_size_log2;
  int bt_stride;              // elements between rows of block_tables
  int num_splits;             // split decode: splits per row (gridDim.x)
  float sm_scale_log2;        // softmax scale * log2(e)
  int early_kv;               // workqueue: 1 = copy the first K/V tiles before pdl_enter (below)
  unsigned long long* trace;  // workqueue: null, or [grid, 3] %globaltimer marks (trace_mark)
};

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
// sm_90+ (pkvrt/_driver.py; PKVRT_PDL=0 turns it off): such a kernel may be scheduled while the
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

// ---- timeline marks (benches/layer_timeline.py) -------------------------------------------
//
// With a non-null trace buffer [grid, 3] (uint64), thread 0 of a working CTA writes %globaltimer
// (ns) at its entry (0), when its PDL wait returned (1) and at its end (2). Null costs one
// predicated branch per mark.
enum TraceMark { kEnter = 0, kWaited = 1, kDone = 2 };
__device__ __forceinline__ void trace_mark(unsigned long long* trace, int mark) {
  if (trace != nullptr && threadIdx.x == 0) {
    unsigned long long t;
    asm volatile("mov.u64 %0, %%globaltimer;" : "=l"(t));
    const unsigned cta = blockIdx.x + gridDim.x * (blockIdx.y + gridDim.y * blockIdx.z);
    trace[3ull * cta + mark] = t;
  }
}

// The kDone mark of a CTA whose warps finish independently (no barrier: some may have left):
// each warp's lane 0 raises it to its own end time (the buffer starts zeroed).
__device__ __forceinline__ void trace_warp_done(unsigned long long* trace) {
  if (trace != nullptr && threadIdx.x % 32 == 0) {
    unsigned long long t;
    asm volatile("mov.u64 %0, %%globaltimer;" : "=l"(t));
    const unsigned cta = blockIdx.x + gridDim.x * (blockIdx.y + gridDim.y * blockIdx.z);
    atomicMax(trace + 3ull * cta + kDone, t);
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
template <int D, int G>
__device__ __forceinline__ void write_neutral(const DecodeParams& p, int kvh, int slot) {
  const int h0 = kvh * G;
  float* a = p.part_a + ((long long)slot * p.num_qo_heads + h0) * D;
  for (int i = threadIdx.x; i < G * D; i += kThreads) a[i] = 0.f;
  if (threadIdx.x < G) {
    float* ml = p.part_ml + ((long long)slot * p.num_qo_heads + h0 + threadIdx.x) * 2;
    ml[0] = -INFINITY;
    ml[1] = 0.f;
  }
}

// Combines NG per-group states staged in shared memory (sm_acc [NG][G][D], sm_ml [NG][G][2],
// written before a __syncthreads) into O (sink.out_row >= 0) or one partial-state slot.
// Each thread finishes 8 consecutive outputs of one head.
template <typename T, int D, int G, int NG>
__device__ __forceinline__ void finish_groups(const DecodeParams& p, const float* sm_acc,
                                              const float* sm_ml, int h0, Sink sink) {
  constexpr int LANES = D / kVec;
  for (int idx = threadIdx.x; idx < G * LANES; idx += kThreads) {
    const int g = idx / LANES;
    const int d0 = (idx % LANES) * kVec;
    float m_all = -INFINITY;
#pragma unroll 4
    for (int gi = 0; gi < NG; ++gi) m_all = fmaxf(m_all, sm_ml[(gi * G + g) * 2]);
    float l_all = 0.f, a[kVec];
#pragma unroll
    for (int e = 0; e < kVec; ++e) a[e] = 0.f;
#pragma unroll 4
    for (int gi = 0; gi < NG; ++gi) {
      const float w = rescale(sm_ml[(gi * G + g) * 2], m_all);
      l_all += w * sm_ml[(gi * G + g) * 2 + 1];
      const float* src = sm_acc + (gi * G + g) * D + d0;
#pragma unroll
      for (int e = 0; e < kVec; ++e) a[e] = fmaf(w, src[e], a[e]);
    }
    const int h = h0 + g;
    if (sink.out_row >= 0) {
      const float inv = 1.f / l_all;
#pragma unroll
      for (int e = 0; e < kVec; ++e) a[e] *= inv;
      T* o = static_cast<T*>(p.out) + ((long long)sink.out_row * p.num_qo_heads + h) * D + d0;
      *reinterpret_cast<uint4*>(o) = from_float8(a, T());
    } else {
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

// ---- SIMT body (G = 1, 2) ------------------------------------------------------------------

template <typename T, int D, int G>
__device__ __forceinline__ void decode_range_simt(const DecodeParams& p, int row, int kvh,
                                                  int tok_begin, int tok_end, Sink sink,
                                                  unsigned char* smem) {
  constexpr int LANES = D / kVec;            // lanes per token row
  constexpr int GROUPS = kThreads / LANES;   // token groups per CTA
  constexpr int TPG = kTileTokens / GROUPS;  // tokens per group per tile
  constexpr int STAGES = stages<D>();
  static_assert(D % kVec == 0 && kThreads % LANES == 0 && kTileTokens % GROUPS == 0, "shape");
  static_assert(GROUPS * G * (D + 2) * 4 <= smem_bytes<D, G>(), "group merge must fit in smem");

  const int lane = threadIdx.x % LANES;
  const int grp = threadIdx.x / LANES;
  const int h0 = kvh * G;
  if (p.early_kv) {  // this body copies nothing early: wait before touching Q
    pdl_enter();
    trace_mark(p.trace, kWaited);
  }

  // Q: this lane's 8 elements of each of the G heads, pre-scaled into the log2 domain.
  float q[G][kVec];
  {
    const T* qrow = static_cast<const T*>(p.q) + ((long long)row * p.num_qo_heads + h0) * D;
#pragma unroll
    for (int g = 0; g < G; ++g) {
      uint4 raw = *reinterpret_cast<const uint4*>(qrow + g * D + lane * kVec);
      to_float8(raw, q[g], T());
#pragma unroll
      for (int i = 0; i < kVec; ++i) q[g][i] *= p.sm_scale_log2;
    }
  }

  // Stage s holds K then V of one tile: [kTileTokens][D] each.
  T* stage_base = reinterpret_cast<T*>(smem);
  const T* kc = static_cast<const T*>(p.k_cache);
  const T* vc = static_cast<const T*>(p.v_cache);
  const int* bt = p.block_tables + (long long)row * p.bt_stride;
  const int pmask = (1 << p.page_size_log2) - 1;
  const int num_tiles = (tok_end - tok_begin + kTileTokens - 1) / kTileTokens;

  // Copy this thread's chunks of tile `t` into stage `t % STAGES` (tokens past tok_end skipped).
  auto issue = [&](int t) {
    T* ks = stage_base + (t % STAGES) * 2 * kTileTokens * D;
    T* vs = ks + kTileTokens * D;
#pragma unroll
    for (int i = 0; i < TPG; ++i) {
      const int j = grp + i * GROUPS;  // token within the tile
      const int tok = tok_begin + t * kTileTokens + j;
      if (tok < tok_end) {
        const long long page = bt[tok >> p.page_size_log2];
        const int in_page = tok & pmask;
        const T* ksrc = kc + page * p.k_page_stride + kvh * p.k_head_stride + (long long)in_page * D;
        const T* vsrc = vc + page * p.v_page_stride + kvh * p.v_head_stride + (long long)in_page * D;
        cp_async16(ks + j * D + lane * kVec, ksrc + lane * kVec);
        cp_async16(vs + j * D + lane * kVec, vsrc + lane * kVec);
      }
    }
  };

  float m[G], l[G], acc[G][kVec];
#pragma unroll
  for (int g = 0; g < G; ++g) {
    m[g] = -INFINITY;
    l[g] = 0.f;
#pragma unroll
    for (int i = 0; i < kVec; ++i) acc[g][i] = 0.f;
  }

#pragma unroll
  for (int s = 0; s < STAGES - 1; ++s) {
    if (s < num_tiles) issue(s);
    cp_async_commit();
  }

  for (int t = 0; t < num_tiles; ++t) {
    if (t + STAGES - 1 < num_tiles) issue(t + STAGES - 1);
    cp_async_commit();
    cp_async_wait<STAGES - 1>();  // this thread's copies of tile t have landed

    const T* ks = stage_base + (t % STAGES) * 2 * kTileTokens * D;
    const T* vs = ks + kTileTokens * D;
    float x[TPG][G];
    float tile_max[G];
#pragma unroll
    for (int g = 0; g < G; ++g) tile_max[g] = -INFINITY;
#pragma unroll
    for (int i = 0; i < TPG; ++i) {
      const int j = grp + i * GROUPS;
      const bool valid = tok_begin + t * kTileTokens + j < tok_end;
      float kf[kVec];
      to_float8(*reinterpret_cast<const uint4*>(ks + j * D + lane * kVec), kf, T());
#pragma unroll
      for (int g = 0; g < G; ++g) {
        float s = 0.f;
#pragma unroll
        for (int e = 0; e < kVec; ++e) s = fmaf(q[g][e], kf[e], s);
#pragma unroll
        for (int off = LANES / 2; off > 0; off /= 2) s += __shfl_xor_sync(0xffffffffu, s, off);
        x[i][g] = valid ? s : -INFINITY;
        tile_max[g] = fmaxf(tile_max[g], x[i][g]);
      }
    }
#pragma unroll
    for (int g = 0; g < G; ++g) {
      const float m_new = fmaxf(m[g], tile_max[g]);
      const float r = rescale(m[g], m_new);
      m[g] = m_new;
      l[g] *= r;
#pragma unroll
      for (int e = 0; e < kVec; ++e) acc[g][e] *= r;
    }
#pragma unroll
    for (int i = 0; i < TPG; ++i) {
      const int j = grp + i * GROUPS;
      if (tok_begin + t * kTileTokens + j < tok_end) {
        float vf[kVec];
        to_float8(*reinterpret_cast<const uint4*>(vs + j * D + lane * kVec), vf, T());
#pragma unroll
        for (int g = 0; g < G; ++g) {
          const float w = fast_exp2(x[i][g] - m[g]);
          l[g] += w;
#pragma unroll
          for (int e = 0; e < kVec; ++e) acc[g][e] = fmaf(w, vf[e], acc[g][e]);
        }
      }
    }
  }
  cp_async_wait<0>();
  __syncthreads();  // all stages drained: the pipeline smem is reused for the group merge

  float* sm_acc = reinterpret_cast<float*>(smem);
  float* sm_ml = sm_acc + GROUPS * G * D;
#pragma unroll
  for (int g = 0; g < G; ++g) {
    float* dst = sm_acc + (grp * G + g) * D + lane * kVec;
#pragma unroll
    for (int e = 0; e < kVec; ++e) dst[e] = acc[g][e];
    if (lane == 0) {
      sm_ml[(grp * G + g) * 2] = m[g];
      sm_ml[(grp * G + g) * 2 + 1] = l[g];
    }
  }
  __syncthreads();
  finish_groups<T, D, G, GROUPS>(p, sm_acc, sm_ml, h0, sink);
}

// ---- tensor-core body (G = 4, 8) -----------------------------------------------------------
//
// Warp w owns 16-token tiles w, w+4, w+8, ... of the range and keeps its own (m, l, O) for
// the G heads; S = Q K^T and O += P V are mma.sync.m16n8k16 with the G heads as rows 0..G-1
// of the 16-row A operand (rows 8..15 are zero). Per tile and warp: D/16 ldmatrix.x4 of K,
// D/8 mma for S, one online-softmax update (quad shuffles), D/16 ldmatrix.x4.trans of V and
// D/8 mma for O. Shared-memory rows are XOR-swizzled in 16-byte chunks (chunk ^ (token & 7))
// so ldmatrix's 8 row reads hit 8 different bank groups. Tokens past tok_end are zero-filled
// by cp.async (never read from the cache) and masked to -inf before the softmax.

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
__device__ __forceinline__ unsigned pack2(float lo, float hi, __half) {
  __half2 h = __floats2half2_rn(lo, hi);
  return *reinterpret_cast<unsigned*>(&h);
}
__device__ __forceinline__ unsigned pack2(float lo, float hi, __nv_bfloat16) {
  __nv_bfloat162 h = __floats2bfloat162_rn(lo, hi);
  return *reinterpret_cast<unsigned*>(&h);
}

template <typename T, int D, int G>
__device__ __forceinline__ void decode_range_tc(const DecodeParams& p, int row, int kvh,
                                                int tok_begin, int tok_end, Sink sink,
                                                unsigned char* smem) {
  constexpr int STAGES = tc_stages<D>();
  constexpr int CHUNKS = D / kVec;              // 16-byte chunks per token row
  constexpr int KSTEPS = D / 16;                // mma k-steps over the head dim (S = Q K^T)
  constexpr int NT = D / 8;                     // n8 tiles of O
  constexpr int TILE_ELEMS = kTcTile * D;       // one K (or V) tile
  static_assert(G <= 8, "heads beyond 8 would need A rows 8..15");
  static_assert(kWarps * G * (D + 2) * 4 <= smem_bytes<D, G>(), "warp merge must fit in smem");

  const int warp = threadIdx.x / 32, lane = threadIdx.x % 32;
  const int grp = lane / 4, tig = lane % 4;     // mma fragment coordinates
  const int h0 = kvh * G;

  const T* kc = static_cast<const T*>(p.k_cache) + kvh * p.k_head_stride;
  const T* vc = static_cast<const T*>(p.v_cache) + kvh * p.v_head_stride;
  const int* bt = p.block_tables + (long long)row * p.bt_stride;
  const int pmask = (1 << p.page_size_log2) - 1;
  const int num_tiles = (tok_end - tok_begin + kTcTile - 1) / kTcTile;
  const int my_tiles = num_tiles > warp ? (num_tiles - warp + kWarps - 1) / kWarps : 0;
  T* wbase = reinterpret_cast<T*>(smem) + warp * STAGES * 2 * TILE_ELEMS;

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
    T* ks = wbase + (i % STAGES) * 2 * TILE_ELEMS;
    T* vs = ks + TILE_ELEMS;
    // Chunk-major: consecutive lanes copy consecutive 16-byte chunks of one token row, so a
    // warp instruction covers whole rows (D=128: 2 rows = 4 lines of 128 B). A lane-per-row
    // mapping (32 B of 16 rows per instruction) ran at 3.0 TB/s instead of 4.1 (NOTES.md, v3).
#pragma unroll
    for (int j = 0; j < CHUNKS * kTcTile / 32; ++j) {
      const int idx = lane + 32 * j;
      const int t = idx / CHUNKS, c = idx % CHUNKS;  // token of the tile, chunk of its row
      const int tok = tok0 + t;
      const bool valid = tok < tok_end;
      const long long page = __shfl_sync(0xffffffffu, page_here, t);
      const long long in_page = (long long)(tok & pmask) * D + c * kVec;
      const int sc = t * D + (c ^ (t & 7)) * kVec;  // swizzled destination
      cp_async16_zfill(ks + sc, valid ? kc + page * p.k_page_stride + in_page : kc, valid);
      cp_async16_zfill(vs + sc, valid ? vc + page * p.v_page_stride + in_page : vc, valid);
    }
  };

  // Prefill the pipeline. With p.early_kv (workqueue launches after the first of a step, see
  // pkvrt/runtime.py) the copies of tiles that hold only tokens before the row's last one are
  // issued before pdl_enter: they overlap the previous kernel's drain (the previous layer's
  // merge in an engine's step). The plan (tasks, offsets, lengths, block tables) is at least
  // two kernels old then, and K/V of those tokens were written before the step; the last token
  // (appended for this step, possibly by the kernel just before) and Q are read after the wait.
  int filled = 0;
  if (p.early_kv) {
    const int safe_end = p.seq_lens[row] - 1;
    for (; filled < STAGES - 1 && filled < my_tiles; ++filled) {
      if (min(tok_end, tok_begin + (warp + filled * kWarps + 1) * kTcTile) > safe_end) break;
      issue(filled);
      cp_async_commit();
    }
    pdl_enter();
    trace_mark(p.trace, kWaited);
  }
  for (int s = filled; s < STAGES - 1; ++s) {
    if (s < my_tiles) issue(s);
    cp_async_commit();
  }

  // Q as A fragments (row = head grp, k = 2*tig..+1 and +8), zero for rows >= G.
  unsigned qa[KSTEPS][2];
  {
    const T* qh = static_cast<const T*>(p.q) + ((long long)row * p.num_qo_heads + h0 + grp) * D;
#pragma unroll
    for (int kk = 0; kk < KSTEPS; ++kk) {
      qa[kk][0] = grp < G ? *reinterpret_cast<const unsigned*>(qh + kk * 16 + 2 * tig) : 0u;
      qa[kk][1] = grp < G ? *reinterpret_cast<const unsigned*>(qh + kk * 16 + 8 + 2 * tig) : 0u;
    }
  }

  float o[NT][4];
#pragma unroll
  for (int n = 0; n < NT; ++n) o[n][0] = o[n][1] = o[n][2] = o[n][3] = 0.f;
  float m = -INFINITY, l = 0.f;  // row grp of this warp's state (l: this thread's columns)
  for (int i = 0; i < my_tiles; ++i) {
    // The stage refilled below was read (ldmatrix) by every lane in iteration i - 1: order
    // those reads before these writes (compute-sanitizer racecheck flags the bare WAR hazard).
    __syncwarp();
    if (i + STAGES - 1 < my_tiles) issue(i + STAGES - 1);
    cp_async_commit();
    cp_async_wait<STAGES - 1>();
    __syncwarp();  // every lane's copies of tile i are visible to the whole warp

    const T* ks = wbase + (i % STAGES) * 2 * TILE_ELEMS;
    const T* vs = ks + TILE_ELEMS;
    // S = Q K^T for 16 tokens: s[nt] covers tokens nt*8 .. nt*8+7.
    float s[2][4] = {{0.f, 0.f, 0.f, 0.f}, {0.f, 0.f, 0.f, 0.f}};
    {
      const int mat = lane / 8, r = lane % 8;
      const int tok = (mat >> 1) * 8 + r;
#pragma unroll
      for (int kk = 0; kk < KSTEPS; ++kk) {
        unsigned b[4];
        const int c = kk * 2 + (mat & 1);
        ldmatrix_x4(b, ks + tok * D + (c ^ (tok & 7)) * kVec);
        mma16816(s[0], qa[kk][0], qa[kk][1], b[0], b[1], T());
        mma16816(s[1], qa[kk][0], qa[kk][1], b[2], b[3], T());
      }
    }
    // Online softmax on row grp (c0, c1 of each n8 tile); rows 8..15 are padding.
    const int tile_tok = tok_begin + (warp + i * kWarps) * kTcTile;
    float x[4];
#pragma unroll
    for (int nt = 0; nt < 2; ++nt)
#pragma unroll
      for (int e = 0; e < 2; ++e) {
        const bool valid = tile_tok + nt * 8 + 2 * tig + e < tok_end;
        x[nt * 2 + e] = valid ? s[nt][e] * p.sm_scale_log2 : -INFINITY;
      }
    float mx = fmaxf(fmaxf(x[0], x[1]), fmaxf(x[2], x[3]));
    mx = fmaxf(mx, __shfl_xor_sync(0xffffffffu, mx, 1));
    mx = fmaxf(mx, __shfl_xor_sync(0xffffffffu, mx, 2));
    const float m_new = fmaxf(m, mx);
    const float alpha = rescale(m, m_new);
    const float m_use = m_new == -INFINITY ? 0.f : m_new;
    float pr[4];
#pragma unroll
    for (int e = 0; e < 4; ++e) pr[e] = fast_exp2(x[e] - m_use);
    l = l * alpha + (pr[0] + pr[1]) + (pr[2] + pr[3]);
    m = m_new;
#pragma unroll
    for (int n = 0; n < NT; ++n) {
      o[n][0] *= alpha;
      o[n][1] *= alpha;
    }
    // O += P V: P (row grp, tokens 2*tig.. and +8) is the A operand straight from registers.
    const unsigned pa0 = pack2(pr[0], pr[1], T());
    const unsigned pa2 = pack2(pr[2], pr[3], T());
    {
      const int mat = lane / 8, r = lane % 8;
      const int tok = (mat & 1) * 8 + r;
#pragma unroll
      for (int n2 = 0; n2 < NT / 2; ++n2) {
        unsigned b[4];
        const int c = n2 * 2 + (mat >> 1);
        ldmatrix_x4_trans(b, vs + tok * D + (c ^ (tok & 7)) * kVec);
        mma16816(o[2 * n2], pa0, pa2, b[0], b[1], T());
        mma16816(o[2 * n2 + 1], pa0, pa2, b[2], b[3], T());
      }
    }
  }
  cp_async_wait<0>();
  l += __shfl_xor_sync(0xffffffffu, l, 1);
  l += __shfl_xor_sync(0xffffffffu, l, 2);
  __syncthreads();  // every warp's pipeline is drained: reuse its smem for the warp merge

  float* sm_acc = reinterpret_cast<float*>(smem);  // [kWarps][G][D]
  float* sm_ml = sm_acc + kWarps * G * D;          // [kWarps][G][2]
  if (grp < G) {
    float* dst = sm_acc + (warp * G + grp) * D + 2 * tig;
#pragma unroll
    for (int n = 0; n < NT; ++n) *reinterpret_cast<float2*>(dst + n * 8) = make_float2(o[n][0], o[n][1]);
    if (tig == 0) {
      sm_ml[(warp * G + grp) * 2] = m;
      sm_ml[(warp * G + grp) * 2 + 1] = l;
    }
  }
  __syncthreads();
  finish_groups<T, D, G, kWarps>(p, sm_acc, sm_ml, h0, sink);
}

// Attention of the G query heads of (row, kvh) over tokens [tok_begin, tok_end) of the row,
// tok_begin < tok_end <= seq_len. `smem` holds smem_bytes<D, G>() bytes.
template <typename T, int D, int G>
__device__ __forceinline__ void decode_range(const DecodeParams& p, int row, int kvh,
                                             int tok_begin, int tok_end, Sink sink,
                                             unsigned char* smem) {
  if constexpr (use_tensor_cores<G>())
    decode_range_tc<T, D, G>(p, row, kvh, tok_begin, tok_end, sink, smem);
  else
    decode_range_simt<T, D, G>(p, row, kvh, tok_begin, tok_end, sink, smem);
}

// Exact merge of the partial states in slots [slot_begin, slot_end) of query head h into
// O[out_row, h, :] (`o` points at that head's D outputs), executed by one warp; lane owns the
// E = D/32 consecutive outputs lane*E .. lane*E+E-1. Latency, not bandwidth, is its cost (a few
// KB per head, in L2), so it is written to have few dependent round trips to L2:
//  1. lane i loads (m, l) of slots i, i+32, ... and folds them online; a butterfly over the warp
//     gives (m_all, l_all) on every lane: one round trip for up to 32 slots;
//  2. lane i turns slot i's m into its weight 2^(m_i - m_all) / l_all; the accumulators then
//     take batches of BATCH slots whose loads are all issued before the first FMA, the weight
//     of each broadcast from its lane by shuffle: ceil(n / BATCH) round trips, the first of
//     them issued together with step 1's loads.
// The first version looped over the slots three times with one dependent load per iteration:
// 9 us for 16 slots, 28 us for 64 on the H200 (benches/NOTES.md, "The merge was latency-bound").
// Loads bypass L1 (__ldcg): in the fused kernel the slots were written by other CTAs.
template <typename T, int D>
__device__ __forceinline__ void merge_head(const float* part_a, const float* part_ml,
                                           int num_qo_heads, int slot_begin, int slot_end, int h,
                                           T* o, int lane) {
  constexpr int E = D / 32;                  // outputs per lane: 2, 4 or 8
  constexpr int V = E >= 4 ? E / 4 : 1;      // float4 (or one float2 at D=64) loads per slot
  constexpr int BATCH = E >= 8 ? 8 : 16;     // slots in flight per lane (<= 64 registers)
  const int n = slot_end - slot_begin;
  auto ml_at = [&](int s) { return part_ml + ((long long)s * num_qo_heads + h) * 2; };
  float v[BATCH][E];
  auto load_batch = [&](int s0, int cnt) {   // the lane's E outputs of slots s0 .. s0+cnt-1
#pragma unroll
    for (int j = 0; j < BATCH; ++j) {
      if (j < cnt) {
        const float* src = part_a + ((long long)(s0 + j) * num_qo_heads + h) * D + lane * E;
        if constexpr (E == 2) {
          const float2 x = __ldcg(reinterpret_cast<const float2*>(src));
          v[j][0] = x.x;
          v[j][1] = x.y;
        } else {
#pragma unroll
          for (int q = 0; q < V; ++q) {
            const float4 x = __ldcg(reinterpret_cast<const float4*>(src) + q);
            v[j][4 * q] = x.x;
            v[j][4 * q + 1] = x.y;
            v[j][4 * q + 2] = x.z;
            v[j][4 * q + 3] = x.w;
          }
        }
      }
    }
  };

  // The first batch of accumulators is loaded with the (m, l) of step 1: one round trip for
  // both when the row has at most BATCH slots (16 at D <= 128), the common case.
  load_batch(slot_begin, min(BATCH, n));

  // 1. (m_all, l_all), with lane's own slot of the first 32 kept for its weight.
  float m_mine = -INFINITY, l_acc = 0.f;
  if (lane < n) {
    m_mine = __ldcg(ml_at(slot_begin + lane));
    l_acc = __ldcg(ml_at(slot_begin + lane) + 1);
  }
  float m_acc = m_mine;
  for (int s = slot_begin + lane + 32; s < slot_end; s += 32) {
    const float ms = __ldcg(ml_at(s)), ls = __ldcg(ml_at(s) + 1);
    const float m_new = fmaxf(m_acc, ms);
    l_acc = l_acc * rescale(m_acc, m_new) + ls * rescale(ms, m_new);
    m_acc = m_new;
  }
#pragma unroll
  for (int off = 16; off > 0; off >>= 1) {
    const float mo = __shfl_xor_sync(0xffffffffu, m_acc, off);
    const float lo = __shfl_xor_sync(0xffffffffu, l_acc, off);
    const float m_new = fmaxf(m_acc, mo);
    l_acc = l_acc * rescale(m_acc, m_new) + lo * rescale(mo, m_new);
    m_acc = m_new;
  }
  const float m_all = m_acc, inv_l = 1.f / l_acc;

  // 2. sum_s w_s a_s over the lane's E outputs.
  float acc[E];
#pragma unroll
  for (int e = 0; e < E; ++e) acc[e] = 0.f;
  for (int c0 = 0; c0 < n; c0 += 32) {
    float w;  // weight of slot slot_begin + c0 + lane
    if (c0 == 0) {
      w = rescale(m_mine, m_all) * inv_l;
    } else {
      const int s = slot_begin + c0 + lane;
      w = s < slot_end ? rescale(__ldcg(ml_at(s)), m_all) * inv_l : 0.f;
    }
    const int cnt = min(32, n - c0);
    for (int j0 = 0; j0 < cnt; j0 += BATCH) {
      if (c0 + j0 > 0) load_batch(slot_begin + c0 + j0, min(BATCH, cnt - j0));
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
  float f[8] = {0.f, 0.f, 0.f, 0.f, 0.f, 0.f, 0.f, 0.f};
#pragma unroll
  for (int e = 0; e < E; ++e) f[e] = acc[e];
  const uint4 raw = from_float8(f, T());
  T* dst = o + lane * E;
  if constexpr (E == 8) *reinterpret_cast<uint4*>(dst) = raw;
  else if constexpr (E == 4) *reinterpret_cast<uint2*>(dst) = make_uint2(raw.x, raw.y);
  else *reinterpret_cast<unsigned*>(dst) = raw.x;
}

}  // namespace pkv

// Instantiates an extern "C" entry point per (dtype, head dim, group size) so cubin symbols
// are stable: NAME_<dtype>_d<D>_g<G>, e.g. pkv_split_decode_f16_d128_g4.
#define PKV_FOR_GROUPS(M, NAME, TN, T, D) \
  M(NAME, TN, T, D, 1) M(NAME, TN, T, D, 2) M(NAME, TN, T, D, 4) M(NAME, TN, T, D, 8)
#define PKV_FOR_DIMS_GROUPS(M, NAME, TN, T) \
  PKV_FOR_GROUPS(M, NAME, TN, T, 64) PKV_FOR_GROUPS(M, NAME, TN, T, 128) PKV_FOR_GROUPS(M, NAME, TN, T, 256)
#define PKV_INSTANTIATE_DECODE(M, NAME) \
  PKV_FOR_DIMS_GROUPS(M, NAME, f16, __half) PKV_FOR_DIMS_GROUPS(M, NAME, bf16, __nv_bfloat16)
