"""examples/finetune_hf.py runs on the CPU: transformers' Trainer fine-tunes a from_hf model (the
eval loss drops), and the checkpoint it saves reloads in transformers to the same loss (the script
exits non-zero otherwise); examples/train_llama.py refuses bad options before it trains and does not
judge FP8 recipes on runs too short for its bar."""

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


@pytest.mark.parametrize("args,match", [
    (["--steps", "0"], "--steps and --batch must be at least 1 and --seq at least 2"),
    (["--steps", "-1"], "--steps and --batch must be at least 1 and --seq at least 2"),
    (["--seq", "0"], "--steps and --batch must be at least 1 and --seq at least 2"),
    (["--batch", "0"], "--steps and --batch must be at least 1 and --seq at least 2"),
    (["--model", "no/such/folder"], "--model no/such/folder: not a folder"),
    (["--out-is-a-file"], "exists and is not a folder"),
])
def test_finetune_hf_refuses_bad_options_before_training(tmp_path, args, match):
    pytest.importorskip("transformers")
    f = tmp_path / "a_file"
    f.write_text("x")
    out = ["--out", str(f)] if args == ["--out-is-a-file"] else ["--out", str(tmp_path / "o")] + args
    run = subprocess.run([sys.executable, str(REPO / "examples" / "finetune_hf.py"), *out], capture_output=True,
                         text=True, timeout=300, env={**os.environ, "CUDA_VISIBLE_DEVICES": ""})
    assert run.returncode == 2 and match in run.stderr, run.stderr[-1000:]
    assert not (tmp_path / "o").exists() and f.read_text() == "x"      # nothing written, the file left alone


@pytest.mark.parametrize("args,match", [
    (["--steps", "0"], "--steps and --batch must be at least 1"),
    (["--fp8", "bogus"], "invalid choice: 'bogus'"),
    (["--out-is-a-file"], "exists and is not a folder"),
    (["--fp8", "tensorwise", "--batch", "2", "--seq", "100"], "a multiple of 128 tokens (FP8 operands are quantised in 128-token blocks), got 2 x 100 = 200"),
    (["--fp8", "tensorwise", "--fp8", "blockwise", "--fp8", "tensorwise"], "--fp8 tensorwise given more than once"),
    (["--lr", "0"], "--lr must be a positive number, got 0.0"),
    (["--lr", "nan"], "--lr must be a positive number, got nan"),
    (["--device", "tpu"], "--device 'tpu' is not a torch device"),
    (["--device", "meta"], "--device meta: the example trains on cpu or cuda"),
    (["--seq", "10000000"], "--seq 10000000 is longer than the corpus allows"),
])
def test_train_llama_refuses_bad_options_before_training(tmp_path, args, match):
    f = tmp_path / "a_file"
    f.write_text("x")
    out = ["--out", str(f)] if args == ["--out-is-a-file"] else ["--out", str(tmp_path / "o")] + args
    run = subprocess.run([sys.executable, str(REPO / "examples" / "train_llama.py"), "--device", "cpu", *out],
                         capture_output=True, text=True, timeout=120, env={**os.environ, "CUDA_VISIBLE_DEVICES": ""})
    assert run.returncode == 2 and match in run.stderr, run.stderr[-1000:]
    assert not (tmp_path / "o").exists() and f.read_text() == "x"     # refused before anything is written


def test_train_llama_help_names_the_fp8_recipes():
    # --fp8's metavar hid argparse's choices: --help never said which recipes there are
    run = subprocess.run([sys.executable, str(REPO / "examples" / "train_llama.py"), "--help"], capture_output=True,
                         text=True, timeout=120, env={**os.environ, "CUDA_VISIBLE_DEVICES": ""})
    assert run.returncode == 0
    assert "blockwise, blockwise_g16, tensorwise" in " ".join(run.stdout.split()), run.stdout


def test_train_llama_short_fp8_runs_are_not_judged(tmp_path):
    run = subprocess.run([sys.executable, str(REPO / "examples" / "train_llama.py"), "--device", "cpu", "--steps", "2",
                          "--batch", "2", "--seq", "128", "--fp8", "tensorwise", "--no-torchao", "--out",
                          str(tmp_path)], capture_output=True, text=True, timeout=600,
                         env={**os.environ, "CUDA_VISIBLE_DEVICES": ""})
    assert run.returncode == 0, run.stdout[-2000:] + run.stderr[-2000:]
    assert "not judged under 200 steps" in run.stdout and (tmp_path / "loss.json").is_file()


def test_train_llama_does_not_overwrite_an_earlier_runs_results(tmp_path):
    # --out naming a folder of earlier results (the committed docs/results/.../train_1000 runs) had
    # its loss.json replaced without a word, and without matplotlib next to the old run's loss.png
    out = tmp_path / "earlier"
    out.mkdir()
    (out / "loss.json").write_text("{}")
    (out / "loss.png").write_bytes(b"png")
    cmd = [sys.executable, str(REPO / "examples" / "train_llama.py"), "--device", "cpu", "--steps", "1", "--batch",
           "2", "--seq", "64", "--out", str(out)]
    env = {**os.environ, "CUDA_VISIBLE_DEVICES": ""}
    run = subprocess.run(cmd, capture_output=True, text=True, timeout=600, env=env)
    assert run.returncode == 2 and "already holds loss.json, loss.png" in run.stderr, run.stderr[-1000:]
    assert (out / "loss.json").read_text() == "{}" and (out / "loss.png").read_bytes() == b"png"
    run = subprocess.run(cmd + ["--overwrite"], capture_output=True, text=True, timeout=600, env=env)
    assert run.returncode == 0, run.stdout[-2000:] + run.stderr[-2000:]
    assert (out / "loss.json").read_text() != "{}"
    # the plot is this run's or none: never the earlier run's beside this run's figures
    assert not (out / "loss.png").exists() or (out / "loss.png").read_bytes() != b"png"
