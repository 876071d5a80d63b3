"""Runtime(device_planning=True) on the GPU: split counts and tasks built by the planning kernel
from device-resident lengths give the host-lengths Runtime's output bit for bit (the same
kernel plans its workqueue/fused steps from lengths it uploads; test_runtime.py checks that plan
against the host planner task for task), over steps whose rows join and leave; a whole
multi-layer step captured in an engine's own CUDA graph replays correctly with new lengths; bad
lengths are flagged, not read."""

from __future__ import annotations

import torch

import pytest
from test_runtime import POOL_LENS, SHAPE, STEPS, check, pool, step_inputs  # noqa: F401

from pkvrt.runtime import Runtime, graphs
from pkvrt.runtime.options import RuntimeOptions, with_options

pytestmark = pytest.mark.gpu


def dev(x):
    return torch.as_tensor(x, device="cuda")


@pytest.mark.parametrize("use_graphs", [True, False], ids=["graphs", "eager"])
@pytest.mark.parametrize("force", [None, "pkv_workqueue", "pkv_fused"])
def test_device_planning_equals_host_planning(pool, use_graphs, force):  # noqa: F811
    b, caches = pool
    kw = dict(max_batch=8, max_pages_per_row=b.block_tables.shape[1], use_cuda_graph=use_graphs)
    rt_dev = Runtime(*SHAPE.values(), torch.float16, device_planning=True, **with_options(kw))
    rt_host = Runtime(*SHAPE.values(), torch.float16, **with_options(kw, flashinfer=False))
    for i, (rows, short) in enumerate(STEPS):
        seq, bt, q = step_inputs(b, rows, short, seed=i)
        rt_dev.plan(dev(seq), dev(bt), force=force)
        rt_host.plan(seq, bt, force=force or rt_dev.registry.device_planning_route().name)
        for layer, cache in enumerate(caches):
            out = rt_dev.run(q, *cache, out=torch.full_like(q, float("nan")))
            check(out, q, cache, seq, bt, f"device planning step {i} layer {layer}")
            host = rt_host.run(q, *cache, out=torch.empty_like(q))
            assert torch.equal(out, host), f"step {i} layer {layer}: differs from host planning"
        assert rt_dev.device_status() == 0
    if use_graphs:
        assert rt_dev.stats()["replays"] > 0


@pytest.mark.parametrize("how", ["inferred", "graphs off"])
@pytest.mark.parametrize("force", [None, "pkv_workqueue", "pkv_fused"])
def test_engine_captures_a_whole_step_and_replays_it_with_new_lengths(pool, force, how):  # noqa: F811
    """plan() + run() for 4 layers inside the engine's own torch.cuda.graph (every launch lands
    in the engine's graph, with early K/V copies from layer 2 on); lengths change between
    replays. "inferred": the README's Runtime, no mode given: the GPU lengths make it device
    planning, and its own graphs (used by the warm-up) give way to launches inside the capture;
    "graphs off": RuntimeOptions(use_cuda_graph=False). pkv_fused (the default): the merge in the
    decode tail, whose completion counters must come back to zero after every layer and replay."""
    b, caches = pool
    rows = [0, 1, 2, 3]
    kw = (dict(device_planning=True, options=RuntimeOptions(use_cuda_graph=False))
          if how == "graphs off" else {})
    rt = Runtime(*SHAPE.values(), torch.float16, max_batch=8,
                 max_pages_per_row=b.block_tables.shape[1], **kw)
    seq0, bt, q = step_inputs(b, rows, 40, seed=7)
    seq_dev, bt_dev = dev(seq0), dev(bt)
    layers = [caches[i % 2] for i in range(4)]
    outs = [torch.empty_like(q) for _ in layers]

    def step():
        rt.plan(seq_dev, bt_dev, force=force)
        for cache, out in zip(layers, outs):
            rt.run(q, *cache, out=out)

    g = graphs.capture(step).graph   # warm-up (loads kernels, sizes buffers), then capture
    for short in (40, 17, 3, 0):     # no host planning between replays: only the lengths move
        seq = [max(1, POOL_LENS[r] - short) for r in rows]
        seq_dev.copy_(torch.tensor(seq, dtype=seq_dev.dtype))
        for out in outs:
            out.fill_(float("nan"))
        g.replay()
        for layer, (cache, out) in enumerate(zip(layers, outs)):
            check(out, q, cache, seq, bt, f"engine graph short={short} layer {layer}")
    assert rt.device_status() == 0


@pytest.mark.parametrize("bound", ["num_pages", "first cache"])
@pytest.mark.parametrize("use_graphs", [True, False], ids=["graphs", "direct"])
@pytest.mark.parametrize("bad", ["length", "page 69", "page 50000000", "page -1"])
def test_a_bad_row_is_flagged_and_never_read(pool, bad, use_graphs, bound):  # noqa: F811
    """A row whose length exceeds its block table, or whose block table holds a page id outside
    the cache (just past it, far past it, negative) in a page its length uses: the planning
    kernel gives the row no work (before the page check: a silent read past the cache, or an
    illegal address that killed the CUDA context), the rows around it are exact, and
    device_status() names the cause; the next good step runs every row. Both ways of planning:
    the inputs copied into the planning graph's buffers, and (graphs off) the planning kernel
    copying them itself (direct mode). The bad step is the Runtime's first: with the page-id
    bound given at construction, or learned from the first run()'s cache (that run() then
    plans the step, after setting the bound)."""
    b, caches = pool
    pages = caches[0][0].shape[0]
    rt = Runtime(*SHAPE.values(), torch.float16, device_planning=True, max_batch=8,
                 max_pages_per_row=b.block_tables.shape[1],
                 num_pages=pages if bound == "num_pages" else None,
                 options=RuntimeOptions(use_cuda_graph=use_graphs))
    seq, bt, q = step_inputs(b, [0, 2, 3], 0, seed=3)
    bad_seq, bad_bt = seq.copy(), bt.copy()
    if bad == "length":
        bad_seq[1] = bt.shape[1] * SHAPE["page_size"] + 1
        bit, match = 2, "seq_len was outside"
    else:
        page = int(bad.split()[1])
        bad_bt[1, (int(seq[1]) - 1) // SHAPE["page_size"]] = pages + 5 if page == 69 else page
        bit, match = 4, "page id outside"
    rt.plan(dev(bad_seq), dev(bad_bt))
    rt.static_q(3).copy_(q)
    rt.static_out(3).fill_(7.0)
    out = rt.run(rt.static_q(3), *caches[0], out=rt.static_out(3))
    torch.cuda.synchronize()
    assert torch.all(out[1] == 7.0)
    check(out[[0, 2]].contiguous(), q[[0, 2]].contiguous(), caches[0], seq[[0, 2]], bt[[0, 2]],
          f"rows around a row with a bad {bad}")
    assert rt.device_status(raise_on_error=False) == bit
    with pytest.raises(RuntimeError, match=match):
        rt.device_status()
    rt.plan(dev(seq), dev(bt))
    out = rt.run(rt.static_q(3), *caches[0], out=rt.static_out(3))
    check(out, q, caches[0], seq, bt, "the good step after a bad one")
    assert rt.device_status() == 0


def test_capturing_plan_of_host_lengths_is_refused(pool):  # noqa: F811
    """Host lengths are planned on the host: such a plan() inside an engine's capture is refused
    (engine_capture=True plans outside the capture); GPU lengths capture (the test above)."""
    b, caches = pool
    rt = Runtime(*SHAPE.values(), torch.float16, max_batch=8, device_planning=False,
                 max_pages_per_row=b.block_tables.shape[1],
                 options=RuntimeOptions(flashinfer=False, use_cuda_graph=False))
    seq, bt, _ = step_inputs(b, [0, 1], 0, seed=1)
    rt.plan(seq, bt)   # warm-up outside capture works
    g = torch.cuda.CUDAGraph()
    with pytest.raises(RuntimeError, match="host planning .* cannot be captured"):
        with torch.cuda.graph(g):
            rt.plan(seq, bt)
