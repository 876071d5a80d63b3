# Session 23, call 3: after the FP8 section's refit, the FP8 and Runtime GPU tests and examples/decode_loop.py.
export PKVRT_SOURCE_COMMIT=$(cat .carry/commit); WHL=.whl07s . benches/h200_call.sh > /dev/null 2>&1 || exit 1
t0=$(date +%s)
timeout 300 python3 -m pytest -q -p no:cacheprovider tests/gpu/test_fp8.py tests/gpu/test_runtime.py tests/gpu/test_device_plan.py > $OUT/gpu-tests.log 2>&1
echo "tests rc=$? $(( $(date +%s) - t0 )) s"; tail -1 $OUT/gpu-tests.log; grep -E "^FAILED|^ERROR" $OUT/gpu-tests.log | head -20
timeout 120 python3 examples/decode_loop.py > $OUT/decode_loop.log 2>&1; echo "decode_loop rc=$?"; tail -12 $OUT/decode_loop.log
echo "total $(( $(date +%s) - t0 )) s"
