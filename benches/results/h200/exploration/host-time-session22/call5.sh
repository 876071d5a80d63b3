# Session 22, call 5: traces the host-time rule was not looked at on (zipf, uniform, homogeneous
# B8), host time weighed vs not in one process, 1 and 32 layers.
export PKVRT_SOURCE_COMMIT=$(cat .carry/commit); WHL=.whl07s . benches/h200_call.sh || exit 1
t0=$(date +%s)
S=/tmp/serving; mkdir -p $S
A="bench serving --max-active 8 --check-steps 2 --seeds 20260623-20260624 --engines flashinfer,adaptive,adaptive-device-time"
sv() { name=$1; shift; timeout 110 python3 -m pkvrt $A "$@" --out $S/serving-$name.json > $S/serving-$name.log 2>&1
  echo "$name rc=$? $(( $(date +%s) - t0 )) s"; grep -E "^\| .*pkvrt" $S/serving-$name.log | cut -c1-150; tar czf $OUT/serving.tgz -C $S .; }
for t in zipf uniform homogeneous; do
  sv $t-B8-L32 --steps-limit 16 --engine-layers 32 --trace $t
  sv $t-B8-L1 --steps-limit 16 --trace $t
done
echo "total $(( $(date +%s) - t0 )) s"
