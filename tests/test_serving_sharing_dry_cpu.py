"""``python -m pkvrt bench serving --engines flashinfer,device-plan-step,shared-step,shared-device-step``
on the sharing traces run end to end on the CPU (tests/dry_bench.py's fake GPU and stand-in
FlashInfer), so that a GPU call spends its minutes on the measurement, not on the harness's own
mistakes: the real command line through ``pkvrt.tools.cli.main`` and ``serving_on_gpu`` (the
baseline probe over FlashInfer's paths, every engine's correctness check against the FP32
reference and FlashInfer's output, the warm-up, interleaved wall passes, the device pass, the
results file and its ``.steps.json``), on ``--trace parallel``, ``--trace sysprompt`` and a JSON
trace file whose requests carry ``hash_ids`` (docs/traces.md, "Shared prefixes").

What stands in for the GPU, besides tests/dry_bench.py: the kernels are said to be launchable
(``_driver.available``; without this the command refuses every pkvrt engine before it starts),
the workload lives on the CPU (``harness.run_seed(device="cpu")``), and the two allocations the
harness and FlashInfer's engines make on "cuda" by name (the L2 flush buffer, the pinned CSR
staging) run on the host (``dry_bench.on_the_host``). Made small for the CPU: 2 layers a step
instead of 32, the synthetic traces' prompt lengths and prefix-hash blocks divided by 32 (the
same requests, arrivals, decode lengths and sharing: block 512 becomes 16 tokens, one page), the
fake H200's L2 divided by 32 with them (about as many cache copies as at full size, and a small
L2 flush buffer), 6 steps instead of 24 for the second and third trace. Checked: every engine's measured row (correct, checked on 2
steps against the FP32 reference, timed on every step) and ratio row, the steps file, that the
shared engines ran the shared path on the steps that share (their graphs keyed by a shared step,
what find_shared found, the route and K/V bytes they report) and that a wrong merge fails.

What this cannot see: what tests/dry_bench.py lists (the kernels' numerics, everything FP32 on
the CPU; real graph capture beyond its recording; placement, memory and every timing and ratio),
the cuDNN path (the stand-in FlashInfer has none: recorded unavailable), the full-size traces
(prompts up to 32K, 32 layers: the cache copies and the memory budget at size) and CUDA-event
timing behind the spin kernel.
"""

from __future__ import annotations

import functools
import json
import types

import attrs
import pytest
import torch
from dry_bench import fake_gpu, on_the_host  # noqa: F401

from pkvrt.launch import _driver, ops
from pkvrt.measure import fi_engines, harness
from pkvrt.policy import sharing
from pkvrt.tools import bench, cli
from pkvrt.runtime.shared import SharedPagesRuntime

SHRINK = 32
LAYERS = 2
ENGINES = "flashinfer,device-plan-step,shared-step,shared-device-step"
LABELS = ("pkvrt-device-plan-step", "pkvrt-shared-step", "pkvrt-shared-device-step")
FI = ("flashinfer-cuda", "flashinfer-tc", "flashinfer-xqa")


def scaled(trace):
    """A synthetic family's trace with its prompt lengths and hash blocks divided by SHRINK (the
    same requests and prefix hashes: block 512 becomes 16 tokens); a file trace as it is."""
    if not trace.source.startswith("synthetic:"):
        return trace
    reqs = [attrs.evolve(r, prompt_len=max(1, r.prompt_len // SHRINK)) for r in trace.requests]
    return attrs.evolve(trace, requests=reqs, block_tokens=trace.block_tokens // SHRINK)


@pytest.fixture
def dry(fake_gpu, monkeypatch):  # noqa: F811
    """The serving command on the fake GPU, small (module docstring); ``made``: the engines
    the harness built, by name; ``found``: the shared tokens of each step find_shared ran on."""
    monkeypatch.setattr(_driver, "available", lambda: None)
    monkeypatch.setattr(harness, "run_seed", functools.partial(harness.run_seed, device="cpu"))
    monkeypatch.setattr(harness.CudaClock, "flush_l2", on_the_host(harness.CudaClock.flush_l2))
    monkeypatch.setattr(fi_engines.FlashInferEngine, "__init__",
                        on_the_host(fi_engines.FlashInferEngine.__init__))
    props = vars(torch.cuda.get_device_properties(0))
    monkeypatch.setattr(torch.cuda, "get_device_properties", lambda *a, **k: types.SimpleNamespace(
        **{**props, "L2_cache_size": props["L2_cache_size"] // SHRINK}))
    resolve = bench.resolve_trace
    monkeypatch.setattr(bench, "resolve_trace", lambda *a, **k: scaled(resolve(*a, **k)))
    made, factory = {}, bench.engine_factory

    def keeping(*a, **k):
        make = factory(*a, **k)

        def make_engine(name, wl, fi_route):
            made[name] = make(name, wl, fi_route)
            return made[name]
        return make_engine

    monkeypatch.setattr(bench, "engine_factory", keeping)
    found, find_shared = [], ops.find_shared

    def noting(seq_lens, block_tables, chunk_seq, *a, **k):   # chunk tokens, each time it runs
        find_shared(seq_lens, block_tables, chunk_seq, *a, **k)
        fake_gpu.launch(lambda: found.append(int(chunk_seq.sum())))

    monkeypatch.setattr(ops, "find_shared", noting)
    # the shrunk steps are too short for the time model to predict a gain from sharing: the
    # host-lengths engine shares them anyway, so that its shared path runs through the harness
    # (tests/test_sharing_rule_cpu.py tests the rule itself)
    monkeypatch.setattr(SharedPagesRuntime, "_sharing_pays", lambda self, seq, rereads, sp, own_gather: True)
    # ... and so does the device-lengths engine's rule (tests/test_sharing_device_rule_cpu.py)
    decide = sharing.SharingRule.decide
    monkeypatch.setattr(sharing.SharingRule, "decide",
                        lambda self, *a: attrs.evolve(decide(self, *a), shared=True))
    return types.SimpleNamespace(gpu=fake_gpu, made=made, found=found)


def serve(tmp_path, trace: str, steps: int) -> tuple[int, dict, dict]:
    """The planned GPU command (2 layers, ``steps`` steps): exit status, results, steps file."""
    out = tmp_path / "F.json"
    rc = cli.main(["bench", "serving", "--trace", trace, "--max-active", "8", "--steps-limit", str(steps),
                   "--check-steps", "2", "--engine-layers", str(LAYERS), "--seeds", "20260623",
                   "--engines", ENGINES, "--out", str(out)])
    return rc, json.loads(out.read_text()), json.loads(bench.steps_path(out).read_text())


def check_run(dry, doc: dict, steps_doc: dict, case: str, steps: int) -> None:
    """Every engine measured, correct against the FP32 reference on the checked steps, with a
    ratio row; the shared engines ran shared steps."""
    meta, rows = doc["meta"], doc["rows"]
    assert meta["kind"] == "serving" and meta["gpu"] == "NVIDIA H200" and meta["layers"] == LAYERS
    assert meta["engines"] == ENGINES.split(",") and meta["calibration_slug"] == "nvidia-h200"
    assert meta["baseline_candidates"]["flashinfer-cudnn"].startswith("unavailable: NotImplementedError")
    assert all(meta["baseline_candidates"][p] == "ok" for p in FI)
    measured = {r["engine"]: r for r in rows if r["row"] == "measured"}
    assert sorted(measured) == sorted([meta["per_seed"]["20260623"]["baseline"], *LABELS])
    for label, r in measured.items():
        assert r["case"] == case and r["correct"] and r["checked_steps"] == 2, r
        assert r["max_err_ref"] < harness.MAX_ERR and r["max_err"] < harness.MAX_ERR, r
        assert r["steps"] == steps and r["median_us"] > 0 and r["timed_passes"] == 4
        assert r["baseline"] == (label in FI)
    ratios = [r for r in rows if r["row"] == "ratio"]
    assert sorted(r["numerator"] for r in ratios) == sorted(LABELS)
    assert all(r["cuda_ratio"] > 0 and r["wall_ratio"] > 0 for r in ratios)
    assert len(steps_doc["rows"]) == 4 * steps and steps_doc["meta"]["kind"] == "serving-steps"
    # the shared paths ran: host lengths in graphs keyed by a shared step, device lengths on
    # what find_shared found; both read fewer K/V bytes than every row reading its pages
    plain, shared, device = (measured[x] for x in LABELS)
    assert "shared-pages" in shared["route_mix"] and "shared-pages-device" in device["route_mix"]
    assert shared["useful_kv_mb"] < plain["useful_kv_mb"] and device["useful_kv_mb"] < plain["useful_kv_mb"]
    assert any(key[0][0] == "shared" for key in dry.made["shared-step"].graphs)
    assert len(dry.found) >= 5 * steps and max(dry.found) > 0   # check, warm-up, 3 wall passes, device


def test_parallel_sampling_as_the_gpu_call_runs_it(dry, tmp_path):
    rc, doc, steps_doc = serve(tmp_path, "parallel", 24)
    assert rc == 0
    check_run(dry, doc, steps_doc, f"parallel-B8-L{LAYERS}-seed20260623", 24)


def test_a_shared_system_prompt(dry, tmp_path):
    rc, doc, steps_doc = serve(tmp_path, "sysprompt", 6)
    assert rc == 0
    check_run(dry, doc, steps_doc, f"sysprompt-B8-L{LAYERS}-seed20260623", 6)


def conversations(path) -> None:
    """A JSON trace as a Mooncake conversation trace converts (docs/traces.md): 16 requests of 4
    conversations, every prompt beginning with one 2-block system prompt (hashes 0, 1), each
    turn's prompt its conversation's previous one plus new blocks, blocks of 32 tokens; arrivals
    staggered, so that turns of a conversation and other conversations share a step."""
    reqs = []
    for turn in range(4):
        for conv in range(4):
            blocks = 2 + 2 * turn + conv % 2              # whole blocks; then a partial one
            hashes = [0, 1] + [1000 * (conv + 1) + j for j in range(2, blocks + 1)]
            reqs.append({"arrival_step": 5 * turn + conv, "prompt_len": 32 * blocks + 5 * conv + 3,
                         "decode_len": 10 + 4 * conv, "hash_ids": hashes})
    path.write_text(json.dumps({"block_tokens": 32, "requests": reqs}))


def test_a_json_trace_with_hash_ids(dry, tmp_path):
    trace = tmp_path / "conversations.json"
    conversations(trace)
    rc, doc, steps_doc = serve(tmp_path, str(trace), 6)
    assert rc == 0 and doc["meta"]["trace_source"] == str(trace)
    check_run(dry, doc, steps_doc, f"conversations-B8-L{LAYERS}-seed20260623", 6)


def test_a_wrong_merge_fails_the_shared_engines(dry, tmp_path, monkeypatch, capsys):
    """merge_segments off by one on one element of its output: both shared engines fail the
    check (not timed, no ratio), the command exits 1 and says so; the plain engine passes."""
    merge = ops.merge_segments

    def off(out_v, lse_v, out_o, lse_o, slots, out, **kw):
        merge(out_v, lse_v, out_o, lse_o, slots, out, **kw)
        dry.gpu.launch(lambda: out[0, 0, 0].add_(1.0))

    monkeypatch.setattr(ops, "merge_segments", off)
    rc, doc, _ = serve(tmp_path, "parallel", 4)
    assert rc == 1
    measured = {r["engine"]: r for r in doc["rows"] if r["row"] == "measured"}
    assert measured["pkvrt-device-plan-step"]["correct"]
    err = capsys.readouterr().err
    for label in LABELS[1:]:
        assert not measured[label]["correct"] and "median_us" not in measured[label]
        assert f"FAILED correctness: parallel-B8-L{LAYERS}-seed20260623 {label}" in err
    assert [r["numerator"] for r in doc["rows"] if r["row"] == "ratio"] == ["pkvrt-device-plan-step"]
