# Session 22, call 2: the GPU tests on the calibration with host_time (call 1's), and bimodal / bucketed at one layer.
export PKVRT_SOURCE_COMMIT=$(cat .carry/commit); WHL=.whl07s . benches/h200_call.sh || exit 1
t0=$(date +%s)
timeout 330 python3 -m pytest -q -p no:cacheprovider tests/gpu/test_runtime.py tests/gpu/test_device_plan.py tests/gpu/test_harness.py tests/gpu/test_fi_engines.py tests/gpu/test_fp8.py > $OUT/gpu-tests.log 2>&1
echo "tests rc=$? $(( $(date +%s) - t0 )) s"; tail -1 $OUT/gpu-tests.log; grep -E "^FAILED|^ERROR" $OUT/gpu-tests.log | head -20
S=/tmp/serving; mkdir -p $S
A="bench serving --max-active 8 --check-steps 2 --seeds 20260623-20260624 --engines flashinfer,adaptive"
sv() { name=$1; shift; timeout 60 python3 -m pkvrt $A "$@" --out $S/serving-$name.json > $S/serving-$name.log 2>&1
  echo "$name rc=$? $(( $(date +%s) - t0 )) s"; grep -E "^\| .*pkvrt" $S/serving-$name.log | cut -c1-150; tar czf $OUT/serving.tgz -C $S .; }
sv bimodal-B8-L1 --steps-limit 16 --trace bimodal
sv bucketed-B1-L1 --steps-limit 16 --trace bucketed --max-active 1
echo "total $(( $(date +%s) - t0 )) s"
