# Session 24 (CPU): the engine-table files record FlashInfer steps whose host enqueue outran their
# spin in the one measured device pass (device_uncovered_steps: 3 of 96 on each Azure trace, 9 of
# 80 on bucketed B1). Could host gaps have inflated the baseline there? Per step, FlashInfer's device
# time over pkvrt's (device-plan-step); steps beyond median + 5 MAD listed; the overall ratio with
# those steps' FlashInfer time capped at median + 5 MAD. Run from the repo root.
import json

import numpy as np

for name in ["azure-code-B8", "azure-conv-B8", "bucketed-B1"]:
    d = json.load(open(f"benches/results/h200/engine-{name}.steps.json"))
    by = {}
    for r in d["rows"]:
        by.setdefault((r["seed"], r["step"]), {})[r["engine"]] = r
    recs = []
    for k, e in sorted(by.items()):
        fi = next((v for v in e.values() if v.get("baseline")), None)
        pk = e.get("pkvrt-device-plan-step")
        if fi and pk:
            recs.append((k, fi["cuda_us"], pk["cuda_us"], fi["active"], fi["max_context"]))
    rat = np.array([a / b for _, a, b, *_ in recs])
    med, mad = np.median(rat), np.median(abs(rat - np.median(rat)))
    fi_tot, pk_tot = sum(r[1] for r in recs), sum(r[2] for r in recs)
    capped = sum(min(r[1], (med + 5 * mad) * r[2]) for r in recs)
    print(f"{name}: overall {fi_tot / pk_tot:.4f}, outliers capped {capped / pk_tot:.4f}")
    for (k, a, b, act, mc), x in zip(recs, rat):
        if x > med + 5 * mad:
            print(f"   seed {k[0]} step {k[1]}: FlashInfer {a:.1f} us, pkvrt {b:.1f} us, {x:.3f}, B {act}, longest {mc}")
