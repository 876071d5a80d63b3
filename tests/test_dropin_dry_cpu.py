"""benches/dropin.py run end to end on the CPU (tests/dry_bench.py's fake GPU and stand-in
FlashInfer), so that a GPU call spends its minutes on the measurement, not on the script's own
mistakes: its real ``main()`` in both calling styles (SGLang's page-1 NHD K and V, vLLM's packed
block-64 cache), both Azure trace files, the time budget, and the paths it records as
unavailable or wrong.

Made small for the CPU, by the script's module constants: 2 layers instead of 32, 1 replay,
2 timed plan() calls, CPU tensors, a tiny workspace; the cases' lengths divided by 64 (names
and row counts kept). The drop-in and FlashInfer's wrapper run in CUDA-graph mode as on the
GPU: plan() outside the graph, run() captured, and the replay after a re-plan reads the buffers
plan() rewrote (tests/dry_bench.py records the launches, and the stand-in FlashInfer reads its
CSR where plan() left it). Checked: the results file (meta, a row per engine and step with the
FP32 check, plan() host time and floor_us, a ratio row), that it passes the report's validator
and renders, the printed table, and that a replay computing nothing fails the check.

What this cannot see: what tests/dry_bench.py lists (numerics, real capture, placement, memory,
time; the plan() host times here include the emulated planning kernel), FlashInfer's own
refusals beyond the stand-in's, and the full-size steps (32K rows, 262 144 page-1 slots).
"""

from __future__ import annotations

import json
import pathlib
import shutil
import time
import types

import pytest
from dry_bench import RecordedGraph, fake_gpu, load_bench, shrunk  # noqa: F401

from pkvrt.measure import coverage_results
from pkvrt.measure import model_shapes as shapes
from pkvrt.runtime import wrapper as dropin_wrapper
from pkvrt.tools import report

ROOT = pathlib.Path(__file__).resolve().parents[1]
LAYERS, SHRINK = 2, 64
ENGINES = ("pkvrt", "flashinfer-tc", "flashinfer-cuda")




bench = load_bench("dropin")




@pytest.fixture
def dry(fake_gpu, monkeypatch, tmp_path):  # noqa: F811
    """The bench on the fake GPU, small; a trace folder holding the shipped fixture trace as
    both Azure traces."""
    for name, value in (("DEVICE", "cpu"), ("LAYERS", LAYERS), ("REPLAYS", 1), ("PLAN_CALLS", 2),
                        ("WORKSPACE", 1024), ("isolated_steps", lambda: shrunk(shapes.isolated_steps(), SHRINK)),
                        ("sample_steps", lambda *a, **k: shrunk(shapes.sample_steps(*a, **k), SHRINK))):
        monkeypatch.setattr(bench, name, value)
    for name in ("azure2023_conv.csv", "azure2023_code.csv"):
        shutil.copy(ROOT / "pkvrt" / "_data" / "traces" / "mixed.csv", tmp_path / name)
    return fake_gpu


def run(tmp_path, *args) -> dict:
    out = tmp_path / "dropin.json"
    assert bench.main(["--steps", "1", "--out", str(out), *args]) == 0
    return json.loads(out.read_text())


def rendered(tmp_path) -> str:
    return coverage_results.dropin_table(report.load_dir(tmp_path))


CASES = ["isolated-B1-32K", "isolated-B8-32K", "bucketed-B1-step0", "bimodal-B8-step0", "uniform-B8-step0",
         "zipf-B8-step0", "bimodal-B4-step0", "azure2023_conv-B8-step0", "azure2023_code-B8-step0"]


def test_main_measures_both_calling_styles(dry, tmp_path, capsys):
    doc = run(tmp_path, "--trace-dir", str(tmp_path))
    printed = capsys.readouterr().out
    meta, rows = doc["meta"], doc["rows"]
    assert meta["kind"] == "dropin" and meta["model"] == "llama-3.1-8b" and meta["layers"] == LAYERS
    assert meta["plan_calls"] == 2 and meta["protocol"].startswith("Calling styles")
    for style in ("sglang", "vllm"):
        mine = [r for r in rows if r["style"] == style]
        assert [r["case"] for r in mine] == [f"{style}-{c}" for c in CASES for _ in range(4)]
        assert [r["engine"] for r in mine] == [*ENGINES, "ratio"] * len(CASES)
        for r in mine:
            if r["engine"] == "ratio":
                assert r["ratio"] > 0 and r["plan_host_ratio"] > 0 and r["baseline"] in ENGINES[1:]
                continue
            assert r["status"] == "ok" and r["max_err_ref"] < 1e-3, r
            assert r["median_us"] > 0 and r["plan_host_us"] > 0 and r["floor_us"] > 0
            assert r["rows"] >= 1 and r["max_context"] >= 1 and r["distinct_caches"] == LAYERS
            assert ("explain" in r) == (r["engine"] == "pkvrt")
            # pkvrt's plan() also timed building block tables first (the ablation), same step
            assert (r.get("plan_host_us_blocktables", 0) > 0) == (r["engine"] == "pkvrt")
        assert f"| {style} | {len(CASES)} |" in printed
    assert not dry.poisoned
    table = rendered(tmp_path)
    assert f"| sglang | {len(CASES)} | {len(CASES)} |" in table and "unavailable" not in table


def test_the_drop_in_is_served_by_pkvrt_in_both_styles(dry, tmp_path, monkeypatch):
    """The drop-in rows are pkvrt's own (a device-planning Runtime per wrapper), never
    FlashInfer's wrapper behind it: a fallback would time FlashInfer twice."""
    made = []
    real = dropin_wrapper.BatchDecodeWithPagedKVCacheWrapper.plan

    def plan(self, *a, **k):
        real(self, *a, **k)
        made.append((self.fallback_reason, self.runtime.device_planning, self.runtime.kv_layout))

    monkeypatch.setattr(dropin_wrapper.BatchDecodeWithPagedKVCacheWrapper, "plan", plan)
    run(tmp_path)
    assert made and set(made) == {(None, True, "NHD")}


def test_a_replay_that_computes_nothing_fails_the_check(dry, tmp_path, monkeypatch):
    """The check after the re-plan reads what the graph's replay wrote: a replay that runs
    nothing leaves layer 0 NaN, and every engine is "wrong" (no ratio, the table says so)."""
    monkeypatch.setattr(bench.torch.cuda, "CUDAGraph", NothingGraph)
    rows = run(tmp_path, "--styles", "vllm")["rows"]
    engines = [r for r in rows if r["engine"] != "ratio"]
    assert engines and all(r["status"] == "wrong: rel. error inf against the FP32 reference" for r in engines)
    assert {r["ratio"] for r in rows if r["engine"] == "ratio"} == {None}
    assert "Paths unavailable or wrong" in rendered(tmp_path)


class NothingGraph(RecordedGraph):
    """A CUDA graph whose replay runs none of the launches it captured."""

    def replay(self) -> None:
        assert self.launches


def test_unavailable_paths_are_recorded_and_the_table_still_prints(dry, tmp_path, monkeypatch, capsys):
    """FlashInfer's CUDA-core wrapper refusing every plan and the drop-in failing on vLLM's
    steps: their rows say why, the ratio falls back to the tensor-core wrapper or is None."""
    import flashinfer

    fi_plan = flashinfer.BatchDecodeWithPagedKVCacheWrapper.plan

    def tensor_cores_only(self, *a, **k):
        if not self.use_tensor_cores:
            raise RuntimeError("no CUDA-core kernel (test)")
        fi_plan(self, *a, **k)

    monkeypatch.setattr(flashinfer.BatchDecodeWithPagedKVCacheWrapper, "plan", tensor_cores_only)
    pk_plan = dropin_wrapper.BatchDecodeWithPagedKVCacheWrapper.plan

    def no_block_64(self, indptr, indices, last, hq, hkv, d, page, **k):
        if page == 64:
            raise ValueError("page 64 refused (test)")
        pk_plan(self, indptr, indices, last, hq, hkv, d, page, **k)

    monkeypatch.setattr(dropin_wrapper.BatchDecodeWithPagedKVCacheWrapper, "plan", no_block_64)
    rows = run(tmp_path)["rows"]
    cuda = [r for r in rows if r["engine"] == "flashinfer-cuda"]
    assert cuda and all(r["status"] == "unavailable: RuntimeError: no CUDA-core kernel (test)" for r in cuda)
    ratios = {r["style"]: r for r in rows if r["engine"] == "ratio"}
    assert ratios["sglang"]["baseline"] == "flashinfer-tc" and ratios["sglang"]["ratio"] > 0
    assert ratios["vllm"]["ratio"] is None and ratios["vllm"]["plan_host_ratio"] is None
    vllm_pk = [r for r in rows if r["style"] == "vllm" and r["engine"] == "pkvrt"]
    assert all(r["status"] == "unavailable: ValueError: page 64 refused (test)" for r in vllm_pk)
    printed = capsys.readouterr().out
    assert "| sglang |" in printed and "| vllm |" not in printed
    assert "| vllm | 7 | 0 | - | - |" in rendered(tmp_path)


def test_the_time_budget_stops_between_steps(dry, tmp_path, monkeypatch, capsys):
    """Each engine's measurement takes 20 s: with --max-seconds 50 the first step of the first
    style is measured (3 engines), nothing after it, and the file holds that step."""
    clock = types.SimpleNamespace(now=0.0)
    monkeypatch.setattr(bench, "time", types.SimpleNamespace(monotonic=lambda: clock.now,
                                                            perf_counter=time.perf_counter))
    measure = bench.measure

    def slow(*a, **k):
        clock.now += 20
        return measure(*a, **k)

    monkeypatch.setattr(bench, "measure", slow)
    rows = run(tmp_path, "--max-seconds", "50")["rows"]
    assert [(r["case"], r["engine"]) for r in rows] == [("sglang-isolated-B1-32K", e) for e in (*ENGINES, "ratio")]
    printed = capsys.readouterr().out
    assert printed.count("time budget spent: isolated-B8-32K and later not measured") == 1
    assert printed.count("time budget spent: isolated-B1-32K and later not measured") == 1   # vllm
    assert "| sglang | 1 |" in printed


def test_profile_plan_keeps_where_each_wrappers_plan_time_goes(dry, tmp_path, capsys, monkeypatch):
    """--profile-plan: every measured wrapper row carries its plan()'s top functions (own time
    per call, largest first), pkvrt's own plan() among pkvrt's, and the summary prints them."""
    monkeypatch.setattr(bench, "PLAN_CALLS", 4)
    doc = run(tmp_path, "--styles", "vllm", "--profile-plan")
    printed = capsys.readouterr().out
    timed = [r for r in doc["rows"] if r["engine"] != "ratio" and r.get("status") == "ok"]
    assert timed and all(r["plan_profile"] for r in timed)
    for r in timed:
        own = [e["own_us"] for e in r["plan_profile"]]
        assert own == sorted(own, reverse=True) and len(own) <= bench.PROFILE_TOP
    pk = next(r for r in timed if r["engine"] == "pkvrt")
    assert any(e["function"].startswith("wrapper.py:") and e["function"].endswith("(plan)")
               for e in pk["plan_profile"]), pk["plan_profile"]
    assert "vllm pkvrt: plan() under cProfile" in printed
    assert "plan_profile" not in json.dumps(run(tmp_path, "--styles", "vllm")["rows"])
