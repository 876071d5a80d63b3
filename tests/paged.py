"""Random paged KV batches for kernel tests: holes, scattered pages, poisoned padding.

Everything a kernel must not read is made harmful: pages no row owns and token slots past a
row's seq_len hold NaN (a read leaks NaN into the output), and block-table padding holds a page
id far outside the cache (a read faults).
"""

from __future__ import annotations

import math

import attrs
import torch

BAD_PAGE = 1 << 30


@attrs.frozen
class PagedBatch:
    q: torch.Tensor             # [B, H_q, D]
    k_cache: torch.Tensor       # [P, H_kv, page, D]
    v_cache: torch.Tensor
    seq_lens: torch.Tensor      # [B] int32
    block_tables: torch.Tensor  # [B, max_pages] int32
    owned: torch.Tensor         # [P] bool: pages some row owns


def make_batch(seq_lens, *, num_qo_heads=32, num_kv_heads=8, head_dim=128, page_size=16,
               dtype=torch.float16, device="cuda", hole_fraction=0.5, seed=0, scale=1.0,
               pad_pages=2) -> PagedBatch:
    gen = torch.Generator().manual_seed(seed)
    lens = [int(n) for n in seq_lens]
    pages = [math.ceil(n / page_size) for n in lens]
    universe = math.ceil(sum(pages) / (1.0 - hole_fraction)) + 1
    perm = torch.randperm(universe, generator=gen)
    max_pages = max(pages) + pad_pages
    bt = torch.full((len(lens), max_pages), BAD_PAGE, dtype=torch.int32)
    owned = torch.zeros(universe, dtype=torch.bool)
    off = 0
    for i, n in enumerate(pages):
        ids = perm[off:off + n]
        bt[i, :n] = ids.int()
        owned[ids] = True
        off += n
    shape = (universe, num_kv_heads, page_size, head_dim)
    k = (torch.randn(shape, generator=gen) * scale).to(dtype)
    v = torch.randn(shape, generator=gen).to(dtype)
    k[~owned] = float("nan")
    v[~owned] = float("nan")
    for i, n in enumerate(lens):  # tail of each row's last page
        tail = n % page_size
        if tail:
            last = bt[i, pages[i] - 1].item()
            k[last, :, tail:] = float("nan")
            v[last, :, tail:] = float("nan")
    q = (torch.randn(len(lens), num_qo_heads, head_dim, generator=gen) * scale).to(dtype)
    to = dict(device=device)
    return PagedBatch(q=q.to(**to), k_cache=k.to(**to), v_cache=v.to(**to),
                      seq_lens=torch.tensor(lens, dtype=torch.int32, device=device),
                      block_tables=bt.to(**to), owned=owned.to(**to))


def rel_err(out: torch.Tensor, ref: torch.Tensor) -> float:
    return ((out.float() - ref.float()).norm() / ref.float().norm()).item()


def simple_tasks(seq_lens, hkv: int, splits: int, tile: int = 32):
    """Reference workqueue plan (the kernels' task layout without the planner): row i gets
    min(splits, its tiles) tile-aligned splits of equal tile counts, one task per (row, KV head,
    split). Returns (tasks [(row, kv_head, split, start, end)], split offsets [B + 1])."""
    tasks, offsets = [], [0]
    for row, n in enumerate(seq_lens):
        tiles = math.ceil(n / tile)
        s = min(splits, tiles)
        per = math.ceil(tiles / s)
        ranges = [(j * per * tile, min(n, (j + 1) * per * tile)) for j in range(s)]
        ranges = [r for r in ranges if r[0] < r[1]]
        tasks += [(row, h, j, a, e) for j, (a, e) in enumerate(ranges) for h in range(hkv)]
        offsets.append(offsets[-1] + len(ranges))
    return tasks, offsets

