# Session 23, call 1: fresh calibration sweeps (test-retest of the refitted time model: the committed
# constants evaluated on steps timed again, offline) and the GPU tests on the refitted calibration.
export PKVRT_SOURCE_COMMIT=$(cat .carry/commit); WHL=.whl07s . benches/h200_call.sh || exit 1
t0=$(date +%s)
mkdir -p /tmp/cal
timeout 300 python3 -m pkvrt calibrate --out /tmp/cal/nvidia-h200.json --raw /tmp/cal/calibrate-sweeps.json \
  --groups 4,1,8 --max-waves 3 > /tmp/cal/calibrate.log 2>&1
echo "calibrate rc=$? $(( $(date +%s) - t0 )) s"; cp /tmp/cal/* $OUT/ 2>/dev/null
tar czf $OUT/fi-cache.tgz -C ~/.cache flashinfer
timeout 250 python3 -m pytest -q -p no:cacheprovider tests/gpu/test_runtime.py tests/gpu/test_device_plan.py tests/gpu/test_harness.py tests/gpu/test_fi_engines.py tests/gpu/test_fp8.py > $OUT/gpu-tests.log 2>&1
echo "tests rc=$? $(( $(date +%s) - t0 )) s"; tail -1 $OUT/gpu-tests.log; grep -E "^FAILED|^ERROR" $OUT/gpu-tests.log | head -20
grep "max |error|" /tmp/cal/calibrate.log
echo "total $(( $(date +%s) - t0 )) s"
