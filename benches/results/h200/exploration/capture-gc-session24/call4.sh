# Session 24, call 4: (a) the GPU tests of the capture code after collector_paused (7aa4f5c);
# (b) FP8 serving with the shipped FP8 time model (refit) against the previous section (.carry/cal-b =
# 285b2a6's file), the adaptive (host-routed) Runtime, whose FP8 route choice the section drives,
# against FlashInfer's fastest FP8 path; alternated per trace, 1 and 32 layers.
export PKVRT_SOURCE_COMMIT=$(cat .carry/commit); WHL=.whl07s . benches/h200_call.sh > /dev/null 2>&1 || exit 1
t0=$(date +%s)
timeout 150 python3 -m pytest -q -p no:cacheprovider tests/gpu/test_fp8.py tests/gpu/test_runtime.py tests/gpu/test_device_planning.py > $OUT/gpu-tests.log 2>&1
echo "tests rc=$? $(( $(date +%s) - t0 )) s: $(tail -1 $OUT/gpu-tests.log)"; grep -E "^FAILED|^ERROR" $OUT/gpu-tests.log | cut -c1-200
S=/tmp/serving; mkdir -p $S
A="bench serving --max-active 8 --check-steps 2 --seeds 20260623-20260624 --engines flashinfer,adaptive --kv-dtype fp8"
sv() { name=$1; shift; timeout 80 python3 -m pkvrt $A "$@" --out $S/serving-$name.json > $S/serving-$name.log 2>&1
  echo "$name rc=$? $(( $(date +%s) - t0 )) s"; grep -E "^\| .*pkvrt" $S/serving-$name.log | cut -c1-150; tar czf $OUT/serving.tgz -C $S .; }
both() { name=$1; shift; sv $name-new "$@"; PKVRT_CALIBRATION_DIR=.carry/cal-b sv $name-old "$@"; }
both fp8-bimodal-B8-L32 --steps-limit 16 --engine-layers 32 --trace bimodal
both fp8-bimodal-B8-L1 --steps-limit 16 --trace bimodal
both fp8-zipf-B8-L32 --steps-limit 16 --engine-layers 32 --trace zipf
both fp8-azure-conv-B8-L32 --steps-limit 32 --engine-layers 32 --trace .carry/traces/azure2023_conv.csv
both fp8-azure-conv-B8-L1 --steps-limit 32 --trace .carry/traces/azure2023_conv.csv
echo "total $(( $(date +%s) - t0 )) s"
