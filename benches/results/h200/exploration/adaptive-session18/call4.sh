export PKVRT_SOURCE_COMMIT=$(cat .carry/commit); WHL=.whl07s . benches/h200_call.sh || exit 1
t0=$(date +%s)
R=/tmp/hc; mkdir -p $R
use() { cp .carry/$1/running.py .carry/$1/checks.py pkvrt/runtime/; }
i=0
for v in new old new old; do i=$((i+1)); use $v
  timeout 100 python3 benches/host_cost.py --out $R/hc-$i-$v.json --steps 60 --layers 1 --cases B1-32K,B8-bimodal --rounds 1 \
    --engines runtime-adaptive-graphs,runtime-flashinfer-eager,flashinfer-raw > $R/hc-$i-$v.log 2>&1
  echo "$v rc=$? $(( $(date +%s) - t0 )) s"; grep "median of" $R/hc-$i-$v.log | cut -c1-170
done
use new
tar czf $OUT/hc.tgz -C $R .
timeout 200 python3 -m pytest -q -p no:cacheprovider tests/gpu/test_runtime.py tests/gpu/test_device_planning.py tests/gpu/test_fp8.py > $OUT/gpu-tests-runtime.log 2>&1
echo "tests rc=$? $(( $(date +%s) - t0 )) s"; tail -2 $OUT/gpu-tests-runtime.log
A=/tmp/ad4; mkdir -p $A
for tr in "bimodal 8" "bucketed 1"; do set -- $tr
  timeout 100 python3 -m pkvrt bench serving --trace $1 --max-active $2 --seeds 20260623-20260624 --steps-limit 16 --check-steps 2 \
    --engine-layers 32 --engines flashinfer,adaptive --out $A/adaptive-$1-B$2-L32.json > $A/adaptive-$1-B$2-L32.log 2>&1
  echo "$1 rc=$? $(( $(date +%s) - t0 )) s"; grep -E "^\| .*pkvrt" $A/adaptive-$1-B$2-L32.log | tail -2
done
tar czf $OUT/adaptive.tgz -C $A .
echo "total $(( $(date +%s) - t0 )) s"
