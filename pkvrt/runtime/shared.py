"""``SharedPagesRuntime``: decode steps whose rows share pages read each shared page once per
chunk of rows instead of once per row, exactly.

Per step, :meth:`~SharedPagesRuntime.plan` looks for repeated page ids in the block tables (a
bincount) and, where rows share pages, plans them with :func:`pkvrt.policy.sharing.plan_sharing`:

- the **shared** Runtime (``H_q' = H_kv * C * G`` query heads, group ``C * G``; C =
  chunk_heads // G rows per chunk, routes.toml ``[sharing] chunk_heads``, 16 shipped: the narrow
  decode body; ``RuntimeOptions.shared_chunk_rows`` asks for up to 64 // G, the wide body) runs
  one decode row per chunk over the chunk's shared pages, its query heads the chunk's rows'
  heads side by side: a K/V tile of the run is read once for C rows;
- the **own** Runtime (the model's shape) runs one decode row per own segment (a row's pages
  outside its chunks, its last page at least);
- each :meth:`~SharedPagesRuntime.run` gathers the chunks' queries (and the own segments' where
  a row has more than one), runs both (the chunk decode on a side stream beside the own decode:
  ``RuntimeOptions.shared_side_stream``), and merges each
  row's partial states with their lse (base 2) in one launch (kernels/merge.cu,
  merge_segments): ``out = sum_k 2^lse_k o_k / (sum_k 2^lse_k + e^sink)``, in float32.

A step without shared pages (or where sharing would save less than ``min_saved`` of its page
reads, or where the calibration's time model predicts the shared path slower than the plain
step: ``RuntimeOptions.shared_when_predicted_faster``) runs on the plain Runtime as it would
without this class. No sliding window (a window
cuts the shared run differently per row). Host lengths carry a step's sharing to the next
(:class:`pkvrt.policy.sharing.StepSharing`), and its decision while the steps share the same
pages and read about as many (:data:`DECISION_DRIFT`).

Device lengths (``device_planning=True``: lengths and block tables on the GPU, nothing read by
the host): one kernel (kernels/find_shared.cu) finds each step's shared prefixes from the block
tables (rows whose tables begin with the same pages: one level per leader row, the rule of
:func:`pkvrt.policy.sharing.plan_prefix_chunks`) into fixed-shape buffers, keeps them only where
the time model predicts the shared step faster (:meth:`~SharedPagesRuntime.device_rule`, decided
in the same kernel; else the buffers describe the plain step), and both decodes plan on the GPU
from them. Every step then runs the shared path's launches (B chunk slots, idle where nothing is
shared), so a captured step replays whatever the sharing; its cost on a step without sharing is
the detection, the query gather, an idle chunk decode and the merge (benches/shared_pages.py
measures it).
The query gathers are torch operations and the merge one kernel: launched eagerly per layer, or captured
with the step by an engine (``engine_capture=True``: plan() outside the capture, run() inside,
a graph per :attr:`~SharedPagesRuntime.step_key`).
"""

from __future__ import annotations

import math
import numbers

import numpy as np
import torch

from pkvrt._buildspec import TILE_TOKENS
from pkvrt.launch import ops
from pkvrt.policy import planner, sharing
from pkvrt.policy.costmodel import launch_us
from pkvrt.runtime import graphs
from pkvrt.runtime.checks import (check_device_step, check_run_args_once, check_shape, check_step,
                                  hnd_view, StepInput)
from pkvrt.runtime.core import Runtime, _StreamRecorder
from pkvrt.runtime.options import RuntimeOptions

# Host lengths: a decision to share or not (the time model's predictions of both ways) stands
# while each step shares what the step before did (the same structure: StepSharing.followed)
# and reads at most this fraction more pages than the step it was made at. The predictions
# move with the pages read, by about that fraction at most (more where a cut's split count
# changes), against routes.toml's margin of 1.10; a step of 8 rows of 2K tokens decides again
# every ~64 steps (dev box:
# a kept decision 40-55 us a plan() against 200-400 made again, sysprompt's steps, 2026-12-06).
DECISION_DRIFT = 1 / 32


class SharedPagesRuntime:
    """:class:`pkvrt.Runtime`'s ``plan()`` / ``run()`` for steps whose rows may share pages.

    Parameters: those of :class:`pkvrt.Runtime` (shape, variant, sizes, routes, calibration,
    ``engine_capture``, ``options``), except ``window_left`` (refused: no sliding window).
    ``device_planning``: False (default) host lengths, the sharing found on the host (any
    structure); True: lengths and block tables on the GPU, the shared prefixes found there
    (module docstring). ``min_saved``: the least fraction of a step's page reads sharing must
    save to be used (host lengths; default 0.1). ``num_pages``: also bounds the page-id bincount
    that finds repeats.
    """

    def __init__(self, num_qo_heads: int, num_kv_heads: int, head_dim: int, page_size: int,
                 dtype=torch.float16, *, sinks: bool = False, min_saved: float = 0.1,
                 num_pages: int | None = None, device_planning: bool = False, **runtime_kw):
        if runtime_kw.get("window_left") not in (None, -1):
            raise ValueError(f"SharedPagesRuntime: window_left={runtime_kw['window_left']!r}: shared "
                             "pages are attended whole (no sliding window)")
        runtime_kw.pop("window_left", None)
        if not isinstance(device_planning, bool):
            raise ValueError(f"SharedPagesRuntime: device_planning={device_planning!r}: expected True "
                             "(lengths on the GPU) or False (on the host)")
        self.device_planning = device_planning
        if isinstance(min_saved, bool) or not isinstance(min_saved, numbers.Real) or not 0.0 <= min_saved < 1.0:
            raise ValueError(f"SharedPagesRuntime: min_saved={min_saved!r}: expected 0 <= min_saved < 1")
        # the shape checked before G is taken from it (the Runtimes below check it again)
        self.group = check_shape(num_qo_heads, num_kv_heads, head_dim, page_size, dtype,
                                 runtime_kw.get("kv_dtype"))
        served = self._chunk_rows_served(head_dim, runtime_kw.get("kv_dtype"))
        want = getattr(runtime_kw.get("options"), "shared_chunk_rows", None)
        if want is not None and want > served:
            raise ValueError(f"SharedPagesRuntime: options.shared_chunk_rows={want}: the decode "
                             f"kernels serve at most {served} rows of G {self.group} per "
                             f"chunk at head dim {head_dim}")
        self.min_saved, self.num_pages, self.sinks = float(min_saved), num_pages, bool(sinks)
        options = runtime_kw.get("options")
        if not isinstance(options, RuntimeOptions):   # None, or a wrong type the Runtimes below name
            options = RuntimeOptions()
        self._by_prediction = options.shared_when_predicted_faster
        # the chunk decode's cut chosen here (the time model's, or a pinned count), not the partition's
        self._cut_here = options.shared_chunk_cut != "partition"
        self._cut_pinned = None if isinstance(options.shared_chunk_cut, str) else int(options.shared_chunk_cut)
        if self._cut_pinned is not None and (device_planning or not runtime_kw.get("engine_capture")):
            raise ValueError(f"SharedPagesRuntime: options.shared_chunk_cut={self._cut_pinned}: a pinned "
                             "cut applies to host lengths with engine_capture=True only (elsewhere the "
                             "chunk decode's cut is its own planner's)")
        side = self._side_option = options.shared_side_stream
        self.num_qo_heads, self.num_kv_heads, self.head_dim = num_qo_heads, num_kv_heads, head_dim
        self.page_size = page_size
        common = dict(runtime_kw, num_pages=num_pages, device_planning=device_planning)
        sm_scale = common.pop("sm_scale", None)
        sm_scale = 1.0 / math.sqrt(head_dim) if sm_scale is None else float(sm_scale)
        self.plain = Runtime(num_qo_heads, num_kv_heads, head_dim, page_size, dtype, sinks=sinks,
                             sm_scale=sm_scale, **common)
        # the own segments merge with the chunks: their sink is added once, at the merge
        self.own = (Runtime(num_qo_heads, num_kv_heads, head_dim, page_size, dtype,
                            sm_scale=sm_scale, **common) if sinks else self.plain)
        self.chunk = want if want is not None else self._chunk_rows_default(served)
        self.shared = (Runtime(num_kv_heads * self.chunk * self.group, num_kv_heads, head_dim,
                               page_size, dtype, sm_scale=sm_scale, **common)
                       if self.chunk >= 2 else None)
        self.device = self.plain.device
        self.plan_used: sharing.SharingPlan | None = None   # the last step's, None: plain
        # the last step with sharing found: its predicted µs per layer, plain and shared (a
        # decision kept from an earlier step keeps that step's prediction: DECISION_DRIFT)
        self.sharing_prediction: dict[str, float] | None = None
        # the step's index tensors, static (a captured run() reads them by address): grown,
        # never shrunk; a regrowth is a new generation (step_key)
        self._bufs: dict[str, torch.Tensor] = {}
        self._generation = 0
        # the two decodes run on the Runtimes' static q/out and these static lse buffers: their
        # graphs (own or an engine's) see the same addresses every layer and step
        if self.shared is not None:
            self._lse_v = torch.empty(self.shared.max_batch, self.shared.num_qo_heads,
                                      dtype=torch.float32, device=self.device)
            self._lse_o = torch.empty(self.own.max_batch, num_qo_heads, dtype=torch.float32,
                                      device=self.device)
        # the chunk decode's stream (CUDA only: the CPU tests' emulated kernels run in order)
        self._side = _SideStream(self.device) if side and self.shared is not None and \
            self.device.type == "cuda" else None
        self._found: dict[str, torch.Tensor] = {}   # device lengths: find_shared's outputs
        self._rules: dict[int, tuple] = {}            # device lengths: the rule per row count
        # ... and each device-planning route's split counts on the device, as the planning
        # kernels read them (made here: a host-to-device copy cannot happen in a capture)
        self._cands = {r.name: torch.tensor(r.splits.candidates(), dtype=torch.int32, device=self.device)
                       for r in self.plain.registry.routes if r.kind in ("workqueue", "fused")
                       } if device_planning and self.shared is not None else {}
        self._found_rows = 0                          # the planned step's rows (0: none)
        # device lengths: the chunk decode's split count by the time model, written by find_shared
        # every step (0: the partition's cut) and read by the chunk decode's planning kernel
        self._split_pin = None
        if device_planning and self.shared is not None:
            self._split_pin = torch.zeros(1, dtype=torch.int32, device=self.device)
            self.shared._device_split_pin = self._split_pin
        self._rows = None   # the rows of the plan in effect; None: none (no plan, or the last raised)
        self._run_checked: set = set()   # run() argument signatures that passed (checks.run_signature)
        self._chunk_times: dict[int, tuple] = {}   # host lengths: the chunk decode's µs per structure
        self._chunk_cuts: dict[int, tuple] = {}    # ... and its cut (the time model's, or pinned)
        self._cut_why = ""                          # ... and why (explain())
        self._staged: tuple | None = None   # host lengths: the structure's arrays the buffers hold
        # host lengths: the chunk Runtime's last plan (its lengths, its tables, its step)
        self._chunk_planned: tuple | None = None
        # host lengths: the decision in effect, ((_layers_now(), re-reads), the pages it was made
        # at, own_identity or None where the step runs plain, the prediction)
        self._kept: tuple | None = None
        # host lengths: what consecutive steps share, carried from one to the next
        self._steps = sharing.StepSharing(page_size, self.group, capacity=self.chunk * self.group,
                                          min_saved=self.min_saved, num_pages=num_pages)

    def _chunk_rows_default(self, served: int) -> int:
        """Rows per chunk by default: the most (at most ``served``) whose rows x G query heads fit
        routes.toml's ``[sharing] chunk_heads`` (16 in the shipped file and without the key: the
        narrow decode body). Wider chunks (the wide body: its warps split the heads over shared
        K/V stages) read a run once for more rows but, measured on an H100 with its own
        calibration (G 64 included; benches/results/h100/shared-pages-64-head-default.json), 64-head chunks ran
        slower than 16-head chunks on every step where sharing beats the plain step, and the
        time model predicted them 15-45 % faster than they ran; 32-head chunks (H200 and H100,
        benches/results/*/chunk-rows/) win on runs of at most 8 rows and lose on runs of more.
        ``RuntimeOptions.shared_chunk_rows`` overrides it per Runtime. Fewer than two rows
        (G above chunk_heads // 2): nothing shared by default."""
        return max(1, min(served, self.plain.registry.sharing_chunk_heads // self.group))

    def _chunk_rows_served(self, head_dim: int, kv_dtype) -> int:
        """Rows per chunk the kernels allow: the most whose rows x G query heads a decode kernel
        of this head dim and K/V dtype serves (64 heads at most; FP8 at D 256: 8)."""
        from pkvrt import _buildspec
        from pkvrt.launch import ops

        tag = ops.KV_TAG.get(kv_dtype) if kv_dtype is not None else None
        for rows in range(sharing.CAPACITY // self.group, 1, -1):
            if _buildspec.unserved(head_dim, rows * self.group, tag) is None:
                return rows
        return 1

    # ------------------------------------------------------------------ plan

    def plan(self, seq_lens, block_tables, *, force: str | None = None):
        """Plan the step: shared chunks and own segments where rows share pages, else the plain
        Runtime's plan. ``force``: the plain Runtime's route, no sharing. Returns the own (or
        plain) Runtime's RouteDecision.

        With ``device_planning``: int32 tensors on the GPU (``seq_lens`` [B], ``block_tables``
        [B, W]); the shared prefixes are found there (a length of 0 is an idle row: its output
        is zeros)."""
        self._rows = None   # until this plan succeeds: run() refuses after a plan() that raised
        if self.device_planning:
            d = self._plan_device(seq_lens, block_tables, force)
            self._rows = self._found_rows or len(seq_lens)
            return d
        self.plan_used = sp = None   # a failure below leaves no sharing plan in effect
        self.sharing_prediction = None
        p = self.plain
        # the caller's step checked as the plain Runtime checks it (ids named at their place in
        # the caller's table, not in the chunk or own tables made from it)
        step = check_step(seq_lens, block_tables, page_size=self.page_size, max_batch=p.max_batch,
                          max_pages_per_row=p.max_pages_per_row, validate=p.validate)
        seq, bt = step.seq, step.block_tables
        rereads = 0
        if force is None and self.shared is not None:
            # page_rereads, the structure found or carried (the step checked above)
            rereads = self._steps.step(seq, bt, _pages=step.pages)
        kept, self._kept = (self._kept if rereads and self._steps.followed else None), None
        if kept is not None and kept[0] == (self._layers_now(), rereads) and \
                self._steps.pages_used <= kept[1] * (1 + DECISION_DRIFT):
            # every step since the decision shared what it shares, and it reads about as many
            # pages: the decision stands (:data:`DECISION_DRIFT`)
            self._kept = kept
            own_identity, self.sharing_prediction = kept[2:]
            sp = self._steps.plan() if own_identity is not None else None
            if sp is None and own_identity is not None:   # it no longer saves min_saved: plain,
                self._kept = self.sharing_prediction = None   # as a fresh decision would say
        elif rereads:
            sp = self._steps.plan()
            # more chunks or own segments than a Runtime's batch (nested or alternating sharing
            # of a full batch): the step runs unshared
            if sp is not None and (sp.chunk_rows.shape[0] > self.shared.max_batch
                                   or sp.own_rows.size > self.own.max_batch):
                sp = None
            own_identity = sp is not None and self._own_reads_q(sp, len(seq))
            if sp is not None and self._by_prediction and \
                    not self._sharing_pays(seq, rereads, sp, own_gather=not own_identity):
                sp = None
            self._kept = ((self._layers_now(), rereads), self._steps.pages_used,
                          own_identity if sp is not None else None, self.sharing_prediction)
        if sp is None:
            d = self.plain.plan(seq, bt, force=force, _checked=step)   # checked once, above
            self._rows = len(seq)
            return d
        try:
            self._plan_chunks(sp)
            d = self.own.plan(sp.own_seq, sp.own_bt, _checked=self._own_step(sp, step))
        except BaseException:
            self._kept = None   # no decision in effect after a plan that failed
            raise
        self._own_identity = own_identity
        self._stage_structure(sp)
        self.plan_used = sp
        self._rows = len(seq)
        return d

    def _own_step(self, sp: sharing.SharingPlan, step: StepInput) -> StepInput:
        """The own decode's step as ``check_step`` would give it, from the caller's checked step:
        each own segment is a slice of its row's used pages (at least one token: no run reaches
        a row's last page), so its pages fit the own Runtime's bounds (the plain Runtime's, or
        its twin's), its ids passed the caller's check, and their largest is at most the
        caller's (the bound ``num_pages`` is checked against)."""
        lens = sp.own_seq.tolist()
        pages = [-(-n // self.page_size) for n in lens]
        return StepInput(seq=sp.own_seq.astype(np.int64), lens=lens, block_tables=sp.own_bt,
                         pages=pages, max_pages=max(pages), max_page_id=step.max_page_id)

    def _plan_chunks(self, sp: sharing.SharingPlan) -> None:
        """The chunk decode's plan. Its lengths and tables are the sharing structure's read-only
        arrays (:func:`pkvrt.policy.sharing.plan_sharing`), so a step that shares what the last
        shared step did passes the very arrays the chunk Runtime planned last, and runs on that
        plan (``Runtime._plan_unchanged``: its device buffers hold it, and only its plan() writes
        them) instead of planning it again."""
        last, self._chunk_planned = self._chunk_planned, None   # until this plan succeeds
        if self._model_cuts():   # (the same structure, the same count: a kept plan stays valid)
            self.shared._pin_splits(self._chunk_cut(sp)[0])
        # (the chunk Runtime's step object too: a plan of it made elsewhere is not ours)
        if last is None or last[0] is not sp.chunk_seq or last[1] is not sp.chunk_bt or \
                last[2] is not self.shared._step or self.shared._plan_unchanged() is None:
            self.shared.plan(sp.chunk_seq, sp.chunk_bt)
        self._chunk_planned = (sp.chunk_seq, sp.chunk_bt, self.shared._step)

    def _layers_now(self) -> tuple:
        """The layers per plan the three Runtimes' policies weigh host time at (part of what a
        sharing decision depends on, besides the step)."""
        return self.plain._layers, self.own._layers, self.shared._layers

    def _stage_structure(self, sp: sharing.SharingPlan) -> None:
        """The step's index tensors in their static device buffers: the chunk query gather's
        indices, the own rows, the merge's slots. All three are the sharing structure's (read-only
        arrays of the runs' memo, :func:`pkvrt.policy.sharing.plan_sharing`), so a step that
        shares what the last staged one did finds them in place and copies nothing (the buffers
        are written only here)."""
        arrays = (sp.chunk_rows, sp.own_rows, sp.slots)
        if self._staged is not None and all(a is b for a, b in zip(arrays, self._staged)):
            return
        self._staged = None   # until all three are written
        # the chunk queries as one gather: chunk v's head hk * C * G + c * G + j is row
        # chunk_rows[v, c]'s head hk * G + j
        hq, g = self.num_qo_heads, self.group
        hk = np.arange(self.num_kv_heads)[None, :, None, None]
        j = np.arange(g)[None, None, None, :]
        q_index = sp.chunk_rows[:, None, :, None].astype(np.int64) * hq + hk * g + j
        self._q_index = self._stage("q_index", q_index.reshape(-1))
        self._own_rows = self._stage("own_rows", sp.own_rows)
        self._slots = self._stage("slots", sp.slots)
        self._staged = arrays

    def _own_reads_q(self, sp: sharing.SharingPlan, rows: int) -> bool:
        """Whether the own decode reads q itself (no gather launch): every row has one own
        segment (its pages after its prefix: the common case), so the own decode's rows are the
        step's rows in order, and it launches into the caller's stream or graph (engine capture,
        or no graphs of its own; its own graphs read their static q, which the gather fills)."""
        direct = self.own.engine_capture or not self.own.use_cuda_graph
        return direct and sp.own_rows.size == rows and bool((sp.own_rows == np.arange(rows)).all())

    def _sharing_pays(self, seq: np.ndarray, rereads: int, sp: sharing.SharingPlan, *,
                      own_gather: bool) -> bool:
        """Whether the step with sharing is predicted faster than the plain step by routes.toml's
        ``[sharing] margin`` (plain / shared >= margin): the chunk and own decodes as their
        Runtimes' policies would run them, plus the launches the shared path adds per layer (the
        chunk query gather, the own gather where the own decode does not read q itself, the
        merge; the calibration's measured ``sharing.overhead_us`` where it has one), against
        the plain Runtime's prediction less what L2 saves it on the step's
        ``rereads`` of shared pages (the calibration's ``sharing.l2_reread_cost``; none without
        it). The chunk decode gets the same credit: the chunks of one shared run (rows past a
        chunk's capacity) each read its pages, and all but the first meet them in L2. Both from
        the calibration's time model; kept in ``sharing_prediction``."""
        cal = self.plain.router.cal
        page_bytes, reread_cost = self._page_bytes(), self._reread_cost()
        t_plain = sharing.plain_step_us(self.plain.predict_step_us(seq), rereads, page_bytes,
                                        cal.beta_gbps, reread_cost)
        t_chunks = self._chunk_us(sp, page_bytes, reread_cost)
        t_shared = t_chunks + self.own.predict_step_us(sp.own_seq) + \
            self._extra_us(own_gather, graphs=self.plain.router.graphs)
        margin = self.plain.registry.sharing_margin
        self.sharing_prediction = {"plain_us": t_plain, "shared_us": t_shared, "margin": margin}
        return t_plain >= margin * t_shared

    def _chunk_us(self, sp: sharing.SharingPlan, page_bytes: int, reread_cost: float) -> float:
        """The chunk decode's predicted µs a layer, L2 credit included (:meth:`_sharing_pays`).
        The chunks are the sharing structure's alone (their lengths and tables are the
        structure's arrays, kept read-only in the runs' memo, :func:`pkvrt.policy.sharing.plan_sharing`),
        so the time is kept per structure: consecutive steps that share the same pages predict
        it once. Looked up by the arrays' identity (the entry holds them, so no other array
        takes their id) and the layers per plan the chunk Runtime's policy weighs host time at
        (its last step's run() calls: the first step's prediction assumes the options' hint)."""
        layers = self.shared._layers
        hit = self._chunk_times.get(id(sp.chunk_seq))
        if hit is not None and hit[0] is sp.chunk_seq and hit[1] is sp.chunk_bt and hit[3] == layers:
            return hit[2]
        cal = self.plain.router.cal
        chunk_rereads = sharing.page_rereads(sp.chunk_seq, sp.chunk_bt, self.page_size, self.num_pages)
        decode_us = self._chunk_cut(sp)[1] if self._model_cuts() else \
            self.shared.predict_step_us(sp.chunk_seq)
        us = sharing.plain_step_us(decode_us, chunk_rereads, page_bytes, cal.beta_gbps, reread_cost)
        if len(self._chunk_times) >= 16:   # as many structures as the runs' memo keeps
            self._chunk_times.pop(next(iter(self._chunk_times)))
        self._chunk_times[id(sp.chunk_seq)] = (sp.chunk_seq, sp.chunk_bt, us, layers)
        return us

    def _model_cuts(self) -> bool:
        """Whether the chunk decode's cut is chosen here: ``shared_chunk_cut="time_model"`` (or a
        pinned count) and a chunk Runtime on the device-planning policy (``engine_capture``).
        Elsewhere its router picks the route and the cut, and the option costs nothing."""
        return self._cut_here and self.shared is not None and self.shared._captured_policy

    def _chunk_cut(self, sp: sharing.SharingPlan) -> tuple[int | None, float]:
        """(split count of the longest chunk, predicted µs a layer) of the chunk decode's cut: the
        time model's fastest (``RuntimeOptions.shared_chunk_cut="time_model"``) among every count
        its device-planning route allows whose chunk is at least the calibration's least split
        (those the planning kernel takes as they are), ties to fewer splits. Kept per sharing
        structure and layer count (its arrays' identity, as :meth:`_chunk_us`): 17 predictions
        once, not per step. (None, the partition's predicted µs) where the chunk decode has more
        chunks than routes.toml ``[sharing] model_cut_rows``, or the model predicts the
        partition's cut less than ``[sharing] model_cut_margin`` times its fastest (the
        partition cuts those). A pinned count (``shared_chunk_cut=N``) is taken whatever the
        chunks and the model say, if the step takes it (ValueError naming the counts it takes
        otherwise). Called only where :meth:`_model_cuts` holds."""
        rows, sh, reg = len(sp.chunk_seq), self.shared, self.plain.registry
        layers = sh._layers   # the layers per plan its policy weighs host time at, as _chunk_us
        hit = self._chunk_cuts.get(id(sp.chunk_seq))
        if hit is not None and hit[0] is sp.chunk_seq and hit[3] == layers:
            self._cut_why = hit[2]
            return hit[1]
        pinned = self._cut_pinned
        if pinned is None and reg.sharing_model_cut_rows is not None and rows > reg.sharing_model_cut_rows:
            s, us = None, sh.predict_step_us(sp.chunk_seq)
            why = (f"cut by the partition: {rows} chunks, over routes.toml [sharing] model_cut_rows "
                   f"{reg.sharing_model_cut_rows}")
        else:
            route = reg.device_planning_route(rows, sh.router.group_size)
            # the counts the planning kernel takes as they are (a chunk of at least
            # min_split_tokens) and whose tasks fit the Runtime's planning grid (the partition
            # never plans more; the smallest count is kept whatever it plans, as the partition
            # keeps it)
            tiles = -(-int(sp.chunk_seq.max()) // TILE_TOKENS)
            min_tiles = -(-sh.calibration.splits.min_split_tokens // TILE_TOKENS)
            counts = planner.partition_candidates(tiles, route.splits, min_tiles).tolist()
            grid = sh._device_grid_tasks(sh._dp_routes[route.name], graphs.padded_batch(rows))
            fits = [s for s in counts if planner.balanced_partition(
                sp.chunk_seq, num_kv_heads=self.num_kv_heads, splits=route.splits, cal=sh.calibration,
                longest_splits=s).ctas <= grid] or counts[:1]
            if pinned is not None:
                if pinned not in fits:
                    raise ValueError(f"SharedPagesRuntime.plan: RuntimeOptions(shared_chunk_cut={pinned}): "
                                     f"this step's chunk decode takes {', '.join(map(str, fits))} "
                                     f"split(s) of its longest chunk ({int(sp.chunk_seq.max())} tokens; "
                                     f"{rows} chunk(s))")
                s, us = pinned, sh.predict_step_us(sp.chunk_seq, splits=pinned)
                why = f"cut at {s} split(s) of its longest chunk (pinned: options.shared_chunk_cut)"
            else:
                us, s = min((sh.predict_step_us(sp.chunk_seq, splits=s), s) for s in fits)
                why = (f"cut at {s} split(s) of its longest chunk (the time model's fastest: "
                       f"options.shared_chunk_cut)")
                # the model's cut only where it predicts a gain beyond its error (routes.toml
                # [sharing] model_cut_margin); else the partition's, as without the option
                partition_us = sh.predict_step_us(sp.chunk_seq)
                if partition_us < reg.sharing_model_cut_margin * us:
                    why = (f"cut by the partition: predicted {partition_us:.1f} us a layer against the "
                           f"time model's fastest cut's {us:.1f} ({s} splits), under routes.toml "
                           f"[sharing] model_cut_margin {reg.sharing_model_cut_margin:g}")
                    s, us = None, partition_us
        if len(self._chunk_cuts) >= 16:   # as many structures as the runs' memo keeps
            self._chunk_cuts.pop(next(iter(self._chunk_cuts)))
        self._chunk_cuts[id(sp.chunk_seq)] = (sp.chunk_seq, (s, us), why, layers)
        self._cut_why = why
        return s, us

    def _extra_us(self, own_gather: bool, *, graphs: bool) -> float:
        """What the shared path adds to its two decodes per layer: measured in graphs (the
        calibration's ``sharing.overhead_us``, with every row's own segment read in place; an
        own gather is one launch more), or its launches alone (eager launches: the overhead
        was not measured so)."""
        cal = self.plain.router.cal
        lam = launch_us(cal, graphs=graphs)
        measured = cal.sharing.overhead_us if cal.sharing is not None and graphs else None
        return (2 + int(own_gather)) * lam if measured is None else measured + int(own_gather) * lam

    def _page_bytes(self) -> int:
        return 2 * self.num_kv_heads * self.page_size * self.head_dim * self.plain.router.dtype_bytes

    def _reread_cost(self) -> float:
        """A re-read of a page another row read, in first reads: it meets the page in L2
        (calibration ``sharing.l2_reread_cost``; 1 without it)."""
        cal = self.plain.router.cal
        return cal.sharing.l2_reread_cost if cal.sharing is not None else 1.0

    def device_rule(self, rows: int) -> sharing.SharingRule | None:
        """The rule find_shared applies to a device-lengths step of ``rows`` rows
        (:class:`pkvrt.policy.sharing.SharingRule`: keep the chunks found only where the time
        model predicts the shared step faster), or None where there is none (``explain()`` says
        why): each decode timed on the route its device planning runs at ``rows`` rows, on its
        Runtime's calibration. Its constants are those of a CUDA graph, whatever this Runtime's
        own graphs: a step of device lengths is captured, by the Runtime or by the engine
        (the overhead it adds was measured so)."""
        return self._device_rule(rows)[0]

    def _device_rule(self, rows: int) -> tuple:
        """(rule, why not, candidates) for ``rows`` rows, kept per row count (the candidates:
        each decode's allowed split counts on the device, as its planning kernel reads them)."""
        hit = self._rules.get(rows)
        if hit is not None:
            return hit
        reg = self.plain.registry
        route = reg.device_planning_route(rows, self.group)
        # the chunk decode's group is its rows' heads side by side (chunk_heads), so its route
        # may be another one (routes.toml [device_planning] large_group)
        chunk_route = route if self.shared is None else \
            reg.device_planning_route(rows, self.shared.router.group_size)
        if self.shared is None:
            why = f"no chunk decode: one row of G {self.group} a chunk"
        elif not self._by_prediction:
            why = "options.shared_when_predicted_faster is off"
        else:
            why = sharing.SharingRule.unavailable(self.plain.calibration, self.shared.calibration,
                                                  route.kind, chunk_route.kind)
        if why is not None:
            hit = (None, why, None)
        else:
            cal_row = self.plain.calibration
            common = dict(num_kv_heads=self.num_kv_heads, head_dim=self.head_dim,
                          dtype_bytes=self.plain.router.dtype_bytes, graphs=True)
            rule = sharing.SharingRule(
                row=sharing.DecodeTime(cal=cal_row, kind=route.kind, splits=route.splits, **common),
                chunk=sharing.DecodeTime(cal=self.shared.calibration, kind=chunk_route.kind,
                                         splits=chunk_route.splits, **common),
                page_size=self.page_size, margin=self.plain.registry.sharing_device_margin,
                l2_saved_us=(1.0 - self._reread_cost()) * self._page_bytes() / (cal_row.beta_gbps * 1e3),
                extra_us=self._extra_us(False, graphs=True),
                # run plain, the step still launches the query gather and the merge (and the
                # idle chunk decode, beside the own decode on the side stream, else after it)
                plain_extra_us=(2 if self._side_option else 3) * cal_row.lambda_graph_us,
                # the chunk decode's cut by the time model (shared_chunk_cut="time_model"), within
                # routes.toml's bounds and the chunk decode's planning grid, as host lengths cut it
                # (_chunk_cut; no bound on the chunks: as many as find_shared finds)
                model_cut_rows=(0 if not self._cut_here else reg.sharing_model_cut_rows
                                if reg.sharing_model_cut_rows is not None else ops.FIND_MAX_ROWS),
                model_cut_margin=reg.sharing_model_cut_margin,
                chunk_max_tasks=self.shared._device_grid_tasks(self.shared._dp_routes[chunk_route.name],
                                                               graphs.padded_batch(rows)))
            hit = (rule, None, (self._cands[route.name], self._cands[chunk_route.name]))
        self._rules[rows] = hit
        return hit

    def _plan_device(self, seq_lens, block_tables, force: str | None):
        """plan() of device lengths: find_shared into the static buffers, then both decodes'
        device planning from them (or, forced or with no chunk decode: the plain Runtime's)."""
        self.plan_used, self._found_rows = None, 0
        if force is not None or self.shared is None:
            return self.plain.plan(seq_lens, block_tables, force=force)
        seq, bt = check_device_step(seq_lens, block_tables, device=self.device,
                                    max_batch=self.plain.max_batch)
        if seq.device != self.device or bt.device != self.device:
            raise ValueError(f"SharedPagesRuntime.plan: device_planning=True: seq_lens and "
                             f"block_tables must be int32 tensors on {self.device}")
        b, w = seq.shape[0], bt.shape[1]
        f = self._found_buffers(w)
        if bt.stride(1) != 1:   # find_shared reads rows of entries (any row stride)
            bt = bt.contiguous()
        rule, _, cands = self._device_rule(b)
        ops.find_shared(seq, bt, f["chunk_seq"][:b], f["chunk_bt"][:b], f["own_seq"][:b],
                        f["own_bt"][:b], f["q_index"][:b * self.num_kv_heads * self.chunk * self.group],
                        f["slots"][:b], page_size=self.page_size, chunk_rows=self.chunk,
                        group=self.group, num_kv_heads=self.num_kv_heads, rule=rule,
                        candidates=cands, rule_out=f["rule_out"], split_pin=self._split_pin)
        self._chunk_planned = None
        self.shared.plan(f["chunk_seq"][:b], f["chunk_bt"][:b])
        d = self.own.plan(f["own_seq"][:b], f["own_bt"][:b])
        self._found_rows = b
        return d

    def _found_buffers(self, width: int) -> dict[str, torch.Tensor]:
        """find_shared's outputs at max_batch rows and ``width`` block-table columns (made again,
        a new generation, when a step's width differs: the decodes' planning reads them whole)."""
        f = self._found
        if not f or f["chunk_bt"].shape[1] != width:
            n, dev = self.plain.max_batch, self.device
            i32 = dict(dtype=torch.int32, device=dev)
            f.update(chunk_seq=torch.zeros(n, **i32), own_seq=torch.zeros(n, **i32),
                     chunk_bt=torch.zeros(n, width, **i32), own_bt=torch.zeros(n, width, **i32),
                     q_index=torch.zeros(n * self.num_kv_heads * self.chunk * self.group,
                                         dtype=torch.int64, device=dev),
                     slots=torch.full((n, 2), -1, dtype=torch.int64, device=dev),
                     rule_out=torch.zeros(6, dtype=torch.float64, device=dev))
            self._generation += 1
        return f

    def found(self) -> sharing.PrefixChunks | None:
        """What find_shared wrote for the planned step (device lengths; None otherwise), with the
        rule's decision where it decided (chunks found). Reads the GPU buffers: it synchronizes
        (for tests and debugging, not the step loop)."""
        b = self._found_rows
        if not b:
            return None
        f = {k: v.cpu().numpy() for k, v in self._found.items()}
        c, g, hkv, hq = self.chunk, self.group, self.num_kv_heads, self.num_qo_heads
        q_rows = f["q_index"][:b * hkv * c * g].reshape(b, hkv, c, g)[:, 0, :, 0] // hq
        slots = f["slots"][:b]
        members = np.full((b, c), -1, np.int32)   # the rows whose chunk state a slot names
        for r in range(b):
            if slots[r, 0] >= 0:
                members[slots[r, 0] // c, slots[r, 0] % c] = r
        assert ((members < 0) | (members == q_rows)).all(), "q_index disagrees with slots"
        out, decision = f["rule_out"], None
        if self._device_rule(b)[0] is not None and out[2] >= 0:   # the rule decided
            decision = sharing.RuleDecision(plain_us=float(out[0]), shared_us=float(out[1]),
                                            shared=bool(out[2] == 1), plain_rereads=int(out[3]),
                                            chunk_rereads=int(out[4]), chunk_splits=int(out[5]))
        return sharing.PrefixChunks(chunk_seq=f["chunk_seq"][:b], chunk_bt=f["chunk_bt"][:b],
                                    chunk_rows=members, own_seq=f["own_seq"][:b],
                                    own_bt=f["own_bt"][:b], slots=slots, decision=decision)

    def _stage(self, name: str, a: np.ndarray) -> torch.Tensor:
        """``a`` in the static int64 device buffer ``name`` (a view of its shape), copied from
        pinned memory without waiting for the stream (torch's pinned allocator keeps the
        source until the copy ran)."""
        buf = self._bufs.get(name)
        if buf is None or buf.numel() < a.size:
            buf = self._bufs[name] = torch.zeros(max(a.size, 2 * (0 if buf is None else buf.numel())),
                                                 dtype=torch.int64, device=self.device)
            self._generation += 1
        view = buf[:a.size].view(a.shape)
        src = torch.from_numpy(a.astype(np.int64))
        if self.device.type == "cuda":
            src = src.pin_memory()
        view.copy_(src, non_blocking=True)
        return view

    @property
    def last_decision(self):
        """The RouteDecision of the last plan(): the own decode's on a step with sharing (and
        every device-lengths step), else the plain Runtime's."""
        return (self.own if self._found_rows or self.plan_used is not None else self.plain).last_decision

    @property
    def step_key(self) -> tuple | None:
        """What a graph of the planned step's run() calls bakes in (``engine_capture``): the
        plain Runtime's key, or the sharing structure (chunks, own segments, states per row,
        buffer generation) with both Runtimes' keys."""
        if self._found_rows:
            return ("shared-device", self._found_rows, self._found["chunk_bt"].shape[1],
                    self._generation, self.shared.step_key, self.own.step_key)
        sp = self.plan_used
        if sp is None:
            return self.plain.step_key
        return ("shared", sp.chunk_rows.shape, sp.own_rows.size, self._own_identity, sp.slots.shape,
                self._generation, self.shared.step_key, self.own.step_key)

    # ------------------------------------------------------------------ run

    def run(self, q: torch.Tensor, k_cache, v_cache, *, out: torch.Tensor | None = None,
            sinks: torch.Tensor | None = None, lse: torch.Tensor | None = None,
            return_lse: bool = False, **scales):
        """One layer of the planned step: q ``[B, H_q, D]`` -> out (the Runtime's arguments;
        ``sinks`` float32 ``[H_q]`` when built with ``sinks=True``; ``lse`` float32 ``[B, H_q]``
        written with each row's and head's log2-sum-exp, the sink not counted, as
        :meth:`pkvrt.Runtime.run`). Returns out, or (out, lse) with ``return_lse``."""
        if self._rows is None:
            raise RuntimeError("SharedPagesRuntime.run: no plan in effect (plan() was not called, or "
                               "the last plan() raised)")
        if self.sinks != (sinks is not None):
            raise ValueError(f"SharedPagesRuntime.run: sinks={'given' if sinks is not None else None}"
                             f" but the Runtime was built with sinks={self.sinks}")
        if self._found_rows or self.plan_used is not None:   # the plain Runtime checks its own
            self._check_run(q, k_cache, v_cache, out, sinks, lse, scales)
        if return_lse and lse is None:
            lse = torch.empty(self._rows, self.num_qo_heads, dtype=torch.float32, device=self.device)
        if self._found_rows:   # device lengths: find_shared's buffers, every row its own segment
            f = self._found
            out = self._run_shared(q, k_cache, v_cache, out, sinks, lse, scales, chunks=q.shape[0],
                                   q_index=f["q_index"], own_rows=None, slots=f["slots"][:q.shape[0]])
        elif self.plan_used is None:
            kw = {"sinks": sinks} if sinks is not None else {}
            out = self.plain.run(q, k_cache, v_cache, out=out, lse=lse, **kw, **scales)
        else:
            out = self._run_shared(q, k_cache, v_cache, out, sinks, lse, scales,
                                   chunks=self.plan_used.chunk_rows.shape[0], q_index=self._q_index,
                                   own_rows=None if self._own_identity else self._own_rows,
                                   slots=self._slots)
        return (out, lse) if return_lse else out

    def _check_run(self, q, k_cache, v_cache, out, sinks, lse, scales) -> None:
        """A step with chunks: run()'s tensors checked against the plan before anything is launched
        (the query gather indexes q by the plan's rows), as :meth:`pkvrt.Runtime.run` checks its
        own (once per set of tensors); ValueError naming the tensor."""
        p = self.plain
        if isinstance(k_cache, torch.Tensor) and isinstance(v_cache, torch.Tensor):
            k_cache, v_cache = hnd_view(k_cache, p.kv_layout), hnd_view(v_cache, p.kv_layout)
        check_run_args_once(self._run_checked, q, k_cache, v_cache, out, batch=self._rows,
                            num_qo_heads=self.num_qo_heads, num_kv_heads=self.num_kv_heads,
                            head_dim=self.head_dim, page_size=self.page_size, dtype=p.dtype,
                            device=self.device, kv_dtype=p.kv_dtype, k_scale=scales.get("k_scale"),
                            v_scale=scales.get("v_scale"), kv_layout=p.kv_layout, sinks=sinks,
                            lse=lse, want_sinks=self.sinks)

    def _run_shared(self, q, k_cache, v_cache, out, sinks, lse, scales, *, chunks: int, q_index,
                    own_rows, slots) -> torch.Tensor:
        """A step with chunks: the chunk queries gathered by ``q_index`` into the chunk decode's
        static q and the chunk decode (on the side stream, when there is one), the own decode (of
        q itself when ``own_rows`` is None: row r's own segment is decode row r; else of the rows
        ``own_rows`` gathers), and, after both, the merge by ``slots``."""
        b, hq, d = q.shape
        qv, lse_v = self.shared.static_q(chunks), self._lse_v[:chunks]
        side = self._side
        if side is not None:
            side.enter()
        try:   # the caller's stream waits for the side's work whatever happens (a capture stays joined)
            try:
                torch.index_select(q.reshape(b * hq, d), 0, q_index[:qv.numel() // d],
                                   out=qv.view(-1, d))
                out_v = self.shared.run(qv, k_cache, v_cache, out=self.shared.static_out(chunks),
                                        lse=lse_v, **scales)
            finally:
                if side is not None:
                    side.leave()
            s_own = b if own_rows is None else own_rows.shape[0]
            if own_rows is None:
                q_own = q if q.is_contiguous() else q.contiguous()
            else:
                q_own = self.own.static_q(s_own)
                torch.index_select(q, 0, own_rows, out=q_own)
            lse_o = self._lse_o[:s_own]
            out_o = self.own.run(q_own, k_cache, v_cache, out=self.own.static_out(s_own),
                                 lse=lse_o, **scales)
        finally:
            if side is not None:
                side.join()
        if out is None:
            out = torch.empty_like(q)
        ops.merge_segments(out_v, lse_v, out_o, lse_o, slots, out, group=self.group,
                           chunk_rows=self.chunk, sinks=sinks, lse=lse)
        return out

    def explain(self) -> str:
        if self._found_rows:
            rule, why, _ = self._device_rule(self._found_rows)
            kept = (f"kept where the time model predicts the plain step at least {rule.margin:g}x "
                    f"the shared one's time (routes.toml [sharing] device_margin), else the plain step"
                    if rule is not None
                    else f"every one kept ({why})")
            return (f"SharedPagesRuntime: device lengths, shared prefixes found on the GPU "
                    f"(find_shared: up to {self._found_rows} chunks of up to {self.chunk} rows, one "
                    f"level per leader row; {kept}; found() reads them and the decision)\n"
                    + self.own.explain())
        sp, p = self.plan_used, self.sharing_prediction
        told = (f"predicted {p['shared_us']:.1f} us a layer shared, {p['plain_us']:.1f} plain "
                f"(L2 credit included; routes.toml [sharing] margin {p['margin']:g})" if p is not None else "")
        if sp is None:
            why = f"shared pages, but {told}" if p is not None else "no sharing this step"
            return f"SharedPagesRuntime: {why} (plain Runtime)\n" + self.plain.explain()
        cut = (f"; the chunk decode {self._cut_why}"
               if self._model_cuts() and self._cut_why else "")
        return (f"SharedPagesRuntime: {sp.chunk_rows.shape[0]} shared chunk(s) of up to "
                f"{sp.capacity_rows} rows, {sp.own_rows.size} own segment(s); pages read "
                f"{sp.pages_read} of {sp.pages_unshared} ({sp.saved_fraction:.0%} saved)"
                + (f"; {told}" if told else "") + cut)


class _SideStream:
    """The stream a shared step's chunk decode runs on, beside the own decode on the caller's.

    The two decodes read the same q and caches and write their own static outputs, so neither
    needs the other; the merge needs both. :meth:`enter` makes the side stream current after
    everything the caller's stream holds (this layer's q; the last layer's merge, which read the
    chunk decode's static output this layer overwrites); :meth:`leave` makes the caller's stream
    current again; :meth:`join` makes it wait for the side's work. Events and stream switches
    work the same inside an engine's CUDA-graph capture (the side stream joins the capture and
    the graph gets two branches). The streams are switched by id (``torch._C``), and the caller's
    Stream object comes from a :class:`~pkvrt.runtime.core._StreamRecorder` (kept while torch
    reports the same stream: ``torch.cuda.stream()`` and ``current_stream()`` build Stream
    objects, ~15 us each on the H200 host, benches/NOTES.md)."""

    def __init__(self, device: torch.device):
        self.device = device
        self.stream = torch.cuda.Stream(device)
        self._forked, self._done = torch.cuda.Event(), torch.cuda.Event()
        self._callers = _StreamRecorder(True)
        self._caller = None

    def enter(self) -> None:
        current = torch._C._cuda_getDevice()
        if current != self.device.index:   # the kernels launch on the current device's stream
            raise RuntimeError(f"SharedPagesRuntime.run: the current CUDA device is cuda:{current}, "
                               f"the Runtime's {self.device}: call it under "
                               f"torch.cuda.device({self.device.index})")
        self._caller = self._callers.current()
        self._forked.record(self._caller)
        self.stream.wait_event(self._forked)
        _make_current(self.stream)

    def leave(self) -> None:
        try:
            self._done.record(self.stream)
        finally:   # the caller's stream current again even if the record failed
            _make_current(self._caller)

    def join(self) -> None:
        self._caller.wait_event(self._done)


def _make_current(stream) -> None:
    """``stream`` torch's current stream, by id (what ``torch.cuda.set_stream`` does, without
    its Python device helpers)."""
    torch._C._cuda_setStream(stream_id=stream.stream_id, device_index=stream.device_index,
                             device_type=stream.device_type)
