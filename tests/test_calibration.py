"""Calibration files: schema-1 round trip, one test per malformed-file kind, device lookup, fit."""

from __future__ import annotations

import json
import math
import pathlib
import re

import attrs
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from pkvrt.policy import calibration as C
from pkvrt.policy.calibration import (Calibration, CalibrationError, SplitPoints, calibration_dirs,
                                      find_calibration, fit_split_points, load_calibration,
                                      save_calibration, slugify)

REPO = pathlib.Path(__file__).resolve().parents[1]
SEED = REPO / "calibration" / "rtx3060-seed.json"


def seed_doc() -> dict:
    return json.loads(SEED.read_text())


def write(tmp_path, doc, name="gpu.json") -> pathlib.Path:
    p = tmp_path / name
    p.write_text(json.dumps(doc, indent=2) if not isinstance(doc, str) else doc)
    return p


# ----------------------------------------------------------------------------- the seed file


def test_seed_profile_holds_the_papers_constants():
    cal = load_calibration(SEED)
    # paper section 3.5 / 4.1: beta 331.2 GB/s, lambda 8.19 us, C_min 4, 28 SMs, seed 20260622
    assert (cal.beta_gbps, cal.lambda_us, cal.c_min, cal.sm_count) == (331.2, 8.19, 4.0, 28)
    assert cal.seed == 20260622 and cal.slug == "rtx3060-seed" and not cal.fallback
    assert "paper" in cal.provenance and cal.source == str(SEED)
    assert cal.version("flashinfer") == "0.2.5" and cal.version("driver") is None


def test_seed_file_is_written_by_save_calibration(tmp_path):
    """save(load(seed)) reproduces the committed file byte for byte (a canonical format)."""
    out = tmp_path / "again.json"
    save_calibration(load_calibration(SEED), out)
    assert out.read_text() == SEED.read_text()


# ----------------------------------------------------------------------------- round trip

names = st.text(st.characters(min_codepoint=32, max_codepoint=0x2FF), min_size=1, max_size=30)
pos = st.floats(min_value=1e-3, max_value=1e6, allow_nan=False, allow_infinity=False)


non_neg = st.floats(min_value=0.0, max_value=1e4, allow_nan=False, allow_infinity=False)
# the four constants, and the optional depth, merge and room terms: 0 (not written) or not
route_times = st.builds(C.RouteTime, pos, non_neg, non_neg, non_neg, st.one_of(st.just(0.0), non_neg),
                        st.one_of(st.just(0.0), non_neg), st.one_of(st.just(0.0), non_neg))


@st.composite
def time_models(draw) -> dict:
    """Calibration keywords: no time model (an older file), or every kind plus some by_group."""
    if not draw(st.booleans()):
        return {}
    groups = draw(st.dictionaries(st.integers(1, 64), st.lists(st.sampled_from(C.TIME_KINDS), min_size=1,
                                                                 max_size=4, unique=True), max_size=3))
    return dict(time_model=tuple((k, draw(route_times)) for k in C.TIME_KINDS),
                time_model_by_group=tuple(sorted((g, tuple((k, draw(route_times)) for k in C.TIME_KINDS if k in ks))
                                                 for g, ks in groups.items())))


@st.composite
def host_times(draw) -> dict:
    """Calibration keywords: no host_time (files written before 2026-12-02), or every kind's host cost."""
    if not draw(st.booleans()):
        return {}
    return dict(host_time=C.HostTime(costs=tuple((k, C.HostCost(draw(non_neg), draw(non_neg))) for k in C.TIME_KINDS),
                                     date=draw(st.dates()).isoformat(), command=draw(names),
                                     provenance=draw(names)))


@st.composite
def sharing_costs(draw) -> dict:
    """Calibration keywords: no sharing section (files before 2026-12-05) or one."""
    if not draw(st.booleans()):
        return {}
    return dict(sharing=C.SharingCost(l2_reread_cost=draw(st.floats(0.01, 1.0)),
                                      date=draw(st.dates()).isoformat(), command=draw(names),
                                      provenance=draw(names)))


@st.composite
def one_section(draw) -> "C.KvDtypeSection":
    """A by_kv_dtype / by_head_dim section: some split keys and/or route kinds, each maybe with
    by_group entries."""
    split_vals = {"bucket_ctas_per_sm": pos, "workqueue_ctas_per_sm": pos, "min_split_tokens": st.integers(1, 4096),
                  "cta_overhead_tiles": non_neg, "co_resident_slowdown": pos, "max_waves": st.integers(1, 8),
                  "wave_room_slots": st.integers(0, 600), "wave_room_tiles": non_neg,
                  "wave_room_chunk_tiles": st.integers(0, 1 << 20)}
    keys = draw(st.lists(st.sampled_from(list(split_vals)), unique=True))
    kinds = draw(st.lists(st.sampled_from(C.TIME_KINDS), unique=True, min_size=0 if keys else 1))
    group_keys = draw(st.lists(st.sampled_from(C._GROUP_KEYS), unique=True)) if keys else []
    group_kinds = draw(st.lists(st.sampled_from(C.TIME_KINDS), unique=True)) if kinds else []
    g = draw(st.integers(1, 8))
    return C.KvDtypeSection(
        splits=tuple((k, draw(split_vals[k])) for k in C._SECTION_SPLIT_KEYS if k in keys),
        splits_by_group=((g, tuple((k, draw(split_vals[k])) for k in C._GROUP_KEYS if k in group_keys)),)
        if group_keys else (),
        time_model=tuple((k, draw(route_times)) for k in C.TIME_KINDS if k in kinds),
        time_model_by_group=((g, tuple((k, draw(route_times)) for k in C.TIME_KINDS if k in group_kinds)),)
        if group_kinds else (),
        date=draw(st.dates()).isoformat(), command=draw(names), provenance=draw(names))


@st.composite
def sections(draw) -> dict:
    """Calibration keywords: no by_kv_dtype (every file before FP8 calibration) or an FP8
    section, and no by_head_dim or sections of some head dims."""
    out = {}
    if draw(st.booleans()):
        out["by_kv_dtype"] = (("float8_e4m3fn", draw(one_section())),)
    dims = draw(st.lists(st.sampled_from(C.SECTION_HEAD_DIMS), unique=True))
    if dims:
        out["by_head_dim"] = tuple((d, draw(one_section())) for d in sorted(dims))
    return out


@st.composite
def calibrations(draw) -> Calibration:
    table = draw(st.dictionaries(st.integers(1, 4096), pos, min_size=1, max_size=6))
    return Calibration(
        gpu=draw(names), slug=draw(st.from_regex(r"[a-z0-9]+(-[a-z0-9]+){0,3}", fullmatch=True)),
        sm_count=draw(st.integers(1, 1024)), l2_bytes=draw(st.integers(1, 2**40)),
        beta_gbps=draw(pos), lambda_us=draw(pos), lambda_graph_us=draw(pos), c_min=draw(pos),
        splits=SplitPoints(draw(pos), draw(pos), draw(st.integers(1, 1 << 20)),
                           merge_free_slots=draw(st.integers(0, 1024)),
                           wave_room_slots=draw(st.integers(0, 1024)), wave_room_tiles=draw(non_neg),
                           wave_room_chunk_tiles=draw(st.integers(0, 1 << 20))),
        flashinfer_ctas_per_sm=tuple(sorted(table.items())),
        versions=tuple((k, draw(st.none() | names)) for k in ("torch", "cuda", "flashinfer", "driver")),
        date=draw(st.dates()).isoformat(), seed=draw(st.integers(0, 2**40)), command=draw(names),
        provenance=draw(names), **draw(time_models()), **draw(sections()), **draw(host_times()),
        **draw(sharing_costs()))


@settings(max_examples=60, deadline=None)
@given(cal=calibrations())
def test_save_then_load_round_trips_exactly(tmp_path_factory, cal):
    p = tmp_path_factory.mktemp("cal") / "x.json"
    save_calibration(cal, p)
    back = load_calibration(p)
    assert back == attrs.evolve(cal, source=str(p))


# ----------------------------------------------------------------------------- malformed files


def test_bad_json_names_file_and_line(tmp_path):
    text = SEED.read_text().replace('"sm_count": 28,', '"sm_count": 28,,')
    line = text[: text.index(",,")].count("\n") + 1
    p = write(tmp_path, text)
    with pytest.raises(CalibrationError, match=rf"{re.escape(str(p))}: invalid JSON at line {line} column"):
        load_calibration(p)


def test_unreadable_file_names_it(tmp_path):
    with pytest.raises(CalibrationError, match="nope.json: cannot read"):
        load_calibration(tmp_path / "nope.json")


@pytest.mark.parametrize("path", [("gpu",), ("sm_count",), ("beta_gbps",), ("lambda_graph_us",), ("splits",),
                                  ("splits", "min_split_tokens"), ("flashinfer", "ctas_per_sm"),
                                  ("versions", "driver"), ("date",), ("source",)])
def test_missing_key_is_named(tmp_path, path):
    doc = seed_doc()
    parent = doc
    for k in path[:-1]:
        parent = parent[k]
    del parent[path[-1]]
    p = write(tmp_path, doc)
    with pytest.raises(CalibrationError, match=rf"{re.escape(str(p))}: key '{re.escape('.'.join(path))}'.*missing"):
        load_calibration(p)


@pytest.mark.parametrize("path, value, expected", [
    (("sm_count",), 28.5, "an integer"),
    (("sm_count",), True, "an integer"),
    (("l2_bytes",), "3MB", "an integer"),
    (("beta_gbps",), "331", "a number"),
    (("lambda_us",), None, "a number"),
    (("splits",), [9, 45, 128], "a JSON object"),
    (("splits", "bucket_ctas_per_sm"), "9", "a number"),
    (("flashinfer", "ctas_per_sm"), [2.6], "a non-empty object"),
    (("versions", "torch"), 2.5, "a non-empty string or null"),
    (("gpu",), "", "a non-empty string"),
    (("date",), "29/11/2026", "an ISO date"),
    (("slug",), "RTX 3060", "a slug"),
    (("splits", "merge_free_slots"), 8.0, "an integer"),
    (("splits", "merge_free_slots"), False, "an integer"),
    (("splits", "merge_free_slots"), -1, "an integer >= 0"),
    (("splits", "wave_room_slots"), -1, "an integer >= 0"),
    (("splits", "wave_room_slots"), 1 << 21, "at most 1048576"),
    (("splits", "wave_room_tiles"), 3e8, "at most 1048576.0"),
    (("splits", "wave_room_chunk_tiles"), 4.0, "an integer"),
])
def test_wrong_type_is_named(tmp_path, path, value, expected):
    doc = seed_doc()
    parent = doc
    for k in path[:-1]:
        parent = parent[k]
    parent[path[-1]] = value
    p = write(tmp_path, doc)
    with pytest.raises(CalibrationError, match=rf"{re.escape(str(p))}: key '{re.escape('.'.join(path))}': expected {expected}"):
        load_calibration(p)


@pytest.mark.parametrize("path, value", [
    (("sm_count",), 0), (("l2_bytes",), -1), (("beta_gbps",), 0.0), (("lambda_us",), -8.19),
    (("lambda_graph_us",), 0), (("c_min",), -4), (("splits", "workqueue_ctas_per_sm"), 0),
    (("splits", "min_split_tokens"), 0), (("flashinfer", "ctas_per_sm", "8"), 0.0),
])
def test_non_positive_is_named(tmp_path, path, value):
    doc = seed_doc()
    parent = doc
    for k in path[:-1]:
        parent = parent[k]
    parent[path[-1]] = value
    p = write(tmp_path, doc)
    with pytest.raises(CalibrationError, match=rf"key '{re.escape('.'.join(path))}': expected a (finite )?positive"):
        load_calibration(p)


def test_flashinfer_table_key_must_be_an_active_count(tmp_path):
    doc = seed_doc()
    doc["flashinfer"]["ctas_per_sm"]["B8"] = 3.0
    with pytest.raises(CalibrationError, match=r"key 'flashinfer.ctas_per_sm.B8': expected keys that are positive"):
        load_calibration(write(tmp_path, doc))


@pytest.mark.parametrize("schema", [2, 0, "1", None])
def test_unknown_schema_is_refused(tmp_path, schema):
    doc = seed_doc()
    doc["schema"] = schema
    with pytest.raises(CalibrationError, match=r"key 'schema': expected 1 \(unknown schema version\)"):
        load_calibration(write(tmp_path, doc))


def test_missing_schema_is_refused(tmp_path):
    doc = seed_doc()
    del doc["schema"]
    with pytest.raises(CalibrationError, match=r"key 'schema': expected it to be present"):
        load_calibration(write(tmp_path, doc))


@pytest.mark.parametrize("where", [(), ("splits",), ("versions",)])
def test_unknown_key_is_refused(tmp_path, where):
    doc = seed_doc()
    parent = doc
    for k in where:
        parent = parent[k]
    parent["betta_gbps"] = 1.0
    key = ".".join(where + ("betta_gbps",))
    with pytest.raises(CalibrationError, match=rf"key '{re.escape(key)}': expected one of the schema-1 keys"):
        load_calibration(write(tmp_path, doc))


def test_top_level_must_be_an_object(tmp_path):
    with pytest.raises(CalibrationError, match="expected a JSON object at top level"):
        load_calibration(write(tmp_path, "[1, 2]"))


# ----------------------------------------------------------------------------- finding a file


@pytest.mark.parametrize("name, slug", [
    ("NVIDIA H200", "nvidia-h200"),
    ("NVIDIA GeForce RTX 3060", "nvidia-geforce-rtx-3060"),
    ("NVIDIA H100 80GB HBM3", "nvidia-h100-80gb-hbm3"),
    ("  NVIDIA A100-SXM4-40GB ", "nvidia-a100-sxm4-40gb"),
    ("rtx3060-seed", "rtx3060-seed"),
])
def test_slugify_examples(name, slug):
    assert slugify(name) == slug


@given(st.text(min_size=1, max_size=40).filter(lambda s: re.search(r"[A-Za-z0-9]", s.lower())))
def test_slugify_is_a_fixed_point_of_its_own_output(name):
    s = slugify(name)
    assert re.fullmatch(r"[a-z0-9]+(-[a-z0-9]+)*", s) and slugify(s) == s


def test_slugify_refuses_names_without_letters():
    with pytest.raises(ValueError, match="no letters or digits"):
        slugify(" -- ")


def test_calibration_dirs_is_the_checkout_directory_here(monkeypatch):
    monkeypatch.delenv(C.ENV_DIR, raising=False)
    assert calibration_dirs() == [REPO / "calibration"]


@pytest.mark.parametrize("kind", ["missing", "file"])
def test_calibration_dir_env_must_be_a_directory(tmp_path, monkeypatch, kind):
    # the user asked for this directory: a typo is an error naming it, not a silent fallback
    path = tmp_path / "no-such-dir"
    if kind == "file":
        path.write_text("{}")
    monkeypatch.setenv(C.ENV_DIR, str(path))
    with pytest.raises(CalibrationError, match=f"^{C.ENV_DIR}={path}: expected an existing "
                                               "directory of calibration files"):
        find_calibration("NVIDIA H200")


def _profile(tmp_path, slug, gpu, name=None, **changes) -> pathlib.Path:
    doc = seed_doc() | {"slug": slug, "gpu": gpu} | changes
    return write(tmp_path, doc, name or f"{slug}.json")


def test_find_by_device_name(tmp_path, monkeypatch):
    monkeypatch.setenv(C.ENV_DIR, str(tmp_path))
    p = _profile(tmp_path, "nvidia-h200", "NVIDIA H200", sm_count=132)
    cal = find_calibration("NVIDIA H200")
    assert (cal.sm_count, cal.source, cal.fallback) == (132, str(p), False)


def test_find_by_slug_field_when_file_is_named_otherwise(tmp_path, monkeypatch):
    monkeypatch.setenv(C.ENV_DIR, str(tmp_path))
    _profile(tmp_path, "nvidia-l40s", "NVIDIA L40S", name="l40s-2026.json", sm_count=142)
    assert find_calibration("NVIDIA L40S").sm_count == 142


def test_file_named_for_device_but_wrong_slug_is_an_error(tmp_path, monkeypatch):
    monkeypatch.setenv(C.ENV_DIR, str(tmp_path))
    _profile(tmp_path, "nvidia-a100", "NVIDIA A100", name="nvidia-h200.json")
    with pytest.raises(CalibrationError, match=r"nvidia-h200.json: key 'slug': expected 'nvidia-h200'"):
        find_calibration("NVIDIA H200")


@pytest.mark.parametrize("device", ["Imaginary GPU 9000", None])
def test_unknown_device_warns_and_falls_back_to_the_seed(tmp_path, monkeypatch, device):
    monkeypatch.setenv(C.ENV_DIR, str(tmp_path))
    _profile(tmp_path, "nvidia-h200", "NVIDIA H200")
    with pytest.warns(UserWarning, match="imaginary-gpu-9000" if device else "no CUDA device"):
        cal = find_calibration(device)
    assert cal.fallback and cal.source == str(SEED) and cal.slug == "rtx3060-seed"
    assert attrs.evolve(cal, fallback=False) == load_calibration(SEED)


def test_no_seed_profile_for_the_fallback_is_an_error(tmp_path, monkeypatch):
    monkeypatch.setattr(C, "calibration_dirs", lambda: [tmp_path])
    with pytest.raises(CalibrationError, match="no rtx3060-seed.json"):
        find_calibration("Imaginary GPU 9000")


# ----------------------------------------------------------------------------- fit_split_points


def _sweep(case, rows, context, best_s, splits, *, route=None, floor_us=400.0):
    """Synthetic timings, convex in S with the minimum at ``best_s`` (5% per octave away)."""
    out = []
    for s in splits:
        rec = {"case": case, "rows": rows, "context": context, "splits": s,
               "us": floor_us * (1 + 0.05 * abs(math.log2(s / best_s)) * 4)}
        if route:
            rec["route"] = route
        out.append(rec)
    return out


def test_fit_recovers_the_timed_optimum():
    recs = _sweep("B1-32K", 1, 32768, 32, (8, 16, 24, 32, 40, 48)) + \
        _sweep("B8-32K", 8, 32768, 20, (12, 16, 20, 24, 28))
    pts = fit_split_points(recs, sm_count=28, num_kv_heads=8)
    # bucket: 1 row * 8 kvh * 32 / 28 SMs; workqueue: 8 * 8 * 20 / 28
    assert pts["bucket_ctas_per_sm"] == pytest.approx(1 * 8 * 32 / 28)
    assert pts["workqueue_ctas_per_sm"] == pytest.approx(8 * 8 * 20 / 28)
    # shortest chosen split: min(32768/32, 32768/20) = 1024 tokens, a multiple of 32
    assert pts["min_split_tokens"] == 1024


def test_fit_prefers_fewer_splits_within_tolerance():
    recs = [{"case": "B1", "rows": 1, "context": 32768, "splits": s, "us": us}
            for s, us in ((28, 452.0), (32, 441.0), (36, 447.0))]
    # 447 <= 441 * 1.02 = 449.8, but 32 < 36 -> 32; with tolerance 0.03, 452 <= 454.2 -> 28
    assert fit_split_points(recs, sm_count=28, num_kv_heads=8)["bucket_ctas_per_sm"] == pytest.approx(8 * 32 / 28)
    assert fit_split_points(recs, sm_count=28, num_kv_heads=8, tolerance=0.03)["bucket_ctas_per_sm"] == \
        pytest.approx(8 * 28 / 28)


def test_fit_takes_the_median_over_cases_and_explicit_routes():
    recs = (_sweep("a", 2, 65536, 16, (8, 16, 32), route="bucket")
            + _sweep("b", 2, 65536, 32, (8, 16, 32), route="bucket")
            + _sweep("c", 2, 65536, 8, (4, 8, 16), route="bucket"))
    pts = fit_split_points(recs, sm_count=100, num_kv_heads=4)
    assert pts["bucket_ctas_per_sm"] == pytest.approx(2 * 4 * 16 / 100)   # median of S 8, 16, 32
    assert "workqueue_ctas_per_sm" not in pts


@pytest.mark.parametrize("bad, match", [
    ([], "empty"),
    ([{"case": "x", "rows": 1, "context": 10, "splits": 2}], r"\['us'\]"),
    ([{"case": "x", "rows": 0, "context": 10, "splits": 2, "us": 1.0}], "positive"),
    (_sweep("x", 1, 10, 2, (1,)) + _sweep("x", 2, 10, 2, (2,)), "mixes"),
    (_sweep("x", 1, 10, 2, (1, 2), route="fused"), "route must be"),
])
def test_fit_rejects_bad_records(bad, match):
    with pytest.raises(ValueError, match=match):
        fit_split_points(bad, sm_count=28, num_kv_heads=8)


def test_fit_partition_recovers_the_constants_that_made_the_times():
    """Times drawn from the partition's own model with known constants: the fit picks constants
    whose choice is the fastest partition of every case (regret 1)."""
    import attrs
    import numpy as np

    from pkvrt.policy import planner
    from pkvrt.policy.calibration import SplitPoints, fit_partition
    from pkvrt.policy.registry import SplitBounds

    bounds = SplitBounds(1, 64, 4)
    truth = attrs.evolve(load_calibration(SEED), sm_count=132,
                         splits=SplitPoints(1.0, 2.0, 64, 6.0, 1.4))
    model = planner.PartitionModel.of(truth)
    cases = {}
    for name, seq in {"one-8K": [8192], "one-32K": [32768], "ragged": [28672] + [2048] * 6,
                      "short": [300, 900, 1500, 4000, 200, 700, 1100, 2500], "uniform": [32768] * 8}.items():
        seq = np.array(seq)
        tiles = -(-seq // 32)
        cands = planner.partition_candidates(int(tiles.max()), bounds, 1)
        cost, _, _ = planner.partition_costs(tiles, cands, num_kv_heads=8, model=model)
        cases[name] = (seq, {int(s): float(c) for s, c in zip(cands, cost)})
    points, regret = fit_partition(cases, sm_count=132, resident=2, num_kv_heads=8, splits=bounds)
    assert points["workqueue_ctas_per_sm"] == 2.0
    assert max(regret.values()) == pytest.approx(1.0)


def _partition_cases(truth_splits, bounds_by_kind, seqs):
    """Times from the partition's own model under ``truth_splits``, one case per (step, route)."""
    import attrs
    import numpy as np

    from pkvrt.policy import planner

    model = planner.PartitionModel.of(attrs.evolve(load_calibration(SEED), sm_count=132, splits=truth_splits))
    cases = {}
    for kind, bounds in bounds_by_kind.items():
        for name, seq in seqs.items():
            seq = np.array(seq)
            tiles = -(-seq // 32)
            cands = planner.partition_candidates(int(tiles.max()), bounds, 1)
            cost, _, _ = planner.partition_costs(tiles, cands, num_kv_heads=8, model=model)
            cases[f"{name} [{kind}]"] = (seq, {int(s): float(c) for s, c in zip(cands, cost)}, bounds)
    return cases


def test_fit_partition_scores_each_case_with_its_own_route_bounds():
    """Both partition routes' sweeps fit one set of constants; each case's picks come from its
    own split bounds (a workqueue case never scores a count its route cannot run)."""
    from pkvrt.policy.calibration import SplitPoints, fit_partition
    from pkvrt.policy.registry import SplitBounds

    kinds = {"fused": SplitBounds(1, 64, 1), "workqueue": SplitBounds(1, 64, 4)}
    seqs = {"one-32K": [32768], "ragged": [28672] + [2048] * 6, "short": [300, 900, 1500, 4000, 200, 700]}
    cases = _partition_cases(SplitPoints(1.0, 2.0, 64, 6.0, 1.375), kinds, seqs)
    kw = dict(sm_count=132, resident=2, num_kv_heads=8, splits=kinds["fused"], min_tokens=(64,))
    kw["wave_room"] = False   # the first stage's scoring (a room charge could mend a wrong pick)
    points, regret = fit_partition(cases, slowdowns=(1.375,), overheads=(6.0,), **kw)
    assert set(regret) == set(cases) and max(regret.values()) == pytest.approx(1.0)
    # the same cases without their bounds: the workqueue steps, timed at multiples of 4 only,
    # are scored with the fused route's counts (1..64), and some pick a count never timed
    _, wrong = fit_partition({k: v[:2] for k, v in cases.items()}, slowdowns=(1.375,), overheads=(6.0,), **kw)
    assert max(wrong[k] for k in wrong if k.endswith("[workqueue]")) > 1.0
    assert all(wrong[k] == regret[k] for k in wrong if k.endswith("[fused]"))


def test_fit_partition_takes_the_middle_of_the_best_plateau():
    """Two steps whose fastest cuts bound the overhead from both sides (the first is cut 10
    from overhead 5 tiles up, the second stays at 15 up to overhead 10): every overhead 5..10
    scores best; the fit takes the one farthest from a worse value (7: 3 steps from 4 and 4
    from 11; 8 ties and the smaller wins), not the plateau's smallest (5)."""
    import attrs
    import numpy as np

    from pkvrt.policy import planner
    from pkvrt.policy.calibration import SplitPoints, fit_partition
    from pkvrt.policy.registry import SplitBounds

    bounds = SplitBounds(1, 64, 1)
    cal = attrs.evolve(load_calibration(H200), sm_count=132)
    steps = {"a": ([33893, 7191, 3753, 34554, 1079, 21750], 10), "b": ([30606, 37100, 16511, 17727, 19073, 38192], 15)}
    cases = {}
    for name, (seq, fastest) in steps.items():
        seq = np.array(seq)
        picks = [planner.balanced_partition(seq, num_kv_heads=8, splits=bounds, cal=attrs.evolve(
            cal, splits=SplitPoints(1.0, 2.0, 64, float(f), 1.25))).longest_splits for f in range(17)]
        assert fastest in picks and len(set(picks)) == 2          # the step's one threshold
        cases[name] = (seq, {s: 1.0 if s == fastest else 1.2 for s in range(1, 65)})
    points, regret = fit_partition(cases, sm_count=132, resident=2, num_kv_heads=8, splits=bounds,
                                   slowdowns=(1.25,), overheads=tuple(float(f) for f in range(17)), min_tokens=(64,))
    assert max(regret.values()) == 1.0 and points["cta_overhead_tiles"] == 7.0


def test_fit_partition_refuses_empty_or_bad_times():
    from pkvrt.policy.calibration import fit_partition
    from pkvrt.policy.registry import SplitBounds

    with pytest.raises(ValueError, match="no cases"):
        fit_partition({}, sm_count=132, resident=2, num_kv_heads=8, splits=SplitBounds(1, 64, 4))
    with pytest.raises(ValueError, match="case 'x'"):
        fit_partition({"x": ([100], {4: -1.0})}, sm_count=132, resident=2, num_kv_heads=8,
                      splits=SplitBounds(1, 64, 4))


# ----------------------------------------------------------------------------- splits.by_group


def by_group_doc(entry) -> dict:
    doc = seed_doc()
    doc["splits"]["by_group"] = entry
    return doc


def test_by_group_round_trips_and_replaces_the_partition_constants(tmp_path):
    """A G with an entry gets its constants (the others kept); a G without one gets the top
    level; for_group empties by_group, so asking again (Runtime, then Router) changes nothing."""
    p = write(tmp_path, by_group_doc({"1": {"cta_overhead_tiles": 1.5, "min_split_tokens": 64},
                                      "8": {"co_resident_slowdown": 1.25}}))
    cal = load_calibration(p)
    assert cal.splits.by_group == ((1, (("min_split_tokens", 64), ("cta_overhead_tiles", 1.5))),
                                   (8, (("co_resident_slowdown", 1.25),)))
    save_calibration(cal, tmp_path / "again.json")
    assert load_calibration(tmp_path / "again.json") == attrs.evolve(cal, source=str(tmp_path / "again.json"))
    top = cal.splits
    g1 = cal.for_group(1).splits
    assert (g1.cta_overhead_tiles, g1.min_split_tokens) == (1.5, 64)
    assert (g1.co_resident_slowdown, g1.workqueue_ctas_per_sm, g1.bucket_ctas_per_sm) == (
        top.co_resident_slowdown, top.workqueue_ctas_per_sm, top.bucket_ctas_per_sm)
    assert g1.by_group == ()
    assert cal.for_group(8).splits.co_resident_slowdown == 1.25
    g4 = cal.for_group(4).splits
    assert attrs.evolve(g4, by_group=top.by_group) == top
    assert cal.for_group(1).for_group(1) == cal.for_group(1)
    assert cal.for_group(1).for_group(8) == cal.for_group(1)   # already the G = 1 view
    no_groups = load_calibration(SEED)
    assert no_groups.for_group(1) is no_groups


@pytest.mark.parametrize("entry, key, expected", [
    ([1, 2], "splits.by_group", "a JSON object"),
    ({"G1": {"min_split_tokens": 64}}, "splits.by_group.G1", "keys that are positive integers"),
    ({"0": {"min_split_tokens": 64}}, "splits.by_group.0", "keys that are positive integers"),
    ({"1": {}}, "splits.by_group.1", "a non-empty object"),
    ({"1": {"bucket_ctas_per_sm": 2.0}}, "splits.by_group.1.bucket_ctas_per_sm", "one of"),
    ({"1": {"min_split_tokens": 6.5}}, "splits.by_group.1.min_split_tokens", "an integer"),
    ({"1": {"co_resident_slowdown": 0}}, "splits.by_group.1.co_resident_slowdown", "a finite positive"),
    ({"1": {"cta_overhead_tiles": -1}}, "splits.by_group.1.cta_overhead_tiles", "a finite number >= 0"),
])
def test_bad_by_group_is_named(tmp_path, entry, key, expected):
    p = write(tmp_path, by_group_doc(entry))
    with pytest.raises(CalibrationError, match=rf"{re.escape(str(p))}: key '{re.escape(key)}': expected {expected}"):
        load_calibration(p)


@pytest.mark.parametrize("g", [0, -4, 2.0, True])
def test_for_group_refuses_a_non_positive_int(g):
    with pytest.raises(ValueError, match="group_size must be a positive int"):
        load_calibration(SEED).for_group(g)


# ----------------------------------------------------------------------------- time_model

def route_time(read=1.0, tail=0.5, split=0.1, fixed=4.0) -> dict:
    return {"read_scale": read, "tail_us": tail, "split_us": split, "fixed_us": fixed}


def time_model_doc(**over) -> dict:
    doc = seed_doc()
    doc["time_model"] = {k: route_time(fixed=float(i)) for i, k in enumerate(C.TIME_KINDS)} | over
    return doc


def test_old_files_have_no_time_model_and_round_trip_without_one(tmp_path):
    cal = load_calibration(SEED)
    assert cal.time_model == () and cal.time_model_by_group == () and cal.route_time("bucket") is None
    assert "time_model" not in C.calibration_to_dict(cal)


def test_time_model_round_trips_and_for_group_replaces_the_kinds_it_has(tmp_path):
    doc = time_model_doc(by_group={"8": {"fused": route_time(read=0.9, fixed=2.5)},
                                   "1": {"flashinfer": route_time(tail=0.0), "bucket": route_time(split=0.0)}})
    cal = load_calibration(write(tmp_path, doc))
    assert [k for k, _ in cal.time_model] == list(C.TIME_KINDS)
    assert cal.route_time("workqueue") == C.RouteTime(1.0, 0.5, 0.1, 2.0)
    assert [g for g, _ in cal.time_model_by_group] == [1, 8]
    save_calibration(cal, tmp_path / "again.json")
    assert json.loads((tmp_path / "again.json").read_text())["time_model"] == doc["time_model"]
    assert load_calibration(tmp_path / "again.json") == attrs.evolve(cal, source=str(tmp_path / "again.json"))
    g8 = cal.for_group(8)
    assert g8.route_time("fused") == C.RouteTime(0.9, 0.5, 0.1, 2.5)
    assert g8.route_time("workqueue") == cal.route_time("workqueue") and g8.time_model_by_group == ()
    assert cal.for_group(1).route_time("flashinfer").tail_us == 0.0
    assert cal.for_group(4).time_model == cal.time_model          # no entry: the top level
    assert cal.for_group(8).for_group(1) == cal.for_group(8)       # already the G = 8 view


def test_depth_merge_and_room_terms_are_optional_and_zero_terms_are_not_written(tmp_path):
    """A file of the model before 8a7d033 (four keys) reads its three new terms as 0; a
    non-zero term round-trips; a term that is 0 is left out on save (old files stay as they were)."""
    doc = time_model_doc()
    doc["time_model"]["fused"].update(depth_us=0.678, room_us=0.0721, merge_us=0.0)
    cal = load_calibration(write(tmp_path, doc))
    assert cal.route_time("fused") == C.RouteTime(1.0, 0.5, 0.1, 3.0, depth_us=0.678, merge_us=0.0, room_us=0.0721)
    assert (cal.route_time("workqueue").depth_us, cal.route_time("workqueue").merge_us,
            cal.route_time("workqueue").room_us) == (0.0, 0.0, 0.0)
    save_calibration(cal, tmp_path / "again.json")
    saved = json.loads((tmp_path / "again.json").read_text())["time_model"]
    assert saved["fused"] == {"read_scale": 1.0, "tail_us": 0.5, "split_us": 0.1, "fixed_us": 3.0,
                              "depth_us": 0.678, "room_us": 0.0721}
    assert saved["workqueue"] == doc["time_model"]["workqueue"]


@pytest.mark.parametrize("edit, key, expected", [
    (lambda tm: tm.pop("bucket"), "time_model.bucket", "it to be present"),
    (lambda tm: tm.update(fuse=route_time()), "time_model.fuse", "one of the schema-1 keys"),
    (lambda tm: tm.update(fused=[1, 2]), "time_model.fused", "a JSON object"),
    (lambda tm: tm["fused"].pop("tail_us"), "time_model.fused.tail_us", "it to be present"),
    (lambda tm: tm["fused"].update(read_scale=0.0), "time_model.fused.read_scale", "a finite positive"),
    (lambda tm: tm["fused"].update(split_us=-0.1), "time_model.fused.split_us", "a finite number >= 0"),
    (lambda tm: tm["fused"].update(fixed_us="4"), "time_model.fused.fixed_us", "a number"),
    (lambda tm: tm["fused"].update(depth_us=-0.5), "time_model.fused.depth_us", "a finite number >= 0"),
    (lambda tm: tm["workqueue"].update(merge_us=float("inf")), "time_model.workqueue.merge_us",
     "a finite number >= 0"),
    (lambda tm: tm["fused"].update(room_us=True), "time_model.fused.room_us", "a number"),
    (lambda tm: tm["fused"].update(depth=0.5), "time_model.fused.depth", "one of the schema-1 keys"),
    (lambda tm: tm.update(by_group={"G8": {}}), "time_model.by_group.G8", "keys that are positive integers"),
    (lambda tm: tm.update(by_group={"8": {}}), "time_model.by_group.8", "a non-empty object"),
    (lambda tm: tm.update(by_group={"8": {"fast": route_time()}}), "time_model.by_group.8.fast", "one of"),
    (lambda tm: tm.update(by_group={"8": {"fused": route_time(tail=-1)}}), "time_model.by_group.8.fused.tail_us",
     "a finite number >= 0"),
])
def test_bad_time_model_is_named(tmp_path, edit, key, expected):
    doc = time_model_doc()
    edit(doc["time_model"])
    p = write(tmp_path, doc)
    with pytest.raises(CalibrationError, match=rf"{re.escape(str(p))}: key '{re.escape(key)}': expected {expected}"):
        load_calibration(p)


def test_time_model_must_be_an_object(tmp_path):
    doc = seed_doc()
    doc["time_model"] = [1]
    with pytest.raises(CalibrationError, match=r"key 'time_model': expected a JSON object"):
        load_calibration(write(tmp_path, doc))


# ----------------------------------------------------------------------------- by_kv_dtype

FP8 = "float8_e4m3fn"
H200 = REPO / "calibration" / "nvidia-h200.json"


def fp8_section(**over) -> dict:
    """An FP8 section: G 4 partition constants and pkvrt's kinds, a G 8 entry of each."""
    return {"splits": {"bucket_ctas_per_sm": 1.5, "workqueue_ctas_per_sm": 3.0, "min_split_tokens": 64,
                       "cta_overhead_tiles": 2.5, "co_resident_slowdown": 1.25,
                       "by_group": {"8": {"cta_overhead_tiles": 6.0}}},
            "time_model": {"fused": route_time(read=0.7, fixed=1.5), "bucket": route_time(read=0.8),
                           "by_group": {"8": {"fused": route_time(read=0.6, fixed=1.0)}}},
            "date": "2026-12-08", "command": "pkvrt calibrate --kv-dtype fp8", "source": "test"} | over


def fp8_doc(section=None) -> dict:
    """The H200 file (time model and by_group at G 1 and 8) with an FP8 section."""
    doc = json.loads(H200.read_text())
    doc["by_kv_dtype"] = {FP8: fp8_section() if section is None else section}
    return doc


def test_fp8_section_round_trips(tmp_path):
    doc = fp8_doc()
    cal = load_calibration(write(tmp_path, doc))
    (name, sec), = cal.by_kv_dtype
    assert name == FP8 and sec.date == "2026-12-08" and sec.provenance == "test"
    assert sec.splits[0] == ("bucket_ctas_per_sm", 1.5) and sec.splits_by_group == ((8, (("cta_overhead_tiles", 6.0),)),)
    assert [k for k, _ in sec.time_model] == ["bucket", "fused"]   # TIME_KINDS order, some kinds
    again = tmp_path / "again.json"
    save_calibration(cal, again)
    assert json.loads(again.read_text()) == doc
    assert load_calibration(again) == attrs.evolve(cal, source=str(again))


def h200_without_fp8():
    """The shipped H200 file as it was before its FP8 section was measured."""
    return attrs.evolve(load_calibration(H200), by_kv_dtype=())


def test_the_seed_file_has_no_fp8_section_and_the_h200_file_a_measured_one():
    assert load_calibration(SEED).by_kv_dtype == ()
    assert "by_kv_dtype" not in json.loads(SEED.read_text())
    ((name, sec),) = load_calibration(H200).by_kv_dtype
    assert name == FP8 and "Measured by pkvrt calibrate --kv-dtype float8_e4m3fn" in sec.provenance
    assert "--kv-dtype fp8" in sec.command and dict(sec.splits)["workqueue_ctas_per_sm"] == 2.0
    assert [k for k, _ in sec.time_model] == ["bucket", "workqueue", "fused"]


@pytest.mark.parametrize("edit, key, expected", [
    (lambda d: d.update(by_kv_dtype=[1]), "by_kv_dtype", "a JSON object"),
    (lambda d: d.update(by_kv_dtype={"fp8": fp8_section()}), "by_kv_dtype.fp8", r"keys among \['float8_e4m3fn'\]"),
    (lambda d: d.update(by_kv_dtype={"float16": fp8_section()}), "by_kv_dtype.float16", "keys among"),
    (lambda d: d.update(by_kv_dtype={FP8: "x"}), f"by_kv_dtype.{FP8}", "a JSON object of"),
    (lambda d: d["by_kv_dtype"][FP8].update(beta_gbps=1.0), f"by_kv_dtype.{FP8}.beta_gbps",
     "one of the schema-1 keys"),
    (lambda d: d["by_kv_dtype"][FP8].pop("source"), f"by_kv_dtype.{FP8}.source", "it to be present"),
    (lambda d: d["by_kv_dtype"][FP8].pop("command"), f"by_kv_dtype.{FP8}.command", "it to be present"),
    (lambda d: d["by_kv_dtype"][FP8].update(date="08/12/2026"), f"by_kv_dtype.{FP8}.date", "an ISO date"),
    (lambda d: d["by_kv_dtype"][FP8].update(source=""), f"by_kv_dtype.{FP8}.source", "a non-empty string"),
    (lambda d: [d["by_kv_dtype"][FP8].pop(k) for k in ("splits", "time_model")], f"by_kv_dtype.{FP8}.splits",
     "splits or time_model to be present"),
    (lambda d: d["by_kv_dtype"][FP8].update(splits={}), f"by_kv_dtype.{FP8}.splits", "a non-empty object"),
    (lambda d: d["by_kv_dtype"][FP8]["splits"].update(c_min=2.0), f"by_kv_dtype.{FP8}.splits.c_min",
     "one of .* \\(unknown key\\)"),
    (lambda d: d["by_kv_dtype"][FP8]["splits"].update(min_split_tokens=6.5),
     f"by_kv_dtype.{FP8}.splits.min_split_tokens", "an integer"),
    (lambda d: d["by_kv_dtype"][FP8]["splits"].update(max_waves=0), f"by_kv_dtype.{FP8}.splits.max_waves",
     "a positive integer"),
    (lambda d: d["by_kv_dtype"][FP8]["splits"].update(co_resident_slowdown=0),
     f"by_kv_dtype.{FP8}.splits.co_resident_slowdown", "a finite positive"),
    (lambda d: d["by_kv_dtype"][FP8]["splits"].update(cta_overhead_tiles=-1),
     f"by_kv_dtype.{FP8}.splits.cta_overhead_tiles", "a finite number >= 0"),
    (lambda d: d["by_kv_dtype"][FP8]["splits"].update(bucket_ctas_per_sm="1"),
     f"by_kv_dtype.{FP8}.splits.bucket_ctas_per_sm", "a number"),
    (lambda d: d["by_kv_dtype"][FP8]["splits"].update(by_group={"8": {"bucket_ctas_per_sm": 1.0}}),
     f"by_kv_dtype.{FP8}.splits.by_group.8.bucket_ctas_per_sm", "one of"),
    (lambda d: d["by_kv_dtype"][FP8]["splits"].update(by_group={"G8": {"min_split_tokens": 64}}),
     f"by_kv_dtype.{FP8}.splits.by_group.G8", "keys that are positive integers"),
    (lambda d: d["by_kv_dtype"][FP8].update(time_model={}), f"by_kv_dtype.{FP8}.time_model", "a JSON object of some of"),
    (lambda d: d["by_kv_dtype"][FP8]["time_model"].update(fuse=route_time()), f"by_kv_dtype.{FP8}.time_model.fuse",
     "one of"),
    (lambda d: d["by_kv_dtype"][FP8]["time_model"]["fused"].pop("tail_us"),
     f"by_kv_dtype.{FP8}.time_model.fused.tail_us", "it to be present"),
    (lambda d: d["by_kv_dtype"][FP8]["time_model"]["fused"].update(read_scale=0),
     f"by_kv_dtype.{FP8}.time_model.fused.read_scale", "a finite positive"),
    (lambda d: d["by_kv_dtype"][FP8]["time_model"].update(by_group={"8": {}}),
     f"by_kv_dtype.{FP8}.time_model.by_group.8", "a non-empty object"),
    (lambda d: d["by_kv_dtype"][FP8]["time_model"].update(by_group={"8": {"fused": route_time(split=-1)}}),
     f"by_kv_dtype.{FP8}.time_model.by_group.8.fused.split_us", "a finite number >= 0"),
])
def test_bad_fp8_section_is_named(tmp_path, edit, key, expected):
    doc = fp8_doc()
    edit(doc)
    p = write(tmp_path, doc)
    with pytest.raises(CalibrationError, match=rf"{re.escape(str(p))}: key '{re.escape(key)}': expected {expected}"):
        load_calibration(p)


def test_a_section_of_splits_only_or_time_model_only_is_valid(tmp_path):
    for drop in ("splits", "time_model"):
        sec = fp8_section()
        del sec[drop]
        cal = load_calibration(write(tmp_path, fp8_doc(sec)))
        assert bool(cal.by_kv_dtype[0][1].splits) == (drop != "splits")


def test_without_a_section_fp8_sees_the_fp16_constants_marked_as_a_fallback():
    h200 = h200_without_fp8()
    fp8 = h200.for_kv_dtype(FP8)
    assert fp8.kv_dtype_fallback and fp8.kv_dtype == FP8
    assert attrs.evolve(fp8, kv_dtype=None, kv_dtype_fallback=False) == h200
    assert "no by_kv_dtype section in nvidia-h200" in fp8.kv_dtype_note()
    for name in ("float16", "bfloat16"):
        view = h200.for_kv_dtype(name)
        assert not view.kv_dtype_fallback and view.kv_dtype_note() == "" and view.splits == h200.splits
    assert h200.kv_dtype_note() == ""


def test_the_fp8_view_takes_the_section_first_then_the_group():
    """Per constant at G: the section's G entry, the section's top, the file's G entry, the
    file's top."""
    cal = calibration_from_fp8_doc()
    h200 = load_calibration(H200)
    g4, g8, g1 = (cal.for_kv_dtype(FP8).for_group(g) for g in (4, 8, 1))
    assert not g4.kv_dtype_fallback and "section's constants" in g4.kv_dtype_note()
    assert (g4.splits.cta_overhead_tiles, g4.splits.min_split_tokens, g4.splits.bucket_ctas_per_sm) == (2.5, 64, 1.5)
    assert g8.splits.cta_overhead_tiles == 6.0                     # the section's G 8 entry
    assert g8.splits.co_resident_slowdown == 1.25 != h200.for_group(8).splits.co_resident_slowdown   # the section's top
    assert g1.splits.min_split_tokens == 64                        # over the file's G 1 (256)
    assert g4.splits.max_waves == h200.splits.max_waves == 3       # not in the section: the file's
    assert g8.route_time("fused") == C.RouteTime(0.6, 0.5, 0.1, 1.0)
    assert g1.route_time("fused") == C.RouteTime(0.7, 0.5, 0.1, 1.5)
    # not timed with FP8 caches: the file's own kinds at that G
    assert g8.route_time("flashinfer") == h200.for_group(8).route_time("flashinfer")
    assert g1.route_time("workqueue") == h200.for_group(1).route_time("workqueue")
    file_g8 = json.loads(H200.read_text())["splits"]["by_group"]["8"]
    assert h200.for_group(8).splits.cta_overhead_tiles == file_g8["cta_overhead_tiles"] != 6.0   # fp16 untouched
    assert cal.for_kv_dtype("float16").for_group(8) == attrs.evolve(h200.for_group(8), by_kv_dtype=(),
                                                                    kv_dtype="float16", source=cal.source)


def calibration_from_fp8_doc() -> Calibration:
    return C.calibration_from_dict(fp8_doc())


@pytest.mark.parametrize("g", [1, 2, 4, 8])
def test_for_kv_dtype_and_for_group_compose_in_either_order(g):
    cal = calibration_from_fp8_doc()
    one = cal.for_kv_dtype(FP8).for_group(g)
    assert one == cal.for_group(g).for_kv_dtype(FP8)
    assert one.for_kv_dtype(FP8) is one and one.for_group(g) == one   # asking again changes nothing
    assert one.by_kv_dtype == () and one.splits.by_group == () and one.time_model_by_group == ()


def test_for_kv_dtype_takes_a_torch_dtype_and_refuses_another_dtype_or_an_unknown_one():
    import torch

    cal = calibration_from_fp8_doc()
    assert cal.for_kv_dtype(torch.float8_e4m3fn) == cal.for_kv_dtype(FP8)
    with pytest.raises(ValueError, match="already the float8_e4m3fn view"):
        cal.for_kv_dtype(FP8).for_kv_dtype("float16")
    with pytest.raises(ValueError, match="KV dtype 'fp8': expected one of"):
        cal.for_kv_dtype("fp8")


def test_a_view_is_not_saved_and_a_section_is_added_without_touching_the_rest():
    h200 = h200_without_fp8()
    with pytest.raises(ValueError, match="view"):
        C.calibration_to_dict(h200.for_kv_dtype(FP8))
    sec = calibration_from_fp8_doc().by_kv_dtype[0][1]
    cal = C.with_kv_dtype_section(h200, FP8, sec)
    doc, base = C.calibration_to_dict(cal), C.calibration_to_dict(h200)
    assert doc.pop("by_kv_dtype") == {FP8: fp8_section()} and doc == base
    again = C.with_kv_dtype_section(cal, FP8, attrs.evolve(sec, provenance="again"))   # replaced, not added
    assert [(n, s.provenance) for n, s in again.by_kv_dtype] == [(FP8, "again")]
    with pytest.raises(ValueError, match="expected one of"):
        C.with_kv_dtype_section(h200, "float16", sec)


def test_calibration_knows_every_kv_dtype_of_routes_toml():
    from pkvrt.policy.registry import KV_DTYPES

    assert set(C.TOP_KV_DTYPES) | set(C.SECTION_KV_DTYPES) == set(KV_DTYPES)
    assert {KV_DTYPES[n] for n in C.TOP_KV_DTYPES} == {2} and {KV_DTYPES[n] for n in C.SECTION_KV_DTYPES} == {1}


# ----------------------------------------------------------------------------- head-dim sections

def _with_head_dim_256(doc: dict) -> dict:
    doc = dict(doc)
    doc["by_head_dim"] = {"256": {"splits": {"workqueue_ctas_per_sm": 1.0, "cta_overhead_tiles": 2.5,
                                             "by_group": {"8": {"min_split_tokens": 512}}},
                                  "date": "2026-12-05", "command": "pkvrt calibrate --head-dim 256",
                                  "source": "test"}}
    return doc


def test_head_dim_sections_are_the_kernels_other_head_dims():
    from pkvrt import _buildspec
    assert set(C.SECTION_HEAD_DIMS) == set(_buildspec.HEAD_DIMS) - {C.CALIBRATION_HEAD_DIM}


@pytest.mark.parametrize("key, expected", [("128", "keys among ['64', '96', '256']"),
                                           ("0256", "keys among"), ("abc", "keys among"), ("32", "keys among")])
def test_a_head_dim_section_of_another_key_is_refused(tmp_path, key, expected):
    doc = _with_head_dim_256(seed_doc())
    doc["by_head_dim"] = {key: doc["by_head_dim"]["256"]}
    with pytest.raises(CalibrationError, match=f"by_head_dim.{key}.*{re.escape(expected)}"):
        load_calibration(write(tmp_path, doc))


def test_a_head_dim_section_that_overrides_nothing_or_an_unknown_key_is_refused(tmp_path):
    doc = _with_head_dim_256(seed_doc())
    del doc["by_head_dim"]["256"]["splits"]
    with pytest.raises(CalibrationError, match="by_head_dim.256.splits.*splits or time_model"):
        load_calibration(write(tmp_path, doc))
    doc = _with_head_dim_256(seed_doc())
    doc["by_head_dim"]["256"]["splits"]["c_min"] = 1.0
    with pytest.raises(CalibrationError, match="by_head_dim.256.splits.c_min"):
        load_calibration(write(tmp_path, doc, "b.json"))


def test_for_head_dim_lays_its_section_over_the_file(tmp_path):
    """D 256 takes its section's constants (and its G 8 entry at G 8), keeps the file's others;
    D 64 has none: the file's, marked a fallback and said so; D 128 is the file's, unmarked. An
    FP8 section lies over the head dim's; either order with for_group; a resolved view answers
    only for its head dim, and is not a file."""
    cal = load_calibration(write(tmp_path, _with_head_dim_256(seed_doc())))
    d256 = cal.for_head_dim(256)
    assert (d256.splits.workqueue_ctas_per_sm, d256.splits.cta_overhead_tiles) == (1.0, 2.5)
    assert d256.splits.min_split_tokens == cal.splits.min_split_tokens and d256.beta_gbps == cal.beta_gbps
    assert d256.for_group(8).splits.min_split_tokens == 512 == cal.for_group(8).for_head_dim(256).splits.min_split_tokens
    assert d256.head_dim_note() == "D 256: the by_head_dim section's constants" and not d256.head_dim_fallback
    d64 = cal.for_head_dim(64)
    assert d64.splits == cal.splits and d64.head_dim_fallback and "pkvrt calibrate --head-dim 64" in d64.head_dim_note()
    assert cal.for_head_dim(128).head_dim_note() == "" and not cal.for_head_dim(128).head_dim_fallback
    assert d256.for_head_dim(256) is d256
    with pytest.raises(ValueError, match="already the D 256 view"):
        d256.for_head_dim(64)
    with pytest.raises(ValueError, match="ask it before for_kv_dtype"):
        cal.for_kv_dtype("float16").for_head_dim(256)
    with pytest.raises(ValueError, match="not a file's calibration"):
        C.calibration_to_dict(d256)
    fp8 = C.with_kv_dtype_section(cal, "float8_e4m3fn", C.KvDtypeSection(
        splits=(("cta_overhead_tiles", 7.0),), date="2026-12-05", command="x", provenance="y"))
    both = fp8.for_head_dim(256).for_kv_dtype("float8_e4m3fn")
    assert (both.splits.cta_overhead_tiles, both.splits.workqueue_ctas_per_sm) == (7.0, 1.0)
    added = C.with_head_dim_section(cal, 64, dict(cal.by_head_dim)[256])
    assert [d for d, _ in added.by_head_dim] == [64, 256]
    with pytest.raises(ValueError, match="expected one of \\[64, 96, 256\\]"):
        C.with_head_dim_section(cal, 128, dict(cal.by_head_dim)[256])


def test_a_section_of_an_empty_by_group_is_refused(tmp_path):
    """A section whose only content is an empty by_group overrides nothing (and could not be
    written back): refused, naming it."""
    doc = _with_head_dim_256(seed_doc())
    doc["by_head_dim"]["256"]["splits"] = {"by_group": {}}
    with pytest.raises(CalibrationError, match="by_head_dim.256.splits.*a constant to override"):
        load_calibration(write(tmp_path, doc))
