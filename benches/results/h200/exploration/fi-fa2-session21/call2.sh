export PKVRT_SOURCE_COMMIT=$(cat .carry/commit); WHL=.whl07s . benches/h200_call.sh || exit 1
t0=$(date +%s)
timeout 200 python3 -m pytest -q -p no:cacheprovider tests/gpu/test_runtime.py > $OUT/gpu-tests.log 2>&1
echo "tests rc=$? $(( $(date +%s) - t0 )) s"; tail -1 $OUT/gpu-tests.log; grep -E "^FAILED|^ERROR" $OUT/gpu-tests.log | head -5
S=/tmp/serving; mkdir -p $S
A="bench serving --max-active 8 --check-steps 2 --seeds 20260623-20260624 --engines flashinfer,adaptive,adaptive-fiwrapper"
timeout 150 python3 .carry/prof_harness.py $A --steps-limit 32 --engine-layers 32 --trace .carry/traces/azure2023_conv.csv --out /tmp/t.json > $OUT/timers.log 2>&1
echo "timers rc=$? $(( $(date +%s) - t0 )) s"; grep -E "^\| .*pkvrt" $OUT/timers.log | cut -c1-150
sv() { name=$1; shift; timeout 120 python3 -m pkvrt $A "$@" --out $S/serving-$name.json > $S/serving-$name.log 2>&1
  echo "$name rc=$? $(( $(date +%s) - t0 )) s"; grep -E "^\| .*pkvrt" $S/serving-$name.log | cut -c1-150; tar czf $OUT/serving.tgz -C $S .; }
sv azure-code-B8-L32 --steps-limit 32 --engine-layers 32 --trace .carry/traces/azure2023_code.csv
sv bimodal-B8-L32 --steps-limit 16 --engine-layers 32 --trace bimodal
sv bucketed-B1-L32 --steps-limit 16 --engine-layers 32 --trace bucketed --max-active 1
sv azure-conv-B8-L1 --steps-limit 32 --trace .carry/traces/azure2023_conv.csv
sv azure-code-B8-L1 --steps-limit 32 --trace .carry/traces/azure2023_code.csv
grep -E "^==|engine\.|Runtime\.|  wall|decide|check_step|gather|wrapper|Direct|to_csr|FlashInferRoute" $OUT/timers.log | grep -v "  n " | head -60
echo "total $(( $(date +%s) - t0 )) s"
