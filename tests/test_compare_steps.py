"""benches/compare_steps.py on two tiny synthetic .steps.json files (CPU)."""

from __future__ import annotations

import importlib.util
import json
import lzma
import pathlib

import pytest

SCRIPT = pathlib.Path(__file__).resolve().parents[1] / "benches" / "compare_steps.py"


def _script():
    spec = importlib.util.spec_from_file_location("compare_steps", SCRIPT)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def _steps(path, fi_us, pkv):   # pkv: [(split_max, cuda_us)] per step
    rows = []
    for i, (fi, (split, us)) in enumerate(zip(fi_us, pkv)):
        rows.append({"engine": "flashinfer-tc", "baseline": True, "seed": 1, "step": i, "active": 8,
                     "max_context": 32768, "split_max": None, "cuda_us": fi})
        rows.append({"engine": "pkvrt-device-plan-step", "baseline": False, "seed": 1, "step": i, "active": 8,
                     "max_context": 32768, "split_max": split, "cuda_us": us})
    data = json.dumps({"meta": {}, "rows": rows}).encode()
    path.write_bytes(lzma.compress(data) if path.suffix == ".xz" else data)
    return path


def test_moved_and_same_steps_with_the_baselines_drift_divided_out(tmp_path, capsys):
    cs = _script()
    before = _steps(tmp_path / "a.steps.json.xz", [100, 100, 100], [(40, 90), (20, 80), (8, 50)])
    # the baseline runs 10 % faster after; step 0's cut moved and it got 10 % slower in absolute terms
    after = _steps(tmp_path / "b.steps.json", [90, 90, 90], [(20, 99), (20, 72), (8, 45)])
    got = {c["group"]: c for c in cs.compare(cs.load_steps(before), cs.load_steps(after))}
    assert got["moved"]["steps"] == 1 and got["moved"]["normalised_median"] == pytest.approx(99 / 90 / 0.9)
    assert got["same"]["steps"] == 2 and got["same"]["normalised_median"] == pytest.approx(1.0)
    assert cs.step_ratios(cs.load_steps(before))["pkvrt-device-plan-step"][1] == pytest.approx(100 / 90)
    assert cs.main([str(before), str(after), "--moved", "5"]) == 0
    assert "cut 40 -> 20, 90 -> 99 us" in capsys.readouterr().out


def test_a_file_without_baseline_rows_is_refused(tmp_path, capsys):
    cs = _script()
    bad = tmp_path / "x.steps.json"
    bad.write_text(json.dumps({"rows": [{"engine": "pkvrt-x", "seed": 1, "step": 0, "cuda_us": 1.0}]}))
    assert cs.main([str(bad), str(bad)]) == 2
    assert "no baseline rows" in capsys.readouterr().err
