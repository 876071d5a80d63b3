"""``pkvrt.BatchDecodeWithPagedKVCacheWrapper`` on the tests' fake device (CPU tensors, emulated
kernels; tests/test_runtime_cpu.py): FlashInfer's plan/run arguments and refusals, the CSR
conversion, both cache layouts and the combined cache tensor, CUDA-graph mode, lse, sinks, and
the fallback to FlashInfer's own wrapper for what pkvrt does not serve."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from test_runtime_cpu import POOL_LENS, ROUTES, SEED, fake_device, pool  # noqa: F401

from pkvrt import reference
from pkvrt.policy.blocktables import to_csr
from pkvrt.runtime import fi_route
from pkvrt.runtime.wrapper import BatchDecodeWithPagedKVCacheWrapper, csr_to_block_tables

HQ, HKV, D, PAGE = 8, 2, 64, 16
TOL = 2e-3


def rel(out, ref):
    return float((out.float() - ref).norm() / ref.norm())


def wrapper(**kw):
    ws = torch.zeros(1024, dtype=torch.uint8)
    kw.setdefault("kv_layout", "HND")
    return BatchDecodeWithPagedKVCacheWrapper(ws, routes=ROUTES, calibration=SEED, **kw)


def step(b, rows, short=0):
    seq = np.array([max(1, POOL_LENS[r] - short) for r in rows], dtype=np.int32)
    bt = b.block_tables[rows].numpy()
    ip, ind, lpl = to_csr(seq, bt, PAGE)
    return seq, bt, torch.as_tensor(ip), torch.as_tensor(ind), torch.as_tensor(lpl)


def plan(w, ip, ind, lpl, **kw):
    w.plan(ip, ind, lpl, HQ, HKV, D, PAGE, q_data_type=torch.float16, **kw)


# ----------------------------------------------------------------------------- CSR


@settings(max_examples=40, deadline=None)
@given(st.lists(st.integers(1, 200), min_size=1, max_size=6), st.sampled_from([1, 4, 16]),
       st.integers(0, 2**31 - 1))
def test_csr_to_block_tables_inverts_to_csr(lens, page, seed):
    rng = np.random.default_rng(seed)
    pages = [-(-n // page) for n in lens]
    perm = rng.permutation(sum(pages) + 5).astype(np.int32)
    bt = np.full((len(lens), max(pages) + 2), -1, np.int32)
    at = 0
    for r, n in enumerate(pages):
        bt[r, :n] = perm[at:at + n]
        at += n
    seq = np.array(lens, np.int32)
    ip, ind, lpl = to_csr(seq, bt, page)
    seq2, bt2 = csr_to_block_tables(torch.as_tensor(ip), torch.as_tensor(ind), torch.as_tensor(lpl), page)
    assert seq2.tolist() == lens
    for r, n in enumerate(pages):
        assert bt2[r, :n].tolist() == bt[r, :n].tolist()


@pytest.mark.parametrize("ip, ind, lpl, match", [
    ([1, 2], [0, 1], [1], r"indptr: expected \[batch_size \+ 1 = 2\] starting at 0"),
    ([0, 1, 3], [0, 1, 2], [1], r"indptr: expected \[batch_size \+ 1 = 2\]"),
    ([0, 1, 1], [0], [1, 1], "row 1 has 0 pages"),
    ([0, 1], [0], [17], r"last_page_len\[0\] = 17: expected 1..page_size = 16"),
    ([0, 1], [0], [0], r"last_page_len\[0\] = 0"),
    ([0, 3], [0, 1], [4], "indices: expected at least indptr"),
])
def test_bad_csr_is_refused_naming_the_argument(ip, ind, lpl, match):
    with pytest.raises(ValueError, match=match):
        csr_to_block_tables(torch.tensor(ip, dtype=torch.int32), torch.tensor(ind, dtype=torch.int32),
                            torch.tensor(lpl, dtype=torch.int32), 16)


# ----------------------------------------------------------------------------- serving


@pytest.mark.parametrize("layout", ["HND", "NHD"])
@pytest.mark.parametrize("combined", [False, True], ids=["k,v", "one tensor"])
def test_plan_and_run_match_the_reference_over_steps(fake_device, pool, layout, combined):  # noqa: F811
    b, _ = pool
    k, v = b.k_cache, b.v_cache          # [P, H_kv, page, D]
    if layout == "NHD":
        k, v = k.transpose(1, 2).contiguous(), v.transpose(1, 2).contiguous()   # [P, page, H_kv, D]
    cache = torch.stack([k, v], dim=1) if combined else (k, v)
    w = wrapper(kv_layout=layout)
    for i, (rows, short) in enumerate([([0, 1, 2, 3], 3), ([0, 1, 2, 3], 2), ([0, 2, 4], 1)]):
        seq, bt, ip, ind, lpl = step(b, rows, short)
        plan(w, ip, ind, lpl)
        q = torch.randn(len(rows), HQ, D, generator=torch.Generator().manual_seed(i)).half()
        out = w.run(q, cache, out=torch.full_like(q, float("nan")))
        ref = reference.decode_attention(q, b.k_cache, b.v_cache, torch.as_tensor(seq), torch.as_tensor(bt))
        assert rel(out, ref) < TOL, (layout, i)
    assert w.fallback_reason is None and "pkvrt.Runtime" in w.explain()


def test_return_lse_and_a_window_and_a_soft_cap(fake_device, pool):  # noqa: F811
    b, _ = pool
    w = wrapper()
    seq, bt, ip, ind, lpl = step(b, [0, 1, 3])
    plan(w, ip, ind, lpl, window_left=300, logits_soft_cap=20.0, sm_scale=0.2)
    q = torch.randn(3, HQ, D, generator=torch.Generator().manual_seed(5)).half() * 3
    out, lse = w.run(q, (b.k_cache, b.v_cache), return_lse=True)
    ref, ref_lse = reference.decode_attention(q, b.k_cache, b.v_cache, torch.as_tensor(seq),
                                              torch.as_tensor(bt), sm_scale=0.2, window_left=300,
                                              logits_soft_cap=20.0, return_lse=True)
    assert rel(out, ref) < TOL
    assert torch.allclose(lse, ref_lse, atol=1e-3, rtol=1e-4)
    with pytest.raises(ValueError, match="window_left=5: expected None or the planned 300"):
        w.run(q, (b.k_cache, b.v_cache), window_left=5)


def test_sinks_rebuild_a_sinks_runtime_once(fake_device, pool):  # noqa: F811
    b, _ = pool
    w = wrapper()
    seq, bt, ip, ind, lpl = step(b, [0, 2, 3])
    plan(w, ip, ind, lpl)
    q = torch.randn(3, HQ, D, generator=torch.Generator().manual_seed(6)).half()
    sinks = torch.linspace(-2, 9, HQ)
    for _ in range(2):
        out = w.run(q, (b.k_cache, b.v_cache), sinks=sinks)
        ref = reference.decode_attention(q, b.k_cache, b.v_cache, torch.as_tensor(seq),
                                         torch.as_tensor(bt), sinks=sinks)
        assert rel(out, ref) < TOL
    assert w.runtime.sinks and not w.runtime.flashinfer_available
    rt = w.runtime
    plan(w, ip, ind, lpl)                      # later plans keep the sinks Runtime
    assert w.runtime is rt


def test_cuda_graph_mode_fixes_the_batch_and_fills_the_buffers(fake_device, pool):  # noqa: F811
    b, _ = pool
    bufs = dict(paged_kv_indptr_buffer=torch.zeros(4, dtype=torch.int32),
                paged_kv_indices_buffer=torch.zeros(2048, dtype=torch.int32),
                paged_kv_last_page_len_buffer=torch.zeros(3, dtype=torch.int32))
    w = wrapper(use_cuda_graph=True, **bufs)
    assert w.is_cuda_graph_enabled
    for short in (4, 1):
        seq, bt, ip, ind, lpl = step(b, [0, 1, 4], short)
        plan(w, ip, ind, lpl)
        assert torch.equal(bufs["paged_kv_indptr_buffer"], ip)
        assert torch.equal(bufs["paged_kv_indices_buffer"][:len(ind)], ind)
        q = torch.randn(3, HQ, D).half()
        out = w.run(q, (b.k_cache, b.v_cache))
        ref = reference.decode_attention(q, b.k_cache, b.v_cache, torch.as_tensor(seq), torch.as_tensor(bt))
        assert rel(out, ref) < TOL
    assert w.runtime.engine_capture
    seq, bt, ip, ind, lpl = step(b, [0, 1], 0)
    with pytest.raises(ValueError, match="batch size should be fixed in cudagraph mode"):
        plan(w, ip, ind, lpl)
    small = wrapper(use_cuda_graph=True, **dict(bufs, paged_kv_indices_buffer=torch.zeros(4, dtype=torch.int32)))
    seq, bt, ip, ind, lpl = step(b, [0, 1, 4], 0)
    with pytest.raises(ValueError, match="size of indices should be less than or equal"):
        plan(small, ip, ind, lpl)


def test_constructor_refusals():
    with pytest.raises(ValueError, match="Invalid kv_layout"):
        wrapper(kv_layout="HDN")
    with pytest.raises(ValueError, match="paged_kv_indptr_buffer: expected a 1-D torch.Tensor"):
        wrapper(use_cuda_graph=True)


# ----------------------------------------------------------------------------- fallback


class FakeFiWrapper:
    def __init__(self, workspace, layout, **kw):
        self.layout, self.kw, self.planned, self.runs = layout, kw, None, 0

    def plan(self, *args, **kw):
        self.planned = (args, kw)

    def run(self, q, cache, *args, out=None, **kw):
        self.runs += 1
        return torch.zeros_like(q) if out is None else out


@pytest.fixture
def fake_flashinfer(monkeypatch):
    made = []

    class Module:
        @staticmethod
        def BatchDecodeWithPagedKVCacheWrapper(*a, **k):
            made.append(FakeFiWrapper(*a, **k))
            return made[-1]
    monkeypatch.setattr(fi_route, "load_flashinfer", lambda: (Module, None))
    return made


@pytest.mark.parametrize("kw, reason", [
    (dict(pos_encoding_mode="ROPE_LLAMA"), "RoPE"),
    (dict(q_len_per_req=2), "one query token per request"),
    (dict(disable_split_kv=True), "batch-invariant"),
    (dict(fixed_split_size=64), "batch-invariant"),
])
def test_what_pkvrt_does_not_serve_runs_flashinfers_wrapper(fake_device, pool, fake_flashinfer, kw, reason):  # noqa: F811
    b, _ = pool
    w = wrapper()
    seq, bt, ip, ind, lpl = step(b, [0, 1])
    plan(w, ip, ind, lpl, **kw)
    assert reason in w.fallback_reason and reason in w.explain()
    q = torch.randn(2, HQ, D).half()
    w.run(q, (b.k_cache, b.v_cache))
    assert fake_flashinfer[0].runs == 1 and fake_flashinfer[0].layout == "HND"
    with pytest.raises(ValueError, match="accepts sinks and ignores them"):
        w.run(q, (b.k_cache, b.v_cache), sinks=torch.zeros(HQ))
    plan(w, ip, ind, lpl)                  # the next plan pkvrt serves runs on pkvrt again
    assert w.fallback_reason is None


def test_run_before_plan_is_refused():
    w = wrapper()
    with pytest.raises(RuntimeError, match="plan\\(\\) must be called before run\\(\\)"):
        w.run(torch.zeros(1, HQ, D).half(), (torch.zeros(1), torch.zeros(1)))
