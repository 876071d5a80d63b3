"""``Runtime.run()``: one layer of the planned step, as a replay of the graph of its key.

The key (route, padded batch, structure, tensors: :func:`pkvrt.runtime.graphs.graph_key`) is
captured on its first use and replayed after; eager launches with
``RuntimeOptions(use_cuda_graph=False)`` and inside an engine's capture (device planning).
q/out that are the static buffers are read and written in place; others are copied through them.
"""

from __future__ import annotations

import torch

from pkvrt.launch import _driver, ops
from pkvrt.policy.registry import DEVICE_PLANNED
from pkvrt.runtime import graphs
from pkvrt.runtime.buffers import _Step
from pkvrt.runtime.checks import NESTED_CAPTURE, check_page_bound, check_run_args_once, hnd_view
from pkvrt.runtime.graphs import bucket_sections

# host routing with validate: no page-id bound in the planning kernel (int32 ids: all pass)
PAGE_ID_LIMIT = 2**31 - 1


class Running:
    """``run()`` and the launches a graph captures (a piece of :class:`pkvrt.runtime.Runtime`; it
    uses ``_capturing`` and ``_capture``, which the Runtime defines for plan() and run() alike)."""

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
            v_scale: torch.Tensor | None = None, sinks: torch.Tensor | None = None,
            lse: torch.Tensor | None = None, return_lse: bool = False):
        """Decode attention of the planned step for one layer. Call once per layer.

        Parameters
        ----------
        q : [B, H_q, D], B = the batch of the last plan(). k_cache, v_cache : the Runtime's
            kv_layout, HND [num_pages, H_kv, page_size, D] or NHD [num_pages, page_size, H_kv,
            D] (strided views allowed: token rows of D contiguous, 16-byte aligned), the
            Runtime's kv_dtype. out : [B, H_q, D] or None (allocated then: pass ``out`` for an
            allocation-free call).
        sinks : float32 [H_q] contiguous on the device, the layer's attention-sink logits:
            required with ``Runtime(sinks=True)``, refused otherwise. Read by the kernels when
            they run (a replay uses its current values; another tensor is another graph key).
        lse : None, or a float32 [B, H_q] contiguous tensor that receives each row's and head's
            log2-sum-exp of its scores (the sink not counted; FlashInfer's base-2 convention).
            ``return_lse=True`` allocates one (when ``lse`` is None) and returns ``(out, lse)``.
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
        out : [B, H_q, D]; ``(out, lse)`` with ``return_lse``.

        With graphs, a call replays the graph keyed by the step and these tensors
        (:mod:`pkvrt.runtime.graphs`). q/out that are :meth:`static_q`/:meth:`static_out` are read and
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
        if return_lse and lse is None and isinstance(q, torch.Tensor):
            lse = torch.empty(st.batch, self.num_qo_heads, dtype=torch.float32, device=self.device)
        fi_caches = (k_cache, v_cache)   # the FlashInfer route takes them in the caller's layout
        k_cache, v_cache = hnd_view(k_cache, self.kv_layout), hnd_view(v_cache, self.kv_layout)
        seen, sig = check_run_args_once(
            self._run_checked, q, k_cache, v_cache, out, batch=st.batch,
            num_qo_heads=self.num_qo_heads, num_kv_heads=self.num_kv_heads, head_dim=self.head_dim,
            page_size=self.page_size, dtype=self.dtype, device=self.device,
            max_page_id=st.max_page_id, kv_dtype=self.kv_dtype, k_scale=k_scale, v_scale=v_scale,
            kv_layout=self.kv_layout, sinks=sinks, lse=lse, want_sinks=self.sinks)
        if seen:   # the same tensors as a call that passed: only this step's page bound is new
            check_page_bound(st.max_page_id, k_cache.shape[0])
        capturing = self._capturing()
        if capturing and st.kind == "flashinfer" and not self._fi.cuda_graph:
            raise RuntimeError("Runtime.run: a FlashInfer step captured in your CUDA graph: its eager "
                               "wrapper re-allocates its plan buffers every plan(), so a replay would "
                               "read freed memory. Build the Runtime with engine_capture=True "
                               "(FlashInfer's CUDA-graph mode) to capture host-routed steps")
        if self._fp8 and self.validate and not capturing:
            self._check_scale_values(k_cache, v_cache, k_scale, v_scale)
        if self._dp_routes:   # after every check that can refuse this run(): it may set the bound
            self._check_page_bound(k_cache.shape[0])
        if out is None:
            out = torch.empty_like(q)
        if self.use_cuda_graph and capturing and not self.device_planning:
            raise RuntimeError(NESTED_CAPTURE.format("run"))
        if st.kind == "flashinfer" and not self._fi.cuda_graph:
            # FlashInfer's eager wrapper (its direct call from the third layer on): no planning
            # kernel to launch, no graph, no early_kv; nothing else between run() and FlashInfer
            self._fi.run(q, *fi_caches, out, lse)
            st.runs += 1
            self._counts["eager_runs"] += 1
            return (out, lse) if return_lse else out
        scales = (k_scale, v_scale, sinks, lse, fi_caches)
        if not self.use_cuda_graph or capturing:   # (capturing: device planning in the engine's graph)
            # early_kv from the second run() of the step on, except on a run() that launches the
            # step's planning kernel itself (engine_capture with host lengths: the first eager
            # run() after plan() and the first of every capture), whose decode must wait for the
            # plan. A step whose planning kernel plan() launched before an engine's capture (the
            # host_cost ablations of engine_capture) gets it on its first captured layer too,
            # st.runs counting the warm-up: safe, that kernel precedes the graph's launch. (Device
            # planning captures plan() itself: a new step, so its first captured run() has
            # st.runs == 0.)
            planned = self._launch_deferred_plan(st, capturing)
            self._launch(st, q, k_cache, v_cache, out, scales, early_kv=st.runs > 0 and not planned)
            st.runs += 1
            self._counts["eager_runs"] += 1
            return (out, lse) if return_lse else out
        # a device-planned first step, planned before any cache was seen: its planning launch,
        # now that _check_page_bound set the bound (Planning._plan_on_device)
        self._launch_deferred_plan(st, capturing)
        st.runs += 1   # layers per plan: what the router weighs host time at (Planning.plan)
        # The scale tensors are baked in by address, like the caches (their values are read at replay).
        # graphs.tensor_key of each tensor: the first four fields of its entry in the signature
        # (computed once per call: a tensor's attribute reads are most of run()'s host time)
        kv = (sig[2][:4], sig[3][:4])
        if self._fp8:
            kv += (sig[5][:4], sig[6][:4])
        if sinks is not None or lse is not None:   # baked in by address, like the caches
            kv += (sig[7] and sig[7][:4], sig[8] and sig[8][:4])
        head = (*self.step_key, kv)
        qk = sig[1][:4]
        ok = sig[4][:4] if sig[4] is not None else graphs.tensor_key(out)   # out=None: allocated
        if qk[0] == self._sq_ptr and ok[0] == self._so_ptr:
            self._run_static(st, head, k_cache, v_cache, scales)
            return (out, lse) if return_lse else out
        key = head + ((qk, ok),)
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
        return (out, lse) if return_lse else out

    def _launch_deferred_plan(self, st: _Step, capturing: bool) -> bool:
        """The step's planning kernel, which plan() left to the step's first run()
        (``st.plan_launch``): engine_capture with host lengths, and a device-planned step
        planned before any cache was seen (its page-id bound comes from that run()'s cache). It
        is launched by the first run() after the plan() eagerly and by the first run() of every
        capture (each capture sequence has its own id: an engine's warm-up-then-capture plans in
        both, so the graph holds the planning kernel and every replay plans from the lengths its
        plan() copied); a device-planned step whose plan() ran outside any capture
        (``st.plan_once``) is planned by its first run() only. Returns whether it launched."""
        if st.plan_launch is None or (st.plan_once and st.planned_in is not None):
            return False
        where = _driver.capture_id() if capturing else "eager"
        if where == st.planned_in:
            return False
        self._launch_device_plan(*st.plan_launch, pinned=st.pinned)
        st.planned_in = where
        return True

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

    def _run_static(self, st: _Step, head: tuple, k_cache, v_cache,
                    scales=(None, None, None, None, None)) -> None:
        """The static graph of the step: q and out are the static buffers of the padded batch,
        and so is an lse output (copied to the caller's after the replay: one small copy)."""
        key = head + (graphs.STATIC,)
        gb, lse = st.gbatch, scales[3]
        if lse is not None:
            scales = (*scales[:3], self._slse[:gb], scales[4])
        e = self._graphs.get(key)
        if e is not None:
            e.graph.replay()
            self._counts["replays"] += 1
        else:
            self._capture(key, lambda: self._launch(st, self._sq[:gb], k_cache, v_cache,
                                                    self._so[:gb], scales))
        if lse is not None:
            lse.copy_(self._slse[:st.batch])

    def _check_page_bound(self, cache_pages: int) -> None:
        """The planning kernel checks page ids against ``num_pages``. Device planning: a cache
        with fewer pages would let an unchecked id through, so it is refused; without
        ``num_pages`` the first cache sets the bound (a step planned before it is planned by
        this run(), after the bound is set). Host routing with ``validate`` and no
        ``engine_capture``: every step's ids are checked on the host (>= 0, and below a given
        ``num_pages``, at plan(); below this cache's pages at run(), before any launch reads the
        cache), so the kernel's bound is the given ``num_pages`` or none (PAGE_ID_LIMIT): a
        bound from an earlier, smaller cache would give a later step's valid ids no work, a
        wrong output. Otherwise (no ``validate``, or an engine's replays that call no run()):
        the smallest cache given so far. Never an error."""
        if not self.device_planning:
            if self.validate and not self.engine_capture:
                if self._num_pages is None:
                    self._num_pages = PAGE_ID_LIMIT
                    self._d_num_pages.fill_(self._num_pages)
            elif self._num_pages is None or cache_pages < self._num_pages:
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

    def _launch(self, st: _Step, q, k_cache, v_cache, out, scales=(None, None, None, None, None),
                early_kv: bool = False) -> None:
        """The step's kernel launches on the current stream (what a graph captures).

        ``scales``: (k_scale, v_scale, sinks, lse, the caches in the caller's layout): an FP8
        cache's scales, the layer's sinks and lse output (pointers the kernels read or write
        at run time), and what a FlashInfer step is given.

        ``early_kv``: the workqueue decode may read the plan and copy its first K/V tiles before
        the previous kernel of the stream has finished (``ops.workqueue_decode``). Set by
        :meth:`run` for every launch of a step but the first when the runtime launches eagerly
        (or inside an engine's captured step), and never on a launch whose run() launched the
        planning kernel just before it (engine_capture): the kernel before it is then the
        previous layer's, never the plan's. The runtime's own per-layer graphs start with a graph
        boundary, where nothing overlaps, so they never set it."""
        k_scale, v_scale, sinks, lse, fi_caches = scales
        if st.kind == "flashinfer":
            self._fi.run(q, *(fi_caches or (k_cache, v_cache)), out, lse)
            return
        views = self._views(st)
        seq = self._d_seq if st.kind in DEVICE_PLANNED else self._v_seq
        pa, pm, bt = self._part_a, self._part_ml, self._bt
        sk = dict(k_scale=k_scale, v_scale=v_scale) if self._fp8 else {}
        var = dict(logits_soft_cap=self.logits_soft_cap, sinks=sinks, lse=lse)
        tail = dict(sinks=sinks, lse=lse)   # the merge: where O of multi-split rows is written
        if st.kind == "bucket":
            for rows, s, moffs in views:
                ops.split_decode(q, k_cache, v_cache, seq, bt, rows, s, out, pa, pm, self.sm_scale,
                                 window_left=self.window_left, **var, **sk)
                if moffs is not None:
                    ops.merge(pa, pm, moffs, out, row_ids=rows, **tail)
            return
        tasks, offsets, counters = views
        # the fused tail in two levels where the kernel's rule says (ops.workqueue_decode)
        two = (dict(group_counters=self._group_counters)
               if counters is not None and self.options.fused_two_level_tail else {})
        ops.workqueue_decode(q, k_cache, v_cache, seq, bt, tasks, self._v_num_tasks, offsets, out,
                             pa, pm, self.sm_scale, counters=counters, early_kv=early_kv, **two, **var, **sk)
        if st.kind == "workqueue":
            ops.merge(pa, pm, offsets, out, skip_single=True, **tail)
