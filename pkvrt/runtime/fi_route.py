"""The FlashInfer route: FlashInfer's paged decode kernel behind the Runtime's plan/run.

FlashInfer is optional (``pip install pkvrt[flashinfer]``). :func:`load_flashinfer` imports it
and says why it cannot be used; the Runtime then reports the route unavailable and never takes
it. When it can, :class:`FlashInferRoute` drives ``flashinfer.BatchDecodeWithPagedKVCacheWrapper``
with its FA2 decode kernels named (``backend="fa2"``, :data:`BACKEND`) over the same HND pages
the PersistentKV kernels read (the CSR of ``pkvrt.policy.blocktables.to_csr``, which the Runtime
writes straight into its pinned staging with ``blocktables.write_csr``):

* CUDA-graph mode (``RuntimeOptions(flashinfer_cuda_graph=True)``): FlashInfer's own graph mode
  (``use_cuda_graph=True`` with fixed ``paged_kv_*_buffer`` tensors). Such a wrapper is built for
  one batch size, so there is one wrapper per batch size, in an LRU of ``max_wrappers``
  (8 MiB device + 8 MiB pinned int workspace each, FlashInfer's own). ``plan`` runs on the host
  every step with pinned CPU ``indptr`` / ``last_page_len`` (FlashInfer's fastest documented host
  path: its scheduler reads them on the host, and the copies into its buffers are asynchronous)
  and ``indices`` already on the device; the Runtime captures ``run`` into its own graph like
  any other route. In graph mode FlashInfer fixes its grid per batch size (``split_kv`` and the
  padded batch depend only on B), which is what makes replaying a graph after a re-plan valid.
* eager mode (``use_cuda_graph=False``, the default): one plain wrapper, planned every step.
  Its ``run()`` is Python that rebuilds the same argument list for FlashInfer's compiled kernel
  entry at every layer (H200 machine's host, 2026-12-02: 28.7 us per layer, of which the call
  into the compiled entry is 12.4). With ``direct_run`` (the default) the second ``run()`` after
  a ``plan()`` goes through ``wrapper.run`` with the wrapper's compiled module behind a
  :class:`_Recorder`, which keeps the one call FlashInfer makes; the step's later layers call
  that entry directly with the same arguments, only q, the two caches and out swapped in
  (:class:`DirectCall`). The first layer is a plain ``wrapper.run``: a one-layer step (one
  attention call per plan) pays nothing for a recording it could not reuse. Nothing of
  FlashInfer is re-implemented: its own run() builds the arguments, its kernel runs them. It
  falls back to ``wrapper.run`` for the rest of the step whenever the recording is not one
  positional call in which each of the four tensors appears exactly once and nothing else
  refers to them (a FlashInfer version that calls its module twice, or by keyword, or passes a
  view, a tuple or any other tensor on the same memory as one of them; q that is out; k_cache
  that is v_cache), and it is used with the FlashInfer versions its GPU test has checked bit for
  bit against ``wrapper.run`` (:data:`DIRECT_RUN_VERSIONS`; what ``run()`` might do to ``out``
  after its module call is not visible to the recording). The arguments ``run()`` derives from
  its tensors besides the tensors themselves (dtypes, head_dim, page_size, q rows per request)
  are the same at every layer of a step, which the Runtime's run() checks before it gets here
  (``checks.check_run_args``).

The ``indices`` every wrapper shares is one device buffer owned by the Runtime, passed both as
``paged_kv_indices_buffer`` and (a prefix view of it) as the ``indices`` argument of ``plan``:
FlashInfer's ``buf[:n].copy_(indices)`` is then a copy of a view onto itself, which
``torch.Tensor.copy_`` skips (same storage, offset, sizes and strides), so the indices cross
PCIe once, in the Runtime's own staging copy. (A CPU ``indices`` tensor would make that copy
blocking: FlashInfer passes ``non_blocking`` only for same-device indices.)
"""

from __future__ import annotations

from collections import OrderedDict

WORKSPACE_BYTES = 128 * 2**20  # FlashInfer's documented example size; shared by every wrapper
# FlashInfer's FA2 decode kernels (tensor-core or CUDA-core), named, so that the route runs one
# kernel in every FlashInfer version: the default "auto" picks them too for 16-bit caches in
# 0.5.3, 0.6.4+ and 0.7, but 0.7's auto re-decides between them and cuDNN at every plan() (H200
# machine's host, 2026-12-02: 467 vs 237 us per plan, for the same kernel), and 0.6.0-0.6.3's
# picked FA3 on SM90 with tensor cores (upstream went back to FA2 for decode in 0.6.4)
BACKEND = "fa2"
# FlashInfer versions whose run() the direct calls were checked against (tests/gpu/test_runtime.py,
# bitwise): a version outside them runs wrapper.run at every layer
DIRECT_RUN_VERSIONS = ("0.7.",)


def load_flashinfer():
    """``(module, None)`` if FlashInfer imports and has the wrapper we drive, else
    ``(None, reason)``."""
    try:
        import flashinfer
    except Exception as exc:  # noqa: BLE001 - any import failure makes the route unavailable
        return None, f"flashinfer failed to import ({type(exc).__name__}: {exc})"
    if not hasattr(flashinfer, "BatchDecodeWithPagedKVCacheWrapper"):
        version = getattr(flashinfer, "__version__", "?")
        return None, (f"flashinfer {version} has no BatchDecodeWithPagedKVCacheWrapper; "
                      "expected flashinfer-python >= 0.5.3")
    return flashinfer, None


class _Recorder:
    """Stands in for a wrapper's compiled FlashInfer module during one ``wrapper.run``: every
    call is forwarded unchanged and kept in ``calls`` as (function, args, kwargs)."""

    def __init__(self, module):
        self._module = module
        self.calls = []

    def __getattr__(self, name):
        attr = getattr(self._module, name)
        if not callable(attr):
            return attr

        def forward(*args, **kwargs):
            self.calls.append((attr, args, kwargs))
            return attr(*args, **kwargs)
        return forward


class DirectCall:
    """FlashInfer's kernel entry for one planned step, as its ``run()`` called it for the layer
    it was recorded at: ``fn(*args)`` with the positions of q, k_cache, v_cache and out in
    ``args`` (held as None there, so that layer's tensors are not kept alive)."""

    __slots__ = ("fn", "args", "slots")

    def __init__(self, fn, args: list, slots: tuple[int, int, int, int]):
        self.fn, self.args, self.slots = fn, args, slots

    @classmethod
    def from_recording(cls, calls, q, k_cache, v_cache, out) -> "DirectCall | None":
        """The call of a recording, or None unless it is exactly one positional call in which
        each of the four tensors appears exactly once (by identity) and no other argument refers
        to their memory: a tensor on one of their addresses (a view) or a list, tuple or dict
        holding tensors would be passed unchanged to later layers, with this layer's data.
        One pass over the arguments (FlashInfer 0.7.2's tensor-core entry takes 46)."""
        import torch

        if len(calls) != 1:
            return None
        fn, args, kwargs = calls[0]
        if kwargs:
            return None
        mine = (q, k_cache, v_cache, out)
        ptrs = {t.data_ptr() for t in mine}
        slots = [-1, -1, -1, -1]
        for i, a in enumerate(args):
            if isinstance(a, torch.Tensor):
                for j, t in enumerate(mine):
                    if a is t:
                        # twice, or q that is out / k_cache that is v_cache at its second
                        # place (passed once, such an alias leaves a slot at -1: refused below)
                        if slots[j] != -1:
                            return None
                        slots[j] = i
                        break
                else:
                    if a.data_ptr() in ptrs:
                        return None
            elif isinstance(a, (list, tuple, dict)):
                items = a.values() if isinstance(a, dict) else a
                if any(isinstance(x, torch.Tensor) for x in items):
                    return None
        if -1 in slots:
            return None
        args = list(args)
        for i in slots:
            args[i] = None
        return cls(fn, args, tuple(slots))

    def __call__(self, q, k_cache, v_cache, out) -> None:
        a = self.args.copy()
        iq, ik, iv, io = self.slots
        a[iq], a[ik], a[iv], a[io] = q, k_cache, v_cache, out
        self.fn(*a)


# FlashInfer's decode has no kernel for these head dims (its tensor-core path raises "Unsupported
# head_dim: 96" from its merge after its decode kernel ran, and the next call in that process
# hit an illegal memory access, on the H200 with 0.7.2, 2026-12-04).
NO_DECODE_HEAD_DIMS = (96,)


# The group sizes FlashInfer 0.7's CUDA-core decode is compiled for (DISPATCH_GQA_GROUP_SIZE in
# include/flashinfer/utils.cuh); any other raises "Unsupported group_size" at plan(). Its
# tensor-core decode takes every group size.
CUDA_CORE_GROUPS = (1, 2, 3, 4, 6, 8, 16)


def unserved(head_dim: int, sinks: bool, group: int | None = None, tensor_cores: bool = True) -> str | None:
    """Why the FlashInfer route must not run this attention (a wrong answer or a crash, not a
    slower baseline), or None. ``group`` and ``tensor_cores``: the path's group sizes (its
    CUDA-core decode has kernels for :data:`CUDA_CORE_GROUPS` only)."""
    if head_dim in NO_DECODE_HEAD_DIMS:
        return f"FlashInfer has no decode kernel for head_dim {head_dim}"
    if not tensor_cores and group is not None and group not in CUDA_CORE_GROUPS:
        return (f"FlashInfer's CUDA-core decode has no kernel for group size {group} (it has "
                f"{', '.join(map(str, CUDA_CORE_GROUPS))}); its tensor-core decode has")
    if sinks:
        return ("not used with attention sinks: FlashInfer's FA2 decode (tensor and CUDA cores) "
                "accepts sinks and ignores them, a wrong answer")
    return None


class FlashInferRoute:
    """FlashInfer decode over HND pages, planned per step, run per layer.

    Parameters
    ----------
    flashinfer : the imported module (:func:`load_flashinfer`).
    num_qo_heads, num_kv_heads, head_dim, page_size, dtype : the attention shape.
    device : torch.device of the cache. sm_scale : softmax scale (None: 1/sqrt(head_dim)).
    tensor_cores : FlashInfer's tensor-core decode path (``use_tensor_cores``) or its CUDA-core
        one. On the H200 at G=4 the tensor-core path measured faster (B1 32K: 44 vs 52 us).
    cuda_graph : FlashInfer's CUDA-graph mode (one wrapper per batch size) or eager.
    direct_run : eager mode: call FlashInfer's kernel entry directly from a step's third layer
        on, as recorded at its second (:class:`DirectCall`; False: ``wrapper.run`` at every
        layer). Graph mode ignores it (its run() is captured and replayed), and so does a
        FlashInfer outside :data:`DIRECT_RUN_VERSIONS` (``stats()['direct_run']`` says which).
    record : ``record(event)`` records an event on the current stream (the Runtime's, which
        skips ``torch.cuda.current_stream()``); None: ``event.record()``.
    indices_buffer : int32 [capacity] device buffer every wrapper reads its page ids from.
    kv_layout : "HND" or "NHD", the layout of the caches run() is given (FlashInfer's own).
    window_left, logits_soft_cap : the attention variant (FlashInfer's meanings), passed to plan.
    max_wrappers : wrappers kept in graph mode (least recently used dropped first).
    """

    def __init__(self, flashinfer, *, num_qo_heads: int, num_kv_heads: int, head_dim: int,
                 page_size: int, dtype, device, sm_scale: float | None, tensor_cores: bool,
                 cuda_graph: bool, indices_buffer, max_wrappers: int = 16,
                 direct_run: bool = True, record=None, kv_layout: str = "HND",
                 window_left: int = -1, logits_soft_cap: float = 0.0):
        import torch

        self._fi = flashinfer
        self.num_qo_heads, self.num_kv_heads = num_qo_heads, num_kv_heads
        self.head_dim, self.page_size, self.dtype = head_dim, page_size, dtype
        self.device, self.sm_scale = device, sm_scale
        self.kv_layout, self.window_left, self.logits_soft_cap = kv_layout, window_left, logits_soft_cap
        self.tensor_cores, self.cuda_graph = tensor_cores, cuda_graph
        self.max_wrappers = max_wrappers
        version = str(getattr(flashinfer, "__version__", ""))
        self.direct_run = (direct_run and not cuda_graph
                           and any(version.startswith(v) for v in DIRECT_RUN_VERSIONS))
        self._direct: DirectCall | None = None   # the current step's, once a run() recorded it
        self._step_runs = 0                      # run()s of the current step that went through wrapper.run
        self.direct_calls = 0                    # run()s that called FlashInfer's entry directly
        self.direct_fallbacks = 0                # steps whose recording could not be used
        self._indices = indices_buffer
        self._record_event = record if record is not None else (lambda ev: ev.record())
        self._workspace = torch.zeros(WORKSPACE_BYTES, dtype=torch.uint8, device=device)
        self._wrappers: OrderedDict[int, tuple[int, object]] = OrderedDict()  # B -> (serial, wrapper)
        self._serial = 0
        self._current = None
        self._plan_events: dict[int, object] = {}   # wrapper serial -> event after its last plan
        self.wrappers_built = 0
        if not cuda_graph:
            self._eager = flashinfer.BatchDecodeWithPagedKVCacheWrapper(
                self._workspace, kv_layout, use_tensor_cores=tensor_cores, backend=BACKEND)

    def _wrapper(self, batch: int) -> tuple[int, object]:
        """The graph-mode wrapper for ``batch`` rows and its serial number (built on first use)."""
        import torch

        hit = self._wrappers.get(batch)
        if hit is not None:
            self._wrappers.move_to_end(batch)
            return hit
        self._serial += 1
        w = self._fi.BatchDecodeWithPagedKVCacheWrapper(
            self._workspace, self.kv_layout, use_cuda_graph=True, use_tensor_cores=self.tensor_cores,
            backend=BACKEND,
            paged_kv_indptr_buffer=torch.zeros(batch + 1, dtype=torch.int32, device=self.device),
            paged_kv_indices_buffer=self._indices,
            paged_kv_last_page_len_buffer=torch.zeros(batch, dtype=torch.int32, device=self.device))
        self.wrappers_built += 1
        self._wrappers[batch] = (self._serial, w)
        while len(self._wrappers) > self.max_wrappers:
            _, (old, _) = self._wrappers.popitem(last=False)  # its graphs keep their key (serial)
            ev = self._plan_events.pop(old, None)             # and never hit again; its pinned
            if ev is not None:                                # buffer may be reused by the next
                ev.synchronize()                              # wrapper: its last copy must be done
        return self._serial, w

    def plan(self, indptr, indices, last_page_len) -> int:
        """Plan this step. Returns the serial number of the wrapper planned (0 in eager mode);
        a graph captured on one wrapper must be keyed by it.

        indptr : int32 [B+1] pinned CPU tensor; last_page_len : int32 [B] pinned CPU tensor;
        indices : int32 [nnz] view of ``indices_buffer`` (already on the device).

        FlashInfer's plan() writes its schedule into a pinned host buffer of the wrapper and
        copies it to the device asynchronously, with no guard against the next plan() of the same
        wrapper rewriting that buffer before the copy has run. A host running ahead of the GPU
        (graph replays make that easy) then hands a step another step's schedule: wrong output,
        or an illegal memory access in FlashInfer's merge. So an event recorded after each
        plan() is waited on before that wrapper plans again (a no-op unless the host is a whole
        step ahead).
        """
        import torch

        self._direct, self._step_runs = None, 0   # before anything that may raise: no stale call
        batch = last_page_len.shape[0]
        if self.cuda_graph:
            serial, w = self._wrapper(batch)
        else:
            serial, w = 0, self._eager
        ev = self._plan_events.get(serial)
        if ev is not None:
            ev.synchronize()  # this wrapper's last plan copy has run: its pinned buffer is free
        else:
            ev = self._plan_events[serial] = torch.cuda.Event()
        w.plan(indptr, indices, last_page_len, self.num_qo_heads, self.num_kv_heads, self.head_dim,
               self.page_size, q_data_type=self.dtype, kv_data_type=self.dtype,
               sm_scale=self.sm_scale, non_blocking=True, **self._variant())
        self._record_event(ev)
        self._current = w
        return serial

    def _variant(self) -> dict:
        """plan()'s keyword arguments of the attention variant (none for plain attention, so a
        plain step plans exactly as before)."""
        kw = {}
        if self.window_left >= 0:
            kw["window_left"] = self.window_left
        if self.logits_soft_cap > 0:
            kw["logits_soft_cap"] = self.logits_soft_cap
        return kw

    def run(self, q, k_cache, v_cache, out, lse=None) -> None:
        """Launch FlashInfer's decode on the current stream (capturable in graph mode). q, out
        [B, H_q, D]; k_cache, v_cache in ``kv_layout`` (HND [num_pages, H_kv, page_size, D] or
        NHD [num_pages, page_size, H_kv, D]); the caller has
        checked them (dtypes, shapes, device) against the Runtime's shape and the planned batch."""
        if lse is not None:   # FlashInfer's run() with its lse output; no direct call for it
            self._current.run(q, (k_cache, v_cache), out=out, lse=lse, return_lse=True)
            return
        direct = self._direct
        if direct is not None:
            direct(q, k_cache, v_cache, out)
            self.direct_calls += 1
            return
        self._step_runs += 1
        if not self.direct_run or self._step_runs != 2:
            self._current.run(q, (k_cache, v_cache), out=out)
            return
        self._direct = self._record_call(q, k_cache, v_cache, out)
        if self._direct is None:
            self.direct_fallbacks += 1

    def _record_call(self, q, k_cache, v_cache, out) -> DirectCall | None:
        """``wrapper.run`` for this layer with the wrapper's compiled module behind a
        :class:`_Recorder`; the call it made, if it can be replayed (:class:`DirectCall`)."""
        w = self._current
        module = getattr(w, "_cached_module", None)
        if module is None:
            w.run(q, (k_cache, v_cache), out=out)
            return None
        rec = _Recorder(module)
        try:
            w._cached_module = rec
        except AttributeError:   # not a plain attribute in this FlashInfer version
            w.run(q, (k_cache, v_cache), out=out)
            return None
        try:
            w.run(q, (k_cache, v_cache), out=out)
        finally:
            w._cached_module = module
        return DirectCall.from_recording(rec.calls, q, k_cache, v_cache, out)

    def stats(self) -> dict:
        return {"wrappers_alive": len(self._wrappers) if self.cuda_graph else 1,
                "wrappers_built": self.wrappers_built if self.cuda_graph else 1,
                "tensor_cores": self.tensor_cores, "direct_run": self.direct_run,
                "direct_calls": self.direct_calls, "direct_fallbacks": self.direct_fallbacks}
