"""Runtime(device_planning=True) on the fake device (CPU): the planning kernel is emulated by an
independent write-out of its rule (test_runtime_cpu.Emu.plan_workqueue_device), so these tests
check the Runtime's side: buffers, graph keys, checks, status word, and that its outputs equal
the host-lengths Runtime's (which plans its workqueue/fused steps with the same kernel;
test_runtime_cpu checks that plan against the host planner's, task for task). The kernel itself
is checked against the host planner on the H200 (tests/gpu/test_device_plan.py,
tests/gpu/test_runtime.py)."""

import pathlib

import numpy as np
import pytest
import torch

from pkvrt.launch import ops
from pkvrt.policy import planner
from pkvrt.runtime import graphs
from pkvrt.runtime import check_device_step
from test_runtime_cpu import (STEPS, fake_device, fake_runtime, pool, ref, rel_err,  # noqa: F401
                              step_inputs)


@pytest.mark.parametrize("use_graphs", [True, False], ids=["graphs", "eager"])
@pytest.mark.parametrize("force", [None, "pkv_workqueue", "pkv_fused"])
def test_device_planning_matches_reference_and_host_planning(fake_device, pool, use_graphs, force):  # noqa: F811
    b, _ = pool
    cache = (b.k_cache, b.v_cache)
    dev = fake_runtime(use_cuda_graph=use_graphs, device_planning=True)
    host = fake_runtime(use_cuda_graph=use_graphs)
    default = dev.registry.device_planning_route().name   # routes.toml [device_planning]
    assert default == "pkv_fused"
    for i, (rows, short) in enumerate(STEPS):
        seq, bt, q = step_inputs(b, rows, short, seed=i)
        d = dev.plan(torch.as_tensor(seq), torch.as_tensor(bt), force=force)
        assert d.route == (force or default) and d.forced == (force is not None)
        out = dev.run(q, *cache, out=torch.full_like(q, float("nan")))
        assert not torch.isnan(out).any()
        assert rel_err(out, ref(q, cache, seq, bt)) < 2e-3, i
        host.plan(seq, bt, force=force or default)
        # same split rule, same per-split arithmetic: bit-identical to host planning
        assert torch.equal(out, host.run(q, *cache, out=torch.empty_like(q))), i
        assert dev.device_status() == 0
    s = dev.stats()
    assert s["plans"] == len(STEPS) and s["h2d_copies"] == 0
    if use_graphs:  # one planning graph per padded batch, replayed on later steps
        assert s["replays"] > 0 and s["graphs"] <= s["max_graphs"]


@pytest.mark.parametrize("use_graphs", [True, False], ids=["graphs", "eager"])
def test_eager_device_planning_is_one_launch(fake_device, pool, use_graphs):  # noqa: F811
    """With the Runtime's graphs off (an engine capturing its own step) plan() is one launch: the
    planning kernel copies the lengths and the block-table entries they use into the runtime's
    buffers itself (direct mode); with them on, the inputs are copied into the planning graph's
    fixed buffers first. Same outputs, and the buffers hold the step's lengths and used ids."""
    b, _ = pool
    cache = (b.k_cache, b.v_cache)
    rt = fake_runtime(use_cuda_graph=use_graphs, device_planning=True, num_pages=b.k_cache.shape[0])
    for i, (rows, short) in enumerate(STEPS):
        seq, bt, q = step_inputs(b, rows, short, seed=i)
        before = fake_device.direct
        if not use_graphs:
            rt._d_meta[:2].fill_(-1)   # the device scalars (rows, longest length): not written
        rt.plan(torch.as_tensor(seq), torch.as_tensor(bt))
        assert fake_device.direct - before == (0 if use_graphs else 1)
        if not use_graphs:
            assert rt._d_meta[:2].tolist() == [-1, -1]
        out = rt.run(q, *cache, out=torch.full_like(q, float("nan")))
        assert rel_err(out, ref(q, cache, seq, bt)) < 2e-3, i
        assert torch.equal(rt._d_seq[:len(seq)], torch.as_tensor(seq))
        for r, n in enumerate(seq):
            w = -(-int(n) // rt.page_size)
            assert torch.equal(rt._bt[r, :w], torch.as_tensor(bt[r, :w])), (i, r)
        assert rt.device_status() == 0


@pytest.mark.parametrize("max_batch", [3, 5])
def test_device_planning_when_max_batch_is_not_a_power_of_two(fake_device, pool, max_batch):  # noqa: F811
    """A step of max_batch rows plans on the graph batch padded_batch(max_batch) > max_batch rows
    (4 for 3, 8 for 5): the Runtime's block-table buffer must hold that many rows (on the H200,
    a Runtime(max_batch=3) refused its first 3-row step: block_tables [3, W] for a 4-row plan)."""
    b, _ = pool
    cache = (b.k_cache, b.v_cache)
    rt = fake_runtime(device_planning=True, max_batch=max_batch)
    seq, bt, q = step_inputs(b, list(range(max_batch)), 0, seed=7)
    rt.plan(torch.as_tensor(seq), torch.as_tensor(bt))
    out = rt.run(q, *cache, out=torch.full_like(q, float("nan")))
    assert rel_err(out, ref(q, cache, seq, bt)) < 2e-3 and rt.device_status() == 0


def test_device_planning_grid_covers_every_batch_of_its_padded_size(fake_device):  # noqa: F811
    """Every step of b rows in (gb/2, gb] fits the grid of its padded batch gb, whatever the
    lengths: uniform long rows, one long row among short ones, random."""
    rt = fake_runtime(device_planning=True)
    route = rt.registry.route("pkv_workqueue")
    rng = np.random.default_rng(0)
    for gb in (1, 2, 4, 8):
        grid = rt._device_grid_tasks(route, gb)
        for b in range(gb // 2 + 1, gb + 1):
            for seq in (np.full(b, 200_000), np.r_[131072, np.full(b - 1, 40)], rng.integers(1, 70000, b)):
                p = planner.balanced_partition(seq, num_kv_heads=rt.num_kv_heads, splits=route.splits,
                                               cal=rt.calibration)
                assert p.ctas <= grid, (gb, seq)


@pytest.mark.parametrize("use_graphs", [True, False], ids=["graphs", "direct"])
def test_device_planning_flags_bad_lengths_and_skips_their_rows(fake_device, pool, use_graphs):  # noqa: F811
    b, _ = pool
    cache = (b.k_cache, b.v_cache)
    rt = fake_runtime(device_planning=True, use_cuda_graph=use_graphs)
    seq, bt, q = step_inputs(b, [0, 1, 2], 0, seed=3)
    bad = seq.copy()
    bad[1] = bt.shape[1] * 16 + 1       # beyond the block table's columns
    rt.plan(torch.as_tensor(bad), torch.as_tensor(bt))
    rt.static_q(3).copy_(q)
    rt.static_out(3).fill_(7.0)
    out = rt.run(rt.static_q(3), *cache, out=rt.static_out(3))
    want = ref(q, cache, seq, bt)
    assert rel_err(out[[0, 2]], want[[0, 2]]) < 2e-3
    assert torch.all(out[1] == 7.0)     # the flagged row was not computed (nothing written)
    assert rt.device_status(raise_on_error=False) == 2
    with pytest.raises(RuntimeError, match="seq_len was outside"):
        rt.device_status()
    bad[1] = -1
    rt.plan(torch.as_tensor(bad), torch.as_tensor(bt))
    assert rt.device_status(raise_on_error=False) == 2
    bad[1] = 0                          # an idle row (an engine's padding): no work, not flagged
    rt.plan(torch.as_tensor(bad), torch.as_tensor(bt))
    out = rt.run(rt.static_q(3), *cache, out=rt.static_out(3).fill_(7.0))
    assert rt.device_status() == 0 and torch.all(out[1] == 7.0)
    assert rel_err(out[[0, 2]], want[[0, 2]]) < 2e-3
    rt.plan(torch.as_tensor(seq), torch.as_tensor(bt))  # the word is rewritten every step
    assert rt.device_status() == 0


I32 = dict(dtype=torch.int32)


@pytest.mark.parametrize("seq, bt, match", [
    (torch.tensor([5.0]), torch.zeros(1, 4, **I32), r"seq_lens: expected an int32 tensor"),
    (torch.tensor([5]), torch.zeros(1, 4, **I32), r"seq_lens: expected an int32 tensor .* got torch.int64"),
    (torch.tensor([[5]], **I32), torch.zeros(1, 4, **I32), r"seq_lens: expected a non-empty \[B\]"),
    (torch.tensor([], **I32), torch.zeros(0, 4, **I32), r"seq_lens: expected a non-empty"),
    (torch.tensor([5, 6], **I32), torch.zeros(3, 4, **I32), r"block_tables: expected shape \[B=2"),
    (torch.tensor([5, 6], **I32), torch.zeros(2, 4), r"block_tables: expected an int32 tensor"),
    (torch.tensor([5, 6], **I32), torch.zeros(2, 4, dtype=torch.int64), r"block_tables: expected an int32"),
    (torch.tensor([5, 6], **I32), torch.zeros(8, **I32), r"block_tables: expected a non-empty \[B, max_pages\]"),
    (torch.ones(9, **I32), torch.zeros(9, 4, **I32), r"batch of 9 rows: expected at most max_batch=8"),
])
def test_device_step_checks_name_the_argument(seq, bt, match):
    with pytest.raises(ValueError, match=match):
        check_device_step(seq, bt, device=torch.device("cpu"), max_batch=8)


def test_device_planning_errors_keep_the_previous_plan(fake_device, pool):  # noqa: F811
    b, _ = pool
    cache = (b.k_cache, b.v_cache)
    rt = fake_runtime(device_planning=True)
    seq, bt, q = step_inputs(b, [0, 4], 0, seed=1)
    rt.plan(torch.as_tensor(seq), torch.as_tensor(bt))
    before = (rt._step, rt._d_seq.clone(), rt._bt.clone())
    for kw, match in ((dict(force="pkv_bucket"), "with device_planning expected one of"),
                      (dict(force="flashinfer"), "with device_planning expected one of")):
        with pytest.raises(ValueError, match=match):
            rt.plan(torch.as_tensor(seq), torch.as_tensor(bt), **kw)
    with pytest.raises(ValueError, match="block_tables"):
        rt.plan(torch.as_tensor(seq), torch.as_tensor(bt[:1]))
    assert rt._step is before[0] and torch.equal(rt._d_seq, before[1]) and torch.equal(rt._bt, before[2])
    out = rt.run(q, *cache, out=torch.empty_like(q))
    assert rel_err(out, ref(q, cache, seq, bt)) < 2e-3


def test_device_planning_construction(fake_device, tmp_path):  # noqa: F811
    rt = fake_runtime(device_planning=True, flashinfer=True)
    assert not rt.flashinfer_available  # device planning never takes the FlashInfer route
    assert "device planning" in rt.explain()
    with pytest.raises(ValueError, match="max_batch=2000: device_planning plans every step with the planning kernel, which plans at most 1024"):
        fake_runtime(device_planning=True, max_batch=2000)
    text = "\n".join(line for line in (pytest.importorskip("pathlib").Path(__file__).parents[1]
                                      / "routes.toml").read_text().splitlines())
    only_bucket = tmp_path / "routes.toml"
    start = text.index("[routes.pkv_workqueue]")
    dp = text.index("\n[device_planning]") + 1
    only_bucket.write_text(text[:dp] + text[text.index("\n\n", dp):start])
    from pkvrt.policy.registry import load_routes
    reg = load_routes(only_bucket)
    if any(r.kind in ("workqueue", "fused") for r in reg.routes):
        pytest.skip("routes.toml order changed: workqueue routes are not last")
    with pytest.raises(ValueError, match="device planning needs a route of kind 'workqueue'"):
        fake_runtime(device_planning=True, routes=reg)


def test_device_planning_explain_names_the_route(fake_device, pool):  # noqa: F811
    b, _ = pool
    rt = fake_runtime(device_planning=True)
    seq, bt, _ = step_inputs(b, [0, 1], 0, seed=1)
    d = rt.plan(torch.as_tensor(seq), torch.as_tensor(bt))
    text = d.explain()
    assert "lengths on the GPU" in text and "pkv_fused" in text and "chosen" in text
    assert "[device_planning] runs pkv_fused" in text


def test_device_planning_graph_replay_after_length_change(fake_device, pool):  # noqa: F811
    """Same padded batch, new lengths: the planning graph and the decode graph replay (no new
    capture), and the output follows the new lengths."""
    b, _ = pool
    cache = (b.k_cache, b.v_cache)
    rt = fake_runtime(device_planning=True, num_pages=b.k_cache.shape[0])
    for i, short in enumerate([30, 12, 0]):
        seq, bt, q = step_inputs(b, [0, 1, 3], short, seed=50 + i)
        rt.plan(torch.as_tensor(seq), torch.as_tensor(bt))
        rt.static_q(3).copy_(q)
        out = rt.run(rt.static_q(3), *cache, out=rt.static_out(3))
        assert rel_err(out, ref(q, cache, seq, bt)) < 2e-3
    s = rt.stats()
    assert s["captures"] == 2 and s["replays"] == 4 and graphs.padded_batch(3) == rt._step.gbatch
    assert ops is not None


def test_device_grid_holds_the_planning_rule_for_all_long_rows(fake_device):  # noqa: F811
    """Worst case of the rule: every row long enough to take the largest split count; the
    planning kernel's rule (emulated) must fit the grid of its padded batch with no overflow."""
    rt = fake_runtime(device_planning=True, max_batch=64)
    cal, hkv = rt.calibration, rt.num_kv_heads
    for name, route in rt._dp_routes.items():
        cands = torch.tensor(route.splits.candidates(), dtype=torch.int32)
        for b in range(1, 65):
            gb = graphs.padded_batch(b)
            grid = rt._device_grid_tasks(route, gb)
            seq = torch.full((gb,), 200_000, dtype=torch.int32)
            tasks = torch.zeros(grid, 5, dtype=torch.int32)
            num, status = torch.zeros(1, dtype=torch.int32), torch.zeros(1, dtype=torch.int32)
            fake_device.plan_workqueue_device(
                seq, torch.tensor([b], dtype=torch.int32), tasks, num,
                torch.zeros(gb + 1, dtype=torch.int32), torch.zeros(gb, dtype=torch.int32), status,
                cands, num_kv_heads=hkv, min_split_tiles=-(-cal.splits.min_split_tokens // 32),
                **planner.device_plan_targets(cal, route.kind),
                max_seq_len=torch.tensor([2**30], dtype=torch.int32))
            assert int(status[0]) == 0 and int(num[0]) <= grid, (name, b)
            assert int(num[0]) // hkv <= rt.stats()["capacities"]["slots"], (name, b)


def test_device_planning_never_regrows(fake_device, pool):  # noqa: F811
    """Buffers are sized for every padded batch at construction: an engine's captured graph can
    never be left pointing at reallocated memory."""
    b, _ = pool
    cache = (b.k_cache, b.v_cache)
    rt = fake_runtime(device_planning=True, max_batch=64)
    for i, rows in enumerate(([0], [0, 1, 2, 3, 4, 5], [2, 3])):
        seq, bt, q = step_inputs(b, rows, 0, seed=i)
        rt.plan(torch.as_tensor(seq), torch.as_tensor(bt))
        out = rt.run(q, *cache, out=torch.empty_like(q))
        assert rel_err(out, ref(q, cache, seq, bt)) < 2e-3
    assert rt.stats()["regrowths"] == 0


def test_device_scalars_are_rewritten_every_step_once_an_engine_captured_a_plan(fake_device, pool):  # noqa: F811
    b, _ = pool
    cache = (b.k_cache, b.v_cache)
    rt = fake_runtime(device_planning=True, use_cuda_graph=False)
    seq, bt, q = step_inputs(b, [0, 1, 2], 0, seed=4)
    # strided lengths: not the planning kernel's direct mode, so plan() copies them and fills
    # the device scalars (rows, longest length) before the planning kernel
    lens = torch.as_tensor(np.stack([seq, seq], 1))[:, 0]
    assert not lens.is_contiguous()
    rt.plan(lens, torch.as_tensor(bt))
    rt._capturing = lambda: True            # as if inside an engine's torch.cuda.graph
    rt.plan(lens, torch.as_tensor(bt))
    rt._capturing = lambda: False
    rt._d_rows.fill_(5)                     # what replaying the engine's B=5 graph would leave
    direct = fake_device.direct
    rt.plan(lens, torch.as_tensor(bt))      # same B and width as the cached scalars
    assert fake_device.direct == direct
    assert int(rt._d_rows[0]) == 3
    out = rt.run(q, *cache, out=torch.empty_like(q))
    assert rel_err(out, ref(q, cache, seq, bt)) < 2e-3


def test_cpu_inputs_during_capture_are_refused(fake_device, pool):  # noqa: F811
    b, _ = pool
    rt = fake_runtime(device_planning=True, use_cuda_graph=False)
    seq, bt, _ = step_inputs(b, [0, 1], 0, seed=4)
    rt._capturing = lambda: True
    rt.device = torch.device("cuda", 0)     # the fake device is the CPU: make the inputs host ones
    with pytest.raises(ValueError, match="on the CPU during CUDA-graph capture"):
        rt.plan(torch.as_tensor(seq), torch.as_tensor(bt))


@pytest.mark.parametrize("use_graphs", [True, False], ids=["graphs", "direct"])
def test_block_table_width_changes_between_steps(fake_device, pool, use_graphs):  # noqa: F811
    """A narrower table bounds the lengths: rows that fit are exact, a longer one is flagged."""
    b, _ = pool
    cache = (b.k_cache, b.v_cache)
    rt = fake_runtime(device_planning=True, use_cuda_graph=use_graphs)
    seq, bt, q = step_inputs(b, [1, 2, 5], 0, seed=6)      # 2500, 900, 33 tokens
    assert list(seq) == [2500, 900, 33]
    flagged = 0
    for width in (bt.shape[1], 160, 57):                   # 57 pages = 912 tokens: row 0 too long
        rt.plan(torch.as_tensor(seq), torch.as_tensor(bt[:, :width].contiguous()))
        rt.static_q(3).copy_(q)
        out = rt.run(rt.static_q(3), *cache, out=rt.static_out(3))
        want = ref(q, cache, seq, bt)
        fits = [i for i, n in enumerate(seq) if n <= width * 16]
        assert rel_err(out[fits], want[fits]) < 2e-3, width
        assert rt.device_status(raise_on_error=False) == (0 if len(fits) == 3 else 2), width
        flagged += len(fits) < 3
    assert flagged == 1   # the 57-page table


@pytest.mark.parametrize("use_graphs", [True, False], ids=["graphs", "direct"])
def test_negative_lengths_are_flagged(fake_device, pool, use_graphs):  # noqa: F811
    b, _ = pool
    rt = fake_runtime(device_planning=True, use_cuda_graph=use_graphs,
                      num_pages=b.k_cache.shape[0])
    seq, bt, _ = step_inputs(b, [0, 1], 0, seed=1)
    seq[0] = -5
    rt.plan(torch.as_tensor(seq), torch.as_tensor(bt))
    assert rt.device_status(raise_on_error=False) == 2


@pytest.mark.parametrize("use_graphs", [True, False], ids=["graphs", "direct"])
def test_page_ids_are_checked_against_num_pages(fake_device, pool, use_graphs):  # noqa: F811
    """Device planning checks the page ids a row's length uses against num_pages (the
    constructor's, else the first run()'s cache); a cache smaller than that bound is refused."""
    b, _ = pool
    cache = (b.k_cache, b.v_cache)
    pages = b.k_cache.shape[0]
    seq, bt, q = step_inputs(b, [0, 1], 0, seed=1)
    bad = bt.clone()
    bad[1, (int(seq[1]) - 1) // b.k_cache.shape[2]] = pages     # the row's last used page
    rt = fake_runtime(device_planning=True, num_pages=pages, use_cuda_graph=use_graphs)
    rt.plan(torch.as_tensor(seq), torch.as_tensor(bad))
    assert rt.device_status(raise_on_error=False) == 4
    with pytest.raises(RuntimeError, match=rf"page id outside \[0, num_pages = {pages}\)"):
        rt.device_status()
    unused = bt.clone()
    unused[1, -1] = pages + 7          # beyond the row's length: never read, not an error
    rt.plan(torch.as_tensor(seq), torch.as_tensor(unused))
    assert rt.device_status() == 0
    with pytest.raises(ValueError, match=f"k_cache has {pages} pages .* num_pages={pages + 1}"):
        small = fake_runtime(device_planning=True, num_pages=pages + 1, use_cuda_graph=use_graphs)
        small.plan(torch.as_tensor(seq), torch.as_tensor(bt))
        small.run(q, *cache)
    # No num_pages: the first cache sets the bound, and a step planned before any run() is
    # planned by its first run(), after the bound is set: its ids are checked too.
    learn = fake_runtime(device_planning=True, use_cuda_graph=use_graphs)
    learn.plan(torch.as_tensor(seq), torch.as_tensor(bad))
    with pytest.raises(RuntimeError, match="not planned yet: no cache has been seen"):
        learn.device_status()
    learn.run(q, *cache)
    assert learn.device_status(raise_on_error=False) == 4
    learn.plan(torch.as_tensor(seq), torch.as_tensor(bt))
    learn.run(q, *cache)
    assert learn.device_status() == 0
    learn.plan(torch.as_tensor(seq), torch.as_tensor(bad))
    assert learn.device_status(raise_on_error=False) == 4
    with pytest.raises(ValueError, match="num_pages=0: expected a positive integer"):
        fake_runtime(device_planning=True, num_pages=0)


def test_the_planning_kernel_is_loaded_at_construction(fake_device, monkeypatch, tmp_path):  # noqa: F811
    """A missing planning cubin must fail Runtime(...), not the first plan() (maybe inside an
    engine's capture). Host routing plans its workqueue/fused steps with it too; a routes.toml
    without such routes does not need it."""
    from pkvrt.launch import _driver
    from pkvrt.policy.registry import load_routes

    loaded = []
    monkeypatch.setattr(_driver, "get_kernel", lambda fam, sym, smem=0: loaded.append((fam, sym, smem)))
    for kw in (dict(device_planning=True), {}):
        loaded.clear()
        fake_runtime(**kw)
        assert ("plan_workqueue", "pkv_plan_workqueue", 0) in loaded, kw
    text = (pathlib.Path(__file__).parents[1] / "routes.toml").read_text()
    dp = text.index("\n[device_planning]") + 1
    (tmp_path / "routes.toml").write_text(text[:dp] + text[text.index("\n\n", dp):text.index("[routes.pkv_workqueue]")])
    loaded.clear()
    rt = fake_runtime(routes=load_routes(tmp_path / "routes.toml"))
    assert not any(f == "plan_workqueue" for f, _, _ in loaded)
    with pytest.raises(RuntimeError, match="nothing is planned on the GPU"):
        rt.device_status()


@pytest.mark.slow
def test_only_later_launches_of_a_step_read_the_plan_early(fake_device, pool):  # noqa: F811
    """early_kv (the decode copying K/V before the previous kernel finishes) is never set on the
    first launch after a plan (the plan kernel may be the kernel before it), and only in eager
    mode (the runtime's own per-layer graphs begin with a graph boundary)."""
    b, _ = pool
    cache = (b.k_cache, b.v_cache)
    for graphs_on, want in ((False, [False, True, True] * 2), (True, None)):
        fake_device.early.clear()
        rt = fake_runtime(use_cuda_graph=graphs_on, device_planning=True)
        for i in range(2):
            seq, bt, q = step_inputs(b, [0, 1, 2], i, seed=i)
            rt.plan(torch.as_tensor(seq), torch.as_tensor(bt))
            for _ in range(3):
                rt.run(q, *cache, out=torch.empty_like(q))
        assert fake_device.early == want if want else fake_device.early and not any(fake_device.early)


def test_device_planning_runs_the_small_route_on_one_row_steps(fake_device, pool, tmp_path):  # noqa: F811
    """routes.toml [device_planning] small_rows / small_route: the shipped file runs
    pkv_workqueue on one-row steps and pkv_fused on the others; a file without the pair runs
    its route on every step. Outputs are exact either way."""
    from pkvrt.policy.registry import load_routes

    b, _ = pool
    cache = (b.k_cache, b.v_cache)
    shipped = load_routes()
    assert shipped.device_small == (1, "pkv_workqueue")
    rt = fake_runtime(routes=shipped, device_planning=True)
    text = pathlib.Path(shipped.path).read_text()
    plain_path = tmp_path / "routes.toml"
    plain_path.write_text(text.replace("small_rows = 1\n", "").replace('small_route = "pkv_workqueue"\n', ""))
    plain = fake_runtime(routes=load_routes(plain_path), device_planning=True)
    for rows, want in (([2], "pkv_workqueue"), ([0, 2], "pkv_fused"), ([4], "pkv_workqueue"),
                       ([0, 1, 2, 3], "pkv_fused")):
        seq, bt, q = step_inputs(b, rows, 0, seed=len(rows))
        for runtime, route in ((rt, want), (plain, "pkv_fused")):
            d = runtime.plan(torch.as_tensor(seq), torch.as_tensor(bt))
            assert d.route == route and not d.forced, (rows, d.route)
            out = runtime.run(q, *cache, out=torch.full_like(q, float("nan")))
            assert rel_err(out, ref(q, cache, seq, bt)) < 2e-3 and runtime.device_status() == 0
    # force= still wins over the row rule
    seq, bt, q = step_inputs(b, [2], 0, seed=9)
    assert rt.plan(torch.as_tensor(seq), torch.as_tensor(bt), force="pkv_fused").route == "pkv_fused"


@pytest.mark.parametrize("kw, match", [
    (dict(rows=2), r"max_seq: expected an int in \[1"),
    (dict(max_seq=64), r"rows: expected an int in \[0, 8\]"),
    (dict(rows=9, max_seq=64), r"rows: expected an int in \[0, 8\]"),
    (dict(rows=True, max_seq=64), r"rows: expected an int"),
    (dict(rows=2, max_seq=0), r"max_seq: expected an int in \[1"),
    (dict(src_seq_lens=torch.ones(2, **I32)), r"rows/max_seq: expected both given"),
    (dict(src_block_tables=torch.zeros(2, 4, **I32)), r"rows/max_seq: expected both given"),
    (dict(rows=3, max_seq=64, src_seq_lens=torch.ones(2, **I32)), r"src_seq_lens: expected \[>= rows = 3\]"),
    (dict(rows=2, max_seq=64, src_block_tables=torch.zeros(1, 4, **I32)), r"src_block_tables: expected \[>= 2, >= 4\]"),
    (dict(rows=2, max_seq=65, src_block_tables=torch.zeros(2, 4, **I32)), r"src_block_tables: expected \[>= 2, >= 5\]"),
    (dict(rows=2, max_seq=64, src_block_tables=torch.zeros(2, 4, **I32), block_tables=None),
     r"src_block_tables: expected given with block_tables"),
])
def test_direct_mode_arguments_are_checked_by_name(kw, match):
    """ops.check_plan_direct_args (the planning kernel's direct mode; the CPU emulator calls it
    too): rows and max_seq together and with every src_*, sources at least rows x max_seq/page."""
    args = dict(block_tables=torch.zeros(8, 16, **I32), page_size=16, src_seq_lens=None,
                src_block_tables=None, rows=None, max_seq=None)
    args.update(kw)
    with pytest.raises(ops.KernelArgumentError, match=match):
        ops.check_plan_direct_args(8, **args)


def test_direct_mode_arguments_accepted():
    bt = torch.zeros(8, 16, **I32)
    assert ops.check_plan_direct_args(8, bt, 16, None, None, None, None) is False
    assert ops.check_plan_direct_args(8, bt, 16, torch.ones(3, **I32), torch.zeros(3, 4, **I32), 3, 64)


def test_the_partition_plans_waves_of_this_shapes_resident_ctas(fake_device):  # noqa: F811
    """A shape whose decode kernel keeps fewer CTAs resident per SM than the calibrated shape's
    (the H200: one at D 256, two at D 128) plans its cuts in waves of its own: the Runtime's
    calibration, the partition's model, the planning kernel's targets and explain() say so, and
    an eight-row 32K step is cut to fit one real wave (132 CTAs on the H200 constants, where two
    resident CTAs per SM would fill 264). At the calibrated head dim nothing changes."""
    from pkvrt.policy.calibration import load_calibration
    from pkvrt.runtime import Runtime, RuntimeOptions

    h200 = load_calibration(pathlib.Path(__file__).resolve().parents[1] / "calibration" / "nvidia-h200.json")
    fake_device.occupancy = {("fused_decode", 256): 1, ("fused_decode", 128): 2}
    kw = dict(calibration=h200, max_batch=8, max_pages_per_row=2100, options=RuntimeOptions(flashinfer=False))
    wide = Runtime(16, 8, 256, 16, torch.float16, **kw)
    plain = Runtime(16, 8, 128, 16, torch.float16, **kw)
    assert wide.residency == (1, 2, "D 128") and plain.residency is None
    assert wide.calibration.splits.workqueue_ctas_per_sm == wide.router.cal.splits.workqueue_ctas_per_sm == 1
    assert plain.calibration.splits == h200.for_group(plain.calibration_group).splits
    assert planner.device_plan_targets(wide.calibration)["resident"] == 1
    assert "partition waves of 1 decode CTAs per SM" in wide.explain()
    assert "partition waves" not in plain.explain()
    bounds = wide.registry.device_planning_route().splits
    seq = np.full(8, 32768)
    cut = {rt.head_dim: planner.balanced_partition(seq, num_kv_heads=8, splits=bounds, cal=rt.calibration,
                                                   kind="fused")
           for rt in (wide, plain)}
    assert cut[128].ctas == 256 and cut[256].ctas == 128
    # the least over the partition routes' kernels: a workqueue kernel holding fewer CTAs than
    # the fused one at D 64 sets the waves of both
    fake_device.occupancy = {("fused_decode", 64): 4, ("workqueue_decode", 64): 3}
    assert Runtime(16, 8, 64, 16, torch.float16, **kw).residency == (3, 2, "D 128")
    # a kernel that fits no CTA changes nothing here (loading the kernels reports it)
    fake_device.occupancy = {("fused_decode", 256): 0}
    assert Runtime(16, 8, 256, 16, torch.float16, **kw).residency is None
    # a by_head_dim section measured at D 256 is this shape's own: its constants, no residency
    from pkvrt.policy import calibration as C
    fake_device.occupancy = {("fused_decode", 256): 1, ("fused_decode", 128): 2}
    sec = C.KvDtypeSection(splits=(("workqueue_ctas_per_sm", 1.0), ("cta_overhead_tiles", 3.25)),
                           date="2026-12-05", command="pkvrt calibrate --head-dim 256", provenance="test")
    own = Runtime(16, 8, 256, 16, torch.float16,
                  **dict(kw, calibration=C.with_head_dim_section(h200, 256, sec)))
    assert own.residency is None and own.calibration.splits.cta_overhead_tiles == 3.25
    assert "D 256: the by_head_dim section's constants" in own.explain()
    assert "no by_head_dim section" in wide.explain()
    # an FP8 Runtime there: the FP8 section (measured at D 128, every partition key) lies over
    # the head-dim section, so its waves are corrected against D 128's e4m3 kernel
    fp8 = Runtime(16, 8, 256, 16, torch.float16, kv_dtype=torch.float8_e4m3fn,
                  **dict(kw, calibration=C.with_head_dim_section(h200, 256, sec)))
    assert fp8.residency == (1, 2, "D 128 e4m3") and fp8.calibration.splits.workqueue_ctas_per_sm == 1.0
    assert "2 at the calibrated D 128 e4m3" in fp8.explain()


@pytest.mark.parametrize("window_left, main", [(127, "pkv_fused"), (511, "pkv_workqueue"), (-1, "pkv_workqueue")],
                         ids=["window 128", "window 512", "no window"])
def test_a_short_window_runs_the_main_route_at_large_groups(fake_device, pool, window_left, main):  # noqa: F811
    """routes.toml [device_planning] large_group_min_window (512 shipped): a G 8 Runtime of a
    window shorter than it (gpt-oss's local layers: window_left 127) plans its steps of more
    than small_rows rows on the main route (pkv_fused), one of a longer window or none on
    large_group_route; exact against the FP32 reference with the window, both with device
    lengths and with host lengths under engine capture (which follows the same table)."""
    from test_runtime_cpu import FAKE_SHAPE, ROUTES, SEED
    from pkvrt import reference
    from pkvrt.runtime import Runtime
    from pkvrt.runtime.options import RuntimeOptions
    b, _ = pool
    cache = (b.k_cache, b.v_cache)
    shape = dict(FAKE_SHAPE, num_qo_heads=8 * FAKE_SHAPE["num_kv_heads"])
    for device_lengths in (True, False):
        rt = Runtime(*shape.values(), torch.float16, routes=ROUTES, calibration=SEED, max_batch=8,
                     max_pages_per_row=256, device_planning=device_lengths,
                     engine_capture=not device_lengths, window_left=window_left,
                     options=RuntimeOptions(flashinfer=False))
        for i, (rows, short) in enumerate(STEPS + [([2], 0)]):
            seq, bt, _ = step_inputs(b, rows, short, seed=i)
            q = torch.randn(len(rows), shape["num_qo_heads"], shape["head_dim"],
                            generator=torch.Generator().manual_seed(i)).half()
            d = rt.plan(torch.as_tensor(seq) if device_lengths else seq, torch.as_tensor(bt) if device_lengths else bt)
            assert d.route == (main if len(rows) > 1 else "pkv_workqueue"), (device_lengths, i)
            out = rt.run(q, *cache, out=torch.full_like(q, float("nan")))
            want = reference.decode_attention(q, cache[0], cache[1], torch.as_tensor(seq), bt,
                                              window_left=window_left)
            assert rel_err(out, want) < 2e-3, (device_lengths, i)


@pytest.mark.parametrize("num_qo_heads, main", [(8, "pkv_fused"), (10, "pkv_workqueue"), (16, "pkv_workqueue")],
                         ids=["G4", "G5", "G8"])
def test_device_planning_runs_the_large_group_route_at_large_groups(fake_device, pool, num_qo_heads, main):  # noqa: F811
    """routes.toml [device_planning] large_group: a Runtime of G >= 5 plans its steps of more than
    small_rows rows on large_group_route (pkv_workqueue), one of G 4 on the main route; a one-row
    step takes small_route either way. Exact against the FP32 reference (the pool's K/V, H_kv 2)."""
    from test_runtime_cpu import FAKE_SHAPE, ROUTES, SEED
    from pkvrt import reference
    from pkvrt.runtime import Runtime
    from pkvrt.runtime.options import RuntimeOptions
    b, _ = pool
    cache = (b.k_cache, b.v_cache)
    shape = dict(FAKE_SHAPE, num_qo_heads=num_qo_heads)
    rt = Runtime(*shape.values(), torch.float16, routes=ROUTES, calibration=SEED, max_batch=8,
                 max_pages_per_row=256, device_planning=True,
                 options=RuntimeOptions(flashinfer=False))
    assert ROUTES.device_planning_route(8, num_qo_heads // shape["num_kv_heads"]).name == main
    for i, (rows, short) in enumerate(STEPS + [([2], 0)]):
        seq, bt, _ = step_inputs(b, rows, short, seed=i)
        q = torch.randn(len(rows), num_qo_heads, shape["head_dim"],
                        generator=torch.Generator().manual_seed(i)).half()
        d = rt.plan(torch.as_tensor(seq), torch.as_tensor(bt))
        assert d.route == (main if len(rows) > 1 else "pkv_workqueue"), i
        out = rt.run(q, *cache, out=torch.full_like(q, float("nan")))
        want = reference.decode_attention(q, cache[0], cache[1], torch.as_tensor(seq), bt)
        assert rel_err(out, want) < 2e-3, i


@pytest.mark.parametrize("pin", [[3], torch.zeros(2, **I32), torch.zeros(1, dtype=torch.int64)],
                         ids=["list", "two", "int64"])
def test_a_bad_split_pin_is_named(pin):
    """ops.plan_workqueue_device names a split_pin that is not an int32 [1] tensor on the planning
    buffers' device before anything is launched."""
    n = 8
    with pytest.raises(ops.KernelArgumentError, match=r"split_pin: expected"):
        ops.plan_workqueue_device(torch.zeros(n, **I32), torch.ones(1, **I32), torch.zeros(64, 5, **I32),
                                  torch.zeros(1, **I32), torch.zeros(n + 1, **I32), torch.zeros(n, **I32),
                                  torch.zeros(1, **I32), torch.tensor([1, 2, 4], **I32), num_kv_heads=2,
                                  min_split_tiles=1, sms=132, resident=2, slowdown8=10, overhead8=4,
                                  max_ctas=1024, split_pin=pin)
