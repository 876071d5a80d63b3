#!/usr/bin/env bash
# Serving evidence of issue 6 in one device call: held-out seeds, the baseline, the adaptive
# policy and device-side planning; OUT/results.tgz is rewritten after every trace, so a call that
# runs out of time still returns what finished.
# usage: bash benches/h200_serving.sh OUT [core|extra|all] [ENGINES] [TRACE_DIR]
#   core   Table 2 traces (seed protocol, one layer, 5 held-out seeds; B4 and G = 1 / 8: 3)
#   extra  the mixed fixture, Azure traces (TRACE_DIR), engine protocol (32 layers, 3 seeds)
#   all    both
set -u
out=$1; set_=${2:-core}; engines=${3:-flashinfer,adaptive,device-plan}; traces=${4:-../shared/traces}
r=$out/r; mkdir -p $r
export PYTHONUNBUFFERED=1
serve() {  # name max_active limit_s seeds extra-args...
  local name=$1 b=$2 limit=$3 seeds=$4; shift 4
  echo "== $name B$b seeds $seeds ($(date +%T))"
  timeout $limit python3 -m pkvrt bench serving --max-active $b --steps-limit 16 --check-steps 2 \
    --engines $engines --seeds $seeds "$@" --out $r/serving-$name-B$b.json > $r/serving-$name-B$b.log 2>&1
  echo "   rc=$?"; grep -E "tok/s|Error|error" $r/serving-$name-B$b.log | tail -8
  tar czf $out/results.tgz -C $r .
}
if [ "$set_" = core ] || [ "$set_" = all ]; then
serve bucketed 1 120 20260623-20260627 --trace bucketed
serve bimodal 8 120 20260623-20260627 --trace bimodal
serve uniform 8 90 20260623-20260627 --trace uniform
serve zipf 8 90 20260623-20260627 --trace zipf
serve bimodal 4 80 20260623-20260625 --trace bimodal
serve gqa-G1 8 60 20260623-20260625 --trace bimodal --num-kv-heads 32
serve gqa-G8 8 60 20260623-20260625 --trace bimodal --num-kv-heads 4
fi
if [ "$set_" = extra ] || [ "$set_" = all ]; then
serve mixed 8 45 20260623 --trace mixed
serve azure-code 8 60 20260623 --trace $traces/azure2023_code.csv --steps-limit 32
serve azure-conv 8 60 20260623 --trace $traces/azure2023_conv.csv --steps-limit 32
serve engine-bimodal-L32 8 90 20260623-20260625 --trace bimodal --engine-layers 32
serve engine-bimodal-L32-mlp 8 90 20260623-20260625 --trace bimodal --engine-layers 32 --mlp
serve engine-bucketed-L32 1 90 20260623-20260625 --trace bucketed --engine-layers 32
fi
