"""The route of a step when FlashInfer is unavailable: the fastest predicted PersistentKV route.

A Runtime without FlashInfer (not installed, ``flashinfer=False``, an FP8 KV cache) still follows
routes.toml: a step the policy sends to FlashInfer runs on the PersistentKV route predicted
fastest, and ``explain()`` says so. Pure policy (numpy, no GPU).
"""

from __future__ import annotations

import attrs
import numpy as np

from pkvrt.policy.planner import check_seq_lens
from pkvrt.policy.router import RouteDecision, Router


def pkv_route_us(router: Router, route, seq: np.ndarray) -> float:
    """The router's predicted T of a PersistentKV ``route`` for ``seq`` (closed-form counters;
    the calibration's measured time model, else the roofline: ``Router.predict``)."""
    return router.predict(route, check_seq_lens(seq))


def decide(router: Router, seq, block_tables, *, force: str | None = None,
           flashinfer_unavailable: str | None = None, fallback_memo: dict | None = None,
           lens: list | None = None, layers: int = 1) -> RouteDecision:
    """``router.decide``, except that when FlashInfer is unavailable (the reason given) a step
    the policy sends to FlashInfer runs on the fastest predicted PersistentKV route instead
    (non-ablation routes first), and ``explain()`` says so in the FlashInfer line.

    ``fallback_memo``: a dict that remembers that fallback route per router memo key (as the
    router remembers its decisions; bounded by ``router.memo_size``), so a step of a known key
    predicts nothing (an FP8 Runtime, which never uses FlashInfer, took 280 us per short B8
    step on the dev box predicting the PersistentKV routes every step).

    ``lens``, ``layers``: as ``Router.decide``'s (``seq`` checked int64, ``lens`` its Python
    ints; ``layers`` run() calls per plan).

    Raises ValueError when ``force`` names the FlashInfer route and it is unavailable.
    """
    if flashinfer_unavailable is None:
        return router.decide(seq, force=force, block_tables=block_tables, lens=lens, layers=layers)
    reg = router.registry
    if force is not None and force == reg.baseline.name:
        raise ValueError(f"force={force!r}: the FlashInfer route is unavailable here "
                         f"({flashinfer_unavailable}); force a PersistentKV route instead")
    d = router.decide(seq, force=force, block_tables=block_tables, lens=lens, layers=layers)
    if d.kind != "flashinfer":
        return d
    base = reg.baseline.name
    pkv = [r for r in reg.routes if r.kind != "flashinfer" and router.kv_dtype in r.kv_dtypes]
    pool = [r for r in pkv if not r.ablation] or pkv
    if not pool:
        raise ValueError(f"{reg.path}: no PersistentKV route serves KV dtype {router.kv_dtype}, and "
                         f"the FlashInfer route is unavailable ({flashinfer_unavailable}): no route "
                         "can run")
    seq64 = np.asarray(seq, dtype=np.int64)
    if router.window_left >= 0:   # the window is the rows' work (as Router.decide predicts it)
        seq64 = np.minimum(seq64, router.window_left + 1)

    def t_us(r) -> float:
        t = d.predicted_us.get(r.name)
        return pkv_route_us(router, r, seq64) if t is None else t

    key = router.memo_key(seq64, force, layers) if fallback_memo is not None else None
    best = fallback_memo.get(key) if key is not None else None
    if best is None:
        best = min(pool, key=t_us)
        if key is not None:
            if len(fallback_memo) >= router.memo_size:
                del fallback_memo[next(iter(fallback_memo))]
            fallback_memo[key] = best
    forced = router.decide(seq, force=best.name, block_tables=block_tables, lens=lens, layers=layers)
    refused = dict(forced.refused)
    refused[base] = (f"FlashInfer unavailable ({flashinfer_unavailable}); the policy chose it, so the "
                     f"runtime ran {best.name}, the fastest predicted PersistentKV route")
    return attrs.evolve(forced, refused=refused, forced=d.forced)
