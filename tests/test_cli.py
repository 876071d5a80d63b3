"""The pkvrt command line, run in-process: `routes`, `doctor`, error handling, lazy commands."""

from __future__ import annotations

import pathlib
import subprocess
import sys
import textwrap

import pytest

from pkvrt.policy.registry import load_routes
from pkvrt.tools import cli, doctor

REPO = pathlib.Path(__file__).resolve().parents[1]
SHIPPED = REPO / "routes.toml"


def run(capsys, *argv):
    rc = cli.main(list(argv))
    out, err = capsys.readouterr()
    return rc, out, err


def table_rows(out: str) -> dict[str, str]:
    """First table of `pkvrt routes` output: route name -> its whole line."""
    return {line.split()[0]: line for line in out.split("\n\n")[0].splitlines()[1:]}


def test_routes_table(capsys):
    rc, out, err = run(capsys, "routes")
    reg = load_routes(SHIPPED)
    assert rc == 0 and err == ""
    rows = table_rows(out)
    assert list(rows) == [r.name for r in reg.routes]
    assert rows["flashinfer"].split()[1:4] == ["flashinfer", "-", "baseline"]
    assert rows["pkv_bucket"].split()[:4] == ["pkv_bucket", "bucket", "split_decode", "enabled"]
    assert "4..64 step 4" in rows["pkv_bucket"] and "1.05" in rows["pkv_bucket"]
    assert "1, 4..64 step 4" in rows["pkv_workqueue"]
    assert "1..64 " in rows["pkv_fused"] and "step" not in rows["pkv_fused"]
    assert "ablation" in rows["pkv_fused"] and "ablation" not in rows["pkv_workqueue"]
    assert "at exactly 4 active rows PersistentKV needs margin >= 1.50" in out
    assert f"file: {reg.path}" in out and f"sha256: {reg.sha256}" in out
    # aligned: every column starts at the same offset on every line of the table
    lines = out.split("\n\n")[0].splitlines()
    kind_col = lines[0].index("kind")
    assert all(line[kind_col - 2: kind_col] == "  " and line[kind_col] != " " for line in lines)


def test_routes_say_what_device_planning_runs(capsys, tmp_path):
    # pkv_fused is an ablation of the host router, but device planning runs it on every step of
    # more than [device_planning] small_rows rows below large_group: the table says both
    rc, out, _ = run(capsys, "routes")
    reg = load_routes(SHIPPED)
    header = out.splitlines()[0]
    col = header.index("device planning")
    role = {name: line[col:header.index("groups")].strip() for name, line in table_rows(out).items()}
    main = reg.device_planning_route().name
    rows, small = reg.device_small
    g, large = reg.device_large_group
    assert small == large == "pkv_workqueue"
    w = reg.device_large_group_min_window
    assert role[main] == f"G < {g} or a window < {w} tokens, rows > {rows}"
    assert role[small] == f"rows <= {rows}; G >= {g}, no window < {w} tokens, rows > {rows}"
    assert role["pkv_bucket"] == role["flashinfer"] == "-"
    assert "device planning (lengths on the GPU) and engine-captured steps run" in out
    assert "ablation: the host router never picks the route on its own" in out
    assert "runs only when forced" not in out
    # without small_rows / small_route and large_group / large_group_route: one route on every step
    p = tmp_path / "r.toml"
    p.write_text(SHIPPED.read_text().replace("small_rows = 1", "").replace(
        'small_route = "pkv_workqueue"', "").replace("large_group = 5", "").replace(
        'large_group_route = "pkv_workqueue"', "").replace("large_group_min_window = 512", ""))
    rc, out, _ = run(capsys, "routes", "--routes", str(p))
    assert rc == 0 and "every step" in table_rows(out)[main]


def test_routes_follow_the_file(capsys, tmp_path):
    p = tmp_path / "r.toml"
    p.write_text(SHIPPED.read_text().replace("max_active = 8", "max_active = 12")
                 .replace("allow = false", "allow = true"))
    rc, out, _ = run(capsys, "routes", "--routes", str(p))
    assert rc == 0
    assert "1..12" in table_rows(out)["pkv_workqueue"]
    assert "allow = true" in out and f"file: {p}" in out


@pytest.mark.parametrize("step, route, margin, verdict", [
    (("8", "32768", "4"), "pkv_workqueue", "1.05", "eligible"),
    (("8", "32768", "4"), "pkv_fused", "1.05",
     "eligible (ablation: the host router runs it only when forced); "
     "device planning runs it at 8 rows (no gates there)"),
    (("1", "32768", "4"), "pkv_workqueue", "1.05",
     "eligible; device planning runs it at 1 row (no gates there)"),
    (("1", "32768", "4"), "pkv_fused", "1.05",
     "eligible (ablation: the host router runs it only when forced)"),
    (("4", "32768", "4"), "pkv_bucket", "1.50 (boundary)", "eligible"),
    (("8", "32768", "8"), "pkv_bucket", "1.05",
     "refused: group size 8 is not calibrated (gates.group_sizes = [4])"),
    (("2", "8192", "1"), "pkv_workqueue", "1.05",
     "refused: group size 1 is not calibrated (gates.group_sizes = [4]); "
     "longest context 8192 tokens is below gates.min_context = 16384"),
    (("16", "65536", "4"), "pkv_workqueue", "1.05",
     "refused: active count 16 is above gates.max_active = 8"),
    (("8", "32768", "8"), "flashinfer", "-", "baseline (always eligible)"),
    (("8", "32768", "8"), "pkv_fused", "1.05",
     "refused: group size 8 is not calibrated (gates.group_sizes = [4])"),
    (("8", "32768", "8"), "pkv_workqueue", "1.05",   # G >= [device_planning] large_group
     "refused: group size 8 is not calibrated (gates.group_sizes = [4]); "
     "device planning runs it at 8 rows (no gates there)"),
])
def test_routes_explain_one_step(capsys, step, route, margin, verdict):
    active, context, group = step
    rc, out, _ = run(capsys, "routes", "--active", active, "--context", context, "--group", group)
    assert rc == 0
    explain = out.split("\n\n")[-1].splitlines()
    assert explain[0] == (f"step: {active} active rows, longest context {context} tokens, "
                          f"group size {group}")
    header = explain[1]
    line = next(x for x in explain[2:] if x.split()[0] == route)
    assert line[header.index("margin"):header.index("verdict")].strip() == margin
    assert line[header.index("verdict"):] == verdict


def test_explain_needs_all_three_flags(capsys):
    rc, out, err = run(capsys, "routes", "--active", "4", "--group", "8")
    assert rc == 2 and out == ""
    assert err == "pkvrt: error: routes: --active, --context and --group go together; " \
                  "got only --active, --group\n"


@pytest.mark.parametrize("argv", [["routes", "--active", "0", "--context", "1", "--group", "4"],
                                  ["routes", "--group", "four"], ["no-such-command"], []])
def test_usage_errors_exit_2(capsys, argv):
    rc, _, err = run(capsys, *argv)
    assert rc == 2 and "usage: pkvrt" in err


def test_help_exits_0(capsys):
    rc, out, _ = run(capsys, "--help")
    assert rc == 0 and "routes" in out and "doctor" in out


@pytest.mark.parametrize("text, needle", [
    ("[gates\n", "TOML syntax error at line 1"),
    (SHIPPED.read_text().replace("min_context = 16384", "min_context = true"),
     "[gates] min_context: true is not an integer"),
])
def test_malformed_routes_file_is_one_line_on_stderr(capsys, tmp_path, text, needle):
    p = tmp_path / "routes.toml"
    p.write_text(text)
    rc, out, err = run(capsys, "routes", "--routes", str(p))
    assert rc == 2 and out == ""
    assert err.startswith(f"pkvrt: error: {p}: ") and needle in err
    assert err.count("\n") == 1 and "Traceback" not in err


def test_missing_routes_file(capsys, tmp_path):
    rc, _, err = run(capsys, "routes", "--routes", str(tmp_path / "absent.toml"))
    assert rc == 2 and "absent.toml: file not found" in err and "Traceback" not in err


def test_traceback_flag_reraises(tmp_path):
    p = tmp_path / "routes.toml"
    p.write_text("[gates\n")
    with pytest.raises(ValueError, match="TOML syntax error"):
        cli.main(["--traceback", "routes", "--routes", str(p)])


# ---- commands from other modules ------------------------------------------------------------

FAKE = '''
"""A fake command for the CLI tests."""
def add_arguments(parser):
    parser.add_argument("--fail", choices=["value", "os", "type"])
def run(args):
    if args.fail == "value":
        raise ValueError("bad trace file t.csv: line 3")
    if args.fail == "os":
        raise FileNotFoundError(2, "No such file or directory", "t.csv")
    if args.fail == "type":
        raise TypeError("a bug")
    print("fake ran")
    return 0
'''


@pytest.fixture
def fake_modules(tmp_path, monkeypatch):
    (tmp_path / "pkvrt_test_fake_cmd.py").write_text(textwrap.dedent(FAKE))
    (tmp_path / "pkvrt_test_broken_cmd.py").write_text("import pkvrt_test_no_such_dependency\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    monkeypatch.setattr(cli, "COMMANDS", {**cli.COMMANDS, "fake": "pkvrt_test_fake_cmd",
                                         "ghost": "pkvrt_test_no_such_module"})


def test_other_commands_are_wired_and_missing_ones_left_out(capsys, fake_modules):
    parser = cli.build_parser()
    choices = parser._subparsers._group_actions[0].choices
    assert "fake" in choices and "ghost" not in choices
    assert choices["fake"].description == "A fake command for the CLI tests."
    rc, out, _ = run(capsys, "fake")
    assert rc == 0 and out == "fake ran\n"


@pytest.mark.parametrize("mode, message", [
    ("value", "pkvrt: error: bad trace file t.csv: line 3\n"),
    ("os", "pkvrt: error: [Errno 2] No such file or directory: 't.csv'\n"),
])
def test_command_errors_exit_2(capsys, fake_modules, mode, message):
    rc, _, err = run(capsys, "fake", "--fail", mode)
    assert rc == 2 and err == message


def test_bugs_are_not_swallowed(fake_modules):
    with pytest.raises(TypeError, match="a bug"):
        cli.main(["fake", "--fail", "type"])


def test_a_broken_import_inside_a_command_module_propagates(fake_modules, monkeypatch):
    monkeypatch.setattr(cli, "COMMANDS", {**cli.COMMANDS, "broken": "pkvrt_test_broken_cmd"})
    with pytest.raises(ModuleNotFoundError) as info:
        cli.build_parser()
    assert info.value.name == "pkvrt_test_no_such_dependency"


@pytest.mark.slow
def test_python_dash_m(tmp_path):
    proc = subprocess.run([sys.executable, "-m", "pkvrt", "routes"], cwd=REPO,
                          capture_output=True, text=True, timeout=300,
                          env={"PYTHONPATH": str(REPO), "PATH": "/usr/bin:/bin"})
    assert proc.returncode == 0, proc.stderr
    assert "pkv_workqueue" in proc.stdout and "sha256:" in proc.stdout


# ---- doctor ---------------------------------------------------------------------------------

def _no_gpu():
    import torch
    return not torch.cuda.is_available()


@pytest.mark.skipif(not _no_gpu(), reason="this machine has a CUDA GPU")
def test_doctor_without_gpu(capsys):
    rc, out, err = run(capsys, "doctor")
    assert rc == 0, out
    rows = dict(line.split(None, 1) for line in out.splitlines() if line and line[0] != " ")
    assert rows["gpu"] == doctor.NO_GPU
    assert rows["python"].startswith(f"{sys.version_info.major}.{sys.version_info.minor}.")
    import torch
    assert rows["torch"].startswith(torch.__version__)
    reg = load_routes(SHIPPED)
    assert rows["routes.toml"] == f"{reg.path} (sha256 {reg.sha256})"
    for key in ("cuda-python", "kernels", "flashinfer", "calibration"):
        assert key in rows
    assert "PROBLEM" not in out


def test_doctor_calibration_line_without_gpu(capsys, monkeypatch):
    import torch
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    rc, out, err = run(capsys, "doctor")
    line = next(x for x in out.splitlines() if x.startswith("calibration"))
    assert "for no CUDA device" not in line and "fallback" not in line and err == ""
    assert line.split(None, 1)[1].startswith(
        "no CUDA device: the calibration is chosen per GPU at run time")
    assert ("shipped files: nvidia-h100-80gb-hbm3 (NVIDIA H100 80GB HBM3), nvidia-h200 (NVIDIA H200), "
            "rtx3060-seed (NVIDIA GeForce RTX 3060)") in line


def test_doctor_reports_a_malformed_shipped_calibration(capsys, monkeypatch, tmp_path):
    import torch
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    (tmp_path / "broken.json").write_text("{")
    monkeypatch.setenv("PKVRT_CALIBRATION_DIR", str(tmp_path))
    rc, out, _ = run(capsys, "doctor")
    line = next(x for x in out.splitlines() if x.startswith("calibration"))
    assert rc == 1 and "PROBLEM" in line and "broken.json" in line


def test_doctor_reports_a_bad_routes_file(capsys, tmp_path):
    p = tmp_path / "routes.toml"
    p.write_text("[gates\n")
    rc, out, _ = run(capsys, "doctor", "--routes", str(p))
    assert rc == 1
    assert f"PROBLEM: {p}: [gates] (table header): TOML syntax error at line 1" in out
    count, names = out.rstrip().splitlines()[-1].split(" problem(s): ")
    assert "routes.toml" in names.split(", ")  # a GPU machine may list others too
    assert int(count) == out.count("PROBLEM: ")


def test_doctor_does_not_import_cuda_bindings():
    # torch may import cuda.bindings on its own, so check what doctor.py itself imports
    import ast
    tree = ast.parse(pathlib.Path(doctor.__file__).read_text())
    names = [a.name for n in ast.walk(tree) if isinstance(n, ast.Import) for a in n.names]
    names += [n.module for n in ast.walk(tree) if isinstance(n, ast.ImportFrom)]
    names += [n.args[0].value for n in ast.walk(tree) if isinstance(n, ast.Call)
              and getattr(n.func, "attr", "") == "import_module"]
    assert "pkvrt.launch.manifest" in names and "flashinfer" in names  # the walk sees lazy imports
    assert not [m for m in names if m and (m == "cuda" or m.startswith("cuda."))]
