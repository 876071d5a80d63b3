"""Per-step route choice: gates -> cost-model predictions -> promotion margin -> one plan.

Each decode step :meth:`Router.decide` looks at the step (active rows, longest context, the
GQA group size), drops the PersistentKV routes whose gates refuse it (``Route.refusals``;
ablation routes unless forced by name), predicts ``T_r`` for the FlashInfer baseline and every
remaining route (:meth:`Router.predict`: the calibration's measured time model, else the seed's
roofline, :mod:`pkvrt.policy.costmodel`), and promotes the fastest PersistentKV route whose
predicted speedup ``T_fi / T_r`` clears ``Registry.margin_for(route, active)``; otherwise the
step stays on FlashInfer. Every route not taken gets a reason, so ``explain()`` can say why.
Where host time is weighed (``Router.weigh_host``, routes.toml ``[host_time]``, the
calibration's ``host_time``) the margins apply to each route's predicted wall time of the step
instead, ``costmodel.wall_us`` at the caller's layers per plan, and a step FlashInfer would run
host-bound is held to ``[host_time] min_context`` instead of the routes' context gate.

Cost per step (measured on the 2-core CPU of the dev box, numpy 2, pytest-benchmark medians):
predictions use closed-form counters (split counts and bucket sizes only, no task arrays),
about 10 µs for the workqueue and 30 µs for exact buckets at B=8; the full plan is built for
the chosen route alone (workqueue B=8: 30 µs; B=64: 35 µs), and not at all for the route kinds
the caller plans on the GPU (``device_plan_kinds``: the Runtime's workqueue and fused routes,
whose plans the planning kernel builds from the exact lengths). A whole ``decide`` on a bimodal
B=8 step that picks the workqueue costs about 85 µs (``test_bench_decide_b8``); a step the
gates send to FlashInfer about 20 µs. With a calibration's measured time model the predictions
come from launch groups instead of counters (FlashInfer's own split form, one group per bucket):
bimodal B8 with the H200 constants 195-205 µs against 167 µs with the roofline, measured side by
side on the (busier) dev box.

Why a memo, not O(1) summaries of the step (active rows, longest and total length): the
predictions read the whole length vector. The balanced partition's makespan counts every row's
splits at each candidate chunk and which rows are "big", and the bucket route groups rows by
length. Two H200 B8 steps with the same summaries (longest 32768, total 47104) are cut and
predicted differently: ``[32768] + [2048] * 7`` into splits ``[43, 3 x 7]`` (bucket 59.8 µs),
``[32768, 12800] + [256] * 6`` into ``[47, 19, 1 x 6]`` (bucket 65.1 µs). So the memo keys the
whole vector at split granularity instead, and a hit costs no planner call for the routes
planned on the GPU. Measured on the (shared, noisy) 2-core dev box, H200 calibration, B8 steps
[32768, 2048, 3072, 4096, 32000, 1024, 2560, 3584] growing one token a step, 2000 steps, 16
misses: ``decide`` median 85-155 µs before (a hit rebuilt the workqueue plan) and 18-30 µs after
with ``device_plan_kinds``; forced pkv_workqueue / pkv_fused 330-635 µs before (never
memoized) and 23-39 µs after. A miss predicts every route: 350-390 µs (470-530 before).
"""

from __future__ import annotations

import attrs
import numpy as np

from pkvrt._buildspec import GROUP_SIZES, HEAD_DIMS, PAGE_SIZES, TILE_TOKENS
from pkvrt.policy.calibration import Calibration
from pkvrt.policy.costmodel import host_bound, predict_route_us, wall_us
from pkvrt.policy.planner import (BucketPlan, FlashInferPlan, WorkqueuePlan, bucket_from_checked,
                                  check_seq_lens, flashinfer_counters_from_checked, fused_counters,
                                  plan_flashinfer, workqueue_from_checked)
from pkvrt.policy.registry import KV_DTYPES, kv_dtype_name


@attrs.frozen(eq=False)
class RouteDecision:
    """The route of one step, its plan, and why every other route was not taken.

    plan : the chosen route's full plan, or None when its kind is one of the router's
        ``device_plan_kinds`` (the caller builds it on the GPU; :meth:`Router.full_plan` gives
        its host twin on demand).
    predicted_us : every evaluated route -> predicted µs: the PersistentKV routes past their
        gates (or forced), and the baseline whenever one of those is weighed against it or it is
        forced. A step whose every PersistentKV route is refused by its gates runs the baseline
        unpredicted (empty; :meth:`Router.predict` gives the time on demand).
    refused : every route not evaluated or not promoted -> reason.
    speedup : predicted ``T_flashinfer / T_chosen`` (1.0 on the baseline).
    """

    route: str
    kind: str
    plan: BucketPlan | WorkqueuePlan | FlashInferPlan | None
    predicted_us: dict[str, float]
    refused: dict[str, str]
    speedup: float
    active: int = 0
    max_context: int = 0
    forced: bool = False
    reused: bool = False   # route taken from the memo (see Router's memo_size); plan exact or None
    # host time weighed (Router.weigh_host): predicted wall µs of the step per evaluated route,
    # and the layers per plan it was predicted for; empty and 0 when only device time is weighed
    wall_us: dict[str, float] = attrs.field(factory=dict)
    layers: int = 0
    host_bound: bool = False   # [host_time] min_context applied: FlashInfer's step predicted host-bound

    def explain(self) -> str:
        """An aligned table: one line per route with its predicted µs and verdict or reason."""
        names = list(self.predicted_us) + [n for n in self.refused if n not in self.predicted_us]
        if self.route not in names:
            names.insert(0, self.route)
        w = max(len("route"), *(len(n) for n in names))
        ctx = (f"longest context {self.max_context} tokens" if self.max_context >= 0 else
               "lengths on the GPU (device planning)")
        lines = [f"step: {self.active} active rows, {ctx}"
                 + (" (forced)" if self.forced else "")
                 + (" (route reused from an earlier step with the same memo key; predictions "
                    "below are that step's)" if self.reused else "")]
        if self.layers:
            lines.append(f"host time weighed: {self.layers} layer{'s' if self.layers > 1 else ''} per plan; "
                         "wall us = the step's plan + layers x max(host, device) per layer"
                         + ("; FlashInfer's step is host-bound, so [host_time] min_context replaces "
                            "[gates] min_context" if self.host_bound else ""))
        wall = f"  {'wall us':>10}" if self.layers else ""
        lines.append(f"{'route':<{w}}  {'predicted us':>12}{wall}  verdict")
        for n in names:
            t = self.predicted_us.get(n)
            ts = f"{t:12.1f}" if t is not None else f"{'-':>12}"
            if self.layers:
                wt = self.wall_us.get(n)
                ts += f"  {wt:10.1f}" if wt is not None else f"  {'-':>10}"
            if n == self.route:
                verdict = "chosen" + ("" if self.speedup == 1.0 else f" ({self.speedup:.3f}x over baseline)")
            else:
                verdict = "refused: " + self.refused.get(n, "")
            lines.append(f"{n:<{w}}  {ts}  {verdict}")
        return "\n".join(lines)


class Router:
    """Chooses a route per step from a registry (routes.toml) and a calibration.

    Parameters
    ----------
    registry : pkvrt.policy.registry.Registry. calibration : pkvrt.policy.calibration.Calibration.
    num_qo_heads, num_kv_heads, head_dim, page_size : the attention shape.
    kv_dtype : the K/V cache dtype, a torch dtype or its name ("float16" default, "bfloat16",
        "float8_e4m3fn"). Routes whose routes.toml ``kv_dtypes`` lack it are refused every
        step; the baseline must serve it (ValueError otherwise). Every PersistentKV kernel
        reads float8_e4m3fn K/V.
    dtype_bytes : bytes per K/V element, what the counters and the cost model count (None:
        from ``kv_dtype``, 2 for fp16/bf16, 1 for FP8). Given, it must agree with ``kv_dtype``.
    graphs : the runtime replays CUDA graphs (launch overhead ``lambda_graph_us``); False for
        the seed's eager protocol (``lambda_us``).
    memo_size : 0 (default): every step is predicted from scratch. N > 0: remember up to N
        decisions keyed by (force, active rows, distinct lengths, each row's length // q) with
        q = max(TILE_TOKENS, calibration min_split_tokens), and reuse the route and predictions
        of the first step with that key; also reuse the last decision used while every row
        stays within q tokens of the lengths it was predicted for (same force, row count and
        distinct lengths, the longest row on the same side of every gate's min_context: a window,
        so rows growing a token a step miss once per q steps, not whenever one of them crosses a
        key's cell; ``_window_hit``). The chosen route's plan is still built from
        the exact lengths (for ``device_plan_kinds``: not built). The key holds everything the
        split rules see at split granularity, so a reused route can differ from a fresh one only
        where predictions sit within a quantum of a margin (a forced route never differs). Why: the
        prediction of every route is most of ``decide``'s host time (NumPy per-call overhead
        over tiny arrays: B1 81 -> ~30 us on the dev box, ~250 us on the H200 host before,
        benches/NOTES.md); the module docstring says why it cannot come from O(1) summaries.
    device_plan_kinds : route kinds whose plans the caller builds on the GPU (the Runtime
        passes ``("workqueue", "fused")``): ``decide`` returns ``plan=None`` for them and runs
        no planner beyond the predictions, memo hit or not. Default (): every decision carries
        its host plan (``pkvrt plan``, the benches' dry runs).
    weigh_host : the caller runs steps in the mode the calibration's ``host_time`` was measured
        in (the Runtime's default: host lengths, a graph per layer, FlashInfer eager with direct
        calls; the Runtime sets it). Host time is then weighed when routes.toml's
        ``[host_time]`` is enabled and the calibration has ``host_time`` (:attr:`host_model`):
        every evaluated route gets a predicted wall time ``costmodel.wall_us`` at ``decide``'s
        ``layers``, the promotion margins apply to the ratio of wall times, and a step refused
        by ``[gates] min_context`` alone is evaluated anyway when FlashInfer's step is predicted
        host-bound (``costmodel.host_bound``) and its longest row reaches ``[host_time]
        min_context``. Settable; setting it forgets the memo.
    """

    def __init__(self, registry, calibration: Calibration, *, num_qo_heads: int, num_kv_heads: int,
                 head_dim: int, page_size: int, kv_dtype="float16", dtype_bytes: int | None = None,
                 graphs: bool = True, memo_size: int = 0, device_plan_kinds=(), weigh_host: bool = False,
                 window_left: int = -1):
        kv_dtype = kv_dtype_name(kv_dtype)
        if dtype_bytes is None:
            dtype_bytes = KV_DTYPES[kv_dtype]
        elif dtype_bytes != KV_DTYPES[kv_dtype]:
            raise ValueError(f"Router: dtype_bytes={dtype_bytes!r}: expected {KV_DTYPES[kv_dtype]}, "
                             f"the element size of kv_dtype {kv_dtype} (or None)")
        if kv_dtype not in registry.baseline.kv_dtypes:
            raise ValueError(f"Router: kv_dtype={kv_dtype}: the baseline route {registry.baseline.name!r} "
                             f"does not serve it (kv_dtypes = {list(registry.baseline.kv_dtypes)} in "
                             f"{registry.path}); expected a K/V dtype the baseline serves (it is every "
                             f"step's fallback)")
        for name, v in (("num_qo_heads", num_qo_heads), ("num_kv_heads", num_kv_heads),
                        ("head_dim", head_dim), ("page_size", page_size), ("dtype_bytes", dtype_bytes)):
            if isinstance(v, bool) or not isinstance(v, int) or v < 1:
                raise ValueError(f"Router: {name}={v!r}: expected a positive integer")
        if num_qo_heads % num_kv_heads:
            raise ValueError(f"Router: num_qo_heads={num_qo_heads} is not a multiple of "
                             f"num_kv_heads={num_kv_heads}; expected H_q = G * H_kv")
        self.registry = registry
        # by_head_dim (this head dim's section), by_kv_dtype (an FP8 section), then splits/time_model
        # by_group, where the file has them
        # (the nearest calibrated group size's where the file has none of this one's)
        cal = calibration.for_head_dim(head_dim).for_kv_dtype(kv_dtype)
        self.cal = cal.for_group(cal.calibrated_group(num_qo_heads // num_kv_heads))
        self.num_qo_heads, self.num_kv_heads = num_qo_heads, num_kv_heads
        self.head_dim, self.page_size, self.dtype_bytes = head_dim, page_size, dtype_bytes
        self.kv_dtype = kv_dtype
        self.group_size = num_qo_heads // num_kv_heads
        self.graphs = graphs
        # -1, or a sliding window: each row attends to its last window_left + 1 tokens; decide()
        # routes on those lengths, full_plan's workqueue tasks start at each row's window
        self.window_left = int(window_left)
        self._invalid = self._kernel_gap()
        self._shape = dict(num_kv_heads=num_kv_heads, num_qo_heads=num_qo_heads, head_dim=head_dim,
                           dtype_bytes=dtype_bytes)
        if isinstance(memo_size, bool) or not isinstance(memo_size, int) or memo_size < 0:
            raise ValueError(f"Router: memo_size={memo_size!r}: expected an integer >= 0")
        self.memo_size = memo_size
        kinds = ("bucket", "workqueue", "fused")
        if isinstance(device_plan_kinds, str) or not set(device_plan_kinds) <= set(kinds):
            raise ValueError(f"Router: device_plan_kinds={device_plan_kinds!r}: expected a subset of "
                             f"{kinds} (FlashInfer's plan is always built on the host)")
        self.device_plan_kinds = frozenset(device_plan_kinds)
        self._memo: dict = {}   # key -> (decision, its lengths, distinct lengths); oldest evicted first
        # per force: (lengths, distinct lengths, decision) of the last decision used (_window_hit)
        self._windows: dict = {}
        # the gates' context thresholds: a window never spans one (the memo's cells never do, as
        # min_context values are multiples of the quantum in practice, but the window is not a cell)
        ctx = {r.gates.min_context for r in registry.routes if r.kind != "flashinfer"}
        if registry.host_time is not None:
            ctx.add(registry.host_time.min_context)
        self._ctx_gates = tuple(sorted(ctx))
        self._quantum = max(TILE_TOKENS, self.cal.splits.min_split_tokens)
        self.memo_hits = 0
        self.weigh_host = weigh_host

    @property
    def weigh_host(self) -> bool:
        return self._weigh_host

    @weigh_host.setter
    def weigh_host(self, value: bool) -> None:
        self._weigh_host = bool(value)
        rule, host = self.registry.host_time, self.cal.host_time
        self._host = (rule, host) if self._weigh_host and rule is not None and rule.enabled and host else None
        self._memo.clear()
        self._windows.clear()

    @property
    def host_model(self) -> str | None:
        """Why host time is not weighed (None: it is): ``weigh_host`` off, routes.toml without an
        enabled ``[host_time]``, or a calibration without ``host_time``."""
        if self._host is not None:
            return None
        if not self._weigh_host:
            return "not weighed in this mode (weigh_host=False)"
        if self.registry.host_time is None or not self.registry.host_time.enabled:
            return f"[host_time] is absent or disabled in {self.registry.path}"
        return f"the calibration ({self.cal.source}) has no host_time (pkvrt calibrate --host-time)"

    def _kernel_gap(self) -> str | None:
        """Why no PersistentKV kernel exists for this shape (None: one does)."""
        gaps = []
        if self.head_dim not in HEAD_DIMS:
            gaps.append(f"head_dim {self.head_dim} not in {list(HEAD_DIMS)}")
        if self.group_size not in GROUP_SIZES:
            gaps.append(f"group size {self.group_size} not in {list(GROUP_SIZES)}")
        if self.page_size not in PAGE_SIZES:
            gaps.append(f"page_size {self.page_size} not in {list(PAGE_SIZES)}")
        return "no PersistentKV kernel: " + "; ".join(gaps) if gaps else None

    # -- per route -----------------------------------------------------------------------

    def _route_plan(self, route, seq, *, full: bool):
        """Counters of ``route`` (``full=False``, closed form) or its whole plan (``full=True``).
        ``seq`` is already validated (int64 [B])."""
        kw = dict(self._shape, splits=route.splits, cal=self.cal, tile_tokens=TILE_TOKENS)
        if route.kind == "bucket":   # planned on the attended lengths (the kernel offsets the window)
            att = seq if self.window_left < 0 else np.minimum(seq, self.window_left + 1)
            return bucket_from_checked(att, bucketing=route.bucketing, coarse_lengths=route.coarse_lengths,
                                       rows=full, **kw)
        out = workqueue_from_checked(seq, tasks=full, kind=route.kind, window_left=self.window_left, **kw)
        if route.kind != "fused":
            return out
        return attrs.evolve(out, counters=fused_counters(out.counters)) if full else fused_counters(out)

    def predict(self, route, seq) -> float:
        """Predicted µs of ``route`` on ``seq`` (int64 [B], checked): the calibration's measured
        time model when it has one (from the step's launch groups), else the roofline (from the
        route's closed-form counters, built only then): ``costmodel.predict_route_us``."""
        counters = None
        if self.cal.route_time(route.kind) is None:
            counters = (flashinfer_counters_from_checked(seq, num_kv_heads=self.num_kv_heads,
                                                         head_dim=self.head_dim, dtype_bytes=self.dtype_bytes)
                        if route.kind == "flashinfer" else self._route_plan(route, seq, full=False))
        return predict_route_us(route.kind, seq, counters, self.cal, graphs=self.graphs,
                                num_kv_heads=self.num_kv_heads, head_dim=self.head_dim,
                                dtype_bytes=self.dtype_bytes, splits=route.splits, bucketing=route.bucketing,
                                coarse_lengths=route.coarse_lengths)

    # -- the decision --------------------------------------------------------------------

    def decide(self, seq_lens, *, force: str | None = None, block_tables=None,
               lens: list | None = None, layers: int = 1) -> RouteDecision:
        """Pick this step's route and build its plan (None for ``device_plan_kinds``).

        Parameters
        ----------
        seq_lens : int [B], tokens per row including the new one (>= 1).
        force : a route name: take it regardless of its gates (``enabled = false`` included),
            ablation flag and margin, for ablations; it must still have a kernel for this shape.
            It is predicted like the others. None: the policy decides.
        block_tables : int32 [B, max_pages] or None; only used for the FlashInfer plan's CSR
            (None: a FlashInfer plan carries its counters alone and the caller builds the CSR,
            as the Runtime does straight into its pinned staging).
        lens : the caller has checked the step already (the Runtime's ``check_step``):
            ``seq_lens`` is its int64 array and ``lens`` the same lengths as Python ints. A memo
            hit then costs no numpy call (the summaries and the key come from ``lens``).
        layers : run() calls per plan (the Runtime passes those of its last step); used only
            when host time is weighed (``weigh_host``), where it is part of the memo key.

        Raises
        ------
        ValueError
            bad ``seq_lens``; ``force`` naming an unknown route or one with no kernel; ``layers``
            not a positive integer.
        """
        if isinstance(layers, bool) or not isinstance(layers, int) or layers < 1:
            raise ValueError(f"Router.decide: layers={layers!r}: expected a positive integer (run() "
                             "calls per plan)")
        plan_seq = None   # the lengths the plans are built from: the real ones
        if self.window_left >= 0:   # a windowed row's work is its window: gates, memo, costs
            plan_seq = check_seq_lens(seq_lens) if lens is None else seq_lens
            seq_lens = np.minimum(plan_seq, self.window_left + 1)
            lens = seq_lens.tolist()
        host = self._host
        mforce = force if host is None else (force, layers)   # the memo's and the window's key
        if lens is None:
            seq = check_seq_lens(seq_lens)
            lens = seq.tolist()
        else:
            seq = seq_lens
        plan_seq = seq if plan_seq is None else plan_seq
        active, max_ctx = len(lens), max(lens)
        key = hit = None
        if self.memo_size:
            hit = self._window_hit(lens, mforce)
            if hit is None:
                key = self._key(lens, mforce)
                entry = self._memo.get(key)
                if entry is not None:
                    hit = entry[0]
                    self._windows[mforce] = (entry[1], entry[2], hit)
            if hit is not None:
                self.memo_hits += 1
                # the constructor, not attrs.evolve: 1.7 vs 4.8 us on the dev box, per step
                return RouteDecision(route=hit.route, kind=hit.kind,
                                     plan=self._plan_for(self.registry.route(hit.route), plan_seq, block_tables),
                                     predicted_us=hit.predicted_us, refused=hit.refused, speedup=hit.speedup,
                                     active=active, max_context=max_ctx, forced=hit.forced, reused=True,
                                     wall_us=hit.wall_us, layers=hit.layers, host_bound=hit.host_bound)
        reg = self.registry
        base = reg.baseline
        if force is not None:
            names = [r.name for r in reg.routes]
            if force not in names:
                raise ValueError(f"force={force!r}: no such route in {reg.path}; known: {', '.join(names)}")
            if reg.route(force).kind != "flashinfer" and self._invalid:
                raise ValueError(f"force={force!r}: {self._invalid}")
            if self.kv_dtype not in reg.route(force).kv_dtypes:
                raise ValueError(f"force={force!r}: the route does not serve KV dtype {self.kv_dtype} "
                                 f"(kv_dtypes = {list(reg.route(force).kv_dtypes)} in {reg.path})")

        refused: dict[str, str] = {}
        candidates = []   # PersistentKV routes past their gates (or forced): predicted below
        below_ctx = []    # refused by [gates] min_context alone: evaluated if FlashInfer is host-bound
        for r in reg.routes:
            if r.kind == "flashinfer":
                continue
            if self._invalid:
                refused[r.name] = self._invalid
                continue
            if r.name != force:
                if r.ablation:
                    refused[r.name] = f"ablation route: runs only when forced (force={r.name!r})"
                    continue
                why = r.refusals(group_size=self.group_size, max_context=max_ctx, active=active,
                                 kv_dtype=self.kv_dtype)
                if why:
                    if (host is not None and max_ctx >= host[0].min_context
                            and not r.refusals(group_size=self.group_size, active=active,
                                               max_context=max(max_ctx, r.gates.min_context),
                                               kv_dtype=self.kv_dtype)):
                        below_ctx.append(r)
                    refused[r.name] = "; ".join(why)
                    continue
            candidates.append(r)
        # The baseline is predicted when something is weighed against it (or it is forced): a
        # step every PersistentKV route's gates refuse runs it unpredicted (23-60 us less host
        # time per step the memo misses, on a trace of short requests joining and leaving).
        t_fi = self.predict(base, seq) if candidates or below_ctx or force is not None else None
        predicted = {} if t_fi is None else {base.name: t_fi}
        walls, admitted = {}, False
        if host is not None and t_fi is not None:
            fi_host = host[1].cost("flashinfer")
            walls[base.name] = wall_us(t_fi, fi_host, layers)
            if below_ctx:
                if host_bound(t_fi, fi_host, layers):
                    admitted = True
                    for r in below_ctx:
                        del refused[r.name]
                    candidates += below_ctx
                else:
                    note = (f"; FlashInfer's step is device-bound (host {fi_host.plan_us + layers * fi_host.run_us:.0f} "
                            f"us <= device {layers * t_fi:.0f} us at {layers} layers), so [host_time] "
                            f"min_context does not apply")
                    for r in below_ctx:
                        refused[r.name] += note
        promotable = []  # (T, route)
        for r in candidates:
            t = self.predict(r, seq)
            predicted[r.name] = t
            if host is not None:
                walls[r.name] = wall_us(t, host[1].cost(r.kind), layers)
            if r.name == force:
                continue
            margin = reg.margin_for(r, active)
            if host is not None:
                t, speedup = walls[r.name], walls[base.name] / walls[r.name]
            else:
                speedup = t_fi / t
            if margin is None:
                refused[r.name] = (f"boundary rule: no PersistentKV at {active} active rows "
                                   f"(promotion.boundary margin = inf, allow = false)")
            elif speedup < margin:
                b = reg.boundary
                rule = " (boundary rule)" if active == b.active and not b.allow and margin > r.margin else ""
                what = "wall speedup" if host is not None else "speedup"
                refused[r.name] = f"predicted {what} {speedup:.3f}x < margin {margin:.2f}{rule}"
            else:
                promotable.append((t, r))

        if force is not None:
            chosen = reg.route(force)
            for t, r in promotable:
                refused[r.name] = f"not chosen: route {force!r} forced"
            if chosen.kind != "flashinfer":
                refused.setdefault(base.name, f"not chosen: route {force!r} forced")
        elif promotable:
            t_best, chosen = min(promotable, key=lambda x: x[0])
            wall = " wall" if host is not None else ""
            for t, r in promotable:
                if r is not chosen:
                    refused[r.name] = f"slower than {chosen.name} ({t:.1f} vs {t_best:.1f} us{wall})"
            t_base = walls[base.name] if host is not None else t_fi
            refused[base.name] = f"{chosen.name} predicted {t_base / t_best:.3f}x faster{wall}"
        else:
            chosen = base
        if t_fi is None:
            speedup = 1.0
        elif host is not None:
            speedup = walls[base.name] / walls[chosen.name]
        else:
            speedup = t_fi / predicted[chosen.name]
        d = RouteDecision(route=chosen.name, kind=chosen.kind, plan=self._plan_for(chosen, plan_seq, block_tables),
                          predicted_us=predicted, refused=refused, speedup=speedup,
                          active=active, max_context=max_ctx, forced=force is not None,
                          wall_us=walls, layers=layers if host is not None else 0, host_bound=admitted)
        if key is not None:
            if len(self._memo) >= self.memo_size:
                del self._memo[next(iter(self._memo))]
            template = attrs.evolve(d, plan=None)   # a hit re-plans: keep no arrays
            lens = tuple(lens)
            self._memo[key] = (template, lens, key[2])
            self._windows[mforce] = (lens, key[2], template)
        return d

    def _window_hit(self, lens: list, force: str | None) -> RouteDecision | None:
        """The decision of the last step decided or reused with this ``force``, if this step is
        within its window: the same row count and number of distinct lengths, the longest row
        on the same side of every gate's min_context, and every row within one quantum of the
        lengths that decision was predicted for (``|n - a| < quantum``, the bound a memo key's
        cell gives). Rows that grow a token a step stay in the window for a quantum of steps
        whatever their phase; the key's fixed grid alone misses whenever any row crosses a cell
        (B8, random phases, quantum 64: 12.5 % of the steps, each a full prediction:
        benches/NOTES.md, the router's memo). One window per force: the fallback without FlashInfer
        decides unforced, then forced, every step."""
        w = self._windows.get(force)
        if w is None or len(lens) != len(w[0]):
            return None
        q = self._quantum
        for n, a in zip(lens, w[0]):
            if not -q < n - a < q:
                return None
        if len(set(lens)) != w[1]:
            return None
        top, was = max(lens), max(w[0])
        for g in self._ctx_gates:
            if (top >= g) != (was >= g):
                return None
        return w[2]

    def memo_key(self, seq, force: str | None = None, layers: int = 1) -> tuple | None:
        """The memo's key of a step (``seq``: int [B], checked, or a list of Python ints):
        (force, active rows, distinct lengths, each length // quantum), with ``force`` paired
        with ``layers`` when host time is weighed; None with the memo off."""
        if not self.memo_size:
            return None
        lens = seq if isinstance(seq, list) else seq.tolist()
        return self._key(lens, force if self._host is None else (force, layers))

    def _key(self, lens: list, mforce) -> tuple:
        q = self._quantum
        return (mforce, len(lens), len(set(lens)), tuple([n // q for n in lens]))

    def full_plan(self, route: str, seq_lens, block_tables=None):
        """The full host plan of the route named ``route`` for ``seq_lens`` (int [B]), whatever
        ``device_plan_kinds`` says: the host twin of a plan the caller built on the GPU (the
        planning kernel builds the same tasks in the same order; benches and tests read it)."""
        return self._host_plan(self.registry.route(route), check_seq_lens(seq_lens), block_tables)

    def _plan_for(self, route, seq, block_tables):
        """The full plan of ``route`` for the exact lengths ``seq``; None for a kind the caller
        plans on the GPU (``device_plan_kinds``)."""
        if route.kind in self.device_plan_kinds:
            return None
        return self._host_plan(route, seq, block_tables)

    def _host_plan(self, route, seq, block_tables):
        if route.kind == "flashinfer":
            if block_tables is None:   # the caller builds the CSR (the Runtime, into staging)
                return FlashInferPlan(indptr=None, indices=None, last_page_len=None,
                                      counters=flashinfer_counters_from_checked(
                                          seq, num_kv_heads=self.num_kv_heads, head_dim=self.head_dim,
                                          dtype_bytes=self.dtype_bytes))
            return plan_flashinfer(seq, num_kv_heads=self.num_kv_heads, head_dim=self.head_dim,
                                   dtype_bytes=self.dtype_bytes, page_size=self.page_size,
                                   block_tables=block_tables)
        return self._route_plan(route, seq, full=True)
