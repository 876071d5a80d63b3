"""Measure: workloads and the timing harness around the library (benches, never the runtime's path).

- :mod:`~pkvrt.measure.traces`: request traces (synthetic families, CSV files) into decode steps.
- :mod:`~pkvrt.measure.pagetable`: paged KV caches and block tables for a trace.
- :mod:`~pkvrt.measure.harness`: the serving and engine protocols (CUDA events, graphs per step).
- :mod:`~pkvrt.measure.fi_engines`: FlashInfer's decode paths (tensor-core, CUDA-core, XQA,
  cuDNN) as baseline engines.
- :mod:`~pkvrt.measure.model`, :mod:`~pkvrt.measure.model_attention`,
  :mod:`~pkvrt.measure.model_tp`: a Llama-shaped model step (one GPU and tensor-parallel).
- :mod:`~pkvrt.measure.model_shapes`: the attention shapes of served models (group sizes, head
  dims, windows, soft caps, sinks) and the steps ``benches/model_shapes.py`` measures them on.
- :mod:`~pkvrt.measure.results`, :mod:`~pkvrt.measure.model_results`,
  :mod:`~pkvrt.measure.tp_results`: results files with the GPU, versions, seeds and hashes.
- :mod:`~pkvrt.measure.coverage_results`: the report tables of the coverage benchmarks (model
  shapes, the drop-in wrapper, rows that share pages).

May import: the runtime, the policy, the launch layer, ``pkvrt.reference`` (the FP32 answer the
benches check against). Never the tools (the commands import it) or the integrations.
"""
