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
graphs for every step of that padded batch while the lengths change. Three ways to give a step:

* host lengths (the default ``Runtime(...)``): ``plan`` checks the step (O(B), and with
  ``validate`` the page ids it uses) and the :class:`pkvrt.policy.router.Router` picks the route from
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
* device lengths (int32 CUDA tensors at the first plan(), or ``device_planning=True``): no host routing, every step runs routes.toml's
  ``[device_planning] route`` (``small_route`` on steps of at most ``small_rows`` rows: the row
  count is known on the host; ``large_group_route`` for a Runtime of G >= ``large_group``); nothing synchronizes, and plan()/run() can be captured in an
  engine's own graph, where plan() is one launch of the planning kernel (it copies the step's
  lengths and block-table entries itself); with the Runtime's graphs on, two device copies and
  the planning graph.
* host lengths, the step captured by the engine (``engine_capture=True``): plan() outside the
  engine's capture checks and stages the step as in the first way (one copy); the step's first
  run() launches the planning kernel before its decode, so the engine, which captures every
  layer's run() in one graph per :attr:`Runtime.step_key` and replays it, replays the planning
  too: one graph launch per step. The route is routes.toml's ``[device_planning]`` one, the policy measured for
  captured steps (``RuntimeOptions(capture_routing="router")``: the router's, the ablation).

Which route a step takes thus depends on how its layers launch: a layer at a time (the Runtime's
own graphs, eager), the router's gates and cost model, measured on such steps; with the
Runtime's own graphs and FlashInfer eager (the default), each route's host time as well
(routes.toml ``[host_time]``, the calibration's ``host_time``): the router predicts the step's
wall time, ``plan_us + L * max(run_us, T)``, at the ``L`` run() calls per plan() it saw on the
last step (``costmodel.wall_us``; the first step counts one), so steps FlashInfer's host path
would bound run on a PersistentKV route; captured whole
(device lengths or ``engine_capture``), ``[device_planning]``: in a captured step the
PersistentKV kernels of one layer start while the previous layer's drain (programmatic dependent
launch) and win on every trace of the engine protocol (README), where FlashInfer's do not.

``run`` checks the tensors and replays the CUDA graph of this (route, batch, structure, tensors)
key, capturing it on a miss (:mod:`pkvrt.runtime.graphs` says what a key holds).

Host cost of a host-lengths ``plan``: the router (a memo hit: 15-35 us on the 2-core dev box
at B8, no planner call for a workqueue/fused step; a miss, about once per ``quantum / B`` steps
of a decode loop, 100-600 us), the O(B * pages) validation (``RuntimeOptions.validate``: ~21-25 us for
the whole check at B8 with 2048-page rows on the dev box, one pass over the page ids,
``test_bench_check_step_b8_32k``; ``RuntimeOptions(validate=False)`` skips the page ids),
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

The package, in the order a step flows through it:

- :mod:`~pkvrt.runtime.checks`: a step's metadata and a run's tensors checked on the host,
  ValueError naming the argument (nothing is written before they pass).
- :mod:`~pkvrt.runtime.options`: :class:`RuntimeOptions`, the ablation and tuning switches.
- :mod:`~pkvrt.runtime.core`: :class:`Runtime`, its construction and reporting; it is
  assembled from the three pieces below, one per seam, each readable alone.
- :mod:`~pkvrt.runtime.buffers`: the static device buffers and pinned staging, their sizes.
- :mod:`~pkvrt.runtime.planning`: ``plan()``: route choice, staging, the planning kernel's graph.
- :mod:`~pkvrt.runtime.running`: ``run()``: the graph of a step's key, captured once, replayed.
- :mod:`~pkvrt.runtime.graphs`: graph keys, the graph cache, capture, arena layout.
- :mod:`~pkvrt.runtime.fi_route`: the FlashInfer route (its wrapper over the same pages).
- :mod:`~pkvrt.runtime.shared`: ``SharedPagesRuntime``, steps whose rows share pages read each
  shared page once per chunk of rows (two Runtimes and an exact merge).
- :mod:`~pkvrt.runtime.wrapper`: ``pkvrt.BatchDecodeWithPagedKVCacheWrapper``, FlashInfer's decode
  wrapper API over a Runtime (one import to switch an engine).

May import: torch, the policy, the launch layer. Never the tools, ``pkvrt.measure`` or the
integrations (they import the runtime).
"""

from pkvrt.policy.registry import DEVICE_PLANNED
from pkvrt.runtime.checks import (DTYPES, MAX_SEQ_LEN, StepInput, check_device_step, check_run_args,
                                  check_shape, check_step, host_int_array, used_page_id_max)
from pkvrt.runtime.core import Runtime
from pkvrt.runtime.options import RuntimeOptions

__all__ = ["Runtime", "RuntimeOptions", "DEVICE_PLANNED", "DTYPES", "MAX_SEQ_LEN", "StepInput", "check_device_step",
           "check_run_args", "check_shape", "check_step", "host_int_array", "used_page_id_max"]
