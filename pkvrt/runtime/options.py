"""``RuntimeOptions``: the Runtime's ablation and tuning switches, out of its constructor.

The defaults are the measured product; the benches and the ablation tests set the others
(``pkvrt.Runtime(..., options=RuntimeOptions(use_cuda_graph=False))``). A serving engine needs
none of them: what it must say (the shape, the attention variant, the sizes) is the Runtime's own
constructor, and its mode follows from what it passes (:class:`pkvrt.Runtime`).
"""

from __future__ import annotations

import numbers

import attrs

CAPTURE_ROUTING = ("device_planning", "router")


def _bool(inst, attribute, value) -> None:
    if not isinstance(value, bool):
        raise ValueError(f"RuntimeOptions: {attribute.name}={value!r}: expected True or False")


def _count(minimum: int):
    def check(inst, attribute, value) -> None:
        if isinstance(value, bool) or not isinstance(value, int) or value < minimum:
            raise ValueError(f"RuntimeOptions: {attribute.name}={value!r}: expected an int >= {minimum}")
    return check


def _layers(inst, attribute, value) -> None:
    if value is not None:
        _count(1)(inst, attribute, value)


def _routing(inst, attribute, value) -> None:
    if value not in CAPTURE_ROUTING:
        raise ValueError(f"RuntimeOptions: capture_routing={value!r}: expected one of "
                         f"{', '.join(map(repr, CAPTURE_ROUTING))}")


CHUNK_CUTS = ("partition", "time_model")


def _chunk_cut(inst, attribute, value) -> None:
    pinned = isinstance(value, numbers.Integral) and not isinstance(value, bool) and value >= 1
    if not pinned and (not isinstance(value, str) or value not in CHUNK_CUTS):
        raise ValueError(f"RuntimeOptions: shared_chunk_cut={value!r}: expected one of "
                         f"{', '.join(map(repr, CHUNK_CUTS))}, or a split count >= 1 (the cut "
                         "pinned: an ablation)")


@attrs.frozen
class RuntimeOptions:
    """Switches a user leaves alone. Each was measured against its default (benches/NOTES.md).

    use_cuda_graph : replay the Runtime's own CUDA graphs (default) or launch eagerly (the
        ablation; an engine capturing its own step needs neither: inside a capture the Runtime
        launches its kernels into it).
    max_graphs : the Runtime's graphs kept (LRU; evicted graphs are freed).
    validate : O(B * pages) checks of the block tables at plan() and of page ids against the cache
        at run(); the O(B) checks that guard the static buffers always run.
    flashinfer : FlashInfer as the baseline route. False, or FlashInfer failing to import, makes it
        unavailable: steps the policy sends to it run on the fastest PersistentKV route.
    flashinfer_tensor_cores : FlashInfer's tensor-core decode (H200, G 4: 44 vs 52 us at B1 32K).
    flashinfer_cuda_graph : the FlashInfer route in FlashInfer's CUDA-graph mode inside the
        Runtime's graphs: half a FlashInfer step's host time, +2 to +5 % device time at 32 layers
        on 32K steps and +19 % on the Azure conversation trace (H200, 2026-12-02), so off.
    flashinfer_direct_run : eager FlashInfer steps call FlashInfer's compiled entry with the
        arguments its run() built for the step's second layer, from the third layer on
        (``fi_route.DirectCall``, bit for bit FlashInfer's output); False: its run() every layer.
    decision_memo : router decisions remembered (keyed by force, rows, lengths at split
        granularity); 0 decides every step from scratch. Plans stay exact either way.
    capture_routing : ``engine_capture`` with host lengths: ``"device_planning"`` (routes.toml's
        ``[device_planning]`` route, measured in the engine protocol) or ``"router"`` (the
        router's gates and time model, measured on steps launched a layer at a time: the ablation).
    layers_per_plan : run() calls per plan() the router assumes before a step has run (None: 1),
        where host time is weighed (host lengths with the Runtime's graphs and FlashInfer,
        routes.toml ``[host_time]``); after a step it counts that step's calls.
    shared_chunk_rows : :class:`pkvrt.SharedPagesRuntime` only (a Runtime ignores it): rows per
        shared chunk decode, at most the most the kernels serve (None: routes.toml's
        ``[sharing] chunk_heads`` // G rows, 16 // G shipped: the narrow decode body; up to
        64 // G runs the wide body; 1: nothing shared). The ablation of how
        many rows read a shared run in one pass.
    shared_when_predicted_faster : :class:`pkvrt.SharedPagesRuntime` only: share a step's
        pages only where the calibration's time model predicts the shared path faster than the
        plain step (default True; device lengths decide on the GPU, find_shared's rule); False
        shares every step that saves ``min_saved`` of its page reads (host lengths) or every
        chunk found (device lengths, where the chunk decode then keeps the partition's cut): the
        ablation of the rule, and the tests of the shared path's arithmetic.
    fused_two_level_tail : the fused route's last CTAs merge a (row, KV head) of many splits in
        two levels where the kernel's rule says (default True: at D 96-128 G 13-16 from 9
        splits, G 5-12 from 33; D 256 from 5 and 17; kernels/workqueue_task.cuh); False merges
        every row in one level (the ablation).
    shared_chunk_cut : :class:`pkvrt.SharedPagesRuntime` only, host lengths with
        ``engine_capture`` (the device-planning policy; elsewhere the chunk Runtime's router
        picks its route and this is ignored) and device lengths (``"time_model"`` there: the
        same choice made on the GPU by find_shared's rule every step, which hands the chunk
        decode's planning kernel the count; needs the rule: ``shared_when_predicted_faster`` and
        a calibration with the time model): how the chunk decode's step is cut:
        ``"time_model"`` (default: the split count of its longest chunk the calibration's time
        model predicts fastest among those that fit the planning grid, once per sharing
        structure, for chunk decodes of at most routes.toml ``[sharing] model_cut_rows`` chunks
        where it predicts the partition's cut at least ``[sharing] model_cut_margin`` times its
        own; the partition cuts the rest) or ``"partition"`` (the planning kernel's partition, as
        every device-planned step: the ablation), or a split count N: every chunk decode cut at
        N splits of its longest chunk whatever its size (the sweep of the cut, an ablation;
        host lengths with ``engine_capture`` only; plan() raises ValueError naming the counts a
        step takes where N is not one). The partition cuts chunk decodes of few chunks
        at 1.3-1.5x the time model's fastest, and two swept H200 steps agree with the model
        (benches/NOTES.md, "The chunk decode's cut"). On an H100 (7414544) the bounded model's
        cut ran 8 x (8K + 512) 25 % faster (shared at 1.24x FlashInfer, where the partition's cut
        runs it plain at 0.93x); 16 x (1K + 1K) shared 2.4 % faster (the rule runs it plain
        either way); every other sharing step kept the partition's cut.
    shared_side_stream : :class:`pkvrt.SharedPagesRuntime` only: run each layer's chunk decode
        (and its query gather) on a stream of its own beside the own decode, joined before the
        merge (default True: the two decodes read the same q and caches and write their own
        states, so neither waits for the other's tail); False runs them one after the other on
        the caller's stream (the ablation).
    """

    use_cuda_graph: bool = attrs.field(default=True, validator=_bool)
    max_graphs: int = attrs.field(default=64, validator=_count(1))
    validate: bool = attrs.field(default=True, validator=_bool)
    flashinfer: bool = attrs.field(default=True, validator=_bool)
    flashinfer_tensor_cores: bool = attrs.field(default=True, validator=_bool)
    flashinfer_cuda_graph: bool = attrs.field(default=False, validator=_bool)
    flashinfer_direct_run: bool = attrs.field(default=True, validator=_bool)
    decision_memo: int = attrs.field(default=4096, validator=_count(0))
    capture_routing: str = attrs.field(default="device_planning", validator=_routing)
    layers_per_plan: int | None = attrs.field(default=None, validator=_layers)
    shared_chunk_rows: int | None = attrs.field(default=None, validator=_layers)
    shared_when_predicted_faster: bool = attrs.field(default=True, validator=_bool)
    shared_side_stream: bool = attrs.field(default=True, validator=_bool)
    shared_chunk_cut: str | int = attrs.field(default="time_model", validator=_chunk_cut)
    fused_two_level_tail: bool = attrs.field(default=True, validator=_bool)


FIELDS = tuple(a.name for a in attrs.fields(RuntimeOptions))


def with_options(kwargs: dict | None = None, **more) -> dict:
    """Runtime keyword arguments from a flat mapping (the benches' and tests' configurations):
    its RuntimeOptions fields gathered into ``options=`` (on top of an ``options`` it holds)."""
    kw = dict(kwargs or {}, **more)
    opts = {k: kw.pop(k) for k in FIELDS if k in kw}
    if opts:
        kw["options"] = attrs.evolve(kw.pop("options", None) or RuntimeOptions(), **opts)
    return kw
