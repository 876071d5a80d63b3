"""``pkvrt.Runtime``: construction and reporting; plan() and run() live in their own modules.

The class is assembled from one piece per seam: :class:`~pkvrt.runtime.buffers.StaticBuffers`
(allocation), :class:`~pkvrt.runtime.planning.Planning` (``plan``) and
:class:`~pkvrt.runtime.running.Running` (``run``); the state they share is set up in
``Runtime.__init__`` below. The package docstring (:mod:`pkvrt.runtime`) tells the whole model.
"""

from __future__ import annotations

import pathlib
import time
import warnings

import torch

from pkvrt import _buildspec
from pkvrt.launch import _driver, ops
from pkvrt.policy.calibration import Calibration, find_calibration, load_calibration
from pkvrt.policy.registry import DEVICE_PLANNED, KIND_KERNELS, Registry, kv_dtype_name, load_routes
from pkvrt.policy.router import RouteDecision, Router
from pkvrt.runtime import fi_route, graphs
from pkvrt.runtime.buffers import StaticBuffers, _Step
from pkvrt.runtime.checks import DTYPES, MAX_SEQ_LEN, check_shape, check_variant
from pkvrt.runtime.graphs import Capacities, initial_capacities
from pkvrt.runtime.planning import Planning
from pkvrt.runtime.running import Running

# Runtime(capture_routing=...): how an engine-captured step of host lengths picks its route
CAPTURE_ROUTING = ("device_planning", "router")


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


class _StreamRecorder:
    """``recorder(event)``: ``event.record()`` on the current stream, without
    ``torch.cuda.current_stream()`` (a Stream object built through Python device-index helpers:
    ~15 us per call on the H200 machine's host, once per plan(); benches/NOTES.md):
    the Stream object is kept while torch reports the same current stream (id, device, type).
    Its own object, not a Runtime method, so that the FlashInfer route holding it does not
    hold the Runtime: a Runtime has no reference cycle and is freed when its last reference
    goes, never by a garbage collection that may run inside some CUDA graph capture (a CUDA
    graph destroyed inside a capture invalidates it; :func:`pkvrt.runtime.graphs.capture`)."""

    def __init__(self, cuda: bool):
        self._get = getattr(torch._C, "_cuda_getCurrentStream", None) if cuda else None
        self._key = self._stream = None

    def __call__(self, event) -> None:
        if self._get is None:
            event.record()
            return
        key = self._get(torch._C._cuda_getDevice())
        if key != self._key:
            self._key = key
            self._stream = torch.cuda.Stream(stream_id=key[0], device_index=key[1], device_type=key[2])
        event.record(self._stream)


class Runtime(StaticBuffers, Planning, Running):
    """Paged-KV decode attention with a per-step route choice, replayed as CUDA graphs.

    Per step, :meth:`plan` chooses the route (host lengths: the router; ``device_planning``:
    routes.toml's device-planning route) and every workqueue/fused plan is built on the GPU by
    the planning kernel into static buffers; per layer, :meth:`run` replays the graph of the
    step's (route, padded batch, grid) key. A bucket step is planned on the host (its buckets
    are its graph's launch structure), a FlashInfer step by FlashInfer's plan (the package
    docstring, :mod:`pkvrt.runtime`, tells the whole model).

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
    routes : routes.toml path (None: ``pkvrt.policy.registry.load_routes()``'s default) or a Registry.
    calibration : "auto" (``find_calibration(torch.cuda.get_device_name(device))``), a path or a
        Calibration; its ``splits.by_group`` entry for this group size, if there is one, replaces
        the balanced partition's constants (``Calibration.for_group``).
    max_batch : most rows of a step. max_pages_per_row : most pages of one row (block-table width).
    use_cuda_graph : replay CUDA graphs (default) or launch eagerly (the ablation).
    max_graphs : graphs kept (LRU; evicted graphs are freed).
    validate : O(B * pages) checks of the block tables at plan() and of page ids vs num_pages at
        run(); the O(B) checks that guard the static buffers always run.
    sm_scale : softmax scale (None: 1/sqrt(head_dim)); any value (Gemma-3-27B: 168 ** -0.5).
    kv_layout : "HND" (caches ``[num_pages, H_kv, page_size, D]``) or "NHD" (``[num_pages,
        page_size, H_kv, D]``, vLLM's, SGLang's and FlashInfer's default). Strides come from the
        tensors run() is given: K and V may be strided views of one tensor (FlashInfer's
        ``[pages, 2, ...]``, vLLM's K/V packed in the last dimension) as long as each token row
        of D elements is contiguous and 16-byte aligned.
    window_left : -1, or a sliding window: each row attends to its last ``window_left + 1``
        tokens (FlashInfer's meaning). Plans cover the window only (a windowed row's work is its
        window's pages). A model that mixes local and global layers uses one Runtime per layer
        kind, each planned once per step: a plan is per window, and one Runtime per kind keeps
        each kind's graphs and plans as few as one kind's.
    logits_soft_cap : 0, or a cap c > 0: scores become ``c * tanh(score / c)`` (Gemma-2).
    sinks : the model has attention sinks (gpt-oss): every run() takes ``sinks=``, one float32
        logit per query head that joins the softmax denominator. FlashInfer is not used then
        (its FA2 decode accepts sinks and ignores them: a wrong answer, not a baseline).
    flashinfer : use FlashInfer as the baseline route; False, or FlashInfer failing to import,
        makes it unavailable: steps the policy sends to it run on the fastest PersistentKV route.
    flashinfer_tensor_cores : FlashInfer's tensor-core decode (H200, G=4: 44 vs 52 us at B1 32K).
    decision_memo : decisions the router remembers and reuses (``Router(memo_size=...)``: keyed by
        force, active rows, distinct lengths and each length at split granularity; plans stay
        exact: a workqueue/fused plan is built on the GPU from the exact lengths, a bucket or
        FlashInfer plan on the host). Cuts ``plan()``'s router time 5-20x (B8, dev box); 0
        predicts every step from scratch.
    flashinfer_cuda_graph : run the FlashInfer route in FlashInfer's CUDA-graph mode inside the
        runtime's graphs. Off by default: on the H200 (2026-12-02, docs/integration.md "Host cost") it halves
        a FlashInfer step's host time (plan() 145-217 vs 316-384 us, run() 10-18 vs 21-43 us per
        layer through FlashInfer's eager run(); the direct calls bring the eager run()
        to FlashInfer's own cost, see ``flashinfer_direct_run``) but costs device time, +2 to
        +5 % at 32 layers on 32K steps and +19 % on the Azure conversation trace (a graph
        boundary at every layer, a grid fixed per batch size), and adds one wrapper per batch
        size. Worth it only where the host, not the GPU,
        bounds the step; an engine that captures its whole step (``engine_capture``) gets graph
        mode without the per-layer boundaries. (The "illegal memory access" once seen with it was a race on pinned buffers,
        FlashInfer's own and the serving harness's, both guarded now: see
        fi_route.FlashInferRoute.plan and tests/gpu/test_runtime.py.)
    flashinfer_direct_run : eager FlashInfer steps (the default mode): from a step's third layer
        on, call FlashInfer's compiled kernel entry with the arguments its ``run()`` built for the
        second, the layer's q, caches and out swapped in, instead of re-running that Python
        at every layer (``fi_route.DirectCall``; falls back to ``wrapper.run`` for any call it
        cannot record exactly, and is off with a FlashInfer its GPU test has not checked,
        ``fi_route.DIRECT_RUN_VERSIONS``: 0.7.x). False: FlashInfer's ``run()`` at every layer
        (the ablation).
    num_pages : the pages of the KV cache that run() will be given (``k_cache.shape[0]``); the
        planning kernel checks the page ids of every workqueue/fused step against it on the GPU.
        Device planning: run() refuses a cache with fewer pages; None: taken from the first
        run()'s cache, and a step planned before any run() has its planning kernel launched by
        that run(), after the bound is set, so no step's ids go unchecked (engine_capture with
        host lengths: likewise; plan() checks them on the host too with ``validate``). Host
        lengths: the bound is lowered to the smallest cache run() is given (never an error),
        on top of the host checks (``validate``).
    device_planning : take each step's lengths and block tables as device tensors and skip host
        routing (both modes build every workqueue/fused plan with the planning kernel,
        kernels/plan_workqueue.cu; this one has no host part). ``plan()`` then does no work
        proportional to the batch and never synchronizes: with ``use_cuda_graph=False`` (an
        engine capturing its step) one launch of the planning kernel, which copies the lengths
        and the block-table entries they use itself (contiguous device tensors); otherwise two
        device copies (lengths, block tables), the device scalars and one replay of a captured
        planning graph. Every step runs routes.toml's ``[device_planning] route``
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

    engine_capture : the engine captures each decode step's ``run()`` calls (every layer) in its
        own CUDA graph and replays it, with host lengths: per step it calls :meth:`plan` outside
        any capture and replays its graph for :attr:`step_key`, capturing one the first time a key
        is seen (``examples/engine_graph.py --host-routing``). plan() checks and copies the
        step; a workqueue/fused step's planning kernel is launched by the step's first run()
        (the first of each capture, and the first eager one), so the engine's graph holds it and
        a replay plans from the lengths the last plan() copied and runs every layer in one graph
        launch (an engine that splits a step over several graphs gets the planning kernel in
        each: correct, one launch more per graph). Implies ``use_cuda_graph=False``
        (no graphs of the Runtime's own) and runs a FlashInfer route in FlashInfer's CUDA-graph
        mode (a wrapper per batch size, whose grid a re-plan keeps). The replays call no run(),
        so with ``validate`` plan() checks the page ids against ``num_pages`` (or, without it,
        the smallest cache a run() was given); the planning kernel checks a workqueue/fused
        step's ids on the GPU too, nothing checks a bucket or FlashInfer step's with
        ``validate=False``. A graph bakes in the addresses of the tensors its run() calls were
        given: q, out, the caches (and FP8 scales) must be the same tensors at every replay of
        a key (e.g. views of :meth:`static_q` / :meth:`static_out` of the padded batch, or one
        graph per (key, batch size) as the harness keeps). With ``device_planning`` it only sets
        ``use_cuda_graph=False`` (plan() is captured too then).
    capture_routing : how ``engine_capture`` with host lengths chooses a step's route.
        ``"device_planning"`` (default): routes.toml's ``[device_planning]`` route, as device
        planning does: the policy of captured steps, measured in the 32-layer engine protocol
        (README), where those routes beat FlashInfer's fastest path on every trace; the plan is
        built on the GPU from the host lengths (one copy), no router. ``"router"``: the router's
        gates and cost model, as the default mode (graph launches charged per kernel); the
        ablation: its gates and constants were measured on steps launched a layer at a time, and
        in captured steps they send to FlashInfer steps the PersistentKV routes run faster
        (benches/NOTES.md, the captured step's routing).
    layers_per_plan : run() calls per plan() the router assumes until a step has run (None: 1);
        from then on it uses the last step's count. Used where host time is weighed (the default
        mode with FlashInfer, routes.toml ``[host_time]``, the calibration's ``host_time``): the
        predicted wall time of a step is ``plan_us + L * max(run_us, T)``. An engine of 32 layers
        passes 32, so that its first step is decided as the ones after it.

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
                 flashinfer_cuda_graph: bool = False, flashinfer_direct_run: bool = True,
                 decision_memo: int = 4096,
                 device_planning: bool = False, num_pages: int | None = None,
                 engine_capture: bool = False, capture_routing: str = "device_planning",
                 layers_per_plan: int | None = None, kv_layout: str = "HND",
                 window_left: int = -1, logits_soft_cap: float = 0.0, sinks: bool = False):
        check_shape(num_qo_heads, num_kv_heads, head_dim, page_size, dtype, kv_dtype)
        self.kv_layout, self.window_left, self.logits_soft_cap, self.sinks = check_variant(
            kv_layout, window_left, logits_soft_cap, sinks)
        if capture_routing not in CAPTURE_ROUTING:
            raise ValueError(f"Runtime: capture_routing={capture_routing!r}: expected one of "
                             f"{', '.join(map(repr, CAPTURE_ROUTING))}")
        if capture_routing != "device_planning" and (not engine_capture or device_planning):
            raise ValueError(f"Runtime: capture_routing={capture_routing!r} applies to "
                             "engine_capture=True with host lengths (device_planning=False) only")
        # a captured step of host lengths runs routes.toml's [device_planning] route (not the router)
        self._captured_policy = bool(engine_capture and not device_planning
                                     and capture_routing == "device_planning")
        mode = ("device_planning" if device_planning else
                "engine_capture (capture_routing='device_planning')" if self._captured_policy else None)
        if mode and max_batch > ops.PLAN_MAX_ROWS:
            raise ValueError(f"Runtime: max_batch={max_batch}: {mode} plans every step with the "
                             f"planning kernel, which plans at most {ops.PLAN_MAX_ROWS} rows (one CTA)"
                             + ("; capture_routing='router' lets larger steps take other routes"
                                if self._captured_policy else ""))
        for name, v in (("max_batch", max_batch), ("max_pages_per_row", max_pages_per_row),
                        ("num_pages", 1 if num_pages is None else num_pages),
                        ("layers_per_plan", 1 if layers_per_plan is None else layers_per_plan)):
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
        # engine_capture: the engine's graphs replace the Runtime's own (its launches are captured)
        self.engine_capture = bool(engine_capture)
        self.use_cuda_graph = bool(use_cuda_graph) and not self.engine_capture
        # How a host-routed workqueue/fused step's planning kernel is launched: "graph", a replay
        # of the Runtime's planning graph in plan(); "eager", launched by plan() (graphs off);
        # "run", under engine_capture with host lengths: launched by the step's first run(), so
        # the engine's graph of the step holds it and a replay plans and runs the layers in one
        # graph launch, as device planning's captured step does (benches/NOTES.md, host routing in a captured step).
        self._plan_launch = ("run" if self.engine_capture and not device_planning
                             else "graph" if self.use_cuda_graph else "eager")
        self.validate, self.sm_scale = bool(validate), sm_scale
        self.registry = routes if isinstance(routes, Registry) else load_routes(routes)
        self.device_planning = bool(device_planning)
        # every workqueue/fused step is planned on the GPU, host-routed or not
        self._dp_routes = {r.name: r for r in self.registry.routes if r.kind in DEVICE_PLANNED}
        if self.device_planning or self._captured_policy:
            try:
                self._dp_default = self.registry.device_planning_route().name
            except KeyError as e:
                raise ValueError(f"Runtime ({mode}): {e.args[0]}") from None
            if self.device_planning:
                flashinfer = False  # device planning runs the PersistentKV workqueue routes only
            small = self.registry.device_small
            for dp_route in map(self.registry.route, dict.fromkeys(filter(None, (self._dp_default,
                                                                                small and small[1])))):
                if self._kv_dtype not in dp_route.kv_dtypes:
                    raise ValueError(f"Runtime ({mode}): dtype={self.kv_dtype}: the device-planning "
                                     f"route {dp_route.name!r} does not serve it (kv_dtypes = "
                                     f"{list(dp_route.kv_dtypes)} in {self.registry.path})")

        self.device = _resolve_device(device)
        self._cuda = self.device.type == "cuda"
        self._record = _StreamRecorder(self._cuda)   # shared with the FlashInfer route
        self._run_checked: set = set()   # run() argument signatures that passed check_run_args

        with torch.cuda.device(self.device):
            if isinstance(calibration, Calibration):
                self.calibration = calibration
            elif calibration == "auto":
                self.calibration = find_calibration(torch.cuda.get_device_name(self.device))
            else:
                self.calibration = load_calibration(pathlib.Path(calibration))
            # the partition constants fitted at this group size (splits.by_group), or at the
            # nearest calibrated one (Calibration.calibrated_group)
            cal = self.calibration.for_kv_dtype(self._kv_dtype)
            self.calibration_group = cal.calibrated_group(self.num_qo_heads // self.num_kv_heads)
            self.calibration = cal.for_group(self.calibration_group)
            self.router = Router(self.registry, self.calibration, num_qo_heads=self.num_qo_heads,
                                 num_kv_heads=self.num_kv_heads, head_dim=self.head_dim,
                                 page_size=self.page_size, kv_dtype=self._kv_dtype,
                                 graphs=self.use_cuda_graph or self.engine_capture,
                                 memo_size=decision_memo,
                                 device_plan_kinds=DEVICE_PLANNED, window_left=self.window_left)
            self._load_kernels()
            self._fi_reason = None if flashinfer else (
                "disabled: Runtime(device_planning=True)" if self.device_planning
                else "disabled: Runtime(flashinfer=False)")
            if flashinfer and self._fp8:
                flashinfer = False
                self._fi_reason = ("not used with kv_dtype=float8_e4m3fn (FlashInfer's decode takes "
                                   "k_scale / v_scale as host floats: a device read per call, and a "
                                   "captured graph would keep the old values)")
            if flashinfer and (why := fi_route.unserved(self.head_dim, self.sinks)) is not None:
                flashinfer = False
                self._fi_reason = why
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
                        kv_layout=self.kv_layout, window_left=self.window_left,
                        logits_soft_cap=self.logits_soft_cap,
                        # a graph replayed after a re-plan needs FlashInfer's graph mode
                        cuda_graph=(self.use_cuda_graph and flashinfer_cuda_graph) or self.engine_capture,
                        indices_buffer=self._fi_indices, direct_run=flashinfer_direct_run,
                        record=self._record)
                except Exception as exc:  # noqa: BLE001 - reported, the route becomes unavailable
                    self._fi_reason = f"building its wrapper failed ({type(exc).__name__}: {exc})"
                    warnings.warn(f"pkvrt.Runtime: the FlashInfer route is unavailable: {self._fi_reason}",
                                  RuntimeWarning, stacklevel=2)
            # Host time is weighed in the mode the calibration's host_time was measured in (host
            # lengths, a graph per layer, FlashInfer eager): plan() passes the layers per plan
            self.router.weigh_host = (self.use_cuda_graph and not self.engine_capture and not self.device_planning
                                      and self._fi is not None and not self._fi.cuda_graph)
            # run() calls per plan: the hint, then those of the last step that ran any (Planning.plan)
            self._layers = 1 if layers_per_plan is None else layers_per_plan
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

    # -- shared by plan() and run() ---------------------------------------------------------

    def _capturing(self) -> bool:
        """Whether the current stream is capturing a CUDA graph (an engine's)."""
        return self._cuda and torch.cuda.is_current_stream_capturing()

    def _capture(self, key, launch) -> None:
        t0 = time.perf_counter()
        entry = graphs.capture(launch, side_stream=self._side, pool=self._pool, device=self.device)
        self._graphs.put(key, entry)
        self._counts["captures"] += 1
        self._counts["capture_seconds"] += time.perf_counter() - t0

    @property
    def step_key(self) -> tuple | None:
        """What a graph of the planned step's ``run()`` calls bakes in, as a hashable tuple: the
        route, its kernel kind, the padded batch, the launch structure (a bucket plan's buckets, a
        planning grid, a FlashInfer wrapper) and the generation of the Runtime's buffers (a
        regrowth reallocates them). Two steps with equal keys launch the same kernels over the
        same buffers, so an engine that captures its steps (``engine_capture``) replays the graph
        it captured for the key, with its own tensors (q, caches, out, scales) the same as at
        capture; a graph of an older generation reads freed buffers and is never replayed by
        key. None before the first plan()."""
        st = self._step
        if st is None:
            return None
        return (st.route, st.kind, st.gbatch, st.structure, self._generation)

    # -- reporting -------------------------------------------------------------------------

    @property
    def flashinfer_available(self) -> bool:
        return self._fi is not None

    def explain(self) -> str:
        """The runtime's configuration and the last step's decision, route by route."""
        cal = self.calibration
        kv = "" if self.kv_dtype == self.dtype else f", KV {self._kv_dtype}"
        lines = [f"pkvrt.Runtime: H_q={self.num_qo_heads} H_kv={self.num_kv_heads} D={self.head_dim} "
                 f"page={self.page_size} {str(self.dtype).replace('torch.', '')}{kv} {self.kv_layout}"
                 f"{self._variant_note()}; "
                 f"{'CUDA graphs' if self.use_cuda_graph else 'eager launches'}; calibration "
                 f"{cal.slug}{' (fallback: no file for this GPU)' if cal.fallback else ''}"
                 + (f" (constants of G {self.calibration_group}, the nearest calibrated group size)"
                    if self.calibration_group != self.num_qo_heads // self.num_kv_heads else "")
                 + (f" ({cal.kv_dtype_note()})" if cal.kv_dtype_note() else "")
                 + ("; device planning (no host routing)" if self.device_planning else "")
                 + self._capture_note()
                 + ("; workqueue/fused plans built on the GPU" if self._dp_routes else ""),
                 "flashinfer: " + ("available" + (" (tensor cores)" if self._fi.tensor_cores else " (CUDA cores)")
                                   if self._fi is not None else
                                   f"unavailable ({self._fi_reason}); steps the policy sends to it run "
                                   "on the fastest predicted PersistentKV route")]
        lines.append(self.last_decision.explain() if self.last_decision is not None else "no step planned yet")
        return "\n".join(lines)

    def _variant_note(self) -> str:
        """explain()'s words for the attention variant (empty for plain attention)."""
        parts = []
        if self.window_left >= 0:
            parts.append(f"window {self.window_left + 1} tokens")
        if self.logits_soft_cap > 0:
            parts.append(f"soft cap {self.logits_soft_cap:g}")
        if self.sinks:
            parts.append("attention sinks")
        if self.sm_scale is not None:
            parts.append(f"sm_scale {self.sm_scale:.6g}")
        return f" ({', '.join(parts)})" if parts else ""

    def _capture_note(self) -> str:
        """explain()'s words for engine_capture with host lengths (empty otherwise)."""
        if not self.engine_capture or self.device_planning:
            return ""
        if self._captured_policy:
            return "; engine-captured steps, routes.toml [device_planning] routes"
        return "; engine-captured steps, the router's routes"

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
