#!/usr/bin/env bash
# The benches on a GPU machine without a package index or nvcc's time to spare: pack what it
# needs on a machine with both, carry the folder there (beside the checkout), run.
#
# usage: bash benches/offline_gpu.sh pack DIR [ARCH]
#          here (internet, nvcc): DIR/wheels (FlashInfer 0.7.2.post1 with its sources trimmed to the
#          decode paths and without CUTLASS (CUTLASS=1 keeps its headers, ~3.7 MB, which
#          FlashInfer's Hopper prefill and so its cascade wrapper compile against), its tvm-ffi,
#          the cuDNN frontend only with CUDNN=1,
#          pytest and the plugins the GPU suite uses, for Python 3.12 x86-64) and DIR/cubins.txz
#          (kernels/*.cu for ARCH, default sm_90). About 30 MB (41 with the cuDNN frontend).
#        bash benches/offline_gpu.sh run DIR OUT STAGE [STAGE ...]
#          there, from the checkout: the wheels into a private site folder, the cubins into
#          pkvrt/_cubins, FlashInfer's JIT cache from DIR/fi-jit.tgz when present; then each
#          STAGE: `suite` (benches/gpu_suite.sh OUT/suite, -n 4 --timeout 300, within SUITE_LIMIT
#          seconds, default 460; on a fresh machine its parallel part alone takes ~280 s, and
#          PKVRT_SUITE_PART=serial runs the part a limit cut) or any stage of benches/h200_run.sh. The JIT cache comes back as OUT/fi-jit.tgz when it grew
#          (carry it as DIR/fi-jit.tgz next time: FlashInfer compiles each module ~40 s; the 13
#          model shapes' modules make ~44 MB, over the device tool's 16 MiB a file and, beside
#          the wheels, its 64 MiB carry: there, stage fi-warm builds them again in ~4 minutes).
#          PKVRT_SOURCE_COMMIT: the commit the results record (a copied checkout's git
#          metadata can be stale). H200_ONLY=1: run nothing unless the GPU is an H200.
set -uo pipefail
cmd=${1:?usage: offline_gpu.sh pack DIR [ARCH] | run DIR OUT STAGE...}
dir=${2:?usage: offline_gpu.sh pack DIR [ARCH] | run DIR OUT STAGE...}
repo=$(cd "$(dirname "$0")/.." && pwd)

case $cmd in
  pack)
    set -e
    arch=${3:-sm_90}
    mkdir -p "$dir/wheels"
    plat=(--platform manylinux_2_28_x86_64 --platform manylinux_2_27_x86_64 --platform manylinux_2_24_x86_64
          --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64)
    get() { python3 -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 \
              --implementation cp "${plat[@]}" -d "$dir/wheels" "$@"; }
    rm -f "$dir"/wheels/flashinfer_python-*.whl   # trimmed in place below: fetch it whole each time
    get flashinfer-python==0.7.2.post1 apache-tvm-ffi==0.1.15.post2 pytest pluggy iniconfig \
        packaging pytest-xdist execnet pytest-timeout pytest-benchmark py-cpuinfo
    if [ "${CUDNN:-0}" = 1 ]; then get nvidia-cudnn-frontend==1.32.0; fi
    whl=$(ls "$dir"/wheels/flashinfer_python-*.whl)
    # the decode paths JIT-compile only the top-level sources and csrc/xqa; CUTLASS is read by none
    # of them (its headers by FlashInfer's Hopper prefill: CUTLASS=1)
    python3 - "$whl" "${CUTLASS:-0}" <<'EOF'
import os, sys, zipfile
path, headers = sys.argv[1], sys.argv[2] == "1"
cutlass_kept = ("flashinfer/data/cutlass/include/", "flashinfer/data/cutlass/tools/util/include/")
keep = lambda n: not ((n.startswith("flashinfer/data/cutlass/")
                       and not (headers and n.startswith(cutlass_kept)))
                      or (n.startswith("flashinfer/data/csrc/") and n.count("/") > 3
                          and not n.startswith("flashinfer/data/csrc/xqa/")))
with zipfile.ZipFile(path) as z:
    items = [(i, z.read(i)) for i in z.infolist() if keep(i.filename)]
tmp = path + ".tmp"
with zipfile.ZipFile(tmp, "w", zipfile.ZIP_DEFLATED) as z:
    for info, data in items:
        z.writestr(info, data)
os.replace(tmp, path)
EOF
    build=$(mktemp -d)
    PKVRT_CUDA_ARCHS=$arch python3 "$repo/pkvrt/_build.py" "$build" > "$build.log" 2>&1 \
      || { tail -20 "$build.log"; exit 1; }
    tar -cJf "$dir/cubins.txz" -C "$build" .
    rm -rf "$build" "$build.log"
    du -sh "$dir"/wheels "$dir"/cubins.txz
    ;;
  run)
    out=${3:?usage: offline_gpu.sh run DIR OUT STAGE...}
    shift 3
    cd "$repo"
    gpu=$(nvidia-smi --query-gpu=name --format=csv,noheader 2>/dev/null | head -1)
    echo "GPU: ${gpu:-none}"
    if [ -n "${H200_ONLY:-}" ] && [[ $gpu != *H200* ]]; then echo "not an H200: nothing run"; exit 0; fi
    site=${TMPDIR:-/tmp}/pkvrt-site
    python3 -m pip install -q --no-index --no-deps --no-compile --target "$site" "$dir"/wheels/*.whl 2>&1 \
      | grep -vi warn | tail -3
    export PYTHONPATH=$site:$repo PYTHONUNBUFFERED=1
    export FLASHINFER_WORKSPACE_BASE=${FLASHINFER_WORKSPACE_BASE:-${TMPDIR:-/tmp}/pkvrt-fi}
    mkdir -p "$FLASHINFER_WORKSPACE_BASE" pkvrt/_cubins "$out"
    tar -xJf "$dir/cubins.txz" -C pkvrt/_cubins
    if [ -f "$dir/fi-jit.tgz" ]; then tar -xzf "$dir/fi-jit.tgz" -C "$FLASHINFER_WORKSPACE_BASE"; fi
    stamp=$(mktemp)
    for stage in "$@"; do
      case $stage in
        suite) timeout "${SUITE_LIMIT:-460}" bash benches/gpu_suite.sh "$out/suite" -n 4 --timeout 300 2>&1 \
                 | grep -E "passed|failed|FAILED|ERROR" | tail -30 ;;
        *) bash benches/h200_run.sh "$out" "$stage" ;;
      esac
    done
    if [ -n "$(find "$FLASHINFER_WORKSPACE_BASE" -newer "$stamp" -name '*.so' 2>/dev/null | head -1)" ]; then
      tar -czf "$out/fi-jit.tgz" -C "$FLASHINFER_WORKSPACE_BASE" . && ls -la "$out/fi-jit.tgz"
    fi
    rm -f "$stamp"
    ;;
  *) echo "offline_gpu.sh: unknown command $cmd (pack or run)" >&2; exit 2 ;;
esac
