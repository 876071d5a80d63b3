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
    assert calibrate.replaced_sections(H200) == [f"by_kv_dtype.{FP8}"]   # the shipped file's measured section
    sec = calib.KvDtypeSection(splits=(("min_split_tokens", 64),), date="2026-12-08", command="c", provenance="p")
    path = tmp_path / "with.json"
    calib.save_calibration(calib.with_kv_dtype_section(attrs.evolve(h200), FP8, sec), path)
    assert calibrate.replaced_sections(path) == [f"by_kv_dtype.{FP8}"]
    assert "by_kv_dtype" in json.loads(path.read_text())


# --------------------------------------------------------------------------- head-dim sections

def test_head_dim_arguments_and_their_refusals():
    """--head-dim D: one of the kernels' other head dims; not with FP8, --host-time or
    --suggest-routes (it times no FlashInfer path); an fp16 run names the head-dim sections it
    drops."""
    import argparse
    parser = argparse.ArgumentParser()
    calibrate.add_arguments(parser)
    assert calibrate.check_arguments(parser.parse_args(["--head-dim", "256"])) == "float16"
    with pytest.raises(SystemExit):
        parser.parse_args(["--head-dim", "128"])          # the file's own head dim: a plain run
    for argv, match in ((["--head-dim", "64", "--kv-dtype", "fp8"], "--head-dim: not with --kv-dtype fp8"),
                        (["--head-dim", "64", "--host-time"], "--head-dim: not with --host-time"),
                        (["--head-dim", "96", "--suggest-routes", "x.toml"], "--suggest-routes: not with --head-dim")):
        with pytest.raises(ValueError, match=match):
            calibrate.check_arguments(parser.parse_args(argv))


def test_a_head_dim_runs_max_waves_is_given_or_kept_from_the_section():
    """--max-waves wins; without it, a max_waves set by hand in the file's section of that head
    dim is kept (not dropped for the top level's), and a head dim without one inherits."""
    h100 = calib.load_calibration(REPO / "calibration" / "nvidia-h100-80gb-hbm3.json")
    assert h100.splits.max_waves == 3 and calibrate.section_max_waves(h100, 256) == 2
    assert h100.for_head_dim(256).splits.max_waves == 2
    assert calibrate.section_max_waves(h100, 64) is None
    assert calibrate.section_max_waves(calib.load_calibration(H200), 256) is None
    sec = calibrate.head_dim_section({4: {"min_split_tokens": 256}}, 1.0,
                                     calibrate.section_max_waves(h100, 256), provenance="test")
    assert dict(sec.splits)["max_waves"] == 2
    assert "max_waves" not in dict(calibrate.head_dim_section({4: {}}, 1.0, None, provenance="t").splits)


def test_a_head_dim_section_holds_the_fitted_points_and_round_trips(tmp_path):
    """G 4's points at the section's top level with the bucket constant, the other G's in
    by_group (group keys only); written into this GPU's file, read back, and seen by a Router of
    that head dim; a later fp16 run says it drops it."""
    from pkvrt.policy.registry import load_routes
    from pkvrt.policy.router import Router

    points = {4: {"workqueue_ctas_per_sm": 1.0, "co_resident_slowdown": 1.3, "cta_overhead_tiles": 3.0,
                  "min_split_tokens": 256},
              8: {"workqueue_ctas_per_sm": 1.0, "co_resident_slowdown": 1.2, "cta_overhead_tiles": 5.0,
                  "min_split_tokens": 512}}
    sec = calibrate.head_dim_section(points, 9.87654, None, provenance="test")
    assert dict(sec.splits) == {"bucket_ctas_per_sm": 9.877, **points[4]}
    assert dict(dict(sec.splits_by_group)[8]) == points[8]
    path = tmp_path / "h200.json"
    calib.save_calibration(calib.with_head_dim_section(calib.load_calibration(H200), 256, sec), path)
    back = calib.load_calibration(path)
    assert dict(back.by_head_dim)[256] == sec
    reg = load_routes()
    r = Router(reg, back, num_qo_heads=16, num_kv_heads=8, head_dim=256, page_size=16)
    assert (r.cal.splits.cta_overhead_tiles, r.cal.splits.min_split_tokens) == (3.0, 256)
    r8 = Router(reg, back, num_qo_heads=64, num_kv_heads=8, head_dim=256, page_size=16)
    assert r8.cal.splits.cta_overhead_tiles == 5.0
    assert Router(reg, back, num_qo_heads=16, num_kv_heads=8, head_dim=128, page_size=16).cal.splits == \
        calib.load_calibration(H200).for_group(2).splits   # D 128: the file's own G 2 constants
    assert "by_head_dim.256" in calibrate.replaced_sections(path)


def test_models_of_another_head_dim_are_refused_with_head_dim():
    import argparse
    parser = argparse.ArgumentParser()
    calibrate.add_arguments(parser)
    with pytest.raises(ValueError, match=r"--models: llama-3.1-8b \(D 128\): not of --head-dim 256"):
        calibrate.check_arguments(parser.parse_args(["--head-dim", "256", "--models", "gemma-2-9b,llama-3.1-8b"]))
    args = parser.parse_args(["--head-dim", "256", "--models", "gemma-2-9b", "--groups", "4"])
    calibrate.check_arguments(args)
    assert args.groups == (4, 2)
