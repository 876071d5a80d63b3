"""A CPU stand-in for the GPU that the GPU benches run on, so that their own code runs end to end
without one (tests/test_model_shapes_dry_cpu.py, tests/test_dropin_dry_cpu.py): a bench's
Python mistakes (a wrong keyword, shape, dtype, key or loop, a results file that cannot be
written, a table that fails on a missing baseline) then cost no GPU minutes.

What stands in for what:

- the device: tests/test_runtime_cpu.py's fake device (CPU tensors, the Runtime's kernels
  emulated in FP32 by ``Emu``), each launch through the real launch wrapper's argument checks
  first (tests/test_gpu_tests_dry_cpu.py's ``checked``), the H200's name, calibration and
  residency.
- CUDA graphs: a capture records the kernel launches made in it (the Runtime's, and the
  stand-in FlashInfer's below) instead of running them, and a replay runs the recorded
  launches with the arguments they were given, so a replay reads whatever the plan left in the
  buffers it captured, as on the GPU. Host code inside a capture runs once, at capture; a
  ``torch.cuda.synchronize()``, a FlashInfer ``plan()`` or a read of a tensor's values on the
  host (:data:`HOST_READS`) inside one raises, as on the GPU. Replaying a graph that captured
  nothing fails the test.
- CUDA events: ``elapsed_time`` counts the kernel launches run between the two records, 10 us
  each. Deterministic and never zero for a real replay; the times and ratios mean nothing else.
- FlashInfer: :func:`make_flashinfer`, a module whose decode wrapper (FA2, tensor and CUDA
  cores, CUDA-graph mode with the caller's fixed buffers, NHD and HND) and XQA entry
  (``flashinfer.decode.trtllm_batch_decode_with_kv_cache``) take FlashInfer's arguments, refuse
  what FlashInfer refuses (a batch other than the buffers', a dtype or window other than the
  plan's, a CUDA-core group size it has no kernel for, a page size XQA has none for) and compute
  with :mod:`pkvrt.reference`. As the real FA2 decode does, it accepts ``sinks=`` and ignores
  them, so a bench that trusts FA2 with sinks gets a wrong answer here too. A call at head dim
  96, which crashed the CUDA context on the H200, is recorded in :attr:`FakeGpu.poisoned`.

Not seen here: the kernels' numerics (everything is FP32 on the CPU), the rest of real graph
capture (a launch on another stream that escapes it, an allocation inside it, a host read the
list above misses), device placement (a tensor left on the host), memory use, FlashInfer's JIT
compiles and the timings themselves.
"""

from __future__ import annotations

import contextlib
import inspect
import math
import sys
import types

import pytest
import torch
from test_gpu_tests_dry_cpu import REAL, checked, cpu_tensors_pass_as_cuda
from test_runtime_cpu import Emu, install_fake_device

from pkvrt import reference
from pkvrt.launch import _driver
from pkvrt.runtime import fi_route, graphs

US_PER_LAUNCH = 10.0
XQA_PAGE_SIZES = (16, 32, 64, 128)   # pkvrt/measure/fi_engines.py: the page sizes XQA has kernels for


# Reading a tensor's values on the host: inside a real capture, of a device tensor, an error
# (a synchronizing copy); the fake device cannot tell device from host tensors, so any such read
# inside a capture fails (the kernels' emulation is not run then: its launches are recorded).
HOST_READS = ("item", "tolist", "cpu", "numpy", "__int__", "__float__", "__bool__")


def _refused(name: str):
    def read(self, *a, **k):
        raise RuntimeError(f"Tensor.{name}() inside a CUDA-graph capture: a host read of a device "
                           "tensor is not permitted while the stream is capturing")
    return read


class FakeGpu:
    """The launches of the fake device: run now, or recorded into the graph being captured."""

    def __init__(self):
        self.capturing: RecordedGraph | None = None
        self.launched = 0        # launches run so far (what the events count)
        self.poisoned: list[str] = []   # calls that would have crashed the H200's CUDA context

    def launch(self, kernel) -> None:
        if self.capturing is not None:
            self.capturing.launches.append(kernel)
        else:
            self.run(kernel)

    def run(self, kernel) -> None:
        kernel()
        self.launched += 1

    @contextlib.contextmanager
    def capture(self, graph):
        if self.capturing is not None:
            raise RuntimeError("nested CUDA-graph capture")
        self.capturing = graph
        saved = {name: torch.Tensor.__dict__.get(name) for name in HOST_READS}
        for name in HOST_READS:
            setattr(torch.Tensor, name, _refused(name))
        try:
            yield
        finally:
            self.capturing = None
            for name, fn in saved.items():
                if fn is None:
                    delattr(torch.Tensor, name)
                else:
                    setattr(torch.Tensor, name, fn)


class RecordedGraph:
    """torch.cuda.CUDAGraph: the launches captured into it, run again by each replay."""

    gpu: FakeGpu   # set by install()

    def __init__(self, keep_graph: bool = False):
        self.launches = []

    def replay(self) -> None:
        assert self.launches, "replayed a CUDA graph that captured no launch"
        for kernel in self.launches:
            self.gpu.run(kernel)

    def reset(self) -> None:
        self.launches = []


class FakeStream:
    def wait_stream(self, other) -> None:
        pass

    def wait_event(self, event) -> None:
        pass

    def synchronize(self) -> None:
        pass


class LaunchCountingEvent:
    """torch.cuda.Event: ``elapsed_time`` is US_PER_LAUNCH per launch run between the records."""

    gpu: FakeGpu   # set by install()

    def __init__(self, enable_timing: bool = False, blocking: bool = False, interprocess: bool = False):
        self.timing, self.at = enable_timing, None

    def record(self, stream=None) -> None:
        self.at = self.gpu.launched

    def synchronize(self) -> None:
        pass

    def query(self) -> bool:
        return True

    def elapsed_time(self, end) -> float:
        if not (self.timing and end.timing):
            raise RuntimeError("Both events must be created with argument 'enable_timing=True'")
        assert self.at is not None and end.at is not None, "elapsed_time of an event never recorded"
        return (end.at - self.at) * US_PER_LAUNCH / 1e3   # ms, as CUDA's


def _deferred(gpu: FakeGpu, name: str, emulated):
    """ops.<name> on the fake device: the real wrapper's argument checks now (at capture, as on
    the GPU), the emulated kernel as a launch (recorded while capturing)."""
    real, run = REAL[name], checked(name, emulated)
    sig = inspect.signature(real)

    def launch(*args, **kw):
        sig.bind(*args, **kw)
        with cpu_tensors_pass_as_cuda():
            real(*args, **kw)
        gpu.launch(lambda: run(*args, **kw))

    return launch


def install(monkeypatch) -> FakeGpu:
    """Patch torch.cuda, the Runtime's device and pkvrt's graph capture onto a :class:`FakeGpu`."""
    gpu = FakeGpu()
    emu = Emu()
    for family in ("split_decode", "workqueue_decode", "fused_decode"):   # the H200's residency
        emu.occupancy.update({(family, 64): 4, (family, 256): 1})        # (benches/NOTES.md)
    install_fake_device(monkeypatch.setattr,
                        lambda name: _deferred(gpu, name, getattr(emu, name)) if name in REAL
                        else getattr(emu, name))
    monkeypatch.setattr(_driver, "launch", lambda *a, **k: None)
    monkeypatch.setattr(RecordedGraph, "gpu", gpu, raising=False)
    monkeypatch.setattr(LaunchCountingEvent, "gpu", gpu, raising=False)

    def capture(launch, *, side_stream=None, pool=None, device=None, capture_error_mode="global"):
        launch()                       # the warm-up, as pkvrt.runtime.graphs.capture's
        graph = RecordedGraph()
        with gpu.capture(graph):
            launch()
        if not graph.launches:         # as the real one: an empty graph is an error
            raise RuntimeError("pkvrt.runtime.graphs.capture: the captured CUDA graph is empty (0 nodes)")
        return graphs.GraphEntry(graph=graph, nodes=len(graph.launches), mem_bytes=0)

    def synchronize(*a, **k):
        if gpu.capturing is not None:
            raise RuntimeError("CUDA error: operation not permitted when stream is capturing")

    def device_properties(*a, **k):
        return types.SimpleNamespace(name="NVIDIA H200", multi_processor_count=132, major=9, minor=0,
                                     L2_cache_size=60 * 2**20, total_memory=141 * 2**30)

    cuda = torch.cuda
    for name, value in (
            ("is_available", lambda: True), ("current_device", lambda: 0),
            ("get_device_name", lambda *a, **k: "NVIDIA H200"),
            ("get_device_properties", device_properties), ("synchronize", synchronize),
            ("is_current_stream_capturing", lambda: gpu.capturing is not None),
            ("Stream", lambda *a, **k: FakeStream()), ("current_stream", lambda *a, **k: FakeStream()),
            ("stream", lambda s: contextlib.nullcontext()), ("Event", LaunchCountingEvent),
            ("CUDAGraph", RecordedGraph),
            ("graph", lambda g, pool=None, stream=None, capture_error_mode="global": gpu.capture(g))):
        monkeypatch.setattr(cuda, name, value)
    monkeypatch.setattr(graphs, "capture", capture)
    return gpu


# ----------------------------------------------------------------------------- FlashInfer


def _unpack(paged_kv_cache, kv_layout: str):
    """FlashInfer's ``_unpack_paged_kv_cache``: (K, V), or one 5-D tensor with K, V at dim 1."""
    if isinstance(paged_kv_cache, (tuple, list)):
        k, v = paged_kv_cache
    else:
        if paged_kv_cache.dim() != 5 or paged_kv_cache.shape[1] != 2:
            raise ValueError(f"paged_kv_cache: expected (k, v) or [pages, 2, ...], got {tuple(paged_kv_cache.shape)}")
        k, v = paged_kv_cache[:, 0], paged_kv_cache[:, 1]
    if k.dim() != 4 or v.shape != k.shape:
        raise ValueError(f"paged_kv_cache: expected 4-D K and V of one shape, got {tuple(k.shape)}, {tuple(v.shape)}")
    if kv_layout == "NHD":   # [pages, page, H_kv, D] -> the reference's [pages, H_kv, page, D] (a view)
        return k.transpose(1, 2), v.transpose(1, 2)
    return k, v


def _check_out(out, q, dtype):
    if out is None:
        return torch.empty_like(q, dtype=dtype)
    if tuple(out.shape) != tuple(q.shape) or out.dtype != dtype or out.device != q.device:
        raise ValueError(f"Invalid out: expected {tuple(q.shape)} {dtype}, got {tuple(out.shape)} {out.dtype}")
    return out


def _kernel(attention, reads, out, lse):
    """A stand-in FlashInfer launch: ``attention()`` -> (out, lse) written to ``out`` (and
    ``lse``). A replay whose inputs (``reads``: data and version of each) did not change since
    the launch last ran writes the same result again without computing it (the scripts replay
    each graph several times; the reference attention is most of the dry run's CPU time)."""
    memo = {}

    def kernel():
        key = tuple(None if t is None else (t.data_ptr(), t._version) for t in reads)
        if memo.get("key") != key:
            memo["key"], memo["result"] = key, attention()
        o, ls = memo["result"]
        out.copy_(o)
        if lse is not None:
            lse.copy_(ls)

    return kernel


def make_flashinfer(gpu: FakeGpu, version: str = "0.7.2") -> types.ModuleType:
    """A stand-in ``flashinfer`` module (module docstring) launching on ``gpu``."""

    def poison(what: str):
        gpu.poisoned.append(what)
        raise RuntimeError(f"Unsupported {what}")

    class BatchDecodeWithPagedKVCacheWrapper:
        def __init__(self, float_workspace_buffer, kv_layout="NHD", use_cuda_graph=False,
                     use_tensor_cores=False, paged_kv_indptr_buffer=None, paged_kv_indices_buffer=None,
                     paged_kv_last_page_len_buffer=None, backend="auto", jit_args=None):
            if kv_layout not in ("NHD", "HND"):
                raise KeyError(kv_layout)
            if backend not in ("auto", "fa2"):
                raise NotImplementedError(f"the stand-in runs FA2 only, not backend={backend!r}")
            self.kv_layout, self.use_tensor_cores = kv_layout, use_tensor_cores
            self.use_cuda_graph = use_cuda_graph
            if use_cuda_graph:
                for name, t in (("paged_kv_indptr_buffer", paged_kv_indptr_buffer),
                                ("paged_kv_indices_buffer", paged_kv_indices_buffer),
                                ("paged_kv_last_page_len_buffer", paged_kv_last_page_len_buffer)):
                    if not torch.is_tensor(t):
                        raise ValueError(f"{name} should be a torch.Tensor in cudagraph mode")
                self.fixed_batch_size = len(paged_kv_last_page_len_buffer)
                if len(paged_kv_indptr_buffer) != self.fixed_batch_size + 1:
                    raise ValueError("The size of paged_kv_indptr_buffer should be batch_size + 1")
            self.bufs = (paged_kv_indptr_buffer, paged_kv_indices_buffer, paged_kv_last_page_len_buffer)
            self.planned = None
            self.sinks_ignored = 0

        def plan(self, indptr, indices, last_page_len, num_qo_heads, num_kv_heads, head_dim, page_size,
                 *, pos_encoding_mode="NONE", window_left=-1, window_right=0, logits_soft_cap=None,
                 q_data_type="float16", kv_data_type=None, o_data_type=None, data_type=None,
                 sm_scale=None, rope_scale=None, rope_theta=None, non_blocking=True,
                 block_tables=None, seq_lens=None, fixed_split_size=None, disable_split_kv=False,
                 q_len_per_req=1):
            if gpu.capturing is not None:   # it reads indptr and last_page_len on the host
                raise RuntimeError("CUDA error: operation not permitted when stream is capturing")
            if head_dim in fi_route.NO_DECODE_HEAD_DIMS:
                poison(f"head_dim: {head_dim}")
            group = num_qo_heads // num_kv_heads
            if not self.use_tensor_cores and group not in fi_route.CUDA_CORE_GROUPS:
                raise RuntimeError(f"Unsupported group_size: {group}")
            if pos_encoding_mode != "NONE":
                raise NotImplementedError("the stand-in applies no RoPE")
            q_dt = getattr(torch, q_data_type) if isinstance(q_data_type, str) else q_data_type
            kv_dt = q_dt if kv_data_type is None else (
                getattr(torch, kv_data_type) if isinstance(kv_data_type, str) else kv_data_type)
            batch = len(last_page_len)
            if self.use_cuda_graph:
                if batch != self.fixed_batch_size:
                    raise ValueError(f"The batch size should be fixed in cudagraph mode, the runtime batch "
                                     f"size {batch} mismatches the batch size set during initialization "
                                     f"{self.fixed_batch_size}")
                if len(indices) > len(self.bufs[1]):
                    raise ValueError("The size of indices should be less than or equal to the allocated buffer")
                self.bufs[0].copy_(indptr)
                self.bufs[1][:len(indices)].copy_(indices)
                self.bufs[2].copy_(last_page_len)
                csr = self.bufs
            else:
                csr = (indptr.clone(), indices.clone(), last_page_len.clone())
            self.planned = {"csr": csr, "batch": batch, "hq": num_qo_heads, "hkv": num_kv_heads,
                            "d": head_dim, "page": page_size, "q_dtype": q_dt, "kv_dtype": kv_dt,
                            "window_left": window_left, "cap": float(logits_soft_cap or 0.0),
                            "sm_scale": sm_scale if sm_scale is not None else 1 / math.sqrt(head_dim)}

        def run(self, q, paged_kv_cache, *args, q_scale=None, k_scale=None, v_scale=None, out=None,
                lse=None, return_lse=False, enable_pdl=None, window_left=None, sinks=None, **kwargs):
            p = self.planned
            if p is None:
                raise RuntimeError("plan() must be called before run()")
            k, v = _unpack(paged_kv_cache, self.kv_layout)
            if q.dtype != p["q_dtype"] or k.dtype != p["kv_dtype"]:
                raise ValueError(f"The dtype of q {q.dtype} / k {k.dtype} does not match the q_data_type "
                                 f"{p['q_dtype']} / kv_data_type {p['kv_dtype']} specified in plan function")
            assert window_left is None or window_left == p["window_left"]
            if tuple(q.shape) != (p["batch"], p["hq"], p["d"]) or k.shape[1:] != (p["hkv"], p["page"], p["d"]):
                raise ValueError(f"q {tuple(q.shape)} or the cache {tuple(k.shape)} (HND) is not the "
                                 f"planned batch {p['batch']}, heads {p['hq']}/{p['hkv']}, page {p['page']}, "
                                 f"head dim {p['d']}")
            out = _check_out(out, q, q.dtype)
            if sinks is not None:   # FA2's decode takes sinks= and does not read them
                self.sinks_ignored += 1

            def attention():   # reads the CSR where plan() left it when it runs (a replay: the new plan)
                indptr, indices, last = (t.long() for t in p["csr"])
                pages = (indptr[1:p["batch"] + 1] - indptr[:p["batch"]]).tolist()
                seq = torch.tensor([(n - 1) * p["page"] + int(x) for n, x in zip(pages, last)], dtype=torch.int32)
                bt = torch.zeros(p["batch"], max(pages), dtype=torch.int32)
                for r, n in enumerate(pages):
                    bt[r, :n] = indices[int(indptr[r]):int(indptr[r]) + n]
                o, ls = reference.decode_attention(q, k, v, seq, bt, sm_scale=p["sm_scale"],
                                                   window_left=p["window_left"], logits_soft_cap=p["cap"],
                                                   return_lse=True)
                return o.to(out.dtype), ls

            lse_out = None
            if return_lse:
                lse_out = lse if lse is not None else torch.empty(q.shape[:2], dtype=torch.float32)
            gpu.launch(_kernel(attention, (q, k, v, *p["csr"]), out, lse_out))
            return (out, lse_out) if return_lse else out

    def trtllm_batch_decode_with_kv_cache(query, kv_cache, workspace_buffer, block_tables, seq_lens,
                                          max_seq_len, bmm1_scale=1.0, bmm2_scale=1.0, window_left=-1,
                                          out=None, out_dtype=None, o_sf_scale=None, o_sf_vec_size=None,
                                          sinks=None, kv_layout="HND", enable_pdl=None, backend="auto",
                                          q_len_per_req=1, o_scale=1.0, **kwargs):
        if backend not in ("auto", "xqa"):
            raise NotImplementedError(f"the stand-in runs XQA only, not backend={backend!r}")
        k, v = _unpack(kv_cache, kv_layout)
        if query.shape[-1] in fi_route.NO_DECODE_HEAD_DIMS:
            poison(f"head_dim: {query.shape[-1]}")
        if k.shape[2] not in XQA_PAGE_SIZES:
            raise RuntimeError(f"XQA: no kernel for page size {k.shape[2]}")
        b, hq, _ = query.shape
        if block_tables.dtype != torch.int32 or block_tables.dim() != 2 or block_tables.shape[0] != b \
                or not block_tables.is_contiguous():
            raise ValueError(f"block_tables: expected int32 [{b}, W] contiguous, got "
                             f"{block_tables.dtype} {tuple(block_tables.shape)}")
        if seq_lens.dtype != torch.int32 or tuple(seq_lens.shape) != (b,):
            raise ValueError(f"seq_lens: expected int32 [{b}], got {seq_lens.dtype} {tuple(seq_lens.shape)}")
        if sinks is not None and (sinks.dtype != torch.float32 or tuple(sinks.shape) != (hq,)):
            raise ValueError(f"sinks: expected float32 [{hq}], got {sinks.dtype} {tuple(sinks.shape)}")
        out = _check_out(out, query, query.dtype if out_dtype is None else out_dtype)

        def attention():
            o = reference.decode_attention(query, k, v, seq_lens, block_tables, sm_scale=float(bmm1_scale),
                                           window_left=window_left, sinks=sinks)
            return (o * float(bmm2_scale)).to(out.dtype), None

        gpu.launch(_kernel(attention, (query, k, v, block_tables, seq_lens, sinks), out, None))
        return out

    fi = types.ModuleType("flashinfer")
    fi.__version__ = version
    fi.BatchDecodeWithPagedKVCacheWrapper = BatchDecodeWithPagedKVCacheWrapper
    fi.decode = types.SimpleNamespace(trtllm_batch_decode_with_kv_cache=trtllm_batch_decode_with_kv_cache)
    return fi


@pytest.fixture
def fake_gpu(monkeypatch):
    """The fake GPU (:func:`install`) and the stand-in FlashInfer as ``import flashinfer``."""
    gpu = install(monkeypatch)
    monkeypatch.setitem(sys.modules, "flashinfer", make_flashinfer(gpu))
    threads = torch.get_num_threads()
    torch.set_num_threads(1)   # many tiny ops: one thread is ~20x faster on a busy 2-core box (conftest.py)
    yield gpu
    torch.set_num_threads(threads)


def load_bench(name: str) -> types.ModuleType:
    """``benches/<name>.py`` imported as a module of its own (``<name>_bench``): the dry runs
    patch its constants (DEVICE, LAYERS, ...) and call its ``main()``."""
    import importlib.util
    import pathlib

    path = pathlib.Path(__file__).resolve().parents[1] / "benches" / f"{name}.py"
    spec = importlib.util.spec_from_file_location(f"{name}_bench", path)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def shrunk(cases, shrink: int):
    """The model-shape step cases with every length divided by ``shrink`` (at least 1 token)."""
    import numpy as np

    from pkvrt.measure import model_shapes as shapes

    return [shapes.StepCase(c.name, np.maximum(1, c.seq_lens // shrink).astype(np.int32)) for c in cases]
