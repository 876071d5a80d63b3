"""A short workload that runs every kernel family once per variant, for compute-sanitizer.

``benches/sanitize.sh`` runs it under memcheck, initcheck, synccheck and racecheck. Sizes are
small (H_kv = 2, at most 4 rows, at most 3000 tokens a row) so that it takes seconds on a GPU and
a minute or two under a sanitizer (50-100x slower). What runs:

* the decode sweep: every head dim (64, 96, 128, 256) with a group size of each group capacity
  the kernels are built for (G 1-4, 5-8, 9-16, 17-64), fp16 and bf16, page sizes 1 to 128; ragged rows
  (length 1, a row of one tile whose splits are all but one empty, page-boundary lengths). Per
  shape: split_decode with S = 1 (writes O), split_decode with S > 1 over permuted rows plus an
  idle (-1) grid row, then merge; workqueue_decode + merge (skip_single) on row-local splits
  with idle task slots past num_tasks; workqueue_decode with counters= (fused decode + merge,
  counters must end at zero);
* the variants and layouts sweep (tests/gpu/test_coverage.py's cases, built on the host): sliding
  windows, soft cap, sinks, sm_scale and lse, alone and together (gpt-oss, Gemma-2), over the
  NHD, combined and vLLM-packed cache layouts and e4m3 K/V, on every route;
* merge_segments (the shared-pages merge) against its torch write-out, one SharedPagesRuntime
  step with nested shared prefixes, find_shared against its twin and one device-lengths
  SharedPagesRuntime step (tests/gpu/test_sharing.py);
* merge alone, with empty states (m = -inf), a one-slot row and an idle row;
* plan_workqueue_device, checked against the host planner, then decode + merge on its plan;
* one CUDA graph of (device plan, workqueue decode, merge) captured once and replayed twice
  with other seq_lens;
* one pkvrt.Runtime step per PersistentKV route of routes.toml (forced), CUDA graphs on;
* FP8 (e4m3) K/V: split_decode, workqueue + merge and fused over 4 shapes (every D, G 1/2/4/8,
  pages 1/16/64, per-tensor and per-KV-head scales), and an FP8 Runtime with device planning.

Inputs come from tests/paged.py's make_batch: pages no row owns and slots past seq_len hold NaN,
block-table padding holds an out-of-range page id. Every output is compared on the host with
the FP32 reference (pkvrt.reference) at a loose tolerance. ``--poison nan`` (default) fills
outputs and partial states with NaN first, so an element left unwritten shows as a mismatch;
``--poison none`` leaves them as torch.empty returns them, so that initcheck (with
PYTORCH_NO_CUDA_MEMORY_CACHING=1: every tensor its own cudaMalloc) flags a read before a write;
the variants-and-layouts, merge_segments and SharedPagesRuntime cases poison with NaN either way
(the GPU tests' own buffers), so initcheck sees their reads of written memory only.

Prints one line per case and ``sanitize_workload: N cases, M mismatches``; exits 1 on any
mismatch (or exception: counted as a mismatch), 2 without a GPU.

usage: python3 benches/sanitize_workload.py [--quick] [--poison nan|none]
"""

from __future__ import annotations

import argparse
import inspect
import math
import sys
import time
import warnings
from pathlib import Path

import attrs
import numpy as np
import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "tests"))
sys.path.append(str(ROOT))  # an installed pkvrt first, else this checkout's
from paged import make_batch, rel_err  # noqa: E402

from pkvrt import _buildspec, reference  # noqa: E402
from pkvrt.launch import _driver, ops  # noqa: E402
from pkvrt.policy import planner  # noqa: E402
from pkvrt.runtime.graphs import collector_paused  # noqa: E402
from pkvrt.policy.calibration import find_calibration  # noqa: E402
from pkvrt.policy.registry import load_routes  # noqa: E402
from pkvrt.runtime import Runtime  # noqa: E402
from pkvrt.runtime.options import RuntimeOptions  # noqa: E402

F16, BF16 = torch.float16, torch.bfloat16
TOL = {F16: 5e-3, BF16: 2e-2}  # loose: 2-2.5x the GPU tests' (tests/gpu/test_kernels.py)
TILE = _buildspec.TILE_TOKENS
H_KV = 2
DEV = "cuda"
SEED = 20260707

# (head_dim, G, dtype, page): every head dim with a G of each group capacity (4, 8, 16, 64: G
# 1-4, 5-8, 9-16, 17-64 run the capacity's kernel with G a run-time value; 64 the wide body, with
# two token streams at G <= 32 and one above), both dtypes and page sizes 1-128 spread over them
# (D = 256 runs 2 pipeline stages, not 3; D = 96 pads its shared-memory rows).
SHAPES = [
    (64, 1, F16, 1), (64, 5, BF16, 16), (64, 16, F16, 128),
    (96, 3, F16, 16), (96, 7, BF16, 1), (96, 12, F16, 32),
    (128, 2, BF16, 8), (128, 4, F16, 64), (128, 8, BF16, 1), (128, 16, F16, 16),
    (256, 1, BF16, 16), (256, 6, F16, 1), (256, 16, BF16, 64),
    (64, 40, BF16, 32), (96, 17, F16, 64), (128, 32, F16, 1), (128, 64, BF16, 16), (256, 48, F16, 8),
]
# --quick (racecheck): every head dim and every group capacity once, both dtypes, pages 1-128.
QUICK_SHAPES = [(64, 16, F16, 1), (96, 7, BF16, 16), (128, 3, F16, 128), (256, 9, BF16, 1),
                (128, 8, BF16, 16), (128, 24, F16, 16), (64, 64, BF16, 1)]
QUICK_MAX_LEN = 800
# Ragged rows, cycled over the shapes: 1 token; 17 and 31 tokens (one tile: with S > 1 all
# splits but one are empty); 33 (two tiles); 2048 (a page boundary at every page size).
LENS = [[1, 33, 700, 2900], [2900, 17], [31, 1500, 64, 1], [2048, 5, 1000], [3000]]
BUCKET_SPLITS = [7, 16, 64]     # split_decode S > 1, cycled
WORKQUEUE_SPLITS = [4, 16, 64]  # per-row workqueue splits (capped by the row's tiles), cycled


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--quick", action="store_true",
                   help=f"{len(QUICK_SHAPES)} decode shapes, rows cut to {QUICK_MAX_LEN} tokens, no "
                        "CUDA graph and no Runtime cases (for racecheck, the slowest tool)")
    p.add_argument("--poison", choices=("nan", "none"), default="nan",
                   help="fill outputs and partial states with NaN before each launch (default), "
                        "or leave them uninitialized (torch.empty) for initcheck")
    return p.parse_args(argv)


# ----------------------------------------------------------------------------- bookkeeping


class Tally:
    """Cases run and mismatches; one printed line per case."""

    def __init__(self):
        self.cases = self.bad = 0

    def check(self, name: str, out: torch.Tensor, ref: torch.Tensor, tol: float, note: str = "") -> None:
        """out [B, H_q, D] (any device) against ref (FP32, host)."""
        out = out.cpu().float()  # on the host: no torch kernel reads the output
        finite = bool(torch.isfinite(out).all())
        err = rel_err(out, ref) if finite else float("nan")
        ok = finite and err < tol
        self.record(name, ok, f"rel_err {err:.2e} (tol {tol:.0e})"
                    + ("" if finite else ", non-finite output") + (f"; {note}" if note else ""))

    def record(self, name: str, ok: bool, detail: str) -> None:
        self.cases += 1
        self.bad += not ok
        print(f"{'ok ' if ok else 'BAD'} {name:<52} {detail}", flush=True)

    def guarded(self, name: str, fn, *args) -> None:
        """Run one case; an exception is reported as a mismatch and the next case runs."""
        try:
            fn(self, name, *args)
        except Exception as exc:  # noqa: BLE001 - reported and counted, the workload goes on
            self.record(name, False, f"{type(exc).__name__}: {exc}")


@attrs.frozen
class Buffers:
    """How scratch tensors are made: NaN-poisoned, or uninitialized (for initcheck)."""

    poison: bool

    def out(self, *shape, dtype=torch.float32) -> torch.Tensor:
        if self.poison:
            bad = float("nan") if dtype.is_floating_point else -7
            return torch.full(shape, bad, dtype=dtype, device=DEV)
        return torch.empty(shape, dtype=dtype, device=DEV)


def host_batch(lens, d, g, dtype, page, seed):
    """A make_batch on the host (the reference runs there: no torch kernels under the sanitizer
    beyond copies and fills) and its device twin."""
    b = make_batch(lens, num_qo_heads=g * H_KV, num_kv_heads=H_KV, head_dim=d, page_size=page,
                   dtype=dtype, device="cpu", seed=seed)
    dev = attrs.evolve(b, **{f.name: getattr(b, f.name).to(DEV) for f in attrs.fields(type(b))})
    return b, dev


def ref_out(b, lens=None) -> torch.Tensor:
    """FP32 reference on the host batch ``b``, optionally with other (shorter) seq_lens."""
    seq = b.seq_lens if lens is None else torch.tensor(lens, dtype=torch.int32)
    return reference.decode_attention(b.q, b.k_cache, b.v_cache, seq, b.block_tables)


def i32(values) -> torch.Tensor:
    return torch.tensor(values, dtype=torch.int32, device=DEV)


# ----------------------------------------------------------------------------- decode sweep


def split_case(t: Tally, name: str, b, dev, ref, splits: int, buf: Buffers, sk=None) -> None:
    """split_decode over the rows in reverse order plus one idle grid row (-1); merge if S > 1.
    ``sk``: dict(k_scale=, v_scale=) of an FP8 cache (:func:`fp8_batch`)."""
    rows, hq, d = b.q.shape
    row_ids = i32(list(reversed(range(rows))) + [-1])
    slots = row_ids.shape[0] * splits
    out = buf.out(rows, hq, d, dtype=b.q.dtype)
    part_a = buf.out(slots, hq, d) if splits > 1 else None
    part_ml = buf.out(slots, hq, 2) if splits > 1 else None
    ops.split_decode(dev.q, dev.k_cache, dev.v_cache, dev.seq_lens, dev.block_tables, row_ids, splits,
                     out, part_a, part_ml, **(sk or {}))
    if splits > 1:
        offsets = torch.arange(row_ids.shape[0] + 1, dtype=torch.int32, device=DEV) * splits
        ops.merge(part_a, part_ml, offsets, out, row_ids=row_ids)
    t.check(name, out, ref, TOL[b.q.dtype])


def workqueue_tasks(lens, splits: int):
    """Row-local tasks as the planners cut them: min(splits, tiles) balanced tile ranges per row
    (planner.split_tile_range), every (row, kvh, split) once. Returns (tasks, split_offsets)."""
    tasks, offsets = [], [0]
    for row, n in enumerate(lens):
        tiles = -(-n // TILE)
        s = min(splits, tiles)
        for j in range(s):
            lo, hi = planner.split_tile_range(j, s, tiles)
            tasks += [(row, h, j, lo * TILE, min(n, hi * TILE)) for h in range(H_KV)]
        offsets.append(offsets[-1] + s)
    return tasks, offsets


def workqueue_case(t: Tally, name: str, b, dev, ref, splits: int, fused: bool, buf: Buffers,
                   sk=None, two_level: int | None = None) -> None:
    """workqueue_decode + merge(skip_single), or the fused kernel (counters=); 7 idle task slots.
    ``sk`` as in :func:`split_case`. ``two_level`` (fused): the group counters with
    ``merge_groups_from`` = that value (0: the kernel's rule; 2: every row of 2+ splits)."""
    rows, hq, d = b.q.shape
    lens = b.seq_lens.tolist()
    tasks, offsets = workqueue_tasks(lens, splits)
    padded = tasks + [(-1,) * 5] * 7   # slots past num_tasks must exit without reading anything
    slots = offsets[-1]
    out = buf.out(rows, hq, d, dtype=b.q.dtype)
    part_a, part_ml = buf.out(slots, hq, d), buf.out(slots, hq, 2)
    counters = torch.zeros(rows, H_KV, dtype=torch.int32, device=DEV) if fused else None
    two = {}
    if two_level is not None:
        two = dict(group_counters=torch.zeros(slots, H_KV, dtype=torch.int32, device=DEV),
                   merge_groups_from=two_level)
    ops.workqueue_decode(dev.q, dev.k_cache, dev.v_cache, dev.seq_lens, dev.block_tables, i32(padded),
                         i32([len(tasks)]), i32(offsets), out, part_a, part_ml, counters=counters,
                         **two, **(sk or {}))
    note = f"{len(tasks)} tasks"
    if fused:
        left = int(counters.abs().sum()) + (int(two["group_counters"].abs().sum()) if two else 0)
        note += f", counters left {left}"
        if left:
            t.record(name, False, f"fused counters not reset to zero (sum |c| = {left})")
            return
    else:
        ops.merge(part_a, part_ml, i32(offsets), out, skip_single=True)
    t.check(name, out, ref, TOL[b.q.dtype], note)


def decode_sweep(t: Tally, shapes, quick: bool, buf: Buffers) -> None:
    for i, (d, g, dtype, page) in enumerate(shapes):
        lens = LENS[i % len(LENS)]
        if quick:
            lens = [min(n, QUICK_MAX_LEN) for n in lens]
        b, dev = host_batch(lens, d, g, dtype, page, seed=SEED + i)
        ref = ref_out(b)
        tag = f"D{d} G{g} {str(dtype)[6:]} p{page} lens={lens}"
        s, w = BUCKET_SPLITS[i % len(BUCKET_SPLITS)], WORKQUEUE_SPLITS[i % len(WORKQUEUE_SPLITS)]
        t.guarded(f"split_decode S=1 {tag}", split_case, b, dev, ref, 1, buf)
        t.guarded(f"split_decode S={s} + merge {tag}", split_case, b, dev, ref, s, buf)
        t.guarded(f"workqueue S<={w} + merge {tag}", workqueue_case, b, dev, ref, w, False, buf)
        t.guarded(f"fused S<={w} {tag}", workqueue_case, b, dev, ref, w, True, buf)
        # the two-level tail: the kernel's rule at 64 splits (two levels at D 96-256 for G 5-16
        # past its thresholds), and forced from 2 splits (one level where the kernel has none)
        t.guarded(f"fused S<=64 two-level rule {tag}", workqueue_case, b, dev, ref, 64, True, buf,
                  None, 0)
        t.guarded(f"fused S<={w} two levels from 2 {tag}", workqueue_case, b, dev, ref, w, True, buf,
                  None, 2)


# FP8 (e4m3) K/V: (head_dim, G, q dtype, page, per-KV-head scales). Every D, both bodies' group
# sizes, both q dtypes, pages 1, 16 and 64, both scale layouts.
FP8_SHAPES = [(64, 1, F16, 16, False), (128, 4, BF16, 1, True), (128, 8, F16, 64, False),
              (256, 2, BF16, 16, True), (128, 32, F16, 16, True), (64, 64, BF16, 1, False)]


def fp8_batch(lens, d, g, dtype, page, per_head, seed):
    """host_batch with e4m3 K/V (reference.quantize_kv: NaN poison stays NaN) and float32 scales
    [H_kv] or [1]; the reference runs over the dequantized caches. Returns (b, dev, sk, ref)."""
    b, _ = host_batch(lens, d, g, dtype, page, seed)
    k, ks = reference.quantize_kv(b.k_cache, per_head=per_head)
    v, vs = reference.quantize_kv(b.v_cache, per_head=per_head)
    b = attrs.evolve(b, k_cache=k, v_cache=v)
    dev = attrs.evolve(b, **{f.name: getattr(b, f.name).to(DEV) for f in attrs.fields(type(b))})
    ref = reference.decode_attention(b.q, k, v, b.seq_lens, b.block_tables, k_scale=ks, v_scale=vs)
    return b, dev, dict(k_scale=ks.to(DEV), v_scale=vs.to(DEV)), ref


def fp8_sweep(t: Tally, quick: bool, buf: Buffers) -> None:
    for i, (d, g, dtype, page, per_head) in enumerate(FP8_SHAPES[:2] if quick else FP8_SHAPES):
        lens = LENS[i % len(LENS)]
        if quick:
            lens = [min(n, QUICK_MAX_LEN) for n in lens]
        b, dev, sk, ref = fp8_batch(lens, d, g, dtype, page, per_head, seed=SEED + 500 + i)
        tag = f"e4m3 D{d} G{g} {str(dtype)[6:]} p{page} {'per-head' if per_head else 'per-tensor'} lens={lens}"
        s, w = BUCKET_SPLITS[i % len(BUCKET_SPLITS)], WORKQUEUE_SPLITS[i % len(WORKQUEUE_SPLITS)]
        t.guarded(f"split_decode S=1 {tag}", split_case, b, dev, ref, 1, buf, sk)
        t.guarded(f"split_decode S={s} + merge {tag}", split_case, b, dev, ref, s, buf, sk)
        t.guarded(f"workqueue S<={w} + merge {tag}", workqueue_case, b, dev, ref, w, False, buf, sk)
        t.guarded(f"fused S<={w} {tag}", workqueue_case, b, dev, ref, w, True, buf, sk)
        t.guarded(f"fused S<={w} two levels from 2 {tag}", workqueue_case, b, dev, ref, w, True, buf, sk, 2)


# ----------------------------------------------------------------------------- merge alone


def merge_case(t: Tally, name: str, d: int, dtype, buf: Buffers) -> None:
    """Four merge rows: 3 slots -> out row 2, 1 slot -> row 0, 4 slots (2 empty) -> row 1, and an
    idle row (-1) with 2 slots that must write nothing."""
    hq, sizes, row_ids = 8, [3, 1, 4, 2], [2, 0, 1, -1]
    gen = torch.Generator().manual_seed(d)
    n = sum(sizes)
    m = torch.randn(n, hq, generator=gen) * 4                      # log2-domain maxima
    l = torch.rand(n, hq, generator=gen) + 0.5
    a = torch.randn(n, hq, d, generator=gen) * l[..., None]
    empty = [5, 7]                                                 # inside row 2's slots 4..7
    m[empty], l[empty], a[empty] = -math.inf, 0.0, 0.0
    offsets = np.concatenate([[0], np.cumsum(sizes)]).tolist()
    ref = torch.empty(3, hq, d)
    for r, out_row in enumerate(row_ids):
        if out_row >= 0:
            s = slice(offsets[r], offsets[r + 1])
            ref[out_row] = reference.merge_states(m[s], l[s], a[s])
    out = buf.out(3, hq, d, dtype=dtype)
    ops.merge(a.to(DEV), torch.stack([m, l], -1).to(DEV), i32(offsets), out, row_ids=i32(row_ids))
    t.check(name, out, ref, TOL[dtype])


# ----------------------------------------------------------------------------- device plan, graph


class DevicePlanStep:
    """plan_workqueue_device -> workqueue_decode -> merge on static buffers (capturable: the
    launches read seq_lens, the plan and q from device memory only)."""

    MAX_ROWS = 8

    def __init__(self, dev, buf: Buffers):
        self.dev, rows_max = dev, self.MAX_ROWS  # seq_lens, plan and block tables: MAX_ROWS rows
        self.route = load_routes().route("pkv_workqueue")
        self.cal = find_calibration(torch.cuda.get_device_name())
        rows, hq, d = dev.q.shape
        cap_splits = self.route.splits.max
        self.seq = torch.zeros(rows_max, dtype=torch.int32, device=DEV)
        self.rows = i32([rows])
        self.cand = i32(list(self.route.splits.candidates()))
        self.bt = torch.zeros(rows_max, dev.block_tables.shape[1], dtype=torch.int32, device=DEV)
        self.bt[:rows] = dev.block_tables
        self.tasks = buf.out(rows_max * H_KV * cap_splits, 5, dtype=torch.int32)
        self.num_tasks = buf.out(1, dtype=torch.int32)
        self.split_offsets = buf.out(rows_max + 1, dtype=torch.int32)
        self.num_splits = buf.out(rows_max, dtype=torch.int32)
        self.status = buf.out(1, dtype=torch.int32)  # overflow / bad-length flags, written every launch
        # The device-side length bound (max_seq_len, [1] int32) is being added to ops in parallel
        # with this script: pass it where it exists (else ops would allocate a default while a
        # graph is being captured). Rows only shrink below the lengths make_batch filled.
        self.bound = {}
        if "max_seq_len" in inspect.signature(ops.plan_workqueue_device).parameters:
            self.bound = dict(max_seq_len=i32([max(dev.seq_lens.tolist())]))
        self.part_a = buf.out(rows_max * cap_splits, hq, d)
        self.part_ml = buf.out(rows_max * cap_splits, hq, 2)
        self.out = buf.out(rows, hq, d, dtype=dev.q.dtype)

    def set_lens(self, lens) -> None:
        self.seq[:len(lens)] = torch.tensor(lens, dtype=torch.int32)

    def launch(self) -> None:
        dev, cal, rows = self.dev, self.cal, self.dev.q.shape[0]
        ops.plan_workqueue_device(self.seq, self.rows, self.tasks, self.num_tasks, self.split_offsets,
                                  self.num_splits, self.status, self.cand, num_kv_heads=H_KV,
                                  min_split_tiles=-(-cal.splits.min_split_tokens // TILE),
                                  **planner.device_plan_targets(cal),
                                  **self.bound)
        ops.workqueue_decode(dev.q, dev.k_cache, dev.v_cache, self.seq, self.bt, self.tasks,
                             self.num_tasks, self.split_offsets, self.out, self.part_a, self.part_ml)
        ops.merge(self.part_a, self.part_ml, self.split_offsets[:rows + 1], self.out, skip_single=True)


PLAN_LENS = [2900, 1, 700, 33]


def sorted_rows(tasks: np.ndarray) -> np.ndarray:
    """tasks [n, 5] in lexicographic order (the device plan orders tasks by row, the host longest
    row first)."""
    return tasks[np.lexsort(tasks.T[::-1])]


def device_plan_case(t: Tally, name: str, buf: Buffers) -> None:
    b, dev = host_batch(PLAN_LENS, 128, 4, F16, 16, seed=SEED + 100)
    step = DevicePlanStep(dev, buf)
    step.set_lens(PLAN_LENS)
    step.launch()
    host = planner.plan_workqueue(np.array(PLAN_LENS), num_kv_heads=H_KV, num_qo_heads=4 * H_KV,
                                  head_dim=128, dtype_bytes=2, splits=step.route.splits, cal=step.cal)
    n, rows = int(step.num_tasks.item()), len(PLAN_LENS)
    same = (int(step.status.item()) == 0 and n == len(host.tasks)
            and np.array_equal(step.num_splits[:rows].cpu().numpy(), host.num_splits)
            and np.array_equal(step.split_offsets[:rows + 1].cpu().numpy(), host.split_offsets)
            and np.array_equal(sorted_rows(step.tasks[:n].cpu().numpy()), sorted_rows(host.tasks)))
    t.record(f"{name}: equals the host planner", same,
             f"{n} tasks, splits {step.num_splits[:rows].tolist()}, status {int(step.status.item())}")
    t.check(f"{name}: workqueue_decode + merge on it", step.out, ref_out(b), TOL[F16])


def graph_case(t: Tally, name: str, buf: Buffers) -> None:
    """Capture (device plan, decode, merge) once; replay twice with shorter rows (shorter only:
    tokens past the original lengths are NaN)."""
    b, dev = host_batch(PLAN_LENS, 128, 4, F16, 16, seed=SEED + 200)
    step = DevicePlanStep(dev, buf)
    step.set_lens(PLAN_LENS)
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        step.launch()                  # warm-up outside capture (module load, attributes)
    torch.cuda.current_stream().wait_stream(side)
    t.check(f"{name}: warm-up", step.out, ref_out(b), TOL[F16])
    graph = torch.cuda.CUDAGraph(keep_graph=True)
    with collector_paused(), torch.cuda.graph(graph):   # pkvrt.runtime.graphs.capture's reason
        step.launch()
    graph.instantiate()                # keep_graph=True (for the node count) defers it
    nodes = _driver.graph_node_count(graph)
    for i, lens in enumerate([[2000, 1, 700, 1], [2900, 1, 64, 33]]):
        step.set_lens(lens)
        if buf.poison:
            step.out.fill_(float("nan"))
        graph.replay()
        t.check(f"{name}: replay {i + 1} lens={lens}", step.out, ref_out(b, lens), TOL[F16],
                f"{nodes} graph nodes")


# ----------------------------------------------------------------------------- Runtime


RUNTIME_LENS = [2900, 2900, 33, 1]


def runtime_case(t: Tally, name: str, route: str, buf: Buffers) -> None:
    """One Runtime step forced onto ``route`` (graphs on), then a step with shorter rows."""
    b, dev = host_batch(RUNTIME_LENS, 128, 4, F16, 16, seed=SEED + 300)
    rows, hq, d = b.q.shape
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # no FlashInfer asked for; calibration fallback warnings
        rt = Runtime(hq, H_KV, d, 16, F16, max_batch=4, max_pages_per_row=256,
                     options=RuntimeOptions(flashinfer=False, use_cuda_graph=True))
    bt = b.block_tables.numpy()
    for i, lens in enumerate([RUNTIME_LENS, [n - 3 if n > 3 else n for n in RUNTIME_LENS]]):
        rt.plan(np.array(lens, dtype=np.int32), bt, force=route)
        rt.static_q(rows).copy_(dev.q)
        if buf.poison:
            rt.static_out(rows).fill_(float("nan"))
        out = rt.run(rt.static_q(rows), dev.k_cache, dev.v_cache, out=rt.static_out(rows))
        s = rt.stats()
        t.check(f"{name} step {i + 1} lens={lens}", out, ref_out(b, lens), TOL[F16],
                f"route {rt.last_decision.route}, captures {s['captures']}, replays {s['replays']}")


def runtime_layers_case(t: Tally, name: str, buf: Buffers) -> None:
    """Device planning launched eagerly for 3 layers of one step: layers 2 and 3 set early_kv
    (the decode copies K/V before the previous layer's merge has finished, PDL on sm_90+)."""
    b, dev = host_batch(RUNTIME_LENS, 128, 4, F16, 16, seed=SEED + 400)
    rows, hq, d = b.q.shape
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        rt = Runtime(hq, H_KV, d, 16, F16, max_batch=4, max_pages_per_row=256, device_planning=True,
                     options=RuntimeOptions(use_cuda_graph=False))
    rt.plan(dev.seq_lens.to(torch.int32), dev.block_tables.to(torch.int32))
    outs = [torch.full_like(dev.q, float("nan")) for _ in range(3)]
    for out in outs:
        rt.run(dev.q, dev.k_cache, dev.v_cache, out=out)
    for i, out in enumerate(outs):
        t.check(f"{name} layer {i + 1}", out, ref_out(b, RUNTIME_LENS), TOL[F16])


def runtime_fp8_case(t: Tally, name: str, buf: Buffers) -> None:
    """An FP8 Runtime with device planning (planning kernel + e4m3 fused decode), graphs on,
    per-KV-head scales, two steps (the second with shorter rows: a replay of both graphs)."""
    b, dev, sk, _ = fp8_batch(RUNTIME_LENS, 128, 4, F16, 16, True, seed=SEED + 600)
    rows, hq, d = b.q.shape
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        rt = Runtime(hq, H_KV, d, 16, F16, kv_dtype=torch.float8_e4m3fn, max_batch=4,
                     max_pages_per_row=256, device_planning=True, num_pages=b.k_cache.shape[0])
    for i, lens in enumerate([RUNTIME_LENS, [n - 3 if n > 3 else n for n in RUNTIME_LENS]]):
        rt.plan(i32(lens), dev.block_tables.to(torch.int32))
        out = buf.out(rows, hq, d, dtype=F16)
        rt.run(dev.q, dev.k_cache, dev.v_cache, out=out, **sk)
        ref = reference.decode_attention(b.q, b.k_cache, b.v_cache, torch.tensor(lens, dtype=torch.int32),
                                         b.block_tables, k_scale=sk["k_scale"].cpu(),
                                         v_scale=sk["v_scale"].cpu())
        s = rt.stats()
        t.check(f"{name} step {i + 1} lens={lens}", out, ref, TOL[F16],
                f"route {rt.last_decision.route}, captures {s['captures']}, replays {s['replays']}")


# ----------------------------------------------------------------------------- variants, layouts


# (route, variant of test_coverage.VARIANTS, make_case arguments): every variant alone and
# together, every layout, page sizes 1 and 128, e4m3 K/V, every route and group capacity.
COVERAGE_CASES = [
    ("fused", "gpt-oss", dict(g=8, d=64, dtype=F16)),
    ("split5", "all", dict(g=5, d=96, dtype=F16)),
    ("workqueue", "sinks", dict(g=7, d=96, dtype=BF16, layout="NHD")),
    ("fused", "all", dict(g=16, d=128, dtype=F16, layout="vllm")),
    ("split1", "all", dict(g=3, d=128, dtype=F16)),
    ("fused", "gemma2", dict(g=2, d=256, dtype=BF16, lens=(1, 300, 4097, 6000))),
    ("split5", "window127", dict(g=4, d=128, dtype=F16, layout="combined")),
    ("fused", "cap30", dict(g=12, d=128, dtype=BF16, layout="combined-nhd")),
    ("workqueue", "all", dict(g=3, d=128, dtype=F16, page=1)),
    ("fused", "window0", dict(g=8, d=64, dtype=F16, page=128)),
    ("fused", "gpt-oss", dict(g=3, d=128, dtype=F16, fp8=True)),
    ("split5", "sm_scale", dict(g=16, d=128, dtype=BF16, fp8=True, layout="NHD")),
]
QUICK_COVERAGE = [0, 3, 5, 10]   # gpt-oss at D 64, everything at G 16 packed, Gemma-2 at D 256, e4m3


def _gpu_tests(name: str):
    """A module of tests/gpu (its case builders and checks), imported once."""
    sys.path.insert(0, str(ROOT / "tests" / "gpu"))
    import importlib

    return importlib.import_module(name)


def coverage_case(t: Tally, name: str, route: str, var_name: str, kw: dict) -> None:
    """tests/gpu/test_coverage.py's case built and its FP32 reference computed on the host (no
    torch kernels under the sanitizer beyond copies), the layout's views made on the device,
    then the route's launches (NaN-poisoned out, lse and partial states) and the checks of out
    and lse on the host."""
    cov = _gpu_tests("test_coverage")
    var = cov.VARIANTS[var_name]
    layout = kw.get("layout", "HND")
    cov.DEV = "cpu"
    try:
        c = cov.make_case(var, **{**kw, "layout": "HND"})
        ref = cov.reference_of(c, var)
    finally:
        cov.DEV = DEV
    k, v = cov.as_layout(c.k.to(DEV), c.v.to(DEV), layout)
    moved = {f.name: (x.to(DEV) if isinstance(x, torch.Tensor) else x)
             for f in attrs.fields(type(c)) for x in [getattr(c, f.name)]}
    dev = attrs.evolve(c, **{**moved, "k": k, "v": v})
    out, lse, note = cov.launch(route, dev, var)
    tol = TOL[kw["dtype"]]
    try:
        cov.check(out.cpu(), None if lse is None else lse.cpu(), ref, name, tol)
    except AssertionError as exc:
        t.record(name, False, str(exc).splitlines()[0])
        return
    t.record(name, True, f"out and {'lse' if lse is not None else 'no lse'} within {tol:.0e}; {note}")


def coverage_sweep(t: Tally, quick: bool) -> None:
    for i, (route, var_name, kw) in enumerate(COVERAGE_CASES):
        if quick and i not in QUICK_COVERAGE:
            continue
        if _buildspec.unserved(kw["d"], kw["g"], "e4m3" if kw.get("fp8") else None) is not None:
            continue
        tag = " ".join(f"{k}={v}" for k, v in kw.items() if k not in ("dtype", "lens"))
        t.guarded(f"{route} {var_name} {str(kw['dtype'])[6:]} {tag}", coverage_case, route, var_name, kw)


def sharing_cases() -> list[tuple[str, str, tuple]]:
    """tests/gpu/test_sharing.py's cases the sanitizer runs: (label, test function, arguments)."""
    nested = tuple(_gpu_tests("test_sharing").CASES[2])
    return [
        ("SharedPagesRuntime, nested prefixes, eager", "test_shared_pages_match_the_reference",
         nested + (False, "default")),
        ("SharedPagesRuntime, nested prefixes, 64-head chunks", "test_shared_pages_match_the_reference",
         nested + (False, "wide")),
        ("SharedPagesRuntime, nested prefixes, engine graph",
         "test_shared_pages_match_the_reference", nested + (True, "default")),
        ("find_shared against its twin (300 rows, C 16)", "test_find_shared_kernel_matches_its_twin", (2,)),
        ("SharedPagesRuntime device lengths, nested prefixes",
         "test_device_lengths_shared_pages_match_the_reference", nested + (False,)),
        ("SharedPagesRuntime device lengths, nested prefixes, engine graph",
         "test_device_lengths_shared_pages_match_the_reference", nested + (True,)),
    ]


def gpu_test_case(t: Tally, name: str, module: str, test: str, *args) -> None:
    """One tests/gpu test function called with ``args``: passes, or its assertion is the detail."""
    try:
        getattr(_gpu_tests(module), test)(*args)
    except AssertionError as exc:
        t.record(name, False, str(exc).splitlines()[0])
        return
    t.record(name, True, f"{module}.{test} passed")


# ----------------------------------------------------------------------------- main


def main(argv=None) -> int:
    args = parse_args(argv)
    if (reason := _driver.available()) is not None:
        print(f"sanitize_workload: needs a CUDA GPU: {reason}", file=sys.stderr)
        return 2
    buf, t, t0 = Buffers(poison=args.poison == "nan"), Tally(), time.perf_counter()
    print(f"sanitize_workload: {torch.cuda.get_device_name()}, torch {torch.__version__}, "
          f"{'quick' if args.quick else 'full'}, poison {args.poison}", flush=True)
    decode_sweep(t, QUICK_SHAPES if args.quick else SHAPES, args.quick, buf)
    fp8_sweep(t, args.quick, buf)
    coverage_sweep(t, args.quick)
    for d, dtype, sinks in [(128, F16, True), (96, BF16, False)][:1 if args.quick else 2]:
        t.guarded(f"merge_segments D{d} {str(dtype)[6:]} sinks={sinks}", gpu_test_case, "test_sharing",
                  "test_merge_segments_kernel_matches_torch", dtype, d, sinks)
    for d, dtype in [(64, BF16), (128, F16), (256, BF16)][:1 if args.quick else 3]:
        t.guarded(f"merge alone D{d} {str(dtype)[6:]}", merge_case, d, dtype, buf)
    t.guarded("plan_workqueue_device", device_plan_case, buf)
    if not args.quick:
        t.guarded("graph (device plan + workqueue + merge)", graph_case, buf)
        for r in load_routes().routes:
            if r.kind != "flashinfer" and r.enabled:
                t.guarded(f"Runtime force={r.name}", runtime_case, r.name, buf)
        t.guarded("Runtime device planning, eager layers", runtime_layers_case, buf)
        t.guarded("Runtime FP8 device planning", runtime_fp8_case, buf)
        for name, test, args in sharing_cases():
            t.guarded(name, gpu_test_case, "test_sharing", test, *args)
    torch.cuda.synchronize()
    print(f"sanitize_workload: {t.cases} cases, {t.bad} mismatches "
          f"({time.perf_counter() - t0:.1f} s)", flush=True)
    return 1 if t.bad else 0


if __name__ == "__main__":
    sys.exit(main())
