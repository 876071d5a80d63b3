#!/usr/bin/env bash
# One device call of the H200 evidence run; stages chosen by name, results under $OUT.
# usage: bash benches/h200_run.sh OUT STAGE [STAGE ...]
#   tests      the GPU test suite (tests/gpu), summary printed
#   suite      benches/gpu_suite.sh, the whole GPU suite as a resolution needs it (its parallel part
#              with 6 workers, then its serial part) -> OUT/suite.tgz (gpu-suite.log and the
#              per-test logs); SUITE_S: its time limit in seconds (default 400; about 200 on a warm
#              H200, more where FlashInfer has not compiled its modules: run fi-warm first)
#   calibrate  pkvrt calibrate -> calibration/<this GPU's slug>.json (nvidia-h200.json on an H200;
#              copied to OUT). The calibrate-* stages below write this GPU's file too
#   isolated   benches/isolated.py (Table 1) -> OUT/isolated.json
#   serving    the serving traces (bucketed, bimodal, uniform, zipf, mixed) -> OUT/serving-*.json
#   engine     the engine protocol (32 layers + MLP tail) on bimodal B8 -> OUT/engine-*.json
#   ablations  pytest benches --benchmark-only -> OUT/ablations.json
#   example    examples/decode_loop.py
#   hostcost   benches/host_cost.py (host time per step, every route, graphs/eager, device planning)
#   soak       benches/soak.py, 100 000 steps, the policy's routes -> OUT/soak.json
#   soak-dev   benches/soak.py --device-planning, 100 000 steps -> OUT/soak-device-planning.json
#   sanitize   benches/sanitize.sh (compute-sanitizer, 4 tools) -> OUT/sanitize*.{json,log}
#   calibrate-groups  pkvrt calibrate --add-groups: the served group sizes the file lacks (ADD_GROUPS,
#              default 2,3,5,7,16), laid over this GPU's calibration file -> OUT/<slug>.json
#   calibrate-d64 | calibrate-d96 | calibrate-d256  the by_head_dim section of that head dim, laid
#              over this GPU's file (run after calibrate-groups) -> OUT/<slug>.json
#   groups     benches/isolated.py on the group sizes the models add, every cut of the partition
#              timed (--partition-sweep) -> OUT/isolated-groups.json
#   models-a | models-b | models-c | models-d  benches/model_shapes.py, one group of models that
#              share FlashInfer's JIT modules each (benches/README.md) -> OUT/model-shapes-<x>.json
#   fi-warm    benches/fi_warm.py: FlashInfer's JIT modules for every model shape, built side by side
#              (run before models-a..d on a fresh machine; nothing timed)
#   dropin     benches/dropin.py, SGLang's and vLLM's calling styles -> OUT/dropin.json
#              (DROPIN_ARGS: more arguments, e.g. --profile-plan)
#   shared     benches/shared_pages.py, every sharing step (SHARED_ARGS: more of its options) -> OUT/shared-pages.json
#   sharing-traces  the sharing trace families (parallel sampling, a shared system prompt) and,
#              with TRACE_DIR/mooncake_conv.json (docs/traces.md), Mooncake's conversation trace,
#              in the engine protocol with and without SharedPagesRuntime -> OUT/engine-<trace>.json
#              (ROUTES: a routes.toml instead of the shipped one, TAG: a suffix of the files' names,
#              SHARING_ENGINES: the --engines list)
#   zipf-sweep  benches/isolated.py --partition-sweep on the drop-in's Zipf B8 step 0 (every cut
#              timed; the H100 ran its planned cut 17 % over the time model) -> OUT/isolated-zipf-sweep.json
#   gemma-waves  benches/model_shapes.py for Gemma-2-9B on this GPU's calibration and on a copy
#              whose by_head_dim.256 max_waves is 2 (the D 256 cut of short windowed steps,
#              benches/NOTES.md) -> OUT/gemma-waves/model-shapes-gemma-2-waves{3,2}.json
#   fused-tail  the fused route's two-level tail against one level (device-plan-step-tail1) in the
#              engine protocol, bimodal B8 at 64/4, 28/4, 64/8 and 32/8 heads (G 16, 7, 8, 4: the
#              first two should gain, the others stay within 1 %), then benches/layer_timeline.py
#              at 64/4 and 28/4 (the kernel's rule and one level) -> OUT/fused-tail.tgz (12 files
#              in one: the device tool brings back at most 8)
# BUDGET: seconds a models-*, dropin or shared stage may take (default 560: a call of its own);
# CAL_TIMEOUT the same for a calibrate stage (default 580).
set -u
out=$1; shift
export PYTHONUNBUFFERED=1
# this GPU's calibration file (its slug: calibration/nvidia-h200.json on an H200), for the calibrate stages
calfile() {
  local slug
  slug=$(python3 -c "import torch; from pkvrt.policy.calibration import slugify as s; print(s(torch.cuda.get_device_name()))") \
    || { echo "h200_run: no GPU name for the calibration file: stage skipped" >&2; return 1; }
  echo calibration/$slug.json
}
for stage in "$@"; do
  echo "== $stage ($(date +%T))"
  case $stage in
    suite) timeout ${SUITE_S:-400} bash benches/gpu_suite.sh $out/suite -n 6 --timeout $(( ${SUITE_S:-400} - 20 )) \
          | grep -E "passed|failed|FAILED|ERROR" | tail -20
      tar czf $out/suite.tgz -C $out suite && rm -rf $out/suite ;;
    tests) timeout 300 python3 -m pytest tests/gpu -q -p no:cacheprovider --maxfail=20 2>&1 | tee $out/gpu_tests.log | grep -E "passed|failed|Error|error|FAILED" | tail -25 ;;
    calibrate) cal=$(calfile) || continue; timeout ${CAL_TIMEOUT:-480} python3 -m pkvrt calibrate --out $cal --raw $out/calibrate-sweeps.json 2>&1 | tail -60; cp $cal $out/ ;;
    isolated) timeout 240 python3 benches/isolated.py --out $out/isolated.json 2>&1 | grep -v WARN | tail -12 ;;
    serving)
      for spec in "bucketed 1" "bimodal 8" "uniform 8" "zipf 8" "bimodal 4" "mixed 8"; do
        set -- $spec
        timeout 60 python3 -m pkvrt bench serving --trace $1 --max-active $2 --steps-limit 60 \
          --engines flashinfer,adaptive,flashinfer-graph --out $out/serving-$1-B$2.json 2>&1 | tail -3
      done ;;
    engine) timeout 100 python3 -m pkvrt bench serving --trace bimodal --max-active 8 --steps-limit 24 \
          --seeds 20260623-20260625 --engine-layers 32 --mlp --engines flashinfer,adaptive \
          --out $out/engine-bimodal-B8-mlp.json 2>&1 | tail -3 ;;
    example) timeout 60 python3 examples/decode_loop.py 2>&1 | tail -8 ;;
    hostcost) timeout 240 python3 benches/host_cost.py --steps 100 --out $out/host-cost.json 2>&1 | grep -v WARN | tail -80 ;;
    soak) timeout 200 python3 benches/soak.py --max-seconds 180 --out $out/soak.json 2>&1 | tail -25 ;;
    soak-dev) timeout 200 python3 benches/soak.py --max-seconds 180 --device-planning \
          --out $out/soak-device-planning.json 2>&1 | tail -25 ;;
    sanitize) bash benches/sanitize.sh $out 2>&1 | tail -20 ;;
    calibrate-groups) cal=$(calfile) || continue
      timeout ${CAL_TIMEOUT:-580} python3 -m pkvrt calibrate --add-groups ${ADD_GROUPS:-2,3,5,7,16} \
          --base $cal --out $cal --raw $out/calibrate-groups-sweeps.json 2>&1 | tail -60
      cp $cal $out/ ;;
    calibrate-d64|calibrate-d96|calibrate-d256) d=${stage#calibrate-d}; cal=$(calfile) || continue
      timeout ${CAL_TIMEOUT:-580} python3 -m pkvrt calibrate --head-dim $d --groups 4,1,2,8,16 --max-waves 3 \
          --base $cal --out $cal --raw $out/calibrate-d$d-sweeps.json 2>&1 | tail -40
      cp $cal $out/ ;;
    groups) timeout 300 python3 benches/isolated.py --partition-sweep --out $out/isolated-groups.json \
          --cases G16-B2-8K,G4-B8-8K,G16-B4-1K,G16-B8-bimodal,G7-B8-bimodal 2>&1 | grep -v WARN | tail -40 ;;
    models-a|models-b|models-c|models-d)
      case $stage in
        models-a) models=llama-3.1-8b,llama-3.1-70b,llama-3.2-3b,qwen2.5-7b,qwen2.5-14b,qwen3-235b-a22b ;;
        models-b) models=qwen2.5-0.5b,smollm2-135m,gpt-oss-20b,phi-3-mini ;;
        models-c) models=gemma-2-9b,gemma-3-12b ;;
        models-d) models=gemma-3-27b ;;
      esac
      timeout $(( ${BUDGET:-560} + 30 )) python3 benches/model_shapes.py --models $models --steps 2 \
          ${TRACE_DIR:+--trace-dir $TRACE_DIR} --max-seconds ${BUDGET:-560} \
          --out $out/model-shapes-${stage#models-}.json 2>&1 | grep -v WARN | tail -30 ;;
    fi-warm) timeout ${BUDGET:-560} python3 benches/fi_warm.py 2>&1 | grep -v WARN | tail -15 ;;
    dropin) timeout $(( ${BUDGET:-560} + 30 )) python3 benches/dropin.py --steps 2 ${TRACE_DIR:+--trace-dir $TRACE_DIR} \
          --max-seconds ${BUDGET:-560} ${DROPIN_ARGS:-} --out $out/dropin.json 2>&1 | grep -v WARN | tail -52 ;;
    shared) timeout $(( ${BUDGET:-560} + 30 )) python3 benches/shared_pages.py ${SHARED_ARGS:-} --max-seconds ${BUDGET:-560} \
          --out $out/shared-pages.json 2>&1 \
          | grep -v WARN | tail -30 ;;
    sharing-traces)
      for spec in "parallel --trace parallel" "sysprompt --trace sysprompt" \
                  ${TRACE_DIR:+"mooncake-conv --trace $TRACE_DIR/mooncake_conv.json --num-requests 200"}; do
        set -- $spec; name=$1; shift
        if [[ $name == mooncake-conv && ! -f ${TRACE_DIR:-}/mooncake_conv.json ]]; then continue; fi
        timeout 180 python3 -m pkvrt bench serving "$@" --max-active 8 --steps-limit 24 --check-steps 2 \
          --engine-layers 32 --seeds 20260623 --out $out/engine-$name-B8${TAG:+-$TAG}.json \
          ${ROUTES:+--routes "$ROUTES"} --engines ${SHARING_ENGINES:-flashinfer,device-plan-step,shared-step,shared-device-step} \
          2>&1 | grep -E "pkvrt-|flashinfer-|Error" | tail -6
      done ;;
    fused-tail)
      mkdir -p $out/fused-tail
      for heads in 64/4 28/4 64/8 32/8; do
        timeout 100 python3 -m pkvrt bench serving --trace bimodal --max-active 8 --steps-limit 16 \
          --check-steps 2 --engine-layers 32 --seeds 20260623 --num-qo-heads ${heads%/*} \
          --num-kv-heads ${heads#*/} --engines flashinfer,device-plan-step,device-plan-step-tail1 \
          --out $out/fused-tail/engine-bimodal-B8-${heads/\//-}.json 2>&1 | grep -E "pkvrt-|flashinfer|Error" | tail -4
      done
      for heads in 64/4 28/4; do
        for m in 0 -1; do
          timeout 60 python3 benches/layer_timeline.py --route pkv_fused --layers 10 --heads $heads \
            --merge-groups-from $m --cases B1-32K,B1-8K,B8-bimodal,B8-one-long \
            --out $out/fused-tail/tl-${heads/\//-}-m$m.json 2>&1 | grep -v "^wrote" | tail -5
        done
      done
      tar -czf $out/fused-tail.tgz -C $out fused-tail && rm -rf $out/fused-tail ;;
    zipf-sweep) timeout 240 python3 benches/isolated.py --cases B8-zipf --partition-sweep --no-sdpa \
          --out $out/isolated-zipf-sweep.json 2>&1 | grep -v WARN | tail -30 ;;
    gemma-waves)
      mkdir -p $out/gemma-waves /tmp/pkvrt-cal-waves2
      cal=$(python3 -c "import torch; from pkvrt.policy.calibration import slugify as s; print(s(torch.cuda.get_device_name()))")
      python3 - calibration/$cal.json /tmp/pkvrt-cal-waves2/$cal.json <<'EOF_W' || continue
import json, sys
doc = json.load(open(sys.argv[1]))
section = doc.get("by_head_dim", {}).get("256")
if section is None:
    sys.exit(f"{sys.argv[1]}: no by_head_dim.256 section (pkvrt calibrate --head-dim 256 first)")
section["splits"]["max_waves"] = 2
json.dump(doc, open(sys.argv[2], "w"), indent=2)
EOF_W
      for w in 3 2; do
        dir=$([ $w = 2 ] && echo /tmp/pkvrt-cal-waves2 || echo calibration)
        PKVRT_CALIBRATION_DIR=$dir timeout $(( ${BUDGET:-240} + 30 )) python3 benches/model_shapes.py \
            --models gemma-2-9b --steps 2 --max-seconds ${BUDGET:-240} \
            --out $out/gemma-waves/model-shapes-gemma-2-waves$w.json 2>&1 | grep -v WARN | tail -8
      done ;;
    ablations) timeout 200 python3 -m pytest benches --benchmark-only -q -p no:cacheprovider --benchmark-json=$out/ablations.json 2>&1 | tail -15 ;;
    *) echo "unknown stage $stage (see the head of benches/h200_run.sh)" ;;
  esac
done
