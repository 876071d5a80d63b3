"""``pkvrt.BatchDecodeWithPagedKVCacheWrapper``: FlashInfer 0.7's decode wrapper, served by pkvrt.

An engine that calls ``flashinfer.BatchDecodeWithPagedKVCacheWrapper`` (SGLang's and vLLM's
FlashInfer backends) switches by one import: the constructor, ``plan()`` and ``run()`` take the
same arguments with the same meanings, and each planned step runs on pkvrt's routes, chosen by
routes.toml and the calibration, or on FlashInfer's own wrapper for what pkvrt does not serve
(``fallback_reason`` says why). What FlashInfer would answer wrongly (attention sinks on its FA2
decode) is refused, never passed on.

How a plan maps onto a :class:`pkvrt.Runtime` (one per wrapper, built at the first plan() from
the shape and the attention variant, rebuilt when they change):

- CSR ``(indptr, indices, last_page_len)`` -> ``seq_lens = (pages - 1) * page_size +
  last_page_len`` (on the host, where FlashInfer's plan() reads indptr and last_page_len too)
  and a block table of each row's pages.
- ``use_cuda_graph=True`` (the engine captures ``run()`` and calls ``plan()`` outside its graph
  before each replay): a device-planning Runtime without graphs of its own. plan() fills the
  caller's indptr / indices / last-page-length buffers (as FlashInfer's does) and launches the
  planning kernel once, which reads that CSR itself (:meth:`Runtime.plan_csr`: neither the page
  ids nor a GPU ``last_page_len`` is read on the host, so plan() does not wait for the GPU; a
  last_page_len outside [1, page_size] found there, page size 1 included, gives its row no work
  and ``runtime.device_status()`` raises). A ``share_prefixes`` wrapper writes lengths and block
  tables into static device buffers first (:func:`device_step`), where its Runtime finds the
  shared pages. The engine's graph holds every layer's launches, which read that plan. A GPU ``indptr`` is read on the host, as
  FlashInfer's plan() reads it (engines pass it on the host). The batch size is fixed by
  the indptr buffer, as in FlashInfer. A page id outside the cache is caught by the planning
  kernel (the row gets no work; ``runtime.device_status()`` raises), where FlashInfer reads it.
- Without it: the default Runtime (host routing, a graph replayed per layer), the block tables
  built on the host (:func:`csr_to_block_tables`).
- ``window_left``, ``logits_soft_cap``, ``sm_scale``, the layout and the dtypes go to the Runtime;
  ``sinks`` given to run() make it a sinks Runtime (rebuilt once, before any capture: the first
  run() with sinks must not be inside one).

Served: decode (one query token per request), no RoPE inside attention, q fp16/bf16, K/V of q's
dtype or float8_e4m3fn (the FP8 scales as floats, as FlashInfer takes them), the shapes
``pkvrt._buildspec.unserved`` accepts, without ``fixed_split_size`` / ``disable_split_kv`` (the
batch-invariance controls are FlashInfer's split rule). Everything else plans and runs
FlashInfer's wrapper, built with the same constructor arguments.
"""

from __future__ import annotations

import functools
import inspect
import math

import attrs
import numpy as np
import torch

from pkvrt import _buildspec
from pkvrt.launch import ops
from pkvrt.runtime import fi_route

KV_LAYOUTS = ("NHD", "HND")
MAX_CONTEXT = 131072   # tokens of the longest row the block-table buffer holds (constructor)


def canonical_dtype(dt, name: str):
    """A dtype given as a torch dtype or its name ("float16", "bfloat16", "float8_e4m3fn")."""
    if dt is None or isinstance(dt, torch.dtype):
        return dt
    if isinstance(dt, str) and isinstance(getattr(torch, dt, None), torch.dtype):
        return getattr(torch, dt)
    raise ValueError(f"{name}={dt!r}: expected a torch dtype or its name")


def csr_pages(indptr, batch: int, *, padding: bool = False) -> np.ndarray:
    """FlashInfer's ``indptr`` on the host as int64 ``[batch + 1]`` (a device-to-host copy when
    it is on the GPU, as in FlashInfer's plan(); engines pass it on the host). ``padding``: rows
    of no pages are allowed (an engine's padding rows of a captured batch size, which vLLM
    gives an indptr that stays flat; they get no work).

    Raises ValueError naming the argument: indptr not [batch + 1] starting at 0, decreasing, or
    (without ``padding``) a row of no pages."""
    ip = np.asarray(indptr.cpu() if isinstance(indptr, torch.Tensor) else indptr, dtype=np.int64)
    if ip.ndim != 1 or ip.shape[0] != batch + 1 or ip[0] != 0:
        raise ValueError(f"indptr: expected [batch_size + 1 = {batch + 1}] starting at 0, got shape "
                         f"{tuple(ip.shape)}" + (f", indptr[0] = {ip[0]}" if ip.size else ""))
    pages = np.diff(ip)
    if (pages < (0 if padding else 1)).any():
        r = int(np.nonzero(pages < (0 if padding else 1))[0][0])
        raise ValueError(f"indptr: row {r} has {int(pages[r])} pages; a decode row has at least one"
                         + ("" if padding else " (rows of none, an engine's padding, only in CUDA-graph mode)"))
    return ip


def _csr_pages_counts(indptr, batch: int, *, padding: bool) -> tuple[np.ndarray, np.ndarray]:
    """:func:`csr_pages` and each row's page count, read with the fewest host operations (a
    plan() in CUDA-graph mode runs this every step): ``(indptr int64 [batch + 1], pages int64
    [batch])``."""
    if isinstance(indptr, torch.Tensor) and indptr.device.type == "cpu" and indptr.dim() == 1 \
            and indptr.shape[0] == batch + 1 and not indptr.requires_grad:
        ip = indptr.numpy().astype(np.int64)
        pages = ip[1:] - ip[:-1]
        if ip[0] == 0 and pages.min() >= (0 if padding else 1):
            return ip, pages
    ip = csr_pages(indptr, batch, padding=padding)   # the general path, naming what is wrong
    return ip, ip[1:] - ip[:-1]


def csr_lengths(indptr, last_page_len, page_size: int, *, padding: bool = False):
    """The lengths of FlashInfer's paged-KV CSR on the host: ``(indptr int64 [B + 1], seq_lens
    int32 [B] = (pages - 1) * page_size + last_page_len)``.

    Raises ValueError naming the argument: as :func:`csr_pages`, last_page_len outside [1,
    page_size]."""
    lpl = _host_array(last_page_len)
    ip = csr_pages(indptr, lpl.shape[0], padding=padding)
    pages = np.diff(ip)
    _check_last_page_len(lpl, pages, page_size)
    # a row of no pages (padding, csr_pages(padding=True)) has length 0
    return ip, np.where(pages > 0, (pages - 1) * page_size + lpl, 0).astype(np.int32)


_CSR_DTYPES = (torch.int32, torch.int64)
_INT32 = np.iinfo(np.int32)


def _check_csr_arg(x, name: str) -> None:
    """ValueError naming ``name`` unless ``x`` is one-dimensional and of integers (a tensor of
    int32 or int64, or an integer array or sequence): a float is not truncated into an index,
    and nothing is written before the three arguments pass. A tensor's dtype and shape are read
    without touching its data (a GPU tensor is not copied)."""
    if isinstance(x, torch.Tensor):
        if x.dim() == 1 and x.dtype in _CSR_DTYPES:
            return
        got = f"a {x.dtype} tensor of shape {tuple(x.shape)}"
    elif x is None:
        got = "None"
    else:
        a = np.asarray(x)
        if a.ndim == 1 and (a.size == 0 or np.issubdtype(a.dtype, np.integer)):
            return
        got = f"{type(x).__name__} of {a.dtype}, shape {a.shape}"
    raise ValueError(f"{name}: expected a 1-D int32 or int64 tensor, got {got}")


def _scale_value(s, name: str) -> float:
    """run()'s ``k_scale`` / ``v_scale`` as a float (a number or a one-element tensor)."""
    if isinstance(s, torch.Tensor) and s.numel() != 1:
        raise ValueError(f"{name}: expected a float (or a one-element tensor), got a tensor of "
                         f"shape {tuple(s.shape)}")
    try:
        return float(s)
    except (TypeError, ValueError):
        raise ValueError(f"{name}={s!r}: expected a float") from None


def _host_array(x) -> np.ndarray:
    """``x`` (a tensor, possibly on the GPU: a device-to-host copy, or a sequence) as int64 numpy."""
    if isinstance(x, torch.Tensor) and x.device.type == "cpu" and not x.requires_grad:
        return x.numpy().astype(np.int64)
    return np.asarray(x.cpu() if isinstance(x, torch.Tensor) else x, dtype=np.int64)


def _check_last_page_len(lpl: np.ndarray, pages: np.ndarray, page_size: int) -> None:
    """ValueError naming the first row of pages whose last_page_len is outside [1, page_size]."""
    if lpl.size and lpl.min() >= 1 and lpl.max() <= page_size:
        return
    bad = ((lpl < 1) | (lpl > page_size)) & (pages > 0)
    if bad.any():
        r = int(np.nonzero(bad)[0][0])
        raise ValueError(f"last_page_len[{r}] = {int(lpl[r])}: expected 1..page_size = {page_size}")


def _host_side(x) -> bool:
    """Whether reading ``x`` on the host costs no device-to-host copy (not a GPU tensor)."""
    return not isinstance(x, torch.Tensor) or x.device.type == "cpu"


def _length(x) -> int:
    """``len(x)``; a tensor's first dimension read directly (``Tensor.__len__`` goes through
    torch's function dispatch: about 1 us a call on a plan()'s path)."""
    return x.shape[0] if isinstance(x, torch.Tensor) else len(x)


def _check_indices_length(indices, nnz: int) -> None:
    n = _length(indices)
    if n < nnz:
        raise ValueError(f"indices: expected at least indptr[-1] = {nnz} entries, got {n}")


def csr_to_block_tables(indptr, indices, last_page_len, page_size: int):
    """FlashInfer's paged-KV CSR as pkvrt's step: ``(seq_lens int32 [B], block_tables int32
    [B, max pages])`` on the host; a row's unused entries are 0 (never read). Reads the page
    ids on the host (a device-to-host copy when ``indices`` is on the GPU).

    Raises ValueError naming the argument: as :func:`csr_lengths`, and indices shorter than
    indptr[-1]."""
    ip, seq = csr_lengths(indptr, last_page_len, page_size)
    b, pages, nnz = seq.shape[0], np.diff(ip), int(ip[-1])
    _check_indices_length(indices, nnz)
    ind = np.asarray(indices[:nnz].cpu() if isinstance(indices, torch.Tensor) else indices[:nnz])
    if ind.dtype != np.int32:   # page ids are int32: a wider id must not wrap onto another page
        ind = ind.astype(np.int64)
        bad = (ind < _INT32.min) | (ind > _INT32.max)
        if bad.any():
            i = int(np.nonzero(bad)[0][0])
            raise ValueError(f"indices[{i}] = {int(ind[i])}: page ids are int32 "
                             f"({_INT32.min}..{_INT32.max})")
        ind = ind.astype(np.int32)
    bt = np.zeros((b, int(pages.max()) if b else 0), dtype=np.int32)
    if b <= 96:   # a slice copy per row: 16 us at B 8 x 32K tokens where one scatter takes 100
        for r, (lo, hi) in enumerate(zip(ip[:-1].tolist(), ip[1:].tolist())):
            bt[r, :hi - lo] = ind[lo:hi]
    else:
        rows = np.repeat(np.arange(b), pages)
        bt[rows, np.arange(nnz) - np.repeat(ip[:-1], pages)] = ind
    return seq, bt


def device_step(ip: np.ndarray, indices: torch.Tensor, seq_out: torch.Tensor, bt_out: torch.Tensor, *,
                seq: np.ndarray | None = None, last_page_len: torch.Tensor | None = None,
                page_size: int = 1) -> None:
    """A CSR step whose page ids are on the device, written there: ``seq_out[:B]`` int32 the
    lengths, ``bt_out[:B]`` int32 each row's pages in its first entries (the others are left as
    they were: nothing reads past a row's pages). ``ip``: the host indptr (:func:`csr_pages`);
    the lengths are ``seq`` (host, int32 [B]) or, with ``last_page_len`` on the device,
    ``(pages - 1) * page_size + last_page_len`` computed there. Only ``ip`` (and ``seq``) cross
    from the host, in one copy that is not waited for; the page ids and ``last_page_len`` are
    never read on the host, so plan() does not wait for the GPU. The block tables take
    O(nnz) work: each entry's row by ``repeat_interleave`` (its output size known), its column
    from the row's first entry, one scatter."""
    dev = bt_out.device
    b, nnz = ip.shape[0] - 1, int(ip[-1])
    _check_indices_length(indices, nnz)
    pages = np.diff(ip)
    host = torch.from_numpy(np.stack([ip[:-1], pages, np.zeros(b, np.int64) if seq is None
                                      else seq.astype(np.int64)]))
    if dev.type == "cuda":
        host = host.pin_memory()
    meta = host.to(dev, non_blocking=True)                  # [3, B]: first entry, pages, length
    if seq is None:   # rows of no pages (padding) have length 0
        seq_out[:b].copy_(torch.where(meta[1] > 0, (meta[1] - 1) * page_size + last_page_len.to(dev), 0))
    else:
        seq_out[:b].copy_(meta[2])
    row = torch.repeat_interleave(torch.arange(b, device=dev), meta[1], output_size=nnz)
    col = torch.arange(nnz, device=dev) - meta[0][row]
    bt_out[row, col] = indices[:nnz].to(device=dev, dtype=torch.int32)


def _page_dim(x: torch.Tensor, kv_layout: str) -> torch.Tensor:
    """A page-size-1 cache given without its page dimension gets it back (FlashInfer's rule:
    NHD before the head dimension, HND after it); a view, no copy."""
    return x.unsqueeze(-3) if kv_layout == "NHD" else x.unsqueeze(-2)


def split_paged_kv_cache(paged_kv_cache, kv_layout: str):
    """``run()``'s cache as ``(k_cache, v_cache)``: a tuple of two 4-D tensors, or one 5-D tensor
    ``[pages, 2, H_kv, page, D]`` (HND) / ``[pages, 2, page, H_kv, D]`` (NHD) whose K and V are
    the views ``[:, 0]`` and ``[:, 1]`` (no copy). Page size 1 may drop the page dimension, as
    FlashInfer allows (SGLang's token slots): 3-D K and V ``[slots, H_kv, D]``, or one 4-D
    ``[slots, 2, H_kv, D]``."""
    if isinstance(paged_kv_cache, (tuple, list)):
        if len(paged_kv_cache) != 2:
            raise ValueError(f"paged_kv_cache: expected (k_cache, v_cache), got {len(paged_kv_cache)} tensors")
        return tuple(_page_dim(t, kv_layout) if isinstance(t, torch.Tensor) and t.dim() == 3 else t
                     for t in paged_kv_cache)
    if isinstance(paged_kv_cache, torch.Tensor) and paged_kv_cache.dim() == 4 and paged_kv_cache.shape[1] == 2:
        paged_kv_cache = _page_dim(paged_kv_cache, kv_layout)
    if not isinstance(paged_kv_cache, torch.Tensor) or paged_kv_cache.dim() != 5 or paged_kv_cache.shape[1] != 2:
        shape = tuple(paged_kv_cache.shape) if isinstance(paged_kv_cache, torch.Tensor) else type(paged_kv_cache)
        raise ValueError(f"paged_kv_cache: expected (k_cache, v_cache) or one [pages, 2, ...] tensor "
                         f"({kv_layout}), got {shape}")
    return paged_kv_cache[:, 0], paged_kv_cache[:, 1]


@functools.cache
def _runtime_class():
    from pkvrt.runtime import Runtime   # at first use: pkvrt.runtime imports this module

    return Runtime


@attrs.frozen(eq=False)
class _PlanSetup:
    """What a plan()'s shape and variant arguments decide (forward()'s variant applied): why
    pkvrt does not serve it (None: served), the Runtime's key, the effective variant, and the
    q and K/V dtypes as given (``data_type`` filled in) for FlashInfer's wrapper."""

    reason: str | None
    key: dict | None
    q_data_type: object
    kv_data_type: object
    pos_encoding_mode: str
    window_left: int
    logits_soft_cap: float | None
    sm_scale: float | None
    variant: tuple


class BatchDecodeWithPagedKVCacheWrapper:
    """FlashInfer 0.7's decode wrapper (``flashinfer.BatchDecodeWithPagedKVCacheWrapper``), served
    by pkvrt's routes where they serve the plan (module docstring).

    Parameters
    ----------
    float_workspace_buffer : torch.Tensor, uint8 on the device (FlashInfer's fallback uses it;
        pkvrt keeps its own buffers).
    kv_layout : "NHD" (default, as FlashInfer's) or "HND".
    use_cuda_graph : FlashInfer's CUDA-graph mode: ``plan()`` outside the engine's graph before
        each replay, ``run()`` captured; needs the three buffers below, whose sizes fix the batch
        size (``paged_kv_indptr_buffer [B + 1]``) and the most pages a step holds
        (``paged_kv_indices_buffer``); each plan() copies its CSR into them, as FlashInfer does.
    use_tensor_cores, backend, jit_args : FlashInfer's; used by its wrapper where it runs
        (fallback) and, for use_tensor_cores, by the Runtime's FlashInfer route.
    routes, calibration : pkvrt's policy (``pkvrt.Runtime``'s; defaults: the shipped routes.toml
        and the calibration of this GPU). max_context : the longest row (tokens) a plan may hold
        in CUDA-graph mode (the block-table buffer's width; default 131072).
    share_prefixes : pkvrt's own switch (default False): serve the plans with
        :class:`pkvrt.SharedPagesRuntime`, which reads pages that several rows share at the
        same positions (SGLang's radix cache, vLLM's prefix caching, n > 1 sampling) once per
        chunk of rows. In CUDA-graph mode the sharing is found on the GPU every step (rows whose
        tables begin with the same pages); otherwise on the host; either way used where the time
        model predicts the shared path faster than the plain step. Plans with a sliding window
        run the plain Runtime. On steps that share nothing it costs launches: turn it on where
        the engine serves with prefix caching.
    """

    def __init__(self, float_workspace_buffer: torch.Tensor, kv_layout: str = "NHD",
                 use_cuda_graph: bool = False, use_tensor_cores: bool = False,
                 paged_kv_indptr_buffer: torch.Tensor | None = None,
                 paged_kv_indices_buffer: torch.Tensor | None = None,
                 paged_kv_last_page_len_buffer: torch.Tensor | None = None,
                 backend: str = "auto", jit_args=None, *, routes=None, calibration="auto",
                 max_context: int = MAX_CONTEXT, share_prefixes: bool = False):
        if kv_layout not in KV_LAYOUTS:
            raise ValueError(f"Invalid kv_layout {kv_layout!r}: expected one of {KV_LAYOUTS}")
        if not isinstance(float_workspace_buffer, torch.Tensor):
            raise ValueError("float_workspace_buffer: expected a torch.Tensor")
        self._workspace = float_workspace_buffer
        self._int_workspace = None   # reset_workspace_buffer()'s, for FlashInfer's wrapper
        self.device = float_workspace_buffer.device
        self._kv_layout = kv_layout
        self.use_tensor_cores = bool(use_tensor_cores)
        self._backend, self._jit_args = backend, jit_args
        self._routes, self._calibration = routes, calibration
        if isinstance(max_context, bool) or not isinstance(max_context, int) or max_context < 1:
            raise ValueError(f"max_context={max_context!r}: expected a positive int")
        self._max_context = max_context
        if not isinstance(share_prefixes, bool):
            raise ValueError(f"share_prefixes={share_prefixes!r}: expected True or False")
        self._share_prefixes = share_prefixes
        self._use_cuda_graph = bool(use_cuda_graph)
        self._buffers = (paged_kv_indptr_buffer, paged_kv_indices_buffer, paged_kv_last_page_len_buffer)
        self._fixed_batch_size = None
        if self._use_cuda_graph:
            for name, t in zip(("paged_kv_indptr_buffer", "paged_kv_indices_buffer",
                                "paged_kv_last_page_len_buffer"), self._buffers):
                if not isinstance(t, torch.Tensor) or t.dim() != 1:
                    raise ValueError(f"{name}: expected a 1-D torch.Tensor when use_cuda_graph is True")
            self._fixed_batch_size = int(paged_kv_indptr_buffer.shape[0]) - 1
            if self._fixed_batch_size < 1:
                raise ValueError(f"paged_kv_indptr_buffer: expected [batch_size + 1] with batch_size >= 1, "
                                 f"got {tuple(paged_kv_indptr_buffer.shape)}")
            if paged_kv_last_page_len_buffer.shape[0] != self._fixed_batch_size:
                raise ValueError(f"paged_kv_last_page_len_buffer: expected [{self._fixed_batch_size}] "
                                 f"(the batch size of paged_kv_indptr_buffer), got "
                                 f"{tuple(paged_kv_last_page_len_buffer.shape)}")
        # FlashInfer's names for the caller's buffers: SGLang writes a step's indices straight
        # into _paged_kv_indices_buf before plan()
        self._paged_kv_indptr_buf, self._paged_kv_indices_buf, self._paged_kv_last_page_len_buf = \
            self._buffers
        # the buffers as the planning kernel reads a CSR (contiguous int32 on the device): fixed
        # with the buffers, so checked once here, not per plan()
        self._buffers_kernel_ready = self._use_cuda_graph and all(
            t.dtype == torch.int32 and t.device == self.device and t.is_contiguous() for t in self._buffers)
        self._begin_forward = self.plan
        self._variant_override = None   # forward()'s window / soft cap / scale, kept for later plans
        # what FlashInfer's plan() leaves in these (vLLM asserts on them before each run)
        self._window_left, self._logits_soft_cap, self._sm_scale = -1, 0.0, None
        self._plan_args = None     # the last plan()'s arguments (forward() may re-plan with them)
        self._rt = None            # the Runtime, and what it was built for (_rt_key)
        self._rt_key = None
        self._setup_memo = None    # (plan()'s shape and variant arguments, forward()'s variant, _PlanSetup)
        self._rt_setup = None      # the _PlanSetup the Runtime was last fetched for
        self._rt_width = 0         # CUDA-graph mode: the pages of the widest row the Runtime holds
        self._fi = None            # FlashInfer's wrapper, built on the first fallback
        self._planned = None       # the last plan: dict of what run() needs
        self.fallback_reason: str | None = None

    # ------------------------------------------------------------------ properties (FlashInfer's)

    @property
    def is_cuda_graph_enabled(self) -> bool:
        return self._use_cuda_graph

    @property
    def runtime(self):
        """The pkvrt Runtime serving the plans (None before the first served plan)."""
        return self._rt

    def explain(self) -> str:
        """Where the last plan runs and why (the Runtime's explain(), or the fallback's reason)."""
        if self._planned is None:
            return "BatchDecodeWithPagedKVCacheWrapper: nothing planned yet"
        if self.fallback_reason is not None:
            return f"FlashInfer's own wrapper: {self.fallback_reason}"
        return self._rt.explain()

    # ------------------------------------------------------------------ plan

    def plan(self, indptr: torch.Tensor, indices: torch.Tensor, last_page_len: torch.Tensor,
             num_qo_heads: int, num_kv_heads: int, head_dim: int, page_size: int, *,
             pos_encoding_mode: str = "NONE", window_left: int = -1, window_right: int = 0,
             logits_soft_cap: float | None = None, q_data_type="float16", kv_data_type=None,
             o_data_type=None, data_type=None, sm_scale: float | None = None,
             rope_scale: float | None = None, rope_theta: float | None = None,
             non_blocking: bool = True, block_tables: torch.Tensor | None = None,
             seq_lens: torch.Tensor | None = None, fixed_split_size: int | None = None,
             disable_split_kv: bool = False, q_len_per_req: int = 1, is_causal=None) -> None:
        """Plan a decode step (FlashInfer's arguments and meanings). Call outside any CUDA-graph
        capture, before the step's run() calls (before each replay in CUDA-graph mode).

        A plan() that raises leaves no plan in effect (run() refuses until the next one), the
        caller's CUDA-graph buffers unwritten where its CSR arguments were refused, and the
        attributes FlashInfer's plan() sets (``_sm_scale``, ``_window_left``, ...) as the last
        plan() that succeeded left them."""
        self._planned = None   # until this plan succeeds
        for name, x in (("indptr", indptr), ("indices", indices), ("last_page_len", last_page_len)):
            _check_csr_arg(x, name)
        plan_args = ((indptr, indices, last_page_len, num_qo_heads, num_kv_heads, head_dim, page_size),
                     dict(pos_encoding_mode=pos_encoding_mode, window_left=window_left,
                          window_right=window_right, logits_soft_cap=logits_soft_cap,
                          q_data_type=q_data_type, kv_data_type=kv_data_type, o_data_type=o_data_type,
                          data_type=data_type, sm_scale=sm_scale, rope_scale=rope_scale,
                          rope_theta=rope_theta, non_blocking=non_blocking, block_tables=block_tables,
                          seq_lens=seq_lens, fixed_split_size=fixed_split_size,
                          disable_split_kv=disable_split_kv, q_len_per_req=q_len_per_req,
                          is_causal=is_causal))
        # what the step's shape and variant decide (the Runtime's key, or why pkvrt does not
        # serve it): the same for every plan() of a model's layer kind, so kept for the next
        sig = (num_qo_heads, num_kv_heads, head_dim, page_size, pos_encoding_mode, window_left,
               window_right, logits_soft_cap, q_data_type, kv_data_type, o_data_type, data_type,
               sm_scale, fixed_split_size, disable_split_kv, q_len_per_req, is_causal)
        memo = self._setup_memo
        if memo is not None and memo[0] == sig and memo[1] is self._variant_override:
            s = memo[2]
        else:
            s = self._setup(*sig)
            self._setup_memo = (sig, self._variant_override, s)
        batch = _length(last_page_len)
        if self._use_cuda_graph:
            if batch != self._fixed_batch_size:
                raise ValueError(f"The batch size should be fixed in cudagraph mode, the runtime batch "
                                 f"size {batch} mismatches the batch size set during initialization "
                                 f"{self._fixed_batch_size}")
            if _length(indices) > self._buffers[1].shape[0]:
                raise ValueError(f"The size of indices should be less than or equal to the allocated buffer "
                                 f"(indices: {_length(indices)} entries, paged_kv_indices_buffer: "
                                 f"{self._buffers[1].shape[0]})")
        if s.reason is not None:
            fi_kwargs = dict(pos_encoding_mode=s.pos_encoding_mode, window_left=s.window_left,
                             logits_soft_cap=s.logits_soft_cap, q_data_type=s.q_data_type,
                             kv_data_type=s.kv_data_type, o_data_type=o_data_type, sm_scale=s.sm_scale,
                             rope_scale=rope_scale, rope_theta=rope_theta, non_blocking=non_blocking,
                             block_tables=block_tables, seq_lens=seq_lens,
                             fixed_split_size=fixed_split_size, disable_split_kv=disable_split_kv,
                             q_len_per_req=q_len_per_req, is_causal=is_causal, window_right=window_right)
            self._plan_flashinfer(s.reason, indptr, indices, last_page_len, num_qo_heads,
                                  num_kv_heads, head_dim, page_size, fi_kwargs)
            self._planned_with(plan_args)
            return
        key = s.key
        if self._use_cuda_graph:
            # indptr on the host (engines pass it there; FlashInfer's plan() reads it there too);
            # the page ids, and last_page_len where it is on the GPU (SGLang's), never read on
            # the host: the step is planned on the device from the caller's buffers
            ip, pages = _csr_pages_counts(indptr, batch, padding=True)
            _check_indices_length(indices, int(ip[-1]))
            if _host_side(last_page_len):   # checked here when it costs no device read
                _check_last_page_len(_host_array(last_page_len), pages, page_size)
            widest = max(1, int(pages.max()))
            rt = self._rt
            # the Runtime of this setup while it holds the widest row (a sinks rebuild keeps it)
            if rt is None or self._rt_setup is not s or widest > self._rt_width:
                rt = self._runtime(key, batch, widest)
                self._rt_setup = s
            # FlashInfer fills the caller's buffers: so do we (SGLang wrote indices there already)
            self._buffers[0].copy_(torch.as_tensor(indptr), non_blocking=non_blocking)
            self._buffers[2].copy_(torch.as_tensor(last_page_len), non_blocking=non_blocking)
            ind = self._buffers[1]
            if not (isinstance(indices, torch.Tensor) and indices.data_ptr() == ind.data_ptr()):
                ind[:_length(indices)].copy_(torch.as_tensor(indices), non_blocking=non_blocking)
            if self._csr_direct(rt):
                # one launch: the planning kernel reads the CSR buffers themselves (the batch is
                # the buffers' own: the same tensors every plan(), checked once at construction)
                csr = self._buffers
                rt._plan_csr(*csr, batch)
                self.fallback_reason = None
                self._planned = dict(csr=csr, batch=batch, pages=widest, window_left=key["window_left"],
                                     kv_dtype=key["kv_dtype"], variant=s.variant)
                self._planned_with(plan_args)
                return
            # the block tables written on the device into this wrapper's static buffers (a
            # SharedPagesRuntime finds the shared pages from them)
            if _host_side(last_page_len):
                seq_host = csr_lengths(ip, last_page_len, page_size, padding=True)[1]
            elif page_size == 1:     # every page holds one token: the lengths are the page counts
                seq_host = pages.astype(np.int32)
            else:                    # computed on the device; a bad one is the planner's to flag
                seq_host = None
            seq_buf, bt_buf = self._step_buffers()
            device_step(ip, ind, seq_buf, bt_buf, seq=seq_host,
                        last_page_len=self._buffers[2] if seq_host is None else None, page_size=page_size)
            seq, bt = seq_buf[:batch], bt_buf[:batch]
        else:
            seq, bt = csr_to_block_tables(indptr, indices, last_page_len, page_size)
            rt = self._runtime(key, batch, bt.shape[1])
            self._rt_setup = s
        rt.plan(seq, bt)
        self.fallback_reason = None
        self._planned = dict(seq=seq, bt=bt, window_left=key["window_left"], kv_dtype=key["kv_dtype"],
                             variant=s.variant)
        self._planned_with(plan_args)

    def _planned_with(self, plan_args) -> None:
        """A plan() succeeded: its arguments kept (forward() may re-plan with them), and the
        attributes FlashInfer's plan() leaves for run() set from them (vLLM asserts on them)."""
        self._plan_args = plan_args
        kw = plan_args[1]
        self._window_left, self._sm_scale = kw["window_left"], kw["sm_scale"]
        self._logits_soft_cap = 0.0 if kw["logits_soft_cap"] is None else kw["logits_soft_cap"]

    def _setup(self, hq, hkv, d, page, pos_encoding_mode, window_left, window_right,
               logits_soft_cap, q_data_type, kv_data_type, o_data_type, data_type, sm_scale,
               fixed_split_size, disable_split_kv, q_len_per_req, is_causal) -> "_PlanSetup":
        """What plan()'s shape and variant arguments decide, forward()'s variant applied."""
        for name, v in (("num_qo_heads", hq), ("num_kv_heads", hkv), ("head_dim", d), ("page_size", page)):
            if isinstance(v, bool) or not isinstance(v, (int, np.integer)) or v < 1:
                raise ValueError(f"plan: {name}={v!r}: expected a positive int")
        if self._variant_override is not None:   # forward() gave the variant: it wins (FlashInfer's rule)
            pos_encoding_mode, window_left, logits_soft_cap, sm_scale = (
                self._variant_override[k] for k in ("pos_encoding_mode", "window_left",
                                                    "logits_soft_cap", "sm_scale"))
        if data_type is not None:
            q_data_type = q_data_type if q_data_type is not None else data_type
            kv_data_type = kv_data_type if kv_data_type is not None else data_type
        q_dt = canonical_dtype(q_data_type, "q_data_type") or torch.float16
        kv_dt = canonical_dtype(kv_data_type, "kv_data_type") or q_dt
        o_dt = canonical_dtype(o_data_type, "o_data_type") or q_dt
        reason = self._unserved(hq, hkv, d, page, pos_encoding_mode, window_right, q_dt, kv_dt, o_dt,
                                fixed_split_size, disable_split_kv, q_len_per_req, is_causal)
        key = None if reason is not None else dict(   # a refused plan runs FlashInfer's wrapper
            num_qo_heads=hq, num_kv_heads=hkv, head_dim=d, page_size=page, dtype=q_dt, kv_dtype=kv_dt,
            window_left=-1 if window_left is None else int(window_left),
            logits_soft_cap=float(logits_soft_cap or 0.0), sm_scale=sm_scale)
        return _PlanSetup(reason=reason, key=key, q_data_type=q_data_type, kv_data_type=kv_data_type,
                          pos_encoding_mode=pos_encoding_mode,
                          window_left=window_left, logits_soft_cap=logits_soft_cap, sm_scale=sm_scale,
                          variant=self._variant(pos_encoding_mode, window_left, logits_soft_cap,
                                                sm_scale, d))

    def _csr_direct(self, rt) -> bool:
        """Whether CUDA-graph mode plans ``rt`` straight from the CSR buffers (``Runtime.plan_csr``):
        a plain Runtime (a SharedPagesRuntime finds shared pages in block tables) and the
        buffers as the planning kernel reads them (contiguous int32 on the device)."""
        return self._buffers_kernel_ready and type(rt) is _runtime_class()

    def _unserved(self, hq, hkv, d, page, pos_encoding_mode, window_right, q_dt, kv_dt, o_dt,
                  fixed_split_size, disable_split_kv, q_len_per_req, is_causal) -> str | None:
        """Why pkvrt does not serve a plan (FlashInfer's wrapper runs it then), or None."""
        if pos_encoding_mode != "NONE":
            return f"pos_encoding_mode={pos_encoding_mode!r}: pkvrt applies no RoPE inside attention"
        if q_len_per_req != 1 or is_causal:
            return f"q_len_per_req={q_len_per_req}: pkvrt decodes one query token per request"
        if window_right != 0:
            return f"window_right={window_right}: pkvrt's windows are left windows"
        if (fixed_split_size is not None and fixed_split_size > 0) or disable_split_kv:
            return ("fixed_split_size / disable_split_kv: FlashInfer's batch-invariant split rule "
                    "(pkvrt's cut depends on the batch)")
        if q_dt not in ops._DTYPES or o_dt != q_dt:
            return f"q_data_type={q_dt}, o_data_type={o_dt}: pkvrt takes fp16/bf16 q and out of q's dtype"
        if kv_dt not in (q_dt, ops.FP8):
            return f"kv_data_type={kv_dt}: pkvrt reads K/V of q's dtype or float8_e4m3fn"
        if hkv <= 0 or hq % hkv:
            return None   # the Runtime refuses it, naming the argument (FlashInfer would too)
        if page not in _buildspec.PAGE_SIZES:
            return f"page_size={page}: pkvrt's kernels take powers of two up to {_buildspec.MAX_PAGE_SIZE}"
        return _buildspec.unserved(d, hq // hkv, ops.KV_TAG.get(kv_dt))

    def _runtime(self, key: dict, batch: int, pages: int):
        """The Runtime for this plan's shape and variant, built (or rebuilt) when they change or
        a non-graph plan outgrows its buffers; a sinks Runtime once run() has seen sinks."""
        from pkvrt.runtime import Runtime

        sinks = bool(self._rt_key and self._rt_key.get("sinks"))
        want = dict(key, sinks=sinks)
        if self._use_cuda_graph:
            # a row holds at most the indices buffer's pages: page size 1 with a long max_context
            # would otherwise give every captured batch size a huge block table
            width = max(1, min(-(-self._max_context // key["page_size"]), len(self._buffers[1])))
            if pages > width:
                raise ValueError(f"plan: a row of {pages} pages; this wrapper's block-table buffer "
                                 f"holds rows of {width} (max_context={self._max_context} tokens): "
                                 "construct it with a larger max_context")
            size = dict(max_batch=self._fixed_batch_size, max_pages_per_row=width)
            self._rt_width = width
        else:
            have = self._rt_key or {}
            size = dict(max_batch=max(have.get("max_batch", 0), 1 << max(batch - 1, 0).bit_length(), 8),
                        max_pages_per_row=max(have.get("max_pages_per_row", 0), 1 << max(pages - 1, 0).bit_length(), 256))
        if self._rt is not None and want == {k: self._rt_key[k] for k in want} and all(
                size[k] <= self._rt_key[k] for k in size):
            return self._rt
        from pkvrt.runtime.options import RuntimeOptions

        # CUDA-graph mode: device planning with no graphs of its own (the engine's graph holds
        # the layers; plan() is one planning launch reading the static buffers below)
        options = RuntimeOptions(use_cuda_graph=False) if self._use_cuda_graph else None
        from pkvrt.runtime.shared import SharedPagesRuntime

        # share_prefixes: pages that rows share read once per chunk of rows (no sliding window)
        make = SharedPagesRuntime if self._share_prefixes and key["window_left"] == -1 else Runtime
        self._rt = make(key["num_qo_heads"], key["num_kv_heads"], key["head_dim"], key["page_size"],
                        key["dtype"], kv_dtype=None if key["kv_dtype"] == key["dtype"] else key["kv_dtype"],
                        device=self.device, routes=self._routes, calibration=self._calibration,
                        sm_scale=key["sm_scale"], kv_layout=self._kv_layout,
                        window_left=key["window_left"], logits_soft_cap=key["logits_soft_cap"],
                        sinks=sinks, device_planning=self._use_cuda_graph, options=options, **size)
        self._rt_key = dict(want, **size)
        return self._rt

    def _step_buffers(self) -> tuple[torch.Tensor, torch.Tensor]:
        """device_step's lengths and block tables at fixed addresses, sized by the Runtime (made
        where a step is not planned from the CSR itself: a SharedPagesRuntime; kept across
        rebuilds of the same size, so a planned step's views stay valid)."""
        shape = (self._rt_key["max_batch"], self._rt_key["max_pages_per_row"])
        if getattr(self, "_bt_buf", None) is None or tuple(self._bt_buf.shape) != shape:
            self._seq_buf = torch.ones(shape[0], dtype=torch.int32, device=self.device)
            self._bt_buf = torch.zeros(shape, dtype=torch.int32, device=self.device)
        return self._seq_buf, self._bt_buf

    def _plan_flashinfer(self, reason, indptr, indices, last_page_len, hq, hkv, d, page, kwargs):
        """Plan FlashInfer's own wrapper (built with this wrapper's constructor arguments)."""
        if self._fi is None:
            fi, why = fi_route.load_flashinfer()
            if fi is None:
                raise RuntimeError(f"plan: pkvrt does not serve this plan ({reason}) and FlashInfer's "
                                   f"wrapper is unavailable ({why})")
            ip, ind, lpl = self._buffers
            self._fi = fi.BatchDecodeWithPagedKVCacheWrapper(
                self._workspace, self._kv_layout, use_cuda_graph=self._use_cuda_graph,
                use_tensor_cores=self.use_tensor_cores, paged_kv_indptr_buffer=ip,
                paged_kv_indices_buffer=ind, paged_kv_last_page_len_buffer=lpl,
                backend=self._backend, jit_args=self._jit_args)
            if self._int_workspace is not None:   # reset_workspace_buffer() came first
                self._fi.reset_workspace_buffer(self._workspace, self._int_workspace)
        self._fi.plan(indptr, indices, last_page_len, hq, hkv, d, page, **kwargs)
        self.fallback_reason = reason
        self._planned = dict(fallback=True, variant=self._variant(
            kwargs["pos_encoding_mode"], kwargs["window_left"], kwargs["logits_soft_cap"],
            kwargs["sm_scale"], d))

    # ------------------------------------------------------------------ run

    def run(self, q: torch.Tensor, paged_kv_cache, *args, q_scale: float | None = None,
            k_scale: float | None = None, v_scale: float | None = None,
            out: torch.Tensor | None = None, lse: torch.Tensor | None = None,
            return_lse: bool = False, enable_pdl: bool | None = None,
            window_left: int | None = None, sinks: torch.Tensor | None = None, **kwargs):
        """Decode attention of the planned step for one layer (FlashInfer's arguments and
        meanings; capturable in CUDA-graph mode). Returns ``out`` or ``(out, lse)``; lse is
        each row's and head's log2-sum-exp of its scores, FlashInfer's convention."""
        if self._planned is None:
            raise RuntimeError("run: plan() must be called before run() (no plan in effect: none "
                               "was made, or the last plan() raised)")
        if self.fallback_reason is not None:
            if sinks is not None:
                raise ValueError(f"sinks: this plan runs FlashInfer's wrapper ({self.fallback_reason}), "
                                 "whose FA2 decode accepts sinks and ignores them; pkvrt refuses "
                                 "rather than return a wrong answer")
            return self._fi.run(q, paged_kv_cache, *args, q_scale=q_scale, k_scale=k_scale,
                                v_scale=v_scale, out=out, lse=lse, return_lse=return_lse,
                                enable_pdl=enable_pdl, window_left=window_left, **kwargs)
        extra = [k for k, v in kwargs.items() if v is not None]
        if args or extra:
            raise ValueError(f"run: arguments pkvrt does not serve: {extra or f'{len(args)} positional'}")
        if window_left is not None and window_left != self._planned["window_left"]:
            raise ValueError(f"window_left={window_left}: expected None or the planned "
                             f"{self._planned['window_left']}")
        if q_scale not in (None, 1.0):
            raise ValueError(f"q_scale={q_scale}: pkvrt takes fp16/bf16 q (no q scale)")
        if sinks is not None and not self._rt.sinks:
            # the first run() with sinks: a sinks Runtime, kept only if this run() succeeds
            kept = (self._rt, self._rt_key, self._rt_setup, self._rt_width)
            try:
                self._rebuild_with_sinks()
                return self._run(q, paged_kv_cache, k_scale, v_scale, out, lse, return_lse, sinks)
            except Exception:
                self._rt, self._rt_key, self._rt_setup, self._rt_width = kept
                raise
        return self._run(q, paged_kv_cache, k_scale, v_scale, out, lse, return_lse, sinks)

    def _run(self, q, paged_kv_cache, k_scale, v_scale, out, lse, return_lse, sinks):
        """run() of a plan pkvrt serves, its arguments checked as far as the wrapper checks them."""
        if not isinstance(q, torch.Tensor):
            raise ValueError(f"q: expected a torch.Tensor [batch_size, num_qo_heads, head_dim], got "
                             f"{type(q).__name__}")
        if not q.is_contiguous():   # vLLM passes rows of its fused QKV output; the kernels read [B, H_q, D]
            q = q.contiguous()
        k_cache, v_cache = split_paged_kv_cache(paged_kv_cache, self._kv_layout)
        scales = (self._scales(k_scale, v_scale) if self._planned["kv_dtype"] == ops.FP8
                  else self._no_scales(k_scale, v_scale))
        if return_lse and lse is None:
            lse = torch.empty(q.shape[0], q.shape[1], dtype=torch.float32, device=q.device)
        out = self._rt.run(q, k_cache, v_cache, out=out, sinks=sinks, lse=lse, **scales)
        return (out, lse) if return_lse else out

    def _rebuild_with_sinks(self) -> None:
        """The first run() with sinks: a sinks Runtime (FlashInfer off), planned again."""
        if torch.cuda.is_available() and torch.cuda.is_current_stream_capturing():
            raise RuntimeError("run: the first run() with sinks is inside a CUDA-graph capture; "
                               "call plan() and run(..., sinks=) once before capturing")
        self._rt_key = dict(self._rt_key, sinks=True)
        key = {k: self._rt_key[k] for k in ("num_qo_heads", "num_kv_heads", "head_dim", "page_size",
                                            "dtype", "kv_dtype", "window_left", "logits_soft_cap",
                                            "sm_scale")}
        self._rt = None
        if "csr" in self._planned:
            self._runtime(key, self._planned["batch"], self._planned["pages"]).plan_csr(*self._planned["csr"])
            return
        rt = self._runtime(key, len(self._planned["seq"]), self._planned["bt"].shape[1])
        rt.plan(self._planned["seq"], self._planned["bt"])

    def _scales(self, k_scale, v_scale) -> dict:
        """FP8 caches: FlashInfer takes the scales as floats; the kernels read device scalars,
        rewritten here when a value changes (in a capture: a memset node with the value, as
        FlashInfer bakes its floats into a captured launch)."""
        vals = [1.0 if s is None else _scale_value(s, name)
                for s, name in ((k_scale, "k_scale"), (v_scale, "v_scale"))]
        for s, v, name in zip((k_scale, v_scale), vals, ("k_scale", "v_scale")):
            if not math.isfinite(v) or v <= 0:   # both checked before either is written
                raise ValueError(f"{name}={s!r}: expected a finite scale > 0")
        if getattr(self, "_scale_buf", None) is None:
            self._scale_buf = torch.ones(2, dtype=torch.float32, device=self.device)
            self._scale_vals = [1.0, 1.0]
        for i, v in enumerate(vals):
            capturing = torch.cuda.is_available() and torch.cuda.is_current_stream_capturing()
            if v != self._scale_vals[i] or capturing:
                self._scale_buf[i:i + 1].fill_(v)
                self._scale_vals[i] = v
        return dict(k_scale=self._scale_buf[0:1], v_scale=self._scale_buf[1:2])

    def _no_scales(self, k_scale, v_scale) -> dict:
        """fp16/bf16 caches: FlashInfer multiplies the scores by ``k_scale`` and the output by
        ``v_scale`` whatever the cache's dtype; pkvrt's kernels scale only FP8 caches, so any
        value but None or 1.0 is refused rather than ignored."""
        for s, name in ((k_scale, "k_scale"), (v_scale, "v_scale")):
            if s is not None and _scale_value(s, name) != 1.0:
                raise ValueError(f"{name}={s!r}: pkvrt applies K/V scales only to float8_e4m3fn "
                                 f"caches; this plan's cache is {self._planned['kv_dtype']} (pass "
                                 "None or 1.0, or fold the scale into sm_scale and the output)")
        return {}

    @staticmethod
    def _variant(pos_encoding_mode, window_left, logits_soft_cap, sm_scale, head_dim) -> tuple:
        """A plan's attention variant with FlashInfer's defaults filled in (None soft cap: 0;
        None scale: 1/sqrt(head_dim)), for comparing plan() with forward()."""
        return (pos_encoding_mode, int(-1 if window_left is None else window_left),
                float(logits_soft_cap or 0.0),
                float(sm_scale) if sm_scale is not None else 1.0 / math.sqrt(head_dim))

    def forward(self, q: torch.Tensor, paged_kv_cache, pos_encoding_mode: str = "NONE",
                q_scale: float | None = None, k_scale: float | None = None,
                v_scale: float | None = None, window_left: int = -1,
                logits_soft_cap: float | None = None, sm_scale: float | None = None,
                rope_scale: float | None = None, rope_theta: float | None = None):
        """FlashInfer's deprecated run(): as in FlashInfer, its RoPE mode, window, soft cap and
        scale replace the planned ones for this call (SGLang passes the layer's scale and soft
        cap here, not to plan()). pkvrt builds its Runtime for a variant, so a different one
        re-plans the step with the last plan()'s arguments (refused inside a CUDA-graph capture:
        run forward() once before capturing, as engines warm up) and later plans take it."""
        return self._forward(q, paged_kv_cache, pos_encoding_mode, q_scale, k_scale, v_scale,
                             window_left, logits_soft_cap, sm_scale, rope_scale, rope_theta)

    def _forward(self, q, paged_kv_cache, pos_encoding_mode, q_scale, k_scale, v_scale, window_left,
                 logits_soft_cap, sm_scale, rope_scale, rope_theta, *, return_lse: bool = False):
        if self._planned is None:
            raise RuntimeError("forward: plan() must be called before forward()")
        head_dim = self._plan_args[0][5]
        want = dict(pos_encoding_mode=pos_encoding_mode, window_left=window_left,
                    logits_soft_cap=logits_soft_cap, sm_scale=sm_scale)
        wv = self._variant(pos_encoding_mode, window_left, logits_soft_cap, sm_scale, head_dim)
        pv = self._planned["variant"]
        if not (wv[:3] == pv[:3] and math.isclose(wv[3], pv[3], rel_tol=1e-6)):
            if torch.cuda.is_available() and torch.cuda.is_current_stream_capturing():
                raise RuntimeError(f"forward: variant {wv} differs from the planned {pv} inside a "
                                   "CUDA-graph capture; call forward() once before capturing")
            prev, self._variant_override = self._variant_override, want
            args, kwargs = self._plan_args
            try:
                self.plan(*args, **kwargs)
            except Exception:
                # a variant the plan refuses is not kept for later plans (they would all fail)
                self._variant_override = prev
                raise
        if self.fallback_reason is not None:
            fi_forward = self._fi.forward_return_lse if return_lse else self._fi.forward
            return fi_forward(q, paged_kv_cache, pos_encoding_mode=pos_encoding_mode,
                              q_scale=q_scale, k_scale=k_scale, v_scale=v_scale,
                              window_left=window_left, logits_soft_cap=logits_soft_cap,
                              sm_scale=sm_scale, rope_scale=rope_scale, rope_theta=rope_theta)
        return self.run(q, paged_kv_cache, q_scale=q_scale, k_scale=k_scale, v_scale=v_scale,
                        return_lse=return_lse)

    def forward_return_lse(self, q: torch.Tensor, paged_kv_cache, pos_encoding_mode: str = "NONE",
                           q_scale: float | None = None, k_scale: float | None = None,
                           v_scale: float | None = None, window_left: int = -1,
                           logits_soft_cap: float | None = None, sm_scale: float | None = None,
                           rope_scale: float | None = None, rope_theta: float | None = None):
        """FlashInfer's deprecated :meth:`forward` returning ``(out, lse)``: the same variant
        rule (a different one re-plans the step)."""
        return self._forward(q, paged_kv_cache, pos_encoding_mode, q_scale, k_scale, v_scale,
                             window_left, logits_soft_cap, sm_scale, rope_scale, rope_theta,
                             return_lse=True)

    def run_return_lse(self, q: torch.Tensor, paged_kv_cache, *args, **kwargs):
        """FlashInfer's ``run(..., return_lse=True)``."""
        return self.run(q, paged_kv_cache, *args, return_lse=True, **kwargs)

    def reset_workspace_buffer(self, float_workspace_buffer: torch.Tensor,
                               int_workspace_buffer: torch.Tensor) -> None:
        """FlashInfer's: new workspace buffers (FlashInfer's own wrapper, where it runs a
        fallback, takes them; pkvrt's kernels keep their state in the Runtime's buffers)."""
        for name, t in (("float_workspace_buffer", float_workspace_buffer),
                        ("int_workspace_buffer", int_workspace_buffer)):
            if not isinstance(t, torch.Tensor):
                raise ValueError(f"{name}: expected a torch.Tensor")
        self._workspace, self._int_workspace = float_workspace_buffer, int_workspace_buffer
        if self._fi is not None:
            self._fi.reset_workspace_buffer(float_workspace_buffer, int_workspace_buffer)

    # ------------------------------------------------------------------ engines' FlashInfer habits

    @property
    def begin_forward(self):
        """FlashInfer's alias of :meth:`plan` (SGLang plans through it)."""
        return self._begin_forward

    @begin_forward.setter
    def begin_forward(self, fn) -> None:
        # After capturing, SGLang sets begin_forward = partial(flashinfer.fast_decode_plan, wrapper):
        # FlashInfer's fast plan edits FlashInfer's private plan state, which this wrapper does not
        # have. pkvrt's plan() in CUDA-graph mode is already host work and copies only, so that
        # replacement keeps plan(), taking the host indptr the fast plan is handed.
        if isinstance(fn, functools.partial) and fn.args[:1] == (self,) and \
                getattr(fn.func, "__name__", "") == "fast_decode_plan":
            fn = self._fast_decode_plan
        self._begin_forward = fn

    def _fast_decode_plan(self, indptr, indices, last_page_len, *args,
                          global_override_indptr_cpu=None, **kwargs):
        extra = sorted(set(kwargs) - set(inspect.signature(self.plan).parameters))
        if extra:
            raise TypeError(f"fast_decode_plan: arguments pkvrt's plan() does not take: {extra}")
        host = global_override_indptr_cpu if global_override_indptr_cpu is not None else indptr
        return self.plan(host, indices, last_page_len, *args, **kwargs)

    @property
    def vllm_first_call(self) -> bool:
        """Always True. vLLM's ``fast_plan_decode`` calls ``plan()`` while this is True and
        FlashInfer's fast plan (FlashInfer's private state) after; pkvrt's plan() is its own
        fast path, so every vLLM plan comes to it."""
        return True

    @vllm_first_call.setter
    def vllm_first_call(self, value) -> None:
        pass


class CUDAGraphBatchDecodeWithPagedKVCacheWrapper(BatchDecodeWithPagedKVCacheWrapper):
    """FlashInfer's CUDA-graph decode wrapper: :class:`BatchDecodeWithPagedKVCacheWrapper` with
    ``use_cuda_graph=True`` and the caller's buffers, FlashInfer's constructor arguments."""

    def __init__(self, workspace_buffer: torch.Tensor, indptr_buffer: torch.Tensor,
                 indices_buffer: torch.Tensor, last_page_len_buffer: torch.Tensor,
                 kv_layout: str = "NHD", use_tensor_cores: bool = False, **pkvrt_kwargs):
        super().__init__(workspace_buffer, kv_layout, use_cuda_graph=True,
                         use_tensor_cores=use_tensor_cores, paged_kv_indptr_buffer=indptr_buffer,
                         paged_kv_indices_buffer=indices_buffer,
                         paged_kv_last_page_len_buffer=last_page_len_buffer, **pkvrt_kwargs)
