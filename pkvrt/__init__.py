"""pkvrt: paged-KV decode-attention runtime.

Each decode step picks the fastest exact route for GQA decode attention over a paged KV cache
(FlashInfer's decode kernel or the PersistentKV kernels), by a policy declared in routes.toml and
constants from a per-GPU calibration file, and replays the chosen kernels as CUDA graphs.

Importing pkvrt is cheap: torch-backed pieces load on first use.
"""

__version__ = "0.1.0"

_LAZY = {
    "Runtime": "pkvrt.runtime",
    "RuntimeOptions": "pkvrt.runtime.options",
    "BatchDecodeWithPagedKVCacheWrapper": "pkvrt.runtime.wrapper",
    "CUDAGraphBatchDecodeWithPagedKVCacheWrapper": "pkvrt.runtime.wrapper",
    "SharedPagesRuntime": "pkvrt.runtime.shared",
    "load_routes": "pkvrt.policy.registry",
    "load_calibration": "pkvrt.policy.calibration",
    "find_calibration": "pkvrt.policy.calibration",
    "Router": "pkvrt.policy.router",
}


def __getattr__(name):
    if name in _LAZY:
        import importlib

        return getattr(importlib.import_module(_LAZY[name]), name)
    raise AttributeError(f"module 'pkvrt' has no attribute {name!r}")


__all__ = ["__version__", *_LAZY]
