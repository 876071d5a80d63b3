#!/usr/bin/env bash
# The 32-layer engine protocol in one device call: every trace family at its batch,
# FlashInfer's fastest decode path (by device time) against device planning run both ways (a
# graph replay per layer; the whole step captured as one graph; and, as the ablation, the step
# graph on pkv_workqueue: decode + a merge launch instead of the merge in the decode tail).
# ENGINES overrides the list; TRACES="bucketed-B1 zipf-B8 ..." runs only those of the set (to split
# the set over two device calls). Results are written under
# /tmp/engine-r and OUT/engine.tgz is rewritten after every trace (one file: the device tool
# returns at most 8), so a call that runs out of time still returns what finished.
# usage: [KV_DTYPE=fp8 [FP8_SCALES=amax]] [CALIBRATION=FILE] [ROUTES=FILE] bash benches/h200_engine.sh OUT [quick|all] [TRACE_DIR]
#   TRACE_DIR: the folder of azure2023_conv.csv and azure2023_code.csv (docs/traces.md says how to
#   make them from the public trace); without it the Azure traces are skipped
#   ROUTES: a routes.toml instead of the shipped one (an ablation, e.g. grid = "slots")
#   CALIBRATION: a calibration JSON instead of the GPU's own (an experiment, e.g. a partition
#   proposal's constants: calibration-P.json, in git at 0a142e3)
#   quick  one held-out seed of bimodal B8, bucketed B1 and the Azure conversation trace
#   all    every trace family (held-out seeds 20260623-27; 3 for B4, G = 1 / 8, the Azure
#          traces and bimodal B8 with the MLP tail)
# KV_DTYPE=fp8: the same protocol over float8_e4m3fn K/V (`--kv-dtype fp8`, per-tensor
# scales: unit, or FP8_SCALES=amax) against FlashInfer's FP8-KV paths (XQA, tensor-core,
# CUDA-core; cuDNN has none with fp16 q and is recorded unavailable); files engine-NAME-BN-fp8.*,
# tarball OUT/engine-fp8.tgz. Time limits are 1.5x, and the first trace gets 180 s more:
# FlashInfer JIT-compiles its FP8 decode kernels on first use (about 40 s per family). The FP8
# table's case: KV_DTYPE=fp8 TRACES=bimodal-B8 bash benches/h200_engine.sh OUT all (4-6 minutes,
# 2 of them FlashInfer's JIT on a fresh machine; benches/results/h200/engine-bimodal-B8-fp8.json).
set -u
out=$1; set_=${2:-quick}; traces=${3:-}   # TRACE_DIR: the Azure CSVs (docs/traces.md); without it those traces are skipped
kv=${KV_DTYPE:-fp16}
case $kv in
  fp16) sfx=; kvargs=; jit=0 ;;
  fp8) sfx=-fp8; kvargs="--kv-dtype fp8 ${FP8_SCALES:+--fp8-scales $FP8_SCALES}"; jit=180 ;;
  *) echo "KV_DTYPE=$kv: expected fp16 or fp8" >&2; exit 2 ;;
esac
r=/tmp/engine-r$sfx; mkdir -p $r
export PYTHONUNBUFFERED=1
engines=${ENGINES:-flashinfer,device-plan,device-plan-step,device-plan-step:pkv_workqueue}
serve() {  # name max_active limit_s seeds extra-args...
  local name=$1 b=$2 limit=$3 seeds=$4; shift 4
  if [[ $name == azure-* && -z $traces ]]; then echo "== $name: skipped (no TRACE_DIR given)"; return; fi
  if [ -n "${TRACES:-}" ] && [[ " $TRACES " != *" $name-B$b "* ]]; then return; fi
  local f=engine-$name-B$b$sfx
  if [ -n "$sfx" ]; then limit=$((limit * 3 / 2 + jit)); jit=0; fi
  echo "== $name B$b seeds $seeds $kv ($(date +%T), limit ${limit}s)"
  timeout $limit python3 -m pkvrt bench serving --max-active $b --steps-limit 16 --check-steps 2 \
    --engine-layers 32 --engines $engines --seeds $seeds $kvargs ${CALIBRATION:+--calibration $CALIBRATION} ${ROUTES:+--routes $ROUTES} "$@" \
    --out $r/$f.json > $r/$f.log 2>&1
  echo "   rc=$?"; grep -E "pkvrt-|flashinfer-|Error|error" $r/$f.log | grep -v "^  baseline" | tail -9
  tar czf $out/engine$sfx.tgz -C $r .
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
