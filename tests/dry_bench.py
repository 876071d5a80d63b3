"""A CPU stand-in for the GPU that the GPU benches run on, so that their own code runs end to end
without one (tests/test_model_shapes_dry_cpu.py, tests/test_dropin_dry_cpu.py,
tests/test_shared_pages_dry_cpu.py, tests/test_serving_sharing_dry_cpu.py): a bench's Python
mistakes (a wrong keyword, shape, dtype, key or loop, a results file that cannot be written, a
table that fails on a missing baseline) then cost no GPU minutes.

What stands in for what:

- the device: tests/test_runtime_cpu.py's fake device (CPU tensors, the Runtime's kernels
  emulated in FP32 by ``Emu``), each launch through the real launch wrapper's argument checks
  first (tests/test_gpu_tests_dry_cpu.py's ``checked``), the H200's name, calibration, residency
  and free memory; ``torch.cuda._sleep`` (the harness's spin) is one launch that does nothing.
  Code that allocates on "cuda" by name (or pinned host memory) runs on the host inside
  :func:`on_the_host`.
- CUDA graphs: a capture records the kernel launches made in it (the Runtime's, the stand-in
  FlashInfer's below, those of a graph replayed in it, as CUDA captures a graph launch) and the
  torch operations (run at once as well, their results needed by the Python after them) instead
  of running them, and a replay runs what it recorded with the arguments it was given, so a
  replay reads whatever the plan left in the buffers it captured, as on the GPU. The Runtime
  knows when it is being captured (its planning kernel goes into each capture of an engine's
  step, as on the GPU). Other host code inside a capture runs once, at capture; a
  ``torch.cuda.synchronize()``, a FlashInfer ``plan()`` or a read of a tensor's values on the
  host (:data:`HOST_READS`) inside one raises, as on the GPU. Replaying a graph that captured
  nothing fails the test.
- CUDA events: ``elapsed_time`` counts the launches run between the two records, 10 us each.
  Deterministic and never zero for a real replay; the times and ratios mean nothing else.
- FlashInfer: :func:`make_flashinfer`, a module whose decode wrapper (FA2, tensor and CUDA
  cores, CUDA-graph mode with the caller's fixed buffers, NHD and HND), XQA entry
  (``flashinfer.decode.trtllm_batch_decode_with_kv_cache``) and cascade wrapper
  (``MultiLevelCascadeAttentionWrapper``, whose ``plan()`` fails to build as the slimmed wheel's
  did on the H200 unless told it builds) take FlashInfer's arguments, refuse what FlashInfer
  refuses (a batch other than the buffers', a dtype or window other than the plan's, a
  CUDA-core group size it has no kernel for, a page size XQA has none for) and compute with
  :mod:`pkvrt.reference`. As the real FA2 decode does, it accepts ``sinks=`` and ignores them,
  so a bench that trusts FA2 with sinks gets a wrong answer here too. A call at head dim 96,
  which crashed the CUDA context on the H200, is recorded in :attr:`FakeGpu.poisoned`. It has
  no cuDNN backend (refused: the harness records that path unavailable).

Not seen here: the kernels' numerics (everything is FP32 on the CPU), the rest of real graph
capture (a launch on another stream that escapes it, an allocation inside it, a host read the
list above misses, host code whose effect a replay would need), device placement (a tensor left
on the host), memory use, FlashInfer's JIT compiles and the timings themselves.
"""

from __future__ import annotations

import collections
import contextlib
import functools
import inspect
import math
import sys
import types

import pytest
import torch
from test_gpu_tests_dry_cpu import REAL, checked, cpu_tensors_pass_as_cuda
from test_runtime_cpu import Emu, install_fake_device
from torch.overrides import TorchFunctionMode

from pkvrt import reference
from pkvrt.launch import _driver
from pkvrt.runtime import core, fi_route, graphs

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
        self.captures = 0        # capture sequences begun (the current one's id, while capturing)
        self.launched = 0        # launches run so far (what the events count)
        self.poisoned: list[str] = []   # calls that would have crashed the H200's CUDA context
        self.memo: collections.OrderedDict = collections.OrderedDict()   # _kernel's results

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
        self.captures += 1
        saved = {name: torch.Tensor.__dict__.get(name) for name in HOST_READS}
        for name in HOST_READS:
            setattr(torch.Tensor, name, _refused(name))
        try:
            with _RecordTorchOps(self):
                yield
        finally:
            self.capturing = None
            for name, fn in saved.items():
                if fn is None:
                    delattr(torch.Tensor, name)
                else:
                    setattr(torch.Tensor, name, fn)


class CudaIsTheHost(TorchFunctionMode):
    """``device="cuda"`` means the CPU, and ``pin_memory=True`` is dropped (a CPU-only torch has
    no pinned allocator): for code that allocates on "cuda" by name, run inside this mode
    (:func:`on_the_host`)."""

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = dict(kwargs or {})
        if str(kwargs.get("device", "")).startswith("cuda"):
            kwargs["device"] = "cpu"
        kwargs.pop("pin_memory", None)
        return func(*args, **kwargs)


def on_the_host(fn):
    """``fn`` run inside :class:`CudaIsTheHost`."""
    @functools.wraps(fn)
    def run(*a, **k):
        with CudaIsTheHost():
            return fn(*a, **k)
    return run


def _tensors(x) -> list:
    return [t for t in (x if isinstance(x, (tuple, list)) else (x,)) if isinstance(t, torch.Tensor)]


class _RecordTorchOps(TorchFunctionMode):
    """torch operations inside a capture: run now (the Python after them needs their results)
    and recorded as launches of the graph, so that a replay runs them again where the captured
    kernels' outputs feed them (SharedPagesRuntime's query gather reads the index find_shared
    writes): a replayed operation writes into the tensor it returned at capture (a CUDA graph
    reuses its addresses). A view, or an operation with no tensor result, writes nothing and is
    not recorded (an in-place one returns its input, and ``__setitem__`` None: both are)."""

    def __init__(self, gpu: FakeGpu):
        super().__init__()
        self.gpu = gpu

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        result = func(*args, **kwargs)
        given = {id(t) for t in _tensors(list(args) + list(kwargs.values()))}
        made = _tensors(result)
        if func is torch.Tensor.__setitem__ or any(id(t) in given or not t._is_view() for t in made):
            self.gpu.launch(lambda: _rerun(func, args, kwargs, made))
        return result


def _rerun(func, args, kwargs, made) -> None:
    again = _tensors(func(*args, **kwargs))
    for old, new in zip(made, again):
        if new is not old and new.data_ptr() != old.data_ptr():
            old.copy_(new)


class RecordedGraph:
    """torch.cuda.CUDAGraph: the launches captured into it, run again by each replay."""

    gpu: FakeGpu   # set by install()

    def __init__(self, keep_graph: bool = False):
        self.launches = []

    def replay(self) -> None:
        """Run the recorded launches; inside another capture, record them into that graph (CUDA
        captures a graph launch as a child graph node: the Runtime's own planning graph replayed
        inside an engine's captured step)."""
        assert self.launches, "replayed a CUDA graph that captured no launch"
        for kernel in self.launches:
            self.gpu.launch(kernel)

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
        if kw.pop("prepare", False):   # ops.PreparedLaunch: checked now, a launch at each call
            return lambda: gpu.launch(lambda: run(*args, **kw))
        gpu.launch(lambda: run(*args, **kw))
        return None

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
    # the Runtime sees the fake device's captures (its own check asks for a CUDA device): a
    # planning kernel left to the step's first run() goes into each capture of an engine's step
    monkeypatch.setattr(core.Runtime, "_capturing", lambda self: gpu.capturing is not None)
    monkeypatch.setattr(_driver, "capture_id", lambda: gpu.captures if gpu.capturing is not None else 0)
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
            ("CUDAGraph", RecordedGraph), ("mem_get_info", lambda *a, **k: (140 * 2**30, 141 * 2**30)),
            ("_sleep", lambda cycles: gpu.launch(lambda: None)),   # a spin: one launch, no work
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


MEMO_ENTRIES = 256   # stand-in FlashInfer results kept (FakeGpu.memo)


def _kernel(gpu: FakeGpu, attention, reads, out, lse, same=lambda: ()):
    """A stand-in FlashInfer launch: ``attention()`` -> (out, lse) written to ``out`` (and
    ``lse``). A launch whose inputs were seen before writes the same result again without
    computing it (the scripts replay each graph several times and run each step in several
    passes; the reference attention is most of the dry run's CPU time): ``reads`` (the tensors
    it reads, by address, version, shape, strides and dtype) and ``same()`` (what else decides
    the result, as values: a CSR planned into fresh tensors every step, the plan's scalars),
    both taken when the launch runs. ``gpu.memo`` keeps the last results with the tensors they
    read, so that no other tensor takes their addresses while they are kept."""

    def kernel():
        key = (tuple(None if t is None else (t.data_ptr(), t._version, tuple(t.shape), t.stride(), t.dtype)
                     for t in reads), same())
        hit = gpu.memo.get(key)
        if hit is None:
            hit = gpu.memo[key] = (attention(), reads)
            if len(gpu.memo) > MEMO_ENTRIES:
                gpu.memo.popitem(last=False)
        gpu.memo.move_to_end(key)
        (o, ls), _ = hit
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
            def same():   # the CSR's values where plan() left them, and the plan's scalars
                return (*(tuple(t.tolist()) for t in p["csr"]),
                        *(p[x] for x in ("batch", "page", "sm_scale", "window_left", "cap")))

            gpu.launch(_kernel(gpu, attention, (q, k, v), out, lse_out, same))
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

        gpu.launch(_kernel(gpu, attention, (query, k, v, block_tables, seq_lens, sinks), out, None,
                           lambda: (float(bmm1_scale), float(bmm2_scale), window_left)))
        return out

    fi = types.ModuleType("flashinfer")
    fi.__version__ = version
    fi.BatchDecodeWithPagedKVCacheWrapper = BatchDecodeWithPagedKVCacheWrapper
    fi.MultiLevelCascadeAttentionWrapper = _cascade_wrapper(gpu)
    fi.decode = types.SimpleNamespace(trtllm_batch_decode_with_kv_cache=trtllm_batch_decode_with_kv_cache)
    return fi


CASCADE_BUILD_ERROR = ("Ninja build failed. Ninja output:\n[1/3] c++ ... batch_prefill.cu\n"
                       "fatal error: cutlass/cutlass.h: No such file or directory")


def _cascade_wrapper(gpu: FakeGpu):
    """FlashInfer's ``MultiLevelCascadeAttentionWrapper`` (one prefill wrapper per level, their
    states merged by lse). As the slimmed wheel the GPU runs (benches/slim_fi_wheel.py drops
    CUTLASS, which its Hopper prefill JIT build needs), ``plan()`` raises the JIT build's error,
    every time it is called (:attr:`plans` counts the calls); with ``builds = True`` it plans
    and computes each level with :mod:`pkvrt.reference` (level l: query rows ``qo_indptr[l][j]
    .. qo_indptr[l][j + 1]`` attend the pages of request j of that level), merged exactly."""

    class MultiLevelCascadeAttentionWrapper:
        builds = False
        plans = 0

        def __init__(self, num_levels, float_workspace_buffer, kv_layout="NHD", use_cuda_graph=False,
                     qo_indptr_buf_arr=None, paged_kv_indptr_buf_arr=None, paged_kv_indices_buf_arr=None,
                     paged_kv_last_page_len_buf_arr=None):
            if kv_layout not in ("NHD", "HND"):
                raise KeyError(kv_layout)
            if use_cuda_graph:
                raise NotImplementedError("the stand-in cascade has no CUDA-graph mode")
            self.num_levels, self.kv_layout, self.levels = num_levels, kv_layout, None

        def plan(self, qo_indptr_arr, paged_kv_indptr_arr, paged_kv_indices_arr, paged_kv_last_page_len,
                 num_qo_heads, num_kv_heads, head_dim, page_size, causal=False, pos_encoding_mode="NONE",
                 use_fp16_qk_reduction=False, sm_scale=None, window_left=-1, logits_soft_cap=None,
                 rope_scale=None, rope_theta=None, q_data_type="float16", kv_data_type=None):
            type(self).plans += 1
            if gpu.capturing is not None:
                raise RuntimeError("CUDA error: operation not permitted when stream is capturing")
            if not self.builds:
                raise RuntimeError(CASCADE_BUILD_ERROR)
            arrays = (qo_indptr_arr, paged_kv_indptr_arr, paged_kv_indices_arr, paged_kv_last_page_len)
            if any(len(a) != self.num_levels for a in arrays):
                raise ValueError(f"zip() arguments: expected {self.num_levels} levels of each array")
            if pos_encoding_mode != "NONE" or causal:
                raise NotImplementedError("the stand-in cascade applies no RoPE and no causal mask")
            self.levels = []
            for qo, kv, idx, last in zip(*arrays):
                qo, kv, idx, last = (t.long().clone() for t in (qo, kv, idx, last))
                if len(kv) != len(qo) or len(last) != len(qo) - 1 or int(kv[-1]) != len(idx) \
                        or int(qo[-1]) != int(qo_indptr_arr[-1][-1]):
                    raise ValueError(f"a level's CSR does not hold together: qo_indptr {qo.tolist()}, "
                                     f"kv_indptr {kv.tolist()}, {len(idx)} indices, last {last.tolist()}")
                if ((last < 1) | (last > page_size)).any():
                    raise ValueError(f"paged_kv_last_page_len: expected 1..{page_size}, got {last.tolist()}")
                self.levels.append((qo, kv, idx, last))
            self.key = (sm_scale, *(tuple(t.tolist()) for level in self.levels for t in level))
            q_dt = getattr(torch, q_data_type) if isinstance(q_data_type, str) else q_data_type
            self.planned = {"batch": int(qo_indptr_arr[-1][-1]), "hq": num_qo_heads, "hkv": num_kv_heads,
                            "d": head_dim, "page": page_size, "q_dtype": q_dt,
                            "kv_dtype": q_dt if kv_data_type is None else kv_data_type,
                            "sm_scale": sm_scale if sm_scale is not None else 1 / math.sqrt(head_dim)}

        def run(self, q, paged_kv_cache):
            if self.levels is None:
                raise RuntimeError("plan() must be called before run()")
            p = self.planned
            k, v = _unpack(paged_kv_cache, self.kv_layout)
            if q.dtype != p["q_dtype"] or k.dtype != p["kv_dtype"]:
                raise ValueError(f"q {q.dtype} / kv {k.dtype}: planned {p['q_dtype']} / {p['kv_dtype']}")
            if tuple(q.shape) != (p["batch"], p["hq"], p["d"]) \
                    or k.shape[1:] != (p["hkv"], p["page"], p["d"]):
                raise ValueError(f"q {tuple(q.shape)} or the cache {tuple(k.shape)} is not the planned shape")
            out = torch.empty_like(q)

            def attention():
                states = []   # per level: out [B, H_q, D] float32, lse [B, H_q] (base 2)
                for qo, kv, idx, last in self.levels:
                    req = torch.searchsorted(qo, torch.arange(q.shape[0]), right=True) - 1   # each row's request
                    pages = (kv[1:] - kv[:-1])[req]
                    seq = torch.where(pages > 0, (pages - 1) * p["page"] + last[req], 0).int()
                    bt = torch.zeros(q.shape[0], max(1, int(pages.max())), dtype=torch.int32)
                    for i, j in enumerate(req.tolist()):
                        bt[i, :int(pages[i])] = idx[int(kv[j]):int(kv[j + 1])]
                    states.append(reference.decode_attention(q, k, v, seq, bt, sm_scale=p["sm_scale"],
                                                             return_lse=True))
                m = torch.stack([lse for _, lse in states]).amax(0)
                w = [torch.exp2(lse - m)[..., None] for _, lse in states]             # [B, H_q, 1]
                o = sum(wi * oi for wi, (oi, _) in zip(w, states)) / sum(w)
                return o.to(out.dtype), None

            gpu.launch(_kernel(gpu, attention, (q, k, v), out, None, lambda: self.key))
            return out

    return MultiLevelCascadeAttentionWrapper


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
