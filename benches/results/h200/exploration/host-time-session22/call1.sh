# Session 22, call 1: measure host_time on the H200 machine, then the serving harness with it.
export PKVRT_SOURCE_COMMIT=$(cat .carry/commit); WHL=.whl07s . benches/h200_call.sh || exit 1
t0=$(date +%s)
timeout 240 python3 -m pkvrt calibrate --host-time --base calibration/nvidia-h200.json \
  --out $OUT/nvidia-h200.json --raw $OUT/host-time.json > $OUT/calibrate-host.log 2>&1
echo "calibrate rc=$? $(( $(date +%s) - t0 )) s"; tail -8 $OUT/calibrate-host.log
tar czf $OUT/fi-cache.tgz -C ~/.cache flashinfer 2>/dev/null
[ -f $OUT/nvidia-h200.json ] && cp $OUT/nvidia-h200.json calibration/nvidia-h200.json
S=/tmp/serving; mkdir -p $S
A="bench serving --max-active 8 --check-steps 2 --seeds 20260623-20260624 --engines flashinfer,adaptive"
sv() { name=$1; shift; timeout 90 python3 -m pkvrt $A "$@" --out $S/serving-$name.json > $S/serving-$name.log 2>&1
  echo "$name rc=$? $(( $(date +%s) - t0 )) s"; grep -E "^\| .*pkvrt" $S/serving-$name.log | cut -c1-150; tar czf $OUT/serving.tgz -C $S .; }
sv azure-conv-B8-L32 --steps-limit 32 --engine-layers 32 --trace .carry/traces/azure2023_conv.csv
sv azure-conv-B8-L1 --steps-limit 32 --trace .carry/traces/azure2023_conv.csv
sv azure-code-B8-L32 --steps-limit 32 --engine-layers 32 --trace .carry/traces/azure2023_code.csv
sv azure-code-B8-L1 --steps-limit 32 --trace .carry/traces/azure2023_code.csv
sv bimodal-B8-L32 --steps-limit 16 --engine-layers 32 --trace bimodal
sv bucketed-B1-L32 --steps-limit 16 --engine-layers 32 --trace bucketed --max-active 1
echo "total $(( $(date +%s) - t0 )) s"
