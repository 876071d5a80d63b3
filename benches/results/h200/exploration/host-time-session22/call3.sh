# Session 22, call 3: the Runtime's layers-per-plan GPU test, decode_loop.py, host_cost with host time weighed.
export PKVRT_SOURCE_COMMIT=$(cat .carry/commit); WHL=.whl07s . benches/h200_call.sh || exit 1
t0=$(date +%s)
timeout 120 python3 -m pytest -q -p no:cacheprovider tests/gpu/test_runtime.py -k "host_time or flashinfer_route or default_flashinfer or decode_steps" > $OUT/gpu-tests.log 2>&1
echo "tests rc=$? $(( $(date +%s) - t0 )) s"; tail -1 $OUT/gpu-tests.log; grep -E "^FAILED|^ERROR" $OUT/gpu-tests.log | head
timeout 90 python3 examples/decode_loop.py > $OUT/decode_loop.log 2>&1; echo "decode_loop rc=$? $(( $(date +%s) - t0 )) s"
grep -E "^step|graphs|replays|captures" $OUT/decode_loop.log | head -14
timeout 200 python3 benches/host_cost.py --out $OUT/host-cost.json --steps 100 --rounds 3 --cases B1-32K,B8-bimodal,B8-phased \
  --engines runtime-adaptive-graphs,runtime-flashinfer-eager,flashinfer-raw > $OUT/host-cost.log 2>&1
echo "host_cost rc=$? $(( $(date +%s) - t0 )) s"; grep -E "median of|^target" $OUT/host-cost.log
