"""Calibration sweeps read back on a CPU: the time-model fit recovers the constants that made
synthetic sweeps, errors and suggested gates, pkvrt calibrate's fit and report, the bench script."""

from __future__ import annotations

import argparse
import json
import pathlib
import sys
import types

import attrs
import numpy as np
import pytest

try:
    import tomllib
except ModuleNotFoundError:  # Python < 3.11
    import tomli as tomllib

from pkvrt.policy import calibration as calib
from pkvrt.policy.calibration import RouteTime, TIME_KINDS, calibration_from_dict, calibration_to_dict, load_calibration
from pkvrt.policy.costmodel import measured_us, route_groups
from pkvrt.policy.registry import load_routes
from pkvrt.tools import calibrate, sweeps

REPO = pathlib.Path(__file__).resolve().parents[1]
# The shipped H200 file as it was before its FP8 section was measured (the tests add their own).
CAL = attrs.evolve(load_calibration(REPO / "calibration" / "nvidia-h200.json"), by_kv_dtype=())
REG = load_routes(REPO / "routes.toml")
REG_TEXT = (REPO / "routes.toml").read_text()

FUSED = RouteTime(0.98, 0.6, 0.09, 3.7)
TRUTH = {4: {"fused": FUSED, "workqueue": RouteTime(0.95, 0.9, 0.07, 2.1),
             "bucket": RouteTime(1.03, 0.6, 0.09, 2.1),        # fitted with the fused kind's shape
             "flashinfer": RouteTime(0.93, 1.1, 0.08, 5.1)},
         8: {"fused": RouteTime(0.89, 1.46, 0.08, 2.8), "flashinfer": RouteTime(1.0, 1.0, 0.1, 6.0)}}


def model_us(kind, seq, group, rt, cut=None, cal=CAL, kv_dtype="float16"):
    route = sweeps.route_of_kind(REG, kind)
    kw = dict(splits=route.splits, bucketing=route.bucketing, coarse_lengths=route.coarse_lengths) \
        if kind != "flashinfer" else {}
    cal = cal.for_kv_dtype(kv_dtype).for_group(group)
    groups = route_groups(kind, seq, cal, longest_splits=cut, **kw, **sweeps.group_shape(group, kv_dtype))
    return measured_us(groups, rt, cal, graphs=True)


def synthetic_rows(truth=TRUTH, cuts_every=5, kinds=("fused", "workqueue"), cal=CAL,
                   kv_dtype="float16") -> list[dict]:
    """Rows of a calibrate-sweeps file whose times are the measured model's with ``truth``
    (and the partition constants of ``cal``'s view of ``kv_dtype``): bucket sweeps at G 4, the
    partition kinds at every ``cuts_every``-th cut (and the planned one) at each G of
    ``truth``, FlashInfer (tensor-core; CUDA-core 30 % slower) on the same steps and at B1..B16
    32K. FP8 rows carry their ``kv_dtype`` and have no FlashInfer (as ``pkvrt calibrate
    --kv-dtype fp8`` writes them); fp16 rows have no kv_dtype (as older files)."""
    fp8 = {"kv_dtype": kv_dtype} if kv_dtype != "float16" else {}
    rows = []
    for case, kind, seq in calibrate.calibration_steps():
        seq = seq.astype(np.int64)
        if kind == "bucket":
            bounds = sweeps.route_of_kind(REG, "bucket").splits
            rows += [dict(case=case, engine="pkvrt-bucket", splits=s, **fp8,
                          median_us=model_us("bucket", seq, 4, truth[4]["bucket"], s, cal, kv_dtype))
                     for s in bounds.candidates()]
            continue
        for g, fits in truth.items():
            name = case if g == 4 else f"{case}-G{g}"
            for k in kinds:
                if k not in fits:
                    continue
                route = sweeps.route_of_kind(REG, k)
                t = sweeps.Timed(kind=k, case=case, group=g, seq=seq, times={}, kv_dtype=kv_dtype)
                cuts = set(route.splits.candidates()[::cuts_every]) | {sweeps.planned_cut(t, route, cal)}
                rows += [dict(case=name, engine=f"pkvrt-{k}", group=g, splits=int(s), **fp8,
                              median_us=model_us(k, seq, g, fits[k], int(s), cal, kv_dtype)) for s in sorted(cuts)]
            if fp8:
                continue
            fi = model_us("flashinfer", seq, g, fits["flashinfer"])
            rows += [dict(case=name, engine="flashinfer-tc", group=g, median_us=fi),
                     dict(case=name, engine="flashinfer-cuda", group=g, median_us=1.3 * fi)]
    for a in (1, 2, 4, 8, 16) if not fp8 else ():
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
    assert "G 4 pkv_fused: max |error| 0.0 % over 11 steps (roofline" in text
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
    cost_model_error = _bench_script()
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


def test_bench_script_write_keeps_the_notes_that_are_still_true(rows, tmp_path, capsys):
    """--write appends a note of what it refitted. A full refit (partition + time model) drops
    the notes of earlier refits (it redid all of it); --keep-partition keeps them (the partition
    constants it keeps came from them); text after a note survives either way."""
    cost_model_error = _bench_script()
    f = tmp_path / "sweeps.json"
    f.write_text(json.dumps({"meta": {"gpu": "NVIDIA H200", "seeds": [calibrate.SEED]}, "rows": rows}))
    old = (" Refitted offline on 2026-11-30: the balanced partition's constants and the time model, by x;"
           " every other constant as measured.")
    cal_path = tmp_path / "cal.json"
    cal_path.write_text(json.dumps(calibration_to_dict(attrs.evolve(CAL, provenance="Measured." + old + " Tail."))))
    for keep, expect_old in ((["--keep-partition"], True), ([], False)):
        out = tmp_path / f"out{len(keep)}.json"
        assert cost_model_error.main([str(f), "--calibration", str(cal_path), *keep, "--write", str(out)]) == 0
        text = load_calibration(out).provenance
        assert text.startswith("Measured.") and " Tail." in text and (old in text) == expect_old, text
        assert text.count(" Refitted offline on ") == 1 + expect_old
    capsys.readouterr()


def test_partition_fits_skip_a_kind_routes_toml_lacks(rows, tmp_path):
    """Sweeps of a partition kind whose route the routes file lacks are left out of the fit
    (they cannot be planned), not an AttributeError."""
    text = pathlib.Path(calibrate.__file__).resolve().parents[2].joinpath("routes.toml").read_text()
    start = text.index("[routes.pkv_workqueue]")
    end = text.index("[routes.pkv_fused]")
    no_wq = tmp_path / "routes.toml"
    no_wq.write_text((text[:start] + text[end:]).replace('small_route = "pkv_workqueue"', 'small_route = "pkv_fused"')
                     .replace('large_group_route = "pkv_workqueue"', 'large_group_route = "pkv_fused"'))
    reg = load_routes(no_wq)
    timed = sweeps.read_rows(rows)
    assert {t.kind for t in timed} >= {"workqueue", "fused"}
    points, regrets = sweeps.fit_partitions(timed, CAL, reg)
    assert points and all(k.endswith("[fused]") for r in regrets.values() for k in r)


# ----------------------------------------------------------------------------- FP8 sweeps

FP8 = "float8_e4m3fn"
FP8_TRUTH = {4: {"fused": RouteTime(0.71, 0.45, 0.12, 2.2), "workqueue": RouteTime(0.74, 0.8, 0.06, 1.9),
                 "bucket": RouteTime(0.81, 0.45, 0.12, 1.7)},   # bucket: the fused kind's shape
             8: {"fused": RouteTime(0.66, 1.2, 0.05, 2.5)}}
FP8_SECTION = calib.KvDtypeSection(
    splits=(("bucket_ctas_per_sm", 1.5), ("workqueue_ctas_per_sm", 3.0), ("min_split_tokens", 64),
            ("cta_overhead_tiles", 2.5), ("co_resident_slowdown", 1.25)),
    date="2026-12-08", command="pkvrt calibrate --kv-dtype fp8", provenance="Measured (test).")
CAL_FP8 = calib.with_kv_dtype_section(CAL, FP8, FP8_SECTION)   # the H200 file + FP8 partition constants


@pytest.fixture(scope="module")
def fp8_rows():
    return synthetic_rows(FP8_TRUTH, cal=CAL_FP8, kv_dtype=FP8)


def test_rows_are_read_by_kv_dtype(rows, fp8_rows):
    both = rows + fp8_rows
    fp16, fp8 = sweeps.read_rows(both), sweeps.read_rows(both, kv_dtype=FP8)
    assert len(fp16) == len(sweeps.read_rows(rows)) and {t.kv_dtype for t in fp16} == {"float16"}
    assert len(fp8) == len(sweeps.read_rows(fp8_rows, kv_dtype=FP8)) and {t.kind for t in fp8} == {
        "bucket", "fused", "workqueue"} and {t.kv_dtype for t in fp8} == {FP8}
    assert sweeps.group_shape(4, FP8)["dtype_bytes"] == 1 and sweeps.group_shape(4)["dtype_bytes"] == 2
    b1 = [t for t in fp8 if t.kind == "fused" and t.case == "B1-32K" and t.group == 4]
    recs = sweeps.fit_records(b1, CAL_FP8, REG, "fused", 4)
    assert {r["kv_bytes"] for r in recs} == {32768 * 2 * 8 * 128 * 1}
    # the planned cut (its record's splits) weighs PLANNED_WEIGHT, every other near-best cut 1
    planned = sweeps.planned_cut(b1[0], sweeps.route_of_kind(REG, "fused"), b1[0].view(CAL_FP8))
    assert sorted(r["weight"] for r in recs) == [1.0] * (len(recs) - 1) + [sweeps.PLANNED_WEIGHT]
    assert [r["splits"] for r in recs if r["weight"] > 1] == [planned]
    with pytest.raises(ValueError, match="kv_dtype 'fp8'"):
        sweeps.read_rows(both, kv_dtype="fp8")


def test_fp8_fit_goes_to_the_section_and_leaves_the_fp16_file_alone(fp8_rows):
    """What `pkvrt calibrate --kv-dtype fp8` does after timing: the partition constants into the
    section of the base file, then the time model (1 byte per K/V element) beside them."""
    cal = calibrate.add_time_model(CAL_FP8, fp8_rows, REG, FP8)
    sec = dict(cal.by_kv_dtype)[FP8]
    assert dict(sec.time_model) == FP8_TRUTH[4] and dict(sec.time_model_by_group) == {8: (("fused", FP8_TRUTH[8]["fused"]),)}
    assert sec.splits == FP8_SECTION.splits and "FlashInfer not timed" in sec.provenance
    doc = calibration_to_dict(cal)
    del doc["by_kv_dtype"]
    assert doc == calibration_to_dict(CAL)                      # the fp16 constants untouched
    view = cal.for_kv_dtype(FP8)
    assert view.route_time("flashinfer") == CAL.route_time("flashinfer") and view.route_time("fused") == FP8_TRUTH[4]["fused"]
    errors, gates = calibrate.report(fp8_rows, cal, REG, kv_dtype=FP8)
    assert "G 4 pkv_fused: max |error| 0.0 %" in errors and "G 8 pkv_fused: max |error| 0.0 %" in errors
    assert "flashinfer" not in errors and gates == ""


def test_fp8_partition_fit_goes_to_the_section():
    points = {4: {"workqueue_ctas_per_sm": 3.0, "co_resident_slowdown": 1.5, "cta_overhead_tiles": 1.0,
                  "min_split_tokens": 128},
              8: {"workqueue_ctas_per_sm": 3.0, "co_resident_slowdown": 2.0, "cta_overhead_tiles": 4.0,
                  "min_split_tokens": 32}}
    cal = sweeps.with_partitions(CAL_FP8, points, FP8)
    sec = dict(cal.by_kv_dtype)[FP8]
    assert dict(sec.splits) == {"bucket_ctas_per_sm": 1.5, **points[4]}     # bucket kept
    assert dict(dict(sec.splits_by_group)[8]) == points[8]
    assert cal.splits == CAL.splits
    assert cal.for_kv_dtype(FP8).for_group(8).splits.cta_overhead_tiles == 4.0


def _bench_script():
    sys.path.insert(0, str(REPO / "benches"))
    try:
        import cost_model_error
    finally:
        sys.path.pop(0)
    return cost_model_error


def _fp8_sweeps(tmp_path, rows, occupancy=None) -> pathlib.Path:
    f = tmp_path / "sweeps-fp8.json"
    meta = {"gpu": "NVIDIA H200", "seeds": [calibrate.SEED], "kv_dtype": FP8, "command": "pkvrt calibrate --kv-dtype fp8"}
    f.write_text(json.dumps({"meta": meta | ({"occupancy": occupancy} if occupancy else {}), "rows": rows}))
    return f


def _saved(tmp_path, cal, name="cal.json") -> pathlib.Path:
    path = tmp_path / name
    path.write_text(json.dumps(calibration_to_dict(cal)))
    return path


def test_bench_script_refits_the_fp8_section_offline(fp8_rows, tmp_path, capsys):
    """benches/cost_model_error.py on FP8 sweeps: the section's time model (a file with FP8
    partition constants, kept), every fp16 constant as it was."""
    script = _bench_script()
    sweeps_path = _fp8_sweeps(tmp_path, fp8_rows)
    out = tmp_path / "out.json"
    assert script.main([str(sweeps_path), "--calibration", str(_saved(tmp_path, CAL_FP8)), "--keep-partition",
                        "--write", str(out)]) == 0
    text = capsys.readouterr().out
    assert "with float8_e4m3fn K/V" in text and "G 4 pkv_fused: max |error| 0.0 %" in text
    assert "# Suggested" not in text and not any(line.split()[1:2] == ["flashinfer"] for line in text.splitlines())
    got = load_calibration(out)
    sec = dict(got.by_kv_dtype)[FP8]
    assert dict(sec.time_model) == FP8_TRUTH[4] and sec.splits == FP8_SECTION.splits
    assert "from sweeps-fp8.json" in sec.provenance and got.provenance == CAL.provenance
    assert calibration_to_dict(attrs.evolve(got, by_kv_dtype=())) == calibration_to_dict(CAL)


def test_bench_script_creates_an_fp8_section_and_takes_the_recorded_occupancy(tmp_path, capsys):
    """A file without an FP8 section: the time model fitted under the fallback view goes to a
    new section (valid: command from the sweeps); the partition refit uses the e4m3 kernel's
    occupancy that the sweeps recorded (3 here, not the file's 2)."""
    script = _bench_script()
    rows = synthetic_rows(FP8_TRUTH, cuts_every=9, cal=CAL, kv_dtype=FP8)   # the fallback view: fp16 constants
    base = _saved(tmp_path, CAL)
    out = tmp_path / "out.json"
    assert script.main([str(_fp8_sweeps(tmp_path, rows)), "--calibration", str(base), "--keep-partition",
                        "--write", str(out)]) == 0
    sec = dict(load_calibration(out).by_kv_dtype)[FP8]
    assert dict(sec.time_model)["fused"] == FP8_TRUTH[4]["fused"] and sec.splits == ()
    assert sec.command == "pkvrt calibrate --kv-dtype fp8" and "Fitted from the float8_e4m3fn sweeps" in sec.provenance
    assert script.main([str(_fp8_sweeps(tmp_path, rows, occupancy={"4": 3, "8": 3})), "--calibration", str(base),
                        "--write", str(out)]) == 0
    sec = dict(load_calibration(out).by_kv_dtype)[FP8]
    assert dict(sec.splits)["workqueue_ctas_per_sm"] == 3.0 and dict(sec.splits_by_group)[8][0] == (
        "workqueue_ctas_per_sm", 3.0)
    assert load_calibration(out).splits == CAL.splits
    capsys.readouterr()
    assert script.main([str(_fp8_sweeps(tmp_path, rows)), "--calibration", str(base), "--file-constants"]) == 2
    assert "has no float8_e4m3fn time_model" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        script.main([str(_fp8_sweeps(tmp_path, rows)), "--calibration", str(base), "--suggest-routes", "x.toml"])


def fp8_rows_of(raw_path) -> list:
    """The rows a ``--raw`` file of ``pkvrt calibrate`` holds."""
    return json.loads(pathlib.Path(raw_path).read_text())["rows"]


def _an_h200(monkeypatch, *, flashinfer: str, resident: int) -> None:
    """pkvrt calibrate's view of the machine, on a CPU: an available H200 (132 SMs, 50 MiB of
    L2), FlashInfer as ``flashinfer`` says, and the decode kernel at ``resident`` CTAs per SM."""
    import torch

    from pkvrt.launch import _driver
    from pkvrt.measure import results

    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda *a: "NVIDIA H200")
    monkeypatch.setattr(torch.cuda, "get_device_properties", lambda *a: types.SimpleNamespace(
        name="NVIDIA H200", multi_processor_count=132, L2_cache_size=50 * 2**20))
    monkeypatch.setattr(_driver, "available", lambda: None)
    monkeypatch.setattr(results, "environment", lambda: {"gpu": "NVIDIA H200", "flashinfer": flashinfer})
    monkeypatch.setattr(calibrate, "decode_occupancy", lambda family, g, kv, head_dim=128: resident)


@pytest.fixture
def fake_gpu(monkeypatch, fp8_rows):
    """`pkvrt calibrate --kv-dtype fp8` on a CPU: an H200 that is available, whose timed steps
    are ``fp8_rows`` and whose e4m3 decode kernel runs 3 CTAs per SM. Yields the calls of
    time_steps (kv_dtype, the planning base)."""
    _an_h200(monkeypatch, flashinfer="unavailable: test", resident=3)
    calls = []

    def time_steps(args, reg, base, *, kv_dtype, repeats, t_start, max_waves, head_dim=128, flashinfer=None):
        calls.append((kv_dtype, base, max_waves) if head_dim == 128 else (kv_dtype, base, max_waves, head_dim,
                                                                          flashinfer))
        timed = sweeps.read_rows(fp8_rows, kv_dtype=FP8)   # the sweeps' times (a head-dim run reuses them)
        fit_recs = [dict(case=t.case, route="bucket", rows=1, context=int(t.seq.max()), splits=s, us=us,
                         kv_bytes=int(t.seq.sum()) * 2048, ctas=8 * s) for t in timed if t.kind == "bucket"
                    for s, us in t.times.items()]
        cases = {g: sweeps.partition_cases([t for t in timed if t.kind in sweeps.PARTITION_KINDS and t.group == g],
                                           reg) for g in args.groups}
        return fit_recs, fp8_rows, cases
    monkeypatch.setattr(calibrate, "time_steps", time_steps)
    return calls


def test_calibrate_fp8_adds_its_section_to_the_base_file(fake_gpu, tmp_path, capsys):
    """The whole FP8 command with the timing faked: the base file's fp16 constants are written
    unchanged beside the new section (FP8 bucket split point, partition constants at G 4 and 8
    with the e4m3 occupancy, time model of pkvrt's kinds), --raw records the KV dtype, and a
    second run replaces the section."""
    from pkvrt.tools import cli

    out, raw = tmp_path / "nvidia-h200.json", tmp_path / "sweeps.json"
    argv = ["calibrate", "--kv-dtype", "fp8", "--groups", "4,8", "--base", str(_saved(tmp_path, CAL, "base.json")),
            "--out", str(out), "--raw", str(raw)]
    assert cli.main(argv) == 0
    text = capsys.readouterr().out
    assert f"wrote {out} (its by_kv_dtype.float8_e4m3fn section" in text and "G 4 pkv_fused: max |error|" in text
    (kv, base, waves), = fake_gpu
    assert waves == CAL.splits.max_waves    # the cuts are timed in the grid of the file's max_waves
    assert kv == FP8 and base.time_model == () and base.by_kv_dtype == () and base.beta_gbps == CAL.beta_gbps
    assert base.l2_bytes == 50 * 2**20      # the K/V copies rotate past the device's L2
    got = load_calibration(out)
    assert calibration_to_dict(attrs.evolve(got, by_kv_dtype=())) == calibration_to_dict(CAL)
    sec = dict(got.by_kv_dtype)[FP8]
    assert [k for k, _ in sec.splits] == ["bucket_ctas_per_sm", "workqueue_ctas_per_sm", "min_split_tokens",
                                          "cta_overhead_tiles", "co_resident_slowdown", "wave_room_slots",
                                          "wave_room_tiles", "wave_room_chunk_tiles"]   # no max_waves: the file's
    assert dict(sec.splits)["workqueue_ctas_per_sm"] == 3.0 and [g for g, _ in sec.splits_by_group] == [8]
    assert [k for k, _ in sec.time_model] == ["bucket", "workqueue", "fused"]
    assert [(g, [k for k, _ in kinds]) for g, kinds in sec.time_model_by_group] == [(8, ["fused"])]
    assert "float8_e4m3fn K/V caches" in sec.provenance and "FlashInfer is not timed" in sec.provenance
    n = {k: sum(t.kind == k and t.group == 4 for t in sweeps.read_rows(fp8_rows_of(raw), kv_dtype=FP8))
         for k in ("fused", "workqueue")}
    assert n["fused"] and n["workqueue"]   # the fit saw both partition routes' sweeps, named by kind
    assert f"fit_partition over {sum(n.values())} sweeps ({n['fused']} fused, {n['workqueue']} workqueue)" in sec.provenance
    assert "[workqueue] " in sec.provenance and "[fused] " in sec.provenance   # the regret of each
    meta = json.loads(raw.read_text())["meta"]
    assert (meta["kv_dtype"], meta["occupancy"], meta["fp8_scales"]) == (FP8, {"4": 3, "8": 3}, "unit")
    assert cli.main([*argv[:-4], "--out", str(out), "--max-waves", "2"]) == 0     # base: the --out file now
    again = dict(load_calibration(out).by_kv_dtype)[FP8]
    assert fake_gpu[-1][2] == 2      # --max-waves sizes the grid the cuts were timed in
    assert dict(again.splits)["max_waves"] == 2 and len(load_calibration(out).by_kv_dtype) == 1
    assert load_calibration(out).splits == CAL.splits


def test_calibrate_head_dim_adds_its_section_to_the_base_file(fake_gpu, tmp_path, capsys):
    """`pkvrt calibrate --head-dim 256` with the timing faked: the steps are timed at D 256
    without FlashInfer, the base file's constants are written unchanged beside the by_head_dim
    section (bucket split point, partition constants at G 4 and 8 with the kernel's occupancy at
    D 256), --raw records the head dim, and a Router at D 256 plans with the section."""
    from pkvrt.policy.router import Router
    from pkvrt.tools import cli

    out, raw = tmp_path / "nvidia-h200.json", tmp_path / "sweeps.json"
    argv = ["calibrate", "--head-dim", "256", "--groups", "4,8", "--base",
            str(_saved(tmp_path, CAL, "base.json")), "--out", str(out), "--raw", str(raw)]
    assert cli.main(argv) == 0
    text = capsys.readouterr().out
    assert f"wrote {out} (its by_head_dim.256 section" in text
    assert "measured vs predicted" not in text and "Suggested" not in text   # no time model at D 256
    assert CAL.time_model   # (the base has one: the report was skipped, not empty)
    (kv, base, waves, head_dim, flashinfer), = fake_gpu
    assert (kv, head_dim, flashinfer, waves) == ("float16", 256, False, CAL.splits.max_waves)
    assert base.by_head_dim == () and base.time_model == ()
    got = load_calibration(out)
    assert calibration_to_dict(attrs.evolve(got, by_head_dim=())) == calibration_to_dict(CAL)
    sec = dict(got.by_head_dim)[256]
    assert dict(sec.splits)["workqueue_ctas_per_sm"] == 3.0 and "bucket_ctas_per_sm" in dict(sec.splits)
    assert [g for g, _ in sec.splits_by_group] == [8] and sec.time_model == ()
    assert "--head-dim 256" in sec.provenance and "Not measured at this head dim" in sec.provenance
    assert {r["head_dim"] for r in fp8_rows_of(raw)} == {256}
    assert json.loads(raw.read_text())["meta"]["head_dim"] == 256
    r = Router(load_routes(), got, num_qo_heads=16, num_kv_heads=8, head_dim=256, page_size=16)
    assert r.cal.splits.workqueue_ctas_per_sm == 3.0 and r.cal.head_dim == 256


def test_calibrate_fp8_refuses_another_gpus_base_before_timing(fake_gpu, tmp_path, capsys):
    from pkvrt.tools import cli

    out = tmp_path / "x.json"
    rc = cli.main(["calibrate", "--kv-dtype", "fp8", "--base", str(REPO / "calibration" / "rtx3060-seed.json"),
                   "--out", str(out)])
    assert rc == 2 and "not of this GPU 'NVIDIA H200'" in capsys.readouterr().err
    assert fake_gpu == [] and not out.exists()


GROUP_TRUTH = {g: {"fused": RouteTime(0.9, 1.3, 0.08, 2.9), "workqueue": RouteTime(0.92, 1.5, 0.07, 2.3),
                   "flashinfer": RouteTime(1.0, 1.0, 0.1, 6.0)} for g in (3, 16)}


@pytest.fixture
def fake_gpu_groups(monkeypatch):
    """`pkvrt calibrate --add-groups` on a CPU: an available H200 whose timed steps at each G are
    the measured model's with GROUP_TRUTH. Yields the calls of time_steps (groups, buckets)."""
    _an_h200(monkeypatch, flashinfer="0.7.2", resident=2)
    rows = [r for r in synthetic_rows({4: TRUTH[4], **GROUP_TRUTH}) if r.get("group") in GROUP_TRUTH]
    calls = []

    def time_steps(args, reg, base, *, kv_dtype, repeats, t_start, max_waves, head_dim=128, flashinfer=None,
                   buckets=True):
        calls.append((tuple(args.groups), buckets, max_waves, base.time_model))
        timed = sweeps.read_rows(rows)
        cases = {g: sweeps.partition_cases([t for t in timed if t.kind in sweeps.PARTITION_KINDS and t.group == g],
                                           reg) for g in args.groups}
        return [], [r for r in rows if r["group"] in args.groups], cases
    monkeypatch.setattr(calibrate, "time_steps", time_steps)
    return calls


def test_calibrate_add_groups_lays_new_group_sizes_over_the_file(fake_gpu_groups, tmp_path, capsys):
    """`pkvrt calibrate --add-groups 3,16` with the timing faked: only G 3 and 16 are timed (no
    bucket sweep, the file's max_waves), their splits.by_group and time_model.by_group entries
    join the file's (G 1 and 8 kept), and every other constant, section and host_time is the
    base file's, byte for byte; a Router at G 16 then plans with G 16's own constants."""
    from pkvrt.policy.router import Router
    from pkvrt.tools import cli

    # the shipped file as it was before its other group sizes were calibrated: G 1, 4 and 8
    doc = calibration_to_dict(load_calibration(REPO / "calibration" / "nvidia-h200.json"))
    for section in ("splits", "time_model"):
        doc[section]["by_group"] = {k: v for k, v in doc[section]["by_group"].items() if k in ("1", "8")}
    shipped = calibration_from_dict(doc)
    base, out, raw = _saved(tmp_path, shipped, "base.json"), tmp_path / "nvidia-h200.json", tmp_path / "raw.json"
    assert cli.main(["calibrate", "--add-groups", "3,16", "--base", str(base), "--out", str(out),
                     "--raw", str(raw)]) == 0
    text = capsys.readouterr().out
    assert f"wrote {out} (its G 3, 16 entries of splits.by_group and time_model.by_group" in text
    (groups, buckets, waves, timing_model), = fake_gpu_groups
    assert groups == (3, 16) and buckets is False and waves == shipped.splits.max_waves and timing_model == ()
    got = load_calibration(out)
    keep = lambda c: {k: v for k, v in calibration_to_dict(c).items() if k not in ("splits", "time_model", "provenance", "source")}  # noqa: E731
    assert keep(got) == keep(shipped)                      # sections, host_time, beta, FlashInfer's: the file's
    want_split = {k: v for k, v in calibration_to_dict(shipped)["splits"].items() if k != "by_group"}
    assert {k: v for k, v in calibration_to_dict(got)["splits"].items() if k != "by_group"} == want_split
    assert [g for g, _ in got.splits.by_group] == [1, 3, 8, 16]
    assert dict(got.splits.by_group)[8] == dict(shipped.splits.by_group)[8]
    assert got.time_model == shipped.time_model
    tm = dict(got.time_model_by_group)
    assert sorted(tm) == [1, 3, 8, 16] and tm[8] == dict(shipped.time_model_by_group)[8]
    assert {k for k, _ in tm[16]} == {"fused", "workqueue", "flashinfer"}
    assert dict(tm[16])["fused"].read_scale == pytest.approx(0.9, abs=0.05)   # the fit recovers the truth
    assert "--add-groups" in got.provenance and got.provenance.startswith(shipped.provenance)
    assert json.loads(raw.read_text())["meta"]["added_groups"] == [3, 16]
    assert got.calibrated_group(16) == 16 and shipped.calibrated_group(16) == 8
    r = Router(load_routes(), got, num_qo_heads=64, num_kv_heads=4, head_dim=128, page_size=16)
    assert r.cal.splits.co_resident_slowdown == dict(dict(got.splits.by_group)[16])["co_resident_slowdown"]


@pytest.mark.parametrize("argv, match", [
    (("--add-groups", "4,16"), "--add-groups: not 4"),
    (("--add-groups", "16,16"), "--add-groups: expected distinct"),
    (("--add-groups", "x"), "--add-groups: expected comma-separated"),
    (("--add-groups", "65"), "--add-groups: "),
])
def test_add_groups_bad_values_are_named(argv, match):
    parser = argparse.ArgumentParser()
    calibrate.add_arguments(parser)
    with pytest.raises((ValueError, SystemExit)) as e:
        calibrate.check_arguments(parser.parse_args(list(argv)))
    if e.type is ValueError:
        assert match in str(e.value)


@pytest.mark.parametrize("extra, flag", [(("--kv-dtype", "fp8"), "--kv-dtype fp8"), (("--head-dim", "64"), "--head-dim"),
                                         (("--groups", "4,8"), "--groups"), (("--host-time",), "--host-time"),
                                         (("--max-waves", "2"), "--max-waves")])
def test_add_groups_refuses_what_does_not_apply(extra, flag):
    parser = argparse.ArgumentParser()
    calibrate.add_arguments(parser)
    with pytest.raises(ValueError, match=f"--add-groups: not with {flag}"):
        calibrate.check_arguments(parser.parse_args(["--add-groups", "16", *extra]))
