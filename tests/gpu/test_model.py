"""The Llama-shaped decoder (pkvrt/measure/model.py) on the GPU: a 2-layer model's whole step captured in
one CUDA graph, with pkvrt's attention and with each FlashInfer path, gives the logits and every
layer's attention output of the same model run eagerly with the FP32 reference attention, step
after step while the rows grow across page boundaries (new pages, new block tables, one graph);
the example and the benchmark run end to end."""

from __future__ import annotations

import importlib.util
import json
from pathlib import Path

import pytest
import torch

from pkvrt.measure import model as M
from pkvrt.measure import model_results as R
from pkvrt.measure.model_attention import ReferenceAttention, make_backend

pytestmark = pytest.mark.gpu

ROOT = Path(__file__).resolve().parents[2]
CFG = M.TINY                      # fp16, 2 layers, H_q 4, H_kv 1, D 128, page 16
BATCH, CONTEXT, STEPS = 3, 45, 22  # tokens 45..66: pages start at 48 and 64


def run(loop, backend, tokens, graph=None):
    """Logits [steps, B, V] and attention outputs [steps, layers, B, H_q, D], fed ``tokens``."""
    loop.reset(tokens[0])
    logits, attn = [], []
    for tok in tokens:
        loop.tokens.copy_(tok)
        loop.step(backend, graph)
        logits.append(loop.logits.clone())
        attn.append(loop.attn_out.clone())
    return torch.stack(logits), torch.stack(attn)


@pytest.fixture(scope="module")
def setup():
    model = M.Model(CFG, M.make_weights(CFG, seed=0))
    caches = M.make_caches(CFG, M.pages_needed(BATCH, CONTEXT, STEPS + 1, CFG.page_size) + 3, seed=1)
    gen = torch.Generator(device="cuda").manual_seed(2)
    tokens = torch.randint(CFG.vocab, (STEPS, BATCH), generator=gen, device="cuda")
    loop = M.DecodeLoop(model, caches, batch=BATCH, context=CONTEXT, max_steps=STEPS + 1, seed=3)
    return model, caches, tokens, run(loop, ReferenceAttention(), tokens)


@pytest.mark.parametrize("engine", ["pkvrt", "flashinfer-tc", "flashinfer-cuda", "flashinfer-xqa"])
def test_captured_step_matches_the_eager_reference_model(setup, engine):
    model, caches, tokens, (ref_logits, ref_attn) = setup
    loop = M.DecodeLoop(model, caches, batch=BATCH, context=CONTEXT, max_steps=STEPS + 1, seed=3)
    try:
        backend = make_backend(engine, CFG, loop)
    except RuntimeError as exc:
        if engine == "pkvrt":
            raise
        pytest.skip(f"{engine}: {exc}")
    try:
        graph = loop.capture(backend)   # refuses an empty graph
    except RuntimeError as exc:         # XQA refuses some shapes at its first call
        if engine != "flashinfer-xqa":
            raise
        pytest.skip(f"{engine}: {exc}")
    logits, attn = run(loop, backend, tokens, graph)
    if engine == "pkvrt":
        backend.check()                 # no row flagged by the planning kernel
    tol = R.attention_tolerance(CFG.dtype)
    for s in range(STEPS):
        for layer in range(CFG.layers):
            err = R.rel_err(attn[s, layer], ref_attn[s, layer])[1]
            assert err <= tol, f"{engine} step {s} layer {layer}: attention rel err {err:.1e}"
        err = R.rel_err(logits[s], ref_logits[s])[1]
        assert err <= R.logits_tolerance(CFG.dtype), f"{engine} step {s}: logits rel err {err:.1e}"
    assert loop.pool.lengths.tolist() == [CONTEXT + STEPS] * BATCH


def _load(path: Path):
    spec = importlib.util.spec_from_file_location(path.stem, path)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def test_example_runs_two_layers(capsys):
    assert _load(ROOT / "examples" / "llama_decode.py").main(
        ["--layers", "2", "--batch", "2", "--context", "1000", "--steps", "3"]) == 0
    assert "ms per step" in capsys.readouterr().out


def test_bench_writes_a_checked_results_file(tmp_path):
    out = tmp_path / "model-decode.json"
    rc = _load(ROOT / "benches" / "model_decode.py").main(
        ["--layers", "2", "--batches", "2", "--contexts", "1000", "--steps", "2", "--warmup", "1",
         "--check-steps", "2", "--engines", "pkvrt,flashinfer-tc,flashinfer-cuda,no-attention",
         "--out", str(out)])
    doc = json.loads(out.read_text())
    assert rc == 0 and doc["meta"]["kind"] == R.KIND
    rows = {r["engine"]: r for r in doc["rows"]}
    assert rows["pkvrt"]["row"] == "measured" and rows["pkvrt"]["ms_per_step"] > 0
    if any(e.startswith("flashinfer") and r["row"] == "measured" for e, r in rows.items()):
        assert rows["pkvrt"]["logits_ok"] is True
        assert any(r["row"] == "ratio" for r in doc["rows"])
