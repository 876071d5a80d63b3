"""A Llama-3-8B-shaped decoder for decode steps: what an attention library does to a model's
decode step. Used by ``examples/llama_decode.py``,
``benches/model_decode.py`` and the tests; not part of the embedding API.

Shape (:data:`LLAMA3_8B`): 32 layers, hidden 4096, H_q 32, H_kv 8, D 128, SwiGLU MLP 14336,
vocab 128256, RMSNorm (eps 1e-5), RoPE (theta 500000), fp16. Weights are random, drawn on the
device from a seed (nothing is downloaded), each linear ~ N(0, 1/fan_in) so that every
projection of a normalized input has unit variance and the residual stream stays finite over
32 layers (it grows like sqrt(layers)); norm weights are 1.

One decode step of B rows, one new token each (:meth:`Model.forward`)::

    x = embed[tokens]                                   x: [B, hidden], the residual stream
    per layer:
        q, k, v = rms_norm(x) @ W_qkv^T                 [B, H_q, D], [B, H_kv, D], [B, H_kv, D]
        q, k = rope(q, pos), rope(k, pos)               pos = seq_len - 1, the new token's place
        k_cache[page, :, slot] = k; v_cache[...] = v    the row's current page (PagePool)
        o = attention(q, k_cache, v_cache)              [B, H_q, D] over the row's seq_len tokens
        x = x + o @ W_o^T
        g, u = rms_norm(x) @ W_gate_up^T                [B, 14336] each
        x = x + (silu(g) * u) @ W_down^T
    logits = rms_norm(x) @ W_head^T                     [B, vocab]; tokens = argmax (greedy)

Every layer has its own paged cache ``[num_pages, H_kv, page_size, D]`` (HND, the layout pkvrt
and FlashInfer read), all rows' pages drawn from one free list (:class:`PagePool`). The step's
non-attention work is plain PyTorch (cuBLAS GEMMs, a few elementwise kernels), identical for
every attention backend; the backend (``pkvrt.measure.model_attention``) only plans and attends.
Not modelled: prefill (the caches hold random K/V for the context), Llama-3.1's RoPE frequency
scaling (the same cost), sampling beyond argmax; tensor parallelism is ``pkvrt.measure.model_tp``.

A step is split into host work and device work, so that the device work can be captured in one
CUDA graph per batch size (:meth:`DecodeLoop.capture`) and replayed with new lengths:

* :meth:`DecodeLoop.prepare` (host, every step): the pool places each row's new token (a new
  page from the free list when the token starts one), the lengths and slots go to the device in
  one asynchronous copy (the block tables in a second one on steps where a row took a page),
  then the backend's own host work (FlashInfer: ``plan()``).
* :meth:`DecodeLoop.forward` (device, capturable): the step above, reading only static buffers.

Memory (:func:`weight_bytes`, :func:`kv_bytes`): the 8B model is 16.1 GB of fp16 weights; a
token's K and V over 32 layers are 128 KiB, so B8 x 128K needs 137 GB of KV and does not fit an
H200 with the weights (:func:`plan_cases` says which cases fit and why the others do not).
"""

from __future__ import annotations

import attrs
import numpy as np
import torch
import torch.nn.functional as F

from pkvrt import reference

DTYPE_BYTES = {torch.float16: 2, torch.bfloat16: 2, torch.float32: 4}
HEADROOM_BYTES = 4 * 2**30   # CUDA context, cuBLAS/FlashInfer workspaces, graph pools, logits


@attrs.frozen
class ModelConfig:
    """A Llama-style decoder shape. ``hidden == num_qo_heads * head_dim`` (Llama-3's)."""

    layers: int = 32
    hidden: int = 4096
    num_qo_heads: int = 32
    num_kv_heads: int = 8
    head_dim: int = 128
    intermediate: int = 14336
    vocab: int = 128256
    page_size: int = 16
    rope_theta: float = 500000.0
    norm_eps: float = 1e-5
    dtype: torch.dtype = torch.float16
    name: str = "llama3-8b"

    def __attrs_post_init__(self):
        for key in ("layers", "hidden", "num_qo_heads", "num_kv_heads", "head_dim",
                    "intermediate", "vocab", "page_size"):
            v = getattr(self, key)
            if isinstance(v, bool) or not isinstance(v, int) or v < 1:
                raise ValueError(f"ModelConfig: {key}={v!r}: expected a positive integer")
        if self.hidden != self.num_qo_heads * self.head_dim:
            raise ValueError(f"ModelConfig: hidden={self.hidden}: expected num_qo_heads * head_dim "
                             f"= {self.num_qo_heads * self.head_dim}")
        if self.num_qo_heads % self.num_kv_heads:
            raise ValueError(f"ModelConfig: num_qo_heads={self.num_qo_heads}: expected a multiple "
                             f"of num_kv_heads={self.num_kv_heads}")
        if self.head_dim % 2:
            raise ValueError(f"ModelConfig: head_dim={self.head_dim}: expected an even number (RoPE pairs)")
        if self.page_size & (self.page_size - 1):
            raise ValueError(f"ModelConfig: page_size={self.page_size}: expected a power of two")
        if self.dtype not in DTYPE_BYTES:
            raise ValueError(f"ModelConfig: dtype={self.dtype}: expected float16, bfloat16 or float32")

    @property
    def qkv_dim(self) -> int:
        return (self.num_qo_heads + 2 * self.num_kv_heads) * self.head_dim

    @property
    def dtype_bytes(self) -> int:
        return DTYPE_BYTES[self.dtype]


LLAMA3_8B = ModelConfig()
# Two layers of the same kind, small enough for a CPU test (float32) and for the pkvrt and
# FlashInfer kernels (D 128, G 4) in a GPU test.
TINY = ModelConfig(layers=2, hidden=512, num_qo_heads=4, num_kv_heads=1, head_dim=128,
                   intermediate=1024, vocab=1000, name="tiny")


# --------------------------------------------------------------------------- memory

def weight_bytes(cfg: ModelConfig) -> int:
    """Bytes of the weights: per layer W_qkv, W_o, W_gate_up, W_down and two norms; the
    embedding, the LM head and the final norm. LLAMA3_8B: 8.03e9 parameters, 16.06e9 B."""
    h = cfg.hidden
    per_layer = (cfg.qkv_dim * h + h * h + 2 * cfg.intermediate * h + cfg.intermediate * h + 2 * h)
    return cfg.dtype_bytes * (cfg.layers * per_layer + 2 * cfg.vocab * h + h)


def pages_needed(batch: int, context: int, steps: int, page_size: int) -> int:
    """Pages of a batch whose rows hold ``context`` tokens and decode ``steps`` more."""
    return batch * -(-(context + steps) // page_size)


def kv_bytes(cfg: ModelConfig, batch: int, context: int, steps: int) -> int:
    """Bytes of all layers' K and V caches (:func:`pages_needed` pages each).

    Worked example, LLAMA3_8B, B8, 128K context, 24 steps: 8 * ceil(131096 / 16) = 65552 pages;
    a page of one layer is 2 (K, V) * 8 heads * 16 tokens * 128 * 2 B = 64 KiB, times 32 layers
    = 2 MiB: 65552 * 2 MiB = 137.5e9 B (128.0 GiB).
    """
    per_page = 2 * cfg.num_kv_heads * cfg.page_size * cfg.head_dim * cfg.dtype_bytes
    return cfg.layers * pages_needed(batch, context, steps, cfg.page_size) * per_page


@attrs.frozen
class Case:
    """One (batch, context) of the benchmark and whether it fits the device."""

    batch: int
    context: int
    kv_bytes: int
    weight_bytes: int
    need_bytes: int      # weights + KV + headroom
    fits: bool
    reason: str | None   # why it is skipped (None when it fits)

    @property
    def name(self) -> str:
        return case_name(self.batch, self.context)


def case_name(batch: int, context: int) -> str:
    """``B4-32K`` (context in units of 1024 tokens when it is a multiple, else in tokens)."""
    ctx = f"{context // 1024}K" if context % 1024 == 0 else str(context)
    return f"B{batch}-{ctx}"


def plan_cases(cfg: ModelConfig, batches, contexts, *, steps: int, capacity_bytes: int,
               headroom_bytes: int = HEADROOM_BYTES) -> list[Case]:
    """Every (batch, context), with the bytes it needs and whether they fit ``capacity_bytes``
    (the device's memory). A case fits when weights + KV + ``headroom_bytes`` <= capacity.

    Example, LLAMA3_8B on an H200 (139.8 GiB): B8 x 128K needs 15.0 (weights) + 128.0 (KV) + 4
    GiB = 147.0 GiB and is skipped; B4 x 128K needs 83.0 GiB and fits.
    """
    w = weight_bytes(cfg)
    out = []
    for b in batches:
        for ctx in contexts:
            kv = kv_bytes(cfg, b, ctx, steps)
            need = w + kv + headroom_bytes
            fits = need <= capacity_bytes
            reason = None if fits else (
                f"needs {need / 2**30:.1f} GiB (weights {w / 2**30:.1f} + KV {kv / 2**30:.1f} + "
                f"headroom {headroom_bytes / 2**30:.1f}) > {capacity_bytes / 2**30:.1f} GiB of "
                "device memory")
            out.append(Case(batch=b, context=ctx, kv_bytes=kv, weight_bytes=w, need_bytes=need,
                            fits=fits, reason=reason))
    return out


# --------------------------------------------------------------------------- weights and caches

@attrs.frozen(eq=False)
class LayerWeights:
    attn_norm: torch.Tensor   # [hidden]
    qkv: torch.Tensor         # [(H_q + 2 H_kv) D, hidden]: q rows, then k, then v
    o: torch.Tensor           # [hidden, H_q D]
    mlp_norm: torch.Tensor    # [hidden]
    gate_up: torch.Tensor     # [2 intermediate, hidden]: gate rows, then up
    down: torch.Tensor        # [hidden, intermediate]


@attrs.frozen(eq=False)
class Weights:
    embed: torch.Tensor       # [vocab, hidden]
    layers: tuple             # LayerWeights per layer
    final_norm: torch.Tensor  # [hidden]
    lm_head: torch.Tensor     # [vocab, hidden]


def weight_draws(cfg: ModelConfig, *, device="cuda", seed: int = 0):
    """The random matrices of :func:`make_weights`, drawn one at a time in its order from one
    seeded generator of ``device``: per layer ``qkv``, ``o``, ``gate_up``, ``down`` (linears ~
    N(0, 1/fan_in)), then ``embed`` (N(0, 1)) and ``lm_head``. Yields ``(name, layer, tensor)``
    (layer None for the last two), so a caller can keep a slice of each matrix and drop the rest
    (``pkvrt.measure.model_tp``: one rank's shard of the 8B model without holding all of it)."""
    gen = torch.Generator(device=device).manual_seed(seed)

    def linear(out_f: int, in_f: int) -> torch.Tensor:
        w = torch.randn(out_f, in_f, generator=gen, device=device, dtype=cfg.dtype)
        return w.mul_(in_f ** -0.5)

    h, inter = cfg.hidden, cfg.intermediate
    for layer in range(cfg.layers):
        yield "qkv", layer, linear(cfg.qkv_dim, h)
        yield "o", layer, linear(h, h)
        yield "gate_up", layer, linear(2 * inter, h)
        yield "down", layer, linear(h, inter)
    yield "embed", None, torch.randn(cfg.vocab, h, generator=gen, device=device, dtype=cfg.dtype)
    yield "lm_head", None, linear(cfg.vocab, h)


def make_weights(cfg: ModelConfig, *, device="cuda", seed: int = 0) -> Weights:
    """Random weights drawn on ``device`` (a seeded generator of that device, :func:`weight_draws`):
    linears ~ N(0, 1/fan_in), embedding ~ N(0, 1), norms 1. Allocates :func:`weight_bytes`."""
    drawn = {(name, layer): t for name, layer, t in weight_draws(cfg, device=device, seed=seed)}

    def ones() -> torch.Tensor:
        return torch.ones(cfg.hidden, device=device, dtype=cfg.dtype)

    layers = tuple(LayerWeights(attn_norm=ones(), qkv=drawn["qkv", i], o=drawn["o", i],
                                mlp_norm=ones(), gate_up=drawn["gate_up", i], down=drawn["down", i])
                   for i in range(cfg.layers))
    return Weights(embed=drawn["embed", None], layers=layers, final_norm=ones(),
                   lm_head=drawn["lm_head", None])


@attrs.frozen(eq=False)
class KVCaches:
    """Every layer's paged cache: k, v ``[layers, num_pages, H_kv, page_size, D]``; layer l's
    cache is the contiguous view ``k[l]``."""

    k: torch.Tensor
    v: torch.Tensor

    @property
    def num_pages(self) -> int:
        return self.k.shape[1]


def cache_draws(cfg: ModelConfig, num_pages: int, dest, *, device="cuda", seed: int = 1):
    """The random K/V of :func:`make_caches` in its order (layer 0's K, layer 0's V, layer 1's
    K, ...), from one seeded generator of ``device``: fills ``dest(layer, i)`` (i 0 for K, 1 for
    V; a contiguous ``[num_pages, H_kv, page_size, D]`` tensor) with N(0, 1) and yields
    ``(layer, i, tensor)``. A caller that keeps a slice (``pkvrt.measure.model_tp``: one rank's KV heads)
    passes one scratch tensor as every ``dest`` and copies out of it."""
    gen = torch.Generator(device=device).manual_seed(seed)
    for layer in range(cfg.layers):
        for i in (0, 1):
            yield layer, i, dest(layer, i).normal_(generator=gen)


def make_caches(cfg: ModelConfig, num_pages: int, *, device="cuda", seed: int = 1) -> KVCaches:
    """Caches of ``num_pages`` pages per layer filled with N(0, 1) K and V (the stand-in for a
    prefill), drawn layer by layer on ``device`` (:func:`cache_draws`). Allocates
    :func:`kv_bytes`' worth."""
    shape = (cfg.layers, num_pages, cfg.num_kv_heads, cfg.page_size, cfg.head_dim)
    kv = (torch.empty(shape, device=device, dtype=cfg.dtype),
          torch.empty(shape, device=device, dtype=cfg.dtype))
    for _ in cache_draws(cfg, num_pages, lambda layer, i: kv[i][layer], device=device, seed=seed):
        pass
    return KVCaches(k=kv[0], v=kv[1])


# --------------------------------------------------------------------------- RoPE and append

def rope_inv_freq(cfg: ModelConfig, device) -> torch.Tensor:
    """float64 [D/2]: theta^(-2i/D), the angle per position of pair i."""
    i = torch.arange(0, cfg.head_dim, 2, device=device, dtype=torch.float64)
    return cfg.rope_theta ** (-i / cfg.head_dim)


def rope_rotation(positions: torch.Tensor, inv_freq: torch.Tensor) -> torch.Tensor:
    """complex64 [B, D/2]: e^(i * pos * theta^(-2i/D)) for each row's position (int [B]).

    The angles are formed in float64: in float32, pos * theta^0 at pos 131071 is off by up to
    0.008 rad (its ulp), a visible error at 128K contexts; [B, D/2] float64 costs nothing."""
    angle = positions.double()[:, None] * inv_freq[None, :]
    return torch.polar(torch.ones_like(angle), angle).to(torch.complex64)


def apply_rope(x: torch.Tensor, rotation: torch.Tensor) -> torch.Tensor:
    """x [B, H, D] with pairs (2i, 2i+1) rotated by ``rotation`` [B, D/2] (Meta's Llama
    reference convention; Hugging Face's rotate_half pairs (i, i + D/2), the same up to a
    permutation of the q/k weight rows, which random weights do not notice). Computed in
    float32; returns a new contiguous [B, H, D] tensor of x's dtype."""
    b, h, d = x.shape
    xc = torch.view_as_complex(x.float().reshape(b, h, d // 2, 2))   # [B, H, D/2]
    return torch.view_as_real(xc * rotation[:, None, :]).reshape(b, h, d).to(x.dtype)


def append_kv(k_cache: torch.Tensor, v_cache: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
              page: torch.Tensor, slot: torch.Tensor) -> None:
    """Write each row's new token into its page: ``k_cache[page[r], :, slot[r]] = k[r]``.

    k_cache, v_cache : [num_pages, H_kv, page_size, D]. k, v : [B, H_kv, D].
    page, slot : int64 [B], the page id and the token's place in it (:meth:`PagePool.advance`).
    """
    k_cache[page, :, slot] = k
    v_cache[page, :, slot] = v


# --------------------------------------------------------------------------- the page pool

@attrs.frozen
class Slots:
    """Where one step's new tokens go: seq_lens [B] (tokens after the append, the new one
    included), page [B] (its page id), slot [B] (its place in the page), and whether a row took
    a new page this step (the block tables changed)."""

    seq_lens: np.ndarray
    page: np.ndarray
    slot: np.ndarray
    new_page: bool


class PagePool:
    """The host side of a batch's paged cache: a free list of page ids, each row's length and
    block table (int32 [B, max_pages_per_row]; entries past a row's pages are 0, a page every
    cache has, so a kernel that sized its grid by the table's width reads inside the cache).

    The free list is a seeded permutation of ``range(num_pages)``, taken from its end, so a row's
    pages are scattered over the cache as in a serving engine. :meth:`reset` gives every row
    ``context`` tokens (their pages taken row after row); :meth:`advance` places one new token
    per row, taking a page when the token starts one.
    """

    def __init__(self, num_pages: int, *, batch: int, max_pages_per_row: int, page_size: int,
                 seed: int = 0):
        self.num_pages, self.batch, self.page_size = num_pages, batch, page_size
        self._perm = np.random.default_rng(seed).permutation(num_pages).astype(np.int32)
        self.block_tables = np.zeros((batch, max_pages_per_row), dtype=np.int32)
        self.lengths = np.zeros(batch, dtype=np.int64)
        self._free = self._perm.copy()
        self._top = 0      # free pages: _free[:_top]
        self.version = 0   # bumped whenever the block tables change (a reset, a new page)

    @property
    def free_pages(self) -> int:
        return self._top

    def _take(self, n: int, why: str) -> np.ndarray:
        if n > self._top:
            raise RuntimeError(f"PagePool: {why} needs {n} free page(s) but the free list has "
                               f"{self._top} of {self.num_pages}: size the cache with "
                               "pages_needed(batch, context, steps, page_size)")
        self._top -= n
        return self._free[self._top:self._top + n][::-1].copy()

    def reset(self, context: int) -> None:
        """Every row holds ``context`` tokens (>= 0); the free list starts over, so a reset with
        the same context gives the same pages."""
        w = self.block_tables.shape[1]
        need = -(-context // self.page_size)
        if need > w:
            raise ValueError(f"PagePool.reset: context {context} needs {need} pages per row; the "
                             f"block tables have {w} columns")
        self._free = self._perm.copy()
        self._top = self.num_pages
        self.block_tables[:] = 0
        self.block_tables[:, :need] = self._take(self.batch * need, f"a context of {context} tokens "
                                                 f"in {self.batch} rows").reshape(self.batch, need)
        self.lengths[:] = context
        self.version += 1

    def advance(self) -> Slots:
        """Place one new token per row (position = the row's length before the step)."""
        pos = self.lengths
        col, slot = pos // self.page_size, pos % self.page_size
        starts = np.nonzero(slot == 0)[0]
        w = self.block_tables.shape[1]
        for r in starts:
            if col[r] >= w:
                raise RuntimeError(f"PagePool.advance: row {r} at token {pos[r]} needs page "
                                   f"{col[r]} but its block table has {w} columns")
            self.block_tables[r, col[r]] = self._take(1, f"row {r} at token {pos[r]}")[0]
        page = self.block_tables[np.arange(self.batch), col]
        self.lengths = pos + 1
        if starts.size:
            self.version += 1
        return Slots(seq_lens=self.lengths.copy(), page=page, slot=slot, new_page=starts.size > 0)


# --------------------------------------------------------------------------- the model

class Model:
    """The decoder's weights and its one-step forward pass (see the module docstring)."""

    def __init__(self, cfg: ModelConfig, weights: Weights):
        self.cfg, self.w = cfg, weights
        self.hidden = cfg.hidden   # the residual stream's width (a TP rank's cfg.hidden is not)
        self.inv_freq = rope_inv_freq(cfg, weights.embed.device)

    def _add_projected(self, x: torch.Tensor, a: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
        """x + a @ w^T: the output projection and the MLP's down projection added to the
        residual stream (pkvrt.measure.model_tp.TPModel sums the ranks' parts here)."""
        return torch.addmm(x, a, w.t())

    def forward(self, tokens, inputs, block_tables, caches: KVCaches, attention, attn_out,
                logits) -> None:
        """One decode step on the device, capturable (no host sync, only static inputs).

        tokens : int64 [B], this step's input tokens; overwritten with the argmax of the logits.
        inputs : int32 [3, B], rows seq_lens (after the append), page, slot (:class:`Slots`).
        block_tables : int32 [B, W] (the pool's, on the device).
        attention : a backend (``pkvrt.measure.model_attention``): ``begin_step(seq_lens, block_tables)``
            once, then ``attend(layer, q, k_cache, v_cache, out) -> o`` per layer.
        attn_out : [layers, B, H_q, D], where layer l's attention writes its output (kept after
            the step: the check compares backends layer by layer).
        logits : [B, vocab] of the model's dtype, written.
        """
        cfg, w = self.cfg, self.w
        b, hq, d = tokens.shape[0], cfg.num_qo_heads, cfg.head_dim
        seq_lens = inputs[0]
        page, slot = inputs[1].long(), inputs[2].long()
        rotation = rope_rotation(seq_lens - 1, self.inv_freq)          # complex [B, D/2]
        attention.begin_step(seq_lens, block_tables)
        x = F.embedding(tokens, w.embed)                                # [B, hidden]
        for layer, lw in enumerate(w.layers):
            q, k, v = self.project(layer, x, rotation)
            append_kv(caches.k[layer], caches.v[layer], k, v, page, slot)
            o = attention.attend(layer, q, caches.k[layer], caches.v[layer], attn_out[layer])
            x = self._add_projected(x, o.reshape(b, hq * d), lw.o)      # x + o @ W_o^T
            h = F.rms_norm(x, (self.hidden,), lw.mlp_norm, cfg.norm_eps)
            g, u = F.linear(h, lw.gate_up).chunk(2, dim=-1)             # [B, inter] each
            x = self._add_projected(x, F.silu(g) * u, lw.down)
        h = F.rms_norm(x, (self.hidden,), w.final_norm, cfg.norm_eps)
        torch.matmul(h, w.lm_head.t(), out=logits)
        tokens.copy_(logits.argmax(dim=-1))


    def project(self, layer: int, x: torch.Tensor, rotation: torch.Tensor):
        """Layer ``layer``'s q [B, H_q, D] and k [B, H_kv, D], turned by RoPE (``rotation``
        [B, D/2]), and v [B, H_kv, D] (a view), from the residual stream x [B, hidden]."""
        cfg, lw = self.cfg, self.w.layers[layer]
        b, hq, hkv, d = x.shape[0], cfg.num_qo_heads, cfg.num_kv_heads, cfg.head_dim
        h = F.rms_norm(x, (self.hidden,), lw.attn_norm, cfg.norm_eps)
        q, k, v = F.linear(h, lw.qkv).split([hq * d, hkv * d, hkv * d], dim=-1)
        return (apply_rope(q.view(b, hq, d), rotation), apply_rope(k.view(b, hkv, d), rotation),
                v.view(b, hkv, d))

    def layer0_reference(self, tokens, caches: KVCaches, block_tables, *, context: int) -> torch.Tensor:
        """FP32 attention output of layer 0 at each step of a pass fed ``tokens`` [steps, B] from
        the initial state (every row holding ``context`` tokens): [steps, B, H_q, D].

        Layer 0's q, k and v depend only on the token and its position, so they are recomputed
        here, and the cache holds what any backend appended during such a pass: call it right
        after one (before another pass overwrites the slots past the context). block_tables :
        int32 [B, W], the pool's tables after the pass (a row's pages never move)."""
        out = []
        for step, tok in enumerate(tokens):
            pos = torch.full_like(tok, context + step)
            q, _, _ = self.project(0, F.embedding(tok, self.w.embed), rope_rotation(pos, self.inv_freq))
            seq_lens = (pos + 1).int()
            out.append(reference.decode_attention(q, caches.k[0], caches.v[0], seq_lens, block_tables))
        return torch.stack(out)


class Staged:
    """A device tensor and its pinned host twin (the same tensor on a CPU device): write
    :meth:`host`, then :meth:`push` copies it asynchronously. :meth:`host` first waits for the
    last push's copy to have run, so a host that runs a step ahead never rewrites memory a
    pending copy still reads (a no-op unless the host is a whole step ahead)."""

    def __init__(self, shape, dtype, device):
        self.device = torch.zeros(shape, dtype=dtype, device=device)
        cuda = self.device.is_cuda
        self._host = torch.zeros(shape, dtype=dtype, pin_memory=True) if cuda else self.device
        self._np = self._host.numpy()
        self._copied = torch.cuda.Event() if cuda else None
        self._pending = False

    def host(self) -> np.ndarray:
        if self._pending:
            self._copied.synchronize()
            self._pending = False
        return self._np

    def push(self) -> None:
        if self._copied is not None:
            self.device.copy_(self._host, non_blocking=True)
            self._copied.record()
            self._pending = True


class DecodeLoop:
    """A batch's decode steps on a model and its caches, for one attention backend at a time:
    the page pool on the host, the static device buffers a captured step reads and writes
    (tokens, lengths and slots, block tables, every layer's attention output, logits), and the
    step, eager or replayed.

    Parameters
    ----------
    model : Model. caches : KVCaches with at least :func:`pages_needed` pages.
    batch : rows. context : tokens every row holds at :meth:`reset`.
    max_steps : steps after a reset the block tables must have room for.
    seed : the pool's page permutation.
    """

    def __init__(self, model: Model, caches: KVCaches, *, batch: int, context: int,
                 max_steps: int, seed: int = 0):
        cfg = model.cfg
        self.model, self.caches, self.batch, self.context = model, caches, batch, context
        device = caches.k.device
        width = -(-(context + max_steps) // cfg.page_size)
        self.pool = PagePool(caches.num_pages, batch=batch, max_pages_per_row=width,
                             page_size=cfg.page_size, seed=seed)
        self.inputs = Staged((3, batch), torch.int32, device)          # seq_lens, page, slot
        self.block_tables = Staged((batch, width), torch.int32, device)
        self.tokens = torch.zeros(batch, dtype=torch.int64, device=device)
        self.logits = torch.empty(batch, cfg.vocab, dtype=cfg.dtype, device=device)
        self.attn_out = torch.zeros(cfg.layers, batch, cfg.num_qo_heads, cfg.head_dim,
                                    dtype=cfg.dtype, device=device)
        self.last: Slots | None = None
        self.reset(self.tokens)   # the initial state, input tokens 0

    def reset(self, tokens: torch.Tensor) -> None:
        """Back to the initial state: every row holds ``context`` tokens, the next input tokens
        are ``tokens`` (int64 [B]). Cache slots past the context are rewritten before any step
        reads them, so the same pool state means the same attention inputs."""
        self.pool.reset(self.context)
        self.block_tables.host()[:] = self.pool.block_tables
        self.block_tables.push()
        self.tokens.copy_(tokens)

    def prepare(self, attention) -> Slots:
        """The host work of one step: place the new tokens, copy lengths and slots (and the block
        tables when a row took a page) to the device, then the backend's own host work."""
        s = self.last = self.pool.advance()
        staged = self.inputs.host()
        staged[0], staged[1], staged[2] = s.seq_lens, s.page, s.slot
        self.inputs.push()
        if s.new_page:
            self.block_tables.host()[:] = self.pool.block_tables
            self.block_tables.push()
        attention.prepare(self)
        return s

    def forward(self, attention) -> None:
        """The device work of the prepared step (capturable)."""
        self.model.forward(self.tokens, self.inputs.device, self.block_tables.device, self.caches,
                           attention, self.attn_out, self.logits)

    def step(self, attention, graph=None) -> None:
        """One step: :meth:`prepare`, then ``graph.replay()`` (a graph of :meth:`capture`) or
        the eager :meth:`forward`."""
        self.prepare(attention)
        if graph is None:
            self.forward(attention)
        else:
            graph.replay()

    def capture(self, attention):
        """The whole step captured in one CUDA graph (``pkvrt.runtime.graphs.capture``: warm-up on a side
        stream, then capture; refuses an empty graph). Prepares one step from the current state
        for the warm-up run, which then runs it: call :meth:`reset` before the steps that count.
        Returns a ``torch.cuda.CUDAGraph``."""
        from pkvrt.runtime import graphs

        self.prepare(attention)
        device = self.tokens.device
        return graphs.capture(lambda: self.forward(attention), side_stream=torch.cuda.Stream(device),
                              pool=None, device=device).graph


def run_steps(loop: DecodeLoop, attention, tokens: torch.Tensor, graph=None):
    """From the initial state, step s fed ``tokens[s]`` (int64 [steps, B]): logits
    [steps, B, vocab] and layer 0's attention outputs [steps, B, H_q, D] of the loop's model
    (graph: a captured step graph, or None for eager steps; the correctness pass of the
    whole-model and TP benches)."""
    loop.reset(tokens[0])
    logits, attn0 = [], []
    for tok in tokens:
        loop.tokens.copy_(tok)
        loop.step(attention, graph)
        logits.append(loop.logits.clone())
        attn0.append(loop.attn_out[0].clone())
    return torch.stack(logits), torch.stack(attn0)
