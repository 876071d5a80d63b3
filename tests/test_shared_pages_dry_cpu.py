"""benches/shared_pages.py run end to end on the CPU (tests/dry_bench.py's fake GPU and stand-in
FlashInfer), so that a GPU call spends its minutes on the measurement, not on the script's own
mistakes: its real ``main()`` with ``--chunk-rows`` (engines ``pkvrt-shared-c<N>``) and
``--engines``, every case, the cascade wrapper unavailable as the slimmed FlashInfer makes it (and
computing, where a FlashInfer builds it), and the time budget.

Made small for the CPU, by the script's module constants: 2 layers instead of 32, 1 replay, CPU
tensors, a tiny workspace; the cases' token counts divided by 64 (names, rows and groups kept:
every case with a shared prefix still shares whole pages, the cases without sharing still share
none). Every engine's layer-0 output is checked against the FP32 reference by the script itself,
as on the GPU; the dry run then checks the results file (meta, a row per case and engine with its
status and error, the ratio rows), that it passes the report's validator and renders, and that a
shared engine ran the shared path (its explain(), the saved tokens), not the plain one.

What this cannot see: what tests/dry_bench.py lists (the kernels' numerics, everything being FP32
on the CPU; real graph capture beyond its recording; placement, memory, and the timings and
ratios themselves), FlashInfer's own refusals beyond the stand-in's, whether the real cascade
wrapper builds (the stand-in's fails as the slimmed wheel's did on the H200) and how its levels
perform, and the full-size steps (32K-token prefixes, 32 layers, the 24 GiB cache budget).
"""

from __future__ import annotations

import json
import pathlib
import types

import pytest
import torch
from dry_bench import CASCADE_BUILD_ERROR, fake_gpu, load_bench  # noqa: F401

from pkvrt.measure import coverage_results
from pkvrt.policy.calibration import load_calibration
from pkvrt.runtime import core
from pkvrt.runtime.shared import SharedPagesRuntime
from pkvrt.tools import report

ROOT = pathlib.Path(__file__).resolve().parents[1]
LAYERS, SHRINK = 2, 64
FI = ("flashinfer-tc", "flashinfer-cuda")
UNAVAILABLE = "unavailable: RuntimeError: Ninja build failed. Ninja output:"




bench = load_bench("shared_pages")


def shrunk(cases: dict) -> dict:
    """Each case's token counts over SHRINK (at least one page shared where the case shares)."""
    page = bench.PAGE
    return {name: ([(rows, max(page, shared // SHRINK) if shared else 0) for rows, shared in groups],
                   max(1, own // SHRINK)) for name, (groups, own) in cases.items()}


@pytest.fixture
def dry(fake_gpu, monkeypatch):  # noqa: F811
    """The bench on the fake GPU, small; int32 CPU tensors count as lengths on the GPU (the
    plain engine's Runtime turns to device planning on its first plan(), as on the GPU)."""
    for name, value in (("DEVICE", "cpu"), ("LAYERS", LAYERS), ("REPLAYS", 1), ("WORKSPACE", 1024),
                        ("CASES", shrunk(bench.CASES))):
        monkeypatch.setattr(bench, name, value)
    monkeypatch.setattr(core, "lengths_on_gpu", lambda s: isinstance(s, torch.Tensor))
    return fake_gpu


def run(tmp_path, *args) -> dict:
    out = tmp_path / "shared-pages.json"
    assert bench.main(["--out", str(out), *args]) == 0
    return json.loads(out.read_text())


def rendered(tmp_path) -> str:
    """The report's table of the results folder (every file validated first)."""
    return coverage_results.shared_pages_table(report.load_dir(tmp_path))


SHARING = [n for n, (groups, _) in bench.CASES.items() if any(s for _, s in groups)]


def test_the_planned_command_runs_every_case_and_engine(dry, tmp_path, capsys):
    """``--chunk-rows 2`` as benches/h200_run.sh will run it: every case, every engine's row, the
    chunked engine exact, the cascade tried once (on the first case) and recorded unavailable."""
    import flashinfer

    doc = run(tmp_path, "--chunk-rows", "2", "--max-seconds", "560")
    meta, rows = doc["meta"], doc["rows"]
    assert meta["kind"] == "shared-pages" and meta["layers"] == LAYERS and meta["gpu"] == "NVIDIA H200"
    assert meta["protocol"].startswith("Protocol") and meta["replays"] == 1
    beta = load_calibration(ROOT / "calibration" / "nvidia-h200.json").beta_gbps   # the fake GPU's file
    assert meta["beta_gbps"] == beta
    names = list(bench.CASES)
    assert list(dict.fromkeys(r["case"] for r in rows)) == names
    engines = ("pkvrt-shared", "pkvrt-shared-always", "pkvrt-shared-serial", "pkvrt-shared-device",
               "pkvrt-shared-device-always", "pkvrt-device-plan", *FI)
    for name in names:
        mine = [r for r in rows if r["case"] == name]
        want = [*engines, "flashinfer-cascade"] if name in SHARING else list(engines)
        assert [r["engine"] for r in mine] == [*want, "pkvrt-shared-c2", "ratio"], name
        by = {r["engine"]: r for r in mine}
        for e in (*engines, "pkvrt-shared-c2"):
            r = by[e]
            assert r["status"] == "ok" and r["max_err_ref"] < 1e-3 and r["median_us"] > 0, (name, r)
            assert r["rows"] == sum(n for n, _ in bench.CASES[name][0])
            assert r["floor_us"] >= r["floor_once_us"] > 0 and r["distinct_caches"] == LAYERS
            assert r["floor_once_gpu_us"] == pytest.approx(r["floor_once_us"] * 4200 / beta)
        ratio = by["ratio"]
        assert ratio["ceiling"] == pytest.approx(by[ratio["baseline"]]["median_us"]
                                                 / by["pkvrt-shared"]["floor_once_gpu_us"])
        assert ratio["baseline"] in FI and ratio["ratio"] > 0 and ratio["ratio_plain"] > 0
        assert ratio["ratio_c2"] > 0 and ratio["ratio_serial"] > 0
        assert ratio["ratio_device"] > 0 and ratio["device_over_plain"] > 0
        shared = (by["pkvrt-shared-always"], by["pkvrt-shared-c2"])
        serial = by["pkvrt-shared-serial"]   # the same shared path, its decodes on one stream
        assert serial["shared"] == by["pkvrt-shared-always"]["shared"] and "chunk_us" not in serial
        rule = by["pkvrt-shared"]   # shares where the time model predicts a gain
        if name in SHARING:
            p = rule["predicted"]
            assert rule["shared"] == (p["shared_us"] < p["plain_us"]), rule
            assert ("shared chunk(s)" in rule["explain"]) == rule["shared"], rule
        else:
            assert rule["shared"] is False and rule["predicted"] is None
        dev = by["pkvrt-shared-device"]   # device lengths: the GPU's rule decides
        assert dev["shared"] == (dev["tokens_saved"] > 0)
        if dev["predicted"] is not None:
            p = dev["predicted"]
            assert dev["shared"] == (p["plain_us"] >= p["margin"] * p["shared_us"]), dev
        assert ratio["ratio_device_always"] > 0
        for r in (dev, by["pkvrt-shared-device-always"]):   # plan() alone, the rule's cost apart
            assert r["plan_us"] > 0, r
        if name in SHARING:   # the shared path ran, in chunks of 2 rows for -c2
            assert by["pkvrt-shared-device-always"]["tokens_saved"] > 0 and dev["predicted"] is not None
            assert all("shared chunk(s)" in r["explain"] for r in shared)
            assert "of up to 2 rows" in by["pkvrt-shared-c2"]["explain"]
            assert "of up to 2 rows" not in by["pkvrt-shared-always"]["explain"]
            for r in shared:   # where its time goes: the two decodes alone
                assert r["chunk_us"] > 0 and r["own_us"] > 0 and "parts_error" not in r, r
        else:
            assert dev["tokens_saved"] == 0 and dev["predicted"] is None
            assert by["pkvrt-shared-device-always"]["tokens_saved"] == 0
            assert all(r["explain"].startswith("SharedPagesRuntime: no sharing") for r in shared)
    cascade = [r["status"] for r in rows if r["engine"] == "flashinfer-cascade"]
    assert cascade[0] == UNAVAILABLE and flashinfer.MultiLevelCascadeAttentionWrapper.plans == 1
    assert cascade[1:] == [f"{UNAVAILABLE} (on {SHARING[0]}; not tried again)"] * (len(SHARING) - 1)
    printed = capsys.readouterr().out
    assert all(f"\n{name:<26} " in printed for name in names)
    table = rendered(tmp_path)
    assert "pkvrt-shared-c2 µs" in table and "flashinfer-cascade on" in table


def test_the_engines_option_runs_only_those(dry, tmp_path, monkeypatch):
    """``--engines flashinfer-tc,flashinfer-cascade,pkvrt-shared``: no other engine is built
    (SharedPagesRuntime made once per case, host lengths only), a ratio against the
    tensor-core path, none for the engines not run."""
    made = []
    init = SharedPagesRuntime.__init__

    def counting(self, *a, **k):
        made.append(k.get("device_planning", False))
        init(self, *a, **k)

    monkeypatch.setattr(SharedPagesRuntime, "__init__", counting)
    cases = ["8x(8K+512)", "8x(0+1K)"]
    rows = run(tmp_path, "--engines", "flashinfer-tc,flashinfer-cascade,pkvrt-shared",
               "--cases", ",".join(cases))["rows"]
    assert [(r["case"], r["engine"]) for r in rows] == [
        (cases[0], "pkvrt-shared"), (cases[0], "flashinfer-tc"), (cases[0], "flashinfer-cascade"),
        (cases[0], "ratio"), (cases[1], "pkvrt-shared"), (cases[1], "flashinfer-tc"), (cases[1], "ratio")]
    assert made == [False, False]
    for r in rows:
        if r["engine"] == "ratio":
            assert r["baseline"] == "flashinfer-tc" and r["ratio"] > 0
            assert r["ratio_plain"] is r["ratio_device"] is r["device_over_plain"] is None
        elif r["engine"] == "flashinfer-cascade":
            assert r["status"] == UNAVAILABLE
        else:
            assert r["status"] == "ok" and r["max_err_ref"] < 1e-3


def test_a_cascade_that_builds_is_exact(dry, tmp_path, monkeypatch):
    """Where FlashInfer builds the cascade wrapper, its two levels (each group's prefix, each
    row's own pages) are the step: exact on every sharing case, groups of several prefixes
    included."""
    import flashinfer

    monkeypatch.setattr(flashinfer.MultiLevelCascadeAttentionWrapper, "builds", True)
    cases = ["8x(8K+512)", "parallel-8x(2K..16K)x4"]
    rows = run(tmp_path, "--engines", "flashinfer-cascade", "--cases", ",".join(cases))["rows"]
    cascade = [r for r in rows if r["engine"] == "flashinfer-cascade"]
    assert [r["case"] for r in cascade] == cases
    assert all(r["status"] == "ok" and r["max_err_ref"] < 1e-3 for r in cascade), cascade
    assert flashinfer.MultiLevelCascadeAttentionWrapper.plans == len(cases)
    assert all(r["baseline"] == "flashinfer-cascade" for r in rows if r["engine"] == "ratio")


def test_an_engine_label_that_names_no_engine_is_refused(dry, tmp_path, capsys):
    """A misspelt label would have run a case without the engine it meant, silently."""
    with pytest.raises(SystemExit) as e:
        bench.main(["--out", str(tmp_path / "x.json"), "--engines", "flashinfer-tc,flashinfer-cascde"])
    assert e.value.code == 2 and not (tmp_path / "x.json").exists()
    assert "--engines: flashinfer-cascde: expected labels of" in capsys.readouterr().err


def test_a_wrong_chunked_engine_is_recorded_wrong_and_gets_no_ratio(dry, tmp_path, monkeypatch):
    """``--chunk-rows 2`` beside ``--engines`` (its engine runs though --engines does not name
    it), its merge off by one on one element: its row says "wrong" and has no ratio, the
    default engine's ratio is unaffected."""
    from pkvrt.launch import ops

    merge = ops.merge_segments

    def off(out_v, lse_v, out_o, lse_o, slots, out, **kw):
        merge(out_v, lse_v, out_o, lse_o, slots, out, **kw)
        if kw["chunk_rows"] == 2:
            dry.launch(lambda: out[0, 0, 0].add_(1.0))

    monkeypatch.setattr(ops, "merge_segments", off)
    rows = run(tmp_path, "--engines", "flashinfer-tc,pkvrt-shared", "--chunk-rows", "2",
               "--cases", "8x(8K+512)")["rows"]
    by = {r["engine"]: r for r in rows}
    assert list(by) == ["pkvrt-shared", "flashinfer-tc", "pkvrt-shared-c2", "ratio"]
    assert by["pkvrt-shared-c2"]["status"].startswith("wrong: rel. error")
    assert by["ratio"]["ratio_c2"] is None
    assert by["pkvrt-shared"]["status"] == "ok" and by["ratio"]["ratio"] > 0


def test_engines_may_name_a_chunked_engine_and_then_only_those_run(dry, tmp_path, capsys):
    """``--engines`` may name ``pkvrt-shared-c<N>`` of ``--chunk-rows``: then the chunked
    engines it does not name do not run; a chunk count not asked for is an error."""
    rows = run(tmp_path, "--engines", "flashinfer-tc,pkvrt-shared-c2", "--chunk-rows", "2,8",
               "--cases", "8x(8K+512)")["rows"]
    assert [r["engine"] for r in rows] == ["flashinfer-tc", "pkvrt-shared-c2", "ratio"]
    with pytest.raises(SystemExit):
        bench.main(["--engines", "pkvrt-shared-c4", "--chunk-rows", "2", "--out", str(tmp_path / "x.json")])
    assert "--engines: pkvrt-shared-c4: expected labels of" in capsys.readouterr().err


def test_the_chunk_splits_option_runs_the_pinned_cuts(dry, tmp_path, capsys):
    """``--chunk-splits 1,4096`` with ``--chunk-rows 2``: pkvrt-shared-s<S> and
    pkvrt-shared-c2-s<S> beside pkvrt-shared-c2 (the chunk decode cut at S splits of its longest
    chunk); the count every step takes (1) runs exact, cut there, with its ratio; a count no step
    takes (4096) is recorded unavailable, naming the counts it takes, and gets no ratio; naming
    one of them in ``--engines`` runs only those."""
    name = SHARING[0]
    doc = run(tmp_path, "--cases", name, "--chunk-rows", "2", "--chunk-splits", "1,4096",
              "--engines", "pkvrt-shared-always,flashinfer-tc")
    by = {r["engine"]: r for r in doc["rows"]}
    assert list(by) == ["pkvrt-shared-always", "flashinfer-tc", "pkvrt-shared-c2", "pkvrt-shared-s1",
                        "pkvrt-shared-s4096", "pkvrt-shared-c2-s1", "pkvrt-shared-c2-s4096", "ratio"]
    for e in ("pkvrt-shared-s1", "pkvrt-shared-c2-s1"):
        r = by[e]
        assert r["status"] == "ok" and r["max_err_ref"] < 1e-3 and r["shared"] and r["chunk_splits"] == 1, r
        assert "cut at 1 split(s) of its longest chunk (pinned" in r["explain"]
        assert by["ratio"][f"ratio_{e[len('pkvrt-shared-'):]}"] > 0
    assert "of up to 2 rows" in by["pkvrt-shared-c2-s1"]["explain"]
    for e in ("pkvrt-shared-s4096", "pkvrt-shared-c2-s4096"):
        assert by[e]["status"].startswith("unavailable: ValueError: SharedPagesRuntime.plan: "
                                          "RuntimeOptions(shared_chunk_cut=4096)"), by[e]
        assert "takes 1 split(s) of its longest chunk" in by[e]["status"]
        assert by["ratio"][f"ratio_{e[len('pkvrt-shared-'):]}"] is None
    rows = run(tmp_path, "--cases", name, "--chunk-rows", "2", "--chunk-splits", "1",
               "--engines", "flashinfer-tc,pkvrt-shared-c2-s1")["rows"]
    assert [r["engine"] for r in rows] == ["flashinfer-tc", "pkvrt-shared-c2-s1", "ratio"]
    with pytest.raises(SystemExit):
        bench.main(["--engines", "pkvrt-shared-s2", "--chunk-splits", "1", "--out", str(tmp_path / "x.json")])
    assert "--engines: pkvrt-shared-s2: expected labels of" in capsys.readouterr().err


def test_the_time_budget_stops_between_cases(dry, tmp_path, monkeypatch, capsys):
    """Each case's step takes 20 s to build: with --max-seconds 30 two cases are measured and
    the file holds them."""
    clock = types.SimpleNamespace(now=0.0)
    monkeypatch.setattr(bench, "time", types.SimpleNamespace(monotonic=lambda: clock.now,
                                                            perf_counter=lambda: clock.now))
    step = bench.Step

    def slow(*a, **k):
        clock.now += 20
        return step(*a, **k)

    monkeypatch.setattr(bench, "Step", slow)
    rows = run(tmp_path, "--max-seconds", "30", "--engines", "pkvrt-shared")["rows"]
    names = list(bench.CASES)
    assert [r["case"] for r in rows] == [names[0]] * 2 + [names[1]] * 2
    assert f"time budget spent: {names[2]} and later not measured" in capsys.readouterr().out


def test_steps_written_as_the_table_writes_them_run_as_cases(dry, tmp_path, capsys):
    """``--cases 4x(64+16)``: a step of one shared prefix at any size runs as a case (its rows,
    lengths and exactness as a named case's); a name that is neither a case nor such a step, or
    a prefix of part of a page, is refused, naming it."""
    doc = run(tmp_path, "--cases", "4x(64+16),2x(1K+3)", "--engines", "pkvrt-shared-always,flashinfer-tc")
    rows = [r for r in doc["rows"] if r["engine"] == "pkvrt-shared-always"]
    assert [(r["case"], r["rows"]) for r in rows] == [("4x(64+16)", 4), ("2x(1K+3)", 2)]
    assert all(r["status"] == "ok" and r["max_err_ref"] < 1e-3 and r["shared"] for r in rows)
    assert bench.case_spec("2x(1K+3)") == ([(2, 1024)], 3)
    for bad in ("4x(64+0)", "4x(65+16)", "4x64+16", "8x(8K+512)x2"):
        with pytest.raises(SystemExit):
            bench.main(["--cases", bad, "--out", str(tmp_path / "x.json")])
        assert bad in capsys.readouterr().err


def test_the_partition_cut_engines_run_beside_the_defaults(dry, tmp_path):
    """``--chunk-cut``: pkvrt-shared-partition and pkvrt-shared-always-partition (the chunk decode
    cut by the partition: the default's ablation) run beside the default engines (the time
    model's cut within routes.toml's bounds), exact, with the cut in the row and ratios of their
    own; without the flag they run only when ``--engines`` names them."""
    names = [n for n in SHARING if n in bench.CASES][:2]
    doc = run(tmp_path, "--cases", ",".join(names), "--chunk-cut",
              "--engines", "pkvrt-shared-always,pkvrt-shared-always-partition,pkvrt-shared-partition,"
              "flashinfer-tc")
    for name in names:
        by = {r["engine"]: r for r in doc["rows"] if r["case"] == name}
        default, part = by["pkvrt-shared-always"], by["pkvrt-shared-always-partition"]
        for row in (default, part):
            assert row["status"] == "ok" and row["max_err_ref"] < 1e-3 and row["shared"]
        # the default: the model's count, or the partition's cut where routes.toml's bounds keep
        # it ([sharing] model_cut_rows / model_cut_margin): explain() says which
        said, n = default["explain"], default["chunk_splits"]
        if n is None:
            assert "the chunk decode cut by the partition" in said, said
        else:
            assert isinstance(n, int) and n >= 1 and f"the chunk decode cut at {n} split(s)" in said, said
        assert part.get("chunk_splits") is None and "the chunk decode cut" not in part["explain"]
        assert by["ratio"]["ratio_always_partition"] > 0 and "pkvrt-shared-partition" in by
    assert "pkvrt-shared-always-partition µs" in rendered(tmp_path)   # the report validates and shows them
    doc = run(tmp_path, "--cases", names[0], "--engines", "pkvrt-shared-always,flashinfer-tc")
    assert not any(r["engine"].endswith("-partition") for r in doc["rows"])
    assert "ratio_always_partition" not in next(r for r in doc["rows"] if r["engine"] == "ratio")


def test_the_reverse_pass_times_every_engine_twice_and_keeps_the_smaller(dry, tmp_path, monkeypatch):
    """``--reverse-pass``: each engine that ran is timed again in the reverse order; its row keeps
    both medians, first pass first, and the smaller as ``median_us``, which the ratios use; an
    engine whose second pass answers wrong is not ok, one whose second pass raises keeps its
    first, and one that failed the first pass is not run again."""
    name = SHARING[0]
    order = []
    real_shared, real_fi = bench.pkvrt_shared, bench.fi_plain
    # each engine's medians by pass (the dry run's own are launch counts, equal in both passes)
    medians = {"pkvrt-shared": [100.0, 80.0], "flashinfer-tc": [60.0, 90.0], "flashinfer-cuda": [70.0]}

    def timed_as(label, row):
        order.append(label)
        k = sum(1 for x in order if x == label) - 1
        if label == "pkvrt-shared-always" and k == 1:
            return {"status": "wrong: rel. error 1 against the FP32 reference", "max_err_ref": 1.0}
        if label == "flashinfer-cuda" and k == 1:
            raise RuntimeError("gone")
        return {**row, "median_us": medians[label][k]} if label in medians else row

    def shared(st, **kw):
        return timed_as("pkvrt-shared-always" if kw.get("always") else "pkvrt-shared", real_shared(st, **kw))

    def fi(mod, st, *, tensor_cores):
        return timed_as("flashinfer-tc" if tensor_cores else "flashinfer-cuda",
                        real_fi(mod, st, tensor_cores=tensor_cores))

    monkeypatch.setattr(bench, "pkvrt_shared", shared)
    monkeypatch.setattr(bench, "fi_plain", fi)
    monkeypatch.setattr(bench, "pkvrt_plain", lambda st: {"status": "unavailable: RuntimeError: no"})
    doc = run(tmp_path, "--cases", name, "--reverse-pass", "--engines",
              "pkvrt-shared,pkvrt-shared-always,pkvrt-device-plan,flashinfer-tc,flashinfer-cuda")
    first = ["pkvrt-shared", "pkvrt-shared-always", "flashinfer-tc", "flashinfer-cuda"]
    assert order == first + first[::-1]
    by = {r["engine"]: r for r in doc["rows"] if r["case"] == name}
    assert [r["engine"] for r in doc["rows"]] == ["pkvrt-shared", "pkvrt-shared-always", "pkvrt-device-plan",
                                                  "flashinfer-tc", "flashinfer-cuda", "ratio"]
    assert by["pkvrt-shared"]["passes_us"] == [100.0, 80.0] and by["pkvrt-shared"]["median_us"] == 80.0
    assert by["flashinfer-tc"]["passes_us"] == [60.0, 90.0] and by["flashinfer-tc"]["median_us"] == 60.0
    assert by["flashinfer-cuda"]["passes_us"] == [70.0, None] and by["flashinfer-cuda"]["median_us"] == 70.0
    assert "gone" in by["flashinfer-cuda"]["second_pass"] and by["flashinfer-cuda"]["status"] == "ok"
    assert by["pkvrt-shared-always"]["status"].startswith("wrong")
    assert by["pkvrt-shared-always"]["passes_us"][1] is None
    assert by["pkvrt-device-plan"]["status"].startswith("unavailable") and "passes_us" not in by["pkvrt-device-plan"]
    assert by["ratio"]["baseline"] == "flashinfer-tc" and by["ratio"]["ratio"] == pytest.approx(60.0 / 80.0)
    assert by["ratio"]["ratio_always"] is None
    assert "pkvrt-shared µs" in rendered(tmp_path)   # the report validates and shows them
