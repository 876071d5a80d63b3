export PKVRT_SOURCE_COMMIT=$(cat .carry/commit); WHL=.whl07s . benches/h200_call.sh || exit 1
t0=$(date +%s)
timeout 200 python3 -m pytest -q -p no:cacheprovider tests/gpu/test_runtime.py tests/gpu/test_harness.py > $OUT/gpu-tests.log 2>&1
echo "tests rc=$? $(( $(date +%s) - t0 )) s"; tail -1 $OUT/gpu-tests.log; grep -E "^FAILED|^ERROR" $OUT/gpu-tests.log | head -5
A="bench serving --max-active 8 --check-steps 2 --steps-limit 32 --engine-layers 32 --trace .carry/traces/azure2023_conv.csv"
p() { name=$1; ev=$2; shift 2; timeout 150 env $ev python3 .carry/prof_harness.py $A "$@" --out /tmp/$name.json > $OUT/$name.log 2>&1
  echo "$name rc=$? $(( $(date +%s) - t0 )) s"; grep -E "^\| .*pkvrt" $OUT/$name.log | cut -c1-150; }
p timers3 E=1 --seeds 20260623-20260624 --engines flashinfer,adaptive,adaptive-fiwrapper
p gcoff3 "GC_OFF=1 TIMERS=0" --seeds 20260623-20260624 --engines flashinfer,adaptive,adaptive-fiwrapper
p two TIMERS=0 --seeds 20260623-20260624 --engines flashinfer,adaptive
grep -E "^==|run_step|engine\.|Runtime\.|wall|gc|decide|check_step|gather|wrapper|Direct|sync|to_csr|block_table|FlashInferRoute" $OUT/timers3.log | head -90
echo "total $(( $(date +%s) - t0 )) s"
