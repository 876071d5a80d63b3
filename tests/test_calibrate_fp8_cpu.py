"""`pkvrt calibrate --kv-dtype fp8` without a GPU: its arguments, refusals and the base file it
extends (the measurement itself is faked in tests/test_sweeps.py, and runs on the H200)."""

from __future__ import annotations

import argparse
import json
import pathlib

import attrs
import pytest
import torch

from pkvrt.policy import calibration as calib
from pkvrt.tools import calibrate, cli

REPO = pathlib.Path(__file__).resolve().parents[1]
H200 = REPO / "calibration" / "nvidia-h200.json"
SEED = REPO / "calibration" / "rtx3060-seed.json"
FP8 = "float8_e4m3fn"


def parse(*argv) -> argparse.Namespace:
    parser = argparse.ArgumentParser()
    calibrate.add_arguments(parser)
    return parser.parse_args(list(argv))


@pytest.fixture
def no_cuda(monkeypatch):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)


@pytest.mark.parametrize("argv, name", [((), "float16"), (("--kv-dtype", "fp16"), "float16"),
                                        (("--kv-dtype", "float16"), "float16"), (("--kv-dtype", "fp8"), FP8),
                                        (("--kv-dtype", FP8), FP8)])
def test_kv_dtype_spellings(argv, name):
    assert calibrate.check_arguments(parse(*argv)) == name


@pytest.mark.parametrize("value", ["bf16", "bfloat16", "e4m3", "int8", ""])
def test_an_unknown_kv_dtype_is_a_usage_error(value, capsys):
    with pytest.raises(SystemExit) as e:
        parse("--kv-dtype", value)
    assert e.value.code == 2 and "--kv-dtype: invalid choice" in capsys.readouterr().err


@pytest.mark.parametrize("argv, match", [
    (("--base", "x.json"), "--base: only with --kv-dtype fp8"),
    (("--kv-dtype", "fp16", "--base", "x.json"), "--base: only with --kv-dtype fp8"),
    (("--kv-dtype", "fp8", "--suggest-routes", "s.toml"), "--suggest-routes: not with --kv-dtype fp8"),
])
def test_options_that_do_not_apply_are_refused(argv, match):
    with pytest.raises(ValueError, match=match):
        calibrate.check_arguments(parse(*argv))


def test_refusals_come_before_the_gpu_check(capsys, no_cuda, tmp_path):
    rc = cli.main(["calibrate", "--kv-dtype", "fp8", "--suggest-routes", str(tmp_path / "s.toml")])
    assert rc == 2 and "pkvrt: error: --suggest-routes: not with --kv-dtype fp8" in capsys.readouterr().err
    assert calibrate.main(["--base", str(H200)]) == 2
    assert "--base: only with --kv-dtype fp8" in capsys.readouterr().err


def test_fp8_without_a_gpu_writes_nothing(capsys, no_cuda, tmp_path):
    out = tmp_path / "cal.json"
    rc = cli.main(["calibrate", "--kv-dtype", "fp8", "--quick", "--base", str(H200), "--out", str(out)])
    assert rc == 2 and "no CUDA GPU here" in capsys.readouterr().err and not out.exists()


def test_the_base_is_this_gpus_file(tmp_path):
    assert calibrate.load_base(H200, "NVIDIA H200").slug == "nvidia-h200"
    with pytest.raises(ValueError, match=r"no calibration file to add the FP8 section to; run `pkvrt calibrate`"):
        calibrate.load_base(tmp_path / "nvidia-h200.json", "NVIDIA H200")
    with pytest.raises(ValueError, match=r"the calibration of 'NVIDIA GeForce RTX 3060' \(slug 'rtx3060-seed'\), "
                                         r"not of this GPU 'NVIDIA H200' \('nvidia-h200'\)"):
        calibrate.load_base(SEED, "NVIDIA H200")
    with pytest.raises(ValueError, match="not of this GPU 'NVIDIA H100 80GB HBM3'"):
        calibrate.load_base(H200, "NVIDIA H100 80GB HBM3")
    broken = tmp_path / "broken.json"
    broken.write_text("{")
    with pytest.raises(calib.CalibrationError, match="invalid JSON"):
        calibrate.load_base(broken, "NVIDIA H200")


def test_out_and_base_default_to_the_gpus_file(tmp_path, monkeypatch):
    monkeypatch.delenv(calib.ENV_DIR, raising=False)
    assert calibrate.out_path(parse(), "nvidia-h200") == H200
    assert calibrate.out_path(parse("--out", str(tmp_path / "x.json")), "nvidia-h200") == tmp_path / "x.json"


def test_an_fp16_run_names_the_sections_it_drops(tmp_path):
    h200 = attrs.evolve(calib.load_calibration(H200), by_kv_dtype=())   # as before its FP8 run
    plain = tmp_path / "plain.json"
    calib.save_calibration(h200, plain)
    assert calibrate.replaced_sections(plain) == [] and calibrate.replaced_sections(tmp_path / "none.json") == []
    assert calibrate.replaced_sections(H200) == [FP8]   # the shipped file has its measured section
    sec = calib.KvDtypeSection(splits=(("min_split_tokens", 64),), date="2026-12-08", command="c", provenance="p")
    path = tmp_path / "with.json"
    calib.save_calibration(calib.with_kv_dtype_section(attrs.evolve(h200), FP8, sec), path)
    assert calibrate.replaced_sections(path) == [FP8]
    assert "by_kv_dtype" in json.loads(path.read_text())
