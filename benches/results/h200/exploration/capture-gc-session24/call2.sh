# Session 24, call 2: bisect call 1's finding (a collection of dead Runtimes breaks a capture):
# which finalizer, and only inside the capture or also just before it. One process per case.
export PKVRT_SOURCE_COMMIT=$(cat .carry/commit); WHL=.whl07s . benches/h200_call.sh > /dev/null 2>&1 || exit 1
D=benches/results/h200/exploration/capture-gc-session24
for where in early before inside; do for what in none all graphs staging fi; do
  [ $where = early ] && [ $what != all ] && continue
  timeout 60 python3 $D/bisect.py $where $what 2>$OUT/$where-$what.err | tee -a $OUT/bisect.txt || echo "$where $what rc=$?" | tee -a $OUT/bisect.txt
done; done
# FP8 test-retest of the refitted FP8 section: fresh FP8 sweeps at G 4 (offline: cost_model_error.py
# --file-constants on them).
t0=$(date +%s); mkdir -p /tmp/cal8
timeout 220 python3 -m pkvrt calibrate --kv-dtype fp8 --groups 4 --out /tmp/cal8/nvidia-h200.json \
  --raw /tmp/cal8/calibrate-sweeps-fp8.json > /tmp/cal8/calibrate-fp8.log 2>&1
echo "calibrate fp8 rc=$? $(( $(date +%s) - t0 )) s"; cp /tmp/cal8/* $OUT/ 2>/dev/null; grep "max |error|" /tmp/cal8/calibrate-fp8.log
