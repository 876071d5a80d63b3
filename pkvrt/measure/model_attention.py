"""The attention backends of ``pkvrt.measure.model``'s decoder, behind one interface.

A backend is what :class:`pkvrt.measure.model.DecodeLoop` and :meth:`pkvrt.measure.model.Model.forward` call:

* ``name`` : the engine's label in results files.
* ``prepare(loop)`` : its host work before each step, outside the graph (FlashInfer: ``plan()``).
  ``loop.last`` is the step's :class:`pkvrt.measure.model.Slots`, ``loop.pool`` the page pool.
* ``begin_step(seq_lens, block_tables)`` : device work once per step, inside the graph (pkvrt:
  device planning). seq_lens int32 [B], block_tables int32 [B, W], both on the device.
* ``attend(layer, q, k_cache, v_cache, out) -> o`` : q, out [B, H_q, D] (out contiguous, the
  loop's buffer for this layer); caches [num_pages, H_kv, page_size, D] (HND), the new token
  already appended. Writes the attention output into ``out`` and returns it (no-attention
  returns q and writes nothing). Capturable for the GPU backends.

=================  ===========================================================================
engine             what runs
=================  ===========================================================================
pkvrt              ``pkvrt.Runtime(...)`` given GPU lengths (device planning), captured: plan() from
                   the device lengths in the graph, run() per layer (examples/engine_graph.py)
flashinfer-tc      FlashInfer's ``BatchDecodeWithPagedKVCacheWrapper`` in CUDA-graph mode,
                   tensor-core decode (``use_tensor_cores=True``), plan() on the host per step
flashinfer-cuda    the same wrapper, CUDA-core decode
flashinfer-xqa     FlashInfer's XQA decode over the device block tables and lengths
                   (``pkvrt.measure.fi_engines.run_xqa``; no host plan)
no-attention       output = q: the step without attention (the attention share's baseline)
reference          ``pkvrt.reference.decode_attention`` in FP32 (eager only: it reads the
                   lengths on the host); the CPU tests' twin
=================  ===========================================================================
"""

from __future__ import annotations

import numpy as np
import torch

from pkvrt import reference
from pkvrt.measure.model import ModelConfig, Staged

FI_WORKSPACE_BYTES = 128 * 2**20   # FlashInfer's documented example size
XQA_WORKSPACE_BYTES = 256 * 2**20  # XQA keeps its semaphores in the first 8 MiB
GPU_ENGINES = ("pkvrt", "flashinfer-tc", "flashinfer-cuda", "flashinfer-xqa", "no-attention")


def make_backend(name: str, cfg: ModelConfig, loop, **pkvrt_kwargs):
    """The backend called ``name`` (one of :data:`GPU_ENGINES` or ``reference``) for ``loop``.
    ``pkvrt_kwargs`` (routes, calibration) go to pkvrt.Runtime. Raises RuntimeError when the
    backend cannot run here (FlashInfer missing, no XQA in this FlashInfer), naming why."""
    if name == "pkvrt":
        return PkvrtAttention(cfg, loop, **pkvrt_kwargs)
    if name in ("flashinfer-tc", "flashinfer-cuda"):
        return FlashInferAttention(cfg, loop, tensor_cores=name == "flashinfer-tc")
    if name == "flashinfer-xqa":
        return XqaAttention(cfg, loop)
    if name == "no-attention":
        return NoAttention()
    if name == "reference":
        return ReferenceAttention()
    raise ValueError(f"unknown attention engine {name!r}; expected one of "
                     f"{', '.join(GPU_ENGINES)} or reference")


class NoAttention:
    """The step without attention: the output is q itself (no kernel, no host work)."""

    name = "no-attention"

    def prepare(self, loop) -> None:
        pass

    def begin_step(self, seq_lens, block_tables) -> None:
        pass

    def attend(self, layer, q, k_cache, v_cache, out):
        return q


class ReferenceAttention(NoAttention):
    """FP32 paged decode attention (``pkvrt.reference.decode_attention``), cast to q's dtype.
    Eager only: it reads the lengths on the host."""

    name = "reference"

    def begin_step(self, seq_lens, block_tables) -> None:
        self._seq, self._bt = seq_lens, block_tables

    def attend(self, layer, q, k_cache, v_cache, out):
        return out.copy_(reference.decode_attention(q, k_cache, v_cache, self._seq, self._bt))


class PkvrtAttention(NoAttention):
    """pkvrt with device planning, capturable: ``plan(seq_lens, block_tables)`` once per step
    from the device buffers (the planning kernel builds the step's work on the GPU), ``run()``
    per layer. No host work per step beyond the loop's copy of lengths and slots."""

    name = "pkvrt"

    def __init__(self, cfg: ModelConfig, loop, *, routes=None, calibration="auto"):
        from pkvrt.runtime import Runtime
        from pkvrt.runtime.options import RuntimeOptions

        self.rt = Runtime(cfg.num_qo_heads, cfg.num_kv_heads, cfg.head_dim, cfg.page_size,
                          cfg.dtype, device=loop.tokens.device, routes=routes,
                          calibration=calibration, max_batch=loop.batch,
                          max_pages_per_row=loop.pool.block_tables.shape[1], device_planning=True,
                          num_pages=loop.caches.num_pages,
                          options=RuntimeOptions(use_cuda_graph=False, validate=False))

    def begin_step(self, seq_lens, block_tables) -> None:
        self.rt.plan(seq_lens, block_tables)

    def attend(self, layer, q, k_cache, v_cache, out):
        return self.rt.run(q, k_cache, v_cache, out=out)

    def check(self) -> None:
        """Raise if the planning kernel flagged a row (bad length or page id) in the last step."""
        self.rt.device_status()


def _flashinfer():
    from pkvrt.runtime import fi_route

    module, reason = fi_route.load_flashinfer()
    if module is None:
        raise RuntimeError(reason)
    return module


class FlashInferAttention(NoAttention):
    """FlashInfer's paged decode wrapper in its CUDA-graph mode, as an engine that captures its
    step uses it: the wrapper is built for this batch size with fixed indptr / indices /
    last_page_len device buffers; before every replay ``plan()`` runs on the host with pinned
    host indptr and last_page_len (FlashInfer's scheduler reads them there) and the page ids
    already on the device: the block tables' CSR, copied only on steps where the tables changed
    (a reset, a new page), into the very buffer the wrapper reads (FlashInfer's own copy of
    ``indices`` is then a copy of a view onto itself, which torch skips). ``run()`` per layer is
    captured in the step's graph.

    tensor_cores : FlashInfer's tensor-core decode (``use_tensor_cores=True``) or its CUDA-core
        one; ``backend="fa2"`` names the kernel in every FlashInfer version.
    """

    def __init__(self, cfg: ModelConfig, loop, *, tensor_cores: bool):
        fi = _flashinfer()
        self.name = "flashinfer-tc" if tensor_cores else "flashinfer-cuda"
        self.cfg = cfg
        device = loop.tokens.device
        b, width = loop.pool.block_tables.shape
        i32 = dict(dtype=torch.int32, device=device)
        self.indices = Staged((b * width,), torch.int32, device)   # CSR page ids, [nnz] used
        pin = dict(dtype=torch.int32, pin_memory=device.type == "cuda")
        self._indptr = torch.zeros(b + 1, **pin)
        self._last_page_len = torch.zeros(b, **pin)
        self._planned = torch.cuda.Event() if device.type == "cuda" else None
        self._version = -1       # the pool's block-table version the indices hold
        self._nnz = 0
        self.workspace = torch.zeros(FI_WORKSPACE_BYTES, dtype=torch.uint8, device=device)
        self.wrapper = fi.BatchDecodeWithPagedKVCacheWrapper(
            self.workspace, "HND", use_cuda_graph=True, use_tensor_cores=tensor_cores,
            paged_kv_indptr_buffer=torch.zeros(b + 1, **i32),
            paged_kv_indices_buffer=self.indices.device,
            paged_kv_last_page_len_buffer=torch.zeros(b, **i32), backend="fa2")

    def prepare(self, loop) -> None:
        cfg, pool = self.cfg, loop.pool
        seq = loop.last.seq_lens
        pages = -(-seq // cfg.page_size)                                # [B]
        if pool.version != self._version:
            used = np.arange(pool.block_tables.shape[1]) < pages[:, None]   # bool [B, W]
            ids = pool.block_tables[used]                                # rows in order
            self._nnz = ids.size
            self.indices.host()[:ids.size] = ids
            self.indices.push()
            self._version = pool.version
        # The pinned indptr / last_page_len of the previous plan() are copied asynchronously:
        # wait for that copy (recorded behind the plan) before rewriting them.
        if self._planned is not None:
            self._planned.synchronize()    # a no-op before the first record
        indptr = self._indptr.numpy()
        indptr[0] = 0
        np.cumsum(pages, out=indptr[1:])
        self._last_page_len.numpy()[:] = seq - (pages - 1) * cfg.page_size   # in 1..page_size
        self.wrapper.plan(self._indptr, self.indices.device[:self._nnz], self._last_page_len,
                          cfg.num_qo_heads, cfg.num_kv_heads, cfg.head_dim, cfg.page_size,
                          q_data_type=cfg.dtype, kv_data_type=cfg.dtype, non_blocking=True)
        if self._planned is not None:
            self._planned.record()

    def attend(self, layer, q, k_cache, v_cache, out):
        self.wrapper.run(q, (k_cache, v_cache), out=out)
        return out


class XqaAttention(NoAttention):
    """FlashInfer's XQA decode (``pkvrt.measure.fi_engines.run_xqa``) over the device block tables and
    lengths: no host plan, capturable. Its max_seq_len is the tables' width * page_size (XQA
    sizes its grid from the width; entries past a row's pages are page 0, inside the cache).
    Raises RuntimeError when ``pkvrt.measure.fi_engines`` or this FlashInfer's XQA entry is missing."""

    name = "flashinfer-xqa"

    def __init__(self, cfg: ModelConfig, loop):
        fi = _flashinfer()
        try:
            from pkvrt.measure import fi_engines
        except ImportError as exc:
            raise RuntimeError(f"pkvrt.measure.fi_engines is unavailable ({exc})") from None
        self._run, self._entry = fi_engines.run_xqa, fi_engines.xqa_entry(fi)
        self.max_len = loop.pool.block_tables.shape[1] * cfg.page_size
        self.workspace = torch.zeros(XQA_WORKSPACE_BYTES, dtype=torch.uint8, device=loop.tokens.device)

    def begin_step(self, seq_lens, block_tables) -> None:
        self._seq, self._bt = seq_lens, block_tables

    def attend(self, layer, q, k_cache, v_cache, out):
        self._run(self._entry, q, k_cache, v_cache, self.workspace, self._bt, self._seq,
                  self.max_len, out)
        return out
