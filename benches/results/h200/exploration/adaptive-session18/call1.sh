export PKVRT_SOURCE_COMMIT=$(cat .carry/commit); WHL=.whl07s . benches/h200_call.sh || exit 1
t0=$(date +%s)
C=/tmp/cal; mkdir -p $C; cp calibration/nvidia-h200.json $C/nvidia-h200.json
timeout 330 python3 -m pkvrt calibrate --out $C/nvidia-h200.json --raw $C/calibrate-sweeps.json --groups 4,1,8 --max-waves 3 --suggest-routes $C/suggested-routes.toml > $C/calibrate.log 2>&1
echo "cal rc=$? $(( $(date +%s) - t0 )) s"
timeout 90 python3 -m pkvrt calibrate --kv-dtype fp8 --groups 4 --base $C/nvidia-h200.json --out $C/nvidia-h200.json --raw $C/calibrate-sweeps-fp8.json > $C/calibrate-fp8.log 2>&1
echo "fp8 rc=$? $(( $(date +%s) - t0 )) s"
tar czf $OUT/cal.tgz -C $C .
R=/tmp/wall; mkdir -p $R
for tr in "bimodal 8" "bucketed 1"; do set -- $tr
  timeout 120 python3 -m pkvrt bench serving --trace $1 --max-active $2 --seeds 20260623 --steps-limit 16 --check-steps 2 \
    --engine-layers 1 --engines flashinfer,host-step,device-plan-step,adaptive --out $R/wall-$1-B$2-L1.json > $R/wall-$1-B$2-L1.log 2>&1
  echo "$1 rc=$? $(( $(date +%s) - t0 )) s"; grep -E "^\| .*(pkvrt|flashinfer)" $R/wall-$1-B$2-L1.log | tail -5
done
tar czf $OUT/wall.tgz -C $R .
grep "max |error|" $C/calibrate.log $C/calibrate-fp8.log
echo "total $(( $(date +%s) - t0 )) s"
