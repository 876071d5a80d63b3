"""Calibration sweeps read back on a CPU: the time-model fit recovers the constants that made
synthetic sweeps, errors and suggested gates, pkvrt calibrate's fit and report, the bench script."""

from __future__ import annotations

import argparse
import json
import pathlib
import sys

import attrs
import numpy as np
import pytest

try:
    import tomllib
except ModuleNotFoundError:  # Python < 3.11
    import tomli as tomllib

from pkvrt import calibrate, sweeps
from pkvrt.calibration import RouteTime, TIME_KINDS, calibration_from_dict, calibration_to_dict, load_calibration
from pkvrt.costmodel import measured_us, route_groups
from pkvrt.registry import load_routes

REPO = pathlib.Path(__file__).resolve().parents[1]
CAL = load_calibration(REPO / "calibration" / "nvidia-h200.json")
REG = load_routes(REPO / "routes.toml")
REG_TEXT = (REPO / "routes.toml").read_text()

FUSED = RouteTime(0.98, 0.6, 0.09, 3.7)
TRUTH = {4: {"fused": FUSED, "workqueue": RouteTime(0.95, 0.9, 0.07, 2.1),
             "bucket": RouteTime(1.03, 0.6, 0.09, 2.1),        # fitted with the fused kind's shape
             "flashinfer": RouteTime(0.93, 1.1, 0.08, 5.1)},
         8: {"fused": RouteTime(0.89, 1.46, 0.08, 2.8), "flashinfer": RouteTime(1.0, 1.0, 0.1, 6.0)}}


def model_us(kind, seq, group, rt, cut=None):
    route = sweeps.route_of_kind(REG, kind)
    kw = dict(splits=route.splits, bucketing=route.bucketing, coarse_lengths=route.coarse_lengths) \
        if kind != "flashinfer" else {}
    cal = CAL.for_group(group)
    groups = route_groups(kind, seq, cal, longest_splits=cut, **kw, **sweeps.group_shape(group))
    return measured_us(groups, rt, cal, graphs=True)


def synthetic_rows(truth=TRUTH, cuts_every=5, kinds=("fused", "workqueue")) -> list[dict]:
    """Rows of a calibrate-sweeps file whose times are the measured model's with ``truth``:
    bucket sweeps at G 4, the partition kinds at every ``cuts_every``-th cut (and the planned
    one) at each G of ``truth``, FlashInfer (tensor-core; CUDA-core 30 % slower) on the same
    steps and at B1..B16 32K."""
    rows = []
    for case, kind, seq in calibrate.calibration_steps():
        seq = seq.astype(np.int64)
        if kind == "bucket":
            bounds = sweeps.route_of_kind(REG, "bucket").splits
            rows += [dict(case=case, engine="pkvrt-bucket", splits=s,
                          median_us=model_us("bucket", seq, 4, truth[4]["bucket"], s)) for s in bounds.candidates()]
            continue
        for g, fits in truth.items():
            name = case if g == 4 else f"{case}-G{g}"
            for k in kinds:
                if k not in fits:
                    continue
                route = sweeps.route_of_kind(REG, k)
                t = sweeps.Timed(kind=k, case=case, group=g, seq=seq, times={})
                cuts = set(route.splits.candidates()[::cuts_every]) | {sweeps.planned_cut(t, route, CAL.for_group(g))}
                rows += [dict(case=name, engine=f"pkvrt-{k}", group=g, splits=int(s),
                              median_us=model_us(k, seq, g, fits[k], int(s))) for s in sorted(cuts)]
            fi = model_us("flashinfer", seq, g, fits["flashinfer"])
            rows += [dict(case=name, engine="flashinfer-tc", group=g, median_us=fi),
                     dict(case=name, engine="flashinfer-cuda", group=g, median_us=1.3 * fi)]
    for a in (1, 2, 4, 8, 16):
        fi = model_us("flashinfer", np.full(a, 32768, dtype=np.int64), 4, truth[4]["flashinfer"])
        rows += [dict(case=f"B{a}-32K", engine="flashinfer-tc", median_us=fi)]
    return rows


@pytest.fixture(scope="module")
def rows():
    return synthetic_rows()


def test_case_names_carry_the_group_size():
    assert sweeps.case_group("bimodal-B8-seed20260622-G1") == ("bimodal-B8-seed20260622", 1)
    assert sweeps.case_group("B1-32K") == ("B1-32K", 4)
    assert sweeps.step_lengths("B4-32K", "flashinfer", calibrate.SEED).tolist() == [32768] * 4
    assert sweeps.step_lengths("B1-8K", "bucket", calibrate.SEED).tolist() == [8192]
    assert sweeps.step_lengths("nope", "fused", calibrate.SEED) is None


def test_read_rows_takes_flashinfers_faster_path_and_the_median_of_repeats():
    rows = [dict(case="B1-32K", engine="flashinfer-tc", median_us=44.0),
            dict(case="B1-32K", engine="flashinfer-tc", median_us=46.0),
            dict(case="B1-32K", engine="flashinfer-cuda", median_us=52.0),
            dict(case="B1-32K-G8", engine="pkvrt-fused", group=8, splits=16, median_us=30.0),
            dict(case="B1-32K", engine="pkvrt-other", median_us=1.0),
            dict(case="unknown-step", engine="pkvrt-fused", splits=1, median_us=1.0)]
    timed = sweeps.read_rows(rows)
    assert [(t.kind, t.case, t.group, t.times) for t in timed] == [
        ("flashinfer", "B1-32K", 4, {0: 45.0}), ("fused", "B1-32K", 8, {16: 30.0})]


def test_fit_recovers_the_constants_that_made_the_sweeps(rows):
    fits = sweeps.fit_time_model(sweeps.read_rows(rows), CAL, REG)
    assert set(fits) == {4, 8} and set(fits[4]) == set(TIME_KINDS) and set(fits[8]) == {"fused", "flashinfer"}
    for g, kinds in fits.items():
        for k, rt in kinds.items():
            assert attrs.astuple(rt) == pytest.approx(attrs.astuple(TRUTH[g][k]), abs=1e-6), (g, k)


def test_errors_at_the_planned_cut_vanish_on_the_models_own_times(rows):
    timed = sweeps.read_rows(rows)
    errs = sweeps.error_rows(timed, CAL, REG, sweeps.fit_time_model(timed, CAL, REG))
    assert {(r.group, r.route) for r in errs} == {(4, "pkv_bucket"), (4, "pkv_workqueue"), (4, "pkv_fused"),
                                                   (4, "flashinfer"), (8, "pkv_fused"), (8, "flashinfer")}
    assert max(abs(r.error) for r in errs) < 1e-6
    text = sweeps.format_errors(errs)
    assert "G 4 pkv_fused: max |error| 0.0 % over 10 steps (roofline" in text
    assert text.splitlines()[0].split()[:4] == ["G", "route", "case", "cut"]


def test_suggested_gates_are_valid_routes_toml_and_never_applied(rows, tmp_path):
    text = sweeps.suggest_gates(sweeps.read_rows(rows), CAL, REG, header="test")
    assert "NOT applied" in text and (REPO / "routes.toml").read_text() == REG_TEXT
    doc = tomllib.loads(text)
    assert set(doc["routes"]) <= {"pkv_bucket", "pkv_workqueue", "pkv_fused"}
    for name, tables in doc["routes"].items():
        gates = tables["gates"]
        assert set(gates) == {"group_sizes", "min_context", "min_active", "max_active"}
        assert gates["min_active"] <= gates["max_active"] and set(gates["group_sizes"]) <= {4, 8}
    edited = tmp_path / "routes.toml"
    edited.write_text(REG_TEXT + "\n" + text)
    reg = load_routes(edited)                  # the snippet is what routes.toml accepts
    for name, tables in doc["routes"].items():
        assert reg.route(name).gates.min_context == tables["gates"]["min_context"]


def test_gates_follow_the_measured_wins():
    """Bucket beats FlashInfer (by its 1.05 margin) at B1 8K, not at B1 32K; B1 64K has no
    FlashInfer time: min_context 8192, one active row, the 32K loss named."""
    rows = [dict(case="B1-8K", engine="pkvrt-bucket", splits=16, median_us=10.0),
            dict(case="B1-32K", engine="pkvrt-bucket", splits=16, median_us=44.0),
            dict(case="B1-64K", engine="pkvrt-bucket", splits=16, median_us=70.0),
            dict(case="B1-8K", engine="flashinfer-tc", median_us=18.0),
            dict(case="B1-32K", engine="flashinfer-tc", median_us=45.0)]
    text = sweeps.suggest_gates(sweeps.read_rows(rows), attrs.evolve(CAL, splits=attrs.evolve(
        CAL.splits, bucket_ctas_per_sm=0.97)), REG)
    assert "#   G 4 B1-8K: 1.80x won" in text and "#   G 4 B1-32K: 1.02x lost" in text
    assert tomllib.loads(text)["routes"]["pkv_bucket"]["gates"] == dict(
        group_sizes=[4], min_context=8192, min_active=1, max_active=1)
    assert "# pkv_workqueue, margin 1.05:\n#   no calibration step timed beside FlashInfer" in text
    assert "#   no verdict (no FlashInfer time, or the planned cut not timed): B1-64K/G4" in text


def test_calibrate_adds_the_time_model_and_reports(rows):
    cal = calibrate.add_time_model(CAL, rows, REG)
    assert cal == calibration_from_dict(calibration_to_dict(cal))
    assert [k for k, _ in cal.time_model] == list(TIME_KINDS)
    assert [g for g, _ in cal.time_model_by_group] == [8]
    assert cal.route_time("fused") == FUSED and "time_model: sweeps.fit_time_model" in cal.provenance
    errors, gates = calibrate.report(rows, cal, REG, header="H200")
    assert "max |error| 0.0 %" in errors and "(H200)" in gates.splitlines()[0]


def test_calibrate_gives_an_untimed_workqueue_kind_the_fused_constants():
    rows = synthetic_rows(kinds=("fused",), cuts_every=9)
    cal = calibrate.add_time_model(CAL, rows, REG)
    assert cal.route_time("workqueue") == cal.route_time("fused")
    assert "No workqueue route was timed" in cal.provenance


def test_calibrate_has_the_suggest_routes_option():
    parser = argparse.ArgumentParser()
    calibrate.add_arguments(parser)
    assert parser.parse_args(["--suggest-routes", "x.toml"]).suggest_routes == "x.toml"
    assert parser.parse_args([]).suggest_routes is None


def test_bench_script_refits_and_prints_the_errors(rows, tmp_path, capsys):
    sys.path.insert(0, str(REPO / "benches"))
    try:
        import cost_model_error
    finally:
        sys.path.pop(0)
    f = tmp_path / "sweeps.json"
    f.write_text(json.dumps({"meta": {"gpu": "NVIDIA H200", "seeds": [calibrate.SEED]}, "rows": rows}))
    cal_path = tmp_path / "cal.json"
    cal_path.write_text(json.dumps(calibration_to_dict(attrs.evolve(CAL, time_model=(), time_model_by_group=()))))
    out = tmp_path / "suggest.toml"
    assert cost_model_error.main([str(f), "--calibration", str(cal_path), "--keep-partition",
                                  "--suggest-routes", str(out)]) == 0
    text = capsys.readouterr().out
    assert "G 4 pkv_workqueue: max |error| 0.0 %" in text and "G 8 flashinfer: max |error| 0.0 %" in text
    assert out.read_text().startswith("# Suggested")
    assert cost_model_error.main([str(f), "--calibration", str(cal_path), "--file-constants"]) == 2
    assert "has no time_model" in capsys.readouterr().err
