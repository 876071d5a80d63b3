"""Runtime(kv_dtype=torch.float8_e4m3fn) on the fake device (CPU; test_runtime_cpu.py's emulated
kernels, which dequantize with the scales they are given): every route and device planning
against the FP32 reference over the dequantized cache, scales as graph inputs read at replay,
bad scales refused before any launch, FlashInfer not used. The kernels themselves: on the GPU
(tests/gpu/test_fp8.py) and their index math on the CPU (test_e4m3_layout.py)."""

from __future__ import annotations

import math

import pytest
import torch

from pkvrt import reference
from pkvrt.launch import ops
from test_runtime_cpu import STEPS, fake_device, fake_runtime, pool, rel_err, step_inputs  # noqa: F401

FP8 = torch.float8_e4m3fn
FP8_STEPS = STEPS[:2] + STEPS[-2:]   # a repeat (replays), rows joining and leaving; short CPU run


@pytest.fixture(scope="module")
def fp8_pool(pool):  # noqa: F811
    """The pool's two layers as FP8 caches: layer 0 per-KV-head scales, layer 1 per tensor (K)
    and per head (V)."""
    b, (k1, v1) = pool
    layers = []
    for k, v, per_head in ((b.k_cache, b.v_cache, (True, True)), (k1, v1, (False, True))):
        kq, ks = reference.quantize_kv(k, per_head=per_head[0])
        vq, vs = reference.quantize_kv(v, per_head=per_head[1])
        layers.append((kq, vq, ks, vs))
    return b, layers


def ref8(q, layer, seq, bt):
    kq, vq, ks, vs = layer
    return reference.decode_attention(q, kq, vq, torch.as_tensor(seq), bt, k_scale=ks, v_scale=vs)


def run8(rt, q, layer, out=None):
    kq, vq, ks, vs = layer
    return rt.run(q, kq, vq, out=torch.full_like(q, math.nan) if out is None else out,
                  k_scale=ks, v_scale=vs)


@pytest.mark.parametrize("use_graphs", [True, False], ids=["graphs", "eager"])
@pytest.mark.parametrize("route", ["pkv_bucket", "pkv_workqueue", "pkv_fused", None])
def test_fp8_decode_loop_matches_the_dequantized_reference(fake_device, fp8_pool, route, use_graphs):  # noqa: F811
    b, layers = fp8_pool
    rt = fake_runtime(use_cuda_graph=use_graphs, kv_dtype=FP8)
    assert rt.router.dtype_bytes == 1 and rt.kv_dtype == FP8 and rt.dtype == torch.float16
    for i, (rows, short) in enumerate(FP8_STEPS):
        seq, bt, q = step_inputs(b, rows, short, seed=i)
        d = rt.plan(seq, bt, force=route)
        assert d.kind != "flashinfer"
        for layer in layers:
            out = run8(rt, q, layer)
            assert not torch.isnan(out).any()
            assert rel_err(out, ref8(q, layer, seq, bt)) < 2e-3, (i, d.route)
    if use_graphs:
        assert rt.stats()["replays"] > 0


def test_fp8_replay_reads_the_scales_current_values(fake_device, fp8_pool):  # noqa: F811
    b, layers = fp8_pool
    kq, vq, ks, vs = (t.clone() for t in layers[0])
    rt = fake_runtime(kv_dtype=FP8)
    seq, bt, q = step_inputs(b, [0, 1, 2], 0, seed=4)
    rt.plan(seq, bt, force="pkv_workqueue")   # captures the planning graph of this batch
    rt.static_q(3).copy_(q)
    s0 = rt.stats()
    outs = []
    for k_mul, v_mul in ((1.0, 1.0), (1.0, 2.0), (0.5, 1.0)):
        ks.copy_(layers[0][2] * k_mul)
        vs.copy_(layers[0][3] * v_mul)
        out = rt.run(rt.static_q(3), kq, vq, out=rt.static_out(3), k_scale=ks, v_scale=vs)
        assert rel_err(out, ref8(q, (kq, vq, ks, vs), seq, bt)) < 2e-3
        outs.append(out.clone())
    assert torch.allclose(outs[1].float(), 2 * outs[0].float(), rtol=2e-3, atol=2e-3)   # linear in V
    assert not torch.allclose(outs[2], outs[0], rtol=1e-2, atol=1e-2)                    # K scale moved
    s = rt.stats()
    assert s["captures"] - s0["captures"] == 1 and s["replays"] - s0["replays"] == 2
    # another scale tensor (same values) is another graph: its address is what a graph keeps
    rt.run(rt.static_q(3), kq, vq, out=rt.static_out(3), k_scale=ks.clone(), v_scale=vs)
    assert rt.stats()["captures"] - s0["captures"] == 2


@pytest.mark.parametrize("change, match", [
    (dict(k_scale=None), r"Runtime.run: k_scale: expected a contiguous float32 \[1\] or \[H_kv=2\] .* got None"),
    (dict(v_scale=torch.ones(3)), r"Runtime.run: v_scale: expected .* got torch.float32 \(3,\)"),
    (dict(k_scale=torch.ones(2, dtype=torch.float64)), r"Runtime.run: k_scale: expected .* got torch.float64"),
    (dict(k_scale=torch.tensor([1.0, math.nan])), r"Runtime.run: k_scale: expected finite scales > 0, got \[1.0, nan\]"),
    (dict(v_scale=torch.tensor([math.inf])), r"Runtime.run: v_scale: expected finite scales > 0, got \[inf\]"),
    (dict(v_scale=torch.tensor([0.0, 1.0])), r"Runtime.run: v_scale: expected finite scales > 0"),
])
@pytest.mark.parametrize("use_graphs", [True, False], ids=["graphs", "eager"])
def test_bad_scales_are_refused_before_any_launch(fake_device, fp8_pool, change, match, use_graphs):  # noqa: F811
    b, layers = fp8_pool
    kq, vq, ks, vs = layers[0]
    rt = fake_runtime(kv_dtype=FP8, use_cuda_graph=use_graphs)
    seq, bt, q = step_inputs(b, [0, 3], 0, seed=5)
    rt.plan(seq, bt, force="pkv_bucket")
    args = dict(k_scale=ks, v_scale=vs) | change
    out = torch.full_like(q, 7.0)
    before = fake_device.launches
    with pytest.raises(ValueError, match=match):
        rt.run(q, kq, vq, out=out, **args)
    assert fake_device.launches == before and torch.all(out == 7.0)


def test_scale_values_are_read_once_per_tensor_version(fake_device, fp8_pool, monkeypatch):  # noqa: F811
    b, layers = fp8_pool
    kq, vq, ks, vs = (t.clone() for t in layers[0])
    reads = []
    real = ops.check_kv_scales

    def counting(*a, check_values=False, **kw):
        reads.append(check_values)
        return real(*a, check_values=check_values, **kw)
    monkeypatch.setattr(ops, "check_kv_scales", counting)
    rt = fake_runtime(kv_dtype=FP8)
    seq, bt, q = step_inputs(b, [0, 1], 0, seed=6)
    rt.plan(seq, bt, force="pkv_fused")
    for _ in range(3):
        run8(rt, q, (kq, vq, ks, vs))
    assert sum(reads) == 1                   # values read back once, metadata every call
    vs.mul_(2.0)                             # an in-place change through PyTorch: read again
    run8(rt, q, (kq, vq, ks, vs))
    assert sum(reads) == 2
    vs.fill_(math.nan)
    with pytest.raises(ValueError, match="v_scale: expected finite scales > 0"):
        run8(rt, q, (kq, vq, ks, vs))
    unchecked = fake_runtime(kv_dtype=FP8, validate=False)
    unchecked.plan(seq, bt, force="pkv_fused")
    n = sum(reads)
    run8(unchecked, q, (kq, vq, ks, vs))     # validate=False: metadata only, the NaN goes through
    assert sum(reads) == n


def test_fp8_runtime_does_not_use_flashinfer(fake_device, fp8_pool):  # noqa: F811
    b, layers = fp8_pool
    rt = fake_runtime(kv_dtype=FP8, flashinfer=True)
    assert not rt.flashinfer_available
    assert "not used with kv_dtype=float8_e4m3fn" in rt.explain()
    assert "float16, KV float8_e4m3fn" in rt.explain()
    seq, bt, q = step_inputs(b, [2, 3], 0, seed=8)            # short rows: the policy's FlashInfer step
    d = rt.plan(seq, bt)
    assert d.kind != "flashinfer" and "not used with kv_dtype" in d.refused["flashinfer"]
    assert rel_err(run8(rt, q, layers[0]), ref8(q, layers[0], seq, bt)) < 2e-3
    with pytest.raises(ValueError, match="the FlashInfer route is unavailable"):
        rt.plan(seq, bt, force="flashinfer")


@pytest.mark.parametrize("use_graphs", [True, False], ids=["graphs", "eager"])
def test_fp8_device_planning(fake_device, fp8_pool, use_graphs):  # noqa: F811
    b, layers = fp8_pool
    rt = fake_runtime(kv_dtype=FP8, device_planning=True, use_cuda_graph=use_graphs)
    for i, (rows, short) in enumerate(FP8_STEPS):
        seq, bt, q = step_inputs(b, rows, short, seed=20 + i)
        rt.plan(torch.as_tensor(seq), torch.as_tensor(bt))
        for layer in layers:
            assert rel_err(run8(rt, q, layer), ref8(q, layer, seq, bt)) < 2e-3, i
        assert rt.device_status() == 0


def test_fp8_runtime_refuses_fp16_caches_and_fp16_runtime_refuses_scales(fake_device, fp8_pool, pool):  # noqa: F811
    b, layers = fp8_pool
    kq, vq, ks, vs = layers[0]
    seq, bt, q = step_inputs(b, [0], 0, seed=9)
    rt8 = fake_runtime(kv_dtype=FP8)
    rt8.plan(seq, bt)
    with pytest.raises(ValueError, match=r"k_cache: expected dtype torch.float8_e4m3fn \(the Runtime's kv_dtype\)"):
        rt8.run(q, b.k_cache, b.v_cache, k_scale=ks, v_scale=vs)
    rt16 = fake_runtime()
    rt16.plan(seq, bt)
    with pytest.raises(ValueError, match=r"Runtime.run: k_scale: expected None \(scales are for float8_e4m3fn"):
        rt16.run(q, b.k_cache, b.v_cache, k_scale=ks, v_scale=vs)
