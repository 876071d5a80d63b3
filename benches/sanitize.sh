#!/usr/bin/env bash
# Every kernel family under compute-sanitizer, in one device call.
# usage: bash benches/sanitize.sh OUT
#
# Runs benches/sanitize_workload.py once plainly (baseline: its time and mismatches with no tool),
# then under memcheck, initcheck, synccheck and racecheck (--quick: racecheck is the slowest),
# each under `timeout` (limits below: the five runs sum to under 8 minutes). Writes the full output
# of each run to OUT/sanitize-<tool>.log and a summary to OUT/sanitize.json, prints a table.
#   rc per run: 0 clean; 3 the tool reported errors (--error-exitcode 3); 1 the workload's
#   outputs mismatched the FP32 reference; 2 no GPU; 124 (137) timed out (killed).
# memcheck and initcheck run with PYTORCH_NO_CUDA_MEMORY_CACHING=1: every tensor is its own
# cudaMalloc, so memcheck flags an access just past a tensor (inside a caching-allocator segment
# it would be a valid address) and initcheck flags a read of memory nothing wrote; initcheck
# also runs the workload with --poison none (outputs and partial states left as torch.empty).
# The commit recorded is PKVRT_SOURCE_COMMIT when set (a device checkout's git metadata can be
# stale), else git's.
# Env: SANITIZE_TOOLS (default "plain memcheck initcheck synccheck racecheck"),
#      SANITIZE_CACHING=1 (keep the caching allocator), SANITIZE_FLAGS (more flags for every
#      tool, e.g. "--report-api-errors no" should torch's own API errors flood memcheck: every
#      pkvrt driver error already raises, and the workload counts it), COMPUTE_SANITIZER.
set -u
out=${1:?usage: bash benches/sanitize.sh OUT}
mkdir -p "$out" && out=$(cd "$out" && pwd)
cd "$(dirname "$0")/.."
export PYTHONUNBUFFERED=1
declare -A LIMIT=([plain]=60 [memcheck]=110 [initcheck]=90 [synccheck]=60 [racecheck]=150)
declare -A WORKLOAD_ARGS=([plain]="" [memcheck]="" [initcheck]="--poison none" [synccheck]=""
                          [racecheck]="")
tools=${SANITIZE_TOOLS:-plain memcheck initcheck synccheck racecheck}

# The sanitizer ships with the CUDA toolkit, next to nvcc.
san=${COMPUTE_SANITIZER:-$(command -v compute-sanitizer)}
nvcc=${PKVRT_NVCC:-$(command -v nvcc)}
for c in ${CUDA_HOME:+$CUDA_HOME/bin/compute-sanitizer} ${nvcc:+$(dirname "$nvcc")/compute-sanitizer} \
         /usr/local/cuda/bin/compute-sanitizer /usr/local/cuda-*/bin/compute-sanitizer; do
  [ -z "$san" ] && [ -x "$c" ] && san=$c
done
help=$([ -n "$san" ] && "$san" --help 2>&1)
# Options passed as --opt=value, and only when --help lists them with a value (a bare switch
# would reject "=no"; "--opt no" could be taken for the program to run).
takes_value() { grep -Eq -- "--$1[ =]+(arg|<|\{|\[|yes|no)" <<<"$help"; }
common="--error-exitcode 3 --print-limit 20${SANITIZE_FLAGS:+ $SANITIZE_FLAGS}"
# A workload mismatch exits 1 and is counted from its own summary line, not as a tool error
# (without this option the tool counts the non-zero exit as one error and exits 3).
takes_value check-exit-code && common+=" --check-exit-code=no"
# cuda-python probes driver entry points with cuGetProcAddress and gets CUDA_ERROR_INVALID_VALUE
# for versions this driver lacks (seen on the H200, 2026-11-29: 20 such reports, no kernel
# error): API-error reports are off; every pkvrt driver call is checked and raises anyway.
takes_value report-api-errors && common+=" --report-api-errors=no"
declare -A TOOL_FLAGS=([memcheck]="" [initcheck]="" [synccheck]="" [racecheck]="")
# Unused-memory reports (allocations never fully touched, e.g. capacity-sized buffers) are not
# findings here; off by default, said explicitly where the option exists.
takes_value track-unused-memory && TOOL_FLAGS[initcheck]="--track-unused-memory=no"

: >"$out/.sanitize-runs"
for tool in $tools; do
  log=$out/sanitize-$tool.log
  env=()
  if [ "$tool" = plain ]; then
    cmd=(python3 benches/sanitize_workload.py ${WORKLOAD_ARGS[$tool]})
  elif [ -z "$san" ]; then
    echo "compute-sanitizer not found (PATH, CUDA_HOME, next to nvcc, /usr/local/cuda*)" >"$log"
    echo "$tool - 0 ${LIMIT[$tool]} -" >>"$out/.sanitize-runs"
    continue
  else
    case $tool in memcheck|initcheck) [ "${SANITIZE_CACHING:-0}" = 1 ] || env=(PYTORCH_NO_CUDA_MEMORY_CACHING=1) ;; esac
    cmd=("$san" --tool "$tool" $common ${TOOL_FLAGS[$tool]} python3 benches/sanitize_workload.py ${WORKLOAD_ARGS[$tool]})
  fi
  shown="${env[*]:+${env[*]} }${cmd[*]}"
  echo "== $tool ($(date +%T), limit ${LIMIT[$tool]} s): $shown"
  echo "+ $shown" >"$log"
  t0=$(date +%s.%N)
  env "${env[@]}" timeout -k 10 "${LIMIT[$tool]}" "${cmd[@]}" >>"$log" 2>&1
  rc=$?
  t1=$(date +%s.%N)
  echo "$tool $rc $(awk "BEGIN { print $t1 - $t0 }") ${LIMIT[$tool]} ${env[*]:-}" >>"$out/.sanitize-runs"
  grep -E "^sanitize_workload: [0-9]+ cases|SUMMARY:" "$log" | sed 's/^/   /'
done

SAN="$san" SAN_VERSION="$([ -n "$san" ] && { "$san" --version 2>&1 | grep -m1 -i version || "$san" --version 2>&1 | head -1; })" \
GPU="$(nvidia-smi --query-gpu=name,driver_version --format=csv,noheader 2>/dev/null | head -1)" \
COMMIT="${PKVRT_SOURCE_COMMIT:-$(git rev-parse HEAD 2>/dev/null || echo unknown)$(git diff --quiet HEAD 2>/dev/null || echo ' (dirty)')}" \
COMMON="$common" INITCHECK_FLAGS="${TOOL_FLAGS[initcheck]}" python3 - "$out" <<'EOF'
import json, os, re, sys
from pathlib import Path

out = Path(sys.argv[1])
tools = {}
for line in (out / ".sanitize-runs").read_text().splitlines():
    tool, rc, secs, limit, *env = line.split()
    log = (out / f"sanitize-{tool}.log").read_text(errors="replace")
    # "ERROR SUMMARY: N errors"; racecheck may instead say "RACECHECK SUMMARY: .. (N errors, ..".
    errors = re.findall(r"ERROR SUMMARY: (\d+) error", log) or re.findall(r"RACECHECK SUMMARY: .*?\((\d+) error", log)
    summary = re.findall(r"^sanitize_workload: \d+ cases.*$", log, re.M)
    rc = None if rc == "-" else int(rc)
    tools[tool] = dict(rc=rc, errors=int(errors[-1]) if errors else None,
                       wall_s=round(float(secs), 1), limit_s=int(limit), timed_out=rc in (124, 137),
                       workload=summary[-1] if summary else None, env=" ".join(env) or None,
                       tool_summaries=re.findall(r"^=+ (\w+ SUMMARY: .*)$", log, re.M),
                       command=log.splitlines()[0][2:] if log.startswith("+ ") else None,
                       log=f"sanitize-{tool}.log")
meta = dict(gpu=os.environ["GPU"] or None, compute_sanitizer=os.environ["SAN"] or None,
            compute_sanitizer_version=os.environ["SAN_VERSION"] or None, commit=os.environ["COMMIT"],
            common_flags=os.environ["COMMON"], initcheck_flags=os.environ["INITCHECK_FLAGS"] or None)
(out / "sanitize.json").write_text(json.dumps(dict(meta=meta, tools=tools), indent=2) + "\n")
print(f"\n{meta['gpu']}; {meta['compute_sanitizer_version']}; commit {meta['commit']}")
print(f"{'tool':<10} {'rc':>4} {'errors':>6} {'wall s':>7}  workload")
for tool, r in tools.items():
    print(f"{tool:<10} {'-' if r['rc'] is None else r['rc']:>4} {'-' if r['errors'] is None else r['errors']:>6} "
          f"{r['wall_s']:>7}  {r['workload'] or ('timed out' if r['timed_out'] else 'no summary line')}")
print(f"-> {out / 'sanitize.json'}")
sys.exit(0 if all(r["rc"] == 0 for r in tools.values()) else 1)
EOF
rc=$?
rm -f "$out/.sanitize-runs"
exit $rc
