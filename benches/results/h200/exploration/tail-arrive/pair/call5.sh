export PKVRT_SOURCE_COMMIT=$(cat .carry/commit); WHL=.whl07s . benches/h200_call.sh || exit 1
t0=$(date +%s)
use() { rm -rf pkvrt/_cubins && mkdir -p pkvrt/_cubins && tar xf .carry/cubins-$1.txz -C pkvrt/_cubins; }
use P1
timeout 100 python3 -m pytest -q -p no:cacheprovider -x tests/gpu/test_kernels.py tests/gpu/test_fp8.py > $OUT/tests-P1.log 2>&1; rc=$?; echo "tests P1 rc=$rc $(( $(date +%s) - t0 )) s"; tail -1 $OUT/tests-P1.log
[ $rc -eq 0 ] || exit 1
R=/tmp/ab5; rm -rf $R; mkdir -p $R
for c in P0 P1; do use $c
  timeout 60 python3 benches/cut_protocols.py --lengths 2048 --group 8 --cuts 2,16,64 --layers 32 --repeats 20 --trace --out $R/g8-merge-$c.json > $R/g8-merge-$c.log 2>&1
  timeout 60 python3 benches/cut_protocols.py --lengths 34304,2069,2069,2070 --group 8 --cuts 27,53 --layers 32 --repeats 20 --trace --out $R/g8-4row-$c.json > $R/g8-4row-$c.log 2>&1
  echo "cut $c $(( $(date +%s) - t0 )) s"; grep -E "^(exact)" $R/g8-merge-$c.log $R/g8-4row-$c.log | sed 's/.*\/g8-/g8-/'
done
for c in P0 P1 P0 P1; do use $c
  n=$(ls $R/engine-gqa-G8-B8-$c*.json 2>/dev/null | grep -vc steps)
  timeout 80 python3 -m pkvrt bench serving --trace bimodal --max-active 8 --num-kv-heads 4 --seeds 20260623-20260625 --steps-limit 16 --check-steps 2 \
    --engine-layers 32 --engines flashinfer,device-plan-step --out $R/engine-gqa-G8-B8-$c-$n.json > $R/engine-gqa-G8-B8-$c-$n.log 2>&1
  echo "G8 $c rc=$? $(( $(date +%s) - t0 )) s $(grep -E '^\| .*pkvrt' $R/engine-gqa-G8-B8-$c-$n.log | tail -1 | cut -d'|' -f6)"
  tar czf $OUT/ab.tgz -C $R .
done
