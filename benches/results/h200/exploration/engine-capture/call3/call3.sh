export PKVRT_SOURCE_COMMIT=$(cat .carry/commit); WHL=.whl07s . benches/h200_call.sh || exit 1
for m in perlayer engine engine-novalidate; do
  CUDA_LAUNCH_BLOCKING=1 timeout 90 python3 .carry/dbg_fi.py $m > $OUT/dbg-$m.log 2>&1; echo "$m rc=$?"; grep -v "^frame\|^ *File \"/opt\|^  *\^" $OUT/dbg-$m.log | head -40 | cut -c1-250
done
