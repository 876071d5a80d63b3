"""FlashInfer's own decode-wrapper tests, ported to ``pkvrt.BatchDecodeWithPagedKVCacheWrapper``
(run on the H200): their parameters, their data construction and their assertions
(``torch.testing.assert_close(o[i], single_decode_with_kv_cache(...), rtol=1e-3, atol=1e-3)``),
from FlashInfer 0.7's tests/attention/test_batch_decode_kernels.py: the paged decode with
``return_lse``, the same with a tuple cache, a user-allocated output, non-contiguous caches, and
the CUDA-graph test (warm-up on a side stream, capture, re-plan, replay). FlashInfer's large
products are cut to pairwise-covering subsets so the file runs in about a minute. RoPE
(``pos_encoding_mode="ROPE_LLAMA"``) runs FlashInfer's own wrapper behind the drop-in (pkvrt
applies no RoPE inside attention), so those cases check the fallback. One deliberate
difference: FlashInfer's CUDA-core decode refuses K and V pools of different strides; pkvrt's
kernels take each cache's strides, so the drop-in serves them (checked against the reference)."""

from __future__ import annotations

import itertools

import pytest
import torch

import pkvrt

pytestmark = pytest.mark.gpu
flashinfer = pytest.importorskip("flashinfer")

def _fp32_gib(batch_size, kv_len, page_size, num_qo_heads, head_dim, kv_dtype, pos, contiguous):
    """GiB of make_kv's FP32 cache (4 KV heads; a non-contiguous one is 16 times larger)."""
    pages = -(-kv_len // page_size) * batch_size
    return pages * page_size * 2 * 4 * head_dim * 4 * (1 if contiguous else 16) / 2**30


DECODE_CASES = [   # (batch_size, kv_len, page_size, num_qo_heads, head_dim, kv_dtype, pos, contiguous)
    # every 23rd of the product of FlashInfer's values (every value of every parameter), less the
    # two whose test data outgrows one GPU (FP32 caches of 256 GiB); those over 2 GiB run alone
    pytest.param(*c, marks=[pytest.mark.serial] if _fp32_gib(*c) > 2 else [])
    for i, c in enumerate(itertools.product(
        [12, 17, 128], [54, 97, 512, 2048, 16384], [1, 8, 16], [4, 32], [128, 256],
        [torch.float16, torch.float8_e4m3fn], ["NONE", "ROPE_LLAMA"], [True, False]))
    if i % 23 == 0 and _fp32_gib(*c) <= 64]


def make_kv(batch_size, kv_len, page_size, num_kv_heads, head_dim, kv_layout, kv_dtype, contiguous):
    """FlashInfer's test data: sequential pages, a combined [pages, 2, ...] cache, optionally
    non-contiguous (every dimension's stride doubled)."""
    num_pages_per_seq = (kv_len + page_size - 1) // page_size
    total = num_pages_per_seq * batch_size
    shape = ([total, 2, num_kv_heads, page_size, head_dim] if kv_layout == "HND"
             else [total, 2, page_size, num_kv_heads, head_dim])
    if not contiguous:
        tmp = [shape[0]]
        for v in shape[1:]:
            tmp += [2, v]
        fp32 = torch.randn(*tmp, dtype=torch.float32, device="cuda:0")
        data = fp32.to(kv_dtype)[:, 1, :, 1, :, 1, :, 1, :]
        fp32 = fp32[:, 1, :, 1, :, 1, :, 1, :]
    else:
        fp32 = torch.randn(*shape, dtype=torch.float32, device="cuda:0")
        data = fp32.to(kv_dtype)
    indptr = torch.arange(0, batch_size + 1, device="cuda:0", dtype=torch.int32) * num_pages_per_seq
    indices = torch.arange(0, total, device="cuda:0", dtype=torch.int32)
    last = torch.full((batch_size,), (kv_len - 1) % page_size + 1, dtype=torch.int32, device="cuda:0")
    return fp32, data, indptr, indices, last


def reference(q, fp32, indptr, last, i, num_kv_heads, head_dim, kv_layout, kv_dtype, pos="NONE",
              soft_cap=0.0):
    """FlashInfer's per-row reference: the row's tokens gathered, single_decode_with_kv_cache."""
    perm = [0, 2, 1, 3] if kv_layout == "HND" else [0, 1, 2, 3]
    perm_last = [1, 0, 2] if kv_layout == "HND" else [0, 1, 2]

    def rows(which):
        last_page = (fp32[indptr[i + 1] - 1, which, :, :last[i]] if kv_layout == "HND"
                     else fp32[indptr[i + 1] - 1, which, :last[i], :])
        return torch.cat([fp32[indptr[i]:indptr[i + 1] - 1, which].permute(*perm).reshape(-1, num_kv_heads, head_dim),
                          last_page.permute(*perm_last).reshape(-1, num_kv_heads, head_dim)]).to(kv_dtype)
    return flashinfer.decode.single_decode_with_kv_cache(q[i], rows(0), rows(1), pos_encoding_mode=pos,
                                                         logits_soft_cap=soft_cap)


@pytest.mark.parametrize("tuple_cache", [False, True], ids=["one tensor", "tuple"])
@pytest.mark.parametrize("batch_size, kv_len, page_size, num_qo_heads, head_dim, kv_dtype, pos, contiguous",
                         DECODE_CASES)
def test_batch_decode_with_paged_kv_cache(batch_size, kv_len, page_size, num_qo_heads, head_dim,
                                          kv_dtype, pos, contiguous, tuple_cache):
    num_kv_heads, kv_layout, q_dtype = 4, "NHD", torch.float16
    q = torch.randn(batch_size, num_qo_heads, head_dim, device="cuda:0", dtype=q_dtype)
    fp32, data, indptr, indices, last = make_kv(batch_size, kv_len, page_size, num_kv_heads, head_dim,
                                                kv_layout, kv_dtype, contiguous)
    cache = (data[:, 0], data[:, 1]) if tuple_cache else data
    ws = torch.empty(32 * 1024 * 1024, dtype=torch.int8, device="cuda:0")
    w = pkvrt.BatchDecodeWithPagedKVCacheWrapper(ws, kv_layout)
    w.plan(indptr, indices, last, num_qo_heads, num_kv_heads, head_dim, page_size,
           logits_soft_cap=0.0, pos_encoding_mode=pos, data_type=kv_dtype, q_data_type=q_dtype)
    assert (w.fallback_reason is None) == (pos == "NONE"), w.fallback_reason
    o, lse = w.run(q, cache, return_lse=True)
    assert lse.shape == (batch_size, num_qo_heads) and torch.isfinite(lse).all()
    for i in range(batch_size):
        ref = reference(q, fp32, indptr, last, i, num_kv_heads, head_dim, kv_layout, kv_dtype, pos)
        torch.testing.assert_close(o[i], ref, rtol=1e-3, atol=1e-3)
    o_buffer = torch.empty_like(o)          # user-allocated output
    w.run(q, cache, out=o_buffer)
    torch.testing.assert_close(o, o_buffer, rtol=1e-3, atol=1e-3)


@pytest.mark.parametrize("batch_size, kv_len, page_size, num_qo_heads, head_dim, kv_dtype, layout", [
    (12, 2048, 8, 32, 128, torch.float16, "NHD"),
    (128, 54, 8, 4, 128, torch.float16, "NHD"),
    (12, 54, 8, 32, 128, torch.float8_e4m3fn, "HND"),
    (17, 16384, 16, 32, 256, torch.float16, "NHD"),
    (12, 512, 1, 4, 128, torch.float16, "HND"),
])
def test_cuda_graph_batch_decode_with_paged_kv_cache(batch_size, kv_len, page_size, num_qo_heads,
                                                     head_dim, kv_dtype, layout):
    """FlashInfer's CUDA-graph test: plan a one-page warm-up, run 3 times on a side stream,
    capture run(), then plan other lengths and replay; the last replay is checked."""
    num_kv_heads, q_dtype = 4, torch.float16
    q = torch.randn(batch_size, num_qo_heads, head_dim, device="cuda:0", dtype=q_dtype)
    fp32, data, _, _, _ = make_kv(batch_size, kv_len, page_size, num_kv_heads, head_dim, layout,
                                  kv_dtype, True)
    num_pages_per_seq = (kv_len + page_size - 1) // page_size
    total = num_pages_per_seq * batch_size
    bufs = dict(paged_kv_indptr_buffer=torch.empty(batch_size + 1, device="cuda:0", dtype=torch.int32),
                paged_kv_indices_buffer=torch.empty(total, device="cuda:0", dtype=torch.int32),
                paged_kv_last_page_len_buffer=torch.empty(batch_size, device="cuda:0", dtype=torch.int32))
    ws = torch.empty(128 * 1024 * 1024, dtype=torch.int8, device="cuda:0")
    w = pkvrt.BatchDecodeWithPagedKVCacheWrapper(ws, layout, use_cuda_graph=True, **bufs)

    def plan(indptr, indices, last):
        w.plan(indptr, indices, last, num_qo_heads, num_kv_heads, head_dim, page_size,
               data_type=kv_dtype, q_data_type=q_dtype)
    plan(torch.arange(0, batch_size + 1, device="cuda:0", dtype=torch.int32),
         torch.arange(0, batch_size, device="cuda:0", dtype=torch.int32),
         torch.full((batch_size,), page_size, dtype=torch.int32))
    s = torch.cuda.Stream()
    s.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(s):
        for _ in range(3):
            o = w.run(q, data)
    torch.cuda.current_stream().wait_stream(s)
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        o = w.run(q, data)
    for i in range(1, min(4, num_pages_per_seq)):
        plan(torch.arange(0, batch_size + 1).int() * i, torch.arange(0, i * batch_size).int(),
             torch.full((batch_size,), page_size, dtype=torch.int32))
        g.replay()
    indptr = torch.arange(0, batch_size + 1).int() * num_pages_per_seq
    last = torch.full((batch_size,), (kv_len - 1) % page_size + 1, dtype=torch.int32)
    plan(indptr, torch.arange(0, total).int(), last)
    g.replay()
    torch.cuda.synchronize()
    for i in range(batch_size):
        ref = reference(q, fp32, indptr, last, i, num_kv_heads, head_dim, layout, kv_dtype)
        torch.testing.assert_close(o[i], ref, rtol=1e-3, atol=1e-3)


@pytest.mark.parametrize("pad_v", [1, 2], ids=["equal strides", "unequal strides"])
def test_k_and_v_pools_with_their_own_strides(pad_v):
    """FlashInfer's stride test: K and V pools padded in their head dimension. Equal padding is
    its positive control; unequal padding FlashInfer's CUDA-core decode refuses, and pkvrt
    serves (each cache's own strides)."""
    torch.manual_seed(42)
    batch_size, kv_len, page_size, num_kv_heads, num_qo_heads, head_dim = 4, 54, 8, 4, 4, 128
    dtype = torch.float16
    q = torch.randn(batch_size, num_qo_heads, head_dim, device="cuda:0", dtype=dtype)
    num_pages_per_seq = (kv_len + page_size - 1) // page_size
    total = num_pages_per_seq * batch_size
    indptr = torch.arange(0, batch_size + 1, device="cuda:0", dtype=torch.int32) * num_pages_per_seq
    indices = torch.arange(0, total, device="cuda:0", dtype=torch.int32)
    last = torch.full((batch_size,), (kv_len - 1) % page_size + 1, dtype=torch.int32, device="cuda:0")

    def padded_pool(pad):
        return torch.randn(total, page_size, num_kv_heads + pad, head_dim, device="cuda:0",
                           dtype=dtype)[:, :, :num_kv_heads, :]
    k, v = padded_pool(1), padded_pool(pad_v)
    ws = torch.empty(32 * 1024 * 1024, dtype=torch.int8, device="cuda:0")
    w = pkvrt.BatchDecodeWithPagedKVCacheWrapper(ws, "NHD")
    w.plan(indptr, indices, last, num_qo_heads, num_kv_heads, head_dim, page_size,
           pos_encoding_mode="NONE", q_data_type=dtype, kv_data_type=dtype)
    o = w.run(q, (k, v))
    ip, lp = indptr.cpu(), last.cpu()
    for i in range(batch_size):
        ki = torch.cat([k[ip[i]:ip[i + 1] - 1].reshape(-1, num_kv_heads, head_dim),
                        k[ip[i + 1] - 1, :lp[i]].reshape(-1, num_kv_heads, head_dim)])
        vi = torch.cat([v[ip[i]:ip[i + 1] - 1].reshape(-1, num_kv_heads, head_dim),
                        v[ip[i + 1] - 1, :lp[i]].reshape(-1, num_kv_heads, head_dim)])
        ref = flashinfer.decode.single_decode_with_kv_cache(q[i], ki, vi, pos_encoding_mode="NONE",
                                                            logits_soft_cap=0.0)
        torch.testing.assert_close(o[i], ref, rtol=1e-3, atol=1e-3)


def test_lse_is_flashinfers():
    """The drop-in's lse equals FlashInfer's wrapper's (the base-2 convention) on the same plan."""
    b, kv_len, page, hkv, hq, d = 12, 2048, 16, 4, 32, 128
    q = torch.randn(b, hq, d, device="cuda:0", dtype=torch.float16)
    fp32, data, indptr, indices, last = make_kv(b, kv_len, page, hkv, d, "NHD", torch.float16, True)
    ws = torch.zeros(128 * 1024 * 1024, dtype=torch.int8, device="cuda:0")
    ours = pkvrt.BatchDecodeWithPagedKVCacheWrapper(ws, "NHD")
    theirs = flashinfer.BatchDecodeWithPagedKVCacheWrapper(torch.zeros_like(ws), "NHD", use_tensor_cores=True)
    for w in (ours, theirs):
        w.plan(indptr, indices, last, hq, hkv, d, page, q_data_type=torch.float16)
    o1, l1 = ours.run(q, data, return_lse=True)
    o2, l2 = theirs.run(q, data, return_lse=True)
    torch.testing.assert_close(o1, o2, rtol=1e-3, atol=1e-3)
    torch.testing.assert_close(l1, l2, rtol=1e-3, atol=1e-3)


@pytest.mark.parametrize("pos", ["NONE", "ROPE_LLAMA"])
def test_lse_spellings_and_the_cuda_graph_class_match_flashinfers(pos):
    """forward_return_lse and run_return_lse of the drop-in against FlashInfer's wrapper called
    the same way (pkvrt's kernels, or with RoPE FlashInfer's wrapper behind the drop-in), and
    CUDAGraphBatchDecodeWithPagedKVCacheWrapper against FlashInfer's class of that name."""
    batch_size, kv_len, page_size, num_qo_heads, num_kv_heads, head_dim = 5, 700, 16, 32, 4, 128
    q = torch.randn(batch_size, num_qo_heads, head_dim, device="cuda:0", dtype=torch.float16)
    _, data, indptr, indices, last = make_kv(batch_size, kv_len, page_size, num_kv_heads, head_dim,
                                             "NHD", torch.float16, True)
    args = (indptr, indices, last, num_qo_heads, num_kv_heads, head_dim, page_size)
    got, want = [], []
    for mod, out in ((pkvrt, got), (flashinfer, want)):
        w = mod.BatchDecodeWithPagedKVCacheWrapper(
            torch.empty(32 * 1024 * 1024, dtype=torch.int8, device="cuda:0"), "NHD")
        w.plan(*args, pos_encoding_mode=pos, q_data_type=torch.float16)
        out += [w.run_return_lse(q, data), w.forward_return_lse(q, data, pos_encoding_mode=pos, sm_scale=0.07)]
        bufs = (torch.empty(batch_size + 1, dtype=torch.int32, device="cuda:0"),
                torch.empty(indices.numel(), dtype=torch.int32, device="cuda:0"),
                torch.empty(batch_size, dtype=torch.int32, device="cuda:0"))
        g = mod.CUDAGraphBatchDecodeWithPagedKVCacheWrapper(
            torch.empty(32 * 1024 * 1024, dtype=torch.int8, device="cuda:0"), *bufs, "NHD")
        g.plan(indptr.cpu(), indices, last, num_qo_heads, num_kv_heads, head_dim, page_size,
               pos_encoding_mode=pos, q_data_type=torch.float16)
        out.append((g.run(q, data), None))
    for (o, lse), (o_ref, lse_ref) in zip(got, want):
        torch.testing.assert_close(o, o_ref, rtol=1e-3, atol=1e-3)
        if lse is not None:
            torch.testing.assert_close(lse, lse_ref, rtol=1e-3, atol=1e-3)
