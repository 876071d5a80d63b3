export PKVRT_SOURCE_COMMIT=$(cat .carry/commit); WHL=.whl07s . benches/h200_call.sh || exit 1
t0=$(date +%s)
timeout 280 python3 -m pytest -q -p no:cacheprovider --durations=8 tests/gpu/test_runtime.py tests/gpu/test_device_plan.py tests/gpu/test_harness.py tests/gpu/test_fi_engines.py tests/gpu/test_fp8.py > $OUT/gpu-tests.log 2>&1
echo "tests rc=$? $(( $(date +%s) - t0 )) s"; tail -1 $OUT/gpu-tests.log; grep -E "^FAILED|^ERROR" $OUT/gpu-tests.log | head -5
timeout 60 python3 .carry/prof_plan_cprofile.py > $OUT/plan-cprofile.log 2>&1; echo "cprofile rc=$? $(( $(date +%s) - t0 )) s"
S=/tmp/serving; mkdir -p $S
A="bench serving --max-active 8 --check-steps 2 --seeds 20260623-20260624 --engines flashinfer,adaptive,adaptive-fiwrapper"
sv() { name=$1; shift; timeout 100 python3 -m pkvrt $A "$@" --out $S/serving-$name.json > $S/serving-$name.log 2>&1
  echo "$name rc=$? $(( $(date +%s) - t0 )) s"; grep -E "^\| .*pkvrt" $S/serving-$name.log | cut -c1-150; tar czf $OUT/serving.tgz -C $S .; }
sv azure-conv-B8-L32 --steps-limit 32 --engine-layers 32 --trace .carry/traces/azure2023_conv.csv
sv azure-code-B8-L32 --steps-limit 32 --engine-layers 32 --trace .carry/traces/azure2023_code.csv
sv bimodal-B8-L32 --steps-limit 16 --engine-layers 32 --trace bimodal
sv bucketed-B1-L32 --steps-limit 16 --engine-layers 32 --trace bucketed --max-active 1
sv azure-conv-B8-L1 --steps-limit 32 --trace .carry/traces/azure2023_conv.csv
sv bimodal-B8-L1 --steps-limit 16 --trace bimodal
timeout 100 python3 benches/host_cost.py --out $OUT/host-cost.json --steps 100 --layers 1,32 --cases B8-bimodal,B1-32K --rounds 3 \
  --engines runtime-flashinfer-eager,runtime-flashinfer-eager-wrapper-run,flashinfer-raw > $OUT/host-cost.log 2>&1
echo "host_cost rc=$? $(( $(date +%s) - t0 )) s"; grep "median of" $OUT/host-cost.log | cut -c1-150
head -45 $OUT/plan-cprofile.log | cut -c1-150
echo "total $(( $(date +%s) - t0 )) s"
