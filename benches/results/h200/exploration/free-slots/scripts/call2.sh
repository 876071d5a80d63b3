export PKVRT_SOURCE_COMMIT=$(cat .carry/commit); WHL=.whl07s . benches/h200_call.sh || exit 1
R=$OUT/r; mkdir -p $R
save() { tar czf $OUT/r.tgz -C $R . ; }
eng() { name=$1; b=$2; seeds=$3; shift 3; timeout ${LIM:-100} python3 -m pkvrt bench serving --max-active $b --steps-limit 16 --check-steps 2 --engine-layers 32 --engines flashinfer,device-plan-step --seeds $seeds "$@" --out $R/$name.json > $R/$name.log 2>&1; echo "$name rc=$? $(date +%T)"; grep -E "^ *(pkvrt-|flashinfer-)" $R/$name.log | grep -v unavailable | tail -2; save; }
date +%T
timeout 90 python3 -m pytest -q -p no:cacheprovider tests/gpu/test_device_plan.py > $R/gpu-tests.log 2>&1; echo "tests rc=$? $(date +%T)"; tail -2 $R/gpu-tests.log
for F in 0 8; do CAL=; [ $F != 0 ] && CAL="--calibration .carry/cal-free$F.json"; LIM=150 eng b1-F$F 1 20260623-20260625 --trace bucketed $CAL; done
for F in 0 8; do CAL=; [ $F != 0 ] && CAL="--calibration .carry/cal-free$F.json"; eng b8-F$F 8 20260623-20260624 --trace bimodal $CAL; done
for F in 0 8; do CAL=; [ $F != 0 ] && CAL="--calibration .carry/cal-free$F.json"; eng conv-F$F 8 20260623 --trace .carry/traces/azure2023_conv.csv --steps-limit 32 $CAL; done
for F in 0 8; do CAL=; [ $F != 0 ] && CAL="--calibration .carry/cal-free$F.json"; eng zipf-F$F 8 20260623 --trace zipf $CAL; done
eng b1-F16 1 20260623-20260625 --trace bucketed --calibration .carry/cal-free16.json
eng b8-F16 8 20260623-20260624 --trace bimodal --calibration .carry/cal-free16.json
