"""The one door to the CUDA driver: the only module that imports ``cuda.bindings``.

It loads the cubin that the build manifest names for the current GPU into PyTorch's primary
context (never creating a context), looks kernels up by name, and launches them on
``torch.cuda.current_stream()`` read at every launch, so that ``torch.cuda.graph`` capture
records them. Every driver call goes through :func:`check`, which turns an error code into a
:class:`CudaDriverError` naming the call.

A kernel whose image was built for sm_90+ is launched with the programmatic-stream-serialization
attribute (programmatic dependent launch, PDL): it may be scheduled while the previous kernel of
the stream drains, and waits in ``pkv::pdl_enter`` (kernels/decode_common.cuh) for that kernel's
completion before touching memory. ``PKVRT_PDL=0`` in the environment, or :func:`set_pdl`, turns
it off (capturing such launches in a CUDA graph needs a CUDA 12.3+ driver).
"""

from __future__ import annotations

import ctypes
import os
import threading
import warnings

import attrs
import torch

from pkvrt.launch.manifest import Manifest, ManifestError, load_manifest, stale_source

try:
    from cuda.bindings import driver as cu
except ImportError as _exc:  # cuda-python missing: GPU routes unavailable, the rest works
    cu = None
    _IMPORT_ERROR = _exc
else:
    _IMPORT_ERROR = None


class CudaDriverError(RuntimeError):
    """A CUDA driver call failed; the message names the call and the CUDA error."""


def check(call: str, result):
    """Unwrap a cuda-python result tuple ``(CUresult, *values)``; raise naming ``call``."""
    err, *values = result if isinstance(result, tuple) else (result,)
    if err != cu.CUresult.CUDA_SUCCESS:
        _, name = cu.cuGetErrorName(err)
        _, text = cu.cuGetErrorString(err)
        name = name.decode() if isinstance(name, bytes) else str(err)
        text = text.decode() if isinstance(text, bytes) else ""
        raise CudaDriverError(f"{call} failed: {name}: {text}")
    if not values:
        return None
    return values[0] if len(values) == 1 else tuple(values)


def available() -> str | None:
    """None when kernels can be launched here, else the reason they cannot."""
    if cu is None:
        return f"cuda-python is not importable ({_IMPORT_ERROR})"
    if not torch.cuda.is_available():
        return "no CUDA GPU visible to torch"
    return None


def driver_cuda_version() -> tuple[int, int]:
    """The newest CUDA version the installed driver supports, ``(major, minor)``, e.g. (12, 8)
    for a R570 driver (cuDriverGetVersion returns 1000 * major + 10 * minor: 12080). Needs no
    context and no GPU, only libcuda. Raises :class:`CudaDriverError` saying why it cannot ask
    (cuda-python missing, libcuda not loadable)."""
    if cu is None:
        raise CudaDriverError(f"cuda-python is not importable ({_IMPORT_ERROR})")
    try:
        result = cu.cuDriverGetVersion()
    except RuntimeError as e:  # cuda-python could not load libcuda (no NVIDIA driver here)
        raise CudaDriverError(f"cuDriverGetVersion: the CUDA driver library is not loadable "
                              f"({type(e).__name__}: {e})") from None
    version = int(check("cuDriverGetVersion", result))
    return version // 1000, version % 1000 // 10


@attrs.frozen
class Kernel:
    name: str
    func: object          # CUfunction
    smem_bytes: int       # dynamic shared memory it is launched with
    pdl: bool = False     # its image was built for sm_90+ (it waits in pkv::pdl_enter)


_lock = threading.Lock()
_modules: dict[tuple[int, str], tuple] = {}      # (context handle, family) -> (CUmodule, arch number)
_kernels: dict[tuple[int, str], Kernel] = {}     # (context handle, symbol) -> Kernel
_manifest: Manifest | None = None
_pdl: bool | None = None                         # None: decide on first launch
_tls = threading.local()                         # per-thread CUlaunchConfig for PDL launches


def _context() -> int:
    """Handle of PyTorch's primary context on the current device, made current if needed."""
    if (reason := available()) is not None:
        raise CudaDriverError(f"pkvrt kernels unavailable: {reason}")
    torch.cuda.init()
    ctx = check("cuCtxGetCurrent", cu.cuCtxGetCurrent())
    if int(ctx) == 0:  # torch initialised, but this thread has no current context yet
        dev = check("cuDeviceGet", cu.cuDeviceGet(torch.cuda.current_device()))
        ctx = check("cuDevicePrimaryCtxRetain", cu.cuDevicePrimaryCtxRetain(dev))
        check("cuCtxSetCurrent", cu.cuCtxSetCurrent(ctx))
    return int(ctx)


def manifest() -> Manifest:
    global _manifest
    if _manifest is None:
        _manifest = load_manifest()
    return _manifest


def _module(ctx: int, family: str):
    key = (ctx, family)
    if key not in _modules:
        cc = torch.cuda.get_device_capability()
        entry = manifest().select(family, cc)
        if entry is None:
            have = sorted({e.arch for e in manifest().entries if e.family == family})
            raise ManifestError(
                f"no kernel image of family {family!r} runs on {torch.cuda.get_device_name()} "
                f"(sm_{cc[0]}{cc[1]}); built: {have or 'nothing'}"
                + (f" ({manifest().skipped})" if manifest().skipped else "")
                + ". Rebuild with PKVRT_CUDA_ARCHS including this GPU.")
        if (stale := stale_source(manifest(), entry)) is not None:
            if os.environ.get("PKVRT_ALLOW_STALE_CUBINS") != "1":
                raise ManifestError(stale + " (PKVRT_ALLOW_STALE_CUBINS=1 loads it anyway: for "
                                    "A/B runs of an older build whose argument structs match)")
            warnings.warn(f"pkvrt: {stale} (loaded: PKVRT_ALLOW_STALE_CUBINS=1)", RuntimeWarning,
                          stacklevel=3)
        data = entry.path.read_bytes()
        if entry.kind == "ptx":
            warnings.warn(f"pkvrt: no cubin of {family} for sm_{cc[0]}{cc[1]}; JIT-compiling "
                          f"{entry.file} in the driver (slower first load)", RuntimeWarning,
                          stacklevel=3)
            data += b"\0"
        _modules[key] = (check(f"cuModuleLoadData({entry.file})", cu.cuModuleLoadData(data)),
                         entry.arch_number)
    return _modules[key]


def get_kernel(family: str, symbol: str, smem_bytes: int = 0) -> Kernel:
    """Look ``symbol`` up in ``family``'s image for the current device (loaded once per context)."""
    ctx = _context()
    key = (ctx, symbol)
    k = _kernels.get(key)
    if k is not None:
        return k
    with _lock:
        if key in _kernels:
            return _kernels[key]
        module, arch = _module(ctx, family)
        func = check(f"cuModuleGetFunction({symbol})", cu.cuModuleGetFunction(module, symbol.encode()))
        if smem_bytes > 0:  # beyond 48 KB (static included) needs the opt-in
            attr = cu.CUfunction_attribute.CU_FUNC_ATTRIBUTE_MAX_DYNAMIC_SHARED_SIZE_BYTES
            check(f"cuFuncSetAttribute({symbol}, MAX_DYNAMIC_SHARED_SIZE_BYTES={smem_bytes})",
                  cu.cuFuncSetAttribute(func, attr, smem_bytes))
        # griddepcontrol exists from sm_90: an image built for an older arch (also one the
        # driver JIT-compiles on an sm_90 GPU) has no wait in it, so it must not get the attribute.
        k = _kernels[key] = Kernel(name=symbol, func=func, smem_bytes=smem_bytes, pdl=arch >= 90)
        return k


def pdl_enabled() -> bool:
    """Whether programmatic dependent launch is allowed: not ``PKVRT_PDL=0`` (read once per
    process) unless :func:`set_pdl` overrides it. A launch uses it only when its kernel's image
    was built for sm_90+ as well (``Kernel.pdl``), which also means the GPU is sm_90+."""
    global _pdl
    if _pdl is None:
        _pdl = os.environ.get("PKVRT_PDL", "1") != "0"
    return _pdl


def set_pdl(enabled: bool | None) -> None:
    """Force programmatic dependent launch on or off for later launches (None: back to the
    default). For A/B measurements; a graph keeps what it was captured with."""
    global _pdl
    _pdl = None if enabled is None else bool(enabled)


def _pdl_config():
    """This thread's PDL launch configuration (grid, block and stream set per launch)."""
    cfg = getattr(_tls, "cfg", None)
    if cfg is None:
        cfg = _tls.cfg = _new_pdl_config()
    return cfg


def _new_pdl_config():
    attr = cu.CUlaunchAttribute()
    attr.id = cu.CUlaunchAttributeID.CU_LAUNCH_ATTRIBUTE_PROGRAMMATIC_STREAM_SERIALIZATION
    attr.value.programmaticStreamSerializationAllowed = 1
    cfg = cu.CUlaunchConfig()
    cfg.attrs, cfg.numAttrs = [attr], 1
    cfg.blockDimY = cfg.blockDimZ = 1
    return cfg


def current_stream_handle() -> int:
    """torch's current CUDA stream of the current device, as a raw ``cudaStream_t``.

    Read through ``torch._C._cuda_getCurrentRawStream`` (what Triton and Inductor launch on)
    rather than ``torch.cuda.current_stream().cuda_stream``, which builds a Stream object through
    Python device-index helpers: ~15 us per call on the H200 machine's host, one per eager launch
    (benches/NOTES.md, host cost). Same stream, capture included.
    """
    raw = getattr(torch._C, "_cuda_getCurrentRawStream", None)
    if raw is None:   # a torch without it: the public way
        return torch.cuda.current_stream().cuda_stream
    return raw(torch._C._cuda_getDevice())


def capture_id() -> int:
    """The id of the capture sequence torch's current stream is in (unique over the process's
    lifetime); 0 when it is not capturing."""
    status, cid, *_ = check("cuStreamGetCaptureInfo",
                            cu.cuStreamGetCaptureInfo(cu.CUstream(current_stream_handle())))
    return int(cid) if status == cu.CUstreamCaptureStatus.CU_STREAM_CAPTURE_STATUS_ACTIVE else 0


def launch(kernel: Kernel, grid: tuple[int, int, int], block: int, params: ctypes.Structure) -> None:
    """Launch ``kernel`` with one by-value struct argument on torch's current stream.

    The stream is read here, at every launch: a cached handle would bypass graph capture.
    The driver copies ``params`` during the call, so the struct may be freed afterwards.
    """
    argv = (ctypes.c_void_p * 1)(ctypes.addressof(params))
    _launch(kernel, grid, block, ctypes.addressof(argv), None)


class Launcher:
    """One kernel, grid and by-value struct, launched again at each call (``ops.PreparedLaunch``):
    the argument array, and with PDL the launch configuration, are built once; a call reads
    torch's current stream (so a capture records it) and launches. The struct must outlive it
    (held here). Not for concurrent calls from several threads (the configuration's stream
    field is shared)."""

    __slots__ = ("kernel", "grid", "block", "params", "_argv", "_argp", "_cfg")

    def __init__(self, kernel: Kernel, grid: tuple[int, int, int], block: int, params: ctypes.Structure):
        self.kernel, self.grid, self.block, self.params = kernel, grid, block, params
        self._argv = (ctypes.c_void_p * 1)(ctypes.addressof(params))
        self._argp = ctypes.addressof(self._argv)
        self._cfg = None

    def __call__(self) -> None:
        if self._cfg is None and self.kernel.pdl and pdl_enabled():
            self._cfg = _shaped(_new_pdl_config(), self.kernel, self.grid, self.block)
        _launch(self.kernel, self.grid, self.block, self._argp, self._cfg)


def _shaped(cfg, kernel: Kernel, grid, block: int):
    """``cfg`` (a PDL launch configuration) with ``grid``, ``block`` and the kernel's dynamic
    shared memory filled in."""
    cfg.gridDimX, cfg.gridDimY, cfg.gridDimZ = grid
    cfg.blockDimX, cfg.sharedMemBytes = block, kernel.smem_bytes
    return cfg


def _launch(kernel: Kernel, grid, block: int, argp: int, cfg) -> None:
    """cuLaunchKernel(Ex) on torch's current stream; ``cfg``: a PDL configuration with this
    grid, block and shared memory filled in, or None (one is filled in here when PDL applies)."""
    stream = cu.CUstream(current_stream_handle())
    pdl = kernel.pdl and pdl_enabled()
    if pdl:
        if cfg is None:
            cfg = _shaped(_pdl_config(), kernel, grid, block)
        cfg.hStream = stream
        result = cu.cuLaunchKernelEx(cfg, kernel.func, argp, 0)
    else:
        result = cu.cuLaunchKernel(kernel.func, grid[0], grid[1], grid[2], block, 1, 1,
                                   kernel.smem_bytes, stream, argp, 0)
    err = result[0] if isinstance(result, tuple) else result
    if err != cu.CUresult.CUDA_SUCCESS:   # the message only on failure: it costs a format per launch
        name = "cuLaunchKernelEx" if pdl else "cuLaunchKernel"
        check(f"{name}({kernel.name}, grid={tuple(grid)}, block={block}{', PDL' if pdl else ''})", result)


def occupancy(kernel: Kernel, block: int) -> int:
    """Most CTAs of ``kernel`` resident on one SM at once with ``block`` threads and its dynamic
    shared memory (cuOccupancyMaxActiveBlocksPerMultiprocessor)."""
    return int(check(f"cuOccupancyMaxActiveBlocksPerMultiprocessor({kernel.name})",
                     cu.cuOccupancyMaxActiveBlocksPerMultiprocessor(kernel.func, block, kernel.smem_bytes)))


def function_attributes(kernel: Kernel) -> dict[str, int]:
    """Registers, local (spill) bytes, static smem of a loaded kernel (for doctor/tests)."""
    A = cu.CUfunction_attribute
    names = {"registers": A.CU_FUNC_ATTRIBUTE_NUM_REGS, "local_bytes": A.CU_FUNC_ATTRIBUTE_LOCAL_SIZE_BYTES,
             "static_smem": A.CU_FUNC_ATTRIBUTE_SHARED_SIZE_BYTES,
             "max_threads": A.CU_FUNC_ATTRIBUTE_MAX_THREADS_PER_BLOCK}
    return {k: check(f"cuFuncGetAttribute({kernel.name}, {k})", cu.cuFuncGetAttribute(a, kernel.func))
            for k, a in names.items()}


def graph_node_count(graph: "torch.cuda.CUDAGraph") -> int:
    """Nodes in a captured graph (needs ``CUDAGraph(keep_graph=True)``): 0 means nothing was
    recorded, e.g. a launch went to another stream than the capturing one."""
    handle = cu.CUgraph(graph.raw_cuda_graph())
    _, count = check("cuGraphGetNodes", cu.cuGraphGetNodes(handle, 0))
    return int(count)
