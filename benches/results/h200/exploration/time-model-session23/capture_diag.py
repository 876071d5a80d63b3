"""pytest plugin (session 23, call 9): before every pkvrt launch inside a stream capture, read the
capture's status; on a failed launch print whether the capture was already invalidated and the
last launches of that capture. usage: PYTHONPATH=DIR pytest -p capture_diag ..."""
import collections

ring = collections.deque(maxlen=12)


def pytest_configure(config):
    from cuda.bindings import driver as cu
    from pkvrt.launch import _driver
    orig = _driver.launch

    def launch(kernel, grid, block, params):
        r = cu.cuStreamGetCaptureInfo(cu.CUstream(_driver.current_stream_handle()))
        st = r[1] if int(r[0]) == 0 else f"err {r[0]}"
        ring.append((kernel.name, tuple(grid), block, kernel.smem_bytes, str(st)))
        try:
            orig(kernel, grid, block, params)
        except Exception:
            print(f"\nDIAG launch of {kernel.name} failed; capture status before it: {st}; pdl "
                  f"{kernel.pdl and _driver.pdl_enabled()}; last launches: {list(ring)}", flush=True)
            raise
    _driver.launch = launch
