"""`pkvrt calibrate --kv-dtype fp8` on a GPU (run on the H200): a quick FP8 run adds its section
to a base file of this GPU and changes nothing else; the section reaches an FP8 view."""

from __future__ import annotations

import json

import attrs
import pytest
import torch

from pkvrt.policy import calibration
from pkvrt.tools import cli, report
from pkvrt.tools.plan_cmd import seed_calibration

pytestmark = [pytest.mark.gpu, pytest.mark.serial]   # a calibration measures time
FP8 = "float8_e4m3fn"


def test_calibrate_fp8_quick_adds_a_section_to_this_gpus_file(capsys, tmp_path):
    props = torch.cuda.get_device_properties(0)
    base = attrs.evolve(seed_calibration(), gpu=props.name, slug=calibration.slugify(props.name),
                        sm_count=props.multi_processor_count,
                        l2_bytes=props.L2_cache_size)   # this GPU's file, seed numbers
    base_path, out, raw = tmp_path / "base.json", tmp_path / "cal.json", tmp_path / "raw" / "sweeps.json"
    calibration.save_calibration(base, base_path)
    rc = cli.main(["calibrate", "--kv-dtype", "fp8", "--quick", "--groups", "4", "--base", str(base_path),
                   "--out", str(out), "--raw", str(raw)])
    text, err = capsys.readouterr()
    assert rc == 0, text + err
    cal = calibration.load_calibration(out)
    doc = calibration.calibration_to_dict(cal)
    sec = doc.pop("by_kv_dtype")[FP8]
    assert doc == calibration.calibration_to_dict(base)                 # the rest as it was
    # the fitted partition constants, and the room charge's keys where its fit found one (a
    # zero charge is omitted: calibration._UNSET_OMITTED)
    required = {"bucket_ctas_per_sm", "workqueue_ctas_per_sm", "min_split_tokens",
                "cta_overhead_tiles", "co_resident_slowdown"}
    room = {"wave_room_slots", "wave_room_tiles", "wave_room_chunk_tiles"}
    assert required <= set(sec["splits"]) <= required | room, sorted(sec["splits"])
    assert all(sec["splits"][k] >= 0 for k in room & set(sec["splits"]))
    assert set(sec["time_model"]) <= {"bucket", "workqueue", "fused"} and "fused" in sec["time_model"]
    view = cal.for_kv_dtype(torch.float8_e4m3fn)
    assert not view.kv_dtype_fallback and view.splits.min_split_tokens == sec["splits"]["min_split_tokens"]
    meta = json.loads(raw.read_text())["meta"]
    assert meta["kv_dtype"] == FP8 and set(meta["occupancy"]) == {"4"}
    assert report.load_dir(raw.parent)
    assert f"wrote {out} (its by_kv_dtype.{FP8} section" in text
