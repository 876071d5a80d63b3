"""What a new user hit on the command line (c6de32f, 2026-12-01): `pkvrt bench` without a mode,
argument errors that name their flag once, a closed stdout, one-line warnings, shapes the Runtime
refuses, the progress bar on a terminal, and the benches on a machine without a GPU."""

from __future__ import annotations

import importlib.util
import io
import pathlib
import subprocess
import sys
import warnings

import pytest
import torch

from pkvrt import _buildspec
from pkvrt.measure import harness
from pkvrt.tools import cli

REPO = pathlib.Path(__file__).resolve().parents[1]


def run(capsys, *argv):
    rc = cli.main(list(argv))
    out, err = capsys.readouterr()
    return rc, out, err


def error_line(err: str) -> str:
    """The last line of stderr: argparse's ``prog: error: ...`` or pkvrt's ``pkvrt: error: ...``."""
    return err.strip().splitlines()[-1]


@pytest.fixture
def no_cuda(monkeypatch):
    """Behave as a machine without CUDA even where one exists."""
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)


# --------------------------------------------------------------------------- 1. bench, no MODE

@pytest.mark.parametrize("lead", [[], ["--traceback"]])
def test_bench_options_without_a_mode_mean_serving(capsys, no_cuda, lead):
    rc, out, err = run(capsys, *lead, "bench", "--trace", "zipf", "--seeds", "5",
                       "--max-active", "4", "--num-requests", "4")
    assert rc == 0, err
    assert "no CUDA GPU here" in out
    assert "Summary (max_active 4)" in out
    assert any(line.split()[:2] == ["zipf", "5"] for line in out.splitlines())


def test_bench_help_says_serving_is_the_default(capsys):
    rc, out, _ = run(capsys, "bench", "--help")     # serving's help: its options, both modes
    assert rc == 0
    text = " ".join(out.split())
    assert out.startswith("usage: pkvrt bench serving")
    assert "``pkvrt bench --trace zipf`` is ``pkvrt bench serving --trace zipf``" in text
    assert "Without a MODE (no arguments, or an option first) it is ``serving``" in text
    assert "``pkvrt bench isolated -- [ARGS]`` runs benches/isolated.py" in text


def test_bench_mode_words_still_work(capsys, no_cuda):
    rc, _, err = run(capsys, "bench", "isolated")
    assert rc == 2 and "no CUDA GPU here" in err


# --------------------------------------------------------------------------- 2, 3. flags, once

def test_plan_seed_must_be_non_negative(capsys):
    rc, out, err = run(capsys, "plan", "--seed", "-1")
    assert rc == 2 and out == ""
    assert error_line(err) == ("pkvrt plan: error: argument --seed: -1: expected a non-negative "
                               "integer")


@pytest.mark.parametrize("seeds, message", [
    ("abc", "'abc' is not an integer or a range A-B"),
    ("9-3", "range '9-3' is empty (expected A <= B)"),
    ("1-100000000", "range '1-100000000' makes 100000000 seeds; expected at most 10000"),
    ("1-5000,6-5006", "range '6-5006' makes 10001 seeds; expected at most 10000"),
])
def test_seeds_errors_name_the_flag_once(capsys, seeds, message):
    rc, out, err = run(capsys, "bench", "serving", "--seeds", seeds)
    assert rc == 2 and out == ""
    assert error_line(err) == f"pkvrt bench serving: error: argument --seeds: {message}"


def test_parse_seeds_takes_up_to_the_limit():
    assert len(harness.parse_seeds(f"1-{harness.MAX_SEEDS}")) == harness.MAX_SEEDS


# --------------------------------------------------------------------------- 4. closed stdout

def test_closed_stdout_exits_quietly():
    # `pkvrt plan | head -0`: the reader is gone before pkvrt prints its first line
    proc = subprocess.Popen([sys.executable, "-m", "pkvrt", "plan", "--trace", "mixed"],
                            cwd=REPO, stdout=subprocess.PIPE, stderr=subprocess.PIPE)
    proc.stdout.close()
    err = proc.stderr.read().decode()
    proc.stderr.close()
    assert proc.wait(timeout=120) == 0, err
    assert err == ""


# --------------------------------------------------------------------------- 5. warnings

def test_cli_warnings_are_one_line(capsys):
    before = warnings.showwarning
    rc, out, err = run(capsys, "plan", "--trace", "mixed", "--num-requests", "2",
                       "--gpu", "Imaginary GPU 9000")
    assert rc == 0 and "calibration  rtx3060-seed" in out
    line = next(x for x in err.splitlines() if "imaginary" in x.lower())
    assert line.startswith("pkvrt: warning: no calibration file for device 'Imaginary GPU 9000'")
    assert "warnings.warn" not in err and "UserWarning" not in err
    assert warnings.showwarning is before         # library users keep Python's format


# --------------------------------------------------------------------------- 6. shapes

# the limits come from the kernels built (pkvrt/_buildspec.py), so the refused values do too
_PAGE = _buildspec.MAX_PAGE_SIZE
_G = max(_buildspec.GROUP_SIZES) * 2
_D = next(d for d in range(8, 1024, 8) if d not in _buildspec.HEAD_DIMS)


@pytest.mark.parametrize("argv, message", [
    (["--page-size", "3"], f"--page-size 3: expected a power of two <= {_PAGE}"),
    (["--page-size", str(2 * _PAGE)], f"--page-size {2 * _PAGE}: expected a power of two <= {_PAGE}"),
    (["--head-dim", str(_D)], f"--head-dim {_D}: expected one of {_buildspec.HEAD_DIMS}"),
    (["--num-qo-heads", "30"], "--num-qo-heads 30: expected a multiple of --num-kv-heads 8"),
    (["--num-qo-heads", str(8 * _G)], f"--num-qo-heads / --num-kv-heads = {_G}: expected a group "
                                      f"size in {_buildspec.GROUP_SIZES[0]}..{_buildspec.GROUP_SIZES[-1]}"),
])
@pytest.mark.parametrize("command", [["plan"], ["bench", "serving"]])
def test_shapes_the_runtime_refuses_are_refused(capsys, no_cuda, command, argv, message):
    rc, out, err = run(capsys, *command, "--trace", "mixed", *argv)
    assert rc == 2 and out == ""
    assert error_line(err).startswith(f"pkvrt: error: {message}")


@pytest.mark.parametrize("argv", [["--page-size", "1"], ["--page-size", "64"],
                                  ["--head-dim", "64"], ["--num-qo-heads", "8"]])
def test_shapes_the_runtime_takes_plan(capsys, argv):
    rc, out, err = run(capsys, "plan", "--trace", "mixed", "--num-requests", "2", *argv)
    assert rc == 0, err


# --------------------------------------------------------------------------- 7. progress

class _Terminal(io.StringIO):
    def isatty(self):
        return True


def test_plan_draws_progress_on_a_terminal_only(capsys, monkeypatch):
    run(capsys, "plan", "--trace", "mixed", "--num-requests", "4")
    assert "planning [" not in capsys.readouterr().err
    term = _Terminal()
    monkeypatch.setattr(sys, "stderr", term)
    assert cli.main(["plan", "--trace", "mixed", "--num-requests", "4"]) == 0
    assert "planning [" in term.getvalue() and term.getvalue().endswith(" steps\n")


# --------------------------------------------------------------------------- 8. benches, no GPU

@pytest.mark.parametrize("script", ["host_cost.py", "isolated.py"])
def test_benches_without_gpu_say_so(capsys, no_cuda, tmp_path, script):
    spec = importlib.util.spec_from_file_location(f"bench_{script[:-3]}", REPO / "benches" / script)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    assert module.main(["--out", str(tmp_path / "r.json")]) == 2
    out, err = capsys.readouterr()
    assert out == "" and not (tmp_path / "r.json").exists()
    assert err == (f"{script}: needs a CUDA GPU (torch.cuda.is_available() is False); "
                   "nothing was run\n")
