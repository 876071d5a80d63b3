# Session 24, call 3: the fix and the acyclic Runtime (285b2a6) with the FP8-refitted calibration in the
# working tree: the GPU tests in session 23's failing order (test_fp8 first), the examples, and an FP8
# test-retest (fresh FP8 sweeps at G 4; evaluated offline with cost_model_error.py --file-constants).
export PKVRT_SOURCE_COMMIT=$(cat .carry/commit); WHL=.whl07s . benches/h200_call.sh > /dev/null 2>&1 || exit 1
t0=$(date +%s)
timeout 240 python3 -m pytest -q -p no:cacheprovider tests/gpu/test_fp8.py tests/gpu/test_runtime.py tests/gpu/test_device_plan.py \
  tests/gpu/test_device_planning.py tests/gpu/test_harness.py tests/gpu/test_fi_engines.py > $OUT/gpu-tests.log 2>&1
echo "tests rc=$? $(( $(date +%s) - t0 )) s: $(tail -1 $OUT/gpu-tests.log)"; grep -E "^FAILED|^ERROR" $OUT/gpu-tests.log | cut -c1-220
for ex in decode_loop engine_graph; do timeout 60 python3 examples/$ex.py > $OUT/$ex.log 2>&1; echo "$ex rc=$? $(tail -2 $OUT/$ex.log | tr '\n' ' ')"; done
mkdir -p /tmp/cal8 && cp calibration/nvidia-h200.json /tmp/cal8/
timeout 200 python3 -m pkvrt calibrate --kv-dtype fp8 --groups 4 --base /tmp/cal8/nvidia-h200.json --out /tmp/cal8/fresh-fp8.json \
  --raw /tmp/cal8/calibrate-sweeps-fp8.json > /tmp/cal8/calibrate-fp8.log 2>&1
echo "calibrate fp8 rc=$? $(( $(date +%s) - t0 )) s"; cp /tmp/cal8/calibrate-sweeps-fp8.json /tmp/cal8/calibrate-fp8.log /tmp/cal8/fresh-fp8.json $OUT/ 2>/dev/null
grep "max |error|" /tmp/cal8/calibrate-fp8.log; tail -3 /tmp/cal8/calibrate-fp8.log
