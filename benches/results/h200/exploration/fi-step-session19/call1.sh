export PKVRT_SOURCE_COMMIT=$(cat .carry/commit); WHL=.whl07s . benches/h200_call.sh || exit 1
t0=$(date +%s)
R=/tmp/hc; mkdir -p $R
use() { for f in runtime/planning.py runtime/buffers.py policy/router.py policy/blocktables.py; do cp .carry/$1/$f pkvrt/$f; done; }
i=0
for v in new old new old; do i=$((i+1)); use $v
  timeout 120 python3 benches/host_cost.py --out $R/hc-$i-$v.json --steps 60 --layers 1,32 --cases B1-32K,B8-bimodal --rounds 1 \
    --engines runtime-adaptive-graphs,runtime-flashinfer-eager,runtime-flashinfer-graph,flashinfer-raw > $R/hc-$i-$v.log 2>&1
  echo "$v rc=$? $(( $(date +%s) - t0 )) s"
done
use new
tar czf $OUT/hc.tgz -C $R .
A=/tmp/ad; mkdir -p $A
for tr in "azure-conv 8 --steps-limit 32 --trace .carry/traces/azure2023_conv.csv" "bimodal 8 --trace bimodal" "bucketed 1 --trace bucketed"; do set -- $tr; n=$1; b=$2; shift 2
  for L in 32 1; do
  timeout 150 python3 -m pkvrt bench serving --max-active $b --seeds 20260623-20260624 --steps-limit 16 --check-steps 2 \
    --engine-layers $L --engines flashinfer,adaptive,adaptive-figraph "$@" --out $A/adaptive-$n-B$b-L$L.json > $A/adaptive-$n-B$b-L$L.log 2>&1
  echo "$n L$L rc=$? $(( $(date +%s) - t0 )) s"; grep -E "^\| .*pkvrt" $A/adaptive-$n-B$b-L$L.log | tail -2 | cut -c1-160
  done
  tar czf $OUT/adaptive.tgz -C $A .
done
timeout 200 python3 -m pytest -q -p no:cacheprovider tests/gpu/test_runtime.py > $OUT/gpu-tests-runtime.log 2>&1
echo "tests rc=$? $(( $(date +%s) - t0 )) s"; tail -2 $OUT/gpu-tests-runtime.log
for f in $R/hc-*.log; do echo "== $f"; grep "median of" $f | cut -c1-150; done
echo "total $(( $(date +%s) - t0 )) s"
