"""FlashInfer's decode paths (pkvrt/measure/fi_engines.py) on the GPU: every path gives the FP32
reference's attention on ragged decode steps, as the serving bench runs it (planned per step,
eager) and as benches/isolated.py runs it (planned once, replayed as a CUDA graph over pages
with holes and NaN-poisoned padding). A path this FlashInfer does not have (cuDNN before 0.6)
is skipped with the reason; any other failure fails."""

from __future__ import annotations

import importlib.util

import pytest
import torch

from pkvrt.measure import fi_engines, harness
from pkvrt.measure.traces import Request, Trace
from pkvrt.runtime import fi_route
from pkvrt.tools.bench import ISOLATED

pytestmark = pytest.mark.gpu

FI_MODULE, FI_REASON = fi_route.load_flashinfer()


def built_or_skip(make):
    """``make()``, or a skip when it says this FlashInfer lacks the path: cuDNN before 0.6
    (RuntimeError at construction), or FlashInfer's own NotImplementedError at the first call
    (0.7.2 without the cuDNN frontend: "q.dtype=torch.float16 requires the cuDNN graph
    backend"), the two cases the harness records as unavailable."""
    if FI_MODULE is None:
        pytest.skip(f"FlashInfer unavailable: {FI_REASON}")
    try:
        return make()
    except NotImplementedError as exc:   # a RuntimeError subclass: caught first
        if "cuDNN" in str(exc):   # only the cuDNN path's known refusal; any other one fails
            pytest.skip(f"this FlashInfer lacks the path: {exc}")
        raise
    except RuntimeError as exc:
        if "does not run backend" in str(exc):
            pytest.skip(str(exc))
        raise


@pytest.mark.parametrize("label", fi_engines.FI_VARIANTS)
@pytest.mark.parametrize("num_kv_heads", [8, 4])   # G = 4 and G = 8
def test_serving_engine_matches_the_reference(label, num_kv_heads):
    reqs = (Request(0, 0, 17000, 3), Request(1, 0, 900, 3), Request(2, 1, 5000, 2),
            Request(3, 2, 33, 2))
    trace = Trace(name="ragged", requests=reqs, seed=None, source="test")
    shape = harness.Shape(num_kv_heads=num_kv_heads)
    config = harness.ServingConfig(trace="ragged", max_active=4, seeds=(3,), engines=("flashinfer",),
                                   shape=shape)
    wl = harness.Workload(trace, config, 3)
    eng = built_or_skip(lambda: fi_engines.make_engine(label, wl, max_active=4))
    assert eng.label == label
    out = torch.full((4, shape.num_qo_heads, shape.head_dim), float("nan"), dtype=torch.float16,
                     device="cuda")
    keep = tuple(range(len(wl.steps)))
    refs = {pos: harness.reference_rows(wl, wl.steps[pos]) for pos in keep}
    kept = built_or_skip(lambda: harness.untimed_pass(eng, wl, wl.steps, out, harness.CudaClock(),
                                                      keep=keep))
    assert harness.wrong_output(kept, refs, wl.steps) is None
    # again, the steps staged or planned a second time (XQA reuses its device tables)
    kept = harness.untimed_pass(eng, wl, wl.steps, out.fill_(float("nan")), harness.CudaClock(),
                                keep=keep)
    assert harness.wrong_output(kept, refs, wl.steps) is None


@pytest.fixture(scope="module")
def isolated():
    spec = importlib.util.spec_from_file_location("pkvrt_benches_isolated_gpu", ISOLATED)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


@pytest.mark.parametrize("label", fi_engines.FI_VARIANTS)
def test_isolated_engine_in_a_cuda_graph(isolated, label):
    case = isolated.Case("ragged", [5000, 900, 33, 2048], 32, 8)
    fn, out = built_or_skip(lambda: isolated.engine_fi_path(case, label))
    out.fill_(float("nan"))
    us = built_or_skip(lambda: isolated.median_us(fn, case.copies, repeats=3))  # warm-up, capture, replays
    max_e, mean_e = isolated.errors(out, case.ref)
    assert us > 0 and harness.within_tolerance(max_e, mean_e), (label, max_e, mean_e)
