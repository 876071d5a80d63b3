# Session 23, call 7: which part of the commit makes test_runtime's planning capture fail after test_fp8:
# this code with (A) the calibration before session 23, (B) the new file with the old FP8 section.
export PKVRT_SOURCE_COMMIT=$(cat .carry/commit); WHL=.whl07s . benches/h200_call.sh > /dev/null 2>&1 || exit 1
for v in A:.carry/cal-old B:.carry/cal-b; do
  PKVRT_CALIBRATION_DIR=${v#*:} timeout 130 python3 -m pytest -q -p no:cacheprovider tests/gpu/test_fp8.py tests/gpu/test_runtime.py > $OUT/${v%%:*}.log 2>&1
  echo "${v%%:*} rc=$?"; tail -1 $OUT/${v%%:*}.log; grep -E "^FAILED" $OUT/${v%%:*}.log
done
