export PKVRT_SOURCE_COMMIT=$(cat .carry/commit); WHL=.whl07s . benches/h200_call.sh || exit 1
t0=$(date +%s)
timeout 120 python3 -m pytest -q -p no:cacheprovider tests/gpu/test_runtime.py -k "engine_capture" > $OUT/tests.log 2>&1; echo "tests rc=$? $(( $(date +%s) - t0 )) s"; tail -2 $OUT/tests.log
timeout 120 python3 -m pkvrt bench serving --trace bucketed --max-active 1 --seeds 20260623 --steps-limit 16 --check-steps 2 \
    --engine-layers 32 --engines flashinfer,device-plan-step,host-step --out /tmp/h-b1.json > $OUT/harness-b1.log 2>&1
echo "harness rc=$? $(( $(date +%s) - t0 )) s"; grep -E "^\| .*(pkvrt|flashinfer)" $OUT/harness-b1.log | tail -3
