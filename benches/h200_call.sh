#!/usr/bin/env bash
# Setup shared by this session's device calls: FlashInfer from the carried wheels, the carried
# sm_90 cubins, FlashInfer's JIT cache when one was carried back. Source it, then run stages.
# usage (on the GPU machine, repo root): . benches/h200_call.sh
python3 -m pip install -q --no-index --no-deps --no-compile --target /tmp/site .whl/*.whl || return 1
export PYTHONPATH=/tmp/site:$PWD PYTHONUNBUFFERED=1
if [ -d .carry/cubins ]; then rm -rf pkvrt/_cubins && cp -r .carry/cubins pkvrt/_cubins; fi
if [ -f .carry/fi-cache.tgz ]; then mkdir -p ~/.cache && tar xzf .carry/fi-cache.tgz -C ~/.cache; fi
nvidia-smi --query-gpu=name,driver_version,clocks.sm,clocks.mem --format=csv,noheader
