"""examples/prefix_sharing.py end to end on the GPU (two layers, three replays): both ways of
feeding SharedPagesRuntime match the FP32 reference, and the example prints what the GPU's
sharing rule decided (its predicted times, and the chunks kept or the plain step)."""

from __future__ import annotations

import importlib.util
import pathlib

import pytest
import torch

pytestmark = pytest.mark.gpu
if not torch.cuda.is_available():
    pytest.skip("needs a CUDA GPU", allow_module_level=True)

ROOT = pathlib.Path(__file__).resolve().parents[2]


def test_prefix_sharing_example_runs(capsys):
    spec = importlib.util.spec_from_file_location("prefix_sharing", ROOT / "examples" / "prefix_sharing.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    assert mod.main(["--layers", "2", "--steps", "3"]) == 0
    text = capsys.readouterr().out
    assert "the GPU's rule predicted" in text and text.rstrip().endswith("ok"), text
    assert ("chunks kept" in text) != ("the plain step" in text), text
