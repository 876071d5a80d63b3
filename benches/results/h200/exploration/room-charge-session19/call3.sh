export PKVRT_SOURCE_COMMIT=$(cat .carry/commit); WHL=.whl07s . benches/h200_call.sh || exit 1
t0=$(date +%s)
timeout 150 python3 -m pytest -q -p no:cacheprovider tests/gpu/test_device_plan.py > $OUT/gpu-tests-device-plan.log 2>&1
echo "tests rc=$? $(( $(date +%s) - t0 )) s"; tail -1 $OUT/gpu-tests-device-plan.log
A=/tmp/room; mkdir -p $A; i=0
for v in file room file room; do i=$((i+1))
  if [ $v = room ]; then C="--calibration .carry/cal-room.json"; else C=; fi
  for tr in conv code; do
    timeout 100 python3 -m pkvrt bench serving --max-active 8 --seeds 20260623-20260624 --steps-limit 32 --check-steps 2 \
      --engine-layers 32 --engines flashinfer,device-plan-step --trace .carry/traces/azure2023_$tr.csv $C \
      --out $A/$tr-$i-$v.json > $A/$tr-$i-$v.log 2>&1
    echo "$tr $v rc=$? $(( $(date +%s) - t0 )) s $(grep -E '^\| .*pkvrt' $A/$tr-$i-$v.log | tail -1 | cut -d'|' -f3,6,7)"
  done
  tar czf $OUT/room.tgz -C $A .
done
echo "total $(( $(date +%s) - t0 )) s"
