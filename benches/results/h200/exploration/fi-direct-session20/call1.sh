export PKVRT_SOURCE_COMMIT=$(cat .carry/commit); WHL=.whl07s . benches/h200_call.sh || exit 1
t0=$(date +%s)
timeout 200 python3 -m pytest -q -p no:cacheprovider tests/gpu/test_runtime.py tests/gpu/test_device_plan.py > $OUT/gpu-tests.log 2>&1
echo "tests rc=$? $(( $(date +%s) - t0 )) s"; tail -1 $OUT/gpu-tests.log; grep -E "^FAILED|Error" $OUT/gpu-tests.log | head -5
S=$OUT/serving; mkdir -p $S
sv() { name=$1; shift; timeout 150 python3 -m pkvrt bench serving --max-active 8 --seeds 20260623-20260624 --check-steps 2 \
    --engines flashinfer,adaptive,adaptive-fiwrapper "$@" --out $S/$name.json > $S/$name.log 2>&1
  echo "$name rc=$? $(( $(date +%s) - t0 )) s"; grep -E "ratio|^\| .*pkvrt" $S/$name.log | tail -4 | cut -c1-160; }
sv conv-L32 --steps-limit 32 --engine-layers 32 --trace .carry/traces/azure2023_conv.csv
sv conv-L1 --steps-limit 32 --trace .carry/traces/azure2023_conv.csv
sv bimodal-L32 --steps-limit 16 --engine-layers 32 --trace bimodal
timeout 200 python3 benches/host_cost.py --out $OUT/host-cost.json --steps 100 --layers 1,32 --cases B8-bimodal,B1-32K --rounds 3 \
  --engines runtime-flashinfer-eager,runtime-flashinfer-eager-wrapper-run,flashinfer-raw > $OUT/host-cost.log 2>&1
echo "host_cost rc=$? $(( $(date +%s) - t0 )) s"; grep "median of" $OUT/host-cost.log | cut -c1-150
echo "total $(( $(date +%s) - t0 )) s"
