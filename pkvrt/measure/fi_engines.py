"""FlashInfer's decode paths as engines of ``pkvrt bench serving``: the candidates of its baseline.

Every path reads the same HND pages every engine reads (k, v: ``[num_pages, H_kv, page_size,
D]``), q and out ``[B, H_q, D]``, softmax scale ``1/sqrt(D)`` and no other scaling:

==================  =====================================================================
label               FlashInfer call
==================  =====================================================================
flashinfer-cuda     ``BatchDecodeWithPagedKVCacheWrapper(ws, "HND", backend="fa2")``: the
                    CUDA-core decode kernel
flashinfer-tc       the same with ``use_tensor_cores=True``: FA2's tensor-core kernel
flashinfer-cudnn    the same with ``backend="cudnn"``: cuDNN's paged SDPA decode graph
                    (FlashInfer 0.6 and later; fp16 needs the cuDNN frontend, ``cudnn``)
flashinfer-xqa      ``flashinfer.decode.trtllm_batch_decode_with_kv_cache(...,
                    backend="xqa")``: the XQA kernel vLLM sends Hopper decode to (SM 9.x,
                    10.x, 12.x; page size 16, 32, 64 or 128; in 0.5.3 as well)
==================  =====================================================================

The three wrapper paths are planned every step as an engine plans them: the step's block-table
rows as CSR (``to_csr``) in pinned host buffers, ``plan()`` on the host, ``run()`` per layer
(the cuDNN wrapper's ``plan()`` turns the CSR into its own dense device block table, its width
rounded up to 1024 tokens so that one built cuDNN graph serves many steps).
``backend`` is explicit, so a label names one kernel in every FlashInfer version (0.7's
``"auto"`` could pick another one). XQA has no host plan: it reads a dense device block table
and int32 lengths (``to_padded``), staged the first time a step is seen and reused after, as the
device-planned engines' inputs are (an engine whose scheduler keeps block tables on the GPU).

A path this FlashInfer lacks raises RuntimeError at construction; one that refuses the shape or
fails to build (a page size XQA has no kernel for, a missing cuDNN) raises at its first call.
The harness records either as the path being unavailable, with the reason.

FP8 K/V (a workload whose ``kv_dtype`` is float8_e4m3fn, ``pkvrt bench serving --kv-dtype
fp8``): the wrappers are planned with ``kv_data_type=torch.float8_e4m3fn`` and run with
``k_scale``/``v_scale``, XQA with ``bmm1_scale = k_scale / sqrt(D)`` and ``bmm2_scale =
v_scale``, all host floats taken once from the workload (``scale_floats``): FlashInfer reads
its scales on the host, and they are fixed for the run. cuDNN has no FP8-KV decode with fp16 q
(FlashInfer 0.7.2 raises NotImplementedError at ``plan()``): the harness records it unavailable
with FlashInfer's reason.
"""

from __future__ import annotations

import math

import torch

from pkvrt.measure.traces import Step
from pkvrt.policy import planner
from pkvrt.policy.blocktables import to_csr, to_padded

WORKSPACE_BYTES = 256 * 2**20   # per engine; XQA keeps its semaphores in the first 8 MiB
ROUTE = "flashinfer"            # the route name every FlashInfer path reports per step
WRAPPERS = {                    # label -> BatchDecodeWithPagedKVCacheWrapper keyword arguments
    "flashinfer-cuda": dict(backend="fa2", use_tensor_cores=False),
    "flashinfer-tc": dict(backend="fa2", use_tensor_cores=True),
    "flashinfer-cudnn": dict(backend="cudnn"),
}
XQA = "flashinfer-xqa"
FI_VARIANTS = (*WRAPPERS, XQA)  # every FlashInfer decode path the baseline probe runs


def make_engine(label: str, wl, *, max_active: int):
    """The engine of FlashInfer path ``label`` (one of :data:`FI_VARIANTS`) on workload ``wl``
    (a ``harness.Workload``); ``max_active`` sizes the wrappers' pinned CSR buffers."""
    if label == XQA:
        return XqaEngine(wl)
    if label not in WRAPPERS:
        raise ValueError(f"unknown FlashInfer path {label!r}; expected one of {', '.join(FI_VARIANTS)}")
    return FlashInferEngine(wl, label=label, max_active=max_active)


def kv_format(wl) -> tuple[torch.dtype, dict]:
    """The K/V dtype of workload ``wl`` and the host-float scale arguments FlashInfer takes for
    it: ``(torch.float8_e4m3fn, {"k_scale": ks, "v_scale": vs})`` for an FP8 cache
    (``wl.scale_floats``), ``(q's dtype, {})`` otherwise (also for a ``wl`` without
    ``kv_dtype``, a stand-in of the tests)."""
    kv = getattr(wl, "kv_dtype", wl.shape.torch_dtype)
    if kv != torch.float8_e4m3fn:
        return kv, {}
    ks, vs = wl.scale_floats
    return kv, dict(k_scale=float(ks), v_scale=float(vs))


def _version(flashinfer) -> str:
    return str(getattr(flashinfer, "__version__", "?"))


def make_wrapper(flashinfer, label: str, workspace: torch.Tensor):
    """``BatchDecodeWithPagedKVCacheWrapper(workspace, "HND", **WRAPPERS[label])``. Raises
    RuntimeError when this FlashInfer's wrapper does not run that backend: 0.5.3 takes
    ``backend="cudnn"`` without complaint and runs its CUDA-core kernel under that name, so the
    wrapper's ``resolved_backend`` (0.6 and later) must name the backend asked for."""
    kwargs = WRAPPERS[label]
    wrapper = flashinfer.BatchDecodeWithPagedKVCacheWrapper(workspace, "HND", **kwargs)
    if kwargs["backend"] != "fa2":
        resolved = getattr(wrapper, "resolved_backend", None)
        if resolved != kwargs["backend"]:
            raise RuntimeError(
                f"flashinfer {_version(flashinfer)}: BatchDecodeWithPagedKVCacheWrapper does not run "
                f"backend={kwargs['backend']!r} (resolved_backend: {resolved!r}; FlashInfer 0.6 and "
                "later have it)")
    return wrapper


def xqa_entry(flashinfer):
    """``flashinfer.decode.trtllm_batch_decode_with_kv_cache`` (0.5.3 and 0.7 alike), or
    RuntimeError naming this FlashInfer's version."""
    entry = getattr(getattr(flashinfer, "decode", None), "trtllm_batch_decode_with_kv_cache", None)
    if entry is None:
        raise RuntimeError(f"flashinfer {_version(flashinfer)} has no "
                           "flashinfer.decode.trtllm_batch_decode_with_kv_cache (XQA)")
    return entry


def run_xqa(entry, q, k_cache, v_cache, workspace, table, seq_lens, max_len: int, out, *,
            k_scale: float = 1.0, v_scale: float = 1.0) -> None:
    """One XQA decode call (capturable: no host sync, no allocation but views).

    q, out : [B, H_q, D], contiguous. k_cache, v_cache : [num_pages, H_kv, page_size, D] (HND),
    q's dtype or float8_e4m3fn. workspace : uint8 device buffer, zeroed before its first use
    (XQA's multi-block semaphores live in its first 8 MiB and reset themselves after every
    launch). table : int32 [B, cols] C-contiguous (:func:`pkvrt.policy.blocktables.to_padded`; XQA's
    max_seq_len is ``cols * page_size``). seq_lens : int32 [B]. max_len : the longest row
    (``max_seq_len``; XQA reads the width instead).

    Scales: ``bmm1_scale`` is the whole scale of q.k, ``k_scale / sqrt(D)``; ``bmm2_scale`` that
    of p.v, ``v_scale``. k_scale, v_scale: a float8_e4m3fn cache's per-tensor dequantization
    scales (host floats), 1 otherwise.
    """
    entry(query=q, kv_cache=(k_cache, v_cache), workspace_buffer=workspace, block_tables=table,
          seq_lens=seq_lens, max_seq_len=max_len, bmm1_scale=k_scale / math.sqrt(q.shape[-1]),
          bmm2_scale=v_scale, out=out, kv_layout="HND", backend="xqa")


class _Counters:
    """``step_info`` and ``stats`` shared by the FlashInfer engines: one launch, FlashInfer's
    own grid (not known here), the step's useful KV bytes."""

    def step_info(self):
        """(route, splits, counters) of the last planned step."""
        sh = self.shape
        c = planner.flashinfer_counters(self._last_info, num_kv_heads=sh.num_kv_heads,
                                        head_dim=sh.head_dim, dtype_bytes=self.kv_dtype.itemsize)
        return ROUTE, (), c

    def stats(self) -> dict:
        return {}


class FlashInferEngine(_Counters):
    """FlashInfer's paged decode wrapper, planned every step on the host path an engine uses:
    the block table rows -> CSR (``to_csr``) written into pinned host buffers, passed to
    ``plan()`` (host-side indptr / last_page_len; indices copied asynchronously from pinned
    memory), then ``run()`` per layer. No CUDA graph: FlashInfer's graph mode is the Runtime's
    ``flashinfer`` route (engine ``flashinfer-graph``).

    label : a key of :data:`WRAPPERS` (which kernel; RuntimeError when this FlashInfer's wrapper
    does not run it, :func:`make_wrapper`). FP8 caches: planned with ``kv_data_type`` FP8, run
    with the workload's host-float scales (:func:`kv_format`).
    """

    def __init__(self, wl, *, label: str, max_active: int):
        import flashinfer

        sh = wl.shape
        self.label = label
        self.layout, self.shape = wl.layout, sh
        self.kv_dtype, self.scales = kv_format(wl)
        ws = torch.zeros(WORKSPACE_BYTES, dtype=torch.uint8, device=wl.device)
        self.wrapper = make_wrapper(flashinfer, label, ws)
        cap = max_active * wl.layout.max_pages
        pin = dict(dtype=torch.int32, pin_memory=True)
        self.indptr = torch.zeros(max_active + 1, **pin)
        self.indices = torch.zeros(cap, **pin)
        self.last = torch.zeros(max_active, **pin)
        self._np = (self.indptr.numpy(), self.indices.numpy(), self.last.numpy())  # views
        self._last_info = None
        self._planned = None   # event after the last plan()'s copies (see plan)

    def plan(self, step: Step) -> None:
        sh = self.shape
        indptr, indices, last = to_csr(step.seq_lens, self.layout.block_table(step.rids), sh.page_size)
        b, nnz = len(last), len(indices)
        # The pinned buffers here and FlashInfer's own pinned schedule buffer are copied to the
        # device asynchronously by plan(): wait until the previous step's copies have run before
        # rewriting them (the untimed pass does not synchronize between steps; without this wait
        # a step ran another step's CSR: illegal memory accesses and hangs, H200 2026-11-29).
        if self._planned is not None:
            self._planned.synchronize()
        else:
            self._planned = torch.cuda.Event()
        np_indptr, np_indices, np_last = self._np
        np_indptr[:b + 1] = indptr
        np_indices[:nnz] = indices
        np_last[:b] = last
        self.wrapper.plan(self.indptr[:b + 1], self.indices[:nnz], self.last[:b],
                          sh.num_qo_heads, sh.num_kv_heads, sh.head_dim, sh.page_size,
                          q_data_type=sh.torch_dtype, kv_data_type=self.kv_dtype)
        self._planned.record()
        self._last_info = step.seq_lens

    def attend(self, q, k_cache, v_cache, out, k_scale=None, v_scale=None) -> None:
        # q, out: [B, H_q, D]; k_cache, v_cache: [num_pages, H_kv, page_size, D]. FP8: the
        # layer's scale tensors are not read (a host read per call); FlashInfer takes the same
        # values as the host floats of self.scales, fixed for the run.
        self.wrapper.run(q, (k_cache, v_cache), out=out, **self.scales)


class XqaEngine(_Counters):
    """FlashInfer's XQA decode (:func:`run_xqa`) per layer over a dense int32 device block table
    ``[B, cols]`` (the step's rows cut to the columns the step uses,
    :func:`pkvrt.policy.blocktables.to_padded`) and int32 lengths ``[B]``, staged once per step (the
    untimed pass) and reused by the timed passes. No host plan. Raises RuntimeError when this
    FlashInfer has no XQA entry point (:func:`xqa_entry`). FP8 caches: the workload's host-float
    scales in ``bmm1_scale``/``bmm2_scale`` (:func:`run_xqa`, :func:`kv_format`)."""

    def __init__(self, wl):
        import flashinfer

        self._entry = xqa_entry(flashinfer)
        sh = wl.shape
        self.label = XQA
        self.layout, self.shape, self.device = wl.layout, sh, wl.device
        self.kv_dtype, self.scales = kv_format(wl)
        self.workspace = torch.zeros(WORKSPACE_BYTES, dtype=torch.uint8, device=wl.device)
        self._on_device: dict[int, tuple] = {}
        self._current = None
        self._last_info = None

    def plan(self, step: Step) -> None:
        hit = self._on_device.get(id(step))
        if hit is None:
            table, seq = to_padded(step.seq_lens, self.layout.block_table(step.rids),
                                   self.shape.page_size)
            hit = self._on_device[id(step)] = (
                torch.as_tensor(table, device=self.device),   # int32 [B, cols]
                torch.as_tensor(seq, device=self.device),     # int32 [B]
                int(seq.max()), step)                         # step kept alive: its id stays unique
        self._current = hit
        self._last_info = step.seq_lens

    def attend(self, q, k_cache, v_cache, out, k_scale=None, v_scale=None) -> None:
        # q, out: [B, H_q, D]; k_cache, v_cache: [num_pages, H_kv, page_size, D]. FP8: the
        # layer's scale tensors are not read; XQA takes self.scales' host floats (fixed for the run).
        table, seq, max_len, _ = self._current
        run_xqa(self._entry, q, k_cache, v_cache, self.workspace, table, seq, max_len, out,
                **self.scales)
