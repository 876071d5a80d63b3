"""``Runtime.plan()``: the step's route, its plan staged or built on the GPU, nothing synchronized.

Host lengths: check the step (:mod:`pkvrt.runtime.checks`), let the router choose, then stage it:
a workqueue/fused step copies lengths and block-table rows to the planning buffers (one copy
from pinned staging) and replays the planning graph; a bucket step stages its host plan; a
FlashInfer step gathers its CSR into pinned staging (the router builds none for it), copies the
indices once and runs FlashInfer's plan. Device lengths (``device_planning``): with the Runtime's
graphs off (how an engine captures plan() and run() in its own graph) one launch of the planning
kernel, which copies the lengths and the block-table entries they use into the runtime's buffers
itself (direct mode); with them on (or CPU / strided inputs) two device copies, the device
scalars and the planning graph.
"""

from __future__ import annotations

import attrs
import numpy as np
import torch

from pkvrt import _buildspec
from pkvrt.launch import ops
from pkvrt.policy import fallback
from pkvrt.policy.blocktables import write_csr
from pkvrt.policy.planner import check_seq_lens, device_plan_targets
from pkvrt.policy.registry import DEVICE_PLANNED, SplitBounds
from pkvrt.policy.router import RouteDecision
from pkvrt.runtime import graphs
from pkvrt.runtime.buffers import RING, _Staging, _Step
from pkvrt.runtime.checks import (StepInput, check_device_step, check_page_bound,
                                  check_step, used_page_id_max)
from pkvrt.runtime.graphs import Capacities, grow, needed_capacities, stage_bucket


# _launch_device_plan(pinned=PIN_NOW): the split count the Runtime is pinned to when it plans
# (None already means "not pinned": the route's allowed counts)
PIN_NOW = object()


class Planning:
    """``plan()`` and the staging behind it (a piece of :class:`pkvrt.runtime.Runtime`; it uses
    ``_capturing`` and ``_capture``, which the Runtime defines for plan() and run() alike)."""

    # Device planning with the Runtime's graphs off plans in one launch when the step's inputs
    # are contiguous device tensors (direct mode). benches/plan_cost.py clears it to time the
    # copy path at one row, where no tensor is strided ([1] is always contiguous).
    _direct_plan = True

    def plan(self, seq_lens, block_tables, *, force: str | None = None,
             _checked: StepInput | None = None) -> RouteDecision:
        """Choose this step's route and enqueue its plan. Call once per decode step.

        Host lengths (the default): check the step, let the router choose the route, then for a
        workqueue/fused route copy the lengths and block-table rows into the planning buffers
        (one H2D copy from pinned staging) and replay the planning graph, which builds the
        tasks on the GPU; a bucket route stages its host plan (two copies); FlashInfer plans
        itself. Nothing synchronizes (unless the host runs two steps ahead of the GPU). With
        ``engine_capture`` the planning kernel is not launched here but by the step's first
        run() (which an engine's graph of the step captures).

        Parameters
        ----------
        seq_lens : int [B], tokens per row including the new one (>= 1): a CPU int32 numpy
            array or (pinned) CPU tensor for host routing. int32 CUDA tensors at a Runtime's
            first plan() make it a device-planning Runtime (unless built with
            ``device_planning=False``: then a CUDA tensor costs one synchronizing D2H copy, the
            router runs on the host). With device planning a length of 0 is an idle row (an
            engine's padding row of a captured batch size): no work, its output row not
            written, no status flag; host lengths refuse it.
        block_tables : int [B, max_pages], logical -> physical page; entries past a row's
            ceil(seq_len / page_size) pages are never read (padding, e.g. -1). On the same side
            as seq_lens.
        force : a route name of routes.toml to run regardless of gates and margins (ablations,
            tests); None: the policy decides.

        Returns
        -------
        RouteDecision (also ``self.last_decision``); ``explain()`` says why. Its ``plan`` is None
        for a workqueue/fused route (built on the GPU; ``self.router.full_plan(route, seq_lens)``
        gives the identical host twin); a FlashInfer route's carries its counters only (its CSR
        is gathered into the Runtime's staging; ``self.router.full_plan(route, seq_lens,
        block_tables)`` gives the arrays).

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
        if self._mode_open and self._gpu_lengths(seq_lens):   # built without device_planning
            self._enter_device_planning(seq_lens, block_tables, force)
        capturing = self._capturing()
        if capturing:
            if not self.device_planning:
                raise RuntimeError("Runtime.plan: called during CUDA-graph capture; host planning "
                                   "stages the plan in host memory and cannot be captured. Call "
                                   "plan() before your capture and capture only run() (with "
                                   "engine_capture=True, a graph per Runtime.step_key), or build "
                                   "the lengths on the GPU (device planning) to capture plan() too")
        if self.device_planning:
            return self._plan_on_device(seq_lens, block_tables, force, capturing)
        # _checked: a SharedPagesRuntime's step, checked there with this Runtime's bounds
        step = _checked if _checked is not None else \
            check_step(seq_lens, block_tables, page_size=self.page_size, max_batch=self.max_batch,
                       max_pages_per_row=self.max_pages_per_row, validate=self.validate)
        if self._mode_open:   # host lengths that passed their checks decide the mode
            self._enter_host_lengths()
        b = len(step.lens)
        if self._num_pages is not None and (self.engine_capture or self._num_pages_given):
            # engine_capture: the engine replays its graph without calling run(), where ids are
            # checked otherwise; a num_pages the caller gave bounds every step's ids (the planning
            # kernel would give a row with a larger one no work)
            check_page_bound(step.max_page_id, self._num_pages, bound="num_pages",
                             where="Runtime.plan (engine_capture: checked here, an engine's replays "
                                   "call no run()): block_tables" if self.engine_capture else
                                   "Runtime.plan: block_tables")
        if self._captured_policy and force is None:
            d = self._captured_decision(b, max(step.lens))   # routes.toml's [device_planning] route
        else:
            # no block tables: a FlashInfer step's CSR is gathered into staging below, from
            # the pages check_step counted (the router's to_csr would check and copy them again)
            if self._step is not None and self._step.runs:
                self._layers = self._step.runs   # the last step's run() calls: layers per plan
            # (a windowed Runtime's router routes on the window: Router(window_left=))
            d = fallback.decide(self.router, step.seq, None, force=force,
                                flashinfer_unavailable=self._fi_reason,
                                fallback_memo=self._fallback_memo, lens=step.lens, layers=self._layers)
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
        # a FlashInfer step's CSR is gathered (and, without validate, its ids checked) first: a
        # bad id raises here, with the previous plan still in effect
        nnz = self._gather_flashinfer(s, step) if d.kind == "flashinfer" else 0
        self._step = None   # until this step is fully enqueued: a failure below leaves no plan
        deferred = None
        if d.kind == "flashinfer":
            structure, gb = self._plan_flashinfer(s, b, nnz), b
        elif on_gpu:
            structure, deferred = self._stage_device_plan(s, self._dp_routes[d.route], step)
            gb = graphs.padded_batch(b)
        else:
            structure, gb = self._stage_bucket(s, d, step), graphs.padded_batch(b)
        self._record(s.event)
        self._step = _Step(route=d.route, kind=d.kind, batch=b, gbatch=gb, structure=structure,
                           max_page_id=step.max_page_id, plan_launch=deferred,
                           pinned=self._pinned_splits if on_gpu else None)
        self.last_decision = d
        self._counts["plans"] += 1
        return d

    def _pin_splits(self, splits: int | None) -> None:
        """Cut the device-planned steps planned from now on with their longest row in ``splits``
        splits (the planning kernel given that one count as its candidates; a count shorter than
        the calibration's least split falls back as the kernel's rule does), or, None, by the
        route's allowed counts (the default). Exact either way: only the cut moves. For a
        SharedPagesRuntime's chunk decode, whose cut the time model picks or an option pins
        (``RuntimeOptions.shared_chunk_cut``). Call it before plan(), outside any capture: the
        candidate's device tensor is made here."""
        if splits is not None and splits not in self._d_cands_pinned:
            self._d_cands_pinned[splits] = torch.tensor([splits], dtype=torch.int32, device=self.device)
        self._pinned_splits = splits

    def _plan_unchanged(self) -> RouteDecision | None:
        """A new step on the last plan, for a caller that knows this step's lengths and block
        tables equal the last plan()'s (a SharedPagesRuntime's chunk decode: its lengths and
        tables are read-only arrays of the sharing structure, the same objects while the step
        shares what the last one did). What plan() would stage is already in the Runtime's
        device buffers, which only plan() writes, and a plan serves any number of run() calls,
        so the step's layers run on it as more layers of the last step would. Restarts the
        step's run() count, so its first run() does not read the plan early. Returns the last
        decision, or None where plan() must run: no plan in effect, device planning (its lengths
        live on the GPU), a FlashInfer step (its wrapper's per-step state), a plan cut at another
        pinned split count than the Runtime's now (:meth:`_pin_splits`), or a router's route
        decided at another layer count than the last step ran (the layers per plan plan() would
        weigh host time at; the captured policy's route does not depend on them)."""
        st = self._step
        if st is None or self.device_planning or st.kind == "flashinfer" or \
                st.pinned != self._pinned_splits:
            return None
        if st.runs and st.runs != self._layers and not self._captured_policy:
            return None
        st.runs = 0
        self._counts["plans_kept"] += 1
        return self.last_decision

    def predict_step_us(self, seq_lens, *, splits: int | None = None) -> float:
        """The device µs this Runtime's policy predicts for a step of ``seq_lens`` (host lengths)
        on the route plan() would take, with nothing planned or staged: the router's decision
        (FlashInfer unavailable: its fallback; ``engine_capture`` with the device-planning
        policy: routes.toml's ``[device_planning]`` route), timed by the calibration's model.
        ``splits``: that route cut with its longest row in this many splits (:meth:`_pin_splits`;
        the device-planning policy only)."""
        seq = check_seq_lens(seq_lens)
        lens = seq.tolist()
        if self._captured_policy:
            route = self.registry.device_planning_route(len(lens), self.router.group_size,
                                                        self._window_tokens)
            if splits is not None:
                route = attrs.evolve(route, splits=SplitBounds(min=splits, max=splits, multiple_of=1))
        elif splits is not None:
            raise ValueError("Runtime.predict_step_us: splits= needs the device-planning policy "
                             "(engine_capture with host lengths)")
        else:
            d = fallback.decide(self.router, seq, None, flashinfer_unavailable=self._fi_reason,
                                fallback_memo=self._fallback_memo, lens=lens, layers=self._layers)
            t = d.predicted_us.get(d.route)
            if t is not None:
                return t
            route = self.registry.route(d.route)   # the baseline, unpredicted by the gates
        if self.router.window_left >= 0:
            seq = np.minimum(seq, self.router.window_left + 1)
        return self.router.predict(route, seq)

    def _plan_on_device(self, seq_lens, block_tables, force: str | None,
                        capturing: bool) -> RouteDecision:
        """plan() with device-side planning (see the constructor's ``device_planning``)."""
        seq, bt = check_device_step(seq_lens, block_tables, device=self.device,
                                    max_batch=self.max_batch)
        b = seq.shape[0]
        route = self._device_route(b, force, "Runtime.plan")
        w = min(bt.shape[1], self.max_pages_per_row)
        if capturing and (seq.device != self.device or bt.device != self.device):
            raise ValueError("Runtime.plan: seq_lens/block_tables on the CPU during CUDA-graph "
                             "capture: the graph would read host memory captured by address; "
                             f"pass int32 tensors on {self.device}")
        rows, max_seq = b, w * self.page_size
        # (inside an engine's capture the Runtime's own graphs are off: launches go into it)
        direct = (self._direct_plan and (capturing or not self.use_cuda_graph) and seq.device == self.device
                  and bt.device == self.device and seq.is_contiguous() and bt.is_contiguous())
        src = dict(src_seq_lens=seq, src_block_tables=bt, rows=rows, max_seq=max_seq) if direct else None
        stage = None if direct else (lambda: self._stage_device_inputs(seq, bt, b, w, rows, max_seq, capturing))
        return self._enqueue_device_step(route, b, src, stage, force, capturing)

    def plan_csr(self, indptr: torch.Tensor, indices: torch.Tensor, last_page_len: torch.Tensor, *,
                 force: str | None = None) -> RouteDecision:
        """plan() of a step given as FlashInfer's paged-KV CSR on the GPU (device planning, the
        Runtime's graphs off, as the drop-in wrapper's CUDA-graph mode runs it): row r's pages are
        ``indices[indptr[r]:indptr[r + 1]]`` and its length ``(pages - 1) * page_size +
        last_page_len[r]`` (0 for a row of no pages: an engine's padding row). One launch: the
        planning kernel reads the CSR itself (no block table is built before it).

        indptr [B + 1], indices [nnz >= indptr[B]] and last_page_len [B]: contiguous int32
        tensors on the Runtime's device, B <= max_batch. Only shapes, dtypes and devices are
        checked here; the values on the GPU (:meth:`device_status`: a decreasing indptr, one past
        ``indices``, a last_page_len outside [1, page_size] or a row of more than
        max_pages_per_row pages is a bad length, bit 1; page ids against ``num_pages``, bit 2).

        Raises ValueError naming the argument; RuntimeError for a Runtime without device planning
        or with its own graphs on (plan with block tables then)."""
        if self._mode_open:
            raise RuntimeError("Runtime.plan_csr: the Runtime has no planning mode yet: build it "
                               "with device_planning=True")
        if not self.device_planning or (self.use_cuda_graph and not self._capturing()):
            raise RuntimeError("Runtime.plan_csr: needs device planning with the Runtime's own graphs "
                               "off (RuntimeOptions(use_cuda_graph=False), or inside a capture); "
                               "plan(seq_lens, block_tables) otherwise")
        for name, t, dims in (("indptr", indptr, 1), ("indices", indices, 1), ("last_page_len", last_page_len, 1)):
            if not isinstance(t, torch.Tensor) or t.dtype != torch.int32 or t.device != self.device \
                    or t.dim() != dims or not t.is_contiguous():
                got = (f"{t.dtype} {tuple(t.shape)} on {t.device}" if isinstance(t, torch.Tensor)
                       else type(t).__name__)
                raise ValueError(f"Runtime.plan_csr: {name}: expected a contiguous 1-D int32 tensor "
                                 f"on {self.device}, got {got}")
        b = last_page_len.shape[0]
        if not 1 <= b <= self.max_batch:
            raise ValueError(f"Runtime.plan_csr: last_page_len: expected 1 to max_batch = "
                             f"{self.max_batch} rows, got {b}")
        if indptr.shape[0] != b + 1:
            raise ValueError(f"Runtime.plan_csr: indptr: expected [batch + 1 = {b + 1}], got "
                             f"{tuple(indptr.shape)}")
        if indices.shape[0] >= 2**31:
            raise ValueError(f"Runtime.plan_csr: indices: expected fewer than 2**31 entries, got "
                             f"{indices.shape[0]}")
        return self._plan_csr(indptr, indices, last_page_len, b, force)

    def _plan_csr(self, indptr, indices, last_page_len, b: int, force: str | None = None) -> RouteDecision:
        """:meth:`plan_csr` of arguments already checked (the drop-in wrapper's CSR buffers,
        checked once when it was built; ``b`` their batch)."""
        route = self._device_route(b, force, "Runtime.plan_csr")
        src = dict(src_indptr=indptr, src_last_page_len=last_page_len, src_block_tables=indices,
                   rows=b, max_seq=self.max_pages_per_row * self.page_size)
        return self._enqueue_device_step(route, b, src, None, force, self._capturing())

    def _device_route(self, b: int, force: str | None, where: str):
        """The workqueue/fused route of a device-planned step of ``b`` rows: routes.toml's
        ``[device_planning]`` table, or ``force``; ValueError naming ``force`` (and ``where``,
        the method called) otherwise."""
        # routes.toml [device_planning]: `route`, `small_route` for steps of <= small_rows rows,
        # `large_group_route` for a Runtime of G >= large_group (and no window shorter than
        # large_group_min_window)
        name = force if force is not None else \
            self.registry.device_planning_route(b, self.router.group_size, self._window_tokens).name
        route = self._dp_routes.get(name)
        if route is None:
            raise ValueError(f"{where}: force={force!r}: with device_planning expected one of "
                             f"the workqueue/fused routes {sorted(self._dp_routes)}")
        if self._kv_dtype not in route.kv_dtypes:
            raise ValueError(f"{where}: force={force!r}: route {name!r} does not serve KV dtype "
                             f"{self._kv_dtype} (kv_dtypes = {list(route.kv_dtypes)} in routes.toml)")
        return route

    def _enqueue_device_step(self, route, b: int, src: dict | None, stage, force: str | None,
                             capturing: bool) -> RouteDecision:
        """Enqueue a device-planned step of ``b`` rows on ``route``: the planning kernel in direct
        mode reading ``src`` (``ops.plan_workqueue_device``'s ``src_*``, ``rows``, ``max_seq``),
        or, ``src`` None, after ``stage()`` copied the step into the planning buffers."""
        gb = graphs.padded_batch(b)
        self._step = None   # until this step is fully enqueued: a failure below leaves no plan
        # Before any cache has been seen (no num_pages at construction, no run() yet) the
        # planning kernel has no page-id bound, so the step's planning launch waits for its
        # first run(), which sets the bound from its cache (Running._check_page_bound) and then
        # launches it: no step is ever planned with unchecked page ids.
        deferred = None
        if self._num_pages is None:
            if src is None:
                stage()
            grid = self._device_grid_tasks(route, gb)
            deferred = (route, gb, grid, src)
        elif src is not None:
            # Direct: one launch, the planning kernel copies the lengths and the block-table
            # entries they use into the runtime's buffers (no copy or fill launch before it;
            # in an engine's captured step each of those is a dependent node: benches/NOTES.md)
            grid = self._enqueue_device_plan(route, gb, direct=src)
        else:
            stage()
            grid = self._enqueue_device_plan(route, gb)
        self._step = _Step(route=route.name, kind=route.kind, batch=b, gbatch=gb, structure=grid,
                           max_page_id=-1, plan_launch=deferred, plan_once=not capturing,
                           pinned=self._pinned_splits)
        self.last_decision = self._route_decision(route, b, forced=force is not None)
        self._counts["plans"] += 1
        return self.last_decision

    def _stage_device_inputs(self, seq, bt, b: int, w: int, rows: int, max_seq: int,
                             capturing: bool) -> None:
        """Device planning's copy path: the step's lengths and block tables into the runtime's
        buffers, and the device scalars (rows, longest length) where they changed."""
        self._d_seq[:b].copy_(seq, non_blocking=True)
        self._bt[:b, :w].copy_(bt[:, :w], non_blocking=True)
        # The device scalars are rewritten only when they change, until an engine captures a
        # plan(): its replays then rewrite them behind the host's back, so from then on always.
        self._d_scalars_cached &= not capturing
        if not self._d_scalars_cached or rows != self._d_scalars[0]:
            self._d_rows.fill_(rows)
        if not self._d_scalars_cached or max_seq != self._d_scalars[1]:
            self._d_max_seq.fill_(max_seq)
        self._d_scalars = (rows, max_seq)

    def _route_decision(self, route, b: int, *, forced: bool, max_context: int = -1) -> RouteDecision:
        """The RouteDecision of a step that runs ``route`` by routes.toml's ``[device_planning]``
        table (or forced), with no host routing; ``max_context`` -1: lengths on the GPU."""
        # the same for every step of a row count: made once (a frozen RouteDecision)
        memo_key = (route.name, b, forced, max_context)
        decision = self._dp_decisions.get(memo_key)
        if decision is None:
            others = self._dp_decisions.get(route.name)   # the refusals: one dict per route
            if others is None:
                others = self._dp_decisions[route.name] = {
                    r.name: f"routes.toml [device_planning] runs {route.name} on this step's row "
                            "count (device lengths or engine_capture: no router)"
                    for r in self.registry.routes if r.name != route.name}
            decision = RouteDecision(route=route.name, kind=route.kind, plan=None, predicted_us={},
                                     refused=others, speedup=1.0, active=b, max_context=max_context,
                                     forced=forced)
            if max_context < 0:   # host lengths (engine_capture) vary every step: not kept
                self._dp_decisions[memo_key] = decision
        return decision

    def _captured_decision(self, b: int, max_context: int) -> RouteDecision:
        """engine_capture with host lengths (``capture_routing="device_planning"``): the route of
        routes.toml's ``[device_planning]`` table for ``b`` rows, as device planning takes it."""
        route = self._dp_routes[self.registry.device_planning_route(b, self.router.group_size,
                                                                    self._window_tokens).name]
        return self._route_decision(route, b, forced=False, max_context=max_context)

    def _stage_device_plan(self, s: _Staging, route, step: StepInput):
        """A host-routed workqueue/fused step: its row count, the longest length the block-table
        buffer holds (the host checked the lengths already), the lengths and the block-table
        rows go to the planning head and the block tables in one copy from pinned staging (they
        are one allocation); then the planning kernel builds the tasks on the GPU
        (:meth:`_enqueue_device_plan`). Returns (the graph structure: the planning grid, the
        arguments of the planning launch (:meth:`_launch_device_plan`) left to the step's first
        run(): with ``_plan_launch == "run"``, else None)."""
        b, a = step.seq.size, graphs.ALIGN
        m = s.meta_np
        m[0], m[1] = b, self.max_pages_per_row * self.page_size
        m[a:a + b] = step.seq
        n = self._head + self._stage_block_tables(s, step)
        self._bt_store[:n].copy_(s.store[:n], non_blocking=True)
        self._counts["h2d_copies"] += 1
        gb = graphs.padded_batch(b)
        if self._plan_launch == "run":
            grid = self._device_grid_tasks(route, gb)
            return grid, (route, gb, grid)   # arguments, not a closure over self: no cycle
        return self._enqueue_device_plan(route, gb), None

    def _enqueue_device_plan(self, route, gbatch: int, direct=None) -> int:
        """Plan ``route`` on the GPU for the lengths, row count and block tables already enqueued
        into the planning buffers: replay the captured planning graph of (route, gbatch) (capture
        it on a miss); an eager launch with the Runtime's graphs off (``_plan_launch``). ``direct``
        (device planning with graphs off only): the kernel's direct-mode inputs, see
        :meth:`_launch_device_plan`. Returns the grid: the task slots of the padded batch
        (:meth:`_device_grid_tasks`), the same for every step of that batch, so the decode
        graphs keyed by it replay while the lengths change."""
        grid = self._device_grid_tasks(route, gbatch)   # <= the capacity sized at construction
        key = ("device-plan", route.name, gbatch, grid, self._generation, self._pinned_splits)
        launch = lambda: self._launch_device_plan(route, gbatch, grid, direct)  # noqa: E731
        assert direct is None or self._plan_launch == "eager", "a direct plan is never captured here"
        if self._plan_launch != "graph":
            launch()
        elif (e := self._graphs.get(key)) is not None:
            e.graph.replay()
            self._counts["replays"] += 1
        else:
            self._capture(key, launch)
        return grid

    def _launch_device_plan(self, route, gbatch: int, grid: int, direct=None, *,
                            pinned: int | None | object = PIN_NOW) -> None:
        """The planning kernel over the padded batch's buffers; ``direct``: the direct-mode
        arguments of ``ops.plan_workqueue_device`` (``src_*``, ``rows``, ``max_seq``), with which
        the kernel copies the step's lengths and block-table entries from those device tensors
        (or derives them from a CSR) itself.

        Every argument but ``direct``'s tensors is the Runtime's own (fixed for a buffer
        generation), so the launch is prepared once per (route, padded batch, grid) and its
        direct inputs' addresses, shapes, strides and counts (``ops.PreparedLaunch``), then
        launched as it is: the checks and the packing of a 30-field struct are not paid per
        step."""
        src = direct or {}
        # the split count the step was planned at (a deferred launch: the step's own, even if
        # the Runtime was pinned again since; PIN_NOW: the Runtime's now, at plan())
        pinned = self._pinned_splits if pinned is PIN_NOW else pinned
        key = (route.name, gbatch, grid, pinned)
        # what a direct launch checks and packs from its inputs: each tensor's address, shape,
        # strides and dtype, the row count and the longest length (the prepared launch holds no
        # reference to them: it is called only after this key matched the live inputs)
        src_key = tuple((k, v.data_ptr(), v.shape, v.stride(), v.dtype) if isinstance(v, torch.Tensor)
                        else (k, v) for k, v in src.items())
        entry = self._prepared_plans.get(key)
        if entry is None or entry[0] != src_key:
            L, cal = self._layout, self.calibration
            prepared = ops.plan_workqueue_device(
                self._d_seq[:gbatch], self._d_rows,
                self._arena[L.tasks:L.tasks + 5 * grid].view(grid, 5),
                self._v_num_tasks, self._arena[L.split_offsets:L.split_offsets + gbatch + 1],
                self._d_num_splits[:gbatch], self._d_status,
                self._d_cands[route.name] if pinned is None else self._d_cands_pinned[pinned],
                split_pin=self._device_split_pin if pinned is None else None,
                num_kv_heads=self.num_kv_heads,
                min_split_tiles=-(-cal.splits.min_split_tokens // _buildspec.TILE_TOKENS),
                max_seq_len=self._d_max_seq, block_tables=self._bt[:gbatch],
                num_pages=self._d_num_pages, page_size=self.page_size, window_left=self.window_left,
                prepare=True, **device_plan_targets(cal, route.kind), **src)
            entry = self._prepared_plans[key] = (src_key, prepared)
        entry[1]()

    def device_status(self, *, raise_on_error: bool = True) -> int:
        """The device planner's status word of the last planned step (synchronizes the stream):
        0 = fine; bit 0 = task capacity exceeded (cannot happen with the runtime's own sizing);
        bit 1 = a row's seq_len was outside [0, block-table columns * page_size] (plan_csr: or
        its indptr or last_page_len was bad) (0 is an idle
        row: an engine's padding, given no work and not flagged); bit 2 = a row's
        block table held a page id outside [0, num_pages) among the pages its length uses
        (either way that row got no work and its output row was not computed). Raises
        RuntimeError on a nonzero word unless ``raise_on_error`` is False. Host routing: the
        word of the last step if it was a workqueue/fused step (its ids checked on the GPU
        against ``num_pages``, or, without it, the smallest cache run() was given where the host
        does not check them: no ``validate``, or ``engine_capture``); 0 without a sync after a
        bucket or FlashInfer step (planned on the host). With ``engine_capture`` the planning
        kernel runs with the step (its first run(), or the replay of the engine's graph); called
        before either, this launches it first (it plans from the lengths plan() copied, so a
        replay after it plans the same step again), so the word is always the last plan()'s."""
        if not self._dp_routes:
            raise RuntimeError("Runtime.device_status: nothing is planned on the GPU (routes.toml "
                               "has no workqueue or fused route)")
        st = self._step
        if st is not None and st.kind not in DEVICE_PLANNED:
            return 0
        if st is not None and st.plan_launch is not None and st.planned_in is None:
            if self._num_pages is None:
                raise RuntimeError("Runtime.device_status: the step is not planned yet: no cache "
                                   "has been seen, so its first run() sets the page-id bound and "
                                   "plans it (or construct the Runtime with num_pages=)")
            # no run() yet: the step's word would be the previous step's
            self._launch_device_plan(*st.plan_launch)
            st.planned_in = "eager"
        word = int(self._d_status.item())
        if word and raise_on_error:
            what = []
            if word & 2:
                what.append("a row's seq_len was outside [0, block_tables columns * page_size] (with "
                            "plan_csr: or its indptr decreased or ran past the indices, or its "
                            "last_page_len was outside [1, page_size]): that row got no work and "
                            "its output row was not computed")
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

    def _gather_flashinfer(self, s: _Staging, step: StepInput) -> int:
        """A FlashInfer step's CSR (indptr, last_page_len, indices) written straight into the
        slot's pinned staging from the lengths and pages check_step counted
        (``blocktables.write_csr``: the arrays ``to_csr`` makes). Returns nnz. Without
        ``validate`` the gathered ids are still checked for negatives (a padding id would send
        FlashInfer outside the cache; one pass over nnz ids): ValueError naming the entry."""
        ip, lpl, ind = s.fi_np
        nnz = write_csr(step.lens, step.pages, step.block_tables, self.page_size, ip, lpl, ind)
        if not self.validate and nnz and int(ind[:nnz].min()) < 0:
            used_page_id_max(step.block_tables, step.pages)   # raises, naming block_tables[row, column]
        return nnz

    def _plan_flashinfer(self, s: _Staging, b: int, nnz: int) -> int:
        """Copy the gathered indices to the device buffer every wrapper reads, then FlashInfer's
        plan. Returns the serial number of the wrapper planned (the graph structure)."""
        idx = self._fi_indices[:nnz]
        idx.copy_(s.fi_indices[:nnz], non_blocking=True)
        self._counts["h2d_copies"] += 1
        return self._fi.plan(s.fi_indptr[:b + 1], idx, s.fi_lpl[:b])
