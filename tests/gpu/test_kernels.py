"""Kernels vs the FP32 reference on fresh random paged data (GPU; run on the H200).

Outputs are poisoned before each launch, pages no row owns and slots past seq_len hold NaN,
block-table padding holds an out-of-range page id: a kernel that reads what it must not, or
leaves an output element unwritten, fails here.
"""

import math

import pytest
import torch

from pkvrt import reference
from pkvrt.launch import _driver, ops
from paged import make_batch, rel_err, simple_tasks

pytestmark = pytest.mark.gpu
TILE = 32
TOL = {torch.float16: 2e-3, torch.bfloat16: 1e-2}


def poisoned_like(q):
    return torch.full_like(q, float("nan"))


def ref_out(b):
    return reference.decode_attention(b.q, b.k_cache, b.v_cache, b.seq_lens, b.block_tables)


def run_split(b, splits):
    rows = b.q.shape[0]
    out = poisoned_like(b.q)
    row_ids = torch.arange(rows, dtype=torch.int32, device="cuda")
    part_a = torch.full((rows * splits, *b.q.shape[1:]), float("nan"), device="cuda")
    part_ml = torch.full((rows * splits, b.q.shape[1], 2), float("nan"), device="cuda")
    ops.split_decode(b.q, b.k_cache, b.v_cache, b.seq_lens, b.block_tables, row_ids, splits, out,
                     part_a, part_ml)
    if splits > 1:
        offsets = torch.arange(rows + 1, dtype=torch.int32, device="cuda") * splits
        ops.merge(part_a, part_ml, offsets, out, row_ids=row_ids)
    return out


def run_workqueue(b, splits, fused=False, capacity_pad=7):
    hkv = b.k_cache.shape[1]
    tasks, offsets = simple_tasks(b.seq_lens.tolist(), hkv, splits)
    cap = len(tasks) + capacity_pad  # idle slots past num_tasks must exit
    t = torch.full((cap, 5), -1, dtype=torch.int32)
    t[: len(tasks)] = torch.tensor(tasks, dtype=torch.int32)
    t = t.cuda()
    num = torch.tensor([len(tasks)], dtype=torch.int32, device="cuda")
    off = torch.tensor(offsets, dtype=torch.int32, device="cuda")
    slots = offsets[-1]
    out = poisoned_like(b.q)
    part_a = torch.full((slots, *b.q.shape[1:]), float("nan"), device="cuda")
    part_ml = torch.full((slots, b.q.shape[1], 2), float("nan"), device="cuda")
    counters = torch.zeros(b.q.shape[0], hkv, dtype=torch.int32, device="cuda") if fused else None
    ops.workqueue_decode(b.q, b.k_cache, b.v_cache, b.seq_lens, b.block_tables, t, num, off, out,
                         part_a, part_ml, counters=counters)
    if not fused:
        ops.merge(part_a, part_ml, off, out, skip_single=True)
    return out, counters


SHAPES = [  # (seq_lens, H_q, H_kv, D, page, dtype)
    ([1, 17, 32, 33, 500, 4096], 32, 8, 128, 16, torch.float16),
    ([2048, 1, 999], 8, 8, 64, 1, torch.bfloat16),
    ([300, 5000], 16, 2, 256, 64, torch.float16),
    ([4097, 64, 31], 16, 8, 128, 8, torch.bfloat16),
    ([777, 12345], 8, 1, 128, 32, torch.float16),
]


@pytest.mark.parametrize("shape", SHAPES, ids=lambda s: f"hq{s[1]}-hkv{s[2]}-d{s[3]}-p{s[4]}")
@pytest.mark.parametrize("route", ["split1", "split7", "split32", "workqueue", "fused"])
def test_kernels_match_fp32_reference(shape, route):
    lens, hq, hkv, d, page, dtype = shape
    b = make_batch(lens, num_qo_heads=hq, num_kv_heads=hkv, head_dim=d, page_size=page,
                   dtype=dtype, seed=hash((tuple(lens), route)) % 2**31)
    if route.startswith("split"):
        out = run_split(b, int(route[5:]))
    else:
        out, counters = run_workqueue(b, 8, fused=route == "fused")
        if counters is not None:
            assert counters.sum().item() == 0  # reset for graph replay
    assert not torch.isnan(out).any(), "an output element was not written or NaN leaked in"
    assert rel_err(out, ref_out(b)) < TOL[dtype]


def test_all_groups_and_dims_compile_and_agree():
    for d in (64, 128, 256):
        for g in (1, 2, 4, 8):
            for dtype in (torch.float16, torch.bfloat16):
                b = make_batch([100, 3000], num_qo_heads=2 * g, num_kv_heads=2, head_dim=d,
                               page_size=16, dtype=dtype, seed=d * g)
                ref = ref_out(b)
                for out in (run_split(b, 4), run_workqueue(b, 4)[0], run_workqueue(b, 4, True)[0]):
                    assert rel_err(out, ref) < TOL[dtype], (d, g, dtype)


def test_large_logits_finite_and_exact():
    b = make_batch([2000, 1], scale=70.0, seed=3)  # |q.k| ~ 1e4 before scaling
    ref = ref_out(b)
    for out in (run_split(b, 16), run_workqueue(b, 16)[0]):
        assert torch.isfinite(out).all()
        assert rel_err(out, ref) < 2e-3


def test_mostly_empty_splits():
    b = make_batch([33, 1, 64], seed=5)  # 64 splits over <= 2 tiles: all but 1-2 splits empty
    assert rel_err(run_split(b, 64), ref_out(b)) < 2e-3


@pytest.mark.parametrize("d", [64, 128, 256])
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_merge_matches_reference_merge_for_any_slot_count(d, dtype):
    """Slot counts around the merge's warp (32) and batch (8 / 16) boundaries, empty slots mixed
    in, rows of different counts in one launch, heads not a multiple of the 4 per CTA."""
    counts = [2, 7, 15, 16, 17, 31, 32, 33, 47, 64, 100, 129]
    hq = 6
    offsets = torch.tensor([0] + counts, dtype=torch.int32).cumsum(0, dtype=torch.int32)
    slots = int(offsets[-1])
    g = torch.Generator().manual_seed(d)
    m = torch.randn(slots, hq, generator=g) * 30
    l = torch.rand(slots, hq, generator=g) * 50 + 0.5
    a = torch.randn(slots, hq, d, generator=g) * 10
    empty = torch.rand(slots, hq, generator=g) < 0.3
    empty[offsets[:-1].long()] = False  # every row keeps a non-empty first slot
    m[empty], l[empty], a[empty] = -math.inf, 0.0, 0.0
    part_ml = torch.stack([m, l], -1).cuda()
    out = torch.full((len(counts), hq, d), float("nan"), dtype=dtype, device="cuda")
    ops.merge(a.cuda(), part_ml, offsets.cuda(), out)
    for r, (b, e) in enumerate(zip(offsets[:-1].tolist(), offsets[1:].tolist())):
        ref = reference.merge_states(m[b:e], l[b:e], a[b:e])
        assert rel_err(out[r].cpu(), ref) < TOL[dtype] / 2, (d, counts[r])


@pytest.mark.parametrize("d,g", [(256, 8), (128, 8), (64, 8), (64, 2), (128, 4)])
def test_fused_merge_with_many_splits(d, g):
    """The fused kernel's in-CTA merge around its batch (8 or 16 slots) and warp (32 slots)
    boundaries and over more than 32 slots (G = 8: two heads per warp in turn), up to and past
    the 64 splits routes.toml allows."""
    b = make_batch([40000, 3000, 1], num_qo_heads=2 * g, num_kv_heads=2, head_dim=d, page_size=16,
                   seed=d + g)
    ref = ref_out(b)
    for splits in (15, 16, 17, 33, 40, 50, 64, 65, 100):
        out, counters = run_workqueue(b, splits, fused=True)
        assert counters.sum().item() == 0
        assert rel_err(out, ref) < TOL[torch.float16], (d, g, splits)
        assert rel_err(run_workqueue(b, splits)[0], ref) < TOL[torch.float16], (d, g, splits)


def test_pdl_is_on_and_changes_no_bit():
    """sm_90+ launches use programmatic dependent launch; outputs are bit-identical without it,
    eager and graph-replayed (the kernels wait for their predecessor before reading)."""
    k = _driver.get_kernel("merge", "pkv_merge_f16_d128")
    assert _driver.pdl_enabled() and k.pdl == (torch.cuda.get_device_capability()[0] >= 9)
    b = make_batch([5000, 33, 20000], seed=21)
    outs = {}
    for pdl in (True, False):
        _driver.set_pdl(pdl)
        try:
            eager = [run_split(b, 16), run_workqueue(b, 12)[0], run_workqueue(b, 12, fused=True)[0]]
            g = torch.cuda.CUDAGraph()
            side = torch.cuda.Stream()
            side.wait_stream(torch.cuda.current_stream())
            with torch.cuda.stream(side):
                run_split(b, 16)  # warm-up on the capture stream
            torch.cuda.current_stream().wait_stream(side)
            with torch.cuda.graph(g):
                graphed = run_split(b, 16)
            g.replay()
            torch.cuda.synchronize()
            outs[pdl] = eager + [graphed.clone()]
        finally:
            _driver.set_pdl(None)
    for on, off in zip(outs[True], outs[False]):
        assert torch.equal(on, off)


def test_capture_replay_after_inplace_change():
    b = make_batch([1000, 5000], seed=9)
    rows, splits = 2, 8
    out = torch.empty_like(b.q)
    row_ids = torch.arange(rows, dtype=torch.int32, device="cuda")
    part_a = torch.empty((rows * splits, *b.q.shape[1:]), device="cuda")
    part_ml = torch.empty((rows * splits, b.q.shape[1], 2), device="cuda")
    offsets = torch.arange(rows + 1, dtype=torch.int32, device="cuda") * splits

    def step():
        ops.split_decode(b.q, b.k_cache, b.v_cache, b.seq_lens, b.block_tables, row_ids, splits,
                         out, part_a, part_ml)
        ops.merge(part_a, part_ml, offsets, out, row_ids=row_ids)

    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        step()  # warm-up: module load and attributes outside capture
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph(keep_graph=True)
    with torch.cuda.graph(graph):
        step()
    assert _driver.graph_node_count(graph) >= 2
    for trial in range(3):
        b.q.copy_(torch.randn_like(b.q))
        b.seq_lens.copy_(torch.tensor([1000 - 100 * trial, 5000 - 7 * trial], dtype=torch.int32))
        out.fill_(float("nan"))
        graph.replay()
        torch.cuda.synchronize()
        assert rel_err(out, ref_out(b)) < 2e-3


def test_no_local_memory_in_loaded_kernels():
    b = make_batch([64], seed=1)
    run_split(b, 2)
    k = _driver.get_kernel("split_decode", "pkv_split_decode_f16_d128_gc4", ops.decode_smem_bytes(128, 4))
    assert _driver.function_attributes(k)["local_bytes"] == 0


def test_timeline_marks_are_ordered_and_change_no_bit():
    """trace buffers (benches/layer_timeline.py): every working CTA writes entry <= wait <= done,
    idle grid slots write nothing, and the outputs are the untraced ones bit for bit; two
    layers, the second with early K/V copies."""
    from pkvrt.policy import planner
    from pkvrt.policy.calibration import find_calibration
    from pkvrt.policy.registry import load_routes

    b = make_batch([5000, 33, 20000], seed=23)
    lens = b.seq_lens.tolist()
    plan = planner.plan_workqueue(lens, num_kv_heads=8, num_qo_heads=32, head_dim=128, dtype_bytes=2,
                                  splits=load_routes().route("pkv_workqueue").splits,
                                  cal=find_calibration(torch.cuda.get_device_name()))
    i32 = dict(dtype=torch.int32, device="cuda")
    n = len(plan.tasks)
    tasks = torch.zeros(n + 5, 5, **i32)           # 5 idle grid slots
    tasks[:n] = torch.as_tensor(plan.tasks, **i32)
    num, offsets = torch.tensor([n], **i32), torch.as_tensor(plan.split_offsets, **i32)
    slots = int(plan.split_offsets[-1])
    pa, pm = torch.empty(slots, 32, 128, device="cuda"), torch.empty(slots, 32, 2, device="cuda")
    outs = {}
    for traced in (False, True):
        dec = torch.zeros(2, n + 5, ops.TRACE_MARKS, dtype=torch.int64, device="cuda")
        mer = torch.zeros(2, 8 * len(lens), ops.TRACE_MARKS, dtype=torch.int64, device="cuda")
        out = poisoned_like(b.q)
        for layer in range(2):
            ops.workqueue_decode(b.q, b.k_cache, b.v_cache, b.seq_lens, b.block_tables, tasks, num,
                                 offsets, out, pa, pm, early_kv=layer > 0,
                                 trace=dec[layer] if traced else None)
            ops.merge(pa, pm, offsets, out, skip_single=True, trace=mer[layer] if traced else None)
        torch.cuda.synchronize()
        outs[traced] = out.clone()
    assert torch.equal(outs[True], outs[False])
    assert rel_err(outs[True], ref_out(b)) < TOL[torch.float16]
    d = dec.cpu()
    assert (d[:, :n] > 0).all() and (d[:, n:] == 0).all()
    assert (d[:, :n, 0] <= d[:, :n, 1]).all() and (d[:, :n, 1] <= d[:, :n, 3]).all()
    assert (d[:, :n, 3] <= d[:, :n, 2]).all()     # decoded before done
    # The fused kernel on the same plan: its decoded mark precedes the arrival and tail merge.
    fused = torch.zeros(n + 5, ops.TRACE_MARKS, dtype=torch.int64, device="cuda")
    counters = torch.zeros(len(lens), 8, **i32)
    out = poisoned_like(b.q)
    ops.workqueue_decode(b.q, b.k_cache, b.v_cache, b.seq_lens, b.block_tables, tasks, num, offsets,
                         out, pa, pm, counters=counters, trace=fused)
    torch.cuda.synchronize()
    assert rel_err(out, ref_out(b)) < TOL[torch.float16] and counters.sum().item() == 0
    f = fused.cpu()
    assert (f[:n] > 0).all() and (f[n:] == 0).all()
    assert (f[:n, 1] <= f[:n, 3]).all() and (f[:n, 3] <= f[:n, 2]).all()
    m = mer.cpu()
    done = m[:, :, 2] > 0                          # rows with one split are not merged
    assert done.any() and (m[:, :, 0][done] <= m[:, :, 1][done]).all()
    assert (m[:, :, 1][done] <= m[:, :, 2][done]).all()


def _fused_step(lens, hq, hkv, seed, longest_splits=None):
    """A fused step's launch arguments (host plan, this GPU's calibration) for ``lens``."""
    from pkvrt.policy import planner
    from pkvrt.policy.calibration import find_calibration
    from pkvrt.policy.registry import load_routes

    b = make_batch(lens, num_qo_heads=hq, num_kv_heads=hkv, seed=seed)
    plan = planner.plan_workqueue(lens, num_kv_heads=hkv, num_qo_heads=hq, head_dim=128, dtype_bytes=2,
                                  splits=load_routes().route("pkv_fused").splits,
                                  cal=find_calibration(torch.cuda.get_device_name()).for_group(hq // hkv),
                                  longest_splits=longest_splits)
    tasks, num, offsets, pa, pm = ops.workqueue_tensors(plan, num_qo_heads=hq, head_dim=128)
    return b, plan, (tasks, num, offsets, pa.fill_(math.nan), pm.fill_(math.nan))


@pytest.mark.parametrize("hq, hkv, splits", [(64, 4, 41), (64, 4, 8), (28, 4, 48), (28, 4, 20), (64, 8, 24),
                                             (32, 8, 56)],
                         ids=["g16-41", "g16-8", "g7-48", "g7-20", "g8-24", "g4-56"])
def test_fused_tail_rule_matches_one_level(hq, hkv, splits):
    """The fused kernel with group counters (two levels where its rule says: G 16 from 9 splits, G 7
    from 33) against the one-level tail on the same plan, both against the FP32 reference; the
    counters are left zero for the next launch, which gives the same output."""
    b, plan, (tasks, num, offsets, pa, pm) = _fused_step([28672, 512, 2300, 900], hq, hkv, seed=hq + splits,
                                                         longest_splits=splits)
    # each count is one an even cut of the 896-tile row gives (57 would be cut in 56 splits of 16)
    assert int(plan.num_splits.max()) == splits
    i32 = dict(dtype=torch.int32, device="cuda")
    counters, groups = torch.zeros(4, hkv, **i32), torch.zeros(pa.shape[0], hkv, **i32)
    outs = []
    for two in (None, groups, groups):
        out = poisoned_like(b.q)
        ops.workqueue_decode(b.q, b.k_cache, b.v_cache, b.seq_lens, b.block_tables, tasks, num, offsets,
                             out, pa, pm, counters=counters, group_counters=two)
        torch.cuda.synchronize()
        assert counters.sum().item() == 0 and groups.sum().item() == 0
        assert rel_err(out, ref_out(b)) < TOL[torch.float16]
        outs.append(out)
    assert torch.equal(outs[1], outs[2])   # the counters left zero: a replay is the same launch


def test_fused_tail_arguments_are_refused_by_name():
    b, plan, (tasks, num, offsets, pa, pm) = _fused_step([5000, 33], 64, 4, seed=5)
    i32 = dict(dtype=torch.int32, device="cuda")
    counters, groups = torch.zeros(2, 4, **i32), torch.zeros(pa.shape[0], 4, **i32)
    out = poisoned_like(b.q)
    bad = [
        (dict(group_counters=groups), r"group_counters: expected the fused kernel's counters beside them"),
        (dict(counters=counters, group_counters=groups[:-1]), r"group_counters: expected \[>= \d+ slots, 4 KV heads\]"),
        (dict(counters=counters, group_counters=groups[:, :2].contiguous()), r"group_counters: expected \[>= "),
        (dict(counters=counters, group_counters=groups.to(torch.int64)), r"group_counters: expected a contiguous int32"),
        (dict(counters=counters, merge_groups_from=9), r"group_counters: expected a \[>= \d+, H_kv\] int32 tensor"),
        (dict(counters=counters, group_counters=groups, merge_groups_from=1), r"merge_groups_from: expected 0 "),
        (dict(counters=counters, group_counters=groups, merge_groups_from=True), r"merge_groups_from: expected 0 "),
        (dict(counters=counters, group_counters=groups, merge_groups_from=2**31), r"merge_groups_from: expected 0 "),
        (dict(counters=counters[:, :2].contiguous()), r"counters: expected \[B, H_kv=4\] int32"),
    ]
    for kw, match in bad:
        with pytest.raises(ops.KernelArgumentError, match=match):
            ops.workqueue_decode(b.q, b.k_cache, b.v_cache, b.seq_lens, b.block_tables, tasks, num, offsets,
                                 out, pa, pm, **kw)
    torch.cuda.synchronize()
    assert torch.isnan(out).all() and counters.sum().item() == 0   # nothing launched
