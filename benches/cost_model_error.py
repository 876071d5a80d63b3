"""Cost-model error per route on a calibrate-sweeps file (CPU only).

Reads the rows ``pkvrt calibrate --raw`` wrote, fits what ``pkvrt calibrate`` fits from them (the
balanced partition's constants per G, then the measured time model per G and route kind:
pkvrt.tools.sweeps), and prints the constants, measured vs predicted µs of every route on every
calibration step at the cut its planner picks (beside the roofline's prediction), the worst error
per route and G, and the routes.toml gates the steps measured (a suggestion, never applied).

beta, SMs, resident CTAs per SM and max_waves come from ``--calibration`` (default: the
calibration file of the sweeps' GPU). ``--keep-partition`` keeps that file's partition
constants instead of refitting them; ``--file-constants`` evaluates that file's own time model
(a file ``pkvrt calibrate`` wrote) instead of fitting one. ``--write PATH`` saves the calibration
with what was refitted (partition constants, time model; every measured constant kept) and a
sentence in its ``source`` saying so: how a planner-model change is carried into a calibration
file without re-timing the GPU (the sweeps time every cut, whatever rule picks among them).

The rows of the sweeps' KV dtype are read (``meta.kv_dtype``; absent: float16). Sweeps of
``pkvrt calibrate --kv-dtype fp8`` refit the file's ``by_kv_dtype.float8_e4m3fn`` section
instead (created if absent; the fp16 constants untouched), with the e4m3 kernel's occupancy the
sweeps recorded (``meta.occupancy``), and print pkvrt's routes only (no FlashInfer, no gates).

usage: python benches/cost_model_error.py SWEEPS.json [--calibration PATH] [--routes PATH]
           [--keep-partition | --file-constants] [--suggest-routes PATH] [--write PATH]
e.g.   python benches/cost_model_error.py benches/results/h200/calibrate-sweeps.json
"""

from __future__ import annotations

import argparse
import json
import re
import sys

import numpy as np
from pathlib import Path


REFIT_NOTE = re.compile(r" Refitted offline on [0-9-]+: .*?every other constant as measured"
                        r"(?:; this supersedes what the text above says of the refitted constants)?\.", re.S)


def _without_refits(provenance: str) -> str:
    """``provenance`` without the notes of earlier ``--write`` refits: used when this refit
    redoes everything they did (the partition constants and the time model), so only its own
    note is true. Text after a note is kept."""
    return REFIT_NOTE.sub("", provenance)


def main(argv=None) -> int:
    from pkvrt.policy import calibration as calib
    from pkvrt.policy.registry import load_routes
    from pkvrt.tools import sweeps
    from pkvrt.tools.calibrate import format_rows

    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("sweeps", help="a calibrate-sweeps results file (pkvrt calibrate --raw)")
    ap.add_argument("--calibration", metavar="PATH",
                    help="calibration giving beta, SMs and occupancy (default: the file of the sweeps' GPU)")
    ap.add_argument("--routes", metavar="PATH", help="routes.toml (default: the shipped one)")
    mode = ap.add_mutually_exclusive_group()
    mode.add_argument("--keep-partition", action="store_true",
                      help="keep the calibration's partition constants (default: refit them from the sweeps)")
    mode.add_argument("--file-constants", action="store_true",
                      help="evaluate the calibration's own time model instead of fitting one")
    ap.add_argument("--suggest-routes", metavar="PATH", help="also write the suggested gates to PATH")
    ap.add_argument("--write", metavar="PATH",
                    help="save the calibration with the refitted constants to PATH (not with --file-constants)")
    args = ap.parse_args(argv)
    if args.write and args.file_constants:
        ap.error("--write saves refitted constants; --file-constants fits none")

    try:
        doc = json.loads(Path(args.sweeps).read_text(encoding="utf-8"))
        meta, rows = doc["meta"], doc["rows"]
        cal = (calib.load_calibration(args.calibration) if args.calibration
               else calib.find_calibration(meta.get("gpu")))
        reg = load_routes(args.routes)
    except (OSError, ValueError, KeyError) as e:
        print(f"cost_model_error.py: {e}", file=sys.stderr)
        return 2
    seed = (meta.get("seeds") or [cal.seed])[0]
    kv = meta.get("kv_dtype", "float16")
    fp16 = kv in calib.TOP_KV_DTYPES
    if not fp16 and args.suggest_routes:
        ap.error(f"--suggest-routes: {kv} sweeps have no FlashInfer times to judge gates against")
    try:
        timed = sweeps.read_rows(rows, seed, kv)
    except ValueError as e:
        print(f"cost_model_error.py: {args.sweeps}: meta.kv_dtype: {e}", file=sys.stderr)
        return 2
    print(f"{args.sweeps}: {len(rows)} rows, {len(timed)} timed (route kind, step, G) with {kv} K/V; "
          f"GPU {meta.get('gpu')}, pkvrt {meta.get('pkvrt_commit')}; calibration {cal.source}")

    fits = None
    if args.file_constants:
        if not cal.for_kv_dtype(kv).time_model or cal.for_kv_dtype(kv).kv_dtype_fallback:
            print(f"cost_model_error.py: {cal.source} has no {'' if fp16 else kv + ' '}time_model to evaluate",
                  file=sys.stderr)
            return 2
    else:
        if not args.keep_partition:
            occupancy = {int(g): n for g, n in (meta.get("occupancy") or {}).items()}
            points, regrets = sweeps.fit_partitions(timed, cal, reg, resident=occupancy)
            cal = sweeps.with_partitions(cal, points, kv)
            print("\nbalanced partition, refitted (calibration.fit_partition on the workqueue and fused sweeps; "
                  "regret: the rule's pick over the fastest cut):")
            print("(no partition sweeps here: the calibration's constants are kept)" if not points else format_rows(
                ("G", "slowdown", "overhead tiles", "min split", "geomean regret", "worst regret", "worst case"),
                [(g, p["co_resident_slowdown"], p["cta_overhead_tiles"], p["min_split_tokens"],
                  f"{np.exp(np.mean(np.log(list(regrets[g].values())))):.4f}", f"{max(regrets[g].values()):.3f}",
                  max(regrets[g], key=regrets[g].get)) for g, p in sorted(points.items())]))
        fits = sweeps.fit_time_model(timed, cal, reg)
        print("\ntime model (sweeps.fit_time_model):")
        print(sweeps.format_time_model(fits))
    print("\nmeasured vs predicted at the cut each planner picks (roofline: the calibration's c_min "
          "and flashinfer.ctas_per_sm):")
    print(sweeps.format_errors(sweeps.error_rows(timed, cal, reg, fits)))
    gates = sweeps.suggest_gates(timed, cal, reg, header=f"{meta.get('gpu')}, {Path(args.sweeps).name}") \
        if fp16 else ""
    print("\n" + gates if gates else "")
    if args.suggest_routes:
        Path(args.suggest_routes).write_text(gates, encoding="utf-8")
        print(f"wrote {args.suggest_routes} (routes.toml is unchanged)")
    if args.write:
        import datetime

        import attrs

        model = (f"the time model (costmodel.fit_route_time: the least largest weighted error, the bucket "
                 f"route's two constants by least squares; each step's "
                 f"planned cut weighted {sweeps.PLANNED_WEIGHT:g}, its cuts within "
                 f"{100 * (sweeps.NEAR_BEST - 1):.0f} % of the fastest 1)")
        what = (model if args.keep_partition else
                "the balanced partition's constants (fit_partition over both partition routes' sweeps: "
                "of the best-scoring plateau, the point farthest from a worse one) and " + model)
        strip = (lambda text: text) if args.keep_partition else _without_refits   # keep: the partition's note stays
        note = (f" Refitted offline on {datetime.date.today().isoformat()}: {what}, by "
                f"benches/cost_model_error.py --write from {Path(args.sweeps).name} (the sweeps of "
                f"pkvrt {meta.get('pkvrt_commit')}) under this checkout's planner; every other constant "
                f"as measured; this supersedes what the text above says of the refitted constants.")
        out = sweeps.with_time_model(cal, fits, kv)
        if fp16:
            out = attrs.evolve(out, provenance=strip(out.provenance) + note)
        else:   # the section's own provenance (a new section: these sweeps' command)
            sec = dict(out.by_kv_dtype)[kv]
            out = calib.with_kv_dtype_section(out, kv, attrs.evolve(
                sec, command=sec.command or str(meta.get("command") or "pkvrt calibrate --kv-dtype fp8"),
                provenance=strip(sec.provenance or f"Fitted from the {kv} sweeps "
                                           f"{Path(args.sweeps).name}; nothing else measured with these caches.")
                + note))
        calib.save_calibration(calib.calibration_from_dict(calib.calibration_to_dict(out)), args.write)
        print(f"wrote {args.write}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
