#!/usr/bin/env bash
# The 32-layer engine protocol (issue 12) in one device call: every trace family at its batch,
# FlashInfer's fastest decode path (by device time) against device planning run both ways (a
# graph replay per layer; the whole step captured as one graph; and, as the ablation, the step
# graph on pkv_workqueue: decode + a merge launch instead of the merge in the decode tail).
# ENGINES overrides the list; TRACES="bucketed-B1 zipf-B8 ..." runs only those of the set (to split
# the set over two device calls). Results are written under
# /tmp/engine-r and OUT/engine.tgz is rewritten after every trace (one file: the device tool
# returns at most 8), so a call that runs out of time still returns what finished.
# usage: bash benches/h200_engine.sh OUT [quick|all] [TRACE_DIR]
#   quick  one held-out seed of bimodal B8, bucketed B1 and the Azure conversation trace
#   all    every family of issue 12 (held-out seeds 20260623-27; 3 for B4, G = 1 / 8, the Azure
#          traces and bimodal B8 with the MLP tail)
set -u
out=$1; set_=${2:-quick}; traces=${3:-../shared/traces}
r=/tmp/engine-r; mkdir -p $r
export PYTHONUNBUFFERED=1
engines=${ENGINES:-flashinfer,device-plan,device-plan-step,device-plan-step:pkv_workqueue}
serve() {  # name max_active limit_s seeds extra-args...
  local name=$1 b=$2 limit=$3 seeds=$4; shift 4
  if [ -n "${TRACES:-}" ] && [[ " $TRACES " != *" $name-B$b "* ]]; then return; fi
  echo "== $name B$b seeds $seeds ($(date +%T))"
  timeout $limit python3 -m pkvrt bench serving --max-active $b --steps-limit 16 --check-steps 2 \
    --engine-layers 32 --engines $engines --seeds $seeds "$@" \
    --out $r/engine-$name-B$b.json > $r/engine-$name-B$b.log 2>&1
  echo "   rc=$?"; grep -E "pkvrt-|flashinfer-|Error|error" $r/engine-$name-B$b.log | grep -v "^  baseline" | tail -9
  tar czf $out/engine.tgz -C $r .
}
if [ "$set_" = quick ]; then
serve bimodal 8 150 20260623 --trace bimodal
serve bucketed 1 120 20260623 --trace bucketed
serve azure-conv 8 120 20260623 --trace $traces/azure2023_conv.csv --steps-limit 32
else
serve bucketed 1 150 20260623-20260627 --trace bucketed
serve bimodal 4 120 20260623-20260625 --trace bimodal
serve bimodal 8 150 20260623-20260627 --trace bimodal
serve bimodal-mlp 8 120 20260623-20260625 --trace bimodal --mlp
serve uniform 8 150 20260623-20260627 --trace uniform
serve zipf 8 150 20260623-20260627 --trace zipf
serve gqa-G8 8 100 20260623-20260625 --trace bimodal --num-kv-heads 4
serve gqa-G1 8 100 20260623-20260625 --trace bimodal --num-kv-heads 32
serve azure-conv 8 120 20260623-20260625 --trace $traces/azure2023_conv.csv --steps-limit 32
serve azure-code 8 120 20260623-20260625 --trace $traces/azure2023_code.csv --steps-limit 32
fi
