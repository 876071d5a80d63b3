export PKVRT_SOURCE_COMMIT=$(cat .carry/commit); WHL=.whl07s . benches/h200_call.sh || exit 1
t0=$(date +%s)
timeout 100 python3 .carry/prof_plan_conv.py > $OUT/plan-timers.log 2>&1
echo "timers rc=$? $(( $(date +%s) - t0 )) s"; cat $OUT/plan-timers.log | tail -25
timeout 120 python3 -m pytest -q -p no:cacheprovider tests/gpu/test_runtime.py > $OUT/gpu-tests.log 2>&1
echo "tests rc=$? $(( $(date +%s) - t0 )) s"; tail -1 $OUT/gpu-tests.log; grep -E "^FAILED" $OUT/gpu-tests.log | head -5
echo "total $(( $(date +%s) - t0 )) s"
