"""Session 24, call 2: which dead-Runtime finalizer breaks another Runtime's capture, and does it
matter whether it runs inside the capture or just before it?
usage: python bisect.py WHERE WHAT
  WHERE: early (before the new Runtime plans; a control), before (in torch.cuda.graph.__enter__,
         before capture_begin), inside (at the first launch inside the capture)
  WHAT: all (the dead Runtime, by a collection), graphs (its CUDA graphs), staging (its pinned
        ring), fi (its FlashInfer route), none
Prints one line: WHERE WHAT ok|FAIL <error> and the capture status seen at the first launch."""
import gc
import sys
import warnings

import numpy as np
import torch
from cuda.bindings import driver as cu

sys.path.insert(0, "tests")
from paged import make_batch  # noqa: E402
from pkvrt.launch import _driver  # noqa: E402
from pkvrt.runtime import Runtime  # noqa: E402

where, what = sys.argv[1], sys.argv[2]
SHAPE = dict(num_qo_heads=32, num_kv_heads=8, head_dim=128, page_size=16)
LENS = [20000, 17000, 5000, 900]
b = make_batch(LENS, **SHAPE, dtype=torch.float16, seed=5)
cache = (b.k_cache, b.v_cache)


def runtime():
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        return Runtime(*SHAPE.values(), torch.float16, max_batch=16, max_pages_per_row=2048,
                       flashinfer_cuda_graph=True)


def step(rt, route, i):
    seq = np.array([n - i for n in LENS], dtype=np.int32)
    bt = b.block_tables[: len(LENS)].cpu().numpy()
    q = torch.randn(len(LENS), 32, 128, device="cuda", dtype=torch.float16)
    rt.plan(seq, bt, force=route)
    return rt.run(q, *cache)


def status():
    r = cu.cuStreamGetCaptureInfo(cu.CUstream(_driver.current_stream_handle()))
    return r[1].name.replace("CU_STREAM_CAPTURE_STATUS_", "")


old = runtime()
for route in ["flashinfer", "pkv_bucket", "pkv_workqueue", "pkv_fused"]:
    for i in range(2):
        step(old, route, i)
torch.cuda.synchronize()
holder = [old]
holder.append(holder)
del old
new = runtime()
done, seen = [], []


def free():
    if done:
        return
    done.append(1)
    rt = holder[0]
    if what == "graphs":
        rt._graphs._entries.clear()
    elif what == "staging":
        rt._ring.clear()
    elif what == "fi":
        rt._fi = None
    elif what == "all":
        holder.clear()
    del rt
    gc.collect()


if where == "early":
    free()
    torch.cuda.synchronize()
elif where == "before":
    enter = torch.cuda.graph.__enter__

    def before_enter(self):
        free()
        return enter(self)
    torch.cuda.graph.__enter__ = before_enter
elif where == "inside":
    launch = _driver.launch

    def inside_launch(kernel, grid, block, params):
        if torch.cuda.is_current_stream_capturing() and not done:
            seen.append(f"{status()} before freeing")
            free()
        if torch.cuda.is_current_stream_capturing():
            seen.append(f"{status()} at {kernel.name}")
        launch(kernel, grid, block, params)
    _driver.launch = inside_launch
try:
    for i in range(3):
        step(new, "pkv_workqueue", i)
    torch.cuda.synchronize()
    print(f"{where:6} {what:8} ok    {seen[:3]}")
except Exception as e:
    print(f"{where:6} {what:8} FAIL  {type(e).__name__}: {str(e)[:110]} {seen[:3]}")
