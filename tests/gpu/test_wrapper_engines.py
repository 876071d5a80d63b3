"""The drop-in called as the engines call FlashInfer's decode wrapper (docs/engines.md), on the
GPU, against the FP32 reference: SGLang (NHD token slots of page size 1 as 3-D K/V,
begin_forward with data_type=, indices written into _paged_kv_indices_buf, forward() with the
layer's scale and soft cap, the fast_decode_plan replacement after capture, CUDA-graph replays)
and vLLM (NHD blocks of 64 with K and V packed in one tensor's last dimension, plan() by keyword
with fixed_split_size=-1, the asserted private attributes, a strided q, CUDA-graph replays)."""

from __future__ import annotations

import functools

import numpy as np
import pytest
import torch

import pkvrt
from pkvrt import reference

pytestmark = pytest.mark.gpu
if not torch.cuda.is_available():
    pytest.skip("needs a CUDA GPU", allow_module_level=True)

HQ, HKV, D = 32, 8, 128
TOL = 2e-3


def rel(out, ref) -> float:
    return float((out.float() - ref).norm() / ref.norm())


def pool(num_pages, page, seed):
    g = torch.Generator(device="cuda").manual_seed(seed)
    k = torch.randn(num_pages, page, HKV, D, device="cuda", generator=g).half()   # NHD
    v = torch.randn(num_pages, page, HKV, D, device="cuda", generator=g).half()
    return k, v


def csr(lens, page, num_pages, seed):
    rng = np.random.default_rng(seed)
    pages = [-(-n // page) for n in lens]
    perm = rng.permutation(num_pages)[:sum(pages)].astype(np.int32)
    indptr = np.concatenate([[0], np.cumsum(pages)]).astype(np.int32)
    last = np.array([n - (p - 1) * page for n, p in zip(lens, pages)], np.int32)
    bt = np.zeros((len(lens), max(pages)), np.int32)
    for r, p in enumerate(pages):
        bt[r, :p] = perm[indptr[r]:indptr[r + 1]]
    return indptr, perm, last, bt


def ref_of(q, k, v, lens, bt, **kw):
    return reference.decode_attention(q, k.transpose(1, 2), v.transpose(1, 2),
                                      torch.as_tensor(np.array(lens, np.int32), device="cuda"),
                                      torch.as_tensor(bt, device="cuda"), **kw)


def test_sglang_calls():
    """Page size 1, 3-D K/V, CUDA-graph mode: warm-up and capture of forward(), then the
    fast_decode_plan replacement planning each replay with new lengths."""
    lens0 = [900, 2000, 333, 4096]
    slots = 16384
    k4, v4 = pool(slots, 1, 1)
    k3, v3 = k4[:, 0], v4[:, 0]                                     # [slots, H_kv, D]
    b = len(lens0)
    bufs = dict(paged_kv_indptr_buffer=torch.zeros(b + 1, dtype=torch.int32, device="cuda"),
                paged_kv_indices_buffer=torch.zeros(slots, dtype=torch.int32, device="cuda"),
                paged_kv_last_page_len_buffer=torch.ones(b, dtype=torch.int32, device="cuda"))
    ws = torch.empty(128 << 20, dtype=torch.uint8, device="cuda")
    w = pkvrt.BatchDecodeWithPagedKVCacheWrapper(ws, "NHD", use_cuda_graph=True, backend="fa2",
                                                 use_tensor_cores=True, **bufs)
    indptr, ind, last, bt = csr(lens0, 1, slots, 2)
    scale, cap = D ** -0.5, 30.0
    q = torch.randn(b, HQ, D, device="cuda").half()
    out = torch.empty_like(q)

    def plan(indptr, ind):
        w._paged_kv_indices_buf[:len(ind)].copy_(torch.as_tensor(ind, device="cuda"))
        w.begin_forward(torch.as_tensor(indptr, device="cuda"), w._paged_kv_indices_buf[:len(ind)],
                        bufs["paged_kv_last_page_len_buffer"], HQ, HKV, D, 1, data_type=torch.float16,
                        q_data_type=torch.float16, non_blocking=True)

    def layer():
        out.copy_(w.forward(q, (k3, v3), sm_scale=scale, logits_soft_cap=cap, k_scale=None, v_scale=None))

    plan(indptr, ind)
    layer()                                                          # warm-up: the cap re-plans once
    assert rel(out, ref_of(q, k4, v4, lens0, bt, sm_scale=scale, logits_soft_cap=cap)) < TOL
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        layer()
    w.begin_forward = functools.partial(pkvrt_fast_decode_plan_stand_in, w)   # SGLang's swap
    for grow in (5, 17, 40):
        lens = [n + grow for n in lens0]
        indptr, ind, _, bt = csr(lens, 1, slots, 3 + grow)
        plan(indptr, ind)
        g.replay()
        assert rel(out, ref_of(q, k4, v4, lens, bt, sm_scale=scale, logits_soft_cap=cap)) < TOL, grow
    assert w.fallback_reason is None


def pkvrt_fast_decode_plan_stand_in(wrapper, *args, **kwargs):   # the name SGLang's partial binds
    raise AssertionError("the drop-in keeps its own plan(): this must never run")


pkvrt_fast_decode_plan_stand_in.__name__ = "fast_decode_plan"


def test_vllm_calls():
    """Blocks of 64, K/V packed in the last dimension, keyword plan with fixed_split_size=-1,
    the attributes vLLM asserts, vllm_first_call, a strided q, CUDA-graph replays."""
    page, num_pages = 64, 512
    kv = torch.randn(num_pages, page, HKV, 2 * D, device="cuda").half()
    k, v = kv[..., :D], kv[..., D:]
    lens0 = [700, 5000, 64, 1500, 9000, 130]
    b = len(lens0)
    bufs = dict(paged_kv_indptr_buffer=torch.zeros(b + 1, dtype=torch.int32, device="cuda"),
                paged_kv_indices_buffer=torch.zeros(num_pages, dtype=torch.int32, device="cuda"),
                paged_kv_last_page_len_buffer=torch.zeros(b, dtype=torch.int32, device="cuda"))
    ws = torch.empty(128 << 20, dtype=torch.uint8, device="cuda")
    w = pkvrt.BatchDecodeWithPagedKVCacheWrapper(ws, "NHD", use_cuda_graph=True, use_tensor_cores=True,
                                                 backend="auto", **bufs)
    qkv = torch.randn(b, HQ + 2 * HKV, D, device="cuda").half()
    q = qkv[:, :HQ]
    out = torch.empty(b, HQ, D, device="cuda").half()
    scale = 0.1

    def plan(lens):
        indptr, ind, last, bt = csr(lens, page, num_pages, sum(lens))
        w.plan(indptr=torch.as_tensor(indptr), indices=torch.as_tensor(ind, device="cuda"),
               last_page_len=torch.as_tensor(last), num_qo_heads=HQ, num_kv_heads=HKV, head_dim=D,
               page_size=page, pos_encoding_mode="NONE", sm_scale=scale, window_left=-1,
               logits_soft_cap=None, q_data_type=torch.float16, kv_data_type=torch.float16,
               o_data_type=torch.float16, data_type=None, rope_scale=None, rope_theta=None,
               non_blocking=True, block_tables=None, seq_lens=torch.as_tensor(np.array(lens, np.int32)),
               fixed_split_size=-1, disable_split_kv=False, q_len_per_req=1)
        assert (w._window_left, w._logits_soft_cap, w._sm_scale) == (-1, 0.0, scale)
        w.vllm_first_call = False
        assert w.vllm_first_call
        return bt

    def layer():
        w.run(q, (k, v), q_scale=None, k_scale=None, v_scale=None, out=out, kv_cache_sf=None, sinks=None)

    bt = plan(lens0)
    layer()
    assert rel(out, ref_of(q, k, v, lens0, bt, sm_scale=scale)) < TOL
    assert w.fallback_reason is None
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        layer()
    for grow in (1, 63, 64):
        lens = [n + grow for n in lens0]
        bt = plan(lens)
        g.replay()
        assert rel(out, ref_of(q, k, v, lens, bt, sm_scale=scale)) < TOL, grow
