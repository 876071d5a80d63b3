"""Host time in the route choice (routes.toml ``[host_time]``, the calibration's ``host_time``,
``costmodel.wall_us``): parsing, the errors that name what is wrong, and the router's decisions
(CPU only; the measurement itself, ``pkvrt calibrate --host-time``, runs on the GPU)."""

from __future__ import annotations

import json
import pathlib

import attrs
import numpy as np
import pytest

from pkvrt.policy import calibration as C
from pkvrt.policy.costmodel import host_bound, wall_us
from pkvrt.policy.registry import HostTimeRule, RoutesError, load_routes
from pkvrt.policy.router import Router

REPO = pathlib.Path(__file__).resolve().parents[1]
H200 = C.load_calibration(REPO / "calibration" / "nvidia-h200.json")
NO_HOST = attrs.evolve(H200, host_time=None)   # a calibration measured before host_time existed
SHAPE = dict(num_qo_heads=32, num_kv_heads=8, head_dim=128, page_size=16)
SHORT = np.array([1000, 2000, 3000], dtype=np.int32)     # every row below the 16K context gate
BIMODAL = np.array([32768, 2048, 3072, 4096, 32000, 1024, 2560, 3584], dtype=np.int32)


def host(fi=(330.0, 35.0), bucket=(280.0, 28.0), wq=(110.0, 22.0), fused=(110.0, 22.0)) -> C.HostTime:
    costs = dict(flashinfer=fi, bucket=bucket, workqueue=wq, fused=fused)
    return C.HostTime(costs=tuple((k, C.HostCost(*costs[k])) for k in C.TIME_KINDS), date="2026-12-02",
                      command="test", provenance="made up for a test")


def routes(tmp_path, table: str | None = "[host_time]\nenabled = true\nmin_context = 1\n"):
    text = (REPO / "routes.toml").read_text()
    start = text.index("\n[host_time]\n") + 1
    end = text.index("# ----", start)
    p = tmp_path / "routes.toml"
    p.write_text(text[:start] + (table or "") + "\n" + text[end:])
    return load_routes(p)


def router(reg, cal=None, *, weigh=True, memo=0):
    cal = attrs.evolve(H200, host_time=host()) if cal is None else cal
    return Router(reg, cal, **SHAPE, memo_size=memo, device_plan_kinds=("workqueue", "fused"), weigh_host=weigh)


# ----------------------------------------------------------------------------- the formula


def test_wall_is_plan_plus_the_slower_of_host_and_device_per_layer():
    c = C.HostCost(plan_us=100.0, run_us=20.0)
    assert wall_us(10.0, c, 32) == 100 + 32 * 20      # host-bound layers
    assert wall_us(50.0, c, 32) == 100 + 32 * 50      # device-bound layers
    assert host_bound(10.0, c, 32) and not host_bound(50.0, c, 32)
    # the plan alone can make a step host-bound: 100 + 20 > 1 * 110 is false, 100 + 20 > 100 true
    assert not host_bound(120.0, c, 1) and host_bound(100.0, c, 1)


# ----------------------------------------------------------------------------- routes.toml


def test_shipped_routes_weigh_host_time_with_the_cost_model_deciding_the_context():
    assert load_routes().host_time == HostTimeRule(enabled=True, min_context=1)


def test_the_h200_calibration_has_host_time_and_flashinfer_costs_the_most_to_plan():
    ht = H200.host_time
    assert ht is not None and "pkvrt calibrate --host-time" in ht.provenance
    assert ht.cost("flashinfer").plan_us > ht.cost("workqueue").plan_us
    assert ht.cost("flashinfer").run_us > ht.cost("workqueue").run_us


@pytest.mark.parametrize("table, words", [
    ("[host_time]\nenabled = 1\nmin_context = 1\n", "[host_time] enabled: 1 is not a boolean"),
    ("[host_time]\nenabled = true\nmin_context = 0\n", "[host_time] min_context: 0 is not positive"),
    ("[host_time]\nenabled = true\n", "[host_time] min_context: missing"),
    ("[host_time]\nenabled = true\nmin_context = 1\nlayers = 32\n", "[host_time] layers: unknown key"),
    ('[host_time]\nenabled = "yes"\nmin_context = 1\n', '[host_time] enabled: "yes" is not a boolean'),
])
def test_a_bad_host_time_table_names_file_table_and_key(tmp_path, table, words):
    with pytest.raises(RoutesError, match=r"routes\.toml: ") as info:
        routes(tmp_path, table)
    assert words in str(info.value) and "; expected" in str(info.value)


# ----------------------------------------------------------------------------- calibration


def test_host_time_round_trips_and_views_keep_it(tmp_path):
    cal = attrs.evolve(H200, host_time=host())
    p = tmp_path / "nvidia-h200.json"
    C.save_calibration(cal, p)
    back = C.load_calibration(p)
    assert back.host_time == host()
    assert back.for_group(8).host_time == host() and back.for_kv_dtype("float8_e4m3fn").host_time == host()


def _doc_with(host_time) -> dict:
    doc = C.calibration_to_dict(attrs.evolve(H200, host_time=host()))
    doc["host_time"] = host_time
    return doc


def _fixed(**over):
    d = host().to_dict()
    for key, value in over.items():
        if value is None:
            del d[key]
        else:
            d[key] = value
    return d


@pytest.mark.parametrize("section, key, expected", [
    (_fixed(bucket=None), "host_time.bucket", "present (missing)"),
    (_fixed(fused={"plan_us": 1.0}), "host_time.fused.run_us", "present (missing)"),
    (_fixed(workqueue={"plan_us": -1.0, "run_us": 1.0}), "host_time.workqueue.plan_us", "a finite number >= 0"),
    (_fixed(flashinfer={"plan_us": 1.0, "run_us": True}), "host_time.flashinfer.run_us", "a number"),
    (_fixed(flashinfer=[1, 2]), "host_time.flashinfer", "a JSON object"),
    (_fixed(date="yesterday"), "host_time.date", "an ISO date"),
    (_fixed(extra=1), "host_time.extra", "unknown key"),
    ("fast", "host_time", "a JSON object"),
])
def test_a_bad_host_time_section_names_its_key(tmp_path, section, key, expected):
    p = tmp_path / "gpu.json"
    p.write_text(json.dumps(_doc_with(section)))
    with pytest.raises(C.CalibrationError) as info:
        C.load_calibration(p)
    msg = str(info.value)
    assert msg.startswith(f"{p}: key {key!r}") and expected in msg, msg


# ----------------------------------------------------------------------------- the router


def test_a_host_bound_short_step_takes_the_route_of_the_smaller_wall_time(tmp_path):
    d = router(routes(tmp_path)).decide(SHORT, layers=32)
    assert d.route == "pkv_workqueue" and d.layers == 32 and d.host_bound
    fi, wq = d.wall_us["flashinfer"], d.wall_us["pkv_workqueue"]
    assert fi == pytest.approx(wall_us(d.predicted_us["flashinfer"], host().cost("flashinfer"), 32))
    assert wq == pytest.approx(wall_us(d.predicted_us["pkv_workqueue"], host().cost("workqueue"), 32))
    assert d.speedup == pytest.approx(fi / wq) and "host-bound" in d.explain()
    assert "wall us" in d.explain()


def test_without_weighing_the_same_step_keeps_the_context_gate(tmp_path):
    reg = routes(tmp_path)
    d = router(reg, weigh=False).decide(SHORT, layers=32)
    assert d.route == "flashinfer" and d.layers == 0 and not d.wall_us
    assert "gates.min_context = 16384" in d.refused["pkv_workqueue"]
    assert router(reg, weigh=False).host_model == "not weighed in this mode (weigh_host=False)"


@pytest.mark.parametrize("table, cal, reason", [
    (None, None, "[host_time] is absent or disabled"),
    ("[host_time]\nenabled = false\nmin_context = 1\n", None, "[host_time] is absent or disabled"),
    ("[host_time]\nenabled = true\nmin_context = 1\n", NO_HOST, "has no host_time"),
])
def test_host_time_needs_the_table_and_the_calibration(tmp_path, table, cal, reason):
    r = router(routes(tmp_path, table), cal)
    assert reason in r.host_model
    d = r.decide(SHORT, layers=32)
    assert d.route == "flashinfer" and not d.wall_us


def test_a_device_bound_flashinfer_step_keeps_the_context_gate(tmp_path):
    # FlashInfer's host time made negligible: its step is device-bound, the gate stands
    cal = attrs.evolve(H200, host_time=host(fi=(0.0, 0.0)))
    d = router(routes(tmp_path), cal).decide(SHORT, layers=32)
    assert d.route == "flashinfer" and not d.host_bound
    assert "FlashInfer's step is device-bound" in d.refused["pkv_workqueue"]


def test_host_time_min_context_gates_host_bound_steps(tmp_path):
    reg = routes(tmp_path, "[host_time]\nenabled = true\nmin_context = 4096\n")
    r = router(reg)
    assert r.decide(SHORT, layers=32).route == "flashinfer"
    assert r.decide(SHORT + 2000, layers=32).route == "pkv_workqueue"   # longest row 5000 >= 4096


def test_the_boundary_rule_applies_to_the_wall_ratio(tmp_path):
    b4 = np.full(4, 32768, dtype=np.int32)
    r = router(routes(tmp_path))
    at32, at1 = r.decide(b4, layers=32), r.decide(b4, layers=1)
    # 32 layers: the plan's host time is amortized, the device times are within 1.5x: FlashInfer
    assert at32.route == "flashinfer" and "boundary rule" in at32.refused["pkv_workqueue"]
    assert "wall speedup" in at32.refused["pkv_workqueue"]
    # one layer: FlashInfer's plan dominates the step
    assert at1.route == "pkv_workqueue" and at1.speedup >= 1.5


def test_device_bound_steps_past_the_gates_are_unchanged_by_small_host_costs(tmp_path):
    # equal host costs on every route: the wall ratio is the device ratio diluted, the choice the same
    same = host(fi=(50.0, 5.0), bucket=(50.0, 5.0), wq=(50.0, 5.0), fused=(50.0, 5.0))
    reg = routes(tmp_path)
    weighed = router(reg, attrs.evolve(H200, host_time=same))
    plain = router(reg, weigh=False)
    for seq in (BIMODAL, np.array([32768], dtype=np.int32), np.full(8, 32768, dtype=np.int32)):
        assert weighed.decide(seq, layers=32).route == plain.decide(seq).route


def test_the_memo_keys_decisions_by_layers_per_plan(tmp_path):
    # FlashInfer cheap per layer but dear to plan: one layer per plan -> PersistentKV, 32 -> FlashInfer
    cal = attrs.evolve(H200, host_time=host(fi=(400.0, 5.0), wq=(20.0, 60.0), bucket=(400.0, 60.0)))
    r = router(routes(tmp_path), cal, memo=64)
    fresh = router(routes(tmp_path), cal)
    for layers in (1, 32, 1, 32):
        d = r.decide(SHORT, layers=layers)
        assert d.route == fresh.decide(SHORT, layers=layers).route == ("pkv_workqueue" if layers == 1 else "flashinfer")
    assert r.memo_hits == 2
    assert r.memo_key(SHORT, None, 1) != r.memo_key(SHORT, None, 32)


@pytest.mark.parametrize("layers", [0, -1, 1.5, True, "32"])
def test_layers_must_be_a_positive_integer(tmp_path, layers):
    with pytest.raises(ValueError, match="layers="):
        router(routes(tmp_path)).decide(SHORT, layers=layers)


def test_setting_weigh_host_forgets_the_memo(tmp_path):
    r = router(routes(tmp_path), memo=64)
    assert r.decide(SHORT, layers=32).route == "pkv_workqueue"
    r.weigh_host = False
    assert r.decide(SHORT, layers=32).route == "flashinfer" and r.memo_hits == 0
