"""SharedPagesRuntime(device_planning=True).plan() run eagerly, three times with the device rule
and three times with every chunk kept, on one sharing step of benches/shared_pages.py, for
Nsight Compute to time find_shared and the two planning kernels each plan() launches.

usage: ncu --clock-control none --metrics gpu__time_duration.sum -k regex:"find_shared|plan_workqueue" \\
           python benches/profile_plan_sharing.py "8x(8K+512)"
(committed run: benches/results/h100/plan-cost/find-shared-chains/ncu-durations.txt)
"""

from __future__ import annotations

import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
import shared_pages as sp  # noqa: E402

import pkvrt  # noqa: E402


def main(argv=None) -> int:
    args = sys.argv[1:] if argv is None else argv
    if len(args) != 1 or args[0] not in sp.CASES:
        print(f"usage: python benches/profile_plan_sharing.py CASE (one of {', '.join(sp.CASES)})",
              file=sys.stderr)
        return 2
    if not torch.cuda.is_available():
        print("benches/profile_plan_sharing.py needs a CUDA GPU (torch sees none); nothing to run here.")
        return 0
    sp.LAYERS = 2   # the step's caches only; plan() reads the block tables alone
    groups, own = sp.CASES[args[0]]
    st = sp.Step(groups, own, torch.Generator().manual_seed(1))
    for always in (False, True):
        rt = pkvrt.SharedPagesRuntime(
            sp.H_Q, sp.H_KV, sp.D, sp.PAGE, torch.float16, max_batch=max(8, len(st.seq)),
            max_pages_per_row=st.bt.shape[1], num_pages=st.num_pages, device_planning=True,
            options=pkvrt.RuntimeOptions(use_cuda_graph=False, shared_when_predicted_faster=not always))
        for _ in range(3):
            rt.plan(st.seq_d, st.bt_d)
        torch.cuda.synchronize()
        found = rt.found()
        print(args[0], "every chunk kept" if always else "the device rule", "|",
              "no chunk found" if found is None else f"{found.tokens_saved} tokens saved, "
              f"decision {found.decision}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
