"""Session 24 (CPU): does the time model's fit carry over from one calibration run to another,
and does the planned cut's weight (sweeps.PLANNED_WEIGHT) change that? Fits the time model on one
run's sweeps (the shipped file's partition constants kept, as `cost_model_error.py
--keep-partition`) and reports the worst |error| at the planned cut on the same run (in-sample) and
on the other run (the same steps timed again: out-of-run), per G and route kind.
usage: python cross_run_fit.py A.json B.json [--weights 1,3,10,30,100]"""
import argparse
import json
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[5]
sys.path.insert(0, str(REPO))

from pkvrt.policy import calibration as calib  # noqa: E402
from pkvrt.policy.registry import load_routes  # noqa: E402
from pkvrt.tools import sweeps  # noqa: E402


def timed_of(path):
    doc = json.loads(Path(path).read_text())
    meta = doc["meta"]
    return sweeps.read_rows(doc["rows"], (meta.get("seeds") or [20260622])[0], meta.get("kv_dtype", "float16"))


def worst(rows):
    out = {}
    for r in rows:
        if r.error is not None:
            k = (r.group, r.kind)
            out[k] = max(out.get(k, 0.0), abs(r.error))
    return out


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("a")
    ap.add_argument("b")
    ap.add_argument("--weights", default="1,3,10,30,100")
    args = ap.parse_args()
    cal = calib.load_calibration(REPO / "calibration" / "nvidia-h200.json")
    reg = load_routes(REPO / "routes.toml")
    runs = {"A": timed_of(args.a), "B": timed_of(args.b)}
    print(f"A = {args.a}\nB = {args.b}")
    results = {}
    for w in [float(x) for x in args.weights.split(",")]:
        sweeps.PLANNED_WEIGHT = w
        for fit_on, other in (("A", "B"), ("B", "A")):
            fits = sweeps.fit_time_model(runs[fit_on], cal, reg)
            ins = worst(sweeps.error_rows(runs[fit_on], cal, reg, fits))
            out = worst(sweeps.error_rows(runs[other], cal, reg, fits))
            results[(w, fit_on)] = (ins, out)
    keys = sorted({k for ins, out in results.values() for k in out})
    print("worst |error| at the planned cut, % (in-sample / on the other run), per fit")
    print(f"{'weight':>6} {'fit on':>6}  " + "  ".join(f"G{g} {kind[:9]:>9}" for g, kind in keys)
          + "   max out-of-run")
    for (w, fit_on), (ins, out) in results.items():
        cells = "  ".join(f"{100 * ins.get(k, 0):4.1f}/{100 * out.get(k, 0):4.1f}" for k in keys)
        print(f"{w:6g} {fit_on:>6}  {cells}   {100 * max(out.values()):.1f}")


if __name__ == "__main__":
    main()
