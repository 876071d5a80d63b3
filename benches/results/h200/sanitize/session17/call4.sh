export PKVRT_SOURCE_COMMIT=$(cat .carry/commit); WHL=.whl07s . benches/h200_call.sh || exit 1
t0=$(date +%s)
timeout 240 python3 -m pytest -q -p no:cacheprovider -rs tests/gpu/test_kernels.py tests/gpu/test_kernels_fuzz.py tests/gpu/test_fp8.py tests/gpu/test_runtime.py tests/gpu/test_device_planning.py tests/gpu/test_device_plan.py > $OUT/gpu-tests.log 2>&1; rc=$?
echo "tests rc=$rc $(( $(date +%s) - t0 )) s"; tail -3 $OUT/gpu-tests.log
[ $rc -eq 0 ] || { grep -E "^(FAILED|ERROR)" $OUT/gpu-tests.log | head; exit 1; }
SANITIZE_TOOLS="plain memcheck" timeout 60 bash benches/sanitize.sh /tmp/san > $OUT/sanitize.log 2>&1; echo "sanitize rc=$? $(( $(date +%s) - t0 )) s"; tail -3 $OUT/sanitize.log; cp /tmp/san/sanitize.json $OUT/ 2>/dev/null
ENGINES=flashinfer,device-plan-step,host-step timeout 280 bash benches/h200_engine.sh $OUT all .carry/traces
echo "engine $(( $(date +%s) - t0 )) s"
