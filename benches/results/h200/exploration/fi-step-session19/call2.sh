export PKVRT_SOURCE_COMMIT=$(cat .carry/commit); WHL=.whl07s . benches/h200_call.sh || exit 1
t0=$(date +%s)
use() { for f in runtime/planning.py runtime/buffers.py policy/router.py policy/blocktables.py policy/costmodel.py; do cp .carry/$1/$f pkvrt/$f; done; }
A=/tmp/ab; mkdir -p $A; i=0
for v in new old new old; do i=$((i+1)); use $v
  timeout 120 python3 -m pkvrt bench serving --max-active 8 --seeds 20260623-20260624 --steps-limit 32 --check-steps 2 \
    --engine-layers 32 --engines flashinfer,adaptive --trace .carry/traces/azure2023_conv.csv --out $A/conv-L32-$i-$v.json > $A/conv-L32-$i-$v.log 2>&1
  echo "$v rc=$? $(( $(date +%s) - t0 )) s"; grep -E "^\| .*pkvrt" $A/conv-L32-$i-$v.log | tail -1 | cut -c1-150
done
use new
tar czf $OUT/ab.tgz -C $A .
timeout 330 python3 -m pytest -q -p no:cacheprovider tests/gpu/test_runtime.py tests/gpu/test_harness.py tests/gpu/test_fi_engines.py tests/gpu/test_device_plan.py > $OUT/gpu-tests.log 2>&1
echo "tests rc=$? $(( $(date +%s) - t0 )) s"; tail -2 $OUT/gpu-tests.log
echo "total $(( $(date +%s) - t0 )) s"
