export PKVRT_SOURCE_COMMIT=$(cat .carry/commit); WHL=.whl07s . benches/h200_call.sh || exit 1
t0=$(date +%s)
use() { rm -rf pkvrt/_cubins && mkdir -p pkvrt/_cubins && tar xf .carry/cubins-$1.txz -C pkvrt/_cubins; }
for c in A AW; do use $c
  timeout 100 python3 -m pytest -q -p no:cacheprovider -x tests/gpu/test_kernels.py tests/gpu/test_kernels_fuzz.py > $OUT/tests-$c.log 2>&1; echo "tests $c rc=$? $(( $(date +%s) - t0 )) s"; tail -1 $OUT/tests-$c.log
done
R=/tmp/ab3; rm -rf $R; mkdir -p $R
for c in base A W AW; do use $c
  timeout 60 python3 benches/cut_protocols.py --lengths 2048 --group 8 --cuts 2,16,64 --layers 32 --repeats 20 --trace --out $R/g8-merge-$c.json > $R/g8-merge-$c.log 2>&1
  timeout 60 python3 benches/cut_protocols.py --lengths 34304,2069,2069,2070 --group 8 --cuts 27,53 --layers 32 --repeats 20 --trace --out $R/g8-4row-$c.json > $R/g8-4row-$c.log 2>&1
  echo "cut $c $(( $(date +%s) - t0 )) s"; grep -E "^(exact)" $R/g8-merge-$c.log $R/g8-4row-$c.log | sed 's/.*\/g8-/g8-/'
done
tar czf $OUT/cut.tgz -C $R .
for tr in "gqa-G8 bimodal 4 8" "bimodal bimodal 8 8" "azure-conv .carry/traces/azure2023_conv.csv 8 8"; do set -- $tr
  for c in base A W AW; do use $c
    timeout 80 python3 -m pkvrt bench serving --trace $2 --max-active $4 --num-kv-heads $3 --seeds 20260623-20260625 --steps-limit $([ $1 = azure-conv ] && echo 32 || echo 16) --check-steps 2 \
      --engine-layers 32 --engines flashinfer,device-plan-step --out $R/engine-$1-B$4-$c.json > $R/engine-$1-B$4-$c.log 2>&1
    echo "$1 $c rc=$? $(( $(date +%s) - t0 )) s $(grep -E '^\| .*pkvrt' $R/engine-$1-B$4-$c.log | tail -1 | cut -d'|' -f6)"
  done
  tar czf $OUT/ab.tgz -C $R .
done
