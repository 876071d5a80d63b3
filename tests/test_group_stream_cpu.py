"""benches/group_stream.py's rows are results rows ``pkvrt report`` reads (case and engine
named, numbers numeric), with the bytes-per-second the table prints."""

from __future__ import annotations

import importlib.util
import pathlib

from pkvrt.tools import report_data

ROOT = pathlib.Path(__file__).resolve().parents[1]


def load_bench():
    spec = importlib.util.spec_from_file_location("group_stream", ROOT / "benches" / "group_stream.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def test_a_point_is_a_row_the_report_reads():
    gs = load_bench()
    nbytes = 2 * 4 * 32768 * gs.H_KV * gs.D * 2
    row = gs.stream_row(4, 32768, 64, 8, 200.0, nbytes)
    report_data.validate("group-stream.json", {"meta": {"kind": "group-stream"}, "rows": [row]})
    assert (row["case"], row["engine"], row["ctas"]) == ("B4-32768 S8", "split-decode G64", 4 * 8 * 8)
    assert abs(row["tb_per_s"] - nbytes / 200.0 / 1e6) < 1e-12


def test_a_non_gpu_machine_is_told_so(capsys, monkeypatch):
    import torch

    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    assert load_bench().main([]) == 2
    assert "needs a CUDA GPU" in capsys.readouterr().err
