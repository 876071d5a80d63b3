"""What the build compiles: one spec per kernel family, the targets, and the symbol names.

This file is data. ``setup.py`` executes it (without importing pkvrt or torch) to drive nvcc,
the manifest records what was built from it, and the runtime and the tests read it to know which
kernels must exist. Change a tuning constant here and every consumer sees the same value.
"""

from __future__ import annotations

import hashlib
import json
from pathlib import Path

# Targets: one cubin per SASS arch, plus PTX of the newest arch for the driver's JIT on later chips.
SASS_ARCHS = ("sm_80", "sm_86", "sm_89", "sm_90")
PTX_ARCH = "compute_90"

# Template instantiations compiled into every cubin. Page size is a run-time argument
# (any power of two up to MAX_PAGE_SIZE), so it is not listed here.
DTYPES = {"f16": "__half", "bf16": "__nv_bfloat16"}   # q and out (and K/V, unless below)
# K/V dtypes other than q's that the decode families read: tag -> element type. A decode symbol
# without a K/V tag reads K/V of its q dtype; with one, K/V of that type (float scales [1] or
# [H_kv] in DecodeParams). "e4m3": torch.float8_e4m3fn, 1 byte (kernels/decode_common.cuh).
KV_TAGS = {"e4m3": "pkv::e4m3"}
HEAD_DIMS = (64, 96, 128, 256)
GROUP_SIZES = tuple(range(1, 65))   # G = H_q / H_kv the decode kernels serve
# A decode kernel serves every group size up to its group capacity (the G heads are rows of a
# 16-row mma operand; G itself is a run-time argument): capacity 4 serves G 1..4, 8 serves 5..8
# and 16 serves 9..16 (kernels/decode_common.cuh). 4 and 8 differ only in the fused tail merge.
# 64 serves 17..64 with the wide body (its warps split the heads, 16 each, over K/V tiles they
# share): models of many query heads per KV head, and SharedPagesRuntime's chunks of rows.
GROUP_CLASSES = (4, 8, 16, 64)
PAGE_SIZES = (1, 2, 4, 8, 16, 32, 64, 128)
MAX_PAGE_SIZE = 128
# e4m3 K/V: head dims whose tiles the e4m3 fragment maps cover, and the largest group capacity
# per head dim (at D = 256 capacity 16 would need twice the O^T accumulators in registers).
E4M3_HEAD_DIMS = (64, 128, 256)
E4M3_MAX_CLASS = {64: 64, 128: 64, 256: 8}


# Kernels that ptxas builds with a small spill, accepted with the reason (tests/test_build.py
# checks that no other kernel spills and that these stay within the bytes given):
# (arch, symbol suffix) -> (most spill-store bytes, most stack bytes, reason).
_E4M3_EMULATED = ("e4m3 on sm_80/86 (the bit-shift conversion, no cvt.e4m3x2), split decode at D 64; "
                  "an A100-class path, not the H200's")
ACCEPTED_SPILLS = {
    ("sm_90", "_d256_gc16"): (8, 8, "D 256 at group capacity 16: 64 registers of Q fragments and "
                                    "128 of accumulators; no model of the coverage table has G > 8 "
                                    "at D 256"),
    **{(arch, f"_e4m3_d64_gc{c}"): (12, 16, _E4M3_EMULATED) for arch in ("sm_80", "sm_86") for c in (4, 8)},
    ("sm_90", "pkv_find_shared"): (24, 8, "one CTA of 1024 threads at its 64-register cap, once a "
                                          "step: 4 bytes stored and read back in the device rule's "
                                          "time-model cut of the chunk decode (this machine code "
                                          "passed the whole GPU suite, cec058b)"),
}


def accepted_spill(arch: str, symbol_name: str) -> tuple[int, int]:
    """(spill-store bytes, stack bytes) :data:`ACCEPTED_SPILLS` allows a kernel ((0, 0) for
    every other)."""
    for (a, suffix), (spill, stack, _) in ACCEPTED_SPILLS.items():
        if a == arch and symbol_name.endswith(suffix):
            return spill, stack
    return 0, 0


def group_class(group: int) -> int:
    """The group capacity of the kernels that serve group size ``group`` (KeyError-free:
    ValueError for a group size no kernel serves)."""
    for c in GROUP_CLASSES:
        if 1 <= group <= c:
            return c
    raise ValueError(f"group size {group}: the decode kernels serve 1..{GROUP_CLASSES[-1]}")


def unserved(head_dim: int, group: int, kv_dtype: str | None = None) -> str | None:
    """Why no decode kernel serves (head dim, group size, K/V dtype tag), or None if one does."""
    if head_dim not in HEAD_DIMS:
        return f"head_dim {head_dim} (kernels: {', '.join(map(str, HEAD_DIMS))})"
    if group not in GROUP_SIZES:
        return f"group size {group} (kernels: 1..{GROUP_SIZES[-1]})"
    if kv_dtype == "e4m3":
        if head_dim not in E4M3_HEAD_DIMS:
            return f"e4m3 K/V at head_dim {head_dim} (e4m3 kernels: {', '.join(map(str, E4M3_HEAD_DIMS))})"
        if group_class(group) > E4M3_MAX_CLASS[head_dim]:
            return (f"e4m3 K/V at head_dim {head_dim} with group size {group} (e4m3 kernels at "
                    f"head_dim {head_dim}: group sizes 1..{E4M3_MAX_CLASS[head_dim]})")
    return None


# Tuning constants the kernels are compiled with (passed as -D defines, echoed in the manifest).
# TILE_TOKENS: tokens per pipeline stage; the planners cut split boundaries at multiples of it.
TUNING = {
    "PKV_TILE_TOKENS": 32,
    "PKV_THREADS": 128,
    "PKV_TC_STAGES": 3,         # per-warp K+V stages of the tensor-core body (D < 256)
    "PKV_TC_STAGES_D256": 2,    # the same at D = 256 (2: 128 KB, one CTA per SM; 1: 64 KB, two)
    "PKV_L2_PREFETCH": 0,       # cp.async L2 prefetch hint in bytes: 0, 128 or 256
    "PKV_TAIL_ACQREL": 1,       # fused tail: arrive with one acq_rel atomic (0: two SC fences, the ablation)
    "PKV_TAIL_WIDE_MIN_GROUP": 8,  # fused tail merge: twice the slots in flight from this group capacity (32: never)
    "PKV_WIDE_TWO_TILES": 0,    # wide body (G 17-64), 3-4 head groups: a stage's two tiles in one pass (1: the variant)
}
TILE_TOKENS = TUNING["PKV_TILE_TOKENS"]

# One family per kernels/<family>.cu. "variants" says how its symbols are instantiated.
FAMILIES = {
    "split_decode": {"source": "kernels/split_decode.cu", "variants": "dtype,kv_dtype,head_dim,group"},
    "workqueue_decode": {"source": "kernels/workqueue_decode.cu", "variants": "dtype,kv_dtype,head_dim,group"},
    "fused_decode": {"source": "kernels/fused_decode.cu", "variants": "dtype,kv_dtype,head_dim,group"},
    "merge": {"source": "kernels/merge.cu", "variants": "dtype,head_dim",
              "also": "merge_segments"},   # its second kernel: the merge of shared-page segments
    "plan_workqueue": {"source": "kernels/plan_workqueue.cu", "variants": ""},
    # rows that share pages, found on the GPU (device lengths): pkvrt.SharedPagesRuntime
    "find_shared": {"source": "kernels/find_shared.cu", "variants": ""},
}
HEADERS = ("kernels/decode_common.cuh", "kernels/workqueue_task.cuh", "kernels/plan_cut.cuh")

NVCC_FLAGS = ("-O3", "-std=c++17", "-Xptxas=-v", "-lineinfo")


def symbol(family: str, dtype: str | None = None, head_dim: int | None = None,
           group: int | None = None, kv_dtype: str | None = None) -> str:
    """Exported (extern "C") kernel name, e.g. ``pkv_split_decode_f16_d128_gc4`` (fp16 q, out and
    K/V, group sizes 1..4: ``group`` is the group size, its kernel the one of its
    :func:`group_class`) or, with ``kv_dtype="e4m3"``, ``pkv_split_decode_f16_e4m3_d128_gc4``
    (fp16 q and out, FP8 K/V). ``kv_dtype``: None (K/V of the q dtype) or a :data:`KV_TAGS` tag."""
    if family not in FAMILIES:
        raise KeyError(f"unknown kernel family {family!r}; known: {sorted(FAMILIES)}")
    if not FAMILIES[family]["variants"]:
        return f"pkv_{family}"
    kv = ""
    if kv_dtype is not None:
        if "kv_dtype" not in FAMILIES[family]["variants"]:
            raise ValueError(f"{family} kernels are not instantiated per K/V dtype; pass kv_dtype=None")
        if kv_dtype not in KV_TAGS:
            raise KeyError(f"unknown K/V dtype tag {kv_dtype!r}; known: {sorted(KV_TAGS)}")
        kv = f"_{kv_dtype}"
    name = f"pkv_{family}_{dtype}{kv}_d{head_dim}"
    if "group" in FAMILIES[family]["variants"]:
        if group is None:
            raise ValueError(f"{family} kernels are instantiated per group capacity; pass group=")
        name += f"_gc{group_class(group)}"
    return name


def symbols(family: str) -> list[str]:
    """Every symbol one cubin of ``family`` must export (kernels/decode_common.cuh
    PKV_INSTANTIATE_DECODE: e4m3 per :func:`unserved`)."""
    if not FAMILIES[family]["variants"]:
        return [symbol(family)]
    grouped = "group" in FAMILIES[family]["variants"]
    kvs = (None, *KV_TAGS) if "kv_dtype" in FAMILIES[family]["variants"] else (None,)
    out = []
    for kv in kvs:
        for dt in DTYPES:
            for d in HEAD_DIMS:
                for g in GROUP_CLASSES if grouped else (None,):
                    if grouped and unserved(d, g, kv) is not None:
                        continue
                    out.append(symbol(family, dt, d, g, kv))
    if FAMILIES[family].get("also"):
        out += [f"pkv_{FAMILIES[family]['also']}_{dt}_d{d}" for dt in DTYPES for d in HEAD_DIMS]
    return out


def source_digest(root: Path, family: str, tuning: dict) -> str:
    """What a manifest entry records as ``source_sha256``: the hash of ``family``'s source and
    the shared headers as ``root`` (the repository root) holds them, the nvcc flags and the
    tuning constants the image is compiled with. The build writes it; the driver compares it
    with the checkout's sources before it loads an image (pkvrt/launch/manifest.py)."""
    h = hashlib.sha256()
    for rel in (FAMILIES[family]["source"], *HEADERS):
        h.update((Path(root) / rel).read_bytes())
    h.update(json.dumps([NVCC_FLAGS, tuning], sort_keys=True).encode())
    return h.hexdigest()
