"""Nsight Compute CSV (``--csv --page raw``, benches/ncu_table5.sh) -> a pkvrt results file.

One row per profiled kernel: name, duration, DRAM throughput (% of peak) and bytes read, L2 hit
rate, achieved occupancy (active warps, % of peak), SM throughput, grid and registers.

usage: python benches/ncu_table5.py NCU_CSV --out ncu-b8-bimodal.json [--case b8-bimodal]
"""

from __future__ import annotations

import argparse
import csv
import sys
from pathlib import Path

COLUMNS = {  # ncu metric -> results key (durations converted to us, bytes to MB)
    "gpu__time_duration.sum": "duration_us",
    "dram__throughput.avg.pct_of_peak_sustained_elapsed": "dram_pct_of_peak",
    "dram__bytes_read.sum": "dram_read_mb",
    "lts__t_sector_hit_rate.pct": "l2_hit_pct",
    "sm__warps_active.avg.pct_of_peak_sustained_active": "achieved_occupancy_pct",
    "sm__throughput.avg.pct_of_peak_sustained_elapsed": "sm_pct_of_peak",
    "launch__grid_size": "grid",
    "launch__registers_per_thread": "registers",
}
TIME_TO_US = {"nsecond": 1e-3, "usecond": 1.0, "msecond": 1e3, "second": 1e6}
BYTES_TO_MB = {"byte": 1e-6, "Kbyte": 1e-3, "Mbyte": 1.0, "Gbyte": 1e3}


def parse(path: Path) -> list[dict]:
    """The kernel rows of an ncu raw CSV (header row, units row, then one row per kernel)."""
    lines = [ln for ln in path.read_text().splitlines() if ln.startswith('"')]
    if len(lines) < 3:
        raise ValueError(f"{path}: expected an ncu --csv --page raw report (header, units, rows); "
                         f"found {len(lines)} CSV lines")
    header, units, *rows = list(csv.reader(lines))
    unit = dict(zip(header, units))
    out = []
    for r in rows:
        rec = dict(zip(header, r))
        row = {"kernel": rec.get("Kernel Name", "?")}
        for metric, key in COLUMNS.items():
            raw = rec.get(metric, "").replace(",", "")
            if not raw:
                continue
            v = float(raw)
            if key == "duration_us":
                v *= TIME_TO_US.get(unit.get(metric, "nsecond"), 1e-3)
            elif key == "dram_read_mb":
                v *= BYTES_TO_MB.get(unit.get(metric, "byte"), 1e-6)
            row[key] = round(v, 3)
        out.append(row)
    return out


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("csv", type=Path)
    ap.add_argument("--out", type=Path, required=True)
    ap.add_argument("--case", default="b8-bimodal", help="the profiled batch (benches/ncu_table5.sh CASE)")
    args = ap.parse_args(argv)
    from pkvrt.measure import results
    from pkvrt.tools import report

    rows = parse(args.csv)
    engine = None
    for r in rows:  # label each kernel with its engine, as pkvrt report does for older files
        r["case"] = args.case
        r["engine"] = engine = report.ncu_engine(r["kernel"], engine)
    meta = results.make_meta(seeds=[20260623], kind="ncu", case=args.case,
                             protocol="ncu --clock-control none, one launch per kernel after warm-up "
                                      "(benches/ncu_workload.py)")
    results.write_results(args.out, meta, rows)
    for r in rows:
        print(f"{r['kernel'][:48]:48s} {r.get('duration_us', 0):9.1f} us  DRAM {r.get('dram_pct_of_peak', 0):5.1f} %"
              f"  L2 hit {r.get('l2_hit_pct', 0):5.1f} %  occ {r.get('achieved_occupancy_pct', 0):5.1f} %")
    return 0


if __name__ == "__main__":
    sys.exit(main())
