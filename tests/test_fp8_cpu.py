"""FP8 K/V on the CPU: the FP32 twin over float8_e4m3fn caches, the scale checks and
where the launch paths call them, routes.toml's kv_dtypes, the router's K/V dtype and the bytes
it counts. (The kernels' e4m3 index math: test_e4m3_layout.py; the kernels themselves and the
Runtime on the GPU: tests/gpu/test_fp8.py; the Runtime's FP8 path on the emulated device:
test_runtime_cpu.py.)"""

from __future__ import annotations

import math
import pathlib

import numpy as np
import pytest
import torch

from pkvrt import reference, runtime
from pkvrt.launch import _driver, ops
from pkvrt.policy import costmodel
from pkvrt.policy.calibration import load_calibration
from pkvrt.policy.planner import flashinfer_counters, kv_bytes, workqueue_counters
from pkvrt.policy.registry import RoutesError, kv_dtype_name, load_routes
from pkvrt.policy.router import Router
from paged import make_batch
from test_registry import edit, write

FP8 = torch.float8_e4m3fn
REPO = pathlib.Path(__file__).resolve().parents[1]
SEED = load_calibration(REPO / "calibration" / "rtx3060-seed.json")
H200 = load_calibration(REPO / "calibration" / "nvidia-h200.json")
SHAPE = dict(num_qo_heads=32, num_kv_heads=8, head_dim=128, page_size=16)


def fp8_batch(lens, *, page_size, head_dim, group, num_kv_heads=2, per_head=True, seed=0):
    """A poisoned random batch (tests/paged.py) in float32 and its FP8 copy with scales."""
    b = make_batch(lens, num_qo_heads=group * num_kv_heads, num_kv_heads=num_kv_heads,
                   head_dim=head_dim, page_size=page_size, dtype=torch.float32, device="cpu",
                   seed=seed)
    kq, ks = reference.quantize_kv(b.k_cache, per_head=per_head)
    vq, vs = reference.quantize_kv(b.v_cache, per_head=per_head)
    return b, kq, ks, vq, vs


def attend(b, k, v, **kw):
    return reference.decode_attention(b.q, k, v, b.seq_lens, b.block_tables, **kw)


# ----------------------------------------------------------------------------- the FP32 twin

# (page_size, D, G): every page size 1..64, D and G each at least twice, small ragged rows.
CASES = [(1, 64, 1), (2, 128, 2), (4, 256, 4), (8, 64, 8), (16, 128, 1), (32, 256, 2),
         (64, 64, 4), (16, 256, 8), (64, 128, 8)]


@pytest.mark.parametrize("per_head", [True, False], ids=["per-head", "per-tensor"])
@pytest.mark.parametrize("page_size, head_dim, group", CASES)
def test_fp8_twin_is_fp32_attention_over_the_dequantized_cache(page_size, head_dim, group, per_head):
    b, kq, ks, vq, vs = fp8_batch([1, 37, 3 * page_size + 1, 90], page_size=page_size,
                                  head_dim=head_dim, group=group, per_head=per_head, seed=page_size + group)
    assert kq.dtype == FP8 and ks.dtype == torch.float32 and ks.shape == ((2,) if per_head else (1,))
    out = attend(b, kq, vq, k_scale=ks, v_scale=vs)
    # dequantized independently of the twin: every element times its head's scale
    deq_k = kq.float() * ks.expand(2)[None, :, None, None]
    deq_v = vq.float() * vs.expand(2)[None, :, None, None]
    assert torch.equal(out, attend(b, deq_k, deq_v))
    assert torch.isfinite(out).all()   # NaN-poisoned pages and tails (FP8 NaN) never read
    split = reference.split_decode_attention(b.q, kq, vq, b.seq_lens, b.block_tables, 3,
                                             k_scale=ks, v_scale=vs)
    torch.testing.assert_close(split, out, rtol=2e-5, atol=2e-6)


def test_per_head_scales_apply_to_their_head():
    b, kq, ks, vq, vs = fp8_batch([40, 7], page_size=4, head_dim=64, group=2, num_kv_heads=4)
    out = attend(b, kq, vq, k_scale=ks, v_scale=vs)
    twice_v = vs.clone()
    twice_v[2] *= 2   # attention is linear in V and x2 is exact: q heads 4, 5 double, bit for bit
    o2 = attend(b, kq, vq, k_scale=ks, v_scale=twice_v)
    assert torch.equal(o2[:, 4:6], 2 * out[:, 4:6])
    assert torch.equal(o2[:, :4], out[:, :4]) and torch.equal(o2[:, 6:], out[:, 6:])
    sharper_k = ks.clone()
    sharper_k[1] *= 3   # K scale of head 1: only q heads 2, 3 change
    o3 = attend(b, kq, vq, k_scale=sharper_k, v_scale=vs)
    assert not torch.allclose(o3[:, 2:4], out[:, 2:4], rtol=1e-3, atol=1e-3)
    assert torch.equal(o3[:, :2], out[:, :2]) and torch.equal(o3[:, 4:], out[:, 4:])


def test_quantize_kv_error_is_within_e4m3_precision():
    # The premise of fp8_error_bound: |x^ - x| <= max(2^-4 |x|, 2^-10 s) elementwise.
    x = torch.randn(6, 3, 16, 64, generator=torch.Generator().manual_seed(1)) * torch.tensor([1e-3, 1.0, 50.0])[:, None, None]
    q, s = reference.quantize_kv(x.permute(1, 0, 2, 3), per_head=True)
    x = x.permute(1, 0, 2, 3)
    err = (q.float() * s[None, :, None, None] - x).abs()
    allowed = torch.maximum(reference.FP8_UNIT_ROUNDOFF * x.abs(),
                            reference.FP8_SUBNORMAL_HALF_ULP * s[None, :, None, None])
    assert (err <= allowed * (1 + 1e-6)).all()
    assert (err > 0.5 * allowed).any()   # and the bound is attained, not loose


@pytest.mark.parametrize("head_dim", [64, 128, 256])
@pytest.mark.parametrize("per_head", [True, False], ids=["per-head", "per-tensor"])
def test_fp8_error_bound_holds_and_a_4x_scale_error_breaks_it(head_dim, per_head):
    b, kq, ks, vq, vs = fp8_batch([1, 37, 300, 129], page_size=16, head_dim=head_dim, group=4,
                                  per_head=per_head, seed=head_dim)
    exact = attend(b, b.k_cache, b.v_cache, dtype=torch.float64)
    bound = reference.fp8_error_bound(b.q, b.k_cache, b.v_cache, b.seq_lens, b.block_tables,
                                      k_scale=ks, v_scale=vs)
    err = (attend(b, kq, vq, k_scale=ks, v_scale=vs, dtype=torch.float64) - exact).norm().item()
    assert err <= bound
    assert bound <= 0.25 * exact.norm().item()      # a bound on a few % of |O|, not vacuous
    for k_s, v_s in ((ks * 4, vs), (ks, vs * 4)):
        wrong = attend(b, kq, vq, k_scale=k_s, v_scale=v_s, dtype=torch.float64)
        assert (wrong - exact).norm().item() > bound


def test_reference_refuses_a_scale_of_the_wrong_shape():
    b, kq, ks, vq, vs = fp8_batch([5], page_size=4, head_dim=64, group=1)
    with pytest.raises(ValueError, match=r"scale: expected shape \[1\] or \[H_kv=2\], got \(3,\)"):
        attend(b, kq, vq, k_scale=torch.ones(3), v_scale=vs)


# ----------------------------------------------------------------------------- scale checks


def caches(dtype=FP8, hkv=2):
    k = torch.zeros(4, hkv, 16, 64).to(dtype)
    return k, k.clone()


def test_check_kv_scales_accepts_what_it_should():
    k, v = caches(torch.float16)
    assert ops.check_kv_scales(k, v, None, None, check_values=True) is False
    k, v = caches()
    q = torch.zeros(1, 4, 64, dtype=torch.bfloat16)
    for ks, vs in ((torch.ones(1), torch.ones(2)), (torch.full((2,), 0.5), torch.ones(1))):
        assert ops.check_kv_scales(k, v, ks, vs, q=q, out=q, check_values=True) is True


@pytest.mark.parametrize("change, match", [
    (dict(k_scale=None), r"k_scale: expected a contiguous float32 \[1\] or \[H_kv=2\] tensor on cpu "
                         r"\(float8_e4m3fn caches need scales\), got None"),
    (dict(v_scale=None), r"v_scale: expected .* need scales\), got None"),
    (dict(k_scale=0.5), r"k_scale: expected .* got float"),
    (dict(k_scale=torch.ones(1, dtype=torch.float64)), r"k_scale: expected a contiguous float32 .* got torch.float64"),
    (dict(v_scale=torch.ones(1, dtype=torch.float16)), r"v_scale: expected a contiguous float32 .* got torch.float16"),
    (dict(k_scale=torch.ones(3)), r"k_scale: expected .*\[H_kv=2\].* got torch.float32 \(3,\)"),
    (dict(k_scale=torch.ones(1, 1)), r"k_scale: expected .* got torch.float32 \(1, 1\)"),
    (dict(k_scale=torch.ones(0)), r"k_scale: expected .* got torch.float32 \(0,\)"),
    (dict(v_scale=torch.ones(4)[::2]), r"v_scale: expected .* \(strided\)"),
    (dict(k_scale=torch.ones(2, device="meta")), r"k_scale: expected .* on cpu, got torch.float32 \(2,\) on meta"),
    (dict(k_scale=torch.tensor([1.0, math.inf])), r"k_scale: expected finite scales > 0, got \[1.0, inf\]"),
    (dict(v_scale=torch.tensor([math.nan])), r"v_scale: expected finite scales > 0, got \[nan\]"),
    (dict(k_scale=torch.tensor([0.0])), r"k_scale: expected finite scales > 0"),
    (dict(v_scale=torch.tensor([1.0, -2.0])), r"v_scale: expected finite scales > 0"),
    (dict(q=torch.zeros(1, 4, 64)), r"q: expected float16 or bfloat16 with float8_e4m3fn K/V, got torch.float32"),
    (dict(out=torch.zeros(1, 4, 64, dtype=FP8)), r"out: expected float16 or bfloat16 .* got torch.float8_e4m3fn"),
    (dict(v_cache=caches(torch.float16)[1]), r"v_cache: expected the dtype of k_cache \(torch.float8_e4m3fn\), "
                                              r"got torch.float16"),
])
def test_check_kv_scales_refusals_name_the_argument(change, match):
    k, v = caches()
    args = dict(k_cache=k, v_cache=v, k_scale=torch.ones(2), v_scale=torch.ones(1),
                q=torch.zeros(1, 4, 64, dtype=torch.float16), out=None)
    ops.check_kv_scales(**args, check_values=True)   # the base case passes
    args.update(change)
    with pytest.raises(ops.KernelArgumentError, match=match):
        ops.check_kv_scales(**args, check_values=True)


def test_scale_values_are_read_only_when_asked():
    k, v = caches()
    bad = torch.tensor([math.nan, 0.0])
    assert ops.check_kv_scales(k, v, bad, bad) is True   # metadata only: no device read
    with pytest.raises(ValueError, match="k_scale: expected finite scales > 0"):
        ops.check_kv_scales(k, v, bad, bad, check_values=True)


@pytest.mark.parametrize("name", ["k_scale", "v_scale"])
def test_scales_with_fp16_caches_are_refused(name):
    k, v = caches(torch.bfloat16)
    kw = dict(k_scale=None, v_scale=None) | {name: torch.ones(1)}
    with pytest.raises(ValueError, match=rf"{name}: expected None \(scales are for float8_e4m3fn "
                                         r"caches; these are torch.bfloat16\), got a Tensor"):
        ops.check_kv_scales(k, v, **kw)


# ----------------------------------------------------------------------------- launch paths check scales first


def cpu_fp8_args(**change):
    """CPU launch arguments of an FP8 step: every check up to the device one passes."""
    q = torch.zeros(2, 8, 128, dtype=torch.float16)
    k = torch.zeros(4, 2, 16, 128, dtype=FP8)
    args = dict(q=q, k_cache=k, v_cache=k.clone(), out=torch.full_like(q, math.nan),
                k_scale=torch.ones(2), v_scale=torch.ones(1))
    args.update(change)
    return args


@pytest.mark.parametrize("change, match", [
    (dict(k_scale=None), r"k_scale: expected .* \(float8_e4m3fn caches need scales\), got None"),
    (dict(v_scale=torch.ones(3)), r"v_scale: expected a contiguous float32 \[1\] or \[H_kv=2\]"),
    (dict(k_scale=torch.ones(2, dtype=torch.float16)), r"k_scale: .* got torch.float16"),
    (dict(k_cache=torch.zeros(4, 2, 16, 128, dtype=torch.float16)),
     r"v_cache: expected the dtype of k_cache \(torch.float16\), got torch.float8_e4m3fn"),
    (dict(q=torch.zeros(2, 8, 128)), r"q: expected float16 or bfloat16 with float8_e4m3fn K/V"),
])
def test_launch_wrappers_check_scales_before_anything(change, match):
    a = cpu_fp8_args(**change)
    i32 = torch.zeros(2, dtype=torch.int32)
    launches = [
        lambda: ops.check_attention_args(a["q"], a["k_cache"], a["v_cache"], a["out"], a["k_scale"], a["v_scale"]),
        lambda: ops.split_decode(a["q"], a["k_cache"], a["v_cache"], i32, i32[None], i32, 1, a["out"],
                                 k_scale=a["k_scale"], v_scale=a["v_scale"]),
        lambda: ops.workqueue_decode(a["q"], a["k_cache"], a["v_cache"], i32, i32[None], i32.view(-1, 1), i32,
                                     i32, a["out"], None, None, k_scale=a["k_scale"], v_scale=a["v_scale"]),
    ]
    for launch in launches:
        with pytest.raises(ops.KernelArgumentError, match=match):
            launch()
    assert torch.isnan(a["out"]).all()   # nothing written


def test_launch_wrappers_pass_good_scales_on_to_the_device_check():
    a = cpu_fp8_args()
    with pytest.raises(ops.KernelArgumentError, match="q: expected a CUDA tensor"):
        ops.check_attention_args(a["q"], a["k_cache"], a["v_cache"], a["out"], a["k_scale"], a["v_scale"])
    # fp16 caches with scales: refused, the scales are for FP8 caches only
    k16 = torch.zeros(4, 2, 16, 128, dtype=torch.float16)
    with pytest.raises(ops.KernelArgumentError, match=r"k_scale: expected None \(scales are for float8"):
        ops.check_attention_args(a["q"], k16, k16, a["out"], a["k_scale"], None)


def test_decode_params_carry_the_scale_pointers_and_shapes():
    a = cpu_fp8_args()
    i32 = torch.zeros(2, dtype=torch.int32)
    p = ops._decode_params(a["q"], a["k_cache"], a["v_cache"], a["out"], None, None, i32, i32[None],
                           None, 4, a["k_scale"], a["v_scale"])
    assert p.k_scale == a["k_scale"].data_ptr() and p.v_scale == a["v_scale"].data_ptr()
    assert (p.k_scale_per_head, p.v_scale_per_head) == (1, 0)
    p16 = ops._decode_params(a["q"], a["k_cache"], a["v_cache"], a["out"], None, None, i32, i32[None],
                             None, 4)
    assert not p16.k_scale and not p16.v_scale
    # the struct mirrors pkv::DecodeParams (tests/test_struct_mirror.py checks every field): the
    # scale pointers follow trace, 8-byte aligned
    assert ops.DecodeParams.k_scale.offset == ops.DecodeParams.trace.offset + 8


@pytest.mark.parametrize("head_dim", [64, 128, 256])
@pytest.mark.parametrize("group", [1, 4])
def test_fp8_decode_smem_equals_fp16(head_dim, group, monkeypatch):
    """The e4m3 pipelines double their stages: the same bytes per CTA, the same occupancy."""
    assert ops.decode_smem_bytes(head_dim, group, 1) == ops.decode_smem_bytes(head_dim, group)


def test_fp8_symbols():
    from pkvrt import _buildspec
    # a group size is served by the kernel of its group capacity (4: G 1..4, 8: 5..8, 16: 9..16)
    assert _buildspec.symbol("split_decode", "f16", 128, 4) == "pkv_split_decode_f16_d128_gc4"
    assert _buildspec.symbol("split_decode", "f16", 128, 3) == "pkv_split_decode_f16_d128_gc4"
    assert _buildspec.symbol("fused_decode", "bf16", 64, 7, "e4m3") == "pkv_fused_decode_bf16_e4m3_d64_gc8"
    assert _buildspec.symbol("fused_decode", "bf16", 96, 16) == "pkv_fused_decode_bf16_d96_gc16"
    syms = _buildspec.symbols("workqueue_decode")
    plain = len(_buildspec.DTYPES) * len(_buildspec.HEAD_DIMS) * len(_buildspec.GROUP_CLASSES)
    e4m3 = len(_buildspec.DTYPES) * sum(1 for d in _buildspec.E4M3_HEAD_DIMS for c in _buildspec.GROUP_CLASSES
                                        if c <= _buildspec.E4M3_MAX_CLASS[d])
    assert len(syms) == plain + e4m3 == len(set(syms))
    assert "pkv_workqueue_decode_f16_e4m3_d256_gc4" in syms and "pkv_workqueue_decode_f16_d256_gc16" in syms
    assert "pkv_workqueue_decode_f16_e4m3_d256_gc16" not in syms   # e4m3 D 256: G <= 8
    assert "pkv_workqueue_decode_f16_e4m3_d96_gc4" not in syms     # e4m3: no D 96
    assert _buildspec.unserved(96, 4, "e4m3") and _buildspec.unserved(256, 12, "e4m3")
    assert _buildspec.unserved(256, 12) is None and _buildspec.unserved(96, 16) is None
    merges = [_buildspec.symbol("merge", dt, d) for dt in _buildspec.DTYPES for d in _buildspec.HEAD_DIMS]
    assert _buildspec.symbols("merge") == merges + [m.replace("pkv_merge_", "pkv_merge_segments_")
                                                    for m in merges]   # merge.cu's second kernel
    with pytest.raises(ValueError, match="not instantiated per K/V dtype"):
        _buildspec.symbol("merge", "f16", 128, None, "e4m3")
    with pytest.raises(KeyError, match="unknown K/V dtype tag 'e5m2'"):
        _buildspec.symbol("split_decode", "f16", 128, 4, "e5m2")


@pytest.mark.parametrize("which", ["k_cache", "v_cache"])
def test_runtime_run_checks_the_kv_dtype_and_scales(which):
    q = torch.randn(3, 32, 128).half()
    kv = torch.randn(10, 8, 16, 128).half().to(FP8)
    base = dict(batch=3, **SHAPE, dtype=torch.float16, device=torch.device("cpu"))
    t = dict(q=q, k_cache=kv, v_cache=kv.clone(), out=torch.zeros_like(q))
    ok = dict(k_scale=torch.ones(8), v_scale=torch.ones(1))
    runtime.check_run_args(**t, **base, kv_dtype=FP8, **ok)
    one = dict(t, **{"k_cache": kv.half(), "v_cache": kv.half()})
    one[which] = kv
    with pytest.raises(ValueError, match=rf"Runtime.run: {which}: expected dtype torch.float16 \(the "
                                         r"Runtime's kv_dtype\), got torch.float8_e4m3fn"):
        runtime.check_run_args(**one, **base)          # an fp16 Runtime
    with pytest.raises(ValueError, match=r"Runtime.run: k_scale: expected a contiguous float32 .* got None"):
        runtime.check_run_args(**t, **base, kv_dtype=FP8)
    with pytest.raises(ValueError, match=r"Runtime.run: v_scale: expected .* got torch.float32 \(2,\)"):
        runtime.check_run_args(**t, **base, kv_dtype=FP8, k_scale=ok["k_scale"], v_scale=torch.ones(2))
    t16 = dict(t, k_cache=torch.randn(10, 8, 16, 128).half())
    t16["v_cache"] = t16["k_cache"].clone()
    with pytest.raises(ValueError, match=r"Runtime.run: k_scale: expected None \(scales are for float8"):
        runtime.check_run_args(**t16, **base, **ok)
    t[which] = torch.zeros(10, 8, 16, 128, dtype=FP8)[:, :, :, :]   # strides fine
    runtime.check_run_args(**t, **base, kv_dtype=FP8, **ok)


def test_runtime_dtype_is_q_and_out_kv_dtype_is_the_cache(monkeypatch):
    with pytest.raises(ValueError, match=r"dtype=torch.float8_e4m3fn: dtype is the dtype of q and out: "
                                         r"expected torch.float16 or torch.bfloat16; an FP8 KV cache is "
                                         r"kv_dtype=torch.float8_e4m3fn"):
        runtime.check_shape(32, 8, 128, 16, FP8)
    with pytest.raises(ValueError, match=r"kv_dtype=torch.bfloat16: expected None \(the dtype, torch.float16\)"):
        runtime.check_shape(32, 8, 128, 16, torch.float16, torch.bfloat16)
    assert runtime.check_shape(32, 8, 128, 16, torch.bfloat16, FP8) == 4
    monkeypatch.setattr(_driver, "available", lambda: "no GPU")
    with pytest.raises(ValueError, match="dtype is the dtype of q and out"):
        runtime.Runtime(32, 8, 128, 16, dtype=FP8)
    with pytest.raises(RuntimeError, match="no GPU"):   # FP8 gets past the checks to the CUDA one
        runtime.Runtime(32, 8, 128, 16, torch.float16, kv_dtype=FP8)
    with pytest.raises(RuntimeError, match="no GPU"):
        runtime.Runtime(32, 8, 128, 16, torch.float16, kv_dtype=FP8, device_planning=True)


def test_device_planning_refuses_a_dtype_its_route_does_not_serve(monkeypatch, tmp_path):
    monkeypatch.setattr(_driver, "available", lambda: "no GPU")
    fused = 'ablation = true\nkv_dtypes = ["float16", "bfloat16", "float8_e4m3fn"]\n'
    text = (REPO / "routes.toml").read_text()
    assert text.count(fused) == 1
    reg = load_routes(write(tmp_path, text.replace(fused, 'ablation = true\nkv_dtypes = ["float16"]\n')))
    with pytest.raises(ValueError, match=r"dtype=torch.bfloat16: the device-planning route 'pkv_fused' "
                                         r"does not serve it \(kv_dtypes = \['float16'\]"):
        runtime.Runtime(32, 8, 128, 16, dtype=torch.bfloat16, routes=reg, device_planning=True)
    with pytest.raises(ValueError, match=r"dtype=torch.float8_e4m3fn: the device-planning route 'pkv_fused'"):
        runtime.Runtime(32, 8, 128, 16, torch.float16, kv_dtype=FP8, routes=reg, device_planning=True)
    with pytest.raises(RuntimeError, match="no GPU"):   # fp16 gets past it, to the CUDA check
        runtime.Runtime(32, 8, 128, 16, dtype=torch.float16, routes=reg, device_planning=True)


# ----------------------------------------------------------------------------- routes.toml kv_dtypes


def test_shipped_kv_dtypes_defaults():
    reg = load_routes(REPO / "routes.toml")
    assert reg.baseline.kv_dtypes == ("float16", "bfloat16", "float8_e4m3fn")
    for name in ("pkv_bucket", "pkv_workqueue", "pkv_fused"):
        assert reg.route(name).kv_dtypes == ("float16", "bfloat16", "float8_e4m3fn")


def test_kv_dtypes_can_be_declared(tmp_path):
    text = edit('kind = "workqueue"\n', 'kind = "workqueue"\nkv_dtypes = ["bfloat16"]\n')
    text = text.replace('kind = "flashinfer"\n', 'kind = "flashinfer"\nkv_dtypes = ["float16", "bfloat16"]\n')
    reg = load_routes(write(tmp_path, text))
    assert reg.route("pkv_workqueue").kv_dtypes == ("bfloat16",)
    assert reg.baseline.kv_dtypes == ("float16", "bfloat16")
    assert reg.route("pkv_bucket").kv_dtypes == ("float16", "bfloat16", "float8_e4m3fn")   # default


@pytest.mark.parametrize("value, problem", [
    ('"float16"', '"float16" is not an array'),
    ("[]", "[] is empty"),
    ('["float32"]', '["float32"] has "float32", not a KV dtype'),
    ('["float16", "fp8"]', 'has "fp8", not a KV dtype'),
    ("[2]", "[2] has 2, not a KV dtype"),
    ('[["float16"]]', 'has ["float16"], not a KV dtype'),
    ('["float16", "float16"]', "lists a dtype twice"),
])
@pytest.mark.parametrize("route", ["flashinfer", "pkv_bucket"])
def test_bad_kv_dtypes_name_file_table_and_key(tmp_path, value, problem, route):
    anchor = 'kind = "flashinfer"\n' if route == "flashinfer" else 'kind = "bucket"\n'
    p = write(tmp_path, edit(anchor, f"{anchor}kv_dtypes = {value}\n"))
    with pytest.raises(RoutesError) as e:
        load_routes(p)
    msg = str(e.value)
    assert msg.startswith(f"{p}: [routes.{route}] kv_dtypes: ")
    assert problem in msg and 'expected a non-empty array of distinct names among "float16", ' \
        '"bfloat16", "float8_e4m3fn"' in msg


def test_refusals_name_an_unserved_kv_dtype(tmp_path):
    reg = load_routes(write(tmp_path, edit('kind = "workqueue"\n', 'kind = "workqueue"\nkv_dtypes = ["float16", "bfloat16"]\n')))
    ok = dict(group_size=4, max_context=32768, active=8)
    wq = reg.route("pkv_workqueue")
    assert wq.refusals(**ok) == () and wq.refusals(**ok, kv_dtype="bfloat16") == ()
    assert wq.refusals(**ok, kv_dtype="float8_e4m3fn") == (
        "KV dtype float8_e4m3fn is not served (kv_dtypes = ['float16', 'bfloat16'])",)
    assert reg.baseline.refusals(**ok, kv_dtype="float8_e4m3fn") == ()
    shipped = load_routes(REPO / "routes.toml")
    assert all(shipped.route(n).refusals(**ok, kv_dtype="float8_e4m3fn") == ()
               for n in ("pkv_bucket", "pkv_workqueue"))


def test_kv_dtype_name():
    assert kv_dtype_name(torch.float16) == kv_dtype_name("float16") == "float16"
    assert kv_dtype_name(FP8) == "float8_e4m3fn"
    with pytest.raises(ValueError, match="KV dtype torch.float32: expected one of float16, bfloat16, float8_e4m3fn"):
        kv_dtype_name(torch.float32)


# ----------------------------------------------------------------------------- the router's K/V dtype

STEPS = [np.array([32768]), np.array([40000, 3000, 20000, 17000]), np.array([17000] * 8),
         np.array([33000, 33000, 900, 1200, 700, 2000, 400, 31000]), np.array([100, 200])]


@pytest.mark.parametrize("cal", [SEED, H200], ids=["roofline", "measured"])
def test_fp16_and_bf16_decisions_are_unchanged(cal):
    reg = load_routes(REPO / "routes.toml")
    routers = [Router(reg, cal, **SHAPE, dtype_bytes=2), Router(reg, cal, **SHAPE),
               Router(reg, cal, **SHAPE, kv_dtype=torch.bfloat16), Router(reg, cal, **SHAPE, kv_dtype="float16")]
    assert all(r.dtype_bytes == 2 for r in routers)
    for seq in STEPS:
        ds = [r.decide(seq) for r in routers]
        for d in ds[1:]:
            assert (d.route, d.predicted_us, d.refused) == (ds[0].route, ds[0].predicted_us, ds[0].refused)
    assert any(r.decide(seq).route != "flashinfer" for r in routers[:1] for seq in STEPS)


@pytest.mark.parametrize("cal", [SEED, H200], ids=["roofline", "measured"])
def test_fp8_steps_are_routed_with_half_the_bytes(cal):
    reg = load_routes(REPO / "routes.toml")
    r16, r8 = Router(reg, cal, **SHAPE), Router(reg, cal, **SHAPE, kv_dtype=FP8)
    assert r8.dtype_bytes == 1 and r8.kv_dtype == "float8_e4m3fn"
    for seq in STEPS:
        d16, d8 = r16.decide(seq), r8.decide(seq)
        for name in ("flashinfer", "pkv_bucket", "pkv_workqueue"):   # predicted with half the bytes
            assert (name in d8.predicted_us) == (name in d16.predicted_us)
            if name in d8.predicted_us:
                assert d8.predicted_us[name] < d16.predicted_us[name]
        assert not any("KV dtype" in why for why in d8.refused.values())
        if d8.kind == "flashinfer":
            assert d8.plan.counters.useful_kv_bytes * 2 == r16.decide(seq, force="flashinfer").plan.counters.useful_kv_bytes
    for force in ("pkv_bucket", "pkv_workqueue", "pkv_fused"):
        d = r8.decide(STEPS[1], force=force)
        d16 = r16.decide(STEPS[1], force=force)
        assert d.route == force and d.plan.counters.useful_kv_bytes * 2 == d16.plan.counters.useful_kv_bytes


def test_a_route_without_the_kv_dtype_is_refused_and_cannot_be_forced(tmp_path):
    reg = load_routes(write(tmp_path, edit('kind = "workqueue"\n', 'kind = "workqueue"\nkv_dtypes = ["float16"]\n')))
    steps = [np.array([40000]), np.array([33000, 33000, 900, 1200, 700, 2000, 400, 31000])]
    r16, rbf = Router(reg, SEED, **SHAPE), Router(reg, SEED, **SHAPE, kv_dtype="bfloat16")
    for seq in steps:
        d = rbf.decide(seq)
        assert d.refused["pkv_workqueue"] == "KV dtype bfloat16 is not served (kv_dtypes = ['float16'])"
        assert "pkv_workqueue" in r16.decide(seq).predicted_us
    with pytest.raises(ValueError, match=r"force='pkv_workqueue': the route does not serve KV dtype bfloat16 "
                                         r"\(kv_dtypes = \['float16'\]"):
        rbf.decide(steps[0], force="pkv_workqueue")


def test_router_refuses_a_kv_dtype_the_baseline_does_not_serve(tmp_path):
    reg = load_routes(write(tmp_path, edit('kind = "flashinfer"\n', 'kind = "flashinfer"\nkv_dtypes = ["float16"]\n')))
    with pytest.raises(ValueError, match=r"kv_dtype=bfloat16: the baseline route 'flashinfer' does not serve it"):
        Router(reg, SEED, **SHAPE, kv_dtype="bfloat16")
    with pytest.raises(ValueError, match=r"dtype_bytes=2: expected 1, the element size of kv_dtype float8_e4m3fn"):
        Router(load_routes(REPO / "routes.toml"), SEED, **SHAPE, kv_dtype=FP8, dtype_bytes=2)
    with pytest.raises(ValueError, match="KV dtype 'float32'"):
        Router(load_routes(REPO / "routes.toml"), SEED, **SHAPE, kv_dtype="float32")


# ----------------------------------------------------------------------------- bytes per token


def test_one_byte_kv_halves_the_counted_bytes_and_the_read_time():
    seq = np.array([32768, 1000, 17000])
    cal = SEED
    shape = dict(num_kv_heads=8, head_dim=128)
    assert kv_bytes(np.array([32768]), **shape, dtype_bytes=2) == 134_217_728   # B1 32K fp16
    assert kv_bytes(np.array([32768]), **shape, dtype_bytes=1) == 67_108_864    # FP8: half
    splits = load_routes(REPO / "routes.toml").route("pkv_workqueue").splits
    wq = {n: workqueue_counters(seq, num_qo_heads=32, **shape, dtype_bytes=n, splits=splits, cal=cal) for n in (1, 2)}
    fi = {n: flashinfer_counters(seq, **shape, dtype_bytes=n) for n in (1, 2)}
    for c in (wq, fi):
        assert c[1].useful_kv_bytes * 2 == c[2].useful_kv_bytes
        assert c[1].merge_bytes == c[2].merge_bytes          # fp32 partial states: not K/V
        assert costmodel.read_us(c[1].useful_kv_bytes, cal) * 2 == pytest.approx(
            costmodel.read_us(c[2].useful_kv_bytes, cal), rel=1e-12)
    for kind in ("flashinfer", "workqueue", "fused", "bucket"):   # the measured model's groups
        g = {n: costmodel.route_groups(kind, seq, H200, **shape, dtype_bytes=n,
                                       splits=None if kind == "flashinfer" else splits) for n in (1, 2)}
        assert [x.kv_bytes * 2 for x in g[1]] == [x.kv_bytes for x in g[2]]
        assert [x.makespan_tiles for x in g[1]] == [x.makespan_tiles for x in g[2]]   # same splits


# ----------------------------------------------------------------------------- benches/isolated.py --kv-dtype fp8


def test_isolated_fp8_baseline_accepts_a_path_within_the_fp8_bound():
    """An FP8 FlashInfer path that misses the fp16 tolerance against the dequantized reference
    (it rounds q or P to FP8, say) is still a baseline candidate if it is within
    ``fp8_error_bound`` of the unquantized answer; outside both it is a wrong output."""
    import importlib.util

    from pkvrt.tools.bench import ISOLATED
    spec = importlib.util.spec_from_file_location("pkvrt_benches_isolated_fp8", ISOLATED)
    iso = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(iso)
    loose = dict(max_err_ref=2e-2, mean_err_ref=2e-3)
    rows = [dict(case="c", engine="flashinfer-xqa", median_us=34.0, within_fp8_bound=True, **loose),
            dict(case="c", engine="flashinfer-tc", median_us=30.0, within_fp8_bound=False, **loose),
            dict(case="c", engine="flashinfer-cuda", median_us=60.0, max_err_ref=1e-3, mean_err_ref=1e-5,
                 within_fp8_bound=True)]
    base, status = iso.fi_candidates(rows)
    assert base == "flashinfer-xqa"
    assert status["flashinfer-tc"].startswith("wrong output") and status["flashinfer-cuda"] == "ok"
    assert iso.FP8_CASES == ["B1-32K", "B8-32K"] and all(c in iso.CASES for c in iso.FP8_CASES)
