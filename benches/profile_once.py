"""Run one isolated case once per engine (eagerly) so that `ncu` can capture its kernels.

usage: ncu --clock-control none -k regex:"pkv_|Prefill|Decode" python benches/profile_once.py B8-32K 8
"""
import sys

import torch

import isolated

name, splits = sys.argv[1], int(sys.argv[2])
lens, hq, hkv = isolated.CASES[name]
case = isolated.Case(name, lens, hq, hkv)
case.copies, case.batches = 1, case.batches[:1]
fns = [isolated.engine_split(case, splits)[0], isolated.engine_flashinfer(case, True)[0]]
for fn in fns:
    fn()
    torch.cuda.synchronize()
