#!/usr/bin/env bash
# Build and time tuning variants of the decode kernels in one device call (benches/NOTES.md).
# usage: bash benches/variants.sh OUTDIR CASES SPLITS TUNE [TUNE ...]
#   TUNE: a PKVRT_TUNE string such as PKV_L2_PREFETCH=128 ("default" for none)
set -u
out=$1; cases=$2; splits=$3; shift 3
for v in "$@"; do
  tag=$(echo "$v" | tr -c 'A-Za-z0-9\n' '_'); d=/tmp/cubins_$tag
  [ "$v" = default ] && tune="" || tune=$v
  PKVRT_CUDA_ARCHS=sm_90 PKVRT_TUNE="$tune" python3 -m pkvrt._build $d >/dev/null || { echo "build $v failed"; continue; }
  echo "== variant $v"
  PKVRT_CUBIN_DIR=$d python3 benches/isolated.py --cases $cases --splits $splits --wq-splits 16 --no-sdpa \
    --out $out/variant_$tag.json 2>&1 | grep -E "^B|^G|FAIL"
done
