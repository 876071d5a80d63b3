"""SharedPagesRuntime on the GPU: steps whose rows share pages (prefix caching, parallel
sampling, nested prefixes) against the FP32 reference, eagerly and captured by an engine; with
device lengths, the shared prefixes found on the GPU (find_shared against its twin)."""

from __future__ import annotations

import attrs
import numpy as np
import pytest
import torch

import pkvrt
from pkvrt import reference

pytestmark = pytest.mark.gpu
if not torch.cuda.is_available():
    pytest.skip("needs a CUDA GPU", allow_module_level=True)

PAGE = 16
DEV = "cuda"   # (a CPU dry run of this file's logic sets it to "cpu" with emulated kernels)
# the shared path's arithmetic on every step with sharing, whatever the time model predicts
ALWAYS = pkvrt.RuntimeOptions(shared_when_predicted_faster=False)


def step(lens, prefixes, num_pages, seed):
    """Block tables: rows draw their pages from a shuffled pool; ``prefixes`` is a list of
    (rows, pages): those rows share those first pages (later entries may nest in earlier)."""
    rng = np.random.default_rng(seed)
    pool = rng.permutation(num_pages).astype(np.int32)
    width = max(-(-n // PAGE) for n in lens)
    bt = pool[:len(lens) * width].reshape(len(lens), width).copy()
    for rows, pages in prefixes:
        bt[rows, :pages] = bt[rows[0], :pages]
    return np.array(lens, np.int32), bt


CASES = [   # (H_q, H_kv, lens, prefixes)
    (32, 8, [2048 + 100 * i for i in range(8)], [(list(range(8)), 120)]),
    (32, 8, [1024 + 37 * i for i in range(16)], [(list(range(16)), 60)]),
    (32, 8, [3000] * 6 + [500, 900], [(list(range(6)), 150), ([0, 1, 2], 170)]),   # nested
    (64, 8, [4096 + i for i in range(5)], [([0, 1, 2, 3, 4], 200)]),              # G 8: chunks of 2
    (24, 8, [1500 + 9 * i for i in range(7)], [(list(range(7)), 80)]),              # G 3: chunks of 5
]


@pytest.mark.parametrize("chunks", ["default", "wide", "cut"],
                         ids=["default chunks", "64-head chunks", "time-model cut"])
@pytest.mark.parametrize("capture", [False, True], ids=["eager", "engine graph"])
@pytest.mark.parametrize("hq, hkv, lens, prefixes", CASES)
def test_shared_pages_match_the_reference(hq, hkv, lens, prefixes, capture, chunks):
    """Default chunks (16 heads with the shipped calibration); chunks of 64 // G rows: the
    wide decode body (its warps split the chunk's heads); and the chunk decode cut at the time
    model's split count (``shared_chunk_cut="time_model"``: the planning kernel given one
    candidate count; routes.toml's bounds on it lifted, so every case is cut so)."""
    seq, bt = step(lens, prefixes, 8192, seed=len(lens))
    k = torch.randn(8192, hkv, PAGE, 128, device=DEV, dtype=torch.float16)
    v = torch.randn_like(k)
    q = torch.randn(len(lens), hq, 128, device=DEV, dtype=torch.float16)
    options = {"default": ALWAYS,
               "wide": pkvrt.RuntimeOptions(shared_when_predicted_faster=False,
                                            shared_chunk_rows=64 * hkv // hq),
               "cut": pkvrt.RuntimeOptions(shared_when_predicted_faster=False,
                                           shared_chunk_cut="time_model")}[chunks]
    routes = pkvrt.load_routes(None)
    if chunks == "cut":
        routes = attrs.evolve(routes, sharing_model_cut_rows=None, sharing_model_cut_margin=1.0)
    rt = pkvrt.SharedPagesRuntime(hq, hkv, 128, PAGE, torch.float16, max_batch=16,
                                  max_pages_per_row=bt.shape[1], num_pages=8192,
                                  engine_capture=capture, options=options, routes=routes)
    rt.plan(seq, bt)
    assert rt.plan_used is not None, rt.explain()
    if chunks == "cut" and capture:   # (eager: the chunk Runtime's own graphs route on the host)
        assert "the chunk decode cut at" in rt.explain(), rt.explain()
    out = torch.full_like(q, float("nan"))
    if capture:
        from pkvrt.runtime.graphs import capture as capture_step

        graph = capture_step(lambda: rt.run(q, k, v, out=out)).graph
        out.fill_(float("nan"))
        graph.replay()
    else:
        rt.run(q, k, v, out=out)
    ref = reference.decode_attention(q, k, v, torch.as_tensor(seq, device=DEV),
                                     torch.as_tensor(bt, device=DEV))
    err = float((out.float() - ref).norm() / ref.norm())
    assert err < 2e-3, (err, rt.explain())


def test_shared_pages_with_fp8_kv_match_the_reference():
    """e4m3 K/V with per-KV-head scales (G 4: chunks of 4 rows), against the FP32 reference over
    the dequantized caches."""
    hq, hkv, lens, prefixes = CASES[0]
    seq, bt = step(lens, prefixes, 8192, seed=3)
    k, ks = reference.quantize_kv(torch.randn(8192, hkv, PAGE, 128, device=DEV), per_head=True)
    v, vs = reference.quantize_kv(torch.randn(8192, hkv, PAGE, 128, device=DEV), per_head=True)
    q = torch.randn(len(lens), hq, 128, device=DEV, dtype=torch.float16)
    rt = pkvrt.SharedPagesRuntime(hq, hkv, 128, PAGE, torch.float16, kv_dtype=torch.float8_e4m3fn,
                                  max_batch=16, max_pages_per_row=bt.shape[1], num_pages=8192,
                                  options=ALWAYS)
    rt.plan(seq, bt)
    assert rt.plan_used is not None, rt.explain()
    out = rt.run(q, k, v, out=torch.full_like(q, float("nan")), k_scale=ks, v_scale=vs)
    ref = reference.decode_attention(q, k, v, torch.as_tensor(seq, device=DEV),
                                     torch.as_tensor(bt, device=DEV), k_scale=ks, v_scale=vs)
    err = float((out.float() - ref).norm() / ref.norm())
    assert err < 2e-3, (err, rt.explain())


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
@pytest.mark.parametrize("d", [64, 96, 128, 256])
@pytest.mark.parametrize("sinks", [False, True])
def test_merge_segments_kernel_matches_torch(dtype, d, sinks):
    """kernels/merge.cu merge_segments against the merge written out in torch (FP32): states from
    the chunk decode (heads side by side) and the own decode, a padded slot, sinks, lse."""
    from pkvrt.launch import ops

    g, c, hkv, va, sb, b = 4, 3, 2, 3, 7, 5
    hq = hkv * g
    gen = torch.Generator(device=DEV).manual_seed(d)
    out_a = torch.randn(va, hkv * c * g, d, device=DEV, generator=gen).to(dtype)
    lse_a = torch.randn(va, hkv * c * g, device=DEV, generator=gen) * 4
    out_b = torch.randn(sb, hq, d, device=DEV, generator=gen).to(dtype)
    lse_b = torch.randn(sb, hq, device=DEV, generator=gen) * 4
    slots = torch.tensor([[0, 9, va * c + sb], [4, 10, 11], [8, 12, 13], [2, 14, va * c + sb],
                          [15, va * c + sb, va * c + sb]], device=DEV, dtype=torch.int64)
    sk = torch.randn(hq, device=DEV, generator=gen) if sinks else None
    out = torch.full((b, hq, d), float("nan"), device=DEV, dtype=dtype)
    lse = torch.empty(b, hq, device=DEV)
    ops.merge_segments(out_a, lse_a, out_b, lse_b, slots, out, group=g, chunk_rows=c, sinks=sk, lse=lse)
    sa = out_a.view(va, hkv, c, g, d).permute(0, 2, 1, 3, 4).reshape(-1, hq, d)
    la = lse_a.view(va, hkv, c, g).permute(0, 2, 1, 3).reshape(-1, hq)
    states, lses = torch.cat([sa.float(), out_b.float()]), torch.cat([la, lse_b])
    for r in range(b):
        ks = [int(x) for x in slots[r] if int(x) < states.shape[0]]
        w = torch.exp2(lses[ks] - lses[ks].amax(0))                    # [K, H_q]
        den = w.sum(0) + (torch.exp2(sk * 1.4426950408889634 - lses[ks].amax(0)) if sinks else 0)
        want = (w.unsqueeze(-1) * states[ks]).sum(0) / den.unsqueeze(-1)
        torch.testing.assert_close(out[r].float(), want, atol=2e-2, rtol=2e-2)
        torch.testing.assert_close(lse[r], lses[ks].amax(0) + torch.log2(w.sum(0)), atol=1e-4, rtol=1e-5)


# ---- device lengths: the shared prefixes found on the GPU (kernels/find_shared.cu)


FIND_SPECS = [(8, 16, 4), (37, 1, 2), (300, 16, 16), (64, 64, 8), (5, 16, 3), (128, 4, 5),
              (1, 16, 4), (1024, 1, 16)]   # (rows, page, C)


def find_cases():
    """(lens, bt, page, C): random steps with nested prefixes (of up to ~40 pages: several
    32-entry compare rounds), idle rows (0), a negative length and one past the block table,
    1 to 1024 rows; seeded."""
    out = []
    for i, (b, page, c_rows) in enumerate(FIND_SPECS):
        rng = np.random.default_rng(100 + i)
        lens = rng.integers(1, 40 * page, size=b).astype(np.int32)
        lens[rng.random(b) < 0.1] = 0
        width = int(-(-lens.max() // page)) + 1
        bt = rng.permutation(b * width + 50).astype(np.int32)[:b * width].reshape(b, width)
        for _ in range(4 if b > 1 else 0):   # prefix families, some nested in others
            rows = rng.choice(b, size=int(rng.integers(2, max(3, b // 2))), replace=False)
            n = int(rng.integers(1, width))
            bt[rows, :n] = bt[rows[0], :n]
        lens[b // 2] = width * page + 3   # past the block table: shares nothing, passed on
        if b > 2:
            lens[1] = -5                   # a negative length: the same
        out.append((lens, bt, page, c_rows))
    return out


@pytest.mark.parametrize("case", range(len(FIND_SPECS)))
def test_find_shared_kernel_matches_its_twin(case):
    """Every output of find_shared equals sharing.plan_prefix_chunks (the entries a decode or
    the merge reads): chunk lengths, their pages, the q gather indices, own lengths and pages,
    slots."""
    from pkvrt.launch import ops
    from pkvrt.policy import sharing

    lens, bt, page, c_rows = find_cases()[case]
    b, w = bt.shape
    g, hkv = 3, 2
    twin = sharing.plan_prefix_chunks(lens, bt, page, c_rows)
    i32 = dict(dtype=torch.int32, device=DEV)
    out = dict(chunk_seq=torch.full((b,), -7, **i32), chunk_bt=torch.full((b, w), -7, **i32),
               own_seq=torch.full((b,), -7, **i32), own_bt=torch.full((b, w), -7, **i32),
               q_index=torch.full((b * hkv * c_rows * g,), -7, dtype=torch.int64, device=DEV),
               slots=torch.full((b, 2), -7, dtype=torch.int64, device=DEV))
    ops.find_shared(torch.as_tensor(lens, device=DEV), torch.as_tensor(bt, device=DEV), **out,
                    page_size=page, chunk_rows=c_rows, group=g, num_kv_heads=hkv)
    got = {k: v.cpu().numpy() for k, v in out.items()}
    for name in ("chunk_seq", "own_seq", "slots"):
        np.testing.assert_array_equal(got[name], getattr(twin, name), err_msg=name)
    np.testing.assert_array_equal(got["q_index"], twin.q_index(hkv, g))
    for v in range(b):
        n = int(twin.chunk_seq[v]) // page
        np.testing.assert_array_equal(got["chunk_bt"][v, :n], twin.chunk_bt[v, :n])
    valid = (lens >= 1) & (lens <= w * page)
    for r in np.nonzero(valid)[0]:
        k = -(-int(twin.own_seq[r]) // page)
        np.testing.assert_array_equal(got["own_bt"][r, :k], twin.own_bt[r, :k])
    assert twin.tokens_saved > 0 or b == 1


# steps of benches/shared_pages.py (rows x (shared + own tokens)): the rule (routes.toml's
# device_margin) shares the first four and runs the last plain with the H100's and the H200's
# calibrations (tests/test_sharing_device_rule_cpu.py)
RULE_STEPS = [(8, 32768, 128), (32, 4096, 256), (64, 2048, 1024), (8, 8192, 512), (16, 1024, 1024)]


def rule_step(rows, shared, own, seed):
    """``rows`` rows of ``shared`` tokens' pages in common, then ``own`` tokens each (page 16)."""
    return step([shared + own] * rows, [(list(range(rows)), shared // PAGE)],
                rows * (-(-(shared + own) // PAGE)), seed)


@pytest.mark.parametrize("margin", [None, 0.0, float("inf")], ids=["routes.toml", "always", "never"])
@pytest.mark.parametrize("case", range(len(RULE_STEPS) + 3))
def test_find_shared_rule_matches_its_twin(case, margin):
    """find_shared with the rule (this GPU's calibration, H_q 32, H_kv 8, D 128; routes.toml's
    margin, 0 and inf) against sharing.plan_prefix_chunks with the same rule: the decision, both
    predicted times (the cut of each decode and its time, computed on the GPU), the re-reads,
    and every output the decodes and the merge read. The bench's sharing steps and random
    steps with nested prefixes and idle rows."""
    import attrs

    from pkvrt.launch import ops
    from pkvrt.policy import sharing

    if case < len(RULE_STEPS):
        lens, bt = rule_step(*RULE_STEPS[case], seed=case)
        page = PAGE
    else:
        lens, bt, page, _ = find_cases()[[0, 2, 5][case - len(RULE_STEPS)]]
    b, w = bt.shape
    hq, hkv = 32, 8
    rt = pkvrt.SharedPagesRuntime(hq, hkv, 128, page, torch.float16, max_batch=max(8, b),
                                  max_pages_per_row=w, device_planning=True)
    rule = rt.device_rule(b)
    assert rule is not None, rt.explain()
    if margin is not None:
        rule = attrs.evolve(rule, margin=margin)
    twin = sharing.plan_prefix_chunks(lens, bt, page, rt.chunk, rule=rule)
    i32 = dict(dtype=torch.int32, device=DEV)
    out = dict(chunk_seq=torch.full((b,), -7, **i32), chunk_bt=torch.full((b, w), -7, **i32),
               own_seq=torch.full((b,), -7, **i32), own_bt=torch.full((b, w), -7, **i32),
               q_index=torch.full((b * hkv * rt.chunk * rt.group,), -7, dtype=torch.int64, device=DEV),
               slots=torch.full((b, 2), -7, dtype=torch.int64, device=DEV))
    rule_out = torch.full((6,), float("nan"), dtype=torch.float64, device=DEV)
    pin = torch.full((1,), -7, **i32)
    cands = tuple(torch.tensor(d.splits.candidates(), **i32) for d in (rule.row, rule.chunk))
    ops.find_shared(torch.as_tensor(lens, device=DEV), torch.as_tensor(bt, device=DEV), **out,
                    page_size=page, chunk_rows=rt.chunk, group=rt.group, num_kv_heads=hkv,
                    rule=rule, candidates=cands, rule_out=rule_out, split_pin=pin)
    got = {k: v.cpu().numpy() for k, v in out.items()}
    d, r = twin.decision, rule_out.cpu().numpy()
    if d is None:   # no chunk found
        assert r[2] == -1 and not (twin.slots[:, 0] >= 0).any()
        assert r[5] == 0 and pin.item() == 0
    else:
        assert r[0] == pytest.approx(d.plain_us, rel=1e-9) and r[1] == pytest.approx(d.shared_us, rel=1e-9)
        assert (r[3], r[4]) == (d.plain_rereads, d.chunk_rereads)
        assert r[2] == float(d.shared)
        # the chunk decode's cut by the time model (8 x (8K + 512): on both GPUs' files)
        assert r[5] == d.chunk_splits and pin.item() == (d.chunk_splits if d.shared else 0)
        if case == 3:
            assert d.chunk_splits > 0, d
        if case < len(RULE_STEPS) and margin is None:
            assert d.shared == (case < len(RULE_STEPS) - 1), d
    for name in ("chunk_seq", "own_seq", "slots"):
        np.testing.assert_array_equal(got[name], getattr(twin, name), err_msg=name)
    np.testing.assert_array_equal(got["q_index"], twin.q_index(hkv, rt.group))
    for v in range(b):
        n = int(twin.chunk_seq[v]) // page
        np.testing.assert_array_equal(got["chunk_bt"][v, :n], twin.chunk_bt[v, :n])
    for row in np.nonzero((lens >= 1) & (lens <= w * page))[0]:
        k = -(-int(twin.own_seq[row]) // page)
        np.testing.assert_array_equal(got["own_bt"][row, :k], twin.own_bt[row, :k])


@pytest.mark.parametrize("graphs", [False, True], ids=["eager", "own graphs"])
def test_the_chunk_decode_is_planned_at_find_shareds_count(graphs):
    """Device lengths on 8 rows of 8K shared + 512 own tokens (the step whose chunk decode the
    time model cuts on both GPUs' files): the count find_shared writes (split_pin, after its
    rule) is the one the chunk decode's planning kernel, launched right after it, cuts the
    longest chunk at (read after its PDL wait), found() reports it, and the output is exact;
    with shared_chunk_cut="partition" the planning kernel takes the partition's cut."""
    from pkvrt.policy import planner

    hq, hkv = 32, 8
    lens, bt = rule_step(8, 8192, 512, seed=5)
    b, w = bt.shape
    num_pages = int(bt.max()) + 1
    gen = torch.Generator(device=DEV).manual_seed(6)
    k = torch.randn(num_pages, hkv, PAGE, 128, device=DEV, dtype=torch.float16, generator=gen)
    v = torch.randn_like(k)
    q = torch.randn(b, hq, 128, device=DEV, dtype=torch.float16, generator=gen)
    seq_d, bt_d = torch.as_tensor(lens, device=DEV), torch.as_tensor(bt, device=DEV)
    for cut in ("time_model", "partition"):
        rt = pkvrt.SharedPagesRuntime(hq, hkv, 128, PAGE, torch.float16, max_batch=b,
                                      max_pages_per_row=w, num_pages=num_pages, device_planning=True,
                                      options=pkvrt.RuntimeOptions(use_cuda_graph=graphs,
                                                                   shared_chunk_cut=cut))
        rt.plan(seq_d, bt_d)
        out = rt.run(q, k, v, out=torch.full_like(q, float("nan")))
        torch.cuda.synchronize()
        found = rt.found()
        d = found.decision
        assert d is not None and d.shared, d
        planned = rt.shared._d_num_splits[:b].cpu().numpy()
        chunks = found.chunk_seq
        assert (planned[chunks == 0] == 0).all()
        if cut == "time_model":
            assert d.chunk_splits > 0 and int(rt._split_pin.item()) == d.chunk_splits
            assert planned.max() == d.chunk_splits, (planned, d)
        else:
            assert d.chunk_splits == 0 and int(rt._split_pin.item()) == 0
            route = rt.plain.registry.device_planning_route(b, rt.shared.router.group_size)
            part = planner.balanced_partition(chunks.astype(np.int64), num_kv_heads=hkv, splits=route.splits,
                                              cal=rt.shared.calibration, kind=route.kind)
            np.testing.assert_array_equal(planned, part.num_splits)
        ref = reference.decode_attention(q, k, v, seq_d, bt_d)
        err = float((out.float() - ref).norm() / ref.norm())
        assert err < 2e-3, (err, cut, rt.explain())


def test_one_captured_step_follows_the_rule_both_ways():
    """An engine's captured step (plan + run, device lengths, the rule on) replayed on a step the
    rule runs plain (8 rows of 1K shared + 1K own) and on one it shares (8 rows of 15K shared +
    1K own), in both orders, in one graph: the decision find_shared wrote (found()) is the
    twin's, and the output matches the FP32 reference each time."""
    from pkvrt.policy import sharing
    from pkvrt.runtime.graphs import capture as capture_step

    hq, hkv, rows, width = 32, 8, 8, 1040
    num_pages = rows * width
    steps = [step([2048] * rows, [(list(range(rows)), 64)], num_pages, seed=1),
             step([16384] * rows, [(list(range(rows)), 960)], num_pages, seed=2)]
    gen = torch.Generator(device=DEV).manual_seed(9)
    k = torch.randn(num_pages, hkv, PAGE, 128, device=DEV, dtype=torch.float16, generator=gen)
    v = torch.randn_like(k)
    q = torch.randn(rows, hq, 128, device=DEV, dtype=torch.float16, generator=gen)
    rt = pkvrt.SharedPagesRuntime(hq, hkv, 128, PAGE, torch.float16, max_batch=rows,
                                  max_pages_per_row=width, num_pages=num_pages, device_planning=True,
                                  options=pkvrt.RuntimeOptions(use_cuda_graph=False))
    seq_d = torch.zeros(rows, dtype=torch.int32, device=DEV)
    bt_d = torch.zeros(rows, width, dtype=torch.int32, device=DEV)
    out = torch.full_like(q, float("nan"))

    def load(i):
        seq, bt = steps[i]
        seq_d.copy_(torch.as_tensor(seq))
        bt_d.zero_()
        bt_d[:, :bt.shape[1]] = torch.as_tensor(bt)

    def body():
        rt.plan(seq_d, bt_d)
        rt.run(q, k, v, out=out)
    for first in (0, 1):
        load(first)
        graph = capture_step(body).graph
        for i in (first, 1 - first, first):
            load(i)
            out.fill_(float("nan"))
            graph.replay()
            seq, bt = steps[i]
            twin = sharing.plan_prefix_chunks(seq, bt_d.cpu().numpy(), PAGE, rt.chunk,
                                              rule=rt.device_rule(rows))
            found = rt.found()
            assert found.decision.shared == twin.decision.shared == (i == 1), (i, found.decision)
            ref = reference.decode_attention(q, k, v, seq_d, bt_d)
            err = float((out.float() - ref).norm() / ref.norm())
            assert err < 2e-3, (i, err, rt.explain())
    assert rt.own.device_status() == 0 and rt.shared.device_status() == 0


@pytest.mark.parametrize("capture", [False, True], ids=["eager", "engine graph"])
@pytest.mark.parametrize("hq, hkv, lens, prefixes", CASES)
def test_device_lengths_shared_pages_match_the_reference(hq, hkv, lens, prefixes, capture):
    """SharedPagesRuntime(device_planning=True): lengths and block tables on the GPU, every chunk
    found kept (no rule). Captured (plan + run in one graph, as an engine captures its step), the
    graph is replayed on the next step's lengths and a block table with other sharing, and still
    matches the reference."""
    seq, bt = step(lens, prefixes, 8192, seed=len(lens))
    k = torch.randn(8192, hkv, PAGE, 128, device=DEV, dtype=torch.float16)
    v = torch.randn_like(k)
    q = torch.randn(len(lens), hq, 128, device=DEV, dtype=torch.float16)
    opts = pkvrt.RuntimeOptions(shared_when_predicted_faster=False, use_cuda_graph=not capture)
    rt = pkvrt.SharedPagesRuntime(hq, hkv, 128, PAGE, torch.float16, max_batch=16,
                                  max_pages_per_row=bt.shape[1] + 1, num_pages=8192,
                                  device_planning=True, options=opts)
    seq_d = torch.as_tensor(seq, device=DEV)
    bt_d = torch.zeros(len(lens), bt.shape[1] + 1, dtype=torch.int32, device=DEV)
    bt_d[:, :bt.shape[1]] = torch.as_tensor(bt, device=DEV)
    out = torch.full_like(q, float("nan"))
    if capture:
        from pkvrt.runtime.graphs import capture as capture_step

        def body():
            rt.plan(seq_d, bt_d)
            rt.run(q, k, v, out=out)
        graph = capture_step(body).graph
        out.fill_(float("nan"))
        graph.replay()
    else:
        rt.plan(seq_d, bt_d)
        rt.run(q, k, v, out=out)
    found = rt.found() if not capture else None
    assert capture or found.tokens_saved > 0, rt.explain()

    def check(seq, bt):
        ref = reference.decode_attention(q, k, v, torch.as_tensor(seq, device=DEV),
                                         torch.as_tensor(bt, device=DEV))
        err = float((out.float() - ref).norm() / ref.norm())
        assert err < 2e-3, (err, rt.explain())
    check(seq, bt_d[:, :bt.shape[1]].cpu().numpy())
    # the next step: one more token per row, and the last row joins the first row's prefix
    seq2 = seq + 1
    bt2 = bt_d.cpu().numpy()
    bt2[-1, :2] = bt2[0, :2]
    seq_d.copy_(torch.as_tensor(seq2))
    bt_d.copy_(torch.as_tensor(bt2))
    out.fill_(float("nan"))
    if capture:
        graph.replay()
    else:
        rt.plan(seq_d, bt_d)
        rt.run(q, k, v, out=out)
    check(seq2, bt2)
    assert rt.own.device_status() == 0 and rt.shared.device_status() == 0


@pytest.mark.parametrize("page", [1, PAGE])
def test_dropin_share_prefixes_in_cuda_graph_mode(page):
    """pkvrt.BatchDecodeWithPagedKVCacheWrapper(share_prefixes=True) called as SGLang calls it
    (page 1: token slots, NHD, K and V apart) or at page 16: plan() outside, run() captured with
    return_lse, replayed; against the FP32 reference, the GPU finding the shared prefix."""
    from pkvrt.policy.blocktables import to_csr

    hq, hkv, d = 32, 8, 128
    # a 15 000-token prefix shared by every row: the rule shares it (predicted 1.3-1.4x faster
    # than the plain step with the H100 and H200 calibrations; a 1 600-token one it runs plain)
    seq = np.array([16000 + 50 * i for i in range(8)], np.int32)
    width = -(-int(seq.max()) // page)
    num_pages = len(seq) * width
    bt = np.random.default_rng(7).permutation(num_pages).astype(np.int32).reshape(len(seq), width)
    bt[1:, :15000 // page] = bt[0, :15000 // page]
    lens = seq.tolist()
    k = torch.randn(num_pages, page, hkv, d, device=DEV, dtype=torch.float16)   # NHD
    v = torch.randn_like(k)
    q = torch.randn(len(lens), hq, d, device=DEV, dtype=torch.float16)
    ip, ind, lpl = to_csr(seq, bt, page)
    bufs = dict(paged_kv_indptr_buffer=torch.zeros(len(lens) + 1, dtype=torch.int32, device=DEV),
                paged_kv_indices_buffer=torch.zeros(len(ind), dtype=torch.int32, device=DEV),
                paged_kv_last_page_len_buffer=torch.zeros(len(lens), dtype=torch.int32, device=DEV))
    w = pkvrt.BatchDecodeWithPagedKVCacheWrapper(torch.zeros(1024, dtype=torch.uint8, device=DEV), "NHD",
                                                 use_cuda_graph=True, share_prefixes=True, **bufs)
    w.plan(torch.as_tensor(ip), torch.as_tensor(ind, device=DEV), torch.as_tensor(lpl), hq, hkv, d,
           page, q_data_type=torch.float16)
    out = torch.full_like(q, float("nan"))
    lse = torch.full((len(lens), hq), float("nan"), device=DEV)
    from pkvrt.runtime.graphs import capture as capture_step

    graph = capture_step(lambda: w.run(q, (k, v), out=out, lse=lse)).graph
    out.fill_(float("nan"))
    graph.replay()
    k_hnd, v_hnd = k.transpose(1, 2), v.transpose(1, 2)   # the reference reads HND views
    ref, ref_lse = reference.decode_attention(q, k_hnd, v_hnd, torch.as_tensor(seq, device=DEV),
                                              torch.as_tensor(bt, device=DEV), return_lse=True)
    err = float((out.float() - ref).norm() / ref.norm())
    assert err < 2e-3, (err, w.explain())
    assert torch.allclose(lse, ref_lse, atol=2e-3, rtol=1e-3)
    found = w.runtime.found()
    assert found.tokens_saved > 0 and found.decision.shared, (found.decision, w.explain())


@pytest.mark.parametrize("device_planning", [False, True], ids=["host lengths", "device lengths"])
@pytest.mark.parametrize("capture", [False, True], ids=["eager", "engine graph"])
def test_layers_back_to_back_on_the_side_stream(device_planning, capture):
    """Six layers launched with no synchronization between them, each its own cache and q; a
    long shared prefix (the chunk decode, on the side stream, the long branch) and short own
    segments. Each layer's q is written on the caller's stream just before its run(), from the
    last layer's output (q + 0 * out: the same values, unless that output is NaN), as a model's
    next layer would. A side stream that did not wait for the caller's (its gather reads q
    before it is written: NaN), a merge that did not wait for the side stream, or a chunk decode
    that overwrote its static output before the last layer's merge read it gives some layer
    another layer's attention or NaN. Every layer against the FP32 reference, and against the
    same Runtime with ``shared_side_stream=False`` (the decodes one after the other)."""
    from pkvrt.runtime.graphs import capture as capture_step

    hq, hkv, layers, num_pages = 32, 8, 6, 4400
    lens = [8192 + 40 + 13 * i for i in range(8)]
    seq, bt = step(lens, [(list(range(8)), 512)], num_pages, seed=5)   # an 8K-token prefix
    gen = torch.Generator(device=DEV).manual_seed(5)
    ks = [torch.randn(num_pages, hkv, PAGE, 128, device=DEV, dtype=torch.float16, generator=gen)
          for _ in range(layers)]
    vs = [torch.randn_like(k) for k in ks]
    qs = [torch.randn(len(lens), hq, 128, device=DEV, dtype=torch.float16, generator=gen)
          for _ in range(layers)]
    seq_d, bt_d = torch.as_tensor(seq, device=DEV), torch.as_tensor(bt, device=DEV)
    outs = {}
    for side in (True, False):
        opts = pkvrt.RuntimeOptions(shared_when_predicted_faster=False, shared_side_stream=side,
                                    use_cuda_graph=not (capture and device_planning))
        rt = pkvrt.SharedPagesRuntime(hq, hkv, 128, PAGE, torch.float16, max_batch=8,
                                      max_pages_per_row=bt.shape[1], num_pages=num_pages,
                                      device_planning=device_planning,
                                      engine_capture=capture and not device_planning, options=opts)
        assert (rt._side is not None) == (side and DEV == "cuda")   # (the CPU dry run: none)
        out = [torch.full_like(q, float("nan")) for q in qs]
        q_in = [torch.full_like(q, float("nan")) for q in qs]

        def body():
            if device_planning:
                rt.plan(seq_d, bt_d)
            for layer, (k, v) in enumerate(zip(ks, vs)):
                torch.add(qs[layer], out[layer - 1] if layer else qs[layer], alpha=0, out=q_in[layer])
                rt.run(q_in[layer], k, v, out=out[layer])
        if not device_planning:
            rt.plan(seq, bt)
            assert rt.plan_used is not None, rt.explain()
        if capture:
            graph = capture_step(body).graph
            for t in (*out, *q_in):
                t.fill_(float("nan"))
            graph.replay()
        else:
            body()
        if DEV == "cuda":
            torch.cuda.synchronize()
        outs[side] = out
    for layer in range(layers):
        ref = reference.decode_attention(qs[layer], ks[layer], vs[layer], seq_d, bt_d)
        for side in (True, False):
            err = float((outs[side][layer].float() - ref).norm() / ref.norm())
            assert err < 2e-3, (layer, side, err)
        assert torch.allclose(outs[True][layer], outs[False][layer], atol=2e-3, rtol=0), layer
