# Session 23, call 8: the shipped calibration (new top level, FP8 section as before) in call 3's order.
export PKVRT_SOURCE_COMMIT=$(cat .carry/commit); WHL=.whl07s . benches/h200_call.sh > /dev/null 2>&1 || exit 1
t0=$(date +%s)
timeout 280 python3 -m pytest -q -p no:cacheprovider tests/gpu/test_fp8.py tests/gpu/test_runtime.py tests/gpu/test_device_plan.py tests/gpu/test_harness.py > $OUT/gpu-tests.log 2>&1
echo "tests rc=$? $(( $(date +%s) - t0 )) s"; tail -1 $OUT/gpu-tests.log; grep -E "^FAILED|^ERROR" $OUT/gpu-tests.log | head
