// split_decode.cu — PersistentKV sequence-split decode (the bucket route).
//
// Computes, for every row of one length bucket, exact GQA decode attention over the native
// block table (decode_common.cuh has the math, layouts and the per-CTA pipeline).
//
// Grid:  blockIdx.x = split (0..num_splits-1), blockIdx.y = KV head, blockIdx.z = bucket row.
//        row_ids[blockIdx.z] is the batch row (Q and O are read/written by that index; -1 marks
//        an idle slot of a padded graph and exits at once).
// Block: 128 threads; dynamic shared memory pkv::smem_bytes<D, GC, KV>() (D = 128: 96 KB; the
//        same for e4m3 K/V).
// Types: q and out T (fp16 / bf16), K/V T or e4m3 with float32 k_scale / v_scale [1] or [H_kv].
// Split ranges are row-local: the row attends to [start, seq_len), start = 0 or, with a sliding
// window (window_left >= 0), seq_len - 1 - window_left when positive; n_tiles =
// ceil((seq_len - start) / 32) and split s owns tiles [s*ceil(n_tiles/S), (s+1)*ceil(n_tiles/S))
// of that range, clipped to the row; a split with no tiles writes the neutral state (m=-inf,
// l=0, a=0) to its slot and returns before touching Q or shared memory.
// num_splits == 1: O is written directly (with the sinks and lse of decode_common.cuh).
// Otherwise the state of (bucket row z, split s) goes to slot z*num_splits + s and merge.cu
// combines the slots.
// Bytes: reads each K and V byte of the row's attended range once: 2 * (seq_len - start) * D *
//        sizeof(KV) bytes per KV head (2 for fp16/bf16, 1 for e4m3).
#include "decode_common.cuh"

template <typename T, typename KV, int D, int GC>
__device__ __forceinline__ void split_decode(const pkv::DecodeParams& p) {
  pkv::pdl_enter();
  const int split = blockIdx.x;
  const int kvh = blockIdx.y;
  const int row = p.row_ids[blockIdx.z];
  if (row < 0) return;
  const int seq_len = p.seq_lens[row];
  const int start = pkv::window_start(seq_len, p.window_left);
  const int S = p.num_splits;
  const int n_tiles = (seq_len - start + pkv::kTileTokens - 1) / pkv::kTileTokens;
  const int tiles_per_split = (n_tiles + S - 1) / S;
  const int begin = start + split * tiles_per_split * pkv::kTileTokens;
  const int end = min(seq_len, begin + tiles_per_split * pkv::kTileTokens);
  const int slot = blockIdx.z * S + split;
  if (begin >= end) {
    if (S > 1) pkv::write_neutral<D>(p, kvh, slot);
    return;
  }
  extern __shared__ uint4 smem[];
  pkv::decode_range<T, KV, D, GC>(p, row, kvh, begin, end, pkv::Sink{S == 1 ? row : -1, slot},
                                  reinterpret_cast<unsigned char*>(smem));
}

#define PKV_SPLIT_ENTRY(NAME, TN, T, KN, KV, D, GC)                                    \
  extern "C" __global__ void __launch_bounds__(pkv::kThreads)                          \
      NAME##_##TN##KN##_d##D##_gc##GC(const __grid_constant__ pkv::DecodeParams p) {   \
    split_decode<T, KV, D, GC>(p);                                                     \
  }
PKV_INSTANTIATE_DECODE(PKV_SPLIT_ENTRY, pkv_split_decode)
