export PKVRT_SOURCE_COMMIT=$(cat .carry/commit); WHL=.whl07s . benches/h200_call.sh || exit 1
t0=$(date +%s)
python3 .carry/prof_fi.py > $OUT/prof-fi.log 2>&1; echo "prof rc=$?"; head -12 $OUT/prof-fi.log
S=$OUT/serving; mkdir -p $S
sv() { name=$1; shift; timeout 150 python3 -m pkvrt bench serving --max-active 8 --seeds 20260623-20260624 --check-steps 2 \
    --engines flashinfer,adaptive,adaptive-fiwrapper "$@" --out $S/$name.json > $S/$name.log 2>&1
  echo "$name rc=$? $(( $(date +%s) - t0 )) s"; grep -E "ratio|^\| .*pkvrt" $S/$name.log | tail -4 | cut -c1-160; }
sv conv-L32 --steps-limit 32 --engine-layers 32 --trace .carry/traces/azure2023_conv.csv
sv conv-L1 --steps-limit 32 --trace .carry/traces/azure2023_conv.csv
sv bimodal-L32 --steps-limit 16 --engine-layers 32 --trace bimodal
sv code-L32 --steps-limit 32 --engine-layers 32 --trace .carry/traces/azure2023_code.csv
timeout 200 python3 -m pytest -q -p no:cacheprovider tests/gpu/test_harness.py tests/gpu/test_fi_engines.py > $OUT/gpu-tests.log 2>&1
echo "tests rc=$? $(( $(date +%s) - t0 )) s"; tail -1 $OUT/gpu-tests.log; grep -E "^FAILED" $OUT/gpu-tests.log | head -5
echo "total $(( $(date +%s) - t0 )) s"
