export PKVRT_SOURCE_COMMIT=$(cat .carry/commit); WHL=.whl07s . benches/h200_call.sh || exit 1
t0=$(date +%s)
R=/tmp/ab3; rm -rf $R; mkdir -p $R
for c in old new; do
  cal=calibration/nvidia-h200.json; [ $c = old ] && cal=.carry/cal-old.json
  timeout 80 python3 -m pkvrt bench serving --trace uniform --max-active 8 --seeds 20260623 --steps-limit 16 --check-steps 2 \
    --engine-layers 32 --engines flashinfer,adaptive --calibration $cal --out $R/adaptive-uniform-B8-$c.json > $R/adaptive-uniform-B8-$c.log 2>&1
  echo "$c rc=$? $(( $(date +%s) - t0 )) s"; grep -E "^\| .*(pkvrt|flashinfer)|pkvrt-adaptive " $R/adaptive-uniform-B8-$c.log | tail -3
done
tar czf $OUT/ab.tgz -C $R .
SANITIZE_TOOLS="plain memcheck" timeout 90 bash benches/sanitize.sh /tmp/san > $OUT/sanitize.log 2>&1; echo "sanitize rc=$? $(( $(date +%s) - t0 )) s"; tail -6 $OUT/sanitize.log; cp /tmp/san/sanitize.json $OUT/ 2>/dev/null
left=$(( 560 - ($(date +%s) - t0) ))
timeout $left python3 -m pytest -q -p no:cacheprovider -rs tests/gpu > $OUT/gpu-tests.log 2>&1; echo "gpu tests rc=$? $(( $(date +%s) - t0 )) s (limit $left)"; tail -12 $OUT/gpu-tests.log
