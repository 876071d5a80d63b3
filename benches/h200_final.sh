#!/usr/bin/env bash
# The serving evidence run (issue 6), one device call; everything lands in OUT/results.tgz.
# usage: bash benches/h200_final.sh OUT TRACE_DIR
set -u
out=$1; traces=$2; r=$out/r; mkdir -p $r
export PYTHONUNBUFFERED=1
serve() {  # name max_active extra-args...
  local name=$1 b=$2; shift 2
  echo "== $name B$b ($(date +%T))"
  timeout 55 python3 -m pkvrt bench serving --max-active $b --steps-limit 30 --check-steps 2 \
    --engines flashinfer,adaptive "$@" --out $r/serving-$name-B$b.json 2>&1 | grep -E "ratio|/ flashinfer|error|Error" | tail -4
  tar czf $out/results.tgz -C $r .
}
serve bucketed 1 --trace bucketed
serve bimodal 8 --trace bimodal
serve zipf 8 --trace zipf
serve bimodal 4 --trace bimodal
serve mixed 8 --trace mixed
serve azure-code 8 --trace $traces/azure2023_code.csv --seeds 20260623 --steps-limit 60
serve azure-conv 8 --trace $traces/azure2023_conv.csv --seeds 20260623 --steps-limit 60
serve gqa-G1 8 --trace bimodal --seeds 20260623 --num-kv-heads 32
serve gqa-G8 8 --trace bimodal --seeds 20260623 --num-kv-heads 4
serve uniform 8 --trace uniform
