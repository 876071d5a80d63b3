"""FP8 (float8_e4m3fn) K/V on the GPU: every kernel route and the Runtime (host and device
planning) against the FP32 reference over the *dequantized* cache (the FP8 error is in the data,
not the kernel, so the tolerance is the fp16 tests'), one end-to-end check against the
unquantized cache within ``reference.fp8_error_bound``, NaN-poisoned outputs and partial states,
ragged batches, page sizes 1-64, D 64/128/256, G 1/2/4/8, per-tensor and per-KV-head scales, a
graph replayed with new scale values, bad scales refused before any launch.

Data: tests/paged.py (unowned pages and row tails hold NaN, which quantizes to e4m3 NaN: a read
of what must not be read poisons the output; block-table padding is an out-of-range page id).
"""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch

from paged import make_batch, rel_err, simple_tasks
from pkvrt import reference
from pkvrt.launch import _driver, ops
from pkvrt.runtime import Runtime, graphs
from pkvrt.runtime.options import with_options

pytestmark = pytest.mark.gpu
FP8 = torch.float8_e4m3fn
TILE = 32
TOL = {torch.float16: 2e-3, torch.bfloat16: 1e-2}


class Fp8Batch:
    """A paged batch (float32 values) with its FP8 copy: q in ``dtype``, caches e4m3 with
    float32 scales per KV head or per tensor; ``ref`` is the FP32 answer over the dequantized
    caches."""

    def __init__(self, lens, *, hq, hkv, d, page, dtype, per_head, seed, scale=1.0):
        self.b = make_batch(lens, num_qo_heads=hq, num_kv_heads=hkv, head_dim=d, page_size=page,
                            dtype=torch.float32, seed=seed, scale=scale)
        self.q = self.b.q.to(dtype)
        self.k, self.ks = reference.quantize_kv(self.b.k_cache, per_head=per_head)
        self.v, self.vs = reference.quantize_kv(self.b.v_cache, per_head=not per_head if hkv > 1 else per_head)
        self.seq, self.bt = self.b.seq_lens, self.b.block_tables

    def ref(self):
        return reference.decode_attention(self.q, self.k, self.v, self.seq, self.bt,
                                          k_scale=self.ks, v_scale=self.vs)


def run_split(x: Fp8Batch, splits):
    rows = x.q.shape[0]
    out = torch.full_like(x.q, math.nan)
    row_ids = torch.arange(rows, dtype=torch.int32, device="cuda")
    part_a = torch.full((rows * splits, *x.q.shape[1:]), math.nan, device="cuda")
    part_ml = torch.full((rows * splits, x.q.shape[1], 2), math.nan, device="cuda")
    ops.split_decode(x.q, x.k, x.v, x.seq, x.bt, row_ids, splits, out, part_a, part_ml,
                     k_scale=x.ks, v_scale=x.vs)
    if splits > 1:
        ops.merge(part_a, part_ml, torch.arange(rows + 1, dtype=torch.int32, device="cuda") * splits,
                  out, row_ids=row_ids)
    return out


def run_workqueue(x: Fp8Batch, splits, fused=False):
    hkv = x.k.shape[1]
    tasks, offsets = simple_tasks(x.seq.tolist(), hkv, splits)
    t = torch.full((len(tasks) + 5, 5), -1, dtype=torch.int32)   # 5 idle grid slots
    t[:len(tasks)] = torch.tensor(tasks, dtype=torch.int32)
    i32 = dict(dtype=torch.int32, device="cuda")
    num, off = torch.tensor([len(tasks)], **i32), torch.tensor(offsets, **i32)
    out = torch.full_like(x.q, math.nan)
    part_a = torch.full((offsets[-1], *x.q.shape[1:]), math.nan, device="cuda")
    part_ml = torch.full((offsets[-1], x.q.shape[1], 2), math.nan, device="cuda")
    counters = torch.zeros(x.q.shape[0], hkv, **i32) if fused else None
    ops.workqueue_decode(x.q, x.k, x.v, x.seq, x.bt, t.cuda(), num, off, out, part_a, part_ml,
                         counters=counters, k_scale=x.ks, v_scale=x.vs)
    if not fused:
        ops.merge(part_a, part_ml, off, out, skip_single=True)
    elif counters.sum().item() != 0:
        raise AssertionError("fused counters not reset")
    return out


ROUTES = {"split1": lambda x: run_split(x, 1), "split7": lambda x: run_split(x, 7),
          "workqueue": lambda x: run_workqueue(x, 8), "fused": lambda x: run_workqueue(x, 8, True)}

# (lens, H_q, H_kv, D, page, q dtype, scales per KV head): every D, G, page size 1..64, both q
# dtypes, both scale kinds, ragged rows (1 token, one tile, tile + 1, page-unaligned, long).
SHAPES = [
    ([1, 17, 32, 33, 500, 4096], 32, 8, 128, 16, torch.float16, True),
    ([2048, 1, 999], 8, 8, 64, 1, torch.bfloat16, False),
    ([300, 5000], 16, 2, 256, 64, torch.float16, True),
    ([4097, 64, 31], 16, 8, 128, 8, torch.bfloat16, True),
    ([777, 12345], 8, 1, 128, 32, torch.float16, False),
    ([3000, 65, 1000], 8, 4, 64, 2, torch.float16, True),
    ([129, 2500], 16, 2, 256, 4, torch.bfloat16, False),
    ([6000, 7, 640, 2], 64, 8, 128, 64, torch.bfloat16, True),
]


@pytest.mark.parametrize("shape", SHAPES, ids=lambda s: f"hq{s[1]}-hkv{s[2]}-d{s[3]}-p{s[4]}-{str(s[5])[6:]}"
                         f"-{'head' if s[6] else 'tensor'}")
@pytest.mark.parametrize("route", list(ROUTES))
def test_fp8_kernels_match_the_dequantized_reference(shape, route):
    lens, hq, hkv, d, page, dtype, per_head = shape
    x = Fp8Batch(lens, hq=hq, hkv=hkv, d=d, page=page, dtype=dtype, per_head=per_head,
                 seed=sum(lens) + 7 * list(ROUTES).index(route))
    out = ROUTES[route](x)
    assert not torch.isnan(out).any(), "an output element was not written or NaN leaked in"
    assert rel_err(out, x.ref()) < TOL[dtype]


@pytest.mark.parametrize("d", [64, 128, 256])
@pytest.mark.parametrize("g", [1, 2, 4, 8])
def test_fp8_every_group_and_dim(d, g):
    for dtype, per_head in ((torch.float16, True), (torch.bfloat16, False)):
        x = Fp8Batch([100, 3000], hq=2 * g, hkv=2, d=d, page=16, dtype=dtype, per_head=per_head,
                     seed=d * g)
        ref = x.ref()
        for name in ("split7", "workqueue", "fused"):
            out = ROUTES[name](x)
            assert not torch.isnan(out).any(), (d, g, dtype, name)
            assert rel_err(out, ref) < TOL[dtype], (d, g, dtype, name)


def test_fp8_error_against_the_unquantized_cache_is_within_the_bound():
    """End to end: the kernel over FP8 vs FP32 attention over the float32 values it came from."""
    x = Fp8Batch([1, 37, 300, 4000], hq=32, hkv=8, d=128, page=16, dtype=torch.float16,
                 per_head=True, seed=11)
    exact = reference.decode_attention(x.b.q, x.b.k_cache, x.b.v_cache, x.seq, x.bt, dtype=torch.float64)
    bound = reference.fp8_error_bound(x.b.q, x.b.k_cache, x.b.v_cache, x.seq, x.bt,
                                      k_scale=x.ks, v_scale=x.vs)
    for name in ("split7", "fused"):
        err = (ROUTES[name](x).double() - exact).norm().item()
        assert err <= bound, (name, err, bound)


def test_fp8_large_logits_stay_finite():
    x = Fp8Batch([2000, 1], hq=32, hkv=8, d=128, page=16, dtype=torch.float16, per_head=True,
                 seed=3, scale=70.0)   # q and k x 70: |q.k| ~ 1e4 before the softmax scale
    ref = x.ref()
    for name in ("split7", "workqueue"):
        out = ROUTES[name](x)
        assert torch.isfinite(out).all() and rel_err(out, ref) < TOL[torch.float16]


def test_fp8_graph_replay_reads_new_scale_values():
    """Scales are pointers: a captured split + merge replayed after the scales changed in place
    gives the answer for the new values (V scale x2 doubles O; a new K scale sharpens it)."""
    x = Fp8Batch([1000, 5000], hq=32, hkv=8, d=128, page=16, dtype=torch.float16, per_head=True, seed=9)
    rows, splits = 2, 8
    out = torch.empty_like(x.q)
    row_ids = torch.arange(rows, dtype=torch.int32, device="cuda")
    part_a = torch.empty((rows * splits, *x.q.shape[1:]), device="cuda")
    part_ml = torch.empty((rows * splits, x.q.shape[1], 2), device="cuda")
    offsets = torch.arange(rows + 1, dtype=torch.int32, device="cuda") * splits
    ks0, vs0 = x.ks.clone(), x.vs.clone()

    def step():
        ops.split_decode(x.q, x.k, x.v, x.seq, x.bt, row_ids, splits, out, part_a, part_ml,
                         k_scale=x.ks, v_scale=x.vs)
        ops.merge(part_a, part_ml, offsets, out, row_ids=row_ids)

    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        step()
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph(keep_graph=True)
    with torch.cuda.graph(graph):
        step()
    assert _driver.graph_node_count(graph) >= 2
    for k_mul, v_mul in ((1.0, 1.0), (1.0, 2.0), (3.0, 0.5)):
        x.ks.copy_(ks0 * k_mul)
        x.vs.copy_(vs0 * v_mul)
        out.fill_(math.nan)
        graph.replay()
        torch.cuda.synchronize()
        assert rel_err(out, x.ref()) < TOL[torch.float16], (k_mul, v_mul)


@pytest.mark.parametrize("change, match", [   # (built once CUDA is there: not at collection)
    (lambda x: dict(k_scale=None), r"k_scale: expected .* \(float8_e4m3fn caches need scales\), got None"),
    (lambda x: dict(v_scale=x.vs.cpu()), r"v_scale: expected .* on cuda:\d, got torch.float32 \(\d+,\) on cpu"),
    (lambda x: dict(k_scale=torch.ones(3, device="cuda")), r"k_scale: expected a contiguous float32 \[1\] or \[H_kv=8\]"),
    (lambda x: dict(v_scale=torch.ones(8, device="cuda", dtype=torch.float16)), r"v_scale: .* got torch.float16"),
], ids=["missing", "host", "shape", "dtype"])
def test_fp8_bad_scales_are_refused_and_nothing_is_written(change, match):
    x = Fp8Batch([500, 40], hq=32, hkv=8, d=128, page=16, dtype=torch.float16, per_head=True, seed=5)
    scales = dict(k_scale=x.ks, v_scale=x.vs) | change(x)
    out = torch.full_like(x.q, 5.0)
    row_ids = torch.arange(2, dtype=torch.int32, device="cuda")
    with pytest.raises(ops.KernelArgumentError, match=match):
        ops.split_decode(x.q, x.k, x.v, x.seq, x.bt, row_ids, 1, out, **scales)
    with pytest.raises(ops.KernelArgumentError, match=match):
        ops.workqueue_decode(x.q, x.k, x.v, x.seq, x.bt, torch.zeros(1, 5, dtype=torch.int32, device="cuda"),
                             torch.zeros(1, dtype=torch.int32, device="cuda"),
                             torch.zeros(3, dtype=torch.int32, device="cuda"), out, None, None, **scales)
    torch.cuda.synchronize()
    assert (out == 5.0).all()


def test_no_local_memory_in_the_fp8_kernels():
    x = Fp8Batch([64], hq=32, hkv=8, d=256, page=16, dtype=torch.bfloat16, per_head=True, seed=1)
    run_split(x, 2)
    run_workqueue(x, 2, fused=True)
    for fam in ("split_decode", "fused_decode"):
        sym = f"pkv_{fam}_bf16_e4m3_d256_gc4"
        k = _driver.get_kernel(fam, sym, ops.decode_smem_bytes(256, 4, 1))
        assert _driver.function_attributes(k)["local_bytes"] == 0, sym


# ----------------------------------------------------------------------------- the Runtime

SHAPE = dict(num_qo_heads=32, num_kv_heads=8, head_dim=128, page_size=16)
POOL_LENS = [20000, 17000, 5000, 900, 33, 12000]
STEPS = [([0, 1, 2, 3], 5), ([0, 1, 2, 3, 4], 3), ([0, 2, 3, 4], 1), ([0, 2, 3, 4, 5], 0)]


@pytest.fixture(scope="module")
def fp8_pool():
    """Two layers of FP8 pages for the pool of requests: layer 0 per-head scales, layer 1 per
    tensor."""
    b = make_batch(POOL_LENS, **SHAPE, dtype=torch.float32, seed=20260623)
    layers = []
    for per_head, gen in ((True, None), (False, 1)):
        k, v = b.k_cache, b.v_cache
        if gen is not None:
            k, v = torch.randn_like(k), torch.randn_like(v)
            k[~b.owned], v[~b.owned] = math.nan, math.nan
        kq, ks = reference.quantize_kv(k, per_head=per_head)
        vq, vs = reference.quantize_kv(v, per_head=per_head)
        layers.append((kq, vq, ks, vs))
    return b, layers


def step_inputs(b, rows, short, seed):
    seq = np.array([max(1, POOL_LENS[r] - short) for r in rows], dtype=np.int32)
    bt = b.block_tables[rows].cpu().numpy()
    gen = torch.Generator(device="cuda").manual_seed(seed)
    q = torch.randn(len(rows), SHAPE["num_qo_heads"], SHAPE["head_dim"], device="cuda", generator=gen)
    return seq, bt, q.half()


def check(out, q, layer, seq, bt, what):
    kq, vq, ks, vs = layer
    torch.cuda.synchronize()
    assert not torch.isnan(out).any(), f"{what}: NaN (an element not written, or a poisoned read)"
    ref = reference.decode_attention(q, kq, vq, torch.as_tensor(seq, device="cuda"),
                                     torch.as_tensor(bt, device="cuda"), k_scale=ks, v_scale=vs)
    assert rel_err(out, ref) < TOL[torch.float16], what


def fp8_runtime(b, **kw):
    return Runtime(*SHAPE.values(), torch.float16, kv_dtype=FP8, max_batch=8,
                   max_pages_per_row=b.block_tables.shape[1], **with_options(kw))


@pytest.mark.parametrize("use_graphs", [True, False], ids=["graphs", "eager"])
@pytest.mark.parametrize("route", ["pkv_bucket", "pkv_workqueue", "pkv_fused", None],
                         ids=lambda r: r or "auto")
def test_fp8_runtime_every_route(fp8_pool, route, use_graphs):
    b, layers = fp8_pool
    rt = fp8_runtime(b, use_cuda_graph=use_graphs)
    assert rt.router.dtype_bytes == 1 and not rt.flashinfer_available
    for i, (rows, short) in enumerate(STEPS):
        seq, bt, q = step_inputs(b, rows, short, seed=i)
        d = rt.plan(seq, bt, force=route)
        assert d.kind != "flashinfer"
        _run_layers(rt, layers, q, seq, bt, len(rows), f"step {i} {d.route}")
    if use_graphs:
        # A bucket step's structure follows its lengths (a workqueue/fused step's grid only its
        # padded batch), so each step above may have been a capture; the same step again
        # replays. (Not one replay per layer: layer 0's fresh q and out tensors are part of its
        # graph key, and the allocator may give them new addresses; the static-buffer layers
        # replay.)
        before = rt.stats()["replays"]
        rt.plan(seq, bt, force=route)
        _run_layers(rt, layers, q, seq, bt, len(rows), f"replayed step {d.route}")
        assert rt.stats()["replays"] > before


def _run_layers(rt, layers, q, seq, bt, rows, what):
    """One step's layers: layer 0 from a fresh q (staged), the others from the static buffers."""
    for layer_i, (kq, vq, ks, vs) in enumerate(layers):
        if layer_i == 0:
            out = rt.run(q.clone(), kq, vq, out=torch.full_like(q, math.nan), k_scale=ks, v_scale=vs)
        else:
            rt.static_q(rows).copy_(q)
            rt.static_out(rows).fill_(math.nan)
            out = rt.run(rt.static_q(rows), kq, vq, out=rt.static_out(rows), k_scale=ks, v_scale=vs)
        check(out, q, layers[layer_i], seq, bt, f"{what} layer {layer_i}")


@pytest.mark.parametrize("use_graphs", [True, False], ids=["graphs", "eager"])
@pytest.mark.parametrize("force", [None, "pkv_workqueue"])
def test_fp8_device_planning(fp8_pool, use_graphs, force):
    b, layers = fp8_pool
    rt = fp8_runtime(b, use_cuda_graph=use_graphs, device_planning=True)
    host = fp8_runtime(b, use_cuda_graph=use_graphs, flashinfer=False)
    for i, (rows, short) in enumerate(STEPS):
        seq, bt, q = step_inputs(b, rows, short, seed=30 + i)
        rt.plan(torch.as_tensor(seq, device="cuda"), torch.as_tensor(bt, device="cuda"), force=force)
        host.plan(seq, bt, force=force or rt.registry.device_planning_route().name)
        for layer in layers:
            out = rt.run(q, layer[0], layer[1], out=torch.full_like(q, math.nan), k_scale=layer[2],
                         v_scale=layer[3])
            check(out, q, layer, seq, bt, f"device planning step {i}")
            same = host.run(q, layer[0], layer[1], out=torch.empty_like(q), k_scale=layer[2], v_scale=layer[3])
            assert torch.equal(out, same), f"step {i}: differs from host planning"
        assert rt.device_status() == 0


def test_fp8_engine_step_graph_replays_with_new_lengths_and_scales(fp8_pool):
    """plan() + 2 layers captured in the engine's own graph (device planning, graphs off in the
    Runtime); replays after the lengths and the scales changed in place."""
    b, layers = fp8_pool
    rt = fp8_runtime(b, use_cuda_graph=False, device_planning=True)
    rows = [0, 1, 2, 3]
    seq0, bt, q = step_inputs(b, rows, 40, seed=7)
    seq_dev, bt_dev = torch.as_tensor(seq0, device="cuda"), torch.as_tensor(bt, device="cuda")
    scales = [(layer[2].clone(), layer[3].clone()) for layer in layers]
    outs = [torch.empty_like(q) for _ in layers]

    def step():
        rt.plan(seq_dev, bt_dev)
        for layer, (ks, vs), out in zip(layers, scales, outs):
            rt.run(q, layer[0], layer[1], out=out, k_scale=ks, v_scale=vs)

    graph = graphs.capture(step).graph
    for i, (short, v_mul) in enumerate([(40, 1.0), (7, 2.0), (0, 0.25)]):
        seq = np.array([max(1, POOL_LENS[r] - short) for r in rows], dtype=np.int32)
        seq_dev.copy_(torch.as_tensor(seq))
        for layer, (ks, vs) in zip(layers, scales):
            vs.copy_(layer[3] * v_mul)
        for out in outs:
            out.fill_(math.nan)
        graph.replay()
        for layer, (ks, vs), out in zip(layers, scales, outs):
            check(out, q, (layer[0], layer[1], ks, vs), seq, bt, f"replay {i}")
    assert rt.device_status() == 0


def test_fp8_runtime_refuses_bad_scales_before_any_launch(fp8_pool):
    b, layers = fp8_pool
    kq, vq, ks, vs = layers[0]
    rt = fp8_runtime(b)
    seq, bt, q = step_inputs(b, [0, 1], 0, seed=3)
    rt.plan(seq, bt, force="pkv_workqueue")   # captures the planning graph (the plan is built on the GPU)
    captures = rt.stats()["captures"]
    for bad, match in ((dict(k_scale=torch.tensor([math.nan] * 8, device="cuda")), "k_scale: expected finite"),
                       (dict(v_scale=torch.zeros(1, device="cuda")), "v_scale: expected finite scales > 0"),
                       (dict(k_scale=None), "k_scale: expected a contiguous float32")):
        out = torch.full_like(q, 5.0)
        with pytest.raises(ValueError, match=match):
            rt.run(q, kq, vq, out=out, **(dict(k_scale=ks, v_scale=vs) | bad))
        torch.cuda.synchronize()
        assert (out == 5.0).all()
    assert rt.stats()["captures"] == captures   # no decode graph was captured
