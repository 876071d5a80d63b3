#!/usr/bin/env bash
# Setup shared by this session's device calls: FlashInfer from the carried wheels, the carried
# sm_90 cubins (a directory, or cubins.txz: `tar cJf .carry/cubins.txz -C DIR .` of the output of
# `PKVRT_CUDA_ARCHS=sm_90 python pkvrt/_build.py DIR`: 1 MB instead of 14), FlashInfer's JIT
# cache when one was carried back (.carry/fi-cache.txz of ~/.cache: 2.4 MB for 0.7.2). Source it.
# The device tool's 64 MiB limit covers the checkout, the wheels and .carry: after
# wheelhouse-fi07.sh, `python benches/slim_fi_wheel.py DIR/flashinfer_python-*.whl` drops
# FlashInfer's CUTLASS headers (unused by the decode paths; 31.5 -> 25.1 MB) so that the JIT
# cache fits beside it (session 21).
# usage (on the GPU machine, repo root): [WHL=.whl07] . benches/h200_call.sh
# WHL: the carried wheel directory (default .whl: FlashInfer 0.5.3; ../shared/gpu/wheelhouse-fi07.sh
# makes a 0.7.2 set)
python3 -m pip install -q --no-index --no-deps --no-compile --target /tmp/site ${WHL:-.whl}/*.whl || return 1
export PYTHONPATH=/tmp/site:$PWD PYTHONUNBUFFERED=1
if [ -d .carry/cubins ]; then rm -rf pkvrt/_cubins && cp -r .carry/cubins pkvrt/_cubins; fi
for t in .carry/cubins.t?z; do [ -f $t ] && rm -rf pkvrt/_cubins && mkdir -p pkvrt/_cubins && tar xf $t -C pkvrt/_cubins; done
for t in .carry/fi-cache.t?z; do [ -f $t ] && mkdir -p ~/.cache && tar xf $t -C ~/.cache; done
nvidia-smi --query-gpu=name,driver_version,clocks.sm,clocks.mem --format=csv,noheader
