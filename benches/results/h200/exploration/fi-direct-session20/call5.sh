export PKVRT_SOURCE_COMMIT=$(cat .carry/commit); WHL=.whl07s . benches/h200_call.sh || exit 1
t0=$(date +%s)
S=/tmp/serving; mkdir -p $S
sv() { name=$1; shift; timeout 150 python3 -m pkvrt bench serving --max-active 8 --seeds 20260623-20260624 --check-steps 2 \
    --engines flashinfer,adaptive,adaptive-fiwrapper "$@" --out $S/serving-$name.json > $S/serving-$name.log 2>&1
  echo "$name rc=$? $(( $(date +%s) - t0 )) s"; grep -E "^\| .*pkvrt" $S/serving-$name.log | tail -2 | cut -c1-140; tar czf $OUT/serving.tgz -C $S .; }
sv azure-conv-B8-L32 --steps-limit 32 --engine-layers 32 --trace .carry/traces/azure2023_conv.csv
sv azure-code-B8-L32 --steps-limit 32 --engine-layers 32 --trace .carry/traces/azure2023_code.csv
sv bimodal-B8-L32 --steps-limit 16 --engine-layers 32 --trace bimodal
sv bucketed-B1-L32 --steps-limit 16 --engine-layers 32 --trace bucketed --max-active 1
sv azure-conv-B8-L1 --steps-limit 32 --trace .carry/traces/azure2023_conv.csv
timeout 200 python3 -m pytest -q -p no:cacheprovider tests/gpu/test_harness.py tests/gpu/test_fi_engines.py > $OUT/gpu-tests.log 2>&1
echo "tests rc=$? $(( $(date +%s) - t0 )) s"; tail -1 $OUT/gpu-tests.log; grep -E "^FAILED" $OUT/gpu-tests.log | head -5
echo "total $(( $(date +%s) - t0 )) s"
