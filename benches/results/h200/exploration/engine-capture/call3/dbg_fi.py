import sys, os, warnings, traceback
sys.path.insert(0, "tests")
import numpy as np, torch
from paged import make_batch, rel_err
from pkvrt import reference
from pkvrt.runtime import Runtime, graphs
SHAPE = dict(num_qo_heads=32, num_kv_heads=8, head_dim=128, page_size=16)
POOL_LENS = [20000, 17000, 5000, 900, 33, 12000]
STEPS = [([0, 1, 2, 3], 5), ([0, 1, 2, 3], 4), ([0, 1, 2, 3, 4], 3), ([0, 1, 2, 3, 4], 2),
         ([0, 2, 3, 4], 1), ([0, 2, 3, 4, 5], 0)]
mode = sys.argv[1]
b = make_batch(POOL_LENS, **SHAPE, dtype=torch.float16, seed=20260623)
caches = [(b.k_cache, b.v_cache)]
kw = dict(max_batch=16, max_pages_per_row=2048)
if mode == "engine": kw.update(engine_capture=True)
if mode == "engine-novalidate": kw.update(engine_capture=True, validate=False)
if mode == "perlayer": kw.update(flashinfer_cuda_graph=True)
with warnings.catch_warnings():
    warnings.simplefilter("ignore")
    rt = Runtime(*SHAPE.values(), torch.float16, **kw)
outs, sg = {}, {}
for i, (rows, short) in enumerate(STEPS + [(r, s - 1) for r, s in STEPS]):
    seq = np.array([max(1, POOL_LENS[r] - short) for r in rows], dtype=np.int32)
    bt = b.block_tables[rows].cpu().numpy()
    q = torch.randn(len(rows), 32, 128, device="cuda").half()
    qs = rt.static_q(len(rows)); qs.copy_(q)
    out = outs.setdefault(len(rows), torch.empty_like(q)); out.fill_(float("nan"))
    d = rt.plan(seq, bt, force="flashinfer")
    torch.cuda.synchronize()
    key = (rt.step_key, len(rows))
    if mode == "perlayer":
        rt.run(qs, *caches[0], out=out); what = "perlayer"
    else:
        g = sg.get(key)
        if g is None:
            sg[key] = graphs.capture(lambda: rt.run(qs, *caches[0], out=out)).graph; what = "capture"
        else:
            g.replay(); what = "replay"
    torch.cuda.synchronize()
    ref = reference.decode_attention(q, *caches[0], torch.as_tensor(seq, device="cuda"), torch.as_tensor(bt, device="cuda"))
    print(mode, i, what, key, "err", rel_err(out, ref), flush=True)
print(mode, "OK")
