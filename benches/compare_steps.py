"""Per-step comparison of two engine-protocol runs of the same trace and seeds (CPU only).

Reads two ``.steps.json`` files written by ``pkvrt bench serving`` (e.g. before and after a
calibration or kernel change, each with its own FlashInfer baseline run in the same process) and,
per pkvrt engine present in both, splits the steps into those whose planned cut (``split_max``)
moved and those whose cut did not. For each group it prints the summed device time before and
after, and the median per-step change with FlashInfer's own change divided out (its time in each
run is the same kernel on the same step, so its drift between runs is the runs', not pkvrt's).
It also prints each engine's per-step ratio against the baseline, 5th percentile and minimum.
With ``--moved N`` it lists up to N moved steps.

usage: python benches/compare_steps.py BEFORE.steps.json AFTER.steps.json [--moved N]
e.g.   python benches/compare_steps.py benches/results/h200/fp8-refit/engine-bimodal-B8-fp8-previous.steps.json \
           benches/results/h200/fp8-refit/engine-bimodal-B8-fp8-shipped.steps.json --moved 8
"""

from __future__ import annotations

import argparse
import json
import lzma
import sys
from pathlib import Path

import numpy as np


def load_steps(path) -> dict:
    """{engine: {(seed, step): row}} of a ``.steps.json`` (or ``.steps.json.xz``) file, and the
    baseline's rows under the key ``"baseline"``."""
    path = Path(path)
    raw = lzma.decompress(path.read_bytes()) if path.suffix == ".xz" else path.read_bytes()
    out: dict = {}
    for r in json.loads(raw)["rows"]:
        key = (r["seed"], r["step"])
        out.setdefault(r["engine"], {})[key] = r
        if r.get("baseline"):
            out.setdefault("baseline", {})[key] = r
    if "baseline" not in out:
        raise ValueError(f"{path}: no baseline rows (expected a pkvrt bench serving .steps.json)")
    return out


def compare(before: dict, after: dict) -> list[dict]:
    """Per pkvrt engine in both runs and per group ("moved" / "same" cut): steps, summed device
    µs before and after, and the median per-step after/before ratio over the baseline's."""
    out = []
    for engine in sorted(set(before) & set(after)):
        if not engine.startswith("pkvrt"):
            continue
        groups: dict = {"moved": [], "same": []}
        for key in sorted(set(before[engine]) & set(after[engine])
                          & set(before["baseline"]) & set(after["baseline"])):
            b, a = before[engine][key], after[engine][key]
            drift = after["baseline"][key]["cuda_us"] / before["baseline"][key]["cuda_us"]
            group = "moved" if b["split_max"] != a["split_max"] else "same"
            groups[group].append((key, b, a, a["cuda_us"] / b["cuda_us"] / drift))
        for group, rows in groups.items():
            if rows:
                out.append({"engine": engine, "group": group, "steps": len(rows),
                            "before_us": sum(r[1]["cuda_us"] for r in rows),
                            "after_us": sum(r[2]["cuda_us"] for r in rows),
                            "normalised_median": float(np.median([r[3] for r in rows])),
                            "rows": rows})
    return out


def step_ratios(run: dict) -> dict:
    """{engine: (p5, min)} of the per-step baseline / engine device-time ratio."""
    out = {}
    for engine, rows in run.items():
        if engine.startswith("pkvrt"):
            r = [run["baseline"][k]["cuda_us"] / v["cuda_us"] for k, v in rows.items() if k in run["baseline"]]
            out[engine] = (float(np.percentile(r, 5)), min(r))
    return out


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("before")
    ap.add_argument("after")
    ap.add_argument("--moved", type=int, default=0, metavar="N", help="list up to N steps whose cut moved")
    args = ap.parse_args(argv)
    try:
        before, after = load_steps(args.before), load_steps(args.after)
    except (OSError, ValueError, KeyError, lzma.LZMAError) as e:
        print(f"compare_steps.py: {e}", file=sys.stderr)
        return 2
    print("engine                               cut    steps  before us   after us  after/before  "
          "median per step, baseline's drift divided out")
    for c in compare(before, after):
        print(f"{c['engine']:36s} {c['group']:6s} {c['steps']:5d} {c['before_us']:10.0f} {c['after_us']:10.0f} "
              f"{c['after_us'] / c['before_us']:12.4f}  {c['normalised_median']:.3f}")
        if c["group"] == "moved":
            for key, b, a, n in c["rows"][:args.moved]:
                print(f"    seed {key[0]} step {key[1]}: {b['active']} rows, longest {b['max_context']}, "
                      f"cut {b['split_max']} -> {a['split_max']}, {b['cuda_us']:.0f} -> {a['cuda_us']:.0f} us "
                      f"({n:.3f} with the baseline's drift divided out)")
    for name, run in (("before", before), ("after", after)):
        print(f"{name}: per-step ratio vs the baseline, p5 / min: " + "; ".join(
            f"{e} {p5:.3f} / {m:.3f}" for e, (p5, m) in sorted(step_ratios(run).items())))
    return 0


if __name__ == "__main__":
    sys.exit(main())
