# Session 22, call 6: the Runtime GPU tests after layers_per_plan (and review fixes), decode_loop.py.
export PKVRT_SOURCE_COMMIT=$(cat .carry/commit); WHL=.whl07s . benches/h200_call.sh || exit 1
t0=$(date +%s)
timeout 300 python3 -m pytest -q -p no:cacheprovider tests/gpu/test_runtime.py tests/gpu/test_harness.py > $OUT/gpu-tests.log 2>&1
echo "tests rc=$? $(( $(date +%s) - t0 )) s"; tail -1 $OUT/gpu-tests.log; grep -E "^FAILED|^ERROR" $OUT/gpu-tests.log | head
timeout 90 python3 examples/decode_loop.py > $OUT/decode_loop.log 2>&1; echo "decode_loop rc=$? $(( $(date +%s) - t0 )) s"
grep -E "^step|^replays|^captures" $OUT/decode_loop.log | cut -c1-160
