# Session 24, call 1: session 23's capture failure (FP8-refitted calibration, test_fp8 then test_runtime).
# A: the code before the fix, with the diagnostic plugin (capture status at every launch and gc run);
# B: the same, collecting (and listing) unreachable CUDA-side objects before every capture;
# C: the fix (no cyclic gc inside pkvrt's captures), the failing order; D: the fix, the GPU test
# files in the other order. E: the new regression test with the code before the fix (expected to fail). The calibration: calibration/nvidia-h200.json of the working tree.
export PKVRT_SOURCE_COMMIT=$(cat .carry/commit); WHL=.whl07s . benches/h200_call.sh > /dev/null 2>&1 || exit 1
D=benches/results/h200/exploration/capture-gc-session24
T="tests/gpu/test_fp8.py tests/gpu/test_runtime.py"
run() { local name=$1 lim=$2; shift 2; timeout $lim "$@" > $OUT/$name.log 2>&1; echo "$name rc=$? $(tail -1 $OUT/$name.log)"; grep -E "^FAILED" $OUT/$name.log | cut -c1-200; }
export DIAG_LOG
DIAG_LOG=$OUT/A-diag.log DIAG_NOFIX=1 PYTHONPATH=$PYTHONPATH:$D run A 90 python3 -m pytest -q -p no:cacheprovider -p capture_diag2 -x $T
grep -v "status NONE" $OUT/A-diag.log | grep -E "INVALID|failed" | head -5 | cut -c1-1500
DIAG_LOG=$OUT/B-diag.log DIAG_NOFIX=1 DIAG_SAVEALL=1 PYTHONPATH=$PYTHONPATH:$D run B 110 python3 -m pytest -q -p no:cacheprovider -p capture_diag2 -x $T
grep -v 'gc gen' $OUT/B-diag.log | sed -E 's/capture #[0-9]+: [0-9]+ unreachable objects before it; //' | sort | uniq -c | sort -rn | head -8 | cut -c1-600
DIAG_LOG=$OUT/E-diag.log DIAG_NOFIX=1 PYTHONPATH=$PYTHONPATH:$D run E 50 python3 -m pytest -q -p no:cacheprovider -p capture_diag2 tests/gpu/test_runtime.py -k collection_inside
grep -E "^E  .*(Error|assert)" $OUT/E.log | head -3 | cut -c1-300
run C 100 python3 -m pytest -q -p no:cacheprovider $T
run D 200 python3 -m pytest -q -p no:cacheprovider tests/gpu/test_runtime.py tests/gpu/test_device_plan.py tests/gpu/test_harness.py tests/gpu/test_fi_engines.py tests/gpu/test_fp8.py
