#!/usr/bin/env bash
# The whole GPU suite in one GPU-machine call: every test marked `gpu` (tests/ and benches/; the
# pytest-benchmark ablations run once, untimed), on the kernels of this checkout.
#
# usage: [PKVRT_SUITE_PART=both|serial|parallel] bash benches/gpu_suite.sh OUT [PYTEST ARGS...]
#   e.g. `-n 6 --timeout 240` (pytest-xdist, pytest-timeout): six test processes share the GPU, so
#   FlashInfer's JIT builds (about 40 s a module on a fresh machine) overlap the kernel tests; no
#   test in tests/ times anything, so sharing the GPU changes no result
#   OUT/gpu-suite.log   the header (commit, GPU, driver, versions, date) and pytest's whole output
#                       (OUT/gpu-suite-serial.log or -parallel.log for PKVRT_SUITE_PART's part alone);
#                       commit it as benches/results/h200/logs/gpu-suite.log with the commit it ran on
#   exit status         pytest's
#
# Before it: FlashInfer importable (without it the FlashInfer tests skip, naming why), and the
# cubins built for this GPU: `pip install -e .` builds them; on a machine without a build, set
# PKVRT_CUBINS=DIR to a directory built elsewhere with `PKVRT_CUDA_ARCHS=sm_90 python
# pkvrt/_build.py DIR` (it is copied to pkvrt/_cubins). The commit recorded is
# PKVRT_SOURCE_COMMIT when set (a copied work tree may carry stale git metadata), else git's HEAD.
set -uo pipefail
out=${1:?usage: bash benches/gpu_suite.sh OUT [PYTEST ARGS...]}
shift
part=${PKVRT_SUITE_PART:-both}
case $part in both|serial|parallel) ;; *) echo "gpu_suite: PKVRT_SUITE_PART=$part: expected both, serial or parallel" >&2; exit 2 ;; esac
cd "$(dirname "$0")/.."
mkdir -p "$out"
log=$out/gpu-suite.log
[ "$part" = both ] || log=$out/gpu-suite-$part.log   # a part run alone keeps the other's log

if [ -n "${PKVRT_CUBINS:-}" ]; then
  mkdir -p pkvrt/_cubins && cp -r "$PKVRT_CUBINS"/. pkvrt/_cubins/ || exit 1
fi
if ! python3 -c 'import torch, sys; sys.exit(0 if torch.cuda.is_available() else 1)'; then
  echo "gpu_suite: no CUDA GPU visible to torch: nothing to run" >&2
  exit 1
fi
# cubins built from other kernel sources than this tree's would fail every GPU test one by one
if ! python3 -c 'import sys; from pkvrt.launch.manifest import load_manifest, stale_images
bad = stale_images(load_manifest()); bad and print(bad[0][1], file=sys.stderr); sys.exit(1 if bad else 0)'; then
  echo "gpu_suite: the cubins are not built from this tree's kernels: nothing run" >&2
  exit 1
fi

commit=${PKVRT_SOURCE_COMMIT:-$(git rev-parse --short HEAD 2>/dev/null || echo unknown)$(git diff --quiet HEAD 2>/dev/null || echo ' (uncommitted changes)')}
{
  case $part in
    both) echo "# pkvrt GPU suite: python3 -m pytest -m 'gpu and not serial' tests benches $*; then -m 'gpu and serial' alone" ;;
    parallel) echo "# pkvrt GPU suite, its parallel part: python3 -m pytest -m 'gpu and not serial' tests benches $*" ;;
    serial) echo "# pkvrt GPU suite, its serial part: python3 -m pytest -m 'gpu and serial' tests benches (without -n)" ;;
  esac
  echo "commit:     $commit"
  echo "date:       $(date -u +%Y-%m-%dT%H:%M:%SZ)"
  echo "gpu:        $(nvidia-smi --query-gpu=name,driver_version --format=csv,noheader 2>/dev/null | head -1)"
  python3 - <<'EOF' 2>&1
import sys, torch
print(f"python:     {sys.version.split()[0]}; torch {torch.__version__} (CUDA {torch.version.cuda})")
try:
    import flashinfer
    print(f"flashinfer: {flashinfer.__version__}")
except Exception as exc:  # the FlashInfer tests skip, naming this
    print(f"flashinfer: unavailable ({type(exc).__name__}: {exc})")
EOF
  echo
} > "$log"

# Two runs: every gpu test not marked serial (with the caller's arguments, -n N included), then
# the serial ones alone (they measure time or need most of the GPU's memory), without -n.
# PKVRT_SUITE_PART=serial runs the second alone (a call whose limit cut it), =parallel the first.
alone=()
skip_next=0
for a in "$@"; do
  if [ $skip_next = 1 ]; then skip_next=0; continue; fi
  case $a in -n) skip_next=1 ;; -n*|--numprocesses*|--dist*) ;; *) alone+=("$a") ;; esac
done
rc=0
if [ "$part" != serial ]; then
  PYTHONUNBUFFERED=1 python3 -m pytest -m "gpu and not serial" tests benches -q -p no:cacheprovider -rfEs \
    --benchmark-disable "$@" 2>&1 | tee -a "$log"
  rc=${PIPESTATUS[0]}
fi
if [ "$part" != parallel ]; then
  echo "== serial: the tests that run alone" | tee -a "$log"
  PYTHONUNBUFFERED=1 python3 -m pytest -m "gpu and serial" tests benches -q -p no:cacheprovider -rfEs \
    --benchmark-disable "${alone[@]}" 2>&1 | tee -a "$log"
  rc2=${PIPESTATUS[0]}
  [ "$rc" = 0 ] && rc=$rc2
fi
echo "gpu_suite: pytest exit status $rc; log $log"
exit "$rc"
