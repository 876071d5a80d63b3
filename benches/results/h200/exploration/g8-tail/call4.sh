export PKVRT_SOURCE_COMMIT=$(cat .carry/commit); WHL=.whl07s . benches/h200_call.sh || exit 1
t0=$(date +%s)
timeout 200 python3 benches/cut_protocols.py --lengths 34304,2069,2069,2070 --group 8 --cuts 14,27,40,53,64 --layers 32 --repeats 20 --trace --out $OUT/g8-4row.json > $OUT/g8-4row.log 2>&1
echo "4row rc=$? $(( $(date +%s) - t0 )) s"; grep -E "^(exact|padded |runtime|trace)" $OUT/g8-4row.log
timeout 150 python3 benches/cut_protocols.py --lengths 34304,2069,2069,2070 --group 4 --cuts 14,27,53 --layers 32 --repeats 20 --out $OUT/g4-4row.json > $OUT/g4-4row.log 2>&1
echo "g4 4row rc=$? $(( $(date +%s) - t0 )) s"; grep -E "^(exact|padded |runtime)" $OUT/g4-4row.log
