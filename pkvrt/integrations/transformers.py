"""Hugging Face transformers models decoding with a paged KV cache through any FlashInfer-style
decode wrapper: pkvrt's drop-in, FlashInfer's own, or the FP32 reference.

What plugs in where (transformers 5.x), with no forward pass of our own:

- **Attention**: :func:`register` adds ``"pkvrt_paged"`` to ``transformers.AttentionInterface``;
  ``model.set_attn_implementation("pkvrt_paged")`` selects it. A decode step (one query token
  per row) runs the wrapper over the cache's pages; a prompt (prefill, a row's first forward)
  runs transformers' own SDPA over the prompt's keys. An implementation name the mask registry
  does not know builds no mask: the block tables and lengths are the mask.
- **KV cache**: a :class:`PagedKVCache` is the model's ``cache`` argument. Every attention layer
  calls its ``update(key, value, layer_idx, kwargs=...)``, which writes the step's new tokens into
  their pages (one ``index_copy_`` per tensor, capturable) and hands itself to the attention
  function through ``kwargs``, as transformers' own continuous-batching cache does.

Why not transformers' continuous batching (``generate_batch`` over ``PagedAttentionCache``)? Its
block-table decode path is wired to flash-attn's ``flash_attn_with_kvcache`` and is switched off
unless flash-attn is installed; without it every layer gathers each row's keys and values into a
contiguous copy before attention, the copy a paged decode kernel exists to avoid.

The decode wrapper is anything with FlashInfer 0.7's ``BatchDecodeWithPagedKVCacheWrapper``
``plan()`` / ``run()`` (NHD pages ``[num_pages, page_size, H_kv, D]``): so the comparison with
FlashInfer is the same code with another import. :class:`ReferenceDecode` is the FP32
reference behind that API and runs on a CPU.
"""

from __future__ import annotations

import math
import time
from collections.abc import Sequence

import attrs
import numpy as np
import torch

from pkvrt import reference

ATTN_IMPLEMENTATION = "pkvrt_paged"


def _positive_int(name: str, v) -> int:
    if isinstance(v, bool) or not isinstance(v, int) or v < 1:
        raise ValueError(f"{name}={v!r}: expected a positive int")
    return v


class ReferenceDecode:
    """:func:`pkvrt.reference.decode_attention` behind FlashInfer's decode-wrapper API (NHD):
    exact FP32 math, any device; the output in q's dtype."""

    def __init__(self, kv_layout: str = "NHD"):
        if kv_layout != "NHD":
            raise ValueError(f"ReferenceDecode: kv_layout={kv_layout!r}: only 'NHD' is served")
        self._planned = None

    def plan(self, indptr, indices, last_page_len, num_qo_heads: int, num_kv_heads: int,
             head_dim: int, page_size: int, *, sm_scale: float | None = None, **_ignored) -> None:
        from pkvrt.runtime.wrapper import csr_to_block_tables

        seq, bt = csr_to_block_tables(indptr, indices, last_page_len, page_size)
        self._planned = (torch.from_numpy(seq), torch.from_numpy(bt), sm_scale)

    def run(self, q: torch.Tensor, paged_kv_cache) -> torch.Tensor:
        if self._planned is None:
            raise RuntimeError("ReferenceDecode.run: plan() must be called before run()")
        seq, bt, scale = self._planned
        k, v = paged_kv_cache
        out = reference.decode_attention(q, k.transpose(1, 2), v.transpose(1, 2), seq, bt, scale)
        return out.to(q.dtype)


@attrs.define
class _Row:
    pages: list[int] = attrs.field(factory=list)
    length: int = 0


class PagedKVCache:
    """Per-layer K/V page pools ``[num_pages, page_size, H_kv, D]`` (NHD) shared by every row,
    a free-page list, each row's pages and length, and the decode wrapper that attends over them.

    One step at a time: :meth:`begin_prefill` (one empty row, its whole prompt) or
    :meth:`begin_decode` (one new token for each of several rows; plans the wrapper once for all
    layers), then the model's forward with ``cache=this``, then :meth:`end_step`. The step's write
    slots live in a static device buffer, so a decode forward can be captured in a CUDA graph and
    replayed after each :meth:`begin_decode` (the wrapper in its CUDA-graph mode).

    Errors name what is wrong and leave the cache unchanged: a row that is not empty for a
    prefill or empty for a decode, pages run out, a step begun inside another, an update outside
    a step or of the wrong number of tokens.
    """

    def __init__(self, decoder, *, num_layers: int, num_qo_heads: int, num_kv_heads: int,
                 head_dim: int, num_pages: int, page_size: int = 16, dtype=torch.float16,
                 device="cuda", sm_scale: float | None = None, max_step_tokens: int = 8192):
        for name in ("num_layers", "num_qo_heads", "num_kv_heads", "head_dim", "num_pages",
                     "page_size", "max_step_tokens"):
            _positive_int(name, locals()[name])
        if num_qo_heads % num_kv_heads:
            raise ValueError(f"num_qo_heads={num_qo_heads} is not a multiple of num_kv_heads={num_kv_heads}")
        self.decoder = decoder
        self.num_layers, self.num_qo_heads, self.num_kv_heads = num_layers, num_qo_heads, num_kv_heads
        self.head_dim, self.page_size, self.num_pages = head_dim, page_size, num_pages
        self.dtype, self.device = dtype, torch.device(device)
        self.sm_scale = float(sm_scale) if sm_scale is not None else 1.0 / math.sqrt(head_dim)
        shape = (num_layers, num_pages, page_size, num_kv_heads, head_dim)
        self.k = torch.zeros(shape, dtype=dtype, device=self.device)
        self.v = torch.zeros(shape, dtype=dtype, device=self.device)
        self._free = list(range(num_pages - 1, -1, -1))   # pop() hands out page 0 first
        self._rows: list[_Row | None] = []
        self._slots = torch.zeros(max_step_tokens, dtype=torch.int64, device=self.device)
        self._step: tuple[str, list[int], int] | None = None   # (kind, rows, tokens)

    @classmethod
    def for_model(cls, model, decoder, *, num_pages: int, page_size: int = 16, **kwargs):
        """A cache shaped by a transformers model's config (layers, heads, head dim, its
        attention scale, the model's dtype and device)."""
        cfg = model.config
        head_dim = getattr(cfg, "head_dim", None) or cfg.hidden_size // cfg.num_attention_heads
        kv_heads = getattr(cfg, "num_key_value_heads", None) or cfg.num_attention_heads
        scale = getattr(model.model.layers[0].self_attn, "scaling", None)
        kwargs.setdefault("dtype", model.dtype)
        kwargs.setdefault("device", model.device)
        return cls(decoder, num_layers=cfg.num_hidden_layers, num_qo_heads=cfg.num_attention_heads,
                   num_kv_heads=kv_heads, head_dim=head_dim, num_pages=num_pages,
                   page_size=page_size, sm_scale=scale, **kwargs)

    # ------------------------------------------------------------------ rows

    def add_row(self) -> int:
        """A new empty row; returns its id."""
        self._rows.append(_Row())
        return len(self._rows) - 1

    def free_row(self, row: int) -> None:
        """Return a row's pages to the free list (the row id is not reused)."""
        r = self._row(row)
        self._free.extend(reversed(r.pages))
        self._rows[row] = None

    def length(self, row: int) -> int:
        return self._row(row).length

    def pages(self, row: int) -> list[int]:
        return list(self._row(row).pages)

    @property
    def free_pages(self) -> int:
        return len(self._free)

    def _row(self, row: int) -> _Row:
        if isinstance(row, bool) or not isinstance(row, int) or not 0 <= row < len(self._rows) \
                or self._rows[row] is None:
            raise ValueError(f"row {row!r}: no such row (add_row() makes one; freed rows are gone)")
        return self._rows[row]

    # ------------------------------------------------------------------ steps

    def begin_prefill(self, row: int, num_tokens: int) -> torch.Tensor:
        """Start the prompt forward of an empty row; returns its position ids ``[1, num_tokens]``."""
        self._not_in_step("begin_prefill")
        r = self._row(row)
        _positive_int("num_tokens", num_tokens)
        if r.length:
            raise ValueError(f"begin_prefill: row {row} already holds {r.length} tokens "
                             "(a prompt goes into an empty row)")
        if num_tokens > self._slots.numel():
            raise ValueError(f"begin_prefill: {num_tokens} tokens exceed max_step_tokens="
                             f"{self._slots.numel()}")
        need = -(-num_tokens // self.page_size)
        self._take_pages([(r, need)])
        pos = np.arange(num_tokens)
        slots = np.asarray(r.pages, dtype=np.int64)[pos // self.page_size] * self.page_size \
            + pos % self.page_size
        self._slots[:num_tokens].copy_(torch.from_numpy(slots))
        self._step = ("prefill", [row], num_tokens)
        return torch.from_numpy(pos).view(1, -1).to(self.device)

    def begin_decode(self, rows: Sequence[int]) -> torch.Tensor:
        """Start a decode step of one new token for each row (rows in batch order); plans the
        decoder over the rows' pages with the new token included. Returns the position ids
        ``[len(rows), 1]``."""
        self._not_in_step("begin_decode")
        rows = list(rows)
        if not rows or len(rows) > self._slots.numel() or len(set(rows)) != len(rows):
            raise ValueError(f"begin_decode: rows {rows}: expected 1..{self._slots.numel()} distinct rows")
        rs = [self._row(i) for i in rows]
        for i, r in zip(rows, rs):
            if not r.length:
                raise ValueError(f"begin_decode: row {i} is empty (prefill its prompt first)")
        grow = [r for r in rs if r.length % self.page_size == 0]   # the new token starts a page
        if len(grow) > len(self._free):
            raise ValueError(f"out of pages: the step needs {len(grow)} new pages, {len(self._free)} "
                             f"are free of num_pages={self.num_pages}")
        new = {id(r): self._free[-1 - i] for i, r in enumerate(grow)}   # taken once plan() passed
        pages = [r.pages + ([new[id(r)]] if id(r) in new else []) for r in rs]
        lens = np.array([r.length for r in rs], dtype=np.int64)
        last_page = np.array([p[-1] for p in pages], dtype=np.int64)
        counts = np.array([len(p) for p in pages], dtype=np.int32)
        indptr = torch.from_numpy(np.concatenate([[0], np.cumsum(counts)]).astype(np.int32))
        indices = torch.from_numpy(np.concatenate([np.asarray(p, dtype=np.int32) for p in pages]))
        last_page_len = torch.from_numpy((lens % self.page_size + 1).astype(np.int32))
        dev = self.device
        self.decoder.plan(indptr.to(dev), indices.to(dev), last_page_len.to(dev),
                          self.num_qo_heads, self.num_kv_heads, self.head_dim, self.page_size,
                          sm_scale=self.sm_scale, q_data_type=self.dtype, kv_data_type=self.dtype)
        self._take_pages([(r, 1) for r in grow])      # the pages named above, in that order
        self._slots[:len(rows)].copy_(torch.from_numpy(last_page * self.page_size + lens % self.page_size))
        self._step = ("decode", rows, len(rows))
        return torch.from_numpy(lens).view(-1, 1).to(dev)

    def end_step(self) -> None:
        """The step's forward is done: its rows now hold their new tokens."""
        if self._step is None:
            raise RuntimeError("end_step: no step begun")
        kind, rows, tokens = self._step
        for i in rows:
            self._rows[i].length += tokens if kind == "prefill" else 1
        self._step = None

    def _not_in_step(self, what: str) -> None:
        if self._step is not None:
            raise RuntimeError(f"{what}: a {self._step[0]} step is open (call end_step() first)")

    def _take_pages(self, needs: list[tuple[_Row, int]]) -> None:
        total = sum(n for _, n in needs)
        if total > len(self._free):
            raise ValueError(f"out of pages: the step needs {total} new pages, {len(self._free)} are "
                             f"free of num_pages={self.num_pages}")
        for r, n in needs:
            r.pages.extend(self._free.pop() for _ in range(n))

    # ------------------------------------------------------------------ the model's hooks

    def update(self, key_states: torch.Tensor, value_states: torch.Tensor, layer_idx: int,
               *args, kwargs: dict | None = None, **_):
        """transformers' cache hook: write the step's keys and values ``[B, H_kv, S, D]`` into
        their pages; hand this cache to the attention function through ``kwargs``."""
        if self._step is None:
            raise RuntimeError("PagedKVCache.update outside a step: call begin_prefill() or "
                               "begin_decode() before the model's forward")
        b, hkv, s, d = key_states.shape
        if (hkv, d) != (self.num_kv_heads, self.head_dim) or b * s != self._step[2]:
            raise ValueError(f"PagedKVCache.update: keys {tuple(key_states.shape)} do not match the "
                             f"step ({self._step[2]} tokens of H_kv={self.num_kv_heads}, "
                             f"D={self.head_dim})")
        slots = self._slots[:b * s]
        for pool, new in ((self.k[layer_idx], key_states), (self.v[layer_idx], value_states)):
            pool.view(-1, hkv, d).index_copy_(0, slots, new.transpose(1, 2).reshape(-1, hkv, d).to(pool.dtype))
        if kwargs is not None:
            kwargs["paged_kv_cache"] = self
        return key_states, value_states

    def attend(self, layer_idx: int, q: torch.Tensor) -> torch.Tensor:
        """The decode step's attention for one layer: q ``[B, H_q, D]`` -> out ``[B, H_q, D]``."""
        if self._step is None or self._step[0] != "decode":
            raise RuntimeError("PagedKVCache.attend: no decode step is open")
        return self.decoder.run(q, (self.k[layer_idx], self.v[layer_idx]))


def paged_attention_forward(module, query, key, value, attention_mask, scaling=None, dropout=0.0,
                            paged_kv_cache: PagedKVCache | None = None, **kwargs):
    """transformers' attention-function signature (query ``[B, H_q, S, D]``, key/value
    ``[B, H_kv, S, D]``); returns ``([B, S, H_q, D], None)``."""
    cache = paged_kv_cache
    if not isinstance(cache, PagedKVCache):
        raise ValueError(f"attn_implementation {ATTN_IMPLEMENTATION!r} needs the model called with "
                         "cache=PagedKVCache(...) (got no paged cache)")
    if scaling is not None and not math.isclose(scaling, cache.sm_scale, rel_tol=1e-6):
        raise ValueError(f"layer {module.layer_idx}: attention scale {scaling} differs from the "
                         f"cache's sm_scale {cache.sm_scale}")
    if cache._step[0] == "prefill":   # the whole prompt of one empty row: its own keys only
        from transformers.integrations.sdpa_attention import sdpa_attention_forward

        return sdpa_attention_forward(module, query, key, value, None, dropout=0.0,
                                      scaling=cache.sm_scale, is_causal=True)
    out = cache.attend(module.layer_idx, query[:, :, 0, :].contiguous())
    return out.unsqueeze(1), None


def register() -> str:
    """Register ``"pkvrt_paged"`` with transformers' AttentionInterface; returns the name."""
    from transformers import AttentionInterface

    AttentionInterface.register(ATTN_IMPLEMENTATION, paged_attention_forward)
    return ATTN_IMPLEMENTATION


# ---------------------------------------------------------------------- greedy decoding


@attrs.frozen
class Generation:
    """Greedy tokens per prompt, and at each step the top-1 minus top-2 logit (the margin by
    which the argmax won); decode timing over the batched steps from the second on (prefill, the
    decoders' first plan and a CUDA graph's capture excluded)."""

    tokens: list[list[int]]
    margins: list[list[float]]
    decode_steps: int = 0
    decode_seconds: float = 0.0

    @property
    def decode_tokens_per_s(self) -> float:
        rows = len(self.tokens)
        return rows * self.decode_steps / self.decode_seconds if self.decode_seconds else float("nan")


def _top2(logits: torch.Tensor):
    v, i = logits.float().topk(2, dim=-1)
    return i[..., 0], v[..., 0] - v[..., 1]


def _sync(device) -> None:
    if torch.device(device).type == "cuda":
        torch.cuda.synchronize(device)


@torch.inference_mode()
def generate_paged(model, cache: PagedKVCache, prompts: Sequence[Sequence[int]],
                   max_new_tokens: int, *, cuda_graph: bool = False) -> Generation:
    """Greedy decoding of ``prompts`` (token ids) through the model with ``cache``: each prompt
    prefilled alone, then ``max_new_tokens - 1`` decode steps of all rows together (no stop at
    EOS). ``cuda_graph``: one decode forward is captured in a CUDA graph and replayed each step
    after begin_decode() (the decoder must be a wrapper in CUDA-graph mode for this batch)."""
    _positive_int("max_new_tokens", max_new_tokens)
    if model.config._attn_implementation != ATTN_IMPLEMENTATION:
        raise ValueError(f"generate_paged: the model's attention is {model.config._attn_implementation!r}; "
                         f"call model.set_attn_implementation({ATTN_IMPLEMENTATION!r}) (after register())")
    dev = cache.device
    rows, first, first_margin = [], [], []
    for p in prompts:
        row = cache.add_row()
        pos = cache.begin_prefill(row, len(p))
        ids = torch.tensor([list(p)], dtype=torch.long, device=dev)
        logits = model(input_ids=ids, position_ids=pos, cache=cache, paged_kv_cache=cache,
                       logits_to_keep=1).logits[:, -1]
        cache.end_step()
        tok, margin = _top2(logits)
        rows.append(row)
        first.append(tok)
        first_margin.append(margin)
    b = len(rows)
    ids = torch.cat(first).view(b, 1)
    toks, margins = [ids[:, 0].clone()], [torch.cat(first_margin)]
    static = None
    t0 = None
    for step in range(max_new_tokens - 1):
        if step == 1:   # timed from the second decode step: builds, warm-up and capture excluded
            _sync(dev)
            t0 = time.perf_counter()
        pos = cache.begin_decode(rows)
        if cuda_graph:
            if static is None:
                static = _capture_decode(model, cache, ids, pos)
            static["ids"].copy_(ids)
            static["pos"].copy_(pos)
            static["graph"].replay()
            tok, margin = static["tok"], static["margin"]
        else:
            logits = model(input_ids=ids, position_ids=pos, cache=cache, paged_kv_cache=cache).logits[:, -1]
            tok, margin = _top2(logits)
        cache.end_step()
        toks.append(tok.clone())
        margins.append(margin.clone())
        ids = tok.view(b, 1)
    _sync(dev)
    seconds = time.perf_counter() - t0 if t0 is not None else 0.0
    tok_rows = torch.stack(toks, dim=1).tolist()
    margin_rows = torch.stack(margins, dim=1).tolist()
    return Generation(tok_rows, margin_rows, max(0, max_new_tokens - 2), seconds)


def _capture_decode(model, cache: PagedKVCache, ids, pos) -> dict:
    """Capture one decode forward (with its argmax) in a CUDA graph over static inputs. The
    cache's write slots and the decoder's plan buffers are static already; the warm-up forward
    on a side stream writes the same slots the replay will, so the step stays exact."""
    static = {"ids": ids.clone(), "pos": pos.clone(), "graph": torch.cuda.CUDAGraph()}

    def forward():
        logits = model(input_ids=static["ids"], position_ids=static["pos"], cache=cache,
                       paged_kv_cache=cache).logits[:, -1]
        static["tok"], static["margin"] = _top2(logits)

    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        forward()
    torch.cuda.current_stream().wait_stream(side)
    with torch.cuda.graph(static["graph"]):
        forward()
    return static


@torch.inference_mode()
def generate_reference(model, prompts: Sequence[Sequence[int]], max_new_tokens: int) -> Generation:
    """Greedy decoding with the model as transformers runs it on its own (its current attention
    implementation, its DynamicCache, one prompt at a time): the reference for token agreement."""
    from transformers import DynamicCache

    _positive_int("max_new_tokens", max_new_tokens)
    dev = model.device
    tokens, margins = [], []
    for p in prompts:
        kv = DynamicCache(config=model.config)
        ids = torch.tensor([list(p)], dtype=torch.long, device=dev)
        row_t, row_m = [], []
        for _ in range(max_new_tokens):
            logits = model(input_ids=ids, cache=kv, use_cache=True, logits_to_keep=1).logits[:, -1]
            tok, margin = _top2(logits)
            row_t.append(int(tok))
            row_m.append(float(margin))
            ids = tok.view(1, 1)
        tokens.append(row_t)
        margins.append(row_m)
    return Generation(tokens, margins)


def first_divergence(ref: Generation, got: Generation) -> list[dict]:
    """Per prompt: the first step where ``got``'s token differs from ``ref``'s (None: none in
    the shorter of the two), with both margins there: a small reference margin marks a near-tie
    that fp16 rounding can flip."""
    if len(ref.tokens) != len(got.tokens):
        raise ValueError(f"first_divergence: {len(ref.tokens)} reference prompts, {len(got.tokens)} compared")
    out = []
    for p, (rt, gt) in enumerate(zip(ref.tokens, got.tokens)):
        n = min(len(rt), len(gt))
        step = next((i for i in range(n) if rt[i] != gt[i]), None)
        out.append({"prompt": p, "steps_compared": n, "first_divergence": step,
                    "ref_margin": None if step is None else ref.margins[p][step],
                    "got_margin": None if step is None else got.margins[p][step]})
    return out
