"""benches/model_shapes.py run end to end on the CPU (tests/dry_bench.py's fake GPU and stand-in
FlashInfer), so that a GPU call spends its minutes on the measurement, not on the script's own
mistakes: its real ``main()`` on one or two models of each group that shares FlashInfer's JIT
modules (benches/README.md; every model of each group as the GPU call runs them: marked slow),
the Azure trace option, the time budget, and the failures it records.

Made small for the CPU, by the script's module constants: 6 layers instead of 32 (every model's
layer pattern still has all its kinds), 1 replay, CPU tensors, a tiny workspace; and the cases'
lengths divided by 64 (names and row counts kept; the probe step keeps its lengths, so every
window and sink still changes the answer there). Checked: the results file (meta, probe rows,
per-case rows with floor_us, the baseline per kind or "none" for head dim 96, summary rows with
the ratio or None), that it passes the report's validator and renders, the printed tables, and
that the probe refuses exactly the FlashInfer paths that are wrong or unavailable (FA2 with
sinks, XQA with a soft cap, CUDA cores at group size 7, every path at head dim 96, never called).
A wrong pkvrt output, a FlashInfer graph that fails and a model that fails are recorded as such.

What this cannot see: what tests/dry_bench.py lists (numerics, real capture, placement, memory,
time), FlashInfer's own refusals beyond the stand-in's, and the full-size steps (32K rows).
"""

from __future__ import annotations

import json
import pathlib
import shutil
import types

import pytest
import torch
from dry_bench import fake_gpu, load_bench, shrunk  # noqa: F401

from pkvrt.measure import coverage_results
from pkvrt.measure import model_shapes as shapes
from pkvrt.runtime import Runtime, fi_route
from pkvrt.tools import report

ROOT = pathlib.Path(__file__).resolve().parents[1]
LAYERS, SHRINK = 6, 64
# The groups of models that share FlashInfer's JIT modules, each run in one GPU call
# (benches/README.md; benches/h200_run.sh models-a..d), and one or two models of each that bring
# every kind of layer, group size and head dim of its group (the everyday test; all: slow).
GROUPS = {"a": "llama-3.1-8b,llama-3.1-70b,llama-3.2-3b,qwen2.5-7b,qwen2.5-14b,qwen3-235b-a22b",
          "b": "qwen2.5-0.5b,smollm2-135m,gpt-oss-20b,phi-3-mini", "c": "gemma-2-9b,gemma-3-12b",
          "d": "gemma-3-27b"}
SAMPLE = {"a": "llama-3.1-8b,qwen2.5-7b", "b": "gpt-oss-20b,phi-3-mini", "c": "gemma-2-9b",
          "d": "gemma-3-27b"}
PATHS = ("flashinfer-tc", "flashinfer-cuda", "flashinfer-xqa")
WRONG = "wrong: rel. error"




bench = load_bench("model_shapes")




@pytest.fixture
def dry(fake_gpu, monkeypatch, tmp_path):  # noqa: F811
    """The bench on the fake GPU, small; a trace folder holding the shipped fixture trace as
    the Azure conversation trace."""
    for name, value in (("DEVICE", "cpu"), ("LAYERS", LAYERS), ("REPLAYS", 1), ("WORKSPACE", 1024),
                        ("isolated_steps", lambda: shrunk(shapes.isolated_steps(), SHRINK)),
                        ("sample_steps", lambda *a, **k: shrunk(shapes.sample_steps(*a, **k), SHRINK))):
        monkeypatch.setattr(bench, name, value)
    shutil.copy(ROOT / "pkvrt" / "_data" / "traces" / "mixed.csv", tmp_path / "azure2023_conv.csv")
    return fake_gpu


def run(tmp_path, *args) -> dict:
    out = tmp_path / "model-shapes.json"
    assert bench.main(["--steps", "1", "--out", str(out), *args]) == 0
    return json.loads(out.read_text())


def rendered(tmp_path) -> str:
    """The report's table of the results folder (every file validated first)."""
    return coverage_results.model_shapes_table(report.load_dir(tmp_path))


# ----------------------------------------------------------------------------- the run


@pytest.mark.parametrize("group", SAMPLE)
def test_main_measures_models_of_each_group(dry, tmp_path, capsys, group):
    check_group(tmp_path, capsys, dry, SAMPLE[group])


@pytest.mark.slow   # 15-40 s each on 2 cores; `pytest --quick` skips them
@pytest.mark.parametrize("group", [g for g in GROUPS if GROUPS[g] != SAMPLE[g]])
def test_main_measures_every_model_as_the_gpu_call_does(dry, tmp_path, capsys, group):
    check_group(tmp_path, capsys, dry, GROUPS[group])


def test_the_groups_hold_every_model_once():
    names = [m for g in GROUPS.values() for m in g.split(",")]
    assert sorted(names) == sorted(shapes.MODELS)
    assert all(set(SAMPLE[g].split(",")) <= set(GROUPS[g].split(",")) for g in GROUPS)


def check_group(tmp_path, capsys, gpu, models: str) -> None:
    """main() on ``models`` with the Azure trace; every row, the tables and the report checked."""
    doc = run(tmp_path, "--models", models, "--trace-dir", str(tmp_path))
    models = models.split(",")
    printed = capsys.readouterr().out
    meta, rows = doc["meta"], doc["rows"]
    assert meta["kind"] == "model-shapes" and meta["layers"] == LAYERS and meta["gpu"] == "NVIDIA H200"
    assert meta["protocol"].startswith("Protocol") and meta["flashinfer"] == "0.7.2"
    traces = ["isolated-B1-32K", "isolated-B8-32K", "bucketed-B1", "bimodal-B8", "azure2023_conv-B8"]
    for name in models:
        model = shapes.MODELS[name]
        probe = {(r["engine"], r["kind"]): r["status"] for r in rows if r["case"] == f"{name}-probe"}
        assert set(probe) == {(p, k.name) for p in PATHS for k in model.kinds()}
        for (path, kind), status in probe.items():
            want = expected_probe(model, path, kind)
            assert status == want or want == WRONG and status.startswith(WRONG), (name, path, kind, status)
        steps = [r for r in rows if r.get("model") == name and r["engine"] == "pkvrt-device-plan-step"]
        assert len(steps) == len(traces) and all(r["status"] == "ok" and r["max_err_ref"] < 1e-3 for r in steps)
        assert all(r["median_us"] > 0 and r["floor_us"] > 0 for r in steps)
        cases = [r["case"] for r in steps]
        base = [r for r in rows if r.get("model") == name and r["engine"] == "flashinfer-fastest-correct"]
        assert [r["case"] for r in base] == cases
        candidates = {(p, k) for (p, k), s in probe.items() if s == "ok"}
        usable = {k for _, k in candidates}
        for r in base:
            assert r["floor_us"] > 0
            if usable == {k.name for k in model.kinds()}:
                assert r["median_us"] > 0 and set(r["paths"]) == usable
            else:
                assert r["median_us"] is None, r
        alone = [r for r in rows if r["case"] in cases and r["engine"] == "pkvrt-device-plan-kind"]
        if len(model.kinds()) > 1:   # each kind alone: a row per kind and step, its layers
            assert sorted((r["case"], r["kind"]) for r in alone) == \
                sorted((c, k.name) for c in cases for k in model.kinds())
            for c in cases:
                assert sum(r["layers"] for r in alone if r["case"] == c) == LAYERS
            assert all(r["median_us"] > 0 and r["status"] == "ok" for r in alone)
        else:
            assert not alone
        timed = [r for r in rows if r["case"] in cases and r.get("kind") and r not in alone]
        assert sorted((r["case"], r["engine"], r["kind"]) for r in timed) == \
            sorted((c, p, k) for c in cases for p, k in candidates)   # every candidate on every step
        assert all(r["status"] == "ok" and r["median_us"] > 0 and r["layers"] > 0 for r in timed)
        summary = {r["trace"]: r for r in rows if r["engine"] == "summary" and r["model"] == name}
        assert sorted(summary) == sorted(traces)
        for r in summary.values():
            assert r["steps"] == 1 and r["pkvrt_us"] > 0 and r["pkvrt_floor_fraction"] > 0
            assert (r["ratio"] is None) == (model.head_dim == 96), r
            assert r["ratio"] is None or (r["ratio"] > 0 and r["baseline_floor_fraction"] > 0)
        line = next(s for s in printed.splitlines() if s.startswith(f"{name}-isolated-B8-32K "))
        assert line.split()[3] == ("none" if model.head_dim == 96 else f"{summary['isolated-B8-32K']['ratio']:.3f}")
    assert "geometric mean of the ratios" in printed and not gpu.poisoned
    table = rendered(tmp_path)
    assert all(f"| {m} | isolated-B1-32K |" in table for m in models)
    for name in models:   # the per-kind table: a line per (trace, kind) of a model of several kinds
        kinds = shapes.MODELS[name].kinds()
        lines = [ln for ln in table.splitlines() if ln.startswith(f"| {name} | ") and ln.count("|") == 10]
        assert len(lines) == (len(traces) * len(kinds) if len(kinds) > 1 else 0), (name, lines)


def expected_probe(model, path: str, kind: str) -> str:
    """What the probe must find, as FlashInfer behaves on the H200 (pkvrt/runtime/fi_route.py);
    WRONG: any relative error over the tolerance."""
    k = next(k for k in model.kinds() if k.name == kind)
    if model.head_dim in fi_route.NO_DECODE_HEAD_DIMS:
        return f"unavailable: FlashInfer has no decode kernel for head_dim {model.head_dim}"
    if path == "flashinfer-xqa" and k.logits_soft_cap:
        return "unavailable: RuntimeError: XQA has no logits soft cap"
    if path == "flashinfer-cuda" and model.group not in fi_route.CUDA_CORE_GROUPS:
        return f"unavailable: RuntimeError: Unsupported group_size: {model.group}"
    if path != "flashinfer-xqa" and k.sinks:   # FA2 ignores sinks: a wrong answer the probe sees
        return WRONG
    return "ok"


def test_no_flashinfer_gives_every_step_no_baseline(dry, tmp_path, capsys):
    doc = run(tmp_path, "--models", "llama-3.1-8b", "--no-flashinfer")
    rows = doc["rows"]
    assert not [r for r in rows if r["case"].endswith("-probe")]
    assert all(r["median_us"] is None for r in rows if r["engine"] == "flashinfer-fastest-correct")
    assert {r["ratio"] for r in rows if r["engine"] == "summary"} == {None}
    assert "nan over 0 (model, trace) pairs" in capsys.readouterr().out
    assert "| llama-3.1-8b | bimodal-B8 | 1 |" in rendered(tmp_path)


# ----------------------------------------------------------------------------- the probe


def test_every_window_cuts_the_probe_rows():
    """The probe step's longest row is longer than every model's window, so a path that
    ignores a window (as FA2 ignores sinks) gives a wrong answer there."""
    for model in shapes.MODELS.values():
        for kind in model.kinds():
            assert kind.window_left + 1 < max(bench.PROBE_LENS), (model.name, kind)


def test_the_probe_refuses_a_path_that_ignores_the_window(dry, monkeypatch):
    """A FlashInfer whose FA2 decode planned every step without its window: the probe marks
    both FA2 paths wrong on each windowed kind (Gemma-2's 4096 too) and keeps the global ones."""
    import flashinfer

    wrapper = flashinfer.BatchDecodeWithPagedKVCacheWrapper
    plan = wrapper.plan
    monkeypatch.setattr(wrapper, "plan", lambda self, *a, window_left=-1, **k: plan(self, *a, **k))
    ws = {"fa2": torch.zeros(1024, dtype=torch.uint8), "xqa": torch.zeros(1024, dtype=torch.uint8)}
    for name in ("gemma-2-9b", "gpt-oss-20b"):
        model = shapes.MODELS[name]
        probe = bench.probe_paths(flashinfer, model, ws)
        for kind in model.kinds():
            for path in ("flashinfer-tc", "flashinfer-cuda"):
                status = probe[(path, kind.name)]
                if kind.window_left >= 0:
                    assert status.startswith(WRONG), (name, kind, path, status)
                elif not kind.sinks:
                    assert status == "ok", (name, kind, path, status)


# ----------------------------------------------------------------------------- the time budget


class Clock:
    """time for the bench: monotonic() reads ``now``, which the test moves."""

    def __init__(self):
        self.now = 0.0

    def monotonic(self) -> float:
        return self.now


@pytest.fixture
def compiling(monkeypatch):
    """The bench's clock, advanced by 40 s at each FlashInfer path's first call on a kind (its
    JIT compile on a fresh machine)."""
    clock = Clock()
    monkeypatch.setattr(bench, "time", types.SimpleNamespace(monotonic=clock.monotonic))
    fi_kind = bench.fi_kind

    def first_call(*a, **k):
        clock.now += 40
        return fi_kind(*a, **k)

    monkeypatch.setattr(bench, "fi_kind", first_call)
    return clock


def test_the_time_budget_stops_between_probe_paths_and_cases(dry, compiling, tmp_path, capsys):
    """Each FlashInfer path's first call takes 40 s (a JIT compile): with --max-seconds 100 the
    first model probes its 3 paths and measures nothing, the second probes none, and the file
    says so."""
    doc = run(tmp_path, "--models", "llama-3.1-8b,gemma-3-27b", "--max-seconds", "100")
    rows = doc["rows"]
    assert [r["status"] for r in rows] == ["ok"] * 3   # llama's probe: 3 paths, then no case
    printed = capsys.readouterr().out
    assert "llama-3.1-8b: time budget spent, isolated-B1-32K and later not measured" in printed
    assert "gemma-3-27b: time budget spent, not measured" in printed
    assert "nan over 0" in printed and rendered(tmp_path) == ""


def test_a_budget_spent_inside_the_probe_leaves_the_rest_unprobed(dry, compiling, tmp_path):
    rows = run(tmp_path, "--models", "gemma-3-27b", "--max-seconds", "100")["rows"]
    status = {(r["engine"], r["kind"]): r["status"] for r in rows}
    assert [status[(p, "local1024")] for p in PATHS] == ["ok"] * 3
    assert [status[(p, "global")] for p in PATHS] == ["not probed: time budget spent"] * 3
    assert "not probed: time budget spent" in rendered(tmp_path)


def test_each_case_is_on_disk_before_the_next_begins(dry, tmp_path, monkeypatch):
    """The results file is rewritten after the probe and after every case: a run killed past
    its deadline (benches/h200_run.sh's timeout) keeps what it measured."""
    out = tmp_path / "model-shapes.json"
    seen = []
    step = bench.pkvrt_step

    def noting(model, st):
        seen.append(sum(1 for r in json.loads(out.read_text())["rows"]
                        if r["engine"] == "pkvrt-device-plan-step"))
        return step(model, st)

    monkeypatch.setattr(bench, "pkvrt_step", noting)
    run(tmp_path, "--models", "llama-3.1-8b,qwen2.5-7b")
    assert seen == list(range(8))


# ----------------------------------------------------------------------------- failures


def test_a_wrong_pkvrt_step_has_no_ratio(dry, tmp_path, monkeypatch):
    """pkvrt's output off by 10 on one element of every layer: its steps are "wrong", the
    summary gives no ratio, and the report lists the steps."""
    real = Runtime.run

    def off(self, q, k_cache, v_cache, out=None, **kw):
        o = real(self, q, k_cache, v_cache, out=out, **kw)
        dry.launch(lambda: o[0, 0, 0].add_(10.0))
        return o

    monkeypatch.setattr(Runtime, "run", off)
    rows = run(tmp_path, "--models", "llama-3.1-8b")["rows"]
    steps = [r for r in rows if r["engine"] == "pkvrt-device-plan-step"]
    assert steps and all(r["status"].startswith(WRONG) for r in steps)
    assert {r["ratio"] for r in rows if r["engine"] == "summary"} == {None}
    assert "pkvrt steps that failed" in rendered(tmp_path)


def test_a_flashinfer_graph_that_fails_is_no_candidate(dry, tmp_path, monkeypatch):
    """XQA refusing to be captured: the probe (which times each path too) says so, no step
    times XQA, the baseline is the FA2 paths'."""
    import flashinfer

    xqa = flashinfer.decode.trtllm_batch_decode_with_kv_cache

    def eager_only(**kw):
        if dry.capturing is not None:
            raise RuntimeError("XQA: operation not permitted when stream is capturing")
        return xqa(**kw)

    monkeypatch.setattr(flashinfer.decode, "trtllm_batch_decode_with_kv_cache", eager_only)
    rows = run(tmp_path, "--models", "llama-3.1-8b")["rows"]
    xqa = [r for r in rows if r["engine"] == "flashinfer-xqa"]
    assert [r["case"] for r in xqa] == ["llama-3.1-8b-probe"]
    assert xqa[0]["status"].startswith("unavailable: timing its graph: RuntimeError: XQA: operation not permitted")
    base = [r for r in rows if r["engine"] == "flashinfer-fastest-correct"]
    assert all(r["paths"]["global"] in ("flashinfer-tc", "flashinfer-cuda") for r in base)


def test_a_model_that_fails_is_recorded_and_the_next_one_runs(dry, tmp_path, monkeypatch, capsys):
    real = Runtime.__init__

    def refuse_d96(self, hq, hkv, d, *a, **kw):
        if d == 96:
            raise ValueError("head_dim 96 refused (test)")
        real(self, hq, hkv, d, *a, **kw)

    monkeypatch.setattr(Runtime, "__init__", refuse_d96)
    rows = run(tmp_path, "--models", "phi-3-mini,qwen2.5-7b")["rows"]
    failed = [r for r in rows if r["case"] == "phi-3-mini"]
    assert failed == [{"case": "phi-3-mini", "engine": "pkvrt-device-plan-step",
                       "status": "failed: ValueError: head_dim 96 refused (test)"}]
    assert {r["model"] for r in rows if r["engine"] == "summary"} == {"qwen2.5-7b"}
    assert "phi-3-mini FAILED" in capsys.readouterr().out
    assert "- phi-3-mini: failed: ValueError" in rendered(tmp_path)


def test_fi_warm_probes_each_named_model_once_and_refuses_bad_arguments(monkeypatch, capsys):
    """benches/fi_warm.py: each named model's probe once, in a pool of at most --processes
    (here an in-process stand-in), its paths' statuses printed; an unknown model or a pool of
    none is refused naming it; without a GPU nothing runs."""
    fw = load_bench("fi_warm")
    with pytest.raises(SystemExit):
        fw.main(["--models", "llama-9"])
    assert "unknown ['llama-9']" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        fw.main(["--processes", "0"])
    assert "--processes 0: expected at least 1" in capsys.readouterr().err
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    assert fw.main(["--models", "gemma-2-9b"]) == 0
    assert "needs a CUDA GPU" in capsys.readouterr().out
    pools = []

    class Pool:   # mp's spawn Pool, in process
        def __init__(self, n):
            pools.append(n)

        def __enter__(self):
            return self

        def __exit__(self, *exc):
            return False

        def imap_unordered(self, fn, items):
            return map(fn, items)
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(fw.mp, "get_context", lambda method: types.SimpleNamespace(Pool=Pool))
    probed = []
    monkeypatch.setattr(fw, "_probe", lambda name: probed.append(name) or
                        (name, 1.0, {("flashinfer-tc", "global"): "ok"}))
    assert fw.main(["--models", "gemma-2-9b,gpt-oss-20b", "--processes", "6"]) == 0
    assert probed == ["gemma-2-9b", "gpt-oss-20b"] and pools == [2]
    out = capsys.readouterr().out
    assert "gemma-2-9b (1 s): flashinfer-tc/global: ok" in out and "gpt-oss-20b" in out


def test_routes_option_reaches_the_runtimes_and_the_meta(dry, tmp_path, monkeypatch):
    """--routes FILE: pkvrt's Runtimes read that routes.toml (a G 7 model on the fused route when
    large_group is past it), and the meta names the file and its sha256; a bad file is refused
    before anything runs."""
    import hashlib

    from pkvrt.runtime import Runtime
    text = (ROOT / "routes.toml").read_text()
    assert "large_group = 5\n" in text
    path = tmp_path / "routes-fused.toml"
    path.write_text(text.replace("large_group = 5\n", "large_group = 64\n"))
    taken = []
    plan = Runtime.plan
    monkeypatch.setattr(Runtime, "plan", lambda self, *a, **k: taken.append(plan(self, *a, **k).route) or taken[-1])
    got = run(tmp_path, "--models", "qwen2.5-7b", "--no-flashinfer", "--routes", str(path))
    assert got["meta"]["routes_path"] == str(path.resolve())
    assert got["meta"]["routes_sha256"] == hashlib.sha256(path.read_bytes()).hexdigest()
    assert "pkv_fused" in taken and all(r in ("pkv_fused", "pkv_workqueue") for r in taken)
    taken.clear()
    run(tmp_path, "--models", "qwen2.5-7b", "--no-flashinfer")   # shipped: G 7 >= 5, workqueue
    assert taken and set(taken) == {"pkv_workqueue"}
    path.write_text(text.replace("large_group = 5\n", "large_group = 0\n"))
    with pytest.raises(Exception, match="large_group"):
        run(tmp_path, "--models", "qwen2.5-7b", "--no-flashinfer", "--routes", str(path))
