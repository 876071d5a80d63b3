#!/usr/bin/env bash
# Table 5 (hardware counters) on the GPU: Nsight Compute over one B8 bimodal step of every engine
# (benches/ncu_workload.py), clocks left alone (METHOD.md), then the CSV -> a results JSON.
# usage: bash benches/ncu_table5.sh OUT    -> OUT/ncu-b8-bimodal.{csv,json}
set -u
out=$1; mkdir -p "$out"
metrics=gpu__time_duration.sum,dram__throughput.avg.pct_of_peak_sustained_elapsed,dram__bytes_read.sum,\
lts__t_sector_hit_rate.pct,sm__warps_active.avg.pct_of_peak_sustained_active,\
sm__throughput.avg.pct_of_peak_sustained_elapsed,launch__grid_size,launch__registers_per_thread
timeout 150 ncu --profile-from-start off --clock-control none --csv --page raw --metrics "$metrics" \
  --log-file "$out/ncu-b8-bimodal.csv" python3 benches/ncu_workload.py
echo "ncu rc=$?"
python3 benches/ncu_table5.py "$out/ncu-b8-bimodal.csv" --out "$out/ncu-b8-bimodal.json"
