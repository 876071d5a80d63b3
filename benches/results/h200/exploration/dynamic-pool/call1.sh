export PKVRT_SOURCE_COMMIT=$(cat .carry/commit); WHL=.whl07s . benches/h200_call.sh || exit 1
t0=$(date +%s)
timeout 200 python3 -m pytest -q -p no:cacheprovider -rs tests/gpu/test_kernels.py tests/gpu/test_kernels_fuzz.py tests/gpu/test_fp8.py > $OUT/tests.log 2>&1; rc=$?
echo "tests rc=$rc $(( $(date +%s) - t0 )) s"; tail -6 $OUT/tests.log
[ $rc -eq 0 ] || { grep -E "^(FAILED|ERROR)" $OUT/tests.log | head; }
for pct in 0 40; do
  PKVRT_POOL_PCT=$pct timeout 60 python3 benches/cut_protocols.py --lengths 34304,2069,2069,2070 --group 8 --cuts 27,53 --layers 32 --repeats 20 --trace --out $OUT/g8-4row-p$pct.json > $OUT/g8-4row-p$pct.log 2>&1
  echo "cut p$pct rc=$? $(( $(date +%s) - t0 )) s"; grep -E "^(exact|runtime|trace exact)" $OUT/g8-4row-p$pct.log
done
R=/tmp/ab1; rm -rf $R; mkdir -p $R
for tr in "gqa-G8 bimodal 4 8" "bimodal bimodal 8 8" "bimodal bimodal 8 4"; do set -- $tr
  for pct in 0 25 50; do
    PKVRT_POOL_PCT=$pct timeout 80 python3 -m pkvrt bench serving --trace $2 --max-active $4 --num-kv-heads $3 --seeds 20260623-20260625 --steps-limit 16 --check-steps 2 \
      --engine-layers 32 --engines flashinfer,device-plan-step --out $R/engine-$1-B$4-p$pct.json > $R/engine-$1-B$4-p$pct.log 2>&1
    echo "$1 B$4 p$pct rc=$? $(( $(date +%s) - t0 )) s"; grep -E "^\| .*pkvrt" $R/engine-$1-B$4-p$pct.log | tail -1
  done
  tar czf $OUT/ab.tgz -C $R .
done
