#!/usr/bin/env bash
# Build and time tuning variants of the decode kernels in one device call (benches/NOTES.md).
# usage: bash benches/variants.sh OUTDIR CASES SPLITS TUNE [TUNE ...]
#   TUNE: a PKVRT_TUNE string such as PKV_TC_STAGES=4 ("default" for none)
#   ISOLATED_ARGS: extra arguments for benches/isolated.py (default: --wq-splits 16)
# Prints one line per (variant, case, engine, splits) at the end.
set -u
out=$1; cases=$2; splits=$3; shift 3
for v in "$@"; do
  tag=$(echo "$v" | tr -c 'A-Za-z0-9\n' '_'); d=/tmp/cubins_$tag
  [ "$v" = default ] && tune="" || tune=$v
  PKVRT_CUDA_ARCHS=sm_90 PKVRT_TUNE="$tune" python3 -m pkvrt._build $d >/dev/null || { echo "build $v failed"; continue; }
  echo "== variant $v"
  PKVRT_CUBIN_DIR=$d python3 benches/isolated.py --cases $cases --splits $splits ${ISOLATED_ARGS:---wq-splits 16} \
    --no-sdpa --out $out/variant_$tag.json 2>&1 | grep -E "FAIL|Error|error" | head -5
done
python3 - "$out" <<'PY'
import json, sys, pathlib
for f in sorted(pathlib.Path(sys.argv[1]).glob("variant_*.json")):
    for r in json.loads(f.read_text())["rows"]:
        if "median_us" in r:
            print(f"{f.stem[8:]:24s} {r['case']:10s} {r['engine']:22s} {str(r['splits']):>4s} "
                  f"{r['median_us']:8.2f} us  maxerr {r['max_err_ref']:.1e}")
PY
