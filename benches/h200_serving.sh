#!/usr/bin/env bash
# Serving evidence of issue 6 in one device call: held-out seeds, the baseline, the adaptive
# policy and device-side planning; OUT/results.tgz is rewritten after every trace, so a call that
# runs out of time still returns what finished.
# usage: bash benches/h200_serving.sh OUT [ENGINES]
set -u
out=$1; engines=${2:-flashinfer,adaptive,device-plan}; r=$out/r; mkdir -p $r
export PYTHONUNBUFFERED=1
serve() {  # name max_active limit_s seeds extra-args...
  local name=$1 b=$2 limit=$3 seeds=$4; shift 4
  echo "== $name B$b seeds $seeds ($(date +%T))"
  timeout $limit python3 -m pkvrt bench serving --max-active $b --steps-limit 16 --check-steps 2 \
    --engines $engines --seeds $seeds "$@" --out $r/serving-$name-B$b.json > $r/serving-$name-B$b.log 2>&1
  echo "   rc=$?"; grep -E "tok/s|Error|error" $r/serving-$name-B$b.log | tail -8
  tar czf $out/results.tgz -C $r .
}
serve bucketed 1 120 20260623-20260627 --trace bucketed
serve bimodal 8 120 20260623-20260627 --trace bimodal
serve zipf 8 70 20260623-20260624 --trace zipf
serve bimodal 4 80 20260623-20260625 --trace bimodal
serve gqa-G1 8 45 20260623 --trace bimodal --num-kv-heads 32
serve uniform 8 55 20260623 --trace uniform
serve gqa-G8 8 45 20260623 --trace bimodal --num-kv-heads 4
