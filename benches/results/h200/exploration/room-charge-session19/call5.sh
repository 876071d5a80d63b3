export PKVRT_SOURCE_COMMIT=$(cat .carry/commit); WHL=.whl07s . benches/h200_call.sh || exit 1
t0=$(date +%s)
timeout 60 python3 -m pytest -q -p no:cacheprovider tests/gpu/test_runtime.py > $OUT/gpu-tests-runtime.log 2>&1
echo "tests rc=$? $(( $(date +%s) - t0 )) s"; tail -1 $OUT/gpu-tests-runtime.log
ENGINES=flashinfer,device-plan-step,host-step bash benches/h200_engine.sh $OUT all .carry/traces 2>&1 | grep -E "^==|rc=|device-plan-step|host-step" | cut -c1-150
echo "total $(( $(date +%s) - t0 )) s"
