"""``pkvrt report``'s table of a real checkpoint generating text (examples/smollm2_generate.py's
results, ``kind: generate``, or rows of decoders in a file written before the example named its
kind): tokens/s against FlashInfer's decoder of the same file, agreement with SDPA and each first
divergence with both margins; a decoder row without its name is refused, naming the file."""

from __future__ import annotations

import json

import pytest

from pkvrt.measure import coverage_results
from pkvrt.tools import report
from pkvrt.tools.report_data import file_kind


def _row(decoder, rate, equal, divs=()):
    return {"decoder": decoder, "cuda_graph": True, "batch": 8, "tokens_per_prompt": 64,
            "decode_tokens_per_s": rate, "decode_tokens_per_s_runs": [rate], "equal_to_sdpa": equal,
            "divergences_vs_sdpa": list(divs), "runs_agree": True, "tokens": [[1, 2]]}


def _write(tmp_path, name, rows, **meta):
    meta = {"gpu": "NVIDIA H200", "date": "2026-12-05T12:00:00+00:00", "pkvrt_commit": "abc1234",
            "model": "SmolLM2-135M-Instruct", **meta}
    (tmp_path / name).write_text(json.dumps({"meta": meta, "rows": rows}))


ROWS = [_row("pkvrt", 2500.0, 7, [{"prompt": 6, "steps_compared": 64, "first_divergence": 1,
                                    "ref_margin": 0.0, "got_margin": 0.015625}]),
        _row("flashinfer-tc", 2000.0, 8)]


@pytest.mark.parametrize("meta", [dict(kind="generate"), dict()])
def test_generation_rows_become_their_own_table(tmp_path, meta):
    _write(tmp_path, "gen.json", ROWS, **meta)
    files = report.load_dir(tmp_path)
    assert file_kind(files[0][1]) == "generate"
    table = coverage_results.generate_table(files)
    pk = next(line for line in table.splitlines() if line.startswith("| pkvrt "))
    cells = [c.strip() for c in pk.strip("|").split("|")]
    assert cells[4:7] == ["2500", "1.250", "7/8"]
    assert cells[7] == "prompt 6 at step 1: 0.000 / 0.016"
    fi = next(line for line in table.splitlines() if line.startswith("| flashinfer-tc "))
    assert fi.rstrip().endswith("| 8/8 | none |")
    md, _ = report.build_report(files, tmp_path / "out", plots=False)
    assert "## A real checkpoint generating text" in md and pk in md
    assert "gen.json | generate |" not in md.split("## Other results")[-1].split("## Results files")[0]


def test_other_files_are_not_taken_for_generation(tmp_path):
    _write(tmp_path, "plain.json", [{"rows": 1, "tokens": 2}])
    files = report.load_dir(tmp_path)
    assert file_kind(files[0][1]) == "generic"
    assert coverage_results.generate_table(files) == ""


def test_a_generation_row_without_its_decoder_is_refused(tmp_path):
    rows = [dict(ROWS[0]), dict(ROWS[1])]
    rows[1]["decoder"] = ""
    _write(tmp_path, "bad.json", rows, kind="generate")
    with pytest.raises(ValueError, match=r"bad\.json.*decoder"):
        report.load_dir(tmp_path)
