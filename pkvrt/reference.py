"""Clear FP32 twins of the kernels: the slow reference every fast path is tested against.

Same arguments and layouts as the kernels (DESIGN.md): q [B, H_q, D], k_cache / v_cache
[num_pages, H_kv, page_size, D], seq_lens [B] int32, block_tables [B, max_pages] int32. Works on
any device (CPU in CI); computes in float32 (or float64 when asked).

FP8 K/V: k_cache / v_cache in torch.float8_e4m3fn with float32 scales ``k_scale``,
``v_scale`` of shape [1] (per tensor) or [H_kv] (per KV head); the value of an element is
``float(element) * scale[head]``. The twin dequantizes the tokens it reads that way
(:func:`dequantize_kv`) and runs the same FP32 attention. :func:`quantize_kv` is the inverse the
tests use to make FP8 caches. Error of FP8 K/V against attention over the unquantized values:
:func:`fp8_error_bound`.

Attention variants (the kernels' and FlashInfer's meanings): ``window_left`` >= 0 keeps each
row's last window_left + 1 tokens (-1: all); ``logits_soft_cap`` c > 0 replaces a score s by
c * tanh(s / c) (s = sm_scale * q . k); ``sinks`` [H_q] adds one logit per query head to the
softmax denominator only; ``return_lse`` also returns each row's and head's log2-sum-exp of its
scores (the sink not counted), FlashInfer's base-2 convention.

Split states use the kernels' convention: scores in the log2 domain,
x_j = (q . k_j) * sm_scale * log2(e); m = max x_j; l = sum 2^(x_j - m); a = sum 2^(x_j - m) v_j.
The empty state is (m=-inf, l=0, a=0).
"""

from __future__ import annotations

import math

import torch

LOG2E = 1.4426950408889634
FP8 = torch.float8_e4m3fn
FP8_MAX = 448.0            # largest finite e4m3fn value
FP8_UNIT_ROUNDOFF = 2.0 ** -4   # 3 mantissa bits, round to nearest: |x^ - x| <= 2^-4 |x| (normal x)
FP8_SUBNORMAL_HALF_ULP = 2.0 ** -10   # below the smallest normal 2^-6 the spacing is 2^-9


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


def _head_scale(scale: torch.Tensor | None, num_kv_heads: int, name: str, dtype) -> torch.Tensor | None:
    """``scale`` ([1] or [H_kv]) as [H_kv, 1, 1] in ``dtype``, for [H_kv, N, D] tokens; None stays None."""
    if scale is None:
        return None
    if scale.dim() != 1 or scale.shape[0] not in (1, num_kv_heads):
        raise ValueError(f"{name}: expected shape [1] or [H_kv={num_kv_heads}], got {tuple(scale.shape)}")
    return scale.to(dtype).expand(num_kv_heads)[:, None, None]


def dequantize_kv(tokens: torch.Tensor, scale: torch.Tensor | None, dtype=torch.float32) -> torch.Tensor:
    """Tokens of a paged cache as ``dtype``: ``tokens.to(dtype) * scale[head]``.

    tokens [H_kv, N, D] (from :func:`gather_kv`); scale None (fp16/bf16 caches: a plain cast) or
    float32 [1] / [H_kv] (FP8 caches).
    """
    s = _head_scale(scale, tokens.shape[0], "scale", dtype)
    return tokens.to(dtype) if s is None else tokens.to(dtype) * s


def quantize_kv(cache: torch.Tensor, *, per_head: bool, scale_error: float = 1.0):
    """An FP8 copy of a cache and its float32 scales, ``scale = amax / 448`` (per KV head or over
    the whole tensor; NaN poison is ignored by the amax and stays NaN).

    cache [P, H_kv, page, D] (any float dtype). Returns (fp8 cache, scale [H_kv] or [1]).
    ``scale_error`` multiplies the returned scale (tests: a wrong scale must break the bound).
    """
    x = cache.float()
    amax = (x.abs().nan_to_num(0.0).amax(dim=(0, 2, 3)) if per_head
            else x.abs().nan_to_num(0.0).amax().reshape(1))                # [H_kv] or [1]
    scale = torch.where(amax > 0, amax / FP8_MAX, torch.ones_like(amax))
    q = (x / scale.expand(cache.shape[1])[None, :, None, None]).to(FP8)
    return q, (scale * scale_error).to(torch.float32)


def window_start(seq_len: int, window_left: int = -1) -> int:
    """The first token a row of ``seq_len`` tokens attends to: its last window_left + 1 tokens
    with a sliding window (window_left >= 0), all of them with -1 (kernels' window_start)."""
    return max(0, seq_len - 1 - window_left) if window_left >= 0 else 0


def decode_attention(q, k_cache, v_cache, seq_lens, block_tables, sm_scale: float | None = None,
                     dtype=torch.float32, *, k_scale: torch.Tensor | None = None,
                     v_scale: torch.Tensor | None = None, window_left: int = -1,
                     logits_soft_cap: float = 0.0, sinks: torch.Tensor | None = None,
                     return_lse: bool = False):
    """Exact GQA decode attention. Returns out [B, H_q, D] in ``dtype`` (and lse [B, H_q] float32
    with ``return_lse``: log2 of the sum of 2^(score * log2 e) over the attended tokens).

    k_cache, v_cache : [num_pages, H_kv, page_size, D] as indexed (any strides: an NHD cache is
        ``cache.transpose(1, 2)``).
    k_scale, v_scale : None for fp16/bf16/fp32 caches; float32 [1] or [H_kv] for FP8 caches
        (the tokens read are dequantized with :func:`dequantize_kv`, then the same attention).
    window_left, logits_soft_cap, sinks : the variants of the module docstring.
    """
    b, hq, d = q.shape
    hkv = k_cache.shape[1]
    g = hq // hkv
    scale = sm_scale if sm_scale is not None else 1.0 / math.sqrt(d)
    out = torch.empty(b, hq, d, dtype=dtype, device=q.device)
    lse = torch.empty(b, hq, dtype=torch.float32, device=q.device)
    lens = seq_lens.tolist()
    for i in range(b):
        start = window_start(lens[i], window_left)
        k = dequantize_kv(gather_kv(k_cache, block_tables[i], lens[i]), k_scale, dtype)[:, start:]
        v = dequantize_kv(gather_kv(v_cache, block_tables[i], lens[i]), v_scale, dtype)[:, start:]
        qi = q[i].to(dtype).view(hkv, g, d)                              # [H_kv, G, D]
        scores = torch.einsum("hgd,hnd->hgn", qi, k) * scale             # [H_kv, G, N]
        if logits_soft_cap and logits_soft_cap > 0:
            scores = logits_soft_cap * torch.tanh(scores / logits_soft_cap)
        lse[i] = (torch.logsumexp(scores, dim=-1) * LOG2E).reshape(hq).float()
        if sinks is not None:   # one more logit per head in the denominator, no value
            sink = sinks.to(dtype).view(hkv, g, 1)
            p = torch.softmax(torch.cat([scores, sink], dim=-1), dim=-1)[..., :-1]
        else:
            p = torch.softmax(scores, dim=-1)
        out[i] = torch.einsum("hgn,hnd->hgd", p, v).reshape(hq, d)
    return (out, lse) if return_lse else out


def split_state(q_row, k, v, sm_scale: float, logits_soft_cap: float = 0.0):
    """State (m, l, a) of one row over the tokens given. q_row [H_q, D]; k, v [H_kv, N, D].

    Returns m [H_q], l [H_q], a [H_q, D] in float32; N = 0 gives the empty state. With a soft
    cap c > 0 the scores are c * tanh(sm_scale * q . k / c) before the log2 domain.
    """
    hq, d = q_row.shape
    hkv = k.shape[0]
    g = hq // hkv
    if k.shape[1] == 0:
        return (torch.full((hq,), -math.inf), torch.zeros(hq), torch.zeros(hq, d))
    x = torch.einsum("hgd,hnd->hgn", q_row.float().view(hkv, g, d), k.float()) * sm_scale
    if logits_soft_cap and logits_soft_cap > 0:
        x = logits_soft_cap * torch.tanh(x / logits_soft_cap)
    x = x * LOG2E
    m = x.amax(dim=-1)                                                   # [H_kv, G]
    w = torch.exp2(x - m[..., None])
    l = w.sum(-1)
    a = torch.einsum("hgn,hnd->hgd", w, v.float())
    return m.reshape(hq), l.reshape(hq), a.reshape(hq, d)


def merge_states(m: torch.Tensor, l: torch.Tensor, a: torch.Tensor, sinks=None,
                 return_lse: bool = False):
    """Exact merge of S split states. m, l [S, H]; a [S, H, D] -> O [H, D] (and lse [H]).

    m* = max_s m_s;  l* = sum_s 2^(m_s - m*) l_s;  O = sum_s 2^(m_s - m*) a_s / l*.
    Empty states (m_s = -inf) weigh 0. sinks [H] (natural-log logits) join the denominator:
    O = sum_s 2^(m_s - m*) a_s / (l* + 2^(sink * log2 e - m*)). lse = m* + log2(l*), the sink
    not counted.
    """
    m_all = m.amax(dim=0)                                                # [H]
    w = torch.where(torch.isinf(m) & (m < 0), torch.zeros_like(m), torch.exp2(m - m_all))
    l_all = (w * l).sum(0)
    den = l_all if sinks is None else l_all + torch.exp2(sinks.float() * LOG2E - m_all)
    out = (w[..., None] * a).sum(0) / den[:, None]
    return (out, m_all + torch.log2(l_all)) if return_lse else out


def split_ranges(seq_len: int, num_splits: int, tile: int) -> list[tuple[int, int]]:
    """The bucket kernel's row-local split ranges: ceil(tiles / S) tiles each, clipped."""
    n_tiles = -(-seq_len // tile)
    per = -(-n_tiles // num_splits)
    return [(min(seq_len, s * per * tile), min(seq_len, (s + 1) * per * tile))
            for s in range(num_splits)]


def split_decode_attention(q, k_cache, v_cache, seq_lens, block_tables, num_splits: int,
                           tile: int = 32, sm_scale: float | None = None, *,
                           k_scale: torch.Tensor | None = None,
                           v_scale: torch.Tensor | None = None) -> torch.Tensor:
    """Decode attention computed the way the split kernels do: states per split, then merge.

    Equal to :func:`decode_attention` up to float32 rounding (a self-check of the merge math);
    k_scale / v_scale as there.
    """
    b, hq, d = q.shape
    scale = sm_scale if sm_scale is not None else 1.0 / math.sqrt(d)
    out = torch.empty(b, hq, d)
    for i, n in enumerate(seq_lens.tolist()):
        k = dequantize_kv(gather_kv(k_cache, block_tables[i], n), k_scale)
        v = dequantize_kv(gather_kv(v_cache, block_tables[i], n), v_scale)
        states = [split_state(q[i], k[:, s:e], v[:, s:e], scale)
                  for s, e in split_ranges(n, num_splits, tile)]
        m, l, a = (torch.stack(t) for t in zip(*states))
        out[i] = merge_states(m, l, a)
    return out


def fp8_error_bound(q, k_cache, v_cache, seq_lens, block_tables, *, k_scale, v_scale,
                    sm_scale: float | None = None, sigmas: float = 3.0) -> float:
    """Bound on ``||O_fp8 - O||_F`` over the batch: O is attention over the unquantized caches,
    O_fp8 over their FP8 copies quantized with ``k_scale`` / ``v_scale`` (:func:`quantize_kv`).

    q [B, H_q, D]; k_cache, v_cache [P, H_kv, page, D] UNquantized; scales float32 [1] / [H_kv].

    Derivation. e4m3 keeps 3 mantissa bits, so rounding x/s to nearest moves it by at most
    2^-4 |x/s| (normal range), or by half the subnormal spacing 2^-10 below 2^-6:
    ``|dk| <= e(k) = max(2^-4 |k|, 2^-10 s)``. To first order in the errors, with
    x_j = sm * q.k_j, p = softmax(x), o = sum_j p_j v_j:

        dx_j = sm * sum_d q_d dk_jd,   dp_j = p_j (dx_j - sum_i p_i dx_i)
        do_d = sum_j p_j dv_jd + sum_j p_j dx_j (v_jd - o_d)

    The worst case (every error at +-e, all aligned) is vacuous: for N(0, 1) data at D = 128,
    |dx_j| <= sm * 2^-4 * sum_d |q_d k_jd| ~ 0.45, so p may move by e^0.9 - 1 = 150 %. Round to
    nearest on data that is not aligned with the grid gives independent zero-mean errors
    instead, with Var(dk) <= e(k)^2, hence

        Var(do_d) <= sum_j p_j^2 e(v_jd)^2 + sm^2 sum_j p_j^2 (v_jd - o_d)^2 sum_e q_e^2 e(k_je)^2

    and ``E ||dO||_F^2 <= sum over rows, heads, d of that``. The bound returned is ``sigmas``
    times its square root. Uniform rounding errors have a variance near e^2/3, so the real
    error sits near 0.4 of the root (measured 0.39-0.42 at D 64, 128, 256); 3 leaves room for
    the second-order terms and the spread. Example, N(0, 1) data, rows of 1, 37, 129, 300
    tokens, H_q 8, H_kv 2: the root is 6.5 % of ||O||; the FP8 error is 0.4 roots; a 4x scale
    error costs 46 roots on V, 13 on K (1.25x: 3.9 on V, 1.5 on K).
    """
    b, hq, d = q.shape
    hkv = k_cache.shape[1]
    g = hq // hkv
    sm = sm_scale if sm_scale is not None else 1.0 / math.sqrt(d)
    sk = _head_scale(k_scale, hkv, "k_scale", torch.float64)
    sv = _head_scale(v_scale, hkv, "v_scale", torch.float64)
    var = 0.0
    for i, n in enumerate(seq_lens.tolist()):
        k = gather_kv(k_cache, block_tables[i], n).double()                   # [H_kv, N, D]
        v = gather_kv(v_cache, block_tables[i], n).double()
        ek = torch.maximum(FP8_UNIT_ROUNDOFF * k.abs(), FP8_SUBNORMAL_HALF_ULP * sk)
        ev = torch.maximum(FP8_UNIT_ROUNDOFF * v.abs(), FP8_SUBNORMAL_HALF_ULP * sv)
        qi = q[i].double().view(hkv, g, d)                                    # [H_kv, G, D]
        p = torch.softmax(torch.einsum("hgd,hnd->hgn", qi, k) * sm, dim=-1)  # [H_kv, G, N]
        o = torch.einsum("hgn,hnd->hgd", p, v)
        p2 = p * p
        var_x = sm * sm * torch.einsum("hgd,hnd->hgn", qi * qi, ek * ek)     # Var(dx_j) bound
        var_v = torch.einsum("hgn,hnd->hgd", p2, ev * ev)
        dev2 = (v[:, None] - o[:, :, None]) ** 2                              # [H_kv, G, N, D]
        var += (var_v.sum() + torch.einsum("hgn,hgnd->", p2 * var_x, dev2)).item()
    return sigmas * math.sqrt(var)
