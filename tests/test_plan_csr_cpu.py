"""``Runtime.plan_csr``: a step given as FlashInfer's paged-KV CSR on the device, planned by one
launch of the planning kernel that reads the CSR itself (its CSR direct mode, emulated on the
tests' fake device), as the drop-in wrapper's CUDA-graph mode plans. The same outputs as the
block-table plan of the same step; a bad indptr or last_page_len gives its row no work and
device_status() bit 1, nothing read past the indices; bad arguments are refused before any
launch, naming the argument."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from test_runtime_cpu import fake_device, fake_runtime, pool, ref, rel_err, step_inputs  # noqa: F401

from pkvrt.launch import ops
from pkvrt.policy.blocktables import to_csr
from pkvrt.runtime import wrapper as wmod

PAGE = 16


def csr(seq, bt, extra=0):
    ip, ind, lpl = to_csr(np.asarray(seq), np.asarray(bt), PAGE)
    ind = np.concatenate([ind, np.full(extra, -7, np.int32)])   # entries past the step: never read
    return tuple(torch.as_tensor(np.asarray(a, dtype=np.int32)) for a in (ip, ind, lpl))


def device_runtime(b, **kw):
    return fake_runtime(device_planning=True, num_pages=b.k_cache.shape[0],
                        use_cuda_graph=False, **kw)


@pytest.mark.parametrize("rows", [[0, 1, 2, 3, 4, 5], [3], [2, 0]])
def test_plan_csr_equals_the_block_table_plan_in_one_direct_launch(fake_device, pool, rows):  # noqa: F811
    b, _ = pool
    cache = (b.k_cache, b.v_cache)
    seq, bt, q = step_inputs(b, rows, 2, seed=len(rows))
    rt = device_runtime(b)
    launches, direct = fake_device.launches, fake_device.direct
    d = rt.plan_csr(*csr(seq, bt, extra=5))
    assert (fake_device.launches, fake_device.direct) == (launches + 1, direct + 1)
    out = rt.run(q, *cache)
    assert rt.device_status() == 0 and d.route == rt.last_decision.route
    twin = device_runtime(b)
    twin.plan(torch.as_tensor(seq), torch.as_tensor(bt))
    assert torch.equal(out, twin.run(q, *cache))
    assert rel_err(out, ref(q, cache, seq, bt)) < 2e-3


def test_padding_rows_of_no_pages_get_no_work(fake_device, pool):  # noqa: F811
    b, _ = pool
    cache = (b.k_cache, b.v_cache)
    seq, bt, q = step_inputs(b, [0, 4], 0, seed=3)
    ip, ind, lpl = csr(seq, bt)
    ip = torch.cat([ip, ip[-1:]])                      # a third row of no pages (vLLM's padding)
    lpl = torch.cat([lpl, torch.tensor([9], dtype=torch.int32)])
    rt = device_runtime(b)
    rt.plan_csr(ip, ind, lpl)
    q3 = torch.cat([q, q[:1]])
    out = rt.run(q3, *cache, out=torch.full_like(q3, 3.0))
    assert rt.device_status() == 0 and torch.all(out[2] == 3.0)
    assert rel_err(out[:2], ref(q, cache, seq, bt)) < 2e-3


@pytest.mark.parametrize("bad", ["last_page_len 0", "last_page_len past the page", "indptr decreases",
                                 "indptr past the indices", "more pages than a row holds"])
def test_a_bad_csr_row_gets_no_work_and_status_bit_1(fake_device, pool, bad):  # noqa: F811
    b, _ = pool
    cache = (b.k_cache, b.v_cache)
    seq, bt, q = step_inputs(b, [1, 2, 3], 0, seed=11)
    ip, ind, lpl = csr(seq, bt)
    if bad == "last_page_len 0":
        lpl[1] = 0
    elif bad == "last_page_len past the page":
        lpl[1] = PAGE + 1
    elif bad == "indptr decreases":
        ip[2] = ip[1] - 1
    elif bad == "indptr past the indices":
        ind = ind[:int(ip[2]) - 1].clone()              # row 1 ends past the last entry, and
        ip[3] = ip[2]                                    # row 2 (no pages) starts past it: bad too
    else:
        ip = torch.tensor([0, 1, 1 + 300, 301 + 1], dtype=torch.int32)
        ind = torch.zeros(302, dtype=torch.int32)
        lpl = torch.tensor([1, 1, 1], dtype=torch.int32)
    rt = device_runtime(b, max_pages_per_row=256)
    rt.plan_csr(ip, ind, lpl)
    out = rt.run(q, *cache, out=torch.full_like(q, 5.0))
    assert rt.device_status(raise_on_error=False) & 2
    with pytest.raises(RuntimeError, match="seq_len"):
        rt.device_status()
    assert torch.all(out[1] == 5.0)
    if bad == "indptr past the indices":
        assert torch.all(out[2] == 5.0)
    if bad.startswith("last_page_len"):                  # the other rows are planned as usual
        keep = [0, 2]
        assert rel_err(out[keep], ref(q, cache, seq, bt)[keep]) < 2e-3


def test_arguments_are_refused_before_any_launch(fake_device, pool):  # noqa: F811
    b, _ = pool
    seq, bt, _ = step_inputs(b, [0, 1], 0, seed=1)
    ip, ind, lpl = csr(seq, bt)
    rt = device_runtime(b, max_batch=2)
    launches = fake_device.launches
    for args, match in (((ip.long(), ind, lpl), "indptr: expected a contiguous 1-D int32"),
                        ((ip, ind.view(1, -1), lpl), "indices: expected a contiguous 1-D int32"),
                        ((ip, ind, lpl.numpy()), "last_page_len: expected a contiguous 1-D int32"),
                        ((ip[:-1], ind, lpl), r"indptr: expected \[batch \+ 1 = 3\]"),
                        ((torch.zeros(4, dtype=torch.int32), ind, torch.ones(3, dtype=torch.int32)),
                         "last_page_len: expected 1 to max_batch = 2 rows, got 3")):
        with pytest.raises(ValueError, match=match):
            rt.plan_csr(*args)
    with pytest.raises(ValueError, match="force='pkv_bucket'"):
        rt.plan_csr(ip, ind, lpl, force="pkv_bucket")
    assert fake_device.launches == launches and rt._step is None
    host = fake_runtime()
    host.plan(seq, bt)
    launches = fake_device.launches
    with pytest.raises(RuntimeError, match="needs device planning"):
        host.plan_csr(ip, ind, lpl)
    graphs_on = fake_runtime(device_planning=True, num_pages=b.k_cache.shape[0])
    with pytest.raises(RuntimeError, match="own graphs"):
        graphs_on.plan_csr(ip, ind, lpl)
    assert fake_device.launches == launches


def test_the_kernel_wrapper_refuses_mixed_direct_modes():
    bt = torch.zeros(2, 4, dtype=torch.int32)
    ip, lpl, ind = torch.zeros(3, dtype=torch.int32), torch.ones(2, dtype=torch.int32), torch.zeros(8, dtype=torch.int32)
    check = ops.check_plan_direct_args
    with pytest.raises(ops.KernelArgumentError, match="src_indptr/src_last_page_len"):
        check(2, bt, PAGE, None, ind, 2, 64, src_indptr=ip)
    with pytest.raises(ops.KernelArgumentError, match="src_seq_lens"):
        check(2, bt, PAGE, lpl, ind, 2, 64, src_indptr=ip, src_last_page_len=lpl)
    with pytest.raises(ops.KernelArgumentError, match="src_block_tables"):
        check(2, bt, PAGE, None, bt, 2, 64, src_indptr=ip, src_last_page_len=lpl)
    with pytest.raises(ops.KernelArgumentError, match="rows/max_seq"):
        check(2, bt, PAGE, None, ind, None, None, src_indptr=ip, src_last_page_len=lpl)
    with pytest.raises(ops.KernelArgumentError, match="src_indptr"):
        check(2, bt, PAGE, None, ind, 2, 64, src_indptr=ip[:2], src_last_page_len=lpl)
    with pytest.raises(ops.KernelArgumentError, match="block_tables"):
        check(2, bt, PAGE, None, ind, 2, 65, src_indptr=ip, src_last_page_len=lpl)
    assert check(2, bt, PAGE, None, ind, 2, 64, src_indptr=ip, src_last_page_len=lpl)


def test_the_wrapper_plans_cuda_graph_steps_from_the_csr(fake_device, pool, monkeypatch):  # noqa: F811
    """CUDA-graph mode: plan() is the buffer copies and one planning launch (in the kernel's
    direct mode) reading them; no block table is built first (device_step is not called);
    sinks re-plan the same way."""
    from test_wrapper_cpu import HKV, HQ, D, wrapper

    b, _ = pool
    cache = (b.k_cache, b.v_cache)
    bufs = dict(paged_kv_indptr_buffer=torch.zeros(4, dtype=torch.int32),
                paged_kv_indices_buffer=torch.zeros(2048, dtype=torch.int32),
                paged_kv_last_page_len_buffer=torch.zeros(3, dtype=torch.int32))
    w = wrapper(use_cuda_graph=True, **bufs)
    monkeypatch.setattr(wmod, "device_step", lambda *a, **k: pytest.fail("built a block table first"))
    for rows, short in (([0, 1, 4], 3), ([2, 5, 3], 0)):
        seq, bt, q = step_inputs(b, rows, short, seed=short)
        ip, ind, lpl = csr(seq, bt)
        direct = fake_device.direct
        w.plan(ip, ind, lpl, HQ, HKV, D, PAGE, q_data_type=torch.float16)
        out = w.run(q, cache)   # (the first step's planning launch waits for the first cache)
        assert fake_device.direct == direct + 1
        assert rel_err(out, ref(q, cache, seq, bt)) < 2e-3
    sinks = torch.randn(HQ)
    out = w.run(q, cache, sinks=sinks)
    from pkvrt import reference
    want = reference.decode_attention(q, *cache, torch.as_tensor(seq), torch.as_tensor(bt), sinks=sinks)
    assert w.runtime.sinks and rel_err(out, want) < 2e-3


def test_a_shared_pages_wrapper_still_builds_block_tables(fake_device, pool, monkeypatch):  # noqa: F811
    from test_wrapper_cpu import HKV, HQ, D, wrapper

    b, _ = pool
    bufs = dict(paged_kv_indptr_buffer=torch.zeros(3, dtype=torch.int32),
                paged_kv_indices_buffer=torch.zeros(2048, dtype=torch.int32),
                paged_kv_last_page_len_buffer=torch.zeros(2, dtype=torch.int32))
    w = wrapper(use_cuda_graph=True, share_prefixes=True, **bufs)
    calls = []
    real = wmod.device_step
    monkeypatch.setattr(wmod, "device_step", lambda *a, **k: calls.append(1) or real(*a, **k))
    seq, bt, q = step_inputs(b, [0, 1], 0, seed=2)
    w.plan(*csr(seq, bt), HQ, HKV, D, PAGE, q_data_type=torch.float16)
    assert calls and not w._csr_direct(w.runtime)
    assert rel_err(w.run(q, (b.k_cache, b.v_cache)), ref(q, (b.k_cache, b.v_cache), seq, bt)) < 2e-3


def test_the_planning_launch_is_prepared_once_per_buffers_and_follows_their_values(fake_device, pool):  # noqa: F811
    """Steps planned from the same CSR buffers reuse one prepared planning launch
    (ops.PreparedLaunch: the checks and the packed struct once) and each is planned from the
    buffers' values at its launch; other buffers (another address, another size) prepare anew."""
    b, _ = pool
    cache = (b.k_cache, b.v_cache)
    rt = device_runtime(b)
    ip, ind, lpl = (torch.zeros(9, dtype=torch.int32), torch.zeros(4096, dtype=torch.int32),
                    torch.zeros(8, dtype=torch.int32))
    prepared = fake_device.prepared
    for short in (3, 2, 1):                       # the rows grow a token a step
        seq, bt, q = step_inputs(b, [0, 2, 4, 5], short, seed=short)
        s_ip, s_ind, s_lpl = csr(seq, bt)
        ip[:5].copy_(s_ip)
        ind[:s_ind.shape[0]].copy_(s_ind)
        lpl[:4].copy_(s_lpl)
        launches = fake_device.launches
        rt.plan_csr(ip[:5], ind, lpl[:4])
        assert fake_device.launches == launches + 1
        assert rel_err(rt.run(q, *cache), ref(q, cache, seq, bt)) < 2e-3
    assert fake_device.prepared == prepared + 1
    rt.plan_csr(*csr(seq, bt))                    # new tensors: a new preparation
    assert fake_device.prepared == prepared + 2
    assert rel_err(rt.run(q, *cache), ref(q, cache, seq, bt)) < 2e-3
