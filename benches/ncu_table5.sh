#!/usr/bin/env bash
# Table 5 (hardware counters) on the GPU: Nsight Compute over one decode step of every engine
# (benches/ncu_workload.py), clocks left alone (METHOD.md), then the CSV -> a results JSON.
# usage: bash benches/ncu_table5.sh OUT [CASE [WORKLOAD ARGS...]]
#   default CASE b8-bimodal (the seed's Table 5 batch) -> OUT/ncu-b8-bimodal.{csv,json}
#   e.g.    bash benches/ncu_table5.sh OUT b1-32k --lens 32768 --bucket-splits 16
set -u
out=$1; case=${2:-b8-bimodal}; shift; [ $# -gt 0 ] && shift
mkdir -p "$out"
metrics=gpu__time_duration.sum,dram__throughput.avg.pct_of_peak_sustained_elapsed,dram__bytes_read.sum,\
lts__t_sector_hit_rate.pct,sm__warps_active.avg.pct_of_peak_sustained_active,\
sm__throughput.avg.pct_of_peak_sustained_elapsed,launch__grid_size,launch__registers_per_thread
timeout 150 ncu --profile-from-start off --clock-control none --csv --page raw --metrics "$metrics" \
  --log-file "$out/ncu-$case.csv" python3 benches/ncu_workload.py "$@"
echo "ncu rc=$?"
python3 benches/ncu_table5.py "$out/ncu-$case.csv" --case "$case" --out "$out/ncu-$case.json"
