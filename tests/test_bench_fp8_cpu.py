"""`pkvrt bench serving --kv-dtype fp8` without a GPU (the FP8 engine protocol): the arguments
and their refusals, the FP8 workload (quantized caches, per-layer scale tensors), the harness's
whole loop with the real pkvrt engines (Runtime, device planning, the whole-step graph) on the
fake device of test_runtime_cpu.py and FlashInfer stand-ins that take host-float scales as its
FP8 paths do, the correctness rule (FP32 over the dequantized cache; a FlashInfer path may
instead be within the FP8 error bound), the results meta and the report; and that a 16-bit run
is what it was. FlashInfer's real FP8 paths and the kernels run on the H200 only
(benches/h200_engine.sh with KV_DTYPE=fp8)."""

from __future__ import annotations

import math
import time

import numpy as np
import pytest
import torch

from pkvrt import reference
from pkvrt.launch import ops
from pkvrt.measure import fi_engines, harness, results
from pkvrt.measure.traces import Request, Trace
from pkvrt.policy.registry import load_routes
from pkvrt.tools import bench, report
from pkvrt.tools.plan_cmd import seed_calibration
from test_bench_cpu import no_cuda, run  # noqa: F401
from test_runtime_cpu import fake_device  # noqa: F401

FP8 = torch.float8_e4m3fn
SHAPE = harness.Shape(num_qo_heads=8, num_kv_heads=2, head_dim=64, page_size=16)
REGISTRY = load_routes(None)
PKVRT_ENGINES = ("adaptive", "device-plan", "device-plan-step", "host-step", "pkv_workqueue")
CUDNN_FP8 = ("cudnn decode backend requires q, kv and o to share one fp16 or bf16 dtype; got "
             "q=torch.float16, kv=torch.float8_e4m3fn, o=torch.float16.")   # FlashInfer 0.7.2
# the keys of a timed 16-bit serving row (no FP8 key may appear there)
FP16_ROW_KEYS = {"case", "engine", "row", "seed", "baseline", "correct", "max_err", "mean_err",
                 "max_err_ref", "mean_err_ref", "checked_steps", "steps_total", "cache_copies",
                 "device_uncovered_steps", "steps", "decode_tokens", "median_us", "mean_cuda_us",
                 "wall_us", "mean_wall_us", "tok_per_s", "cuda_tok_per_s", "route", "route_mix",
                 "splits", "split_main", "launches_per_step", "cta_work_per_sm", "useful_kv_mb",
                 "merge_mb", "merge_launches", "mean_active", "timed_passes"}


def _trace():
    reqs = (Request(0, 0, 600, 4), Request(1, 0, 100, 3), Request(2, 1, 900, 3))
    return Trace(name="tiny", requests=reqs, seed=None, source="test")


def _config(**kw):
    base = dict(trace="tiny", max_active=2, seeds=(11,), steps_limit=4, check_steps=2, probe_steps=2,
                layers=2, engines=("flashinfer", *PKVRT_ENGINES), shape=SHAPE, kv_dtype="fp8")
    return harness.ServingConfig(**{**base, **kw})


def _workload(**kw):
    return harness.Workload(_trace(), _config(**kw), 11, device="cpu", budget_bytes=2**30)


# --------------------------------------------------------------------------- arguments

def test_kv_dtype_and_scale_mode_reach_the_config(capsys, no_cuda, monkeypatch):
    seen = []
    monkeypatch.setattr(bench, "planner_fallback", lambda args, config, reg, traces: seen.append(config) or 0)
    for argv, kv, scales in ((["--kv-dtype", "fp8", "--fp8-scales", "amax"], "fp8", "amax"),
                             (["--kv-dtype", "fp8"], "fp8", "unit"),
                             ([], "fp16", "unit")):
        rc, _, err = run(capsys, "bench", "serving", "--seeds", "1", *argv)
        assert rc == 0, err
        assert (seen[-1].kv_dtype, seen[-1].fp8_scales, seen[-1].fp8) == (kv, scales, kv == "fp8")


@pytest.mark.parametrize("argv, message", [
    (["--kv-dtype", "fp4"], "argument --kv-dtype: invalid choice: 'fp4'"),
    (["--kv-dtype", "fp8", "--fp8-scales", "per-head"], "argument --fp8-scales: invalid choice: 'per-head'"),
    (["--fp8-scales", "amax"], "--fp8-scales amax: scales belong to an FP8 KV cache; add --kv-dtype fp8"),
    (["--kv-dtype", "fp8", "--engines", "adaptive,flashinfer-graph"],
     "--engines flashinfer-graph: with --kv-dtype fp8 the Runtime does not run FlashInfer"),
])
def test_bad_kv_arguments_are_refused(capsys, no_cuda, argv, message):
    rc, out, err = run(capsys, "bench", "serving", *argv)
    assert rc == 2 and message in err and out == ""


def test_config_and_helpers_refuse_bad_values():
    with pytest.raises(ValueError, match=r"kv_dtype='int8': expected one of fp16, fp8"):
        _config(kv_dtype="int8")
    with pytest.raises(ValueError, match=r"fp8_scales='head': expected one of unit, amax"):
        _config(fp8_scales="head")
    with pytest.raises(ValueError, match=r"fp8_scales='x': expected one of unit, amax"):
        harness.quantize_fp8(torch.zeros(1, 1, 1, 1), "x")
    # a forced route whose routes.toml kv_dtypes lack FP8 cannot be an FP8 engine
    served = {"pkv_bucket": ("float16", "bfloat16"), "pkv_fused": ("float16", "float8_e4m3fn"),
              "flashinfer": ("float16",)}
    with pytest.raises(ValueError, match=r"--engines pkv_bucket: route 'pkv_bucket' does not serve "
                                         r"an FP8 KV cache \(kv_dtypes = \['float16', 'bfloat16'\]"):
        harness.check_fp8_engines(("flashinfer", "adaptive", "pkv_bucket"), served)
    with pytest.raises(ValueError, match="--engines device-plan:pkv_bucket: route 'pkv_bucket'"):
        harness.check_fp8_engines(("device-plan:pkv_bucket",), served)
    harness.check_fp8_engines(("flashinfer", "flashinfer-xqa", "device-plan-step:pkv_fused"), served)


def test_case_names_and_default_out_carry_fp8():
    assert harness.case_name("bimodal", 8, 7, layers=32, kv_dtype="fp8") == "bimodal-B8-L32-fp8-seed7"
    assert harness.case_name("bimodal", 8, None, kv_dtype="fp8") == "bimodal-B8-fp8"
    assert harness.case_name("bimodal", 8, 7, layers=32) == "bimodal-B8-L32-seed7"   # 16-bit: as before
    cfg = _config(trace="bimodal", max_active=8, layers=32)
    assert bench.default_out(cfg, "NVIDIA H200").name == "serving-bimodal-B8-L32-fp8.json"
    assert bench.default_out(_config(trace="bimodal", max_active=8, layers=32, kv_dtype="fp16"),
                             "NVIDIA H200").name == "serving-bimodal-B8-L32.json"


def test_fp8_planner_fallback_names_fp8(capsys, tmp_path, no_cuda):
    out_file = tmp_path / "plan.json"
    rc, out, err = run(capsys, "bench", "serving", "--kv-dtype", "fp8", "--seeds", "5",
                       "--max-active", "4", "--out", str(out_file))
    assert rc == 0, err
    assert "KV cache float8_e4m3fn" in out and "does not run the FlashInfer route" in out
    doc = results.read_results(out_file)
    assert {r["case"] for r in doc["rows"]} == {"bimodal-B4-fp8-seed5"}
    assert doc["meta"]["kv_dtype"] == "float8_e4m3fn" and doc["meta"]["fp8_scales"] == "unit"


# --------------------------------------------------------------------------- the workload

@pytest.mark.parametrize("mode", ["unit", "amax"])
def test_fp8_workload_quantizes_the_fp16_caches(mode):
    wl16 = _workload(kv_dtype="fp16")
    wl = _workload(fp8_scales=mode)
    assert wl.fp8 and wl.kv_dtype == FP8 and wl.kv_dtype_bytes == 1 and all(k.dtype == FP8 for k in wl.k)
    assert torch.equal(wl.q, wl16.q)                           # same draw: same q ...
    assert torch.equal(wl.k_src, wl16.k[0]) and torch.equal(wl.v_src, wl16.v[0])   # ... and K/V
    ks, vs = wl.scales(0)["k_scale"], wl.scales(0)["v_scale"]
    if mode == "unit":
        assert wl.scale_floats == (1.0, 1.0) and torch.equal(wl.k[0], wl16.k[0].to(FP8))
    else:
        amax = float(wl16.k[0].float().abs().max())
        assert float(ks) == pytest.approx(amax / reference.FP8_MAX)
        assert wl.scale_floats == (float(ks), float(vs))
        err = (wl.k[0].float() * ks - wl16.k[0].float()).abs()
        assert float(err.max()) <= 2 ** -4 * amax + 1e-6        # e4m3 rounding of the scaled values
    # one scale tensor pair per layer: separate tensors (graph inputs), the same values
    layers = [wl.scales(i) for i in range(wl.layers)]
    assert len({s["k_scale"].data_ptr() for s in layers}) == wl.layers == 2
    assert all(s["k_scale"].dtype == torch.float32 and s["k_scale"].shape == (1,) for s in layers)
    assert all(torch.equal(s["v_scale"], vs) for s in layers)
    assert wl16.scales(0) == {} and wl16.k_src is None and wl16.kv_dtype_bytes == 2
    # every row of a checked step, against the dequantized cache, plus the unquantized answer
    r = harness.reference_rows(wl, wl.steps[-1])
    assert r.rows.tolist() == list(range(len(wl.steps[-1].rids))) and r.fp8_bound > 0
    assert r.exact.dtype == torch.float64 and r.ref.dtype == torch.float32
    wl.drop_source()
    with pytest.raises(RuntimeError, match="the fp16 source of the FP8 cache was dropped"):
        harness.reference_rows(wl, wl.steps[-1])


# --------------------------------------------------------------------------- engines, the loop

def attention(q, k, v, seq, bt, ks, vs, p_fp8=False):
    """FP32 decode attention over FP8 pages with host-float scales; ``p_fp8`` rounds the
    unnormalized probabilities exp(x - max) to e4m3 before P.V, as XQA's FP8 kernel does."""
    if not p_fp8:
        return reference.decode_attention(q, k, v, seq, bt, k_scale=torch.tensor([ks]),
                                          v_scale=torch.tensor([vs]))
    out = torch.empty(q.shape)
    hkv, d = k.shape[1], q.shape[2]
    for i, n in enumerate(seq.tolist()):
        kk = reference.gather_kv(k, bt[i], n).float() * ks              # [H_kv, N, D]
        vv = reference.gather_kv(v, bt[i], n).float() * vs
        x = torch.einsum("hgd,hnd->hgn", q[i].float().view(hkv, -1, d), kk) / math.sqrt(d)
        p = torch.exp(x - x.amax(-1, keepdim=True))
        o = torch.einsum("hgn,hnd->hgd", p.to(FP8).float(), vv) / p.sum(-1, keepdim=True)
        out[i] = o.reshape(-1, d)
    return out


class VirtualClock(harness.HostClock):
    """HostClock plus virtual seconds: a fake path's delay advances ``offset`` instead of
    sleeping, so which path the baseline probe finds fastest does not depend on how busy the CPU
    is (a real 50 ms sleep per plan lost to CPU noise twice on 2026-12-01, the XQA-like path's
    Python loop being the slowest to compute)."""

    def __init__(self):
        self.offset = 0.0

    def start(self, cover_us: float):
        return time.perf_counter(), self.offset

    def stop(self, token) -> float:
        t0, offset = token
        return (time.perf_counter() - t0 + self.offset - offset) * 1e6


class FakeFlashInfer(fi_engines._Counters):
    """A FlashInfer path as the harness drives one: its scales are the workload's host floats
    (``fi_engines.kv_format``), the layer's scale tensors it is handed are not read. ``p_fp8``:
    XQA-like rounding of P (beyond the fp16 tolerance on short rows, inside the FP8 bound);
    ``v_scale_lost``: forgets V's scale (wrong); ``delay_s``: a slower path (virtual seconds on
    ``clock``, a :class:`VirtualClock`; slept without one)."""

    def __init__(self, label, wl, *, p_fp8=False, v_scale_lost=False, delay_s=0.0, clock=None):
        self.label, self.wl, self.shape = label, wl, wl.shape
        self.kv_dtype, self.scales = fi_engines.kv_format(wl)
        self.p_fp8, self.v_scale_lost, self.delay_s = p_fp8, v_scale_lost, delay_s
        self.clock = clock
        self.calls = []

    def plan(self, step):
        if self.clock is not None:
            self.clock.offset += self.delay_s
        else:
            time.sleep(self.delay_s)
        self._last_info = step.seq_lens
        self.seq = torch.from_numpy(step.seq_lens.astype(np.int32))
        self.bt = torch.from_numpy(self.wl.layout.block_table(step.rids))

    def attend(self, q, k, v, out, **scales):
        self.calls.append(sorted(scales))
        assert k.dtype == self.kv_dtype
        if self.kv_dtype != FP8:
            out.copy_(reference.decode_attention(q, k, v, self.seq, self.bt))
            return
        ks, vs = self.scales["k_scale"], 1.0 if self.v_scale_lost else self.scales["v_scale"]
        out.copy_(attention(q, k, v, self.seq, self.bt, ks, vs, self.p_fp8))


def _run(config, *, fast="flashinfer-xqa", fi_kwargs=None):
    """run_seed on the fake device: the real pkvrt engines of ``bench.engine_factory``, FlashInfer
    stand-ins (cuDNN refuses FP8 K/V as FlashInfer 0.7.2 does; every path but ``fast`` slower)."""
    made, fi_kwargs = {}, fi_kwargs or {}
    clock = VirtualClock()

    def flashinfer(name, wl, *, max_active):
        if name == "flashinfer-cudnn" and wl.fp8:
            raise NotImplementedError(CUDNN_FP8)
        made[name] = FakeFlashInfer(name, wl, delay_s=0.0 if name == fast else 1.0, clock=clock,
                                    **fi_kwargs.get(name, {}))
        return made[name]

    factory = bench.engine_factory(config, REGISTRY, seed_calibration(), flashinfer=flashinfer)

    def make_engine(name, wl, fi_route):
        made["wl"] = wl
        made[name] = made.get(name) or factory(name, wl, fi_route)
        return made[name]
    logs = []
    rows, steps, info = harness.run_seed(config, 11, _trace(), make_engine, clock=clock,
                                         device="cpu", budget_bytes=2**30, log=logs.append)
    return rows, steps, info, made, logs


@pytest.mark.slow
@pytest.mark.parametrize("mode", ["unit", "amax"])
def test_fp8_engine_protocol_on_the_fake_device(fake_device, monkeypatch, tmp_path, mode):  # noqa: F811
    """Every pkvrt engine runs FP8 pages with each layer's scale tensors and matches the FP32
    reference over the dequantized cache; the XQA-like path, the fastest, is the baseline although
    it is outside the fp16 tolerance (within the FP8 bound); cuDNN is unavailable with its reason."""
    launches = []
    real = ops.workqueue_decode

    def recording(*a, k_scale=None, v_scale=None, **kw):
        launches.append((k_scale.data_ptr(), v_scale.data_ptr(), a[1].dtype))
        return real(*a, k_scale=k_scale, v_scale=v_scale, **kw)
    monkeypatch.setattr(ops, "workqueue_decode", recording)
    rows, steps, info, made, logs = _run(_config(fp8_scales=mode),
                                         fi_kwargs={"flashinfer-xqa": dict(p_fp8=True)})
    wl = made["wl"]
    assert info["baseline"] == "flashinfer-xqa"
    assert info["baseline_candidates"]["flashinfer-cudnn"] == f"unavailable: NotImplementedError: {CUDNN_FP8}"
    assert {k for k, v in info["baseline_candidates"].items() if v == "ok"} == {
        "flashinfer-cuda", "flashinfer-tc", "flashinfer-xqa"}
    measured = {r["engine"]: r for r in rows if r["row"] == "measured"}
    assert list(measured) == ["flashinfer-xqa", "pkvrt-adaptive", "pkvrt-device-plan",
                              "pkvrt-device-plan-step", "pkvrt-host-step", "pkvrt-workqueue"]
    base = measured["flashinfer-xqa"]
    assert base["baseline"] and base["correct"] and base["within_fp8_bound"]
    assert not harness.within_tolerance(base["max_err_ref"], base["mean_err_ref"])
    for label in measured:
        r = measured[label]
        assert r["case"] == "tiny-B2-L2-fp8-seed11" and r["correct"] and r["checked_steps"] == 2
        assert r["err_norm_unquantized"] <= r["fp8_bound"]
        if label != "flashinfer-xqa":   # pkvrt: exact to the dequantized cache, not to XQA's output
            assert harness.within_tolerance(r["max_err_ref"], r["mean_err_ref"]), r
            assert r["max_err"] > 2e-3      # vs the baseline's output: recorded, not the verdict
    assert [r["numerator"] for r in rows if r["row"] == "ratio"] == list(measured)[1:]
    assert len(steps) == len(measured) * len(wl.steps)
    # the Runtime of every pkvrt engine serves FP8; its graph bound covers a graph per layer's scales
    for name in PKVRT_ENGINES:
        assert made[name].rt.kv_dtype == FP8 and made[name].rt.dtype == torch.float16
    assert made["adaptive"].rt.stats()["max_graphs"] == 64 * wl.copies * wl.layers
    # every launch read FP8 pages with one of the layers' scale tensors, and both layers' were used
    layers = {(s["k_scale"].data_ptr(), s["v_scale"].data_ptr()) for s in map(wl.scales, range(wl.layers))}
    assert {(k, v) for k, v, _ in launches} == layers and {d for *_, d in launches} == {FP8}
    # FlashInfer's paths get their host floats, and the layer's tensors through attend()
    assert made["flashinfer-tc"].scales == dict(k_scale=wl.scale_floats[0], v_scale=wl.scale_floats[1])
    assert made["flashinfer-tc"].calls[0] == ["k_scale", "v_scale"]
    assert wl.k_src is None                                  # the fp16 source was freed
    # the FlashInfer counters count 1-byte K/V
    route, _, c = made["flashinfer-xqa"].step_info()
    assert route == "flashinfer" and c.useful_kv_bytes == int(wl.steps[-1].seq_lens.sum()) * 2 * 2 * 64
    assert any("KV float8_e4m3fn" in line for line in logs)
    # the files as `bench serving` writes them render in the report, apart from any fp16 trace
    meta = {"kind": "serving", "kv_dtype": "float8_e4m3fn", "layers": 2, "shape": {"num_kv_heads": 2,
                                                                                 "head_dim": 64}}
    results.write_results(tmp_path / "s.json", meta, rows)
    results.write_results(tmp_path / "s.steps.json", {**meta, "kind": "serving-steps"}, steps)
    md, _ = report.build_report(report.load_dir(tmp_path), tmp_path, plots=False)
    assert "| tiny-B2-L2-fp8 | pkvrt-device-plan-step |" in md and report.FP8_ERRORS_NOTE in md


@pytest.mark.parametrize("name", ["device-plan-step", "host-step", "device-plan", "pkv_workqueue"])
def test_each_layer_runs_with_its_own_scale_tensors(fake_device, monkeypatch, name):  # noqa: F811
    wl = _workload(fp8_scales="amax")
    seen = []
    real = ops.workqueue_decode

    def recording(*a, k_scale=None, v_scale=None, **kw):
        seen.append((k_scale.data_ptr(), v_scale.data_ptr()))
        return real(*a, k_scale=k_scale, v_scale=v_scale, **kw)
    monkeypatch.setattr(ops, "workqueue_decode", recording)
    eng = bench.engine_factory(_config(fp8_scales="amax"), REGISTRY, seed_calibration())(name, wl, None)
    out = torch.full((2, 8, 64), math.nan, dtype=torch.float16)
    step = wl.steps[0]
    harness.run_step(eng, wl, step, 0, out)
    layers = [(s["k_scale"].data_ptr(), s["v_scale"].data_ptr()) for s in map(wl.scales, range(wl.layers))]
    assert seen[-wl.layers:] == layers                   # the last run of each layer, in order
    c = harness.check_output(out[:len(step.rids)], harness.reference_rows(wl, step))
    assert harness.within_tolerance(c["max_err_ref"], c["mean_err_ref"]), c


@pytest.mark.parametrize("name, graphs", [("adaptive", True), ("adaptive-eager", False)])
def test_adaptive_eager_is_the_default_runtime_without_graphs(fake_device, name, graphs):  # noqa: F811
    """``adaptive-eager``: the same host-routed Runtime as ``adaptive`` with ``use_cuda_graph``
    off (each run() launches its kernels; no graph is captured or replayed), exact either way."""
    config = _config(kv_dtype="fp16", engines=("flashinfer", name))
    wl = _workload(kv_dtype="fp16")
    eng = bench.engine_factory(config, REGISTRY, seed_calibration())(name, wl, None)
    assert eng.label == f"pkvrt-{name}" and eng.force is None
    assert eng.rt.use_cuda_graph is graphs
    out = torch.full((2, 8, 64), math.nan, dtype=torch.float16)
    for pos, step in enumerate(wl.steps[:3]):
        harness.run_step(eng, wl, step, pos, out)
        c = harness.check_output(out[:len(step.rids)], harness.reference_rows(wl, step))
        assert harness.within_tolerance(c["max_err_ref"], c["mean_err_ref"]), c
    s = eng.rt.stats()
    assert (s["captures"] + s["replays"] > 0) is graphs, s


def test_fp8_verdict_is_the_dequantized_reference_or_for_flashinfer_the_bound(fake_device):  # noqa: F811
    """measure_engine's FP8 rule on one workload: the XQA-like output is correct for a FlashInfer
    path (within the FP8 bound) and wrong for a pkvrt engine (outside the fp16 tolerance of the
    dequantized reference); a path that loses V's scale is wrong either way, and the probe says
    why (wrong_output)."""
    wl = _workload(fp8_scales="amax", layers=1)
    refs = {pos: harness.reference_rows(wl, wl.steps[pos])
            for pos in harness.check_positions(len(wl.steps), 2)}
    out = torch.full((2, 8, 64), math.nan, dtype=torch.float16)
    clock = harness.HostClock()

    def measure(label, baseline=False, **kw):
        eng = FakeFlashInfer(label, wl, **kw)
        row, _ = harness.measure_engine(eng, wl, clock, case="c", seed=1, fi_outs=fi_outs, refs=refs,
                                        out=out, baseline=baseline, log=lambda m: None)
        return row
    fi_outs = {}
    exact = measure("flashinfer-tc", baseline=True)
    assert exact["correct"] and exact["max_err_ref"] < 1e-3 and exact["within_fp8_bound"]
    assert measure("flashinfer-xqa", p_fp8=True)["correct"]
    pkvrt_like = measure("pkvrt-fused", p_fp8=True)
    assert not pkvrt_like["correct"] and pkvrt_like["within_fp8_bound"] and "tok_per_s" not in pkvrt_like
    lost = measure("flashinfer-cuda", v_scale_lost=True)
    assert not lost["correct"] and not lost["within_fp8_bound"]
    eng = FakeFlashInfer("flashinfer-cuda", wl, v_scale_lost=True)
    kept = harness.untimed_pass(eng, wl, wl.steps, out, clock, keep=tuple(refs))
    why = harness.wrong_output(kept, refs, wl.steps)
    assert why.startswith("wrong output on step 0: vs FP32 max|e| ") and "FP8 bound" in why
    eng = FakeFlashInfer("flashinfer-xqa", wl, p_fp8=True)
    assert harness.wrong_output(harness.untimed_pass(eng, wl, wl.steps, out, clock, keep=tuple(refs)),
                                refs, wl.steps) is None


def test_fp16_run_is_unchanged(fake_device):  # noqa: F811
    """A 16-bit run: no -fp8 in the names, no FP8 key in the rows, two reference rows per checked
    step, the Runtime built as before (no kv_dtype asked for, 64 graphs per cache copy), and the
    FlashInfer paths called without scales."""
    config = _config(kv_dtype="fp16", engines=("flashinfer", "device-plan-step", "pkv_workqueue"))
    with pytest.warns(RuntimeWarning, match="FlashInfer route is unavailable"):
        rows, steps, info, made, _ = _run(config, fast="flashinfer-tc")
    measured = [r for r in rows if r["row"] == "measured"]
    assert [r["engine"] for r in measured] == ["flashinfer-tc", "pkvrt-device-plan-step", "pkvrt-workqueue"]
    for r in measured:
        assert r["case"] == "tiny-B2-L2-seed11" and r["correct"]
        assert set(r) - {k for k in r if k.startswith("rt_")} <= FP16_ROW_KEYS, set(r) - FP16_ROW_KEYS
    assert info["baseline_candidates"] == dict.fromkeys(harness.FI_VARIANTS, "ok")
    wl = made["wl"]
    assert len(harness.reference_rows(wl, wl.steps[0]).rows) == harness.REF_ROWS
    assert "kv_dtype" not in made["pkv_workqueue"].kwargs
    assert made["pkv_workqueue"].rt.kv_dtype == torch.float16
    assert made["pkv_workqueue"].rt.stats()["max_graphs"] == 64 * wl.copies
    assert {tuple(c) for c in made["flashinfer-tc"].calls} == {()}


# --------------------------------------------------------------------------- meta and report

def test_results_meta_records_the_kv_dtype(tmp_path):
    from types import SimpleNamespace as NS

    def meta_of(config):
        out = tmp_path / f"{config.kv_dtype}.json"
        bench._write(out, config, NS(path=None), NS(source=None, slug="x", fallback=False),
                     NS(cycles_per_us=1.0), [_trace()], {"11": {}}, [], [])
        return results.read_results(out)["meta"], results.read_results(bench.steps_path(out))["meta"]
    meta, steps_meta = meta_of(_config(fp8_scales="amax"))
    for m in (meta, steps_meta):
        assert (m["kv_dtype"], m["fp8_scales"], m["fp8_scale_granularity"]) == (
            "float8_e4m3fn", "amax", "tensor")
    assert "FP8 KV cache" in meta["protocol"] and "fp8_error_bound" in meta["protocol"]
    meta16, _ = meta_of(_config(kv_dtype="fp16"))
    assert "kv_dtype" not in meta16 and "fp8_scales" not in meta16
    assert meta16["protocol"].endswith("layers share one KV cache rotated over L2-defeating copies")


def test_report_keeps_fp8_rows_apart_and_counts_one_byte_per_element(tmp_path, capsys):
    def rec(engine, cuda_us, baseline=False):
        return {"case": case, "engine": engine, "seed": 1, "baseline": baseline, "step": 0, "active": 8,
                "max_context": 32768, "mean_context": 32768.0, "route": "r", "split_max": None,
                "wall_us": cuda_us, "cuda_us": cuda_us}
    for kv in ("fp16", "fp8"):
        case = harness.case_name("bimodal", 8, 1, layers=32, kv_dtype=kv)
        meta = {"kind": "serving-steps", "layers": 32, "date": "2026-12-02",
                "shape": {"num_kv_heads": 8, "head_dim": 128}}
        if kv == "fp8":
            meta.update(kv_dtype="float8_e4m3fn")
        rows = [rec("flashinfer-xqa", 100.0, True), rec("pkvrt-device-plan-step", 80.0)]
        results.write_results(tmp_path / f"engine-{kv}.steps.json", meta, rows)
    files = report.load_dir(tmp_path)
    got = {r["trace"]: r for r in report.engine_protocol_rows(files)}
    assert set(got) == {"bimodal-B8-L32", "bimodal-B8-L32-fp8"}     # never merged
    assert got["bimodal-B8-L32-fp8"]["floor_fraction"] == pytest.approx(
        got["bimodal-B8-L32"]["floor_fraction"] / 2)                 # half the bytes, same time
    r16 = {"active": 8, "mean_context": 32768.0}
    assert report.step_floor_us(r16, {"layers": 32, "kv_dtype": "float8_e4m3fn"}) == pytest.approx(
        report.step_floor_us(r16, {"layers": 32}) / 2)
    assert report.kv_element_bytes({}) == 2 and report.kv_element_bytes({"kv_dtype": "bfloat16"}) == 2


def test_report_table_2_shows_fp8_rows_with_their_reference_errors(tmp_path):
    def row(case, engine, tok, max_err, max_err_ref, baseline=False, fp8=False):
        r = {"case": case, "engine": engine, "row": "measured", "seed": 1, "baseline": baseline,
             "correct": True, "median_us": 1e6 / tok, "wall_us": 1e6 / tok, "tok_per_s": tok,
             "cuda_tok_per_s": tok, "max_err": max_err, "mean_err": max_err / 10,
             "max_err_ref": max_err_ref, "mean_err_ref": max_err_ref / 10, "route": "r"}
        return dict(r, within_fp8_bound=True) if fp8 else r
    c16, c8 = (harness.case_name("bimodal", 8, 1, layers=32, kv_dtype=kv) for kv in ("fp16", "fp8"))
    results.write_results(tmp_path / "a.json", {"kind": "serving"}, [
        row(c16, "flashinfer-tc", 100.0, 0.0, 2e-5, baseline=True),
        row(c16, "pkvrt-device-plan-step", 104.0, 1.2e-4, 3e-5)])
    alone = report.serving_table(report.load_dir(tmp_path))
    assert "-fp8" not in alone and report.FP8_ERRORS_NOTE not in alone
    results.write_results(tmp_path / "b.json", {"kind": "serving", "kv_dtype": "float8_e4m3fn"}, [
        row(c8, "flashinfer-xqa", 150.0, 0.0, 4e-3, baseline=True, fp8=True),
        row(c8, "pkvrt-device-plan-step", 190.0, 4.1e-3, 2.5e-5, fp8=True)])
    both = report.serving_table(report.load_dir(tmp_path))
    assert both.startswith(alone.rstrip()[: alone.index("\n")])        # same header
    for line in alone.splitlines()[2:]:
        assert line in both                                              # fp16 rows as they were
    fp8_line = next(ln for ln in both.splitlines() if ln.startswith("| bimodal-B8-L32-fp8 | pkvrt-"))
    assert fp8_line.endswith("| 1.267 | 1.267 | 2.500e-05 | 2.500e-06 |")   # not 4.1e-03 vs XQA
    assert both.endswith(report.FP8_ERRORS_NOTE)
