"""The Runtime's static buffers: device memory its graphs read, and the pinned staging ring.

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
fused group counters   int32 [slot_capacity, H_kv], zero (two-level     16 KiB
                       tail: kernels/workqueue_task.cuh)
static q / out         dtype [pow2(max_batch), H_q, D] each              2 MiB each
FlashInfer indices     int32 [max_batch * max_pages_per_row]            8 MiB (+128 MiB workspace)
pinned staging         2 ring slots x (arena + planning head and block  ~32 MiB host
                       tables + CSR)
=====================  ==============================================  =====================

Capacities (:func:`pkvrt.runtime.graphs.initial_capacities`): PersistentKV routes run only up to the gates'
``max_active`` rows (unless forced), so partial-state slots are sized for
``pow2(min(max_batch, max max_active)) * max splits`` (seed: 8 rows * 64 = 512 slots) and tasks
for ``task_bucket(slots * H_kv)`` (4096), and at least for the planning kernel's largest grid
of every padded batch up to max_batch (:meth:`Runtime._device_capacities`; H200 calibration,
seed shape: 792 tasks at 2..64 rows, 2048 at 256), so workqueue/fused steps never grow them. A
bucket plan that needs more (a forced bucket route at B = 32, say) grows the buffer between
steps to ``max(need, 2 * old)``; growing reallocates, so every graph is dropped
(``stats()['invalidations']``). Row ids never grow: the padded rows of all buckets sum to
< 2 * B (each bucket pads r rows to pow2(r) <= 2r - 1).

Everything here is allocated at construction (and grown between steps, never during one); a
graph bakes in the addresses, so a regrowth drops every graph (``stats()['invalidations']``).
"""

from __future__ import annotations

import attrs
import numpy as np
import torch

from pkvrt.launch import ops
from pkvrt.policy.planner import device_grid_ctas
from pkvrt.runtime import graphs
from pkvrt.runtime.graphs import Capacities, arena_layout

RING = 2    # pinned staging slots


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
    fi_np: tuple | None         # numpy views of (fi_indptr, fi_lpl, fi_indices)
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
    # engine_capture with host lengths: the planning launch that the step's first run() makes
    # (the arguments of Runtime._launch_device_plan), and where it was made last: "eager", or
    # the capture sequence's id
    plan_launch: object = None
    planned_in: object = None
    # a device-planned step deferred for its page-id bound, planned outside any capture: its
    # first run() plans it, once (a capture of a later run() replays the plan, not the planning)
    plan_once: bool = False
    # a device-planned step cut at this split count of its longest row (Runtime._pin_splits),
    # None: by the route's allowed counts
    pinned: int | None = None


def _pinned(n: int, dtype=torch.int32) -> torch.Tensor:
    return torch.zeros(n, dtype=dtype, pin_memory=True)


class StaticBuffers:
    """Allocation of the Runtime's buffers (a piece of :class:`pkvrt.runtime.Runtime`)."""

    def _alloc(self, cap: Capacities) -> None:
        """(Re)allocate every capacity-sized buffer; the first call also allocates the fixed ones.
        Everything is allocated before anything is replaced, so a failed allocation (OOM) leaves
        the runtime as it was."""
        dev, hq, d = self.device, self.num_qo_heads, self.head_dim
        layout = arena_layout(self.max_batch, cap.tasks)
        arena = torch.zeros(layout.size, dtype=torch.int32, device=dev)
        part_a = torch.empty(cap.slots, hq, d, dtype=torch.float32, device=dev)
        part_ml = torch.empty(cap.slots, hq, 2, dtype=torch.float32, device=dev)
        group_counters = torch.zeros(cap.slots, self.num_kv_heads, dtype=torch.int32, device=dev)
        pinned = [_pinned(layout.size) for _ in range(RING)]
        first = not hasattr(self, "_cap")
        if first:
            nb, npg, gmax = self.max_batch, self.max_pages_per_row, graphs.padded_batch(self.max_batch)
            fi = self._fi_wanted   # the FlashInfer route may be set up (Runtime._setup_flashinfer)
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
            self._slse = torch.zeros(gmax, hq, dtype=torch.float32, device=dev)   # lse of static runs
            self._sq_ptr, self._so_ptr = self._sq.data_ptr(), self._so.data_ptr()
            self._fi_indices = torch.zeros(nb * npg, dtype=torch.int32, device=dev) if fi else None
            self._ring = []
            for _ in range(RING):
                store = _pinned(head + nb * npg)
                csr = (_pinned(nb + 1), _pinned(nb), _pinned(nb * npg)) if fi else (None,) * 3
                self._ring.append(_Staging(
                    arena=None, arena_np=None, store=store, bt=store[head:],
                    bt_np=store.numpy()[head:].reshape(nb, npg),
                    meta_np=store.numpy()[:head] if head else None,
                    fi_indptr=csr[0], fi_lpl=csr[1], fi_indices=csr[2],
                    fi_np=tuple(t.numpy() for t in csr) if fi else None))
            self._generation = 0
            # the planning launch of each (route, padded batch, grid), its arguments checked and packed
            # once (Planning._launch_device_plan): keyed by the buffers' generation, so emptied here
            self._prepared_plans: dict = {}
        else:
            for s in self._ring:  # the old pinned arenas may still be the source of queued copies
                if s.event is not None:
                    s.event.synchronize()
        for s, p in zip(self._ring, pinned):
            s.arena, s.arena_np = p, p.numpy()
        self._cap, self._layout = cap, layout
        self._arena, self._part_a, self._part_ml = arena, part_a, part_ml
        self._group_counters = group_counters
        self._v_seq = arena[layout.seq_lens:layout.seq_lens + self.max_batch]
        self._v_num_tasks = arena[layout.num_tasks:layout.num_tasks + 1]
        if not first:
            self._generation += 1
            self._graphs.clear()
            self._prepared_plans.clear()   # they point into the old arena
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
        # Runtime._pin_splits: one split count as the planning kernel's only candidate
        self._pinned_splits: int | None = None
        self._d_cands_pinned: dict[int, torch.Tensor] = {}
        # a split count the kernel before the planning kernel writes on the GPU (int32 [1]; > 0
        # replaces the candidates): SharedPagesRuntime's chunk decode, cut by find_shared's time
        # model on device lengths; None: the candidates as they are
        self._device_split_pin: torch.Tensor | None = None
        # device planning's RouteDecision per (route, rows, forced, -1), and its refusals per route name
        self._dp_decisions: dict = {}

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
