export PKVRT_SOURCE_COMMIT=$(cat .carry/commit); WHL=.whl07s . benches/h200_call.sh || exit 1
t0=$(date +%s)
timeout 220 python3 -m pytest -q -p no:cacheprovider -rs tests/gpu/test_runtime.py tests/gpu/test_device_planning.py > $OUT/tests.log 2>&1; echo "tests rc=$? $(( $(date +%s) - t0 )) s"; tail -3 $OUT/tests.log
( python3 examples/engine_graph.py --host-routing --steps 30 2>&1 | tail -3; python3 examples/engine_graph.py --steps 30 2>&1 | tail -3 ) | tee $OUT/example.log
timeout 200 python3 benches/host_cost.py --out $OUT/host-cost.json --steps 60 --layers 1 --cases B1-32K,B8-bimodal --rounds 3 \
  --engines runtime-engine-capture,runtime-engine-capture-plan-graph,runtime-engine-capture-eager-plan,runtime-adaptive-graphs,runtime-device-plan-graphs,flashinfer-raw > $OUT/host-cost.log 2>&1
echo "host_cost rc=$? $(( $(date +%s) - t0 )) s"; grep -E "median|target" $OUT/host-cost.log
R=/tmp/wall2; rm -rf $R; mkdir -p $R
for tr in "bimodal 8" "bucketed 1"; do set -- $tr
  timeout 150 python3 -m pkvrt bench serving --trace $1 --max-active $2 --seeds 20260623 --steps-limit 16 --check-steps 2 \
    --engine-layers 1 --engines flashinfer,host-step,device-plan-step --out $R/wall-$1-B$2-L1.json > $R/wall-$1-B$2-L1.log 2>&1
  echo "$1 rc=$? $(( $(date +%s) - t0 )) s"; grep -E "^\| .*(pkvrt|flashinfer)" $R/wall-$1-B$2-L1.log | tail -3
done
tar czf $OUT/wall.tgz -C $R .
rm -rf /tmp/engine-r
ENGINES=flashinfer,device-plan-step,host-step bash benches/h200_engine.sh $OUT all .carry/traces
echo "total $(( $(date +%s) - t0 )) s"
