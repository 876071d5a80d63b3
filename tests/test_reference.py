"""Self-checks of the FP32 reference (CPU): the twin every kernel is compared with."""

import math

import pytest
import torch

from pkvrt import reference
from paged import make_batch


def dense_attention(q, k, v, scale):
    # q [H_q, D], k/v [H_kv, N, D] in float64, the textbook formula (1) of the paper.
    g = q.shape[0] // k.shape[0]
    k = k.repeat_interleave(g, 0)
    v = v.repeat_interleave(g, 0)
    p = torch.softmax(torch.einsum("hd,hnd->hn", q, k) * scale, -1)
    return torch.einsum("hn,hnd->hd", p, v)


@pytest.mark.parametrize("page_size", [1, 16, 64])
@pytest.mark.parametrize("group", [1, 4, 8])
def test_reference_matches_dense_softmax(page_size, group):
    b = make_batch([1, 37, 300], num_qo_heads=8 * group // 2, num_kv_heads=4, head_dim=64,
                   page_size=page_size, dtype=torch.float32, device="cpu", seed=page_size + group)
    out = reference.decode_attention(b.q, b.k_cache, b.v_cache, b.seq_lens, b.block_tables,
                                     dtype=torch.float64)
    for i, n in enumerate(b.seq_lens.tolist()):
        k = reference.gather_kv(b.k_cache, b.block_tables[i], n).double()
        v = reference.gather_kv(b.v_cache, b.block_tables[i], n).double()
        ref = dense_attention(b.q[i].double(), k, v, 1 / math.sqrt(64))
        torch.testing.assert_close(out[i], ref, rtol=1e-9, atol=1e-9)
    assert torch.isfinite(out).all()  # padding and unowned pages (NaN, bad ids) never read


@pytest.mark.parametrize("splits", [1, 2, 5, 64])
def test_split_then_merge_is_exact(splits):
    b = make_batch([1, 33, 1000, 4097], num_qo_heads=8, num_kv_heads=2, head_dim=64,
                   page_size=16, dtype=torch.float32, device="cpu", seed=splits)
    whole = reference.decode_attention(b.q, b.k_cache, b.v_cache, b.seq_lens, b.block_tables)
    split = reference.split_decode_attention(b.q, b.k_cache, b.v_cache, b.seq_lens,
                                             b.block_tables, splits)
    torch.testing.assert_close(split, whole, rtol=2e-5, atol=2e-6)


def test_merge_ignores_empty_states_and_large_logits():
    h, d = 3, 8
    m = torch.tensor([[1e4, 5.0, -math.inf], [-math.inf, 7.0, -math.inf], [1e4 - 1, 6.0, 0.0]])
    l = torch.tensor([[2.0, 1.0, 0.0], [0.0, 3.0, 0.0], [1.0, 1.0, 1.0]])
    a = torch.randn(3, h, d)
    a[1, 0] = 0
    a[0, 2] = 0
    a[1, 2] = 0
    out = reference.merge_states(m, l, a)
    assert torch.isfinite(out).all()
    # head 0: states 0 and 2 with weights 1 and 2^-1
    torch.testing.assert_close(out[0], (a[0, 0] + 0.5 * a[2, 0]) / (2.0 + 0.5))
    # head 2: only state 2 is non-empty
    torch.testing.assert_close(out[2], a[2, 2] / 1.0)


def test_split_ranges_are_row_local_and_cover():
    for n in [1, 31, 32, 33, 1000, 32768]:
        for s in [1, 3, 32]:
            rs = reference.split_ranges(n, s, 32)
            assert rs[0][0] == 0 and rs[-1][1] == n
            assert all(a <= b for a, b in rs)
            assert all(rs[i][1] == rs[i + 1][0] for i in range(s - 1))
            assert all(a % 32 == 0 for a, b in rs if a < b)


def test_simple_tasks_is_the_kernels_task_layout():
    """tests/paged.simple_tasks, the GPU tests' and isolated.py's reference workqueue plan: 100
    tokens = 4 tiles cut in 3 splits of 2 tiles (the last empty split dropped), one task per KV
    head; a 1-token row keeps one split."""
    from paged import simple_tasks

    tasks, offsets = simple_tasks([100, 1], 2, 3)
    assert offsets == [0, 2, 3]
    assert tasks == [(0, 0, 0, 0, 64), (0, 1, 0, 0, 64), (0, 0, 1, 64, 100), (0, 1, 1, 64, 100),
                     (1, 0, 0, 0, 1), (1, 1, 0, 0, 1)]
