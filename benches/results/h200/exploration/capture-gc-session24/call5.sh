# Session 24, call 5: the baseline probe's per-step least of 3 device passes (call 4's one-layer FP8
# bimodal seed 20260624 probed the tensor-core path at 3x its time and took the CUDA-core path):
# the harness GPU tests, then that run again (and the FP8 conversation trace, one layer).
export PKVRT_SOURCE_COMMIT=$(cat .carry/commit); WHL=.whl07s . benches/h200_call.sh > /dev/null 2>&1 || exit 1
t0=$(date +%s)
timeout 150 python3 -m pytest -q -p no:cacheprovider tests/gpu/test_harness.py > $OUT/gpu-tests.log 2>&1
echo "tests rc=$? $(( $(date +%s) - t0 )) s: $(tail -1 $OUT/gpu-tests.log)"; grep -E "^FAILED|^ERROR" $OUT/gpu-tests.log | cut -c1-200
S=$OUT; A="bench serving --max-active 8 --check-steps 2 --seeds 20260623-20260624 --engines flashinfer,adaptive --kv-dtype fp8"
sv() { name=$1; shift; timeout 70 python3 -m pkvrt $A "$@" --out $S/serving-$name.json > $S/serving-$name.log 2>&1
  echo "$name rc=$? $(( $(date +%s) - t0 )) s"; grep -E "baseline flashinfer|^\| .*pkvrt" $S/serving-$name.log | cut -c1-170; }
sv fp8-bimodal-B8-L1 --steps-limit 16 --trace bimodal
sv fp8-azure-conv-B8-L1 --steps-limit 32 --trace .carry/traces/azure2023_conv.csv
