"""``pkvrt.BatchDecodeWithPagedKVCacheWrapper`` on the tests' fake device (CPU tensors, emulated
kernels; tests/test_runtime_cpu.py): FlashInfer's plan/run arguments and refusals, the CSR
conversion, both cache layouts and the combined cache tensor, CUDA-graph mode, lse, sinks, and
the fallback to FlashInfer's own wrapper for what pkvrt does not serve."""

from __future__ import annotations

import functools

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


@settings(max_examples=60, deadline=None)
@given(st.lists(st.integers(0, 300), min_size=1, max_size=8), st.sampled_from([1, 4, 16]),
       st.integers(0, 2**31 - 1), st.booleans())
def test_device_step_is_the_host_conversion(lens, page, seed, device_lengths):
    """device_step (CUDA-graph mode: the step written where the indices are) gives the host
    conversion's lengths and each row's pages, from host lengths or from last_page_len on the
    device, rows of no pages (padding) included as length 0; entries past a row's pages are left
    as they were."""
    from pkvrt.runtime import wrapper as wmod

    rng = np.random.default_rng(seed)
    pages = [-(-n // page) for n in lens]
    ids = rng.permutation(sum(pages) + 3).astype(np.int32)
    ip = np.concatenate([[0], np.cumsum(pages)]).astype(np.int64)
    lpl = np.array([n - (p - 1) * page if p else 1 for n, p in zip(lens, pages)], np.int32)
    ind = torch.as_tensor(ids)
    seq_out = torch.full((len(lens) + 1,), -7, dtype=torch.int32)
    bt_out = torch.full((len(lens) + 1, max(pages) + 3), -7, dtype=torch.int32)
    kw = (dict(last_page_len=torch.as_tensor(lpl), page_size=page) if device_lengths
          else dict(seq=wmod.csr_lengths(ip, lpl, page, padding=True)[1]))
    wmod.device_step(wmod.csr_pages(ip, len(lens), padding=True), ind, seq_out, bt_out, **kw)
    assert seq_out[:len(lens)].tolist() == lens and seq_out[-1] == -7
    for r, p in enumerate(pages):
        assert bt_out[r, :p].tolist() == ids[ip[r]:ip[r + 1]].tolist() and (bt_out[r, p:] == -7).all()
    assert (bt_out[-1] == -7).all()


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


def test_flashinfers_lse_spellings_and_the_cuda_graph_class(fake_device, pool):  # noqa: F811
    """forward_return_lse (forward()'s variant rule: another scale re-plans) and run_return_lse
    give run(return_lse=True)'s answer; CUDAGraphBatchDecodeWithPagedKVCacheWrapper is the
    CUDA-graph wrapper over the caller's buffers, as FlashInfer's is."""
    from pkvrt.runtime.wrapper import CUDAGraphBatchDecodeWithPagedKVCacheWrapper

    b, _ = pool
    w = wrapper()
    seq, bt, ip, ind, lpl = step(b, [0, 1, 3])
    plan(w, ip, ind, lpl, sm_scale=0.2)
    q = torch.randn(3, HQ, D, generator=torch.Generator().manual_seed(9)).half()
    cache = (b.k_cache, b.v_cache)
    ref, ref_lse = reference.decode_attention(q, b.k_cache, b.v_cache, torch.as_tensor(seq),
                                              torch.as_tensor(bt), sm_scale=0.2, return_lse=True)
    for out, lse in (w.run_return_lse(q, cache), w.forward_return_lse(q, cache, sm_scale=0.2)):
        assert rel(out, ref) < TOL and torch.allclose(lse, ref_lse, atol=1e-3, rtol=1e-4)
    out, lse = w.forward_return_lse(q, cache, sm_scale=0.3)          # another variant: re-planned
    ref3, lse3 = reference.decode_attention(q, b.k_cache, b.v_cache, torch.as_tensor(seq),
                                            torch.as_tensor(bt), sm_scale=0.3, return_lse=True)
    assert rel(out, ref3) < TOL and torch.allclose(lse, lse3, atol=1e-3, rtol=1e-4)
    bufs = (torch.zeros(4, dtype=torch.int32), torch.zeros(2048, dtype=torch.int32),
            torch.zeros(3, dtype=torch.int32))
    g = CUDAGraphBatchDecodeWithPagedKVCacheWrapper(torch.zeros(8, dtype=torch.uint8), *bufs, "HND",
                                                    routes=ROUTES, calibration=SEED)
    assert g.is_cuda_graph_enabled and g._buffers == bufs
    plan(g, ip, ind, lpl)
    ref = reference.decode_attention(q, b.k_cache, b.v_cache, torch.as_tensor(seq), torch.as_tensor(bt))
    assert rel(g.run(q, cache), ref) < TOL and torch.equal(bufs[0], ip)


def test_reset_workspace_buffer_reaches_flashinfers_wrapper(fake_device, pool, fake_flashinfer):  # noqa: F811
    b, _ = pool
    w = wrapper()
    fws, iws = torch.zeros(16, dtype=torch.uint8), torch.zeros(16, dtype=torch.uint8)
    w.reset_workspace_buffer(fws, iws)                 # before any fallback: kept for it
    seq, bt, ip, ind, lpl = step(b, [0, 1])
    plan(w, ip, ind, lpl, pos_encoding_mode="ROPE_LLAMA")
    fi = fake_flashinfer[0]
    assert fi.args[0] is fws and fi.reset == [(fws, iws)]
    w.reset_workspace_buffer(iws, fws)
    assert fi.reset == [(fws, iws), (iws, fws)]
    with pytest.raises(ValueError, match="int_workspace_buffer: expected a torch.Tensor"):
        w.reset_workspace_buffer(fws, None)


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
    assert w.runtime.device_planning
    seq, bt, ip, ind, lpl = step(b, [0, 1], 0)
    with pytest.raises(ValueError, match="batch size should be fixed in cudagraph mode"):
        plan(w, ip, ind, lpl)
    small = wrapper(use_cuda_graph=True, **dict(bufs, paged_kv_indices_buffer=torch.zeros(4, dtype=torch.int32)))
    seq, bt, ip, ind, lpl = step(b, [0, 1, 4], 0)
    with pytest.raises(ValueError, match="size of indices should be less than or equal"):
        plan(small, ip, ind, lpl)


def graph_wrapper(batch: int, indices: int = 4096):
    return wrapper(use_cuda_graph=True,
                   paged_kv_indptr_buffer=torch.zeros(batch + 1, dtype=torch.int32),
                   paged_kv_indices_buffer=torch.zeros(indices, dtype=torch.int32),
                   paged_kv_last_page_len_buffer=torch.zeros(batch, dtype=torch.int32))


@pytest.mark.parametrize("ip, ind, lpl, match", [
    ([1, 2], [0, 1], [1], r"indptr: expected \[batch_size \+ 1 = 2\] starting at 0"),
    ([0, 2, 1], [0, 1], [1, 1], "row 1 has -1 pages"),
    ([0, 1], [0], [17], r"last_page_len\[0\] = 17: expected 1..page_size = 16"),
    ([0, 1, 2], [0, 1], [3, 0], r"last_page_len\[1\] = 0"),
    ([0, 3], [0, 1], [4], "indices: expected at least indptr"),
])
def test_cuda_graph_mode_refuses_a_bad_csr_naming_the_argument(fake_device, pool, ip, ind, lpl, match):  # noqa: F811
    """plan()'s lean host checks of CUDA-graph mode refuse what the general ones do (a row of no
    pages is an engine's padding there, so its last_page_len is not read), and write nothing."""
    w = graph_wrapper(len(lpl))
    before = [t.clone() for t in w._buffers]
    with pytest.raises(ValueError, match=match):
        plan(w, torch.tensor(ip, dtype=torch.int32), torch.tensor(ind, dtype=torch.int32),
             torch.tensor(lpl, dtype=torch.int32))
    assert all(torch.equal(a, b) for a, b in zip(before, w._buffers))


def test_cuda_graph_mode_keeps_its_setup_while_the_arguments_stay(fake_device, pool, monkeypatch):  # noqa: F811
    """Repeated plan() arguments reuse the setup and the Runtime (no key or refusal derived again);
    a changed variant argument, or forward() with another variant, derives them again, and each
    step still matches the reference."""
    b, _ = pool
    w = graph_wrapper(3)
    setups = []
    real = type(w)._setup
    monkeypatch.setattr(type(w), "_setup", lambda self, *a: setups.append(a) or real(self, *a))
    q = torch.randn(3, HQ, D, generator=torch.Generator().manual_seed(8)).half()
    for i, (kw, want_setups) in enumerate([({}, 1), ({}, 1), ({"sm_scale": 0.3}, 2), ({"sm_scale": 0.3}, 2),
                                           ({"window_left": 200, "sm_scale": 0.3}, 3)]):
        seq, bt, ip, ind, lpl = step(b, [0, 1, 4], short=i)
        plan(w, ip, ind, lpl, **kw)
        assert len(setups) == want_setups, (i, kw)
        rt = w.runtime
        ref = reference.decode_attention(q, b.k_cache, b.v_cache, torch.as_tensor(seq), torch.as_tensor(bt),
                                         sm_scale=kw.get("sm_scale"), window_left=kw.get("window_left", -1))
        assert rel(w.run(q, (b.k_cache, b.v_cache)), ref) < TOL, (i, kw)
    assert rt.window_left == 200
    # forward() with another scale re-plans once with it; later plans keep it
    out = w.forward(q, (b.k_cache, b.v_cache), window_left=200, sm_scale=0.25)
    ref = reference.decode_attention(q, b.k_cache, b.v_cache, torch.as_tensor(seq), torch.as_tensor(bt),
                                     sm_scale=0.25, window_left=200)
    assert rel(out, ref) < TOL and len(setups) == 4
    plan(w, ip, ind, lpl, window_left=200, sm_scale=0.3)   # the arguments forward() re-planned with
    assert len(setups) == 4 and w._planned["variant"][3] == 0.25


def test_cuda_graph_mode_never_reads_the_page_ids_on_the_host(fake_device, pool, monkeypatch):  # noqa: F811
    """CUDA-graph mode builds the block tables where the indices are (an engine's indices live on
    the GPU: reading them on the host would make every plan() wait for the GPU, which
    FlashInfer's plan() does not): the host conversion is never called, the step equals the
    host twin's, SGLang's habit of writing the indices into the buffer itself is served, and a
    page id outside the cache gives that row no work and a device_status() error, not a read."""
    from pkvrt.runtime import wrapper as wmod

    b, _ = pool
    bufs = dict(paged_kv_indptr_buffer=torch.zeros(4, dtype=torch.int32),
                paged_kv_indices_buffer=torch.full((2048,), -5, dtype=torch.int32),
                paged_kv_last_page_len_buffer=torch.zeros(3, dtype=torch.int32))
    w = wrapper(use_cuda_graph=True, **bufs)
    monkeypatch.setattr(wmod, "csr_to_block_tables", lambda *a, **k: pytest.fail("read page ids on the host"))
    seq, bt, ip, ind, lpl = step(b, [5, 2, 0])
    ip64 = ip.numpy().astype(np.int64)
    for kw in (dict(seq=wmod.csr_lengths(ip, lpl, PAGE)[1]), dict(last_page_len=lpl, page_size=PAGE)):
        dev_seq = torch.full((4,), -1, dtype=torch.int32)
        dev_bt = torch.full((4, 300), -1, dtype=torch.int32)
        wmod.device_step(ip64, ind, dev_seq, dev_bt, **kw)   # lengths from the host, or the device's
        assert dev_seq[:3].tolist() == seq.tolist() and dev_seq[3] == -1
        for r, n in enumerate(seq.tolist()):
            p = -(-n // PAGE)
            assert dev_bt[r, :p].tolist() == bt[r, :p].tolist() and (dev_bt[r, p:] == -1).all()
    bufs["paged_kv_indices_buffer"][:len(ind)] = ind          # SGLang writes the buffer itself
    plan(w, ip, bufs["paged_kv_indices_buffer"][:len(ind)], lpl)
    q = torch.randn(3, HQ, D, generator=torch.Generator().manual_seed(9)).half()
    out = w.run(q, (b.k_cache, b.v_cache))
    ref = reference.decode_attention(q, b.k_cache, b.v_cache, torch.as_tensor(seq), torch.as_tensor(bt))
    assert rel(out, ref) < TOL and w.runtime.device_status() == 0
    bad = ind.clone()
    bad[int(ip[1])] = b.k_cache.shape[0] + 3                  # row 1's first page: past the cache
    plan(w, ip, bad, lpl)
    w.run(q, (b.k_cache, b.v_cache))
    with pytest.raises(RuntimeError, match="page id outside"):
        w.runtime.device_status()
    with pytest.raises(ValueError, match="indices: expected at least"):
        plan(w, ip, ind[:3], lpl)


class NoHostRead(torch.Tensor):
    """A tensor that may not be read on the host (as a GPU tensor would need a copy that waits)."""

    def _refuse(self, *a, **k):
        raise AssertionError("read on the host")

    cpu = numpy = tolist = item = __array__ = _refuse


@pytest.mark.parametrize("page", [1, PAGE])
def test_cuda_graph_mode_reads_neither_page_ids_nor_a_gpu_last_page_len_on_the_host(
        fake_device, pool, monkeypatch, page):  # noqa: F811
    """As SGLang calls it: indices written into the buffer, last_page_len on the GPU. Neither is
    read on the host (SGLang's own fast plan avoids that copy at page size 1, where the lengths
    are the page counts; at other page sizes the lengths are computed on the device), and the
    step still equals the reference."""
    from pkvrt.runtime import wrapper as wmod

    b, _ = pool
    k, v = b.k_cache, b.v_cache
    if page == 1:   # the same tokens as page-1 slots: [P * 16, H_kv, 1, D]
        k = b.k_cache.transpose(1, 2).reshape(-1, HKV, 1, D)
        v = b.v_cache.transpose(1, 2).reshape(-1, HKV, 1, D)
    bufs = dict(paged_kv_indptr_buffer=torch.zeros(4, dtype=torch.int32),
                paged_kv_indices_buffer=torch.zeros(8192, dtype=torch.int32),
                paged_kv_last_page_len_buffer=torch.zeros(3, dtype=torch.int32))
    w = wrapper(use_cuda_graph=True, **bufs)
    monkeypatch.setattr(wmod, "_host_side", lambda x: not isinstance(x, torch.Tensor))
    seq, bt, ip, ind, lpl = step(b, [1, 4, 3], 2)
    if page == 1:
        slots = (bt[:, :, None] * PAGE + np.arange(PAGE)).reshape(len(seq), -1)
        ip, ind, lpl = wmod_csr(seq, slots)
        bt = slots
    bufs["paged_kv_indices_buffer"][:len(ind)] = ind
    w.plan(ip, bufs["paged_kv_indices_buffer"][:len(ind)].as_subclass(NoHostRead),
           lpl.as_subclass(NoHostRead), HQ, HKV, D, page, q_data_type=torch.float16)
    q = torch.randn(3, HQ, D, generator=torch.Generator().manual_seed(8)).half()
    out = w.run(q, (k, v))
    ref = reference.decode_attention(q, k, v, torch.as_tensor(seq), torch.as_tensor(bt))
    assert rel(out, ref) < TOL


def wmod_csr(seq, slots):
    """The page-size-1 CSR of rows whose tokens are ``slots`` (one page a token)."""
    ip = np.concatenate([[0], np.cumsum(seq)]).astype(np.int32)
    ind = np.concatenate([slots[r, :n] for r, n in enumerate(seq)]).astype(np.int32)
    return torch.as_tensor(ip), torch.as_tensor(ind), torch.ones(len(seq), dtype=torch.int32)


def test_cuda_graph_mode_serves_vllms_padding_rows(fake_device, pool):  # noqa: F811
    """vLLM pads a CUDA-graph decode batch to its captured size with rows of no pages (indptr
    flat, last_page_len 1): they get no work and no flag (the planning kernel's idle rows), the
    real rows equal the reference; without CUDA-graph mode such a row is refused, naming it."""
    b, _ = pool
    bufs = dict(paged_kv_indptr_buffer=torch.zeros(6, dtype=torch.int32),
                paged_kv_indices_buffer=torch.zeros(2048, dtype=torch.int32),
                paged_kv_last_page_len_buffer=torch.zeros(5, dtype=torch.int32))
    w = wrapper(use_cuda_graph=True, **bufs)
    seq, bt, ip, ind, lpl = step(b, [0, 2, 3], 1)
    ip5 = torch.cat([ip, ip[-1:].repeat(2)])                  # two padding rows
    lpl5 = torch.cat([lpl, torch.ones(2, dtype=lpl.dtype)])
    plan(w, ip5, ind, lpl5)
    q = torch.randn(5, HQ, D, generator=torch.Generator().manual_seed(12)).half()
    out = w.run(q, (b.k_cache, b.v_cache))
    ref = reference.decode_attention(q[:3], b.k_cache, b.v_cache, torch.as_tensor(seq), torch.as_tensor(bt))
    assert rel(out[:3], ref) < TOL and w.runtime.device_status() == 0
    with pytest.raises(ValueError, match="row 3 has 0 pages.*only in CUDA-graph mode"):
        plan(wrapper(), ip5, ind, lpl5)


def test_constructor_refusals():
    with pytest.raises(ValueError, match="Invalid kv_layout"):
        wrapper(kv_layout="HDN")
    with pytest.raises(ValueError, match="paged_kv_indptr_buffer: expected a 1-D torch.Tensor"):
        wrapper(use_cuda_graph=True)


# ----------------------------------------------------------------------------- fallback


class FakeFiWrapper:
    def __init__(self, workspace, layout, **kw):
        self.args, self.layout, self.kw, self.planned, self.runs = (workspace, layout), layout, kw, None, 0
        self.reset = []

    def plan(self, *args, **kw):
        self.planned = (args, kw)

    def reset_workspace_buffer(self, f, i):
        self.reset.append((f, i))

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


def test_a_refused_plan_with_window_left_none_runs_flashinfers_wrapper(fake_device, pool, fake_flashinfer):  # noqa: F811
    b, _ = pool
    w = wrapper()
    seq, bt, ip, ind, lpl = step(b, [0, 1])
    plan(w, ip, ind, lpl, pos_encoding_mode="ROPE_LLAMA", window_left=None)
    assert "RoPE" in w.fallback_reason and fake_flashinfer[0].planned[1]["window_left"] is None


def test_the_fallback_gets_the_dtypes_data_type_gave(fake_device, pool, fake_flashinfer):  # noqa: F811
    """FlashInfer's deprecated ``data_type`` fills in the K/V dtype (q's has a default) for
    FlashInfer's own wrapper too, as FlashInfer's plan() reads it (FP8 K/V with RoPE)."""
    b, _ = pool
    w = wrapper()
    seq, bt, ip, ind, lpl = step(b, [0, 1])
    w.plan(ip, ind, lpl, HQ, HKV, D, PAGE, pos_encoding_mode="ROPE_LLAMA",
           data_type=torch.float8_e4m3fn, q_data_type=torch.float16)
    kw = fake_flashinfer[0].planned[1]
    assert (kw["q_data_type"], kw["kv_data_type"]) == (torch.float16, torch.float8_e4m3fn)
    w.plan(ip, ind, lpl, HQ, HKV, D, PAGE, pos_encoding_mode="ROPE_LLAMA", data_type=torch.bfloat16)
    kw = fake_flashinfer[0].planned[1]
    assert (kw["q_data_type"], kw["kv_data_type"]) == ("float16", torch.bfloat16)   # q's default stays


def test_run_before_plan_is_refused():
    w = wrapper()
    with pytest.raises(RuntimeError, match="plan\\(\\) must be called before run\\(\\)"):
        w.run(torch.zeros(1, HQ, D).half(), (torch.zeros(1), torch.zeros(1)))


# ----------------------------------------------------------------------------- engines' calls


def token_slots(b, rows, short=0):
    """The step as page-size-1 token slots (SGLang's cache): slot = page * PAGE + offset."""
    seq = np.array([max(1, POOL_LENS[r] - short) for r in rows], dtype=np.int32)
    bt = b.block_tables[rows].numpy()
    ind = np.concatenate([bt[i, np.arange(n) // PAGE] * PAGE + np.arange(n) % PAGE
                          for i, n in enumerate(seq)]).astype(np.int32)
    ip = np.concatenate([[0], np.cumsum(seq)]).astype(np.int32)
    return seq, bt, torch.as_tensor(ip), torch.as_tensor(ind), torch.ones(len(rows), dtype=torch.int32)


def test_sglang_calls_page_size_one_begin_forward_and_forward_with_the_scale(fake_device, pool):  # noqa: F811
    """SGLang: 3-D token-slot K/V (NHD, page 1), plan through begin_forward with data_type=,
    the indices written into _paged_kv_indices_buf, the scale and soft cap given to forward()."""
    b, _ = pool
    k3 = b.k_cache.permute(0, 2, 1, 3).reshape(-1, HKV, D)     # [slots, H_kv, D]
    v3 = b.v_cache.permute(0, 2, 1, 3).reshape(-1, HKV, D)
    rows = [0, 1, 3]
    bufs = dict(paged_kv_indptr_buffer=torch.zeros(4, dtype=torch.int32),
                paged_kv_indices_buffer=torch.zeros(8192, dtype=torch.int32),
                paged_kv_last_page_len_buffer=torch.zeros(3, dtype=torch.int32))
    w = wrapper(kv_layout="NHD", use_cuda_graph=True, **bufs)
    assert w._paged_kv_indices_buf is bufs["paged_kv_indices_buffer"]
    rt = None
    for i, (short, scale, cap) in enumerate([(3, D ** -0.5, 0.0), (2, 0.2, 20.0), (1, 0.2, 20.0)]):
        seq, bt, ip, ind, lpl = token_slots(b, rows, short)
        w._paged_kv_indices_buf[:len(ind)] = ind
        w.begin_forward(ip, w._paged_kv_indices_buf[:len(ind)], lpl, HQ, HKV, D, 1,
                        data_type=torch.float16, q_data_type=torch.float16, non_blocking=True)
        q = torch.randn(len(rows), HQ, D, generator=torch.Generator().manual_seed(i)).half() * 2
        out = w.forward(q, (k3, v3), sm_scale=scale, logits_soft_cap=cap, k_scale=None, v_scale=None)
        ref = reference.decode_attention(q, b.k_cache, b.v_cache, torch.as_tensor(seq),
                                         torch.as_tensor(bt), sm_scale=scale, logits_soft_cap=cap)
        assert rel(out, ref) < TOL, i
        if i == 2:   # the scale forward() gave at step 1 is kept: no re-plan, no new Runtime
            assert w.runtime is rt
        rt = w.runtime
    assert w.fallback_reason is None


def test_sglang_fast_decode_plan_replacement_keeps_pkvrts_plan(fake_device, pool):  # noqa: F811
    b, _ = pool
    w = wrapper()
    calls = []

    def fast_decode_plan(wrapper, *args, **kwargs):   # FlashInfer's, as SGLang binds it
        calls.append(args)

    w.begin_forward = functools.partial(fast_decode_plan, w)
    seq, bt, ip, ind, lpl = step(b, [0, 2])
    w.begin_forward(ip.to(torch.int64) * 0, ind, lpl, HQ, HKV, D, PAGE, q_data_type=torch.float16,
                    global_override_indptr_cpu=ip)
    assert not calls and w.fallback_reason is None
    assert w._planned["seq"].tolist() == seq.tolist()   # planned from the host indptr it was given
    with pytest.raises(TypeError, match="does not take: \\['no_such'\\]"):
        w.begin_forward(ip, ind, lpl, HQ, HKV, D, PAGE, no_such=1)
    other = object()
    w.begin_forward = other                               # anything else is kept as given
    assert w.begin_forward is other


def test_vllm_calls_packed_kv_strided_q_and_its_plan_arguments(fake_device, pool):  # noqa: F811
    """vLLM: K/V packed in the last dimension (strided views), fixed_split_size=-1 (no pinned
    split), the plan attributes it asserts on, vllm_first_call, q a view of fused QKV rows."""
    b, _ = pool
    kv = torch.cat([b.k_cache.transpose(1, 2), b.v_cache.transpose(1, 2)], dim=-1)   # [P, page, H_kv, 2D]
    k, v = kv[..., :D], kv[..., D:]
    seq, bt, ip, ind, lpl = step(b, [0, 1, 2, 4], 2)
    w = wrapper(kv_layout="NHD")
    w.plan(indptr=ip, indices=ind, last_page_len=lpl, num_qo_heads=HQ, num_kv_heads=HKV,
           head_dim=D, page_size=PAGE, pos_encoding_mode="NONE", sm_scale=0.11, window_left=-1,
           logits_soft_cap=None, q_data_type=torch.float16, kv_data_type=torch.float16,
           o_data_type=torch.float16, data_type=None, rope_scale=None, rope_theta=None,
           non_blocking=True, block_tables=None, seq_lens=torch.as_tensor(seq),
           fixed_split_size=-1, disable_split_kv=False, q_len_per_req=1)
    assert w.fallback_reason is None
    assert (w._window_left, w._logits_soft_cap, w._sm_scale) == (-1, 0.0, 0.11)
    w.vllm_first_call = False
    assert w.vllm_first_call
    qkv = torch.randn(4, HQ + 2 * HKV, D, generator=torch.Generator().manual_seed(3)).half()
    q = qkv[:, :HQ]
    assert not q.is_contiguous()
    out = torch.full((4, HQ, D), float("nan"), dtype=torch.float16)
    w.run(q, (k, v), q_scale=None, k_scale=None, v_scale=None, out=out, kv_cache_sf=None, sinks=None)
    ref = reference.decode_attention(q, b.k_cache, b.v_cache, torch.as_tensor(seq),
                                     torch.as_tensor(bt), sm_scale=0.11)
    assert rel(out, ref) < TOL


def test_page_size_one_cache_as_one_4d_tensor(fake_device, pool):  # noqa: F811
    b, _ = pool
    k3 = b.k_cache.permute(0, 2, 1, 3).reshape(-1, HKV, D)
    v3 = b.v_cache.permute(0, 2, 1, 3).reshape(-1, HKV, D)
    kv4 = torch.stack([k3, v3], dim=1)                       # [slots, 2, H_kv, D]
    seq, bt, ip, ind, lpl = token_slots(b, [1, 2])
    w = wrapper(kv_layout="NHD")
    w.plan(ip, ind, lpl, HQ, HKV, D, 1, q_data_type=torch.float16)
    q = torch.randn(2, HQ, D).half()
    ref = reference.decode_attention(q, b.k_cache, b.v_cache, torch.as_tensor(seq), torch.as_tensor(bt))
    assert rel(w.run(q, kv4), ref) < TOL


@pytest.mark.parametrize("b", [3, 97, 200])   # both fills: a slice per row (B <= 96), one scatter
def test_csr_to_block_tables_large_batches(b):
    rng = np.random.default_rng(b)
    lens = rng.integers(1, 400, b)
    pages = -(-lens // 16)
    bt = np.full((b, int(pages.max())), -1, np.int32)
    perm = rng.permutation(int(pages.sum())).astype(np.int32)
    at = 0
    for r, n in enumerate(pages):
        bt[r, :n] = perm[at:at + n]
        at += n
    ip, ind, lpl = to_csr(lens.astype(np.int32), bt, 16)
    seq, got = csr_to_block_tables(torch.as_tensor(ip), torch.as_tensor(ind), torch.as_tensor(lpl), 16)
    assert seq.tolist() == lens.tolist()
    for r, n in enumerate(pages):
        assert got[r, :n].tolist() == bt[r, :n].tolist()


def shared_step(b, rows, prefix_pages, short=0):
    """step() whose rows take the first row's first ``prefix_pages`` pages (prefix caching)."""
    seq = np.array([max(1, POOL_LENS[r] - short) for r in rows], dtype=np.int32)
    bt = b.block_tables[rows].numpy().copy()
    bt[1:, :prefix_pages] = bt[0, :prefix_pages]
    ip, ind, lpl = to_csr(seq, bt, PAGE)
    return seq, bt, torch.as_tensor(ip), torch.as_tensor(ind), torch.as_tensor(lpl)


@pytest.mark.parametrize("graph_mode", [False, True], ids=["host lengths", "cuda graph mode"])
def test_share_prefixes_reads_shared_pages_once_and_matches(fake_device, pool, graph_mode,  # noqa: F811
                                                           monkeypatch):
    """share_prefixes=True: the plans run SharedPagesRuntime (in CUDA-graph mode with the
    sharing found on the device), outputs and lse match the reference and a plain wrapper's; a
    windowed plan runs the plain Runtime. (Host lengths share where the time model predicts a
    gain, which these short rows do not: shared here regardless, to check the arithmetic.)"""
    from pkvrt.runtime.shared import SharedPagesRuntime

    monkeypatch.setattr(SharedPagesRuntime, "_sharing_pays", lambda self, seq, rereads, sp, own_gather: True)

    b, _ = pool
    rows = [0, 1, 4, 2]
    bufs = dict(paged_kv_indptr_buffer=torch.zeros(len(rows) + 1, dtype=torch.int32),
                paged_kv_indices_buffer=torch.zeros(4096, dtype=torch.int32),
                paged_kv_last_page_len_buffer=torch.zeros(len(rows), dtype=torch.int32)) if graph_mode else {}
    w = wrapper(use_cuda_graph=graph_mode, share_prefixes=True, **bufs)
    seq, bt, ip, ind, lpl = shared_step(b, rows, 30)
    plan(w, ip, ind, lpl)
    assert isinstance(w.runtime, SharedPagesRuntime) and w.runtime.device_planning == graph_mode
    q = torch.randn(len(rows), HQ, D, generator=torch.Generator().manual_seed(3)).half()
    out, lse = w.run(q, (b.k_cache, b.v_cache), return_lse=True)
    ref, ref_lse = reference.decode_attention(q, b.k_cache, b.v_cache, torch.as_tensor(seq),
                                              torch.as_tensor(bt), return_lse=True)
    assert rel(out, ref) < TOL and torch.allclose(lse, ref_lse, atol=1e-3, rtol=1e-4)
    if graph_mode:
        assert w.runtime.found().tokens_saved > 0
    else:
        assert w.runtime.plan_used is not None and "saved" in w.explain()
    plan(w, ip, ind, lpl, window_left=300)
    assert not isinstance(w.runtime, SharedPagesRuntime)
    with pytest.raises(ValueError, match="share_prefixes='yes': expected True or False"):
        wrapper(share_prefixes="yes")


# ----------------------------------------------------------------------------- failed calls


@pytest.mark.parametrize("arg, bad, match", [
    ("indptr", lambda t: t.double() + 0.5, "indptr: expected a 1-D int32 or int64 tensor, got a torch.float64"),
    ("indices", lambda t: t.float(), "indices: expected a 1-D int32 or int64 tensor, got a torch.float32"),
    ("last_page_len", lambda t: t.float() + 0.9, "last_page_len: expected a 1-D int32 or int64 tensor"),
    ("indices", lambda t: t[:, None], r"indices: .* of shape \(\d+, 1\)"),
    ("last_page_len", lambda t: t[:, None], r"last_page_len: .* of shape \(3, 1\)"),
    ("indptr", lambda t: None, "indptr: expected a 1-D int32 or int64 tensor, got None"),
])
@pytest.mark.parametrize("graph_mode", [False, True], ids=["host", "cuda-graph"])
def test_a_csr_of_the_wrong_dtype_or_rank_is_refused_before_anything_is_written(
        fake_device, pool, arg, bad, match, graph_mode):  # noqa: F811
    """FlashInfer reads indptr, indices and last_page_len as int32: a float is refused, not
    truncated into an index, and a 2-D one is named, before the caller's buffers are touched."""
    b, _ = pool
    w = graph_wrapper(3) if graph_mode else wrapper()
    seq, bt, ip, ind, lpl = step(b, [0, 1, 3])
    plan(w, ip, ind, lpl)
    before = [t.clone() for t in w._buffers] if graph_mode else None
    csr = dict(indptr=ip, indices=ind, last_page_len=lpl)
    csr[arg] = bad(csr[arg])
    with pytest.raises(ValueError, match=match):
        plan(w, csr["indptr"], csr["indices"], csr["last_page_len"])
    if graph_mode:
        assert all(torch.equal(x, y) for x, y in zip(before, w._buffers))
    with pytest.raises(RuntimeError, match="no plan in effect"):
        w.run(torch.zeros(3, HQ, D).half(), (b.k_cache, b.v_cache))


def test_page_ids_past_int32_are_refused_not_wrapped(fake_device, pool):  # noqa: F811
    b, _ = pool
    seq, bt, ip, ind, lpl = step(b, [0, 1])
    wide = ind.long()
    wide[3] += 1 << 32          # would wrap onto the row's own page id
    with pytest.raises(ValueError, match=r"indices\[3\] = 42949\d+: page ids are int32"):
        plan(wrapper(), ip, wide, lpl)
    seq2, bt2 = csr_to_block_tables(ip, ind.long(), lpl, PAGE)   # int64 within range: as int32
    assert np.array_equal(bt2, csr_to_block_tables(ip, ind, lpl, PAGE)[1])


def test_a_failed_plan_leaves_flashinfers_attributes_as_the_last_good_plan_set_them(
        fake_device, pool):  # noqa: F811
    """vLLM asserts on _sm_scale / _window_left / _logits_soft_cap, and forward() re-plans from
    the last plan()'s arguments: a plan() that raises changes none of them."""
    b, _ = pool
    w = wrapper()
    seq, bt, ip, ind, lpl = step(b, [0, 2])
    plan(w, ip, ind, lpl, sm_scale=0.3, window_left=200)
    with pytest.raises(ValueError, match="q_data_type='float17'"):
        w.plan(ip, ind, lpl, HQ, HKV, D, PAGE, sm_scale=0.5, window_left=7, logits_soft_cap=3.0,
               q_data_type="float17")
    assert (w._sm_scale, w._window_left, w._logits_soft_cap) == (0.3, 200, 0.0)
    assert w._plan_args[1]["sm_scale"] == 0.3
    plan(w, ip, ind, lpl, sm_scale=0.3, window_left=200)
    q = torch.randn(2, HQ, D, generator=torch.Generator().manual_seed(3)).half()
    ref = reference.decode_attention(q, b.k_cache, b.v_cache, torch.as_tensor(seq), torch.as_tensor(bt),
                                     sm_scale=0.3, window_left=200)
    assert rel(w.run(q, (b.k_cache, b.v_cache)), ref) < TOL


@pytest.mark.parametrize("variant", [dict(window_left=-5), dict(logits_soft_cap=-1.0)])
def test_a_forward_variant_that_is_refused_is_not_kept_for_later_plans(fake_device, pool, variant):  # noqa: F811
    b, _ = pool
    w = wrapper()
    seq, bt, ip, ind, lpl = step(b, [1, 3])
    plan(w, ip, ind, lpl)
    q = torch.randn(2, HQ, D, generator=torch.Generator().manual_seed(4)).half()
    with pytest.raises(ValueError, match=next(iter(variant))):
        w.forward(q, (b.k_cache, b.v_cache), **variant)
    plan(w, ip, ind, lpl)      # plans as before the failed forward()
    ref = reference.decode_attention(q, b.k_cache, b.v_cache, torch.as_tensor(seq), torch.as_tensor(bt))
    assert rel(w.run(q, (b.k_cache, b.v_cache)), ref) < TOL


@pytest.mark.parametrize("graph_mode", [False, True], ids=["host", "cuda-graph"])
def test_a_failed_first_run_with_sinks_keeps_the_runtime_without_sinks(fake_device, pool, graph_mode):  # noqa: F811
    b, _ = pool
    w = graph_wrapper(3) if graph_mode else wrapper()
    seq, bt, ip, ind, lpl = step(b, [0, 2, 3])
    plan(w, ip, ind, lpl)
    q = torch.randn(3, HQ, D, generator=torch.Generator().manual_seed(5)).half()
    for bad_q, sinks in ((q, torch.zeros(HQ + 1)), (q, torch.zeros(HQ).half()), (q[:2], torch.zeros(HQ))):
        with pytest.raises(ValueError, match="sinks|q: expected"):
            w.run(bad_q, (b.k_cache, b.v_cache), sinks=sinks)
        assert not w.runtime.sinks
    ref = reference.decode_attention(q, b.k_cache, b.v_cache, torch.as_tensor(seq), torch.as_tensor(bt))
    assert rel(w.run(q, (b.k_cache, b.v_cache)), ref) < TOL
    sinks = torch.linspace(-1, 3, HQ)   # and a good first run with sinks still rebuilds
    ref = reference.decode_attention(q, b.k_cache, b.v_cache, torch.as_tensor(seq), torch.as_tensor(bt),
                                     sinks=sinks)
    assert rel(w.run(q, (b.k_cache, b.v_cache), sinks=sinks), ref) < TOL and w.runtime.sinks


def test_kv_scales_on_a_16_bit_cache_are_refused_unless_one(fake_device, pool):  # noqa: F811
    """FlashInfer multiplies the scores by k_scale and the output by v_scale for any cache
    dtype; pkvrt scales only FP8 caches, so it refuses a scale it would otherwise ignore."""
    b, _ = pool
    w = wrapper()
    seq, bt, ip, ind, lpl = step(b, [0, 1])
    plan(w, ip, ind, lpl)
    q = torch.randn(2, HQ, D, generator=torch.Generator().manual_seed(8)).half()
    ref = reference.decode_attention(q, b.k_cache, b.v_cache, torch.as_tensor(seq), torch.as_tensor(bt))
    assert rel(w.run(q, (b.k_cache, b.v_cache), k_scale=1.0, v_scale=None), ref) < TOL
    for kw in (dict(k_scale=0.5), dict(v_scale=2.0), dict(k_scale=-1.0)):
        with pytest.raises(ValueError, match=f"{next(iter(kw))}=.*only to float8_e4m3fn caches"):
            w.run(q, (b.k_cache, b.v_cache), **kw)
    with pytest.raises(ValueError, match=r"q: expected a torch.Tensor"):
        w.run(q.tolist(), (b.k_cache, b.v_cache))


def test_plan_refuses_head_counts_and_sizes_that_are_not_positive_ints(fake_device, pool):  # noqa: F811
    b, _ = pool
    seq, bt, ip, ind, lpl = step(b, [0])
    for args, name in (((HQ, HKV, 0, PAGE), "head_dim=0"), (("8", HKV, D, PAGE), "num_qo_heads='8'"),
                       ((HQ, HKV, D, 0), "page_size=0"), ((HQ, True, D, PAGE), "num_kv_heads=True")):
        with pytest.raises(ValueError, match=f"plan: {name}: expected a positive int"):
            wrapper().plan(ip, ind, lpl, *args)
    w = wrapper()
    plan(w, ip, ind, lpl, window_left=None)   # FlashInfer's None: no window
    assert w.runtime.window_left == -1
