"""Tensor-parallel decode (pkvrt/measure/model_tp.py) on the CPU: each rank's heads, weights and caches
are slices of the one-GPU model's; bad TP sizes, ranks and groups are refused by name; every
rank plans its attention alike from the same lengths; and two gloo processes run the TP step
whose logits equal the one-process model's over steps that cross page boundaries (and do not
when a shard is wrong or the all-reduces are left out). The report renders a tp-decode file."""

from __future__ import annotations

import argparse
import importlib.util
import types
from pathlib import Path

import attrs
import pytest
import torch

from pkvrt.measure import model as M
from pkvrt.measure import model_attention as A
from pkvrt.measure import model_tp as T
from pkvrt.measure import tp_results as R
from pkvrt.policy import planner
from test_model_cpu import FakeEvent
from test_runtime_cpu import ROUTES, SEED, fake_device  # noqa: F401

ROOT = Path(__file__).resolve().parent.parent
H200_BYTES = int(139.8 * 2**30)
# 8 query heads over 2 KV heads (G 4), so TP 2 gives each rank H_q 4, H_kv 1; 4-token pages: a
# 13-token context crosses a page boundary on the 4th and 8th step.
TP_TINY32 = M.ModelConfig(layers=2, hidden=512, num_qo_heads=8, num_kv_heads=2, head_dim=64,
                          intermediate=256, vocab=97, page_size=4, dtype=torch.float32, name="tiny-tp")
CHECK = dict(engine="reference", batch=3, context=13, steps=9, weight_seed=3, cache_seed=4,
             pool_seed=5, token_seed=6)


# --------------------------------------------------------------------------- the shard

def test_make_weights_draws_as_before_the_per_matrix_refactor():
    """make_weights (now through weight_draws) against its former body, written out here: the
    committed results and the TP check depend on the same seed giving the same weights."""
    cfg, seed = TP_TINY32, 7
    gen = torch.Generator().manual_seed(seed)

    def linear(o, i):
        return torch.randn(o, i, generator=gen, dtype=cfg.dtype).mul_(i ** -0.5)

    old = []
    for _ in range(cfg.layers):
        old += [linear(cfg.qkv_dim, cfg.hidden), linear(cfg.hidden, cfg.hidden),
                linear(2 * cfg.intermediate, cfg.hidden), linear(cfg.hidden, cfg.intermediate)]
    old += [torch.randn(cfg.vocab, cfg.hidden, generator=gen, dtype=cfg.dtype), linear(cfg.vocab, cfg.hidden)]
    w = M.make_weights(cfg, device="cpu", seed=seed)
    new = [t for lw in w.layers for t in (lw.qkv, lw.o, lw.gate_up, lw.down)] + [w.embed, w.lm_head]
    assert all(torch.equal(a, b) for a, b in zip(old, new)) and len(old) == len(new)
    assert all((t == 1).all() for lw in w.layers for t in (lw.attn_norm, lw.mlp_norm))
    c = M.make_caches(cfg, 5, device="cpu", seed=seed)
    gen = torch.Generator().manual_seed(seed)
    for layer in range(cfg.layers):
        assert torch.equal(c.k[layer], torch.empty_like(c.k[layer]).normal_(generator=gen))
        assert torch.equal(c.v[layer], torch.empty_like(c.v[layer]).normal_(generator=gen))


def test_shard_of_the_8b_model():
    s = T.shard_of(M.LLAMA3_8B, 2, 1)
    assert (s.q_heads, s.kv_heads, s.inter) == ((16, 32), (4, 8), (7168, 14336))
    s = T.shard_of(M.LLAMA3_8B, 8, 7)
    assert (s.q_heads, s.kv_heads, s.inter) == ((28, 32), (7, 8), (12544, 14336))
    local = T.rank_config(M.LLAMA3_8B, 4)
    assert (local.num_qo_heads, local.num_kv_heads, local.head_dim, local.intermediate) == (8, 2, 128, 3584)
    assert local.num_qo_heads // local.num_kv_heads == 4 and local.hidden == 8 * 128
    assert M.kv_bytes(local, 8, 131072, 24) * 4 == M.kv_bytes(M.LLAMA3_8B, 8, 131072, 24)


@pytest.mark.parametrize("cfg, tp, rank, match", [
    (M.LLAMA3_8B, 3, 0, r"tp=3: must divide num_kv_heads=8 of llama3-8b .*tp in \[1, 2, 4, 8\] would"),
    (M.LLAMA3_8B, 16, 0, r"tp=16: must divide num_kv_heads=8"),
    (attrs.evolve(M.LLAMA3_8B, intermediate=14004), 8, 0, r"tp=8: must divide intermediate=14004"),
    (M.LLAMA3_8B, 0, 0, r"tp=0: expected a positive integer"),
    (M.LLAMA3_8B, True, 0, r"tp=True: expected a positive integer"),
    (M.LLAMA3_8B, 2, 2, r"rank=2: expected an integer in \[0, tp=2\)"),
    (M.LLAMA3_8B, 2, -1, r"rank=-1: expected an integer"),
])
def test_bad_tp_and_rank_are_refused(cfg, tp, rank, match):
    with pytest.raises(ValueError, match=match):
        T.shard_of(cfg, tp, rank)


@pytest.mark.parametrize("tp", [1, 2])
def test_shard_weights_are_the_one_gpu_weights_slices(tp):
    cfg = TP_TINY32
    full = M.make_weights(cfg, device="cpu", seed=3)
    d, hq, hkv, inter = cfg.head_dim, cfg.num_qo_heads, cfg.num_kv_heads, cfg.intermediate
    o_cols, down_cols = [], []
    for rank in range(tp):
        s = T.shard_of(cfg, tp, rank)
        w = T.make_shard_weights(cfg, s, device="cpu", seed=3)
        assert all(torch.equal(a, b) for a, b in zip(
            tensors_of(w), tensors_of(T.shard_weights(cfg, s, full))))   # drawn == sliced from full
        nq, nkv, ni = hq // tp, hkv // tp, inter // tp
        for lw, fw in zip(w.layers, full.layers):
            q = fw.qkv[rank * nq * d:(rank + 1) * nq * d]
            k = fw.qkv[hq * d + rank * nkv * d:hq * d + (rank + 1) * nkv * d]
            v = fw.qkv[(hq + hkv) * d + rank * nkv * d:(hq + hkv) * d + (rank + 1) * nkv * d]
            assert torch.equal(lw.qkv, torch.cat([q, k, v]))
            assert torch.equal(lw.gate_up, torch.cat([fw.gate_up[rank * ni:(rank + 1) * ni],
                                                      fw.gate_up[inter + rank * ni:inter + (rank + 1) * ni]]))
            assert lw.o.is_contiguous() and lw.down.is_contiguous()
        o_cols.append(w.layers[1].o)
        down_cols.append(w.layers[1].down)
        assert torch.equal(w.embed, full.embed) and torch.equal(w.lm_head, full.lm_head)
        assert sum(t.numel() * cfg.dtype_bytes for t in tensors_of(w)) == T.shard_weight_bytes(cfg, tp)
    assert torch.equal(torch.cat(o_cols, dim=1), full.layers[1].o)       # row-parallel: columns
    assert torch.equal(torch.cat(down_cols, dim=1), full.layers[1].down)


def tensors_of(w: M.Weights) -> list[torch.Tensor]:
    """Every tensor of a Weights, in a fixed order."""
    return [w.embed, w.final_norm, w.lm_head] + [t for lw in w.layers for t in
                                                 (lw.attn_norm, lw.qkv, lw.o, lw.mlp_norm, lw.gate_up, lw.down)]


def test_shard_caches_are_the_one_gpu_caches_heads():
    cfg, pages = TP_TINY32, 11
    full = M.make_caches(cfg, pages, device="cpu", seed=4)
    for rank in range(2):
        s = T.shard_of(cfg, 2, rank)
        c = T.make_shard_caches(cfg, s, pages, device="cpu", seed=4)
        assert c.k.shape == (cfg.layers, pages, 1, cfg.page_size, cfg.head_dim)
        assert torch.equal(c.k, full.k[:, :, rank:rank + 1]) and torch.equal(c.v, full.v[:, :, rank:rank + 1])
        assert torch.equal(T.shard_caches(cfg, s, full).k, c.k)
    one = T.make_shard_caches(cfg, T.shard_of(cfg, 1, 0), pages, device="cpu", seed=4)
    assert torch.equal(one.k, full.k) and torch.equal(one.v, full.v)


def test_shard_weight_bytes_and_the_memory_plan_of_the_8b_model():
    cfg = M.LLAMA3_8B
    assert T.shard_weight_bytes(cfg, 1) == M.weight_bytes(cfg)
    assert [round(T.shard_weight_bytes(cfg, tp) / 1e9, 2) for tp in (2, 4, 8)] == [9.08, 5.59, 3.85]
    one = T.plan_tp_cases(cfg, 1, [8], [32768, 131072], steps=26, capacity_bytes=H200_BYTES)
    two = T.plan_tp_cases(cfg, 2, [8], [32768, 131072], steps=26, capacity_bytes=H200_BYTES)
    assert [c.fits for c in one] == [True, False] and all(c.fits for c in two)
    assert one[1].reason.startswith("TP 1: a rank needs 149.0 GiB (weights 15.0 + KV 128.0 + draw "
                                    "scratch 2.0 + headroom 4.0) > 139.8 GiB")
    assert two[1].kv_bytes * 2 == one[1].kv_bytes and two[1].need_bytes < 80 * 2**30
    assert one[0].weight_bytes == M.weight_bytes(cfg) and two[0].name == "B8-32K"


# --------------------------------------------------------------------------- one process

def _loop(model, caches, **kw):
    return M.DecodeLoop(model, caches, batch=CHECK["batch"], context=CHECK["context"],
                        max_steps=CHECK["steps"] + 1, seed=CHECK["pool_seed"], **kw)


def _tokens(cfg):
    return torch.randint(cfg.vocab, (CHECK["steps"], CHECK["batch"]),
                         generator=torch.Generator().manual_seed(CHECK["token_seed"]))


def test_tp1_model_is_the_one_gpu_model_bit_for_bit():
    cfg = TP_TINY32
    pages = M.pages_needed(CHECK["batch"], CHECK["context"], CHECK["steps"] + 1, cfg.page_size)
    shard = T.shard_of(cfg, 1, 0)
    tp = T.TPModel(cfg, shard, T.make_shard_weights(cfg, shard, device="cpu", seed=3))
    one = M.Model(cfg, M.make_weights(cfg, device="cpu", seed=3))
    assert not tp.communicate and tp.cfg.num_kv_heads == cfg.num_kv_heads
    got = T.run_steps(_loop(tp, T.make_shard_caches(cfg, shard, pages, device="cpu", seed=4)),
                      A.ReferenceAttention(), _tokens(cfg))
    want = T.run_steps(_loop(one, M.make_caches(cfg, pages, device="cpu", seed=4)),
                       A.ReferenceAttention(), _tokens(cfg))
    assert torch.equal(got[0], want[0]) and torch.equal(got[1], want[1])


def test_tp_model_refuses_weights_of_another_shape():
    cfg = TP_TINY32
    full = M.make_weights(cfg, device="cpu", seed=3)
    with pytest.raises(ValueError, match=r"layer 0's qkv is \[768, 512\]; rank 0 of TP 2 expects \[384, 512\]"):
        T.TPModel(cfg, T.shard_of(cfg, 2, 0), full)
    with pytest.raises(ValueError, match="a shard without a process group has no other ranks"):
        s = T.shard_of(cfg, 2, 0)
        T.check_against_one_gpu(T.TPModel(cfg, s, T.shard_weights(cfg, s, full)), **CHECK)


@pytest.mark.parametrize("backend, device, current, where, match", [
    ("nccl", "cpu", 0, None, r"rank 0's weights are on cpu; the NCCL backend all-reduces CUDA tensors"),
    ("nccl", "cuda:1", 0, None, r"weights are on cuda:1 but its current CUDA device is cuda:0: "
                                r"torch.cuda.set_device\(1\) first"),
    ("gloo", "cuda:0", 0, None, r"weights are on cuda:0; the gloo backend is used here on the CPU"),
    ("nccl", "cuda:0", 0, [("h", "cuda:0"), ("h", "cuda:0")],
     r"ranks 0 and 1 both hold their shard on cuda:0 of h: each rank needs its own GPU"),
])
def test_the_group_check_names_a_bad_device(monkeypatch, backend, device, current, where, match):
    """check_group's device rules, with torch.distributed's answers for a 2-rank group faked (the
    real NCCL group needs GPUs: tests/gpu/test_model_tp.py)."""
    _fake_group(monkeypatch, backend, current, where)
    with pytest.raises(ValueError, match=match):
        T.check_group(T.shard_of(TP_TINY32, 2, 0), object(), torch.device(device))


@pytest.mark.parametrize("backend, device", [("nccl", "cuda:0"), ("gloo", "cpu")])
def test_the_group_check_passes_a_gpu_per_rank_or_the_cpu(monkeypatch, backend, device):
    _fake_group(monkeypatch, backend, 0, [("h", device), ("h", "cuda:1" if backend == "nccl" else "cpu")])
    T.check_group(T.shard_of(TP_TINY32, 2, 0), object(), torch.device(device))


def _fake_group(monkeypatch, backend, current, where):
    """torch.distributed's answers for rank 0 of a 2-rank group of ``backend``; all_gather_object
    returns ``where`` (default: this rank's and another GPU's)."""
    monkeypatch.setattr(T.dist, "get_world_size", lambda group: 2)
    monkeypatch.setattr(T.dist, "get_rank", lambda group: 0)
    monkeypatch.setattr(T.dist, "get_backend", lambda group: backend)
    monkeypatch.setattr(torch.cuda, "current_device", lambda: current)

    def all_gather_object(out, obj, group):
        out[:] = where or [obj, ("h", "other")]
    monkeypatch.setattr(T.dist, "all_gather_object", all_gather_object)


def test_init_distributed_names_what_is_missing(monkeypatch):
    for key in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT"):
        monkeypatch.delenv(key, raising=False)
    with pytest.raises(RuntimeError, match="RANK, WORLD_SIZE, LOCAL_RANK, MASTER_ADDR, MASTER_PORT "
                                           "not set: launch with torchrun"):
        T.init_distributed()


def test_every_rank_plans_the_same_steps_for_its_own_heads(fake_device):  # noqa: F811
    """Each rank's pkvrt backend (device planning, on the fake device of test_runtime_cpu: the
    planning kernel's Python twin) is built for the rank-local shape and, from the same lengths
    and block tables, plans the same split counts and tasks on every rank, equal to the host
    planner's balanced partition for H_kv/TP heads: no collective is needed to plan."""
    cfg = attrs.evolve(TP_TINY32, dtype=torch.float16, layers=1)
    batch, context, steps = 3, 1500, 6
    pages = M.pages_needed(batch, context, steps, cfg.page_size)
    plans = []
    for rank in range(2):
        s = T.shard_of(cfg, 2, rank)
        model = T.TPModel(cfg, s, T.make_shard_weights(cfg, s, device="cpu", seed=3))
        loop = M.DecodeLoop(model, T.make_shard_caches(cfg, s, pages, device="cpu", seed=4),
                            batch=batch, context=context, max_steps=steps, seed=5)
        backend = A.make_backend("pkvrt", model.cfg, loop, routes=ROUTES, calibration=SEED)
        rt = backend.rt
        assert (rt.num_qo_heads, rt.num_kv_heads) == (4, 1)
        route = rt.registry.route(rt.registry.device_planning_route().name)
        mine = []
        for _ in range(steps - 1):
            slots = loop.prepare(backend)
            backend.begin_step(loop.inputs.device[0], loop.block_tables.device)
            L, n = rt._layout, int(rt._v_num_tasks[0])
            splits = rt._d_num_splits[:batch].clone()
            want = planner.balanced_partition(slots.seq_lens, num_kv_heads=1, splits=route.splits,
                                              cal=rt.calibration, kind=route.kind).num_splits
            assert splits.tolist() == want.tolist()
            tasks = rt._arena[L.tasks:L.tasks + 5 * n].view(n, 5).clone()
            assert set(tasks[:, 1].tolist()) == {0}                 # the rank's one KV head
            assert n == int(want.sum()) and splits.sum() > batch    # rows are split
            assert rt.device_status() == 0
            mine.append((splits, tasks))
        plans.append(mine)
    for (s0, t0), (s1, t1) in zip(*plans):
        assert torch.equal(s0, s1) and torch.equal(t0, t1)


# --------------------------------------------------------------------------- two gloo ranks

def _gloo_ranks(out_path: str) -> None:
    """One rank of the 2-process test: the TP step against the one-process model, right, with a
    wrong shard (each rank holds the other's weights) and without the all-reduces; and the group
    checks. Rank 0 saves what it saw to ``out_path``."""
    import torch.distributed as dist

    torch.set_num_threads(1)
    rank, world, device = T.init_distributed()
    try:
        cfg, group = TP_TINY32, dist.group.WORLD
        shard = T.shard_of(cfg, world, rank)
        weights = T.make_shard_weights(cfg, shard, device=device, seed=CHECK["weight_seed"])
        errors = {}
        for name, s in (("tp", T.shard_of(cfg, 1, 0)), ("rank", T.shard_of(cfg, 2, 1 - rank))):
            try:   # both refused before any collective
                T.TPModel(cfg, s, T.make_shard_weights(cfg, s, device=device, seed=3), group=group)
            except ValueError as exc:
                errors[name] = str(exc)
        model = T.TPModel(cfg, shard, weights, group=group)
        good = T.check_against_one_gpu(model, **CHECK)
        model.communicate = False
        no_comm = T.check_against_one_gpu(model, **CHECK)
        other = T.shard_of(cfg, world, world - 1 - rank)
        wrong = T.TPModel(cfg, shard, T.make_shard_weights(cfg, other, device=device, seed=3), group=group)
        wrong_shard = T.check_against_one_gpu(wrong, **CHECK)
        fake_cuda(setattr)                    # the benchmark's collective paths, on the CPU
        bench_rows = _load(ROOT / "benches" / "tp_decode.py").run_tp(
            world, rank, device, group, BENCH_ARGS, lambda msg: None, cfg=cfg)
        if rank == 0:
            torch.save({"good": attrs.asdict(good), "no_comm": attrs.asdict(no_comm),
                        "wrong_shard": attrs.asdict(wrong_shard), "errors": errors, "bench": bench_rows,
                        "world": world, "backend": str(dist.get_backend(group))}, out_path)
    finally:
        dist.destroy_process_group()


@pytest.fixture(scope="module")
def gloo_run(tmp_path_factory):
    out = tmp_path_factory.mktemp("tp") / "rank0.pt"
    T.spawn_ranks(_gloo_ranks, 2, str(out))
    return torch.load(out)


def test_two_gloo_ranks_give_the_one_process_logits(gloo_run):
    r = gloo_run
    assert r["world"] == 2 and r["backend"] == "gloo"
    good = r["good"]
    assert good["logits"].shape == (CHECK["steps"], CHECK["batch"], TP_TINY32.vocab)
    assert good["attn0"].shape == (CHECK["steps"], CHECK["batch"], 8, 64)    # both ranks' heads
    # fp32: only the order of the sums over the two ranks' halves differs
    torch.testing.assert_close(good["attn0"], good["ref_attn0"], rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(good["logits"], good["ref_logits"], rtol=1e-5, atol=1e-5)
    assert good["ranks_agree"] and good["fields"]["logits_ok"]
    assert good["fields"]["logits_rel_err"] < 1e-5 and good["fields"]["argmax_agree"] == 1.0


def test_the_check_fails_on_a_wrong_shard_or_without_all_reduce(gloo_run):
    for name in ("wrong_shard", "no_comm"):
        bad = gloo_run[name]
        assert not bad["fields"]["logits_ok"], name
        assert bad["fields"]["logits_rel_err"] > 1e-2, name
        assert not torch.allclose(bad["logits"], bad["ref_logits"], rtol=1e-3, atol=1e-3), name
    # layer 0's attention is right without the all-reduces (they come after it), not with the
    # other rank's q/k/v weights
    torch.testing.assert_close(gloo_run["no_comm"]["attn0"], gloo_run["no_comm"]["ref_attn0"],
                               rtol=1e-5, atol=1e-6)
    assert gloo_run["wrong_shard"]["fields"]["attn0_rel_err"] > 1e-2


def test_the_group_checks_name_the_mismatch(gloo_run):
    e = gloo_run["errors"]
    assert "the process group has 2 rank(s) but the shard is for tp=1" in e["tp"]
    assert "this process is rank 0 of the group but holds the shard of rank 1" in e["rank"]


def test_the_bench_on_two_gloo_ranks(gloo_run):
    """benches/tp_decode.py's run_tp on the two gloo ranks with CPU stand-ins for CUDA (events on
    the host clock, graphs replayed eagerly; FP32 reference attention): the one-GPU check, the
    timed passes, the all-reduce alone, the rows."""
    rows = R.finish(gloo_run["bench"])
    assert [(r["row"], r["tp"], r["mode"]) for r in rows] == [("check", 2, "gloo"), ("measured", 2, "gloo")]
    check, m = rows
    assert check["logits_ok"] and check["ranks_agree"] and check["logits_rel_err"] < 1e-5
    assert m["ref_ok"] and m["attn0_ref_err"] < 1e-5 and m["ranks_agree"] and "status_error" not in m
    assert len(m["rank_ms"]) == 2 and m["ms_per_step"] == max(m["rank_ms"]) > 0
    assert m["steps"] == BENCH_ARGS.steps and m["scaling_efficiency"] is None   # no TP 1 row
    for key in ("attention_share", "comm_share", "allreduce_us", "allreduce_share_alone", "interval_ms"):
        assert m[key] is not None, key
    assert m["allreduce_calls"] == 2 * TP_TINY32.layers and m["kv_gib"] > 0


def test_the_bench_shard_only_on_the_cpu(monkeypatch):
    bench = _load(ROOT / "benches" / "tp_decode.py")
    fake_cuda(monkeypatch.setattr)
    rows = bench.run_tp(2, 0, torch.device("cpu"), None, BENCH_ARGS, lambda msg: None, cfg=TP_TINY32)
    assert [(r["row"], r["mode"], r["tp"]) for r in rows] == [("measured", "shard-only", 2)]
    m = rows[0]
    assert m["comm_share"] is None and m["allreduce_us"] is None and len(m["rank_ms"]) == 1
    assert m["ref_ok"] and "ranks_agree" not in m and m["attention_share"] is not None


def fake_cuda(set_attr) -> None:
    """CPU stand-ins for what benches/tp_decode.py asks of CUDA (``set_attr``: setattr, or
    monkeypatch.setattr): host-clock events, no-op synchronize, a 16 GiB device, and graphs that
    replay the step eagerly (the capture only prepares it, as DecodeLoop.capture's warm-up does)."""
    from pkvrt.runtime import graphs

    def capture_step(loop, attention):
        loop.prepare(attention)
        return types.SimpleNamespace(replay=lambda: loop.forward(attention))

    def capture(launch, **kw):
        launch()
        return types.SimpleNamespace(graph=types.SimpleNamespace(replay=launch))

    set_attr(torch.cuda, "Event", FakeEvent)
    set_attr(torch.cuda, "synchronize", lambda *a, **k: None)
    set_attr(torch.cuda, "Stream", lambda *a, **k: None)
    set_attr(torch.cuda, "get_device_properties", lambda d: types.SimpleNamespace(total_memory=2**34))
    set_attr(T, "capture_step", capture_step)
    set_attr(graphs, "capture", capture)


BENCH_ARGS = argparse.Namespace(batches=[2], contexts=[13], steps=3, warmup=1, check_steps=3,
                                check_context=13, engine="reference", no_check=False, layers=2,
                                dtype="float32")


# --------------------------------------------------------------------------- results, report

def _ranks(ms, *, no_comm=None, ar=None, err=1e-4, agree=True):
    return {"replay_ms": [ms, ms * 1.01, ms * 0.99], "interval_ms": [ms * 1.02] * 2,
            "no_attention_ms": [ms * 0.6] * 3, "no_comm_ms": None if no_comm is None else [no_comm] * 3,
            "allreduce_us": ar, "attn0_ref_err": err, "ranks_agree": agree}


def synthetic_rows():
    cfg = M.LLAMA3_8B
    rows = []
    for tp, ms in ((1, 14.0), (2, 8.0)):
        cases = T.plan_tp_cases(cfg, tp, [8], [32768, 131072], steps=26, capacity_bytes=H200_BYTES)
        ranks = [_ranks(ms, no_comm=None if tp == 1 else ms * 0.9, ar=None if tp == 1 else 12.0)] * tp
        rows.append(R.measured_row(cases[0], model=cfg.name, engine="pkvrt", tp=tp, mode="nccl",
                                   ranks=ranks, warmup=5, steps=3, allreduce_calls=64,
                                   dtype=torch.float16))
        if cases[1].fits:
            rows.append(R.measured_row(cases[1], model=cfg.name, engine="pkvrt", tp=tp, mode="nccl",
                                       ranks=[_ranks(20.0, no_comm=19.0, ar=12.0, err=0.5)] * tp,
                                       warmup=5, steps=3, allreduce_calls=64, dtype=torch.float16))
        else:
            rows.append(R.skipped_row(cases[1], model=cfg.name, tp=tp))
        small = T.plan_tp_cases(cfg, tp, [2], [1005], steps=5, capacity_bytes=H200_BYTES)[0]
        rows.append(R.check_row(small, model=cfg.name, engine="pkvrt", tp=tp, mode="nccl", steps=4,
                                fields={"logits_rel_err": 3e-3, "attn0_rel_err": 1e-3,
                                        "argmax_agree": 1.0, "logits_ok": True}, ranks_agree=True))
    shard = T.plan_tp_cases(cfg, 4, [8], [32768], steps=26, capacity_bytes=H200_BYTES)[0]
    rows.append(R.measured_row(shard, model=cfg.name, engine="pkvrt", tp=4, mode="shard-only",
                               ranks=[_ranks(5.0)], warmup=5, steps=3, allreduce_calls=64,
                               dtype=torch.float16))
    return R.finish(rows)


def test_rows_scaling_efficiency_and_shares():
    rows = synthetic_rows()
    by = {(r["case"], r["tp"], r["mode"], r["row"]): r for r in rows}
    one = by["llama3-8b-B8-32K", 1, "nccl", "measured"]
    two = by["llama3-8b-B8-32K", 2, "nccl", "measured"]
    assert one["ms_per_step"] == pytest.approx(14.0) and one["tokens_per_s"] == pytest.approx(8 / 0.014)
    assert one["scaling_efficiency"] == 1.0 and one["comm_share"] is None and one["allreduce_us"] is None
    assert two["scaling_efficiency"] == pytest.approx((8 / 0.008) / (2 * 8 / 0.014))   # 0.875
    assert two["comm_share"] == pytest.approx(0.1) and two["attention_share"] == pytest.approx(0.4)
    assert two["allreduce_share_alone"] == pytest.approx(64 * 12.0e-3 / 8.0)
    assert two["rank_ms"] == [8.0, 8.0] and two["ref_ok"] and two["ranks_agree"]
    big = by["llama3-8b-B8-128K", 2, "nccl", "measured"]
    assert big["scaling_efficiency"] is None and big["ref_ok"] is False and R.check_failed(big)
    skipped = [r for r in rows if r["row"] == "skipped"]
    assert len(skipped) == 1 and skipped[0]["tp"] == 1 and "149.0 GiB" in skipped[0]["reason"]
    assert by["llama3-8b-B8-32K", 4, "shard-only", "measured"]["scaling_efficiency"] is None
    with pytest.raises(ValueError, match="mode='ring'"):
        R.measured_row(T.plan_tp_cases(M.LLAMA3_8B, 1, [1], [8], steps=1, capacity_bytes=H200_BYTES)[0],
                       model="m", engine="pkvrt", tp=1, mode="ring", ranks=[_ranks(1.0)], warmup=0,
                       steps=3, allreduce_calls=0, dtype=torch.float16)


def test_report_renders_a_tp_decode_file(tmp_path):
    from pkvrt.measure import results
    from pkvrt.tools import report

    results.write_results(tmp_path / "tp-decode.json", {"kind": R.KIND, "date": "2027-01-01"},
                          synthetic_rows())
    results.write_results(tmp_path / "other.json", {"kind": "serving-steps"}, [])
    files = report.load_dir(tmp_path)                      # validates every row
    text, _ = report.build_report(files, tmp_path / "report", plots=False)
    assert "## Tensor-parallel decode" in text
    assert ("| llama3-8b-B8-32K | 2 | nccl | pkvrt | 8.00 | 1000 | 0.875 | 40.0 % | 10.0 % | 12.0 | "
            "8.5 + 16.0 | ok: layer 0 vs FP32 1.0e-04 (worst rank); logits identical on every rank |") in text
    assert "| llama3-8b-B8-32K | 1 | nccl | pkvrt | 14.00 | 571 | 1.000 | 40.0 % | - | - |" in text
    assert "| llama3-8b-B8-32K | 4 | shard-only | pkvrt | 5.00 | 1600 | - |" in text
    assert "| llama3-8b-B8-128K | 2 | nccl | pkvrt | 20.00 | 400 | - |" in text and "**FAILED**" in text
    assert "| llama3-8b-B2-1005 | 2 | pkvrt | 4 | 3.0e-03 | 1.0e-03 | 100.0 % | yes | ok |" in text
    assert "| llama3-8b-B8-32K | 1 | nccl | pkvrt | 14.00 | 571 | 1.000 | 40.0 % | - | - | 15.0 + 32.0 | " \
           "ok: layer 0 vs FP32 1.0e-04 (worst rank) |" in text          # one rank: no agreement
    assert "- llama3-8b-B8-128K TP 1: skipped (TP 1: a rank needs 149.0 GiB" in text
    assert "Other results: tp-decode.json" not in text     # handled, not a generic table
    assert R.tp_decode_table([("x.json", {"meta": {"kind": "model-decode"}, "rows": []})]) == ""


# --------------------------------------------------------------------------- scripts without a GPU

def _load(path: Path):
    spec = importlib.util.spec_from_file_location(path.stem, path)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the no-GPU path")
def test_example_and_bench_say_they_need_a_gpu(capsys):
    assert _load(ROOT / "examples" / "tp_decode.py").main([]) == 0
    assert "needs CUDA GPUs" in capsys.readouterr().out
    bench = _load(ROOT / "benches" / "tp_decode.py")
    assert bench.main([]) == 2
    assert "needs CUDA GPUs" in capsys.readouterr().err
    assert bench.parse_counts("1,2,4") == [1, 2, 4] and bench.parse_counts("32K") == [32768]
