"""Policy: which route a decode step takes, and its plan. Runs on any machine (no GPU, no kernels).

The data flow of a step starts here::

    routes.toml ──> registry ──> router ──> planner ──> (runtime: staging, graphs) ──> launch
                       calibration ──> costmodel ──┘

- :mod:`~pkvrt.policy.registry`: routes.toml (routes, gates, margins, split bounds), validated.
- :mod:`~pkvrt.policy.calibration`: a GPU's measured constants (bandwidth, partition, time model).
- :mod:`~pkvrt.policy.costmodel`: predicted device time of a route for a step.
- :mod:`~pkvrt.policy.planner`: plans (bucket splits, the balanced partition, FlashInfer's CSR),
  the host twin of the planning kernel.
- :mod:`~pkvrt.policy.router`: the route of a step, from gates, predictions and margins, memoized.
- :mod:`~pkvrt.policy.fallback`: the route when FlashInfer is unavailable.
- :mod:`~pkvrt.policy.blocktables`: a step's block tables as FlashInfer's CSR and as dense
  tables (what the FlashInfer plan and the baselines read), and the page runs rows share.
- :mod:`~pkvrt.policy.sharing`: a step whose rows share pages as shared chunks (each shared page
  read once per chunk of rows) and own segments, merged exactly.

May import: the standard library, numpy, attrs, tomli, ``pkvrt._buildspec`` (what kernels exist)
and ``pkvrt._paths``. Never torch, the launch layer, the runtime, ``pkvrt.measure``, the integrations or
the tools: a planner that works without a GPU is what lets ``pkvrt plan`` and the CPU tests check every decision.
"""
