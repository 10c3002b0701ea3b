"""The benchmark tools that run without a GPU (bench/byte_bound.py)."""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "bench"))


def test_byte_bound_reads_block_results_without_a_gpu():
    import byte_bound
    result = {"width": "8b", "M": 8192,
              "sites": {"coda": {"qkv.dgrad": 700.0, "qkv": 646.0}, "cublas": {"qkv.dgrad": 629.0, "qkv": 636.0}},
              "sites_fwd": {"coda": {"gate_up.infer": 3030.0}, "cublas": {"gate_up": 2994.0}}}
    rows = {r["site"]: r for r in byte_bound.rows(result)}
    assert set(rows) == {"qkv.dgrad", "qkv", "gate_up.infer"}
    nb = rows["qkv.dgrad"]          # x, dres read, h written: 3 x 8192 x 4096 bf16 = 192 MiB beyond the bare GEMM
    assert 192 < nb["extra_mib"] < 194
    assert nb["unhidden"] == 1 + nb["extra_us"] / 629.0
    assert nb["hidden"] < 0         # it lost more (71 us) than its bytes take at copy bandwidth (~48 us)
    assert rows["qkv"]["hidden"] is None and rows["gate_up.infer"]["extra_mib"] < 0
    assert "| 8b | 8192 | qkv.dgrad |" in byte_bound.markdown(list(rows.values()))


def test_byte_bound_says_what_is_wrong_with_its_input(tmp_path):
    import subprocess
    script = Path(__file__).resolve().parents[1] / "bench" / "byte_bound.py"
    (tmp_path / "empty.json").write_text("")
    (tmp_path / "list.json").write_text("[1]")
    (tmp_path / "fp8.json").write_text(json.dumps({"results": [{"width": "8b", "M": 8192, "sites": {
        "cublas": {"qkv": 600.0}, "coda-fp8-tensorwise": {"qkv": 330.0}}}]}))
    for name, says in [("missing.json", "No such file"), ("empty.json", "not JSON"), ("list.json", "no 'results' list"),
                       ("fp8.json", "it reads the 'coda' variant's sites")]:
        run = subprocess.run([sys.executable, str(script), str(tmp_path / name)], capture_output=True, text=True,
                             timeout=120, env={**os.environ, "CUDA_VISIBLE_DEVICES": ""})
        assert run.returncode == 2 and says in run.stderr and "Traceback" not in run.stderr, run.stderr[-800:]


def test_model_bench_builds_its_variants_and_writes_its_report_without_a_gpu(tmp_path):
    """bench/model.py on the CPU: the eager and coda variants of its tiny config build from the same
    weights, take a training step and agree on the first loss; the table and plot are written."""
    import argparse

    import pytest
    import torch
    pytest.importorskip("transformers")
    import model as bench_model
    fields = dict(bench_model.QUICK, hidden_size=64, intermediate_size=128, head_dim=16, vocab_size=256)
    args = argparse.Namespace(seq=16, compile_mode=None, device="cpu")
    variants = bench_model.build_variants(fields, ["eager", "coda"], args)
    tokens = torch.randint(0, 256, (1, 16))
    losses = {n: float(v.step(tokens)) for n, v in variants.items()}
    assert abs(losses["eager"] - losses["coda"]) < 0.05 * losses["eager"]
    assert all(v.resident_bytes() > 0 for v in variants.values())
    row = {"ms": 10.0, "ms_all": [10.0], "tokens_per_s": 1600.0, "peak_gib": 1.0, "first_loss": 5.5}
    results = [{"config": "quick", "layers": 2, "hidden": 64, "batch": 1, "seq": 16,
                "variants": {"eager": row, "coda": dict(row, tokens_per_s=1760.0)}}]
    bench_model.markdown(results, {"gpu": "cpu", "driver": "-", "torch": torch.__version__, "cuda": None,
                                   "transformers": "5"}, tmp_path / "results.md")
    text = (tmp_path / "results.md").read_text()
    assert "coda vs eager 1.100x" in text and "| quick (2 layers, 1 x 16) |" in text


@pytest.mark.parametrize("config", ["1b", "3b", "8b"])
def test_model_bench_builds_each_shipped_configs_model_kind(config):
    """Every config's own fields (the 1B and 3B ones carry max_position_embeddings and the llama3 RoPE)
    build, at tiny widths: the thirtieth session's fields gave LlamaConfig max_position_embeddings twice
    (a TypeError before the first step on the GPU)."""
    import argparse

    import torch
    pytest.importorskip("transformers")
    import model as bench_model
    fields = dict(bench_model.CONFIGS[config], hidden_size=64, intermediate_size=128, num_hidden_layers=1,
                  num_attention_heads=4, num_key_value_heads=2, head_dim=16, vocab_size=256)
    variants = bench_model.build_variants(fields, ["coda"], argparse.Namespace(seq=16, compile_mode=None, device="cpu"))
    hf = variants["coda"].model
    assert hf.config.max_position_embeddings == bench_model.CONFIGS[config].get("max_position_embeddings", 8192)
    assert float(variants["coda"].step(torch.randint(0, 256, (1, 16)))) > 0


def test_model_bench_attention_inputs_variant_steps_like_its_base_and_is_reported_against_it(tmp_path):
    """coda@heads: the same model with SDPA handed head-major q, k, v: the same first loss as coda's
    (fp32 math on the CPU), its own column and a ratio against coda in the table."""
    import argparse

    import pytest
    import torch
    pytest.importorskip("transformers")
    import model as bench_model
    fields = dict(bench_model.QUICK, hidden_size=64, intermediate_size=128, head_dim=16, vocab_size=256)
    args = argparse.Namespace(seq=16, compile_mode=None, device="cpu")
    variants = bench_model.build_variants(fields, ["coda", "coda@heads_repeated"], args)
    assert all(b.attention.inputs == "heads_repeated" for b in variants["coda@heads_repeated"].model.coda.blocks)
    assert all(b.attention.inputs == "views" for b in variants["coda"].model.coda.blocks)
    tokens = torch.randint(0, 256, (1, 16))
    losses = {n: float(v.step(tokens)) for n, v in variants.items()}
    assert abs(losses["coda"] - losses["coda@heads_repeated"]) < 1e-2 * losses["coda"]
    row = {"ms": 10.0, "ms_all": [10.0], "tokens_per_s": 1600.0, "peak_gib": 1.0, "first_loss": 5.5}
    results = [{"config": "quick", "layers": 2, "hidden": 64, "batch": 1, "seq": 16,
                "variants": {"liger": row, "coda": row, "coda@heads_repeated": dict(row, tokens_per_s=1680.0)}}]
    bench_model.markdown(results, {"gpu": "cpu", "driver": "-", "torch": torch.__version__, "cuda": None,
                                   "transformers": "5"}, tmp_path / "results.md")
    text = (tmp_path / "results.md").read_text()
    assert "coda@heads_repeated vs coda 1.050x" in text and "coda@heads_repeated vs liger 1.050x" in text
    assert bench_model.attention_variant("coda-fp8-tensorwise@heads") == ("coda-fp8-tensorwise", "heads")
    assert bench_model.attention_variant("liger@heads") is None and bench_model.attention_variant("coda") is None


def test_model_bench_fp8_variant_builds_and_steps_without_a_gpu():
    """The opt-in FP8 rows: from_hf(..., fp8=RECIPE) of the same weights, one training step."""
    import argparse

    import pytest
    import torch
    pytest.importorskip("transformers")
    import model as bench_model
    fields = dict(bench_model.QUICK, vocab_size=512)            # FP8 widths: multiples of 128
    args = argparse.Namespace(seq=128, compile_mode=None, device="cpu")
    variants = bench_model.build_variants(fields, ["eager", "coda-fp8-tensorwise"], args)
    tokens = torch.randint(0, 512, (1, 128))
    losses = {n: float(v.step(tokens)) for n, v in variants.items()}
    assert abs(losses["eager"] - losses["coda-fp8-tensorwise"]) < 0.05 * losses["eager"], losses
    assert all(b.fp8 is not None for b in variants["coda-fp8-tensorwise"].model.coda.blocks)


def test_model_bench_plot(tmp_path):
    import pytest
    pytest.importorskip("matplotlib")
    import model as bench_model
    row = {"ms": 10.0, "ms_all": [10.0], "tokens_per_s": 1600.0, "peak_gib": 1.0, "first_loss": 5.5}
    bench_model.plot([{"config": "quick", "variants": {"eager": row, "coda": row}}], tmp_path / "results.png")
    assert (tmp_path / "results.png").stat().st_size > 0


def test_distributed_bench_runs_its_phases_over_gloo_and_writes_its_report(tmp_path, monkeypatch):
    """bench/distributed.py's processes, run here as world size 1 over gloo with the interpreter:
    the coda and plain models build (on the meta device for throughput, from one seed for the loss),
    shard, step and report; the loss curves of both start from the same weights."""
    import socket

    import distributed as bench_dist
    for key in ("MASTER_ADDR", "MASTER_PORT", "RANK", "WORLD_SIZE", "LOCAL_RANK", *bench_dist.MULTICAST_OFF):
        monkeypatch.setenv(key, os.environ.get(key, ""))
    a = bench_dist.parse(["--out", str(tmp_path), "--device", "cpu", "--gpus", "1", "--variants", "coda,eager",
                          "--batch", "1", "--seq", "16", "--steps", "1", "--warmup", "1", "--loss-steps", "3"])
    cfg = dict(vocab=256, dim=64, layers=2, heads=4, kv_heads=2, ffn=128, theta=1e4)
    res = {"config": cfg, "args": {k: str(v) if isinstance(v, Path) else v for k, v in vars(a).items()},
           "environment": bench_dist.environment("cpu")}
    for phase in ("throughput", "loss"):
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            port = s.getsockname()[1]
        bench_dist.worker(0, 1, port, phase, cfg, a, str(tmp_path / f"{phase}.json"))
        res[phase] = json.loads((tmp_path / f"{phase}.json").read_text())
    assert os.environ["NCCL_NVLS_ENABLE"] == "0" and os.environ["TORCH_SYMM_MEM_DISABLE_MULTICAST"] == "1"
    for v in ("coda", "eager"):
        assert res["throughput"][v]["tokens_per_s_per_gpu"] > 0 and len(res["throughput"][v]["steps_s"]) == 1
    coda, eager = res["loss"]["coda"]["losses"], res["loss"]["eager"]["losses"]
    # the same weights and tokens, both computing in bf16 (the policy): within bf16 error
    assert len(coda) == 3 and abs(coda[0] - eager[0]) < 2e-2 * eager[0]
    res["loss"] = {v: {"gpus": r["losses"], "one": r["losses"], "max_abs_diff": 0.0} for v, r in res["loss"].items()}
    bench_dist.markdown(res, tmp_path / "results.md")
    text = (tmp_path / "results.md").read_text()
    assert "| coda |" in text and "| eager |" in text and "coda / eager:" in text


def test_block_bench_fp8_middle_block_takes_its_gradient_quantised_as_a_stack_hands_it_over(monkeypatch):
    """bench/fp8_variants.py: the FP8 middle block's output gradient comes in FP8 with its transposed
    copy (as the next block's QKV dX epilogue writes it), so the timed backward quantises nothing of
    it; the block's backward takes exactly that operand from the stash."""
    import torch
    from coda_cutlass.nn import LlamaBlock
    from coda_cutlass.nn.fp8 import autograd
    from coda_cutlass.nn.fp8.support import first_norm_fp8
    import fp8_variants
    for recipe in ("tensorwise", "blockwise", "blockwise_g16"):
        torch.manual_seed(0)
        block = LlamaBlock(256, 2, 1, 512, head_dim=128, fp8=recipe, dtype=torch.bfloat16)
        step = block.step(1, 128)
        x = torch.randn(128, 256, dtype=torch.bfloat16, requires_grad=True)
        dy = torch.randn(128, 256, dtype=torch.bfloat16)
        with torch.no_grad():
            h, r = first_norm_fp8(step, x.detach(), block.attn_norm)
            h = block.fp8_path().quantize_input(step, h)
        dyq = fp8_variants.incoming_gradient(step, dy, block.fp8)
        assert dyq.qt.shape == (256, 128)
        taken = []
        real = autograd.stash_take
        monkeypatch.setattr(autograd, "stash_take", lambda st, t: taken.append(real(st, t)) or taken[-1])
        x2, _, _ = block.run(step, x, h, r, torch.ones(256, dtype=torch.bfloat16), next_fp8=True)
        autograd.stash_put(step, dy, dyq)
        x2.backward(dy)
        assert taken == [dyq], recipe
        assert x.grad is not None and torch.isfinite(x.grad.float()).all()
        monkeypatch.undo()


def test_block_bench_report_without_the_compile_variant():
    """bench/block.py --skip compile (FP8 rows against torchao only) writes its tables: the ratios to
    bf16 torch.compile read "-"/nan instead of the report failing after the whole run (it did)."""
    import block
    path = Path(__file__).resolve().parents[1] / "docs/results/session15/block8b_offsets/results.json"
    data = json.loads(path.read_text())
    assert "compile" not in data["results"][0]["fwd_bwd"]
    text = block.markdown(data["results"], data["environment"])
    fp8_row = next(l for l in text.splitlines() if l.startswith("| 8b | 8192 | coda-fp8-blockwise | 15.38 |"))
    assert fp8_row.split(" | ")[4:7] == ["-", "-", "1.13"]    # x compile, x torchao tensorwise, x rowwise


def test_epilogue_probe_full_checks_edit_puts_cutlass_row_reduction_back():
    """bench/probes/epilogue_outputs.py's "(full checks)" variants (the next device session's check of
    the column-checked row reductions) must find the library's node in today's sources."""
    import torch
    sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "bench" / "probes"))
    import epilogue_outputs as probe
    from coda_cutlass import epilogues as E
    from coda_cutlass.nn.runner import gemm_options
    from coda_cutlass.pipeline import generate, lower_program
    src = generate(lower_program(E.swiglu_backward_t, gemm_options(
        torch.bfloat16, "nk", (torch.float8_e4m3fn, "tensor", True)))).source
    assert src.count("coda::ColumnCheckedRowReduction<") == 3          # amax_g, amax_u, zdz
    edited = probe.EDITS["full checks"](src)
    assert "ColumnCheckedRowReduction<" not in edited.split("namespace coda_generated")[1]
    assert edited.count("fusion::Sm90ColReduction<") == 3
    assert edited.count("/*EnableNullptr=*/true, /*FinalReduction=*/false>") == 3


def test_attention_layout_probe_runs_its_variants_on_the_cpu(capsys):
    """bench/probes/attention_layouts.py --device cpu: every layout variant computes coda's gradients."""
    import torch
    sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "bench" / "probes"))
    import attention_layouts as probe
    fns = probe.variants(1, 32, 4, 2, 16, "cpu")
    ref = fns["coda (views of the QKV output)"](None)
    for name in ("separate contiguous q, k, v", "coda + copies to (B, H, S, D)",
                 "coda + copies to (B, H, S, D), k and v repeated"):
        got = fns[name](None)
        assert [tuple(g.shape) for g in got] == [tuple(g.shape) for g in ref], name
        for a, b in zip(got, ref):
            torch.testing.assert_close(a.float(), b.float(), atol=0.07, rtol=0.02, msg=name)
