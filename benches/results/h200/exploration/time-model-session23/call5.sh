# Session 23, call 5: is call 3-4's capture failure this session's? The same order (test_fp8, then the
# failing test_runtime test) on this commit and on cfcbce9 (session 22's last, unpacked from .carry).
export PKVRT_SOURCE_COMMIT=$(cat .carry/commit); WHL=.whl07s . benches/h200_call.sh > /dev/null 2>&1 || exit 1
T=tests/gpu/test_runtime.py::test_host_lengths_plan_is_built_on_the_gpu_task_for_task
timeout 120 python3 -m pytest -q -p no:cacheprovider tests/gpu/test_fp8.py $T > $OUT/new.log 2>&1; echo "new rc=$?"; tail -1 $OUT/new.log
timeout 60 python3 -m pytest -q -p no:cacheprovider $T > $OUT/new-alone.log 2>&1; echo "new alone rc=$?"; tail -1 $OUT/new-alone.log
mkdir -p /tmp/old && tar xzf .carry/old-cfcbce9.tgz -C /tmp/old && cp -r pkvrt/_cubins /tmp/old/pkvrt/ && cd /tmp/old
PYTHONPATH=/tmp/site:/tmp/old timeout 120 python3 -m pytest -q -p no:cacheprovider tests/gpu/test_fp8.py $T > $OUT/old.log 2>&1; echo "old rc=$?"; tail -1 $OUT/old.log
grep -E "^FAILED" $OUT/*.log
