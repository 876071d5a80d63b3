"""Launch: the door to the GPU. Loads the cubins built at install time and launches kernels.

- :mod:`~pkvrt.launch._driver`: cuda-python's driver API (the only module that imports it):
  modules, functions, launches with PDL attributes on the current torch stream.
- :mod:`~pkvrt.launch.manifest`: the build's manifest (which cubin holds which kernel, for which
  architectures), written by ``pkvrt/_build.py``.
- :mod:`~pkvrt.launch.ops`: one function per kernel (split decode, merge, workqueue decode, the
  planning kernel): argument checks, grids, shared memory, FP8 scales.

May import: torch, cuda-python, ``pkvrt._buildspec`` and ``pkvrt._paths``. Never the policy,
the runtime, ``pkvrt.measure``, the integrations or the tools: a kernel call knows tensors and grids, not routes.
"""
