export PKVRT_SOURCE_COMMIT=$(cat .carry/commit); WHL=.whl07s . benches/h200_call.sh || exit 1
t0=$(date +%s)
R=/tmp/adaptive3; mkdir -p $R
for tr in "bimodal 8 --trace bimodal" "bucketed 1 --trace bucketed" "azure-conv 8 --steps-limit 32 --trace .carry/traces/azure2023_conv.csv"; do set -- $tr; n=$1; b=$2; shift 2
  timeout 150 python3 -m pkvrt bench serving --max-active $b --seeds 20260623-20260624 --steps-limit 16 --check-steps 2 \
    --engine-layers 32 --engines flashinfer,adaptive,adaptive-eager,host-step "$@" --out $R/adaptive-$n-B$b-L32.json > $R/adaptive-$n-B$b-L32.log 2>&1
  echo "$n rc=$? $(( $(date +%s) - t0 )) s"; grep -E "^\| .*pkvrt" $R/adaptive-$n-B$b-L32.log | tail -3
  tar czf $OUT/adaptive.tgz -C $R .
done
timeout 300 python3 -m pytest -q -p no:cacheprovider tests/gpu/test_harness.py tests/gpu/test_fi_engines.py tests/gpu/test_calibrate_fp8.py tests/gpu/test_device_plan.py tests/gpu/test_runtime.py > $OUT/gpu-tests.log 2>&1
echo "tests rc=$? $(( $(date +%s) - t0 )) s"; tail -3 $OUT/gpu-tests.log
echo "total $(( $(date +%s) - t0 )) s"
