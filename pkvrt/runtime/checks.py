"""The host checks of a step (``plan()``'s metadata) and of a run (``run()``'s tensors).

Each raises ValueError naming the argument and what was expected, before anything is written:
a step or a run that fails its checks leaves the runtime as it was. O(B) checks guard the
static buffers and always run; the page-id scan (``validate``) is O(B * pages) in one numpy pass.
Device planning checks only shapes, dtypes and devices here; lengths and page ids are checked by
the planning kernel (``Runtime.device_status``).

May import: torch, numpy, attrs, the launch layer (``ops``: the kernels' limits), ``_buildspec``.
"""

from __future__ import annotations

import attrs
import numpy as np
import torch

from pkvrt import _buildspec
from pkvrt.launch import ops

DTYPES = {torch.float16: "f16", torch.bfloat16: "bf16"}
MAX_SEQ_LEN = ops.MAX_SEQ_LEN   # longest row in tokens: int32 lengths, tile arithmetic included
NESTED_CAPTURE = ("Runtime.{}: called during CUDA-graph capture with host lengths and the Runtime's "
                  "own graphs; the step was planned outside your capture, so a replay would run "
                  "a stale plan. Build it with engine_capture=True (plan() outside your capture, "
                  "a graph per Runtime.step_key), or give plan() the lengths on the GPU (device "
                  "planning) and capture plan() with the layers")


KV_LAYOUTS = ("HND", "NHD")


def check_shape(num_qo_heads, num_kv_heads, head_dim, page_size, dtype, kv_dtype=None) -> int:
    """Check an attention shape against the kernels built (``pkvrt/_buildspec.py``); return G.

    Raises ValueError naming the argument: head_dim in (64, 96, 128, 256); page_size a power of
    two <= 128; num_qo_heads a multiple of num_kv_heads with G in 1..64; dtype (q and out)
    fp16/bf16; kv_dtype None (= dtype), dtype or float8_e4m3fn (head dims 64, 128, 256; at 256
    G <= 8: ``_buildspec.unserved``).
    """
    for name, v in (("num_qo_heads", num_qo_heads), ("num_kv_heads", num_kv_heads),
                    ("head_dim", head_dim), ("page_size", page_size)):
        if isinstance(v, bool) or not isinstance(v, (int, np.integer)) or v < 1:
            raise ValueError(f"Runtime: {name}={v!r}: expected a positive integer")
    if head_dim not in _buildspec.HEAD_DIMS:
        raise ValueError(f"Runtime: head_dim={head_dim}: expected one of {_buildspec.HEAD_DIMS} "
                         "(the head dims the kernels are built for)")
    if page_size not in _buildspec.PAGE_SIZES:
        raise ValueError(f"Runtime: page_size={page_size}: expected a power of two <= "
                         f"{_buildspec.MAX_PAGE_SIZE}")
    if num_qo_heads % num_kv_heads:
        raise ValueError(f"Runtime: num_qo_heads={num_qo_heads}: expected a multiple of "
                         f"num_kv_heads={num_kv_heads} (H_q = G * H_kv)")
    g = num_qo_heads // num_kv_heads
    if g not in _buildspec.GROUP_SIZES:
        raise ValueError(f"Runtime: num_qo_heads / num_kv_heads = {g}: expected a group size in "
                         f"{_buildspec.GROUP_SIZES[0]}..{_buildspec.GROUP_SIZES[-1]}")
    if dtype == ops.FP8:
        raise ValueError(f"Runtime: dtype={dtype}: dtype is the dtype of q and out: expected "
                         "torch.float16 or torch.bfloat16; an FP8 KV cache is "
                         "kv_dtype=torch.float8_e4m3fn")
    if dtype not in DTYPES:
        raise ValueError(f"Runtime: dtype={dtype}: expected torch.float16 or torch.bfloat16")
    if kv_dtype is not None and kv_dtype not in (dtype, ops.FP8):
        raise ValueError(f"Runtime: kv_dtype={kv_dtype}: expected None (the dtype, {dtype}) or "
                         "torch.float8_e4m3fn")
    if (why := _buildspec.unserved(head_dim, g, ops.KV_TAG.get(kv_dtype))) is not None:
        raise ValueError(f"Runtime: no decode kernel serves {why}")
    return g


def check_variant(kv_layout, window_left, logits_soft_cap, sinks) -> tuple[str, int, float, bool]:
    """The Runtime's cache layout and attention variant, checked: kv_layout "HND" or "NHD";
    window_left -1 or an int >= 0; logits_soft_cap 0 or a finite number > 0; sinks a bool.
    Raises ValueError naming the argument."""
    if kv_layout not in KV_LAYOUTS:
        raise ValueError(f"Runtime: kv_layout={kv_layout!r}: expected one of {KV_LAYOUTS}")
    if isinstance(window_left, bool) or not isinstance(window_left, (int, np.integer)) or window_left < -1:
        raise ValueError(f"Runtime: window_left={window_left!r}: expected -1 (no window) or an int >= 0 "
                         "(each row attends to its last window_left + 1 tokens)")
    try:
        cap = float(logits_soft_cap)
    except (TypeError, ValueError):
        cap = float("nan")
    if isinstance(logits_soft_cap, bool) or not np.isfinite(cap) or cap < 0:
        raise ValueError(f"Runtime: logits_soft_cap={logits_soft_cap!r}: expected 0 (none) or a "
                         "finite cap > 0")
    if not isinstance(sinks, bool):
        raise ValueError(f"Runtime: sinks={sinks!r}: expected True (every run() takes sinks=) or False")
    return kv_layout, int(window_left), cap, sinks


def hnd_view(cache: torch.Tensor, kv_layout: str) -> torch.Tensor:
    """A cache as the kernels index it, [num_pages, H_kv, page_size, D]: itself (HND), or the
    view ``cache.transpose(1, 2)`` of an NHD cache [num_pages, page_size, H_kv, D] (no copy)."""
    return cache if kv_layout == "HND" or cache.dim() != 4 else cache.transpose(1, 2)


def host_int_array(x, name: str) -> np.ndarray:
    """``x`` (list, numpy array, CPU or CUDA tensor) as a host numpy array, without a copy when
    it is already one (or a CPU tensor). A CUDA tensor costs one synchronizing D2H copy."""
    if isinstance(x, torch.Tensor):
        if x.is_cuda:
            x = x.cpu()  # the host router needs the values: one D2H copy, synchronizing
        return x.numpy()
    a = np.asarray(x)
    if a.dtype == object:
        raise ValueError(f"Runtime.plan: {name}: expected integers, got a ragged or mixed sequence")
    return a


@attrs.frozen(eq=False)
class StepInput:
    """A validated step: seq [B] int64, lens (the same lengths as Python ints), block_tables
    [B, W] (caller's ints), pages (pages each row needs, Python ints), max_pages (their max),
    max_page_id (largest page id in use, or -1 when not validated)."""

    seq: np.ndarray
    lens: list
    block_tables: np.ndarray
    pages: list
    max_pages: int
    max_page_id: int


def check_step(seq_lens, block_tables, *, page_size: int, max_batch: int, max_pages_per_row: int,
               validate: bool = True) -> StepInput:
    """Validate one step's metadata; raise ValueError naming the argument, else a StepInput.

    Always (O(B), they guard the static buffers): 1-D integer seq_lens >= 1, B <= max_batch,
    block_tables [B, W] integer with W >= the pages of the longest row, every row's pages within
    max_pages_per_row. With ``validate``: every page id a row uses (its first
    ceil(seq_len / page_size) entries) is >= 0; padding past them is never read and may be -1.

    The O(B) checks run over the lengths as Python ints (one ``tolist``): on a decode batch (1-64
    rows) a numpy call on a short vector costs more than the whole loop (``plan()``'s host time
    is some dozens of such calls, benches/NOTES.md, host cost).
    """
    seq = host_int_array(seq_lens, "seq_lens")
    if seq.ndim != 1 or seq.size == 0:
        raise ValueError(f"Runtime.plan: seq_lens: expected a non-empty 1-D integer array [B], "
                         f"got shape {seq.shape}")
    if seq.dtype.kind not in "iu":
        raise ValueError(f"Runtime.plan: seq_lens: expected an integer dtype (int32), got {seq.dtype}")
    b = seq.size
    if b > max_batch:
        raise ValueError(f"Runtime.plan: seq_lens: batch of {b} rows: expected at most "
                         f"max_batch={max_batch} (raise Runtime(max_batch=...))")
    lens = seq.tolist()
    low = min(lens)
    if low < 1:
        row = lens.index(low)
        raise ValueError(f"Runtime.plan: seq_lens[{row}] = {low}: expected >= 1 "
                         "(tokens in the cache, the new one included)")
    bt = host_int_array(block_tables, "block_tables")
    if bt.ndim != 2 or bt.shape[0] != b:
        raise ValueError(f"Runtime.plan: block_tables: expected shape [B={b}, max_pages], got "
                         f"{bt.shape}")
    if bt.dtype.kind not in "iu":
        raise ValueError(f"Runtime.plan: block_tables: expected an integer dtype (int32), got {bt.dtype}")
    pages = [-(-n // page_size) for n in lens]
    max_pages = max(pages)
    if max_pages > max_pages_per_row or max_pages > bt.shape[1]:
        row = pages.index(max_pages)
        if max_pages > max_pages_per_row:
            raise ValueError(f"Runtime.plan: seq_lens[{row}] = {lens[row]} needs {max_pages} pages "
                             f"of {page_size} tokens: expected at most "
                             f"max_pages_per_row={max_pages_per_row}")
        raise ValueError(f"Runtime.plan: block_tables: row {row} has seq_len {lens[row]} = "
                         f"{max_pages} pages of {page_size}, but block_tables has only "
                         f"{bt.shape[1]} columns; expected at least {max_pages}")
    max_id = used_page_id_max(bt, pages) if validate else -1
    return StepInput(seq=seq.astype(np.int64, copy=False), lens=lens, block_tables=bt, pages=pages,
                     max_pages=max_pages, max_page_id=max_id)


def used_page_id_max(bt: np.ndarray, pages) -> int:
    """The largest page id the rows use (row r: its first ``pages[r]`` entries of ``bt`` [B, W]);
    ValueError naming the first negative one. Padding past a row's pages is never looked at.

    One pass: the ids are read as unsigned integers of the same width, so a negative id is
    larger than any real one, and ``maximum.reduceat`` over [row start, row start + pages)
    segments of the flat table gives each row's largest id (the segments in between, a row's
    padding, are skipped). ~3x faster than masking the table (B8 32K: 19 vs 51 us per step on
    the dev box). One row is one slice's max."""
    w = bt.shape[1]
    if not isinstance(pages, list):
        pages = np.asarray(pages).tolist()
    if len(pages) == 1:
        used = bt[0, :pages[0]]
        top = int(used.view(f"u{used.itemsize}").max())
    else:
        flat = np.ascontiguousarray(bt).reshape(-1)
        bounds = [x for r, p in enumerate(pages) for x in (r * w, r * w + p)]
        if bounds[-1] == flat.size:    # the last row uses every column: its segment runs to the end
            bounds.pop()
        top = max(np.maximum.reduceat(flat.view(f"u{flat.itemsize}"), bounds).tolist()[0::2])
    if bt.dtype.kind == "u" or top < 1 << (8 * bt.itemsize - 1):
        return top
    mask = np.arange(w) < np.asarray(pages)[:, None]
    r, c = (int(v[0]) for v in np.nonzero((bt < 0) & mask))
    raise ValueError(f"Runtime.plan: block_tables[{r}, {c}] = {bt[r, c]}: expected a page "
                     f"id >= 0 (row {r} uses its first {pages[r]} entries; only entries "
                     "past them may be padding)")


def check_device_step(seq_lens, block_tables, *, device, max_batch: int):
    """Device planning's host checks of a step (O(1): shapes, int32 dtype, devices, never values,
    so nothing synchronizes); raise ValueError naming the argument, else ``(seq_lens,
    block_tables)`` as tensors. Lengths and page ids are checked by the planning kernel
    (Runtime.device_status)."""
    out = []
    for name, x, ndim, what in (("seq_lens", seq_lens, 1, "[B]"),
                                ("block_tables", block_tables, 2, "[B, max_pages]")):
        t = x if isinstance(x, torch.Tensor) else torch.as_tensor(np.asarray(x))
        if t.dtype != torch.int32:  # the kernels' type: a wider one would wrap unchecked
            raise ValueError(f"Runtime.plan: {name}: expected an int32 tensor (on {device} for the "
                             f"fast path), got {t.dtype}")
        if t.device.type != "cpu" and t.device != device:
            raise ValueError(f"Runtime.plan: {name}: expected a tensor on {device} (or the CPU), "
                             f"got {t.device}")
        if t.dim() != ndim or t.numel() == 0:
            raise ValueError(f"Runtime.plan: {name}: expected a non-empty {what} tensor, got shape "
                             f"{tuple(t.shape)}")
        out.append(t)
    seq, bt = out
    b = seq.shape[0]
    if b > max_batch:
        raise ValueError(f"Runtime.plan: seq_lens: batch of {b} rows: expected at most "
                         f"max_batch={max_batch} (raise Runtime(max_batch=...))")
    if bt.shape[0] != b:
        raise ValueError(f"Runtime.plan: block_tables: expected shape [B={b}, max_pages], got "
                         f"{tuple(bt.shape)}")
    return seq, bt


def check_page_bound(max_page_id: int, num_pages: int, *,
                     where: str = "Runtime.run: block_tables (last plan)",
                     bound: str = "num_pages = k_cache.shape[0]") -> None:
    """The step's largest page id (-1: not validated) against the cache's pages; ValueError
    naming ``where`` the ids come from and what the ``bound`` is."""
    if max_page_id >= num_pages:
        raise ValueError(f"{where} uses page id {max_page_id}: expected page ids < {bound} = "
                         f"{num_pages}")


def run_signature(q, k_cache, v_cache, out, k_scale, v_scale, batch: int, sinks=None, lse=None):
    """Everything :func:`check_run_args` reads of its tensors besides the step's page bound, as a
    hashable key (each tensor's ``(data_ptr, shape, strides, dtype)`` and device, ``batch``), or
    None when an argument is not a tensor (the full check then says which). The checks are a
    function of this key and the Runtime's shape, so a key that passed once passes again: run()
    checks each key once (its attribute reads: ~3 us per call on the dev box, per layer; a flat
    tuple measured no faster)."""
    sig = [batch]
    for t in (q, k_cache, v_cache, out, k_scale, v_scale, sinks, lse):
        if t is None:
            sig.append(None)
        elif isinstance(t, torch.Tensor):
            # t.shape (a torch.Size) hashes and compares as the tuple graphs.tensor_key makes
            sig.append((t.data_ptr(), t.shape, t.stride(), t.dtype, t.device))
        else:
            return None
    return tuple(sig)


def check_run_args_once(seen: set, q, k_cache, v_cache, out, *, batch: int, k_scale=None,
                        v_scale=None, sinks=None, lse=None, **shape) -> tuple[bool, tuple | None]:
    """:func:`check_run_args` once per :func:`run_signature`: ``seen`` holds the signatures that
    passed (the caller's, bounded at 4096: keys of freed tensors are dropped). Returns whether
    the arguments were seen before (then only what changes with the step is left to check) and
    their signature (None: an argument is not a tensor)."""
    sig = run_signature(q, k_cache, v_cache, out, k_scale, v_scale, batch, sinks, lse)
    if sig is not None and sig in seen:
        return True, sig
    check_run_args(q, k_cache, v_cache, out, batch=batch, k_scale=k_scale, v_scale=v_scale,
                   sinks=sinks, lse=lse, **shape)
    if sig is not None:
        if len(seen) >= 4096:
            seen.clear()
        seen.add(sig)
    return False, sig


def check_run_args(q, k_cache, v_cache, out, *, batch: int, num_qo_heads: int, num_kv_heads: int,
                   head_dim: int, page_size: int, dtype, device, max_page_id: int = -1,
                   kv_dtype=None, k_scale=None, v_scale=None, kv_layout: str = "HND",
                   sinks=None, lse=None, want_sinks: bool = False) -> None:
    """Check run()'s tensors against the runtime's shape and the planned batch; raise ValueError
    naming the tensor. Pure metadata checks (no device access): out is never touched here.

    q, out [batch, H_q, D] contiguous, ``dtype``; k_cache, v_cache as the kernels index them
    (:func:`hnd_view` of the ``kv_layout`` the caller uses): [num_pages, H_kv, page_size, D]
    with contiguous 16-byte-aligned token rows, same shape, ``kv_dtype`` (None: ``dtype``);
    all on ``device``; ``max_page_id`` (the step's largest page id, -1 = not validated) <
    num_pages. k_scale, v_scale: float32 [1] or [H_kv] on ``device`` for float8_e4m3fn caches,
    None otherwise (``ops.check_kv_scales``, metadata only). sinks: a float32 [H_q] tensor
    iff ``want_sinks``; lse: None or a float32 [batch, H_q] tensor.
    """
    kv_dtype = dtype if kv_dtype is None else kv_dtype
    named = [("q", q), ("k_cache", k_cache), ("v_cache", v_cache)]
    if out is not None:
        named.append(("out", out))
    for name, t in named:
        if not isinstance(t, torch.Tensor):
            raise ValueError(f"Runtime.run: {name}: expected a torch.Tensor, got {type(t).__name__}")
        want_dtype = kv_dtype if name in ("k_cache", "v_cache") else dtype
        if t.dtype != want_dtype:
            what = "kv_dtype" if name in ("k_cache", "v_cache") else "dtype"
            raise ValueError(f"Runtime.run: {name}: expected dtype {want_dtype} (the Runtime's "
                             f"{what}), got {t.dtype}")
        if t.device != device:
            raise ValueError(f"Runtime.run: {name}: expected a tensor on {device}, got {t.device}")
    want = (batch, num_qo_heads, head_dim)
    for name, t in named[:1] + named[3:]:
        if t.data_ptr() % 16:
            raise ValueError(f"Runtime.run: {name}: expected a 16-byte aligned tensor (the kernels "
                             f"read and write it 16 bytes at a time), got address {t.data_ptr():#x}")
        if tuple(t.shape) != want or not t.is_contiguous():
            raise ValueError(f"Runtime.run: {name}: expected a contiguous [B, H_q, D] = {want} tensor "
                             f"(B = the batch of the last plan()), got shape {tuple(t.shape)}"
                             f"{'' if t.is_contiguous() else ' (not contiguous)'}")
    per16 = 16 // k_cache.element_size()   # elements per 16 bytes: 8 (fp16/bf16), 16 (FP8)
    for name, c in named[1:3]:   # as the kernels index them (hnd_view): an NHD cache transposed
        nhd = kv_layout == "NHD"
        if c.dim() != 4 or tuple(c.shape[1:]) != (num_kv_heads, page_size, head_dim):
            shape = tuple(c.shape) if not nhd or c.dim() != 4 else tuple(c.transpose(1, 2).shape)
            want = (f"[num_pages, page_size={page_size}, H_kv={num_kv_heads}, D={head_dim}] (NHD)"
                    if nhd else f"[num_pages, H_kv={num_kv_heads}, page_size={page_size}, D={head_dim}] (HND)")
            raise ValueError(f"Runtime.run: {name}: expected {want}, got shape {shape}")
        if (c.stride(3) != 1 or c.data_ptr() % 16 or c.stride(2) * c.shape[2] >= 2**31
                or any(c.stride(i) % per16 for i in range(3) if c.shape[i] > 1)):
            raise ValueError(f"Runtime.run: {name}: expected contiguous, 16-byte aligned token rows "
                             f"and page/head/token strides that are multiples of {per16} elements, "
                             f"got strides {c.stride()} ({kv_layout} as [pages, heads, tokens, D])")
    if v_cache.shape != k_cache.shape:
        raise ValueError(f"Runtime.run: v_cache: expected the shape of k_cache {tuple(k_cache.shape)}, "
                         f"got {tuple(v_cache.shape)}")
    check_page_bound(max_page_id, k_cache.shape[0])
    try:
        ops.check_kv_scales(k_cache, v_cache, k_scale, v_scale)
    except ops.KernelArgumentError as e:
        raise ValueError(f"Runtime.run: {e}") from None
    if want_sinks != (sinks is not None):
        raise ValueError("Runtime.run: sinks: " + (
            "expected a float32 [H_q] tensor of attention-sink logits (the Runtime was built with "
            "sinks=True)" if want_sinks else
            "given, but the Runtime was built without sinks (construct it with sinks=True)"))
    for name, t, shape in (("sinks", sinks, (num_qo_heads,)), ("lse", lse, (batch, num_qo_heads))):
        if t is not None and (not isinstance(t, torch.Tensor) or t.dtype != torch.float32
                              or t.device != device or tuple(t.shape) != shape or not t.is_contiguous()):
            raise ValueError(f"Runtime.run: {name}: expected a contiguous float32 {list(shape)} tensor "
                             f"on {device}, got " + (f"{t.dtype} {tuple(t.shape)} on {t.device}"
                                                     if isinstance(t, torch.Tensor) else type(t).__name__))
