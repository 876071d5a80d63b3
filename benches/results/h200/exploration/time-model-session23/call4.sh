# Session 23, call 4: call 3's one failure (CUDA_ERROR_STREAM_CAPTURE_INVALIDATED while capturing the
# planning kernel in test_runtime after test_fp8) run again in the same order, twice, to see whether it repeats.
export PKVRT_SOURCE_COMMIT=$(cat .carry/commit); WHL=.whl07s . benches/h200_call.sh > /dev/null 2>&1 || exit 1
t0=$(date +%s)
for i in 1 2; do
  timeout 200 python3 -m pytest -q -p no:cacheprovider tests/gpu/test_fp8.py tests/gpu/test_runtime.py tests/gpu/test_device_plan.py > $OUT/gpu-tests-$i.log 2>&1
  echo "round $i rc=$? $(( $(date +%s) - t0 )) s"; tail -1 $OUT/gpu-tests-$i.log; grep -E "^FAILED|^ERROR" $OUT/gpu-tests-$i.log | head
done
