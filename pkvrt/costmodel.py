"""The seed's roofline cost model: predicted µs of one decode step on one route.

    T_r = KVBytes/beta * max(1, C_min/C_r) + L_r*lambda + MergeBytes_r/beta

KVBytes: useful K+V bytes of the step; beta: streaming-read bandwidth; C_r: decode CTA work per
SM of route r; C_min: occupancy target; L_r: launches; lambda: one launch's overhead (eager, or
inside a CUDA-graph replay); MergeBytes_r: partial-state bytes written by decode and read back by
the merge. All constants come from a :class:`pkvrt.calibration.Calibration`; none live here.

Worked example, B8 x 32K on the H200 (DESIGN.md anchors: beta 4120 GB/s, 132 SMs, lambda inside
a graph 1.1 µs; C_min 4), H_q=32, H_kv=8, D=128, fp16, workqueue with 16 splits per row:

    KVBytes    = 8 rows * 32768 tok * 8 kvh * 128 * 2 (K,V) * 2 B = 1_073_741_824 B
    read       = 1_073_741_824 / 4120e3 B/µs                       = 260.6 µs
    C_wq       = 8 * 8 * 16 CTAs / 132 SMs = 7.76 >= 4             -> factor 1
    launches   = 2 (decode + merge) * 1.1 µs                       =   2.2 µs
    MergeBytes = 128 slots * 32 heads * (128*4 + 8) B * 2 (w + r)  = 4_259_840 B -> 1.0 µs
    T_wq       = 260.6 + 2.2 + 1.0                                 = 263.9 µs

FlashInfer splits the KV internally and chooses its own grid, so its C is *not* counted from a
plan: it is a fitted number (``Calibration.flashinfer_ctas_per_sm``, per active count), the C
that makes this model reproduce FlashInfer's measured time. The H200 anchor B8 32K = 290 µs
gives (290 - 1.1) / 260.6 = 1.109 = C_min/C -> C = 3.61 CTAs/SM, so

    T_fi       = 260.6 * 4/3.61 + 1 * 1.1                          = 289.9 µs
    speedup    = 289.9 / 263.9                                     = 1.10x
"""

from __future__ import annotations

import math

from pkvrt.calibration import Calibration


def launch_us(cal: Calibration, *, graphs: bool) -> float:
    """Overhead of one launch: inside a CUDA graph (the runtime) or eager (the seed protocol)."""
    return cal.lambda_graph_us if graphs else cal.lambda_us


def read_us(nbytes: float, cal: Calibration) -> float:
    """µs to stream ``nbytes`` at ``beta_gbps`` (1 GB/s = 1e3 bytes per µs)."""
    return nbytes / (cal.beta_gbps * 1e3)


def route_time_us(*, kv_bytes: float, cta_work_per_sm: float, launches: int, merge_bytes: float,
                  cal: Calibration, graphs: bool) -> float:
    """``T_r`` of the model (module docstring), in µs.

    A route with ``cta_work_per_sm <= 0`` (no CTAs) is infinitely slow; ``kv_bytes`` of 0 costs
    only launches.
    """
    if cta_work_per_sm <= 0:
        return math.inf
    occupancy = max(1.0, cal.c_min / cta_work_per_sm)
    return read_us(kv_bytes, cal) * occupancy + launches * launch_us(cal, graphs=graphs) + read_us(merge_bytes, cal)


def flashinfer_ctas_per_sm(cal: Calibration, *, active: int, num_kv_heads: int) -> float:
    """FlashInfer's modelled decode CTA work per SM at ``active`` rows (a fitted number).

    The calibrated table is interpolated linearly in log2(active) between measured active
    counts and held constant beyond its ends. It is floored by FlashInfer's structural minimum,
    one CTA per (row, KV head): ``active * num_kv_heads / sm_count``.

    Example (seed table {1: 2.63, 8: 3.57}, 28 SMs, 8 KV heads): active 4 sits 2/3 of the way
    from log2 1 = 0 to log2 8 = 3 -> 2.63 + (2/3)*(3.57-2.63) = 3.26; floor 4*8/28 = 1.14 -> 3.26.
    Active 32: table end 3.57, floor 32*8/28 = 9.14 -> 9.14 (no occupancy penalty).
    """
    if active < 1:
        raise ValueError(f"flashinfer_ctas_per_sm: active must be >= 1, got {active}")
    table = cal.flashinfer_ctas_per_sm
    x = math.log2(active)
    if active <= table[0][0]:
        fitted = table[0][1]
    elif active >= table[-1][0]:
        fitted = table[-1][1]
    else:
        for (a0, c0), (a1, c1) in zip(table, table[1:]):
            if a0 <= active <= a1:
                x0, x1 = math.log2(a0), math.log2(a1)
                fitted = c0 + (x - x0) / (x1 - x0) * (c1 - c0)
                break
    return max(fitted, active * num_kv_heads / cal.sm_count)


def predict_us(counters, cal: Calibration, *, graphs: bool) -> float:
    """``T_r`` of a PersistentKV plan from its :class:`pkvrt.planner.Counters`."""
    return route_time_us(kv_bytes=counters.useful_kv_bytes, cta_work_per_sm=counters.cta_work_per_sm,
                         launches=counters.launches, merge_bytes=counters.merge_bytes, cal=cal, graphs=graphs)


def predict_flashinfer_us(counters, cal: Calibration, *, active: int, num_kv_heads: int, graphs: bool) -> float:
    """``T_fi``: the model with FlashInfer's fitted C (``flashinfer_ctas_per_sm``) and its counters."""
    c = flashinfer_ctas_per_sm(cal, active=active, num_kv_heads=num_kv_heads)
    return route_time_us(kv_bytes=counters.useful_kv_bytes, cta_work_per_sm=c, launches=counters.launches,
                         merge_bytes=counters.merge_bytes, cal=cal, graphs=graphs)
