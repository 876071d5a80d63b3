"""Adapters that put pkvrt under other libraries' models; each imports its library lazily.

``pkvrt.integrations.transformers``: Hugging Face transformers models on a paged KV cache
(an attention function and a cache passed as the model's ``cache``).

May import ``pkvrt.runtime`` (the decode wrapper's helpers), ``pkvrt.reference`` and itself:
an adapter is a user of the runtime, never a part of it. Never the policy, the launch layer,
``pkvrt.measure`` or the tools.
"""
