export PKVRT_SOURCE_COMMIT=$(cat .carry/commit); WHL=.whl07s . benches/h200_call.sh || exit 1
t0=$(date +%s)
run() { name=$1; shift; timeout 90 python3 benches/cut_protocols.py "$@" --layers 32 --repeats 20 --trace --out $OUT/$name.json > $OUT/$name.log 2>&1
  echo "$name rc=$? $(( $(date +%s) - t0 )) s"; grep -E "^(exact|runtime|trace exact)" $OUT/$name.log | sed 's/, start spread.*decode alone/; dec/'; }
run g8-4row --lengths 34304,2069,2069,2070 --group 8 --cuts 14,27,40,53
run g4-4row --lengths 34304,2069,2069,2070 --group 4 --cuts 27,53
run g8-merge --lengths 2048 --group 8 --cuts 2,8,16,32,64
run g4-merge --lengths 2048 --group 4 --cuts 8,32,64
timeout 120 python3 -m pytest -q -p no:cacheprovider -rs tests/gpu/test_kernels.py > $OUT/tests.log 2>&1; echo "tests rc=$? $(( $(date +%s) - t0 )) s"; tail -2 $OUT/tests.log
