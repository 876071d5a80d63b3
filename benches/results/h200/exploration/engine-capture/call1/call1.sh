export PKVRT_SOURCE_COMMIT=$(cat .carry/commit); WHL=.whl07s . benches/h200_call.sh || exit 1
t0=$(date +%s)
python3 -m pytest -q -p no:cacheprovider tests/gpu/test_runtime.py 2>&1 | tail -6 | tee $OUT/tests.log
(cd ~/.cache && tar cJf $OUT/fi-cache.txz --exclude=pip .)
echo "tests $(( $(date +%s) - t0 )) s"
python3 examples/engine_graph.py --host-routing --steps 30 2>&1 | tail -9 | tee $OUT/example.log
python3 examples/engine_graph.py --steps 30 2>&1 | tail -3 | tee -a $OUT/example.log
echo "example $(( $(date +%s) - t0 )) s"
ENGINES=flashinfer,device-plan-step,adaptive-step bash benches/h200_engine.sh $OUT quick .carry/traces
(cd ~/.cache && tar cJf $OUT/fi-cache.txz --exclude=pip .)
echo "total $(( $(date +%s) - t0 )) s"
