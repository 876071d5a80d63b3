"""Host-side soak of pkvrt.Runtime on the fake device (CPU, no GPU).

30 000 decode steps with random batch composition (rows join and leave) and lengths, graphs on,
a small graph bound and a small router memo. What it proves without a GPU: the runtime's host
state stays bounded (graphs, seen keys, router memo), host memory stops growing after warm-up
(tracemalloc), and an identical step gives a bit-identical output after thousands of others.
The GPU side of the soak (device memory, real graph replays) is benches/soak.py.
"""

import gc
import tracemalloc

import numpy as np
import pytest
import torch

from pkvrt.launch import ops
from pkvrt.policy import costmodel, planner
from test_runtime_cpu import fake_device, fake_runtime, pool, rel_err, ref, step_inputs  # noqa: F401

STEPS, WARMUP = 30_000, 15_000

pytestmark = pytest.mark.slow  # ~4 min alone on 2 cores (255 s, 2026-12-01); `pytest -q --quick` skips it


# Memoizing caches with a fixed bound (functools.lru_cache(maxsize=...)): they may legitimately
# keep filling after warm-up (the planner's partition cache held 1 066 of its 4 096 entries at
# step 15 000 once the router stopped re-planning memo hits), so they are emptied before each
# snapshot and the comparison counts only what is not bounded by construction.
BOUNDED_CACHES = (planner._candidates, planner._partition_of_tiles, costmodel._bucket_cost)


# tracemalloc's own bookkeeping: the first snapshot's list of traces is alive when the second is
# taken and would count as growth (157 KiB on the dev box, in proportion to the blocks traced).
NOT_OURS = (tracemalloc.Filter(False, tracemalloc.__file__),)


def snapshot():
    for cache in BOUNDED_CACHES:
        cache.cache_clear()
    gc.collect()   # cycles awaiting the collector are not held memory (their amount varies per run)
    return tracemalloc.take_snapshot().filter_traces(NOT_OURS)


def test_soak_host_state_bounded_and_deterministic(fake_device, pool, monkeypatch):  # noqa: F811
    b, _ = pool
    cache = (b.k_cache, b.v_cache)
    rt = fake_runtime(max_graphs=8, decision_memo=64)

    # Golden step, computed with the emulated kernels before the soak.
    seq0, bt0, q0 = step_inputs(b, [0, 2, 4], 3, seed=1)
    rt.plan(seq0, bt0)
    golden = rt.run(q0, *cache, out=torch.empty_like(q0)).clone()
    assert rel_err(golden, ref(q0, cache, seq0, bt0)) < 2e-3

    # The soak itself launches nothing (host bookkeeping only): the emulated attention would
    # cost ~ms per step on the CPU.
    emu = {n: getattr(ops, n) for n in ("split_decode", "merge", "workqueue_decode")}
    for n in emu:
        monkeypatch.setattr(ops, n, lambda *a, **k: None)
    rng = np.random.default_rng(20260623)
    out = torch.empty(6, 8, 64, dtype=torch.float16)
    q = torch.zeros(6, 8, 64, dtype=torch.float16)
    tracemalloc.start()  # traced from the start, so entries that replace others in a bounded
    for i in range(STEPS):  # cache net out instead of counting as growth
        if i == WARMUP:
            before = snapshot()
        k = int(rng.integers(1, 7))
        rows = sorted(rng.choice(6, size=k, replace=False).tolist())
        seq, bt, _ = step_inputs(b, rows, int(rng.integers(0, 400)), seed=0)
        rt.plan(seq, bt)
        rt.run(q[:k], *cache, out=out[:k])
        s = rt.stats()
        assert s["graphs"] <= 8 and len(rt.router._memo) <= 64
    after = snapshot()
    tracemalloc.stop()
    diff = after.compare_to(before, "lineno")
    growth = sum(st.size_diff for st in diff)
    top = "\n".join(str(st) for st in diff[:8])
    assert growth < 256 * 1024, f"host memory grew {growth} bytes over {STEPS - WARMUP} steps:\n{top}"
    assert rt.stats()["plans"] == STEPS + 1

    for n, f in emu.items():
        monkeypatch.setattr(ops, n, f)
    rt.plan(seq0, bt0)
    again = rt.run(q0, *cache, out=torch.empty_like(q0))
    assert torch.equal(again, golden)
