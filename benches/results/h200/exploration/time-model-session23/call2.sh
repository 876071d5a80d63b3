# Session 23, call 2: serving with the refitted time model (calibration/nvidia-h200.json) against the
# file before it (.carry/cal-old, via PKVRT_CALIBRATION_DIR), alternated per trace, 1 and 32 layers.
export PKVRT_SOURCE_COMMIT=$(cat .carry/commit); WHL=.whl07s . benches/h200_call.sh || exit 1
t0=$(date +%s)
S=/tmp/serving; mkdir -p $S
A="bench serving --max-active 8 --check-steps 2 --seeds 20260623-20260624 --engines flashinfer,adaptive"
sv() { name=$1; shift; timeout 70 python3 -m pkvrt $A "$@" --out $S/serving-$name.json > $S/serving-$name.log 2>&1
  echo "$name rc=$? $(( $(date +%s) - t0 )) s"; grep -E "^\| .*pkvrt" $S/serving-$name.log | cut -c1-150; tar czf $OUT/serving.tgz -C $S .; }
both() { name=$1; shift; sv $name-new "$@"; PKVRT_CALIBRATION_DIR=.carry/cal-old sv $name-old "$@"; }
both bimodal-B8-L32 --steps-limit 16 --engine-layers 32 --trace bimodal
both bimodal-B8-L1 --steps-limit 16 --trace bimodal
both zipf-B8-L32 --steps-limit 16 --engine-layers 32 --trace zipf
both uniform-B8-L32 --steps-limit 16 --engine-layers 32 --trace uniform
both azure-conv-B8-L1 --steps-limit 32 --trace .carry/traces/azure2023_conv.csv
both azure-conv-B8-L32 --steps-limit 32 --engine-layers 32 --trace .carry/traces/azure2023_conv.csv
echo "total $(( $(date +%s) - t0 )) s"
