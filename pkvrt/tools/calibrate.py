"""Measure this GPU's cost-model constants, write calibration/<gpu>.json (needs a GPU and FlashInfer).

What is measured, at the seed shape (H_q 32, H_kv 8, D 128, page 16, fp16), every time a CUDA-
event median of CUDA-graph replays (the benches/isolated.py protocol), every kernel output
checked against the FP32 reference first:

- beta_gbps: the faster of two streaming reads, a torch float32-accumulating sum over 2 GiB of
  fp16 and the PersistentKV split-decode kernel over a B16 x 32K step (2 GiB of K+V, 8 splits;
  its merge launch is included, ~2 MB of partial states against 2 GiB, so beta errs low);
- lambda_us: one eager launch of a tiny pkvrt kernel (split decode of a 1-token row) from
  Python, median over 20 loops of 100 launches; lambda_graph_us: the same kernel as one node of
  a graph of 200 (torch's 1-element add is measured too and printed, for comparison);
- splits.bucket_ctas_per_sm: candidate split counts of the bucket route (B1 at 8K, 32K, 64K),
  fitted by ``calibration.fit_split_points``;
- the balanced partition's constants (splits.workqueue_ctas_per_sm, co_resident_slowdown,
  cta_overhead_tiles, min_split_tokens): the workqueue and fused routes of routes.toml (which
  share them) timed at every cut their split bounds allow on eleven steps (:func:`calibration_steps`),
  fitted together by ``calibration.fit_partition`` with the main device-planning route's kernel
  occupancy (``[device_planning] route``, the fused kernel as shipped, also at the group sizes
  that run ``large_group_route``: the two kinds share the constants); once per group size of
  ``--groups`` (H_q 32 over H_kv 32 / G where G divides 32, else H_kv 8 and H_q 8 G: the models'
  shapes, e.g. 24 / 8 at G 3; FlashInfer's CUDA-core path only at the group sizes it has
  kernels for): the first (4) gives the top-level keys, the others a
  ``splits.by_group`` entry each, which the Runtime uses for that G;
- c_min: the occupancy target that makes the cost model best fit every timed split
  configuration (least squares in log time, :func:`fit_c_min`);
- flashinfer.ctas_per_sm: FlashInfer's best (CUDA-core or tensor-core) time at 32K for 1, 2, 4,
  8, 16 active rows, turned into the C that reproduces it (:func:`fit_flashinfer_ctas`);
- time_model (what the router predicts with; :mod:`pkvrt.policy.costmodel`, "The measured model"):
  per route kind and group size, fitted by ``sweeps.fit_time_model`` on the timed rows: the
  bucket sweeps, the device-planning route and the other workqueue-or-fused route of routes.toml
  (``pkv_workqueue`` as shipped) each timed at every cut of the eleven partition steps at every G of
  ``--groups``, and FlashInfer (both paths) on those steps at every G and at B1..B16 32K.

FlashInfer is required (``pip install -e ".[flashinfer]"``): it is timed to fit FlashInfer's cost
model (``time_model.flashinfer``, and ``flashinfer.ctas_per_sm`` for the roofline), which the host
router uses to predict the FlashInfer baseline's time before it promotes a PersistentKV route
(the promotion margin). Every other constant comes from pkvrt's own kernels and torch and could
be measured without FlashInfer, but a calibration file needs all of them (schema 1), so without
FlashInfer calibrate stops before measuring anything.

More group sizes (``--add-groups LIST``, e.g. 2,3,5,7,16; not 4): the partition sweeps and
FlashInfer at those G only (no bucket sweep), fitted as above into their ``splits.by_group`` and
``time_model.by_group`` entries of this GPU's file (``--base``, default the ``--out`` file); every
other constant, section and ``host_time`` stays the file's, so the cuts of the shapes the file
already covers do not move. About 45 s per group size on an H200 (an estimate).

Another head dim (``--head-dim D``, D 64, 96 or 256): the calibration steps' partition and bucket
sweeps at that head dim (fp16 caches, FlashInfer not timed), fitted into the
``by_head_dim.<D>`` section of this GPU's file (``--base``): splits.bucket_ctas_per_sm and the
partition constants per G of ``--groups``, with the kernel's occupancy at that head dim; the
time model and every other constant stay the file's (``Calibration.for_head_dim``).

FP8 K/V (``--kv-dtype fp8``): the same bucket and partition sweeps with
float8_e4m3fn caches (``harness.quantize_fp8`` "unit", scales as float32 [1] device tensors,
outputs checked against the FP32 reference over the dequantized caches), fitted into the
``by_kv_dtype.float8_e4m3fn`` section of this GPU's file (``--base``, default the ``--out``
file): splits.bucket_ctas_per_sm, the partition constants per G (with the occupancy of the
e4m3 kernel) and the time model of pkvrt's route kinds per G. FlashInfer is not timed (an FP8
Runtime does not run it: its decode takes the scales as host floats) and need not be installed;
beta, lambda, c_min, FlashInfer's constants and max_waves stay the file's, as every other
constant does. An FP8 Runtime or Router sees the file through ``Calibration.for_kv_dtype``.
``--raw`` rows carry ``kv_dtype``; ``benches/cost_model_error.py`` refits the section offline.
A 16-bit run writes a whole file and drops the section of the file it replaces (its time model
was fitted against the old beta), saying so.

It prints a table of the constants and the sweeps, then measured against predicted µs per route
and step at the cut each planner picks (the time model and the roofline, ``sweeps.format_errors``),
then the gates the steps measured (group sizes, minimum context, active rows where each route beat
FlashInfer by its margin) as a routes.toml snippet: printed, written to ``--suggest-routes PATH``
when asked, never applied (not with FP8: no FlashInfer times). It takes about 2.5 minutes on an
H200 with the three group sizes and the 64 + 17 cuts of the shipped bounds (an FP8 run at G 4
only, an estimate: about 50 s); ``--quick`` measures fewer points. Without a CUDA GPU, or
without FlashInfer for a 16-bit run, it says so and exits with status 2.
"""

from __future__ import annotations

import argparse
import datetime
import math
import sys
import time
from pathlib import Path

import attrs
import numpy as np

from pkvrt._buildspec import TILE_TOKENS
from pkvrt.measure import results
from pkvrt.measure.traces import Request, Trace, decode_steps, synthetic
from pkvrt.policy import calibration as calib
from pkvrt.policy.costmodel import route_time_us
from pkvrt.policy.registry import KV_DTYPES, SplitBounds, load_routes
from pkvrt.measure.model_shapes import MODELS
from pkvrt.runtime import fi_route
from pkvrt.tools import sweeps
from pkvrt.tools.cli import positive_int

SEED = 20260622
SHAPE = dict(num_qo_heads=32, num_kv_heads=8, head_dim=calib.CALIBRATION_HEAD_DIM, page_size=16)
GROUPS = (4, 1, 8)   # group sizes whose partition constants are fitted; 4 gives the top level


def group_shape(group: int, head_dim: int = SHAPE["head_dim"]) -> dict:
    """SHAPE with ``group`` query heads per KV head (``sweeps.group_heads``: H_q 32 over
    32 / G KV heads where G divides 32, else 8 KV heads and 8 G query heads), at ``head_dim``."""
    try:
        hq, hkv = sweeps.group_heads(group)
    except ValueError as e:
        raise ValueError(f"--groups: {e}") from None
    return {**SHAPE, "num_qo_heads": hq, "num_kv_heads": hkv, "head_dim": head_dim}


def _group_list(text: str, flag: str) -> tuple[int, ...]:
    """``text`` as distinct group sizes each with a calibration shape (ValueError naming ``flag``)."""
    try:
        groups = tuple(int(x) for x in text.split(","))
    except ValueError:
        example = "4,1,8" if flag == "--groups" else "3,5,16"
        raise ValueError(f"{flag}: expected comma-separated positive integers, e.g. {example}; "
                         f"got {text!r}") from None
    if not groups or len(set(groups)) != len(groups):
        raise ValueError(f"{flag}: expected distinct group sizes, got {text!r}")
    for g in groups:
        try:
            group_shape(g)
        except ValueError as e:
            raise ValueError(str(e).replace("--groups", flag)) from None
    return groups


def parse_groups(text: str) -> tuple[int, ...]:
    """``--groups`` as a tuple of distinct group sizes, e.g. "4,1,8" -> (4, 1, 8). It must hold 4
    (the seed shape): that fit becomes the file's top-level partition keys, the others
    ``splits.by_group``."""
    groups = _group_list(text, "--groups")
    if 4 not in groups:
        raise ValueError(f"--groups: must include 4 (the seed shape, whose fit gives the file's "
                         f"top-level partition keys), got {text!r}")
    return groups


B1_CONTEXTS = (8192, 32768, 65536)
FI_CONTEXT = 32768
FI_ACTIVE = (1, 2, 4, 8, 16)
C_GRID = tuple(0.5 * 1.01 ** i for i in range(int(math.log(128) / math.log(1.01)) + 1))  # 0.5..64


# --------------------------------------------------------------------------- pure parts

def calibration_steps(seed: int = SEED) -> list[tuple[str, str, np.ndarray]]:
    """The timed steps: (case, route kind, seq_lens int32 [B]).

    Bucket route: B1 rows of 8K, 32K and 64K tokens (its split target). Workqueue route (the
    balanced partition, timed at every candidate cut): one row of 1.6K, 8K, 32K and 128K tokens; a
    32K row beside a 1.4K one; eight 32K rows; eight 1K rows; eight short rows drawn with
    ``seed`` (log-normal around 900 tokens); the first decode step of a B4 and a B8
    continuous-decode run over ``synthetic("bimodal", seed=seed)`` (one ~32K row and three
    1K-4K rows per four; seq_len = prompt + 1); one long row (uniform in 16K-48K) among seven
    short ones (uniform in 1K-6K) drawn with ``seed``: the step of a serving batch with one
    long-context request, whose cut trades the long row's split count against the short rows'
    CTAs (the B8 bimodal step has two long rows, the B2 one a single short row; without this
    step the G = 8 fit of 2026-12-01 cut such steps at 20 where 40 ran 14-24 % faster,
    benches/NOTES.md, "Current state").
    """
    i32 = lambda x: np.asarray(x, dtype=np.int32)  # noqa: E731
    out = [(f"B1-{n // 1024}K", "bucket", i32([n])) for n in B1_CONTEXTS]
    out += [("B1-1.6K", "workqueue", i32([1600])), ("B1-8K", "workqueue", i32([8192])),
            ("B1-32K", "workqueue", i32([32768])), ("B1-128K", "workqueue", i32([131072])),
            ("B2-32K+1.4K", "workqueue", i32([32768, 1400])),
            ("B8-32K", "workqueue", i32([32768] * 8)), ("B8-1K", "workqueue", i32([1024] * 8))]
    rng = np.random.default_rng(seed)
    short = np.clip(np.round(rng.lognormal(np.log(900), 0.9, 8)), 16, 8000)
    out.append((f"short-B8-seed{seed}", "workqueue", i32(short)))
    for b in (4, 8):
        trace = synthetic("bimodal", num_requests=b, seed=seed)
        step = next(decode_steps(trace, max_active=b))
        out.append((f"bimodal-B{b}-seed{seed}", "workqueue", step.seq_lens.astype(np.int32)))
    long1 = np.concatenate([rng.integers(16384, 49153, 1), rng.integers(1024, 6145, 7)])
    out.append((f"long1-B8-seed{seed}", "workqueue", i32(long1)))
    return out


def split_candidates(bounds: SplitBounds, quick: bool) -> tuple[int, ...]:
    """The counts to time: every allowed count, or every fourth (plus the last) with --quick.
    Bounds 4..64 by 4 -> quick: 4, 20, 36, 52, 64."""
    c = bounds.candidates()
    return tuple(dict.fromkeys(c[::4] + c[-1:])) if quick else c


def fit_c_min(records, cal: calib.Calibration, grid=C_GRID) -> float:
    """The C_min of the cost model that best reproduces the timed configurations.

    records : mappings with ``kv_bytes``, ``ctas``, ``launches``, ``merge_bytes``, ``us``.
    cal : supplies beta, lambda_graph_us and sm_count (``c_min`` is what is fitted).

    Minimises ``sum (log T_model(C_min) - log T_measured)^2`` over ``grid``; where several values
    fit equally well (every point already above the knee) the largest is taken: the data only
    says C_min is at most that. Example (beta 4120 GB/s, lambda 1.1 µs, 132 SMs): B1 32K, one
    row of 134 MB = 32.6 µs of read, timed at S = 4, 8, 16, 32 (0.24, 0.48, 0.97, 1.94 CTAs/SM)
    as 272, 137, 70, 37 µs -> the model with C_min 2 gives 271.0, 136.6, 69.5, 36.1 µs: C_min ~2.
    """
    recs = list(records)
    if not recs:
        raise ValueError("fit_c_min: no timed configurations")
    logs = np.log([r["us"] for r in recs])
    best, best_loss = None, math.inf
    for c in grid:
        trial = attrs.evolve(cal, c_min=c)
        pred = [route_time_us(kv_bytes=r["kv_bytes"], cta_work_per_sm=r["ctas"] / cal.sm_count,
                              launches=r["launches"], merge_bytes=r["merge_bytes"], cal=trial,
                              graphs=True) for r in recs]
        loss = float(np.sum((np.log(pred) - logs) ** 2))
        if loss <= best_loss * (1 + 1e-9) + 1e-12:
            best, best_loss = c, min(loss, best_loss)
    return best


def fit_flashinfer_ctas(times_us: dict[int, float], *, context: int, cal: calib.Calibration,
                        kv_bytes_per_token: int) -> dict[int, float]:
    """FlashInfer's fitted CTA work per SM per active count (calibration/README.md):
    ``C = C_min * (KVBytes / beta) / (T - lambda_graph)``.

    Example (README's H200 anchor): B8 32K, 1_073_741_824 B at 4120 GB/s = 260.6 µs, T = 290 µs,
    lambda 1.1, C_min 4 -> 4 * 260.6 / 288.9 = 3.61.
    """
    out = {}
    for active, t in sorted(times_us.items()):
        read = active * context * kv_bytes_per_token / (cal.beta_gbps * 1e3)
        if not t > cal.lambda_graph_us:
            raise ValueError(f"fit_flashinfer_ctas: active {active}: time {t} us is not above the "
                             f"launch overhead {cal.lambda_graph_us} us")
        out[active] = cal.c_min * read / (t - cal.lambda_graph_us)
    return out


def rounded_by_group(by_group: dict) -> tuple:
    """{G: fit_partition points} as a file's ``splits.by_group``: ((G, ((key, value), ...)), ...),
    sorted by G, each value rounded as the files hold it."""
    rounded = {"workqueue_ctas_per_sm": lambda v: round(float(v), 3), "min_split_tokens": int,
               "cta_overhead_tiles": lambda v: round(float(v), 3),
               "co_resident_slowdown": lambda v: round(float(v), 3), "wave_room_slots": int,
               "wave_room_tiles": lambda v: round(float(v), 3), "wave_room_chunk_tiles": int}
    return tuple(sorted((int(g), tuple((k, rounded[k](pts[k])) for k in rounded if k in pts))
                        for g, pts in by_group.items()))


def make_calibration(*, gpu: str, sm_count: int, l2_bytes: int, beta_gbps: float, lambda_us: float,
                     lambda_graph_us: float, c_min: float, splits: dict, flashinfer: dict,
                     versions: dict, command: str, provenance: str, by_group: dict | None = None,
                     date: str | None = None) -> calib.Calibration:
    """A schema-1 :class:`~pkvrt.policy.calibration.Calibration` (rounded; validated by a round trip).
    ``by_group``: {G: fit_partition points} for ``splits.by_group``."""
    groups = rounded_by_group(by_group or {})
    cal = calib.Calibration(
        gpu=gpu, slug=calib.slugify(gpu), sm_count=int(sm_count), l2_bytes=int(l2_bytes),
        beta_gbps=round(beta_gbps, 1), lambda_us=round(lambda_us, 3),
        lambda_graph_us=round(lambda_graph_us, 3), c_min=round(c_min, 3),
        splits=calib.SplitPoints(bucket_ctas_per_sm=round(splits["bucket_ctas_per_sm"], 3),
                                 workqueue_ctas_per_sm=round(splits["workqueue_ctas_per_sm"], 3),
                                 min_split_tokens=int(splits["min_split_tokens"]),
                                 cta_overhead_tiles=round(float(splits["cta_overhead_tiles"]), 3),
                                 co_resident_slowdown=round(float(splits["co_resident_slowdown"]), 3),
                                 max_waves=int(splits.get("max_waves", calib.DEFAULT_MAX_WAVES)),
                                 merge_free_slots=int(splits.get("merge_free_slots", 0)),
                                 wave_room_slots=int(splits.get("wave_room_slots", 0)),
                                 wave_room_tiles=round(float(splits.get("wave_room_tiles", 0.0)), 3),
                                 wave_room_chunk_tiles=int(splits.get("wave_room_chunk_tiles", 0)),
                                 by_group=groups),
        flashinfer_ctas_per_sm=tuple((int(a), round(c, 3)) for a, c in sorted(flashinfer.items())),
        versions=tuple((k, versions.get(k)) for k in ("torch", "cuda", "flashinfer", "driver")),
        date=date or datetime.date.today().isoformat(), seed=SEED, command=command,
        provenance=provenance)
    return calib.calibration_from_dict(calib.calibration_to_dict(cal))


def format_rows(header, rows) -> str:
    widths = [max(len(str(r[i])) for r in [header, *rows]) for i in range(len(header))]
    return "\n".join("  ".join(str(c).ljust(w) for c, w in zip(r, widths)).rstrip()
                     for r in [header, *rows])


# --------------------------------------------------------------------------- GPU measurements

def _workload(seq_lens, l2_bytes: int, shape: dict = SHAPE, kv_dtype: str = "float16"):
    """K/V copies, q, seq_lens and block tables of one calibration step (hole fraction 0).
    ``kv_dtype`` "float8_e4m3fn": the caches quantized by ``harness.quantize_fp8(.., "unit")``
    (a cast, scale 1), their scales float32 [1] device tensors (``wl.scales(0)``); the fp16
    source is freed (outputs are checked against the reference over the dequantized caches)."""
    from pkvrt.measure import harness

    reqs = tuple(Request(i, 0, int(n) - 1, 1) for i, n in enumerate(seq_lens))
    trace = Trace(name="calibration", requests=reqs, seed=SEED, source="pkvrt calibrate")
    config = harness.ServingConfig(trace="calibration", max_active=len(reqs), seeds=(SEED,),
                                   engines=(harness.BASELINE,), steps_limit=1,
                                   shape=harness.Shape(**shape),
                                   kv_dtype="fp16" if kv_dtype in calib.TOP_KV_DTYPES else "fp8",
                                   fp8_scales="unit")
    wl = harness.Workload(trace, config, SEED, l2_bytes=l2_bytes)
    wl.drop_source()
    return wl


def _device_tables(wl):
    import torch

    step = wl.steps[0]
    bt = torch.from_numpy(wl.layout.block_table(step.rids)).cuda()
    seq = torch.from_numpy(step.seq_lens.astype(np.int32)).cuda()
    return step, bt, seq


def _checked(name: str, out, ref) -> None:
    from pkvrt.measure import harness

    max_e, mean_e = harness.errors(out, ref)
    if not harness.within_tolerance(max_e, mean_e):
        raise RuntimeError(f"{name}: wrong output (max|e| {max_e:.3g}, mean|e| {mean_e:.3g} vs the "
                           "FP32 reference); the kernels are broken on this GPU, nothing written")


def time_bucket(wl, splits: int, ref, repeats: int) -> float:
    """split_decode (+ merge when S > 1) over every row of ``wl``'s step, µs per call."""
    import torch

    from pkvrt.launch import ops
    from pkvrt.measure import harness

    step, bt, seq = _device_tables(wl)
    b, hq, d = len(step.rids), wl.shape.num_qo_heads, wl.shape.head_dim
    q, out = wl.q[:b], torch.full((b, hq, d), float("nan"), dtype=wl.q.dtype, device="cuda")
    row_ids = torch.arange(b, dtype=torch.int32, device="cuda")
    part_a = torch.empty((b * splits, hq, d), device="cuda")
    part_ml = torch.empty((b * splits, hq, 2), device="cuda")
    offsets = torch.arange(b + 1, dtype=torch.int32, device="cuda") * splits

    def fn():
        for k, v in zip(wl.k, wl.v):
            ops.split_decode(q, k, v, seq, bt, row_ids, splits, out, part_a, part_ml, **wl.scales(0))
            if splits > 1:
                ops.merge(part_a, part_ml, offsets, out, row_ids=row_ids)
    us = harness.median_us(fn, wl.copies, repeats)
    _checked(f"bucket S={splits}", out, ref)
    return us


LAYERS = 8   # back-to-back calls per timed graph of the workqueue-kind routes


def time_workqueue(wl, plan, ref, repeats: int, fused: bool = False, grid: int | None = None,
                   early_kv: bool = True) -> float:
    """workqueue_decode + merge of ``plan`` (a WorkqueuePlan of ``wl``'s step), or with ``fused``
    the fused decode (merge in the tail, one launch), µs per call.

    grid: the decode grid (task slots), at least the plan's tasks; the slots past them exit at
    once. None: exactly the plan's tasks. early_kv False: no layer starts its K/V copies before
    the previous one ends (an ablation).

    Timed as a step's layers run (the Runtime's device planning): at least ``LAYERS`` calls back
    to back in one graph over the rotating K/V copies, with programmatic dependent launch and
    early K/V copies from the second call on. One call alone, as first done, mis-ranks cuts:
    at B1 64K the 32-layer engine protocol measured 32 splits 21 % faster than 16, which a
    single-call graph timed as equal (benches/NOTES.md, "Which calibration setting ranks cuts as
    the engine does")."""
    import torch

    from pkvrt.launch import ops
    from pkvrt.measure import harness

    step, bt, seq = _device_tables(wl)
    b, hq, d = len(step.rids), wl.shape.num_qo_heads, wl.shape.head_dim
    q, out = wl.q[:b], torch.full((b, hq, d), float("nan"), dtype=wl.q.dtype, device="cuda")
    tasks, num, offsets, part_a, part_ml = ops.workqueue_tensors(plan, num_qo_heads=hq, head_dim=d)
    tasks = padded_tasks(tasks, grid)
    counters = (torch.zeros((b, wl.shape.num_kv_heads), dtype=torch.int32, device="cuda")
                if fused else None)
    # as the Runtime launches it: the two-level tail where the kernel's rule says
    two = (dict(group_counters=torch.zeros((part_a.shape[0], wl.shape.num_kv_heads), dtype=torch.int32,
                                           device="cuda")) if fused else {})

    calls = max(LAYERS, wl.copies)

    def fn():
        for i in range(calls):
            k, v = wl.k[i % wl.copies], wl.v[i % wl.copies]
            ops.workqueue_decode(q, k, v, seq, bt, tasks, num, offsets, out, part_a, part_ml,
                                 counters=counters, early_kv=early_kv and i > 0, **two, **wl.scales(0))
            if not fused:
                ops.merge(part_a, part_ml, offsets, out, skip_single=True)
    us = harness.median_us(fn, calls, repeats)
    _checked(f"{'fused' if fused else 'workqueue'} S={int(plan.num_splits.max())}", out, ref)
    return us


def time_flashinfer(wl, tensor_cores: bool, ref, repeats: int) -> float:
    """FlashInfer decode over ``wl``'s step, planned once, graph-replayed, µs per call."""
    import flashinfer
    import torch

    from pkvrt.measure import harness
    from pkvrt.policy.blocktables import to_csr
    from pkvrt.runtime import fi_route

    sh = wl.shape
    step = wl.steps[0]
    indptr, indices, last = (torch.from_numpy(a) for a in
                             to_csr(step.seq_lens, wl.layout.block_table(step.rids), sh.page_size))
    ws = torch.zeros(harness.FI_WORKSPACE_BYTES, dtype=torch.uint8, device="cuda")
    w = flashinfer.BatchDecodeWithPagedKVCacheWrapper(ws, "HND", use_tensor_cores=tensor_cores,
                                                   backend=fi_route.BACKEND)   # the route's kernel
    w.plan(indptr, indices, last, sh.num_qo_heads, sh.num_kv_heads, sh.head_dim, sh.page_size,
           q_data_type=sh.torch_dtype, kv_data_type=sh.torch_dtype)
    b = len(step.rids)
    q, out = wl.q[:b], torch.full((b, sh.num_qo_heads, sh.head_dim), float("nan"),
                                  dtype=wl.q.dtype, device="cuda")

    def fn():
        for k, v in zip(wl.k, wl.v):
            w.run(q, (k, v), out=out)
    us = harness.median_us(fn, wl.copies, repeats)
    _checked(f"flashinfer{'-tc' if tensor_cores else '-cuda'} B{b}", out, ref)
    return us


def padded_tasks(tasks, grid: int | None):
    """``tasks`` [T, 5] (``ops.workqueue_tensors``) grown with zero rows to ``grid`` slots (the
    decode launches one CTA per row; ``num_tasks`` stays T, so the added ones exit at once);
    unchanged when ``grid`` is None or not larger."""
    import torch

    if grid is None or grid <= tasks.shape[0]:
        return tasks
    return torch.cat([tasks, tasks.new_zeros((grid - tasks.shape[0], 5))])


def runtime_grid(rows: int, *, num_kv_heads: int, splits, base: calib.Calibration, resident: int,
                 max_waves: int) -> int:
    """The decode grid the Runtime launches for a device-planned step of ``rows`` rows: the most
    CTAs the partition may plan for the padded batch (``planner.device_grid_ctas`` with
    ``resident`` CTAs per SM and ``max_waves``), the slots past a step's tasks exiting at once.
    The sweeps time every cut in that grid: timed in a grid of exactly its CTAs, a cut of less
    than one wave ran up to 35 % faster than the Runtime runs it (G = 8, an eight-row step cut at
    12: 128 CTAs, 46.8 vs 61.1 us per layer; 124 CTAs: 48.7 vs 65.6; ``benches/cut_protocols.py``),
    and the fit chose such cuts (benches/NOTES.md, "The fix: calibrate in the Runtime's grid",
    208e68a)."""
    from pkvrt.policy import planner
    from pkvrt.runtime.graphs import padded_batch

    cal = attrs.evolve(base, splits=calib.SplitPoints(1.0, float(resident), TILE_TOKENS, max_waves=max_waves))
    return planner.device_grid_ctas(padded_batch(rows), num_kv_heads=num_kv_heads, splits=splits, cal=cal)


def time_partition(case: str, seq, group: int, route, base: calib.Calibration, wl, ref,
                   repeats: int, quick: bool, grid: int | None = None) -> list[dict]:
    """Time ``route`` (a workqueue or fused route) over one step at every cut of the balanced
    partition (the longest row's allowed split counts whose chunk is at least one tile; every
    third with ``quick``), at ``group`` query heads per KV head. ``wl``, ``ref``: the step's
    workload at that shape (``_workload(seq, l2, group_shape(group))``) and its FP32 reference,
    shared with the other engines timed on the step (its K/V dtype is the sweep's). One record
    per cut: case, route, group, rows, context, splits, us, kv_bytes, ctas, launches, merge_bytes.
    ``grid``: the decode grid every cut is launched with (:func:`runtime_grid`; None: each cut's
    own CTAs)."""
    from pkvrt.policy import planner

    shape = group_shape(group, wl.shape.head_dim)
    hq, hkv, d = shape["num_qo_heads"], shape["num_kv_heads"], shape["head_dim"]
    cands = planner.partition_candidates(int(-(-seq.max() // TILE_TOKENS)), route.splits, 1).tolist()
    cands = cands[::3] + cands[-1:] if quick else cands
    fused = route.kind == "fused"
    out = []
    for s in dict.fromkeys(cands):
        plan = planner.plan_workqueue(seq, num_kv_heads=hkv, num_qo_heads=hq, head_dim=d,
                                      dtype_bytes=wl.kv_dtype_bytes, splits=route.splits, cal=base,
                                      longest_splits=s)
        us = time_workqueue(wl, plan, ref, repeats, fused=fused, grid=grid)
        out.append(dict(case=case, route=route.kind, group=group, rows=len(seq),
                        context=int(seq.max()), splits=int(s), us=float(us),
                        kv_bytes=int(seq.sum()) * 2 * hkv * d * wl.kv_dtype_bytes, ctas=plan.counters.decode_ctas,
                        launches=1 if fused else 2, merge_bytes=plan.counters.merge_bytes))
    return out


def _reference(wl):
    from pkvrt import reference

    step, bt, seq = _device_tables(wl)
    return reference.decode_attention(wl.q[:len(step.rids)], wl.k[0], wl.v[0], seq, bt, **wl.scales(0))


def measure_launch(repeats: int) -> dict[str, float]:
    """Eager and in-graph per-launch µs of a 1-token pkvrt split decode and of torch's 1-element add."""
    import torch

    from pkvrt.launch import ops
    from pkvrt.measure import harness

    sh = SHAPE
    k = torch.randn((1, sh["num_kv_heads"], sh["page_size"], sh["head_dim"]), device="cuda",
                    dtype=torch.float16)
    q = torch.randn((1, sh["num_qo_heads"], sh["head_dim"]), device="cuda", dtype=torch.float16)
    out = torch.empty_like(q)
    bt = torch.zeros((1, 1), dtype=torch.int32, device="cuda")
    seq = torch.ones(1, dtype=torch.int32, device="cuda")
    rows = torch.zeros(1, dtype=torch.int32, device="cuda")
    x = torch.zeros(1, device="cuda")
    kernels = {"pkvrt": lambda: ops.split_decode(q, k, k, seq, bt, rows, 1, out),
               "torch": lambda: x.add_(1.0)}
    res = {}
    for name, launch in kernels.items():
        n, per = 100, []
        for _ in range(repeats + 2):            # two warm-up loops
            torch.cuda.synchronize()
            t0 = time.perf_counter()
            for _ in range(n):
                launch()
            torch.cuda.synchronize()
            per.append((time.perf_counter() - t0) * 1e6 / n)
        res[f"{name}_eager"] = float(np.median(per[2:]))

        def graph_body(launch=launch):
            for _ in range(200):
                launch()
        res[f"{name}_graph"] = harness.median_us(graph_body, 200, repeats)
    return res


def decode_occupancy(family: str = "workqueue_decode", group: int = 4, kv_dtype: str = "float16",
                     head_dim: int = SHAPE["head_dim"]) -> int:
    """Resident CTAs per SM of a workqueue-kind decode kernel (``workqueue_decode`` or
    ``fused_decode``) at the seed shape with ``group`` query heads per KV head and ``kv_dtype``
    K/V (its ``_e4m3`` variant for float8_e4m3fn) (the driver's occupancy query with its block
    size and dynamic shared memory): the partition's waves."""
    import torch

    from pkvrt.launch import ops

    return ops.decode_occupancy(family, torch.float16, head_dim, group, getattr(torch, kv_dtype))


def measure_torch_read(gib: int, repeats: int) -> float:
    """GB/s of ``sum(x, dim=1, dtype=float32)`` over ``gib`` GiB of fp16 (reads each byte once)."""
    import torch

    from pkvrt.measure import harness

    x = torch.randn((gib * 2**16, 2**13), device="cuda", dtype=torch.float16)   # gib GiB
    out = torch.empty(x.shape[0], device="cuda", dtype=torch.float32)
    us = harness.median_us(lambda: torch.sum(x, dim=1, dtype=torch.float32, out=out), 1, repeats)
    nbytes = x.numel() * x.element_size()
    del x
    return nbytes / (us * 1e3)


# --------------------------------------------------------------------------- the command

# --kv-dtype spellings -> routes.toml names (bfloat16 caches use the fp16 constants: same bytes)
KV_DTYPE_ARGS = {"fp16": "float16", "float16": "float16", "fp8": "float8_e4m3fn", "float8_e4m3fn": "float8_e4m3fn"}


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """Arguments of ``pkvrt calibrate``."""
    parser.add_argument("--out", metavar="PATH",
                        help="calibration file to write (default: calibration/<gpu slug>.json)")
    parser.add_argument("--quick", action="store_true",
                        help="fewer split candidates, active counts and repeats (seconds; for tests)")
    parser.add_argument("--routes", metavar="PATH",
                        help="routes.toml whose split bounds give the candidates (default: the shipped one)")
    parser.add_argument("--raw", metavar="PATH",
                        help="also write every timed configuration as a results JSON (pkvrt report)")
    parser.add_argument("--groups", type=parse_groups, default=GROUPS, metavar="LIST",
                        help="group sizes 1-64 (query heads per KV head: H_q 32 over 32 / G KV heads, "
                             "or 8 KV heads where G does not divide 32) whose partition constants are "
                             "fitted; must include 4, which gives the top-level keys, the others go to "
                             "splits.by_group (default: 4,1,8; the models' table: 4,1,8,2,3,5,7,16)")
    parser.add_argument("--add-groups", type=parse_added_groups, default=None, metavar="LIST",
                        help="measure only these group sizes (not 4) and add or replace their "
                             "splits.by_group and time_model.by_group entries in --base (this GPU's "
                             "file), every other constant, section and host_time kept: a new model's "
                             "G without re-fitting the ones the file has (e.g. 2,3,5,7,16; 64: the "
                             "wide decode body's constants, for models of G 17-64)")
    parser.add_argument("--models", type=parse_models, default=(), metavar="NAMES",
                        help="comma-separated model names of the served models' table (e.g. "
                             "llama-3.2-3b,qwen2.5-14b): their group sizes join --groups (their head "
                             "dims other than 128 run on the D 128 constants with their own kernel's "
                             f"waves); known: {', '.join(MODELS)}")
    parser.add_argument("--head-dim", type=int, choices=calib.SECTION_HEAD_DIMS, metavar="D",
                        help="measure the partition's constants at head dim D (one of "
                             f"{', '.join(map(str, calib.SECTION_HEAD_DIMS))}; the file's are D "
                             f"{calib.CALIBRATION_HEAD_DIM}'s) and write them as the by_head_dim.D "
                             "section of --base (this GPU's file, written by a run without it first)")
    parser.add_argument("--suggest-routes", metavar="PATH",
                        help="also write the gates the calibration steps measured (group sizes, "
                             "minimum context and active rows where each route beat FlashInfer) as a "
                             "routes.toml snippet to PATH; it is printed either way and never applied")
    parser.add_argument("--max-waves", type=positive_int, metavar="N",
                        help="splits.max_waves, the resident waves of CTAs the balanced partition may "
                             "plan; not fitted (the calibration steps are G = 4, where it rarely binds). "
                             "Default: the value of the calibration file being replaced, else "
                             f"{calib.DEFAULT_MAX_WAVES} (fp8: the --base file's, which the FP8 section "
                             "then leaves to it; given, it is written to the section)")
    parser.add_argument("--kv-dtype", choices=tuple(KV_DTYPE_ARGS), default="fp16",
                        help="K/V cache dtype to measure with. fp16 (default): the whole file. fp8 "
                             "(float8_e4m3fn): pkvrt's routes with FP8 caches (no FlashInfer), fitted "
                             "into the by_kv_dtype.float8_e4m3fn section of --base, which is written "
                             "to --out with every other constant kept")
    parser.add_argument("--base", metavar="PATH",
                        help="with --kv-dtype fp8, --head-dim or --host-time: this GPU's calibration file "
                             "the FP8, head-dim or host_time section is added to or replaced in (default: "
                             "the --out file)")
    parser.add_argument("--host-time", action="store_true",
                        help="measure only this machine's host time per route kind (the host_time "
                             "section the router weighs where routes.toml's [host_time] is enabled; "
                             "a full fp16 run measures it too) and write it into --base, every other "
                             "constant kept")


def parse_added_groups(text: str) -> tuple[int, ...]:
    """``--add-groups`` as distinct group sizes other than 4 (ValueError naming the option): 4's
    constants are the file's top level, which only a whole fp16 run measures."""
    groups = _group_list(text, "--add-groups")
    if 4 in groups:
        raise ValueError(f"--add-groups: not 4 (the file's top-level constants: a whole fp16 run "
                         f"measures them), got {text!r}")
    return groups


def parse_models(text: str) -> tuple:
    """``--models`` as ModelShapes of ``pkvrt.measure.model_shapes.MODELS`` (ValueError naming an
    unknown name and the known ones)."""
    names = [n.strip() for n in text.split(",") if n.strip()]
    if not names:
        raise ValueError("--models: expected comma-separated model names, e.g. llama-3.2-3b")
    for n in names:
        if n not in MODELS:
            raise ValueError(f"--models: unknown model {n!r}; expected one of {', '.join(MODELS)}")
    return tuple(MODELS[n] for n in dict.fromkeys(names))


def with_model_groups(args) -> tuple[int, ...]:
    """``--groups`` followed by the group sizes of ``--models`` it lacks. With ``--head-dim D``
    every model must have that head dim (ValueError naming the others: a section is one head
    dim's); without it, says which models' head dims the run does not time (they run on the D
    128 constants, with their kernel's own waves: Runtime.residency)."""
    head_dim = getattr(args, "head_dim", None)
    if head_dim is not None:
        other = [f"{m.name} (D {m.head_dim})" for m in args.models if m.head_dim != head_dim]
        if other:
            raise ValueError(f"--models: {', '.join(other)}: not of --head-dim {head_dim}; calibrate "
                             "each head dim's models in its own run")
    groups = tuple(dict.fromkeys((*args.groups, *(m.group for m in args.models))))
    other = [f"{m.name} (D {m.head_dim})" for m in args.models if m.head_dim != calib.CALIBRATION_HEAD_DIM]
    if other and head_dim is None:
        print(f"pkvrt calibrate: --models: timed at D {calib.CALIBRATION_HEAD_DIM}; "
              f"{', '.join(other)} run on those constants with their own kernel's resident CTAs "
              f"per SM (--head-dim D times theirs)", file=sys.stderr)
    return groups


def check_arguments(args) -> str:
    """The routes.toml name of ``--kv-dtype``, after refusing combinations that do not apply to
    it (ValueError naming the option): ``--base`` without FP8, ``--suggest-routes`` with FP8.
    ``--models`` adds their group sizes to ``args.groups``."""
    kv = KV_DTYPE_ARGS[args.kv_dtype]
    if getattr(args, "add_groups", None) is not None:
        for flag, given in (("--kv-dtype fp8", kv not in calib.TOP_KV_DTYPES),
                            ("--head-dim", getattr(args, "head_dim", None) is not None),
                            ("--host-time", getattr(args, "host_time", False)),
                            ("--models", bool(getattr(args, "models", ()))),
                            ("--suggest-routes", bool(args.suggest_routes)),
                            ("--max-waves", args.max_waves is not None)):
            if given:
                raise ValueError(f"--add-groups: not with {flag} (it adds group sizes to this GPU's "
                                 f"fp16 file, in the file's own grid)")
        if args.groups != GROUPS:
            raise ValueError("--add-groups: not with --groups (--groups names what a whole run "
                             "measures; --add-groups what is added to --base)")
        return kv
    if getattr(args, "models", ()):
        args.groups = with_model_groups(args)
    if getattr(args, "head_dim", None) is not None:
        if kv not in calib.TOP_KV_DTYPES:
            raise ValueError("--head-dim: not with --kv-dtype fp8 (a head-dim section is measured with "
                             "fp16 caches; the FP8 section, at D 128, lies over it)")
        if getattr(args, "host_time", False):
            raise ValueError("--head-dim: not with --host-time (host time does not depend on it)")
        if args.suggest_routes:
            raise ValueError("--suggest-routes: not with --head-dim (a head-dim run times no "
                             "FlashInfer path to judge gates against)")
        return kv
    if getattr(args, "host_time", False):
        if kv not in calib.TOP_KV_DTYPES:
            raise ValueError("--host-time: not with --kv-dtype fp8 (host_time is measured in the mode "
                             "FlashInfer runs in, fp16 caches; an FP8 Runtime does not weigh it)")
        if args.suggest_routes:
            raise ValueError("--suggest-routes: not with --host-time (it times no route's device time)")
        return kv
    if kv in calib.TOP_KV_DTYPES and args.base:
        raise ValueError("--base: only with --kv-dtype fp8, --head-dim, --host-time or --add-groups "
                         "(an fp16 run measures and writes a whole file)")
    if kv not in calib.TOP_KV_DTYPES and args.suggest_routes:
        raise ValueError("--suggest-routes: not with --kv-dtype fp8 (gates are judged against FlashInfer's "
                         "times, which an FP8 run does not measure: an FP8 Runtime does not run FlashInfer)")
    return kv


def out_path(args, slug: str) -> Path:
    """``--out``, else ``calibration/<slug>.json`` (the checkout's, else the installed copy's)."""
    return Path(args.out) if args.out else calib.calibration_dirs()[-1] / f"{slug}.json"


def load_base(path: Path, device_name: str, section: str = "FP8") -> calib.Calibration:
    """The file an FP8 (or host-time) run adds its section to: it must exist and be this GPU's
    (its slug is ``slugify(device_name)``): the section's time model is fitted against its
    beta, and its constants are laid over the file's on the GPU that measured them. ValueError
    otherwise (a malformed file: CalibrationError)."""
    if not path.is_file():
        raise ValueError(f"{path}: no calibration file to add the {section} section to; run `pkvrt calibrate` "
                         "(fp16) on this GPU first, or name this GPU's file with --base PATH")
    base = calib.load_calibration(path)
    want = calib.slugify(device_name)
    if base.slug != want:
        raise ValueError(f"{path}: the calibration of {base.gpu!r} (slug {base.slug!r}), not of this GPU "
                         f"{device_name!r} ({want!r}); an {section} section extends its own GPU's file")
    return base


def run(args: argparse.Namespace) -> int:
    """``pkvrt calibrate``: measure, fit, print, write; 2 without a GPU, 1 on a wrong result."""
    import torch

    kv_dtype = check_arguments(args)
    fp8 = kv_dtype not in calib.TOP_KV_DTYPES
    if not torch.cuda.is_available():
        print("pkvrt calibrate: no CUDA GPU here. Calibration measures the GPU it runs on "
              "(bandwidth, launch overhead, split sweeps, FlashInfer times); run it on the GPU "
              "to calibrate. Nothing was written.", file=sys.stderr)
        return 2
    from pkvrt.launch import _driver

    why = _driver.available()
    env = results.environment()
    if why:
        print(f"pkvrt calibrate: cannot measure here: {why}", file=sys.stderr)
        return 2
    if not fp8 and getattr(args, "head_dim", None) is None and \
            str(env.get("flashinfer", "")).startswith("unavailable"):
        print(f"pkvrt calibrate: FlashInfer is {env['flashinfer']}. Calibration needs it: it times "
              "FlashInfer's decode to fit flashinfer.ctas_per_sm, the cost model the router uses "
              "to predict the FlashInfer baseline before promoting a PersistentKV route. Install "
              "it (pip install -e \".[flashinfer]\", flashinfer-python 0.5.3 to 0.7.x) and run again; "
              "`pkvrt doctor` says why it does not import. Nothing was measured or written.",
              file=sys.stderr)
        return 2
    device = torch.cuda.get_device_name(0)
    out = out_path(args, calib.slugify(device))
    if getattr(args, "host_time", False):
        return run_host_time(args, out, device)
    try:
        if getattr(args, "add_groups", None) is not None:
            cal, raw, meta = measure_added_groups(
                args, load_base(Path(args.base) if args.base else out, device, "group-size"), args.add_groups)
        elif getattr(args, "head_dim", None) is not None:
            cal, raw, meta = measure_head_dim(
                args, load_base(Path(args.base) if args.base else out, device, f"head-dim {args.head_dim}"),
                args.head_dim)
        elif fp8:
            cal, raw, meta = measure_kv_dtype(args, load_base(Path(args.base) if args.base else out, device),
                                              kv_dtype)
        else:
            dropped = replaced_sections(out)
            cal, raw, meta = measure(args, env)
            from pkvrt.tools.calibrate_host import host_table, measure_host_time

            ht, _ = measure_host_time(load_routes(args.routes), cal, rounds=1 if args.quick else 3,
                                      command=_command())
            cal = attrs.evolve(cal, host_time=ht)
            print("host_time (this machine's host, per step: plan_us + layers x run_us)\n" + host_table(ht) + "\n")
            if dropped:
                print(f"pkvrt calibrate: the {', '.join(dropped)} section(s) of {out} are not kept (an "
                      f"FP8 time model is fitted against that file's beta, and a section belongs to the "
                      f"kernels it timed): run pkvrt calibrate --kv-dtype fp8 / --head-dim D again",
                      file=sys.stderr)
    except RuntimeError as e:
        print(f"pkvrt calibrate: {e}", file=sys.stderr)
        return 1
    out.parent.mkdir(parents=True, exist_ok=True)
    calib.save_calibration(cal, out)
    if args.raw:
        meta = results.make_meta(seeds=[SEED], routes_path=args.routes or None, calibration_path=out,
                                 kind="calibration-sweeps", **meta)
        results.write_results(args.raw, meta, raw)
        print(f"wrote {args.raw}")
    section = (f"by_head_dim.{args.head_dim}" if getattr(args, "head_dim", None) is not None
               else f"by_kv_dtype.{kv_dtype}" if fp8
               else f"G {', '.join(map(str, args.add_groups))} entries of splits.by_group and "
                    f"time_model.by_group" if getattr(args, "add_groups", None) is not None else None)
    print(f"wrote {out}" + (f" (its {section} section; every other constant as in "
                            f"{args.base or 'the file before'})" if section else ""))
    if cal.time_model and getattr(args, "head_dim", None) is None \
            and getattr(args, "add_groups", None) is None:   # a head-dim run fits no time model
        errors, gates = report(raw, cal, load_routes(args.routes), header=f"{cal.gpu}, {cal.date}, seed {SEED}",
                               kv_dtype=kv_dtype)
        print("\nmeasured vs predicted at the cut each planner picks (time_model; roofline: c_min and "
              "flashinfer.ctas_per_sm)\n" + errors + ("\n\n" + gates if gates else ""))
        if args.suggest_routes:
            Path(args.suggest_routes).write_text(gates, encoding="utf-8")
            print(f"wrote {args.suggest_routes} (suggested gates; routes.toml is unchanged)")
    return 0


def run_host_time(args, out: Path, device: str) -> int:
    """``pkvrt calibrate --host-time``: measure the host_time section and write it into
    ``--base`` (default ``out``) as ``out``, every other constant kept."""
    from pkvrt.tools.calibrate_host import host_table, measure_host_time

    base = load_base(Path(args.base) if args.base else out, device, section="host_time")
    reg = load_routes(args.routes)
    try:
        ht, rows = measure_host_time(reg, base, rounds=1 if args.quick else 3, command=_command())
    except RuntimeError as e:
        print(f"pkvrt calibrate: {e}", file=sys.stderr)
        return 1
    out.parent.mkdir(parents=True, exist_ok=True)
    calib.save_calibration(attrs.evolve(base, host_time=ht), out)
    if args.raw:
        meta = results.make_meta(seeds=[SEED], routes_path=args.routes or None, calibration_path=out,
                                 kind="host-time")
        results.write_results(args.raw, meta, rows)
        print(f"wrote {args.raw}")
    print("host_time (this machine's host, per step: plan_us + layers x run_us)\n" + host_table(ht))
    print(f"wrote {out} (its host_time section; every other constant as in {args.base or 'the file before'})")
    return 0


def replaced_sections(out: Path) -> list[str]:
    """The ``by_kv_dtype`` and ``by_head_dim`` sections of the file a 16-bit run replaces (it
    writes none)."""
    try:
        if not out.is_file():
            return []
        cal = calib.load_calibration(out)
        return [f"by_kv_dtype.{n}" for n, _ in cal.by_kv_dtype] + [f"by_head_dim.{d}" for d, _ in cal.by_head_dim]
    except calib.CalibrationError:
        return []


def kept_merge_free_slots(args, slug: str) -> int:
    """splits.merge_free_slots of the calibration file this run replaces (set by hand, like max_waves:
    the partition's timed cuts cannot measure it, benches/NOTES.md "The one-row 8K step: a cut
    that fills every resident slot"), else 0."""
    out = out_path(args, slug)
    if out.is_file():
        try:
            return calib.load_calibration(out).splits.merge_free_slots
        except calib.CalibrationError:
            pass
    return 0


def kept_max_waves(args, slug: str) -> int:
    """``--max-waves``, else the value in the calibration file this run replaces (it is set by
    hand: re-calibrating must not reset it silently), else the default."""
    if getattr(args, "max_waves", None):
        return args.max_waves
    out = out_path(args, slug)
    if out.is_file():
        try:
            return calib.load_calibration(out).splits.max_waves
        except calib.CalibrationError:
            pass   # a broken file is replaced; its value is not worth keeping
    return calib.DEFAULT_MAX_WAVES


def time_steps(args, reg, base: calib.Calibration, *, kv_dtype: str, repeats: int,
               t_start: float, max_waves: int, head_dim: int = SHAPE["head_dim"],
               flashinfer: bool | None = None, buckets: bool = True) -> tuple[list[dict], list[dict], dict[int, dict]]:
    """Every calibration step timed with ``kv_dtype`` caches: the bucket route at each candidate
    S (G 4), the workqueue-or-fused routes of routes.toml at every cut (the device-planning
    route first; in the grid the Runtime launches, :func:`runtime_grid`, with the device-planning
    kernel's occupancy at that G and ``max_waves``) at each G of ``--groups``, and beside them
    FlashInfer's two paths (16-bit
    caches only: an FP8 Runtime does not run FlashInfer). ``base``: the calibration the timed
    cuts are planned with (SMs; partition constants that leave every cut allowed).

    Returns (fit records: the bucket sweeps and the device-planning route at G 4; the raw rows of
    ``--raw``, each with its ``kv_dtype``; {G: {"case [kind]": (seq_lens, {cut: us}, the route's
    split bounds)}} of both partition routes, for ``fit_partition``: the names and tuples of
    ``sweeps.partition_cases``). ``head_dim``: the shape's (a ``--head-dim`` run); ``flashinfer``
    False: FlashInfer not timed (default: with 16-bit caches); ``buckets`` False: the bucket
    route's steps are skipped (an ``--add-groups`` run: the bucket route is G 4's).
    """
    import torch

    from pkvrt.policy import planner

    quick, sm, l2 = args.quick, base.sm_count, base.l2_bytes
    bucket_bounds = next(r.splits for r in reg.routes if r.kind == "bucket")
    # the partition is fitted on the main device-planning route (G >= large_group runs
    # large_group_route on the same constants: the two kinds share them)
    dp_route = reg.device_planning_route()
    # every workqueue-or-fused kind is timed at every cut (its time model); dp_route first
    partition_routes = [dp_route] + [r for k in ("workqueue", "fused") if k != dp_route.kind
                                     for r in [sweeps.route_of_kind(reg, k)] if r is not None]
    hkv, hq, d = SHAPE["num_kv_heads"], SHAPE["num_qo_heads"], head_dim
    kv_tok = 2 * hkv * d * KV_DTYPES[kv_dtype]
    if flashinfer is None:
        flashinfer = kv_dtype in calib.TOP_KV_DTYPES
    raw, fit_recs = [], []
    partition_cases: dict[int, dict] = {g: {} for g in args.groups}
    # the device-planning kernel's occupancy per G: the Runtime's grid (runtime_grid) is sized by it
    resident = {g: decode_occupancy(dp_route.kernel, g, kv_dtype, d) for g in args.groups}
    for case, kind, seq in calibration_steps():
        kv = int(seq.sum()) * kv_tok
        if kind == "bucket" and not buckets:
            continue
        if kind == "bucket":
            wl = _workload(seq, l2, {**SHAPE, "head_dim": d}, kv_dtype=kv_dtype)
            ref = _reference(wl)
            for s in split_candidates(bucket_bounds, quick):
                us = time_bucket(wl, s, ref, repeats)
                merge = planner.state_bytes(len(seq) * s if s > 1 else 0, num_qo_heads=hq, head_dim=d)
                fit_recs.append(dict(case=case, route=kind, rows=len(seq), context=int(seq.max()),
                                     splits=int(s), us=float(us), kv_bytes=kv, ctas=len(seq) * hkv * s,
                                     launches=2 if s > 1 else 1, merge_bytes=int(merge)))
                raw.append(dict(case=case, engine="pkvrt-bucket", kv_dtype=kv_dtype, splits=int(s),
                                median_us=float(us), gbps=kv / (us * 1e3), cta_work_per_sm=len(seq) * hkv * s / sm,
                                ctas=len(seq) * hkv * s, rows=len(seq), kv_mb=round(kv / 1e6, 3)))
            del wl
            torch.cuda.empty_cache()
            continue
        for g in args.groups:   # the partition routes at every cut, then FlashInfer, per group size
            name = case if g == 4 else f"{case}-G{g}"
            wl = _workload(seq, l2, group_shape(g, d), kv_dtype)   # one workload and reference for every engine
            ref = _reference(wl)
            for route in partition_routes:
                grid = runtime_grid(len(seq), num_kv_heads=group_shape(g)["num_kv_heads"], splits=route.splits,
                                    base=base, resident=resident[g], max_waves=max_waves)
                records = time_partition(case, seq, g, route, base, wl, ref, repeats, quick, grid=grid)
                best = min(records, key=lambda r: r["us"])
                print(f"  {case} G {g} {route.name}: {len(records)} cuts, fastest S = {best['splits']} "
                      f"({best['us']:.1f} us, {time.perf_counter() - t_start:.0f} s)", flush=True)
                raw += [dict(case=name, engine=f"pkvrt-{route.kind}", kv_dtype=kv_dtype, group=g,
                             splits=r["splits"], median_us=r["us"], gbps=r["kv_bytes"] / (r["us"] * 1e3),
                             cta_work_per_sm=r["ctas"] / sm, ctas=r["ctas"], rows=len(seq),
                             kv_mb=round(r["kv_bytes"] / 1e6, 3)) for r in records]
                # both partition routes fit the shared constants (sweeps.partition_cases' names)
                partition_cases[g][f"{case} [{route.kind}]"] = (seq, {r["splits"]: r["us"] for r in records},
                                                                route.splits)
                if route is dp_route and g == 4:
                    fit_recs += records
            kv_g = kv * group_shape(g)["num_kv_heads"] // hkv
            for tc in (False, True) if flashinfer else ():
                if fi_route.unserved(d, False, g, tc) is not None:   # no CUDA-core kernel at this G
                    continue
                us = time_flashinfer(wl, tc, ref, repeats)
                raw.append(dict(case=name, engine="flashinfer-tc" if tc else "flashinfer-cuda",
                                kv_dtype=kv_dtype, group=g, median_us=float(us), gbps=kv_g / (us * 1e3),
                                rows=len(seq), kv_mb=round(kv_g / 1e6, 3)))
            del wl
            torch.cuda.empty_cache()
    return fit_recs, raw, partition_cases


def fit_groups(partition_cases: dict, reg, *, sm_count: int, kv_dtype: str,
               max_waves: int, head_dim: int = SHAPE["head_dim"]) -> tuple[dict, dict, dict]:
    """``calibration.fit_partition`` per G of :func:`time_steps`' partition sweeps (the workqueue
    and fused routes share the constants), with the occupancy of the device-planning route's
    kernel (``kv_dtype`` variant) at each G from the driver:
    ({G: points}, {G: {case: regret}}, {G: resident CTAs per SM})."""
    dp_route = reg.device_planning_route()
    fitted, regrets, resident = {}, {}, {}
    for g, cases in partition_cases.items():
        resident[g] = decode_occupancy(dp_route.kernel, g, kv_dtype, head_dim)
        fitted[g], regrets[g] = calib.fit_partition(
            cases, sm_count=sm_count, resident=resident[g], num_kv_heads=group_shape(g)["num_kv_heads"],
            splits=dp_route.splits, max_waves=max_waves)
    return fitted, regrets, resident


def _routes_text(cases: dict) -> str:
    """"5 fused, 5 workqueue" for fit_partition's "case [kind]" names."""
    kinds = [name.rsplit("[", 1)[-1].rstrip("]") for name in cases]
    return ", ".join(f"{kinds.count(k)} {k}" for k in sorted(set(kinds)))


def _regret_text(regrets: dict) -> str:
    return "; ".join(f"G {g}: " + ", ".join(f"{k} {v:.3f}" for k, v in r.items()) for g, r in regrets.items())


def measure(args, env) -> tuple[calib.Calibration, list[dict], dict]:
    """Every measurement and fit of a 16-bit calibration; returns the calibration, the raw timed
    rows and what ``--raw``'s meta records beside them (``kv_dtype``, ``occupancy`` per G)."""
    import torch

    from pkvrt.tools.plan_cmd import seed_calibration

    t_start = time.perf_counter()
    quick = args.quick
    repeats = 10 if quick else 30
    reg = load_routes(args.routes)
    dp_route = reg.device_planning_route()
    props = torch.cuda.get_device_properties(0)
    sm, l2 = props.multi_processor_count, getattr(props, "L2_cache_size", 0) or 60 * 2**20
    hkv = SHAPE["num_kv_heads"]
    kv_tok = 2 * hkv * SHAPE["head_dim"] * 2

    launch = measure_launch(repeats)
    torch_read = measure_torch_read(1 if quick else 2, repeats)
    # the split kernel as a streaming read: B16 x 32K = 2 GiB of K+V (B8 = 1 GiB with --quick)
    rows16 = 8 if quick else 16
    wl_big = _workload([FI_CONTEXT] * rows16, l2)
    ref_big = _reference(wl_big)
    big_bytes = int(wl_big.steps[0].seq_lens.sum()) * kv_tok
    kernel_read = big_bytes / (time_bucket(wl_big, 8, ref_big, repeats) * 1e3)
    beta = max(torch_read, float(kernel_read))
    base = attrs.evolve(seed_calibration(), gpu=props.name, sm_count=sm, l2_bytes=l2,
                        beta_gbps=beta, lambda_us=launch["pkvrt_eager"],
                        lambda_graph_us=launch["pkvrt_graph"],
                        splits=calib.SplitPoints(1.0, 1.0, TILE_TOKENS))

    max_waves = kept_max_waves(args, calib.slugify(props.name))
    fit_recs, raw, partition_cases = time_steps(args, reg, base, kv_dtype="float16", repeats=repeats,
                                                t_start=t_start, max_waves=max_waves)
    splits = calib.fit_split_points([r for r in fit_recs if r["route"] == "bucket"],
                                    sm_count=sm, num_kv_heads=hkv)
    fitted, regrets, resident = fit_groups(partition_cases, reg, sm_count=sm, kv_dtype="float16",
                                           max_waves=max_waves)
    splits.update(fitted[4], max_waves=max_waves, merge_free_slots=kept_merge_free_slots(args, calib.slugify(props.name)))
    by_group = {g: pts for g, pts in fitted.items() if g != 4}
    c_min = fit_c_min(fit_recs, base)
    base = attrs.evolve(base, c_min=c_min)

    fi_times, fi_variant = {}, {}
    for a in ((1, 8) if quick else FI_ACTIVE):
        wl = wl_big if a == rows16 else _workload([FI_CONTEXT] * a, l2)
        ref = ref_big if a == rows16 else _reference(wl)
        t = {tc: time_flashinfer(wl, tc, ref, repeats) for tc in (False, True)}
        tc = min(t, key=t.get)
        fi_times[a], fi_variant[a] = t[tc], "tc" if tc else "cuda"
        raw += [dict(case=f"B{a}-32K", engine="flashinfer-tc" if k else "flashinfer-cuda", kv_dtype="float16",
                     median_us=float(v), gbps=a * FI_CONTEXT * kv_tok / (v * 1e3)) for k, v in t.items()]
        if wl is not wl_big:
            del wl
            torch.cuda.empty_cache()
    fi = fit_flashinfer_ctas(fi_times, context=FI_CONTEXT, cal=base, kv_bytes_per_token=kv_tok)

    family = dp_route.kernel
    which = "split_decode kernel" if kernel_read >= torch_read else "torch sum"
    provenance = (
        f"Measured by pkvrt calibrate{' --quick' if quick else ''} on {props.name}. beta: the faster "
        f"streaming read, here the {which}: torch float32-accumulating sum over "
        f"{1 if quick else 2} GiB fp16 {torch_read:.0f} GB/s, PersistentKV split_decode over a "
        f"B{rows16} x 32K step (8 splits, incl. merge) {float(kernel_read):.0f} GB/s. "
        f"splits.workqueue_ctas_per_sm: the {family} kernel's occupancy (driver query, "
        f"{fitted[4]['workqueue_ctas_per_sm']:g} CTAs per SM); co_resident_slowdown / "
        f"cta_overhead_tiles / min_split_tokens: fit_partition over {len(partition_cases[4])} sweeps "
        f"({_routes_text(partition_cases[4])}, timed at every cut of the balanced partition in the grid the Runtime launches, "
        f"max_waves {max_waves}; the "
        f"middle of the best-scoring plateau) at G = 4 (H_q 32, H_kv 8); splits.by_group: the same fit at "
        f"G = {', '.join(str(g) for g in by_group) or '(none)'} (sweeps.group_heads: H_kv 32 / G, or 8 "
        f"with H_q 8 G where G does not divide 32). Regret of the "
        f"fitted rule (its pick over the fastest cut): " + _regret_text(regrets) + ". "
        f"lambda_us / lambda_graph_us:"
        f" a 1-token pkvrt split decode launched eagerly from Python (median of {repeats} loops of "
        f"100) / as one node of a 200-node CUDA graph (torch 1-element add: "
        f"{launch['torch_eager']:.2f} / {launch['torch_graph']:.2f} us). splits.bucket_ctas_per_sm: fit_split_points "
        f"over bucket B1 {'/'.join(f'{n // 1024}K' for n in B1_CONTEXTS)} (seed {SEED}); c_min: "
        f"least-squares fit of the cost model (log time) to the same configurations. "
        f"flashinfer.ctas_per_sm: FlashInfer "
        f"{env.get('flashinfer')} best of CUDA-core/tensor-core at 32K "
        f"({', '.join(f'B{a} {fi_times[a]:.1f} us ({fi_variant[a]})' for a in fi_times)}), "
        f"C = c_min * (KVBytes/beta) / (T - lambda_graph_us). All times: CUDA-event medians of "
        f"graph replays, outputs checked against the FP32 reference.")
    cal = make_calibration(
        gpu=props.name, sm_count=sm, l2_bytes=l2, beta_gbps=beta, lambda_us=launch["pkvrt_eager"],
        lambda_graph_us=launch["pkvrt_graph"], c_min=c_min, splits=splits, flashinfer=fi,
        versions={"torch": torch.__version__, "cuda": torch.version.cuda,
                  "flashinfer": env.get("flashinfer"), "driver": env.get("driver")},
        command=_command(), provenance=provenance, by_group=by_group)
    try:
        cal = add_time_model(cal, raw, reg)
    except ValueError as e:   # keep the measurements: the file gets the roofline, --raw the rows
        print(f"pkvrt calibrate: no time model written ({e}); the router will use the roofline. "
              "benches/cost_model_error.py fits and prints it from the --raw rows.", file=sys.stderr)
    _print(cal, launch, torch_read, float(kernel_read), fit_recs, fi_times, fi_variant)
    _print_sweeps(cal, fit_recs, regrets, time.perf_counter() - t_start)
    return cal, raw, {"kv_dtype": "float16", "occupancy": {str(g): n for g, n in resident.items()}}


def measure_kv_dtype(args, base: calib.Calibration, kv_dtype: str) -> tuple[calib.Calibration, list[dict], dict]:
    """The ``by_kv_dtype`` section of ``kv_dtype`` (FP8), measured and fitted as :func:`measure`
    fits the 16-bit constants, and ``base`` (this GPU's file, :func:`load_base`) with it added
    or replaced; every other constant of ``base`` is kept.

    Timed: the calibration steps of :func:`time_steps` with FP8 caches (no FlashInfer). Fitted:
    splits.bucket_ctas_per_sm (``fit_split_points``), the partition constants per G
    (``fit_partition``, with the occupancy of the device-planning kernel's e4m3 variant) and the
    time model of pkvrt's route kinds per G (``sweeps.fit_time_model``, against ``base``'s beta).
    Not measured, so the file's: beta, lambda, c_min, FlashInfer's constants and time model, and
    max_waves (unless ``--max-waves``). Returns as :func:`measure`.
    """
    import torch

    t_start = time.perf_counter()
    repeats = 10 if args.quick else 30
    reg = load_routes(args.routes)
    dp_route = reg.device_planning_route()
    props = torch.cuda.get_device_properties(0)   # the K/V copies rotate past this GPU's L2
    timing = attrs.evolve(base, l2_bytes=getattr(props, "L2_cache_size", 0) or base.l2_bytes,
                          splits=calib.SplitPoints(1.0, 1.0, TILE_TOKENS), by_kv_dtype=(), time_model=(),
                          time_model_by_group=())
    max_waves = args.max_waves or base.splits.max_waves
    fit_recs, raw, partition_cases = time_steps(args, reg, timing, kv_dtype=kv_dtype, repeats=repeats,
                                                t_start=t_start, max_waves=max_waves)
    bucket = calib.fit_split_points([r for r in fit_recs if r["route"] == "bucket"], sm_count=base.sm_count,
                                    num_kv_heads=SHAPE["num_kv_heads"])["bucket_ctas_per_sm"]
    fitted, regrets, resident = fit_groups(partition_cases, reg, sm_count=base.sm_count, kv_dtype=kv_dtype,
                                           max_waves=max_waves)
    others = ", ".join(str(g) for g in fitted if g != 4)
    waves = f"set by --max-waves: {max_waves}" if args.max_waves else f"the file's {max_waves}"
    provenance = (
        f"Measured by pkvrt calibrate --kv-dtype {kv_dtype}{' --quick' if args.quick else ''} on "
        f"{torch.cuda.get_device_name(0)}: every calibration step with {kv_dtype} K/V caches "
        f"(harness.quantize_fp8 'unit': a cast, scale 1.0, passed to the kernels as float32 [1] "
        f"device tensors; fp16 q and out), outputs checked against the FP32 reference over the "
        f"dequantized caches. splits.bucket_ctas_per_sm: fit_split_points over bucket B1 "
        f"{'/'.join(f'{n // 1024}K' for n in B1_CONTEXTS)}; splits.workqueue_ctas_per_sm: the "
        f"{dp_route.kernel} e4m3 kernel's occupancy (driver query, {resident[4]} CTAs per SM at G 4); "
        f"co_resident_slowdown / cta_overhead_tiles / min_split_tokens: fit_partition over "
        f"{len(partition_cases[4])} sweeps ({_routes_text(partition_cases[4])}) timed at every cut, in the "
        f"grid the Runtime launches (max_waves {max_waves}), at G = 4"
        f"{f'; splits.by_group: the same at G = {others}' if others else ''}. Regret of the fitted rule: "
        f"{_regret_text(regrets)}. Not measured with {kv_dtype} caches, so the file's: beta_gbps, "
        f"lambda_us, lambda_graph_us, c_min, flashinfer.ctas_per_sm and time_model.flashinfer "
        f"(FlashInfer is not timed: an FP8 Runtime does not run it), splits.max_waves "
        f"({waves}).")
    section = calib.KvDtypeSection(
        splits=(("bucket_ctas_per_sm", round(bucket, 3)),) + ((("max_waves", max_waves),) if args.max_waves else ()),
        date=datetime.date.today().isoformat(), command=_command(), provenance=provenance)
    cal = sweeps.with_partitions(calib.with_kv_dtype_section(base, kv_dtype, section), fitted, kv_dtype)
    try:
        cal = add_time_model(cal, raw, reg, kv_dtype)
    except ValueError as e:
        print(f"pkvrt calibrate: no {kv_dtype} time model written ({e}); the router will use the file's. "
              "benches/cost_model_error.py fits and prints it from the --raw rows.", file=sys.stderr)
    _print_section(cal, kv_dtype)
    _print_sweeps(cal.for_kv_dtype(kv_dtype), fit_recs, regrets, time.perf_counter() - t_start)
    return cal, raw, {"kv_dtype": kv_dtype, "fp8_scales": "unit",
                      "occupancy": {str(g): n for g, n in resident.items()}}


def timing_base(base: calib.Calibration, props) -> calib.Calibration:
    """What a section's run plans its timed cuts with: this GPU's file (SMs, beta) on this
    device's L2, with partition constants that leave every cut allowed and no sections or time
    model to lay over them."""
    return attrs.evolve(base, l2_bytes=getattr(props, "L2_cache_size", 0) or base.l2_bytes,
                        splits=calib.SplitPoints(1.0, 1.0, TILE_TOKENS), by_kv_dtype=(), by_head_dim=(),
                        time_model=(), time_model_by_group=())


def measure_head_dim(args, base: calib.Calibration, head_dim: int) -> tuple[calib.Calibration, list[dict], dict]:
    """The ``by_head_dim`` section of ``head_dim``: the calibration steps timed at that head dim
    (fp16 caches, the workqueue and fused routes at every cut, the bucket route's split
    candidates), fitted as :func:`measure` fits them (``fit_split_points``; ``fit_partition``
    per G of ``--groups`` with the device-planning kernel's occupancy at that head dim), and
    ``base`` (this GPU's file, :func:`load_base`) with the section added or replaced. FlashInfer
    is not timed and no time model is fitted: the router predicts with the file's (measured at D
    128, bytes counted at this head dim); the partition, which device planning and every captured
    step run, gets this head dim's constants. Returns as :func:`measure`."""
    import torch

    t_start = time.perf_counter()
    repeats = 10 if args.quick else 30
    reg = load_routes(args.routes)
    dp_route = reg.device_planning_route()
    props = torch.cuda.get_device_properties(0)
    timing = timing_base(base, props)
    kept = args.max_waves or section_max_waves(base, head_dim)   # given, or set by hand before
    max_waves = kept or base.splits.max_waves
    fit_recs, raw, partition_cases = time_steps(args, reg, timing, kv_dtype="float16", repeats=repeats,
                                                t_start=t_start, max_waves=max_waves, head_dim=head_dim,
                                                flashinfer=False)
    raw = [dict(r, head_dim=head_dim) for r in raw]
    bucket = calib.fit_split_points([r for r in fit_recs if r["route"] == "bucket"], sm_count=base.sm_count,
                                    num_kv_heads=SHAPE["num_kv_heads"])["bucket_ctas_per_sm"]
    fitted, regrets, resident = fit_groups(partition_cases, reg, sm_count=base.sm_count, kv_dtype="float16",
                                           max_waves=max_waves, head_dim=head_dim)
    section = head_dim_section(fitted, bucket, kept, provenance=(
        f"Measured by pkvrt calibrate --head-dim {head_dim}{' --quick' if args.quick else ''} on "
        f"{torch.cuda.get_device_name(0)}: every calibration step at head dim {head_dim} (H_q and "
        f"H_kv as the D {calib.CALIBRATION_HEAD_DIM} run's, fp16 caches), outputs checked against the "
        f"FP32 reference. splits.bucket_ctas_per_sm: fit_split_points over bucket B1 "
        f"{'/'.join(f'{n // 1024}K' for n in B1_CONTEXTS)}; splits.workqueue_ctas_per_sm: the "
        f"{dp_route.kernel} kernel's occupancy at D {head_dim} (driver query, {resident[4]} CTAs per SM "
        f"at G 4); co_resident_slowdown / cta_overhead_tiles / min_split_tokens: fit_partition over "
        f"{len(partition_cases[4])} sweeps ({_routes_text(partition_cases[4])}) timed at every cut, in "
        f"the grid the Runtime launches (max_waves {max_waves}), per G of {', '.join(map(str, fitted))}. "
        f"Regret of the fitted rule: {_regret_text(regrets)}. Not measured at this head dim, so the "
        f"file's: beta_gbps, lambda, c_min, FlashInfer's constants and the time model."))
    cal = calib.with_head_dim_section(base, head_dim, section)
    _print_sweeps(cal.for_head_dim(head_dim), fit_recs, regrets, time.perf_counter() - t_start)
    return cal, raw, {"kv_dtype": "float16", "head_dim": head_dim,
                      "occupancy": {str(g): n for g, n in resident.items()}}


def measure_added_groups(args, base: calib.Calibration, groups: tuple[int, ...]
                         ) -> tuple[calib.Calibration, list[dict], dict]:
    """``--add-groups``: the calibration steps timed at each G of ``groups`` (both partition
    routes at every cut in the grid of the file's ``max_waves``, FlashInfer's paths beside them;
    no bucket sweep), ``fit_partition`` and ``sweeps.fit_time_model`` per G as :func:`measure`
    fits them, and ``base`` (this GPU's file) with those G's ``splits.by_group`` and
    ``time_model.by_group`` entries added or replaced. Everything else stays the file's: the top
    level (G 4, beta, lambda, c_min, FlashInfer's constants), the other G's entries, the FP8 and
    head-dim sections (whose own by_group entries are their runs'), host_time. Why: a model
    whose G the file lacks plans on the nearest calibrated G's constants
    (``Calibration.calibrated_group``); calibrating it alone leaves the cuts of every other shape
    as they were. Returns as :func:`measure`."""
    import torch

    t_start = time.perf_counter()
    repeats = 10 if args.quick else 30
    reg = load_routes(args.routes)
    props = torch.cuda.get_device_properties(0)
    timing = timing_base(base, props)
    max_waves = base.splits.max_waves
    timed_args = argparse.Namespace(**{**vars(args), "groups": tuple(groups)})
    _, raw, partition_cases = time_steps(timed_args, reg, timing, kv_dtype="float16", repeats=repeats,
                                         t_start=t_start, max_waves=max_waves, buckets=False)
    fitted, regrets, resident = fit_groups(partition_cases, reg, sm_count=base.sm_count, kv_dtype="float16",
                                           max_waves=max_waves)
    splits_by_group = tuple(sorted({**dict(base.splits.by_group), **dict(rounded_by_group(fitted))}.items()))
    cal = attrs.evolve(base, splits=attrs.evolve(base.splits, by_group=splits_by_group))
    fits = sweeps.fit_time_model(sweeps.read_rows(raw, SEED, "float16"), cal, reg)
    missing = [g for g in groups if not fits.get(g)]
    if missing:
        raise RuntimeError(f"no time model could be fitted at G {missing} (too few timed cuts); "
                           "the file is not changed")
    times = tuple(sorted({**dict(base.time_model_by_group),
                          **{g: sweeps.rounded_kinds(fits[g]) for g in groups}}.items()))
    today = datetime.date.today().isoformat()
    cal = attrs.evolve(cal, time_model_by_group=times, provenance=base.provenance + (
        f" splits.by_group and time_model.by_group at G {', '.join(map(str, groups))}: pkvrt calibrate "
        f"--add-groups{' --quick' if args.quick else ''} on {props.name}, {today} (the calibration steps at "
        f"each G's shape, sweeps.group_heads; both partition routes at every cut in the grid of max_waves "
        f"{max_waves}, FlashInfer's paths beside them; fit_partition and sweeps.fit_time_model as the "
        f"whole run's); the rest of the file as before. Regret of the fitted rule: {_regret_text(regrets)}."))
    cal = calib.calibration_from_dict(calib.calibration_to_dict(cal))
    print(sweeps.format_time_model({g: fits[g] for g in groups}))
    return cal, raw, {"kv_dtype": "float16", "added_groups": list(groups),
                      "occupancy": {str(g): n for g, n in resident.items()}}


def section_max_waves(base: calib.Calibration, head_dim: int) -> int | None:
    """The ``max_waves`` of ``base``'s ``by_head_dim`` section of ``head_dim``, or None where the
    section sets none (or there is no section): a value set by hand there is kept by a
    ``--head-dim`` run without ``--max-waves``, as the top level's is by a whole run."""
    section = dict(base.by_head_dim).get(head_dim)
    return None if section is None else dict(section.splits).get("max_waves")


def head_dim_section(points: dict, bucket_ctas_per_sm: float, max_waves: int | None, *,
                     provenance: str) -> calib.KvDtypeSection:
    """A ``by_head_dim`` section of ``fit_partition``'s points per G (G 4 at its top level, the
    others by_group) and the bucket route's fitted constant (and ``max_waves`` when given)."""
    order = [a.name for a in attrs.fields(calib.SplitPoints)]
    top = dict(points.get(4, {}), bucket_ctas_per_sm=round(bucket_ctas_per_sm, 3))
    if max_waves is not None:
        top["max_waves"] = max_waves
    return calib.KvDtypeSection(
        splits=tuple((k, top[k]) for k in calib._SECTION_SPLIT_KEYS[:-1] if k in top),
        splits_by_group=tuple(sorted((g, tuple((k, p[k]) for k in order if k in p and k in calib._GROUP_KEYS))
                                     for g, p in points.items() if g != 4)),
        date=datetime.date.today().isoformat(), command=_command(), provenance=provenance)


def _command() -> str:
    return " ".join([Path(sys.argv[0]).name, *sys.argv[1:]])


def add_time_model(cal: calib.Calibration, raw: list[dict], reg, kv_dtype: str = "float16") -> calib.Calibration:
    """``cal`` (its partition constants fitted) with the measured time model that
    ``sweeps.fit_time_model`` fits on the timed rows of ``kv_dtype`` in ``raw``, and a sentence
    on it in ``source``: the file's top level for a 16-bit ``kv_dtype``, its ``by_kv_dtype``
    section (and that section's source) for FP8. A workqueue or fused kind that was not timed
    (routes.toml has no such route) takes the other's constants, and ``source`` says so. Raises
    ValueError when a 16-bit G 4 still lacks a kind."""
    fits = sweeps.fit_time_model(sweeps.read_rows(raw, SEED, kv_dtype), cal, reg)
    top, notes = fits.setdefault(4, {}), []
    for kind, other in (("workqueue", "fused"), ("fused", "workqueue")):
        if kind not in top and other in top:
            top[kind] = top[other]
            notes.append(f" No {kind} route was timed: time_model.{kind} is {other}'s.")
    cal = sweeps.with_time_model(cal, fits, kv_dtype)
    dp = reg.device_planning_route()
    fp16 = kv_dtype in calib.TOP_KV_DTYPES
    view = cal.for_kv_dtype(kv_dtype)
    groups = dict(cal.time_model_by_group) if fp16 else dict(dict(cal.by_kv_dtype)[kv_dtype].time_model_by_group)
    text = (f" time_model: sweeps.fit_time_model per route kind and group size (G 4 top level, "
            f"by_group: G = {', '.join(str(g) for g in groups) or '(none)'}) on "
            f"every calibration step at the cut its planner picks (weight {sweeps.PLANNED_WEIGHT:g}) "
            f"plus every cut within {100 * (sweeps.NEAR_BEST - 1):.0f} % of the step's fastest (weight 1), "
            "the least largest weighted error (costmodel.fit_route_time; bucket: least squares), "
            + ("FlashInfer at its faster path on the same steps and B1..B16 at 32K; " if fp16 else
               f"against the file's beta_gbps {view.beta_gbps:g}; FlashInfer not timed (the file's "
               "time_model.flashinfer, bytes counted at 1 per element); ")
            + f"bucket: read_scale and fixed_us only, tail_us and split_us from {dp.name} ({dp.kind}), "
            "no depth, merge or room term.") \
        + "".join(notes)
    if fp16:
        cal = attrs.evolve(cal, provenance=cal.provenance + text)
    else:
        sec = dict(cal.by_kv_dtype)[kv_dtype]
        cal = calib.with_kv_dtype_section(cal, kv_dtype, attrs.evolve(sec, provenance=sec.provenance + text))
    return calib.calibration_from_dict(calib.calibration_to_dict(cal))


def report(raw: list[dict], cal: calib.Calibration, reg, *, header: str = "",
           kv_dtype: str = "float16") -> tuple[str, str]:
    """(error table, suggested gates) of the calibration ``cal`` on the timed rows of
    ``kv_dtype`` in ``raw``: measured vs predicted µs per route and step at the cut the planner
    picks (``sweeps.format_errors``) and the routes.toml gates they measured
    (``sweeps.suggest_gates``, text for a person, never applied; "" for FP8 rows, which have no
    FlashInfer time to judge a route against)."""
    timed = sweeps.read_rows(raw, SEED, kv_dtype)
    gates = sweeps.suggest_gates(timed, cal, reg, header=header) if kv_dtype in calib.TOP_KV_DTYPES else ""
    return sweeps.format_errors(sweeps.error_rows(timed, cal, reg)), gates


def _print(cal, launch, torch_read, kernel_read, recs, fi_times, fi_variant) -> None:
    s = cal.splits
    rows = [
        ("gpu", cal.gpu, f"{cal.sm_count} SMs, L2 {cal.l2_bytes / 2**20:.0f} MiB"),
        ("beta_gbps", f"{cal.beta_gbps:.1f}",
         f"max(torch sum {torch_read:.0f}, split_decode {kernel_read:.0f})"),
        ("lambda_us", f"{cal.lambda_us:.2f}", f"eager pkvrt launch (torch add {launch['torch_eager']:.2f})"),
        ("lambda_graph_us", f"{cal.lambda_graph_us:.2f}",
         f"per graph node (torch add {launch['torch_graph']:.2f})"),
        ("c_min", f"{cal.c_min:.2f}", f"cost-model fit over {len(recs)} configurations"),
        *_split_rows("splits", s),
        *((f"flashinfer.ctas_per_sm.{a}", f"{c:.2f}", f"{fi_times[a]:.1f} us ({fi_variant[a]})")
          for a, c in cal.flashinfer_ctas_per_sm),
        *_time_rows("time_model", cal.time_model, cal.time_model_by_group),
    ]
    print(format_rows(("constant", "value", "from"), rows))
    print()


def _split_rows(prefix: str, s: calib.SplitPoints) -> list[tuple]:
    return [(f"{prefix}.bucket_ctas_per_sm", f"{s.bucket_ctas_per_sm:.2f}", "fit_split_points, B1 cases"),
            (f"{prefix}.workqueue_ctas_per_sm", f"{s.workqueue_ctas_per_sm:.2f}", "decode kernel occupancy (driver)"),
            (f"{prefix}.co_resident_slowdown", f"{s.co_resident_slowdown:.2f}", "fit_partition: two CTAs on an SM"),
            (f"{prefix}.cta_overhead_tiles", f"{s.cta_overhead_tiles:.2f}", "fit_partition: a CTA's fixed cost"),
            (f"{prefix}.min_split_tokens", str(s.min_split_tokens), "fit_partition: shortest split"),
            (f"{prefix}.wave_room_slots / tiles / chunk_tiles",
             f"{s.wave_room_slots} / {s.wave_room_tiles:.1f} / {s.wave_room_chunk_tiles}",
             "fit_wave_room: a last wave's room charge")]


def _time_rows(prefix: str, top, by_group) -> list[tuple]:
    return [(f"{prefix}{'' if g == 4 else f'.by_group.{g}'}.{k}",
             f"{t.read_scale:.3f} {t.depth_us:.3f} {t.tail_us:.3f} {t.split_us:.3f} {t.merge_us:.3f} "
             f"{t.room_us:.3f} {t.fixed_us:.2f}",
             "read_scale depth_us tail_us split_us merge_us room_us fixed_us (sweeps.fit_time_model)")
            for g, kinds in ((4, top), *by_group) for k, t in kinds]


def _print_section(cal: calib.Calibration, kv_dtype: str) -> None:
    """The constants an FP8 run measured: its ``by_kv_dtype`` section at G 4."""
    sec = dict(cal.by_kv_dtype)[kv_dtype]
    prefix = f"by_kv_dtype.{kv_dtype}"
    rows = [("gpu", cal.gpu, f"{cal.sm_count} SMs; beta {cal.beta_gbps:.1f} GB/s from the file"),
            *_split_rows(f"{prefix}.splits", cal.for_kv_dtype(kv_dtype).splits),
            *_time_rows(f"{prefix}.time_model", sec.time_model, sec.time_model_by_group)]
    print(format_rows(("constant", "value", "from"), rows))
    print()


def _print_sweeps(cal, recs, regrets, seconds) -> None:
    """The bucket and G 4 partition sweeps, and the fitted partition rule per G (``cal``: the
    file's calibration, or its view of the KV dtype timed)."""
    print(format_rows(("case", "route", "S", "us", "CTAs/SM", "GB/s"),
                      [(r["case"], r["route"], r["splits"], f"{r['us']:.1f}",
                        f"{r['ctas'] / cal.sm_count:.2f}", f"{r['kv_bytes'] / (r['us'] * 1e3):.0f}")
                       for r in recs]))
    print()
    print(format_rows(("G", "slowdown", "overhead tiles", "min split", "regret: case (pick / fastest cut)"),
                      [(g, f"{c.splits.co_resident_slowdown:.2f}", f"{c.splits.cta_overhead_tiles:.2f}",
                        c.splits.min_split_tokens,
                        ", ".join(f"{k} {v:.3f}" for k, v in regrets[g].items()))
                       for g, c in ((g, cal.for_group(g)) for g in regrets)]))
    print(f"\ncalibrated in {seconds:.0f} s")


def main(argv: list[str] | None = None) -> int:
    """``python calibration/calibrate.py [--out PATH] [--quick]``: the same as ``pkvrt calibrate``."""
    parser = argparse.ArgumentParser(prog="calibrate.py", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    add_arguments(parser)
    args = parser.parse_args(argv)
    try:
        return run(args)
    except (ValueError, OSError) as e:
        print(f"calibrate.py: error: {e}", file=sys.stderr)
        return 2
