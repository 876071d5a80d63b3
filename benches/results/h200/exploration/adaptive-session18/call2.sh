export PKVRT_SOURCE_COMMIT=$(cat .carry/commit); WHL=.whl07s . benches/h200_call.sh || exit 1
t0=$(date +%s)
ENGINES=flashinfer,device-plan-step,host-step bash benches/h200_engine.sh $OUT all .carry/traces 2>&1 | grep -E "^==|rc=|device-plan-step|host-step" | cut -c1-150
echo "engine done $(( $(date +%s) - t0 )) s"
R=/tmp/adaptive; mkdir -p $R
for tr in "bimodal 8" "bucketed 1"; do set -- $tr
  timeout 100 python3 -m pkvrt bench serving --trace $1 --max-active $2 --seeds 20260623 --steps-limit 16 --check-steps 2 \
    --engine-layers 32 --engines flashinfer,adaptive --out $R/adaptive-$1-B$2-L32.json > $R/adaptive-$1-B$2-L32.log 2>&1
  echo "$1 rc=$? $(( $(date +%s) - t0 )) s"; grep -E "^\| .*pkvrt" $R/adaptive-$1-B$2-L32.log | tail -2
done
tar czf $OUT/adaptive.tgz -C $R .
echo "total $(( $(date +%s) - t0 )) s"
