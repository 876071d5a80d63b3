#!/usr/bin/env bash
# Setup shared by this session's device calls: FlashInfer from the carried wheels, the carried
# sm_90 cubins (a directory, or cubins.tgz: `tar czf .carry/cubins.tgz -C DIR .` of the output of
# `PKVRT_CUDA_ARCHS=sm_90 python pkvrt/_build.py DIR`: a quarter of the size), FlashInfer's JIT
# cache when one was carried back (.carry/fi-cache.tgz of ~/.cache). Source it, then run stages.
# usage (on the GPU machine, repo root): [WHL=.whl07] . benches/h200_call.sh
# WHL: the carried wheel directory (default .whl: FlashInfer 0.5.3; ../shared/gpu/wheelhouse-fi07.sh
# makes a 0.7.2 set)
python3 -m pip install -q --no-index --no-deps --no-compile --target /tmp/site ${WHL:-.whl}/*.whl || return 1
export PYTHONPATH=/tmp/site:$PWD PYTHONUNBUFFERED=1
if [ -d .carry/cubins ]; then rm -rf pkvrt/_cubins && cp -r .carry/cubins pkvrt/_cubins; fi
if [ -f .carry/cubins.tgz ]; then rm -rf pkvrt/_cubins && mkdir -p pkvrt/_cubins && tar xzf .carry/cubins.tgz -C pkvrt/_cubins; fi
if [ -f .carry/fi-cache.tgz ]; then mkdir -p ~/.cache && tar xzf .carry/fi-cache.tgz -C ~/.cache; fi
nvidia-smi --query-gpu=name,driver_version,clocks.sm,clocks.mem --format=csv,noheader
