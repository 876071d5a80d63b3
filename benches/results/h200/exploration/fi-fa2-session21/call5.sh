export PKVRT_SOURCE_COMMIT=$(cat .carry/commit); WHL=.whl07s . benches/h200_call.sh || exit 1
t0=$(date +%s)
S=/tmp/serving; mkdir -p $S
A="bench serving --max-active 8 --check-steps 2 --seeds 20260623-20260624"
sv() { name=$1; shift; timeout 200 python3 -m pkvrt $A "$@" --out $S/serving-$name.json > $S/serving-$name.log 2>&1
  echo "$name rc=$? $(( $(date +%s) - t0 )) s"; grep -E "^\| .*pkvrt" $S/serving-$name.log | cut -c1-150; tar czf $OUT/serving.tgz -C $S .; }
E=flashinfer,adaptive,pkv_workqueue
sv azure-code-B8-L32-forced --engines $E --steps-limit 32 --engine-layers 32 --trace .carry/traces/azure2023_code.csv
sv azure-code-B8-L1-forced --engines $E --steps-limit 32 --trace .carry/traces/azure2023_code.csv
echo "total $(( $(date +%s) - t0 )) s"
