"""`pkvrt report` on small synthetic results files.

Every number below is FAKE, made up in this file so that the expected table cells can be worked
out by hand (e.g. baseline 1000 tok/s, engine 1200 tok/s -> ratio 1.200); none is a measurement.
"""

from __future__ import annotations

import json
import math
import pathlib
import re

import pytest

from pkvrt.measure import results
from pkvrt.tools import cli, report


def run(capsys, *argv):
    rc = cli.main(list(argv))
    out, err = capsys.readouterr()
    return rc, out, err


def table(md: str, title_start: str) -> list[list[str]]:
    """Cells of the Markdown table under the ``## <title_start>...`` heading (no header/rule)."""
    return cells(table_section(md, title_start))


def table_section(md: str, title_start: str) -> str:
    """The text of the ``## <title_start>...`` section, up to the next ``## `` heading."""
    return next(s for s in md.split("\n## ") if s.startswith(title_start))


def last_line(text: str) -> str:
    """The last line of ``text`` (stderr: the error after the progress lines)."""
    return text.rstrip("\n").rsplit("\n", 1)[-1]


def cells(text: str) -> list[list[str]]:
    """Cells of the first Markdown table in ``text`` (no header/rule)."""
    lines = [ln for ln in text.splitlines() if ln.startswith("| ")]
    return [[c.strip() for c in ln.strip("|").split(" | ")] for ln in lines[2:]]


def serving_rows(seed, *, base_tok, base_cuda, eng_tok, eng_cuda, route="pkv_workqueue", split=20,
                 engine="pkvrt-adaptive", max_err=5e-5, mean_err=4e-6, trace="bimodal-B8"):
    case = f"{trace}-seed{seed}"
    common = dict(case=case, row="measured", seed=seed, correct=True, steps=10, decode_tokens=80,
                  launches_per_step=1.0, useful_kv_mb=500.0, merge_mb=0.0, merge_launches=0.0,
                  cta_work_per_sm=None)
    base = dict(common, engine="flashinfer-tc", baseline=True, route="flashinfer", split_main=None,
                tok_per_s=base_tok, cuda_tok_per_s=base_cuda, median_us=100.0, wall_us=110.0,
                mean_cuda_us=1000.0, mean_wall_us=1100.0, max_err=0.0, mean_err=0.0)
    eng = dict(common, engine=engine, baseline=False, route=route, split_main=split,
               tok_per_s=eng_tok, cuda_tok_per_s=eng_cuda, median_us=80.0, wall_us=90.0,
               mean_cuda_us=800.0, mean_wall_us=900.0, max_err=max_err, mean_err=mean_err,
               launches_per_step=2.0, cta_work_per_sm=45.0, merge_mb=2.5, merge_launches=1.0)
    return [base, eng]


def write(path, kind, rows, **meta):
    results.write_results(path, {"kind": kind, "gpu": "FAKE GPU", **meta} if kind else
                          {"gpu": "FAKE GPU", **meta}, rows)
    return path


@pytest.fixture
def serving_dir(tmp_path):
    d = tmp_path / "res"
    write(d / "serving.json", "serving",
          serving_rows(1, base_tok=1000.0, base_cuda=2000.0, eng_tok=1200.0, eng_cuda=2500.0)
          + serving_rows(2, base_tok=1000.0, base_cuda=2000.0, eng_tok=1300.0, eng_cuda=2700.0,
                         max_err=6e-5, mean_err=2e-6))
    write(d / "serving-b1.json", "serving",
          serving_rows(1, base_tok=500.0, base_cuda=600.0, eng_tok=700.0, eng_cuda=900.0,
                       route="pkv_bucket", split=32, trace="bucketed-B1"))
    return d


def test_serving_table_mean_std_over_seeds(capsys, serving_dir, tmp_path):
    rc, out, err = run(capsys, "report", str(serving_dir), "--out", str(tmp_path / "rep"))
    assert rc == 0, err
    assert "read 2 results file(s)" in out and f"wrote {tmp_path / 'rep' / 'report.md'}" in out
    md = (tmp_path / "rep" / "report.md").read_text()
    rows = {(r[0], r[1]): r for r in table(md, "Table 2")}
    # wall 1200/1000, 1300/1000 -> 1.25 ± 0.0707; cuda 2500/2000, 2700/2000 -> 1.30 ± 0.0707
    assert rows[("bimodal-B8", "pkvrt-adaptive")] == [
        "bimodal-B8", "pkvrt-adaptive", "pkv_workqueue, split 20", "2", "1.300 ± 0.071",
        "1.250 ± 0.071", "6.000e-05", "3.000e-06"]
    assert rows[("bimodal-B8", "flashinfer-tc (baseline)")][2:6] == ["flashinfer", "2", "1.000 ± 0.000",
                                                                    "1.000 ± 0.000"]
    # one seed: no ± part; 900/600 = 1.5, 700/500 = 1.4
    assert rows[("bucketed-B1", "pkvrt-adaptive")][2:6] == ["pkv_bucket, split 32", "1", "1.500", "1.400"]
    t3 = {(r[0], r[1]): r for r in table(md, "Table 3")}
    assert t3[("bimodal-B8", "pkvrt-adaptive")][2:] == ["2", "2600.0 ± 141.4", "0.800 ± 0.000",
                                                        "1250.0 ± 70.7", "0.900 ± 0.000"]
    t4 = {(r[0], r[1]): r for r in table(md, "Table 4")}
    assert t4[("bimodal-B8", "pkvrt-adaptive")][2:] == ["measured run", "2.00", "45.0", "500.0",
                                                        "2.50", "1.00"]
    assert t4[("bimodal-B8", "flashinfer-tc")][4] == "–"
    assert "| serving.json | serving | FAKE GPU |" in md


def test_failed_engine_is_reported_not_ratioed(capsys, tmp_path):
    rows = serving_rows(1, base_tok=1000.0, base_cuda=2000.0, eng_tok=1100.0, eng_cuda=2100.0)
    rows.append({"case": "bimodal-B8-seed1", "engine": "pkvrt-bucket", "row": "measured",
                 "correct": False, "max_err": 0.25, "mean_err": 0.01})
    rows.append({"case": "bimodal-B8-seed1", "engine": "pkvrt-adaptive / flashinfer-tc", "row": "ratio",
                 "wall_ratio": 1.1, "cuda_ratio": 1.05})
    write(tmp_path / "r" / "s.json", "serving", rows)
    rc, _, err = run(capsys, "report", str(tmp_path / "r"), "--out", str(tmp_path / "o"))
    assert rc == 0, err
    t2 = {r[1]: r for r in table((tmp_path / "o" / "report.md").read_text(), "Table 2")}
    assert t2["pkvrt-bucket"][4:7] == ["- (1 FAILED)", "- (1 FAILED)", "2.500e-01"]
    assert "pkvrt-adaptive / flashinfer-tc" not in t2          # ratio rows are recomputed, not shown


def test_isolated_table(capsys, tmp_path):
    d = tmp_path / "iso"
    rows = [
        dict(case="B1-32K", engine="flashinfer-cuda", splits=None, median_us=50.0, gbps=2000.0),
        dict(case="B1-32K", engine="flashinfer-tc", splits=None, median_us=40.0, gbps=2500.0),
        dict(case="B1-32K", engine="pkvrt-bucket", splits=16, median_us=45.0, gbps=2222.0),
        dict(case="B1-32K", engine="pkvrt-bucket", splits=32, median_us=36.0, gbps=2777.0,
             frac_read_bw=0.7),
        dict(case="B1-32K", engine="pkvrt-fused", splits=8, error="RuntimeError('boom')"),
    ]
    write(d / "isolated.json", None, rows, protocol="isolated graph-replay (fake)",
          read_bandwidth_gbps=2000.0)
    rc, _, err = run(capsys, "report", str(d), "--out", str(tmp_path / "o"))
    assert rc == 0, err
    md = (tmp_path / "o" / "report.md").read_text()
    t1 = table(md, "Table 1")
    # the fraction is GB/s over the stated 4.2 TB/s floor, never over the file's read probe
    # (2000 GB/s here: 2777 / 2000 = 1.39) nor a row's own frac_read_bw (0.7): 2777 / 4200 = 0.661
    assert t1[0] == ["B1-32K", "pkvrt-bucket", "32", "36.00", "2777.0", "0.661", "1.111x"]
    assert t1[1] == ["B1-32K", "flashinfer-tc (baseline)", "-", "40.00", "2500.0", "0.595", "1.000x"]
    assert t1[2] == ["B1-32K", "flashinfer-cuda", "-", "50.00", "2000.0", "0.476", "0.800x"]
    assert t1[3][:4] == ["B1-32K", "pkvrt-fused", "8", "FAILED"] and "boom" in t1[3][6]
    assert "| Case | Engine | Split | µs | GB/s | Fraction of 4.2 TB/s | Ratio vs baseline |" in md
    assert report.FLOOR_GBPS == 4200.0


def test_isolated_baseline_is_the_one_the_file_names(capsys, tmp_path):
    """benches/isolated.py names each case's baseline (FlashInfer's fastest path that matched the
    FP32 reference): a faster but wrong path is not the baseline, an unavailable one is shown."""
    d = tmp_path / "iso"
    common = dict(case="B1-32K", splits=None, baseline_engine="flashinfer-xqa")
    rows = [
        dict(common, engine="flashinfer-tc", median_us=44.0, gbps=2500.0),
        dict(common, engine="flashinfer-xqa", median_us=40.0, gbps=2700.0),
        dict(common, engine="flashinfer-cuda", median_us=30.0, gbps=3000.0,   # wrong: not the baseline
             max_err_ref=0.5, mean_err_ref=0.1),
        dict(common, engine="flashinfer-cudnn",
             unavailable="unavailable: RuntimeError: flashinfer 0.5.3: no backend='cudnn'"),
        dict(common, engine="pkvrt-bucket", splits=32, median_us=36.0, gbps=2777.0),
        dict(case="B8-32K", splits=None, baseline_engine=None, engine="pkvrt-bucket", median_us=50.0),
    ]
    write(d / "isolated.json", None, rows, protocol="isolated graph-replay (fake)")
    rc, _, err = run(capsys, "report", str(d), "--out", str(tmp_path / "o"))
    assert rc == 0, err
    md = (tmp_path / "o" / "report.md").read_text()
    t1 = {r[1]: r for r in table(md, "Table 1") if r[0] == "B1-32K"}
    assert t1["flashinfer-xqa (baseline)"][6] == "1.000x"
    assert t1["pkvrt-bucket"][6] == "1.111x" and t1["flashinfer-cuda"][6] == "1.333x"
    assert t1["flashinfer-cudnn"][3:] == ["unavailable", "-", "-",
                                          "RuntimeError: flashinfer 0.5.3: no backend='cudnn'"]
    b8 = [r for r in table(md, "Table 1") if r[0] == "B8-32K"]
    assert b8 == [["B8-32K", "pkvrt-bucket", "-", "50.00", "-", "-", "-"]]   # no correct FlashInfer
    t6 = {r[0]: r for r in table(md, "Table 6")}
    assert t6["B1-32K"][2] == "flashinfer-xqa" and t6["B1-32K"][5] == "1.111"


def _steps(engine, baseline, values, route=None, case="bimodal-B8-seed1"):
    """values: (step, active, max_context, wall_us, cuda_us)."""
    return [dict(case=case, engine=engine, seed=1, baseline=baseline, step=s, active=a,
                 max_context=c, mean_context=c / 2, route=route or ("flashinfer" if baseline else "x"),
                 split_max=None, wall_us=w, cuda_us=u) for s, a, c, w, u in values]


def test_per_step_tables_and_route_map(capsys, tmp_path):
    d = tmp_path / "st"
    base = _steps("flashinfer-tc", True, [(0, 8, 20000, 100.0, 80.0), (1, 8, 30000, 100.0, 80.0),
                                          (2, 2, 40000, 60.0, 50.0), (3, 1, 5000, 10.0, 8.0)])
    adaptive = (_steps("pkvrt-adaptive", False, [(0, 8, 20000, 80.0, 40.0), (1, 8, 30000, 120.0, 60.0)],
                       route="pkv_workqueue")
                + _steps("pkvrt-adaptive", False, [(2, 2, 40000, 40.0, 25.0)], route="pkv_bucket")
                + _steps("pkvrt-adaptive", False, [(3, 1, 5000, 10.0, 8.0)], route="flashinfer"))
    write(d / "s.steps.json", "serving-steps", base + adaptive)
    files = report.load_dir(d)
    by_ctx = {(r["experiment"], r["engine"], r["bin"]): r for r in report.ratio_by_context(files)}
    # 16K-32K bin: baseline 200 us wall, engine 200 us -> 1.0; cuda 160 / 100 = 1.6
    r = by_ctx[("bimodal-B8", "pkvrt-adaptive", (16384, 32768))]
    assert r["steps"] == 2 and r["wall_ratio"] == pytest.approx(1.0) and r["cuda_ratio"] == pytest.approx(1.6)
    assert r["baseline"] == "flashinfer-tc"
    assert by_ctx[("bimodal-B8", "pkvrt-adaptive", (32768, 65536))]["wall_ratio"] == pytest.approx(1.5)
    cells = {(c["active"], c["bin"]): c for c in report.route_map_cells(files)}
    assert cells[(8, (16384, 32768))]["route"] == "pkv_workqueue"
    assert cells[(2, (32768, 65536))]["route"] == "pkv_bucket"
    assert cells[(1, (4096, 8192))]["wall_ratio"] == pytest.approx(1.0)
    rc, out, err = run(capsys, "report", str(d), "--out", str(tmp_path / "o"), "--no-plots")
    assert rc == 0, err
    md = (tmp_path / "o" / "report.md").read_text()
    assert ["bimodal-B8", "pkvrt-adaptive", "flashinfer-tc", "16K-32K", "2", "1.600",
            "1.000"] in table(md, "Throughput ratio")
    assert ["bimodal-B8", "flashinfer-tc", "2", "32K-64K", "pkv_bucket", "100%", "1", "2.000",
            "1.500"] in table(md, "Route map")


def test_per_step_data_is_per_experiment_and_names_the_baseline(tmp_path):
    """B, G and L are different experiments: the per-step tables and plots never pool them, and
    a group whose seeds had different baselines names each with its share."""
    d = tmp_path / "st"
    rows = []
    for case in ("bimodal-B8-seed1", "bimodal-B4-seed1", "bimodal-B8-G1-seed1", "bimodal-B8-L32-seed1"):
        rows += (_steps("flashinfer-tc", True, [(0, 2, 20000, 100.0, 80.0)], case=case)
                 + _steps("pkvrt-adaptive", False, [(0, 2, 20000, 50.0, 40.0)], case=case))
    rows += (_steps("flashinfer-cuda", True, [(0, 2, 20000, 100.0, 80.0)], case="bimodal-B8-seed2")
             + _steps("pkvrt-adaptive", False, [(0, 2, 20000, 50.0, 40.0)], case="bimodal-B8-seed2"))
    write(d / "s.steps.json", "serving-steps", rows)
    files = report.load_dir(d)
    by_ctx = {r["experiment"]: r for r in report.ratio_by_context(files)}
    assert sorted(by_ctx) == ["bimodal-B4", "bimodal-B8", "bimodal-B8-G1", "bimodal-B8-L32"]
    assert by_ctx["bimodal-B4"]["steps"] == 1 and by_ctx["bimodal-B8"]["steps"] == 2
    assert by_ctx["bimodal-B8"]["baseline"] == "flashinfer-tc (1/2 seeds), flashinfer-cuda (1/2 seeds)"
    assert by_ctx["bimodal-B8-L32"]["baseline"] == "flashinfer-tc"
    cells = report.route_map_cells(files)
    assert [(c["experiment"], c["steps"]) for c in cells] == [
        ("bimodal-B4", 1), ("bimodal-B8", 2), ("bimodal-B8-G1", 1), ("bimodal-B8-L32", 1)]


def test_per_step_run_in_two_files_counts_once_newest_wins(tmp_path):
    """A later file re-timing an engine on the same seeds (serving-figraph-*) replaces the older
    records in the per-step tables and plots, as in Table 2: each measured step counts once."""
    d = tmp_path / "st"
    old = (_steps("flashinfer-cuda", True, [(0, 8, 20000, 100.0, 80.0), (1, 8, 20000, 100.0, 80.0)])
           + _steps("pkvrt-device-plan", False, [(0, 8, 20000, 50.0, 40.0), (1, 8, 20000, 50.0, 40.0)])
           + _steps("pkvrt-adaptive", False, [(0, 8, 20000, 80.0, 60.0), (1, 8, 20000, 80.0, 60.0)]))
    new = (_steps("flashinfer-cuda", True, [(0, 8, 20000, 100.0, 80.0), (1, 8, 20000, 100.0, 80.0)])
           + _steps("pkvrt-device-plan", False, [(0, 8, 20000, 100.0, 80.0), (1, 8, 20000, 100.0, 80.0)]))
    write(d / "a.steps.json", "serving-steps", old, date="2026-11-29T20:00:00+00:00", layers=32)
    write(d / "b.steps.json", "serving-steps", new, date="2026-11-29T21:00:00+00:00", layers=32)
    files = report.load_dir(d)
    by_ctx = {r["engine"]: r for r in report.ratio_by_context(files)}
    assert by_ctx["pkvrt-device-plan"]["steps"] == 2                      # not 4
    assert by_ctx["pkvrt-device-plan"]["cuda_ratio"] == pytest.approx(1.0)  # the newer file's
    assert by_ctx["pkvrt-adaptive"]["steps"] == 2                         # only in the older file
    pts = report.engine_step_points(files, "pkvrt-device-plan")
    assert len(pts) == 2 and {p["ratio"] for p in pts} == {1.0}
    assert {p["baseline"] for p in pts} == {"flashinfer-cuda"}
    rows = {r["engine"]: r for r in report.engine_protocol_rows(files)}
    assert rows["pkvrt-device-plan"]["steps"] == len(pts) == 2


def test_without_matplotlib_report_fails_and_keeps_the_committed_plots(capsys, tmp_path, monkeypatch):
    d = tmp_path / "st"
    write(d / "s.steps.json", "serving-steps",
          _steps("flashinfer-tc", True, [(0, 8, 20000, 100.0, 80.0)])
          + _steps("pkvrt-adaptive", False, [(0, 8, 20000, 80.0, 40.0)]))
    o = tmp_path / "o"
    o.mkdir()
    committed = "# pkvrt results report\n\n![route_map.png](route_map.png)\n"
    (o / "report.md").write_text(committed)
    (o / "route_map.png").write_bytes(b"\x89PNG committed")
    monkeypatch.setattr(report, "_have_matplotlib", lambda: False)
    rc, out, err = run(capsys, "report", str(d), "--out", str(o))
    assert rc == 2 and out == ""
    assert last_line(err) == f"pkvrt: error: {report.NO_MATPLOTLIB}"
    assert "pip install 'pkvrt[plots]'" in err and "--no-plots" in err
    assert (o / "report.md").read_text() == committed
    assert (o / "route_map.png").read_bytes() == b"\x89PNG committed"
    # --no-plots: the tables only, said so; the plot files already there are not touched
    rc, out, err = run(capsys, "report", str(d), "--out", str(o), "--no-plots")
    assert rc == 0, err
    md = (o / "report.md").read_text()
    assert report.PLOTS_OFF in out and report.PLOTS_OFF in md and "## Route map" in md
    assert "](route_map.png)" not in md
    assert (o / "route_map.png").read_bytes() == b"\x89PNG committed"


def test_without_per_step_records_matplotlib_is_not_needed(capsys, serving_dir, tmp_path, monkeypatch):
    monkeypatch.setattr(report, "_have_matplotlib", lambda: False)
    rc, out, err = run(capsys, "report", str(serving_dir), "--out", str(tmp_path / "o"))
    assert rc == 0, err
    assert "No per-step records (.steps.json files) to plot." in out


def test_plots_have_one_panel_per_experiment_and_name_the_baseline(tmp_path, monkeypatch):
    pytest.importorskip("matplotlib")
    import matplotlib.pyplot as plt

    figs = []
    monkeypatch.setattr(plt, "close", figs.append)
    d = tmp_path / "st"
    rows = []
    for case, base in (("bimodal-B8-L32-seed1", "flashinfer-tc"), ("bimodal-B8-L32-seed2", "flashinfer-tc"),
                       ("bimodal-B8-G1-L32-seed1", "flashinfer-cuda")):
        rows += (_steps(base, True, [(0, 8, 20000, 100.0, 80.0), (1, 4, 40000, 50.0, 40.0)], case=case)
                 + _steps("pkvrt-device-plan", False, [(0, 8, 20000, 90.0, 70.0),
                                                      (1, 4, 40000, 45.0, 35.0)], case=case))
    write(d / "s.steps.json", "serving-steps", rows, layers=32)
    files = report.load_dir(d)
    report.plot_ratio_vs_context(report.ratio_by_context(files), tmp_path / "r.png")
    report.plot_step_ratios(report.engine_step_points(files, "pkvrt-device-plan"), "pkvrt-device-plan",
                            tmp_path / "s.png")
    ctx, steps = ([ax for ax in f.axes if ax.get_label() != "<colorbar>"] for f in figs)
    assert [ax.get_title() for ax in ctx] == ["bimodal-B8-G1-L32", "bimodal-B8-L32"]
    assert [t.get_text() for t in ctx[0].get_legend().get_texts()] == [
        "pkvrt-device-plan vs flashinfer-cuda"]
    # one point per measured step, as the engine-protocol table counts them
    assert [ax.get_title() for ax in steps] == ["bimodal-B8-L32 vs flashinfer-tc (4 steps)",
                                                "bimodal-B8-G1-L32 vs flashinfer-cuda (2 steps)"]
    assert [len(ax.collections[0].get_offsets()) for ax in steps] == [4, 2]


def test_plots_written_with_matplotlib(capsys, tmp_path):
    pytest.importorskip("matplotlib")
    d = tmp_path / "st"
    write(d / "s.steps.json", "serving-steps",
          _steps("flashinfer-tc", True, [(0, 8, 20000, 100.0, 80.0), (1, 1, 40000, 50.0, 40.0)])
          + _steps("pkvrt-adaptive", False, [(0, 8, 20000, 80.0, 40.0), (1, 1, 40000, 30.0, 20.0)]))
    rc, out, _ = run(capsys, "report", str(d), "--out", str(tmp_path / "o"))
    assert rc == 0 and "wrote plots: ratio_vs_context.png, route_map.png" in out
    md = (tmp_path / "o" / "report.md").read_text()
    assert "![ratio_vs_context.png](ratio_vs_context.png)" in md
    for name in ("ratio_vs_context.png", "route_map.png"):
        assert (tmp_path / "o" / name).read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_other_files_get_a_generic_table(capsys, tmp_path):
    d = tmp_path / "g"
    write(d / "sweeps.json", "calibration-sweeps",
          [dict(case="B1-32K", engine="pkvrt-bucket", splits=16, median_us=70.0, extra={"a": 1})])
    rc, _, err = run(capsys, "report", str(d), "--out", str(tmp_path / "o"))
    assert rc == 0, err
    md = (tmp_path / "o" / "report.md").read_text()
    assert "\n### sweeps.json\n" in table_section(md, "Other results")
    assert "| case | engine | splits | median_us | extra |" in md
    assert '| B1-32K | pkvrt-bucket | 16 | 70 | {"a": 1} |' in md


def test_default_out_is_inside_the_results_dir(capsys, serving_dir):
    rc, _, _ = run(capsys, "report", str(serving_dir))
    assert rc == 0 and (serving_dir / "report" / "report.md").is_file()



# --------------------------------------------------------------------------- Tables 6, 7

def sub_tables(md: str, title_start: str) -> dict[str, list[list[str]]]:
    """The tables of a section that holds several, keyed by the bold title line above each."""
    section = next(s for s in md.split("\n## ") if s.startswith(title_start))
    out: dict[str, list[list[str]]] = {}
    for block in section.split("\n**")[1:]:
        title, _, body = block.partition("\n")
        out[title] = cells(body)
    return out


@pytest.mark.parametrize("ratio, text", [
    (1.05, "pkvrt faster"), (1.02, "pkvrt faster"), (1.0196, "pkvrt faster"),   # shown as 1.020
    (1.019, "tie"), (1.0, "tie"), (0.98, "tie"), (0.9796, "tie"),               # shown as 0.980
    (0.979, "FlashInfer faster"), (0.5, "FlashInfer faster"), (None, "-")])
def test_verdict_thresholds(ratio, text):
    assert report.verdict(ratio) == text


def test_coverage_table(capsys, tmp_path):
    d = tmp_path / "cov"
    iso = [
        dict(case="B1-32K", engine="flashinfer-tc", splits=None, median_us=40.0),
        dict(case="B1-32K", engine="flashinfer-cuda", splits=None, median_us=50.0),
        dict(case="B1-32K", engine="pkvrt-bucket", splits=16, median_us=45.0),
        dict(case="B1-32K", engine="pkvrt-bucket", splits=32, median_us=38.0),   # 40 / 38 = 1.053
        dict(case="B1-32K", engine="pkvrt-workqueue", splits=64, median_us=39.0),
        dict(case="B1-32K", engine="pkvrt-fused", splits=8, median_us=None, error="boom"),
        dict(case="B8-32K", engine="flashinfer-tc", splits=None, median_us=50.0),
        dict(case="B8-32K", engine="pkvrt-bucket", splits=4, median_us=50.5),     # 0.990
        dict(case="G8-B1-32K", engine="flashinfer-cuda", splits=None, median_us=30.0),
        dict(case="G8-B1-32K", engine="pkvrt-bucket", splits=8, median_us=40.0),  # 0.750
    ]
    write(d / "isolated.json", None, iso, protocol="isolated graph-replay (fake)")
    # bimodal-B8: adaptive cuda 1.25, 1.35 (wall 1.2, 1.3); device-plan cuda 0.95, 1.05 (wall 1.5, 1.7)
    serving = []
    for seed, (a_cuda, a_tok, d_cuda, d_tok) in ((1, (2500.0, 1200.0, 1900.0, 1500.0)),
                                                  (2, (2700.0, 1300.0, 2100.0, 1700.0))):
        serving += serving_rows(seed, base_tok=1000.0, base_cuda=2000.0, eng_tok=a_tok, eng_cuda=a_cuda)
        serving += serving_rows(seed, base_tok=1000.0, base_cuda=2000.0, eng_tok=d_tok, eng_cuda=d_cuda,
                                engine="pkvrt-device-plan")[1:]
    serving.append({"case": "bimodal-B8-seed2", "engine": "pkvrt-bucket", "row": "measured",
                    "correct": False, "max_err": 0.25})
    write(d / "serving.json", "serving", serving)
    # bucketed-B1, one seed: cuda 594 / 600 = 0.99 (tie), wall 485 / 500 = 0.97 (FlashInfer faster)
    write(d / "serving-b1.json", "serving",
          serving_rows(1, base_tok=500.0, base_cuda=600.0, eng_tok=485.0, eng_cuda=594.0,
                       trace="bucketed-B1"))
    rc, _, err = run(capsys, "report", str(d), "--out", str(tmp_path / "o"))
    assert rc == 0, err
    md = (tmp_path / "o" / "report.md").read_text()
    rows = {r[0]: r for r in table(md, "Table 6")}
    assert rows["B1-32K"] == ["B1-32K", "isolated.json", "flashinfer-tc", "-", "pkvrt-bucket, split 32",
                              "1.053", "pkvrt faster", "-", "-", "-"]
    assert rows["B8-32K"][4:7] == ["pkvrt-bucket, split 4", "0.990", "tie"]
    assert rows["G8-B1-32K"][2:7] == ["flashinfer-cuda", "-", "pkvrt-bucket, split 8", "0.750",
                                      "FlashInfer faster"]
    # the best engine differs per measure: adaptive on CUDA events, device-plan on wall time
    assert rows["bimodal-B8"] == ["bimodal-B8", "serving.json", "flashinfer-tc", "2", "pkvrt-adaptive",
                                  "1.300 ± 0.071", "pkvrt faster", "pkvrt-device-plan",
                                  "1.600 ± 0.141", "pkvrt faster"]
    assert rows["bucketed-B1"][4:] == ["pkvrt-adaptive", "0.990", "tie", "pkvrt-adaptive", "0.970",
                                       "FlashInfer faster"]
    # isolated cases first, then the traces in Table 2's order (files by name: serving-b1 first)
    assert list(rows) == ["B1-32K", "B8-32K", "G8-B1-32K", "bucketed-B1", "bimodal-B8"]
    section = md.split("## Table 6")[1].split("\n## ")[0]
    assert "Verdicts, CUDA events (isolated and serving): pkvrt faster 2, tie 2, FlashInfer faster 1." \
        in section
    assert "Verdicts, wall (serving): pkvrt faster 1, FlashInfer faster 1." in section
    assert "Not candidates (a seed failed correctness): bimodal-B8: pkvrt-bucket." in section
    assert "protocol: isolated graph-replay (fake)" in section


def test_coverage_baselines_over_seeds(tmp_path):
    rows = (serving_rows(1, base_tok=1.0, base_cuda=1.0, eng_tok=1.0, eng_cuda=1.0)
            + serving_rows(2, base_tok=1.0, base_cuda=1.0, eng_tok=1.0, eng_cuda=1.0)
            + [dict(r, engine="flashinfer-cuda") if r["baseline"] else r
               for r in serving_rows(3, base_tok=1.0, base_cuda=1.0, eng_tok=1.0, eng_cuda=1.0)])
    write(tmp_path / "s.json", "serving", rows)
    cov, failed = report.serving_coverage(report.load_dir(tmp_path))
    assert cov[0]["baseline"] == "flashinfer-tc (2), flashinfer-cuda (1)" and cov[0]["seeds"] == 3
    assert failed == []


def test_split_sensitivity_table(capsys, tmp_path):
    d = tmp_path / "sw"
    rows = [
        dict(case="B1-32K", engine="pkvrt-bucket", splits=32, median_us=50.0, cta_work_per_sm=2.0),
        dict(case="B1-32K", engine="pkvrt-bucket", splits=8, median_us=60.0, cta_work_per_sm=0.5),
        dict(case="B1-32K", engine="pkvrt-bucket", splits=16, median_us=40.0, cta_work_per_sm=1.0),
        dict(case="B1-32K", engine="flashinfer-tc", splits=None, median_us=44.0),
        dict(case="B1-8K", engine="pkvrt-bucket", splits=16, median_us=18.0),      # one split: no table
        dict(case="B2-32K", engine="flashinfer-cuda", splits=None, median_us=70.0),  # no sweep: no table
        dict(case="mix-seed1", engine="pkvrt-workqueue", splits=4, median_us=None),
        dict(case="mix-seed1", engine="pkvrt-workqueue", splits=12, median_us=30.0, cta_work_per_sm=3.0),
    ]
    write(d / "calibrate-sweeps.json", "calibration-sweeps", rows)
    rc, _, err = run(capsys, "report", str(d), "--out", str(tmp_path / "o"))
    assert rc == 0, err
    md = (tmp_path / "o" / "report.md").read_text()
    # sorted by split, relative to the best (40 us): 60/40, 40/40, 50/40; FlashInfer 44/40
    head = ["B1-32K", "pkvrt-bucket", "calibrate-sweeps.json"]
    mix = ["mix-seed1", "pkvrt-workqueue", "calibrate-sweeps.json"]
    assert table(md, "Table 7") == [
        head + ["8", "60.00", "0.50", "1.500", ""],
        head + ["16", "40.00", "1.00", "1.000", "best"],
        head + ["32", "50.00", "2.00", "1.250", ""],
        head + ["flashinfer-tc (no split)", "44.00", "-", "1.100", "reference"],
        mix + ["4", "FAILED", "-", "-", ""],
        mix + ["12", "30.00", "3.00", "1.000", "best"]]
    assert "\n### calibrate-sweeps.json\n" in table_section(md, "Other results")   # the raw rows too
    assert not list((tmp_path / "o").glob("appendix-*.csv"))                   # short: no appendix


def test_new_sections_say_no_data(capsys, tmp_path):
    d = tmp_path / "none"
    write(d / "soak.json", "soak", [dict(case="soak", engine="pkvrt-adaptive", steps=10)])
    rc, _, err = run(capsys, "report", str(d), "--out", str(tmp_path / "o"))
    assert rc == 0, err
    md = (tmp_path / "o" / "report.md").read_text()
    assert "## Table 6: coverage map (from the measured results)\n\nNo data: no isolated or serving " \
           "results files." in md
    assert "## Table 7: split sensitivity (calibration seed sweeps)\n\nNo data: no calibration-sweeps " \
           "file with a split sweep" in md
    assert "\n### soak.json\n" in table_section(md, "Other results")

# --------------------------------------------------------------------------- malformed inputs

def _bad_row(**over):
    row = serving_rows(1, base_tok=1.0, base_cuda=1.0, eng_tok=1.0, eng_cuda=1.0)
    row[1].update(over)
    return row


@pytest.mark.parametrize("content, message", [
    ("{not json", "invalid JSON at line 1 column 2"),
    (json.dumps({"rows": []}), "not a pkvrt results file (expected an object with 'meta' and 'rows')"),
    (json.dumps({"meta": {}, "rows": {}}), "not a pkvrt results file"),
    (json.dumps({"meta": [], "rows": []}), "key 'meta': expected an object, got list"),
    (json.dumps({"meta": {}, "rows": [3]}), "rows[0]: expected an object, got 3"),
    (json.dumps({"meta": {}, "rows": [{"engine": "e"}]}),
     "rows[0]: key 'case': expected a non-empty string, got None"),
    (json.dumps({"meta": {}, "rows": [{"case": "c", "engine": "e", "median_us": "fast"}]}),
     "rows[0]: key 'median_us': expected a number or null, got 'fast'"),
    (json.dumps({"meta": {"kind": "serving"}, "rows": _bad_row(tok_per_s=None)}),
     "rows[1]: key 'tok_per_s': expected a positive number in a timed serving row, got None"),
    (json.dumps({"meta": {"kind": "serving"}, "rows": _bad_row(baseline=True)}),
     "case 'bimodal-B8-seed1': two baseline rows (flashinfer-tc, pkvrt-adaptive)"),
    (json.dumps({"meta": {"kind": "serving"}, "rows": _bad_row()[1:]}),
     "case 'bimodal-B8-seed1': no baseline row"),
    (json.dumps({"meta": {"kind": "serving-steps"}, "rows": [
        {"case": "c", "engine": "e", "step": 0, "active": 1, "max_context": 5, "wall_us": 1.0,
         "cuda_us": 1.0}]}), "rows[0]: key 'route': expected a string, got None"),
])
def test_malformed_file_is_an_error_naming_it(capsys, tmp_path, content, message):
    d = tmp_path / "bad"
    d.mkdir()
    write(d / "good.json", "serving", serving_rows(1, base_tok=1.0, base_cuda=1.0, eng_tok=2.0, eng_cuda=2.0))
    (d / "broken.json").write_text(content)
    rc, out, err = run(capsys, "report", str(d), "--out", str(tmp_path / "o"))
    assert rc == 2 and out == ""
    assert last_line(err).startswith(f"pkvrt: error: {d / 'broken.json'}") and message in err
    assert not (tmp_path / "o" / "report.md").exists()


@pytest.mark.parametrize("make, message", [
    (lambda p: p.mkdir(), "no results files (*.json) found"),
    (lambda p: p.write_text("x"), "expected a directory of results files"),
    (lambda p: None, "expected a directory of results files"),
])
def test_bad_results_dir(capsys, tmp_path, make, message):
    p = tmp_path / "in"
    make(p)
    rc, _, err = run(capsys, "report", str(p))
    assert rc == 2 and err == f"pkvrt: error: {p}: {message}\n"


def test_report_needs_a_directory_argument(capsys):
    rc, _, err = run(capsys, "report")
    assert rc == 2 and "RESULTS_DIR" in err


# --------------------------------------------------------------------------- formatting helpers

@pytest.mark.parametrize("values, text", [([1.2, 1.3], "1.250 ± 0.071"), ([1.2], "1.200"), ([], "-"),
                                          ([None, 2.0], "2.000")])
def test_fmt_pm(values, text):
    assert report.fmt_pm(values) == text


@pytest.mark.parametrize("tokens, bin_, label", [(20000, (16384, 32768), "16K-32K"),
                                                 (16384, (16384, 32768), "16K-32K"),
                                                 (700, (512, 1024), "512-1K"), (1, (1, 2), "1-2")])
def test_context_bins(tokens, bin_, label):
    assert report.context_bin(tokens) == bin_ and report.bin_label(*bin_) == label


def test_trace_key():
    assert report.trace_key("bimodal-B8-L32-mlp-seed20260623") == "bimodal-B8-L32-mlp"
    assert report.trace_key("B1-32K") == "B1-32K"


def test_declared_source_commit_overrides_stale_git_metadata(monkeypatch):
    """A work tree copied to the GPU machine can carry an older .git: the sender declares the
    commit it copied, and the results' meta records that."""
    from pkvrt.measure import results

    monkeypatch.setenv("PKVRT_SOURCE_COMMIT", "abc123")
    assert results.make_meta()["pkvrt_commit"] == "abc123"
    monkeypatch.delenv("PKVRT_SOURCE_COMMIT")
    assert results.make_meta()["pkvrt_commit"] != "abc123"


def test_the_meta_names_the_kernel_sources_that_ran(monkeypatch, tmp_path):
    """kernel_build's sources_sha256 follows the kernel families' source hashes (not the
    manifest's path or build time): a build of other sources copied in gets another digest."""
    from pkvrt.launch import manifest
    from pkvrt.measure import results

    def build(find_shared_hash, built_in):
        entries = tuple(manifest.Entry(family=f, arch=a, kind=k, file=f"{f}.{a}", source_sha256=h,
                                       symbols=(), resources={}, path=tmp_path / built_in / f)
                        for f, h in (("find_shared", find_shared_hash), ("merge", "m1"))
                        for a, k in (("sm_90", "cubin"), ("compute_90", "ptx")))
        return manifest.Manifest(path=tmp_path / built_in / "manifest.json", nvcc_version="13.0",
                                 skipped=None, entries=entries, tuning={})

    digests = []
    for h, where in (("f1", "a"), ("f1", "b"), ("f2", "a")):
        monkeypatch.setattr(manifest, "load_manifest", lambda h=h, where=where: build(h, where))
        digests.append(results.kernel_build()["sources_sha256"])
    assert digests[0] == digests[1] != digests[2]


def test_ncu_rows_render_as_table_5_with_engines_per_kernel(tmp_path):
    from pkvrt.measure import results
    from pkvrt.tools import report

    rows = [{"kernel": "pkv_workqueue_decode_f16_d128_g4", "duration_us": 82.0, "dram_pct_of_peak": 85.0},
            {"kernel": "pkv_merge_f16_d128", "duration_us": 4.5},
            {"kernel": "void flashinfer::BatchPrefillWithPagedKVCacheKernel<x>(y)", "duration_us": 87.0},
            {"kernel": "void flashinfer::PersistentVariableLengthMergeStatesKernel<x>(y)", "duration_us": 4.6}]
    results.write_results(tmp_path / "ncu-b8.json", results.make_meta(kind="ncu", case="b8-bimodal"), rows)
    md = report.ncu_table(report.load_dir(tmp_path))
    assert "| b8-bimodal | pkvrt-workqueue | pkv_merge_f16_d128 | 4.5 |" in md
    assert "| b8-bimodal | pkvrt-workqueue | **all kernels** | **86.5** |" in md
    assert "| b8-bimodal | flashinfer-tc | **all kernels** | **91.6** |" in md
    results.write_results(tmp_path / "bad.json", results.make_meta(kind="ncu"), [{"duration_us": 1.0}])
    with pytest.raises(ValueError, match="bad.json: rows\\[0\\]: key 'kernel'"):
        report.load_dir(tmp_path)


def test_a_seed_measured_in_two_files_counts_once_newest_wins(tmp_path):
    """A later run that adds an engine re-times the others on the same seeds: each (case, engine)
    enters the mean once, from the newest file, never twice."""
    from pkvrt.tools import report

    d = tmp_path / "res"
    write(d / "a.json", "serving", serving_rows(1, base_tok=1000.0, base_cuda=2000.0, eng_tok=1200.0,
                                                 eng_cuda=2500.0, engine="pkvrt-device-plan"),
          date="2026-11-29T20:00:00+00:00")
    write(d / "b.json", "serving", serving_rows(1, base_tok=1000.0, base_cuda=2000.0, eng_tok=1400.0,
                                                 eng_cuda=3000.0, engine="pkvrt-device-plan"),
          date="2026-11-29T21:00:00+00:00")
    groups = report.serving_groups(report.load_dir(d))
    entries = groups[("bimodal-B8", "pkvrt-device-plan")]
    assert len(entries) == 1 and entries[0]["cuda_ratio"] == pytest.approx(1.5)
    assert len(groups[("bimodal-B8", "flashinfer-tc")]) == 1


def test_baseline_probe_table_lists_every_path_and_the_reason_one_could_not_run(tmp_path):
    """FAKE probe times: seed 1 tc 100 / cuda 150 / xqa 200 us, seed 2 tc 100 / cuda 130 / xqa
    300 -> cuda 1.400, xqa 2.500 (mean of the per-seed ratios), tc the baseline in bold; cuDNN
    unavailable with its reason. A file without probe records gets no row."""
    per_seed = {
        "1": {"baseline": "flashinfer-tc",
              "baseline_probe_device_us": {"flashinfer-cuda": 150.0, "flashinfer-tc": 100.0,
                                           "flashinfer-xqa": 200.0},
              "baseline_candidates": {"flashinfer-cuda": "ok", "flashinfer-tc": "ok",
                                      "flashinfer-cudnn": "unavailable: no cuDNN decode in 0.5.3",
                                      "flashinfer-xqa": "ok"}},
        "2": {"baseline": "flashinfer-tc",
              "baseline_probe_device_us": {"flashinfer-cuda": 130.0, "flashinfer-tc": 100.0,
                                           "flashinfer-xqa": 300.0}},
    }
    rows = serving_rows(1, base_tok=1000.0, base_cuda=2000.0, eng_tok=1200.0, eng_cuda=2500.0)
    a = write(tmp_path / "engine-a.json", "serving", rows, per_seed=per_seed)
    b = write(tmp_path / "engine-b.json", "serving", rows)
    files = [(str(a), results.read_results(a)), (str(b), results.read_results(b))]
    got = cells(report.baseline_probe_table(files))
    assert got == [["engine-a.json", "2",
                    "flashinfer-cuda 1.400 (150 us); **flashinfer-tc** 1.000 (100 us); "
                    "flashinfer-cudnn: unavailable: no cuDNN decode in 0.5.3; flashinfer-xqa 2.500 (200 us)"]]
    assert report.baseline_probe_table(files[1:]) == ""


# --------------------------------------------------------------------------- layout: bounded length,
# CSV appendices, plots beside their tables, header, progress on stderr

def _big_sweep(cases: int = 30, splits: int = 64) -> list[dict]:
    """A FAKE calibration sweep: per case three engines over ``splits`` split values (time
    100 / s + s / 8 us, best near s = 28) and one FlashInfer reference."""
    rows = []
    for c in range(cases):
        case = f"B{c + 1}-32K"
        rows.append(dict(case=case, engine="flashinfer-tc", splits=None, median_us=30.0))
        for engine in ("pkvrt-bucket", "pkvrt-workqueue", "pkvrt-fused"):
            rows += [dict(case=case, engine=engine, splits=s, median_us=100.0 / s + s / 8 + c,
                          cta_work_per_sm=s / 132) for s in range(1, splits + 1)]
    return rows


def _many_step_files(d, experiments: int = 12, layers: int = 2) -> None:
    """FAKE per-step files: ``experiments`` traces, each with steps over four context bins."""
    rows = []
    for x in range(experiments):
        case = f"trace{x}-B8-seed1"
        values = [(s, 8, 1024 << s, 100.0, 80.0) for s in range(4)]
        rows += _steps("flashinfer-tc", True, values, case=case)
        rows += _steps("pkvrt-adaptive", False, [(s, a, c, w * 0.8, u * 0.7) for s, a, c, w, u in values],
                       route="pkv_fused", case=case)
    write(d / "many.steps.json", "serving-steps", rows, layers=layers)


def test_large_sweep_goes_to_a_csv_appendix_and_report_md_stays_short(capsys, tmp_path):
    import csv

    d = tmp_path / "big"
    rows = _big_sweep()
    write(d / "calibrate-sweeps.json", "calibration-sweeps", rows)
    _many_step_files(d)
    rc, out, err = run(capsys, "report", str(d), "--out", str(tmp_path / "o"), "--no-plots")
    assert rc == 0, err
    o = tmp_path / "o"
    md = (o / "report.md").read_text()
    assert len(md.splitlines()) < 200                   # 5 790 sweep rows, 48 context rows
    # Table 7: a summary row per (file, engine), every split in the CSV it links
    section = table_section(md, "Table 7")
    assert "[appendix-split-sensitivity.csv](appendix-split-sensitivity.csv)" in section
    summary = {r[1]: r for r in cells(section)}
    assert list(summary) == ["pkvrt-bucket", "pkvrt-workqueue", "pkvrt-fused"]
    # 100 / s + s / 8 is least at s = 28 (4.071 us + c); 2 % of the best admits s = 24..32 for c = 0
    assert summary["pkvrt-bucket"][2:5] == ["30", "1-64 (64 values)", "28 / 28 / 28"]
    with open(o / "appendix-split-sensitivity.csv", newline="") as f:
        full = list(csv.reader(f))
    assert full[0] == ["Case", "Engine", "File", "Splits", "µs", "CTA work/SM", "Time vs best split", "Best"]
    assert len(full) - 1 == 30 * 3 * 64 + 30 * 3           # every split, plus a reference per group
    assert sum(r[7] == "best" for r in full[1:]) == 90
    # the raw rows of the sweeps file: a CSV of their own, linked from the overview
    assert "[appendix-file-calibrate-sweeps.csv](appendix-file-calibrate-sweeps.csv)" in md
    with open(o / "appendix-file-calibrate-sweeps.csv", newline="") as f:
        assert len(list(csv.reader(f))) == len(rows) + 1
    # per-step tables: 48 (experiment, engine, bin) rows -> one row per experiment and engine
    ctx = table_section(md, "Throughput ratio")
    assert "[appendix-ratio-by-context.csv](appendix-ratio-by-context.csv)" in ctx
    assert len(cells(ctx)) == 12
    assert cells(ctx)[0][4] == "1K-2K 1.429 · 2K-4K 1.429 · 4K-8K 1.429 · 8K-16K 1.429"     # 80 / 56
    assert (o / "appendix-steps-trace0-B8.csv").is_file()
    assert "[trace0-B8](appendix-steps-trace0-B8.csv)" in ctx
    routes = table_section(md, "Route map")
    assert "[appendix-route-map.csv](appendix-route-map.csv)" in routes and len(cells(routes)) == 12
    assert "wrote" in out and "CSV appendices" in out


@pytest.mark.parametrize("n, appendix", [(report.MAX_ROWS, False), (report.MAX_ROWS + 1, True)])
def test_a_table_longer_than_the_limit_goes_to_a_csv(tmp_path, n, appendix):
    t = report.Table(("a", "b"), [(i, i * i) for i in range(n)])
    out = report.Outputs()
    md = report.place(t, out, "squares", report.MAX_ROWS)
    assert bool(out.appendices) == appendix
    assert len(cells(md)) == report.MAX_ROWS if appendix else n
    if appendix:
        assert md.startswith(f"{n} rows, all in [appendix-squares.csv](appendix-squares.csv)")
        report.write_outputs(tmp_path, out)
        assert (tmp_path / "appendix-squares.csv").read_text().splitlines()[-1] == f"{n - 1},{(n - 1) ** 2}"


def test_a_long_isolated_table_keeps_the_pkvrt_and_baseline_rows(capsys, tmp_path):
    d = tmp_path / "iso"
    rows = []
    for c in range(8):                                     # 8 cases x 6 engines = 48 rows > 40
        case = f"B{c + 1}-32K"
        rows += [dict(case=case, engine=e, splits=None, median_us=t) for e, t in
                 (("flashinfer-tc", 40.0), ("flashinfer-cuda", 50.0), ("flashinfer-xqa", 45.0))]
        rows += [dict(case=case, engine=e, splits=16, median_us=t) for e, t in
                 (("pkvrt-bucket", 38.0), ("pkvrt-fused", 39.0), ("pkvrt-workqueue", 41.0))]
    write(d / "isolated.json", None, rows, protocol="isolated graph-replay (fake)")
    rc, _, err = run(capsys, "report", str(d), "--out", str(tmp_path / "o"))
    assert rc == 0, err
    md = (tmp_path / "o" / "report.md").read_text()
    t1 = table(md, "Table 1")
    assert len(t1) == 8 * 4 and {r[1] for r in t1} == {"pkvrt-bucket", "pkvrt-fused", "pkvrt-workqueue",
                                                        "flashinfer-tc (baseline)"}
    assert "48 rows, all in [appendix-table-1-isolated.csv]" in md
    assert (tmp_path / "o" / "appendix-table-1-isolated.csv").read_text().count("\n") == 49


def test_each_plot_follows_the_table_it_illustrates(capsys, tmp_path):
    pytest.importorskip("matplotlib")
    d = tmp_path / "st"
    _many_step_files(d, experiments=2)
    rc, _, err = run(capsys, "report", str(d), "--out", str(tmp_path / "o"))
    assert rc == 0, err
    md = (tmp_path / "o" / "report.md").read_text()
    assert "## Plots" not in md
    for title, plot in (("Engine protocol", "steps_pkvrt-adaptive.png"),
                        ("Throughput ratio", "ratio_vs_context.png"), ("Route map", "route_map.png")):
        blocks = table_section(md, title).rstrip("\n").split("\n\n")
        assert blocks[-1] == f"![{plot}]({plot})", title          # the section ends with its plot ...
        assert blocks[-2].startswith("| "), title                  # ... right after its table
        assert (tmp_path / "o" / plot).read_bytes()[:4] == b"\x89PNG"
    assert md.count("](steps_pkvrt-adaptive.png)") == 1


def test_progress_lines_on_stderr(capsys, tmp_path, serving_dir):
    pytest.importorskip("matplotlib")
    _many_step_files(serving_dir, experiments=1)
    rc, out, err = run(capsys, "report", str(serving_dir), "--out", str(tmp_path / "o"))
    assert rc == 0, err
    lines = err.splitlines()
    assert all(ln.startswith("pkvrt report: ") for ln in lines)
    assert lines[0] == f"pkvrt report: reading 3 results file(s) (*.json) from {serving_dir}"
    n = len(report.SECTIONS)
    assert [ln for ln in lines if " section " in ln][::n - 1] == [
        "pkvrt report: section 1/19: Table 1: isolated decode attention",
        "pkvrt report: section 19/19: Results files read"] and n == 19
    assert "pkvrt report: plot: ratio_vs_context.png" in lines
    assert "pkvrt report: appendix: appendix-steps-trace0-B8.csv (4 rows)" in lines
    assert lines[-1].startswith(f"pkvrt report: writing {tmp_path / 'o' / 'report.md'} (")
    assert "pkvrt report:" not in out                      # stdout keeps its short summary


def test_header_names_the_report_its_command_and_contents(capsys, serving_dir, tmp_path):
    rc, _, err = run(capsys, "report", str(serving_dir), "--out", str(tmp_path / "o"))
    assert rc == 0, err
    md = (tmp_path / "o" / "report.md").read_text()
    head = md.split("\n## ")[0]
    assert head.startswith("# pkvrt results report\n\nThe tables and plots of the 2 pkvrt results files")
    assert f"Regenerate: `pkvrt report {serving_dir} --out {tmp_path / 'o'}`" in head
    titles = [ln[3:] for ln in md.splitlines() if ln.startswith("## ")]
    links = re.findall(r"^- \[(.+)\]\(#(.+)\)$", head, re.MULTILINE)
    assert [anchor for _, anchor in links] == [report.anchor(t) for t in titles]
    assert [label for label, _ in links] == [t.split(" (")[0] for t in titles]
    assert report.anchor("Table 2: serving throughput against the baseline (mean ± std over seeds)") \
        == "table-2-serving-throughput-against-the-baseline-mean--std-over-seeds"


def test_work_labels_in_results_files_are_not_shown(capsys, tmp_path):
    d = tmp_path / "lab"
    write(d / "isolated.json", None, [dict(case="B1-32K", engine="flashinfer-tc", median_us=40.0),
                                      dict(case="B1-32K", engine="pkvrt-bucket", splits=8, median_us=38.0)],
          protocol="isolated graph-replay (session 12), L2 rotation per issue #4")
    write(d / "notes.json", "soak", [dict(case="soak", engine="pkvrt-adaptive", note="fixed in Session 9")])
    rc, _, err = run(capsys, "report", str(d), "--out", str(tmp_path / "o"))
    assert rc == 0, err
    md = (tmp_path / "o" / "report.md").read_text()
    assert not re.search(r"(session|issue)\s*#?\d", md, re.IGNORECASE)
    assert "protocol: isolated graph-replay, L2 rotation per." in md and "| fixed in |" in md


def test_rows_without_case_and_engine_in_a_file_of_no_kind_are_plain_rows(capsys, tmp_path):
    """benches/plan_cost.py writes rows keyed by shape only and no meta.kind: shown as they are
    (a row naming only one of case / engine is still an error, see the malformed-file test)."""
    d = tmp_path / "pc"
    write(d / "plan-cost.json", None, [dict(rows=1, tokens=1600, checked_us=19.35)])
    rc, _, err = run(capsys, "report", str(d), "--out", str(tmp_path / "o"))
    assert rc == 0, err
    md = (tmp_path / "o" / "report.md").read_text()
    assert "| rows | tokens | checked_us |\n| --- | --- | --- |\n| 1 | 1600 | 19.35 |" in md


def test_coverage_benchmarks_get_their_own_tables(capsys, tmp_path):
    """model-shapes (two files: the newer one's rows win), dropin and shared-pages results each
    render their section: ratios, geometric means, baseline paths, unavailable paths, and none
    of them in "Other results"."""
    d = tmp_path / "cov"
    step = dict(engine="pkvrt-device-plan-step", median_us=100.0, floor_us=80.0, status="ok")
    old = [dict(case="llama-3.2-3b-bimodal-B8-step0", model="llama-3.2-3b", **dict(step, median_us=999.0)),
           dict(case="llama-3.2-3b-bimodal-B8", engine="summary", model="llama-3.2-3b", trace="bimodal-B8",
                steps=1, pkvrt_us=999.0, baseline_us=150.0, ratio=0.15, pkvrt_floor_fraction=0.08,
                baseline_floor_fraction=0.53),
           dict(case="phi-3-mini", engine="pkvrt-device-plan-step", status="failed: measured again later")]
    new = [dict(case="llama-3.2-3b-probe", engine="flashinfer-cuda", kind="global", status="ok"),
           dict(case="phi-3-mini-probe", engine="flashinfer-tc", kind="global",
                status="unavailable: FlashInfer has no decode kernel for head_dim 96"),
           dict(case="llama-3.2-3b-bimodal-B8", engine="summary", model="llama-3.2-3b", trace="bimodal-B8",
                steps=1, pkvrt_us=100.0, baseline_us=150.0, ratio=1.5, pkvrt_floor_fraction=0.8,
                baseline_floor_fraction=0.53),
           dict(case="llama-3.2-3b-bimodal-B8-step0", engine="flashinfer-fastest-correct",
                model="llama-3.2-3b", median_us=150.0, paths={"global": "flashinfer-tc"}, floor_us=80.0),
           dict(case="phi-3-mini-bimodal-B8", engine="summary", model="phi-3-mini", trace="bimodal-B8",
                steps=1, pkvrt_us=90.0, baseline_us=None, ratio=None, pkvrt_floor_fraction=0.9,
                baseline_floor_fraction=None),
           dict(case="gemma-2-9b", engine="pkvrt-device-plan-step", status="failed: RuntimeError: x")]
    write(d / "model-shapes-a.json", "model-shapes", old, date="2026-12-05T01:00:00+00:00")
    write(d / "model-shapes-b.json", "model-shapes", new, date="2026-12-05T02:00:00+00:00")
    drop = []
    for i, (pk, fi) in enumerate(((100.0, 120.0), (100.0, 90.0))):
        case = f"sglang-bimodal-B8-step{i}"
        drop += [dict(case=case, style="sglang", engine="pkvrt", status="ok", median_us=pk, plan_host_us=50.0),
                 dict(case=case, style="sglang", engine="flashinfer-tc", status="ok", median_us=fi,
                      plan_host_us=150.0),
                 dict(case=case, style="sglang", engine="flashinfer-cuda", status="unavailable: Unsupported"),
                 dict(case=case, style="sglang", engine="ratio", baseline="flashinfer-tc", ratio=fi / pk)]
    write(d / "dropin.json", "dropin", drop)
    shared = [dict(case="8x(32K+128)", engine="pkvrt-shared", status="ok", median_us=2000.0,
                   floor_us=8213.0, floor_once_us=1055.0),
              dict(case="8x(32K+128)", engine="pkvrt-shared-device", status="ok", median_us=2500.0,
                   floor_us=8213.0, floor_once_us=1055.0),
              dict(case="8x(32K+128)", engine="flashinfer-tc", status="ok", median_us=3931.0,
                   floor_us=8213.0, floor_once_us=1055.0),
              dict(case="8x(32K+128)", engine="flashinfer-cascade", status="unavailable: no CUTLASS",
                   floor_us=8213.0, floor_once_us=1055.0),
              dict(case="8x(32K+128)", engine="ratio", baseline="flashinfer-tc", ratio=1.9655,
                   ratio_device=1.5724, ratio_plain=0.75, device_over_plain=0.477)]
    write(d / "shared-pages.json", "shared-pages", shared)
    rc, _, err = run(capsys, "report", str(d), "--out", str(tmp_path / "o"), "--no-plots")
    assert rc == 0, err
    md = (tmp_path / "o" / "report.md").read_text()
    ms = table_section(md, "Served models' shapes")
    assert cells(ms.split("Geometric mean")[0]) == [
        ["llama-3.2-3b", "bimodal-B8", "1", "100.0", "150.0", "1.500", "0.80", "0.53"],
        ["phi-3-mini", "bimodal-B8", "1", "90.0", "-", "none", "0.90", "-"]]
    assert "Geometric mean of the ratios: 1.500 over 1 (model, trace) pairs" in ms
    by_trace = ms[ms.index("By trace"):]
    assert cells(by_trace)[:2] == [["bimodal-B8", "1", "1.500", "0.80", "0.53", f"{1 / 0.53:.3f}"],
                                   ["all", "1", "1.500", "0.80", "0.53", f"{1 / 0.53:.3f}"]]
    assert "llama-3.2-3b (global: flashinfer-tc)" in ms
    assert "phi-3-mini global: flashinfer-tc: unavailable: FlashInfer has no decode kernel for head_dim 96" in ms
    assert "- gemma-2-9b: failed: RuntimeError: x" in ms and "measured again later" not in ms
    dr = table_section(md, "The drop-in wrapper")
    assert cells(dr) == [["sglang", "2", "2", "0.900", f"{math.sqrt(1.2 * 0.9):.3f}",
                          "pkvrt 50.0, flashinfer-tc 150.0"]]
    assert "flashinfer-cuda: unavailable: Unsupported" in dr
    sp = table_section(md, "Rows that share pages")
    assert cells(sp) == [["8x(32K+128)", "8213", "1055", "2000.0", "2500.0", "3931.0", "-", "flashinfer-tc",
                          "-", "1.966", "1.572", "0.750", "0.477"]]   # FAKE GPU: no rate, no ceiling
    assert "flashinfer-cascade on 8x(32K+128): unavailable: no CUTLASS" in sp
    assert "Other results" not in md


def test_shared_pages_ceiling_at_the_gpu_rate(tmp_path):
    """The ceiling column: the ratio row's own ``ceiling`` where the bench wrote it; for a file
    from before, the baseline over the 4.2 TB/s pages-once floor restated at the streaming rate
    of the shipped calibration file of the file's GPU; "-" for a GPU pkvrt has no file for."""
    from pkvrt.measure import coverage_results
    from pkvrt.policy.calibration import load_calibration
    from pkvrt.tools import report

    def step(case, base_us, ratio_extra):
        common = dict(case=case, floor_us=8213.0, floor_once_us=1055.0)
        return [dict(common, engine="pkvrt-shared", status="ok", median_us=2000.0),
                dict(common, engine="flashinfer-tc", status="ok", median_us=base_us),
                dict(case=case, engine="ratio", baseline="flashinfer-tc", ratio=base_us / 2000.0,
                     **ratio_extra)]

    d = tmp_path / "res"
    write(d / "new.json", "shared-pages", step("a", 4000.0, dict(ceiling=2.5)),
          gpu="NVIDIA H200", beta_gbps=4302.8, date="2026-12-07T02:00:00+00:00")
    write(d / "old.json", "shared-pages", step("b", 4000.0, {}),
          gpu="NVIDIA H100 80GB HBM3", date="2026-12-07T01:00:00+00:00")
    write(d / "unknown.json", "shared-pages", step("c", 4000.0, {}), date="2026-12-07T00:00:00+00:00")
    table = coverage_results.shared_pages_table(report.load_dir(d))
    by = {row[0]: row for row in cells(table)}
    header = [c.strip() for c in table.split("\n")[0].strip("|").split("|")]
    at = header.index("ceiling: baseline / pages once at the GPU's rate")
    root = pathlib.Path(__file__).resolve().parents[1]
    h100 = load_calibration(root / "calibration" / "nvidia-h100-80gb-hbm3.json").beta_gbps
    assert by["a"][at] == "2.50"
    assert by["b"][at] == f"{4000.0 / (1055.0 * 4200.0 / h100):.2f}"
    assert by["c"][at] == "-"
