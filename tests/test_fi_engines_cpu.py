"""FlashInfer's decode paths as bench engines (pkvrt/measure/fi_engines.py) without a GPU: which
FlashInfer call each path makes, the refusals that make a path unavailable, and XQA's staged
block table and lengths, checked against the FP32 reference through a stand-in FlashInfer."""

from __future__ import annotations

import math
import sys
import types

import numpy as np
import pytest
import torch

from pkvrt import reference
from pkvrt.measure import fi_engines, harness
from pkvrt.measure.pagetable import build_layout
from pkvrt.measure.traces import Request, Trace, decode_steps
from pkvrt.policy.blocktables import to_padded


class Wrapper053:
    """FlashInfer 0.5.3's decode wrapper as far as pkvrt can see: it takes any ``backend`` and
    has no ``resolved_backend``."""

    def __init__(self, workspace, kv_layout, **kwargs):
        self.workspace, self.kv_layout, self.kwargs = workspace, kv_layout, kwargs


class Wrapper07(Wrapper053):
    @property
    def resolved_backend(self):
        return self.kwargs.get("backend", "auto")


def fake_flashinfer(version, wrapper=Wrapper07, entry=None):
    fi = types.ModuleType("flashinfer")
    fi.__version__ = version
    fi.BatchDecodeWithPagedKVCacheWrapper = wrapper
    if entry is not None:
        fi.decode = types.SimpleNamespace(trtllm_batch_decode_with_kv_cache=entry)
    return fi


def test_the_four_paths_and_their_wrapper_arguments():
    assert fi_engines.FI_VARIANTS == ("flashinfer-cuda", "flashinfer-tc", "flashinfer-cudnn",
                                      "flashinfer-xqa")
    ws = torch.zeros(16, dtype=torch.uint8)
    fi = fake_flashinfer("0.7.2")
    for label, kwargs in (("flashinfer-cuda", dict(backend="fa2", use_tensor_cores=False)),
                          ("flashinfer-tc", dict(backend="fa2", use_tensor_cores=True)),
                          ("flashinfer-cudnn", dict(backend="cudnn"))):
        w = fi_engines.make_wrapper(fi, label, ws)
        assert w.kv_layout == "HND" and w.kwargs == kwargs and w.workspace is ws


def test_cudnn_is_unavailable_where_the_wrapper_does_not_run_it():
    ws = torch.zeros(16, dtype=torch.uint8)
    with pytest.raises(RuntimeError, match=r"flashinfer 0\.5\.3: .*does not run backend='cudnn' "
                                           r"\(resolved_backend: None; FlashInfer 0\.6 and later"):
        fi_engines.make_wrapper(fake_flashinfer("0.5.3", Wrapper053), "flashinfer-cudnn", ws)
    # the fa2 paths need no resolved_backend (0.5.3 runs them)
    assert fi_engines.make_wrapper(fake_flashinfer("0.5.3", Wrapper053), "flashinfer-tc", ws)

    class FallsBack(Wrapper07):   # a wrapper that would run another kernel under the name
        resolved_backend = "fa2"
    with pytest.raises(RuntimeError, match="resolved_backend: 'fa2'"):
        fi_engines.make_wrapper(fake_flashinfer("0.6.0", FallsBack), "flashinfer-cudnn", ws)


def test_xqa_entry_and_its_arguments():
    with pytest.raises(RuntimeError, match=r"flashinfer 0\.4\.0 has no .*trtllm_batch_decode_with_kv_cache"):
        fi_engines.xqa_entry(fake_flashinfer("0.4.0"))
    calls = []
    fi = fake_flashinfer("0.7.2", entry=lambda **kw: calls.append(kw))
    entry = fi_engines.xqa_entry(fi)
    q, k, v, out = (torch.zeros(2, 8, 64), torch.zeros(5, 2, 16, 64), torch.ones(5, 2, 16, 64),
                    torch.zeros(2, 8, 64))
    table, seq, ws = torch.zeros(2, 3, dtype=torch.int32), torch.tensor([33, 5]), torch.zeros(4)
    fi_engines.run_xqa(entry, q, k, v, ws, table, seq, 33, out)
    (kw,) = calls
    assert kw["query"] is q and kw["kv_cache"][0] is k and kw["kv_cache"][1] is v and kw["out"] is out
    assert kw["block_tables"] is table and kw["seq_lens"] is seq and kw["workspace_buffer"] is ws
    assert kw["max_seq_len"] == 33
    # softmax scale 1/sqrt(D) and nothing else: bmm1 is the whole q.k scale, bmm2 that of p.v
    assert kw["bmm1_scale"] == pytest.approx(1 / math.sqrt(64)) and kw["bmm2_scale"] == 1.0
    assert kw["kv_layout"] == "HND" and kw["backend"] == "xqa"


def test_make_engine_refuses_an_unknown_path():
    with pytest.raises(ValueError, match="unknown FlashInfer path 'flashinfer-fa3'"):
        fi_engines.make_engine("flashinfer-fa3", None, max_active=1)


SHAPE = harness.Shape(num_qo_heads=8, num_kv_heads=2, head_dim=64, page_size=16)


def reference_xqa(**kw):
    """XQA's contract, done by the FP32 reference: ``block_tables`` [B, cols] and ``seq_lens``
    [B] say which tokens of the HND caches each row reads."""
    k, v = kw["kv_cache"]
    table, seq = kw["block_tables"], kw["seq_lens"]
    assert table.dtype == seq.dtype == torch.int32 and table.is_contiguous()
    assert kw["bmm1_scale"] == pytest.approx(1 / math.sqrt(k.shape[-1])) and kw["bmm2_scale"] == 1.0
    kw["out"].copy_(reference.decode_attention(kw["query"], k, v, seq, table))


def test_xqa_engine_stages_each_step_once_and_reads_the_right_pages(monkeypatch):
    calls = []

    def entry(**kw):
        calls.append(kw)
        reference_xqa(**kw)
    monkeypatch.setitem(sys.modules, "flashinfer", fake_flashinfer("0.7.2", entry=entry))
    reqs = (Request(0, 0, 900, 3), Request(1, 0, 40, 2), Request(2, 1, 500, 2))
    trace = Trace(name="t", requests=reqs, seed=None, source="test")
    layout = build_layout(trace, page_size=16, hole_fraction=0.5, seed=3)
    gen = torch.Generator().manual_seed(0)
    shape4 = (layout.num_physical_pages, SHAPE.num_kv_heads, SHAPE.page_size, SHAPE.head_dim)
    k, v = torch.randn(shape4, generator=gen), torch.randn(shape4, generator=gen)
    q = torch.randn(2, SHAPE.num_qo_heads, SHAPE.head_dim, generator=gen)
    wl = types.SimpleNamespace(shape=SHAPE, layout=layout, device="cpu")
    eng = fi_engines.XqaEngine(wl)
    assert eng.label == "flashinfer-xqa" and eng.workspace.count_nonzero() == 0
    steps = list(decode_steps(trace, max_active=2))
    for step in steps + steps:                  # the second pass reuses the staged tensors
        b = len(step.rids)
        out = torch.full((b, SHAPE.num_qo_heads, SHAPE.head_dim), float("nan"))
        eng.plan(step)
        eng.attend(q[:b], k, v, out)
        table, seq = to_padded(step.seq_lens, layout.block_table(step.rids), 16)
        assert calls[-1]["block_tables"].tolist() == table.tolist()
        assert calls[-1]["seq_lens"].tolist() == seq.tolist()
        assert calls[-1]["max_seq_len"] == int(step.seq_lens.max())
        want = reference.decode_attention(q[:b], k, v, torch.from_numpy(seq),
                                          torch.from_numpy(layout.block_table(step.rids)))
        assert torch.allclose(out, want)
    n = len(steps)
    assert all(calls[i]["block_tables"] is calls[i + n]["block_tables"] for i in range(n))
    assert len(eng._on_device) == n
    route, splits, counters = eng.step_info()
    assert route == "flashinfer" and splits == () and counters.launches == 1
    assert counters.useful_kv_bytes == int(np.sum(steps[-1].seq_lens)) * SHAPE.kv_bytes_per_token


def test_xqa_engine_is_unavailable_without_the_entry_point(monkeypatch):
    monkeypatch.setitem(sys.modules, "flashinfer", fake_flashinfer("0.4.0"))
    wl = types.SimpleNamespace(shape=SHAPE, layout=None, device="cpu")
    with pytest.raises(RuntimeError, match=r"flashinfer 0\.4\.0 has no"):
        fi_engines.make_engine("flashinfer-xqa", wl, max_active=2)


def _isolated():
    """benches/isolated.py as a module (as ``pkvrt bench isolated`` loads it)."""
    import importlib.util

    from pkvrt.tools.bench import ISOLATED

    spec = importlib.util.spec_from_file_location("pkvrt_benches_isolated_test", ISOLATED)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_isolated_baseline_is_the_fastest_correct_path_and_names_the_rest():
    iso = _isolated()
    ok = dict(max_err_ref=1e-3, mean_err_ref=1e-5)
    rows = [dict(case="c", engine="flashinfer-cuda", median_us=51.1, **ok),
            dict(case="c", engine="flashinfer-tc", median_us=43.9, **ok),
            dict(case="c", engine="flashinfer-xqa", median_us=30.0, max_err_ref=float("nan"),
                 mean_err_ref=float("nan")),                           # fastest, but wrong
            dict(case="c", engine="flashinfer-cudnn",
                 unavailable="unavailable: RuntimeError: flashinfer 0.5.3: no backend='cudnn'"),
            dict(case="c", engine="pkvrt-bucket", median_us=40.0, **ok)]
    base, status = iso.fi_candidates(rows)
    assert base == "flashinfer-tc"
    assert status == {"flashinfer-cuda": "ok", "flashinfer-tc": "ok",
                      "flashinfer-cudnn": "unavailable: RuntimeError: flashinfer 0.5.3: no backend='cudnn'",
                      "flashinfer-xqa": "wrong output: vs FP32 max|e| nan, mean|e| nan"}
    rows[1] = dict(case="c", engine="flashinfer-tc", error="RuntimeError('JIT failed')")
    base, status = iso.fi_candidates(rows)
    assert base == "flashinfer-cuda" and status["flashinfer-tc"] == "unavailable: RuntimeError('JIT failed')"
    base, status = iso.fi_candidates(rows[4:])
    assert base is None and set(status.values()) == {"unavailable: not run"}
