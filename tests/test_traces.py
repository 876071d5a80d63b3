"""Traces: synthetic families, the trace-file loaders and their errors, the decode loop."""

from __future__ import annotations

import json

import attrs
import numpy as np
import pytest
from hypothesis import given, settings, strategies as st

from pkvrt._paths import CHECKOUT
import pkvrt.measure.traces as traces
from pkvrt.measure.traces import Request, Trace, TraceError

SHARED_TRACES = CHECKOUT.parent / "shared" / "traces"
SEEDS = [20260622, 20260623, 20260627]


# --------------------------------------------------------------------------- synthetic families

@pytest.mark.parametrize("family", traces.FAMILIES)
@pytest.mark.parametrize("seed", SEEDS)
def test_synthetic_is_deterministic_per_seed(family, seed):
    a = traces.synthetic(family, num_requests=40, seed=seed)
    b = traces.synthetic(family, num_requests=40, seed=seed)
    assert a == b
    assert a.seed == seed and a.name == family and a.source == f"synthetic:{family}"
    assert [r.rid for r in a.requests] == list(range(40))


@pytest.mark.parametrize("family", ["bimodal", "uniform", "zipf"])
def test_synthetic_seeds_differ(family):
    a = traces.synthetic(family, num_requests=40, seed=1)
    b = traces.synthetic(family, num_requests=40, seed=2)
    assert not np.array_equal(a.column("prompt_len"), b.column("prompt_len"))


@pytest.mark.parametrize("family", traces.FAMILIES)
@pytest.mark.parametrize("seed", SEEDS)
def test_synthetic_ranges(family, seed):
    n = 200
    tr = traces.synthetic(family, num_requests=n, seed=seed)
    prompt, decode = tr.column("prompt_len"), tr.column("decode_len")
    assert decode.min() >= 32 and decode.max() <= 128
    assert (tr.column("arrival_step") == 0).all()
    if family == "bucketed":
        assert prompt.tolist() == [8192, 16384, 32768, 65536] * (n // 4)
    elif family == "homogeneous":
        assert (prompt == 32768).all()
    elif family == "bimodal":
        is_long = prompt >= traces.BIMODAL_LONG[0]
        assert (prompt[is_long] <= traces.BIMODAL_LONG[1]).all()
        short = prompt[~is_long]
        assert short.min() >= 1024 and short.max() <= 4096
        # exactly one long request per block of four
        assert (is_long.reshape(-1, 4).sum(axis=1) == 1).all()
    else:
        assert prompt.min() >= 1024 and prompt.max() <= 65536
        if family == "zipf":  # heavy tail: most requests short, the median well below the mean
            assert np.median(prompt) < prompt.mean()
            assert (prompt < 8192).mean() > 0.4


def test_synthetic_decode_range_and_errors():
    tr = traces.synthetic("uniform", num_requests=50, seed=0, decode_range=(5, 6))
    assert set(tr.column("decode_len").tolist()) <= {5, 6}
    with pytest.raises(ValueError, match="family='nope'"):
        traces.synthetic("nope", num_requests=4, seed=0)
    with pytest.raises(ValueError, match="num_requests=0"):
        traces.synthetic("uniform", num_requests=0, seed=0)
    with pytest.raises(ValueError, match="decode_range"):
        traces.synthetic("uniform", num_requests=4, seed=0, decode_range=(0, 3))


def test_bimodal_partial_block_and_fraction():
    tr = traces.synthetic("bimodal", num_requests=6, seed=5)
    assert len(tr) == 6
    tr = traces.synthetic("bimodal", num_requests=400, seed=5)
    assert (tr.column("prompt_len") >= 16384).mean() == pytest.approx(0.25)


# --------------------------------------------------------------------------- the mixed fixture

def test_mixed_fixture_matches_its_generator():
    shipped = traces.resolve_trace("mixed", seed=0)
    made = traces.mixed_fixture()
    assert shipped.name == "mixed" and len(shipped) == 32
    assert shipped.requests == made.requests
    prompt = shipped.column("prompt_len")
    assert (prompt >= 16384).sum() >= 4 and (prompt < 4096).sum() >= 8
    arrivals = shipped.column("arrival_step")
    assert (np.diff(arrivals) >= 0).all() and arrivals.max() > 0


# --------------------------------------------------------------------------- files

def test_csv_roundtrip_any_column_order(tmp_path):
    path = tmp_path / "t.csv"
    path.write_text("decode_len, prompt_len ,arrival_step\n"
                    "4,100,0\n\n3,+7,2\n")
    tr = traces.load_trace(path)
    assert tr.requests == (Request(0, 0, 100, 4), Request(1, 2, 7, 3))
    assert tr.seed is None and tr.source == str(path) and tr.name == "t"


def test_csv_without_arrival_column(tmp_path):
    path = tmp_path / "t.csv"
    path.write_text("prompt_len,decode_len\n10,2\n20,1\n")
    assert traces.load_trace(path).column("arrival_step").tolist() == [0, 0]


@pytest.mark.parametrize("family", traces.FAMILIES)
def test_write_csv_roundtrip(tmp_path, family):
    """CSV for the families without prefix hashes, JSON (which keeps them) for every family."""
    tr = traces.synthetic(family, num_requests=9, seed=3)
    if not any(r.prefix for r in tr.requests):
        traces.write_csv(tr, tmp_path / "x.csv")
        assert traces.load_trace(tmp_path / "x.csv").requests == tr.requests
    traces.write_json(tr, tmp_path / "x.json")
    assert traces.load_trace(tmp_path / "x.json").requests == tr.requests


@pytest.mark.parametrize("wrapped", [False, True])
def test_json_loads_both_shapes(tmp_path, wrapped):
    reqs = [{"prompt_len": 5, "decode_len": 2, "arrival_step": 1},
            {"decode_len": 1, "prompt_len": 9}]
    path = tmp_path / "t.json"
    path.write_text(json.dumps({"meta": {"x": [1]}, "requests": reqs} if wrapped else reqs,
                               indent=2))
    tr = traces.load_trace(path)
    assert tr.requests == (Request(0, 1, 5, 2), Request(1, 0, 9, 1))


CSV_CASES = [
    # (file text, line, field, words the message must contain)
    ("", 1, None, "empty file"),
    ("prompt_len,arrival_step\n5,0\n", 1, "decode_len", "column"),
    ("decode_len,arrival_step\n5,0\n", 1, "prompt_len", "column"),
    ("prompt_len,decode_len\n", 2, None, "at least one request"),
    ("prompt_len,decode_len\n10,4\n0,4\n", 3, "prompt_len", "positive"),
    ("prompt_len,decode_len\n10,-1\n", 2, "decode_len", "positive"),
    ("prompt_len,decode_len\n10,4\n\n12.5,4\n", 4, "prompt_len", "integer"),
    ("prompt_len,decode_len\n10,abc\n", 2, "decode_len", "integer"),
    ("prompt_len,decode_len\n10,\n", 2, "decode_len", "integer"),
    ("prompt_len,decode_len,arrival_step\n10,4,-3\n", 2, "arrival_step", "negative"),
    ("prompt_len,decode_len,arrival_step\n10,4,0\n10,4\n", 3, "arrival_step", "no value"),
    ("prompt_len,decode_len\n2147483647,4\n", 2, "decode_len", "int32"),
    ("prompt_len,decode_len\n99999999999,4\n", 2, "prompt_len", "int32"),
    # a misspelt optional column is refused, not silently absent (arrival_step would read as 0)
    ("prompt_len,decode_len,arrival_stp\n10,4,3\n", 1, "arrival_stp", "unknown column"),
    ("prompt_len,decode_len,note\n10,4,x\n", 1, "note", "unknown column"),
    ("prompt_len,decode_len,\n10,4,\n", 1, None, "column 3 of the header has no name"),
    ("prompt_len,decode_len,prompt_len\n10,4,9\n", 1, "prompt_len", "2 times"),
]

JSON_CASES = [
    ("", 1, None, "valid JSON"),
    ('[{"prompt_len": 1, "decode_len": 2},\n {"prompt_len": 1 "decode_len": 2}]', 2, None,
     "valid JSON"),
    ('[]', 1, "requests", "at least one"),
    ('{"reqs": []}', 1, "requests", "under key"),
    ('"hello"', 1, None, "list of request objects"),
    ('[\n {"prompt_len": 1, "decode_len": 2},\n 7\n]', 3, None, "request object"),
    ('[\n {"prompt_len": 1, "decode_len": 2},\n\n {"prompt_len": 3}\n]', 4, "decode_len",
     "expected key"),
    ('{"name": "x",\n "requests": [\n  {"prompt_len": 1, "decode_len": 2},\n'
     '  {"prompt_len": 0, "decode_len": 2}]}', 4, "prompt_len", "positive"),
    ('[{"prompt_len": "12", "decode_len": 2}]', 1, "prompt_len", "integer"),
    ('[{"prompt_len": 12.0, "decode_len": 2}]', 1, "prompt_len", "integer"),
    ('[{"prompt_len": 12, "decode_len": true}]', 1, "decode_len", "integer"),
    ('[{"prompt_len": 12, "decode_len": 2, "arrival_step": -1}]', 1, "arrival_step", "negative"),
    ('{"requests": [{"prompt_len": 1, "decode_len": 2}],\n "requests": [\n {"prompt_len": 0, '
     '"decode_len": 2}]}', 3, "prompt_len", "positive"),           # duplicate key: the last wins
    ('[\n {"prompt_len": 1, "decode_len": 2},\n {"prompt_len": 1, "decode_len": 2, '
     '"arrivalstep": 4}\n]', 3, "arrivalstep", "unknown key"),
]


@pytest.mark.parametrize("suffix,text,line,field,words",
                         [("csv", *c) for c in CSV_CASES] + [("json", *c) for c in JSON_CASES])
def test_file_errors_name_file_line_field(tmp_path, suffix, text, line, field, words):
    path = tmp_path / f"bad.{suffix}"
    path.write_text(text)
    with pytest.raises(TraceError) as info:
        traces.load_trace(path)
    err = info.value
    msg = str(err)
    assert str(path) in msg and f"line {line}" in msg and words in msg
    assert (err.file, err.line, err.field) == (str(path), line, field)
    if field is not None:
        assert repr(field) in msg


@pytest.mark.parametrize("suffix, text", [
    ("csv", "prompt_len,decode_len,arival_step\n10,4,3\n"),
    ("json", '[{"prompt_len": 10, "decode_len": 4, "arival_step": 3}]'),
])
def test_unknown_column_names_the_accepted_ones(tmp_path, suffix, text):
    path = tmp_path / f"typo.{suffix}"
    path.write_text(text)
    with pytest.raises(TraceError) as info:
        traces.load_trace(path)
    msg = str(info.value)
    assert msg.startswith(f"{path}, line 1, field 'arival_step': unknown ")
    assert msg.endswith("prompt_len, decode_len (required), arrival_step (optional)"
                        + (", hash_ids (optional)" if suffix == "json" else ""))


def test_raw_azure_columns_are_refused_not_guessed(tmp_path):
    """The Azure LLM inference trace's own columns are not aliases: such a file must be converted
    (docs/traces.md) rather than load with every column ignored."""
    path = tmp_path / "AzureLLMInferenceTrace_code.csv"
    path.write_text("TIMESTAMP,ContextTokens,GeneratedTokens\n"
                    "2023-11-16 18:15:46.6805900,4808,10\n")
    with pytest.raises(TraceError, match=r"line 1, field 'TIMESTAMP': unknown column"):
        traces.load_trace(path)


def test_non_utf8_file_names_line(tmp_path):
    path = tmp_path / "latin1.csv"
    path.write_bytes(b"prompt_len,decode_len\n10,4\n\xe9,4\n")
    with pytest.raises(TraceError, match=r"latin1.csv, line 3: expected UTF-8"):
        traces.load_trace(path)


def test_trace_error_is_a_value_error_and_pickles():
    import pickle
    err = TraceError("f.csv", 3, "prompt_len", "expected x")
    assert isinstance(err, ValueError)
    again = pickle.loads(pickle.dumps(err))
    assert str(again) == str(err) and again.line == 3


def test_resolve_trace_specs(tmp_path):
    fam = traces.resolve_trace("zipf", num_requests=7, seed=4)
    assert fam == traces.synthetic("zipf", num_requests=7, seed=4)
    assert len(traces.resolve_trace("uniform", seed=4)) == 32
    assert len(traces.resolve_trace("mixed", num_requests=5, seed=4)) == 5
    path = tmp_path / "t.csv"
    path.write_text("prompt_len,decode_len\n1,1\n2,2\n3,3\n")
    assert len(traces.resolve_trace(str(path), seed=0)) == 3
    assert traces.resolve_trace(str(path), num_requests=2, seed=0).column(
        "prompt_len").tolist() == [1, 2]
    with pytest.raises(ValueError, match="'nope'.*bimodal"):
        traces.resolve_trace("nope", seed=0)


def test_request_and_trace_validate():
    with pytest.raises(ValueError, match="prompt_len"):
        Request(0, 0, 0, 1)
    with pytest.raises(ValueError, match="arrival_step"):
        Request(0, -1, 1, 1)
    with pytest.raises(ValueError, match="rid=0"):
        Trace(name="x", requests=(Request(1, 0, 1, 1),), seed=None, source="t")
    with pytest.raises(ValueError, match="at least one"):
        Trace(name="x", requests=(), seed=None, source="t")


@pytest.mark.parametrize("name", ["azure2023_code.csv", "azure2023_conv.csv"])
def test_azure_traces_load(name):
    path = SHARED_TRACES / name
    if not path.is_file():
        pytest.skip(f"{path} not present")
    tr = traces.load_trace(path)
    assert len(tr) == 2000
    prompt, decode = tr.column("prompt_len"), tr.column("decode_len")
    assert prompt.min() >= 1 and prompt.max() < 8192 and decode.min() >= 1
    assert (np.diff(tr.column("arrival_step")) >= 0).all()
    steps = list(traces.decode_steps(tr, max_active=8))
    assert sum(len(s.rids) for s in steps) == decode.sum()


# --------------------------------------------------------------------------- decode loop

def _check_loop(trace: Trace, max_active: int):
    """Replay decode_steps and check every rule of the continuous-decode loop."""
    arrival = trace.column("arrival_step")
    prompt, decode = trace.column("prompt_len"), trace.column("decode_len")
    first, last, count = {}, {}, {}
    prev_clock = None
    admitted = []
    prev_active = set()
    for i, s in enumerate(traces.decode_steps(trace, max_active=max_active)):
        assert s.index == i
        assert s.rids.dtype == np.int32 and s.seq_lens.dtype == np.int32
        assert 1 <= len(s.rids) <= max_active
        assert len(set(s.rids.tolist())) == len(s.rids)
        if prev_clock is not None:
            assert s.clock > prev_clock
            if s.clock > prev_clock + 1:        # only skip when nothing carried over ...
                assert not (prev_active - set(last_left))
                assert arrival[s.rids].min() == s.clock     # ... and land on an arrival
        for rid, seq in zip(s.rids.tolist(), s.seq_lens.tolist()):
            assert arrival[rid] <= s.clock
            if rid not in first:
                first[rid] = s.clock
                admitted.append(rid)
            else:
                assert last[rid] == s.clock - 1          # active on consecutive steps
            assert seq == prompt[rid] + (s.clock - first[rid]) + 1
            last[rid] = s.clock
            count[rid] = count.get(rid, 0) + 1
        last_left = [r for r in s.rids.tolist() if count[r] == decode[r]]
        prev_active = set(s.rids.tolist())
        # work conservation: a waiting, arrived request means the batch is full
        waiting = [r for r in range(len(trace)) if r not in first and arrival[r] <= s.clock]
        if waiting:
            assert len(s.rids) == max_active
        prev_clock = s.clock
    assert count == {r: int(decode[r]) for r in range(len(trace))}
    order = sorted(range(len(trace)), key=lambda r: (arrival[r], r))
    assert admitted == order
    return first


request_lists = st.lists(
    st.tuples(st.integers(0, 30), st.integers(1, 50), st.integers(1, 12)), min_size=1,
    max_size=25)


@settings(max_examples=150, deadline=None)
@given(reqs=request_lists, max_active=st.integers(1, 9))
def test_decode_loop_properties(reqs, max_active):
    tr = Trace(name="h", requests=tuple(Request(i, a, p, d) for i, (a, p, d) in enumerate(reqs)),
               seed=None, source="hypothesis")
    _check_loop(tr, max_active)


def test_decode_loop_skips_idle_gap_and_worked_example():
    tr = Trace(name="g", requests=(Request(0, 0, 10, 2), Request(1, 5, 100, 3)), seed=None,
               source="t")
    steps = list(traces.decode_steps(tr, max_active=4))
    assert [s.clock for s in steps] == [0, 1, 5, 6, 7]
    assert [s.index for s in steps] == [0, 1, 2, 3, 4]
    assert [s.seq_lens.tolist() for s in steps] == [[11], [12], [101], [102], [103]]


def test_decode_loop_admission_waits_for_free_slot():
    reqs = (Request(0, 0, 5, 3), Request(1, 0, 7, 1), Request(2, 0, 9, 2))
    tr = Trace(name="q", requests=reqs, seed=None, source="t")
    steps = list(traces.decode_steps(tr, max_active=2))
    assert [s.rids.tolist() for s in steps] == [[0, 1], [0, 2], [0, 2]]
    assert [s.seq_lens.tolist() for s in steps] == [[6, 8], [7, 10], [8, 11]]


@pytest.mark.parametrize("family", traces.FAMILIES)
def test_synthetic_batches_stay_full(family):
    tr = traces.synthetic(family, num_requests=32, seed=20260623)
    steps = list(traces.decode_steps(tr, max_active=8))
    full = np.mean([len(s.rids) == 8 for s in steps])
    assert full > 0.6
    _check_loop(tr, 8)


@pytest.mark.parametrize("bad", [0, -1, 2.0, True])
def test_decode_loop_rejects_bad_max_active(bad):
    tr = traces.synthetic("uniform", num_requests=2, seed=0)
    with pytest.raises(ValueError, match="max_active"):
        next(traces.decode_steps(tr, max_active=bad))


def test_trace_is_frozen():
    tr = traces.synthetic("uniform", num_requests=2, seed=0)
    with pytest.raises(attrs.exceptions.FrozenInstanceError):
        tr.name = "x"
