# Session 22, call 4: serving with host time weighed (adaptive) and without (adaptive-device-time,
# the routing before [host_time]) in the same process, 1 and 32 layers, four traces.
export PKVRT_SOURCE_COMMIT=$(cat .carry/commit); WHL=.whl07s . benches/h200_call.sh || exit 1
t0=$(date +%s)
S=/tmp/serving; mkdir -p $S
A="bench serving --max-active 8 --check-steps 2 --seeds 20260623-20260624 --engines flashinfer,adaptive,adaptive-device-time"
sv() { name=$1; shift; timeout 80 python3 -m pkvrt $A "$@" --out $S/serving-$name.json > $S/serving-$name.log 2>&1
  echo "$name rc=$? $(( $(date +%s) - t0 )) s"; grep -E "^\| .*pkvrt" $S/serving-$name.log | cut -c1-150; tar czf $OUT/serving.tgz -C $S .; }
sv azure-conv-B8-L32 --steps-limit 32 --engine-layers 32 --trace .carry/traces/azure2023_conv.csv
sv azure-conv-B8-L1 --steps-limit 32 --trace .carry/traces/azure2023_conv.csv
sv azure-code-B8-L32 --steps-limit 32 --engine-layers 32 --trace .carry/traces/azure2023_code.csv
sv azure-code-B8-L1 --steps-limit 32 --trace .carry/traces/azure2023_code.csv
sv bimodal-B8-L32 --steps-limit 16 --engine-layers 32 --trace bimodal
sv bimodal-B8-L1 --steps-limit 16 --trace bimodal
sv bucketed-B1-L32 --steps-limit 16 --engine-layers 32 --trace bucketed --max-active 1
sv bucketed-B1-L1 --steps-limit 16 --trace bucketed --max-active 1
echo "total $(( $(date +%s) - t0 )) s"
