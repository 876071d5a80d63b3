export PKVRT_SOURCE_COMMIT=$(cat .carry/commit); WHL=.whl07s . benches/h200_call.sh || exit 1
t0=$(date +%s)
A="bench serving --max-active 8 --seeds 20260623 --check-steps 2 --steps-limit 32 --engine-layers 32 --trace .carry/traces/azure2023_conv.csv"
timeout 150 python3 .carry/prof_serving.py $A --engines flashinfer,adaptive,adaptive-fiwrapper --out /tmp/t1.json > $OUT/timers.log 2>&1
echo "timers rc=$? $(( $(date +%s) - t0 )) s"; grep -E "us/call|device .*wall" $OUT/timers.log
timeout 150 python3 -m cProfile -o $OUT/serving.prof .carry/prof_serving.py $A --engines flashinfer,adaptive --out /tmp/t2.json > $OUT/cprof.log 2>&1
echo "cprof rc=$? $(( $(date +%s) - t0 )) s"; grep -E "device .*wall" $OUT/cprof.log
echo "total $(( $(date +%s) - t0 )) s"
