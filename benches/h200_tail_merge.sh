#!/usr/bin/env bash
# The merge in the decode tail (issue 12, item 2) in one device call: the two workqueue kernels'
# SASS opcode counts (f16, D 128, G 4), ncu of one B1 32K launch of each, and the engine
# protocol with device planning running pkv_workqueue (decode + merge launch) and pkv_fused
# (the last CTA of a row and KV head merges) in the same process as FlashInfer.
# usage: bash benches/h200_tail_merge.sh OUT [TRACE_DIR] [OLD_FUSED_CUBIN]
#   STAGES="sass ncu engine g1 fine" (default: all but fine); g1 = bimodal B8 at G = 1 with the
#   tensor-core body (the shipped build) and with the SIMT body (a PKV_TC_MIN_GROUP=4 build);
#   fine = both routes again with every split count 1..64 allowed (routes.toml + two ablation
#   routes *_fine), device planning of all four in one process.
# Writes OUT/tail.tgz (sass/, ncu csv, engine-*.json/log), rewritten after every stage.
set -u
out=$1; traces=${2:-../shared/traces}; old=${3:-}; stages=${STAGES:-sass ncu engine g1}
engines=flashinfer,device-plan-step,device-plan-step:pkv_fused
r=/tmp/tail-r; mkdir -p $r/sass
save() { tar czf $out/tail.tgz -C $r .; }
has() { case " $stages " in *" $1 "*) return 0;; esac; return 1; }
if has sass; then
for fam in workqueue_decode fused_decode; do
  cuobjdump -sass -fun pkv_${fam}_f16_d128_g4 pkvrt/_cubins/$fam.sm_90.cubin > $r/sass/$fam.sass
done
[ -n "$old" ] && cuobjdump -sass -fun pkv_fused_decode_f16_d128_g4 $old > $r/sass/fused_old.sass
python3 - $r/sass <<'PY'
import collections, pathlib, re, sys
d = pathlib.Path(sys.argv[1]); rows = {}
for f in sorted(d.glob("*.sass")):
    c = collections.Counter(m.group(1) for m in re.finditer(r"/\*[0-9a-f]{4,}\*/\s+(?:@!?U?P\w+\s+)?([A-Z][A-Z0-9_.]*)", f.read_text()))
    rows[f.stem] = c
ops = sorted(set().union(*rows.values()), key=lambda o: -max(r[o] for r in rows.values()))
lines = ["op " + " ".join(rows)] + [f"{o} " + " ".join(str(rows[k][o]) for k in rows) for o in ops]
(d / "opcounts.txt").write_text("\n".join(lines) + "\n")
print("\n".join(l for l in lines[:1] + [l for l in lines[1:] if len(set(l.split()[1:])) > 1][:40]))
PY
save
fi
if has ncu; then
m=gpu__time_duration.sum,dram__bytes_read.sum,lts__t_sectors_srcunit_tex_op_read.sum,\
lts__t_sectors_srcunit_tex_op_read_lookup_hit.sum,l1tex__t_sectors_pipe_lsu_mem_global_op_ld.sum,\
smsp__inst_executed_op_ldgsts.sum,smsp__inst_executed.sum,launch__registers_per_thread,\
l1tex__data_bank_conflicts_pipe_lsu_mem_shared.sum,sm__warps_active.avg.pct_of_peak_sustained_active
timeout 120 ncu --profile-from-start off --clock-control none --csv --page raw --metrics "$m" \
  --log-file $r/ncu-b1-32k.csv python3 benches/ncu_workload.py --lens 32768 --bucket-splits 16
echo "ncu rc=$?"
python3 - $r/ncu-b1-32k.csv <<'PY'
import csv, sys
lines = open(sys.argv[1]).read().splitlines()
i = next(k for k, l in enumerate(lines) if l.startswith('"ID"'))
rows = list(csv.reader(lines[i:])); hdr = rows[0]
for r in rows[2:]:
    d = dict(zip(hdr, r)); print(d["Kernel Name"][:34].ljust(34), "  ".join(
        f"{k.split('__')[1][:22]}={d[k]}" for k in hdr if "__" in k and k.endswith((".sum", ".pct", "thread", "active"))))
PY
save
fi
serve() {  # name B seeds extra-args...
  local name=$1 b=$2 seeds=$3; shift 3
  echo "== $name B$b ($(date +%T))"
  timeout 150 python3 -m pkvrt bench serving --max-active $b --steps-limit 16 --check-steps 2 \
    --engine-layers 32 --engines $engines \
    --seeds $seeds "$@" --out $r/engine-$name-B$b.json > $r/engine-$name-B$b.log 2>&1
  echo "   rc=$?"; grep -E "^ *(pkvrt-|flashinfer)|Error|error" $r/engine-$name-B$b.log | grep -v "^  baseline" | tail -6
  save
}
if has engine; then
serve bucketed 1 20260623-20260624 --trace bucketed
serve bimodal 4 20260623 --trace bimodal
serve bimodal 8 20260623-20260624 --trace bimodal
serve azure-conv 8 20260623 --trace $traces/azure2023_conv.csv --steps-limit 32
serve gqa-G8 8 20260623 --trace bimodal --num-kv-heads 4
serve uniform 8 20260623 --trace uniform
fi
if has g1; then
serve gqa-G1-tc 8 20260623 --trace bimodal --num-kv-heads 32
PKVRT_CUDA_ARCHS=sm_90 PKVRT_TUNE=PKV_TC_MIN_GROUP=4 python3 -m pkvrt._build /tmp/cubins-simt > /dev/null
PKVRT_CUBIN_DIR=/tmp/cubins-simt serve gqa-G1-simt 8 20260623 --trace bimodal --num-kv-heads 32
fi
if has fine; then
python3 - <<'PY'
base = open("routes.toml").read()
extra = "".join(f"""
[routes.{name}_fine]
kind = "{kind}"
kernel = "{kind}_decode"
ablation = true

[routes.{name}_fine.splits]
min = 1
max = 64
multiple_of = 1
""" for name, kind in (("pkv_workqueue", "workqueue"), ("pkv_fused", "fused")))
open("/tmp/routes-fine.toml", "w").write(base + extra)
PY
engines=$engines,device-plan-step:pkv_workqueue_fine,device-plan-step:pkv_fused_fine
serve fine-gqa-G1 8 20260623 --trace bimodal --num-kv-heads 32 --routes /tmp/routes-fine.toml
serve fine-bimodal 8 20260623-20260624 --trace bimodal --routes /tmp/routes-fine.toml
serve fine-bucketed 1 20260623 --trace bucketed --routes /tmp/routes-fine.toml
serve fine-bimodal 4 20260623 --trace bimodal --routes /tmp/routes-fine.toml
serve fine-uniform 8 20260623 --trace uniform --routes /tmp/routes-fine.toml
serve fine-azure-conv 8 20260623 --trace $traces/azure2023_conv.csv --steps-limit 32 --routes /tmp/routes-fine.toml
serve fine-gqa-G8 8 20260623 --trace bimodal --num-kv-heads 4 --routes /tmp/routes-fine.toml
fi
