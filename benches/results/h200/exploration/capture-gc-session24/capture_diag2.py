"""pytest plugin (session 24): why does a planning-graph capture fail with
CUDA_ERROR_STREAM_CAPTURE_INVALIDATED at its first launch (session 23, calls 3-7)?
Logs to $DIAG_LOG:
* every pkvrt launch made while the current stream captures, with the capture status before it;
* every cyclic garbage collection that starts while the current stream captures, with the status
  before and after it;
* DIAG_NOFIX=1: pkvrt.runtime.graphs.capture's gc.disable() is made a no-op (the code before the fix);
* DIAG_SAVEALL=1: before every torch.cuda.graph capture, collect with gc.DEBUG_SAVEALL and log the
  unreachable objects whose type lives in torch.cuda / pkvrt / flashinfer / cuda (then free them
  outside the capture).
usage: PYTHONPATH=DIR pytest -p capture_diag2 ..."""
import collections
import gc
import os
import types

ring = collections.deque(maxlen=16)
log = open(os.environ.get("DIAG_LOG", "/dev/stdout"), "a", buffering=1)
captures = [0]


def pytest_configure(config):
    import torch
    from cuda.bindings import driver as cu
    from pkvrt.launch import _driver
    from pkvrt.runtime import graphs

    def status():
        if not torch.cuda.is_initialized():
            return "NONE"
        r = cu.cuStreamGetCaptureInfo(cu.CUstream(_driver.current_stream_handle()))
        return r[1].name.replace("CU_STREAM_CAPTURE_STATUS_", "") if int(r[0]) == 0 else f"err {r[0]}"

    orig = _driver.launch

    def launch(kernel, grid, block, params):
        st = status()
        if st != "NONE":
            ring.append(f"launch {kernel.name} {tuple(grid)} status {st}")
        try:
            orig(kernel, grid, block, params)
        except Exception:
            log.write(f"DIAG capture #{captures[0]}: launch of {kernel.name} failed; status before "
                      f"it {st}; recent: {list(ring)}\n")
            raise
    _driver.launch = launch

    before = {}

    def on_gc(phase, info):
        if phase == "start":
            before["st"] = status()
            return
        st0, st1 = before.pop("st", "NONE"), status()
        if st0 != "NONE" or st1 != "NONE":
            msg = f"gc gen {info['generation']} collected {info['collected']} status {st0}->{st1}"
            ring.append(msg)
            log.write(f"DIAG capture #{captures[0]}: {msg}\n")
    gc.callbacks.append(on_gc)

    if os.environ.get("DIAG_NOFIX") == "1":
        graphs.gc = types.SimpleNamespace(disable=lambda: None, enable=gc.enable, isenabled=gc.isenabled)

    enter = torch.cuda.graph.__enter__

    def counted_enter(self):
        captures[0] += 1
        if os.environ.get("DIAG_SAVEALL") == "1":
            gc.set_debug(gc.DEBUG_SAVEALL)
            gc.collect()
            gc.set_debug(0)
            kinds = collections.Counter()
            for o in gc.garbage:
                m = type(o).__module__ or ""
                if m.startswith(("torch.cuda", "pkvrt", "flashinfer", "cuda")) or "CUDA" in type(o).__name__:
                    kinds[f"{m}.{type(o).__qualname__}"] += 1
            n = len(gc.garbage)
            gc.garbage.clear()
            gc.collect()
            if kinds:
                log.write(f"DIAG capture #{captures[0]}: {n} unreachable objects before it; CUDA-side: "
                          f"{dict(kinds)}\n")
        return enter(self)
    torch.cuda.graph.__enter__ = counted_enter
