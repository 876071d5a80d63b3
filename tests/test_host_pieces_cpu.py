"""benches/host_pieces_cpu.py runs without a GPU and prints plan()'s host pieces (a subprocess:
the script patches torch.cuda for the fake device, which must not leak into other tests)."""

import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]


@pytest.mark.parametrize("grow", ["long", "all"])
def test_host_pieces_runs_on_the_cpu_and_names_every_piece(grow):
    out = subprocess.run([sys.executable, str(REPO / "benches" / "host_pieces_cpu.py"), "--rows", "1,8",
                          "--calls", "20", "--grow", grow], capture_output=True, text=True, check=True,
                         cwd=REPO).stdout
    rows = [line.split() for line in out.splitlines()[1:]]
    assert [r[0] for r in rows] == ["1", "8"]
    for r in rows:
        # the bench's premise: the router itself picks a device-planned route on these cases
        assert r[1] in ("pkv_workqueue", "pkv_fused"), f"the cases no longer route to PersistentKV: {r}"
        assert float(r[2]) > 0
        line = " ".join(r)
        assert "check_step" in line and "route decision" in line and "staging" in line
        assert 0 <= float(r[-1]) <= 1000     # full predictions per 1000 calls
