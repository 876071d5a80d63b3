"""`pkvrt plan`: the planner run over a trace, its text tables and its JSON."""

from __future__ import annotations

import argparse
import io
import json

import attrs
import numpy as np
import pytest

from pkvrt._paths import CHECKOUT
from pkvrt.measure import traces
from pkvrt.policy import calibration as calib
from pkvrt.policy.registry import load_routes
from pkvrt.policy.router import Router
from pkvrt.tools import plan_cmd

TABLE4 = ("Launches/step", "Decode CTA work/SM", "Useful KV MB", "Merge MB", "Merge launches")
SHARED_TRACES = CHECKOUT.parent / "shared" / "traces"


def parse(*argv) -> argparse.Namespace:
    p = argparse.ArgumentParser()
    plan_cmd.add_arguments(p)
    return p.parse_args(list(argv))


def plan(capsys, *argv) -> tuple[str, str]:
    assert plan_cmd.run(parse(*argv)) == 0
    return capsys.readouterr()


def router(*, num_qo_heads=32, num_kv_heads=8, cal=None, graphs=True) -> Router:
    return Router(load_routes(None), cal or plan_cmd.seed_calibration(),
                  num_qo_heads=num_qo_heads, num_kv_heads=num_kv_heads, head_dim=128,
                  page_size=16, graphs=graphs)


def rows_by_engine(doc) -> dict[str, dict]:
    return {r["engine"]: r for r in doc["rows"]}


def section(out: str, title: str) -> list[str]:
    """The lines of the table printed under a line starting with ``title``."""
    blocks = out.split("\n\n")
    block = next(b for b in blocks if b.startswith(title))
    return block.splitlines()[1:]


# --------------------------------------------------------------------------- the command

@pytest.mark.parametrize("spec", ["bimodal", "mixed"])
def test_plan_prints_table4_and_writes_json(capsys, tmp_path, spec):
    out_json = tmp_path / "plan.json"
    out, err = plan(capsys, "--trace", spec, "--json", str(out_json))
    assert "planning [" not in err                      # stderr is not a tty under pytest
    for col in TABLE4:
        assert col in out
    for label in ("FlashInfer (flashinfer)", "PersistentKV buckets (pkv_bucket)",
                  "PersistentKV workqueue (pkv_workqueue)", "Adaptive route"):
        assert label in out
    assert "COST-MODEL PREDICTION for calibration 'rtx3060-seed'" in out
    assert "predicted adaptive/FlashInfer throughput ratio" in out
    doc = json.loads(out_json.read_text())
    assert set(doc) == {"meta", "rows", "route_mix", "summary"}
    assert doc["meta"]["gpu"] is None and doc["meta"]["calibration"] == "rtx3060-seed"
    assert len(doc["meta"]["routes_sha256"]) == 64
    rows = rows_by_engine(doc)
    assert {"flashinfer", "pkv_bucket", "pkv_workqueue", "adaptive"} <= set(rows)
    s = doc["summary"]
    assert sum(m["steps"] for m in doc["route_mix"]) == s["steps"]
    assert rows["adaptive"]["ratio_vs_flashinfer"] == pytest.approx(s["predicted_ratio"])
    case = f"{spec}-B8-seed20260623" if spec == "bimodal" else "mixed-B8"
    assert all(r["case"] == case for r in doc["rows"])
    # the text and the JSON show the same numbers
    lines = {ln.split("  ")[0]: ln for ln in section(out, "Structural counters")}
    wq = rows["pkv_workqueue"]
    assert lines["PersistentKV workqueue (pkv_workqueue)"].split()[-5:] == [
        f"{wq['launches_per_step']:.2f}", f"{wq['cta_work_per_sm']:.1f}",
        f"{wq['useful_kv_mb']:.1f}", f"{wq['merge_mb']:.2f}", f"{wq['merge_launches']:.2f}"]


def test_b8_bimodal_workqueue_two_launches_buckets_many(capsys, tmp_path):
    out_json = tmp_path / "p.json"
    plan(capsys, "--trace", "bimodal", "--max-active", "8", "--json", str(out_json))
    doc = json.loads(out_json.read_text())
    rows = rows_by_engine(doc)
    assert rows["pkv_workqueue"]["launches_per_step"] == 2.0
    assert rows["pkv_workqueue"]["merge_launches"] == 1.0
    assert rows["flashinfer"]["launches_per_step"] == 1.0
    assert rows["flashinfer"]["cta_work_per_sm"] is None
    # exact buckets: one bucket per distinct length, two launches when split -> ~2 per row
    mean_active = doc["summary"]["mean_active"]
    assert rows["pkv_bucket"]["launches_per_step"] > 1.5 * mean_active > 10
    assert rows["pkv_bucket"]["merge_mb"] > rows["pkv_workqueue"]["merge_mb"]
    mix = {m["route"]: m for m in doc["route_mix"]}
    assert mix["pkv_workqueue"]["share"] > 0.5
    assert max(dict(map(tuple, mix["pkv_workqueue"]["splits"]))) <= 64   # routes.toml's bound
    kv = {r["useful_kv_mb"] for r in doc["rows"]}
    assert max(kv) - min(kv) < 1e-9                      # every engine reads the same KV


def test_plan_through_the_cli(capsys):
    cli = pytest.importorskip("pkvrt.tools.cli")
    rc = cli.main(["plan", "--trace", "mixed", "--num-requests", "6"])
    out, err = capsys.readouterr()
    assert rc == 0 and "6 requests" in out and "Merge launches" in out


@pytest.mark.parametrize("argv,words", [
    (("--trace", "nope"), "--trace 'nope'"),
    (("--calibration", "/nonexistent/cal.json"), "/nonexistent/cal.json"),
    (("--routes", "/nonexistent/routes.toml"), "/nonexistent/routes.toml"),
])
def test_plan_errors_name_the_argument(capsys, argv, words):
    cli = pytest.importorskip("pkvrt.tools.cli")
    rc = cli.main(["plan", *argv])
    _, err = capsys.readouterr()
    assert rc == 2 and words in err


@pytest.mark.parametrize("parent", ["missing", "missing/deeper", "a-file"])
def test_plan_json_refuses_a_missing_directory(capsys, tmp_path, parent):
    cli = pytest.importorskip("pkvrt.tools.cli")
    (tmp_path / "a-file").write_text("")
    target = tmp_path / parent / "plan.json"
    rc = cli.main(["plan", "--trace", "mixed", "--num-requests", "2", "--json", str(target)])
    out, err = capsys.readouterr()
    what = "is not a directory" if parent == "a-file" else "does not exist"
    assert rc == 2 and out == ""
    assert err == (f"pkvrt: error: --json {target}: directory {target.parent} {what}; create it "
                   "first (nothing was written)\n")
    assert sorted(x.name for x in tmp_path.iterdir()) == ["a-file"]


def test_plan_bad_trace_file_names_line(capsys, tmp_path):
    cli = pytest.importorskip("pkvrt.tools.cli")
    bad = tmp_path / "bad.csv"
    bad.write_text("prompt_len,decode_len\n100,4\n100,x\n")
    rc = cli.main(["plan", "--trace", str(bad)])
    _, err = capsys.readouterr()
    assert rc == 2 and f"{bad}, line 3, field 'decode_len'" in err


def test_plan_tables_are_aligned(capsys):
    out, _ = plan(capsys, "--trace", "uniform", "--num-requests", "12")
    for title in ("Structural counters", "Predicted step time"):
        lines = section(out, title)
        engines = sum(r.enabled for r in load_routes(None).routes) + 1      # + adaptive
        assert len(lines) == 1 + engines
        assert len({len(ln) for ln in lines}) == 1                          # right-aligned numbers


# --------------------------------------------------------------------------- run_planner

def _direct_kv_mb(trace, max_active):
    steps = list(traces.decode_steps(trace, max_active=max_active))
    kv = [int(s.seq_lens.sum()) * 8 * 128 * 2 * 2 for s in steps]
    return np.mean(kv) / 2**20, len(steps), sum(len(s.rids) for s in steps)


@pytest.mark.parametrize("family", traces.FAMILIES)
@pytest.mark.parametrize("max_active", [1, 4, 8])
def test_run_planner_counts_match_the_decode_loop(family, max_active):
    tr = traces.synthetic(family, num_requests=8, seed=20260624, decode_range=(4, 12))
    s = plan_cmd.run_planner(tr, max_active=max_active, router=router())
    kv_mb, steps, tokens = _direct_kv_mb(tr, max_active)
    assert (s.steps, s.decode_tokens) == (steps, tokens)
    assert s.mean_active == pytest.approx(tokens / steps)
    rows = {e.engine: e for e in s.engines}
    for e in s.engines:
        assert e.useful_kv_mb == pytest.approx(kv_mb)
    # the policy only leaves FlashInfer for a predicted win, so it never predicts slower
    assert rows["adaptive"].predicted_us <= rows["flashinfer"].predicted_us * (1 + 1e-12)
    assert s.predicted_ratio == pytest.approx(rows["adaptive"].ratio_vs_flashinfer)
    assert s.predicted_ratio >= 1.0
    assert sum(m.share for m in s.route_mix) == pytest.approx(1.0)
    assert rows["pkv_workqueue"].launches_per_step == 2.0
    assert rows["pkv_fused"].launches_per_step == 1.0 and rows["pkv_fused"].merge_launches == 0


def test_uncalibrated_group_size_stays_on_flashinfer():
    tr = traces.synthetic("homogeneous", num_requests=8, seed=1, decode_range=(4, 8))
    s = plan_cmd.run_planner(tr, max_active=8, router=router(num_qo_heads=64))   # G = 8
    assert [(m.route, m.share) for m in s.route_mix] == [("flashinfer", 1.0)]
    assert s.predicted_ratio == 1.0


def test_short_trace_stays_on_flashinfer():
    short = traces.Trace(name="short", seed=None, source="test", requests=tuple(
        traces.Request(i, i, 1000 + 37 * i, 6) for i in range(10)))
    s = plan_cmd.run_planner(short, max_active=8, router=router())
    assert [m.route for m in s.route_mix] == ["flashinfer"]
    assert s.long_steps == 0 and s.context_max < 16384


def test_eager_uses_the_eager_launch_overhead(tmp_path):
    doc = calib.calibration_to_dict(plan_cmd.seed_calibration())
    doc.update(lambda_us=10.0, lambda_graph_us=1.1)
    path = tmp_path / "cal.json"
    path.write_text(json.dumps(doc))
    cal = calib.load_calibration(path)
    tr = traces.synthetic("bimodal", num_requests=8, seed=3, decode_range=(4, 8))
    eager = plan_cmd.run_planner(tr, max_active=8, router=router(cal=cal, graphs=False))
    graph = plan_cmd.run_planner(tr, max_active=8, router=router(cal=cal, graphs=True))
    assert (eager.launch_us, graph.launch_us) == (10.0, 1.1)
    fi_e = {e.engine: e for e in eager.engines}["flashinfer"]
    fi_g = {e.engine: e for e in graph.engines}["flashinfer"]
    # FlashInfer: one launch per step, so the per-step difference is exactly 10.0 - 1.1 µs
    assert fi_e.predicted_us - fi_g.predicted_us == pytest.approx(8.9)


def test_gpu_flag_picks_calibration_by_name(capsys, tmp_path, monkeypatch):
    doc = calib.calibration_to_dict(plan_cmd.seed_calibration())
    doc.update(gpu="NVIDIA H200", slug="nvidia-h200", sm_count=132, beta_gbps=4120.0)
    (tmp_path / "nvidia-h200.json").write_text(json.dumps(doc))
    monkeypatch.setenv(calib.ENV_DIR, str(tmp_path))
    out, _ = plan(capsys, "--trace", "mixed", "--gpu", "NVIDIA H200", "--num-requests", "4")
    assert "calibration  nvidia-h200 (NVIDIA H200)" in out
    assert "COST-MODEL PREDICTION for calibration 'nvidia-h200'" in out


def test_layers_show_the_step_of_that_many_layers(capsys):
    out, _ = plan(capsys, "--trace", "mixed", "--num-requests", "4", "--layers", "8")
    times = section(out, "Predicted step time")
    assert [c.strip() for c in times[0].split("  ") if c][:3] == [
        "engine", "predicted µs/layer", "µs/step (8 layers)"]
    per_layer, per_step = (float(x) for x in times[1].split()[-4:-2])
    assert per_step == pytest.approx(8 * per_layer, abs=8 * 0.05 + 0.05)   # both rounded
    assert "a step is 8 attention calls, planned once" in out


def test_run_planner_reports_the_engines_asked_for():
    tr = traces.synthetic("bimodal", num_requests=6, seed=3, decode_range=(4, 8))
    r = router()
    full = plan_cmd.run_planner(tr, max_active=4, router=r)
    some = plan_cmd.run_planner(tr, max_active=4, router=r,
                                engines=("adaptive", "device-plan", "device-plan:pkv_workqueue"))
    assert [e.engine for e in some.engines] == ["flashinfer", "adaptive", "device-plan",
                                                "device-plan:pkv_workqueue"]
    by = {e.engine: e for e in full.engines}
    got = {e.engine: e for e in some.engines}
    assert got["adaptive"] == by["adaptive"] and got["flashinfer"] == by["flashinfer"]
    assert got["device-plan:pkv_workqueue"].predicted_us == by["pkv_workqueue"].predicted_us
    assert got["device-plan"].label == "Device planning (device-plan)"
    assert some.route_mix == full.route_mix and some.predicted_ratio == full.predicted_ratio
    # device-plan: per step the route [device_planning] names for its row count
    reg = r.registry
    steps = list(traces.decode_steps(tr, max_active=4))
    fused = [s for s in steps if reg.device_planning_route(len(s.seq_lens)).name == "pkv_fused"]
    assert 0 < len(fused) < len(steps)       # both routes of the shipped table are used
    expect = sum(r.predict(reg.device_planning_route(len(s.seq_lens)), s.seq_lens) for s in steps)
    assert got["device-plan"].predicted_us == pytest.approx(expect / len(steps))


def test_progress_bar_on_request():
    tr = traces.synthetic("uniform", num_requests=6, seed=2, decode_range=(4, 6))
    buf = io.StringIO()
    s = plan_cmd.run_planner(tr, max_active=4, router=router(), progress=True, stream=buf)
    text = buf.getvalue()
    assert text.startswith("\rplanning [") and text.endswith(f"{s.steps}/{s.steps} steps\n")


def test_azure_trace_plans(capsys):
    path = SHARED_TRACES / "azure2023_code.csv"
    if not path.is_file():
        pytest.skip(f"{path} not present")
    out, _ = plan(capsys, "--trace", str(path), "--num-requests", "200")
    assert "azure2023_code" in out and "200 requests" in out


def test_summary_is_frozen_plain_data():
    tr = traces.synthetic("bimodal", num_requests=4, seed=2, decode_range=(4, 6))
    s = plan_cmd.run_planner(tr, max_active=4, router=router())
    with pytest.raises(attrs.exceptions.FrozenInstanceError):
        s.steps = 0
    json.dumps(plan_cmd.summary_json(s, command="test"))


def test_plan_reports_what_sharing_would_save():
    """A trace with prefix hashes: the mean fraction of page reads that reading each shared page
    once saves, from the layout the benches build. Two requests share two whole 512-token blocks
    (64 pages of 16) and are alone on the loop at 1101-1104 tokens (69 pages each): every step
    reads 138 pages of which 64 twice; none without hashes."""
    reqs = [traces.Request(rid=i, arrival_step=0, prompt_len=1100, decode_len=4, prefix=(7, 8, 9 + i))
            for i in range(2)]
    tr = traces.Trace(name="two", requests=tuple(reqs), seed=None, source="test", block_tokens=512)
    s = plan_cmd.run_planner(tr, max_active=2, router=router())
    assert s.shared_read == pytest.approx(64 / 138) and s.shared_steps == 1.0
    assert "saves 46.4% of a step's page reads" in plan_cmd.format_summary(s)
    plain = plan_cmd.run_planner(traces.synthetic("bimodal", num_requests=4, seed=1), max_active=2,
                                 router=router())
    assert plain.shared_read is None and "sharing" not in plan_cmd.format_summary(plain)
