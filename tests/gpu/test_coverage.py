"""The generalized decode kernels on the GPU (run on the H200): every group size 1..16, head dims
64/96/128/256, page sizes 1..128, fp16/bf16, e4m3 K/V, the HND / NHD / combined / vLLM-packed
cache layouts, and the attention variants (sliding window, soft cap, sinks, sm_scale, lse),
kernel by kernel and through the Runtime, against the FP32 twins of pkvrt.reference.

Data: tests/paged.py::make_batch (scattered pages, NaN in every slot no row owns and in each
row's tail, block-table padding out of range). Outputs, lse and partial states are NaN before
each launch, so an element left unwritten fails. With a sliding window, every block-table entry
of a page wholly before a row's window points at a NaN page (a kernel that reads it fails); the
tokens before the window in the window's first page are real values, which a kernel that
attends to them gets wrong by far more than the tolerance.

Sizes are small (H_kv 1-8, 3-5 rows, one of a few thousand tokens) and batches are cached per
shape across routes and variants: the whole file is meant to take well under a minute.
"""

from __future__ import annotations

import functools
import warnings

import attrs
import numpy as np
import pytest
import torch

from paged import make_batch, rel_err
from pkvrt import _buildspec, reference
from pkvrt.launch import ops
from pkvrt.policy import planner
from pkvrt.policy.calibration import find_calibration
from pkvrt.policy.registry import load_routes
from pkvrt.runtime import Runtime
from pkvrt.runtime.options import with_options

pytestmark = pytest.mark.gpu

DEV = "cuda"   # (a CPU dry run of this file's logic sets it to "cpu" with emulated kernels)
NAN = float("nan")
FP8 = torch.float8_e4m3fn
F16, BF16 = torch.float16, torch.bfloat16
TOL = {F16: 2e-3, BF16: 1e-2}     # rel. Frobenius error vs FP32 (tests/gpu/test_kernels.py's)
LSE_TOL = 1e-3                      # |lse - ref| <= LSE_TOL * max(1, |ref|)
LENS = (1, 17, 300, 2100, 3500)     # ragged: one token, < one tile, a few pages, long rows
ROUTES = ("split1", "split5", "workqueue", "fused")
# the fused kernel's two-level tail: the longest row cut in 23 splits (groups of 5: 5, 5, 5, 5, 3),
# every row of at least 2 splits merged in two levels where the kernel has them (G 5-16 at
# D 96-256; one level elsewhere)
TWO_LEVEL = "fused-2level"
TWO_LEVEL_SPLITS = 23
ROUTES_TOML = load_routes()


# ----------------------------------------------------------------------------- variants


@attrs.frozen
class Variant:
    """An attention variant: window_left (-1: none), soft cap (0: none), sinks (random float32
    [H_q], every 5th head +12 or +16: the sink dominates those heads), sm_scale (None: 1/sqrt(D)),
    lse (request and check it), and the q/K scale of the data (scores ~ scale^2 N(0, 1): 3 makes
    a cap of 30 bite)."""

    window_left: int = -1
    cap: float = 0.0
    sinks: bool = False
    sm_scale: float | None = None
    lse: bool = False
    scale: float = 1.0


VARIANTS = {
    "plain": Variant(),
    "lse": Variant(lse=True),
    "window0": Variant(window_left=0, lse=True),
    "window127": Variant(window_left=127),
    "window1000": Variant(window_left=1000, lse=True),
    "cap50": Variant(cap=50.0, scale=3.0),
    "cap30": Variant(cap=30.0, lse=True, scale=3.0),
    "sinks": Variant(sinks=True, lse=True),
    "sm_scale": Variant(sm_scale=168 ** -0.5, lse=True),
    "all": Variant(window_left=1000, cap=30.0, sinks=True, sm_scale=168 ** -0.5, lse=True, scale=2.0),
    # the models' combinations: gpt-oss (window 128 + sinks), Gemma-2 (window 4096 + cap 50)
    "gpt-oss": Variant(window_left=127, sinks=True, lse=True),
    "gemma2": Variant(window_left=4095, cap=50.0, sm_scale=144 ** -0.5, lse=True, scale=2.0),
}
GEMMA_LENS = (1, 300, 4097, 6000)   # 4097: the window starts at token 1; 6000: at 1904


@functools.lru_cache(maxsize=None)
def calibration():
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")   # the fallback warning on a GPU without a calibration file
        return find_calibration(torch.cuda.get_device_name())


@functools.lru_cache(maxsize=None)
def sinks_for(hq: int, seed: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    s = torch.randn(hq, generator=g) * 2
    s[0::5] = 12.0      # e^12 against the ~e^9 of a 3500-token row's scores: the sink dominates
    s[2::5] = 16.0
    return s.to(DEV)


def unowned_page(b) -> int:
    """A page no row owns: every slot NaN (make_batch)."""
    return int(torch.nonzero(~b.owned)[0].item())


def windowed_tables(bt: torch.Tensor, lens, window_left: int, page: int, nan_page: int) -> torch.Tensor:
    """block tables whose entries for pages wholly before each row's window point at ``nan_page``."""
    bt = bt.clone()
    if window_left >= 0:
        for i, n in enumerate(lens):
            first = reference.window_start(int(n), window_left) // page
            if first:
                bt[i, :first] = nan_page
    return bt


# ----------------------------------------------------------------------------- data


@functools.lru_cache(maxsize=None)
def paged(lens: tuple, hq: int, hkv: int, d: int, page: int, dtype, seed: int, scale: float = 1.0,
          hole_fraction: float = 0.5):
    """make_batch, cached across routes and variants (nothing here writes into it)."""
    return make_batch(list(lens), num_qo_heads=hq, num_kv_heads=hkv, head_dim=d, page_size=page,
                      dtype=dtype, device=DEV, seed=seed, scale=scale, hole_fraction=hole_fraction)


@attrs.frozen(eq=False)
class Case:
    """What a kernel is given: q, k, v (as the kernels index them: [P, H_kv, page, D] views of
    the layout's tensors), k_ref, v_ref the same values in HND for the reference (FP8: the e4m3
    caches, with scales), seq, bt (windowed), sinks or None."""

    q: torch.Tensor
    k: torch.Tensor
    v: torch.Tensor
    k_ref: torch.Tensor
    v_ref: torch.Tensor
    seq: torch.Tensor
    bt: torch.Tensor
    sinks: torch.Tensor | None
    k_scale: torch.Tensor | None = None
    v_scale: torch.Tensor | None = None


def as_layout(k: torch.Tensor, v: torch.Tensor, layout: str):
    """HND caches [P, H_kv, page, D] rebuilt in ``layout`` and returned as the kernels take them:
    HND as is; NHD [P, page, H_kv, D] transposed; FlashInfer's combined [P, 2, H_kv, page, D]
    ("combined") and [P, 2, page, H_kv, D] ("combined-nhd") as kv[:, 0] / kv[:, 1]; vLLM's packed
    [blocks, block, H_kv, 2D] as kv[..., :D] / kv[..., D:], transposed."""
    d = k.shape[3]
    if layout == "HND":
        return k, v
    if layout == "NHD":
        return (k.transpose(1, 2).contiguous().transpose(1, 2),
                v.transpose(1, 2).contiguous().transpose(1, 2))
    if layout == "combined":
        kv = torch.stack([k, v], 1)
        return kv[:, 0], kv[:, 1]
    if layout == "combined-nhd":
        kv = torch.stack([k.transpose(1, 2), v.transpose(1, 2)], 1)          # [P, 2, page, H, D]
        return kv[:, 0].transpose(1, 2), kv[:, 1].transpose(1, 2)
    if layout == "vllm":
        kv = torch.cat([k.transpose(1, 2), v.transpose(1, 2)], -1).contiguous()   # [P, page, H, 2D]
        return kv[..., :d].transpose(1, 2), kv[..., d:].transpose(1, 2)
    raise ValueError(layout)


def make_case(var: Variant, *, g: int, d: int, dtype, lens=LENS, hkv: int = 2, page: int = 16,
              layout: str = "HND", fp8: bool = False, seed: int = 0) -> Case:
    hq = g * hkv
    if fp8:   # float32 values quantized per KV head (K) / per tensor (V); q in dtype
        b = paged(tuple(lens), hq, hkv, d, page, torch.float32, seed, var.scale)
        k, ks = reference.quantize_kv(b.k_cache, per_head=True)
        v, vs = reference.quantize_kv(b.v_cache, per_head=False)
        q = b.q.to(dtype)
    else:
        b = paged(tuple(lens), hq, hkv, d, page, dtype, seed, var.scale)
        k, v, q, ks, vs = b.k_cache, b.v_cache, b.q, None, None
    bt = windowed_tables(b.block_tables, lens, var.window_left, page, unowned_page(b))
    kk, vv = as_layout(k, v, layout)
    return Case(q=q, k=kk, v=vv, k_ref=k, v_ref=v, seq=b.seq_lens, bt=bt,
                sinks=sinks_for(hq, seed) if var.sinks else None, k_scale=ks, v_scale=vs)


def reference_of(c: Case, var: Variant):
    return reference.decode_attention(c.q, c.k_ref, c.v_ref, c.seq, c.bt, var.sm_scale,
                                      k_scale=c.k_scale, v_scale=c.v_scale,
                                      window_left=var.window_left, logits_soft_cap=var.cap,
                                      sinks=c.sinks, return_lse=True)


# ----------------------------------------------------------------------------- launches


def host_plan(c: Case, route: str, window_left: int):
    """The host twin's workqueue (or fused) plan of the case's lengths (the two-level route's:
    the longest row in TWO_LEVEL_SPLITS splits)."""
    r = ROUTES_TOML.route("pkv_fused" if route in ("fused", TWO_LEVEL) else "pkv_workqueue")
    return planner.plan_workqueue(c.seq.cpu().numpy(), num_kv_heads=c.k.shape[1],
                                  num_qo_heads=c.q.shape[1], head_dim=c.q.shape[2],
                                  dtype_bytes=c.k.element_size(), splits=r.splits,
                                  cal=calibration(), kind=r.kind, window_left=window_left,
                                  longest_splits=TWO_LEVEL_SPLITS if route == TWO_LEVEL else None)


def launch(route: str, c: Case, var: Variant):
    """One route's launches on NaN-poisoned out / lse / partial states. Returns (out, lse or None,
    a note for failure messages)."""
    b, hq, d = c.q.shape
    hkv = c.k.shape[1]
    i32 = dict(dtype=torch.int32, device=DEV)
    out = torch.full_like(c.q, NAN)
    lse = torch.full((b, hq), NAN, device=DEV) if var.lse else None
    sk = dict(k_scale=c.k_scale, v_scale=c.v_scale) if c.k_scale is not None else {}
    var_kw = dict(logits_soft_cap=var.cap, sinks=c.sinks, lse=lse)   # where O is written
    tail = dict(sinks=c.sinks, lse=lse)                               # the merge's
    if route.startswith("split"):
        s = int(route[5:])
        rows = torch.arange(b, **i32)
        pa = torch.full((b * s, hq, d), NAN, device=DEV)
        pm = torch.full((b * s, hq, 2), NAN, device=DEV)
        ops.split_decode(c.q, c.k, c.v, c.seq, c.bt, rows, s, out, pa, pm, var.sm_scale,
                         window_left=var.window_left, **var_kw, **sk)
        if s > 1:
            ops.merge(pa, pm, torch.arange(b + 1, **i32) * s, out, row_ids=rows, **tail)
        note = f"{s} splits"
    else:
        plan = host_plan(c, route, var.window_left)
        tasks, num, offs, pa, pm = ops.workqueue_tensors(plan, num_qo_heads=hq, head_dim=d, device=DEV)
        tasks = torch.cat([tasks, torch.full((7, 5), -1, **i32)])   # idle grid slots past num_tasks
        pa.fill_(NAN)
        pm.fill_(NAN)
        counters = torch.zeros(b, hkv, **i32) if route != "workqueue" else None
        # fused: as the Runtime launches it (two levels where the kernel's rule says); the
        # two-level route: from 2 splits
        two = (dict(group_counters=torch.zeros(pa.shape[0], hkv, **i32),
                    merge_groups_from=2 if route == TWO_LEVEL else 0) if route != "workqueue" else {})
        ops.workqueue_decode(c.q, c.k, c.v, c.seq, c.bt, tasks, num, offs, out, pa, pm, var.sm_scale,
                             counters=counters, **two, **var_kw, **sk)
        if route == "workqueue":
            ops.merge(pa, pm, offs, out, skip_single=True, **tail)
        note = f"splits per row {plan.num_splits.tolist()}"
        if counters is not None:
            torch.cuda.synchronize()
            assert int(counters.abs().sum()) == 0, "fused: completion counters not reset"
            if two:
                assert int(two["group_counters"].abs().sum()) == 0, "fused: group counters not reset"
    torch.cuda.synchronize()
    return out, lse, note


def check(out, lse, ref, what: str, tol: float) -> None:
    ref_out, ref_lse = ref
    assert not torch.isnan(out).any(), f"{what}: NaN in out (an element not written, or a poisoned read)"
    err = rel_err(out, ref_out)
    assert err < tol, f"{what}: rel. error {err:.2e} >= {tol}"
    if lse is not None:
        assert not torch.isnan(lse).any(), f"{what}: NaN in lse (not written, or a poisoned read)"
        bad = (lse - ref_lse).abs() > LSE_TOL * ref_lse.abs().clamp(min=1.0)
        assert not bad.any(), (f"{what}: lse differs at [row, head] {bad.nonzero().tolist()[:8]}: "
                               f"got {lse[bad][:4].tolist()}, want {ref_lse[bad][:4].tolist()}")


class Soft:
    """Collects the failed checks of a loop (steps, layers, routes) so that one run reports all of
    them, not the first; ``done()`` fails with the list."""

    def __init__(self):
        self.errors: list[str] = []

    def check(self, *args, **kw) -> bool:
        try:
            check(*args, **kw)
        except AssertionError as e:
            self.errors.append(str(e).splitlines()[0])
            return False
        return True

    def expect(self, ok: bool, what: str) -> bool:
        if not ok:
            self.errors.append(what)
        return ok

    def done(self) -> None:
        assert not self.errors, f"{len(self.errors)} failed checks:\n" + "\n".join(self.errors)


def run_case(route, var_name, *, g, d, dtype, **kw):
    var = VARIANTS[var_name]
    c = make_case(var, g=g, d=d, dtype=dtype, **kw)
    out, lse, note = launch(route, c, var)
    check(out, lse, reference_of(c, var), f"{route} {var_name} G={g} D={d} {dtype} {kw} ({note})",
          TOL[dtype])


# ----------------------------------------------------------------------------- kernels: G x D


def _gd_cases():
    cases = [(g, 128, F16) for g in (1, 2, 3, 4, 5, 7, 8, 9, 12, 16)]
    cases += [(g, d, F16) for d in (64, 96, 256) for g in (1, 5, 16)]
    cases += [(3, 128, BF16), (9, 128, BF16), (16, 128, BF16), (5, 64, BF16), (1, 96, BF16),
              (16, 256, BF16)]
    # the wide body (capacity 64): two head groups and two token streams (17..32), three
    # (33..48, one warp only copies), four (49..64)
    cases += [(g, 128, F16) for g in (17, 24, 32, 33, 48, 64)]
    cases += [(g, d, F16) for d in (64, 96, 256) for g in (20, 64)]
    cases += [(32, 128, BF16), (64, 128, BF16), (40, 256, BF16)]
    return [pytest.param(g, d, dt, id=f"g{g}-d{d}-{str(dt)[6:]}") for g, d, dt in cases
            if _buildspec.unserved(d, g) is None]


@pytest.mark.parametrize("variant", ["plain", "all"])
@pytest.mark.parametrize("route", ROUTES + (TWO_LEVEL,))
@pytest.mark.parametrize("g, d, dtype", _gd_cases())
def test_every_group_size_and_head_dim(g, d, dtype, route, variant):
    """Every group capacity (4, 8, 16, 64) at G at and between its bounds, every head dim, two KV
    heads; plain attention and everything at once (window 1000 + cap 30 + sinks + sm_scale
    168^-0.5 + lse); the fused kernel's tail in one level (its warps' heads at once where they
    fit, G 5-16 at D 96-256) and in two."""
    run_case(route, variant, g=g, d=d, dtype=dtype, seed=100 * g + d)


# ----------------------------------------------------------------------------- page sizes


@pytest.mark.parametrize("route", ROUTES)
@pytest.mark.parametrize("page", [1, 16, 64, 128])
@pytest.mark.parametrize("g, d, variant", [(3, 128, "all"), (16, 64, "plain"), (8, 256, "window127"),
                                           (48, 128, "all")],
                         ids=["g3-d128-all", "g16-d64-plain", "g8-d256-window127", "g48-d128-all"])
def test_page_sizes(g, d, variant, page, route):
    run_case(route, variant, g=g, d=d, dtype=F16, page=page, seed=7 * page + g)


# ----------------------------------------------------------------------------- layouts


@pytest.mark.parametrize("route", ROUTES)
@pytest.mark.parametrize("layout", ["NHD", "combined", "combined-nhd", "vllm"])
@pytest.mark.parametrize("g, d, dtype, variant", [(4, 128, F16, "all"), (7, 96, BF16, "plain"),
                                                  (16, 64, F16, "sinks"), (2, 256, BF16, "window127"),
                                                  (32, 128, F16, "all")],
                         ids=["g4-d128-all", "g7-d96-bf16", "g16-d64-sinks", "g2-d256-bf16-window",
                              "g32-d128-all"])
def test_cache_layouts(g, d, dtype, variant, layout, route):
    """Strided caches: NHD as a transposed view, FlashInfer's combined tensors (HND and NHD) as
    kv[:, 0] / kv[:, 1], vLLM's K/V packed in the last dimension."""
    run_case(route, variant, g=g, d=d, dtype=dtype, layout=layout, seed=11 + g)


def test_layout_views_are_what_they_claim():
    """The views above are strided views of one tensor, not copies (checked where it is cheap)."""
    b = paged(LENS[:3], 8, 2, 128, 16, F16, 5)
    for layout in ("NHD", "combined", "combined-nhd", "vllm"):
        k, v = as_layout(b.k_cache, b.v_cache, layout)
        assert k.shape == b.k_cache.shape and torch.equal(k.nan_to_num(7.0), b.k_cache.nan_to_num(7.0))
        assert not k.is_contiguous() or layout == "combined"
        if layout != "NHD":
            assert k.untyped_storage().data_ptr() == v.untyped_storage().data_ptr(), layout


# ----------------------------------------------------------------------------- variants


VARIANT_CASES = [
    pytest.param("window0", 4, 128, F16, LENS, id="window0"),
    pytest.param("window127", 4, 128, F16, LENS, id="window127"),
    pytest.param("window1000", 4, 128, BF16, LENS, id="window1000-bf16"),
    pytest.param("cap50", 4, 128, F16, LENS, id="cap50"),
    pytest.param("cap30", 12, 128, BF16, LENS, id="cap30-g12-bf16"),
    pytest.param("sinks", 4, 128, F16, LENS, id="sinks"),
    pytest.param("sinks", 16, 128, F16, LENS, id="sinks-g16"),
    pytest.param("sm_scale", 5, 128, F16, LENS, id="sm_scale-g5"),
    pytest.param("lse", 1, 64, F16, LENS, id="lse-g1-d64"),
    pytest.param("gpt-oss", 8, 64, BF16, LENS, id="gpt-oss-g8-d64"),
    pytest.param("gemma2", 2, 256, BF16, GEMMA_LENS, id="gemma2-g2-d256"),
]


@pytest.mark.parametrize("route", ROUTES)
@pytest.mark.parametrize("variant, g, d, dtype, lens", VARIANT_CASES)
def test_attention_variants(variant, g, d, dtype, lens, route):
    """Each variant alone (windows shorter and longer than rows: window 0 keeps one token and
    leaves the other splits of split5 empty), then the models' combinations."""
    run_case(route, variant, g=g, d=d, dtype=dtype, lens=lens, seed=3 + g + d)


def test_sinks_dominate_where_they_are_large():
    """The +12 / +16 sinks shrink their heads' outputs by more than 10x against the same heads
    without sinks (so the variant tests above check a sink that matters), and lse ignores them."""
    var, plain = VARIANTS["sinks"], VARIANTS["lse"]
    c = make_case(var, g=4, d=128, dtype=F16, seed=21)
    with_sinks, lse_s, _ = launch("fused", c, var)
    without, lse_p, _ = launch("fused", attrs.evolve(c, sinks=None), plain)
    big = c.sinks > 10
    ratio = with_sinks[:, big].float().norm() / without[:, big].float().norm()
    assert ratio < 0.1, ratio
    assert torch.allclose(lse_s, lse_p, rtol=1e-5, atol=1e-5)


# ----------------------------------------------------------------------------- e4m3 K/V


@pytest.mark.parametrize("route", ROUTES)
@pytest.mark.parametrize("variant", ["plain", "gpt-oss", "cap30"])
@pytest.mark.parametrize("g, d, dtype", [(3, 128, F16), (12, 128, BF16), (16, 128, F16), (5, 256, F16),
                                         (32, 128, F16), (64, 128, BF16), (40, 64, F16)],
                         ids=["g3-d128", "g12-d128-bf16", "g16-d128", "g5-d256", "g32-d128",
                              "g64-d128-bf16", "g40-d64"])
def test_e4m3_kv(g, d, dtype, variant, route):
    """FP8 K/V (K scales per KV head, V per tensor) against the reference over the dequantized
    caches, at the new group sizes and at D 256 with G 5 (capacity 8, the largest e4m3 serves)."""
    assert _buildspec.unserved(d, g, "e4m3") is None
    run_case(route, variant, g=g, d=d, dtype=dtype, fp8=True, seed=31 + g)


def test_e4m3_nhd_layout():
    for route in ROUTES:
        run_case(route, "window127", g=12, d=128, dtype=F16, fp8=True, layout="NHD", seed=41)


# ----------------------------------------------------------------------------- device planning


@pytest.mark.parametrize("kind", ["workqueue", "fused"])
@pytest.mark.parametrize("window_left", [0, 127, 1000, 4095])
def test_device_plan_with_a_window_equals_the_host_plan(window_left, kind):
    """plan_workqueue_device(window_left=w) writes the tasks, offsets and split counts of
    planner.plan_workqueue(..., window_left=w) (the same order), checks only the page ids of each
    row's window (entries before it hold -1 and ids past the cache: status stays 0), and, in
    direct mode, copies only those entries; then the decode over that plan is exact."""
    rng = np.random.default_rng(window_left + (kind == "fused"))
    hkv, page, max_rows = 2, 16, 16
    seq = np.r_[1, 17, window_left + 1, window_left + 2, rng.integers(1, 9000, 6)].astype(np.int32)
    b = len(seq)
    route = ROUTES_TOML.route("pkv_fused" if kind == "fused" else "pkv_workqueue")
    cal = calibration()
    host = planner.plan_workqueue(seq, num_kv_heads=hkv, num_qo_heads=4 * hkv, head_dim=128,
                                  dtype_bytes=2, splits=route.splits, cal=cal, kind=route.kind,
                                  window_left=window_left)
    width = -(-int(seq.max()) // page) + 3
    num_pages = 4000
    src = torch.as_tensor(rng.integers(0, num_pages, (b, width)), dtype=torch.int32)
    for i, n in enumerate(seq.tolist()):        # entries before the window: never checked
        first = reference.window_start(n, window_left) // page
        src[i, :first] = torch.as_tensor(np.where(np.arange(first) % 2, -1, num_pages + 9), dtype=torch.int32)
    i32 = dict(dtype=torch.int32, device=DEV)
    cand = torch.tensor(route.splits.candidates(), **i32)
    kw = dict(num_kv_heads=hkv, min_split_tiles=-(-cal.splits.min_split_tokens // 32),
              num_pages=torch.tensor([num_pages], **i32), page_size=page,
              window_left=window_left, **planner.device_plan_targets(cal, route.kind))
    got = []
    for direct in (False, True):
        cap = max_rows * hkv * 64
        bufs = dict(tasks=torch.full((cap, 5), -7, **i32), num_tasks=torch.zeros(1, **i32),
                    split_offsets=torch.zeros(max_rows + 1, **i32),
                    num_splits=torch.zeros(max_rows, **i32), status=torch.full((1,), -1, **i32))
        seq_dev = torch.full((max_rows,), -3, **i32)
        bt = torch.full((max_rows, width), -9, **i32)
        if direct:
            extra = dict(src_seq_lens=torch.as_tensor(seq).to(DEV), src_block_tables=src.to(DEV),
                         rows=b, max_seq=width * page)
            rows, max_len = torch.zeros(1, **i32), torch.zeros(1, **i32)
        else:
            seq_dev[:b] = torch.as_tensor(seq)
            bt[:b] = src
            extra = {}
            rows, max_len = torch.tensor([b], **i32), torch.tensor([width * page], **i32)
        ops.plan_workqueue_device(seq_dev, rows, bufs["tasks"], bufs["num_tasks"], bufs["split_offsets"],
                                  bufs["num_splits"], bufs["status"], cand, max_seq_len=max_len,
                                  block_tables=bt, **kw, **extra)
        torch.cuda.synchronize()
        what = f"{'direct' if direct else 'copied'} window_left={window_left} {kind}"
        assert int(bufs["status"][0]) == 0, f"{what}: status {int(bufs['status'][0])}"
        np.testing.assert_array_equal(bufs["num_splits"].cpu().numpy()[:b], host.num_splits, err_msg=what)
        np.testing.assert_array_equal(bufs["split_offsets"].cpu().numpy()[:b + 1], host.split_offsets,
                                      err_msg=what)
        n = int(bufs["num_tasks"][0])
        np.testing.assert_array_equal(bufs["tasks"].cpu().numpy()[:n], host.tasks, err_msg=what)
        if direct:
            bt_d = bt.cpu()
            for i, n_i in enumerate(seq.tolist()):
                first, used = reference.window_start(n_i, window_left) // page, -(-n_i // page)
                assert torch.equal(bt_d[i, first:used], src[i, first:used]), (what, i)
                assert (bt_d[i, :first] == -9).all() and (bt_d[i, used:] == -9).all(), (what, i)
        got.append(bufs)

    # the decode over the device plan (pre-window pages: a NaN page; tasks from the planner)
    var = Variant(window_left=window_left, sinks=True, lse=True)
    pb = paged(tuple(seq.tolist()), 4 * hkv, hkv, 128, page, F16, 51)
    c = Case(q=pb.q, k=pb.k_cache, v=pb.v_cache, k_ref=pb.k_cache, v_ref=pb.v_cache, seq=pb.seq_lens,
             bt=windowed_tables(pb.block_tables, seq.tolist(), window_left, page, unowned_page(pb)),
             sinks=sinks_for(4 * hkv, 51))
    bufs = got[0]
    out = torch.full_like(c.q, NAN)
    lse = torch.full((b, 4 * hkv), NAN, device=DEV)
    slots = int(host.split_offsets[-1])
    pa = torch.full((slots, 4 * hkv, 128), NAN, device=DEV)
    pm = torch.full((slots, 4 * hkv, 2), NAN, device=DEV)
    offs = bufs["split_offsets"][:b + 1]
    counters = torch.zeros(b, hkv, **i32) if kind == "fused" else None
    ops.workqueue_decode(c.q, c.k, c.v, c.seq, c.bt, bufs["tasks"], bufs["num_tasks"], offs, out, pa, pm,
                         counters=counters, sinks=c.sinks, lse=lse)
    if kind == "workqueue":
        ops.merge(pa, pm, offs, out, skip_single=True, sinks=c.sinks, lse=lse)
    torch.cuda.synchronize()
    check(out, lse, reference_of(c, var), f"decode over the device plan, window_left={window_left} {kind}",
          TOL[F16])


# ----------------------------------------------------------------------------- Runtime


def _runtime(*shape, **kw):
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")   # the calibration fallback warning on a GPU with no file
        return Runtime(*shape, **with_options(dict(dict(max_batch=8), **kw)))


# host: the router (FlashInfer off: a FlashInfer instantiation per variant costs ~40 s of JIT and
# is FlashInfer's coverage, not this file's), then each PersistentKV route forced in turn.
MODES = {
    "host": dict(flashinfer=False),
    "device-graphs": dict(device_planning=True),
    "device-eager": dict(device_planning=True, use_cuda_graph=False),
}
HOST_FORCES = (None, "pkv_bucket", "pkv_workqueue", "pkv_fused")


@attrs.frozen
class Model:
    """An attention shape and its Runtimes' variants. ``runtimes``: the Runtime keywords of each
    layer kind (gpt-oss: a sliding-window Runtime and a full one); ``layers``: the kind of each
    layer; ``layouts``: the caches each layer is given (NHD, vLLM-packed: views)."""

    hq: int
    hkv: int
    d: int
    dtype: torch.dtype
    lens: tuple
    runtimes: tuple = (dict(),)
    layers: tuple = (0, 0)
    layouts: tuple = ("HND", "HND")
    kv_layout: str = "HND"
    hole_fraction: float = 0.5


MODELS = {
    "gpt-oss": Model(64, 8, 64, BF16, (1, 100, 2100, 5000),
                     runtimes=(dict(window_left=127, sinks=True), dict(sinks=True)), layers=(0, 1)),
    "gemma2": Model(16, 8, 256, BF16, GEMMA_LENS,
                    runtimes=(dict(window_left=4095, logits_soft_cap=50.0, sm_scale=144 ** -0.5),),
                    layouts=("NHD", "vllm"), kv_layout="NHD", hole_fraction=0.25),
    "qwen2.5-7b": Model(28, 4, 128, BF16, (1, 17, 2100, 5000)),
    "qwen3-235b": Model(64, 4, 128, BF16, (1, 17, 2100, 5000)),
    "phi3": Model(32, 32, 96, F16, (1, 300, 900, 2100)),
}
PAGE = 16
STEPS = (((0, 1, 2), 3), ((0, 1, 2, 3), 0))   # (pool rows, tokens short of the pool's lengths)


@functools.lru_cache(maxsize=None)
def model_pool(name: str):
    """Two layers of paged KV for the model's pool of rows (same pages, other values; every NaN
    of the first layer's caches at the same place in the second's) and each layer's sinks."""
    m = MODELS[name]
    b = paged(m.lens, m.hq, m.hkv, m.d, PAGE, m.dtype, 2026, 1.0, m.hole_fraction)
    gen = torch.Generator(device=DEV).manual_seed(7)
    second = []
    for c in (b.k_cache, b.v_cache):
        x = torch.randn(c.shape, generator=gen, device=DEV).to(m.dtype)
        x[torch.isnan(c)] = NAN
        second.append(x)
    hnd = [(b.k_cache, b.v_cache), tuple(second)]
    layers = [layer_caches(m, hnd[i], i) for i in range(2)]
    sinks = [sinks_for(m.hq, 60 + i) for i in range(2)]
    return b, hnd, layers, sinks


def layer_caches(m: Model, hnd, layer: int):
    """A layer's caches as its run() is given them (the Runtime's kv_layout) and as the reference
    reads them (HND views of the same tensors). Built once per layer: a graph bakes them in."""
    k, v = as_layout(*hnd, m.layouts[layer])   # [P, H_kv, page, D] views of the layout's tensors
    given = (k, v) if m.kv_layout == "HND" else (k.transpose(1, 2), v.transpose(1, 2))
    return given, (k, v)


def step_inputs(m: Model, b, rows, short, seed):
    seq = np.array([max(1, m.lens[r] - short) for r in rows], dtype=np.int32)
    bt = b.block_tables[list(rows)]
    gen = torch.Generator(device=DEV).manual_seed(seed)
    q = torch.randn(len(rows), m.hq, m.d, generator=gen, device=DEV).to(m.dtype)
    return seq, bt, q


def plan_args(mode: str, seq, bt):
    if mode.startswith("device"):
        return torch.as_tensor(seq, device=DEV), bt.to(DEV)
    return seq, bt.cpu().numpy()


@pytest.mark.parametrize("mode", list(MODES))
@pytest.mark.parametrize("model", list(MODELS))
def test_runtime_models(model, mode):
    """Decode steps of 3 and 4 rows, two layers each, through one Runtime per layer kind, in each
    mode (host routing: the router's choice and each PersistentKV route forced; device planning,
    graphs on and off): every layer's output (and lse: second layer of the 4-row step; a 3-row
    step's lse is test_runtime_lse_of_a_padded_batch's) against the reference with the Runtime's
    variant. Every failed check is reported, not only the first. gpt-oss: a sliding-window layer (128 tokens, sinks) and a full one
    (sinks); Gemma-2: window 4096 + cap 50 + sm_scale 144^-0.5 on NHD caches (a contiguous one,
    then vLLM's packed K/V); Qwen2.5-7B (G 7), Qwen3-235B (G 16), Phi-3 (D 96)."""
    m = MODELS[model]
    b, _, layers, sinks = model_pool(model)
    nan_page = unowned_page(b)
    width = b.block_tables.shape[1]
    rts = [_runtime(m.hq, m.hkv, m.d, PAGE, m.dtype, kv_layout=m.kv_layout, max_pages_per_row=width,
                    **MODES[mode], **kw) for kw in m.runtimes]
    forces = HOST_FORCES if mode == "host" else (None,)
    soft = Soft()
    for force in forces:
        for i, (rows, short) in enumerate(STEPS):
            seq, bt_full, q0 = step_inputs(m, b, rows, short, seed=10 * i + len(forces))
            tables = []
            for rt in rts:
                bt = windowed_tables(bt_full, seq.tolist(), rt.window_left, PAGE, nan_page)
                d = rt.plan(*plan_args(mode, seq, bt), force=force)
                assert force is None or d.route == force
                tables.append(bt)
            for layer, kind in enumerate(m.layers):
                rt, bt = rts[kind], tables[kind]
                given, ref_kv = layers[layer]
                q = q0 * (1 + 0.5 * layer)
                out = torch.full_like(q, NAN)
                want_lse = layer == 1 and len(rows) == 4
                lse = torch.full((len(rows), m.hq), NAN, device=DEV) if want_lse else None
                s = sinks[layer] if rt.sinks else None
                res = rt.run(q, *given, out=out, sinks=s, lse=lse)
                soft.expect(res is out, f"{model} {mode} force={force} step {i} layer {layer}: run() "
                                        f"returned {type(res)}, not out")
                torch.cuda.synchronize()
                ref = reference.decode_attention(q, *ref_kv, torch.as_tensor(seq, device=DEV), bt.to(DEV),
                                                 rt.sm_scale, window_left=rt.window_left,
                                                 logits_soft_cap=rt.logits_soft_cap, sinks=s,
                                                 return_lse=True)
                what = (f"{model} {mode} force={force} step {i} layer {layer} route "
                        f"{rt.last_decision.route if rt.last_decision else '?'}")
                soft.check(out, lse, ref, what, TOL[m.dtype])
            if rts[0].device_planning:
                for rt in rts:
                    status = rt.device_status(raise_on_error=False)
                    soft.expect(status == 0, f"{model} {mode} step {i}: device_status {status}")
    if mode == "device-graphs":   # the second step replays (a layer given fresh lse may capture)
        soft.expect(sum(rt.stats()["replays"] for rt in rts) > 0, "no graph replayed")
    soft.done()


@pytest.mark.parametrize("mode", ["host-graphs", "host-eager", "device-graphs", "device-eager"])
def test_runtime_lse_of_a_padded_batch(mode):
    """run(lse=) on a 3-row step, lse [3, H_q] as run() documents: with graphs the kernels run the
    padded batch of 4 (static q/out [4, H_q, D]; the fourth row idle); each route writes the
    three rows' lse exactly (host routing: every PersistentKV route forced)."""
    m = MODELS["gpt-oss"]
    b, _, layers, sinks = model_pool("gpt-oss")
    nan_page = unowned_page(b)
    kw = dict(max_pages_per_row=b.block_tables.shape[1], use_cuda_graph=mode.endswith("graphs"),
              window_left=127, sinks=True)
    kw.update(dict(device_planning=True) if mode.startswith("device") else dict(flashinfer=False))
    rt = _runtime(m.hq, m.hkv, m.d, PAGE, m.dtype, **kw)
    rows, short = STEPS[0]
    assert len(rows) == 3
    seq, bt, q = step_inputs(m, b, rows, short, seed=17)
    bt = windowed_tables(bt, seq.tolist(), 127, PAGE, nan_page)
    given, ref_kv = layers[0]
    ref = reference.decode_attention(q, *ref_kv, torch.as_tensor(seq, device=DEV), bt.to(DEV),
                                     window_left=127, sinks=sinks[0], return_lse=True)
    soft = Soft()
    for force in (("pkv_bucket", "pkv_workqueue", "pkv_fused") if mode.startswith("host") else (None,)):
        rt.plan(*plan_args(mode, seq, bt), force=force)
        for static in (False, True):
            if static:
                qq, oo = rt.static_q(3), rt.static_out(3)
                qq.copy_(q)
                oo.fill_(NAN)
            else:
                qq, oo = q.clone(), torch.full_like(q, NAN)
            lse = torch.full((3, m.hq), NAN, device=DEV)
            what = f"{mode} force={force} static={static}"
            try:
                rt.run(qq, *given, out=oo, sinks=sinks[0], lse=lse)
            except ValueError as e:   # ops.KernelArgumentError is one
                soft.expect(False, f"{what}: run(lse=[3, H_q]) raised {type(e).__name__}: {e}")
                continue
            torch.cuda.synchronize()
            soft.check(oo, lse, ref, what, TOL[m.dtype])
    soft.done()


def test_phi3_has_no_flashinfer_route():
    """D 96: FlashInfer has no decode kernel for it; the Runtime says so and runs PersistentKV."""
    m = MODELS["phi3"]
    rt = _runtime(m.hq, m.hkv, m.d, PAGE, m.dtype, max_pages_per_row=64)
    assert rt.flashinfer_available is False
    assert "head_dim 96" in rt.explain(), rt.explain()


@pytest.mark.parametrize("mode", ["host-graphs", "host-eager", "device-graphs", "device-eager"])
def test_runtime_sinks_and_lse_arguments(mode):
    """A Runtime with sinks refuses run() without them and one without sinks refuses them
    (ValueError, out untouched); return_lse=True returns (out, lse), with a fresh q/out and with
    the static buffers, exact."""
    m = MODELS["qwen2.5-7b"]
    b, hnd_layers, _, sinks = model_pool("qwen2.5-7b")
    kw = dict(max_pages_per_row=b.block_tables.shape[1], use_cuda_graph=mode.endswith("graphs"))
    kw.update(dict(device_planning=True) if mode.startswith("device") else dict(flashinfer=False))
    with_sinks = _runtime(m.hq, m.hkv, m.d, PAGE, m.dtype, sinks=True, **kw)
    plain = _runtime(m.hq, m.hkv, m.d, PAGE, m.dtype, **kw)
    rows, short = STEPS[1]
    seq, bt, q = step_inputs(m, b, rows, short, seed=5)
    args = plan_args(mode, seq, bt)
    caches = hnd_layers[0]
    for rt in (with_sinks, plain):
        rt.plan(*args)
    out = torch.full_like(q, 5.0)
    with pytest.raises(ValueError, match="sinks"):
        with_sinks.run(q, *caches, out=out)
    with pytest.raises(ValueError, match="sinks"):
        plain.run(q, *caches, out=out, sinks=sinks[0])
    torch.cuda.synchronize()
    assert (out == 5.0).all()
    seq_t, bt_t = torch.as_tensor(seq, device=DEV), bt.to(DEV)
    soft = Soft()
    for rt, s in ((with_sinks, sinks[0]), (plain, None)):
        ref = reference.decode_attention(q, *caches, seq_t, bt_t, sinks=s, return_lse=True)
        for static in (False, True, False):   # fresh tensors (twice: staging, then its own graph)
            if static:
                qq, oo = rt.static_q(len(rows)), rt.static_out(len(rows))
                qq.copy_(q)
                oo.fill_(NAN)
            else:
                qq, oo = q.clone(), torch.full_like(q, NAN)
            res = rt.run(qq, *caches, out=oo, sinks=s, return_lse=True)
            what = f"{mode} sinks={s is not None} static={static}"
            if not soft.expect(isinstance(res, tuple) and len(res) == 2,
                               f"{what}: return_lse=True returned {type(res).__name__}, not (out, lse)"):
                continue
            got, lse = res
            if soft.expect(got is oo and tuple(lse.shape) == (len(rows), m.hq) and lse.dtype == torch.float32,
                           f"{what}: (out, lse) of the wrong tensor, shape or dtype"):
                soft.check(got, lse, ref, what, TOL[m.dtype])
        out = rt.run(q, *caches, sinks=s)   # without return_lse: out alone
        if soft.expect(isinstance(out, torch.Tensor), f"{mode}: run() returned {type(out).__name__}"):
            soft.check(out, None, ref, f"{mode} out=None", TOL[m.dtype])
    soft.done()


@pytest.mark.parametrize("mode", ["host-bucket", "host-workqueue", "host-fused", "device"])
def test_graph_replay_after_lengths_grew(mode):
    """Graphs on, static q/out and one lse tensor: plan, run, the lengths grow (pages and tiles
    crossed, the window sliding), plan, run: the replayed graph reads the new plan, window,
    sinks and writes out and lse exactly."""
    m = Model(16, 2, 128, F16, (1, 140, 2100, 5000))
    b = paged(m.lens, m.hq, m.hkv, m.d, PAGE, m.dtype, 77)
    nan_page = unowned_page(b)
    kw = dict(device_planning=True) if mode == "device" else dict(flashinfer=False)
    rt = _runtime(m.hq, m.hkv, m.d, PAGE, m.dtype, max_pages_per_row=b.block_tables.shape[1],
                  window_left=127, logits_soft_cap=30.0, sinks=True, **kw)
    force = None if mode == "device" else "pkv_" + mode.split("-")[1]
    sinks = sinks_for(m.hq, 8)
    rows = (0, 1, 2, 3)
    lse = torch.full((len(rows), m.hq), NAN, device=DEV)
    caches = (b.k_cache, b.v_cache)
    for i, short in enumerate((40, 17, 0)):
        seq, bt, q = step_inputs(m, b, rows, short, seed=90 + i)
        bt = windowed_tables(bt, seq.tolist(), 127, PAGE, nan_page)
        d = rt.plan(*plan_args(mode, seq, bt), force=force)
        qs, out = rt.static_q(len(rows)), rt.static_out(len(rows))
        qs.copy_(q)
        out.fill_(NAN)
        lse.fill_(NAN)
        rt.run(qs, *caches, out=out, sinks=sinks, lse=lse)
        torch.cuda.synchronize()
        ref = reference.decode_attention(q, *caches, torch.as_tensor(seq, device=DEV), bt.to(DEV),
                                         window_left=127, logits_soft_cap=30.0, sinks=sinks,
                                         return_lse=True)
        check(out, lse, ref, f"{mode} step {i} (short {short}) route {d.route}", TOL[m.dtype])
    s = rt.stats()
    # workqueue/fused: the planning graph and the decode graph replay at steps 2 and 3; a bucket
    # step whose windowed lengths regroup its rows is a new graph (its buckets are its launches),
    # the first two share one; device planning without num_pages plans its first step in run()
    want = {"host-bucket": 1, "host-workqueue": 4, "host-fused": 4, "device": 3}[mode]
    assert s["captures"] >= 1 and s["replays"] >= want, s


@pytest.mark.parametrize("kw, match", [
    (dict(num_qo_heads=32, num_kv_heads=32, head_dim=96), r"e4m3 K/V at head_dim 96"),
    (dict(num_qo_heads=24, num_kv_heads=2, head_dim=256), r"e4m3 K/V at head_dim 256 with group size 12"),
])
def test_runtime_refuses_unserved_e4m3_shapes(kw, match):
    with pytest.raises(ValueError, match=match):
        Runtime(kw["num_qo_heads"], kw["num_kv_heads"], kw["head_dim"], 16, F16, kv_dtype=FP8)
