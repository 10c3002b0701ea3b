"""The command line: emit, prebuild (sources only and with a fake nvcc), cache export, and the
demo's CPU path."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

import coda_cutlass as cc

from coda_cutlass.cli import main

HERE = Path(__file__).resolve().parent


def test_emit_prints_the_kernel(capsys):
    assert main(["emit", str(HERE / "catalog.py") + ":residual_norm_stats"]) == 0
    out = capsys.readouterr().out
    assert "coda-cutlass generated kernel: residual_norm_stats" in out and "coda_run" in out


def test_emit_unknown_program(capsys):
    assert main(["emit", str(HERE / "catalog.py") + ":nope"]) == 2
    assert "no program 'nope'" in capsys.readouterr().err


def library_programs() -> int:
    import coda_cutlass.epilogues as lib
    return sum(isinstance(getattr(lib, n), cc.EpilogueProgram) for n in lib.__all__)


def test_prebuild_sources_only(tmp_path, capsys):
    assert main(["prebuild", "coda_cutlass.epilogues", "--sources-only", "--out", str(tmp_path)]) == 0
    cus = list(tmp_path.glob("*.cu"))
    assert len(cus) == library_programs() and (tmp_path / "include" / "coda" / "functors.hpp").is_file()


def test_prebuild_and_cache_export(fake_nvcc, tmp_path, capsys):
    out = tmp_path / "pre"
    assert main(["prebuild", "coda_cutlass.epilogues", "--out", str(out)]) == 0
    metas = [json.loads(p.read_text()) for p in out.glob("*.json")]
    n = library_programs()
    assert len(metas) == n and all(m["so_sha256"] for m in metas)
    exported = tmp_path / "exported"
    assert main(["cache", "--export", str(exported)]) == 0
    assert len(list(exported.glob("*.so"))) == n
    assert f"kernels: {n}" in capsys.readouterr().out


def test_demo_runs_on_cpu(fake_nvcc, capsys):
    import torch
    if torch.cuda.is_available():
        pytest.skip("with a GPU the demo runs the real kernel (tests/gpu covers it)")
    assert main(["demo"]) == 0
    text = capsys.readouterr().out
    assert "-> OK" in text and "no Hopper GPU here" in text and "all checks passed" in text
