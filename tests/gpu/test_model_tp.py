"""Tensor-parallel decode (pkvrt/measure/model_tp.py) on GPUs: a TP 1 shard is the one-GPU model bit for
bit (both steps captured in one CUDA graph, pkvrt's attention); shards drawn on the GPU equal the
slices of the one-GPU weights and caches; with two GPUs, two NCCL ranks with the whole step
(both all-reduces of every layer) captured in one graph each give the one-GPU step's logits
within the fp16 tolerance while the rows grow across page boundaries; the example and the
benchmark run end to end (on two GPUs when there are two)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from pkvrt.measure import model as M
from pkvrt.measure import model_results as R
from pkvrt.measure import model_tp as T

pytestmark = pytest.mark.gpu

ROOT = Path(__file__).resolve().parents[2]
# 8 query heads over 2 KV heads, D 128: at TP 2 each rank has the kernels' tested shape
# H_q 4, H_kv 1 (G 4); fp16, 16-token pages.
CFG = M.ModelConfig(layers=2, hidden=1024, num_qo_heads=8, num_kv_heads=2, head_dim=128,
                    intermediate=1024, vocab=1000, name="tiny-tp")
CHECK = dict(batch=3, context=45, steps=22, weight_seed=0, cache_seed=1, pool_seed=3, token_seed=2)
TWO_GPUS = pytest.mark.skipif(torch.cuda.is_available() and torch.cuda.device_count() < 2,
                              reason="needs 2 GPUs")


def test_tp1_shard_is_the_one_gpu_model_bit_for_bit():
    shard = T.shard_of(CFG, 1, 0)
    model = T.TPModel(CFG, shard, T.make_shard_weights(CFG, shard, device="cuda", seed=0))
    chk = T.check_against_one_gpu(model, engine="pkvrt", **CHECK)   # both captured in a graph
    assert torch.equal(chk.logits, chk.ref_logits) and torch.equal(chk.attn0, chk.ref_attn0)
    assert chk.fields["logits_ok"] and torch.isfinite(chk.logits).all()


def test_shards_drawn_on_the_gpu_are_the_one_gpu_slices():
    full_w = M.make_weights(CFG, device="cuda", seed=5)
    full_c = M.make_caches(CFG, 9, device="cuda", seed=6)
    for rank in range(2):
        s = T.shard_of(CFG, 2, rank)
        w, want = T.make_shard_weights(CFG, s, device="cuda", seed=5), T.shard_weights(CFG, s, full_w)
        for a, b in zip(w.layers, want.layers):
            assert all(torch.equal(getattr(a, n), getattr(b, n)) for n in ("qkv", "o", "gate_up", "down"))
        c = T.make_shard_caches(CFG, s, 9, device="cuda", seed=6)
        assert torch.equal(c.k, full_c.k[:, :, rank:rank + 1]) and torch.equal(c.v, full_c.v[:, :, rank:rank + 1])


def _nccl_ranks(out_path: str) -> None:
    """One rank of the 2-GPU test; rank 0 saves the check."""
    import torch.distributed as dist

    rank, world, device = T.init_distributed()
    try:
        shard = T.shard_of(CFG, world, rank)
        model = T.TPModel(CFG, shard, T.make_shard_weights(CFG, shard, device=device, seed=0),
                          group=dist.group.WORLD)
        chk = T.check_against_one_gpu(model, engine="pkvrt", **CHECK)
        if rank == 0:
            torch.save({"fields": chk.fields, "ranks_agree": chk.ranks_agree, "world": world,
                        "attn0": chk.attn0, "ref_attn0": chk.ref_attn0}, out_path)
    finally:
        dist.destroy_process_group()


@TWO_GPUS
def test_two_nccl_ranks_captured_in_graphs_match_one_gpu(tmp_path):
    out = tmp_path / "rank0.pt"
    T.spawn_ranks(_nccl_ranks, 2, str(out))
    r = torch.load(out)
    f = r["fields"]
    assert r["world"] == 2 and r["ranks_agree"]
    assert f["logits_ok"], f
    assert f["logits_rel_err"] <= R.logits_tolerance(CFG.dtype)
    for s in range(CHECK["steps"]):            # every step, across the pages taken at 48 and 64
        err = R.rel_err(r["attn0"][s], r["ref_attn0"][s])[1]
        assert err <= R.attention_tolerance(CFG.dtype), f"step {s}: layer 0 rel err {err:.1e}"


def _env() -> dict:
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join(p for p in (str(ROOT), env.get("PYTHONPATH")) if p)
    return env


def test_example_runs_on_the_gpus_there_are():
    n = min(2, torch.cuda.device_count())
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", str(n),
           str(ROOT / "examples" / "tp_decode.py"), "--layers", "2", "--batch", "2", "--context", "1000",
           "--steps", "3"]
    p = subprocess.run(cmd, cwd=ROOT, env=_env(), capture_output=True, text=True, timeout=600)
    assert p.returncode == 0, p.stdout[-3000:] + p.stderr[-3000:]
    assert "ms per step" in p.stdout and ": ok" in p.stdout and "the same on every rank: True" in p.stdout


def test_bench_writes_a_checked_results_file(tmp_path):
    out = tmp_path / "tp-decode.json"
    common = ["--layers", "2", "--batches", "2", "--contexts", "1000", "--steps", "3", "--warmup", "1",
              "--check-steps", "2"]
    p = subprocess.run([sys.executable, str(ROOT / "benches" / "tp_decode.py"), "--tp", "1,2",
                        "--out", str(out), *common],
                       cwd=ROOT, env=_env(), capture_output=True, text=True, timeout=600)
    assert p.returncode == 0, p.stdout[-3000:] + p.stderr[-3000:]
    doc = json.loads(out.read_text())
    assert doc["meta"]["kind"] == "tp-decode" and doc["meta"]["gpu_count"] >= 1
    rows = doc["rows"]
    one = [r for r in rows if r["row"] == "measured" and r["tp"] == 1]
    assert len(one) == 1 and one[0]["ms_per_step"] > 0 and one[0]["scaling_efficiency"] == 1.0
    assert one[0]["ref_ok"] and "status_error" not in one[0]
    assert all(r["logits_ok"] and r["ranks_agree"] for r in rows if r["row"] == "check")
    two = [r for r in rows if r["tp"] == 2]
    if torch.cuda.device_count() >= 2:
        m = next(r for r in two if r["row"] == "measured")
        assert m["comm_share"] is not None and m["allreduce_us"] > 0 and m["scaling_efficiency"] > 0
        assert m["ranks_agree"] and m["ref_ok"] and len(m["rank_ms"]) == 2
    else:
        assert two and all(r["row"] == "skipped" and "needs 2 GPUs" in r["reason"] for r in two)
    shard = tmp_path / "tp-decode-shard2.json"
    p = subprocess.run([sys.executable, str(ROOT / "benches" / "tp_decode.py"), "--shard-only", "2",
                        "--out", str(shard), *common],
                       cwd=ROOT, env=_env(), capture_output=True, text=True, timeout=600)
    assert p.returncode == 0, p.stdout[-3000:] + p.stderr[-3000:]
    rows = json.loads(shard.read_text())["rows"]
    assert [(r["row"], r["mode"], r["tp"]) for r in rows] == [("measured", "shard-only", 2)]
    assert rows[0]["comm_share"] is None and rows[0]["attention_share"] is not None
