"""``pkvrt.Runtime``: construction and reporting; plan() and run() live in their own modules.

The class is assembled from one piece per seam: :class:`~pkvrt.runtime.buffers.StaticBuffers`
(allocation), :class:`~pkvrt.runtime.planning.Planning` (``plan``) and
:class:`~pkvrt.runtime.running.Running` (``run``); the state they share is set up in
``Runtime.__init__`` below. The package docstring (:mod:`pkvrt.runtime`) tells the whole model.
"""

from __future__ import annotations

import math
import numbers
import pathlib
import time
import warnings

import attrs
import torch

from pkvrt import _buildspec
from pkvrt.launch import _driver, ops
from pkvrt.policy.calibration import CALIBRATION_HEAD_DIM, Calibration, find_calibration, load_calibration
from pkvrt.policy.registry import DEVICE_PLANNED, KIND_KERNELS, Registry, kv_dtype_name, load_routes
from pkvrt.policy.router import RouteDecision, Router
from pkvrt.runtime import fi_route, graphs
from pkvrt.runtime.buffers import StaticBuffers, _Step
from pkvrt.runtime.checks import DTYPES, MAX_SEQ_LEN, check_device_step, check_shape, check_variant
from pkvrt.runtime.graphs import Capacities, initial_capacities
from pkvrt.runtime.options import FIELDS as OPTION_FIELDS
from pkvrt.runtime.options import RuntimeOptions
from pkvrt.runtime.planning import Planning
from pkvrt.runtime.running import Running


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
    """``recorder(event)``: ``event.record()`` on the current stream, and ``current()``: that
    stream, without ``torch.cuda.current_stream()`` (a Stream object built through Python
    device-index helpers: ~15 us per call on the H200 machine's host, once per plan();
    benches/NOTES.md): the Stream object is kept while torch reports the same current stream
    (id, device, type).
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
        event.record(self.current())

    def current(self):
        """torch's current CUDA stream of the current device (CUDA only)."""
        key = self._get(torch._C._cuda_getDevice())
        if key != self._key:
            self._key = key
            self._stream = torch.cuda.Stream(stream_id=key[0], device_index=key[1], device_type=key[2])
        return self._stream


def lengths_on_gpu(seq_lens) -> bool:
    """Whether plan() was given its lengths in a CUDA tensor (device planning)."""
    return isinstance(seq_lens, torch.Tensor) and seq_lens.device.type == "cuda"


def moved_arguments(moved: dict) -> str:
    """The TypeError of a Runtime given constructor keywords it does not take: ablation switches
    (now :class:`RuntimeOptions` fields) are named with where they went."""
    opts = [k for k in moved if k in OPTION_FIELDS]
    other = [k for k in moved if k not in OPTION_FIELDS]
    parts = []
    if opts:
        inner = ", ".join(f"{k}={moved[k]!r}" for k in opts)
        parts.append(f"{', '.join(opts)}: ablation switches, set through "
                     f"options=pkvrt.RuntimeOptions({inner})")
    if other:
        parts.append(f"unexpected keyword argument(s) {', '.join(map(repr, other))}")
    return "Runtime: " + "; ".join(parts)


class Runtime(StaticBuffers, Planning, Running):
    """Paged-KV decode attention with a per-step route choice, replayed as CUDA graphs.

    Per step, :meth:`plan` chooses the route and every workqueue/fused plan is built on the GPU
    by the planning kernel; per layer, :meth:`run` launches the step's kernels (the package
    docstring, :mod:`pkvrt.runtime`, tells the whole model).

    The mode follows from what the caller passes:

    - lengths and block tables as CUDA int32 tensors at the first plan(): **device planning**,
      no host routing, routes.toml's ``[device_planning]`` routes (by row count and group
      size); plan() and run() inside the
      caller's CUDA-graph capture go into that graph (the fastest way to run pkvrt: the
      README's first snippet). ``device_planning=True/False`` fixes the mode at construction.
    - host lengths (numpy, lists, CPU tensors): the router picks each step's route; the Runtime
      replays a graph of its own per layer. An engine that captures its steps with host
      lengths says ``engine_capture=True``: plan() outside its capture, a graph of the step's
      run() calls per :attr:`step_key`.

    Parameters
    ----------
    num_qo_heads, num_kv_heads, head_dim, page_size : the attention shape (:func:`check_shape`).
    dtype : torch.float16 or torch.bfloat16: q and out, and the KV cache unless ``kv_dtype``.
    kv_dtype : None or torch.float8_e4m3fn (each run() then takes ``k_scale``, ``v_scale``).
    kv_layout : "HND" (``[num_pages, H_kv, page_size, D]``) or "NHD" (``[num_pages, page_size,
        H_kv, D]``); K and V may be strided views of one tensor, each token row contiguous.
    sm_scale, window_left, logits_soft_cap, sinks : the attention variant: scale (None:
        1/sqrt(D)); a sliding window of the last window_left + 1 tokens (-1: none); scores
        ``c * tanh(s / c)`` (0: none); one learned sink logit per query head, given to each
        run() as ``sinks=`` (FlashInfer is then not used: its FA2 decode ignores sinks).
        A model mixing layer kinds uses one Runtime per kind, each planned once per step.
    max_batch, max_pages_per_row : the most rows of a step and pages of a row.
    num_pages : the cache's pages; page ids are checked against it on the GPU (None: the first
        run()'s cache, and no step is planned before that bound is known).
    device_planning : None (the first plan() decides, above), True or False.
    engine_capture : host lengths in the caller's CUDA graphs (above).
    device, routes, calibration : the CUDA device; routes.toml (path or Registry; None: the
        shipped one); "auto" (this GPU's calibration file), a path or a Calibration.
    options : :class:`~pkvrt.runtime.options.RuntimeOptions`, the ablation and tuning switches
        (graphs off, FlashInfer's modes, the router's memo, validation); the defaults are the
        measured product. Passing one of its fields here is a TypeError naming it.

    Details a user rarely needs, by topic: FP8 scales, layouts, variants, page-id checks and
    the captured modes in docs/integration.md; each switch in :class:`RuntimeOptions`.

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
                 dtype=torch.float16, *, kv_dtype=None, kv_layout: str = "HND",
                 sm_scale: float | None = None, window_left: int = -1,
                 logits_soft_cap: float = 0.0, sinks: bool = False, max_batch: int = 256,
                 max_pages_per_row: int = 8192, num_pages: int | None = None,
                 device_planning: bool | None = None, engine_capture: bool = False,
                 device="cuda", routes=None, calibration="auto",
                 options: RuntimeOptions | None = None, **moved):
        if moved:
            raise TypeError(moved_arguments(moved))
        if options is None:
            options = RuntimeOptions()
        elif not isinstance(options, RuntimeOptions):
            raise ValueError(f"Runtime: options={options!r}: expected a pkvrt.RuntimeOptions")
        self.options = options
        (use_cuda_graph, max_graphs, validate, flashinfer, flashinfer_tensor_cores,
         flashinfer_cuda_graph, flashinfer_direct_run, decision_memo, capture_routing,
         layers_per_plan) = (getattr(options, f) for f in (
            "use_cuda_graph", "max_graphs", "validate", "flashinfer", "flashinfer_tensor_cores",
            "flashinfer_cuda_graph", "flashinfer_direct_run", "decision_memo", "capture_routing",
            "layers_per_plan"))
        for name, v in (("device_planning", device_planning), ("engine_capture", engine_capture)):
            if v is not None and not isinstance(v, bool):
                raise ValueError(f"Runtime: {name}={v!r}: expected True or False"
                                 + (" (or None: the first plan() decides)" if name == "device_planning" else ""))
        if sm_scale is not None and (isinstance(sm_scale, bool) or not isinstance(sm_scale, numbers.Real)
                                     or not math.isfinite(sm_scale)):
            raise ValueError(f"Runtime: sm_scale={sm_scale!r}: expected a finite number (None: "
                             "1/sqrt(head_dim))")
        # device_planning None: the first plan() decides, from where its lengths are (_decide_mode)
        self._mode_open = device_planning is None
        self._plan_launch_forced = None
        device_planning = bool(device_planning)
        check_shape(num_qo_heads, num_kv_heads, head_dim, page_size, dtype, kv_dtype)
        self.kv_layout, self.window_left, self.logits_soft_cap, self.sinks = check_variant(
            kv_layout, window_left, logits_soft_cap, sinks)
        if capture_routing != "device_planning" and (not engine_capture or device_planning):
            raise ValueError(f"Runtime: options.capture_routing={capture_routing!r} applies to "
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
        self._num_pages_given = num_pages is not None   # the caller's bound: checked at plan()
        if max_pages_per_row * page_size > MAX_SEQ_LEN:
            raise ValueError(f"Runtime: max_pages_per_row={max_pages_per_row}: rows of "
                             f"{max_pages_per_row * page_size} tokens exceed the int32 lengths the "
                             f"kernels take (at most {MAX_SEQ_LEN} tokens)")
        self._graphs = graphs.GraphCache(max_graphs)   # checks max_graphs
        self._counts = dict(plans=0, plans_kept=0, captures=0, replays=0, eager_runs=0,
                            staging_copies=0, h2d_copies=0, regrowths=0, capture_seconds=0.0)
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
        self.validate, self.sm_scale = bool(validate), sm_scale
        self.registry = routes if isinstance(routes, Registry) else load_routes(routes)
        self.device_planning = bool(device_planning)
        # every workqueue/fused step is planned on the GPU, host-routed or not
        self._dp_routes = {r.name: r for r in self.registry.routes if r.kind in DEVICE_PLANNED}
        if self.device_planning or self._captured_policy:
            self._dp_default = self._device_planning_route(mode)
            if self.device_planning:
                flashinfer = False  # device planning runs the PersistentKV workqueue routes only

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
            file_cal = self.calibration
            cal = file_cal.for_head_dim(self.head_dim).for_kv_dtype(self._kv_dtype)
            self.calibration_group = cal.calibrated_group(self.num_qo_heads // self.num_kv_heads)
            self.calibration = cal.for_group(self.calibration_group)
            # the partition's waves are this shape's decode kernel's, not the calibrated shape's
            self.calibration, self.residency = self._residency_of_shape(self.calibration, file_cal)
            self.router = Router(self.registry, self.calibration, num_qo_heads=self.num_qo_heads,
                                 num_kv_heads=self.num_kv_heads, head_dim=self.head_dim,
                                 page_size=self.page_size, kv_dtype=self._kv_dtype,
                                 graphs=self.use_cuda_graph or self.engine_capture,
                                 memo_size=decision_memo,
                                 device_plan_kinds=DEVICE_PLANNED, window_left=self.window_left)
            self._load_kernels()
            self._fi_wanted = bool(flashinfer and not self.device_planning and not self._fp8
                                   and self._fi_unserved() is None)
            cap = initial_capacities(self.registry, max_batch=max_batch, num_kv_heads=self.num_kv_heads)
            self._dp_grid: dict[tuple[str, int], int] = {}
            if self._dp_routes:
                dp = self._device_capacities()
                cap = Capacities(slots=max(cap.slots, dp.slots), tasks=max(cap.tasks, dp.tasks))
            self._alloc(cap)
            # the FlashInfer route (host lengths only): a Runtime whose first plan() decides its
            # mode sets it up now and says it is unavailable only if that plan() has host lengths
            self._fi_warning = None
            self._setup_flashinfer(flashinfer and not self.device_planning, warn=not self._mode_open)
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

    def _residency_of_shape(self, cal: Calibration, file_cal: Calibration
                            ) -> tuple[Calibration, tuple[int, int, str] | None]:
        """``cal`` with ``splits.workqueue_ctas_per_sm`` set to the CTAs per SM this shape's
        decode kernels keep resident, when that differs from the kernels of the shape the
        constant in force was measured at; and ``(here, calibrated, that shape)``, None when
        unchanged. The partition plans waves of resident CTAs, and a larger D holds more
        registers and shared memory: on the H200 one CTA per SM at D 256 where the calibration
        counted two. Both are the driver's occupancy, the least over the workqueue and fused
        kernels the routes run (they share the partition's constants), so at the calibrated
        shape nothing changes. A kernel that does not load (or fits no CTA) changes nothing
        here: loading the Runtime's kernels says why, next."""
        families = sorted({KIND_KERNELS[r.kind] for r in self.registry.routes
                           if r.kind in ("workqueue", "fused")})
        if not families:   # no workqueue or fused route: no partition to plan
            return cal, None
        group = self.num_qo_heads // self.num_kv_heads
        calibrated_d, calibrated_kv = self._resident_constant_shape(file_cal)
        try:
            here = min(ops.decode_occupancy(f, self.dtype, self.head_dim, group, self.kv_dtype)
                       for f in families)
            there = min(ops.decode_occupancy(f, torch.float16, calibrated_d, self.calibration_group,
                                             calibrated_kv) for f in families)
        except Exception:  # noqa: BLE001 - _load_kernels reports a kernel that cannot be loaded
            return cal, None
        if here == there or here < 1 or there < 1:
            return cal, None
        shape = f"D {calibrated_d}" + (" e4m3" if calibrated_kv == ops.FP8 else "")
        return (attrs.evolve(cal, splits=attrs.evolve(cal.splits, workqueue_ctas_per_sm=float(here))),
                (here, there, shape))

    def _resident_constant_shape(self, file_cal: Calibration) -> tuple[int, torch.dtype]:
        """(head dim, K/V dtype) of the kernel ``splits.workqueue_ctas_per_sm`` in force was
        measured with: the last section laid over that sets it (at the calibration group or
        its top level), an FP8 section's (measured at D 128) over a head-dim section's, else the
        file's (D 128, fp16)."""
        def sets(section) -> bool:
            return section is not None and (
                "workqueue_ctas_per_sm" in dict(section.splits)
                or "workqueue_ctas_per_sm" in dict(dict(section.splits_by_group).get(self.calibration_group, ())))
        if self._fp8 and sets(dict(file_cal.by_kv_dtype).get(self._kv_dtype)):
            return CALIBRATION_HEAD_DIM, self.kv_dtype
        if sets(dict(file_cal.by_head_dim).get(self.head_dim)):
            return self.head_dim, torch.float16
        return CALIBRATION_HEAD_DIM, torch.float16

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

    def _fi_unserved(self) -> str | None:
        """Why the FlashInfer route must not run this Runtime's attention (fi_route.unserved)."""
        return fi_route.unserved(self.head_dim, self.sinks, self.num_qo_heads // self.num_kv_heads,
                                 self.options.flashinfer_tensor_cores)

    def _setup_flashinfer(self, flashinfer: bool, warn: bool = True) -> None:
        """The FlashInfer route of a host-lengths Runtime (device planning runs the PersistentKV
        workqueue routes only): import, build, or the reason it is unavailable; whether host
        time is weighed (it is where the calibration's host_time was measured: host lengths, a
        graph per layer, FlashInfer eager)."""
        o = self.options
        self._fi_reason = None if flashinfer else (
            "disabled: device planning" if self.device_planning
            else "disabled: RuntimeOptions(flashinfer=False)")
        if flashinfer and self._fp8:
            flashinfer = False
            self._fi_reason = ("not used with kv_dtype=float8_e4m3fn (FlashInfer's decode takes "
                               "k_scale / v_scale as host floats: a device read per call, and a "
                               "captured graph would keep the old values)")
        if flashinfer and (why := self._fi_unserved()) is not None:
            flashinfer = False
            self._fi_reason = why
        fi_mod = None
        if flashinfer:
            fi_mod, self._fi_reason = fi_route.load_flashinfer()
        if self._fi_reason is not None and flashinfer:
            self._fi_warning = (f"pkvrt.Runtime: the FlashInfer route is unavailable: {self._fi_reason}; "
                                "steps the policy sends to it run on the fastest PersistentKV route")
        if self._fi_reason is not None and not any(r.kind != "flashinfer" and self._kv_dtype in r.kv_dtypes
                                                   for r in self.registry.routes):
            raise ValueError(f"{self.registry.path}: no PersistentKV route serves KV dtype "
                             f"{self._kv_dtype}, and the FlashInfer route is unavailable "
                             f"({self._fi_reason}): no route can run")
        self._fi = None
        if fi_mod is not None:
            with torch.cuda.device(self.device):
                try:
                    self._fi = fi_route.FlashInferRoute(
                        fi_mod, num_qo_heads=self.num_qo_heads, num_kv_heads=self.num_kv_heads,
                        head_dim=self.head_dim, page_size=self.page_size, dtype=self.dtype,
                        device=self.device, sm_scale=self.sm_scale,
                        tensor_cores=o.flashinfer_tensor_cores, kv_layout=self.kv_layout,
                        window_left=self.window_left, logits_soft_cap=self.logits_soft_cap,
                        # a graph replayed after a re-plan needs FlashInfer's graph mode
                        cuda_graph=(self.use_cuda_graph and o.flashinfer_cuda_graph) or self.engine_capture,
                        indices_buffer=self._fi_indices, direct_run=o.flashinfer_direct_run,
                        record=self._record)
                except Exception as exc:  # noqa: BLE001 - reported, the route becomes unavailable
                    self._fi_reason = f"building its wrapper failed ({type(exc).__name__}: {exc})"
                    self._fi_warning = f"pkvrt.Runtime: the FlashInfer route is unavailable: {self._fi_reason}"
        if warn:
            self._warn_flashinfer()
        self.router.weigh_host = (self.use_cuda_graph and not self.engine_capture and not self.device_planning
                                  and self._fi is not None and not self._fi.cuda_graph)

    def _device_planning_route(self, mode: str) -> str:
        """routes.toml's device-planning route, checked: it exists and serves the K/V dtype
        (ValueError naming the mode otherwise)."""
        try:
            name = self.registry.device_planning_route(group=self.num_qo_heads // self.num_kv_heads,
                                                       window=self._window_tokens).name
        except KeyError as e:
            raise ValueError(f"Runtime ({mode}): {e.args[0]}") from None
        small = self.registry.device_small
        for dp_route in map(self.registry.route, dict.fromkeys(filter(None, (name, small and small[1])))):
            if self._kv_dtype not in dp_route.kv_dtypes:
                raise ValueError(f"Runtime ({mode}): dtype={self.kv_dtype}: the device-planning "
                                 f"route {dp_route.name!r} does not serve it (kv_dtypes = "
                                 f"{list(dp_route.kv_dtypes)} in {self.registry.path})")
        return name

    @property
    def _window_tokens(self) -> int | None:
        """The most tokens a row attends (window_left + 1), None without a sliding window: what
        routes.toml's ``[device_planning] large_group_min_window`` compares."""
        return self.window_left + 1 if self.window_left >= 0 else None

    def _gpu_lengths(self, seq_lens) -> bool:
        return lengths_on_gpu(seq_lens)

    def _enter_device_planning(self, seq_lens, block_tables, force) -> None:
        """The first plan() of a Runtime built without ``device_planning``, given its lengths in
        a CUDA tensor: from now on a device-planning Runtime. Everything the constructor checks
        for ``device_planning=True`` and this plan()'s own device checks come first: if one
        fails, nothing has changed (the next plan() decides again)."""
        mode = "device_planning: the first plan() was given lengths on the GPU"
        if self.max_batch > ops.PLAN_MAX_ROWS:
            raise ValueError(f"Runtime ({mode}): max_batch={self.max_batch}: device planning "
                             f"plans every step with the planning kernel, which plans at most "
                             f"{ops.PLAN_MAX_ROWS} rows (one CTA)")
        if self.engine_capture and self.options.capture_routing != "device_planning":
            raise ValueError(f"Runtime ({mode}): options.capture_routing="
                             f"{self.options.capture_routing!r} applies to engine_capture=True "
                             "with host lengths only")
        default = self._device_planning_route(mode)
        check_device_step(seq_lens, block_tables, device=self.device, max_batch=self.max_batch)
        if force is not None and force not in self._dp_routes:
            raise ValueError(f"Runtime.plan: force={force!r}: with device planning (lengths on the "
                             f"GPU) expected one of the workqueue/fused routes {sorted(self._dp_routes)}")
        self._mode_open = False
        self.device_planning, self._captured_policy, self._dp_default = True, False, default
        self._fi, self._fi_reason = None, "disabled: device planning (the lengths are on the GPU)"
        self._fi_warning = None
        self.router.weigh_host = False

    def _enter_host_lengths(self) -> None:
        """The first plan() of a Runtime built without ``device_planning``, with host lengths
        that passed their checks: a host-routing Runtime from now on (now it says if its
        FlashInfer route is unavailable)."""
        self._mode_open = False
        self._warn_flashinfer()

    def _warn_flashinfer(self) -> None:
        if self._fi_warning is not None:
            warnings.warn(self._fi_warning, RuntimeWarning, stacklevel=4)
            self._fi_warning = None

    @property
    def _plan_launch(self) -> str:
        """How a workqueue/fused step's planning kernel is launched: "run", under engine_capture
        with host lengths: by the step's first run(), so the engine's graph of the step holds it
        and a replay plans and runs the layers in one graph launch, as device planning's
        captured step does (benches/NOTES.md, host routing in a captured step); "graph", a
        replay of the Runtime's planning graph in plan(); "eager", launched by plan(): the
        Runtime's graphs off, or device planning inside an engine's capture (the launch goes
        into the engine's graph)."""
        if self._plan_launch_forced is not None:
            return self._plan_launch_forced
        if not self.device_planning:   # (host planning inside a capture is refused by plan())
            return "run" if self.engine_capture else "graph" if self.use_cuda_graph else "eager"
        return "graph" if self.use_cuda_graph and not self._capturing() else "eager"

    @_plan_launch.setter
    def _plan_launch(self, how: str) -> None:
        # benches/host_cost.py's ablations force a device-planned step's planning launch
        self._plan_launch_forced = how

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
        key = (st.route, st.kind, st.gbatch, st.structure, self._generation)
        return key if st.pinned is None else key + (("splits", st.pinned),)

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
                 + (f" ({cal.head_dim_note()})" if cal.head_dim_note() else "")
                 + (f" ({cal.kv_dtype_note()})" if cal.kv_dtype_note() else "")
                 + (f"; partition waves of {self.residency[0]} decode CTAs per SM (this shape's kernel;"
                    f" {self.residency[1]} at the calibrated {self.residency[2]})" if self.residency else "")
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
        eager_runs, plans, plans_kept (steps a SharedPagesRuntime ran on this Runtime's last plan,
        their lengths and tables unchanged), regrowths, capture_seconds, capacities, flashinfer.
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
