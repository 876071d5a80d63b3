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
  workqueue and fused routes, the task capacity :func:`task_bucket` (the 1-D grid size);
  FlashInfer, the serial number of the wrapper it was planned on.
* buffer generation: bumped when a static buffer is reallocated to grow (the cache is cleared
  then, too; the number keeps an old key from ever matching a new buffer).
* tensors: :func:`tensor_key` ``(data_ptr, shape, strides, dtype)``; the runtime's own static
  q/out staging buffers are keyed as the single word ``"static"``.

Everything here but :func:`capture` is plain Python and runs without CUDA.
"""

from __future__ import annotations

from collections import OrderedDict

import attrs

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
    """Task capacity (1-D grid size) a workqueue graph is captured for: ``tasks`` rounded up to
    one of ``steps_per_octave`` evenly spaced sizes per power of two.

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


def capture(launch, *, side_stream, pool, device) -> GraphEntry:
    """Warm ``launch()`` up on ``side_stream``, then capture it into a new graph (CUDA only).

    The warm-up is a real run: it computes this call's result, so the caller need not replay
    the new graph for this call. ``torch.cuda.graph`` synchronizes the device when entering
    capture, so a miss costs a device sync plus the capture (see Runtime.stats()).

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

    from pkvrt import _driver

    cur = torch.cuda.current_stream(device)
    side_stream.wait_stream(cur)
    with torch.cuda.stream(side_stream):
        launch()
    cur.wait_stream(side_stream)
    before = torch.cuda.memory_allocated(device)
    graph = torch.cuda.CUDAGraph(keep_graph=True)
    with torch.cuda.graph(graph, pool=pool):
        launch()
    if hasattr(graph, "instantiate"):
        graph.instantiate()
    nodes = _driver.graph_node_count(graph)
    if nodes <= 0:
        graph.reset()
        raise RuntimeError("pkvrt.graphs.capture: the captured CUDA graph is empty (0 nodes); expected "
                           "the route's kernel launches on the capturing stream")
    return GraphEntry(graph=graph, nodes=nodes, mem_bytes=torch.cuda.memory_allocated(device) - before)
