"""Tensor-parallel decode of ``pkvrt.measure.model``'s Llama-shaped decoder: the step of
:class:`pkvrt.measure.model.Model` spread over TP ranks under ``torch.distributed`` (NCCL on GPUs, gloo
on the CPU), each rank's attention through the same backends (``pkvrt.measure.model_attention``) over
its own heads. Used by ``examples/tp_decode.py``, ``benches/tp_decode.py`` and the tests.

Layout (Megatron's): rank r of TP holds

* H_q/TP query heads ``[r H_q/TP, (r+1) H_q/TP)`` and H_kv/TP KV heads ``[r H_kv/TP, ...)``
  (the same group size G, so query head j of the rank reads the rank's KV head j // G);
* W_qkv column-parallel: the q, k and v rows of its heads, ``[(H_q + 2 H_kv) D / TP, hidden]``;
* W_o row-parallel: the H_q/TP * D input columns of its heads, ``[hidden, H_q D / TP]``;
* W_gate_up column-parallel (gate rows, then up rows, each ``intermediate/TP``), W_down
  row-parallel (``[hidden, intermediate/TP]``);
* replicated: the embedding, both norms of every layer, the final norm and the LM head (every
  rank computes the full logits, so every rank takes the same greedy token without a collective;
  Megatron would split the vocabulary, which this does not model);
* paged caches ``[num_pages, H_kv/TP, page_size, D]`` per layer: its KV heads only. The page
  pool (``pkvrt.measure.model.PagePool``) is replicated: every rank draws the same pages from the same
  seed, so block tables and lengths agree on every rank and each rank plans its attention from
  them alone (no collective for planning).

One decode step on a rank (:meth:`TPModel.forward`; x is replicated)::

    x = embed[tokens]                                        [B, hidden]
    per layer:
        q, k, v = rms_norm(x) @ W_qkv[r]^T                   [B, H_q/TP, D], [B, H_kv/TP, D] x 2
        rope, append k, v into the rank's caches, o = attention(q, ...)   [B, H_q/TP, D]
        x = x + all_reduce(o @ W_o[r]^T)                     partial sums over the ranks' heads
        g, u = rms_norm(x) @ W_gate_up[r]^T                  [B, intermediate/TP] each
        x = x + all_reduce((silu(g) * u) @ W_down[r]^T)
    logits = rms_norm(x) @ W_head^T                          [B, vocab] on every rank

Two all-reduces of ``[B, hidden]`` per layer (``torch.distributed.all_reduce``, sum). At TP = 1
the step is :meth:`pkvrt.measure.model.Model.forward`'s, kernel for kernel (``addmm``, no collective),
so a TP = 1 model gives the one-GPU logits bit for bit.

Weights and caches are the one-GPU model's, sliced: :func:`make_shard_weights` draws the full
weights of ``pkvrt.measure.model.make_weights`` one matrix at a time on the rank's device (its generator
sequence, :func:`pkvrt.measure.model.weight_draws`) and keeps only the rank's slice; the caches likewise
(:func:`make_shard_caches`, one layer's K or V at a time). A rank therefore holds its shard and
at most two full matrices (the embedding: 1 GB), never the 16 GB model. The draws equal the
one-GPU model's on any GPU of the same kind (CUDA's random numbers depend on the SM count), so
:func:`check_against_one_gpu` can compare the TP step with the one-GPU step.

CUDA graphs: the whole step (planning, attention, projections, both all-reduces of every layer,
MLP, LM head) is captured in one graph per batch size by :func:`capture_step` (the
``DecodeLoop.capture`` of ``pkvrt.measure.model``, in thread-local capture mode so that NCCL's watchdog
thread may query its events meanwhile); :class:`TPModel` runs one eager all-reduce at
construction so that the NCCL communicator exists before any capture. Every rank must replay
its graph the same number of times (the collectives pair up).

Launch: ``torchrun --nproc-per-node TP ...`` (or ``python3 -m torch.distributed.run``), or
:func:`spawn_ranks` from one process; each rank then calls :func:`init_distributed`.
"""

from __future__ import annotations

import os
import socket

import attrs
import torch
import torch.distributed as dist

from pkvrt.measure.model import (HEADROOM_BYTES, Case, DecodeLoop, KVCaches, LayerWeights, Model,
                                 ModelConfig, Weights, cache_draws, kv_bytes, make_caches,
                                 make_weights, pages_needed, run_steps, weight_draws)


# --------------------------------------------------------------------------- the shard

def check_tp(cfg: ModelConfig, tp: int) -> None:
    """Raise ValueError unless ``tp`` splits ``cfg`` evenly: it must divide num_kv_heads (each
    rank holds whole KV heads), num_qo_heads and intermediate."""
    if isinstance(tp, bool) or not isinstance(tp, int) or tp < 1:
        raise ValueError(f"tensor parallelism tp={tp!r}: expected a positive integer")
    keys = ("num_kv_heads", "num_qo_heads", "intermediate")
    for key in keys:
        v = getattr(cfg, key)
        if v % tp:
            ok = [t for t in range(1, cfg.num_kv_heads + 1) if not any(getattr(cfg, k) % t for k in keys)]
            raise ValueError(f"tensor parallelism tp={tp}: must divide {key}={v} of {cfg.name} "
                             f"(each rank holds {key}/tp of them); tp in {ok} would")


def rank_config(cfg: ModelConfig, tp: int) -> ModelConfig:
    """The shape one rank's attention and caches see: H_q/TP query heads, H_kv/TP KV heads (the
    same G), ``intermediate/TP``; its ``hidden`` is H_q/TP * D, the width of the rank's attention
    output (the residual stream keeps ``cfg.hidden``). What the attention backends
    (``make_backend``), ``DecodeLoop`` and :func:`pkvrt.measure.model.kv_bytes` are given for a rank."""
    check_tp(cfg, tp)
    return attrs.evolve(cfg, num_qo_heads=cfg.num_qo_heads // tp, num_kv_heads=cfg.num_kv_heads // tp,
                        hidden=cfg.hidden // tp, intermediate=cfg.intermediate // tp,
                        name=f"{cfg.name}-tp{tp}")


@attrs.frozen
class Shard:
    """Rank ``rank`` of ``tp``: its query heads, KV heads and MLP columns, each ``(first, end)``."""

    tp: int
    rank: int
    q_heads: tuple
    kv_heads: tuple
    inter: tuple


def shard_of(cfg: ModelConfig, tp: int, rank: int) -> Shard:
    """The part of ``cfg``'s model rank ``rank`` of ``tp`` holds (module docstring).

    Example, LLAMA3_8B at TP 2, rank 1: query heads 16..31, KV heads 4..7, MLP columns
    7168..14335."""
    check_tp(cfg, tp)
    if isinstance(rank, bool) or not isinstance(rank, int) or not 0 <= rank < tp:
        raise ValueError(f"tensor parallelism: rank={rank!r}: expected an integer in [0, tp={tp})")
    hq, hkv, inter = cfg.num_qo_heads // tp, cfg.num_kv_heads // tp, cfg.intermediate // tp
    return Shard(tp=tp, rank=rank, q_heads=(rank * hq, (rank + 1) * hq),
                 kv_heads=(rank * hkv, (rank + 1) * hkv), inter=(rank * inter, (rank + 1) * inter))


def shard_matrix(cfg: ModelConfig, shard: Shard, name: str, t: torch.Tensor) -> torch.Tensor:
    """The rank's slice of one of :func:`pkvrt.measure.model.weight_draws`' matrices (a new contiguous
    tensor, or ``t`` itself when replicated).

    qkv ``[(H_q + 2 H_kv) D, hidden]`` -> the rank's q rows, then k rows, then v rows; o
    ``[hidden, H_q D]`` -> its heads' columns; gate_up ``[2 I, hidden]`` -> its gate rows, then
    its up rows; down ``[hidden, I]`` -> its columns; embed, lm_head: replicated."""
    d, hq, hkv, inter = cfg.head_dim, cfg.num_qo_heads, cfg.num_kv_heads, cfg.intermediate
    (q0, q1), (k0, k1), (i0, i1) = shard.q_heads, shard.kv_heads, shard.inter
    if name == "qkv":
        return torch.cat([t[q0 * d:q1 * d], t[(hq + k0) * d:(hq + k1) * d],
                          t[(hq + hkv + k0) * d:(hq + hkv + k1) * d]])
    if name == "o":
        return t[:, q0 * d:q1 * d].contiguous()
    if name == "gate_up":
        return torch.cat([t[i0:i1], t[inter + i0:inter + i1]])
    if name == "down":
        return t[:, i0:i1].contiguous()
    if name in ("embed", "lm_head"):
        return t
    raise ValueError(f"shard_matrix: unknown matrix {name!r}")


def _assemble(cfg: ModelConfig, parts: dict, device) -> Weights:
    def ones() -> torch.Tensor:
        return torch.ones(cfg.hidden, device=device, dtype=cfg.dtype)

    layers = tuple(LayerWeights(attn_norm=ones(), qkv=parts["qkv", i], o=parts["o", i], mlp_norm=ones(),
                                gate_up=parts["gate_up", i], down=parts["down", i])
                   for i in range(cfg.layers))
    return Weights(embed=parts["embed", None], layers=layers, final_norm=ones(),
                   lm_head=parts["lm_head", None])


def shard_weights(cfg: ModelConfig, shard: Shard, weights: Weights) -> Weights:
    """The rank's shard of full weights (:func:`shard_matrix` of each matrix; norms shared)."""
    parts = {("embed", None): weights.embed, ("lm_head", None): weights.lm_head}
    for i, lw in enumerate(weights.layers):
        for name in ("qkv", "o", "gate_up", "down"):
            parts[name, i] = shard_matrix(cfg, shard, name, getattr(lw, name))
    return _assemble(cfg, parts, weights.embed.device)


def make_shard_weights(cfg: ModelConfig, shard: Shard, *, device="cuda", seed: int = 0) -> Weights:
    """``shard_weights(cfg, shard, make_weights(cfg, device=device, seed=seed))`` without ever
    holding the full weights: each matrix is drawn on ``device`` in make_weights' order, sliced,
    and dropped. Allocates :func:`shard_weight_bytes`."""
    parts = {}
    for name, layer, t in weight_draws(cfg, device=device, seed=seed):
        parts[name, layer] = shard_matrix(cfg, shard, name, t)
        del t
    return _assemble(cfg, parts, device)


def shard_caches(cfg: ModelConfig, shard: Shard, caches: KVCaches) -> KVCaches:
    """The rank's KV heads of full caches ``[layers, pages, H_kv, page_size, D]`` (copies)."""
    k0, k1 = shard.kv_heads
    return KVCaches(k=caches.k[:, :, k0:k1].contiguous(), v=caches.v[:, :, k0:k1].contiguous())


def make_shard_caches(cfg: ModelConfig, shard: Shard, num_pages: int, *, device="cuda",
                      seed: int = 1) -> KVCaches:
    """``shard_caches(cfg, shard, make_caches(cfg, num_pages, device=device, seed=seed))``
    without the full caches: each layer's K or V is drawn into one scratch layer on ``device``
    (:func:`pkvrt.measure.model.cache_draws`; ``kv_bytes / (2 layers)`` bytes, freed on return) and the
    rank's heads are copied out of it."""
    k0, k1 = shard.kv_heads
    shape = (cfg.layers, num_pages, k1 - k0, cfg.page_size, cfg.head_dim)
    kv = (torch.empty(shape, device=device, dtype=cfg.dtype), torch.empty(shape, device=device, dtype=cfg.dtype))
    scratch = torch.empty(num_pages, cfg.num_kv_heads, cfg.page_size, cfg.head_dim, device=device,
                          dtype=cfg.dtype)
    for layer, i, t in cache_draws(cfg, num_pages, lambda layer, i: scratch, device=device, seed=seed):
        kv[i][layer].copy_(t[:, k0:k1])
    return KVCaches(k=kv[0], v=kv[1])


# --------------------------------------------------------------------------- memory

def shard_weight_bytes(cfg: ModelConfig, tp: int) -> int:
    """Bytes of one rank's weights: the replicated embedding, LM head and norms plus 1/TP of
    every layer's W_qkv, W_o, W_gate_up, W_down. LLAMA3_8B: TP 1 16.06e9 B (15.0 GiB), TP 2
    9.08e9 (8.5 GiB), TP 4 5.59e9, TP 8 3.85e9."""
    check_tp(cfg, tp)
    h = cfg.hidden
    split = cfg.qkv_dim * h + h * h + 3 * cfg.intermediate * h
    return cfg.dtype_bytes * (cfg.layers * (split // tp + 2 * h) + 2 * cfg.vocab * h + h)


def plan_tp_cases(cfg: ModelConfig, tp: int, batches, contexts, *, steps: int, capacity_bytes: int,
                  headroom_bytes: int = HEADROOM_BYTES) -> list[Case]:
    """Every (batch, context) at ``tp`` with one rank's bytes: its weights, its KV heads' caches,
    the scratch layer :func:`make_shard_caches` draws into, and ``headroom_bytes``; it fits when
    that is at most ``capacity_bytes`` (one GPU's memory). ``Case.weight_bytes`` and
    ``Case.kv_bytes`` are per rank.

    Example, LLAMA3_8B, B8 x 128K (+ 24 steps) on an H200 (139.8 GiB): TP 1 needs 15.0 + 128.0 +
    2.0 (scratch) + 4 = 149.0 GiB and is skipped; TP 2 needs 8.5 + 64.0 + 2.0 + 4 = 78.5 GiB."""
    w = shard_weight_bytes(cfg, tp)
    local = rank_config(cfg, tp)
    out = []
    for b in batches:
        for ctx in contexts:
            kv = kv_bytes(local, b, ctx, steps)
            scratch = kv_bytes(cfg, b, ctx, steps) // (2 * cfg.layers)
            need = w + kv + scratch + headroom_bytes
            fits = need <= capacity_bytes
            reason = None if fits else (
                f"TP {tp}: a rank needs {need / 2**30:.1f} GiB (weights {w / 2**30:.1f} + KV "
                f"{kv / 2**30:.1f} + draw scratch {scratch / 2**30:.1f} + headroom "
                f"{headroom_bytes / 2**30:.1f}) > {capacity_bytes / 2**30:.1f} GiB of device memory")
            out.append(Case(batch=b, context=ctx, kv_bytes=kv, weight_bytes=w, need_bytes=need,
                            fits=fits, reason=reason))
    return out


# --------------------------------------------------------------------------- the model

class TPModel(Model):
    """One rank's part of the decoder (module docstring): a :class:`pkvrt.measure.model.Model` whose
    ``cfg`` is the rank-local shape (:func:`rank_config`, what ``DecodeLoop`` and the attention
    backends read) and whose ``full`` is the one-GPU config.

    Parameters
    ----------
    cfg : the one-GPU model's config. shard : :func:`shard_of` (cfg, tp, rank).
    weights : the rank's shard (:func:`make_shard_weights`), on the rank's device.
    group : the process group of the TP ranks (``dist.group.WORLD`` after
        :func:`init_distributed`); collective: every rank constructs its TPModel together. Its
        size must be ``shard.tp``, this process's rank in it ``shard.rank``; NCCL needs the
        weights on this process's current CUDA device, each rank on its own GPU; gloo CPU
        tensors. None: no communication at all (one rank's shard alone: the per-rank cost of
        TP > 1 on one GPU, ``benches/tp_decode.py --shard-only``; its logits mean nothing).

    ``communicate`` (True with a group of more than one rank) may be turned off before a capture
    to time the step without its all-reduces.
    """

    def __init__(self, cfg: ModelConfig, shard: Shard, weights: Weights, *, group=None):
        super().__init__(rank_config(cfg, shard.tp), weights)
        self.hidden = cfg.hidden   # the replicated residual stream (self.cfg.hidden is H_q/TP * D)
        self.full, self.shard, self.group = cfg, shard, group
        self.device = weights.embed.device
        self._check_weights()
        if group is not None:
            check_group(shard, group, self.device)
            warm = torch.zeros(1, device=self.device, dtype=cfg.dtype)
            dist.all_reduce(warm, group=group)   # NCCL: the communicator exists before a capture
            if self.device.type == "cuda":
                torch.cuda.synchronize(self.device)
        self.communicate = group is not None and shard.tp > 1

    def _check_weights(self) -> None:
        lw, c = self.w.layers[0], self.cfg
        want = {"qkv": (c.qkv_dim, self.full.hidden), "o": (self.full.hidden, c.hidden),
                "gate_up": (2 * c.intermediate, self.full.hidden), "down": (self.full.hidden, c.intermediate)}
        for name, shape in want.items():
            got = tuple(getattr(lw, name).shape)
            if got != shape:
                raise ValueError(f"TPModel: layer 0's {name} is {list(got)}; rank {self.shard.rank} of "
                                 f"TP {self.shard.tp} expects {list(shape)} (make_shard_weights)")
        if len(self.w.layers) != self.full.layers:
            raise ValueError(f"TPModel: {len(self.w.layers)} layers of weights for {self.full.layers}")

    def _add_projected(self, x: torch.Tensor, a: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
        """x + the sum over ranks of a @ w^T (x [B, hidden], a [B, n/TP], w [hidden, n/TP]):
        the row-parallel W_o and W_down with their all-reduce; the rest of the step is
        :meth:`pkvrt.measure.model.Model.forward` with the rank-local shapes (caches ``[layers, pages,
        H_kv/TP, page_size, D]``, attn_out ``[layers, B, H_q/TP, D]``; logits ``[B, vocab]``,
        full and the same on every rank)."""
        if self.shard.tp == 1:
            return torch.addmm(x, a, w.t())           # the one-GPU step's kernel
        part = torch.mm(a, w.t())                     # [B, hidden], this rank's partial sum
        if self.communicate:
            dist.all_reduce(part, group=self.group)
        return x + part


def capture_step(loop: DecodeLoop, attention):
    """``loop.capture(attention)`` (warm-up on a side stream, then one CUDA graph of the whole
    step; an empty graph is refused) in thread-local capture mode: NCCL's watchdog thread may
    query the events of the warm-up's all-reduces while this thread captures. Prepares one step
    for the warm-up run, which then runs it: reset the loop before the steps that count."""
    from pkvrt.runtime import graphs

    loop.prepare(attention)
    device = loop.tokens.device
    return graphs.capture(lambda: loop.forward(attention), side_stream=torch.cuda.Stream(device),
                          pool=None, device=device, capture_error_mode="thread_local").graph


# --------------------------------------------------------------------------- processes

def check_group(shard: Shard, group, device: torch.device) -> None:
    """Raise ValueError unless ``group`` is the TP group of ``shard`` on a usable ``device``: its
    size is ``shard.tp`` and this process's rank in it is ``shard.rank``; NCCL: ``device`` is
    this process's current CUDA device and no two ranks share a GPU; other backends (gloo): CPU.
    Collective (one all_gather_object)."""
    world, rank = dist.get_world_size(group), dist.get_rank(group)
    if world != shard.tp:
        raise ValueError(f"TPModel: the process group has {world} rank(s) but the shard is for "
                         f"tp={shard.tp}: launch tp processes (torchrun --nproc-per-node {shard.tp})")
    if rank != shard.rank:
        raise ValueError(f"TPModel: this process is rank {rank} of the group but holds the shard of "
                         f"rank {shard.rank}")
    backend = str(dist.get_backend(group))
    if backend == "nccl":
        if device.type != "cuda":
            raise ValueError(f"TPModel: rank {rank}'s weights are on {device}; the NCCL backend "
                             "all-reduces CUDA tensors")
        current = torch.cuda.current_device()
        if device.index != current:
            raise ValueError(f"TPModel: rank {rank}'s weights are on {device} but its current CUDA "
                             f"device is cuda:{current}: torch.cuda.set_device({device.index}) first "
                             "(init_distributed does)")
    elif device.type != "cpu":
        raise ValueError(f"TPModel: rank {rank}'s weights are on {device}; the {backend} backend is "
                         "used here on the CPU (NCCL for CUDA tensors)")
    where = [None] * world
    dist.all_gather_object(where, (socket.gethostname(), str(device)), group=group)
    if device.type == "cuda":
        seen = {}
        for r, key in enumerate(where):
            if key in seen:
                raise ValueError(f"TPModel: ranks {seen[key]} and {r} both hold their shard on "
                                 f"{key[1]} of {key[0]}: each rank needs its own GPU (LOCAL_RANK)")
            seen[key] = r


def init_distributed(timeout_s: float = 600.0) -> tuple[int, int, torch.device]:
    """Join the process group that ``torchrun`` (or :func:`spawn_ranks`) describes in the
    environment (RANK, WORLD_SIZE, LOCAL_RANK, MASTER_ADDR, MASTER_PORT): NCCL on GPU
    ``cuda:LOCAL_RANK`` (made the current device; the communicator is created at once) when
    CUDA is available, else gloo on the CPU. Returns ``(rank, world_size, device)``."""
    import datetime

    missing = [k for k in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT")
               if k not in os.environ]
    if missing:
        raise RuntimeError(f"init_distributed: {', '.join(missing)} not set: launch with torchrun "
                           "--nproc-per-node N (or python3 -m torch.distributed.run)")
    rank, world, local = (int(os.environ[k]) for k in ("RANK", "WORLD_SIZE", "LOCAL_RANK"))
    timeout = datetime.timedelta(seconds=timeout_s)
    if torch.cuda.is_available():
        n = torch.cuda.device_count()
        if local >= n:
            raise RuntimeError(f"init_distributed: LOCAL_RANK={local} but this machine has {n} "
                               f"GPU(s): launch at most {n} processes per node")
        device = torch.device("cuda", local)
        torch.cuda.set_device(device)
        dist.init_process_group("nccl", rank=rank, world_size=world, timeout=timeout, device_id=device)
    else:
        device = torch.device("cpu")
        dist.init_process_group("gloo", rank=rank, world_size=world, timeout=timeout)
    return rank, world, device


def free_port() -> int:
    """A TCP port on 127.0.0.1 that was free a moment ago (MASTER_PORT of a local launch)."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _rank_main(rank: int, nprocs: int, port: int, fn, args) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank),
                      LOCAL_RANK=str(rank), WORLD_SIZE=str(nprocs))
    fn(*args)


def spawn_ranks(fn, nprocs: int, *args) -> None:
    """Run ``fn(*args)`` in ``nprocs`` fresh processes (``torch.multiprocessing.spawn``) on this
    machine, each with the environment of one torchrun rank (RANK = LOCAL_RANK = its index,
    WORLD_SIZE, MASTER_ADDR 127.0.0.1, a free MASTER_PORT): ``fn`` calls
    :func:`init_distributed`. ``fn`` must be importable (a module-level function). Raises
    ``torch.multiprocessing.ProcessRaisedException`` (with the rank's traceback) if a rank fails."""
    import torch.multiprocessing as mp

    mp.spawn(_rank_main, args=(nprocs, free_port(), fn, args), nprocs=nprocs, join=True)


# --------------------------------------------------------------------------- checks

def gather(t: torch.Tensor, group) -> list[torch.Tensor]:
    """Every rank's ``t`` (same shape on every rank), in rank order; ``[t]`` without a group."""
    if group is None:
        return [t]
    out = [torch.empty_like(t) for _ in range(dist.get_world_size(group))]
    dist.all_gather(out, t.contiguous(), group=group)
    return out


@attrs.frozen(eq=False)
class OneGpuCheck:
    """The TP step against the one-GPU step (rank 0's; tensors on the CPU): logits
    [steps, B, vocab] of rank 0, layer 0's attention [steps, B, H_q, D] gathered over the ranks'
    heads, the same of the one-GPU model, ``ranks_agree`` (every rank's logits identical) and
    ``fields`` (``pkvrt.measure.model_results.agreement``: ``logits_rel_err``, ``attn0_rel_err``,
    ``logits_ok``, ...)."""

    logits: torch.Tensor
    attn0: torch.Tensor
    ref_logits: torch.Tensor
    ref_attn0: torch.Tensor
    ranks_agree: bool
    fields: dict


def check_against_one_gpu(model: TPModel, *, engine: str, batch: int, context: int, steps: int,
                          weight_seed: int, cache_seed: int, pool_seed: int = 0, token_seed: int = 2,
                          use_graph: bool | None = None, **backend_kwargs) -> OneGpuCheck | None:
    """Run ``steps`` steps of the TP model (every rank) and of the one-GPU model (rank 0, the
    full weights and caches drawn from the same seeds on its device) from the same state, fed
    the same tokens, with attention engine ``engine`` on both, and compare them on rank 0 within
    ``pkvrt.measure.model_results``' tolerances of the dtype. Collective over ``model.group``; rank 0
    briefly holds the full model beside its shard. Each pass is captured in one CUDA graph
    (``use_graph`` None: on CUDA unless ``engine`` is the eager ``reference``).

    Returns the :class:`OneGpuCheck` on rank 0, None on the other ranks."""
    from pkvrt.measure.model_attention import make_backend
    from pkvrt.measure.model_results import agreement

    full, device, group = model.full, model.device, model.group
    rank = model.shard.rank
    if group is None and model.shard.tp > 1:
        raise ValueError("check_against_one_gpu: a shard without a process group has no other ranks "
                         "to compare with")
    if use_graph is None:
        use_graph = device.type == "cuda" and engine != "reference"
    max_steps = steps + 1   # + the capture's warm-up step
    pages = pages_needed(batch, context, max_steps, full.page_size)
    tokens = torch.randint(full.vocab, (steps, batch),
                           generator=torch.Generator().manual_seed(token_seed)).to(device)

    def one_pass(m, caches):
        loop = DecodeLoop(m, caches, batch=batch, context=context, max_steps=max_steps, seed=pool_seed)
        backend = make_backend(engine, m.cfg, loop, **backend_kwargs)
        graph = capture_step(loop, backend) if use_graph else None
        out = run_steps(loop, backend, tokens, graph)
        if hasattr(backend, "check"):
            backend.check()   # pkvrt: the planning kernel flagged no row
        return out

    logits, attn0 = one_pass(model, make_shard_caches(full, model.shard, pages, device=device,
                                                      seed=cache_seed))
    all_logits, all_attn0 = gather(logits, group), gather(attn0, group)
    if device.type == "cuda":
        torch.cuda.empty_cache()
    result = None
    if rank == 0:
        one = Model(full, make_weights(full, device=device, seed=weight_seed))
        ref_logits, ref_attn0 = one_pass(one, make_caches(full, pages, device=device, seed=cache_seed))
        attn0_full = torch.cat(all_attn0, dim=2)                     # heads in rank order
        agree = all(torch.equal(x, all_logits[0]) for x in all_logits)
        result = OneGpuCheck(logits=logits.cpu(), attn0=attn0_full.cpu(), ref_logits=ref_logits.cpu(),
                             ref_attn0=ref_attn0.cpu(), ranks_agree=agree,
                             fields=agreement(logits, attn0_full, ref_logits, ref_attn0, dtype=full.dtype))
        del one
        if device.type == "cuda":
            torch.cuda.empty_cache()
    if group is not None:
        dist.barrier(group=group)   # the other ranks wait for rank 0's one-GPU pass
    return result
