"""When SharedPagesRuntime shares: the time model's rule (the plain step credited for the
re-reads that meet their page in L2, against the chunk and own decodes plus the launches
sharing adds), the calibration's ``sharing`` section that carries the L2 constant, and its fit
from measured steps (benches/shared_pages.py --fit-l2). CPU only: the fake device of
tests/test_runtime_cpu.py plans the steps; nothing runs a kernel."""

from __future__ import annotations

import json

import attrs
import numpy as np
import pytest
import torch

from test_runtime_cpu import ROUTES, fake_device  # noqa: F401

from pkvrt.policy import calibration as C
from pkvrt.policy import sharing
from pkvrt.runtime.options import RuntimeOptions
from pkvrt.runtime import shared as shared_mod
from pkvrt.runtime.shared import SharedPagesRuntime

H200 = "calibration/nvidia-h200.json"
PAGE = 16


def prefix_step(rows: int, shared: int, own: int):
    """``rows`` rows that share their first ``shared`` tokens' pages, then ``own`` tokens of
    their own pages each: lengths, block tables, pages used."""
    n = shared // PAGE
    own_pages = -(-(shared + own) // PAGE) - n
    bt = np.zeros((rows, n + own_pages), np.int32)
    bt[:, :n] = np.arange(n)
    bt[:, n:] = n + np.arange(rows * own_pages).reshape(rows, own_pages)
    return np.full(rows, shared + own, np.int32), bt, n + rows * own_pages


def shared_runtime(cal, rows, num_pages, width, **options):
    return SharedPagesRuntime(32, 8, 128, PAGE, torch.float16, max_batch=max(8, rows),
                              max_pages_per_row=width, num_pages=num_pages, engine_capture=True,
                              routes=ROUTES, calibration=cal,
                              options=RuntimeOptions(flashinfer=False, **options))


@pytest.fixture(scope="module")
def h200_with_sharing():
    cal = C.load_calibration(H200)
    if cal.sharing is None:   # the rule's outcome below is the fitted constant's (0.62 on the H200)
        cal = attrs.evolve(cal, sharing=C.SharingCost(0.62, "2026-12-05", "test", "test"))
    return cal


@pytest.mark.parametrize("rows, shared, own, cut, expect", [
    (8, 32768, 128, "time_model", True),    # a long prefix: read once wins by far (2.18x)
    (32, 4096, 256, "time_model", True),
    (16, 1024, 1024, "time_model", False),  # short prefix, long own rows: the shared path's extra decode loses
    (8, 2048, 64, "time_model", False),     # 2K prefix: the L2 serves the plain step's re-reads
    # two chunks re-reading an 8K / 12K prefix: shared at the time model's cut of their chunk
    # decode (8 splits: 1.17x / 1.43x), plain at the partition's (0.94x / 1.05x, the second
    # under routes.toml's margin)
    (8, 8192, 512, "time_model", True),
    (8, 12288, 512, "time_model", True),
    (8, 8192, 512, "partition", False),
    (8, 12288, 512, "partition", False),
])
def test_the_rule_shares_where_the_model_predicts_a_gain(fake_device, h200_with_sharing,  # noqa: F811
                                                         rows, shared, own, cut, expect):
    seq, bt, n = prefix_step(rows, shared, own)
    rt = shared_runtime(h200_with_sharing, rows, n, bt.shape[1], shared_chunk_cut=cut)
    rt.plan(seq, bt)
    p = rt.sharing_prediction
    assert p is not None and p["margin"] == rt.plain.registry.sharing_margin == 1.10
    assert (p["plain_us"] >= p["margin"] * p["shared_us"]) == expect, p
    assert (rt.plan_used is not None) == expect, rt.explain()
    assert f"[sharing] margin {p['margin']:g}" in rt.explain()
    # the ablation shares every step that saves min_saved of its reads
    always = shared_runtime(h200_with_sharing, rows, n, bt.shape[1], shared_when_predicted_faster=False)
    always.plan(seq, bt)
    assert always.plan_used is not None and always.sharing_prediction is None


def test_the_chunk_decodes_time_is_predicted_once_per_sharing_structure(fake_device, h200_with_sharing,  # noqa: F811
                                                                          monkeypatch):
    """Consecutive steps that share the same pages predict the chunk decode once: its lengths and
    tables are the structure's. Their decision stands until they read more than DECISION_DRIFT
    more pages than the step it was made at, then is made again as a fresh Runtime makes it,
    with the chunk time kept; a new structure, or the same one at another layer count, is
    predicted again."""
    grow = 80 * PAGE
    seq, bt, n = prefix_step(8, 32768, 127 + grow)   # room for the steps below
    seq = seq - grow
    rt = shared_runtime(h200_with_sharing, 8, n + 8, bt.shape[1])
    calls, plain = [], []
    predict, predict_plain = rt.shared.predict_step_us, rt.plain.predict_step_us
    # the chunk decode's predictions: its time, and (the time model's cut) each count's
    monkeypatch.setattr(rt.shared, "predict_step_us", lambda s, **kw: calls.append(1) or predict(s, **kw))
    monkeypatch.setattr(rt.plain, "predict_step_us", lambda s: plain.append(1) or predict_plain(s))
    decided, at, first, once = [], None, None, None
    for k in range(grow):
        before = len(plain)
        rt.plan(seq + k, bt)
        once = once or len(calls)
        assert rt.plan_used is not None and len(calls) == once
        assert rt.plan_used.own_seq.tolist() == (seq + k - 32768).tolist()   # this step's own lengths
        pages = int((-(-(seq + k) // PAGE)).sum())
        if len(plain) > before:
            assert at is None or pages > at * (1 + shared_mod.DECISION_DRIFT)
            decided.append(k)
            at = pages
        else:
            assert pages <= at * (1 + shared_mod.DECISION_DRIFT)
        first = first or rt.sharing_prediction
    assert len(decided) == 2 and decided[0] == 0
    fresh = shared_runtime(h200_with_sharing, 8, n + 8, bt.shape[1])
    fresh.plan(seq + decided[1], bt)
    rt.plan(seq + decided[1], bt)   # rows shorter than the step before: decided again
    assert rt.sharing_prediction == fresh.sharing_prediction != first
    other_seq, other_bt, _ = prefix_step(8, 16384, 127)   # a shorter prefix: another structure
    rt.plan(other_seq, other_bt)
    assert len(calls) > once
    again = len(calls)
    # the layers per plan the chunk Runtime's policy weighs host time at (its last step's run()
    # calls, set by its next plan()) are part of what the prediction depends on
    rt.shared._layers = 32
    rt.plan(other_seq + 1, other_bt)
    assert len(calls) > again


def test_the_l2_credit_moves_the_plain_prediction_by_the_rereads(fake_device, h200_with_sharing):  # noqa: F811
    """Without the calibration's sharing section the plain step is predicted at its every-row
    bytes; with it, lower by (1 - cost) x the re-reads' bytes at beta, exactly."""
    seq, bt, n = prefix_step(8, 8192, 512)
    got = {}
    for name, cal in (("none", attrs.evolve(h200_with_sharing, sharing=None)), ("fit", h200_with_sharing)):
        rt = shared_runtime(cal, 8, n, bt.shape[1])
        rt.plan(seq, bt)
        got[name] = rt.sharing_prediction
    rereads = sharing.page_rereads(seq, bt, PAGE)
    assert rereads == 7 * (8192 // PAGE)
    page_bytes = 2 * 8 * PAGE * 128 * 2
    sec = h200_with_sharing.sharing
    per_read = (1 - sec.l2_reread_cost) * page_bytes / (h200_with_sharing.beta_gbps * 1e3)
    assert got["none"]["plain_us"] - got["fit"]["plain_us"] == pytest.approx(per_read * rereads)
    # the shared side: 8 rows are two chunks of 4 (16 query heads), both reading the prefix (one
    # chunk's reads are re-reads: the same credit), and the measured overhead in place of the
    # chunk gather's and the merge's launches
    assert sec.overhead_us is not None
    lam = h200_with_sharing.lambda_graph_us
    assert got["none"]["shared_us"] - got["fit"]["shared_us"] == pytest.approx(
        per_read * (8192 // PAGE) + 2 * lam - sec.overhead_us)
    # eager launches (no graphs): the overhead, measured in graphs, is not used; the launches
    # are counted at lambda_us
    eager = SharedPagesRuntime(32, 8, 128, PAGE, torch.float16, max_batch=8, max_pages_per_row=bt.shape[1],
                               num_pages=n, routes=ROUTES, calibration=h200_with_sharing,
                               options=RuntimeOptions(flashinfer=False, use_cuda_graph=False))
    assert not eager.plain.router.graphs
    eager.plan(seq, bt)
    sp = sharing.plan_sharing(seq, bt, PAGE, 4, capacity=16)   # two chunks of 4 rows
    want = (eager.shared.predict_step_us(sp.chunk_seq) - per_read * (8192 // PAGE)
            + eager.own.predict_step_us(sp.own_seq) + 2 * h200_with_sharing.lambda_us)
    assert eager.sharing_prediction["shared_us"] == pytest.approx(want)


def test_plain_step_us_and_the_fit():
    assert sharing.plain_step_us(100.0, 0, 4096, 4000.0, 0.5) == 100.0
    # 1000 re-reads of 4 MB at 4 GB/s-ms... : (1 - 0.25) * 1000 * 4000 / 4e6 = 0.75 us
    assert sharing.plain_step_us(10.0, 1000, 4000, 4000.0, 0.25) == pytest.approx(9.25)
    assert sharing.plain_step_us(1.0, 10**9, 4000, 4000.0, 0.0) == 0.0   # never below zero
    # steps made by a known cost, with noise: the fit finds it
    rng = np.random.default_rng(5)
    steps = []
    for _ in range(8):
        model, x = rng.uniform(20, 300), rng.uniform(10, 200)
        steps.append((model - (1 - 0.6) * x + rng.normal(0, 0.2), model, x))
    assert sharing.fit_l2_reread_cost(steps) == pytest.approx(0.6, abs=0.01)
    # a model that under-predicts: no credit (cost 1); one far over: the floor 0.05
    assert sharing.fit_l2_reread_cost([(110.0, 100.0, 50.0)]) == 1.0
    assert sharing.fit_l2_reread_cost([(1.0, 100.0, 50.0)]) == pytest.approx(0.05)
    with pytest.raises(ValueError, match="no measured step re-reads"):
        sharing.fit_l2_reread_cost([(10.0, 10.0, 0.0)])


@pytest.mark.parametrize("section, key, expected", [
    ({"l2_reread_cost": 1.5}, "sharing.l2_reread_cost", "(0, 1]"),
    ({"l2_reread_cost": 0}, "sharing.l2_reread_cost", "a finite positive number"),
    ({"l2_reread_cost": "0.6"}, "sharing.l2_reread_cost", "a number"),
    ({"l2_reread_cost": None}, "sharing.l2_reread_cost", "present (missing)"),
    ({"extra": 1}, "sharing.extra", "'overhead_us'] (unknown key)"),
    ({"date": "today"}, "sharing.date", "an ISO date"),
    ({"overhead_us": -1.0}, "sharing.overhead_us", "a finite number >= 0"),
    ({"overhead_us": "14"}, "sharing.overhead_us", "a number"),
    ([0.6], "sharing", "a JSON object"),
])
def test_a_bad_sharing_section_names_its_key(tmp_path, section, key, expected):
    doc = json.loads(open(H200).read())
    good = {"l2_reread_cost": 0.6, "date": "2026-12-05", "command": "c", "source": "s"}
    if isinstance(section, dict):
        good.update(section)
        section = {k: v for k, v in good.items() if v is not None}
    doc["sharing"] = section
    p = tmp_path / "gpu.json"
    p.write_text(json.dumps(doc))
    with pytest.raises(C.CalibrationError) as info:
        C.load_calibration(p)
    msg = str(info.value)
    assert msg.startswith(f"{p}: key {key!r}") and expected in msg, msg


def test_fit_l2_writes_the_section_and_keeps_the_rest(tmp_path):
    """benches/shared_pages.py --fit-l2 on committed results (no GPU): the section written, every
    other constant of the file unchanged, the file loadable; a results file without a step of
    shared pages is refused, nothing written."""
    import importlib.util

    spec = importlib.util.spec_from_file_location("shared_pages", "benches/shared_pages.py")
    bench = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(bench)
    res = tmp_path / "res.json"
    rows = []
    for case, us in (("8x(32K+128)", 5300.0), ("32x(4K+256)", 2800.0), ("8x(0+8K)", 2100.0)):
        rows.append({"case": case, "engine": "pkvrt-device-plan", "status": "ok", "median_us": us})
    # shared steps timed in parts: 32 layers of 10, 12 and 20 us beyond the two decodes
    shared = [{"case": c, "engine": "pkvrt-shared-always", "status": "ok", "median_us": 32 * (a + b + x),
               "chunk_us": 32 * a, "own_us": 32 * b}
              for c, a, b, x in (("8x(32K+128)", 60.0, 6.0, 10.0), ("32x(4K+256)", 33.0, 14.0, 12.0),
                                 ("64x(2K+1K)", 33.0, 65.0, 20.0))]
    res.write_text(json.dumps({"meta": {}, "rows": rows + shared}))
    out = tmp_path / "cal.json"
    assert bench.main(["--fit-l2", str(res), "--calibration", H200, "--write", str(out)]) == 0
    base, new = json.loads(open(H200).read()), json.loads(out.read_text())
    sec = new.pop("sharing")
    base.pop("sharing", None)
    assert new == base
    assert 0.05 <= sec["l2_reread_cost"] <= 1.0 and "--fit-l2" in sec["command"]
    assert sec["overhead_us"] == pytest.approx(12.0)   # the median
    loaded = C.load_calibration(out).sharing
    assert (loaded.l2_reread_cost, loaded.overhead_us) == (sec["l2_reread_cost"], sec["overhead_us"])
    # a whole step faster than its parts alone (their overlap): the overhead is 0, not negative
    fast = [dict(r, median_us=r["chunk_us"] + r["own_us"] - 64.0) for r in shared]
    res.write_text(json.dumps({"meta": {}, "rows": rows + fast}))
    assert bench.main(["--fit-l2", str(res), "--calibration", H200, "--write", str(out)]) == 0
    assert C.load_calibration(out).sharing.overhead_us == 0.0
    # results without shared steps timed in parts: no overhead written (the launches count)
    res.write_text(json.dumps({"meta": {}, "rows": rows}))
    assert bench.main(["--fit-l2", str(res), "--calibration", H200, "--write", str(out)]) == 0
    assert "overhead_us" not in json.loads(out.read_text())["sharing"]
    assert C.load_calibration(out).sharing.overhead_us is None
    only_plain = tmp_path / "plain.json"
    only_plain.write_text(json.dumps({"meta": {}, "rows": rows[2:]}))
    out2 = tmp_path / "cal2.json"
    with pytest.raises(ValueError, match="no measured step re-reads"):
        bench.main(["--fit-l2", str(only_plain), "--calibration", H200, "--write", str(out2)])
    assert not out2.exists()


def test_the_margin_comes_from_routes_toml(fake_device, h200_with_sharing, tmp_path):  # noqa: F811
    """8 x (12K + 512) with its chunk decode cut by the partition, predicted a little faster
    shared (1.05x): shared under margin 1.0 (no table: any predicted gain), plain under the
    shipped 1.10, and a margin of inf never shares."""
    from pkvrt.policy.registry import load_routes

    text = open(ROUTES.path).read()
    shipped = "[sharing]\nmargin = 1.10\ndevice_margin = 1.0\nchunk_heads = 16\nmodel_cut_rows = 4\nmodel_cut_margin = 1.10\n"
    assert text.count(shipped) == 1
    seq, bt, n = prefix_step(8, 12288, 512)
    got = {}
    for name, table in (("none", ""), ("shipped", shipped), ("inf", "[sharing]\nmargin = inf\n"),
                        ("device", "[sharing]\nmargin = 1.10\ndevice_margin = 0.5\n")):
        path = tmp_path / f"{name}.toml"
        path.write_text(text.replace(shipped, table))
        if name == "device":
            with pytest.raises(Exception, match=r"device_margin: .*0.5.*expected a number >= 1.0 or inf"):
                load_routes(path)
            continue
        rt = SharedPagesRuntime(32, 8, 128, PAGE, torch.float16, max_batch=8, max_pages_per_row=bt.shape[1],
                                num_pages=n, engine_capture=True, routes=load_routes(path),
                                calibration=h200_with_sharing,
                                options=RuntimeOptions(flashinfer=False, shared_chunk_cut="partition"))
        rt.plan(seq, bt)
        got[name] = (rt.plain.registry.sharing_margin, rt.plain.registry.sharing_device_margin,
                     rt.plan_used is not None)
    # the device rule's margin: the key, 1.0 without it
    assert got == {"none": (1.0, 1.0, True), "shipped": (1.10, 1.0, False),
                   "inf": (float("inf"), 1.0, False)}


def test_a_kept_decision_to_share_yields_to_min_saved(fake_device, h200_with_sharing):  # noqa: F811
    """A step that follows a shared one, inside the decision's drift, but whose plan no longer
    saves min_saved of the reads, runs plain with no prediction (as deciding afresh says), and
    the next step decides again."""
    seq, bt, n = prefix_step(8, 32768, 127 + PAGE)
    seq = seq - PAGE   # one token short of a page
    saved = sharing.plan_sharing(seq, bt, PAGE, 4, capacity=16).saved_fraction
    rt = SharedPagesRuntime(32, 8, 128, PAGE, torch.float16, max_batch=8, max_pages_per_row=bt.shape[1],
                            num_pages=n + 8, engine_capture=True, routes=ROUTES, calibration=h200_with_sharing,
                            min_saved=saved, options=RuntimeOptions(flashinfer=False))
    rt.plan(seq, bt)
    assert rt.plan_used is not None and rt.sharing_prediction is not None
    rt.plan(seq + 2, bt)   # a page more each: saves a little less than min_saved
    assert rt._steps.followed and rt.plan_used is None and rt.sharing_prediction is None
    assert rt._kept is None
