# Session 24: results files whose seeds disagree on the FlashInfer baseline, with the probe sums (run from the repo root).
import json, glob, collections
files = sorted(glob.glob("benches/results/h200/*.json") + glob.glob("benches/results/h200/session*/*.json"))
for f in files:
    if f.endswith(".steps.json"): continue
    try: d = json.load(open(f))
    except Exception: continue
    m = d.get("meta", {}) if isinstance(d, dict) else {}
    ps = m.get("per_seed")
    if not ps: continue
    bases = {s: v.get("baseline") for s, v in ps.items()}
    if len(set(bases.values())) > 1:
        print(f)
        for s, v in ps.items():
            p = v.get("baseline_probe_device_us", {})
            print("   ", s, v.get("baseline"), {k: round(x) for k, x in p.items()})
