"""`pkvrt bench` without a GPU (planner mode): --seeds, --engines and --engine-layers take effect
or are refused naming the flag, --gpu picks the calibration and the output says which one
predicts, a short summary table (the per-seed detail with --verbose), and --help lists every
option and every engine name that --engines takes."""

from __future__ import annotations

import re

import pytest
import torch

from pkvrt.measure import harness, results
from pkvrt.policy.registry import load_routes
from pkvrt.tools import bench, cli

SMALL = ("--num-requests", "4", "--max-active", "4")
ROUTES = load_routes(None)


def run(capsys, *argv):
    rc = cli.main(list(argv))
    out, err = capsys.readouterr()
    return rc, out, err


@pytest.fixture(autouse=True)
def no_cuda(monkeypatch):
    """Behave as a machine without CUDA even where one exists."""
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)


def summary(out: str) -> tuple[list[str], list[list[str]]]:
    """The summary table: its header cells and its rows' cells (split at 2+ spaces)."""
    lines = out[out.index("Summary ("):].splitlines()[1:]
    cells = [re.split(r"\s{2,}", line.strip()) for line in lines
             if line and not line.startswith(("note:", "wrote "))]
    return cells[0], cells[1:]


# --------------------------------------------------------------------------- --seeds

def test_each_seed_of_a_family_is_planned(capsys):
    rc, out, err = run(capsys, "bench", "--trace", "bimodal", "--seeds", "1,2", *SMALL)
    assert rc == 0, err
    head, rows = summary(out)
    assert [r[:2] for r in rows] == [["bimodal", "1"], ["bimodal", "2"], ["all", "2 seeds"]]
    assert rows[0][2] != rows[1][2] or rows[0][4] != rows[1][4]      # different draws
    assert int(rows[2][2]) == int(rows[0][2]) + int(rows[1][2])


def test_a_file_trace_is_planned_once_and_says_why(capsys, tmp_path):
    out_file = tmp_path / "plan.json"
    rc, out, err = run(capsys, "bench", "--trace", "mixed", "--seeds", "1-3", "--out", str(out_file))
    assert rc == 0, err
    assert "--seeds: trace 'mixed' is a file, the same requests for every seed" in out
    assert "planned once" in out
    _, rows = summary(out)
    assert [r[:2] for r in rows] == [["mixed", "1,2,3"]]
    doc = results.read_results(out_file)                 # every seed's case is still written
    assert {r["case"] for r in doc["rows"]} == {f"mixed-B8-seed{s}" for s in (1, 2, 3)}


# --------------------------------------------------------------------------- --engines

def test_engines_choose_the_reported_engines(capsys, tmp_path):
    out_file = tmp_path / "plan.json"
    rc, out, err = run(capsys, "bench", "--seeds", "3", *SMALL, "--engines",
                       "pkv_bucket,adaptive,device-plan", "--out", str(out_file))
    assert rc == 0, err
    head, _ = summary(out)
    assert head[5:] == ["pkv_bucket", "adaptive", "device-plan"]
    doc = results.read_results(out_file)
    assert [r["engine"] for r in doc["rows"]] == ["flashinfer", "pkv_bucket", "adaptive",
                                                  "device-plan"]


def test_without_engines_every_enabled_route_and_adaptive(capsys):
    rc, out, err = run(capsys, "bench", "--seeds", "3", *SMALL)
    assert rc == 0, err
    head, _ = summary(out)
    assert head[5:] == [*(r.name for r in ROUTES.routes if r.enabled and r.kind != "flashinfer"),
                        "adaptive"]


@pytest.mark.parametrize("engines, named", [
    ("flashinfer-xqa", "--engines flashinfer-xqa: it needs a CUDA GPU (none here)"),
    ("adaptive,adaptive-eager,host-step", "--engines adaptive-eager,host-step: they need a CUDA GPU"),
])
def test_engines_only_a_gpu_tells_apart_are_refused(capsys, engines, named):
    rc, out, err = run(capsys, "bench", "--seeds", "3", *SMALL, "--engines", engines)
    assert rc == 2 and out == ""
    assert err.startswith(f"pkvrt: error: {named}") and err.count("\n") == 1
    assert "the planner predicts flashinfer, adaptive, device-plan, device-plan:ROUTE" in err


def test_device_plan_takes_only_the_routes_device_planning_runs(capsys):
    rc, out, err = run(capsys, "bench", "--seeds", "3", *SMALL, "--engines", "device-plan:pkv_bucket")
    assert rc == 2 and out == ""
    assert err == ("pkvrt: error: --engines device-plan:pkv_bucket: device planning runs a "
                   "workqueue or fused route; pkv_bucket is a bucket route\n")


# --------------------------------------------------------------------------- --engine-layers

def test_engine_layers_give_predictions_per_step_of_that_many_layers(capsys, tmp_path):
    out_file = tmp_path / "plan.json"
    rc, out, err = run(capsys, "bench", "--trace", "mixed", "--seeds", "1", "--num-requests", "4",
                       "--engine-layers", "8", "--verbose", "--out", str(out_file))
    assert rc == 0, err
    assert "layers: a step is 8 attention calls (--engine-layers), planned once" in out
    assert "µs/step (8 layers)" in out
    doc = results.read_results(out_file)
    assert doc["meta"]["layers"] == 8 and doc["rows"][0]["case"] == "mixed-B8-L8-seed1"


def test_engine_layers_move_routes_where_host_time_is_weighed(capsys):
    # the H200 calibration has host_time: the router decides at the step's layers, as the
    # Runtime's default mode does, so one layer and 32 layers route differently
    mixes = {}
    for layers in ("1", "32"):
        rc, out, err = run(capsys, "bench", "--trace", "mixed", "--seeds", "1", "--gpu",
                           "NVIDIA H200", "--engine-layers", layers)
        assert rc == 0, err
        assert "host time weighed as the Runtime's default mode does" in out
        mixes[layers] = summary(out)[1][0][4]
    assert mixes["1"] != mixes["32"]


def test_gpu_only_options_are_named_in_a_warning(capsys):
    rc, out, err = run(capsys, "bench", "--seeds", "3", *SMALL, "--steps-limit", "5", "--mlp")
    assert rc == 0
    assert err == ("pkvrt: warning: --steps-limit, --mlp: not used without a GPU (they shape the "
                   "timed run; the planner plans every step of the trace, attention only)\n")


# --------------------------------------------------------------------------- --gpu, calibration

def test_default_calibration_is_named_and_is_plans(capsys):
    rc, out, err = run(capsys, "bench", "--seeds", "3", *SMALL)
    assert rc == 0, err
    line = next(x for x in out.splitlines() if x.startswith("calibration: "))
    assert line.startswith("calibration: rtx3060-seed (NVIDIA GeForce RTX 3060) from ")
    assert "the default without a GPU, as pkvrt plan; --gpu NAME or --calibration PATH" in line
    assert "shipped: nvidia-h100-80gb-hbm3, nvidia-h200, rtx3060-seed" in line
    rc, plan_out, _ = run(capsys, "plan", "--num-requests", "4")
    assert "calibration  rtx3060-seed (NVIDIA GeForce RTX 3060)" in plan_out


def test_gpu_picks_the_calibration_by_name(capsys):
    rc, out, err = run(capsys, "bench", "--seeds", "3", *SMALL, "--gpu", "NVIDIA H200")
    assert rc == 0, err
    assert "calibration: nvidia-h200 (NVIDIA H200) from " in out and "(--gpu 'NVIDIA H200';" in out
    assert "for calibration 'nvidia-h200'" in out


def test_gpu_without_a_file_says_fallback(capsys):
    rc, out, err = run(capsys, "bench", "--seeds", "3", *SMALL, "--gpu", "Imaginary GPU 9000")
    assert rc == 0
    assert "--gpu 'Imaginary GPU 9000': no file for it, the seed profile" in out
    assert "pkvrt: warning: no calibration file for device 'Imaginary GPU 9000'" in err


def test_gpu_and_calibration_exclude_each_other(capsys):
    rc, out, err = run(capsys, "bench", "--gpu", "NVIDIA H200", "--calibration", "x.json")
    assert rc == 2 and out == "" and "not allowed with argument" in err


def test_the_gpu_run_takes_the_same_calibration_choice(monkeypatch):
    import argparse
    args = argparse.Namespace(calibration=None, gpu="NVIDIA H200")
    assert bench.calibration_for(args, "NVIDIA GeForce RTX 3060").slug == "nvidia-h200"
    args.gpu = None
    assert bench.calibration_for(args, None).slug == "rtx3060-seed"
    assert not bench.calibration_for(args, None).fallback


# --------------------------------------------------------------------------- output

def test_summary_by_default_detail_with_verbose(capsys):
    argv = ("bench", "--seeds", "1-3", *SMALL)
    rc, short, _ = run(capsys, *argv)
    assert rc == 0
    assert "Route mix of the adaptive policy" not in short and "Launches/step" not in short
    assert len(short.splitlines()) <= 12
    head, rows = summary(short)
    assert head[:5] == ["trace", "seed", "steps", "mean active", "adaptive route mix"]
    assert len(rows) == 4 and all(c.endswith("x") for r in rows for c in r[5:])
    rc, long, _ = run(capsys, *argv, "--verbose")
    assert long.count("Route mix of the adaptive policy") == 3 and "== seed 2" in long
    assert long.endswith(short[short.index("Summary ("):])          # the same summary last


# --------------------------------------------------------------------------- --help

def _help(capsys, *argv) -> str:
    rc, out, _ = run(capsys, *argv, "--help")
    assert rc == 0
    return out


def test_bench_help_lists_every_option(capsys):
    import argparse
    out = _help(capsys, "bench")
    parser = cli.build_parser()
    serving = parser._subparsers._group_actions[0].choices["bench"]._subparsers._group_actions[0] \
        .choices["serving"]
    for action in serving._actions:
        for flag in action.option_strings:
            assert flag in out, flag
        assert action.help or isinstance(action, argparse._HelpAction)


def test_every_engine_name_is_in_help_and_in_the_error(capsys):
    out = _help(capsys, "bench")
    documented = set(re.findall(r"^  ([a-z][a-z0-9_-]*)\s{2,}", out[out.index("\nengines ("):],
                                re.M))
    rc, _, err = run(capsys, "bench", "--engines", "warp")
    assert rc == 2
    listed = err.split("expected one of ", 1)[1].split(" (device-plan", 1)[0].split(", ")
    routes = {r.name for r in ROUTES.routes}
    assert set(listed) - routes == documented - routes           # the engines: the same names
    text = " ".join(out.split())
    shipped = text[text.index("(shipped: "):].split(")", 1)[0]
    assert all(r in shipped for r in routes - {ROUTES.baseline.name})  # every route named too
    assert set(bench.ENGINES) == documented
