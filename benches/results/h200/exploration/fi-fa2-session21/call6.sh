export PKVRT_SOURCE_COMMIT=$(cat .carry/commit); WHL=.whl07s . benches/h200_call.sh || exit 1
t0=$(date +%s)
python3 -c "import flashinfer, time; print('flashinfer', flashinfer.__version__)"; echo "import $(( $(date +%s) - t0 )) s"
timeout 240 python3 -m pytest -q -p no:cacheprovider tests/gpu/test_fi_engines.py tests/gpu/test_runtime.py -k "flashinfer or fi_" > $OUT/gpu-tests.log 2>&1
echo "tests rc=$? $(( $(date +%s) - t0 )) s"; tail -1 $OUT/gpu-tests.log; grep -E "^FAILED|^ERROR" $OUT/gpu-tests.log | head -5
ls ~/.cache/flashinfer/0.7.2.post1/90a/cached_ops/ | cut -c1-60
find ~/.cache/flashinfer -name "*.so" -newer .carry/commit | head; echo "new .so above (none = every module from the carried cache)"
echo "total $(( $(date +%s) - t0 )) s"
