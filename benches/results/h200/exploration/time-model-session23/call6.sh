# Session 23, call 6: call 4's order (test_fp8, test_runtime) on cfcbce9 (session 22's last) and on
# cfcbce9's code with this commit's calibration file.
export PKVRT_SOURCE_COMMIT=$(cat .carry/commit); WHL=.whl07s . benches/h200_call.sh > /dev/null 2>&1 || exit 1
mkdir -p /tmp/old && tar xzf .carry/old-cfcbce9.tgz -C /tmp/old && cp -r pkvrt/_cubins /tmp/old/pkvrt/
NEWCAL=$PWD/calibration; cd /tmp/old
PYTHONPATH=/tmp/site:/tmp/old timeout 150 python3 -m pytest -q -p no:cacheprovider tests/gpu/test_fp8.py tests/gpu/test_runtime.py > $OUT/old.log 2>&1; echo "old rc=$?"; tail -1 $OUT/old.log
grep -E "^FAILED" $OUT/old.log
