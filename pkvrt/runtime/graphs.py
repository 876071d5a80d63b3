"""CUDA-graph bookkeeping of :class:`pkvrt.runtime.Runtime`: keys, padded sizes, an LRU of graphs.

A captured graph bakes in everything its launches were given: grid sizes, the pointers of q,
out, k_cache, v_cache and of the runtime's static metadata buffers, and the strides. Its key
therefore holds exactly what changes those (DESIGN.md "CUDA graphs")::

    (route, kind, graph batch, structure, buffer generation, k/v tensors, q/out tensors)

* graph batch: :func:`padded_batch` (next power of two) for the PersistentKV routes, so a
  step with 5, 6, 7 or 8 rows replays the same graph (padded rows have ``row_ids = -1`` or an
  empty ``split_offsets`` range and exit at once); the exact B for FlashInfer, whose CUDA-graph
  wrappers are built for one batch size.
* structure: bucket route, one ``(padded rows, splits)`` pair per bucket in launch order;
  workqueue and fused routes, the grid of the planning kernel for the padded batch (the most
  tasks the balanced partition plans for that many rows, ``planner.device_grid_ctas``; slots
  past a step's tasks exit at once), the same for every step of that padded batch, so their
  graphs replay while the lengths change; FlashInfer, the serial number of the wrapper it was
  planned on.
* buffer generation: bumped when a static buffer is reallocated to grow (the cache is cleared
  then, too; the number keeps an old key from ever matching a new buffer).
* tensors: :func:`tensor_key` ``(data_ptr, shape, strides, dtype)``; the runtime's own static
  q/out staging buffers are keyed as the single word ``"static"``.

It also sizes and lays out the static buffers graphs read: :func:`initial_capacities`,
:func:`needed_capacities` and :func:`grow` (partial-state slots, workqueue tasks), and the int32
metadata arena (:func:`arena_layout`) with its writer :func:`stage_bucket`, which copies a
bucket plan into pinned staging. :func:`stage_workqueue` writes a host workqueue plan the way
the planning kernel (kernels/plan_workqueue.cu) writes it on the GPU: the Runtime no longer
stages workqueue plans from the host, the function stays as the kernel's reference twin.

Everything here but :func:`capture` is plain Python and NumPy and runs without CUDA
(:func:`collector_paused`, which capture uses, too).
"""

from __future__ import annotations

import contextlib
import gc
import threading
from collections import OrderedDict

import attrs
import numpy as np

ALIGN = 16  # arena sections start at multiples of 16 int32 (64 bytes)
STATIC = "static"  # the tensor part of a key whose graph reads the runtime's static q/out buffers


def padded_batch(batch: int) -> int:
    """Next power of two >= ``batch`` (at least 1): the batch a PersistentKV graph is captured for.

    1 -> 1, 3 -> 4, 8 -> 8, 9 -> 16. Padding wastes only idle grid slots that exit at once, and
    cuts the graphs a growing or shrinking batch needs from B to log2(B).
    """
    if batch < 1:
        raise ValueError(f"padded_batch: batch={batch}: expected >= 1")
    return 1 << (int(batch) - 1).bit_length()


def task_bucket(tasks: int, steps_per_octave: int = 4) -> int:
    """Task capacity (1-D grid size) of a host-staged workqueue plan (:func:`stage_workqueue`,
    the reference twin; the Runtime's graphs use the planning kernel's grid): ``tasks`` rounded
    up to one of ``steps_per_octave`` evenly spaced sizes per power of two.

    Every idle grid slot is a CTA that is scheduled and exits, so the capacity must stay close to
    the real count: with 4 steps per octave at most 25 % of the grid idles. Example: 1280 tasks
    (B8 x 8 kv heads x 20 splits) -> octave 1024, step 256 -> 1280 (no idle slot); 1300 -> 1536
    (236 idle); 3 -> 3 (below 4, steps of 1). The planner aims every step at the same CTA count
    (``workqueue_ctas_per_sm * SMs``), so the bucket rarely changes between steps.
    """
    if tasks < 1:
        return 1
    octave = 1 << (int(tasks).bit_length() - 1)
    step = max(1, octave // steps_per_octave)
    return -(-int(tasks) // step) * step


def tensor_key(t) -> tuple:
    """What a graph bakes in of a tensor: ``(data_ptr, shape, strides, dtype)``."""
    return (t.data_ptr(), tuple(t.shape), t.stride(), t.dtype)


def graph_key(route: str, kind: str, batch: int, structure, generation: int, kv: tuple,
              q_out) -> tuple:
    """The key of one captured graph (module docstring). ``kv`` = ``(tensor_key(k_cache),
    tensor_key(v_cache))``; ``q_out`` = ``(tensor_key(q), tensor_key(out))`` or :data:`STATIC`."""
    return (route, kind, batch, structure, generation, kv, q_out)


@attrs.define(eq=False)
class GraphEntry:
    """One captured graph: ``graph`` (a torch.cuda.CUDAGraph or anything with ``replay`` and
    ``reset``), its node count and the estimated memory it holds (bytes)."""

    graph: object
    nodes: int
    mem_bytes: int


class GraphCache:
    """LRU of at most ``max_graphs`` captured graphs; an evicted graph is ``reset()`` (freed).

    ``get`` marks an entry most recently used; ``put`` evicts the least recently used entries
    beyond the bound; ``clear`` drops all of them (buffers were reallocated).
    """

    def __init__(self, max_graphs: int):
        if isinstance(max_graphs, bool) or not isinstance(max_graphs, int) or max_graphs < 1:
            raise ValueError(f"max_graphs={max_graphs!r}: expected an integer >= 1")
        self.max_graphs = max_graphs
        self._entries: OrderedDict[tuple, GraphEntry] = OrderedDict()
        self.evictions = 0
        self.invalidations = 0

    def __len__(self) -> int:
        return len(self._entries)

    def __contains__(self, key) -> bool:
        return key in self._entries

    def get(self, key) -> GraphEntry | None:
        e = self._entries.get(key)
        if e is not None:
            self._entries.move_to_end(key)
        return e

    def put(self, key, entry: GraphEntry) -> None:
        old = self._entries.pop(key, None)
        if old is not None:
            old.graph.reset()
        self._entries[key] = entry
        while len(self._entries) > self.max_graphs:
            _, e = self._entries.popitem(last=False)
            e.graph.reset()  # an in-flight graph exec is freed by the driver when it completes
            self.evictions += 1

    def clear(self) -> None:
        for e in self._entries.values():
            e.graph.reset()
        self.invalidations += len(self._entries)
        self._entries.clear()

    def memory_bytes(self) -> int:
        return sum(e.mem_bytes for e in self._entries.values())

    def node_counts(self) -> list[int]:
        return [e.nodes for e in self._entries.values()]


class SeenKeys:
    """A bounded set of recently seen keys (oldest forgotten first).

    The runtime captures a graph on a caller's own q/out tensors only the second time it sees
    the same key: engines that pass fresh tensors every call would otherwise capture a graph per
    call. The first time, the call runs through the static q/out buffers instead.
    """

    def __init__(self, size: int):
        self.size = max(1, size)
        self._keys: OrderedDict[tuple, None] = OrderedDict()

    def check_and_add(self, key) -> bool:
        """True if ``key`` was seen before; records it either way."""
        if key in self._keys:
            self._keys.move_to_end(key)
            return True
        self._keys[key] = None
        if len(self._keys) > self.size:
            self._keys.popitem(last=False)
        return False


# ----------------------------------------------------------------------------- capacities


@attrs.frozen
class Capacities:
    """Partial-state slots (part_a/part_ml rows) and workqueue task slots the buffers hold."""

    slots: int
    tasks: int


def initial_capacities(registry, *, max_batch: int, num_kv_heads: int) -> Capacities:
    """Capacities allocated at construction (:mod:`pkvrt.runtime.buffers` says why). Seed
    routes.toml, H_kv 8:
    max_active 8 -> 8 rows * max splits 64 = 512 slots; task_bucket(512 * 8) = 4096 tasks."""
    pkv = [r for r in registry.routes if r.kind != "flashinfer"]
    if not pkv:
        return Capacities(slots=1, tasks=1)
    rows = padded_batch(min(max_batch, max(r.gates.max_active for r in pkv)))
    slots = rows * max(r.splits.max for r in pkv)
    return Capacities(slots=slots, tasks=task_bucket(slots * num_kv_heads))


def needed_capacities(kind: str, plan) -> Capacities:
    """What a plan needs. Bucket: the largest padded-rows x splits of a bucket with splits > 1
    (buckets run one after another and reuse slots from 0); workqueue/fused: every row's splits
    (``split_offsets[-1]``) and the graph's task capacity; FlashInfer: nothing."""
    if kind == "bucket":
        slots = max((padded_batch(b.rows.size) * b.num_splits
                     for b in plan.buckets if b.num_splits > 1), default=0)
        return Capacities(slots=slots, tasks=0)
    if kind in ("workqueue", "fused"):
        return Capacities(slots=int(plan.split_offsets[-1]), tasks=task_bucket(plan.tasks.shape[0]))
    return Capacities(slots=0, tasks=0)


def grow(current: int, need: int) -> int:
    """``current`` if it suffices, else ``max(need, 2 * current)`` (geometric: few regrowths)."""
    return current if need <= current else max(need, 2 * current)


# ----------------------------------------------------------------------------- metadata arena


def _align(n: int) -> int:
    return -(-n // ALIGN) * ALIGN


@attrs.frozen
class ArenaLayout:
    """Element offsets of the sections of the int32 metadata arena (one H2D copy per step)."""

    max_batch: int
    task_capacity: int
    seq_lens: int
    split_offsets: int
    num_tasks: int
    row_ids: int
    merge_offsets: int
    tasks: int
    size: int


def arena_layout(max_batch: int, task_capacity: int) -> ArenaLayout:
    """Sections, in order: seq_lens [max_batch]; split_offsets [pow2(max_batch)+1] (the padded
    batch's); num_tasks [1]; row_ids [2*max_batch]; merge offsets [2*max_batch] (each bucket
    pads r rows to pow2(r) <= 2r-1, so all buckets' padded rows, and their pad+1 offsets, fit);
    tasks [task_capacity * 5] last, so a workqueue step copies only the prefix it uses."""
    sizes = (max_batch, padded_batch(max_batch) + 1, 1, 2 * max_batch, 2 * max_batch,
             5 * task_capacity)
    offs, at = [], 0
    for s in sizes:
        offs.append(at)
        at = _align(at + s)
    return ArenaLayout(max_batch, task_capacity, *offs, size=at)


def bucket_sections(layout: ArenaLayout, structure) -> list[tuple[int, int, int, int | None]]:
    """``(row_ids offset, padded rows, splits, merge-offsets offset or None)`` per bucket of a
    bucket-route structure ``((padded rows, splits), ...)``, in launch order."""
    out, r, m = [], layout.row_ids, layout.merge_offsets
    for pad, s in structure:
        out.append((r, pad, s, m if s > 1 else None))
        r += pad
        if s > 1:
            m += pad + 1
    return out


def stage_bucket(arena: np.ndarray, layout: ArenaLayout, plan) -> tuple[tuple, int]:
    """Write a bucket plan's row ids (each bucket padded to pow2 rows with -1) and, for buckets
    with splits > 1, merge offsets ``arange(pad + 1) * splits``. Returns (structure, elements
    of the arena used). Example: buckets of 3 rows (S 16) and 1 row (S 32) -> row ids
    [r0 r1 r2 -1 | r3], merge offsets [0 16 32 48 64 | 0 32], structure ((4, 16), (1, 32))."""
    structure = tuple((padded_batch(b.rows.size), int(b.num_splits)) for b in plan.buckets)
    end = layout.row_ids
    for (roff, pad, s, moff), b in zip(bucket_sections(layout, structure), plan.buckets):
        n = b.rows.size
        arena[roff:roff + n] = b.rows
        arena[roff + n:roff + pad] = -1
        end = max(end, roff + pad)
        if moff is not None:
            arena[moff:moff + pad + 1] = np.arange(pad + 1) * s
            end = max(end, moff + pad + 1)
    return structure, end


def stage_workqueue(arena: np.ndarray, layout: ArenaLayout, plan, batch: int) -> tuple[int, int]:
    """Write a workqueue plan as the planning kernel writes it on the GPU (the reference twin;
    the Runtime does not call it): split_offsets over the padded batch (padded rows repeat the
    last offset: zero slots, the merge skips them), num_tasks, tasks. Returns (task capacity of
    the graph, elements of the arena used)."""
    gb = padded_batch(batch)
    t = plan.tasks.shape[0]
    cap = task_bucket(t)
    if cap > layout.task_capacity:
        raise ValueError(f"stage_workqueue: {t} tasks need capacity {cap}, the arena holds "
                         f"{layout.task_capacity}; grow it first")
    so = layout.split_offsets
    arena[so:so + batch + 1] = plan.split_offsets
    arena[so + batch + 1:so + gb + 1] = plan.split_offsets[-1]
    arena[layout.num_tasks] = t
    arena[layout.tasks:layout.tasks + 5 * t] = plan.tasks.reshape(-1)
    return cap, layout.tasks + 5 * t


_pause_lock = threading.Lock()
_pauses = 0                  # captures under way in this process (threads may capture at once)
_resume = False              # whether the collector was on when the first of them began


@contextlib.contextmanager
def collector_paused():
    """Python's cyclic garbage collector off while the block runs (:func:`capture`). Counted,
    so that when several threads capture at once the collector comes back on only when the last
    of them ends, and only if it was on before the first began.

    The collector has one switch per process, so this cannot defend against code that flips it
    meanwhile: a ``gc.enable()`` (or an explicit ``gc.collect()``) in another thread during the
    capture lets a collection run inside it again, and a ``gc.disable()`` made during the
    capture is undone when the last pause ends (the collector goes back to its state before the
    first). A collection that another thread had already started when the pause began runs to
    its end."""
    global _pauses, _resume
    entered = False
    try:
        with _pause_lock:
            if _pauses == 0:
                _resume = gc.isenabled()
                gc.disable()
            _pauses += 1
            entered = True
        yield
    finally:
        if entered:
            with _pause_lock:
                _pauses -= 1
                if _pauses == 0 and _resume:
                    gc.enable()


def capture(launch, *, side_stream=None, pool=None, device=None,
            capture_error_mode: str = "global") -> GraphEntry:
    """Warm ``launch()`` up on ``side_stream``, then capture it into a new graph (CUDA only).
    The one home of the warm-up-then-capture sequence: the Runtime's per-layer graphs, the
    harness's timed graphs, an engine's whole-step graph (examples/engine_graph.py).
    ``side_stream`` None: a new stream; ``pool`` None: a private memory pool; ``device`` None:
    the current device.
    ``capture_error_mode`` is ``torch.cuda.graph``'s (``"thread_local"`` lets other threads,
    such as NCCL's watchdog, make CUDA calls during the capture).

    The warm-up is a real run: it computes this call's result, so the caller need not replay
    the new graph for this call. ``torch.cuda.graph`` synchronizes the device when entering
    capture, so a miss costs a device sync plus the capture (see Runtime.stats()).

    The cyclic garbage collector is paused for the capture (an automatic collection runs
    when Python allocates, which ``launch()`` does): a collection inside it would run the
    finalizers of unreachable objects there, and a CUDA graph destroyed inside a capture
    (a dead Runtime's, a dead harness's) invalidates it, so the capture's next launch fails
    with CUDA_ERROR_STREAM_CAPTURE_INVALIDATED (2026-12-03: tests/gpu/test_fp8.py then
    test_runtime.py with some calibrations; benches/NOTES.md). Garbage found meanwhile is
    collected at the next allocation after it.

    Returns a :class:`GraphEntry`; its ``mem_bytes`` is the ``torch.cuda.memory_allocated``
    delta around the capture, an estimate: memory the driver holds for the instantiated graph
    itself is not visible to torch and is not counted.

    Raises
    ------
    RuntimeError
        if the captured graph has no nodes (a launch went to another stream than the capturing
        one, so replaying it would silently do nothing).
    """
    import torch

    from pkvrt.launch import _driver

    cur = torch.cuda.current_stream(device)
    side_stream = torch.cuda.Stream(device) if side_stream is None else side_stream
    side_stream.wait_stream(cur)
    with torch.cuda.stream(side_stream):
        launch()
    cur.wait_stream(side_stream)
    before = torch.cuda.memory_allocated(device)
    graph = torch.cuda.CUDAGraph(keep_graph=True)
    with collector_paused():   # no finalizer may destroy a CUDA graph inside the capture (above)
        with torch.cuda.graph(graph, pool=pool, capture_error_mode=capture_error_mode):
            launch()
    if hasattr(graph, "instantiate"):
        graph.instantiate()
    nodes = _driver.graph_node_count(graph)
    if nodes <= 0:
        graph.reset()
        raise RuntimeError("pkvrt.runtime.graphs.capture: the captured CUDA graph is empty (0 nodes); expected "
                           "the route's kernel launches on the capturing stream")
    return GraphEntry(graph=graph, nodes=nodes, mem_bytes=torch.cuda.memory_allocated(device) - before)
