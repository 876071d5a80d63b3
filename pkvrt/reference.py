"""Clear FP32 twins of the kernels: the slow reference every fast path is tested against.

Same arguments and layouts as the kernels (DESIGN.md): q [B, H_q, D], k_cache / v_cache
[num_pages, H_kv, page_size, D], seq_lens [B] int32, block_tables [B, max_pages] int32. Works on
any device (CPU in CI); computes in float32 (or float64 when asked).

Split states use the kernels' convention: scores in the log2 domain,
x_j = (q . k_j) * sm_scale * log2(e); m = max x_j; l = sum 2^(x_j - m); a = sum 2^(x_j - m) v_j.
The empty state is (m=-inf, l=0, a=0).
"""

from __future__ import annotations

import math

import torch

LOG2E = 1.4426950408889634


def gather_kv(cache: torch.Tensor, block_table_row: torch.Tensor, seq_len: int) -> torch.Tensor:
    """The row's tokens from a paged cache: [H_kv, seq_len, D], in logical order.

    cache [num_pages, H_kv, page_size, D]; block_table_row [max_pages]; only the first
    ceil(seq_len / page_size) entries are read.
    """
    page_size = cache.shape[2]
    n_pages = -(-seq_len // page_size)
    pages = block_table_row[:n_pages].long()
    kv = cache[pages]                                  # [n_pages, H_kv, page, D]
    kv = kv.permute(1, 0, 2, 3).reshape(cache.shape[1], n_pages * page_size, cache.shape[3])
    return kv[:, :seq_len]


def decode_attention(q, k_cache, v_cache, seq_lens, block_tables, sm_scale: float | None = None,
                     dtype=torch.float32) -> torch.Tensor:
    """Exact GQA decode attention. Returns out [B, H_q, D] in ``dtype``."""
    b, hq, d = q.shape
    hkv = k_cache.shape[1]
    g = hq // hkv
    scale = sm_scale if sm_scale is not None else 1.0 / math.sqrt(d)
    out = torch.empty(b, hq, d, dtype=dtype, device=q.device)
    lens = seq_lens.tolist()
    for i in range(b):
        k = gather_kv(k_cache, block_tables[i], lens[i]).to(dtype)      # [H_kv, N, D]
        v = gather_kv(v_cache, block_tables[i], lens[i]).to(dtype)
        qi = q[i].to(dtype).view(hkv, g, d)                              # [H_kv, G, D]
        scores = torch.einsum("hgd,hnd->hgn", qi, k) * scale             # [H_kv, G, N]
        p = torch.softmax(scores, dim=-1)
        out[i] = torch.einsum("hgn,hnd->hgd", p, v).reshape(hq, d)
    return out


def split_state(q_row, k, v, sm_scale: float):
    """State (m, l, a) of one row over the tokens given. q_row [H_q, D]; k, v [H_kv, N, D].

    Returns m [H_q], l [H_q], a [H_q, D] in float32; N = 0 gives the empty state.
    """
    hq, d = q_row.shape
    hkv = k.shape[0]
    g = hq // hkv
    if k.shape[1] == 0:
        return (torch.full((hq,), -math.inf), torch.zeros(hq), torch.zeros(hq, d))
    x = torch.einsum("hgd,hnd->hgn", q_row.float().view(hkv, g, d), k.float()) * (sm_scale * LOG2E)
    m = x.amax(dim=-1)                                                   # [H_kv, G]
    w = torch.exp2(x - m[..., None])
    l = w.sum(-1)
    a = torch.einsum("hgn,hnd->hgd", w, v.float())
    return m.reshape(hq), l.reshape(hq), a.reshape(hq, d)


def merge_states(m: torch.Tensor, l: torch.Tensor, a: torch.Tensor) -> torch.Tensor:
    """Exact merge of S split states. m, l [S, H]; a [S, H, D] -> O [H, D].

    m* = max_s m_s;  l* = sum_s 2^(m_s - m*) l_s;  O = sum_s 2^(m_s - m*) a_s / l*.
    Empty states (m_s = -inf) weigh 0.
    """
    m_all = m.amax(dim=0)                                                # [H]
    w = torch.where(torch.isinf(m) & (m < 0), torch.zeros_like(m), torch.exp2(m - m_all))
    l_all = (w * l).sum(0)
    return (w[..., None] * a).sum(0) / l_all[:, None]


def split_ranges(seq_len: int, num_splits: int, tile: int) -> list[tuple[int, int]]:
    """The bucket kernel's row-local split ranges: ceil(tiles / S) tiles each, clipped."""
    n_tiles = -(-seq_len // tile)
    per = -(-n_tiles // num_splits)
    return [(min(seq_len, s * per * tile), min(seq_len, (s + 1) * per * tile))
            for s in range(num_splits)]


def split_decode_attention(q, k_cache, v_cache, seq_lens, block_tables, num_splits: int,
                           tile: int = 32, sm_scale: float | None = None) -> torch.Tensor:
    """Decode attention computed the way the split kernels do: states per split, then merge.

    Equal to :func:`decode_attention` up to float32 rounding (a self-check of the merge math).
    """
    b, hq, d = q.shape
    scale = sm_scale if sm_scale is not None else 1.0 / math.sqrt(d)
    out = torch.empty(b, hq, d)
    for i, n in enumerate(seq_lens.tolist()):
        k = gather_kv(k_cache, block_tables[i], n)
        v = gather_kv(v_cache, block_tables[i], n)
        states = [split_state(q[i], k[:, s:e], v[:, s:e], scale)
                  for s, e in split_ranges(n, num_splits, tile)]
        m, l, a = (torch.stack(t) for t in zip(*states))
        out[i] = merge_states(m, l, a)
    return out
