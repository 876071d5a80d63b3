"""Thin launch wrappers, one per kernel family (kernels/*.cu).

Each checks what is cheap to check (device, dtype, shape, contiguity, supported head dim /
group size / page size), packs pointers and int32s into the kernel's parameter struct and
launches on the current stream. They never allocate, synchronize or read device values: they
are what a captured CUDA graph records. O(batch * pages) checks (page ids in range) belong to
the Runtime's validate mode, not here.
"""

from __future__ import annotations

import ctypes
import math
import os

import torch

from pkvrt import _buildspec
from pkvrt.launch import _driver

_DTYPES = {torch.float16: "f16", torch.bfloat16: "bf16"}
FP8 = torch.float8_e4m3fn
KV_TAG = {FP8: "e4m3"}   # K/V dtypes other than q's -> _buildspec.KV_TAGS tag
THREADS = _buildspec.TUNING["PKV_THREADS"]
TRACE_MARKS = 4   # columns of a timeline buffer: kernels/decode_common.cuh kTraceMarks (enter, waited, done, decoded)
LOG2E = 1.4426950408889634


class PreparedLaunch(_driver.Launcher):
    """A launch whose arguments were checked and packed once (``prepare=True``): calling it
    launches the same kernel, grid and packed struct again on torch's current stream (read at the
    call, so a capture records it; :class:`_driver.Launcher`). What it packed are the tensors'
    addresses, not their values: the caller keeps those tensors alive and calls it only while
    they are the ones it was prepared with (a temporary it made itself it keeps alive). The
    kernel handle is the CUDA context's that was current at preparation: call it with the same
    device current (another one's launch fails in the driver, naming the kernel)."""

    __slots__ = ("_keep",)

    def __init__(self, kernel, grid: tuple[int, int, int], block: int, params: ctypes.Structure, keep: tuple):
        super().__init__(kernel, grid, block, params)
        self._keep = keep


class KernelArgumentError(ValueError):
    """A kernel argument has the wrong dtype, shape, device or layout."""


class DecodeParams(ctypes.Structure):
    """Mirror of pkv::DecodeParams in kernels/decode_common.cuh (same order and types)."""
    _fields_ = [
        ("q", ctypes.c_void_p), ("k_cache", ctypes.c_void_p), ("v_cache", ctypes.c_void_p),
        ("out", ctypes.c_void_p), ("part_a", ctypes.c_void_p), ("part_ml", ctypes.c_void_p),
        ("seq_lens", ctypes.c_void_p), ("block_tables", ctypes.c_void_p),
        ("row_ids", ctypes.c_void_p), ("tasks", ctypes.c_void_p), ("num_tasks", ctypes.c_void_p),
        ("split_offsets", ctypes.c_void_p), ("counters", ctypes.c_void_p),
        ("k_page_stride", ctypes.c_longlong), ("k_head_stride", ctypes.c_longlong),
        ("v_page_stride", ctypes.c_longlong), ("v_head_stride", ctypes.c_longlong),
        ("num_qo_heads", ctypes.c_int), ("num_kv_heads", ctypes.c_int),
        ("page_size_log2", ctypes.c_int), ("bt_stride", ctypes.c_int),
        ("num_splits", ctypes.c_int), ("sm_scale_log2", ctypes.c_float), ("early_kv", ctypes.c_int),
        ("trace", ctypes.c_void_p), ("k_scale", ctypes.c_void_p), ("v_scale", ctypes.c_void_p),
        ("k_scale_per_head", ctypes.c_int), ("v_scale_per_head", ctypes.c_int),
        ("k_tok_stride", ctypes.c_int), ("v_tok_stride", ctypes.c_int),
        ("group", ctypes.c_int), ("window_left", ctypes.c_int),
        ("softcap_scale", ctypes.c_float), ("softcap_log2", ctypes.c_float),
        ("sinks", ctypes.c_void_p), ("lse", ctypes.c_void_p),
        ("group_counters", ctypes.c_void_p), ("merge_groups_from", ctypes.c_int),
    ]


class MergeParams(ctypes.Structure):
    """Mirror of MergeParams in kernels/merge.cu."""
    _fields_ = [
        ("part_a", ctypes.c_void_p), ("part_ml", ctypes.c_void_p),
        ("split_offsets", ctypes.c_void_p), ("row_ids", ctypes.c_void_p), ("out", ctypes.c_void_p),
        ("num_qo_heads", ctypes.c_int), ("skip_single", ctypes.c_int), ("trace", ctypes.c_void_p),
        ("early_trigger", ctypes.c_int), ("sinks", ctypes.c_void_p), ("lse", ctypes.c_void_p),
    ]


# The merge lets the next kernel's CTAs become resident before its own PDL wait (they still
# wait for the whole merge at theirs): a workqueue step's next decode then issues its early K/V
# copies while this layer's decode runs (benches/NOTES.md, the merge). PKVRT_MERGE_TRIGGER=0:
# after the wait, as before (the ablation); read once per process.
_MERGE_EARLY_TRIGGER = int(os.environ.get("PKVRT_MERGE_TRIGGER", "1") != "0")


def _tuning() -> dict:
    """The tuning constants the loaded cubins were built with (their manifest: a PKVRT_TUNE
    variant in PKVRT_CUBIN_DIR may differ from the shipped ones), else _buildspec.TUNING."""
    try:
        return {**_buildspec.TUNING, **_driver.manifest().tuning}
    except Exception:  # noqa: BLE001 - no cubins here (CPU-only package): the shipped constants
        return _buildspec.TUNING


def decode_smem_bytes(head_dim: int, group: int, kv_bytes: int = 2) -> int:
    """Dynamic shared memory of a decode CTA; mirrors pkv::smem_bytes<D, GC, KV>()
    (decode_common.cuh) for the group capacity GC that serves ``group``: the larger of the
    pipeline, 4 warps x tc_stages x (K + V) x 16 tokens x row x kv_bytes (D=128: 3 * 4 * 2 * 16
    * 128 * 2 = 96 KB; e4m3, kv_bytes 1: twice the stages, the same 96 KB; a row is D elements,
    D + 8 at D = 96), and the states at the end, GC x (D + 2) x 4 bytes per warp (the wide body
    of GC > 16, whose warps share the stages: GC x (D + 2) x 4 in all)."""
    t = _tuning()
    stages = (t["PKV_TC_STAGES_D256"] if head_dim >= 256 else t["PKV_TC_STAGES"]) * (2 if kv_bytes == 1 else 1)
    row = head_dim if head_dim & (head_dim - 1) == 0 else head_dim + 8
    warps = t["PKV_THREADS"] // 32
    pipe = stages * warps * 2 * 16 * row * kv_bytes
    gc = _buildspec.group_class(group)
    return max(pipe, (1 if gc > 16 else warps) * gc * (head_dim + 2) * 4)


def decode_occupancy(family: str, dtype: torch.dtype, head_dim: int, group: int,
                     kv_dtype: torch.dtype | None = None) -> int:
    """Decode CTAs of ``family`` (``workqueue_decode``, ``fused_decode``, ``split_decode``)
    resident per SM for this shape: the driver's occupancy query of the kernel this shape
    launches, with its block size and dynamic shared memory (registers and shared memory grow
    with D: on the H200 two CTAs at D 128, one at D 256). Loads the kernel."""
    kv = dtype if kv_dtype is None else kv_dtype
    sym = _buildspec.symbol(family, _DTYPES[dtype], head_dim, group, KV_TAG.get(kv))
    kernel = _driver.get_kernel(family, sym, decode_smem_bytes(head_dim, group, kv.itemsize))
    return _driver.occupancy(kernel, THREADS)


def _fail(name: str, expected: str, got) -> None:
    raise KernelArgumentError(f"{name}: expected {expected}, got {got}")


def _int32(name: str, t: torch.Tensor, device, ndim: int) -> int:
    if t.dtype != torch.int32 or t.device != device or t.dim() != ndim or not t.is_contiguous():
        _fail(name, f"a contiguous int32 tensor with {ndim} dims on {device}",
              f"{t.dtype} {tuple(t.shape)} on {t.device}{'' if t.is_contiguous() else ' (strided)'}")
    return t.data_ptr()


def _split_pin(t, device) -> int:
    """The address of a split count handed from one kernel to the next (int32 [1] on ``device``:
    find_shared writes it, the planning kernel reads it)."""
    if not isinstance(t, torch.Tensor) or tuple(t.shape) != (1,):
        _fail("split_pin", f"an int32 [1] tensor on {device}",
              t if not isinstance(t, torch.Tensor) else tuple(t.shape))
    return _int32("split_pin", t, device, 1)


def check_attention_args(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                         out: torch.Tensor, k_scale=None, v_scale=None
                         ) -> tuple[str, str | None, int, int, int]:
    """Validate the tensors shared by every decode launch, the K/V scales included
    (:func:`check_kv_scales`, metadata only, first: a scale problem is the first thing said).
    The caches are indexed [page, KV head, token, D] with any strides whose token rows are
    contiguous and 16-byte aligned (an NHD cache is passed as ``cache.transpose(1, 2)``; K and V
    may be views of one tensor). Returns (q dtype tag, K/V dtype tag or None for K/V of q's
    dtype, D, G, log2 page)."""
    check_kv_scales(k_cache, v_cache, k_scale, v_scale, q=q, out=out)
    if q.dtype not in _DTYPES:
        _fail("q", "dtype float16 or bfloat16", q.dtype)
    if not q.is_cuda:
        _fail("q", "a CUDA tensor", q.device)
    if q.dim() != 3 or not q.is_contiguous():
        _fail("q", "a contiguous [B, H_q, D] tensor", f"shape {tuple(q.shape)}")
    for name, t in (("q", q), ("out", out)):   # read and written 16 bytes at a time
        if t.data_ptr() % 16:
            _fail(name, "a 16-byte aligned tensor", f"address {t.data_ptr():#x}")
    _, hq, d = q.shape
    if d not in _buildspec.HEAD_DIMS:
        _fail("q", f"head_dim in {_buildspec.HEAD_DIMS}", d)
    kv_tag = KV_TAG.get(k_cache.dtype)
    per16 = 16 // k_cache.element_size()   # elements per 16 bytes
    for name, c in (("k_cache", k_cache), ("v_cache", v_cache)):
        if (c.dtype != q.dtype and c.dtype not in KV_TAG) or c.device != q.device:
            _fail(name, f"{q.dtype} (like q) or float8_e4m3fn on {q.device}", f"{c.dtype} on {c.device}")
        if c.dim() != 4 or c.shape[3] != d or c.stride(3) != 1:
            _fail(name, f"[num_pages, H_kv, page_size, {d}] (as indexed) with contiguous token rows",
                  f"shape {tuple(c.shape)} strides {c.stride()}")
        # (a dimension of size 1 is never stepped over: its stride does not matter)
        if c.data_ptr() % 16 or any(c.stride(i) % per16 for i in range(3) if c.shape[i] > 1):
            _fail(name, "16-byte aligned pages, heads and token rows", f"strides {c.stride()}")
        if c.stride(2) * c.shape[2] >= 2**31:
            _fail(name, "a page of fewer than 2^31 elements between its first and last token row",
                  f"strides {c.stride()}")
    if k_cache.shape != v_cache.shape:
        _fail("v_cache", f"the shape of k_cache {tuple(k_cache.shape)}", tuple(v_cache.shape))
    hkv, page = k_cache.shape[1], k_cache.shape[2]
    if hq % hkv:
        _fail("q", f"H_q a multiple of H_kv={hkv}", hq)
    g = hq // hkv
    if (why := _buildspec.unserved(d, g, kv_tag)) is not None:
        _fail("q/k_cache", "a shape the decode kernels serve", why)
    if page not in _buildspec.PAGE_SIZES:
        _fail("k_cache", f"page_size in {_buildspec.PAGE_SIZES}", page)
    if out.dtype != q.dtype or out.device != q.device or not out.is_contiguous() or out.dim() != 3 \
            or out.shape[1:] != q.shape[1:]:
        _fail("out", f"a contiguous {q.dtype} [*, {hq}, {d}] tensor on {q.device}",
              f"{out.dtype} {tuple(out.shape)} on {out.device}")
    return _DTYPES[q.dtype], kv_tag, d, g, int(math.log2(page))


def _check_sinks_lse(p, out: torch.Tensor, sinks, lse, lse_rows: int | None = None) -> None:
    """sinks (None or a contiguous float32 [H_q] tensor on out's device) and lse (None or a
    contiguous float32 [rows, H_q] tensor there, rows = out's batch, or >= lse_rows) into p."""
    hq, rows = out.shape[1], out.shape[0]
    if sinks is not None:
        if sinks.dtype != torch.float32 or sinks.device != out.device or tuple(sinks.shape) != (hq,) \
                or not sinks.is_contiguous():
            _fail("sinks", f"a contiguous float32 [{hq}] tensor on {out.device}",
                  f"{sinks.dtype} {tuple(sinks.shape)} on {sinks.device}")
        p.sinks = sinks.data_ptr()
    if lse is not None:
        want = rows if lse_rows is None else lse_rows
        if lse.dtype != torch.float32 or lse.device != out.device or lse.dim() != 2 \
                or lse.shape[1] != hq or lse.shape[0] < want or not lse.is_contiguous():
            _fail("lse", f"a contiguous float32 [{want}, {hq}] tensor on {out.device}",
                  f"{lse.dtype} {tuple(lse.shape)} on {lse.device}")
        p.lse = lse.data_ptr()


def _variant_params(p, q: torch.Tensor, *, window_left: int, logits_soft_cap: float, sm_scale,
                    sinks, lse, lse_rows: int) -> None:
    """The attention variant's fields of a DecodeParams (checked): window_left (-1 or >= 0),
    the soft cap (0: none; cap * tanh(score / cap) otherwise), sinks and lse
    (:func:`_check_sinks_lse`)."""
    if isinstance(window_left, bool) or not isinstance(window_left, int) or not -1 <= window_left < 2**31:
        _fail("window_left", "-1 (no window) or an int in [0, 2**31)", window_left)
    p.window_left = window_left
    cap = float(logits_soft_cap or 0.0)
    if not math.isfinite(cap) or cap < 0:
        _fail("logits_soft_cap", "0 (none) or a finite cap > 0", logits_soft_cap)
    if cap > 0:
        scale = sm_scale if sm_scale is not None else 1.0 / math.sqrt(q.shape[2])
        p.softcap_scale, p.softcap_log2 = scale / cap, cap * LOG2E
    _check_sinks_lse(p, q, sinks, lse, lse_rows)


def check_kv_scales(k_cache: torch.Tensor, v_cache: torch.Tensor, k_scale, v_scale, *,
                    q: torch.Tensor | None = None, out: torch.Tensor | None = None,
                    check_values: bool = False) -> bool:
    """Validate the KV dtype and its dequantization scales; returns True for FP8 K/V.

    k_cache, v_cache [P, H_kv, page, D], one dtype: float16 / bfloat16 (``k_scale`` and
    ``v_scale`` must be None) or float8_e4m3fn (both required: contiguous float32 [1] (per
    tensor) or [H_kv] (per KV head) on the caches' device; q and out, when given, float16 or
    bfloat16). Scales are device tensors so that a replayed CUDA graph reads new values without
    re-capture.

    check_values : also require every scale finite and > 0. That reads the scales back (a
    device sync, one ``.item()``), so it is for validate modes (``Runtime(validate=True)``,
    once per scale tensor and version: :meth:`pkvrt.runtime.Runtime.run`), never for a launch
    wrapper or a captured region; without it only metadata is read. Every launch wrapper here
    calls it without values, before it builds any launch.

    Raises KernelArgumentError (a ValueError) naming the argument and what was expected.
    """
    if v_cache.dtype != k_cache.dtype:
        _fail("v_cache", f"the dtype of k_cache ({k_cache.dtype})", v_cache.dtype)
    if k_cache.dtype != FP8:
        for name, s in (("k_scale", k_scale), ("v_scale", v_scale)):
            if s is not None:
                _fail(name, f"None (scales are for float8_e4m3fn caches; these are {k_cache.dtype})",
                      f"a {type(s).__name__}")
        return False
    for name, t in (("q", q), ("out", out)):
        if t is not None and t.dtype not in _DTYPES:
            _fail(name, "float16 or bfloat16 with float8_e4m3fn K/V", t.dtype)
    hkv = k_cache.shape[1] if k_cache.dim() == 4 else None   # a bad cache shape is said later
    want = f"a contiguous float32 [1] or [H_kv={hkv}] tensor on {k_cache.device}"
    for name, s in (("k_scale", k_scale), ("v_scale", v_scale)):
        if not isinstance(s, torch.Tensor):
            _fail(name, want + " (float8_e4m3fn caches need scales)",
                  "None" if s is None else type(s).__name__)
        if s.dtype != torch.float32 or s.device != k_cache.device or s.dim() != 1 \
                or s.shape[0] not in (1, hkv) or not s.is_contiguous():
            _fail(name, want, f"{s.dtype} {tuple(s.shape)} on {s.device}"
                  f"{'' if s.is_contiguous() else ' (strided)'}")
        if check_values and not bool((torch.isfinite(s) & (s > 0)).all().item()):
            _fail(name, "finite scales > 0", s.tolist())
    return True


def _decode_params(q, k_cache, v_cache, out, part_a, part_ml, seq_lens, block_tables,
                   sm_scale, log2_page, k_scale=None, v_scale=None) -> DecodeParams:
    dev = q.device
    p = DecodeParams()
    p.q, p.k_cache, p.v_cache, p.out = q.data_ptr(), k_cache.data_ptr(), v_cache.data_ptr(), out.data_ptr()
    if part_a is not None:
        if part_a.dtype != torch.float32 or part_a.device != dev or not part_a.is_contiguous() \
                or part_a.dim() != 3 or part_a.shape[1:] != q.shape[1:]:
            _fail("part_a", f"contiguous float32 [slots, {q.shape[1]}, {q.shape[2]}] on {dev}",
                  f"{part_a.dtype} {tuple(part_a.shape)}")
        if part_ml.dtype != torch.float32 or part_ml.device != dev or not part_ml.is_contiguous() \
                or tuple(part_ml.shape) != (part_a.shape[0], q.shape[1], 2):
            _fail("part_ml", f"contiguous float32 [{part_a.shape[0]}, {q.shape[1]}, 2] on {dev}",
                  f"{part_ml.dtype} {tuple(part_ml.shape)}")
        p.part_a, p.part_ml = part_a.data_ptr(), part_ml.data_ptr()
    p.seq_lens = _int32("seq_lens", seq_lens, dev, 1)
    p.block_tables = _int32("block_tables", block_tables, dev, 2)
    p.k_page_stride, p.k_head_stride = k_cache.stride(0), k_cache.stride(1)
    p.v_page_stride, p.v_head_stride = v_cache.stride(0), v_cache.stride(1)
    p.k_tok_stride, p.v_tok_stride = k_cache.stride(2), v_cache.stride(2)
    p.num_qo_heads, p.num_kv_heads = q.shape[1], k_cache.shape[1]
    p.group = q.shape[1] // k_cache.shape[1]
    p.window_left = -1
    p.page_size_log2 = log2_page
    p.bt_stride = block_tables.shape[1]
    scale = sm_scale if sm_scale is not None else 1.0 / math.sqrt(q.shape[2])
    p.sm_scale_log2 = scale * LOG2E
    if k_scale is not None:   # checked by check_kv_scales: float32 [1] or [H_kv] each
        p.k_scale, p.v_scale = k_scale.data_ptr(), v_scale.data_ptr()
        p.k_scale_per_head, p.v_scale_per_head = int(k_scale.shape[0] > 1), int(v_scale.shape[0] > 1)
    return p


def split_decode(q, k_cache, v_cache, seq_lens, block_tables, row_ids, num_splits: int, out,
                 part_a=None, part_ml=None, sm_scale: float | None = None, *, k_scale=None,
                 v_scale=None, window_left: int = -1, logits_soft_cap: float = 0.0, sinks=None,
                 lse=None) -> None:
    """Sequence-split decode over the rows ``row_ids`` (one bucket), grid (S, H_kv, rows).

    q [B, H_q, D] fp16/bf16; k_cache, v_cache [P, H_kv, page, D], q's dtype or float8_e4m3fn;
    seq_lens [B] int32; block_tables [B, max_pages] int32; row_ids [R] int32 (batch row per grid
    row, -1 idle); out [B, H_q, D] like q. With num_splits > 1, partial states go to slots r*S + s
    of part_a [>= R*S, H_q, D] / part_ml [>= R*S, H_q, 2] and :func:`merge` must follow.
    k_scale, v_scale: FP8 caches only (required then), float32 [1] (per tensor) or [H_kv] (per KV
    head) device tensors, each independently; read by the kernel at run time (a replayed graph
    sees new values). The partial states are dequantized (``merge`` is the same for every K/V
    dtype).

    Variants: window_left (-1, or each row attends to its last window_left + 1 tokens, its
    splits over that range), logits_soft_cap (0, or cap * tanh(score / cap)), sinks (float32
    [H_q], one logit per head in the softmax denominator) and lse (float32 [B, H_q], each row's
    log2-sum-exp of its scores, written) apply where O is written here (num_splits == 1);
    with more splits pass sinks and lse to :func:`merge`.
    """
    tag, kv_tag, d, g, log2_page = check_attention_args(q, k_cache, v_cache, out, k_scale, v_scale)
    if num_splits < 1:
        _fail("num_splits", ">= 1", num_splits)
    if num_splits > 1 and (part_a is None or part_a.shape[0] < row_ids.shape[0] * num_splits):
        _fail("part_a", f"at least rows*splits = {row_ids.shape[0] * num_splits} slots",
              None if part_a is None else part_a.shape[0])
    p = _decode_params(q, k_cache, v_cache, out, part_a, part_ml, seq_lens, block_tables,
                       sm_scale, log2_page, k_scale, v_scale)
    p.row_ids = _int32("row_ids", row_ids, q.device, 1)
    p.num_splits = num_splits
    _variant_params(p, q, window_left=window_left, logits_soft_cap=logits_soft_cap,
                    sm_scale=sm_scale, sinks=sinks, lse=lse, lse_rows=out.shape[0])
    k = _driver.get_kernel("split_decode", _buildspec.symbol("split_decode", tag, d, g, kv_tag),
                           decode_smem_bytes(d, g, k_cache.element_size()))
    _driver.launch(k, (num_splits, k_cache.shape[1], row_ids.shape[0]), THREADS, p)


def workqueue_decode(q, k_cache, v_cache, seq_lens, block_tables, tasks, num_tasks,
                     split_offsets, out, part_a, part_ml, sm_scale: float | None = None,
                     counters=None, early_kv: bool = False, trace=None, *, k_scale=None,
                     v_scale=None, logits_soft_cap: float = 0.0, sinks=None, lse=None,
                     group_counters=None, merge_groups_from: int = 0) -> None:
    """Compact-workqueue decode, grid (task_capacity,); ``counters`` given = fused variant.

    tasks [capacity, 5] int32 (row, kvh, split, tok_begin, tok_end); num_tasks [1] int32 on the
    device (tasks at or beyond it exit); split_offsets [B+1] int32; partial slots
    split_offsets[row] + split. Rows with one split write O directly. Without ``counters``,
    :func:`merge` with skip_single=True must follow; with counters [B, H_kv] int32 (zeroed
    once, left zero by the kernel) the last CTA of each (row, kvh) merges in-kernel.

    group_counters [>= slots, H_kv] int32 (zeroed once, left zero; slots = part_a's first
    dimension): the fused kernel may merge a (row, kvh) in two levels, groups of
    ceil(sqrt(splits)) consecutive splits first, at G 5-16 and D 96-256 (elsewhere it has one
    level): where its rule says (``merge_groups_from`` 0: at D 96-128 G 13-16 from 9 splits,
    G 5-12 from 33; at D 256 from 5 and 17; kernels/workqueue_task.cuh two_level_tail), or from
    ``merge_groups_from`` >= 2 splits (tests, ablations). Needs ``counters``.

    early_kv (sm_90+, PDL): read the plan and start the first K/V copies before
    waiting for the previous kernel of the stream, which may still be running. Only valid when
    that kernel is not the one writing this plan (tasks, num_tasks, split_offsets, seq_lens,
    block tables): the Runtime sets it for the second and later layers of a step. K/V of a row's
    last token, Q and every output are touched after the wait.

    trace: None or a zeroed int64 [>= capacity, TRACE_MARKS] timeline buffer
    (benches/layer_timeline.py).

    K/V in float8_e4m3fn: k_scale, v_scale as :func:`split_decode`'s.

    logits_soft_cap, sinks, lse: as :func:`split_decode`'s, where O is written here (rows of
    one split; with ``counters`` every row); a sliding window is the planner's (the tasks'
    token ranges). Without counters pass sinks and lse to the :func:`merge` that follows.
    """
    tag, kv_tag, d, g, log2_page = check_attention_args(q, k_cache, v_cache, out, k_scale, v_scale)
    if tasks.dim() != 2 or tasks.shape[1] != 5:
        _fail("tasks", "[capacity, 5] int32", tuple(tasks.shape))
    p = _decode_params(q, k_cache, v_cache, out, part_a, part_ml, seq_lens, block_tables,
                       sm_scale, log2_page, k_scale, v_scale)
    p.tasks = _int32("tasks", tasks, q.device, 2)
    p.num_tasks = _int32("num_tasks", num_tasks, q.device, 1)
    p.split_offsets = _int32("split_offsets", split_offsets, q.device, 1)
    family = "workqueue_decode"
    if counters is not None:
        family = "fused_decode"
        p.counters = _int32("counters", counters, q.device, 2)
        if counters.shape[1] != k_cache.shape[1]:
            _fail("counters", f"[B, H_kv={k_cache.shape[1]}] int32", tuple(counters.shape))
    if group_counters is not None or merge_groups_from:
        if (isinstance(merge_groups_from, bool) or not isinstance(merge_groups_from, int)
                or merge_groups_from == 1 or not 0 <= merge_groups_from < 2**31):
            _fail("merge_groups_from", "0 (the kernel's rule) or an int in [2, 2^31) (splits of a "
                  "(row, KV head) from which the tail merges in two levels)", repr(merge_groups_from))
        if counters is None:
            _fail("group_counters", "the fused kernel's counters beside them (counters=...)", "counters=None")
        if group_counters is None:
            _fail("group_counters", f"a [>= {part_a.shape[0]}, H_kv] int32 tensor with merge_groups_from",
                  "None")
        p.group_counters = _int32("group_counters", group_counters, q.device, 2)
        if group_counters.shape[0] < part_a.shape[0] or group_counters.shape[1] != k_cache.shape[1]:
            _fail("group_counters", f"[>= {part_a.shape[0]} slots, {k_cache.shape[1]} KV heads] int32",
                  tuple(group_counters.shape))
        p.merge_groups_from = merge_groups_from
    p.early_kv = int(bool(early_kv))
    p.trace = _trace(trace, max(1, tasks.shape[0]), q.device)
    _variant_params(p, q, window_left=-1, logits_soft_cap=logits_soft_cap, sm_scale=sm_scale,
                    sinks=sinks, lse=lse, lse_rows=out.shape[0])
    k = _driver.get_kernel(family, _buildspec.symbol(family, tag, d, g, kv_tag),
                           decode_smem_bytes(d, g, k_cache.element_size()))
    _driver.launch(k, (max(1, tasks.shape[0]), 1, 1), THREADS, p)


def _trace(trace, grid_ctas: int, device) -> int:
    """Pointer of a timeline buffer (int64 [>= grid_ctas, TRACE_MARKS], zeroed; see trace_mark in
    kernels/decode_common.cuh), or 0 for none."""
    if trace is None:
        return 0
    if trace.dtype != torch.int64 or trace.device != device or not trace.is_contiguous() \
            or trace.dim() != 2 or trace.shape[1] != TRACE_MARKS or trace.shape[0] < grid_ctas:
        _fail("trace", f"a contiguous int64 [>= {grid_ctas}, {TRACE_MARKS}] tensor on {device}",
              f"{trace.dtype} {tuple(trace.shape)} on {trace.device}")
    return trace.data_ptr()


def merge(part_a, part_ml, split_offsets, out, *, row_ids=None, skip_single: bool = False,
          trace=None, sinks=None, lse=None) -> None:
    """Segmented exact merge, grid (head blocks, rows); rows = split_offsets.numel() - 1.

    part_a [slots, H_q, D] f32; part_ml [slots, H_q, 2] f32; split_offsets [rows+1] int32;
    row_ids [rows] int32 output row per merge row (None: identity; -1: idle); out [B, H_q, D].
    sinks: None or float32 [H_q] attention-sink logits (each head's denominator); lse: None or
    float32 [B, H_q], each merged row's and head's log2-sum-exp (written).
    trace: None or a zeroed int64 [>= grid CTAs, TRACE_MARKS] timeline buffer (benches/layer_timeline.py).
    """
    if out.dtype not in _DTYPES or not out.is_cuda or not out.is_contiguous() or out.dim() != 3:
        _fail("out", "a contiguous CUDA float16/bfloat16 [B, H_q, D] tensor",
              f"{out.dtype} {tuple(out.shape)} on {out.device}")
    _, hq, d = out.shape
    if part_a.dtype != torch.float32 or part_a.shape[1:] != out.shape[1:] or not part_a.is_contiguous():
        _fail("part_a", f"contiguous float32 [slots, {hq}, {d}]", f"{part_a.dtype} {tuple(part_a.shape)}")
    if part_ml.dtype != torch.float32 or tuple(part_ml.shape) != (part_a.shape[0], hq, 2):
        _fail("part_ml", f"float32 [{part_a.shape[0]}, {hq}, 2]", f"{part_ml.dtype} {tuple(part_ml.shape)}")
    p = MergeParams()
    p.part_a, p.part_ml, p.out = part_a.data_ptr(), part_ml.data_ptr(), out.data_ptr()
    p.split_offsets = _int32("split_offsets", split_offsets, out.device, 1)
    rows = split_offsets.shape[0] - 1
    if row_ids is not None:
        p.row_ids = _int32("row_ids", row_ids, out.device, 1)
        if row_ids.shape[0] != rows:
            _fail("row_ids", f"{rows} entries (split_offsets has {rows + 1})", row_ids.shape[0])
    if rows <= 0:
        return
    p.num_qo_heads, p.skip_single = hq, int(skip_single)
    p.early_trigger = _MERGE_EARLY_TRIGGER
    _check_sinks_lse(p, out, sinks, lse)
    heads_per_cta = THREADS // 32  # one warp per head (kernels/merge.cu)
    grid = ((hq + heads_per_cta - 1) // heads_per_cta, rows, 1)
    p.trace = _trace(trace, grid[0] * grid[1], out.device)
    k = _driver.get_kernel("merge", _buildspec.symbol("merge", _DTYPES[out.dtype], d))
    _driver.launch(k, grid, THREADS, p)


def workqueue_tensors(plan, *, num_qo_heads: int, head_dim: int, device="cuda"):
    """A host WorkqueuePlan as the device tensors :func:`workqueue_decode` and :func:`merge`
    take: ``(tasks [T, 5], num_tasks [1], split_offsets [B+1])`` int32 and the partial-state
    buffers ``(part_a [slots, H_q, D], part_ml [slots, H_q, 2])`` float32 (uninitialised)."""
    i32 = dict(dtype=torch.int32, device=device)
    slots = int(plan.split_offsets[-1])
    return (torch.as_tensor(plan.tasks, **i32), torch.tensor([len(plan.tasks)], **i32),
            torch.as_tensor(plan.split_offsets, **i32),
            torch.empty(slots, num_qo_heads, head_dim, device=device),
            torch.empty(slots, num_qo_heads, 2, device=device))


class SegmentParams(ctypes.Structure):
    """Mirror of SegmentParams in kernels/merge.cu."""
    _fields_ = [
        ("out_a", ctypes.c_void_p), ("lse_a", ctypes.c_void_p), ("out_b", ctypes.c_void_p),
        ("lse_b", ctypes.c_void_p), ("slots", ctypes.c_void_p), ("out", ctypes.c_void_p),
        ("sinks", ctypes.c_void_p), ("lse", ctypes.c_void_p), ("num_qo_heads", ctypes.c_int),
        ("group", ctypes.c_int), ("chunk_rows", ctypes.c_int), ("slots_a", ctypes.c_int),
        ("slots_b", ctypes.c_int), ("k", ctypes.c_int),
    ]


def merge_segments(out_a, lse_a, out_b, lse_b, slots, out, *, group: int, chunk_rows: int,
                   sinks=None, lse=None) -> None:
    """Exact merge of each row's segment states from two decodes (kernels/merge.cu,
    merge_segments): out_a [Va, H_kv * C * G, D] / lse_a [Va, H_kv * C * G] the chunk states
    (chunk v's row c holds head hk * G + j at hk * C * G + c * G + j), out_b [Sb, H_q, D] / lse_b
    [Sb, H_q] the own states, slots int64 [B, K] (< Va * C: a chunk's row; < Va * C + Sb: an own
    state; negative or above: none), out [B, H_q, D]; sinks None or float32 [H_q]; lse None or float32 [B,
    H_q] (written). One launch, grid (head blocks, B)."""
    if out.dtype not in _DTYPES or not out.is_cuda or not out.is_contiguous() or out.dim() != 3:
        _fail("out", "a contiguous CUDA float16/bfloat16 [B, H_q, D] tensor",
              f"{out.dtype} {tuple(out.shape)} on {out.device}")
    b, hq, d = out.shape
    if group < 1 or hq % group or chunk_rows < 1:
        _fail("group/chunk_rows", f"G dividing H_q = {hq} and C >= 1", (group, chunk_rows))
    ha = hq * chunk_rows
    for name, t, shape in (("out_a", out_a, (None, ha, d)), ("out_b", out_b, (None, hq, d))):
        if t.dtype != out.dtype or t.device != out.device or not t.is_contiguous() or t.dim() != 3 \
                or tuple(t.shape[1:]) != shape[1:]:
            _fail(name, f"a contiguous {out.dtype} [n, {shape[1]}, {d}] tensor on {out.device}",
                  f"{t.dtype} {tuple(t.shape)} on {t.device}")
    for name, t, src in (("lse_a", lse_a, out_a), ("lse_b", lse_b, out_b)):
        if t.dtype != torch.float32 or t.device != out.device or not t.is_contiguous() \
                or tuple(t.shape) != tuple(src.shape[:2]):
            _fail(name, f"a contiguous float32 {list(src.shape[:2])} tensor on {out.device}",
                  f"{t.dtype} {tuple(t.shape)} on {t.device}")
    if slots.dtype != torch.int64 or slots.device != out.device or slots.dim() != 2 \
            or slots.shape[0] != b or not slots.is_contiguous():
        _fail("slots", f"a contiguous int64 [{b}, K] tensor on {out.device}",
              f"{slots.dtype} {tuple(slots.shape)} on {slots.device}")
    p = SegmentParams()
    p.out_a, p.lse_a, p.out_b, p.lse_b = out_a.data_ptr(), lse_a.data_ptr(), out_b.data_ptr(), lse_b.data_ptr()
    p.slots, p.out = slots.data_ptr(), out.data_ptr()
    p.num_qo_heads, p.group, p.chunk_rows = hq, group, chunk_rows
    p.slots_a, p.slots_b, p.k = out_a.shape[0] * chunk_rows, out_b.shape[0], slots.shape[1]
    _check_sinks_lse(p, out, sinks, lse)
    if b == 0:
        return
    heads_per_cta = THREADS // 32
    grid = ((hq + heads_per_cta - 1) // heads_per_cta, b, 1)
    name = f"pkv_merge_segments_{_DTYPES[out.dtype]}_d{d}"   # merge.cu's second kernel (_buildspec.symbols)
    _driver.launch(_driver.get_kernel("merge", name), grid, THREADS, p)


class PlanParams(ctypes.Structure):
    """Mirror of PlanParams in kernels/plan_workqueue.cu."""
    _fields_ = [
        ("seq_lens", ctypes.c_void_p), ("num_rows", ctypes.c_void_p),
        ("max_seq_len", ctypes.c_void_p), ("tasks", ctypes.c_void_p),
        ("num_tasks", ctypes.c_void_p), ("split_offsets", ctypes.c_void_p),
        ("num_splits", ctypes.c_void_p), ("status", ctypes.c_void_p),
        ("candidates", ctypes.c_void_p), ("num_candidates", ctypes.c_int),
        ("max_rows", ctypes.c_int), ("num_kv_heads", ctypes.c_int),
        ("min_split_tiles", ctypes.c_int), ("tile_tokens", ctypes.c_int),
        ("task_capacity", ctypes.c_int), ("sms", ctypes.c_int), ("resident", ctypes.c_int),
        ("slowdown8", ctypes.c_int), ("overhead8", ctypes.c_int), ("max_ctas", ctypes.c_int),
        ("block_tables", ctypes.c_void_p), ("num_pages", ctypes.c_void_p),
        ("bt_stride", ctypes.c_int), ("page_size_log2", ctypes.c_int),
        ("src_seq_lens", ctypes.c_void_p), ("src_block_tables", ctypes.c_void_p),
        ("src_bt_stride", ctypes.c_int), ("rows", ctypes.c_int), ("max_seq", ctypes.c_int),
        ("free_slots", ctypes.c_int), ("room_slots", ctypes.c_int), ("room8", ctypes.c_int),
        ("room_chunk", ctypes.c_int), ("window_left", ctypes.c_int),
        ("src_indptr", ctypes.c_void_p), ("src_last_page_len", ctypes.c_void_p),
        ("src_indices_len", ctypes.c_int), ("split_pin", ctypes.c_void_p),
    ]


PLAN_MAX_ROWS = 1024
MAX_SEQ_LEN = 2**31 - 1 - _buildspec.TILE_TOKENS   # int32 lengths; len + tile - 1 must not overflow


def check_plan_direct_args(max_rows: int, block_tables, page_size, src_seq_lens, src_block_tables,
                           rows, max_seq, src_indptr=None, src_last_page_len=None) -> bool:
    """The direct-mode arguments of :func:`plan_workqueue_device` (shapes and values only; dtype
    and device are checked with the pointers). Returns True in direct mode (``rows`` and
    ``max_seq`` given), False when none of the four is given; raises KernelArgumentError naming
    the argument otherwise: ``rows``/``max_seq`` come together and with every ``src_*``,
    ``src_seq_lens`` holds at least ``rows`` lengths, ``src_block_tables`` comes with
    ``block_tables`` and both hold ``rows`` rows of at least ``max_seq / page_size`` entries.
    CSR direct mode: ``src_indptr`` [>= rows + 1] and ``src_last_page_len`` [>= rows] come
    together, with ``src_block_tables`` the 1-D indices (fewer than 2**31) and without
    ``src_seq_lens``; ``block_tables`` holds ``rows`` rows of ``max_seq / page_size`` entries."""
    if (src_indptr is None) != (src_last_page_len is None):
        _fail("src_indptr/src_last_page_len", "both given (CSR direct mode) or neither",
              (src_indptr is None, src_last_page_len is None))
    if src_indptr is not None:
        if rows is None or max_seq is None:
            _fail("rows/max_seq", "both given with src_indptr (CSR direct mode)", (rows, max_seq))
        if src_seq_lens is not None:
            _fail("src_seq_lens", "not given with src_indptr (the lengths come from the CSR)", "given")
        if src_block_tables is None or src_block_tables.dim() != 1 or src_block_tables.shape[0] >= 2**31:
            _fail("src_block_tables", "the CSR's page indices, 1-D, fewer than 2**31 entries (with src_indptr)",
                  None if src_block_tables is None else tuple(src_block_tables.shape))
        if block_tables is None or page_size is None:
            _fail("src_indptr", "given with block_tables and page_size", None)
    if rows is None and max_seq is None:
        if src_seq_lens is not None or src_block_tables is not None:
            _fail("rows/max_seq", "both given with src_seq_lens / src_block_tables (direct mode)",
                  (rows, max_seq))
        return False
    if isinstance(rows, bool) or not isinstance(rows, int) or not 0 <= rows <= max_rows:
        _fail("rows", f"an int in [0, {max_rows}] (with max_seq)", rows)
    if isinstance(max_seq, bool) or not isinstance(max_seq, int) or not 1 <= max_seq <= MAX_SEQ_LEN:
        _fail("max_seq", f"an int in [1, {MAX_SEQ_LEN}] (with rows)", max_seq)
    if src_seq_lens is not None and (src_seq_lens.dim() != 1 or src_seq_lens.shape[0] < rows):
        _fail("src_seq_lens", f"[>= rows = {rows}] int32", tuple(src_seq_lens.shape))
    if src_indptr is not None:
        if src_indptr.dim() != 1 or src_indptr.shape[0] < rows + 1:
            _fail("src_indptr", f"[>= rows + 1 = {rows + 1}] int32", tuple(src_indptr.shape))
        if src_last_page_len.dim() != 1 or src_last_page_len.shape[0] < rows:
            _fail("src_last_page_len", f"[>= rows = {rows}] int32", tuple(src_last_page_len.shape))
        cols = -(-max_seq // page_size)
        if block_tables.shape[1] < cols:
            _fail("block_tables", f"[.., >= {cols}] (max_seq / page_size columns)", tuple(block_tables.shape))
    elif src_block_tables is not None:
        if block_tables is None or page_size is None:
            _fail("src_block_tables", "given with block_tables and page_size", None)
        cols = -(-max_seq // page_size)
        if (src_block_tables.dim() != 2 or src_block_tables.shape[0] < rows
                or src_block_tables.shape[1] < cols or block_tables.shape[1] < cols):
            _fail("src_block_tables", f"[>= {rows}, >= {cols}] int32 (max_seq / page_size columns, "
                  f"and block_tables [.., {block_tables.shape[1]}] as wide)", tuple(src_block_tables.shape))
    return True


def plan_workqueue_device(seq_lens, num_rows, tasks, num_tasks, split_offsets, num_splits,
                          status, candidates, *, num_kv_heads: int, min_split_tiles: int,
                          sms: int, resident: int, slowdown8: int, overhead8: int, max_ctas: int,
                          free_slots: int = 0, room_slots: int = 0, room8: int = 0, room_chunk: int = 0,
                          max_seq_len=None, block_tables=None, num_pages=None,
                          page_size: int | None = None, src_seq_lens=None, src_block_tables=None,
                          rows: int | None = None, max_seq: int | None = None,
                          window_left: int = -1, src_indptr=None, src_last_page_len=None,
                          split_pin=None, prepare: bool = False) -> PreparedLaunch | None:
    """Build the workqueue plan on the GPU (kernels/plan_workqueue.cu), one CTA.

    seq_lens [max_rows] int32 (device); num_rows [1] int32 (device: active rows); max_seq_len
    [1] int32 (device; None: MAX_SEQ_LEN, through a temporary tensor);
    tasks [capacity, 5]; num_tasks [1]; split_offsets [max_rows+1]; num_splits [max_rows];
    status [1] int32, written every launch: bit 0 = the plan needs more than capacity tasks
    (num_tasks clamped), bit 1 = an active row's seq_len is outside [0, max_seq_len] (0: an idle row), bit 2 =
    an active row's block table holds a page id outside [0, num_pages) among the entries its
    length uses (either way that row gets no split: nothing reads its block table or the cache
    for it, nor writes its output). Page ids are checked when ``block_tables`` [>= max_rows,
    W] int32 (device, row-contiguous), ``num_pages`` [1] int32 (device; 0 = unchecked) and
    ``page_size`` are given. candidates [n] int32,
    the allowed split counts ascending (SplitBounds.candidates()). Same split rule as
    pkvrt.policy.planner.balanced_partition; sms, resident, slowdown8, overhead8, max_ctas,
    free_slots, room_slots, room8 and room_chunk are ``planner.device_plan_targets(cal,
    route.kind)`` (free_slots: the one-row preference of ``planner.partition_choice``, 0 = none;
    room_*: the last wave's room charge, ``PartitionModel.room_charge``, 0 = none).

    Direct mode (an engine's captured step: no copy or fill launch before the planning kernel):
    ``rows`` (active rows; num_rows is not read) and ``max_seq`` (the longest valid seq_len;
    max_seq_len is not read) as integers, ``src_seq_lens`` [>= rows] int32 (device) copied by the
    kernel into seq_lens, and ``src_block_tables`` [>= rows, >= max_seq / page_size] int32
    (device, contiguous): the entries each valid length uses are copied into block_tables
    (which must be given); :func:`check_plan_direct_args`. ``candidates`` are read before the
    kernel's PDL wait: they must not be written by the kernel just before it in the stream.
    CSR direct mode (a FlashInfer-style step on the GPU, the drop-in wrapper's CUDA-graph mode):
    ``src_indptr`` [>= rows + 1], ``src_last_page_len`` [>= rows] and ``src_block_tables`` the
    1-D page indices, int32 on the device, instead of ``src_seq_lens``: the kernel writes each
    row's length, (pages - 1) * page_size + last_page_len (0 for a row of no pages, an engine's
    padding), into seq_lens and its pages into block_tables; an indptr that decreases, starts
    below 0 or ends past the indices, or a last_page_len outside [1, page_size], is a bad
    length (status bit 1: no work for that row; nothing is read past the indices).

    window_left: -1, or each row attends to its last window_left + 1 tokens: the plan covers
    that range (its tasks' token ranges start there; only its block-table entries are checked
    and copied), as ``planner.plan_workqueue(..., window_left=)``.

    split_pin: None, or [1] int32 (device) read after the kernel's PDL wait: a value > 0 replaces
    ``candidates`` with that one split count (written by the kernel before this one in the
    stream: :func:`find_shared`'s time-model cut of a chunk decode).

    prepare: check and pack the arguments, launch nothing, and return a :class:`PreparedLaunch`
    that launches them (a Runtime's plan() of the same buffers every step: the checks and the
    struct once, not per step).
    """
    dev = seq_lens.device
    max_rows = seq_lens.shape[0]
    if max_rows > PLAN_MAX_ROWS:
        _fail("seq_lens", f"at most {PLAN_MAX_ROWS} rows (one planning CTA)", max_rows)
    if split_offsets.shape != (max_rows + 1,) or num_splits.shape != (max_rows,):
        _fail("split_offsets/num_splits", f"[{max_rows + 1}] / [{max_rows}]",
              f"{tuple(split_offsets.shape)} / {tuple(num_splits.shape)}")
    if not 1 <= candidates.shape[0] <= 64:
        _fail("candidates", "1 to 64 allowed split counts", candidates.shape[0])
    if max_seq_len is None:  # a temporary: pass a persistent tensor when capturing a graph
        max_seq_len = torch.full((1,), MAX_SEQ_LEN, dtype=torch.int32, device=dev)
    p = PlanParams()
    p.seq_lens = _int32("seq_lens", seq_lens, dev, 1)
    p.num_rows = _int32("num_rows", num_rows, dev, 1)
    p.max_seq_len = _int32("max_seq_len", max_seq_len, dev, 1)
    p.tasks = _int32("tasks", tasks, dev, 2)
    p.num_tasks = _int32("num_tasks", num_tasks, dev, 1)
    p.split_offsets = _int32("split_offsets", split_offsets, dev, 1)
    p.num_splits = _int32("num_splits", num_splits, dev, 1)
    p.status = _int32("status", status, dev, 1)
    p.candidates = _int32("candidates", candidates, dev, 1)
    p.num_candidates, p.max_rows, p.num_kv_heads = candidates.shape[0], max_rows, num_kv_heads
    p.min_split_tiles, p.tile_tokens = min_split_tiles, _buildspec.TILE_TOKENS
    for name, v, least in (("sms", sms, 1), ("resident", resident, 1), ("slowdown8", slowdown8, 0),
                           ("overhead8", overhead8, 0), ("max_ctas", max_ctas, 1),
                           ("free_slots", free_slots, 0), ("room_slots", room_slots, 0),
                           ("room8", room8, 0), ("room_chunk", room_chunk, 0)):
        if isinstance(v, bool) or not isinstance(v, int) or not least <= v < 2**31:
            _fail(name, f"an integer in [{least}, 2**31)", v)   # c_int would wrap silently
    p.task_capacity, p.sms, p.resident, p.slowdown8 = tasks.shape[0], sms, resident, slowdown8
    p.overhead8, p.max_ctas, p.free_slots = overhead8, max_ctas, free_slots
    p.room_slots, p.room8, p.room_chunk = room_slots, room8, room_chunk
    if isinstance(window_left, bool) or not isinstance(window_left, int) or not -1 <= window_left < 2**31:
        _fail("window_left", "-1 (no window) or an int in [0, 2**31)", window_left)
    p.window_left = window_left
    if split_pin is not None:
        p.split_pin = _split_pin(split_pin, dev)
    if block_tables is not None:
        if num_pages is None or page_size is None:
            _fail("num_pages/page_size", "both given with block_tables", (num_pages, page_size))
        if block_tables.dim() != 2 or block_tables.shape[0] < max_rows or block_tables.stride(1) != 1:
            _fail("block_tables", f"a row-contiguous int32 [>= {max_rows}, W] tensor",
                  tuple(block_tables.shape))
        if isinstance(page_size, bool) or page_size < 1 or page_size & (page_size - 1):
            _fail("page_size", "a power of two", page_size)
        p.block_tables = _int32("block_tables", block_tables, dev, 2)
        p.num_pages = _int32("num_pages", num_pages, dev, 1)
        p.bt_stride, p.page_size_log2 = block_tables.stride(0), page_size.bit_length() - 1
    p.rows, p.max_seq = -1, 0
    if check_plan_direct_args(max_rows, block_tables, page_size, src_seq_lens, src_block_tables,
                              rows, max_seq, src_indptr, src_last_page_len):
        p.rows, p.max_seq = rows, max_seq
        if src_seq_lens is not None:
            p.src_seq_lens = _int32("src_seq_lens", src_seq_lens, dev, 1)
        if src_indptr is not None:
            p.src_indptr = _int32("src_indptr", src_indptr, dev, 1)
            p.src_last_page_len = _int32("src_last_page_len", src_last_page_len, dev, 1)
            p.src_block_tables = _int32("src_block_tables", src_block_tables, dev, 1)
            p.src_indices_len = src_block_tables.shape[0]
        elif src_block_tables is not None:
            p.src_block_tables = _int32("src_block_tables", src_block_tables, dev, 2)
            p.src_bt_stride = src_block_tables.stride(0)
    k = _driver.get_kernel("plan_workqueue", _buildspec.symbol("plan_workqueue"))
    if prepare:
        return PreparedLaunch(k, (1, 1, 1), 1024, p, keep=(max_seq_len,))
    _driver.launch(k, (1, 1, 1), 1024, p)
    return None


class FindSharedParams(ctypes.Structure):
    """Mirror of FindSharedParams in kernels/find_shared.cu."""
    _fields_ = [
        ("seq_lens", ctypes.c_void_p), ("block_tables", ctypes.c_void_p), ("bt_stride", ctypes.c_int),
        ("rows", ctypes.c_int), ("width", ctypes.c_int), ("page_size_log2", ctypes.c_int),
        ("chunk_rows", ctypes.c_int), ("group", ctypes.c_int), ("num_kv_heads", ctypes.c_int),
        ("chunk_seq", ctypes.c_void_p), ("chunk_bt", ctypes.c_void_p), ("own_seq", ctypes.c_void_p),
        ("own_bt", ctypes.c_void_p), ("out_stride", ctypes.c_int), ("q_index", ctypes.c_void_p),
        ("slots", ctypes.c_void_p), ("rule", ctypes.c_int), ("tile_tokens", ctypes.c_int),
        ("sms", ctypes.c_int),
        *[f for m in ("row", "chunk") for f in
          [(f"{m}_candidates", ctypes.c_void_p)]
          + [(f"{m}_{k}", ctypes.c_int) for k in ("num_candidates", "min_split_tiles", "resident",
                                                  "slowdown8", "overhead8", "max_ctas", "free_slots",
                                                  "room_slots", "room8", "room_chunk")]],
        *[(f"{m}_{k}", ctypes.c_double) for m in ("row", "chunk")
          for k in ("read_scale", "depth_us", "tail_us", "split_us", "merge_us", "room_us", "fixed_us")],
        ("token_us", ctypes.c_double), ("l2_saved_us", ctypes.c_double), ("extra_us", ctypes.c_double),
        ("plain_extra_us", ctypes.c_double), ("margin", ctypes.c_double), ("rule_out", ctypes.c_void_p),
        ("split_pin", ctypes.c_void_p), ("model_cut_rows", ctypes.c_int),
        ("chunk_max_tasks", ctypes.c_int), ("model_cut_margin", ctypes.c_double),
    ]


FIND_MAX_ROWS = 1024   # one CTA of 1024 threads, a row each


def find_shared(seq_lens, block_tables, chunk_seq, chunk_bt, own_seq, own_bt, q_index, slots, *,
                page_size: int, chunk_rows: int, group: int, num_kv_heads: int, rule=None,
                candidates=None, rule_out=None, split_pin=None) -> None:
    """The step's shared prefixes, found on the GPU (kernels/find_shared.cu, one CTA): the rule
    of ``pkvrt.policy.sharing.plan_prefix_chunks``, written into fixed-shape buffers.

    seq_lens [B] int32 and block_tables [B, W] int32 (row-contiguous) on the GPU, B <= 1024;
    outputs, on the same device: chunk_seq and own_seq [B] int32, chunk_bt and own_bt [B, W'] int32
    (W' >= W, row-contiguous, the same row stride), q_index int64 [B * H_kv * C * G], slots int64
    [B, 2]. ``chunk_rows`` C (2..64) rows per chunk, ``group`` G, ``num_kv_heads`` H_kv.
    ``rule``: a ``sharing.SharingRule`` (keep the chunks only where it predicts them faster), with
    ``candidates`` the (row, chunk) decodes' allowed split counts as int32 tensors on the device
    (their routes' ``splits.candidates()``); None: keep every chunk found. ``rule_out``: float64
    [6] on the device or None (the decision: plain µs, shared µs, 1 / 0, the re-reads, the chunk
    decode's split count by the time model or 0). ``split_pin``: int32 [1] on the device or None,
    written every launch: the time model's count where the rule's ``model_cut_rows`` is set and
    the step shares on that cut, else 0 (the chunk decode's planning kernel reads it:
    ``plan_workqueue_device(split_pin=)``); required with such a rule, whose cut the kernel
    times only where it can hand the count on."""
    dev = seq_lens.device
    p = FindSharedParams()
    p.seq_lens = _int32("seq_lens", seq_lens, dev, 1)
    b = seq_lens.shape[0]
    if not 1 <= b <= FIND_MAX_ROWS:
        _fail("seq_lens", f"1 to {FIND_MAX_ROWS} rows (one CTA)", b)
    if block_tables.dtype != torch.int32 or block_tables.device != dev or block_tables.dim() != 2 \
            or block_tables.shape[0] != b or block_tables.stride(1) != 1:
        _fail("block_tables", f"a row-contiguous int32 [{b}, W] tensor on {dev}",
              f"{block_tables.dtype} {tuple(block_tables.shape)} on {block_tables.device}")
    w = block_tables.shape[1]
    if isinstance(page_size, bool) or not isinstance(page_size, int) or page_size < 1 \
            or page_size & (page_size - 1) or w * page_size >= 2**31:
        _fail("page_size", "a power of two (W * page_size < 2**31)", page_size)
    for name, v, lo, hi in (("chunk_rows", chunk_rows, 2, 64), ("group", group, 1, 64),
                            ("num_kv_heads", num_kv_heads, 1, 2**16)):
        if isinstance(v, bool) or not isinstance(v, int) or not lo <= v <= hi:
            _fail(name, f"an int in [{lo}, {hi}]", v)
    p.block_tables, p.bt_stride = block_tables.data_ptr(), block_tables.stride(0)
    for name, t in (("chunk_seq", chunk_seq), ("own_seq", own_seq)):
        if t.shape != (b,):
            _fail(name, f"[{b}] int32", tuple(t.shape))
    p.chunk_seq = _int32("chunk_seq", chunk_seq, dev, 1)
    p.own_seq = _int32("own_seq", own_seq, dev, 1)
    for name, t in (("chunk_bt", chunk_bt), ("own_bt", own_bt)):
        if t.dtype != torch.int32 or t.device != dev or t.dim() != 2 or t.shape[0] != b \
                or t.shape[1] < w or t.stride(1) != 1 or t.stride(0) != chunk_bt.stride(0):
            _fail(name, f"a row-contiguous int32 [{b}, >= {w}] tensor on {dev} (chunk_bt's and "
                  "own_bt's row strides equal)", f"{t.dtype} {tuple(t.shape)} on {t.device}")
    p.chunk_bt, p.own_bt, p.out_stride = chunk_bt.data_ptr(), own_bt.data_ptr(), chunk_bt.stride(0)
    n_index = b * num_kv_heads * chunk_rows * group
    for name, t, shape in (("q_index", q_index, (n_index,)), ("slots", slots, (b, 2))):
        if t.dtype != torch.int64 or t.device != dev or tuple(t.shape) != shape or not t.is_contiguous():
            _fail(name, f"a contiguous int64 {list(shape)} tensor on {dev}",
                  f"{t.dtype} {tuple(t.shape)} on {t.device}")
    p.q_index, p.slots = q_index.data_ptr(), slots.data_ptr()
    p.rows, p.width, p.page_size_log2 = b, w, page_size.bit_length() - 1
    p.chunk_rows, p.group, p.num_kv_heads = chunk_rows, group, num_kv_heads
    if rule_out is not None:
        if rule_out.dtype != torch.float64 or rule_out.device != dev or tuple(rule_out.shape) != (6,):
            _fail("rule_out", f"a float64 [6] tensor on {dev}",
                  f"{rule_out.dtype} {tuple(rule_out.shape)} on {rule_out.device}")
        p.rule_out = rule_out.data_ptr()
    if rule is not None:
        fields = rule.kernel_fields()
        for name, value in fields.items():
            setattr(p, name, value)
        if not isinstance(candidates, (tuple, list)) or len(candidates) != 2:
            _fail("candidates", "a (row, chunk) pair of int32 tensors on the device", candidates)
        for which, t in zip(("row", "chunk"), candidates):
            n = fields[f"{which}_num_candidates"]
            if not isinstance(t, torch.Tensor) or t.dtype != torch.int32 or t.device != dev \
                    or tuple(t.shape) != (n,) or not 1 <= n <= 64:
                _fail(f"candidates ({which})", f"an int32 [{n}] tensor on {dev} (1 to 64 split counts)",
                      t if not isinstance(t, torch.Tensor) else f"{t.dtype} {tuple(t.shape)} on {t.device}")
            setattr(p, f"{which}_candidates", t.data_ptr())
    if rule is not None and fields["model_cut_rows"] > 0 and split_pin is None:
        # (the kernel times the chunk decode's cut only where it can hand the count on)
        _fail("split_pin", f"an int32 [1] tensor on {dev} with a rule whose model_cut_rows is set",
              None)
    if split_pin is not None:   # written every launch (0 without a rule or a model cut)
        p.split_pin = _split_pin(split_pin, dev)
    _driver.launch(_driver.get_kernel("find_shared", _buildspec.symbol("find_shared")), (1, 1, 1),
                   FIND_MAX_ROWS, p)
