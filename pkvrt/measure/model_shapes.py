"""The attention shapes of models engines serve, and the decode steps they are measured on.

Each :class:`ModelShape` is one model's attention as its config.json gives it (H_q, H_kv, head
dim, and per layer kind the sliding window, logits soft cap, sinks and softmax scale) with its
layer pattern over :data:`LAYERS` layers (local and global layers in the model's real ratio).
``benches/model_shapes.py`` runs each of them in the engine protocol (the whole step, planning
and every layer, in one CUDA graph) against FlashInfer's fastest correct path per layer kind.

Pure data and numpy: runs and is tested without a GPU.
"""

from __future__ import annotations

import math

import attrs
import numpy as np

from pkvrt.measure import traces

LAYERS = 32            # layers per measured step (the engine protocol's)
FLOOR_BYTES_PER_US = 4.2e6   # the floor's read bandwidth, 4.2 TB/s (docs/measurement.md)


@attrs.frozen
class LayerKind:
    """One kind of attention layer: ``window_left`` -1 or a sliding window (the last
    window_left + 1 tokens), ``logits_soft_cap`` 0 or the cap, ``sinks`` one learned logit per
    query head, ``sm_scale`` None (1/sqrt(D)) or the model's scale."""

    name: str = "global"
    window_left: int = -1
    logits_soft_cap: float = 0.0
    sinks: bool = False
    sm_scale: float | None = None


@attrs.frozen
class ModelShape:
    """A model's decode attention: shape, and ``pattern`` the layer kinds of consecutive layers,
    repeated over the :data:`LAYERS` measured layers (Gemma-3: 5 local then 1 global)."""

    name: str
    num_qo_heads: int
    num_kv_heads: int
    head_dim: int
    pattern: tuple[LayerKind, ...] = (LayerKind(),)

    @property
    def group(self) -> int:
        return self.num_qo_heads // self.num_kv_heads

    def layer_kinds(self, layers: int = LAYERS) -> list[LayerKind]:
        """The kind of each of ``layers`` consecutive layers."""
        return [self.pattern[i % len(self.pattern)] for i in range(layers)]

    def kinds(self) -> list[LayerKind]:
        """The distinct kinds, in pattern order."""
        return list(dict.fromkeys(self.pattern))


def _local(window: int, **kw) -> LayerKind:
    return LayerKind(name=f"local{window}", window_left=window - 1, **kw)


GEMMA2_CAP = 50.0
MODELS = {m.name: m for m in (
    ModelShape("llama-3.1-8b", 32, 8, 128),
    ModelShape("llama-3.1-70b", 64, 8, 128),
    ModelShape("llama-3.2-3b", 24, 8, 128),
    ModelShape("qwen2.5-7b", 28, 4, 128),
    ModelShape("qwen2.5-14b", 40, 8, 128),
    ModelShape("qwen3-235b-a22b", 64, 4, 128),
    ModelShape("qwen2.5-0.5b", 14, 2, 64),
    ModelShape("smollm2-135m", 9, 3, 64),
    ModelShape("phi-3-mini", 32, 32, 96),
    ModelShape("gemma-2-9b", 16, 8, 256, (
        _local(4096, logits_soft_cap=GEMMA2_CAP, sm_scale=256 ** -0.5),
        LayerKind(logits_soft_cap=GEMMA2_CAP, sm_scale=256 ** -0.5))),
    ModelShape("gemma-3-12b", 16, 8, 256, (_local(1024),) * 5 + (LayerKind(),)),
    ModelShape("gemma-3-27b", 32, 16, 128, (_local(1024, sm_scale=168 ** -0.5),) * 5
               + (LayerKind(sm_scale=168 ** -0.5),)),
    ModelShape("gpt-oss-20b", 64, 8, 64, (_local(128, sinks=True), LayerKind(sinks=True))),
)}


@attrs.frozen
class StepCase:
    """One measured decode step: ``seq_lens`` int32 [B] (new token included)."""

    name: str
    seq_lens: np.ndarray = attrs.field(eq=False)


def sample_steps(trace_spec: str, *, max_active: int, count: int, seed: int) -> list[StepCase]:
    """``count`` steps spread evenly over the continuous-decode loop of a trace
    (``traces.resolve_trace``: a family, "mixed" or a CSV/JSON path), the loop's warm-up (the
    first ``max_active`` steps) skipped; each named ``<trace>-B<max_active>-step<index>``."""
    trace = traces.resolve_trace(trace_spec, seed=seed)
    steps = [s for s in traces.decode_steps(trace, max_active=max_active) if len(s.seq_lens) == max_active]
    if not steps:
        raise ValueError(f"{trace_spec}: no step has {max_active} active rows")
    picks = np.unique(np.linspace(0, len(steps) - 1, num=min(count, len(steps))).round().astype(int))
    label = trace.name if trace_spec in traces.FAMILIES or trace_spec == "mixed" else trace.name
    return [StepCase(f"{label}-B{max_active}-step{steps[i].index}", steps[i].seq_lens.copy())
            for i in picks]


def isolated_steps() -> list[StepCase]:
    """The isolated cases: one 32K row, and eight."""
    return [StepCase("isolated-B1-32K", np.array([32768], np.int32)),
            StepCase("isolated-B8-32K", np.full(8, 32768, np.int32))]


def attended(seq_lens: np.ndarray, kind: LayerKind) -> np.ndarray:
    """Tokens each row attends to in a layer of ``kind``: all, or its window."""
    seq = np.asarray(seq_lens, np.int64)
    return seq if kind.window_left < 0 else np.minimum(seq, kind.window_left + 1)


def floor_us(model: ModelShape, seq_lens: np.ndarray, *, kv_bytes: int = 2,
             layers: int = LAYERS) -> float:
    """The step's read floor: the K and V bytes its layers must read (each layer its window) at
    4.2 TB/s, in microseconds."""
    per_token = 2 * model.num_kv_heads * model.head_dim * kv_bytes
    total = sum(int(attended(seq_lens, k).sum()) for k in model.layer_kinds(layers)) * per_token
    return total / FLOOR_BYTES_PER_US


def geomean(xs) -> float:
    xs = [float(x) for x in xs if x and x > 0]
    return math.exp(sum(map(math.log, xs)) / len(xs)) if xs else float("nan")
