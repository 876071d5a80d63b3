export PKVRT_SOURCE_COMMIT=$(cat .carry/commit); WHL=.whl07s . benches/h200_call.sh || exit 1
R=$OUT/r; mkdir -p $R
save() { tar czf $OUT/r.tgz -C $R . ; }
b1() { name=$1; shift; timeout ${LIM:-120} python3 -m pkvrt bench serving --max-active 1 --steps-limit 16 --check-steps 2 --engine-layers 32 --engines flashinfer,device-plan-step --seeds 20260623-20260625 --trace bucketed "$@" --out $R/b1-$name.json > $R/b1-$name.log 2>&1; echo "b1-$name rc=$? $(date +%T)"; grep -E "^ *(pkvrt-|flashinfer-)" $R/b1-$name.log | tail -3; save; }
date +%T
LIM=300 b1 shipped
b1 wq32 --routes .carry/routes-wq32.toml
b1 mlp-shipped --mlp
b1 mlp-wq32 --mlp --routes .carry/routes-wq32.toml
(cd ~/.cache && tar cJf $OUT/fi-cache.txz --exclude=pip .) ; ls -la $OUT
# host cost: the new tree, the old tree (0c5f519's pkvrt, same script), the new again
mkdir -p .carry/old/pkvrt/_cubins && cp pkvrt/_cubins/* .carry/old/pkvrt/_cubins/
HC="--cases B1-32K,B8-bimodal,B8-phased --layers 1 --rounds 3 --engines runtime-adaptive-graphs,runtime-device-plan-graphs,flashinfer-raw"
timeout 150 python3 benches/host_cost.py $HC --out $R/host-cost-new.json > $R/host-cost-new.log 2>&1; echo "hc new rc=$? $(date +%T)"
PYTHONPATH=/tmp/site:$PWD/.carry/old timeout 150 python3 benches/host_cost.py $HC --out $R/host-cost-old.json > $R/host-cost-old.log 2>&1; echo "hc old rc=$? $(date +%T)"; save
for b in 1 8; do timeout 60 python3 .carry/prof_gpu.py $b > $R/prof-b$b.log 2>&1; done; save; echo "prof $(date +%T)"
timeout 200 python3 -m pytest -q -p no:cacheprovider tests/gpu/test_runtime.py tests/gpu/test_fi_engines.py tests/gpu/test_device_planning.py > $R/gpu-tests.log 2>&1; echo "tests rc=$? $(date +%T)"; tail -3 $R/gpu-tests.log; save
grep -h "target\|median of" $R/host-cost-*.log | grep -v "L1  *median" | head -30
grep -h "plan() median" $R/prof-b*.log
