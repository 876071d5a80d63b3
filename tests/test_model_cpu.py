"""The Llama-shaped decoder of pkvrt/measure/model.py on the CPU: RoPE against the rotation formula, the
page pool and the paged append, a 2-layer decoder with paged FP32 attention against an
independent dense decoder over steps that cross page boundaries, the logits tolerance against
fp16 rounding and real faults, the memory plan of the benchmark and its report table."""

from __future__ import annotations

import importlib.util
import math
import time
from pathlib import Path

import attrs
import numpy as np
import pytest
import torch

from pkvrt.measure import model as M
from pkvrt.measure import model_attention as A
from pkvrt.measure import model_results as R
from pkvrt.reference import gather_kv

ROOT = Path(__file__).resolve().parent.parent
H200_BYTES = int(139.8 * 2**30)
# The tiny decoder in float32 with 4-token pages: a 13-token context crosses a page boundary on
# the 4th, 8th, ... step.
TINY32 = attrs.evolve(M.TINY, dtype=torch.float32, page_size=4, vocab=97, intermediate=256)


# --------------------------------------------------------------------------- RoPE

@pytest.mark.parametrize("head_dim", [8, 128])
@pytest.mark.parametrize("pos", [0, 1, 17, 4095, 131071])
def test_rope_rotates_each_pair_by_its_angle(head_dim, pos):
    cfg = attrs.evolve(M.TINY, head_dim=head_dim, num_qo_heads=2, num_kv_heads=1, hidden=2 * head_dim)
    x = torch.randn(1, 2, head_dim, generator=torch.Generator().manual_seed(pos))
    rot = M.rope_rotation(torch.tensor([pos]), M.rope_inv_freq(cfg, "cpu"))
    got = M.apply_rope(x, rot)
    want = torch.empty_like(x)
    for i in range(head_dim // 2):           # pair (2i, 2i+1) turned by pos * theta^(-2i/D)
        a = pos * cfg.rope_theta ** (-2 * i / head_dim)
        c, s = math.cos(a), math.sin(a)
        x0, x1 = x[..., 2 * i], x[..., 2 * i + 1]
        want[..., 2 * i], want[..., 2 * i + 1] = x0 * c - x1 * s, x0 * s + x1 * c
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)
    assert got.is_contiguous() and got.dtype == x.dtype


def test_rope_of_half_keeps_dtype_and_rows_use_their_own_positions():
    cfg = M.TINY
    x = torch.randn(3, 4, cfg.head_dim).half()
    rot = M.rope_rotation(torch.tensor([0, 5, 9]), M.rope_inv_freq(cfg, "cpu"))
    out = M.apply_rope(x, rot)
    assert out.dtype == torch.float16
    torch.testing.assert_close(out[0], x[0])                              # position 0: identity
    single = M.apply_rope(x[2:], M.rope_rotation(torch.tensor([9]), M.rope_inv_freq(cfg, "cpu")))
    torch.testing.assert_close(out[2:], single)


# --------------------------------------------------------------------------- page pool, append

def _pool(num_pages=40, batch=3, width=8, page=4, seed=0):
    return M.PagePool(num_pages, batch=batch, max_pages_per_row=width, page_size=page, seed=seed)


def test_pool_reset_gives_each_row_distinct_pages_for_its_context():
    pool = _pool()
    pool.reset(10)                                     # 3 pages of 4 per row
    used = pool.block_tables[:, :3]
    assert len(np.unique(used)) == 9 and used.min() >= 0 and used.max() < 40
    assert (pool.block_tables[:, 3:] == 0).all()       # padding: page 0, inside every cache
    assert pool.free_pages == 40 - 9 and pool.lengths.tolist() == [10, 10, 10]
    first = pool.block_tables.copy()
    pool.advance()
    pool.reset(10)
    assert (pool.block_tables == first).all()          # a reset gives the same pages again


def test_pool_places_each_token_in_its_page_and_takes_a_page_at_boundaries():
    pool = _pool()
    pool.reset(6)
    seen = set(pool.block_tables[:, :2].ravel().tolist())
    for step in range(14):
        pos = 6 + step
        version = pool.version
        s = pool.advance()
        assert s.seq_lens.tolist() == [pos + 1] * 3
        assert s.slot.tolist() == [pos % 4] * 3
        assert s.page.tolist() == pool.block_tables[:, pos // 4].tolist()
        assert s.new_page == (pos % 4 == 0) and (pool.version > version) == s.new_page
        if s.new_page:                                  # a fresh page, never used before
            assert not seen & set(s.page.tolist())
            seen |= set(s.page.tolist())
    assert pool.free_pages == 40 - 3 * 5


def test_pool_raises_when_the_free_list_is_empty():
    pool = _pool(num_pages=M.pages_needed(3, 6, 2, 4))   # 3 rows x 2 pages: no page to spare
    pool.reset(6)
    pool.advance()
    pool.advance()                                         # tokens 6, 7: still page 1
    empty = r"row 0 at token 8 needs 1 free page\(s\) but the free list has 0 of 6"
    with pytest.raises(RuntimeError, match=empty):
        pool.advance()
    with pytest.raises(RuntimeError, match="free list has 6 of 6"):
        _pool(num_pages=6).reset(16)                       # 3 rows x 4 pages


def test_pool_raises_when_a_row_outgrows_its_block_table():
    pool = _pool(width=2)
    pool.reset(8)
    with pytest.raises(RuntimeError, match="row 0 at token 8 needs page 2 but its block table has 2 columns"):
        pool.advance()
    with pytest.raises(ValueError, match="needs 3 pages per row"):
        pool.reset(9)


def test_append_writes_only_the_new_tokens_slot():
    k_cache, v_cache = torch.zeros(6, 2, 4, 3), torch.zeros(6, 2, 4, 3)
    k, v = torch.randn(2, 2, 3), torch.randn(2, 2, 3)
    M.append_kv(k_cache, v_cache, k, v, torch.tensor([4, 1]), torch.tensor([3, 0]))
    torch.testing.assert_close(k_cache[4, :, 3], k[0])
    torch.testing.assert_close(v_cache[1, :, 0], v[1])
    assert (k_cache != 0).sum() == k.numel() and (v_cache != 0).sum() == v.numel()


# --------------------------------------------------------------------------- the decoder

def dense_decode(cfg, w, k_hist, v_hist, tokens, context):
    """An independent dense twin of the paged decoder: per layer a growing [B, H_kv, T, D]
    history, attention as softmax(q k^T / sqrt(D)) v over it, RoPE with cos/sin, RMSNorm by its
    formula. Returns logits [steps, B, vocab] and layer 0's attention [steps, B, H_q, D]."""
    hq, hkv, d = cfg.num_qo_heads, cfg.num_kv_heads, cfg.head_dim
    g = hq // hkv
    inv = cfg.rope_theta ** (-torch.arange(0, d, 2, dtype=torch.float64) / d)

    def norm(x, weight):
        return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + cfg.norm_eps) * weight

    def rope(x, pos):                                    # x [B, H, D]; pairs (2i, 2i+1)
        c, s = torch.cos(pos * inv).float(), torch.sin(pos * inv).float()
        x0, x1 = x[..., 0::2], x[..., 1::2]
        return torch.stack([x0 * c - x1 * s, x0 * s + x1 * c], dim=-1).flatten(-2)

    logits, attn0 = [], []
    for step, tok in enumerate(tokens):
        pos = context + step
        x = w.embed[tok]
        b = x.shape[0]
        for layer, lw in enumerate(w.layers):
            q, k, v = (norm(x, lw.attn_norm) @ lw.qkv.T).split([hq * d, hkv * d, hkv * d], -1)
            q, k = rope(q.view(b, hq, d), pos), rope(k.view(b, hkv, d), pos)
            k_hist[layer] = torch.cat([k_hist[layer], k[:, :, None]], dim=2)
            v_hist[layer] = torch.cat([v_hist[layer], v.view(b, hkv, 1, d)], dim=2)
            kk = k_hist[layer].repeat_interleave(g, dim=1)               # [B, H_q, T, D]
            vv = v_hist[layer].repeat_interleave(g, dim=1)
            p = torch.softmax(torch.einsum("bhd,bhtd->bht", q, kk) / math.sqrt(d), dim=-1)
            o = torch.einsum("bht,bhtd->bhd", p, vv)
            if layer == 0:
                attn0.append(o)
            x = x + o.reshape(b, hq * d) @ lw.o.T
            gate, up = (norm(x, lw.mlp_norm) @ lw.gate_up.T).chunk(2, -1)
            x = x + (torch.nn.functional.silu(gate) * up) @ lw.down.T
        logits.append(norm(x, w.final_norm) @ w.lm_head.T)
    return torch.stack(logits), torch.stack(attn0)


def paged_run(loop, attention, tokens):
    loop.reset(tokens[0])
    logits, attn0 = [], []
    for tok in tokens:
        loop.tokens.copy_(tok)
        loop.step(attention)
        logits.append(loop.logits.clone())
        attn0.append(loop.attn_out[0].clone())
    return torch.stack(logits), torch.stack(attn0)


@pytest.fixture(scope="module")
def tiny():
    cfg, batch, context, steps = TINY32, 3, 13, 9
    model = M.Model(cfg, M.make_weights(cfg, device="cpu", seed=3))
    caches = M.make_caches(cfg, M.pages_needed(batch, context, steps, cfg.page_size) + 2,
                           device="cpu", seed=4)
    loop = M.DecodeLoop(model, caches, batch=batch, context=context, max_steps=steps, seed=5)
    tokens = torch.randint(cfg.vocab, (steps, batch), generator=torch.Generator().manual_seed(6))
    return loop, tokens


def test_paged_decoder_matches_a_dense_decoder(tiny):
    loop, tokens = tiny
    cfg, w, context = loop.model.cfg, loop.model.w, loop.context
    logits, attn0 = paged_run(loop, A.ReferenceAttention(), tokens)
    loop.pool.reset(context)      # the context's pages as the dense twin's starting history
    bt = torch.as_tensor(loop.pool.block_tables)
    k_hist = [torch.stack([gather_kv(loop.caches.k[l], bt[r], context) for r in range(loop.batch)])
              for l in range(cfg.layers)]
    v_hist = [torch.stack([gather_kv(loop.caches.v[l], bt[r], context) for r in range(loop.batch)])
              for l in range(cfg.layers)]
    want_logits, want_attn0 = dense_decode(cfg, w, k_hist, v_hist, tokens, context)
    torch.testing.assert_close(attn0, want_attn0, rtol=1e-4, atol=1e-5)
    torch.testing.assert_close(logits, want_logits, rtol=1e-4, atol=1e-4)
    assert loop.tokens.tolist() == logits[-1].argmax(-1).tolist()       # greedy next tokens


def test_layer0_reference_recomputes_a_pass(tiny):
    loop, tokens = tiny
    _, attn0 = paged_run(loop, A.NoAttention(), tokens)    # fills layer 0's slots, no attention
    ref = loop.model.layer0_reference(tokens, loop.caches, torch.as_tensor(loop.pool.block_tables),
                                      context=loop.context)
    _, want = paged_run(loop, A.ReferenceAttention(), tokens)
    torch.testing.assert_close(ref, want, rtol=1e-5, atol=1e-6)
    check = R.reference_check(want, ref, dtype=torch.float32)
    assert check["ref_ok"] and check["attn0_ref_err"] < 1e-5
    assert not R.reference_check(want.roll(1, dims=1), ref, dtype=torch.float16)["ref_ok"]


class DropNewest(A.ReferenceAttention):
    """A faulty backend: attends over every token but the one just appended."""

    def begin_step(self, seq_lens, block_tables):
        super().begin_step(seq_lens - 1, block_tables)


def test_the_comparison_sees_a_missing_token(tiny):
    loop, tokens = tiny
    good = paged_run(loop, A.ReferenceAttention(), tokens)
    bad = paged_run(loop, DropNewest(), tokens)
    assert not R.agreement(*bad, *good, dtype=torch.float32)["logits_ok"]
    assert R.rel_err(bad[0], good[0])[1] > 1e-2


def test_no_attention_returns_q_and_leaves_the_buffer(tiny):
    loop, tokens = tiny
    loop.attn_out.fill_(7.0)
    paged_run(loop, A.NoAttention(), tokens[:2])
    assert (loop.attn_out == 7.0).all()
    with pytest.raises(ValueError, match="unknown attention engine 'sdpa'"):
        A.make_backend("sdpa", loop.model.cfg, loop)


class FakeWrapper:
    """FlashInfer's graph-mode decode wrapper as far as FlashInferAttention uses it: plan() copies
    indptr / last_page_len into the fixed buffers (indices must already be in its own buffer);
    run() rebuilds lengths and block tables from that CSR and runs the FP32 reference."""

    def __init__(self, workspace, layout, *, use_cuda_graph, use_tensor_cores, backend,
                 paged_kv_indptr_buffer, paged_kv_indices_buffer, paged_kv_last_page_len_buffer):
        assert layout == "HND" and use_cuda_graph and backend == "fa2"
        self.indptr, self.indices = paged_kv_indptr_buffer, paged_kv_indices_buffer
        self.last = paged_kv_last_page_len_buffer
        self.plans = 0

    def plan(self, indptr, indices, last_page_len, hq, hkv, d, page_size, *, q_data_type,
             kv_data_type, non_blocking):
        assert indices.data_ptr() == self.indices.data_ptr()   # a view onto its own buffer
        self.indptr.copy_(indptr)
        self.last.copy_(last_page_len)
        self.page_size, self.plans = page_size, self.plans + 1

    def run(self, q, kv, out):
        ptr = self.indptr.tolist()
        pages = [ptr[i + 1] - ptr[i] for i in range(len(ptr) - 1)]
        seq = torch.tensor([(n - 1) * self.page_size + int(l) for n, l in zip(pages, self.last)])
        bt = torch.zeros(len(pages), max(pages), dtype=torch.int32)
        for r, n in enumerate(pages):
            bt[r, :n] = self.indices[ptr[r]:ptr[r] + n]
        out.copy_(A.reference.decode_attention(q, *kv, seq, bt))


def test_flashinfer_backend_plans_the_pools_pages_as_csr(tiny, monkeypatch):
    import types

    loop, tokens = tiny
    fake = types.SimpleNamespace(BatchDecodeWithPagedKVCacheWrapper=FakeWrapper)
    monkeypatch.setattr(A, "_flashinfer", lambda: fake)
    backend = A.make_backend("flashinfer-tc", loop.model.cfg, loop)
    got = paged_run(loop, backend, tokens)           # crosses page boundaries: the CSR changes
    want = paged_run(loop, A.ReferenceAttention(), tokens)
    torch.testing.assert_close(got, want, rtol=0, atol=0)
    assert backend.wrapper.plans == len(tokens) and backend.name == "flashinfer-tc"


# --------------------------------------------------------------------------- tolerance

class Perturbed(A.ReferenceAttention):
    """FP32 attention with a relative error of ``rel`` per element (a kernel's rounding), or
    with row 0 of ``layer`` reading row 1's first page instead of its own (a fault)."""

    def __init__(self, rel=0.0, wrong_page_layer=None):
        self.rel, self.layer = rel, wrong_page_layer
        self.gen = torch.Generator().manual_seed(11)

    def attend(self, layer, q, k_cache, v_cache, out):
        bt = self._bt.clone()
        if layer == self.layer:
            bt[0, 0] = bt[1, 0]
        o = A.reference.decode_attention(q, k_cache, v_cache, self._seq, bt)
        return out.copy_(o * (1 + self.rel * torch.randn(o.shape, generator=self.gen)))


@pytest.mark.slow
def test_logits_tolerance_passes_fp16_rounding_and_fails_faults():
    """A 32-layer fp16 decoder (hidden 512): attention outputs perturbed by 2 unit roundoffs give
    logits ~8u apart, inside the 40u tolerance; one layer reading one wrong page (of 5) and a
    step without attention are far outside it. (The full 8B shape, measured once on the CPU:
    7.6u for the same perturbation.)"""
    cfg = attrs.evolve(M.TINY, layers=32, intermediate=1792, vocab=512)
    batch, context, steps = 2, 72, 2
    model = M.Model(cfg, M.make_weights(cfg, device="cpu", seed=0))
    caches = M.make_caches(cfg, M.pages_needed(batch, context, steps + 1, cfg.page_size),
                           device="cpu", seed=1)
    loop = M.DecodeLoop(model, caches, batch=batch, context=context, max_steps=steps, seed=2)
    tokens = torch.randint(cfg.vocab, (steps, batch), generator=torch.Generator().manual_seed(3))
    base = paged_run(loop, A.ReferenceAttention(), tokens)
    u = R.UNIT_ROUNDOFF[torch.float16]
    rounding = R.agreement(*paged_run(loop, Perturbed(rel=2 * u), tokens), *base, dtype=cfg.dtype)
    assert rounding["logits_ok"] and rounding["logits_rel_err"] < R.logits_tolerance(cfg.dtype) / 2
    for fault in (Perturbed(wrong_page_layer=5), A.NoAttention()):
        bad = R.agreement(*paged_run(loop, fault, tokens), *base, dtype=cfg.dtype)
        assert not bad["logits_ok"] and bad["logits_rel_err"] > 2 * R.logits_tolerance(cfg.dtype)


def test_agreement_measures_max_relative_error():
    ref = torch.tensor([[[1.0, -4.0]]])
    near = ref + torch.tensor([[[0.0, 0.01]]])
    d = R.agreement(near, ref[..., None], ref, ref[..., None], dtype=torch.float16)
    assert d["logits_max_abs"] == pytest.approx(0.01) and d["logits_rel_err"] == pytest.approx(0.0025)
    assert d["argmax_agree"] == 1.0 and d["logits_ok"]
    far = R.agreement(ref * -1, ref[..., None], ref, ref[..., None], dtype=torch.float16)
    assert not far["logits_ok"] and far["argmax_agree"] == 0.0
    assert R.logits_tolerance(torch.float16) == pytest.approx(40 * 2**-11)
    assert R.attention_tolerance(torch.bfloat16) == pytest.approx(20 * 2**-8)


# --------------------------------------------------------------------------- memory plan

def test_weight_and_kv_bytes_of_the_8b_shape():
    assert M.weight_bytes(M.LLAMA3_8B) == 2 * 8_030_261_248          # Llama-3-8B's parameter count
    # B8 x 128K + 24 steps: 8 * ceil(131096 / 16) pages x 32 layers x (K, V) x 32 KiB
    assert M.pages_needed(8, 131072, 24, 16) == 65552
    assert M.kv_bytes(M.LLAMA3_8B, 8, 131072, 24) == 65552 * 32 * 2 * 8 * 16 * 128 * 2
    assert M.kv_bytes(M.LLAMA3_8B, 1, 8192, 0) == 8192 * 128 * 1024   # 128 KiB per token
    assert M.kv_bytes(attrs.evolve(M.LLAMA3_8B, dtype=torch.float32), 1, 16, 0) == 16 * 256 * 1024


def test_plan_cases_skips_what_does_not_fit_an_h200():
    cases = M.plan_cases(M.LLAMA3_8B, [1, 4, 8, 32], [8192, 32768, 131072], steps=24,
                         capacity_bytes=H200_BYTES)
    assert len(cases) == 12
    skipped = {c.name for c in cases if not c.fits}
    assert skipped == {"B8-128K", "B32-32K", "B32-128K"}
    big = next(c for c in cases if c.name == "B8-128K")
    assert big.reason.startswith("needs 147.0 GiB (weights 15.0 + KV 128.0 + headroom 4.0) > 139.8 GiB")
    b4 = next(c for c in cases if c.name == "B4-128K")
    assert b4.fits and b4.reason is None and b4.need_bytes == b4.weight_bytes + b4.kv_bytes + M.HEADROOM_BYTES
    exact = M.plan_cases(M.LLAMA3_8B, [4], [131072], steps=24, capacity_bytes=b4.need_bytes)[0]
    assert exact.fits
    assert not M.plan_cases(M.LLAMA3_8B, [4], [131072], steps=24, capacity_bytes=b4.need_bytes - 1)[0].fits
    assert M.case_name(1, 8192) == "B1-8K" and M.case_name(2, 1000) == "B2-1000"


@pytest.mark.parametrize("bad, match", [
    (dict(hidden=100), "hidden=100: expected num_qo_heads"),
    (dict(num_kv_heads=3), "expected a multiple of num_kv_heads=3"),
    (dict(page_size=12), "page_size=12: expected a power of two"),
    (dict(layers=0), "layers=0: expected a positive integer"),
    (dict(dtype=torch.int8), "expected float16, bfloat16 or float32"),
])
def test_config_refuses_bad_shapes(bad, match):
    with pytest.raises(ValueError, match=match):
        attrs.evolve(M.LLAMA3_8B, **bad)


# --------------------------------------------------------------------------- results and table

def _case_rows(case, times):
    """Rows of one case: engine -> (sync ms, pipelined ms)."""
    rows = [R.measured_row(case, e, model="llama3-8b", sync_ms=[s, s, s * 1.1], pipelined_ms=[p],
                           host_us=[10.0], warmup=3) for e, (s, p) in times.items()]
    return rows


def test_finish_case_shares_baseline_and_ratio():
    case = M.plan_cases(M.LLAMA3_8B, [4], [32768], steps=24, capacity_bytes=H200_BYTES)[0]
    rows = _case_rows(case, {"pkvrt": (20.0, 19.0), "flashinfer-tc": (22.0, 21.0),
                             "flashinfer-cuda": (24.0, 23.0), "no-attention": (10.0, 9.5)})
    ratio = R.finish_case(rows)
    by = {r["engine"]: r for r in rows}
    assert by["pkvrt"]["tokens_per_s"] == pytest.approx(4 / 0.020)
    assert by["pkvrt"]["attention_ms"] == pytest.approx(10.0)
    assert by["pkvrt"]["attention_share"] == pytest.approx(0.5)
    assert by["flashinfer-tc"]["baseline"] and not by["flashinfer-cuda"]["baseline"]
    assert "attention_share" not in by["no-attention"]
    assert len(ratio) == 1 and ratio[0]["engine"] == "pkvrt / flashinfer-tc"
    assert ratio[0]["step_ratio"] == pytest.approx(1.1)
    assert ratio[0]["attention_ratio"] == pytest.approx(12.0 / 10.0)
    assert ratio[0]["pipelined_ratio"] == pytest.approx(21.0 / 19.0)
    assert R.finish_case(_case_rows(case, {"pkvrt": (1.0, 1.0)})) == []   # no FlashInfer: no ratio


def test_model_decode_table_renders_measured_ratio_and_skipped_rows():
    cases = {c.name: c for c in M.plan_cases(M.LLAMA3_8B, [1, 8], [8192, 131072], steps=24,
                                              capacity_bytes=H200_BYTES)}
    rows = _case_rows(cases["B1-8K"], {"pkvrt": (5.0, 4.9), "flashinfer-cuda": (5.5, 5.4),
                                       "no-attention": (4.5, 4.4)})
    rows[0].update(R.agreement(torch.ones(1, 1, 2), torch.ones(1, 1, 1, 1), torch.ones(1, 1, 2),
                               torch.ones(1, 1, 1, 1), dtype=torch.float16), logits_vs="flashinfer-cuda")
    rows[0].update(R.reference_check(torch.ones(2), torch.ones(2) + 1e-4, dtype=torch.float16))
    rows[1].update(logits_ok=False, logits_rel_err=0.5, attn0_rel_err=0.1, logits_vs="pkvrt")
    rows += R.finish_case(rows)
    rows.append(R.skipped_row(cases["B8-128K"], model="llama3-8b"))
    rows.append(R.unavailable_row(cases["B1-8K"], "flashinfer-xqa", model="llama3-8b", reason="no XQA"))
    doc = {"meta": {"kind": R.KIND}, "rows": rows}
    text = R.model_decode_table([("model-decode.json", doc)])
    assert ("| llama3-8b-B1-8K | pkvrt | 5.00 | 200 | 10.0 % | 4.90 | 10 | ok: layer 0 vs FP32 "
            "1.0e-04; vs flashinfer-cuda: logits 0.0e+00, layer 0 0.0e+00 |") in text
    assert "| llama3-8b-B1-8K | flashinfer-cuda (baseline) | 5.50 |" in text and "**FAILED**" in text
    assert "| llama3-8b-B1-8K | flashinfer-cuda | 1.100 | 1.102 | 2.000 |" in text
    assert "- llama3-8b-B8-128K: skipped (needs 147.0 GiB" in text
    assert "- llama3-8b-B1-8K flashinfer-xqa: unavailable (no XQA)" in text
    assert R.model_decode_table([("other.json", {"meta": {"kind": "serving"}, "rows": rows})]) == ""


class FakeEvent:
    """torch.cuda.Event on the host clock (the bench's passes, run on a CPU)."""

    def __init__(self, enable_timing=False):
        self.t = None

    def record(self):
        self.t = time.perf_counter()

    def synchronize(self):
        pass

    def elapsed_time(self, end):
        return (end.t - self.t) * 1e3


class FakeGraph:
    def __init__(self, loop, backend):
        self.replay = lambda: loop.forward(backend)


def test_bench_case_on_the_cpu_checks_times_and_ratios(tiny, monkeypatch, tmp_path):
    """benches/model_decode.py's run_case with CPU stand-ins: "pkvrt" is the FP32 reference,
    FlashInfer's wrapper the fake above (its two paths), graphs replay eagerly, events read the
    host clock. Every engine passes the FP32 check, the rows are complete, the results file
    passes the report's validator."""
    import argparse
    import types

    from pkvrt.measure import results
    from pkvrt.tools import report

    bench = _load(ROOT / "benches" / "model_decode.py")
    loop, _ = tiny
    monkeypatch.setattr(torch.cuda, "Event", FakeEvent)
    monkeypatch.setattr(torch.cuda, "synchronize", lambda: None)
    monkeypatch.setattr(M.DecodeLoop, "capture",
                        lambda self, backend: (self.prepare(backend), FakeGraph(self, backend))[1])
    fake = types.SimpleNamespace(BatchDecodeWithPagedKVCacheWrapper=FakeWrapper)
    monkeypatch.setattr(A, "_flashinfer", lambda: fake)
    make = A.make_backend

    def backend(name, cfg, lp, **kw):
        if name == "pkvrt":
            b = A.ReferenceAttention()
            b.name = "pkvrt"
            return b
        if name == "flashinfer-xqa":
            raise RuntimeError("no XQA here")
        return make(name, cfg, lp, **kw)
    monkeypatch.setattr(A, "make_backend", backend)
    case = M.plan_cases(TINY32, [2], [11], steps=6, capacity_bytes=2**40)[0]
    args = argparse.Namespace(check_steps=2, warmup=1, steps=3)
    engines = ["pkvrt", "flashinfer-tc", "flashinfer-cuda", "flashinfer-xqa", "no-attention"]
    rows = bench.run_case(case, loop.model, engines, args, log=lambda msg: None)
    by = {r["engine"]: r for r in rows}
    assert by["flashinfer-xqa"]["row"] == "unavailable" and "no XQA here" in by["flashinfer-xqa"]["reason"]
    for e in ("pkvrt", "flashinfer-tc", "flashinfer-cuda"):
        assert by[e]["ref_ok"] and by[e]["logits_ok"] and by[e]["attn0_ref_err"] < 1e-5, e
        assert by[e]["steps"] == 3 and by[e]["ms_per_step"] > 0 and "attention_share" in by[e]
    base = next(r["engine"] for r in rows if r.get("baseline"))
    assert by["pkvrt"]["logits_vs"] == base and by[base]["logits_vs"] != base
    assert by["no-attention"]["attention_signal"] > 1e-2
    assert by[f"pkvrt / {base}"]["row"] == "ratio" and by[f"pkvrt / {base}"]["step_ratio"] > 0
    results.write_results(tmp_path / "model-decode.json", {"kind": R.KIND}, rows)
    text = R.model_decode_table(report.load_dir(tmp_path))
    assert "FAILED" not in text and f"{base} (baseline)" in text


def test_rows_pass_the_report_validator(tmp_path):
    from pkvrt.measure import results
    from pkvrt.tools import report

    case = M.plan_cases(M.LLAMA3_8B, [1], [8192], steps=24, capacity_bytes=H200_BYTES)[0]
    rows = _case_rows(case, {"pkvrt": (5.0, 4.9), "flashinfer-tc": (5.5, 5.4)})
    rows += R.finish_case(rows) + [R.skipped_row(case, model="llama3-8b", reason="test")]
    results.write_results(tmp_path / "model-decode.json", {"kind": R.KIND}, rows)
    files = report.load_dir(tmp_path)                    # validates every row
    assert "| llama3-8b-B1-8K | pkvrt |" in R.model_decode_table(files)


# --------------------------------------------------------------------------- scripts without a GPU

def _load(path: Path):
    spec = importlib.util.spec_from_file_location(path.stem, path)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the no-GPU path")
def test_example_and_bench_say_they_need_a_gpu(capsys):
    assert _load(ROOT / "examples" / "llama_decode.py").main([]) == 0
    out = capsys.readouterr().out
    assert out.count("\n") == 1 and "needs a CUDA GPU" in out
    assert _load(ROOT / "benches" / "model_decode.py").main([]) == 2
    assert "needs a CUDA GPU" in capsys.readouterr().err
    bench = _load(ROOT / "benches" / "model_decode.py")
    assert bench.parse_counts("8K,32k,100") == [8192, 32768, 100]
