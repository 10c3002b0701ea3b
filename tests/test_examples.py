"""examples/finetune_hf.py runs on the CPU: transformers' Trainer fine-tunes a from_hf model (the
eval loss drops), and the checkpoint it saves reloads in transformers to the same loss (the script
exits non-zero otherwise)."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parent.parent


def test_finetune_hf_example(tmp_path):
    pytest.importorskip("transformers")
    pytest.importorskip("accelerate")
    run = subprocess.run([sys.executable, str(REPO / "examples" / "finetune_hf.py"), "--steps", "3", "--seq", "32",
                          "--batch", "2", "--out", str(tmp_path)], capture_output=True, text=True, timeout=600,
                         env={**os.environ, "CUDA_VISIBLE_DEVICES": ""})
    assert run.returncode == 0, run.stdout[-2000:] + run.stderr[-2000:]
    assert "saved checkpoint reloaded by transformers" in run.stdout
    assert (tmp_path / "model" / "config.json").is_file()
