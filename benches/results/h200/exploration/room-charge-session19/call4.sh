export PKVRT_SOURCE_COMMIT=$(cat .carry/commit); WHL=.whl07s . benches/h200_call.sh || exit 1
t0=$(date +%s)
timeout 200 python3 -m pytest -q -p no:cacheprovider tests/gpu/test_device_plan.py tests/gpu/test_device_planning.py tests/gpu/test_runtime.py > $OUT/gpu-tests.log 2>&1
echo "tests rc=$? $(( $(date +%s) - t0 )) s"; tail -1 $OUT/gpu-tests.log
A=/tmp/room; mkdir -p $A
run() {  # name b variant i args...
  local n=$1 b=$2 v=$3 i=$4; shift 4
  if [ $v = room ]; then C="--calibration .carry/cal-room.json"; else C=; fi
  timeout 100 python3 -m pkvrt bench serving --max-active $b --seeds 20260623-20260624 --steps-limit 16 --check-steps 2 \
    --engine-layers 32 --engines flashinfer,device-plan-step $C "$@" --out $A/$n-$i-$v.json > $A/$n-$i-$v.log 2>&1
  echo "$n $v rc=$? $(( $(date +%s) - t0 )) s $(grep -E '^\| .*pkvrt' $A/$n-$i-$v.log | tail -1 | cut -d'|' -f3,6,7)"
  tar czf $OUT/room.tgz -C $A .
}
for i in 1 2; do for v in file room; do
  run conv 8 $v $i --trace .carry/traces/azure2023_conv.csv --steps-limit 32
  run code 8 $v $i --trace .carry/traces/azure2023_code.csv --steps-limit 32
done; done
for v in file room; do
  run bimodal-B8 8 $v 1 --trace bimodal
  run uniform-B8 8 $v 1 --trace uniform
  run zipf-B8 8 $v 1 --trace zipf
  run G8-B8 8 $v 1 --trace bimodal --num-kv-heads 4
  run bucketed-B1 1 $v 1 --trace bucketed
  run bimodal-B4 4 $v 1 --trace bimodal
done
echo "total $(( $(date +%s) - t0 )) s"
