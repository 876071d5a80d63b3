# Session 23, NOT RUN (device time spent): the next step on calls 3-7's capture failure (the FP8-refitted file,
# diagnostic (capture status before each launch), then the same with PKVRT_PDL=0.
export PKVRT_SOURCE_COMMIT=$(cat .carry/commit); WHL=.whl07s . benches/h200_call.sh > /dev/null 2>&1 || exit 1
D=benches/results/h200/exploration/time-model-session23
T="tests/gpu/test_fp8.py tests/gpu/test_runtime.py"
PYTHONPATH=$PYTHONPATH:$D PKVRT_CALIBRATION_DIR=.carry/cal-refit timeout 110 python3 -m pytest -q -p no:cacheprovider -p capture_diag -x $T > $OUT/diag.log 2>&1
echo "diag rc=$?"; tail -1 $OUT/diag.log; grep -A2 "^DIAG" $OUT/diag.log | cut -c1-1500
PKVRT_PDL=0 PKVRT_CALIBRATION_DIR=.carry/cal-refit timeout 110 python3 -m pytest -q -p no:cacheprovider $T > $OUT/nopdl.log 2>&1
echo "nopdl rc=$?"; tail -1 $OUT/nopdl.log; grep -E "^FAILED" $OUT/nopdl.log
