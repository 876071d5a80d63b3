"""``pkvrt.Runtime``: the embedding API. Plan once per decode step, run once per layer.

::

    rt = pkvrt.Runtime(32, 8, 128, 16)              # H_q, H_kv, head_dim, page_size (fp16)
    for step in decode_loop:
        rt.plan(seq_lens, block_tables)             # route choice + static metadata upload
        for layer in layers:
            q = rt.static_q(B); q.copy_(...)        # or any [B, H_q, D] tensor
            out = rt.run(q, k_cache[layer], v_cache[layer], out=rt.static_out(B))

An FP8 (float8_e4m3fn) KV cache: ``Runtime(..., torch.float16, kv_dtype=torch.float8_e4m3fn)``
(q and out stay fp16 or bf16) and per layer ``rt.run(q, k_cache, v_cache, out=...,
k_scale=k_scale, v_scale=v_scale)`` with float32 device tensors [1] or [H_kv] (element value =
e4m3 * scale of its KV head). The kernels read the scales when they run, so a replayed graph uses
the values the tensors hold then; a different scale tensor is a different graph.

One way to build a PersistentKV workqueue or fused plan: on the GPU, by the planning kernel
(kernels/plan_workqueue.cu, ``ops.plan_workqueue_device``: the balanced partition, the tasks in
the host planner's order, a status word), from lengths the host copied there or lengths already
on the device. Its grid is fixed per padded batch, so ``run`` replays one set of per-layer
graphs for every step of that padded batch while the lengths change. Two ways to give a step:

* host lengths (the default ``Runtime(...)``): ``plan`` checks the step (O(B), and with
  ``validate`` the page ids it uses) and the :class:`pkvrt.router.Router` picks the route from
  its gates, predictions and margins, memoized at split granularity (it builds no plan for these
  routes). A workqueue/fused step then issues one non-blocking H2D copy from pinned staging
  (row count, longest valid length, lengths and block-table rows: the planning head and the
  block tables are one allocation) and replays the captured planning graph of (route, padded
  batch). A bucket step stages its
  plan on the host (row ids and merge offsets into the int32 arena, plus the block-table rows:
  two copies), because its buckets are the launch structure of its graph, which the host must
  know to pick the graph (:meth:`Runtime._stage_bucket`). A FlashInfer step runs FlashInfer's
  own host plan. The Python plan of a workqueue step (``planner.plan_workqueue``,
  ``graphs.stage_workqueue``) is now only the planning kernel's reference twin in the tests.
* device lengths (``device_planning=True``): no host routing, every step runs routes.toml's
  ``[device_planning] route`` (``small_route`` on steps of at most ``small_rows`` rows: the row
  count is known on the host); two device copies and the planning graph, nothing synchronizes,
  and plan()/run() can be captured in an engine's own graph.

``run`` checks the tensors and replays the CUDA graph of this (route, batch, structure, tensors)
key, capturing it on a miss (:mod:`pkvrt.graphs` says what a key holds).

Static buffers (allocated once; sizes at the seed shape H_q 32, H_kv 8, D 128, fp16, with the
defaults max_batch 256, max_pages_per_row 8192 and the seed routes.toml):

=====================  ==============================================  =====================
buffer                 shape                                           seed size
=====================  ==============================================  =====================
metadata arena         int32: seq_lens [max_batch], split_offsets       ~90 KB
                       [pow2(max_batch)+1], num_tasks [1], row_ids
                       [2*max_batch], merge offsets [2*max_batch],
                       tasks [task_capacity, 5]
planning buffers       int32: a head in front of block_tables (rows,    ~3 KB
                       longest length, lengths) [16 + pow2(max_batch)];
                       split counts [pow2(max_batch)]; status [1];
                       allowed split counts per workqueue/fused route
block_tables           int32 [pow2(max_batch), max_pages_per_row]       8 MiB
part_a / part_ml       f32 [slot_capacity, H_q, D] / [.., H_q, 2]       8 MiB / 128 KiB
fused counters         int32 [pow2(max_batch), H_kv], zero              8 KiB
static q / out         dtype [pow2(max_batch), H_q, D] each              2 MiB each
FlashInfer indices     int32 [max_batch * max_pages_per_row]            8 MiB (+128 MiB workspace)
pinned staging         2 ring slots x (arena + planning head and block  ~32 MiB host
                       tables + CSR)
=====================  ==============================================  =====================

Capacities (:func:`pkvrt.graphs.initial_capacities`): PersistentKV routes run only up to the gates'
``max_active`` rows (unless forced), so partial-state slots are sized for
``pow2(min(max_batch, max max_active)) * max splits`` (seed: 8 rows * 64 = 512 slots) and tasks
for ``task_bucket(slots * H_kv)`` (4096), and at least for the planning kernel's largest grid
of every padded batch up to max_batch (:meth:`Runtime._device_capacities`; H200 calibration,
seed shape: 792 tasks at 2..64 rows, 2048 at 256), so workqueue/fused steps never grow them. A
bucket plan that needs more (a forced bucket route at B = 32, say) grows the buffer between
steps to ``max(need, 2 * old)``; growing reallocates, so every graph is dropped
(``stats()['invalidations']``). Row ids never grow: the padded rows of all buckets sum to
< 2 * B (each bucket pads r rows to pow2(r) <= 2r - 1).

Host cost of a host-lengths ``plan``: the router (a memo hit: 15-35 us on the 2-core dev box
at B8, no planner call for a workqueue/fused step; a miss, about once per ``quantum / B`` steps
of a decode loop, 100-600 us), the O(B * pages) validation (``validate=True``: 16 us at B8 with
2048-page rows on the dev box, ``test_bench_check_step_b8_32k``; ``validate=False`` skips it),
a few numpy writes, one tensor copy and one planning-graph replay (a bucket step: two
copies), and one event record; it
allocates no device or pinned memory. The block-table copy moves rows 0..B-1 at the buffer's
row stride, ``((B-1) * max_pages_per_row + pages) * 4`` bytes (B8 at the default 8192: 256 KB,
asynchronous): size ``max_pages_per_row`` to the longest context served. ``run`` on a graph hit
is the tensor checks, one dict lookup and ``graph.replay()``. The staging ring has 2 slots: a
slot's pinned memory is rewritten only after the event recorded behind its last copies has
completed (``Event.synchronize``, a no-op unless the host runs more than a whole step ahead of
the GPU).

Measured on the H200's host (benches/host_cost.py -> benches/results/h200/host-cost.json, one
layer), before workqueue/fused plans moved to the GPU for host lengths too: host-planned
plan() 250-740 us (the Python plan of every workqueue step), a graph-hit run() 16-40 us; with
device_planning plan() 48-71 us and run() 20-31 us; an engine that captures plan() + 32 layers
in its own graph (examples/engine_graph.py) spends 3-6 us of host time per replayed step. The
host-lengths workqueue/fused path is now device planning's copies and replay plus the checks
and a memoized route choice (target <= 60 us; re-measure with benches/host_cost.py).

The runtime must be used from the thread, CUDA device and stream it plans on: ``plan``'s copies,
the launches and the replays all go to the current stream, which must be the same one for
``plan`` and ``run`` (like FlashInfer's wrappers).
"""

from __future__ import annotations

import pathlib
import warnings

import attrs
import numpy as np
import torch

from pkvrt import _buildspec, _driver, fi_route, graphs, ops
from pkvrt.calibration import Calibration, find_calibration, load_calibration
from pkvrt.graphs import (Capacities, arena_layout, bucket_sections, grow, initial_capacities,
                          needed_capacities, stage_bucket)
from pkvrt.planner import check_seq_lens, device_grid_ctas, device_plan_targets
from pkvrt.registry import KIND_KERNELS, Registry, kv_dtype_name, load_routes
from pkvrt.router import RouteDecision, Router

DTYPES = {torch.float16: "f16", torch.bfloat16: "bf16"}
RING = 2    # pinned staging slots
DEVICE_PLANNED = ("workqueue", "fused")   # route kinds whose plans the planning kernel builds
MAX_SEQ_LEN = ops.MAX_SEQ_LEN   # longest row in tokens: int32 lengths, tile arithmetic included
_NESTED_CAPTURE = ("Runtime.{}: called during CUDA-graph capture with use_cuda_graph=True; the Runtime "
                   "would replay or capture its own graphs inside yours. Build it with "
                   "use_cuda_graph=False (and device_planning=True) to capture whole steps in your "
                   "own graph")


# ----------------------------------------------------------------------------- validation


def check_shape(num_qo_heads, num_kv_heads, head_dim, page_size, dtype, kv_dtype=None) -> int:
    """Check an attention shape against the kernels built (``pkvrt/_buildspec.py``); return G.

    Raises ValueError naming the argument: head_dim in (64, 128, 256); page_size a power of
    two <= 64; num_qo_heads a multiple of num_kv_heads with G in (1, 2, 4, 8); dtype (q and out)
    fp16/bf16; kv_dtype None (= dtype), dtype or float8_e4m3fn.
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
                         f"{_buildspec.GROUP_SIZES}")
    if dtype == ops.FP8:
        raise ValueError(f"Runtime: dtype={dtype}: dtype is the dtype of q and out: expected "
                         "torch.float16 or torch.bfloat16; an FP8 KV cache is "
                         "kv_dtype=torch.float8_e4m3fn")
    if dtype not in DTYPES:
        raise ValueError(f"Runtime: dtype={dtype}: expected torch.float16 or torch.bfloat16")
    if kv_dtype is not None and kv_dtype not in (dtype, ops.FP8):
        raise ValueError(f"Runtime: kv_dtype={kv_dtype}: expected None (the dtype, {dtype}) or "
                         "torch.float8_e4m3fn")
    return g


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
    """A validated step: seq [B] int64, block_tables [B, W] (caller's ints), pages [B] int64
    (pages each row needs), max_pages (their max), max_page_id (largest page id in use, or -1
    when not validated)."""

    seq: np.ndarray
    block_tables: np.ndarray
    pages: np.ndarray
    max_pages: int
    max_page_id: int


def check_step(seq_lens, block_tables, *, page_size: int, max_batch: int, max_pages_per_row: int,
               validate: bool = True) -> StepInput:
    """Validate one step's metadata; raise ValueError naming the argument, else a StepInput.

    Always (O(B), they guard the static buffers): 1-D integer seq_lens >= 1, B <= max_batch,
    block_tables [B, W] integer with W >= the pages of the longest row, every row's pages within
    max_pages_per_row. With ``validate``: every page id a row uses (its first
    ceil(seq_len / page_size) entries) is >= 0; padding past them is never read and may be -1.
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
    seq = seq.astype(np.int64, copy=False)
    if seq.min() < 1:
        row = int(np.argmin(seq))
        raise ValueError(f"Runtime.plan: seq_lens[{row}] = {seq[row]}: expected >= 1 "
                         "(tokens in the cache, the new one included)")
    bt = host_int_array(block_tables, "block_tables")
    if bt.ndim != 2 or bt.shape[0] != b:
        raise ValueError(f"Runtime.plan: block_tables: expected shape [B={b}, max_pages], got "
                         f"{bt.shape}")
    if bt.dtype.kind not in "iu":
        raise ValueError(f"Runtime.plan: block_tables: expected an integer dtype (int32), got {bt.dtype}")
    pages = -(-seq // page_size)
    row = int(np.argmax(pages))
    max_pages = int(pages[row])
    if max_pages > max_pages_per_row:
        raise ValueError(f"Runtime.plan: seq_lens[{row}] = {seq[row]} needs {max_pages} pages of "
                         f"{page_size} tokens: expected at most max_pages_per_row={max_pages_per_row}")
    if max_pages > bt.shape[1]:
        raise ValueError(f"Runtime.plan: block_tables: row {row} has seq_len {seq[row]} = "
                         f"{max_pages} pages of {page_size}, but block_tables has only "
                         f"{bt.shape[1]} columns; expected at least {max_pages}")
    max_id = used_page_id_max(bt, pages) if validate else -1
    return StepInput(seq=seq, block_tables=bt, pages=pages, max_pages=max_pages, max_page_id=max_id)


def used_page_id_max(bt: np.ndarray, pages: np.ndarray) -> int:
    """The largest page id the rows use (row r: its first ``pages[r]`` entries of ``bt`` [B, W]);
    ValueError naming the first negative one. Padding past a row's pages is never looked at.

    One pass: the ids are read as unsigned integers of the same width, so a negative id is
    larger than any real one, and ``maximum.reduceat`` over [row start, row start + pages)
    segments of the flat table gives each row's largest id (the segments in between, a row's
    padding, are skipped). ~3x faster than masking the table (B8 32K: 19 vs 51 us per step on
    the dev box)."""
    w = bt.shape[1]
    flat = np.ascontiguousarray(bt).reshape(-1)
    bounds = np.empty(2 * bt.shape[0], dtype=np.intp)
    bounds[0::2] = np.arange(bt.shape[0]) * w
    bounds[1::2] = bounds[0::2] + pages
    if bounds[-1] == flat.size:    # the last row uses every column: its segment runs to the end
        bounds = bounds[:-1]
    top = int(np.maximum.reduceat(flat.view(f"u{flat.itemsize}"), bounds)[0::2].max())
    if flat.dtype.kind == "u" or top < 1 << (8 * flat.itemsize - 1):
        return top
    mask = np.arange(w) < pages[:, None]
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


def check_run_args(q, k_cache, v_cache, out, *, batch: int, num_qo_heads: int, num_kv_heads: int,
                   head_dim: int, page_size: int, dtype, device, max_page_id: int = -1,
                   kv_dtype=None, k_scale=None, v_scale=None) -> None:
    """Check run()'s tensors against the runtime's shape and the planned batch; raise ValueError
    naming the tensor. Pure metadata checks (no device access): out is never touched here.

    q, out [batch, H_q, D] contiguous, ``dtype``; k_cache, v_cache [num_pages, H_kv, page_size,
    D] with contiguous 16-byte-aligned token rows, same shape, ``kv_dtype`` (None: ``dtype``);
    all on ``device``; ``max_page_id`` (the step's largest page id, -1 = not validated) <
    num_pages. k_scale, v_scale: float32 [1] or [H_kv] on ``device`` for float8_e4m3fn caches,
    None otherwise (``ops.check_kv_scales``, metadata only).
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
        if tuple(t.shape) != want or not t.is_contiguous():
            raise ValueError(f"Runtime.run: {name}: expected a contiguous [B, H_q, D] = {want} tensor "
                             f"(B = the batch of the last plan()), got shape {tuple(t.shape)}"
                             f"{'' if t.is_contiguous() else ' (not contiguous)'}")
    per16 = 16 // k_cache.element_size()   # elements per 16 bytes: 8 (fp16/bf16), 16 (FP8)
    for name, c in named[1:3]:
        if c.dim() != 4 or tuple(c.shape[1:]) != (num_kv_heads, page_size, head_dim):
            raise ValueError(f"Runtime.run: {name}: expected [num_pages, H_kv={num_kv_heads}, "
                             f"page_size={page_size}, D={head_dim}] (HND), got shape {tuple(c.shape)}")
        if c.stride(3) != 1 or c.stride(2) != head_dim or c.stride(0) % per16 or c.stride(1) % per16 \
                or c.data_ptr() % 16:
            raise ValueError(f"Runtime.run: {name}: expected contiguous, 16-byte aligned token rows "
                             f"and page/head strides that are multiples of {per16} elements, got "
                             f"strides {c.stride()}")
    if v_cache.shape != k_cache.shape:
        raise ValueError(f"Runtime.run: v_cache: expected the shape of k_cache {tuple(k_cache.shape)}, "
                         f"got {tuple(v_cache.shape)}")
    if max_page_id >= k_cache.shape[0]:
        raise ValueError(f"Runtime.run: block_tables (last plan) uses page id {max_page_id}: expected "
                         f"page ids < num_pages = k_cache.shape[0] = {k_cache.shape[0]}")
    try:
        ops.check_kv_scales(k_cache, v_cache, k_scale, v_scale)
    except ops.KernelArgumentError as e:
        raise ValueError(f"Runtime.run: {e}") from None


# ----------------------------------------------------------------------------- route choice


def predict_route_us(router: Router, route, seq: np.ndarray) -> float:
    """The router's predicted T of a PersistentKV ``route`` for ``seq`` (closed-form counters;
    the calibration's measured time model, else the roofline: ``Router.predict``)."""
    return router.predict(route, check_seq_lens(seq))


def decide(router: Router, seq, block_tables, *, force: str | None = None,
           flashinfer_unavailable: str | None = None, fallback_memo: dict | None = None) -> RouteDecision:
    """``router.decide``, except that when FlashInfer is unavailable (the reason given) a step
    the policy sends to FlashInfer runs on the fastest predicted PersistentKV route instead
    (non-ablation routes first), and ``explain()`` says so in the FlashInfer line.

    ``fallback_memo``: a dict that remembers that fallback route per router memo key (as the
    router remembers its decisions; bounded by ``router.memo_size``), so a step of a known key
    predicts nothing (an FP8 Runtime, which never uses FlashInfer, took 280 us per short B8
    step on the dev box predicting the PersistentKV routes every step).

    Raises ValueError when ``force`` names the FlashInfer route and it is unavailable.
    """
    reg = router.registry
    base = reg.baseline.name
    if flashinfer_unavailable is not None and force == base:
        raise ValueError(f"force={force!r}: the FlashInfer route is unavailable here "
                         f"({flashinfer_unavailable}); force a PersistentKV route instead")
    d = router.decide(seq, force=force, block_tables=block_tables)
    if d.kind != "flashinfer" or flashinfer_unavailable is None:
        return d
    pkv = [r for r in reg.routes if r.kind != "flashinfer" and router.kv_dtype in r.kv_dtypes]
    pool = [r for r in pkv if not r.ablation] or pkv
    if not pool:
        raise ValueError(f"{reg.path}: no PersistentKV route serves KV dtype {router.kv_dtype}, and "
                         f"the FlashInfer route is unavailable ({flashinfer_unavailable}): no route "
                         "can run")
    seq64 = np.asarray(seq, dtype=np.int64)

    def t_us(r) -> float:
        t = d.predicted_us.get(r.name)
        return predict_route_us(router, r, seq64) if t is None else t

    key = router.memo_key(seq64, force) if fallback_memo is not None else None
    best = fallback_memo.get(key) if key is not None else None
    if best is None:
        best = min(pool, key=t_us)
        if key is not None:
            if len(fallback_memo) >= router.memo_size:
                del fallback_memo[next(iter(fallback_memo))]
            fallback_memo[key] = best
    forced = router.decide(seq, force=best.name, block_tables=block_tables)
    refused = dict(forced.refused)
    refused[base] = (f"FlashInfer unavailable ({flashinfer_unavailable}); the policy chose it, so the "
                     f"runtime ran {best.name}, the fastest predicted PersistentKV route")
    return attrs.evolve(forced, refused=refused, forced=d.forced)


# ----------------------------------------------------------------------------- the runtime


@attrs.define(eq=False)
class _Staging:
    """One pinned ring slot: host twins of the device buffers, numpy views of them, an event."""

    arena: torch.Tensor
    arena_np: np.ndarray
    store: torch.Tensor         # twin of Runtime._bt_store: [planning head | block tables]
    bt: torch.Tensor            # [max_batch * max_pages_per_row] flat view of store
    bt_np: np.ndarray           # [max_batch, max_pages_per_row] view
    meta_np: np.ndarray | None  # the planning head: rows, max_seq_len, pad, seq_lens
    fi_indptr: torch.Tensor | None
    fi_lpl: torch.Tensor | None
    fi_indices: torch.Tensor | None
    event: torch.cuda.Event | None = None


@attrs.define(eq=False)
class _Step:
    """What run() needs of the last plan(): route, batch, graph batch, structure, page-id bound,
    and the launch views (built on the first launch of the step, reused by every layer)."""

    route: str
    kind: str
    batch: int
    gbatch: int
    structure: object
    max_page_id: int
    views: object = None
    runs: int = 0        # run() calls since this plan: the first must not read the plan early


def _resolve_device(device) -> torch.device:
    """The CUDA device to run on ("cuda" = the current one). RuntimeError without a usable GPU,
    ValueError for a non-CUDA device."""
    if (reason := _driver.available()) is not None:
        raise RuntimeError(f"pkvrt.Runtime needs a CUDA GPU to run kernels: {reason}. (The router "
                           "and planners work without one: pkvrt.Router, `pkvrt plan`.)")
    dev = torch.device(device)
    if dev.type != "cuda":
        raise ValueError(f"Runtime: device={device!r}: expected a CUDA device")
    return torch.device("cuda", torch.cuda.current_device() if dev.index is None else dev.index)


def _pinned(n: int, dtype=torch.int32) -> torch.Tensor:
    return torch.zeros(n, dtype=dtype, pin_memory=True)


class Runtime:
    """Paged-KV decode attention with a per-step route choice, replayed as CUDA graphs.

    Per step, :meth:`plan` chooses the route (host lengths: the router; ``device_planning``:
    routes.toml's device-planning route) and every workqueue/fused plan is built on the GPU by
    the planning kernel into static buffers; per layer, :meth:`run` replays the graph of the
    step's (route, padded batch, grid) key. A bucket step is planned on the host (its buckets
    are its graph's launch structure), a FlashInfer step by FlashInfer's plan (module docstring).

    Parameters
    ----------
    num_qo_heads, num_kv_heads, head_dim, page_size : the attention shape (module-level checks in
        :func:`check_shape`). dtype : torch.float16 or torch.bfloat16, the dtype of q and out
        (and of the KV cache unless ``kv_dtype`` says otherwise).
    kv_dtype : None (the KV cache is ``dtype``) or torch.float8_e4m3fn: an FP8 KV cache, whose
        dequantization scales each :meth:`run` takes (``k_scale``, ``v_scale``). The router then
        counts 1 byte per K/V element. FlashInfer is not used with it (its decode takes the
        scales as host floats, which a captured graph cannot re-read; ``explain()`` says so):
        steps the policy sends to FlashInfer run on the fastest PersistentKV route.
    device : the CUDA device of the caches ("cuda" = the current one).
    routes : routes.toml path (None: ``pkvrt.registry.load_routes()``'s default) or a Registry.
    calibration : "auto" (``find_calibration(torch.cuda.get_device_name(device))``), a path or a
        Calibration; its ``splits.by_group`` entry for this group size, if there is one, replaces
        the balanced partition's constants (``Calibration.for_group``).
    max_batch : most rows of a step. max_pages_per_row : most pages of one row (block-table width).
    use_cuda_graph : replay CUDA graphs (default) or launch eagerly (the ablation).
    max_graphs : graphs kept (LRU; evicted graphs are freed).
    validate : O(B * pages) checks of the block tables at plan() and of page ids vs num_pages at
        run(); the O(B) checks that guard the static buffers always run.
    sm_scale : softmax scale (None: 1/sqrt(head_dim)).
    flashinfer : use FlashInfer as the baseline route; False, or FlashInfer failing to import,
        makes it unavailable: steps the policy sends to it run on the fastest PersistentKV route.
    flashinfer_tensor_cores : FlashInfer's tensor-core decode (H200, G=4: 44 vs 52 us at B1 32K).
    decision_memo : decisions the router remembers and reuses (``Router(memo_size=...)``: keyed by
        force, active rows, distinct lengths and each length at split granularity; plans stay
        exact: a workqueue/fused plan is built on the GPU from the exact lengths, a bucket or
        FlashInfer plan on the host). Cuts ``plan()``'s router time 5-20x (B8, dev box); 0
        predicts every step from scratch.
    flashinfer_cuda_graph : run the FlashInfer route in FlashInfer's CUDA-graph mode inside the
        runtime's graphs. Off by default: it does not remove the larger host cost, FlashInfer's
        plan() on the host (H200: 210-470 us per step, host-cost.json), and adds one wrapper
        per batch size. (The "illegal memory access" once seen with it was a race on pinned buffers,
        FlashInfer's own and the serving harness's, both guarded now: see
        fi_route.FlashInferRoute.plan and tests/gpu/test_runtime.py.)
    num_pages : the pages of the KV cache that run() will be given (``k_cache.shape[0]``); the
        planning kernel checks the page ids of every workqueue/fused step against it on the GPU.
        Device planning: run() refuses a cache with fewer pages; None: taken from the first
        run()'s cache, so the ids of a step planned before any run() are not checked. Host
        lengths: the bound is lowered to the smallest cache run() is given (never an error),
        on top of the host checks (``validate``).
    device_planning : take each step's lengths and block tables as device tensors and skip host
        routing (both modes build every workqueue/fused plan with the planning kernel,
        kernels/plan_workqueue.cu; this one has no host part). ``plan()`` then does no work
        proportional to the batch and never synchronizes: two device copies
        (lengths, block tables), one fill and one replay of a captured planning graph (an eager
        launch with graphs off). Every step runs routes.toml's ``[device_planning] route``
        (pkv_fused, the merge in the decode tail, as shipped; without that table the first
        non-ablation workqueue or fused route), except steps of at most ``small_rows`` rows,
        which run ``small_route`` (shipped: pkv_workqueue on one-row steps, where the tail
        merge is exposed); ``force=`` may name another workqueue or fused route. FlashInfer and the bucket route are not used. Lengths and page ids are checked
        on the GPU by the planning kernel: a row whose seq_len is outside [1, block-table columns
        * page_size], or whose block table holds a page id outside [0, num_pages) among the
        pages its length uses, gets no work (its output row is not computed) and sets a flag
        that :meth:`device_status` reports for the last planned step. With
        ``use_cuda_graph=False`` plan() and run() are capturable, so an engine can capture a whole
        step (all layers) in its own CUDA graph and replay it with new lengths (same batch size)
        and no host planning at all: the fastest way to run pkvrt (H200 engine protocol,
        README). The split of every step is the balanced partition (planner.balanced_partition).

    Ordering contract with PDL (sm_90+, eager launches or an engine's captured step): from the
    second run() after a plan(), the decode kernel reads the plan and copies K/V of each row's
    tokens before its last one while the previous kernel of the stream may still run (it
    overlaps the previous layer's merge). Those tokens must be in the cache before the step
    starts, as in any decode step (only the new token's K/V is written during the step, and that
    one, Q and all outputs are read and written after the wait). ``PKVRT_PDL=0`` turns PDL off.

    Raises
    ------
    ValueError for an unsupported shape or bad argument (naming it); RuntimeError without a CUDA
    GPU or when a kernel image for this GPU is missing (naming the kernel).
    """

    def __init__(self, num_qo_heads: int, num_kv_heads: int, head_dim: int, page_size: int,
                 dtype=torch.float16, *, kv_dtype=None, device="cuda", routes=None, calibration="auto",
                 max_batch: int = 256, max_pages_per_row: int = 8192, use_cuda_graph: bool = True,
                 max_graphs: int = 64, validate: bool = True, sm_scale: float | None = None,
                 flashinfer: bool = True, flashinfer_tensor_cores: bool = True,
                 flashinfer_cuda_graph: bool = False, decision_memo: int = 4096,
                 device_planning: bool = False, num_pages: int | None = None):
        check_shape(num_qo_heads, num_kv_heads, head_dim, page_size, dtype, kv_dtype)
        if device_planning and max_batch > ops.PLAN_MAX_ROWS:
            raise ValueError(f"Runtime: max_batch={max_batch}: device_planning plans at most "
                             f"{ops.PLAN_MAX_ROWS} rows (one planning CTA)")
        for name, v in (("max_batch", max_batch), ("max_pages_per_row", max_pages_per_row),
                        ("num_pages", 1 if num_pages is None else num_pages)):
            if isinstance(v, bool) or not isinstance(v, int) or v < 1:
                raise ValueError(f"Runtime: {name}={v!r}: expected a positive integer")
        self._num_pages = num_pages   # device planning: the page-id bound (None: the first cache)
        if max_pages_per_row * page_size > MAX_SEQ_LEN:
            raise ValueError(f"Runtime: max_pages_per_row={max_pages_per_row}: rows of "
                             f"{max_pages_per_row * page_size} tokens exceed the int32 lengths the "
                             f"kernels take (at most {MAX_SEQ_LEN} tokens)")
        self._graphs = graphs.GraphCache(max_graphs)   # checks max_graphs
        self._counts = dict(plans=0, captures=0, replays=0, eager_runs=0, staging_copies=0,
                            h2d_copies=0, regrowths=0, capture_seconds=0.0)
        self.num_qo_heads, self.num_kv_heads = int(num_qo_heads), int(num_kv_heads)
        self.head_dim, self.page_size, self.dtype = int(head_dim), int(page_size), dtype
        self.kv_dtype = dtype if kv_dtype is None else kv_dtype
        self._kv_dtype = kv_dtype_name(self.kv_dtype)   # routes.toml's name of the K/V dtype
        self._fp8 = self.kv_dtype == ops.FP8
        self._scale_versions: dict[int, int] = {}   # validate: scale data_ptr -> checked _version
        self.max_batch, self.max_pages_per_row = max_batch, max_pages_per_row
        self.use_cuda_graph, self.validate, self.sm_scale = bool(use_cuda_graph), bool(validate), sm_scale
        self.registry = routes if isinstance(routes, Registry) else load_routes(routes)
        self.device_planning = bool(device_planning)
        # every workqueue/fused step is planned on the GPU, host-routed or not
        self._dp_routes = {r.name: r for r in self.registry.routes if r.kind in DEVICE_PLANNED}
        if self.device_planning:
            try:
                self._dp_default = self.registry.device_planning_route().name
            except KeyError as e:
                raise ValueError(e.args[0]) from None
            flashinfer = False  # device planning runs the PersistentKV workqueue routes only
            small = self.registry.device_small
            for dp_route in map(self.registry.route, dict.fromkeys(filter(None, (self._dp_default,
                                                                                small and small[1])))):
                if self._kv_dtype not in dp_route.kv_dtypes:
                    raise ValueError(f"Runtime: dtype={self.kv_dtype}: the device-planning route "
                                     f"{dp_route.name!r} does not serve it (kv_dtypes = "
                                     f"{list(dp_route.kv_dtypes)} in {self.registry.path})")

        self.device = _resolve_device(device)
        self._cuda = self.device.type == "cuda"

        with torch.cuda.device(self.device):
            if isinstance(calibration, Calibration):
                self.calibration = calibration
            elif calibration == "auto":
                self.calibration = find_calibration(torch.cuda.get_device_name(self.device))
            else:
                self.calibration = load_calibration(pathlib.Path(calibration))
            # the partition constants fitted at this group size (splits.by_group), if any
            self.calibration = self.calibration.for_kv_dtype(self._kv_dtype).for_group(
                self.num_qo_heads // self.num_kv_heads)
            self.router = Router(self.registry, self.calibration, num_qo_heads=self.num_qo_heads,
                                 num_kv_heads=self.num_kv_heads, head_dim=self.head_dim,
                                 page_size=self.page_size, kv_dtype=self._kv_dtype,
                                 graphs=self.use_cuda_graph, memo_size=decision_memo,
                                 device_plan_kinds=DEVICE_PLANNED)
            self._load_kernels()
            self._fi_reason = None if flashinfer else (
                "disabled: Runtime(device_planning=True)" if self.device_planning
                else "disabled: Runtime(flashinfer=False)")
            if flashinfer and self._fp8:
                flashinfer = False
                self._fi_reason = ("not used with kv_dtype=float8_e4m3fn (FlashInfer's decode takes "
                                   "k_scale / v_scale as host floats: a device read per call, and a "
                                   "captured graph would keep the old values)")
            fi_mod = None
            if flashinfer:
                fi_mod, self._fi_reason = fi_route.load_flashinfer()
            if self._fi_reason is not None and flashinfer:
                warnings.warn(f"pkvrt.Runtime: the FlashInfer route is unavailable: {self._fi_reason}; "
                              "steps the policy sends to it run on the fastest PersistentKV route",
                              RuntimeWarning, stacklevel=2)
            if self._fi_reason is not None and not any(r.kind != "flashinfer" and self._kv_dtype in r.kv_dtypes
                                                       for r in self.registry.routes):
                raise ValueError(f"{self.registry.path}: no PersistentKV route serves KV dtype "
                                 f"{self._kv_dtype}, and the FlashInfer route is unavailable "
                                 f"({self._fi_reason}): no route can run")
            cap = initial_capacities(self.registry, max_batch=max_batch, num_kv_heads=self.num_kv_heads)
            self._dp_grid: dict[tuple[str, int], int] = {}
            if self._dp_routes:
                dp = self._device_capacities()
                cap = Capacities(slots=max(cap.slots, dp.slots), tasks=max(cap.tasks, dp.tasks))
            self._alloc(cap)
            self._fi = None
            if fi_mod is not None:
                try:
                    self._fi = fi_route.FlashInferRoute(
                        fi_mod, num_qo_heads=self.num_qo_heads, num_kv_heads=self.num_kv_heads,
                        head_dim=self.head_dim, page_size=self.page_size, dtype=dtype, device=self.device,
                        sm_scale=sm_scale, tensor_cores=flashinfer_tensor_cores,
                        cuda_graph=self.use_cuda_graph and flashinfer_cuda_graph,
                        indices_buffer=self._fi_indices)
                except Exception as exc:  # noqa: BLE001 - reported, the route becomes unavailable
                    self._fi_reason = f"building its wrapper failed ({type(exc).__name__}: {exc})"
                    warnings.warn(f"pkvrt.Runtime: the FlashInfer route is unavailable: {self._fi_reason}",
                                  RuntimeWarning, stacklevel=2)
            self._side = torch.cuda.Stream(self.device)
            self._pool = torch.cuda.graph_pool_handle()
            if self._dp_routes:
                self._alloc_device_planning()
        self._seen = graphs.SeenKeys(4 * max_graphs)
        self._fallback_memo: dict = {}   # decide(): FlashInfer unavailable, route per memo key
        self._ring_next = 0
        self._step: _Step | None = None
        self.last_decision: RouteDecision | None = None

    # -- construction ----------------------------------------------------------------------

    def _load_kernels(self) -> None:
        """Load every kernel the routes need now: a missing cubin is a construction error."""
        tag, g = DTYPES[self.dtype], self.num_qo_heads // self.num_kv_heads
        families = {KIND_KERNELS[r.kind] for r in self.registry.routes if r.kind != "flashinfer"}
        if families & {"split_decode", "workqueue_decode"}:
            families.add("merge")
        if self._dp_routes:
            families.add("plan_workqueue")
        kv_tag = ops.KV_TAG.get(self.kv_dtype)
        for fam in sorted(families):
            grouped = "group" in _buildspec.FAMILIES[fam]["variants"]
            sym = _buildspec.symbol(fam, tag, self.head_dim, g if grouped else None,
                                    kv_tag if grouped else None)
            # The same dynamic smem ops.py launches with: _driver caches a kernel with the first
            # size it is looked up with.
            smem = ops.decode_smem_bytes(self.head_dim, g, self.kv_dtype.itemsize) if grouped else 0
            try:
                _driver.get_kernel(fam, sym, smem)
            except Exception as exc:
                raise RuntimeError(f"pkvrt.Runtime: kernel {sym} (family {fam}) cannot be loaded on "
                                   f"{torch.cuda.get_device_name(self.device)}: {exc}") from exc

    def _alloc(self, cap: Capacities) -> None:
        """(Re)allocate every capacity-sized buffer; the first call also allocates the fixed ones.
        Everything is allocated before anything is replaced, so a failed allocation (OOM) leaves
        the runtime as it was."""
        dev, hq, d = self.device, self.num_qo_heads, self.head_dim
        layout = arena_layout(self.max_batch, cap.tasks)
        arena = torch.zeros(layout.size, dtype=torch.int32, device=dev)
        part_a = torch.empty(cap.slots, hq, d, dtype=torch.float32, device=dev)
        part_ml = torch.empty(cap.slots, hq, 2, dtype=torch.float32, device=dev)
        pinned = [_pinned(layout.size) for _ in range(RING)]
        first = not hasattr(self, "_cap")
        if first:
            nb, npg, gmax = self.max_batch, self.max_pages_per_row, graphs.padded_batch(self.max_batch)
            fi = self._fi_reason is None
            # gmax rows: device planning passes the graph batch's rows (padded_batch(b) may exceed
            # max_batch, e.g. 4 for max_batch 3); rows past the step's are never read. The
            # planning head (_alloc_device_planning) sits right before the block tables, so a
            # host-lengths step uploads its lengths and block tables in one copy.
            self._head = head = self._plan_head()
            self._bt_store = torch.zeros(head + gmax * npg, dtype=torch.int32, device=dev)
            self._bt_flat = self._bt_store[head:]
            self._bt = self._bt_flat.view(gmax, npg)
            self._counters = torch.zeros(gmax, self.num_kv_heads, dtype=torch.int32, device=dev)
            self._sq = torch.zeros(gmax, hq, d, dtype=self.dtype, device=dev)
            self._so = torch.zeros(gmax, hq, d, dtype=self.dtype, device=dev)
            self._sq_ptr, self._so_ptr = self._sq.data_ptr(), self._so.data_ptr()
            self._fi_indices = torch.zeros(nb * npg, dtype=torch.int32, device=dev) if fi else None
            self._ring = []
            for _ in range(RING):
                store = _pinned(head + nb * npg)
                self._ring.append(_Staging(
                    arena=None, arena_np=None, store=store, bt=store[head:],
                    bt_np=store.numpy()[head:].reshape(nb, npg),
                    meta_np=store.numpy()[:head] if head else None,
                    fi_indptr=_pinned(nb + 1) if fi else None, fi_lpl=_pinned(nb) if fi else None,
                    fi_indices=_pinned(nb * npg) if fi else None))
            self._generation = 0
        else:
            for s in self._ring:  # the old pinned arenas may still be the source of queued copies
                if s.event is not None:
                    s.event.synchronize()
        for s, p in zip(self._ring, pinned):
            s.arena, s.arena_np = p, p.numpy()
        self._cap, self._layout = cap, layout
        self._arena, self._part_a, self._part_ml = arena, part_a, part_ml
        self._v_seq = arena[layout.seq_lens:layout.seq_lens + self.max_batch]
        self._v_num_tasks = arena[layout.num_tasks:layout.num_tasks + 1]
        if not first:
            self._generation += 1
            self._graphs.clear()
            self._counts["regrowths"] += 1

    def _plan_rows(self) -> int:
        """Rows of the planning buffers: the padded max_batch, at most what one planning CTA
        plans (ops.PLAN_MAX_ROWS)."""
        return graphs.padded_batch(min(self.max_batch, ops.PLAN_MAX_ROWS))

    def _plan_head(self) -> int:
        """int32 elements of the planning head ``[rows, max_seq_len, pad to ALIGN | seq_lens
        [plan rows], pad to ALIGN]`` in front of the block tables; 0 without workqueue/fused
        routes."""
        if not self._dp_routes:
            return 0
        return graphs.ALIGN + -(-self._plan_rows() // graphs.ALIGN) * graphs.ALIGN

    def _alloc_device_planning(self) -> None:
        """Buffers of device-side planning: the planning head ``_d_meta`` (the active row count,
        the longest valid length and the lengths over the padded batch; a view of the front of
        the block-table allocation, so a host-lengths step uploads it with the block tables in
        one copy), the planner's split counts and status word, and each workqueue/fused route's
        allowed split counts."""
        dev, gmax = self.device, self._plan_rows()
        i32 = dict(dtype=torch.int32, device=dev)
        self._d_meta = self._bt_store[:self._head]
        self._d_rows = self._d_meta[0:1]
        self._d_max_seq = self._d_meta[1:2]
        self._d_seq = self._d_meta[graphs.ALIGN:graphs.ALIGN + gmax]   # 64-byte aligned
        self._d_scalars = (0, 0)   # host copy of (_d_rows, _d_max_seq) ...
        self._d_scalars_cached = True   # ... valid until an engine captures a plan()
        self._d_num_splits = torch.zeros(gmax, **i32)
        self._d_status = torch.zeros(1, **i32)
        # Page ids are checked against this bound by the planning kernel (0 = not yet known:
        # the first run() sets it from its cache when the constructor was not told num_pages).
        self._d_num_pages = torch.full((1,), self._num_pages or 0, **i32)
        self._d_cands = {n: torch.tensor(r.splits.candidates(), **i32) for n, r in self._dp_routes.items()}
        self._dp_refused: dict[str, dict[str, str]] = {}

    def _device_capacities(self) -> Capacities:
        """What device planning can ever need: the worst step of every padded batch (every split
        has H_kv tasks, so slots = tasks / H_kv). Allocated at construction, so the buffers never
        grow afterwards and a graph an engine captured around plan()/run() never points at
        freed memory."""
        batches = [1 << i for i in range(self._plan_rows().bit_length())]
        tasks = max(self._device_grid_tasks(r, gb) for r in self._dp_routes.values() for gb in batches)
        return Capacities(slots=tasks // self.num_kv_heads, tasks=tasks)

    def _device_grid_tasks(self, route, gbatch: int) -> int:
        """Grid (task slots) of a device-planned step on ``gbatch`` padded rows: the most CTAs the
        balanced partition can plan for that many rows (``planner.device_grid_ctas``), so every
        step of up to ``gbatch`` rows replays one graph; slots beyond a step's tasks exit at once."""
        key = (route.name, gbatch)
        if key not in self._dp_grid:
            self._dp_grid[key] = device_grid_ctas(gbatch, num_kv_heads=self.num_kv_heads,
                                                  splits=route.splits, cal=self.calibration)
        return self._dp_grid[key]

    # -- planning --------------------------------------------------------------------------

    def _capturing(self) -> bool:
        """Whether the current stream is capturing a CUDA graph (an engine's)."""
        return self._cuda and torch.cuda.is_current_stream_capturing()

    def plan(self, seq_lens, block_tables, *, force: str | None = None) -> RouteDecision:
        """Choose this step's route and enqueue its plan. Call once per decode step.

        Host lengths (the default): check the step, let the router choose the route, then for a
        workqueue/fused route copy the lengths and block-table rows into the planning buffers
        (one H2D copy from pinned staging) and replay the planning graph, which builds the
        tasks on the GPU; a bucket route stages its host plan (two copies); FlashInfer plans
        itself. Nothing synchronizes (unless the host runs two steps ahead of the GPU).

        Parameters
        ----------
        seq_lens : int [B], tokens per row including the new one (>= 1). Fastest: a CPU int32
            numpy array or (pinned) CPU tensor. A CUDA tensor works but costs one synchronizing
            D2H copy (the router runs on the host).
        block_tables : int [B, max_pages], logical -> physical page; entries past a row's
            ceil(seq_len / page_size) pages are never read (padding, e.g. -1). Same host/device
            advice as seq_lens.
        force : a route name of routes.toml to run regardless of gates and margins (ablations,
            tests); None: the policy decides.

        Returns
        -------
        RouteDecision (also ``self.last_decision``); ``explain()`` says why. Its ``plan`` is None
        for a workqueue/fused route (built on the GPU; ``self.router.full_plan(route, seq_lens)``
        gives the identical host twin).

        Raises
        ------
        ValueError naming the argument (seq_lens, block_tables, force; a batch of more than
        ``ops.PLAN_MAX_ROWS`` = 1024 rows on a workqueue/fused route); the runtime's state is
        unchanged then (the previous plan stays in effect). If plan() raises after its checks (a
        failed copy or launch), no step is planned until the next successful plan().

        With ``device_planning``: seq_lens [B] and block_tables [B, W] are int32 tensors on the
        Runtime's device (CPU int32 tensors work outside graph capture, as a host-to-device copy
        that a pageable source makes synchronous); only their shapes, dtypes and devices are
        checked on the host, the lengths and the page ids each length uses on the GPU, against
        ``num_pages`` (:meth:`device_status`).
        """
        capturing = self._capturing()
        if capturing:
            if not self.device_planning:
                raise RuntimeError("Runtime.plan: called during CUDA-graph capture; host planning "
                                   "stages the plan in host memory and cannot be captured. Build the "
                                   "Runtime with device_planning=True, use_cuda_graph=False to "
                                   "capture whole steps in your own graph")
            if self.use_cuda_graph:
                raise RuntimeError(_NESTED_CAPTURE.format("plan"))
        if self.device_planning:
            return self._plan_on_device(seq_lens, block_tables, force, capturing)
        step = check_step(seq_lens, block_tables, page_size=self.page_size, max_batch=self.max_batch,
                          max_pages_per_row=self.max_pages_per_row, validate=self.validate)
        d = decide(self.router, step.seq, step.block_tables, force=force,
                   flashinfer_unavailable=self._fi_reason, fallback_memo=self._fallback_memo)
        b = step.seq.size
        on_gpu = d.kind in DEVICE_PLANNED
        if on_gpu and b > ops.PLAN_MAX_ROWS:
            raise ValueError(f"Runtime.plan: seq_lens: batch of {b} rows on route {d.route!r}: its plan "
                             f"is built by the planning kernel, which plans at most "
                             f"{ops.PLAN_MAX_ROWS} rows (one CTA); force the bucket or FlashInfer "
                             "route for larger batches")
        if d.kind == "bucket":
            need = needed_capacities(d.kind, d.plan)
            if need.slots > self._cap.slots or need.tasks > self._cap.tasks:
                self._alloc(Capacities(slots=grow(self._cap.slots, need.slots),
                                       tasks=grow(self._cap.tasks, need.tasks)))
        s = self._ring[self._ring_next]
        self._ring_next = (self._ring_next + 1) % RING
        if s.event is not None:
            s.event.synchronize()  # its last copies are done (a no-op unless the host is a step ahead)
        else:
            s.event = torch.cuda.Event()
        self._step = None   # until this step is fully enqueued: a failure below leaves no plan
        if d.kind == "flashinfer":
            structure, gb = self._stage_flashinfer(s, d.plan, b), b
        elif on_gpu:
            structure, gb = self._stage_device_plan(s, self._dp_routes[d.route], step), graphs.padded_batch(b)
        else:
            structure, gb = self._stage_bucket(s, d, step), graphs.padded_batch(b)
        s.event.record()
        self._step = _Step(route=d.route, kind=d.kind, batch=b, gbatch=gb, structure=structure,
                           max_page_id=step.max_page_id)
        self.last_decision = d
        self._counts["plans"] += 1
        return d

    def _plan_on_device(self, seq_lens, block_tables, force: str | None,
                        capturing: bool) -> RouteDecision:
        """plan() with device-side planning (see the constructor's ``device_planning``)."""
        seq, bt = check_device_step(seq_lens, block_tables, device=self.device,
                                    max_batch=self.max_batch)
        b, gb = seq.shape[0], graphs.padded_batch(seq.shape[0])
        # routes.toml [device_planning]: `route`, or `small_route` for steps of <= small_rows rows
        name = self.registry.device_planning_route(b).name if force is None else force
        route = self._dp_routes.get(name)
        if route is None:
            raise ValueError(f"Runtime.plan: force={force!r}: with device_planning expected one of "
                             f"the workqueue/fused routes {sorted(self._dp_routes)}")
        if self._kv_dtype not in route.kv_dtypes:
            raise ValueError(f"Runtime.plan: force={force!r}: route {name!r} does not serve KV dtype "
                             f"{self._kv_dtype} (kv_dtypes = {list(route.kv_dtypes)} in routes.toml)")
        w = min(bt.shape[1], self.max_pages_per_row)
        if capturing and (seq.device != self.device or bt.device != self.device):
            raise ValueError("Runtime.plan: seq_lens/block_tables on the CPU during CUDA-graph "
                             "capture: the graph would read host memory captured by address; "
                             f"pass int32 tensors on {self.device}")
        self._step = None   # until this step is fully enqueued: a failure below leaves no plan
        self._d_seq[:b].copy_(seq, non_blocking=True)
        self._bt[:b, :w].copy_(bt[:, :w], non_blocking=True)
        # The device scalars are rewritten only when they change, until an engine captures a
        # plan(): its replays then rewrite them behind the host's back, so from then on always.
        self._d_scalars_cached &= not capturing
        rows, max_seq = b, w * self.page_size
        if not self._d_scalars_cached or rows != self._d_scalars[0]:
            self._d_rows.fill_(rows)
        if not self._d_scalars_cached or max_seq != self._d_scalars[1]:
            self._d_max_seq.fill_(max_seq)
        self._d_scalars = (rows, max_seq)
        grid = self._enqueue_device_plan(route, gb)
        self._step = _Step(route=route.name, kind=route.kind, batch=b, gbatch=gb, structure=grid,
                           max_page_id=-1)
        others = self._dp_refused.get(route.name)
        if others is None:   # built once per route, not every step
            others = self._dp_refused[route.name] = {
                r.name: f"device_planning runs {route.name} on this step's row count (routes.toml "
                        "[device_planning]; no host routing)"
                for r in self.registry.routes if r.name != route.name}
        self.last_decision = RouteDecision(route=route.name, kind=route.kind, plan=None,
                                           predicted_us={}, refused=others, speedup=1.0, active=b,
                                           max_context=-1, forced=force is not None)
        self._counts["plans"] += 1
        return self.last_decision

    def _stage_device_plan(self, s: _Staging, route, step: StepInput) -> int:
        """A host-routed workqueue/fused step: its row count, the longest length the block-table
        buffer holds (the host checked the lengths already), the lengths and the block-table
        rows go to the planning head and the block tables in one copy from pinned staging (they
        are one allocation); then the planning kernel builds the tasks on the GPU
        (:meth:`_enqueue_device_plan`). Returns the graph structure: the planning grid."""
        b, a = step.seq.size, graphs.ALIGN
        m = s.meta_np
        m[0], m[1] = b, self.max_pages_per_row * self.page_size
        m[a:a + b] = step.seq
        n = self._head + self._stage_block_tables(s, step)
        self._bt_store[:n].copy_(s.store[:n], non_blocking=True)
        self._counts["h2d_copies"] += 1
        return self._enqueue_device_plan(route, graphs.padded_batch(b))

    def _enqueue_device_plan(self, route, gbatch: int) -> int:
        """Plan ``route`` on the GPU for the lengths, row count and block tables already enqueued
        into the planning buffers: replay the captured planning graph of (route, gbatch) (capture
        it on a miss; an eager launch with graphs off). Returns the grid: the task slots of the
        padded batch (:meth:`_device_grid_tasks`), the same for every step of that batch, so the
        decode graphs keyed by it replay while the lengths change."""
        grid = self._device_grid_tasks(route, gbatch)   # <= the capacity sized at construction
        key = ("device-plan", route.name, gbatch, grid, self._generation)
        launch = lambda: self._launch_device_plan(route, gbatch, grid)  # noqa: E731
        if not self.use_cuda_graph:
            launch()
        elif (e := self._graphs.get(key)) is not None:
            e.graph.replay()
            self._counts["replays"] += 1
        else:
            self._capture(key, launch)
        return grid

    def _launch_device_plan(self, route, gbatch: int, grid: int) -> None:
        L, cal = self._layout, self.calibration
        ops.plan_workqueue_device(
            self._d_seq[:gbatch], self._d_rows,
            self._arena[L.tasks:L.tasks + 5 * grid].view(grid, 5),
            self._v_num_tasks, self._arena[L.split_offsets:L.split_offsets + gbatch + 1],
            self._d_num_splits[:gbatch], self._d_status, self._d_cands[route.name],
            num_kv_heads=self.num_kv_heads,
            min_split_tiles=-(-cal.splits.min_split_tokens // _buildspec.TILE_TOKENS),
            max_seq_len=self._d_max_seq, block_tables=self._bt[:gbatch], num_pages=self._d_num_pages,
            page_size=self.page_size, **device_plan_targets(cal))

    def _check_page_bound(self, cache_pages: int) -> None:
        """The planning kernel checks page ids against ``num_pages``. Device planning: a cache
        with fewer pages would let an unchecked id through, so it is refused; without
        ``num_pages`` the first cache sets the bound (from the next plan() on: the first step's
        ids were not checked). Host routing (ids >= 0 checked at plan() and < the cache's pages at
        run() with ``validate``): the bound is the smallest cache given so far, never an error."""
        if not self.device_planning:
            if self._num_pages is None or cache_pages < self._num_pages:
                self._num_pages = int(cache_pages)
                self._d_num_pages.fill_(self._num_pages)
            return
        if self._num_pages is None:
            self._num_pages = int(cache_pages)
            self._d_num_pages.fill_(self._num_pages)
        elif cache_pages < self._num_pages:
            raise ValueError(f"Runtime.run: k_cache has {cache_pages} pages but device planning "
                             f"checks page ids against num_pages={self._num_pages}; pass a cache "
                             f"of at least that many pages (or construct with num_pages="
                             f"{cache_pages})")

    def device_status(self, *, raise_on_error: bool = True) -> int:
        """The device planner's status word of the last planned step (synchronizes the stream):
        0 = fine; bit 0 = task capacity exceeded (cannot happen with the runtime's own sizing);
        bit 1 = a row's seq_len was outside [1, block-table columns * page_size]; bit 2 = a row's
        block table held a page id outside [0, num_pages) among the pages its length uses
        (either way that row got no work and its output row was not computed). Raises
        RuntimeError on a nonzero word unless ``raise_on_error`` is False. Host routing: the
        word of the last step if it was a workqueue/fused step (its ids checked on the GPU
        against the smallest cache run() was given, or ``num_pages``); 0 without a sync after a
        bucket or FlashInfer step (planned on the host)."""
        if not self._dp_routes:
            raise RuntimeError("Runtime.device_status: nothing is planned on the GPU (routes.toml "
                               "has no workqueue or fused route)")
        if self._step is not None and self._step.kind not in DEVICE_PLANNED:
            return 0
        word = int(self._d_status.item())
        if word and raise_on_error:
            what = []
            if word & 2:
                what.append("a row's seq_len was outside [1, block_tables columns * page_size]: "
                            "that row got no work and its output row was not computed")
            if word & 4:
                what.append(f"a row's block table held a page id outside [0, num_pages = "
                            f"{self._num_pages}): that row got no work and its output row was not "
                            "computed")
            if word & 1:
                what.append("the plan needed more tasks than the grid holds")
            raise RuntimeError("Runtime.device_status: " + "; ".join(what))
        return word

    def _stage_bucket(self, s: _Staging, d: RouteDecision, step: StepInput):
        """A bucket step: lengths, row ids and merge offsets into the pinned arena, one copy, and
        the block tables. Planned on the host: its structure (one decode launch per bucket, grid
        padded rows x H_kv x S, and a merge where S > 1) is the graph's shape, which the host must
        know to pick the graph to replay; a device-built bucket plan would need a device-to-host
        sync per step or a graph of the worst-case bucket count."""
        L, a, b = self._layout, s.arena_np, step.seq.size
        a[L.seq_lens:L.seq_lens + b] = step.seq
        structure, used = stage_bucket(a, L, d.plan)
        self._arena[:used].copy_(s.arena[:used], non_blocking=True)
        n = self._stage_block_tables(s, step)
        self._bt_flat[:n].copy_(s.bt[:n], non_blocking=True)
        self._counts["h2d_copies"] += 2
        return structure

    def _stage_block_tables(self, s: _Staging, step: StepInput) -> int:
        """Write the B x max_pages entries the kernels may read into pinned staging; return the
        elements to copy: one contiguous range of rows 0..B-1 (row stride max_pages_per_row,
        the kernels' bt_stride; the tails are never read)."""
        b, w = step.seq.size, step.max_pages
        s.bt_np[:b, :w] = step.block_tables[:, :w]
        return (b - 1) * self.max_pages_per_row + w

    def _stage_flashinfer(self, s: _Staging, plan, b: int) -> int:
        nnz = plan.indices.size
        s.fi_indptr.numpy()[:b + 1] = plan.indptr
        s.fi_lpl.numpy()[:b] = plan.last_page_len
        s.fi_indices.numpy()[:nnz] = plan.indices
        idx = self._fi_indices[:nnz]
        idx.copy_(s.fi_indices[:nnz], non_blocking=True)
        self._counts["h2d_copies"] += 1
        return self._fi.plan(s.fi_indptr[:b + 1], idx, s.fi_lpl[:b])

    # -- running ---------------------------------------------------------------------------

    def static_q(self, batch: int) -> torch.Tensor:
        """The static q buffer as [batch, H_q, D]. Write q here and pass it to run() (with
        ``out=static_out(batch)``): graphs then read it in place, no staging copies."""
        if not 1 <= batch <= self.max_batch:
            raise ValueError(f"Runtime.static_q: batch={batch}: expected 1..max_batch={self.max_batch}")
        return self._sq[:batch]

    def static_out(self, batch: int) -> torch.Tensor:
        """The static out buffer as [batch, H_q, D] (see :meth:`static_q`)."""
        if not 1 <= batch <= self.max_batch:
            raise ValueError(f"Runtime.static_out: batch={batch}: expected 1..max_batch={self.max_batch}")
        return self._so[:batch]

    def run(self, q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
            out: torch.Tensor | None = None, *, k_scale: torch.Tensor | None = None,
            v_scale: torch.Tensor | None = None) -> torch.Tensor:
        """Decode attention of the planned step for one layer. Call once per layer.

        Parameters
        ----------
        q : [B, H_q, D], B = the batch of the last plan(). k_cache, v_cache :
            [num_pages, H_kv, page_size, D] (HND), the Runtime's kv_dtype. out : [B, H_q, D] or
            None (allocated then: pass ``out`` for an allocation-free call).
        k_scale, v_scale : FP8 KV cache (``kv_dtype=torch.float8_e4m3fn``) only, and required
            then: float32 [1] (per tensor) or [H_kv] (per KV head) contiguous tensors on the
            Runtime's device, this layer's dequantization scales (K = e4m3 * k_scale[head]). The
            kernels read them when they run: a graph replay uses the values they hold then, so
            update them in place (``copy_``) to change scales without re-capture; another tensor
            is another graph key. With ``validate`` their values (finite, > 0) are read back once
            per tensor and again after each in-place change made through PyTorch (its version
            counter; one device sync each time, never during capture).

        Returns
        -------
        out : [B, H_q, D].

        With graphs, a call replays the graph keyed by the step and these tensors
        (:mod:`pkvrt.graphs`). q/out that are :meth:`static_q`/:meth:`static_out` are read and
        written in place. Other q/out tensors: the first time a key is seen, q is copied into the
        static buffer, the static graph replayed and the static out copied to ``out`` (2 device
        copies, ``stats()['staging_copies']``); a key seen again gets its own graph, reading q
        and writing out in place. A miss captures (a device sync and ~ms, ``stats()``).

        Raises
        ------
        ValueError naming the tensor (dtype, device, shape, layout, page ids beyond num_pages, a
        missing, misshapen or non-finite scale); nothing is launched and ``out`` is untouched
        then. RuntimeError before any plan().
        """
        st = self._step
        if st is None:
            raise RuntimeError("Runtime.run: no step planned; call plan(seq_lens, block_tables) once "
                               "per decode step first")
        check_run_args(q, k_cache, v_cache, out, batch=st.batch, num_qo_heads=self.num_qo_heads,
                       num_kv_heads=self.num_kv_heads, head_dim=self.head_dim, page_size=self.page_size,
                       dtype=self.dtype, device=self.device, max_page_id=st.max_page_id,
                       kv_dtype=self.kv_dtype, k_scale=k_scale, v_scale=v_scale)
        if self._dp_routes:
            self._check_page_bound(k_cache.shape[0])
        capturing = self._capturing()
        if self._fp8 and self.validate and not capturing:
            self._check_scale_values(k_cache, v_cache, k_scale, v_scale)
        if out is None:
            out = torch.empty_like(q)
        if self.use_cuda_graph and capturing:
            raise RuntimeError(_NESTED_CAPTURE.format("run"))
        scales = (k_scale, v_scale)
        if not self.use_cuda_graph or (st.kind == "flashinfer" and not self._fi.cuda_graph):
            self._launch(st, q, k_cache, v_cache, out, scales, early_kv=st.runs > 0)
            st.runs += 1
            self._counts["eager_runs"] += 1
            return out
        # The scale tensors are baked in by address, like the caches (their values are read at replay).
        kv = (graphs.tensor_key(k_cache), graphs.tensor_key(v_cache))
        if self._fp8:
            kv += (graphs.tensor_key(k_scale), graphs.tensor_key(v_scale))
        head = (st.route, st.kind, st.gbatch, st.structure, self._generation, kv)
        if q.data_ptr() == self._sq_ptr and out.data_ptr() == self._so_ptr:
            self._run_static(st, head, k_cache, v_cache, scales)
            return out
        key = head + ((graphs.tensor_key(q), graphs.tensor_key(out)),)
        e = self._graphs.get(key)
        if e is not None:
            e.graph.replay()
            self._counts["replays"] += 1
        elif self._seen.check_and_add(key):
            self._capture(key, lambda: self._launch(st, q, k_cache, v_cache, out, scales))
        else:
            self._sq[:st.batch].copy_(q)
            self._run_static(st, head, k_cache, v_cache, scales)
            out.copy_(self._so[:st.batch])
            self._counts["staging_copies"] += 2
        return out

    def _check_scale_values(self, k_cache, v_cache, k_scale, v_scale) -> None:
        """validate: every scale finite and > 0 (``ops.check_kv_scales(check_values=True)``: a
        device sync), unless both tensors were checked before and not changed in place through
        PyTorch since (same address, same ``Tensor._version``); ValueError naming the scale."""
        if all(self._scale_versions.get(s.data_ptr()) == s._version for s in (k_scale, v_scale)):
            return
        try:
            ops.check_kv_scales(k_cache, v_cache, k_scale, v_scale, check_values=True)
        except ops.KernelArgumentError as e:
            raise ValueError(f"Runtime.run: {e}") from None
        if len(self._scale_versions) > 4096:   # bounded: addresses of freed tensors are dropped
            self._scale_versions.clear()
        for s in (k_scale, v_scale):
            self._scale_versions[s.data_ptr()] = s._version

    def _run_static(self, st: _Step, head: tuple, k_cache, v_cache, scales=(None, None)) -> None:
        key = head + (graphs.STATIC,)
        e = self._graphs.get(key)
        if e is not None:
            e.graph.replay()
            self._counts["replays"] += 1
            return
        gb = st.gbatch
        self._capture(key, lambda: self._launch(st, self._sq[:gb], k_cache, v_cache, self._so[:gb],
                                                scales))

    def _capture(self, key, launch) -> None:
        import time

        t0 = time.perf_counter()
        entry = graphs.capture(launch, side_stream=self._side, pool=self._pool, device=self.device)
        self._graphs.put(key, entry)
        self._counts["captures"] += 1
        self._counts["capture_seconds"] += time.perf_counter() - t0

    def _views(self, st: _Step):
        """Launch views of the static buffers for this step (built once per step)."""
        if st.views is None:
            if st.kind == "bucket":
                a = self._arena
                st.views = [(a[r:r + pad], s, None if m is None else a[m:m + pad + 1])
                            for r, pad, s, m in bucket_sections(self._layout, st.structure)]
            elif st.kind in ("workqueue", "fused"):
                L, cap, gb = self._layout, st.structure, st.gbatch
                tasks = self._arena[L.tasks:L.tasks + 5 * cap].view(cap, 5)
                offsets = self._arena[L.split_offsets:L.split_offsets + gb + 1]
                counters = self._counters[:gb] if st.kind == "fused" else None
                st.views = (tasks, offsets, counters)
        return st.views

    def _launch(self, st: _Step, q, k_cache, v_cache, out, scales=(None, None),
                early_kv: bool = False) -> None:
        """The step's kernel launches on the current stream (what a graph captures).

        ``scales``: (k_scale, v_scale) of an FP8 cache (pointers the kernels read at run time).

        ``early_kv``: the workqueue decode may read the plan and copy its first K/V tiles before
        the previous kernel of the stream has finished (``ops.workqueue_decode``). Set by
        :meth:`run` for every launch of a step but the first when the runtime launches eagerly
        (or inside an engine's captured step): the kernel before it is then the previous
        layer's, never the plan's. The runtime's own per-layer graphs start with a graph
        boundary, where nothing overlaps, so they never set it."""
        if st.kind == "flashinfer":
            self._fi.run(q, k_cache, v_cache, out)
            return
        views = self._views(st)
        seq = self._d_seq if st.kind in DEVICE_PLANNED else self._v_seq
        pa, pm, bt = self._part_a, self._part_ml, self._bt
        sk = dict(k_scale=scales[0], v_scale=scales[1]) if self._fp8 else {}
        if st.kind == "bucket":
            for rows, s, moffs in views:
                ops.split_decode(q, k_cache, v_cache, seq, bt, rows, s, out, pa, pm, self.sm_scale, **sk)
                if moffs is not None:
                    ops.merge(pa, pm, moffs, out, row_ids=rows)
            return
        tasks, offsets, counters = views
        ops.workqueue_decode(q, k_cache, v_cache, seq, bt, tasks, self._v_num_tasks, offsets, out,
                             pa, pm, self.sm_scale, counters=counters, early_kv=early_kv, **sk)
        if st.kind == "workqueue":
            ops.merge(pa, pm, offsets, out, skip_single=True)

    # -- reporting -------------------------------------------------------------------------

    @property
    def flashinfer_available(self) -> bool:
        return self._fi is not None

    def explain(self) -> str:
        """The runtime's configuration and the last step's decision, route by route."""
        cal = self.calibration
        kv = "" if self.kv_dtype == self.dtype else f", KV {self._kv_dtype}"
        lines = [f"pkvrt.Runtime: H_q={self.num_qo_heads} H_kv={self.num_kv_heads} D={self.head_dim} "
                 f"page={self.page_size} {str(self.dtype).replace('torch.', '')}{kv}; "
                 f"{'CUDA graphs' if self.use_cuda_graph else 'eager launches'}; calibration "
                 f"{cal.slug}{' (fallback: no file for this GPU)' if cal.fallback else ''}"
                 + (f" ({cal.kv_dtype_note()})" if cal.kv_dtype_note() else "")
                 + ("; device planning (no host routing)" if self.device_planning else "")
                 + ("; workqueue/fused plans built on the GPU" if self._dp_routes else ""),
                 "flashinfer: " + ("available" + (" (tensor cores)" if self._fi.tensor_cores else " (CUDA cores)")
                                   if self._fi is not None else
                                   f"unavailable ({self._fi_reason}); steps the policy sends to it run "
                                   "on the fastest predicted PersistentKV route")]
        lines.append(self.last_decision.explain() if self.last_decision is not None else "no step planned yet")
        return "\n".join(lines)

    def stats(self) -> dict:
        """Counters since construction.

        graphs (alive), max_graphs, captures, replays, evictions, invalidations (graphs dropped
        when a buffer grew), graph_memory_bytes (estimate: ``torch.cuda.memory_allocated`` delta
        around each capture of the graphs alive; the driver's own graph memory is not visible),
        min_graph_nodes, staging_copies (q/out copies through the static buffers), h2d_copies,
        eager_runs, plans, regrowths, capture_seconds, capacities, flashinfer.
        """
        g = self._graphs
        nodes = g.node_counts()
        out = dict(self._counts)
        out.update(graphs=len(g), max_graphs=g.max_graphs, evictions=g.evictions,
                   invalidations=g.invalidations, graph_memory_bytes=g.memory_bytes(),
                   min_graph_nodes=min(nodes) if nodes else None,
                   capacities=dict(slots=self._cap.slots, tasks=self._cap.tasks,
                                   max_batch=self.max_batch, max_pages_per_row=self.max_pages_per_row),
                   flashinfer=self._fi.stats() if self._fi is not None else {"unavailable": self._fi_reason})
        return out
